"""The ``kvgen`` command line: parses arguments, runs a verb, prints what it did.

``kvgen.paths`` reads the environment; a verb gets every value as an argument. Exit statuses:
0 ok, 1 a check failed (an invalid spec, a failed compile, a registry problem), 2 bad usage (an
unknown arch, family or option value, a missing specs folder, a missing extra). ``--json``
prints one JSON document on stdout and nothing else there; messages and progress go to stderr.
Text from files and tools (paths, spec errors, compiler logs) is printed as plain text, never
read as rich markup.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from kvgen import paths
from kvgen.arch import ARCHS, ArchError, canonical_arch, parse_arch_list
from kvgen.lower.layout import family_layout, to_json
from kvgen.spec.schema import FamilySpec, SpecError, load_spec, name_collisions

# Build-side modules (render, backends, cache, registry) and the tools (tune, demo, bench) are
# imported inside their verbs so that `kvgen validate` stays fast and every verb that needs no
# extra runs on a base install.

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
EPILOG = ("exit status: 0 ok, 1 a check failed (invalid spec, failed compile, registry problem), "
          "2 bad usage (unknown arch, family or folder, missing extra)")
# Modules of the optional extras (pyproject.toml) -> the extra that installs them.
EXTRAS = {"optuna": "tune", "psycopg2": "tune", "triton": "triton", "cutlass": "cute", "matplotlib": "report",
          "transformers": "hf"}

console = Console(highlight=False, emoji=False, width=None if sys.stdout.isatty() else 160)
err_console = Console(stderr=True, highlight=False, emoji=False)


class UsageError(Exception):
    """Bad usage (exit 2): the message names the argument, file or folder at fault."""


def default_specs_dir() -> Path:
    """``$KVGEN_SPECS_DIR``, else ``./specs``, else the specs shipped beside the package."""
    return paths.specs_dir()


def spec_files(specs_dir: Path) -> list[Path]:
    """The specs in ``specs_dir``; a missing or empty folder is bad usage, never an empty list."""
    if not specs_dir.is_dir():
        raise UsageError(f"{specs_dir}: no such specs folder (pass --specs DIR or set {paths.ENV_SPECS})")
    files = sorted(specs_dir.glob("*.yaml"))
    if not files:
        raise UsageError(f"{specs_dir}: no spec files (*.yaml) in this folder")
    return files


def find_spec(name: str, specs_dir: Path) -> Path:
    """A family name or a path to a spec file."""
    as_path = Path(name)
    if as_path.suffix in (".yaml", ".yml") and as_path.exists():
        return as_path
    candidate = specs_dir / f"{name}.yaml"
    if candidate.exists():
        return candidate
    known = ", ".join(p.stem for p in sorted(specs_dir.glob("*.yaml"))) or "none"
    raise UsageError(f"no family {name!r} in {specs_dir}; known families: {known}")


def load_all(paths: list[Path]) -> tuple[list[FamilySpec], list[SpecError]]:
    """The valid specs and the errors; a spec whose name collides with an earlier one's in C is an error."""
    loaded, errors = [], []
    for path in paths:
        try:
            loaded.append((path, load_spec(path)))
        except SpecError as exc:
            errors.append(exc)
    collisions = name_collisions(loaded)
    refused = {exc.path for exc in collisions}
    return [spec for path, spec in loaded if str(path) not in refused], errors + collisions


def _print_json(document: Any) -> None:
    """``--json``: the verb's one document on stdout (plain print: no rich wrapping or markup)."""
    print(json.dumps(document, indent=2, default=str))


def _spec_error_json(exc: SpecError) -> dict[str, Any]:
    return {"file": exc.path, "issues": [issue.model_dump() for issue in exc.issues]}


# ---------------------------------------------------------------- verbs


def cmd_validate(args: argparse.Namespace) -> int:
    files = [Path(p) for p in args.files] or spec_files(args.specs)
    specs, errors = load_all(files)
    if args.json:
        _print_json({"valid": [s.name for s in specs], "invalid": [_spec_error_json(e) for e in errors]})
    else:
        for spec in specs:
            console.print("[green]ok[/green]", Text(spec.name))
        for exc in errors:
            _print_error(str(exc))
        console.print(f"{len(specs)} valid, {len(errors)} invalid")
    return EXIT_FAILED if errors else EXIT_OK


