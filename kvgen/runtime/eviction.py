"""TriAttention eviction rounds on the GPU (TRIATTENTION.md §3-§7) and the manager that runs them.

One round for the due requests of a generation step:
score (generated CuTe DSL kernel, ``ScoreLibrary``) -> z-normalize -> aggregate -> select (torch
ops on the GPU, below) -> pack (the generated Triton packer, or the oracle's ``pack_moves``) ->
compact (the generated CUDA mover, or the oracle's ``compact_paged``) -> new physical lengths.

Selection is exact: every kept set equals the oracle's selection applied to the kernel's scores.
That holds because the steps after scoring are the oracle's own arithmetic on the same tensor
shapes: ``zscore`` is the oracle's function, applied per layer to the contiguous ``[B, Hq, W]``
slice the oracle would see (torch's reductions are deterministic for a given shape, but may sum in
another order for another shape); the per_head mean reduces the same ``[B, layers, Hkv, W]``
tensor over the same dim; max is exact in any order; the top-``budget`` choice is a stable sort
by value descending (ties: lower index first), emitted ascending as absolute positions.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from kvgen.lower.triattention import calibration_defaults, require_scorable
from kvgen.reference.triattention import (
    MODES,
    MOVE_FILL,
    Calibration,
    Moves,
    TriGeometry,
    compact_paged,
    is_due,
    load_calibration,
    mean_phase_table,
    pack_moves,
    zscore,
)
from kvgen.runtime.score import TORCH_DTYPES, ScoreLibrary
from kvgen.spec.schema import FamilySpec

Packer = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
Compactor = Callable[..., None]


# ----------------------------------------------------------------------------------------------
# Normalize, aggregate, select (§4, §5)
# ----------------------------------------------------------------------------------------------

def zscore_layers(scores: torch.Tensor, valid: torch.Tensor) -> list[torch.Tensor]:
    """Per scored layer, ``[B, Hq, W]`` z-scores of ``scores`` ``[layers, B, Hq, W]`` over the
    columns where ``valid`` ``[B, W]`` holds (the oracle's ``zscore``, layer by layer)."""
    return [zscore(scores[layer], valid[:, None, :]) for layer in range(scores.shape[0])]


def aggregate_layers(z: Sequence[torch.Tensor], mode: str, geometry: TriGeometry) -> torch.Tensor:
    """Decision values ``[B, R, W]`` from the z-scores of the scored layers (in
    ``geometry.scored_layers`` order), without materializing rows for sliding layers."""
    if mode not in MODES:
        raise ValueError(f"eviction_mode {mode!r}; accepted: {', '.join(MODES)}")
    B, _, W = z[0].shape
    if mode == "union":
        values = z[0].amax(dim=1)
        for rows in z[1:]:
            values = torch.maximum(values, rows.amax(dim=1))
        return values.unsqueeze(1)
    grouped = [rows.reshape(B, geometry.kv_heads, geometry.group, W).amax(dim=2) for rows in z]
    if mode == "per_head":
        return torch.stack(grouped, dim=1).mean(dim=1)   # [B, layers, Hkv, W] -> mean over layers
    out = z[0].new_zeros((B, geometry.num_layers, geometry.kv_heads, W))  # sliding layers' rows stay 0
    for layer, rows in zip(geometry.scored_layers, grouped):
        out[:, layer] = rows
    return out.reshape(B, geometry.num_layers * geometry.kv_heads, W)


def select_keep(values: torch.Tensor, valid_width: torch.Tensor, budget: int, P: torch.Tensor) -> torch.Tensor:
    """Kept absolute positions ``[B, R, budget]`` int64, ascending: per decision row the first
    ``budget`` of the stable order (value desc, index asc) among the ``valid_width[b]`` leading
    columns; -1 fills the slots of rows with fewer valid columns."""
    B, R, W = values.shape
    width = valid_width.to(device=values.device, dtype=torch.int64).reshape(B, 1, 1)
    base = P.to(device=values.device, dtype=torch.int64).reshape(B, 1, 1)
    valid = torch.arange(W, device=values.device) < width
    key = torch.where(valid, values, float("-inf"))   # invalid columns last (and after valid -inf)
    order = torch.sort(key, dim=-1, descending=True, stable=True).indices[..., :budget]
    order = torch.where(order < width, order, W)       # picks past the valid width sort to the end
    order = torch.sort(order, dim=-1).values
    kept = torch.where(order < W, order + base, MOVE_FILL)
    if kept.shape[-1] < budget:
        kept = torch.cat([kept, kept.new_full((B, R, budget - kept.shape[-1]), MOVE_FILL)], dim=-1)
    return kept


# ----------------------------------------------------------------------------------------------
# The manager
# ----------------------------------------------------------------------------------------------

class Request(Protocol):
    """What the hooks read of a request."""

    request_id: Hashable
    prompt_len: int


@dataclass(frozen=True)
class GenerationStep:
    """One scheduled generation step, after its tokens' K/V were written.

    ``page_table`` row ``b`` (int32, on the device) and ``lengths[b]`` (physical tokens in the
    cache, protected tail included; host ints) belong to ``request_ids[b]``. ``tail[b]``: the
    newest tokens that are never scored and always kept, moved right after the kept ones
    (default 0)."""

    request_ids: Sequence[Hashable]
    page_table: torch.Tensor
    lengths: Sequence[int]
    tail: Sequence[int] | None = None


@dataclass(frozen=True)
class RoundReport:
    """What the cache manager must apply: new physical lengths (pages past them can be freed)."""

    due: tuple[Hashable, ...]     # requests compacted by this step's round
    lengths: tuple[int, ...]      # physical length of every request of the step, after the round
    evicted: tuple[int, ...]      # tokens evicted per request of the step by this round
    kept: torch.Tensor | None = None   # [due, R, budget] absolute kept positions (None: no round)


@dataclass
class _RequestState:
    prompt_len: int
    evicted: int = 0


def oracle_packer(geometry: TriGeometry) -> Packer:
    """The oracle's ``pack_moves`` behind the generated packer's call signature."""
    def pack(kept, P, S, tail, active, budget, mode, max_requests=None, capacity=None):  # noqa: ANN001
        moves = pack_moves(kept, P, S, tail, active, budget, mode, geometry, max_requests)
        return moves.src, moves.dst, moves.offsets
    return pack


def oracle_compactor(k_pools: Sequence[torch.Tensor], v_pools: Sequence[torch.Tensor],
                     geometry: TriGeometry) -> Compactor:
    """The oracle's ``compact_paged`` behind the generated compactor's call signature."""
    def compact(page_table, src, dst, offsets, stream=None):  # noqa: ANN001
        compact_paged(k_pools, v_pools, page_table, Moves(src, dst, offsets), geometry)
    return compact


def generated_backends(family: str, k_pools: Sequence[torch.Tensor], v_pools: Sequence[torch.Tensor],
                       pack_module: str | Path, compact_library: str | Path) -> tuple[Packer, Compactor]:
    """The family's generated Triton packer (``generated/<family>/pack.py``) and CUDA compactor
    (its family library) as the manager's ``packer`` and ``compactor``."""
    from kvgen.runtime.compact import Compactor as CudaCompactor
    from kvgen.runtime.pack import MovePacker

    return MovePacker(pack_module, family=family), CudaCompactor(compact_library, k_pools, v_pools)


class TriAttentionManager:
    """TriAttention as an iteration-driven KV-cache compression method.

    Built from the family spec, the calibration file (loaded with ``load_calibration`` and checked
    against the spec's geometry and RoPE: a mismatch fails here, naming file and key), the K/V pools
    of every cache layer, the family's score library, and optionally the generated packer module
    and compactor library (``pack_module``, ``compact_library``; otherwise the oracle's).

    Only ``on_generation_step_end`` works: it picks the due requests (every ``beta`` generated
    tokens once past ``budget``; several crossings in one step give one round), runs one round
    for them and returns their new physical lengths. The other hooks keep per-request state.

    Admission predicates (checked when a deployment is configured, never a run-time fallback):
    - ``changes_physical_kv_length = True``: rounds compact the cache in place; the cache manager
      must take the lengths of ``RoundReport`` and free the pages past them.
    - ``supports_block_reuse() -> False``: compaction writes decode tokens into the page that
      holds the end of the prompt (destinations start at ``P``, rarely page-aligned) and changes
      what a page's token ids mean, so a page shared through prefix reuse would be corrupted and
      the reuse tree's hashes would lie.
    - ``supports_speculative_decoding() -> False``: a round assumes every token in the cache is
      accepted; draft tokens awaiting verification would be scored or moved as the tail, and a
      later rollback by physical length would cut the wrong tokens after compaction (and a
      separate draft model's cache would not be compacted with it).
    """

    changes_physical_kv_length = True

    @staticmethod
    def supports_block_reuse() -> bool:
        return False

    @staticmethod
    def supports_speculative_decoding() -> bool:
        return False

    def __init__(self, spec: FamilySpec, calibration_path: str | Path, k_pools: Sequence[torch.Tensor],
                 v_pools: Sequence[torch.Tensor], score_library: ScoreLibrary | str | Path, *,
                 budget: int | None = None, beta: int | None = None, eviction_mode: str | None = None,
                 max_position: int = 1 << 15, packer: Packer | None = None, compactor: Compactor | None = None,
                 pack_module: str | Path | None = None, compact_library: str | Path | None = None):
        self.spec = spec
        self.geometry = require_scorable(spec)
        tri = spec.triattention
        self.budget = tri.budget if budget is None else budget
        self.beta = tri.beta if beta is None else beta
        self.mode = tri.eviction_mode if eviction_mode is None else eviction_mode
        if self.mode not in MODES:
            raise ValueError(f"eviction_mode {self.mode!r}; accepted: {', '.join(MODES)}")
        if self.budget < 1 or self.beta < 1:
            raise ValueError(f"budget {self.budget} and beta {self.beta} must be positive")
        windows = [w for w in self.geometry.swa_window if w is not None]
        if windows and self.budget < max(windows):
            raise ValueError(f"budget {self.budget} < sliding window {max(windows)}; SWA layers keep their window")
        omega, scale = calibration_defaults(spec)
        self.calibration: Calibration = load_calibration(calibration_path, self.geometry, omega, scale)
        # A path loads the library; anything else is used as one (tests pass stand-ins).
        self.library = ScoreLibrary(score_library) if isinstance(score_library, (str, Path)) else score_library
        if self.library.family != spec.name:
            raise ValueError(f"{self.library.path}: score library of {self.library.family!r}, not {spec.name!r}")
        self.library.check_geometry(self.geometry, spec.dtype)
        self.k_pools, self.v_pools = list(k_pools), list(v_pools)
        self.device = self._check_pools()
        self._prepare_inputs(max_position)
        if pack_module is not None and compact_library is not None and packer is None and compactor is None:
            packer, compactor = generated_backends(spec.name, self.k_pools, self.v_pools, pack_module,
                                                   compact_library)
        # Without the generated packer/compactor, the oracle's (correct, slower) stand in.
        self.packer = packer or oracle_packer(self.geometry)
        self.compactor = compactor or oracle_compactor(self.k_pools, self.v_pools, self.geometry)
        self.requests: dict[Hashable, _RequestState] = {}

    # ---- init helpers

    def _check_pools(self) -> torch.device:
        g, dtype = self.geometry, TORCH_DTYPES[self.spec.dtype]
        if len(self.k_pools) != g.num_layers or len(self.v_pools) != g.num_layers:
            raise ValueError(f"{self.spec.name}: {g.num_layers} layers, got {len(self.k_pools)} K and "
                             f"{len(self.v_pools)} V pools")
        page = ((g.kv_heads, g.tokens_per_block, g.head_dim) if g.layout == "HND"
                else (g.tokens_per_block, g.kv_heads, g.head_dim))
        device = self.k_pools[g.scored_layers[0]].device
        strides = set()
        for layer, pool in enumerate(self.k_pools + self.v_pools):
            name = f"{'K' if layer < g.num_layers else 'V'} pool {layer % g.num_layers}"
            if pool.dtype != dtype or tuple(pool.shape[1:]) != page or pool.device != device:
                raise ValueError(f"{name}: expected {str(dtype).replace('torch.', '')} [pages, {', '.join(map(str, page))}] "
                                 f"on {device}, got {pool.dtype} {list(pool.shape)} on {pool.device}")
            if not pool[0].is_contiguous():
                raise ValueError(f"{name}: each page must be contiguous in the {g.layout} layout")
        for layer in g.scored_layers:
            pool = self.k_pools[layer]
            if pool.data_ptr() % 16:
                raise ValueError(f"K pool {layer}: base address not 16-byte aligned")
            strides.add(pool.stride(0))
        if len(strides) != 1:
            raise ValueError(f"scored K pools have different page strides {sorted(strides)}; one is required")
        self.page_stride = strides.pop()
        return device

    def _prepare_inputs(self, max_position: int) -> None:
        g, calib, device = self.geometry, self.calibration, self.device
        scored = list(g.scored_layers)
        self.k_layer_ptrs = torch.tensor([self.k_pools[layer].data_ptr() for layer in scored], dtype=torch.int64,
                                         device=device)
        e_q = calib.E_q[scored].to(device)
        self.qr = e_q.real.to(torch.float32).contiguous()
        self.qi = e_q.imag.to(torch.float32).contiguous()
        # mlr = E|q| - |E q| in float32, as the oracle's score_coefficients computes it.
        self.mlr = (calib.E_q_norm[scored].to(device=device, dtype=torch.float32)
                    - torch.hypot(self.qr, self.qi)).contiguous()
        self.freq_scale_sq = calib.freq_scale_sq.to(device=device, dtype=torch.float32).contiguous()
        self.omega = calib.omega.to(device)
        self._table = mean_phase_table(self.omega, max_position)

    def _mean_phase(self, L: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows ``(c, d)`` ``[B, F]`` at positions ``L``; the table doubles when outgrown."""
        needed = int(L.max()) + 1
        if needed > self._table[0].shape[0]:
            self._table = mean_phase_table(self.omega, needed)
        cos_rows, sin_rows = self._table
        return cos_rows[L].contiguous(), sin_rows[L].contiguous()

    # ---- lifecycle hooks

    def on_request_init(self, request: Request) -> None:
        self.requests[request.request_id] = _RequestState(int(request.prompt_len))

    def on_context_step_end(self, requests: Sequence[Request]) -> None:
        """Nothing to do: the prompt is never evicted."""

    def on_generation_step_begin(self, step: GenerationStep) -> None:
        """Nothing to do: a round needs the step's tokens written."""

    def on_request_finish(self, request: Request) -> None:
        self.requests.pop(request.request_id, None)

    def on_generation_step_end(self, step: GenerationStep) -> RoundReport:
        """Cadence rule, then one round for the due requests of ``step``."""
        tails = list(step.tail) if step.tail is not None else [0] * len(step.request_ids)
        states = [self.requests[rid] for rid in step.request_ids]
        S = [length - tail for length, tail in zip(step.lengths, tails)]
        due = [b for b, (state, s) in enumerate(zip(states, S))
               if is_due(state.prompt_len, s, state.evicted, s + state.evicted, self.budget, self.beta)]
        lengths, evicted = list(step.lengths), [0] * len(states)
        if not due:
            return RoundReport((), tuple(lengths), tuple(evicted))
        P_due = [states[b].prompt_len for b in due]
        S_due = [S[b] for b in due]
        L_due = [S[b] + states[b].evicted for b in due]
        kept = self.run_round(step.page_table[torch.tensor(due, device=step.page_table.device)].contiguous(),
                              P_due, S_due, L_due, [tails[b] for b in due])
        for b in due:
            evicted[b] = S[b] - states[b].prompt_len - self.budget
            states[b].evicted += evicted[b]
            lengths[b] = states[b].prompt_len + self.budget + tails[b]
        return RoundReport(tuple(step.request_ids[b] for b in due), tuple(lengths), tuple(evicted), kept)

    # ---- one round

    def score(self, page_table: torch.Tensor, P: Sequence[int], S: Sequence[int],
              L: Sequence[int]) -> torch.Tensor:
        """Scores ``[scored layers, B, Hq, W]`` (``W = max(S - P)``), zeros past each request's width."""
        device, g = self.device, self.geometry
        width = max(max(s - p for p, s in zip(P, S)), 0)
        P_t = torch.tensor(P, dtype=torch.int32, device=device)
        S_t = torch.tensor(S, dtype=torch.int32, device=device)
        c, d = self._mean_phase(torch.tensor(L, dtype=torch.int64, device=device))
        scores = torch.empty((len(g.scored_layers), len(P), g.query_heads, width), dtype=torch.float32,
                             device=device)
        self.library.score(self.k_layer_ptrs, self.page_stride, page_table, P_t, S_t, c, d, self.qr, self.qi,
                           self.mlr, self.freq_scale_sq, scores)
        return scores

    def decide(self, scores: torch.Tensor, P: Sequence[int], S: Sequence[int]) -> torch.Tensor:
        """Kept positions ``[B, R, budget]`` from the kernel's scores (normalize, aggregate, select)."""
        device = scores.device
        P_t = torch.tensor(P, dtype=torch.int64, device=device)
        width_t = torch.tensor(S, dtype=torch.int64, device=device) - P_t
        valid = torch.arange(scores.shape[-1], device=device)[None, :] < width_t[:, None]
        values = aggregate_layers(zscore_layers(scores, valid), self.mode, self.geometry)
        return select_keep(values, width_t, self.budget, P_t)

    def run_round(self, page_table: torch.Tensor, P: Sequence[int], S: Sequence[int], L: Sequence[int],
                  tail: Sequence[int]) -> torch.Tensor:
        """Score -> decide -> pack -> compact for requests that are all due; returns ``kept``."""
        if page_table.dtype != torch.int32:
            raise ValueError(f"page_table: expected int32, got {page_table.dtype}")
        kept = self.decide(self.score(page_table, P, S, L), P, S)
        device = self.device
        active = torch.ones(len(P), dtype=torch.bool, device=device)
        as_long = [torch.tensor(v, dtype=torch.int64, device=device) for v in (P, S, tail)]
        src, dst, offsets = self.packer(kept, *as_long, active, self.budget, self.mode, len(P))
        self.compactor(page_table, src, dst, offsets)
        return kept

    def describe(self) -> dict[str, Any]:
        return {"family": self.spec.name, "budget": self.budget, "beta": self.beta, "mode": self.mode,
                "score_library": str(self.library.path), "arch": self.library.arch,
                "scored_layers": list(self.geometry.scored_layers)}
