"""optuna studies shared across processes through a real PostgreSQL server (tests/pgserver.py)."""

from __future__ import annotations

import subprocess
import sys

import optuna  # the `tune` extra, which scripts/bootstrap.sh installs

# Each worker is its own interpreter, as a tuning worker on another host would be: it only
# knows the study name and the storage URL.
WORKER = """
import sys
import optuna

optuna.logging.set_verbosity(optuna.logging.WARNING)
study = optuna.load_study(study_name=sys.argv[1], storage=sys.argv[2])
study.optimize(lambda trial: trial.suggest_float("x", -1.0, 1.0) ** 2, n_trials=3)
"""


def test_two_processes_share_one_study(postgres_url):
    storage = optuna.storages.RDBStorage(postgres_url)
    study = optuna.create_study(study_name="shared", storage=storage)

    # Started together, so their trials interleave in the one database.
    workers = [
        subprocess.Popen(
            [sys.executable, "-c", WORKER, study.study_name, postgres_url],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for _ in range(2)
    ]
    for worker in workers:
        output, _ = worker.communicate(timeout=60)
        assert worker.returncode == 0, output

    trials = study.get_trials(deepcopy=False)
    assert [t.state for t in trials] == [optuna.trial.TrialState.COMPLETE] * 6
    assert sorted(t.number for t in trials) == list(range(6))
