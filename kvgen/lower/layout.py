"""Lowering a spec to the cold-page byte layout (COLD_PAGE_FORMAT.md §1-2), once, as plain data.

``family_layout(spec)`` answers every size question a kernel, the oracle or ``kvgen show`` asks:
each quantized buffer's row schema (lossless prefix, quantized run, 2FP4 part, lossless suffix),
the ordered regions of one layer record with their offsets, and each lifecycle's cold page size.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Literal

from kvgen.lower.triattention import eviction_config, eviction_refusal
from kvgen.spec.schema import FamilySpec, quantized_buffer_names


def align16(n: int) -> int:
    return (n + 15) // 16 * 16


@dataclass(frozen=True)
class BufferSchema:
    """One quantized buffer of a layer: ``rows`` rows of ``prefix | q | suffix`` elements.

    The 2FP4 part (``r`` elements) sits inside the quantized run, at its start or its end.
    """

    name: str
    rows: int
    row_dim: int
    elem_bytes: int
    prefix: int
    q: int
    suffix: int
    r: int
    residual_at: Literal["start", "end"]
    G: float
    Q: float

    @property
    def lossless(self) -> int:
        return self.prefix + self.suffix

    @property
    def residual_start(self) -> int:
        """Element offset of the 2FP4 part inside the quantized run."""
        return 0 if self.residual_at == "start" else self.q - self.r

    @property
    def hot_bytes(self) -> int:
        return self.rows * self.row_dim * self.elem_bytes

    @property
    def data_bytes(self) -> int:
        return self.rows * self.q // 2

    @property
    def scale_bytes(self) -> int:
        return self.rows * self.q // 16

    @property
    def residual_bytes(self) -> int:
        return self.rows * self.r // 2

    @property
    def residual_scale_bytes(self) -> int:
        return self.rows * self.r // 16

    @property
    def lossless_bytes(self) -> int:
        return self.rows * self.lossless * self.elem_bytes


@dataclass(frozen=True)
class SideSchema:
    """A side buffer copied byte for byte: ``bytes`` per page of one layer."""

    name: str
    bytes: int


RegionKind = Literal["data", "scales", "residual", "residual_scales", "lossless", "side", "pad"]


@dataclass(frozen=True)
class Region:
    buffer: str
    kind: RegionKind
    offset: int
    size: int


@dataclass(frozen=True)
class LayerRecord:
    buffers: tuple[BufferSchema, ...]
    sides: tuple[SideSchema, ...]
    regions: tuple[Region, ...]
    unpadded_bytes: int

    @property
    def bytes(self) -> int:
        return align16(self.unpadded_bytes)

    @property
    def hot_bytes(self) -> int:
        return sum(b.hot_bytes for b in self.buffers) + sum(s.bytes for s in self.sides)

    def region(self, buffer: str, kind: RegionKind) -> Region:
        for region in self.regions:
            if region.buffer == buffer and region.kind == kind:
                return region
        raise KeyError(f"no {kind} region for buffer {buffer!r}")


@dataclass(frozen=True)
class Lifecycle:
    """Layers whose pages move together (one per distinct attention window)."""

    index: int
    layers: tuple[int, ...]
    window: int | None
    record_bytes: int
    hot_record_bytes: int

    @property
    def cold_page_bytes(self) -> int:
        return len(self.layers) * self.record_bytes

    @property
    def hot_page_bytes(self) -> int:
        return len(self.layers) * self.hot_record_bytes


@dataclass(frozen=True)
class FamilyLayout:
    family: str
    record: LayerRecord
    lifecycles: tuple[Lifecycle, ...]

    def lifecycle_of(self, layer: int) -> Lifecycle:
        for lifecycle in self.lifecycles:
            if layer in lifecycle.layers:
                return lifecycle
        raise KeyError(f"layer {layer} is not in family {self.family}")


# ---------------------------------------------------------------- lowering


def buffer_rows(spec: FamilySpec) -> int:
    """Rows of one quantized buffer in one page: heads × tokens, or CSA entries."""
    if spec.attention == "csa":
        return spec.tokens_per_block // (spec.csa.tokens_per_entry if spec.csa else 4)
    return spec.kv_heads * spec.tokens_per_block


def row_schema(spec: FamilySpec, buffer: str) -> BufferSchema:
    """Spans of one quantized buffer's row under the spec's RoPE policy (V never carries RoPE)."""
    rotary = spec.rotary_dim if buffer != "v" else 0
    policy = spec.cold_page.rope if rotary else "quantized"
    trailing = spec.rope.placement == "trailing"
    prefix = suffix = r = 0
    if policy == "lossless":
        if trailing:
            suffix = rotary
        else:
            prefix = rotary
    elif policy == "2fp4":
        r = spec.cold_page.residual_width or rotary
    G, Q = spec.scale_for(buffer)
    return BufferSchema(
        name=buffer,
        rows=buffer_rows(spec),
        row_dim=spec.row_dim,
        elem_bytes=spec.elem_bytes,
        prefix=prefix,
        q=spec.row_dim - prefix - suffix,
        suffix=suffix,
        r=r,
        residual_at="end" if trailing else "start",
        G=G,
        Q=Q,
    )


def _regions(buffers: tuple[BufferSchema, ...], sides: tuple[SideSchema, ...]) -> tuple[list[Region], int]:
    """Regions in record order (§2 table): data of every buffer, then per-buffer blocks, sides, pad."""
    regions: list[Region] = []
    offset = 0

    def put(buffer: str, kind: RegionKind, size: int) -> None:
        nonlocal offset
        if size:
            regions.append(Region(buffer, kind, offset, size))
            offset += size

    for b in buffers:
        put(b.name, "data", b.data_bytes)
    for b in buffers:
        put(b.name, "scales", b.scale_bytes)
        put(b.name, "residual", b.residual_bytes)
        put(b.name, "residual_scales", b.residual_scale_bytes)
        put(b.name, "lossless", b.lossless_bytes)
    for s in sides:
        put(s.name, "side", s.bytes)
    unpadded = offset
    put("", "pad", align16(offset) - offset)
    return regions, unpadded


def layer_record(spec: FamilySpec) -> LayerRecord:
    buffers = tuple(row_schema(spec, name) for name in quantized_buffer_names(spec))
    sides = tuple(SideSchema(s.name, s.bytes_per_token * spec.tokens_per_block) for s in spec.side_buffers)
    regions, unpadded = _regions(buffers, sides)
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
