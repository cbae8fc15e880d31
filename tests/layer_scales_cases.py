"""Test families and data for per-layer second-level scales (tests/test_layer_scales.py and
tests/gpu/test_layer_scales_gpu.py): the test spec, a mixed variant, hot pages with garbage rows
and a distinct (G, Q) per layer and buffer, and scales files in both formats."""

from __future__ import annotations

from pathlib import Path

import torch

from kvgen.lower.layout import family_layout
from kvgen.reference.codec import HOT_TORCH_DTYPES
from kvgen.runtime.scales import LayerScales, per_layer_buffers
from kvgen.spec.schema import FamilySpec, load_spec, parse_spec

from .conftest import ROOT

TEST_SPECS = ROOT / "tests" / "specs"
PER_LAYER_SPEC = TEST_SPECS / "per-layer-scales.yaml"


def per_layer_spec() -> FamilySpec:
    """K and V per layer, bf16, K's RoPE span 2FP4, a side buffer, two lifecycles."""
    return load_spec(PER_LAYER_SPEC)


def mixed_spec() -> FamilySpec:
    """The same geometry in fp16 with K per layer and V's scales compiled in (G 0.5, Q 2)."""
    text = PER_LAYER_SPEC.read_text(encoding="utf-8")
    text = text.replace("name: per-layer-scales", "name: per-layer-scales-mixed").replace("dtype: bf16", "dtype: fp16")
    text = text.replace("    v: per_layer", "    v: {G: 0.5}")
    return parse_spec(text, "per-layer-scales-mixed")


def fp8_spec() -> FamilySpec:
    """The test family with an FP8 hot cache (the FP8 widening and rounding of the record code)."""
    text = PER_LAYER_SPEC.read_text(encoding="utf-8")
    text = text.replace("name: per-layer-scales", "name: per-layer-scales-fp8").replace("dtype: bf16", "dtype: fp8_e4m3")
    return parse_spec(text, "per-layer-scales-fp8")


def layer_scales(spec: FamilySpec, seed: int = 0) -> LayerScales:
    """A distinct binary32 (G, Q) per (layer, per-layer buffer): G spread over 2^-6..2^6; Q is 1/G,
    an unrelated value, or exactly 1 (a row whose decode takes Q = 1 at run time)."""
    gen = torch.Generator().manual_seed(seed)
    layout = family_layout(spec)
    buffers = per_layer_buffers(layout)
    values = []
    for layer in range(spec.layers):
        row = []
        for j, _ in enumerate(buffers):
            G = float(torch.tensor(2.0 ** (12 * torch.rand((), generator=gen).item() - 6), dtype=torch.float32))
            kind = (layer + j) % 3
            Q = float(torch.tensor(1.0 / G, dtype=torch.float32)) if kind == 0 else 1.0 if kind == 1 else float(
                torch.tensor(0.37 + torch.rand((), generator=gen).item(), dtype=torch.float32))
            row.append((G, Q))
        values.append(tuple(row))
    return LayerScales(family=spec.name, buffers=buffers, values=tuple(values))


def hot_pages(spec: FamilySpec, pages: int, seed: int = 0) -> list[list[torch.Tensor]]:
    """Per layer: [pages, ...] of every part (quantized buffers then side buffers), on the CPU, with
    an outlier channel, a zero block and NaN/Inf/huge garbage in some rows (a partial page)."""
    gen = torch.Generator().manual_seed(seed)
    layout = family_layout(spec)
    dtype = HOT_TORCH_DTYPES[spec.dtype]
    out = []
    for _ in range(spec.layers):
        parts = []
        for b in layout.record.buffers:
            x = torch.randn(pages, b.rows, b.row_dim, generator=gen) * 3
            x[:, :, 5] *= 50
            x[:, 0, :16] = 0
            junk = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e30])
            x[:, -2:, :] = junk[torch.randint(0, 4, (pages, 2, b.row_dim), generator=gen)]
            if spec.dtype == "fp8_e4m3":  # torch's fp8 cast gives NaN above 464: keep finite values finite
                x = torch.where(x.isfinite(), x.clamp(-448, 448), x)
            parts.append(x.to(dtype))
        for s in layout.record.sides:
            parts.append(torch.randint(0, 256, (pages, s.bytes), generator=gen, dtype=torch.uint8))
        out.append(parts)
    return out


def split_layer(spec: FamilySpec, parts: list[torch.Tensor], index) -> tuple[dict, dict]:
    """(buffers, sides) of one layer's pages at ``index``, as ``kvgen.reference.codec`` takes them."""
    layout = family_layout(spec)
    nq = len(layout.record.buffers)
    buffers = {b.name: parts[i][index] for i, b in enumerate(layout.record.buffers)}
    sides = {s.name: parts[nq + i][index] for i, s in enumerate(layout.record.sides)}
    return buffers, sides


def save_scales(path: Path, scales: LayerScales, with_q: bool = True) -> Path:
    """Write ``scales`` as a scales file (``.safetensors`` or a torch file, by suffix)."""
    tensors = {}
    for j, buffer in enumerate(scales.buffers):
        tensors[f"{buffer}.G"] = torch.tensor([row[j][0] for row in scales.values], dtype=torch.float32)
        if with_q:
            tensors[f"{buffer}.Q"] = torch.tensor([row[j][1] for row in scales.values], dtype=torch.float32)
    if path.suffix == ".safetensors":
        from safetensors.torch import save_file

        save_file(tensors, str(path))
    else:
        torch.save(tensors, path)
    return path
