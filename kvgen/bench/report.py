"""``kvgen bench report DIR``: ``DIR/report.md`` and PNG plots from ``DIR/bench.json``.

Plots (matplotlib, written beside the Markdown):
  ``fraction_of_ceiling.png``  every kernel and size as a fraction of its ceiling (device copy or
                               pinned host of that direction), goals marked;
  ``peers.png``                kvgen against its peers: the oracle in eager PyTorch, under
                               ``torch.compile``, and a plain copy of the same bytes (log-scale time);
  ``tuned_vs_default.png``     speed-up of the tuned registry over the default one, when the run had one.
Tables: the machine, the ceilings, the same three views, the codec's traffic mixes (``mix_rows``),
compaction batches against a copy of their own size, the tuned configurations found in a tuning
directory (``tuning/<arch>/<family>.json``), the eviction round's stages, and any errors.

``merge_recorded(DIR)`` turns the per-benchmark files of an older run (``bench_codec.json``,
``bench_compact.json``, ``bench_score.json``, each with its own environment and ceilings) into one
``bench.json`` document; each benchmark keeps its own ``environment`` and ``ceilings``.

Only this module's plot functions import matplotlib; reading and merging need nothing but the
standard library.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Iterable

from kvgen.bench.report_interference import FIGURE as INTERFERENCE_FIGURE
from kvgen.bench.report_interference import interference_markdown, interference_rows, plot_interference

RESULT = "bench.json"
REPORT = "report.md"
FIGURES = {"fraction": "fraction_of_ceiling.png", "peers": "peers.png", "tuned": "tuned_vs_default.png"}
RECORDED = {"codec": "bench_codec.json", "compact": "bench_compact.json", "score": "bench_score.json"}

# The goals the benchmarks' docstrings and docs/performance.md state (fraction of the ceiling).
GOALS = {"codec device": 0.85, "codec pinned": 0.90, "compact": 0.70, "score": 0.75}
CODEC_LABELS = {"encode_device": ("codec encode → device", "device copy", "codec device"),
                "decode_device": ("codec decode ← device", "device copy", "codec device"),
                "encode_pinned": ("codec encode → pinned", "pinned d2h", "codec pinned"),
                "decode_pinned": ("codec decode ← pinned", "pinned h2d", "codec pinned")}
CEILING_COLORS = {"device copy": "#4C72B0", "pinned d2h": "#DD8452", "pinned h2d": "#55A868"}
PEER_COLUMNS = (("kvgen_ms", "kvgen", "#4C72B0"), ("kvgen_eager_ms", "kvgen eager", "#8172B3"),
                ("oracle_eager_ms", "oracle eager", "#C44E52"),
                ("oracle_compile_ms", "oracle torch.compile", "#DD8452"),
                ("plain_copy_ms", "plain copy", "#937860"))


# ---------------------------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------------------------


def load(directory: Path) -> dict:
    return json.loads((Path(directory) / RESULT).read_text())


def normalize_ceilings(ceilings: dict | None) -> dict:
    """``{"device_copy": ..., "pinned": {...}}``; older score records called the copy ``copy``."""
    ceilings = dict(ceilings or {})
    if "copy" in ceilings and "device_copy" not in ceilings:
        ceilings["device_copy"] = ceilings.pop("copy")
    return ceilings


def merge_recorded(directory: Path, files: dict[str, str] | None = None) -> dict:
    """One ``bench.json`` document from an older run's per-benchmark files (those present)."""
    directory = Path(directory)
    files = files or RECORDED
    benchmarks, merged = {}, []
    for name, file in files.items():
        path = directory / file
        if not path.is_file():
            continue
        data = json.loads(path.read_text())
        data["ceilings"] = normalize_ceilings(data.get("ceilings"))
        data["source"] = file
        benchmarks[name] = data
        merged.append(file)
    if not benchmarks:
        raise FileNotFoundError(f"{directory}: none of {', '.join(files.values())}")
    first = next(iter(benchmarks.values()))
    with_pinned = next((b for b in benchmarks.values() if "pinned" in b["ceilings"]), first)
    return {"schema": 1, "tool": "kvgen bench merge", "environment": first.get("environment", {}),
            "ceilings": with_pinned["ceilings"], "config": {"merged_from": str(directory)},
            "benchmarks": benchmarks, "tuned_vs_default": [], "errors": {}, "seconds": {}, "merged_from": merged}


def bench_environment(doc: dict, name: str) -> dict:
    return doc["benchmarks"].get(name, {}).get("environment") or doc.get("environment", {})


