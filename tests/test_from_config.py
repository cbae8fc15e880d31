"""``kvgen spec from-config``: specs drafted from config.json files written after the published ones
(tests/configs/, key fields as the hub ships them), checked against the shipped specs, the validator
and, for LongRoPE, an independent float64 computation of the frequencies (rtol 1e-6: float32 vs
float64 of the same expression)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from kvgen.cli import main
from kvgen.lower.triattention import calibration_defaults, eviction_config, rope_scaling, tri_geometry
from kvgen.reference import triattention as T
from kvgen.spec.from_config import ConfigError, draft_spec, read_config, validate
from kvgen.spec.schema import FamilySpec, SpecError, load_spec, parse_spec
from tests.test_cli import run_without_extras

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "tests" / "configs"
SPECS = ROOT / "specs"
# config fixture -> the shipped spec it must agree with (None: kvgen ships no spec for it)
FIXTURES = {
    "llama-3.1-8b": "llama-3.1-8b",
    "qwen3-8b": "qwen3-8b",
    "gemma-2-9b": "gemma-2-9b",
    "gpt-oss-20b": "gpt-oss-20b",
    "deepseek-v3": "deepseek-v3",
    "phi-4-mini-instruct": None,
    "chatglm3-6b": None,
}


def drafted(stem: str, **overrides) -> FamilySpec:
    path = CONFIGS / f"{stem}.json"
    values = dict(read_config(path), **overrides)
    draft = draft_spec(values, str(path), fallback_name=stem)
    return validate(draft, f"{draft.name}.yaml")


def geometry_facts(spec: FamilySpec) -> dict:
    """What a spec says of the model (not of the engine: page size, layout, TriAttention budget)."""
    scaling = rope_scaling(spec)
    return {
        "attention": spec.attention, "layers": spec.layers, "query_heads": spec.query_heads,
        "kv_heads": spec.kv_heads, "row_dim": spec.row_dim, "rotary_dim": spec.rotary_dim,
        "rope_start": spec.rope_start, "placement": spec.rope.placement, "pairing": spec.rope.pairing,
        "theta": spec.rope.theta, "scaling": scaling, "swa_layers": spec.swa_layers,
        "windows": [spec.layer_window(i) for i in range(spec.layers)], "mla": spec.mla,
    }


@pytest.mark.parametrize("stem", sorted(FIXTURES))
def test_every_draft_validates_and_loads_from_disk(stem, tmp_path):
    path = CONFIGS / f"{stem}.json"
    draft = draft_spec(read_config(path), str(path), fallback_name=stem)
    out = tmp_path / f"{draft.name}.yaml"
    out.write_text(draft.text())
    assert load_spec(out) == validate(draft, str(out))
    assert draft.text().startswith("# ")  # commented, like the shipped specs
    assert any("tokens_per_block" in note for note in draft.notes)


@pytest.mark.parametrize("stem", [s for s, shipped in FIXTURES.items() if shipped])
def test_draft_matches_the_shipped_spec(stem):
    spec, shipped = drafted(stem), load_spec(SPECS / f"{FIXTURES[stem]}.yaml")
    mine, theirs = geometry_facts(spec), geometry_facts(shipped)
    assert mine == theirs
    assert spec.tokens_per_block == shipped.tokens_per_block


def test_phi4_mini_partial_rotary_and_longrope():
    spec = drafted("phi-4-mini-instruct")
    assert (spec.rope.placement, spec.rope.partial_rotary_factor, spec.rotary_dim) == ("leading", 0.75, 96)
    assert (spec.head_dim, spec.query_heads, spec.kv_heads, spec.sliding_window) == (128, 24, 8, None)
    scaling = spec.rope.scaling
    assert (scaling.type, scaling.original_max_position_embeddings, scaling.factor) == ("longrope", 4096, 32.0)
    config = read_config(CONFIGS / "phi-4-mini-instruct.json")["rope_scaling"]
    # Independent computation (float64): inv_freq_f = 1 / (ext_f * theta^(2f / rotary_dim)).
    for key, seq_len in (("long_factor", None), ("long_factor", 4097), ("short_factor", 4096)):
        expected = torch.tensor([1.0 / (config[key][f] * 10000.0 ** (2 * f / 96)) for f in range(48)],
                                dtype=torch.float64)
        omega = T.rope_omega(96, spec.rope.theta, rope_scaling(spec), seq_len=seq_len)
        torch.testing.assert_close(omega.double(), expected, rtol=1e-6, atol=0)
    attention_factor = math.sqrt(1 + math.log(131072 / 4096) / math.log(4096))
    omega, scale = calibration_defaults(spec)  # what TriAttention scores with: the long factors
    torch.testing.assert_close(omega, T.rope_omega(96, 10000.0, rope_scaling(spec), seq_len=1 << 15))
    torch.testing.assert_close(scale.double(), torch.full((48,), attention_factor ** 2, dtype=torch.float64))


def test_longrope_reaches_the_runtime_through_the_manifest(tmp_path):
    """The manager's defaults come from the shipped EvictionConfig (JSON in the manifest): the same
    omega and attention factor as the spec's, and a calibration made with them loads (bit equal)."""
    spec = drafted("phi-4-mini-instruct")
    shipped = T.EvictionConfig.from_json(json.loads(json.dumps(eviction_config(spec).to_json())))
    omega, scale = T.rope_defaults(shipped.geometry.rotary_dim, shipped.rope_theta, shipped.rope_scaling)
    expected_omega, expected_scale = calibration_defaults(spec)
    assert torch.equal(omega, expected_omega) and torch.equal(scale, expected_scale)
    calib = T.synthetic_calibration(shipped.geometry, seed=0, num_queries=4, theta=shipped.rope_theta,
                                    scaling=shipped.rope_scaling)
    T.save_calibration(calib, tmp_path / "calib.pt")
    loaded = T.load_calibration(tmp_path / "calib.pt", shipped.geometry, omega, scale)
    assert torch.equal(loaded.omega, omega)
    short = T.rope_omega(96, 10000.0, shipped.rope_scaling, seq_len=4096)
    with pytest.raises(T.CalibrationError, match="disagrees with the family's RoPE"):
        T.load_calibration(tmp_path / "calib.pt", shipped.geometry, short, scale)


