"""The AOT selection library (``kvgen.build.triton_aot``, ``kvgen/kernels/include/kvgen_select.h``)
on this GPU-less machine: what can be proven without launching a kernel.

- the library of the real qwen3-8b registry: ABI version, family, arch, geometry and scored layers
  equal the spec's and the JIT module's constants; every entry point refuses bad arguments with a
  message naming the call and the argument, before touching the device; with no GPU the first
  launch fails with a clear load error, never a crash; ``SelectLibrary`` refuses CPU tensors;
- the images: exactly the kernels and constants of ``aot_specializations`` (the JIT launches' own),
  one cubin per target, for ``sm_100f`` one per 10.x kvgen target (checked with ``cuobjdump``);
- the cache: a second build is a hit, and a changed tunable changes the key.

That the kernels compute the oracle's bits is proven on the H200 (tests/gpu/test_select_gpu.py)
and, for the same kernels under Triton's interpreter, by tests/test_select_triton.py.
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
from kvgen.build.triton_aot import KERNEL_ORDER, cache_key, triton_targets
from kvgen.kernels.triton.select import aot_specializations
from kvgen.lower.triattention import tri_geometry
from kvgen.runtime.library import LibraryError
from kvgen.runtime.lookup import RuntimeRegistry
from kvgen.runtime.select import SelectLibrary, load_select_module
from kvgen.spec.schema import load_spec

from .conftest import ROOT, SPECS_DIR
from .test_runtime_registry import REAL_FAMILY, SYSTEM_NVCC, real_registry

triton = pytest.importorskip("triton")


@pytest.fixture(scope="module")
def library(tmp_path_factory: pytest.TempPathFactory) -> SelectLibrary:
    registry = real_registry(tmp_path_factory)
    return SelectLibrary(RuntimeRegistry([registry]).resolve(REAL_FAMILY, "sm_90a").artifact("select"),
                         family=REAL_FAMILY)


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
    assert (library.rows, library.block_w, library.block, library.radix_bits) == (
        jit.ROWS, jit.BLOCK_W, jit.BLOCK, jit.RADIX_BITS)


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
])
def test_bad_arguments_are_refused_before_the_device(library: SelectLibrary, call: str, args: tuple,
                                                     message: str) -> None:
    lib = _raw(library)
    assert getattr(lib, call)(*args) == -1
    assert message in lib.kvgen_select_last_error().decode()


def test_empty_work_launches_nothing(library: SelectLibrary) -> None:
    lib = _raw(library)
    assert lib.kvgen_select_statistics(None, None, None, None, 0, 100, None) == 0
    assert lib.kvgen_select_keep(None, None, None, None, None, 0, 1, 100, 8, None) == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the load error of a machine without a GPU")
def test_without_a_gpu_the_first_launch_is_a_load_error(library: SelectLibrary) -> None:
    lib = _raw(library)
    assert lib.kvgen_select_statistics(16, 16, 16, 16, 2, 100, None) == -2
    assert lib.kvgen_select_last_error().decode().startswith("loading kernel statistics (sm_90a): ")


def test_cpu_tensors_are_refused(library: SelectLibrary) -> None:
    scores = torch.zeros(len(library.scored_layers), 1, library.query_heads, 16)
    with pytest.raises(ValueError, match="libkvgen_qwen3_8b_select.so: tensors must be on a CUDA device"):
        library.statistics(scores, torch.tensor([16]))


def test_a_codec_library_is_not_a_selection_library(tmp_path_factory: pytest.TempPathFactory) -> None:
    codec = RuntimeRegistry([real_registry(tmp_path_factory)]).resolve(REAL_FAMILY, "sm_90a").artifact("codec")
    with pytest.raises(LibraryError, match="missing entry point kvgen_select_abi_version; not a kvgen selection"):
        SelectLibrary(codec)


def test_family_targets_cover_every_member() -> None:
    assert triton_targets("sm_90a") == ["sm_90a"]
    assert triton_targets("sm_100f") == [a for a in ARCHS if a.startswith("sm_10") and a.endswith("a")]


@pytest.mark.slow
def test_the_family_build_holds_one_cubin_per_member(tmp_path: Path, toolchains: Toolchains) -> None:
    """sm_100f: every kernel's fatbinary has the 10.0, 10.3 and 10.7 cubins, compiled from exactly
    the JIT launches' specializations; a rebuild is a hit, a changed tunable a new key."""
    source = load_spec_source(SPECS_DIR / f"{REAL_FAMILY}.yaml")
    (job,) = [j for j in family_jobs(source, "sm_100f") if j.ops == ("select",)]
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
    (other,) = [j for j in family_jobs(source, "sm_100f", {"select": {"block": 1024}}) if j.ops == ("select",)]
    toolchain = toolchain_for("sm_100f", toolchains.nvcc)
    assert other.artifact == job.artifact
    assert cache_key(*other.rendered.values(), "sm_100f", toolchain) != outcome.key
