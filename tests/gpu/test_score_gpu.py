"""The generated TriAttention score kernels on the GPU against the oracle (TRIATTENTION.md §3-§7).

Libraries: ``<registry>/sm_90a/lib<kvgen_family>_score.so`` (``kvgen.build.cute_aot``, built on
the CPU machine, carried here; ``KVGEN_SCORE_REGISTRY`` points at a registry of variants with other
tunable parameters, e.g. ``build/registry-score-l4t4``); nothing here imports CUTLASS.

Tolerance of the scores (derived, not tuned). The kernel computes in float32 what the oracle
computes in float64: the coefficients ``a = s(qr·c − qi·d)``, ``b = s(qr·d + qi·c)`` from float32
mean-phase rows (each rounded once, u = 2^-24) in four rounded operations, ``m = s·(E|q| − |Eq|)``
in three; the magnitude ``sqrt(re² + im²)`` in two; then a chain of 3F fused multiply-adds. With
``T = Σ_f s_f[(|qr||c| + |qi||d|)|re| + (|qr||d| + |qi||c|)|im| + (E|q| + |Eq|)|k_f|]`` (the sum of
the magnitudes every rounding error is relative to) the first-order worst case is
``|kernel − oracle| ≤ (3F + 16)·u·T``: 3F for the accumulation chain, the rest for the
coefficients and the magnitude. The bound is asserted everywhere, so it holds for any inputs, not
only on average. Columns past a request's width must be exactly 0.

The tensor-core form (``form`` 1, ``kvgen/kernels/cute/score_mma.py``) is held to the same bound: its
own, ``(F/2 + 23)·u·T`` with f32 magnitude FMAs and ``(F/2 + 69)·u·T`` with tf32 magnitude MMAs
(stated and derived in its docstring), is inside ``(3F + 16)·u·T`` for every shipped F (32-128).
Its scores are not bit-identical to form 0's; kept sets and rounds are compared as below.

fp8 E4M3 K (qwen3-8b-fp8): every code widens exactly, the kernel reads K as stored (no scale), so
the same bound holds with T taken over the fp8 values, and the kept sets are compared the same way.
Variants of the pipeline tunables
(``tokens_per_thread``, ``prefetch``) are the same tests run with ``KVGEN_SCORE_REGISTRY`` set to
their registry (``build/registry-score-{t2,p1,t2p1,t4p1}``): same scores within the same bound.
Device-side safety: page ids outside the pool in the page table score 0 and the next call raises.

Grid: every TriAttention family, its first 6 cache layers (the kernel's layer count is a run-time
size; for the SWA families 3 of the 6 slide), three requests: widths 300, 0 and 517 decode tokens,
positions L = S + C up to ~70600 (the mean-phase table grows past its initial 2^15 rows), K/V of
two families interleaved in one buffer (page stride twice the page), ten repeated K rows (ties).
Full rounds: families whose windows fit a short decode (gemma-2-9b slides 4096 tokens, so its
budget would need a 4096-token decode; its scores and selection are covered above), all layers,
both with the oracle's packer/compactor and with the generated ones when they are built. The
oracle's round scores with float32 torch ops, the manager with the kernel: both round, so with
continuous random keys a value within ~1e-7 of the budget cut could flip. The decode therefore
draws K rows from 24 distinct rows per layer (``DecodeSim(codebook=24)``): equal keys tie exactly
in both (settled by index: many ties, all exercised), distinct keys score far apart, and the
rounds must be byte-identical, with no tolerance.
"""

from __future__ import annotations

import functools
import os
import tempfile
from pathlib import Path

import pytest
import torch

from kvgen.lower.triattention import calibration_defaults, eviction_config, tri_geometry
from kvgen.reference.triattention import (
    MODES,
    aggregate,
    gather_token_rows,
    load_calibration,
    mean_phase_rows,
    score_paged,
    select_keep,
    split_pairs,
    zscore,
)
from kvgen.runtime.eviction import TriAttentionManager, generated_backends
from kvgen.runtime.library import LibraryError
from kvgen.runtime.lookup import RegistryError, RuntimeRegistry
from kvgen.runtime.score import ScoreDispatch, ScoreLibrary
from kvgen.spec.schema import load_spec

from ..conftest import SPECS_DIR
from ..tri_sim import DecodeSim, run_against_oracle, save_synthetic_calibration, small_spec
from .conftest import ARCH, REGISTRY

pytestmark = pytest.mark.gpu

