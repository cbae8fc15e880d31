"""Import a generated Triton module (the packer, the selection) from its file, once per path.

The file is a registry artifact whose sha256 ``Resolved.artifact`` has already checked, or a
``generated/<family>/`` file of a checkout. It is executed as a fresh module under a name derived
from its path, so two families' modules never share state; Triton decides JIT or interpreter at
import time (``TRITON_INTERPRET``).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
from pathlib import Path
from types import ModuleType


def import_generated_module(path: str | Path, kind: str, required: tuple[str, ...],
                            error: type[Exception]) -> ModuleType:
    """Execute ``path`` as a fresh module; ``error`` names the file when it is missing or lacks one
    of ``required`` (then it is not a generated ``kind`` module)."""
    path = Path(path).resolve()
    if not path.is_file():
        raise error(f"{path}: no generated {kind} module; build it with: kvgen build")
    name = f"kvgen_{kind}_" + hashlib.sha256(str(path).encode()).hexdigest()[:16]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    missing = [attr for attr in required if not hasattr(module, attr)]
    if missing:
        raise error(f"{path}: not a kvgen {kind} module (missing {', '.join(missing)})")
    return module


@functools.lru_cache(maxsize=None)
def _cached(path: str, kind: str, required: tuple[str, ...], error: type[Exception]) -> ModuleType:
    return import_generated_module(path, kind, required, error)


def load_generated_module(path: str | Path, kind: str, required: tuple[str, ...],
                          error: type[Exception]) -> ModuleType:
    """``import_generated_module`` once per process and resolved path."""
    return _cached(str(Path(path).resolve()), kind, required, error)
