"""The TriAttention scoring workload: the score library over every scored layer of B requests of
``width`` decode tokens, checked against the float64 oracle (``kvgen.reference.triattention.score_paged``)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvgen.measure.timing import rotation_sets
from kvgen.measure.workloads.base import Failure, Inputs, launch, loading, timed
from kvgen.reference.triattention import TriGeometry, mean_phase_table, score_paged, synthetic_calibration
from kvgen.runtime.score import TORCH_DTYPES, ScoreLibrary

PROMPT = 1024
CHECK_BATCH, CHECK_WIDTH = 2, 300
# float32 accumulation over <= 128 frequencies is ~1e-6 relative; a wrong index is O(1)
CHECK_TOLERANCE = 1e-4


@dataclass(frozen=True)
class ScoreFamily:
    """What scoring needs of a family: its TriAttention geometry, K dtype and RoPE (theta, scaling)."""

    name: str
    geometry: TriGeometry
    dtype: str
    rope_theta: float
    rope_scaling: dict[str, Any] | None = None


def random_pool(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Standard-normal values in ``dtype`` (fp8 E4M3 pools: rounded from float32, as an fp8 cache is
    filled; ``normal_`` has no fp8 kernel)."""
    if dtype.itemsize == 1:
        return torch.empty(shape, device="cuda").normal_().to(dtype)
    return torch.empty(shape, dtype=dtype, device="cuda").normal_()


def shared_pools(layers: list[int], own: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
    """Every layer's pool: its own where it has one, else the i-th layer's (round robin)."""
    first = list(own.values())
    return {layer: own.get(layer, first[i % len(first)]) for i, layer in enumerate(layers)}


class ScoreCache:
    """K (and optionally V) pools of a family for B requests of ``PROMPT + width`` tokens, pages
    scattered by a random page table, a synthetic calibration, and everything the kernel takes."""

    def __init__(self, family: ScoreFamily, batch: int, width: int, all_layers: bool = False, with_v: bool = False,
                 only_layer: int | None = None, own_layers: int | None = None):
        """``own_layers`` (with ``all_layers``): only the first that many layers get pools; layer i
        uses layer ``i % own_layers``'s, so a cache larger than the GPU still moves every layer's
        bytes (each layer's K is far larger than the L2: no layer finds another's in it)."""
        self.family = family
        g = self.geometry = family.geometry
        self.batch, self.width = batch, width
        dtype = TORCH_DTYPES[family.dtype]
        per_request = math.ceil((PROMPT + width) / g.tokens_per_block)
        pages = batch * per_request
        layers = list(range(g.num_layers) if all_layers else g.scored_layers)
        if only_layer is not None:
            layers = [only_layer]
        own = layers[:own_layers] if own_layers is not None else layers
        shape = (pages, *g.page_shape)
        self.k_pools = shared_pools(layers, {layer: random_pool(shape, dtype) for layer in own})
        self.v_pools = shared_pools(layers, {layer: random_pool(shape, dtype) for layer in own}) if with_v else {}
        self.page_table = torch.randperm(pages, device="cuda").to(torch.int32).reshape(batch, per_request)
        self.calibration = synthetic_calibration(g, seed=0, theta=family.rope_theta, scaling=family.rope_scaling)
        self.P = [PROMPT] * batch
        self.S = [PROMPT + width] * batch

    def k_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.k_pools.values())

    def kernel_inputs(self) -> dict:
        g, calib = self.geometry, self.calibration
        scored = list(g.scored_layers)
        e_q = calib.E_q[scored].cuda()
        qr, qi = e_q.real.float().contiguous(), e_q.imag.float().contiguous()
        cos_rows, sin_rows = mean_phase_table(calib.omega.cuda(), PROMPT + self.width + 1)
        L = torch.tensor(self.S, device="cuda")
        return {
            "k_layer_ptrs": torch.tensor([self.k_pools[layer].data_ptr() for layer in scored], dtype=torch.int64,
                                         device="cuda"),
            "page_stride": self.k_pools[scored[0]].stride(0),
            "num_pages": self.k_pools[scored[0]].shape[0],
            "page_table": self.page_table,
            "P": torch.tensor(self.P, dtype=torch.int32, device="cuda"),
            "S": torch.tensor(self.S, dtype=torch.int32, device="cuda"),
            "c": cos_rows[L].contiguous(), "d": sin_rows[L].contiguous(), "qr": qr, "qi": qi,
            "mlr": (calib.E_q_norm[scored].cuda() - torch.hypot(qr, qi)).contiguous(),
            "freq_scale_sq": calib.freq_scale_sq.cuda(),
            "scores": torch.empty((len(scored), self.batch, g.query_heads, self.width), device="cuda"),
        }


def oracle_mismatch(cache: ScoreCache, inputs: dict) -> str | None:
    """Where the kernel's scores (``inputs["scores"]``, ``inputs`` from ``cache.kernel_inputs()``)
    leave the float64 oracle by more than ``CHECK_TOLERANCE`` x the largest |score|; None when
    every scored layer is within it."""
    g = cache.geometry
    zeros = torch.zeros(cache.batch, dtype=torch.long, device="cuda")
    for index, layer in enumerate(g.scored_layers):
        pool = cache.k_pools[layer]
        pool = pool.float() if pool.element_size() == 1 else pool   # fp8 widens exactly; no fp8 gathers needed
        ref, _ = score_paged(pool, cache.page_table, inputs["P"], inputs["S"], zeros,
                             cache.calibration, layer, g, torch.float64)
        err = (inputs["scores"][index].double() - ref).abs().max()
        if not bool(err <= CHECK_TOLERANCE * ref.abs().max().clamp(min=1e-30)):
            return f"layer {layer}: max error {float(err):.3g} vs max |score| {float(ref.abs().max()):.3g}"
    return None


class ScoreWorkload:
    """The scorer over every scored layer; size ``{"batch", "width"}``, whole caches rotated."""

    op = "score"

    def __init__(self, family: ScoreFamily):
        self.family = family

    def load(self, path: Path) -> ScoreLibrary:
        # tuning candidates are not published: no sidecar sha256 to verify against
        return loading(lambda: ScoreLibrary(path, family=self.family.name))

    def inputs(self, size: dict[str, Any], seed: int) -> Inputs:
        torch.manual_seed(seed)
        sets = []
        while True:   # rotate whole caches: one B=1 cache is a few hundred MB at most
            cache = ScoreCache(self.family, size["batch"], size["width"])
            sets.append((cache, cache.kernel_inputs()))
            if len(sets) >= rotation_sets(cache.k_bytes()):
                break
        return Inputs(sets, {"batch": size["batch"], "width": size["width"], "rotation": len(sets)})

    def check(self, library: ScoreLibrary, seed: int) -> None:
        """Scores of 2 fresh requests within ``CHECK_TOLERANCE`` x the largest |score| of the oracle."""
        torch.manual_seed(seed)
        cache = ScoreCache(self.family, CHECK_BATCH, CHECK_WIDTH)
        inputs = cache.kernel_inputs()
        launch(lambda: library.score(**inputs))
        why = oracle_mismatch(cache, inputs)
        if why:
            raise Failure("wrong", why)

    def time(self, library: ScoreLibrary, inputs: Inputs, reps: int) -> dict[str, float]:
        calls = [lambda kernel_inputs=kernel_inputs: library.score(**kernel_inputs)
                 for _, kernel_inputs in inputs.sets]
        return timed(calls, reps)
