"""The host side of the move-source packer (TRIATTENTION.md §6), whoever launches its kernels:
``kvgen.kernels.triton.pack.TritonPacker`` (Triton JIT, a checkout's ``generated/<family>/pack.py``)
and ``kvgen.runtime.pack.PackLibrary`` (the same kernels compiled ahead of time into
``lib<symbol>_pack.so``) both subclass ``PackHost``.

``pack_moves`` mirrors ``kvgen.reference.triattention.pack_moves`` and returns exactly its
``Moves`` as ``(src, dst, offsets)``: ``src``/``dst`` int32 ``[layers, kv_heads, N]``, ``offsets``
int32 ``[max_requests + 1]``, ``-1`` in every slot that moves nothing. Only host-side facts (shapes,
mode, budget against the windows) are checked here; the kernels clamp whatever the device holds
to the tensors they are given. Needs torch only. The kernels' compile-time constants are stated
here once (``*_constants``): the JIT launches pass them, the AOT build compiles exactly them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvgen.kernels.selection import MODES, MOVE_FILL, next_power_of_2  # noqa: F401 - MODES, MOVE_FILL: this module's API

OFFSETS_BLOCK = 1024  # requests per step of the cumulative sum


def _as_device(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:  # noqa: ANN001
    return torch.as_tensor(values, dtype=dtype, device=device).reshape(-1).contiguous()


class PackHost:
    """The packer of one family: its layer count, KV heads, per-layer windows and launch block."""

    def __init__(self, num_layers: int, kv_heads: int, swa_window: Sequence[int | None], block: int):
        self.num_layers = num_layers
        self.kv_heads = kv_heads
        self.swa_window = tuple(swa_window)
        self.block = block
        self._windows: dict[torch.device, torch.Tensor] = {}

    def layer_windows(self, device: torch.device) -> torch.Tensor:
        """int32 ``[num_layers]``, the window of each layer (0 when scored). Copied to the device on
        first use and kept: call ``pack_moves`` once before capturing it in a graph."""
        device = torch.device(device)
        if device not in self._windows:
            windows = [w or 0 for w in self.swa_window]
            self._windows[device] = torch.tensor(windows, dtype=torch.int32, device=device)
        return self._windows[device]

    def decision_row_strides(self, mode: str) -> tuple[int, int]:
        """``(a, b)``: (layer, head) reads decision row ``layer * a + head * b`` (oracle ``decision_rows``)."""
        if mode == "union":
            return 0, 0
        if mode == "per_head":
            return 0, 1
        if mode == "per_layer_perhead":
            return self.kv_heads, 1
        raise ValueError(f"eviction_mode {mode!r}; accepted: {', '.join(MODES)}")

    def num_decision_rows(self, mode: str) -> int:
        layer_stride, head_stride = self.decision_row_strides(mode)
        return 1 + (self.num_layers - 1) * layer_stride + (self.kv_heads - 1) * head_stride

    # ---- the kernels' compile-time constants

    def offsets_constants(self) -> dict[str, int]:
        return {"BLOCK_R": OFFSETS_BLOCK}

    def moves_constants(self) -> dict[str, int]:
        return {"KV_HEADS": self.kv_heads, "HEADS": next_power_of_2(self.kv_heads), "BLOCK": self.block}

    # ---- checks and the packing

    def _check(self, kept: torch.Tensor, budget: int, mode: str, batch: int, max_requests: int) -> None:
        expected = (batch, self.num_decision_rows(mode), budget)
        if tuple(kept.shape) != expected:
            raise ValueError(f"kept has shape {list(kept.shape)}, expected {list(expected)} for mode {mode!r}")
        if max_requests < batch:
            raise ValueError(f"max_requests {max_requests} < batch {batch}")
        for layer, window in enumerate(self.swa_window):
            if window is not None and budget < window:
                raise ValueError(f"layer {layer}: budget {budget} < sliding window {window}; "
                                 f"SWA layers keep their whole window, so budget >= W is required")
        self._check_device(kept)

    def _check_device(self, tensor: torch.Tensor) -> None:
        """Where the kernels can run (every device for Triton, whose interpreter runs on the CPU)."""

    def pack_moves(self, kept: torch.Tensor, P, S, tail, active, budget: int, mode: str,  # noqa: ANN001
                   max_requests: int | None = None, capacity: int | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Moves of every due (``active``) request at cumulative offsets: ``(src, dst, offsets)``.

        ``kept`` ``[B, R, budget]`` (int64 or int32) from ``select_keep``; ``P``, ``S``, ``tail`` ``[B]``;
        ``active`` bool ``[B]``. Requests ``B .. max_requests-1`` are padding. ``capacity``: the
        length ``N`` of the move rows to allocate, at least the total number of moves (e.g.
        ``max_requests * (budget + max tail)``); slots past the last move hold -1. ``None``: exactly
        the total, read back from the device (one synchronization; pass it to capture in a graph)."""
        batch = kept.shape[0]
        max_requests = batch if max_requests is None else max_requests
        self._check(kept, budget, mode, batch, max_requests)
        device = kept.device
        kept = kept.to(torch.int64).contiguous()
        P = _as_device(P, torch.int64, device)
        S = _as_device(S, torch.int64, device)
        tail = _as_device(tail, torch.int64, device)
        due = _as_device(active, torch.bool, device).view(torch.int8)
        for name, tensor in (("P", P), ("S", S), ("tail", tail), ("active", due)):
            if tensor.numel() != batch:
                raise ValueError(f"{name} has {tensor.numel()} requests, kept {batch}")
        offsets = torch.empty(max_requests + 1, dtype=torch.int32, device=device)
        self._launch_offsets(tail, due, offsets, batch, max_requests, budget)
        if capacity is None:
            capacity = int(offsets[-1])
        src = torch.empty((self.num_layers, self.kv_heads, capacity), dtype=torch.int32, device=device)
        dst = torch.empty_like(src)
        if capacity > 0:
            self._launch_moves(kept, P, S, self.layer_windows(device), offsets, src, dst, mode, batch, max_requests,
                               budget, capacity)
        return src, dst, offsets

    # ---- the launches (checked, allocated arguments)

    def _launch_offsets(self, tail, due, offsets, batch: int, max_requests: int, budget: int) -> None:  # noqa: ANN001
        raise NotImplementedError

    def _launch_moves(self, kept, P, S, windows, offsets, src, dst, mode: str, batch: int,  # noqa: ANN001
                      max_requests: int, budget: int, capacity: int) -> None:
        raise NotImplementedError
