"""No-op stamps: how a warm ``kvgen build`` that would change nothing finishes in a fraction of a
second, without rendering a template, probing a compiler or importing torch.

The full build (``kvgen.build.pipeline.build``) renders, probes nvcc and the CuTe DSL, looks each
artifact up in the content-addressed cache (``kvgen.build.cache``) and publishes. Each (family,
arch) that came out fully built then gets a stamp,
``<cache>/<kvgen version>/stamps/<arch>/<family>-<where>.json`` (``where`` hashes the registry
and generated folders, so two registries built from one cache keep their own stamps), holding:

- ``key``: a sha256 over every input that decides what the build makes, by content where it is
  ours to read: the spec file's bytes; every file of the kvgen package (code, templates, kernel
  headers) and of the templates and kernels folders passed in; the tuned file of this (arch,
  family), ``KVGEN_TUNING`` and ``KVGEN_TUNED_PARAMS``; the GPUs the driver lists; the extra
  flags, backends and output folders. Toolchains are named by the identity the caller gave, or,
  when they are probed on demand, by the state (real path, size, mtime, ctime, inode) of every
  file the probe would look at: the nvcc candidates and the host compiler. The Python that runs
  the build and its site-packages folders (any pip install changes them) are named the same way;
- ``outputs``: the state of each published artifact and generated file, taken after checking
  their bytes against what the build made, and the sha256 of the family's manifest entry;
- ``tools``: the state of the compilers the probe found (nvcc behind a wrapper, the CuTe DSL's
  runtime library, cudart, the C++ compiler);
- the outcomes and the tuning notes the build reported.

``Stamps.replay`` returns the report of a build whose every (family, arch) has a stamp with this
key whose outputs and tools are in the recorded state; anything else is None, and the full build
runs (correct either way; only slower). Outputs are compared by state, as ninja and FlashInfer
do, because they are what this build wrote; ``kvgen verify`` re-hashes them.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import sysconfig
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import kvgen
from kvgen import __version__
from kvgen.artifacts.manifest import manifest_path
from kvgen.build.job import BuildJob, BuildOutcome, SpecSource
from kvgen.files import file_sha256, write_json_atomic
from kvgen.lower.tuned import tuning_path

# Bump when the stamp's fields or what its key covers change: old stamps then miss.
STAMP_SCHEMA = 1
PACKAGE_DIR = Path(kvgen.__file__).resolve().parent

State = list[int] | None          # [size, mtime_ns, ctime_ns, inode]; None: no such file


def file_state(path: Path | str) -> State:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]


def tool_state(path: Path | str) -> list[Any]:
    """A tool named by where it really is and the state of that file (a symlink swap shows)."""
    return [os.path.realpath(path), file_state(path)]


def tree_digest(roots: Iterable[Path]) -> str:
    """sha256 over every file under ``roots`` (bytecode caches aside): name, length and bytes."""
    digest = hashlib.sha256()
    for root in roots:
        root = Path(root).resolve()
        digest.update(f"root {root}\0".encode())
        files = sorted(p for p in root.rglob("*") if p.is_file() and "__pycache__" not in p.parts)
        for path in files:
            data = path.read_bytes()
            digest.update(f"{path.relative_to(root).as_posix()}\0{len(data)}\0".encode())
            digest.update(data)
    return digest.hexdigest()


def code_roots(templates_dir: Path, kernels_dir: Path) -> list[Path]:
    """The kvgen package, and the templates and kernels folders where they lie outside it."""
    roots = [PACKAGE_DIR]
    for folder in (Path(templates_dir).resolve(), Path(kernels_dir).resolve()):
        if folder.is_dir() and not folder.is_relative_to(PACKAGE_DIR):
            roots.append(folder)
    return roots


def python_state() -> dict[str, Any]:
    """The interpreter and its site-packages folders: installing, upgrading or removing any
    distribution (the CuTe DSL, Jinja2, a pip nvcc, torch) changes a folder's mtime."""
    folders = sorted({sysconfig.get_paths()[name] for name in ("purelib", "platlib")})
    return {"python": tool_state(sys.executable), "site": {f: file_state(f) for f in folders}}


