"""The one timer of kvgen's tools, the L2 rotation rule, and the physical ceilings.

``time_calls(calls, reps, warmup, clock)``: call ``i`` (warm-ups included) runs
``calls[i % len(calls)]``, so a list of closures over different copies of the inputs rotates them
past the L2; each timed call is bracketed on its own -- by CUDA events (``clock="cuda"``, kernel
time) or by the host clock with the device synchronized after it (``clock="wall"``: eager calls
whose host loops and syncs are part of the cost, and the CPU oracle). The result is the median and
the 20 % / 80 % quantiles in ms, raw samples kept (``summary`` drops them for JSON records).

``time_beside``: several streams started together, each one's time to its own end (interference).

``rotation_sets``: how many copies of the inputs make the timed calls touch at least 3x the L2.

Ceilings (``measure_ceilings``): device-to-device copy bandwidth and pinned host memory each way,
measured in the same process as the kernels they are compared with.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from statistics import median
from typing import Any, Literal

import torch

Clock = Literal["cuda", "wall"]
L2_ROTATE_FACTOR = 3
DEFAULT_L2_BYTES = 60 << 20      # an H100/H200's L2, for a device that does not report it
FREE_MEMORY_SHARE = 0.85         # rotation copies may take at most this share of the free memory


class NoGpu(RuntimeError):
    """A measurement that needs a CUDA device found none."""


def require_cuda(what: str = "kvgen bench") -> None:
    if not torch.cuda.is_available():
        cpu_build = "" if torch.version.cuda else "; this is a CPU build of torch"
        raise NoGpu(f"{what} needs a CUDA GPU: torch {torch.__version__} sees none "
                    f"(torch.cuda.is_available() is False{cpu_build})")


# ---------------------------------------------------------------- the timer


def clock_for(device: torch.device | str) -> Clock:
    """CUDA events on a GPU, the host clock on the CPU."""
    return "cuda" if torch.device(device).type == "cuda" else "wall"


def synchronize() -> None:
    """Wait for the device, in a process that has used it (a CPU run has nothing to wait for)."""
    if torch.cuda.is_initialized():   # the CPU demo and CPU tests never initialize CUDA
        torch.cuda.synchronize()


def time_once(fn: Callable[[], Any], clock: Clock = "cuda") -> tuple[Any, float]:
    """``fn()`` and its time in ms on ``clock`` (the device synchronized before the clock stops)."""
    if clock == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        value = fn()
        end.record()
        end.synchronize()
        return value, start.elapsed_time(end)
    if clock != "wall":
        raise ValueError(f"clock: expected 'cuda' or 'wall', got {clock!r}")
    begin = time.perf_counter()
    value = fn()
    synchronize()
    return value, (time.perf_counter() - begin) * 1e3


def quantiles(samples: Sequence[float]) -> dict[str, Any]:
    """Median, 20 % and 80 % quantiles (ms) of ``samples``, which are kept (sorted) as ``samples_ms``."""
    ordered = sorted(samples)
    if not ordered:
        raise ValueError("quantiles: no samples (reps must be >= 1)")
    return {"median_ms": median(ordered), "p20_ms": ordered[len(ordered) // 5],
            "p80_ms": ordered[(4 * len(ordered)) // 5], "samples_ms": ordered}


def time_calls(calls: Sequence[Callable[[], Any]], reps: int = 20, warmup: int = 3,
               clock: Clock = "cuda") -> dict[str, Any]:
    """``warmup`` untimed calls, then ``reps`` timed ones; call ``i`` runs ``calls[i % len(calls)]``."""
    if not calls:
        raise ValueError("time_calls: no calls to time")
    turn = 0
    for _ in range(warmup):
        calls[turn % len(calls)]()
        turn += 1
    synchronize()
    samples = []
    for _ in range(reps):
        samples.append(time_once(calls[turn % len(calls)], clock)[1])
        turn += 1
    return quantiles(samples)


def time_ms(fn: Callable[[], Any], reps: int = 20, warmup: int = 3, clock: Clock = "cuda") -> dict[str, Any]:
    """``time_calls`` of one call (inputs that already exceed the L2, or deliberately warm)."""
    return time_calls([fn], reps, warmup, clock)


def summary(t: dict) -> dict:
    """A timing without its samples (what the JSON records)."""
    return {k: v for k, v in t.items() if k != "samples_ms"}


HOLD_CYCLES = 10_000_000   # ~5 ms of GPU clock: the host enqueues every stream's work meanwhile


def time_beside(calls: Sequence[Callable[[torch.cuda.Stream], Any]], streams: Sequence[torch.cuda.Stream]) -> list[float]:
    """``calls[i](streams[i])`` started together (each stream waits on one start event, recorded
    after a spin kernel that holds the GPU while the host enqueues all of them) and each stream's
    time from that start to the end of its own work, in ms (CUDA events): how long each of several
    concurrent streams took beside the others (``kvgen.measure.workloads.interference``)."""
    torch.cuda._sleep(HOLD_CYCLES)
    start = torch.cuda.Event(enable_timing=True)
    start.record()
    ends = []
    for call, stream in zip(calls, streams):
        stream.wait_event(start)
        with torch.cuda.stream(stream):
            call(stream)
            end = torch.cuda.Event(enable_timing=True)
            end.record(stream)
        ends.append(end)
    for end in ends:
        end.synchronize()
    return [start.elapsed_time(end) for end in ends]


def capture(fn: Callable[[], Any]) -> torch.cuda.CUDAGraph:
    """``fn`` captured in a CUDA graph (run once on a side stream first, as capture requires)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


# ---------------------------------------------------------------- L2 rotation


def l2_bytes() -> int:
    return int(getattr(torch.cuda.get_device_properties(0), "L2_cache_size", DEFAULT_L2_BYTES))


def rotation_count(touched_bytes: int, l2: int, set_bytes: int | None = None, free_bytes: int | None = None) -> int:
    """The rotation rule: enough copies that the timed calls touch at least 3x ``l2`` (each call
    touches ``touched_bytes`` distinct bytes); with ``set_bytes`` (one copy's size) and
    ``free_bytes``, no more copies than 85 % of the free memory holds. At least one."""
    wanted = max(1, math.ceil(L2_ROTATE_FACTOR * l2 / max(1, touched_bytes)))
    if set_bytes is None or free_bytes is None:
        return wanted
    return max(1, min(wanted, int(FREE_MEMORY_SHARE * free_bytes // max(1, set_bytes))))


def rotation_sets(touched_bytes: int, set_bytes: int | None = None) -> int:
    """``rotation_count`` for GPU 0's L2 and, with ``set_bytes``, its free memory now."""
    free = torch.cuda.mem_get_info()[0] if set_bytes is not None else None
    return rotation_count(touched_bytes, l2_bytes(), set_bytes, free)


# ---------------------------------------------------------------- ceilings


COPY_CEILING_BYTES = 2 << 30   # the device copy ceiling's size, each way


def copy_ceiling(nbytes: int = COPY_CEILING_BYTES) -> dict[str, float]:
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
