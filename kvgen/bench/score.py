"""TriAttention scoring and whole eviction rounds on the GPU, against ceilings measured in the same run.

Score kernel (per variant: family, batch B, decode region W tokens after a 1024-token prompt, pages
scattered, every scored layer in one launch):
  effective bandwidth = (K bytes the kernel must read + score bytes written) / time, as a fraction
  of the device-to-device copy bandwidth measured here (``copy_ceiling``: bytes read + written per
  second; the kernel is a read stream, so this is the ceiling of a memory-bound kernel). K bytes =
  scored layers x B x Hkv x W x rotated span bytes x the fewest passes over K any configuration
  needs (``k_bytes_read``: 1 for every group <= 16). A variant that splits the group into more
  passes reads K again, mostly from L2: that is its cost, and is not counted as bytes moved.
  Variants: Qwen3-8B geometry (36 layers, 32/8 heads, head 128, bf16) at B = 32 and B = 1;
  head 64 (gpt-oss-20b, 64/8, 12 scored of 24 layers) and head 256 (gemma-2-9b, 16/8, 21 scored of
  42; qwen3.5-397b-a17b, 32/2, partial rotary 64 of 256) at B = 32; qwen3-8b-fp8 (fp8 E4M3 K, half
  the bytes) at B = 32, from whichever registry holds its score library (its shipped spec leaves
  TriAttention off: ``build/registry-score-fp8`` is built from an enabled copy), skipped if none.
Variants: the same kernels with other tunable parameters (``lanes``, ``token_tiles``, ``smem_stages``,
  ``tokens_per_thread``, ``prefetch``), from the registries ``build/registry-score-*``, timed on the
  same cache and checked against the first.
Peers: the oracle's ``score_paged`` (float32) on the GPU, eager and under ``torch.compile``, one
  layer of the Qwen3-8B B = 32 variant (an out-of-memory is recorded, not raised).
Round: one whole round (score -> z -> aggregate -> select (generated) -> pack -> compact) for Qwen3-8B, B = 32,
  every request due (budget 2048), stage by stage, against an estimate of one decode step's
  attention over the same cache: K + V bytes of every layer / copy bandwidth (an estimate of a
  perfect memory-bound attention kernel, not a measurement), before and after compaction.

Tuned vs default (``--default-registry DIR``): that registry's score library is one more variant
  (``role: "default"``; the first registry's is ``role: "tuned"``), timed on the same cache and
  checked against the first one's scores.

Usage: python -m kvgen.bench.score [--width 16384] [--batch 32] [--no-peers] [--no-round] [--default-registry DIR]
(``kvgen bench run`` runs it with the other benchmarks, against ceilings measured once.)
"""

from __future__ import annotations

import argparse
import math
import tempfile
from pathlib import Path

import torch

from kvgen import paths
from kvgen.artifacts.manifest import RegistryError
from kvgen.lower.plan import TUNABLES
from kvgen.lower.triattention import eviction_config, rope_scaling, tri_geometry
from kvgen.measure.environment import environment, write_result
from kvgen.measure.libraries import registry_artifact, registry_dispatch
from kvgen.measure.timing import measure_ceilings, require_cuda, time_ms
from kvgen.measure.workloads.round import round_artifacts
from kvgen.measure.workloads.score import PROMPT, ScoreCache, ScoreFamily
from kvgen.reference.triattention import save_calibration, score_paged
from kvgen.runtime.eviction import TriAttentionManager, generated_backends
from kvgen.runtime.lookup import RuntimeRegistry
from kvgen.runtime.score import ScoreDispatch
from kvgen.spec.schema import load_spec

VARIANTS = [("qwen3-8b", 32), ("qwen3-8b", 1), ("gpt-oss-20b", 32), ("gemma-2-9b", 32), ("qwen3.5-397b-a17b", 32),
            ("qwen3-8b-fp8", 32)]


