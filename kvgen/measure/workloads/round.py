"""The whole-round workload: one TriAttention eviction round (score -> normalize/aggregate/select ->
pack -> compact) of B requests, every one due, on the family's generated kernels, and the round's
bytes limit.

Bytes limit (PERFORMANCE.md): the K the scorer must read, once (scored layers x B x Hkv x W x the
rotated span's bytes), at the copy ceiling, plus the compaction's moves (every cache layer, K and
V, the rows a round moves per (request, KV head), each read and written) at the copy ceiling: a
scored layer moves its ``budget`` kept rows, a sliding-window layer its latest ``window`` rows
(TRIATTENTION.md §6; the bench's rounds protect no tail). The ceiling is
``kvgen.measure.timing.copy_ceiling``'s bytes read + written per second.
"""

from __future__ import annotations

import math
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from kvgen.artifacts.dispatch import DispatchFiles
from kvgen.artifacts.manifest import RegistryError
from kvgen.measure.libraries import registry_artifact, registry_dispatch
from kvgen.measure.workloads.score import PROMPT, ScoreCache, ScoreFamily
from kvgen.reference.triattention import EvictionConfig, save_calibration
from kvgen.runtime.eviction import TriAttentionManager
from kvgen.runtime.lookup import RuntimeRegistry
from kvgen.runtime.score import TORCH_DTYPES, ScoreDispatch


def cache_bytes(family: ScoreFamily, batch: int, width: int) -> int:
    """K and V of every cache layer for ``batch`` requests of ``PROMPT + width`` tokens."""
    g = family.geometry
    pages = batch * math.ceil((PROMPT + width) / g.tokens_per_block)
    elem = torch.empty((), dtype=TORCH_DTYPES[family.dtype]).element_size()
    return 2 * g.num_layers * pages * math.prod(g.page_shape) * elem


