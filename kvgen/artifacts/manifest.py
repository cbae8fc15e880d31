"""The kernel registry: ``<registry>/<arch>/manifest.json`` plus every artifact it lists.

One entry per family. It records the decision (ops, their params and plan keys, the layout) and
each artifact the family ships: the nvcc library (``codec``, ``compact``), the CuTe DSL score
library (``score``) and the AOT-compiled Triton libraries of the packer (``pack``) and of
normalize/aggregate/select (``select``), each with its sha256. Every op names the artifact file
that serves it, and may list size-dispatched variants (``kvgen.artifacts.dispatch``): another
artifact, with its own params, for calls of at least ``from_work``. ``read_manifest`` refuses a
manifest written by another format or kvgen version, a manifest whose arch is not its folder's, an
artifact path that leaves the manifest's folder (absolute, ``..``, a symlink pointing out) and an
artifact whose bytes do not match, each with an error naming the file and the command that
rebuilds it. ``manifest_problems`` lists every such problem of one manifest (``kvgen verify``).
Nothing here knows how an artifact was made.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, Mapping

from kvgen import __version__
from kvgen.files import file_sha256, write_json_atomic

# 3: an op may list size-dispatched variants. 2: one entry per family listing every artifact (score
# library and packer included), ops naming their artifact; format 1 had one library per entry and
# the score library in a sidecar.
FORMAT_VERSION = 3
# The C ABI of the generated libraries (entry-point names and argument lists). Bump on any change
# a loader would have to know about; the runtime refuses libraries of another ABI.
# 2: the codec's staged offload/onboard entry points (kvgen_codec.h, version 2 block).
ABI_VERSION = 2
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
    backend: str                                  # "nvcc" | "cute" | "triton-aot"
    cache_key: str
    # Versions of what made it, e.g. {"nvcc": "13.0.88"}; {"nvcc", "triton"} for the Triton AOT
    # libraries (packer, selection).
    toolchain: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class VariantEntry:
    """The artifact serving an op's calls of at least ``from_work`` (in the op's unit of work,
    ``kvgen.artifacts.dispatch``: requests x width for the scorer, request slots for compaction), up to the
    next variant's threshold."""

    from_work: int
    bucket: str                                   # the tuning bucket whose measurements chose it
    artifact: str                                 # an ``ArtifactEntry.file``; may be the op's own
    plan_key: str
    params: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class OpEntry:
    op: str
    artifact: str                                 # the ``ArtifactEntry.file`` that serves this op
    template: str
    plan_key: str
    params: Mapping[str, int] = field(default_factory=dict)
    tuning: str = "default"                       # how params were chosen: measured, model-tuned, override, default
    variants: tuple[VariantEntry, ...] = ()       # ascending from_work; calls below the first take ``artifact``

    def artifacts(self) -> tuple[str, ...]:
        """Every artifact file this op may load."""
        return (self.artifact, *(v.artifact for v in self.variants))


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
        return self.artifact_named(entry.artifact)

    def artifact_named(self, file: str) -> ArtifactEntry | None:
        return next((a for a in self.artifacts if a.file == file), None)


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
        entry["ops"] = [{**op, "params": dict(sorted(op["params"].items())),
                         "variants": [{**v, "params": dict(sorted(v["params"].items()))} for v in op["variants"]]}
                        for op in entry["ops"]]
        entry["artifacts"] = sorted(entry["artifacts"], key=lambda a: a["file"])
    return data


def write_manifest(path: Path, manifest: Manifest) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, manifest_json(manifest))


# (required fields, optional fields) of each JSON object, with the type each must have: a manifest
# of the right shape but wrong types is refused here, not by whatever later trips over a value.
_ARTIFACT = ({"file": str, "sha256": str, "backend": str, "cache_key": str}, {"toolchain": dict})
_VARIANT = ({"from_work": int, "bucket": str, "artifact": str, "plan_key": str}, {"params": dict})
_OP = ({"op": str, "artifact": str, "template": str, "plan_key": str},
       {"params": dict, "tuning": str, "variants": list})
_FAMILY = ({"family": str, "arch": str, "symbol": str, "spec_sha256": str, "ops": list, "artifacts": list},
           {"layout": (dict, type(None)), "kvgen_version": str, "abi_version": int})
_MANIFEST = ({"arch": str, "families": list}, {"format_version": int, "kvgen_version": str, "abi_version": int})


class _Malformed(ValueError):
    pass


