"""Kernel plans: what to generate for one (family, op), as frozen, hashable data.

A plan carries the fixed geometry a template needs (from ``kvgen.lower.layout``), the tunable launch
parameters (apart, as Triton's ``Config``), and the template that renders it. ``key()`` hashes
every field that changes the generated code; the target arch is *not* part of a plan's source:
one rendered source compiles for every target (arch-specific paths are ``__CUDA_ARCH__`` guards).
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal, Mapping

from kvgen.lower.layout import FamilyLayout, family_layout
from kvgen.spec.schema import FamilySpec, c_identifier

Op = Literal["codec", "compact", "pack", "score", "select"]

# Tunable launch parameters per op: name -> (choices, safe default). One place, read by the
# tuner (search space), the build (defaults) and the templates (values).
TUNABLES: dict[str, dict[str, tuple[tuple[int, ...], int]]] = {
    "codec": {
        "threads": ((64, 128, 256, 512), 256),
        "in_flight": ((1, 2, 4, 8), 4),        # 16-byte record loads in flight per thread
        # E2M1 rounding of the software path (sm_90a; the SM100-family hardware path has its cvt):
        # 0 = integer bit arithmetic, 1 = FMA-pipe magic-add rounding (NaN-free blocks; others fall
        # back to 0), 2 = route 1 with two of its three sums fused (fma.rn: 257 instead of 287 SASS
        # instructions per qwen3-8b encode block, but 47 registers instead of 40: 5 CTAs per SM
        # instead of 6 at 256 threads). Same bytes; 1 issues about half route 0's integer-pipe work.
        # 3 = fp8 hot pages on packed fp16 lanes (two elements per instruction, compiled Q = 1): 150
        # instead of 298 SASS instructions per qwen3-8b-fp8 encode block (68 instead of 129 on the
        # integer pipe), 47 registers instead of 39 (scripts/codec_sass.py). Where it does not apply
        # (16-bit hot dtypes, another Q, per-layer buffers, the SM100 hardware path) the kernel takes
        # route 2, and a family without an fp8 Q = 1 buffer is built with 2 (fold_codec_params).
        # Route 3 (fp8): H200 encode, 1 GiB scattered, fraction of device copy, route 1 -> 3: qwen3-8b-fp8
        # 0.472 -> 0.706 at 256 threads (512 threads, min_blocks 3: 0.685; route 2 measured 0.485 in
        # codec_device_check.json), cold bytes equal (results/2026-12-02-h200/codec3/); bf16 families
        # keep route 2: qwen3-8b 0.773 -> 0.785, deepseek-v3 0.769 -> 0.811, deepseek-v4-csa
        # 0.555 -> 0.582 from 1 to 2 (results/2026-12-02-h200/codec_device_check.json).
        # 4 = bf16 hot pages (compiled Q = 1): binary32 products, codes on packed fp16 lanes (one
        # cvt per two products, then route 3's fp16 rounding; packed bf16 block maximum; exact by
        # nvfp4_host_check --sweep-bf16): 171 instead of 257 SASS instructions per qwen3-8b encode
        # block, 47 registers both (40, no spills, at 512 threads with min_blocks 3; scripts/codec_sass.py).
        # fp8 pages build 3, other families 2. Default 4: H200 encode, 1.2 GiB scattered, fraction of
        # device copy, route 2 -> 4 at 256 threads: qwen3-8b 0.759 -> 0.900, deepseek-v3 0.776 -> 0.887,
        # deepseek-v4-csa 0.563 -> 0.625, oracle-checked, cold bytes equal, device sweep passed
        # (results/2026-12-02-h200-s4/callD/encode5/); fp8 keeps route 3 through the fold.
        "rounding": ((0, 1, 2, 3, 4), 4),
        # Decode of plain blocks: 0 = binary32 multiply then per-pair rounding cvt, 1 = PRMT table
        # lookup of the codes as fp16/bf16 pairs times the scale in one packed FMA (exact: Q = 1
        # products are representable; another compiled Q, or per-layer scales, compile route 0). Same bytes.
        "decode_route": ((0, 1), 1),
        # __launch_bounds__ minimum CTAs per SM: registers capped near 64K / (threads * min_blocks)
        # for occupancy; 0 = none (ptxas' own choice: 40 registers for qwen3-8b encode, while 1 gives
        # 54). scripts/codec_sass.py --variant reports registers and spills: threads 512 with 4 spills
        # 40-48 bytes in encode (results/2026-12-01-h200/2026-12-01-codec-sass-v2.json). 5 and 6 reach
        # past 4 CTAs of 256 threads: deepseek-v4-csa's encode takes 64 registers (4 CTAs, 50 %
        # occupancy, issue 56 %, DRAM 58 %: latency-bound, results/2026-12-03-h200-s6/callB/ncu/);
        # 5 caps it at 48 with 20 bytes spilled, 6 at 40 with 60.
        "min_blocks": ((0, 1, 2, 3, 4, 5, 6), 0),
        # decode's own __launch_bounds__ minimum (-1: min_blocks, as before it existed). Decode needs
        # fewer registers than encode: deepseek-v4-csa's decode takes 48 (5 CTAs of 256 threads,
        # achieved occupancy 56 %, results/2026-12-07-h100-s13/call1/ncu-decode-deepseek-v4-csa.csv);
        # 6 caps it at 40 with 4 bytes spilled, where encode at 6 spills 312. Same bytes. No gain on
        # an H100 (1 GiB encode + decode 1.0668 ms at 6, 1.0564 at -1; results/2026-12-07-h100-s15).
        "decode_min_blocks": ((-1, 5, 6), -1),
        # Plain blocks one thread loads before quantizing them in encode (all loads of the batch
        # first): more hot bytes in flight per thread for more registers. Same bytes. Default 1:
        # 2 and 4 gained nothing on the H200 (4 lost: qwen3-8b encode 0.773 -> 0.689 of copy).
        "hot_batch": ((1, 2, 4), 1),
        # Threads per plain block in decode: 2 = half a block each (decode_route 1, 16-bit hot
        # dtypes; fp8 and decode_route 0 compile 1), so a warp's hot store is 512 contiguous bytes
        # instead of two stores that each half-fill 32 sectors. Same bytes. Default 2: H200 decode,
        # 1 GiB scattered, fraction of device copy, 1 -> 2: qwen3-8b 0.636 -> 0.871, deepseek-v3
        # 0.622 -> 0.871, deepseek-v4-csa 0.740 -> 0.812 (results/2026-12-02-h200/codec_device_check.json;
        # qwen3-8b-fp8 measured 0.775 -> 0.747 is the same kernel, folded to 1, i.e. run-to-run noise).
        "decode_split": ((1, 2), 2),
        # How decode brings the record from the cold slot into shared memory (codec_kernels.cuh
        # RecordLoad): 0 = through registers, in_flight 16-byte loads per thread at a time (a memory
        # round trip per threads x in_flight words), 1 = cp.async, every word of a thread in flight at
        # once, 2 = one cp.async.bulk of the whole record (sm_90+) waited on with an mbarrier, for slots
        # in device memory (host slots take 1: the bulk engine reads host memory at half the bus).
        # Same bytes.
        "decode_load": ((0, 1, 2), 1),
        # Consecutive page pairs one decode CTA takes (codec_kernels.cuh DecodePages): above 1 the CTA
        # keeps two record buffers in shared memory and issues page i + 1's record before decoding page
        # i, so a record is in flight while the previous one decodes (Nsight, H100 decode: ~40 % of warp
        # cycles stalled on long_scoreboard waiting for the record, DRAM at 79-81 % of peak). Twice the
        # shared memory per CTA. Same bytes. decode_load 0 (a register copy cannot overlap) builds 1
        # (fold_codec_params). Default 1: on the H100 it lost everywhere (encode + decode of 1 GiB
        # scattered, decode_load 1, pages 1 -> 2 -> 4: qwen3-8b 0.984 -> 0.989 -> 0.999 ms, deepseek-v3
        # 0.967 -> 0.971 -> 0.982, deepseek-v4-csa 1.060 -> 1.065 -> 1.078, qwen3-8b-fp8 1.216 -> 1.222
        # -> 1.230; the 8 MiB bucket 1-21 % slower; results/2026-12-07-h100-s13/call3): half the CTAs
        # per SM cost what the overlap gains. Kept for GPUs of another bandwidth x latency (unmeasured).
        "decode_pages": ((1, 2, 4), 1),
        # How encode stores the finished record from shared memory to the cold slot: 0 = through
        # registers (in_flight words per thread at a time), 1 = one cp.async.bulk store by one thread
        # (sm_90+; the other warps retire at once, and the copy's registers are gone: qwen3-8b encode
        # 47 -> 40 registers, 5 -> 6 CTAs per SM). Same bytes.
        # Defaults 1 and 1: H200, encode + decode of 1 GiB scattered, 256 threads, 0 / 0 -> 1 / 1:
        # qwen3-8b 0.730 -> 0.726 ms, deepseek-v3 0.711 -> 0.705, deepseek-v4-csa 0.843 -> 0.835,
        # qwen3-8b-fp8 1.003 -> 0.977, every candidate oracle-checked (results/2026-12-07-h200-s11/call1).
        "encode_store": ((0, 1), 1),
    },
    "compact": {
        # 512 threads and 128-move tiles raise the bytes in flight per CTA (batch 1 has few CTAs);
        # tile_moves() still caps a tile at 16 vectors per thread, so long rows do not spill.
        "threads": ((64, 128, 256, 512), 128),
        "tile_tokens": ((8, 16, 32, 64, 128), 32),
        # CTAs per (request, KV head, layer), each copying its 1/slices run of every K and V row
        # (compact_kernels.cuh): batch 1 launches only layers x KV heads CTAs (288 for qwen3-8b on
        # 132 SMs). The same bytes land; folded to the largest choice dividing a move's vectors.
        # 8: qwen3.5-397b-a17b batch 1 (256 threads, 128-move tiles) 0.0692 ms against 0.0728 at 4;
        # it loses everywhere for qwen3-8b (H100, results/2026-12-07-h100-s14/call1).
        "slices": ((1, 2, 4, 8), 1),
        # The walk's pipeline (compact_kernels.cuh), same bytes in the same order of tiles:
        # load_ahead tiles loading while one is stored (2: a third register tile, and tile_moves()
        # shrinks the tile so the three fit), and index_ahead 1 fetches a thread's move indices one
        # tile before it resolves them, so a resolve waits for the page id alone. Measured on an
        # H100 (results/2026-12-07-h100-s18/call3): neither speeds qwen3-8b batch 1 up (0.251 ms at
        # 1 / 0, 0.263 with index_ahead, 0.266 with load_ahead 2): its SMs move a fixed ~22 GB/s
        # each, and the 5-CTA SMs set the time (Nsight Compute, call1). index_ahead is 1 % faster
        # for gpt-oss-20b and qwen3.5-397b-a17b at batch 1, inside the noise.
        "load_ahead": ((1, 2), 1),
        "index_ahead": ((0, 1), 0),
        # CTAs each unit (request, KV head, layer, slice) past the last whole multiple of the SM count
        # is copied by, each taking 1/tail_split of the slice (compact_kernels.cuh, cta_unit): batch 1
        # of qwen3-8b is 576 units on 132 SMs, and the 48 SMs holding a fifth ran 1.21x longer than
        # the rest (Nsight Compute, results/2026-12-07-h100-s18/call1). Same bytes, same order per
        # byte column; folded like slices so slices x tail_split divides a move's vectors.
        "tail_split": ((1, 2, 4), 1),
    },
    "pack": {
        "block": ((64, 128, 256, 512), 256),
    },
    "score": {
        "threads": ((64, 128, 256), 128),      # threads per CTA
        "max_heads": ((4, 8, 16), 16),         # query heads accumulated per pass over K
        # threads per token (adjacent 16-byte pieces of its row); 2 measured 2.3x faster than 1 on the
        # H200 for head 128 and 2.0x for head 256 (results/2026-11-30-h200/bench_score-variants.json)
        "lanes": ((1, 2, 4), 2),
        "token_tiles": ((1, 2, 4, 8, 16, 32, 64), 1),  # stages per CTA (amortizes the coefficient prologue)
        # Bytes in flight per thread (the scorer is latency-bound: PERFORMANCE.md). Same scores,
        # bit for bit (same accumulation order); defaults are today's measured best until the H200
        # tuner says otherwise:
        "tokens_per_thread": ((1, 2, 4), 1),   # tokens a thread scores per stage, all loads issued first
        "prefetch": ((0, 1), 0),               # 1: the next stage's K loads before computing this one
                                               # (stage 0's before the coefficient prologue)
        # > 0: K pieces by cp.async into a per-thread ring of that many stages in shared memory
        # (smem_stages - 1 stages in flight while one is computed; no registers hold them in flight);
        # replaces prefetch (folded to 0 by the tuner). Unmeasured: 0 until the H200 says otherwise.
        "smem_stages": ((0, 2, 3, 4), 0),
        # > 0: each token's rotated span by one cp.async.bulk into a ring of that many stages of rows
        # in shared memory (no load-pipe wavefronts for K, which the L1 data pipe spends today:
        # docs/tuning-evidence/scorer-warp-form-postmortem.md); one token per thread, no prefetch, no
        # cp.async ring (folded by the tuner); 16-byte pieces only. Unmeasured: 0 until the H200 says.
        "bulk_stages": ((0, 2, 3, 4), 0),
        # 1: bf16 K widened to f32 from its 32-bit words (shift / mask: one instruction per element
        # instead of PRMT + SHF for the high half; the scorer is issue- and shared-load-bound for
        # heads >= 8, scripts/score_variants_coef_reuse.json). Same values, same scores; folded
        # to 0 for other dtypes by the tuner. Unmeasured: 0 until the H200 says otherwise.
        "unpack": ((0, 1), 0),
        # 1: the linear part of the score (a·re + b·im) by tensor-core MMAs over K tiles in shared
        # memory, coefficients split into three bf16 terms (kvgen/kernels/cute/score_mma.py): not
        # the same bits as form 0, within the same stated bound. bf16 or fp8 E4M3 K (widened to bf16
        # in registers, exactly), half pairs and a rotated span of whole pair chunks only (32 bf16 or
        # 64 fp8 elements; folded to 0 otherwise); the ring depth is bulk_stages
        # (0 -> 3), and lanes, tokens_per_thread, prefetch, smem_stages and unpack are form 0's
        # (folded). qwen3-8b B32 0.70 -> 0.92 of copy (results/2026-12-04-h200-s10/callC-score).
        "form": ((0, 1), 0),
        "mma_tiles": ((1, 2, 4), 1),           # form 1: 16-token MMA tiles per warp stage
        # form 1: 1 takes the magnitude term m·|k| to tf32 MMAs too (3xTF32); 0 keeps f32 FMAs, one
        # per pair and query head, and a shuffle sum over the 4 lanes of a row.
        "mag_mma": ((0, 1), 0),
    },
    # Normalize, aggregate, select (kvgen/kernels/triton/select.py); none changes a result bit: the
    # summation order of the statistics is fixed by the reference (REDUCTION_LANES), not by these.
    "select": {
        # Score rows per statistics program, its warps, and steps of LANES columns it loads at once.
        # Each row is read twice (mean, then squared deviations); with one row of 8 warps few rows
        # are between their two reads, so the second partly hits L2: qwen3-8b B32 1.245 -> 1.03 ms
        # at rows 1, unroll 4, 8 warps against the old 2 / 1 / 4 (results/2026-12-03-h200-s8/callA);
        # 16 warps, fewer rows in flight: 1.416 -> 1.064 ms on an H100 (results/2026-12-07-h100-s15).
        "rows": ((1, 2, 4), 1),
        "stats_unroll": ((1, 2, 4, 8), 4),
        "stats_warps": ((4, 8, 16), 16),
        # Columns of a row a statistics program holds in registers between the two sums, so a row
        # that fits is read once (0: every row twice). A wider row falls back to two reads. Held
        # rows take one program a SM, and lost to two reads by 13-16 % (same H100 run).
        "stats_resident": ((0, 4096, 8192, 16384), 0),
        # Columns and warps per aggregation program: 64 / 2 took the union aggregate of qwen3-8b B32
        # from 0.893 to 0.648 ms (128 / 4 before; same run).
        "block_w": ((32, 64, 128, 256), 64),
        "aggregate_warps": ((2, 4, 8), 2),
        # columns per selection step (route 0 compares BLOCK keys with 2^radix_bits candidates a step:
        # 512 x 16 keeps that tile at 64 registers a thread for 4 warps)
        "block": ((256, 512, 1024, 2048, 4096), 1024),
        "radix_bits": ((1, 2, 4, 8), 4),       # bits of the budget-th key found per pass over a row
        # How a pass counts the keys at or above each candidate digit: 0 compares every key with
        # every candidate (2^radix_bits per key; radix_bits 8 folds to 4), 1 takes a histogram of
        # the digits of the keys under the known prefix (one count per key). Same counts, same bits.
        # Route 1 at block 1024, 16 warps: 0.345 -> 0.127 ms a B32 round on an H100 (route 0 at
        # 512, 4 warps before; results/2026-12-07-h100-s15).
        "select_route": ((0, 1), 1),
        "select_warps": ((4, 8, 16), 16),
        # 0: the statistics and the aggregation are two launches, and the aggregation reads every
        # score from DRAM again; 1: one launch, a queue of chunks (one scored layer of
        # chunk_requests requests): a chunk's aggregation items follow its statistics queue_lag
        # chunks later, so its rows are read again from L2. The queue runs queue_programs programs a SM
        # at stats_warps warps, block_w columns an aggregation item. Same bits either way.
        "aggregate_route": ((0, 1), 0),
        "chunk_requests": ((1, 2, 4, 8), 1),
        "queue_lag": ((1, 2, 4, 8), 4),    # chunks of statistics queued ahead of their aggregation
        "queue_programs": ((1, 2, 4), 2),
        # Query heads an aggregation step holds (0: all of a program's heads at once). Fewer heads
        # a step, fewer registers (gpt-oss-20b's union aggregation at 64 x 2 warps: 160 -> 36 at 8),
        # same bits (a max in any order); on an H100 it is slower in most launches but where the
        # all-heads tile spills, and qwen3.5's measured pick (results/2026-12-07-h100-s17).
        "head_step": ((0, 4, 8, 16), 0),
    },
}


def default_params(op: Op) -> dict[str, int]:
    return {name: default for name, (_, default) in TUNABLES[op].items()}


def packed_encode_route(spec: FamilySpec, layout: FamilyLayout | None = None) -> int | None:
    """The packed rounding route the family's quantized buffers can take: 3 (codec_kernels.cuh
    kPackedF16) for an fp8 hot dtype, 4 (kPackedBF16) for bf16, where some buffer has a compiled Q
    of 1; None otherwise (fp16, or only per-layer buffers or other Qs: those take route 2)."""
    route = {"fp8_e4m3": 3, "bf16": 4}.get(spec.dtype)
    if route is None:
        return None
    one = f32_literal(1.0)
    layout = layout or family_layout(spec)
    return route if any(b.Q is not None and f32_literal(b.Q) == one for b in layout.record.buffers) else None


def fold_codec_params(spec: FamilySpec, params: Mapping[str, int], layout: FamilyLayout | None = None) -> dict[str, int]:
    """Codec params with a packed rounding (3, 4) folded onto the route the kernel compiles for this
    family: 4 is 3 on fp8 hot pages, and either is 2 where no buffer has its packed route, so
    16-bit families render what they always did with 3. The register record load (decode_load 0)
    keeps one page per decode CTA: it has no load in flight to overlap with a decode. Decode's own
    minimum equal to the shared one is the shared one (-1): the same kernels."""
    out = dict(params)
    if out.get("rounding") in (3, 4):
        route = packed_encode_route(spec, layout)
        out["rounding"] = 3 if route == 3 else (4 if route == out["rounding"] else 2)
    if out.get("decode_load") == 0 and "decode_pages" in out:
        out["decode_pages"] = 1
    if "min_blocks" in out and out.get("decode_min_blocks") == out["min_blocks"]:
        out["decode_min_blocks"] = -1
    return out


def check_params(op: Op, params: Mapping[str, int]) -> None:
    """Reject unknown names or values outside the declared choices (names the accepted ones)."""
    space = TUNABLES[op]
    for name, value in params.items():
        if name not in space:
            raise ValueError(f"{op}: unknown parameter {name!r}; accepted: {', '.join(space)}")
        if value not in space[name][0]:
            raise ValueError(f"{op}: {name}={value} is not one of {space[name][0]}")


def _freeze(value: Any) -> Any:
    if isinstance(value, Mapping):
        return MappingProxyType({k: _freeze(v) for k, v in value.items()})
    if isinstance(value, list):
        return tuple(_freeze(v) for v in value)
    return value


def _plain(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    return value


@dataclass(frozen=True)
class KernelPlan:
    family: str
    op: Op
    template: str
    geometry: Mapping[str, Any]
    params: Mapping[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "geometry", _freeze(self.geometry))
        object.__setattr__(self, "params", _freeze(self.params))

    def as_dict(self) -> dict[str, Any]:
        return {"family": self.family, "op": self.op, "template": self.template,
                "geometry": _plain(self.geometry), "params": _plain(self.params)}

    def key(self) -> str:
        """sha256 over everything that changes the generated source."""
        text = json.dumps(self.as_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()

    def symbol(self) -> str:
        """C identifier prefix: ``kvgen_<family>`` with non-identifier characters as '_'."""
        return "kvgen_" + c_identifier(self.family)

    def with_params(self, params: Mapping[str, int]) -> "KernelPlan":
        check_params(self.op, params)
        merged = {**_plain(self.params), **params}
        return KernelPlan(self.family, self.op, self.template, _plain(self.geometry), merged)


# ---------------------------------------------------------------- geometry per op


def f32_literal(value: float) -> str:
    """C++ hex literal of ``value`` rounded to binary32: G and Q are binary32 by contract."""
    return float(struct.unpack("<f", struct.pack("<f", value))[0]).hex() + "f"


def _scale_literal(value: float | None) -> str | None:
    """G or Q as a binary32 literal; None for per-layer scales (read by the kernels at run time)."""
    return None if value is None else f32_literal(value)


def copy_align(*sizes: int) -> int:
    """Largest power of two <= 16 dividing every size (the word a byte copy can use)."""
    align = 16
    while any(size % align for size in sizes):
        align //= 2
    return align


def codec_geometry(spec: FamilySpec, layout: FamilyLayout) -> dict[str, Any]:
    record = layout.record
    buffers = [
        {"name": b.name, "rows": b.rows, "row_dim": b.row_dim, "prefix": b.prefix, "q": b.q, "suffix": b.suffix,
         "r": b.r, "residual_start": b.residual_start, "G": _scale_literal(b.G), "Q": _scale_literal(b.Q),
         "hot_bytes": b.hot_bytes, "align": 16,
         "regions": {kind: _offset(record, b.name, kind)
                     for kind in ("data", "scales", "residual", "residual_scales", "lossless")}}
        for b in record.buffers
    ]
    sides = []
    for s in record.sides:
        offset = record.region(s.name, "side").offset
        sides.append({"name": s.name, "bytes": s.bytes, "offset": offset, "align": copy_align(offset, s.bytes)})
    return {
        "dtype": spec.dtype,
        "layout": spec.layout,
        "record_bytes": record.bytes,
        "unpadded_bytes": record.unpadded_bytes,
        "num_layers": spec.layers,
        "buffers": buffers,
        "sides": sides,
        "lifecycles": [{"layers": list(lc.layers), "window": lc.window, "cold_page_bytes": lc.cold_page_bytes}
                       for lc in layout.lifecycles],
    }


def _offset(record, buffer: str, kind: str) -> int:
    """Region offset, or 0 for a region the buffer does not have (the kernel never touches it)."""
    try:
        return record.region(buffer, kind).offset
    except KeyError:
        return 0


def compact_geometry(spec: FamilySpec) -> dict[str, Any]:
    return {
        "dtype": spec.dtype,
        "layout": spec.layout,
        "elem_bytes": spec.elem_bytes,
        "kv_heads": spec.kv_heads,
        "head_dim": spec.row_dim,
        "tokens_per_block": spec.tokens_per_block,
        "layers": spec.layers,
    }


def fold_select_params(params: Mapping[str, int], query_heads: int) -> dict[str, int]:
    """The comparison route (select_route 0) takes at most 4 radix bits: 8 would compare every key
    with 256 candidates, a tile no register file holds. A round runs one aggregation route, so the
    other route's launch parameters are held at their defaults (one candidate, not many). A
    ``head_step`` that holds all ``query_heads`` (the union program's, so every group's too) is 0."""
    out = dict(params)
    if out["select_route"] == 0 and out["radix_bits"] > 4:
        out["radix_bits"] = 4
    if out["head_step"] >= query_heads:
        out["head_step"] = 0
    unused = ("chunk_requests", "queue_lag", "queue_programs") if out["aggregate_route"] == 0 else ("aggregate_warps",)
    return {**out, **{name: TUNABLES["select"][name][1] for name in unused}}


def fold_compact_params(spec: FamilySpec, params: Mapping[str, int]) -> dict[str, int]:
    """``slices`` lowered to the largest choice that divides a move's 16-byte vectors (its K and V
    row), then ``tail_split`` to the largest that divides a slice's: the kernel cuts them into equal
    runs."""
    slices, tail_split = fold_compact_runs(2 * spec.row_dim * spec.elem_bytes // 16, params["slices"],
                                           params["tail_split"])
    return {**params, "slices": slices, "tail_split": tail_split}


def fold_compact_runs(vectors: int, slices: int, tail_split: int) -> tuple[int, int]:
    """(slices, tail_split) for a move of ``vectors`` 16-byte vectors: each lowered to the largest
    choice at most the one asked for that divides the move's, then the slice's, vectors."""
    folded = _largest_dividing("slices", slices, vectors)
    return folded, _largest_dividing("tail_split", tail_split, vectors // folded)


def _largest_dividing(name: str, wanted: int, vectors: int) -> int:
    """The largest choice of compaction's ``name`` at most ``wanted`` that divides ``vectors``."""
    return max(c for c in TUNABLES["compact"][name][0] if c <= wanted and vectors % c == 0)


