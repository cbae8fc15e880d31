"""``kvgen bench run``: every kernel benchmark in one process, against ceilings measured once.

Order: the ceilings (device copy, pinned device->host and host->device; ``measure_ceilings``), then
the codec, the compaction and packer, the scorer with its peers, whole eviction rounds stage by
stage against their bytes limit (``kvgen.bench.round``), and offload/onboard beside a foreground
stream (interference), each given the same ceilings. ``bench.json`` in the output directory is rewritten after every step, so a
run cut short keeps what it measured; a benchmark that fails is recorded under ``errors`` (with its
traceback) and the next one still runs.

With a default registry (``--default-registry DIR``: the same families built with the safe default
parameters, e.g. ``KVGEN_TUNING=off kvgen build --registry build/registry-default``), the codec,
the compaction and the scorer time both registries' kernels on the same inputs in this run, and
``tuned_vs_default`` lists one entry per kernel and size: ``{kernel, family, size, tuned_ms,
default_ms, speedup (default_ms / tuned_ms), tuned_params, default_params, ...}``; parameters are
the registry manifest's per-op ``params`` (score included).

``bench.json``::

    {"schema": 1, "tool": "kvgen bench", "environment": {gpu, driver, date, commit, ...},
     "ceilings": {"device_copy": {...}, "pinned": {"d2h": {...}, "h2d": {...}}},
     "config": {registry, default_registry, arch, ...},
     "benchmarks": {"codec": {"results": [...]},                       # as bench_codec.json
                    "compact": {"config": {...}, "results": [...]},     # as bench_compact.json
                    "score": {"score": [...], "oracle": {...}, "round": {...}},  # as bench_score.json
                    "round": {"results": [...]},                          # kvgen.bench.round
                    "interference": {"foreground": {...}, "goals": {...}, "results": [...]}},  # bench/interference.py
     "tuned_vs_default": [...], "errors": {benchmark: traceback}, "seconds": {step: s}}

Needs torch, Triton and pydantic (the codec and scorer read specs); nothing else.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from kvgen.bench.report import codec_size

SCHEMA = 1
BENCHMARKS = ("codec", "compact", "score", "round", "interference")
RESULT = "bench.json"
CODEC_RUNS = ("encode_device", "decode_device", "encode_pinned", "decode_pinned")


@dataclass
class Options:
    out: Path
    registry: Path
    arch: str = "sm_90a"
    default_registry: Path | None = None
    only: tuple[str, ...] = BENCHMARKS
    families: tuple[str, ...] = ("qwen3-8b", "qwen3-8b-fp8", "deepseek-v3", "deepseek-v4-csa")
    hot_gib: float = 1.2
    interference_families: tuple[str, ...] = ("qwen3-8b", "qwen3-8b-fp8")
    compact_family: str = "qwen3-8b"
    batches: tuple[int, ...] = (1, 32, 256)
    mode: str = "union"
    width: int = 16384
    score_batch: int = 32
    score_variants: tuple[Path, ...] = ()
    peers: bool = True
    round: bool = True
    argv: list[str] = field(default_factory=list)
    specs: Path | None = None   # kvgen --specs DIR (None: paths.specs_dir())

    def config(self) -> dict[str, Any]:
        return {"registry": str(self.registry), "default_registry": str(self.default_registry or "") or None,
                "arch": self.arch, "benchmarks": list(self.only),
                "codec": {"families": list(self.families), "hot_gib": self.hot_gib},
                "interference": {"families": list(self.interference_families), "hot_gib": self.hot_gib},
                "compact": {"family": self.compact_family, "batches": list(self.batches), "mode": self.mode},
                "score": {"width": self.width, "batch": self.score_batch,
                          "variants": [str(p) for p in self.score_variants]},
                "peers": self.peers, "round": self.round, "argv": self.argv}


def write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)


def release() -> None:
    """Give the previous benchmark's memory back to the driver (the next one sizes itself by it)."""
    import torch

    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def _run_codec(ceilings: dict, o: Options) -> dict:
    from kvgen.bench import codec

    return codec.run(ceilings, list(o.families), o.hot_gib, o.registry, o.arch, o.peers, o.default_registry,
                     o.specs)


def _run_compact(ceilings: dict, o: Options) -> dict:
    from kvgen.bench import compact

    return compact.run(ceilings, o.compact_family, list(o.batches), o.mode, o.registry, o.arch,
                       o.default_registry)


def _run_score(ceilings: dict, o: Options) -> dict:
    from kvgen.bench import score

    # The score benchmark's single qwen3-8b round is left out when the round benchmark runs: it measures
    # the same round, and more.
    return score.run(ceilings, o.width, o.score_batch, o.registry, list(o.score_variants), o.arch, o.peers,
                     o.round and "round" not in o.only, o.default_registry, o.specs)


def _run_round(ceilings: dict, o: Options) -> dict:
    from kvgen.bench import round as whole_round

    return whole_round.run(ceilings, o.width, whole_round.BATCHES, o.registry, o.arch, o.mode, o.specs)


def _run_interference(ceilings: dict, o: Options) -> dict:
    from kvgen.bench import interference

    return interference.run(ceilings, o.interference_families, o.hot_gib, o.registry, o.arch, o.specs)


RUNNERS: dict[str, Callable[[dict, Options], dict]] = {"codec": _run_codec, "compact": _run_compact,
                                                       "score": _run_score, "round": _run_round,
                                                       "interference": _run_interference}