def _family_row(s: FamilySpec) -> dict[str, Any]:
    return {"family": s.name, "attention": s.attention, "layers": s.layers, "query_heads": s.query_heads,
            "kv_heads": s.kv_heads, "row_dim": s.row_dim, "dtype": s.dtype, "layout": s.layout,
            "rope": {"placement": s.rope.placement, "start": s.rope_start, "width": s.rotary_dim,
                     "pairing": s.rope.pairing},
            "cold_rope": s.cold_page.rope, "triattention": s.triattention.enabled, "targets": list(s.targets)}


def cmd_list(args: argparse.Namespace) -> int:
    specs, errors = load_all(spec_files(args.specs))
    rows = [_family_row(s) for s in specs]
    if args.json:
        _print_json({"specs": str(args.specs), "families": rows, "invalid": [_spec_error_json(e) for e in errors]})
        return EXIT_FAILED if errors else EXIT_OK
    table = Table("family", "attention", "layers", "heads q/kv", "row", "dtype", "layout", "rope", "cold rope",
                  "tri", title=Text(f"families in {args.specs}"))
    for r in rows:
        rope = r["rope"]
        table.add_row(r["family"], r["attention"], str(r["layers"]), f"{r['query_heads']}/{r['kv_heads']}",
                      str(r["row_dim"]), r["dtype"], r["layout"], f"{rope['placement']} {rope['width']} "
                      f"{rope['pairing']}", r["cold_rope"], "yes" if r["triattention"] else "no")
    console.print(table)
    for exc in errors:
        _print_error(str(exc))
    return EXIT_FAILED if errors else EXIT_OK


def _rope_line(spec: FamilySpec) -> str:
    """Where RoPE sits in a K row and how the cold page stores it (lossless, 2FP4 or quantized)."""
    if spec.rope.placement == "none":
        return "rope: none (the whole row is quantized)"
    policy = spec.cold_page.rope
    if policy == "2fp4":
        policy += f" (residual width {spec.cold_page.residual_width or spec.rotary_dim})"
    return (f"rope: {spec.rope.placement}, span start {spec.rope_start} width {spec.rotary_dim}, "
            f"pairing {spec.rope.pairing}; cold page stores it {policy}")


def _saving(cold: int, hot: int) -> str:
    return f"{(cold - hot) / hot * 100:+.3f} %"


def cmd_show(args: argparse.Namespace) -> int:
    spec = load_spec(find_spec(args.family, args.specs))
    layout = family_layout(spec)
    if args.json:
        print(json.dumps(to_json(spec, layout), indent=2))
        return 0
    record = layout.record
    console.print(Text(f"{spec.name} ({spec.model or 'no model id'}): {spec.attention}, {spec.dtype}, "
                       f"{spec.layout}, {spec.tokens_per_block} tokens/block", style="bold"))
    console.print(_rope_line(spec))
    spans = Table("buffer", "rows", "row", "lossless prefix", "quantized", "2FP4", "lossless suffix", "G", "Q",
                  title="row schema")
    for b in record.buffers:
        spans.add_row(b.name, str(b.rows), str(b.row_dim), str(b.prefix), str(b.q),
                      f"{b.r} at {b.residual_at}" if b.r else "0", str(b.suffix),
                      *(("per layer", "per layer") if b.per_layer_scales else (f"{b.G:g}", f"{b.Q:g}")))
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


def _nvcc_search() -> tuple[str | None, str | None, list[Path]]:
    """($KVGEN_NVCC, the host compiler, the nvcc candidates in order): found without running any."""
    from kvgen.build.nvcc import default_host_compiler, default_nvcc_candidates

    search = paths.toolchain_search()
    return (search.nvcc, default_host_compiler(search.path),
            default_nvcc_candidates(search.nvcc, search.cuda_home, search.path))


def toolchain_files() -> list[Path]:
    """The files ``discover_toolchains`` would probe: the no-op build stamps record their state."""
    _, host_cc, candidates = _nvcc_search()
    return [*candidates, *([Path(host_cc)] if host_cc else [])]


def discover_toolchains() -> list:
    """Toolchains from $KVGEN_NVCC, $CUDA_HOME, $PATH (``paths.toolchain_search``) and pip wheels."""
    from kvgen.build.nvcc import ToolchainError, find_toolchains, probe_toolchain

    explicit, host_cc, candidates = _nvcc_search()
    if explicit:
        probe_toolchain(explicit, host_cc)   # a broken $KVGEN_NVCC is an error, not a silent skip
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


