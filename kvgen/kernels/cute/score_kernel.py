"""TriAttention scoring kernel (TRIATTENTION.md §3), CuTe DSL.

``score(ℓ, h, j) = Σ_f a_f·Re k_f + b_f·Im k_f + m_f·|k_f|`` for every decode token ``j`` in
``[P, S)`` of every request, read straight from the paged K pool (post-RoPE keys, never
re-rotated), with ``a = s(qr·c − qi·d)``, ``b = s(qr·d + qi·c)``, ``m = s·mlr`` built per CTA from
the calibration (``qr, qi, mlr`` ``[layers, Hq, F]``, ``s = freq_scale_sq`` ``[F]``) and the
request's mean-phase row (``c, d`` ``[B, F]``).

Work decomposition (memory bound: every K row is read once per pass, see below):
- grid ``(⌈W / tokens_per_cta⌉, Hkv · passes, layers · B)``; one CTA = ``token_tiles`` stages of
  ``tokens_per_thread`` tiles of ``threads / lanes`` tokens of one KV head of one (layer,
  request); ``lanes`` adjacent threads
  share a token: lane ``l`` reads the row's 16-byte chunks ``l, l + lanes, ...`` (so one warp load
  covers ``lanes`` adjacent chunks of each of ``32 / lanes`` rows), and a butterfly shuffle sums
  the lanes' partial scores. ``lanes = 1``: one thread per token, the simplest form.
- the query heads of a KV group are scored from the same K row: a thread keeps one f32
  accumulator per query head. Groups wider than ``max_heads`` are split into ``passes`` of
  ``heads`` query heads each (``passes = ⌈G / max_heads⌉``), one grid row per pass; K is then read
  once per pass (from L2 after the first). Every shipped family but falcon-7b (G = 71) needs one.
- the CTA first turns the calibration of its ``heads`` query heads into ``(a, b, m)`` in shared
  memory (``coefficient_layout``: a lane's coefficients of one chunk contiguous, for 16-byte
  loads; lanes in different banks; all threads of a lane read the same address: broadcast), then
  each thread loads its chunks of the K row's rotated span in 16-byte vectors and accumulates with
  fused multiply-adds; ``|k_f|`` uses the approximate square root (one MUFU op).
- bytes in flight (the kernel is latency-bound, PERFORMANCE.md): a thread issues the K loads of
  all ``tokens_per_thread`` tokens of a stage into registers before computing any, and with
  ``prefetch`` the next stage's before computing this one (stage 0's before the coefficient
  prologue); the loads are branch-free (``RowSource.locate``) so nothing separates them. These
  pipelined forms keep the stage loop rolled (the loads of stage s + 1 stay in flight across the
  computation of stage s) and read the coefficients with volatile shared loads, once per chunk for
  all the stage's tokens (``CoefficientReader``): plain loads are hoisted out of the loop and
  shared between the tokens, which held every coefficient of the row live at once (255 registers
  and a 2-6 KB spill stack on sm_90a). The lean form (one token, no prefetch) keeps plain loads
  under its branch, where nothing hoists them (36 registers). ptxas may still sink the register
  prefetch's loads to the end of the stage (it does for qwen3-8b), which ``smem_stages`` avoids:
  each thread copies its own pieces by ``cp.async`` into a ring of ``smem_stages`` stages in shared
  memory (``[stage][token][piece][thread]``: conflict-free), issues stage ``s + smem_stages - 1``
  before waiting for stage ``s`` (``cp.async.wait_group``) and reads its pieces back with volatile
  loads; no thread reads another's pieces, so no barrier. The accumulation order of a token is the
  same in every variant: the scores are identical, bit for bit.
- ``bulk_stages``: the ring above still spends a load-pipe wavefront per row a warp load touches
  (the L1 data pipe is what binds the thread form: docs/tuning-evidence/scorer-warp-form-postmortem.md).
  Here lane 0 of each token copies the token's whole rotated span with one ``cp.async.bulk`` (the
  SM's copy engine) into a ring of rows in shared memory, padded so a warp's 16-byte reads of it
  are conflict-free; every thread arrives on its warp's mbarrier of the stage (the copy's bytes
  complete it), stage ``s + bulk_stages - 1`` is issued before stage ``s`` is waited for, and a
  warp barrier keeps a slot from being overwritten before every lane of the warp has read it.
- page ids from the page table outside ``[0, num_pages)``, and positions outside the page table's
  row, are never dereferenced: the token is scored 0 and the value recorded in ``errors`` (the C
  shim fails the next call with it).
- columns ``[S − P, W)`` of a request are written as zeros, so the output needs no memset.
- K dtypes: bf16, fp16, fp8 E4M3 (16 elements per 16-byte load), widened exactly to f32 (bf16 with
  ``unpack``: from its 32-bit words by shift / mask, one instruction per element instead of 1.5).

Inputs are raw device pointers wrapped in CuTe tensors with symbolic sizes (``compile_aot``): the
AOT export turns each into a ``{data, dynamic_shapes, dynamic_strides}`` struct that the C shim
(``kvgen/kernels/cute/score_abi.cpp``) fills.
"""

from __future__ import annotations

import math

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from kvgen.kernels.cute.geometry import bulk_ring_fits, effective_lanes, pairs_per_chunk, vector_width

# fp8_e4m3 K is read as stored: the score of a dequantized pool (K × k_scale, k_scale > 0) is the
# same score × k_scale, which z-normalization removes (TRIATTENTION.md §3 and reference.score_keys).
ELEMENT_TYPES = {"bf16": cutlass.BFloat16, "fp16": cutlass.Float16, "fp8_e4m3": cutlass.Float8E4M3FN}
ELEMENT_BYTES = {"bf16": 2, "fp16": 2, "fp8_e4m3": 1}
# The device error record (score_abi.cpp reports it on the next call): errors[0] = what was
# skipped (0: nothing), errors[1] = one such value.
ERROR_WORDS = 2
SKIPPED_PAGE = 1       # a page id from the page table outside [0, num_pages); errors[1] = the id
SKIPPED_POSITION = 2   # a position P + j outside the page table's row; errors[1] = the position