def layers_that_fit(family: ScoreFamily, batch: int, width: int, free_bytes: int, share: float) -> int:
    """How many cache layers' K and V fit in ``share`` of ``free_bytes`` (all of them at most)."""
    per_layer = cache_bytes(family, batch, width) // family.geometry.num_layers
    return min(family.geometry.num_layers, int(share * free_bytes) // per_layer)


def bytes_limit(family: ScoreFamily, batch: int, width: int, budget: int) -> dict[str, int]:
    """``{"k_read", "moves"}``: the bytes of the module docstring (moves counted read + written)."""
    g = family.geometry
    elem = torch.empty((), dtype=TORCH_DTYPES[family.dtype]).element_size()
    k_read = len(g.scored_layers) * batch * g.kv_heads * width * g.rotary_dim * elem
    rows = sum(budget if window is None else window for window in g.swa_window)   # moved rows of every layer
    moves = 2 * 2 * rows * batch * g.kv_heads * g.head_dim * elem
    return {"k_read": k_read, "moves": moves}


def score_round_trip(family: ScoreFamily, batch: int, width: int) -> int:
    """The bytes the round's design moves past the bytes limit: its float32 scores (scored layers x B
    x Hq x W), written by the scorer and read by the statistics and again by the aggregation.
    z-normalization needs a row's statistics before any of its values is aggregated (TRIATTENTION.md
    §4), so the scores are materialized; where they are large next to the K span a request reads
    (many query heads a KV head, a short span), this sets a floor above the limit."""
    g = family.geometry
    return 3 * len(g.scored_layers) * batch * g.query_heads * width * 4


@dataclass
class Artifacts:
    """Where each stage's kernel comes from, and what was used instead when it is missing."""

    score: ScoreDispatch           # the score library and its size-dispatched variants
    pack: Path | None
    compact: DispatchFiles | None   # the compaction library and its size-dispatched variants
    select: DispatchFiles           # the selection, likewise
    note: str


def round_artifacts(family: str, registry: Path, arch: str, generated: Path) -> Artifacts:
    """The registry's artifacts; the selection module falls back to ``generated/<family>/select.py``
    of the checkout (the same text) for a registry built before the op existed, and the packer and
    compactor to the oracle's when the registry lacks them (said in ``note``)."""
    score = ScoreDispatch.from_resolved(RuntimeRegistry([registry]).resolve(family, arch))
    notes = []
    try:
        select = registry_dispatch(registry, family, arch, "select")
    except RegistryError:
        select = (Path(generated) / family / "select.py", [])
        notes.append(f"selection from {select[0]} (not in the registry)")
    try:
        pack, compact = (registry_artifact(registry, family, arch, "pack"),
                         registry_dispatch(registry, family, arch, "compact"))
    except RegistryError as exc:
        pack = compact = None
        notes.append(f"oracle pack_moves + compact_paged ({str(exc).splitlines()[0]})")
    return Artifacts(score, pack, compact, select, "; ".join(notes) or "all from the registry")


class RoundCase:
    """A full cache of ``batch`` requests (``PROMPT`` + ``width`` tokens, pages scattered) and the
    manager that runs its round with ``artifacts``; every request is due. With ``own_layers``, the
    layers past the first ``own_layers`` share their pools (``ScoreCache``): every layer is still
    scored and compacted, and layers on the same pool compact the same bytes at once, which moves
    the same bytes as separate pools would (their contents are then no one's result)."""

    def __init__(self, config: EvictionConfig, family: ScoreFamily, batch: int, width: int, artifacts: Artifacts,
                 budget: int, mode: str, own_layers: int | None = None):
        self.cache = ScoreCache(family, batch, width, all_layers=True, with_v=True, own_layers=own_layers)
        g = self.cache.geometry
        k_pools = [self.cache.k_pools[layer] for layer in range(g.num_layers)]
        v_pools = [self.cache.v_pools[layer] for layer in range(g.num_layers)]
        backends = {}
        if artifacts.pack is not None:
            backends = {"pack_module": artifacts.pack, "compact_library": artifacts.compact}
        with tempfile.TemporaryDirectory() as tmp:
            calib_path = Path(tmp) / "calib.pt"
            save_calibration(self.cache.calibration, calib_path)
            self.manager = TriAttentionManager(config, calib_path, k_pools, v_pools, artifacts.score, budget=budget,
                                               beta=128, eviction_mode=mode, max_position=PROMPT + width + 1,
                                               select_module=artifacts.select, **backends)
        self.P, self.S = self.cache.P, self.cache.S
        self.L, self.tail = self.cache.S, [0] * batch

    def stages(self) -> dict:
        """Callables of each stage on this cache (inputs prepared once, as the round prepares them)."""
        m, table = self.manager, self.cache.page_table
        P, S, L, tail = self.P, self.S, self.L, self.tail
        rows = m.round_rows(P, S, L, tail)
        scores = m.score(table, P, S, L, rows)
        kept = m.select(scores, P, S, rows).check()
        active = torch.ones(len(P), dtype=torch.bool, device=m.device)
        capacity = sum(m.budget + t for t in tail)
        pack_args = (kept, rows[0], rows[2], rows[3], active, m.budget, m.mode, len(P), capacity)
        moves = m.packer(*pack_args)
        stages = {
            "score": lambda: m.score(table, P, S, L, rows),
            "normalize_aggregate_select": lambda: m.select(scores, P, S, rows).check(),
            "pack": lambda: m.packer(*pack_args),
            "compact": lambda: m.compactor(table, *moves),
            "round": lambda: m.run_round(table, P, S, L, tail),
        }
        module_for = getattr(m.selector, "module_for", None)
        if module_for is not None:   # the generated selection's kernels serving this round, one by one
            module = module_for(len(P), scores.shape[-1])
            width = rows[1]
            mean, std = module.statistics(scores, width)
            values = module.aggregate(scores, mean, std, width, m.mode)
            stages["statistics"] = lambda: module.statistics(scores, width)
            stages["aggregate"] = lambda: module.aggregate(scores, mean, std, width, m.mode)
            # both in one launch (aggregate_route 1), whichever route the round takes
            stages["statistics_aggregate"] = lambda: module.statistics_aggregate(scores, width, m.mode)
            stages["select"] = lambda: module.select(values, width, m.budget, rows[0])
        return stages
