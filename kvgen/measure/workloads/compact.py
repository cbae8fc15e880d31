"""The TriAttention compaction workload: in-place compaction of B due requests over every layer,
moves from the oracle's packer, pools checked byte for byte against the oracle's ``compact_paged``."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from kvgen.measure.timing import rotation_sets
from kvgen.measure.workloads.base import Failure, Inputs, launch, loading, timed
from kvgen.reference.triattention import Moves, TriGeometry, compact_paged, pack_moves
from kvgen.runtime.compact import CompactLibrary, Compactor
from kvgen.runtime.score import TORCH_DTYPES

PROMPT, MAX_TAIL = 512, 31
CHECK_SIZE = {"batch": 2, "decode": 300, "budget": 100}
POOL_SHARE = 0.4     # the pools of one size take at most this share of the free memory


def oracle_compaction_matches(compactor: Compactor, k_pools: list, v_pools: list, table: torch.Tensor,
                              moves: Moves, geometry: TriGeometry) -> bool:
    """One compaction by ``compactor`` (in place) against the oracle's ``compact_paged`` on copies of
    the same pools: every pool byte-identical. ``moves`` may carry fill moves (-1) past the real ones."""
    k_ref = [p.clone() for p in k_pools]
    v_ref = [p.clone() for p in v_pools]
    n = int(moves.offsets[-1])
    real = Moves(moves.src[..., :n].contiguous(), moves.dst[..., :n].contiguous(), moves.offsets)
    compact_paged(k_ref, v_ref, table, real, geometry)
    launch(lambda: compactor(table, moves.src, moves.dst, moves.offsets))
    return all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
               for a, b in zip(list(k_pools) + list(v_pools), k_ref + v_ref))


class CompactWorkload:
    """Compaction of B due requests (``budget`` kept of ``decode`` generated tokens, protected tails
    of 0..31), every layer; size ``{"batch", "decode", "budget"}``; K/V pools of the geometry."""

    op = "compact"

    def __init__(self, geometry: TriGeometry, dtype: str):
        self.geometry = geometry
        self.dtype = TORCH_DTYPES[dtype]
        self.elem_bytes = torch.empty((), dtype=self.dtype).element_size()

    def _size(self, size: dict[str, Any]) -> tuple[int, int, int]:
        """The size's (batch, decode, budget), the budget raised to the widest sliding window (the
        contract requires it) and the batch halved until the pools take at most 40 % of free memory."""
        windows = [w for w in self.geometry.swa_window if w]
        budget = max(size["budget"], *windows) if windows else size["budget"]
        decode = max(size["decode"], budget + 1024)
        batch = size["batch"]
        per_request = 2 * self.geometry.num_layers * self._pages_per_request(decode) * self._page_bytes()
        free, _ = torch.cuda.mem_get_info()
        while batch > 1 and batch * per_request > POOL_SHARE * free:
            batch //= 2
        return batch, decode, budget

    def _pages_per_request(self, decode: int) -> int:
        return math.ceil((PROMPT + decode + MAX_TAIL) / self.geometry.tokens_per_block)

    def _page_bytes(self) -> int:
        return math.prod(self.geometry.page_shape) * self.elem_bytes

    def moves(self, batch: int, decode: int, budget: int, seed: int) -> tuple[Moves, torch.Tensor, int]:
        """The oracle's moves for ``batch`` due requests keeping a random ``budget`` of their tokens, a
        random page table, and the page count; seeded on the CPU (the same on every GPU)."""
        g = self.geometry
        gen = torch.Generator().manual_seed(seed)
        P = torch.full((batch,), PROMPT, dtype=torch.long)
        S = P + decode
        tail = torch.randint(0, MAX_TAIL + 1, (batch,), generator=gen)
        order = torch.rand(batch, 1, decode, generator=gen).argsort(dim=-1)[..., :budget]
        kept = order.sort(dim=-1).values + P[:, None, None]
        active = torch.ones(batch, dtype=torch.bool)
        packed = pack_moves(kept, P, S, tail, active, budget, "union", g, batch)
        moves = Moves(packed.src.cuda(), packed.dst.cuda(), packed.offsets.cuda())
        per_request = self._pages_per_request(decode)
        table = torch.randperm(batch * per_request, generator=gen).to(torch.int32).reshape(batch, per_request)
        return moves, table.cuda(), batch * per_request

    def pools(self, pages: int, fill: bool, seed: int = 0) -> tuple[list, list]:
        """K and V pools of every layer; with ``fill``, random bytes (else uninitialized)."""
        shape = (pages, *self.geometry.page_shape)
        gen = torch.Generator(device="cuda").manual_seed(seed)
        pools: tuple[list, list] = ([], [])
        for _ in range(self.geometry.num_layers):
            for side in pools:
                pool = torch.empty(shape, dtype=self.dtype, device="cuda")
                if fill:
                    pool.view(torch.uint8).random_(0, 256, generator=gen)
                side.append(pool)
        return pools

    def load(self, path: Path) -> CompactLibrary:
        return loading(lambda: CompactLibrary(path))

    def compactor(self, library: CompactLibrary, pools: tuple[list, list]) -> Compactor:
        return loading(lambda: Compactor(library, *pools))

    def inputs(self, size: dict[str, Any], seed: int) -> Inputs:
        batch, decode, budget = self._size(size)
        moves, table, pages = self.moves(batch, decode, budget, seed)
        layer_bytes = 2 * pages * self._page_bytes()
        # distinct bytes a call touches ~ half of every layer's K and V
        copies = rotation_sets(self.geometry.num_layers * layer_bytes // 2)
        sets = [(moves, table, self.pools(pages, fill=False)) for _ in range(copies)]
        return Inputs(sets, {"batch": batch, "decode": decode, "budget": budget, "rotation": len(sets)})

    def check(self, library: CompactLibrary, seed: int) -> None:
        """Pools byte-identical to the oracle's compact_paged after one compaction of 2 fresh requests."""
        _, decode, budget = self._size(CHECK_SIZE)
        moves, table, pages = self.moves(CHECK_SIZE["batch"], decode, budget, seed)
        pools = self.pools(pages, fill=True, seed=seed)
        if not oracle_compaction_matches(self.compactor(library, pools), *pools, table, moves, self.geometry):
            raise Failure("wrong", "compacted pools differ from the oracle")

    def time(self, library: CompactLibrary, inputs: Inputs, reps: int) -> dict[str, float]:
        calls = []
        for moves, table, pools in inputs.sets:
            compactor = self.compactor(library, pools)
            calls.append(lambda c=compactor, m=moves, t=table: c(t, m.src, m.dst, m.offsets))
        return timed(calls, reps)
