"""The sm_90a kernel wheel on the H200, with no compiler: libraries come from the installed
``kvgen-kernels-sm90`` package (found through its ``kvgen.registries`` entry point, never from
build/registry) and must reproduce the oracle (kvgen.reference) byte for byte.

Run by scripts/wheel_proof.sh, which installs the wheel with ``pip install --no-deps --target``,
sets KVGEN_WHEEL_TARGET to that directory and takes nvcc off PATH.

Grid: qwen3-8b (GQA, bf16, HND, TriAttention on) once into device memory with host index arrays
and once into pinned host memory with device index arrays (the library's two launch paths); the
custom ops captured in one CUDA graph and replayed; compaction of a three-request batch whose
moves cross pages. The all-family codec grid is test_codec_gpu.py's job; the point here is the
packaging, so the helpers below are this file's own (no build-side fixtures).
Imports go through kvgen.runtime.lookup and kvgen.runtime.codec, not kvgen.runtime, so they also work where
tests/gpu/conftest.py registers the kvgen packages bare (no pydantic).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvgen import __version__
from kvgen.runtime.codec import register_codec, register_ops
from kvgen.runtime.lookup import RuntimeRegistry, codec_from_registry

from ..conftest import SPECS_DIR

pytestmark = pytest.mark.gpu

FAMILY = "qwen3-8b"
PACKAGE = "kvgen-kernels-sm90"
TARGET = os.environ.get("KVGEN_WHEEL_TARGET")
FILL = 0xA5  # bytes no kernel writes: untouched slots and pages keep them


@pytest.fixture(scope="module")
def registry() -> RuntimeRegistry:
    """Installed wheels only: no caller paths and no $KVGEN_REGISTRY."""
    found = RuntimeRegistry.default(environ={})
    if not any(source.package == PACKAGE for source in found.sources):
        pytest.skip(f"{PACKAGE} is not installed; run: bash scripts/wheel_proof.sh")
    return found


@pytest.fixture(scope="module")
def oracle():
    """(spec, layout, reference codec module); the spec side needs pydantic."""
    try:
        from kvgen.lower.layout import family_layout
        from kvgen.reference import codec as reference
        from kvgen.spec.schema import load_spec
    except ImportError as exc:
        pytest.skip(f"the codec oracle needs the spec (pydantic): {exc}")
    spec = load_spec(SPECS_DIR / f"{FAMILY}.yaml")
    return spec, family_layout(spec), reference


def test_resolves_from_the_installed_wheel_without_a_compiler(registry: RuntimeRegistry) -> None:
    resolved = registry.resolve(FAMILY)                      # arch from the device
    assert resolved.arch == "sm_90a"
    assert (resolved.source.package, resolved.source.version) == (PACKAGE, __version__)
    ops = [op.op for op in resolved.entry.ops]
    assert ops == ["codec", "compact", "pack", "score", "select"], "the wheel ships every artifact of the family"
    if TARGET:
        for op in ops:
            assert resolved.artifact(op).is_relative_to(Path(TARGET)), resolved.artifact(op)
        assert shutil.which("nvcc") is None, "the proof must run without nvcc on PATH"
    assert registry.load(FAMILY).family == FAMILY


# ---------------------------------------------------------------- codec helpers


def hot_pools(spec, layout, pages: int, gen: torch.Generator, dtype: torch.dtype) -> list[list[torch.Tensor]]:
    """Per layer: a pool per quantized buffer, then per side buffer, [pages, ...] on the GPU."""
    pools = []
    for _ in range(spec.layers):
        layer = []
        for b in layout.record.buffers:
            x = torch.randn(pages, b.rows, b.row_dim, generator=gen) * 3
            x[:, :, 5] *= 50                                  # an outlier channel
            layer.append(x.to(dtype).cuda())
        for s in layout.record.sides:
            layer.append(torch.randint(0, 256, (pages, s.bytes), generator=gen, dtype=torch.uint8).cuda())
        pools.append(layer)
    return pools


def _split(layout, layer_pools: list[torch.Tensor], index: torch.Tensor):
    nq = len(layout.record.buffers)
    buffers = {b.name: layer_pools[i][index] for i, b in enumerate(layout.record.buffers)}
    sides = {s.name: layer_pools[nq + i][index] for i, s in enumerate(layout.record.sides)}
    return buffers, sides


def expected_cold(reference, layout, pools, lifecycle: int, pairs: torch.Tensor, slots: int) -> torch.Tensor:
    lc = layout.lifecycles[lifecycle]
    cold = torch.full((slots, lc.cold_page_bytes), FILL, dtype=torch.uint8, device="cuda")
    src, dst = pairs[:, 1].long().cuda(), pairs[:, 0].long().cuda()
    for j, layer in enumerate(lc.layers):
        cold[dst, j * lc.record_bytes:(j + 1) * lc.record_bytes] = reference.encode_records(
            layout.record, *_split(layout, pools[layer], src))
    return cold


def check_decoded(reference, layout, lifecycle: int, dtype: str, out_pools, cold, dpairs) -> None:
    """Decoded pages equal the oracle's decode of the same bytes; every other page is untouched."""
    lc = layout.lifecycles[lifecycle]
    dst, src = dpairs[:, 0].long().cuda(), dpairs[:, 1].long().cuda()
    untouched = torch.ones(out_pools[0][0].shape[0], dtype=torch.bool, device="cuda")
    untouched[dst] = False
    for j, layer in enumerate(lc.layers):
        recs = cold[src, j * lc.record_bytes:(j + 1) * lc.record_bytes]
        buffers, sides = reference.decode_records(layout.record, recs, dtype)
        for pool, want in zip(out_pools[layer], [*buffers.values(), *sides.values()]):
            raw = pool.view(torch.uint8).reshape(pool.shape[0], -1)
            assert torch.equal(raw[dst], want.contiguous().view(torch.uint8).reshape(dst.numel(), -1)), layer
            assert bool((raw[untouched] == FILL).all()), layer


