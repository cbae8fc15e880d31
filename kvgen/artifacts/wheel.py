"""Pre-generated kernel wheels: a registry's manifests and shared libraries as an installable package.

``kvgen wheel --arch sm_90a,sm_100a`` writes one wheel per arch family (``kvgen_kernels_sm90``,
``kvgen_kernels_sm100``: each stays far under PyPI's and GitHub's 100 MB per-file limit):

    kvgen_kernels_sm90/__init__.py                 REGISTRY, KVGEN_VERSION, ARCHS; never imported by kvgen
    kvgen_kernels_sm90/registry/<arch>/manifest.json and every artifact it lists (per family
                                                   lib<symbol>.so; for TriAttention families also
                                                   lib<symbol>_score.so, lib<symbol>_select.so
                                                   and lib<symbol>_pack.so)
    kvgen_kernels_sm90-<v>.dist-info/              METADATA (Requires-Dist: kvgen==<v>; its body lists
                                                   the specs), WHEEL, entry_points.txt,
                                                   kvgen_provenance.json, RECORD

How the runtime finds it: the wheel declares an entry point in the group ``kvgen.registries``
whose value is the package name; ``kvgen.runtime.lookup.installed_sources`` locates that package
with ``importlib.util.find_spec`` (no code from the wheel runs) and searches its ``registry/``.
The wheel's version is the kvgen version it was built by, and it requires exactly that kvgen: the
libraries speak that version's C ABI and layout.

Provenance: ``kvgen_provenance.json`` records, per arch and family, the sha256 of the spec file the
family was built from (the manifest's ``spec_sha256``) and how that file stood in git when it was
packed (``git status --porcelain --ignored``): committed, modified, untracked, ignored, changed
since the build, missing, or "not in a git checkout" (nothing to tell). Packing a spec that is not
committed (or whose file no longer matches the build) is refused unless ``allow_dirty``, and the
wheel then says so in that file and in METADATA. ``verify_installed`` checks installed wheels: the
RECORD sha256 of every file, every manifest with its artifacts, the kvgen version and the
provenance.

Written with the standard library (zipfile, RECORD with sha256), byte-for-byte reproducible:
members sorted, fixed timestamps and modes. Data only: the libraries link nothing from torch or
Triton.
Platform tag ``manylinux_2_28_x86_64``, raised to the newest glibc symbol version the libraries
really reference (``manylinux_2_34`` when linked on a glibc >= 2.34 system), so pip never installs
a wheel whose libraries cannot load.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata
import json
import os
import re
import subprocess
import tempfile
import zipfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvgen import __version__, paths
from kvgen.arch import parse_arch
from kvgen.artifacts.manifest import MANIFEST, RegistryError, fix_command, manifest_path, parse_manifest, read_manifest
from kvgen.artifacts.packages import ENTRY_POINT_GROUP, package_name
from kvgen.files import file_sha256

# The oldest glibc a tag may claim; raised to what the libraries really need (see glibc_needed).
MIN_GLIBC_MINOR = 28
WHEEL_TAG = "py3-none-manylinux_2_28_x86_64"     # for libraries that need nothing newer than 2.28
# GitHub and PyPI refuse files over 100 MB; keep a margin so a growing registry fails here first.
MAX_FILE_BYTES = 90 * 1000 * 1000
_ZIP_TIME = (1980, 1, 1, 0, 0, 0)   # earliest zip time: reproducible wheels
_GLIBC = re.compile(rb"GLIBC_2\.(\d+)")
PROVENANCE = "kvgen_provenance.json"
PROVENANCE_SCHEMA = 1
# Spec states that need --allow-dirty: the wheel could not be rebuilt from a commit.
DIRTY_STATES = ("modified", "untracked", "ignored", "changed since the build", "missing")
NO_GIT = "not in a git checkout"


class WheelError(RuntimeError):
    """A wheel that must not be written; the message says what to change."""


# ---------------------------------------------------------------- members


@dataclass(frozen=True)
class Member:
    """One file of the wheel: its archive name, and its bytes or the file that holds them."""

    name: str
    data: bytes | None = None
    source: Path | None = None
    mode: int = 0o644

    def sha256(self) -> str:
        if self.source is not None:
            return file_sha256(self.source)
        return hashlib.sha256(self.data or b"").hexdigest()

    def size(self) -> int:
        return self.source.stat().st_size if self.source is not None else len(self.data or b"")


def _registry_members(registry_dir: Path, arch: str, package: str) -> list[Member]:
    """The manifest and every artifact it lists, and nothing else in the directory, all verified
    first: a wheel never ships a tampered artifact or one of another kvgen version."""
    path = manifest_path(registry_dir, arch)
    if not path.is_file():
        raise WheelError(f"{path}: no manifest for {arch}; run: {fix_command(arch)} --registry {registry_dir}")
    manifest = read_manifest(path, verify=True)
    prefix = f"{package}/registry/{arch}"
    members = [Member(f"{prefix}/{MANIFEST}", source=path)]
    for entry in manifest.families:
        members += [Member(f"{prefix}/{a.file}", source=path.parent / a.file, mode=_mode(a.file))
                    for a in entry.artifacts]
    return members


def _mode(name: str) -> int:
    """Shared libraries are executable (as the registry publishes them); everything else is data."""
    return 0o755 if name.endswith(".so") else 0o644


def _init_py(archs: Sequence[str]) -> str:
    return (f'"""Pre-generated kvgen kernel libraries for {", ".join(archs)}: data only, found by\n'
            f'kvgen.runtime through the `{ENTRY_POINT_GROUP}` entry point (this file is never imported by it)."""\n\n'
            "from pathlib import Path\n\n"
            f'KVGEN_VERSION = "{__version__}"\n'
            f"ARCHS = {tuple(archs)!r}\n"
            'REGISTRY = Path(__file__).resolve().parent / "registry"\n')


