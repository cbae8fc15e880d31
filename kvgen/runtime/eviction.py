"""TriAttention eviction rounds on the GPU (TRIATTENTION.md §3-§7) and the manager that runs them.

One round for the due requests of a generation step:
score (generated CuTe DSL kernel, ``ScoreLibrary``) -> z-normalize -> aggregate -> select (the
generated Triton kernels, ``kvgen.runtime.select.Selector``, or the oracle's ``zscore``,
``aggregate`` and ``select_keep``) -> pack (the generated Triton packer, or the oracle's
``pack_moves``) -> compact (the generated CUDA mover, or the oracle's ``compact_paged``) -> new
physical lengths.

Selection is exact either way: the reference fixes every summation order of normalize and
aggregate (``lane_sum``; layers added in order), and the generated kernels follow it bit for bit,
so every kept set equals the oracle's selection applied to the kernel's scores. The oracle path
calls ``zscore`` per layer on the ``[B, Hq, W]`` slices of the kernel's ``[layers, B, Hq, W]``
output and ``aggregate`` over the scored layers only (no rows are materialized for sliding layers).

A round reads nothing back from the device but once: the generated selection's NaN count, right
before compaction (the oracle raises on a NaN decision value, and nothing may move then). Its
small inputs (P, S - P, S, tail, L) go to the device in one copy.

The manager is built from an ``EvictionConfig`` (plain data: the registry manifest carries it as
the family layout's ``triattention`` entry), never from the spec: this module needs torch, the
oracle and the runtime's libraries only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from kvgen.artifacts.dispatch import DispatchFiles
from kvgen.reference.triattention import (
    Calibration,
    EvictionConfig,
    GeometryError,
    Moves,
    TriGeometry,
    aggregate,
    compact_paged,
    is_due,
    load_calibration,
    mean_phase_table,
    pack_moves,
    rope_defaults,
    select_keep,
    zscore,
)
from kvgen.runtime.score import TORCH_DTYPES, ScoreDispatch, ScoreLibrary

Packer = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
Compactor = Callable[..., None]
Decider = Callable[..., Any]   # (scores, P, S, budget, mode, device_rows) -> object with .kept, .check()
# selector="oracle": the reference's selection (tests), said explicitly; a manager built directly with
# neither a selector nor a select_module gets it too, as it gets the oracle's packer and compactor.
ORACLE = "oracle"


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


@dataclass(frozen=True)
class OracleSelection:
    """The oracle's decision, already checked (``select_keep`` raised on NaN)."""

    kept: torch.Tensor

    def check(self) -> torch.Tensor:
        return self.kept


def oracle_selector(geometry: TriGeometry) -> Decider:
    """The oracle's ``zscore``, ``aggregate`` and ``select_keep`` behind the generated selector's
    call signature."""
    def decide(scores, P, S, budget, mode, device_rows=None):  # noqa: ANN001, ANN202
        P_t, width_t = device_rows if device_rows is not None else _long_rows([P, [s - p for p, s in zip(P, S)]],
                                                                             scores.device)
        valid = torch.arange(scores.shape[-1], device=scores.device)[None, :] < width_t[:, None]
        z = [zscore(layer_scores, valid[:, None, :]) for layer_scores in scores]
        return OracleSelection(select_keep(aggregate(z, mode, geometry), width_t, budget, P_t))
    return decide


def _long_rows(rows: Sequence[Sequence[int]], device: torch.device) -> torch.Tensor:
    """int64 ``[len(rows), B]`` on ``device`` in one copy; from pinned memory on a GPU, so the copy
    does not wait for the work already queued."""
    host = torch.tensor([list(row) for row in rows], dtype=torch.int64)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def generated_backends(family: str, k_pools: Sequence[torch.Tensor], v_pools: Sequence[torch.Tensor],
                       pack_module: str | Path, compact_library: str | Path | DispatchFiles) -> tuple[Packer, Compactor]:
    """The family's packer (its AOT library ``lib<symbol>_pack.so``, or a checkout's
    ``generated/<family>/pack.py``) and CUDA compactor (its family library, or a registry's
    ``(library, [(from_work, variant library), ...])``: ``Resolved.dispatch("compact")``) as the
    manager's ``packer`` and ``compactor``."""
    from kvgen.runtime.compact import Compactor as CudaCompactor
    from kvgen.runtime.pack import MovePacker

    main, variants = compact_library if isinstance(compact_library, tuple) else (compact_library, [])
    return MovePacker(pack_module, family=family), CudaCompactor(main, k_pools, v_pools, variants)


