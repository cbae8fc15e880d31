#!/usr/bin/env python3
"""Codec and compaction variants against the copy ceiling of the same run (issues 13 and 15).

Two halves:

    python scripts/codec_device_check.py build build/device/codec          # here (nvcc, no GPU)
    python scripts/codec_device_check.py measure build/device/codec --out $OUT   # on the H200

``build`` makes, under DIR, xz archives of bundles (unpacked by ``measure``): ``codec-variants``
(scripts/codec_variants_bundle.py ``--codec-set``, default ``defaults``: the previous codec defaults
and today's, for ``--codec-family`` (default qwen3-8b and deepseek-v3); ``routes`` with all four
families was the set of results/2026-12-02-h200/codec_device_check.json; ``--no-compact``: this one
only, and ``measure`` then skips compaction) and one compaction bundle
per way of checking device indices, each built from its own copy of the kernels:
  ``compact-on``   the kernels of ``--base`` (default: main, the checks as shipped),
  ``compact-off``  this tree with in_range/in_range32 forced true (checks compiled out: the
                   reference of what the checks cost; never shipped),
  ``compact-new``  this tree (indices clamped into range, loads unconditional, stores predicated,
                   skipped moves noted in registers and reported once after the walk).

``measure`` measures the ceilings once, then per codec family of the bundle every variant's device encode and
decode over >= 1 GiB of scattered hot pages ((hot + cold bytes) / time / device copy), each variant
checked against the oracle (the tuner's gate) and its cold bytes compared with the first variant's;
then qwen3-8b compaction at batch 1 and 32 (kvgen.bench.compact's workload) for on / off / new,
interleaved twice. Writes JSON to ``--out`` (codec_device_check.json) and never stops at a
failure: a failed variant is a record with its error.

``profile`` runs one encode and one decode of ``--family``'s best device-encode variant of
``--results`` (measure's JSON) for Nsight Compute:

    ncu --clock-control none -k regex:"encode_kernel|decode_kernel" -c 2 --section SpeedOfLight \
        --section ComputeWorkloadAnalysis --section Occupancy --section InstructionStats --csv \
        python scripts/codec_device_check.py profile DIR --results $OUT/codec_device_check.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CODEC_FAMILIES = ("qwen3-8b", "deepseek-v3", "deepseek-v4-csa", "qwen3-8b-fp8")
COMPACT_FAMILY = "qwen3-8b"
CHECKS = ("on", "off", "new")
BUNDLES = ("codec-variants", *(f"compact-{way}" for way in CHECKS))

# Builds one compaction bundle with the kvgen on PYTHONPATH (the copy of the tree whose kernels it uses).
_BUILD_COMPACT = """
import sys
from pathlib import Path
import kvgen
from kvgen import paths
from kvgen.build.job import load_spec_source
from kvgen.cli import discover_toolchains
from kvgen.lower.plan import default_params
from kvgen.tuning.candidates import Request, build_candidates
root, out, family = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
req = Request(load_spec_source(root / "specs" / f"{family}.yaml"), "compact", default_params("compact"))
for c in build_candidates([req], "sm_90a", out, paths.cache_dir(), toolchains=discover_toolchains(), jobs=1):
    print(kvgen.__file__, c.family, c.config, c.status, c.key[:16], c.error[:2000])
