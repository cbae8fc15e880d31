"""What TriAttention needs of a cache family, as plain data (TRIATTENTION.md §1, §2, §8).

Stated here once, for the spec validator, the lowering, the runtime and the tools alike:

- ``refusal_reason``: which families TriAttention cannot serve (MLA, CSA, no RoPE, a K dtype
  it cannot read, nothing scored, not enabled), and why;
- ``TriGeometry``: the cache geometry the oracle and the kernels compute with, and
  ``page_shape``, the shape of one page of a K (or V) pool in the HND or NHD layout;
- ``check_budget``: the budgets a round can keep;
- ``EvictionConfig``: geometry, hot dtype, default budget/beta/mode and RoPE of one family, the
  JSON the registry manifest carries so the eviction manager needs no spec.

No torch here: the spec validator asks ``refusal_reason`` without importing the torch-based
oracle. ``kvgen.reference.triattention`` re-exports every public name.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import MISSING, asdict, dataclass, fields
from typing import Any

MODES = ("union", "per_head", "per_layer_perhead")
LATENT_ATTENTION = ("mla", "csa")   # one shared latent per token: no KV heads to score
HEAD_ATTENTION = ("mha", "gqa", "mqa")
SCORED_DTYPES = ("bf16", "fp16", "fp8_e4m3")   # hot K dtypes the score kernel reads (fp8: as stored, score_keys)
LAYOUTS = ("HND", "NHD")
PAIRINGS = ("half", "interleaved")


class GeometryError(ValueError):
    """A cache geometry TriAttention cannot serve; the message names the field."""


# ----------------------------------------------------------------------------------------------
# Refusals and the page shape
# ----------------------------------------------------------------------------------------------

def refusal_reason(attention: str, *, rope_placement: str | None = None, scored_layers: int | None = None,
                   enabled: bool | None = None, dtype: str | None = None) -> str | None:
    """Why TriAttention cannot serve a family with these properties, or ``None`` (§8).

    Each caller passes the values it knows; an argument left ``None`` is not checked (a
    ``TriGeometry`` knows no dtype, the spec validator only asks for enabled families). The
    reasons are tried in this order: attention kind, RoPE, scored layers, ``enabled``, hot K
    dtype; a disabled family of an unreadable dtype therefore reads "not enabled"."""
    if attention in LATENT_ATTENTION:
        return (f"TriAttention cannot serve attention: {attention} (one shared latent per token, "
                "no KV-head semantics)")
    if rope_placement == "none":
        return "TriAttention scores RoPE frequencies; this family has no RoPE"
    if scored_layers == 0:
        return "every layer is sliding-window; nothing is scored"
    if enabled is False:
        return "triattention.enabled is false; nothing to score"
    if dtype is not None and dtype not in SCORED_DTYPES:
        return f"TriAttention scoring reads {', '.join(SCORED_DTYPES)} K, not {dtype}"
    return None


def page_shape(layout: str, kv_heads: int, tokens_per_block: int, head_dim: int) -> tuple[int, int, int]:
    """One page of a per-layer K (or V) pool: ``(Hkv, tokens_per_block, head_dim)`` in the HND
    layout, ``(tokens_per_block, Hkv, head_dim)`` in NHD; a pool is ``[num_pages, *page]``."""
    if layout == "HND":
        return kv_heads, tokens_per_block, head_dim
    if layout == "NHD":
        return tokens_per_block, kv_heads, head_dim
    raise GeometryError(f"layout {layout!r}; accepted: {', '.join(LAYOUTS)}")


# ----------------------------------------------------------------------------------------------
# Geometry
# ----------------------------------------------------------------------------------------------

def _positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise GeometryError(f"TriGeometry.{name}: expected a positive int, got {value!r}")


def _refuse(field: str, reason: str | None) -> None:
    if reason is not None:
        raise GeometryError(f"TriGeometry.{field}: {reason}")


def _fields_of(cls: type, data: Mapping[str, Any], source: str) -> dict[str, Any]:
    """``data`` as the constructor arguments of dataclass ``cls``: every required field present,
    nothing unknown (a stale or hand-edited manifest fails here, naming ``source`` and the key)."""
    if not isinstance(data, Mapping):
        raise ValueError(f"{source}: expected a JSON object, got {type(data).__name__}")
    names = [f.name for f in fields(cls)]
    unknown = sorted(set(data) - set(names))
    if unknown:
        raise ValueError(f"{source}: unknown key {unknown[0]!r}; accepted: {', '.join(names)}")
    missing = [f.name for f in fields(cls)
               if f.default is MISSING and f.default_factory is MISSING and f.name not in data]
    if missing:
        raise ValueError(f"{source}: missing key {missing[0]!r}")
    return dict(data)


@dataclass(frozen=True)
class TriGeometry:
    """What the oracle needs of a family spec. MLA and CSA (one shared latent per token, no KV
    heads) cannot be stated: ``attention="mla"`` is refused, and a latent has no per-head rows."""

    num_layers: int          # scored + SWA layers of the cache
    query_heads: int         # Hq
    kv_heads: int            # Hkv (Hq % Hkv == 0)
    head_dim: int
    rotary_start: int        # first rotated element inside the K row
    rotary_dim: int          # rotated width R (even); F = R // 2
    pairing: str             # "half" (f with f+F) | "interleaved" (2f with 2f+1); see split_pairs
    tokens_per_block: int
    layout: str              # "HND" | "NHD"; see page_shape
    swa_window: tuple[int | None, ...]  # per layer: None = full attention (scored), int = window
    attention: str = "gqa"   # the spec's attention kind; mla and csa are refused (§8)

    def __post_init__(self) -> None:
        self._check_attention()
        for name in ("num_layers", "query_heads", "kv_heads", "head_dim", "rotary_dim", "tokens_per_block"):
            _positive_int(name, getattr(self, name))
        if self.query_heads % self.kv_heads:
            raise GeometryError(f"TriGeometry.query_heads: {self.query_heads} is not a multiple of "
                                f"kv_heads {self.kv_heads}")
        if self.rotary_dim % 2:
            raise GeometryError(f"TriGeometry.rotary_dim: {self.rotary_dim} is odd; pairs need an even width")
        if isinstance(self.rotary_start, bool) or not isinstance(self.rotary_start, int) or self.rotary_start < 0:
            raise GeometryError(f"TriGeometry.rotary_start: expected an int >= 0, got {self.rotary_start!r}")
        if self.rotary_start + self.rotary_dim > self.head_dim:
            raise GeometryError(f"TriGeometry.rotary_dim: span [{self.rotary_start}, "
                                f"{self.rotary_start + self.rotary_dim}) exceeds head_dim {self.head_dim}")
        if self.pairing not in PAIRINGS:
            raise GeometryError(f"TriGeometry.pairing: {self.pairing!r}; accepted: {', '.join(PAIRINGS)}")
        if self.layout not in LAYOUTS:
            raise GeometryError(f"TriGeometry.layout: {self.layout!r}; accepted: {', '.join(LAYOUTS)}")
        object.__setattr__(self, "swa_window", tuple(self.swa_window))  # hashable even if a list came
        if len(self.swa_window) != self.num_layers:
            raise GeometryError(f"TriGeometry.swa_window: {len(self.swa_window)} entries for "
                                f"{self.num_layers} layers")
        for layer, window in enumerate(self.swa_window):
            if window is not None:
                _positive_int(f"swa_window[{layer}]", window)
        _refuse("swa_window", refusal_reason(self.attention, scored_layers=len(self.scored_layers)))

    def _check_attention(self) -> None:
        _refuse("attention", refusal_reason(self.attention))
        if self.attention not in HEAD_ATTENTION:
            raise GeometryError(f"TriGeometry.attention: {self.attention!r}; accepted: {', '.join(HEAD_ATTENTION)}")
        if self.attention == "mqa" and self.kv_heads != 1:
            raise GeometryError(f"TriGeometry.kv_heads: attention mqa has one KV head, got {self.kv_heads}")
        if self.attention == "mha" and self.kv_heads != self.query_heads:
            raise GeometryError(f"TriGeometry.kv_heads: attention mha needs kv_heads == query_heads "
                                f"({self.query_heads}), got {self.kv_heads}")

    @property
    def freqs(self) -> int:
        return self.rotary_dim // 2

    @property
    def group(self) -> int:
        """Query heads per KV head; query head h reads KV head h // group."""
        return self.query_heads // self.kv_heads

    @property
    def scored_layers(self) -> tuple[int, ...]:
        return tuple(layer for layer, window in enumerate(self.swa_window) if window is None)

    @property
    def page_shape(self) -> tuple[int, int, int]:
        """One page of a K (or V) pool of this geometry (``page_shape``)."""
        return page_shape(self.layout, self.kv_heads, self.tokens_per_block, self.head_dim)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["swa_window"] = list(self.swa_window)
        return data

    @classmethod
    def from_json(cls, data: Mapping[str, Any], source: str = "geometry") -> TriGeometry:
        """The inverse of ``to_json``; errors name ``source`` and the key."""
        return cls(**_fields_of(cls, data, source))


