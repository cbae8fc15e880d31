"""The Triton AOT backend: a family's rendered ``select.py`` -> Triton cubins for the arch ->
fatbinaries -> the C shim -> ``lib<symbol>_select.so`` (``kvgen/kernels/include/kvgen_select.h``).

Flow per select ``BuildJob`` (the rendered ``templates/select.py.j2``: the family's constants bound
to ``kvgen.kernels.triton.select.TritonSelector``):
1. a child process (``python -m kvgen.build.triton_aot``: Triton is imported only there) executes
   the rendered module and compiles ``aot_specializations(module.SELECTOR)``, exactly the kernels
   and constants its JIT launches would compile, for each Triton target of the arch (one; three
   for ``sm_100f``: 10.0, 10.3 and 10.7), line info off, Triton's own cache under the build cache;
2. ``fatbinary`` bundles each kernel's cubins; ``select_family.h`` carries them as byte arrays with
   the family's constants (data, no logic);
3. nvcc compiles the hand-written shim ``kvgen/kernels/triton/select_abi.cu`` (host code only,
   static cudart) with it into the library, which needs only the CUDA driver where it runs;
4. cached like every kvgen artifact under a key over the rendered module, the kernel, host and
   shim sources, Triton's version, the nvcc toolchain and the arch.

A kernel that needs global or profile scratch, or more than 48 KiB of shared memory, fails the
build with its name: the shim launches with neither.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any

from kvgen import __version__
from kvgen.arch import ARCHS, parse_arch
from kvgen.build.cache import CACHE_SCHEMA_VERSION, entry_dir, failed_dir, get_or_build
from kvgen.build.job import BuildJob, BuildOutcome
from kvgen.build.nvcc import CompileError, Toolchain, compile_shared_library, nvcc_flags
from kvgen.build.process import run_in_group
from kvgen.kernels import INCLUDE_DIR, KERNELS_DIR

TRITON_DIR = KERNELS_DIR / "triton"
SOURCES = (TRITON_DIR / "select.py", KERNELS_DIR / "selection.py", TRITON_DIR / "select_abi.cu",
           INCLUDE_DIR / "kvgen_select.h")
SHIM = "select_abi.cu"
RECIPE_VERSION = 1                    # bump when the compile or link recipe below changes
MAX_SHARED_BYTES = 48 * 1024          # the shim sets no opt-in attribute
CHILD_TIMEOUT = 900.0
# The shim's kImages order (select_abi.cu's enum Kernel).
KERNEL_ORDER = ("statistics", "aggregate_union", "aggregate_per_head", "aggregate_per_layer_perhead", "select")
EXPORTED = ("kvgen_select_abi_version", "kvgen_select_family_name", "kvgen_select_arch", "kvgen_select_last_error",
            "kvgen_select_query_geometry", "kvgen_select_scored_layers", "kvgen_select_statistics",
            "kvgen_select_aggregate", "kvgen_select_keep")


class TritonAotError(RuntimeError):
    """The AOT compile or link failed; the message carries the log."""


def triton_targets(arch: str) -> list[str]:
    """Arch-specific targets whose cubins the library holds: the arch itself, or for a family build
    (``sm_100f``) every arch-specific kvgen target of that major."""
    major, minor, variant = parse_arch(arch)
    if variant != "f":
        return [arch]
    return [a for a in ARCHS if parse_arch(a)[0] == major and parse_arch(a)[2] == "a"]


def triton_version() -> str:
    try:
        return metadata.version("triton")
    except metadata.PackageNotFoundError:
        raise TritonAotError("Triton is not installed: the selection library cannot be compiled "
                             "(install kvgen's [triton] extra)") from None


def cache_key(rendered: str, arch: str, toolchain: Toolchain) -> str:
    payload = {
        "module": hashlib.sha256(rendered.encode()).hexdigest(),
        "sources": {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in SOURCES},
        "triton": triton_version(),
        "toolchain": toolchain.identity(),
        "flags": nvcc_flags(arch),
        "arch": arch,
        "recipe": RECIPE_VERSION,
        "schema": CACHE_SCHEMA_VERSION,
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def compile_select(job: BuildJob, cache_dir: Path, toolchain: Toolchain) -> BuildOutcome:
    """The job's library in its cache entry (built if its key is not there yet); a failure is a
    ``failed`` outcome carrying the log."""
    (rendered,) = job.rendered.values()
    start = time.perf_counter()
    try:
        key = cache_key(rendered, job.arch, toolchain)
    except TritonAotError as exc:
        return BuildOutcome(job.family, job.arch, job.backend, "failed", 0.0, None, "", str(exc))
    entry = entry_dir(cache_dir, __version__, job.arch, f"{job.family}-select", key)
    try:
        meta, hit = get_or_build(entry, key, lambda tmp: _build_into(tmp, job, rendered, toolchain, cache_dir))
    except (TritonAotError, CompileError) as exc:
        return BuildOutcome(job.family, job.arch, job.backend, "failed", time.perf_counter() - start, None, key,
                            f"{entry.name}: {exc} (kept in {failed_dir(entry)})")
    return BuildOutcome(job.family, job.arch, job.backend, "hit" if hit else "built", time.perf_counter() - start,
                        entry / meta["artifact"], key, sha256=meta["artifact_sha256"],
                        toolchain={"nvcc": meta["toolchain"]["version"], "triton": meta["triton"]})


def _build_into(tmp: Path, job: BuildJob, rendered: str, toolchain: Toolchain, cache_dir: Path) -> dict[str, Any]:
    src = tmp / "src"
    src.mkdir()
    module = src / "select.py"
    module.write_text(rendered, encoding="utf-8")
    compiled = _compile_kernels(module, triton_targets(job.arch), src / "cubins", Path(cache_dir) / "triton")
    images = {name: _fatbinary(src / "cubins", name, kernel["cubins"], toolchain)
              for name, kernel in compiled["kernels"].items()}
    (src / "select_family.h").write_text(family_header(compiled, images, job.arch), encoding="utf-8")
    (src / SHIM).write_text((TRITON_DIR / SHIM).read_text(encoding="utf-8"), encoding="utf-8")
    result = compile_shared_library([Path("src") / SHIM], job.arch, [INCLUDE_DIR, Path("src")], Path(job.artifact),
                                    toolchain, cwd=tmp)
    (tmp / "build.log").write_text(result.log, encoding="utf-8")
    return {
        "artifact": job.artifact,
        "family": job.family,
        "arch": job.arch,
        "backend": job.backend,
        "triton": triton_version(),
        "targets": triton_targets(job.arch),
        "kernels": {name: {k: v for k, v in kernel.items() if k != "cubins"}
                    for name, kernel in compiled["kernels"].items()},
        "toolchain": toolchain.identity(),
        "compile_seconds": round(compiled["seconds"], 3),
        "kvgen_version": __version__,
    }


def _compile_kernels(module: Path, targets: list[str], out: Path, triton_cache: Path) -> dict[str, Any]:
    """The child process's ``kernels.json`` (its cubins under ``out``)."""
    out.mkdir(parents=True)
    env = {**os.environ, "TRITON_DISABLE_LINE_INFO": "1", "TRITON_CACHE_DIR": str(triton_cache)}
    cmd = [sys.executable, "-m", "kvgen.build.triton_aot", str(module), str(out), *targets]
    try:
        proc = run_in_group(cmd, timeout=CHILD_TIMEOUT, env=env)
    except subprocess.TimeoutExpired:
        raise TritonAotError(f"Triton compile of {module} timed out after {CHILD_TIMEOUT:.0f} s") from None
    if proc.returncode != 0:
        raise TritonAotError(f"Triton compile of {module} failed (exit {proc.returncode}):\n"
                             f"{proc.stdout}{proc.stderr}")
    return json.loads((out / "kernels.json").read_text(encoding="utf-8"))


