"""The autotuner without a GPU: search space, studies over recorded measurements (the build/measure
split's search half), resume after a kill, tuned-config files and what ``kvgen build`` does with
them. Measurements are files in the format the GPU side writes (tests/tuning_data.py); the GPU
side itself runs in tests/gpu/test_tuning_gpu.py.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from kvgen.lower.plan import TUNABLES, default_params
from kvgen.lower.tuned import (
    BuildEnvironment,
    TuningFileError,
    build_choice,
    load_tuned,
    parse_override,
    tuning_path,
    write_op,
)
from kvgen.spec.schema import load_spec
from kvgen.tuning.space import canonical, config_id, configurations, parse_config
from kvgen.tuning.study import RecordedEvaluator, run_bucket, study_name

from .conftest import ROOT, SPECS_DIR
from .tuning_data import ENV, OPTIMUM, WRONG, bowl, use_grid_space, write_codec_measurements

QWEN = load_spec(SPECS_DIR / "qwen3-8b.yaml")


# ---------------------------------------------------------------- space


def test_space_folds_configurations_that_compile_to_the_same_kernel() -> None:
    # group 4: max_heads 4, 8 and 16 are one pass of 4 heads -> one kernel
    assert canonical("score", {"threads": 128, "max_heads": 16, "lanes": 2, "token_tiles": 1}, QWEN)["max_heads"] == 4
    falcon = load_spec(SPECS_DIR / "falcon-7b.yaml")   # group 71: every max_heads is another split
    assert {canonical("score", {**default_params("score"), "max_heads": m}, falcon)["max_heads"]
            for m in (4, 8, 16)} == {4, 8, 16}
    configs = configurations("score", QWEN)
    # form 0: threads x lanes x token_tiles x tokens_per_thread x (prefetch 0/1 without the shared-memory
    # ring, or a ring of 2, 3 or 4 stages, which folds prefetch to 0) x unpack 0/1: 3 x 3 x 7 x 3 x 5 x 2;
    # max_heads folds to one; plus the bulk ring (2, 3 or 4 stages) for one token per thread: 3 x 3 x 7 x 3 x 2.
    # form 1: threads x token_tiles x ring stages x mma_tiles x mag_mma = 3 x 7 x 3 x 3 x 2 = 378 before the
    # rings that do not fit the shared-memory budget fold onto smaller ones: 182 distinct
    assert len([c for c in configs if c["form"] == 0]) == 1890 + 378
    assert len([c for c in configs if c["form"] == 1]) == 182
    assert len({config_id("score", c) for c in configs}) == len(configs)
    assert canonical("score", {**default_params("score"), "smem_stages": 2, "prefetch": 1}, QWEN)["prefetch"] == 0
    bulk = canonical("score", {**default_params("score"), "bulk_stages": 2, "smem_stages": 3, "prefetch": 1}, QWEN)
    assert (bulk["bulk_stages"], bulk["smem_stages"], bulk["prefetch"]) == (2, 0, 0)
    # the bulk ring holds one token per thread: with more it is not that kernel
    assert canonical("score", {**default_params("score"), "bulk_stages": 2, "tokens_per_thread": 2},
                     QWEN)["bulk_stages"] == 0
    # bf16's shift / mask widening: one kernel for fp8 K whatever unpack says
    fp8 = load_spec(SPECS_DIR / "qwen3-8b-fp8.yaml")
    assert canonical("score", {**default_params("score"), "unpack": 1}, fp8)["unpack"] == 0
    assert configs[0] == canonical("score", default_params("score"), QWEN)   # the default is first
    # every other codec tunable changes the kernel (min_blocks 1 is not min_blocks 0: ptxas then
    # allocates registers differently even where the cap is above 255); decode_split 2 folds into 1
    # on decode_route 0 (no half-block route there): 3 (route, split) pairs instead of 4; rounding 3
    # (FP8 hot pages only) folds into 2 on bf16 and rounding 4 (BF16's packed route) into 3 on fp8:
    # 4 roundings instead of 5; decode_pages folds into 1 on decode_load 0 (the register copy has no
    # load in flight to overlap): 1 + 2 x 3 (load, pages) pairs instead of 9; decode_min_blocks equal to
    # min_blocks folds into -1 (the same kernels): 7 x 3 - 2 (min_blocks, decode_min_blocks) pairs
    codec = configurations("codec", QWEN)
    others = [len(choices) for name, (choices, _) in TUNABLES["codec"].items()
              if name not in ("decode_route", "decode_split", "rounding", "decode_load", "decode_pages", "min_blocks",
                              "decode_min_blocks")]
    assert len(codec) == math.prod(others) * 3 * 4 * 7 * 19
    fp8 = load_spec(SPECS_DIR / "qwen3-8b-fp8.yaml")  # no half blocks (1 split)
    assert len(configurations("codec", fp8)) == math.prod(others) * 2 * 4 * 7 * 19
    assert canonical("codec", {**default_params("codec"), "min_blocks": 5, "decode_min_blocks": 5},
                     QWEN)["decode_min_blocks"] == -1
    paged = {**default_params("codec"), "decode_pages": 4}
    assert [canonical("codec", {**paged, "decode_load": load}, QWEN)["decode_pages"] for load in (0, 1, 2)] == [1, 4, 4]
    # the default rounding 4 is bf16's packed route; qwen3-8b-fp8 builds its own (3)
    assert [configurations("codec", s)[0]["rounding"] for s in (fp8, QWEN)] == [3, 4]


# ---------------------------------------------------------------- studies over recorded measurements


@pytest.fixture()
def measurements(tmp_path: Path) -> Path:
    return write_codec_measurements(tmp_path / "m.jsonl")


@pytest.fixture()
def grid_measurements(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    use_grid_space(monkeypatch.setitem)
    return write_codec_measurements(tmp_path / "m.jsonl")


def test_grid_finds_the_exact_best_and_never_picks_a_wrong_candidate(grid_measurements: Path) -> None:
    evaluator = RecordedEvaluator([grid_measurements])
    for bucket, best in OPTIMUM.items():
        result = run_bucket(QWEN, "codec", "sm_90a", bucket, evaluator, strategy="grid")
        assert result.best == best
        assert result.best_ms == pytest.approx(1.0)
        assert result.failures == {"wrong": 1} and config_id("codec", WRONG) not in result.measured
        # every distinct configuration but the wrong one; grid duplicates reused, not re-measured
        assert len(result.measured) == len(configurations("codec", QWEN)) - 1
        assert result.default_ms == pytest.approx(bowl(default_params("codec"), bucket))


def test_tpe_runs_the_requested_trials_starting_from_the_default(tmp_path: Path, measurements: Path) -> None:
    storage = f"sqlite:///{tmp_path / 's.db'}"
    result = run_bucket(QWEN, "codec", "sm_90a", "large", RecordedEvaluator([measurements]), strategy="tpe",
                        trials=8, seed=3, storage=storage)
    assert result.trials == 8 and result.best_ms <= result.default_ms
    first = optuna.load_study(study_name=result.study, storage=storage).trials[0]
    assert first.user_attrs["role"] == "default" and first.user_attrs["config"] == config_id(
        "codec", canonical("codec", default_params("codec"), QWEN))


def test_missing_measurements_are_failed_trials_with_a_reason(tmp_path: Path, grid_measurements: Path) -> None:
    lines = [json.loads(line) for line in grid_measurements.read_text().splitlines()]
    kept = [r for r in lines if not (r["bucket"] == "large" and r["params"]["threads"] == 512)]
    partial = tmp_path / "partial.jsonl"
    partial.write_text("\n".join(json.dumps(r) for r in kept) + "\n")
    result = run_bucket(QWEN, "codec", "sm_90a", "large", RecordedEvaluator([partial]), strategy="grid")
    dropped = sum(c["threads"] == 512 for c in configurations("codec", QWEN))
    assert result.failures.get("missing") == dropped and result.best["threads"] != 512


SUBSPACE = {"rounding": 4, "decode_route": 1, "min_blocks": 0, "decode_min_blocks": -1, "hot_batch": 1,
            "decode_split": 2, "decode_load": 1, "decode_pages": 1, "encode_store": 1}


def test_a_fixed_subspace_is_searched_whole_with_its_default_and_nothing_else(tmp_path: Path) -> None:
    """``--fix``: the grid visits threads x in_flight only, all of them measured (no "missing"),
    in a study of its own; fixed away from the default, the default is still the baseline."""
    assert len(configurations("codec", QWEN, SUBSPACE)) == 16
    fp8 = load_spec(SPECS_DIR / "qwen3-8b-fp8.yaml")   # fixed before folding: route 4 is 3 on fp8 pages
    assert {c["rounding"] for c in configurations("codec", fp8, SUBSPACE)} == {3}
    evaluator = RecordedEvaluator([write_codec_measurements(tmp_path / "m.jsonl", fixed=SUBSPACE)])
    result = run_bucket(QWEN, "codec", "sm_90a", "large", evaluator, strategy="grid", fixed=SUBSPACE)
    assert result.trials == 16 and result.failures == {} and len(result.measured) == 16
    assert result.study == study_name("qwen3-8b", "codec", "sm_90a", "large", SUBSPACE) != study_name(
        "qwen3-8b", "codec", "sm_90a", "large")
    assert result.bucket == "large"   # the bucket, not the study's subspace suffix
    assert result.best == {**SUBSPACE, "threads": 512, "in_flight": 4}
    away = {**SUBSPACE, "threads": 512}
    evaluator = RecordedEvaluator([write_codec_measurements(tmp_path / "away.jsonl", fixed=away)])
    result = run_bucket(QWEN, "codec", "sm_90a", "large", evaluator, strategy="grid", fixed=away)
    assert result.failures == {} and len(result.measured) == 5   # the default and in_flight 1-8 at 512
    assert result.default_ms == pytest.approx(bowl(default_params("codec"), "large"))


def test_the_search_evidence_replays_a_fixed_subspace_measured_whole(tmp_path: Path) -> None:
    """``kvgen.tuning.evidence --fix``: the exhaustive reference is the subspace a ``--fix`` bundle
    measured (its 16 launch shapes, the default among them), so no trial is lost to a missing one."""
    from kvgen.tuning.evidence import main as evidence

    measured = write_codec_measurements(tmp_path / "m.jsonl", fixed=SUBSPACE)
    fix = ",".join(f"{k}={v}" for k, v in SUBSPACE.items())
    assert evidence([str(measured), "--out", str(tmp_path / "e"), "--seeds", "2", "--fix", fix]) == 0
    large = next(r for r in json.loads((tmp_path / "e" / "evidence.json").read_text()) if r["bucket"] == "large")
    assert large["candidates"] == 16 and large["failed"] == {} and large["fixed"] == SUBSPACE
    assert parse_config(large["exhaustive_best"]) == {**default_params("codec"), **SUBSPACE, "threads": 512,
                                                      "in_flight": 4}
    with pytest.raises(SystemExit):
        evidence([str(measured), "--out", str(tmp_path / "e"), "--fix", "threads=96"])


def test_fix_names_what_is_wrong_with_it(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from kvgen.cli import main

    for fix, says in (("thread=256", "--fix thread=256: no parameter 'thread' in codec"),
                      ("threads=96", "--fix threads=96: codec accepts threads in (64, 128, 256, 512)"),
                      ("threads", "expected name=value")):
        rc = main(["tune", "--family", "qwen3-8b", "--op", "codec", "--build-only", "--bundle", str(tmp_path / "b"),
                   "--fix", fix])
        assert rc == 2 and says in capsys.readouterr().out
        assert not (tmp_path / "b").exists()


def test_a_dotted_bundle_name_keeps_its_dots_in_the_archive(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """build/tune/cs-qwen3.5-397b-a17b packed as cs-qwen3.5-397b-a17b.tar.xz, not cs-qwen3.tar.xz."""
    import kvgen.tuning.candidates as candidates
    from kvgen.cli import main

    def build_nothing(requests, arch, bundle, *args, **kwargs):   # noqa: ANN001, ANN202 - the packing is under test
        Path(bundle).mkdir(parents=True)
        return []

    monkeypatch.setattr(candidates, "build_candidates", build_nothing)
    bundle = tmp_path / "cs-qwen3.5-397b-a17b"
    assert main(["tune", "--family", "qwen3.5-397b-a17b", "--op", "compact", "--build-only", "--bundle", str(bundle),
                 "--fix", "threads=256,tile_tokens=32,slices=1"]) == 0
    assert [p.name for p in tmp_path.glob("*.tar.xz")] == ["cs-qwen3.5-397b-a17b.tar.xz"]


def test_selection_candidates_build_into_a_bundle(tmp_path: Path) -> None:
    """``--op select``: the selection libraries (Triton AOT) of a subspace, radix_bits 8 folded to 4
    on the comparison route (one candidate, not two), the Triton release recorded for the measure step."""
    from kvgen.cli import main
    from kvgen.tuning.candidates import read_bundle

    bundle = tmp_path / "sel"
    fix = ("rows=1,stats_unroll=4,stats_resident=16384,stats_warps=16,block_w=64,aggregate_warps=2,block=4096,"
           "select_warps=16,aggregate_route=0,head_step=0")   # the queue's parameters fold away under route 0
    assert main(["tune", "--family", "qwen3-8b", "--op", "select", "--build-only", "--bundle", str(bundle),
                 "--fix", fix, "--cache-dir", str(tmp_path / "cache")]) == 0
    index = read_bundle(bundle)
    from kvgen.lower.plan import default_params

    routes = [(c["params"]["select_route"], c["params"]["radix_bits"]) for c in index["candidates"]]
    default = default_params("select")
    assert len(routes) == 8 and routes[0] == (default["select_route"], default["radix_bits"])   # the default first
    assert sorted(routes[1:]) == [(0, 1), (0, 2), (0, 4), (1, 1), (1, 2), (1, 4), (1, 8)]
    assert all(c["status"] in ("built", "hit") and c["artifact"].endswith(".so") for c in index["candidates"])
    assert index["toolchains"]["triton"] and (tmp_path / "sel.tar.xz").is_file()


def test_a_killed_tune_resumes_without_losing_a_finished_trial(tmp_path: Path, measurements: Path) -> None:
    storage = f"sqlite:///{tmp_path / 'studies.sqlite3'}"
    script = f"""
