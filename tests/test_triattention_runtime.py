"""The GPU-side TriAttention pipeline, on the CPU: the decision step against the oracle, the
manager's cadence, bookkeeping and admission rules, whole rounds byte-identical to
``eviction_round``, and the manager built from a registry entry with no spec on the path.

The score kernel needs a GPU, so the manager here gets a stand-in scorer that evaluates the
oracle's ``score_keys`` through the score library's call signature; the kernel itself is checked
on the H200 by ``tests/gpu/test_score_gpu.py`` with the same simulation (``tests/tri_sim.py``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from kvgen.lower.layout import family_layout, to_json
from kvgen.lower.triattention import calibration_defaults, eviction_config, tri_geometry
from kvgen.reference.triattention import (
    MODES,
    CalibrationError,
    GeometryError,
    aggregate,
    gather_token_rows,
    load_calibration,
    score_keys,
    select_keep,
    zscore,
)
from kvgen.runtime.eviction import GenerationStep, TriAttentionManager, oracle_compactor, oracle_packer
from kvgen.runtime.library import LibraryError
from kvgen.runtime.select import SelectModuleError
from kvgen.spec.schema import load_spec

from .tri_sim import DecodeSim, run_against_oracle, save_synthetic_calibration, small_spec

ROOT = Path(__file__).resolve().parents[1]
SPECS = ROOT / "specs"


class OracleScorer:
    """Stands in for ``ScoreLibrary`` on the CPU: same arguments, the oracle's arithmetic."""

    def __init__(self, family: str, pools: list[torch.Tensor], calibration, geometry):
        self.family, self.path, self.arch = family, Path("<oracle>"), "cpu"
        self.pools, self.calibration, self.geometry = pools, calibration, geometry
        self.calls = 0

    def check_geometry(self, geometry, dtype) -> None:
        assert geometry == self.geometry

    def score(self, k_layer_ptrs, page_stride, page_table, P, S, c, d, qr, qi, mlr, freq_scale_sq, scores,
              stream=None, *, num_pages: int) -> None:
        assert num_pages == min(self.pools[layer].shape[0] for layer in self.geometry.scored_layers)
        self.calls += 1
        P, S = P.long(), S.long()
        width = scores.shape[-1]
        j = torch.arange(width)
        valid = j[None, :] < (S - P)[:, None]
        for index, layer in enumerate(self.geometry.scored_layers):
            rows = gather_token_rows(self.pools[layer], page_table, P[:, None] + j, valid, self.geometry)
            s = score_keys(rows.float(), self.calibration, layer, c, d, self.geometry, torch.float32)
            scores[index] = torch.where(valid[:, None, :], s, 0)


def _scorer(spec, path: Path, sim: DecodeSim) -> tuple[OracleScorer, object]:
    omega, scale = calibration_defaults(spec)
    calibration = load_calibration(path, tri_geometry(spec), omega, scale)
    return OracleScorer(spec.name, sim.k_pools, calibration, tri_geometry(spec)), calibration


def _manager(spec, tmp_path: Path, sim: DecodeSim, **kwargs) -> tuple[TriAttentionManager, object]:
    path = save_synthetic_calibration(eviction_config(spec), tmp_path / "calib.pt")
    scorer, calibration = _scorer(spec, path, sim)
    return TriAttentionManager(eviction_config(spec), path, sim.k_pools, sim.v_pools, scorer, **kwargs), calibration


# ---------------------------------------------------------------- the decision step


@pytest.mark.parametrize("mode", MODES)
def test_decide_is_the_oracle_decision_on_the_kernel_scores(tmp_path: Path, mode: str) -> None:
    spec = small_spec(load_spec(SPECS / "gpt-oss-20b.yaml"), 6)   # 3 scored, 3 sliding layers
    sim = DecodeSim(eviction_config(spec), [5], [0], 64, torch.device("cpu"))
    manager, _ = _manager(spec, tmp_path, sim, budget=130, eviction_mode=mode)
    g = manager.geometry
    gen = torch.Generator().manual_seed(3)
    P, S = [5, 12, 30, 7], [95, 12, 71, 84]                       # widths 90, 0, 41, 77
    scores = torch.randn(len(g.scored_layers), 4, g.query_heads, 90, generator=gen).round(decimals=1)  # many ties
    width = torch.tensor(S) - torch.tensor(P)
    valid = torch.arange(90)[None, :] < width[:, None]
    scores = torch.where(valid[None, :, None, :], scores, 0)
    z = [zscore(scores[index], valid[:, None, :]) for index in range(len(g.scored_layers))]
    expected = select_keep(aggregate(z, mode, g), width, manager.budget, torch.tensor(P))
    assert torch.equal(manager.decide(scores, P, S), expected)


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
    sim = DecodeSim(eviction_config(spec), prompts, tails, max(prompts) + max(tails) + steps + 30, torch.device("cpu"), seed=5,
                    generated=[0, 5, 19], codebook=24 if family == "qwen3-8b" else None)
    manager, calibration = _manager(spec, tmp_path, sim, budget=budget, beta=beta, eviction_mode=mode)
    rounds = run_against_oracle(manager, sim, steps, calibration)
    assert len(rounds) >= 3, "the decode is long enough for several rounds"
    assert len({tuple(r["due"]) for r in rounds}) > 1, "requests become due at different steps"
    assert manager.library.calls == len(rounds), "no scoring when nothing is due"
    assert manager.requests == {}, "on_request_finish drops the state"