def _fatbinary(directory: Path, name: str, cubins: dict[str, str], toolchain: Toolchain) -> Path:
    """One fatbinary of a kernel's cubins (one per target); ``fatbinary`` sits next to nvcc."""
    tool = Path(toolchain.nvcc).with_name("fatbinary")
    out = directory / f"{name}.fatbin"
    images = [f"--image3=kind=elf,sm={arch.removeprefix('sm_')},file={directory / cubin}"
              for arch, cubin in sorted(cubins.items())]
    cmd = [str(tool), "-64", f"--create={out}", *images]
    proc = run_in_group(cmd, timeout=120)
    if proc.returncode != 0:
        raise TritonAotError(f"fatbinary failed for {name} (exit {proc.returncode}): {' '.join(cmd)}\n"
                             f"{proc.stdout}{proc.stderr}")
    return out


def _byte_rows(data: bytes, per_row: int = 24) -> str:
    return "\n".join("    " + ", ".join(f"0x{b:02x}" for b in data[i:i + per_row]) + ","
                     for i in range(0, len(data), per_row))


def family_header(compiled: dict[str, Any], images: dict[str, Path], arch: str) -> str:
    """``select_family.h``: the family's constants and each kernel's image, for the shim."""
    c = compiled["constants"]
    lines = ["// Written by kvgen.build.triton_aot for select_abi.cu: data only, regenerated every build.",
             "#pragma once",
             f'#define KVGEN_SELECT_FAMILY "{c["FAMILY"]}"',
             f'#define KVGEN_SELECT_ARCH "{arch}"',
             "namespace {"]
    for name, value in (("kNumLayers", c["NUM_LAYERS"]), ("kKvHeads", c["KV_HEADS"]), ("kGroup", c["GROUP"]),
                        ("kNumScored", len(c["SCORED_LAYERS"])), ("kRows", c["ROWS"]), ("kBlockW", c["BLOCK_W"]),
                        ("kBlock", c["BLOCK"]), ("kRadixBits", c["RADIX_BITS"])):
        lines.append(f"constexpr int32_t {name} = {int(value)};")
    lines.append(f"const int32_t kScoredLayers[] = {{{', '.join(str(int(x)) for x in c['SCORED_LAYERS'])}}};")
    entries = []
    for name in KERNEL_ORDER:
        kernel = compiled["kernels"][name]
        lines += [f"// {name}: {kernel['symbol']}, {kernel['constants']}",
                  f"alignas(64) const unsigned char kImage_{name}[] = {{", _byte_rows(images[name].read_bytes()), "};"]
        entries.append(f'    {{"{name}", kImage_{name}, "{kernel["symbol"]}", {kernel["shared"]}, '
                       f'{kernel["num_warps"] * 32}}},')
    lines += ["const KernelImage kImages[] = {", *entries, "};", "}  // namespace", ""]
    return "\n".join(lines)


