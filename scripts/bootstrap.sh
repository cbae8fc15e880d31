#!/usr/bin/env bash
# Create (or refresh) the project's virtual environment in .venv with every toolchain kvgen
# drives on a GPU-less build machine: torch (CPU wheel, pinned so pip does not pull a CUDA
# build), Triton, CuTe DSL, optuna (+ a PostgreSQL driver, and a server if the system has none),
# nvcc 13.5 for sm_107a, and the test tools.
# Idempotent: a second run installs nothing new.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --disable-pip-version-check "torch==2.13.0"
.venv/bin/python -m pip install -q --disable-pip-version-check -e ".[triton,cute,tune,nvcc-rubin,dev,report,hf]"
# The shared-study test needs a real PostgreSQL server; where the system has none, take the one
# the `pgserver` wheel bundles (tests/pgserver.py looks for it after the system's).
if ! command -v pg_ctl >/dev/null 2>&1 && ! compgen -G "/usr/lib/postgresql/*/bin/pg_ctl" >/dev/null; then
  .venv/bin/python -m pip install -q --disable-pip-version-check pgserver
fi
