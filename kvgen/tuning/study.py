"""The search: one optuna study per (family, op, arch, size bucket), over measured candidates.

A trial suggests a configuration, folds it onto its canonical form (``space.canonical``), and asks
an **evaluator** for its measurement:

- ``RecordedEvaluator``: measurements made on a GPU machine (``kvgen.tuning.measure``), the
  build/measure split: candidates built here, measured there, searched anywhere (Kernel Tuner's
  simulation mode, and how a build farm feeds a tuner);
- ``LiveEvaluator``: one machine with a GPU and a compiler: each trial builds its candidate
  (content-hash cache) and measures it in a fresh worker process.

A candidate that failed (build, load, launch, wrong result, crash, timeout) is a FAIL trial with
its failure kind in the trial's user attributes: optuna never picks it. A configuration whose
canonical form was measured already is a PRUNED trial: the budget (``--trials``) counts distinct
candidates, as GPU time does. The safe default is always trial 0, so every study has the baseline
its speed-up is computed against.

Storage: any optuna storage URL. The embedded default is SQLite (every finished trial is committed
before the next starts); trials left RUNNING by a killed process are marked FAIL ("interrupted")
when the study is opened again, and ``--trials N`` means N *counted* trials in total: a candidate
measured (COMPLETE) or refused for a reason of its own (FAIL with its failure kind). An
interrupted trial, or one whose objective died without naming a failure, measured nothing: it
does not count, is no twin of anything, and its configuration is queued again, so rerunning the
same command after ``kill -9`` measures exactly the missing configurations. A PostgreSQL URL lets several workers share a study; each stops when the
study holds N finished trials.
"""

from __future__ import annotations

import math
import os
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Protocol

import optuna
from optuna.trial import TrialState

from kvgen.lower.plan import TUNABLES, Op, default_params
from kvgen.spec.schema import FamilySpec
from kvgen.tuning.measure import numbered_records
from kvgen.tuning.space import STRATEGIES, canonical, config_id, configurations, parse_config

WORKER = f"{socket.gethostname()}:{os.getpid()}"
FINISHED = (TrialState.COMPLETE, TrialState.FAIL)
INTERRUPTED = "interrupted"


class CandidateFailed(Exception):
    """A candidate that must never be picked (its failure kind is in the trial's attributes)."""


@dataclass(frozen=True)
class Measurement:
    status: str                   # "ok" or a failure kind
    median_ms: float = math.nan
    detail: str = ""
    extra: Mapping[str, Any] = field(default_factory=dict)


class Evaluator(Protocol):
    def __call__(self, family: str, op: Op, arch: str, bucket: str, params: Mapping[str, int]) -> Measurement: ...


class RecordedEvaluator:
    """Measurements from JSON-lines files written by ``kvgen.tuning.measure``. A line that is not
    a usable measurement (a key missing or of the wrong type, a time that is not a positive
    finite number) is skipped and reported in ``problems`` as ``file:line: what is wrong``. A
    kernel recorded more than once for a bucket counts once (``fastest``)."""

    def __init__(self, paths: list[Path]):
        self.records: dict[tuple, dict[str, Any]] = {}
        self.problems: list[str] = []
        for path in paths:
            if not Path(path).is_file():
                raise FileNotFoundError(f"{path}: no such measurement file")
            for line, record in numbered_records(path):
                problem = record_problem(record)
                if problem:
                    self.problems.append(f"{path}:{line}: {problem}; skipped")
                    continue
                key = tuple(record[k] for k in RECORD_KEYS)
                self.records[key] = fastest(self.records.get(key), record)
        if not self.records:
            raise ValueError(f"{', '.join(map(str, paths))}: no usable measurements"
                             + (f" ({len(self.problems)} lines skipped, the first: {self.problems[0]})"
                                if self.problems else ""))

    def environment(self, family: str, op: Op, arch: str) -> dict[str, Any]:
        for (f, o, a, _, _), r in self.records.items():
            if (f, o, a) == (family, op, arch) and r.get("environment"):
                return dict(r["environment"])
        return {}

    def __call__(self, family: str, op: Op, arch: str, bucket: str, params: Mapping[str, int]) -> Measurement:
        r = self.records.get((family, op, arch, bucket, config_id(op, params)))
        if r is None:
            return Measurement("missing", detail=f"{family} {op} {arch} {bucket} {config_id(op, params)}: "
                                                 "not in the measurement files (build and measure it first)")
        if r["status"] != "ok":
            return Measurement(r["status"], detail=str(r.get("failure", "")))
        return Measurement("ok", r["median_ms"], extra={k: r[k] for k in ("p20_ms", "p80_ms", "size") if k in r})


