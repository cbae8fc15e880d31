"""The TriAttention oracle against hand computations, the paper's formula and its own invariants."""

from __future__ import annotations

import json
import math
import pickle
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvgen.reference import triattention as T
from kvgen.reference.triattention import Calibration, CalibrationError, GeometryError, TriGeometry


def geometry(**overrides) -> TriGeometry:
    fields = dict(num_layers=2, query_heads=4, kv_heads=2, head_dim=12, rotary_start=0, rotary_dim=12,
                  pairing="half", tokens_per_block=4, layout="HND", swa_window=(None, None))
    fields.update(overrides)
    return TriGeometry(**fields)


# ------------------------------------------------------------------------------------------------
# Geometry
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("overrides, field", [
    (dict(query_heads=6, kv_heads=4), "query_heads"),
    (dict(rotary_dim=7), "rotary_dim"),
    (dict(rotary_start=6, rotary_dim=8), "rotary_dim"),
    (dict(rotary_start=-1), "rotary_start"),
    (dict(pairing="neox"), "pairing"),
    (dict(layout="HDN"), "layout"),
    (dict(swa_window=(None,)), "swa_window"),
    (dict(swa_window=(4, 4)), "swa_window"),
    (dict(swa_window=(None, 0)), "swa_window[1]"),
    (dict(kv_heads=0), "kv_heads"),
    (dict(head_dim=True), "head_dim"),
])
def test_geometry_rejects(overrides, field):
    with pytest.raises(GeometryError, match=rf"TriGeometry\.{re.escape(field)}"):
        geometry(**overrides)


def test_geometry_derived_and_hashable():
    g = geometry(swa_window=[None, 8])  # a list is frozen into a tuple
    assert g.swa_window == (None, 8)
    assert (g.freqs, g.group, g.scored_layers) == (6, 2, (0,))
    assert hash(g) == hash(geometry(swa_window=(None, 8)))


@pytest.mark.parametrize("kind", ["mla", "csa"])
def test_mla_is_refused(kind):
    # DeepSeek-V3 MLA: 128 query heads over one 576-wide latent (last 64 elements: RoPE key).
    with pytest.raises(GeometryError, match=f"cannot serve attention: {kind}"):
        geometry(query_heads=128, kv_heads=1, head_dim=576, rotary_start=512, rotary_dim=64, attention=kind)


@pytest.mark.parametrize("overrides", [dict(attention="mqa"), dict(attention="mha"), dict(attention="linear")])
def test_attention_kind_checked(overrides):
    with pytest.raises(GeometryError, match=r"TriGeometry\.(kv_heads|attention)"):
        geometry(**overrides)
    assert geometry(attention="mqa", kv_heads=1).group == 4
    assert geometry(attention="mha", kv_heads=4).group == 1


SERVABLE = dict(attention="gqa", rope_placement="leading", scored_layers=3, enabled=True, dtype="bf16")


@pytest.mark.parametrize("overrides, reason", [
    (dict(attention="mla"), "TriAttention cannot serve attention: mla (one shared latent per token, no KV-head"),
    (dict(attention="csa"), "TriAttention cannot serve attention: csa (one shared latent per token, no KV-head"),
    (dict(rope_placement="none"), "TriAttention scores RoPE frequencies; this family has no RoPE"),
    (dict(dtype="fp8_e4m3"), "TriAttention scoring reads bf16 or fp16 K, not fp8_e4m3 (fp8 K scoring is out of"),
    (dict(scored_layers=0), "every layer is sliding-window; nothing is scored"),
    (dict(enabled=False), "triattention.enabled is false; nothing to score"),
    # the order: a disabled fp8 family reads "not enabled", a disabled MLA family "cannot serve"
    (dict(enabled=False, dtype="fp8_e4m3"), "triattention.enabled is false"),
    (dict(enabled=False, attention="mla"), "TriAttention cannot serve attention: mla"),
])
def test_refusal_reason_states_each_refusal(overrides, reason):
    assert T.refusal_reason(**SERVABLE) is None
    got = T.refusal_reason(**{**SERVABLE, **overrides})
    assert got is not None and got.startswith(reason)


def test_refusal_reason_checks_only_what_it_is_given():
    assert T.refusal_reason("gqa") is None
    assert T.refusal_reason("mha", dtype="fp16") is None
    assert T.refusal_reason("gqa", dtype="fp8_e4m3") is not None


def test_geometry_refusals_are_the_shared_ones():
    with pytest.raises(GeometryError) as info:
        geometry(swa_window=(4, 4))
    assert str(info.value) == f"TriGeometry.swa_window: {T.refusal_reason('gqa', scored_layers=0)}"
    with pytest.raises(GeometryError) as info:
        geometry(query_heads=16, kv_heads=1, head_dim=576, rotary_start=512, rotary_dim=64, attention="csa")
    assert str(info.value) == f"TriGeometry.attention: {T.refusal_reason('csa')}"


@pytest.mark.parametrize("layout, shape", [("HND", (2, 4, 12)), ("NHD", (4, 2, 12))])
def test_page_shape(layout, shape):
    assert T.page_shape(layout, kv_heads=2, tokens_per_block=4, head_dim=12) == shape
    assert geometry(layout=layout).page_shape == shape


def test_page_shape_refuses_another_layout():
    with pytest.raises(GeometryError, match="layout 'HDN'; accepted: HND, NHD"):
        T.page_shape("HDN", 2, 4, 12)


def test_geometry_json_round_trip():
    g = geometry(num_layers=3, swa_window=(None, 8, None), layout="NHD", pairing="interleaved", rotary_start=4,
                 rotary_dim=8)
    data = json.loads(json.dumps(g.to_json()))
    assert data["swa_window"] == [None, 8, None]
    assert TriGeometry.from_json(data) == g
    with pytest.raises(ValueError, match=r"here: unknown key 'rotary'; accepted: num_layers"):
        TriGeometry.from_json({**data, "rotary": 1}, "here")
    del data["layout"]
    with pytest.raises(ValueError, match=r"here: missing key 'layout'"):
        TriGeometry.from_json(data, "here")


