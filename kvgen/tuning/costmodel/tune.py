"""Model-tuned configurations for targets no GPU of which can be run here (sm_100a, sm_103a,
sm_107a): every candidate of the searched space compiled for the target to a cubin only, its SASS
and resources read (``features``), its time per size bucket predicted (``predict``), and the
configuration with the best predicted geometric-mean speed-up over the default written to
``tuning/<arch>/<family>.json`` under ``"model_ops"`` with ``"method": "model"``.

Gate: an op is model-tuned only if the model passed its validation on the H200 for that op
(``validate``'s JSON, ``ops.<op>.passes``); otherwise nothing is written and the command says why.
A measured entry for the same arch and toolchain always wins at build time (``kvgen.lower.tuned``).

    kvgen tune --model --arch sm_100a --op codec --family qwen3-8b \\
        [--validation docs/tuning-evidence/costmodel-validation.json] [--fix rounding=1,min_blocks=0]
"""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path
from typing import Any, Mapping

from kvgen import __version__
from kvgen.lower.plan import default_params
from kvgen.lower.tuned import build_choice, write_op
from kvgen.spec.schema import FamilySpec
from kvgen.tuning.costmodel.features import KernelFeatures, cubin_features, nvcc_cubin
from kvgen.tuning.costmodel.model import VERSION
from kvgen.tuning.costmodel.predict import predict
from kvgen.tuning.costmodel.targets import ESTIMATES, target
from kvgen.tuning.space import BUCKETS, canonical, config_id, subspace

KERNELS = Path(__file__).resolve().parents[2] / "kernels"
CUDA_OPS = ("codec", "compact")


class NotValidated(RuntimeError):
    """The model failed (or never had) its H200 validation for this op."""


def require_validated(validation: Path, op: str) -> dict[str, Any]:
    try:
        data = json.loads(Path(validation).read_text())
        verdict = data["ops"][op]
    except (OSError, ValueError, KeyError):
        raise NotValidated(f"{validation}: no validation of op {op!r}; model-tuned files need one that "
                           "passed (python -m kvgen.tuning.costmodel.validate)") from None
    if str(data.get("model_version")) != VERSION:
        # a verdict on another model's formulas says nothing about this one's picks
        raise NotValidated(f"{validation}: validates cost model {data.get('model_version')!r}, this is model "
                           f"{VERSION!r}; re-run python -m kvgen.tuning.costmodel.validate")
    if not verdict.get("passes"):
        raise NotValidated(f"{op}: the cost model failed its H200 validation ({validation}: failed studies "
                           f"{', '.join(verdict.get('failed', [])) or '-'}); no model-tuned file written")
    return verdict


def cuda_features(spec: FamilySpec, op: str, params: Mapping[str, int], arch: str, nvcc: str,
                  work: Path) -> dict[str, KernelFeatures]:
    from kvgen.render.source import render_family

    source = work / f"{op}.cu"
    source.write_text(render_family(spec, params={op: params})[f"{spec.name}/{op}.cu"])
    includes = [KERNELS / "include", KERNELS / "cuda"]
    return cubin_features(nvcc_cubin(source, arch, includes, work / f"{op}.cubin", nvcc))


def inputs_of(features: Mapping[str, KernelFeatures]) -> dict[str, Any]:
    """What the model read of one candidate: resources and the loops' instruction mix per kernel."""
    return {name: {"registers": f.registers, "shared_bytes": f.shared_bytes, "local_bytes": f.local_bytes,
                   "hardware_fp4": f.static.hardware_fp4, "static_per_pipe": f.static.per_pipe,
                   "loops": [{"per_pipe": m.per_pipe, "global_bytes": m.global_bytes, "load_bytes": m.load_bytes,
                              "shared_load_bytes": m.shared_load_bytes, "hardware_fp4": m.hardware_fp4} for m in f.loops]}
            for name, f in features.items()}


def model_entry(spec: FamilySpec, op: str, arch: str, candidates: Mapping[str, Mapping[str, KernelFeatures]],
                params: Mapping[str, Mapping[str, int]]) -> dict[str, Any]:
    """The ``model_ops`` entry: predicted times per bucket, the build's choice, the model's inputs."""
    t = target(arch)
    predicted = {b.name: {c: predict(spec, op, params[c], b.size, f, t).ms for c, f in candidates.items()}
                 for b in BUCKETS[op]}
    default = config_id(op, canonical(op, default_params(op), spec))
    choice = build_choice(predicted, default if default in candidates else min(candidates), margin=0.0)
    return {
        "method": "model", "model_version": VERSION, "params": dict(params[choice]),
        "default": canonical(op, default_params(op), spec),
        "target": t.asdict(), "estimates": ESTIMATES.get(arch, {}),
        "buckets": {b: {"best": min(p, key=p.get), "predicted_best_ms": min(p.values()),
                        "predicted_params_ms": p[choice], "predicted_default_ms": p.get(default, math.nan),
                        "predicted_ms": p} for b, p in predicted.items()},
        "inputs": {c: inputs_of(f) for c, f in candidates.items()},
    }


def tune(spec: FamilySpec, op: str, arch: str, nvcc: str, nvcc_version: str, fixed: Mapping[str, int],
         tuning_dir: Path) -> Path:
    if op not in CUDA_OPS:
        raise NotImplementedError(f"{op}: model tuning compiles CUDA ops only (codec, compact)")
    configs = {config_id(op, c): c for c in subspace(op, spec, fixed)}
    candidates = {}
    with tempfile.TemporaryDirectory(prefix="kvgen-costmodel-") as tmp:
        for config, params in configs.items():
            candidates[config] = cuda_features(spec, op, params, arch, nvcc, Path(tmp))
    entry = model_entry(spec, op, arch, candidates, configs)
    entry["searched"] = {"fixed": dict(fixed), "candidates": len(configs)}
    environment = {"kvgen": __version__, "toolchain": {"kvgen": __version__, "nvcc": nvcc_version}, "arch": arch}
    return write_op(tuning_dir, spec.name, arch, op, entry, environment, section="model_ops")
