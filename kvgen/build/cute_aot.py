"""The CuTe DSL AOT backend: a family's rendered score module -> exported object -> shared library.

Flow per (family, arch):
1. render ``templates/score.py.j2`` (the family's constants; kernel logic in ``kvgen.kernels.cute``);
2. in a child process with ``CUTE_DSL_ARCH=<arch>`` (the DSL exports only for its own arch, so one
   process per arch, all of that arch's families in it): ``cute.compile`` with symbolic sizes,
   ``export_to_c`` -> ``kvgen_score_impl.h`` + an x86-64 ``.o`` with the cubin embedded, and
   ``score_family.h`` (the family's name, arch and geometry for the C shim);
3. ``g++``: ``kvgen/kernels/cute/score_abi.cpp`` (the C ABI, ``kvgen/kernels/include/kvgen_score.h``) + the object +
   the CuTe DSL runtime and cudart, both static -> ``lib<kvgen_family>_score.so``, which needs only
   the CUDA driver where it runs;
4. cached like every kvgen artifact (``kvgen.build.cache.get_or_build``: temp dir, rename, metadata last)
   under a key over the rendered module, the kernel and shim sources, the DSL distributions'
   versions, the static libraries' sha256, the host compiler and the arch; then copied into
   ``<registry>/<arch>/`` beside a ``.json`` sidecar (sha256, key, versions, plan).

``build_score_library`` / ``build_score_libraries`` are the only entry points ``kvgen build`` needs.
Nothing here reads a GPU; the child process is the only place CUTLASS is imported.
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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from kvgen import __version__
from kvgen.arch import ARCHS
from kvgen.artifacts.manifest import score_library_name as registry_score_name
from kvgen.build.cache import CACHE_SCHEMA_VERSION, entry_dir, get_or_build, load_entry
from kvgen.files import copy_if_different, file_sha256, write_if_different, write_json_atomic
from kvgen.kernels import CUTE_DIR, INCLUDE_DIR, KERNELS_DIR
from kvgen.lower.plan import KernelPlan, score_plan
from kvgen.lower.triattention import require_scorable
from kvgen.render.source import TEMPLATES_DIR, render
from kvgen.spec.schema import FamilySpec

KERNEL_SOURCE = CUTE_DIR / "score_kernel.py"
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
            "kvgen_score_last_error", "kvgen_score_query_geometry")


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


# ---------------------------------------------------------------- plan and render


def score_library_name(plan: KernelPlan) -> str:
    return registry_score_name(plan.symbol())


def source_texts(rendered: str) -> dict[str, str]:
    """Every source the artifact is made of, by a stable relative name (part of the key)."""
    texts = {"score.py": rendered}
    for path in (KERNEL_SOURCE, SHIM_SOURCE, SHIM_HEADER):
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
    env = dict(os.environ if environ is None else environ)
    env.update(CUTE_DSL_ARCH=arch, CUTE_DSL_NO_CACHE="1")
    cmd = [toolchain.python, "-m", "kvgen.build.cute_aot", "export", str(jobs_file), str(out_root)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
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
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    log = " ".join(cmd) + "\n" + proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise CuteCompileError(f"linking {out.name} failed (exit {proc.returncode})", log)
    return log


# ---------------------------------------------------------------- build with cache and registry


@dataclass(frozen=True)
class ScoreBuild:
    family: str
    arch: str
    status: str                 # "hit" | "built" | "failed"
    artifact: Path | None       # the registry copy
    key: str = ""
    seconds: float = 0.0
    error: str = ""


@dataclass
class _Job:
    plan: KernelPlan
    rendered: str
    key: str
    entry: Path
    texts: dict[str, str] = field(default_factory=dict)


def _build_into(tmp: Path, job: _Job, staged: Path, arch: str, toolchain: CuteToolchain) -> dict[str, Any]:
    """``get_or_build`` callback: copy the staged export in, link, describe."""
    for name in (f"{IMPL_NAME}.o", f"{IMPL_NAME}.h", "score_family.h"):
        shutil.copyfile(staged / name, tmp / name)
    (tmp / "score.py").write_text(job.rendered, encoding="utf-8")
    library = score_library_name(job.plan)
    start = time.perf_counter()
    log = link_score_library(tmp, tmp / library, toolchain)
    (tmp / "link.log").write_text(log, encoding="utf-8")
    return {
        "artifact": library,
        "family": job.plan.family,
        "arch": arch,
        "op": "score",
        "plan_key": job.plan.key(),
        "params": dict(job.plan.params),
        "toolchain": toolchain.identity(),
        "sources_sha256": {n: hashlib.sha256(t.encode()).hexdigest() for n, t in sorted(job.texts.items())},
        "link_seconds": round(time.perf_counter() - start, 3),
        "kvgen_version": __version__,
    }


def publish_score_library(registry_dir: Path, arch: str, artifact: Path, meta: Mapping[str, Any]) -> Path:
    """Copy into ``<registry>/<arch>/`` (atomic) and write the sidecar ``.json`` after it."""
    dest = Path(registry_dir) / arch / artifact.name
    copy_if_different(artifact, dest, meta["artifact_sha256"])
    sidecar = {k: meta[k] for k in ("family", "arch", "op", "plan_key", "params", "artifact_sha256", "key",
                                    "kvgen_version") if k in meta}
    sidecar["artifact"] = dest.name
    sidecar["dsl"] = meta.get("toolchain", {}).get("dsl", {})
    write_json_atomic(dest.with_suffix(".json"), sidecar)
    os.chmod(dest.with_suffix(".json"), 0o644)
    return dest


def score_library_path(registry_dir: Path, arch: str, family: str) -> Path:
    """Where ``build_score_libraries`` publishes a family's library for ``arch``."""
    return Path(registry_dir) / arch / score_library_name(KernelPlan(family, "score", TEMPLATE, {}))


