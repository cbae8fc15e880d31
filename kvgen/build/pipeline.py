"""``kvgen build``: render every family, compile one shared library per (family, arch), publish.

Flow: specs -> ``render_family`` -> ``generated/<family>/`` (write_if_different) -> per (family,
arch) a cache key over the rendered text, the hand-written headers, flags, toolchain identity and
arch -> ``cache.get_or_build`` (nvcc in a worker thread) -> artifact copied into
``<registry>/<arch>/`` and listed in its ``manifest.json``. Nothing here reads the environment or
prints; the CLI passes paths and toolchains in and shows progress through ``BuildProgress``.
"""

from __future__ import annotations

import hashlib
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal, Mapping, Protocol, Sequence

from kvgen import __version__
from kvgen.artifacts.manifest import (
    LibraryEntry,
    Manifest,
    OpEntry,
    RegistryError,
    manifest_path,
    parse_manifest,
    write_manifest,
)
from kvgen.build.cache import CACHE_SCHEMA_VERSION, entry_dir, failed_dir, get_or_build
from kvgen.build.nvcc import CompileError, Toolchain, cache_key, compile_shared_library, nvcc_flags, toolchain_for
from kvgen.files import copy_if_different
from kvgen.kernels import KERNELS_DIR
from kvgen.lower.layout import family_layout, to_json
from kvgen.lower.plan import KernelPlan, plans_for
from kvgen.lower.tuned import TunedParams
from kvgen.render.source import TEMPLATES_DIR, render_family, stale_files, write_rendered
from kvgen.spec.schema import FamilySpec, load_spec

HEADER_SUFFIXES = (".cuh", ".h", ".hpp", ".inl")
Status = Literal["hit", "built", "failed", "skipped"]


@dataclass(frozen=True)
class SpecSource:
    """A parsed spec with the sha256 of its file text (the manifest records which spec built it)."""

    spec: FamilySpec
    sha256: str
    path: Path | None = None


def load_spec_source(path: Path) -> SpecSource:
    path = Path(path)
    spec = load_spec(path)
    return SpecSource(spec, hashlib.sha256(path.read_bytes()).hexdigest(), path)


@dataclass(frozen=True)
class BuildOutcome:
    family: str
    arch: str
    status: Status
    seconds: float = 0.0
    artifact: Path | None = None          # in the registry
    key: str = ""
    error: str = ""


@dataclass
class BuildReport:
    outcomes: list[BuildOutcome] = field(default_factory=list)
    rendered: list[Path] = field(default_factory=list)      # generated files that changed
    manifests: list[Path] = field(default_factory=list)

    def with_status(self, status: Status) -> list[BuildOutcome]:
        return [o for o in self.outcomes if o.status == status]

    @property
    def ok(self) -> bool:
        return not self.with_status("failed")


class BuildProgress(Protocol):
    def start(self, total: int) -> None: ...

    def advance(self, outcome: BuildOutcome) -> None: ...


class _NoProgress:
    def start(self, total: int) -> None:
        pass

    def advance(self, outcome: BuildOutcome) -> None:
        pass


@dataclass(frozen=True)
class BuildJob:
    source: SpecSource
    arch: str
    toolchain: Toolchain
    plans: tuple[KernelPlan, ...]
    rendered: Mapping[str, str]           # "<family>/<name>" -> text

    @property
    def family(self) -> str:
        return self.source.spec.name

    @property
    def library(self) -> str:
        return f"lib{self.plans[0].symbol()}.so"


# ---------------------------------------------------------------- render


def _as_sources(specs: Sequence[SpecSource | Path]) -> list[SpecSource]:
    return [s if isinstance(s, SpecSource) else load_spec_source(Path(s)) for s in specs]


def render_all(specs: Sequence[SpecSource | Path], templates_dir: Path = TEMPLATES_DIR) -> dict[str, dict[str, str]]:
    """family -> {"<family>/<name>": text} with the safe default parameters, in memory: the
    arch-neutral rendering ``generated/`` holds (a tuned build differs only in launch constants,
    recorded per op in the manifest, its exact sources kept in the build cache entry)."""
    return {s.spec.name: render_family(s.spec, templates_dir) for s in _as_sources(specs)}


