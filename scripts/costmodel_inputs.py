#!/usr/bin/env python3
"""The cost model's validation inputs: the SASS features of the candidates an H200 run measured,
compiled here from the commit that measured them (no GPU).

    git -C . worktree add --detach /work/wt/old c90e8ab        # the commit of the measurements
    python scripts/costmodel_inputs.py --old-tree /work/wt/old --out build/costmodel \\
        --codec qwen3-8b,deepseek-v3 --compact qwen3-8b --score qwen3-8b
    python -m kvgen.tuning.costmodel.validate results/.../measurements-*.jsonl \\
        --features build/costmodel/features-sm_90a.json --out docs/tuning-evidence

Codec and compaction candidates: rendered by the old tree (its own ``kvgen.render`` and
``kvgen.tuning.space``, in a child process with that tree first on the path), compiled to cubin
with this tree's ``features.nvcc_cubin`` against the old tree's ``kvgen/csrc``. Score candidates:
exported by the old tree's CuTe DSL AOT path (``kvgen.backends.cute_aot export``, one process), the
cubin read out of each exported object. Cubins and features are cached under ``--out``.

Candidates a ``kvgen tune --build-only --bundle DIR`` already compiled (``--bundle``, repeatable):
no old tree, no nvcc; each library's cubin of the candidate's op (``<op>.<arch>.cubin``, embedded
in the ``.so``'s fatbin) is cut out with ``cuobjdump -xelf`` and read like the others, so the
features are those of the very binaries a run measured.

    python scripts/costmodel_inputs.py --out build/costmodel-s18 --bundle build/s18/ct-qwen3-8b
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from kvgen.tuning.costmodel.features import (  # noqa: E402
    cubin_features, cuobjdump, embedded_cubin, extract, to_json)

# Runs inside the old tree: every candidate of each (op, family) rendered, indexed as JSON on stdout.
RENDER = r'''
import json, sys
from pathlib import Path
from kvgen.plan import score_plan
from kvgen.render import render, render_family
from kvgen.spec import load_spec
from kvgen.tuning.space import config_id, configurations
out, wanted = Path(sys.argv[1]), json.loads(sys.argv[2])
index = []
for op, families in wanted.items():
    for family in families:
        spec = load_spec(Path("specs") / f"{family}.yaml")
        for c in configurations(op, spec):
            config = config_id(op, c)
            d = out / family / op / config.replace(",", "_").replace("=", "")
            d.mkdir(parents=True, exist_ok=True)
            name = "score.py" if op == "score" else f"{op}.cu"
            text = render(score_plan(spec, c)) if op == "score" else render_family(spec, params={op: c})[f"{family}/{name}"]
            (d / name).write_text(text)
            index.append({"family": family, "op": op, "config": config, "source": str(d / name)})
print(json.dumps(index))
'''


def render_old(old: Path, out: Path, wanted: dict[str, list[str]]) -> list[dict]:
    env = {**os.environ, "PYTHONPATH": str(old)}
    proc = subprocess.run([sys.executable, "-c", RENDER, str(out / "src"), json.dumps(wanted)], cwd=old, env=env,
                          capture_output=True, text=True, check=True)
    return json.loads(proc.stdout)


def score_features(old: Path, out: Path, entries: list[dict], arch: str) -> dict[str, dict]:
    jobs = {f"{e['family']}__{e['config']}".replace(",", "_").replace("=", ""): e for e in entries}
    export = out / "score-export"
    export.mkdir(parents=True, exist_ok=True)
    jobs_file = export / "jobs.json"
    jobs_file.write_text(json.dumps({"arch": arch, "jobs": {n: e["source"] for n, e in jobs.items()}}))
    env = {**os.environ, "PYTHONPATH": str(old), "CUTE_DSL_ARCH": arch, "CUTE_DSL_NO_CACHE": "1"}
    subprocess.run([sys.executable, "-m", "kvgen.backends.cute_aot", "export", str(jobs_file), str(export)],
                   cwd=old, env=env, check=True)
    done = {}
    for name, e in jobs.items():
        cubin = embedded_cubin(export / name / "kvgen_score_impl.o", export / name / "score.cubin")
        done[f"{e['family']}|score|{arch}|{e['config']}"] = to_json(cubin_features(cubin))
    return done


def bundle_features(bundle: Path, out: Path) -> dict[str, dict]:
    """Features of every built candidate of a bundle (``bundle.json``), keyed like ``extract``'s."""
    index = json.loads((bundle / "bundle.json").read_text())
    done = {}
    for c in index["candidates"]:
        if not c.get("artifact"):
            continue   # a candidate that failed to build has no library
        where = out / "cubins" / Path(c["artifact"]).stem
        where.mkdir(parents=True, exist_ok=True)
        name = f"{c['op']}.{c['arch']}.cubin"
        subprocess.run([str(cuobjdump()), "-xelf", name, str((bundle / c["artifact"]).resolve())], cwd=where,
                       capture_output=True, check=True)
        done[f"{c['family']}|{c['op']}|{c['arch']}|{c['config']}"] = to_json(cubin_features(where / name))
    return done


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--old-tree", type=Path, help="a checkout of the measuring commit (--codec/--compact/--score)")
    parser.add_argument("--bundle", type=Path, action="append", default=[],
                        help="a kvgen tune --build-only bundle whose compiled candidates to read (no old tree)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--arch", default="sm_90a")
    for op in ("codec", "compact", "score"):
        parser.add_argument(f"--{op}", default="", help=f"comma-separated families whose {op} candidates to read")
    args = parser.parse_args(argv)
    wanted = {op: [f for f in getattr(args, op).split(",") if f] for op in ("codec", "compact", "score")}
    if args.bundle:
        cache = args.out / f"features-{args.arch}.json"
        features = {k: v for b in args.bundle for k, v in bundle_features(b, args.out).items()}
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_text(json.dumps(features, indent=0, sort_keys=True) + "\n")
        print(f"{len(features)} candidates' features in {cache}")
        return 0
    if args.old_tree is None:
        parser.error("--old-tree is required unless --bundle is given")
    index = render_old(args.old_tree.resolve(), args.out.resolve(), {op: fs for op, fs in wanted.items() if fs})
    cuda = [{"key": f"{e['family']}|{e['op']}|{args.arch}|{e['config']}", "source": e["source"]}
            for e in index if e["op"] != "score"]
    cache = args.out / f"features-{args.arch}.json"
    features = extract(cuda, args.arch, [args.old_tree / "kvgen" / "csrc"], cache, args.out / "cubins")
    scores = [e for e in index if e["op"] == "score"]
    if scores:
        features.update(score_features(args.old_tree.resolve(), args.out, scores, args.arch))
        cache.write_text(json.dumps(features, indent=0, sort_keys=True) + "\n")
    print(f"{len(features)} candidates' features in {cache}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
