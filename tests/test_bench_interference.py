"""The interference section of ``kvgen bench report`` from a synthetic ``bench.json`` (CPU): the
table row per (family, strategy, way), the staged goal judged per row, the plot written."""

from __future__ import annotations

import pytest

from kvgen.bench.report import REPORT, write_report
from kvgen.bench.report_interference import FIGURE, interference_rows, meets_goal
from kvgen.bench.suite import BENCHMARKS, write_json
from kvgen.measure.workloads.interference import sm_bound

from .test_bench_report import assert_png

GOALS = {"fraction_of_pinned": 0.90, "slowdown": 1.05}


def run(strategy: str, direction: str, fraction: float, slowdown: float) -> dict:
    beside = {name: {"wall_ms": 7.0, "fraction_of_pinned": fraction, "slowdown": slowdown, "foreground_lost_ms": 0.3,
                     "iterations": 9} for name in ("copy", "gemm")}
    return {"strategy": strategy, "direction": direction, "alone_ms": 6.9, "fraction_of_pinned": fraction + 0.01,
            "beside": beside}


def doc() -> dict:
    results = [{"family": "qwen3-8b", "pages": 949, "hot_bytes": 1 << 30, "cold_bytes": 377 << 20,
                "staged_equals_zero_copy": True,
                "codec": {"strategy": "staged", "reason": "measured", "staging_bytes": 64 << 20},
                "runs": [run("staged", "offload", 0.93, 1.03), run("staged", "onboard", 0.92, 1.08),
                         run("zero-copy", "offload", 0.94, 1.85)],
                "sm_bound": {"offload": sm_bound(0.6, 363626496, 55.24, 0.90),
                             "onboard": sm_bound(0.2, 363626496, 55.43, 0.90)}}]
    return {"schema": 1, "environment": {}, "ceilings": {}, "benchmarks": {"interference": {
        "foreground": {"copy": {"median_ms": 0.5, "what": "1 GiB copy_"},
                       "gemm": {"median_ms": 1.6, "what": "bf16 8192^3 matmul"}},
        "goals": GOALS, "results": results}}}


def test_interference_is_a_benchmark_of_the_suite():
    assert "interference" in BENCHMARKS


def test_sm_bound_is_the_codec_kernels_share_of_a_transfer_at_the_goal_rate():
    # the s12 H100 record: 0.597 ms of qwen3-8b encode; 363.6 MB cold at 0.90 x 55.24 GB/s = 7.31 ms
    bound = sm_bound(0.597, 363626496, 55.24, 0.90)
    assert bound["transfer_ms_at_goal"] == pytest.approx(7.314, abs=1e-3)
    assert bound["sm_share"] == pytest.approx(0.597 / 7.314, rel=1e-3)
    assert bound["busy_foreground_floor"] == pytest.approx(1 / (1 - 0.597 / 7.314), rel=1e-3)
    assert sm_bound(8.0, 363626496, 55.24, 0.90)["busy_foreground_floor"] == float("inf")


def test_staged_goal_needs_both_foregrounds_within_it():
    rows = interference_rows(doc())
    assert [meets_goal(r, GOALS) for r in rows] == [True, False, False]


def test_report_has_the_interference_table_and_plot(tmp_path):
    pytest.importorskip("matplotlib")
    write_json(tmp_path / "bench.json", doc())
    text = write_report(tmp_path).read_text()
    assert (tmp_path / REPORT).exists()
    assert "## Offload and onboard beside the model's work (interference)" in text
    assert "| qwen3-8b | staged | offload | 6.90 ms | 0.94 | 7.00 ms / 0.93 / 1.03× | 7.00 ms / 0.93 / 1.03× | **met** |" \
        in text
    assert "| qwen3-8b | staged | onboard |" in text and "| missed |" in text
    assert "| qwen3-8b | zero-copy | offload |" in text and "1.85×" in text
    assert "runtime default strategy **staged**" in text
    assert ("qwen3-8b offload: the codec kernels take 0.600 ms on the whole GPU, 8.2% of a transfer at 0.90 of "
            "pinned (7.31 ms): a foreground keeping every SM busy slows at least 1.089×, **above** the 1.05× goal."
            in text)
    assert "qwen3-8b onboard:" in text and "within the 1.05× goal" in text
    assert f"![interference]({FIGURE})" in text
    assert_png(tmp_path / FIGURE)
