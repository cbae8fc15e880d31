"""Memory tiers: the paged hot pool on the device, the pinned cold tier, the disk tier below it."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

import torch

from kvgen.demo.synthetic import CacheGeometry


class FreeList:
    """Numbered slots handed out and taken back (hot pages, cold slots)."""

    def __init__(self, slots: int):
        self.free = list(range(slots))
        self.slots = slots

    def allocate(self, count: int) -> list[int]:
        taken, self.free = self.free[:count], self.free[count:]
        return taken

    def release(self, slots: Sequence[int]) -> None:
        self.free.extend(slots)

    @property
    def used(self) -> int:
        return self.slots - len(self.free)


class HotPool(FreeList):
    """Paged K/V (or latent) pools on the device: ``pools[layer][buffer]`` is ``[pages, *page]``."""

    def __init__(self, geometry: CacheGeometry, pages: int, device: torch.device):
        super().__init__(pages)
        shape = (pages,) + geometry.page_shape
        self.pools = [[torch.zeros(shape, dtype=geometry.torch_dtype, device=device) for _ in geometry.buffers]
                      for _ in range(geometry.layers)]
        self.pages = pages

    def write(self, pages: Sequence[int], data: dict[str, torch.Tensor], buffers: Sequence[str]) -> None:
        index = torch.tensor(list(pages), device=self.pools[0][0].device)
        for layer, pools in enumerate(self.pools):
            for pool, name in zip(pools, buffers):
                pool[index] = data[name][layer]

    def read(self, pages: Sequence[int]) -> list[list[torch.Tensor]]:
        index = torch.tensor(list(pages), device=self.pools[0][0].device)
        return [[pool[index] for pool in pools] for pools in self.pools]


class ColdTier(FreeList):
    """Fixed-size cold slots in pinned host memory (plain host memory without a GPU)."""

    def __init__(self, slots: int, page_bytes: int, pinned: bool):
        super().__init__(slots)
        storage = torch.zeros((max(slots, 1), page_bytes), dtype=torch.uint8)
        self.storage = storage.pin_memory() if pinned else storage
        self.kind = "pinned host" if pinned else "host (no GPU: not pinned)"


class DiskTier:
    """Cold blobs in one file, at ``slot * cold_page_bytes``; plain file writes and reads."""

    def __init__(self, directory: Path, family: str, page_bytes: int):
        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / f"kvgen-demo-{family}.cold"
        self.file = open(self.path, "w+b")  # noqa: SIM115 - closed by close()
        self.page_bytes = page_bytes
        self.free: list[int] = []
        self.next_slot = 0
        self.bytes_written = 0
        self.bytes_read = 0
        self.seconds = 0.0

    def store(self, blobs: torch.Tensor) -> list[int]:
        """Write ``uint8 [n, page_bytes]`` host blobs; their disk slots."""
        begin = time.perf_counter()
        slots = []
        for blob in blobs:
            slot = self.free.pop() if self.free else self._grow()
            self.file.seek(slot * self.page_bytes)
            self.file.write(blob.numpy().tobytes())
            slots.append(slot)
        self.file.flush()
        self.bytes_written += blobs.numel()
        self.seconds += time.perf_counter() - begin
        return slots

    def load(self, slots: Sequence[int], into: torch.Tensor) -> None:
        """Read the blobs of ``slots`` into the host rows ``into`` (``uint8 [n, page_bytes]``) and free them."""
        begin = time.perf_counter()
        for slot, row in zip(slots, into):
            self.file.seek(slot * self.page_bytes)
            self.file.readinto(memoryview(row.numpy()))
        self.free.extend(slots)
        self.bytes_read += into.numel()
        self.seconds += time.perf_counter() - begin

    def _grow(self) -> int:
        self.next_slot += 1
        return self.next_slot - 1

    def close(self) -> None:
        self.file.close()
        self.path.unlink(missing_ok=True)
