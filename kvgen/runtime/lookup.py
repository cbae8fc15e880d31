"""Run-time lookup: (family, arch) -> manifest entry -> sha256-verified library -> loaded once.

Search path. ``RuntimeRegistry(search_path)`` takes registry directories (each holding
``<arch>/manifest.json``, as ``kvgen build --registry DIR`` writes them) from its caller and
searches them in order. ``RuntimeRegistry.default(search_path, environ)`` builds the usual path: the
caller's paths, then ``$KVGEN_REGISTRY`` (``kvgen.paths.registry_search_path``: os.pathsep-separated,
read from the mapping passed in, default the process environment), then installed kernel wheels.
A local build therefore overrides an installed wheel.

Installed kernel wheels (``kvgen wheel``) declare an entry point in the group ``kvgen.registries``
whose value is their package; its ``registry/`` directory is searched. The package is located
with ``importlib.util.find_spec``: nothing from the wheel is imported or run.

Lookup order for ``resolve(family, arch)``: the exact arch in every directory, then the arch's
family target (``sm_100f`` for 10.x) in every directory. The first manifest listing the family
wins and is then checked, never skipped: another format, another kvgen version (the wheel's
message names both versions and the ``pip install`` fix) or another ABI is an error naming the
file and the command that fixes it. Each op's artifact (``Resolved.artifact(op)``: codec, compact,
score, pack) is sha256-checked against the manifest when it is handed out, so a missing or
altered file is refused before anything loads it. Nothing here writes a file.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import importlib.util
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvgen import __version__, paths
from kvgen.arch import arch_for_capability, family_target, parse_arch
from kvgen.artifacts.dispatch import DispatchFiles
from kvgen.artifacts.manifest import (
    FORMAT_VERSION,
    FamilyEntry,
    Manifest,
    OpEntry,
    RegistryError,
    fix_command,
    manifest_path,
    parse_manifest,
    read_manifest,
    verify_op,
    verify_op_files,
)
from kvgen.artifacts.packages import ENTRY_POINT_GROUP, distribution_name, pip_fix
from kvgen.runtime.library import FamilyLibrary, LibraryError


@dataclass(frozen=True)
class RegistrySource:
    """One registry directory; ``package``/``version`` are set for an installed kernel wheel."""

    path: Path
    package: str | None = None
    version: str | None = None

    def describe(self) -> str:
        return f"{self.path} ({self.package} {self.version})" if self.package else str(self.path)


def installed_sources() -> list[RegistrySource]:
    """Registries of installed kernel wheels (entry point group ``kvgen.registries``), by name."""
    sources = []
    for ep in sorted(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
        spec = importlib.util.find_spec(ep.module)
        if spec is None or not spec.submodule_search_locations:
            continue
        dist = ep.dist
        sources.append(RegistrySource(Path(list(spec.submodule_search_locations)[0]) / "registry",
                                      dist.metadata["Name"] if dist else ep.module,
                                      dist.version if dist else None))
    return sources


def current_arch() -> str:
    """The arch-specific target of GPU 0 (``sm_90a`` on an H200); a clear error without one."""
    import torch

    if not torch.cuda.is_available():
        raise RegistryError("no CUDA device: pass arch= explicitly (e.g. 'sm_90a') to look up a library")
    major, minor = torch.cuda.get_device_capability()
    return arch_for_capability(major, minor)


def candidate_archs(arch: str) -> list[str]:
    """Exact arch first, then its family target (if any and different)."""
    family = family_target(arch)
    return [arch] if family in (None, arch) else [arch, family]


# ---------------------------------------------------------------- checks


def spec_file_sha256(spec_path: Path) -> str:
    return hashlib.sha256(Path(spec_path).read_bytes()).hexdigest()


def check_spec(entry: FamilyEntry, spec_path: Path) -> None:
    """Refuse a library built from another version of the spec file (the spec changed since)."""
    actual = spec_file_sha256(spec_path)
    if actual != entry.spec_sha256:
        raise RegistryError(f"{spec_path}: changed since {entry.family} was built for {entry.arch} (manifest records "
                            f"spec sha256 {entry.spec_sha256[:16]}..., the file is {actual[:16]}...); rebuild with: "
                            f"{fix_command(entry.arch, entry.family)}")


def _check_wheel_version(source: RegistrySource, path: Path, manifest: Manifest, family: str) -> None:
    """An installed kernels package must be exactly this kvgen's version (C ABI and layout)."""
    versions = {source.version, manifest.kvgen_version}
    if source.package is None or versions == {__version__}:
        return
    raise RegistryError(f"{path}: installed {source.package} {source.version} holds kernels built by kvgen "
                        f"{manifest.kvgen_version}, this is kvgen {__version__}; fix: "
                        f"{pip_fix(manifest.arch)} (or build locally: {fix_command(manifest.arch, family)})")


