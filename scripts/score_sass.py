#!/usr/bin/env python3
"""SASS instruction mix of each scorer variant of a ``score_variants_bundle.py`` bundle, per token,
without a GPU, and what it implies on the H200 (issue 14 item 1):

    python scripts/score_sass.py build/device/scorer2 [--out results/x.json]

Per variant: registers and stack (``cuobjdump --dump-resource-usage``), then the instructions of
the stage loop (the backward branch whose body reads shared memory; a kernel whose stage loop is
unrolled is taken whole) divided by the tokens a thread scores in it: instructions per thread and
token. A token (one K row of one KV head) is ``lanes`` threads, so a warp-instruction covers
``32 / lanes`` tokens. Per token and SM at the copy ceiling the budget is
``(K bytes + score bytes) / (copy GB/s / SMs / clock)`` cycles; against it:
- ``issue``: warp-instructions / 4 (four schedulers, one each per cycle);
- ``fp32``: FFMA + FMUL + FADD warp-instructions / 4 (128 FP32 lanes);
- ``lds``: coefficient bytes delivered to registers (every LDS.128 lane gets 16 bytes, broadcast
  or not) / 128 B per cycle (the shared-memory data path), the reading to check with Nsight's
  ``l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld`` per shared load instruction.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COPY_GBPS, SMS, CLOCK_GHZ = 4161.0, 132, 1.98   # results/2026-12-02-h200/score_variants.log, H200 boost
ROW = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")
CLASSES = {"FFMA": "fp32", "FMUL": "fp32", "FADD": "fp32", "LDS": "lds", "LDG": "ldg", "MUFU": "mufu", "STG": "stg"}


def stage_loop(rows: list[tuple[int, str]]) -> list[tuple[int, str]] | None:
    """The largest loop body (backward branch target .. branch) that reads shared memory."""
    best = None
    for addr, op, args in rows:
        target = re.search(r"0x([0-9a-f]+)", args) if op.startswith("BRA") else None
        if target and int(target.group(1), 16) < addr:
            body = [r for r in rows if int(target.group(1), 16) <= r[0] <= addr]
            if any(r[1].startswith("LDS") for r in body) and (best is None or len(body) > len(best)):
                best = body
    return best


def analyse(candidate: dict, bundle: Path, tmp: Path, geometry: dict) -> dict:
    from kvgen.tuning.costmodel.features import cuobjdump, embedded_cubin

    tool = str(cuobjdump())
    cubin = embedded_cubin(bundle / candidate["artifact"], tmp / "score.cubin")
    usage = subprocess.run([tool, "--dump-resource-usage", str(cubin)], capture_output=True, text=True).stdout
    regs, stack = (int(x) for x in re.search(r"REG:(\d+) STACK:(\d+)", usage).groups())
    sass = subprocess.run([tool, "-sass", str(cubin)], capture_output=True, text=True).stdout
    rows = [(int(m.group(1), 16), m.group(2), m.group(3)) for m in ROW.finditer(sass)]
    p = candidate["params"]
    body = stage_loop(rows)
    tokens = p["tokens_per_thread"] * (1 if body else p["token_tiles"])
    ops = collections.Counter(op for _, op, _ in body or rows)
    per = collections.Counter()
    for op, n in ops.items():
        per[CLASSES.get(op.split(".")[0], "other")] += n / tokens
    per["total"] = sum(ops.values()) / tokens
    lds_bytes = sum(n * (16 if ".128" in op else 8 if ".64" in op else 4) for op, n in ops.items()
                    if op.startswith("LDS")) / tokens
    threads_per_token = geometry["lanes"]
    per_sm_clk = COPY_GBPS / SMS / CLOCK_GHZ   # bytes per cycle per SM at the copy ceiling
    budget = (geometry["k_bytes"] + geometry["score_bytes"]) / per_sm_clk
    warp = threads_per_token / 32              # warp-instructions per thread-instruction of one token
    model = {"budget_clk": budget, "issue_clk": per["total"] * warp / 4, "fp32_clk": per["fp32"] * warp / 4,
             "lds_clk": lds_bytes * threads_per_token / 128}
    bounds = {k.replace("_clk", "_bound"): budget / v for k, v in model.items() if k != "budget_clk" and v}
    return {"family": candidate["family"], "config": candidate["config"], "registers": regs, "stack": stack,
            "loop": "rolled" if body else "unrolled", "per_thread_token": dict(per), "lds_bytes_per_thread_token":
            lds_bytes, **model, **bounds}


def family_geometry(family: str) -> dict:
    """Lanes and bytes per token (one K row of one KV head): the rotated span read, scores written."""
    from kvgen.build.job import load_spec_source
    from kvgen.lower.plan import score_geometry
    spec = load_spec_source(ROOT / "specs" / f"{family}.yaml").spec
    g = score_geometry(spec)
    return {"k_bytes": g["rotary_dim"] * spec.elem_bytes, "score_bytes": 4 * (g["query_heads"] // g["kv_heads"])}


def threads_per_token(params: dict) -> float:
    """Threads a token's work is spread over: ``lanes`` (form 0); form 1's warp scores 16 tokens per
    MMA tile (a warp-instruction covers 16 · mma_tiles tokens: 32 / that threads a token)."""
    return params["lanes"] if params.get("form", 0) == 0 else 32 / (16 * params["mma_tiles"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("bundle", type=Path, help="an unpacked bundle (bundle.json) or its directory with the archive")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "scripts"))
    import tempfile

    from score_variants import unpack
    with tempfile.TemporaryDirectory(prefix="kvgen-score-sass-") as tmp:
        bundle = unpack(args.bundle, Path(tmp) / "bundle")
        candidates = [c for c in json.loads((bundle / "bundle.json").read_text())["candidates"] if c["artifact"]]
        results = []
        for c in candidates:
            geometry = {**family_geometry(c["family"]), "lanes": threads_per_token(c["params"])}
            r = analyse(c, bundle, Path(tmp), geometry)
            results.append(r)
            t = r["per_thread_token"]
            print(f"{r['family'][:12]:12} {r['config'][:92]:92} reg={r['registers']:3} stk={r['stack']} "
                  f"instr/thread-token={t['total']:.0f} (fp32 {t['fp32']:.0f} lds {t.get('lds', 0):.0f}) "
                  f"clk/token budget={r['budget_clk']:.1f} issue={r['issue_clk']:.1f} fp32={r['fp32_clk']:.1f} "
                  f"lds={r['lds_clk']:.1f}")
    if args.out:
        args.out.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
