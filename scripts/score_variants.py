#!/usr/bin/env python3
"""Check and time a bundle of TriAttention scorer variants on the GPU (one H200 call, ~3 minutes).

    python scripts/score_variants.py BUNDLE_DIR --out DIR [--width 16384] [--batch 1 --batch 32]

``BUNDLE_DIR`` is what ``scripts/score_variants_bundle.py`` wrote (``score-variants.tar.xz``).
The device copy ceiling is measured first, in this run. Then one worker process per family, each:
1. checks every variant against the float64 oracle (``ScoreWorkload.check``: 2 requests of 300
   decode tokens, partial tiles included, within ``CHECK_TOLERANCE`` x the largest |score|);
2. per batch, builds one cache of ``width`` decode tokens (every scored layer, pages scattered),
   times every variant on it (median of 10 after 2 warm-ups) and compares its scores with the
   family's shipped configuration's on the same cache: ``bit_identical`` (expected: the
   accumulation order of a token is the same in every variant) and the largest difference over the
   largest |score|.
Ratio = (K bytes the kernel must read + score bytes written) / time / copy ceiling, as ``kvgen bench``.

Never fails fast: a worker that dies (a sticky CUDA error) is restarted on the variants it had not
reached, the one it was on recorded as crashed. Writes ``DIR/records.jsonl`` (one line per event)
and ``DIR/score_variants.json`` (everything, with the table printed at the end).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ARCHIVE = "score-variants.tar.xz"


def unpack(bundle_dir: Path, dest: Path) -> Path:
    """The bundle's directory of libraries (``bundle.json``): ``bundle_dir`` itself or its archive unpacked."""
    if (bundle_dir / "bundle.json").is_file():
        return bundle_dir
    archive = bundle_dir / ARCHIVE
    if not archive.is_file():
        raise SystemExit(f"{bundle_dir}: neither bundle.json nor {ARCHIVE} (build it with score_variants_bundle.py)")
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(archive, "r:xz") as tar:
        tar.extractall(dest, filter="data")
    return dest


def emit(records: Path, **record) -> None:
    with records.open("a", encoding="utf-8") as out:
        out.write(json.dumps(record) + "\n")


# ---------------------------------------------------------------- worker (one family)


def exit_if_context_lost() -> None:
    """After a failed launch: a sticky CUDA error leaves this process unable to run anything, so
    end it (the parent restarts a worker without the variant it was on) rather than blame the
    variants after it."""
    import os

    import torch

    try:
        (torch.ones(1, device="cuda") + 1).item()
    except Exception:  # noqa: BLE001
        os._exit(3)


def done_events(records: Path, family: str) -> set:
    """``(event, config, batch)`` of the checks and timings already recorded for ``family``."""
    if not records.exists():
        return set()
    events = [json.loads(x) for x in records.read_text().splitlines()]
    return {(r["event"], r["config"], r.get("batch")) for r in events
            if r.get("family") == family and r["event"] in ("check", "time")}


