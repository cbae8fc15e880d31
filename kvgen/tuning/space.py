"""What the tuner searches: per op, the declared tunables (``kvgen.lower.plan.TUNABLES``), the
configurations that compile to the same kernel folded onto one, and the size buckets it tunes for.

Canonical configurations: the score kernel clamps ``lanes`` to what divides the chunks of a row and
splits a query group into ``ceil(group / max_heads)`` passes, so e.g. ``max_heads`` 8 and 16 are the
same kernel for a group of 4. Measuring both would waste GPU time and, worse, let a noisy duplicate
win; every candidate is keyed by its canonical configuration (Kernel Tuner's "restrictions").
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any, Mapping

from kvgen.kernels.cute.geometry import (
    MMA_SHARED_BUDGET,
    bulk_ring_fits,
    effective_lanes,
    mma_coefficient_words,
    mma_form_fits,
    mma_magnitude_fits,
    mma_ring_bytes,
    row_chunks,
    vector_width,
)
from kvgen.lower.layout import family_layout
from kvgen.lower.plan import (
    TUNABLES,
    Op,
    default_params,
    f32_literal,
    fold_codec_params,
    fold_compact_params,
    fold_select_params,
    score_geometry,
)
from kvgen.lower.tuned import CHOICE_MARGIN
from kvgen.spec.schema import FamilySpec

TUNED_OPS: tuple[Op, ...] = ("codec", "compact", "score", "select")


@dataclass(frozen=True)
class Bucket:
    """One problem size an op is tuned for; ``size`` is read by the op's measurement."""

    name: str
    size: Mapping[str, int | str]
    why: str


# The samplers a study may use (kvgen.tuning.study); here, so the argument parser can name them without optuna.
STRATEGIES = ("tpe", "random", "grid")

# Buckets per op. The build compiles one configuration per (family, op, arch), the one with the best
# geometric-mean speed-up over these buckets (kvgen.lower.tuned.build_choice), plus, for an op that
# owns its artifact, a library per size range where a bucket's own best beats it (dispatch_variants).
BUCKETS: dict[Op, tuple[Bucket, ...]] = {
    "codec": (
        Bucket("small", {"hot_mib": 8, "cold": "device"}, "one returning request: few pages, latency-bound"),
        Bucket("large", {"hot_mib": 1024, "cold": "device"}, "bulk offload into device staging: throughput"),
        Bucket("offload", {"hot_mib": 1024, "cold": "pinned"}, "bulk offload straight into pinned host memory"),
    ),
    "compact": (
        Bucket("b1", {"batch": 1, "decode": 4096, "budget": 2048}, "one long-decode request compacted"),
        Bucket("b32", {"batch": 32, "decode": 4096, "budget": 2048}, "a full decode batch due at once"),
    ),
    "score": (
        Bucket("b1", {"batch": 1, "width": 4096}, "one request due"),
        Bucket("b32", {"batch": 32, "width": 4096}, "a full decode batch due at once"),
        # kvgen bench's width (its goals are stated there): 4x the tokens per (layer, head) row, so
        # more stages per CTA pay (qwen3-8b form 1: token_tiles 8 at 4096, 16 at 16384, callC/callE
        # of results/2026-12-04-h200-s10)
        Bucket("b32-wide", {"batch": 32, "width": 16384}, "a full batch of long decodes (the bench's width)"),
    ),
    # normalize + aggregate (union) + select of a round, at the bench's width and budget
    "select": (
        Bucket("b1", {"batch": 1, "width": 16384, "budget": 2048}, "one request due: one selection program"),
        Bucket("b32", {"batch": 32, "width": 16384, "budget": 2048}, "a full decode batch due at once"),
    ),
}


def ops_for(spec: FamilySpec) -> tuple[Op, ...]:
    """The tuned ops a family has (TriAttention ops only where the spec enables it)."""
    return TUNED_OPS if spec.triattention.enabled else ("codec",)


def lut_decode_buffers(spec: FamilySpec) -> bool:
    """Whether some quantized buffer can take decode_route 1 (codec_kernels.cuh kLutDecode), the
    only route with half blocks (decode_split 2): a 16-bit hot dtype and a compiled Q of 1. A
    per-layer buffer (Q known at run time) or another Q keeps the binary32 route, whole blocks."""
    if spec.elem_bytes != 2:
        return False
    one = f32_literal(1.0)
    return any(b.Q is not None and f32_literal(b.Q) == one for b in family_layout(spec).record.buffers)


