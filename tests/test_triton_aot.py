"""The Triton AOT libraries (``kvgen.build.triton_aot``): the selection (``kvgen_select.h``) and the
move packer (``kvgen_pack.h``), on this GPU-less machine: what can be proven without a kernel launch.

- the libraries of the real qwen3-8b registry: ABI version, family, arch, geometry, scored layers
  and windows equal the spec's and the JIT modules' constants; every entry point refuses bad
  arguments with a message naming the call and the argument, before touching the device; with no
  GPU the first launch fails with a clear load error, never a crash; CPU tensors are refused;
- the images: exactly the kernels and constants of ``aot_specializations`` (the JIT launches' own),
  one cubin per target, for ``sm_100f`` one per 10.x kvgen target (checked with ``cuobjdump``);
- the cache: a second build is a hit, and a changed tunable changes the key.

That the kernels compute the oracle's bits is proven on the H200 (tests/gpu/test_select_gpu.py,
tests/gpu/test_compact_gpu.py) and, for the same kernels under Triton's interpreter, by
tests/test_select_triton.py and tests/test_pack_triton.py.
"""

from __future__ import annotations

import ctypes
import json
import subprocess
from pathlib import Path

import pytest
import torch

from kvgen.arch import ARCHS
from kvgen.build.compile import Toolchains, compile_one
from kvgen.build.job import family_jobs, load_spec_source
from kvgen.build.nvcc import find_toolchains, pip_nvcc_paths, toolchain_for
from kvgen.build.triton_aot import RECIPES, cache_key, triton_targets
from kvgen.kernels import INCLUDE_DIR
from kvgen.kernels.selection import MODES
from kvgen.kernels.triton.select import aot_specializations
from kvgen.lower.triattention import tri_geometry
from kvgen.runtime.library import LibraryError
from kvgen.runtime.lookup import RuntimeRegistry
from kvgen.runtime.pack import PackLibrary, load_pack_module
from kvgen.runtime.select import SelectLibrary, load_select_module
from kvgen.spec.schema import load_spec

from .conftest import ROOT, SPECS_DIR
from .test_runtime_registry import REAL_FAMILY, SYSTEM_NVCC, real_registry

triton = pytest.importorskip("triton")


KERNEL_ORDER = RECIPES["select"].kernel_order


def _artifact(factory: pytest.TempPathFactory, op: str) -> Path:
    return RuntimeRegistry([real_registry(factory)]).resolve(REAL_FAMILY, "sm_90a").artifact(op)


@pytest.fixture(scope="module")
def library(tmp_path_factory: pytest.TempPathFactory) -> SelectLibrary:
    return SelectLibrary(_artifact(tmp_path_factory, "select"), family=REAL_FAMILY)


@pytest.fixture(scope="module")
def packer(tmp_path_factory: pytest.TempPathFactory) -> PackLibrary:
    return PackLibrary(_artifact(tmp_path_factory, "pack"), family=REAL_FAMILY)


@pytest.fixture(scope="module")
def toolchains() -> Toolchains:
    found = find_toolchains([SYSTEM_NVCC, *pip_nvcc_paths()])
    if not any(t.supports("sm_100a") for t in found):
        pytest.skip("no nvcc for sm_100a")
    return Toolchains(nvcc=found)


def test_the_library_states_the_family_geometry(library: SelectLibrary) -> None:
    g = tri_geometry(load_spec(SPECS_DIR / f"{REAL_FAMILY}.yaml"))
    jit = load_select_module(ROOT / "generated" / REAL_FAMILY / "select.py")
    assert (library.family, library.arch) == (REAL_FAMILY, "sm_90a")
    assert (library.num_layers, library.kv_heads, library.group, library.scored_layers) == (
        g.num_layers, g.kv_heads, g.group, tuple(g.scored_layers))
    assert library.tunables() == jit.SELECTOR.tunables()   # every launch tunable, through the ABI's geometry


def _raw(library: SelectLibrary) -> ctypes.CDLL:
    return library._lib   # the raw entry points: bad arguments the Python side would refuse first


