"""TriAttention scoring on the tensor cores (``form`` 1 of the scorer, TRIATTENTION.md §3), CuTe DSL.

The CUDA-core forms (``score_kernel.TriScoreKernel``) spend about 58 warp instructions on each
head-128 token, most of the 16.8 SM cycles per token that copy speed allows, and most of them
are the ``Σ a·Re k + b·Im k`` fused multiply-adds (PERFORMANCE.md). That part is linear in the K
row: for one KV head it is the product of a tile of K rows (tokens × rotated span) with a
coefficient matrix (rotated span × query heads), which ``mma.sync.m16n8k16`` computes in one
instruction per 16 tokens × 16 elements × 8 heads. The magnitudes ``|k_f| = sqrt(re² + im²)`` are
computed in f32 from the same fragments (``sqrt.approx.ftz``: one MUFU op), and ``Σ m·|k|`` is
either f32 FMAs summed over the 4 lanes of a row (``mag_mma`` 0) or tf32 MMAs into the same
accumulators (``mag_mma`` 1: 3xTF32, no FMA per query head, no shuffles).

Operands: K is bf16, an exact MMA operand; fp8 E4M3 K is widened in registers (``cvt`` to f16x2,
to f32, to bf16x2: every E4M3 value is a bf16, so the operand is exact and the bound below holds
unchanged). Each coefficient ``a`` or ``b`` (f32) is split into
three bf16 terms (each the rounding of what the previous left: within 2⁻²⁷ of it), each term
accumulated by its own MMA chain (three independent chains, summed at the end); the products of
bf16 operands are exact. With ``mag_mma``, ``|k|`` and ``m`` are split into tf32 hi + lo by masks
(within 2⁻²⁰ of each) and ``hi·hi + hi·lo + lo·hi`` accumulated (the dropped ``lo·lo`` < 2⁻²⁰).

Tolerance (stated; ``tests/gpu/test_score_gpu.py`` asserts form 0's ``(3F + 16)·u·T`` for both
forms). ``T`` is the sum of the magnitudes every rounding is relative to, ``R = 2F`` the rotated
width. An MMA rounds the sum it adds to its accumulator once, to f32 with truncation: at most 2u
of the magnitudes added (products exact, aligned and truncated: Fasi et al., "Numerical behavior
of NVIDIA tensor cores", PeerJ CS 2021; an assumption about sm_90a's tensor cores, which the H200
tests check against the float64 oracle). Form 0's 16u cover the coefficients and the magnitude;
chain 0 adds ``R/16`` MMAs (2u each), the other chains are 2⁻⁸ smaller; the final sums 3u.
- ``mag_mma`` 0: ``F/4`` FMAs per lane and two shuffle additions: ``(F/2 + 23)·u·T``;
- ``mag_mma`` 1: ``F/8`` more MMAs in chain 0 and the tf32 splits' 48u: ``(F/2 + 69)·u·T``,
  within ``(3F + 16)·u·T`` for ``F >= 32`` only (``geometry.mma_magnitude_fits``).
Squares below 2⁻¹²⁶ flush to zero (``.ftz``): a pair with ``|k_f| < 2⁻⁶³`` counts 0, outside the
bound only for such keys. The scores of the two forms are not bit-identical.

Work decomposition: grid as form 0, ``(⌈W / tokens_per_cta⌉, Hkv · passes, layers · B)``. Each
warp of a CTA walks ``token_tiles`` stages of ``16 · mma_tiles`` tokens; a stage's K rows arrive
by one ``cp.async.bulk`` per row (the SM's copy engine, issued by the lane that owns the row) in
the warp's own ring of ``bulk_stages`` slots, so warps never wait for each other after the
coefficient prologue. Rows are padded to 16 (mod 128) bytes so ``ldmatrix`` reads 8 rows from 8
different bank groups. A stage: ``ldmatrix.x4`` gives the A fragment of 16 tokens × 16 elements;
the B fragments (coefficients, three bf16 splits) and ``m`` are read from shared memory, laid out
in fragment order (conflict-free 8- and 16-byte loads), once per stage for all its MMA tiles.

Pairs: element ``f`` and ``f + F`` (``half``) sit at the same fragment place of blocks ``f // 16``
and ``f // 16 + F / 16``, so a lane holds both parts of each pair it takes the magnitude of. Needs
bf16 or fp8 E4M3 K, half pairs and a rotated span of whole pair chunks starting on a 16-byte
boundary (``geometry.mma_form_fits``: every scorable family shipped); the tuner folds others to form 0.

fp8 K: one ``ldmatrix.x4`` over 1-byte elements gives lane ``(g, t4)`` four consecutive elements
``4·t4 .. 4·t4 + 3`` of rows ``g`` and ``g + 8`` of two blocks. An MMA sums over its 16 columns in any
order, so block ``k``'s A fragment takes them as they come: physical element ``4·t4 + s`` of the block
is MMA column ``2·t4 + 8·(s // 2) + s % 2`` (``mma_column``), and the coefficients are stored at the
same columns of the B fragments. A pair chunk (two blocks of re, two of im) is one ``ldmatrix.x4``
of each half of the span.

Bounds: as form 0 (``RowSource.locate``): rows that cannot be read are not copied, score 0, and
their page id or position is recorded in ``errors``.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from kvgen.kernels.cute.geometry import (
    MMA_SHARED_BUDGET,
    mma_coefficient_words,
    mma_form_fits,
    mma_m_stride,
    mma_magnitude_fits,
    mma_ring_bytes,
    mma_row_stride,
)
from kvgen.kernels.cute.score_kernel import (
    RowSource,
    TriScoreKernel,
    bulk_row,
    mbarrier_init,
    mbarrier_wait,
    volatile_shared_load,
    volatile_shared_store,
    word_as_f32,
)

SPLITS = 3          # bf16 terms per coefficient
MMA_ROWS = 16       # tokens per MMA tile (m16)
MMA_HEADS = 8       # query heads per MMA tile (n8)
BLOCK = 16          # rotated elements per MMA step (k16)
SLOTS = 4           # pairs a lane holds per magnitude block (2 columns x 2 registers), in 2 rows
SLOT_PAIRS = 2      # tf32 k8 MMAs per magnitude block: slots (0, 1) and (2, 3)


def _asm(result_types, operands, text, constraints, *, side_effects=False, loc=None, ip=None):
    """One inline PTX statement; ``side_effects``: kept where it is (shared-memory traffic)."""
    return llvm.inline_asm(result_types, [v.ir_value(loc=loc, ip=ip) for v in operands], text, constraints,
                           has_side_effects=side_effects, is_align_stack=False,
                           asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)


def _unpack(struct_value, ir_type, count, dtype, *, loc=None, ip=None) -> list:
    return [dtype(llvm.extractvalue(ir_type, struct_value, [i], loc=loc, ip=ip)) for i in range(count)]


@dsl_user_op
def ldmatrix_x4(address: Int32, *, loc=None, ip=None) -> list:
    """Four 8x8 b16 matrices from shared memory (lane ``i`` gives the address of row ``i % 8`` of
    matrix ``i // 8``), one 32-bit word of each per lane: the A fragment of ``mma.m16n8k16``. Volatile
    (after the barrier wait, never hoisted)."""
    struct = llvm.StructType.get_literal([T.i32()] * 4)
    value = _asm(struct, [Int32(address)], "ldmatrix.sync.aligned.m8n8.x4.shared.b16 {$0, $1, $2, $3}, [$4];",
                 "=r,=r,=r,=r,r", side_effects=True, loc=loc, ip=ip)
    return _unpack(value, T.i32(), 4, Int32, loc=loc, ip=ip)


# The two MMA shapes: 16 x 8 x 16 with bf16 operands (the K part), 16 x 8 x 8 with tf32 (the
# magnitude part); both take 4 A words, 2 B words and 4 f32 accumulators, laid out alike.
MMA_BF16 = "m16n8k16.row.col.f32.bf16.bf16.f32"
MMA_TF32 = "m16n8k8.row.col.f32.tf32.tf32.f32"


@dsl_user_op
def mma(shape: str, a: list, b: list, c: list, *, loc=None, ip=None) -> list:
    """``c + A·B`` of one ``mma.sync`` of ``shape`` (``MMA_BF16`` or ``MMA_TF32``)."""
    struct = llvm.StructType.get_literal([T.f32()] * 4)
    value = _asm(struct, [Int32(x) for x in a] + [Int32(x) for x in b] + [Float32(x) for x in c],
                 f"mma.sync.aligned.{shape} {{$0, $1, $2, $3}}, {{$4, $5, $6, $7}}, {{$8, $9}}, "
                 "{$10, $11, $12, $13};", "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f", loc=loc, ip=ip)
    return _unpack(value, T.f32(), 4, Float32, loc=loc, ip=ip)


TF32_MASK = -8192   # 0xffffe000: sign, exponent and the 10 fraction bits of a tf32


def tf32_split(x: Float32) -> tuple:
    """``x ≈ hi + lo`` as two tf32 words, each an f32 truncated to 10 fraction bits by a mask (a
    conversion instruction is emulated on sm_90a: ~9 instructions): ``hi`` leaves ``x - hi`` exactly,
    ``lo`` truncates that, so ``|x - hi - lo| < 2⁻²⁰·|x|``. The tensor core reads exactly these bits."""
    hi = f32_bits(x) & Int32(TF32_MASK)
    return hi, f32_bits(x - word_as_f32(hi)) & Int32(TF32_MASK)


def f32_bits(x: Float32) -> Int32:
    """The 32 bits of an f32 (a bit cast: no instruction)."""
    return Int32(llvm.bitcast(T.i32(), Float32(x).ir_value()))


@dsl_user_op
def bf16_pair(high: Float32, low: Float32, *, loc=None, ip=None) -> Int32:
    """Two f32 values rounded to nearest bf16, packed: ``low`` in bits 0-15, ``high`` in 16-31."""
    return Int32(_asm(T.i32(), [Float32(high), Float32(low)], "cvt.rn.bf16x2.f32 $0, $1, $2;", "=r,f,f",
                      loc=loc, ip=ip))


@dsl_user_op
def sqrt_ftz(x: Float32, *, loc=None, ip=None) -> Float32:
    """``sqrt.approx.ftz``: one MUFU op. Without ``.ftz`` ptxas wraps it in a subnormal rescale
    (compare, two predicated multiplies: four instructions a pair, measured in the SASS)."""
    return Float32(_asm(T.f32(), [Float32(x)], "sqrt.approx.ftz.f32 $0, $1;", "=f,f", loc=loc, ip=ip))


@dsl_user_op
def shared_store_b16(address: Int32, value: Int32, *, loc=None, ip=None) -> None:
    """The low 16 bits of ``value`` into shared memory at a byte address."""
    _asm(None, [Int32(address), Int32(value)], "{ .reg .b16 h; cvt.u16.u32 h, $1; st.shared.b16 [$0], h; }", "r,r",
         side_effects=True, loc=loc, ip=ip)


def bf16_low(word: Int32) -> Float32:
    """The bf16 in bits 0-15 of ``word``, as the f32 it is exactly."""
    return word_as_f32(word << 16)


def bf16_high(word: Int32) -> Float32:
    """The bf16 in bits 16-31 of ``word``, as the f32 it is exactly."""
    return word_as_f32(word & Int32(-65536))


@dsl_user_op
def e4m3x4_to_f32(word: Int32, *, loc=None, ip=None) -> list:
    """The four E4M3 bytes of ``word`` (byte ``i`` is element ``i``) as the f32 values they are
    exactly: two ``cvt.rn.f16x2.e4m3x2`` (the high byte of each pair to the high half), then each half
    widened."""
    struct = llvm.StructType.get_literal([T.f32()] * 4)
    value = _asm(struct, [Int32(word)],
                 "{ .reg .b16 lo, hi, h0, h1, h2, h3; .reg .b32 p, q;"
                 " mov.b32 {lo, hi}, $4; cvt.rn.f16x2.e4m3x2 p, lo; cvt.rn.f16x2.e4m3x2 q, hi;"
                 " mov.b32 {h0, h1}, p; mov.b32 {h2, h3}, q;"
                 " cvt.f32.f16 $0, h0; cvt.f32.f16 $1, h1; cvt.f32.f16 $2, h2; cvt.f32.f16 $3, h3; }",
                 "=f,=f,=f,=f,r", loc=loc, ip=ip)
    return _unpack(value, T.f32(), 4, Float32, loc=loc, ip=ip)


class TriScoreMmaKernel(TriScoreKernel):
    """Form 1: the linear part of the score on the tensor cores (module docstring). The geometry,
    launch grid, bounds checks, stores and AOT export are form 0's."""

    def __init__(self, *, dtype: str, layout: str, head_dim: int, query_heads: int, kv_heads: int,
                 rotary_start: int, rotary_dim: int, pairing: str, tokens_per_block: int,
                 threads: int = 128, max_heads: int = 16, token_tiles: int = 1, mma_tiles: int = 1,
                 bulk_stages: int = 3, mag_mma: int = 0):
        if not mma_form_fits(dtype, rotary_start, rotary_dim, pairing):
            raise ValueError(f"score kernel form 1: needs bf16 or fp8_e4m3 K, half pairs and a rotated span of whole "
                             f"pair chunks (32 bf16 or 64 fp8 elements) from a 16-byte boundary, not {dtype}, "
                             f"{pairing} pairs, [{rotary_start}, {rotary_start + rotary_dim})")
        if mag_mma and not mma_magnitude_fits(rotary_dim):
            raise ValueError(f"score kernel form 1: mag_mma needs at least 32 pairs, not {rotary_dim // 2}")
        if mma_tiles not in (1, 2, 4) or bulk_stages not in (2, 3, 4) or mag_mma not in (0, 1):
            raise ValueError(f"score kernel form 1: mma_tiles {mma_tiles} (1, 2 or 4) / bulk_stages {bulk_stages} "
                             f"(2, 3 or 4) / mag_mma {mag_mma} (0 or 1)")
        super().__init__(dtype=dtype, layout=layout, head_dim=head_dim, query_heads=query_heads,
                         kv_heads=kv_heads, rotary_start=rotary_start, rotary_dim=rotary_dim, pairing=pairing,
                         tokens_per_block=tokens_per_block, threads=threads, max_heads=max_heads, lanes=1,
                         token_tiles=token_tiles)
        self.mma_tiles = mma_tiles
        self.stages = bulk_stages
        # fp8: one ldmatrix.x4 per half span gives a lane 2 blocks (a pair chunk), widened to bf16
        self.fp8 = dtype == "fp8_e4m3"
        self.chunk_blocks = 2 if self.fp8 else 1
        self.rows = MMA_ROWS * mma_tiles                      # tokens per warp stage
        self.copies = (self.rows + 31) // 32                  # rows each lane copies per stage
        self.tokens_per_cta = self.warps * token_tiles * self.rows
        self.blocks = rotary_dim // BLOCK                     # MMA steps over the rotated span
        self.head_tiles = (self.heads + MMA_HEADS - 1) // MMA_HEADS
        # Magnitude blocks: the re elements of pairs 16q .. 16q + 15 are block q, their im elements
        # block q + blocks / 2; a lane holds 4 pairs (slots) of each, in 2 rows.
        self.mag_blocks = self.blocks // 2
        # mag_mma 1: Σ m·|k| by tf32 MMAs (k8: two pair slots of each lane per MMA), three per MMA
        # step for the hi/lo splits of both operands; 0: f32 FMAs and a shuffle sum over the quad.
        self.mag_mma = mag_mma
        self.row_stride = mma_row_stride(self.span_bytes)
        # Shared memory: B fragments [head_tile][block][split][lane][2 words]; m [mag_block][t4][slot][head]
        # with the t4 rows 4 (mod 8) words apart (the 4 addresses of a warp's read in different banks);
        # then per warp its ring of rows, the used masks [slot][copy] and the mbarriers [slot].
        self.b_words, self.m_words = mma_coefficient_words(self.heads, rotary_dim, mag_mma)
        self.m_stride = mma_m_stride(self.heads)
        self.m_width = 4 if self.heads % 4 == 0 else 2 if self.heads % 2 == 0 else 1
        self.ring_bytes = mma_ring_bytes(self.warps, self.stages, self.rows, self.span_bytes)
        if self.ring_bytes + 4 * (self.b_words + self.m_words) > MMA_SHARED_BUDGET:
            raise ValueError(f"score kernel form 1: {self.ring_bytes} bytes of rows in flight plus the coefficients "
                             f"exceed {MMA_SHARED_BUDGET} bytes of shared memory; fewer warps, tiles or stages")

    # ------------------------------------------------------------------ device side

    @cute.kernel
    def kernel(self, k_ptrs: cute.Tensor, page_table: cute.Tensor, P: cute.Tensor, S: cute.Tensor,
               c: cute.Tensor, d: cute.Tensor, qr: cute.Tensor, qi: cute.Tensor, mlr: cute.Tensor,
               freq_scale_sq: cute.Tensor, scores: cute.Tensor, errors: cute.Tensor, page_stride: Int64,
               num_pages: Int32):
        tid, _, _ = cute.arch.thread_idx()
        tile, layer, request, kv_head, first = self.cta_item(scores)
        width = scores.shape[3]
        warp = tid // 32
        lane = tid % 32
        token = RowSource(k_ptrs, page_table, P, errors, page_stride, num_pages, layer, request, kv_head, lane,
                          S[request] - P[request], hoist=True)

        smem = cutlass.memory.SmemAllocator()
        b_frag = smem.allocate_tensor(Int32, cute.make_layout(self.b_words), 16)
        m_coef = smem.allocate_tensor(Float32, cute.make_layout(self.m_words), 16)
        ring = smem.allocate_tensor(Int32, cute.make_layout(self.ring_bytes // 4), 128).iterator.toint()
        ring = ring + warp * (self.ring_bytes // self.warps)
        if lane == 0:
            for slot in cutlass.range_constexpr(self.stages):
                mbarrier_init(self.barrier(ring, slot), 32 * self.copies)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_warp()
        # the first stages - 1 stages' rows go out before the coefficient prologue
        for ahead in cutlass.range_constexpr(self.stages - 1):
            self.issue_stage(token, ring, tile, warp, lane, Int32(ahead), ahead < self.token_tiles, ahead)
        self.load_coefficients(b_frag.iterator.toint(), m_coef, c, d, qr, qi, mlr, freq_scale_sq, tid, layer, request,
                               kv_head, first)
        cute.arch.sync_threads()

        for stage in cutlass.range(self.token_tiles, unroll=1):
            self.run_stage(token, ring, b_frag.iterator.toint(), m_coef.iterator.toint(), scores, tile, warp,
                           lane, first, width, stage)

    # ring addresses (per warp): [slot][row] rows, then [slot][copy] used masks, then [slot] barriers

    def row_address(self, ring: Int32, slot, row) -> Int32:
        return ring + (slot * self.rows + row) * self.row_stride

    def mask_address(self, ring: Int32, slot, copy: int) -> Int32:
        return ring + self.stages * self.rows * self.row_stride + (slot * self.copies + copy) * 4

    def barrier(self, ring: Int32, slot) -> Int32:
        masks = self.stages * self.rows * self.row_stride + self.stages * self.copies * 4
        return ring + masks + (8 - masks % 8) % 8 + slot * 8

    def stage_base(self, tile, warp, stage):
        """Column of row 0 of this warp's ``stage``: the warps of a CTA take adjacent runs."""
        return tile * self.tokens_per_cta + (stage * self.warps + warp) * self.rows

    def issue_stage(self, token: RowSource, ring: Int32, tile, warp, lane, stage, live, slot) -> None:
        """``stage``'s rows into ring ``slot``: lane ``l`` copies rows ``l, l + 32, ...`` (those it
        can read) by ``cp.async.bulk`` and arrives once per row on the slot's barrier; the warp's
        ballot of which rows were copied goes to the slot's masks."""
        base = self.stage_base(tile, warp, stage)
        for copy in range(self.copies):
            row = lane + 32 * copy
            use, span = token.locate(self, base + row, live & (row < self.rows))
            # every lane stores the same ballot word (one shared transaction, no branch)
            volatile_shared_store(self.mask_address(ring, slot, copy), cute.arch.vote_ballot_sync(use))
            bulk_row(self.row_address(ring, slot, row % self.rows), span.iterator.toint(), self.span_bytes,
                     self.barrier(ring, slot), cutlass.select_(use, Int32(1), Int32(0)))

    @cute.jit
    def run_stage(self, token: RowSource, ring: Int32, b_frag: Int32, m_coef: Int32, scores: cute.Tensor,
                  tile: Int32, warp: Int32, lane: Int32, first: Int32, width: Int32, stage: Int32):
        """Once every lane is past stage ``stage - 1`` (its slot may be overwritten), issue stage
        ``stage + stages - 1`` there, wait for this stage's rows and score them."""
        cute.arch.sync_warp()
        ahead = stage + self.stages - 1
        self.issue_stage(token, ring, tile, warp, lane, ahead, ahead < self.token_tiles, ahead % self.stages)
        slot = stage % self.stages
        mbarrier_wait(self.barrier(ring, slot), (stage // self.stages) % 2)
        # one accumulator chain per coefficient split: three independent MMA chains, not one of 3x the length
        acc = cute.make_rmem_tensor(cute.make_layout(self.mma_tiles * self.head_tiles * SPLITS * 4), Float32)
        mag = cute.make_rmem_tensor(cute.make_layout(1 if self.mag_mma else self.mma_tiles * 2 * self.heads), Float32)
        acc.fill(0.0)
        mag.fill(0.0)
        for chunk in cutlass.range_constexpr(self.mag_blocks // self.chunk_blocks):
            blocks = tuple(chunk * self.chunk_blocks + i for i in range(self.chunk_blocks))
            self.score_chunk(acc, mag, ring, slot, b_frag, m_coef, lane, blocks)
        base = self.stage_base(tile, warp, stage)
        masks = [volatile_shared_load(self.mask_address(ring, slot, copy), 1, Int32)[0] for copy in range(self.copies)]
        self.finish_stage(acc, mag, masks, scores, token, first, base, lane, width)

    def score_chunk(self, acc, mag, ring: Int32, slot, b_frag: Int32, m_coef: Int32, lane, blocks: tuple) -> None:
        """Magnitude blocks ``blocks`` of every MMA tile of the stage: their K fragments (with their
        pair blocks), their MMAs and the magnitudes of their pairs."""
        ks = blocks + tuple(block + self.mag_blocks for block in blocks)
        b = {k: self.read_b(b_frag, lane, k) for k in ks}
        m = {block: self.read_m(m_coef, lane, block) for block in blocks}
        for tile in range(self.mma_tiles):
            a, values = self.read_k(ring, slot, lane, tile, ks)
            for k in ks:
                for nt in range(self.head_tiles):
                    for split in range(SPLITS):
                        index = ((tile * self.head_tiles + nt) * SPLITS + split) * 4
                        value = mma(MMA_BF16, a[k], b[k][nt][split], [acc[index + i] for i in range(4)])
                        for i in range(4):
                            acc[index + i] = value[i]
            for block in blocks:
                magnitudes = self.magnitudes(self.element_of(a, values, block),
                                             self.element_of(a, values, block + self.mag_blocks))
                if self.mag_mma:
                    self.magnitude_mmas(acc, tile, magnitudes, m[block])
                else:
                    self.magnitude_fmas(mag, tile, magnitudes, m[block])

    def magnitudes(self, re, im) -> list:
        """``[q][e]``: ``|k|`` of the pairs in fragment register ``q`` (row ``g + 8·(q % 2)``, slot
        ``2·(q // 2) + e``), from the same place of the re and the im block (``element_of`` getters)."""
        out = []
        for q in range(4):
            pairs = [(re(q, 0), im(q, 0)), (re(q, 1), im(q, 1))]
            out.append([sqrt_ftz(x * x + y * y) for x, y in pairs])
        return out

    def element_of(self, a: dict, values: dict, k: int):
        """``(q, e) -> `` the f32 value of element ``e`` of A word ``q`` of block ``k``: fp8's widened
        values; bf16's halves unpacked from the word where the magnitude needs them (after the MMAs)."""
        if self.fp8:
            return lambda q, e: values[k][q][e]
        return lambda q, e: bf16_high(a[k][q]) if e else bf16_low(a[k][q])

    def slot_of(self, q: int, e: int) -> int:
        """The lane's pair slot of ``magnitudes()[q][e]``."""
        return 2 * (q // 2) + e

    def magnitude_fmas(self, mag: cute.Tensor, tile: int, magnitudes: list, m: list) -> None:
        """``mag[row][h] += m[slot][h] · |k|`` for this lane's pairs (summed over the quad at the end)."""
        for q, values in enumerate(magnitudes):
            row = tile * 2 + q % 2
            for e, magnitude in enumerate(values):
                for h in range(self.heads):
                    index = row * self.heads + h
                    mag[index] = mag[index] + m[self.slot_of(q, e) * self.heads + h] * magnitude

    def magnitude_mmas(self, acc: cute.Tensor, tile: int, magnitudes: list, m: list) -> None:
        """``Σ m·|k|`` into the accumulators by tf32 MMAs: MMA ``j`` takes slots ``2j`` (k = t4) and
        ``2j + 1`` (k = t4 + 4) of rows g and g + 8; 3xTF32 (hi·hi, hi·lo, lo·hi), one per chain."""
        place = {(q % 2, self.slot_of(q, e)): v for q, values in enumerate(magnitudes) for e, v in enumerate(values)}
        for j in range(SLOT_PAIRS):
            fragment = [place[(0, 2 * j)], place[(1, 2 * j)], place[(0, 2 * j + 1)], place[(1, 2 * j + 1)]]
            split = [tf32_split(v) for v in fragment]
            hi, lo = [x[0] for x in split], [x[1] for x in split]
            for nt in range(self.head_tiles):
                m_hi, m_lo = m[nt][j]
                for chain, (x, y) in enumerate(((hi, m_hi), (hi, m_lo), (lo, m_hi))):
                    index = ((tile * self.head_tiles + nt) * SPLITS + chain) * 4
                    value = mma(MMA_TF32, x, y, [acc[index + i] for i in range(4)])
                    for i in range(4):
                        acc[index + i] = value[i]

    def read_k(self, ring: Int32, slot, lane, tile: int, ks: tuple) -> tuple:
        """MMA tile ``tile``'s K in blocks ``ks``: ``{k: 4 A-fragment words}`` and, for fp8, ``{k: [q][e]}``
        the f32 value of element ``e`` of word ``q``. bf16: one ``ldmatrix.x4`` per block (lane ``i``
        points at row ``i % 16`` and the block's column ``8 · (i // 16)``). fp8: one per two blocks
        (columns ``16 · (i // 16)`` bytes on), each byte widened exactly and the pairs packed to bf16x2:
        word ``q`` of block ``k`` is row ``g + 8·(q % 2)``, elements ``4·t4 + 2·(q // 2) + {0, 1}``
        (``mma_column``)."""
        a, values = {}, {}
        if not self.fp8:
            for k in ks:
                a[k] = ldmatrix_x4(self.fragment_address(ring, slot, lane, tile, k))
            return a, values
        for k in ks[:: self.chunk_blocks]:
            # rows g, g + 8 of block k, then of block k + 1
            words = ldmatrix_x4(self.fragment_address(ring, slot, lane, tile, k))
            for j in range(self.chunk_blocks):
                f = [e4m3x4_to_f32(words[2 * j + half]) for half in range(2)]
                values[k + j] = [[f[q % 2][2 * (q // 2) + e] for e in range(2)] for q in range(4)]
                a[k + j] = [bf16_pair(x[1], x[0]) for x in values[k + j]]
        return a, values

    def fragment_address(self, ring: Int32, slot, lane, tile: int, k: int) -> Int32:
        """Where lane ``i``'s ``ldmatrix`` row of MMA tile ``tile``, block ``k`` starts: row ``i % 16``,
        16 bytes on for lanes 16-31 (bf16: the block's column 8; fp8: block ``k + 1``)."""
        row = tile * MMA_ROWS + lane % 16
        return self.row_address(ring, slot, row) + k * BLOCK * self.elem_bytes + (lane // 16) * 16

    def read_b(self, b_frag: Int32, lane, k: int) -> list:
        """``[head_tile][split]`` -> the two words of this lane's B fragment of block ``k``."""
        out = []
        for nt in range(self.head_tiles):
            splits = []
            for split in range(SPLITS):
                offset = ((nt * self.blocks + k) * SPLITS + split) * 64 + lane * 2
                splits.append(volatile_shared_load(b_frag + offset * 4, 2, Int32))
            out.append(splits)
        return out

    def read_m(self, m_coef: Int32, lane, block: int) -> list:
        """``m`` of this lane's pairs in magnitude block ``block``: ``[slot·heads + head]`` (FMAs), or
        ``[head_tile][slot pair]`` -> (hi, lo) B fragments of two words each (mag_mma)."""
        if self.mag_mma:
            return [[[volatile_shared_load(m_coef + self.m_fragment_word(nt, block, j, split, lane) * 4, 2, Int32)
                      for split in range(2)] for j in range(SLOT_PAIRS)] for nt in range(self.head_tiles)]
        base = (block * 4 + lane % 4) * self.m_stride
        values = []
        for i in range(0, SLOTS * self.heads, self.m_width):
            values += volatile_shared_load(m_coef + (base + i) * 4, self.m_width)
        return values

    @cute.jit
    def finish_stage(self, acc: cute.Tensor, mag: cute.Tensor, masks: list, scores: cute.Tensor, token: RowSource,
                     first: Int32, base: Int32, lane: Int32, width: Int32):
        """Sum each row's magnitude terms over the 4 lanes that hold its columns, add them to the
        MMA accumulators and store: lane ``(g, t4)`` holds rows ``g``, ``g + 8`` and heads
        ``2·t4 + {0, 1}`` of every head tile (0 for a row that was not read)."""
        if cutlass.const_expr(not self.mag_mma):
            for i in cutlass.range_constexpr(self.mma_tiles * 2 * self.heads):
                mag[i] = cute.arch.warp_reduction_sum(mag[i], threads_in_group=4)
        g = lane // 4
        t4 = lane % 4
        for tile in cutlass.range_constexpr(self.mma_tiles):
            for nt in cutlass.range_constexpr(self.head_tiles):
                for q in cutlass.range_constexpr(4):
                    half_row = q // 2
                    row = tile * MMA_ROWS + g + 8 * half_row
                    h = nt * MMA_HEADS + 2 * t4 + q % 2     # this lane's head of the pass
                    term = (Float32(0.0) if self.mag_mma else
                            self.pick_head(mag, (tile * 2 + half_row) * self.heads, nt * MMA_HEADS + q % 2, t4))
                    chains = [acc[((tile * self.head_tiles + nt) * SPLITS + split) * 4 + q] for split in range(SPLITS)]
                    value = (chains[2] + chains[1]) + (chains[0] + term)
                    # rows of tile t are bits 16·t (mod 32) + g + 8·(q // 2) of mask 16·t // 32
                    bit = (tile * MMA_ROWS) % 32 + g + 8 * half_row
                    used = ((masks[(tile * MMA_ROWS) // 32] >> bit) & Int32(1)) != 0
                    j = base + row
                    if (j < width) & (h < self.heads) & (first + h < self.group):
                        head = token.kv_head * self.group + first + h
                        scores[token.layer, token.request, head, j] = Float32(
                            cutlass.select_(used, value, Float32(0.0)))

    def pick_head(self, mag: cute.Tensor, row_base: int, offset: int, t4):
        """``mag[row_base + offset + 2·t4]`` without indexing registers at run time (0 past the pass's heads)."""
        value = Float32(0.0)
        for choice in range(4):
            h = offset + 2 * choice
            if h < self.heads:
                value = cutlass.select_(t4 == choice, mag[row_base + h], value)
        return value

    @cute.jit
    def load_coefficients(self, b_frag: Int32, m_coef: cute.Tensor, c: cute.Tensor, d: cute.Tensor, qr: cute.Tensor,
                          qi: cute.Tensor, mlr: cute.Tensor, freq_scale_sq: cute.Tensor, tid: Int32, layer: Int32,
                          request: Int32, kv_head: Int32, first: Int32):
        """``(a, b, m)`` of every (pass head ``h``, frequency ``f``), once: ``a`` and ``b`` as three bf16
        terms each at their elements' places in the B fragments (zeros past the group, and for the
        head tile's padding), ``m`` at the lane's magnitude slot."""
        for index in cutlass.range(tid, self.head_tiles * MMA_HEADS * self.freqs, self.threads):
            h = index // self.freqs
            f = index - h * self.freqs
            member = first + h
            live = (h < self.heads) & (member < self.group)
            head = kv_head * self.group + cutlass.min(member, self.group - 1)
            s = freq_scale_sq[f]
            cf = c[request, f]
            df = d[request, f]
            re = qr[layer, head, f]
            im = qi[layer, head, f]
            zero = Float32(0.0)
            a = Float32(cutlass.select_(live, s * (re * cf - im * df), zero))
            b = Float32(cutlass.select_(live, s * (re * df + im * cf), zero))
            self.store_splits(b_frag, h, f, a)                # re element f
            self.store_splits(b_frag, h, f + self.freqs, b)   # im element f + F
            m = Float32(cutlass.select_(live, s * mlr[layer, head, f], zero))
            if cutlass.const_expr(self.mag_mma):
                self.store_m_fragment(m_coef.iterator.toint(), h, f, m)
            else:
                if h < self.heads:
                    m_coef[self.magnitude_slot(f) + h] = m

    def mma_column(self, within):
        """The MMA column (k of ``m16n8k16``) that holds element ``within`` of a block: itself for bf16;
        for fp8 the place ``read_k`` gives it (element ``4·t4 + s`` -> column ``2·t4 + 8·(s // 2) + s % 2``)."""
        if not self.fp8:
            return within
        return 2 * (within // 4) + 8 * ((within % 4) // 2) + within % 2

    def b_place(self, h, element) -> tuple:
        """``(word, half)`` of (element, head ``h``) in the B fragments of split 0: lane ``(h % 8, t4)``,
        register ``r`` and half of the word holding MMA columns ``2·t4 + 8r + {0, 1}`` of block ``k``
        (``mma_column``); split ``s`` is ``64·s`` words on."""
        k = element // BLOCK
        column = self.mma_column(element - k * BLOCK)
        lane = (h % MMA_HEADS) * 4 + (column % 8) // 2
        return ((h // MMA_HEADS) * self.blocks + k) * SPLITS * 64 + lane * 2 + column // 8, column % 2

    def store_splits(self, b_frag: Int32, h, element, value: Float32) -> None:
        """``value`` as three bf16 terms (each the rounding of what the previous left) at the B
        fragment place of (element, head ``h``) (``b_place``)."""
        word, half = self.b_place(h, element)
        for split in range(SPLITS):
            rounded = bf16_pair(Float32(0.0), value)
            shared_store_b16(b_frag + (word + split * 64) * 4 + half * 2, rounded)
            value = value - bf16_low(rounded)

    def m_fragment_word(self, nt, block, j, split, lane, r=0):
        """Word of ``m``'s tf32 B fragments: [head tile][block][slot pair][hi, lo][lane][b0, b1]."""
        return ((((nt * self.mag_blocks + block) * SLOT_PAIRS + j) * 2 + split) * 32 + lane) * 2 + r

    def store_m_fragment(self, m_coef: Int32, h, f, m: Float32) -> None:
        """``m`` of (head ``h``, pair ``f``) as tf32 hi and lo at its B fragment place: lane
        ``(h % 8, t4)``, slot pair ``slot // 2``, register ``slot % 2`` (k = t4 or t4 + 4)."""
        block, t4, slot = self.pair_place(f)
        lane = (h % MMA_HEADS) * 4 + t4
        for split, word in enumerate(tf32_split(m)):
            address = m_coef + self.m_fragment_word(h // MMA_HEADS, block, slot // 2, split, lane, slot % 2) * 4
            volatile_shared_store(address, word)

    def magnitude_slot(self, f):
        """Index in ``m_coef`` of head 0 of pair ``f``: ``(block·4 + t4)·m_stride + slot·heads``."""
        block, t4, slot = self.pair_place(f)
        return (block * 4 + t4) * self.m_stride + slot * self.heads

    def pair_place(self, f) -> tuple:
        """``(block, t4, slot)`` of pair ``f``: the magnitude block, the quad lane and its slot (bf16:
        ``f = 16·block + 2·t4 + 8·(slot // 2) + slot % 2``, the fragment's columns; fp8:
        ``f = 16·block + 4·t4 + slot``, the bytes ``ldmatrix`` gives the lane)."""
        block = f // BLOCK
        within = f - block * BLOCK
        if self.fp8:
            return block, within // 4, within % 4
        return block, (within % 8) // 2, 2 * (within // 8) + within % 2


# The launch parameters only one form reads (the other's are folded to their defaults by the tuner).
CUDA_CORE_ONLY = ("lanes", "tokens_per_thread", "prefetch", "smem_stages", "unpack")
MMA_ONLY = ("mma_tiles", "mag_mma")


def make_score_kernel(*, form: int = 0, **params) -> TriScoreKernel:
    """The scorer of ``form`` (0: CUDA-core FMAs, ``TriScoreKernel``; 1: tensor cores,
    ``TriScoreMmaKernel``) from a family's geometry and launch parameters."""
    if form == 1:
        return TriScoreMmaKernel(**{k: v for k, v in params.items() if k not in CUDA_CORE_ONLY})
    if form != 0:
        raise ValueError(f"score kernel: form {form} (0: CUDA cores, 1: tensor cores)")
    return TriScoreKernel(**{k: v for k, v in params.items() if k not in MMA_ONLY})
