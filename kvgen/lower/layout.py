"""Lowering a spec to the cold-page byte layout (COLD_PAGE_FORMAT.md §1-2), once, as plain data
(the layout's types and span arithmetic are the format's, in ``kvgen.reference.layout``).

``family_layout(spec)`` answers every size question a kernel, the oracle or ``kvgen show`` asks:
each quantized buffer's row schema (lossless prefix, quantized run, 2FP4 part, lossless suffix),
the ordered regions of one layer record with their offsets, and each lifecycle's cold page size.
"""

from __future__ import annotations

from dataclasses import asdict

from kvgen.lower.triattention import eviction_config, eviction_refusal
from kvgen.reference.layout import (
    BufferSchema,
    FamilyLayout,
    LayerRecord,
    Lifecycle,
    SideSchema,
    record_regions,
    row_spans,
)
from kvgen.spec.schema import FamilySpec, quantized_buffer_names


def buffer_rows(spec: FamilySpec) -> int:
    """Rows of one quantized buffer in one page: heads × tokens, or CSA entries."""
    if spec.attention == "csa":
        return spec.tokens_per_block // (spec.csa.tokens_per_entry if spec.csa else 4)
    return spec.kv_heads * spec.tokens_per_block


def row_schema(spec: FamilySpec, buffer: str) -> BufferSchema:
    """Spans of one quantized buffer's row under the spec's RoPE policy (V never carries RoPE)."""
    rotary = spec.rotary_dim if buffer != "v" else 0
    prefix, q, suffix, r, residual_at = row_spans(spec.row_dim, rotary, spec.rope.placement, spec.cold_page.rope,
                                                  spec.cold_page.residual_width)
    G, Q = spec.scale_for(buffer) or (None, None)
    return BufferSchema(name=buffer, rows=buffer_rows(spec), row_dim=spec.row_dim, elem_bytes=spec.elem_bytes,
                        prefix=prefix, q=q, suffix=suffix, r=r, residual_at=residual_at, G=G, Q=Q)


def layer_record(spec: FamilySpec) -> LayerRecord:
    buffers = tuple(row_schema(spec, name) for name in quantized_buffer_names(spec))
    sides = tuple(SideSchema(s.name, s.bytes_per_token * spec.tokens_per_block) for s in spec.side_buffers)
    regions, unpadded = record_regions(buffers, sides)
    return LayerRecord(buffers=buffers, sides=sides, regions=tuple(regions), unpadded_bytes=unpadded)


def lifecycles(spec: FamilySpec, record: LayerRecord) -> tuple[Lifecycle, ...]:
    """Group layers by attention window: full-attention layers first, then each window ascending."""
    groups: dict[int | None, list[int]] = {}
    for layer in range(spec.layers):
        groups.setdefault(spec.layer_window(layer), []).append(layer)
    order = sorted(groups, key=lambda w: (w is not None, w or 0))
    return tuple(
        Lifecycle(index=i, layers=tuple(groups[w]), window=w, record_bytes=record.bytes,
                  hot_record_bytes=record.hot_bytes)
        for i, w in enumerate(order)
    )


def family_layout(spec: FamilySpec) -> FamilyLayout:
    record = layer_record(spec)
    return FamilyLayout(family=spec.name, record=record, lifecycles=lifecycles(spec, record))


def to_json(spec: FamilySpec, layout: FamilyLayout) -> dict:
    """The layout as plain JSON: what ``kvgen show --json`` prints and the manifest carries to the
    runtime, which sizes cold storage from it and builds the eviction manager from its
    ``triattention`` entry (``EvictionConfig.to_json()``), without the spec. That entry is null
    when TriAttention cannot run for the family; ``triattention_refusal`` then says why."""
    record = layout.record
    refusal = eviction_refusal(spec)
    return {
        "family": spec.name,
        "record_bytes": record.bytes,
        "hot_record_bytes": record.hot_bytes,
        "buffers": [asdict(b) for b in record.buffers],
        "sides": [asdict(s) for s in record.sides],
        "regions": [asdict(r) for r in record.regions],
        "lifecycles": [
            {"index": lc.index, "window": lc.window, "layers": list(lc.layers),
             "cold_page_bytes": lc.cold_page_bytes, "hot_page_bytes": lc.hot_page_bytes}
            for lc in layout.lifecycles
        ],
        "triattention": None if refusal else eviction_config(spec).to_json(),
        "triattention_refusal": refusal,
    }
