"""Is the model right where it can be checked? Its ranking against the measured ranking, per
(family, op, bucket), over recorded H200 measurements whose candidates' SASS was extracted.

Goals (issue 17): Spearman rank correlation >= 0.8 over the study's candidates, and the model's
top pick within 5 % of the measured best. A study whose measured times all lie within
``NOISE`` of one another has no ranking to match (the measurement's own spread is that large):
it is reported with its Spearman but judged on the top pick alone. An op passes when every one
of its studies meets the goals that apply; only an op that passes may have model-tuned files.

Noise (reported next to the goals, never instead of them): per study, the measurement's noise
band is the larger of the median within-run spread of its candidates ((p80 - p20) / median of the
20 repetitions) and, where the same candidates were measured again (``--rerun``), the median
run-to-run change. Two readings follow from it: the Spearman a perfect model could reach against
measurements that noisy (the ``ceiling``: the measured times against themselves perturbed by the
band, median of 200 seeded draws; with a re-run, also the two runs against each other), and the
top pick counted within 5 % plus the band. The noise-aware verdict judges the Spearman only where
the ceiling reaches the goal; the gate for model-tuned files stays the plain goals.

    python -m kvgen.tuning.costmodel.validate MEASUREMENTS.jsonl... --features F.json --out DIR \
        [--rerun VERIFY.jsonl] [--gpu h100]

``--gpu`` judges the model with the table of the part that measured (``targets.GPUS``: the H100
for measurements of an H100, whose HBM is slower than the H200 the sm_90a table describes);
without it, the arch's own table.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

from kvgen.paths import spec_path
from kvgen.spec.schema import load_spec
from kvgen.tuning.costmodel.features import from_json
from kvgen.tuning.costmodel.model import VERSION
from kvgen.tuning.costmodel.predict import predict
from kvgen.tuning.costmodel.targets import GPUS, gpu_target, target

SPEARMAN_GOAL = 0.8
TOP_PICK_GOAL = 0.05
NOISE = 0.03


def ranks(values: list[float]) -> list[float]:
    """Ranks from 1, ties sharing their mean rank."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    out = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return out


