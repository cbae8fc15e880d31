"""Score-kernel arithmetic that needs no CUTLASS: how a K row is cut into vector loads.

Shared by the kernel (``score_kernel.py``, build machine only) and the tuner, which folds launch
parameters that compile to the same kernel (``kvgen.tuning.space``) without importing the DSL.
"""

from __future__ import annotations

VECTOR_BYTES = 16


def vector_width(rotary_start: int, rotary_dim: int, pairing: str, elem_bytes: int) -> int:
    """Elements per K load: the widest power of two up to 16 bytes that keeps every load of the
    rotated span aligned (the span start, and for ``half`` the imaginary half, are multiples)."""
    width = VECTOR_BYTES // elem_bytes
    extent = rotary_dim // 2 if pairing == "half" else rotary_dim
    while width > 1 and (rotary_start % width or extent % width):
        width //= 2
    return width


def pairs_per_chunk(vec: int, pairing: str) -> int:
    """Frequencies one step of a thread reads: a vector of re and one of im for ``half`` pairs,
    one vector of interleaved pairs (two scalars if ``vec == 1``)."""
    return vec if pairing == "half" else max(vec // 2, 1)


def row_chunks(rotary_start: int, rotary_dim: int, pairing: str, elem_bytes: int) -> int:
    """Chunks (thread steps) in the rotated span of one K row."""
    vec = vector_width(rotary_start, rotary_dim, pairing, elem_bytes)
    return (rotary_dim // 2) // pairs_per_chunk(vec, pairing)


def effective_lanes(lanes: int, chunks: int) -> int:
    """Threads per token the kernel really uses: ``lanes`` halved until it divides the chunks."""
    while chunks % lanes:
        lanes //= 2
    return lanes


def bulk_ring_fits(vec: int, elem_bytes: int, lanes: int, tokens_per_thread: int) -> bool:
    """Whether the scorer's bulk-copy ring (``bulk_stages``) can hold a row: 16-byte pieces (a bulk
    copy moves multiples of 16 bytes between 16-byte aligned addresses), at most 4 effective lanes
    (its row padding gives 8 bank groups) and one token per thread."""
    return vec * elem_bytes == VECTOR_BYTES and lanes <= 4 and tokens_per_thread == 1


# Shared memory one CTA of the tensor-core scorer (form 1) may take: two CTAs fit an SM of
# sm_90a / sm_100a (227 KiB each).
MMA_SHARED_BUDGET = 110 * 1024


# K dtypes the tensor-core scorer takes as exact bf16 operands, and their bytes per element.
MMA_K_BYTES = {"bf16": 2, "fp8_e4m3": 1}


def mma_form_fits(dtype: str, rotary_start: int, rotary_dim: int, pairing: str) -> bool:
    """Whether the tensor-core scorer (form 1) serves a family: K that is an exact bf16 MMA operand
    (bf16 as stored; fp8 E4M3 widened in registers, every E4M3 value is a bf16), half pairs (element
    f and f + F at the same place of two MMA blocks: the lane holds both parts), a rotated span of
    whole pair chunks (the bytes one ``ldmatrix.x4`` gives a lane row: 32 bytes of re and of im, so
    32 bf16 or 64 fp8 elements) starting 16-byte aligned (a bulk copy per row)."""
    elem_bytes = MMA_K_BYTES.get(dtype)
    return (elem_bytes is not None and pairing == "half" and (rotary_dim * elem_bytes) % 64 == 0
            and (rotary_start * elem_bytes) % 16 == 0)


def mma_magnitude_fits(rotary_dim: int) -> bool:
    """Whether form 1 may take the magnitude term to tf32 MMAs (``mag_mma``): its bound,
    ``(F/2 + 69)·u·T``, is within the stated ``(3F + 16)·u·T`` for F >= 32 pairs only."""
    return rotary_dim // 2 >= 32


def mma_row_stride(span_bytes: int) -> int:
    """Bytes per ring row: the span padded to 16 (mod 128), so ``ldmatrix``'s 8 rows hit 8 bank groups."""
    return span_bytes + (16 - span_bytes) % 128


def mma_m_stride(heads: int) -> int:
    """Words per quad lane of form 1's f32 magnitude coefficients (4 slots x ``heads``), padded to 4
    (mod 8) so the 4 addresses of a warp's read fall in different banks."""
    return 4 * heads + (4 - 4 * heads) % 8


def mma_coefficient_words(heads: int, rotary_dim: int, mag_mma: int) -> tuple[int, int]:
    """Shared words of form 1's coefficients: the B fragments ([head tile][block][3 splits][32
    lanes][2 words]) and the magnitude coefficients: tf32 B fragments ([head tile][block / 2][2 slot
    pairs][hi, lo][32 lanes][2 words]) with ``mag_mma``, else [block / 2][4 quad lanes][``mma_m_stride``]."""
    blocks = rotary_dim // 16
    head_tiles = -(-heads // 8)
    m_words = head_tiles * (blocks // 2) * 2 * 2 * 64 if mag_mma else (blocks // 2) * 4 * mma_m_stride(heads)
    return head_tiles * blocks * 3 * 64, m_words


def mma_ring_bytes(warps: int, stages: int, rows: int, span_bytes: int) -> int:
    """Shared bytes of the rings of all warps: per warp ``stages`` slots of ``rows`` rows, a used mask
    per 32 rows of a slot, an mbarrier per slot; each warp's part a multiple of 128 bytes."""
    copies = (rows + 31) // 32
    part = stages * rows * mma_row_stride(span_bytes) + stages * copies * 4
    part += (8 - part % 8) % 8 + stages * 8
    return warps * (part + (128 - part % 128) % 128)
