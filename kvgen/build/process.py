"""Compiler processes that never outlive the build that started them.

``run_in_group`` runs a compiler (nvcc, the CuTe DSL export, the score library's link) in its own
session, so its process group holds it and everything it spawns (nvcc runs cicc, ptxas, the host
compiler), under a small watchdog that is that group's leader. The group is killed with SIGKILL:

- by the build, when the compile times out or the waiting thread is interrupted
  (KeyboardInterrupt, an exception): ``run_in_group`` kills the group before re-raising, and
  ``kill_all`` kills every group still running (``compile_many`` calls it when interrupted);
- by the watchdog, when the build process is gone (``kill -9``, SIGTERM's default exit): it
  sees its parent change and kills its own group.

A group of its own also keeps a Ctrl-C at the terminal from reaching the compiler directly, so
the build decides what happens to it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence

# The group leader: runs the command, exits with its status, and kills the whole group (itself
# included) when its parent, the build, is no longer the process that started it.
_WATCHDOG = """
import os, signal, subprocess, sys
parent = os.getppid()
try:
    child = subprocess.Popen(sys.argv[1:])
except OSError as exc:
    sys.exit(f"cannot run {sys.argv[1]}: {exc}")
def kill_group(*_):
    os.killpg(0, signal.SIGKILL)
signal.signal(signal.SIGTERM, kill_group)
while True:
    try:
        code = child.wait(timeout=0.2)
    except subprocess.TimeoutExpired:
        if os.getppid() != parent:
            kill_group()
        continue
    sys.exit(code if code >= 0 else 128 - code)
"""

_live: set[subprocess.Popen] = set()
_live_lock = threading.Lock()


def run_in_group(cmd: Sequence[str], *, timeout: float, cwd: str | None = None,
                 env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, capture_output=True, text=True, timeout=...)`` with the command in a
    process group of its own, killed whole on a timeout or any interruption of the wait (then
    re-raised; a timeout as ``subprocess.TimeoutExpired`` carrying the output so far)."""
    proc = subprocess.Popen([sys.executable, "-c", _WATCHDOG, *cmd], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=cwd, env=None if env is None else dict(env),
                            start_new_session=True)
    with _live_lock:
        _live.add(proc)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        out, err = proc.communicate()
        raise subprocess.TimeoutExpired(list(cmd), timeout, out, err) from None
    except BaseException:
        kill_group(proc)
        raise
    finally:
        with _live_lock:
            _live.discard(proc)
    return subprocess.CompletedProcess(list(cmd), proc.returncode, out, err)


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the group ``proc`` leads (a group that is gone already is fine)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def kill_all() -> None:
    """Kill every compiler group this process still runs (an interrupted build)."""
    with _live_lock:
        running = list(_live)
    for proc in running:
        kill_group(proc)
