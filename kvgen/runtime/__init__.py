"""Run-time side of kvgen: load generated family libraries through their C ABI and drive them
with torch tensors. Importing this package creates no files, needs no compiler and no build-time
dependency (pydantic): registries carry the layouts the runtime needs, and every op's artifact is
looked up through ``RuntimeRegistry.resolve(...).artifact(op)``."""

from kvgen.runtime.codec import (
    ColdPageCodec,
    cold_decode,
    cold_encode,
    cold_offload,
    cold_onboard,
    pool_descriptors,
    register_codec,
    register_ops,
)
from kvgen.runtime.compact import CompactLibrary, Compactor
from kvgen.runtime.library import FamilyLibrary, LibraryError
from kvgen.runtime.lookup import (
    RegistryLayout,
    RegistrySource,
    Resolved,
    RuntimeRegistry,
    check_spec,
    codec_from_registry,
    installed_sources,
)
from kvgen.runtime.pack import MovePacker, PackModuleError, load_pack_module

__all__ = [
    "ColdPageCodec", "CompactLibrary", "Compactor", "FamilyLibrary", "LibraryError", "MovePacker",
    "PackModuleError", "load_pack_module", "RegistryLayout", "RegistrySource", "Resolved",
    "RuntimeRegistry", "check_spec", "codec_from_registry", "cold_decode", "cold_encode", "cold_offload", "cold_onboard",
    "installed_sources",
    "pool_descriptors", "register_codec", "register_ops",
]