FP8_FAMILY = "qwen3-8b-fp8"
FAMILIES = sorted(p.stem for p in SPECS_DIR.glob("*.yaml") if load_spec(p).triattention.enabled)
U = 2.0 ** -24
PROMPTS, GENERATED, TAILS = [5, 37, 70], [300, 0, 517], [0, 2, 1]
EVICTED = [0, 1000, 70000]
COMBINED = {"qwen3-8b-nhd", "mistral-7b"}
# Score libraries may come from another registry (a variant with other tunable parameters).
SCORE_REGISTRY = Path(os.environ.get("KVGEN_SCORE_REGISTRY", REGISTRY))


def family_spec(family: str):  # noqa: ANN201 - a FamilySpec
    return load_spec(SPECS_DIR / f"{family}.yaml")


def resolved_family(family: str):  # noqa: ANN201 - kvgen.runtime.lookup.Resolved
    try:
        resolved = RuntimeRegistry([SCORE_REGISTRY]).resolve(family, ARCH)
        resolved.artifact("score")
    except RegistryError as exc:
        pytest.skip(f"no score library ({exc}); build it on the CPU machine and carry {SCORE_REGISTRY}")
    return resolved


def score_library(family: str, bucket: str = "") -> ScoreLibrary:
    """The family's main score library, or the size-dispatched variant tuned at ``bucket``."""
    resolved = resolved_family(family)
    main, variants = resolved.dispatch("score")
    buckets = [v.bucket for v in resolved.op("score").variants]
    return ScoreLibrary(variants[buckets.index(bucket)][1] if bucket else main, family=family)


def exact_pool(pool: torch.Tensor) -> torch.Tensor:
    """An fp8 pool as float32 (exact) for the oracle's gathers; other dtypes as they are."""
    return pool.float() if pool.element_size() == 1 else pool


@functools.lru_cache(maxsize=None)
def scenario(family: str, bucket: str = "") -> dict:
    """Kernel scores of one family's scenario (computed once per session), by its main score
    library or the variant tuned at ``bucket``."""
    spec = small_spec(family_spec(family), 6)
    max_tokens = max(p + n + t for p, n, t in zip(PROMPTS, GENERATED, TAILS)) + 8
    sim = DecodeSim(eviction_config(spec), PROMPTS, TAILS, max_tokens, torch.device("cuda"), seed=11, generated=GENERATED,
                    combined=family in COMBINED)
    sim.duplicate_rows(0, 1, range(10, 20))
    path = save_synthetic_calibration(eviction_config(spec), Path(tempfile.mkdtemp(prefix="kvgen-calib-")) / f"{family}.pt", seed=4)
    manager = TriAttentionManager(eviction_config(spec), path, sim.k_pools, sim.v_pools, score_library(family, bucket),
                                  budget=max(100, max((w for w in tri_geometry(spec).swa_window if w), default=0)))
    S = [n - t for n, t in zip(sim.lengths, TAILS)]
    L = [s + c for s, c in zip(S, EVICTED)]
    scores = manager.score(sim.page_table, PROMPTS, S, L)
    torch.cuda.synchronize()
    return {"spec": spec, "sim": sim, "manager": manager, "S": S, "scores": scores}


def abs_bound(k_rows: torch.Tensor, calibration, layer: int, c: torch.Tensor, d: torch.Tensor,
              geometry) -> torch.Tensor:
    """``T`` of the module docstring, ``[B, Hq, W]``, in float64."""
    re, im = split_pairs(k_rows.double(), geometry)
    re = re.repeat_interleave(geometry.group, dim=-3).abs()
    im = im.repeat_interleave(geometry.group, dim=-3).abs()
    device = k_rows.device
    qr = calibration.E_q[layer].real.double().to(device).abs()
    qi = calibration.E_q[layer].imag.double().to(device).abs()
    qa = calibration.E_q_norm[layer].double().to(device) + calibration.E_q[layer].abs().double().to(device)
    s = calibration.freq_scale_sq.double().to(device)
    c, d = c.abs()[:, None, None, :], d.abs()[:, None, None, :]
    a = s * (qr[None, :, None, :] * c + qi[None, :, None, :] * d)
    b = s * (qr[None, :, None, :] * d + qi[None, :, None, :] * c)
    m = s * qa[None, :, None, :]
    return (a * re + b * im + m * torch.hypot(re, im)).sum(dim=-1)


@pytest.mark.parametrize("family", FAMILIES)
def test_scores_match_the_float64_oracle(family: str) -> None:
    print(f"{family}: worst error / bound = {worst_error(scenario(family)):.3g}")