# ------------------------------------------------------------------------------------------------
# EvictionConfig
# ------------------------------------------------------------------------------------------------

def config(**overrides) -> T.EvictionConfig:
    fields = dict(family="fam", geometry=geometry(num_layers=3, swa_window=(None, 8, None)), dtype="bf16",
                  budget=16, beta=4, eviction_mode="per_head", rope_theta=500000.0,
                  rope_scaling={"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 8192})
    fields.update(overrides)
    return T.EvictionConfig(**fields)


@pytest.mark.parametrize("overrides", [{}, dict(rope_scaling=None, rope_theta=10000.0, eviction_mode="union")])
def test_eviction_config_json_round_trip(overrides):
    c = config(**overrides)
    data = json.loads(json.dumps(c.to_json()))
    assert T.EvictionConfig.from_json(data) == c
    assert data["geometry"] == c.geometry.to_json()


def test_eviction_config_keeps_its_own_scaling():
    scaling = {"type": "linear", "factor": 2.0}
    c = config(rope_scaling=scaling)
    scaling["factor"] = 4.0
    c.to_json()["rope_scaling"]["factor"] = 8.0
    assert c.rope_scaling == {"type": "linear", "factor": 2.0}


@pytest.mark.parametrize("overrides, message", [
    (dict(dtype="fp8_e4m3"), "fam: TriAttention scoring reads bf16 or fp16 K, not fp8_e4m3"),
    (dict(eviction_mode="max"), "fam: eviction_mode 'max'; accepted: union, per_head, per_layer_perhead"),
    (dict(budget=4), "layer 1: budget 4 < sliding window 8"),
    (dict(budget=0), "budget 0: expected a positive int"),
    (dict(beta=0), "fam: beta 0: expected a positive int"),
    (dict(rope_theta=float("nan")), "fam: rope_theta nan: expected a positive number"),
    (dict(geometry={"num_layers": 3}), "fam: geometry must be a TriGeometry, got dict"),
])
def test_eviction_config_refuses(overrides, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        config(**overrides)


def test_eviction_config_from_json_names_the_source_and_key():
    data = config().to_json()
    with pytest.raises(ValueError, match=r"manifest: unknown key 'omega'"):
        T.EvictionConfig.from_json({**data, "omega": [1.0]}, "manifest")
    with pytest.raises(ValueError, match=r"manifest: missing key 'beta'"):
        T.EvictionConfig.from_json({k: v for k, v in data.items() if k != "beta"}, "manifest")
    with pytest.raises(ValueError, match=r"manifest.geometry: missing key 'layout'"):
        T.EvictionConfig.from_json({**data, "geometry": {k: v for k, v in data["geometry"].items()
                                                          if k != "layout"}}, "manifest")
    with pytest.raises(ValueError, match=r"manifest: expected a JSON object, got list"):
        T.EvictionConfig.from_json([], "manifest")


# ------------------------------------------------------------------------------------------------
# RoPE frequencies
# ------------------------------------------------------------------------------------------------

def test_default_omega_and_linear():
    omega = T.rope_omega(8, 10000.0, None)
    expected = torch.tensor([10000.0 ** (-2 * f / 8) for f in range(4)], dtype=torch.float64)
    assert omega.dtype == torch.float32
    torch.testing.assert_close(omega.double(), expected, rtol=1e-6, atol=0)
    linear = T.rope_omega(8, 10000.0, {"type": "linear", "factor": 4.0})
    torch.testing.assert_close(linear, omega / 4)
    torch.testing.assert_close(T.rope_freq_scale_sq(8, None), torch.ones(4))


def test_llama3_omega_by_hand():
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    base = T.rope_omega(128, 500000.0, None)
    omega = T.rope_omega(128, 500000.0, scaling)
    wavelen = [2 * math.pi / float(w) for w in base]
    for f in range(64):
        if wavelen[f] < 2048:      # high frequency: unchanged
            expected = float(base[f])
        elif wavelen[f] > 8192:    # low frequency: divided by the factor
            expected = float(base[f]) / 8
        else:                      # in between: blend
            smooth = (8192 / wavelen[f] - 1) / (4 - 1)
            expected = (1 - smooth) * float(base[f]) / 8 + smooth * float(base[f])
        assert float(omega[f]) == pytest.approx(expected, rel=1e-6)
    assert any(2048 <= w <= 8192 for w in wavelen)  # the blend was exercised


def test_yarn_omega_and_attention_factor_by_hand():
    # gpt-oss-20b: theta 150000, R 64, factor 32, beta_fast 32, beta_slow 1, original 4096.
    scaling = {"type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
               "original_max_position_embeddings": 4096}
    base = T.rope_omega(64, 150000.0, None)
    omega = T.rope_omega(64, 150000.0, scaling)
    low = math.floor(64 * math.log(4096 / (32 * 2 * math.pi)) / (2 * math.log(150000)))
    high = math.ceil(64 * math.log(4096 / (1 * 2 * math.pi)) / (2 * math.log(150000)))
    assert (low, high) == (8, 18)
    for f in range(32):
        ramp = min(max((f - low) / (high - low), 0.0), 1.0)
        expected = float(base[f]) / 32 * ramp + float(base[f]) * (1 - ramp)
        assert float(omega[f]) == pytest.approx(expected, rel=1e-6)
    factor = 0.1 * math.log(32) + 1
    torch.testing.assert_close(T.rope_freq_scale_sq(64, scaling), torch.full((32,), factor * factor))
    deepseek = dict(scaling, mscale=1.0, mscale_all_dim=1.0)
    torch.testing.assert_close(T.rope_freq_scale_sq(64, deepseek), torch.ones(32))
    assert T.yarn_attention_factor(dict(scaling, attention_factor=2.0)) == 2.0


def test_longrope_omega_and_attention_factor_by_hand():
    # Phi-3-style: rescale factors per pair, short within the pretrained context, long past it.
    scaling = {"rope_type": "longrope", "short_factor": [1.0, 1.5, 2.0, 3.0], "long_factor": [1.0, 4.0, 8.0, 16.0],
               "original_max_position_embeddings": 4096, "factor": 32.0}
    base = T.rope_omega(8, 10000.0, None)
    for seq_len, key in ((4096, "short_factor"), (4097, "long_factor"), (None, "long_factor")):
        expected = torch.tensor([float(base[f]) / scaling[key][f] for f in range(4)], dtype=torch.float64)
        torch.testing.assert_close(T.rope_omega(8, 10000.0, scaling, seq_len=seq_len).double(), expected,
                                   rtol=1e-6, atol=0)
    factor = math.sqrt(1 + math.log(32) / math.log(4096))
    torch.testing.assert_close(T.rope_freq_scale_sq(8, scaling), torch.full((4,), factor * factor))
    assert T.rope_attention_factor(dict(scaling, factor=1.0)) == 1.0
    assert T.rope_attention_factor(dict(scaling, attention_factor=1.25)) == 1.25


@pytest.mark.parametrize("scaling, message", [
    ({"type": "dynamic", "factor": 2.0}, "not supported"),
    ({"type": "longrope", "short_factor": [1.0], "long_factor": [1.0], "original_max_position_embeddings": 4096},
     "long_factor has 1 entries; rotary_dim 64 needs 32"),
    ({"type": "llama3", "factor": 8.0}, "low_freq_factor"),
    ({"type": "yarn", "factor": 4.0}, "original_max_position_embeddings"),
])
def test_rope_scaling_errors(scaling, message):
    with pytest.raises(ValueError, match=message):
        T.rope_omega(64, 10000.0, scaling)


# ------------------------------------------------------------------------------------------------
# Mean phase
# ------------------------------------------------------------------------------------------------

def test_mean_phase_by_hand_and_table():
    omega = torch.tensor([1.0, 0.01], dtype=torch.float32)
    c, d = T.mean_phase_rows(omega, torch.tensor([5]), torch.float64)
    for f, w in enumerate(omega.tolist()):  # the float32 value of 0.01, widened
        assert float(c[0, f]) == pytest.approx(sum(math.cos((5 + 2 ** i) * w) for i in range(17)) / 17, abs=1e-12)
        assert float(d[0, f]) == pytest.approx(sum(math.sin((5 + 2 ** i) * w) for i in range(17)) / 17, abs=1e-12)
    table = T.mean_phase_table(omega, 100)
    assert table[0].shape == (128, 2) and table[0].dtype == torch.float32  # power-of-two rows
    L = torch.tensor([0, 5, 99, 127])
    direct = T.mean_phase_rows(omega, L)
    gathered = T.gather_mean_phase(table, L)
    assert torch.equal(direct[0], gathered[0]) and torch.equal(direct[1], gathered[1])
    with pytest.raises(IndexError):
        T.gather_mean_phase(table, torch.tensor([128]))


# ------------------------------------------------------------------------------------------------
# Scores
# ------------------------------------------------------------------------------------------------

def tiny_calibration(q: complex, qa: float, scale: float = 1.0) -> Calibration:
    return Calibration(E_q=torch.tensor([[[q]]], dtype=torch.complex64),
                       E_q_norm=torch.tensor([[[qa]]], dtype=torch.float32),
                       omega=torch.tensor([0.5]), freq_scale_sq=torch.tensor([scale]))


def test_split_pairs_by_hand():
    row = torch.arange(8.0)
    re, im = T.split_pairs(row, geometry(head_dim=8, rotary_start=2, rotary_dim=6, pairing="half"))
    assert re.tolist() == [2, 3, 4] and im.tolist() == [5, 6, 7]
    re, im = T.split_pairs(row, geometry(head_dim=8, rotary_start=2, rotary_dim=6, pairing="interleaved"))
    assert re.tolist() == [2, 4, 6] and im.tolist() == [3, 5, 7]


def test_score_by_hand():
    g = geometry(num_layers=1, query_heads=1, kv_heads=1, head_dim=2, rotary_dim=2, swa_window=(None,))
    k = torch.tensor([[[2.0, -1.0]]])  # [Hkv, T, head_dim]
    c, d = torch.tensor([0.5]), torch.tensor([0.25])
    # a = qr c - qi d = 0.25, b = qr d + qi c = 0.75, m = qa - |q| = 2 - sqrt 2
    expected = 0.25 * 2 + 0.75 * -1 + (2 - math.sqrt(2)) * math.sqrt(5)
    score = T.score_keys(k, tiny_calibration(1 + 1j, 2.0), 0, c, d, g, torch.float64)
    assert float(score[0, 0]) == pytest.approx(expected, rel=1e-6)
    doubled = T.score_keys(k, tiny_calibration(1 + 1j, 2.0, scale=2.0), 0, c, d, g, torch.float64)
    assert float(doubled[0, 0]) == pytest.approx(2 * expected, rel=1e-6)


@pytest.mark.parametrize("pairing", ["half", "interleaved"])
@pytest.mark.parametrize("rotary_start, trailing", [(0, 0), (3, 2)])
def test_score_equals_trigonometric_series(pairing, rotary_start, trailing):
    """The score of a cached (post-RoPE) key equals the paper's series at relative distance
    L + o - p over the pre-RoPE key, and the mean over offsets of the RoPE'd mean query's dot
    product with the cached key (plus the norm term)."""
    R = 8
    g = geometry(head_dim=rotary_start + R + trailing, rotary_start=rotary_start, rotary_dim=R, pairing=pairing)
    calib = T.synthetic_calibration(g, seed=3)
    gen = torch.Generator().manual_seed(0)
    k_pre = torch.randn(g.kv_heads, 5, g.head_dim, generator=gen, dtype=torch.float64)
    p = torch.randint(0, 600, (5,), generator=gen)
    cached = T.apply_rope(k_pre, p.expand(g.kv_heads, 5), calib.omega, g)
    L = 777
    c, d = T.mean_phase_rows(calib.omega, torch.tensor(L), torch.float64)
    omega = calib.omega.double()
    for layer in range(g.num_layers):
        scores = T.score_keys(cached, calib, layer, c, d, g, torch.float64)
        for h in range(g.query_heads):
            q = calib.E_q[layer, h].to(torch.complex128)
            qa = calib.E_q_norm[layer, h].double()
            q_row = torch.zeros(g.head_dim, dtype=torch.float64)
            q_re, q_im = T.split_pairs(q_row, g)
            q_re.copy_(q.real)
            q_im.copy_(q.imag)
            for t in range(5):
                kr, ki = T.split_pairs(k_pre[h // g.group, t], g)
                k = torch.complex(kr, ki)
                norm_term = float(((qa - q.abs()) * k.abs()).sum())
                phase = q.angle() - k.angle()
                series = sum(float((q.abs() * k.abs() * torch.cos((L + o - p[t]) * omega + phase)).sum())
                             for o in T.OFFSETS) / 17 + norm_term
                dot = sum(float(T.apply_rope(q_row, torch.tensor(L + o), calib.omega, g) @ cached[h // g.group, t])
                          for o in T.OFFSETS) / 17 + norm_term
                assert float(scores[h, t]) == pytest.approx(series, rel=1e-9, abs=1e-9)
                assert float(scores[h, t]) == pytest.approx(dot, rel=1e-9, abs=1e-9)


def paged_cache(g: TriGeometry, lengths: list[int], dtype=torch.float32, seed=0, spare_pages=3):
    """Random pools for every layer and a random page table covering ``lengths``."""
    gen = torch.Generator().manual_seed(seed)
    max_pages = max(-(-n // g.tokens_per_block) for n in lengths)
    num_pages = max_pages * len(lengths) + spare_pages
    shape = (num_pages, *g.page_shape)

    def pool():
        return torch.randn(shape, generator=gen).to(dtype)

    k = [pool() for _ in range(g.num_layers)]
    v = [pool() for _ in range(g.num_layers)]
    table = torch.full((len(lengths), max_pages), -1, dtype=torch.int32)
    perm = torch.randperm(num_pages, generator=gen)
    used = 0
    for r, n in enumerate(lengths):
        pages = -(-n // g.tokens_per_block)
        table[r, :pages] = perm[used:used + pages].to(torch.int32)
        used += pages
    return k, v, table


def logical_rows(pool, table, r, head, positions, g):
    rows = T.gather_token_rows(pool, table[r:r + 1], torch.tensor([positions], dtype=torch.int64),
                               torch.ones(1, len(positions), dtype=torch.bool), g)
    return rows[0, head]


@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_paged_addressing_by_hand(layout):
    """Every element encodes (page, head, slot): tokens resolve through the table in either layout."""
    g = geometry(layout=layout, head_dim=2, rotary_dim=2)
    pages, heads, slots = torch.meshgrid(torch.arange(5), torch.arange(2), torch.arange(4), indexing="ij")
    code = (pages * 100 + heads * 10 + slots).float()[..., None].expand(5, 2, 4, 2)
    pool = code if layout == "HND" else code.permute(0, 2, 1, 3).contiguous()
    table = torch.tensor([[3, 0, 4]], dtype=torch.int32)
    for head in range(2):
        got = logical_rows(pool, table, 0, head, [0, 3, 4, 9], g)[:, 0].tolist()
        assert got == [300 + head * 10, 303 + head * 10, head * 10, 401 + head * 10]


@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_score_paged_matches_contiguous(layout):
    g = geometry(layout=layout, rotary_start=2, rotary_dim=8, pairing="interleaved")
    calib = T.synthetic_calibration(g, seed=1)
    P, S, C = [3, 0, 5], [11, 7, 5], [4, 0, 9]
    k, _, table = paged_cache(g, [12, 8, 6], dtype=torch.bfloat16)
    scores, valid = T.score_paged(k[1], table, P, S, C, calib, 1, g, torch.float64)
    assert scores.shape == (3, 4, 8) and valid.sum(dim=1).tolist() == [8, 7, 0]
    for r in range(3):
        n = S[r] - P[r]
        if n <= 0:
            assert bool((scores[r] == 0).all())
            continue
        rows = torch.stack([logical_rows(k[1], table, r, h, list(range(P[r], S[r])), g) for h in range(2)])
        c, d = T.mean_phase_rows(calib.omega, torch.tensor(S[r] + C[r]), torch.float64)
        expected = T.score_keys(rows, calib, 1, c, d, g, torch.float64)
        torch.testing.assert_close(scores[r, :, :n], expected)
        assert bool((scores[r, :, n:] == 0).all())
    single, _ = T.score_paged(k[1], table, P, S, C, calib, 1, g)
    torch.testing.assert_close(single.double(), scores, rtol=1e-4, atol=1e-4)


def test_score_paged_fp8_scale_and_swa_refused():
    g = geometry(swa_window=(None, 4))
    calib = T.synthetic_calibration(g, seed=2)
    k, _, table = paged_cache(g, [9])
    k8 = k[0].to(torch.float8_e4m3fn)
    scaled, _ = T.score_paged(k8, table, [1], [9], [0], calib, 0, g, torch.float64, k_scale=0.5)
    plain, _ = T.score_paged(k8.to(torch.float64) * 0.5, table, [1], [9], [0], calib, 0, g, torch.float64)
    torch.testing.assert_close(scaled, plain)
    with pytest.raises(ValueError, match="never scored"):
        T.score_paged(k[1], table, [1], [9], [0], calib, 1, g)


# ------------------------------------------------------------------------------------------------
# Normalize, aggregate, select, cadence
# ------------------------------------------------------------------------------------------------

def test_zscore_by_hand():
    scores = torch.tensor([[1.0, 2.0, 3.0, 99.0], [5.0, 5.0, 5.0, 5.0]], dtype=torch.float64)
    valid = torch.tensor([[True, True, True, False], [True, True, True, True]])
    z = T.zscore(scores, valid)
    std = math.sqrt(2 / 3)  # population std of 1, 2, 3
    torch.testing.assert_close(z[0], torch.tensor([-1 / std, 0.0, 1 / std, 0.0], dtype=torch.float64))
    assert z[1].tolist() == [0.0, 0.0, 0.0, 0.0]  # constant row: std floored, z = 0


def test_aggregate_modes_by_hand():
    g = geometry(num_layers=3, swa_window=(None, 8, None))
    z = torch.zeros(2, 1, 4, 2)                            # scored layers 0 and 2 only
    z[0, 0, :, 0] = torch.tensor([1.0, 2.0, 3.0, 4.0])   # layer 0, token 0
    z[1, 0, :, 0] = torch.tensor([5.0, -1.0, 0.0, -2.0])  # layer 2, token 0
    union = T.aggregate(z, "union", g)
    assert union.tolist() == [[[5.0, 0.0]]]
    per_head = T.aggregate(z, "per_head", g)               # mean over layers 0, 2 of group max
    assert per_head[0, :, 0].tolist() == [(2.0 + 5.0) / 2, (4.0 + 0.0) / 2]
    per_layer = T.aggregate(z, "per_layer_perhead", g)
    assert per_layer.shape == (1, 6, 2)
    assert per_layer[0, :, 0].tolist() == [2.0, 4.0, 0.0, 0.0, 5.0, 0.0]
    with pytest.raises(ValueError, match="accepted"):
        T.aggregate(z, "max", g)
    with pytest.raises(ValueError, match="3 layers of z-scores for 2 scored layers"):
        T.aggregate(torch.zeros(3, 1, 4, 2), "union", g)


def aggregate_materialized(z_layers, mode, g):
    """§4's table over a ``[B, Lc, Hq, W]`` tensor with zero rows for the SWA layers: the oracle's
    earlier statement, kept here to show the per-layer one gives the same bits."""
    B, Hq, W = z_layers[0].shape
    z = torch.zeros(B, g.num_layers, Hq, W, dtype=z_layers[0].dtype)
    for layer, rows in zip(g.scored_layers, z_layers):
        z[:, layer] = rows
    scored = list(g.scored_layers)
    grouped = z.reshape(B, g.num_layers, g.kv_heads, g.group, W).amax(dim=3)
    if mode == "union":
        return z[:, scored].amax(dim=(1, 2)).unsqueeze(1)
    if mode == "per_head":
        return grouped[:, scored].mean(dim=1)
    out = torch.zeros_like(grouped)
    out[:, scored] = grouped[:, scored]
    return out.reshape(B, g.num_layers * g.kv_heads, W)


@pytest.mark.parametrize("mode", T.MODES)
def test_aggregate_per_layer_equals_the_materialized_table(mode):
    """Bit for bit, with many exact ties and a request with no valid column."""
    g = geometry(num_layers=6, query_heads=8, kv_heads=2, swa_window=(None, 8, None, 8, None, 8))
    gen = torch.Generator().manual_seed(3)
    width = torch.tensor([90, 0, 41, 77])
    scores = torch.randn(len(g.scored_layers), 4, g.query_heads, 90, generator=gen).round(decimals=1)
    valid = torch.arange(90)[None, :] < width[:, None]
    z = [T.zscore(layer, valid[:, None, :]) for layer in scores]
    values = T.aggregate(z, mode, g)
    assert torch.equal(values, aggregate_materialized(z, mode, g))
    assert torch.equal(T.aggregate(torch.stack(z), mode, g), values), "a stacked tensor is the same input"
    P = torch.tensor([5, 12, 30, 7])
    for budget in (1, 16, 41, 200):
        kept = T.select_keep(values, width, budget, P)
        assert kept.shape == (4, T.num_decision_rows(mode, g), budget)
        assert bool((kept[1] == -1).all()), "no valid column: every slot is -1"


def test_select_keep_ties_and_order():
    values = torch.tensor([[[1.0, 3.0, 3.0, 2.0, 3.0, 9.0]]])
    P = torch.tensor([10])
    # Three-way tie at 3.0: the lower indices win; emitted ascending as absolute positions.
    assert T.select_keep(values, torch.tensor([5]), 2, P).tolist() == [[[11, 12]]]
    assert T.select_keep(values, torch.tensor([5]), 4, P).tolist() == [[[11, 12, 13, 14]]]
    assert T.select_keep(values, torch.tensor([6]), 2, P).tolist() == [[[11, 15]]]
    # Fewer valid tokens than the budget: all of them, then -1.
    assert T.select_keep(values, torch.tensor([2]), 4, P).tolist() == [[[10, 11, -1, -1]]]
    ties = torch.full((2, 1, 5), float("-inf"))
    assert T.select_keep(ties, torch.tensor([3, 5]), 2, torch.tensor([0, 1])).tolist() == [[[0, 1]], [[1, 2]]]


@pytest.mark.parametrize("P, S, C, budget, beta, due", [
    (10, 19, 0, 8, 4, False),   # 8//4 = 2, (19-10)//4 = 2: no crossing
    (10, 20, 0, 8, 4, False),   # 2 vs 10//4 = 2
    (10, 22, 0, 8, 4, True),    # 2 vs 12//4 = 3
    (10, 30, 0, 8, 4, True),    # 2 vs 20//4 = 5: several crossings, one round
    (10, 20, 5, 8, 4, False),   # 13//4 = 3 vs 15//4 = 3
    (10, 21, 5, 8, 4, True),    # 3 vs 16//4 = 4
    (10, 18, 4, 8, 4, False),   # 12//4 = 3 vs 12//4 = 3 (and S == P + budget)
])
def test_cadence(P, S, C, budget, beta, due):
    assert T.is_due(P, S, C, S + C, budget, beta) is due


def test_cadence_needs_something_to_evict():
    # A caller whose L runs ahead of S (e.g. counting the tail) crosses without surplus tokens.
    assert T.is_due(10, 18, 0, 22, 8, 4) is False
    assert T.is_due(10, 19, 0, 22, 8, 4) is True


def test_post_round_and_next_due():
    P, S, C, budget, beta = 10, 22, 0, 8, 4
    assert T.is_due(P, S, C, S + C, budget, beta)
    C, length = T.post_round(P, S, C, budget, tail=1)
    assert (C, length) == (4, 19)
    S = P + budget  # the physical scorable length right after the round
    steps = [T.is_due(P, S + n, C, S + n + C, budget, beta) for n in range(1, 9)]
    assert steps == [False, False, False, True, True, True, True, True]  # (12 + n)//4 > 3 from n = 4


# ------------------------------------------------------------------------------------------------
# Move packing
# ------------------------------------------------------------------------------------------------

@st.composite
def batches(draw):
    kv_heads = draw(st.integers(1, 3))
    budget = draw(st.integers(1, 8))
    windows = draw(st.lists(st.one_of(st.none(), st.integers(1, budget)), min_size=1, max_size=4))
    if all(w is not None for w in windows):
        windows[draw(st.integers(0, len(windows) - 1))] = None
    g = geometry(num_layers=len(windows), query_heads=2 * kv_heads, kv_heads=kv_heads,
                 tokens_per_block=draw(st.sampled_from([1, 2, 4, 16])), swa_window=tuple(windows),
                 layout=draw(st.sampled_from(["HND", "NHD"])))
    B = draw(st.integers(1, 5))
    P, S, tail, active = [], [], [], []
    for _ in range(B):
        p = draw(st.integers(0, 9))
        a = draw(st.booleans())
        s = p + budget + draw(st.integers(1, 9)) if a else p + draw(st.integers(0, budget + 4))
        P.append(p)
        S.append(s)
        tail.append(draw(st.integers(0, 3)))
        active.append(a)
    mode = draw(st.sampled_from(T.MODES))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2 ** 16)))
    rows = T.num_decision_rows(mode, g)
    kept = torch.full((B, rows, budget), -1, dtype=torch.int64)
    for r in range(B):
        if active[r]:
            for row in range(rows):
                pick = torch.randperm(S[r] - P[r], generator=gen)[:budget]
                kept[r, row] = torch.sort(pick).values + P[r]
    return g, mode, budget, kept, torch.tensor(P), torch.tensor(S), torch.tensor(tail), torch.tensor(active), \
        B + draw(st.integers(0, 2)), gen


@settings(max_examples=60, deadline=None)
@given(batches())
def test_pack_moves_invariants(batch):
    g, mode, budget, kept, P, S, tail, active, max_requests, _ = batch
    moves = T.pack_moves(kept, P, S, tail, active, budget, mode, g, max_requests)
    offsets = moves.offsets.tolist()
    assert moves.src.dtype == moves.dst.dtype == moves.offsets.dtype == torch.int32
    assert len(offsets) == max_requests + 1 and offsets[0] == 0
    assert moves.src.shape == moves.dst.shape == (g.num_layers, g.kv_heads, offsets[-1])
    for r in range(max_requests):
        count = budget + int(tail[r]) if r < len(P) and bool(active[r]) else 0
        assert offsets[r + 1] - offsets[r] == count  # padded and inactive requests move nothing
        if not count:
            continue
        p, s, t = int(P[r]), int(S[r]), int(tail[r])
        for layer, window in enumerate(g.swa_window):
            rows = T.decision_rows(mode, layer, g)
            for head in range(g.kv_heads):
                src = moves.src[layer, head, offsets[r]:offsets[r + 1]].long()
                dst = moves.dst[layer, head, offsets[r]:offsets[r + 1]].long()
                real = src >= 0
                m = torch.arange(count)
                assert bool((dst[real] == p + m[real]).all())
                assert bool((dst[real] <= src[real]).all())
                assert bool((src[real][1:] > src[real][:-1]).all())
                assert bool((dst[~real] == -1).all())
                if window is None:
                    assert bool(real.all())
                    assert src[:budget].tolist() == kept[r, rows[head]].tolist()
                    assert src[budget:].tolist() == list(range(s, s + t))
                else:
                    assert real.tolist() == [i >= budget - window for i in range(count)]
                    assert src[real].tolist() == list(range(s - window, s + t))
    T.check_moves(moves)


def test_pack_moves_errors():
    g = geometry(swa_window=(None, 6))
    kept = torch.tensor([[[2, 3, 4, 5]]])
    P, S, tail, active = torch.tensor([2]), torch.tensor([10]), torch.tensor([0]), torch.tensor([True])
    with pytest.raises(ValueError, match="budget >= W"):
        T.pack_moves(kept, P, S, tail, active, 4, "union", g)
    g = geometry()
    with pytest.raises(ValueError, match="strictly ascending"):
        T.pack_moves(torch.tensor([[[2, 4, 3, 5]]]), P, S, tail, active, 4, "union", g)
    with pytest.raises(ValueError, match="strictly ascending"):
        T.pack_moves(torch.tensor([[[1, 3, 4, 5]]]), P, S, tail, active, 4, "union", g)
    with pytest.raises(ValueError, match="expected"):
        T.pack_moves(kept, P, S, tail, active, 4, "per_head", g)
    with pytest.raises(ValueError, match="max_requests"):
        T.pack_moves(kept, P, S, tail, active, 4, "union", g, max_requests=0)


def test_check_moves_rejects_bad_moves():
    good = T.Moves(torch.tensor([[[5, 7]]], dtype=torch.int32), torch.tensor([[[3, 4]]], dtype=torch.int32),
                   torch.tensor([0, 2], dtype=torch.int32))
    T.check_moves(good)
    with pytest.raises(ValueError, match="passes"):
        T.check_moves(T.Moves(good.src, torch.tensor([[[6, 4]]], dtype=torch.int32), good.offsets))
    with pytest.raises(ValueError, match="strictly increasing"):
        T.check_moves(T.Moves(torch.tensor([[[7, 7]]], dtype=torch.int32), good.dst, good.offsets))


# ------------------------------------------------------------------------------------------------
# Compaction
# ------------------------------------------------------------------------------------------------

def sequential_compaction(k_pools, v_pools, table, moves, g):
    """The CUDA mover's order, one move at a time: ascending slots per (layer, head)."""
    request = moves.request_of_slot()
    for layer in range(g.num_layers):
        for head in range(g.kv_heads):
            for slot in range(moves.src.shape[-1]):
                src, dst = int(moves.src[layer, head, slot]), int(moves.dst[layer, head, slot])
                if src < 0 or src == dst:
                    continue
                r = int(request[slot])
                for pool in (k_pools[layer], v_pools[layer]):
                    raw = pool.view(torch.uint8)
                    index_src = T._token_index(g, table[r, src // g.tokens_per_block].long(), torch.tensor(head),
                                               torch.tensor(src % g.tokens_per_block))
                    index_dst = T._token_index(g, table[r, dst // g.tokens_per_block].long(), torch.tensor(head),
                                               torch.tensor(dst % g.tokens_per_block))
                    raw[index_dst] = raw[index_src].clone()


@settings(max_examples=25, deadline=None)
@given(batches(), st.sampled_from([torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float32]))
def test_compaction_matches_gather(batch, dtype):
    g, mode, budget, kept, P, S, tail, active, max_requests, gen = batch
    moves = T.pack_moves(kept, P, S, tail, active, budget, mode, g, max_requests)
    k, v, table = paged_cache(g, [int(s + t) for s, t in zip(S, tail)], dtype, seed=int(gen.initial_seed()))
    expected_k, expected_v = T.compact_paged_gather(k, v, table, moves, g)
    sequential_k, sequential_v = [p.clone() for p in k], [p.clone() for p in v]
    sequential_compaction(sequential_k, sequential_v, table, moves, g)
    T.compact_paged(k, v, table, moves, g)
    for got, want, seq in zip(k + v, expected_k + expected_v, sequential_k + sequential_v):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
        assert torch.equal(got.view(torch.uint8), seq.view(torch.uint8))


# ------------------------------------------------------------------------------------------------
# One round
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize("mode", T.MODES)
def test_eviction_round_end_to_end(layout, mode):
    g = geometry(num_layers=3, layout=layout, swa_window=(None, 3, None), rotary_start=4, rotary_dim=8)
    calib = T.synthetic_calibration(g, seed=5)
    P, S, C, tail = [4, 2, 6], [21, 9, 13], [0, 0, 5], [1, 0, 2]
    budget, beta = 6, 4
    k, v, table = paged_cache(g, [s + t for s, t in zip(S, tail)], torch.bfloat16)
    before_k, before_v = [p.clone() for p in k], [p.clone() for p in v]
    result = T.eviction_round(k, v, table, P, S, C, tail, calib, g, budget, beta, mode, max_requests=4)
    assert result.due.tolist() == [True, False, True]
    assert result.evicted.tolist() == [21 - 4 - 6, 0, 13 - 6 - 6]
    assert result.lengths.tolist() == [4 + 6 + 1, 9, 6 + 6 + 2]
    assert result.C.tolist() == [11, 0, 6]
    assert result.moves.offsets.tolist() == [0, 7, 7, 15, 15]
    assert bool((result.kept[1] == -1).all())
    for r in (0, 2):
        p, s, t = P[r], S[r], tail[r]
        for layer, window in enumerate(g.swa_window):
            rows = T.decision_rows(mode, layer, g)
            for head in range(g.kv_heads):
                if window is None:
                    sources = result.kept[r, rows[head]].tolist() + list(range(s, s + t))
                    first = p
                else:
                    sources = list(range(s - window, s + t))
                    first = p + budget - window
                for pool, old in ((k[layer], before_k[layer]), (v[layer], before_v[layer])):
                    got = logical_rows(pool, table, r, head, list(range(first, first + len(sources))), g)
                    want = logical_rows(old, table, r, head, sources, g)
                    assert torch.equal(got, want)
                    prompt = list(range(p))
                    assert torch.equal(logical_rows(pool, table, r, head, prompt, g),
                                       logical_rows(old, table, r, head, prompt, g))
    for layer in range(g.num_layers):  # the request that was not due is untouched
        for head in range(g.kv_heads):
            assert torch.equal(logical_rows(k[layer], table, 1, head, list(range(9)), g),
                               logical_rows(before_k[layer], table, 1, head, list(range(9)), g))


def test_eviction_round_keeps_top_scores():
    g = geometry(num_layers=1, swa_window=(None,))
    calib = T.synthetic_calibration(g, seed=7)
    k, v, table = paged_cache(g, [30])
    scores, valid = T.score_paged(k[0], table, [2], [30], [0], calib, 0, g, torch.float64)
    z = T.zscore(scores, valid[:, None, :])
    best = z[0].amax(dim=0)
    result = T.eviction_round(k, v, table, [2], [30], [0], [0], calib, g, 5, 4, "union", dtype=torch.float64)
    kept = result.kept[0, 0] - 2
    assert set(torch.topk(best, 5).indices.tolist()) == set(kept.tolist())


# ------------------------------------------------------------------------------------------------
# Calibration
# ------------------------------------------------------------------------------------------------

class NeedsCode:
    """Pickled by reference to this module: loading it would need arbitrary code."""


def flat(calib: Calibration) -> dict:
    return {"E_q": calib.E_q, "E_q_norm": calib.E_q_norm, "omega": calib.omega, "freq_scale_sq": calib.freq_scale_sq}


def defaults(g: TriGeometry):
    return T.rope_omega(g.rotary_dim, 10000.0, None), T.rope_freq_scale_sq(g.rotary_dim, None)


def test_flat_roundtrip(tmp_path):
    g = geometry()
    calib = T.synthetic_calibration(g, seed=0)
    path = tmp_path / "calib.pt"
    T.save_calibration(calib, path)
    loaded = T.load_calibration(path, g, *defaults(g))
    for name in ("E_q", "E_q_norm", "omega", "freq_scale_sq"):
        assert torch.equal(getattr(loaded, name), getattr(calib, name))
    torch.testing.assert_close(loaded.mlr, calib.E_q_norm - calib.E_q.abs())
    # Concentrated queries: |E q| is close to E|q|, the norm term is a small correction.
    assert bool((loaded.mlr >= -1e-6).all()) and float((loaded.mlr / loaded.E_q_norm).mean()) < 0.1


def test_upstream_form_missing_heads_score_zero(tmp_path):
    g = geometry()
    calib = T.synthetic_calibration(g, seed=0)
    sampled = [[0, 0], [0, 1], [1, 3]]
    stats = {}
    for layer, head in sampled:
        stats[f"layer{layer:02d}_head{head:02d}"] = {"q_mean_real": calib.E_q[layer, head].real.clone(),
                                                     "q_mean_imag": calib.E_q[layer, head].imag.clone(),
                                                     "q_abs_mean": calib.E_q_norm[layer, head].clone()}
    path = tmp_path / "upstream.pt"
    torch.save({"metadata": {"sampled_heads": sampled, "head_dim": 12, "rope_style": "half"}, "stats": stats}, path)
    omega, scale = defaults(g)
    loaded = T.load_calibration(path, g, omega, scale)
    assert torch.equal(loaded.omega, omega) and torch.equal(loaded.freq_scale_sq, scale)
    for layer in range(2):
        for head in range(4):
            if [layer, head] in sampled:
                assert torch.equal(loaded.E_q[layer, head], calib.E_q[layer, head])
            else:
                assert bool((loaded.E_q[layer, head] == 0).all() and (loaded.E_q_norm[layer, head] == 0).all())
    k = torch.randn(2, 3, 12)
    c, d = T.mean_phase_rows(omega, torch.tensor(50))
    scores = T.score_keys(k, loaded, 0, c, d, g)
    assert bool((scores[2:] == 0).all()) and bool((scores[:2] != 0).all())


def calibration_error(tmp_path, payload, g=None, name="bad.pt", **kwargs) -> str:
    g = g or geometry()
    path = tmp_path / name
    torch.save(payload, path)
    omega, scale = defaults(g)
    with pytest.raises(CalibrationError) as info:
        T.load_calibration(path, g, kwargs.get("omega", omega), kwargs.get("scale", scale))
    message = str(info.value)
    assert str(path) in message
    return message


def test_flat_errors_name_file_and_key(tmp_path):
    g = geometry()
    good = flat(T.synthetic_calibration(g, seed=0))
    msg = calibration_error(tmp_path, dict(good, E_q=good["E_q"][:, :, :5]))
    assert "'E_q'" in msg and "expected shape [2, 4, 6]" in msg and "got [2, 4, 5]" in msg
    bad = good["E_q_norm"].clone()
    bad[1, 2, 3] = float("nan")
    assert "'E_q_norm'" in calibration_error(tmp_path, dict(good, E_q_norm=bad))
    assert "non-finite" in calibration_error(tmp_path, dict(good, E_q_norm=bad))
    msg = calibration_error(tmp_path, dict(good, E_q=good["E_q"].real.contiguous()))
    assert "'E_q'" in msg and "expected dtype complex64, got float32" in msg
    msg = calibration_error(tmp_path, dict(good, E_q_norm=good["E_q_norm"].double()))
    assert "'E_q_norm'" in msg and "float64" in msg
    msg = calibration_error(tmp_path, good, g=geometry(num_layers=3, swa_window=(None, None, None)))
    assert "'E_q'" in msg and "expected shape [3, 4, 6]" in msg
    msg = calibration_error(tmp_path, good, g=geometry(query_heads=8))
    assert "'E_q'" in msg and "expected shape [2, 8, 6]" in msg
    msg = calibration_error(tmp_path, {k: v for k, v in good.items() if k != "E_q_norm"})
    assert "'E_q_norm'" in msg and "missing" in msg
    msg = calibration_error(tmp_path, dict(good, omega=good["omega"] * 2))
    assert "'omega'" in msg and "disagrees" in msg
    assert "<top level>" in calibration_error(tmp_path, [1, 2, 3])
    assert "<top level>" in calibration_error(tmp_path, {"weights": torch.zeros(1)})


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
def test_pickle_needing_code_is_refused(tmp_path):
    g = geometry()
    good = flat(T.synthetic_calibration(g, seed=0))
    msg = calibration_error(tmp_path, dict(good, extra=NeedsCode()))
    assert "refused" in msg and "weights_only" in msg
    path = tmp_path / "raw.pkl"
    path.write_bytes(pickle.dumps(NeedsCode()))
    with pytest.raises(CalibrationError, match="refused"):
        T.load_calibration(path, g, *defaults(g))
    with pytest.raises(CalibrationError, match="not found"):
        T.load_calibration(tmp_path / "absent.pt", g, *defaults(g))


def test_upstream_errors_name_file_and_key(tmp_path):
    entry = {"q_mean_real": torch.zeros(6), "q_mean_imag": torch.zeros(6), "q_abs_mean": torch.ones(6)}
    msg = calibration_error(tmp_path, {"metadata": {"sampled_heads": [[2, 0]]}, "stats": {}})
    assert "metadata.sampled_heads" in msg and "layer 2" in msg
    msg = calibration_error(tmp_path, {"metadata": {"sampled_heads": [[0, 4]]}, "stats": {}})
    assert "metadata.sampled_heads" in msg and "head 4" in msg
    msg = calibration_error(tmp_path, {"metadata": {"sampled_heads": [[0, 1]]}, "stats": {}})
    assert "stats.layer00_head01" in msg
    msg = calibration_error(tmp_path, {"metadata": {"sampled_heads": [[0, 1]]},
                                       "stats": {"layer00_head01": dict(entry, q_abs_mean=torch.ones(5))}})
    assert "stats.layer00_head01.q_abs_mean" in msg and "expected shape [6]" in msg
    integers = torch.zeros(6, dtype=torch.int64)
    msg = calibration_error(tmp_path, {"metadata": {"sampled_heads": [[0, 1]]},
                                       "stats": {"layer00_head01": dict(entry, q_mean_imag=integers)}})
    assert "stats.layer00_head01.q_mean_imag" in msg and "dtype" in msg
    inf = torch.zeros(6)
    inf[0] = float("inf")
    msg = calibration_error(tmp_path, {"metadata": {"sampled_heads": [[0, 1]]},
                                       "stats": {"layer00_head01": dict(entry, q_mean_real=inf)}})
    assert "stats.layer00_head01.q_mean_real" in msg and "non-finite" in msg
    msg = calibration_error(tmp_path, {"stats": {"layer00_head01": entry}})
    assert "metadata.sampled_heads" in msg and "missing" in msg
    msg = calibration_error(tmp_path, {"metadata": {"sampled_heads": [[0, 1]]}, "stats": {"layer00_head01": entry}},
                            omega=None)
    assert "'stats'" in msg and "omega" in msg
