"""The staged offload/onboard's host logic (kvgen/kernels/cuda/staging_plan.cuh), compiled with g++ and
run on the CPU: ring slots from a staging size, refusals before any launch, one copy per run of
consecutive cold slots, pairs remapped to staging positions, and the order of a transfer's
operations on the caller (C) and copier (K) streams: a ring slot reused only after its previous
chunk's copy (offload) or decode (onboard), and the capture rules (waits on events recorded in the
call, fork, join). Exact expected lines (no tolerance)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from kvgen.kernels import CUDA_DIR, INCLUDE_DIR

SRC = Path(__file__).resolve().parent / "csrc" / "staging_plan_check.cpp"

EXPECTED = """\
ring 67108864 1327104: slots 2 pages 25 bytes 33177600
ring 1327104 1327104: slots 1 pages 1 bytes 1327104
ring 1327103 1327104: refused: staging buffer of 1327103 bytes is smaller than one cold page (1327104 bytes)
ring 12388 4096: slots 2 pages 1 bytes 4096
ring 4096 4100: refused: cold page size 4100 is not a positive multiple of 16
runs offload [0,6): (0 3 3) (3 9 3)
runs offload [2,5): (2 5 1) (3 9 2)
runs onboard [0,4): (0 3 2) (2 8 1) (3 2 1)
check offload 12: ok
check offload 11: pair 5: cold slot 11 outside [0, 11)
check offload 4: pair 0: negative hot page -1
check onboard 4: pair 0: cold slot -2 outside [0, 4)
check onboard 4: pair 0: negative hot page -3
check onboard 9: ok
local offload: (0 2) (1 1) (2 5)
local onboard: (0 0) (2 1) (1 2)
offload n=5 ring 2x2: C:code[0,2)@0 C:rec computed0 K:wait computed0 K:copy[0,2)@0 K:rec moved0 C:code[2,4)@1 C:rec computed1 K:wait computed1 K:copy[2,4)@1 K:rec moved1 C:wait moved0 C:code[4,5)@0 C:rec computed0 K:wait computed0 K:copy[4,5)@0 K:rec moved0 C:wait moved0 | legal 1 fork 1 join 1
onboard n=5 ring 2x2: C:rec fork0 K:wait fork0 K:copy[0,2)@0 K:rec moved0 C:wait moved0 C:code[0,2)@0 C:rec computed0 K:copy[2,4)@1 K:rec moved1 C:wait moved1 C:code[2,4)@1 C:rec computed1 K:wait computed0 K:copy[4,5)@0 K:rec moved0 C:wait moved0 C:code[4,5)@0 C:rec computed0 | legal 1 fork 1 join 1
offload n=2 ring 1x1: C:code[0,1)@0 C:rec computed0 K:wait computed0 K:copy[0,1)@0 K:rec moved0 C:wait moved0 C:code[1,2)@0 C:rec computed0 K:wait computed0 K:copy[1,2)@0 K:rec moved0 C:wait moved0 | legal 1 fork 1 join 1
onboard n=0 ring 2x4: | legal 1 fork 1 join 1
"""


@pytest.fixture(scope="module")
def checker(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cxx = shutil.which("g++")
    if cxx is None:
        pytest.skip("no g++")
    exe = tmp_path_factory.mktemp("staging") / "staging_plan_check"
    subprocess.run([cxx, "-std=c++17", "-Wall", "-Werror", "-I", str(INCLUDE_DIR), "-I", str(CUDA_DIR), str(SRC),
                    "-o", str(exe)], check=True, capture_output=True, text=True)
    return exe


def test_staging_plan_matches_the_staged_contract(checker: Path) -> None:
    out = subprocess.run([str(checker)], capture_output=True, text=True, check=True, timeout=60).stdout
    assert out == EXPECTED
