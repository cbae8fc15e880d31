"""``kvgen tune``: build candidates, search them, write the winners to ``tuning/``.

Three ways to run, one search:

    kvgen tune --family qwen3-8b --op codec --arch sm_90a --build-only --bundle build/tune/b
        # here, no GPU: every canonical candidate built -> build/tune/b + build/tune/b.tar.xz
    python -m kvgen.tuning.measure build/tune/b.tar.xz --out m.jsonl
        # on the GPU machine: correctness-gated measurements, one line per (candidate, bucket)
    kvgen tune --family qwen3-8b --op codec --arch sm_90a --measurements m.jsonl --strategy tpe --trials 8
        # anywhere: the optuna studies over the measurements -> tuning/sm_90a/qwen3-8b.json

    kvgen tune --family qwen3-8b --op codec --arch sm_90a --trials 8
        # one machine with a GPU and nvcc: each trial builds and measures its candidate
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvgen.artifacts.dispatch import bucket_work
from kvgen.lower.plan import Op, default_params
from kvgen.lower.tuned import CHOICE_MARGIN, VARIANT_OPS, build_choice, model_entry, model_offset, write_op
from kvgen.tuning.space import (
    BUCKETS,
    STRATEGIES,
    TUNED_OPS,
    canonical,
    check_fixed,
    config_id,
    configurations,
    dispatch_variants,
    fixed_for,
    ops_for,
    parse_config,
)

if TYPE_CHECKING:
    from kvgen.tuning.study import BucketResult, Measurement, RecordedEvaluator

# kvgen.tuning.study (optuna, the [tune] extra) is imported where a search runs, so that building
# the `kvgen tune` parser -- part of every `kvgen` command -- works on a base install.


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--family", action="append", help="family (repeatable, comma-separated; default: every spec)")
    p.add_argument("--op", action="append", help=f"op(s) to tune, repeatable or comma-separated (default: every "
                                                 f"op the family has: {', '.join(TUNED_OPS)})")
    p.add_argument("--arch", default="sm_90a", help="target arch (default: sm_90a)")
    p.add_argument("--bucket", action="append", help="size bucket(s), repeatable (default: all of the op's)")
    p.add_argument("--strategy", choices=STRATEGIES, default="tpe", help="sampler (default: tpe)")
    p.add_argument("--trials", type=int, default=None,
                   help="finished trials per study in total (default: the number of distinct configurations; "
                        "grid: the whole grid); rerunning resumes up to it")
    p.add_argument("--storage", default=None, help="optuna storage URL (default: sqlite in the cache dir; "
                                                   "postgresql://... to share studies between workers)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--measurements", type=Path, action="append",
                   help="search recorded measurements (kvgen.tuning.measure output) instead of measuring here")
    p.add_argument("--build-only", action="store_true", help="build every candidate into --bundle; no search")
    p.add_argument("--bundle", type=Path, default=Path("build/tune/bundle"),
                   help="candidate bundle directory (default: build/tune/bundle; packed beside it as .tar.xz)")
    p.add_argument("--tuning", type=Path, default=Path("tuning"), help="tuned-config directory (default: tuning)")
    p.add_argument("--no-write", action="store_true", help="search and report, write nothing to --tuning")
    p.add_argument("--model", action="store_true",
                   help="no GPU: pick with the static cost model (kvgen.tuning.costmodel) and write model-tuned "
                        "entries; refused for an op whose model failed its H200 validation (--validation)")
    p.add_argument("--validation", type=Path, default=Path("docs/tuning-evidence/costmodel-validation.json"),
                   help="the cost model's H200 validation (--model)")
    p.add_argument("--fix", default="", help="name=value,... held fixed: the searched subspace (every mode; the "
                                             "default is still measured, the baseline)")


def default_storage(cache_dir: Path) -> str:
    path = Path(cache_dir) / "tuning" / "studies.sqlite3"
    path.parent.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{path}"


def requests_for(sources, ops: list[Op] | None, fixed: dict[str, int] | None = None) -> list:
    from kvgen.tuning.candidates import Request

    return [Request(s, op, params) for s in sources for op in (ops or ops_for(s.spec)) if op in ops_for(s.spec)
            for params in configurations(op, s.spec, fixed_for(op, fixed or {}))]


# ---------------------------------------------------------------------------------------------
# One-machine mode
# ---------------------------------------------------------------------------------------------


class LiveEvaluator:
    """Builds a candidate when a trial first needs it and measures all its buckets at once
    (a worker process per batch, as ``kvgen.tuning.measure`` does)."""

    def __init__(self, sources, arch: str, work_dir: Path, cache_dir: Path, toolchains, reps: int = 20):
        self.sources = {s.spec.name: s for s in sources}
        self.arch = arch
        self.bundle = work_dir / "bundle"
        self.out = work_dir / "measurements.jsonl"
        self.cache_dir = cache_dir
        self.toolchains = toolchains
        self.reps = reps
        self.recorded: RecordedEvaluator | None = None   # re-read only after a measurement

    def __call__(self, family: str, op: Op, arch: str, bucket: str, params) -> Measurement:
        found = self._recorded(family, op, bucket, params)
        if found.status == "missing":
            from kvgen.tuning.candidates import Request, build_candidates
            from kvgen.tuning.measure import measure_bundle
            from kvgen.tuning.study import RecordedEvaluator

            build_candidates([Request(self.sources[family], op, dict(params))], arch, self.bundle, self.cache_dir,
                             toolchains=self.toolchains, jobs=1)
            source = self.sources[family]   # the worker reads the spec this candidate was built from
            specs = source.path.parent if source.path is not None else None
            measure_bundle(self.bundle, self.out, families={family}, ops={op}, reps=self.reps, specs=specs,
                           log=lambda _m: None)
            if self.out.exists():
                self.recorded = RecordedEvaluator([self.out])
            found = self._recorded(family, op, bucket, params)
        return found

    def environment(self, family: str, op: Op, arch: str) -> dict[str, Any]:
        return self.recorded.environment(family, op, arch) if self.recorded else {}

    def _recorded(self, family, op, bucket, params) -> Measurement:
        from kvgen.tuning.study import Measurement

        if self.recorded is None:
            return Measurement("missing", detail="the measurement worker recorded nothing")
        return self.recorded(family, op, self.arch, bucket, params)


# ---------------------------------------------------------------------------------------------
# The command
# ---------------------------------------------------------------------------------------------


def run(args: argparse.Namespace, sources, console, cache_dir: Path, discover_toolchains) -> int:
    from kvgen.tuning.study import RecordedEvaluator, StorageError

    ops: list[Op] | None = [o.strip() for v in args.op for o in v.split(",") if o.strip()] if args.op else None
    for op in ops or []:
        if op not in TUNED_OPS:
            _error(console, f"--op {op}: accepted: {', '.join(TUNED_OPS)}")
            return 2
    if args.trials is not None and args.trials < 1:
        _error(console, f"--trials {args.trials}: a study needs at least 1 trial")
        return 2
    try:
        args.fixed = parse_config(args.fix) if args.fix else {}
    except ValueError:
        _error(console, f"--fix {args.fix!r}: expected name=value,name=value (integers)")
        return 2
    try:
        check_fixed(ops or list(TUNED_OPS), args.fixed)
    except ValueError as exc:
        _error(console, str(exc))
        return 2
    if args.build_only:
        return _build_only(args, sources, ops, console, cache_dir, discover_toolchains())
    if args.model:
        return _model_tune(args, sources, ops, console, discover_toolchains())
    if args.measurements:
        try:
            evaluator = RecordedEvaluator(args.measurements)
        except (OSError, ValueError) as exc:
            _error(console, str(exc))
            return 1
        for problem in evaluator.problems:
            console.print(f"warning: {problem}", markup=False, highlight=False, soft_wrap=True)
    else:
        import torch

        if not torch.cuda.is_available():
            _error(console, "no CUDA GPU here: build candidates with --build-only, measure them on the GPU machine "
                            "(python -m kvgen.tuning.measure BUNDLE --out m.jsonl), then search them with "
                            "--measurements m.jsonl")
            return 2
        work = Path(tempfile.mkdtemp(prefix="kvgen-tune-"))
        evaluator = LiveEvaluator(sources, args.arch, work, cache_dir, discover_toolchains())
    storage = args.storage or default_storage(cache_dir)
    results: list[tuple[str, Op, BucketResult, str]] = []
    written: dict[Path, list[str]] = {}
    try:
        for source in sources:
            spec = source.spec
            for op in [o for o in (ops or ops_for(spec)) if o in ops_for(spec)]:
                per_bucket = _tune_op(args, spec, op, evaluator, storage, console)
                choice, path = _write(args, spec, op, per_bucket, evaluator)
                results += [(spec.name, op, r, choice) for r in per_bucket]
                if path is not None:
                    written.setdefault(path, []).append(op)
    except StorageError as exc:
        _error(console, str(exc))
        return 2
    console.print(summary_table(results))
    _print_written(console, written, args)
    return 0 if all(r.best is not None for _, _, r, _ in results) else 1


def _print_written(console, written: dict[Path, list[str]], args) -> None:
    """Where the tuned configurations went (the build reads them from there)."""
    from rich.text import Text

    for path, ops in sorted(written.items()):
        console.print(Text(f"wrote {path} ({', '.join(ops)})"), soft_wrap=True)
    if args.no_write:
        console.print(Text(f"--no-write: nothing written to {args.tuning}"))
    elif not written:
        console.print(Text(f"nothing written to {args.tuning}: no op had a best configuration in every bucket"))


def _line(text: str) -> None:
    """Progress without a TTY: one plain line, flushed at once (a log shows where a run is)."""
    print(text, file=sys.stderr, flush=True)


def _error(console, text: str) -> None:
    """Plain text: paths and exception messages hold brackets that rich would read as markup."""
    console.print(f"error: {text}", markup=False, highlight=False, soft_wrap=True)


def _tune_op(args, spec, op: Op, evaluator, storage: str, console) -> list[BucketResult]:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from kvgen.tuning.study import run_bucket

    names = args.bucket or [b.name for b in BUCKETS[op]]
    fixed = fixed_for(op, args.fixed)
    out = []
    for name in names:
        total = args.trials or len(configurations(op, spec, fixed))
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=console, transient=True, disable=not console.is_terminal) as bar:
            task = bar.add_task(f"{spec.name} {op} {args.arch} {name} ({args.strategy})", total=total)

            def advance(trial, task=task, bar=bar) -> None:
                best = f"{trial.value:.4f} ms" if trial.value is not None else trial.user_attrs.get("failure", "failed")
                bar.update(task, advance=1, description=f"{spec.name} {op} {name}: trial {trial.number} "
                                                        f"{trial.user_attrs.get('config', '')} -> {best}")

            out.append(run_bucket(spec, op, args.arch, name, evaluator, strategy=args.strategy, trials=args.trials,
                                  storage=storage, seed=args.seed, on_trial=advance, fixed=fixed))
        if not console.is_terminal:
            r = out[-1]
            speedup = "" if math.isnan(r.speedup) else f", {r.speedup:.3f}x the default"
            best = f"best {config_id(op, r.best)} {_ms(r.best_ms)} ms{speedup}" if r.best else "no correct configuration"
            _line(f"{spec.name} {op} {args.arch} {name}: {r.trials} trials ({r.failed} failed), {best}")
    return out


def _write(args, spec, op: Op, per_bucket: list[BucketResult], evaluator) -> tuple[str, Path | None]:
    """The config the build will compile (printed either way), written unless --no-write, and
    the file it went to (None: not written)."""
    default = config_id(op, canonical(op, default_params(op), spec))
    choice = build_choice({r.bucket: r.measured for r in per_bucket}, default,
                          {r.bucket: r.spread for r in per_bucket})
    if args.no_write or any(r.best is None for r in per_bucket):
        return choice, None
    entry = {
        "params": parse_config(choice),
        "default": parse_config(default),
        "choice_margin": CHOICE_MARGIN,   # a bucket's gain below this (or its p80/p20) was a tie
        "buckets": {r.bucket: {"best": r.best, "best_ms": r.best_ms, "default_ms": r.default_ms,
                               "params_ms": r.measured.get(choice, math.nan), "speedup": r.speedup,
                               "trials": r.trials, "failed": r.failed, "failures": r.failures,
                               "strategy": r.strategy, "study": r.study} for r in per_bucket},
    }
    variants = _variants(op, per_bucket, choice)
    if variants:
        entry["variants"] = variants
    if fixed_for(op, args.fixed):   # a subspace search: say which parameters it did not search
        entry["fixed"] = fixed_for(op, args.fixed)
    model = model_entry(args.tuning, spec.name, args.arch, op)
    if model is not None:   # the measurement replaces the model's pick: record how far off it was
        entry["replaced_model"] = model_offset(model, {r.bucket: r.measured for r in per_bucket}, choice,
                                               config_id(op, canonical(op, model["params"], spec)))
    env = evaluator.environment(spec.name, op, args.arch)
    return choice, write_op(args.tuning, spec.name, args.arch, op, entry, env)


def _variants(op: Op, per_bucket: list[BucketResult], choice: str) -> list[dict[str, Any]]:
    """The size-dispatched variants of an op that owns its artifact (``dispatch_variants``), each
    with its bucket's measured time."""
    if op not in VARIANT_OPS:
        return []
    sizes = {b.name: b.size for b in BUCKETS[op]}
    measured = {r.bucket: r.measured for r in per_bucket}
    picks = dispatch_variants(measured, choice, {b: bucket_work(op, sizes[b]) for b in measured},
                              {r.bucket: r.spread for r in per_bucket})
    return [{"bucket": v["bucket"], "from_work": v["from_work"], "params": parse_config(v["config"]),
             "params_ms": measured[v["bucket"]][v["config"]]} for v in picks]


