"""Bad indices on the GPU (issue 15): nothing outside the given memory is touched, the errors are clear.

Codec (qwen3-8b, bit-exact against the oracle for the good pairs): host pairs with src 100000,
dst 100000 or src -5 fail before anything is enqueued; device pairs with the same values are
skipped by the kernels, every good pair still lands, no other slot or page changes, and the next
call (or ``check_device_errors``) raises. A closed codec raises, through the torch ops too.
Compaction (qwen3-8b's library, bit-exact against the oracle on the moves that remain): device
moves with src 100000, dst -5, src -5 and a page table entry past the pools are skipped, the rest
made. After all of it the CUDA context still works.

``bash scripts/device_check.sh sanitize-bad`` runs this file under compute-sanitizer: the goal is
"ERROR SUMMARY: 0 errors" (no kernel touched memory it was not given).
"""

from __future__ import annotations

import pytest
import torch

from kvgen.reference.codec import decode_records
from kvgen.reference.triattention import compact_paged, pack_moves
from kvgen.runtime import ColdPageCodec, FamilyLibrary, LibraryError, cold_encode, register_codec
from kvgen.runtime.compact import Compactor
from tests.move_cases import corrupt_moves, geometry, random_batch, random_page_table, random_pools

from .conftest import library_path, spec_and_layout
from .test_codec_gpu import FILL, cold_storage, expected_cold, filled_like, hot_pools

pytestmark = pytest.mark.gpu

FAMILY = "qwen3-8b"
PAGES, SLOTS = 8, 6
BAD_VALUES = [(1, 100000), (0, 100000), (1, -5), (0, -5)]  # (column: 0 dst, 1 src; value)


@pytest.fixture(scope="module")
def setup():
    spec, layout = spec_and_layout(FAMILY)
    library = FamilyLibrary(library_path(FAMILY), FAMILY)
    pools = hot_pools(spec, layout, PAGES, torch.Generator().manual_seed(15))
    return spec, layout, library, pools


def _with_bad(good: list[list[int]], column: int, value: int) -> torch.Tensor:
    """The good pairs with one bad pair in the middle."""
    bad = [0, 0]
    bad[column] = value
    rows = good[:1] + [bad] + good[1:]
    return torch.tensor(rows, dtype=torch.int32)


GOOD_ENCODE = [[0, 3], [2, 5], [5, 0]]  # (cold slot, hot page)
GOOD_DECODE = [[1, 0], [6, 2], [4, 5]]  # (hot page, cold slot)


@pytest.mark.parametrize("column, value", BAD_VALUES)
def test_bad_host_pairs_fail_before_anything_is_enqueued(setup, column, value):
    spec, layout, library, pools = setup
    codec = ColdPageCodec(library, layout, pools, index_location="host")
    lc = layout.lifecycles[0]
    cold = cold_storage(SLOTS, lc.cold_page_bytes, "device")
    pairs = _with_bad(GOOD_ENCODE, column, value)
    what = "src" if column else "dst"
    with pytest.raises(LibraryError, match=f"pair 1: {what} {value} is not a (hot page|cold slot)"):
        codec.encode(cold, pairs)
    out_pools = [[filled_like(p) for p in layer] for layer in pools]
    decoder = ColdPageCodec(library, layout, out_pools, index_location="host")
    with pytest.raises(LibraryError, match=f"pair 1: {what} {value} is not a (hot page|cold slot)"):
        decoder.decode(cold, _with_bad(GOOD_DECODE, column, value))
    torch.cuda.synchronize()
    assert bool((cold == FILL).all()), "a refused call wrote cold slots"
    assert all(bool((p.view(torch.uint8) == FILL).all()) for layer in out_pools for p in layer)
    codec.encode(cold, torch.tensor(GOOD_ENCODE, dtype=torch.int32))  # the context is fine
    torch.cuda.synchronize()
    codec.close()
    decoder.close()


