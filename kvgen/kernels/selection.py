"""The host side of normalize -> aggregate -> select (TRIATTENTION.md §4-§5), whoever launches the
kernels: ``kvgen.kernels.triton.select.TritonSelector`` (Triton JIT, a checkout's
``generated/<family>/select.py``) and ``kvgen.runtime.select.SelectLibrary`` (the same kernels
compiled ahead of time into ``lib<symbol>_select.so``) both subclass ``SelectionHost``.

It checks every host-side fact (dtypes, shapes, devices, budget), allocates the outputs, and hands
plain tensors and sizes to three ``_launch_*`` hooks. It needs torch only: no Triton, so a kernel
wheel's AOT selection runs without it. The kernels' compile-time constants are stated here once
(``*_constants``): the JIT launches pass them, the AOT build compiles exactly them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

MODES = ("union", "per_head", "per_layer_perhead")
MOVE_FILL = -1
# Both restate kvgen.reference.triattention (kvgen.kernels imports nothing of kvgen); a test
# checks that they agree.
STD_FLOOR = 1e-6
REDUCTION_LANES = 512
LOG2_LANES = REDUCTION_LANES.bit_length() - 1


def next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


@dataclass(frozen=True)
class Selection:
    """What a decision leaves on the device: kept positions ``[B, R, budget]`` int64 and the NaN
    count of each decision row. ``check`` reads the counts back (one synchronization)."""

    kept: torch.Tensor
    nan_rows: torch.Tensor

    def check(self) -> torch.Tensor:
        """``kept``, or the oracle's error when a valid decision value is NaN."""
        if bool(self.nan_rows.any()):
            raise ValueError("NaN among the decision values")
        return self.kept


def mode_index(mode: str) -> int:
    if mode not in MODES:
        raise ValueError(f"eviction_mode {mode!r}; accepted: {', '.join(MODES)}")
    return MODES.index(mode)


