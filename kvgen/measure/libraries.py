"""A registry's verified artifact of one op, found through the runtime lookup."""

from __future__ import annotations

from pathlib import Path

from kvgen.runtime.lookup import Resolved, RuntimeRegistry

OPS = ("codec", "compact", "score")


def registry_artifact(registry: Path, family: str, arch: str, op: str) -> Path:
    """The sha256-verified artifact serving ``op`` of ``family`` in ``registry`` alone (a measurement
    names the registry under test: no ``$KVGEN_REGISTRY``, no installed wheel). A missing family is a
    ``RegistryError`` naming the build command."""
    return op_artifact(RuntimeRegistry([registry]).resolve(family, arch), op)


def op_artifact(resolved: Resolved, op: str) -> Path:
    """The artifact of ``op`` in a resolved entry (the family library serves codec and compact)."""
    if op not in OPS:
        raise ValueError(f"op: expected one of {', '.join(OPS)}, got {op!r}")
    # becomes resolved.artifact(op) once the lookup states every op's artifact itself
    return resolved.score_library() if op == "score" else resolved.artifact