def _metadata(dist: str, archs: Sequence[str], provenance: dict[str, Any]) -> str:
    head = (f"Metadata-Version: 2.1\nName: {dist}\nVersion: {__version__}\n"
            f"Summary: Pre-generated kvgen kernel libraries (C ABI) for {', '.join(archs)}\n"
            f"Requires-Python: >=3.11\nRequires-Dist: kvgen=={__version__}\n")
    lines = [f"Built by kvgen {__version__} at commit {provenance['commit'] or 'unknown'} from these specs "
             f"(arch, family, sha256 of the spec file, its git state when packed):", ""]
    lines += [f"    {r['arch']} {r['family']} {r['spec_sha256']} {r['state']}" for r in provenance["specs"]]
    if provenance["dirty"]:
        lines += ["", "Packed with --allow-dirty: not every spec was committed:", ""]
        lines += [f"    {line}" for line in provenance["dirty"]]
    return head + "\n" + "\n".join(lines) + "\n"


# ---------------------------------------------------------------- provenance


def _git(folder: Path, *argv: str) -> subprocess.CompletedProcess | None:
    try:
        return subprocess.run(["git", "-C", str(folder), *argv], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None


def git_state(path: Path) -> str:
    """How ``path`` stands in its git checkout: committed, modified (staged or not), untracked or
    ignored; ``NO_GIT`` outside a checkout or without git."""
    proc = _git(Path(path).parent, "status", "--porcelain", "--ignored", "--", Path(path).name)
    if proc is None or proc.returncode != 0:
        return NO_GIT
    code = proc.stdout[:2]
    return {"": "committed", "??": "untracked", "!!": "ignored"}.get(code, "modified")


def git_commit(folder: Path) -> str | None:
    """HEAD of the checkout holding ``folder``, else ``$KVGEN_COMMIT`` (a copy without git)."""
    proc = _git(folder, "rev-parse", "HEAD")
    if proc is not None and proc.returncode == 0:
        return proc.stdout.strip()
    return paths.commit()


def _spec_state(spec: Path | None, built_sha256: str, cache: dict[Path, str]) -> str:
    if spec is None:
        return "not checked"
    if not spec.is_file():
        return "missing"
    if file_sha256(spec) != built_sha256:
        return "changed since the build"
    if spec not in cache:
        cache[spec] = git_state(spec)
    return cache[spec]


def provenance(registry_dir: Path, archs: Sequence[str], package: str, specs_dir: Path | None,
               allow_dirty: bool) -> dict[str, Any]:
    """What ``kvgen_provenance.json`` holds: per (arch, family) the spec sha256 the manifest
    records and the spec file's state; ``dirty`` lists the states that needed ``allow_dirty``.
    ``specs_dir`` None: the spec files are not looked at (state "not checked")."""
    records, cache = [], {}
    for arch in archs:
        for entry in parse_manifest(manifest_path(registry_dir, arch)).families:
            spec = Path(specs_dir) / f"{entry.family}.yaml" if specs_dir is not None else None
            records.append({"arch": arch, "family": entry.family, "spec_sha256": entry.spec_sha256,
                            "spec": str(spec) if spec else None,
                            "state": _spec_state(spec, entry.spec_sha256, cache)})
    dirty = [f"{r['family']} {r['arch']}: {r['spec']} {r['state']}" for r in records if r["state"] in DIRTY_STATES]
    return {"schema": PROVENANCE_SCHEMA, "package": package, "kvgen_version": __version__, "archs": list(archs),
            "commit": git_commit(Path(specs_dir)) if specs_dir is not None else None,
            "allow_dirty": bool(allow_dirty and dirty), "dirty": dirty, "specs": records}


def _refuse_dirty(package: str, dirty: Sequence[str]) -> WheelError:
    return WheelError(f"{package}: built from specs that are not committed: {'; '.join(dirty)}. Commit them and "
                      "rebuild (kvgen build), or pass --allow-dirty (the wheel then records it)")


def wheel_provenance(wheel: Path) -> dict[str, Any]:
    """The ``kvgen_provenance.json`` of a wheel file."""
    with zipfile.ZipFile(wheel) as zf:
        name = next(n for n in zf.namelist() if n.endswith(f".dist-info/{PROVENANCE}"))
        return json.loads(zf.read(name))


def _wheel_file(tag: str) -> str:
    # Root-Is-Purelib false: shared libraries belong in platlib.
    return f"Wheel-Version: 1.0\nGenerator: kvgen {__version__}\nRoot-Is-Purelib: false\nTag: {tag}\n"


def glibc_needed(paths: Iterable[Path]) -> int:
    """Highest ``GLIBC_2.N`` symbol version the libraries name (N), at least MIN_GLIBC_MINOR.

    Libraries linked on a new distribution need its glibc (e.g. 2.34, where pthread moved into
    libc); a manylinux tag older than that would let pip install a wheel that cannot dlopen.
    The version names are plain strings in the dynamic string table, so a byte scan finds them.
    """
    needed = MIN_GLIBC_MINOR
    for path in paths:
        needed = max([needed, *(int(m) for m in _GLIBC.findall(Path(path).read_bytes()))])
    return needed


def wheel_tag(payload: Iterable[Member]) -> str:
    libraries = [m.source for m in payload if m.source is not None and m.name.endswith(".so")]
    return f"py3-none-manylinux_2_{glibc_needed(libraries)}_x86_64"


def _dist_info_members(package: str, archs: Sequence[str], payload: Sequence[Member], tag: str,
                       record: dict[str, Any]) -> list[Member]:
    dist = package.replace("_", "-")
    info = f"{package}-{_file_version()}.dist-info"
    members = [
        Member(f"{info}/METADATA", _metadata(dist, archs, record).encode()),
        Member(f"{info}/WHEEL", _wheel_file(tag).encode()),
        Member(f"{info}/entry_points.txt", f"[{ENTRY_POINT_GROUP}]\n{package} = {package}\n".encode()),
        Member(f"{info}/top_level.txt", f"{package}\n".encode()),
        Member(f"{info}/{PROVENANCE}", (json.dumps(record, indent=2, sort_keys=True) + "\n").encode()),
    ]
    record = _record([*payload, *members], f"{info}/RECORD")
    return [*members, Member(f"{info}/RECORD", record.encode())]


def _record(members: Iterable[Member], record_name: str) -> str:
    lines = []
    for m in members:
        digest = base64.urlsafe_b64encode(bytes.fromhex(m.sha256())).rstrip(b"=").decode()
        lines.append(f"{m.name},sha256={digest},{m.size()}")
    lines.append(f"{record_name},,")
    return "\n".join(lines) + "\n"


def _file_version() -> str:
    """Wheel file names use '_' where a version has '-' (PEP 427 escaping)."""
    return __version__.replace("-", "_")


def wheel_filename(package: str, tag: str = WHEEL_TAG) -> str:
    return f"{package}-{_file_version()}-{tag}.whl"


# ---------------------------------------------------------------- writing


def _write_member(zf: zipfile.ZipFile, member: Member) -> None:
    info = zipfile.ZipInfo(member.name, date_time=_ZIP_TIME)
    info.compress_type = zipfile.ZIP_DEFLATED
    info.external_attr = (0o100000 | member.mode) << 16   # regular file with this mode
    with zf.open(info, "w") as out:
        if member.source is None:
            out.write(member.data or b"")
            return
        with open(member.source, "rb") as src:
            for chunk in iter(lambda: src.read(1 << 20), b""):
                out.write(chunk)


def _write_zip(path: Path, members: Sequence[Member], limit_bytes: int) -> None:
    """Written beside ``path`` and renamed into place only if it is under the size limit."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        with zipfile.ZipFile(tmp, "w") as zf:
            for member in members:
                _write_member(zf, member)
        size = os.path.getsize(tmp)
        if size > limit_bytes:
            raise WheelError(f"{path.name} would be {size / 1e6:.1f} MB, over the {limit_bytes / 1e6:.0f} MB limit "
                             "(files above 100 MB are refused by PyPI and GitHub); ship fewer archs or families "
                             "per wheel")
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def build_wheel(registry_dir: Path, archs: Sequence[str], out_dir: Path, limit_bytes: int = MAX_FILE_BYTES, *,
                specs_dir: Path | None = None, allow_dirty: bool = False) -> Path:
    """One wheel holding ``archs`` (all of one arch family) from ``registry_dir``. With
    ``specs_dir`` (what ``kvgen wheel`` passes), a family whose spec file there is not committed
    in git, or no longer the one it was built from, is refused unless ``allow_dirty``."""
    if not archs:
        raise WheelError("no archs to package (pass --arch, e.g. sm_90a)")
    packages = {package_name(a) for a in archs}
    if len(packages) != 1:
        raise WheelError(f"archs {', '.join(archs)} belong to different wheels ({', '.join(sorted(packages))})")
    package = packages.pop()
    archs = sorted(set(archs))
    payload = [Member(f"{package}/__init__.py", _init_py(archs).encode())]
    for arch in archs:
        payload += _registry_members(Path(registry_dir), arch, package)
    payload.sort(key=lambda m: m.name)
    record = provenance(Path(registry_dir), archs, package, specs_dir, allow_dirty)
    if record["dirty"] and not allow_dirty:
        raise _refuse_dirty(package, record["dirty"])
    tag = wheel_tag(payload)
    path = Path(out_dir) / wheel_filename(package, tag)
    _write_zip(path, [*payload, *_dist_info_members(package, archs, payload, tag, record)], limit_bytes)
    return path


def group_by_wheel(archs: Iterable[str]) -> dict[str, list[str]]:
    """package -> its archs, both sorted (so the same request always writes the same files)."""
    groups: dict[str, list[str]] = {}
    for arch in sorted(set(archs)):
        groups.setdefault(package_name(arch), []).append(arch)
    return dict(sorted(groups.items()))


def build_wheels(registry_dir: Path, archs: Sequence[str], out_dir: Path, limit_bytes: int = MAX_FILE_BYTES, *,
                 specs_dir: Path | None = None, allow_dirty: bool = False) -> list[Path]:
    """One wheel per arch family among ``archs``."""
    return [build_wheel(registry_dir, group, out_dir, limit_bytes, specs_dir=specs_dir, allow_dirty=allow_dirty)
            for group in group_by_wheel(archs).values()]


def _is_arch(name: str) -> bool:
    try:
        parse_arch(name)
    except ValueError:
        return False
    return True


def registry_archs(registry_dir: Path) -> list[str]:
    """Archs with a manifest in a registry (the default of ``kvgen wheel``)."""
    root = Path(registry_dir)
    if not root.is_dir():
        return []
    return sorted(d.name for d in root.iterdir() if (d / MANIFEST).is_file() and _is_arch(d.name))


# ---------------------------------------------------------------- installed wheels


@dataclass
class InstalledCheck:
    """One installed kernel wheel, checked: ``problems`` fail ``kvgen verify --installed``;
    ``notes`` (a wheel packed with --allow-dirty) are reported and do not."""

    name: str
    version: str
    location: str
    files: int = 0
    manifests: int = 0
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def installed_wheels(search_path: Sequence[str] | None = None) -> list[importlib.metadata.Distribution]:
    """Installed distributions declaring a ``kvgen.registries`` entry point (on ``search_path``,
    default ``sys.path``), by name."""
    found = {}
    dists = importlib.metadata.distributions(**({"path": list(search_path)} if search_path is not None else {}))
    for dist in dists:
        if dist.entry_points.select(group=ENTRY_POINT_GROUP):
            found.setdefault(dist.metadata["Name"], dist)   # the first on the path wins, as for imports
    return [found[name] for name in sorted(found)]


def _record_problems(dist: importlib.metadata.Distribution) -> tuple[int, list[str]]:
    """Files RECORD lists with a sha256 that are missing or differ (pip writes no hash for the
    bytecode it compiles, nor for RECORD itself)."""
    checked, problems = 0, []
    for file in dist.files or []:
        if file.hash is None:
            continue
        path = Path(file.locate())
        if not path.is_file():
            problems.append(f"{path}: listed in RECORD, missing")
            continue
        digest = base64.urlsafe_b64encode(bytes.fromhex(file_sha256(path))).rstrip(b"=").decode()
        checked += 1
        if file.hash.mode != "sha256" or file.hash.value != digest:
            problems.append(f"{path}: sha256 differs from RECORD")
    return checked, problems


def check_installed(dist: importlib.metadata.Distribution) -> InstalledCheck:
    name, version = dist.metadata["Name"], dist.version
    check = InstalledCheck(name, version, str(dist.locate_file("")))
    check.files, check.problems = _record_problems(dist)
    if version != __version__:
        check.problems.append(f"{name} {version} needs kvgen {version}, this is kvgen {__version__}; fix: "
                              f"pip install {name}=={__version__}")
    recorded = dist.read_text(PROVENANCE)
    if recorded is None:
        check.problems.append(f"{name}: no {PROVENANCE} (packed by an older kvgen): the specs it was built from "
                              "are not recorded; repack it with kvgen wheel")
        record = {}
    else:
        record = json.loads(recorded)
        check.notes += [f"{name}: packed with --allow-dirty: {line}" for line in record.get("dirty", [])]
    shas = {(r["arch"], r["family"]): r["spec_sha256"] for r in record.get("specs", [])}
    for ep in dist.entry_points.select(group=ENTRY_POINT_GROUP):
        for path in sorted(Path(dist.locate_file(ep.value.replace(".", "/"))).glob(f"registry/*/{MANIFEST}")):
            check.manifests += 1
            check.problems += _manifest_problems(path, shas, name, recorded is not None)
    if check.manifests == 0:
        check.problems.append(f"{name}: no registry manifests found in the package")
    return check


def _manifest_problems(path: Path, shas: dict[tuple[str, str], str], name: str, has_record: bool) -> list[str]:
    try:
        manifest = read_manifest(path, verify=True)
    except RegistryError as exc:
        return [str(exc)]
    if not has_record:
        return []
    return [f"{path}: {e.family} built from spec sha256 {e.spec_sha256[:16]}..., {name}'s {PROVENANCE} records "
            f"{(shas.get((manifest.arch, e.family)) or 'none')[:16]}"
            for e in manifest.families if shas.get((manifest.arch, e.family)) != e.spec_sha256]


def verify_installed(search_path: Sequence[str] | None = None) -> list[InstalledCheck]:
    """Every installed kernel wheel, checked (``kvgen verify --installed``)."""
    return [check_installed(dist) for dist in installed_wheels(search_path)]
