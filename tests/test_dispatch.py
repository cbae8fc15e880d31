"""Size-dispatched variants (kvgen.artifacts.dispatch) without a GPU: which sizes the tuner gives
their own library, the tuned file and the manifest that carry them, the build jobs that compile
them, and the runtime's choice per call. The GPU side: every score variant library against the
float64 oracle (tests/gpu/test_score_gpu.py::test_size_dispatched_variants_match_the_float64_oracle),
every compaction variant byte-exact against the oracle (tests/gpu/test_compact_gpu.py::
test_size_dispatched_compaction_equals_the_oracle), every selection variant's kept sets identical
to the oracle's (tests/gpu/test_select_gpu.py::test_size_dispatched_selection_keeps_the_oracles_sets).
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvgen.artifacts.dispatch import bucket_work, compact_work, dispatch_rows, score_work, select_work, serving
from kvgen.artifacts.manifest import (
    ArtifactEntry,
    FamilyEntry,
    Manifest,
    OpEntry,
    RegistryError,
    VariantEntry,
    manifest_problems,
    read_manifest,
    verify_op_files,
    write_manifest,
)
from kvgen.build.job import family_jobs, load_spec_source
from kvgen.files import file_sha256
from kvgen.lower.plan import default_params
from kvgen.lower.tuned import BuildEnvironment, TuningFileError, Variant, load_tuned, read_file, write_op
from kvgen.runtime.score import ScoreDispatch
from kvgen.tuning.space import BUCKETS, dispatch_variants

from .conftest import ROOT, SPECS_DIR

FP8 = "qwen3-8b-fp8"
WORK = {"b1": 4096, "b32": 131072, "b32-wide": 524288}
ENV = {"gpu": "NVIDIA H100 80GB HBM3", "kvgen": "0.1.0", "toolchain": {"cutlass_dsl": "4.8.1"}}


def test_work_is_requests_times_width_and_the_bucket_sizes_follow_it() -> None:
    assert score_work(32, 16384) == 524288
    assert {b.name: bucket_work("score", b.size) for b in BUCKETS["score"]} == WORK
    with pytest.raises(ValueError, match="codec: no unit of work"):
        bucket_work("codec", {"hot_mib": 8})


def test_compaction_work_is_its_request_slots() -> None:
    assert compact_work(7) == 7
    assert {b.name: bucket_work("compact", b.size) for b in BUCKETS["compact"]} == {"b1": 1, "b32": 32}
    # b32's own best serves calls from the geometric mean of 1 and 32 request slots on
    per_bucket = {"b1": {"m": 0.063, "t64": 0.070}, "b32": {"m": 1.275, "t64": 1.047}}
    assert dispatch_variants(per_bucket, "m", {"b1": 1, "b32": 32}) == [{"bucket": "b32", "from_work": 5, "config": "t64"}]
    assert dispatch_rows("lib.so", [(5, "lib_compact_b32.so")]) == [
        {"from_work": 0, "library": "lib.so"}, {"from_work": 5, "library": "lib_compact_b32.so"}]


def test_serving_takes_the_last_threshold_reached() -> None:
    assert serving([], 10**9) is None
    assert [serving([100, 1000], w) for w in (0, 99, 100, 999, 1000, 10**9)] == [None, None, 0, 0, 1, 1]


def test_a_bucket_keeps_the_main_config_within_the_noise_and_else_takes_the_one_serving_most_larger_buckets() -> None:
    # the fp8 H100 measurements in miniature: m wins b1, t32 wins b32, t64 wins b32-wide but t32 is
    # within 3.5 % of it there, so one library (t32) serves both large buckets
    per_bucket = {"b1": {"m": 0.109, "t32": 0.144, "t64": 0.21},
                  "b32": {"m": 2.379, "t32": 2.284, "t64": 2.40},
                  "b32-wide": {"m": 9.654, "t32": 8.984, "t64": 8.928}}
    assert dispatch_variants(per_bucket, "m", WORK) == [{"bucket": "b32", "from_work": 23170, "config": "t32"}]
    # within the margin everywhere: no variant
    assert dispatch_variants({"b1": {"m": 1.0, "x": 0.98}, "b32": {"m": 1.0, "x": 0.97}}, "m", WORK) == []
    # a measurement's own p80/p20 spread widens what counts as a tie
    assert dispatch_variants({"b32": {"m": 1.1, "x": 1.0}}, "m", WORK, spread={"b32": {"m": 1.15}}) == []


def test_a_variant_can_hand_larger_calls_back_to_the_main_library() -> None:
    per_bucket = {"b1": {"m": 2.0, "s": 1.0}, "b32": {"m": 1.0, "s": 2.0}}
    assert dispatch_variants(per_bucket, "m", WORK) == [
        {"bucket": "b1", "from_work": 0, "config": "s"}, {"bucket": "b32", "from_work": 23170, "config": "m"}]


def _variant(token_tiles: int, from_work: int = 23170, bucket: str = "b32") -> dict:
    return {"bucket": bucket, "from_work": from_work,
            "params": {**default_params("score"), "token_tiles": token_tiles}, "params_ms": 1.0}


def _tuned_file(tuning: Path, variants: list[dict], op: str = "score") -> Path:
    return write_op(tuning, FP8, "sm_90a", op, {"params": default_params(op), "default": default_params(op),
                                                 "buckets": {}, "variants": variants}, ENV)


def _env() -> BuildEnvironment:
    return BuildEnvironment("0.1.0", {"cutlass_dsl": "4.8.1"}, None)


def test_tuned_variants_reach_the_build_and_an_override_drops_them(tmp_path: Path) -> None:
    _tuned_file(tmp_path, [_variant(32)])
    tuned = load_tuned(tmp_path, {"sm_90a": _env()}, [FP8], environ={})
    (variant,) = tuned.variants_for("sm_90a", FP8)["score"]
    assert (variant.bucket, variant.from_work, variant.params["token_tiles"]) == ("b32", 23170, 32)
    pinned = load_tuned(tmp_path, {"sm_90a": _env()}, [FP8], environ={"KVGEN_TUNED_PARAMS": f"{FP8}:score:threads=64"})
    assert pinned.variants_for("sm_90a", FP8) == {} and pinned.for_family("sm_90a", FP8)["score"]["threads"] == 64


@pytest.mark.parametrize(("variants", "op", "why"), [
    ([_variant(32, 5000), _variant(64, 5000, "b32-wide")], "score", "from_work 5000: expected integers ascending"),
    ([{"bucket": "b32", "from_work": 1, "params": {"threads": 3}}], "score", "variants\\[0\\]"),
    ([{"bucket": "large", "from_work": 1, "params": default_params("codec")}], "codec",
     "codec takes one configuration for every size"),
    ({"bucket": "b32"}, "score", "variants: dict, expected a list"),
])
def test_bad_variants_in_a_tuned_file_are_named(tmp_path: Path, variants: list, op: str, why: str) -> None:
    path = tmp_path / "sm_90a" / f"{FP8}.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"schema": 1, "family": FP8, "arch": "sm_90a", "ops": {
        op: {"params": default_params(op), "variants": variants, "environment": ENV}}}))
    with pytest.raises(TuningFileError, match=f"{path}: ops.{op}.*{why}"):
        read_file(path)


def test_selection_work_is_requests_times_score_columns() -> None:
    assert select_work(32, 16384) == 524288
    assert {b.name: bucket_work("select", b.size) for b in BUCKETS["select"]} == {"b1": 16384, "b32": 524288}


def test_a_selection_variant_is_a_library_of_select_alone() -> None:
    source = load_spec_source(SPECS_DIR / "qwen3-8b.yaml")
    main = {"select": {**default_params("select"), "block_w": 64, "aggregate_warps": 8}}
    variants = {"select": (Variant("b32", 92681, {**default_params("select"), "block_w": 256, "head_step": 4}),)}
    jobs = family_jobs(source, "sm_90a", main, variants=variants)
    (extra,) = [job for job in jobs if job.variant is not None]
    assert extra.artifact == "libkvgen_qwen3_8b_select_b32.so" and extra.ops == ("select",)
    assert extra.backend == "triton-aot" and list(extra.rendered) == ["qwen3-8b/select.py"]
    assert extra.plans[0].params["block_w"] == 256 and extra.plans[0].params["head_step"] == 4
    (library,) = [job for job in jobs if job.artifact == "libkvgen_qwen3_8b_select.so"]
    assert library.plans[0].params["block_w"] == 64


def test_each_variant_with_other_params_is_one_more_job_of_its_op_alone() -> None:
    source = load_spec_source(SPECS_DIR / f"{FP8}.yaml")
    main = {"score": {**default_params("score"), "token_tiles": 16}}
    t32 = {**default_params("score"), "token_tiles": 32}
    variants = {"score": (Variant("b32", 23170, t32), Variant("b32-wide", 100000, main["score"]),
                          Variant("b64", 200000, t32))}   # t32 again: served by the b32 library
    jobs = family_jobs(source, "sm_90a", main, variants=variants)
    names = [job.artifact for job in jobs]
    assert "libkvgen_qwen3_8b_fp8_score.so" in names and "libkvgen_qwen3_8b_fp8_score_b32.so" in names
    assert not any("b32_wide" in name for name in names)   # the main config again: served by the main library
    (extra,) = [job for job in jobs if job.variant is not None]
    assert extra.ops == ("score",) and extra.plans[0].params["token_tiles"] == 32


def test_a_compaction_variant_is_a_library_of_compact_cu_alone() -> None:
    source = load_spec_source(SPECS_DIR / "gpt-oss-20b.yaml")
    main = {"compact": {"threads": 128, "tile_tokens": 128, "slices": 2}}
    variants = {"compact": (Variant("b32", 5, {"threads": 128, "tile_tokens": 64, "slices": 2}),)}
    jobs = family_jobs(source, "sm_90a", main, variants=variants)
    (family_library,) = [job for job in jobs if job.artifact == "libkvgen_gpt_oss_20b.so"]
    assert family_library.ops == ("codec", "compact")
    (extra,) = [job for job in jobs if job.variant is not None]
    assert extra.artifact == "libkvgen_gpt_oss_20b_compact_b32.so" and extra.ops == ("compact",)
    assert list(extra.rendered) == ["gpt-oss-20b/compact.cu"] and "kTileTokens = 64" in extra.rendered[
        "gpt-oss-20b/compact.cu"]


def test_the_manifest_names_each_variants_library_and_leaves_out_one_that_failed() -> None:
    from kvgen.build.job import BuildOutcome
    from kvgen.build.pipeline import _family_entry
    from kvgen.lower.tuned import TunedParams

    source = load_spec_source(SPECS_DIR / f"{FP8}.yaml")
    t16, t32 = ({**default_params("score"), "token_tiles": t} for t in (16, 32))
    tuned = TunedParams()
    tuned.set("sm_90a", FP8, "score", t16, variants=(Variant("b32", 23170, t32), Variant("b32-wide", 100000, t16),
                                                      Variant("b64", 200000, t32)))
    jobs = family_jobs(source, "sm_90a", tuned.for_family("sm_90a", FP8), variants=tuned.variants_for("sm_90a", FP8))
    built = [(job, BuildOutcome(FP8, "sm_90a", job.backend, "built", sha256="s")) for job in jobs]
    score = _family_entry(built, tuned).op("score")
    assert [(v.bucket, v.from_work, v.artifact) for v in score.variants] == [
        ("b32", 23170, "libkvgen_qwen3_8b_fp8_score_b32.so"), ("b32-wide", 100000, "libkvgen_qwen3_8b_fp8_score.so"),
        ("b64", 200000, "libkvgen_qwen3_8b_fp8_score_b32.so")]
    assert score.variants[0].params["token_tiles"] == 32
    without = [(job, outcome) for job, outcome in built if job.variant is None]   # the b32 library failed
    assert [v.bucket for v in _family_entry(without, tuned).op("score").variants] == ["b32-wide"]


def _registry(tmp_path: Path, variants: tuple[VariantEntry, ...], files: tuple[str, ...]) -> Path:
    folder = tmp_path / "sm_90a"
    folder.mkdir()
    artifacts = []
    for name in files:
        (folder / name).write_bytes(name.encode())
        artifacts.append(ArtifactEntry(name, file_sha256(folder / name), "cute", "k" * 64))
    op = OpEntry("score", files[0], "score.py.j2", "p" * 64, {"token_tiles": 16}, "measured", variants)
    entry = FamilyEntry(FAMILY := "fam", "sm_90a", f"kvgen_{FAMILY}", "s" * 64, (op,), tuple(artifacts))
    path = folder / "manifest.json"
    write_manifest(path, Manifest("sm_90a", (entry,)))
    return path


def test_the_manifest_carries_variants_and_refuses_one_naming_an_unlisted_file(tmp_path: Path) -> None:
    variant = VariantEntry(23170, "b32", "lib_b32.so", "q" * 64, {"token_tiles": 32})
    path = _registry(tmp_path, (variant,), ("lib.so", "lib_b32.so"))
    manifest = read_manifest(path)
    entry = manifest.family("fam")
    assert entry.op("score").variants == (variant,)
    assert [p.name for p in verify_op_files(path, manifest, entry, "score")] == ["lib.so", "lib_b32.so"]
    from kvgen.cli import _registry_tuning   # kvgen show-config's tuning lines

    assert _registry_tuning(tmp_path) == {"sm_90a fam score": "measured; from work 23170: lib_b32.so (b32)"}
    data = json.loads(path.read_text())
    data["families"][0]["ops"][0]["variants"][0]["artifact"] = "lib_gone.so"
    path.write_text(json.dumps(data))
    _, problems = manifest_problems(path)
    assert any("'lib_gone.so', which is not among its artifacts" in str(p) for p in problems)
    data["families"][0]["ops"][0]["variants"] *= 2   # thresholds must ascend
    path.write_text(json.dumps(data))
    with pytest.raises(RegistryError, match="from_work: 23170, expected ascending"):
        read_manifest(path, verify=False)


class _Library:
    """A loaded score library's identity, as ScoreDispatch reads it."""

    def __init__(self, name: str, family: str = "fam", arch: str = "sm_90a"):
        self.path, self.family, self.arch, self.geometry = Path(name), family, arch, {}
        self.calls: list[tuple] = []

    def score(self, *args, num_pages: int) -> None:
        self.calls.append(tuple(args[11].shape))


