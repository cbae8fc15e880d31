"""The move-source packer (TRIATTENTION.md §6) in Triton, for any family.

``pack_moves`` mirrors ``kvgen.reference.triattention.pack_moves`` and returns exactly its
``Moves`` as ``(src, dst, offsets)``: ``src``/``dst`` int32 ``[layers, kv_heads, N]``, ``offsets``
int32 ``[max_requests + 1]``, ``-1`` in every slot that moves nothing. Request ``r`` owns slots
``offsets[r] .. offsets[r+1]-1`` of every (layer, KV head) row; slot ``m`` has ``dst = P + m`` and
``src = kept[m]`` (``m < budget``) or ``S + m - budget`` (the protected tail); a sliding-window
layer keeps its latest window: slots ``m < budget - W`` are fill, later ones ``src = S - budget + m``.

Everything runs in two Triton kernels (plain pointer arithmetic: Triton 3.6 and newer). With
``capacity`` given, nothing is read back to the host, so a call can be captured in a CUDA graph;
without it, ``N`` is read from ``offsets[-1]`` (one synchronization), as the oracle sizes it.
The kernels trust their inputs (the oracle validates ``kept``); only host-side facts (shapes,
mode, budget against the windows) are checked here.

Generated ``generated/<family>/pack.py`` modules hold only the family's constants and bind a
``TritonPacker`` to them; the kernels live here, once.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

MOVE_FILL = -1
MODES = ("union", "per_head", "per_layer_perhead")
_OFFSETS_BLOCK = 1024  # requests per step of the cumulative sum


@triton.jit
def _offsets_kernel(tail_ptr, due_ptr, offsets_ptr, batch, max_requests, budget, BLOCK_R: tl.constexpr):
    """One program: offsets[0] = 0, offsets[r+1] = offsets[r] + (budget + tail[r] if r is due else 0);
    requests batch .. max_requests-1 are padding and own nothing."""
    tl.store(offsets_ptr, 0)
    carry = tl.zeros((), dtype=tl.int64)  # moves of the requests before this step
    for start in range(0, max_requests, BLOCK_R):
        r = start + tl.arange(0, BLOCK_R)
        live = r < batch
        tail = tl.load(tail_ptr + r, mask=live, other=0).to(tl.int64)
        due = tl.load(due_ptr + r, mask=live, other=0) != 0
        count = tl.where(due, budget + tail, 0)
        ends = carry + tl.cumsum(count, axis=0)
        tl.store(offsets_ptr + 1 + r, ends.to(tl.int32), mask=r < max_requests)
        carry += tl.sum(count, axis=0)


@triton.jit
def _moves_kernel(kept_ptr, P_ptr, S_ptr, window_ptr, offsets_ptr, src_ptr, dst_ptr,
                  max_requests, budget, num_rows, row_layer_stride, row_head_stride, capacity,
                  KV_HEADS: tl.constexpr, HEADS: tl.constexpr, BLOCK: tl.constexpr):
    """Program (request, layer) writes the request's slots of every KV head of the layer.
    Program request == max_requests writes the fill after the last request, up to capacity.
    (-1 is MOVE_FILL, spelled out: a kernel cannot read a Python global.)"""
    request = tl.program_id(0)
    layer = tl.program_id(1)
    is_request = request < max_requests
    # Clamped to the row: a too-small capacity drops moves instead of writing out of bounds.
    begin = tl.minimum(tl.load(offsets_ptr + request), capacity)
    end = tl.minimum(tl.load(offsets_ptr + request + 1, mask=is_request, other=capacity), capacity)
    count = end - begin
    has_moves = is_request & (count > 0)  # only due requests (r < batch) own slots
    p = tl.load(P_ptr + request, mask=has_moves, other=0).to(tl.int64)
    s = tl.load(S_ptr + request, mask=has_moves, other=0).to(tl.int64)
    window = tl.load(window_ptr + layer)   # 0: scored layer
    # Slots [moved_from, count) move; earlier ones are fill: SWA slots before the window's
    # destination base, and every slot of the program past the last request.
    moved_from = tl.where(has_moves, tl.where(window > 0, budget - window, 0), count)
    # Slots [0, kept_end) read their source from kept (scored layers only).
    kept_end = tl.where(has_moves & (window == 0), tl.minimum(count, budget), 0)
    # (Masks combine tensors only: the interpreter of Triton 3.9 turns tensor & scalar-bool into int32.)

    head = tl.arange(0, HEADS)[:, None]
    row = layer * row_layer_stride + head * row_head_stride  # decision row feeding each head
    kept_row = kept_ptr + (request.to(tl.int64) * num_rows + row) * budget
    out = (layer * KV_HEADS + head).to(tl.int64) * capacity + begin
    for m0 in range(0, count, BLOCK):
        m = m0 + tl.arange(0, BLOCK)[None, :]
        live = (m < count) & (head < KV_HEADS)
        kept = tl.load(kept_row + m, mask=(m < kept_end) & (head < KV_HEADS), other=-1)
        scored = tl.where(m < budget, kept.to(tl.int64), s + m - budget)  # kept tokens, then the tail
        src = tl.where(window > 0, s - budget + m, scored)                # SWA: the latest window
        moved = m >= moved_from
        src = tl.where(moved, src, -1)
        dst = tl.where(moved, p + m, -1)
        tl.store(src_ptr + out + m, src.to(tl.int32), mask=live)
        tl.store(dst_ptr + out + m, dst.to(tl.int32), mask=live)


def _as_device(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.as_tensor(values, dtype=dtype, device=device).reshape(-1).contiguous()


class TritonPacker:
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

    def pack_moves(self, kept: torch.Tensor, P, S, tail, active, budget: int, mode: str,
                   max_requests: int | None = None, capacity: int | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Moves of every due (``active``) request at cumulative offsets: ``(src, dst, offsets)``.

        ``kept`` ``[B, R, budget]`` (int64 or int32) from ``select_keep``; ``P``, ``S``, ``tail`` ``[B]``;
        ``active`` bool ``[B]``. Requests ``B .. max_requests-1`` are padding. ``capacity``: the
        length ``N`` of the move rows to allocate, at least the total number of moves (e.g.
        ``max_requests * (budget + max tail)``); slots past the last move hold -1. ``None``: exactly
        the total, read back from the device."""
        batch = kept.shape[0]
        max_requests = batch if max_requests is None else max_requests
        self._check(kept, budget, mode, batch, max_requests)
        device = kept.device
        kept = kept.contiguous()
        P = _as_device(P, torch.int64, device)
        S = _as_device(S, torch.int64, device)
        tail = _as_device(tail, torch.int64, device)
        due = _as_device(active, torch.bool, device).view(torch.int8)
        offsets = torch.empty(max_requests + 1, dtype=torch.int32, device=device)
        _offsets_kernel[(1,)](tail, due, offsets, batch, max_requests, budget, BLOCK_R=_OFFSETS_BLOCK)
        if capacity is None:
            capacity = int(offsets[-1])  # the one synchronization; pass capacity to avoid it
        src = torch.empty((self.num_layers, self.kv_heads, capacity), dtype=torch.int32, device=device)
        dst = torch.empty_like(src)
        if capacity > 0:
            layer_stride, head_stride = self.decision_row_strides(mode)
            grid = (max_requests + 1, self.num_layers)
            _moves_kernel[grid](kept, P, S, self.layer_windows(device), offsets, src, dst, max_requests, budget,
                                kept.shape[1], layer_stride, head_stride, capacity, KV_HEADS=self.kv_heads,
                                HEADS=triton.next_power_of_2(self.kv_heads), BLOCK=self.block)
        return src, dst, offsets
