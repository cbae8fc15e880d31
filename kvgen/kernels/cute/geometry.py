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
