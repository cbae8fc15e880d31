"""The generated Triton normalize/aggregate/select (kvgen/kernels/triton/select.py) against the oracle.

Exact: the statistics (mean, floored std) of ``zscore``, the decision values of ``aggregate`` and
the kept positions of ``select_keep`` must be bit-identical (``torch.equal``; values compare -0.0
equal to +0.0, which select treats as one key). The kernels run under Triton's interpreter in one
worker subprocess (the interpreter must be on before triton is imported; see
tests/test_pack_triton.py); this process only builds the cases, runs the oracle and compiles the
kernels for sm_90/sm_100 with the real compiler.

Cases, small enough for the interpreter: a 3-layer geometry with a sliding middle layer (2 KV
heads, group 2), every mode; widths that are not multiples of the selection block (64) or of the
reduction lanes (512), a request with no valid column, budgets of 1, inside and past the valid
width; scores rounded to one decimal (many exact ties); seeded random shapes (hypothesis-style,
without hypothesis' shrinking: every example must pass); adversarial decision values for select
alone: all ties, -0.0 against +0.0, valid -inf and +inf, NaN in a valid column (the error) and in
an invalid one (no error).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvgen.kernels import selection as host
from kvgen.kernels.triton import select as kernels
from kvgen.lower.plan import plans_for
from kvgen.reference import triattention as T
from kvgen.reference.triattention import TriGeometry
from kvgen.render.source import render
from kvgen.runtime.select import SelectModuleError, Selector, check_round, import_select_module
from kvgen.spec.schema import load_spec

from .interpreter import interpret

ROOT = Path(__file__).resolve().parents[1]
TUNABLES = {"rows": 2, "stats_unroll": 2, "stats_resident": 0, "stats_warps": 4, "block_w": 64, "aggregate_warps": 2,
            "block": 64, "radix_bits": 4, "select_route": 0, "select_warps": 4, "aggregate_route": 0,
            "chunk_requests": 1, "queue_lag": 1, "queue_programs": 1, "head_step": 0}
# Tunables that must give the same bits: rows read once where they fit (the wide case's 1100
# columns fall back to two reads under 512 resident columns and are held whole under 2048), the
# histogram passes, with 256 digits and with fewer digits than a warp has lanes, and statistics
# and aggregation as one queue (chunks of 2 requests: a batch of 3 ends in half a chunk; a lag of
# 2 chunks, more than some cases have; the two-launch aggregation is the other routes'), and the
# aggregation's max taken a few heads a step (2: the queue's; 1: one head a step; steps past a
# group of 3 heads are half dead).
ROUTES = {
    "two-reads-comparisons": TUNABLES,
    "resident-histogram8-queue": {**TUNABLES, "rows": 1, "stats_resident": 512, "radix_bits": 8, "select_route": 1,
                                  "select_warps": 8, "aggregate_route": 1, "chunk_requests": 2, "queue_lag": 2,
                                  "queue_programs": 2, "head_step": 2},
    "resident-histogram2": {**TUNABLES, "stats_resident": 2048, "radix_bits": 2, "select_route": 1, "head_step": 1},
}


def _geometry(num_layers: int = 3, kv_heads: int = 2, group: int = 2, swa=(None, 8, None)) -> TriGeometry:
    return TriGeometry(num_layers=num_layers, query_heads=kv_heads * group, kv_heads=kv_heads, head_dim=64,
                       rotary_start=0, rotary_dim=64, pairing="half", tokens_per_block=16, layout="HND",
                       swa_window=tuple(swa))


def _scores(g: TriGeometry, width: list[int], W: int, seed: int, decimals: int | None = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    scores = torch.randn(len(g.scored_layers), len(width), g.query_heads, W, generator=gen) * 3
    if decimals is not None:
        scores = scores.round(decimals=decimals)
    valid = torch.arange(W)[None, :] < torch.tensor(width)[:, None]
    return torch.where(valid[None, :, None, :], scores, 0).contiguous()   # the scorer writes 0 past the width


def _decide_cases() -> list[dict]:
    cases = []
    g = _geometry()
    for mode in T.MODES:
        for budget in (1, 40, 120):
            cases.append({"id": f"{mode}-b{budget}", "geometry": g, "mode": mode, "budget": budget,
                          "width": [150, 0, 77], "P": [5, 9, 100], "scores": _scores(g, [150, 0, 77], 150, 7)})
    cases.append({"id": "wide-rows", "geometry": g, "mode": "union", "budget": 300, "width": [1100, 613],
                  "P": [0, 7], "scores": _scores(g, [1100, 613], 1100, 11, decimals=None)})
    constant = torch.full((len(g.scored_layers), 2, g.query_heads, 70), 2.5)
    cases.append({"id": "constant-rows", "geometry": g, "mode": "per_head", "budget": 16, "width": [70, 33],
                  "P": [0, 3], "scores": constant})
    gen = torch.Generator().manual_seed(2026)
    for example in range(6):   # random shapes, continuous and tied scores
        layers = int(torch.randint(1, 4, (1,), generator=gen))
        kv_heads, group = int(torch.randint(1, 3, (1,), generator=gen)), int(torch.randint(1, 4, (1,), generator=gen))
        swa = [None if int(torch.randint(0, 3, (1,), generator=gen)) else 8 for _ in range(layers)]
        swa[0] = None
        geo = _geometry(layers, kv_heads, group, swa)
        batch = int(torch.randint(1, 4, (1,), generator=gen))
        W = int(torch.randint(1, 200, (1,), generator=gen))
        width = [int(torch.randint(0, W + 1, (1,), generator=gen)) for _ in range(batch)]
        cases.append({"id": f"random-{example}", "geometry": geo, "mode": T.MODES[example % 3],
                      "budget": int(torch.randint(1, W + 20, (1,), generator=gen)), "width": width,
                      "P": [int(torch.randint(0, 50, (1,), generator=gen)) for _ in range(batch)],
                      "scores": _scores(geo, width, W, example, decimals=None if example % 2 else 0)})
    return cases


def _select_cases() -> list[dict]:
    inf, nan = float("inf"), float("nan")
    row = [1.0, 3.0, -0.0, 3.0, 0.0, -inf, 3.0, inf, -0.0, 0.0] * 13    # 130 columns, ties in every value
    cases = [
        {"id": "all-ties", "values": torch.full((2, 1, 130), 0.5), "width": [130, 97], "budget": 64},
        {"id": "signed-zeros-infs", "values": torch.tensor([[row], [row[::-1]]]), "width": [130, 129], "budget": 70},
        {"id": "budget-past-width", "values": torch.tensor([[row]]), "width": [11], "budget": 40},
        {"id": "one-column", "values": torch.tensor([[row]]), "width": [1], "budget": 1},
        {"id": "only-neg-inf", "values": torch.full((1, 2, 65), -inf), "width": [65], "budget": 64},
    ]
    with_nan = torch.tensor([[row]]).clone()
    with_nan[0, 0, 100] = nan
    cases.append({"id": "nan-valid", "values": with_nan, "width": [101], "budget": 5})
    cases.append({"id": "nan-invalid", "values": with_nan, "width": [100], "budget": 5})
    for case in cases:
        case["P"] = [3 * b for b in range(case["values"].shape[0])]
    return cases


DECIDE = _decide_cases()
SELECT = _select_cases()

WORKER = r"""
import sys, torch
from kvgen.kernels.triton.select import TritonSelector
decide, select, tunables = torch.load(sys.argv[1], weights_only=False)
out = {}
def long(values):
    return torch.tensor(values, dtype=torch.int64)
