"""Offload and onboard beside a foreground stream: the method is ``kvgen.measure.workloads.interference``
(``PERFORMANCE.md``, "Offload beside the model's own work").

Per family (default qwen3-8b and qwen3-8b-fp8, ~1.2 GiB of hot pages), per strategy (staged,
zero-copy as the peer row, device-then-copy) and direction: the transfer alone (median ms, cold
bytes / time / pinned ceiling of that way) and beside each foreground (memory-bound copy,
compute-bound GEMM): the transfer's wall time, its fraction of pinned, the foreground's slowdown.
Goal for staged: >= 0.90 of pinned with a foreground slowdown <= 1.05x, both ways (``GOALS``).
Per direction, ``sm_bound``: the codec kernels' time on the whole GPU, their share of a transfer at
the goal rate, and the least slowdown of a foreground that keeps every SM busy (the GEMM's bound).

Usage: ``kvgen bench run --only interference`` (ceilings measured once in the same process).
"""

from __future__ import annotations

from pathlib import Path

import torch

from kvgen import paths
from kvgen.lower.layout import family_layout
from kvgen.measure.libraries import registry_artifact
from kvgen.measure.workloads.interference import InterferenceWorkload, beside, foregrounds, sm_bound, time_alone
from kvgen.runtime import FamilyLibrary
from kvgen.spec.schema import load_spec

DEFAULT_FAMILIES = ("qwen3-8b", "qwen3-8b-fp8")
GOALS = {"fraction_of_pinned": 0.90, "slowdown": 1.05}
REPS = 10


def bench_family(family: str, hot_gib: float, ceilings: dict, fg: dict, fg_ms: dict, registry: Path, arch: str,
                 specs: Path | None = None) -> dict:
    spec = load_spec(paths.spec_path(family, specs))
    workload = InterferenceWorkload(family_layout(spec), spec.dtype)
    library = FamilyLibrary(registry_artifact(registry, family, arch, "codec"), family)
    s = workload.setup(library, int(hot_gib * (1 << 30)))
    lc = workload.lc
    cold_bytes = s["pages"] * lc.cold_page_bytes
    pinned = {"offload": ceilings["pinned"]["d2h"]["gbps"], "onboard": ceilings["pinned"]["h2d"]["gbps"]}
    result = {"family": family, "pages": s["pages"], "hot_bytes": s["pages"] * lc.hot_page_bytes,
              "cold_bytes": cold_bytes, "codec": s["codec"].describe_offload(),
              "staged_equals_zero_copy": workload.staged_equals_zero_copy(s), "runs": [], "sm_bound": {}}

    def fraction(ms: float, direction: str) -> float:
        return cold_bytes / ms / 1e6 / pinned[direction]

    current = torch.cuda.current_stream()
    for direction, kernels in workload.codec_kernels(s).items():
        kernels_ms = time_alone(lambda: kernels(current), REPS)["median_ms"]
        bound = sm_bound(kernels_ms, cold_bytes, pinned[direction], GOALS["fraction_of_pinned"])
        result["sm_bound"][direction] = bound
        print(f"  {family} {direction}: codec kernels {kernels_ms:.3f} ms = {bound['sm_share']:.3f} of the GPU at "
              f"{GOALS['fraction_of_pinned']:.2f} of pinned; a busy foreground slows >= "
              f"{bound['busy_foreground_floor']:.3f}x", flush=True)
    for (strategy, direction), transfer in workload.transfers(s).items():
        alone = time_alone(lambda: transfer(current), REPS)
        run = {"strategy": strategy, "direction": direction, "alone_ms": alone["median_ms"],
               "alone_p20_ms": alone["p20_ms"], "alone_p80_ms": alone["p80_ms"],
               "fraction_of_pinned": fraction(alone["median_ms"], direction), "beside": {}}
        for name, foreground in fg.items():
            b = beside(transfer, foreground, fg_ms[name], alone["median_ms"])
            run["beside"][name] = {**b, "fraction_of_pinned": fraction(b["wall_ms"], direction)}
        print(f"  {family} {strategy} {direction}: {run['alone_ms']:.2f} ms, {run['fraction_of_pinned']:.2f} of "
              f"pinned; beside " + ", ".join(f"{n} {v['wall_ms']:.2f} ms / fg {v['slowdown']:.2f}x"
                                             for n, v in run["beside"].items()), flush=True)
        result["runs"].append(run)
    s["codec"].close()
    return result


def run(ceilings: dict, families: list[str] | tuple[str, ...] = DEFAULT_FAMILIES, hot_gib: float = 1.2,
        registry: Path | None = None, arch: str = "sm_90a", specs: Path | None = None) -> dict:
    """Every family against ``ceilings`` (``measure_ceilings()``, with pinned), the foregrounds
    timed alone once first: ``{"foreground": {...}, "goals": GOALS, "results": [...]}``."""
    fg = foregrounds()
    fg_alone = {name: time_alone(fn, REPS) for name, fn in fg.items()}
    fg_ms = {name: t["median_ms"] for name, t in fg_alone.items()}
    print("  foreground alone: " + ", ".join(f"{n} {ms:.3f} ms" for n, ms in fg_ms.items()), flush=True)
    results = [bench_family(f, hot_gib, ceilings, fg, fg_ms, paths.registry_dir(registry), arch, specs)
               for f in families]
    return {"foreground": {name: {**t, "what": what} for (name, t), what in
                           zip(fg_alone.items(), ("1 GiB copy_", "bf16 8192^3 matmul"))},
            "goals": GOALS, "results": results}
