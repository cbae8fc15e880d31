"""The GPU-side TriAttention pipeline, on the CPU: selection against the oracle, the manager's
cadence, bookkeeping and admission rules, and whole rounds byte-identical to ``eviction_round``.

The score kernel needs a GPU, so the manager here gets a stand-in scorer that evaluates the
oracle's ``score_keys`` through the score library's call signature; the kernel itself is checked
on the H200 by ``tests/gpu/test_score_gpu.py`` with the same simulation (``tests/tri_sim.py``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvgen.lower.triattention import calibration_defaults, tri_geometry
from kvgen.reference.triattention import (
    MODES,
    CalibrationError,
    aggregate,
    gather_token_rows,
    load_calibration,
    score_keys,
    zscore,
)
from kvgen.reference.triattention import select_keep as oracle_select_keep
from kvgen.runtime.eviction import GenerationStep, TriAttentionManager, aggregate_layers, select_keep, zscore_layers
from kvgen.spec.schema import load_spec

from .tri_sim import DecodeSim, run_against_oracle, save_synthetic_calibration, small_spec

SPECS = Path(__file__).resolve().parents[1] / "specs"


class OracleScorer:
    """Stands in for ``ScoreLibrary`` on the CPU: same arguments, the oracle's arithmetic."""

    def __init__(self, family: str, pools: list[torch.Tensor], calibration, geometry):
        self.family, self.path, self.arch = family, Path("<oracle>"), "cpu"
        self.pools, self.calibration, self.geometry = pools, calibration, geometry
        self.calls = 0

    def check_geometry(self, geometry, dtype) -> None:
        assert geometry == self.geometry

    def score(self, k_layer_ptrs, page_stride, page_table, P, S, c, d, qr, qi, mlr, freq_scale_sq, scores,
              stream=None) -> None:
        self.calls += 1
        P, S = P.long(), S.long()
        width = scores.shape[-1]
        j = torch.arange(width)
        valid = j[None, :] < (S - P)[:, None]
        for index, layer in enumerate(self.geometry.scored_layers):
            rows = gather_token_rows(self.pools[layer], page_table, P[:, None] + j, valid, self.geometry)
            s = score_keys(rows.float(), self.calibration, layer, c, d, self.geometry, torch.float32)
            scores[index] = torch.where(valid[:, None, :], s, 0)


def _manager(spec, tmp_path: Path, sim: DecodeSim, **kwargs) -> tuple[TriAttentionManager, object]:
    path = save_synthetic_calibration(spec, tmp_path / "calib.pt")
    omega, scale = calibration_defaults(spec)
    calibration = load_calibration(path, tri_geometry(spec), omega, scale)
    scorer = OracleScorer(spec.name, sim.k_pools, calibration, tri_geometry(spec))
    return TriAttentionManager(spec, path, sim.k_pools, sim.v_pools, scorer, **kwargs), calibration


# ---------------------------------------------------------------- select against the oracle


@pytest.mark.parametrize("mode", MODES)
def test_aggregate_and_select_equal_the_oracle(mode: str) -> None:
    spec = small_spec(load_spec(SPECS / "gpt-oss-20b.yaml"), 6)   # 3 scored, 3 sliding layers
    g = tri_geometry(spec)
    gen = torch.Generator().manual_seed(3)
    B, W = 4, 90
    width = torch.tensor([90, 0, 41, 77])
    P = torch.tensor([5, 12, 30, 7])
    scores = torch.randn(len(g.scored_layers), B, g.query_heads, W, generator=gen).round(decimals=1)  # many ties
    valid = torch.arange(W)[None, :] < width[:, None]
    scores = torch.where(valid[None, :, None, :], scores, 0)
    z_layers = zscore_layers(scores, valid)
    full = torch.zeros(B, g.num_layers, g.query_heads, W)
    for index, layer in enumerate(g.scored_layers):
        full[:, layer] = zscore(scores[index], valid[:, None, :])
    values = aggregate_layers(z_layers, mode, g)
    assert torch.equal(values, aggregate(full, mode, g))
    for budget in (1, 16, 41, 200):
        assert torch.equal(select_keep(values, width, budget, P), oracle_select_keep(values, width, budget, P))


def test_select_breaks_ties_by_lower_index_and_emits_ascending_positions() -> None:
    values = torch.tensor([[[1.0, 3.0, 3.0, 2.0, 3.0, 0.5]]])
    kept = select_keep(values, torch.tensor([6]), 3, torch.tensor([100]))
    assert kept.tolist() == [[[101, 102, 104]]]
    kept = select_keep(values, torch.tensor([2]), 3, torch.tensor([100]))
    assert kept.tolist() == [[[100, 101, -1]]], "fewer valid columns than the budget: -1 fills"


