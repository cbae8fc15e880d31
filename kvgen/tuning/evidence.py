"""How good is the search? Exhaustive sweep vs TPE (and random) on the same GPU measurements.

For each (family, op, arch, bucket) of a measurement file: the exhaustive best (every distinct
candidate was measured), then ``seeds`` TPE and random studies replayed over the same records with
a budget of 25 % of the distinct candidates (the default included as trial 0). Reported: each
strategy's gap to the exhaustive best (median, worst, share of seeds within 3 %), the default's
time and the tuned speed-up. Plot: best-so-far over trials (median over seeds) against the
exhaustive best, one panel per study.

    python -m kvgen.tuning.evidence results/.../measurements.jsonl --out docs/tuning

``--fix name=value,...`` replays over the subspace a ``kvgen tune --build-only --fix`` bundle
measured (the default, as there, is still trial 0), so a whole subspace measured once is the
exhaustive reference.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any

from kvgen.lower.plan import default_params
from kvgen.paths import spec_path
from kvgen.spec.schema import load_spec
from kvgen.tuning.space import canonical, check_fixed, config_id, configurations, parse_config
from kvgen.tuning.study import RecordedEvaluator, run_bucket

BUDGET_SHARE = 0.25
WITHIN = 0.03


def studies_in(evaluator: RecordedEvaluator) -> list[tuple[str, str, str, str]]:
    return sorted({key[:4] for key in evaluator.records})


def compare(evaluator: RecordedEvaluator, family: str, op: str, arch: str, bucket: str, seeds: int,
            fixed: dict[str, int] | None = None) -> dict[str, Any]:
    spec = load_spec(spec_path(family))
    space = configurations(op, spec, fixed)
    ok = {config_id(op, c): evaluator(family, op, arch, bucket, c) for c in space}
    times = {c: m.median_ms for c, m in ok.items() if m.status == "ok"}
    best_config = min(times, key=times.get)
    default = config_id(op, canonical(op, default_params(op), spec))
    budget = max(2, math.floor(BUDGET_SHARE * len(space)))
    out: dict[str, Any] = {
        "family": family, "op": op, "arch": arch, "bucket": bucket, "fixed": fixed or {}, "candidates": len(space),
        "failed": {c: m.status for c, m in ok.items() if m.status != "ok"},
        "exhaustive_best": best_config, "exhaustive_best_ms": times[best_config],
        "default": default, "default_ms": times.get(default, math.nan),
        "speedup_vs_default": times.get(default, math.nan) / times[best_config], "budget": budget,
        "within_3pct_of_best": sorted(c for c, t in times.items() if t <= (1 + WITHIN) * times[best_config]),
    }
    for strategy in ("tpe", "random"):
        gaps, curves = [], []
        for seed in range(seeds):
            curve: list[float] = []
            run_bucket(spec, op, arch, bucket, evaluator, strategy=strategy, trials=budget, seed=seed, fixed=fixed,
                       on_trial=lambda t, curve=curve: curve.append(
                           min(curve[-1] if curve else math.inf, t.value if t.value is not None else math.inf)))
            gaps.append(curve[-1] / times[best_config] - 1)
            curves.append(curve)
        out[strategy] = {"gap_median": statistics.median(gaps), "gap_worst": max(gaps),
                         "share_within_3pct": sum(g <= WITHIN for g in gaps) / len(gaps), "seeds": seeds,
                         "best_so_far_median": [statistics.median(c[i] for c in curves) for i in range(budget)]}
    return out


def space_sizes(evaluator: RecordedEvaluator) -> list[dict[str, Any]]:
    """Per (family, op) of the measurements: the distinct candidates measured, today's declared
    space (``configurations`` over ``TUNABLES``, duplicates folded) and its raw grid."""
    from kvgen.tuning.study import grid_size

    measured: dict[tuple[str, str], set[str]] = {}
    for family, op, _arch, _bucket, config in evaluator.records:
        measured.setdefault((family, op), set()).add(config)
    return [{"family": family, "op": op, "measured": len(configs),
             "declared": len(configurations(op, load_spec(spec_path(family)))), "grid": grid_size(op)}
            for (family, op), configs in sorted(measured.items())]


def sizes_markdown(sizes: list[dict[str, Any]], results: list[dict[str, Any]]) -> str:
    """The space sizes, and how often TPE met the goal (median gap within 3 % in a quarter of the trials)."""
    lines = ["| family | op | measured candidates | declared today (distinct) | raw grid |", "|---|---|---|---|---|"]
    lines += [f"| {s['family']} | {s['op']} | {s['measured']} | {s['declared']} | {s['grid']} |" for s in sizes]
    if results:
        met = [r for r in results if r["tpe"]["gap_median"] <= WITHIN]
        lines += ["", f"TPE, 25 % budget, {results[0]['tpe']['seeds']} seeds: median within 3 % of the exhaustive best "
                  f"in {len(met)} of {len(results)} studies; misses: "
                  + (", ".join(f"{r['family']} {r['op']} {r['bucket']} ({100 * r['tpe']['gap_median']:.1f} %)"
                               for r in results if r not in met) or "none")]
    return "\n".join(lines) + "\n"


def plot(results: list[dict[str, Any]], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = min(3, len(results))
    rows = math.ceil(len(results) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.2 * rows), squeeze=False)
    for ax, r in zip(axes.flat, results):
        x = range(1, r["budget"] + 1)
        ax.axhline(r["exhaustive_best_ms"], color="k", lw=1, label=f"exhaustive best ({r['candidates']})")
        ax.axhline(r["exhaustive_best_ms"] * (1 + WITHIN), color="k", lw=0.6, ls=":", label="+3 %")
        ax.axhline(r["default_ms"], color="grey", lw=1, ls="--", label="default")
        for strategy, colour in (("tpe", "tab:blue"), ("random", "tab:orange")):
            ax.plot(x, r[strategy]["best_so_far_median"], marker="o", ms=3, color=colour,
                    label=f"{strategy} (median of {r[strategy]['seeds']} seeds)")
        ax.set_title(f"{r['family']} {r['op']} {r['bucket']}", fontsize=9)
        ax.set_xlabel("trial")
        ax.set_ylabel("best so far (ms)")
        ax.tick_params(labelsize=7)
    for ax in list(axes.flat)[len(results):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=6)
    fig.suptitle("kvgen tune: best-so-far vs trials, 25 % budget (H200 measurements, replayed)", fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.4 / fig.get_figheight()))   # room for the title
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def markdown(results: list[dict[str, Any]]) -> str:
    lines = ["| family | op | bucket | candidates | budget | exhaustive best | ms | default ms | speed-up | "
             "TPE gap median / worst | TPE within 3 % | random gap median / worst |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        t, rnd = r["tpe"], r["random"]
        lines.append(f"| {r['family']} | {r['op']} | {r['bucket']} | {r['candidates']} | {r['budget']} | "
                     f"`{r['exhaustive_best']}` | {r['exhaustive_best_ms']:.4f} | {r['default_ms']:.4f} | "
                     f"{r['speedup_vs_default']:.3f}x | {100 * t['gap_median']:.1f} % / {100 * t['gap_worst']:.1f} % "
                     f"| {100 * t['share_within_3pct']:.0f} % | {100 * rnd['gap_median']:.1f} % / "
                     f"{100 * rnd['gap_worst']:.1f} % |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("measurements", type=Path, nargs="+")
    parser.add_argument("--out", type=Path, required=True, help="directory for evidence.json, .md and .png")
    parser.add_argument("--families", default="", help="comma-separated (default: every family measured)")
    parser.add_argument("--seeds", type=int, default=20)
    parser.add_argument("--sizes-only", action="store_true",
                        help="write space-sizes.md only (with the verdicts of an existing --out/evidence.json); "
                             "no replay")
    parser.add_argument("--fix", default="", help="name=value,...: the subspace the measurements cover (as kvgen tune)")
    args = parser.parse_args(argv)
    evaluator = RecordedEvaluator(args.measurements)
    try:
        fixed = parse_config(args.fix) if args.fix else None
        check_fixed(sorted({key[1] for key in evaluator.records}), fixed or {})
    except ValueError as exc:
        parser.error(f"--fix {args.fix!r}: {exc}")
    if args.sizes_only:
        previous = args.out / "evidence.json"
        results = json.loads(previous.read_text()) if previous.is_file() else []
        text = sizes_markdown(space_sizes(evaluator), results)
        (args.out / "space-sizes.md").write_text(text)
        print(text)
        return 0
    wanted = {f for f in args.families.split(",") if f}
    results = [compare(evaluator, *key, seeds=args.seeds, fixed=fixed) for key in studies_in(evaluator)
               if not wanted or key[0] in wanted]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "evidence.json").write_text(json.dumps(results, indent=1) + "\n")
    (args.out / "evidence.md").write_text(markdown(results))
    plot(results, args.out / "trials.png")
    print(markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
