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
The kernels take ``kept`` as the oracle validated it; whatever the offsets on the device say,
they read only the ``batch`` requests' rows and write only inside the ``capacity`` slots. The
host side (``kvgen.kernels.packing.PackHost``) checks shapes, mode and budget.

Two ways to run them, same kernels, same constants (``PackHost.*_constants``):
- ``TritonPacker``: Triton JIT-compiles on the first call (a checkout's generated
  ``generated/<family>/pack.py`` binds one to the family's constants);
- ahead of time: ``aot_specializations`` lists both kernels, and ``kvgen.build.triton_aot``
  compiles them into ``lib<symbol>_pack.so`` (``kvgen/kernels/include/kvgen_pack.h``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from kvgen.kernels.packing import MODES, MOVE_FILL, PackHost  # noqa: F401 - part of this module's API
from kvgen.kernels.triton.aot import Specialization


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
                  batch, max_requests, budget, num_rows, row_layer_stride, row_head_stride, capacity,
                  KV_HEADS: tl.constexpr, HEADS: tl.constexpr, BLOCK: tl.constexpr):
    """Program (request, layer) writes the request's slots of every KV head of the layer.
    Program request == max_requests writes the fill after the last request, up to capacity.
    (-1 is MOVE_FILL, spelled out: a kernel cannot read a Python global.)"""
    request = tl.program_id(0)
    layer = tl.program_id(1)
    is_request = request < max_requests
    # Clamped to the row, [0, capacity]: a too-small capacity drops moves, and offsets that are not
    # the offsets kernel's (negative, decreasing) write nothing outside the row either.
    begin = tl.minimum(tl.maximum(tl.load(offsets_ptr + request), 0), capacity)
    end = tl.minimum(tl.load(offsets_ptr + request + 1, mask=is_request, other=capacity), capacity)
    count = end - begin
    has_moves = (request < batch) & (count > 0)  # only due requests own slots; padding never reads kept
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


# ----------------------------------------------------------------------------------------------
# Launching: JIT, or the specializations the AOT build compiles
# ----------------------------------------------------------------------------------------------

SIGNATURES: dict[str, dict[str, str]] = {
    "offsets": {"tail_ptr": "*i64", "due_ptr": "*i8", "offsets_ptr": "*i32", "batch": "i32", "max_requests": "i32",
                "budget": "i32"},
    "moves": {"kept_ptr": "*i64", "P_ptr": "*i64", "S_ptr": "*i64", "window_ptr": "*i32", "offsets_ptr": "*i32",
              "src_ptr": "*i32", "dst_ptr": "*i32", "batch": "i32", "max_requests": "i32", "budget": "i32",
              "num_rows": "i32", "row_layer_stride": "i32", "row_head_stride": "i32", "capacity": "i32"},
}
OPTIONS = {"num_warps": 4, "num_stages": 3}   # Triton's defaults, stated so both paths compile alike


def aot_specializations(host: PackHost) -> list[Specialization]:
    """Both kernels a family's packer launches, with exactly the constants of its JIT launches."""
    return [Specialization("offsets", _offsets_kernel, SIGNATURES["offsets"], host.offsets_constants(), OPTIONS),
            Specialization("moves", _moves_kernel, SIGNATURES["moves"], host.moves_constants(), OPTIONS)]


def aot_header_constants(host: PackHost) -> dict[str, int | list[int]]:
    """The family's constants ``pack_abi.cpp`` reads (its names)."""
    return {"kNumLayers": host.num_layers, "kKvHeads": host.kv_heads, "kBlock": host.block,
            "kLayerWindows": [w or 0 for w in host.swa_window]}


class TritonPacker(PackHost):
    """``PackHost`` launching the kernels through Triton's JIT (compiled on the first call)."""

    def _launch_offsets(self, tail, due, offsets, batch, max_requests, budget):  # noqa: ANN001, ANN202
        _offsets_kernel[(1,)](tail, due, offsets, batch, max_requests, budget, **self.offsets_constants(), **OPTIONS)

    def _launch_moves(self, kept, P, S, windows, offsets, src, dst, mode, batch, max_requests,  # noqa: ANN001, ANN202
                      budget, capacity):
        layer_stride, head_stride = self.decision_row_strides(mode)
        _moves_kernel[(max_requests + 1, self.num_layers)](
            kept, P, S, windows, offsets, src, dst, batch, max_requests, budget, kept.shape[1], layer_stride,
            head_stride, capacity, **self.moves_constants(), **OPTIONS)
