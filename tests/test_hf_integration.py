"""``kvgen.integrations.transformers`` on the CPU: refusals of models the family does not describe,
the mapping of transformers' ``[B, H, T, D]`` K/V to the family's pages and back (through the
oracle's cold-page codec too), and the TriAttention cache inside a real ``generate()``, calibrated
by ``kvgen calibrate`` on the same model, with the oracle standing in for the GPU kernels (kept
sets equal to ``eviction_round``'s, exactly).

The codec and the score kernel need a GPU: ``tests/gpu/test_hf_gpu.py`` runs both caches there.
Models are tiny random-initialised Qwen3 / Qwen3.5-text configs (no hub access), 2 layers, with
the family's attention geometry and little else (hidden 32, MLP 64, vocabulary 64); most of this
file's time is importing transformers."""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, replace

import pytest
import torch

pytest.importorskip("transformers")

from transformers import DynamicCache  # noqa: E402

from kvgen.integrations.transformers import (  # noqa: E402
    KvgenOffloadedCache,
    KvgenTriAttentionCache,
    ModelMismatch,
    PagedKV,
    PagePool,
    check_model,
    reference_record,
)
from kvgen.lower.layout import family_layout, to_json  # noqa: E402
from kvgen.lower.triattention import eviction_config  # noqa: E402
from kvgen.reference.codec import decode_records, encode_records  # noqa: E402
from kvgen.reference.layout import LayerRecord, record_regions  # noqa: E402
from kvgen.reference.triattention import load_calibration, rope_defaults  # noqa: E402
from kvgen.runtime.eviction import TriAttentionManager  # noqa: E402
from kvgen.runtime.lookup import RegistryLayout  # noqa: E402
from kvgen.spec.schema import load_spec  # noqa: E402

from .conftest import SPECS_DIR  # noqa: E402
from .hf_models import (  # noqa: E402
    OracleCodec,
    RoundOracle,
    calibrate_random_tokens,
    config_for,
    offload_round_trip,
    oracle_history,
    tiny_model,
)
from .test_triattention_runtime import OracleScorer  # noqa: E402
from .tri_sim import small_spec  # noqa: E402


@dataclass
class _Entry:
    family: str
    layout: dict


@dataclass
class _Resolved:
    """Duck-types ``kvgen.runtime.lookup.Resolved`` (``entry.layout``, ``layout()``, ``arch``)."""

    entry: _Entry
    arch: str = "cpu"

    def layout(self) -> RegistryLayout:
        return RegistryLayout.from_json(self.entry.layout)


class _Registry:
    """A registry of specs, as the manifest would carry them (layout JSON through JSON)."""

    def __init__(self, *specs):
        self.specs = {spec.name: spec for spec in specs}

    def resolve(self, family: str, arch: str | None = None) -> _Resolved:
        spec = self.specs[family]
        return _Resolved(_Entry(family, json.loads(json.dumps(to_json(spec, family_layout(spec))))))


def _spec(name: str, layers: int = 2):
    return small_spec(load_spec(SPECS_DIR / f"{name}.yaml"), layers)


VOCAB = 64


@functools.cache
def _model(family: str):  # noqa: ANN202 - one tiny model per family for the whole module
    return tiny_model(eviction_config(_spec(family)), "cpu", hidden=32, intermediate=64, vocab=VOCAB)


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201 - a hf_models.Calibrated
    """``kvgen calibrate`` of the qwen3-8b model (2 layers) over 256 random tokens in two passes,
    both forms written: ~0.3 s on the CPU, so no synthetic statistics are needed here."""
    return calibrate_random_tokens(_model("qwen3-8b"), _spec("qwen3-8b"), tmp_path_factory.mktemp("calib"), 256, 128)


# ---------------------------------------------------------------- refusals


@pytest.mark.parametrize("change, message", [
    ({"num_hidden_layers": 3}, "num_hidden_layers 3, family 2"),
    ({"num_key_value_heads": 4}, "num_key_value_heads 4, family 8"),
    ({"head_dim": 64}, "head_dim 64, family 128"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}, "rope_theta 10000.0, family 1000000.0"),
    ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}},
     "rope_type 'linear', the family has no RoPE scaling"),
    ({"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 64, "use_sliding_window": True},
     "these caches serve full attention in every layer"),
])
def test_a_model_the_family_does_not_describe_is_refused(change: dict, message: str) -> None:
    spec = _spec("qwen3-8b")
    config = config_for(eviction_config(spec))
    for key, value in change.items():
        setattr(config, key, value)
    for cache in (KvgenOffloadedCache, KvgenTriAttentionCache):
        args = (config, "qwen3-8b") if cache is KvgenOffloadedCache else (config, "qwen3-8b", "unused.pt")
        with pytest.raises(ModelMismatch, match="qwen3 config does not match kvgen family qwen3-8b") as info:
            cache(*args, registry=_Registry(spec))
        assert message in str(info.value)


