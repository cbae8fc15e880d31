"""Validated inputs, no out-of-bounds access (issue 15), on the CPU build machine.

(a) The codec's bounds checks compiled for the host (tests/csrc/codec_host_check.cu): host pairs
    against the pools' pages and the cold slots, the kernels' per-pair check (skip and record) and
    the report of the record through kvgen_last_error. Exact messages.
(b) The real family library through ctypes, without a GPU: the bounds-checked entry points refuse
    bad arguments with a message and never crash (null codec, negative page counts, bad index
    location, page table narrower than its stride says, no GPU for the error record).
(c) The Python runtime's checks before any launch (pools, cold storage, pairs, a closed codec,
    the manager's host lengths against the page table), on CPU tensors.
The compaction kernel's skip-and-record is checked bit-exact against the oracle in
tests/test_compact_cpu.py (test_host_walk_skips_out_of_range_moves); on the GPU in
tests/gpu/test_bounds_gpu.py.
"""

from __future__ import annotations

import ctypes
import subprocess
from pathlib import Path

import pytest
import torch

from kvgen.artifacts.manifest import manifest_path, read_manifest
from kvgen.kernels import INCLUDE_DIRS
from kvgen.lower.layout import family_layout, to_json
from kvgen.lower.triattention import eviction_config
from kvgen.runtime.codec import ColdPageCodec, check_pairs, check_pools
from kvgen.runtime.compact import CompactLibrary, CompactPoolExtent
from kvgen.runtime.library import FamilyLibrary, LibraryError, PoolExtent
from kvgen.runtime.lookup import RegistryLayout
from kvgen.runtime.offload import cold_slots
from kvgen.spec.schema import load_spec

from .test_runtime_registry import REAL_FAMILY, real_registry
from .test_triattention_runtime import _manager
from .tri_sim import DecodeSim, small_spec

ROOT = Path(__file__).resolve().parents[1]
CHECK_SRC = ROOT / "tests" / "csrc" / "codec_host_check.cu"
SYSTEM_NVCC = Path("/usr/local/bin/nvcc")


# ---------------------------------------------------------------------------------------------
# (a) the codec's checks on the host
# ---------------------------------------------------------------------------------------------

SKIPPED = "a kernel skipped out-of-range device indices (nothing was read or written for them): "
EXPECTED_LINES = [
    "encode ok: 1 ",
    "encode src 100000: 0 fam: pair 1: src 100000 is not a hot page of lifecycle 0 (its pools hold 64 pages)",
    "encode src -5: 0 fam: pair 1: src -5 is not a hot page of lifecycle 0 (its pools hold 64 pages)",
    "encode dst 100000: 0 fam: pair 1: dst 100000 is not a cold slot (the cold buffer holds 10 slots)",
    "encode dst = slots: 0 fam: pair 1: dst 10 is not a cold slot (the cold buffer holds 10 slots)",
    "decode dst 64: 0 fam: pair 1: dst 64 is not a hot page of lifecycle 0 (its pools hold 64 pages)",
    "decode src -1: 0 fam: pair 1: src -1 is not a cold slot (the cold buffer holds 10 slots)",
    "unknown counts: 1 ",
    "unknown counts, -5: 0 fam: pair 1: src -5 is not a hot page of lifecycle 0 (pages are >= 0)",
    # pair in range, record clean, record clean after the report
    "device encode ok: 1 1 1 ",
    f"device encode src 100000: 0 0 1 {SKIPPED}encode: src is not a hot page of the lifecycle's pools (e.g. 100000)",
    f"device encode both: 0 0 1 {SKIPPED}encode: src is not a hot page of the lifecycle's pools (e.g. 64); "
    "encode: dst is not a slot of the cold buffer (e.g. -5)",
    f"device decode dst -5: 0 0 1 {SKIPPED}decode: dst is not a hot page of the lifecycle's pools (e.g. -5)",
    f"device decode src 10: 0 0 1 {SKIPPED}decode: src is not a slot of the cold buffer (e.g. 10)",
    "hot pages: 1 6 5 ",  # the smallest pool of each lifecycle
    "hot pages unknown: 1 4294967296 4294967296 ",
    "hot pages negative: 0 -1 -1 fam: pool 3 (layer 1, buffer 1) has a negative page count",
]


