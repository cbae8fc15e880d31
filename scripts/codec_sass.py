#!/usr/bin/env python3
"""SASS instruction mix of the codec's per-block loops, per pipe class, without a GPU.

Compiles ``generated/<family>/codec.cu`` for sm_90a the way ``tests/test_generated.py`` does
(``nvcc -cubin -O3 --fmad=false``, with ``-Xptxas -v`` for registers), disassembles it with the
cuobjdump that Triton's wheel ships, and counts the instructions of the loop that quantizes plain
blocks: in the encode kernel the loop holding the hot loads (LDG) and the scale store (STS.U8), in
the decode kernel the loop holding the scale load (LDS.U8) and the hot stores (STG). Each
iteration handles as many 16-element blocks as it stores (encode) or loads (decode) scale bytes,
so dividing by that gives instructions per block. Two counts: ``static`` is every instruction
of the loop body (both sides of its branches), ``path`` the instructions along the loop's
shortest path, which is what a block of finite values executes (the division's fast path, the
fallbacks for non-finite blocks skipped, the shorter packer taken). With ``hot_batch`` > 1 the shortest path
skips the batch's guarded later blocks, so only ``static`` (and registers) compare across batches.

Pipe classes follow Nsight Compute's pipes on sm_90: ``alu`` (integer/logic, compares, selects,
float min/max, PRMT), ``imad`` (IMAD/IMUL: integer work that issues on the FMA-heavy pipe),
``fma`` (FP32 and packed FP16/BF16 arithmetic), ``conversion`` (F2F/F2I/I2F/F2FP/...), ``mufu``,
``memory``, ``uniform`` (the U* datapath), ``control``.

    python scripts/codec_sass.py                       # the working tree
    python scripts/codec_sass.py --rev 0469adf         # a commit (its kernels and generated/)
    python scripts/codec_sass.py --rev 0469adf --rev WORKTREE --out results/x.json
    python scripts/codec_sass.py --variant decode_route=0 --variant decode_route=1,min_blocks=2

``--variant NAME=VALUE,...`` renders the working tree's codec plan of each family with those
tunables (``TUNABLES["codec"]``, the rest at their defaults) instead of reading generated/, so one
run compares the choices of a tunable; ``per_element`` is ``per_class`` divided by 16.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
# one reader of SASS: the cost model's (pipe classes, functions, loops, shortest path)
from kvgen.tuning.costmodel.features import loop_bodies, pipe_class, shortest_path  # noqa: E402
from kvgen.tuning.costmodel.features import parse_sass as parse_functions  # noqa: E402

FAMILIES = ("qwen3-8b", "qwen3-8b-fp8", "mistral-7b")
WORKTREE = "WORKTREE"

def block_loop(insns, direction: str):
    """The first plain-block loop of a kernel and the blocks one iteration handles."""
    for body in loop_bodies(insns):
        ops = [insn[1] for insn in body]
        if direction == "encode" and any(o.startswith("LDG") for o in ops):
            blocks = sum(o == "STS.U8" for o in ops)
        elif direction == "decode" and any(o.startswith(("STG", "ST.")) for o in ops):
            blocks = sum(o.startswith("LDS.U8") for o in ops)
        else:
            continue
        if blocks:
            return body, blocks
    raise SystemExit(f"no {direction} block loop found")


def mix(insns, blocks: int) -> dict:
    """Instructions per block: total, per pipe class, per opcode."""
    per_class = Counter(pipe_class(insn[1]) for insn in insns)
    per_op = Counter(insn[1] for insn in insns)
    return {"total": round(len(insns) / blocks, 2),
            "per_class": {cls: round(n / blocks, 2) for cls, n in sorted(per_class.items())},
            "per_element": {cls: round(n / blocks / 16, 3) for cls, n in sorted(per_class.items())},
            "per_opcode": {op: round(n / blocks, 2) for op, n in per_op.most_common()}}


def ptxas_info(log: str) -> dict[str, dict[str, int]]:
    """Kernel name -> registers, static shared memory and spill bytes, from ``ptxas -v``."""
    out: dict[str, dict[str, int]] = {}
    name = None
    for line in log.splitlines():
        if m := re.search(r"Compiling entry function '([^']+)'", line):
            name = m.group(1)
            out[name] = {"registers": 0, "static_smem_bytes": 0, "spill_bytes": 0}
        elif name and (m := re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)):
            out[name]["spill_bytes"] = int(m.group(1)) + int(m.group(2))
        elif name and (m := re.search(r"Used (\d+) registers", line)):
            out[name]["registers"] = int(m.group(1))
            if s := re.search(r"(\d+) bytes smem", line):
                out[name]["static_smem_bytes"] = int(s.group(1))
    return out


def cuobjdump() -> Path:
    import triton  # ships cuobjdump; the CUDA toolkit here has no disassembler for every target

    return Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"


def source_tree(rev: str, tmp: Path) -> Path:
    """A tree holding the kernels and generated/ of ``rev`` (the working tree itself for WORKTREE)."""
    if rev == WORKTREE:
        return ROOT
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "kvgen/kernels", "generated"],
                             capture_output=True, check=True).stdout
    dest = tmp / rev
    dest.mkdir()
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    return dest


def render_variant(params: dict[str, int], family: str, tmp: Path, label: str) -> Path:
    """The working tree's codec.cu of ``family`` rendered with ``params``, under tmp/<label>/generated."""
    from kvgen.render.source import render_family
    from kvgen.spec.schema import load_spec

    rendered = render_family(load_spec(ROOT / "specs" / f"{family}.yaml"), params={"codec": params})
    dest = tmp / label / "generated" / family / "codec.cu"
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(rendered[f"{family}/codec.cu"])
    return dest


