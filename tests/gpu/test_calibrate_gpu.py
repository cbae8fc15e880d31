"""``kvgen calibrate`` on the GPU: a random-initialised model of Qwen3-8B's real shape (36 layers,
GQA 32/8, head_dim 128, rope_theta 1e6, built from the config in code, no weights), bfloat16,
against the shipped ``qwen3-8b`` spec.

The statistics must equal the float64 means of the queries the model hands to its
``apply_rotary_pos_emb`` (recorded by tests/test_calibrate.py's patch), within float32 rounding of
the stored means (rtol 1e-6), and both written forms must load back equal. Two forward passes of
4096 tokens; it prints the calibration throughput.
"""

from __future__ import annotations

import time

import pytest
import torch

from kvgen.calibrate import calibrate, write_outputs
from kvgen.lower.triattention import calibration_defaults, tri_geometry
from kvgen.reference.triattention import load_calibration
from kvgen.spec.schema import load_spec
from tests.conftest import SPECS_DIR
from tests.test_calibrate import direct_means, record_rope_inputs

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.gpu

QWEN3_8B = {"vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
            "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 40960,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}, "tie_word_embeddings": False}
CHUNKS, CHUNK_TOKENS = 2, 4096


def test_qwen3_8b_shape_bf16_statistics_match_the_captured_queries(monkeypatch, tmp_path):
    spec = load_spec(SPECS_DIR / "qwen3-8b.yaml")
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(transformers.Qwen3Config(**QWEN3_8B),
                                                              dtype=torch.bfloat16).eval()
    generator = torch.Generator().manual_seed(1)
    chunks = [torch.randint(0, QWEN3_8B["vocab_size"], (CHUNK_TOKENS,), generator=generator) for _ in range(CHUNKS)]
    calibrate(model, chunks[:1], spec)   # warm-up: kernels and allocator, off the clock
    seen = record_rope_inputs(model, monkeypatch)
    torch.cuda.synchronize()
    start = time.perf_counter()
    run = calibrate(model, chunks, spec)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    print(f"\ncalibrate qwen3-8b shape, bf16: {run.tokens} tokens in {seconds:.3f} s "
          f"({run.tokens / seconds:.0f} tokens/s, forward and recording patch included); "
          f"concentration {run.concentration:.4f}")
    geometry = tri_geometry(spec)
    e_q, e_norm = direct_means(seen, geometry.num_layers, geometry.pairing, geometry.rotary_dim)
    torch.testing.assert_close(run.calibration.E_q, e_q, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(run.calibration.E_q_norm, e_norm, rtol=1e-6, atol=1e-7)
    flat, upstream = tmp_path / "qwen3-8b.pt", tmp_path / "qwen3-8b.upstream.pt"
    write_outputs(run, flat, upstream)
    omega, scale = calibration_defaults(spec)
    for path in (flat, upstream):
        loaded = load_calibration(path, geometry, omega, scale)
        assert torch.equal(loaded.E_q, run.calibration.E_q) and torch.equal(loaded.E_q_norm, run.calibration.E_q_norm)
