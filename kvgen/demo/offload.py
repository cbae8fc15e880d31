"""Part 1: the offload scenario of one family -- requests offloaded through the codec into the cold
tier and onboarded back, every page checked against the oracle -- and the transfer measurements
(codec to/from the cold tier vs raw copies of the same hot pages)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from kvgen.demo.attention import ErrorStats, attention, random_queries
from kvgen.demo.codecs import open_codec, oracle_decode_pages, oracle_encode_pages, pairs_tensor
from kvgen.demo.config import DemoConfig, DemoError, load_family, timer_label
from kvgen.demo.synthetic import CacheGeometry, KVGenerator, from_pages
from kvgen.demo.tiers import ColdTier, DiskTier, HotPool
from kvgen.lower.layout import FamilyLayout, family_layout
from kvgen.measure.timing import clock_for, time_ms, time_once


@dataclass
class Request:
    rid: int
    tokens: int
    pages: int
    state: str = "new"            # new | hot | cold | disk | dropped
    hot: list[int] = field(default_factory=list)
    cold: list[int] = field(default_factory=list)
    disk: list[int] = field(default_factory=list)
    last_used: int = 0


@dataclass
class ScenarioCounts:
    admitted: int = 0
    returns: int = 0
    offloads: int = 0
    pages_offloaded: int = 0
    onboards: int = 0
    pages_onboarded: int = 0
    spilled_to_disk: int = 0
    read_from_disk: int = 0
    dropped: int = 0
    recomputed: int = 0
    peak_cold_pages: int = 0
    offload_ms: float = 0.0
    onboard_ms: float = 0.0


@dataclass
class CodecChecks:
    pages_checked: int = 0
    cold_bytes_equal_oracle: bool = True
    restored_equal_oracle_decode: bool = True


def request_trace(count: int, rng: torch.Generator) -> list[int]:
    """Every request arrives once, in order, then returns once in a random order: arrivals fill
    the hot pool and push older requests out; returns bring them back."""
    returns = torch.randperm(count, generator=rng).tolist()
    return list(range(count)) + returns


class OffloadScenario:
    """LRU offload/onboard of requests between a hot pool, a cold tier and an optional disk tier.

    Hot pool full: the least recently used hot request is encoded into cold slots. Cold tier full:
    the least recently used cold request moves to disk (its blobs, byte for byte), or is dropped
    without a disk. A returning request comes back disk -> cold -> hot; every onboarded page is
    checked against the oracle and its attention error measured (``_onboard``).
    """

    def __init__(self, config: DemoConfig, geometry: CacheGeometry, layout: FamilyLayout, hot: HotPool,
                 cold: ColdTier, disk: DiskTier | None, codec: Any, generator: KVGenerator):
        self.config, self.geometry, self.layout = config, geometry, layout
        self.hot, self.cold, self.disk, self.codec, self.generator = hot, cold, disk, codec, generator
        self.counts = ScenarioCounts()
        self.checks = CodecChecks()
        self.errors = {"both": ErrorStats(), "k_only": ErrorStats(), "v_only": ErrorStats()}
        self.buffer_errors = {name: ErrorStats() for name in geometry.buffers}
        self.clock = 0
        self.requests: list[Request] = []
        self.query_gen = torch.Generator().manual_seed(config.seed + 17)

    # ---- the trace

    def run(self, requests: Sequence[Request], trace: Sequence[int]) -> None:
        self.requests = list(requests)
        for rid in trace:
            self.serve(self.requests[rid])

    def serve(self, request: Request) -> None:
        """A request is scheduled: make its K/V hot (prefill, or onboard from cold or disk)."""
        self.clock += 1
        if request.state != "new":
            self.counts.returns += 1
        if request.state in ("new", "dropped"):
            self._prefill(request)
        elif request.state in ("cold", "disk"):
            self._onboard(request)
        request.last_used = self.clock

    def _prefill(self, request: Request) -> None:
        if request.state == "dropped":
            self.counts.recomputed += 1
        else:
            self.counts.admitted += 1
        self._make_hot_room(request.pages, keep=request)
        request.hot = self.hot.allocate(request.pages)
        self.hot.write(request.hot, self.generator.paged(request.rid, request.tokens), self.geometry.buffers)
        request.state = "hot"

    # ---- eviction from the hot pool

    def _make_hot_room(self, pages: int, keep: Request) -> None:
        if pages > self.hot.pages:
            raise ValueError(f"request of {pages} pages cannot fit a hot pool of {self.hot.pages}")
        while len(self.hot.free) < pages:
            victim = min((r for r in self.requests if r.state == "hot" and r is not keep), key=lambda r: r.last_used)
            self._offload(victim)

    def _offload(self, request: Request) -> None:
        """Encode the request's hot pages into cold slots (the store is the transfer), free them."""
        if not self._make_cold_room(request.pages, keep=request):
            self._drop(request)
            return
        slots = self.cold.allocate(request.pages)
        pairs = pairs_tensor(slots, request.hot)
        _, ms = time_once(lambda: self.codec.encode(self.cold.storage, pairs), clock_for(self.config.device))
        self.counts.offload_ms += ms
        self.counts.offloads += 1
        self.counts.pages_offloaded += request.pages
        self.hot.release(request.hot)
        request.hot, request.cold, request.state = [], slots, "cold"
        self.counts.peak_cold_pages = max(self.counts.peak_cold_pages, self.cold.used)

    def _drop(self, request: Request) -> None:
        """No host room: discard the cache; the request is recomputed (prefilled again) when it
        returns. Happens without a disk tier, or when the only cold pages that could move down
        belong to the request being onboarded."""
        self.hot.release(request.hot)
        self.cold.release(request.cold)
        request.hot, request.cold, request.state = [], [], "dropped"
        self.counts.dropped += 1

    # ---- the cold tier

    def _make_cold_room(self, pages: int, keep: Request) -> bool:
        """Free cold slots by moving the least recently used cold requests down (to disk, or
        dropping them); False when even that cannot make room."""
        if pages > self.cold.slots:
            return False
        while len(self.cold.free) < pages:
            victims = [r for r in self.requests if r.state == "cold" and r is not keep]
            if not victims:
                return False
            victim = min(victims, key=lambda r: r.last_used)
            if self.disk is not None:
                self._spill(victim)
            else:
                self._drop(victim)
        return True

    def _spill(self, request: Request) -> None:
        request.disk = self.disk.store(self.cold.storage[request.cold])
        self.cold.release(request.cold)
        request.cold, request.state = [], "disk"
        self.counts.spilled_to_disk += 1

    def _unspill(self, request: Request) -> None:
        if not self._make_cold_room(request.pages, keep=request):
            raise RuntimeError(f"request {request.rid}: {request.pages} pages do not fit the cold tier")
        slots = self.cold.allocate(request.pages)
        staging = torch.empty((request.pages, self.cold.storage.shape[1]), dtype=torch.uint8)
        self.disk.load(request.disk, staging)
        self.cold.storage[slots] = staging
        request.disk, request.cold, request.state = [], slots, "cold"
        self.counts.read_from_disk += 1

    # ---- onboarding

    def _onboard(self, request: Request) -> None:
        """Decode the request's cold pages into free hot pages, then check what came back."""
        if request.state == "disk":
            self._unspill(request)
        # While room is made in the hot pool, the victims' offloads may need cold room: this
        # request's cold pages must not be the ones moved down or dropped to make it.
        request.state = "onboarding"
        self._make_hot_room(request.pages, keep=request)
        pages = self.hot.allocate(request.pages)
        original = self._original_pages(request)
        expected_cold = oracle_encode_pages(self.layout, original)
        self._check_cold_bytes(request, expected_cold)
        pairs = pairs_tensor(pages, request.cold)
        _, ms = time_once(lambda: self.codec.decode(self.cold.storage, pairs), clock_for(self.config.device))
        self.counts.onboard_ms += ms
        self.counts.onboards += 1
        self.counts.pages_onboarded += request.pages
        self.cold.release(request.cold)
        request.hot, request.cold, request.state = pages, [], "hot"
        restored = self.hot.read(request.hot)
        self._check_restored(restored, expected_cold)
        self.checks.pages_checked += request.pages
        self._attention_error(request, original, restored)

    def _original_pages(self, request: Request) -> list[list[torch.Tensor]]:
        paged = self.generator.paged(request.rid, request.tokens)
        return [[paged[name][layer] for name in self.geometry.buffers] for layer in range(self.geometry.layers)]

    def _check_cold_bytes(self, request: Request, expected: torch.Tensor) -> None:
        """The cold blobs (after pinned memory, and the disk if they went there) must be the
        oracle's encoding of the original pages (regenerated), byte for byte."""
        got = self.cold.storage[request.cold].to(expected.device)
        self.checks.cold_bytes_equal_oracle &= bool(torch.equal(got, expected))

    def _check_restored(self, restored: list[list[torch.Tensor]], expected_cold: torch.Tensor) -> None:
        """Restored pages must equal the oracle's decode(encode(original)), bit for bit."""
        expected = oracle_decode_pages(self.layout, expected_cold, self.geometry.dtype, self.geometry.page_shape)
        for want_layer, got_layer in zip(expected, restored):
            for want, got in zip(want_layer, got_layer):
                same = torch.equal(want.contiguous().view(torch.uint8), got.contiguous().view(torch.uint8))
                self.checks.restored_equal_oracle_decode &= bool(same)

    def _attention_error(self, request: Request, original: list[list[torch.Tensor]],
                         restored: list[list[torch.Tensor]]) -> None:
        g = self.geometry
        q = random_queries(g, self.config.sizes.queries_per_head, request.tokens, self.query_gen, self.config.device)
        for layer in range(g.layers):
            want = [from_pages(pages, g)[:, :request.tokens] for pages in original[layer]]
            got = [from_pages(pages, g)[:, :request.tokens] for pages in restored[layer]]
            for name, w, r in zip(g.buffers, want, got):
                self.buffer_errors[name].add(w, r)
            k_ref, v_ref = want[0], want[-1][..., :g.value_dim]
            k_got, v_got = got[0], got[-1][..., :g.value_dim]
            reference = attention(q[layer], k_ref, v_ref, g.softmax_scale)
            self.errors["both"].add(reference, attention(q[layer], k_got, v_got, g.softmax_scale))
            if len(g.buffers) > 1:   # K and V are separate buffers: which one costs what
                self.errors["k_only"].add(reference, attention(q[layer], k_got, v_ref, g.softmax_scale))
                self.errors["v_only"].add(reference, attention(q[layer], k_ref, v_got, g.softmax_scale))



