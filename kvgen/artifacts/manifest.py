"""The kernel registry: ``<registry>/<arch>/manifest.json`` plus every artifact it lists.

One entry per family. It records the decision (ops, their params and plan keys, the layout) and
each artifact the family ships: the nvcc library (``codec``, ``compact``), the CuTe DSL score
library (``score``) and the Triton modules of the packer (``pack``) and of normalize/aggregate/select
(``select``), each with its sha256. Every op names
the artifact file that serves it. ``read_manifest`` refuses a manifest written by another format
or kvgen version, and an artifact whose bytes do not match, with an error naming the file and the
command that rebuilds it. Nothing here knows how an artifact was made.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Mapping

from kvgen import __version__
from kvgen.files import file_sha256, write_json_atomic

# 2: one entry per family listing every artifact (score library and packer included), ops naming
# their artifact; format 1 had one library per entry and the score library in a sidecar.
FORMAT_VERSION = 2
# The C ABI of the generated libraries (entry-point names and argument lists). Bump on any change
# a loader would have to know about; the runtime refuses libraries of another ABI.
ABI_VERSION = 1
MANIFEST = "manifest.json"


class RegistryError(RuntimeError):
    """A manifest or artifact that must not be loaded; the message says how to rebuild it."""


def fix_command(arch: str, family: str | None = None) -> str:
    return f"kvgen build --arch {arch}" + (f" --family {family}" if family else "")


@dataclass(frozen=True)
class ArtifactEntry:
    """One shipped file, relative to the manifest's directory."""

    file: str
    sha256: str
    backend: str                                  # "nvcc" | "cute" | "triton"
    cache_key: str
    # Versions of what made it, e.g. {"nvcc": "13.0.88"}; empty for the Triton modules (packer,
    # selection), whose source is shipped and compiled by Triton on the GPU at run time.
    toolchain: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class OpEntry:
    op: str
    artifact: str                                 # the ``ArtifactEntry.file`` that serves this op
    template: str
    plan_key: str
    params: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class FamilyEntry:
    family: str
    arch: str
    symbol: str
    spec_sha256: str
    ops: tuple[OpEntry, ...]
    artifacts: tuple[ArtifactEntry, ...]
    # The family's cold-page layout as plain JSON (``kvgen.lower.layout.to_json``), so the runtime
    # can size cold storage without the spec (and without pydantic).
    layout: Mapping[str, Any] | None = None
    kvgen_version: str = __version__
    abi_version: int = ABI_VERSION

    def op(self, name: str) -> OpEntry | None:
        return next((op for op in self.ops if op.op == name), None)

    def artifact_of(self, op: str) -> ArtifactEntry | None:
        """The artifact serving ``op`` (None when the family has no such op in this manifest)."""
        entry = self.op(op)
        if entry is None:
            return None
        return next((a for a in self.artifacts if a.file == entry.artifact), None)


@dataclass(frozen=True)
class Manifest:
    arch: str
    families: tuple[FamilyEntry, ...]
    format_version: int = FORMAT_VERSION
    kvgen_version: str = __version__
    abi_version: int = ABI_VERSION

    def family(self, name: str) -> FamilyEntry | None:
        return next((entry for entry in self.families if entry.family == name), None)


def manifest_path(registry_dir: Path, arch: str) -> Path:
    return Path(registry_dir) / arch / MANIFEST


def manifest_json(manifest: Manifest) -> dict[str, Any]:
    data = asdict(manifest)
    data["families"] = sorted(data["families"], key=lambda entry: entry["family"])
    for entry in data["families"]:
        entry["ops"] = [{**op, "params": dict(sorted(op["params"].items()))} for op in entry["ops"]]
        entry["artifacts"] = sorted(entry["artifacts"], key=lambda a: a["file"])
    return data


def write_manifest(path: Path, manifest: Manifest) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, manifest_json(manifest))


def _family(data: dict[str, Any]) -> FamilyEntry:
    ops = tuple(OpEntry(op["op"], op["artifact"], op["template"], op["plan_key"], dict(op.get("params", {})))
                for op in data["ops"])
    artifacts = tuple(ArtifactEntry(**artifact) for artifact in data["artifacts"])
    return FamilyEntry(**{**data, "ops": ops, "artifacts": artifacts})


def parse_manifest(path: Path) -> Manifest:
    """Parse without checking versions or artifacts (the build merges into an old manifest)."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if data.get("format_version") != FORMAT_VERSION:   # another format's fields are not ours to read
            return Manifest(arch=data["arch"], families=(), **{k: data[k] for k in (
                "format_version", "kvgen_version", "abi_version") if k in data})
        families = tuple(_family(entry) for entry in data.pop("families"))
        return Manifest(families=families, **data)
    except FileNotFoundError:
        raise RegistryError(f"{path}: no manifest") from None
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise RegistryError(f"{path}: not a kvgen manifest ({exc})") from None


def _refuse(path: Path, what: str, arch: str, family: str | None = None) -> RegistryError:
    return RegistryError(f"{path}: {what}; rebuild with: {fix_command(arch, family)}")


def verify_file(path: Path, arch: str, family: str, artifact: ArtifactEntry) -> Path:
    """The absolute path of ``artifact`` (listed in the manifest at ``path``), after checking its
    sha256: a missing or altered file is a ``RegistryError`` naming it and the rebuild command."""
    file = Path(path).parent / artifact.file
    if not file.is_file():
        raise _refuse(file, f"artifact missing (listed in {path})", arch, family)
    actual = file_sha256(file)
    if actual != artifact.sha256:
        raise _refuse(file, f"sha256 mismatch with {path} (expected {artifact.sha256}, found {actual})", arch, family)
    return file


def verify_op(path: Path, manifest: Manifest, entry: FamilyEntry, op: str) -> Path:
    """The verified file that serves ``op`` of ``entry``; a family without the op is refused too."""
    artifact = entry.artifact_of(op)
    if artifact is None:
        have = ", ".join(o.op for o in entry.ops) or "none"
        raise _refuse(Path(path), f"{entry.family} has no {op!r} artifact (its ops: {have})", manifest.arch,
                      entry.family)
    return verify_file(path, manifest.arch, entry.family, artifact)


def read_manifest(path: Path, kvgen_version: str = __version__, verify: bool = True) -> Manifest:
    """A manifest safe to load from: this format, this kvgen version and ABI, intact artifacts
    (every artifact of every family when ``verify``)."""
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
    for entry in manifest.families:
        if entry.abi_version != ABI_VERSION or entry.arch != manifest.arch:
            raise _refuse(path, f"{entry.family}: ABI {entry.abi_version} for {entry.arch}", manifest.arch,
                          entry.family)
        if verify:
            for artifact in entry.artifacts:
                verify_file(path, manifest.arch, entry.family, artifact)
    return manifest
