"""``kvgen build``: render every family, compile every artifact per (family, arch), publish.

Flow: specs -> ``render_family`` -> ``generated/<family>/`` (write_if_different) -> the tuned
parameters valid for this build (``kvgen.lower.tuned``, checked against
``kvgen.build.environment``) -> per (family, arch) one ``BuildJob`` per backend
(``kvgen.build.job.family_jobs``: the nvcc library, and for TriAttention families the CuTe DSL
score library and the Triton packer) -> ``compile_many`` (cached) -> ``publish``: every artifact
copied into ``<registry>/<arch>/`` and listed, with its sha256, in that arch's ``manifest.json``.

A Python caller of ``build()`` gets exactly what ``kvgen build`` makes. Nothing here prints; the
CLI passes paths and toolchains in and shows progress through ``BuildProgress``.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping, Protocol, Sequence

from kvgen import paths
from kvgen.artifacts.manifest import (
    ArtifactEntry,
    FamilyEntry,
    Manifest,
    OpEntry,
    RegistryError,
    VariantEntry,
    manifest_path,
    parse_manifest,
    write_manifest,
)
from kvgen.build.compile import Toolchains, compile_many
from kvgen.build.cute_aot import CuteToolchain
from kvgen.build.environment import build_environments, gpu_fingerprint, gpu_name
from kvgen.build.job import (
    BACKENDS,
    Backend,
    BuildJob,
    BuildOutcome,
    SpecSource,
    Status,
    family_jobs,
    load_spec_source,
    variant_plan,
)
from kvgen.build.nvcc import Toolchain
from kvgen.build.stamp import Stamps, common_inputs, replayed_outcomes
from kvgen.files import copy_if_different, file_lock, require_writable
from kvgen.kernels import KERNELS_DIR
from kvgen.lower.layout import family_layout, to_json
from kvgen.lower.plan import KernelPlan
from kvgen.lower.tuned import TunedParams, load_tuned, switch_notes
from kvgen.render.source import TEMPLATES_DIR, render_family, stale_files, write_rendered
from kvgen.spec.schema import name_collisions


@dataclass
class BuildReport:
    outcomes: list[BuildOutcome] = field(default_factory=list)
    rendered: list[Path] = field(default_factory=list)      # generated files that changed
    manifests: list[Path] = field(default_factory=list)
    tuning_notes: list[str] = field(default_factory=list)   # tuned files not used (or overrides), one line each
    noop: bool = False                                      # every (family, arch) current by its stamp

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


# ---------------------------------------------------------------- registry


def _family_entry(built: Sequence[tuple[BuildJob, BuildOutcome]], tuned: TunedParams | None = None) -> FamilyEntry:
    """The manifest entry of one family from its built artifacts (an op whose artifact failed is
    not listed: the runtime then refuses that op with the rebuild command; a variant whose artifact
    failed is left out: its calls take the library below it); each op says how its parameters
    were chosen (``tuned.method``: measured, model-tuned, override or default)."""
    source, arch = built[0][0].source, built[0][0].arch
    ops, artifacts = [], []
    for job, outcome in built:
        artifacts.append(ArtifactEntry(job.artifact, outcome.sha256, job.backend, outcome.key,
                                       dict(outcome.toolchain)))
        if job.variant is None:
            ops += [OpEntry(p.op, job.artifact, p.template, p.key(), dict(p.params),
                            tuned.method(arch, job.family, p.op) if tuned else "default",
                            _variant_entries(built, p, tuned)) for p in job.plans]
    spec = source.spec
    return FamilyEntry(family=spec.name, arch=arch, symbol=built[0][0].symbol, spec_sha256=source.sha256,
                       ops=tuple(sorted(ops, key=lambda op: op.op)), artifacts=tuple(artifacts),
                       layout=to_json(spec, family_layout(spec)))


def _variant_entries(built: Sequence[tuple[BuildJob, BuildOutcome]], main: KernelPlan,
                     tuned: TunedParams | None) -> tuple[VariantEntry, ...]:
    """The size-dispatched variants of the op of ``main`` (its plan), each served by the built
    artifact of its plan (the op's own where the variant compiles to the same plan)."""
    if tuned is None:
        return ()
    job = built[0][0]
    by_plan = {p.key(): j.artifact for j, _ in built for p in j.plans if p.op == main.op}
    entries = []
    for variant in tuned.variants_for(job.arch, job.family).get(main.op, ()):
        plan = variant_plan(job.source.spec, tuned.for_family(job.arch, job.family), main.op, variant)
        if plan.key() in by_plan:   # else its library failed to build: its calls take the one below
            entries.append(VariantEntry(variant.from_work, variant.bucket, by_plan[plan.key()], plan.key(),
                                        dict(plan.params)))
    return tuple(entries)


def registry_lock(registry_dir: Path, arch: str) -> Path:
    """The lock file of one arch's manifest: one writer at a time. In the registry's root, so an arch
    folder holds exactly its manifest and the artifacts it lists."""
    return Path(registry_dir) / f".{arch}.manifest.lock"


def publish(registry_dir: Path, arch: str, results: Sequence[tuple[BuildJob, BuildOutcome]],
            tuned: TunedParams | None = None) -> Path:
    """Copy this arch's built artifacts into the registry (each atomically), then rewrite its
    manifest (last, atomically): the families built now get new entries listing what built (a
    family nothing of which built is dropped), other families' entries are kept. All of it
    under the registry lock, so concurrent builds of other families lose nothing and a manifest
    never lists an artifact another build replaced after it was hashed."""
    path = manifest_path(registry_dir, arch)
    with file_lock(registry_lock(registry_dir, arch)):
        _publish_locked(path, arch, results, tuned)
    return path


def _publish_locked(path: Path, arch: str, results: Sequence[tuple[BuildJob, BuildOutcome]],
                    tuned: TunedParams | None) -> None:
    try:
        kept = list(parse_manifest(path).families) if path.exists() else []
    except RegistryError:
        kept = []   # unreadable old manifest: start over rather than carry garbage forward
    by_family: dict[str, list[tuple[BuildJob, BuildOutcome]]] = {}
    for job, outcome in results:
        by_family.setdefault(job.family, [])
        if outcome.ok:
            copy_if_different(outcome.artifact, path.parent / job.artifact, outcome.sha256,
                              mode=0o644 if job.backend == "triton" else 0o755)
            by_family[job.family].append((job, outcome))
    entries = [entry for entry in kept if entry.family not in by_family]
    entries += [_family_entry(built, tuned) for built in by_family.values() if built]
    write_manifest(path, Manifest(arch=arch, families=tuple(sorted(entries, key=lambda e: e.family))))


# ---------------------------------------------------------------- entry


def _pairs(sources: Sequence[SpecSource], archs: Sequence[str] | None) -> tuple[list[tuple[SpecSource, str]],
                                                                               list[BuildOutcome]]:
    """(source, arch) to build, and a skipped outcome for each arch a spec does not target."""
    pairs, skipped = [], []
    for source in sources:
        for arch in archs or source.spec.targets:
            if arch in source.spec.targets:
                pairs.append((source, arch))
            else:
                skipped.append(BuildOutcome(source.spec.name, arch, None, "skipped",
                                            error=f"{arch} is not in the spec's targets"))
    return pairs, skipped


def _needs_score(pairs: Sequence[tuple[SpecSource, str]], backends: Collection[Backend]) -> bool:
    """Every spec target is one the CuTe DSL exports for (``kvgen.arch.ARCHS``), so a TriAttention
    family always gets a score library."""
    return "cute" in backends and any(source.spec.triattention.enabled for source, _ in pairs)


def build(specs: Sequence[SpecSource | Path], archs: Sequence[str] | None, out_generated: Path, cache_dir: Path,
          jobs: int = 1, progress: BuildProgress | None = None, *,
          toolchains: Sequence[Toolchain] | Callable[[], Sequence[Toolchain]],
          cute_toolchain: CuteToolchain | None = None, registry_dir: Path = Path("build/registry"),
          tuning_dir: Path = Path("tuning"), tuning_environ: Mapping[str, str] | None = None,
          templates_dir: Path = TEMPLATES_DIR, kernels_dir: Path = KERNELS_DIR, extra_flags: Sequence[str] = (),
          backends: Collection[Backend] = BACKENDS, noop_stamps: bool = False,
          toolchain_files: Sequence[Path | str] = ()) -> BuildReport:
    """Render, compile every artifact (cached, ``jobs`` compiles at once) and publish to the registry.

    ``archs=None`` builds each spec's targets; an arch a spec does not target is skipped. Tuned
    launch parameters come from ``tuning_dir`` where they match this build's environment
    (``KVGEN_TUNING`` / ``KVGEN_TUNED_PARAMS`` read from ``tuning_environ``, default the process
    environment, exactly as ``kvgen build`` does). ``toolchains`` may be a function that probes
    them, called only when something has to be built. The CuTe DSL toolchain is probed when a
    score library is due and ``cute_toolchain`` is None. ``backends`` narrows what is compiled
    (tests of one backend). A missing nvcc raises ``ToolchainError`` before anything compiles; a
    compile failure is reported in its outcome and everything else still builds and publishes.

    ``noop_stamps`` (what ``kvgen build`` passes): when every (family, arch) is current by its
    stamp (``kvgen.build.stamp``), return the report a full build would give without rendering,
    probing or compiling (``report.noop``); otherwise build, then stamp what built.
    ``toolchain_files`` are the files a ``toolchains`` function would probe (nvcc candidates, the
    host compiler): their state stands for its result in the stamps' key.
    """
    sources = _as_sources(specs)
    collisions = name_collisions([(s.path or s.spec.name, s.spec) for s in sources])
    if collisions:
        raise collisions[0]   # two families would build one library
    progress = progress or _NoProgress()
    pairs, skipped = _pairs(sources, archs)
    stamps = _stamps(toolchains, toolchain_files, cute_toolchain, templates_dir, kernels_dir, extra_flags, backends,
                     tuning_environ, cache_dir, registry_dir, out_generated, tuning_dir) if noop_stamps else None
    if stamps is not None:
        replayed = _replay(stamps, pairs, skipped, progress, tuning_environ)
        if replayed is not None:
            return replayed
    report = BuildReport(outcomes=skipped)
    rendered = render_all(sources, templates_dir)
    for files in rendered.values():
        report.rendered += write_rendered(files, Path(out_generated))
    toolchains = tuple(toolchains() if callable(toolchains) else toolchains)
    compilers = Toolchains(toolchains, cute_toolchain)
    if _needs_score(pairs, backends):
        compilers = compilers.probe_cute()    # once, before the tuned files are checked against its version
    tuned = _tuned(sources, pairs, toolchains, compilers.cute, tuning_dir, tuning_environ)
    report.tuning_notes = tuned.notes
    todo = [job for source, arch in pairs
            for job in family_jobs(source, arch, tuned.for_family(arch, source.spec.name), templates_dir,
                                   tuned.variants_for(arch, source.spec.name))
            if job.backend in backends]
    if todo:
        require_writable(Path(registry_dir))   # before minutes of compiling, not at publish
    progress.start(len(todo))
    outcomes = compile_many(todo, Path(cache_dir), compilers, workers=jobs,
                            kernels_dir=Path(kernels_dir), extra_flags=extra_flags, on_done=progress.advance)
    published = []
    for arch in sorted({job.arch for job in todo}):
        results = [(job, outcome) for job, outcome in zip(todo, outcomes) if job.arch == arch]
        path = publish(Path(registry_dir), arch, results, tuned)
        report.manifests.append(path)
        published += [(job, _registry_outcome(path, job, outcome)) for job, outcome in results]
    report.outcomes += [outcome for _, outcome in published]
    report.outcomes.sort(key=lambda o: (o.family, o.arch, o.backend or ""))
    if stamps is not None:
        _stamp(stamps, pairs, published, rendered, report.tuning_notes, _tool_files(toolchains, compilers.cute))
    return report


# ---------------------------------------------------------------- no-op stamps


def _stamps(toolchains: Sequence[Toolchain] | Callable[[], Sequence[Toolchain]], toolchain_files: Sequence[Path | str],
            cute: CuteToolchain | None, templates_dir: Path, kernels_dir: Path, extra_flags: Sequence[str],
            backends: Collection[Backend], environ: Mapping[str, str] | None, cache_dir: Path, registry_dir: Path,
            out_generated: Path, tuning_dir: Path) -> Stamps:
    given = None if callable(toolchains) else [{**t.identity(), "archs": list(t.archs)} for t in toolchains]
    tuning = {"enabled": paths.tuning_enabled(environ), "override": paths.tuned_params_override(environ)}
    common = common_inputs(given_toolchains=given, toolchain_files=toolchain_files,
                           cute_identity=cute.identity() if cute is not None else None, templates_dir=templates_dir,
                           kernels_dir=kernels_dir, extra_flags=extra_flags, backends=backends, tuning=tuning,
                           gpus=gpu_fingerprint(environ), cache_dir=cache_dir)
    return Stamps(Path(cache_dir), Path(registry_dir), Path(out_generated), common, Path(tuning_dir))


def _replay(stamps: Stamps, pairs: Sequence[tuple[SpecSource, str]], skipped: list[BuildOutcome],
            progress: BuildProgress, environ: Mapping[str, str] | None) -> BuildReport | None:
    """The report of a no-op build, or None when some (family, arch) is not current."""
    before, after = switch_notes(environ)   # a bad override is an error on this path too
    current = []
    for source, arch in sorted(pairs, key=lambda pair: pair[1]):   # the full build's note order
        stamp = stamps.current(source, arch)
        if stamp is None:
            return None
        current.append(stamp)
    if not current:
        return None
    outcomes = [o for stamp in current for o in replayed_outcomes(stamp)]
    progress.start(len(outcomes))
    for outcome in outcomes:
        progress.advance(outcome)
    notes = before + [note for stamp in current for note in stamp["tuning_notes"]] + after
    archs = sorted({arch for _, arch in pairs})
    return BuildReport(outcomes=sorted(skipped + outcomes, key=lambda o: (o.family, o.arch, o.backend or "")),
                       manifests=[manifest_path(stamps.registry_dir, arch) for arch in archs],
                       tuning_notes=notes, noop=True)


def _tool_files(toolchains: Sequence[Toolchain], cute: CuteToolchain | None) -> list[str]:
    """The compilers a probe found: their state must stay as it was for a stamp to hold."""
    files = [path for t in toolchains for path in (t.nvcc, t.host_cc) if path]
    if cute is not None:
        files += [cute.runtime_lib, cute.cudart_static, cute.cxx]
    return sorted(set(files))


def _stamp(stamps: Stamps, pairs: Sequence[tuple[SpecSource, str]], published: Sequence[tuple[BuildJob, BuildOutcome]],
           rendered: Mapping[str, Mapping[str, str]], notes: Sequence[str], tools: Sequence[str]) -> None:
    for source, arch in pairs:
        family = source.spec.name
        results = [(job, outcome) for job, outcome in published if job.family == family and job.arch == arch]
        stamps.record(source, arch, results, rendered[family], notes, tools)


def _tuned(sources: Sequence[SpecSource], pairs: Sequence[tuple[SpecSource, str]], toolchains: Sequence[Toolchain],
           cute: CuteToolchain | None, tuning_dir: Path, environ: Mapping[str, str] | None) -> TunedParams:
    archs = sorted({arch for _, arch in pairs})
    envs = build_environments(archs, toolchains, cute, gpu_name())
    return load_tuned(Path(tuning_dir), envs, [s.spec.name for s in sources], environ)


def _registry_outcome(manifest: Path, job: BuildJob, outcome: BuildOutcome) -> BuildOutcome:
    """Report the registry copy (what the runtime loads), not the cache entry."""
    if not outcome.ok:
        return outcome
    return BuildOutcome(outcome.family, outcome.arch, outcome.backend, outcome.status, outcome.seconds,
                        manifest.parent / job.artifact, outcome.key, outcome.error, outcome.sha256, outcome.toolchain)