def test_each_call_goes_to_the_library_of_its_work() -> None:
    import torch

    main, large = _Library("main.so"), _Library("large.so")
    dispatch = ScoreDispatch(main, [(23170, large)])
    assert dispatch.library_for(1, 4096) is main and dispatch.library_for(32, 4096) is large
    assert dispatch.variant_index(1, 4096) is None and dispatch.variant_index(32, 4096) == 0
    assert dispatch.library_for(1, 23170) is large and dispatch.library_for(1, 23169) is main
    for batch, width in ((1, 100), (32, 16384)):
        dispatch.score(*[None] * 11, torch.empty(2, batch, 4, width, device="meta"), num_pages=1)
    assert main.calls == [(2, 1, 4, 100)] and large.calls == [(2, 32, 4, 16384)]
    assert dispatch.describe() == [{"from_work": 0, "library": "main.so"}, {"from_work": 23170, "library": "large.so"}]
    with pytest.raises(Exception, match="a variant of other for sm_90a, not of fam"):
        ScoreDispatch(main, [(1, _Library("x.so", family="other"))])


def _measured_buckets(path: Path, op: str) -> dict[str, SimpleNamespace]:
    """A recorded measurement file as the tuner's per-bucket results (measured ms and p80/p20 per config)."""
    from kvgen.tuning.space import config_id

    per_bucket: dict[str, SimpleNamespace] = {}
    for r in (json.loads(line) for line in path.open()):
        bucket = per_bucket.setdefault(r["bucket"], SimpleNamespace(bucket=r["bucket"], measured={}, spread={}))
        config = config_id(op, r["params"])
        bucket.measured[config] = r["median_ms"]
        bucket.spread[config] = r["p80_ms"] / r["p20_ms"]
    return per_bucket