def test_partial_rotary_is_checked_against_the_family() -> None:
    lossless = _spec("qwen3.5-397b-a17b-lossless-rope")
    check_model(config_for(eviction_config(lossless)), eviction_config(lossless))   # 64 of 256 rotate
    full = config_for(eviction_config(_spec("qwen3-8b")))
    with pytest.raises(ModelMismatch, match=r"rotary dim \(head_dim \* partial_rotary_factor\) 64, family 128"):
        check_model(config_for(eviction_config(lossless)), eviction_config(_spec("qwen3-8b")))
    assert full.head_dim == 128


def test_a_family_without_per_head_pages_is_refused() -> None:
    spec = _spec("deepseek-v3")
    config = config_for(eviction_config(_spec("qwen3-8b")))
    with pytest.raises(ModelMismatch, match="deepseek-v3: no TriAttention eviction from the registry.*per-head K/V"):
        KvgenOffloadedCache(config, "deepseek-v3", registry=_Registry(spec))


def test_the_hot_dtype_is_checked_at_the_first_forward() -> None:
    spec = _spec("qwen3-8b")
    cache = KvgenOffloadedCache(config_for(eviction_config(spec)), "qwen3-8b", registry=_Registry(spec))
    with pytest.raises(ModelMismatch, match="K/V dtype torch.float32, family qwen3-8b keeps bf16 pages"):
        cache.update(torch.zeros(1, 8, 3, 128), torch.zeros(1, 8, 3, 128), 0)


# ---------------------------------------------------------------- pages


@pytest.mark.parametrize("family", ["qwen3-8b", "qwen3-8b-nhd"])
def test_pages_hold_tokens_in_the_family_layout_and_read_back(family: str) -> None:
    g = eviction_config(_spec(family)).geometry
    store = PagedKV(PagePool(g, 8, torch.bfloat16, "cpu"), batch=2, capacity=70)
    gen = torch.Generator().manual_seed(1)
    k = torch.randn(2, g.kv_heads, 45, g.head_dim, generator=gen).bfloat16()
    store.write(0, k[:, :, :40], k[:, :, :40], 0)
    store.write(0, k[:, :, 40:], k[:, :, 40:], 40)       # a second write starts mid-page
    keys, values = store.read(0, 45)
    assert torch.equal(keys, k) and keys.is_contiguous() and torch.equal(values, k)
    tpb = g.tokens_per_block
    page = store.k[0][store.page_table[1, 1]]             # row 1, tokens 32..63
    token_rows = page[:, 13] if g.layout == "HND" else page[13]   # token 45 would be slot 13: not written
    assert torch.equal(token_rows, torch.zeros_like(token_rows))
    expected = k[1, :, tpb + 3]                           # token 35 of row 1: [H, D]
    assert torch.equal(page[:, 3] if g.layout == "HND" else page[3], expected)
    with pytest.raises(ValueError, match="kvgen cache full: 97 tokens per row, max_cache_len gives 96"):
        more = torch.zeros(2, g.kv_heads, 52, g.head_dim, dtype=torch.bfloat16)
        store.write(0, more, more, 45)


@pytest.mark.parametrize("family", ["qwen3-8b", "qwen3.5-397b-a17b-lossless-rope"])
def test_pages_through_the_oracle_codec_are_the_rows_through_it(family: str) -> None:
    """Each cold-page row is one (head, token) K or V row: restored pages read back as the oracle's
    round trip of the [B, H, T, D] rows themselves; the lossless RoPE span comes back bit for bit."""
    spec = _spec(family)
    g = eviction_config(spec).geometry
    record = reference_record(RegistryLayout.from_json(json.loads(json.dumps(to_json(spec, family_layout(spec))))))
    store = PagedKV(PagePool(g, 2, torch.bfloat16, "cpu"), batch=1, capacity=64)
    k = torch.randn(1, g.kv_heads, 64, g.head_dim, generator=torch.Generator().manual_seed(2)).bfloat16()
    v = -k
    store.write(1, k, v, 0)
    cold = encode_records(record, {"k": store.k[1], "v": store.v[1]})
    restored, _ = decode_records(record, cold, "bf16")
    store.k[1].copy_(restored["k"].view_as(store.k[1]))
    keys, _ = store.read(1, 64)
    rows = k.reshape(-1, 1, g.head_dim)                   # every row its own "page" of one row
    row_record = _one_row_record(record)
    expected, _ = decode_records(row_record, encode_records(row_record, {"k": rows, "v": rows}), "bf16")
    assert torch.equal(keys.reshape(-1, g.head_dim).view(torch.int16),
                       expected["k"].reshape(-1, g.head_dim).view(torch.int16))
    span = slice(g.rotary_start, g.rotary_start + g.rotary_dim)
    lossless = record.buffers[0].prefix >= g.rotary_dim
    assert lossless == (family != "qwen3-8b")
    if lossless:
        assert torch.equal(keys[..., span].view(torch.int16), k[..., span].view(torch.int16))


