"""The Triton AOT backend: a family's rendered ``select.py`` or ``pack.py`` -> Triton cubins for
the arch -> fatbinaries -> the op's C shim -> ``lib<symbol>_select.so`` / ``lib<symbol>_pack.so``
(``kvgen/kernels/include/kvgen_select.h``, ``kvgen_pack.h``).

Flow per ``BuildJob`` of either op (the rendered template: the family's constants bound to the
kernel module's ``TritonSelector`` / ``TritonPacker``; ``RECIPES`` names the files of each op):
1. a child process (``python -m kvgen.build.triton_aot``: Triton is imported only there) executes
   the rendered module and compiles the kernel module's ``aot_specializations`` of its host
   object, exactly the kernels and constants its JIT launches would compile, for each Triton
   target of the arch (one; three for ``sm_100f``: 10.0, 10.3 and 10.7), line info off, Triton's
   own cache shared by the user's builds (``kvgen.paths.triton_cache_dir``);
2. ``fatbinary`` bundles each kernel's cubins; ``aot_family.h`` carries them as byte arrays with
   the family's constants (``aot_header_constants``: data, no logic);
3. nvcc compiles the hand-written shim (host code only, no cudart: ``aot_launch.h`` opens the
   driver, loads and launches the images) with it into the library, which needs only the driver;
4. cached like every kvgen artifact under a key over the rendered module, the kernel, host and
   shim sources, Triton's version, the nvcc toolchain and the arch.

A kernel that needs global or profile scratch, or more than 48 KiB of shared memory, fails the
build with its name: the shim launches with neither.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import json
import subprocess
import sys
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from kvgen import __version__, paths
from kvgen.arch import ARCHS, parse_arch
from kvgen.build.cache import CACHE_SCHEMA_VERSION, entry_dir, failed_dir, get_or_build
from kvgen.build.job import BuildJob, BuildOutcome
from kvgen.build.nvcc import CompileError, Toolchain, compile_shared_library, nvcc_flags
from kvgen.build.process import run_in_group
from kvgen.kernels import INCLUDE_DIR, KERNELS_DIR

TRITON_DIR = KERNELS_DIR / "triton"
SHARED_SOURCES = (TRITON_DIR / "aot.py", TRITON_DIR / "aot_launch.h")
RECIPE_VERSION = 2                    # bump when the compile or link recipe below changes
MAX_SHARED_BYTES = 48 * 1024          # the shims set no opt-in attribute
CHILD_TIMEOUT = 900.0
FAMILY_HEADER = "aot_family.h"
CUDART = "none"                       # the shims open the driver themselves (aot_launch.h)


@dataclass(frozen=True)
class Recipe:
    """The files of one op: its Triton kernel module, the host object the rendered module binds,
    the host side, the C shim and its public header; ``kernel_order`` is the shim's kImages order."""

    kernel_module: str
    host_attr: str
    host_source: str
    shim: str
    header: str
    kernel_order: tuple[str, ...]

    def sources(self) -> tuple[Path, ...]:
        module = TRITON_DIR / (self.kernel_module.rsplit(".", 1)[-1] + ".py")
        return (module, KERNELS_DIR / self.host_source, TRITON_DIR / self.shim, INCLUDE_DIR / self.header,
                *SHARED_SOURCES)


RECIPES: dict[str, Recipe] = {
    "select": Recipe("kvgen.kernels.triton.select", "SELECTOR", "selection.py", "select_abi.cpp", "kvgen_select.h",
                     ("statistics", "aggregate_union", "aggregate_per_head", "aggregate_per_layer_perhead", "queue_union",
                      "queue_per_head", "queue_per_layer_perhead", "select")),
    "pack": Recipe("kvgen.kernels.triton.pack", "PACKER", "packing.py", "pack_abi.cpp", "kvgen_pack.h",
                   ("offsets", "moves")),
}


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


