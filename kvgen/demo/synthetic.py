"""Geometry of a cache family as the scenario needs it, and synthetic K/V shaped like a real cache:
outlier channels, K rotated by RoPE at its real positions (one generator for every family)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvgen.demo.config import DemoError
from kvgen.lower import triattention as spec_tri
from kvgen.lower.layout import FamilyLayout
from kvgen.reference import triattention as oracle
from kvgen.reference.codec import HOT_TORCH_DTYPES
from kvgen.spec.schema import FamilySpec


@dataclass(frozen=True)
class RopeSpan:
    """The rotated span of a row (duck-types the fields of ``TriGeometry`` that ``split_pairs``
    and ``apply_rope`` read, so MLA latents, which ``TriGeometry`` refuses, rotate the same way)."""

    rotary_start: int
    rotary_dim: int
    pairing: str

    @property
    def freqs(self) -> int:
        return self.rotary_dim // 2


@dataclass(frozen=True)
class CacheGeometry:
    family: str
    attention: str
    layers: int
    query_heads: int
    kv_heads: int            # 1 for an MLA latent
    row_dim: int             # K/V head_dim, or the latent width
    value_dim: int           # width of the attention values: head_dim, or kv_lora_rank for MLA
    tokens_per_block: int
    layout: str              # HND | NHD
    dtype: str
    buffers: tuple[str, ...]  # quantized buffers of a layer, in codec order (k, v) or (latent,)
    rope: RopeSpan
    omega: torch.Tensor      # float32 [F], RoPE angular frequencies (HF inv_freq, scaling applied)

    @classmethod
    def from_spec(cls, spec: FamilySpec, layout: FamilyLayout) -> CacheGeometry:
        if layout.record.sides:
            raise DemoError(f"{spec.name}: side buffers are not part of this demo")
        rotary = spec.rotary_dim
        start = spec.row_dim - rotary if spec.rope.placement == "trailing" else 0
        value_dim = spec.mla.kv_lora_rank if spec.attention == "mla" and spec.mla else spec.row_dim
        return cls(family=spec.name, attention=spec.attention, layers=spec.layers, query_heads=spec.query_heads,
                   kv_heads=spec.kv_heads, row_dim=spec.row_dim, value_dim=value_dim,
                   tokens_per_block=spec.tokens_per_block, layout=spec.layout, dtype=spec.dtype,
                   buffers=tuple(b.name for b in layout.record.buffers),
                   rope=RopeSpan(start, rotary, spec.rope.pairing),
                   omega=oracle.rope_omega(rotary, spec.rope.theta, spec_tri.rope_scaling(spec)))

    @property
    def page_shape(self) -> tuple[int, int, int]:
        if self.layout == "HND":
            return self.kv_heads, self.tokens_per_block, self.row_dim
        return self.tokens_per_block, self.kv_heads, self.row_dim

    @property
    def torch_dtype(self) -> torch.dtype:
        return HOT_TORCH_DTYPES[self.dtype]

    @property
    def softmax_scale(self) -> float:
        # 1/sqrt(width of the dot product): head_dim for GQA, the latent width for MLA's absorbed form.
        return 1.0 / math.sqrt(self.row_dim)

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.tokens_per_block)


def to_pages(rows: torch.Tensor, geometry: CacheGeometry) -> torch.Tensor:
    """``[Hkv, T, D]`` token rows (T a multiple of the page size) -> ``[pages, *page_shape]``."""
    heads, tokens, width = rows.shape
    pages = tokens // geometry.tokens_per_block
    paged = rows.reshape(heads, pages, geometry.tokens_per_block, width)
    if geometry.layout == "HND":
        return paged.permute(1, 0, 2, 3).contiguous()
    return paged.permute(1, 2, 0, 3).contiguous()


def from_pages(pages: torch.Tensor, geometry: CacheGeometry) -> torch.Tensor:
    """Inverse of ``to_pages``: ``[pages, *page_shape]`` -> ``[Hkv, pages * tokens_per_block, D]``."""
    if geometry.layout == "HND":
        rows = pages.permute(1, 0, 2, 3)
    else:
        rows = pages.permute(2, 0, 1, 3)
    return rows.reshape(geometry.kv_heads, -1, geometry.row_dim)



OUTLIER_SCALE = (10.0, 50.0)
ROTATED_OUTLIER_PAIRS = 2     # per (layer, head): massive values sit in low-frequency RoPE pairs
PLAIN_OUTLIER_CHANNELS = 2    # per (layer, head): outlier channels of V (and the latent's non-RoPE part)
CHANNEL_MEAN_STD = 0.5        # channels have a small per-channel mean, as real K/V do


def _pair_elements(span: RopeSpan, freqs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row indices of the two elements of RoPE pairs ``freqs`` (half: f, f+F; interleaved: 2f, 2f+1)."""
    if span.pairing == "half":
        return span.rotary_start + freqs, span.rotary_start + freqs + span.freqs
    return span.rotary_start + 2 * freqs, span.rotary_start + 2 * freqs + 1


