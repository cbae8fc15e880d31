"""Tuned configurations: written by ``kvgen tune`` into ``tuning/<arch>/<family>.json``, read by
``kvgen build``. No optuna here (the build reads plain JSON).

File (schema 1)::

    {"schema": 1, "family": ..., "arch": ...,
     "ops": {op: {"params": {...},            <- what the build compiles
                  "default": {...},
                  "environment": {gpu, compute_capability, driver, cuda_runtime, torch, kvgen,
                                  toolchain: {nvcc | cutlass_dsl: version}},   <- where it was measured
                  "buckets": {bucket: {"best": {...}, "best_ms", "default_ms", "params_ms",
                                       "speedup", "trials", "failed", "failures", "strategy"}},
                  "variants": [{"bucket", "from_work", "params", "params_ms"}, ...]}}}   <- optional

Each op carries its own environment: ops are tuned at different times, with different compilers.

Model-tuned entries (``kvgen.tuning.costmodel``: picked by the static cost model for a target no GPU
of which was measured) live beside them under ``"model_ops"`` with ``"method": "model"``, the model
version, its inputs and predicted times. A measured entry of an op that applies to the build (same
arch, kvgen and toolchain) always wins over the model's; a model entry is used only where no
measured one applies, and is itself checked against the build's kvgen and toolchain.

``params`` is the configuration with the best geometric-mean speed-up over the buckets (among those
measured in all of them); each bucket also records its own winner and what the compromise costs
there (``params_ms``). Where a bucket's own winner beats the compromise by more than the noise, an
op that owns its artifact (``VARIANT_OPS``) also gets ``variants``
(``kvgen.tuning.space.dispatch_variants``): the build compiles each as one more library, and the runtime sends calls
of at least ``from_work`` to it.

Validity: a file is used only when its environment matches the build's: same arch, same kvgen
version (major.minor), the same compiler release that will compile it (nvcc for codec/compact,
the CuTe DSL for score), and, when the build machine has a GPU, the same GPU name. Otherwise the
safe defaults are used and one line says why. ``KVGEN_TUNING=off`` ignores every file;
``KVGEN_TUNED_PARAMS='qwen3-8b:codec:threads=512,in_flight=2;...'`` overrides (any family/op).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from kvgen import paths
from kvgen.lower.plan import TUNABLES, Op, check_params

SCHEMA = 1
# Ops whose size-dispatched variant is one more library of that op alone: the scorer and the
# selection own their artifacts, and compaction is a translation unit with its own C ABI inside the
# family's nvcc library (its variant library compiles compact.cu alone). The codec takes one
# configuration for every size; the packer is not tuned.
VARIANT_OPS: tuple[Op, ...] = ("score", "compact", "select")
# How the parameters the build compiles were chosen (the manifest and ``kvgen show-config`` say it).
MEASURED, MODEL, OVERRIDE, DEFAULT = "measured", "model-tuned", "override", "default"
OP_TOOLCHAIN = {"codec": "nvcc", "compact": "nvcc", "score": "cutlass_dsl", "pack": "triton", "select": "triton"}


class TuningFileError(ValueError):
    """A tuned-config file or override that cannot be used; the message names it."""


def tuning_path(tuning_dir: Path, arch: str, family: str) -> Path:
    return Path(tuning_dir) / arch / f"{family}.json"


def read_file(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise TuningFileError(f"{path}: not a readable tuned-config file ({exc})") from None
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        raise TuningFileError(f"{path}: schema {data.get('schema') if isinstance(data, dict) else None!r}, "
                              f"this kvgen reads {SCHEMA}")
    for section in ("ops", "model_ops"):
        for op, entry in data.get(section, {}).items():
            if op not in TUNABLES:
                raise TuningFileError(f"{path}: {section}: unknown op {op!r}")
            try:
                check_params(op, entry["params"])
            except (KeyError, ValueError, TypeError) as exc:
                raise TuningFileError(f"{path}: {section}.{op}.params: {exc}") from None
            _check_variants(path, f"{section}.{op}", op, entry.get("variants", []))
            if section == "model_ops" and entry.get("method") != "model":
                raise TuningFileError(f"{path}: model_ops.{op}: \"method\" is {entry.get('method')!r}, not 'model'")
    return data


def _check_variants(path: Path, where: str, op: Op, variants: Any) -> None:
    if variants and op not in VARIANT_OPS:
        raise TuningFileError(f"{path}: {where}.variants: {op} takes one configuration for every size "
                              f"(variants exist for {', '.join(VARIANT_OPS)})")
    if not isinstance(variants, list):
        raise TuningFileError(f"{path}: {where}.variants: {type(variants).__name__}, expected a list")
    last = -1
    for i, variant in enumerate(variants):
        try:
            check_params(op, variant["params"])
            start = variant["from_work"]
            if not isinstance(start, int) or isinstance(start, bool) or start <= last:
                raise ValueError(f"from_work {start!r}: expected integers ascending from 0")
            last = start
        except (KeyError, ValueError, TypeError) as exc:
            raise TuningFileError(f"{path}: {where}.variants[{i}]: {exc}") from None


def write_op(tuning_dir: Path, family: str, arch: str, op: Op, entry: Mapping[str, Any],
             environment: Mapping[str, Any], section: str = "ops") -> Path:
    """Set one op's entry of ``tuning/<arch>/<family>.json`` (other ops and sections kept),
    atomically; ``section`` "model_ops" for the cost model's picks. A measured entry replaces the
    model's entry of the op (the caller records how far the model was off, ``model_offset``)."""
    path = tuning_path(tuning_dir, arch, family)
    data = read_file(path) if path.exists() else {"schema": SCHEMA, "family": family, "arch": arch, "ops": {}}
    data.setdefault("ops", {})
    data[section] = dict(sorted({**data.get(section, {}), op: {**entry, "environment": dict(environment)}}.items()))
    if section == "ops" and op in data.get("model_ops", {}):
        del data["model_ops"][op]
        if not data["model_ops"]:
            del data["model_ops"]
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n", encoding="utf-8")
    os.replace(tmp, path)
    return path


