"""The generated Triton normalize/aggregate/select of a family, loaded from its file: the registry's
``select`` artifact (``RuntimeRegistry.resolve(family, arch).artifact("select")``, sha256-verified),
which a kernel wheel ships too, or ``generated/<family>/select.py`` of a checkout.

The generated module needs only torch, Triton and ``kvgen.kernels.triton``; it carries the
family's layers, KV heads, group and scored layers, so nothing here reads a spec. Its kernels are
shipped as source and JIT-compiled by Triton on the GPU at the first call (not ahead of time).
``Selector`` checks a round's host-side inputs (issue 14's bad input: P, S and budget against the
scores' width) before anything is launched, then calls the module's ``decide``.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

import torch

from kvgen.runtime.generated_module import import_generated_module, load_generated_module

REQUIRED = ("FAMILY", "NUM_LAYERS", "KV_HEADS", "GROUP", "SCORED_LAYERS", "decide", "num_decision_rows")


class SelectModuleError(RuntimeError):
    """A file that is not a generated selection module; the message names it."""


def import_select_module(path: str | Path) -> ModuleType:
    """Execute the file as a fresh module (``kvgen.runtime.generated_module``)."""
    return import_generated_module(path, "select", REQUIRED, SelectModuleError)


def load_select_module(path: str | Path) -> ModuleType:
    """The select module of ``path``, imported once per process."""
    return load_generated_module(path, "select", REQUIRED, SelectModuleError)


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


class Selector:
    """One family's selection: ``selector(scores, P, S, budget, mode)`` -> ``Selection`` (kept
    positions ``[B, R, budget]`` int64 on the device; ``.check()`` raises the oracle's NaN error).
    ``P`` and ``S`` are host ints, checked by ``check_round`` before anything is launched."""

    def __init__(self, path: str | Path, family: str | None = None):
        self.path = Path(path)
        self.module = load_select_module(path)
        self.family = self.module.FAMILY
        if family is not None and family != self.family:
            raise SelectModuleError(f"{path}: generated for family {self.family!r}, not {family!r}")

    @property
    def scored_layers(self) -> tuple[int, ...]:
        return tuple(self.module.SCORED_LAYERS)

    def check_geometry(self, num_layers: int, kv_heads: int, group: int, scored_layers: Sequence[int]) -> None:
        """The module must have been generated for exactly this geometry."""
        mine = (self.module.NUM_LAYERS, self.module.KV_HEADS, self.module.GROUP, self.scored_layers)
        theirs = (num_layers, kv_heads, group, tuple(scored_layers))
        if mine != theirs:
            raise SelectModuleError(f"{self.path}: generated for (layers, kv heads, group, scored layers) {mine}, "
                                    f"not {theirs}; rebuild it")

    def __call__(self, scores: torch.Tensor, P: Sequence[int], S: Sequence[int], budget: int, mode: str,
                 device_rows: tuple[torch.Tensor, torch.Tensor] | None = None):  # noqa: ANN204 - a Selection
        """``device_rows``: ``(P, S - P)`` int64 ``[B]`` already on the scores' device (saves a copy)."""
        check_round(P, S, scores.shape[-1], budget)
        if device_rows is None:
            rows = torch.tensor([list(P), [s - p for p, s in zip(P, S)]], dtype=torch.int64)
            device_rows = tuple(rows.to(scores.device))
        P_t, width_t = device_rows
        return self.module.decide(scores, width_t, P_t, budget, mode)
