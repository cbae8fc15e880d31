"""Staged offload/onboard (C ABI v2, ``ColdPageCodec.offload`` / ``onboard``) on the GPU: cold pages
in pinned host memory byte-identical to the oracle and to the version-1 zero-copy path, decoded
pages byte-identical to the oracle with every other page untouched; CUDA graph capture and replay;
bad staging buffers and slots refused before any launch.

Grid: qwen3-8b (bf16, HND, 36 layers) and qwen3-8b-fp8 (fp8 hot pages), the two families the
interference benchmark moves. Staging sizes: one cold page (a ring of one slot: every chunk waits
for the previous copy), three pages (two slots of one page: 40 chunks alternating) and the default
64 MiB (two slots of 25 qwen3-8b pages: the 40 pairs are two chunks). Slots both scattered (one
copy per page) and consecutive (one copy per chunk).
"""

from __future__ import annotations

import zlib

import pytest
import torch

from kvgen.runtime import ColdPageCodec, FamilyLibrary, LibraryError, cold_offload, cold_onboard, register_codec

from .conftest import library_path, spec_and_layout
from .test_codec_gpu import FILL, check_decoded, encode_pairs, expected_cold, hot_pools

pytestmark = pytest.mark.gpu

FAMILIES = ("qwen3-8b", "qwen3-8b-fp8")
STAGING_PAGES = (1, 3, None)   # None: the codec's default 64 MiB


def setup(family: str, pages: int, seed: str, index_location: str = "host"):
    spec, layout = spec_and_layout(family)
    library = FamilyLibrary(library_path(family), family)
    gen = torch.Generator().manual_seed(zlib.crc32(seed.encode()))
    pools = hot_pools(spec, layout, pages, gen)
    return spec, layout, pools, ColdPageCodec(library, layout, pools, index_location=index_location), gen


def pinned_cold(slots: int, page_bytes: int) -> torch.Tensor:
    return torch.full((slots, page_bytes), FILL, dtype=torch.uint8).pin_memory()


def refill(pools) -> None:
    for layer in pools:
        for pool in layer:
            pool.view(torch.uint8).fill_(FILL)


def staging_arg(pages: int | None, page_bytes: int):
    return None if pages is None else pages * page_bytes + 16 * (pages > 1)   # a remainder short of a page


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("staging_pages", STAGING_PAGES)
@pytest.mark.parametrize("consecutive", [False, True])
def test_staged_is_byte_identical_to_zero_copy_and_the_oracle(family, staging_pages, consecutive):
    n, pages, slots = 40, 24, 47
    spec, layout, pools, codec, gen = setup(family, pages, f"{family}-{staging_pages}-{consecutive}")
    lc = layout.lifecycles[0]
    assert codec.offload_strategy == "staged"
    codec.set_staging(staging_arg(staging_pages, lc.cold_page_bytes))
    pairs = encode_pairs(n, pages, slots, gen)
    if consecutive:
        pairs[:, 0] = torch.arange(3, 3 + n, dtype=torch.int32)
    want = expected_cold(layout, pools, 0, pairs, slots)
    staged, zero_copy = pinned_cold(slots, lc.cold_page_bytes), pinned_cold(slots, lc.cold_page_bytes)
    codec.offload(staged, pairs)
    codec.offload(zero_copy, pairs, strategy="zero-copy")
    torch.cuda.synchronize()
    assert torch.equal(staged.cuda(), want)
    assert torch.equal(zero_copy, staged)

    hot_dst = torch.randperm(pages, generator=gen)[: pages - 4].to(torch.int32)   # 4 pages stay untouched
    dpairs = torch.stack([hot_dst, pairs[: pages - 4, 0]], dim=1)
    for strategy in ("staged", "zero-copy"):
        refill(pools)
        codec.onboard(staged, dpairs, strategy=strategy)
        torch.cuda.synchronize()
        check_decoded(layout, lc, spec.dtype, pools, want, dpairs)
    assert codec.describe_offload()["staging_bytes"] == (64 << 20 if staging_pages is None
                                                         else staging_arg(staging_pages, lc.cold_page_bytes))
    codec.close()


