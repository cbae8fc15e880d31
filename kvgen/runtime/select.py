"""A family's normalize/aggregate/select, from one of two files:

- the registry's ``select`` artifact ``lib<symbol>_select.so`` (``RuntimeRegistry.resolve(family,
  arch).artifact("select")``, sha256-verified; a kernel wheel ships it too): the Triton kernels
  compiled ahead of time for the arch behind the C ABI ``kvgen/kernels/include/kvgen_select.h``,
  loaded here by ``SelectLibrary`` with ctypes. It needs torch and the CUDA driver, not Triton;
- ``generated/<family>/select.py`` of a checkout: the same kernels and constants, JIT-compiled by
  Triton at the first call (or run by its interpreter on a CPU: the tests).

A registry may also list size-dispatched variants of the library (``kvgen.artifacts.dispatch``:
the same kernels at other launch tunables, for rounds of more requests x columns); ``Selector``
sends each round to the one of its size.

Both are a ``kvgen.kernels.selection.SelectionHost`` (same checks, same allocations) and carry
the family's layers, KV heads, group and scored layers, so nothing here reads a spec. ``Selector``
checks a round's host-side inputs (issue 14's bad input: P, S and budget against the scores'
width) before anything is launched, then calls ``decide``.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

import torch

from kvgen.artifacts.dispatch import DispatchFiles, dispatch_rows, select_work, serving
from kvgen.kernels.selection import SelectionHost, mode_index
from kvgen.runtime.generated_module import import_generated_module, load_generated_module
from kvgen.runtime.library import TritonAotLibrary

ABI_VERSION = 5

REQUIRED = ("FAMILY", "NUM_LAYERS", "KV_HEADS", "GROUP", "SCORED_LAYERS", "decide", "num_decision_rows")


class SelectModuleError(RuntimeError):
    """A file that is not a generated selection module; the message names it."""


def import_select_module(path: str | Path) -> ModuleType:
    """Execute the file as a fresh module (``kvgen.runtime.generated_module``)."""
    return import_generated_module(path, "select", REQUIRED, SelectModuleError)


def load_select_module(path: str | Path) -> ModuleType:
    """The select module of ``path``, imported once per process."""
    return load_generated_module(path, "select", REQUIRED, SelectModuleError)


class SelectGeometry(ctypes.Structure):
    _fields_ = [(name, ctypes.c_int32) for name in (
        "abi_version", "num_layers", "kv_heads", "group", "num_scored", "rows", "block_w", "block", "radix_bits",
        "stats_unroll", "stats_warps", "aggregate_warps", "stats_resident", "select_route", "select_warps",
        "aggregate_route", "chunk_requests", "queue_lag", "queue_programs", "head_step")]


_c = ctypes
_P = _c.c_void_p
_SIGNATURES = {
    "kvgen_select_abi_version": (_c.c_int, []),
    "kvgen_select_family_name": (_c.c_char_p, []),
    "kvgen_select_arch": (_c.c_char_p, []),
    "kvgen_select_last_error": (_c.c_char_p, []),
    "kvgen_select_query_geometry": (_c.c_int, [_c.POINTER(SelectGeometry)]),
    "kvgen_select_scored_layers": (_c.POINTER(_c.c_int32), []),
    "kvgen_select_statistics": (_c.c_int, [_P, _P, _P, _P, _c.c_int32, _c.c_int32, _P]),
    "kvgen_select_aggregate": (_c.c_int, [_c.c_int32, _P, _P, _P, _P, _P, _P, _c.c_int32, _c.c_int32, _P]),
    "kvgen_select_queue_work_ints": (_c.c_int64, [_c.c_int32, _c.c_int32, _c.c_int32]),
    "kvgen_select_statistics_aggregate": (_c.c_int, [_c.c_int32, _P, _P, _P, _P, _P, _P, _P, _c.c_int32, _c.c_int32,
                                                     _P]),
    "kvgen_select_keep": (_c.c_int, [_P, _P, _P, _P, _P, _c.c_int32, _c.c_int32, _c.c_int32, _c.c_int32, _P]),
}


def _stream(tensor: torch.Tensor) -> int:
    return torch.cuda.current_stream(tensor.device).cuda_stream


class SelectLibrary(TritonAotLibrary, SelectionHost):
    """A loaded ``lib<symbol>_select.so``: ABI and family checked at load, its compile-time
    geometry read from the library itself; launches through the C ABI on torch's current stream."""

    PREFIX, KIND, ABI_VERSION, SIGNATURES = "kvgen_select", "selection", ABI_VERSION, _SIGNATURES

    def __init__(self, path: str | Path, family: str | None = None):
        self._open(path, family)
        g = SelectGeometry()
        self._call("query_geometry", ctypes.byref(g))
        layers = self._lib.kvgen_select_scored_layers()
        super().__init__(g.num_layers, g.kv_heads, g.group, [layers[i] for i in range(g.num_scored)], rows=g.rows,
                         stats_unroll=g.stats_unroll, stats_resident=g.stats_resident, stats_warps=g.stats_warps,
                         block_w=g.block_w, aggregate_warps=g.aggregate_warps, block=g.block,
                         radix_bits=g.radix_bits, select_route=g.select_route, select_warps=g.select_warps,
                         aggregate_route=g.aggregate_route, chunk_requests=g.chunk_requests,
                         queue_lag=g.queue_lag, queue_programs=g.queue_programs, head_step=g.head_step)

    def _launch_statistics(self, scores, width, mean, std, batch, W):  # noqa: ANN001, ANN202
        self._call("statistics", scores.data_ptr(), width.data_ptr(), mean.data_ptr(), std.data_ptr(),
                   batch, W, _stream(scores))

    def _launch_aggregate(self, mode, scores, mean, std, width, layers, out, batch, W):  # noqa: ANN001, ANN202
        self._call("aggregate", mode_index(mode), scores.data_ptr(), mean.data_ptr(), std.data_ptr(),
                   width.data_ptr(), layers.data_ptr(), out.data_ptr(), batch, W, _stream(scores))

    def _launch_queue(self, mode, scores, width, mean, std, layers, out, work, batch, W):  # noqa: ANN001, ANN202
        self._call("statistics_aggregate", mode_index(mode), scores.data_ptr(), width.data_ptr(), layers.data_ptr(),
                   mean.data_ptr(), std.data_ptr(), out.data_ptr(), work.data_ptr(), batch, W, _stream(scores))

    def _launch_select(self, values, width, P, kept, nan_rows, rows, W, budget):  # noqa: ANN001, ANN202
        self._call("keep", values.data_ptr(), width.data_ptr(), P.data_ptr(), kept.data_ptr(),
                   nan_rows.data_ptr(), kept.shape[0], rows, W, budget, _stream(values))


