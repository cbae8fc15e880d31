"""What one compile is: a ``BuildJob`` (one artifact of one family for one arch, any backend) and
its ``BuildOutcome``. ``kvgen build`` and the tuner both make jobs here and compile them with
``kvgen.build.compile.compile_one`` / ``compile_many``.

A family's plans split by backend: ``codec`` and ``compact`` compile together into the nvcc
library ``lib<symbol>.so``; ``score`` is the CuTe DSL library ``lib<symbol>_score.so``; ``pack``
and ``select`` are Triton kernels compiled ahead of time into ``lib<symbol>_pack.so`` and
``lib<symbol>_select.so``. The artifact names are decided here and recorded in the manifest:
nothing downstream derives them.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Mapping

from kvgen.lower.plan import KernelPlan, Op, plans_for
from kvgen.lower.tuned import Variant
from kvgen.render.source import TEMPLATES_DIR, output_name, render
from kvgen.spec.schema import FamilySpec, c_identifier, load_spec

# "triton-aot": Triton kernels compiled at build time behind a C shim (kvgen.build.triton_aot).
Backend = Literal["nvcc", "cute", "triton-aot"]
BACKENDS: tuple[Backend, ...] = ("nvcc", "cute", "triton-aot")
OP_BACKEND: dict[Op, Backend] = {"codec": "nvcc", "compact": "nvcc", "score": "cute", "pack": "triton-aot",
                                 "select": "triton-aot"}
# Keyed by op: ops of one backend with the same suffix share one artifact (codec + compact).
ARTIFACT_SUFFIX: dict[Op, str] = {"codec": ".so", "compact": ".so", "score": "_score.so", "pack": "_pack.so",
                                  "select": "_select.so"}
Status = Literal["hit", "built", "failed", "skipped"]


@dataclass(frozen=True)
class SpecSource:
    """A parsed spec with the sha256 of its file text (the manifest records which spec built it)."""

    spec: FamilySpec
    sha256: str
    path: Path | None = None


def load_spec_source(path: Path) -> SpecSource:
    path = Path(path)
    spec = load_spec(path)
    return SpecSource(spec, hashlib.sha256(path.read_bytes()).hexdigest(), path)


@dataclass(frozen=True)
class BuildJob:
    """One artifact to make: the plans it serves (all of one backend) and their rendered texts."""

    source: SpecSource
    arch: str
    backend: Backend
    plans: tuple[KernelPlan, ...]
    rendered: Mapping[str, str]           # "<family>/<name>" -> text
    variant: Variant | None = None        # the first size-dispatched variant its one plan serves (its name)

    @property
    def family(self) -> str:
        return self.source.spec.name

    @property
    def symbol(self) -> str:
        return self.plans[0].symbol()

    @property
    def ops(self) -> tuple[Op, ...]:
        return tuple(plan.op for plan in self.plans)

    def entry_meta(self) -> dict[str, str]:
        """What every cache entry's metadata says of its job (the backend adds its own facts)."""
        return {"artifact": self.artifact, "family": self.family, "arch": self.arch, "backend": self.backend}

    @property
    def artifact(self) -> str:
        """The artifact's file name, in the cache entry and in ``<registry>/<arch>/``."""
        op = self.plans[0].op
        stem, ext = ARTIFACT_SUFFIX[op].rsplit(".", 1)
        if self.variant:   # one op alone, named for it and its bucket: lib<symbol>_<op>_<bucket>
            return f"lib{self.symbol}_{op}_{c_identifier(self.variant.bucket)}.{ext}"
        return f"lib{self.symbol}{stem}.{ext}"


@dataclass(frozen=True)
class BuildOutcome:
    family: str
    arch: str
    backend: Backend | None               # None: skipped before a job was made
    status: Status
    seconds: float = 0.0
    artifact: Path | None = None          # the cache entry's file; the registry copy once published
    key: str = ""
    error: str = ""
    sha256: str = ""
    toolchain: Mapping[str, str] = field(default_factory=dict)   # versions recorded in the manifest

    @property
    def ok(self) -> bool:
        return self.status in ("hit", "built")


def family_jobs(source: SpecSource, arch: str, params: Mapping[Op, Mapping[str, int]] | None = None,
                templates_dir: Path = TEMPLATES_DIR,
                variants: Mapping[Op, tuple[Variant, ...]] | None = None) -> list[BuildJob]:
    """One job per artifact the family needs for ``arch`` (ops of one backend and suffix share
    one), ``params`` (tuned, per op) over the safe defaults, each job's plans rendered for exactly
    those parameters; then one job per distinct plan of the size-dispatched variants that is not
    already the op's (a variant compiling to a plan built before is served by that artifact)."""
    plans = plans_for(source.spec, params)
    by_artifact: dict[tuple[Backend, str], list[KernelPlan]] = {}
    for plan in plans:
        by_artifact.setdefault((OP_BACKEND[plan.op], ARTIFACT_SUFFIX[plan.op]), []).append(plan)
    jobs = [BuildJob(source, arch, backend, tuple(group), render_plans(group, templates_dir))
            for (backend, _), group in by_artifact.items()]
    built = {plan.key() for plan in plans}
    for op, op_variants in (variants or {}).items():
        for variant in op_variants:
            plan = variant_plan(source.spec, params, op, variant)
            if plan.key() not in built:
                built.add(plan.key())
                jobs.append(BuildJob(source, arch, OP_BACKEND[op], (plan,), render_plans([plan], templates_dir),
                                     variant))
    return jobs


def variant_plan(spec: FamilySpec, params: Mapping[Op, Mapping[str, int]] | None, op: Op,
                 variant: Variant) -> KernelPlan:
    """The plan of ``op`` compiled for ``variant`` (the other ops' parameters as ``params``)."""
    (plan,) = [p for p in plans_for(spec, {**(params or {}), op: variant.params}) if p.op == op]
    return plan


def render_plans(plans: list[KernelPlan], templates_dir: Path = TEMPLATES_DIR) -> dict[str, str]:
    return {f"{plan.family}/{output_name(plan.template)}": render(plan, templates_dir) for plan in plans}