RECORD_KEYS = ("family", "op", "arch", "bucket", "config")


def fastest(earlier: Mapping[str, Any] | None, record: Mapping[str, Any]) -> Mapping[str, Any]:
    """Of two records of one kernel and bucket (a repeat, or files passed together), the one a
    search uses: a failure is not hidden by a pass, and of two passes the faster median counts,
    since timing noise on a shared GPU (clocks, a neighbour) only ever slows a kernel down."""
    if earlier is None:
        return record
    if (earlier["status"] == "ok") != (record["status"] == "ok"):
        return earlier if earlier["status"] != "ok" else record
    if record["status"] != "ok":
        return record
    return record if record["median_ms"] < earlier["median_ms"] else earlier


def _ms(value: Any, low: float) -> bool:
    """A finite number of milliseconds above ``low`` (0: at least 0)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        return False
    return value > low if low else value >= 0


def record_problem(record: Any) -> str | None:
    """Why a measurement line cannot be used (None: it can)."""
    if not isinstance(record, dict):
        return f"not a measurement object ({type(record).__name__})"
    bad = [k for k in (*RECORD_KEYS, "status") if not isinstance(record.get(k), str)]
    if bad:
        return f"{', '.join(bad)} missing or not a string (a measurement needs {', '.join(RECORD_KEYS)}, status)"
    if not isinstance(record.get("environment", {}), dict):
        return "environment is not an object"
    if record["status"] != "ok":
        return None
    if not _ms(record.get("median_ms"), 1e-9):   # the search divides by it: a zero time is no measurement
        return f"median_ms {record.get('median_ms')!r} is not a positive number of milliseconds"
    for key in ("p20_ms", "p80_ms"):
        if key in record and not _ms(record[key], 0):
            return f"{key} {record[key]!r} is not a number of milliseconds"
    return None


# ---------------------------------------------------------------------------------------------
# Studies
# ---------------------------------------------------------------------------------------------


def study_name(family: str, op: Op, arch: str, bucket: str, fixed: Mapping[str, int] | None = None) -> str:
    """One study per subspace: a search with parameters fixed never resumes the whole space's."""
    name = f"{family}/{op}/{arch}/{bucket}"
    return f"{name}[{','.join(f'{k}={v}' for k, v in sorted(fixed.items()))}]" if fixed else name


def sampler_for(strategy: str, op: Op, seed: int | None,
                fixed: Mapping[str, int] | None = None) -> optuna.samplers.BaseSampler:
    if strategy == "tpe":
        # one random trial after the default (trial 0): the budgets are a quarter of spaces of 16 to 81
        return optuna.samplers.TPESampler(seed=seed, n_startup_trials=2, multivariate=True)
    if strategy == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    if strategy == "grid":
        return optuna.samplers.GridSampler({n: list(range(len(TUNABLES[op][n][0]))) for n in searched(op, fixed)},
                                           seed=seed)
    raise ValueError(f"strategy {strategy!r}; accepted: {', '.join(STRATEGIES)}")


def connect(storage: str | optuna.storages.BaseStorage, attempts: int = 5) -> optuna.storages.BaseStorage:
    """The storage behind a URL. Workers starting together on a fresh database all try to create
    its schema and all but one fail (PostgreSQL: a duplicate type); those retry and find it made."""
    import sqlalchemy.exc

    for attempt in range(1, attempts):
        try:
            return optuna.storages.get_storage(storage)
        except sqlalchemy.exc.ArgumentError:
            break   # not a URL: retrying will not help
        except sqlalchemy.exc.DBAPIError:
            time.sleep(0.2 * attempt)
    try:
        return optuna.storages.get_storage(storage)
    except (sqlalchemy.exc.SQLAlchemyError, ValueError) as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise StorageError(f"--storage {storage}: cannot open it ({reason})") from None


class StorageError(ValueError):
    """An optuna storage URL that does not parse or whose database cannot be opened."""