for case in decide:
    g = case["geometry"]
    s = TritonSelector(g.num_layers, g.kv_heads, g.group, g.scored_layers, **tunables)
    width = long(case["width"])
    if s.aggregate_route:
        mean, std, values = s.statistics_aggregate(case["scores"], width, case["mode"])
    else:
        mean, std = s.statistics(case["scores"], width)
        values = s.aggregate(case["scores"], mean, std, width, case["mode"])
    sel = s.select(values, width, case["budget"], long(case["P"]))
    out[case["id"]] = (mean, std, values, sel.kept, sel.nan_rows)
s = TritonSelector(1, 1, 1, (0,), **tunables)
for case in select:
    sel = s.select(case["values"].contiguous(), long(case["width"]), case["budget"], long(case["P"]))
    try:
        kept = sel.check()
    except ValueError as exc:
        kept = str(exc)
    out[case["id"]] = kept
torch.save(out, sys.argv[2])
"""


@pytest.fixture(scope="module", params=list(ROUTES))
def interpreted(request: pytest.FixtureRequest, tmp_path_factory) -> dict:
    work = tmp_path_factory.mktemp("select_worker")
    torch.save((DECIDE, SELECT, ROUTES[request.param]), work / "cases.pt")
    interpret(WORKER, str(work / "cases.pt"), str(work / "out.pt"))
    return torch.load(work / "out.pt", weights_only=False)


ROUND_WORKER = r"""
import sys
from pathlib import Path
import torch
from kvgen.lower.plan import plans_for
from kvgen.lower.triattention import eviction_config
from kvgen.render.source import render
from kvgen.runtime.eviction import TriAttentionManager
from kvgen.spec.schema import load_spec
from tests.test_triattention_runtime import _scorer
from tests.tri_sim import DecodeSim, run_against_oracle, save_synthetic_calibration, small_spec
root, tmp = Path(sys.argv[1]), Path(sys.argv[2])
spec = small_spec(load_spec(root / "specs" / "gpt-oss-20b.yaml"), 4)
module = tmp / "select.py"
# wide tiles: the interpreter's cost grows with programs and with masked lanes, the result does not change
tiles = {"block": 256, "stats_unroll": 1, "block_w": 256}
module.write_text(render(next(p for p in plans_for(spec, {"select": tiles}) if p.op == "select")))
config = eviction_config(spec)
sim = DecodeSim(config, [13, 40], [0, 2], 260, torch.device("cpu"), seed=5, generated=[0, 5])
path = save_synthetic_calibration(config, tmp / "calib.pt")
scorer, calibration = _scorer(spec, path, sim)
manager = TriAttentionManager(config, path, sim.k_pools, sim.v_pools, scorer, budget=130, beta=16,
                              eviction_mode=sys.argv[3], select_module=module)