def bench_ceilings(doc: dict, name: str) -> dict:
    return normalize_ceilings(doc["benchmarks"].get(name, {}).get("ceilings") or doc.get("ceilings"))


def _copy_gbps(doc: dict, name: str) -> float | None:
    return bench_ceilings(doc, name).get("device_copy", {}).get("gbps_read_plus_write")


def _tuned_variant(s: dict) -> dict | None:
    variants = s.get("variants") or []
    return next((v for v in variants if v.get("role") == "tuned"), variants[0] if variants else None)


def codec_size(r: dict) -> str:
    return f"{r['hot_bytes'] / 2**30:.2f} GiB hot, {r['pages']} pages"


def _size_compact(r: dict) -> str:
    size = f"batch {r['batch']}"
    if r.get("layers_moved") is not None and r.get("layers") and r["layers_moved"] != r["layers"]:
        size += f" ({r['layers_moved']} of {r['layers']} layers)"      # records before the twelfth session
    own = r.get("layers_with_own_pools")
    if own is not None and r.get("layers") and own != r["layers"]:
        size += f" ({r['layers']} layers on {own} layers' pools)"
    if r.get("params"):   # the library that served this batch (a size-dispatched variant or the main one)
        size += " [" + ", ".join(f"{k} {v}" for k, v in r["params"].items()) + "]"
    return size


def fraction_rows(doc: dict) -> list[dict]:
    """One row per kernel and size: time, GB/s, the ceiling it is divided by, the fraction, the goal."""
    rows = []
    for r in doc["benchmarks"].get("codec", {}).get("results", []):
        for run, (kernel, ceiling, goal) in CODEC_LABELS.items():
            if run in r:
                rows.append({"kernel": kernel, "family": r["family"], "size": codec_size(r),
                             "ms": r[run]["median_ms"], "gbps": r[run].get("gbps"), "ceiling": ceiling,
                             "fraction": r[run].get("fraction_of_ceiling"), "goal": GOALS[goal]})
    compact = doc["benchmarks"].get("compact", {})
    for r in compact.get("results", []):
        if "compact" in r:
            rows.append({"kernel": "compaction", "family": compact.get("config", {}).get("family", ""),
                         "size": _size_compact(r), "ms": r["compact"]["median_ms"], "gbps": r["compact"].get("gbps"),
                         "ceiling": "device copy", "fraction": r["compact"].get("fraction_of_copy"),
                         "goal": GOALS["compact"]})
    for s in doc["benchmarks"].get("score", {}).get("score", []):
        v = _tuned_variant(s)
        if v:
            rows.append({"kernel": "TriAttention score", "family": s["family"],
                         "size": f"batch {s['batch']}, {s['width']} tokens, {s['scored_layers']} layers",
                         "ms": v["median_ms"], "gbps": v.get("gbps"), "ceiling": "device copy",
                         "fraction": v.get("fraction_of_copy"), "goal": GOALS["score"]})
    return rows


