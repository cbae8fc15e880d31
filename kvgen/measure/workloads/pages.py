"""The paged K/V shape every TriAttention workload allocates (the kernels' HND / NHD layouts)."""

from __future__ import annotations


def page_shape(layout: str, kv_heads: int, tokens_per_block: int, head_dim: int) -> tuple[int, int, int]:
    """One page of one layer's K (or V) pool: ``HND`` = (heads, tokens, dim), ``NHD`` = (tokens, heads, dim)."""
    if layout == "HND":
        return kv_heads, tokens_per_block, head_dim
    if layout == "NHD":
        return tokens_per_block, kv_heads, head_dim
    raise ValueError(f"layout: expected 'HND' or 'NHD', got {layout!r}")


def geometry_page_shape(g) -> tuple[int, int, int]:  # noqa: ANN001 - a TriGeometry or alike
    return page_shape(g.layout, g.kv_heads, g.tokens_per_block, g.head_dim)
