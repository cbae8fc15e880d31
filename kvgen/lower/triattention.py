"""What TriAttention needs of a family spec: the oracle's ``TriGeometry`` and ``EvictionConfig``
(TRIATTENTION.md §1, §2, §8).

One place maps spec fields to the oracle's terms, so the build (score kernel constants), the
registry manifest (the layout's ``triattention`` entry), the runtime manager and the tests agree
on them:

- ``rotary_start``: the spec's ``rope_start`` (0 for ``leading`` and ``full`` RoPE,
  ``row_dim - rotary_dim`` for ``trailing``);
- ``swa_window[layer]``: the spec's window for sliding layers, ``None`` for scored ones;
- refusals (MLA, CSA, no RoPE, an unreadable K dtype, nothing scored, not enabled): the oracle's
  ``refusal_reason``, asked with the spec's values; ``GeometryError`` names the family.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvgen.reference.triattention_family import EvictionConfig, GeometryError, TriGeometry, refusal_reason
from kvgen.spec.schema import FamilySpec

if TYPE_CHECKING:
    import torch


def _refuse(spec: FamilySpec, reason: str | None) -> None:
    if reason is not None:
        raise GeometryError(f"{spec.name}: {reason}")


def tri_geometry(spec: FamilySpec) -> TriGeometry:
    """The oracle geometry of a family (enabled or not, any hot dtype: the geometry depends on
    neither); ``GeometryError`` names what TriAttention cannot serve."""
    # Asked before building: MLA specs have no head_dim to even build a TriGeometry with.
    _refuse(spec, refusal_reason(spec.attention, rope_placement=spec.rope.placement))
    return TriGeometry(
        num_layers=spec.layers,
        query_heads=spec.query_heads,
        kv_heads=spec.kv_heads,
        head_dim=spec.row_dim,
        rotary_start=spec.rope_start,
        rotary_dim=spec.rotary_dim,
        pairing=spec.rope.pairing,
        tokens_per_block=spec.tokens_per_block,
        layout=spec.layout,
        swa_window=tuple(spec.layer_window(layer) for layer in range(spec.layers)),
        attention=spec.attention,
    )


def rope_scaling(spec: FamilySpec) -> dict[str, Any] | None:
    """The spec's RoPE scaling as the HF-style dict the oracle reads (``type`` key, no Nones)."""
    if spec.rope.scaling is None:
        return None
    return spec.rope.scaling.model_dump(exclude_none=True)


def calibration_defaults(spec: FamilySpec) -> tuple[torch.Tensor, torch.Tensor]:
    """``(omega, freq_scale_sq)``, float32 ``[F]``, from the spec's RoPE (theta, scaling): the
    defaults ``load_calibration`` checks a stored omega against (and uses for upstream files)."""
    from kvgen.reference.triattention import rope_defaults  # torch: only here (layout.to_json needs none)

    return rope_defaults(tri_geometry(spec).rotary_dim, spec.rope.theta, rope_scaling(spec))


def _scored_layer_count(spec: FamilySpec) -> int:
    return sum(spec.layer_window(layer) is None for layer in range(spec.layers))


def eviction_refusal(spec: FamilySpec) -> str | None:
    """Why TriAttention cannot run for this family (refused, or not enabled), or ``None``."""
    return refusal_reason(spec.attention, rope_placement=spec.rope.placement,
                          scored_layers=_scored_layer_count(spec), enabled=spec.triattention.enabled,
                          dtype=spec.dtype)


def require_scorable(spec: FamilySpec) -> TriGeometry:
    """The geometry of a family the score kernel serves, or ``GeometryError`` saying why not."""
    _refuse(spec, eviction_refusal(spec))
    return tri_geometry(spec)


def eviction_config(spec: FamilySpec) -> EvictionConfig:
    """The family's ``EvictionConfig`` (what the manifest ships and the manager is built from);
    ``GeometryError`` if TriAttention cannot run for it."""
    tri = spec.triattention
    return EvictionConfig(family=spec.name, geometry=require_scorable(spec), dtype=spec.dtype, budget=tri.budget,
                          beta=tri.beta, eviction_mode=tri.eviction_mode, rope_theta=spec.rope.theta,
                          rope_scaling=rope_scaling(spec))