import os, signal
from pathlib import Path
from kvgen.spec.schema import load_spec
from kvgen.tuning.study import RecordedEvaluator, run_bucket
inner = RecordedEvaluator([Path({str(measurements)!r})])
calls = []
def evaluator(*args):
    calls.append(1)
    if len(calls) == 6:                      # killed in the middle of the 6th measurement
        os.kill(os.getpid(), signal.SIGKILL)
    return inner(*args)
run_bucket(load_spec({str(SPECS_DIR / 'qwen3-8b.yaml')!r}), "codec", "sm_90a", "large", evaluator,
           strategy="random", trials=12, storage={storage!r}, seed=1)
"""
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == -9, proc.stderr
    study = optuna.load_study(study_name="qwen3-8b/codec/sm_90a/large", storage=storage)
    before = {t.number: t.value for t in study.get_trials() if t.state == TrialState.COMPLETE}
    assert len([t for t in study.get_trials() if t.state == TrialState.RUNNING]) == 1
    result = run_bucket(QWEN, "codec", "sm_90a", "large", RecordedEvaluator([measurements]), strategy="random",
                        trials=12, storage=storage, seed=1)
    study = optuna.load_study(study_name="qwen3-8b/codec/sm_90a/large", storage=storage)
    trials = study.get_trials()
    after = {t.number: t.value for t in trials if t.state == TrialState.COMPLETE}
    assert before.items() <= after.items()                       # nothing finished was lost or redone
    interrupted = [t for t in trials if t.user_attrs.get("failure") == "interrupted"]
    assert len(interrupted) == 1 and interrupted[0].state == TrialState.FAIL
    assert result.trials == 12 and not [t for t in trials if t.state == TrialState.RUNNING]


def test_two_workers_share_one_study_on_a_real_postgresql_server(tmp_path: Path, postgres_url: str) -> None:
    # A subspace keeps the measurement file small.
    fixed = {"decode_load": 1, "decode_pages": 1, "encode_store": 1}
    measurements = write_codec_measurements(tmp_path / "m.jsonl", fixed=fixed)
    cmd = [sys.executable, "-m", "kvgen.cli", "tune", "--family", "qwen3-8b", "--op", "codec", "--arch", "sm_90a",
           "--bucket", "offload", "--strategy", "random", "--trials", "12", "--measurements", str(measurements),
           "--storage", postgres_url, "--no-write", "--fix", ",".join(f"{k}={v}" for k, v in fixed.items())]
    # Each worker reads the measurements, then waits for the other at a file barrier before it tunes:
    # with recorded measurements a trial is instant, so on a loaded machine one worker could
    # otherwise finish the study before the other has read its file.
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    script = (f"import pathlib, sys, time; import kvgen.cli, kvgen.tuning.study as study\n"
              f"b = pathlib.Path({str(barrier)!r}); read = study.RecordedEvaluator.__init__\n"
              f"def read_then_wait(self, *args):\n"
              f"    read(self, *args); (b / sys.argv[-1]).touch()\n"
              f"    while len(list(b.iterdir())) < 2: time.sleep(0.01)\n"
              f"study.RecordedEvaluator.__init__ = read_then_wait\n"
              f"sys.exit(kvgen.cli.main(sys.argv[1:]))")
    workers = [subprocess.Popen([sys.executable, "-c", script, *cmd[3:], "--seed", str(seed)], cwd=ROOT,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for seed in (1, 2)]
    outputs = [w.communicate(timeout=300)[0] for w in workers]
    assert all(w.returncode == 0 for w in workers), outputs
    study = optuna.load_study(study_name=study_name("qwen3-8b", "codec", "sm_90a", "offload", fixed),
                              storage=postgres_url)
    trials = study.get_trials(states=(TrialState.COMPLETE, TrialState.FAIL))
    assert 12 <= len(trials) <= 13          # each worker stops once the study holds 12 (one may be in flight)
    assert len({t.number for t in trials}) == len(trials)
    assert len({t.user_attrs["worker"] for t in trials}) == 2      # both did work
    assert study.best_value == min(bowl(parse_config(t.user_attrs["config"]), "offload")
                                   for t in trials if t.state == TrialState.COMPLETE)


# ---------------------------------------------------------------- tuned-config files and the build


def test_build_choice_is_the_best_geometric_mean_over_buckets() -> None:
    per_bucket = {"a": {"d": 1.0, "x": 0.5, "y": 0.8}, "b": {"d": 1.0, "x": 1.6, "y": 0.8}, "c": {"d": 1.0, "x": 0.5}}
    assert build_choice(per_bucket, "d") == "x"   # y is not measured in c; x: 2 * 0.625 * 2 > 1
    assert build_choice({"a": {"x": 1.0}}, "d") == "d"


def test_a_kernel_measured_twice_counts_its_faster_median_and_a_failure_sticks(tmp_path: Path) -> None:
    """Bit-exact status, timing by the faster repeat: noise only slows a kernel."""
    first = write_codec_measurements(tmp_path / "a.jsonl")
    rows = [json.loads(line) for line in first.read_text().splitlines()]
    slow = [{**r, "median_ms": r["median_ms"] * 2} if r["status"] == "ok" else {**r, "status": "ok", "median_ms": 1.0}
            for r in rows]
    second = tmp_path / "b.jsonl"
    second.write_text("\n".join(json.dumps(r) for r in slow) + "\n")
    for paths in ([first, second], [second, first]):
        evaluator = RecordedEvaluator(paths)
        assert evaluator(QWEN.name, "codec", "sm_90a", "large", WRONG).status == "wrong"
        fast = evaluator(QWEN.name, "codec", "sm_90a", "large", default_params("codec"))
        assert fast.median_ms == bowl(canonical("codec", default_params("codec"), QWEN), "large")


def test_build_choice_counts_a_bucket_only_beyond_its_noise() -> None:
    """The H200 case: a latency-bound bucket 10 % faster inside a 29 % p80/p20 spread must not
    outvote a bulk bucket lost by 1.7 %, and gains under the margin keep the default."""
    per_bucket = {"small": {"d": 0.0388, "x": 0.0351}, "large": {"d": 0.727, "x": 0.739},
                  "offload": {"d": 11.72, "x": 11.70}}
    spread = {"small": {"d": 1.29, "x": 1.10}, "large": {"d": 1.005, "x": 1.005}}
    assert build_choice(per_bucket, "d", spread) == "d"
    assert build_choice(per_bucket, "d", spread, margin=0.0) == "d"   # the small bucket's spread still ties it
    assert build_choice(per_bucket, "d", margin=0.0) == "x"           # no noise known: raw geometric mean
    assert build_choice({"large": {"d": 1.0, "x": 0.9}}, "d") == "x"  # 11 % beyond a 3.5 % margin


def _env(**over) -> BuildEnvironment:
    return BuildEnvironment(over.get("kvgen", "0.1.0"), over.get("toolchains", {"nvcc": "13.0.88"}), over.get("gpu"))


def _write(tuning: Path, params: dict) -> Path:
    return write_op(tuning, "qwen3-8b", "sm_90a", "codec", {"params": params, "default": default_params("codec"),
                                                             "buckets": {}}, ENV)


def test_tuned_configs_apply_only_where_their_environment_matches(tmp_path: Path) -> None:
    params = {"threads": 512, "in_flight": 2, "rounding": 1}
    _write(tmp_path, params)
    tuned = load_tuned(tmp_path, {"sm_90a": _env()}, ["qwen3-8b"], environ={})
    assert tuned.for_family("sm_90a", "qwen3-8b") == {"codec": params} and not tuned.notes
    for env, why in ((_env(toolchains={"nvcc": "13.5.1"}), "nvcc '13.0.88', building with 13.5.1"),
                     (_env(gpu="NVIDIA B200"), "tuned on NVIDIA H200, this machine has NVIDIA B200"),
                     (_env(kvgen="0.2.0"), "kvgen '0.1.0', building with 0.2.0")):
        tuned = load_tuned(tmp_path, {"sm_90a": env}, ["qwen3-8b"], environ={})
        assert tuned.for_family("sm_90a", "qwen3-8b") == {}
        assert len(tuned.notes) == 1 and why in tuned.notes[0] and "safe defaults" in tuned.notes[0]
    off = load_tuned(tmp_path, {"sm_90a": _env()}, ["qwen3-8b"], environ={"KVGEN_TUNING": "off"})
    assert off.for_family("sm_90a", "qwen3-8b") == {} and "KVGEN_TUNING=off" in off.notes[0]


def test_a_tampered_tuned_config_is_named_and_the_defaults_are_used(tmp_path: Path) -> None:
    path = _write(tmp_path, {"threads": 512, "in_flight": 2, "rounding": 1})
    data = json.loads(path.read_text())
    data["ops"]["codec"]["params"]["threads"] = 96
    path.write_text(json.dumps(data))
    tuned = load_tuned(tmp_path, {"sm_90a": _env()}, ["qwen3-8b"], environ={})
    assert tuned.for_family("sm_90a", "qwen3-8b") == {}
    assert str(path) in tuned.notes[0] and "threads=96 is not one of" in tuned.notes[0]


def test_environment_override_wins_and_bad_overrides_are_named() -> None:
    tuned = load_tuned(Path("/nonexistent"), {"sm_90a": _env()}, ["qwen3-8b"],
                       environ={"KVGEN_TUNED_PARAMS": "qwen3-8b:codec:threads=128; qwen3-8b:score:lanes=4"})
    assert tuned.for_family("sm_90a", "qwen3-8b") == {"codec": {"threads": 128}, "score": {"lanes": 4}}
    with pytest.raises(TuningFileError, match="'qwen3-8b:codec:threads=100'.*not one of"):
        parse_override("qwen3-8b:codec:threads=100")
    with pytest.raises(TuningFileError, match="format: family:op:name=value"):
        parse_override("qwen3-8b:codec")


def test_tune_writes_a_config_the_build_compiles(tmp_path: Path, grid_measurements: Path) -> None:
    """kvgen tune over recorded measurements -> tuning/sm_90a/qwen3-8b.json -> the build renders it."""
    from kvgen.cli import main
    from kvgen.render.source import render_family

    tuning = tmp_path / "tuning"
    rc = main(["tune", "--family", "qwen3-8b", "--op", "codec", "--arch", "sm_90a", "--strategy", "grid",
               "--measurements", str(grid_measurements), "--storage", f"sqlite:///{tmp_path / 's.db'}",
               "--tuning", str(tuning)])
    assert rc == 0
    data = json.loads(tuning_path(tuning, "sm_90a", "qwen3-8b").read_text())
    entry = data["ops"]["codec"]
    assert {b: v["best"] for b, v in entry["buckets"].items()} == OPTIMUM
    assert entry["params"] == {"threads": 512, "in_flight": 4, "rounding": 1, "decode_route": 1,  # best geometric mean
                               "min_blocks": 1, "decode_min_blocks": -1,                    # over the three bowls
                               "hot_batch": 1, "decode_split": 1,
                               "decode_load": 0, "decode_pages": 1, "encode_store": 0}
    env = entry["environment"]
    assert env["gpu"] == "NVIDIA H200" and env["toolchain"]["nvcc"] == "13.0.88"
    tuned = load_tuned(tuning, {"sm_90a": _env()}, ["qwen3-8b"], environ={})
    source = render_family(QWEN, params=tuned.for_family("sm_90a", "qwen3-8b"))["qwen3-8b/codec.cu"]
    assert "codec::Codec<Layer, 512, 4>" in source


# ---------------------------------------------------------------- the build side of the split


def test_candidates_build_into_a_bundle_that_packs_and_unpacks(tmp_path: Path) -> None:
    """Real nvcc builds of two codec candidates, compiled as ``kvgen build`` compiles them (its
    build of the default is then a cache hit); the archive carries the same files and index; a
    foreign index is a clear error naming the file."""
    from kvgen.build.job import load_spec_source
    from kvgen.build.pipeline import build
    from kvgen.cli import discover_toolchains
    from kvgen.tuning.candidates import Request, build_candidates, pack_bundle, read_bundle, read_index, unpack_bundle

    source = load_spec_source(SPECS_DIR / "qwen3-8b-fp8.yaml")
    default = default_params("codec")
    requests = [Request(source, "codec", default),
                Request(source, "codec", {**default, "threads": 512, "in_flight": 8, "rounding": 0})]
    bundle = tmp_path / "bundle"
    built = build_candidates(requests, "sm_90a", bundle, tmp_path / "cache", toolchains=discover_toolchains())
    assert [c.status for c in built] == ["built", "built"] and len({c.artifact for c in built}) == 2
    assert read_bundle(bundle)["toolchains"]["nvcc"].startswith("13.")
    report = build([source], ["sm_90a"], tmp_path / "generated", tmp_path / "cache", toolchains=discover_toolchains(),
                   registry_dir=tmp_path / "registry", tuning_dir=tmp_path / "tuning", tuning_environ={})
    (outcome,) = [o for o in report.outcomes if o.backend == "nvcc"]
    assert (outcome.status, outcome.key) == ("hit", built[0].key)     # the default candidate is the build's
    archive = pack_bundle(bundle, tmp_path / "bundle.tar.xz")
    assert archive.stat().st_size < sum((bundle / c.artifact).stat().st_size for c in built)
    out = unpack_bundle(archive, tmp_path / "unpacked")
    assert read_index(out) == built
    assert all((out / c.artifact).read_bytes() == (bundle / c.artifact).read_bytes() for c in built)
    (out / "bundle.json").write_text('{"schema": 99}')
    with pytest.raises(ValueError, match=r"unpacked/bundle.json: bundle schema 99"):
        read_index(out)


def test_measuring_without_a_gpu_says_where_to_measure(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "kvgen.tuning.measure", str(tmp_path), "--out", str(tmp_path / "m")],
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 2 and "needs a CUDA GPU" in proc.stderr


def test_tune_without_measurements_or_gpu_is_a_clear_error(capsys) -> None:
    from kvgen.cli import main

    assert main(["tune", "--family", "qwen3-8b", "--op", "codec", "--no-write"]) == 2
    assert "no CUDA GPU here" in capsys.readouterr().out
    assert main(["tune", "--family", "qwen3-8b", "--op", "pack", "--no-write"]) == 2


def test_bad_measurement_files_are_named_with_what_is_wrong(tmp_path: Path, capsys) -> None:
    from kvgen.cli import main

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"family": "qwen3-8b"}\n')
    for path, why in ((bad, f"{bad}:1: op, arch, bucket, config, status missing"), (tmp_path / "none.jsonl", "no such")):
        assert main(["tune", "--family", "qwen3-8b", "--op", "codec", "--measurements", str(path),
                     "--no-write"]) == 1
        out = capsys.readouterr().out
        assert str(path) in out and why in out


def test_the_tensor_core_form_serves_bf16_and_e4m3_k_in_whole_pair_chunks_from_16_bytes() -> None:
    """``mma_form_fits``: a pair chunk is what one ``ldmatrix.x4`` gives a lane row (32 bytes of re and
    of im: 32 bf16 or 64 fp8 elements of rotated span), and each row's span starts 16-byte aligned."""
    from kvgen.kernels.cute.geometry import mma_form_fits

    assert mma_form_fits("bf16", 0, 128, "half") and mma_form_fits("bf16", 8, 32, "half")
    assert mma_form_fits("fp8_e4m3", 0, 128, "half") and mma_form_fits("fp8_e4m3", 16, 64, "half")
    assert not mma_form_fits("fp8_e4m3", 0, 96, "half")        # 48 pairs: not whole 32-pair chunks
    assert not mma_form_fits("fp8_e4m3", 8, 128, "half")       # 8 bytes in: no 16-byte bulk copy
    assert not mma_form_fits("bf16", 0, 48, "half") and not mma_form_fits("bf16", 4, 128, "half")
    assert not mma_form_fits("fp16", 0, 128, "half") and not mma_form_fits("bf16", 0, 128, "interleaved")


