"""The static cost model: the time of a launch from what the compiler made of it and what the target
can do, no GPU.

A launch (``Launch``) is a grid of CTAs that each run a sequence of phases; a phase moves bytes
through global memory with a loop whose instruction mix per iteration is read from the SASS
(``features.Mix``: bytes per thread per iteration, instructions per pipe). Its time on a target is
built from three terms, each a plain bound:

- **memory**: the bytes over the bandwidth of where they live (HBM or the host link), divided by
  the share of each 32-byte sector the access pattern uses;
- **issue**, per pipe: the warp instructions of every iteration over the SMs that hold CTAs, at the
  pipe's rate (``targets.Target.issue``), and the same over the schedulers' total rate; model 3
  adds the **L1 data pipe** (``issue:l1``): the wavefronts of every warp iteration (shared-memory
  and global accesses share it, ``l1_wavefronts_per_clk``), by default the bytes of the shared
  loads (model 2's shared pipe) and the global accesses at 128 B a wavefront, or the workload's
  own count where the access pattern
  sets it (the scorer: one wavefront per K row a warp load touches, one per distinct coefficient
  address of a broadcast shared load, ``workload.score_wavefronts``);
- **latency**, for phases whose loads are waited on: in a loop, each warp's iteration is a round
  trip (the load latency, then its instructions a dependency step apart) and the SM's resident warps
  take turns (Hong & Kim's memory-warp parallelism), plus one latency per wave of CTAs (the loop's
  fill); a loopless copy is Little's law (bytes / (bytes in flight x latency)), at least one latency
  per round trip a CTA makes, wave after wave. Residency comes from the registers, shared memory,
  warps and CTA limits of the target.
- **walk** (model 2), for a loop whose every step waits a chain of dependent loads before its
  addresses are known (compaction: move index -> page-table entry -> row address -> K/V load ->
  store): per step the chain's latencies plus the step's own dependent issue plus the time the
  CTA's warps take to move the tile with the bytes each keeps in flight (Little's law per warp),
  or the wave's bytes of one step over HBM bandwidth where that is longer (the two combined as a
  2-norm: they overlap only partly); steps x waves (the ``tail`` below makes a partial last wave
  cost a whole one). Model 6: a load issued n steps before the step that uses it (a pipeline's
  prefetch) hides at most n steps of its latency, so a step lasts at least its latency / n, however
  short the step's own chain is.

A phase takes the larger of its memory time and its issue + latency time; the phases of a launch
add up (each CTA runs them in order), shrinking towards each resource's total as more CTAs share
an SM (they overlap one another's phases). Launches of one call add up, plus the target's launch
gap each. ``VERSION`` changes whenever a formula does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal, Sequence

from kvgen.tuning.costmodel.features import KernelFeatures, Mix
from kvgen.tuning.costmodel.targets import Target

VERSION = "6"   # 2: the walk term (dependent chain, per-warp bytes in flight), noise-aware validation
#                 3: the L1 data-pipe wavefront term; the scorer's K bytes are the rotated span it reads
#                 4: decode's record load by route (decode_load: one round trip for cp.async and bulk)
#                 5: compaction's walk loop holds load_ahead + 1 tiles (its ring, unrolled), and with
#                    index_ahead a step's chain is the page-table load alone
#                 6: a walk's prefetched loads (issued n steps ahead) bound a step from below at
#                    latency / n; compaction's tile is the kernel's tile_moves, not read off the SASS


@dataclass(frozen=True)
class Walk:
    """A CTA's loop over tiles where every step first waits a chain of dependent loads."""

    steps: int                      # tiles one CTA walks
    step_bytes: float               # bytes one CTA reads and writes per step
    chain: tuple[str, ...]          # where each dependent load of a step is served, in order: "hbm" or "l2"
    prologue: int = 0               # dependent HBM round trips before the first step
    ahead: tuple[tuple[str, int], ...] = ()   # loads issued steps before their use: (where, steps ahead)


@dataclass(frozen=True)
class Phase:
    """One stretch of a CTA's work: ``bytes`` through global memory (all CTAs together)."""

    name: str
    bytes: float
    where: Literal["hbm", "host"]
    loop: Mix | None                   # one iteration per thread (None: a straight copy, no loop)
    inflight_per_thread: float         # bytes one thread has outstanding when it waits (0: never waits)
    rounds: int = 0                    # loopless copies: round trips one CTA waits for, one after another
    sector_efficiency: float = 1.0     # useful share of the 32-byte DRAM sectors a warp's accesses touch
    walk: Walk | None = None           # a dependent-chain loop: its latency term is ``walk_time``
    l1_wavefronts: float | None = None  # L1 data-pipe wavefronts of one warp iteration (None: ``l1_wavefronts``)