def _requested_archs(args: argparse.Namespace) -> list[str]:
    """``--arch`` (repeatable; ``;``, ``,`` or space separated, as TORCH_CUDA_ARCH_LIST), else
    ``$KVGEN_CUDA_ARCH_LIST``; empty: none asked for. An unknown arch raises ``ArchError``."""
    if args.arch:
        try:
            return parse_arch_list(";".join(args.arch))
        except ArchError as exc:
            raise ArchError(f"--arch: {exc}") from None
    return paths.cuda_arch_list()


def _check_targeted(archs: list[str], specs: list[FamilySpec]) -> None:
    """An arch that none of the selected specs targets would build nothing: bad usage, not a skip."""
    for arch in archs:
        if not any(arch in spec.targets for spec in specs):
            targets = [a for a in ARCHS if any(a in spec.targets for spec in specs)]
            raise UsageError(f"no selected spec targets {arch} (their targets: {', '.join(targets)}); "
                             "add it to a spec's targets or pick another --arch")


class _RichProgress:
    """Adapts ``kvgen.build.pipeline.BuildProgress`` to a rich progress bar (stderr is a TTY)."""

    def __init__(self, progress) -> None:  # noqa: ANN001 - rich.progress.Progress
        self.progress = progress
        self.task = None

    def start(self, total: int) -> None:
        self.task = self.progress.add_task("compiling", total=total)

    def advance(self, outcome) -> None:  # noqa: ANN001 - kvgen.build.job.BuildOutcome
        self.progress.update(self.task, advance=1,
                             description=f"{outcome.family} {outcome.arch} {outcome.backend}: {outcome.status}")


class _LineProgress:
    """``BuildProgress`` for a log (stderr is not a TTY): one plain line per finished job, flushed
    at once, so a cold build written to a file shows where it is."""

    def __init__(self, stream) -> None:  # noqa: ANN001 - a text stream
        self.stream = stream
        self.total = 0
        self.done = 0

    def start(self, total: int) -> None:
        self.total = total

    def advance(self, outcome) -> None:  # noqa: ANN001 - kvgen.build.job.BuildOutcome
        self.done += 1
        print(f"[{self.done}/{self.total}] {outcome.family} {outcome.arch} {outcome.backend}: {outcome.status} "
              f"({outcome.seconds:.1f} s)", file=self.stream, flush=True)


def _outcome_json(o) -> dict[str, Any]:  # noqa: ANN001 - kvgen.build.job.BuildOutcome
    return {"family": o.family, "arch": o.arch, "backend": o.backend, "status": o.status, "seconds": o.seconds,
            "artifact": str(o.artifact) if o.artifact else None, "sha256": o.sha256, "error": o.error or None}


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
    status = EXIT_FAILED if differ else EXIT_OK
    if args.json:
        _print_json({"generated": str(args.generated), "current": not differ, "differ": differ})
        return status
    for rel in differ:
        console.print("[red]differs[/red]", Text(str(args.generated / rel)))
    if differ:
        console.print(f"{len(differ)} generated files are not current; run: kvgen build --render-only")
    else:
        console.print(Text(f"{args.generated} is current"))
    return status


def _render_only(sources: list, args: argparse.Namespace) -> int:
    from kvgen.build.pipeline import render_all
    from kvgen.render.source import write_rendered

    changed = [p for files in render_all(sources, args.templates).values() for p in write_rendered(files, args.generated)]
    if args.json:
        _print_json({"generated": str(args.generated), "families": [s.spec.name for s in sources],
                     "changed": [str(p) for p in changed]})
    else:
        console.print(Text(f"rendered {len(sources)} families into {args.generated}: {len(changed)} files changed"))
    return EXIT_OK


def _build_report_json(report) -> dict[str, Any]:  # noqa: ANN001 - kvgen.build.pipeline.BuildReport
    return {"ok": report.ok, "outcomes": [_outcome_json(o) for o in report.outcomes],
            "manifests": [str(p) for p in report.manifests], "tuning_notes": report.tuning_notes,
            "counts": _counts(report), "noop": report.noop}


def _counts(report) -> dict[str, int]:  # noqa: ANN001 - kvgen.build.pipeline.BuildReport
    return {s: len(report.with_status(s)) for s in ("built", "hit", "failed", "skipped")}