def model_entry(tuning_dir: Path, family: str, arch: str, op: Op) -> dict[str, Any] | None:
    """The model-tuned entry of an op, if the file has one."""
    path = tuning_path(tuning_dir, arch, family)
    return read_file(path).get("model_ops", {}).get(op) if path.is_file() else None


def model_offset(model: Mapping[str, Any], measured: Mapping[str, Mapping[str, float]],
                 choice: str, model_choice: str) -> dict[str, Any]:
    """How far the model was off, from the measurements that replace its pick: per bucket, the
    measured time of the model's bucket pick and of its build choice against the measured best."""
    buckets = {}
    for bucket, times in measured.items():
        best = min(times.values())
        pick = model.get("buckets", {}).get(bucket, {}).get("best")
        buckets[bucket] = {"model_pick": pick, "model_pick_ms": times.get(pick, math.nan),
                           "measured_best_ms": best,
                           "model_pick_off": times[pick] / best - 1 if pick in times else math.nan,
                           "model_choice_off": times[model_choice] / times[choice] - 1
                           if model_choice in times and choice in times else math.nan}
    return {"model_version": model.get("model_version"), "model_params": dict(model["params"]),
            "buckets": buckets}


# ---------------------------------------------------------------------------------------------
# The build's choice among the buckets
# ---------------------------------------------------------------------------------------------


# The run-to-run repeat of one kernel on the H200: qwen3-8b's default codec (1 GiB scattered, encode
# and decode) measured 0.727 and 0.751 ms in two bundles of one device call, 3.4 % apart, while each
# measurement's own p20-p80 spread was 0.5 % (results/2026-12-03-h200-s6/tune/). A measured gain
# below this is not evidence.
CHOICE_MARGIN = 0.035


def build_choice(per_bucket: Mapping[str, Mapping[str, float]], default: str,
                 spread: Mapping[str, Mapping[str, float]] | None = None, margin: float = CHOICE_MARGIN) -> str:
    """Config id with the best geometric-mean speed-up over the default across every bucket, among
    configs measured in all of them (the default when nothing else is).

    A bucket's ratio counts only beyond its noise: the larger of ``margin`` and the p80/p20
    ``spread`` (bucket -> config -> ratio) of either measurement; within it the bucket is a tie.
    So a latency-bound bucket's noise cannot outvote a bulk bucket the config loses, and the
    default stays unless something beats it by more than the noise (predictions: ``margin`` 0)."""
    common = set.intersection(*(set(m) for m in per_bucket.values())) if per_bucket else set()
    if default not in common:
        return default

    def noise(bucket: str, config: str) -> float:
        ratios = (spread or {}).get(bucket, {})
        return math.log(max(1.0 + margin, ratios.get(config, 1.0), ratios.get(default, 1.0)))

    def gain(config: str) -> float:
        total = 0.0
        for bucket, m in per_bucket.items():
            r = math.log(m[default] / m[config])
            total += math.copysign(max(0.0, abs(r) - noise(bucket, config)), r)
        return total

    return max(sorted(common), key=lambda c: (gain(c), c == default))