def _checked(data: Any, where: str, shape: tuple[dict, dict]) -> dict[str, Any]:
    """``data`` if it is an object with exactly the fields of ``shape``, each of its type."""
    required, optional = shape
    if not isinstance(data, dict):
        raise _Malformed(f"{where}: expected an object, found {type(data).__name__}")
    missing = [k for k in required if k not in data]
    unknown = [k for k in data if k not in required and k not in optional]
    if missing or unknown:
        raise _Malformed(f"{where}: " + "; ".join(([f"missing {', '.join(missing)}"] if missing else [])
                                                  + ([f"unknown {', '.join(unknown)}"] if unknown else [])))
    for key, value in data.items():
        kind = required.get(key) or optional[key]
        if not isinstance(value, kind) or (isinstance(value, bool) and kind is int):
            raise _Malformed(f"{where}.{key}: {type(value).__name__} {value!r:.40}, expected "
                             f"{getattr(kind, '__name__', 'object or null')}")
    return data


def _params(data: Mapping[str, Any], where: str) -> dict[str, int]:
    params = data.get("params", {})
    if not all(isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) for k, v in params.items()):
        raise _Malformed(f"{where}.params: expected names of integers")
    return dict(params)


def _variants(data: list, where: str) -> tuple[VariantEntry, ...]:
    variants = []
    for i, variant in enumerate(data):
        variant = _checked(variant, f"{where}[{i}]", _VARIANT)
        if variants and variant["from_work"] <= variants[-1].from_work or variant["from_work"] < 0:
            raise _Malformed(f"{where}[{i}].from_work: {variant['from_work']}, expected ascending thresholds >= 0")
        variants.append(VariantEntry(**{**variant, "params": _params(variant, f"{where}[{i}]")}))
    return tuple(variants)


def _family(data: Any, where: str) -> FamilyEntry:
    data = _checked(data, where, _FAMILY)
    ops = []
    for i, op in enumerate(data["ops"]):
        op = _checked(op, f"{where}.ops[{i}]", _OP)
        at = f"{where}.ops[{i}]"
        ops.append(OpEntry(op["op"], op["artifact"], op["template"], op["plan_key"], _params(op, at),
                           op.get("tuning", "default"), _variants(op.get("variants", []), f"{at}.variants")))
    artifacts = []
    for i, artifact in enumerate(data["artifacts"]):
        artifact = _checked(artifact, f"{where}.artifacts[{i}]", _ARTIFACT)
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in artifact.get("toolchain", {}).items()):
            raise _Malformed(f"{where}.artifacts[{i}].toolchain: expected names of version strings")
        artifacts.append(ArtifactEntry(**artifact))
    return FamilyEntry(**{**data, "ops": tuple(ops), "artifacts": tuple(artifacts)})


