"""TriAttention compaction and move packing on the GPU, byte-exact against the oracle.

Libraries come from the registry (conftest's REGISTRY/ARCH: build/registry/sm_90a/manifest.json,
written by `kvgen build --arch sm_90a` and carried to the GPU machine), the packers too (their AOT
libraries, lib<symbol>_pack.so). Either missing skips its tests with the command that makes it.

What the grid covers, and why:
- every registry family with compaction: the dtypes and layouts the specs use (bf16 HND, bf16
  and fp16 NHD), head_dim 64/128/256, tokens_per_block 16/32/64, 1 to 8 KV heads, 15 to 42 layers;
- fp8 pages and tokens_per_block 128 appear in no TriAttention spec, so two more libraries are
  rendered from compact.cu.j2 with plain jinja2 and compiled here (skipped without nvcc);
- every mode per family (the moves differ; the kernel must not care), with a synthetic sliding
  window on every third layer (fill slots, then the latest window rebased), tails of different
  lengths, prompts of a few pages so moves cross pages, padded requests, and once K and V as
  strided views of one combined pool;
- the packer and the compaction captured together in one CUDA graph and replayed on new inputs.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from kvgen.artifacts.manifest import RegistryError, manifest_path, read_manifest, verify_op
from kvgen.kernels import INCLUDE_DIRS
from kvgen.reference.triattention import MODES, Moves, check_moves, compact_paged, pack_moves
from kvgen.render.source import TEMPLATES_DIR
from kvgen.runtime.compact import CompactLibrary, Compactor
from kvgen.runtime.pack import MovePacker, PackLibrary
from tests.move_cases import Batch, geometry, random_batch, random_page_table

from .conftest import ARCH, REGISTRY

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]
MANIFEST = manifest_path(REGISTRY, ARCH)
WINDOW = 32        # synthetic sliding window of every third layer
BUDGET = 48        # >= WINDOW
POOL_DTYPE = {2: torch.bfloat16, 1: torch.float8_e4m3fn}  # by element bytes: compaction copies bytes
DEVICE = "cuda"


def _registry() -> tuple[dict[str, Path], str]:
    """family -> verified library path for families built with compaction, or ({}, why not)."""
    if not MANIFEST.is_file():
        return {}, f"no registry at {MANIFEST}; run: kvgen build --arch {ARCH} (and carry build/registry)"
    try:
        manifest = read_manifest(MANIFEST)
    except RegistryError as exc:
        return {}, str(exc)
    libraries = {entry.family: verify_op(MANIFEST, manifest, entry, "compact") for entry in manifest.families
                 if entry.op("compact") is not None}
    return libraries, "" if libraries else f"{MANIFEST} lists no family with compaction"


LIBRARIES, WHY_NO_REGISTRY = _registry()
FAMILIES = sorted(LIBRARIES) or [pytest.param(None, marks=pytest.mark.skip(reason=WHY_NO_REGISTRY))]


# ---------------------------------------------------------------------------------------------
# One compaction case: oracle vs library
# ---------------------------------------------------------------------------------------------


def _geometry_of(info: dict):
    windows = [WINDOW if layer % 3 == 1 else None for layer in range(info["num_layers"])]
    return geometry(info["num_layers"], info["kv_heads"], windows, info["head_dim"], info["tokens_per_block"],
                    info["layout"])


def _random_pools(geo, info: dict, num_pages: int, combined: bool, seed: int) -> tuple[list, list]:
    """Random bytes on the GPU; ``combined``: K and V as strided views of one [pages, 2, page] pool."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    page = ((geo.kv_heads, geo.tokens_per_block) if geo.layout == "HND" else (geo.tokens_per_block, geo.kv_heads))
    row = geo.head_dim * info["elem_bytes"]
    dtype = POOL_DTYPE[info["elem_bytes"]]
    k_pools, v_pools = [], []
    for _ in range(geo.num_layers):
        if combined:
            kv = torch.randint(0, 256, (num_pages, 2, *page, row), dtype=torch.uint8, device=DEVICE, generator=g)
            kv = kv.view(dtype)
            k_pools.append(kv[:, 0])
            v_pools.append(kv[:, 1])
        else:
            for pools in (k_pools, v_pools):
                raw = torch.randint(0, 256, (num_pages, *page, row), dtype=torch.uint8, device=DEVICE, generator=g)
                pools.append(raw.view(dtype))
    return k_pools, v_pools