@dataclass
class TransferResult:
    """Codec to/from the cold tier vs a raw copy of the same hot pages, same path, same run."""

    pages: int
    hot_bytes: int
    cold_bytes: int
    cold_memory: str
    timer: str
    reps: int
    encode_to_cold_ms: float
    decode_from_cold_ms: float
    raw_copy_to_host_ms: float
    raw_copy_from_host_ms: float
    offload_speedup_vs_raw: float      # raw copy time / encode time
    onboard_speedup_vs_raw: float      # raw copy time / decode time
    encode_cold_gbps: float
    decode_cold_gbps: float
    raw_to_host_gbps: float
    raw_from_host_gbps: float
    raw_baseline: str = "pre-gathered hot pages, one copy_ each way (gather not timed)"


def measure_transfers(config: DemoConfig, codec: Any, hot: HotPool, cold: ColdTier, layout: FamilyLayout,
                      gen: torch.Generator) -> TransferResult | None:
    """Encode ``n`` scattered hot pages into the cold tier and decode them back, against a raw copy
    of the same hot bytes over the same path (device -> pinned host and back). The raw copy moves
    pre-gathered pages with one ``copy_`` each way (the gather is not timed): the most favourable
    raw baseline. Runs after the scenario: it overwrites cold slots and hot pages."""
    lc = layout.lifecycles[0]
    n = min(hot.pages, cold.slots)
    if n == 0:
        return None
    sources = torch.randperm(hot.pages, generator=gen)[:n].tolist()
    slots = list(range(n))
    encode_pairs, decode_pairs = pairs_tensor(slots, sources), pairs_tensor(sources, slots)
    reps, warmup = config.sizes.transfer_reps, (2 if config.on_gpu else 0)
    device = config.device
    encode_ms = time_ms(lambda: codec.encode(cold.storage, encode_pairs), reps, warmup, clock_for(device))["median_ms"]
    decode_ms = time_ms(lambda: codec.decode(cold.storage, decode_pairs), reps, warmup, clock_for(device))["median_ms"]
    staging = gather_hot_bytes(hot, sources)
    raw = torch.empty_like(staging, device="cpu")
    raw = raw.pin_memory() if config.on_gpu else raw
    d2h_ms = time_ms(lambda: raw.copy_(staging, non_blocking=True), reps, warmup, clock_for(device))["median_ms"]
    h2d_ms = time_ms(lambda: staging.copy_(raw, non_blocking=True), reps, warmup, clock_for(device))["median_ms"]
    hot_bytes, cold_bytes = n * lc.hot_page_bytes, n * lc.cold_page_bytes
    return TransferResult(
        pages=n, hot_bytes=hot_bytes, cold_bytes=cold_bytes, cold_memory=cold.kind, timer=timer_label(device),
        reps=reps, encode_to_cold_ms=encode_ms, decode_from_cold_ms=decode_ms, raw_copy_to_host_ms=d2h_ms,
        raw_copy_from_host_ms=h2d_ms, offload_speedup_vs_raw=d2h_ms / encode_ms,
        onboard_speedup_vs_raw=h2d_ms / decode_ms, encode_cold_gbps=cold_bytes / encode_ms / 1e6,
        decode_cold_gbps=cold_bytes / decode_ms / 1e6, raw_to_host_gbps=hot_bytes / d2h_ms / 1e6,
        raw_from_host_gbps=hot_bytes / h2d_ms / 1e6)