# ---------------------------------------------------------------- the child process


def _load_module(path: Path) -> Any:
    spec = importlib.util.spec_from_file_location(f"kvgen_aot_select_{path.parent.name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _child(module_path: Path, out: Path, targets: list[str]) -> None:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kvgen.kernels.triton.select import OPTIONS, aot_specializations

    module = _load_module(module_path)
    start = time.perf_counter()
    kernels: dict[str, Any] = {}
    for spec in aot_specializations(module.SELECTOR):
        signature = {**spec.signature, **{name: "constexpr" for name in spec.constants}}
        entry: dict[str, Any] = {"constants": spec.constants, "cubins": {}}
        for arch in targets:
            major, minor, _ = parse_arch(arch)
            target = GPUTarget("cuda", major * 10 + minor, 32)
            backend = triton.compiler.make_backend(target)
            options = backend.parse_options(dict(OPTIONS))
            compiled = triton.compile(ASTSource(spec.kernel, signature, spec.constants), target=target,
                                      options=options.__dict__)
            md = compiled.metadata
            if getattr(md, "global_scratch_size", 0) or getattr(md, "profile_scratch_size", 0):
                raise SystemExit(f"{spec.name}: needs Triton scratch memory, which the shim does not pass")
            if md.shared > MAX_SHARED_BYTES:
                raise SystemExit(f"{spec.name}: {md.shared} bytes of shared memory, above {MAX_SHARED_BYTES}")
            cubin = f"{spec.name}.{arch}.cubin"
            (out / cubin).write_bytes(compiled.asm["cubin"])
            entry["cubins"][arch] = cubin
            entry.update(symbol=md.name, shared=md.shared, num_warps=md.num_warps)
        kernels[spec.name] = entry
    constants = {name: getattr(module, name) for name in ("FAMILY", "NUM_LAYERS", "KV_HEADS", "GROUP",
                                                          "SCORED_LAYERS", "ROWS", "BLOCK_W", "BLOCK", "RADIX_BITS")}
    constants["SCORED_LAYERS"] = list(constants["SCORED_LAYERS"])
    result = {"kernels": kernels, "constants": constants, "seconds": time.perf_counter() - start}
    (out / "kernels.json").write_text(json.dumps(result, indent=1), encoding="utf-8")


if __name__ == "__main__":
    _child(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:])
