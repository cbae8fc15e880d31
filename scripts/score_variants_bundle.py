#!/usr/bin/env python3
"""A small bundle of TriAttention scorer variants for one H200 call (issue 14, item 1): per family,
the shipped configuration (its ``tuning/sm_90a`` record over the defaults) and the pipelined shapes
of ``TUNABLES["score"]`` (register prefetch, the cp.async shared-memory ring, several tokens per
thread), built here (CuTe DSL, no GPU), measured there by ``scripts/score_variants.py``:

    python scripts/score_variants_bundle.py --out build/device/scorer        # here
    python scripts/score_variants.py build/device/scorer --out $OUT/score    # on the H200

``--changes FILE`` replaces ``CHANGES`` with per-family lists (JSON ``{family: [change, ...]}``; the
shipped configuration is always measured, first), e.g. ``scripts/score_variants_coef_reuse.json``.

The bundle directory holds ``score-variants.tar.xz`` only (the libraries share their static CUDA
runtime, which the archive stores once; unpacked, they would be ~1 MiB each), and
``variants.json``: which candidate is each family's shipped configuration.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FAMILIES = ("qwen3-8b", "gpt-oss-20b", "gemma-2-9b", "qwen3.5-397b-a17b", "qwen3-8b-fp8")
ARCHIVE = "score-variants.tar.xz"
INDEX = "variants.json"

# Changes over the shipped configuration, the first (none) being the shipped one itself.
CHANGES = (
    {},
    {"prefetch": 1},
    {"threads": 128, "token_tiles": 4, "prefetch": 1},
    {"threads": 128, "token_tiles": 4, "smem_stages": 2},
    {"threads": 128, "token_tiles": 4, "smem_stages": 3},
    {"threads": 256, "token_tiles": 4, "smem_stages": 2},
    {"threads": 128, "token_tiles": 2, "tokens_per_thread": 2, "smem_stages": 2},
    {"threads": 128, "token_tiles": 4, "lanes": 4, "smem_stages": 2},
)


def shipped_params(family: str, arch: str) -> dict[str, int]:
    """The score parameters ``kvgen build`` compiles for ``family``: its tuned record, else the defaults."""
    from kvgen.lower.plan import default_params

    path = ROOT / "tuning" / arch / f"{family}.json"
    tuned = json.loads(path.read_text())["ops"].get("score", {}).get("params", {}) if path.is_file() else {}
    return {**default_params("score"), **tuned}


def load_changes(path: Path) -> dict[str, list[dict[str, int]]]:
    """Per-family change lists from ``path``: ``{family: [{param: value}, ...]}``."""
    try:
        changes = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise SystemExit(f"--changes {path}: {exc}") from exc
    unknown = sorted(set(changes) - set(FAMILIES)) if isinstance(changes, dict) else []
    if not isinstance(changes, dict) or unknown:
        raise SystemExit(f"--changes {path}: a JSON object keyed by family ({', '.join(FAMILIES)}); "
                         f"unknown: {', '.join(unknown)}")
    return changes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "build" / "device" / "scorer")
    parser.add_argument("--family", action="append", choices=FAMILIES, help="default: all five")
    parser.add_argument("--arch", default="sm_90a")
    parser.add_argument("--changes", type=Path, help="JSON {family: [change, ...]} instead of CHANGES")
    args = parser.parse_args(argv)
    changes = load_changes(args.changes) if args.changes else {}
    sys.path.insert(0, str(ROOT))
    from kvgen import paths
    from kvgen.build.job import load_spec_source
    from kvgen.tuning.candidates import Request, build_candidates, pack_bundle
    from kvgen.tuning.space import canonical, config_id

    requests, shipped = [], {}
    for family in args.family or (list(changes) if changes else FAMILIES):
        source = load_spec_source(ROOT / "specs" / f"{family}.yaml")
        base = shipped_params(family, args.arch)
        seen = set()
        for change in ({}, *changes.get(family, ())) if changes else CHANGES:
            params = canonical("score", {**base, **change}, source.spec)
            if config_id("score", params) in seen:
                continue
            seen.add(config_id("score", params))
            requests.append(Request(source, "score", params))
        shipped[family] = config_id("score", canonical("score", base, source.spec))
    with tempfile.TemporaryDirectory(prefix="kvgen-score-variants-") as tmp:
        bundle = Path(tmp) / "bundle"
        built = build_candidates(requests, args.arch, bundle, paths.cache_dir())
        for c in built:
            print(f"{c.family} {c.config}: {c.status}" + (f"\n{c.error}" if c.error else ""))
        (bundle / INDEX).write_text(json.dumps({"shipped": shipped}, indent=1) + "\n")
        args.out.mkdir(parents=True, exist_ok=True)
        pack_bundle(bundle, Path(tmp) / ARCHIVE)
        shutil.copyfile(Path(tmp) / ARCHIVE, args.out / ARCHIVE)
    size = (args.out / ARCHIVE).stat().st_size
    print(f"bundle: {args.out / ARCHIVE} ({size / 2**20:.1f} MiB, {len(built)} variants)")
    return 0 if all(c.status != "failed" for c in built) else 1


if __name__ == "__main__":
    raise SystemExit(main())
