"""Spec language: shipped specs validate; each rule's violation names file, line and key; hostile
YAML never escapes as a traceback (only SpecError)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvgen.reference.triattention_family import refusal_reason
from kvgen.spec.schema import SpecError, load_spec, parse_spec

SPECS = sorted((Path(__file__).resolve().parent.parent / "specs").glob("*.yaml"))

BASE = """\
name: t
attention: gqa
layers: 4
query_heads: 8
kv_heads: 2
head_dim: 128
tokens_per_block: 16
dtype: bf16
rope:
  placement: full
  pairing: half
"""


def errors_of(text: str) -> list[tuple[int, str, str]]:
    with pytest.raises(SpecError) as info:
        parse_spec(text, "t.yaml")
    assert str(info.value).startswith("t.yaml:")
    return [(i.line, i.key, i.message) for i in info.value.issues]


def test_shipped_specs_cover_the_required_families():
    names = {p.stem for p in SPECS}
    required = {"llama-3.1-8b", "qwen3-8b", "qwen3.5-397b-a17b", "qwen3.5-397b-a17b-lossless-rope", "mistral-7b",
                "gemma-2-9b", "gpt-oss-20b", "deepseek-v3", "glm-5", "deepseek-v4-csa", "qwen3-8b-fp8",
                "qwen3-8b-nhd"}
    assert required <= names


@pytest.mark.parametrize("path", SPECS, ids=[p.stem for p in SPECS])
def test_shipped_spec_is_valid(path):
    spec = load_spec(path)
    assert spec.name == path.stem


def test_base_is_valid():
    spec = parse_spec(BASE)
    assert spec.rotary_dim == 128 and spec.row_dim == 128


@pytest.mark.parametrize(
    "edit, line, key, fragment",
    [
        # type / shape errors (pydantic) keep the line of the offending key
        (("layers: 4", "layers: four"), 3, "layers", "valid integer"),
        (("dtype: bf16", "dtype: fp32"), 8, "dtype", "'bf16', 'fp16' or 'fp8_e4m3'"),
        (("  pairing: half", "  pairing: half\n  pairng: x"), 12, "rope.pairng", "accepted keys: placement"),
        (("name: t", "name: 'a/b'"), 1, "name", "lowercase"),
        (("layers: 4", "layers: 99999999999999999999"), 3, "layers", "less than or equal"),
        # COLD_PAGE_FORMAT §5
        (("head_dim: 128", "head_dim: 120"), 6, "head_dim", "multiple of 16"),
        (("  pairing: half", "  pairing: half\ncold_page:\n  rope: lossless"), 13, "cold_page.rope",
         "nothing to quantize"),
        (("placement: full", "placement: leading\n  rotary_dim: 23"), 9, "rope", "must be even"),
        (("  pairing: half", "  pairing: half\ncold_page:\n  residual_width: 32"), 13, "cold_page.residual_width",
         "only accepted with rope: 2fp4"),
        (("  pairing: half", "  pairing: half\ncold_page:\n  scales:\n    latent: {G: 2.0}"), 14,
         "cold_page.scales.latent", "accepted: k, v"),
        (("  pairing: half", "  pairing: half\ncold_page:\n  scales:\n    k: {G: .nan}"), 14, "cold_page.scales.k.G",
         "finite"),
        # attention geometry
        (("kv_heads: 2", "kv_heads: 3"), 5, "kv_heads", "query_heads % kv_heads"),
        (("attention: gqa", "attention: mla"), 2, "attention", "needs an 'mla' block"),
        (("attention: gqa", "attention: csa"), 6, "head_dim", "512"),
        # TRIATTENTION §8
        (("dtype: bf16", "dtype: bf16\nsliding_window: {window: 64, layers: [0, 7]}"), 9, "sliding_window.layers",
         "does not exist"),
    ],
)
def test_rule_violation_names_line_and_key(edit, line, key, fragment):
    old, new = edit
    assert old in BASE
    issues = errors_of(BASE.replace(old, new, 1))
    assert any(i[0] == line and i[1] == key and fragment in i[2] for i in issues), issues


def test_mla_rejects_triattention_with_reason():
    text = """\
