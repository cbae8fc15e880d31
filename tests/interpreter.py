"""Run a worker program under Triton's interpreter (``TRITON_INTERPRET`` must be set before the
kernels are decorated, so every interpreted test runs its kernels in a fresh process)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def interpret(worker: str, *args: str, timeout: int = 900, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """``python -c worker args...`` on the CPU interpreter with the repository importable; asserts
    it exited 0 (its stderr's tail is the message) and returns the finished process."""
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", worker, *args], env=env, capture_output=True, text=True,
                          timeout=timeout, cwd=cwd)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc
