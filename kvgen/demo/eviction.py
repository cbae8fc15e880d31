"""Part 2: TriAttention eviction of long-decode requests at several budgets, attention over the kept
tokens compared with attention over all of them."""

from __future__ import annotations

import math
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvgen.demo.attention import ErrorStats, attention, calibrated_queries
from kvgen.demo.codecs import runtime_registry
from kvgen.demo.config import (
    CALIBRATION_QUERIES,
    CALIBRATION_SPREAD,
    EVICTION_FAMILY,
    DemoConfig,
    load_family,
    timer_label,
)
from kvgen.demo.synthetic import CacheGeometry, KVGenerator
from kvgen.lower import triattention as spec_tri
from kvgen.lower.layout import family_layout
from kvgen.measure.timing import clock_for, time_once
from kvgen.reference import triattention as oracle
from kvgen.reference.codec import HOT_TORCH_DTYPES
from kvgen.spec.schema import FamilySpec


class OracleScoreLibrary:
    """Stands in for ``ScoreLibrary`` on the CPU: its call signature, the oracle's ``score_keys``."""

    arch = "cpu"
    path = Path("<oracle score_keys>")

    def __init__(self, family: str, k_pools: Sequence[torch.Tensor], calibration: Any, geometry: Any):
        self.family, self.k_pools, self.calibration, self.geometry = family, k_pools, calibration, geometry

    def check_geometry(self, geometry: Any, dtype: str) -> None:
        if geometry != self.geometry:
            raise ValueError(f"oracle scorer built for {self.geometry}, asked for {geometry}")

    def score(self, k_layer_ptrs, page_stride, page_table, P, S, c, d, qr, qi, mlr, freq_scale_sq,  # noqa: ANN001
              scores, stream=None, *, num_pages: int) -> None:
        """``ScoreLibrary.score``'s signature; ``num_pages`` is unused (the oracle indexes tensors)."""
        P, S = P.long(), S.long()
        j = torch.arange(scores.shape[-1], device=scores.device)
        valid = j[None, :] < (S - P)[:, None]
        for index, layer in enumerate(self.geometry.scored_layers):
            rows = oracle.gather_token_rows(self.k_pools[layer], page_table, P[:, None] + j, valid, self.geometry)
            value = oracle.score_keys(rows.float(), self.calibration, layer, c, d, self.geometry, torch.float32)
            scores[index] = torch.where(valid[:, None, :], value, 0)


@dataclass(frozen=True)
class _Req:
    request_id: int
    prompt_len: int


def eviction_backends(config: DemoConfig, spec: FamilySpec, spec_path: Path, calibration_path: Path,
                      k_pools: list[torch.Tensor], v_pools: list[torch.Tensor]) -> tuple[dict, dict]:
    """Manager arguments (score library, packer, compactor) and their labels. On the GPU: the
    family's score library and library (compaction) from the registry and its generated Triton
    packer; a part that cannot load falls back to the oracle and the label says why."""
    geometry = spec_tri.tri_geometry(spec)
    omega, scale = spec_tri.calibration_defaults(spec)
    calibration = oracle.load_calibration(calibration_path, geometry, omega, scale)
    oracle_scorer = OracleScoreLibrary(spec.name, k_pools, calibration, geometry)
    if not config.on_gpu:
        labels = {"score": "oracle score_keys (cpu)", "pack": "oracle pack_moves (cpu)",
                  "compact": "oracle compact_paged (cpu)"}
        return {"score_library": oracle_scorer}, labels
    from kvgen.runtime.eviction import generated_backends
    from kvgen.runtime.score import ScoreDispatch

    resolved = runtime_registry(config).resolve(spec.name, config.arch, spec_path)
    kwargs: dict[str, Any] = {}
    labels = {}
    try:
        kwargs["score_library"] = ScoreDispatch.from_resolved(resolved)
        labels["score"] = f"generated CuTe DSL ({kwargs['score_library'].path})"
    except Exception as exc:  # noqa: BLE001 - recorded in the report, never silent
        kwargs["score_library"] = oracle_scorer
        labels["score"] = f"oracle score_keys (generated unavailable: {exc})"
    try:
        pack, compact = resolved.artifact("pack"), resolved.dispatch("compact")
        packer, compactor = generated_backends(spec.name, k_pools, v_pools, pack, compact)
        kwargs.update(packer=packer, compactor=compactor)
        labels["pack"] = f"generated Triton ({pack})"
        labels["compact"] = f"generated CUDA ({compact[0]}{f', {len(compact[1])} size variants' if compact[1] else ''})"
    except Exception as exc:  # noqa: BLE001 - recorded in the report, never silent
        labels["pack"] = f"oracle pack_moves (generated unavailable: {exc})"
        labels["compact"] = f"oracle compact_paged (generated unavailable: {exc})"
    return kwargs, labels