@pytest.mark.parametrize("call,args,message", [
    ("kvgen_select_keep", (16, 16, 16, 16, 16, 2, 1, 100, 0, None), "kvgen_select_keep: rows 1 and budget 0"),
    ("kvgen_select_keep", (16, 16, 16, 16, None, 2, 1, 100, 8, None), "kvgen_select_keep: a tensor is NULL"),
    ("kvgen_select_keep", (16, 16, 16, 16, 16, -1, 1, 100, 8, None), "batch -1 and W 100 must not be negative"),
    ("kvgen_select_aggregate", (5, 16, 16, 16, 16, 16, 16, 2, 100, None), "kvgen_select_aggregate: mode 5"),
    ("kvgen_select_aggregate", (0, 16, 16, 16, 16, 16, 16, 70000, 100, None), "batch 70000 above 65535"),
    ("kvgen_select_statistics", (None, 16, 16, 16, 2, 100, None), "kvgen_select_statistics: a tensor is NULL"),
    ("kvgen_select_statistics", (16, 16, 16, 16, 2, -3, None), "batch 2 and W -3 must not be negative"),
    ("kvgen_select_statistics_aggregate", (3, 16, 16, 16, 16, 16, 16, 16, 2, 100, None),
     "kvgen_select_statistics_aggregate: mode 3"),
    ("kvgen_select_statistics_aggregate", (1, 16, 16, 16, 16, 16, 16, None, 2, 100, None), "a tensor is NULL"),
    ("kvgen_select_statistics_aggregate", (0, 16, 16, 16, 16, 16, 16, 16, -2, 100, None), "batch -2 and W 100"),
    ("kvgen_select_statistics_aggregate", (0, 16, 16, 16, 16, 16, 16, 16, 2**30, 2**30, None), "are too large"),
    ("kvgen_select_queue_work_ints", (7, 2, 100), "kvgen_select_queue_work_ints: mode 7"),
])
def test_bad_arguments_are_refused_before_the_device(library: SelectLibrary, call: str, args: tuple,
                                                     message: str) -> None:
    lib = _raw(library)
    assert getattr(lib, call)(*args) == -1
    assert message in lib.kvgen_select_last_error().decode()


def test_empty_work_launches_nothing(library: SelectLibrary) -> None:
    lib = _raw(library)
    assert lib.kvgen_select_statistics(None, None, None, None, 0, 100, None) == 0
    assert lib.kvgen_select_statistics_aggregate(0, None, None, None, None, None, None, None, 3, 0, None) == 0
    assert lib.kvgen_select_keep(None, None, None, None, None, 0, 1, 100, 8, None) == 0


@pytest.mark.parametrize("mode", range(3))
def test_the_queue_work_size_is_the_hosts(library: SelectLibrary, mode: int) -> None:
    for batch, W in ((1, 16384), (3, 1000), (32, 16385), (0, 5)):
        assert _raw(library).kvgen_select_queue_work_ints(mode, batch, W) == library.queue_work_ints(
            MODES[mode], batch, W)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the load error of a machine without a GPU")
def test_without_a_gpu_the_first_launch_is_a_load_error(library: SelectLibrary) -> None:
    lib = _raw(library)
    assert lib.kvgen_select_statistics(16, 16, 16, 16, 2, 100, None) == -2
    assert lib.kvgen_select_last_error().decode().startswith("loading the kernels (sm_90a): ")


def test_cpu_tensors_are_refused(library: SelectLibrary) -> None:
    scores = torch.zeros(len(library.scored_layers), 1, library.query_heads, 16)
    with pytest.raises(ValueError, match="libkvgen_qwen3_8b_select.so: tensors must be on a CUDA device"):
        library.statistics(scores, torch.tensor([16]))


def test_a_codec_library_is_not_a_selection_or_pack_library(tmp_path_factory: pytest.TempPathFactory) -> None:
    codec = _artifact(tmp_path_factory, "codec")
    with pytest.raises(LibraryError, match="missing entry point kvgen_select_abi_version; not a kvgen selection"):
        SelectLibrary(codec)
    with pytest.raises(LibraryError, match="missing entry point kvgen_pack_abi_version; not a kvgen pack library"):
        PackLibrary(codec)


def test_the_pack_library_states_the_family_geometry(packer: PackLibrary) -> None:
    jit = load_pack_module(ROOT / "generated" / REAL_FAMILY / "pack.py")
    assert (packer.family, packer.arch) == (REAL_FAMILY, "sm_90a")
    assert (packer.num_layers, packer.kv_heads, packer.swa_window, packer.block) == (
        jit.NUM_LAYERS, jit.KV_HEADS, tuple(jit.SWA_WINDOW), jit.BLOCK)


