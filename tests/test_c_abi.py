"""The C ABI from C++: examples/cpp/offload_manager.cpp includes kvgen_codec.h and
kvgen_compact.h, dlopen()s a real family library and configures a codec. On this GPU-less machine
configure must refuse with a message (never crash); a wrong descriptor count names the right one."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from kvgen.artifacts.manifest import manifest_path, read_manifest
from kvgen.kernels import INCLUDE_DIR

from .test_runtime_registry import REAL_FAMILY, ROOT, real_registry

EXAMPLE = ROOT / "examples" / "cpp" / "offload_manager.cpp"


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
    assert f"family {REAL_FAMILY}, codec ABI 1, compaction present" in out
    assert "configure refused:" in out or "configured: cold page of lifecycle 0 = 1327104 bytes" in out


def test_wrong_descriptor_count_names_the_expected_one(manager: Path, library: Path) -> None:
    out = run(manager, library, 36, 3)
    assert "configure refused: qwen3-8b: expected 72 pool descriptors (36 layers x 2 buffers), got 108" in out