def run_suite(o: Options) -> dict:
    """Measure, write ``o.out / bench.json`` after every step, return the document. Raises
    ``NoGpu`` (before touching anything) without a CUDA device."""
    from kvgen.measure import environment, timing

    timing.require_cuda()
    import torch

    o.out.mkdir(parents=True, exist_ok=True)
    path = o.out / RESULT
    doc: dict[str, Any] = {"schema": SCHEMA, "tool": "kvgen bench", "environment": environment.environment(),
                           "config": o.config(), "ceilings": {}, "benchmarks": {}, "tuned_vs_default": [],
                           "errors": {}, "seconds": {}}
    start = time.perf_counter()
    doc["ceilings"] = ceilings = timing.measure_ceilings(pinned=True)
    doc["seconds"]["ceilings"] = time.perf_counter() - start
    copy, pinned = ceilings["device_copy"], ceilings["pinned"]
    print(f"ceilings: device copy {copy['gbps_read_plus_write']:.0f} GB/s (read + write), pinned "
          f"d2h {pinned['d2h']['gbps']:.1f} GB/s, h2d {pinned['h2d']['gbps']:.1f} GB/s", flush=True)
    write_json(path, doc)
    for name in o.only:
        release()
        free, total = torch.cuda.mem_get_info()
        print(f"== {name} ({free / 2**30:.1f} of {total / 2**30:.1f} GiB free)", flush=True)
        began = time.perf_counter()
        try:
            doc["benchmarks"][name] = RUNNERS[name](ceilings, o)
        except Exception:  # noqa: BLE001 - recorded; the next benchmark still runs
            doc["errors"][name] = traceback.format_exc()[-6000:]
            print(f"{name} failed:\n{doc['errors'][name]}", file=sys.stderr, flush=True)
        doc["seconds"][name] = time.perf_counter() - began
        if o.default_registry is not None:
            doc["tuned_vs_default"] = tuned_vs_default(doc["benchmarks"], manifest_params(o.registry, o.arch),
                                                       manifest_params(o.default_registry, o.arch))
        write_json(path, doc)
    doc["seconds"]["total"] = time.perf_counter() - start
    write_json(path, doc)
    print(f"wrote {path} ({doc['seconds']['total']:.0f} s)", flush=True)
    return doc


# ---------------------------------------------------------------------------------------------
# Tuned vs default
# ---------------------------------------------------------------------------------------------

Params = Callable[[str, str], dict]   # (family, op) -> the op's params in one registry


def manifest_params(registry: Path, arch: str) -> Params:
    """The per-op ``params`` of ``<registry>/<arch>/manifest.json`` (``kvgen.artifacts.manifest.OpEntry``);
    {} where the manifest, the family or the op is missing."""
    from kvgen.artifacts.manifest import RegistryError, manifest_path, parse_manifest

    try:
        manifest = parse_manifest(manifest_path(registry, arch))
    except RegistryError:
        manifest = None

    def params(family: str, op: str) -> dict:
        entry = manifest.family(family) if manifest is not None else None
        for op_entry in (entry.ops if entry is not None else ()):
            if op_entry.op == op:
                return dict(op_entry.params)
        return {}

    return params


def _entry(kernel: str, family: str, size: str, tuned: dict, default: dict, tuned_params: dict,
           default_params: dict, fraction_key: str) -> dict:
    tuned_ms, default_ms = tuned["median_ms"], default["median_ms"]
    return {"kernel": kernel, "family": family, "size": size, "tuned_ms": tuned_ms, "default_ms": default_ms,
            "speedup": default_ms / tuned_ms if tuned_ms else None, "tuned_params": tuned_params,
            "default_params": default_params, "tuned_fraction": tuned.get(fraction_key),
            "default_fraction": default.get(fraction_key)}


def tuned_vs_default(benchmarks: dict, tuned_params: Params, default_params: Params) -> list[dict]:
    """One entry per kernel and size that both registries ran (see the module docstring)."""
    entries: list[dict] = []
    for r in benchmarks.get("codec", {}).get("results", []):
        default = r.get("default") or {}
        for run in CODEC_RUNS:
            if run in r and run in default:
                entries.append(_entry(f"codec.{run}", r["family"], codec_size(r), r[run], default[run],
                                      tuned_params(r["family"], "codec"), default_params(r["family"], "codec"),
                                      "fraction_of_ceiling"))
    compact = benchmarks.get("compact", {})
    family = compact.get("config", {}).get("family", "")
    for r in compact.get("results", []):
        default = (r.get("default") or {}).get("compact")
        if default and "compact" in r:
            entries.append(_entry("compact", family, f"batch {r['batch']}", r["compact"], default,
                                  tuned_params(family, "compact"), default_params(family, "compact"),
                                  "fraction_of_copy"))
    for s in benchmarks.get("score", {}).get("score", []):
        variants = s.get("variants", [])
        tuned = next((v for v in variants if v.get("role") == "tuned"), None)
        default = next((v for v in variants if v.get("role") == "default"), None)
        if tuned and default:
            entries.append(_entry("score", s["family"], f"batch {s['batch']}, {s['width']} tokens", tuned, default,
                                  tuned.get("params") or tuned_params(s["family"], "score"),
                                  default.get("params") or default_params(s["family"], "score"),
                                  "fraction_of_copy"))
    return entries
