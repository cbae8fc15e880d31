#!/usr/bin/env python3
"""One launch of each named scorer variant of a ``score_variants_bundle.py`` bundle, on one cache,
for Nsight Compute to profile (issue 14 item 1: is the scorer bound by shared-memory coefficient
traffic, instruction issue or DRAM latency?):

    ncu --clock-control none -k regex:TriScoreKernel -s 1 -c 2 --csv --page raw \\
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables \\
        --section WarpStateStats --section InstructionStats --section ComputeWorkloadAnalysis \\
        python3 scripts/ncu_score.py BUNDLE_DIR qwen3-8b shipped CONFIG

``shipped`` names the family's shipped configuration (``variants.json``); each other argument is a
config id of the bundle. One warm-up launch of the first variant runs before them (``-s 1`` skips
it). ``--batch`` (default 4) and ``--width`` (default 16384) keep ncu's replays (every pass restores
the scores) well under a minute.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("bundle", type=Path, help="directory with score-variants.tar.xz (or an unpacked bundle)")
    parser.add_argument("family")
    parser.add_argument("configs", nargs="+", help="config ids of the bundle, or 'shipped'")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--width", type=int, default=16384)
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "scripts"))
    import torch
    from score_variants import unpack

    from kvgen.bench.score import score_family
    from kvgen.measure.workloads.score import ScoreCache
    from kvgen.runtime.score import ScoreLibrary
    from kvgen.tuning.candidates import read_index

    bundle = unpack(args.bundle, Path(tempfile.mkdtemp(prefix="kvgen-ncu-score-")))
    shipped = json.loads((bundle / "variants.json").read_text())["shipped"]
    by_config = {c.config: c for c in read_index(bundle) if c.family == args.family}
    configs = [shipped[args.family] if c == "shipped" else c for c in args.configs]
    missing = [c for c in configs if c not in by_config]
    if missing:
        raise SystemExit(f"{args.bundle}: no {args.family} variant {', '.join(missing)}; it has:\n  "
                         + "\n  ".join(by_config))
    _, scoring = score_family(args.family)
    inputs = ScoreCache(scoring, args.batch, args.width).kernel_inputs()
    libs = [ScoreLibrary(bundle / by_config[c].artifact, family=args.family) for c in configs]
    libs[0].score(**inputs)   # warm-up (module load), skipped by ncu -s 1
    for config, lib in zip(configs, libs):
        lib.score(**inputs)
        torch.cuda.synchronize()
        print(f"launched {args.family} {config}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