def registry_config(resolved: Any) -> EvictionConfig:
    """The ``EvictionConfig`` of a resolved registry family (its layout's ``triattention`` entry);
    ``GeometryError`` naming the family and the reason when it has none."""
    family = resolved.entry.family
    layout = resolved.entry.layout or {}
    data = layout.get("triattention")
    if data is None:
        reason = layout.get("triattention_refusal") or (
            "its manifest entry has no TriAttention description (written by an older build); rebuild it "
            "with kvgen build")
        raise GeometryError(f"{family}: no TriAttention eviction from the registry: {reason}")
    return EvictionConfig.from_json(data, source=f"{family}: layout.triattention")


class TriAttentionManager:
    """TriAttention as an iteration-driven KV-cache compression method.

    Built from the family's ``EvictionConfig`` (from the registry: ``from_registry``; from a spec:
    ``kvgen.lower.triattention.eviction_config``), the calibration file (loaded with
    ``load_calibration`` and checked against the config's geometry and RoPE: a mismatch fails
    here, naming file and key), the K/V pools of every cache layer, the family's score library,
    and optionally the generated packer module and compactor library (``pack_module``,
    ``compact_library``; otherwise the oracle's) and the generated selection module
    (``select_module``, or a ``selector``; without either, or with ``selector="oracle"``, the
    oracle's selection). ``from_registry`` always takes the registry's generated selection unless
    a ``selector`` is given. ``budget``, ``beta`` and ``eviction_mode`` override the config's
    defaults and are checked like them.

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

    def __init__(self, config: EvictionConfig, calibration_path: str | Path, k_pools: Sequence[torch.Tensor],
                 v_pools: Sequence[torch.Tensor], score_library: ScoreLibrary | ScoreDispatch | str | Path, *,
                 budget: int | None = None, beta: int | None = None, eviction_mode: str | None = None,
                 max_position: int = 1 << 15, packer: Packer | None = None, compactor: Compactor | None = None,
                 pack_module: str | Path | None = None, compact_library: str | Path | DispatchFiles | None = None,
                 selector: Decider | str | None = None,
                 select_module: str | Path | DispatchFiles | None = None):
        overrides = {"budget": budget, "beta": beta, "eviction_mode": eviction_mode}
        # replace() runs the config's checks again on the overridden values (mode, budget >= windows).
        self.config = dataclasses.replace(config, **{k: v for k, v in overrides.items() if v is not None})
        self.family, self.geometry = self.config.family, self.config.geometry
        self.budget, self.beta, self.mode = self.config.budget, self.config.beta, self.config.eviction_mode
        omega, scale = rope_defaults(self.geometry.rotary_dim, self.config.rope_theta, self.config.rope_scaling)
        self.calibration: Calibration = load_calibration(calibration_path, self.geometry, omega, scale)
        # A path loads the library; anything else is used as one (tests pass stand-ins).
        self.library = ScoreLibrary(score_library) if isinstance(score_library, (str, Path)) else score_library
        if self.library.family != self.family:
            raise ValueError(f"{self.library.path}: score library of {self.library.family!r}, not {self.family!r}")
        self.library.check_geometry(self.geometry, self.config.dtype)
        self.k_pools, self.v_pools = list(k_pools), list(v_pools)
        self.device = self._check_pools()
        self._prepare_inputs(max_position)
        if pack_module is not None and compact_library is not None and packer is None and compactor is None:
            packer, compactor = generated_backends(self.family, self.k_pools, self.v_pools, pack_module,
                                                   compact_library)
        # Without the generated packer/compactor, the oracle's (correct, slower) stand in.
        self.packer = packer or oracle_packer(self.geometry)
        self.compactor = compactor or oracle_compactor(self.k_pools, self.v_pools, self.geometry)
        self.selector = self._make_selector(selector, select_module)
        self.requests: dict[Hashable, _RequestState] = {}

    def _make_selector(self, selector: Decider | str | None, select_module: str | Path | None) -> Decider:
        if select_module is not None and selector is None:
            from kvgen.runtime.select import Selector

            selector = Selector(select_module, family=self.family)
            g = self.geometry
            selector.check_geometry(g.num_layers, g.kv_heads, g.group, g.scored_layers)
        if selector is None or selector == ORACLE:
            return oracle_selector(self.geometry)
        return selector

    @classmethod
    def from_registry(cls, resolved: Any, calibration_path: str | Path, k_pools: Sequence[torch.Tensor],
                      v_pools: Sequence[torch.Tensor], **overrides: Any) -> TriAttentionManager:
        """The manager of a registry family: config from ``resolved.entry.layout["triattention"]``,
        the packer module from ``resolved.artifact("pack")``, the selection, compaction and score
        libraries with their size-dispatched variants (``resolved.dispatch("select")``,
        ``resolved.dispatch("compact")``, ``ScoreDispatch.from_resolved``) (a
        ``kvgen.runtime.lookup.Resolved``; no spec).

        ``overrides`` are the constructor's keywords; a ``score_library``, a ``packer`` and
        ``compactor``, or a ``selector`` (``"oracle"`` included), given there replace the
        registry's (and those artifacts are not asked for).
        A family TriAttention cannot serve fails with ``GeometryError`` naming it and the reason."""
        config = registry_config(resolved)
        if overrides.get("packer") is None and overrides.get("compactor") is None:
            overrides.setdefault("pack_module", resolved.artifact("pack"))
            overrides.setdefault("compact_library", resolved.dispatch("compact"))
        if overrides.get("selector") is None:
            overrides.setdefault("select_module", resolved.dispatch("select"))
        if "score_library" not in overrides:   # loads the libraries: after every artifact is verified
            overrides["score_library"] = ScoreDispatch.from_resolved(resolved)
        return cls(config, calibration_path, k_pools, v_pools, **overrides)

    # ---- init helpers

    def _check_pools(self) -> torch.device:
        g, dtype = self.geometry, TORCH_DTYPES[self.config.dtype]
        if len(self.k_pools) != g.num_layers or len(self.v_pools) != g.num_layers:
            raise ValueError(f"{self.family}: {g.num_layers} layers, got {len(self.k_pools)} K and "
                             f"{len(self.v_pools)} V pools")
        page = g.page_shape
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
        self.num_pages = min(self.k_pools[layer].shape[0] for layer in g.scored_layers)   # the kernel's page bound
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

    def _mean_phase(self, L: torch.Tensor, largest: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows ``(c, d)`` ``[B, F]`` at positions ``L`` (``largest``: their host-side maximum, so
        nothing is read back); the table doubles when outgrown."""
        if largest + 1 > self._table[0].shape[0]:
            self._table = mean_phase_table(self.omega, largest + 1)
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
        rows = step.page_table.shape[0] if step.page_table.dim() == 2 else None
        if not len(step.request_ids) == len(step.lengths) == len(tails) == rows:
            raise ValueError(f"step: {len(step.request_ids)} request ids, {len(step.lengths)} lengths, {len(tails)} "
                             f"tails and page table {list(step.page_table.shape)}; one each (one row) per request")
        if any(not 0 <= tail <= length for tail, length in zip(tails, step.lengths)):
            raise ValueError("step: every tail must be between 0 and its request's length")
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

    def round_rows(self, P: Sequence[int], S: Sequence[int], L: Sequence[int],
                   tail: Sequence[int] | None = None) -> torch.Tensor:
        """int64 ``[5, B]`` on the device, one copy: P, S - P, S, tail, L."""
        tail = [0] * len(P) if tail is None else tail
        return _long_rows([P, [s - p for p, s in zip(P, S)], S, tail, L], self.device)

    def score(self, page_table: torch.Tensor, P: Sequence[int], S: Sequence[int], L: Sequence[int],
              rows: torch.Tensor | None = None) -> torch.Tensor:
        """Scores ``[scored layers, B, Hq, W]`` (``W = max(S - P)``), zeros past each request's width.
        ``rows``: ``round_rows(P, S, L, ...)`` when the caller has it."""
        g = self.geometry
        self._check_round_inputs(page_table, P, S, L)
        rows = self.round_rows(P, S, L) if rows is None else rows
        width = max(max(s - p for p, s in zip(P, S)), 0)
        c, d = self._mean_phase(rows[4], max(L))
        scores = torch.empty((len(g.scored_layers), len(P), g.query_heads, width), dtype=torch.float32,
                             device=self.device)
        self.library.score(self.k_layer_ptrs, self.page_stride, page_table, rows[0].to(torch.int32),
                           rows[2].to(torch.int32), c, d, self.qr, self.qi, self.mlr, self.freq_scale_sq, scores,
                           num_pages=self.num_pages)
        return scores

    def _check_round_inputs(self, page_table: torch.Tensor, P: Sequence[int], S: Sequence[int],
                            L: Sequence[int]) -> None:
        """Host lengths against the page table (no device value is read): one row per request, and
        every scored token ``P[b] .. S[b]-1`` inside its row's pages."""
        if page_table.dim() != 2 or page_table.device != self.device:
            raise ValueError(f"page_table: expected a [requests, pages] tensor on {self.device}, got "
                             f"{list(page_table.shape)} on {page_table.device}")
        if not len(P) == len(S) == len(L) == page_table.shape[0] or not len(P):
            raise ValueError(f"P, S, L and the page table rows must be one per request, got {len(P)}, {len(S)}, "
                             f"{len(L)} and {page_table.shape[0]}")
        capacity = page_table.shape[1] * self.geometry.tokens_per_block
        for b, (p, s, length) in enumerate(zip(P, S, L)):
            if not 0 <= p <= s <= capacity or length < s:
                raise ValueError(f"request {b}: P={p}, S={s}, L={length}; need 0 <= P <= S <= {capacity} (the page "
                                 f"table's {page_table.shape[1]} pages of {self.geometry.tokens_per_block} tokens) "
                                 "and L >= S")

    def select(self, scores: torch.Tensor, P: Sequence[int], S: Sequence[int], rows: torch.Tensor | None = None):  # noqa: ANN201
        """The decision of ``scores`` (normalize, aggregate, select), unchecked: ``.kept``
        ``[B, R, budget]`` and ``.check()`` (raises on a NaN decision value, like the oracle)."""
        device_rows = None if rows is None else (rows[0], rows[1])
        return self.selector(scores, P, S, self.budget, self.mode, device_rows=device_rows)

    def decide(self, scores: torch.Tensor, P: Sequence[int], S: Sequence[int]) -> torch.Tensor:
        """Kept positions ``[B, R, budget]`` from the kernel's scores (normalize, aggregate, select)."""
        return self.select(scores, P, S).check()

    def run_round(self, page_table: torch.Tensor, P: Sequence[int], S: Sequence[int], L: Sequence[int],
                  tail: Sequence[int]) -> torch.Tensor:
        """Score -> decide -> pack -> compact for requests that are all due; returns ``kept``."""
        if page_table.dtype != torch.int32:
            raise ValueError(f"page_table: expected int32, got {page_table.dtype}")
        rows = self.round_rows(P, S, L, tail)
        selection = self.select(self.score(page_table, P, S, L, rows), P, S, rows)
        active = torch.ones(len(P), dtype=torch.bool, device=self.device)
        capacity = sum(self.budget + t for t in tail)   # every request is due: the packer need not count
        src, dst, offsets = self.packer(selection.kept, rows[0], rows[2], rows[3], active, self.budget, self.mode,
                                        len(P), capacity)
        kept = selection.check()   # the round's one synchronization: a NaN stops it before anything moves
        self.compactor(page_table, src, dst, offsets)
        return kept

    def describe(self) -> dict[str, Any]:
        return {"family": self.family, "budget": self.budget, "beta": self.beta, "mode": self.mode,
                "score_library": str(self.library.path), "arch": self.library.arch,
                "score_dispatch": self.library.describe() if isinstance(self.library, ScoreDispatch) else [],
                "compact_dispatch": self.compactor.describe() if hasattr(self.compactor, "describe") else [],
                "selection": str(getattr(self.selector, "path", ORACLE)),
                "select_dispatch": self.selector.describe() if hasattr(self.selector, "describe") else [],
                "scored_layers": list(self.geometry.scored_layers)}