def test_chatglm3_interleaved_pairs_on_half_the_head():
    spec = drafted("chatglm3-6b")
    assert (spec.attention, spec.query_heads, spec.kv_heads, spec.head_dim, spec.layers) == ("gqa", 32, 2, 128, 28)
    assert (spec.rope.placement, spec.rotary_dim, spec.rope.pairing, spec.dtype) == ("leading", 64, "interleaved",
                                                                                     "fp16")
    re, im = T.split_pairs(torch.arange(128), tri_geometry(spec))
    assert re.tolist() == list(range(0, 64, 2)) and im.tolist() == list(range(1, 64, 2))
    assert drafted("chatglm3-6b", rope_ratio=500).rope.theta == 5_000_000.0  # GLM-4-9B's base


def test_deepseek_v3_is_mla_without_triattention():
    spec = drafted("deepseek-v3")
    assert (spec.attention, spec.row_dim, spec.rotary_dim, spec.rope_start) == ("mla", 576, 64, 512)
    assert spec.kv_heads == 1 and not spec.triattention.enabled


def test_layer_types_written_as_the_pattern_or_a_list():
    types = ["full_attention"] * 24
    types[3] = types[7] = "sliding_attention"
    spec = drafted("gpt-oss-20b", layer_types=types)
    assert spec.sliding_window.layers == [3, 7]
    assert drafted("gpt-oss-20b", layer_types=["sliding_attention"] * 23 + ["full_attention"]).swa_layers == \
        frozenset(range(23))
    with pytest.raises(ConfigError, match=r"layer_types\[0\]: 'chunked_attention'"):
        drafted("gpt-oss-20b", layer_types=["chunked_attention"] * 24)  # Llama-4's: not a KV pattern kvgen has
    with pytest.raises(ConfigError, match="24 layer types"):
        drafted("gpt-oss-20b", layer_types=["full_attention"])