def _one_row_record(record: LayerRecord) -> LayerRecord:
    """The record with pages of one row each: same row spans, regions sized for one row."""
    buffers = tuple(replace(b, rows=1) for b in record.buffers)
    regions, size = record_regions(buffers, record.sides)
    return LayerRecord(buffers, record.sides, tuple(regions), size)


# ---------------------------------------------------------------- offloading in generate()


@pytest.mark.parametrize("family", ["qwen3-8b", "qwen3.5-397b-a17b-lossless-rope"])
def test_offloading_cache_in_generate_with_the_oracle_codec(family: str) -> None:
    """The cache's flow with the oracle's codec standing in for the kernels: same tokens and logits
    as DynamicCache; offload then the automatic onboard; the continued generate() equal, bit for
    bit, to a DynamicCache holding the oracle's decode of the cold pages (the proof's bound 0)."""
    spec = _spec(family)
    model = _model(family)
    ids = torch.randint(0, VOCAB, (2, 30), generator=torch.Generator().manual_seed(5))
    cache = KvgenOffloadedCache(model.config, family, registry=_Registry(spec), max_cache_len=64,
                                codec_factory=OracleCodec)
    kw = {"do_sample": False, "output_logits": True, "return_dict_in_generate": True}
    mine = model.generate(ids, max_new_tokens=6, past_key_values=cache, **kw)   # 35 tokens cached: 2 pages a row
    ref = model.generate(ids, max_new_tokens=6, past_key_values=DynamicCache(), **kw)
    assert torch.equal(mine.sequences, ref.sequences)
    assert all(torch.equal(a, b) for a, b in zip(mine.logits, ref.logits))
    trip = offload_round_trip(cache)
    assert trip["pages"] == 2 * 2 and trip["cold_byte_exact_vs_oracle"] and trip["restored_byte_exact_vs_oracle"]
    assert trip["lossless_span_bit_exact"] is (None if family == "qwen3-8b" else True)
    cache.offload()
    history = oracle_history(cache)
    turn = torch.cat([mine.sequences, ids[:, :5]], dim=1)
    again = model.generate(turn, max_new_tokens=4, past_key_values=cache, **kw)
    oracle = model.generate(turn, max_new_tokens=4, past_key_values=history, **kw)
    assert cache.offloaded is None, "the first forward onboards"
    assert torch.equal(again.sequences, oracle.sequences)
    assert all(torch.equal(a, b) for a, b in zip(again.logits, oracle.logits))


def test_caches_sharing_a_pool_take_turns_on_the_gpu() -> None:
    """Two conversations, one pool that holds one of them: the paused one waits on the host."""
    spec = _spec("qwen3-8b")
    model = _model("qwen3-8b")
    g = eviction_config(spec).geometry
    pool = PagePool(g, 2, torch.bfloat16, "cpu", host_pages=4)   # 2 hot pages: one row of up to 64 tokens
    kw = {"do_sample": False, "output_logits": True, "return_dict_in_generate": True}
    a, b = (KvgenOffloadedCache(model.config, "qwen3-8b", registry=_Registry(spec), max_cache_len=64, pool=pool,
                                codec_factory=OracleCodec) for _ in range(2))
    ids = torch.randint(0, VOCAB, (2, 1, 36), generator=torch.Generator().manual_seed(6))
    first = model.generate(ids[0], max_new_tokens=4, past_key_values=a, **kw)
    with pytest.raises(ValueError, match="page pool: 2 hot pages asked for, 0 of 2 free"):
        model.generate(ids[1], max_new_tokens=4, past_key_values=b, **kw)
    b.close()
    a.offload()
    assert pool.free == [0, 1] and a.store.row_pages == 0
    other = KvgenOffloadedCache(model.config, "qwen3-8b", registry=_Registry(spec), max_cache_len=64, pool=pool,
                                codec_factory=OracleCodec)
    model.generate(ids[1], max_new_tokens=4, past_key_values=other, **kw)
    other.offload()
    history = oracle_history(a)
    turn = torch.cat([first.sequences, ids[1][:, :3]], dim=1)
    again = model.generate(turn, max_new_tokens=3, past_key_values=a, **kw)
    oracle = model.generate(turn, max_new_tokens=3, past_key_values=history, **kw)
    assert all(torch.equal(x, y) for x, y in zip(again.logits, oracle.logits))
    assert pool.free == [] and pool.free_slots == [0, 1]   # a back on the GPU, other's 2 pages on the host (2, 3)