def _sha(document: Any) -> str:
    return hashlib.sha256(json.dumps(document, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _optional_sha(path: Path) -> str | None:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None


def manifest_entry_sha(manifests: dict[Path, Any], registry_dir: Path, arch: str, family: str) -> str | None:
    """sha256 of the manifest's own fields and ``family``'s entry (None: no such entry). Parsed
    manifests are kept in ``manifests``: a replay reads each one once."""
    path = manifest_path(registry_dir, arch)
    if path not in manifests:
        try:
            manifests[path] = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            manifests[path] = None
    data = manifests[path]
    if not isinstance(data, dict) or not isinstance(data.get("families"), list):
        return None
    entry = next((e for e in data["families"] if isinstance(e, dict) and e.get("family") == family), None)
    if entry is None:
        return None
    return _sha({"manifest": {k: v for k, v in data.items() if k != "families"}, "entry": entry})


@dataclass
class Stamps:
    """The stamps of one build request: where they live and the inputs every key shares."""

    cache_dir: Path
    registry_dir: Path
    out_generated: Path
    common: Mapping[str, Any]                  # see ``common_inputs``
    tuning_dir: Path
    manifests: dict[Path, Any] = field(default_factory=dict)

    def path(self, family: str, arch: str) -> Path:
        where = _sha([str(Path(self.registry_dir).resolve()), str(Path(self.out_generated).resolve())])[:16]
        return Path(self.cache_dir) / __version__ / "stamps" / arch / f"{family}-{where}.json"

    def key(self, source: SpecSource, arch: str) -> str:
        tuned = tuning_path(self.tuning_dir, arch, source.spec.name)
        return _sha({**self.common, "spec_sha256": source.sha256, "family": source.spec.name, "arch": arch,
                     "tuned_file": [str(tuned), _optional_sha(tuned)]})

    # ------------------------------------------------------------ replay

    def current(self, source: SpecSource, arch: str) -> dict[str, Any] | None:
        """The stamp of (family, arch) when its key, outputs and tools are all as recorded."""
        try:
            stamp = json.loads(self.path(source.spec.name, arch).read_text(encoding="utf-8"))
            if stamp.get("schema") != STAMP_SCHEMA or stamp.get("key") != self.key(source, arch):
                return None
            if any(file_state(p) != state for p, state in stamp["outputs"].items()):
                return None
            if any(tool_state(p) != state for p, state in stamp["tools"].items()):
                return None
            sha = manifest_entry_sha(self.manifests, self.registry_dir, arch, source.spec.name)
            return stamp if sha is not None and sha == stamp["manifest_entry_sha256"] else None
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return None

    # ------------------------------------------------------------ record

    def record(self, source: SpecSource, arch: str, results: Sequence[tuple[BuildJob, BuildOutcome]],
               rendered: Mapping[str, str], notes: Sequence[str], tools: Iterable[Path | str]) -> bool:
        """Stamp (family, arch) after a build whose every artifact of it published; nothing is
        stamped unless the registry and generated files hold exactly what this build made (a
        concurrent build may have published over them)."""
        if not results or not all(o.ok and o.artifact for _, o in results):
            return False
        outputs = _checked_states([(Path(o.artifact), o.sha256) for _, o in results] +
                                  [(Path(self.out_generated) / rel, _text_sha(text)) for rel, text in rendered.items()])
        if outputs is None:
            return False
        self.manifests.clear()   # the build has just rewritten them
        sha = manifest_entry_sha(self.manifests, self.registry_dir, arch, source.spec.name)
        if sha is None or not self._entry_matches(arch, source, results):
            return False
        prefix = f"{tuning_path(self.tuning_dir, arch, source.spec.name)}:"
        stamp = {"schema": STAMP_SCHEMA, "key": self.key(source, arch), "family": source.spec.name, "arch": arch,
                 "outputs": outputs, "tools": {str(t): tool_state(t) for t in tools},
                 "manifest_entry_sha256": sha, "tuning_notes": [n for n in notes if n.startswith(prefix)],
                 "outcomes": [_outcome_json(o) for _, o in results]}
        path = self.path(source.spec.name, arch)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(path, stamp)
        return True

    def _entry_matches(self, arch: str, source: SpecSource, results: Sequence[tuple[BuildJob, BuildOutcome]]) -> bool:
        data = self.manifests.get(manifest_path(self.registry_dir, arch)) or {}
        entry = next(e for e in data["families"] if e.get("family") == source.spec.name)
        listed = {a["file"]: a["sha256"] for a in entry.get("artifacts", [])}
        return entry.get("spec_sha256") == source.sha256 and listed == {j.artifact: o.sha256 for j, o in results}


def _text_sha(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _checked_states(files: Sequence[tuple[Path, str]]) -> dict[str, State] | None:
    """path -> state of each file whose bytes have the sha256 given, the same state before and
    after hashing (else None: something is writing them)."""
    states = {}
    for path, sha in files:
        before = file_state(path)
        try:
            same = before is not None and file_sha256(path) == sha and file_state(path) == before
        except OSError:
            return None
        if not same:
            return None
        states[str(path)] = before
    return states


def _outcome_json(o: BuildOutcome) -> dict[str, Any]:
    return {"backend": o.backend, "artifact": str(o.artifact), "key": o.key, "sha256": o.sha256,
            "toolchain": dict(o.toolchain)}


def replayed_outcomes(stamp: Mapping[str, Any]) -> list[BuildOutcome]:
    """The outcomes a stamp recorded, as cache hits (which is what a full build would report)."""
    return [BuildOutcome(stamp["family"], stamp["arch"], o["backend"], "hit", 0.0, Path(o["artifact"]), o["key"],
                         sha256=o["sha256"], toolchain=o["toolchain"]) for o in stamp["outcomes"]]


def common_inputs(*, given_toolchains: Sequence[Any] | None, toolchain_files: Sequence[Path | str],
                  cute_identity: Mapping[str, Any] | None, templates_dir: Path, kernels_dir: Path,
                  extra_flags: Sequence[str], backends: Iterable[str], tuning: Mapping[str, Any],
                  gpus: Sequence[str], cache_dir: Path) -> dict[str, Any]:
    """The part of every key a build request shares (computed once: the code digest reads ~100
    files). ``given_toolchains`` are identity dicts when the caller probed them; otherwise the
    state of ``toolchain_files`` stands for what a probe would find."""
    return {
        "schema": STAMP_SCHEMA, "kvgen": __version__, "code": tree_digest(code_roots(templates_dir, kernels_dir)),
        "python": python_state(), "nvcc": given_toolchains,
        "nvcc_files": {str(p): tool_state(p) for p in toolchain_files}, "cute": cute_identity,
        "extra_flags": list(extra_flags), "backends": sorted(backends), "tuning": dict(tuning),
        "gpus": list(gpus), "cache_dir": str(Path(cache_dir).resolve()),
    }
