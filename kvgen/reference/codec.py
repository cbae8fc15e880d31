"""Reference cold-page codec: one layer record and one lifecycle page (COLD_PAGE_FORMAT.md §2).

Plain PyTorch over the block arithmetic of ``kvgen.reference.nvfp4``. Every generated codec kernel
must produce exactly these bytes. Inputs are hot pages as written by the engine: one tensor per
quantized buffer holding ``rows × row_dim`` elements in hot row order (HND or NHD, the codec does
not care: it keeps the order), and one uint8 tensor per side buffer.

A buffer whose global multipliers are per layer (``BufferSchema.per_layer_scales``) takes this
layer's ``(G, Q)`` from ``scales``, a mapping from buffer name to the pair (binary32, like every G
and Q); page-level functions take one such mapping per layer of the family.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from kvgen.reference import nvfp4
from kvgen.reference.layout import BufferSchema, FamilyLayout, LayerRecord

HOT_TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8_e4m3": torch.float8_e4m3fn}

LayerInput = tuple[Mapping[str, torch.Tensor], Mapping[str, torch.Tensor]]
# One layer's (G, Q) by per-layer buffer name.
LayerScales = Mapping[str, tuple[float, float]]


def buffer_scales(b: BufferSchema, scales: LayerScales | None) -> tuple[float, float]:
    """(G, Q) of one buffer in one layer: the compiled pair, or the layer's pair of a per-layer buffer."""
    given = scales or {}
    if b.per_layer_scales:
        if b.name not in given:
            raise ValueError(f"buffer {b.name!r}: G and Q are per layer; pass this layer's scales "
                             f"{{{b.name!r}: (G, Q)}}")
        return given[b.name]
    if b.name in given:
        raise ValueError(f"buffer {b.name!r}: G and Q are compiled in (G={b.G}, Q={b.Q}); only per-layer "
                         "buffers take scales")
    return b.G, b.Q


def _rows(hot: torch.Tensor, b: BufferSchema) -> torch.Tensor:
    """[pages, rows, row_dim] view of one page or a batch of pages of a buffer."""
    per_page = b.rows * b.row_dim
    if hot.numel() == 0 or hot.numel() % per_page:
        raise ValueError(f"buffer {b.name!r}: expected pages of {b.rows}×{b.row_dim} elements, "
                         f"got shape {tuple(hot.shape)}")
    return hot.contiguous().reshape(-1, b.rows, b.row_dim)