def check_budget(budget: int, geometry: TriGeometry) -> None:
    """A budget a round can keep: a positive int, and at least every sliding window (SWA layers
    keep their whole window, §6)."""
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise ValueError(f"budget {budget!r}: expected a positive int")
    for layer, window in enumerate(geometry.swa_window):
        if window is not None and budget < window:
            raise ValueError(f"layer {layer}: budget {budget} < sliding window {window}; "
                             f"SWA layers keep their whole window, so budget >= W is required")


# ----------------------------------------------------------------------------------------------
# What eviction needs of a family (the registry manifest carries it)
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class EvictionConfig:
    """Everything TriAttention needs of a family, without the spec: the geometry, the hot K dtype,
    the default ``budget``/``beta``/``eviction_mode``, and the RoPE (``rope_theta`` and the
    HF-style ``rope_scaling`` dict) that gives the calibration's default ``omega`` and
    ``freq_scale_sq`` (``rope_defaults(geometry.rotary_dim, rope_theta, rope_scaling)``).

    ``kvgen.lower.triattention.eviction_config(spec)`` makes it; the family layout's
    ``triattention`` entry in the registry manifest is its ``to_json()``, so the eviction manager
    runs from what ships. Construction refuses what TriAttention cannot serve (``refusal_reason``),
    an unknown mode and a budget ``check_budget`` rejects; ``dataclasses.replace`` re-checks."""

    family: str
    geometry: TriGeometry
    dtype: str               # hot K dtype, one of SCORED_DTYPES
    budget: int
    beta: int
    eviction_mode: str
    rope_theta: float
    rope_scaling: Mapping[str, Any] | None = None   # treat as read-only; None: plain RoPE

    def __post_init__(self) -> None:
        if not isinstance(self.family, str) or not self.family:
            raise ValueError(f"EvictionConfig.family: expected a family name, got {self.family!r}")
        if not isinstance(self.geometry, TriGeometry):
            raise ValueError(f"{self.family}: geometry must be a TriGeometry, got {type(self.geometry).__name__}")
        reason = refusal_reason(self.geometry.attention, dtype=self.dtype)
        if reason is not None:
            raise GeometryError(f"{self.family}: {reason}")
        if self.eviction_mode not in MODES:
            raise ValueError(f"{self.family}: eviction_mode {self.eviction_mode!r}; accepted: {', '.join(MODES)}")
        check_budget(self.budget, self.geometry)
        if isinstance(self.beta, bool) or not isinstance(self.beta, int) or self.beta < 1:
            raise ValueError(f"{self.family}: beta {self.beta!r}: expected a positive int")
        theta = self.rope_theta
        if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not (theta > 0 and math.isfinite(theta)):
            raise ValueError(f"{self.family}: rope_theta {theta!r}: expected a positive number")
        if self.rope_scaling is not None:
            object.__setattr__(self, "rope_scaling", dict(self.rope_scaling))  # a copy: the caller's stays theirs

    def to_json(self) -> dict[str, Any]:
        data = {f.name: getattr(self, f.name) for f in fields(self)}
        data["geometry"] = self.geometry.to_json()
        data["rope_scaling"] = None if self.rope_scaling is None else dict(self.rope_scaling)
        return data

    @classmethod
    def from_json(cls, data: Mapping[str, Any], source: str = "triattention") -> EvictionConfig:
        """The inverse of ``to_json``; errors name ``source`` (e.g. the manifest) and the key."""
        values = _fields_of(cls, data, source)
        values["geometry"] = TriGeometry.from_json(values["geometry"], f"{source}.geometry")
        return cls(**values)
