"""The record of where a measurement ran (GPU, driver, torch, CUDA runtime, commit, host, date),
and where results are written."""

from __future__ import annotations

import datetime
import json
import platform
import subprocess
from pathlib import Path

import torch

from kvgen import paths


def environment() -> dict[str, str]:
    """GPU 0 and the software around it; the commit from ``$KVGEN_COMMIT`` or the checkout's git."""
    props = torch.cuda.get_device_properties(0)
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": props.name,
        "compute_capability": f"{props.major}.{props.minor}",
        "sms": props.multi_processor_count,
        "driver": driver_version(),
        "torch": torch.__version__,
        "cuda_runtime": torch.version.cuda or "",
        "commit": paths.commit() or git_commit(),
        "host": platform.node(),
    }


def git_commit() -> str:
    """The checkout's short commit, ``+dirty`` with uncommitted changes; "unknown" without git."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=30,
                              cwd=paths.PACKAGE_ROOT)
        if head.returncode != 0:
            return "unknown"
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, timeout=30, cwd=paths.PACKAGE_ROOT)
        return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"


def driver_version() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        return out.stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"


def write_result(name: str, data: dict, tag: str = "", out: Path | None = None) -> Path:
    """``<name>[-tag].json`` in ``paths.results_dir(out)`` ($OUT on device runs, else results/)."""
    out_dir = paths.results_dir(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}{'-' + tag if tag else ''}.json"
    path.write_text(json.dumps(data, indent=2) + "\n")
    return path