class SelectionHost:
    """Normalize -> aggregate -> select for one family: its layers, KV heads, query heads per KV
    head, scored layers, and the launch tunables (``kvgen.lower.plan.TUNABLES["select"]``:
    ``rows`` statistics rows per program, ``stats_unroll`` steps of their columns loaded at once,
    ``stats_resident`` columns a statistics program holds to read a row once (0: twice),
    ``block_w`` columns per aggregation program, ``block`` columns per selection step,
    ``radix_bits`` bits of the budget-th key found per pass, ``select_route`` how a pass counts
    (0 comparisons, 1 histogram), the warps per program of each kernel, and ``aggregate_route``:
    0 launches the statistics and the aggregation apart, 1 as one queue (``_queue_kernel``) of
    ``chunk_requests`` requests a chunk, aggregated ``queue_lag`` chunks after their statistics, on
    ``queue_programs`` programs a SM at the statistics' warps; ``head_step`` query heads an
    aggregation step holds, 0: all of an item's heads at once)."""

    def __init__(self, num_layers: int, kv_heads: int, group: int, scored_layers: Sequence[int], *,
                 rows: int, stats_unroll: int, stats_resident: int, stats_warps: int, block_w: int,
                 aggregate_warps: int, block: int, radix_bits: int, select_route: int, select_warps: int,
                 aggregate_route: int, chunk_requests: int, queue_lag: int, queue_programs: int, head_step: int):
        if stats_resident % REDUCTION_LANES:
            raise ValueError(f"stats_resident {stats_resident}: must be a multiple of {REDUCTION_LANES}")
        if aggregate_route not in (0, 1) or min(chunk_requests, queue_lag, queue_programs) < 1:
            raise ValueError(f"aggregate_route {aggregate_route} (0 or 1), chunk_requests {chunk_requests}, queue_lag "
                             f"{queue_lag} and queue_programs {queue_programs} (at least 1)")
        if head_step < 0 or head_step & (head_step - 1):
            raise ValueError(f"head_step {head_step}: 0 (every head at once) or a power of two")
        self.num_layers, self.kv_heads, self.group = num_layers, kv_heads, group
        self.query_heads = kv_heads * group
        self.scored_layers = tuple(scored_layers)
        self.rows, self.stats_unroll, self.stats_resident = rows, stats_unroll, stats_resident
        self.block_w, self.block, self.radix_bits, self.select_route = block_w, block, radix_bits, select_route
        self.num_warps = {"statistics": stats_warps, "aggregate": aggregate_warps, "select": select_warps,
                          "queue": stats_warps}
        self.aggregate_route, self.chunk_requests, self.queue_lag = aggregate_route, chunk_requests, queue_lag
        self.queue_programs, self.head_step = queue_programs, head_step
        self._layers: dict[torch.device, torch.Tensor] = {}

    def tunables(self) -> dict[str, int]:
        """The launch tunables this host was built with, by their plan names (the constructor's keywords)."""
        return {"rows": self.rows, "stats_unroll": self.stats_unroll, "stats_resident": self.stats_resident,
                "stats_warps": self.num_warps["statistics"], "block_w": self.block_w,
                "aggregate_warps": self.num_warps["aggregate"], "block": self.block, "radix_bits": self.radix_bits,
                "select_route": self.select_route, "select_warps": self.num_warps["select"],
                "aggregate_route": self.aggregate_route, "chunk_requests": self.chunk_requests,
                "queue_lag": self.queue_lag, "queue_programs": self.queue_programs, "head_step": self.head_step}

    def num_decision_rows(self, mode: str) -> int:
        return (1, self.kv_heads, self.num_layers * self.kv_heads)[mode_index(mode)]

    def layer_table(self, device: torch.device) -> torch.Tensor:
        """int32 ``[scored]``: the cache layer of each scored layer, copied once per device."""
        device = torch.device(device)
        if device not in self._layers:
            self._layers[device] = torch.tensor(self.scored_layers, dtype=torch.int32, device=device)
        return self._layers[device]

    # ---- the kernels' compile-time constants (one specialization each; aggregate one per mode)

    def stats_constants(self) -> dict[str, int | float]:
        return {"QUERY_HEADS": self.query_heads, "ROWS": self.rows, "LANES": REDUCTION_LANES,
                "LOG2_LANES": LOG2_LANES, "UNROLL": self.stats_unroll,
                "RESIDENT_STEPS": self.stats_resident // REDUCTION_LANES, "STD_FLOOR": STD_FLOOR}

    def aggregate_heads(self, mode: str) -> int:
        """Query heads one aggregation program reduces: all of them (union) or one KV group."""
        return self.query_heads if mode == "union" else self.group

    def aggregate_constants(self, mode: str) -> dict[str, int]:
        heads = self.aggregate_heads(mode)
        step = min(self.head_step or next_power_of_2(heads), next_power_of_2(heads))
        return {"MODE": mode_index(mode), "QUERY_HEADS": self.query_heads, "KV_HEADS": self.kv_heads,
                "HEADS": heads, "HEAD_STEP": step, "STEPS": -(-heads // step), "BLOCK_W": self.block_w}

    def queue_constants(self, mode: str) -> dict[str, int | float]:
        """The queue kernel's: the aggregation's and the statistics' constants, the chunk and the lag."""
        return {**self.aggregate_constants(mode), **self.stats_constants(), "CHUNK": self.chunk_requests,
                "LAG": self.queue_lag}

    def queue_work_ints(self, mode: str, batch: int, W: int) -> int:
        """int32 counters the queue kernel needs zeroed: its ticket, one per chunk (statistics
        done), one per request, group and column tile (layers folded)."""
        groups = 1 if mode == "union" else self.kv_heads
        chunks = len(self.scored_layers) * -(-batch // self.chunk_requests)
        return 1 + chunks + batch * groups * -(-W // self.block_w)

    def select_constants(self) -> dict[str, int]:
        return {"BLOCK": self.block, "RADIX_BITS": self.radix_bits, "ROUTE": self.select_route}

    # ---- checks (host-side facts only: nothing is read back from the device)

    def _check_scores(self, scores: torch.Tensor) -> None:
        self._check_device(scores)
        expected = (len(self.scored_layers), self.query_heads)
        if scores.dim() != 4 or scores.dtype != torch.float32 or (scores.shape[0], scores.shape[2]) != expected:
            raise ValueError(f"scores: expected float32 [{expected[0]} scored layers, B, {expected[1]} query heads, "
                             f"W], got {scores.dtype} {list(scores.shape)}")
        if not scores.is_contiguous():
            raise ValueError("scores: must be contiguous")

    def _check_device(self, tensor: torch.Tensor) -> None:
        """Where the kernels can run (every device for Triton, whose interpreter runs on the CPU)."""

    @staticmethod
    def _check_rows(name: str, tensor: torch.Tensor, batch: int, device: torch.device) -> None:
        if tensor.dtype != torch.int64 or tuple(tensor.shape) != (batch,) or tensor.device != device:
            raise ValueError(f"{name}: expected int64 [{batch}] on {device}, got {tensor.dtype} "
                             f"{list(tensor.shape)} on {tensor.device}")

    # ---- outputs (after the checks)

    def _statistics_outputs(self, scores: torch.Tensor, width: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Checked ``scores`` and ``width``; empty float32 ``(mean, std)`` ``[scored, B, Hq]``."""
        self._check_scores(scores)
        layers, batch, heads, _ = scores.shape
        self._check_rows("width", width, batch, scores.device)
        mean = torch.empty((layers, batch, heads), dtype=torch.float32, device=scores.device)
        return mean, torch.empty_like(mean)

    def _values_output(self, mode: str, batch: int, W: int, device: torch.device) -> torch.Tensor:
        """float32 ``[B, R, W]`` decision values; zeros where per_layer_perhead has sliding layers
        (their rows are never written)."""
        sliding = mode == "per_layer_perhead" and len(self.scored_layers) < self.num_layers
        alloc = torch.zeros if sliding else torch.empty
        return alloc((batch, self.num_decision_rows(mode), W), dtype=torch.float32, device=device)

    # ---- the three stages

    def statistics(self, scores: torch.Tensor, width: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 ``(mean, std)`` ``[scored, B, Hq]`` of ``zscore`` (std floored) over each row's
        ``width[b]`` leading columns (``width`` int64 ``[B]``, each <= W; a larger one counts as W)."""
        mean, std = self._statistics_outputs(scores, width)
        _, batch, _, W = scores.shape
        if mean.numel():
            self._launch_statistics(scores, width, mean, std, batch, W)
        return mean, std

    def aggregate(self, scores: torch.Tensor, mean: torch.Tensor, std: torch.Tensor, width: torch.Tensor,
                  mode: str) -> torch.Tensor:
        """Decision values ``[B, R, W]`` float32: ``aggregate`` of the z-scores of ``scores``."""
        self._check_scores(scores)
        layers, batch, heads, W = scores.shape
        self._check_rows("width", width, batch, scores.device)
        for name, tensor in (("mean", mean), ("std", std)):
            if (tensor.dtype != torch.float32 or tuple(tensor.shape) != (layers, batch, heads)
                    or tensor.device != scores.device or not tensor.is_contiguous()):
                raise ValueError(f"{name}: expected contiguous float32 [{layers}, {batch}, {heads}] on "
                                 f"{scores.device}, got {tensor.dtype} {list(tensor.shape)} on {tensor.device}")
        out = self._values_output(mode, batch, W, scores.device)
        if out.numel():
            self._launch_aggregate(mode, scores, mean, std, width, self.layer_table(scores.device), out, batch, W)
        return out

    def select(self, values: torch.Tensor, width: torch.Tensor, budget: int, P: torch.Tensor) -> Selection:
        """``select_keep(values, width, budget, P)`` (``width``, ``P`` int64 ``[B]`` on the device)."""
        self._check_device(values)
        if values.dim() != 3 or values.dtype != torch.float32 or not values.is_contiguous():
            raise ValueError(f"values: expected contiguous float32 [B, R, W], got {values.dtype} {list(values.shape)}")
        if budget < 1:
            raise ValueError(f"budget {budget}: must be at least 1")
        batch, rows, W = values.shape
        for name, tensor in (("width", width), ("P", P)):
            self._check_rows(name, tensor, batch, values.device)
        kept = torch.empty((batch, rows, budget), dtype=torch.int64, device=values.device)
        nan_rows = torch.zeros((batch, rows), dtype=torch.int32, device=values.device)
        if kept.numel():
            self._launch_select(values, width, P, kept, nan_rows, rows, W, budget)
        return Selection(kept, nan_rows)

    def statistics_aggregate(self, scores: torch.Tensor, width: torch.Tensor,
                             mode: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(mean, std, values)`` of ``statistics`` and ``aggregate``, bit for bit, from one launch
        of the queue kernel (each chunk of rows read a second time from L2, not DRAM)."""
        mean, std = self._statistics_outputs(scores, width)
        _, batch, _, W = scores.shape
        out = self._values_output(mode, batch, W, scores.device)
        if out.numel() and mean.numel():
            work = torch.zeros(self.queue_work_ints(mode, batch, W), dtype=torch.int32, device=scores.device)
            self._launch_queue(mode, scores, width, mean, std, self.layer_table(scores.device), out, work, batch, W)
        return mean, std, out

    def decide(self, scores: torch.Tensor, width: torch.Tensor, P: torch.Tensor, budget: int,
               mode: str) -> Selection:
        """Kept positions of ``scores`` ``[scored, B, Hq, W]``: statistics, aggregate (apart, or one
        queue: ``aggregate_route``), select."""
        if self.aggregate_route:
            values = self.statistics_aggregate(scores, width, mode)[2]
        else:
            mean, std = self.statistics(scores, width)
            values = self.aggregate(scores, mean, std, width, mode)
        return self.select(values, width, budget, P)

    # ---- the launches (checked, allocated, non-empty arguments)

    def _launch_statistics(self, scores, width, mean, std, batch: int, W: int) -> None:  # noqa: ANN001
        raise NotImplementedError

    def _launch_aggregate(self, mode: str, scores, mean, std, width, layers, out, batch: int,  # noqa: ANN001
                          W: int) -> None:
        raise NotImplementedError

    def _launch_queue(self, mode: str, scores, width, mean, std, layers, out, work, batch: int,  # noqa: ANN001
                      W: int) -> None:
        raise NotImplementedError

    def _launch_select(self, values, width, P, kept, nan_rows, rows: int, W: int,  # noqa: ANN001
                       budget: int) -> None:
        raise NotImplementedError
