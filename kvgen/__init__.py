"""kvgen: a compiler-style kernel generator and autotuner for KV-cache compression.

``load_spec``, ``FamilySpec`` and ``SpecError`` load lazily: the run-time side (``kvgen.runtime``)
must import on machines without the build-time dependencies (pydantic).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

__all__ = ["FamilySpec", "SpecError", "__version__", "load_spec"]

if TYPE_CHECKING:
    from kvgen.spec.schema import FamilySpec, SpecError, load_spec


def __getattr__(name: str) -> Any:
    if name in ("FamilySpec", "SpecError", "load_spec"):
        from kvgen import spec

        return getattr(spec, name)
    raise AttributeError(f"module 'kvgen' has no attribute {name!r}")