# ---------------------------------------------------------------------------------------------
# What the build compiles
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BuildEnvironment:
    """What the configurations will be compiled with (and on, if the build machine has a GPU)."""

    kvgen: str
    toolchains: Mapping[str, str]          # "nvcc" / "cutlass_dsl" -> version
    gpu: str | None = None


@dataclass(frozen=True)
class Variant:
    """A size-dispatched configuration of an op (``dispatch_variants``): calls of at least
    ``from_work`` run it."""

    bucket: str
    from_work: int
    params: Mapping[str, int]


@dataclass
class TunedParams:
    """arch -> family -> op -> params (and size-dispatched variants), plus one line per file or
    override not used, or used."""

    table: dict[str, dict[str, dict[Op, dict[str, int]]]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    methods: dict[tuple[str, str, str], str] = field(default_factory=dict)   # (arch, family, op) -> MEASURED...
    variants: dict[tuple[str, str, str], tuple[Variant, ...]] = field(default_factory=dict)

    def for_family(self, arch: str, family: str) -> dict[Op, dict[str, int]]:
        return self.table.get(arch, {}).get(family, {})

    def variants_for(self, arch: str, family: str) -> dict[Op, tuple[Variant, ...]]:
        return {op: v for (a, f, op), v in self.variants.items() if (a, f) == (arch, family)}

    def set(self, arch: str, family: str, op: Op, params: Mapping[str, int], method: str = MEASURED,
            variants: tuple[Variant, ...] = ()) -> None:
        """``op``'s parameters (and variants: an override or model pick, which name one
        configuration, drops the measured ones)."""
        self.table.setdefault(arch, {}).setdefault(family, {})[op] = dict(params)
        self.methods[(arch, family, op)] = method
        self.variants.pop((arch, family, op), None)
        if variants:
            self.variants[(arch, family, op)] = variants

    def method(self, arch: str, family: str, op: str) -> str:
        """How the build's parameters of ``op`` were chosen (DEFAULT when no file or override applied)."""
        return self.methods.get((arch, family, op), DEFAULT)


def _minor(version: str) -> str:
    return ".".join(str(version).split(".")[:2])


def mismatch(data: Mapping[str, Any], op: Op, env: BuildEnvironment, section: str = "ops") -> str:
    """Why a file's op entry does not apply here ("" when it does). A model entry names no GPU
    (nothing was measured): only its kvgen and toolchain are checked."""
    recorded = data[section][op].get("environment", {})
    if _minor(recorded.get("kvgen", "")) != _minor(env.kvgen):
        return f"tuned with kvgen {recorded.get('kvgen')!r}, building with {env.kvgen}"
    tool = OP_TOOLCHAIN[op]
    want = env.toolchains.get(tool)
    have = recorded.get("toolchain", {}).get(tool)
    if want is not None and _minor(have or "") != _minor(want):
        return f"{op} tuned with {tool} {have!r}, building with {want}"
    if env.gpu and recorded.get("gpu") and recorded["gpu"] != env.gpu:
        return f"tuned on {recorded['gpu']}, this machine has {env.gpu}"
    return ""


def load_tuned(tuning_dir: Path, envs: Mapping[str, BuildEnvironment], families: list[str],
               environ: Mapping[str, str] | None = None) -> TunedParams:
    """The tuned parameters ``kvgen build`` applies for each arch of ``envs`` (what that arch is
    built with), with a note for each file it does not use."""
    tuned = TunedParams()
    before, after = switch_notes(environ)
    tuned.notes += before
    if paths.tuning_enabled(environ):
        for arch, env in envs.items():
            for family in families:
                _load_one(tuning_path(tuning_dir, arch, family), arch, family, env, tuned)
    for (family, op), params in parse_override(paths.tuned_params_override(environ)).items():
        for arch in envs:
            tuned.set(arch, family, op, {**tuned.for_family(arch, family).get(op, {}), **params}, OVERRIDE)
    tuned.notes += after
    return tuned


def switch_notes(environ: Mapping[str, str] | None = None) -> tuple[list[str], list[str]]:
    """The notes of ``KVGEN_TUNING=off`` and of a ``KVGEN_TUNED_PARAMS`` override: (before the
    tuned files' notes, after them). A bad override raises ``TuningFileError`` naming the variable."""
    before = [] if paths.tuning_enabled(environ) else [
        "KVGEN_TUNING=off: building every op with its safe default parameters"]
    override = paths.tuned_params_override(environ)
    parse_override(override)
    return before, [f"KVGEN_TUNED_PARAMS overrides: {override}"] if override else []


def _load_one(path: Path, arch: str, family: str, env: BuildEnvironment, tuned: TunedParams) -> None:
    if not path.is_file():
        return
    try:
        data = read_file(path)
    except TuningFileError as exc:
        tuned.notes.append(f"{exc}; using the safe defaults")
        return
    if data.get("arch") != arch or data.get("family") != family:
        tuned.notes.append(f"{path}: is for {data.get('family')} {data.get('arch')}; using the safe defaults")
        return
    measured, model = data.get("ops", {}), data.get("model_ops", {})
    for op in sorted(set(measured) | set(model)):
        why = mismatch(data, op, env) if op in measured else ""
        if op in measured and not why:   # a measurement always wins
            variants = tuple(Variant(v["bucket"], v["from_work"], v["params"]) for v in measured[op].get("variants", []))
            tuned.set(arch, family, op, measured[op]["params"], MEASURED, variants)
            continue
        model_why = mismatch(data, op, env, "model_ops") if op in model else ""
        if op in model and not model_why:
            tuned.set(arch, family, op, model[op]["params"], MODEL)
            if why:
                tuned.notes.append(f"{path}: {op}: measured entry not used ({why}); using the model-tuned one")
            continue
        reasons = "; ".join(r for r in (why, f"model-tuned entry: {model_why}" if model_why else "") if r)
        tuned.notes.append(f"{path}: {op}: {reasons}; using the safe defaults")


OVERRIDE_FORMAT = "format: family:op:name=value,name=value;..."


def parse_override(text: str) -> dict[tuple[str, Op], dict[str, int]]:
    """``family:op:name=value,name=value;...`` -> {(family, op): params}; a bad item raises
    ``TuningFileError`` naming the variable, the item and what is wrong with it."""
    if text.strip().startswith("{") or text.strip().endswith(".json"):
        raise TuningFileError(f"KVGEN_TUNED_PARAMS {text.strip()!r}: an override string, not JSON or a file "
                              f"({OVERRIDE_FORMAT}); tuned files go in tuning/<arch>/<family>.json")
    out: dict[tuple[str, Op], dict[str, int]] = {}
    for item in filter(None, (part.strip() for part in text.split(";"))):
        try:
            family, op, params = _override_item(item)
        except ValueError as exc:
            raise TuningFileError(f"KVGEN_TUNED_PARAMS item {item!r}: {exc} ({OVERRIDE_FORMAT})") from None
        out[(family, op)] = params
    return out


def _override_item(item: str) -> tuple[str, Op, dict[str, int]]:
    parts = [part.strip() for part in item.split(":", 2)]
    if len(parts) != 3 or not all(parts):
        raise ValueError("expected family:op:assignments")
    family, op, assignments = parts
    if op not in TUNABLES:
        raise ValueError(f"unknown op {op!r}; ops: {', '.join(TUNABLES)}")
    params = {}
    for assignment in assignments.split(","):
        name, eq, value = (piece.strip() for piece in assignment.partition("="))
        if not eq or not name or "=" in value:
            raise ValueError(f"{assignment.strip()!r} is not name=value")
        try:
            params[name] = int(value)
        except ValueError:
            raise ValueError(f"{name}={value!r} is not an integer") from None
    check_params(op, params)  # type: ignore[arg-type]
    return family, op, params  # type: ignore[return-value]