def k_bytes_read(g, batch: int, width: int, elem: int) -> int:
    """K bytes a scorer must read for ``batch`` requests of ``width`` decode tokens: each scored
    layer's rotated span once per pass that the widest declared ``max_heads`` leaves (falcon-7b's
    71-head group: 5; every other shipped group: 1), whatever the measured variant's passes."""
    passes = math.ceil(g.query_heads // g.kv_heads / max(TUNABLES["score"]["max_heads"][0]))
    return len(g.scored_layers) * batch * g.kv_heads * width * g.rotary_dim * elem * passes


def score_family(family: str, specs: Path | None = None):  # noqa: ANN201 - (FamilySpec, ScoreFamily)
    """The spec of ``family`` and what the score workload needs of it."""
    spec = load_spec(paths.spec_path(family, specs))
    return spec, ScoreFamily(spec.name, tri_geometry(spec), spec.dtype, spec.rope.theta, rope_scaling(spec))


def score_library(family: str, registry: Path, arch: str) -> ScoreDispatch:
    """The family's score libraries in ``registry`` alone, dispatched by call size as the runtime does."""
    return ScoreDispatch.from_resolved(RuntimeRegistry([registry]).resolve(family, arch))


def _has_score(registry: Path, family: str, arch: str) -> bool:
    try:
        RuntimeRegistry([registry]).resolve(family, arch).artifact("score")
    except RegistryError:
        return False
    return True


def bench_score(family: str, batch: int, width: int, copy: dict, registries: list[Path], arch: str,
                default_registry: Path | None = None, specs: Path | None = None) -> dict:
    """Every score-library variant (one per registry: tunable params differ) on the same cache; the
    first is the reference the others' scores are compared with. ``role``: "tuned" for the first,
    "default" for ``default_registry`` (appended last when not among ``registries``), else "variant"."""
    registries = list(registries)
    if default_registry is not None and default_registry not in registries:
        registries.append(default_registry)
    if not any(_has_score(registry, family, arch) for registry in registries):
        print(f"score {family}: no score library in {[str(r) for r in registries]}; skipped")
        return {"family": family, "batch": batch, "width": width, "skipped": "no score library", "variants": []}
    cache = ScoreCache(score_family(family, specs)[1], batch, width)
    g = cache.geometry
    inputs = cache.kernel_inputs()
    elem = cache.k_pools[g.scored_layers[0]].element_size()
    score_bytes = inputs["scores"].numel() * 4
    result = {"family": family, "batch": batch, "width": width, "scored_layers": len(g.scored_layers),
              "head_dim": g.head_dim, "rotary_dim": g.rotary_dim, "query_heads": g.query_heads,
              "kv_heads": g.kv_heads, "score_bytes": score_bytes, "variants": []}
    reference = None
    for registry in registries:
        try:
            resolved = RuntimeRegistry([registry]).resolve(family, arch)
            resolved.artifact("score")   # a family without a score library is refused here
        except RegistryError as exc:
            if registry == default_registry:
                result["default_error"] = f"{registry}: no score library ({str(exc).splitlines()[0]})"
            continue
        if registry == default_registry:   # the comparison may fail; the measurements above stay
            try:
                lib = ScoreDispatch.from_resolved(resolved)
                t = time_ms(lambda: lib.score(**inputs), reps=10, warmup=2)
            except Exception as exc:  # noqa: BLE001
                result["default_error"] = f"{type(exc).__name__}: {exc}"
                continue
        else:
            lib = ScoreDispatch.from_resolved(resolved)
            t = time_ms(lambda: lib.score(**inputs), reps=10, warmup=2)
        index, op = lib.variant_index(batch, width), resolved.op("score")
        served = op if index is None else op.variants[index]   # the manifest entry of the library timed
        passes = int(lib.library_for(batch, width).geometry["passes"])
        k_bytes = k_bytes_read(g, batch, width, elem)
        gbps = (k_bytes + score_bytes) / t["median_ms"] / 1e6
        role = "tuned" if registry == registries[0] else "default" if registry == default_registry else "variant"
        variant = {"registry": str(registry), "role": role, "params": dict(served.params),
                   "served_by": "main" if index is None else served.bucket, "passes": passes,
                   "k_bytes": k_bytes, "gbps": gbps, "fraction_of_copy": gbps / copy["gbps_read_plus_write"],
                   **{k: v for k, v in t.items()}}
        if reference is None:
            reference = inputs["scores"].clone()
        else:
            scale = reference.abs().max().clamp(min=1e-30)
            variant["max_abs_diff_over_max_abs"] = float((inputs["scores"] - reference).abs().max() / scale)
        result["variants"].append(variant)
        print(f"score {family:22s} B={batch:3d} W={width} {variant['params']}: {t['median_ms']:.3f} ms, "
              f"{gbps:.0f} GB/s = {variant['fraction_of_copy']:.2f} of copy")
    return result   # the cache is freed on return; the caller empties the allocator


def bench_oracle(width: int, batch: int, specs: Path | None = None) -> dict:
    """The oracle's scoring of one layer (f32), eager and compiled."""
    layer = 0
    cache = ScoreCache(score_family("qwen3-8b", specs)[1], batch, width, only_layer=layer)
    g = cache.geometry
    calib = cache.calibration.to("cuda")
    args = (cache.k_pools[layer], cache.page_table, torch.tensor(cache.P, device="cuda"),
            torch.tensor(cache.S, device="cuda"), torch.zeros(batch, dtype=torch.int64, device="cuda"), calib,
            layer, g, torch.float32)
    out = {"family": "qwen3-8b", "batch": batch, "width": width, "layers_timed": 1,
           "note": "one layer; a full round scores 36"}
    for name, fn in (("eager", score_paged), ("compiled", torch.compile(score_paged))):
        try:
            t = time_ms(lambda: fn(*args), reps=3, warmup=1)
            out[name] = {k: v for k, v in t.items()}
            print(f"oracle {name}: {t['median_ms']:.1f} ms per layer")
        except torch.cuda.OutOfMemoryError as exc:
            out[name] = {"error": f"out of memory: {str(exc).splitlines()[0]}"}
        torch.cuda.empty_cache()
    return out


def bench_round(width: int, batch: int, copy: dict, registry: Path, arch: str,
                specs: Path | None = None) -> dict:
    family = "qwen3-8b"
    spec, scoring = score_family(family, specs)
    cache = ScoreCache(scoring, batch, width, all_layers=True, with_v=True)
    g = cache.geometry
    k_pools = [cache.k_pools[layer] for layer in range(g.num_layers)]
    v_pools = [cache.v_pools[layer] for layer in range(g.num_layers)]
    with tempfile.TemporaryDirectory() as tmp:
        calib_path = Path(tmp) / "calib.pt"
        save_calibration(cache.calibration, calib_path)
        backends, which = {}, "oracle pack_moves + compact_paged"
        try:
            packer, compactor = generated_backends(family, k_pools, v_pools,
                                                   registry_artifact(registry, family, arch, "pack"),
                                                   registry_dispatch(registry, family, arch, "compact"))
            backends, which = {"packer": packer, "compactor": compactor}, "generated Triton packer + CUDA compactor"
        except Exception as exc:  # noqa: BLE001 - fall back and say so in the record
            which = f"oracle (generated backends unusable: {exc})"
        select = round_artifacts(family, registry, arch, paths.generated_dir()).select
        manager = TriAttentionManager(eviction_config(spec), calib_path, k_pools, v_pools,
                                      score_library(family, registry, arch), select_module=select,
                                      budget=2048, beta=128, eviction_mode="union", max_position=PROMPT + width + 1,
                                      **backends)
    P, S, L, tail = cache.P, cache.S, cache.S, [0] * batch
    stages = {}
    scores = manager.score(cache.page_table, P, S, L)
    stages["score"] = time_ms(lambda: manager.score(cache.page_table, P, S, L), reps=5, warmup=1)
    kept = manager.decide(scores, P, S)
    stages["normalize_aggregate_select"] = time_ms(lambda: manager.decide(scores, P, S), reps=5, warmup=1)
    device_args = [torch.tensor(v, dtype=torch.int64, device="cuda") for v in (P, S, tail)]
    active = torch.ones(batch, dtype=torch.bool, device="cuda")
    moves = manager.packer(kept, *device_args, active, manager.budget, manager.mode, batch)
    stages["pack"] = time_ms(lambda: manager.packer(kept, *device_args, active, manager.budget, manager.mode, batch),
                             reps=5, warmup=1)
    stages["compact"] = time_ms(lambda: manager.compactor(cache.page_table, *moves), reps=5, warmup=1)
    total = time_ms(lambda: manager.run_round(cache.page_table, P, S, L, tail), reps=5, warmup=1)
    elem = k_pools[0].element_size()
    kv_bytes = lambda tokens: 2 * g.num_layers * batch * tokens * g.kv_heads * g.head_dim * elem  # noqa: E731
    before = kv_bytes(PROMPT + width) / copy["gbps_read_plus_write"] / 1e6
    after = kv_bytes(PROMPT + manager.budget) / copy["gbps_read_plus_write"] / 1e6
    result = {"family": family, "batch": batch, "width": width, "budget": manager.budget, "pack_compact": which,
              "stages": {k: {kk: vv for kk, vv in v.items() if kk != "samples_ms"} for k, v in stages.items()},
              "round": {k: v for k, v in total.items()},
              "decode_attention_estimate_ms": {"before_round": before, "after_round": after,
                                               "estimate": "K+V bytes of every layer / copy bandwidth"},
              "round_over_decode_step": total["median_ms"] / before,
              # a round runs once every beta generated tokens: its share of that many decode steps
              "round_over_beta_decode_steps": total["median_ms"] / (manager.beta * before)}
    print(f"round: {total['median_ms']:.2f} ms; one decode step's attention ~{before:.2f} ms before, "
          f"~{after:.2f} ms after ({which})")
    return result


def run(ceilings: dict, width: int = 16384, batch: int = 32, registry: Path | None = None,
        score_variants: list[Path] = (), arch: str = "sm_90a", peers: bool = True, round_: bool = True,
        default_registry: Path | None = None, specs: Path | None = None) -> dict:
    """Every variant, the oracle peers and one round against ``ceilings["device_copy"]``:
    ``{"score": [...], "oracle": {...}, "round": {...}}``. Defaults: ``kvgen.paths``."""
    copy = ceilings["device_copy"]
    registry = paths.registry_dir(registry)
    record: dict = {"score": []}
    for family, variant_batch in VARIANTS:
        variant_batch = batch if variant_batch != 1 else 1
        registries = [registry, *score_variants]
        record["score"].append(bench_score(family, variant_batch, width, copy, registries, arch, default_registry,
                                           specs))
        torch.cuda.empty_cache()
    if peers:
        record["oracle"] = bench_oracle(width, batch, specs)
        torch.cuda.empty_cache()
    if round_:
        record["round"] = bench_round(width, batch, copy, registry, arch, specs)
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=16384)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--registry", type=Path, default=paths.registry_dir())
    parser.add_argument("--score-variants", type=Path, nargs="*", default=paths.score_variant_registries(),
                        help="more registries holding score-library variants")
    parser.add_argument("--default-registry", type=Path, default=None,
                        help="also time this registry's score libraries (built with the default parameters)")
    parser.add_argument("--arch", default="sm_90a")
    parser.add_argument("--no-peers", action="store_true")
    parser.add_argument("--no-round", action="store_true")
    parser.add_argument("--tag", default="", help="suffix of the result file (bench_score-TAG.json)")
    args = parser.parse_args(argv)
    require_cuda()
    ceilings = measure_ceilings(pinned=False)
    print(f"copy ceiling: {ceilings['device_copy']['gbps_read_plus_write']:.0f} GB/s (read + write)")
    record = {"environment": environment(), "ceilings": ceilings,
              **run(ceilings, args.width, args.batch, args.registry, args.score_variants, args.arch,
                    not args.no_peers, not args.no_round, args.default_registry)}
    print(f"wrote {write_result('bench_score', record, args.tag)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
