"""The cold-page layout's vocabulary (COLD_PAGE_FORMAT.md §1-2) as plain data, and its span and
region arithmetic: how a row splits into lossless, quantized and 2FP4 parts, and in which order a
layer record holds its regions.

``kvgen.lower.layout`` computes a family's layout from its spec with these; the oracle codec, the
spec validator (which cross-checks a declared quantized range) and the tools read them. Nothing
here knows the spec.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

ResidualAt = Literal["start", "end"]


def align16(n: int) -> int:
    return (n + 15) // 16 * 16


@dataclass(frozen=True)
class BufferSchema:
    """One quantized buffer of a layer: ``rows`` rows of ``prefix | q | suffix`` elements.

    The 2FP4 part (``r`` elements) sits inside the quantized run, at its start or its end.
    ``G`` and ``Q`` are the buffer's global multipliers, or both None when they are per layer
    (given at configure time, one pair per layer: ``per_layer_scales``).
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
    G: float | None
    Q: float | None

    @property
    def per_layer_scales(self) -> bool:
        return self.G is None

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


def row_spans(row_dim: int, rotary_dim: int, placement: str, policy: str,
              residual_width: int | None = None) -> tuple[int, int, int, int, ResidualAt]:
    """``(prefix, q, suffix, r, residual_at)`` of one row: a lossless RoPE span sits before the
    quantized run (``leading``/``full`` RoPE) or after it (``trailing``); a 2FP4 span of ``r``
    elements (default: the rotary span) sits inside the run at the RoPE side. ``rotary_dim`` 0
    (V, or no RoPE) quantizes the whole row."""
    policy = policy if rotary_dim else "quantized"
    trailing = placement == "trailing"
    prefix = suffix = r = 0
    if policy == "lossless":
        if trailing:
            suffix = rotary_dim
        else:
            prefix = rotary_dim
    elif policy == "2fp4":
        r = residual_width or rotary_dim
    return prefix, row_dim - prefix - suffix, suffix, r, "end" if trailing else "start"


def record_regions(buffers: tuple[BufferSchema, ...], sides: tuple[SideSchema, ...]) -> tuple[list[Region], int]:
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