def test_codec_checks_on_the_host(tmp_path: Path) -> None:
    if not SYSTEM_NVCC.is_file():
        pytest.skip("nvcc 13.0 not found at /usr/local/bin/nvcc")
    exe = tmp_path / "codec_host_check"
    cmd = [str(SYSTEM_NVCC), "-x", "cu", "-std=c++17", *[f"-I{d}" for d in INCLUDE_DIRS], str(CHECK_SRC), "-o", str(exe)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60, check=True).stdout
    assert out.splitlines() == EXPECTED_LINES


# ---------------------------------------------------------------------------------------------
# (b) the real library, no GPU
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def library_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = manifest_path(real_registry(tmp_path_factory), "sm_90a")
    return path.parent / read_manifest(path).family(REAL_FAMILY).artifact_of("codec").file


def _extents(num_pages: int = 8, count: int = 72) -> ctypes.Array:
    return (PoolExtent * count)(*[PoolExtent(4096 * (i + 1), 4096, num_pages) for i in range(count)])


def test_checked_codec_entry_points_refuse_bad_arguments(library_path: Path) -> None:
    lib = FamilyLibrary(library_path, REAL_FAMILY)
    assert not lib.kvgen_codec_configure_checked(_extents(count=70), 70, 0)
    assert lib.last_error() == "qwen3-8b: expected 72 pool descriptors (36 layers x 2 buffers), got 70"
    assert not lib.kvgen_codec_configure_checked(None, 72, 0)
    assert lib.last_error() == "qwen3-8b: null pool array or negative pool count"
    bad = _extents()
    bad[7].num_pages = -1
    assert not lib.kvgen_codec_configure_checked(bad, 72, 0)
    assert lib.last_error() == "qwen3-8b: pool 7 (layer 3, buffer 1) has a negative page count"
    assert not lib.kvgen_codec_configure_checked(_extents(), 72, 7)
    assert lib.last_error() == "qwen3-8b: index location must be KVGEN_INDEX_HOST or KVGEN_INDEX_DEVICE"
    # good arguments: refused only for want of a GPU, with CUDA's message
    assert not lib.kvgen_codec_configure_checked(_extents(), 72, 0)
    assert lib.last_error().startswith("encode smem: ")


def test_null_codec_is_an_error_not_a_crash(library_path: Path) -> None:
    lib = FamilyLibrary(library_path, REAL_FAMILY)
    pairs = (ctypes.c_int32 * 2)(0, 0)
    for fn in (lib.kvgen_codec_encode_checked, lib.kvgen_codec_decode_checked):
        assert fn(None, 0, 4096, 4, pairs, 1, None) == 0
        assert lib.last_error() == "qwen3-8b: null codec"
    for fn in (lib.kvgen_codec_encode, lib.kvgen_codec_decode):
        assert fn(None, 0, 4096, pairs, 1, None) == 0
    assert lib.kvgen_codec_check_device_errors(None) == 0
    assert lib.kvgen_codec_query_cold_page_bytes(None, 0) == 0
    assert lib.kvgen_codec_num_lifecycles(None) == 0


def test_checked_compaction_refuses_bad_arguments(library_path: Path) -> None:
    lib = CompactLibrary(library_path)
    layers = lib.info["num_layers"]
    pools = (CompactPoolExtent * layers)(*[CompactPoolExtent(4096, 4096 * 64, 8192, 4096 * 64, 10)
                                           for _ in range(layers)])
    call = lib.kvgen_compact_checked
    assert call(pools, layers, 16, 0, -1, 4, 16, 16, 16, 10, None) == 0
    assert lib.last_error() == "max_requests, moves_per_head, page_table_stride and page_table_width must be >= 0"
    assert call(pools, layers, 16, 3, 4, 4, 16, 16, 16, 10, None) == 0
    assert lib.last_error() == "page_table_stride 3 is below the row width 4"
    pools[2].num_pages = -3
    assert call(pools, layers, 16, 4, 4, 4, 16, 16, 16, 10, None) == 0
    assert lib.last_error() == "layer 2: negative page count"
    pools[2].num_pages = 10
    assert call(pools, layers - 1, 16, 4, 4, 4, 16, 16, 16, 10, None) == 0
    assert lib.last_error() == f"expected {layers} layer pools, got {layers - 1}"
    assert call(pools, layers, 16, 4, 4, 0, 16, 16, 16, 10, None) == 1  # nothing to move: no launch
    # the error record needs a GPU: without one, a clear error (the first call or check allocates it)
    assert call(pools, layers, 16, 4, 4, 4, 16, 16, 16, 10, None) == 0
    assert lib.last_error().startswith("cannot allocate the device error record: ")
    assert lib.kvgen_compact_check_device_errors() == 0
    assert lib.last_error().startswith("cannot allocate the device error record: ")


