"""How a ``ColdPageCodec`` moves cold pages to and from pinned host memory (``offload`` / ``onboard``).

Strategies:

- ``"staged"`` (C ABI version 2): the SMs encode chunks into a device staging ring (default 64 MiB),
  the copy engine moves each chunk's cold pages to host; onboard runs the other way. The SMs work
  only for the encode/decode, so a concurrent model stream keeps them the rest of the time.
- ``"zero-copy"``: the kernel writes/reads the mapped pinned host pages directly (the version-1
  ``encode`` / ``decode``). Same wall time, but the SMs *are* the transfer for its whole length.

The default (``default_strategy``) is a recorded measurement turned into a rule: on the H200,
offloading 1.2 GiB of qwen3-8b pages beside a memory-bound and a compute-bound foreground stream,
zero-copy slowed the foreground 1.74-1.89x, staged 1.07-1.17x, at the same wall time (7.1-7.6 ms;
``PERFORMANCE.md``, "Offload beside the model's own work"; ``kvgen bench run --only interference``
re-measures it). So staged wherever the library has it, zero-copy for a version-1 library.

Nothing here needs a GPU: the checks and the record of offloaded slots are plain torch on the host.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

STRATEGIES = ("staged", "zero-copy")
DEFAULT_STAGING_BYTES = 64 << 20
STAGED_REASON = ("staged: same wall time as zero-copy, foreground stream slowed 1.07-1.17x instead of 1.74-1.89x "
                 "(H200, 1.2 GiB qwen3-8b; kvgen bench run --only interference)")
ZERO_COPY_REASON = "zero-copy: the library has C ABI version 1 (no staged entry points; rebuild with kvgen build)"


def default_strategy(abi_version: int) -> tuple[str, str]:
    """(strategy, why) for a library of ``abi_version`` (see the module docstring)."""
    return ("staged", STAGED_REASON) if abi_version >= 2 else ("zero-copy", ZERO_COPY_REASON)


def check_strategy(strategy: str, abi_version: int) -> str:
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy: expected one of {', '.join(STRATEGIES)}, got {strategy!r}")
    if strategy == "staged" and abi_version < 2:
        raise ValueError(f"strategy 'staged' needs a library of C ABI version 2, this one has {abi_version}; "
                         "rebuild with kvgen build")
    return strategy


def check_staging_tensor(staging: torch.Tensor) -> None:
    """A caller's staging buffer: contiguous uint8 on the current CUDA device (size and alignment
    are the library's checks, which know the cold page sizes)."""
    if staging.dtype != torch.uint8 or not staging.is_contiguous():
        raise ValueError(f"staging: expected a contiguous uint8 tensor, got {staging.dtype}"
                         f"{'' if staging.is_contiguous() else ' (not contiguous)'}")
    if not staging.is_cuda:
        raise ValueError("staging: must be GPU memory (the copy engine moves it to and from host)")
    if staging.device.index != torch.cuda.current_device():
        raise ValueError(f"staging: on {staging.device}, the codec runs on cuda:{torch.cuda.current_device()}")


def cold_slots(cold: Any, page_bytes: int, device: torch.device) -> int:
    """Slots of a cold buffer: contiguous uint8, 16-byte aligned, on ``device`` or pinned host memory."""
    if not isinstance(cold, torch.Tensor) or cold.dtype != torch.uint8 or not cold.is_contiguous():
        raise ValueError("cold: cold storage must be a contiguous uint8 tensor")
    if cold.is_cuda and cold.device != device:
        raise ValueError(f"cold: on {cold.device}, the hot pools on {device}")
    if not (cold.is_cuda or cold.is_pinned()):
        raise ValueError("cold: cold storage must be GPU memory or pinned host memory")
    if cold.data_ptr() % 16:
        raise ValueError("cold: base address must be 16-byte aligned")
    if cold.numel() % page_bytes:
        raise ValueError(f"cold: {cold.numel()} bytes is not a multiple of the cold page size {page_bytes}")
    return cold.numel() // page_bytes


def check_host_cold(cold: Any, page_bytes: int, device: torch.device) -> int:
    """Pinned host cold storage of whole pages (offload and onboard); its number of slots."""
    slots = cold_slots(cold, page_bytes, device)
    if cold.is_cuda:
        raise ValueError("cold: offload/onboard take pinned host cold storage (encode/decode serve device memory)")
    return slots


def check_slots(slots: torch.Tensor, num_slots: int) -> None:
    """Every cold slot id of host pairs in [0, num_slots)."""
    if slots.numel() and (int(slots.min()) < 0 or int(slots.max()) >= num_slots):
        bad = slots[(slots < 0) | (slots >= num_slots)][0]
        raise ValueError(f"cold slot {int(bad)} outside [0, {num_slots}) of the cold storage")


@dataclass
class OffloadedSlots:
    """Which cold slots of which host cold storage hold pages offloaded by this codec, per lifecycle,
    so ``onboard`` can refuse a slot that was never written (host pairs only: device pairs would need
    a sync to read)."""

    written: dict[tuple[int, int, int], torch.Tensor] = field(default_factory=dict)

    @staticmethod
    def key(cold: torch.Tensor, lifecycle: int) -> tuple[int, int, int]:
        return (lifecycle, cold.data_ptr(), cold.numel())

    def mark(self, cold: torch.Tensor, lifecycle: int, slots: torch.Tensor, num_slots: int) -> None:
        mask = self.written.setdefault(self.key(cold, lifecycle), torch.zeros(num_slots, dtype=torch.bool))
        mask[slots.long()] = True

    def require(self, cold: torch.Tensor, lifecycle: int, slots: torch.Tensor) -> None:
        mask = self.written.get(self.key(cold, lifecycle))
        missing = slots if mask is None else slots[~mask[slots.long()]]
        if missing.numel():
            raise ValueError(f"cold slot {int(missing[0])} of lifecycle {lifecycle} was never offloaded into this "
                             "cold storage by this codec")


@dataclass
class OffloadState:
    """A codec's offload settings: the strategy, why, and the staging buffer in use."""

    strategy: str
    reason: str
    staging: torch.Tensor | None = None   # a caller's buffer, kept alive while in use
    slots: OffloadedSlots = field(default_factory=OffloadedSlots)
