"""Whole TriAttention eviction rounds on the GPU, stage by stage, against the round's bytes limit.

Per family (head 128: qwen3-8b; head 64: gpt-oss-20b; head 256: gemma-2-9b; partial rotary:
qwen3.5-397b-a17b) and batch (1 and 32): ``width`` decode tokens after a 1024-token prompt, pages
scattered, every request due (budget 2048 or the spec's when larger, union unless ``mode``), the family's generated kernels
(``kvgen.measure.workloads.round``). Stages: score, normalize/aggregate/select (and its
kernels: statistics, aggregate, both as one launch, select), pack, compact, and the whole round
(``TriAttentionManager.run_round``: one input copy, one synchronization). Each is timed alone on
the same cache (CUDA events, median of 5 after a warm-up; the round compacts in place every
time, which moves the same bytes).

Bytes limit: K read once + the compaction moves read and written, at the copy ceiling measured
in the same run; ``round_over_limit`` = whole round / limit (issue 14's goal: <= 1.3). A cache
larger than 80 % of the free memory gives only the layers that fit pools of their own, and the
others share them round robin (``layers_with_own_pools`` of ``layers``; every layer is still scored
and compacted, each K far larger than the L2: qwen3-8b at batch 32 is ~82 GB, more than an H100
holds); a case where fewer than ``MIN_OWN_LAYERS`` layers fit (and not all of them) is recorded as
skipped, with its size; a case that fails is recorded with its error and the others still run.

Usage: ``kvgen bench run --only round`` (or ``python -m kvgen.bench run --only round``).
"""

from __future__ import annotations

import gc
from pathlib import Path

import torch

from kvgen import paths
from kvgen.bench.report import shared_pools_note
from kvgen.bench.score import score_family
from kvgen.lower.triattention import eviction_config
from kvgen.measure.timing import summary, time_ms
from kvgen.measure.workloads.round import (
    RoundCase,
    bytes_limit,
    cache_bytes,
    layers_that_fit,
    round_artifacts,
    score_round_trip,
)

FAMILIES = ("qwen3-8b", "gpt-oss-20b", "gemma-2-9b", "qwen3.5-397b-a17b")
BATCHES = (1, 32)
BUDGET = 2048  # at least; a family whose spec declares more (SWA windows: gemma-2-9b's 4096) uses its own
GOAL = 1.3   # issue 14: a whole round within 1.3x of its bytes limit
CACHE_SHARE = 0.8   # of the free memory, for K and V; the rest is the round's scores and workspace
# Layers on one pool are own_layers apart in every launch (layer-major grids): at batch 32 that is
# thousands of CTAs, far more than run at once, so none reads another's bytes from the L2.
MIN_OWN_LAYERS = 4


def bench_round(family: str, batch: int, width: int, copy: dict, registry: Path, arch: str, mode: str,
                specs: Path | None = None) -> dict:
    spec, scoring = score_family(family, specs)
    config = eviction_config(spec)
    budget = max(BUDGET, config.budget)
    need = cache_bytes(scoring, batch, width)
    record = {"family": family, "batch": batch, "width": width, "budget": budget, "mode": mode,
              "cache_bytes": need}
    free, _ = torch.cuda.mem_get_info()
    own = layers_that_fit(scoring, batch, width, free, CACHE_SHARE)
    layers = scoring.geometry.num_layers
    if own < min(MIN_OWN_LAYERS, layers):
        record["skipped"] = (f"K+V cache {need / 2**30:.1f} GiB: fewer than {MIN_OWN_LAYERS} layers fit in "
                             f"{CACHE_SHARE:.0%} of {free / 2**30:.1f} GiB free")
        print(f"round {family} B={batch}: skipped ({record['skipped']})")
        return record
    record.update(layers=layers, layers_with_own_pools=own)
    artifacts = round_artifacts(family, registry, arch, paths.generated_dir())
    case = RoundCase(config, scoring, batch, width, artifacts, budget, mode, own if own < layers else None)
    stages = {name: summary(time_ms(fn, reps=5, warmup=1)) for name, fn in case.stages().items()}
    limit_bytes = bytes_limit(scoring, batch, width, budget)
    gbps = copy["gbps_read_plus_write"]
    limit_ms = sum(limit_bytes.values()) / gbps / 1e6
    scores_bytes = score_round_trip(scoring, batch, width)
    floor_ms = limit_ms + scores_bytes / gbps / 1e6
    round_ms = stages.pop("round")["median_ms"]
    record.update({"artifacts": artifacts.note, "selection": str(case.manager.selector.path_for(batch, width)),
                   "score_served_by": str(artifacts.score.library_for(batch, width).path), "stages": stages,
                   "round_ms": round_ms, "bytes": limit_bytes, "limit_ms": limit_ms,
                   "limit_parts_ms": {k: v / gbps / 1e6 for k, v in limit_bytes.items()},
                   "round_over_limit": round_ms / limit_ms, "goal": GOAL,
                   "score_round_trip_bytes": scores_bytes, "floor_ms": floor_ms, "round_over_floor": round_ms / floor_ms})
    parts = ", ".join(f"{k} {v['median_ms']:.2f}" for k, v in stages.items())
    print(f"round {family} B={batch} W={width}: {round_ms:.2f} ms = {round_ms / limit_ms:.2f} x the bytes limit "
          f"{limit_ms:.2f} ms, {round_ms / floor_ms:.2f} x the floor {floor_ms:.2f} ms "
          f"({parts}; {artifacts.note}{shared_pools_note(record)})", flush=True)
    return record


def run(ceilings: dict, width: int = 16384, batches: tuple[int, ...] = BATCHES, registry: Path | None = None,
        arch: str = "sm_90a", mode: str = "union", specs: Path | None = None,
        families: tuple[str, ...] = FAMILIES) -> dict:
    """``{"results": [one record per family and batch]}`` against ``ceilings["device_copy"]``."""
    copy = ceilings["device_copy"]
    registry = paths.registry_dir(registry)
    results = []
    for family in families:
        for batch in batches:
            try:
                results.append(bench_round(family, batch, width, copy, registry, arch, mode, specs))
            except Exception as exc:  # noqa: BLE001 - recorded; the other cases still run
                results.append({"family": family, "batch": batch, "width": width, "budget": BUDGET, "mode": mode,
                                "error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"})
                print(f"round {family} B={batch} failed: {results[-1]['error']}", flush=True)
            gc.collect()
            torch.cuda.empty_cache()
    return {"results": results}