def build_score_libraries(specs: Sequence[FamilySpec], archs: Sequence[str] | None, cache_dir: Path,
                          registry_dir: Path = Path("build/registry"), *,
                          params: Callable[[str, str], Mapping[str, int]] | None = None,
                          toolchain: CuteToolchain | None = None, jobs: int = 2,
                          generated_dir: Path | None = None, templates_dir: Path = TEMPLATES_DIR) -> list[ScoreBuild]:
    """Score libraries of every TriAttention family in ``specs`` for ``archs`` (None: each spec's
    targets that the DSL supports), cached, published to ``<registry_dir>/<arch>/``.

    ``params(family, arch)`` gives the tuned launch parameters (default: the safe defaults);
    ``generated_dir`` receives the default-parameter rendering (the arch-neutral reference).
    Families without TriAttention are skipped silently; a family that enables it but cannot be
    scored (MLA, fp8) raises ``GeometryError`` (the spec already refuses those). ``jobs`` archs
    export at once (one child process each). A failed family is reported, not raised.
    """
    toolchain = toolchain or find_cute_toolchain()
    wanted: dict[str, list[KernelPlan]] = {}
    for spec in specs:
        if not spec.triattention.enabled:
            continue
        if generated_dir is not None:
            write_if_different(Path(generated_dir) / spec.name / "score.py", render(score_plan(spec), templates_dir))
        for arch in archs or [a for a in spec.targets if a in ARCHS]:
            if arch not in ARCHS:
                raise ValueError(f"score kernels target {', '.join(ARCHS)}; not {arch}")
            if arch not in spec.targets:
                continue   # like the family library: an arch the spec does not target is skipped
            wanted.setdefault(arch, []).append(score_plan(spec, params(spec.name, arch) if params else None))
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        futures = [pool.submit(_build_arch, arch, plans, Path(cache_dir), toolchain, templates_dir, registry_dir)
                   for arch, plans in sorted(wanted.items())]
        results = [build for future in futures for build in future.result()]
    return sorted(results, key=lambda b: (b.family, b.arch))