def _encode_run(run: torch.Tensor, b: BufferSchema, G: float, Q: float) -> dict[str, torch.Tensor]:
    """Encode the quantized run [pages, rows, q] into the byte regions of one buffer."""
    pages = run.shape[0]
    blocks = run.reshape(pages, b.rows, b.q // 16, 16)
    codes, scales = nvfp4.encode_blocks(blocks, G, Q)
    out = {}
    if b.r:
        first = b.residual_start // 16
        last = first + b.r // 16
        main_c, main_s, res_c, res_s = nvfp4.encode_blocks_2fp4(blocks[:, :, first:last], G, Q)
        codes[:, :, first:last] = main_c
        scales[:, :, first:last] = main_s
        out["residual"] = nvfp4.pack_nibbles(res_c.reshape(pages, b.rows * b.r))
        out["residual_scales"] = res_s.reshape(pages, -1)
    out["data"] = nvfp4.pack_nibbles(codes.reshape(pages, b.rows * b.q))
    out["scales"] = scales.reshape(pages, -1)
    return out


def _lossless_bytes(hot: torch.Tensor, b: BufferSchema) -> torch.Tensor:
    """Prefix bytes then suffix bytes of every row, exactly as in the hot page."""
    pages = hot.shape[0]
    raw = hot.view(torch.uint8).reshape(pages, b.rows, b.row_dim * b.elem_bytes)
    prefix = raw[:, :, : b.prefix * b.elem_bytes]
    suffix = raw[:, :, (b.row_dim - b.suffix) * b.elem_bytes :]
    return torch.cat([prefix, suffix], dim=2).reshape(pages, -1)


def encode_buffer(hot: torch.Tensor, b: BufferSchema, scales: LayerScales | None = None) -> dict[str, torch.Tensor]:
    """Byte regions (``data``, ``scales``, ``residual``, ``residual_scales``, ``lossless``) of one buffer."""
    hot = _rows(hot, b)
    x = nvfp4.hot_to_f32(hot)
    out = _encode_run(x[:, :, b.prefix : b.prefix + b.q], b, *buffer_scales(b, scales))
    if b.lossless:
        out["lossless"] = _lossless_bytes(hot, b)
    return out


def encode_records(record: LayerRecord, buffers: Mapping[str, torch.Tensor],
                   side_buffers: Mapping[str, torch.Tensor] | None = None,
                   scales: LayerScales | None = None) -> torch.Tensor:
    """Encode a batch of pages of one layer into zero-padded records: uint8 [pages, record.bytes]."""
    parts = {b.name: encode_buffer(buffers[b.name], b, scales) for b in record.buffers}
    pages, device = next(iter(parts.values()))["data"].shape[0], next(iter(buffers.values())).device
    for s in record.sides:
        if s.name not in (side_buffers or {}):
            raise ValueError(f"side buffer {s.name!r}: missing (the record copies it byte for byte)")
        raw = side_buffers[s.name].contiguous().view(torch.uint8).reshape(-1)
        if raw.numel() != pages * s.bytes:
            raise ValueError(f"side buffer {s.name!r}: expected {pages}×{s.bytes} bytes, got {raw.numel()}")
        parts[s.name] = {"side": raw.reshape(pages, s.bytes)}
    out = torch.zeros(pages, record.bytes, dtype=torch.uint8, device=device)
    for region in record.regions:
        if region.kind != "pad":
            out[:, region.offset : region.offset + region.size] = parts[region.buffer][region.kind].to(device)
    return out


def encode_record(record: LayerRecord, buffers: Mapping[str, torch.Tensor],
                  side_buffers: Mapping[str, torch.Tensor] | None = None,
                  scales: LayerScales | None = None) -> torch.Tensor:
    """Encode one page of one layer into its zero-padded record of ``record.bytes`` bytes."""
    out = encode_records(record, buffers, side_buffers, scales)
    if out.shape[0] != 1:
        raise ValueError(f"encode_record takes one page; got {out.shape[0]} (use encode_records)")
    return out[0]


def _region_bytes(recs: torch.Tensor, record: LayerRecord, buffer: str, kind: str) -> torch.Tensor:
    """One region of a batch of records: uint8 [pages, region size]."""
    region = record.region(buffer, kind)
    return recs[:, region.offset : region.offset + region.size]


def decode_buffer(recs: torch.Tensor, record: LayerRecord, b: BufferSchema, dtype: str,
                  scales: LayerScales | None = None) -> torch.Tensor:
    """Hot rows [pages, rows, row_dim] of one buffer, in the hot dtype."""
    _, Q = buffer_scales(b, scales)
    pages = recs.shape[0]
    codes = nvfp4.unpack_nibbles(_region_bytes(recs, record, b.name, "data")).reshape(pages, b.rows, b.q // 16, 16)
    block_scales = _region_bytes(recs, record, b.name, "scales").reshape(pages, b.rows, b.q // 16)
    y = nvfp4.decode_blocks(codes, block_scales, Q)
    if b.r:
        first = b.residual_start // 16
        last = first + b.r // 16
        res_c = nvfp4.unpack_nibbles(_region_bytes(recs, record, b.name, "residual"))
        res_s = _region_bytes(recs, record, b.name, "residual_scales").reshape(pages, b.rows, b.r // 16)
        y[:, :, first:last] = nvfp4.decode_blocks_2fp4(codes[:, :, first:last], block_scales[:, :, first:last],
                                                       res_c.reshape(pages, b.rows, b.r // 16, 16), res_s, Q)
    run = nvfp4.round_to_hot(y.reshape(pages, b.rows, b.q), dtype)
    hot = torch.empty(pages, b.rows, b.row_dim, dtype=run.dtype, device=recs.device)
    hot[:, :, b.prefix : b.prefix + b.q] = run
    if b.lossless:
        eb = b.elem_bytes
        raw = _region_bytes(recs, record, b.name, "lossless").reshape(pages, b.rows, b.lossless * eb)
        hot_raw = hot.view(torch.uint8).reshape(pages, b.rows, b.row_dim * eb)
        hot_raw[:, :, : b.prefix * eb] = raw[:, :, : b.prefix * eb]
        hot_raw[:, :, (b.row_dim - b.suffix) * eb :] = raw[:, :, b.prefix * eb :]
    return hot


def decode_records(record: LayerRecord, recs: torch.Tensor, dtype: str, scales: LayerScales | None = None
                   ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Inverse of ``encode_records``: ({buffer: [pages, rows, row_dim]}, {side: [pages, bytes]})."""
    if recs.dim() != 2 or recs.shape[1] != record.bytes:
        raise ValueError(f"expected records of {record.bytes} bytes as [pages, bytes], got {tuple(recs.shape)}")
    buffers = {b.name: decode_buffer(recs, record, b, dtype, scales) for b in record.buffers}
    sides = {s.name: _region_bytes(recs, record, s.name, "side").clone() for s in record.sides}
    return buffers, sides


def decode_record(record: LayerRecord, rec: torch.Tensor, dtype: str, scales: LayerScales | None = None
                  ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Inverse of ``encode_record``: ({buffer: hot rows [rows, row_dim]}, {side: bytes})."""
    if rec.numel() != record.bytes:
        raise ValueError(f"expected a {record.bytes}-byte record, got {rec.numel()} bytes")
    buffers, sides = decode_records(record, rec.reshape(1, -1), dtype, scales)
    return {k: v[0] for k, v in buffers.items()}, {k: v[0] for k, v in sides.items()}


# ---------------------------------------------------------------- pages


def _lifecycle_scales(lc, scales: Sequence[LayerScales] | None) -> list[LayerScales | None]:
    """Each lifecycle layer's scales, from ``scales`` indexed by family layer (None: none given)."""
    if scales is None:
        return [None] * len(lc.layers)
    last = max(lc.layers)
    if len(scales) <= last:
        raise ValueError(f"scales: one mapping per layer of the family expected; got {len(scales)}, "
                         f"the lifecycle reaches layer {last}")
    return [scales[layer] for layer in lc.layers]


def encode_page(layout: FamilyLayout, layers: Sequence[LayerInput], lifecycle: int = 0,
                scales: Sequence[LayerScales] | None = None) -> torch.Tensor:
    """One cold page: the layer records of every layer of the lifecycle, ascending. ``scales``: one
    mapping per layer of the family (``scales[layer]``), for per-layer buffers."""
    lc = layout.lifecycles[lifecycle]
    if len(layers) != len(lc.layers):
        raise ValueError(f"lifecycle {lifecycle} has {len(lc.layers)} layers, got {len(layers)}")
    per_layer = _lifecycle_scales(lc, scales)
    return torch.cat([encode_record(layout.record, bufs, sides, s) for (bufs, sides), s in zip(layers, per_layer)])


def decode_page(layout: FamilyLayout, page: torch.Tensor, dtype: str, lifecycle: int = 0,
                scales: Sequence[LayerScales] | None = None) -> list[tuple[dict, dict]]:
    """Inverse of ``encode_page``: per layer of the lifecycle, (buffers, sides) in ``dtype``."""
    lc = layout.lifecycles[lifecycle]
    if page.numel() != lc.cold_page_bytes:
        raise ValueError(f"expected a {lc.cold_page_bytes}-byte cold page, got {page.numel()} bytes")
    records = page.reshape(len(lc.layers), lc.record_bytes)
    per_layer = _lifecycle_scales(lc, scales)
    return [decode_record(layout.record, rec, dtype, s) for rec, s in zip(records, per_layer)]