def peer_rows(doc: dict) -> list[dict]:
    """kvgen against the oracle (eager, torch.compile) and a plain copy of the same bytes at the
    ceiling; None where a peer was not measured."""
    rows = []
    codec_copy = _copy_gbps(doc, "codec")
    for r in doc["benchmarks"].get("codec", {}).get("results", []):
        peers = r.get("peers", {})
        if "encode_device" in r:
            moved = r["hot_bytes"] + r["cold_bytes"]
            rows.append({"kernel": "codec encode → device", "family": r["family"], "size": codec_size(r),
                         "kvgen_ms": r["encode_device"]["median_ms"],
                         "oracle_eager_ms": peers.get("oracle_eager_ms"),
                         "oracle_compile_ms": peers.get("oracle_torch_compile_ms"),
                         "plain_copy_ms": moved / codec_copy / 1e6 if codec_copy else None,
                         "plain_copy": "hot + cold bytes at the device copy ceiling"})
        if "encode_pinned" in r and r.get("raw_offload_ms"):
            rows.append({"kernel": "offload → pinned", "family": r["family"], "size": codec_size(r),
                         "kvgen_ms": r["encode_pinned"]["median_ms"], "plain_copy_ms": r["raw_offload_ms"],
                         "plain_copy": "raw hot pages at the pinned d2h ceiling"})
    compact = doc["benchmarks"].get("compact", {})
    compact_copy = _copy_gbps(doc, "compact")
    family = compact.get("config", {}).get("family", "")
    for r in compact.get("results", []):
        if "compact" in r:
            rows.append({"kernel": "compaction", "family": family, "size": _size_compact(r),
                         "kvgen_ms": r["compact"]["median_ms"],
                         "plain_copy_ms": r["moved_bytes"] / compact_copy / 1e6 if compact_copy else None,
                         "plain_copy": "moved bytes at the device copy ceiling"})
        pack = r.get("pack")
        if pack:
            rows.append({"kernel": "move packer", "family": family, "size": f"batch {r['batch']}",
                         "kvgen_ms": pack["triton_graph"]["median_ms"],
                         "kvgen_eager_ms": pack.get("triton_eager", {}).get("median_ms"),
                         "oracle_eager_ms": pack.get("oracle_eager", {}).get("median_ms")})
    score = doc["benchmarks"].get("score", {})
    oracle = score.get("oracle")
    score_copy = _copy_gbps(doc, "score")
    for s in score.get("score", []):
        if not oracle or s["family"] != oracle.get("family") or s["batch"] != oracle.get("batch") \
                or s["width"] != oracle.get("width"):
            continue
        v = _tuned_variant(s)
        if not v:
            continue
        layers = s["scored_layers"]
        rows.append({"kernel": "TriAttention score, per layer", "family": s["family"],
                     "size": f"batch {s['batch']}, {s['width']} tokens",
                     "kvgen_ms": v["median_ms"] / layers,
                     "oracle_eager_ms": oracle.get("eager", {}).get("median_ms"),
                     "oracle_compile_ms": oracle.get("compiled", {}).get("median_ms"),
                     "plain_copy_ms": ((v["k_bytes"] + s["score_bytes"]) / score_copy / 1e6 / layers
                                       if score_copy else None),
                     "plain_copy": "K + score bytes at the device copy ceiling"})
    return rows


def default_errors(doc: dict) -> list[str]:
    """Where the default registry could not be compared (its message per kernel and size)."""
    errors = []
    bench = doc["benchmarks"]
    for r in bench.get("codec", {}).get("results", []):
        if (r.get("default") or {}).get("error"):
            errors.append(f"codec {r['family']}: {r['default']['error']}")
    for r in bench.get("compact", {}).get("results", []):
        if (r.get("default") or {}).get("error"):
            errors.append(f"compaction batch {r['batch']}: {r['default']['error']}")
    for s in bench.get("score", {}).get("score", []):
        if s.get("default_error"):
            errors.append(f"score {s['family']} batch {s['batch']}: {s['default_error']}")
    return errors


def tuning_records(tuning: Path | None) -> list[dict]:
    """Rows of ``tuning/<arch>/<family>.json`` (schema 1), one per (op, bucket); an op without
    buckets gives one row. Missing keys are left empty; unreadable files give an ``error`` row."""
    rows: list[dict] = []
    if tuning is None or not Path(tuning).is_dir():
        return rows
    for path in sorted(Path(tuning).glob("*/*.json")):
        try:
            data = json.loads(path.read_text())
            ops = data.get("ops") or {}
            if not isinstance(ops, dict):
                raise ValueError("'ops' is not an object")
        except (OSError, ValueError) as exc:
            rows.append({"file": str(path), "error": str(exc)})
            continue
        base = {"file": str(path), "arch": data.get("arch") or path.parent.name,
                "family": data.get("family") or path.stem, "schema": data.get("schema")}
        for op, entry in sorted(ops.items()):
            entry = entry if isinstance(entry, dict) else {}
            op_row = {**base, "op": op, "params": entry.get("params"), "default": entry.get("default")}
            buckets = entry.get("buckets") or {}
            if not isinstance(buckets, dict) or not buckets:
                rows.append(op_row)
                continue
            for bucket, b in sorted(buckets.items()):
                b = b if isinstance(b, dict) else {}
                rows.append({**op_row, "bucket": bucket, **{k: b.get(k) for k in (
                    "best", "best_ms", "default_ms", "params_ms", "speedup", "trials", "failed", "strategy")}})
    return rows


# ---------------------------------------------------------------------------------------------
# Formatting
# ---------------------------------------------------------------------------------------------


def _ms(value: float | None) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "—"
    if value >= 100:
        return f"{value:.0f} ms"
    if value >= 10:
        return f"{value:.1f} ms"
    if value >= 0.1:
        return f"{value:.2f} ms"
    return f"{value:.3f} ms"


def _num(value: Any, fmt: str = "{:.2f}") -> str:
    if value is None:
        return "—"
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return fmt.format(value)
    return str(value)


