"""Generated codec on the GPU against the oracle: encoded cold pages and decoded hot pages must be
byte-identical (COLD_PAGE_FORMAT.md §4), for every shipped family, into device memory and into
mapped pinned host memory, with host and device index arrays.

Grid choices: every family runs with a few dozen page pairs (scattered sources, one hot page
encoded into several slots, garbage in unused rows); qwen3-8b additionally runs 300 pairs, so a
host index array is split over two launches (256 pairs each at most). Decode CTAs of 2 and 4 pairs
(decode_pages) also decode 23 pairs (a short last CTA), 259 host pairs (launches of 256 and 3) and
device pairs with out-of-range ones inside a CTA.
"""

from __future__ import annotations

import os
import zlib

import pytest
import torch

from kvgen.lower.layout import FamilyLayout
from kvgen.reference.codec import HOT_TORCH_DTYPES, decode_records, encode_records
from kvgen.runtime import ColdPageCodec, FamilyLibrary, LibraryError

from ..conftest import SPECS_DIR
from .conftest import library_path, spec_and_layout

pytestmark = pytest.mark.gpu

FAMILIES = sorted(p.stem for p in SPECS_DIR.glob("*.yaml"))
FILL = 0xA5  # bytes no kernel writes: untouched slots and pages must keep them


def token_of_row(spec, rows: int) -> torch.Tensor:
    """Token index of each row of a quantized buffer page (for partially filled pages)."""
    r = torch.arange(rows)
    if spec.attention == "csa":
        return r * 4
    if spec.layout == "NHD":
        return r // spec.kv_heads
    return r % spec.tokens_per_block


def hot_pools(spec, layout: FamilyLayout, pages: int, gen: torch.Generator) -> list[list[torch.Tensor]]:
    """Per layer: one pool per quantized buffer then per side buffer, [pages, ...] on the GPU.

    Values have an outlier channel, zero blocks, and NaN/Inf/huge garbage in the rows of tokens
    past each page's fill level (a partially filled page)."""
    dtype = HOT_TORCH_DTYPES[spec.dtype]
    pools = []
    for _ in range(spec.layers):
        layer = []
        for b in layout.record.buffers:
            x = torch.randn(pages, b.rows, b.row_dim, generator=gen) * 3
            x[:, :, 5] *= 50
            x[:, 0, :32] = 0
            fill = torch.randint(1, spec.tokens_per_block + 1, (pages, 1), generator=gen)
            garbage = token_of_row(spec, b.rows)[None, :] >= fill
            junk = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e30])
            x[garbage] = junk[torch.randint(0, 4, (int(garbage.sum()), b.row_dim), generator=gen)]
            if spec.dtype == "fp8_e4m3":
                x = torch.where(x.isfinite(), x.clamp(-448, 448), x)
            layer.append(x.to(dtype).cuda())
        for s in layout.record.sides:
            layer.append(torch.randint(0, 256, (pages, s.bytes), generator=gen, dtype=torch.uint8).cuda())
        pools.append(layer)
    return pools


def split_pools(layout: FamilyLayout, layer_pools: list[torch.Tensor], index: torch.Tensor):
    nq = len(layout.record.buffers)
    buffers = {b.name: layer_pools[i][index] for i, b in enumerate(layout.record.buffers)}
    sides = {s.name: layer_pools[nq + i][index] for i, s in enumerate(layout.record.sides)}
    return buffers, sides


def expected_cold(layout, pools, lifecycle, pairs, slots) -> torch.Tensor:
    lc = layout.lifecycles[lifecycle]
    cold = torch.full((slots, lc.cold_page_bytes), FILL, dtype=torch.uint8, device="cuda")
    src, dst = pairs[:, 1].long().cuda(), pairs[:, 0].long().cuda()
    for j, layer in enumerate(lc.layers):
        recs = encode_records(layout.record, *split_pools(layout, pools[layer], src))
        cold[dst, j * lc.record_bytes : (j + 1) * lc.record_bytes] = recs
    return cold


