"""Shared benchmark plumbing: CUDA-event timing, the physical ceilings, and the run record.

Every benchmark measures its ceilings in the same process and reports ratios against them.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
from pathlib import Path
from statistics import median
from typing import Callable

import torch


def time_ms(fn: Callable[[], None], reps: int = 20, warmup: int = 3) -> dict[str, float]:
    """Median and quantiles of per-call times (ms), each call bracketed by its own CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end))
    samples.sort()
    return {"median_ms": median(samples), "p20_ms": samples[len(samples) // 5],
            "p80_ms": samples[(4 * len(samples)) // 5], "samples_ms": samples}


def copy_ceiling(nbytes: int = 2 << 30) -> dict[str, float]:
    """Device-to-device copy bandwidth, bytes read + written per second (GB/s)."""
    a = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    t = time_ms(lambda: b.copy_(a), reps=10)
    return {"bytes": nbytes, "gbps_read_plus_write": 2 * nbytes / t["median_ms"] / 1e6, **_short(t)}


def pinned_ceilings(nbytes: int = 1 << 30) -> dict[str, dict[str, float]]:
    """Pinned host bandwidth each way (GB/s), cudaMemcpy through torch."""
    host = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    d2h = time_ms(lambda: host.copy_(dev, non_blocking=True), reps=10)
    h2d = time_ms(lambda: dev.copy_(host, non_blocking=True), reps=10)
    return {"d2h": {"gbps": nbytes / d2h["median_ms"] / 1e6, **_short(d2h)},
            "h2d": {"gbps": nbytes / h2d["median_ms"] / 1e6, **_short(h2d)}}


def _short(t: dict) -> dict:
    return {k: v for k, v in t.items() if k != "samples_ms"}


def environment() -> dict[str, str]:
    props = torch.cuda.get_device_properties(0)
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": props.name,
        "compute_capability": f"{props.major}.{props.minor}",
        "sms": props.multi_processor_count,
        "driver": _driver(),
        "torch": torch.__version__,
        "cuda_runtime": torch.version.cuda or "",
        "commit": os.environ.get("KVGEN_COMMIT", "unknown"),
        "host": platform.node(),
    }


def _driver() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        return out.stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"


def write_result(name: str, data: dict, tag: str = "") -> Path:
    """JSON under $OUT (device runs) or results/ (local); ``tag`` tells runs of one benchmark apart."""
    out_dir = Path(os.environ.get("OUT") or "results")
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}{'-' + tag if tag else ''}.json"
    path.write_text(json.dumps(data, indent=2) + "\n")
    return path