def cmd_build(args: argparse.Namespace) -> int:
    from kvgen.build.pipeline import load_spec_source

    archs = _requested_archs(args)   # a bad --arch fails before any spec is read or rendered
    sources = [load_spec_source(p) for p in _selected_spec_paths(args)]
    if args.check:
        return _render_check(sources, args)
    if args.render_only:
        return _render_only(sources, args)
    _check_targeted(archs, [s.spec for s in sources])
    report = _run_build(args, sources, archs or None)
    for note in report.tuning_notes:
        err_console.print("[yellow]tuning[/yellow]", Text(note), soft_wrap=True)
    if args.json:
        _print_json(_build_report_json(report))
        return EXIT_OK if report.ok else EXIT_FAILED
    console.print(_summary(report))
    for outcome in report.with_status("failed"):
        _print_error(f"{outcome.family} {outcome.arch} {outcome.backend}:\n{outcome.error}")
    console.print(Text(", ".join(f"{n} {s}" for s, n in _counts(report).items()) + "; manifests: "
                       + (", ".join(map(str, report.manifests)) or "none")
                       + ("; no-op: nothing changed since the last build" if report.noop else "")))
    return EXIT_OK if report.ok else EXIT_FAILED


def _run_build(args: argparse.Namespace, sources: list, archs: list[str] | None):
    """``kvgen.build.pipeline.build`` with a progress bar on a TTY, else one line per finished job.
    Toolchains are probed only if the no-op stamps say something must be built."""
    from rich.progress import Progress

    from kvgen.build.pipeline import build

    def run(progress) -> Any:  # noqa: ANN001 - a BuildProgress
        return build(sources, archs, args.generated, args.cache_dir, args.jobs, progress=progress,
                     toolchains=discover_toolchains, registry_dir=args.registry, tuning_dir=args.tuning,
                     templates_dir=args.templates, noop_stamps=True, toolchain_files=toolchain_files())

    if not err_console.is_terminal:
        return run(_LineProgress(sys.stderr))
    with Progress(console=err_console, transient=True) as bar:
        return run(_RichProgress(bar))