def worker(bundle: Path, family: str, configs: list[str], batches: list[int], width: int, copy_gbps: float,
           records: Path) -> int:
    import torch

    from kvgen.bench.score import k_bytes_read, score_family
    from kvgen.measure.timing import time_ms
    from kvgen.measure.workloads.base import Failure
    from kvgen.measure.workloads.score import ScoreCache, ScoreWorkload
    from kvgen.runtime.score import ScoreLibrary
    from kvgen.tuning.candidates import read_index

    by_config = {c.config: c for c in read_index(bundle) if c.family == family}
    _, scoring = score_family(family)
    workload = ScoreWorkload(scoring)
    done = done_events(records, family)   # what a previous worker of this family recorded
    libs = {}
    for config in configs:
        try:
            lib = ScoreLibrary(bundle / by_config[config].artifact, family=family)
        except Exception as exc:  # noqa: BLE001 - recorded, the others go on
            emit(records, event="check", family=family, config=config, ok=False, error=f"load: {exc}")
            continue
        libs[config] = lib   # wrong scores are still timed (and flagged)
        if ("check", config, None) in done:
            continue
        emit(records, event="start", family=family, config=config, stage="check")
        try:
            workload.check(lib, seed=1)
            emit(records, event="check", family=family, config=config, ok=True, geometry=lib.geometry)
        except Failure as exc:
            emit(records, event="check", family=family, config=config, ok=False, error=f"{exc.kind}: {exc.detail}")
            exit_if_context_lost()
        except Exception as exc:  # noqa: BLE001 - not a verdict on the scores: not timed either
            emit(records, event="check", family=family, config=config, ok=False,
                 error=f"{type(exc).__name__}: {exc}")
            del libs[config]
    for batch in batches:
        cache = ScoreCache(scoring, batch, width)
        g = cache.geometry
        inputs = cache.kernel_inputs()
        elem = cache.k_pools[g.scored_layers[0]].element_size()
        score_bytes = inputs["scores"].numel() * 4
        reference = None
        for config in configs:
            if config not in libs:
                continue
            lib = libs[config]
            if ("time", config, batch) in done:
                if reference is None:   # the reference's scores again (not re-recorded)
                    lib.score(**inputs)
                    reference = inputs["scores"].clone()
                continue
            emit(records, event="start", family=family, config=config, stage=f"time B={batch}")
            try:
                inputs["scores"].fill_(float("nan"))
                t = time_ms(lambda lib=lib: lib.score(**inputs), reps=10, warmup=2)
            except Exception as exc:  # noqa: BLE001
                emit(records, event="time", family=family, config=config, batch=batch,
                     error=f"{type(exc).__name__}: {exc}")
                exit_if_context_lost()
                continue
            k_bytes = k_bytes_read(g, batch, width, elem)
            gbps = (k_bytes + score_bytes) / t["median_ms"] / 1e6
            record = {"event": "time", "family": family, "config": config, "batch": batch, "width": width,
                      "median_ms": t["median_ms"], "min_ms": t.get("min_ms"), "k_bytes": k_bytes,
                      "score_bytes": score_bytes, "gbps": gbps, "fraction_of_copy": gbps / copy_gbps}
            if reference is None:
                reference = inputs["scores"].clone()
                record["reference"] = True
            else:
                scale = reference.abs().max().clamp(min=1e-30)
                record["bit_identical"] = bool(torch.equal(inputs["scores"], reference))
                record["max_abs_diff_over_max_abs"] = float((inputs["scores"] - reference).abs().max() / scale)
            emit(records, **record)
            print(f"{family:20s} B={batch:3d} {config}: {t['median_ms']:.3f} ms = {record['fraction_of_copy']:.3f}"
                  f" of copy", flush=True)
        cache = inputs = reference = None   # free the cache before the next batch
        torch.cuda.empty_cache()
    emit(records, event="done", family=family)
    return 0


# ---------------------------------------------------------------- parent


def run_family(bundle: Path, family: str, configs: list[str], args, copy_gbps: float, records: Path) -> None:
    """Worker processes until every config of ``family`` was reached: after a crash, a new worker
    goes on without the variant it was on (what the others recorded is kept)."""
    remaining = list(configs)
    while remaining:
        before = records.read_text().count("\n") if records.exists() else 0
        cmd = [sys.executable, __file__, "--worker", family, str(bundle), "--out", str(args.out),
               "--copy-gbps", str(copy_gbps), "--width", str(args.width), "--configs", ";".join(remaining),
               *[x for b in args.batch for x in ("--batch", str(b))]]
        try:
            proc = subprocess.run(cmd, timeout=args.family_timeout)
            code = proc.returncode
        except subprocess.TimeoutExpired:
            code = "timeout"
        lines = [json.loads(x) for x in records.read_text().splitlines()[before:]] if records.exists() else []
        if any(r.get("event") == "done" for r in lines):
            return
        starts = [r for r in lines if r.get("event") == "start"]
        if not starts:
            emit(records, event="crash", family=family, config=None, exit=code, skipped=remaining)
            return
        last = starts[-1]
        emit(records, event="crash", family=family, config=last["config"], stage=last["stage"], exit=code)
        remaining.remove(last["config"])


