"""``kvgen calibrate`` on tiny random-initialised transformers models built from a config (no hub).

The statistics are checked against a direct computation: the test records the query tensor each
attention layer hands to its ``apply_rotary_pos_emb`` (the pre-RoPE query by definition, whatever
the hook site), cuts the pairs by index itself and takes the float64 means. The hook path also sums
in float64, so both agree to float32 rounding of the stored means (rtol 1e-6).

Models: Qwen3 (q_norm before RoPE, half pairing, full rotary; float32 and bfloat16; with a sliding
layer, whose rows are measured too though never scored), Llama with
YaRN (attention factor != 1, so freq_scale_sq != 1), GLM (interleaved pairing, partial rotary 0.5).
All GQA 4/2, 2 layers, head_dim 16: a few milliseconds per forward pass on the CPU.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import torch

from kvgen.calibrate import (
    CalibrateError,
    calibrate,
    calibrate_text,
    read_text,
    token_chunks,
    write_outputs,
)
from kvgen.cli import main
from kvgen.lower.triattention import calibration_defaults, tri_geometry
from kvgen.reference.triattention import GeometryError, load_calibration
from kvgen.spec.schema import parse_spec
from tests.conftest import ROOT

transformers = pytest.importorskip("transformers")

LAYERS, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 2, 4, 2, 16, 64
TINY = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 64, "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM,
        "max_position_embeddings": 256, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 1}
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64}


def spec_text(*, pairing: str = "half", rope_extra: str = "  placement: full\n", theta: float = 10000.0,
              query_heads: int = HEADS, head_dim: int = HEAD_DIM, extra: str = "") -> str:
    """Spec of family ``tiny`` for the tiny models (GQA 4/2, head_dim 16)."""
    return (f"name: tiny\nattention: gqa\nlayers: {LAYERS}\nquery_heads: {query_heads}\n"
            f"kv_heads: {KV_HEADS}\nhead_dim: {head_dim}\ntokens_per_block: 16\nlayout: HND\ndtype: bf16\n"
            f"rope:\n{rope_extra}  pairing: {pairing}\n  theta: {theta}\ncold_page:\n  rope: quantized\n"
            "triattention:\n  enabled: true\n  budget: 64\n  beta: 16\n  eviction_mode: union\n" + extra)


YARN_ROPE = ("  placement: full\n  scaling:\n    type: yarn\n    factor: 4.0\n"
             "    original_max_position_embeddings: 64\n")
PARTIAL_ROPE = "  placement: leading\n  partial_rotary_factor: 0.5\n"

# name -> (config class, extra config, spec text)
MODELS = {
    "qwen3": ("Qwen3Config", {}, spec_text()),
    "llama-yarn": ("LlamaConfig", {"rope_parameters": YARN}, spec_text(rope_extra=YARN_ROPE)),
    "qwen3-swa": ("Qwen3Config", {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 8,
                                  "use_sliding_window": True},
                  spec_text(extra="sliding_window:\n  window: 8\n  layers: even\n")),
    "glm-interleaved-partial": ("GlmConfig", {"partial_rotary_factor": 0.5},
                                spec_text(pairing="interleaved", rope_extra=PARTIAL_ROPE)),
}


def tiny_model(kind: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    config_cls, extra, _ = MODELS[kind]
    config = getattr(transformers, config_cls)(**TINY, **extra)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config, dtype=dtype).eval()


def random_chunks(seed: int = 1) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (length,), generator=generator) for length in (40, 17)]


def record_rope_inputs(model: torch.nn.Module, monkeypatch: pytest.MonkeyPatch) -> list[torch.Tensor]:
    """Patch the modeling module's apply_rotary_pos_emb to keep every query it rotates ([B, Hq, T, D])."""
    module = sys.modules[type(model.model.layers[0].self_attn).__module__]
    original = module.apply_rotary_pos_emb
    heads = model.config.num_attention_heads
    seen: list[torch.Tensor] = []

    def recording(q, k, cos, sin, *args, **kwargs):
        if q.shape[1] == heads:   # the RoPE probe of the model check rotates one head: not a forward pass
            seen.append(q.detach().clone())
        return original(q, k, cos, sin, *args, **kwargs)

    monkeypatch.setattr(module, "apply_rotary_pos_emb", recording)
    return seen


