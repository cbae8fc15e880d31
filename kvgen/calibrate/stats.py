"""Running sums of pre-RoPE query pairs, turned into the oracle's ``Calibration`` (TRIATTENTION.md §1).

A forward hook hands ``QueryStats.add`` the queries of one layer, ``[..., Hq, head_dim]`` in any
float dtype; the pairs are cut with the oracle's pair rule (``split_pairs``), so half and
interleaved pairing and partial rotary follow the spec's geometry. Sums are float64 on the model's
device and no query is kept, so the text can be as long as the forward passes allow:

- ``E_q[l, h, f]`` = mean over tokens of ``re + i·im`` (stored complex64);
- ``E_q_norm[l, h, f]`` = mean over tokens of ``hypot(re, im)`` (stored float32).

Every token of every forward pass counts once in every layer.
"""

from __future__ import annotations

import torch

from kvgen.calibrate.model import CalibrateError
from kvgen.reference.triattention import Calibration, TriGeometry, split_pairs


class QueryStats:
    """Per (layer, query head, frequency) sums of the pre-RoPE query pair and its magnitude."""

    def __init__(self, geometry: TriGeometry, device: torch.device | str) -> None:
        self.geometry = geometry
        shape = (geometry.num_layers, geometry.query_heads, geometry.freqs)
        self.sum_re = torch.zeros(shape, dtype=torch.float64, device=device)
        self.sum_im = torch.zeros_like(self.sum_re)
        self.sum_abs = torch.zeros_like(self.sum_re)
        self.tokens = [0] * geometry.num_layers

    def add(self, layer: int, queries: torch.Tensor) -> None:
        """Add the queries ``[..., Hq, head_dim]`` (or ``[..., Hq * head_dim]``) of ``layer``."""
        g = self.geometry
        rows = queries.detach().reshape(-1, g.query_heads, g.head_dim).to(device=self.sum_re.device,
                                                                          dtype=torch.float64)
        re, im = split_pairs(rows, g)
        self.sum_re[layer] += re.sum(dim=0)
        self.sum_im[layer] += im.sum(dim=0)
        self.sum_abs[layer] += torch.hypot(re, im).sum(dim=0)
        self.tokens[layer] += rows.shape[0]

    def calibration(self, omega: torch.Tensor, freq_scale_sq: torch.Tensor) -> Calibration:
        """The means, on the CPU; every layer must have seen the same tokens, and finite queries."""
        if len(set(self.tokens)) != 1 or self.tokens[0] == 0:
            raise CalibrateError(f"queries seen per layer: {self.tokens}; every layer must see every token once "
                                 "(did a forward pass skip a layer's q_proj/q_norm?)")
        count = self.tokens[0]
        e_q = torch.complex(self.sum_re / count, self.sum_im / count).to(torch.complex64).cpu()
        e_q_norm = (self.sum_abs / count).to(torch.float32).cpu()
        bad = ~(torch.isfinite(e_q.real) & torch.isfinite(e_q.imag) & torch.isfinite(e_q_norm))
        if bool(bad.any()):
            layer = int(bad.nonzero()[0, 0])
            raise CalibrateError(f"layer {layer}: non-finite query statistics (the model produced inf or nan "
                                 "queries; try --dtype float32)")
        return Calibration(e_q, e_q_norm, omega.to(torch.float32).cpu(), freq_scale_sq.to(torch.float32).cpu())
