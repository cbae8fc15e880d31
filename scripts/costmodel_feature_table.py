#!/usr/bin/env python3
"""What the cost model reads of each candidate, next to its measured and predicted time: for one op
and bucket of the validation, per family, the candidate's parameters, resident CTAs and warps per
SM of each launch, registers, and the model's dominant term; then, per family, the Spearman of the
measured times against each single feature (which feature, if any, orders the measurements).

    python scripts/costmodel_feature_table.py docs/tuning-evidence/costmodel-validation.json \\
        --features docs/tuning-evidence/costmodel-features-sm_90a.json --op codec --bucket large \\
        --out docs/tuning-evidence/costmodel-codec-large-features.md
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from kvgen.paths import spec_path  # noqa: E402
from kvgen.spec.schema import load_spec  # noqa: E402
from kvgen.tuning.costmodel.features import from_json  # noqa: E402
from kvgen.tuning.costmodel.predict import predict  # noqa: E402
from kvgen.tuning.costmodel.targets import target  # noqa: E402
from kvgen.tuning.costmodel.validate import spearman  # noqa: E402


def params_of(config: str) -> dict[str, int]:
    return {k: int(v) for k, v in (kv.split("=") for kv in config.split(","))}


def rows(study: dict, features: dict, records: dict) -> list[dict]:
    spec, t = load_spec(spec_path(study["family"])), target(study["arch"])
    out = []
    for config in sorted(study["measured_ms"], key=study["measured_ms"].get):
        f = from_json(features[f"{study['family']}|{study['op']}|{study['arch']}|{config}"])
        e = predict(spec, study["op"], records[config]["params"], records[config]["size"], f, t)
        dominant = max(((f"{ph}:{term}", v) for ph, terms in e.terms.items() for term, v in terms.items()
                        if term in ("memory", "issue", "latency")), key=lambda kv: kv[1])[0]
        params = params_of(config)
        warps = {launch: n * math.ceil(params["threads"] / 32) for launch, n in e.residency.items()}
        registers = {launch: max(k.registers for name, k in f.items() if f"{launch}_kernel" in name or launch in name)
                     for launch in e.residency}
        out.append({"config": config, **params, "measured_ms": study["measured_ms"][config], "predicted_ms": e.ms,
                    "resident": e.residency, "warps_per_sm": warps, "registers": registers, "dominant": dominant})
    return out


def single_feature_spearman(table: list[dict]) -> dict[str, float]:
    measured = [r["measured_ms"] for r in table]
    candidates = {"threads": [r["threads"] for r in table]}
    candidates.update({k: [r[k] for r in table] for k in table[0] if k in ("in_flight", "tile_tokens", "lanes",
                                                                            "max_heads", "token_tiles")})
    for launch in table[0]["resident"]:
        candidates[f"{launch} resident CTAs"] = [r["resident"][launch] for r in table]
        candidates[f"{launch} warps/SM"] = [r["warps_per_sm"][launch] for r in table]
        candidates[f"{launch} registers"] = [r["registers"][launch] for r in table]
    candidates["model"] = [r["predicted_ms"] for r in table]
    return {name: spearman(measured, values) for name, values in candidates.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("validation", type=Path)
    parser.add_argument("--features", type=Path, required=True)
    parser.add_argument("--measurements", type=Path, nargs="+", default=sorted(
        (ROOT / "results/2026-11-30-h200-tuned/tuning").glob("measurements-*.jsonl")))
    parser.add_argument("--op", required=True)
    parser.add_argument("--bucket", required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    validation = json.loads(args.validation.read_text())
    features = json.loads(args.features.read_text())
    records: dict[tuple, dict] = {}
    for path in args.measurements:
        for line in path.read_text().splitlines():
            r = json.loads(line)
            if r.get("status") == "ok":
                records.setdefault((r["family"], r["op"], r["bucket"]), {})[r["config"]] = r
    lines = [f"Cost model {validation['model_version']}: {args.op} `{args.bucket}`, each candidate's features next to "
             "its measured (H200) and predicted time, fastest measured first; then the Spearman of the measured "
             "times against each single feature. Written by scripts/costmodel_feature_table.py.", ""]
    for study in validation["studies"]:
        if study["op"] != args.op or study["bucket"] != args.bucket:
            continue
        table = rows(study, features, records[(study["family"], study["op"], study["bucket"])])
        launches = list(table[0]["resident"])
        lines += [f"## {study['family']}", "",
                  "| config | measured ms | predicted ms | " + " | ".join(
                      f"{launch} CTAs/SM, warps/SM, regs" for launch in launches) + " | dominant term |",
                  "|---|---|---|" + "---|" * len(launches) + "---|"]
        for r in table:
            per_launch = " | ".join(f"{r['resident'][x]}, {r['warps_per_sm'][x]}, {r['registers'][x]}" for x in launches)
            lines.append(f"| `{r['config']}` | {r['measured_ms']:.3f} | {r['predicted_ms']:.3f} | {per_launch} | "
                         f"{r['dominant']} |")
        rho = single_feature_spearman(table)
        lines += ["", "Spearman of the measured times against: " + ", ".join(
            f"{name} {value:+.2f}" for name, value in rho.items() if not math.isnan(value)), ""]
    args.out.write_text("\n".join(lines) + "\n")
    print(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