def check_generated(specs: Sequence[SpecSource | Path], out_generated: Path,
                    templates_dir: Path = TEMPLATES_DIR) -> list[str]:
    """Files under ``out_generated`` that a fresh render would change (empty: it is current)."""
    differ = []
    for rendered in render_all(specs, templates_dir).values():
        differ += stale_files(rendered, out_generated)
    return differ


# ---------------------------------------------------------------- compile one (family, arch)


def header_texts(kernels_dir: Path) -> dict[str, str]:
    """Hand-written headers the generated sources include; part of every cache key."""
    if not kernels_dir.is_dir():
        return {}
    paths = sorted(p for p in kernels_dir.rglob("*") if p.is_file() and p.suffix in HEADER_SUFFIXES)
    return {f"kernels/{p.relative_to(kernels_dir).as_posix()}": p.read_text(encoding="utf-8") for p in paths}


def _compile_into(tmp: Path, job: BuildJob, texts: Mapping[str, str], kernels_dir: Path,
                  extra_flags: Sequence[str]) -> dict[str, Any]:
    """Build function for ``get_or_build``: sources copied in, so the entry holds exactly what
    was hashed and a failed build keeps them for inspection."""
    src = tmp / "src"
    src.mkdir()
    for rel, text in job.rendered.items():
        (src / Path(rel).name).write_text(text, encoding="utf-8")
    sources = sorted(Path("src") / p.name for p in src.iterdir() if p.suffix == ".cu")
    includes = [d.resolve() for d in (kernels_dir / "include", kernels_dir / "cuda") if d.is_dir()] + [Path("src")]
    try:
        result = compile_shared_library(sources, job.arch, includes, Path(job.library), job.toolchain, extra_flags,
                                        cwd=tmp)
    except CompileError as exc:
        (tmp / "build.log").write_text(exc.log, encoding="utf-8")
        raise
    (tmp / "build.log").write_text(result.log, encoding="utf-8")
    return {
        "artifact": job.library,
        "family": job.family,
        "arch": job.arch,
        "toolchain": job.toolchain.identity(),
        "flags": nvcc_flags(job.arch, extra_flags),
        "sources_sha256": {rel: hashlib.sha256(t.encode()).hexdigest() for rel, t in sorted(texts.items())},
        "ptxas": {name: asdict(r) for name, r in sorted(result.kernels.items())},
        "compile_seconds": round(result.seconds, 3),
        "kvgen_version": __version__,
    }


def _kept_error(exc: CompileError, entry: Path) -> str:
    kept = failed_dir(entry)
    sources = [kept / s for s in exc.sources]
    return str(CompileError(f"{entry.name}: compile failed; sources and build.log kept in {kept}", exc.log,
                            exc.command, sources))


def _run_job(job: BuildJob, cache_dir: Path, kernels_dir: Path, extra_flags: Sequence[str]) -> tuple[BuildOutcome, dict]:
    texts = {**job.rendered, **header_texts(kernels_dir)}
    key = cache_key(texts, nvcc_flags(job.arch, extra_flags), job.toolchain, job.arch, CACHE_SCHEMA_VERSION)
    entry = entry_dir(cache_dir, __version__, job.arch, job.family, key)
    start = time.perf_counter()
    try:
        meta, hit = get_or_build(entry, key, lambda tmp: _compile_into(tmp, job, texts, kernels_dir, extra_flags))
    except CompileError as exc:
        return BuildOutcome(job.family, job.arch, "failed", time.perf_counter() - start, None, key,
                            _kept_error(exc, entry)), {}
    status: Status = "hit" if hit else "built"
    outcome = BuildOutcome(job.family, job.arch, status, time.perf_counter() - start, entry / meta["artifact"], key)
    return outcome, meta


# ---------------------------------------------------------------- registry


def _library_entry(job: BuildJob, meta: Mapping[str, Any]) -> LibraryEntry:
    ops = tuple(OpEntry(p.op, p.template, p.key(), dict(p.params)) for p in job.plans)
    spec = job.source.spec
    return LibraryEntry(family=job.family, arch=job.arch, symbol=job.plans[0].symbol(), ops=ops,
                        spec_sha256=job.source.sha256, artifact=job.library,
                        artifact_sha256=meta["artifact_sha256"], cache_key=meta["key"],
                        toolchain=meta["toolchain"]["version"], layout=to_json(spec, family_layout(spec)))


