"""Compile ``BuildJob``s, every backend through the same content-hash cache
(``kvgen.build.cache.get_or_build``): ``compile_one`` for one job, ``compile_many`` for a batch.
``kvgen build`` and the tuner both compile here.

- ``nvcc``: the rendered ``.cu`` sources + the hand-written headers -> ``lib<symbol>.so``;
- ``cute``: the rendered score module -> CuTe DSL export (a child process per arch) -> linked
  ``lib<symbol>_score.so`` (``kvgen.build.cute_aot``);
- ``triton-aot`` (selection, packer): the rendered ``select.py`` / ``pack.py`` -> Triton cubins for
  the arch -> the op's C shim -> ``lib<symbol>_select.so`` / ``lib<symbol>_pack.so``
  (``kvgen.build.triton_aot``).

A compile failure is a ``failed`` outcome carrying its log, never an exception; a missing nvcc
for the arch raises ``ToolchainError`` (a configuration error, reported before anything runs).
"""

from __future__ import annotations

import hashlib
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from kvgen import __version__
from kvgen.build.cache import CACHE_SCHEMA_VERSION, entry_dir, failed_dir, get_or_build
from kvgen.build.cute_aot import CuteCompileError, CuteToolchain, compile_scores, find_cute_toolchain
from kvgen.build.job import BuildJob, BuildOutcome
from kvgen.build.nvcc import CompileError, Toolchain, cache_key, compile_shared_library, nvcc_flags, toolchain_for
from kvgen.build.process import kill_all
from kvgen.build.triton_aot import compile_aot
from kvgen.kernels import KERNELS_DIR

HEADER_SUFFIXES = (".cuh", ".h", ".hpp", ".inl")
OnDone = Callable[[BuildOutcome], None]


@dataclass(frozen=True)
class Toolchains:
    """The compilers a batch may use: nvcc toolchains (the first supporting an arch wins) and the
    CuTe DSL (probed on first need when None)."""

    nvcc: Sequence[Toolchain] = ()
    cute: CuteToolchain | None = None
    cute_error: str = ""            # why there is no CuTe DSL toolchain (set by ``probe_cute``)

    def probe_cute(self) -> Toolchains:
        """These toolchains with the CuTe DSL probed, unless that was done: a failure is kept in
        ``cute_error`` (the score jobs then fail with it) rather than raised, so the other
        artifacts still build."""
        if self.cute is not None or self.cute_error:
            return self
        try:
            return replace(self, cute=find_cute_toolchain())
        except CuteCompileError as exc:
            return replace(self, cute_error=f"TriAttention score library not built: {exc}")


def compile_one(job: BuildJob, cache_dir: Path, toolchains: Toolchains, *, kernels_dir: Path = KERNELS_DIR,
                extra_flags: Sequence[str] = ()) -> BuildOutcome:
    """The job's artifact in the cache (built if its key is not there yet)."""
    (outcome,) = compile_many([job], cache_dir, toolchains, kernels_dir=kernels_dir, extra_flags=extra_flags)
    return outcome


