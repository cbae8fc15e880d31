"""What one measured call of each op launches: grids, threads and the phases of a CTA, from the
family's geometry, the size bucket (``kvgen.tuning.space.BUCKETS``, as ``kvgen.tuning.measure``
sizes it) and the candidate's parameters. Which loop of the SASS does which phase is picked by what
it touches (global loads into shared stores: the codec's quantizer; ...), not by name.

The ops' launch shapes (documented with their kernels):
- codec: encode then decode, grid (page pairs x layers), one layer record per CTA, staged in shared
  memory (``kvgen/kernels/cuda/codec_kernels.cuh``);
- compact: grid (requests x KV heads x layers), each CTA walks its moves tile after tile, K and V
  rows of 16-byte vectors, a tile's loads issued before the previous tile's stores;
- score: grid (token tiles x KV heads x passes x layers x requests), each thread a token's chunks
  of K (``kvgen/kernels/cute/score_kernel.py``).
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Mapping

from kvgen.tuning.costmodel.features import KernelFeatures, Mix
from kvgen.tuning.costmodel.model import Launch, Phase, Walk


class WorkloadError(ValueError):
    """A candidate whose SASS lacks a kernel or loop the op's workload needs."""


def pick_kernel(features: Mapping[str, KernelFeatures], marker: str) -> KernelFeatures:
    """The kernel whose name holds ``marker``; of several instantiations the device-pair one
    (``Lb1E``, what the runtime launches for pairs on the GPU), else the first."""
    named = [f for n, f in sorted(features.items()) if marker in n]
    if not named:
        raise WorkloadError(f"no kernel named *{marker}* among {sorted(features)}")
    return next((f for f in named if "Lb1E" in f.name), named[0])


def pick_loop(kernel: KernelFeatures, *kinds: str) -> Mix | None:
    """The largest loop touching every memory kind of ``kinds`` (None when there is none)."""
    loops = [m for m in kernel.loops if all(m.memory.get(k, 0) for k in kinds) and m.global_bytes]
    return max(loops, key=lambda m: m.total) if loops else None


def record_load(params: Mapping[str, int], record_bytes: int) -> tuple[float, int]:
    """Bytes a decode thread has in flight while the record comes in, and the round trips it takes
    (``decode_load``, codec_kernels.cuh RecordLoad): the register copy keeps ``in_flight`` words per
    thread outstanding, round after round; cp.async and the bulk copy put the whole record in flight
    at once (a host slot takes cp.async under route 2: the same single round trip)."""
    threads = params["threads"]
    if params.get("decode_load", 0):
        return record_bytes / threads, 1
    in_flight = params["in_flight"]
    return min(16.0 * in_flight, record_bytes / threads), math.ceil(record_bytes / 16 / (threads * in_flight))


def codec_launches(features: Mapping[str, KernelFeatures], params: Mapping[str, int], size: Mapping,
                   record_bytes: int) -> list[Launch]:
    """Encode + decode of ``size["pages"]`` pages (``size``: the measurement's hot/cold bytes)."""
    hot, cold = float(size["hot_bytes"]), float(size["cold_bytes"])
    where = "host" if size.get("cold") == "pinned" else "hbm"
    ctas = max(1, round(cold / record_bytes))
    threads = params["threads"]
    record_in_flight, rounds = record_load(params, record_bytes)
    pages = decode_pages(params)
    encode, decode = pick_kernel(features, "encode_kernel"), pick_kernel(features, "decode_kernel")
    quantize = pick_loop(encode, "global_load", "shared_store")
    dequantize = pick_loop(decode, "shared_load", "global_store")
    return [
        Launch("encode", encode, ctas, threads, record_bytes, (
            Phase("quantize", hot, "hbm", quantize, float(quantize.load_bytes) if quantize else 16.0),
            Phase("store", cold, where, None, 0.0))),
        Launch("decode", decode, math.ceil(ctas / pages), threads, record_bytes * (2 if pages > 1 else 1), (
            Phase("load", cold, where, None, record_in_flight, rounds=rounds),
            Phase("dequantize", hot, "hbm", dequantize, 0.0))),
    ]


def decode_pages(params: Mapping[str, int]) -> int:
    """Pairs a decode CTA takes (``decode_pages``; the register copy folds it to 1). The model
    counts its fewer CTAs and doubled shared memory, not the overlap of one record's load with the
    other's decode (measured on the H100 to gain less than the occupancy costs)."""
    return params.get("decode_pages", 1) if params.get("decode_load", 0) else 1


