#!/usr/bin/env python3
"""A small tuning bundle of codec variants: one candidate per value of each new codec tunable, the
others at their defaults, for the GPU machine to verify and time (no full ``kvgen tune`` grid).

Built here (nvcc, no GPU); measured there with the tuner's correctness-gated timer, which checks
every candidate's bytes against the oracle before timing it per bucket:

    python scripts/codec_variants_bundle.py --out build/tune/codec-variants     # here
    python -m kvgen.tuning.measure build/tune/codec-variants.tar.xz --out m.jsonl  # on the H200

Variant sets (``--set``): ``launch``: the defaults; ``decode_route`` 0; ``rounding`` 0;
``min_blocks`` 0..4 at 512 threads and 1..4 at 256 (0 at 256 is the default). ``routes``: the
previous defaults (``rounding`` 1, ``decode_split`` 1); ``hot_batch`` 2 and 4 (plain blocks loaded per
thread before encoding them); ``rounding`` 2 (fused FMA-pipe rounding); ``decode_split`` 2 (half
blocks per thread in decode); the last three together (the set of
results/2026-12-02-h200/codec_device_check.json). ``defaults``: the previous defaults, then today's
(``rounding`` 3, built as 2 off fp8, ``decode_split`` 2, chosen from that measurement and
results/2026-12-02-h200/codec3/), to confirm them. ``packed``: ``rounding`` 2; the default ``rounding`` 3
(FP8 hot pages on packed fp16 lanes; other families build 2); the same at 512 threads with min_blocks 3
(40 registers instead of 47). ``bf16packed``: ``rounding`` 2 (what bf16 families build today), then
``rounding`` 4 (BF16 hot pages: binary32 products, codes on packed fp16 lanes; fp8 builds 3) at the
default launch and at 512 threads with min_blocks 3.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FAMILIES = ("qwen3-8b", "deepseek-v3", "deepseek-v4-csa", "qwen3-8b-fp8")
SETS = ("launch", "routes", "defaults", "packed", "bf16packed")
# The codec defaults before results/2026-12-02-h200/codec_device_check.json chose rounding 2, decode_split 2.
PREVIOUS_DEFAULTS = {"rounding": 1, "decode_split": 1}


def variants(which: str = "launch") -> list[dict[str, int]]:
    sys.path.insert(0, str(ROOT))
    from kvgen.lower.plan import default_params

    base = default_params("codec")
    if which == "defaults":
        return [{**base, **PREVIOUS_DEFAULTS}, base]
    if which == "packed":
        changes = [{"rounding": 2}, {}, {"threads": 512, "min_blocks": 3}]
    elif which == "bf16packed":
        changes = [{"rounding": 2}, {"rounding": 4}, {"rounding": 4, "threads": 512, "min_blocks": 3}]
    elif which == "routes":
        base = {**base, **PREVIOUS_DEFAULTS}
        changes = [{}, {"hot_batch": 2}, {"hot_batch": 4}, {"rounding": 2}, {"decode_split": 2},
                   {"rounding": 2, "hot_batch": 2, "decode_split": 2}]
    else:
        changes = [{}, {"decode_route": 0}, {"rounding": 0}]
        changes += [{"threads": 512, "min_blocks": m} for m in (0, 1, 2, 3, 4)]
        changes += [{"threads": 256, "min_blocks": m} for m in (1, 2, 3, 4)]
    return [{**base, **c} for c in changes]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "build" / "tune" / "codec-variants")
    parser.add_argument("--family", action="append", choices=FAMILIES, help="default: all four")
    parser.add_argument("--arch", default="sm_90a")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--set", dest="which", choices=SETS, default="launch")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from kvgen import paths
    from kvgen.build.job import load_spec_source
    from kvgen.cli import discover_toolchains
    from kvgen.tuning.candidates import Request, build_candidates, pack_bundle

    requests = [Request(load_spec_source(ROOT / "specs" / f"{family}.yaml"), "codec", params)
                for family in args.family or FAMILIES for params in variants(args.which)]
    built = build_candidates(requests, args.arch, args.out, paths.cache_dir(), toolchains=discover_toolchains(),
                             jobs=args.jobs)
    for c in built:
        print(f"{c.family} {c.config}: {c.status}")
    archive = pack_bundle(args.out, args.out.with_suffix(".tar.xz"))
    print(f"bundle {args.out} -> {archive}")
    return 0 if all(c.status != "failed" for c in built) else 1


if __name__ == "__main__":
    raise SystemExit(main())
