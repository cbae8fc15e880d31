"""GPU side of tuning: prove each candidate correct on fresh random inputs, then time it per bucket.

Runs where the GPU is; needs torch, the kvgen runtime and the specs (no optuna, no compiler). The
workloads (inputs per bucket, the oracle check, the timed call) are ``kvgen.measure.workloads``:

    python -m kvgen.tuning.measure BUNDLE(.tar.xz or directory) --out measurements.jsonl

One JSON line per (candidate, bucket): the configuration, ``status`` ("ok", or the failure kind:
"build", "load", "launch", "wrong", "crash", "timeout"), and for "ok" the median and quantiles of
CUDA-event times over ``reps`` calls after warm-up, inputs rotated over enough copies that the
calls touch at least 3x the L2 cache (a candidate is never timed on data a previous call left in
L2). Lines are appended as they are measured, so a killed run keeps everything it finished and a
rerun skips it.

Isolation: a wrong memory access poisons the CUDA context for the rest of the process, so the
candidates of one (family, op) run in a worker process; when it dies, the candidate it was on is
recorded as "crash" and a fresh worker continues with the next one.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tarfile
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

from kvgen import paths
from kvgen.measure.workloads import Failure, Workload, workload_class
from kvgen.tuning.candidates import Candidate, read_bundle, read_index, unpack_bundle
from kvgen.tuning.space import BUCKETS, parse_config

DEFAULT_REPS = 20
WORKER_SILENCE_S = 180        # a worker that writes nothing for this long is hung: killed, "timeout"


def record_key(record: dict[str, Any]) -> tuple:
    return record["family"], record["op"], record["arch"], record["config"], record["bucket"]


def numbered_records(path: Path) -> list[tuple[int, Any]]:
    """(1-based line, parsed JSON) of every line of a measurement file that parses; a torn last
    line from a killed run is not one."""
    if not Path(path).is_file():
        return []
    records = []
    for n, line in enumerate(Path(path).read_text(encoding="utf-8", errors="replace").splitlines(), 1):
        try:
            records.append((n, json.loads(line)))
        except (ValueError, RecursionError):
            continue
    return records


def read_records(path: Path) -> list[dict[str, Any]]:
    """Measurement lines of a file (a torn last line from a killed run is ignored)."""
    return [record for _, record in numbered_records(path)]


# ---------------------------------------------------------------------------------------------
# Worker: one (family, op), its candidates in order
# ---------------------------------------------------------------------------------------------


def workload_for(op: str, family: str, specs: Path | None = None) -> Workload:
    """The measurement workload of ``op`` for ``family``'s spec (in ``specs``, default: ``paths.specs_dir``)."""
    from kvgen.lower.layout import family_layout
    from kvgen.lower.triattention import rope_scaling, tri_geometry
    from kvgen.spec.schema import load_spec

    spec = load_spec(paths.spec_path(family, specs))
    workload = workload_class(op)
    if op == "codec":
        return workload(family_layout(spec), spec.dtype)
    if op == "compact":
        return workload(tri_geometry(spec), spec.dtype)
    if op == "select":
        return workload(spec.name, tri_geometry(spec))
    from kvgen.measure.workloads.score import ScoreFamily

    return workload(ScoreFamily(spec.name, tri_geometry(spec), spec.dtype, spec.rope.theta, rope_scaling(spec)))


def worker(bundle: Path, family: str, op: str, configs: list[str], out: Path, reps: int, seed: int,
           specs: Path | None = None) -> int:
    index = read_bundle(bundle)
    candidates = {c["config"]: Candidate(**c) for c in index["candidates"] if (c["family"], c["op"]) == (family, op)}
    buckets = BUCKETS[op]
    workload = workload_for(op, family, specs)
    inputs = {b.name: workload.inputs(b.size, seed) for b in buckets}
    env = {**environment(), "toolchain": index.get("toolchains", {})}
    with open(out, "a", encoding="utf-8") as sink:
        for n, config in enumerate(configs):
            c = candidates[config]
            rows = measure_candidate(workload, inputs, bundle, c, buckets, reps, seed + 1 + n)
            for row in rows:
                sink.write(json.dumps({**row, "environment": env}) + "\n")
            sink.flush()
    return 0


def measure_candidate(workload: Workload, inputs: dict[str, Any], bundle: Path, c: Candidate, buckets, reps: int,
                      seed: int) -> list[dict[str, Any]]:
    """Load, check against the oracle, then time every bucket: one record per bucket (a failure
    is a record of its kind, never an exception)."""
    base = {"family": c.family, "op": c.op, "arch": c.arch, "config": c.config, "params": c.params}
    try:
        if c.status == "failed":
            raise Failure("build", c.error.splitlines()[0] if c.error else "build failed")
        library = workload.load(bundle / c.artifact)
        workload.check(library, seed)
    except Failure as failure:
        return [{**base, "bucket": b.name, "status": failure.kind, "failure": failure.detail[:500]} for b in buckets]
    except Exception:  # noqa: BLE001 - a harness error is recorded (same for every candidate: visible)
        detail = traceback.format_exc()[-500:]
        return [{**base, "bucket": b.name, "status": "error", "failure": detail} for b in buckets]
    rows = []
    for b in buckets:
        try:
            rows.append({**base, "bucket": b.name, "status": "ok", "reps": reps, "size": inputs[b.name].size,
                         **workload.time(library, inputs[b.name], reps)})
        except Failure as failure:
            rows.append({**base, "bucket": b.name, "status": failure.kind, "failure": failure.detail[:500]})
    return rows