def compile_many(jobs: Sequence[BuildJob], cache_dir: Path, toolchains: Toolchains, *, workers: int = 1,
                 kernels_dir: Path = KERNELS_DIR, extra_flags: Sequence[str] = (),
                 on_done: OnDone | None = None) -> list[BuildOutcome]:
    """Outcomes of ``jobs``, in their order. nvcc and Triton jobs run ``workers`` at a time; the
    score jobs of one arch share one CuTe DSL export process (the DSL import costs seconds), and
    those processes take worker slots too. ``on_done`` sees each outcome as it is known."""
    done = on_done or (lambda _outcome: None)
    cache_dir = Path(cache_dir)
    outcomes: dict[int, BuildOutcome] = {}
    score_jobs: dict[str, list[int]] = {}
    for index, job in enumerate(jobs):
        if job.backend == "cute":
            score_jobs.setdefault(job.arch, []).append(index)
        elif _needs_nvcc(job):
            toolchain_for(job.arch, toolchains.nvcc)   # a missing nvcc is an error before anything compiles
    if score_jobs:
        toolchains = toolchains.probe_cute()

    def single(index: int) -> list[tuple[int, BuildOutcome]]:
        job = jobs[index]
        if job.backend == "nvcc":
            return [(index, _compile_nvcc(job, cache_dir, toolchain_for(job.arch, toolchains.nvcc), kernels_dir,
                                          extra_flags))]
        return [(index, compile_aot(job, cache_dir, toolchain_for(job.arch, toolchains.nvcc)))]

    def scores(indices: list[int]) -> list[tuple[int, BuildOutcome]]:
        if toolchains.cute is None:
            return [(i, _failed(jobs[i], toolchains.cute_error)) for i in indices]
        return list(zip(indices, compile_scores([jobs[i] for i in indices], cache_dir, toolchains.cute)))

    pool = ThreadPoolExecutor(max_workers=max(1, workers))
    try:
        # export processes first: each is the longest single task, so it should not queue behind nvcc
        futures = [pool.submit(scores, indices) for _, indices in sorted(score_jobs.items())]
        futures += [pool.submit(single, i) for i, job in enumerate(jobs) if job.backend != "cute"]
        for future in as_completed(futures):
            for index, outcome in future.result():
                outcomes[index] = outcome
                done(outcome)
    except BaseException:
        # interrupted (Ctrl-C, an error): nothing queued starts, every running compiler group dies
        pool.shutdown(wait=False, cancel_futures=True)
        kill_all()
        raise
    pool.shutdown()
    return [outcomes[i] for i in range(len(jobs))]


def _needs_nvcc(job: BuildJob) -> bool:
    """The nvcc libraries, and the Triton AOT libraries (their shims are compiled by nvcc)."""
    return job.backend in ("nvcc", "triton-aot")


def _failed(job: BuildJob, error: str, key: str = "", seconds: float = 0.0) -> BuildOutcome:
    return BuildOutcome(job.family, job.arch, job.backend, "failed", seconds, None, key, error)


# ---------------------------------------------------------------- nvcc


def header_texts(kernels_dir: Path) -> dict[str, str]:
    """Hand-written headers the generated sources include; part of every nvcc cache key."""
    if not kernels_dir.is_dir():
        return {}
    paths = sorted(p for p in kernels_dir.rglob("*") if p.is_file() and p.suffix in HEADER_SUFFIXES)
    return {f"kernels/{p.relative_to(kernels_dir).as_posix()}": p.read_text(encoding="utf-8") for p in paths}


def _nvcc_into(tmp: Path, job: BuildJob, texts: Mapping[str, str], toolchain: Toolchain, kernels_dir: Path,
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
        result = compile_shared_library(sources, job.arch, includes, Path(job.artifact), toolchain, extra_flags,
                                        cwd=tmp)
    except CompileError as exc:
        (tmp / "build.log").write_text(exc.log, encoding="utf-8")
        raise
    (tmp / "build.log").write_text(result.log, encoding="utf-8")
    return {
        **job.entry_meta(),
        "toolchain": toolchain.identity(),
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


def _compile_nvcc(job: BuildJob, cache_dir: Path, toolchain: Toolchain, kernels_dir: Path,
                  extra_flags: Sequence[str]) -> BuildOutcome:
    texts = {**job.rendered, **header_texts(kernels_dir)}
    key = cache_key(texts, nvcc_flags(job.arch, extra_flags), toolchain, job.arch, CACHE_SCHEMA_VERSION)
    entry = entry_dir(cache_dir, __version__, job.arch, job.family, key)
    start = time.perf_counter()
    try:
        meta, hit = get_or_build(entry, key, lambda tmp: _nvcc_into(tmp, job, texts, toolchain, kernels_dir,
                                                                    extra_flags))
    except CompileError as exc:
        return _failed(job, _kept_error(exc, entry), key, time.perf_counter() - start)
    return BuildOutcome(job.family, job.arch, job.backend, "hit" if hit else "built", time.perf_counter() - start,
                        entry / meta["artifact"], key, sha256=meta["artifact_sha256"],
                        toolchain={"nvcc": meta["toolchain"]["version"]})
