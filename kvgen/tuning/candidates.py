"""Build side of tuning: every candidate configuration of (family, op, arch) compiled here, no GPU.

A candidate is the artifact the build would ship with those parameters (the whole family library
for ``codec``/``compact``, the score library for ``score``), built through the same content-hash
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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterable, Sequence

from kvgen import __version__
from kvgen.build.nvcc import Toolchain, toolchain_for
from kvgen.build.pipeline import BuildJob, SpecSource, _run_job
from kvgen.kernels import KERNELS_DIR
from kvgen.lower.plan import Op, plans_for, score_plan
from kvgen.render.source import render_family
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


def _build_family_library(request: Request, arch: str, toolchain: Toolchain, cache_dir: Path) -> tuple[str, Path | None,
                                                                                                         str, str]:
    """(status, artifact in the cache, key, error) of the family library with ``op``'s params."""
    spec = request.source.spec
    rendered = render_family(spec, params={request.op: request.params})
    plans = tuple(plans_for(spec, {request.op: request.params}))
    outcome, _ = _run_job(BuildJob(request.source, arch, toolchain, plans, rendered), cache_dir, KERNELS_DIR, ())
    return outcome.status, outcome.artifact, outcome.key, outcome.error


def build_candidates(requests: Sequence[Request], arch: str, out_dir: Path, cache_dir: Path, *,
                     toolchains: Sequence[Toolchain] = (), jobs: int = 2,
                     on_done: Callable[[Candidate], None] | None = None) -> list[Candidate]:
    """Build every request for ``arch`` into the bundle directory ``out_dir`` and write its index
    (candidates already in the bundle stay, unless rebuilt now).

    nvcc candidates build ``jobs`` at a time; score candidates go through one CuTe DSL export
    process per call (the DSL import dominates a single export). A failed build is a candidate
    with status "failed" (its error kept), never an exception: the tuner records it and moves on.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    done = on_done or (lambda _c: None)
    candidates: list[Candidate] = []
    versions = {"kvgen": __version__}
    nvcc_requests = [r for r in requests if r.op in ("codec", "compact")]
    score_requests = [r for r in requests if r.op == "score"]
    if nvcc_requests:
        toolchain = toolchain_for(arch, toolchains)
        versions["nvcc"] = toolchain.version
        with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
            futures = [(r, pool.submit(_build_family_library, r, arch, toolchain, cache_dir)) for r in nvcc_requests]
            for request, future in futures:
                status, artifact, key, error = future.result()
                candidates.append(_publish(out_dir, request, arch, status, artifact, key, error))
                done(candidates[-1])
    if score_requests:
        from kvgen.build.cute_aot import build_score_candidates, find_cute_toolchain

        cute = find_cute_toolchain()
        versions["cutlass_dsl"] = dict(cute.dsl_versions).get("nvidia-cutlass-dsl", "")
        plans = [score_plan(r.source.spec, r.params) for r in score_requests]
        for request, built in zip(score_requests, build_score_candidates(plans, arch, cache_dir, toolchain=cute)):
            candidates.append(_publish(out_dir, request, arch, built.status, built.artifact, built.key, built.error))
            done(candidates[-1])
    previous = read_bundle(out_dir) if (out_dir / BUNDLE_INDEX).exists() else {"candidates": [], "toolchains": {}}
    rebuilt = {(c.family, c.op, c.config) for c in candidates}
    kept = [Candidate(**c) for c in previous["candidates"] if (c["family"], c["op"], c["config"]) not in rebuilt]
    write_index(out_dir, arch, kept + candidates, {**previous["toolchains"], **versions})
    return candidates


def _publish(out_dir: Path, request: Request, arch: str, status: str, artifact: Path | None, key: str,
             error: str) -> Candidate:
    config = config_id(request.op, request.params)
    name = ""
    if artifact is not None and status != "failed":
        name = f"{request.source.spec.name}.{request.op}.{key[:16]}{artifact.suffix}"
        shutil.copyfile(artifact, out_dir / name)
    return Candidate(request.source.spec.name, request.op, arch, config, dict(request.params), status, name, key,
                     "\n".join(error.splitlines()[:40]))


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
