"""``kvgen.integrations.transformers`` on the GPU, inside ``model.generate()`` of tiny random-init
models shaped like registry families, beside ``DynamicCache`` (greedy):

- the offloading cache generates the same tokens and the same logits bit for bit as
  ``DynamicCache`` (the pages hold the same bf16 values); after ``offload()`` / the automatic
  onboard, cold pages and restored pages are byte-exact to the oracle's codec, the lossless RoPE
  span (qwen3.5-397b-a17b-lossless-rope) bit-exact to the original, and a continued ``generate()``
  gives logits identical to a ``DynamicCache`` holding the oracle's decoded history;
- the TriAttention cache, calibrated by ``kvgen calibrate`` on the same random-init model (2048
  random token ids, the upstream-form file), scores with exactly the measured statistics and runs
  rounds with the registry's generated scorer, selection, packer and compactor, its kept sets
  agreeing with the oracle's ``eviction_round`` (scores within the score kernel's tolerance, so a
  near tie at the budget cut may differ), and equals ``DynamicCache`` while no round is due.

Needs the carried sm_90a registry (``KVGEN_REGISTRY`` or build/registry) and transformers.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from transformers import DynamicCache  # noqa: E402

from kvgen.integrations.transformers import KvgenOffloadedCache, KvgenTriAttentionCache  # noqa: E402
from kvgen.runtime.eviction import registry_config  # noqa: E402
from kvgen.runtime.lookup import RuntimeRegistry  # noqa: E402
from kvgen.spec.schema import load_spec  # noqa: E402

from ..conftest import SPECS_DIR  # noqa: E402
from ..hf_models import (  # noqa: E402
    RoundOracle,
    calibrate_random_tokens,
    deterministic_attention,
    offload_round_trip,
    oracle_history,
    tiny_model,
)
from .conftest import ARCH, REGISTRY  # noqa: E402

pytestmark = pytest.mark.gpu

SIZES = {"hidden": 256, "intermediate": 512, "vocab": 1024}


def _family(name: str):
    registry = RuntimeRegistry([REGISTRY])
    try:
        resolved = registry.resolve(name, ARCH)
    except Exception as exc:  # noqa: BLE001 - a registry without the family: say which
        pytest.skip(f"{name} not in {REGISTRY} for {ARCH}: {exc}")
    return registry, registry_config(resolved)


def _generate(model, ids, cache, new: int):
    with deterministic_attention():   # the comparisons are bit for bit
        return model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, past_key_values=cache,
                              output_logits=True, return_dict_in_generate=True)


@pytest.mark.parametrize("family", ["qwen3-8b", "qwen3.5-397b-a17b-lossless-rope"])
def test_offloading_cache_in_generate(family: str) -> None:
    registry, config = _family(family)
    model = tiny_model(config, "cuda", **SIZES)
    ids = torch.randint(0, SIZES["vocab"], (2, 100), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    cache = KvgenOffloadedCache(model.config, family, registry=registry, arch=ARCH, max_cache_len=256)
    ref_cache = DynamicCache()
    mine, ref = _generate(model, ids, cache, 20), _generate(model, ids, ref_cache, 20)
    assert torch.equal(mine.sequences, ref.sequences)
    assert all(torch.equal(a, b) for a, b in zip(mine.logits, ref.logits))

    trip = offload_round_trip(cache)
    assert trip["strategy"] == "staged"
    assert trip["cold_byte_exact_vs_oracle"] and trip["restored_byte_exact_vs_oracle"], trip
    assert trip["lossless_span_bit_exact"] in ((True,) if family != "qwen3-8b" else (None,)), trip

    # Leave again; the next forward onboards. It must match the oracle's decode of those cold pages exactly.
    cache.offload()
    oracle_cache = oracle_history(cache)
    turn = torch.cat([mine.sequences, ids[:, :16]], dim=1)
    again, oracle = _generate(model, turn, cache, 8), _generate(model, turn, oracle_cache, 8)
    assert cache.offloaded is None
    assert torch.equal(again.sequences, oracle.sequences)
    assert all(torch.equal(a, b) for a, b in zip(again.logits, oracle.logits))


def test_triattention_cache_in_generate(tmp_path: Path) -> None:
    registry, config = _family("qwen3-8b")
    model = tiny_model(config, "cuda", **SIZES)
    calibrated = calibrate_random_tokens(model, load_spec(SPECS_DIR / "qwen3-8b.yaml"), tmp_path, 2048, 1024)
    print(f"\nkvgen calibrate: {calibrated.describe()}")
    calibration = calibrated.upstream
    ids = torch.randint(0, SIZES["vocab"], (1, 64), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    budget, beta = 128, 32

    quiet = KvgenTriAttentionCache(model.config, "qwen3-8b", calibration, registry=registry, arch=ARCH,
                                   max_cache_len=64 + budget + beta, budget=budget, beta=beta)
    mine, ref = _generate(model, ids, quiet, budget), _generate(model, ids, DynamicCache(), budget)
    assert quiet.rounds == [] and torch.equal(mine.sequences, ref.sequences)

    oracle = RoundOracle()
    cache = KvgenTriAttentionCache(model.config, "qwen3-8b", calibration, registry=registry, arch=ARCH,
                                   max_cache_len=64 + budget + beta, budget=budget, beta=beta, on_round=oracle)
    _generate(model, ids, cache, budget + 4 * beta + 1)
    assert torch.equal(cache.manager.calibration.E_q, calibrated.run.calibration.E_q)
    assert len(cache.rounds) == 4
    assert all(r.after == 64 + budget for r in cache.rounds)
    agreement = oracle.agreement(cache)
    assert min(agreement) >= 0.98, agreement
    assert cache.evicted_bytes() > 0
