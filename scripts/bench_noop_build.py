"""Time a warm no-op ``kvgen build``: every shipped spec, every target, nothing to do.

Runs ``kvgen build`` the way a user does (the ``kvgen`` script beside this Python, else
``python -m kvgen``), each run a fresh process: one warm-up build first (it compiles whatever the
cache lacks and stamps the result), then ``--runs`` timed no-op builds, then one ``--json`` build
that records what was checked (families, archs, artifacts, whether the no-op path was taken).
Prints one JSON document and writes it to ``--out``.

    python scripts/bench_noop_build.py --registry /tmp/noop-registry --runs 7

The goal (issue 16) is a median of at most 3 s on the 2-core build machine. The machine is shared:
``load_average`` says how busy it was. Pass ``--arch`` to narrow the build (default: each spec's
targets, i.e. sm_90a, sm_100a, sm_103a and sm_107a).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

GOAL_SECONDS = 3.0


def kvgen_command() -> list[str]:
    """The ``kvgen`` console script of this interpreter's environment, else ``python -m kvgen``."""
    script = Path(sys.executable).with_name("kvgen")
    return [str(script)] if script.is_file() else [sys.executable, "-m", "kvgen"]


def run_build(argv: list[str], timeout: float) -> tuple[float, subprocess.CompletedProcess]:
    start = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    return time.perf_counter() - start, proc


def checked(report: dict) -> dict:
    """What the timed builds covered, from the ``--json`` report."""
    outcomes = report["outcomes"]
    return {"families": sorted({o["family"] for o in outcomes}), "archs": sorted({o["arch"] for o in outcomes}),
            "artifacts": sum(1 for o in outcomes if o["status"] in ("hit", "built")), "counts": report["counts"],
            "noop": report.get("noop"), "manifests": report["manifests"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5, help="timed no-op builds (default 5)")
    parser.add_argument("--registry", default="build/registry", help="registry to build into (default build/registry)")
    parser.add_argument("--arch", action="append", default=[], help="passed to kvgen build (default: all targets)")
    parser.add_argument("--out", type=Path, default=Path("results/bench_noop_build.json"), help="JSON written here")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds allowed for the warm-up build")
    args = parser.parse_args(argv)

    build = [*kvgen_command(), "build", "--registry", args.registry, *[f"--arch={a}" for a in args.arch]]
    warm_seconds, proc = run_build(build, args.timeout)
    if proc.returncode != 0:
        print(proc.stdout[-4000:], proc.stderr[-4000:], sep="\n", file=sys.stderr)
        print(f"warm-up build failed (exit {proc.returncode}): {' '.join(build)}", file=sys.stderr)
        return 1
    times = []
    for _ in range(args.runs):
        seconds, proc = run_build(build, 600)
        if proc.returncode != 0:
            print(proc.stderr[-4000:], file=sys.stderr)
            return 1
        times.append(seconds)
    _, proc = run_build([*build, "--json"], 600)
    report = json.loads(proc.stdout)
    result = {
        "command": " ".join(build), "runs": args.runs, "seconds": [round(t, 3) for t in times],
        "median_s": round(statistics.median(times), 3), "min_s": round(min(times), 3),
        "max_s": round(max(times), 3), "goal_s": GOAL_SECONDS, "met": statistics.median(times) <= GOAL_SECONDS,
        "warm_up_s": round(warm_seconds, 3), "checked": checked(report),
        "machine": {"cpus": os.cpu_count(), "load_average_1_5_15_min": [round(x, 2) for x in os.getloadavg()],
                    "python": sys.version.split()[0]},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(json.dumps(result, indent=2))
    return 0 if result["met"] else 1


if __name__ == "__main__":
    sys.exit(main())