# ---------------------------------------------------------------- TriAttention in generate()


def _oracle_factory(resolved, calibration, k_pools, v_pools, **overrides) -> TriAttentionManager:
    """``from_registry`` with the oracle standing in for the GPU kernels (scorer, selection, packer,
    compactor): what the CPU can run."""
    config = eviction_config(_spec("qwen3-8b"))
    omega, scale = rope_defaults(config.geometry.rotary_dim, config.rope_theta, config.rope_scaling)
    scorer = OracleScorer(config.family, k_pools, load_calibration(calibration, config.geometry, omega, scale),
                          config.geometry)
    overrides.setdefault("max_position", 64)   # the mean-phase table doubles as positions grow; 2^15 rows: ~1 s
    return TriAttentionManager(config, calibration, k_pools, v_pools, scorer, selector="oracle", **overrides)


def test_calibrate_then_triattention_cache_in_generate_keeps_the_oracle_sets(calibrated) -> None:  # noqa: ANN001
    """kvgen calibrate -> its flat file -> KvgenTriAttentionCache in generate(): the manager scores
    with exactly the statistics calibrate measured, and every round keeps the oracle's sets."""
    spec = _spec("qwen3-8b")
    calibration = calibrated.flat
    model = _model("qwen3-8b")
    prompt = torch.randint(0, VOCAB, (1, 24), generator=torch.Generator().manual_seed(3))
    oracle = RoundOracle()
    cache = KvgenTriAttentionCache(model.config, "qwen3-8b", calibration, registry=_Registry(spec),
                                   max_cache_len=24 + 16 + 8, budget=16, beta=8, manager_factory=_oracle_factory,
                                   on_round=oracle)
    out = model.generate(prompt, max_new_tokens=40, do_sample=False, past_key_values=cache)
    assert out.shape[1] == 24 + 40
    assert cache.seen == 24 + 40 - 1                        # the last token is sampled, never cached
    assert [(r.before, r.after) for r in cache.rounds] == [(24 + 24, 24 + 16)] * len(cache.rounds)
    assert len(cache.rounds) == 2                           # at 24 and 32 generated tokens cached (39 in all)
    assert oracle.agreement(cache) == [1.0] * 2             # the oracle's own scores: identical sets
    measured = calibrated.run.calibration
    assert torch.equal(cache.manager.calibration.E_q, measured.E_q)
    assert torch.equal(cache.manager.calibration.E_q_norm, measured.E_q_norm)
    assert cache.length == 24 + 16 + (cache.seen - cache.rounds[-1].seen)
    assert cache.evicted_bytes() == (cache.seen - cache.length) * 2 * 2 * 8 * 128 * 2


def test_without_eviction_generate_equals_dynamic_cache(calibrated) -> None:  # noqa: ANN001
    spec = _spec("qwen3-8b")
    calibration = calibrated.upstream                       # the upstream form loads as well
    model = _model("qwen3-8b")
    prompt = torch.randint(0, VOCAB, (2, 20), generator=torch.Generator().manual_seed(4))
    cache = KvgenTriAttentionCache(model.config, "qwen3-8b", calibration, registry=_Registry(spec),
                                   max_cache_len=20 + 16 + 8, budget=16, beta=8, manager_factory=_oracle_factory)
    mine = model.generate(prompt, max_new_tokens=17, do_sample=False, past_key_values=cache,   # 16 cached: no round
                          output_logits=True, return_dict_in_generate=True)
    ref = model.generate(prompt, max_new_tokens=17, do_sample=False, past_key_values=DynamicCache(),
                         output_logits=True, return_dict_in_generate=True)
    assert cache.rounds == []
    assert torch.equal(mine.sequences, ref.sequences)
    assert all(torch.equal(a, b) for a, b in zip(mine.logits, ref.logits))