def open_study(name: str, storage: str | optuna.storages.BaseStorage, sampler) -> optuna.Study:
    """Create or load; in the embedded (SQLite, one writer) storage, trials a killed process left
    RUNNING become FAIL ("interrupted")."""
    embedded = isinstance(storage, str) and storage.startswith("sqlite")
    storage = connect(storage)
    study = optuna.create_study(study_name=name, storage=storage, sampler=sampler, direction="minimize",
                                load_if_exists=True)
    if embedded:
        for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            storage.set_trial_user_attr(trial._trial_id, "failure", INTERRUPTED)
            storage.set_trial_state_values(trial._trial_id, TrialState.FAIL)
    _requeue_uncounted(study)
    return study


def counted(trial: optuna.trial.FrozenTrial) -> bool:
    """Whether a trial measured its candidate: COMPLETE, or FAIL for a failure of the candidate
    (not an interrupted trial, nor one whose objective raised without naming a failure)."""
    if trial.state == TrialState.COMPLETE:
        return True
    failure = trial.user_attrs.get("failure")
    return trial.state == TrialState.FAIL and failure is not None and failure != INTERRUPTED


def _requeue_uncounted(study: optuna.Study) -> None:
    """Queue once more the configuration of every failed trial that does not count, unless a
    counted trial has it or it is queued already (each resume adds nothing twice)."""
    trials = study.get_trials(deepcopy=False)
    measured = {t.user_attrs.get("config") for t in trials if counted(t)}
    queued = {tuple(sorted(t.params.items())) for t in trials if t.state == TrialState.WAITING}
    for t in trials:
        key = tuple(sorted(t.params.items()))
        if t.state != TrialState.FAIL or counted(t) or t.user_attrs.get("config") in measured or key in queued:
            continue
        if t.params:
            study.enqueue_trial(dict(t.params), user_attrs={k: v for k, v in t.user_attrs.items() if k == "role"})
            queued.add(key)


def ordinal(op: Op, params: Mapping[str, int]) -> dict[str, int]:
    """Parameters as positions in their declared (ascending) choices: the sampler sees ordered
    numbers, so TPE can learn that 256 threads lies between 128 and 512 (categorical choices
    would make every value a stranger to its neighbours)."""
    return {n: TUNABLES[op][n][0].index(v) for n, v in params.items()}


def finished(study: optuna.Study) -> int:
    """Trials counted against the budget (see ``counted``)."""
    return sum(counted(t) for t in study.get_trials(deepcopy=False, states=FINISHED))


def stop_at(target: int) -> Callable[[optuna.Study, optuna.trial.FrozenTrial], None]:
    """Stop the study once it holds ``target`` counted trials (optuna's MaxTrialsCallback would
    count interrupted ones)."""
    def callback(study: optuna.Study, _trial: optuna.trial.FrozenTrial) -> None:
        if finished(study) >= target:
            study.stop()

    return callback


def searched(op: Op, fixed: Mapping[str, int] | None) -> list[str]:
    """The parameters a trial suggests; the fixed ones take their one value."""
    return [n for n in TUNABLES[op] if not fixed or n not in fixed]


def grid_size(op: Op, fixed: Mapping[str, int] | None = None) -> int:
    return math.prod(len(TUNABLES[op][n][0]) for n in searched(op, fixed))


def make_objective(spec: FamilySpec, op: Op, arch: str, bucket: str, evaluator: Evaluator,
                   study: optuna.Study, fixed: Mapping[str, int] | None = None) -> Callable[[optuna.Trial], float]:
    names = searched(op, fixed)

    def objective(trial: optuna.Trial) -> float:
        suggested = {n: TUNABLES[op][n][0][trial.suggest_int(n, 0, len(TUNABLES[op][n][0]) - 1)] for n in names}
        # the default trial is the whole default (the baseline), fixed parameters included
        base = default_params(op) if trial.user_attrs.get("role") == "default" else dict(fixed or {})
        params = {**default_params(op), **base, **suggested}
        trial.set_user_attr("worker", WORKER)   # shared studies: which machine/process ran it
        canon = canonical(op, params, spec)
        trial.set_user_attr("config", config_id(op, canon))
        twin = _measured_twin(study, config_id(op, canon), trial.number)
        if twin is not None:
            # the same kernel is measured already: a pruned trial (not counted against the budget,
            # never timed twice); the twin's value is reported so the sampler still learns from it
            trial.set_user_attr("duplicate_of", twin.number)
            if twin.state == TrialState.COMPLETE:
                trial.report(twin.value, 0)
            raise optuna.TrialPruned()
        m = evaluator(spec.name, op, arch, bucket, canon)
        if m.status != "ok":
            trial.set_user_attr("failure", m.status)
            trial.set_user_attr("detail", m.detail[:300])
            raise CandidateFailed(f"{m.status}: {m.detail[:200]}")
        for key, value in m.extra.items():
            trial.set_user_attr(key, value)
        return m.median_ms

    return objective


