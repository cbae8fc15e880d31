"""TriAttention compaction and move packing on the GPU, against the copy ceiling of the same run.

Compaction, at the geometry of --family's library (default qwen3-8b: 36 layers, 8 KV heads,
head_dim 128, bf16, 32 tokens per block), budget 2048, decode length 4096 (S - P), prompt 512,
protected tails of 0..31 tokens, batch 1, 32 and 256, pages scattered by a random page table:
  moved bytes (K and V rows of every real move, read + written; identity moves excluded)
  / median time / device copy bandwidth (``measure_ceilings``: torch copy of 2 GiB, read + written,
  measured once per run; before ``kvgen bench`` this benchmark copied 4 GiB: 4211 vs 4217 GB/s).
Timing: the call captured in a CUDA graph and replayed, each replay between CUDA events, median and
quantiles of 20 after 3 warm-ups. Compaction is in place and its cost does not depend on the bytes,
so replaying the same moves measures the same work. L2: a set of pools whose moves touch less than
3x the L2 is rotated with further sets (at these sizes one set already touches >= 600 MB).
Memory: the whole 36-layer cache at batch 256 is ~150 GB, more than an H200 holds. The batch,
budget and lengths stay, and every layer moves its bytes: the layers that do not fit compact the
pools of the layers that do (round robin; the same moves replayed on the same bytes, as every
replay does), and the result says how many layers have pools of their own (layers_with_own_pools).
Until the twelfth session those layers got fill moves (-1) instead: their CTAs still walked every
move row while adding no bytes, which cost batch 256 0.69 of copy on an H100 (22 of 36 layers fill)
where the same kernel reached 0.94 at batch 32 (results/2026-12-07-h100-s12/call3).
A batch that moves fewer bytes than the ceiling's copy (batch 1: ~0.3 GB each way) also times a
``copy_`` of its own size (``same_size_copy``): the part of its fraction that size alone costs.

Packer: the generated Triton packer (the registry's ``pack`` artifact, with capacity: no host sync) as a
CUDA graph replay and as an eager call, against the oracle's pack_moves on the GPU (torch ops in
Python loops, eager wall time). Batch 1 also checks compaction against the oracle's compact_paged.

Tuned vs default (``--default-registry DIR``): the compaction of the second registry's family
library (built with the safe default parameters) captured over the same pools, page table and moves
and timed the same way right after; batch 1 checks it against the oracle too. Recorded under
``default`` per batch.

Page tables (``--page-table``): ``scattered`` (default, what ``kvgen bench run`` measures) gives every
request random pages of the pool; ``contiguous`` gives each request a run of consecutive pages, the
same moves over the same bytes with far fewer distinct 2 MiB translation pages in flight (a
diagnostic: whether a batch's fraction of copy is lost to address translation rather than to the
kernel).

Usage: python -m kvgen.bench.compact [--family qwen3-8b] [--batches 1,32,256] [--mode union] [--page-table scattered]
Needs only torch, triton and this repository (no pydantic). Writes bench_compact.json to $OUT or results/.
(``kvgen bench run`` runs it with the other benchmarks, against ceilings measured once.)
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

from kvgen import paths
from kvgen.artifacts.dispatch import dispatch_rows
from kvgen.artifacts.manifest import RegistryError
from kvgen.measure.environment import environment, write_result
from kvgen.measure.libraries import registry_artifact, registry_dispatch
from kvgen.measure.timing import (
    COPY_CEILING_BYTES,
    capture,
    l2_bytes,
    measure_ceilings,
    require_cuda,
    rotation_sets,
    summary,
    time_calls,
    time_ms,
)
from kvgen.measure.workloads.compact import oracle_compaction_matches
from kvgen.reference.triattention import Moves, TriGeometry, page_shape
from kvgen.reference.triattention import pack_moves as oracle_pack_moves
from kvgen.runtime.compact import LAUNCH, CompactLibrary, Compactor
from kvgen.runtime.library import LibraryError, load_once
from kvgen.runtime.pack import MovePacker

BUDGET = 2048
DECODE = 4096
PROMPT = 512
MAX_TAIL = 31
REPS = 20


Libraries = tuple[CompactLibrary, list[tuple[int, CompactLibrary]]]   # the main one, (from_work, variant)


def libraries_for(family: str, registry: Path, arch: str) -> Libraries:
    """The registry's compaction library and its size-dispatched variants, each file loaded once."""
    return load_once(*registry_dispatch(registry, family, arch, "compact"), CompactLibrary)


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


