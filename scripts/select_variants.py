"""Launch shapes and routes of the selection's kernels on the GPU: which are fastest, each checked
bit for bit against the family's shipped constants (``generated/<family>/select.py``) on the same
scores. A decision input for the select tunables, like ``score_variants.py``; the figures the docs
quote as round stages come from ``kvgen bench``.

- statistics: ``stats_resident`` (a row read once from registers, or twice: the second read
  partly from L2) x ``stats_warps`` x ``rows``;
- aggregate (union): ``block_w`` x ``aggregate_warps`` x ``head_step`` (heads a step of the max holds);
- select (one program per decision row, union mode: B rows): ``select_route`` (comparisons or
  histograms) x ``radix_bits`` x ``block`` x ``select_warps``;
- queue (``aggregate_route`` 1: statistics and aggregation as one launch, each chunk's rows read
  again from L2): ``queue_lag`` x ``chunk_requests`` x ``queue_programs`` x ``block_w`` x
  ``head_step`` x the warps a program (``stats_warps``: 16 holds two programs a SM at most), against
  the two launches apart (``apart_ms``) in the same run; mean, std and the values of every mode
  checked.
(``results/2026-12-03-h200-s8/callA`` was measured by this script's first form, which also tried
a persistent grid and L2 eviction hints: neither beat the plain grid beyond the noise.)

    python scripts/select_variants.py --family qwen3-8b [--batch 32] [--width 16384] [--only queue] > variants.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from pathlib import Path

import torch

from kvgen.kernels.triton import select as kernels
from kvgen.runtime.select import load_select_module

ROOT = Path(__file__).resolve().parents[1]


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


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int32), b.view(torch.int32)) if a.is_floating_point() else torch.equal(a, b)


SECTIONS = ("stats", "aggregate", "select", "queue")


def queue_variants(selector, shipped, scores, width, result) -> None:  # noqa: ANN001
    """``aggregate_route`` 1 against the shipped two launches (``apart_ms``, same scores)."""
    def apart():  # noqa: ANN202
        mean, std = shipped.statistics(scores, width)
        return mean, std, shipped.aggregate(scores, mean, std, width, "union")

    result["apart_ms"] = timed(apart)
    mean, std = shipped.statistics(scores, width)
    reference = {mode: (mean, std, shipped.aggregate(scores, mean, std, width, mode)) for mode in kernels.MODES}
    for lag, chunk, programs, block_w, step, warps in itertools.product((2, 4, 8), (1,), (2, 4), (64, 256), (0, 8),
                                                                        (8, 16)):
        sel = selector(aggregate_route=1, chunk_requests=chunk, queue_lag=lag, queue_programs=programs,
                       block_w=block_w, head_step=step, stats_warps=warps)
        modes = kernels.MODES if not result["queue"] else ("union",)   # every mode once, then the bench's
        identical = all(all(same_bits(a, b) for a, b in zip(sel.statistics_aggregate(scores, width, mode),
                                                              reference[mode])) for mode in modes)
        result["queue"].append({"queue_lag": lag, "chunk_requests": chunk, "queue_programs": programs,
                                "block_w": block_w, "head_step": step, "stats_warps": warps,
                                "identical": identical, "modes_checked": list(modes),
                                "ms": timed(lambda: sel.statistics_aggregate(scores, width, "union"))})
        print("queue", result["queue"][-1], flush=True, file=sys.stderr)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--family", default="qwen3-8b")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--width", type=int, default=16384)
    parser.add_argument("--budget", type=int, default=2048)
    parser.add_argument("--only", choices=SECTIONS, action="append", help="sections to run (default: all)")
    args = parser.parse_args()
    sections = args.only or SECTIONS
    shipped = load_select_module(ROOT / "generated" / args.family / "select.py").SELECTOR
    base = shipped.tunables()

    def selector(**changes: int) -> kernels.TritonSelector:
        return kernels.TritonSelector(shipped.num_layers, shipped.kv_heads, shipped.group, shipped.scored_layers,
                                      **{**base, **changes})

    torch.manual_seed(0)
    B, W = args.batch, args.width
    scores = torch.randn((len(shipped.scored_layers), B, shipped.query_heads, W), dtype=torch.float32,
                         device="cuda") * 3 + 1
    width = torch.full((B,), W, dtype=torch.int64, device="cuda")
    width[1::3] = W - 1000            # rows of unequal width
    P = torch.zeros(B, dtype=torch.int64, device="cuda")
    nbytes = scores.numel() * 4
    result = {"family": args.family, "batch": B, "width": W, "budget": args.budget, "score_bytes": nbytes,
              "copy_ms": copy_ms(nbytes), "shipped": base, "stats": [], "aggregate": [], "select": [], "queue": []}
    if "queue" in sections:
        queue_variants(selector, shipped, scores, width, result)
    ref_mean, ref_std = shipped.statistics(scores, width)
    # one row a program: two held rows would double the registers a program needs
    for resident, warps in itertools.product((0, 8192, 16384) if "stats" in sections else (), (8, 16)):
        sel = selector(stats_resident=resident, stats_warps=warps, rows=1)
        mean, std = sel.statistics(scores, width)
        result["stats"].append({"stats_resident": resident, "stats_warps": warps, "rows": 1,
                                "identical": same_bits(mean, ref_mean) and same_bits(std, ref_std),
                                "ms": timed(lambda: sel.statistics(scores, width))})
        print("stats", result["stats"][-1], flush=True, file=sys.stderr)
    values = shipped.aggregate(scores, ref_mean, ref_std, width, "union")
    for block_w, warps, step in itertools.product((32, 64, 128, 256) if "aggregate" in sections else (), (2, 4, 8),
                                                  (0, 8)):
        sel = selector(block_w=block_w, aggregate_warps=warps, head_step=step)
        out = sel.aggregate(scores, ref_mean, ref_std, width, "union")
        result["aggregate"].append({"block_w": block_w, "aggregate_warps": warps, "head_step": step,
                                    "identical": same_bits(out, values),
                                    "ms": timed(lambda: sel.aggregate(scores, ref_mean, ref_std, width, "union"))})
        print("aggregate", result["aggregate"][-1], flush=True, file=sys.stderr)
    ref_kept = shipped.select(values, width, args.budget, P).check()
    configs = [(0, 4, 512, 4), (0, 4, 1024, 8)]
    configs += [(1, bits, block, warps) for bits, block, warps in itertools.product((4, 8), (1024, 4096), (4, 16))]
    for route, bits, block, warps in configs if "select" in sections else ():
        sel = selector(select_route=route, radix_bits=bits, block=block, select_warps=warps)
        kept = sel.select(values, width, args.budget, P).check()
        result["select"].append({"select_route": route, "radix_bits": bits, "block": block, "select_warps": warps,
                                 "identical": same_bits(kept, ref_kept),
                                 "ms": timed(lambda: sel.select(values, width, args.budget, P))})
        print("select", result["select"][-1], flush=True, file=sys.stderr)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
