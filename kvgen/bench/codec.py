"""Cold-page codec throughput on the GPU against the ceilings measured in the same run.

Per family (lifecycle 0, >= 1 GiB of hot pages with an outlier channel, from the codec workload of
``kvgen.measure.workloads``; page sources scattered; library from the registry through the runtime lookup):
  device encode/decode: (hot + cold bytes) / time / device copy bandwidth   (goal >= 0.85)
  pinned encode/decode: cold bytes / time / pinned bandwidth of that way     (goal >= 0.90)
  mix: each device run's own bytes (cold in, hot out; the reverse) through a kernel without
       arithmetic (``kvgen.measure.mix``): the DRAM's rate for that mix, and the run's fraction of it
  offload speed-up: hot bytes / measured pinned d2h bandwidth, over the time of encode-to-pinned
  peers: the oracle's encode in eager PyTorch and under torch.compile, same pages, on the GPU.

Tuned vs default (``--default-registry DIR``): the same four runs with the family library of a
  second registry (built with the safe default parameters), on the same pools, pairs and cold
  buffers, right after the first registry's; recorded under ``default`` per family.

Usage: python -m kvgen.bench.codec [--families a,b] [--hot-gib 1.2] [--no-peers] [--default-registry DIR]
(``kvgen bench run`` runs it with the other benchmarks, against ceilings measured once.)
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

from kvgen import paths
from kvgen.artifacts.manifest import RegistryError
from kvgen.lower.layout import family_layout
from kvgen.measure.environment import environment, write_result
from kvgen.measure import mix
from kvgen.measure.libraries import registry_artifact
from kvgen.measure.timing import measure_ceilings, require_cuda, time_ms
from kvgen.measure.workloads.codec import CodecWorkload
from kvgen.reference.codec import encode_records
from kvgen.runtime import ColdPageCodec, FamilyLibrary, LibraryError
from kvgen.spec.schema import load_spec

DEFAULT_FAMILIES = "qwen3-8b,qwen3-8b-fp8,deepseek-v3,deepseek-v4-csa"


def library_for(family: str, registry: Path, arch: str) -> FamilyLibrary:
    return FamilyLibrary(registry_artifact(registry, family, arch, "codec"), family)


def oracle_encode(layout, pools, lc, src: torch.Tensor, encode_fn) -> None:
    nq = len(layout.record.buffers)
    for layer in lc.layers:
        buffers = {b.name: pools[layer][i][src] for i, b in enumerate(layout.record.buffers)}
        sides = {s.name: pools[layer][nq + i][src] for i, s in enumerate(layout.record.sides)}
        encode_fn(layout.record, buffers, sides)


def bench_family(family: str, hot_gib: float, ceilings: dict, registry: Path, arch: str, peers: bool,
                 default_registry: Path | None = None, specs: Path | None = None) -> dict:
    spec = load_spec(paths.spec_path(family, specs))
    layout = family_layout(spec)
    lc = layout.lifecycles[0]
    pages = math.ceil(hot_gib * (1 << 30) / lc.hot_page_bytes)
    pools = CodecWorkload(layout, spec.dtype).pools(pages, torch.Generator(device="cuda").manual_seed(0))
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
    result.update(time_runs(runs))
    result["mix"] = mix_ceilings(pages, lc.hot_page_bytes, lc.cold_page_bytes, copy_bw, result)
    if default_registry is not None:
        try:
            default = ColdPageCodec(library_for(family, default_registry, arch), layout, pools)
        except (LookupError, RegistryError, LibraryError) as exc:
            result["default"] = {"registry": str(default_registry), "error": f"{type(exc).__name__}: {exc}"}
        else:
            try:
                # both libraries must write the same cold bytes (parameters never change the format)
                ours, theirs = torch.zeros_like(cold_dev), torch.zeros_like(cold_dev)
                codec.encode(ours, enc_pairs)
                default.encode(theirs, enc_pairs)
                same = bool(torch.equal(ours, theirs))
                del ours, theirs
                default_runs = {
                    "encode_device": (lambda: default.encode(cold_dev, enc_pairs), hot_bytes + cold_bytes, copy_bw),
                    "decode_device": (lambda: default.decode(cold_dev, dec_pairs), hot_bytes + cold_bytes, copy_bw),
                    "encode_pinned": (lambda: default.encode(cold_pin, enc_pairs), cold_bytes, d2h),
                    "decode_pinned": (lambda: default.decode(cold_pin, dec_pairs), cold_bytes, h2d),
                }
                result["default"] = {"registry": str(default_registry), "encode_equal_to_tuned": same,
                                     **time_runs(default_runs)}
            except Exception as exc:  # noqa: BLE001 - the comparison is recorded as failed, the family kept
                result["default"] = {"registry": str(default_registry), "error": f"{type(exc).__name__}: {exc}"}
            finally:
                default.close()
    # what offloading costs without the codec: the hot bytes at the measured pinned bandwidth
    result["raw_offload_ms"] = hot_bytes / d2h / 1e6
    result["offload_speedup_vs_raw_copy"] = result["raw_offload_ms"] / result["encode_pinned"]["median_ms"]
    if peers:
        result["peers"] = bench_peers(layout, pools, lc, perm.long().cuda())
    codec.close()
    del pools
    torch.cuda.empty_cache()
    return result


def time_runs(runs: dict) -> dict:
    """name -> (call, bytes moved, ceiling GB/s): median and quantiles, GB/s, fraction of the ceiling."""
    out = {}
    for name, (fn, moved, ceiling) in runs.items():
        t = time_ms(fn, reps=10)
        gbps = moved / t["median_ms"] / 1e6
        out[name] = {"median_ms": t["median_ms"], "p20_ms": t["p20_ms"], "p80_ms": t["p80_ms"],
                     "gbps": gbps, "fraction_of_ceiling": gbps / ceiling}
    return out


def mix_ceilings(pages: int, hot_page_bytes: int, cold_page_bytes: int, copy_gbps: float, result: dict) -> dict:
    """The device runs' own traffic mixes without arithmetic (``kvgen.measure.mix``): decode reads
    the cold records and writes the hot pages, encode the reverse. Each device run gains
    ``fraction_of_mix``, its mix's time over its own."""
    mixes = {"decode_device": mix.ceiling(pages, cold_page_bytes, hot_page_bytes, copy_gbps),
             "encode_device": mix.ceiling(pages, hot_page_bytes, cold_page_bytes, copy_gbps)}
    for run, m in mixes.items():
        result[run]["fraction_of_mix"] = m["median_ms"] / result[run]["median_ms"]
    return mixes


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