# ---------------------------------------------------------------- the manager


CASES = [  # family, layers kept for the test, eviction mode, budget, beta
    ("qwen3-8b", 3, "union", 48, 16),
    ("llama-3.1-8b", 3, "per_head", 40, 32),
    ("mistral-7b", 2, "per_layer_perhead", 32, 16),     # NHD, fp16
    ("gpt-oss-20b", 4, "union", 130, 16),               # sliding window 128 on even layers
    ("gpt-oss-20b", 4, "per_layer_perhead", 130, 16),   # decision rows of sliding layers are never used
    ("qwen3.5-397b-a17b", 2, "per_head", 40, 16),       # partial (leading) rotary
]


@pytest.mark.parametrize("family,layers,mode,budget,beta", CASES)
def test_rounds_are_byte_identical_to_the_oracle(tmp_path: Path, family: str, layers: int, mode: str, budget: int,
                                                 beta: int) -> None:
    spec = small_spec(load_spec(SPECS / f"{family}.yaml"), layers)
    prompts, tails = [13, 40, 77], [0, 1, 3]
    steps = budget + 3 * beta + 20
    sim = DecodeSim(spec, prompts, tails, max(prompts) + max(tails) + steps + 30, torch.device("cpu"), seed=5,
                    generated=[0, 5, 19], codebook=24 if family == "qwen3-8b" else None)
    manager, calibration = _manager(spec, tmp_path, sim, budget=budget, beta=beta, eviction_mode=mode)
    rounds = run_against_oracle(manager, sim, steps, calibration)
    assert len(rounds) >= 3, "the decode is long enough for several rounds"
    assert len({tuple(r["due"]) for r in rounds}) > 1, "requests become due at different steps"
    assert manager.library.calls == len(rounds), "no scoring when nothing is due"
    assert manager.requests == {}, "on_request_finish drops the state"


def test_several_crossings_in_one_step_give_one_round(tmp_path: Path) -> None:
    spec = small_spec(load_spec(SPECS / "qwen3-8b.yaml"), 1)
    sim = DecodeSim(spec, [10], [0], 400, torch.device("cpu"))
    manager, _ = _manager(spec, tmp_path, sim, budget=32, beta=8)
    manager.on_request_init(_Request("a", 10))
    sim.lengths = [10 + 100]      # a speculative-style jump: many beta multiples crossed at once
    report = manager.on_generation_step_end(GenerationStep(["a"], sim.page_table, sim.lengths))
    assert report.due == ("a",) and report.lengths == (42,) and report.evicted == (68,)
    assert manager.library.calls == 1
    again = manager.on_generation_step_end(GenerationStep(["a"], sim.page_table, [43]))
    assert again.due == () and again.lengths == (43,), "C = 68 now: next round at L - P = 104"


def test_admission_predicates() -> None:
    assert TriAttentionManager.changes_physical_kv_length is True
    assert TriAttentionManager.supports_block_reuse() is False
    assert TriAttentionManager.supports_speculative_decoding() is False


def test_init_validates_calibration_library_and_pools(tmp_path: Path) -> None:
    spec = small_spec(load_spec(SPECS / "qwen3-8b.yaml"), 2)
    sim = DecodeSim(spec, [10], [0], 64, torch.device("cpu"))
    manager, calibration = _manager(spec, tmp_path, sim)
    assert (manager.budget, manager.beta, manager.mode) == (2048, 128, "union")
    other = small_spec(load_spec(SPECS / "llama-3.1-8b.yaml"), 2)   # same shapes, another RoPE
    wrong = save_synthetic_calibration(other, tmp_path / "llama.pt")
    with pytest.raises(CalibrationError, match=r"llama\.pt.*omega.*disagrees"):
        TriAttentionManager(spec, wrong, sim.k_pools, sim.v_pools, manager.library)
    with pytest.raises(ValueError, match="2 layers, got 1 K"):
        TriAttentionManager(spec, tmp_path / "calib.pt", sim.k_pools[:1], sim.v_pools[:1], manager.library)
    with pytest.raises(ValueError, match="expected bfloat16"):
        TriAttentionManager(spec, tmp_path / "calib.pt", [p.half() for p in sim.k_pools], sim.v_pools,
                            manager.library)
    manager.library.family = "llama-3.1-8b"
    with pytest.raises(ValueError, match="score library of 'llama-3.1-8b'"):
        TriAttentionManager(spec, tmp_path / "calib.pt", sim.k_pools, sim.v_pools, manager.library)


class _Request:
    def __init__(self, request_id: str, prompt_len: int):
        self.request_id, self.prompt_len = request_id, prompt_len
