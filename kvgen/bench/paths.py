"""Where the benchmarks find specs, generated sources, registries and tuning records (no torch here).

The project root is the current directory when it holds ``specs/`` (a checkout; the GPU machine's
copy), else the checkout this package lives in; ``$KVGEN_SPECS_DIR`` or ``kvgen --specs`` overrides
the spec directory.
"""

from __future__ import annotations

import os
from pathlib import Path

PACKAGE_ROOT = Path(__file__).resolve().parents[2]


def project_root() -> Path:
    cwd = Path.cwd()
    return cwd if (cwd / "specs").is_dir() else PACKAGE_ROOT


ROOT = project_root()
_specs_dir: Path | None = None


def set_specs_dir(path: Path | None) -> None:
    """The spec directory of this process (``kvgen --specs``); None: the default rule."""
    global _specs_dir
    _specs_dir = Path(path) if path is not None else None


def specs_dir() -> Path:
    return _specs_dir or Path(os.environ.get("KVGEN_SPECS_DIR") or ROOT / "specs")


def spec_path(family: str) -> Path:
    return specs_dir() / f"{family}.yaml"