class LongDecode:
    """Long-decode requests in paged K/V pools, fed ``beta`` tokens per generation step.

    Every round point of TriAttention's cadence is a multiple of ``beta`` generated tokens
    (TRIATTENTION.md §5: due when ``⌊(budget + C)/β⌋ < ⌊(L − P)/β⌋``, and after a round
    ``budget + C`` is the generated count), so steps of ``beta`` tokens give exactly the rounds of
    one-token steps, with ``beta`` times fewer hook calls.
    """

    def __init__(self, spec: FamilySpec, originals: list[dict[str, torch.Tensor]], prompt: int, generated: int,
                 device: torch.device, rng: torch.Generator):
        self.geometry = spec_tri.tri_geometry(spec)
        g = self.geometry
        self.originals, self.prompt, self.generated = originals, prompt, generated
        per_request = -(-(prompt + generated) // g.tokens_per_block)
        pages = len(originals) * per_request
        shape = (pages,) + ((g.kv_heads, g.tokens_per_block, g.head_dim) if g.layout == "HND"
                            else (g.tokens_per_block, g.kv_heads, g.head_dim))
        dtype = HOT_TORCH_DTYPES[spec.dtype]
        self.k_pools = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(g.num_layers)]
        self.v_pools = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(g.num_layers)]
        order = torch.randperm(pages, generator=rng)       # scattered pages, as a real allocator leaves them
        self.page_table = order.reshape(len(originals), per_request).to(torch.int32).to(device)
        self.device = device

    def reset(self) -> None:
        """Empty cache: lengths 0, and each (layer, head)'s map from physical to logical tokens."""
        g = self.geometry
        for pool in self.k_pools + self.v_pools:
            pool.zero_()
        self.lengths = [0] * len(self.originals)
        self.logical = [torch.empty((g.num_layers, g.kv_heads, 0), dtype=torch.int64) for _ in self.originals]

    def append(self, request: int, first: int, count: int) -> None:
        """Write logical tokens ``[first, first + count)`` at the request's physical end."""
        g = self.geometry
        start = self.lengths[request]
        physical = torch.arange(start, start + count)
        pages = self.page_table[request].cpu().long()[physical // g.tokens_per_block].to(self.device)
        slots = (physical % g.tokens_per_block).to(self.device)
        for layer in range(g.num_layers):
            for pool, name in ((self.k_pools[layer], "k"), (self.v_pools[layer], "v")):
                rows = self.originals[request][name][layer][:, first:first + count].transpose(0, 1)  # [n, Hkv, D]
                if g.layout == "HND":
                    pool[pages, :, slots, :] = rows
                else:
                    pool[pages, slots] = rows
        span = torch.arange(first, first + count).expand(g.num_layers, g.kv_heads, count)
        self.logical[request] = torch.cat([self.logical[request], span], dim=2)
        self.lengths[request] += count

    def apply_round(self, request: int, kept: torch.Tensor, mode: str) -> None:
        """Follow a round in the physical->logical map: prompt, then the kept tokens of each
        (layer, head)'s decision row (``kept`` ``[R, budget]`` absolute physical positions)."""
        g = self.geometry
        rows = torch.tensor([oracle.decision_rows(mode, layer, g) for layer in range(g.num_layers)])
        picks = kept.cpu()[rows]                                    # [layers, Hkv, budget]
        current = self.logical[request]
        self.logical[request] = torch.cat([current[:, :, :self.prompt], current.gather(2, picks)], dim=2)

    def cached_rows(self, request: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V rows ``[Hkv, length, D]`` physically in the cache (what decode attention reads)."""
        g = self.geometry
        length = self.lengths[request]
        positions = torch.arange(length, device=self.device)[None, :]
        valid = torch.ones_like(positions, dtype=torch.bool)
        table = self.page_table[request:request + 1]
        k = oracle.gather_token_rows(self.k_pools[layer], table, positions, valid, g)[0]
        v = oracle.gather_token_rows(self.v_pools[layer], table, positions, valid, g)[0]
        return k, v


@dataclass
class BudgetResult:
    """TriAttention at one budget: rounds, their time, and attention over the kept tokens."""

    budget: int
    rounds: int
    round_ms_median: float | None
    round_ms_total: float
    kept_tokens_mean: float            # physical length per request at the end (prompt + kept + since)
    rel_l2: float | None               # attention over the kept tokens vs over every token
    cos_mean: float | None
    cos_min: float | None
    vectors: int
    recent_window_rel_l2: float | None  # the same for prompt + the latest tokens, as many
    kept_rows_equal_original: bool     # the cache holds exactly the original rows of the kept tokens


@dataclass
class EvictionResult:
    family: str
    backend: dict[str, str]            # score / pack / compact: generated (path) or oracle (why)
    requests: int
    prompt: int
    generated: int
    beta: int
    mode: str
    timer: str
    queries: str
    budgets: list[BudgetResult]


def run_eviction(config: DemoConfig) -> EvictionResult:
    sizes = config.sizes
    spec_path, spec = load_family(config, EVICTION_FAMILY)
    layout = family_layout(spec)
    geometry = CacheGeometry.from_spec(spec, layout)
    tri = spec_tri.tri_geometry(spec)
    prompt, generated = sizes.long_prompt, sizes.long_generated
    total = prompt + generated
    generator = KVGenerator(geometry, config.seed + 1, config.device)
    originals = [generator.tokens(1000 + b, total) for b in range(sizes.long_requests)]
    rng = torch.Generator().manual_seed(config.seed + 2)
    cache = LongDecode(spec, originals, prompt, generated, config.device, rng)
    calibration_seed = config.seed + 3
    queries = calibrated_queries(spec, calibration_seed, sizes.queries_per_head, total, config.device)
    with tempfile.TemporaryDirectory(prefix="kvgen-demo-") as tmp:
        calibration_path = Path(tmp) / "calibration.pt"
        calibration = oracle.synthetic_calibration(tri, calibration_seed, CALIBRATION_QUERIES, CALIBRATION_SPREAD,
                                            theta=spec.rope.theta, scaling=spec_tri.rope_scaling(spec))
        oracle.save_calibration(calibration, calibration_path)
        backends, labels = eviction_backends(config, spec, spec_path, calibration_path, cache.k_pools, cache.v_pools)
        results = [evict_at_budget(config, spec, calibration_path, cache, backends, queries, budget)
                   for budget in sizes.budgets]
    return EvictionResult(
        family=EVICTION_FAMILY, backend=labels, requests=sizes.long_requests, prompt=prompt, generated=generated,
        beta=spec.triattention.beta, mode=spec.triattention.eviction_mode, timer=timer_label(config.device),
        queries=f"{sizes.queries_per_head} per query head from the calibrated distribution "
                f"(synthetic_queries, seed {calibration_seed}), RoPE at position {total}",
        budgets=results)


def evict_at_budget(config: DemoConfig, spec: FamilySpec, calibration_path: Path, cache: LongDecode,
                    backends: dict, queries: torch.Tensor, budget: int) -> BudgetResult:
    """Decode every request from an empty cache with TriAttention rounds at ``budget``, then
    compare attention over what the cache kept with attention over every token."""
    from kvgen.runtime.eviction import GenerationStep, TriAttentionManager

    beta = spec.triattention.beta
    manager = TriAttentionManager(spec_tri.eviction_config(spec), calibration_path, cache.k_pools, cache.v_pools, budget=budget, beta=beta,
                                  max_position=cache.prompt + cache.generated + 1, **backends)
    cache.reset()
    ids = list(range(len(cache.originals)))
    for rid in ids:
        cache.append(rid, 0, cache.prompt)
        manager.on_request_init(_Req(rid, cache.prompt))
    round_ms, rounds = [], 0
    done = 0
    while done < cache.generated:
        step = min(beta, cache.generated - done)
        for rid in ids:
            cache.append(rid, cache.prompt + done, step)
        done += step
        generation = GenerationStep(ids, cache.page_table, list(cache.lengths))
        report, ms = time_once(lambda: manager.on_generation_step_end(generation), clock_for(config.device))
        if report.due:
            round_ms.append(ms)
            rounds += 1
            for index, rid in enumerate(report.due):
                cache.apply_round(rid, report.kept[index], manager.mode)
        cache.lengths = list(report.lengths)
    for rid in ids:
        manager.on_request_finish(_Req(rid, cache.prompt))
    ordered = sorted(round_ms)
    return BudgetResult(budget=budget, rounds=rounds,
                        round_ms_median=ordered[len(ordered) // 2] if ordered else None,
                        round_ms_total=sum(ordered), kept_tokens_mean=sum(cache.lengths) / len(cache.lengths),
                        **kept_attention(cache, queries, spec))


def kept_attention(cache: LongDecode, queries: torch.Tensor, spec: FamilySpec) -> dict[str, Any]:
    """Attention over the cached (kept) rows vs over every token, every layer; also a check that
    the cache holds exactly the original rows of the tokens the rounds kept, and the same error for
    a recent-window baseline (prompt + the latest tokens, as many as the cache kept)."""
    scale = 1.0 / math.sqrt(spec.row_dim)
    kept, recent = ErrorStats(), ErrorStats()
    exact = True
    total = cache.prompt + cache.generated
    for rid, original in enumerate(cache.originals):
        length = cache.lengths[rid]
        window = torch.cat([torch.arange(cache.prompt), torch.arange(total - (length - cache.prompt), total)])
        window = window.to(cache.device)
        for layer in range(cache.geometry.num_layers):
            k_all, v_all = original["k"][layer], original["v"][layer]
            reference = attention(queries[layer], k_all, v_all, scale)
            k, v = cache.cached_rows(rid, layer)
            index = cache.logical[rid][layer].to(cache.device)[..., None].expand(-1, -1, k_all.shape[-1])
            exact &= bool(torch.equal(k, k_all.gather(1, index)) and torch.equal(v, v_all.gather(1, index)))
            kept.add(reference, attention(queries[layer], k, v, scale))
            recent.add(reference, attention(queries[layer], k_all[:, window], v_all[:, window], scale))
    summary = kept.summary()
    return {"rel_l2": summary["rel_l2"], "cos_mean": summary["cos_mean"], "cos_min": summary["cos_min"],
            "vectors": summary["vectors"], "recent_window_rel_l2": recent.summary()["rel_l2"],
            "kept_rows_equal_original": exact}