def parse_manifest(path: Path) -> Manifest:
    """Parse (shape and types checked) without checking versions or artifacts (the build merges
    into an old manifest)."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if isinstance(data, dict) and data.get("format_version") != FORMAT_VERSION:
            # another format's fields are not ours to read: only what says which format it is
            head = {k: data[k] for k in ("arch", "format_version", "kvgen_version", "abi_version") if k in data}
            return Manifest(families=(), **_checked(head, "manifest", ({"arch": str}, _MANIFEST[1])))
        data = _checked(data, "manifest", _MANIFEST)
        families = tuple(_family(entry, f"families[{i}]") for i, entry in enumerate(data["families"]))
        return Manifest(**{**data, "families": families})
    except FileNotFoundError:
        raise RegistryError(f"{path}: no manifest") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise RegistryError(f"{path}: unreadable manifest ({exc})") from None
    except (ValueError, RecursionError) as exc:   # bad JSON, or the shape checks above
        raise RegistryError(f"{path}: not a kvgen manifest ({exc})") from None


def _refuse(path: Path, what: str, arch: str, family: str | None = None) -> RegistryError:
    return RegistryError(f"{path}: {what}; rebuild with: {fix_command(arch, family)}")


def artifact_file(path: Path, artifact: ArtifactEntry) -> Path:
    """Where ``artifact`` (listed in the manifest at ``path``) lies: a relative path that stays
    inside the manifest's folder once symlinks are resolved, else a ``RegistryError``. Only
    this resolved path is hashed and handed to a loader."""
    folder = Path(path).parent
    name = PurePosixPath(artifact.file)
    if not artifact.file or name.is_absolute() or "\\" in artifact.file or ".." in name.parts:
        raise RegistryError(f"{path}: artifact path {artifact.file!r} must be a plain path relative to {folder}")
    file = (folder / name).resolve()
    if not file.is_relative_to(folder.resolve()):
        raise RegistryError(f"{path}: artifact {artifact.file!r} resolves to {file}, outside {folder} (a symlink "
                            "pointing out of the registry)")
    return file


def verify_file(path: Path, arch: str, family: str, artifact: ArtifactEntry) -> Path:
    """The resolved path of ``artifact`` (listed in the manifest at ``path``), after checking that
    it stays inside the registry and its sha256: anything else is a ``RegistryError`` naming it
    and the rebuild command."""
    try:
        file = artifact_file(path, artifact)
    except RegistryError as exc:
        raise RegistryError(f"{exc}; rebuild with: {fix_command(arch, family)}") from None
    if not file.is_file():
        raise _refuse(file, f"artifact missing (listed in {path})", arch, family)
    try:
        actual = file_sha256(file)
    except OSError as exc:
        raise _refuse(file, f"unreadable artifact ({exc})", arch, family) from None
    if actual != artifact.sha256:
        raise _refuse(file, f"sha256 mismatch with {path} (expected {artifact.sha256}, found {actual})", arch, family)
    return file


def verify_op(path: Path, manifest: Manifest, entry: FamilyEntry, op: str) -> Path:
    """The verified file that serves ``op`` of ``entry`` (its main artifact); a family without the
    op is refused too."""
    return verify_op_files(path, manifest, entry, op)[0]


def verify_op_files(path: Path, manifest: Manifest, entry: FamilyEntry, op: str) -> list[Path]:
    """The verified files of ``op``: its main artifact, then each size-dispatched variant's, in the
    order of ``OpEntry.variants``; a family without the op, or an op naming an unlisted file, is refused."""
    op_entry = entry.op(op)
    if op_entry is None:
        have = ", ".join(o.op for o in entry.ops) or "none"
        raise _refuse(Path(path), f"{entry.family} has no {op!r} artifact (its ops: {have})", manifest.arch,
                      entry.family)
    files = []
    for name in op_entry.artifacts():
        artifact = entry.artifact_named(name)
        if artifact is None:
            raise _refuse(Path(path), f"{entry.family}: op {op!r} names {name!r}, which is not among its artifacts",
                          manifest.arch, entry.family)
        files.append(verify_file(path, manifest.arch, entry.family, artifact))
    return files


def manifest_problems(path: Path, kvgen_version: str = __version__,
                      verify: bool = True) -> tuple[Manifest | None, list[RegistryError]]:
    """The manifest at ``path`` and every reason not to load from it: unreadable or malformed, another
    format, kvgen version or ABI, an arch that is not its folder's, and per family an op naming
    an unlisted artifact or (``verify``) an artifact outside the registry, missing or altered.
    The manifest is None when nothing in it can be trusted."""
    path = Path(path)
    folder_arch = path.parent.name
    try:
        manifest = parse_manifest(path)
    except RegistryError as exc:
        return None, [RegistryError(f"{exc}; rebuild with: {fix_command(folder_arch)}")]
    if manifest.format_version != FORMAT_VERSION:
        return None, [_refuse(path, f"format version {manifest.format_version}, this kvgen reads {FORMAT_VERSION}",
                              folder_arch)]
    if manifest.kvgen_version != kvgen_version or manifest.abi_version != ABI_VERSION:
        return None, [_refuse(path, f"written by kvgen {manifest.kvgen_version} (ABI {manifest.abi_version}), "
                                    f"this is kvgen {kvgen_version} (ABI {ABI_VERSION})", folder_arch)]
    if manifest.arch != folder_arch:
        return None, [_refuse(path, f"a manifest for {manifest.arch} in the folder {folder_arch}/ (copied from "
                                    "another arch?)", folder_arch)]
    problems = []
    for entry in manifest.families:
        problems += _family_problems(path, manifest, entry, verify)
    return manifest, problems


def _family_problems(path: Path, manifest: Manifest, entry: FamilyEntry, verify: bool) -> list[RegistryError]:
    if entry.abi_version != ABI_VERSION or entry.arch != manifest.arch:
        return [_refuse(path, f"{entry.family}: ABI {entry.abi_version} for {entry.arch}", manifest.arch,
                        entry.family)]
    problems = []
    listed = {a.file for a in entry.artifacts}
    for op in entry.ops:
        for artifact in op.artifacts():
            if artifact not in listed:
                problems.append(_refuse(path, f"{entry.family}: op {op.op!r} names {artifact!r}, which is not "
                                              "among its artifacts", manifest.arch, entry.family))
    for artifact in entry.artifacts if verify else ():
        try:
            verify_file(path, manifest.arch, entry.family, artifact)
        except RegistryError as exc:
            problems.append(exc)
    return problems


def read_manifest(path: Path, kvgen_version: str = __version__, verify: bool = True) -> Manifest:
    """A manifest safe to load from: this format, this kvgen version and ABI, its folder's arch,
    ops naming listed artifacts, and (every artifact of every family when ``verify``) artifacts
    inside the registry and intact. The first problem is raised."""
    manifest, problems = manifest_problems(path, kvgen_version, verify)
    if problems:
        raise problems[0]
    return manifest
