"""Proof on the GPU of issue 18: kvgen's transformers caches inside greedy ``model.generate()`` of
random-initialised Qwen3-style models shaped like registry families, beside ``DynamicCache``.

    PYTHONPATH=$PWD python scripts/hf_proof.py --registry build/registry --out $OUT

Writes ``$OUT/hf_proof.json`` (and prints it). Every section runs even if another failed (its
error is recorded), so one command gives everything:

- ``offload/<family>``: tokens/s of generate() with ``KvgenOffloadedCache`` and with
  ``DynamicCache`` (both warmed up, then ``RUNS`` runs each, alternating, medians); same tokens and
  logits bit for bit; one offload + onboard of every page through the codec (staged), cold and
  restored pages byte-exact vs the oracle, the lossless RoPE span bit-exact
  (qwen3.5-397b-a17b-lossless-rope); then a continued generate() whose logits must equal those of a
  ``DynamicCache`` holding the oracle's decoded history (relative error bound 0, see
  docs/transformers.md), and their relative error against the uncompressed history (reported).
  Every bit-for-bit comparison runs with SDPA's math backend
  (``tests.hf_models.deterministic_attention``): on the H200 the default attention kernels are not
  bit-reproducible run to run at batch 4 (``DynamicCache`` against itself differs), which the
  section records as the floor (``default_backends``).
- ``shared-pool/qwen3-8b``: two conversations on one ``PagePool`` that holds one: the paused one
  waits in cold pages on the host and continues with logits equal to the oracle's decoded history.
- ``triattention/qwen3-8b``: ``kvgen calibrate`` of the random-init model first (4096 random token
  ids in two passes; its time and both written files, ``$OUT/calibration/qwen3-8b{,.upstream}.pt``),
  the flat file then serving the cache; tokens/s against ``DynamicCache``, rounds, time per round,
  K/V bytes saved, kept-set agreement with the oracle's ``eviction_round`` per round.

The offload sections need no spec (families come from the registry manifest); the TriAttention
section reads ``specs/<family>.yaml`` for ``kvgen calibrate`` (pydantic and PyYAML).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from transformers import DynamicCache  # noqa: E402

from kvgen.integrations.transformers import KvgenOffloadedCache, KvgenTriAttentionCache, PagePool  # noqa: E402
from kvgen.runtime.eviction import registry_config  # noqa: E402
from kvgen.runtime.lookup import RuntimeRegistry  # noqa: E402
from tests.hf_models import (  # noqa: E402
    RoundOracle,
    calibrate_random_tokens,
    deterministic_attention,
    offload_round_trip,
    oracle_history,
    tiny_model,
)

SIZES = {"hidden": 1024, "intermediate": 2048, "vocab": 8192}
RUNS = 5       # timed generate() runs per cache (offload sections)
TRI_RUNS = 2   # the TriAttention section's (batch 1: each run is ~15 s of Python-bound decoding)

CALIBRATION_TOKENS, CALIBRATION_CHUNK = 4096, 2048


def generate(model, ids, cache, new: int):  # noqa: ANN001, ANN201
    return model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, past_key_values=cache,
                          output_logits=True, return_dict_in_generate=True)


def timed(fn):  # noqa: ANN001, ANN201
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return out, time.perf_counter() - start


def rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def _max_rel_error(x, y) -> float:  # noqa: ANN001 - two generate() outputs
    return max(rel_error(a, b) for a, b in zip(x.logits, y.logits))


def _same_logits(x, y) -> bool:  # noqa: ANN001 - two generate() outputs
    return all(torch.equal(a, b) for a, b in zip(x.logits, y.logits))


def offload_section(registry: RuntimeRegistry, arch: str, family: str, batch: int, prompt: int, new: int) -> dict:
    config = registry_config(registry.resolve(family, arch))
    model = tiny_model(config, "cuda", **SIZES)
    gen = torch.Generator("cuda").manual_seed(0)
    ids = torch.randint(0, SIZES["vocab"], (batch, prompt), device="cuda", generator=gen)

    def kvgen_cache() -> KvgenOffloadedCache:
        return KvgenOffloadedCache(model.config, family, registry=registry, arch=arch,
                                   max_cache_len=prompt + new + 128)   # the continued turn: 64 + 16 more

    generate(model, ids, kvgen_cache(), new), generate(model, ids, DynamicCache(), new)   # warm up both
    runs = {"dynamic": [], "kvgen": []}
    for _ in range(RUNS):   # alternating, so drift (clocks, allocator) lands on both
        runs["dynamic"].append(timed(lambda: generate(model, ids, DynamicCache(), new))[1])
        runs["kvgen"].append(timed(lambda: generate(model, ids, kvgen_cache(), new))[1])
    floor = [generate(model, ids, DynamicCache(), new) for _ in range(2)]
    with deterministic_attention():
        ref = generate(model, ids, DynamicCache(), new)
        cache = kvgen_cache()
        mine = generate(model, ids, cache, new)
    tokens = batch * new
    out = {"model": {"layers": config.geometry.num_layers, "query_heads": config.geometry.query_heads,
                     "kv_heads": config.geometry.kv_heads, "head_dim": config.geometry.head_dim,
                     "rotary_dim": config.geometry.rotary_dim, **SIZES, "class": type(model).__name__,
                     "parameters": sum(p.numel() for p in model.parameters())},
           "batch": batch, "prompt": prompt, "new_tokens": new, "timed_runs": RUNS,
           "tokens_per_s": {k: tokens / statistics.median(v) for k, v in runs.items()},
           "seconds": runs,
           "default_backends": {"dynamic_vs_dynamic_logits_bit_identical": _same_logits(*floor),
                                "dynamic_vs_dynamic_logits_rel_error": _max_rel_error(*floor),
                                "dynamic_vs_dynamic_same_tokens": bool(torch.equal(floor[0].sequences,
                                                                                   floor[1].sequences))},
           "same_tokens_as_dynamic": bool(torch.equal(mine.sequences, ref.sequences)),
           "logits_bit_identical_to_dynamic": _same_logits(mine, ref),
           "cache": cache.describe()}
    out["overhead"] = out["tokens_per_s"]["dynamic"] / out["tokens_per_s"]["kvgen"] - 1
    out["round_trip"] = offload_round_trip(cache)
    trip = out["round_trip"]
    trip["offload_GBps"] = trip["hot_bytes"] / trip["offload_s"] / 1e9
    trip["onboard_GBps"] = trip["hot_bytes"] / trip["onboard_s"] / 1e9

    # Continue the conversation: history restored from cold pages vs the oracle's and the raw history.
    history = cache.length   # the tokens that went through the codec
    cache.offload()
    oracle_cache = oracle_history(cache)
    turn = torch.cat([mine.sequences, torch.randint(0, SIZES["vocab"], (batch, 64), device="cuda", generator=gen)], 1)
    with deterministic_attention():
        again = generate(model, turn, cache, 16)
        oracle = generate(model, turn, oracle_cache, 16)
        raw_cache = DynamicCache()
        generate(model, ids, raw_cache, new)
        raw = generate(model, turn, raw_cache, 16)
    out["continued"] = {
        "onboarded_before_use": cache.offloaded is None,
        "logits_rel_error_vs_oracle_history": _max_rel_error(again, oracle),
        "logits_bit_identical_to_oracle_history": _same_logits(again, oracle),
        "bound_vs_oracle_history": 0.0,
        "same_tokens_as_oracle_history": bool(torch.equal(again.sequences, oracle.sequences)),
        "first_step_logits_rel_error_vs_raw_history": rel_error(again.logits[0], raw.logits[0]),
        "first_step_argmax_agreement_vs_raw_history": float((again.logits[0].argmax(-1)
                                                             == raw.logits[0].argmax(-1)).float().mean()),
        "restored_kv_rel_error": _history_error(cache, raw_cache, config.geometry.num_layers, history),
    }
    out["continued"]["within_bound"] = (out["continued"]["logits_rel_error_vs_oracle_history"]
                                        <= out["continued"]["bound_vs_oracle_history"])
    return out


def shared_pool_section(registry: RuntimeRegistry, arch: str, family: str, batch: int, prompt: int, new: int) -> dict:
    """Two conversations on one pool that holds one of them: the paused one waits on the host
    (cold pages), then continues exactly as with the oracle's decoded history."""
    config = registry_config(registry.resolve(family, arch))
    model = tiny_model(config, "cuda", **SIZES)
    gen = torch.Generator("cuda").manual_seed(3)
    ids = [torch.randint(0, SIZES["vocab"], (batch, prompt), device="cuda", generator=gen) for _ in range(2)]
    tokens = prompt + new + 128   # the continued turn: 64 + 16 more
    pool = PagePool.for_family(family, batch * -(-tokens // config.geometry.tokens_per_block), registry=registry, device="cuda",
                               arch=arch, host_pages=2 * batch * -(-tokens // config.geometry.tokens_per_block))
    a, b = (KvgenOffloadedCache(model.config, family, registry=registry, arch=arch, max_cache_len=tokens, pool=pool)
            for _ in range(2))
    first = generate(model, ids[0], a, new)
    (_, offload_a_s) = timed(a.offload)
    generate(model, ids[1], b, new)                 # takes the pages a gave back
    (_, offload_b_s) = timed(b.offload)
    history = oracle_history(a)
    turn = torch.cat([first.sequences, ids[1][:, :64]], dim=1)
    with deterministic_attention():
        again = generate(model, turn, a, 16)       # onboards a into free pages first
        oracle = generate(model, turn, history, 16)
    per_conversation = a.cached_bytes()
    return {"pool_bytes": pool.nbytes(), "conversation_bytes_now": per_conversation,
            "offload_s": [offload_a_s, offload_b_s],
            "cold_bytes_per_conversation": a.layout.cold_page_bytes() * batch * -(-(prompt + new) //
                                                                                 config.geometry.tokens_per_block),
            "logits_rel_error_vs_oracle_history": _max_rel_error(again, oracle),
            "logits_bit_identical_to_oracle_history": _same_logits(again, oracle),
            "same_tokens_as_oracle_history": bool(torch.equal(again.sequences, oracle.sequences)),
            "pool_free_pages_after": len(pool.free), "host_slots_in_use_after": pool.host_pages - len(pool.free_slots)}


def _history_error(cache, raw_cache, layers: int, n: int) -> dict:  # noqa: ANN001
    """Relative error of the first ``n`` restored K and V rows (the codec's quantization) against the
    raw history."""
    errors = {"k": [], "v": []}
    for layer in range(layers):
        k, v = cache.store.read(layer, n)
        errors["k"].append(rel_error(k, raw_cache.layers[layer].keys[:, :, :n]))
        errors["v"].append(rel_error(v, raw_cache.layers[layer].values[:, :, :n]))
    return {name: max(values) for name, values in errors.items()}


def triattention_section(registry: RuntimeRegistry, arch: str, family: str, prompt: int, new: int, budget: int,
                         beta: int, workdir: Path) -> dict:
    from kvgen.spec.schema import load_spec  # pydantic: only this section needs the spec (kvgen calibrate)

    config = registry_config(registry.resolve(family, arch))
    model = tiny_model(config, "cuda", **SIZES)
    calibrated = calibrate_random_tokens(model, load_spec(ROOT / "specs" / f"{family}.yaml"), workdir,
                                         CALIBRATION_TOKENS, CALIBRATION_CHUNK)
    calibration = calibrated.flat
    ids = torch.randint(0, SIZES["vocab"], (1, prompt), device="cuda", generator=torch.Generator("cuda").manual_seed(2))

    def kvgen_cache(on_round=None) -> KvgenTriAttentionCache:  # noqa: ANN001
        return KvgenTriAttentionCache(model.config, family, calibration, registry=registry, arch=arch,
                                      max_cache_len=prompt + budget + beta, budget=budget, beta=beta,
                                      on_round=on_round)

    generate(model, ids, kvgen_cache(), budget + beta + 2)     # warm up: Triton compiles select and pack
    generate(model, ids, DynamicCache(), 8)
    times: dict[str, list[float]] = {"dynamic": [], "kvgen": []}
    round_times: list[float] = []
    for _ in range(TRI_RUNS):   # alternating; the last run's caches are the ones reported
        ref_cache = DynamicCache()
        ref, t_ref = timed(lambda: generate(model, ids, ref_cache, new))
        cache = kvgen_cache()
        round_times = _time_rounds(cache)
        mine, t_mine = timed(lambda: generate(model, ids, cache, new))
        times["dynamic"].append(t_ref)
        times["kvgen"].append(t_mine)
    t_ref, t_mine = statistics.median(times["dynamic"]), statistics.median(times["kvgen"])
    oracle = RoundOracle()
    checked = kvgen_cache(oracle)
    generate(model, ids, checked, new)
    agreement = oracle.agreement(checked)
    dynamic_bytes = sum(layer.keys.numel() * 2 + layer.values.numel() * 2 for layer in ref_cache.layers)
    return {"family": family, "prompt": prompt, "new_tokens": new, "budget": budget, "beta": beta,
            "calibration": {**calibrated.describe(), "form_used": "flat",
                            "manager_holds_these_statistics": bool(
                                torch.equal(checked.manager.calibration.E_q, calibrated.run.calibration.E_q)
                                and torch.equal(checked.manager.calibration.E_q_norm,
                                                calibrated.run.calibration.E_q_norm))},
            "tokens_per_s": {"dynamic": new / t_ref, "kvgen": new / t_mine}, "seconds": times,
            "rounds": len(cache.rounds), "round_ms": [1e3 * t for t in round_times],
            "round_ms_median": 1e3 * statistics.median(round_times) if round_times else None,
            "extra_ms_per_round_end_to_end": 1e3 * (t_mine - t_ref) / max(len(cache.rounds), 1),
            "physical_tokens": cache.length, "seen_tokens": cache.seen,
            "kv_bytes": {"dynamic_cache": dynamic_bytes, "kvgen_cached": cache.cached_bytes(),
                         "saved": cache.evicted_bytes(), "kvgen_pool_allocated": cache.pool.nbytes()},
            "memory_saved_fraction": cache.evicted_bytes() / dynamic_bytes,
            "kept_agreement_with_oracle": agreement,
            "kept_agreement_min": min(agreement) if agreement else None,
            "same_rounds_as_oracle_run": [(r.before, r.after) for r in checked.rounds]
            == [(r.before, r.after) for r in cache.rounds],
            "first_tokens_equal_dynamic_until_first_round": bool(torch.equal(
                mine.sequences[:, : prompt + budget + beta], ref.sequences[:, : prompt + budget + beta])),
            "manager": checked.manager.describe()}


def _time_rounds(cache) -> list[float]:  # noqa: ANN001
    """Wrap the manager's step hook (once it exists) to time every round, synchronized."""
    times: list[float] = []
    allocate = cache.allocate

    def timed_allocate(key_states):  # noqa: ANN001, ANN202
        allocate(key_states)
        hook = cache.manager.on_generation_step_end

        def timed_hook(step):  # noqa: ANN001, ANN202
            torch.cuda.synchronize()
            start = time.perf_counter()
            report = hook(step)
            torch.cuda.synchronize()
            if report.due:
                times.append(time.perf_counter() - start)
            return report

        cache.manager.on_generation_step_end = timed_hook

    cache.allocate = timed_allocate
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--registry", type=Path, default=ROOT / "build" / "registry")
    parser.add_argument("--arch", default="sm_90a")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--only", default="", help="comma list of section-name prefixes (default: all)")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    registry = RuntimeRegistry([args.registry])
    report: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                    "transformers": __import__("transformers").__version__, "sections": {}}
    sections = {
        "offload/qwen3-8b": lambda: offload_section(registry, args.arch, "qwen3-8b", 4, 1024, 96),
        "offload/qwen3.5-397b-a17b-lossless-rope": lambda: offload_section(
            registry, args.arch, "qwen3.5-397b-a17b-lossless-rope", 4, 1024, 96),
        "shared-pool/qwen3-8b": lambda: shared_pool_section(registry, args.arch, "qwen3-8b", 4, 1024, 96),
    }
    sections["triattention/qwen3-8b"] = lambda: triattention_section(registry, args.arch, "qwen3-8b", 256, 320,
                                                                     128, 64, args.out / "calibration")
    wanted = [p for p in args.only.split(",") if p]
    for name, run in sections.items():
        if wanted and not any(name.startswith(p) for p in wanted):
            continue
        start = time.perf_counter()
        try:
            report["sections"][name] = run()
        except Exception:  # noqa: BLE001 - record and go on: one command gives every section
            report["sections"][name] = {"error": traceback.format_exc()}
        report["sections"][name]["wall_s"] = time.perf_counter() - start
        print(f"{name}: {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
        torch.cuda.empty_cache()
        # after every section, so a run cut off by its time limit keeps what it measured
        (args.out / "hf_proof.json").write_text(json.dumps(report, indent=1, default=str))
    print(json.dumps(report, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
