"""Argument parsing of ``kvgen bench`` / ``python -m kvgen.bench``. Plain ``print`` only: the GPU
machine has neither rich nor matplotlib unless installed (the report is skipped without it)."""

from __future__ import annotations

import argparse
import sys
import traceback
from pathlib import Path

from kvgen import paths
from kvgen.bench import suite

DEFAULT_FAMILIES = "qwen3-8b,qwen3-8b-fp8,deepseek-v3,deepseek-v4-csa"


def _csv(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench_command", required=True, metavar="{run,report,merge}")

    p = sub.add_parser("run", help="every kernel benchmark in one process, ceilings measured once; bench.json "
                                   "and the report", description=suite.__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=None, help="output directory (default: $OUT, else "
                                                          "results/bench-<date>)")
    p.add_argument("--registry", type=Path, default=paths.registry_dir(),
                   help="registry under test (default: build/registry)")
    p.add_argument("--default-registry", type=Path, default=None,
                   help="registry built with the default parameters: time both, record tuned_vs_default")
    p.add_argument("--arch", default="sm_90a")
    p.add_argument("--only", default=",".join(("codec", "compact", "score", "round", "interference")),
                   help="comma list of codec, compact, score, round, interference (default: all, in that order)")
    p.add_argument("--families", default=DEFAULT_FAMILIES, help="codec families")
    p.add_argument("--hot-gib", type=float, default=1.2, help="codec: GiB of hot pages per family")
    p.add_argument("--compact-family", default="qwen3-8b")
    p.add_argument("--batches", default="1,32,256", help="compaction batch sizes")
    p.add_argument("--mode", default="union", choices=("union", "per_head", "per_layer_perhead"),
                   help="eviction mode of the compaction and round benchmarks")
    p.add_argument("--width", type=int, default=16384, help="scorer: decode tokens scored per request")
    p.add_argument("--score-batch", type=int, default=32)
    p.add_argument("--score-variants", type=Path, nargs="*", default=None,
                   help="more registries holding score-library variants (default: build/registry-score-*)")
    p.add_argument("--no-peers", action="store_true", help="skip the oracle eager / torch.compile peers")
    p.add_argument("--no-round", action="store_true", help="skip the whole eviction round")
    p.add_argument("--tuning", type=Path, default=paths.tuning_dir(),
                   help="tuning records for the report's table of tuned configurations (default: tuning/)")
    p.add_argument("--no-report", action="store_true", help="write bench.json only")
    p.set_defaults(bench_func=cmd_run)

    p = sub.add_parser("report", help="report.md and PNG plots from DIR/bench.json (needs matplotlib)")
    p.add_argument("dir", type=Path)
    p.add_argument("--tuning", type=Path, default=paths.tuning_dir(),
                   help="tuning records (tuning/<arch>/<family>.json; default: tuning/)")
    p.set_defaults(bench_func=cmd_report)

    p = sub.add_parser("merge", help="merge the per-benchmark JSON of an older recorded run (bench_codec.json, "
                                     "bench_compact.json, bench_score.json) into OUT/bench.json, then report")
    p.add_argument("src", type=Path)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--tuning", type=Path, default=paths.tuning_dir())
    p.add_argument("--no-report", action="store_true")
    p.set_defaults(bench_func=cmd_merge)


def run(args: argparse.Namespace) -> int:
    return args.bench_func(args)


def cmd_run(args: argparse.Namespace) -> int:
    try:
        import torch
    except ImportError as exc:
        print(f"error: kvgen bench run needs a CUDA GPU and torch built for it (cannot import torch: {exc})",
              file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print(f"error: kvgen bench run needs a CUDA GPU: torch {torch.__version__} sees none", file=sys.stderr)
        return 2
    from kvgen.bench.suite import BENCHMARKS, Options, run_suite
    from kvgen.measure.timing import NoGpu

    only = tuple(_csv(args.only))
    unknown = [name for name in only if name not in BENCHMARKS]
    if unknown:
        print(f"error: --only: unknown benchmark {', '.join(unknown)} (accepted: {', '.join(BENCHMARKS)})",
              file=sys.stderr)
        return 2
    variants = args.score_variants if args.score_variants is not None else paths.score_variant_registries()
    options = Options(out=paths.run_dir("bench", args.out), registry=args.registry, arch=args.arch,
                      default_registry=args.default_registry, only=only,
                      families=tuple(_csv(args.families)), hot_gib=args.hot_gib, compact_family=args.compact_family,
                      batches=tuple(int(b) for b in _csv(args.batches)), mode=args.mode, width=args.width,
                      score_batch=args.score_batch, score_variants=tuple(variants), peers=not args.no_peers,
                      round=not args.no_round, argv=sys.argv[1:],
                      specs=getattr(args, "specs", None))   # kvgen --specs DIR
    try:
        doc = run_suite(options)
    except NoGpu as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    rc = 1 if doc["errors"] else 0
    if doc["errors"]:
        print(f"failed: {', '.join(doc['errors'])} (tracebacks in bench.json 'errors')", file=sys.stderr)
    if not args.no_report:
        rc = max(rc, _report(options.out, args.tuning))
    return rc


def _report(directory: Path, tuning: Path | None) -> int:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print(f"report skipped: matplotlib is not installed here; elsewhere run: "
              f"python -m kvgen.bench report {directory}", flush=True)
        return 0
    from kvgen.bench.report import write_report

    try:
        path = write_report(directory, tuning)
    except Exception:  # noqa: BLE001 - the measurements are on disk; say what broke
        traceback.print_exc()
        return 1
    print(f"wrote {path}", flush=True)
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    if not (args.dir / "bench.json").is_file():
        print(f"error: {args.dir / 'bench.json'}: no such file (kvgen bench run --out {args.dir} writes it; "
              f"kvgen bench merge turns an older recorded run into one)", file=sys.stderr)
        return 2
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("error: the report needs matplotlib: pip install 'kvgen[report]'", file=sys.stderr)
        return 2
    return _report(args.dir, args.tuning)


def cmd_merge(args: argparse.Namespace) -> int:
    from kvgen.bench.report import merge_recorded
    from kvgen.bench.suite import RESULT, write_json

    try:
        doc = merge_recorded(args.src)
    except FileNotFoundError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    write_json(args.out / RESULT, doc)
    print(f"wrote {args.out / RESULT} (from {', '.join(doc['merged_from'])})")
    return 0 if args.no_report else _report(args.out, args.tuning)
