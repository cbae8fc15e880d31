"""Shared benchmark plumbing: CUDA-event timing, the physical ceilings, and the run record.

Every benchmark reports ratios against ceilings measured in the same process: ``kvgen bench run``
measures them once (``measure_ceilings``) and hands them to every benchmark; a benchmark run on its
own (``python -m kvgen.bench.codec``) measures them itself.

Paths (specs, generated sources, registries): ``kvgen.bench.paths``, re-exported here.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import subprocess
from pathlib import Path
from statistics import median
from typing import Callable

import torch

from kvgen.bench.paths import PACKAGE_ROOT, ROOT, project_root, set_specs_dir, spec_path, specs_dir  # noqa: F401


class NoGpu(RuntimeError):
    """The benchmarks need a CUDA device."""


def require_cuda() -> None:
    if not torch.cuda.is_available():
        cpu_build = "" if torch.version.cuda else "; this is a CPU build of torch"
        raise NoGpu(f"kvgen bench needs a CUDA GPU: torch {torch.__version__} sees none "
                    f"(torch.cuda.is_available() is False{cpu_build})")


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
    return {"bytes": nbytes, "gbps_read_plus_write": 2 * nbytes / t["median_ms"] / 1e6, **summary(t)}


def pinned_ceilings(nbytes: int = 1 << 30) -> dict[str, dict[str, float]]:
    """Pinned host bandwidth each way (GB/s), cudaMemcpy through torch."""
    host = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    d2h = time_ms(lambda: host.copy_(dev, non_blocking=True), reps=10)
    h2d = time_ms(lambda: dev.copy_(host, non_blocking=True), reps=10)
    return {"d2h": {"gbps": nbytes / d2h["median_ms"] / 1e6, **summary(d2h)},
            "h2d": {"gbps": nbytes / h2d["median_ms"] / 1e6, **summary(h2d)}}


def measure_ceilings(pinned: bool = True) -> dict[str, dict]:
    """The ceilings every benchmark divides by, measured once: device copy (2 GiB ``copy_``, read +
    written) and, with ``pinned``, pinned host memory each way (1 GiB). Frees what it allocated."""
    ceilings = {"device_copy": copy_ceiling()}
    torch.cuda.empty_cache()
    if pinned:
        ceilings["pinned"] = pinned_ceilings()
        torch.cuda.empty_cache()
    return ceilings


def summary(t: dict) -> dict:
    """A ``time_ms`` result without its samples (what the JSON records)."""
    return {k: v for k, v in t.items() if k != "samples_ms"}


L2_ROTATE_FACTOR = 3


def l2_bytes() -> int:
    return int(getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 60 << 20))


def rotation_sets(touched_bytes: int, set_bytes: int | None = None) -> int:
    """How many copies of the inputs the timed calls cycle through so that they touch at least 3x
    the L2 (each call touches ``touched_bytes`` distinct bytes); with ``set_bytes`` (one copy's
    size), no more copies than 85 % of the free memory holds."""
    wanted = max(1, math.ceil(L2_ROTATE_FACTOR * l2_bytes() / max(1, touched_bytes)))
    if set_bytes is None:
        return wanted
    free, _ = torch.cuda.mem_get_info()
    return max(1, min(wanted, int(0.85 * free // max(1, set_bytes))))


def time_rotated(calls: list[Callable[[], None]], reps: int = 20, warmup: int = 3) -> dict[str, float]:
    """``time_ms`` where call ``i`` runs ``calls[i % len(calls)]`` (inputs rotated past the L2)."""
    turn = iter(range(1 << 40))
    return time_ms(lambda: calls[next(turn) % len(calls)](), reps=reps, warmup=warmup)


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
        "commit": os.environ.get("KVGEN_COMMIT") or _git_commit(),
        "host": platform.node(),
    }


def _git_commit() -> str:
    """The checkout's short commit, ``+dirty`` with uncommitted changes; "unknown" without git."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=30,
                              cwd=PACKAGE_ROOT)
        if head.returncode != 0:
            return "unknown"
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, timeout=30, cwd=PACKAGE_ROOT)
        return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"


def _driver() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        return out.stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"


def registry_artifact(family: str, registry: Path, arch: str, op: str) -> Path:
    """The verified file serving ``op`` of ``family`` in ``registry`` for ``arch`` (a clear error
    naming the build command when it is not there)."""
    from kvgen.artifacts.manifest import manifest_path, read_manifest, verify_op

    path = manifest_path(registry, arch)
    manifest = read_manifest(path, verify=False)
    entry = manifest.family(family)
    if entry is None:
        raise LookupError(f"{family} is not in {path}; run: kvgen build --arch {arch} --family {family} "
                          f"--registry {registry}")
    return verify_op(path, manifest, entry, op)


def write_result(name: str, data: dict, tag: str = "") -> Path:
    """JSON under $OUT (device runs) or results/ (local); ``tag`` tells runs of one benchmark apart."""
    out_dir = Path(os.environ.get("OUT") or "results")
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}{'-' + tag if tag else ''}.json"
    path.write_text(json.dumps(data, indent=2) + "\n")
    return path