def _params(params: Any) -> str:
    if not params:
        return "—"
    if isinstance(params, dict):
        return ", ".join(f"{k}={v}" for k, v in params.items())
    return str(params)


def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _table(header: Iterable[str], rows: Iterable[Iterable[Any]]) -> list[str]:
    header = list(header)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return lines


def _environment_summary(doc: dict) -> dict[str, str]:
    """Each environment field as one value, or ``a (codec, compact), b (score)`` where runs differ."""
    names = [n for n in ("codec", "compact", "score") if n in doc["benchmarks"]]
    envs = {n: bench_environment(doc, n) for n in names} or {"run": doc.get("environment", {})}
    summary = {}
    for key in ("gpu", "compute_capability", "sms", "driver", "torch", "cuda_runtime", "date", "commit"):
        values: dict[str, list[str]] = {}
        for name, env in envs.items():
            values.setdefault(str(env.get(key, "?")), []).append(name)
        summary[key] = (next(iter(values)) if len(values) == 1
                        else ", ".join(f"{v} ({', '.join(n)})" for v, n in values.items()))
    return summary


def _machine(doc: dict) -> list[str]:
    names = [n for n in ("codec", "compact", "score") if n in doc["benchmarks"]]
    envs = {n: bench_environment(doc, n) for n in names}
    keys = (("gpu", "GPU"), ("compute_capability", "compute capability"), ("sms", "SMs"), ("driver", "driver"),
            ("torch", "torch"), ("cuda_runtime", "CUDA runtime"), ("host", "host"), ("date", "date"),
            ("commit", "commit"))
    distinct = {json.dumps(e, sort_keys=True) for e in envs.values()}
    if len(distinct) <= 1:
        env = next(iter(envs.values()), doc.get("environment", {}))
        return _table(("", "this run"), ((label, env.get(key, "—")) for key, label in keys))
    return _table(("", *names), ((label, *(envs[n].get(key, "—") for n in names)) for key, label in keys))


def _ceilings(doc: dict) -> list[str]:
    names = [n for n in ("codec", "compact", "score") if n in doc["benchmarks"]]
    per = {n: bench_ceilings(doc, n) for n in names}
    shared = len({json.dumps(c, sort_keys=True) for c in per.values()}) <= 1

    def row(label: str, c: dict) -> tuple:
        copy = c.get("device_copy", {})
        pinned = c.get("pinned", {})
        return (label, _num(copy.get("gbps_read_plus_write"), "{:.0f} GB/s"),
                _num(copy.get("bytes") and copy["bytes"] / 2**30, "{:.0f} GiB"),
                _num(pinned.get("d2h", {}).get("gbps"), "{:.1f} GB/s"),
                _num(pinned.get("h2d", {}).get("gbps"), "{:.1f} GB/s"))

    header = ("measured in", "device copy (read + written)", "copy size", "pinned device → host",
              "pinned host → device")
    if shared:
        return _table(header, [row("this run, once, before every benchmark",
                                   normalize_ceilings(doc.get("ceilings")) or next(iter(per.values()), {}))])
    return _table(header, [row(f"the {n} run ({doc['benchmarks'][n].get('source', n)})", per[n]) for n in names])


def mix_rows(doc: dict) -> list[dict]:
    """One row per codec device run that has its mix ceiling (records from the seventeenth session on)."""
    rows = []
    for r in doc["benchmarks"].get("codec", {}).get("results", []):
        for run, m in (r.get("mix") or {}).items():
            rows.append({"run": CODEC_LABELS[run][0], "family": r["family"], "gbps": m["gbps"],
                         "mix_of_copy": m["of_copy"], "of_copy": r[run]["fraction_of_ceiling"],
                         "of_mix": r[run]["fraction_of_mix"]})
    return rows


