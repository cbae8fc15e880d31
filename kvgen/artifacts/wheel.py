"""Pre-generated kernel wheels: a registry's manifests and shared libraries as an installable package.

``kvgen wheel --arch sm_90a,sm_100a`` writes one wheel per arch family (``kvgen_kernels_sm90``,
``kvgen_kernels_sm100``: each stays far under PyPI's and GitHub's 100 MB per-file limit):

    kvgen_kernels_sm90/__init__.py                 REGISTRY, KVGEN_VERSION, ARCHS; never imported by kvgen
    kvgen_kernels_sm90/registry/<arch>/manifest.json and every artifact it lists (per family
                                                   lib<symbol>.so; for TriAttention families also
                                                   lib<symbol>_score.so, <symbol>_pack.py and
                                                   <symbol>_select.py)
    kvgen_kernels_sm90-<v>.dist-info/              METADATA (Requires-Dist: kvgen==<v>), WHEEL,
                                                   entry_points.txt, RECORD

How the runtime finds it: the wheel declares an entry point in the group ``kvgen.registries``
whose value is the package name; ``kvgen.runtime.lookup.installed_sources`` locates that package
with ``importlib.util.find_spec`` (no code from the wheel runs) and searches its ``registry/``.
The wheel's version is the kvgen version it was built by, and it requires exactly that kvgen: the
libraries speak that version's C ABI and layout.

Written with the standard library (zipfile, RECORD with sha256), byte-for-byte reproducible:
members sorted, fixed timestamps and modes. Data only: the libraries link nothing from torch, and
the Triton modules are read by ``kvgen.runtime.pack`` and ``kvgen.runtime.select``, never imported
as part of this package.
Platform tag ``manylinux_2_28_x86_64``, raised to the newest glibc symbol version the libraries
really reference (``manylinux_2_34`` when linked on a glibc >= 2.34 system), so pip never installs
a wheel whose libraries cannot load.
"""

from __future__ import annotations

import base64
import hashlib
import os
import re
import tempfile
import zipfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvgen import __version__
from kvgen.arch import parse_arch
from kvgen.artifacts.manifest import MANIFEST, fix_command, manifest_path, read_manifest
from kvgen.artifacts.packages import ENTRY_POINT_GROUP, package_name
from kvgen.files import file_sha256

# The oldest glibc a tag may claim; raised to what the libraries really need (see glibc_needed).
MIN_GLIBC_MINOR = 28
WHEEL_TAG = "py3-none-manylinux_2_28_x86_64"     # for libraries that need nothing newer than 2.28
# GitHub and PyPI refuse files over 100 MB; keep a margin so a growing registry fails here first.
MAX_FILE_BYTES = 90 * 1000 * 1000
_ZIP_TIME = (1980, 1, 1, 0, 0, 0)   # earliest zip time: reproducible wheels
_GLIBC = re.compile(rb"GLIBC_2\.(\d+)")


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


def _metadata(dist: str, archs: Sequence[str]) -> str:
    return (f"Metadata-Version: 2.1\nName: {dist}\nVersion: {__version__}\n"
            f"Summary: Pre-generated kvgen kernel libraries (C ABI) for {', '.join(archs)}\n"
            f"Requires-Python: >=3.11\nRequires-Dist: kvgen=={__version__}\n")


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


def _dist_info_members(package: str, archs: Sequence[str], payload: Sequence[Member], tag: str) -> list[Member]:
    dist = package.replace("_", "-")
    info = f"{package}-{_file_version()}.dist-info"
    members = [
        Member(f"{info}/METADATA", _metadata(dist, archs).encode()),
        Member(f"{info}/WHEEL", _wheel_file(tag).encode()),
        Member(f"{info}/entry_points.txt", f"[{ENTRY_POINT_GROUP}]\n{package} = {package}\n".encode()),
        Member(f"{info}/top_level.txt", f"{package}\n".encode()),
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


def build_wheel(registry_dir: Path, archs: Sequence[str], out_dir: Path,
                limit_bytes: int = MAX_FILE_BYTES) -> Path:
    """One wheel holding ``archs`` (all of one arch family) from ``registry_dir``."""
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
    tag = wheel_tag(payload)
    path = Path(out_dir) / wheel_filename(package, tag)
    _write_zip(path, [*payload, *_dist_info_members(package, archs, payload, tag)], limit_bytes)
    return path


def group_by_wheel(archs: Iterable[str]) -> dict[str, list[str]]:
    """package -> its archs, both sorted (so the same request always writes the same files)."""
    groups: dict[str, list[str]] = {}
    for arch in sorted(set(archs)):
        groups.setdefault(package_name(arch), []).append(arch)
    return dict(sorted(groups.items()))


def build_wheels(registry_dir: Path, archs: Sequence[str], out_dir: Path,
                 limit_bytes: int = MAX_FILE_BYTES) -> list[Path]:
    """One wheel per arch family among ``archs``."""
    return [build_wheel(registry_dir, group, out_dir, limit_bytes) for group in group_by_wheel(archs).values()]


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
