"""The CuTe DSL AOT backend: a family's rendered score module -> exported object -> shared library.

Flow per score ``BuildJob`` (``kvgen.build.job``: the rendered ``templates/score.py.j2``, the
family's constants; kernel logic in ``kvgen.kernels.cute``):
1. in a child process with ``CUTE_DSL_ARCH=<arch>`` (the DSL exports only for its own arch, so one
   process per arch, all of that arch's jobs in it): ``cute.compile`` with symbolic sizes,
   ``export_to_c`` -> ``kvgen_score_impl.h`` + an x86-64 ``.o`` with the cubin embedded, and
   ``score_family.h`` (the family's name, arch and geometry for the C shim);
2. ``g++``: ``kvgen/kernels/cute/score_abi.cpp`` (the C ABI, ``kvgen/kernels/include/kvgen_score.h``) + the object +
   the CuTe DSL runtime and cudart, both static -> ``lib<kvgen_family>_score.so``, which needs only
   the CUDA driver where it runs;
3. cached like every kvgen artifact (``kvgen.build.cache.get_or_build``: temp dir, rename, metadata last)
   under a key over the rendered module, the kernel and shim sources, the DSL distributions'
   versions, the static libraries' sha256, the host compiler and the arch. Publishing into the
   registry is ``kvgen.build.pipeline.publish``'s, as for every artifact.

``compile_scores`` is the entry point (``kvgen.build.compile`` calls it once per arch). Nothing
here reads a GPU; the child process is the only place CUTLASS is imported.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from kvgen import __version__, paths
from kvgen.build.cache import CACHE_SCHEMA_VERSION, entry_dir, get_or_build, load_entry
from kvgen.build.job import BuildJob, BuildOutcome
from kvgen.build.process import run_in_group
from kvgen.files import file_sha256
from kvgen.kernels import CUTE_DIR, INCLUDE_DIR, KERNELS_DIR

# the kernel modules the rendered score.py imports (both forms and the geometry they share)
KERNEL_SOURCES = (CUTE_DIR / "score_kernel.py", CUTE_DIR / "score_mma.py", CUTE_DIR / "geometry.py")
SHIM_SOURCE = CUTE_DIR / "score_abi.cpp"
SHIM_HEADER = INCLUDE_DIR / "kvgen_score.h"
TEMPLATE = "score.py.j2"
IMPL_NAME = "kvgen_score_impl"          # function_prefix of the export; the shim includes its header
RECIPE_VERSION = 1                       # bump when the export or link recipe below changes

# libstdc++ stays dynamic: its static archive pulls arc4random (glibc 2.36) and libgcc_eh
# _dl_find_object (2.35); dynamic, the library needs GLIBC_2.34 and GLIBCXX_3.4.21, like the codec's.
CXX_FLAGS = ("-std=c++17", "-O2", "-fPIC", "-shared")
LINK_LIBS = ("-ldl", "-lrt", "-lpthread")
EXPORTED = ("kvgen_score", "kvgen_score_abi_version", "kvgen_score_family_name", "kvgen_score_arch",
            "kvgen_score_last_error", "kvgen_score_query_geometry", "kvgen_score_check_device_errors")


class CuteCompileError(RuntimeError):
    """The DSL export or the link failed; carries the full log."""

    def __init__(self, message: str, log: str = ""):
        self.log = log
        super().__init__(f"{message}\n{log}" if log else message)


# ---------------------------------------------------------------- toolchain


@dataclass(frozen=True)
class CuteToolchain:
    python: str                                 # interpreter with the DSL (not realpath: a venv)
    dsl_versions: tuple[tuple[str, str], ...]   # every nvidia-cutlass-dsl* distribution, sorted
    runtime_lib: str                            # libcuda_dialect_runtime_static.a
    runtime_lib_sha256: str
    cudart_static: str                          # libcudart_static.a of the CUDA the GPU driver runs
    cudart_static_sha256: str
    cuda_include: str
    cxx: str                                    # real path of the host C++ compiler
    cxx_version: str

    def identity(self) -> dict[str, Any]:
        """What changes the artifact (cache key): versions and contents, not paths."""
        return {"dsl": dict(self.dsl_versions), "runtime_lib_sha256": self.runtime_lib_sha256,
                "cudart_static_sha256": self.cudart_static_sha256, "cxx": self.cxx, "cxx_version": self.cxx_version}


_PROBE = """
import importlib.metadata as md, json, subprocess, sys
versions = sorted((d.metadata["Name"].lower(), d.version) for d in md.distributions()
                  if (d.metadata["Name"] or "").lower().startswith("nvidia-cutlass-dsl"))
