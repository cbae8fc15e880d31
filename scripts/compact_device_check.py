#!/usr/bin/env python3
"""Compaction variants against the copy ceiling of the same run (issue 14 item 5: >= 0.90 at batch 1, 32, 256).

Two halves:

    python scripts/compact_device_check.py build build/device/compact              # here (nvcc, no GPU)
    python scripts/compact_device_check.py measure build/device/compact --out $OUT  # on the H200

``build`` makes, under DIR, one xz bundle per variant (qwen3-8b's compaction library, sm_90a), at
qwen3-8b's tuned shape (threads 256, tile_tokens 32) unless said, from this tree (a variant may
name a git revision instead: ``base`` is ``--base``):
  ``shipped``     slices 1: one CTA per (request, KV head, layer), as shipped before `slices`,
  ``s2``, ``s4``  slices 2 / 4: that many CTAs per (request, KV head, layer), each copying its run
                  of every K and V row (batch 1 launches 288 CTAs on 132 SMs with slices 1),
  ``s2-t64``, ``s4-t128``  the same with tiles of as many bytes as the shipped tile (more moves).
Earlier runs of this script measured the third session's steps (predicated loads, no page-id reads
for moves that copy nothing, tile and thread shapes; results/2026-12-02-h200-s3/call3/): each is in
git history, and ``--base``/a revision rebuilds it.

``measure`` measures the ceilings once, then per variant: an oracle check (4 requests, pools of
random bytes, the last half of the layers given fill moves, every pool byte against the oracle's
compact_paged), then kvgen.bench.compact's compaction at batch 1, 32 and 256 (batch 1 also checked
against the oracle inside the benchmark), every variant at one batch before the next batch,
``--rounds`` times. Writes ``compact_device_check.json`` to ``--out`` after every row and never
stops at a failure: a failed variant is a record with its error. Starts no new row after
``--budget-s`` seconds (the rows left are listed under ``not_run``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

from codec_device_check import guarded, tree_copy  # noqa: E402

FAMILY = "qwen3-8b"
# name -> (revision of the kernels ("base": --base, None: this tree), compact params)
VARIANTS = {
    "shipped": (None, {"threads": 256, "tile_tokens": 32, "slices": 1}),
    "s2": (None, {"threads": 256, "tile_tokens": 32, "slices": 2}),
    "s4": (None, {"threads": 256, "tile_tokens": 32, "slices": 4}),
    "s2-t64": (None, {"threads": 256, "tile_tokens": 64, "slices": 2}),
    "s4-t128": (None, {"threads": 256, "tile_tokens": 128, "slices": 4}),
}
CHECK_BATCH = 4

# Builds one compaction bundle with the kvgen on PYTHONPATH (the copy of the tree whose kernels it uses).
_BUILD = """
import json, sys
from pathlib import Path
import kvgen
from kvgen import paths
from kvgen.build.job import load_spec_source
from kvgen.cli import discover_toolchains
from kvgen.tuning.candidates import Request, build_candidates
root, out, family, params = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], json.loads(sys.argv[4])
from kvgen.lower.plan import default_params
params = {**default_params("compact"), **params}  # every tunable of that tree, the variant's on top
req = Request(load_spec_source(root / "specs" / f"{family}.yaml"), "compact", params)
for c in build_candidates([req], "sm_90a", out, paths.cache_dir(), toolchains=discover_toolchains(), jobs=1):
    print(kvgen.__file__, c.family, c.config, c.status, c.key[:16], c.error[:2000])
