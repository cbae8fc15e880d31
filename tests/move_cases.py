"""Random TriAttention batches for the move packer and compaction tests (CPU and GPU).

Only torch and the oracle (kvgen.reference.triattention): the GPU machine has no pydantic, so
nothing here touches the spec or the build side.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvgen.reference.triattention import MOVE_FILL, Moves, TriGeometry, num_decision_rows

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8_e4m3": torch.float8_e4m3fn}


def geometry(num_layers: int, kv_heads: int, swa_window=None, head_dim: int = 64, tokens_per_block: int = 16,
             layout: str = "HND") -> TriGeometry:
    """A TriGeometry for packing and compaction: the query-side fields only need to be valid."""
    windows = tuple(swa_window) if swa_window is not None else (None,) * num_layers
    return TriGeometry(num_layers=num_layers, query_heads=kv_heads, kv_heads=kv_heads, head_dim=head_dim,
                       rotary_start=0, rotary_dim=head_dim, pairing="half", tokens_per_block=tokens_per_block,
                       layout=layout, swa_window=windows)


@dataclass
class Batch:
    kept: torch.Tensor    # int64 [B, R, budget], -1 rows for requests that are not due
    P: torch.Tensor       # int64 [B]
    S: torch.Tensor
    tail: torch.Tensor
    active: torch.Tensor  # bool [B]
    budget: int
    mode: str
    max_requests: int

    @property
    def lengths(self) -> torch.Tensor:
        """Physical length before the round: prompt, scorable decode tokens, protected tail."""
        return self.S + self.tail

    def args(self) -> tuple:
        return self.kept, self.P, self.S, self.tail, self.active, self.budget, self.mode

    def to(self, device: str | torch.device) -> "Batch":
        moved = [t.to(device) for t in (self.kept, self.P, self.S, self.tail, self.active)]
        return Batch(*moved, self.budget, self.mode, self.max_requests)


def random_batch(geo: TriGeometry, mode: str, budget: int, batch: int, seed: int, padding: int = 2,
                 max_prompt: int = 40, max_extra: int = 40, max_tail: int = 24,
                 active: list[bool] | None = None) -> Batch:
    """``batch`` requests (the first is always due) plus ``padding`` padded ones. Each due request
    keeps ``budget`` of its ``S - P`` decode tokens per decision row, ascending and absolute."""
    g = torch.Generator().manual_seed(seed)
    P = torch.randint(0, max_prompt + 1, (batch,), generator=g)
    S = P + budget + torch.randint(0, max_extra + 1, (batch,), generator=g)
    tail = torch.randint(0, max_tail + 1, (batch,), generator=g)
    if active is None:
        active = [True] + (torch.rand(batch - 1, generator=g) < 0.7).tolist()
    due = torch.tensor(active, dtype=torch.bool)
    rows = num_decision_rows(mode, geo)
    kept = torch.full((batch, rows, budget), MOVE_FILL, dtype=torch.int64)
    for r in range(batch):
        if due[r]:
            width = int(S[r] - P[r])
            order = torch.rand(rows, width, generator=g).argsort(dim=1)[:, :budget]
            kept[r] = order.sort(dim=1).values + P[r]
    return Batch(kept, P, S, tail, due, budget, mode, batch + padding)


def random_page_table(lengths: torch.Tensor, tokens_per_block: int, max_requests: int, seed: int,
                      spare_pages: int = 3) -> tuple[torch.Tensor, int]:
    """int32 ``[max_requests, max_pages]`` of distinct, shuffled pages (unused entries -1) and the
    pool's page count; every request gets the pages its ``lengths`` need."""
    g = torch.Generator().manual_seed(seed)
    need = [(int(n) + tokens_per_block - 1) // tokens_per_block for n in lengths.tolist()]
    num_pages = sum(need) + spare_pages
    pages = torch.randperm(num_pages, generator=g)
    table = torch.full((max_requests, max(need + [1])), -1, dtype=torch.int32)
    start = 0
    for r, n in enumerate(need):
        table[r, :n] = pages[start:start + n].to(torch.int32)
        start += n
    return table, num_pages


def random_pools(geo: TriGeometry, num_pages: int, dtype: str, seed: int) -> tuple[list, list]:
    """Per-layer K and V pools of random bytes (any bit pattern: compaction copies bytes)."""
    g = torch.Generator().manual_seed(seed)
    elem = torch.empty((), dtype=DTYPES[dtype]).element_size()
    shape = (num_pages, *geo.page_shape)

    def pool() -> torch.Tensor:
        raw = torch.randint(0, 256, shape[:-1] + (geo.head_dim * elem,), dtype=torch.uint8, generator=g)
        return raw.view(DTYPES[dtype])

    k_pools = [pool() for _ in range(geo.num_layers)]
    v_pools = [pool() for _ in range(geo.num_layers)]
    return k_pools, v_pools


def corrupt_moves(moves: Moves, table: torch.Tensor, tpb: int) -> tuple[Moves, torch.Tensor, Moves]:
    """Bad moves and a bad page table entry (what a buggy caller could pass as device arrays), and
    the moves the kernel must still make: every move touching a bad value turned into the fill.

    src 100000 (past the table row), dst -5 and src -5 (negative, not the -1 fill) on three real
    moves; the page table entry of a fourth real move's source page set past the pools (every move of
    its request reading or writing a token of that page must be skipped)."""
    src, dst = moves.src.clone(), moves.dst.clone()
    real = ((src >= 0) & (src != dst)).nonzero().tolist()
    assert len(real) >= 4
    for (layer, head, m), (field, value) in zip(real[:3], [(src, 100000), (dst, -5), (src, -5)]):
        field[layer, head, m] = value
    keep_src, keep_dst = moves.src.clone(), moves.dst.clone()
    for layer, head, m in real[:3]:
        keep_src[layer, head, m] = keep_dst[layer, head, m] = -1
    bad_table = table.clone()
    layer, head, m = real[3]  # a real move left: its source page's entry goes bad
    request = int(moves.request_of_slot()[m])
    page_index = int(moves.src[layer, head, m]) // tpb
    bad_table[request, page_index] = 1 << 20
    slot = torch.arange(src.shape[-1], device=src.device)
    in_request = (slot >= int(moves.offsets[request])) & (slot < int(moves.offsets[request + 1]))
    touches = ((moves.src // tpb == page_index) & (moves.src >= 0)) | ((moves.dst // tpb == page_index) & (moves.dst >= 0))
    hit = touches & in_request
    keep_src[hit] = -1
    keep_dst[hit] = -1
    return Moves(src, dst, moves.offsets), bad_table, Moves(keep_src, keep_dst, moves.offsets)
