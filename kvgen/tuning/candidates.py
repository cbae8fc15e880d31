"""Build side of tuning: every candidate configuration of (family, op, arch) compiled here, no GPU.

A candidate is the artifact the build would ship with those parameters (the whole family library
for ``codec``/``compact``, the score library for ``score``, the selection library for ``select``), built through the same content-hash
cache as ``kvgen build``, so a winner is never rebuilt. A **bundle** is a directory holding the
candidates and ``bundle.json`` (plain data: family, op, arch, parameters, artifact, build status),
packed into one archive for the GPU machine: the libraries share their static CUDA runtime, so a
long-window compressor stores it once (hundreds of candidates fit in a few MiB).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tarfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterable, Sequence

from kvgen import __version__
from kvgen.build.compile import Toolchains, compile_many
from kvgen.build.cute_aot import find_cute_toolchain
from kvgen.build.job import BuildJob, BuildOutcome, SpecSource, family_jobs
from kvgen.build.nvcc import Toolchain, toolchain_for
from kvgen.build.triton_aot import triton_version
from kvgen.lower.plan import Op
from kvgen.tuning.space import config_id

BUNDLE_INDEX = "bundle.json"
BUNDLE_SCHEMA = 1


@dataclass(frozen=True)
class Candidate:
    family: str
    op: Op
    arch: str
    config: str                  # config_id: "threads=256,in_flight=4"
    params: dict[str, int]
    status: str                  # "built" | "hit" | "failed"
    artifact: str = ""           # file name inside the bundle ("" when the build failed)
    key: str = ""                # build cache key
    error: str = ""              # compiler output of a failed build (first lines)


@dataclass(frozen=True)
class Request:
    """One configuration to build."""

    source: SpecSource
    op: Op
    params: dict[str, int]


def candidate_job(request: Request, arch: str) -> BuildJob:
    """The job of the artifact that serves ``request.op``, built with its params (the family
    library for ``codec``/``compact``, the score library for ``score``), as ``kvgen build`` makes it."""
    jobs = family_jobs(request.source, arch, {request.op: request.params})
    return next(job for job in jobs if request.op in job.ops)


def build_candidates(requests: Sequence[Request], arch: str, out_dir: Path, cache_dir: Path, *,
                     toolchains: Sequence[Toolchain] = (), jobs: int = 2,
                     on_done: Callable[[Candidate], None] | None = None) -> list[Candidate]:
    """Build every request for ``arch`` into the bundle directory ``out_dir`` and write its index
    (candidates already in the bundle stay, unless rebuilt now).

    Compiled through ``kvgen.build.compile.compile_many``: nvcc candidates ``jobs`` at a time,
    score candidates in one CuTe DSL export process (the DSL import dominates a single export).
    A failed build is a candidate with status "failed" (its error kept), never an exception: the
    tuner records it and moves on.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    done = on_done or (lambda _c: None)
    versions = {"kvgen": __version__}
    compilers = Toolchains(tuple(toolchains))
    if any(r.op in ("codec", "compact") for r in requests):
        versions["nvcc"] = toolchain_for(arch, toolchains).version
    if any(r.op == "select" for r in requests):
        versions["triton"] = triton_version()
    if any(r.op == "score" for r in requests):
        compilers = Toolchains(tuple(toolchains), find_cute_toolchain())
        versions["cutlass_dsl"] = dict(compilers.cute.dsl_versions).get("nvidia-cutlass-dsl", "")
    todo = [candidate_job(r, arch) for r in requests]
    outcomes = compile_many(todo, cache_dir, compilers, workers=jobs)
    candidates = []
    for request, outcome in zip(requests, outcomes):
        candidates.append(_publish(out_dir, request, outcome))
        done(candidates[-1])
    previous = read_bundle(out_dir) if (out_dir / BUNDLE_INDEX).exists() else {"candidates": [], "toolchains": {}}
    rebuilt = {(c.family, c.op, c.config) for c in candidates}
    kept = [Candidate(**c) for c in previous["candidates"] if (c["family"], c["op"], c["config"]) not in rebuilt]
    write_index(out_dir, arch, kept + candidates, {**previous["toolchains"], **versions})
    return candidates


def _publish(out_dir: Path, request: Request, outcome: BuildOutcome) -> Candidate:
    config = config_id(request.op, request.params)
    name = ""
    if outcome.ok:
        name = f"{request.source.spec.name}.{request.op}.{outcome.key[:16]}{outcome.artifact.suffix}"
        shutil.copyfile(outcome.artifact, out_dir / name)
    return Candidate(request.source.spec.name, request.op, outcome.arch, config, dict(request.params), outcome.status,
                     name, outcome.key, "\n".join(outcome.error.splitlines()[:40]))


def write_index(out_dir: Path, arch: str, candidates: Iterable[Candidate], toolchains: dict[str, str]) -> Path:
    """``bundle.json``: the candidates and the compiler releases that built them (a tuned
    configuration is valid for those; the GPU side copies them into every measurement)."""
    index = {"schema": BUNDLE_SCHEMA, "kvgen_version": __version__, "arch": arch, "toolchains": toolchains,
             "candidates": [asdict(c) for c in candidates]}
    path = out_dir / BUNDLE_INDEX
    path.write_text(json.dumps(index, indent=1) + "\n", encoding="utf-8")
    return path


def read_index(bundle_dir: Path) -> list[Candidate]:
    """The candidates of a bundle; a missing or foreign index is a clear error naming the file."""
    return [Candidate(**c) for c in read_bundle(bundle_dir)["candidates"]]


def read_bundle(bundle_dir: Path) -> dict:
    path = Path(bundle_dir) / BUNDLE_INDEX
    try:
        index = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: not a kvgen candidate bundle ({exc})") from None
    if index.get("schema") != BUNDLE_SCHEMA:
        raise ValueError(f"{path}: bundle schema {index.get('schema')!r}, this kvgen reads {BUNDLE_SCHEMA}")
    return index


def pack_bundle(bundle_dir: Path, archive: Path) -> Path:
    """``bundle_dir`` as one ``.tar.xz`` whose LZMA window spans the whole tar, so the static CUDA
    runtime every library carries is stored once. Unpacked with the standard library alone."""
    archive.parent.mkdir(parents=True, exist_ok=True)
    tar = subprocess.run(["tar", "-C", str(bundle_dir), "-cf", "-", "."], capture_output=True, check=True)
    window = max(1 << 20, min(1 << 30, 1 << max(len(tar.stdout) - 1, 1).bit_length()))
    with open(archive, "wb") as out:
        subprocess.run(["xz", "-c", "-T1", f"--lzma2=preset=6,dict={window}"], input=tar.stdout, stdout=out, check=True)
    return archive


def unpack_bundle(archive: Path, dest: Path) -> Path:
    with tarfile.open(archive, "r:xz") as tar:
        tar.extractall(dest, filter="data")
    return dest