assert manager.describe()["selection"] == str(module)
print("rounds", len(run_against_oracle(manager, sim, 130 + 3 * 16 + 10, calibration)))
"""


@pytest.mark.parametrize("mode", ["per_layer_perhead"])   # SWA rows included; ~2 min here
def test_manager_rounds_with_the_generated_selection(tmp_path: Path, mode: str) -> None:
    """The manager's whole round (oracle scorer, packer and compactor on the CPU; the generated
    selection under the interpreter) byte-identical to ``eviction_round``: pools, kept, lengths."""
    proc = interpret(ROUND_WORKER, str(ROOT), str(tmp_path), mode, cwd=ROOT)
    assert int(proc.stdout.split()[-1]) >= 3


def _oracle_statistics(scores: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``zscore``'s mean and floored std, restated with its own functions (float64, lane_sum)."""
    valid = valid.expand_as(scores)
    wide = torch.where(valid, scores, 0).double()
    count = valid.sum(-1, keepdim=True).clamp(min=1).double()
    mean = T.lane_sum(wide) / count
    deviation = torch.where(valid, wide - mean, 0)
    std = (T.lane_sum(deviation * deviation) / count).sqrt()
    return mean.float()[..., 0], std.float().clamp(min=T.STD_FLOOR)[..., 0]


@pytest.mark.parametrize("case", DECIDE, ids=[c["id"] for c in DECIDE])
def test_decide_equals_the_oracle(interpreted: dict, case: dict) -> None:
    mean, std, values, kept, nan_rows = interpreted[case["id"]]
    g, scores = case["geometry"], case["scores"]
    width, P = torch.tensor(case["width"]), torch.tensor(case["P"])
    valid = torch.arange(scores.shape[-1])[None, :] < width[:, None]
    ref_mean, ref_std = _oracle_statistics(scores, valid[None, :, None, :])
    assert torch.equal(mean, ref_mean) and torch.equal(std, ref_std)
    z = [T.zscore(layer, valid[:, None, :]) for layer in scores]
    ref_values = T.aggregate(z, case["mode"], g)
    assert torch.equal(values, ref_values)
    assert torch.equal(kept, T.select_keep(ref_values, width, case["budget"], P))
    assert not bool(nan_rows.any())