name: m
attention: mla
layers: 2
query_heads: 16
tokens_per_block: 64
dtype: bf16
mla: {kv_lora_rank: 512, qk_rope_head_dim: 64}
rope: {placement: trailing, pairing: interleaved}
triattention:
  enabled: true
"""
    issues = errors_of(text)
    assert issues[0][1] == "triattention.enabled" and "cannot serve attention: mla" in issues[0][2]
    assert issues[0][0] == 10


def test_quantized_range_is_cross_checked():
    text = BASE.replace("placement: full", "placement: leading\n  rotary_dim: 32") + (
        "cold_page:\n  rope: lossless\n  quantized_range: {start: 0, length: 96}\n")
    issues = errors_of(text)
    assert issues[0][1] == "cold_page.quantized_range" and "start 32, length 96" in issues[0][2]
    ok = text.replace("start: 0", "start: 32")
    assert parse_spec(ok).cold_page.quantized_range.start == 32


@pytest.mark.parametrize("edit, reason", [
    (("placement: full", "placement: none"), dict(rope_placement="none")),
    (("dtype: bf16", "dtype: bf16\nsliding_window: {window: 64, layers: all}"), dict(scored_layers=0)),
])
def test_triattention_refusals_are_the_oracles(edit, reason):
    """The validator reports ``refusal_reason``'s words on triattention.enabled, with the fix."""
    text = BASE.replace(*edit) + "triattention: {enabled: true}\n"
    issues = errors_of(text)
    assert issues[0][1] == "triattention.enabled"
    assert issues[0][2] == f"{refusal_reason('gqa', **reason)}; set enabled: false"


@pytest.mark.parametrize("rope, start", [
    ("{placement: full}", 0),
    ("{placement: leading, rotary_dim: 32}", 0),
    ("{placement: trailing, rotary_dim: 32}", 96),
    ("{placement: none}", 0),
])
def test_rope_start(rope, start):
    assert parse_spec(BASE.replace("rope:\n  placement: full\n  pairing: half\n", f"rope: {rope}\n")).rope_start \
        == start


def test_swa_budget_must_cover_window():
    text = BASE + "sliding_window: {window: 4096, layers: even}\ntriattention: {enabled: true, budget: 1024}\n"
    assert errors_of(text)[0][1] == "triattention.budget"


def test_file_name_must_match(tmp_path):
    path = tmp_path / "other.yaml"
    path.write_text(BASE)
    with pytest.raises(SpecError, match="must match the file name"):
        load_spec(path)


@pytest.mark.parametrize(
    "text",
    [
        "",
        "- a\n- b\n",
        "a: &x [1]\nb: *x\n",
        "name: !!python/object:os.system echo\n",
        "{1: 2}\n",
        "name: t\nname: u\n",
        "name: [\n",
        "\x00\x01",
        BASE.replace("name: t", 'name: "a\\nb"'),
        BASE.replace("name: t", "name: '{{x}}'"),
        BASE.replace("name: t", "name: ../../etc/passwd"),
        BASE.replace("layers: 4", "layers: 1e400"),
        BASE.replace("layers: 4", "layers: true"),
        BASE.replace("rope:\n", "rope: 5\nx:\n"),
        BASE + "side_buffers: [{name: 'x\"y', bytes_per_token: 4}]\n",
    ],
)
def test_hostile_yaml_gives_spec_error(text):
    with pytest.raises(SpecError):
        parse_spec(text, "h.yaml")


_yaml_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=20,
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(key=st.sampled_from(["name", "attention", "layers", "head_dim", "rope", "cold_page", "sliding_window",
                            "side_buffers", "triattention", "targets", "mla", "tokens_per_block"]),
       value=_yaml_values)
def test_fuzzed_field_values_never_crash(key, value):
    doc = yaml.safe_load(BASE)
    doc[key] = value
    try:
        parse_spec(yaml.safe_dump(doc), "f.yaml")
    except SpecError:
        pass


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=200))
def test_fuzzed_text_never_crashes(text):
    try:
        parse_spec(text, "f.yaml")
    except SpecError:
        pass