def build_score_candidates(plans: Sequence[KernelPlan], arch: str, cache_dir: Path, *,
                           toolchain: CuteToolchain | None = None,
                           templates_dir: Path = TEMPLATES_DIR) -> list[ScoreBuild]:
    """Libraries of score plans (any families, any parameters) for ``arch``, cached and left in
    the cache (``artifact`` is the cache entry's file): the tuner's candidates, never published."""
    return _build_arch(arch, plans, Path(cache_dir), toolchain or find_cute_toolchain(), templates_dir, None)


def _build_arch(arch: str, plans: Sequence[KernelPlan], cache_dir: Path, toolchain: CuteToolchain,
                templates_dir: Path, registry_dir: Path | None) -> list[ScoreBuild]:
    start = time.perf_counter()
    todo = []
    for plan in plans:
        rendered = render(plan, templates_dir)
        texts = source_texts(rendered)
        key = score_cache_key(texts, arch, toolchain)
        entry = entry_dir(cache_dir, __version__, arch, f"{plan.family}-score", key)
        todo.append(_Job(plan, rendered, key, entry, texts))
    misses = {job.key: job for job in todo if load_entry(job.entry, job.key) is None}
    results = []
    with tempfile.TemporaryDirectory(prefix=f"kvgen-cute-{arch}-") as staging_dir:
        staging = Path(staging_dir)
        errors: dict[str, str] = {}
        if misses:
            modules = {}
            for key, job in misses.items():   # one module per distinct key: plans of one family may differ
                module = staging / "modules" / key[:16] / "score.py"
                module.parent.mkdir(parents=True, exist_ok=True)
                module.write_text(job.rendered, encoding="utf-8")
                modules[key[:16]] = module
            errors = export_objects(modules, arch, staging / "out", toolchain)
        for job in todo:
            results.append(_finish(job, arch, staging / "out" / job.key[:16], errors.get(job.key[:16]),
                                   registry_dir, toolchain, start))
    return results


def _finish(job: _Job, arch: str, staged: Path, export_error: str | None, registry_dir: Path | None,
            toolchain: CuteToolchain, start: float) -> ScoreBuild:
    family = job.plan.family
    if export_error:
        return ScoreBuild(family, arch, "failed", None, job.key, time.perf_counter() - start, export_error)
    try:
        meta, hit = get_or_build(job.entry, job.key, lambda tmp: _build_into(tmp, job, staged, arch, toolchain))
    except (CuteCompileError, OSError) as exc:
        return ScoreBuild(family, arch, "failed", None, job.key, time.perf_counter() - start, str(exc))
    artifact = job.entry / meta["artifact"]
    if registry_dir is not None:
        artifact = publish_score_library(registry_dir, arch, artifact, meta)
    return ScoreBuild(family, arch, "hit" if hit else "built", artifact, job.key, time.perf_counter() - start)


def build_score_library(spec: FamilySpec, arch: str, cache_dir: Path, registry_dir: Path = Path("build/registry"),
                        *, params: Mapping[str, int] | None = None, toolchain: CuteToolchain | None = None,
                        generated_dir: Path | None = None) -> Path:
    """One family's score library for one arch: the path of the registry copy (built if needed).
    Raises ``CuteCompileError`` on failure, ``GeometryError`` for a family it cannot score."""
    require_scorable(spec)
    builds = build_score_libraries([spec], [arch], cache_dir, registry_dir, params=lambda _f, _a: dict(params or {}),
                                   toolchain=toolchain, jobs=1, generated_dir=generated_dir)
    (build,) = builds
    if build.status == "failed":
        raise CuteCompileError(f"{spec.name} score library for {arch} failed", build.error)
    return build.artifact


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
        ("layout", {"HND": 0, "NHD": 1}[kernel.layout]), ("dtype", {"bf16": 0, "fp16": 1}[kernel.dtype]),
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
    if os.environ.get("CUTE_DSL_ARCH") != arch:
        raise SystemExit(f"CUTE_DSL_ARCH={os.environ.get('CUTE_DSL_ARCH')!r} but the jobs are for {arch}")
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