def render_markdown(doc: dict, tuning_rows: list[dict], figures: dict[str, str], tuning_dir: Path | None) -> str:
    env = _environment_summary(doc)
    merged = doc.get("merged_from")
    out = ["# kvgen benchmark report", ""]
    out += [f"Machine: **{env['gpu']}** (compute capability {env['compute_capability']}, {env['sms']} SMs), "
            f"driver {env['driver']}, torch {env['torch']}, CUDA runtime {env['cuda_runtime']}; "
            f"date {env['date']}; commit {env['commit']}.", ""]
    if merged:
        out += [f"Merged from the recorded runs {', '.join(f'`{m}`' for m in merged)} (one process each, "
                "before `kvgen bench` ran them together): **every ratio is against the ceilings measured in "
                "the same process as the kernel**, listed per run below.", ""]
    else:
        out += ["Written by `kvgen bench run`: every benchmark ran in one process and **every ratio is against "
                "ceilings measured in the same run**, once, before the first benchmark.", ""]
    out += _machine(doc) + [""]
    out += ["## Ceilings", "",
            "Device copy: a `copy_` between two device buffers, bytes read + written per second. Pinned: "
            "`cudaMemcpy` (torch `copy_`) between device memory and pinned host memory, one direction each. "
            "Times are medians of CUDA-event-bracketed calls.", ""]
    out += _ceilings(doc) + [""]

    rows = fraction_rows(doc)
    out += ["## Fraction of the ceiling, per kernel and size", "",
            "Codec device columns: (hot + cold bytes) / time; pinned: cold bytes / time (the kernel stores into, "
            "or loads from, mapped pinned memory); compaction: moved K/V bytes read + written; score: K bytes "
            "read + score bytes written. Each divided by the ceiling named in the row.", ""]
    if "fraction" in figures:
        out += [f"![fraction of ceiling]({figures['fraction']})", ""]
    out += _table(("kernel", "family", "size", "time", "GB/s", "ceiling", "fraction", "goal"),
                  ((r["kernel"], r["family"], r["size"], _ms(r["ms"]), _num(r["gbps"], "{:.0f}"), r["ceiling"],
                    f"**{_num(r['fraction'])}**" if r["fraction"] is not None and r["fraction"] >= r["goal"]
                    else _num(r["fraction"]), f"≥ {r['goal']:.2f}") for r in rows)) + [""]

    mixes = mix_rows(doc)
    if mixes:
        out += ["## The codec's own traffic mixes", "",
                "The same bytes as each device run (decode: cold records in, hot pages out; encode the reverse) "
                "through a kernel without arithmetic (`kvgen.measure.mix`): what the DRAM sustains for that "
                "read/write mix, as a fraction of the balanced copy, and the codec's time against it.", ""]
        out += _table(("run", "family", "mix GB/s", "mix of copy", "codec of copy", "codec of its mix"),
                      ((r["run"], r["family"], _num(r["gbps"], "{:.0f}"), _num(r["mix_of_copy"]),
                        _num(r["of_copy"]), _num(r["of_mix"])) for r in mixes)) + [""]

    small = [r for r in doc["benchmarks"].get("compact", {}).get("results", []) if "same_size_copy" in r]
    if small:
        out += ["## Compaction batches smaller than the ceiling's copy", "",
                "A `copy_` of the batch's moved bytes in one piece, captured and replayed as the compaction is: "
                "what launch, ramp and last wave alone cost at that size.", ""]
        out += _table(("batch", "bytes each way", "same-size copy of copy", "compaction of copy",
                       "compaction of the same-size copy"),
                      ((r["batch"], _num(r["same_size_copy"]["bytes"] / 1e9, "{:.2f} GB"),
                        _num(r["same_size_copy"]["of_copy"]), _num(r["compact"]["fraction_of_copy"]),
                        _num(r["same_size_copy"]["compact_of_it"])) for r in small)) + [""]

    peers = peer_rows(doc)
    out += ["## Against the peers", "",
            "kvgen's kernel against the oracle (`kvgen.reference`, plain PyTorch on the same GPU) run eagerly and "
            "under `torch.compile`, and against a plain copy: the time the same bytes take at the ceiling "
            "(what a perfectly memory-bound kernel would take; for the offload row, copying the raw hot pages "
            "to pinned memory instead of encoding them). — : not measured.", ""]
    if "peers" in figures:
        out += [f"![peers]({figures['peers']})", ""]
    out += _table(("kernel", "family", "size", "kvgen", "kvgen eager", "oracle eager", "oracle torch.compile",
                   "plain copy", "oracle torch.compile ÷ kvgen"),
                  ((r["kernel"], r["family"], r["size"], _ms(r.get("kvgen_ms")), _ms(r.get("kvgen_eager_ms")),
                    _ms(r.get("oracle_eager_ms")), _ms(r.get("oracle_compile_ms")), _ms(r.get("plain_copy_ms")),
                    _num(r["oracle_compile_ms"] / r["kvgen_ms"], "{:.1f}×") if r.get("oracle_compile_ms")
                    else "—") for r in peers)) + [""]

    tvd = doc.get("tuned_vs_default") or []
    out += ["## Tuned vs default parameters", ""]
    if tvd:
        config = doc.get("config", {})
        out += [f"The registry under test (`{config.get('registry', '?')}`) against one built with the safe default "
                f"parameters (`{config.get('default_registry', '?')}`), timed on the same inputs in this run. "
                "Speed-up = default time / tuned time.", ""]
        if "tuned" in figures:
            out += [f"![tuned vs default]({figures['tuned']})", ""]
        out += _table(("kernel", "family", "size", "tuned", "default", "speed-up", "tuned params", "default params"),
                      ((e["kernel"], e["family"], e["size"], _ms(e.get("tuned_ms")), _ms(e.get("default_ms")),
                        _num(e.get("speedup"), "{:.2f}×"), _params(e.get("tuned_params")),
                        _params(e.get("default_params"))) for e in tvd)) + [""]
    else:
        out += ["Not measured in this run (`kvgen bench run --default-registry DIR` times a registry built with the "
                "default parameters, e.g. `KVGEN_TUNING=off kvgen build --registry build/registry-default`, "
                "against the one under test).", ""]

    failed = default_errors(doc)
    if failed:
        out += ["Not compared (the default registry's kernel failed or is missing):", ""]
        out += [f"- {_cell(line)}" for line in failed] + [""]

    out += ["## Tuned configurations", ""]
    if tuning_rows:
        out += [f"From `{tuning_dir}` (`<arch>/<family>.json`): per op the parameters the build uses and the "
                "safe defaults; per size bucket the best configuration the tuner measured, its time, the "
                "default's, the chosen parameters', and the speed-up it recorded.", ""]
        out += _table(("arch", "family", "op", "build params", "defaults", "bucket", "best config", "best time",
                       "default time", "build params' time", "speed-up", "trials", "failed", "strategy"),
                      ((r.get("arch", "—"), r.get("family", "—"), r.get("op", "—"), _params(r.get("params")),
                        _params(r.get("default")), r.get("bucket", "—"), _params(r.get("best")),
                        _ms(r.get("best_ms")), _ms(r.get("default_ms")), _ms(r.get("params_ms")),
                        _num(r.get("speedup"), "{:.2f}×"), _num(r.get("trials"), "{}"), _num(r.get("failed"), "{}"),
                        r.get("strategy") or "—") if "error" not in r
                       else (r["file"], "unreadable", r["error"], *["—"] * 11) for r in tuning_rows)) + [""]
    else:
        out += [f"No tuning records (`<arch>/<family>.json`) in `{tuning_dir}`." if tuning_dir
                else "No tuning directory given.", ""]

    round_ = doc["benchmarks"].get("score", {}).get("round")
    if round_:
        out += ["## One eviction round", "",
                f"{round_['family']}, batch {round_['batch']}, {round_['width']} decode tokens, budget "
                f"{round_['budget']}, every request due; pack and compact: {round_.get('pack_compact', '?')}.", ""]
        stages = round_.get("stages", {})
        est = round_.get("decode_attention_estimate_ms", {})
        out += _table(("stage", "time"), [*((k.replace("_", " / "), _ms(v.get("median_ms"))) for k, v in stages.items()),
                                          ("whole round", _ms(round_.get("round", {}).get("median_ms"))),
                                          ("one decode step's attention before / after (estimate: K+V bytes at the "
                                           "copy ceiling)", f"{_ms(est.get('before_round'))} / "
                                                            f"{_ms(est.get('after_round'))}"),
                                          ("round ÷ one decode step", _num(round_.get("round_over_decode_step"))),
                                          ("share of β decode steps", _num(round_.get("round_over_beta_decode_steps"),
                                                                           "{:.1%}"))]) + [""]

    out += round_section(doc["benchmarks"].get("round", {}).get("results", []))
    out += interference_markdown(doc, figures.get("interference"), _table, _ms, _num)

    if doc.get("errors"):
        out += ["## Errors", ""]
        for name, text in doc["errors"].items():
            out += [f"`{name}` failed:", "", "```", str(text).strip()[-2000:], "```", ""]
    out += ["Data: `bench.json` beside this file" + (f" (merged from {', '.join(merged)})." if merged else "."), ""]
    return "\n".join(out)