def test_the_tensor_core_form_folds_where_it_cannot_serve_and_ignores_the_other_forms_params() -> None:
    """Form 1 (score_mma.py) serves bf16 and fp8 E4M3 K with half pairs only; it reads mma_tiles /
    mag_mma and takes bulk_stages as its ring depth, form 0 reads neither: each form's unread
    parameters are folded to their defaults, so the space holds each kernel once."""
    mma = {**default_params("score"), "form": 1, "lanes": 4, "prefetch": 1, "tokens_per_thread": 2, "mag_mma": 1}
    folded = canonical("score", mma, QWEN)
    assert folded["form"] == 1 and folded["mag_mma"] == 1
    assert {k: folded[k] for k in ("lanes", "prefetch", "tokens_per_thread", "smem_stages", "unpack")} == {
        k: default_params("score")[k] for k in ("lanes", "prefetch", "tokens_per_thread", "smem_stages", "unpack")}
    assert folded["bulk_stages"] == 3                          # 0 is not a ring: the default depth
    fp8 = canonical("score", mma, load_spec(SPECS_DIR / "qwen3-8b-fp8.yaml"))   # E4M3 widened in registers
    assert fp8["form"] == 1 and fp8["mag_mma"] == 1
    other = canonical("score", mma, load_spec(SPECS_DIR / "mistral-7b.yaml"))   # fp16 K: form 0
    assert other["form"] == 0 and other["mma_tiles"] == 1 and other["mag_mma"] == 0
    # a ring that does not fit the shared-memory budget takes fewer MMA tiles, then stages, then warps
    gemma = load_spec(SPECS_DIR / "gemma-2-9b.yaml")          # 512-byte rows
    wide = canonical("score", {**mma, "threads": 256, "mma_tiles": 4, "bulk_stages": 4}, gemma)
    assert (wide["mma_tiles"], wide["bulk_stages"], wide["threads"]) == (1, 2, 128)
    # an old record without the form's parameters is form 0
    old = {k: v for k, v in default_params("score").items() if k not in ("form", "mma_tiles", "mag_mma")}
    assert canonical("score", old, QWEN) == canonical("score", default_params("score"), QWEN)


def test_every_tunable_op_names_the_toolchain_its_entries_are_checked_against() -> None:
    """A measured entry of any op loads (the first measured select entries met a KeyError)."""
    from kvgen.lower.plan import TUNABLES
    from kvgen.lower.tuned import OP_TOOLCHAIN

    assert set(OP_TOOLCHAIN) == set(TUNABLES)