def canonical(op: Op, params: Mapping[str, int], spec: FamilySpec) -> dict[str, int]:
    """The representative of ``params``' equivalence class (same generated kernel)."""
    out = dict(params)
    if op == "score":
        g = score_geometry(spec)
        group = g["query_heads"] // g["kv_heads"]
        passes = math.ceil(group / out["max_heads"])
        # the smallest declared max_heads giving the same passes (so the same heads per pass)
        out["max_heads"] = min(m for m in TUNABLES["score"]["max_heads"][0] if math.ceil(group / m) == passes)
        out = fold_score_form(out, spec, g, heads=math.ceil(group / passes))
        if out["form"] == 1:                 # form 0's parameters at their defaults (unread)
            out.update({name: SCORE_DEFAULTS[name] for name in FORM0_PARAMS})
        else:
            out = fold_cuda_core_score(out, spec, g)
    if op == "compact":
        out = fold_compact_params(spec, out)
    if op == "codec" and out["decode_split"] != 1 and (out["decode_route"] == 0 or not lut_decode_buffers(spec)):
        out["decode_split"] = 1  # half blocks exist only on the Lut route of 16-bit hot dtypes
    if op == "codec":
        out = fold_codec_params(spec, out)  # the packed fp16 route (rounding 3) needs an fp8 Q = 1 buffer
    if op == "select":
        out = fold_select_params(out, spec.query_heads)
    return out


def fold_cuda_core_score(params: dict[str, int], spec: FamilySpec, g: Mapping) -> dict[str, int]:
    """Form 0's equivalences: lanes that divide the row's chunks, and the rings that replace the
    register prefetch (or cannot hold the row)."""
    out = dict(params)
    chunks = row_chunks(g["rotary_start"], g["rotary_dim"], g["pairing"], spec.elem_bytes)
    out["lanes"] = effective_lanes(out["lanes"], chunks)
    if out.get("smem_stages", 0) > 0:   # the shared-memory ring replaces the register prefetch
        out["prefetch"] = 0
    vec = vector_width(g["rotary_start"], g["rotary_dim"], g["pairing"], spec.elem_bytes)
    if out.get("bulk_stages", 0) > 0 and not bulk_ring_fits(vec, spec.elem_bytes, out["lanes"],
                                                            out["tokens_per_thread"]):
        out["bulk_stages"] = 0           # the bulk ring needs one token per thread, 16-byte pieces
    if out.get("bulk_stages", 0) > 0:   # it replaces the cp.async ring and the register prefetch
        out["prefetch"] = out["smem_stages"] = 0
    if spec.dtype != "bf16":             # shift / mask widening is bf16's only
        out["unpack"] = 0
    return out


# Score parameters only form 0 reads; form 1 reads mma_tiles and takes bulk_stages as its ring depth.
FORM0_PARAMS = ("lanes", "tokens_per_thread", "prefetch", "smem_stages", "unpack")
MMA_PARAMS = ("mma_tiles", "mag_mma")
SCORE_DEFAULTS = default_params("score")
MMA_DEFAULT_STAGES = 3


