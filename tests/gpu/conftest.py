"""GPU test fixtures: the sm_90a registry built on the build machine and carried to the GPU."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvgen.artifacts.manifest import manifest_path, read_manifest, verify_op
from kvgen.lower.layout import family_layout
from kvgen.spec.schema import load_spec

from ..conftest import ROOT, SPECS_DIR

REGISTRY = Path(os.environ.get("KVGEN_REGISTRY", ROOT / "build" / "registry"))
ARCH = os.environ.get("KVGEN_TEST_ARCH", "sm_90a")


def library_path(family: str) -> Path:
    """The verified codec library of a family, or a skip naming the build command that makes it."""
    path = manifest_path(REGISTRY, ARCH)
    if not path.exists():
        pytest.skip(f"no registry at {path}; run: kvgen build --arch {ARCH}")
    manifest = read_manifest(path, verify=False)
    entry = manifest.family(family)
    if entry is None:
        pytest.skip(f"{family} not in {path}; run: kvgen build --arch {ARCH} --family {family}")
    return verify_op(path, manifest, entry, "codec")


def spec_and_layout(family: str):
    spec = load_spec(SPECS_DIR / f"{family}.yaml")
    return spec, family_layout(spec)
