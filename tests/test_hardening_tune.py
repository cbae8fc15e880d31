"""Issue 15, ``kvgen tune`` crash-proofing: measurement lines with zero, negative, missing or
non-numeric times or keys are reported as ``file:line`` and skipped (a file with nothing usable is a
one-line error, exit 1, no traceback, no rich markup); the budget counts measured trials only, so a
study resumed after ``kill -9`` (a RUNNING trial left in its SQLite storage) or after an objective
that died without naming a failure measures exactly the configurations still missing.

Recorded measurements over the real qwen3-8b codec space (``tests/tuning_data``), no GPU.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from kvgen.cli import main
from kvgen.spec.schema import load_spec
from kvgen.tuning.space import configurations
from kvgen.tuning.study import RecordedEvaluator, counted, record_problem, run_bucket

from .conftest import ROOT, SPECS_DIR
from .tuning_data import use_grid_space, write_codec_measurements

QWEN = load_spec(SPECS_DIR / "qwen3-8b.yaml")
STUDY = "qwen3-8b/codec/sm_90a/large"


@pytest.fixture
def measurements(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    use_grid_space(monkeypatch.setitem)   # the grid strategy searches whole grids here
    return write_codec_measurements(tmp_path / "m.jsonl")


def _good(measurements: Path) -> dict:
    return json.loads(measurements.read_text().splitlines()[0])


BAD = {
    "zero time": {"median_ms": 0},
    "negative time": {"median_ms": -1.5},
    "missing time": {"median_ms": None},
    "text time": {"median_ms": "fast"},
    "bool time": {"median_ms": True},
    "nan time": {"median_ms": math.nan},
    "infinite p80": {"p80_ms": math.inf},
    "config not a string": {"config": 7},
    "no family": {"family": None},
    "status a number": {"status": 0},
}


@pytest.mark.parametrize("what", sorted(BAD))
def test_a_bad_measurement_line_is_named_and_skipped(measurements: Path, what: str) -> None:
    good = _good(measurements)
    bad = {k: v for k, v in {**good, **BAD[what]}.items() if v is not None}
    assert record_problem(bad)
    path = measurements.with_name("mixed.jsonl")
    path.write_text(json.dumps(bad) + "\n" + measurements.read_text() + "[1, 2]\n7\n")
    evaluator = RecordedEvaluator([path])
    lines = len(measurements.read_text().splitlines())
    assert [p.split(": ")[0] for p in evaluator.problems] == [f"{path}:1", f"{path}:{lines + 2}",
                                                              f"{path}:{lines + 3}"]
    assert all(p.endswith("skipped") for p in evaluator.problems)
    assert len(evaluator.records) == lines


def test_a_failed_measurement_needs_no_time(measurements: Path) -> None:
    assert record_problem({**_good(measurements), "status": "wrong", "median_ms": None}) is None


def test_tune_over_a_file_with_nothing_usable_is_a_plain_error(tmp_path: Path, measurements: Path, capsys) -> None:
    good = _good(measurements)
    path = tmp_path / "[bad]" / "m.jsonl"     # brackets: rich markup would swallow or crash on them
    path.parent.mkdir()
    path.write_text("".join(json.dumps({**good, **change}) + "\n" for change in BAD.values()) + "{torn")
    code = main(["tune", "--family", "qwen3-8b", "--op", "codec", "--measurements", str(path), "--no-write"])
    out = capsys.readouterr().out
    assert code == 1 and "Traceback" not in out
    assert f"error: {path}: no usable measurements ({len(BAD)} lines skipped, the first: {path}:1: median_ms 0 " \
           "is not a positive number" in out
    assert len(out.strip().splitlines()) == 1


def test_tune_with_some_bad_lines_still_searches(tmp_path: Path, measurements: Path, capsys) -> None:
    path = tmp_path / "with-bad.jsonl"
    path.write_text(measurements.read_text() + json.dumps({**_good(measurements), "median_ms": -1}) + "\n")
    code = main(["tune", "--family", "qwen3-8b", "--op", "codec", "--bucket", "large", "--strategy", "grid",
                 "--measurements", str(path), "--no-write", "--cache-dir", str(tmp_path / "cache")])
    out = capsys.readouterr().out
    assert code == 0 and f"{path}:{len(measurements.read_text().splitlines()) + 1}: median_ms -1" in out


def test_trials_below_one_is_a_usage_error(measurements: Path, capsys) -> None:
    assert main(["tune", "--family", "qwen3-8b", "--op", "codec", "--measurements", str(measurements),
                 "--trials", "0", "--no-write"]) == 2
    assert "--trials" in capsys.readouterr().out


# ---------------------------------------------------------------- budgets count measured trials only


class Counting:
    """The recorded evaluator, counting which configurations were measured."""

    def __init__(self, measurements: Path):
        self.inner = RecordedEvaluator([measurements])
        self.measured: list[str] = []

    def __call__(self, family, op, arch, bucket, params):
        from kvgen.tuning.space import config_id

        self.measured.append(config_id(op, params))
        return self.inner(family, op, arch, bucket, params)


KILLED_RUN = """
import os, signal, sys
from pathlib import Path
from kvgen.spec.schema import load_spec
from kvgen.tuning.study import RecordedEvaluator, run_bucket
from tests.tuning_data import use_grid_space
use_grid_space()                         # the space the measurements were written for
inner = RecordedEvaluator([Path(sys.argv[1])])
calls = []
def evaluator(*args):
    calls.append(1)
    if len(calls) == int(sys.argv[4]):       # kill -9 in the middle of this measurement
        os.kill(os.getpid(), signal.SIGKILL)
    return inner(*args)
