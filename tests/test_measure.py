"""``kvgen.measure`` on the CPU: the rotation rule, the timer's bookkeeping (which call runs when,
the summary; no time is asserted), the library lookup, and the oracle check of the compaction
workload against a correct and a broken compactor."""

from __future__ import annotations

import pytest
import torch

from kvgen.artifacts.manifest import RegistryError
from kvgen.measure import mix, timing
from kvgen.measure.libraries import registry_artifact
from kvgen.measure.mix import mix_reference
from kvgen.measure.workloads import Failure, launch, workload_class
from kvgen.measure.workloads.compact import oracle_compaction_matches
from kvgen.reference.triattention import Moves, compact_paged, pack_moves, page_shape

from .interpreter import interpret
from .move_cases import geometry
from .test_runtime_registry import fake_registry

L2 = 50 << 20


def test_rotation_touches_three_times_the_l2():
    assert timing.rotation_count(L2, L2) == 3
    assert timing.rotation_count(L2 // 2, L2) == 6
    assert timing.rotation_count(L2 // 3 + 1, L2) == 9           # rounded up: at least 3x
    assert timing.rotation_count(4 * L2, L2) == 1                 # one copy already exceeds it
    assert timing.rotation_count(0, L2) == 3 * L2                 # no division by zero


def test_rotation_copies_fit_in_85_percent_of_free_memory():
    assert timing.rotation_count(1 << 20, L2, set_bytes=1 << 30, free_bytes=10 << 30) == 8
    assert timing.rotation_count(1 << 20, L2, set_bytes=1 << 30, free_bytes=1 << 29) == 1   # at least one
    assert timing.rotation_count(L2, L2, set_bytes=1 << 20, free_bytes=1 << 40) == 3       # never more than wanted


def test_calls_rotate_through_warmup_and_timed_reps_in_order():
    ran = []
    calls = [lambda i=i: ran.append(i) for i in range(3)]
    t = timing.time_calls(calls, reps=4, warmup=2, clock="wall")
    assert ran == [0, 1, 2, 0, 1, 2]
    assert len(t["samples_ms"]) == 4 and t["samples_ms"] == sorted(t["samples_ms"])
    assert set(timing.summary(t)) == {"median_ms", "p20_ms", "p80_ms"}


def test_quantiles_and_bad_arguments():
    q = timing.quantiles([5.0, 1.0, 4.0, 2.0, 3.0])
    assert q == {"median_ms": 3.0, "p20_ms": 2.0, "p80_ms": 5.0, "samples_ms": [1.0, 2.0, 3.0, 4.0, 5.0]}
    with pytest.raises(ValueError, match="no samples"):
        timing.quantiles([])
    with pytest.raises(ValueError, match="no calls"):
        timing.time_calls([], reps=1)
    with pytest.raises(ValueError, match="clock"):
        timing.time_once(lambda: None, clock="sundial")
    assert timing.clock_for("cpu") == "wall" and timing.clock_for(torch.device("cuda")) == "cuda"
    value, ms = timing.time_once(lambda: 42, clock="wall")
    assert value == 42 and ms >= 0


def test_page_shapes():
    assert page_shape("HND", 8, 32, 128) == (8, 32, 128)
    assert page_shape("NHD", 8, 32, 128) == (32, 8, 128)
    with pytest.raises(ValueError, match="layout"):
        page_shape("XYZ", 8, 32, 128)


def test_workload_classes_and_launch_failures():
    ops = ("codec", "compact", "score", "select")
    assert [workload_class(op).op for op in ops] == list(ops)
    with pytest.raises(ValueError, match="pack"):
        workload_class("pack")

    def broken():
        raise RuntimeError("illegal address")

    with pytest.raises(Failure) as failure:
        launch(broken)
    assert failure.value.kind == "launch" and "illegal address" in failure.value.detail


def test_libraries_come_through_the_runtime_lookup(tmp_path):
    registry = fake_registry(tmp_path / "r", "sm_90a", ["qwen3-8b"])
    artifact = registry_artifact(registry, "qwen3-8b", "sm_90a", "codec")
    assert artifact == registry / "sm_90a" / "libkvgen_qwen3_8b.so"
    for op in ("compact", "score"):                                 # the fake entry ships only the codec
        with pytest.raises(RegistryError, match=f"has no '{op}' artifact"):
            registry_artifact(registry, "qwen3-8b", "sm_90a", op)
    with pytest.raises(RegistryError, match="gemma-2-9b"):
        registry_artifact(registry, "gemma-2-9b", "sm_90a", "codec")


def _compaction_case(seed: int = 0):
    g = geometry(num_layers=2, kv_heads=2, head_dim=8, tokens_per_block=4)
    gen = torch.Generator().manual_seed(seed)
    batch, prompt, decode, budget = 2, 5, 20, 8
    P = torch.full((batch,), prompt, dtype=torch.long)
    S = P + decode
    tail = torch.tensor([0, 3])
    kept = torch.rand(batch, 1, decode, generator=gen).argsort(dim=-1)[..., :budget].sort(dim=-1).values + prompt
    moves = pack_moves(kept, P, S, tail, torch.ones(batch, dtype=torch.bool), budget, "union", g, batch)
    per_request = -(-(prompt + decode + 3) // g.tokens_per_block)
    table = torch.randperm(batch * per_request, generator=gen).to(torch.int32).reshape(batch, per_request)
    shape = (batch * per_request, *page_shape(g.layout, g.kv_heads, g.tokens_per_block, g.head_dim))
    k = [torch.randn(shape, generator=gen).to(torch.bfloat16) for _ in range(g.num_layers)]
    v = [torch.randn(shape, generator=gen).to(torch.bfloat16) for _ in range(g.num_layers)]
    return g, table, Moves(moves.src, moves.dst, moves.offsets), k, v


def test_compaction_check_accepts_the_oracle_and_rejects_a_wrong_compactor():
    g, table, moves, k, v = _compaction_case()

    def oracle_compactor(table, src, dst, offsets):
        compact_paged(k, v, table, Moves(src, dst, offsets), g)

    assert oracle_compaction_matches(oracle_compactor, k, v, table, moves, g)

    g, table, moves, k, v = _compaction_case(seed=1)

    def off_by_one(table, src, dst, offsets):
        oracle_compactor(table, src, dst, offsets)
        k[0].view(torch.uint8).view(-1)[0] ^= 1

    assert not oracle_compaction_matches(off_by_one, k, v, table, moves, g)


MIX_WORKER = r"""
import torch
from kvgen.measure.mix import mix, mix_reference
torch.manual_seed(0)
for s_words, d_words in [(5, 18), (18, 5), (7, 7), (300, 1100), (1100, 300), (3, 2500), (2500, 3)]:
    src = torch.randint(-2**31, 2**31 - 1, (3, s_words), dtype=torch.int32)
    out = mix(src, torch.full((3, d_words), 7, dtype=torch.int32))
    assert torch.equal(out, mix_reference(src, d_words)), (s_words, d_words)
print("checked")
"""


def test_mix_reference_states_the_repeat_and_the_fold():
    """Bit for bit: the decode mix repeats the narrower source, the encode mix XOR-folds the wider."""
    src = torch.tensor([[1, 2, 4, 8, 16]], dtype=torch.int32)
    assert mix_reference(src[:, :2], 5).tolist() == [[1, 2, 1, 2, 1]]
    assert mix_reference(src, 2).tolist() == [[1 ^ 4 ^ 16, 2 ^ 8]]
    assert mix_reference(src, 5).tolist() == src.tolist()


def test_mix_kernel_equals_its_reference_under_the_interpreter():
    """The mix-ceiling kernel (``kvgen bench``'s codec runs divide by its time) writes exactly
    ``mix_reference``'s words, over row widths that expand, fold and neither, blocks left partial."""
    assert interpret(MIX_WORKER, timeout=300).stdout.split()[-1] == "checked"


def test_mix_ceiling_refuses_rows_of_partial_words():
    with pytest.raises(ValueError, match="src_row_bytes must be a positive multiple of 4"):
        mix.ceiling(4, 6, 16, 3000.0)