def check_round(P: Sequence[int], S: Sequence[int], width: int, budget: int) -> None:
    """A round's requests against the scores' ``width`` columns: ``0 <= P``, ``S - P <= width``
    and ``budget < S - P`` (a round is due only past the budget: selecting would keep everything)."""
    if len(P) != len(S):
        raise ValueError(f"P has {len(P)} requests, S {len(S)}")
    if budget < 1:
        raise ValueError(f"budget {budget}: must be at least 1")
    for r, (p, s) in enumerate(zip(P, S)):
        if p < 0 or s - p > width:
            raise ValueError(f"request {r}: P={p}, S={s} outside the scores' {width} columns (need 0 <= P "
                             f"and S - P <= {width})")
        if budget >= s - p:
            raise ValueError(f"request {r}: budget {budget} >= scorable width S - P = {s - p}; a round needs "
                             f"more decode tokens than the budget")


def _load_host(path: Path) -> tuple[SelectionHost, str, bool]:
    """(module, family, ahead of time) of a selection library (``.so``) or generated module (``.py``)."""
    if path.suffix == ".so":
        library = SelectLibrary(path)
        return library, library.family, True
    generated = load_select_module(path)
    return generated.SELECTOR, generated.FAMILY, False


def _geometry(module: SelectionHost) -> tuple[int, int, int, tuple[int, ...]]:
    return module.num_layers, module.kv_heads, module.group, tuple(module.scored_layers)


