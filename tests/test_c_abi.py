"""The C ABI from C++: examples/cpp/offload_manager.cpp includes kvgen_codec.h and
kvgen_compact.h, dlopen()s a real family library and configures a codec. On this GPU-less machine
configure must refuse with a message (never crash); a wrong descriptor count names the right one.
ABI version 2 keeps version 1: its declarations compile unchanged beside the header, and the library
exports every version-1 and version-2 entry point, and the per-layer scales block that extends
version 2."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from kvgen.artifacts.manifest import manifest_path, read_manifest
from kvgen.kernels import INCLUDE_DIR

from .test_runtime_registry import REAL_FAMILY, ROOT, real_registry

EXAMPLE = ROOT / "examples" / "cpp" / "offload_manager.cpp"
V1_CHECK = ROOT / "tests" / "csrc" / "abi_v1_check.c"
V1_ENTRY_POINTS = ("kvgen_abi_version", "kvgen_family_name", "kvgen_last_error", "kvgen_codec_configure",
                   "kvgen_codec_destroy", "kvgen_codec_num_lifecycles", "kvgen_codec_query_cold_page_bytes",
                   "kvgen_codec_get_batching_layer_group_id", "kvgen_codec_query_page_index_location",
                   "kvgen_codec_encode", "kvgen_codec_decode")
V2_ENTRY_POINTS = ("kvgen_codec_set_staging", "kvgen_codec_staging_bytes", "kvgen_codec_offload",
                   "kvgen_codec_onboard")
LAYER_SCALE_ENTRY_POINTS = ("kvgen_codec_set_layer_scales", "kvgen_codec_layer_scale_buffers")  # extends v2


@pytest.fixture(scope="module")
def manager(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cxx = shutil.which("g++")
    if cxx is None:
        pytest.skip("no g++")
    exe = tmp_path_factory.mktemp("cpp") / "offload_manager"
    subprocess.run([cxx, "-std=c++17", "-Wall", "-Werror", "-I", str(INCLUDE_DIR), str(EXAMPLE), "-ldl", "-o", str(exe)],
                   check=True, capture_output=True, text=True)
    return exe


@pytest.fixture(scope="module")
def library(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = manifest_path(real_registry(tmp_path_factory), "sm_90a")
    return path.parent / read_manifest(path).family(REAL_FAMILY).artifact_of("codec").file


def run(manager: Path, library: Path, layers: int, buffers: int) -> str:
    proc = subprocess.run([str(manager), str(library), str(layers), str(buffers)], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_cpp_manager_loads_the_library_and_checks_the_abi(manager: Path, library: Path) -> None:
    out = run(manager, library, 36, 2)
    assert f"family {REAL_FAMILY}, codec ABI 2, compaction present" in out
    assert "configure refused:" in out or "configured: cold page of lifecycle 0 = 1327104 bytes" in out


def test_wrong_descriptor_count_names_the_expected_one(manager: Path, library: Path) -> None:
    out = run(manager, library, 36, 3)
    assert "configure refused: qwen3-8b: expected 72 pool descriptors (36 layers x 2 buffers), got 108" in out


def test_version_1_declarations_are_unchanged(tmp_path: Path) -> None:
    cc = shutil.which("gcc")
    if cc is None:
        pytest.skip("no gcc")
    subprocess.run([cc, "-std=c11", "-Wall", "-Werror", "-c", "-I", str(INCLUDE_DIR), str(V1_CHECK), "-o",
                    str(tmp_path / "v1.o")], check=True, capture_output=True, text=True)


def test_library_exports_version_1_and_2_entry_points_and_layer_scales(library: Path) -> None:
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("no nm")
    out = subprocess.run([nm, "-D", "--defined-only", str(library)], capture_output=True, text=True, check=True).stdout
    exported = set(re.findall(r" T (\w+)$", out, flags=re.M))
    assert set(V1_ENTRY_POINTS + V2_ENTRY_POINTS + LAYER_SCALE_ENTRY_POINTS) <= exported
