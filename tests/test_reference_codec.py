"""Record- and page-level reference codec (COLD_PAGE_FORMAT.md §2-4), exact byte checks."""

from __future__ import annotations

import pytest
import torch

from kvgen.lower.layout import family_layout
from kvgen.reference import nvfp4
from kvgen.reference.codec import decode_page, decode_record, encode_page, encode_record
from kvgen.spec.schema import load_spec

from .conftest import SPECS_DIR

FAMILIES = ["qwen3-8b", "qwen3-8b-fp8", "mistral-7b", "qwen3.5-397b-a17b-lossless-rope", "deepseek-v3", "glm-5",
            "deepseek-v4-csa"]


def random_layer(spec, gen: torch.Generator, scale: float = 4.0):
    """Hot pages with outlier channels, exact zeros and a few huge values, in the hot dtype."""
    record = family_layout(spec).record
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8_e4m3": torch.float8_e4m3fn}[spec.dtype]
    buffers = {}
    for b in record.buffers:
        x = torch.randn(b.rows, b.row_dim, generator=gen) * scale
        x[:, 3] *= 40  # an outlier channel, as real K caches have
        x[0, :16] = 0  # an all-zero block
        buffers[b.name] = x.clamp(-440, 440).to(dtype)
    sides = {s.name: torch.randint(0, 256, (s.bytes,), generator=gen, dtype=torch.uint8) for s in record.sides}
    return buffers, sides


@pytest.mark.parametrize("family", FAMILIES)
def test_round_trip_and_lossless_parts(family):
    spec = load_spec(SPECS_DIR / f"{family}.yaml")
    record = family_layout(spec).record
    buffers, sides = random_layer(spec, torch.Generator().manual_seed(1))
    rec = encode_record(record, buffers, sides)
    assert rec.dtype == torch.uint8 and rec.numel() == record.bytes
    pad = record.regions[-1]
    if pad.kind == "pad":
        assert not rec[pad.offset :].any()
    out, out_sides = decode_record(record, rec, spec.dtype)
    for b in record.buffers:
        hot = buffers[b.name].view(torch.uint8).reshape(b.rows, -1)
        got = out[b.name].view(torch.uint8).reshape(b.rows, -1)
        eb = b.elem_bytes
        assert torch.equal(got[:, : b.prefix * eb], hot[:, : b.prefix * eb])
        assert torch.equal(got[:, (b.row_dim - b.suffix) * eb :], hot[:, (b.row_dim - b.suffix) * eb :])
    for name, raw in sides.items():
        assert torch.equal(out_sides[name], raw)
    # a decoded page re-encodes to the same bytes when it has no 2FP4 span (no drift, §4)
    if not any(b.r for b in record.buffers):
        again = encode_record(record, {k: v.reshape(buffers[k].shape) for k, v in out.items()}, out_sides)
        scales_ok = all((nvfp4.e4m3_to_f32(rec[record.region(b.name, "scales").offset:][: b.scale_bytes]) >= 2 ** -7
                         ).all() for b in record.buffers)
        if scales_ok:
            assert torch.equal(again, rec)


def test_error_bound_per_element():
    spec = load_spec(SPECS_DIR / "qwen3-8b.yaml")
    record = family_layout(spec).record
    buffers, _ = random_layer(spec, torch.Generator().manual_seed(2))
    out, _ = decode_record(record, encode_record(record, buffers), spec.dtype)
    x = buffers["k"].float().reshape(-1, 16)
    y = out["k"].float().reshape(-1, 16)
    amax = x.abs().amax(dim=1, keepdim=True)
    S = nvfp4.e4m3_to_f32(nvfp4.e4m3_from_f32(amax / 6))
    bound = torch.maximum(S, x.abs() - 6 * S)
    # the final bf16 rounding of y adds at most half a bf16 ulp of |y|
    assert ((x - y).abs() <= bound + y.abs() * 2 ** -8).all()


def test_garbage_rows_do_not_change_valid_rows():
    """A partially filled page: NaN/Inf in unused rows never changes a valid row's bytes."""
    spec = load_spec(SPECS_DIR / "qwen3-8b.yaml")
    record = family_layout(spec).record
    buffers, _ = random_layer(spec, torch.Generator().manual_seed(3))
    clean = encode_record(record, buffers)
    dirty = {k: v.clone() for k, v in buffers.items()}
    dirty["k"][200:] = float("nan")
    dirty["v"][200:, ::2] = float("inf")
    rec = encode_record(record, dirty)
    for b in record.buffers:
        for kind, per_row in (("data", b.q // 2), ("scales", b.q // 16)):
            off = record.region(b.name, kind).offset
            assert torch.equal(rec[off : off + 200 * per_row], clean[off : off + 200 * per_row])


def test_non_finite_inputs_follow_the_rules():
    spec = load_spec(SPECS_DIR / "qwen3-8b.yaml")
    buffers, _ = random_layer(spec, torch.Generator().manual_seed(4))
    k = buffers["k"]
    k[0, :16] = torch.tensor([float("nan"), float("inf"), -float("inf")] + [1.0] * 13)
    rec = encode_record(family_layout(spec).record, buffers)
    codes = nvfp4.unpack_nibbles(rec[:8])
    assert codes[:3].tolist() == [0x0, 0x7, 0xF]


def test_lifecycle_page_is_the_concatenation_of_records():
    spec = load_spec(SPECS_DIR / "gemma-2-9b.yaml")
    layout = family_layout(spec)
    gen = torch.Generator().manual_seed(5)
    lc = layout.lifecycles[1]
    layers = [random_layer(spec, gen) for _ in lc.layers]
    page = encode_page(layout, layers, lifecycle=1)
    assert page.numel() == lc.cold_page_bytes
    assert torch.equal(page[: lc.record_bytes], encode_record(layout.record, *layers[0]))
    back = decode_page(layout, page, spec.dtype, lifecycle=1)
    assert len(back) == len(lc.layers)
    with pytest.raises(ValueError, match="expected a"):
        decode_page(layout, page[:-16], spec.dtype, lifecycle=1)
