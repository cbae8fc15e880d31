"""The cold-page codec workload: encode + decode of lifecycle-0 pages, checked byte for byte
against the oracle (``kvgen.reference.codec.encode_records`` / ``decode_records``)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from kvgen.measure.timing import rotation_sets
from kvgen.measure.workloads.base import Failure, Inputs, launch, loading, timed
from kvgen.reference.codec import HOT_TORCH_DTYPES, decode_records, encode_records
from kvgen.runtime.codec import ColdPageCodec
from kvgen.runtime.library import FamilyLibrary, LibraryError

CHECK_PAIRS = ((5, 0), (0, 3), (2, 5), (1, 1), (4, 2), (3, 4))   # (dst, src): scattered, one identity
OUTLIER_CHANNEL, OUTLIER_SCALE = 3, 40


def reverse_pairs(pairs: torch.Tensor) -> torch.Tensor:
    """(dst, src) pairs of the way back: decode slot -> the page it came from."""
    return pairs.flip(1).contiguous()


def scattered_pairs(first_slot: int, pages: int) -> torch.Tensor:
    """Encode pairs: cold slots ``first_slot..+pages`` in order, hot pages of that range permuted."""
    slots = torch.arange(first_slot, first_slot + pages, dtype=torch.int32)
    return torch.stack([slots, slots[torch.randperm(pages)]], dim=1)


class CodecWorkload:
    """Encode + decode of one lifecycle-0 batch of pages (both directions share one launch
    configuration), cold pages in device or pinned memory as the size says (``hot_mib``, ``cold``)."""

    op = "codec"

    def __init__(self, layout: Any, dtype: str):
        """``layout``: the family's ``kvgen.lower.layout.FamilyLayout``, lowered by the tool (measure
        never reads a spec); ``dtype``: the hot pages' dtype name (``bf16``, ``fp8_e4m3``, ...)."""
        self.layout = layout
        self.dtype = dtype
        self.lc = layout.lifecycles[0]
        self.layers = 1 + max(layer for lc in layout.lifecycles for layer in lc.layers)

    def pools(self, pages: int, gen: torch.Generator) -> list[list[torch.Tensor]]:
        """Hot pages with an outlier channel (what KV caches look like), side buffers random."""
        dtype = HOT_TORCH_DTYPES[self.dtype]
        pools = []
        for _ in range(self.layers):
            layer = []
            for b in self.layout.record.buffers:
                x = torch.randn(pages, b.rows, b.row_dim, device="cuda", generator=gen) * 2
                x[:, :, OUTLIER_CHANNEL] *= OUTLIER_SCALE
                if self.dtype == "fp8_e4m3":
                    x = x.clamp(-448, 448)
                layer.append(x.to(dtype))
            layer += [torch.randint(0, 256, (pages, s.bytes), device="cuda", dtype=torch.uint8, generator=gen)
                      for s in self.layout.record.sides]
            pools.append(layer)
        return pools

    def load(self, path: Path) -> FamilyLibrary:
        return loading(lambda: FamilyLibrary(path), (LibraryError,))

    def codec(self, library: FamilyLibrary, pools: list[list[torch.Tensor]]) -> ColdPageCodec:
        return loading(lambda: ColdPageCodec(library, self.layout, pools), (LibraryError,))

    def inputs(self, size: dict[str, Any], seed: int) -> Inputs:
        pages = max(1, math.ceil(size["hot_mib"] * (1 << 20) / self.lc.hot_page_bytes))
        sets = rotation_sets(pages * self.lc.hot_page_bytes)
        pools = self.pools(pages * sets, torch.Generator(device="cuda").manual_seed(seed))
        cold = torch.empty(pages * sets, self.lc.cold_page_bytes, dtype=torch.uint8,
                           device="cuda" if size["cold"] == "device" else "cpu")
        cold = cold if cold.is_cuda else cold.pin_memory()
        pairs = [scattered_pairs(s * pages, pages) for s in range(sets)]
        recorded = {"pages": pages, "hot_bytes": pages * self.lc.hot_page_bytes,
                    "cold_bytes": pages * self.lc.cold_page_bytes, "cold": size["cold"], "rotation": sets}
        # one pool set holds every rotation copy: the pairs of copy s address its own page range
        return Inputs([(pools, cold, p) for p in pairs], recorded)

    def check(self, library: FamilyLibrary, seed: int) -> None:
        """Encoded bytes and decoded pages byte-identical to the oracle on 6 fresh pages."""
        pools = self.pools(6, torch.Generator(device="cuda").manual_seed(seed))
        codec = self.codec(library, pools)
        record, lc = self.layout.record, self.lc
        pairs = torch.tensor(CHECK_PAIRS, dtype=torch.int32)
        cold = torch.full((6, lc.cold_page_bytes), 0xA5, dtype=torch.uint8, device="cuda")
        launch(lambda: codec.encode(cold, pairs))
        nq = len(record.buffers)
        src, dst = pairs[:, 1].long().cuda(), pairs[:, 0].long().cuda()
        for j, layer in enumerate(lc.layers):
            buffers = {b.name: pools[layer][i][src] for i, b in enumerate(record.buffers)}
            sides = {s.name: pools[layer][nq + i][src] for i, s in enumerate(record.sides)}
            want = encode_records(record, buffers, sides)
            if not torch.equal(cold[dst, j * lc.record_bytes:(j + 1) * lc.record_bytes], want):
                raise Failure("wrong", f"encoded layer {layer} differs from the oracle")
        out = [[torch.zeros_like(p) for p in layer] for layer in pools]
        decoder = self.codec(library, out)
        launch(lambda: decoder.decode(cold, reverse_pairs(pairs)))
        for j, layer in enumerate(lc.layers):
            buffers, sides = decode_records(record, cold[dst, j * lc.record_bytes:(j + 1) * lc.record_bytes],
                                            self.dtype)
            for pool, want in zip(out[layer], list(buffers.values()) + list(sides.values())):
                if not torch.equal(pool[src].contiguous().view(torch.uint8).flatten(),
                                   want.contiguous().view(torch.uint8).flatten()):
                    raise Failure("wrong", f"decoded layer {layer} differs from the oracle")
        codec.close()
        decoder.close()

    def time(self, library: FamilyLibrary, inputs: Inputs, reps: int) -> dict[str, float]:
        pools, cold, _ = inputs.sets[0]
        codec = self.codec(library, pools)
        calls = [lambda p=p, q=reverse_pairs(p): (codec.encode(cold, p), codec.decode(cold, q))
                 for _, _, p in inputs.sets]
        t = timed(calls, reps)
        codec.close()
        return t
