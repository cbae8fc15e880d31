"""``kvgen demo`` on the CPU: the whole serving scenario with the oracle as codec and as TriAttention
backends (``--device cpu --small``), checked through its JSON report.

One run (module fixture) with a disk tier and a host budget of three Qwen3-8B cold pages, so that
with the small sizes every path runs: offload under hot-pool pressure, spill to disk under
cold-tier pressure, read back from disk, onboard; the families keep their geometry but only
``CPU_SMALL_LAYERS`` layers (the oracle is slow; a cold page is one record per layer, so per-page
ratios are the same).

Tolerances (NVFP4: E2M1 values with one E4M3 scale per 16 elements, COLD_PAGE_FORMAT.md §3):
- every buffer's restored elements: relative L2 error < 0.12. NVFP4's rounding error of a
  Gaussian block is ~8 % RMS; outlier channels do not raise the relative error of their own row.
- attention with only V restored: < 0.15 (the output is linear in V: the same ~8 %).
- attention with K and V restored: < 0.5, mean cosine > 0.9 for Qwen3-8B (GQA). This is not
  0.2: the synthetic K has two outlier RoPE pairs of 10-50x per head; an outlier sets the scale of
  its 16-element block, the block's ordinary channels round to 0 or ±S/2, and with random queries
  the logits move by ~0.5, which moves the softmax (about 0.3 observed here). DeepSeek-V3's
  latent (RoPE in 64 of 576 channels) stays < 0.2.
Eviction: the error must not grow as the budget grows, and the cache must hold exactly the
original rows of the tokens the rounds kept.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import pytest
import torch

from kvgen import demo
from kvgen.lower.layout import family_layout
from kvgen.spec.schema import load_spec

SPECS = Path(__file__).resolve().parents[1] / "specs"


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    return parser.parse_args(argv)


def small_layout(family: str):
    spec = load_spec(SPECS / f"{family}.yaml")
    return family_layout(spec), family_layout(spec.model_copy(update={"layers": demo.CPU_SMALL_LAYERS}))


HOST_BUDGET = 3 * small_layout("qwen3-8b")[1].lifecycles[0].cold_page_bytes


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp = tmp_path_factory.mktemp("demo")
    out = tmp / "demo.json"
    args = parse(["--device", "cpu", "--small", "--out", str(out), "--disk", str(tmp / "disk"),
                  "--host-budget-mib", repr(HOST_BUDGET / (1 << 20)), "--registry", str(tmp / "no-registry")])
    assert demo.run(args) == 0
    assert not list((tmp / "disk").iterdir()), "the disk tier's file is removed at the end"
    return json.loads(out.read_text())


def test_the_report_says_oracle_and_wall_clock(report: dict) -> None:
    assert report["backend"] == "oracle (cpu)"
    assert report["timer"] == "wall-clock (cpu)"
    assert report["device"]["kind"] == "cpu"
    for family in report["codec"]:
        assert family["backend"] == "oracle (cpu)" and family["library"] is None
        assert family["transfer"]["timer"] == "wall-clock (cpu)"
        assert family["transfer"]["cold_memory"].startswith("host (no GPU")
    assert all(label.startswith("oracle") for label in report["eviction"]["backend"].values())
    assert [f["family"] for f in report["codec"]] == list(demo.CODEC_FAMILIES)
    assert [f["attention_kind"] for f in report["codec"]] == ["gqa", "mla"]


def test_cold_over_hot_is_the_layout_ratio(report: dict) -> None:
    for family in report["codec"]:
        full, small = small_layout(family["family"])
        lc = small.lifecycles[0]
        b = family["bytes"]
        assert family["layers"] == demo.CPU_SMALL_LAYERS
        assert (b["hot_page_bytes"], b["cold_page_bytes"]) == (lc.hot_page_bytes, lc.cold_page_bytes)
        assert b["codec_cold_page_bytes"] == lc.cold_page_bytes
        assert b["cold_over_hot"] == lc.cold_page_bytes / lc.hot_page_bytes
        assert b["hot_over_cold"] == lc.hot_page_bytes / lc.cold_page_bytes
        # one record per layer: the ratio of the full family is the same number
        full_lc = full.lifecycles[0]
        assert b["cold_over_hot"] == full_lc.cold_page_bytes / full_lc.hot_page_bytes == 36864 / 131072
        budget = HOST_BUDGET
        assert b["host_budget_bytes"] == budget
        assert b["cold_pages_in_budget"] == budget // lc.cold_page_bytes
        assert b["raw_pages_in_budget"] == budget // lc.hot_page_bytes
        assert b["cold_pages_in_budget"] > b["raw_pages_in_budget"]


def test_onboarded_pages_are_the_oracle_round_trip(report: dict) -> None:
    spilled = 0
    for family in report["codec"]:
        checks, scenario = family["checks"], family["scenario"]
        assert checks["cold_bytes_equal_oracle"], f"{family['family']}: cold blobs differ from encode(original)"
        assert checks["restored_equal_oracle_decode"], f"{family['family']}: restored K/V != decode(encode(original))"
        assert scenario["offloads"] > 0 and scenario["onboards"] > 0
        assert checks["pages_checked"] == scenario["pages_onboarded"] > 0
        assert scenario["read_from_disk"] <= scenario["spilled_to_disk"]
        assert scenario["disk_bytes_read"] <= scenario["disk_bytes_written"]
        assert scenario["peak_cold_pages"] <= scenario["cold_slots"]
        spilled += scenario["spilled_to_disk"] * (scenario["read_from_disk"] > 0)
    assert spilled > 0, "the small budget pushes cold pages to disk and some come back"


def _finite(*values: float) -> bool:
    return all(v is not None and math.isfinite(v) for v in values)


def test_attention_error_over_the_restored_cache_is_small(report: dict) -> None:
    qwen, deepseek = report["codec"]
    for family in (qwen, deepseek):
        a = family["attention"]
        assert _finite(a["both"]["rel_l2"], a["both"]["cos_mean"], a["both"]["cos_min"])
        for name, value in a["buffer_rel_l2"].items():
            assert _finite(value) and 0 < value < 0.12, f"{family['family']} {name}: element error {value}"
    assert qwen["attention"]["v_only"]["rel_l2"] < 0.15
    assert qwen["attention"]["both"]["rel_l2"] < 0.5 and qwen["attention"]["both"]["cos_mean"] > 0.9
    assert qwen["attention"]["k_only"]["rel_l2"] > qwen["attention"]["v_only"]["rel_l2"], "K's outliers cost most"
    assert deepseek["attention"]["both"]["rel_l2"] < 0.2 and deepseek["attention"]["both"]["cos_mean"] > 0.95


def test_eviction_error_does_not_grow_with_the_budget(report: dict) -> None:
    ev = report["eviction"]
    rows = sorted(ev["budgets"], key=lambda r: r["budget"])
    assert [r["budget"] for r in rows] == list(demo.SMALL.budgets)
    errors = [r["rel_l2"] for r in rows]
    assert _finite(*errors)
    assert all(later <= earlier for earlier, later in zip(errors, errors[1:])), errors
    for row in rows:
        assert row["kept_rows_equal_original"], f"budget {row['budget']}: cache rows are not the kept originals"
        assert row["rounds"] >= 1
        assert ev["prompt"] + row["budget"] <= row["kept_tokens_mean"] < ev["prompt"] + row["budget"] + ev["beta"]
        assert _finite(row["round_ms_median"], row["recent_window_rel_l2"])


def test_arguments_and_output_path() -> None:
    args = parse(["--budgets", "512,1024"])
    assert args.budgets == (512, 1024) and args.registry == Path("build/registry") and args.device is None
    with pytest.raises(SystemExit):
        parse(["--budgets", "512,x"])
    cpu = parse(["--device", "cpu", "--small"])
    assert demo.config_from_args(cpu, {"OUT": "/tmp/o"}).out == Path("/tmp/o/demo.json")
    assert demo.config_from_args(cpu, {}).out == Path("results/demo.json")
    assert demo.config_from_args(cpu, {}).sizes.layers == demo.CPU_SMALL_LAYERS


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without CUDA")
def test_cuda_without_a_gpu_is_a_clear_error(capsys: pytest.CaptureFixture) -> None:
    assert demo.run(parse(["--device", "cuda", "--small"])) == 1
    assert "no CUDA device" in capsys.readouterr().out
