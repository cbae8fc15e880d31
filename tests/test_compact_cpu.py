"""The compaction kernel (compact.cu.j2 + kvgen/kernels/cuda/compact_*.cuh) on the CPU build machine.

(a) The kernel's walk on the host: tests/csrc/compact_host_check.cu runs walk_moves with the
    kernel's addressing over host memory, phase by phase, and the pools must equal the oracle's
    compact_paged byte for byte. The concurrent phase (loads of tile k+D with stores of tile k,
    D = load_ahead) runs in both orders, and the addresses it touches must never overlap: that is
    the claim the kernel's single barrier per tile rests on. Grid: HND and NHD; bf16, fp16, fp8;
    head_dim 64/128/256; tokens_per_block 16..128; every threads, tile_tokens, slices, load_ahead,
    index_ahead and tail_split choice, the tail split over "SM counts" that leave 0 to 45 % of the
    units in the tail (the launch's CTAs walked in the kernel's cta_unit order); several layers with a sliding window layer; separate and combined
    (strided) K/V pools; prompts long enough that moves cross pages.
(b) The rendered source compiles for every target: all TriAttention families for sm_90a (device
    code, -cubin, no spills), two families for sm_100a and sm_103a, one for sm_107a (pip nvcc 13.5),
    every tunable combination for the longest row, and one shared library whose C ABI the
    runtime binding loads (no GPU needed to load it or to get argument errors back).
"""

from __future__ import annotations

import itertools
import random
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch

from kvgen.build.nvcc import compile_shared_library, find_toolchains, parse_ptxas, pip_nvcc_paths
from kvgen.kernels import INCLUDE_DIRS
from kvgen.lower.plan import TUNABLES, fold_compact_runs, plans_for
from kvgen.reference.triattention import MODES, check_moves, compact_paged, pack_moves
from kvgen.render.source import render
from kvgen.runtime.compact import CompactLibrary, Compactor
from kvgen.runtime.library import LibraryError
from kvgen.spec.schema import load_spec
from tests.move_cases import corrupt_moves, geometry, random_batch, random_page_table, random_pools

ROOT = Path(__file__).resolve().parents[1]
CHECK_SRC = ROOT / "tests" / "csrc" / "compact_host_check.cu"
SYSTEM_NVCC = Path("/usr/local/bin/nvcc")
PIP_NVCC = [p for p in pip_nvcc_paths() if p.is_file()]


def _nvcc() -> str:
    if not SYSTEM_NVCC.is_file():
        pytest.skip("nvcc 13.0 not found at /usr/local/bin/nvcc")
    return str(SYSTEM_NVCC)


