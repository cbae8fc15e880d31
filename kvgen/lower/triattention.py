"""What TriAttention needs of a family spec: the oracle's ``TriGeometry`` and the RoPE defaults of
its calibration (TRIATTENTION.md §1, §2, §8).

One place maps spec fields to the oracle's terms, so the build (score kernel constants), the
runtime manager and the tests agree on them:

- ``rotary_start``: 0 for ``leading`` and ``full`` RoPE, ``row_dim - rotary_dim`` for ``trailing``;
- ``swa_window[layer]``: the spec's window for sliding layers, ``None`` for scored ones;
- ``attention``: passed through, so MLA/CSA are refused by ``TriGeometry`` with its message.
"""

from __future__ import annotations

from typing import Any

import torch

from kvgen.reference.triattention import GeometryError, TriGeometry, rope_freq_scale_sq, rope_omega
from kvgen.spec.schema import FamilySpec

SCORED_DTYPES = ("bf16", "fp16")


def tri_geometry(spec: FamilySpec) -> TriGeometry:
    """The oracle geometry of a family; ``GeometryError`` names what TriAttention cannot serve."""
    if spec.attention in ("mla", "csa"):
        # TriGeometry refuses these too, but MLA specs have no head_dim to even build one.
        raise GeometryError(f"{spec.name}: TriAttention cannot serve attention: {spec.attention} "
                            f"(one shared latent per token, no KV-head semantics)")
    if spec.rope.placement == "none":
        raise GeometryError(f"{spec.name}: TriAttention scores RoPE frequencies; this family has no RoPE")
    rotary_dim = spec.rotary_dim
    rotary_start = spec.row_dim - rotary_dim if spec.rope.placement == "trailing" else 0
    return TriGeometry(
        num_layers=spec.layers,
        query_heads=spec.query_heads,
        kv_heads=spec.kv_heads,
        head_dim=spec.row_dim,
        rotary_start=rotary_start,
        rotary_dim=rotary_dim,
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
    geometry = tri_geometry(spec)
    scaling = rope_scaling(spec)
    omega = rope_omega(geometry.rotary_dim, spec.rope.theta, scaling)
    return omega, rope_freq_scale_sq(geometry.rotary_dim, scaling)


def require_scorable(spec: FamilySpec) -> TriGeometry:
    """The geometry of a family the score kernel serves, or ``GeometryError`` saying why not."""
    geometry = tri_geometry(spec)
    if not spec.triattention.enabled:
        raise GeometryError(f"{spec.name}: triattention.enabled is false; nothing to score")
    if spec.dtype not in SCORED_DTYPES:
        raise GeometryError(f"{spec.name}: the score kernel reads {' or '.join(SCORED_DTYPES)} K, not "
                            f"{spec.dtype} (fp8 K scoring is out of scope; the spec refuses it too)")
    return geometry