def pack_geometry(spec: FamilySpec) -> dict[str, Any]:
    """What the move packer needs: its (layer, KV head) rows and which layers slide (window or None)."""
    return {
        "num_layers": spec.layers,
        "kv_heads": spec.kv_heads,
        "swa_window": [spec.layer_window(layer) for layer in range(spec.layers)],
    }


def score_geometry(spec: FamilySpec) -> dict[str, Any]:
    from kvgen.lower.triattention import require_scorable  # refuses families TriAttention cannot serve

    geometry = require_scorable(spec)
    return {
        "dtype": spec.dtype,
        "layout": geometry.layout,
        "head_dim": geometry.head_dim,
        "query_heads": geometry.query_heads,
        "kv_heads": geometry.kv_heads,
        "rotary_start": geometry.rotary_start,
        "rotary_dim": geometry.rotary_dim,
        "pairing": geometry.pairing,
        "tokens_per_block": geometry.tokens_per_block,
        "num_layers": geometry.num_layers,
        "scored_layers": list(geometry.scored_layers),
    }


def select_geometry(spec: FamilySpec) -> dict[str, Any]:
    """What normalize/aggregate/select need: the decision rows' shape and which layers are scored."""
    from kvgen.lower.triattention import require_scorable

    geometry = require_scorable(spec)
    return {
        "num_layers": geometry.num_layers,
        "kv_heads": geometry.kv_heads,
        "group": geometry.group,
        "scored_layers": list(geometry.scored_layers),
    }