def _choice_and_variants(family: str, op: str, buckets: list[SimpleNamespace]) -> tuple[str, list[dict]]:
    """The build choice and the size-dispatched variants the tuner makes of ``buckets``."""
    from kvgen.lower.tuned import build_choice
    from kvgen.tuning.run import _variants
    from kvgen.tuning.space import config_id

    default = config_id(op, read_file(ROOT / "tuning/sm_90a" / f"{family}.json")["ops"][op]["default"])
    choice = build_choice({b.bucket: b.measured for b in buckets}, default, {b.bucket: b.spread for b in buckets})
    return choice, _variants(op, buckets, choice)


def test_fp8_scoring_gets_a_library_for_large_calls_from_the_h100_measurements() -> None:
    """The twelfth session's 99 form-1 candidates x 3 buckets (H100), through the tuner's choice and
    its variants step: b1 keeps the main config (token_tiles 16), b32 and b32-wide share one variant
    (token_tiles 32, mma_tiles 2) from 23170 scored tokens, as the committed tuning file says."""
    from kvgen.tuning.space import config_id

    per_bucket = _measured_buckets(ROOT / "results/2026-12-07-h100-s12/call1/fp8score.jsonl", "score")
    choice, (variant,) = _choice_and_variants(FP8, "score", [per_bucket[b] for b in WORK])
    assert (variant["bucket"], variant["from_work"]) == ("b32", 23170)
    assert (variant["params"]["token_tiles"], variant["params"]["mma_tiles"]) == (32, 2)
    committed = read_file(ROOT / "tuning/sm_90a" / f"{FP8}.json")["ops"]["score"]
    assert config_id("score", committed["params"]) == choice and committed["params"]["token_tiles"] == 16
    assert committed["variants"][0]["params"] == variant["params"]


def test_qwen3_8b_selection_gets_a_library_for_large_calls_from_the_h100_measurements() -> None:
    """The eighteenth session's aggregation subspace (48 candidates x 2 buckets, H100): b1 keeps
    64-column items of 8 warps, b32's own best (256 columns, 2 warps, 4 heads a step: 1.868 against
    2.042 ms) serves calls from sqrt(16384 x 524288) = 92681 requests x columns, as committed."""
    from kvgen.tuning.space import config_id

    per_bucket = _measured_buckets(ROOT / "results/2026-12-07-h100-s18/call1/agg-qwen3-8b.jsonl", "select")
    choice, (variant,) = _choice_and_variants("qwen3-8b", "select", [per_bucket["b1"], per_bucket["b32"]])
    assert (variant["bucket"], variant["from_work"]) == ("b32", 92681)
    assert {k: variant["params"][k] for k in ("block_w", "aggregate_warps", "head_step")} == {
        "block_w": 256, "aggregate_warps": 2, "head_step": 4}
    committed = read_file(ROOT / "tuning/sm_90a" / "qwen3-8b.json")["ops"]["select"]
    assert config_id("select", committed["params"]) == choice and committed["params"]["block_w"] == 64
    assert committed["variants"][0]["params"] == variant["params"]
