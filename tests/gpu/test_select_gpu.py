"""The generated Triton normalize/aggregate/select on the GPU against the oracle, exactly.

Modules: ``generated/<family>/select.py`` of this checkout (the registry's ``select`` artifact is
the same text; a registry built before that op existed lacks it, and the test should not depend on
its age). Triton JIT-compiles the kernels at the first call.

1. Every scorable family and mode (its generated tunables, the scenario's 6 layers), on the
   kernel's scores of tests/gpu/test_score_gpu.py's scenario (widths 300, 0, 517, duplicated K rows: ties): decision values and kept sets equal
   the oracle's functions run on the same device (budgets 1 .. past the widest request).
2. Qwen3-8B-shaped scores of a real round (36 scored layers, 32 query heads, B = 4, widths up to
   16384: many lanes, long sums): statistics, values and kept sets bit-identical, every mode; with
   the shipped tunables and with the other routes (comparison passes, rows read once, histograms,
   statistics and aggregation as one queue).
3. Whole rounds with the generated selection (oracle and generated packer/compactor): pools, kept
   sets and lengths byte-identical to ``eviction_round`` (tests/tri_sim.py), every family of
   test_score_gpu's ROUND_CASES.
4. A NaN score stops the round before anything moves, with the oracle's error.
5. The registry's AOT libraries (``lib<symbol>_select.so``: the same kernels compiled at build
   time, launched through the C ABI, no Triton): every scorable family and mode on full-geometry
   scores with ties and widths that are not a multiple of any tile, bit-identical to the oracle and
   to the JIT kernels (both aggregation routes); whole rounds with them byte-identical to ``eviction_round``; a width past W
   on the device reads nothing outside the row (the values past it are NaN: none is counted); and
   a process in which Triton cannot be imported selects with them.
6. The registry's size-dispatched selection variants: each round goes to the library of its work,
   and both keep the oracle's sets.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from kvgen.artifacts.manifest import RegistryError
from kvgen.kernels.triton.select import TritonSelector
from kvgen.lower.triattention import calibration_defaults, eviction_config, tri_geometry
from kvgen.reference import triattention as T
from kvgen.runtime.eviction import TriAttentionManager
from kvgen.runtime.lookup import RuntimeRegistry
from kvgen.runtime.select import SelectLibrary, Selector, load_select_module
from kvgen.spec.schema import load_spec

from ..conftest import ROOT, SPECS_DIR
from ..tri_sim import DecodeSim, run_against_oracle, save_synthetic_calibration
from .conftest import ARCH, REGISTRY
from .test_score_gpu import FAMILIES, PROMPTS, ROUND_CASES, _backends, scenario, score_library

pytestmark = pytest.mark.gpu


def select_module(family: str) -> Path:
    return ROOT / "generated" / family / "select.py"


def select_library(family: str) -> Path:
    try:
        return RuntimeRegistry([REGISTRY]).resolve(family, ARCH).artifact("select")
    except RegistryError as exc:
        pytest.skip(f"no selection library ({exc}); build it on the CPU machine and carry {REGISTRY}")


def _long(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device="cuda")


def _oracle(scores: torch.Tensor, width: torch.Tensor, mode: str, g) -> torch.Tensor:
    valid = torch.arange(scores.shape[-1], device="cuda")[None, :] < width[:, None]
    return T.aggregate([T.zscore(layer, valid[:, None, :]) for layer in scores], mode, g)


@pytest.mark.parametrize("mode", T.MODES)
@pytest.mark.parametrize("family", [f for f in FAMILIES if select_module(f).exists()])
def test_selection_equals_the_oracle_on_the_kernel_scores(family: str, mode: str) -> None:
    case = scenario(family)
    scores, g = case["scores"], case["manager"].geometry   # the scenario keeps 6 cache layers
    tuned = load_select_module(select_module(family))
    module = TritonSelector(g.num_layers, g.kv_heads, g.group, g.scored_layers, **tuned.SELECTOR.tunables())
    P, width = _long(PROMPTS), _long(case["S"]) - _long(PROMPTS)
    values = _oracle(scores, width, mode, g)
    mean, std = module.statistics(scores, width)
    assert torch.equal(module.aggregate(scores, mean, std, width, mode), values)
    for budget in (1, 100, 300, 600):
        kept = module.decide(scores, width, P, budget, mode).check()
        assert torch.equal(kept, T.select_keep(values, width, budget, P)), f"budget {budget}"


# Routes beside the shipped constants: the comparison passes and 8-warp statistics shipped before
# the fifteenth session, every row read once (16384 resident columns), or the rows wider than 8192
# read twice, and histogram passes of 8 and 4 bits.
ROUTES = {
    "shipped": {},
    "comparisons": {"stats_warps": 8, "select_route": 0, "radix_bits": 4, "block": 512, "select_warps": 4},
    "resident16384-histogram8": {"stats_resident": 16384, "stats_warps": 16, "select_route": 1, "radix_bits": 8,
                                 "block": 4096, "select_warps": 16},
    "resident8192-histogram4": {"stats_resident": 8192, "select_route": 1, "radix_bits": 4, "block": 1024,
                                "select_warps": 8},
    # the queue (statistics and aggregation in one launch, many programs waiting on each other)
    "queue-chunk1": {"aggregate_route": 1, "chunk_requests": 1, "queue_lag": 8, "queue_programs": 4, "block_w": 64},
    # the aggregation's max 8 heads a step (fewer registers: more queue programs resident a SM)
    "queue-lag4-heads8": {"aggregate_route": 1, "chunk_requests": 1, "queue_lag": 4, "queue_programs": 2,
                          "block_w": 256, "head_step": 8},
    "apart-heads4": {"head_step": 4},
    "queue-chunk4-resident": {"aggregate_route": 1, "chunk_requests": 4, "queue_lag": 1, "queue_programs": 1,
                              "block_w": 256, "stats_resident": 16384, "stats_warps": 8},
}


@pytest.mark.parametrize("route", list(ROUTES))
@pytest.mark.parametrize("mode", T.MODES)
def test_round_sized_scores_are_bit_identical(mode: str, route: str) -> None:
    g = tri_geometry(load_spec(SPECS_DIR / "qwen3-8b.yaml"))
    shipped = load_select_module(select_module("qwen3-8b")).SELECTOR
    module = TritonSelector(g.num_layers, g.kv_heads, g.group, g.scored_layers,
                            **{**shipped.tunables(), **ROUTES[route]})
    gen = torch.Generator(device="cuda").manual_seed(5)
    W, widths = 16384, [16384, 9001, 513, 16000]
    scores = torch.randn(len(g.scored_layers), len(widths), g.query_heads, W, device="cuda", generator=gen) * 40 + 7
    width = _long(widths)
    scores = torch.where(torch.arange(W, device="cuda") < width[None, :, None, None], scores, 0).contiguous()
    mean, std = module.statistics(scores, width)
    valid = (torch.arange(W, device="cuda")[None, :] < width[:, None])[None, :, None, :].expand_as(scores)
    wide = torch.where(valid, scores, 0).double()
    count = valid.sum(-1, keepdim=True).clamp(min=1).double()
    ref_mean = T.lane_sum(wide) / count
    dev = torch.where(valid, wide - ref_mean, 0)
    ref_std = (T.lane_sum(dev * dev) / count).sqrt().float().clamp(min=T.STD_FLOOR)
    assert torch.equal(mean, ref_mean.float()[..., 0]) and torch.equal(std, ref_std[..., 0])
    values = _oracle(scores, width, mode, g)
    assert torch.equal(module.aggregate(scores, mean, std, width, mode), values)
    together = module.statistics_aggregate(scores, width, mode)
    assert all(torch.equal(a, b) for a, b in zip(together, (mean, std, values)))
    P = _long([1024] * len(widths))
    for budget in (1, 2048, 9001):
        assert torch.equal(module.decide(scores, width, P, budget, mode).check(), T.select_keep(values, width, budget, P))


@pytest.mark.parametrize("selection", ["jit", "aot"])
@pytest.mark.parametrize("backend", ["oracle", "generated"])
@pytest.mark.parametrize("family,mode,budget,beta", ROUND_CASES)
def test_rounds_with_the_generated_selection_are_byte_identical(tmp_path: Path, family: str, mode: str, budget: int,
                                                                beta: int, backend: str, selection: str) -> None:
    spec = load_spec(SPECS_DIR / f"{family}.yaml")
    prompts, tails, generated = [13, 150, 61, 7], [0, 1, 3, 2], [0, 9, 20, 31]
    steps = budget + 3 * beta + 24
    sim = DecodeSim(eviction_config(spec), prompts, tails, max(prompts) + max(tails) + max(generated) + steps + 8,
                    torch.device("cuda"), seed=23, generated=generated, codebook=24)
    calibration_path = save_synthetic_calibration(eviction_config(spec), tmp_path / "calib.pt", seed=9)
    manager = TriAttentionManager(eviction_config(spec), calibration_path, sim.k_pools, sim.v_pools,
                                  score_library(family), budget=budget, beta=beta, eviction_mode=mode,
                                  select_module=select_module(family) if selection == "jit" else select_library(family),
                                  **_backends(family, sim, backend))
    assert manager.describe()["selection"].endswith("select.py" if selection == "jit" else "_select.so")
    omega, scale = calibration_defaults(spec)
    calibration = T.load_calibration(calibration_path, tri_geometry(spec), omega, scale)
    rounds = run_against_oracle(manager, sim, steps, calibration)
    assert len(rounds) >= 3 and len({tuple(r["due"]) for r in rounds}) > 1


def test_a_nan_score_stops_the_round_before_anything_moves() -> None:
    g = tri_geometry(load_spec(SPECS_DIR / "qwen3-8b.yaml"))
    selector = TritonSelector(g.num_layers, g.kv_heads, g.group, g.scored_layers, rows=2, stats_unroll=1,
                              stats_resident=0, stats_warps=4, block_w=128, aggregate_warps=4, block=512, radix_bits=4,
                              select_route=0, select_warps=4, aggregate_route=0, chunk_requests=1, queue_lag=1,
                              queue_programs=1, head_step=0)
    scores = torch.randn(len(g.scored_layers), 2, g.query_heads, 300, device="cuda")
    scores[3, 1, 5, 17] = float("nan")
    width = _long([300, 200])
    with pytest.raises(ValueError, match="NaN among the decision values"):
        T.select_keep(_oracle(scores, width, "union", g), width, 8, _long([0, 0]))
    with pytest.raises(ValueError, match="NaN among the decision values"):
        selector.decide(scores, width, _long([0, 0]), 8, "union").check()
    scores[3, 1, 5, 17] = 0.0
    scores[3, 1, 5, 250] = float("nan")      # past request 1's width: never read
    selector.decide(scores, width, _long([0, 0]), 8, "union").check()


@pytest.mark.parametrize("mode", T.MODES)
@pytest.mark.parametrize("family", FAMILIES)
def test_the_aot_library_equals_the_oracle_and_the_jit_kernels(family: str, mode: str) -> None:
    library = SelectLibrary(select_library(family), family=family)
    g = tri_geometry(load_spec(SPECS_DIR / f"{family}.yaml"))
    assert (library.num_layers, library.kv_heads, library.group, library.scored_layers) == (
        g.num_layers, g.kv_heads, g.group, tuple(g.scored_layers))
    jit = load_select_module(select_module(family)).SELECTOR
    gen = torch.Generator(device="cuda").manual_seed(11)
    W, widths = 1301, [1301, 0, 777, 1000]
    scores = torch.randn(len(g.scored_layers), len(widths), g.query_heads, W, device="cuda", generator=gen) * 3
    scores = scores.round(decimals=1).contiguous()       # coarse values: many ties
    width, P = _long(widths), _long([64, 0, 9, 4096])
    values = _oracle(scores, width, mode, g)
    mean, std = library.statistics(scores, width)
    assert all(torch.equal(a, b) for a, b in zip((mean, std), jit.statistics(scores, width)))
    assert torch.equal(library.aggregate(scores, mean, std, width, mode), values)
    assert all(torch.equal(a, b) for a, b in zip(library.statistics_aggregate(scores, width, mode), (mean, std, values)))
    assert library.queue_work_ints(mode, len(widths), W) == library._lib.kvgen_select_queue_work_ints(
        T.MODES.index(mode), len(widths), W)
    for budget in (1, 333, 1300):
        kept = library.decide(scores, width, P, budget, mode).check()
        assert torch.equal(kept, T.select_keep(values, width, budget, P)), f"budget {budget}"
        assert torch.equal(kept, jit.decide(scores, width, P, budget, mode).check())


def test_size_dispatched_selection_keeps_the_oracles_sets() -> None:
    """The registry's selection variants (kvgen.artifacts.dispatch; qwen3-8b ships one for large
    rounds): a round of at least the threshold's requests x columns goes to the variant library,
    a smaller one to the main library; both keep exactly the oracle's sets in every mode."""
    family = "qwen3-8b"
    try:
        files = RuntimeRegistry([REGISTRY]).resolve(family, ARCH).dispatch("select")
    except RegistryError as exc:
        pytest.skip(f"no selection library ({exc}); build it on the CPU machine and carry {REGISTRY}")
    if not files[1]:
        pytest.skip(f"{REGISTRY} lists no selection variant of {family} (built before tuning/sm_90a/{family}.json had one)")
    selector = Selector(files, family=family)
    g = tri_geometry(load_spec(SPECS_DIR / f"{family}.yaml"))
    (threshold,) = selector.thresholds
    gen = torch.Generator(device="cuda").manual_seed(12)
    for batch, W, serves in ((1, 3000, selector.module), (-(-threshold // 9000), 9000, selector.variants[0])):
        assert selector.module_for(batch, W) is serves
        widths = [W - 7 * b for b in range(batch)]     # none a multiple of a tile
        scores = (torch.randn(len(g.scored_layers), batch, g.query_heads, W, device="cuda", generator=gen) * 3)
        scores = scores.round(decimals=1).contiguous()   # coarse values: many ties
        S = [w + 5 for w in widths]
        for mode in T.MODES:
            kept = selector(scores, [5] * batch, S, 1000, mode).check()
            width = _long(widths)
            assert torch.equal(kept, T.select_keep(_oracle(scores, width, mode, g), width, 1000, _long([5] * batch))), (
                f"B={batch} W={W} {mode}")


def test_the_aot_library_reads_nothing_past_a_row() -> None:
    """A device width past W counts as W: the NaN beyond each row's end is never read."""
    family = "qwen3-8b"
    library = Selector(select_library(family), family=family).module
    g = tri_geometry(load_spec(SPECS_DIR / f"{family}.yaml"))
    W = 300
    padded = torch.full((len(g.scored_layers), 2, g.query_heads, W + 64), float("nan"), device="cuda")
    padded[..., :W] = torch.randn(len(g.scored_layers), 2, g.query_heads, W, device="cuda")
    storage = padded.flatten()
    scores = storage[: padded[..., :W].numel()].view(len(g.scored_layers), 2, g.query_heads, W)
    scores.copy_(padded[..., :W])
    honest, liar = _long([W, W]), _long([W, 10 * W])
    assert all(torch.equal(a, b) for a, b in zip(library.statistics(scores, liar), library.statistics(scores, honest)))
    assert all(torch.equal(a, b) for a, b in zip(library.statistics_aggregate(scores, liar, "per_head"),
                                                  library.statistics_aggregate(scores, honest, "per_head")))
    assert torch.equal(library.decide(scores, liar, _long([0, 0]), 8, "union").check(),
                       library.decide(scores, honest, _long([0, 0]), 8, "union").check())


def test_the_aot_library_needs_no_triton() -> None:
    library = select_library("qwen3-8b")
    code = textwrap.dedent(f"""
        import sys
        sys.modules["triton"] = None          # any import of Triton now fails
        import torch
        from kvgen.runtime.select import Selector
        selector = Selector({str(library)!r}, family="qwen3-8b")
        scores = torch.randn(36, 2, 32, 700, device="cuda")
        kept = selector(scores, [0, 5], [700, 400], 64, "per_head").check()
        assert kept.shape == (2, 8, 64) and bool((kept[1] < 400).all()), kept
        print("selected without Triton")
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert result.returncode == 0 and "selected without Triton" in result.stdout, result.stderr[-3000:]
