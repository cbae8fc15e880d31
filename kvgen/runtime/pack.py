"""The generated Triton move packer of a family, loaded from its file: the registry's ``pack``
artifact (``RuntimeRegistry.resolve(family, arch).artifact("pack")``, sha256-verified), which a
kernel wheel ships too.

The generated module needs only torch, Triton and ``kvgen.kernels.triton``; it carries the
family's layers, KV heads and windows, so nothing here reads a spec. Triton compiles its kernels
on the GPU at the first call. ``load_pack_module`` imports a file once per path;
``MovePacker`` calls its ``pack_moves`` (signature of ``kvgen.reference.triattention.pack_moves``
without the geometry, plus ``capacity`` for graph capture).
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import torch

from kvgen.runtime.generated_module import import_generated_module, load_generated_module

REQUIRED = ("FAMILY", "NUM_LAYERS", "KV_HEADS", "SWA_WINDOW", "pack_moves")


class PackModuleError(RuntimeError):
    """A file that is not a generated packer; the message names it."""


def import_pack_module(path: str | Path) -> ModuleType:
    """Execute the file as a fresh module (``kvgen.runtime.generated_module``)."""
    return import_generated_module(path, "pack", REQUIRED, PackModuleError)


def load_pack_module(path: str | Path) -> ModuleType:
    """The pack module of ``path``, imported once per process."""
    return load_generated_module(path, "pack", REQUIRED, PackModuleError)


class MovePacker:
    """One family's packer: ``packer(kept, P, S, tail, active, budget, mode, max_requests, capacity)``
    returns ``(src, dst, offsets)``, the oracle's ``Moves`` fields."""

    def __init__(self, path: str | Path, family: str | None = None):
        self.module = load_pack_module(path)
        self.family = self.module.FAMILY
        if family is not None and family != self.family:
            raise PackModuleError(f"{path}: generated for family {self.family!r}, not {family!r}")

    @property
    def num_layers(self) -> int:
        return self.module.NUM_LAYERS

    @property
    def kv_heads(self) -> int:
        return self.module.KV_HEADS

    @property
    def swa_window(self) -> tuple[int | None, ...]:
        return tuple(self.module.SWA_WINDOW)

    def __call__(self, kept: torch.Tensor, P, S, tail, active, budget: int, mode: str,
                 max_requests: int | None = None,
                 capacity: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.module.pack_moves(kept, P, S, tail, active, budget, mode, max_requests, capacity)
