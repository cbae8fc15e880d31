"""TriAttention compaction and move packing on the GPU, against the copy ceiling of the same run.

Compaction, at the geometry of --family's library (default qwen3-8b: 36 layers, 8 KV heads,
head_dim 128, bf16, 32 tokens per block), budget 2048, decode length 4096 (S - P), prompt 512,
protected tails of 0..31 tokens, batch 1, 32 and 256, pages scattered by a random page table:
  moved bytes (K and V rows of every real move, read + written; identity moves excluded)
  / median time / device copy bandwidth (torch copy of 4 GiB, read + written).
Timing: the call captured in a CUDA graph and replayed, each replay between CUDA events, median and
quantiles of 20 after 3 warm-ups. Compaction is in place and its cost does not depend on the bytes,
so replaying the same moves measures the same work. L2: a set of pools whose moves touch less than
3x the L2 is rotated with further sets (at these sizes one set already touches >= 600 MB).
Memory: the whole 36-layer cache at batch 256 is ~150 GB, more than an H200 holds. The batch,
budget and lengths stay; the layers that do not fit get fill moves (-1: their CTAs read the move
rows and touch no pool) and the result says how many layers moved (layers_moved).

Packer: the generated Triton packer (generated/<family>/pack.py, with capacity: no host sync) as a
CUDA graph replay and as an eager call, against the oracle's pack_moves on the GPU (torch ops in
Python loops, eager wall time). Batch 1 also checks compaction against the oracle's compact_paged.

Usage: python benchmarks/bench_compact.py [--family qwen3-8b] [--batches 1,32,256] [--mode union]
Needs only torch, triton and this repository (no pydantic). Writes bench_compact.json to $OUT or results/.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import re
import sys
import time
import types
from pathlib import Path
from statistics import median

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _register_bare_kvgen_packages() -> None:
    """The GPU machine has no pydantic, which kvgen/__init__.py (via the spec) needs: register the
    packages bare so the spec-free modules used here import. A no-op where pydantic exists."""
    if importlib.util.find_spec("pydantic") is not None or "kvgen" in sys.modules:
        return
    kvgen = ROOT / "kvgen"
    version = re.search(r'__version__ = "([^"]+)"', (kvgen / "__init__.py").read_text()).group(1)
    for name in ("kvgen", "kvgen.reference", "kvgen.runtime"):
        package = types.ModuleType(name)
        package.__path__ = [str(kvgen.joinpath(*name.split(".")[1:]))]
        sys.modules[name] = package
    sys.modules["kvgen"].__version__ = version


_register_bare_kvgen_packages()

from benchmarks.common import copy_ceiling, environment, time_ms, write_result  # noqa: E402
from kvgen.reference.triattention import TriGeometry, compact_paged  # noqa: E402
from kvgen.reference.triattention import pack_moves as oracle_pack_moves  # noqa: E402
from kvgen.registry import manifest_path, read_manifest, verify_artifact  # noqa: E402
from kvgen.runtime.compact import CompactLibrary, Compactor  # noqa: E402
from kvgen.runtime.pack import MovePacker, pack_module_path  # noqa: E402

BUDGET = 2048
DECODE = 4096
PROMPT = 512
MAX_TAIL = 31
REPS = 20


def library_for(family: str, registry: Path, arch: str) -> CompactLibrary:
    path = manifest_path(registry, arch)
    manifest = read_manifest(path, verify=False)
    entry = manifest.library(family)
    if entry is None:
        raise SystemExit(f"{family} is not in {path}; run: kvgen build --arch {arch} --family {family}")
    return CompactLibrary(verify_artifact(path, manifest, entry))


def oracle_geometry(info: dict, packer: MovePacker) -> TriGeometry:
    return TriGeometry(num_layers=info["num_layers"], query_heads=info["kv_heads"], kv_heads=info["kv_heads"],
                       head_dim=info["head_dim"], rotary_start=0, rotary_dim=info["head_dim"], pairing="half",
                       tokens_per_block=info["tokens_per_block"], layout=info["layout"],
                       swa_window=packer.swa_window)


def make_batch(batch: int, rows: int, seed: int) -> dict:
    """Due requests keeping a random BUDGET of their DECODE tokens (ascending, absolute)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    P = torch.full((batch,), PROMPT, dtype=torch.int64, device="cuda")
    S = P + DECODE
    tail = torch.randint(0, MAX_TAIL + 1, (batch,), generator=g, device="cuda")
    order = torch.rand(batch, rows, DECODE, generator=g, device="cuda").argsort(dim=-1)[..., :BUDGET]
    kept = order.sort(dim=-1).values + PROMPT
    active = torch.ones(batch, dtype=torch.bool, device="cuda")
    return {"kept": kept, "P": P, "S": S, "tail": tail, "active": active}