# ---------------------------------------------------------------------------------------------
# Packer
# ---------------------------------------------------------------------------------------------


def bench_packer(packer: MovePacker, geo: TriGeometry, b: dict, mode: str, capacity: int) -> dict:
    args = batch_args(b, mode)
    batch = b["kept"].shape[0]
    graph = capture(lambda: packer(*args, batch, capacity))
    replay = time_ms(graph.replay, reps=REPS)
    eager = summary(time_ms(lambda: packer(*args, batch, capacity), reps=REPS, warmup=1, clock="wall"))
    oracle = summary(time_ms(lambda: oracle_pack_moves(*args, geo, batch), reps=10, warmup=1, clock="wall"))
    return {"triton_graph": summary(replay), "triton_eager": eager, "oracle_eager": oracle,
            "speedup_graph_vs_oracle": oracle["median_ms"] / replay["median_ms"]}


# ---------------------------------------------------------------------------------------------
# Compaction
# ---------------------------------------------------------------------------------------------


def pool_shape(info: dict, pages: int) -> tuple[int, ...]:
    return pages, *page_shape(info["layout"], info["kv_heads"], info["tokens_per_block"], info["head_dim"])


def layer_bytes(info: dict, pages: int) -> int:
    """K and V pools of one layer."""
    return 2 * pages * math.prod(pool_shape(info, 1)[1:]) * info["elem_bytes"]