def cache_key(op: str, rendered: str, arch: str, toolchain: Toolchain) -> str:
    payload = {
        "op": op,
        "module": hashlib.sha256(rendered.encode()).hexdigest(),
        "sources": {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in RECIPES[op].sources()},
        "triton": triton_version(),
        "toolchain": toolchain.identity(),
        "flags": nvcc_flags(arch, cudart=CUDART),
        "arch": arch,
        "recipe": RECIPE_VERSION,
        "schema": CACHE_SCHEMA_VERSION,
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def compile_aot(job: BuildJob, cache_dir: Path, toolchain: Toolchain) -> BuildOutcome:
    """The job's library (select or pack) in its cache entry (built if its key is not there yet);
    a failure is a ``failed`` outcome carrying the log."""
    (rendered,) = job.rendered.values()
    (op,) = job.ops
    start = time.perf_counter()
    try:
        key = cache_key(op, rendered, job.arch, toolchain)
    except TritonAotError as exc:
        return BuildOutcome(job.family, job.arch, job.backend, "failed", 0.0, None, "", str(exc))
    entry = entry_dir(cache_dir, __version__, job.arch, f"{job.family}-{op}", key)
    try:
        meta, hit = get_or_build(entry, key, lambda tmp: _build_into(tmp, job, rendered, toolchain))
    except (TritonAotError, CompileError) as exc:
        return BuildOutcome(job.family, job.arch, job.backend, "failed", time.perf_counter() - start, None, key,
                            f"{entry.name}: {exc} (kept in {failed_dir(entry)})")
    return BuildOutcome(job.family, job.arch, job.backend, "hit" if hit else "built", time.perf_counter() - start,
                        entry / meta["artifact"], key, sha256=meta["artifact_sha256"],
                        toolchain={"nvcc": meta["toolchain"]["version"], "triton": meta["triton"]})


def _build_into(tmp: Path, job: BuildJob, rendered: str, toolchain: Toolchain) -> dict[str, Any]:
    (op,) = job.ops
    recipe = RECIPES[op]
    src = tmp / "src"
    src.mkdir()
    module = src / f"{op}.py"
    module.write_text(rendered, encoding="utf-8")
    compiled = _compile_kernels(op, module, triton_targets(job.arch), src / "cubins", paths.triton_cache_dir())
    images = {name: _fatbinary(src / "cubins", name, kernel["cubins"], toolchain)
              for name, kernel in compiled["kernels"].items()}
    (src / FAMILY_HEADER).write_text(family_header(compiled, images, recipe.kernel_order, job.arch), encoding="utf-8")
    for name in (recipe.shim, "aot_launch.h"):
        (src / name).write_text((TRITON_DIR / name).read_text(encoding="utf-8"), encoding="utf-8")
    result = compile_shared_library([Path("src") / recipe.shim], job.arch, [INCLUDE_DIR, Path("src")],
                                    Path(job.artifact), toolchain, cwd=tmp, cudart=CUDART)
    (tmp / "build.log").write_text(result.log, encoding="utf-8")
    return {
        **job.entry_meta(),
        "triton": triton_version(),
        "targets": triton_targets(job.arch),
        "kernels": {name: {k: v for k, v in kernel.items() if k != "cubins"}
                    for name, kernel in compiled["kernels"].items()},
        "toolchain": toolchain.identity(),
        "compile_seconds": round(compiled["seconds"], 3),
        "kvgen_version": __version__,
    }


def _compile_kernels(op: str, module: Path, targets: list[str], out: Path, triton_cache: Path) -> dict[str, Any]:
    """The child process's ``kernels.json`` (its cubins under ``out``)."""
    out.mkdir(parents=True)
    env = paths.child_environ(None, TRITON_DISABLE_LINE_INFO="1", TRITON_CACHE_DIR=str(triton_cache))
    cmd = [sys.executable, "-m", "kvgen.build.triton_aot", op, str(module), str(out), *targets]
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


def _constant(name: str, value: int | list[int]) -> str:
    if isinstance(value, list):
        return f"const int32_t {name}[] = {{{', '.join(str(int(v)) for v in value)}}};"
    return f"constexpr int32_t {name} = {int(value)};"


def family_header(compiled: dict[str, Any], images: dict[str, Path], order: tuple[str, ...], arch: str) -> str:
    """``aot_family.h``: the family's constants and each kernel's image, in the shim's order."""
    lines = ["// Written by kvgen.build.triton_aot for the op's shim: data only, regenerated every build.",
             "#pragma once",
             f'#define KVGEN_AOT_FAMILY "{compiled["family"]}"',
             f'#define KVGEN_AOT_ARCH "{arch}"',
             "namespace {",
             *(_constant(name, value) for name, value in compiled["constants"].items())]
    entries = []
    for name in order:
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


def _child(op: str, module_path: Path, out: Path, targets: list[str]) -> None:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    recipe = RECIPES[op]
    kernels_module = importlib.import_module(recipe.kernel_module)
    module = _load_module(module_path)
    host = getattr(module, recipe.host_attr)
    start = time.perf_counter()
    kernels: dict[str, Any] = {}
    for spec in kernels_module.aot_specializations(host):
        entry: dict[str, Any] = {"constants": spec.constants, "cubins": {}}
        for arch in targets:
            major, minor, _ = parse_arch(arch)
            target = GPUTarget("cuda", major * 10 + minor, 32)
            options = triton.compiler.make_backend(target).parse_options(dict(spec.options))
            compiled = triton.compile(ASTSource(spec.kernel, spec.triton_signature(), spec.constants), target=target,
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
    if sorted(kernels) != sorted(recipe.kernel_order):
        raise SystemExit(f"{op}: compiled {sorted(kernels)}, the shim launches {sorted(recipe.kernel_order)}")
    result = {"kernels": kernels, "constants": kernels_module.aot_header_constants(host), "family": module.FAMILY,
              "seconds": time.perf_counter() - start}
    (out / "kernels.json").write_text(json.dumps(result, indent=1), encoding="utf-8")


if __name__ == "__main__":
    _child(sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4:])