def test_several_crossings_in_one_step_give_one_round(tmp_path: Path) -> None:
    spec = small_spec(load_spec(SPECS / "qwen3-8b.yaml"), 1)
    sim = DecodeSim(eviction_config(spec), [10], [0], 400, torch.device("cpu"))
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
    config = eviction_config(spec)
    sim = DecodeSim(eviction_config(spec), [10], [0], 64, torch.device("cpu"))
    manager, calibration = _manager(spec, tmp_path, sim)
    assert (manager.budget, manager.beta, manager.mode) == (2048, 128, "union")
    other = small_spec(load_spec(SPECS / "llama-3.1-8b.yaml"), 2)   # same shapes, another RoPE
    wrong = save_synthetic_calibration(eviction_config(other), tmp_path / "llama.pt")
    with pytest.raises(CalibrationError, match=r"llama\.pt.*omega.*disagrees"):
        TriAttentionManager(config, wrong, sim.k_pools, sim.v_pools, manager.library)
    with pytest.raises(ValueError, match="2 layers, got 1 K"):
        TriAttentionManager(config, tmp_path / "calib.pt", sim.k_pools[:1], sim.v_pools[:1], manager.library)
    with pytest.raises(ValueError, match="expected bfloat16"):
        TriAttentionManager(config, tmp_path / "calib.pt", [p.half() for p in sim.k_pools], sim.v_pools,
                            manager.library)
    manager.library.family = "llama-3.1-8b"
    with pytest.raises(ValueError, match="score library of 'llama-3.1-8b'"):
        TriAttentionManager(config, tmp_path / "calib.pt", sim.k_pools, sim.v_pools, manager.library)


@pytest.mark.parametrize("overrides, message", [
    (dict(eviction_mode="max"), "eviction_mode 'max'; accepted: union"),
    (dict(budget=100), "budget 100 < sliding window 128"),
    (dict(beta=0), "beta 0: expected a positive int"),
])
def test_overrides_are_checked_like_the_config(tmp_path: Path, overrides: dict, message: str) -> None:
    spec = small_spec(load_spec(SPECS / "gpt-oss-20b.yaml"), 2)
    sim = DecodeSim(eviction_config(spec), [10], [0], 64, torch.device("cpu"))
    manager, _ = _manager(spec, tmp_path, sim)
    with pytest.raises(ValueError, match=message):
        TriAttentionManager(manager.config, tmp_path / "calib.pt", sim.k_pools, sim.v_pools, manager.library,
                            **overrides)
    assert manager.config == eviction_config(spec), "overrides never change the config they start from"


# ---------------------------------------------------------------- from the registry


@dataclass
class _Entry:
    family: str
    layout: dict | None


@dataclass
class _Resolved:
    """Duck-types ``kvgen.runtime.lookup.Resolved``: ``entry.layout``, ``artifact(op)`` and
    ``dispatch(op)`` (no size-dispatched variants)."""

    entry: _Entry
    artifacts: dict = field(default_factory=dict)
    asked: list = field(default_factory=list)

    def artifact(self, op: str) -> Path:
        self.asked.append(op)
        return self.artifacts[op]

    def dispatch(self, op: str) -> tuple[Path, list]:
        return self.artifact(op), []


def _resolved(spec) -> _Resolved:
    """A registry entry as the build writes it: the layout JSON of the manifest, through JSON."""
    layout = json.loads(json.dumps(to_json(spec, family_layout(spec))))
    return _Resolved(_Entry(spec.name, layout))