run_bucket(load_spec(sys.argv[2]), "codec", "sm_90a", "large", evaluator, strategy=sys.argv[5], trials=16,
           storage=sys.argv[3], seed=3)
"""


def _kill_during(measurements: Path, storage: str, call: int, strategy: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", KILLED_RUN, str(measurements), str(SPECS_DIR / "qwen3-8b.yaml"),
                           storage, str(call), strategy], cwd=ROOT, capture_output=True, text=True, env=env)
    assert proc.returncode == -signal.SIGKILL, proc.stderr


@pytest.mark.parametrize("strategy, call", [("random", 1), ("random", 5), ("tpe", 6), ("grid", 4)])
def test_a_study_resumed_after_kill_9_measures_exactly_the_missing_configurations(
        tmp_path: Path, measurements: Path, strategy: str, call: int) -> None:
    storage = f"sqlite:///{tmp_path / 'studies.sqlite3'}"
    _kill_during(measurements, storage, call, strategy)
    study = optuna.load_study(study_name=STUDY, storage=storage)
    measured_before = {t.user_attrs["config"] for t in study.get_trials() if counted(t)}
    running = [t for t in study.get_trials() if t.state == TrialState.RUNNING]
    assert len(running) == 1 and len(measured_before) == call - 1
    evaluator = Counting(measurements)
    result = run_bucket(QWEN, "codec", "sm_90a", "large", evaluator, strategy=strategy, trials=16,
                        storage=storage, seed=3)
    target = len(configurations("codec", QWEN)) if strategy == "grid" else 16
    assert result.trials == target and len(result.measured) + result.failed == target
    assert len(evaluator.measured) == len(set(evaluator.measured)) == target - len(measured_before)
    assert not set(evaluator.measured) & measured_before
    assert running[0].user_attrs["config"] in evaluator.measured      # the interrupted one, measured now
    assert not math.isnan(result.default_ms)   # the baseline is measured even when its trial was the one killed


def test_an_objective_that_died_without_a_failure_kind_does_not_count(tmp_path: Path, measurements: Path) -> None:
    storage = f"sqlite:///{tmp_path / 'studies.sqlite3'}"
    inner = Counting(measurements)
    calls = []

    def interrupted(*args):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt   # Ctrl-C: optuna records the trial FAIL, without a failure kind
        return inner(*args)

    with pytest.raises(KeyboardInterrupt):
        run_bucket(QWEN, "codec", "sm_90a", "large", interrupted, strategy="random", trials=10, storage=storage,
                   seed=5)
    again = Counting(measurements)
    result = run_bucket(QWEN, "codec", "sm_90a", "large", again, strategy="random", trials=10, storage=storage,
                        seed=5)
    assert result.trials == 10 and len(again.measured) == len(set(again.measured)) == 8
    assert not set(again.measured) & set(inner.measured)
    # a second resume has nothing left to do and queues nothing twice
    third = Counting(measurements)
    assert run_bucket(QWEN, "codec", "sm_90a", "large", third, strategy="random", trials=10, storage=storage,
                      seed=5).trials == 10
    assert third.measured == []


@pytest.mark.parametrize("storage", ["nonsense", "sqlite:////nonexistent/dir/studies.sqlite3"])
def test_a_storage_that_cannot_be_opened_is_a_plain_error(measurements: Path, capsys, storage: str) -> None:
    assert main(["tune", "--family", "qwen3-8b", "--op", "codec", "--bucket", "large", "--measurements",
                 str(measurements), "--storage", storage, "--no-write"]) == 2
    out = capsys.readouterr().out
    assert f"error: --storage {storage}: cannot open it" in out and "Traceback" not in out


def test_an_environment_that_is_not_an_object_is_skipped(measurements: Path) -> None:
    assert record_problem({**_good(measurements), "environment": "H200"}) == "environment is not an object"