def publish(registry_dir: Path, arch: str, results: Sequence[tuple[BuildJob, BuildOutcome, dict]]) -> Path:
    """Copy this arch's artifacts into the registry and rewrite its manifest: entries of families
    built now are replaced (or dropped if they failed), other families' entries are kept."""
    path = manifest_path(registry_dir, arch)
    try:
        kept = list(parse_manifest(path).libraries) if path.exists() else []
    except RegistryError:
        kept = []   # unreadable old manifest: start over rather than carry garbage forward
    touched = {job.family for job, _, _ in results}
    libraries = [lib for lib in kept if lib.family not in touched]
    for job, outcome, meta in results:
        if outcome.status in ("hit", "built"):
            copy_if_different(outcome.artifact, path.parent / job.library, meta["artifact_sha256"])
            libraries.append(_library_entry(job, meta))
    write_manifest(path, Manifest(arch=arch, libraries=tuple(sorted(libraries, key=lambda lib: lib.family))))
    return path


# ---------------------------------------------------------------- entry


def _jobs(sources: Sequence[SpecSource], archs: Sequence[str] | None, rendered: Mapping[str, Mapping[str, str]],
          toolchains: Sequence[Toolchain], tuned: TunedParams, templates_dir: Path) -> tuple[list[BuildJob],
                                                                                           list[BuildOutcome]]:
    jobs, skipped = [], []
    for source in sources:
        spec = source.spec
        for arch in archs or spec.targets:
            if arch not in spec.targets:
                skipped.append(BuildOutcome(spec.name, arch, "skipped", error=f"{arch} is not in the spec's targets"))
                continue
            params = tuned.for_family(arch, spec.name)
            plans = tuple(plans_for(spec, params))
            texts = render_family(spec, templates_dir, params) if params else rendered[spec.name]
            jobs.append(BuildJob(source, arch, toolchain_for(arch, toolchains), plans, texts))
    return jobs, skipped


def build(specs: Sequence[SpecSource | Path], archs: Sequence[str] | None, out_generated: Path, cache_dir: Path,
          jobs: int = 1, tuned_params: TunedParams | None = None, progress: BuildProgress | None = None, *,
          toolchains: Sequence[Toolchain], registry_dir: Path = Path("build/registry"),
          templates_dir: Path = TEMPLATES_DIR, kernels_dir: Path = KERNELS_DIR,
          extra_flags: Sequence[str] = ()) -> BuildReport:
    """Render, compile (cached, ``jobs`` nvcc processes at once) and publish to the registry.

    ``tuned_params`` gives each (arch, family) its tuned launch parameters (``kvgen.lower.tuned``;
    default: the safe defaults). ``archs=None`` builds each spec's targets; an arch a spec does not target is skipped. A
    missing toolchain raises ``ToolchainError`` before anything compiles; a compile failure is
    reported in its outcome and the other pairs still build.
    """
    sources = _as_sources(specs)
    tuned = tuned_params or TunedParams()
    progress = progress or _NoProgress()
    rendered = render_all(sources, templates_dir)
    report = BuildReport()
    for files in rendered.values():
        report.rendered += write_rendered(files, Path(out_generated))
    todo, skipped = _jobs(sources, archs, rendered, toolchains, tuned, templates_dir)
    report.outcomes += skipped
    progress.start(len(todo))
    results: dict[str, list[tuple[BuildJob, BuildOutcome, dict]]] = {}
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        futures = {pool.submit(_run_job, job, Path(cache_dir), Path(kernels_dir), extra_flags): job for job in todo}
        for future in as_completed(futures):
            job = futures[future]
            outcome, meta = future.result()
            results.setdefault(job.arch, []).append((job, outcome, meta))
            progress.advance(outcome)
    for arch in sorted(results):
        path = publish(Path(registry_dir), arch, results[arch])
        report.manifests.append(path)
        report.outcomes += [_registry_outcome(path, o) for _, o, _ in results[arch]]
    report.outcomes.sort(key=lambda o: (o.family, o.arch))
    return report


def _registry_outcome(manifest: Path, outcome: BuildOutcome) -> BuildOutcome:
    """Report the registry copy (what the runtime loads), not the cache entry."""
    if outcome.artifact is None:
        return outcome
    return BuildOutcome(outcome.family, outcome.arch, outcome.status, outcome.seconds,
                        manifest.parent / outcome.artifact.name, outcome.key, outcome.error)