def _installed(dist: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return "not installed"


def _config(args: argparse.Namespace) -> dict[str, Any]:
    """What ``show-config`` reports: toolchains (or why none), paths and versions."""
    from kvgen import __version__
    from kvgen.build.nvcc import ToolchainError
    from kvgen.render.source import TEMPLATES_DIR

    try:
        toolchains, warnings = discover_toolchains(), []
    except ToolchainError as exc:
        toolchains, warnings = [], [str(exc)]
    return {
        "toolchains": [{"nvcc": str(t.nvcc), "version": t.version, "archs": list(t.archs),
                        "host_cc": str(t.host_cc) if t.host_cc else None, "host_cc_version": t.host_cc_version}
                       for t in toolchains],
        "warnings": warnings,
        "paths": {"cache dir": str(args.cache_dir / __version__), "registry": str(args.registry),
                  "specs": str(args.specs), "templates": str(TEMPLATES_DIR), "max jobs": default_jobs()},
        "versions": {"kvgen": __version__, "python": sys.version.split()[0],
                     **{d: _installed(d) for d in ("torch", "triton", "nvidia-cutlass-dsl", "nvidia-cuda-nvcc")}},
        "tuning": _registry_tuning(args.registry),
    }


def _registry_tuning(registry: Path) -> dict[str, str]:
    """``"<arch> <family> <op>" -> how its built parameters were chosen`` (measured, model-tuned,
    override, default, then the op's size-dispatched variants), from the registry's manifests (a
    manifest that does not read is skipped: ``kvgen verify`` reports it)."""
    from kvgen.artifacts.manifest import RegistryError, parse_manifest

    out = {}
    for path in sorted(Path(registry).glob("*/manifest.json")):
        try:
            manifest = parse_manifest(path)
        except RegistryError:
            continue
        for entry in manifest.families:
            out.update({f"{manifest.arch} {entry.family} {op.op}": op.tuning + "".join(
                f"; from work {v.from_work}: {v.artifact} ({v.bucket})" for v in op.variants) for op in entry.ops})
    return out


def cmd_show_config(args: argparse.Namespace) -> int:
    config = _config(args)
    if args.json:
        _print_json(config)
        return EXIT_OK
    for warning in config["warnings"]:
        err_console.print("[yellow]warning[/yellow]", Text(warning), soft_wrap=True)
    table = Table("nvcc", "version", "archs", "host compiler", title="toolchains (first match wins per arch)")
    for t in config["toolchains"]:
        host = f"{t['host_cc']} ({t['host_cc_version']})" if t["host_cc"] else "-"
        table.add_row(Text(t["nvcc"]), t["version"], " ".join(t["archs"]), Text(host))
    console.print(table)
    for name, value in config["paths"].items():
        console.print(Text(f"{name:>10}: {value}"))
    for name, value in config["versions"].items():
        console.print(Text(f"{name:>18}: {value}"))
    for name, value in config["tuning"].items():
        console.print(Text(f"tuning {name}: {value}"))
    return EXIT_OK


def cmd_clear_cache(args: argparse.Namespace) -> int:
    from kvgen.build.cache import clear_cache

    removed = clear_cache(args.cache_dir)
    for path in removed:
        console.print(Text(f"removed {path}"))
    console.print(Text(f"cleared {len(removed)} cache version directories in {args.cache_dir}"))
    return EXIT_OK


def verify_registry(registry: Path, specs_dir: Path) -> list[str]:
    """Problems of a registry, one line each: manifests that do not read (malformed, format,
    version, ABI, an arch not its folder's), every artifact path leaving the registry, missing or
    altered, and families built from a spec file that has changed since (or is gone)."""
    from kvgen.artifacts.manifest import RegistryError, manifest_problems
    from kvgen.runtime.lookup import check_spec

    problems = []
    for path in sorted(Path(registry).glob("*/manifest.json")):
        manifest, found = manifest_problems(path)
        problems += [str(exc) for exc in found]
        for entry in manifest.families if manifest else ():
            spec_path = specs_dir / f"{entry.family}.yaml"
            try:
                check_spec(entry, spec_path)
            except (RegistryError, OSError) as exc:
                problems.append(str(exc) if isinstance(exc, RegistryError) else f"{spec_path}: {exc}")
    return problems


def _verify_counts(manifests: list[Path]) -> dict[str, int]:
    """Manifests, families and artifacts of the manifests that parse (the others are problems)."""
    from kvgen.artifacts.manifest import RegistryError, parse_manifest

    counted = []
    for path in manifests:
        try:
            counted.append(parse_manifest(path))
        except RegistryError:
            continue   # reported by verify_registry
    return {"manifests": len(manifests), "families": sum(len(m.families) for m in counted),
            "artifacts": sum(len(e.artifacts) for m in counted for e in m.families)}


def _installed_json(check) -> dict[str, Any]:  # noqa: ANN001 - kvgen.artifacts.wheel.InstalledCheck
    return {"package": check.name, "version": check.version, "location": check.location, "files": check.files,
            "manifests": check.manifests, "problems": check.problems, "notes": check.notes}


def cmd_verify_installed(args: argparse.Namespace) -> int:
    """``kvgen verify --installed``: every installed kernel wheel (RECORD, manifests, provenance)."""
    from kvgen.artifacts.wheel import verify_installed

    checks = verify_installed()
    problems = [p for c in checks for p in c.problems] or ([] if checks else [
        "no kvgen kernel wheels installed (pip install kvgen-kernels-sm90, or kvgen wheel then pip install dist/*.whl)"])
    if args.json:
        _print_json({"ok": not problems, "installed": [_installed_json(c) for c in checks], "problems": problems})
        return EXIT_FAILED if problems else EXIT_OK
    for check in checks:
        status = "verified" if not check.problems else f"{len(check.problems)} problems"
        console.print(Text(f"{check.name} {check.version} in {check.location}: {check.files} files, "
                           f"{check.manifests} manifests: {status}"))
        for note in check.notes:
            err_console.print("[yellow]warning[/yellow]", Text(note), soft_wrap=True)
    for line in problems:
        _print_error(line)
    return EXIT_FAILED if problems else EXIT_OK


def cmd_verify(args: argparse.Namespace) -> int:
    if args.installed:
        return cmd_verify_installed(args)
    manifests = sorted(Path(args.registry).glob("*/manifest.json"))
    problems = (verify_registry(args.registry, args.specs) if manifests
                else [f"{args.registry}: no manifests; run: kvgen build"])
    counts = _verify_counts(manifests)
    if args.json:
        _print_json({"registry": str(args.registry), "ok": not problems, **counts, "problems": problems})
        return EXIT_FAILED if problems else EXIT_OK
    for line in problems:
        _print_error(line)
    if manifests:
        console.print(f"{counts['manifests']} manifests, {counts['families']} families, {counts['artifacts']} "
                      "artifacts: " + ("all verified" if not problems else f"{len(problems)} problems"))
    return EXIT_FAILED if problems else EXIT_OK


def _add_paths(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cache-dir", type=Path, default=None, help="build cache (default: $KVGEN_CACHE_DIR or "
                                                                "~/.cache/kvgen)")
    p.add_argument("--registry", type=Path, default=Path("build/registry"), help="registry (default: build/registry)")


def _add_json(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="one JSON document on stdout (messages go to stderr)")


ARCH_HELP = "repeatable; sm_90a, 90a or 9.0a, separated by ; , or spaces (default: $KVGEN_CUDA_ARCH_LIST, else "


def _add_build_parsers(sub) -> None:  # noqa: ANN001 - argparse's private subparsers type
    from kvgen.render.source import TEMPLATES_DIR

    p = sub.add_parser("build", help="render, compile and publish kernel libraries", epilog=EPILOG)
    _add_paths(p)
    _add_json(p)
    p.add_argument("--arch", action="append", help=ARCH_HELP + "each spec's targets)")
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
    _add_json(p)
    p.set_defaults(func=cmd_show_config)

    p = sub.add_parser("clear-cache", help="delete the build cache")
    _add_paths(p)
    p.set_defaults(func=cmd_clear_cache)

    p = sub.add_parser("verify", help="check a registry: artifact sha256, versions, specs unchanged since the build",
                       epilog=EPILOG)
    _add_paths(p)
    _add_json(p)
    p.add_argument("--installed", action="store_true", help="check the installed kernel wheels instead: every "
                                                            "file's RECORD sha256, manifests, recorded spec sha256")
    p.set_defaults(func=cmd_verify)


# ---------------------------------------------------------------- wheel


def cmd_wheel(args: argparse.Namespace) -> int:
    from kvgen.artifacts.wheel import PROVENANCE, WheelError, build_wheels, registry_archs, wheel_provenance

    archs = _requested_archs(args) or registry_archs(args.registry)
    if not archs:
        _print_error(f"no manifests in {args.registry}; run: kvgen build --arch sm_90a --registry {args.registry}")
        return EXIT_FAILED
    try:
        wheels = build_wheels(args.registry, archs, args.out, specs_dir=args.specs, allow_dirty=args.allow_dirty)
    except (WheelError, ValueError) as exc:
        _print_error(str(exc))
        return EXIT_FAILED
    for path in wheels:
        record = wheel_provenance(path)
        commit = (record["commit"] or "unknown")[:12]
        count = len({r["family"] for r in record["specs"]})
        console.print(Text(f"wrote {path} ({path.stat().st_size / 1e6:.1f} MB): {count} "
                           f"{'family' if count == 1 else 'families'} for {', '.join(record['archs'])}, specs at "
                           f"commit {commit}, their sha256 in {PROVENANCE}"), soft_wrap=True)
        for line in record["dirty"]:
            err_console.print("[yellow]warning[/yellow]", Text(f"packed with --allow-dirty (recorded in the wheel): "
                                                               f"{line}"), soft_wrap=True)
    return EXIT_OK


def _add_wheel_parser(sub) -> None:  # noqa: ANN001 - argparse's private subparsers type
    p = sub.add_parser("wheel", help="package registry libraries as kernel wheels, one per arch family")
    p.add_argument("--arch", action="append", help=ARCH_HELP + "every arch in the registry)")
    p.add_argument("--registry", type=Path, default=Path("build/registry"), help="registry (default: build/registry)")
    p.add_argument("--out", type=Path, default=Path("dist"), help="output directory (default: dist)")
    p.add_argument("--allow-dirty", action="store_true", help="pack families whose spec file is not committed in "
                                                              "git (or changed since the build); the wheel records it")
    p.set_defaults(func=cmd_wheel)


# ---------------------------------------------------------------- tune, demo, bench


def cmd_tune(args: argparse.Namespace) -> int:
    from kvgen.build.job import load_spec_source
    from kvgen.tuning.run import run

    try:
        args.arch = canonical_arch(args.arch)
    except ArchError as exc:
        raise ArchError(f"--arch: {exc}") from None
    sources = [load_spec_source(p) for p in _selected_spec_paths(args)]
    return run(args, sources, console, args.cache_dir, discover_toolchains)


DEMO_CPU = ("without a GPU, kvgen demo needs --device cpu: the CPU oracle then stands in for the kernels; "
            "the full-size scenario takes minutes there, --small seconds")


def cmd_demo(args: argparse.Namespace) -> int:
    """``kvgen demo``. Without a GPU it does not fall back to the CPU oracle by itself: that runs
    the full-size scenario for minutes, so it is asked for (``--device cpu``), and warned about
    without ``--small``."""
    from kvgen import demo

    if args.device is None and not _has_cuda():
        raise UsageError("no CUDA device here: kvgen demo runs the generated kernels on a GPU. For the CPU oracle "
                         "pass --device cpu --small (seconds) or --device cpu (full size, minutes)")
    if args.device == "cpu" and not args.small:
        err_console.print("[yellow]warning[/yellow]", Text(
            "--device cpu without --small: the CPU oracle runs the full-size scenario (on a 2-core machine it had "
            "not finished after 37 min); add --small for a run of seconds"), soft_wrap=True)
    return demo.run(args)


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


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

    p = sub.add_parser("demo", help="serving scenario on the GPU: offload/onboard through the codec, eviction",
                       epilog=DEMO_CPU)
    demo.add_arguments(p)
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("bench", help="every kernel benchmark with its ceilings; JSON, Markdown and plots")
    bench.add_arguments(p)
    p.set_defaults(func=bench.run)


def cmd_spec_from_config(args: argparse.Namespace) -> int:
    """Draft a spec from a config.json: notes on stderr, validated before it is written."""
    from kvgen.spec.from_config import ConfigError, draft_spec, read_config, validate

    config, out = args.config, args.out
    to_stdout = out is not None and str(out) == "-"
    named_by_out = out is not None and not to_stdout and out.suffix in (".yaml", ".yml")
    try:
        draft = draft_spec(read_config(config), str(config), name=args.name or (out.stem if named_by_out else None),
                           fallback_name=config.resolve().parent.name if config.stem == "config" else config.stem)
    except ConfigError as exc:
        raise UsageError(str(exc)) from None
    out = out if out is not None else args.specs / f"{draft.name}.yaml"
    if not to_stdout and out.stem != draft.name:
        raise UsageError(f"{out}: a spec's file name is its name ({draft.name}.yaml); change --out or --name")
    if not to_stdout and out.exists() and not args.force:
        raise UsageError(f"{out}: already exists; pass --force to overwrite it")
    validate(draft, str(out))  # a SpecError here: exit 1, nothing written
    for note in draft.notes:
        print(f"note: {note}", file=sys.stderr)
    if to_stdout:
        sys.stdout.write(draft.text())
        return EXIT_OK
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(draft.text(), encoding="utf-8")
    print(f"wrote {out}", file=sys.stderr)
    return EXIT_OK


# ---------------------------------------------------------------- calibrate

CALIBRATE_DTYPES = ("auto", "bfloat16", "float16", "float32")


def cmd_calibrate(args: argparse.Namespace) -> int:
    """TriAttention statistics of a local checkpoint on a text file, written in both on-disk forms."""
    import torch

    from kvgen import calibrate
    from kvgen.reference.triattention import GeometryError

    spec = load_spec(find_spec(args.family, args.specs))
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype_name = args.dtype if args.dtype != "auto" else ("bfloat16" if device.startswith("cuda") else "float32")
    upstream = args.upstream_out or calibrate.upstream_path(args.out)
    if upstream.resolve() == args.out.resolve():
        raise UsageError(f"--upstream-out {upstream}: the same file as --out; the two forms need two files")
    try:
        text = calibrate.read_text(args.text)
        model, tokenizer = calibrate.load_model(args.model, device, getattr(torch, dtype_name), args.tokenizer)
        run = calibrate.calibrate_text(model, tokenizer, text, spec,
                                       chunk_tokens=args.chunk_tokens or calibrate.DEFAULT_CHUNK_TOKENS,
                                       max_tokens=args.max_tokens, source=str(args.text))
    except (calibrate.CalibrateError, GeometryError) as exc:
        raise UsageError(str(exc)) from None
    calibrate.write_outputs(run, args.out, upstream)
    summary = {"family": run.family, "model": run.model, "tokens": run.tokens, "forward_passes": run.chunks,
               "query_site": run.metadata["query_site"], "concentration": round(run.concentration, 6),
               "flat": str(args.out), "upstream": str(upstream)}
    if args.json:
        _print_json(summary)
    else:
        print(f"{run.family}: {run.tokens} tokens in {run.chunks} forward passes; mean |E q|/E|q| "
              f"{run.concentration:.4f}; wrote {args.out} (flat) and {upstream} (upstream form)", file=sys.stderr)
    return EXIT_OK


def _add_calibrate_parser(sub) -> None:  # noqa: ANN001 - argparse's private subparsers type
    p = sub.add_parser("calibrate", help="TriAttention query statistics of a Hugging Face checkpoint on a text file",
                       epilog=EPILOG)
    p.add_argument("family", help="family name or spec file the model must match")
    p.add_argument("--model", type=Path, required=True, help="local Hugging Face checkpoint folder")
    p.add_argument("--text", type=Path, required=True, help="calibration text (UTF-8)")
    p.add_argument("--out", type=Path, required=True, help="flat calibration file to write (E_q, E_q_norm, omega, "
                                                           "freq_scale_sq)")
    p.add_argument("--upstream-out", type=Path, help="upstream-form file to write (default: <out stem>.upstream.pt)")
    p.add_argument("--tokenizer", type=Path, help="tokenizer folder (default: the model folder)")
    p.add_argument("--chunk-tokens", type=int, help="tokens per forward pass (default: 4096)")
    p.add_argument("--max-tokens", type=int, help="use only the first N tokens of the text")
    p.add_argument("--device", help="torch device (default: cuda if available, else cpu)")
    p.add_argument("--dtype", choices=CALIBRATE_DTYPES, default="auto",
                   help="model dtype (default auto: bfloat16 on cuda, float32 on cpu)")
    _add_json(p)
    p.set_defaults(func=cmd_calibrate)


# ---------------------------------------------------------------- entry


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvgen", description="KV-cache compression kernel generator",
                                     epilog=EPILOG)
    parser.add_argument("--specs", type=Path, default=None, help="spec directory (default: $KVGEN_SPECS_DIR, "
                                                                 "else ./specs)")
    sub = parser.add_subparsers(dest="verb", required=True)

    p = sub.add_parser("validate", help="validate spec files (default: every shipped spec)", epilog=EPILOG)
    p.add_argument("files", nargs="*")
    _add_json(p)
    p.set_defaults(func=cmd_validate)

    p = sub.add_parser("list", help="list the families")
    _add_json(p)
    p.set_defaults(func=cmd_list)

    p = sub.add_parser("show", help="show a family's cold-page layout")
    p.add_argument("family")
    p.add_argument("--json", action="store_true", help="the family's layout JSON (what the build ships)")
    p.set_defaults(func=cmd_show)

    p = sub.add_parser("spec", help="write spec files")
    spec_verbs = p.add_subparsers(dest="spec_verb", required=True)
    p = spec_verbs.add_parser("from-config", help="draft a spec from a Hugging Face config.json (notes on stderr)")
    p.add_argument("config", type=Path, help="the model's config.json")
    p.add_argument("--name", help="family name (default: from --out, _name_or_path or the file name)")
    p.add_argument("--out", type=Path, help="spec file to write (default: <specs>/<name>.yaml; - for stdout)")
    p.add_argument("--force", action="store_true", help="overwrite an existing file")
    p.set_defaults(func=cmd_spec_from_config)

    _add_build_parsers(sub)
    _add_wheel_parser(sub)
    _add_run_parsers(sub)
    _add_calibrate_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one ``kvgen`` command; the exit status (0 ok, 1 a check failed, 2 bad usage)."""
    args = build_parser().parse_args(argv)
    try:
        args.specs = args.specs or default_specs_dir()
        if hasattr(args, "cache_dir"):
            args.cache_dir = args.cache_dir or default_cache_dir()
        return args.func(args)
    except SpecError as exc:
        _print_error(str(exc))
        return EXIT_FAILED
    except ModuleNotFoundError as exc:
        extra = EXTRAS.get((exc.name or "").split(".")[0])
        if extra is None:
            raise
        _print_error(f"kvgen {args.verb} needs {exc.name}: pip install 'kvgen[{extra}]'")
        return EXIT_USAGE
    except _usage_errors() as exc:
        _print_error(str(exc))
        return EXIT_USAGE
    except _build_errors() as exc:
        _print_error(str(exc))
        return EXIT_FAILED
    except OSError as exc:   # a read-only or full cache, registry or output directory: fix it and rerun
        _print_error(f"{exc.filename}: {exc.strerror}" if exc.filename and exc.strerror else str(exc))
        return EXIT_USAGE


def _print_error(text: str) -> None:
    """Paths, spec messages and compiler logs contain brackets: never let rich read them as markup."""
    err_console.print("[red]error[/red]", end=" ")
    err_console.print(text, markup=False, soft_wrap=True)


def _usage_errors() -> tuple[type[Exception], ...]:
    from kvgen.lower.tuned import TuningFileError

    # TuningFileError reaching here is a bad $KVGEN_TUNED_PARAMS (bad tuned files are notes).
    return UsageError, ArchError, TuningFileError


def _build_errors() -> tuple[type[Exception], ...]:
    from kvgen.artifacts.manifest import RegistryError
    from kvgen.build.nvcc import ToolchainError
    from kvgen.render.source import RenderError

    return ToolchainError, RegistryError, RenderError


if __name__ == "__main__":
    sys.exit(main())
