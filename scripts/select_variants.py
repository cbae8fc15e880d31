"""Variants of the selection's statistics and aggregation kernels on the GPU: which launch shapes
are fastest, each checked bit for bit against the shipped kernels (``kvgen/kernels/triton/select.py``)
on the same scores. A decision input for the tunables, like ``score_variants.py``; the numbers the
docs quote come from ``kvgen bench``.

The statistics kernel reads every score row twice (mean, then the squared deviations); its
tunables (``rows``, ``stats_unroll``, ``stats_warps``) decide how many rows are between their two
reads, so how much of the second read hits L2. The aggregation's are ``block_w`` and
``aggregate_warps``. (``results/2026-12-03-h200-s8/callA`` was measured by this script's first
form, which also tried a persistent grid and L2 eviction hints: neither beat the plain grid
beyond the noise, so neither became a tunable.)

    python scripts/select_variants.py [--batch 32] [--width 16384] > variants.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics

import torch

from kvgen.kernels.triton import select as shipped

# qwen3-8b: 36 scored layers, 8 KV heads x 4 query heads.
LAYERS, KV_HEADS, GROUP = 36, 8, 4
# The launch shapes before the eighth session, the baseline every variant is checked against.
SHIPPED_BEFORE = {"rows": 2, "stats_unroll": 1, "stats_warps": 4, "block_w": 128, "aggregate_warps": 4, "block": 512,
                  "radix_bits": 4}


def timed(fn, repeats: int = 15) -> float:
    """Median milliseconds of ``fn`` over ``repeats`` runs after one warm-up."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def copy_ms(nbytes: int) -> float:
    """A device-to-device copy of ``nbytes`` (read + write), the ceiling the ratios use."""
    a = torch.empty(nbytes // 4, dtype=torch.float32, device="cuda")
    b = torch.empty_like(a)
    return timed(lambda: b.copy_(a))


def selector(**tunables: int) -> shipped.TritonSelector:
    return shipped.TritonSelector(LAYERS, KV_HEADS, GROUP, range(LAYERS), **{**SHIPPED_BEFORE, **tunables})


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--width", type=int, default=16384)
    args = parser.parse_args()
    torch.manual_seed(0)
    B, W = args.batch, args.width
    heads = KV_HEADS * GROUP
    scores = torch.randn((LAYERS, B, heads, W), dtype=torch.float32, device="cuda") * 3 + 1
    width = torch.full((B,), W, dtype=torch.int64, device="cuda")
    width[::3] = W - 1000            # rows of unequal width
    base = selector()
    nbytes = scores.numel() * 4
    result = {"batch": B, "width": W, "score_bytes": nbytes, "copy_ms": copy_ms(nbytes), "baseline": SHIPPED_BEFORE,
              "stats": [], "aggregate": []}
    ref_mean, ref_std = base.statistics(scores, width)
    for rows, unroll, warps in itertools.product((1, 2), (1, 2, 4, 8), (4, 8)):
        sel = selector(rows=rows, stats_unroll=unroll, stats_warps=warps)
        mean, std = sel.statistics(scores, width)
        same = torch.equal(mean.view(torch.int32), ref_mean.view(torch.int32)) and torch.equal(
            std.view(torch.int32), ref_std.view(torch.int32))
        result["stats"].append({"rows": rows, "stats_unroll": unroll, "stats_warps": warps, "identical": bool(same),
                                "ms": timed(lambda: sel.statistics(scores, width))})
    ref_union = base.aggregate(scores, ref_mean, ref_std, width, "union")
    for block_w, warps in itertools.product((32, 64, 128, 256), (2, 4, 8)):
        sel = selector(block_w=block_w, aggregate_warps=warps)
        out = sel.aggregate(scores, ref_mean, ref_std, width, "union")
        result["aggregate"].append({"block_w": block_w, "aggregate_warps": warps,
                                    "identical": bool(torch.equal(out.view(torch.int32), ref_union.view(torch.int32))),
                                    "ms": timed(lambda: sel.aggregate(scores, ref_mean, ref_std, width, "union"))})
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
