"""Attention (``softmax(q K^T * scale) V`` with the spec's GQA grouping), its error statistics, and
the queries it is evaluated with (random, or the calibration's synthetic queries)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from kvgen.demo.config import CALIBRATION_QUERIES, CALIBRATION_SPREAD
from kvgen.demo.synthetic import CacheGeometry
from kvgen.lower import triattention as spec_tri
from kvgen.reference import triattention as oracle
from kvgen.spec.schema import FamilySpec


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """``softmax(q k^T * scale) v`` in float32. ``q`` ``[Hq, n, D]``, ``k`` ``[Hkv, T, D]``,
    ``v`` ``[Hkv, T, Dv]``; query head ``h`` reads KV head ``h // (Hq / Hkv)`` (GQA)."""
    heads, n, width = q.shape
    kv_heads = k.shape[0]
    grouped = q.float().reshape(kv_heads, (heads // kv_heads) * n, width)
    logits = grouped @ k.float().transpose(1, 2) * scale
    out = logits.softmax(dim=-1) @ v.float()
    return out.reshape(heads, n, v.shape[-1])


@dataclass
class ErrorStats:
    """Relative L2 error over all output vectors and per-vector cosine similarity."""

    squared_error: float = 0.0
    squared_reference: float = 0.0
    cosines: list[float] = field(default_factory=list)

    def add(self, reference: torch.Tensor, other: torch.Tensor) -> None:
        ref = reference.double().reshape(-1, reference.shape[-1])
        got = other.double().reshape(-1, other.shape[-1])
        self.squared_error += float(((got - ref) ** 2).sum())
        self.squared_reference += float((ref ** 2).sum())
        self.cosines += torch.nn.functional.cosine_similarity(got, ref, dim=-1).tolist()

    def summary(self) -> dict[str, float | int | None]:
        if not self.cosines:
            return {"rel_l2": None, "cos_mean": None, "cos_min": None, "vectors": 0}
        return {"rel_l2": math.sqrt(self.squared_error / max(self.squared_reference, 1e-300)),
                "cos_mean": sum(self.cosines) / len(self.cosines), "cos_min": min(self.cosines),
                "vectors": len(self.cosines)}


def random_queries(geometry: CacheGeometry, count: int, position: int, gen: torch.Generator,
                   device: torch.device) -> torch.Tensor:
    """Gaussian queries ``[layers, Hq, count, D]``, RoPE applied at ``position`` on the rotated span."""
    g = geometry
    q = torch.randn((g.layers, g.query_heads, count, g.row_dim), generator=gen).to(device)
    if g.rope.rotary_dim:
        q = oracle.apply_rope(q, torch.full(q.shape[:-1], position, device=device), g.omega.to(device), g.rope)
    return q


def calibrated_queries(spec: FamilySpec, seed: int, count: int, position: int, device: torch.device) -> torch.Tensor:
    """Queries ``[layers, Hq, count, D]`` from the distribution the calibration was measured on
    (``synthetic_queries`` with the calibration's seed: the calibration is their mean), rotated at
    ``position``: TriAttention ranks keys by the attention such queries give them."""
    geometry = spec_tri.tri_geometry(spec)
    pairs = oracle.synthetic_queries(geometry, seed, CALIBRATION_QUERIES, CALIBRATION_SPREAD)[..., :count]
    pairs = pairs.permute(0, 1, 3, 2)                           # [L, Hq, count, F]
    rows = torch.zeros(pairs.shape[:3] + (geometry.head_dim,), dtype=torch.float32)
    re, im = oracle.split_pairs(rows, geometry)                         # views into rows
    re.copy_(pairs.real)
    im.copy_(pairs.imag)
    omega, _ = spec_tri.calibration_defaults(spec)
    rows = oracle.apply_rope(rows, torch.full(rows.shape[:-1], position), omega, geometry)
    return rows.to(device)