@pytest.mark.parametrize("case", SELECT, ids=[c["id"] for c in SELECT])
def test_select_equals_the_oracle(interpreted: dict, case: dict) -> None:
    got = interpreted[case["id"]]
    try:
        expected = T.select_keep(case["values"], torch.tensor(case["width"]), case["budget"], torch.tensor(case["P"]))
    except ValueError as exc:
        assert got == str(exc) == "NaN among the decision values"
        return
    assert not isinstance(got, str), got
    assert torch.equal(got, expected)


def test_constants_restate_the_reference() -> None:
    assert host.STD_FLOOR == T.STD_FLOOR and host.REDUCTION_LANES == T.REDUCTION_LANES
    assert host.MODES == T.MODES and host.MOVE_FILL == T.MOVE_FILL


# ---------------------------------------------------------------------------------------------
# Host side, in JIT mode (no kernel runs)
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("family", ["qwen3-8b", "gpt-oss-20b", "qwen3.5-397b-a17b"])
def test_generated_module_carries_the_family(family: str) -> None:
    spec = load_spec(ROOT / "specs" / f"{family}.yaml")
    plan = next(p for p in plans_for(spec) if p.op == "select")
    path = ROOT / "generated" / family / "select.py"
    assert path.read_text() == render(plan)
    module = import_select_module(path)
    from kvgen.lower.triattention import tri_geometry

    g = tri_geometry(spec)
    assert (module.FAMILY, module.NUM_LAYERS, module.KV_HEADS, module.GROUP) == (family, g.num_layers, g.kv_heads,
                                                                                 g.group)
    assert module.SCORED_LAYERS == tuple(g.scored_layers)
    for mode in T.MODES:
        assert module.num_decision_rows(mode) == T.num_decision_rows(mode, g)
    selector = Selector(path, family)
    selector.check_geometry(g.num_layers, g.kv_heads, g.group, g.scored_layers)
    with pytest.raises(SelectModuleError, match="generated for"):
        selector.check_geometry(g.num_layers + 1, g.kv_heads, g.group, g.scored_layers)
    with pytest.raises(SelectModuleError, match=f"generated for family '{family}', not 'mistral-7b'"):
        Selector(path, "mistral-7b")


def test_a_round_goes_to_the_selection_variant_of_its_work(tmp_path: Path) -> None:
    """Selector((main, [(from_work, variant)])): a registry's size-dispatched selection; each variant
    must be the same family and geometry (only the launch tunables differ)."""
    spec = load_spec(ROOT / "specs" / "qwen3-8b.yaml")
    wide = tmp_path / "select_b32.py"
    wide.write_text(render(next(p for p in plans_for(spec, {"select": {"block_w": 256}}) if p.op == "select")))
    main = ROOT / "generated" / "qwen3-8b" / "select.py"
    selector = Selector((main, [(92681, wide)]), "qwen3-8b")
    assert selector.module_for(1, 16384) is selector.module and selector.path_for(1, 16384) == main
    assert selector.module_for(32, 16384) is selector.variants[0] and selector.path_for(32, 16384) == wide
    assert selector.variants[0].block_w == 256 and selector.module.block_w != 256
    assert selector.describe() == [{"from_work": 0, "library": str(main)}, {"from_work": 92681, "library": str(wide)}]
    other = ROOT / "generated" / "gpt-oss-20b" / "select.py"
    with pytest.raises(SelectModuleError, match=f"{other}: a selection variant of 'gpt-oss-20b'"):
        Selector((main, [(92681, other)]), "qwen3-8b")