def run(ceilings: dict, families: list[str], hot_gib: float = 1.2, registry: Path | None = None,
        arch: str = "sm_90a", peers: bool = True, default_registry: Path | None = None,
        specs: Path | None = None) -> dict:
    """Every family (specs from ``specs``, default ``paths.specs_dir()``) against ``ceilings``
    (``measure_ceilings()``, with pinned): ``{"results": [...]}``."""
    results = []
    for family in families:
        res = bench_family(family, hot_gib, ceilings, paths.registry_dir(registry), arch, peers, default_registry,
                           specs)
        print(family, {k: v for k, v in res.items() if isinstance(v, dict)}, flush=True)
        results.append(res)
    return {"results": results}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", default=DEFAULT_FAMILIES)
    parser.add_argument("--hot-gib", type=float, default=1.2)
    parser.add_argument("--registry", type=Path, default=paths.registry_dir())
    parser.add_argument("--default-registry", type=Path, default=None,
                        help="also time this registry's libraries (built with the default parameters)")
    parser.add_argument("--arch", default="sm_90a")
    parser.add_argument("--no-peers", action="store_true")
    parser.add_argument("--tag", default="", help="suffix of the result file (bench_codec-TAG.json)")
    args = parser.parse_args()
    require_cuda()
    ceilings = measure_ceilings()
    print("ceilings", ceilings, flush=True)
    record = run(ceilings, args.families.split(","), args.hot_gib, args.registry, args.arch, not args.no_peers,
                 args.default_registry)
    path = write_result("bench_codec", {"environment": environment(), "ceilings": ceilings, **record}, args.tag)
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
