"""The ``kvgen`` command line. The only place that reads the environment and prints."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table
from rich.text import Text

from kvgen import paths
from kvgen.lower.layout import family_layout, to_json
from kvgen.spec.schema import FamilySpec, SpecError, load_spec

# Build-side modules (render, backends, cache, registry) are imported inside their verbs so that
# `kvgen validate` stays fast and works without them.

console = Console(highlight=False, width=None if sys.stdout.isatty() else 160)
err_console = Console(stderr=True, highlight=False)


def default_specs_dir() -> Path:
    """``$KVGEN_SPECS_DIR``, else ``./specs``, else the specs shipped beside the package."""
    return paths.specs_dir()


def spec_files(specs_dir: Path) -> list[Path]:
    return sorted(specs_dir.glob("*.yaml"))


def find_spec(name: str, specs_dir: Path) -> Path:
    """A family name or a path to a spec file."""
    as_path = Path(name)
    if as_path.suffix in (".yaml", ".yml") and as_path.exists():
        return as_path
    candidate = specs_dir / f"{name}.yaml"
    if candidate.exists():
        return candidate
    known = ", ".join(p.stem for p in spec_files(specs_dir)) or "none"
    raise SpecError(str(candidate), [_issue(f"no family {name!r} in {specs_dir}; known families: {known}")])


def _issue(message: str):
    from kvgen.spec.schema import SpecIssue

    return SpecIssue(line=1, key="(file)", message=message)


def load_all(paths: list[Path]) -> tuple[list[FamilySpec], list[SpecError]]:
    specs, errors = [], []
    for path in paths:
        try:
            specs.append(load_spec(path))
        except SpecError as exc:
            errors.append(exc)
    return specs, errors


# ---------------------------------------------------------------- verbs


def cmd_validate(args: argparse.Namespace) -> int:
    paths = [Path(p) for p in args.files] or spec_files(args.specs)
    if not paths:
        err_console.print(f"no spec files found in {args.specs}")
        return 2
    specs, errors = load_all(paths)
    for spec in specs:
        console.print(f"[green]ok[/green] {spec.name}")
    for exc in errors:
        err_console.print(f"[red]error[/red] {exc}", markup=True, soft_wrap=True)
    console.print(f"{len(specs)} valid, {len(errors)} invalid")
    return 1 if errors else 0


def cmd_list(args: argparse.Namespace) -> int:
    specs, errors = load_all(spec_files(args.specs))
    table = Table("family", "attention", "layers", "heads q/kv", "row", "dtype", "layout", "rope", "cold rope",
                  "tri", title=f"families in {args.specs}")
    for s in specs:
        table.add_row(s.name, s.attention, str(s.layers), f"{s.query_heads}/{s.kv_heads}", str(s.row_dim), s.dtype,
                      s.layout, f"{s.rope.placement} {s.rotary_dim} {s.rope.pairing}", s.cold_page.rope,
                      "yes" if s.triattention.enabled else "no")
    console.print(table)
    for exc in errors:
        err_console.print(f"[red]error[/red] {exc}", soft_wrap=True)
    return 1 if errors else 0


def _saving(cold: int, hot: int) -> str:
    return f"{(cold - hot) / hot * 100:+.3f} %"


def cmd_show(args: argparse.Namespace) -> int:
    spec = load_spec(find_spec(args.family, args.specs))
    layout = family_layout(spec)
    if args.json:
        print(json.dumps(to_json(spec, layout), indent=2))
        return 0
    record = layout.record
    console.print(f"[bold]{spec.name}[/bold] ({spec.model or 'no model id'}): {spec.attention}, {spec.dtype}, "
                  f"{spec.layout}, {spec.tokens_per_block} tokens/block")
    spans = Table("buffer", "rows", "row", "lossless prefix", "quantized", "2FP4", "lossless suffix", "G", "Q",
                  title="row schema")
    for b in record.buffers:
        spans.add_row(b.name, str(b.rows), str(b.row_dim), str(b.prefix), str(b.q),
                      f"{b.r} at {b.residual_at}" if b.r else "0", str(b.suffix), f"{b.G:g}", f"{b.Q:g}")
    console.print(spans)
    regions = Table("offset", "bytes", "buffer", "region", title="layer record")
    for r in record.regions:
        regions.add_row(str(r.offset), str(r.size), r.buffer or "-", r.kind)
    console.print(regions)
    console.print(f"layer record: {record.bytes} bytes (hot {record.hot_bytes}: {_saving(record.bytes, record.hot_bytes)})")
    for lc in layout.lifecycles:
        window = f"window {lc.window}" if lc.window else "full attention"
        console.print(f"lifecycle {lc.index} ({window}, {len(lc.layers)} layers): cold page {lc.cold_page_bytes} "
                      f"bytes, hot {lc.hot_page_bytes} ({_saving(lc.cold_page_bytes, lc.hot_page_bytes)})")
    return 0


# ---------------------------------------------------------------- build, show-config, clear-cache


def default_cache_dir() -> Path:
    return paths.cache_dir()


def default_jobs() -> int:
    return paths.max_jobs()


def _split(values: list[str] | None) -> list[str]:
    """Repeatable, comma-separated options: ``--family a,b --family c`` -> [a, b, c]."""
    return [v.strip() for value in values or [] for v in value.split(",") if v.strip()]


def discover_toolchains() -> list:
    """Toolchains from $KVGEN_NVCC, $CUDA_HOME, $PATH and pip wheels (the only env read for it)."""
    from kvgen.build.nvcc import (
        ToolchainError,
        default_host_compiler,
        default_nvcc_candidates,
        find_toolchains,
        probe_toolchain,
    )

    path = os.environ.get("PATH", "")
    host_cc = default_host_compiler(path)
    explicit = os.environ.get("KVGEN_NVCC")
    if explicit:
        probe_toolchain(explicit, host_cc)   # a broken $KVGEN_NVCC is an error, not a silent skip
    candidates = default_nvcc_candidates(explicit, os.environ.get("CUDA_HOME"), path)
    toolchains = find_toolchains(candidates, host_cc)
    if not toolchains:
        raise ToolchainError("no nvcc found (looked at: " + ", ".join(map(str, candidates)) + "); set KVGEN_NVCC "
                             "or CUDA_HOME, or pip install kvgen[nvcc-rubin]")
    return toolchains


def _selected_spec_paths(args: argparse.Namespace) -> list[Path]:
    families = _split(args.family)
    if not families:
        return spec_files(args.specs)
    return [find_spec(name, args.specs) for name in families]


def _build_archs(args: argparse.Namespace) -> list[str] | None:
    archs = _split(args.arch) or paths.cuda_arch_list()
    return archs or None


class _RichProgress:
    """Adapts ``kvgen.build.pipeline.BuildProgress`` to a rich progress bar."""

    def __init__(self, progress) -> None:  # noqa: ANN001 - rich.progress.Progress
        self.progress = progress
        self.task = None

    def start(self, total: int) -> None:
        self.task = self.progress.add_task("compiling", total=total)

    def advance(self, outcome) -> None:  # noqa: ANN001 - kvgen.build.job.BuildOutcome
        self.progress.update(self.task, advance=1,
                             description=f"{outcome.family} {outcome.arch} {outcome.backend}: {outcome.status}")


def _summary(report) -> Table:  # noqa: ANN001 - kvgen.build.pipeline.BuildReport
    table = Table("family", "arch", "backend", "status", "seconds", "artifact", title="kvgen build")
    colours = {"hit": "green", "built": "cyan", "failed": "red", "skipped": "yellow"}
    for o in report.outcomes:
        where = str(o.artifact) if o.artifact else (o.error.splitlines() or ["-"])[0]
        table.add_row(o.family, o.arch, o.backend or "-", f"[{colours[o.status]}]{o.status}[/]", f"{o.seconds:.2f}",
                      Text(where))
    return table


def _render_check(sources: list, args: argparse.Namespace) -> int:
    from kvgen.build.pipeline import check_generated

    differ = check_generated(sources, args.generated, args.templates)
    for rel in differ:
        console.print(f"[red]differs[/red] {args.generated / rel}")
    if differ:
        console.print(f"{len(differ)} generated files are not current; run: kvgen build --render-only")
        return 1
    console.print(f"{args.generated} is current")
    return 0


def cmd_build(args: argparse.Namespace) -> int:
    from rich.progress import Progress

    from kvgen.build.pipeline import build, load_spec_source, render_all
    from kvgen.render.source import write_rendered

    sources = [load_spec_source(p) for p in _selected_spec_paths(args)]
    if args.check:
        return _render_check(sources, args)
    if args.render_only:
        changed = [p for files in render_all(sources, args.templates).values()
                   for p in write_rendered(files, args.generated)]
        console.print(f"rendered {len(sources)} families into {args.generated}: {len(changed)} files changed")
        return 0
    with Progress(console=err_console, transient=True) as bar:
        report = build(sources, _build_archs(args), args.generated, args.cache_dir, args.jobs,
                       progress=_RichProgress(bar), toolchains=discover_toolchains(), registry_dir=args.registry,
                       tuning_dir=args.tuning, templates_dir=args.templates)
    for note in report.tuning_notes:
        err_console.print(f"[yellow]tuning[/yellow] {note}", markup=True, soft_wrap=True, highlight=False)
    console.print(_summary(report))
    for outcome in report.with_status("failed"):
        _print_error(f"{outcome.family} {outcome.arch} {outcome.backend}:\n{outcome.error}")
    counts = {s: len(report.with_status(s)) for s in ("built", "hit", "failed", "skipped")}
    console.print(", ".join(f"{n} {s}" for s, n in counts.items()) + "; manifests: "
                  + (", ".join(map(str, report.manifests)) or "none"))
    return 0 if report.ok else 1


def _installed(dist: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return "not installed"


def cmd_show_config(args: argparse.Namespace) -> int:
    from kvgen import __version__
    from kvgen.build.nvcc import ToolchainError
    from kvgen.render.source import TEMPLATES_DIR

    try:
        toolchains = discover_toolchains()
    except ToolchainError as exc:
        toolchains = []
        err_console.print(f"[yellow]warning[/yellow] {exc}", soft_wrap=True)
    table = Table("nvcc", "version", "archs", "host compiler", title="toolchains (first match wins per arch)")
    for t in toolchains:
        table.add_row(t.nvcc, t.version, " ".join(t.archs), f"{t.host_cc} ({t.host_cc_version})" if t.host_cc else "-")
    console.print(table)
    paths = {"cache dir": args.cache_dir / __version__, "registry": args.registry, "specs": args.specs,
             "templates": TEMPLATES_DIR, "max jobs": default_jobs()}
    for name, value in paths.items():
        console.print(f"{name:>10}: {value}")
    versions = {"kvgen": __version__, "python": sys.version.split()[0]}
    versions |= {dist: _installed(dist) for dist in ("torch", "triton", "nvidia-cutlass-dsl", "nvidia-cuda-nvcc")}
    for name, value in versions.items():
        console.print(f"{name:>18}: {value}")
    return 0


def cmd_clear_cache(args: argparse.Namespace) -> int:
    from kvgen.build.cache import clear_cache

    removed = clear_cache(args.cache_dir)
    for path in removed:
        console.print(f"removed {path}")
    console.print(f"cleared {len(removed)} cache version directories in {args.cache_dir}")
    return 0


def verify_registry(registry: Path, specs_dir: Path) -> list[str]:
    """Problems of a registry, one line each: manifests that do not read (format, version, ABI,
    the sha256 of every artifact they list), families built from a spec file that has changed
    since (or is gone)."""
    from kvgen.artifacts.manifest import RegistryError, read_manifest
    from kvgen.runtime.lookup import check_spec

    problems = []
    for path in sorted(Path(registry).glob("*/manifest.json")):
        try:
            manifest = read_manifest(path)
        except RegistryError as exc:
            problems.append(str(exc))
            continue
        for entry in manifest.families:
            spec_path = specs_dir / f"{entry.family}.yaml"
            try:
                check_spec(entry, spec_path)
            except (RegistryError, OSError) as exc:
                problems.append(str(exc) if isinstance(exc, RegistryError) else f"{spec_path}: {exc}")
    return problems


def cmd_verify(args: argparse.Namespace) -> int:
    from kvgen.artifacts.manifest import RegistryError, parse_manifest

    manifests = sorted(Path(args.registry).glob("*/manifest.json"))
    if not manifests:
        _print_error(f"{args.registry}: no manifests; run: kvgen build")
        return 1
    problems = verify_registry(args.registry, args.specs)
    for line in problems:
        _print_error(line)
    counted = []
    for path in manifests:
        try:
            counted.append(parse_manifest(path))
        except RegistryError:
            continue   # already reported above
    families = sum(len(m.families) for m in counted)
    artifacts = sum(len(e.artifacts) for m in counted for e in m.families)
    console.print(f"{len(manifests)} manifests, {families} families, {artifacts} artifacts: "
                  + ("all verified" if not problems else f"{len(problems)} problems"))
    return 1 if problems else 0


def _add_paths(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cache-dir", type=Path, default=None, help="build cache (default: $KVGEN_CACHE_DIR or "
                                                                "~/.cache/kvgen)")
    p.add_argument("--registry", type=Path, default=Path("build/registry"), help="registry (default: build/registry)")


def _add_build_parsers(sub) -> None:  # noqa: ANN001 - argparse's private subparsers type
    from kvgen.render.source import TEMPLATES_DIR

    p = sub.add_parser("build", help="render, compile and publish kernel libraries")
    _add_paths(p)
    p.add_argument("--arch", action="append", help="comma list (default: $KVGEN_CUDA_ARCH_LIST, else each "
                                                    "spec's targets)")
    p.add_argument("--family", action="append", help="family name(s), repeatable or comma list (default: all)")
    p.add_argument("--generated", type=Path, default=Path("generated"), help="rendered sources (default: generated)")
    p.add_argument("--templates", type=Path, default=TEMPLATES_DIR, help=argparse.SUPPRESS)
    p.add_argument("--jobs", "-j", type=int, default=default_jobs(), help="parallel compiles (default: $MAX_JOBS "
                                                                          "or the CPU count)")
    p.add_argument("--tuning", type=Path, default=Path("tuning"), help="tuned configurations (default: tuning; "
                                                                       "KVGEN_TUNING=off ignores them)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--render-only", action="store_true", help="only render generated/")
    mode.add_argument("--check", action="store_true", help="exit 1 if generated/ differs from a fresh render")
    p.set_defaults(func=cmd_build)

    p = sub.add_parser("show-config", help="toolchains, paths and versions")
    _add_paths(p)
    p.set_defaults(func=cmd_show_config)

    p = sub.add_parser("clear-cache", help="delete the build cache")
    _add_paths(p)
    p.set_defaults(func=cmd_clear_cache)

    p = sub.add_parser("verify", help="check a registry: artifact sha256, versions, specs unchanged since the build")
    _add_paths(p)
    p.set_defaults(func=cmd_verify)


# ---------------------------------------------------------------- wheel


def cmd_wheel(args: argparse.Namespace) -> int:
    from kvgen.artifacts.wheel import WheelError, build_wheels, registry_archs

    archs = _build_archs(args) or registry_archs(args.registry)
    if not archs:
        _print_error(f"no manifests in {args.registry}; run: kvgen build --arch sm_90a --registry {args.registry}")
        return 1
    try:
        paths = build_wheels(args.registry, archs, args.out)
    except (WheelError, ValueError) as exc:
        _print_error(str(exc))
        return 1
    for path in paths:
        console.print(f"wrote {path} ({path.stat().st_size / 1e6:.1f} MB)")
    return 0


def _add_wheel_parser(sub) -> None:  # noqa: ANN001 - argparse's private subparsers type
    p = sub.add_parser("wheel", help="package registry libraries as kernel wheels, one per arch family")
    p.add_argument("--arch", action="append", help="comma list (default: $KVGEN_CUDA_ARCH_LIST, else every arch "
                                                    "in the registry)")
    p.add_argument("--registry", type=Path, default=Path("build/registry"), help="registry (default: build/registry)")
    p.add_argument("--out", type=Path, default=Path("dist"), help="output directory (default: dist)")
    p.set_defaults(func=cmd_wheel)


# ---------------------------------------------------------------- tune, demo, bench


def cmd_tune(args: argparse.Namespace) -> int:
    from kvgen.build.job import load_spec_source
    from kvgen.tuning.run import run

    sources = [load_spec_source(p) for p in _selected_spec_paths(args)]
    return run(args, sources, console, args.cache_dir, discover_toolchains)


def _add_run_parsers(sub) -> None:  # noqa: ANN001 - argparse's private subparsers type
    from kvgen import bench, demo
    from kvgen.tuning import run as tune

    p = sub.add_parser("tune", help="autotune launch parameters (optuna), correctness-gated; writes tuning/",
                       description=tune.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cache-dir", type=Path, default=None, help="build cache (default: $KVGEN_CACHE_DIR or "
                                                                "~/.cache/kvgen)")
    p.add_argument("--jobs", "-j", type=int, default=default_jobs(), help="parallel compiles")
    tune.add_arguments(p)
    p.set_defaults(func=cmd_tune)

    p = sub.add_parser("demo", help="serving scenario on the GPU: offload/onboard through the codec, eviction")
    demo.add_arguments(p)
    p.set_defaults(func=demo.run)

    p = sub.add_parser("bench", help="every kernel benchmark with its ceilings; JSON, Markdown and plots")
    bench.add_arguments(p)
    p.set_defaults(func=bench.run)


# ---------------------------------------------------------------- entry


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvgen", description="KV-cache compression kernel generator")
    parser.add_argument("--specs", type=Path, default=None, help="spec directory (default: ./specs)")
    sub = parser.add_subparsers(dest="verb", required=True)

    p = sub.add_parser("validate", help="validate spec files (default: every shipped spec)")
    p.add_argument("files", nargs="*")
    p.set_defaults(func=cmd_validate)

    p = sub.add_parser("list", help="list the families")
    p.set_defaults(func=cmd_list)

    p = sub.add_parser("show", help="show a family's cold-page layout")
    p.add_argument("family")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_show)

    _add_build_parsers(sub)
    _add_wheel_parser(sub)
    _add_run_parsers(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.specs = args.specs or default_specs_dir()
    if hasattr(args, "cache_dir"):
        args.cache_dir = args.cache_dir or default_cache_dir()
    try:
        return args.func(args)
    except SpecError as exc:
        err_console.print(f"[red]error[/red] {exc}", soft_wrap=True)
        return 1
    except _build_errors() as exc:
        _print_error(str(exc))
        return 1


def _print_error(text: str) -> None:
    """Compiler logs contain brackets: never let rich read them as markup."""
    err_console.print("[red]error[/red]", end=" ")
    err_console.print(text, markup=False, soft_wrap=True)


def _build_errors() -> tuple[type[Exception], ...]:
    from kvgen.artifacts.manifest import RegistryError
    from kvgen.build.nvcc import ToolchainError
    from kvgen.render.source import RenderError

    return ToolchainError, RegistryError, RenderError


if __name__ == "__main__":
    sys.exit(main())
