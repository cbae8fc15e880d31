"""The TriAttention selection workload: normalize, aggregate (union) and select of B due requests'
scores, checked bit for bit against the oracle (``zscore``, ``aggregate``, ``select_keep``) in
every eviction mode."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from kvgen.measure.timing import rotation_sets
from kvgen.measure.workloads.base import Failure, Inputs, launch, loading, timed
from kvgen.reference import triattention as T
from kvgen.reference.triattention import TriGeometry
from kvgen.runtime.select import Selector

# Small enough for the oracle, wide enough for a two-step resident row (512 lanes) and a partial
# selection block, with a request shorter than the rest.
CHECK_WIDTHS = (1100, 613)
CHECK_BUDGETS = (1, 300)
MODE = "union"   # the bench's mode: one decision row a request


def scores_for(geometry: TriGeometry, widths: list[int], W: int, generator: torch.Generator) -> torch.Tensor:
    """Scores ``[scored, B, Hq, W]`` as the scorer leaves them: random in the valid columns (some
    repeated: ties), 0 past each request's width."""
    shape = (len(geometry.scored_layers), len(widths), geometry.query_heads, W)
    scores = torch.randn(shape, device="cuda", generator=generator) * 3 + 1
    scores[..., 1::7] = scores[..., ::7][..., : scores[..., 1::7].shape[-1]]
    width = torch.tensor(widths, device="cuda")
    return torch.where(torch.arange(W, device="cuda") < width[None, :, None, None], scores, 0).contiguous()


class SelectWorkload:
    """One round's selection for B requests of ``width`` decode tokens keeping ``budget``; size
    ``{"batch", "width", "budget"}``; a selection library of the family."""

    op = "select"

    def __init__(self, family: str, geometry: TriGeometry):
        self.family, self.geometry = family, geometry

    def load(self, path: Path) -> Selector:
        """The library, refused ("load") when it was built for another family."""
        return loading(lambda: Selector(path, self.family))

    def inputs(self, size: dict[str, Any], seed: int) -> Inputs:
        batch, width, budget = int(size["batch"]), int(size["width"]), int(size["budget"])
        gen = torch.Generator(device="cuda").manual_seed(seed)
        one = scores_for(self.geometry, [width] * batch, width, gen)
        copies = rotation_sets(one.numel() * one.element_size())
        sets = [one] + [scores_for(self.geometry, [width] * batch, width, gen) for _ in range(copies - 1)]
        return Inputs(sets, {"batch": batch, "width": width, "budget": budget, "rotation": len(sets)})

    def check(self, selector: Selector, seed: int) -> None:
        """Kept positions bit-identical to the oracle's in every mode and budget."""
        gen = torch.Generator(device="cuda").manual_seed(seed)
        widths = list(CHECK_WIDTHS)
        scores = scores_for(self.geometry, widths, max(widths), gen)
        width = torch.tensor(widths, device="cuda")
        P = torch.zeros(len(widths), dtype=torch.int64, device="cuda")
        valid = torch.arange(scores.shape[-1], device="cuda")[None, :] < width[:, None]
        z = [T.zscore(layer, valid[:, None, :]) for layer in scores]
        for mode in T.MODES:
            values = T.aggregate(z, mode, self.geometry)
            for budget in CHECK_BUDGETS:
                got = []
                launch(lambda m=mode, b=budget: got.append(selector.module.decide(scores, width, P, b, m).check()))
                if not torch.equal(got[0], T.select_keep(values, width, budget, P)):
                    raise Failure("wrong", f"{mode}, budget {budget}: kept positions differ from the oracle")

    def time(self, selector: Selector, inputs: Inputs, reps: int) -> dict[str, float]:
        budget, batch = inputs.size["budget"], inputs.size["batch"]
        width = torch.full((batch,), inputs.size["width"], dtype=torch.int64, device="cuda")
        P = torch.zeros(batch, dtype=torch.int64, device="cuda")
        calls = [lambda s=scores: selector.module.decide(s, width, P, budget, MODE) for scores in inputs.sets]
        return timed(calls, reps)
