"""The kernel registry: ``<registry>/<arch>/manifest.json`` plus the shared libraries it names.

The manifest records the decision (family, ops, params, plan keys) and the artifact's sha256;
``read_manifest`` refuses a manifest written by another format or kvgen version, and an artifact
whose bytes do not match, with an error naming the file and the command that rebuilds it.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Mapping

from kvgen import __version__
from kvgen.files import file_sha256, write_json_atomic

FORMAT_VERSION = 1
# The C ABI of the generated libraries (entry-point names and argument lists). Bump on any change
# a loader would have to know about; the runtime refuses libraries of another ABI.
ABI_VERSION = 1
MANIFEST = "manifest.json"


class RegistryError(RuntimeError):
    """A manifest or artifact that must not be loaded; the message says how to rebuild it."""


def fix_command(arch: str, family: str | None = None) -> str:
    return f"kvgen build --arch {arch}" + (f" --family {family}" if family else "")


@dataclass(frozen=True)
class OpEntry:
    op: str
    template: str
    plan_key: str
    params: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class LibraryEntry:
    family: str
    arch: str
    symbol: str
    ops: tuple[OpEntry, ...]
    spec_sha256: str
    artifact: str                  # relative to the manifest's directory
    artifact_sha256: str
    cache_key: str
    toolchain: str                 # nvcc version, e.g. "13.0.88"
    kvgen_version: str = __version__
    abi_version: int = ABI_VERSION
    # The family's cold-page layout as plain JSON (``kvgen show FAMILY --json``), so the runtime
    # can size cold storage without the spec (and without pydantic). None in older manifests.
    layout: Mapping[str, Any] | None = None


@dataclass(frozen=True)
class Manifest:
    arch: str
    libraries: tuple[LibraryEntry, ...]
    format_version: int = FORMAT_VERSION
    kvgen_version: str = __version__
    abi_version: int = ABI_VERSION

    def library(self, family: str) -> LibraryEntry | None:
        for entry in self.libraries:
            if entry.family == family:
                return entry
        return None


def score_library_name(symbol: str) -> str:
    """File name of a family's TriAttention score library (CuTe DSL AOT), beside its family library
    in ``<registry>/<arch>/`` with a ``.json`` sidecar holding its sha256."""
    return f"lib{symbol}_score.so"


def manifest_path(registry_dir: Path, arch: str) -> Path:
    return Path(registry_dir) / arch / MANIFEST


def manifest_json(manifest: Manifest) -> dict[str, Any]:
    data = asdict(manifest)
    data["libraries"] = sorted(data["libraries"], key=lambda lib: lib["family"])
    for lib in data["libraries"]:
        lib["ops"] = [{**op, "params": dict(sorted(op["params"].items()))} for op in lib["ops"]]
    return data


def write_manifest(path: Path, manifest: Manifest) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, manifest_json(manifest))


def _library(data: dict[str, Any]) -> LibraryEntry:
    ops = tuple(OpEntry(op["op"], op["template"], op["plan_key"], dict(op.get("params", {})))
                for op in data["ops"])
    return LibraryEntry(**{**data, "ops": ops})


def parse_manifest(path: Path) -> Manifest:
    """Parse without checking versions or artifacts (the build merges into an old manifest)."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        libraries = tuple(_library(lib) for lib in data.pop("libraries"))
        return Manifest(libraries=libraries, **data)
    except FileNotFoundError:
        raise RegistryError(f"{path}: no manifest") from None
    except (ValueError, KeyError, TypeError) as exc:
        raise RegistryError(f"{path}: not a kvgen manifest ({exc})") from None


def _refuse(path: Path, what: str, arch: str, family: str | None = None) -> RegistryError:
    return RegistryError(f"{path}: {what}; rebuild with: {fix_command(arch, family)}")


def verify_artifact(path: Path, manifest: Manifest, entry: LibraryEntry) -> Path:
    """The artifact's absolute path, after checking its sha256 against the manifest."""
    artifact = Path(path).parent / entry.artifact
    if not artifact.is_file():
        raise _refuse(artifact, f"artifact missing (listed in {path})", manifest.arch, entry.family)
    actual = file_sha256(artifact)
    if actual != entry.artifact_sha256:
        raise _refuse(artifact, f"sha256 mismatch with {path} (expected {entry.artifact_sha256}, found {actual})",
                      manifest.arch, entry.family)
    return artifact


def read_manifest(path: Path, kvgen_version: str = __version__, verify: bool = True) -> Manifest:
    """A manifest safe to load from: this format, this kvgen version and ABI, intact artifacts."""
    path = Path(path)
    arch = path.parent.name
    try:
        manifest = parse_manifest(path)
    except RegistryError as exc:
        raise RegistryError(f"{exc}; rebuild with: {fix_command(arch)}") from None
    if manifest.format_version != FORMAT_VERSION:
        raise _refuse(path, f"format version {manifest.format_version}, this kvgen reads {FORMAT_VERSION}", arch)
    if manifest.kvgen_version != kvgen_version or manifest.abi_version != ABI_VERSION:
        raise _refuse(path, f"written by kvgen {manifest.kvgen_version} (ABI {manifest.abi_version}), this is "
                            f"kvgen {kvgen_version} (ABI {ABI_VERSION})", manifest.arch)
    for entry in manifest.libraries:
        if entry.abi_version != ABI_VERSION or entry.arch != manifest.arch:
            raise _refuse(path, f"{entry.family}: ABI {entry.abi_version} for {entry.arch}", manifest.arch,
                          entry.family)
        if verify:
            verify_artifact(path, manifest, entry)
    return manifest
