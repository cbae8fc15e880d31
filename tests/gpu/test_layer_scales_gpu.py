"""Per-layer second-level scales on the GPU: the generated codec of the test family
tests/specs/per-layer-scales.yaml (K and V per layer, K's RoPE span 2FP4, a side buffer, two
lifecycles), configured through ``ColdPageCodec(scales=load_layer_scales(file, layout))``, i.e. the C
ABI's kvgen_codec_set_layer_scales, encodes and decodes multi-layer pages with a distinct (G, Q) per
layer and buffer byte for byte like the oracle: into device and pinned memory, host and device index
arrays, and the staged offload/onboard path. Changing the scales changes the bytes accordingly;
a codec whose scales were never set refuses to encode.

The library is built on the build machine (it is not a shipped family):
  kvgen --specs tests/specs build --family per-layer-scales --arch sm_90a --registry build/device/scales/registry
and found through $KVGEN_LAYER_SCALES_REGISTRY (default: that folder).
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import pytest
import torch

from kvgen.artifacts.manifest import manifest_path, read_manifest, verify_op
from kvgen.lower.layout import family_layout
from kvgen.reference.codec import decode_records, encode_records
from kvgen.runtime import ColdPageCodec, FamilyLibrary
from kvgen.runtime.library import LibraryError, PoolExtent
from kvgen.runtime.lookup import RegistryLayout
from kvgen.runtime.scales import LayerScales, load_layer_scales

from ..conftest import ROOT
from ..layer_scales_cases import hot_pages, layer_scales, per_layer_spec, save_scales, split_layer

pytestmark = pytest.mark.gpu

REGISTRY = Path(os.environ.get("KVGEN_LAYER_SCALES_REGISTRY", ROOT / "build" / "device" / "scales" / "registry"))
FAMILY = "per-layer-scales"
FILL = 0xA5
PAGES = 24


@pytest.fixture(scope="module")
def built():
    """(library, the manifest's layout): what an engine has at run time."""
    path = manifest_path(REGISTRY, "sm_90a")
    if not path.exists():
        pytest.skip(f"no registry at {path}; run: kvgen --specs tests/specs build --family {FAMILY} --arch sm_90a "
                    f"--registry {REGISTRY}")
    manifest = read_manifest(path, verify=False)
    entry = manifest.family(FAMILY)
    return FamilyLibrary(verify_op(path, manifest, entry, "codec"), FAMILY), RegistryLayout.from_json(entry.layout)


def gpu_pools(pools: list[list[torch.Tensor]]) -> list[list[torch.Tensor]]:
    return [[p.cuda() for p in layer] for layer in pools]


def scattered_pairs(n: int, pages: int, slots: int, gen: torch.Generator) -> torch.Tensor:
    src = torch.randint(0, pages, (n,), generator=gen)
    dst = torch.randperm(slots, generator=gen)[:n]
    return torch.stack([dst, src], dim=1).to(torch.int32)


def oracle_cold(spec, pools, scales, lifecycle: int, pairs: torch.Tensor, slots: int) -> torch.Tensor:
    layout = family_layout(spec)
    lc = layout.lifecycles[lifecycle]
    cold = torch.full((slots, lc.cold_page_bytes), FILL, dtype=torch.uint8)
    src, dst = pairs[:, 1].long(), pairs[:, 0].long()
    for j, layer in enumerate(lc.layers):
        buffers, sides = split_layer(spec, pools[layer], src)
        recs = encode_records(layout.record, buffers, sides, scales.of_layer(layer))
        cold[dst, j * lc.record_bytes : (j + 1) * lc.record_bytes] = recs
    return cold


def check_decoded(spec, scales, lifecycle: int, out_pools, cold: torch.Tensor, dpairs: torch.Tensor) -> None:
    layout = family_layout(spec)
    lc = layout.lifecycles[lifecycle]
    dst, src = dpairs[:, 0].long(), dpairs[:, 1].long()
    for j, layer in enumerate(lc.layers):
        recs = cold[src, j * lc.record_bytes : (j + 1) * lc.record_bytes]
        buffers, sides = decode_records(layout.record, recs, spec.dtype, scales.of_layer(layer))
        for pool, want in zip(out_pools[layer], [*buffers.values(), *sides.values()]):
            raw = pool.cpu().view(torch.uint8).reshape(pool.shape[0], -1)
            assert torch.equal(raw[dst], want.contiguous().view(torch.uint8).reshape(dst.numel(), -1)), \
                f"lifecycle {lifecycle} layer {layer}: decode differs"


def filled_like(pool: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(pool)
    out.view(torch.uint8).fill_(FILL)
    return out


@pytest.mark.parametrize("where, index_location", [("device", "host"), ("pinned", "device"), ("device", "device")])
def test_multi_layer_pages_with_distinct_layer_scales_match_the_oracle(built, tmp_path, where, index_location):
    library, layout = built
    spec = per_layer_spec()
    scales = layer_scales(spec, seed=11)
    loaded = load_layer_scales(save_scales(tmp_path / "scales.safetensors", scales), layout)
    assert loaded.values == scales.values
    host_pools = hot_pages(spec, PAGES, seed=5)
    codec = ColdPageCodec(library, layout, gpu_pools(host_pools), index_location=index_location, scales=loaded)
    gen = torch.Generator().manual_seed(7)
    for lifecycle, lc in enumerate(layout.lifecycles):
        slots = PAGES + 5
        pairs = scattered_pairs(PAGES, PAGES, slots, gen)
        cold = torch.full((slots, lc.cold_page_bytes), FILL, dtype=torch.uint8)
        cold = cold.cuda() if where == "device" else cold.pin_memory()
        codec.encode(cold, pairs.cuda() if index_location == "device" else pairs, lifecycle)
        torch.cuda.synchronize()
        want = oracle_cold(spec, host_pools, scales, lifecycle, pairs, slots)
        got = cold.cpu()
        assert torch.equal(got, want), f"lifecycle {lifecycle}: {(got != want).sum().item()} bytes differ"

        out_pools = [[filled_like(p) for p in layer] for layer in gpu_pools(host_pools)]
        out = ColdPageCodec(library, layout, out_pools, index_location=index_location, scales=loaded)
        dpairs = torch.stack([torch.randperm(PAGES, generator=gen).to(torch.int32), pairs[:, 0]], dim=1)
        src_cold = want.cuda() if where == "device" else want.clone().pin_memory()
        out.decode(src_cold, dpairs.cuda() if index_location == "device" else dpairs, lifecycle)
        torch.cuda.synchronize()
        check_decoded(spec, scales, lifecycle, out_pools, want, dpairs)
        out.close()
    codec.close()


def test_new_scales_change_the_bytes_as_the_oracle_says(built):
    library, layout = built
    spec = per_layer_spec()
    host_pools = hot_pages(spec, 4, seed=2)
    codec = ColdPageCodec(library, layout, gpu_pools(host_pools), scales=layer_scales(spec, seed=1))
    pairs = torch.tensor([[0, 3], [1, 0], [2, 2]], dtype=torch.int32)
    first = torch.full((3, layout.cold_page_bytes(0)), FILL, dtype=torch.uint8, device="cuda")
    codec.encode(first, pairs)
    torch.cuda.synchronize()  # set_layer_scales copies synchronously: nothing of this codec in flight
    second_scales = layer_scales(spec, seed=2)
    codec.set_layer_scales(second_scales)
    second = torch.full_like(first, FILL)
    codec.encode(second, pairs)
    torch.cuda.synchronize()
    assert torch.equal(second.cpu(), oracle_cold(spec, host_pools, second_scales, 0, pairs, 3))
    assert not torch.equal(first, second)
    codec.close()


def test_staged_offload_and_onboard_use_the_layer_scales(built):
    library, layout = built
    spec = per_layer_spec()
    scales = layer_scales(spec, seed=4)
    host_pools = hot_pages(spec, PAGES, seed=4)
    pools = gpu_pools(host_pools)
    codec = ColdPageCodec(library, layout, pools, scales=scales)
    codec.set_staging(1 << 20)
    pairs = scattered_pairs(PAGES, PAGES, PAGES, torch.Generator().manual_seed(3))
    cold = torch.full((PAGES, layout.cold_page_bytes(1)), FILL, dtype=torch.uint8).pin_memory()
    codec.offload(cold, pairs, lifecycle=1, strategy="staged")
    torch.cuda.synchronize()
    want = oracle_cold(spec, host_pools, scales, 1, pairs, PAGES)
    assert torch.equal(cold, want)
    # onboard 8 of those slots over hot pages 0..7 of the same pools
    dpairs = torch.stack([torch.arange(8, dtype=torch.int32), pairs[:8, 0]], dim=1)
    codec.onboard(cold, dpairs, lifecycle=1, strategy="staged")
    torch.cuda.synchronize()
    check_decoded(spec, scales, 1, pools, want, dpairs)
    codec.close()


def test_scales_are_required_and_checked(built):
    library, layout = built
    spec = per_layer_spec()
    pools = gpu_pools(hot_pages(spec, 2))
    with pytest.raises(ValueError, match="per-layer-scales takes per-layer scales for k, v; pass scales="):
        ColdPageCodec(library, layout, pools)
    codec = ColdPageCodec(library, layout, pools, scales=layer_scales(spec))
    good = layer_scales(spec)
    bad = LayerScales(good.family, good.buffers, ((good.values[0][0], (float("nan"), 1.0)), *good.values[1:]))
    with pytest.raises(LibraryError, match=r"set_layer_scales: per-layer-scales: G\[1\] \(layer 0, buffer 1\) is nan"):
        codec.set_layer_scales(bad)
    codec.close()
    # through the C ABI alone: configured, scales never set -> encode refuses, names the call
    descs = [(p.data_ptr(), p.stride(0) * p.element_size(), p.shape[0]) for layer in pools for p in layer]
    array = (PoolExtent * len(descs))(*[PoolExtent(*d) for d in descs])
    handle = library.kvgen_codec_configure_checked(array, len(descs), 0)
    assert handle, library.last_error()
    cold = torch.zeros(2, layout.cold_page_bytes(0), dtype=torch.uint8, device="cuda")
    pair = torch.tensor([[0, 0]], dtype=torch.int32)
    ok = library.kvgen_codec_encode_checked(handle, 0, ctypes.c_void_p(cold.data_ptr()), 2,
                                            ctypes.c_void_p(pair.data_ptr()), 1, None)
    assert not ok and "per-layer scales not set (call kvgen_codec_set_layer_scales" in library.last_error()
    assert library.kvgen_codec_layer_scale_buffers(handle) == 2
    library.kvgen_codec_destroy(handle)