# ---------------------------------------------------------------------------------------------
# (c) the Python runtime, before any launch
# ---------------------------------------------------------------------------------------------


def _layouts(family: str = "qwen3-8b"):
    spec = load_spec(ROOT / "specs" / f"{family}.yaml")
    layout = family_layout(spec)
    return spec, [layout, RegistryLayout.from_json(to_json(spec, layout))]


def _cpu_pools(spec, pages: int = 4, dtype=torch.bfloat16) -> list[list[torch.Tensor]]:
    return [[torch.zeros(pages, spec.kv_heads, spec.tokens_per_block, spec.head_dim, dtype=dtype) for _ in range(2)]
            for _ in range(spec.layers)]


@pytest.mark.parametrize("which", ["family_layout", "registry_layout"])
def test_pools_are_checked_before_configure(which: str) -> None:
    spec, layouts = _layouts()
    layout = layouts[which == "registry_layout"]
    pools = _cpu_pools(spec)
    with pytest.raises(ValueError, match="pools: qwen3-8b has 36 layers, got 35 lists"):
        check_pools(pools[:-1], layout)
    with pytest.raises(ValueError, match=r"pools\[3\]: expected 2 pools \(k, v\), got 1"):
        check_pools(pools[:3] + [pools[3][:1]] + pools[4:], layout)
    short = [list(layer) for layer in pools]
    short[5][1] = torch.zeros(4, 8, 16, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"layer 5, buffer 1 \(v\): pages of 65536 bytes expected, got "
                                         r"\[8, 16, 64\] bfloat16 = 16384 bytes"):
        check_pools(short, layout)
    with pytest.raises(ValueError, match=r"buffer 0 \(k\): dtype int16, the family's hot dtype is bfloat16 or float16"):
        check_pools(_cpu_pools(spec, dtype=torch.int16), layout)
    not_dense = [[p.transpose(2, 3) for p in layer] for layer in pools]
    with pytest.raises(ValueError, match="each page must be dense"):
        check_pools(not_dense, layout)
    page = (spec.kv_heads, spec.tokens_per_block, spec.head_dim)
    combined = [torch.zeros(4, 2, *page, dtype=torch.bfloat16) for _ in range(spec.layers)]
    strided = [[c[:, 0], c[:, 1]] for c in combined]  # K and V of a combined pool pass, up to the device
    with pytest.raises(ValueError, match="pool of layer 0, buffer 0: on cpu; every pool must be on one CUDA device"):
        check_pools(strided, layout)