def test_other_config_shapes():
    # transformers v5: theta and scaling in rope_parameters, per layer type (full attention is scored).
    llama = read_config(CONFIGS / "llama-3.1-8b.json")
    v5 = {"full_attention": dict(llama["rope_scaling"], rope_theta=500000.0),
          "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}
    assert drafted("llama-3.1-8b", rope_scaling=None, rope_theta=None, rope_parameters=v5) == drafted("llama-3.1-8b")
    # Gemma-3: every 6th layer is global; Qwen2 with use_sliding_window: layers from max_window_layers on.
    gemma3 = drafted("gemma-2-9b", model_type="gemma3", sliding_window_pattern=6, num_hidden_layers=12)
    assert gemma3.swa_layers == frozenset(range(12)) - {5, 11}
    qwen2 = drafted("qwen3-8b", use_sliding_window=True, sliding_window=4096, max_window_layers=28)
    assert qwen2.swa_layers == frozenset(range(28, 36))
    # Hybrid stacks: linear-attention layers keep no KV cache (Qwen3.5: every 4th of 60 is full).
    qwen35 = {"model_type": "qwen3_5_moe", "num_hidden_layers": 60, "num_attention_heads": 32,
              "num_key_value_heads": 2, "head_dim": 256, "partial_rotary_factor": 0.25, "rope_theta": 10000000,
              "full_attention_interval": 4, "torch_dtype": "bfloat16", "max_position_embeddings": 262144}
    facts = geometry_facts(validate(draft_spec(qwen35, "config.json", name="qwen3.5-397b-a17b"), "x.yaml"))
    assert facts == geometry_facts(load_spec(SPECS / "qwen3.5-397b-a17b.yaml"))
    types = ["linear_attention", "sliding_attention", "linear_attention", "full_attention"] * 6
    assert drafted("gpt-oss-20b", layer_types=types).swa_layers == frozenset(range(0, 12, 2))
    # Multimodal configs nest the language model.
    qwen = read_config(CONFIGS / "qwen3-8b.json")
    nested = draft_spec({"model_type": "qwen3_vl", "text_config": qwen}, "config.json", name="qwen3-8b")
    assert validate(nested, "qwen3-8b.yaml") == drafted("qwen3-8b")


def test_rope_scaling_spellings_and_refusals():
    old = drafted("llama-3.1-8b", rope_scaling=dict(read_config(CONFIGS / "llama-3.1-8b.json")["rope_scaling"],
                                                     type="llama3", rope_type=None))
    assert old == drafted("llama-3.1-8b")
    phi = read_config(CONFIGS / "phi-4-mini-instruct.json")["rope_scaling"]
    assert drafted("phi-4-mini-instruct", rope_scaling=dict(phi, type="su")).rope.scaling.type == "longrope"
    with pytest.raises(ConfigError, match="type 'mrope' has no spec form"):
        drafted("qwen3-8b", rope_scaling={"type": "mrope", "mrope_section": [16, 24, 24]})
    with pytest.raises(ConfigError, match="47 factors"):
        drafted("phi-4-mini-instruct", rope_scaling=dict(phi, long_factor=phi["long_factor"][:47]))
    dynamic = drafted("qwen3-8b", rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    assert dynamic.rope.scaling.type == "dynamic" and not dynamic.triattention.enabled


def test_config_errors_name_the_file_and_key(tmp_path):
    bad = tmp_path / "config.json"
    bad.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="config.json: expected a JSON object"):
        read_config(bad)
    with pytest.raises(ConfigError, match=r"rope_scaling.factor: not a number"):
        drafted("qwen3-8b", rope_scaling={"rope_type": "linear", "factor": "eight"})
    with pytest.raises(ConfigError, match="num_key_value_heads: 5 does not divide"):
        drafted("qwen3-8b", num_key_value_heads=5)


# ---------------------------------------------------------------- the spec language


LLAMA = (SPECS / "llama-3.1-8b.yaml").read_text()


def test_spec_accepts_rope_type_as_type():
    assert parse_spec(LLAMA.replace("    type: llama3", "    rope_type: llama3")) == parse_spec(LLAMA)
    with pytest.raises(SpecError, match="not both"):
        parse_spec(LLAMA.replace("    type: llama3", "    type: llama3\n    rope_type: llama3"))


@pytest.mark.parametrize("edit, message", [
    (("    low_freq_factor: 1.0\n", "    low_freq_factor: 1.0\n    beta_fast: 32.0\n"),
     "rope.scaling.beta_fast: llama3 scaling does not use beta_fast"),
    (("    type: llama3\n    factor: 8.0\n    low_freq_factor: 1.0\n    high_freq_factor: 4.0\n",
      "    type: dynamic\n    factor: 2.0\n"), "rope.scaling.type: dynamic NTK scaling .* triattention.enabled: false"),
    (("    type: llama3\n", "    type: longrope\n"), "longrope scaling needs short_factor, long_factor"),
])
def test_spec_scaling_errors(edit, message):
    with pytest.raises(SpecError, match=message):
        parse_spec(LLAMA.replace(*edit))


# ---------------------------------------------------------------- the CLI


def test_cli_writes_validates_and_never_overwrites(tmp_path, capsys):
    config = CONFIGS / "phi-4-mini-instruct.json"
    assert main(["--specs", str(tmp_path), "spec", "from-config", str(config)]) == 0
    out = tmp_path / "phi-4-mini-instruct.yaml"
    err = capsys.readouterr().err
    assert "note: tokens_per_block" in err and f"wrote {out}" in err
    assert load_spec(out).rope.scaling.type == "longrope"
    out.write_text("# edited\n" + out.read_text())
    assert main(["--specs", str(tmp_path), "spec", "from-config", str(config)]) == 2
    assert "already exists; pass --force" in capsys.readouterr().err
    assert out.read_text().startswith("# edited")
    assert main(["--specs", str(tmp_path), "spec", "from-config", str(config), "--force"]) == 0
    assert not out.read_text().startswith("# edited")


def test_cli_names_stdout_and_bad_input(tmp_path, capsys):
    config = CONFIGS / "qwen3-8b.json"
    assert main(["spec", "from-config", str(config), "--out", "-", "--name", "qwen3-mine"]) == 0
    assert "name: qwen3-mine\n" in capsys.readouterr().out
    out = tmp_path / "my-qwen.yaml"
    assert main(["spec", "from-config", str(config), "--out", str(out)]) == 0
    assert load_spec(out).name == "my-qwen"
    assert main(["spec", "from-config", str(config), "--out", str(tmp_path / "a.yaml"), "--name", "b"]) == 2
    assert "a spec's file name is its name (b.yaml)" in capsys.readouterr().err
    broken = tmp_path / "config.json"
    broken.write_text(json.dumps({"num_hidden_layers": 2}))
    assert main(["spec", "from-config", str(broken), "--out", "-"]) == 2
    assert "config.json: num_attention_heads / n_head: missing" in capsys.readouterr().err


def test_cli_on_a_base_install(tmp_path):
    """No optuna, triton, cutlass or matplotlib: the verb needs none of them."""
    proc = run_without_extras("spec", "from-config", str(CONFIGS / "gpt-oss-20b.json"), "--out",
                              str(tmp_path / "gpt-oss-20b.yaml"))
    assert proc.returncode == 0, proc.stderr
    assert "note: dtype: no torch_dtype in the config; chose bf16" in proc.stderr
    assert load_spec(tmp_path / "gpt-oss-20b.yaml").rope.scaling.truncate is False