def environment() -> dict[str, str]:
    """What a tuned configuration is valid for (compared by ``kvgen.lower.tuned``)."""
    import torch

    from kvgen import __version__
    from kvgen.measure.environment import environment as run_environment

    env = run_environment()
    return {"gpu": env["gpu"], "compute_capability": env["compute_capability"], "driver": env["driver"],
            "cuda_runtime": env["cuda_runtime"], "torch": torch.__version__, "kvgen": __version__}



# Parent: every (family, op) of a bundle, workers restarted past crashes
# ---------------------------------------------------------------------------------------------


def measure_bundle(bundle: Path, out: Path, *, families: set[str] | None = None, ops: set[str] | None = None,
                   reps: int = DEFAULT_REPS, seed: int = 0, specs: Path | None = None,
                   log: Callable[[str], None] = print) -> Path:
    """Measure every candidate of ``bundle`` not yet in ``out``; workers read their specs from
    ``specs`` (default: ``paths.specs_dir()``), passed to them as an argument."""
    done = {record_key(r) for r in read_records(out)}
    groups: dict[tuple[str, str, str], list[str]] = {}
    for c in read_index(bundle):
        if (families and c.family not in families) or (ops and c.op not in ops):
            continue
        if all((c.family, c.op, c.arch, c.config, b.name) in done for b in BUCKETS[c.op]):
            continue
        groups.setdefault((c.family, c.op, c.arch), []).append(c.config)
    for (family, op, arch), configs in groups.items():
        start = time.perf_counter()
        _run_group(bundle, family, op, arch, configs, out, reps, seed, specs, log)
        log(f"{family} {op}: {len(configs)} candidates in {time.perf_counter() - start:.1f} s")
    return out


def _run_group(bundle: Path, family: str, op: str, arch: str, configs: list[str], out: Path, reps: int, seed: int,
               specs: Path | None, log: Callable[[str], None]) -> None:
    todo = list(configs)
    specs_args = ["--specs", str(Path(specs).resolve())] if specs is not None else []
    while todo:
        cmd = [sys.executable, "-m", "kvgen.tuning.measure", "--worker", str(bundle), "--family", family,
               "--op", op, "--configs", ";".join(todo), "--out", str(out), "--reps", str(reps), "--seed", str(seed),
               *specs_args]
        status, stderr = _supervise(cmd, out)
        finished = {r["config"] for r in read_records(out) if r["family"] == family and r["op"] == op}
        todo = [c for c in todo if c not in finished]
        if status == 0 or not todo:
            if todo:
                log(f"{family} {op}: worker exited without measuring {len(todo)} candidates")
            return
        culprit = todo.pop(0)
        kind = "timeout" if status is None else "crash"
        log(f"{family} {op} {culprit}: {kind}; {stderr.strip().splitlines()[-1] if stderr.strip() else ''}")
        with open(out, "a", encoding="utf-8") as sink:
            for b in BUCKETS[op]:
                sink.write(json.dumps({"family": family, "op": op, "arch": arch, "config": culprit, "bucket": b.name,
                                       "params": parse_config(culprit), "status": kind,
                                       "failure": stderr.strip()[-500:]}) + "\n")


def _supervise(cmd: list[str], out: Path) -> tuple[int | None, str]:
    """Run a worker; kill it when ``out`` stops growing for WORKER_SILENCE_S (status None)."""
    with tempfile.TemporaryFile(mode="w+") as err:
        proc = subprocess.Popen(cmd, stderr=err, env=paths.child_environ(PYTHONUNBUFFERED="1"))
        size, last = -1, time.monotonic()
        while proc.poll() is None:
            time.sleep(0.5)
            now_size = out.stat().st_size if out.exists() else 0
            if now_size != size:
                size, last = now_size, time.monotonic()
            elif time.monotonic() - last > WORKER_SILENCE_S:
                proc.kill()
                proc.wait()
                err.seek(0)
                return None, err.read()
        err.seek(0)
        return proc.returncode, err.read()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("bundle", type=Path, help="candidate bundle: a directory or its .tar.xz")
    parser.add_argument("--out", type=Path, required=True, help="measurements (JSON lines, appended)")
    parser.add_argument("--families", default="", help="comma-separated (default: all in the bundle)")
    parser.add_argument("--ops", default="", help="comma-separated (default: all in the bundle)")
    parser.add_argument("--reps", type=int, default=DEFAULT_REPS)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--specs", type=Path, default=None, help="spec directory (default: $KVGEN_SPECS_DIR, "
                                                                 "else ./specs)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--family", help=argparse.SUPPRESS)
    parser.add_argument("--op", help=argparse.SUPPRESS)
    parser.add_argument("--configs", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args.bundle, args.family, args.op, args.configs.split(";"), args.out, args.reps, args.seed,
                      args.specs)
    import torch

    if not torch.cuda.is_available():
        print("kvgen.tuning.measure needs a CUDA GPU (build candidates anywhere, measure them on the GPU machine)",
              file=sys.stderr)
        return 2
    bundle = args.bundle
    split = lambda s: {x for x in s.split(",") if x}  # noqa: E731
    try:
        if bundle.is_file():
            bundle = unpack_bundle(bundle, Path(tempfile.mkdtemp(prefix="kvgen-bundle-")))
        measure_bundle(bundle, args.out, families=split(args.families) or None, ops=split(args.ops) or None,
                       reps=args.reps, seed=args.seed, specs=args.specs)
    except (OSError, ValueError, tarfile.TarError) as exc:
        print(f"error: {args.bundle}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