def test_overlapping_pages_are_refused() -> None:
    spec, (layout, _) = _layouts()
    page = spec.kv_heads * spec.tokens_per_block * spec.head_dim
    raw = torch.zeros(page * 3, dtype=torch.bfloat16)
    pool = raw.as_strided((4, spec.kv_heads, spec.tokens_per_block, spec.head_dim),
                          (page // 2, spec.tokens_per_block * spec.head_dim, spec.head_dim, 1))
    with pytest.raises(ValueError, match=r"buffer 0 \(k\): page stride 32768 bytes is below the page size 65536 \(pages would overlap\)"):
        check_pools([[pool, pool] for _ in range(spec.layers)], layout)


def test_cold_storage_and_pairs_are_checked() -> None:
    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match="cold: cold storage must be a contiguous uint8 tensor"):
        cold_slots(torch.zeros(64, dtype=torch.int8), 16, cpu)
    with pytest.raises(ValueError, match="cold: cold storage must be GPU memory or pinned host memory"):
        cold_slots(torch.zeros(64, dtype=torch.uint8), 16, cpu)
    with pytest.raises(ValueError, match="pairs: page pairs must be an int32 tensor of shape"):
        check_pairs(torch.zeros(3, 2, dtype=torch.int64), "host", cpu)
    with pytest.raises(ValueError, match="pairs: page pairs must be an int32 tensor of shape"):
        check_pairs(torch.zeros(3, 3, dtype=torch.int32), "host", cpu)
    strided = torch.zeros(4, 4, dtype=torch.int32)[:, ::2]
    assert check_pairs(strided, "host", cpu).is_contiguous()  # host pairs are read during the call
    with pytest.raises(ValueError, match="pairs: this codec takes device index arrays on cuda:0, got cpu"):
        check_pairs(strided, "device", torch.device("cuda:0"))


def test_a_closed_codec_raises_instead_of_calling_the_library(library_path: Path) -> None:
    """A codec whose configure failed (no GPU here) is as closed as a closed one: every call raises."""
    spec, (layout, _) = _layouts()
    lib = FamilyLibrary(library_path, REAL_FAMILY)
    codec = ColdPageCodec.__new__(ColdPageCodec)  # the state configure leaves when it fails
    codec._handle, codec.library, codec.layout = None, lib, layout
    for call in (lambda: codec.encode(torch.zeros(16, dtype=torch.uint8), torch.zeros(1, 2, dtype=torch.int32)),
                 lambda: codec.decode(torch.zeros(16, dtype=torch.uint8), torch.zeros(1, 2, dtype=torch.int32)),
                 lambda: codec.cold_page_bytes(0), codec.check_device_errors):
        with pytest.raises(LibraryError, match="this qwen3-8b codec is closed"):
            call()
    codec.close()  # closing twice is fine


def test_bad_index_location_and_lifecycle() -> None:
    spec, (layout, _) = _layouts()
    with pytest.raises(ValueError, match="index_location: 'gpu', expected one of"):
        ColdPageCodec(type("Lib", (), {"family": "qwen3-8b"})(), layout, [], index_location="gpu")


def test_manager_checks_host_lengths_against_the_page_table(tmp_path: Path) -> None:
    spec = small_spec(load_spec(ROOT / "specs" / "qwen3-8b.yaml"), 1)
    sim = DecodeSim(eviction_config(spec), [10], [0], 64, torch.device("cpu"))
    manager, _ = _manager(spec, tmp_path, sim)
    table = torch.zeros(1, 2, dtype=torch.int32)  # 2 pages of 32 tokens per request
    with pytest.raises(ValueError, match=r"request 0: P=10, S=70, L=70; need 0 <= P <= S <= 64 \(the page table's "
                                         r"2 pages of 32 tokens\)"):
        manager.score(table, [10], [70], [70])
    with pytest.raises(ValueError, match=r"request 0: P=20, S=10"):
        manager.score(table, [20], [10], [10])
    with pytest.raises(ValueError, match="one per request, got 2, 2, 2 and 1"):
        manager.score(table, [1, 2], [3, 4], [3, 4])


def test_generation_step_is_checked(tmp_path: Path) -> None:
    from kvgen.runtime.eviction import GenerationStep

    spec = small_spec(load_spec(ROOT / "specs" / "qwen3-8b.yaml"), 1)
    sim = DecodeSim(eviction_config(spec), [10], [0], 64, torch.device("cpu"))
    manager, _ = _manager(spec, tmp_path, sim)
    table = torch.zeros(2, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"step: 1 request ids, 1 lengths, 1 tails and page table \[2, 2\]"):
        manager.on_generation_step_end(GenerationStep(["a"], table, [20]))
    with pytest.raises(ValueError, match="every tail must be between 0 and its request's length"):
        manager.on_generation_step_end(GenerationStep(["a", "b"], table, [20, 5], [0, 6]))


def test_score_page_stride_is_checked() -> None:
    from kvgen.runtime.score import ScoreLibrary

    lib = ScoreLibrary.__new__(ScoreLibrary)  # the geometry is all the check reads
    lib.geometry = {"vector_elems": 8}
    lib.check_page_stride(4096)
    for bad in (0, -8, 12, True, 8.0):
        with pytest.raises(ValueError, match=f"page_stride: {bad!r}, expected a positive multiple of 8 elements"):
            lib.check_page_stride(bad)