@dataclass(frozen=True)
class Launch:
    name: str
    kernel: KernelFeatures
    ctas: int
    threads: int
    dynamic_shared: int
    phases: tuple[Phase, ...]


@dataclass
class Estimate:
    seconds: float
    terms: dict[str, dict[str, float]] = field(default_factory=dict)   # launch/phase -> term -> seconds
    residency: dict[str, int] = field(default_factory=dict)           # launch -> resident CTAs per SM

    @property
    def ms(self) -> float:
        return self.seconds * 1e3


def resident_ctas(kernel: KernelFeatures, threads: int, dynamic_shared: int, t: Target) -> int:
    """CTAs one SM holds at once: the tightest of the warp, CTA, register and shared-memory limits."""
    warps = math.ceil(threads / 32)
    regs_per_warp = math.ceil(max(kernel.registers, 1) / t.register_granule) * t.register_granule * 32
    by_regs = t.registers_per_sm // (regs_per_warp * warps)
    # cuobjdump's SHARED already holds the 1 KiB the driver reserves per CTA (sm_80 and later)
    by_shared = t.shared_per_sm // max(1, kernel.shared_bytes + dynamic_shared)
    return max(0, min(t.ctas_per_sm, t.warps_per_sm // warps, by_regs, by_shared))


def walk_time(walk: Walk, step: Mix, launch: Launch, resident: int, t: Target) -> float:
    """Seconds of a dependent-chain walk, all CTAs together (model 2).

    One step of one CTA: the chain (each dependent load's latency: HBM, Luo et al.'s ~650 ns on
    Hopper, or an L2 hit), then the step's instructions one dependency apart, then the tile's bytes
    at the rate the CTA's warps sustain (Little's law: each warp keeps ``warp_inflight_bytes`` in
    flight across one HBM latency). The SMs' HBM share bounds the same step from the other side: a
    full wave's CTAs move ``step_bytes`` each. Chain-bound and bandwidth-bound only partly overlap
    (the next tile's loads are issued after the barrier that ends the chain), so the step takes the
    2-norm of the two. Whole waves run one after another (``estimate``'s tail charges a partial
    last wave as a whole one), so the walk is ``steps`` steps per wave, CTAs / (SMs x resident)
    waves, plus the prologue's round trips per wave.

    Model 6: a load issued n steps before the step that waits for it (``Walk.ahead``: a tile's rows
    loaded load_ahead steps before they are stored, move indices fetched a step before their
    resolve) has only n steps to arrive, so the step waits at least its latency / n, however short
    the step's own chain."""
    latency = {"hbm": t.dram_latency_ns, "l2": t.l2_latency_ns}
    dram = t.dram_latency_ns * 1e-9
    chain = sum(latency[where] for where in walk.chain) * 1e-9 + step.total * t.dependent_issue_cycles / (
        t.clock_ghz * 1e9)
    chain = max([chain] + [latency[where] * 1e-9 / steps for where, steps in walk.ahead])
    warps = math.ceil(launch.threads / 32)
    moved = walk.step_bytes * dram / (warps * t.warp_inflight_bytes)       # Little's law, per CTA
    wave_ctas = min(launch.ctas, t.sms * resident)
    streamed = wave_ctas * walk.step_bytes / (t.hbm_gbs * t.hbm_efficiency * 1e9)
    step_time = math.hypot(chain + moved, streamed)
    waves = max(1.0, launch.ctas / (t.sms * resident))   # a single partial wave still walks every step
    return waves * (walk.steps * step_time + walk.prologue * dram)


def l1_wavefronts(loop: Mix, t: Target) -> float:
    """L1 data-pipe wavefronts of one warp iteration when every access is conflict-free and coalesced:
    the bytes of its shared-memory loads (model 2's shared pipe) and of its global loads and stores
    (they pass the same L1TEX data pipe), 32 threads' worth, 128 B (``shared_bytes_per_clk``) a
    wavefront. A workload whose accesses the SASS alone cannot size (broadcast shared loads, a warp
    load spread over many rows) gives ``Phase.l1_wavefronts``."""
    return 32 * (loop.shared_load_bytes + loop.global_bytes) / t.shared_bytes_per_clk


def phase_terms(phase: Phase, launch: Launch, resident: int, t: Target) -> dict[str, float]:
    """The phase's memory, issue (per pipe, and their maximum) and latency times, all CTAs together."""
    busy_sms = min(t.sms, launch.ctas)
    concurrent = min(launch.ctas, t.sms * resident)
    waves = math.ceil(launch.ctas / (t.sms * resident))
    warps_per_sm = math.ceil(concurrent / busy_sms) * math.ceil(launch.threads / 32)
    bandwidth = (t.hbm_gbs * t.hbm_efficiency if phase.where == "hbm" else t.host_link_gbs) * 1e9
    latency = (t.dram_latency_ns if phase.where == "hbm" else t.host_latency_ns) * 1e-9
    clock = t.clock_ghz * 1e9
    terms = {"memory": phase.bytes / phase.sector_efficiency / bandwidth}
    if phase.loop is not None and phase.loop.global_bytes:
        warp_iterations = phase.bytes / phase.loop.global_bytes / 32
        issue = {f"issue:{pipe}": warp_iterations * n / (busy_sms * t.issue[pipe] * clock)
                 for pipe, n in phase.loop.per_pipe.items() if n}
        issue["issue:total"] = warp_iterations * phase.loop.total / (busy_sms * t.issue["total"] * clock)
        # model 3: the L1 data pipe (shared-memory and global accesses share it), one wavefront per clock
        wavefronts = phase.l1_wavefronts if phase.l1_wavefronts is not None else l1_wavefronts(phase.loop, t)
        issue["issue:l1"] = warp_iterations * wavefronts / (busy_sms * t.l1_wavefronts_per_clk * clock)
        terms.update(issue)
        terms["issue"] = max(issue.values())
        if phase.walk is not None:
            terms["latency"] = walk_time(phase.walk, phase.loop, launch, resident, t)
        elif phase.inflight_per_thread:
            # a warp's iteration: wait for its loads, then issue its instructions one dependency
            # step apart; the SM's resident warps take turns (Hong & Kim's memory/compute warps);
            # each wave of CTAs also waits once for its first loads (the loop's pipeline fill)
            round_trip = latency + phase.loop.total * t.dependent_issue_cycles / clock
            terms["latency"] = warp_iterations * round_trip / (busy_sms * warps_per_sm) + waves * latency
    elif phase.inflight_per_thread:
        # a copy without a loop: Little's law over the bytes the resident threads have in flight,
        # and at least one latency per round trip a CTA makes, wave after wave
        little = phase.bytes * latency / (concurrent * launch.threads * phase.inflight_per_thread)
        terms["latency"] = max(little, waves * phase.rounds * latency)
    return terms


def _compute(phase: dict[str, float]) -> float:
    """Issue and waiting add (the pessimistic reading: an SM issuing at its limit hides no latency);
    the memory system works meanwhile. Measured against the max() of the two on the H200 data
    (docs/tuning.md, "Static cost model"), the sum ranks better for every op."""
    return phase.get("issue", 0.0) + phase.get("latency", 0.0)


def launch_time(phases: Sequence[dict[str, float]], resident: int) -> float:
    """A CTA runs its phases in order (each bound by memory or by its issue + waiting); ``resident``
    CTAs per SM overlap one another's phases, so the serial sum shrinks towards the all-overlapped
    bound (memory's total or compute's total) as 1 / resident."""
    serial = sum(max(p["memory"], _compute(p)) for p in phases)
    overlapped = max(sum(p["memory"] for p in phases), sum(_compute(p) for p in phases))
    return overlapped + (serial - overlapped) / resident


def estimate(launches: Sequence[Launch], t: Target) -> Estimate:
    out = Estimate(0.0)
    for launch in launches:
        resident = resident_ctas(launch.kernel, launch.threads, launch.dynamic_shared, t)
        out.residency[launch.name] = resident
        if resident == 0:
            out.seconds = math.inf   # does not fit on an SM: it would fail to launch
            continue
        phases = [phase_terms(phase, launch, resident, t) for phase in launch.phases]
        for phase, terms in zip(launch.phases, phases):
            out.terms[f"{launch.name}/{phase.name}"] = terms
        # a partial last wave leaves SMs idle for the tail's share of the per-CTA work
        waves = launch.ctas / (t.sms * resident)
        tail = math.ceil(waves) / waves if waves > 1 else 1.0
        out.seconds += t.launch_us * 1e-6 + tail * launch_time(phases, resident)
    return out
