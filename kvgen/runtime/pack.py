"""A family's move packer, from one of two files:

- the registry's ``pack`` artifact ``lib<symbol>_pack.so`` (``RuntimeRegistry.resolve(family,
  arch).artifact("pack")``, sha256-verified; a kernel wheel ships it too): the Triton kernels
  compiled ahead of time for the arch behind the C ABI ``kvgen/kernels/include/kvgen_pack.h``,
  loaded here by ``PackLibrary`` with ctypes. It needs torch and the CUDA driver, not Triton;
- ``generated/<family>/pack.py`` of a checkout: the same kernels and constants, JIT-compiled by
  Triton at the first call (or run by its interpreter on a CPU: the tests).

Both are a ``kvgen.kernels.packing.PackHost`` and carry the family's layers, KV heads and windows,
so nothing here reads a spec. ``MovePacker`` calls ``pack_moves`` (signature of
``kvgen.reference.triattention.pack_moves`` without the geometry, plus ``capacity`` for graph
capture).
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from types import ModuleType

import torch

from kvgen.kernels.packing import MODES, PackHost
from kvgen.runtime.generated_module import import_generated_module, load_generated_module
from kvgen.runtime.library import TritonAotLibrary

ABI_VERSION = 1
REQUIRED = ("FAMILY", "NUM_LAYERS", "KV_HEADS", "SWA_WINDOW", "PACKER", "pack_moves")


class PackModuleError(RuntimeError):
    """A file that is not a generated packer; the message names it."""


def import_pack_module(path: str | Path) -> ModuleType:
    """Execute the file as a fresh module (``kvgen.runtime.generated_module``)."""
    return import_generated_module(path, "pack", REQUIRED, PackModuleError)


def load_pack_module(path: str | Path) -> ModuleType:
    """The pack module of ``path``, imported once per process."""
    return load_generated_module(path, "pack", REQUIRED, PackModuleError)


class PackGeometry(ctypes.Structure):
    _fields_ = [(name, ctypes.c_int32) for name in ("abi_version", "num_layers", "kv_heads", "block")]


_c = ctypes
_P = _c.c_void_p
_I = _c.c_int32
_SIGNATURES = {
    "kvgen_pack_abi_version": (_c.c_int, []),
    "kvgen_pack_family_name": (_c.c_char_p, []),
    "kvgen_pack_arch": (_c.c_char_p, []),
    "kvgen_pack_last_error": (_c.c_char_p, []),
    "kvgen_pack_query_geometry": (_c.c_int, [_c.POINTER(PackGeometry)]),
    "kvgen_pack_layer_windows": (_c.POINTER(_I), []),
    "kvgen_pack_offsets": (_c.c_int, [_P, _P, _P, _I, _I, _I, _P]),
    "kvgen_pack_moves": (_c.c_int, [_I, _P, _P, _P, _P, _P, _P, _P, _I, _I, _I, _I, _P]),
}


class PackLibrary(TritonAotLibrary, PackHost):
    """A loaded ``lib<symbol>_pack.so``: ABI and family checked at load, its geometry and windows
    read from the library itself; launches through the C ABI on torch's current stream."""

    PREFIX, KIND, ABI_VERSION, SIGNATURES = "kvgen_pack", "pack", ABI_VERSION, _SIGNATURES

    def __init__(self, path: str | Path, family: str | None = None):
        self._open(path, family)
        g = PackGeometry()
        self._call("query_geometry", ctypes.byref(g))
        windows = self._lib.kvgen_pack_layer_windows()
        super().__init__(g.num_layers, g.kv_heads, [windows[i] or None for i in range(g.num_layers)], g.block)

    def _launch_offsets(self, tail, due, offsets, batch, max_requests, budget):  # noqa: ANN001, ANN202
        self._call("offsets", tail.data_ptr(), due.data_ptr(), offsets.data_ptr(), batch, max_requests,
                   budget, torch.cuda.current_stream(offsets.device).cuda_stream)

    def _launch_moves(self, kept, P, S, windows, offsets, src, dst, mode, batch, max_requests,  # noqa: ANN001, ANN202
                      budget, capacity):
        self._call("moves", MODES.index(mode), kept.data_ptr(), P.data_ptr(), S.data_ptr(),
                   windows.data_ptr(), offsets.data_ptr(), src.data_ptr(), dst.data_ptr(), batch, max_requests,
                   budget, capacity, torch.cuda.current_stream(src.device).cuda_stream)


class MovePacker:
    """One family's packer: ``packer(kept, P, S, tail, active, budget, mode, max_requests, capacity)``
    returns ``(src, dst, offsets)``, the oracle's ``Moves`` fields. ``path``: a pack library (``.so``,
    ahead of time) or a generated module (``.py``, JIT); ``module`` is its ``PackHost`` either way."""

    def __init__(self, path: str | Path, family: str | None = None):
        self.path = Path(path)
        if self.path.suffix == ".so":
            self.module: PackHost = PackLibrary(path)
            self.family, self.aot = self.module.family, True
        else:
            generated = load_pack_module(path)
            self.module, self.family, self.aot = generated.PACKER, generated.FAMILY, False
        if family is not None and family != self.family:
            raise PackModuleError(f"{path}: generated for family {self.family!r}, not {family!r}")

    @property
    def num_layers(self) -> int:
        return self.module.num_layers

    @property
    def kv_heads(self) -> int:
        return self.module.kv_heads

    @property
    def swa_window(self) -> tuple[int | None, ...]:
        return self.module.swa_window

    def __call__(self, kept: torch.Tensor, P, S, tail, active, budget: int, mode: str,  # noqa: ANN001
                 max_requests: int | None = None,
                 capacity: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.module.pack_moves(kept, P, S, tail, active, budget, mode, max_requests, capacity)