def _batch(geo, mode: str, seed: int) -> Batch:
    tpb = geo.tokens_per_block
    return random_batch(geo, mode, BUDGET, batch=4, seed=seed, padding=2, max_prompt=2 * tpb, max_extra=tpb,
                        max_tail=tpb // 2 + 5)


def _check_compaction(library: CompactLibrary, mode: str, seed: int, combined: bool = False,
                      variants: tuple = (), serves: CompactLibrary | None = None) -> None:
    geo = _geometry_of(library.info)
    batch = _batch(geo, mode, seed)
    moves = pack_moves(*batch.args(), geo, batch.max_requests)
    table, num_pages = random_page_table(batch.lengths, geo.tokens_per_block, batch.max_requests, seed)
    real = (moves.src >= 0) & (moves.src != moves.dst)
    assert bool(((moves.src[real] // geo.tokens_per_block) != (moves.dst[real] // geo.tokens_per_block)).any())
    k_pools, v_pools = _random_pools(geo, library.info, num_pages, combined, seed)
    k_ref = [p.clone() for p in k_pools]
    v_ref = [p.clone() for p in v_pools]
    table = table.to(DEVICE)
    compact_paged(k_ref, v_ref, table, moves, geo)
    compactor = Compactor(library, k_pools, v_pools, variants)
    assert compactor.library_for(batch.max_requests) is (serves or library)
    compactor(table, moves.src.to(DEVICE), moves.dst.to(DEVICE), moves.offsets.to(DEVICE))
    torch.cuda.synchronize()
    compactor.check_device_errors()
    for layer in range(geo.num_layers):
        assert torch.equal(k_pools[layer].view(torch.uint8), k_ref[layer].view(torch.uint8)), f"{mode}: K {layer}"
        assert torch.equal(v_pools[layer].view(torch.uint8), v_ref[layer].view(torch.uint8)), f"{mode}: V {layer}"


@pytest.mark.parametrize("family", FAMILIES)
def test_compaction_equals_oracle(family: str) -> None:
    library = CompactLibrary(LIBRARIES[family])
    for i, mode in enumerate(MODES):
        _check_compaction(library, mode, seed=100 + i, combined=(i == 0))


# ---------------------------------------------------------------------------------------------
# fp8 pages and 128-token blocks: libraries rendered and compiled here
# ---------------------------------------------------------------------------------------------

SYNTHETIC = {
    "fp8-hnd-d128-tpb32": {"dtype": "fp8_e4m3", "layout": "HND", "elem_bytes": 1, "kv_heads": 8, "head_dim": 128,
                           "tokens_per_block": 32, "layers": 6},
    "fp8-nhd-d64-tpb128": {"dtype": "fp8_e4m3", "layout": "NHD", "elem_bytes": 1, "kv_heads": 4, "head_dim": 64,
                           "tokens_per_block": 128, "layers": 5},
}


def _render_synthetic(name: str, geometry_: dict, params: dict | None = None) -> str:
    """compact.cu.j2 with the context kvgen.render.source gives it (that module needs the spec, so pydantic)."""
    import jinja2

    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(TEMPLATES_DIR)),
                             undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True,
                             keep_trailing_newline=True)
    plan = SimpleNamespace(family=name)
    context = {"plan": plan, "g": geometry_, "p": params or {"threads": 128, "tile_tokens": 32, "slices": 1,
                                                             "load_ahead": 1, "index_ahead": 0, "tail_split": 1},
               "symbol": "kvgen_test",
               "header": f"// test library {name}"}
    return env.get_template("compact.cu.j2").render(context)


@pytest.fixture(scope="module")
def synthetic_libraries(tmp_path_factory) -> dict[str, CompactLibrary]:
    from kvgen.build.nvcc import compile_shared_library, probe_toolchain

    nvcc = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    if not Path(nvcc).is_file():
        pytest.skip("no nvcc on this machine to build the fp8 / tpb-128 test libraries")
    toolchain = probe_toolchain(nvcc)
    work = tmp_path_factory.mktemp("compact_synthetic")
    libraries = {}
    for name, geometry_ in SYNTHETIC.items():
        source = work / f"{name}.cu"
        source.write_text(_render_synthetic(name, geometry_))
        out = work / f"lib{name}.so"
        compile_shared_library([source], "sm_90a", list(INCLUDE_DIRS), out, toolchain)
        libraries[name] = CompactLibrary(out)
    return libraries


# The compaction tunables' larger values (more bytes in flight per CTA), on bf16 rows of 256 and
# 512 bytes: every (threads, tile_tokens) pair with 512 threads or 128-move tiles; then rows cut
# into 2, 4 and 8 slices (CTAs of one request, head and layer side by side on disjoint bytes).
BIG_TILES = [(t, k, 1) for t in (256, 512) for k in (32, 64, 128) if t == 512 or k == 128] + [
    (128, 32, 2), (128, 32, 4), (256, 64, 4), (512, 128, 2), (128, 32, 8), (256, 32, 8)]
BF16_GEOMETRIES = {
    "bf16-hnd-d128-tpb64": {"dtype": "bf16", "layout": "HND", "elem_bytes": 2, "kv_heads": 8, "head_dim": 128,
                            "tokens_per_block": 64, "layers": 3},
    "bf16-nhd-d256-tpb16": {"dtype": "bf16", "layout": "NHD", "elem_bytes": 2, "kv_heads": 4, "head_dim": 256,
                            "tokens_per_block": 16, "layers": 3},
}


@pytest.fixture(scope="module")
def tile_library(tmp_path_factory):
    """(geometry name, threads, tile, slices) -> its CompactLibrary, compiled on first use (so a
    test that needs two configurations compiles two)."""
    from kvgen.build.nvcc import compile_shared_library, probe_toolchain

    nvcc = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    if not Path(nvcc).is_file():
        pytest.skip("no nvcc on this machine to build the tile-variant test libraries")
    toolchain = probe_toolchain(nvcc)
    work = tmp_path_factory.mktemp("compact_tiles")
    libraries: dict[tuple, CompactLibrary] = {}

    def library(name: str, threads: int, tile: int, slices: int, load_ahead: int = 1,
                index_ahead: int = 0, tail_split: int = 1) -> CompactLibrary:
        key = (name, threads, tile, slices, load_ahead, index_ahead, tail_split)
        if key not in libraries:
            stem = f"{name}-t{threads}x{tile}s{slices}a{load_ahead}i{index_ahead}x{tail_split}"
            source = work / f"{stem}.cu"
            source.write_text(_render_synthetic(name, BF16_GEOMETRIES[name], {
                "threads": threads, "tile_tokens": tile, "slices": slices, "load_ahead": load_ahead,
                "index_ahead": index_ahead, "tail_split": tail_split}))
            compile_shared_library([source], "sm_90a", list(INCLUDE_DIRS), work / f"lib{stem}.so", toolchain)
            libraries[key] = CompactLibrary(work / f"lib{stem}.so")
        return libraries[key]
    return library


@pytest.mark.parametrize("threads, tile, slices", BIG_TILES)
@pytest.mark.parametrize("name", sorted(BF16_GEOMETRIES))
def test_big_tiles_equal_oracle(tile_library, name: str, threads: int, tile: int, slices: int) -> None:
    """threads 512 / tile_tokens 128 and rows in slices move exactly the oracle's bytes (bit for bit)."""
    library = tile_library(name, threads, tile, slices)
    assert library.info["slices"] == slices
    for i, mode in enumerate(MODES):
        _check_compaction(library, mode, seed=300 + i, combined=(i == 2))


# The walk's pipeline shapes: a third register tile (load_ahead 2) and move indices fetched a tile
# ahead (index_ahead 1), at the shipped qwen3-8b shape, at 8-move tiles (many tiles a CTA) and at
# the largest tile.
PIPELINES = [(256, 32, 2, 2, 0), (256, 32, 2, 1, 1), (256, 32, 2, 2, 1), (128, 8, 1, 2, 1), (512, 128, 1, 2, 1)]


@pytest.mark.parametrize("threads, tile, slices, load_ahead, index_ahead", PIPELINES)
@pytest.mark.parametrize("name", sorted(BF16_GEOMETRIES))
def test_pipelines_equal_oracle(tile_library, name: str, threads: int, tile: int, slices: int, load_ahead: int,
                                index_ahead: int) -> None:
    """Every pipeline shape moves exactly the oracle's bytes (bit for bit)."""
    library = tile_library(name, threads, tile, slices, load_ahead, index_ahead)
    assert (library.info["load_ahead"], library.info["index_ahead"]) == (load_ahead, index_ahead)
    for i, mode in enumerate(MODES):
        _check_compaction(library, mode, seed=500 + i, combined=(i == 2))


@pytest.mark.parametrize("slices, tail_split", [(1, 2), (2, 4), (2, 2)])
@pytest.mark.parametrize("name", sorted(BF16_GEOMETRIES))
def test_tail_split_equals_oracle(tile_library, name: str, slices: int, tail_split: int) -> None:
    """The units past the last whole multiple of this GPU's SM count, each copied by tail_split CTAs
    (bf16-hnd-d128-tpb64 at 2 slices: 288 units, the last 24 split on a 132-SM GPU), move exactly
    the oracle's bytes (bit for bit)."""
    library = tile_library(name, 256, 32, slices, tail_split=tail_split)
    assert library.info["tail_split"] == tail_split
    for i, mode in enumerate(MODES):
        _check_compaction(library, mode, seed=600 + i, combined=(i == 2))


@pytest.mark.parametrize("name", sorted(BF16_GEOMETRIES))
def test_size_dispatched_compaction_equals_the_oracle(tile_library, name: str) -> None:
    """A registry's size variants (kvgen.artifacts.dispatch): calls of at least the threshold's
    request slots go to the variant library, smaller ones to the main one; both bit for bit."""
    main, variant = tile_library(name, 512, 32, 1), tile_library(name, 128, 32, 8)
    slots = _batch(_geometry_of(main.info), MODES[0], 0).max_requests
    _check_compaction(main, MODES[0], seed=400, variants=[(slots, variant)], serves=variant)
    _check_compaction(main, MODES[1], seed=401, variants=[(slots + 1, variant)], serves=main)


@pytest.mark.parametrize("name", sorted(SYNTHETIC))
def test_fp8_and_long_blocks_equal_oracle(synthetic_libraries: dict, name: str) -> None:
    library = synthetic_libraries[name]
    assert library.info["elem_bytes"] == 1
    for i, mode in enumerate(MODES):
        _check_compaction(library, mode, seed=200 + i, combined=(i == 1))


# ---------------------------------------------------------------------------------------------
# The packer on the GPU, and packer + compaction in one CUDA graph
# ---------------------------------------------------------------------------------------------


def _packer(family: str) -> MovePacker:
    """The family's packer as the registry ships it (sha256-verified ``pack`` artifact)."""
    manifest = read_manifest(MANIFEST, verify=False)
    entry = manifest.family(family)
    if entry is None or entry.op("pack") is None:
        pytest.skip(f"{MANIFEST} lists no packer for {family}; run: kvgen build --arch {ARCH} --family {family}")
    return MovePacker(verify_op(MANIFEST, manifest, entry, "pack"), family)


def _packer_geometry(packer: MovePacker):
    return geometry(packer.num_layers, packer.kv_heads, packer.swa_window)


@pytest.mark.parametrize("family", FAMILIES)
def test_packer_on_gpu_equals_oracle(family: str) -> None:
    packer = _packer(family)
    geo = _packer_geometry(packer)
    budget = max([BUDGET] + [w for w in packer.swa_window if w])
    for i, mode in enumerate(MODES):
        batch = random_batch(geo, mode, budget, batch=6, seed=300 + i, padding=3)
        ref = pack_moves(*batch.args(), geo, batch.max_requests)
        n = ref.src.shape[-1]
        for capacity in (None, n + 129):
            src, dst, offsets = packer(*batch.to(DEVICE).args(), batch.max_requests, capacity)
            assert torch.equal(offsets.cpu(), ref.offsets)
            assert torch.equal(src[..., :n].cpu(), ref.src) and torch.equal(dst[..., :n].cpu(), ref.dst)
            assert bool((src[..., n:] == -1).all()) and bool((dst[..., n:] == -1).all())


def _copy_batch(static: Batch, new: Batch) -> None:
    for name in ("kept", "P", "S", "tail", "active"):
        getattr(static, name).copy_(getattr(new, name))


@pytest.mark.parametrize("family", FAMILIES)
def test_pack_and_compact_replay_in_a_cuda_graph(family: str) -> None:
    """Capture once, replay on three new batches and new pool bytes: what a serving engine does."""
    packer = _packer(family)
    library = CompactLibrary(LIBRARIES[family])
    geo = _packer_geometry(packer)
    info = library.info
    geo_pages = geometry(geo.num_layers, geo.kv_heads, geo.swa_window, info["head_dim"], info["tokens_per_block"],
                         info["layout"])
    budget = max([BUDGET] + [w for w in packer.swa_window if w])
    tpb = info["tokens_per_block"]

    def new_batch(seed: int) -> Batch:
        return random_batch(geo, "union", budget, batch=4, seed=seed, padding=2, max_prompt=2 * tpb,
                            max_extra=tpb, max_tail=tpb // 2 + 5, active=[True, True, seed % 2 == 0, True])

    first = new_batch(400)
    longest = 2 * tpb + budget + tpb + tpb // 2 + 5  # P + (S - P) + tail, the most new_batch makes
    lengths = torch.full((first.max_requests,), longest)
    table, num_pages = random_page_table(lengths, tpb, first.max_requests, seed=400)
    table = table.to(DEVICE)
    k_pools, v_pools = _random_pools(geo_pages, info, num_pages, combined=False, seed=400)
    compactor = Compactor(library, k_pools, v_pools)
    static = first.to(DEVICE)
    capacity = first.max_requests * (budget + tpb // 2 + 5)

    def step():
        src, dst, offsets = packer(*static.args(), static.max_requests, capacity)
        compactor(table, src, dst, offsets)
        return src, dst, offsets

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # warm-up: the packer loads its kernels and caches its window table
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = step()

    for seed in (401, 402, 403):
        batch = new_batch(seed)
        _copy_batch(static, batch.to(DEVICE))
        for pool in k_pools + v_pools:
            pool.view(torch.uint8).copy_(torch.randint_like(pool.view(torch.uint8), 0, 256))
        k_ref = [p.clone() for p in k_pools]
        v_ref = [p.clone() for p in v_pools]
        graph.replay()
        torch.cuda.synchronize()
        ref = pack_moves(*batch.args(), geo, batch.max_requests)
        check_moves(ref)
        n = ref.src.shape[-1]
        assert torch.equal(outputs[2].cpu(), ref.offsets) and torch.equal(outputs[0][..., :n].cpu(), ref.src)
        compact_paged(k_ref, v_ref, table, Moves(*(t.to(DEVICE) for t in (ref.src, ref.dst, ref.offsets))), geo_pages)
        for layer in range(geo.num_layers):
            assert torch.equal(k_pools[layer].view(torch.uint8), k_ref[layer].view(torch.uint8)), f"seed {seed} K"
            assert torch.equal(v_pools[layer].view(torch.uint8), v_ref[layer].view(torch.uint8)), f"seed {seed} V"


@pytest.mark.parametrize("family", FAMILIES)
def test_the_pack_library_stays_inside_its_tensors_whatever_the_offsets(family: str) -> None:
    """Garbage offsets on the device (counts past capacity, negative, for padding requests): the
    AOT packer reads kept only for the batch's requests and writes only the capacity slots
    (compute-sanitizer checks the accesses; here the fill and the untouched guard)."""
    packer = _packer(family).module
    assert isinstance(packer, PackLibrary), "the registry ships the AOT packer"
    budget = max([BUDGET] + [w for w in packer.swa_window if w])
    batch, max_requests, capacity = 2, 5, 64
    kept = torch.zeros((batch, packer.num_decision_rows("union"), budget), dtype=torch.int64, device=DEVICE)
    P = torch.tensor([3, 9], dtype=torch.int64, device=DEVICE)
    S = P + budget
    offsets = torch.tensor([0, 10**6, -5, 3, 10**7, 2**31 - 1], dtype=torch.int32, device=DEVICE)
    shape = (packer.num_layers, packer.kv_heads, capacity)
    n = packer.num_layers * packer.kv_heads * capacity
    buffers = [torch.full((n + 256,), 7, dtype=torch.int32, device=DEVICE) for _ in range(2)]
    src, dst = (buffer[:n].view(shape) for buffer in buffers)      # 256 guard words after each
    packer._launch_moves(kept, P, S, packer.layer_windows(DEVICE), offsets, src, dst, "union", batch,
                         max_requests, budget, capacity)
    torch.cuda.synchronize()
    assert all(bool((buffer[n:] == 7).all()) for buffer in buffers)
    assert bool(((src >= -1) & (src < int(S.max()) + capacity)).all())