def channel_statistics(geometry: CacheGeometry, rotated: bool, gen: torch.Generator
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per (layer, head, channel) mean and std of one buffer: a property of the model, not of a request.

    Channels of the rotated span (K, the latent's RoPE part) get ``ROTATED_OUTLIER_PAIRS`` outlier
    pairs among the lowest-frequency quarter of the pairs, with a large consistent magnitude (mean
    10-50, phase fixed per pair, std a quarter of it): the "massive values" of K sit in slowly
    rotating pairs in real models. Other channels (V, the latent's non-RoPE part) get
    ``PLAIN_OUTLIER_CHANNELS`` channels whose std is 10-50x.
    """
    shape = (geometry.layers, geometry.kv_heads, geometry.row_dim)
    mean = torch.randn(shape, generator=gen) * CHANNEL_MEAN_STD
    std = torch.ones(shape)
    span = geometry.rope if rotated else RopeSpan(0, 0, "half")
    inside = torch.zeros(geometry.row_dim, dtype=torch.bool)
    inside[span.rotary_start:span.rotary_start + span.rotary_dim] = True
    plain = torch.nonzero(~inside).flatten()
    low, high = OUTLIER_SCALE
    for layer in range(geometry.layers):
        for head in range(geometry.kv_heads):
            if span.rotary_dim:
                slow = torch.arange(span.freqs - max(span.freqs // 4, ROTATED_OUTLIER_PAIRS), span.freqs)
                freqs = slow[torch.randperm(slow.numel(), generator=gen)[:ROTATED_OUTLIER_PAIRS]]
                size = low + (high - low) * torch.rand(freqs.numel(), generator=gen)
                phase = torch.rand(freqs.numel(), generator=gen) * 2 * math.pi
                a, b = _pair_elements(span, freqs)
                mean[layer, head, a], mean[layer, head, b] = size * phase.cos(), size * phase.sin()
                std[layer, head, a], std[layer, head, b] = size / 4, size / 4
            if plain.numel():
                channels = plain[torch.randperm(plain.numel(), generator=gen)[:PLAIN_OUTLIER_CHANNELS]]
                std[layer, head, channels] = low + (high - low) * torch.rand(channels.numel(), generator=gen)
    return mean, std


class KVGenerator:
    """Deterministic synthetic cache of a family: the same (request seed, length) gives the same
    bytes every time, so a request's original K/V can be regenerated to check what came back."""

    def __init__(self, geometry: CacheGeometry, seed: int, device: torch.device):
        self.geometry = geometry
        self.device = device
        self.seed = seed
        gen = torch.Generator().manual_seed(seed * 1_000_003 + sum(map(ord, geometry.family)))
        # K and the latent carry RoPE; V never does (COLD_PAGE_FORMAT.md §1).
        self.stats = {name: tuple(t.to(device) for t in channel_statistics(geometry, name != "v", gen))
                      for name in geometry.buffers}

    def tokens(self, request_seed: int, count: int) -> dict[str, torch.Tensor]:
        """``{buffer: [layers, Hkv, count, D]}`` in the hot dtype, token ``t`` rotated at position ``t``."""
        g = self.geometry
        gen = torch.Generator(device=self.device).manual_seed(self.seed * 7919 + request_seed)
        positions = torch.arange(count, device=self.device).expand(g.kv_heads, count)
        out = {}
        for name in g.buffers:
            mean, std = self.stats[name]
            layers = []
            for layer in range(g.layers):
                noise = torch.randn((g.kv_heads, count, g.row_dim), generator=gen, device=self.device)
                x = mean[layer][:, None, :] + std[layer][:, None, :] * noise
                if name != "v" and g.rope.rotary_dim:
                    x = oracle.apply_rope(x, positions, g.omega.to(self.device), g.rope)
                layers.append(x.to(g.torch_dtype))
            out[name] = torch.stack(layers)
        return out

    def paged(self, request_seed: int, count: int) -> dict[str, torch.Tensor]:
        """``{buffer: [layers, pages, *page_shape]}``; rows past ``count`` in the last page are zero."""
        g = self.geometry
        padded = g.pages_for(count) * g.tokens_per_block
        out = {}
        for name, rows in self.tokens(request_seed, count).items():
            full = rows.new_zeros(rows.shape[:2] + (padded, g.row_dim))
            full[:, :, :count] = rows
            out[name] = torch.stack([to_pages(full[layer], g) for layer in range(g.layers)])
        return out