ROUND_STAGES = ("score", "normalize_aggregate_select", "statistics", "aggregate", "statistics_aggregate", "select",
                "pack", "compact")


def round_section(results: list[dict]) -> list[str]:
    """Whole rounds (``kvgen.bench.round``): per family and batch the stages, the round, its bytes
    limit and the ratio against the goal; skipped cases with the reason."""
    if not results:
        return []
    out = ["## Eviction rounds against the bytes limit", "",
           "Every request due, budget and width as listed; stages timed alone on the same cache (median ms); "
           "normalize / aggregate / select is the selection as the round runs it: statistics and aggregate "
           "apart, or statistics / aggregate (one launch: the queue) when the family's aggregate_route is 1; "
           "then select. "
           "Bytes limit: K read once plus the compaction moves read and written (a sliding-window layer moves "
           "its window), at the copy ceiling of this run. Goal (issue 14): round ≤ 1.3 × the limit. "
           "Floor: the limit plus the float32 scores the design materializes (written by the scorer, read by "
           "the statistics and by the aggregation), the least this pipeline can take.", ""]
    header = ("family", "batch", "width", "budget", *(s.replace("_", " / ") for s in ROUND_STAGES), "whole round",
              "bytes limit (K read + moves)", "round ÷ limit", "floor (+ scores × 3)", "round ÷ floor", "kernels")
    rows = []
    for r in results:
        if "skipped" in r or "error" in r:
            rows.append((r["family"], r["batch"], r["width"], r["budget"], *["—"] * len(ROUND_STAGES), "—", "—",
                         "skipped" if "skipped" in r else "failed", "—", "—", r.get("skipped") or r["error"]))
            continue
        stages = r.get("stages", {})
        parts = r.get("limit_parts_ms", {})
        ratio = r.get("round_over_limit")
        mark = "" if ratio is None else (" ✓" if ratio <= r.get("goal", 1.3) else " ✗")
        rows.append((r["family"], r["batch"], r["width"], r["budget"],
                     *(_ms(stages.get(s, {}).get("median_ms")) for s in ROUND_STAGES), _ms(r.get("round_ms")),
                     f"{_ms(r.get('limit_ms'))} ({_ms(parts.get('k_read'))} + {_ms(parts.get('moves'))})",
                     _num(ratio, "{:.2f}×") + mark, _ms(r.get("floor_ms")), _num(r.get("round_over_floor"), "{:.2f}×"),
                     r.get("artifacts", "—") + shared_pools_note(r)))
    return out + _table(header, rows) + [""]


