"""The interference section of ``kvgen bench report``: one table row per (family, strategy,
direction), and a plot of the foreground slowdown against the fraction of pinned bandwidth (the
staged goal is the top-left corner: >= 0.90 of pinned, <= 1.05x slowdown)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

FIGURE = "interference.png"
FOREGROUNDS = ("copy", "gemm")
STRATEGY_COLORS = {"staged": "#4C72B0", "zero-copy": "#C44E52", "device-then-copy": "#8172B3"}
MARKERS = {("offload", "copy"): "o", ("offload", "gemm"): "s", ("onboard", "copy"): "^", ("onboard", "gemm"): "D"}


def interference_rows(doc: dict) -> list[dict]:
    """Flat rows of ``benchmarks.interference.results[].runs[]``."""
    rows = []
    bench = doc.get("benchmarks", {}).get("interference", {})
    for r in bench.get("results", []):
        for run in r.get("runs", []):
            row = {"family": r["family"], "cold_bytes": r["cold_bytes"], **run}
            rows.append(row)
    return rows


def meets_goal(row: dict, goals: dict) -> bool:
    """Staged goal: the fraction of pinned and the slowdown of every foreground within the goals."""
    return all(b["fraction_of_pinned"] >= goals["fraction_of_pinned"] and b["slowdown"] <= goals["slowdown"]
               for b in row["beside"].values())


def interference_markdown(doc: dict, figure: str | None, table, ms, num) -> list[str]:
    """The section's lines (``table``, ``ms``, ``num``: report.py's formatters)."""
    bench = doc.get("benchmarks", {}).get("interference")
    if not bench:
        return []
    goals = bench.get("goals", {"fraction_of_pinned": 0.90, "slowdown": 1.05})
    fg = bench.get("foreground", {})
    out = ["## Offload and onboard beside the model's work (interference)", "",
           "~1.2 GiB of hot pages per family, cold pages in pinned host memory, in one process. Foregrounds on "
           "their own stream, each timed alone first: " +
           ", ".join(f"{name} ({v.get('what', '')}, {ms(v.get('median_ms'))})" for name, v in fg.items()) +
           ". Fraction of pinned: cold bytes / time / pinned ceiling of that way (same run). Slowdown: the "
           "foreground's rate while the transfer runs, relative to alone. Goal for staged: "
           f"≥ {goals['fraction_of_pinned']:.2f} of pinned and ≤ {goals['slowdown']:.2f}× both ways "
           "(**bold**: met).", ""]
    if figure:
        out += [f"![interference]({figure})", ""]
    rows = []
    for r in interference_rows(doc):
        cells = [r["family"], r["strategy"], r["direction"], ms(r["alone_ms"]), num(r["fraction_of_pinned"])]
        for name in FOREGROUNDS:
            b = r["beside"].get(name)
            cells += [f"{ms(b['wall_ms'])} / {num(b['fraction_of_pinned'])} / {num(b['slowdown'])}×" if b else "—"]
        goal = meets_goal(r, goals) if r["strategy"] == "staged" else None
        cells.append("—" if goal is None else ("**met**" if goal else "missed"))
        rows.append(cells)
    out += table(("family", "strategy", "way", "alone", "fraction of pinned",
                  "beside copy: wall / fraction / fg slowdown", "beside GEMM: wall / fraction / fg slowdown",
                  "staged goal"), rows) + [""]
    for r in bench.get("results", []):
        codec = r.get("codec", {})
        out.append(f"{r['family']}: runtime default strategy **{codec.get('strategy', '?')}** "
                   f"({codec.get('reason', '')}); staging {codec.get('staging_bytes', 0) / 2**20:.0f} MiB; "
                   f"staged and zero-copy cold bytes identical: {r.get('staged_equals_zero_copy')}.")
        out += [sm_bound_line(r["family"], way, b, goals) for way, b in r.get("sm_bound", {}).items()]
    return out + [""]


def sm_bound_line(family: str, way: str, bound: dict, goals: dict) -> str:
    """Why a compute-bound foreground cannot keep both goals where the codec's share is too large."""
    floor = bound["busy_foreground_floor"]
    verdict = "within" if floor <= goals["slowdown"] else "**above**"
    return (f"{family} {way}: the codec kernels take {bound['kernels_ms']:.3f} ms on the whole GPU, "
            f"{bound['sm_share']:.1%} of a transfer at {goals['fraction_of_pinned']:.2f} of pinned "
            f"({bound['transfer_ms_at_goal']:.2f} ms): a foreground keeping every SM busy slows at least "
            f"{floor:.3f}×, {verdict} the {goals['slowdown']:.2f}× goal.")


def plot_interference(rows: list[dict], goals: dict, path: Path, pyplot: Any) -> None:
    """Foreground slowdown (y) against the transfer's fraction of pinned beside it (x), one point
    per (family, strategy, way, foreground); the goal region shaded."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 5.5))
    ax.axvspan(goals["fraction_of_pinned"], 1.05, ymin=0, ymax=1, color="#DDEEDD", zorder=0)
    top = max([1.2] + [b["slowdown"] for r in rows for b in r["beside"].values()]) * 1.05
    ax.axhline(goals["slowdown"], color="black", linewidth=0.8, linestyle="--")
    for r in rows:
        for name, b in r["beside"].items():
            ax.scatter(b["fraction_of_pinned"], b["slowdown"], color=STRATEGY_COLORS.get(r["strategy"], "#777777"),
                       marker=MARKERS.get((r["direction"], name), "x"), s=45, zorder=3)
    for strategy, color in STRATEGY_COLORS.items():
        ax.scatter([], [], color=color, label=strategy)
    for (way, name), marker in MARKERS.items():
        ax.scatter([], [], color="grey", marker=marker, label=f"{way} beside {name}")
    ax.set_xlim(0, 1.05)
    ax.set_ylim(0.95, top)
    ax.set_xlabel("transfer: cold bytes / time / pinned ceiling (beside the foreground)")
    ax.set_ylabel("foreground slowdown while the transfer runs (×)")
    ax.set_title("offload / onboard beside the model's work (goal: green band, below the dashed line)")
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