def summary_table(results):
    from rich.table import Table

    table = Table("family", "op", "bucket", "trials", "failed", "default ms", "best ms", "speed-up", "best",
                  "built", title="kvgen tune")
    for family, op, r, choice in results:
        table.add_row(family, op, r.bucket, str(r.trials), str(r.failed), _ms(r.default_ms), _ms(r.best_ms),
                      "-" if math.isnan(r.speedup) else f"{r.speedup:.3f}x",
                      config_id(op, r.best) if r.best else "-", choice)
    return table


def _ms(value: float) -> str:
    return "-" if value is None or math.isnan(value) else f"{value:.4f}"


def _build_only(args, sources, ops, console, cache_dir: Path, toolchains) -> int:
    from rich.progress import Progress

    from kvgen.tuning.candidates import build_candidates, pack_bundle

    requests = requests_for(sources, ops, args.fixed)
    done = []

    def line(c) -> None:
        done.append(c)
        _line(f"[{len(done)}/{len(requests)}] {c.family} {c.op} {args.arch} {c.config}: {c.status}")

    with Progress(console=console, transient=True, disable=not console.is_terminal) as bar:
        task = bar.add_task("building candidates", total=len(requests))
        on_done = (lambda c: bar.update(task, advance=1, description=f"{c.family} {c.op} {c.config}: {c.status}")
                   ) if console.is_terminal else line
        candidates = build_candidates(requests, args.arch, args.bundle, cache_dir, toolchains=toolchains,
                                      jobs=args.jobs, on_done=on_done)
    archive = pack_bundle(args.bundle, args.bundle.parent / f"{args.bundle.name}.tar.xz")  # a dotted name keeps its dots
    failed = [c for c in candidates if c.status == "failed"]
    console.print(f"{len(candidates)} candidates ({len(failed)} failed to build) in {args.bundle}; packed: {archive} "
                  f"({archive.stat().st_size / 2**20:.1f} MiB)")
    console.print(f"next, on the GPU machine: python -m kvgen.tuning.measure {archive} --out measurements.jsonl")
    return 0


def _model_tune(args, sources, ops, console, toolchains) -> int:
    """``--model``: the cost model's pick per (family, op), written as a model-tuned entry."""
    from kvgen.build.nvcc import toolchain_for
    from kvgen.tuning.costmodel.tune import CUDA_OPS, NotValidated, require_validated, tune

    unsupported = [op for op in ops or () if op not in CUDA_OPS]
    if unsupported:
        _error(console, f"--model: {', '.join(unsupported)} not model-tuned (the model compiles {', '.join(CUDA_OPS)})")
        return 2
    wanted = list(ops or CUDA_OPS)
    try:
        for op in wanted:
            require_validated(args.validation, op)
    except NotValidated as exc:
        _error(console, str(exc))
        return 1
    toolchain = toolchain_for(args.arch, toolchains)
    for source in sources:
        for op in [o for o in wanted if o in ops_for(source.spec)]:
            path = tune(source.spec, op, args.arch, toolchain.nvcc, toolchain.version, fixed_for(op, args.fixed),
                        args.tuning)
            _line(f"{source.spec.name} {op} {args.arch}: model-tuned -> {path}")
    return 0