@dsl_user_op
def volatile_shared_load(address: Int32, count: int, dtype=Float32, *, loc=None, ip=None) -> list:
    """``count`` (1, 2 or 4) consecutive 32-bit words (``Float32`` or ``Int32``) at a shared-memory
    byte address, in one volatile vector load: the compiler neither merges it with another load nor
    moves it out of its loop."""
    suffix = {1: "", 2: ".v2", 4: ".v4"}[count]
    kind, constraint, ir_type = (".f32", "=f", T.f32()) if dtype is Float32 else (".b32", "=r", T.i32())
    outputs = ", ".join(f"${i}" for i in range(count))
    outputs = outputs if count == 1 else "{" + outputs + "}"
    result = llvm.inline_asm(
        ir_type if count == 1 else llvm.StructType.get_literal([ir_type] * count),
        [Int32(address).ir_value(loc=loc, ip=ip)],
        f"ld.volatile.shared{suffix}{kind} {outputs}, [${count}];",
        ",".join([constraint] * count + ["r"]),
        has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)
    if count == 1:
        return [dtype(result)]
    return [dtype(llvm.extractvalue(ir_type, result, [i], loc=loc, ip=ip)) for i in range(count)]


@dsl_user_op
def word_as_f32(word: Int32, *, loc=None, ip=None) -> Float32:
    """The 32 bits of ``word`` read as an f32 (a bit cast: no instruction)."""
    return Float32(llvm.bitcast(T.f32(), Int32(word).ir_value(loc=loc, ip=ip), loc=loc, ip=ip))


@dsl_user_op
def volatile_shared_store(address: Int32, value: Int32, *, loc=None, ip=None) -> None:
    """One 32-bit word into shared memory, volatile (kept in program order with the loads above)."""
    llvm.inline_asm(None, [Int32(address).ir_value(loc=loc, ip=ip), Int32(value).ir_value(loc=loc, ip=ip)],
                    "st.volatile.shared.b32 [$0], $1;", "r,r", has_side_effects=True, is_align_stack=False,
                    asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)


@dsl_user_op
def cp_async(shared: Int32, source: Int64, size: int, read: Int32, *, loc=None, ip=None) -> None:
    """``cp.async`` of ``size`` (4, 8 or 16) bytes from global ``source`` into shared ``shared``;
    ``read`` bytes are read (``size`` or 0: nothing is read, zeros are written). 16-byte copies
    bypass L1 (``.cg``: K is read once)."""
    cache = "cg" if size == 16 else "ca"
    llvm.inline_asm(None, [Int32(shared).ir_value(loc=loc, ip=ip), Int64(source).ir_value(loc=loc, ip=ip),
                           Int32(read).ir_value(loc=loc, ip=ip)],
                    f"cp.async.{cache}.shared.global [$0], [$1], {size}, $2;", "r,l,r", has_side_effects=True,
                    is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)


@dsl_user_op
def mbarrier_init(address: Int32, count: int, *, loc=None, ip=None) -> None:
    """Initialize the mbarrier at a shared byte address for ``count`` arrivals per phase."""
    llvm.inline_asm(None, [Int32(address).ir_value(loc=loc, ip=ip)],
                    f"mbarrier.init.shared::cta.b64 [$0], {count};", "r", has_side_effects=True,
                    is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)


@dsl_user_op
def bulk_row(shared: Int32, source: Int64, size: int, barrier: Int32, copies: Int32, *, loc=None, ip=None) -> None:
    """Arrive on the mbarrier expecting ``size`` bytes and, if ``copies`` is not 0, copy ``size``
    bytes from global ``source`` to shared ``shared`` by ``cp.async.bulk`` (the copy engine of the
    SM, not the load pipe), completing them on that barrier; else arrive expecting nothing. One
    branch-free sequence, so the rows of a stage go out back to back."""
    llvm.inline_asm(None, [Int32(shared).ir_value(loc=loc, ip=ip), Int64(source).ir_value(loc=loc, ip=ip),
                           Int32(barrier).ir_value(loc=loc, ip=ip), Int32(copies).ir_value(loc=loc, ip=ip)],
                    "{ .reg .pred p; .reg .b32 tx; setp.ne.b32 p, $3, 0; "
                    f"selp.b32 tx, {size}, 0, p; "
                    "mbarrier.arrive.expect_tx.shared::cta.b64 _, [$2], tx; "
                    f"@p cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [$0], [$1], {size}, [$2]; }}",
                    "r,l,r,r", has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
                    loc=loc, ip=ip)


@dsl_user_op
def mbarrier_wait(address: Int32, parity: Int32, *, loc=None, ip=None) -> None:
    """Wait until the phase of the mbarrier with this parity has completed (its copies landed)."""
    llvm.inline_asm(None, [Int32(address).ir_value(loc=loc, ip=ip), Int32(parity).ir_value(loc=loc, ip=ip)],
                    "{ .reg .pred done; WAIT: mbarrier.try_wait.parity.shared::cta.b64 done, [$0], $1; "
                    "@!done bra WAIT; }", "r,r", has_side_effects=True, is_align_stack=False,
                    asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)


class RowSource:
    """Where the K rows of one thread's tokens are: the (layer, request, KV head) of its CTA and
    the pool's bounds. Traced inside the kernel (values are the kernel's)."""

    def __init__(self, k_ptrs, page_table, P, errors, page_stride, num_pages, layer, request, kv_head, lane,
                 valid_width, hoist: bool):
        self.k_ptrs, self.page_table, self.P, self.errors = k_ptrs, page_table, P, errors
        self.page_stride, self.num_pages = page_stride, num_pages
        self.layer, self.request, self.kv_head, self.lane = layer, request, kv_head, lane
        self.valid_width = valid_width
        # hoist: read once, here, before any loop (the pipelined loops' volatile accesses would
        # otherwise make the compiler reload both, a dependent global load, in every stage); the
        # lean form reads them where it uses them (its code, and so its speed, as measured).
        self.hoisted = (P[request], k_ptrs[layer]) if hoist else None

    def first_position(self):
        """``P`` of the request: the position of decode column 0."""
        return self.P[self.request] if self.hoisted is None else self.hoisted[0]

    def layer_base(self):
        """The base address of the layer's K pool."""
        return self.k_ptrs[self.layer] if self.hoisted is None else self.hoisted[1]

    def locate(self, kernel: "TriScoreKernel", j, live) -> tuple:
        """``(use, span)``: whether column ``j`` is a token of the request that can be read, and its
        rotated span (``live`` false: never). Branch-free, so the loads of several tokens can be in
        flight together.
        Never read: a column past the width (no error), a position outside the page table's row
        (``P + j < 0`` or past ``max_pages`` pages: ``SKIPPED_POSITION``) and a page id outside
        ``[0, num_pages)`` (``SKIPPED_PAGE``); an unused column reads page-table entry 0 and slot 0
        of page 0 instead (which exist: the shim requires ``max_pages, num_pages > 0``), and its
        score is written as 0."""
        valid = (j < self.valid_width) & live
        position = self.first_position() + j
        block = position // kernel.tokens_per_block
        slot = position - block * kernel.tokens_per_block
        in_table = (position >= 0) & (block < self.page_table.shape[1])
        kernel.record_skipped(self.errors, valid & ((position < 0) | (block >= self.page_table.shape[1])),
                              SKIPPED_POSITION, position)
        listed = valid & in_table
        page = self.page_table[self.request, cutlass.select_(listed, block, Int32(0))]
        in_pool = (page >= 0) & (page < self.num_pages)
        kernel.record_skipped(self.errors, listed & ((page < 0) | (page >= self.num_pages)), SKIPPED_PAGE, page)
        use = listed & in_pool
        page = cutlass.select_(use, page, Int32(0))
        slot = cutlass.select_(use, slot, Int32(0))
        offset = (Int64(page) * self.page_stride + self.kv_head * kernel.head_stride + slot * kernel.slot_stride
                  + kernel.rotary_start)
        span_ptr = cute.make_ptr(kernel.element, self.layer_base() + offset * kernel.elem_bytes,
                                 cute.AddressSpace.gmem, assumed_align=kernel.vec * kernel.elem_bytes)
        return use, cute.make_tensor(span_ptr, cute.make_layout(kernel.rotary_dim))