def summarize(records: Path, shipped: dict, ceilings: dict, out: Path) -> dict:
    events = [json.loads(x) for x in records.read_text().splitlines()]
    result = {"ceilings": ceilings, "shipped": shipped, "families": {}}
    for r in events:
        fam = result["families"].setdefault(r["family"], {}) if r.get("family") else None
        if fam is None or not r.get("config"):
            continue
        v = fam.setdefault(r["config"], {"shipped": r["config"] == shipped.get(r["family"]), "times": {}})
        if r["event"] == "check":
            v["oracle_ok"] = r["ok"]
            v["oracle_error"] = r.get("error")
            v["geometry"] = r.get("geometry")
        elif r["event"] == "time":
            v["times"][f"B{r['batch']}"] = {k: r.get(k) for k in ("median_ms", "min_ms", "gbps", "fraction_of_copy",
                                                                  "bit_identical", "max_abs_diff_over_max_abs",
                                                                  "error", "k_bytes", "score_bytes")}
        elif r["event"] == "crash":
            v["crashed"] = r.get("stage")
    (out / "score_variants.json").write_text(json.dumps(result, indent=1) + "\n")
    print(f"\ncopy ceiling {ceilings['device_copy']['gbps_read_plus_write']:.0f} GB/s; fraction of copy per batch")
    for family, variants in result["families"].items():
        for config, v in variants.items():
            ratios = "  ".join(f"{b}={t['fraction_of_copy']:.3f}" if t.get("fraction_of_copy") is not None else f"{b}=error"
                               for b, t in v["times"].items())
            flags = ("shipped " if v["shipped"] else "") + ("" if v.get("oracle_ok") else "ORACLE-FAIL ") + \
                ("" if all(t.get("bit_identical") is not False for t in v["times"].values()) else "NOT-BIT-IDENTICAL ") + \
                (f"CRASHED({v['crashed']}) " if v.get("crashed") else "")
            print(f"{family:20s} {config:95s} {ratios}  {flags}")
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bundle", type=Path, help="directory with score-variants.tar.xz (or an unpacked bundle)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--width", type=int, default=16384)
    parser.add_argument("--batch", type=int, action="append", help="default: 1 and 32")
    parser.add_argument("--family", action="append", help="default: every family in the bundle")
    parser.add_argument("--family-timeout", type=float, default=150)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--configs", help=argparse.SUPPRESS)
    parser.add_argument("--copy-gbps", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.batch = args.batch or [1, 32]
    sys.path.insert(0, str(ROOT))
    args.out.mkdir(parents=True, exist_ok=True)
    records = args.out / "records.jsonl"
    if args.worker:
        return worker(args.bundle, args.worker, args.configs.split(";"), args.batch, args.width, args.copy_gbps,
                      records)

    import torch

    from kvgen.measure.timing import measure_ceilings
    from kvgen.tuning.candidates import read_index

    start = time.perf_counter()
    bundle = unpack(args.bundle, Path(tempfile.mkdtemp(prefix="kvgen-score-variants-")))
    shipped = json.loads((bundle / "variants.json").read_text())["shipped"]
    candidates = [c for c in read_index(bundle) if c.status != "failed" and c.artifact]
    ceilings = measure_ceilings(pinned=False)
    torch.cuda.empty_cache()
    copy_gbps = ceilings["device_copy"]["gbps_read_plus_write"]
    print(f"copy ceiling: {copy_gbps:.0f} GB/s (read + write)", flush=True)
    for family in args.family or list(dict.fromkeys(c.family for c in candidates)):
        configs = [c.config for c in candidates if c.family == family]
        configs.sort(key=lambda config: config != shipped.get(family))   # the shipped one first: the reference
        run_family(bundle, family, configs, args, copy_gbps, records)
    summarize(records, shipped, ceilings, args.out)
    print(f"wrote {args.out / 'score_variants.json'} ({time.perf_counter() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