def test_from_registry_runs_rounds_equal_to_the_oracle(tmp_path: Path) -> None:
    spec = small_spec(load_spec(SPECS / "gpt-oss-20b.yaml"), 4)
    sim = DecodeSim(eviction_config(spec), [13, 40], [0, 2], 260, torch.device("cpu"), seed=5, generated=[0, 5])
    path = save_synthetic_calibration(eviction_config(spec), tmp_path / "calib.pt")
    scorer, calibration = _scorer(spec, path, sim)
    resolved = _resolved(spec)
    g = tri_geometry(spec)
    stand_ins = {"score_library": scorer, "packer": oracle_packer(g),
                 "compactor": oracle_compactor(sim.k_pools, sim.v_pools, g), "selector": "oracle"}
    manager = TriAttentionManager.from_registry(resolved, path, sim.k_pools, sim.v_pools, budget=130, beta=16,
                                                **stand_ins)
    assert manager.config == dataclasses.replace(eviction_config(spec), budget=130, beta=16)
    assert resolved.asked == [], "what was given is not looked up"
    rounds = run_against_oracle(manager, sim, 130 + 3 * 16 + 10, calibration)
    assert len(rounds) >= 3


def test_from_registry_asks_for_the_artifacts_it_is_not_given(tmp_path: Path) -> None:
    spec = small_spec(load_spec(SPECS / "qwen3-8b.yaml"), 2)
    sim = DecodeSim(eviction_config(spec), [10], [0], 64, torch.device("cpu"))
    path = save_synthetic_calibration(eviction_config(spec), tmp_path / "calib.pt")
    scorer, _ = _scorer(spec, path, sim)
    resolved = _resolved(spec)
    resolved.artifacts = {op: tmp_path / f"missing-{op}" for op in ("score", "pack", "compact", "select")}
    with pytest.raises(LibraryError, match="missing-score: cannot load"):   # the registry's score library
        TriAttentionManager.from_registry(resolved, path, sim.k_pools, sim.v_pools)
    assert sorted(resolved.asked) == ["compact", "pack", "score", "select"]
    resolved.asked.clear()
    with pytest.raises(SelectModuleError, match="missing-select: no generated select module"):
        TriAttentionManager.from_registry(resolved, path, sim.k_pools, sim.v_pools, score_library=scorer,
                                          packer=object(), compactor=object())
    assert resolved.asked == ["select"]
    resolved.asked.clear()
    stand_in = object()
    manager = TriAttentionManager.from_registry(resolved, path, sim.k_pools, sim.v_pools, score_library=scorer,
                                                packer=stand_in, selector="oracle")
    assert resolved.asked == [] and manager.packer is stand_in


@pytest.mark.parametrize("family, reason", [
    ("deepseek-v3", "TriAttention cannot serve attention: mla"),
    ("glm-5", "TriAttention cannot serve attention"),
])
def test_from_registry_refuses_a_family_without_eviction(tmp_path: Path, family: str, reason: str) -> None:
    resolved = _resolved(load_spec(SPECS / f"{family}.yaml"))
    assert resolved.entry.layout["triattention"] is None
    with pytest.raises(GeometryError, match=f"{family}: no TriAttention eviction from the registry: {reason}"):
        TriAttentionManager.from_registry(resolved, tmp_path / "calib.pt", [], [])
    assert resolved.asked == []


def test_from_registry_names_an_older_manifest(tmp_path: Path) -> None:
    resolved = _resolved(load_spec(SPECS / "qwen3-8b.yaml"))
    for layout in ({k: v for k, v in resolved.entry.layout.items() if not k.startswith("triattention")}, None):
        resolved.entry.layout = layout
        with pytest.raises(GeometryError, match=r"qwen3-8b: .*older build.*kvgen build"):
            TriAttentionManager.from_registry(resolved, tmp_path / "calib.pt", [], [])


def test_from_registry_names_a_broken_entry(tmp_path: Path) -> None:
    resolved = _resolved(load_spec(SPECS / "qwen3-8b.yaml"))
    del resolved.entry.layout["triattention"]["geometry"]["layout"]
    with pytest.raises(ValueError, match=r"qwen3-8b: layout.triattention.geometry: missing key 'layout'"):
        TriAttentionManager.from_registry(resolved, tmp_path / "calib.pt", [], [])


BLOCKED = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "pydantic" or name.startswith(("kvgen.spec", "kvgen.lower", "kvgen.render",
                                                               "kvgen.build", "kvgen.tuning", "kvgen.bench",
                                                               "kvgen.demo", "kvgen.measure")):
            raise ImportError(name + " blocked")
sys.meta_path.insert(0, Block())
import kvgen.runtime.eviction
from kvgen.runtime.eviction import TriAttentionManager
assert not any(m.split(".")[0] == "pydantic" or m.startswith(("kvgen.spec", "kvgen.lower")) for m in sys.modules)
print("ok")
"""


def test_eviction_imports_without_spec_lower_or_pydantic(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, "-c", BLOCKED], cwd=tmp_path, env=env, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


class _Request:
    def __init__(self, request_id: str, prompt_len: int):
        self.request_id, self.prompt_len = request_id, prompt_len
