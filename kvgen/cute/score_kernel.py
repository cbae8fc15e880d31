"""TriAttention scoring kernel (TRIATTENTION.md §3), CuTe DSL.

``score(ℓ, h, j) = Σ_f a_f·Re k_f + b_f·Im k_f + m_f·|k_f|`` for every decode token ``j`` in
``[P, S)`` of every request, read straight from the paged K pool (post-RoPE keys, never
re-rotated), with ``a = s(qr·c − qi·d)``, ``b = s(qr·d + qi·c)``, ``m = s·mlr`` built per CTA from
the calibration (``qr, qi, mlr`` ``[layers, Hq, F]``, ``s = freq_scale_sq`` ``[F]``) and the
request's mean-phase row (``c, d`` ``[B, F]``).

Work decomposition (memory bound: every K row is read once per pass, see below):
- grid ``(⌈W / threads⌉, Hkv · passes, layers · B)``; one CTA = one token tile of one KV head of
  one (layer, request); one thread = one token.
- the query heads of a KV group are scored from the same K row: a thread keeps one f32
  accumulator per query head. Groups wider than ``max_heads`` are split into ``passes`` of
  ``heads`` query heads each (``passes = ⌈G / max_heads⌉``), one grid row per pass; K is then read
  once per pass (from L2 after the first). Every shipped family with G ≤ 16 needs one pass.
- the CTA first turns the calibration of its ``heads`` query heads into ``(a, b, m)`` in shared
  memory, laid out ``[F][3][heads]`` so a thread walks it in order (warp-uniform broadcast
  reads); then each thread loads its K row's rotated span in 16-byte vectors and accumulates.
- columns ``[S − P, W)`` of a request are written as zeros, so the output needs no memset.

Inputs are raw device pointers wrapped in CuTe tensors with symbolic sizes (``compile_aot``): the
AOT export turns each into a ``{data, dynamic_shapes, dynamic_strides}`` struct that the C shim
(``kvgen/csrc/score_abi.cpp``) fills.
"""

from __future__ import annotations

import math

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64

ELEMENT_TYPES = {"bf16": cutlass.BFloat16, "fp16": cutlass.Float16}
ELEMENT_BYTES = {"bf16": 2, "fp16": 2}
VECTOR_BYTES = 16


def vector_width(rotary_start: int, rotary_dim: int, pairing: str, elem_bytes: int) -> int:
    """Elements per K load: the widest power of two up to 16 bytes that keeps every load of the
    rotated span aligned (the span start, and for ``half`` the imaginary half, are multiples)."""
    width = VECTOR_BYTES // elem_bytes
    extent = rotary_dim // 2 if pairing == "half" else rotary_dim
    while width > 1 and (rotary_start % width or extent % width):
        width //= 2
    return width