"""


def tree_copy(dest: Path, rev: str | None) -> Path:
    """kvgen/, specs/ and generated/ of ``rev`` (None: this working tree) under ``dest``."""
    dest.mkdir(parents=True)
    if rev is None:
        for part in ("kvgen", "specs", "generated"):
            shutil.copytree(ROOT / part, dest / part, ignore=shutil.ignore_patterns("__pycache__"))
    else:
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "kvgen", "specs", "generated"],
                                 capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    return dest


def checks_off(tree: Path) -> None:
    """Force every device index check of ``tree`` true (the measurement reference only)."""
    header = tree / "kvgen" / "kernels" / "cuda" / "device_errors.cuh"
    text = header.read_text()
    for old in ("return (uint64_t)index < (uint64_t)limit;", "return (uint32_t)index < limit32;"):
        if old not in text:
            raise SystemExit(f"{header}: expected {old!r} (the checks changed: update checks_off)")
        text = text.replace(old, "return true;")
    header.write_text(text)


def build(out: Path, base: str, codec: bool, codec_set: str, codec_families: list[str], compact: bool = True) -> int:
    out.mkdir(parents=True, exist_ok=True)
    status = 0
    if codec:
        families = [arg for family in codec_families for arg in ("--family", family)]
        status = subprocess.call([sys.executable, str(ROOT / "scripts" / "codec_variants_bundle.py"), "--set",
                                  codec_set, *families, "--out", str(out / "codec-variants")])
    with tempfile.TemporaryDirectory() as tmp:
        for way in CHECKS if compact else ():
            tree = tree_copy(Path(tmp) / way, base if way == "on" else None)
            if way == "off":
                checks_off(tree)
            bundle = out / f"compact-{way}"
            shutil.rmtree(bundle, ignore_errors=True)
            # cwd too: `python -c` puts the working directory first on sys.path
            status |= subprocess.call([sys.executable, "-c", _BUILD_COMPACT, str(tree), str(bundle.absolute()),
                                       COMPACT_FAMILY], env={"PYTHONPATH": str(tree), "PATH": _path()}, cwd=tree)
    from kvgen.tuning.candidates import pack_bundle

    for name in [n for n in BUNDLES if (codec if n == "codec-variants" else compact)]:
        pack_bundle(out / name, out / f"{name}.tar.xz")
        shutil.rmtree(out / name)
    return status


def _path() -> str:
    import os

    return os.environ.get("PATH", "")


# ---------------------------------------------------------------------------------------------
# measure (GPU)
# ---------------------------------------------------------------------------------------------


def guarded(fn, *args) -> dict:
    try:
        return fn(*args)
    except Exception:  # noqa: BLE001 - one failed variant is a record, the run goes on
        return {"error": traceback.format_exc()[-1500:]}


def measure_codec(bundle: Path, family: str, ceilings: dict, hot_gib: float) -> dict:
    import math

    import torch

    from kvgen import paths
    from kvgen.lower.layout import family_layout
    from kvgen.measure.workloads.codec import CodecWorkload
    from kvgen.spec.schema import load_spec
    from kvgen.tuning.candidates import read_bundle

    spec = load_spec(paths.spec_path(family))
    layout = family_layout(spec)
    lc = layout.lifecycles[0]
    workload = CodecWorkload(layout, spec.dtype)
    pages = math.ceil(hot_gib * (1 << 30) / lc.hot_page_bytes)
    pools = workload.pools(pages, torch.Generator(device="cuda").manual_seed(0))
    perm = torch.randperm(pages, dtype=torch.int32)
    enc = torch.stack([torch.arange(pages, dtype=torch.int32), perm], dim=1)
    dec = torch.stack([perm, torch.arange(pages, dtype=torch.int32)], dim=1)
    moved = pages * (lc.hot_page_bytes + lc.cold_page_bytes)
    cold = torch.empty(pages, lc.cold_page_bytes, dtype=torch.uint8, device="cuda")
    copy = ceilings["device_copy"]["gbps_read_plus_write"]
    # decode writes other pools, so every variant encodes the same hot pages
    decoded = [[torch.empty_like(p) for p in layer] for layer in pools]
    case = {"workload": workload, "layout": layout, "pools": pools, "decoded": decoded, "enc": enc, "dec": dec,
            "cold": cold, "moved": moved, "copy": copy, "first": None}
    out = {"family": family, "pages": pages, "moved_bytes": moved, "variants": []}
    for c in [c for c in read_bundle(bundle)["candidates"] if c["family"] == family and c["op"] == "codec"]:
        rec = {"config": c["config"], "params": c["params"], "status": c["status"]}
        if c["status"] == "failed":
            rec["error"] = c["error"][:800]
        else:
            rec.update(guarded(codec_variant, bundle / c["artifact"], case))
        print(family, rec, flush=True)
        out["variants"].append(rec)
    case.clear()
    del pools, decoded, cold
    torch.cuda.empty_cache()
    return out


def codec_variant(path: Path, case: dict) -> dict:
    """One library: the oracle gate, its cold bytes against the first variant's, device encode/decode."""
    import torch

    from kvgen.bench.codec import time_runs
    from kvgen.runtime import ColdPageCodec

    library = case["workload"].load(path)
    case["workload"].check(library, 1)  # the oracle's bytes, or Failure
    codec = ColdPageCodec(library, case["layout"], case["pools"])
    decoder = ColdPageCodec(library, case["layout"], case["decoded"])
    cold, enc, dec, moved, copy = case["cold"], case["enc"], case["dec"], case["moved"], case["copy"]
    try:
        codec.encode(cold, enc)
        torch.cuda.synchronize()
        same = None
        if case["first"] is None:
            case["first"] = cold.clone()
        else:
            same = bool(torch.equal(case["first"], cold))
        runs = {"encode_device": (lambda: codec.encode(cold, enc), moved, copy),
                "decode_device": (lambda: decoder.decode(cold, dec), moved, copy)}
        return {"oracle_check": "ok", "cold_equal_to_first_variant": same, **time_runs(runs)}
    finally:
        codec.close()
        decoder.close()


