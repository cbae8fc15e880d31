#!/usr/bin/env python3
"""Diagnosis only (not part of kvgen): the compaction workload of cost model 5 and the variants the
README discusses, each validated like ``python -m kvgen.tuning.costmodel.validate --gpu h100`` on the
eighteenth session's H100 measurements. Every variant replaces ``workload.compact_launches`` and
``model.walk_time`` as a whole, so the model 5 row reproduces model 5 on any later code whose other
terms are model 5's (model 6's are). Switches:

- ``tile``: the tile is the kernel's ``tile_moves`` (model 5: read off the loop's vector stores / ring);
- ``ahead``: a load issued n steps before its use bounds a step at latency / n (rows: n = load_ahead;
  the move index under index_ahead: n = 1);
- ``inflight``: a warp's bytes in flight are its loop's row loads (32 x the loop's load bytes x
  load_ahead / (load_ahead + 1), ``Phase.inflight_per_thread``) instead of the calibrated 2600 B;
- ``swa``: the bytes are those of the real moves (gpt-oss-20b: 12 of its 24 layers keep a 128-token
  window, so 1920 of their 2048 slots per (request, head) are fill moves that copy nothing).

tile + ahead is model 6. Run from the repository root:

    python docs/tuning-evidence/costmodel5-compact-h100/whatif.py > docs/tuning-evidence/costmodel5-compact-h100/whatif.md
"""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import kvgen.tuning.costmodel.model as model
import kvgen.tuning.costmodel.predict as predict
from kvgen.paths import spec_path
from kvgen.spec.schema import load_spec
from kvgen.tuning.costmodel.model import Launch, Phase, Walk
from kvgen.tuning.costmodel.validate import validate
from kvgen.tuning.costmodel.workload import compact_tile, pick_kernel, pick_loop

HERE = Path(__file__).resolve().parent
MEASUREMENTS = sorted(Path("results/2026-12-07-h100-s18/call3").glob("ct-*.jsonl"))


def real_move_share(family: str, budget: int = 2048) -> float:
    """Share of the walked slots that move bytes: sliding-window layers move only their window."""
    spec = load_spec(spec_path(family))
    windows = [spec.layer_window(layer) for layer in range(spec.layers)]
    return sum(min(w, budget) if w else budget for w in windows) / (spec.layers * budget)


SWA = {load_spec(spec_path(f)).layers: real_move_share(f) for f in ("gpt-oss-20b", "qwen3-8b", "qwen3.5-397b-a17b")}


def variant(tile_from_kernel: bool, ahead: bool, inflight: bool, swa: bool):
    def compact_launches(features, params, geometry, batch, moves):
        kernel = pick_kernel(features, "compact_kernel")
        slices = params.get("slices", 1)
        ctas = batch * geometry["kv_heads"] * geometry["layers"] * slices
        per_move = 2 * geometry["head_dim"] * geometry["elem_bytes"] // slices
        share = SWA[geometry["layers"]] if swa else 1.0
        walk = pick_loop(kernel, "global_load", "global_store")
        load_ahead = params.get("load_ahead", 1)
        ring = load_ahead + 1
        if tile_from_kernel:
            tile = compact_tile(params, per_move // 16)
        else:   # model 5
            tile = max(1, int(walk.memory["global_store"] / ring * params["threads"] // (per_move // 16)))
        chain = ("l2",) if params.get("index_ahead", 0) else ("hbm", "l2")
        early = (("hbm", load_ahead),) + ((("hbm", 1),) if params.get("index_ahead", 0) else ())
        return [Launch("compact", kernel, ctas, params["threads"], 0,
                       (Phase("move", 2.0 * ctas * moves * per_move * share, "hbm", walk,
                              float(walk.load_bytes) * (ring - 1) / ring,
                              walk=Walk(math.ceil(moves / tile), 2.0 * tile * per_move * share, chain, prologue=3,
                                        ahead=early if ahead else ())),))]

    def walk_time(walk, step, launch, resident, t):
        latency = {"hbm": t.dram_latency_ns, "l2": t.l2_latency_ns}
        dram = t.dram_latency_ns * 1e-9
        chain = sum(latency[w] for w in walk.chain) * 1e-9 + step.total * t.dependent_issue_cycles / (t.clock_ghz * 1e9)
        chain = max([chain] + [latency[w] * 1e-9 / n for w, n in walk.ahead])
        warps = math.ceil(launch.threads / 32)
        per_warp = 32 * launch.phases[0].inflight_per_thread if inflight else t.warp_inflight_bytes
        moved = walk.step_bytes * dram / (warps * per_warp)
        wave_ctas = min(launch.ctas, t.sms * resident)
        streamed = wave_ctas * walk.step_bytes / (t.hbm_gbs * t.hbm_efficiency * 1e9)
        waves = max(1.0, launch.ctas / (t.sms * resident))
        return waves * (walk.steps * math.hypot(chain + moved, streamed) + walk.prologue * dram)

    return compact_launches, walk_time


def main() -> None:
    features: dict = json.loads((HERE / "features-sm_90a.json").read_text())
    print("Spearman / model pick's gap to the measured best per study (* meets both goals), H100 table.\n")
    header = None
    for swa, tile, ahead, inflight in itertools.product((False, True), repeat=4):
        predict.compact_launches, model.walk_time = variant(tile, ahead, inflight, swa)
        results = validate(MEASUREMENTS, features, gpu="h100")
        if header is None:
            header = [f"{r['family']} {r['bucket']}" for r in results]
            print("| tile | ahead | inflight | swa | " + " | ".join(header) + " | passes |")
            print("|---|---|---|---|" + "---|" * len(header) + "---|")
        name = "model 5" if not (tile or ahead or inflight or swa) else \
            "model 6" if (tile and ahead and not inflight and not swa) else ""
        cells = " | ".join(f"{r['spearman']:.2f} / {100 * r['top_pick_gap']:.1f} %{' *' if r['passes'] else ''}"
                           for r in results)
        flags = " | ".join("yes" if x else "-" for x in (tile, ahead, inflight, swa))
        print(f"| {flags} | {cells} | {sum(r['passes'] for r in results)}{' (' + name + ')' if name else ''} |")


if __name__ == "__main__":
    main()