def direct_means(seen: list[torch.Tensor], layers: int, pairing: str,
                 rotary_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """E_q [L, Hq, F] and E_q_norm from the recorded queries (calls come in layer order in every
    pass), in float64, pairs cut by index here; the rotated span leads in every model tested."""
    e_q, e_norm = [], []
    for layer in range(layers):
        rows = torch.cat([q[0].transpose(0, 1) for q in seen[layer::layers]]).double()   # [tokens, Hq, D]
        span = rows[..., :rotary_dim]
        if pairing == "half":
            pairs = torch.complex(span[..., :rotary_dim // 2], span[..., rotary_dim // 2:])
        else:
            pairs = torch.complex(span[..., 0::2], span[..., 1::2])
        e_q.append(pairs.mean(dim=0))
        e_norm.append(pairs.abs().mean(dim=0))
    return torch.stack(e_q).to(torch.complex64).cpu(), torch.stack(e_norm).to(torch.float32).cpu()


@pytest.mark.parametrize(("kind", "dtype"), [(kind, torch.float32) for kind in sorted(MODELS)]
                         + [("qwen3", torch.bfloat16)])
def test_statistics_are_the_means_of_the_pre_rope_queries(kind, dtype, monkeypatch):
    model = tiny_model(kind, dtype)
    spec = parse_spec(MODELS[kind][2])
    seen = record_rope_inputs(model, monkeypatch)
    chunks = random_chunks()
    run = calibrate(model, chunks, spec)
    assert run.tokens == sum(len(c) for c in chunks) and run.chunks == len(chunks)
    assert len(seen) == LAYERS * len(chunks)
    assert run.metadata["query_site"] == ("q_norm" if kind.startswith("qwen3") else "q_proj")
    geometry = tri_geometry(spec)
    e_q, e_norm = direct_means(seen, LAYERS, geometry.pairing, geometry.rotary_dim)
    calib = run.calibration
    assert calib.E_q.shape == (LAYERS, HEADS, geometry.rotary_dim // 2) and calib.E_q.dtype == torch.complex64
    torch.testing.assert_close(calib.E_q, e_q, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(calib.E_q_norm, e_norm, rtol=1e-6, atol=1e-7)
    omega, scale = calibration_defaults(spec)
    assert torch.equal(calib.omega, omega) and torch.equal(calib.freq_scale_sq, scale)
    if kind == "llama-yarn":   # the attention factor travels as freq_scale_sq, the queries stay unscaled
        factor = model.model.rotary_emb.attention_scaling
        assert factor != 1.0 and torch.allclose(scale, torch.full_like(scale, factor ** 2))


def test_both_forms_load_back_equal(tmp_path):
    model = tiny_model("qwen3")
    spec = parse_spec(MODELS["qwen3"][2])
    run = calibrate(model, random_chunks(), spec)
    flat, upstream = tmp_path / "out" / "c.pt", tmp_path / "out" / "c.upstream.pt"
    write_outputs(run, str(flat), str(upstream))   # plain strings too, as in a notebook; folders are made
    geometry = tri_geometry(spec)
    omega, scale = calibration_defaults(spec)
    for path in (flat, upstream):   # exact: the upstream form stores the same float32 parts
        loaded = load_calibration(path, geometry, omega, scale)
        assert torch.equal(loaded.E_q, run.calibration.E_q) and torch.equal(loaded.E_q_norm, run.calibration.E_q_norm)
        assert torch.equal(loaded.omega, omega) and torch.equal(loaded.freq_scale_sq, scale)
    metadata = torch.load(upstream, weights_only=True)["metadata"]
    assert metadata["family"] == "tiny" and metadata["num_tokens"] == run.tokens
    assert len(metadata["sampled_heads"]) == LAYERS * HEADS
    assert upstream.stat().st_size < 64 * 1024   # per-head entries are copies, not views of the whole tensor


# ----------------------------------------------------------------------------------------------
# Errors name the problem
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("kind", "spec_kwargs", "message"), [
    ("qwen3", {"query_heads": 8}, "query heads: model 4 (config num_attention_heads), spec 8"),
    ("qwen3", {"head_dim": 32}, "head_dim: model 16 (config head_dim), spec 32"),
    ("qwen3", {"extra": "sliding_window:\n  window: 8\n  layers: even\n"},
     "sliding-window layers: model none (config layer_types, sliding_window), spec [0] (window [8])"),
    ("qwen3", {"theta": 1000000.0}, "RoPE frequencies (inv_freq) disagree with tiny's rope.theta"),
    ("qwen3", {"pairing": "interleaved"}, "the model pairs 'half' (set rope.pairing: half)"),
    ("glm-interleaved-partial", {"rope_extra": PARTIAL_ROPE}, "the model pairs 'interleaved'"),
    ("qwen3", {"rope_extra": PARTIAL_ROPE}, "the model rotates 16 elements per head, tiny rotary_dim 8"),
    ("llama-yarn", {"rope_extra": YARN_ROPE + "    attention_factor: 1.5\n"},
     "attention scaling 1.13863 disagrees with tiny's 1.5"),
])
def test_a_model_the_spec_does_not_describe_is_refused(kind, spec_kwargs, message):
    with pytest.raises(CalibrateError, match=re.escape(message)):
        calibrate(tiny_model(kind), random_chunks(), parse_spec(spec_text(**spec_kwargs)))


def test_a_model_cast_with_to_is_refused_with_the_fix():
    """model.to(bfloat16) also rounds the inv_freq buffer, so the model's RoPE is no longer the spec's."""
    with pytest.raises(CalibrateError, match=re.escape("inv_freq is bfloat16: model.to(dtype) rounds")):
        calibrate(tiny_model("qwen3").to(torch.bfloat16), random_chunks(), parse_spec(spec_text()))


def test_a_model_without_rope_is_refused():
    model = tiny_model("qwen3")
    model.model.rotary_emb = torch.nn.Identity()
    with pytest.raises(CalibrateError, match="RoPE not found: no module holds an inv_freq buffer"):
        calibrate(model, random_chunks(), parse_spec(spec_text()))


def test_a_family_triattention_cannot_serve_is_refused():
    mla = ("name: tiny-mla\nattention: mla\nlayers: 2\nquery_heads: 4\nkv_heads: 1\ntokens_per_block: 16\n"
           "layout: HND\ndtype: bf16\nmla:\n  kv_lora_rank: 32\n  qk_rope_head_dim: 16\n"
           "rope:\n  placement: trailing\n  pairing: interleaved\n  theta: 10000.0\ncold_page:\n  rope: quantized\n")
    with pytest.raises(GeometryError, match="TriAttention cannot serve attention: mla"):
        calibrate(tiny_model("qwen3"), random_chunks(), parse_spec(mla))


class SpaceTokenizer:
    """Word ids by position in a fixed list; what calibrate_text needs of an HF tokenizer."""

    bos_token_id = 1
    words = ("[unk]", "[bos]", "the", "quick", "brown", "fox")

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": [self.words.index(w) if w in self.words else 0 for w in text.split()]}


@pytest.mark.parametrize("text", ["", "  \n\t "])
def test_an_empty_text_is_refused(text, tmp_path):
    path = tmp_path / "empty.txt"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(CalibrateError, match="empty.txt: the calibration text is empty"):
        calibrate_text(tiny_model("qwen3"), SpaceTokenizer(), read_text(path), parse_spec(spec_text()),
                       source=str(path))


def test_text_errors_name_the_file(tmp_path):
    with pytest.raises(CalibrateError, match="missing.txt: calibration text not found"):
        read_text(tmp_path / "missing.txt")
    binary = tmp_path / "binary.txt"
    binary.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(CalibrateError, match="binary.txt: not UTF-8 text"):
        read_text(binary)


def test_chunks_start_with_bos_and_cover_every_token():
    chunks = token_chunks(list(range(10, 20)), chunk_tokens=4, bos=1)
    assert [c.tolist() for c in chunks] == [[1, 10, 11, 12], [1, 13, 14, 15], [1, 16, 17, 18], [1, 19]]
    assert [c.tolist() for c in token_chunks([5, 6, 7], chunk_tokens=2)] == [[5, 6], [7]]
    with pytest.raises(CalibrateError, match="--chunk-tokens"):
        token_chunks([1, 2], chunk_tokens=1)


# ----------------------------------------------------------------------------------------------
# The verb, end to end, on a checkpoint folder
# ----------------------------------------------------------------------------------------------

def save_checkpoint(folder) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tiny_model("qwen3").save_pretrained(folder)
    words = ["[UNK]", "[BOS]", "the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", bos_token="[BOS]")
    fast.save_pretrained(folder)


def test_cli_writes_both_forms(tmp_path, capsys):
    checkpoint, specs = tmp_path / "ckpt", tmp_path / "specs"
    save_checkpoint(checkpoint)
    specs.mkdir()
    (specs / "tiny.yaml").write_text(spec_text(), encoding="utf-8")
    text = tmp_path / "calib.txt"
    text.write_text("the quick brown fox jumps over the lazy dog\n" * 20, encoding="utf-8")
    out = tmp_path / "out" / "tiny.pt"
    status = main(["--specs", str(specs), "calibrate", "tiny", "--model", str(checkpoint), "--text", str(text),
                   "--out", str(out), "--chunk-tokens", "64", "--device", "cpu", "--json"])
    assert status == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["tokens"] == 180 + 3 and summary["forward_passes"] == 3   # 63 words + BOS per pass
    spec = parse_spec(spec_text())
    omega, scale = calibration_defaults(spec)
    flat = load_calibration(out, tri_geometry(spec), omega, scale)
    upstream = load_calibration(tmp_path / "out" / "tiny.upstream.pt", tri_geometry(spec), omega, scale)
    assert torch.equal(flat.E_q, upstream.E_q)


def test_cli_refusal_is_a_usage_error(tmp_path, capsys):
    checkpoint, specs = tmp_path / "ckpt", tmp_path / "specs"
    save_checkpoint(checkpoint)
    specs.mkdir()
    (specs / "tiny.yaml").write_text(spec_text(query_heads=8), encoding="utf-8")
    text = tmp_path / "calib.txt"
    text.write_text("the quick brown fox", encoding="utf-8")
    status = main(["--specs", str(specs), "calibrate", "tiny", "--model", str(checkpoint), "--text", str(text),
                   "--out", str(tmp_path / "c.pt"), "--device", "cpu"])
    assert status == 2
    assert "query heads: model 4" in capsys.readouterr().err
    assert not (tmp_path / "c.pt").exists()


NO_TRANSFORMERS = """
import importlib.abc, runpy, sys
class Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "transformers":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, Absent())
sys.argv = ["kvgen", *ARGV]
runpy.run_module("kvgen", run_name="__main__")
"""


def test_cli_without_transformers_names_the_extra(tmp_path):
    """A base install has no transformers: the verb says which extra brings it, in one line."""
    text = tmp_path / "calib.txt"
    text.write_text("the quick brown fox", encoding="utf-8")
    argv = ["calibrate", "qwen3-8b", "--model", str(tmp_path), "--text", str(text), "--out", str(tmp_path / "c.pt")]
    proc = subprocess.run([sys.executable, "-c", NO_TRANSFORMERS.replace("ARGV", repr(argv))], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == "error kvgen calibrate needs transformers: pip install 'kvgen[hf]'"


def test_no_or_empty_chunks_are_refused():
    model, spec = tiny_model("qwen3"), parse_spec(spec_text())
    with pytest.raises(CalibrateError, match="no token chunks"):
        calibrate(model, [], spec)
    with pytest.raises(CalibrateError, match="token chunk 1 is empty"):
        calibrate(model, [torch.tensor([3, 4]), torch.tensor([], dtype=torch.int64)], spec)
    assert not model.training and not model.model.layers[0].self_attn.q_norm._forward_hooks   # hooks removed