def measure_compact(root: Path, ceilings: dict, batches=(1, 32), rounds: int = 2) -> dict:
    import torch

    from kvgen import paths
    from kvgen.bench.compact import bench_compaction, oracle_geometry
    from kvgen.measure.libraries import registry_artifact
    from kvgen.runtime.compact import CompactLibrary
    from kvgen.runtime.pack import MovePacker
    from kvgen.tuning.candidates import read_bundle

    libraries = {}
    for way in CHECKS:
        c = next(c for c in read_bundle(root / f"compact-{way}")["candidates"] if c["op"] == "compact")
        libraries[way] = CompactLibrary(root / f"compact-{way}" / c["artifact"])
    packer = MovePacker(registry_artifact(paths.registry_dir(), COMPACT_FAMILY, "sm_90a", "pack"), COMPACT_FAMILY)
    geo = oracle_geometry(libraries["new"].info, packer)
    copy = ceilings["device_copy"]["gbps_read_plus_write"]
    rows = []
    for batch in batches:
        for r in range(rounds):
            for way, library in libraries.items():
                res = guarded(lambda: bench_compaction(library, packer, geo, batch, "union", copy)[0])
                row = {"checks": way, "batch": batch, "round": r, **res}
                print("compact", way, batch, r, row.get("compact", row.get("error")), flush=True)
                rows.append(row)
                torch.cuda.empty_cache()
    return {"family": COMPACT_FAMILY, "results": rows}


def measure(root: Path, out: Path, hot_gib: float) -> int:
    from kvgen.measure.environment import environment
    from kvgen.measure.timing import measure_ceilings, require_cuda
    from kvgen.tuning.candidates import read_bundle, unpack_bundle

    require_cuda("codec_device_check")
    out.mkdir(parents=True, exist_ok=True)
    unpacked = Path(tempfile.mkdtemp(prefix="codec-device-check-"))
    present = [name for name in BUNDLES if (root / f"{name}.tar.xz").exists()]  # built with --no-compact: codec only
    for name in present:
        unpack_bundle(root / f"{name}.tar.xz", unpacked / name)
    root = unpacked
    ceilings = measure_ceilings(pinned=False)
    print("ceilings", ceilings, flush=True)
    report = {"environment": environment(), "ceilings": ceilings, "codec": [], "compact": None}
    families = {c["family"]: None for c in read_bundle(root / "codec-variants")["candidates"]}
    for family in families:
        report["codec"].append(guarded(measure_codec, root / "codec-variants", family, ceilings, hot_gib))
        (out / "codec_device_check.json").write_text(json.dumps(report, indent=1, default=str))
    if "compact-on" in present:
        report["compact"] = guarded(measure_compact, root, ceilings)
    (out / "codec_device_check.json").write_text(json.dumps(report, indent=1, default=str))
    print("wrote", out / "codec_device_check.json")
    return 0