def compact_launches(features: Mapping[str, KernelFeatures], params: Mapping[str, int], geometry: Mapping,
                     batch: int, moves: int) -> list[Launch]:
    """One compaction of ``batch`` requests, ``moves`` kept tokens per (request, layer, KV head).

    The CTA walks its moves a tile at a time (``compact_kernels.cuh``, ``walk_moves``): a tile is
    ``compact_tile`` moves (model 6; model 5 read it off the loop's vector stores, which round a
    narrow tile up to a whole vector per thread: 8 moves of 4 vectors on 256 threads looked like 64
    moves), and resolving a later tile chains two dependent loads, the move's index (HBM) then its
    page-table entry (shared by every head and layer of the request, an L2 hit); with index_ahead
    the index was fetched a step earlier, so the chain is the page-table entry alone, but the index
    load, issued one step ahead, still bounds the step (model 6, ``Walk.ahead``), as the tile's row
    loads, issued load_ahead steps before its stores, do. Before the first tile: the request's
    range, then two tiles' resolves and the first tile's loads, three HBM round trips. With
    ``slices`` CTAs per (request, layer, KV head), each copies 1/slices of every move's K and V
    row. ``tail_split`` is not modelled: its split tail is counted as whole units, so its
    candidates differ only by their compiled code (registers, instruction mix)."""
    kernel = pick_kernel(features, "compact_kernel")
    slices = params.get("slices", 1)
    ctas = batch * geometry["kv_heads"] * geometry["layers"] * slices
    row = geometry["head_dim"] * geometry["elem_bytes"]
    per_move = 2 * row // slices                              # bytes of a move one CTA copies
    moved = 1.0 * ctas * moves * per_move
    walk = pick_loop(kernel, "global_load", "global_store")
    if walk is None:
        raise WorkloadError(f"{kernel.name}: no loop that loads and stores global memory (the tile walk)")
    load_ahead = params.get("load_ahead", 1)
    ring = load_ahead + 1
    tile = compact_tile(params, per_move // 16)
    steps = math.ceil(moves / tile)
    chain = ("l2",) if params.get("index_ahead", 0) else ("hbm", "l2")
    ahead = (("hbm", load_ahead),) + ((("hbm", 1),) if params.get("index_ahead", 0) else ())
    return [Launch("compact", kernel, ctas, params["threads"], 0,
                   (Phase("move", 2 * moved, "hbm", walk, float(walk.load_bytes) * (ring - 1) / ring,
                          walk=Walk(steps, 2.0 * tile * per_move, chain, prologue=3, ahead=ahead)),))]


def compact_tile(params: Mapping[str, int], per_move: int) -> int:
    """Moves per tile as the kernel computes them (``compact_kernels.cuh``, ``tile_moves``):
    ``tile_tokens``, capped so a thread's ring of load_ahead + 1 tiles fits 32 vectors (16 above
    256 threads) and at one move per thread; at least one. ``per_move``: the 16-byte vectors of a
    move one CTA copies."""
    threads, ring = params["threads"], params.get("load_ahead", 1) + 1
    per_thread = (16 if threads > 256 else 32) // ring       # max_vectors_per_thread
    cap = min(per_thread * threads // per_move, threads)
    return max(1, min(params["tile_tokens"], cap))


def score_launches(features: Mapping[str, KernelFeatures], params: Mapping[str, int], geometry: Mapping,
                   batch: int, width: int, lanes: int, passes: int) -> list[Launch]:
    """One scoring call: ``batch`` requests of ``width`` tokens, every scored layer. One iteration
    is one token per ``lanes`` threads: the token-tile loop when ``token_tiles`` > 1, else the
    kernel's straight-line body; ``lanes`` adjacent threads read adjacent 16-byte chunks of a row,
    so a warp uses ``16 * lanes`` bytes of each 32-byte sector it touches in a row."""
    kernel = pick_kernel(features, "kernel")
    tokens_per_cta = params["threads"] // lanes * params["token_tiles"]
    layers = len(geometry["scored_layers"])
    ctas = math.ceil(width / tokens_per_cta) * geometry["kv_heads"] * passes * layers * batch
    elem = 1 if geometry["dtype"].startswith("fp8") else 2
    span = geometry["rotary_dim"] * elem   # model 3: a thread reads only the row's rotated span
    k_bytes = float(batch) * width * geometry["kv_heads"] * passes * layers * span
    tile_loop = pick_loop(kernel, "global_load")
    per_token = tile_loop if params["token_tiles"] > 1 and tile_loop is not None and \
        tile_loop.total > kernel.static.total / 2 else kernel.static
    # model 2: an iteration's K bytes per thread are its share of one row (the page-table loads and
    # score stores of the same SASS do not scale with the work); the loop's rates follow from them
    k_share = span // lanes
    per_token = replace(per_token, global_bytes=k_share, load_bytes=k_share)
    return [Launch("score", kernel, ctas, params["threads"], 0,
                   (Phase("scores", k_bytes, "hbm", per_token, float(per_token.load_bytes),
                          sector_efficiency=min(1.0, 16 * lanes / 32),
                          l1_wavefronts=score_wavefronts(per_token, k_share, lanes)),))]


def score_wavefronts(per_token: Mix, k_share: int, lanes: int) -> float:
    """L1 data-pipe wavefronts of one warp iteration of the scorer (model 3; the post-mortem's
    ncu-checked count, docs/tuning-evidence/scorer-warp-form-postmortem.md): a warp's 16-byte K
    load touches 32 / ``lanes`` rows, one wavefront each; a coefficient load (LDS.128) reads the
    ``lanes`` distinct addresses of the lanes' chunks (every token of the warp uses the same
    coefficients), one wavefront each but never fewer than two (ncu: 2.0 per LDS.128 at lanes=2;
    "an LDS.128 costs 2 wavefronts whatever it carries"); every other memory instruction (page
    table, score stores, staging) one."""
    k_loads = k_share / 16
    memory = per_token.memory
    others = memory["global_load"] + memory["global_store"] + memory["shared_store"] - k_loads
    return k_loads * 32 / lanes + memory["shared_load"] * max(2, lanes) + max(0.0, others)
