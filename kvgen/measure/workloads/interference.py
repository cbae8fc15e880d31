"""Offload and onboard beside the model's own work (``PERFORMANCE.md``, "Offload beside the model's
own work"), for ``kvgen bench run --only interference``.

Pages: ``hot_bytes`` of lifecycle-0 hot pages (the codec workload's pools: outlier channel, sources
scattered, cold slots in order), cold pages in pinned host memory. Foregrounds, each on its own
stream and timed alone first (``t`` per iteration): ``copy``, memory-bound (1 GiB ``copy_``), and
``gemm``, compute-bound (bf16 8192³ matmul). Transfers, each way, timed alone (``time_calls``)
then beside each foreground: the foreground runs ``N`` iterations spanning about twice the transfer
and both start together (``time_beside``). With ``W`` the transfer's time beside it and ``F`` the
foreground's, the foreground lost ``F - N t`` of work, and ran ``W / (W - lost)`` times slower while
the transfer ran. Fraction of pinned: cold bytes / transfer time / the pinned ceiling of that way
measured in the same run.

Strategies: ``staged`` (``ColdPageCodec.offload``: device staging ring + copy engine), ``zero-copy``
(the peer row: encode/decode straight into/from pinned host memory) and ``device-then-copy`` (the
whole batch encoded into device memory, then one copy-engine copy; onboard the other way: unbounded
staging, the reference point for the ring).

The SMs' share (``sm_bound``): whatever the strategy, a transfer's encode or decode is the same
kernel work, timed alone on the whole GPU into and from device memory (``codec_kernels``). At a
goal rate the transfer lasts ``cold bytes / (goal x pinned)``, so the codec needs that work's share
of the GPU for that long, and a foreground that keeps every SM busy for the whole time (a
compute-bound kernel with no idle tail) must cede the share: it runs at least ``1 / (1 - share)``
times slower. Where that floor exceeds the slowdown goal, no strategy meets both beside it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from statistics import median
from typing import Any

import torch

from kvgen.measure.timing import summary, time_beside, time_calls
from kvgen.measure.workloads.codec import CodecWorkload, reverse_pairs, scattered_pairs
from kvgen.runtime.codec import ColdPageCodec

STRATEGIES = ("staged", "zero-copy", "device-then-copy")
COPY_BYTES = 1 << 30
GEMM_N = 8192
ROUNDS = 5                 # beside runs per (strategy, direction, foreground); medians reported
SPAN = 2.0                 # the foreground runs about this many transfer lengths

Transfer = Callable[[torch.cuda.Stream], Any]


def foregrounds() -> dict[str, Callable[[], Any]]:
    """The model's stand-ins: a memory-bound copy and a compute-bound GEMM (inputs allocated once)."""
    a = torch.empty(COPY_BYTES, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    x = torch.randn(GEMM_N, GEMM_N, dtype=torch.bfloat16, device="cuda")
    y = torch.randn_like(x)
    z = torch.empty_like(x)
    return {"copy": lambda: b.copy_(a), "gemm": lambda: torch.matmul(x, y, out=z)}


class InterferenceWorkload:
    """One family's offload/onboard batch and its three strategies (see the module docstring)."""

    def __init__(self, layout: Any, dtype: str):
        self.codec_workload = CodecWorkload(layout, dtype)
        self.lc = layout.lifecycles[0]
        self.layout = layout

    def setup(self, library: Any, hot_bytes: int, staging_bytes: int | None = None) -> dict[str, Any]:
        pages = max(1, math.ceil(hot_bytes / self.lc.hot_page_bytes))
        pools = self.codec_workload.pools(pages, torch.Generator(device="cuda").manual_seed(0))
        codec = ColdPageCodec(library, self.layout, pools)
        codec.set_staging(staging_bytes)
        enc = scattered_pairs(0, pages)
        dec = reverse_pairs(enc)
        cold_pin = torch.empty(pages, self.lc.cold_page_bytes, dtype=torch.uint8).pin_memory()
        cold_dev = torch.empty(pages, self.lc.cold_page_bytes, dtype=torch.uint8, device="cuda")
        return {"pages": pages, "pools": pools, "codec": codec, "enc": enc, "dec": dec, "cold_pin": cold_pin,
                "cold_dev": cold_dev}

    @staticmethod
    def transfers(s: dict[str, Any]) -> dict[tuple[str, str], Transfer]:
        """(strategy, direction) -> a call enqueuing the transfer on the stream it is given."""
        codec, enc, dec, pin, dev = s["codec"], s["enc"], s["dec"], s["cold_pin"], s["cold_dev"]

        def device_offload(stream: torch.cuda.Stream) -> None:
            codec.encode(dev, enc, stream=stream)
            with torch.cuda.stream(stream):
                pin.copy_(dev, non_blocking=True)

        def device_onboard(stream: torch.cuda.Stream) -> None:
            with torch.cuda.stream(stream):
                dev.copy_(pin, non_blocking=True)
            codec.decode(dev, dec, stream=stream)

        return {
            ("staged", "offload"): lambda stream: codec.offload(pin, enc, stream=stream, strategy="staged"),
            ("staged", "onboard"): lambda stream: codec.onboard(pin, dec, stream=stream, strategy="staged"),
            ("zero-copy", "offload"): lambda stream: codec.offload(pin, enc, stream=stream, strategy="zero-copy"),
            ("zero-copy", "onboard"): lambda stream: codec.onboard(pin, dec, stream=stream, strategy="zero-copy"),
            ("device-then-copy", "offload"): device_offload,
            ("device-then-copy", "onboard"): device_onboard,
        }

    @staticmethod
    def codec_kernels(s: dict[str, Any]) -> dict[str, Transfer]:
        """direction -> the transfer's SM work alone: the batch encoded into / decoded from device memory."""
        codec, enc, dec, dev = s["codec"], s["enc"], s["dec"], s["cold_dev"]
        return {"offload": lambda stream: codec.encode(dev, enc, stream=stream),
                "onboard": lambda stream: codec.decode(dev, dec, stream=stream)}

    @staticmethod
    def staged_equals_zero_copy(s: dict[str, Any]) -> bool:
        """Both strategies write the same cold bytes (the format does not depend on the path)."""
        codec, enc, pin = s["codec"], s["enc"], s["cold_pin"]
        codec.offload(pin, enc, strategy="zero-copy")
        torch.cuda.synchronize()
        zero_copy = pin.clone()
        pin.zero_()
        codec.offload(pin, enc, strategy="staged")
        torch.cuda.synchronize()
        return bool(torch.equal(pin, zero_copy))


def sm_bound(kernels_ms: float, cold_bytes: int, pinned_gbps: float, fraction_of_pinned: float) -> dict[str, float]:
    """The codec's share of the GPU during a transfer at ``fraction_of_pinned`` of ``pinned_gbps``, and
    the least slowdown of a foreground that keeps every SM busy meanwhile (module docstring)."""
    transfer_ms = cold_bytes / (fraction_of_pinned * pinned_gbps * 1e6)
    share = kernels_ms / transfer_ms
    return {"kernels_ms": kernels_ms, "transfer_ms_at_goal": transfer_ms, "sm_share": share,
            "busy_foreground_floor": 1 / (1 - share) if share < 1 else math.inf}


def time_alone(fn: Callable[[], Any], reps: int) -> dict[str, float]:
    return summary(time_calls([fn], reps=reps, warmup=2))


def beside(transfer: Transfer, foreground: Callable[[], Any], fg_ms: float, transfer_ms: float) -> dict[str, float]:
    """The transfer beside ``iterations`` of the foreground, ``ROUNDS`` times: medians of the
    transfer's wall time, the foreground's lost work and its slowdown during the transfer."""
    iterations = max(3, math.ceil(SPAN * transfer_ms / fg_ms))
    bg, fg = torch.cuda.Stream(), torch.cuda.Stream()

    def run_foreground(stream: torch.cuda.Stream) -> None:
        for _ in range(iterations):
            foreground()

    walls, fg_times, losts = [], [], []
    for _ in range(ROUNDS):
        wall, fg_time = time_beside([transfer, run_foreground], [bg, fg])
        walls.append(wall)
        fg_times.append(fg_time)
        losts.append(max(0.0, fg_time - iterations * fg_ms))
    wall, lost = median(walls), median(losts)
    return {"wall_ms": wall, "foreground_ms": median(fg_times), "foreground_alone_ms": iterations * fg_ms,
            "foreground_lost_ms": lost, "iterations": iterations,
            "slowdown": wall / (wall - lost) if wall > lost else float("inf")}