# ---------------------------------------------------------------------------------------------
# (a) the walk on the host against the oracle
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def host_check(tmp_path_factory) -> Path:
    exe = tmp_path_factory.mktemp("compact_host_check") / "compact_host_check"
    cmd = [_nvcc(), "-x", "cu", "-std=c++17", "-O2", "-I", str(ROOT), str(CHECK_SRC), "-o", str(exe)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return exe


def _grid_cases(count: int = 20) -> list[dict]:
    """Seeded sample of the grid, arranged so every value of every axis appears."""
    axes = {
        "layout": ["HND", "NHD"], "dtype": ["bf16", "fp16", "fp8_e4m3"], "head_dim": [64, 128, 256],
        "tpb": [16, 32, 64, 128], "threads": list(TUNABLES["compact"]["threads"][0]),
        "tile": list(TUNABLES["compact"]["tile_tokens"][0]), "slices": list(TUNABLES["compact"]["slices"][0]),
        "load_ahead": list(TUNABLES["compact"]["load_ahead"][0]),
        "index_ahead": list(TUNABLES["compact"]["index_ahead"][0]),
        # the "SM count" as a share of the launch's units: 0.55 puts 45 % of them in the tail
        "tail_split": list(TUNABLES["compact"]["tail_split"][0]), "sms": [1.0, 0.55, 0.3, 0.8],
        "kv_heads": [1, 2, 4], "mode": list(MODES),
        "interleaved": [False, True], "stores_first": [False, True],
    }
    rng = random.Random(2026)
    cases = []
    for i in range(count):
        case = {name: values[i % len(values)] for name, values in axes.items()}
        case = {name: value if i < 4 else rng.choice(axes[name]) for name, value in case.items()}
        case["seed"] = i
        cases.append(_fold_tail_split(case))
    return cases


def _fold_tail_split(case: dict) -> dict:
    """``tail_split`` folded as the plan folds it (``fold_compact_runs``): the largest choice that
    divides a slice's 16-byte vectors."""
    vectors = 2 * case["head_dim"] * (1 if case["dtype"] == "fp8_e4m3" else 2) // 16
    slices, split = fold_compact_runs(vectors, case["slices"], case["tail_split"])
    assert slices == case["slices"], "the grid's slices divide every row it pairs them with"
    return {**case, "tail_split": split}


CASES = _grid_cases()


def _run_host_check(exe: Path, geo, table: torch.Tensor, moves, k_pools, v_pools, case: dict):
    """Compaction by the host build of the kernel's walk: (overlaps, skipped, loads, K pools, V pools);
    skipped: whether moves were skipped for a token outside the table row, for a page outside the pools;
    loads: the 16-byte pool loads the walk issued."""
    page_bytes = k_pools[0][0].numel() * k_pools[0].element_size()
    header = [0 if geo.layout == "HND" else 1, page_bytes // (geo.kv_heads * geo.tokens_per_block), geo.kv_heads,
              geo.tokens_per_block, geo.num_layers, k_pools[0].shape[0], table.shape[0], table.shape[1],
              moves.src.shape[-1], case["threads"], case["tile"], int(case["stores_first"]), int(case["interleaved"]),
              case["slices"], case["load_ahead"], case["index_ahead"], case.get("tail_split", 1)]
    units = table.shape[0] * geo.kv_heads * geo.num_layers * case["slices"]
    header.append(max(1, round(units * case.get("sms", 1.0))))
    parts = [np.asarray(header, dtype="<i8").tobytes()]
    for t in (table, moves.src, moves.dst, moves.offsets):
        parts.append(t.to(torch.int32).contiguous().numpy().astype("<i4").tobytes())
    for k, v in zip(k_pools, v_pools):
        parts += [k.contiguous().view(torch.uint8).numpy().tobytes(), v.contiguous().view(torch.uint8).numpy().tobytes()]
    proc = subprocess.run([str(exe)], input=b"".join(parts), capture_output=True, timeout=120)
    assert proc.returncode == 0, f"exit {proc.returncode}: {proc.stderr.decode()}"
    overlaps, *skipped, loads = (int(x) for x in np.frombuffer(proc.stdout[:32], dtype="<i8"))
    data = np.frombuffer(proc.stdout[32:], dtype=np.uint8)
    pool_bytes = k_pools[0].numel() * k_pools[0].element_size()
    assert data.size == 2 * geo.num_layers * pool_bytes
    pools = [torch.from_numpy(data[i * pool_bytes:(i + 1) * pool_bytes].copy()) for i in range(2 * geo.num_layers)]
    return overlaps, tuple(skipped), loads, pools[0::2], pools[1::2]


def _row_loads(moves, k_pools, geo) -> int:
    """16-byte loads of a walk that loads only the moves that copy (K and V rows): fill (-1),
    identity and skipped moves must load nothing."""
    n = int(moves.offsets[-1])
    src, dst = moves.src[..., :n], moves.dst[..., :n]
    row_bytes = k_pools[0][0].numel() * k_pools[0].element_size() // (geo.kv_heads * geo.tokens_per_block)
    return int(((src >= 0) & (src != dst)).sum()) * 2 * (row_bytes // 16)


def _case_inputs(case: dict):
    """Geometry (3 layers, the middle one sliding), a batch whose moves cross pages, pools."""
    window = 12
    geo = geometry(3, case["kv_heads"], (None, window, None), case["head_dim"], case["tpb"], case["layout"])
    budget = case.get("budget", 16 + case["seed"] % 24)
    batch = random_batch(geo, case["mode"], budget, batch=3, seed=case["seed"],
                         max_prompt=2 * case["tpb"], max_extra=case["tpb"], max_tail=case["tpb"] // 2 + 3)
    moves = pack_moves(*batch.args(), geo, batch.max_requests)
    check_moves(moves)
    table, num_pages = random_page_table(batch.lengths, geo.tokens_per_block, batch.max_requests, case["seed"])
    k_pools, v_pools = random_pools(geo, num_pages, case["dtype"], case["seed"])
    return geo, moves, table, k_pools, v_pools


@pytest.mark.parametrize("case", CASES, ids=[
    f"{c['layout']}-{c['dtype']}-d{c['head_dim']}-tpb{c['tpb']}-h{c['kv_heads']}-t{c['threads']}x{c['tile']}"
    f"s{c['slices']}a{c['load_ahead']}{'i' if c['index_ahead'] else ''}x{c['tail_split']}of{c['sms']}-"
    f"{c['mode']}{'-kv' if c['interleaved'] else ''}{'-sf' if c['stores_first'] else ''}" for c in CASES])
def test_host_walk_equals_oracle(host_check: Path, case: dict) -> None:
    _check_walk(host_check, case)


# Walks of many tiles (up to ~25 of 8 moves) through every pipeline shape: the prologue, the ring
# wrapping around and the last tiles, where a shape's lookahead runs past the end.
LONG_WALKS = [{**CASES[i % 4], "threads": 64, "tile": 8, "slices": 1, "budget": 200, "load_ahead": ahead,
               "index_ahead": index} for i, (ahead, index) in enumerate(itertools.product(
                   TUNABLES["compact"]["load_ahead"][0], TUNABLES["compact"]["index_ahead"][0]))]


@pytest.mark.parametrize("case", LONG_WALKS, ids=lambda c: f"a{c['load_ahead']}i{c['index_ahead']}-{c['layout']}")
def test_long_walks_of_every_pipeline_equal_oracle(host_check: Path, case: dict) -> None:
    _check_walk(host_check, case)


def _check_walk(host_check: Path, case: dict) -> None:
    """The host walk of ``case`` against the oracle, byte for byte, with no overlap in a concurrent
    phase, no load for a move that stores nothing and no valid move skipped."""
    geo, moves, table, k_pools, v_pools = _case_inputs(case)
    overlaps, skipped, loads, k_out, v_out = _run_host_check(host_check, geo, table, moves, k_pools, v_pools, case)
    k_ref = [p.clone() for p in k_pools]
    v_ref = [p.clone() for p in v_pools]
    compact_paged(k_ref, v_ref, table, moves, geo)
    assert overlaps == 0, "a load of tile k+D touched a row stored by tile k"
    assert loads == _row_loads(moves, k_pools, geo), "a move that stores nothing loaded its row"
    assert skipped == (0, 0), "a valid move was skipped as out of range"
    assert any(not torch.equal(a, b) for a, b in zip(k_ref, k_pools)), "the case moves nothing"
    for layer in range(geo.num_layers):
        assert torch.equal(k_out[layer], k_ref[layer].view(torch.uint8).reshape(-1)), f"K of layer {layer}"
        assert torch.equal(v_out[layer], v_ref[layer].view(torch.uint8).reshape(-1)), f"V of layer {layer}"


@pytest.mark.parametrize("case", CASES[:4], ids=lambda c: f"{c['layout']}-t{c['threads']}x{c['tile']}-{c['mode']}")
def test_host_walk_skips_out_of_range_moves(host_check: Path, case: dict) -> None:
    """The kernel's bounds checks (bit-exact against the oracle): moves with tokens outside the page
    table row or pages outside the pools are skipped and recorded; every other move is made and no
    other byte changes."""
    geo, moves, table, k_pools, v_pools = _case_inputs(case)
    bad_moves, bad_table, kept_moves = corrupt_moves(moves, table, geo.tokens_per_block)
    overlaps, skipped, loads, k_out, v_out = _run_host_check(host_check, geo, bad_table, bad_moves, k_pools, v_pools,
                                                             case)
    k_ref = [p.clone() for p in k_pools]
    v_ref = [p.clone() for p in v_pools]
    compact_paged(k_ref, v_ref, table, kept_moves, geo)
    assert skipped == (1, 1) and overlaps == 0
    assert loads == _row_loads(kept_moves, k_pools, geo), "a skipped move loaded a row"
    for layer in range(geo.num_layers):
        assert torch.equal(k_out[layer], k_ref[layer].view(torch.uint8).reshape(-1)), f"K of layer {layer}"
        assert torch.equal(v_out[layer], v_ref[layer].view(torch.uint8).reshape(-1)), f"V of layer {layer}"


def test_moves_cross_pages() -> None:
    """The grid above really exercises page crossings: a move whose source and destination pages
    differ, in every case."""
    for case in CASES:
        geo, moves, table, *_ = _case_inputs(case)
        real = (moves.src >= 0) & (moves.src != moves.dst)
        assert bool(((moves.src[real] // geo.tokens_per_block) != (moves.dst[real] // geo.tokens_per_block)).any())


# ---------------------------------------------------------------------------------------------
# (b) compiles for every target
# ---------------------------------------------------------------------------------------------


def _triattention_specs() -> dict:
    specs = {}
    for path in sorted((ROOT / "specs").glob("*.yaml")):
        spec = load_spec(path)
        if spec.triattention.enabled:
            specs[spec.name] = spec
    return specs


def _compact_plan(spec, params: dict | None = None):
    plan = next(p for p in plans_for(spec) if p.op == "compact")
    return plan.with_params(params) if params else plan


def _cubin(nvcc: str, source: str, arch: str, workdir: Path, name: str) -> dict:
    """Device code only (-cubin: no host pass, fast); the ptxas facts of the kernel."""
    src = workdir / f"{name}.cu"
    src.write_text(source)
    cmd = [nvcc, "-cubin", "-O3", "-std=c++17", f"-arch={arch}", "-Xptxas", "-v", *[f"-I{d}" for d in INCLUDE_DIRS], str(src),
           "-o", str(workdir / f"{name}.{arch}.cubin")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{name} {arch}:\n{proc.stdout}{proc.stderr}"
    kernels = parse_ptxas(proc.stdout + proc.stderr)
    assert len(kernels) == 1, kernels
    return next(iter(kernels.values())).__dict__


def _compile_all(jobs: list[tuple[str, str, str, str]], workdir: Path) -> dict[str, dict]:
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {name: pool.submit(_cubin, nvcc, source, arch, workdir, name) for name, nvcc, source, arch in jobs}
        return {name: f.result() for name, f in futures.items()}


def _assert_no_spills(facts: dict[str, dict]) -> None:
    for name, f in facts.items():
        assert f["stack_bytes"] == 0 and f["spill_stores"] == 0 and f["spill_loads"] == 0, (name, f)


def test_every_family_compiles_for_sm90a(tmp_path: Path) -> None:
    specs = _triattention_specs()
    assert {"qwen3-8b", "llama-3.1-8b", "mistral-7b", "gemma-2-9b", "gpt-oss-20b"} <= set(specs)
    jobs = [(name, _nvcc(), render(_compact_plan(spec)), "sm_90a") for name, spec in specs.items()]
    _assert_no_spills(_compile_all(jobs, tmp_path))


def test_every_tunable_compiles_without_spills_for_the_longest_row(tmp_path: Path) -> None:
    spec = _triattention_specs()["gemma-2-9b"]  # head_dim 256 bf16: 512-byte rows, the most vectors per thread
    space = TUNABLES["compact"]
    jobs = []
    for threads, tile in itertools.product(space["threads"][0], space["tile_tokens"][0]):
        source = render(_compact_plan(spec, {"threads": threads, "tile_tokens": tile}))
        jobs.append((f"t{threads}x{tile}", _nvcc(), source, "sm_90a"))
    for slices in space["slices"][0][1:]:   # shorter runs per move: more moves per tile, the same vectors
        source = render(_compact_plan(spec, {"threads": 512, "tile_tokens": 128, "slices": slices}))
        jobs.append((f"t512x128s{slices}", _nvcc(), source, "sm_90a"))
    for threads, tile in itertools.product((256, 512), (32, 128)):   # a third register tile, fetched indices
        source = render(_compact_plan(spec, {"threads": threads, "tile_tokens": tile, "load_ahead": 2,
                                             "index_ahead": 1}))
        jobs.append((f"t{threads}x{tile}a2i", _nvcc(), source, "sm_90a"))
    for threads, split in itertools.product((256, 512), space["tail_split"][0][1:]):   # two walks in one kernel
        source = render(_compact_plan(spec, {"threads": threads, "tile_tokens": 128, "slices": 2, "tail_split": split}))
        jobs.append((f"t{threads}x128s2x{split}", _nvcc(), source, "sm_90a"))
    _assert_no_spills(_compile_all(jobs, tmp_path))


def test_blackwell_and_rubin_targets(tmp_path: Path) -> None:
    specs = _triattention_specs()
    jobs = [(f"{family}-{arch}", _nvcc(), render(_compact_plan(specs[family])), arch)
            for family in ("qwen3-8b", "mistral-7b") for arch in ("sm_100a", "sm_103a")]
    jobs.append(("qwen3-8b-slices2-sm_100a", _nvcc(),
                 render(_compact_plan(specs["qwen3-8b"], {"slices": 2, "tail_split": 4})), "sm_100a"))
    if PIP_NVCC:
        jobs.append(("qwen3-8b-sm_107a", str(PIP_NVCC[0]), render(_compact_plan(specs["qwen3-8b"])), "sm_107a"))
    _assert_no_spills(_compile_all(jobs, tmp_path))
    if not PIP_NVCC:
        pytest.skip("sm_107a needs the pip nvcc 13.5 (pip install kvgen[nvcc-rubin]); sm_100a/sm_103a passed")


# ---------------------------------------------------------------------------------------------
# The C ABI through the runtime binding, without a GPU
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def compact_library(tmp_path_factory) -> Path:
    toolchains = [t for t in find_toolchains([SYSTEM_NVCC]) if t.supports("sm_90a")]
    if not toolchains:
        pytest.skip("no nvcc for sm_90a")
    work = tmp_path_factory.mktemp("compact_lib")
    source = work / "compact.cu"
    source.write_text(render(_compact_plan(_triattention_specs()["mistral-7b"])))
    out = work / "libkvgen_mistral_7b_compact.so"
    compile_shared_library([source], "sm_90a", list(INCLUDE_DIRS), out, toolchains[0])
    return out


def test_a_size_variant_of_another_geometry_is_refused(compact_library: Path, tmp_path: Path) -> None:
    """Compactor(variants=...) serves the registry's size-dispatched libraries; one compiled for
    another family's pages would write the wrong bytes, so it is refused before any pool is read."""
    nvcc = [t for t in find_toolchains([SYSTEM_NVCC]) if t.supports("sm_90a")][0]
    source = tmp_path / "compact.cu"
    source.write_text(render(_compact_plan(_triattention_specs()["gpt-oss-20b"], {"slices": 2})))
    other = tmp_path / "libkvgen_gpt_oss_20b_compact_b32.so"
    compile_shared_library([source], "sm_90a", list(INCLUDE_DIRS), other, nvcc)
    with pytest.raises(LibraryError, match=f"{other}: a compaction variant of another geometry than "
                                           f"{compact_library} \\(num_layers 24 vs 32, kv_heads 8 vs 8, head_dim 64 vs 128"):
        Compactor(compact_library, [], [], variants=[(5, other)])


def test_library_describes_itself(compact_library: Path) -> None:
    lib = CompactLibrary(compact_library)
    assert lib.info == {"abi_version": 4, "num_layers": 32, "kv_heads": 8, "head_dim": 128, "tokens_per_block": 16,
                        "elem_bytes": 2, "layout": "NHD", "threads": 128, "tile_tokens": 32, "slices": 1,
                        "load_ahead": 1, "index_ahead": 0, "tail_split": 1}


def test_argument_errors_come_back_without_a_gpu(compact_library: Path) -> None:
    lib = CompactLibrary(compact_library)
    assert lib.kvgen_compact(None, 3, None, 0, 4, None, None, None, 10, None) == 0
    assert lib.last_error() == "expected 32 layer pools, got 3"
    assert lib.kvgen_compact(None, 32, None, 0, 4, None, None, None, 10, None) == 0
    assert lib.last_error() == "null pool array"
    # Nothing to move is a success that touches nothing (no launch, so no GPU needed).
    from kvgen.runtime.compact import CompactPool
    pools = (CompactPool * 32)(*[CompactPool(4096, 4096 * 16, 8192, 4096 * 16) for _ in range(32)])
    assert lib.kvgen_compact(pools, 32, None, 0, 0, None, None, None, 10, None) == 1
    pools[5].v_page_stride_bytes = 24
    assert lib.kvgen_compact(pools, 32, None, 0, 4, None, None, None, 10, None) == 0
    assert lib.last_error() == "layer 5: pool bases and page strides must be 16-byte aligned"


def test_compactor_checks_pools(compact_library: Path) -> None:
    good = [torch.zeros(4, 16, 8, 128, dtype=torch.float16) for _ in range(32)]
    with pytest.raises(ValueError, match="32 layers, got 2 K"):
        Compactor(compact_library, good[:2], good)
    hnd = [torch.zeros(4, 8, 16, 128, dtype=torch.float16) for _ in range(32)]
    with pytest.raises(ValueError, match=r"K pool of layer 0: expected \[pages, 16, 8, 128\] \(NHD\)"):
        Compactor(compact_library, hnd, good)
    with pytest.raises(ValueError, match="K pool of layer 0: pools must be CUDA tensors"):
        Compactor(compact_library, good, good)
    with pytest.raises(LibraryError, match="missing entry point kvgen_compact_abi_version"):
        CompactLibrary("libc.so.6")