@pytest.mark.parametrize("family", FAMILIES)
def test_staged_captures_in_a_cuda_graph_and_replays(family):
    n, pages, slots = 12, 12, 20
    spec, layout, pools, codec, gen = setup(family, pages, f"graph-{family}")
    lc = layout.lifecycles[0]
    codec.set_staging(2 * lc.cold_page_bytes)      # 2 slots of one page: 12 chunks, events reused
    pairs = encode_pairs(n, pages, slots, gen)
    want = expected_cold(layout, pools, 0, pairs, slots)
    cold = pinned_cold(slots, lc.cold_page_bytes)
    dpairs = torch.stack([torch.randperm(pages, generator=gen).to(torch.int32), pairs[:, 0]], dim=1)
    saved = [[p.clone() for p in layer] for layer in pools]
    stream = torch.cuda.Stream()
    offload_graph, onboard_graph = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(offload_graph, stream=stream):
        codec.offload(cold, pairs)
    with torch.cuda.graph(onboard_graph, stream=stream):
        codec.onboard(cold, dpairs)
    for _ in range(2):    # replay twice: the second run starts from FILL again
        cold.fill_(FILL)
        for layer, kept in zip(pools, saved):
            for pool, original in zip(layer, kept):
                pool.copy_(original)
        torch.cuda.synchronize()
        offload_graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(cold.cuda(), want)
        refill(pools)
        torch.cuda.synchronize()
        onboard_graph.replay()
        torch.cuda.synchronize()
        check_decoded(layout, lc, spec.dtype, pools, want, dpairs)
    codec.close()


def test_bad_staging_is_refused_before_any_launch():
    spec, layout, pools, codec, gen = setup("qwen3-8b", 4, "bad-staging")
    page = layout.lifecycles[0].cold_page_bytes
    with pytest.raises(LibraryError, match=f"smaller than one cold page \\({page} bytes\\)"):
        codec.set_staging(torch.empty(page - 16, dtype=torch.uint8, device="cuda"))
    with pytest.raises(LibraryError, match="smaller than one cold page"):
        codec.set_staging(page - 1)
    with pytest.raises(LibraryError, match="16-byte aligned"):
        codec.set_staging(torch.empty(2 * page, dtype=torch.uint8, device="cuda")[1:])
    with pytest.raises(ValueError, match="must be GPU memory"):
        codec.set_staging(torch.empty(2 * page, dtype=torch.uint8).pin_memory())
    host = torch.empty(2 * page, dtype=torch.uint8).pin_memory()     # the library's own check
    assert not codec.library.kvgen_codec_set_staging(codec._handle, host.data_ptr(), host.numel())
    assert "must be device memory" in codec.library.last_error()
    if torch.cuda.device_count() > 1:
        with pytest.raises(ValueError, match="on cuda:1"):
            codec.set_staging(torch.empty(2 * page, dtype=torch.uint8, device="cuda:1"))
    assert codec.describe_offload()["staging_bytes"] == 0     # nothing refused was taken
    codec.close()


def test_bad_slots_and_never_offloaded_slots_are_refused():
    spec, layout, pools, codec, gen = setup("qwen3-8b", 4, "bad-slots")
    page = layout.lifecycles[0].cold_page_bytes
    cold = pinned_cold(4, page)
    codec.set_staging(2 * page)
    with pytest.raises(ValueError, match="cold slot 0 of lifecycle 0 was never offloaded"):
        codec.onboard(cold, torch.tensor([[0, 0]], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"cold slot 4 outside \[0, 4\)"):
        codec.offload(cold, torch.tensor([[4, 0]], dtype=torch.int32))
    pairs = torch.tensor([[1, 0]], dtype=torch.int32)          # the library checks too, before launching
    assert not codec.library.kvgen_codec_offload(codec._handle, 0, cold.data_ptr(), 1, pairs.data_ptr(), 1, None)
    assert "cold slot 1 outside [0, 1)" in codec.library.last_error()
    with pytest.raises(ValueError, match="pinned host cold storage"):
        codec.offload(cold.cuda(), pairs)
    torch.cuda.synchronize()
    assert bool((cold == FILL).all())                          # nothing was written
    codec.offload(cold, pairs)
    codec.onboard(cold, torch.tensor([[2, 1]], dtype=torch.int32))   # slot 1 was offloaded: accepted
    torch.cuda.synchronize()
    codec.close()


def test_device_index_arrays_refuse_the_staged_path():
    spec, layout, pools, codec, gen = setup("qwen3-8b", 4, "device-index", index_location="device")
    with pytest.raises(LibraryError, match="needs host index arrays"):
        codec.set_staging()
    codec.close()


def test_custom_ops_offload_and_onboard():
    spec, layout, pools, codec, gen = setup("qwen3-8b-fp8", 6, "ops")
    lc = layout.lifecycles[0]
    pairs = encode_pairs(6, 6, 8, gen)
    want = expected_cold(layout, pools, 0, pairs, 8)
    cold = pinned_cold(8, lc.cold_page_bytes)
    codec_id = register_codec(codec)
    cold_offload(codec_id, cold, pairs)
    torch.cuda.synchronize()
    assert torch.equal(cold.cuda(), want)
    dpairs = torch.stack([torch.arange(6, dtype=torch.int32), pairs[:, 0]], dim=1)
    refill(pools)
    cold_onboard(codec_id, cold, dpairs)
    torch.cuda.synchronize()
    check_decoded(layout, lc, spec.dtype, pools, want, dpairs)
    assert codec.describe_offload()["strategy"] == "staged"
    codec.close()