def spearman(a: list[float], b: list[float]) -> float:
    """Pearson correlation of the ranks (nan when either side has a single rank)."""
    ra, rb = ranks(a), ranks(b)
    ma, mb = sum(ra) / len(ra), sum(rb) / len(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    va, vb = sum((x - ma) ** 2 for x in ra), sum((y - mb) ** 2 for y in rb)
    return cov / math.sqrt(va * vb) if va and vb else math.nan


def noise_band(records: dict[str, dict], rerun: dict[str, dict] | None = None) -> dict[str, Any]:
    """The study's noise: within-run band and, with a re-run, the run-to-run change and Spearman."""
    within = statistics.median((r["p80_ms"] - r["p20_ms"]) / r["median_ms"] for r in records.values())
    out: dict[str, Any] = {"within_run": within, "band": within}
    common = sorted(set(records) & set(rerun or {}))
    if len(common) >= 3:
        a, b = [records[c]["median_ms"] for c in common], [rerun[c]["median_ms"] for c in common]
        again = min(common, key=lambda c: rerun[c]["median_ms"])
        out.update(rerun_candidates=len(common), rerun_change=statistics.median(abs(y / x - 1) for x, y in zip(a, b)),
                   rerun_spearman=spearman(a, b), rerun_pick_gap=records[again]["median_ms"] / min(a) - 1)
        out["band"] = max(within, out["rerun_change"])
    return out


def spearman_ceiling(measured: list[float], band: float, draws: int = 200, seed: int = 0) -> float:
    """The Spearman of the measured times against themselves perturbed by ``band`` (relative, one
    standard deviation): what a perfect model can expect against measurements this noisy."""
    rng = random.Random(seed)
    return statistics.median(spearman(measured, [m * (1 + band * rng.gauss(0, 1)) for m in measured])
                             for _ in range(draws))


def study_verdict(measured: dict[str, float], predicted: dict[str, float], noise: dict[str, Any] | None = None
                  ) -> dict[str, Any]:
    configs = sorted(measured)
    m = [measured[c] for c in configs]
    p = [predicted[c] for c in configs]
    best = min(m)
    pick = min(configs, key=lambda c: (predicted[c], c))
    rho = spearman(m, p)
    spread = max(m) / best - 1
    flat = spread <= NOISE
    top_gap = measured[pick] / best - 1
    meets_top = top_gap <= TOP_PICK_GOAL
    meets_rank = flat or (not math.isnan(rho) and rho >= SPEARMAN_GOAL)
    out = {"candidates": len(configs), "spearman": rho, "measured_spread": spread, "flat": flat,
           "model_pick": pick, "model_pick_ms": measured[pick], "measured_best": min(configs, key=measured.get),
           "measured_best_ms": best, "top_pick_gap": top_gap, "passes": meets_top and meets_rank,
           "measured_ms": measured, "predicted_ms": predicted}
    if noise is not None:
        ceiling = spearman_ceiling(m, noise["band"])
        if "rerun_spearman" in noise:
            ceiling = min(ceiling, noise["rerun_spearman"])
        rank_judged = not flat and ceiling >= SPEARMAN_GOAL
        out["noise"] = {**noise, "spearman_ceiling": ceiling, "rank_judged": rank_judged,
                        "pick_within_goal_plus_band": top_gap <= TOP_PICK_GOAL + noise["band"]}
        out["passes_noise_aware"] = out["noise"]["pick_within_goal_plus_band"] and (not rank_judged or meets_rank)
    return out


def measurements(paths: list[Path]) -> dict[tuple, dict[str, dict]]:
    """(family, op, arch, bucket) -> config -> the measurement record (status ok only)."""
    out: dict[tuple, dict[str, dict]] = defaultdict(dict)
    for path in paths:
        for line in Path(path).read_text().splitlines():
            r = json.loads(line)
            if r.get("status") == "ok":
                out[(r["family"], r["op"], r["arch"], r["bucket"])][r["config"]] = r
    return out


def validate(paths: list[Path], features: dict[str, dict], arch: str = "sm_90a",
             reruns: list[Path] = (), gpu: str | None = None) -> list[dict[str, Any]]:
    t = gpu_target(gpu, arch) if gpu else target(arch)
    again = measurements(list(reruns))
    results = []
    for (family, op, rec_arch, bucket), records in sorted(measurements(paths).items()):
        keys = {c: f"{family}|{op}|{rec_arch}|{c}" for c in records}
        if rec_arch != arch or not all(k in features for k in keys.values()):
            continue
        spec = load_spec(spec_path(family))
        predicted = {c: predict(spec, op, r["params"], r["size"], from_json(features[keys[c]]), t).ms
                     for c, r in records.items()}
        noise = noise_band(records, again.get((family, op, rec_arch, bucket)))
        verdict = study_verdict({c: r["median_ms"] for c, r in records.items()}, predicted, noise)
        results.append({"family": family, "op": op, "arch": arch, "bucket": bucket, **verdict})
    return results


def op_verdicts(results: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per op: passes when every study of at least 3 families passes."""
    out: dict[str, dict[str, Any]] = {}
    for op in sorted({r["op"] for r in results}):
        rs = [r for r in results if r["op"] == op]
        families = sorted({r["family"] for r in rs})
        failed = [f"{r['family']}/{r['bucket']}" for r in rs if not r["passes"]]
        failed_noise = [f"{r['family']}/{r['bucket']}" for r in rs if not r.get("passes_noise_aware", r["passes"])]
        out[op] = {"families": families, "studies": len(rs), "failed": failed,
                   "passes": len(families) >= 3 and not failed, "failed_noise_aware": failed_noise,
                   "passes_noise_aware": len(families) >= 3 and not failed_noise}
    return out


def markdown(results: list[dict[str, Any]], verdicts: dict[str, dict[str, Any]], part: str = "H200") -> str:
    lines = [f"Cost model version {VERSION} against the {part} (sm_90a) measurements. Goals: Spearman >= "
             f"{SPEARMAN_GOAL} (not judged where every measured time lies within {100 * NOISE:.0f} % of the best: "
             f"'flat'), model's pick within {100 * TOP_PICK_GOAL:.0f} % of the measured best.", "",
             "Noise band: the larger of the candidates' median within-run (p80 - p20) / median and, where a "
             "re-run exists, the median run-to-run change. Ceiling: the Spearman a perfect model could reach "
             "against measurements that noisy (and, with a re-run, the two runs against each other). "
             "Noise-aware: the Spearman judged only where the ceiling reaches the goal, the pick within 5 % "
             "plus the band. The gate for model-tuned files is the plain goals.", "",
             "| op | family | bucket | candidates | measured spread | noise band | ceiling | Spearman | model pick "
             "| its gap to best | passes | noise-aware |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        n = r.get("noise", {})
        rerun = f" (re-run: {n['rerun_spearman']:.2f}, its best +{100 * n['rerun_pick_gap']:.1f} %)" \
            if "rerun_spearman" in n else ""
        lines.append(f"| {r['op']} | {r['family']} | {r['bucket']} | {r['candidates']} | "
                     f"{100 * r['measured_spread']:.1f} %{' (flat)' if r['flat'] else ''} | "
                     f"{100 * n.get('band', math.nan):.1f} % | {n.get('spearman_ceiling', math.nan):.2f}{rerun} | "
                     f"{r['spearman']:.2f} | `{r['model_pick']}` | {100 * r['top_pick_gap']:.1f} % | "
                     f"{'yes' if r['passes'] else 'NO'} | {'yes' if r.get('passes_noise_aware') else 'NO'} |")
    lines += ["", "| op | families | studies | failed studies | validated | failed, noise-aware | noise-aware |",
              "|---|---|---|---|---|---|---|"]
    for op, v in verdicts.items():
        lines.append(f"| {op} | {', '.join(v['families'])} | {v['studies']} | {', '.join(v['failed']) or '-'} | "
                     f"{'yes' if v['passes'] else 'NO'} | {', '.join(v['failed_noise_aware']) or '-'} | "
                     f"{'yes' if v['passes_noise_aware'] else 'NO'} |")
    return "\n".join(lines) + "\n"


def plot(results: list[dict[str, Any]], path: Path, part: str = "H200") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = 4
    rows = math.ceil(len(results) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.4 * cols, 2.9 * rows), squeeze=False)
    for ax, r in zip(axes.flat, results):
        configs = sorted(r["measured_ms"])
        m = [r["measured_ms"][c] for c in configs]
        p = [r["predicted_ms"][c] for c in configs]
        ax.scatter(p, m, s=10, color="tab:green" if r["passes"] else "tab:red")
        ax.scatter([r["predicted_ms"][r["model_pick"]]], [r["model_pick_ms"]], s=40, facecolors="none",
                   edgecolors="k", label="model pick")
        ax.axhline(r["measured_best_ms"] * (1 + TOP_PICK_GOAL), color="grey", lw=0.6, ls=":")
        ax.set_title(f"{r['family']} {r['op']} {r['bucket']}\nrho {r['spearman']:.2f}, pick +"
                     f"{100 * r['top_pick_gap']:.1f} %", fontsize=7)
        ax.set_xlabel("predicted ms", fontsize=7)
        ax.set_ylabel("measured ms", fontsize=7)
        ax.tick_params(labelsize=6)
    for ax in list(axes.flat)[len(results):]:
        ax.axis("off")
    fig.suptitle(f"kvgen cost model v{VERSION}: predicted vs measured, {part} (green: meets the goals)", fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.4 / fig.get_figheight()))   # room for the title
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("measurements", type=Path, nargs="+")
    parser.add_argument("--features", type=Path, action="append", required=True,
                        help="feature cache(s) (kvgen.tuning.costmodel.features.extract)")
    parser.add_argument("--rerun", type=Path, action="append", default=[],
                        help="measurements of some of the same candidates taken again (the run-to-run noise)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--gpu", choices=sorted(GPUS),
                        help="the part that measured, where it is not the one the arch's table describes")
    args = parser.parse_args(argv)
    features: dict[str, dict] = {}
    for path in args.features:
        features.update(json.loads(path.read_text()))
    results = validate(args.measurements, features, reruns=args.rerun, gpu=args.gpu)
    verdicts = op_verdicts(results)
    part = args.gpu.upper() if args.gpu else "H200"
    # which table judged it, where it is not the arch's own (the default output stays as it was)
    table = {"gpu": GPUS[args.gpu].gpu, "target": GPUS[args.gpu].asdict()} if args.gpu else {}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "costmodel-validation.json").write_text(json.dumps(
        {"model_version": VERSION, **table, "ops": verdicts, "studies": results}, indent=1) + "\n")
    (args.out / "costmodel-validation.md").write_text(markdown(results, verdicts, part))
    plot(results, args.out / "costmodel-validation.png", part)
    print(markdown(results, verdicts, part))
    return 0


if __name__ == "__main__":
    sys.exit(main())