class Selector:
    """One family's selection: ``selector(scores, P, S, budget, mode)`` -> ``Selection`` (kept
    positions ``[B, R, budget]`` int64 on the device; ``.check()`` raises the oracle's NaN error).
    ``P`` and ``S`` are host ints, checked by ``check_round`` before anything is launched.
    ``path``: a selection library (``.so``, ahead of time) or a generated module (``.py``, JIT), or
    a registry's ``(file, [(from_work, variant file), ...])`` (``Resolved.dispatch("select")``):
    a round of ``B`` requests over ``W`` columns goes to the last variant whose threshold
    ``select_work(B, W)`` reaches, else to the main file. ``module`` is the main file's
    ``SelectionHost``; every variant is checked to have its family and geometry (only the launch
    tunables differ)."""

    def __init__(self, path: str | Path | DispatchFiles, family: str | None = None):
        main, variants = path if isinstance(path, tuple) else (path, [])
        self.path = Path(main)
        self.module, self.family, self.aot = _load_host(self.path)
        if family is not None and family != self.family:
            raise SelectModuleError(f"{main}: generated for family {self.family!r}, not {family!r}")
        self.thresholds = [int(start) for start, _ in variants]
        self.variant_paths = [Path(file) for _, file in variants]
        self.variants = [self._variant(file) for file in self.variant_paths]

    def _variant(self, path: Path) -> SelectionHost:
        module, family, _ = _load_host(path)
        if family != self.family or _geometry(module) != _geometry(self.module):
            raise SelectModuleError(f"{path}: a selection variant of {family!r} {_geometry(module)}, not of "
                                    f"{self.family!r} {_geometry(self.module)} like {self.path}")
        return module

    @property
    def scored_layers(self) -> tuple[int, ...]:
        return self.module.scored_layers

    def check_geometry(self, num_layers: int, kv_heads: int, group: int, scored_layers: Sequence[int]) -> None:
        """The selection must have been generated for exactly this geometry."""
        mine, theirs = _geometry(self.module), (num_layers, kv_heads, group, tuple(scored_layers))
        if mine != theirs:
            raise SelectModuleError(f"{self.path}: generated for (layers, kv heads, group, scored layers) {mine}, "
                                    f"not {theirs}; rebuild it")

    def variant_index(self, batch: int, width: int) -> int | None:
        """Which variant serves ``batch`` requests of ``width`` score columns (None: the main file)."""
        return serving(self.thresholds, select_work(batch, width))

    def module_for(self, batch: int, width: int) -> SelectionHost:
        index = self.variant_index(batch, width)
        return self.module if index is None else self.variants[index]

    def path_for(self, batch: int, width: int) -> Path:
        index = self.variant_index(batch, width)
        return self.path if index is None else self.variant_paths[index]

    def describe(self) -> list[dict[str, object]]:
        """Which file serves which calls (``from_work``: requests x score columns)."""
        return dispatch_rows(self.path, list(zip(self.thresholds, self.variant_paths)))

    def __call__(self, scores: torch.Tensor, P: Sequence[int], S: Sequence[int], budget: int, mode: str,
                 device_rows: tuple[torch.Tensor, torch.Tensor] | None = None):  # noqa: ANN204 - a Selection
        """``device_rows``: ``(P, S - P)`` int64 ``[B]`` already on the scores' device (saves a copy)."""
        check_round(P, S, scores.shape[-1], budget)
        if device_rows is None:
            rows = torch.tensor([list(P), [s - p for p, s in zip(P, S)]], dtype=torch.int64)
            device_rows = tuple(rows.to(scores.device))
        P_t, width_t = device_rows
        return self.module_for(len(P), scores.shape[-1]).decide(scores, width_t, P_t, budget, mode)
