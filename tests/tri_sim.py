"""A synthetic long decode for TriAttention tests (CPU and GPU): paged K/V pools with scattered
pages, requests with prompts of different lengths and protected tails, one token per request per
step; the manager under test and the oracle's ``eviction_round`` run side by side on copies.

Spec-free (an ``EvictionConfig`` describes the family), so the wheel proof runs it where only the
runtime, the oracle and an installed kernel wheel exist."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvgen.reference.triattention import (
    EvictionConfig,
    TriGeometry,
    eviction_round,
    is_due,
    save_calibration,
    synthetic_calibration,
)
from kvgen.runtime.eviction import GenerationStep, TriAttentionManager
from kvgen.runtime.score import TORCH_DTYPES


def small_spec(spec, layers: int):  # noqa: ANN001 - a FamilySpec (pydantic), kept out of this module's imports
    """The family with fewer cache layers (the kernel does not depend on the count)."""
    return spec.model_copy(update={"layers": layers})


def write_rows(pool: torch.Tensor, geometry: TriGeometry, pages: torch.Tensor, slots: torch.Tensor,
               rows: torch.Tensor) -> None:
    """``rows`` ``[n, Hkv, D]`` into tokens (page, slot) of ``pool``."""
    if geometry.layout == "HND":
        pool[pages, :, slots, :] = rows
    else:
        pool[pages, slots] = rows


def save_synthetic_calibration(config: EvictionConfig, path: Path, seed: int = 0) -> Path:
    save_calibration(synthetic_calibration(config.geometry, seed, theta=config.rope_theta,
                                           scaling=config.rope_scaling), path)
    return path


@dataclass
class DecodeSim:
    """Pools, page table and lengths of a batch; ``step()`` appends one token per request."""

    config: EvictionConfig
    prompts: list[int]
    tails: list[int]
    max_tokens: int
    device: torch.device
    seed: int = 0
    generated: list[int] | None = None   # decode tokens already in the cache per request (staggers rounds)
    combined: bool = False               # K and V of a layer share one buffer [pages, 2, ...] (page stride x2)
    codebook: int | None = None          # K rows drawn from this many distinct rows per layer (see below)
    geometry: TriGeometry = field(init=False)

    def __post_init__(self) -> None:
        self.geometry = self.config.geometry
        g = self.geometry
        self.gen = torch.Generator().manual_seed(self.seed)
        per_request = math.ceil(self.max_tokens / g.tokens_per_block)
        num_pages = len(self.prompts) * per_request + 3
        order = torch.randperm(num_pages, generator=self.gen)          # scattered pages
        self.page_table = order[: len(self.prompts) * per_request].reshape(len(self.prompts), per_request)
        self.page_table = self.page_table.to(torch.int32).to(self.device)
        dtype = TORCH_DTYPES[self.config.dtype]
        shape = (num_pages, *g.page_shape)
        if self.combined:
            buffers = [self._random((num_pages, 2, *shape[1:])).to(dtype).to(self.device) for _ in range(g.num_layers)]
            self.k_pools = [buffer[:, 0] for buffer in buffers]
            self.v_pools = [buffer[:, 1] for buffer in buffers]
        else:
            self.k_pools = [self._random(shape).to(dtype).to(self.device) for _ in range(g.num_layers)]
            self.v_pools = [self._random(shape).to(dtype).to(self.device) for _ in range(g.num_layers)]
        if self.codebook:
            # Every K row is one of `codebook` random rows of its layer: equal rows score equally in
            # any implementation (exact ties, settled by index), distinct rows score far apart, so a
            # float32 kernel and the oracle keep the same tokens however they round.
            self.rows_of_layer = [self._random((self.codebook, g.kv_heads, g.head_dim)).to(dtype)
                                  for _ in range(g.num_layers)]
            for layer, pool in enumerate(self.k_pools):
                pick = torch.randint(self.codebook, (num_pages, g.tokens_per_block), generator=self.gen)
                rows = self.rows_of_layer[layer][pick]                      # [pages, tpb, Hkv, D]
                pool.copy_(rows.permute(0, 2, 1, 3) if g.layout == "HND" else rows)
        # The prompt, any decode tokens already generated and the tail are in the cache already.
        generated = self.generated or [0] * len(self.prompts)
        self.lengths = [p + n + t for p, n, t in zip(self.prompts, generated, self.tails)]

    def _random(self, shape) -> torch.Tensor:
        x = torch.randn(shape, generator=self.gen) * 2
        return x

    def clone_pools(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        return [p.clone() for p in self.k_pools], [p.clone() for p in self.v_pools]

    def duplicate_rows(self, request: int, source: int, targets: range) -> None:
        """Copy the K row of decode token ``source`` (relative to the prompt) over ``targets``: equal
        keys score equally, so selection must break the ties by index."""
        g = self.geometry
        base = self.prompts[request]
        for pool in self.k_pools:
            row = self._row(pool, request, base + source)
            for target in targets:
                token = base + target
                page = int(self.page_table[request, token // g.tokens_per_block])
                slot = token % g.tokens_per_block
                if g.layout == "HND":
                    pool[page, :, slot, :] = row
                else:
                    pool[page, slot] = row

    def step(self, other_pools: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None,
             other_lengths: list[int] | None = None, repeat_every: int = 7) -> None:
        """Write one new token per request at its physical length, in these pools and the other
        (oracle) copy; every ``repeat_every``-th token copies an earlier row (exact score ties)."""
        g = self.geometry
        positions = torch.tensor(self.lengths, dtype=torch.int64)
        if other_lengths is not None:
            assert other_lengths == self.lengths, "the manager and the oracle disagree on lengths"
        table = self.page_table.cpu().long()
        pages = table[torch.arange(len(self.lengths)), positions // g.tokens_per_block].to(self.device)
        slots = (positions % g.tokens_per_block).to(self.device)
        dtype = TORCH_DTYPES[self.config.dtype]
        for layer in range(g.num_layers):
            if self.codebook:
                pick = torch.randint(self.codebook, (len(self.lengths),), generator=self.gen)
                rows = self.rows_of_layer[layer][pick].to(self.device)
            else:
                rows = self._random((len(self.lengths), g.kv_heads, g.head_dim)).to(dtype).to(self.device)
            for b, length in enumerate(self.lengths):
                if length % repeat_every == 0 and length > self.prompts[b] + 2:
                    rows[b] = self._row(self.k_pools[layer], b, self.prompts[b] + 1)   # a decode token's K
            for pools in [(self.k_pools, self.v_pools)] + ([other_pools] if other_pools else []):
                write_rows(pools[0][layer], g, pages, slots, rows)
                write_rows(pools[1][layer], g, pages, slots, rows.flip(-1))
        self.lengths = [length + 1 for length in self.lengths]

    def _row(self, pool: torch.Tensor, request: int, token: int) -> torch.Tensor:
        g = self.geometry
        page = int(self.page_table[request, token // g.tokens_per_block])
        slot = token % g.tokens_per_block
        return pool[page, :, slot, :].clone() if g.layout == "HND" else pool[page, slot].clone()


def run_against_oracle(manager: TriAttentionManager, sim: DecodeSim, steps: int, calibration) -> list[dict]:
    """Decode ``steps`` tokens; after each, the manager's hook and (when some request is due) the
    oracle's ``eviction_round`` on a copy. Pools must stay byte-identical; returns the rounds."""
    g = sim.geometry
    ref_k, ref_v = sim.clone_pools()
    ids = [f"r{b}" for b in range(len(sim.prompts))]
    C = [0] * len(ids)
    ref_lengths = list(sim.lengths)
    rounds = []
    for rid, prompt in zip(ids, sim.prompts):
        manager.on_request_init(_Req(rid, prompt))
    for step in range(steps):
        sim.step((ref_k, ref_v), ref_lengths)
        ref_lengths = [n + 1 for n in ref_lengths]
        report = manager.on_generation_step_end(GenerationStep(ids, sim.page_table, list(sim.lengths), sim.tails))
        S = [n - t for n, t in zip(ref_lengths, sim.tails)]
        due = [is_due(p, s, c, s + c, manager.budget, manager.beta) for p, s, c in zip(sim.prompts, S, C)]
        if any(due):
            result = eviction_round(ref_k, ref_v, sim.page_table, sim.prompts, S, C, sim.tails, calibration, g,
                                    manager.budget, manager.beta, manager.mode)
            C = result.C.tolist()
            ref_lengths = result.lengths.tolist()
            due_index = [b for b, d in enumerate(due) if d]
            assert list(report.due) == [ids[b] for b in due_index], f"step {step}: due sets differ"
            assert torch.equal(report.kept.cpu(), result.kept[due_index].cpu()), \
                f"step {step}: kept positions differ from the oracle's\n{_near_ties(result, due_index, manager.budget)}"
            rounds.append({"step": step, "due": due_index, "evicted": list(report.evicted)})
        else:
            assert report.due == (), f"step {step}: the manager ran a round the oracle would not"
        assert list(report.lengths) == ref_lengths, f"step {step}: lengths {report.lengths} != {ref_lengths}"
        sim.lengths = list(report.lengths)
        for layer in range(g.num_layers):
            for mine, ref, what in ((sim.k_pools[layer], ref_k[layer], "K"), (sim.v_pools[layer], ref_v[layer], "V")):
                assert torch.equal(mine.view(torch.int16), ref.view(torch.int16)), \
                    f"step {step}: {what} pool of layer {layer} differs from the oracle's"
    for rid, prompt in zip(ids, sim.prompts):
        manager.on_request_finish(_Req(rid, prompt))
    return rounds


def _near_ties(result, due_index: list[int], budget: int) -> str:
    """Diagnostic: the gap between the budget-th and next decision value of each due row (a
    difference of kept sets at a gap of ~1e-6 is rounding, not a bug)."""
    lines = []
    for b in due_index:
        for r in range(result.values.shape[1]):
            top = torch.sort(result.values[b, r], descending=True).values
            if top.numel() > budget:
                lines.append(f"request {b} row {r}: gap at the cut {float(top[budget - 1] - top[budget]):.3g}")
    return "\n".join(lines[:20])


@dataclass(frozen=True)
class _Req:
    request_id: str
    prompt_len: int
