"""The nvcc backend: find toolchains, compile rendered CUDA sources to a shared library per arch.

A toolchain is identified by what it *is* (real path of the nvcc binary, its version and the
sha256 of ``nvcc --version``, and the host compiler), never by how it was reached (the PATH
string, a wrapper script, a symlink): the same compiler reached two ways gives one cache key.
Nothing here reads the environment; the CLI passes ``$KVGEN_NVCC``, ``$CUDA_HOME`` and ``$PATH`` in.
Compiles run in a process group of their own (``kvgen.build.process``): an interrupted or killed
build leaves no nvcc behind.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Mapping, Sequence

from kvgen.build.process import run_in_group

# Architectures whose SASS needs a newer nvcc than the system one, and how to get it.
RUBIN_HINT = 'pip install "nvidia-cuda-nvcc==13.5.*" (or pip install kvgen[nvcc-rubin])'

_ARCH = re.compile(r"^sm_(\d+)([af]?)$")


class ToolchainError(RuntimeError):
    """No usable nvcc, or none that supports the requested arch."""


class CompileError(RuntimeError):
    """nvcc failed; carries the full compiler log, the command and the sources it was given."""

    def __init__(self, message: str, log: str, command: Sequence[str], sources: Sequence[Path]):
        self.log = log
        self.command = tuple(command)
        self.sources = tuple(sources)
        super().__init__(f"{message}\ncommand: {' '.join(self.command)}\nsources: "
                         f"{', '.join(map(str, self.sources))}\n{log}")

    @property
    def resource_overflow(self) -> bool:
        """Too much shared memory / too many registers: an invalid config for the tuner, not a bug."""
        return bool(re.search(r"too much shared data|uses too much|Registers exceed|too many resources",
                              self.log, re.IGNORECASE))


def _run(cmd: Sequence[str], timeout: float = 120, cwd: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout, cwd=cwd)


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


# ---------------------------------------------------------------- toolchains


@dataclass(frozen=True)
class Toolchain:
    nvcc: str                       # real path of the nvcc binary (wrappers, symlinks resolved)
    version: str                    # e.g. "13.0.88"
    version_sha256: str             # sha256 of the full ``nvcc --version`` output
    archs: tuple[str, ...]          # real archs it can emit SASS for, e.g. ("sm_75", ..., "sm_90")
    host_cc: str = ""               # real path of the host compiler passed as -ccbin ("" = nvcc's)
    host_cc_version: str = ""       # first line of ``host_cc --version``

    @property
    def release(self) -> str:
        return ".".join(self.version.split(".")[:2])

    def supports(self, arch: str) -> bool:
        """``sm_90a``/``sm_100f`` are variants of the real arch ``sm_90``/``sm_100``."""
        match = _ARCH.match(arch)
        return bool(match) and f"sm_{match.group(1)}" in self.archs

    def identity(self) -> dict[str, str]:
        """Everything about the toolchain that changes its output (cache key and metadata)."""
        return {"nvcc": self.nvcc, "version": self.version, "version_sha256": self.version_sha256,
                "host_cc": self.host_cc, "host_cc_version": self.host_cc_version}


def _version(text: str) -> str:
    match = re.search(r"V(\d+\.\d+\.\d+)", text) or re.search(r"release (\d+\.\d+)", text)
    if not match:
        raise ToolchainError(f"cannot read an nvcc version from: {text.strip()!r}")
    return match.group(1)


def real_nvcc(candidate: str | Path) -> str:
    """The nvcc binary behind ``candidate``, following symlinks and wrapper scripts.

    A wrapper (``exec /usr/local/cuda-13.0/bin/nvcc "$@"``) is seen through by asking nvcc
    where it lives: ``-dryrun`` prints ``_HERE_=<its bin directory>`` without compiling.
    """
    path = os.path.realpath(candidate)
    with open(path, "rb") as f:
        is_script = f.read(2) == b"#!"
    if not is_script:
        return path
    with tempfile.TemporaryDirectory(prefix="kvgen-nvcc-") as tmp:
        proc = _run([path, "-dryrun", "-x", "cu", "-E", os.devnull], cwd=tmp)
    match = re.search(r"^#\$ _HERE_=(.+)$", proc.stdout + proc.stderr, re.MULTILINE)
    if not match:
        raise ToolchainError(f"{candidate}: a wrapper script whose nvcc cannot be located (-dryrun)")
    return os.path.realpath(os.path.join(match.group(1).strip(), "nvcc"))


def _archs(nvcc: str) -> tuple[str, ...]:
    codes = _run([nvcc, "--list-gpu-code"]).stdout.split()
    return tuple(sorted({c for c in codes if _ARCH.match(c)}, key=lambda a: int(_ARCH.match(a).group(1))))


def _host_cc_version(host_cc: str) -> str:
    if not host_cc:
        return ""
    lines = _run([host_cc, "--version"]).stdout.splitlines()
    return lines[0].strip() if lines else ""


def probe_toolchain(candidate: str | Path, host_cc: str | None = None) -> Toolchain:
    """Ask one nvcc what it is. Raises ToolchainError if it is not a working nvcc."""
    try:
        nvcc = real_nvcc(candidate)
        out = _run([nvcc, "--version"])
    except (OSError, subprocess.SubprocessError) as exc:
        raise ToolchainError(f"{candidate}: not a runnable nvcc ({exc})") from None
    if out.returncode != 0:
        raise ToolchainError(f"{candidate}: `nvcc --version` failed: {out.stderr.strip()}")
    cc = os.path.realpath(host_cc) if host_cc else ""
    return Toolchain(nvcc=nvcc, version=_version(out.stdout), version_sha256=_sha256(out.stdout),
                     archs=_archs(nvcc), host_cc=cc, host_cc_version=_host_cc_version(cc))


def pip_nvcc_paths() -> list[Path]:
    """nvcc binaries shipped in pip wheels (``nvidia/cu13/bin/nvcc``, ``nvidia/cuda_nvcc/bin/nvcc``)."""
    spec = importlib.util.find_spec("nvidia")
    if spec is None or not spec.submodule_search_locations:
        return []
    found = []
    for root in spec.submodule_search_locations:
        found += sorted(Path(root).glob("*/bin/nvcc"))
    return found


def default_nvcc_candidates(explicit: str | None = None, cuda_home: str | None = None,
                            search_path: str | None = None) -> list[Path]:
    """Candidates in preference order: the explicit one ($KVGEN_NVCC), $CUDA_HOME, the PATH, the
    usual system location, then pip wheels. System first: the H200's driver is CUDA 13.0, and
    its binaries should come from the 13.0 toolkit; the pip 13.5 one is there for sm_107a."""
    candidates = []
    if explicit:
        candidates.append(Path(explicit))
    if cuda_home:
        candidates.append(Path(cuda_home) / "bin" / "nvcc")
    on_path = shutil.which("nvcc", path=search_path) if search_path is not None else None
    if on_path:
        candidates.append(Path(on_path))
    candidates.append(Path("/usr/local/cuda/bin/nvcc"))
    return candidates + pip_nvcc_paths()


def default_host_compiler(search_path: str | None) -> str | None:
    """The host C++ compiler nvcc would pick from this PATH, resolved so it can be pinned."""
    if search_path is None:
        return None
    found = shutil.which("g++", path=search_path) or shutil.which("c++", path=search_path)
    return os.path.realpath(found) if found else None


def find_toolchains(candidates: Iterable[str | Path], host_cc: str | None = None) -> list[Toolchain]:
    """Probe candidates in order; the unusable are skipped, the same nvcc reached twice kept once."""
    found: dict[str, Toolchain] = {}
    for candidate in candidates:
        if not Path(candidate).exists():
            continue
        try:
            toolchain = probe_toolchain(candidate, host_cc)
        except ToolchainError:
            continue
        found.setdefault(toolchain.nvcc, toolchain)
    return list(found.values())


def toolchain_for(arch: str, toolchains: Sequence[Toolchain]) -> Toolchain:
    """The first toolchain that supports ``arch``, else a clear error saying how to get one."""
    if not _ARCH.match(arch):
        raise ToolchainError(f"unknown arch {arch!r}; expected e.g. sm_90a, sm_100a, sm_100f, sm_103a, sm_107a")
    for toolchain in toolchains:
        if toolchain.supports(arch):
            return toolchain
    have = "; ".join(f"{t.nvcc} {t.version} ({', '.join(t.archs)})" for t in toolchains) or "no nvcc found"
    hint = RUBIN_HINT if arch.startswith("sm_107") else "install a CUDA toolkit that supports it"
    raise ToolchainError(f"no nvcc supports {arch} (have: {have}); {hint}, "
                         f"or point KVGEN_NVCC at an nvcc that does")


# ---------------------------------------------------------------- compile


@dataclass(frozen=True)
class KernelResources:
    """``-Xptxas -v`` facts about one entry function (the tuner prunes on these)."""

    registers: int = 0
    smem_bytes: int = 0
    stack_bytes: int = 0
    spill_stores: int = 0
    spill_loads: int = 0


@dataclass(frozen=True)
class CompileResult:
    artifact: Path
    command: tuple[str, ...]
    log: str
    seconds: float
    kernels: Mapping[str, KernelResources] = field(default_factory=dict)
    ptx: tuple[Path, ...] = ()


def gencode(arch: str) -> str:
    """``sm_90a`` -> ``arch=compute_90a,code=sm_90a`` (SASS only: no PTX embedded for JIT)."""
    if not _ARCH.match(arch):
        raise ToolchainError(f"unknown arch {arch!r}")
    return f"arch=compute_{arch[len('sm_'):]},code={arch}"


def nvcc_flags(arch: str, extra_flags: Sequence[str] = (), cudart: str = "static") -> list[str]:
    """The flags that shape the artifact (they are part of the cache key; paths are not).
    ``cudart="none"``: a library that opens the driver itself (the Triton AOT shims)."""
    return ["-shared", "-Xcompiler", "-fPIC", "-O3", "-std=c++17", "-gencode", gencode(arch),
            "--fmad=false", "-cudart", cudart, "-lineinfo", *extra_flags]


_ENTRY = re.compile(r"Compiling entry function '([^']+)' for")
_PROPS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers")
_SMEM = re.compile(r"(\d+) bytes smem")


def parse_ptxas(log: str) -> dict[str, KernelResources]:
    """Per entry function: registers, static smem, stack, spills (from ``-Xptxas -v``)."""
    facts: dict[str, dict[str, int]] = {}
    current = None
    for line in log.splitlines():
        if match := _ENTRY.search(line):
            current = match.group(1)
            facts[current] = {}
        elif current is None:
            continue
        elif match := _PROPS.search(line):
            stack, stores, loads = map(int, match.groups())
            facts[current].update(stack_bytes=stack, spill_stores=stores, spill_loads=loads)
        elif match := _USED.search(line):
            facts[current]["registers"] = int(match.group(1))
            smem = _SMEM.search(line)
            facts[current]["smem_bytes"] = int(smem.group(1)) if smem else 0
    return {name: KernelResources(**values) for name, values in facts.items()}


def _ptx(sources: Sequence[Path], arch: str, includes: list[str], out_dir: Path, toolchain: Toolchain,
         extra_flags: Sequence[str], timeout: float, cwd: Path | None) -> tuple[Path, ...]:
    """PTX beside the artifact, for inspection and tests; never embedded in the library."""
    written = []
    for source in sources:
        target = (out_dir / f"{Path(source).stem}.{arch}.ptx").absolute()
        cmd = [toolchain.nvcc, "-ptx", "-O3", "-std=c++17", "-gencode", gencode(arch), "--fmad=false",
               "-lineinfo", *extra_flags, *includes, str(source), "-o", str(target)]
        proc = run_in_group(cmd, timeout=timeout, cwd=str(cwd) if cwd else None)
        if proc.returncode != 0:
            raise CompileError(f"nvcc -ptx failed for {arch}", proc.stdout + proc.stderr, cmd, [Path(source)])
        written.append(target)
    return tuple(written)


def compile_shared_library(sources: Sequence[Path], arch: str, include_dirs: Sequence[Path], out: Path,
                           toolchain: Toolchain, extra_flags: Sequence[str] = (), *, ptx: bool = False,
                           timeout: float = 600, cwd: Path | None = None, cudart: str = "static") -> CompileResult:
    """One shared library (C ABI, static cudart, SASS for ``arch`` only) from ``sources``.

    Relative paths are taken from ``cwd``: compiling ``src/x.cu`` there keeps the compiler log
    and the ``-lineinfo`` file names free of the (temporary) absolute directory.
    """
    includes = [f"-I{d}" for d in include_dirs]
    ccbin = ["-ccbin", toolchain.host_cc] if toolchain.host_cc else []
    cmd = [toolchain.nvcc, *nvcc_flags(arch, extra_flags, cudart), *ccbin, "-Xptxas", "-v", *includes,
           *map(str, sources), "-o", str(out)]
    start = time.perf_counter()
    try:
        proc = run_in_group(cmd, timeout=timeout, cwd=str(cwd) if cwd else None)
    except subprocess.TimeoutExpired as exc:
        raise CompileError(f"nvcc timed out after {timeout} s for {arch}", str(exc.stderr or ""), cmd,
                           sources) from None
    log = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise CompileError(f"nvcc failed for {arch} (exit {proc.returncode})", log, cmd, sources)
    out_dir = Path(cwd or ".") / Path(out).parent
    ptx_files = _ptx(sources, arch, includes + ccbin, out_dir, toolchain, extra_flags, timeout, cwd) if ptx else ()
    return CompileResult(artifact=Path(cwd or ".") / out, command=tuple(cmd), log=log,
                         seconds=time.perf_counter() - start, kernels=parse_ptxas(log), ptx=ptx_files)


def cache_key(sources_text: Mapping[str, str], flags: Sequence[str], toolchain: Toolchain, arch: str,
              kvgen_schema_version: int | str) -> str:
    """sha256 over everything that changes the artifact: source texts (by relative name), flags,
    toolchain identity, arch and the cache schema. Never mtimes, absolute paths or PATH."""
    payload = {
        "sources": {name: _sha256(text) for name, text in sorted(sources_text.items())},
        "flags": list(flags),
        "toolchain": toolchain.identity(),
        "arch": arch,
        "schema": str(kvgen_schema_version),
    }
    return _sha256(json.dumps(payload, sort_keys=True, separators=(",", ":")))
