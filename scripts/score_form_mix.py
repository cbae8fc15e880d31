#!/usr/bin/env python3
"""SASS mix per token of the scorer's thread form (reduce 0) and warp form (reduce 1), from a
``score_variants_bundle.py`` bundle, without a GPU (docs/tuning-evidence/scorer-warp-form-postmortem.md):

    python scripts/score_form_mix.py BUNDLE_DIR VARIANTS_JSON [--family qwen3-8b] [--out x.json]

VARIANTS_JSON is the H200 run's ``score_variants.json`` (geometry and times of each config). Per
config: registers, CTAs and warps per SM (register limit, 64 warps, 32 CTAs), and the stage
loop's SASS (the backward branch with the most instructions; the lean thread form, whose stages
are unrolled, taken whole, prologue included) in warp-instructions per token (one K row of one KV head):
thread form ``count · lanes / 32 / tokens_per_thread``, warp form ``count / (tokens_per_thread ·
32 / padded_heads)``, by class, and the measured SM cycles per token
``ms · clock · SMs / tokens``.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

SMS, CLOCK_GHZ = 132, 1.97   # H200; gpc__cycles_elapsed.avg.per_second of ncu_score.csv
ROW = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")
# Classes (Nsight pipes in brackets): LDG/LDS/STG/SHFL [lsu], FP32 [fma], MUFU [xu], IMAD [fmaheavy],
# ALU = integer/logic/compare/select/PRMT [alu], U* and LDC [uniform], control [cbu].
CLASS = [("LDG", ("LDG",)), ("LDS", ("LDS",)), ("STG", ("STG",)), ("SHFL", ("SHFL",)),
         ("FP32", ("FFMA", "FMUL", "FADD")), ("MUFU", ("MUFU",)), ("IMAD", ("IMAD", "IMUL")),
         ("ALU", ("IADD3", "VIADD", "LEA", "SHF", "LOP3", "ISETP", "FSETP", "PLOP3", "SEL", "FSEL", "PRMT",
                  "P2R", "MOV", "IABS")),
         ("uniform", ("U", "LDC", "R2UR")), ("control", ("BRA", "BSSY", "BSYNC", "BAR", "EXIT", "WARPSYNC"))]


def klass(op: str) -> str:
    base = op.split(".")[0]
    for name, prefixes in CLASS:
        if base in prefixes or (name == "uniform" and (base.startswith("U") or base in prefixes)):
            return name
    return "other"


def stage_loop(rows: list) -> list | None:
    """The largest loop body (backward branch target .. branch)."""
    best = None
    for addr, op, args in rows:
        target = re.search(r"0x([0-9a-f]+)", args) if op.startswith("BRA") else None
        if target and int(target.group(1), 16) < addr:
            body = [r for r in rows if int(target.group(1), 16) <= r[0] <= addr]
            best = body if best is None or len(body) > len(best) else best
    return best


def occupancy(registers: int, threads: int) -> tuple[int, int]:
    allocated = -(-registers // 8) * 8          # per-thread allocation granularity (256 per warp)
    ctas = min(32, 64 // (threads // 32), 65536 // (allocated * threads))
    return ctas, ctas * threads // 32


def analyse(bundle: Path, candidate: dict, result: dict, tmp: Path) -> dict:
    from kvgen.tuning.costmodel.features import cuobjdump, embedded_cubin

    tool = str(cuobjdump())
    cubin = embedded_cubin(bundle / candidate["artifact"], tmp / "score.cubin")
    usage = subprocess.run([tool, "--dump-resource-usage", str(cubin)], capture_output=True, text=True).stdout
    registers = int(re.search(r"REG:(\d+)", usage).group(1))
    sass = subprocess.run([tool, "-sass", str(cubin)], capture_output=True, text=True).stdout
    rows = [(int(m.group(1), 16), m.group(2), m.group(3)) for m in ROW.finditer(sass)]
    p, g = candidate["params"], result["geometry"]
    lean = not (p.get("reduce") or p["tokens_per_thread"] > 1 or p["prefetch"] or p["smem_stages"]
                or p.get("bulk_stages"))
    body = None if lean else stage_loop(rows)   # the lean form's stages are unrolled (its loop is the prologue's)
    if p.get("reduce"):
        padded = 1 << (g["heads_per_pass"] - 1).bit_length()
        per_iteration = p["tokens_per_thread"] * 32 // padded      # tokens a warp scores per stage
    else:
        per_iteration = 32 // g["lanes"] * p["tokens_per_thread"] * (1 if body else p["token_tiles"])
    counts = collections.Counter(klass(op) for _, op, _ in (body or rows) if not op.startswith("NOP"))
    per_token = {k: v / per_iteration for k, v in counts.items()}
    per_token["total"] = sum(counts.values()) / per_iteration
    ctas, warps = occupancy(registers, p["threads"])
    out = {"config": candidate["config"], "registers": registers, "ctas_per_sm": ctas, "warps_per_sm": warps,
           "loop": "rolled" if body else "whole kernel", "warp_instructions_per_token": per_token}
    for batch, t in result["times"].items():
        if t.get("median_ms"):
            tokens = t["score_bytes"] // 4 // (g["query_heads"] // g["kv_heads"])   # (layer, request, KV head, column)
            out[f"{batch}_clk_per_token"] = t["median_ms"] * 1e-3 * CLOCK_GHZ * 1e9 * SMS / tokens
            out[f"{batch}_fraction_of_copy"] = t["fraction_of_copy"]
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("bundle", type=Path, help="directory with score-variants.tar.xz (or an unpacked bundle)")
    parser.add_argument("variants", type=Path)
    parser.add_argument("--family", action="append")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT / "scripts"))
    from score_variants import unpack

    measured = json.loads(args.variants.read_text())["families"]
    report = []
    with tempfile.TemporaryDirectory() as tmp:
        libs = unpack(args.bundle, Path(tmp) / "bundle")
        bundle = json.loads((libs / "bundle.json").read_text())
        for candidate in bundle["candidates"]:
            family = candidate["family"]
            if args.family and family not in args.family or candidate["config"] not in measured.get(family, {}):
                continue
            row = {"family": family, **analyse(libs, candidate, measured[family][candidate["config"]],
                                               Path(tmp))}
            report.append(row)
            mix = row["warp_instructions_per_token"]
            print(f"{family:18s} {row['config'][:60]:60s} regs={row['registers']:3d} warps/SM={row['warps_per_sm']:2d}"
                  f" total={mix['total']:6.1f} " + " ".join(f"{k}={mix.get(k, 0):.1f}" for k, _ in CLASS)
                  + "".join(f" {b}={row.get(f'{b}_clk_per_token', 0):.1f}clk" for b in ("B1", "B32")))
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