class PlainCoefficients:
    """Coefficient reads of the lean form: plain shared loads, each issued where the arithmetic
    uses it (``read(...)[h]`` loads ``coef[h, k, e, lane, step]``; the compiler merges a head's run
    into vector loads)."""

    def __init__(self, coef: cute.Tensor):
        self.coef = coef

    def read(self, k: int, e: int, lane, step: int) -> "_HeadsOf":
        return _HeadsOf(self.coef, (k, e, lane, step))


class _HeadsOf:
    """``coef[h, *index]`` on subscript ``h`` (a load at the point of use)."""

    def __init__(self, coef: cute.Tensor, index: tuple):
        self.coef, self.index = coef, index

    def __getitem__(self, h: int):
        return self.coef[(h, *self.index)]


class VolatileCoefficients:
    """Coefficient reads of the pipelined forms: the heads' run of one (k, e, lane, step) is
    contiguous in ``coefficient_layout``, read in volatile vector loads of up to 4 words (the run
    starts on a multiple of 4 words when ``heads`` is, of 2 when it is even), so each is issued where
    the program reads it (see the module docstring)."""

    def __init__(self, kernel: "TriScoreKernel", coef: cute.Tensor):
        self.kernel, self.coef = kernel, coef
        heads = kernel.heads
        self.width = 4 if heads % 4 == 0 else 2 if heads % 2 == 0 else 1
        self.base = coef.iterator.toint()

    def read(self, k: int, e: int, lane, step: int) -> list:
        kernel = self.kernel
        H = kernel.heads
        offset = k * H + e * 3 * H + (lane + step * kernel.lanes) * kernel.lane_stride
        values = []
        for h in range(0, H, self.width):
            values += volatile_shared_load(self.base + (offset + h) * 4, self.width)
        return values