def batch_args(b: dict, mode: str) -> tuple:
    return b["kept"], b["P"], b["S"], b["tail"], b["active"], BUDGET, mode


def wall_ms(fn, reps: int, warmup: int = 1) -> dict[str, float]:
    """Eager wall time (host loops and syncs included), synchronized around each call."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        samples.append((time.perf_counter() - start) * 1e3)
    samples.sort()
    return {"median_ms": median(samples), "p20_ms": samples[len(samples) // 5],
            "p80_ms": samples[(4 * len(samples)) // 5]}


def capture(fn) -> torch.cuda.CUDAGraph:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def _short(t: dict) -> dict:
    return {k: v for k, v in t.items() if k != "samples_ms"}


# ---------------------------------------------------------------------------------------------
# Packer
# ---------------------------------------------------------------------------------------------


def bench_packer(packer: MovePacker, geo: TriGeometry, b: dict, mode: str, capacity: int) -> dict:
    args = batch_args(b, mode)
    batch = b["kept"].shape[0]
    graph = capture(lambda: packer(*args, batch, capacity))
    replay = time_ms(graph.replay, reps=REPS)
    eager = wall_ms(lambda: packer(*args, batch, capacity), reps=REPS)
    oracle = wall_ms(lambda: oracle_pack_moves(*args, geo, batch), reps=10)
    return {"triton_graph": _short(replay), "triton_eager": eager, "oracle_eager": oracle,
            "speedup_graph_vs_oracle": oracle["median_ms"] / replay["median_ms"]}


# ---------------------------------------------------------------------------------------------
# Compaction
# ---------------------------------------------------------------------------------------------


def pool_shape(info: dict, pages: int) -> tuple[int, ...]:
    if info["layout"] == "HND":
        return pages, info["kv_heads"], info["tokens_per_block"], info["head_dim"]
    return pages, info["tokens_per_block"], info["kv_heads"], info["head_dim"]


def layer_bytes(info: dict, pages: int) -> int:
    """K and V pools of one layer."""
    return 2 * pages * math.prod(pool_shape(info, 1)[1:]) * info["elem_bytes"]


def layers_that_fit(info: dict, pages: int, reserve: int = 1 << 30) -> int:
    free, _ = torch.cuda.mem_get_info()
    return max(1, min(info["num_layers"], int((0.85 * free - reserve) // layer_bytes(info, pages))))


def rotation_sets(moved_bytes: int, set_bytes: int, l2_bytes: int) -> int:
    """Pool sets to rotate so the replays touch >= 3x the L2, as many as memory allows."""
    wanted = max(1, math.ceil(3 * l2_bytes / max(1, moved_bytes // 2)))  # distinct bytes ~ half of read + written
    free, _ = torch.cuda.mem_get_info()
    return max(1, min(wanted, int(0.85 * free // max(1, set_bytes))))


def make_pools(info: dict, pages: int, moved_layers: int, fill: bool) -> tuple[list, list]:
    """Real pools for the moved layers; one 1-page pool stands in for every other layer (never read)."""
    dtype = {2: torch.bfloat16, 1: torch.float8_e4m3fn}[info["elem_bytes"]]
    stub = torch.empty(pool_shape(info, 1), dtype=dtype, device="cuda")
    k_pools, v_pools = [], []
    for layer in range(info["num_layers"]):
        for pools in (k_pools, v_pools):
            if layer >= moved_layers:
                pools.append(stub)
                continue
            pool = torch.empty(pool_shape(info, pages), dtype=dtype, device="cuda")
            if fill:
                pool.view(torch.uint8).random_(0, 256)
            pools.append(pool)
    return k_pools, v_pools


def verify_packer(src, dst, offsets, b: dict, mode: str, geo: TriGeometry) -> bool:
    ref = oracle_pack_moves(*batch_args(b, mode), geo, b["kept"].shape[0])
    n = ref.src.shape[-1]
    return (torch.equal(src[..., :n], ref.src) and torch.equal(dst[..., :n], ref.dst)
            and torch.equal(offsets, ref.offsets) and bool((src[..., n:] == -1).all()))


def verify(compactor: Compactor, k_pools: list, v_pools: list, table, moves: tuple, geo: TriGeometry) -> bool:
    """One eager compaction against the oracle's compact_paged on copies of the same pools."""
    from kvgen.reference.triattention import Moves

    k_ref = [p.clone() for p in k_pools]
    v_ref = [p.clone() for p in v_pools]
    src, dst, offsets = moves
    n = int(offsets[-1])
    compact_paged(k_ref, v_ref, table, Moves(src[..., :n].contiguous(), dst[..., :n].contiguous(), offsets), geo)
    compactor(table, *moves)
    torch.cuda.synchronize()
    return all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
               for a, b in zip(k_pools + v_pools, k_ref + v_ref))