def filled_like(pool: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(pool)
    out.view(torch.uint8).fill_(FILL)
    return out


def cold_storage(slots: int, page_bytes: int, where: str) -> torch.Tensor:
    cold = torch.full((slots, page_bytes), FILL, dtype=torch.uint8)
    return cold.cuda() if where == "device" else cold.pin_memory()


def page_pairs(n: int, pages: int, slots: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Encode pairs (dst slot, src page; one page into several slots) and decode pairs reading
    back some of those slots into distinct hot pages."""
    src = torch.randint(0, pages, (n,), generator=gen)
    src[: n // 4] = src[0]
    dst = torch.randperm(slots, generator=gen)[:n]
    hot_dst = torch.randperm(pages, generator=gen)[: min(n, pages)]
    encode = torch.stack([dst, src], dim=1).to(torch.int32)
    decode = torch.stack([hot_dst, dst[: hot_dst.numel()]], dim=1).to(torch.int32)
    return encode, decode


# ---------------------------------------------------------------- codec


def _index(pairs: torch.Tensor, index_location: str) -> torch.Tensor:
    return pairs.cuda() if index_location == "device" else pairs


@pytest.mark.parametrize("where, index_location", [("device", "host"), ("pinned", "device")])
def test_codec_from_the_wheel_matches_the_oracle(registry: RuntimeRegistry, oracle, where: str,
                                                 index_location: str) -> None:
    spec, layout, reference = oracle
    manifest_layout = registry.resolve(FAMILY).layout()
    gen = torch.Generator().manual_seed(20260901)
    n, pages, slots = 40, 24, 47
    pools = hot_pools(spec, layout, pages, gen, reference.HOT_TORCH_DTYPES[spec.dtype])
    codec = codec_from_registry(registry, FAMILY, pools, index_location=index_location)
    for lifecycle, lc in enumerate(layout.lifecycles):
        assert codec.cold_page_bytes(lifecycle) == lc.cold_page_bytes == manifest_layout.cold_page_bytes(lifecycle)
        pairs, dpairs = page_pairs(n, pages, slots, gen)
        cold = cold_storage(slots, lc.cold_page_bytes, where)
        codec.encode(cold, _index(pairs, index_location), lifecycle)
        torch.cuda.synchronize()
        want = expected_cold(reference, layout, pools, lifecycle, pairs, slots)
        assert torch.equal(cold.cuda(), want), f"lifecycle {lifecycle}: encoded bytes differ from the oracle"

        out_pools = [[filled_like(p) for p in layer] for layer in pools]
        out = codec_from_registry(registry, FAMILY, out_pools, index_location=index_location)
        src_cold = cold_storage(slots, lc.cold_page_bytes, where)
        src_cold.copy_(want)
        out.decode(src_cold, _index(dpairs, index_location), lifecycle)
        torch.cuda.synchronize()
        check_decoded(reference, layout, lifecycle, spec.dtype, out_pools, want, dpairs)
        out.close()
    codec.close()


def test_custom_ops_replay_in_a_cuda_graph(registry: RuntimeRegistry, oracle) -> None:
    """kvgen::cold_encode then kvgen::cold_decode captured once: nothing runs until replay."""
    spec, layout, reference = oracle
    gen = torch.Generator().manual_seed(7)
    n, pages, slots = 32, 20, 40
    pools = hot_pools(spec, layout, pages, gen, reference.HOT_TORCH_DTYPES[spec.dtype])
    out_pools = [[filled_like(p) for p in layer] for layer in pools]
    codec = codec_from_registry(registry, FAMILY, pools, index_location="device")
    out = codec_from_registry(registry, FAMILY, out_pools, index_location="device")
    register_ops()
    pairs, dpairs = page_pairs(n, pages, slots, gen)
    cold = torch.full((slots, layout.lifecycles[0].cold_page_bytes), FILL, dtype=torch.uint8, device="cuda")
    ids = (register_codec(codec), register_codec(out))
    # device index arrays must outlive every replay: the graph holds their addresses, not them
    pairs_dev, dpairs_dev = pairs.cuda(), dpairs.cuda()
    graph = _capture(ids, cold, pairs_dev, dpairs_dev, pools, out_pools)
    torch.cuda.synchronize()
    assert bool((cold == FILL).all()), "capturing must not run the kernels"
    graph.replay()
    torch.cuda.synchronize()
    want = expected_cold(reference, layout, pools, 0, pairs, slots)
    assert torch.equal(cold, want)
    check_decoded(reference, layout, 0, spec.dtype, out_pools, want, dpairs)
    codec.close()
    out.close()


def _capture(ids, cold, pairs, dpairs, pools, out_pools) -> torch.cuda.CUDAGraph:  # noqa: ANN001
    hot = [t for layer in pools for t in layer]
    out_hot = [t for layer in out_pools for t in layer]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        torch.ops.kvgen.cold_encode(ids[0], cold, pairs, 0, hot)
        torch.ops.kvgen.cold_decode(ids[1], cold, dpairs, 0, out_hot)
    return graph


# ---------------------------------------------------------------- compaction


def test_compaction_from_the_wheel_matches_the_oracle(registry: RuntimeRegistry) -> None:
    resolved = registry.resolve(FAMILY)
    if resolved.op("compact") is None:
        pytest.skip(f"{FAMILY}'s manifest lists no compact op")
    try:
        from kvgen.reference.triattention import compact_paged, pack_moves
        from kvgen.runtime.compact import CompactLibrary, Compactor

        from ..move_cases import geometry, random_batch, random_page_table, random_pools
    except ImportError as exc:
        pytest.skip(f"compaction runtime not available: {exc}")
    library = CompactLibrary(resolved.artifact("compact"))       # verified against the manifest
    info = library.info
    geo = geometry(info["num_layers"], info["kv_heads"], head_dim=info["head_dim"],
                   tokens_per_block=info["tokens_per_block"], layout=info["layout"])
    tpb = geo.tokens_per_block
    batch = random_batch(geo, "per_head", 24, batch=3, seed=11, max_prompt=2 * tpb, max_extra=tpb, max_tail=tpb)
    moves = pack_moves(*batch.args(), geo, batch.max_requests)
    table, num_pages = random_page_table(batch.lengths, tpb, batch.max_requests, seed=11)
    k_pools, v_pools = random_pools(geo, num_pages, {2: "bf16", 1: "fp8_e4m3"}[info["elem_bytes"]], seed=11)
    k_gpu, v_gpu = [p.cuda() for p in k_pools], [p.cuda() for p in v_pools]
    compact_paged(k_pools, v_pools, table, moves, geo)          # the oracle, on the CPU copies
    Compactor(library, k_gpu, v_gpu)(table.cuda(), moves.src.cuda(), moves.dst.cuda(), moves.offsets.cuda())
    torch.cuda.synchronize()
    for layer in range(geo.num_layers):
        assert torch.equal(k_gpu[layer].cpu().view(torch.uint8), k_pools[layer].view(torch.uint8)), f"K {layer}"
        assert torch.equal(v_gpu[layer].cpu().view(torch.uint8), v_pools[layer].view(torch.uint8)), f"V {layer}"


# ---------------------------------------------------------------- an eviction round from the wheel alone

RUNTIME_SIDE = ("__init__.py", "arch.py", "files.py", "paths.py", "artifacts", "kernels", "reference", "runtime")


def test_eviction_round_from_the_wheel_alone(tmp_path: Path) -> None:
    """Score -> select -> pack -> compact with every kernel from the installed wheel, in a child
    process holding only kvgen's run-time side, ``tri_sim`` and the wheel (tests/gpu/wheel_eviction.py
    says what is blocked); byte-identical to the oracle's ``eviction_round`` after every step."""
    if not TARGET:
        pytest.skip("needs the wheel installed by scripts/wheel_proof.sh (KVGEN_WHEEL_TARGET)")
    root = Path(__file__).resolve().parents[2]
    site = tmp_path / "site"
    for name in RUNTIME_SIDE:
        source = root / "kvgen" / name
        if source.is_dir():
            shutil.copytree(source, site / "kvgen" / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            (site / "kvgen").mkdir(parents=True, exist_ok=True)
            shutil.copy(source, site / "kvgen" / name)
    for script in (root / "tests" / "tri_sim.py", Path(__file__).with_name("wheel_eviction.py")):
        shutil.copy(script, site / script.name)
    empty = tmp_path / "cwd"
    empty.mkdir()
    environ = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "KVGEN_REGISTRY")}
    environ["PYTHONPATH"] = os.pathsep.join([str(site), TARGET])
    proc = subprocess.run([sys.executable, str(site / "wheel_eviction.py")], cwd=empty, env=environ,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    record = json.loads(proc.stdout.strip().splitlines()[-1])
    assert record["byte_identical"] and record["rounds"] >= 3
    assert record["score_library"].startswith(TARGET), record
    assert set(record["kvgen_packages_loaded"]) <= {"arch", "files", "paths", "artifacts", "kernels", "reference",
                                                     "runtime"}, record
    if (out := os.environ.get("OUT")):
        Path(out, "wheel_eviction.json").write_text(json.dumps(record, indent=2) + "\n")