def layers_that_fit(info: dict, pages: int, reserve: int = 1 << 30) -> int:
    free, _ = torch.cuda.mem_get_info()
    return max(1, min(info["num_layers"], int((0.85 * free - reserve) // layer_bytes(info, pages))))


def make_pools(info: dict, pages: int, own_layers: int, fill: bool) -> tuple[list, list]:
    """Pools of their own for the first ``own_layers`` layers; every later layer compacts the pools
    of one of those (round robin: the module docstring's memory note)."""
    dtype = {2: torch.bfloat16, 1: torch.float8_e4m3fn}[info["elem_bytes"]]
    k_pools, v_pools = [], []
    for layer in range(info["num_layers"]):
        for pools in (k_pools, v_pools):
            if layer >= own_layers:
                pools.append(pools[layer % own_layers])
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


PAGE_TABLES = ("scattered", "contiguous")


def page_table(batch: int, pages_per_request: int, order: str) -> torch.Tensor:
    """``[batch, pages_per_request]`` page ids of the pool: a random permutation (``scattered``) or
    consecutive runs (``contiguous``)."""
    pages = batch * pages_per_request
    if order == "contiguous":
        ids = torch.arange(pages, dtype=torch.int32, device="cuda")
    else:
        ids = torch.randperm(pages, dtype=torch.int32, device="cuda")
    return ids.reshape(batch, pages_per_request)


def bench_compaction(libraries: Libraries, packer: MovePacker, geo: TriGeometry, batch: int, mode: str,
                     copy_gbps: float, default_library: CompactLibrary | None = None,
                     table_order: str = "scattered") -> tuple[dict, dict, int]:
    """The compaction result of one batch size (by the library serving it: the main one or a
    size-dispatched variant), plus the batch and capacity for the packer run; with
    ``default_library``, that library's compaction over the same pools and moves too."""
    library, variants = libraries
    info = library.info
    tpb = info["tokens_per_block"]
    pages_per_request = math.ceil((PROMPT + DECODE + MAX_TAIL) / tpb)
    pages = batch * pages_per_request
    rows = {"union": 1, "per_head": info["kv_heads"], "per_layer_perhead": info["num_layers"] * info["kv_heads"]}[mode]
    b = make_batch(batch, rows, seed=batch)
    capacity = batch * (BUDGET + MAX_TAIL)
    src, dst, offsets = packer(*batch_args(b, mode), batch, capacity)
    packer_verified = verify_packer(src, dst, offsets, b, mode, geo) if batch == 1 else None
    own_layers = layers_that_fit(info, pages)
    real = int(((src >= 0) & (src != dst)).sum())
    moved_bytes = real * info["head_dim"] * info["elem_bytes"] * 2 * 2  # K and V, read and written
    table = page_table(batch, pages_per_request, table_order)

    # distinct bytes a replay touches ~ half of the bytes read + written
    sets = rotation_sets(moved_bytes // 2, own_layers * layer_bytes(info, pages))
    graphs, verified = [], None
    for i in range(sets):
        k_pools, v_pools = make_pools(info, pages, own_layers, fill=(batch == 1 and i == 0))
        compactor = Compactor(library, k_pools, v_pools, variants)
        if batch == 1 and i == 0:
            verified = oracle_compaction_matches(compactor, k_pools, v_pools, table, Moves(src, dst, offsets), geo)
        graphs.append((capture(lambda c=compactor: c(table, src, dst, offsets)), compactor))
    t = time_calls([graph.replay for graph, _ in graphs], reps=REPS)
    gbps = moved_bytes / t["median_ms"] / 1e6
    served = graphs[0][1].library_for(batch)
    result = {"batch": batch, "library": str(served.path),
              "params": {k: served.info[k] for k in LAUNCH},
              "layers_moved": info["num_layers"], "layers_with_own_pools": own_layers,
              "layers": info["num_layers"], "real_moves": real,
              "moved_bytes": moved_bytes, "rotation_sets": sets, "verified_against_oracle": verified,
              "packer_verified_against_oracle": packer_verified,
              "compact": {**summary(t), "gbps": gbps, "fraction_of_copy": gbps / copy_gbps}}
    if moved_bytes // 2 < COPY_CEILING_BYTES:    # batch 1 (~0.3 GB each way)
        result["same_size_copy"] = same_size_copy(moved_bytes, copy_gbps, t["median_ms"])
    if default_library is not None:
        try:
            result["default"] = bench_default(default_library, graphs, table, (src, dst, offsets), geo, batch,
                                              moved_bytes, copy_gbps)
        except Exception as exc:  # noqa: BLE001 - the comparison is recorded as failed, the batch kept
            result["default"] = {"library": str(default_library.path), "error": f"{type(exc).__name__}: {exc}"}
    del graphs
    return result, b, capacity


def same_size_copy(moved_bytes: int, copy_gbps: float, compact_ms: float) -> dict:
    """A ``copy_`` of the moved bytes in one piece, captured and replayed as the compaction is: where
    a batch moves less than the ceiling's copy, what launch, ramp and last wave alone cost at that
    size (``of_copy``), and the compaction's time against it (``compact_of_it``)."""
    src = torch.empty(moved_bytes // 2, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    t = time_calls([capture(lambda: dst.copy_(src)).replay], reps=REPS)
    gbps = moved_bytes / t["median_ms"] / 1e6
    return {"bytes": moved_bytes // 2, **summary(t), "gbps_read_plus_write": gbps, "of_copy": gbps / copy_gbps,
            "compact_of_it": t["median_ms"] / compact_ms}


def bench_default(library: CompactLibrary, graphs: list, table, moves: tuple, geo: TriGeometry, batch: int,
                  moved_bytes: int, copy_gbps: float) -> dict:
    """The default library's compaction over the pool sets of ``graphs`` (same pools, table and
    moves), captured and timed like the tuned one; batch 1 is checked against the oracle."""
    out: dict = {"library": str(library.path), "geometry": library.info}
    default_graphs, verified = [], None
    for i, (_, tuned) in enumerate(graphs):
        compactor = Compactor(library, *tuned._pools)
        if batch == 1 and i == 0:
            verified = oracle_compaction_matches(compactor, *tuned._pools, table, Moves(*moves), geo)
        default_graphs.append((capture(lambda c=compactor: c(table, *moves)), compactor))
    t = time_calls([graph.replay for graph, _ in default_graphs], reps=REPS)
    gbps = moved_bytes / t["median_ms"] / 1e6
    del default_graphs
    return {**out, "verified_against_oracle": verified,
            "compact": {**summary(t), "gbps": gbps, "fraction_of_copy": gbps / copy_gbps}}


def run(ceilings: dict, family: str = "qwen3-8b", batches: list[int] = (1, 32, 256), mode: str = "union",
        registry: Path | None = None, arch: str = "sm_90a",
        default_registry: Path | None = None, table_order: str = "scattered") -> dict:
    """Compaction and packing at every batch size against ``ceilings["device_copy"]``:
    ``{"config": {...}, "results": [...]}``."""
    libraries = libraries_for(family, paths.registry_dir(registry), arch)
    library = libraries[0]
    default_library, default_error = None, None
    if default_registry is not None:
        try:
            default_library = libraries_for(family, default_registry, arch)[0]
        except (LookupError, RegistryError, LibraryError) as exc:
            default_error = f"{type(exc).__name__}: {exc}"
    packer = MovePacker(registry_artifact(paths.registry_dir(registry), family, arch, "pack"), family)
    geo = oracle_geometry(library.info, packer)
    torch.cuda.empty_cache()
    copy_gbps = ceilings["device_copy"]["gbps_read_plus_write"]
    results = []
    for batch in batches:
        res, b, capacity = bench_compaction(libraries, packer, geo, batch, mode, copy_gbps, default_library,
                                            table_order)
        if default_error:
            res["default"] = {"registry": str(default_registry), "error": default_error}
        torch.cuda.empty_cache()
        res["pack"] = bench_packer(packer, geo, b, mode, capacity)
        print(batch, res, flush=True)
        results.append(res)
        del b
        torch.cuda.empty_cache()
    config = {"family": family, "mode": mode, "budget": BUDGET, "decode": DECODE, "prompt": PROMPT,
              "tail": f"0..{MAX_TAIL}", "page_table": table_order, "geometry": library.info, "l2_bytes": l2_bytes(),
              "dispatch": dispatch_rows(library.path, [(start, lib.path) for start, lib in libraries[1]])}
    if default_library is not None:
        config["default_geometry"] = default_library.info
    return {"config": config, "results": results}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", default="qwen3-8b")
    parser.add_argument("--batches", default="1,32,256")
    parser.add_argument("--mode", default="union", choices=("union", "per_head", "per_layer_perhead"))
    parser.add_argument("--registry", type=Path, default=paths.registry_dir())
    parser.add_argument("--default-registry", type=Path, default=None,
                        help="also time this registry's compaction (built with the default parameters)")
    parser.add_argument("--arch", default="sm_90a")
    parser.add_argument("--page-table", default="scattered", choices=PAGE_TABLES,
                        help="each request's pages: random pages of the pool, or consecutive ones")
    args = parser.parse_args()
    require_cuda()
    ceilings = measure_ceilings(pinned=False)
    print("ceilings", ceilings, flush=True)
    record = run(ceilings, args.family, [int(b) for b in args.batches.split(",")], args.mode, args.registry,
                 args.arch, args.default_registry, args.page_table)
    path = write_result("bench_compact", {"environment": environment(), "ceilings": ceilings, **record})
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
