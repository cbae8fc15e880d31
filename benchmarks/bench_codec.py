"""Cold-page codec throughput on the GPU against the ceilings measured in the same run.

Per family (lifecycle 0, >= 1 GiB of hot pages, page sources scattered):
  device encode/decode: (hot + cold bytes) / time / device copy bandwidth   (goal >= 0.85)
  pinned encode/decode: cold bytes / time / pinned bandwidth of that way     (goal >= 0.90)
  offload speed-up: hot bytes / measured pinned d2h bandwidth, over the time of encode-to-pinned
  peers: the oracle's encode in eager PyTorch and under torch.compile, same pages, on the GPU.

Usage: python benchmarks/bench_codec.py [--families a,b] [--hot-gib 1.2] [--no-peers]
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import copy_ceiling, environment, pinned_ceilings, time_ms, write_result  # noqa: E402
from kvgen.layout import family_layout  # noqa: E402
from kvgen.reference import encode_records  # noqa: E402
from kvgen.reference.codec import HOT_TORCH_DTYPES  # noqa: E402
from kvgen.registry import manifest_path, read_manifest, verify_artifact  # noqa: E402
from kvgen.runtime import ColdPageCodec, FamilyLibrary  # noqa: E402
from kvgen.spec import load_spec  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_FAMILIES = "qwen3-8b,qwen3-8b-fp8,deepseek-v3,deepseek-v4-csa"


def library_for(family: str, registry: Path, arch: str) -> FamilyLibrary:
    path = manifest_path(registry, arch)
    manifest = read_manifest(path, verify=False)
    return FamilyLibrary(verify_artifact(path, manifest, manifest.library(family)), family)


def make_pools(spec, layout, pages: int) -> list[list[torch.Tensor]]:
    dtype = HOT_TORCH_DTYPES[spec.dtype]
    pools = []
    for _ in range(spec.layers):
        layer = [(torch.randn(pages, b.rows, b.row_dim, device="cuda") * 2).to(dtype) for b in layout.record.buffers]
        layer += [torch.randint(0, 256, (pages, s.bytes), device="cuda", dtype=torch.uint8)
                  for s in layout.record.sides]
        pools.append(layer)
    return pools


def oracle_encode(layout, pools, lc, src: torch.Tensor, encode_fn) -> None:
    nq = len(layout.record.buffers)
    for layer in lc.layers:
        buffers = {b.name: pools[layer][i][src] for i, b in enumerate(layout.record.buffers)}
        sides = {s.name: pools[layer][nq + i][src] for i, s in enumerate(layout.record.sides)}
        encode_fn(layout.record, buffers, sides)


def bench_family(family: str, hot_gib: float, ceilings: dict, registry: Path, arch: str, peers: bool) -> dict:
    spec = load_spec(ROOT / "specs" / f"{family}.yaml")
    layout = family_layout(spec)
    lc = layout.lifecycles[0]
    pages = math.ceil(hot_gib * (1 << 30) / lc.hot_page_bytes)
    pools = make_pools(spec, layout, pages)
    codec = ColdPageCodec(library_for(family, registry, arch), layout, pools)
    perm = torch.randperm(pages, dtype=torch.int32)
    enc_pairs = torch.stack([torch.arange(pages, dtype=torch.int32), perm], dim=1)
    dec_pairs = torch.stack([perm, torch.arange(pages, dtype=torch.int32)], dim=1)
    hot_bytes, cold_bytes = pages * lc.hot_page_bytes, pages * lc.cold_page_bytes
    cold_dev = torch.empty(pages, lc.cold_page_bytes, dtype=torch.uint8, device="cuda")
    cold_pin = torch.empty(pages, lc.cold_page_bytes, dtype=torch.uint8).pin_memory()

    copy_bw = ceilings["device_copy"]["gbps_read_plus_write"]
    d2h, h2d = ceilings["pinned"]["d2h"]["gbps"], ceilings["pinned"]["h2d"]["gbps"]
    result = {"family": family, "pages": pages, "layers": len(lc.layers), "hot_bytes": hot_bytes,
              "cold_bytes": cold_bytes, "cold_over_hot": cold_bytes / hot_bytes}
    runs = {
        "encode_device": (lambda: codec.encode(cold_dev, enc_pairs), hot_bytes + cold_bytes, copy_bw),
        "decode_device": (lambda: codec.decode(cold_dev, dec_pairs), hot_bytes + cold_bytes, copy_bw),
        "encode_pinned": (lambda: codec.encode(cold_pin, enc_pairs), cold_bytes, d2h),
        "decode_pinned": (lambda: codec.decode(cold_pin, dec_pairs), cold_bytes, h2d),
    }
    for name, (fn, moved, ceiling) in runs.items():
        t = time_ms(fn, reps=10)
        gbps = moved / t["median_ms"] / 1e6
        result[name] = {"median_ms": t["median_ms"], "p20_ms": t["p20_ms"], "p80_ms": t["p80_ms"],
                        "gbps": gbps, "fraction_of_ceiling": gbps / ceiling}
    # what offloading costs without the codec: the hot bytes at the measured pinned bandwidth
    result["raw_offload_ms"] = hot_bytes / d2h / 1e6
    result["offload_speedup_vs_raw_copy"] = result["raw_offload_ms"] / result["encode_pinned"]["median_ms"]
    if peers:
        result["peers"] = bench_peers(layout, pools, lc, perm.long().cuda())
    codec.close()
    del pools
    torch.cuda.empty_cache()
    return result


def bench_peers(layout, pools, lc, src) -> dict:
    """The oracle's encode, eager and compiled, over the same pages (device memory)."""
    peers = {}
    eager = time_ms(lambda: oracle_encode(layout, pools, lc, src, encode_records), reps=3, warmup=1)
    peers["oracle_eager_ms"] = eager["median_ms"]
    try:
        compiled = torch.compile(encode_records, dynamic=False)
        t = time_ms(lambda: oracle_encode(layout, pools, lc, src, compiled), reps=3, warmup=2)
        peers["oracle_torch_compile_ms"] = t["median_ms"]
    except Exception as exc:  # a peer that fails to compile is reported, not fatal
        peers["oracle_torch_compile_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    return peers


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", default=DEFAULT_FAMILIES)
    parser.add_argument("--hot-gib", type=float, default=1.2)
    parser.add_argument("--registry", type=Path, default=ROOT / "build" / "registry")
    parser.add_argument("--arch", default="sm_90a")
    parser.add_argument("--no-peers", action="store_true")
    parser.add_argument("--tag", default="", help="suffix of the result file (bench_codec-TAG.json)")
    args = parser.parse_args()
    ceilings = {"device_copy": copy_ceiling(), "pinned": pinned_ceilings()}
    print("ceilings", ceilings, flush=True)
    results = []
    for family in args.families.split(","):
        res = bench_family(family, args.hot_gib, ceilings, args.registry, args.arch, not args.no_peers)
        print(family, {k: v for k, v in res.items() if isinstance(v, dict)}, flush=True)
        results.append(res)
    path = write_result("bench_codec", {"environment": environment(), "ceilings": ceilings, "results": results},
                        args.tag)
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
