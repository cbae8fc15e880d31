"""Layer record layout: every worked size and offset of COLD_PAGE_FORMAT.md §2 (exact)."""

from __future__ import annotations

import json

import pytest

from kvgen.lower.layout import family_layout, to_json
from kvgen.lower.triattention import eviction_config
from kvgen.reference.triattention import EvictionConfig
from kvgen.spec.schema import load_spec, parse_spec

from .conftest import SPECS_DIR


def spec_text(**overrides) -> str:
    fields = {
        "name": "w", "attention": "mha", "layers": 2, "query_heads": 1, "kv_heads": 1, "head_dim": 32,
        "tokens_per_block": 5, "dtype": "fp16", "rope": "{placement: full}",
    }
    fields.update(overrides)
    return "\n".join(f"{k}: {v}" for k, v in fields.items()) + "\n"


def regions(text: str) -> list[tuple[str, str, int, int]]:
    record = family_layout(parse_spec(text)).record
    return [(r.buffer, r.kind, r.offset, r.size) for r in record.regions]


def test_one_head_five_tokens_row32():
    assert regions(spec_text()) == [
        ("k", "data", 0, 80), ("v", "data", 80, 80), ("k", "scales", 160, 10), ("v", "scales", 170, 10),
        ("", "pad", 180, 12),
    ]
    assert family_layout(parse_spec(spec_text())).record.bytes == 192


def test_four_heads_five_tokens_row128():
    text = spec_text(query_heads=4, kv_heads=4, head_dim=128)
    assert [(r[0], r[1], r[2]) for r in regions(text)] == [
        ("k", "data", 0), ("v", "data", 1280), ("k", "scales", 2560), ("v", "scales", 2720)]
    assert family_layout(parse_spec(text)).record.bytes == 2880


@pytest.mark.parametrize("family, record, hot", [("qwen3-8b", 36864, 131072), ("qwen3-8b-fp8", 36864, 65536)])
def test_qwen3_page(family, record, hot):
    layout = family_layout(load_spec(SPECS_DIR / f"{family}.yaml"))
    assert (layout.record.bytes, layout.record.hot_bytes) == (record, hot)
    assert layout.lifecycles[0].cold_page_bytes == 36 * record


def test_mla_with_side_buffer():
    text = spec_text(attention="mla", query_heads=16, head_dim=576, tokens_per_block=64, dtype="bf16",
                     rope="{placement: trailing, pairing: interleaved}",
                     mla="{kv_lora_rank: 512, qk_rope_head_dim: 64}",
                     side_buffers="[{name: indexer_k, bytes_per_token: 132}]")
    assert regions(text) == [("latent", "data", 0, 18432), ("latent", "scales", 18432, 2304),
                             ("indexer_k", "side", 20736, 8448)]
    assert family_layout(load_spec(SPECS_DIR / "glm-5.yaml")).record.bytes == 29184


def test_mla_lossless_rope():
    assert family_layout(load_spec(SPECS_DIR / "deepseek-v3-lossless-rope.yaml")).record.bytes == 13312


def test_leading_lossless_rope_on_k_only():
    text = spec_text(head_dim=64, tokens_per_block=4, dtype="bf16",
                     rope="{placement: leading, rotary_dim: 16}", cold_page="{rope: lossless}")
    assert regions(text) == [
        ("k", "data", 0, 96), ("v", "data", 96, 128), ("k", "scales", 224, 12), ("k", "lossless", 236, 128),
        ("v", "scales", 364, 16), ("", "pad", 380, 4),
    ]
    assert family_layout(parse_spec(text)).record.bytes == 384


def test_deepseek_v4_csa_2fp4():
    layout = family_layout(load_spec(SPECS_DIR / "deepseek-v4-csa.yaml"))
    entry = layout.record.buffers[0]
    assert (entry.rows, entry.q, entry.r, entry.residual_start) == (32, 512, 64, 448)
    assert [(r.kind, r.size) for r in layout.record.regions] == [
        ("data", 8192), ("scales", 1024), ("residual", 1024), ("residual_scales", 128)]
    assert layout.record.bytes == 10368


def test_swa_families_split_lifecycles():
    layout = family_layout(load_spec(SPECS_DIR / "gemma-2-9b.yaml"))
    assert [(lc.window, lc.layers[:2]) for lc in layout.lifecycles] == [(None, (1, 3)), (4096, (0, 2))]


@pytest.mark.parametrize("family", ["qwen3-8b", "gpt-oss-20b", "mistral-7b", "qwen3.5-397b-a17b"])
def test_layout_json_carries_the_eviction_config(family):
    spec = load_spec(SPECS_DIR / f"{family}.yaml")
    data = json.loads(json.dumps(to_json(spec, family_layout(spec))))
    assert data["triattention_refusal"] is None
    config = EvictionConfig.from_json(data["triattention"])
    assert config == eviction_config(spec)
    assert (config.budget, config.beta, config.eviction_mode) == (spec.triattention.budget, spec.triattention.beta,
                                                                   spec.triattention.eviction_mode)


@pytest.mark.parametrize("family, reason", [
    ("deepseek-v3", "TriAttention cannot serve attention: mla"),
    ("deepseek-v4-csa", "TriAttention cannot serve attention: csa"),
])
def test_layout_json_says_why_a_family_has_no_eviction(family, reason):
    spec = load_spec(SPECS_DIR / f"{family}.yaml")
    data = to_json(spec, family_layout(spec))
    assert data["triattention"] is None and data["triattention_refusal"].startswith(reason)


def test_fp8_k_families_are_scored():
    """fp8_e4m3 K is no longer refused (issue 14): the shipped FP8 family carries its eviction entry."""
    spec = load_spec(SPECS_DIR / "qwen3-8b-fp8.yaml")
    data = to_json(spec, family_layout(spec))
    assert data["triattention"] is not None and data["triattention_refusal"] is None