libdir = subprocess.run([sys.executable, "-m", "cutlass.cute.export.aot_config", "--libdir"],
                        capture_output=True, text=True, check=True).stdout.strip()
print(json.dumps({"versions": versions, "libdir": libdir}))
"""


def find_cute_toolchain(python: str | None = None, cxx: str = "g++",
                        cuda_home: str | Path = "/usr/local/cuda") -> CuteToolchain:
    """Probe the DSL in ``python`` (a child process: this process never imports CUTLASS), the
    CUDA static runtime under ``cuda_home`` and the host compiler."""
    python = python or sys.executable
    proc = subprocess.run([python, "-c", _PROBE], capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        raise CuteCompileError(f"{python}: CuTe DSL not usable (pip install 'nvidia-cutlass-dsl[cu13]==4.8.1')",
                               proc.stderr)
    probe = json.loads(proc.stdout.strip().splitlines()[-1])
    if not probe["versions"]:
        raise CuteCompileError(f"{python}: no nvidia-cutlass-dsl distribution installed")
    runtime_lib = Path(probe["libdir"]) / "libcuda_dialect_runtime_static.a"
    cudart = Path(cuda_home) / "lib64" / "libcudart_static.a"
    for needed in (runtime_lib, cudart):
        if not needed.is_file():
            raise CuteCompileError(f"missing {needed} (needed to link a score library)")
    cxx_path = shutil.which(cxx) or cxx
    version = subprocess.run([cxx_path, "--version"], capture_output=True, text=True).stdout.splitlines()
    return CuteToolchain(
        python=python, dsl_versions=tuple(tuple(v) for v in probe["versions"]),
        runtime_lib=str(runtime_lib), runtime_lib_sha256=file_sha256(runtime_lib),
        cudart_static=str(cudart), cudart_static_sha256=file_sha256(cudart),
        cuda_include=str(Path(cuda_home) / "include"), cxx=os.path.realpath(cxx_path),
        cxx_version=version[0].strip() if version else "")


# ---------------------------------------------------------------- cache key


def source_texts(rendered: str) -> dict[str, str]:
    """Every source the artifact is made of, by a stable relative name (part of the key)."""
    texts = {"score.py": rendered}
    for path in (*KERNEL_SOURCES, SHIM_SOURCE, SHIM_HEADER):
        texts[f"kernels/{path.relative_to(KERNELS_DIR).as_posix()}"] = path.read_text(encoding="utf-8")
    return texts


def score_cache_key(texts: Mapping[str, str], arch: str, toolchain: CuteToolchain) -> str:
    payload = {
        "sources": {name: hashlib.sha256(text.encode()).hexdigest() for name, text in sorted(texts.items())},
        "arch": arch,
        "toolchain": toolchain.identity(),
        "recipe": RECIPE_VERSION,
        "cxx_flags": list(CXX_FLAGS),
        "schema": CACHE_SCHEMA_VERSION,
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


# ---------------------------------------------------------------- export (child process) and link


def export_objects(modules: Mapping[str, Path], arch: str, out_root: Path, toolchain: CuteToolchain,
                   timeout: float = 1800, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """Export every ``{name: score.py path}`` for ``arch`` into ``out_root/<name>/`` in ONE child
    process. Returns ``{name: error text}`` for the failures (empty: all exported)."""
    out_root.mkdir(parents=True, exist_ok=True)
    jobs_file = out_root / "jobs.json"
    jobs_file.write_text(json.dumps({"arch": arch, "jobs": {n: str(p) for n, p in modules.items()}}))
    env = paths.child_environ(environ, CUTE_DSL_ARCH=arch, CUTE_DSL_NO_CACHE="1")
    cmd = [toolchain.python, "-m", "kvgen.build.cute_aot", "export", str(jobs_file), str(out_root)]
    try:
        proc = run_in_group(cmd, timeout=timeout, env=env)
    except subprocess.TimeoutExpired as exc:
        raise CuteCompileError(f"CuTe DSL export for {arch} timed out after {timeout} s", str(exc.stderr or ""))
    results_file = out_root / "results.json"
    if not results_file.is_file():
        raise CuteCompileError(f"CuTe DSL export for {arch} died (exit {proc.returncode})", proc.stdout + proc.stderr)
    results = json.loads(results_file.read_text())
    return {name: error for name, error in results.items() if error}


def link_score_library(obj_dir: Path, out: Path, toolchain: CuteToolchain, timeout: float = 600) -> str:
    """``score_abi.cpp`` + the exported object + static runtimes -> ``out``; returns the log."""
    version_script = obj_dir / "exports.map"
    version_script.write_text("{\n  global:\n" + "".join(f"    {name};\n" for name in EXPORTED)
                              + "  local: *;\n};\n")
    cmd = [toolchain.cxx, *CXX_FLAGS, f"-I{INCLUDE_DIR}", f"-I{obj_dir}", f"-I{toolchain.cuda_include}",
           str(SHIM_SOURCE), str(obj_dir / f"{IMPL_NAME}.o"), toolchain.runtime_lib,
           toolchain.cudart_static, *LINK_LIBS, f"-Wl,--version-script={version_script}", "-Wl,--exclude-libs,ALL",
           "-o", str(out)]
    proc = run_in_group(cmd, timeout=timeout)
    log = " ".join(cmd) + "\n" + proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise CuteCompileError(f"linking {out.name} failed (exit {proc.returncode})", log)
    return log


# ---------------------------------------------------------------- compile score jobs through the cache


@dataclass
class _Pending:
    job: BuildJob
    rendered: str
    texts: dict[str, str]
    key: str
    entry: Path


def _link_into(tmp: Path, pending: _Pending, staged: Path, toolchain: CuteToolchain) -> dict[str, Any]:
    """``get_or_build`` callback: copy the staged export in, link, describe."""
    for name in (f"{IMPL_NAME}.o", f"{IMPL_NAME}.h", "score_family.h"):
        shutil.copyfile(staged / name, tmp / name)
    (tmp / "score.py").write_text(pending.rendered, encoding="utf-8")
    job = pending.job
    start = time.perf_counter()
    log = link_score_library(tmp, tmp / job.artifact, toolchain)
    (tmp / "link.log").write_text(log, encoding="utf-8")
    (plan,) = job.plans
    return {
        **job.entry_meta(),
        "plan_key": plan.key(),
        "params": dict(plan.params),
        "toolchain": toolchain.identity(),
        "sources_sha256": {n: hashlib.sha256(t.encode()).hexdigest() for n, t in sorted(pending.texts.items())},
        "link_seconds": round(time.perf_counter() - start, 3),
        "kvgen_version": __version__,
    }


def compile_scores(jobs: Sequence[BuildJob], cache_dir: Path, toolchain: CuteToolchain) -> list[BuildOutcome]:
    """Outcomes of score jobs (backend ``cute``, all for one arch), in order, each library left in
    its cache entry. Cache misses are exported in ONE child process (one module per distinct key:
    jobs of one family may differ in parameters), then linked one by one. A failure is a
    ``failed`` outcome with its log."""
    archs = {job.arch for job in jobs}
    if len(archs) > 1 or any(job.backend != "cute" for job in jobs):
        raise ValueError(f"compile_scores takes score jobs of one arch, got {sorted(archs)}")
    start = time.perf_counter()
    pending = []
    for job in jobs:
        (rendered,) = job.rendered.values()
        texts = source_texts(rendered)
        key = score_cache_key(texts, job.arch, toolchain)
        pending.append(_Pending(job, rendered, texts, key, entry_dir(cache_dir, __version__, job.arch,
                                                                     f"{job.family}-score", key)))
    misses = {p.key[:16]: p for p in pending if load_entry(p.entry, p.key) is None}
    with tempfile.TemporaryDirectory(prefix="kvgen-cute-") as staging_dir:
        staging = Path(staging_dir)
        errors: dict[str, str] = {}
        if misses:
            modules = {}
            for name, p in misses.items():
                module = staging / "modules" / name / "score.py"
                module.parent.mkdir(parents=True, exist_ok=True)
                module.write_text(p.rendered, encoding="utf-8")
                modules[name] = module
            try:
                errors = export_objects(modules, archs.pop(), staging / "out", toolchain)
            except CuteCompileError as exc:
                errors = {name: str(exc) for name in modules}
        return [_finish(p, staging / "out" / p.key[:16], errors.get(p.key[:16]), toolchain, start) for p in pending]


def _finish(pending: _Pending, staged: Path, export_error: str | None, toolchain: CuteToolchain,
            start: float) -> BuildOutcome:
    job = pending.job
    if export_error:
        return BuildOutcome(job.family, job.arch, job.backend, "failed", time.perf_counter() - start, None,
                            pending.key, export_error)
    try:
        meta, hit = get_or_build(pending.entry, pending.key,
                                 lambda tmp: _link_into(tmp, pending, staged, toolchain))
    except (CuteCompileError, OSError) as exc:
        return BuildOutcome(job.family, job.arch, job.backend, "failed", time.perf_counter() - start, None,
                            pending.key, str(exc))
    return BuildOutcome(job.family, job.arch, job.backend, "hit" if hit else "built", time.perf_counter() - start,
                        pending.entry / meta["artifact"], pending.key, sha256=meta["artifact_sha256"],
                        toolchain=dict(toolchain.dsl_versions))


def embedded_sm_versions(path: Path) -> list[int]:
    """SM versions (90, 100, ...) of the CUDA ELF images embedded in a host object or library:
    the fatbin's cubins start with an ELF header whose machine is EM_CUDA (190); the SM number
    is byte 1 of e_flags. Lets a CPU-only test prove an artifact was compiled for its target."""
    data = Path(path).read_bytes()
    found = []
    start = data.find(b"\x7fELF", 1)
    while start != -1:
        header = data[start:start + 64]
        if len(header) == 64 and int.from_bytes(header[18:20], "little") == 190:
            found.append(int.from_bytes(header[48:52], "little") >> 8 & 0xFF)
        start = data.find(b"\x7fELF", start + 1)
    return found


# ---------------------------------------------------------------- the child process


def family_header(kernel: Any, family: str, arch: str) -> str:
    """``score_family.h``: what the shim reports and checks (values from the kernel object)."""
    fields = [
        ("abi_version", "KVGEN_SCORE_ABI_VERSION"), ("head_dim", kernel.head_dim),
        ("query_heads", kernel.query_heads), ("kv_heads", kernel.kv_heads),
        ("rotary_start", kernel.rotary_start), ("rotary_dim", kernel.rotary_dim),
        ("pairing", {"half": 0, "interleaved": 1}[kernel.pairing]), ("tokens_per_block", kernel.tokens_per_block),
        ("layout", {"HND": 0, "NHD": 1}[kernel.layout]), ("dtype", {"bf16": 0, "fp16": 1, "fp8_e4m3": 2}[kernel.dtype]),
        ("threads", kernel.threads), ("heads_per_pass", kernel.heads), ("passes", kernel.passes),
        ("vector_elems", kernel.vec), ("lanes", kernel.lanes), ("tokens_per_cta", kernel.tokens_per_cta),
    ]
    body = "".join(f"    /*{name}=*/{value},\n" for name, value in fields)
    return (f"// Generated by kvgen.build.cute_aot for {family}, {arch}: do not edit.\n"
            f"#define KVGEN_SCORE_FAMILY \"{family}\"\n#define KVGEN_SCORE_ARCH \"{arch}\"\n"
            f"static const kvgen_score_geometry_t kFamilyGeometry = {{\n{body}}};\n")


def _export_one(module_path: Path, out_dir: Path, arch: str) -> None:
    import importlib.util

    name = "kvgen_score_module_" + hashlib.sha256(str(module_path).encode()).hexdigest()[:12]
    spec = importlib.util.spec_from_file_location(name, module_path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    kernel = module.make_kernel()
    compiled = kernel.compile_aot(arch)
    out_dir.mkdir(parents=True, exist_ok=True)
    compiled.export_to_c(str(out_dir), IMPL_NAME, function_prefix=IMPL_NAME)
    (out_dir / "score_family.h").write_text(family_header(kernel, module.FAMILY, arch), encoding="utf-8")


def _export_main(jobs_file: Path, out_root: Path) -> int:
    """Child process: ``CUTE_DSL_ARCH`` is set by the parent; export every job, record each
    outcome in ``results.json`` (written last, so its presence means the process finished)."""
    import traceback

    request = json.loads(jobs_file.read_text())
    arch = request["arch"]
    if paths.cute_dsl_arch() != arch:
        raise SystemExit(f"CUTE_DSL_ARCH={paths.cute_dsl_arch()!r} but the jobs are for {arch}")
    results = {}
    for name, module_path in request["jobs"].items():
        try:
            _export_one(Path(module_path), out_root / name, arch)
            results[name] = ""
        except Exception:  # noqa: BLE001 - one family's failure must not stop the others
            results[name] = traceback.format_exc()
    (out_root / "results.json").write_text(json.dumps(results, indent=2))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) == 3 and args[0] == "export":
        return _export_main(Path(args[1]), Path(args[2]))
    print("usage: python -m kvgen.build.cute_aot export JOBS.json OUT_DIR  (CUTE_DSL_ARCH set)", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