@pytest.mark.parametrize("call,args,message", [
    ("kvgen_pack_offsets", (16, 16, 16, 4, 2, 8, None), "kvgen_pack_offsets: batch 4 and max_requests 2"),
    ("kvgen_pack_offsets", (16, 16, 16, 2, 2, 0, None), "kvgen_pack_offsets: budget 0 must be at least 1"),
    ("kvgen_pack_offsets", (None, 16, 16, 2, 2, 8, None), "kvgen_pack_offsets: a tensor is NULL"),
    ("kvgen_pack_moves", (3, 16, 16, 16, 16, 16, 16, 16, 2, 2, 8, 64, None), "kvgen_pack_moves: mode 3"),
    ("kvgen_pack_moves", (0, 16, 16, 16, 16, 16, 16, 16, 2, 2, 8, -1, None), "capacity -1 must not be negative"),
    ("kvgen_pack_moves", (0, None, 16, 16, 16, 16, 16, 16, 2, 2, 8, 64, None), "kvgen_pack_moves: a tensor is NULL"),
])
def test_bad_pack_arguments_are_refused_before_the_device(packer: PackLibrary, call: str, args: tuple,
                                                          message: str) -> None:
    lib = packer._lib   # the raw entry points: bad arguments the Python side would refuse first
    assert getattr(lib, call)(*args) == -1
    assert message in lib.kvgen_pack_last_error().decode()


def test_the_pack_library_refuses_cpu_tensors(packer: PackLibrary) -> None:
    kept = torch.zeros(1, 1, 8, dtype=torch.int64)
    with pytest.raises(ValueError, match="libkvgen_qwen3_8b_pack.so: tensors must be on a CUDA device"):
        packer.pack_moves(kept, [0], [20], [0], [True], 8, "union")


def test_family_targets_cover_every_member() -> None:
    assert triton_targets("sm_90a") == ["sm_90a"]
    assert triton_targets("sm_100f") == [a for a in ARCHS if a.startswith("sm_10") and a.endswith("a")]


@pytest.mark.slow
def test_the_family_build_holds_one_cubin_per_member(tmp_path: Path, toolchains: Toolchains) -> None:
    """sm_100f: every kernel's fatbinary has the 10.0, 10.3 and 10.7 cubins, compiled from exactly
    the JIT launches' specializations; a rebuild is a hit, a changed tunable a new key."""
    source = load_spec_source(SPECS_DIR / f"{REAL_FAMILY}.yaml")
    (job,) = [j for j in family_jobs(source, "sm_100f") if j.ops == ("select",)]   # pack: the same recipe
    outcome = compile_one(job, tmp_path / "cache", toolchains)
    assert outcome.status == "built", outcome.error
    meta = json.loads((outcome.artifact.parent / "meta.json").read_text())
    assert list(meta["kernels"]) == sorted(KERNEL_ORDER) and meta["targets"] == ["sm_100a", "sm_103a", "sm_107a"]
    jit = load_select_module(ROOT / "generated" / REAL_FAMILY / "select.py").SELECTOR
    assert {s.name: s.constants for s in aot_specializations(jit)} == {
        name: {k: (float(v) if isinstance(v, float) else v) for k, v in kernel["constants"].items()}
        for name, kernel in meta["kernels"].items()}
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    for name in KERNEL_ORDER:
        listing = subprocess.run([str(cuobjdump), "--list-elf", str(outcome.artifact.parent / "src" / "cubins" /
                                                                   f"{name}.fatbin")],
                                 capture_output=True, text=True, check=True).stdout
        assert [line.split(".")[-2] for line in listing.split() if line.endswith(".cubin")] == meta["targets"]
    assert compile_one(job, tmp_path / "cache", toolchains).status == "hit"
    (other,) = [j for j in family_jobs(source, "sm_100f", {"select": {"block": 2048}}) if j.ops == ("select",)]
    toolchain = toolchain_for("sm_100f", toolchains.nvcc)
    assert other.artifact == job.artifact
    assert cache_key("select", *other.rendered.values(), "sm_100f", toolchain) != outcome.key


def test_the_public_headers_are_plain_c(tmp_path: Path) -> None:
    """kvgen_select.h and kvgen_pack.h need no CUDA header and compile as C99, warnings as errors."""
    source = tmp_path / "use.c"
    source.write_text('#include "kvgen_select.h"\n#include "kvgen_pack.h"\n'
                      "int main(void) { kvgen_select_geometry s; kvgen_pack_geometry p; (void)s; (void)p; "
                      "return KVGEN_SELECT_ABI_VERSION + KVGEN_PACK_ABI_VERSION; }\n")
    subprocess.run(["gcc", "-std=c99", "-Wall", "-Wextra", "-Werror", "-I", str(INCLUDE_DIR), "-c", str(source),
                    "-o", str(tmp_path / "use.o")], check=True)