def parse_variant(text: str) -> dict[str, int]:
    pairs = [item.split("=", 1) for item in text.split(",") if item]
    if any(len(p) != 2 or not p[1].lstrip("-").isdigit() for p in pairs):
        raise SystemExit(f"--variant {text!r}: expected NAME=INT[,NAME=INT...]")
    return {name: int(value) for name, value in pairs}


def analyse(tree: Path, family: str, tmp: Path, source: Path | None = None) -> dict:
    source = source or tree / "generated" / family / "codec.cu"
    cubin = tmp / f"{source.parent.parent.parent.name}-{family}.cubin"
    includes = [f"-I{tree / 'kvgen' / 'kernels' / d}" for d in ("include", "cuda")]
    cmd = ["nvcc", "-cubin", "-O3", "-std=c++17", "--fmad=false", "-gencode", "arch=compute_90a,code=sm_90a",
           "-Xptxas", "-v", *includes, "-o", str(cubin), str(source)]
    build = subprocess.run(cmd, capture_output=True, text=True)
    if build.returncode:
        raise SystemExit(f"nvcc failed for {source}:\n{build.stderr}")
    record = int(re.search(r"Layer record: (\d+) bytes", source.read_text()).group(1))
    resources = ptxas_info(build.stderr)
    sass = subprocess.run([str(cuobjdump()), "-sass", str(cubin)], capture_output=True, text=True,
                          check=True).stdout
    result = {}
    for name, insns in parse_functions(sass).items():
        direction = "encode" if "encode_kernel" in name else "decode"
        if "Lb1E" not in name:
            continue  # one instantiation per direction: device index arrays (host arrays: same loop)
        body, blocks = block_loop(insns, direction)
        result[direction] = {
            "blocks_per_iteration": blocks,
            "path": mix(shortest_path(body), blocks),
            "static": mix(body, blocks),
            "registers": resources[name]["registers"],
            "spill_bytes": resources[name]["spill_bytes"],
            "smem_per_cta_bytes": resources[name]["static_smem_bytes"] + record,
        }
    return result


def git_commit(rev: str) -> str:
    if rev == WORKTREE:
        head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True)
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "kvgen/kernels", "generated"],
                               capture_output=True, text=True).stdout.strip()
        return head.stdout.strip() + ("+dirty" if dirty else "")
    return subprocess.run(["git", "-C", str(ROOT), "rev-parse", rev], capture_output=True, text=True,
                          check=True).stdout.strip()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rev", action="append", help=f"git revision to analyse (default: {WORKTREE})")
    parser.add_argument("--variant", action="append", default=[], metavar="NAME=INT,...",
                        help="the working tree rendered with these codec tunables (repeatable)")
    parser.add_argument("--family", action="append", choices=FAMILIES, help="default: all three")
    parser.add_argument("--out", type=Path, help="write the JSON here (default: stdout)")
    args = parser.parse_args(argv)
    revs = args.rev or ([] if args.variant else [WORKTREE])
    report = {"arch": "sm_90a", "method": __doc__.split("\n\n")[1].replace("\n", " "), "revisions": {}}
    with tempfile.TemporaryDirectory() as tmpdir:
        tmp = Path(tmpdir)
        for rev in revs:
            tree = source_tree(rev, tmp)
            report["revisions"][rev] = {"commit": git_commit(rev),
                                        "families": {f: analyse(tree, f, tmp) for f in args.family or FAMILIES}}
        for text in args.variant:
            params = parse_variant(text)
            label = "variant-" + re.sub(r"\W", "_", text)
            report["revisions"][f"{WORKTREE}[{text}]"] = {
                "commit": git_commit(WORKTREE), "params": params,
                "families": {f: analyse(ROOT, f, tmp, render_variant(params, f, tmp, label))
                             for f in args.family or FAMILIES}}
    text = json.dumps(report, indent=2) + "\n"
    if args.out:
        args.out.write_text(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