def bench_compaction(library: CompactLibrary, packer: MovePacker, geo: TriGeometry, batch: int, mode: str,
                     copy_gbps: float, l2_bytes: int) -> tuple[dict, dict, int]:
    """The compaction result of one batch size, plus the batch and capacity for the packer run."""
    info = library.info
    tpb = info["tokens_per_block"]
    pages_per_request = math.ceil((PROMPT + DECODE + MAX_TAIL) / tpb)
    pages = batch * pages_per_request
    rows = {"union": 1, "per_head": info["kv_heads"], "per_layer_perhead": info["num_layers"] * info["kv_heads"]}[mode]
    b = make_batch(batch, rows, seed=batch)
    capacity = batch * (BUDGET + MAX_TAIL)
    src, dst, offsets = packer(*batch_args(b, mode), batch, capacity)
    packer_verified = verify_packer(src, dst, offsets, b, mode, geo) if batch == 1 else None
    moved_layers = layers_that_fit(info, pages)
    src[moved_layers:] = -1  # layers that do not fit move nothing (see the module docstring)
    dst[moved_layers:] = -1
    real = int(((src >= 0) & (src != dst)).sum())
    moved_bytes = real * info["head_dim"] * info["elem_bytes"] * 2 * 2  # K and V, read and written
    table = torch.randperm(pages, dtype=torch.int32, device="cuda").reshape(batch, pages_per_request)

    sets = rotation_sets(moved_bytes, moved_layers * layer_bytes(info, pages), l2_bytes)
    graphs, verified = [], None
    for i in range(sets):
        k_pools, v_pools = make_pools(info, pages, moved_layers, fill=(batch == 1 and i == 0))
        compactor = Compactor(library, k_pools, v_pools)
        if batch == 1 and i == 0:
            verified = verify(compactor, k_pools, v_pools, table, (src, dst, offsets), geo)
        graphs.append((capture(lambda c=compactor: c(table, src, dst, offsets)), compactor))
    turn = iter(range(1 << 30))
    t = time_ms(lambda: graphs[next(turn) % sets][0].replay(), reps=REPS)
    gbps = moved_bytes / t["median_ms"] / 1e6
    result = {"batch": batch, "layers_moved": moved_layers, "layers": info["num_layers"], "real_moves": real,
              "moved_bytes": moved_bytes, "rotation_sets": sets, "verified_against_oracle": verified,
              "packer_verified_against_oracle": packer_verified,
              "compact": {**_short(t), "gbps": gbps, "fraction_of_copy": gbps / copy_gbps}}
    del graphs
    return result, b, capacity


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", default="qwen3-8b")
    parser.add_argument("--batches", default="1,32,256")
    parser.add_argument("--mode", default="union", choices=("union", "per_head", "per_layer_perhead"))
    parser.add_argument("--registry", type=Path, default=ROOT / "build" / "registry")
    parser.add_argument("--arch", default="sm_90a")
    parser.add_argument("--generated", type=Path, default=ROOT / "generated")
    args = parser.parse_args()

    library = library_for(args.family, args.registry, args.arch)
    packer = MovePacker(pack_module_path(args.generated, args.family), args.family)
    geo = oracle_geometry(library.info, packer)
    ceilings = {"device_copy": copy_ceiling(4 << 30)}
    torch.cuda.empty_cache()
    copy_gbps = ceilings["device_copy"]["gbps_read_plus_write"]
    l2_bytes = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 60 << 20)
    print("ceilings", ceilings, flush=True)
    results = []
    for batch in map(int, args.batches.split(",")):
        res, b, capacity = bench_compaction(library, packer, geo, batch, args.mode, copy_gbps, l2_bytes)
        torch.cuda.empty_cache()
        res["pack"] = bench_packer(packer, geo, b, args.mode, capacity)
        print(batch, res, flush=True)
        results.append(res)
        del b
        torch.cuda.empty_cache()
    config = {"family": args.family, "mode": args.mode, "budget": BUDGET, "decode": DECODE, "prompt": PROMPT,
              "tail": f"0..{MAX_TAIL}", "geometry": library.info, "l2_bytes": l2_bytes}
    path = write_result("bench_compact", {"environment": environment(), "ceilings": ceilings, "config": config,
                                          "results": results})
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