def gather_hot_bytes(hot: HotPool, pages: Sequence[int]) -> torch.Tensor:
    """``uint8 [n, hot_page_bytes]`` on the device: every layer's pages of ``pages``, contiguous."""
    index = torch.tensor(list(pages), device=hot.pools[0][0].device)
    parts = [pool[index].reshape(len(pages), -1).view(torch.uint8) for layer in hot.pools for pool in layer]
    return torch.cat(parts, dim=1).contiguous()



def make_requests(config: DemoConfig, geometry: CacheGeometry, rng: torch.Generator) -> list[Request]:
    """Prompts of a random number of pages; the last page is partly filled (up to half empty)."""
    low, high = config.sizes.prompt_pages
    high = min(high, config.sizes.hot_pages)
    requests = []
    for rid in range(config.sizes.requests):
        pages = int(torch.randint(low, high + 1, (1,), generator=rng))
        empty = int(torch.randint(0, geometry.tokens_per_block // 2 + 1, (1,), generator=rng))
        requests.append(Request(rid, pages * geometry.tokens_per_block - empty, pages))
    return requests


@dataclass
class PageBytes:
    """Sizes of one page of every layer, and what the host budget holds raw or encoded."""

    hot_page_bytes: int
    cold_page_bytes: int
    codec_cold_page_bytes: int         # as the codec itself reports it (C ABI query on the GPU)
    cold_over_hot: float
    hot_over_cold: float               # how many times more pages the same host bytes hold
    host_budget_bytes: int
    cold_pages_in_budget: int
    raw_pages_in_budget: int


def page_bytes(layout: FamilyLayout, codec_cold_page_bytes: int, budget_bytes: int) -> PageBytes:
    lc = layout.lifecycles[0]
    return PageBytes(hot_page_bytes=lc.hot_page_bytes, cold_page_bytes=lc.cold_page_bytes,
                     codec_cold_page_bytes=codec_cold_page_bytes,
                     cold_over_hot=lc.cold_page_bytes / lc.hot_page_bytes,
                     hot_over_cold=lc.hot_page_bytes / lc.cold_page_bytes, host_budget_bytes=budget_bytes,
                     cold_pages_in_budget=budget_bytes // lc.cold_page_bytes,
                     raw_pages_in_budget=budget_bytes // lc.hot_page_bytes)


@dataclass
class CodecFamilyResult:
    family: str
    attention_kind: str
    layers: int
    kv_heads: int
    query_heads: int
    row_dim: int
    tokens_per_block: int
    dtype: str
    layout: str
    backend: str                       # "generated (registry)" | "oracle (cpu)"
    library: str | None
    arch: str | None
    bytes: PageBytes
    scenario: dict[str, Any]           # tiers and ScenarioCounts
    checks: CodecChecks
    attention: dict[str, Any]          # ErrorStats summaries: both, k_only, v_only; buffer_rel_l2
    transfer: TransferResult | None    # None when the host budget holds no cold page


def run_codec_family(config: DemoConfig, family: str) -> CodecFamilyResult:
    spec_path, spec = load_family(config, family)
    layout = family_layout(spec)
    if len(layout.lifecycles) != 1:
        raise DemoError(f"{family}: the demo moves lifecycle 0 only; this family has {len(layout.lifecycles)}")
    geometry = CacheGeometry.from_spec(spec, layout)
    lc = layout.lifecycles[0]
    hot = HotPool(geometry, config.sizes.hot_pages, config.device)
    budget = int(config.sizes.host_budget_mib * (1 << 20))
    cold = ColdTier(budget // lc.cold_page_bytes, lc.cold_page_bytes, pinned=config.on_gpu)
    disk = DiskTier(config.disk, family, lc.cold_page_bytes) if config.disk else None
    codec, where = open_codec(config, spec_path, family, layout, hot.pools)
    try:
        codec_bytes = codec.cold_page_bytes(0)
        if codec_bytes != lc.cold_page_bytes:
            raise DemoError(f"{family}: codec says {codec_bytes} bytes per cold page, the layout "
                            f"{lc.cold_page_bytes}")
        rng = torch.Generator().manual_seed(config.seed)
        scenario = OffloadScenario(config, geometry, layout, hot, cold, disk, codec,
                                   KVGenerator(geometry, config.seed, config.device))
        requests = make_requests(config, geometry, rng)
        scenario.run(requests, request_trace(len(requests), rng))
        transfers = measure_transfers(config, codec, hot, cold, layout, rng)
    finally:
        codec.close()
        if disk is not None:
            disk.close()
    counts = asdict(scenario.counts)
    peak = counts["peak_cold_pages"]
    counts.update(peak_cold_bytes=peak * lc.cold_page_bytes, raw_bytes_for_peak=peak * lc.hot_page_bytes,
                  timer=timer_label(config.device))
    errors = {name: stats.summary() for name, stats in scenario.errors.items() if stats.cosines}
    return CodecFamilyResult(
        family=family, attention_kind=spec.attention, layers=spec.layers, kv_heads=spec.kv_heads,
        query_heads=spec.query_heads, row_dim=spec.row_dim, tokens_per_block=spec.tokens_per_block,
        dtype=spec.dtype, layout=spec.layout, **where, bytes=page_bytes(layout, codec_bytes, budget),
        scenario={"requests": len(requests), "prompt_tokens": [r.tokens for r in requests],
                  "hot_pages": hot.pages, "cold_slots": cold.slots, "cold_memory": cold.kind,
                  "disk": str(disk.path) if disk else None,
                  "disk_bytes_written": disk.bytes_written if disk else 0,
                  "disk_bytes_read": disk.bytes_read if disk else 0,
                  "disk_seconds": disk.seconds if disk else 0.0, **counts},
        checks=scenario.checks,
        attention={"queries": f"gaussian, {config.sizes.queries_per_head} per query head, RoPE at the next "
                              f"position; {spec.query_heads} query heads over {spec.kv_heads} KV head(s)",
                   "k_only_v_only": "error with only K (only V) restored, the other original",
                   "softmax_scale": geometry.softmax_scale, **errors,
                   "buffer_rel_l2": {name: stats.summary()["rel_l2"]
                                     for name, stats in scenario.buffer_errors.items()}},
        transfer=transfers)