@pytest.mark.parametrize("family", FAMILIES)
def test_size_dispatched_variants_match_the_float64_oracle(family: str) -> None:
    """Every library a size range is dispatched to (kvgen.artifacts.dispatch) is within the bound
    too, and the registry's dispatch sends each call to the library of its work."""
    resolved = resolved_family(family)
    variants = resolved.op("score").variants
    own = [v for v in variants if v.artifact != resolved.op("score").artifact]
    if not own:
        pytest.skip(f"{family}: one score library serves every size")
    for variant in own:
        print(f"{family} {variant.bucket}: worst error / bound = {worst_error(scenario(family, variant.bucket)):.3g}")
    dispatch = ScoreDispatch.from_resolved(resolved)
    if variants[0].from_work > 1:
        assert dispatch.library_for(1, 1).path.name == resolved.op("score").artifact
    for variant in variants:
        assert dispatch.library_for(1, variant.from_work).path.name == variant.artifact
        assert dispatch.library_for(variant.from_work, 1).path.name == variant.artifact


def worst_error(case: dict) -> float:
    """The scenario's largest error over the stated bound (3F+16)u·T, asserted <= 1."""
    sim, manager, scores = case["sim"], case["manager"], case["scores"]
    g = manager.geometry
    P = torch.tensor(PROMPTS, device="cuda")
    S = torch.tensor(case["S"], device="cuda")
    C = torch.tensor(EVICTED, device="cuda")
    width = scores.shape[-1]
    assert width == max(s - p for s, p in zip(case["S"], PROMPTS))
    gamma = (3 * g.freqs + 16) * U
    c, d = mean_phase_rows(manager.omega, S + C, torch.float64)
    j = torch.arange(width, device="cuda")
    valid = j[None, :] < (S - P)[:, None]
    worst = 0.0
    for index, layer in enumerate(g.scored_layers):
        pool = exact_pool(sim.k_pools[layer])
        ref, ref_valid = score_paged(pool, sim.page_table, P, S, C, manager.calibration, layer, g, torch.float64)
        assert torch.equal(ref_valid, valid)
        got = scores[index].double()
        assert bool(torch.isfinite(got).all())
        assert bool((got[~valid[:, None, :].expand_as(got)] == 0).all()), "columns past the width must be 0"
        rows = gather_token_rows(pool, sim.page_table, P[:, None] + j, valid, g)
        bound = gamma * abs_bound(rows, manager.calibration, layer, c, d, g)
        err = (got - ref).abs()
        mask = valid[:, None, :].expand_as(err)
        ratio = (err[mask] / bound[mask].clamp(min=1e-300)).max().item()
        worst = max(worst, ratio)
        assert ratio <= 1.0, f"layer {layer}: error {ratio:.3g} x the bound (3F+16)u·T"
    return worst


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("family", FAMILIES)
def test_selection_equals_the_oracle_on_the_kernel_scores(family: str, mode: str) -> None:
    case = scenario(family)
    scores, g = case["scores"], case["manager"].geometry
    P = torch.tensor(PROMPTS, device="cuda")
    width = torch.tensor(case["S"], device="cuda") - P
    valid = torch.arange(scores.shape[-1], device="cuda")[None, :] < width[:, None]
    # The oracle's decision on the kernel's scores (the manager's decide() calls these functions):
    # every kept set is min(budget, width) ascending positions inside [P, S), then -1.
    values = aggregate([zscore(layer, valid[:, None, :]) for layer in scores], mode, g)
    for budget in (1, 100, 300, 600):
        kept = select_keep(values, width, budget, P)
        for b in range(len(PROMPTS)):
            real = kept[b][:, :min(budget, int(width[b]))]
            assert bool((kept[b][:, real.shape[1]:] == -1).all()), f"budget {budget}: -1 after the valid picks"
            assert bool((real >= PROMPTS[b]).all() & (real < case["S"][b]).all()), f"budget {budget}"
            assert bool((real[:, 1:] > real[:, :-1]).all()), f"budget {budget}: ascending"
    manager = case["manager"]
    if mode == manager.mode:
        assert torch.equal(manager.decide(scores, PROMPTS, case["S"]), select_keep(values, width, manager.budget, P))
    tied = select_keep(values, width, 100, P)[0]
    assert bool((tied[tied >= 0] >= PROMPTS[0]).all()) and bool((tied[:, 1:] > tied[:, :-1]).all())