class TriScoreKernel:
    """One family's scorer: the geometry is compile-time, sizes (layers, B, W, pages) are not."""

    def __init__(self, *, dtype: str, layout: str, head_dim: int, query_heads: int, kv_heads: int,
                 rotary_start: int, rotary_dim: int, pairing: str, tokens_per_block: int,
                 threads: int = 128, max_heads: int = 16, lanes: int = 1, token_tiles: int = 1,
                 tokens_per_thread: int = 1, prefetch: int = 0, smem_stages: int = 0, unpack: int = 0,
                 bulk_stages: int = 0):
        if dtype not in ELEMENT_TYPES:
            raise ValueError(f"score kernel: dtype {dtype!r}; accepted: {', '.join(ELEMENT_TYPES)}")
        if layout not in ("HND", "NHD") or pairing not in ("half", "interleaved"):
            raise ValueError(f"score kernel: layout {layout!r} / pairing {pairing!r} not supported")
        if query_heads % kv_heads or rotary_dim % 2 or rotary_start + rotary_dim > head_dim:
            raise ValueError("score kernel: inconsistent geometry")
        if lanes not in (1, 2, 4, 8) or threads % 32 or token_tiles < 1 or tokens_per_thread < 1:
            raise ValueError(f"score kernel: lanes {lanes} (1, 2, 4 or 8) / threads {threads} (multiple of 32) "
                             f"/ token_tiles {token_tiles} / tokens_per_thread {tokens_per_thread} (>= 1)")
        if prefetch not in (0, 1):
            raise ValueError(f"score kernel: prefetch {prefetch} (0 or 1)")
        if smem_stages not in (0, 2, 3, 4) or (smem_stages and prefetch):
            raise ValueError(f"score kernel: smem_stages {smem_stages} (0, 2, 3 or 4; > 0 needs prefetch 0: the "
                             "shared-memory ring replaces the register prefetch)")
        if bulk_stages not in (0, 2, 3, 4) or (bulk_stages and (smem_stages or prefetch or tokens_per_thread > 1)):
            raise ValueError(f"score kernel: bulk_stages {bulk_stages} (0, 2, 3 or 4; > 0 needs smem_stages 0, "
                             "prefetch 0 and tokens_per_thread 1: the bulk-copy ring replaces them)")
        if unpack not in (0, 1) or (unpack and dtype != "bf16"):
            raise ValueError(f"score kernel: unpack {unpack} (0 or 1; 1 needs bf16 K, not {dtype})")
        self.dtype = dtype
        self.element = ELEMENT_TYPES[dtype]
        # 1: bf16 pairs widened from their 32-bit word, low = word << 16, high = word & 0xffff0000
        # (one instruction per element; the element conversion spends PRMT + SHF on the high
        # half). Exact either way: the same f32 values, so the same scores.
        self.unpack = unpack
        self.elem_bytes = ELEMENT_BYTES[dtype]
        self.layout = layout
        self.head_dim = head_dim
        self.query_heads = query_heads
        self.kv_heads = kv_heads
        self.group = query_heads // kv_heads
        self.rotary_start = rotary_start
        self.rotary_dim = rotary_dim
        self.freqs = rotary_dim // 2
        self.pairing = pairing
        self.tokens_per_block = tokens_per_block
        self.threads = threads
        self.passes = math.ceil(self.group / max_heads)
        self.heads = math.ceil(self.group / self.passes)   # query heads scored per pass
        self.vec = vector_width(rotary_start, rotary_dim, pairing, self.elem_bytes)
        # A chunk: the frequencies one step of a thread reads (one vector of re and one of im for
        # half pairs; one vector of interleaved pairs, two scalars if vec == 1).
        self.pairs_per_chunk = pairs_per_chunk(self.vec, pairing)
        self.chunks = self.freqs // self.pairs_per_chunk
        self.lanes = lanes = effective_lanes(lanes, self.chunks)  # threads per token, chunk c -> lane c % lanes
        self.steps = self.chunks // lanes                   # chunks per lane
        self.tokens_per_tile = threads // lanes
        # A CTA walks token_tiles stages (amortizes its prologue); in each, a thread scores
        # tokens_per_thread tokens whose loads are all issued before the first is computed.
        self.token_tiles = token_tiles
        self.tokens_per_thread = tokens_per_thread
        self.prefetch = prefetch                            # 1: stage s + 1's loads before computing stage s
        # smem_stages > 0: K pieces travel by cp.async into a ring of that many stages in shared
        # memory; stages s + 1 .. s + smem_stages - 1 are in flight while stage s is computed.
        self.smem_stages = smem_stages
        # The pipelined forms: loads of several tokens in flight, coefficients read once per chunk.
        # bulk_stages > 0: each token's rotated span travels by one cp.async.bulk (the SM's copy
        # engine: no load-pipe wavefronts) into a ring of that many stages of rows in shared memory.
        self.bulk_stages = bulk_stages
        self.pipelined = tokens_per_thread > 1 or prefetch == 1 or smem_stages > 0 or bulk_stages > 0
        self.tokens_per_cta = self.tokens_per_tile * tokens_per_thread * token_tiles
        self.vectors_per_chunk = 2 if pairing == "half" else max(2 * self.pairs_per_chunk // self.vec, 1)
        self.row_elems = self.steps * self.vectors_per_chunk * self.vec   # K elements a lane holds per token
        # Shared coefficients [heads][3][pairs_per_chunk][lanes][steps]: a lane's block of one step
        # is contiguous (vector loads); lane blocks are 4 (mod 8) words apart so the lanes of a
        # token read different banks.
        block = 3 * self.heads * self.pairs_per_chunk
        self.lane_stride = block if lanes == 1 else block + (4 - block) % 8
        # The ring: [stage][token][piece][thread] of piece_bytes each (consecutive threads on
        # consecutive pieces: no bank conflicts), then one used flag per [stage][token][thread].
        self.pieces = self.row_elems // self.vec
        self.piece_bytes = self.vec * self.elem_bytes
        if smem_stages and self.piece_bytes < 4:
            raise ValueError(f"score kernel: smem_stages needs K loads of at least 4 bytes, not {self.piece_bytes}")
        self.ring_words = smem_stages * tokens_per_thread * threads * (self.pieces * self.piece_bytes // 4 + 1)
        self.span_bytes = rotary_dim * self.elem_bytes
        if bulk_stages:
            self.check_bulk_geometry()
        # The bulk ring: [stage][token][row_stride bytes], then a used flag per [stage][thread], and
        # one mbarrier per [stage][warp]. Rows are padded so that row r starts 16·lanes·r bytes (mod
        # 128) into the banks: the 8 threads of a quarter warp (8 / lanes tokens × lanes pieces) read
        # 8 different 16-byte bank groups, so a warp's LDS.128 takes the minimum 4 wavefronts while
        # the coefficient loads stay broadcast.
        self.row_stride = self.span_bytes + (16 * self.lanes - self.span_bytes) % 128
        self.warps = threads // 32
        self.bulk_ring_bytes = bulk_stages * (self.tokens_per_tile * self.row_stride + threads * 4)
        # Element offsets inside one page of the pool.
        if layout == "HND":   # [Hkv][tokens_per_block][head_dim]
            self.head_stride = tokens_per_block * head_dim
            self.slot_stride = head_dim
        else:                 # NHD: [tokens_per_block][Hkv][head_dim]
            self.head_stride = head_dim
            self.slot_stride = kv_heads * head_dim

    def check_bulk_geometry(self) -> None:
        """The bulk ring's requirements (``geometry.bulk_ring_fits``)."""
        if not bulk_ring_fits(self.vec, self.elem_bytes, self.lanes, self.tokens_per_thread):
            raise ValueError(f"score kernel: bulk_stages needs 16-byte K pieces and lanes <= 4, not "
                             f"{self.piece_bytes} bytes and {self.lanes} lanes")

    def coefficient_layout(self) -> cute.Layout:
        H, ppc = self.heads, self.pairs_per_chunk
        return cute.make_layout((H, 3, ppc, self.lanes, self.steps),
                                stride=(1, H, 3 * H, self.lane_stride, self.lane_stride * self.lanes))

    # ------------------------------------------------------------------ host side (traced)

    @cute.jit
    def __call__(self, k_ptrs: cute.Tensor, page_table: cute.Tensor, P: cute.Tensor, S: cute.Tensor,
                 c: cute.Tensor, d: cute.Tensor, qr: cute.Tensor, qi: cute.Tensor, mlr: cute.Tensor,
                 freq_scale_sq: cute.Tensor, scores: cute.Tensor, errors: cute.Tensor, page_stride: Int64,
                 num_pages: Int32, stream: cuda.CUstream):
        layers = scores.shape[0]
        batch = scores.shape[1]
        width = scores.shape[3]
        tiles = (width + self.tokens_per_cta - 1) // self.tokens_per_cta
        self.kernel(k_ptrs, page_table, P, S, c, d, qr, qi, mlr, freq_scale_sq, scores, errors, page_stride,
                    num_pages).launch(
            grid=[tiles, self.kv_heads * self.passes, layers * batch],
            block=[self.threads, 1, 1],
            stream=stream,
        )

    # ------------------------------------------------------------------ device side

    def cta_item(self, scores: cute.Tensor) -> tuple:
        """This CTA's ``(tile, layer, request, KV head, first group member of its pass)`` from the
        grid ``(tiles, Hkv · passes, layers · B)``."""
        tile, head_pass, layer_request = cute.arch.block_idx()
        batch = scores.shape[1]
        layer = layer_request // batch
        request = layer_request - layer * batch
        kv_head = head_pass // self.passes
        return tile, layer, request, kv_head, (head_pass - kv_head * self.passes) * self.heads

    @cute.kernel
    def kernel(self, k_ptrs: cute.Tensor, page_table: cute.Tensor, P: cute.Tensor, S: cute.Tensor,
               c: cute.Tensor, d: cute.Tensor, qr: cute.Tensor, qi: cute.Tensor, mlr: cute.Tensor,
               freq_scale_sq: cute.Tensor, scores: cute.Tensor, errors: cute.Tensor, page_stride: Int64,
               num_pages: Int32):
        tid, _, _ = cute.arch.thread_idx()
        tile, layer, request, kv_head, first = self.cta_item(scores)
        width = scores.shape[3]
        lane = tid % self.lanes
        token = RowSource(k_ptrs, page_table, P, errors, page_stride, num_pages, layer, request, kv_head, lane,
                          S[request] - P[request], hoist=self.pipelined)
        # Registers for one stage's K pieces (tokens_per_thread rows) and whether each is used.
        rows = cute.make_rmem_tensor(cute.make_layout(self.tokens_per_thread * self.row_elems), self.element)
        used = cute.make_rmem_tensor(cute.make_layout(self.tokens_per_thread), Int32)
        # prefetch: the first stage's K loads (and their page-table lookups) are issued before
        # the coefficient prologue, so its global loads and barrier overlap them.
        if cutlass.const_expr(self.prefetch == 1):
            self.load_stage(token, rows, used, tile, tid, Int32(0), True)

        # (a, b, m) of this pass's query heads for this (layer, request), in shared memory.
        smem = cutlass.memory.SmemAllocator()
        coef = smem.allocate_tensor(Float32, self.coefficient_layout(), 16)
        ring = Int32(0)
        barriers = Int32(0)
        if cutlass.const_expr(self.bulk_stages > 0):
            # the first bulk_stages - 1 stages' copies go out before the coefficient prologue
            barriers = smem.allocate_tensor(Int64, cute.make_layout(self.bulk_stages * self.warps), 8)
            barriers = barriers.iterator.toint()
            ring = smem.allocate_tensor(Int32, cute.make_layout(self.bulk_ring_bytes // 4), 128).iterator.toint()
            self.init_barriers(barriers, tid)
            for ahead in cutlass.range_constexpr(self.bulk_stages - 1):
                self.issue_bulk_stage(token, ring, barriers, tile, tid, Int32(ahead), ahead < self.token_tiles, ahead)
        if cutlass.const_expr(self.smem_stages > 0):
            # the first smem_stages - 1 stages' copies go out before the coefficient prologue
            ring = smem.allocate_tensor(Int32, cute.make_layout(self.ring_words), 16).iterator.toint()
            for ahead in cutlass.range_constexpr(self.smem_stages - 1):
                self.issue_stage(token, ring, tile, tid, Int32(ahead), ahead < self.token_tiles, ahead)
        self.load_coefficients(coef, c, d, qr, qi, mlr, freq_scale_sq, tid, layer, request, kv_head, first)
        cute.arch.sync_threads()

        acc = cute.make_rmem_tensor(cute.make_layout(self.tokens_per_thread * self.heads), Float32)
        # A loop, not unrolled at trace time: unrolled, the compiler hoists every stage's loads to
        # the top and spills (255 registers + stack measured for 4 stages of qwen3-8b, sm_90a;
        # looped: 36). The pipelined forms also keep the compiler from unrolling it (unroll=1).
        for stage in cutlass.range(self.token_tiles, unroll=1 if self.pipelined else -1):
            if cutlass.const_expr(self.smem_stages > 0):
                self.run_ring_stage(token, ring, acc, coef, scores, tile, tid, first, width, stage)
            elif cutlass.const_expr(self.bulk_stages > 0):
                self.run_bulk_stage(token, ring, barriers, acc, coef, scores, tile, tid, first, width, stage)
            else:
                self.run_stage(token, rows, used, acc, coef, scores, tile, tid, first, width, stage)
        if cutlass.const_expr(self.smem_stages > 0):
            cute.arch.cp_async_wait_group(0)   # the zero-filled copies past the last stage land before exit

    def columns(self, tile, tid, stage) -> list:
        """Columns of this thread's tokens in ``stage``: one per token tile of the stage, the threads
        of a tile on adjacent columns (coalesced rows of one page)."""
        base = (tile * self.token_tiles + stage) * self.tokens_per_thread
        return [(base + t) * self.tokens_per_tile + tid // self.lanes for t in range(self.tokens_per_thread)]

    @cute.jit
    def run_stage(self, token: "RowSource", rows: cute.Tensor, used: cute.Tensor, acc: cute.Tensor,
                  coef: cute.Tensor, scores: cute.Tensor, tile: Int32, tid: Int32, first: Int32, width: Int32,
                  stage: Int32):
        """One stage: its tokens' scores. Without prefetch, one token per thread is read under a
        branch (the lean form: nothing is loaded for a column that is not used), several are all
        loaded first, branch-free. With prefetch, ``rows`` already holds this stage (loaded by the
        prologue or the previous stage): it is copied, the next stage's loads are issued into
        ``rows`` (none past the CTA's last stage: those read the one line at slot 0 of page 0),
        then the copy is computed."""
        columns = self.columns(tile, tid, stage)
        if cutlass.const_expr(self.prefetch == 1):
            current = cute.make_rmem_tensor(cute.make_layout(self.tokens_per_thread * self.row_elems), self.element)
            current.store(rows.load())
            current_used = cute.make_rmem_tensor(cute.make_layout(self.tokens_per_thread), Int32)
            current_used.store(used.load())
            if cutlass.const_expr(self.token_tiles > 1):
                self.load_stage(token, rows, used, tile, tid, stage + 1, stage + 1 < self.token_tiles)
            self.score_stage(acc, coef, current, current_used, scores, token, first, columns, width)
        elif cutlass.const_expr(self.tokens_per_thread == 1):
            # acc stays 0 for a column that is not read, so the stores need no select.
            acc.fill(0.0)
            if columns[0] < token.valid_width:
                self.accumulate_if_readable(acc, coef, token, columns[0])
            self.finish_token(acc, scores, token, first, 0, columns[0], cutlass.Boolean(True), width)
        else:
            self.load_stage(token, rows, used, tile, tid, stage, True)
            self.score_stage(acc, coef, rows, used, scores, token, first, columns, width)

    def ring_piece(self, ring: Int32, slot, t: int, k: int, tid) -> Int32:
        """Shared byte address of piece ``k`` of token ``t`` of this thread in ring ``slot``."""
        return ring + (((slot * self.tokens_per_thread + t) * self.pieces + k) * self.threads + tid) * self.piece_bytes

    def ring_flag(self, ring: Int32, slot, t: int, tid) -> Int32:
        """Shared byte address of the used flag of token ``t`` of this thread in ring ``slot``."""
        flags = self.smem_stages * self.tokens_per_thread * self.pieces * self.threads * self.piece_bytes
        return ring + flags + ((slot * self.tokens_per_thread + t) * self.threads + tid) * 4

    def issue_stage(self, token: "RowSource", ring: Int32, tile, tid, stage, live, slot) -> None:
        """``stage``'s K pieces of this thread by cp.async into ring ``slot``, and their used flags,
        as one commit group (every thread commits one per stage, empty or not, so the wait counts
        agree). Unused tokens read nothing (zeros are written; ``live`` false: none is used)."""
        for t, j in enumerate(self.columns(tile, tid, stage)):
            use, span = token.locate(self, j, live)
            volatile_shared_store(self.ring_flag(ring, slot, t, tid), cutlass.select_(use, Int32(1), Int32(0)))
            read = cutlass.select_(use, Int32(self.piece_bytes), Int32(0))
            base = span.iterator.toint()
            for k, piece in enumerate(self.row_pieces(token.lane)):
                cp_async(self.ring_piece(ring, slot, t, k, tid), base + piece * self.piece_bytes, self.piece_bytes,
                         read)
        cute.arch.cp_async_commit_group()

    @cute.jit
    def run_ring_stage(self, token: "RowSource", ring: Int32, acc: cute.Tensor, coef: cute.Tensor,
                       scores: cute.Tensor, tile: Int32, tid: Int32, first: Int32, width: Int32, stage: Int32):
        """One stage of the shared-memory ring: issue stage ``stage + smem_stages - 1`` into the
        slot stage ``stage - 1`` used (this thread's own reads of it are done), wait for this
        stage's group, read its pieces and flags back (volatile: each thread reads only what it
        copied, so no barrier) and score them."""
        ahead = stage + self.smem_stages - 1
        self.issue_stage(token, ring, tile, tid, ahead, ahead < self.token_tiles, ahead % self.smem_stages)
        cute.arch.cp_async_wait_group(self.smem_stages - 1)
        slot = stage % self.smem_stages
        words = self.piece_bytes // 4
        raw = cute.make_rmem_tensor(cute.make_layout(self.tokens_per_thread * self.pieces * words), Int32)
        used = cute.make_rmem_tensor(cute.make_layout(self.tokens_per_thread), Int32)
        for t in cutlass.range_constexpr(self.tokens_per_thread):
            used[t] = volatile_shared_load(self.ring_flag(ring, slot, t, tid), 1, Int32)[0]
            for k in cutlass.range_constexpr(self.pieces):
                for w, value in enumerate(volatile_shared_load(self.ring_piece(ring, slot, t, k, tid), words, Int32)):
                    raw[(t * self.pieces + k) * words + w] = value
        self.score_stage(acc, coef, cute.recast_tensor(raw, self.element), used, scores, token, first,
                         self.columns(tile, tid, stage), width)

    def bulk_barrier(self, barriers: Int32, slot, warp) -> Int32:
        """Shared byte address of the mbarrier of ``warp``'s rows in ring ``slot``."""
        return barriers + (slot * self.warps + warp) * 8

    def bulk_row_address(self, ring: Int32, slot, tid) -> Int32:
        """Shared byte address of the row of this thread's token in ring ``slot``."""
        return ring + (slot * self.tokens_per_tile + tid // self.lanes) * self.row_stride

    def bulk_flag(self, ring: Int32, slot, tid) -> Int32:
        """Shared byte address of this thread's used flag in ring ``slot``."""
        rows = self.bulk_stages * self.tokens_per_tile * self.row_stride
        return ring + rows + (slot * self.threads + tid) * 4

    @cute.jit
    def init_barriers(self, barriers: Int32, tid: Int32) -> None:
        """Lane 0 of each warp initializes its warp's mbarriers (32 arrivals a phase): the warps of
        a CTA never wait for each other's rows."""
        if tid % 32 == 0:
            for slot in cutlass.range_constexpr(self.bulk_stages):
                mbarrier_init(self.bulk_barrier(barriers, slot, tid // 32), 32)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_warp()

    def issue_bulk_stage(self, token: "RowSource", ring: Int32, barriers: Int32, tile, tid, stage, live,
                         slot) -> None:
        """``stage``'s row of this thread's token into ring ``slot``: lane 0 of the token copies its
        rotated span if it is used; every thread arrives once on its warp's barrier of the slot and
        records the used flag. Unused tokens copy nothing (``live`` false: none is used)."""
        use, span = token.locate(self, self.columns(tile, tid, stage)[0], live)
        volatile_shared_store(self.bulk_flag(ring, slot, tid), cutlass.select_(use, Int32(1), Int32(0)))
        copies = cutlass.select_(use & (token.lane == 0), Int32(1), Int32(0))
        bulk_row(self.bulk_row_address(ring, slot, tid), span.iterator.toint(), self.span_bytes,
                 self.bulk_barrier(barriers, slot, tid // 32), copies)

    @cute.jit
    def run_bulk_stage(self, token: "RowSource", ring: Int32, barriers: Int32, acc: cute.Tensor, coef: cute.Tensor,
                       scores: cute.Tensor, tile: Int32, tid: Int32, first: Int32, width: Int32, stage: Int32):
        """One stage of the bulk ring: once every lane of the warp is past stage ``stage - 1``
        (its rows may then be overwritten), issue stage ``stage + bulk_stages - 1`` into that slot,
        wait for this stage's rows, read this thread's pieces (volatile: after the wait) and score."""
        cute.arch.sync_warp()
        ahead = stage + self.bulk_stages - 1
        self.issue_bulk_stage(token, ring, barriers, tile, tid, ahead, ahead < self.token_tiles,
                              ahead % self.bulk_stages)
        slot = stage % self.bulk_stages
        mbarrier_wait(self.bulk_barrier(barriers, slot, tid // 32), (stage // self.bulk_stages) % 2)
        used = volatile_shared_load(self.bulk_flag(ring, slot, tid), 1, Int32)[0]
        acc.fill(0.0)
        self.accumulate(acc, VolatileCoefficients(self, coef), self.shared_chunks(ring, slot, tid, token.lane), 1,
                        token.lane)
        self.finish_token(acc, scores, token, first, 0, self.columns(tile, tid, stage)[0], used != 0, width)

    def register_chunks(self, rows: cute.Tensor):
        """``chunk(t, step)`` over the pieces ``load_row`` left in registers, token after token."""
        per_step = self.row_elems // self.steps

        def chunk(t: int, step: int) -> list:
            return self.load_f32(rows, (t * self.row_elems + step * per_step) // self.vec, per_step // self.vec)

        return chunk

    def shared_chunks(self, ring: Int32, slot, tid, lane):
        """``chunk(t, step)``: the f32 values of this lane's chunk ``step`` of its token's row in
        ring ``slot``, read where the arithmetic needs them (volatile 16-byte loads: after the
        barrier wait, and never all of the row live in registers at once)."""
        row = self.bulk_row_address(ring, slot, tid)
        pieces = self.row_pieces(lane)
        per_step = len(pieces) // self.steps

        def chunk(t: int, step: int) -> list:
            values = []
            for piece in pieces[step * per_step:(step + 1) * per_step]:
                words = cute.make_rmem_tensor(cute.make_layout(4), Int32)
                for w, value in enumerate(volatile_shared_load(row + piece * 16, 4, Int32)):
                    words[w] = value
                values += self.load_f32(cute.recast_tensor(words, self.element), 0, 1)
            return values

        return chunk

    @cute.jit
    def accumulate_if_readable(self, acc: cute.Tensor, coef: cute.Tensor, token: "RowSource", j: Int32):
        """Column ``j``'s scores into ``acc`` if its row can be read (all address arithmetic under
        the caller's width branch: the lean form; qwen3-8b's tuned shape, 4 one-token stages,
        measured 36 registers, 78 branch-free, 47 before the page checks were added)."""
        use, span = token.locate(self, j, True)
        if use:
            row = cute.make_rmem_tensor(cute.make_layout(self.row_elems), self.element)
            self.load_row(token, row, 0, span)
            self.accumulate(acc, PlainCoefficients(coef), self.register_chunks(row), 1, token.lane)

    def load_stage(self, token: "RowSource", rows: cute.Tensor, used: cute.Tensor, tile, tid, stage, live) -> None:
        """Every token of ``stage`` into ``rows`` (``row_pieces`` order, token after token) and
        ``used``, with no branch (``RowSource.locate``), so all its loads are in flight together;
        ``live`` false: none is used (and only slot 0 of page 0 is read)."""
        for t, j in enumerate(self.columns(tile, tid, stage)):
            use, span = token.locate(self, j, live)
            used[t] = Int32(cutlass.select_(use, Int32(1), Int32(0)))
            self.load_row(token, rows, t, span)

    def load_row(self, token: "RowSource", rows: cute.Tensor, t: int, span: cute.Tensor) -> None:
        """This lane's pieces of one K row's rotated span into token ``t``'s part of ``rows``."""
        first = t * (self.row_elems // self.vec)
        for k, piece in enumerate(self.row_pieces(token.lane)):
            cute.local_tile(rows, (self.vec,), (first + k,)).store(cute.local_tile(span, (self.vec,), (piece,)).load())

    def row_pieces(self, lane) -> list:
        """Indices (in ``vec``-wide pieces of the rotated span) this lane loads, in register order:
        per step, the re and im vectors of a half-pair chunk, or the chunk's interleaved vectors."""
        pieces = []
        for step in range(self.steps):
            chunk = step * self.lanes + lane
            if self.pairing == "half":
                pieces += [chunk, self.chunks + chunk]
            else:
                pieces += [chunk * self.vectors_per_chunk + k for k in range(self.vectors_per_chunk)]
        return pieces

    @cute.jit
    def score_stage(self, acc: cute.Tensor, coef: cute.Tensor, rows: cute.Tensor, used: cute.Tensor,
                    scores: cute.Tensor, token: "RowSource", first: Int32, columns: list, width: Int32):
        """The stage's decode tokens (``columns``) from their loaded pieces, all accumulated in one
        pass over the chunks (each coefficient read once for all of them)."""
        acc.fill(0.0)
        self.accumulate(acc, VolatileCoefficients(self, coef), self.register_chunks(rows), self.tokens_per_thread,
                        token.lane)
        for t in cutlass.range_constexpr(self.tokens_per_thread):
            self.finish_token(acc, scores, token, first, t, columns[t], used[t] != 0, width)

    @cute.jit
    def finish_token(self, acc: cute.Tensor, scores: cute.Tensor, token: "RowSource", first: Int32,
                     t: cutlass.Constexpr, j: Int32, use: cutlass.Boolean, width: Int32):
        """Token ``t``'s lanes' sum and stores (its accumulators ``acc[t·heads + h]``): 0 for a
        column past the request's width or not read."""
        base = t * self.heads
        if self.lanes > 1:
            # Every thread takes part (the shuffles need the whole warp); lanes of a token are
            # adjacent threads, so a butterfly over `lanes` sums the token's partial scores.
            for h in cutlass.range_constexpr(self.heads):
                acc[base + h] = cute.arch.warp_reduction_sum(acc[base + h], threads_in_group=self.lanes)
        if j < width:
            for h in cutlass.range_constexpr(self.heads):
                self.store(scores, Float32(cutlass.select_(use, acc[base + h], Float32(0.0))), token.layer,
                           token.request, token.kv_head, first, h, j, token.lane)

    @cute.jit
    def record_skipped(self, errors: cute.Tensor, skipped: cutlass.Boolean, kind: cutlass.Constexpr, value: Int32):
        """Plain stores, the failure path only: writers of one kind store the same flag."""
        if skipped:
            errors[1] = value
            errors[0] = Int32(kind)

    @cute.jit
    def store(self, scores: cute.Tensor, value: Float32, layer: Int32, request: Int32, kv_head: Int32,
              first: Int32, h: cutlass.Constexpr, j: Int32, lane: Int32):
        """Head ``h`` of the pass is written by lane ``h % lanes`` (if it is in the group)."""
        head = kv_head * self.group + first + h
        if self.lanes == 1:
            if self.passes == 1:
                scores[layer, request, head, j] = value
            else:
                if first + h < self.group:
                    scores[layer, request, head, j] = value
        else:
            if lane == h % self.lanes and first + h < self.group:
                scores[layer, request, head, j] = value

    @cute.jit
    def load_coefficients(self, coef: cute.Tensor, c: cute.Tensor, d: cute.Tensor, qr: cute.Tensor,
                          qi: cute.Tensor, mlr: cute.Tensor, freq_scale_sq: cute.Tensor, tid: Int32,
                          layer: Int32, request: Int32, kv_head: Int32, first: Int32):
        """``(a, b, m)`` of group member ``first + h`` and frequency ``f`` at
        ``coef[h, 0..2, e, lane, step]`` with ``f = (step·lanes + lane)·pairs_per_chunk + e`` (zeros
        past the group)."""
        ppc = self.pairs_per_chunk
        for index in cutlass.range(tid, self.heads * self.freqs, self.threads):
            h = index // self.freqs
            f = index - h * self.freqs
            chunk = f // ppc
            e = f - chunk * ppc
            step = chunk // self.lanes
            lane = chunk - step * self.lanes
            member = first + h
            live = member < self.group
            head = kv_head * self.group + cutlass.min(member, self.group - 1)
            s = freq_scale_sq[f]
            cf = c[request, f]
            df = d[request, f]
            re = qr[layer, head, f]
            im = qi[layer, head, f]
            zero = Float32(0.0)
            coef[h, 0, e, lane, step] = Float32(cutlass.select_(live, s * (re * cf - im * df), zero))
            coef[h, 1, e, lane, step] = Float32(cutlass.select_(live, s * (re * df + im * cf), zero))
            coef[h, 2, e, lane, step] = Float32(cutlass.select_(live, s * mlr[layer, head, f], zero))

    def accumulate(self, acc: cute.Tensor, coefficients, chunks, tokens: int, lane) -> None:
        """``acc[t·heads + h] += Σ a·re + b·im + m·|k|`` over this lane's chunks of the K rows of
        tokens ``t < tokens`` (chunk ``step·lanes + lane``: the lanes of a token read adjacent
        16-byte pieces), from ``chunks(t, step)``: the f32 values of one chunk (``register_chunks``
        or ``shared_chunks``; fp8 and 16-bit alike). Chunk by chunk, each pair's coefficients read
        once for every token."""
        for step in range(self.steps):   # plain Python: unrolled at trace time
            values = [chunks(t, step) for t in range(tokens)]
            for e in range(self.pairs_per_chunk):
                a, b, m = (coefficients.read(k, e, lane, step) for k in range(3))
                for t in range(tokens):
                    if self.pairing == "half":
                        re, im = values[t][e], values[t][self.vec + e]
                    else:
                        re, im = values[t][2 * e], values[t][2 * e + 1]
                    self.accumulate_pair(acc, t * self.heads, a, b, m, re, im)

    def load_f32(self, rows: cute.Tensor, first_vector: int, count: int) -> list:
        """``count`` consecutive ``vec``-wide pieces of the register copy from piece
        ``first_vector``, as f32 scalars (the exact widening of bf16, fp16 or fp8 E4M3)."""
        values = []
        if self.unpack:
            words = cute.recast_tensor(rows, Int32)   # bf16 element 2i is the low half of word i
            half = self.vec // 2
            for k in range(count):
                loaded = cute.local_tile(words, (half,), (first_vector + k,)).load()
                for i in range(half):
                    word = Int32(loaded[i])
                    values += [word_as_f32(word << 16), word_as_f32(word & Int32(-65536))]
            return values
        for k in range(count):
            loaded = cute.local_tile(rows, (self.vec,), (first_vector + k,)).load().to(Float32)
            values += [loaded[e] for e in range(self.vec)]
        return values

    def accumulate_pair(self, acc: cute.Tensor, base: int, a: list, b: list, m: list, re, im) -> None:
        """One frequency of one token into ``acc[base + h]``, ``(a, b, m)[h]`` its coefficients."""
        # sqrt.approx (one MUFU op, a few ulp) instead of the IEEE sequence (~10 instructions):
        # F square roots per token would otherwise cost as much as a third of the FMAs.
        magnitude = cute.math.sqrt(re * re + im * im, approx=True)
        for h in range(self.heads):
            acc[base + h] = acc[base + h] + a[h] * re + b[h] * im + m[h] * magnitude

    # ------------------------------------------------------------------ ahead-of-time compile

    def fake_arguments(self) -> tuple:
        """Fake tensors with symbolic sizes (layers L, batch B, width W, max pages MP) in the
        argument order of ``__call__``; every tensor is compact, row-major."""
        from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

        L = cute.sym_int32(symbol="L")
        B = cute.sym_int32(symbol="B")
        W = cute.sym_int32(symbol="W")
        MP = cute.sym_int32(symbol="MP")
        F, Hq = self.freqs, self.query_heads

        def tensor(dtype, shape, align=4):
            order = tuple(reversed(range(len(shape))))
            return make_fake_compact_tensor(dtype, shape, stride_order=order, assumed_align=align,
                                            use_32bit_stride=False)

        return (
            tensor(Int64, (L,), 8),               # k_ptrs: base address of each layer's K pool
            tensor(Int32, (B, MP)),               # page_table
            tensor(Int32, (B,)),                  # P
            tensor(Int32, (B,)),                  # S
            tensor(Float32, (B, F)),              # c
            tensor(Float32, (B, F)),              # d
            tensor(Float32, (L, Hq, F)),          # qr
            tensor(Float32, (L, Hq, F)),          # qi
            tensor(Float32, (L, Hq, F)),          # mlr
            tensor(Float32, (F,)),                # freq_scale_sq
            tensor(Float32, (L, B, Hq, W)),       # scores
            tensor(Int32, (ERROR_WORDS,)),        # errors (mapped host memory of the C shim)
            Int64(0),                             # page_stride (elements)
            Int32(0),                             # num_pages in every K pool
            make_fake_stream(),
        )

    def compile_aot(self, arch: str, keep_ptx: bool = False):
        options = f"--gpu-arch {arch}" + (" --keep-ptx" if keep_ptx else "")
        return cute.compile(self, *self.fake_arguments(), options=options)