class TriScoreKernel:
    """One family's scorer: the geometry is compile-time, sizes (layers, B, W, pages) are not."""

    def __init__(self, *, dtype: str, layout: str, head_dim: int, query_heads: int, kv_heads: int,
                 rotary_start: int, rotary_dim: int, pairing: str, tokens_per_block: int,
                 threads: int = 128, max_heads: int = 16):
        if dtype not in ELEMENT_TYPES:
            raise ValueError(f"score kernel: dtype {dtype!r}; accepted: {', '.join(ELEMENT_TYPES)} "
                             "(fp8 K is not scored yet)")
        if layout not in ("HND", "NHD") or pairing not in ("half", "interleaved"):
            raise ValueError(f"score kernel: layout {layout!r} / pairing {pairing!r} not supported")
        if query_heads % kv_heads or rotary_dim % 2 or rotary_start + rotary_dim > head_dim:
            raise ValueError("score kernel: inconsistent geometry")
        self.dtype = dtype
        self.element = ELEMENT_TYPES[dtype]
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
        # Element offsets inside one page of the pool.
        if layout == "HND":   # [Hkv][tokens_per_block][head_dim]
            self.head_stride = tokens_per_block * head_dim
            self.slot_stride = head_dim
        else:                 # NHD: [tokens_per_block][Hkv][head_dim]
            self.head_stride = head_dim
            self.slot_stride = kv_heads * head_dim

    # ------------------------------------------------------------------ host side (traced)

    @cute.jit
    def __call__(self, k_ptrs: cute.Tensor, page_table: cute.Tensor, P: cute.Tensor, S: cute.Tensor,
                 c: cute.Tensor, d: cute.Tensor, qr: cute.Tensor, qi: cute.Tensor, mlr: cute.Tensor,
                 freq_scale_sq: cute.Tensor, scores: cute.Tensor, page_stride: Int64,
                 stream: cuda.CUstream):
        layers = scores.shape[0]
        batch = scores.shape[1]
        width = scores.shape[3]
        tiles = (width + self.threads - 1) // self.threads
        self.kernel(k_ptrs, page_table, P, S, c, d, qr, qi, mlr, freq_scale_sq, scores, page_stride).launch(
            grid=[tiles, self.kv_heads * self.passes, layers * batch],
            block=[self.threads, 1, 1],
            stream=stream,
        )

    # ------------------------------------------------------------------ device side

    @cute.kernel
    def kernel(self, k_ptrs: cute.Tensor, page_table: cute.Tensor, P: cute.Tensor, S: cute.Tensor,
               c: cute.Tensor, d: cute.Tensor, qr: cute.Tensor, qi: cute.Tensor, mlr: cute.Tensor,
               freq_scale_sq: cute.Tensor, scores: cute.Tensor, page_stride: Int64):
        tid, _, _ = cute.arch.thread_idx()
        tile, head_pass, layer_request = cute.arch.block_idx()
        batch = scores.shape[1]
        width = scores.shape[3]
        layer = layer_request // batch
        request = layer_request - layer * batch
        kv_head = head_pass // self.passes
        first = (head_pass - kv_head * self.passes) * self.heads   # first group member of this pass

        # (a, b, m) of this pass's query heads for this (layer, request), in shared memory.
        smem = cutlass.memory.SmemAllocator()
        coef = smem.allocate_tensor(
            Float32, cute.make_layout((self.heads, 3, self.freqs), stride=(1, self.heads, 3 * self.heads)), 16)
        self.load_coefficients(coef, c, d, qr, qi, mlr, freq_scale_sq, tid, layer, request, kv_head, first)
        cute.arch.sync_threads()

        acc = cute.make_rmem_tensor(cute.make_layout(self.heads), Float32)
        acc.fill(0.0)
        j = tile * self.threads + tid                       # decode token index (column)
        valid_width = S[request] - P[request]
        if j < valid_width:
            position = P[request] + j
            block = position // self.tokens_per_block
            slot = position - block * self.tokens_per_block
            page = page_table[request, block]
            offset = (Int64(page) * page_stride + kv_head * self.head_stride + slot * self.slot_stride
                      + self.rotary_start)
            span_ptr = cute.make_ptr(self.element, k_ptrs[layer] + offset * self.elem_bytes,
                                     cute.AddressSpace.gmem, assumed_align=self.vec * self.elem_bytes)
            span = cute.make_tensor(span_ptr, cute.make_layout(self.rotary_dim))
            self.accumulate(acc, coef, span)
        if j < width:
            for h in cutlass.range_constexpr(self.heads):
                if self.passes == 1:
                    scores[layer, request, kv_head * self.group + h, j] = acc[h]
                else:
                    if first + h < self.group:
                        scores[layer, request, kv_head * self.group + first + h, j] = acc[h]

    @cute.jit
    def load_coefficients(self, coef: cute.Tensor, c: cute.Tensor, d: cute.Tensor, qr: cute.Tensor,
                          qi: cute.Tensor, mlr: cute.Tensor, freq_scale_sq: cute.Tensor, tid: Int32,
                          layer: Int32, request: Int32, kv_head: Int32, first: Int32):
        """``coef[h, 0..2, f] = (a, b, m)`` of group member ``first + h`` (zeros past the group)."""
        for index in cutlass.range(tid, self.heads * self.freqs, self.threads):
            h = index // self.freqs
            f = index - h * self.freqs
            member = first + h
            live = member < self.group
            head = kv_head * self.group + cutlass.min(member, self.group - 1)
            s = freq_scale_sq[f]
            cf = c[request, f]
            df = d[request, f]
            re = qr[layer, head, f]
            im = qi[layer, head, f]
            zero = Float32(0.0)
            coef[h, 0, f] = Float32(cutlass.select_(live, s * (re * cf - im * df), zero))
            coef[h, 1, f] = Float32(cutlass.select_(live, s * (re * df + im * cf), zero))
            coef[h, 2, f] = Float32(cutlass.select_(live, s * mlr[layer, head, f], zero))

    @cute.jit
    def accumulate(self, acc: cute.Tensor, coef: cute.Tensor, span: cute.Tensor):
        """``acc[h] += Σ_f a·re + b·im + m·|k|`` over the rotated span of one K row."""
        if self.pairing == "half":
            for chunk in cutlass.range_constexpr(self.freqs // self.vec):
                re = self.load_f32(span, chunk * self.vec)
                im = self.load_f32(span, self.freqs + chunk * self.vec)
                for e in cutlass.range_constexpr(self.vec):
                    self.accumulate_pair(acc, coef, chunk * self.vec + e, re[e], im[e])
        else:
            pairs = max(self.vec // 2, 1)   # pairs per chunk
            for chunk in cutlass.range_constexpr(self.freqs // pairs):
                values = self.load_f32(span, 2 * chunk * pairs, 2 * pairs)
                for e in cutlass.range_constexpr(pairs):
                    self.accumulate_pair(acc, coef, chunk * pairs + e, values[2 * e], values[2 * e + 1])

    def load_f32(self, span: cute.Tensor, start: int, count: int | None = None) -> list:
        """Elements ``[start, start + count)`` of the span as f32 scalars, in ``vec``-wide loads."""
        count = self.vec if count is None else count
        values = []
        for k in range(count // self.vec):
            piece = cute.local_tile(span, (self.vec,), (start // self.vec + k,))
            loaded = piece.load().to(Float32)
            values += [loaded[e] for e in range(self.vec)]
        return values

    def accumulate_pair(self, acc: cute.Tensor, coef: cute.Tensor, f: int, re, im) -> None:
        # sqrt.approx (one MUFU op, a few ulp) instead of the IEEE sequence (~10 instructions):
        # F square roots per token would otherwise cost as much as a third of the FMAs.
        magnitude = cute.math.sqrt(re * re + im * im, approx=True)
        for h in range(self.heads):
            acc[h] = acc[h] + coef[h, 0, f] * re + coef[h, 1, f] * im + coef[h, 2, f] * magnitude

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
            Int64(0),                             # page_stride (elements)
            make_fake_stream(),
        )

    def compile_aot(self, arch: str, keep_ptx: bool = False):
        options = f"--gpu-arch {arch}" + (" --keep-ptx" if keep_ptx else "")
        return cute.compile(self, *self.fake_arguments(), options=options)