def score_plan(spec: FamilySpec, params: Mapping[str, int] | None = None) -> KernelPlan:
    """The CuTe DSL scorer of a TriAttention family (built by kvgen.build.cute_aot)."""
    merged = {**default_params("score"), **(params or {})}
    check_params("score", merged)
    return KernelPlan(spec.name, "score", "score.py.j2", score_geometry(spec), merged)


def plans_for(spec: FamilySpec, params: Mapping[Op, Mapping[str, int]] | None = None) -> list[KernelPlan]:
    """Every kernel plan of a family, tuned params applied over the safe defaults."""
    params = params or {}
    layout = family_layout(spec)
    codec = fold_codec_params(spec, {**default_params("codec"), **params.get("codec", {})}, layout)
    plans = [KernelPlan(spec.name, "codec", "codec.cu.j2", codec_geometry(spec, layout), codec)]
    if spec.triattention.enabled:
        compact = fold_compact_params(spec, {**default_params("compact"), **params.get("compact", {})})
        plans.append(KernelPlan(spec.name, "compact", "compact.cu.j2", compact_geometry(spec), compact))
        plans.append(KernelPlan(spec.name, "pack", "pack.py.j2", pack_geometry(spec),
                                {**default_params("pack"), **params.get("pack", {})}))
        plans.append(score_plan(spec, params.get("score")))
        plans.append(KernelPlan(spec.name, "select", "select.py.j2", select_geometry(spec),
                                fold_select_params({**default_params("select"), **params.get("select", {})},
                                                   spec.query_heads)))
    for plan in plans:
        check_params(plan.op, plan.params)
    return plans