# ---------------------------------------------------------------- lookup


@dataclass(frozen=True)
class Resolved:
    """A family's manifest entry (format, kvgen version and ABI checked): where it was found and,
    through ``artifact(op)``, the verified file serving each op."""

    source: RegistrySource
    manifest_path: Path
    manifest: Manifest
    entry: FamilyEntry

    @property
    def arch(self) -> str:
        return self.manifest.arch

    def op(self, name: str) -> OpEntry | None:
        return self.entry.op(name)

    def artifact(self, op: str) -> Path:
        """The file serving ``op`` (``codec``, ``compact``: the family library; ``score``: the CuTe
        DSL score library; ``pack``: the Triton packer module; ``select``: the Triton normalize/aggregate/
        select module), inside the registry directory,
        its sha256 checked against the manifest now. A family without the op, or a missing or
        altered file, is a ``RegistryError`` naming the manifest and the rebuild command."""
        return verify_op(self.manifest_path, self.manifest, self.entry, op)

    def dispatch(self, op: str) -> DispatchFiles:
        """``op``'s main file and its size-dispatched variants as (from_work, file), ascending
        (``kvgen.artifacts.dispatch``), every file's sha256 checked now."""
        main, *files = verify_op_files(self.manifest_path, self.manifest, self.entry, op)
        return main, [(v.from_work, file) for v, file in zip(self.entry.op(op).variants, files)]

    def layout(self) -> RegistryLayout:
        if self.entry.layout is None:
            raise RegistryError(f"{self.manifest_path}: {self.entry.family} has no layout (written by an older "
                                f"build); rebuild with: {fix_command(self.arch, self.entry.family)}")
        return RegistryLayout.from_json(self.entry.layout)


class RuntimeRegistry:
    """Registry directories searched in order; see the module docstring for the lookup rules."""

    def __init__(self, search_path: Sequence[Path | str | RegistrySource]):
        self.sources = [s if isinstance(s, RegistrySource) else RegistrySource(Path(s)) for s in search_path]

    @classmethod
    def default(cls, search_path: Sequence[Path | str] = (), environ: Mapping[str, str] | None = None,
                installed: bool = True) -> RuntimeRegistry:
        sources = [RegistrySource(p) for p in paths.registry_search_path(search_path, environ)]
        return cls(sources + (installed_sources() if installed else []))

    def resolve(self, family: str, arch: str | None = None, spec_path: Path | None = None) -> Resolved:
        arch = arch or current_arch()
        parse_arch(arch)
        for candidate in candidate_archs(arch):
            for source in self.sources:
                found = self._lookup(source, candidate, family)
                if found is not None:
                    if spec_path is not None:
                        check_spec(found.entry, spec_path)
                    return found
        raise RegistryError(self._missing_message(family, arch))

    def load(self, family: str, arch: str | None = None, spec_path: Path | None = None) -> FamilyLibrary:
        """The family's codec library, verified, loaded once per (path, sha256). No GPU call happens here."""
        resolved = self.resolve(family, arch, spec_path)
        return _codec_library(resolved)

    def _lookup(self, source: RegistrySource, arch: str, family: str) -> Resolved | None:
        path = manifest_path(source.path, arch)
        if not path.is_file():
            return None
        try:
            manifest = parse_manifest(path)
        except RegistryError as exc:
            raise RegistryError(f"{exc}; rebuild with: {fix_command(arch, family)}") from None
        if manifest.format_version == FORMAT_VERSION and manifest.family(family) is None:
            return None   # another format is refused below: it cannot say which families it holds
        _check_wheel_version(source, path, manifest, family)
        manifest = read_manifest(path, verify=False)   # format, kvgen version, ABI; artifacts when asked for
        return Resolved(source, path, manifest, manifest.family(family))

    def available(self) -> dict[str, dict[str, list[str]]]:
        """source description -> arch -> families, for messages and listings."""
        found: dict[str, dict[str, list[str]]] = {}
        for source in self.sources:
            found[source.describe()] = _families_by_arch(source.path)
        return found

    def _missing_message(self, family: str, arch: str) -> str:
        looked = " then ".join(candidate_archs(arch))
        lines = [f"no kvgen library for family {family!r} on {arch} (looked for {looked}) in:"]
        for where, archs in self.available().items():
            listed = "; ".join(f"{a}: {', '.join(fams) or 'no families'}" for a, fams in archs.items())
            lines.append(f"  {where}: {listed or 'no manifests'}")
        if not self.sources:
            lines.append("  (empty search path: pass registry directories, set $KVGEN_REGISTRY or install a "
                         "kernels wheel)")
        fix = f"fix: {fix_command(arch, family)}"
        if not any(s.package == distribution_name(arch) for s in self.sources):
            fix += f" (then pass its --registry directory), or: {pip_fix(arch)}"
        return "\n".join(lines + [fix])


