"""The whole demo (``demo(config)``), its JSON report and its tables."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from kvgen.demo.config import CODEC_FAMILIES, FORMAT_VERSION, GENERATED_BACKEND, DemoConfig, timer_label
from kvgen.demo.eviction import EvictionResult, run_eviction
from kvgen.demo.offload import CodecFamilyResult, run_codec_family


def device_report(config: DemoConfig) -> dict[str, Any]:
    info: dict[str, Any] = {"kind": config.device.type, "torch": torch.__version__}
    if config.on_gpu:
        props = torch.cuda.get_device_properties(config.device)
        info.update(name=props.name, compute_capability=f"{props.major}.{props.minor}")
    return info


@dataclass
class DemoResult:
    """The whole report; ``dataclasses.asdict`` of it is the JSON written to ``--out``."""

    kvgen_demo: int                    # format version of this report
    backend: str                       # "generated (registry)" | "oracle (cpu)"
    timer: str                         # "cuda events" | "wall-clock (cpu)"
    device: dict[str, Any]
    config: dict[str, Any]
    codec: list[CodecFamilyResult]
    eviction: EvictionResult
    elapsed_s: float


def demo(config: DemoConfig) -> DemoResult:
    """Run both parts."""
    begin = time.perf_counter()
    torch.manual_seed(config.seed)
    codec = [run_codec_family(config, family) for family in CODEC_FAMILIES]
    eviction = run_eviction(config)
    return DemoResult(
        kvgen_demo=FORMAT_VERSION, backend=config.backend, timer=timer_label(config.device),
        device=device_report(config),
        config={"small": config.small, "seed": config.seed, "registry": str(config.registry), "arch": config.arch,
                "disk": str(config.disk) if config.disk else None, "sizes": asdict(config.sizes)},
        codec=codec, eviction=eviction, elapsed_s=time.perf_counter() - begin)


def _fmt(value: Any, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}g}"
    return str(value)


def _table(title: str, columns: Sequence[str]) -> Any:
    from rich.table import Table

    table = Table(title=title)
    for column in columns:
        table.add_column(column)
    return table


def cold_tier_table(report: dict[str, Any]) -> Any:
    table = _table("Cold tier (one page of every layer)", (
        "family", "hot B", "cold B", "cold/hot", "pages in host budget: raw → cold", "pages offloaded",
        "onboarded", "disk spills", "dropped", "bit-exact vs oracle"))
    for fam in report["codec"]:
        b, s, c = fam["bytes"], fam["scenario"], fam["checks"]
        exact = c["cold_bytes_equal_oracle"] and c["restored_equal_oracle_decode"]
        table.add_row(fam["family"], str(b["hot_page_bytes"]), str(b["cold_page_bytes"]), _fmt(b["cold_over_hot"]),
                      f"{b['raw_pages_in_budget']} → {b['cold_pages_in_budget']} (×{b['hot_over_cold']:.3g})",
                      str(s["pages_offloaded"]), str(s["pages_onboarded"]), str(s["spilled_to_disk"]),
                      str(s["dropped"]), f"{exact} ({c['pages_checked']} pages)")
    return table


def transfer_table(report: dict[str, Any]) -> Any:
    table = _table(f"Transfers to/from the cold tier ({report['timer']})", (
        "family", "pages", "encode→host ms", "raw copy→host ms", "offload ×", "decode←host ms",
        "raw copy←host ms", "onboard ×"))
    for fam in report["codec"]:
        t = fam["transfer"] or {}
        table.add_row(fam["family"], str(t.get("pages", 0)), _fmt(t.get("encode_to_cold_ms")),
                      _fmt(t.get("raw_copy_to_host_ms")), _fmt(t.get("offload_speedup_vs_raw")),
                      _fmt(t.get("decode_from_cold_ms")), _fmt(t.get("raw_copy_from_host_ms")),
                      _fmt(t.get("onboard_speedup_vs_raw")))
    return table


def attention_table(report: dict[str, Any]) -> Any:
    table = _table("Attention over the restored K/V vs the original (codec)", (
        "family", "rel L2", "cos mean", "cos min", "K only", "V only", "elements rel L2"))
    for fam in report["codec"]:
        a = fam["attention"]
        both = a.get("both", {})
        table.add_row(fam["family"], _fmt(both.get("rel_l2")), _fmt(both.get("cos_mean"), 4),
                      _fmt(both.get("cos_min")), _fmt(a.get("k_only", {}).get("rel_l2")),
                      _fmt(a.get("v_only", {}).get("rel_l2")),
                      ", ".join(f"{k} {_fmt(v)}" for k, v in a["buffer_rel_l2"].items()))
    return table


def eviction_table(report: dict[str, Any]) -> Any:
    ev = report["eviction"]
    table = _table(f"TriAttention eviction, {ev['family']}: {ev['requests']} requests, prompt {ev['prompt']}, "
                   f"{ev['generated']} generated, β {ev['beta']} ({ev['timer']})", (
                       "budget", "cached tokens", "rounds", "round ms (median)", "rel L2", "cos mean",
                       "recent-window rel L2", "rows exact"))
    for row in ev["budgets"]:
        table.add_row(str(row["budget"]), _fmt(row["kept_tokens_mean"]), str(row["rounds"]),
                      _fmt(row["round_ms_median"]), _fmt(row["rel_l2"]), _fmt(row["cos_mean"], 4),
                      _fmt(row["recent_window_rel_l2"]), str(row["kept_rows_equal_original"]))
    return table


def print_report(report: dict[str, Any]) -> None:
    from rich.console import Console

    console = Console(highlight=False, width=None if sys.stdout.isatty() else 160)
    console.print(f"kvgen demo: backend [bold]{report['backend']}[/bold], times: {report['timer']}"
                  + ("" if report["backend"] == GENERATED_BACKEND else " (oracle code, not kernel times)"))
    for table in (cold_tier_table(report), transfer_table(report), attention_table(report), eviction_table(report)):
        console.print(table)
    console.print("eviction backends: " + "; ".join(f"{k}: {v}" for k, v in report["eviction"]["backend"].items()))


def write_report(result: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