@pytest.mark.parametrize("family", ["qwen3-8b", FP8_FAMILY])
def test_page_ids_outside_the_pool_are_skipped_and_reported(family: str) -> None:
    """A page-table entry < 0 or >= num_pages is never dereferenced: its tokens score 0, every other
    token scores as before, and the next call (or check_device_errors) raises naming the page."""
    case = scenario(family)
    sim, manager = case["sim"], case["manager"]
    library = manager.library
    library.check_device_errors()     # nothing recorded so far
    good = manager.score(sim.page_table, PROMPTS, case["S"], [s + c for s, c in zip(case["S"], EVICTED)])
    bad_table = sim.page_table.clone()
    block = (PROMPTS[0] + 3) // manager.geometry.tokens_per_block       # a page of request 0's decode
    for bad in (manager.num_pages, -7, 1 << 30):
        bad_table[0, block] = bad
        scores = manager.score(bad_table, PROMPTS, case["S"], [s + c for s, c in zip(case["S"], EVICTED)])
        torch.cuda.synchronize()
        tpb = manager.geometry.tokens_per_block
        j = torch.arange(scores.shape[-1], device="cuda")
        hit = (PROMPTS[0] + j) // tpb == block
        assert bool((scores[:, 0][..., hit] == 0).all()), "skipped tokens score 0"
        assert torch.equal(scores[:, 0][..., ~hit], good[:, 0][..., ~hit]) and torch.equal(scores[:, 1:], good[:, 1:])
        with pytest.raises(LibraryError, match=f"page id {bad} from the page table"):
            library.check_device_errors()
        library.check_device_errors()     # the record was cleared
    bad_table[0, block] = manager.num_pages
    manager.score(bad_table, PROMPTS, case["S"], case["S"])
    torch.cuda.synchronize()
    with pytest.raises(LibraryError, match="outside the pool"):
        manager.score(sim.page_table, PROMPTS, case["S"], case["S"])   # the next call reports it
    manager.score(sim.page_table, PROMPTS, case["S"], case["S"])       # and then works again


ROUND_CASES = [  # family, eviction mode, budget, beta
    ("qwen3-8b", "union", 96, 32),
    ("qwen3-8b-nhd", "per_head", 64, 16),
    ("llama-3.1-8b", "per_head", 80, 32),
    ("mistral-7b", "per_layer_perhead", 64, 16),       # NHD, fp16
    ("gpt-oss-20b", "union", 160, 32),                  # sliding window 128 on even layers, YaRN
    ("falcon-7b", "per_layer_perhead", 64, 16),         # MQA: 71 query heads over one KV head, 5 passes
    ("qwen3.5-397b-a17b", "per_head", 64, 16),          # partial (leading) rotary, head_dim 256
]


def _backends(family: str, sim: DecodeSim, which: str):
    """``generated``: the registry's packer and compaction libraries as the manager gets them (the
    sim's 4 request slots are served by the main compaction library); ``variant``: the library of
    the largest calls serving every call, so its bytes are checked too (families without one skip)."""
    if which == "oracle":
        return {}
    try:
        resolved = RuntimeRegistry([REGISTRY]).resolve(family, ARCH)
        pack, (compact, variants) = resolved.artifact("pack"), resolved.dispatch("compact")
    except RegistryError as exc:
        pytest.skip(f"generated packer or compactor of {family} not in {REGISTRY}: {exc}")
    if which == "variant":
        if not variants:
            pytest.skip(f"{family} has no compaction size variant in {REGISTRY}")
        compact, variants = variants[-1][1], []
    packer, compactor = generated_backends(family, sim.k_pools, sim.v_pools, pack, (compact, variants))
    return {"packer": packer, "compactor": compactor}


@pytest.mark.parametrize("backend", ["oracle", "generated", "variant"])
@pytest.mark.parametrize("family,mode,budget,beta", ROUND_CASES)
def test_full_rounds_are_byte_identical_to_the_oracle(tmp_path: Path, family: str, mode: str, budget: int,
                                                      beta: int, backend: str) -> None:
    spec = load_spec(SPECS_DIR / f"{family}.yaml")
    prompts, tails, generated = [13, 150, 61, 7], [0, 1, 3, 2], [0, 9, 20, 31]
    steps = budget + 3 * beta + 24
    sim = DecodeSim(eviction_config(spec), prompts, tails, max(prompts) + max(tails) + max(generated) + steps + 8,
                    torch.device("cuda"), seed=23, generated=generated, codebook=24)
    calibration_path = save_synthetic_calibration(eviction_config(spec), tmp_path / "calib.pt", seed=9)
    manager = TriAttentionManager(eviction_config(spec), calibration_path, sim.k_pools, sim.v_pools,
                                  score_library(family), budget=budget, beta=beta, eviction_mode=mode,
                                  **_backends(family, sim, backend))
    omega, scale = calibration_defaults(spec)
    calibration = load_calibration(calibration_path, tri_geometry(spec), omega, scale)
    rounds = run_against_oracle(manager, sim, steps, calibration)
    assert len(rounds) >= 3 and len({tuple(r["due"]) for r in rounds}) > 1
