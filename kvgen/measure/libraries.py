"""A registry's verified artifacts of one op, found through the runtime lookup."""

from __future__ import annotations

from pathlib import Path

from kvgen.artifacts.dispatch import DispatchFiles
from kvgen.runtime.lookup import RuntimeRegistry


def registry_artifact(registry: Path, family: str, arch: str, op: str) -> Path:
    """The sha256-verified artifact serving ``op`` of ``family`` in ``registry`` alone (a measurement
    names the registry under test: no ``$KVGEN_REGISTRY``, no installed wheel). A missing family is a
    ``RegistryError`` naming the build command."""
    return RuntimeRegistry([registry]).resolve(family, arch).artifact(op)


def registry_dispatch(registry: Path, family: str, arch: str, op: str) -> DispatchFiles:
    """``op``'s verified main artifact and its size-dispatched variants as ``(from_work, file)``
    (``Resolved.dispatch``), from ``registry`` alone."""
    return RuntimeRegistry([registry]).resolve(family, arch).dispatch(op)