def shared_pools_note(r: dict) -> str:
    """"; N of L layers with pools of their own" for a round whose layers share pools, else ""."""
    own, layers = r.get("layers_with_own_pools"), r.get("layers")
    return f"; {own} of {layers} layers with pools of their own" if own is not None and own < layers else ""


# ---------------------------------------------------------------------------------------------
# Plots
# ---------------------------------------------------------------------------------------------


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_fraction(rows: list[dict], path: Path) -> None:
    plt = _pyplot()
    rows = [r for r in rows if r.get("fraction") is not None]
    labels = [f"{r['kernel']} · {r['family']} · {r['size']}" for r in rows]
    fig, ax = plt.subplots(figsize=(11, 1.2 + 0.32 * len(rows)))
    y = list(range(len(rows)))[::-1]
    ax.barh(y, [r["fraction"] for r in rows], color=[CEILING_COLORS.get(r["ceiling"], "#777777") for r in rows])
    ax.scatter([r["goal"] for r in rows], y, marker="|", s=220, color="black", zorder=3, label="goal")
    for yi, r in zip(y, rows):
        ax.text(r["fraction"] + 0.01, yi, f"{r['fraction']:.2f}", va="center", fontsize=8)
    ax.axvline(1.0, color="grey", linewidth=0.8, linestyle="--")
    ax.set_yticks(y, labels, fontsize=8)
    ax.set_xlim(0, max(1.1, max((r["fraction"] for r in rows), default=1) + 0.1))
    ax.set_xlabel("fraction of the ceiling measured in the same run")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in CEILING_COLORS.values()]
    ax.legend(handles + [ax.collections[0]], [f"ceiling: {k}" for k in CEILING_COLORS] + ["goal"],
              loc="upper center", bbox_to_anchor=(0.5, -0.6 / (1.2 + 0.32 * len(rows))), ncol=4, fontsize=8,
              frameon=False)
    ax.set_title("kvgen kernels: fraction of ceiling per kernel and size")
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def plot_peers(rows: list[dict], path: Path) -> None:
    """One block of bars per row (only the measured ones), top to bottom, log-scale time."""
    plt = _pyplot()
    bar, gap = 0.8, 0.7
    blocks, y = [], 0.0
    for r in reversed(rows):   # matplotlib's y grows upwards: lay the last row out first
        present = [(key, label, color) for key, label, color in PEER_COLUMNS if r.get(key)]
        ys = [y + bar * (len(present) - 1 - i) for i in range(len(present))]
        blocks.append((r, present, ys))
        y += bar * len(present) + gap
    fig, ax = plt.subplots(figsize=(11, 1.4 + 0.2 * y))
    seen = set()
    for r, present, ys in blocks:
        for (key, label, color), yi in zip(present, ys):
            ax.barh(yi, r[key], height=bar * 0.9, color=color, label=None if label in seen else label)
            ax.text(r[key], yi, f" {_ms(r[key])}", va="center", fontsize=7)
            seen.add(label)
    ax.set_xscale("log")
    ax.set_yticks([sum(ys) / len(ys) for _, _, ys in blocks if ys],
                  [f"{r['kernel']} · {r['family']} · {r['size']}" for r, _, ys in blocks if ys], fontsize=8)
    ax.set_ylim(-gap, y)
    lo = min((r[k] for r, present, _ in blocks for k, _, _ in present), default=0.01)
    hi = max((r[k] for r, present, _ in blocks for k, _, _ in present), default=1)
    ax.set_xlim(lo / 2, hi * 8)
    ax.set_xlabel("time per call (ms, log scale; shorter is better)")
    handles, labels = ax.get_legend_handles_labels()
    order = [labels.index(label) for _, label, _ in PEER_COLUMNS if label in labels]
    ax.legend([handles[i] for i in order], [labels[i] for i in order], loc="upper center", fontsize=8,
              bbox_to_anchor=(0.5, -0.05 * 12 / max(12, 1.4 + 0.2 * y)), ncol=len(order), frameon=False)
    ax.set_title("kvgen against the oracle (eager, torch.compile) and a plain copy of the same bytes")
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def plot_tuned(entries: list[dict], path: Path) -> None:
    plt = _pyplot()
    entries = [e for e in entries if e.get("speedup")]
    fig, ax = plt.subplots(figsize=(10, 1.2 + 0.3 * len(entries)))
    y = list(range(len(entries)))[::-1]
    speedups = [e["speedup"] for e in entries]
    ax.barh(y, speedups, color=["#55A868" if s >= 1 else "#C44E52" for s in speedups])
    for yi, s in zip(y, speedups):
        ax.text(s, yi, f" {s:.2f}×", va="center", fontsize=8)
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_yticks(y, [f"{e['kernel']} · {e['family']} · {e['size']}" for e in entries], fontsize=8)
    ax.set_xlabel("speed-up of the tuned parameters over the defaults (default time / tuned time)")
    ax.set_xlim(0, max(1.2, max(speedups, default=1) * 1.15))
    ax.set_title("tuned vs default parameters, same inputs, same run")
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def write_report(directory: Path, tuning: Path | None = None) -> Path:
    """``directory/report.md`` and its PNGs from ``directory/bench.json``; the Markdown's path."""
    directory = Path(directory)
    doc = load(directory)
    doc.setdefault("benchmarks", {})
    figures: dict[str, str] = {}
    rows = fraction_rows(doc)
    if rows:
        plot_fraction(rows, directory / FIGURES["fraction"])
        figures["fraction"] = FIGURES["fraction"]
    peers = peer_rows(doc)
    if peers:
        plot_peers(peers, directory / FIGURES["peers"])
        figures["peers"] = FIGURES["peers"]
    if any(e.get("speedup") for e in doc.get("tuned_vs_default") or []):
        plot_tuned(doc["tuned_vs_default"], directory / FIGURES["tuned"])
        figures["tuned"] = FIGURES["tuned"]
    interference = interference_rows(doc)
    if interference:
        plot_interference(interference, doc["benchmarks"]["interference"]["goals"], directory / INTERFERENCE_FIGURE,
                          _pyplot)
        figures["interference"] = INTERFERENCE_FIGURE
    tuning_dir = Path(tuning) if tuning is not None and Path(tuning).is_dir() else None
    path = directory / REPORT
    path.write_text(render_markdown(doc, tuning_records(tuning_dir), figures, _shown(tuning_dir or tuning)))
    return path


def _shown(path: Path | None) -> Path | None:
    """A path as the report shows it: relative to the current directory when under it."""
    if path is None:
        return None
    try:
        return Path(path).resolve().relative_to(Path.cwd().resolve())
    except ValueError:
        return Path(path)