def _measured_twin(study: optuna.Study, config: str, number: int) -> optuna.trial.FrozenTrial | None:
    for t in study.get_trials(deepcopy=False, states=FINISHED):
        if t.number != number and t.user_attrs.get("config") == config and counted(t):
            return t
    return None


@dataclass
class BucketResult:
    bucket: str
    study: str
    strategy: str
    trials: int
    failed: int
    best: dict[str, int] | None
    best_ms: float
    default: dict[str, int]
    default_ms: float
    failures: dict[str, int]                        # failure kind -> trials
    measured: dict[str, float]                      # config id -> median ms (complete, distinct)
    spread: dict[str, float] = field(default_factory=dict)   # config id -> p80 / p20 (where recorded)

    @property
    def speedup(self) -> float:
        return self.default_ms / self.best_ms if self.best_ms and not math.isnan(self.default_ms) else math.nan


def run_bucket(spec: FamilySpec, op: Op, arch: str, bucket: str, evaluator: Evaluator, *, strategy: str = "tpe",
               trials: int | None = None, storage: str | optuna.storages.BaseStorage = "sqlite:///:memory:",
               seed: int | None = 0, on_trial: Callable[[optuna.trial.FrozenTrial], None] | None = None,
               fixed: Mapping[str, int] | None = None) -> BucketResult:
    """Run (or resume) one study until it holds ``trials`` finished trials (grid: the whole grid),
    over the subspace with the ``fixed`` parameters held (``--fix``; the default trial stays whole)."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    name = study_name(spec.name, op, arch, bucket, fixed)
    study = open_study(name, storage, sampler_for(strategy, op, seed, fixed))
    study.set_user_attr("strategy", strategy)
    distinct = len(configurations(op, spec, fixed))
    target = distinct if strategy == "grid" else min(trials or distinct, distinct)
    default = canonical(op, default_params(op), spec)
    if not study.get_trials(deepcopy=False):
        default_trial = {n: v for n, v in default_params(op).items() if n in searched(op, fixed)}
        study.enqueue_trial(ordinal(op, default_trial), user_attrs={"role": "default"})
        if fixed and any(default_params(op)[k] != v for k, v in fixed.items()):
            # the default trial took this grid point with the default's values: visit it with the fixed ones
            study.enqueue_trial(ordinal(op, default_trial))
    objective = make_objective(spec, op, arch, bucket, evaluator, study, fixed)
    callbacks = [stop_at(target)]
    if on_trial is not None:
        callbacks.append(lambda _study, trial: on_trial(trial) if counted(trial) else None)
    if finished(study) < target:
        # duplicates are pruned and do not count: cap the attempts (the grid stops itself when exhausted)
        attempts = grid_size(op, fixed) + 1 if strategy == "grid" else 50 * target
        study.optimize(objective, n_trials=attempts, catch=(CandidateFailed,), callbacks=callbacks)
    return summarize(study, bucket, op, strategy, default)


def summarize(study: optuna.Study, bucket: str, op: Op, strategy: str, default: dict[str, int]) -> BucketResult:
    trials = [t for t in study.get_trials(deepcopy=False, states=FINISHED) if counted(t)]
    complete = [t for t in trials if t.state == TrialState.COMPLETE]
    failures: dict[str, int] = {}
    for t in trials:
        if t.state == TrialState.FAIL:
            kind = t.user_attrs.get("failure", "failed")
            failures[kind] = failures.get(kind, 0) + 1
    measured = {t.user_attrs["config"]: t.value for t in complete}
    spread = {t.user_attrs["config"]: t.user_attrs["p80_ms"] / t.user_attrs["p20_ms"] for t in complete
              if t.user_attrs.get("p20_ms", 0) > 0 and t.user_attrs.get("p80_ms", 0) > 0}
    best = min(complete, key=lambda t: t.value) if complete else None
    default_id = config_id(op, default)
    return BucketResult(
        bucket=bucket, study=study.study_name, strategy=strategy, trials=len(trials),
        failed=len(trials) - len(complete),
        best=parse_config(best.user_attrs["config"]) if best else None, best_ms=best.value if best else math.nan,
        default=default, default_ms=measured.get(default_id, math.nan), failures=failures, measured=measured,
        spread=spread)