def describe_mismatch(layout: FamilyLayout, lifecycle: int, got: torch.Tensor, want: torch.Tensor) -> str:
    """Where encoded bytes differ: count, and the first few as (slot, layer, region, offset, got, want)."""
    lc = layout.lifecycles[lifecycle]
    bad = (got != want).nonzero()
    lines = [f"lifecycle {lifecycle}: {bad.shape[0]} bytes differ"]
    for slot, col in bad[:8].tolist():
        j, off = divmod(col, lc.record_bytes)
        region = next((r for r in layout.record.regions if r.offset <= off < r.offset + r.size), None)
        where = f"{region.buffer}.{region.kind}+{off - region.offset}" if region else "?"
        lines.append(f"slot {slot} layer {lc.layers[j]} {where}: got {got[slot, col].item()} "
                     f"want {want[slot, col].item()}")
    return "\n".join(lines)


def cold_storage(slots: int, page_bytes: int, where: str) -> torch.Tensor:
    cold = torch.full((slots, page_bytes), FILL, dtype=torch.uint8)
    return cold.cuda() if where == "device" else cold.pin_memory()


def encode_pairs(n: int, pages: int, slots: int, gen: torch.Generator) -> torch.Tensor:
    src = torch.randint(0, pages, (n,), generator=gen)
    src[: n // 4] = src[0]  # one hot page into several slots
    dst = torch.randperm(slots, generator=gen)[:n]
    return torch.stack([dst, src], dim=1).to(torch.int32)


CASES = [(f, "device", "host", 40) for f in FAMILIES] + [
    (f, "pinned", "host", 24) for f in FAMILIES] + [
    ("qwen3-8b", "device", "host", 300), ("qwen3-8b", "pinned", "device", 300), ("glm-5", "device", "device", 40)]


@pytest.mark.parametrize("family, where, index_location, n", CASES)
def test_encode_decode_bit_exact(family, where, index_location, n):
    roundtrip(FamilyLibrary(library_path(family), family), family, where, index_location, n)


def _variant_id(variant: dict) -> str:
    return ",".join(f"{k}={x}" for k, x in variant.items())


# Decode CTAs of several pairs, the next record loading while one decodes, by cp.async and by the bulk copy.
PAGED = [{"decode_load": load, "decode_pages": pages} for load in (1, 2) for pages in (2, 4)]
# Each value of the codec tunables that change the arithmetic or the register budget, the others at
# their defaults (scripts/codec_variants_bundle.py builds the same set for timing).
VARIANTS = [{"decode_route": 0}, {"decode_route": 1}, {"rounding": 0}, {"rounding": 1},
            *({"threads": 512, "min_blocks": m} for m in (1, 2, 3, 4)), {"threads": 256, "min_blocks": 4},
            {"hot_batch": 2}, {"hot_batch": 4}, {"hot_batch": 4, "threads": 64}, {"rounding": 2},
            {"decode_split": 2}, {"decode_split": 2, "threads": 64},  # rounding 3 is the default
            {"decode_load": 1}, {"decode_load": 2}, {"decode_load": 2, "threads": 64},
            {"encode_store": 1}, {"encode_store": 1, "threads": 64}, *PAGED]
VARIANT_FAMILIES = ["qwen3-8b", "mistral-7b", "qwen3-8b-fp8", "deepseek-v4-csa"]


@pytest.fixture(scope="module")
def variant_libraries(tmp_path_factory):
    """Every (family, variant) library, built here with nvcc (skipped without one)."""
    from kvgen.build.job import load_spec_source
    from kvgen.build.nvcc import ToolchainError
    from kvgen.cli import discover_toolchains
    from kvgen.lower.plan import default_params
    from kvgen.tuning.candidates import Request, build_candidates

    try:
        toolchains = discover_toolchains()
    except ToolchainError as exc:
        pytest.skip(f"no nvcc on this GPU machine: {exc}")
    out = tmp_path_factory.mktemp("codec-variants")
    requests = [Request(load_spec_source(SPECS_DIR / f"{f}.yaml"), "codec", {**default_params("codec"), **v})
                for f in VARIANT_FAMILIES for v in VARIANTS]
    built = build_candidates(requests, "sm_90a", out / "bundle", out / "cache", toolchains=toolchains,
                             jobs=max(2, (os.cpu_count() or 2) // 2))
    return {(c.family, c.config): out / "bundle" / c.artifact for c in built if c.status != "failed"}


def variant_library(variant_libraries, family: str, variant: dict) -> FamilyLibrary:
    """The library of ``family`` built with ``variant`` (the other tunables at their defaults)."""
    from kvgen.lower.plan import default_params
    from kvgen.tuning.space import config_id

    path = variant_libraries.get((family, config_id("codec", {**default_params("codec"), **variant})))
    assert path is not None, f"{family} {variant}: build failed"
    return FamilyLibrary(path, family)


@pytest.mark.parametrize("variant", VARIANTS, ids=_variant_id)
@pytest.mark.parametrize("family", VARIANT_FAMILIES)
def test_codec_variants_bit_exact(variant_libraries, family, variant):
    """Every value of decode_route / rounding / min_blocks / hot_batch / decode_split / decode_load /
    encode_store / decode_pages writes the oracle's bytes, both ways."""
    roundtrip(variant_library(variant_libraries, family, variant), family, "device", "device", 40)


@pytest.mark.parametrize("family", VARIANT_FAMILIES)
def test_bulk_record_load_reads_pinned_slots_through_cp_async(variant_libraries, family):
    """decode_load 2 issues its bulk copy only for device-memory slots; mapped pinned slots take the
    cp.async route (the launcher asks where they are) and decode the oracle's bytes all the same."""
    roundtrip(variant_library(variant_libraries, family, {"decode_load": 2}), family, "pinned", "host", 24)


# 46 pairs decode 23 pages (roundtrip decodes min(n, n // 2) pairs): the last CTA takes fewer pairs
# than decode_pages; device and pinned slots (the bulk route reads pinned ones by cp.async), host and
# device indices.
@pytest.mark.parametrize("where, index_location", [("device", "host"), ("device", "device"), ("pinned", "device")])
@pytest.mark.parametrize("variant", PAGED, ids=_variant_id)
@pytest.mark.parametrize("family", VARIANT_FAMILIES)
def test_paged_decode_with_a_short_last_cta_is_bit_exact(variant_libraries, family, variant, where, index_location):
    roundtrip(variant_library(variant_libraries, family, variant), family, where, index_location, 46)


@pytest.mark.parametrize("variant", PAGED, ids=_variant_id)
def test_paged_decode_of_more_host_pairs_than_one_launch_takes(variant_libraries, variant):
    """518 pairs decode 259 pages: two host launches of 256 and 3 pairs."""
    roundtrip(variant_library(variant_libraries, "qwen3-8b", variant), "qwen3-8b", "device", "host", 518)


@pytest.mark.parametrize("variant", PAGED, ids=_variant_id)
@pytest.mark.parametrize("family", VARIANT_FAMILIES)
def test_paged_decode_skips_out_of_range_pairs_inside_a_cta(variant_libraries, family, variant):
    """Device pairs 5 (a cold slot past the buffer) and 8 (a hot page past the pools) sit inside and at
    the head of a CTA's pages (2 or 4 a CTA; 11 pairs, so the last CTA is short): both are skipped and
    reported, every other pair of their CTAs decodes the oracle's bytes (the cp.async groups and the
    bulk copy's barrier phases stay in step), and no other page changes (page 3, only a bad pair's dst,
    keeps its fill)."""
    spec, layout = spec_and_layout(family)
    library = variant_library(variant_libraries, family, variant)
    gen = torch.Generator().manual_seed(zlib.crc32(f"paged-bad-{family}-{_variant_id(variant)}".encode()))
    pages, slots = 16, 12
    pools = hot_pools(spec, layout, pages, gen)
    dst = torch.tensor([p for p in torch.randperm(pages, generator=gen).tolist() if p != 3][:9])
    good = torch.stack([dst, torch.randperm(slots, generator=gen)[:9]], dim=1).to(torch.int32)
    bad = torch.tensor([[3, 100000], [100000, 2]], dtype=torch.int32)
    dpairs = torch.cat([good[:5], bad[:1], good[5:7], bad[1:], good[7:]])
    out_pools = [[filled_like(p) for p in layer] for layer in pools]
    decoder = ColdPageCodec(library, layout, out_pools, index_location="device")
    for lifecycle, lc in enumerate(layout.lifecycles):
        fill = torch.stack([torch.arange(slots), torch.randint(0, pages, (slots,), generator=gen)], dim=1)
        cold = expected_cold(layout, pools, lifecycle, fill.to(torch.int32), slots)
        decoder.decode(cold, dpairs.cuda(), lifecycle)
        torch.cuda.synchronize()
        with pytest.raises(LibraryError, match="decode: src is not a slot of the cold buffer .*"
                                               "decode: dst is not a hot page"):
            decoder.check_device_errors()
        check_decoded(layout, lc, spec.dtype, out_pools, cold, good)
    decoder.close()


def roundtrip(library, family: str, where: str, index_location: str, n: int) -> None:
    """Encode n scattered pairs against the oracle's records, then decode the oracle's records into
    fresh pools against the oracle's hot pages (pages not hit keep FILL)."""
    spec, layout = spec_and_layout(family)
    gen = torch.Generator().manual_seed(zlib.crc32(f"{family}-{where}-{index_location}-{n}".encode()))
    pages = max(8, n // 2)
    slots = n + 7
    pools = hot_pools(spec, layout, pages, gen)
    codec = ColdPageCodec(library, layout, pools, index_location=index_location)
    for lifecycle, lc in enumerate(layout.lifecycles):
        assert codec.cold_page_bytes(lifecycle) == lc.cold_page_bytes
        pairs = encode_pairs(n, pages, slots, gen)
        cold = cold_storage(slots, lc.cold_page_bytes, where)
        codec.encode(cold, pairs.cuda() if index_location == "device" else pairs, lifecycle)
        torch.cuda.synchronize()
        want = expected_cold(layout, pools, lifecycle, pairs, slots)
        assert torch.equal(cold.cuda(), want), describe_mismatch(layout, lifecycle, cold.cuda(), want)

        # decode the oracle's bytes into fresh pools: pages hit must match the oracle, others untouched
        out_pools = [[filled_like(p) for p in layer] for layer in pools]
        out = ColdPageCodec(library, layout, out_pools, index_location=index_location)
        hot_dst = torch.randperm(pages, generator=gen)[: min(n, pages)]
        slot_src = pairs[: hot_dst.numel(), 0]
        dpairs = torch.stack([hot_dst.to(torch.int32), slot_src], dim=1)
        src_cold = cold_storage(slots, lc.cold_page_bytes, where)
        src_cold.copy_(want)
        out.decode(src_cold, dpairs.cuda() if index_location == "device" else dpairs, lifecycle)
        torch.cuda.synchronize()
        check_decoded(layout, lc, spec.dtype, out_pools, want, dpairs)
        out.close()
    codec.close()


def filled_like(pool: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(pool)
    out.view(torch.uint8).fill_(FILL)
    return out


def check_decoded(layout, lc, dtype: str, out_pools, cold, dpairs) -> None:
    dst, src = dpairs[:, 0].long().cuda(), dpairs[:, 1].long().cuda()
    untouched = torch.ones(out_pools[0][0].shape[0], dtype=torch.bool, device="cuda")
    untouched[dst] = False
    for j, layer in enumerate(lc.layers):
        recs = cold[src, j * lc.record_bytes : (j + 1) * lc.record_bytes]
        buffers, sides = decode_records(layout.record, recs, dtype)
        got = out_pools[layer]
        expected = list(buffers.values()) + list(sides.values())
        for pool, want in zip(got, expected):
            raw = pool.view(torch.uint8).reshape(pool.shape[0], -1)
            assert torch.equal(raw[dst], want.contiguous().view(torch.uint8).reshape(dst.numel(), -1))
            assert bool((raw[untouched] == FILL).all())


def test_bad_configure_is_a_clear_error():
    family = "qwen3-8b"
    spec, layout = spec_and_layout(family)
    library = FamilyLibrary(library_path(family), family)
    pools = hot_pools(spec, layout, 2, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="pools: qwen3-8b has 36 layers, got 35 lists of pools"):
        ColdPageCodec(library, layout, pools[:-1])
