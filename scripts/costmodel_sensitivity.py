#!/usr/bin/env python3
"""How much the cost model's compaction verdicts hang on its two least-sourced numbers: the bytes a warp of
the tile walk keeps in flight (``warp_inflight_bytes``, calibrated in-sample) and the L2 hit
latency of the page-table load (``l2_latency_ns``, an estimate). Re-runs the compaction validation
over a grid of both and writes Spearman / pick gap per study.

    python scripts/costmodel_sensitivity.py --features docs/tuning-evidence/costmodel-features-sm_90a.json \\
        --out docs/tuning-evidence/costmodel-walk-sensitivity.md
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from kvgen.tuning.costmodel import targets  # noqa: E402
from kvgen.tuning.costmodel.model import VERSION  # noqa: E402
from kvgen.tuning.costmodel.validate import SPEARMAN_GOAL, TOP_PICK_GOAL, validate  # noqa: E402

WARP_INFLIGHT = (1950, 2600, 3250, 5200)     # 3, 4, 5 and 8 B/ns per warp x 650 ns
L2_LATENCY = (100, 200, 400)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--features", type=Path, required=True)
    parser.add_argument("--measurements", type=Path,
                        default=ROOT / "results/2026-11-30-h200-tuned/tuning/measurements-codec-compact.jsonl")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    features = {k: v for k, v in json.loads(args.features.read_text()).items() if "|compact|" in k}
    base = targets.TARGETS["sm_90a"]
    header, lines = None, []
    try:
        for inflight in WARP_INFLIGHT:
            for l2 in L2_LATENCY:
                targets.TARGETS["sm_90a"] = dataclasses.replace(base, warp_inflight_bytes=inflight, l2_latency_ns=l2)
                results = validate([args.measurements], features)
                header = header or [f"{r['family']} {r['bucket']}" for r in results]
                cells = [f"{r['spearman']:.2f} / {100 * r['top_pick_gap']:.1f} %"
                         + ("" if r["spearman"] >= SPEARMAN_GOAL and r["top_pick_gap"] <= TOP_PICK_GOAL else " x")
                         for r in results]
                lines.append(f"| {inflight} | {l2} | " + " | ".join(cells) + " |")
    finally:
        targets.TARGETS["sm_90a"] = base
    text = [f"Compaction under cost model {VERSION} with the walk's two least-sourced numbers varied: Spearman / the "
            "model pick's gap to the measured best per study ('x': misses a goal). The committed table uses "
            f"{base.warp_inflight_bytes} B and {base.l2_latency_ns} ns.", "",
            "| warp in-flight bytes | L2 latency ns | " + " | ".join(header) + " |",
            "|---|---|" + "---|" * len(header), *lines]
    args.out.write_text("\n".join(text) + "\n")
    print("\n".join(text))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