def fold_score_form(params: dict[str, int], spec: FamilySpec, g: Mapping, heads: int) -> dict[str, int]:
    """Form 1 where it serves the family (else form 0), its ring depth at least 2 stages and its
    shared memory within budget (fewer MMA tiles, then fewer stages, then fewer warps: the largest
    shape that fits, with ``heads`` query heads a pass); form 0 with form 1's parameters at their
    defaults (unread)."""
    out = {**{name: SCORE_DEFAULTS[name] for name in ("form", *MMA_PARAMS)}, **params}
    if out["form"] == 1 and not mma_form_fits(spec.dtype, g["rotary_start"], g["rotary_dim"], g["pairing"]):
        out["form"] = 0
    if not mma_magnitude_fits(g["rotary_dim"]):
        out["mag_mma"] = 0
    if out["form"] == 0:
        out.update({name: SCORE_DEFAULTS[name] for name in MMA_PARAMS})
        return out
    if out["bulk_stages"] == 0:
        out["bulk_stages"] = MMA_DEFAULT_STAGES
    span = g["rotary_dim"] * spec.elem_bytes
    coefficients = 4 * sum(mma_coefficient_words(heads, g["rotary_dim"], out["mag_mma"]))
    while (mma_ring_bytes(out["threads"] // 32, out["bulk_stages"], 16 * out["mma_tiles"], span) + coefficients
           > MMA_SHARED_BUDGET):
        if out["mma_tiles"] > 1:
            out["mma_tiles"] //= 2
        elif out["bulk_stages"] > 2:
            out["bulk_stages"] -= 1
        elif out["threads"] > min(TUNABLES["score"]["threads"][0]):
            out["threads"] //= 2
        else:
            break
    return out


def configurations(op: Op, spec: FamilySpec, fixed: Mapping[str, int] | None = None) -> list[dict[str, int]]:
    """Every distinct (canonical) configuration of the op's space, the safe default first.
    ``fixed`` (``--fix``) restricts it to a ``subspace``, which still starts with the default: the
    baseline every measured speed-up is against."""
    default = canonical(op, default_params(op), spec)
    return _distinct([default, *subspace(op, spec, fixed)])


def subspace(op: Op, spec: FamilySpec, fixed: Mapping[str, int] | None = None) -> list[dict[str, int]]:
    """The distinct configurations with the ``fixed`` parameters at their values (fixed before
    folding: ``rounding=4`` is route 3 on an fp8 family)."""
    names = list(TUNABLES[op])
    return _distinct([canonical(op, dict(zip(names, values)), spec)
                      for values in itertools.product(*(searched_choices(op, n, fixed) for n in names))])


def _distinct(configs: list[dict[str, int]]) -> list[dict[str, int]]:
    seen: dict[tuple, dict[str, int]] = {}
    for config in configs:
        seen.setdefault(tuple(sorted(config.items())), config)
    return list(seen.values())


def searched_choices(op: Op, name: str, fixed: Mapping[str, int] | None) -> tuple[int, ...]:
    """The values of one parameter a search visits: its declared choices, or its fixed value."""
    return (fixed[name],) if fixed and name in fixed else TUNABLES[op][name][0]


def fixed_for(op: Op, fixed: Mapping[str, int]) -> dict[str, int]:
    """The part of a ``--fix`` that names this op's parameters (one --fix serves several ops)."""
    return {k: v for k, v in fixed.items() if k in TUNABLES[op]}


def check_fixed(ops: tuple[Op, ...] | list[Op], fixed: Mapping[str, int]) -> None:
    """A ``--fix`` must name parameters of the tuned ops, at declared values."""
    for name, value in fixed.items():
        owners = [op for op in ops if name in TUNABLES[op]]
        if not owners:
            accepted = sorted({n for op in ops for n in TUNABLES[op]})
            raise ValueError(f"--fix {name}={value}: no parameter {name!r} in {', '.join(ops)} "
                             f"(accepted: {', '.join(accepted)})")
        for op in owners:
            if value not in TUNABLES[op][name][0]:
                raise ValueError(f"--fix {name}={value}: {op} accepts {name} in {TUNABLES[op][name][0]}")


def config_id(op: Op, params: Mapping[str, int]) -> str:
    """Stable, readable name of a configuration: ``threads=256,in_flight=4`` in TUNABLES order."""
    return ",".join(f"{name}={params[name]}" for name in TUNABLES[op])


def parse_config(config: str) -> dict[str, int]:
    """Inverse of ``config_id``."""
    return {k: int(v) for k, v in (item.split("=") for item in config.split(","))}


def dispatch_variants(per_bucket: Mapping[str, Mapping[str, float]], choice: str, work: Mapping[str, int],
                      spread: Mapping[str, Mapping[str, float]] | None = None,
                      margin: float = CHOICE_MARGIN) -> list[dict[str, Any]]:
    """Size ranges served by another config than ``choice``: [{"bucket", "from_work", "config"}],
    ascending (``work``: each bucket's work, ``kvgen.artifacts.dispatch.bucket_work``).

    A bucket keeps the config serving the bucket below it (the smallest: ``choice``) while that config
    is within the noise of the bucket's best (``margin``, or either measurement's p80/p20 ``spread``).
    Otherwise it takes, among the configs within the noise of its best, the one that is also within
    it in the most larger buckets (fewest libraries; ties: the fastest here). A variant starts at the
    geometric mean of its bucket's work and the work of the bucket below (the buckets are spaced by
    factors, not by steps); one naming ``choice`` again sends calls back to the main library."""
    order = sorted(per_bucket, key=lambda b: work[b])
    near = {b: _within_noise(per_bucket[b], (spread or {}).get(b, {}), margin) for b in order}
    serving, variants = choice, []
    for i, bucket in enumerate(order):
        if serving in near[bucket]:
            continue
        later = order[i + 1:]
        serving = max(sorted(near[bucket]),
                      key=lambda c: (sum(c in near[b] for b in later), -per_bucket[bucket][c]))
        start = math.isqrt(work[order[i - 1]] * work[bucket]) if i else 0
        variants.append({"bucket": bucket, "from_work": start, "config": serving})
    return variants


def _within_noise(times: Mapping[str, float], ratios: Mapping[str, float], margin: float) -> set[str]:
    """The configs whose time is within the noise of the bucket's best."""
    best = min(times, key=times.get)
    return {c for c, t in times.items()
            if t <= times[best] * max(1.0 + margin, ratios.get(c, 1.0), ratios.get(best, 1.0))}