def _families_by_arch(root: Path) -> dict[str, list[str]]:
    if not root.is_dir():
        return {}
    found = {}
    for arch_dir in sorted(d for d in root.iterdir() if d.is_dir()):
        try:
            found[arch_dir.name] = [e.family for e in parse_manifest(manifest_path(root, arch_dir.name)).families]
        except RegistryError:
            continue
    return found


def _codec_library(resolved: Resolved) -> FamilyLibrary:
    path = resolved.artifact("codec")   # verified now; a family without a codec raises
    return load_library(path, resolved.entry.artifact_of("codec").sha256, resolved.entry.family)


@functools.cache
def load_library(path: Path, sha256: str, family: str) -> FamilyLibrary:
    """dlopen once per (path, verified sha256): a replaced artifact is a new key, not a stale handle.

    The libraries link cudart statically and touch no device while loading, so this works on a
    machine without a GPU or driver; configuring a codec is the first GPU call.
    """
    return FamilyLibrary(path, family)


# ---------------------------------------------------------------- layout without the spec


@dataclass(frozen=True)
class LifecycleInfo:
    """The fields of ``kvgen.lower.layout.Lifecycle`` a runtime needs, read from the manifest."""

    index: int
    window: int | None
    layers: tuple[int, ...]
    cold_page_bytes: int
    hot_page_bytes: int


@dataclass(frozen=True)
class RegistryLayout:
    """A family's layout from its manifest entry (``kvgen show --json``), no spec or pydantic needed.

    Buffers, sides and regions stay plain JSON mappings: the runtime only sizes pages with them.
    """

    family: str
    record_bytes: int
    hot_record_bytes: int
    lifecycles: tuple[LifecycleInfo, ...]
    buffers: tuple[Mapping[str, Any], ...]
    sides: tuple[Mapping[str, Any], ...]
    regions: tuple[Mapping[str, Any], ...]

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> RegistryLayout:
        lifecycles = tuple(LifecycleInfo(lc["index"], lc["window"], tuple(lc["layers"]), lc["cold_page_bytes"],
                                         lc["hot_page_bytes"]) for lc in data["lifecycles"])
        return cls(data["family"], data["record_bytes"], data["hot_record_bytes"], lifecycles,
                   tuple(data["buffers"]), tuple(data["sides"]), tuple(data["regions"]))

    def cold_page_bytes(self, lifecycle: int = 0) -> int:
        return self.lifecycles[lifecycle].cold_page_bytes


def require_cuda() -> None:
    import torch

    if not torch.cuda.is_available():
        raise LibraryError("no CUDA device: a codec needs a GPU (the library loads without one, configuring it "
                           "is the first GPU call)")


def codec_from_registry(registry: RuntimeRegistry, family: str, pools: Sequence[Sequence[Any]],
                        arch: str | None = None, index_location: str = "host", spec_path: Path | None = None,
                        scales_file: str | Path | None = None):
    """``ColdPageCodec`` of ``family`` from the registry, its layout from the manifest (no spec).
    ``scales_file``: the per-layer scales of a family that declares them (``kvgen.runtime.scales``).

    Stops with a clear error before any GPU call when there is no CUDA device.
    """
    from kvgen.runtime.codec import ColdPageCodec  # torch-heavy; imported when a codec is really made
    from kvgen.runtime.scales import load_layer_scales

    resolved = registry.resolve(family, arch, spec_path)
    layout = resolved.layout()
    scales = None if scales_file is None else load_layer_scales(scales_file, layout)
    library = _codec_library(resolved)
    require_cuda()
    return ColdPageCodec(library, layout, pools, index_location=index_location, scales=scales)