@pytest.mark.parametrize("P, S, width, budget, message", [
    ([0, 4], [100, 50], 100, 46, r"request 1: budget 46 >= scorable width S - P = 46"),
    ([-1], [50], 100, 8, r"request 0: P=-1, S=50 outside the scores' 100 columns"),
    ([3], [120], 100, 8, r"request 0: P=3, S=120 outside the scores' 100 columns"),
    ([3], [120, 4], 200, 8, "P has 1 requests, S 2"),
    ([3], [120], 200, 0, "budget 0: must be at least 1"),
])
def test_round_inputs_are_checked_before_launch(P, S, width, budget, message) -> None:
    with pytest.raises(ValueError, match=message):
        check_round(P, S, width, budget)


def test_selector_checks_shapes() -> None:
    s = kernels.TritonSelector(3, 2, 2, (0, 2), **TUNABLES)
    width = torch.tensor([5], dtype=torch.int64)
    with pytest.raises(ValueError, match=r"scores: expected float32 \[2 scored layers, B, 4 query heads, W\]"):
        s.statistics(torch.zeros(3, 1, 4, 5), width)
    with pytest.raises(ValueError, match=r"width: expected int64 \[1\]"):
        s.statistics(torch.zeros(2, 1, 4, 5), width.int())
    with pytest.raises(ValueError, match="eviction_mode 'max'"):
        s.num_decision_rows("max")
    with pytest.raises(ValueError, match="budget 0"):
        s.select(torch.zeros(1, 1, 5), width, 0, width)


@pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION")
def test_kernels_compile_for_gpu_targets() -> None:
    """The real compiler is stricter than the interpreter; and it must round as the reference:
    correctly rounded float64 division and square root, float32 division, no fused multiply-add.
    Each route at the bench's sizes: 16384 resident columns, histograms of 256 or 4 digits."""
    for route in ROUTES.values():
        resident = {"stats_resident": 16384, "rows": 1, "stats_warps": 16} if route["stats_resident"] else {}
        selector = kernels.TritonSelector(36, 8, 4, range(36), **{**route, **resident, "block": 1024})
        _compile_for_gpu_targets(selector)


def _compile_for_gpu_targets(selector: kernels.TritonSelector) -> None:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    specs = {spec.name: spec for spec in kernels.aot_specializations(selector)}
    assert list(specs) == ["statistics", "aggregate_union", "aggregate_per_head", "aggregate_per_layer_perhead",
                           "queue_union", "queue_per_head", "queue_per_layer_perhead", "select"]

    def compiled(name: str, target: GPUTarget):  # noqa: ANN202
        spec = specs[name]
        assert spec.options["enable_fp_fusion"] is False
        return triton.compile(ASTSource(spec.kernel, spec.triton_signature(), spec.constants), target, spec.options)

    for arch in (90, 100):
        target = GPUTarget("cuda", arch, 32)
        ptx = compiled("statistics", target).asm["ptx"]
        assert "div.rn.f64" in ptx and "sqrt.rn.f64" in ptx and "fma.rn.f64" not in ptx
        assert "add.rn.f64" in ptx and "mul.rn.f64" in ptx   # explicit rounding: ptxas may not contract them
        for mode in host.MODES:
            ptx = compiled(f"aggregate_{mode}", target).asm["ptx"]
            assert "div.rn.f32" in ptx and ".ftz" not in ptx
            # the queue: counted with release, waited on with acquire, the other programs' results read past L1
            ptx = compiled(f"queue_{mode}", target).asm["ptx"]
            assert "div.rn.f64" in ptx and "div.rn.f32" in ptx and "fma.rn.f64" not in ptx and ".ftz" not in ptx
            assert ".gpu.release" in ptx and "ld.global.gpu.acquire" in ptx and "ld.global.cg" in ptx
        assert compiled("select", target).asm["cubin"]


def test_tunables_are_the_plans_names() -> None:
    """``SelectionHost.tunables`` names exactly the plan's select tunables and rebuilds the same host."""
    from kvgen.lower.plan import TUNABLES as PLAN

    for route in ROUTES.values():
        selector = kernels.TritonSelector(3, 2, 2, (0, 2), **route)
        assert selector.tunables() == route and set(route) == set(PLAN["select"])
