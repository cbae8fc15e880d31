"""Run-time side of kvgen: load generated family libraries through their C ABI and drive them
with torch tensors. Importing this package creates no files and needs no compiler."""

from .codec import ColdPageCodec, pool_descriptors
from .library import FamilyLibrary, LibraryError

__all__ = ["ColdPageCodec", "FamilyLibrary", "LibraryError", "pool_descriptors"]

from .registry import (RegistryLayout, RegistrySource, Resolved, RuntimeRegistry, check_spec, codec_from_registry,
                       installed_sources, register_codec)

__all__ += ["RegistryLayout", "RegistrySource", "Resolved", "RuntimeRegistry", "check_spec", "codec_from_registry",
            "installed_sources", "register_codec"]
