"""The DRAM ceiling of a codec's traffic mix: how fast this GPU reads R and writes W bytes per page
with no arithmetic at all.

The device copy ceiling reads and writes equal bytes. A decode reads a cold record and writes a hot
page about 3.6x its size (encode the reverse), and DRAM does not turn a write-heavy mix around as
fast as a balanced one. ``ceiling`` times the cheapest kernel with the codec's exact mix, rows of
``src_row_bytes`` in and ``dst_row_bytes`` out, so a codec kernel's time can be read against what
its bytes alone cost:

- expanding (``dst`` wider): destination word ``j`` is source word ``j mod S`` (a program loads a
  block of the source once and stores it at every repeat);
- folding (``src`` wider): destination word ``j`` is the XOR of every source word ``i = j mod D``
  (each source word read once).

Both are stated by ``mix_reference``; rows are contiguous here, where the codec scatters pages of
at least a few KiB, a granularity DRAM does not notice.
"""

from __future__ import annotations

import triton
import triton.language as tl
import torch

from kvgen.measure.timing import summary, time_ms

WORD = 4                 # bytes a lane moves: int32
BLOCK = 1024             # words of the narrower side a program covers: 4 warps, 8 words a thread


@triton.jit
def _mix_kernel(src, dst, SRC_WORDS: tl.constexpr, DST_WORDS: tl.constexpr, PASSES: tl.constexpr,
                BLOCK: tl.constexpr):
    """Program (row, block of the narrower side). Expanding: one vector load of the source block,
    stored at each of its PASSES repeats. Folding: PASSES source slices XORed into the destination
    block. Both sides stay contiguous, so every access is a vector one."""
    row = tl.program_id(0).to(tl.int64)
    k = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    if DST_WORDS > SRC_WORDS:
        live = k < SRC_WORDS
        x = tl.load(src + row * SRC_WORDS + k, mask=live)
        for r in tl.static_range(PASSES):
            j = r * SRC_WORDS + k
            tl.store(dst + row * DST_WORDS + j, x, mask=live & (j < DST_WORDS))
    else:
        live = k < DST_WORDS
        acc = tl.zeros([BLOCK], dtype=tl.int32)
        for r in tl.static_range(PASSES):
            i = r * DST_WORDS + k
            acc ^= tl.load(src + row * SRC_WORDS + i, mask=live & (i < SRC_WORDS), other=0)
        tl.store(dst + row * DST_WORDS + k, acc, mask=live)


def _words(row_bytes: int, name: str) -> int:
    if row_bytes <= 0 or row_bytes % WORD:
        raise ValueError(f"mix ceiling: {name} must be a positive multiple of {WORD} bytes, got {row_bytes}")
    return row_bytes // WORD


def mix(src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    """Write ``dst`` (rows x D int32) from ``src`` (rows x S int32) as the module docstring says."""
    rows, s_words = src.shape
    if dst.shape[0] != rows or src.dtype != torch.int32 or dst.dtype != torch.int32:
        raise ValueError(f"mix: src {tuple(src.shape)} {src.dtype} and dst {tuple(dst.shape)} {dst.dtype} "
                         "must be int32 with equal rows")
    d_words = dst.shape[1]
    narrow, wide = min(s_words, d_words), max(s_words, d_words)
    _mix_kernel[(rows, triton.cdiv(narrow, BLOCK))](src, dst, s_words, d_words, triton.cdiv(wide, narrow), BLOCK,
                                                    num_warps=4)
    return dst


def mix_reference(src: torch.Tensor, d_words: int) -> torch.Tensor:
    """``mix``'s statement in torch: the source repeated where it is the narrower, folded by XOR in
    destination-wide slices where it is the wider."""
    s_words = src.shape[1]
    if d_words >= s_words:
        return src[:, torch.arange(d_words, device=src.device) % s_words]
    out = torch.zeros(src.shape[0], d_words, dtype=src.dtype, device=src.device)
    for start in range(0, s_words, d_words):
        part = src[:, start:start + d_words]
        out[:, :part.shape[1]] ^= part
    return out


def ceiling(rows: int, src_row_bytes: int, dst_row_bytes: int, copy_gbps: float) -> dict:
    """Time ``mix`` over ``rows`` rows on the GPU: median ms, GB/s (bytes read + written) and that
    rate over ``copy_gbps`` (the device copy ceiling of the same run). Frees what it allocated."""
    s_words, d_words = _words(src_row_bytes, "src_row_bytes"), _words(dst_row_bytes, "dst_row_bytes")
    src = torch.randint(-2**31, 2**31 - 1, (rows, s_words), dtype=torch.int32, device="cuda")
    dst = torch.empty(rows, d_words, dtype=torch.int32, device="cuda")
    t = time_ms(lambda: mix(src, dst), reps=10)
    gbps = rows * (src_row_bytes + dst_row_bytes) / t["median_ms"] / 1e6
    del src, dst
    torch.cuda.empty_cache()
    return {"rows": rows, "src_row_bytes": src_row_bytes, "dst_row_bytes": dst_row_bytes, "gbps": gbps,
            "of_copy": gbps / copy_gbps, **summary(t)}
