#!/usr/bin/env python3
"""Tuned-config entries for the scorer from a variants run (scripts/score_variants.py on the GPU).

A variants run times a handful of hand-picked scorer configurations per family at batch 1 and 32,
each checked against the float64 oracle and for bit identity with the shipped kernel's scores. This
writes, per family, the configuration with the best geometric-mean speed-up over the shipped one
(``kvgen.lower.tuned.build_choice``, the tuner's own rule) into ``tuning/<arch>/<family>.json``,
replacing the op's entry only where a variant beats the shipped configuration. Only variants that
passed the oracle and are bit-identical to the shipped kernel compete, so the scores do not change.

    python scripts/tuned_from_variants.py results/2026-12-02-h200/score-variants/score_variants.json

The entry's ``strategy`` is ``variants`` and its ``study`` names the JSON, so ``kvgen show-config``
and a reader of the file see that these were not a full search; ``default`` is the declared default
(``kvgen.lower.plan``) as in every tuned file, and ``baseline`` the configuration it replaces.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvgen.lower.plan import default_params  # noqa: E402
from kvgen.lower.tuned import build_choice, read_file, tuning_path, write_op  # noqa: E402
from kvgen.tuning.space import config_id, parse_config  # noqa: E402

BUCKETS = {"B1": "b1", "B32": "b32"}


def eligible(variant: dict) -> bool:
    """Checked against the oracle, and bit-identical to the shipped kernel (or the shipped one)."""
    times = variant["times"].values()
    return (variant["oracle_ok"] and all(t.get("error") is None and t.get("median_ms") for t in times)
            and (variant["shipped"] or all(t.get("bit_identical") for t in times)))


def family_entry(variants: dict, shipped: str, study: str) -> dict | None:
    """The op entry for one family, or None when no variant beats the shipped configuration."""
    ok = {config: v for config, v in variants.items() if eligible(v)}
    if shipped not in ok:
        return None
    per_bucket = {BUCKETS[b]: {c: v["times"][b]["median_ms"] for c, v in ok.items()} for b in BUCKETS}
    choice = build_choice(per_bucket, shipped)
    if choice == shipped:
        return None
    buckets = {}
    for bucket, times in per_bucket.items():
        best = min(times, key=times.get)
        buckets[bucket] = {"best": parse_config(best), "best_ms": times[best], "params_ms": times[choice],
                           "baseline_ms": times[shipped], "speedup": times[shipped] / times[choice],
                           "trials": len(times), "failed": len(variants) - len(ok), "failures": {},
                           "strategy": "variants", "study": study}
    return {"params": parse_config(choice), "default": default_params("score"),
            "baseline": parse_config(shipped), "buckets": buckets}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("variants", type=Path, help="score_variants.json of scripts/score_variants.py")
    parser.add_argument("--arch", default="sm_90a")
    parser.add_argument("--tuning", type=Path, default=ROOT / "tuning")
    args = parser.parse_args(argv)
    run = json.loads(args.variants.read_text(encoding="utf-8"))
    study = str(args.variants.resolve().relative_to(ROOT)) if args.variants.resolve().is_relative_to(ROOT) \
        else str(args.variants)
    for family, variants in run["families"].items():
        entry = family_entry(variants, run["shipped"][family], study)
        if entry is None:
            print(f"{family}: the shipped configuration stays ({run['shipped'][family]})")
            continue
        path = tuning_path(args.tuning, args.arch, family)
        environment = read_file(path)["ops"]["score"]["environment"] if path.exists() else {}
        write_op(args.tuning, family, args.arch, "score", entry, environment)
        gains = ", ".join(f"{b} {e['speedup']:.2f}x" for b, e in entry["buckets"].items())
        print(f"{family}: {config_id('score', entry['params'])} ({gains}) -> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