"""


def build(out: Path, base: str) -> int:
    import os

    from kvgen.tuning.candidates import pack_bundle

    out.mkdir(parents=True, exist_ok=True)
    status = 0
    with tempfile.TemporaryDirectory() as tmp:
        for name, (rev, params) in VARIANTS.items():
            tree = tree_copy(Path(tmp) / name, base if rev == "base" else rev)
            bundle = Path(tmp) / f"bundle-{name}"
            # cwd too: `python -c` puts the working directory first on sys.path
            status |= subprocess.call([sys.executable, "-c", _BUILD, str(tree), str(bundle), FAMILY, json.dumps(params)],
                                      env={"PYTHONPATH": str(tree), "PATH": os.environ.get("PATH", "")}, cwd=tree)
            pack_bundle(bundle, out / f"{name}.tar.xz")
    return status


# ---------------------------------------------------------------------------------------------
# measure (GPU)
# ---------------------------------------------------------------------------------------------


def check_with_fill_layers(library, packer, geo) -> dict:
    """CHECK_BATCH requests of the benchmark's workload, the last half of the layers all fill moves,
    pools of random bytes: every byte against the oracle's compact_paged."""
    import torch

    from kvgen.bench.compact import (
        BUDGET,
        DECODE,
        MAX_TAIL,
        PROMPT,
        batch_args,
        make_batch,
        make_pools,
        oracle_compaction_matches,
    )
    from kvgen.reference.triattention import Moves
    from kvgen.runtime.compact import Compactor

    info = library.info
    pages_per_request = -(-(PROMPT + DECODE + MAX_TAIL) // info["tokens_per_block"])
    b = make_batch(CHECK_BATCH, 1, seed=7)
    src, dst, offsets = packer(*batch_args(b, "union"), CHECK_BATCH, CHECK_BATCH * (BUDGET + MAX_TAIL))
    moved = info["num_layers"] // 2
    src[moved:] = -1
    dst[moved:] = -1
    table = torch.randperm(CHECK_BATCH * pages_per_request, dtype=torch.int32, device="cuda")
    table = table.reshape(CHECK_BATCH, pages_per_request)
    k_pools, v_pools = make_pools(info, CHECK_BATCH * pages_per_request, info["num_layers"], fill=True)
    ok = oracle_compaction_matches(Compactor(library, k_pools, v_pools), k_pools, v_pools, table,
                                   Moves(src, dst, offsets), geo)
    return {"batch": CHECK_BATCH, "layers_moved": moved, "equal_to_oracle": bool(ok)}


def measure(root: Path, out: Path, batches: list[int], rounds: int, budget_s: float) -> int:
    import time

    import torch

    from kvgen import paths
    from kvgen.bench.compact import bench_compaction, oracle_geometry
    from kvgen.measure.environment import environment
    from kvgen.measure.libraries import registry_artifact
    from kvgen.measure.timing import measure_ceilings, require_cuda
    from kvgen.runtime.compact import CompactLibrary
    from kvgen.runtime.pack import MovePacker
    from kvgen.tuning.candidates import read_bundle, unpack_bundle

    require_cuda("compact_device_check")
    start = time.monotonic()
    out.mkdir(parents=True, exist_ok=True)
    path = out / "compact_device_check.json"
    unpacked = Path(tempfile.mkdtemp(prefix="compact-device-check-"))
    report: dict = {"environment": environment(), "family": FAMILY, "variants": {}, "results": [], "not_run": []}
    libraries = {}
    for name, (_, params) in VARIANTS.items():
        def load(name=name):
            unpack_bundle(root / f"{name}.tar.xz", unpacked / name)
            c = next(c for c in read_bundle(unpacked / name)["candidates"] if c["op"] == "compact")
            if c.get("status") == "failed":
                raise RuntimeError(f"{name}: build {c.get('status')}: {c.get('error', '')[:500]}")
            return CompactLibrary(unpacked / name / c["artifact"])
        library = guarded(load)
        report["variants"][name] = {"params": params, "error": library["error"]} if isinstance(library, dict) \
            else {"params": params, "geometry": library.info}
        if not isinstance(library, dict):
            libraries[name] = library
    report["ceilings"] = ceilings = measure_ceilings(pinned=False)
    print("ceilings", ceilings, flush=True)
    packer = MovePacker(registry_artifact(paths.registry_dir(), FAMILY, "sm_90a", "pack"), FAMILY)
    geo = oracle_geometry(next(iter(libraries.values())).info, packer)
    copy = ceilings["device_copy"]["gbps_read_plus_write"]
    for name, library in libraries.items():
        report["variants"][name]["fill_layer_check"] = guarded(check_with_fill_layers, library, packer, geo)
        print("check", name, report["variants"][name]["fill_layer_check"], flush=True)
        torch.cuda.empty_cache()
    path.write_text(json.dumps(report, indent=1, default=str))
    for batch in batches:
        for r in range(rounds):
            for name, library in libraries.items():
                if time.monotonic() - start > budget_s:
                    report["not_run"].append({"variant": name, "batch": batch, "round": r})
                    continue
                res = guarded(lambda: bench_compaction(library, packer, geo, batch, "union", copy)[0])
                row = {"variant": name, "batch": batch, "round": r, **res}
                print("compact", name, batch, r, row.get("compact", row.get("error")), flush=True)
                report["results"].append(row)
                path.write_text(json.dumps(report, indent=1, default=str))
                torch.cuda.empty_cache()
    report["summary"] = summary(report["results"])
    path.write_text(json.dumps(report, indent=1, default=str))
    print("summary (fraction of copy, best round)", json.dumps(report["summary"]), flush=True)
    print("wrote", path)
    return 0


def summary(rows: list[dict]) -> dict:
    """variant -> batch -> best fraction of copy over the rounds (None if every round failed)."""
    out: dict = {}
    for row in rows:
        frac = row.get("compact", {}).get("fraction_of_copy")
        best = out.setdefault(row["variant"], {}).get(str(row["batch"]))
        out[row["variant"]][str(row["batch"])] = frac if best is None else max(best, frac or 0)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=("build", "measure"))
    parser.add_argument("dir", type=Path)
    parser.add_argument("--out", type=Path, default=Path("compact-device-check"))
    parser.add_argument("--base", default="2efb532", help="build: revision of the kernels before these changes (variant main)")
    parser.add_argument("--batches", default="1,32,256")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--budget-s", type=float, default=100.0, help="measure: start no row after this long")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    if args.what == "build":
        return build(args.dir, args.base)
    return measure(args.dir, args.out, [int(b) for b in args.batches.split(",")], args.rounds, args.budget_s)


if __name__ == "__main__":
    raise SystemExit(main())
