"""kvgen: a compiler-style kernel generator and autotuner for KV-cache compression."""

from .spec import FamilySpec, SpecError, load_spec

__version__ = "0.1.0"

__all__ = ["FamilySpec", "SpecError", "__version__", "load_spec"]