def test_bad_device_pairs_are_skipped_and_reported(setup):
    spec, layout, library, pools = setup
    lc = layout.lifecycles[0]
    codec = ColdPageCodec(library, layout, pools, index_location="device")
    good = torch.tensor(GOOD_ENCODE, dtype=torch.int32)
    pairs = torch.cat([good[:1], torch.tensor([[0, 100000], [100000, 1], [0, -5], [-5, 2]], dtype=torch.int32),
                       good[1:]]).cuda()
    cold = cold_storage(SLOTS, lc.cold_page_bytes, "device")
    codec.encode(cold, pairs)
    torch.cuda.synchronize()
    # good pairs encoded exactly, every other slot untouched (expected_cold fills the others with FILL)
    assert torch.equal(cold, expected_cold(layout, pools, 0, good, SLOTS))
    with pytest.raises(LibraryError, match="encode: src is not a hot page of the lifecycle's pools .*"
                                           "encode: dst is not a slot of the cold buffer"):
        codec.check_device_errors()
    codec.check_device_errors()  # reported once, then cleared

    # the next call reports an earlier launch's skipped pairs, enqueues nothing; the one after runs
    codec.encode(cold, pairs)
    torch.cuda.synchronize()
    with pytest.raises(LibraryError, match="a kernel skipped out-of-range device indices"):
        codec.encode(cold, good.cuda())
    codec.encode(cold, good.cuda())
    torch.cuda.synchronize()

    out_pools = [[filled_like(p) for p in layer] for layer in pools]
    decoder = ColdPageCodec(library, layout, out_pools, index_location="device")
    good_dec = torch.tensor(GOOD_DECODE, dtype=torch.int32)
    bad_dec = torch.tensor([[100000, 0], [-5, 1], [3, 100000], [3, -5]], dtype=torch.int32)
    decoder.decode(cold, torch.cat([bad_dec[:2], good_dec, bad_dec[2:]]).cuda())
    torch.cuda.synchronize()
    with pytest.raises(LibraryError, match="decode: src is not a slot of the cold buffer .*"
                                           "decode: dst is not a hot page"):
        decoder.check_device_errors()
    # decoded pages equal the oracle; every other page (page 3 above included) keeps FILL
    dst, src = good_dec[:, 0].long().cuda(), good_dec[:, 1].long().cuda()
    untouched = torch.ones(PAGES, dtype=torch.bool, device="cuda")
    untouched[dst] = False
    for j, layer in enumerate(lc.layers):
        buffers, sides = decode_records(layout.record, cold[src, j * lc.record_bytes:(j + 1) * lc.record_bytes],
                                        spec.dtype)
        for pool, want in zip(out_pools[layer], list(buffers.values()) + list(sides.values())):
            raw = pool.view(torch.uint8).reshape(PAGES, -1)
            assert torch.equal(raw[dst], want.contiguous().view(torch.uint8).reshape(dst.numel(), -1))
            assert bool((raw[untouched] == FILL).all())
    codec.close()
    decoder.close()


def test_closed_codec_raises(setup):
    spec, layout, library, pools = setup
    codec = ColdPageCodec(library, layout, pools)
    codec_id = register_codec(codec)
    codec.close()
    cold = cold_storage(SLOTS, layout.lifecycles[0].cold_page_bytes, "device")
    pairs = torch.tensor(GOOD_ENCODE, dtype=torch.int32)
    for call in (lambda: codec.encode(cold, pairs), lambda: codec.decode(cold, pairs),
                 lambda: cold_encode(codec_id, cold, pairs), codec.check_device_errors):
        with pytest.raises(LibraryError, match="codec is closed"):
            call()


def test_pool_and_cold_mismatches_are_clear_errors(setup):
    spec, layout, library, pools = setup
    with pytest.raises(ValueError, match="pages of 65536 bytes expected"):
        ColdPageCodec(library, layout, [[p[:, :128] for p in layer] for layer in pools])
    with pytest.raises(ValueError, match="dtype float16|hot dtype"):
        ColdPageCodec(library, layout, [[p.view(torch.int16) for p in layer] for layer in pools])
    codec = ColdPageCodec(library, layout, pools)
    lc = layout.lifecycles[0]
    with pytest.raises(ValueError, match="not a multiple of the cold page size"):
        codec.encode(torch.zeros(lc.cold_page_bytes + 16, dtype=torch.uint8, device="cuda"),
                     torch.tensor(GOOD_ENCODE, dtype=torch.int32))
    with pytest.raises(ValueError, match="lifecycle: 3"):
        codec.encode(cold_storage(SLOTS, lc.cold_page_bytes, "device"), torch.tensor(GOOD_ENCODE, dtype=torch.int32), 3)
    codec.close()


def test_bad_device_moves_are_skipped_and_reported():
    compactor_lib = library_path(FAMILY)  # the family library holds the compaction too
    spec, _ = spec_and_layout(FAMILY)
    geo = geometry(spec.layers, spec.kv_heads, None, spec.head_dim, spec.tokens_per_block, spec.layout)
    batch = random_batch(geo, "union", 40, batch=3, seed=15, max_prompt=2 * spec.tokens_per_block,
                         max_extra=spec.tokens_per_block)
    moves = pack_moves(*batch.args(), geo, batch.max_requests)
    table, num_pages = random_page_table(batch.lengths, geo.tokens_per_block, batch.max_requests, 15)
    k_pools, v_pools = random_pools(geo, num_pages, spec.dtype, 15)
    bad_moves, bad_table, kept_moves = corrupt_moves(moves, table, geo.tokens_per_block)
    k_ref, v_ref = [p.clone() for p in k_pools], [p.clone() for p in v_pools]
    compact_paged(k_ref, v_ref, table, kept_moves, geo)
    k_gpu, v_gpu = [p.cuda() for p in k_pools], [p.cuda() for p in v_pools]
    compactor = Compactor(compactor_lib, k_gpu, v_gpu)
    compactor(bad_table.cuda(), bad_moves.src.cuda(), bad_moves.dst.cuda(), bad_moves.offsets.cuda())
    torch.cuda.synchronize()
    with pytest.raises(LibraryError, match="compaction: src or dst token is outside the page table row .*"
                                           "compaction: the page table maps a moved token to a page outside"):
        compactor.check_device_errors()
    for layer in range(geo.num_layers):
        assert torch.equal(k_gpu[layer].cpu().view(torch.uint8), k_ref[layer].view(torch.uint8)), f"K {layer}"
        assert torch.equal(v_gpu[layer].cpu().view(torch.uint8), v_ref[layer].view(torch.uint8)), f"V {layer}"
    compactor.check_device_errors()  # cleared
    torch.cuda.synchronize()