def profile(root: Path, results: Path, family: str, hot_mib: int = 256) -> int:
    """One encode and one decode of the best device-encode variant of ``family`` in ``results``
    (measure's JSON), on ~256 MiB of scattered hot pages, for Nsight Compute."""
    import torch

    from kvgen import paths
    from kvgen.lower.layout import family_layout
    from kvgen.measure.workloads.codec import CodecWorkload
    from kvgen.runtime import ColdPageCodec
    from kvgen.spec.schema import load_spec
    from kvgen.tuning.candidates import read_bundle, unpack_bundle

    report = json.loads(results.read_text())
    rows = next(r for r in report["codec"] if r.get("family") == family)["variants"]
    best = max((v for v in rows if "encode_device" in v), key=lambda v: v["encode_device"]["fraction_of_ceiling"])
    bundle = unpack_bundle(root / "codec-variants.tar.xz", Path(tempfile.mkdtemp()) / "codec-variants")
    c = next(c for c in read_bundle(bundle)["candidates"] if c["family"] == family and c["config"] == best["config"])
    print("profiling", family, best["config"], file=sys.stderr)
    spec = load_spec(paths.spec_path(family))
    layout = family_layout(spec)
    lc = layout.lifecycles[0]
    workload = CodecWorkload(layout, spec.dtype)
    pages = max(1, hot_mib * (1 << 20) // lc.hot_page_bytes)
    pools = workload.pools(pages, torch.Generator(device="cuda").manual_seed(0))
    codec = ColdPageCodec(workload.load(bundle / c["artifact"]), layout, pools)
    cold = torch.empty(pages, lc.cold_page_bytes, dtype=torch.uint8, device="cuda")
    slots = torch.arange(pages, dtype=torch.int32)
    # scattered sources; device pairs: one launch per direction
    pairs = torch.stack([slots, slots[torch.randperm(pages)]], dim=1).contiguous().cuda()
    codec.encode(cold, pairs)
    codec.decode(cold, pairs.flip(1).contiguous())
    torch.cuda.synchronize()
    codec.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=("build", "measure", "profile"))
    parser.add_argument("dir", type=Path)
    parser.add_argument("--out", type=Path, default=Path("codec-device-check"))
    parser.add_argument("--base", default="main", help="revision of the shipped checks (compact-on)")
    parser.add_argument("--hot-gib", type=float, default=1.2)
    parser.add_argument("--no-codec", action="store_true", help="build: the compaction bundles only")
    parser.add_argument("--no-compact", action="store_true", help="build: the codec bundle only (measure skips compaction)")
    parser.add_argument("--codec-set", default="defaults", help="build: scripts/codec_variants_bundle.py --set")
    parser.add_argument("--codec-family", action="append", choices=CODEC_FAMILIES,
                        help="build: a codec family (repeatable; default qwen3-8b and deepseek-v3)")
    parser.add_argument("--results", type=Path, help="profile: measure's codec_device_check.json")
    parser.add_argument("--family", default="deepseek-v3", help="profile: the family")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    if args.what == "build":
        return build(args.dir, args.base, not args.no_codec, args.codec_set,
                     args.codec_family or ["qwen3-8b", "deepseek-v3"], not args.no_compact)
    if args.what == "profile":
        return profile(args.dir, args.results, args.family)
    return measure(args.dir, args.out, args.hot_gib)


if __name__ == "__main__":
    raise SystemExit(main())
