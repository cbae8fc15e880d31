"""What ``kvgen calibrate`` needs of a Hugging Face model, checked against the family spec.

It reads the module tree, not a list of model classes, so any Llama/Qwen3-style decoder fits:

- attention modules: the modules with a ``q_proj`` child, in module order, one per decoder layer;
- where pre-RoPE queries appear (``QuerySite``): the output of the attention's ``q_norm`` if it has
  one (Qwen3, OLMo2 and Gemma normalize queries before RoPE), else the output of ``q_proj``
  (Llama, Mistral, GLM). Either reshapes to ``[tokens, Hq, head_dim]``: HF splits heads with
  ``view(..., -1, head_dim)``;
- the RoPE: the module holding an ``inv_freq`` buffer (HF's ``*RotaryEmbedding``, whose
  ``attention_scaling`` multiplies cos and sin) and the ``apply_rotary_pos_emb`` function of the
  attention's modeling module. A probe runs that function on random rows and compares it with
  ``kvgen.reference.triattention.apply_rope`` under the spec's geometry: pairing (half or
  interleaved), rotated span (partial rotary, leading or trailing), omega and the attention factor
  all have to agree, so statistics are never split into the wrong pairs.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import Any

import torch

from kvgen.reference.triattention import TriGeometry, apply_rope, split_pairs

PROBE_POSITIONS = 64   # positions 0..63: angles small enough for float32 cos/sin to be exact to ~1e-5
PROBE_ATOL = 1e-4
OMEGA_RTOL = 1e-5      # the tolerance load_calibration checks a stored omega with


class CalibrateError(ValueError):
    """A model, text or spec ``kvgen calibrate`` cannot calibrate from; the message says which and why."""


@dataclass(frozen=True)
class QuerySite:
    """The module of decoder ``layer`` whose output holds that layer's pre-RoPE queries."""

    layer: int
    kind: str                # "q_norm" or "q_proj"
    module: torch.nn.Module


def text_config(model: torch.nn.Module) -> Any:
    """The decoder's config (a multimodal model keeps it apart: ``get_text_config``)."""
    config = getattr(model, "config", None)
    if config is None:
        raise CalibrateError(f"{type(model).__name__} has no .config: kvgen calibrate takes a Hugging Face "
                             "transformers model")
    getter = getattr(config, "get_text_config", None)
    return getter() if callable(getter) else config


def model_label(model: torch.nn.Module) -> str:
    """How errors and metadata name an in-memory model: its checkpoint path, else its class."""
    return getattr(getattr(model, "config", None), "_name_or_path", "") or type(model).__name__


def _model_shape(config: Any) -> dict[str, tuple[int, str]]:
    """``(value, config key)`` of what the spec must agree with."""
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return {"layers": (config.num_hidden_layers, "num_hidden_layers"),
            "query heads": (heads, "num_attention_heads"),
            "KV heads": (kv_heads, "num_key_value_heads"),
            "head_dim": (head_dim, "head_dim")}


def _model_windows(config: Any) -> tuple[int | None, ...] | None:
    """Per layer: the sliding window, ``None`` for full attention; ``None`` if the config has no
    ``layer_types`` (then it is not compared)."""
    layer_types = getattr(config, "layer_types", None)
    if layer_types is None:
        return None
    window = getattr(config, "sliding_window", None)
    return tuple(window if kind == "sliding_attention" else None for kind in layer_types)


def _windows_text(windows: tuple[int | None, ...]) -> str:
    sliding = [layer for layer, window in enumerate(windows) if window is not None]
    if not sliding:
        return "none"
    return f"{sliding} (window {sorted({windows[layer] for layer in sliding})})"


def check_shape(model: torch.nn.Module, geometry: TriGeometry, family: str) -> None:
    """Layers, heads, head_dim and sliding-window layers of the model's config against the spec's;
    every mismatch in one message."""
    expected = {"layers": geometry.num_layers, "query heads": geometry.query_heads,
                "KV heads": geometry.kv_heads, "head_dim": geometry.head_dim}
    config = text_config(model)
    try:
        shape = _model_shape(config)
    except AttributeError as exc:
        raise CalibrateError(f"{model_label(model)}: its config has no {exc.name!r}; kvgen calibrate reads "
                             "Llama/Qwen3-style decoder configs") from None
    wrong = [f"{what}: model {value} (config {key}), spec {expected[what]}"
             for what, (value, key) in shape.items() if value != expected[what]]
    windows = _model_windows(config)
    if windows is not None and windows != geometry.swa_window:
        wrong.append(f"sliding-window layers: model {_windows_text(windows)} (config layer_types, sliding_window), "
                     f"spec {_windows_text(geometry.swa_window)}")
    if wrong:
        raise CalibrateError(f"{model_label(model)} is not the model family {family} describes: " + "; ".join(wrong))


def _child(module: torch.nn.Module, name: str) -> torch.nn.Module | None:
    child = getattr(module, name, None)
    return child if isinstance(child, torch.nn.Module) else None


def attention_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """``(name, module)`` of every module with a ``q_proj`` child, in module order."""
    return [(name, module) for name, module in model.named_modules() if _child(module, "q_proj") is not None]


def query_sites(model: torch.nn.Module, geometry: TriGeometry) -> list[QuerySite]:
    """One site per decoder layer (``q_norm`` if present, else ``q_proj``), in layer order."""
    found = attention_modules(model)
    if len(found) != geometry.num_layers:
        raise CalibrateError(f"{model_label(model)}: found {len(found)} attention modules with a q_proj, for "
                             f"{geometry.num_layers} layers; kvgen calibrate reads Llama/Qwen3-style attention "
                             "(q_proj, optional q_norm, apply_rotary_pos_emb)")
    sites = []
    for index, (name, attention) in enumerate(found):
        q_proj = attention.q_proj
        width = getattr(q_proj, "out_features", None)
        if width is not None and width != geometry.query_heads * geometry.head_dim:
            raise CalibrateError(f"{model_label(model)}: {name}.q_proj writes {width} features, not query heads × "
                                 f"head_dim = {geometry.query_heads} × {geometry.head_dim}")
        norm = _child(attention, "q_norm")
        kind, site = ("q_norm", norm) if norm is not None else ("q_proj", q_proj)
        sites.append(QuerySite(getattr(attention, "layer_idx", index), kind, site))
    layers = sorted(site.layer for site in sites)
    if layers != list(range(geometry.num_layers)):
        raise CalibrateError(f"{model_label(model)}: attention layer_idx values {layers} are not "
                             f"0..{geometry.num_layers - 1}")
    return sorted(sites, key=lambda site: site.layer)


# ----------------------------------------------------------------------------------------------
# RoPE
# ----------------------------------------------------------------------------------------------

def find_rotary(model: torch.nn.Module) -> torch.nn.Module:
    """The rotary embedding: modules with an ``inv_freq`` buffer (older HF keeps one per attention
    module; they must then all agree)."""
    found = [(name, module) for name, module in model.named_modules()
             if isinstance(module._buffers.get("inv_freq"), torch.Tensor)]
    if not found:
        raise CalibrateError(f"{model_label(model)}: RoPE not found: no module holds an inv_freq buffer (HF's "
                             "*RotaryEmbedding); kvgen calibrate needs the model's RoPE to check it against the spec "
                             "(per-layer-type RoPE, as Gemma 3's, is not supported)")
    first = found[0][1].inv_freq
    for name, module in found[1:]:
        if module.inv_freq.shape != first.shape or not torch.equal(module.inv_freq.cpu(), first.cpu()):
            raise CalibrateError(f"{model_label(model)}: several RoPEs ({found[0][0]}, {name}) with different "
                                 "inv_freq; TriAttention calibrates one RoPE per family")
    return found[0][1]


def _apply_function(model: torch.nn.Module, attention: torch.nn.Module) -> Any:
    module = sys.modules.get(type(attention).__module__)
    function = getattr(module, "apply_rotary_pos_emb", None)
    if not callable(function):
        raise CalibrateError(f"{model_label(model)}: RoPE not found: {type(attention).__module__} has no "
                             "apply_rotary_pos_emb; kvgen calibrate reads Llama/Qwen3-style attention")
    return function


def _check_frequencies(model: torch.nn.Module, rotary: torch.nn.Module, omega: torch.Tensor,
                       freq_scale_sq: torch.Tensor, family: str) -> None:
    inv_freq = rotary.inv_freq.detach().float().cpu()
    label = model_label(model)
    if inv_freq.shape != omega.shape:
        raise CalibrateError(f"{label}: the model rotates {2 * inv_freq.numel()} elements per head, {family} "
                             f"rotary_dim {2 * omega.numel()} (check rope.placement, rotary_dim, "
                             "partial_rotary_factor)")
    if not torch.allclose(inv_freq.double(), omega.double(), rtol=OMEGA_RTOL, atol=0):
        worst = float(((inv_freq.double() - omega.double()).abs() / omega.double()).max())
        cast = rotary.inv_freq.dtype != torch.float32
        hint = (f"; inv_freq is {str(rotary.inv_freq.dtype).replace('torch.', '')}: model.to(dtype) rounds the RoPE "
                "frequencies, build the model with from_pretrained(..., dtype=) or from_config(..., dtype=) instead"
                if cast else "")
        raise CalibrateError(f"{label}: the model's RoPE frequencies (inv_freq) disagree with {family}'s rope.theta "
                             f"and rope.scaling (largest relative difference {worst:.3g}){hint}")
    factor = float(getattr(rotary, "attention_scaling", 1.0))
    expected = math.sqrt(float(freq_scale_sq[0]))
    if not math.isclose(factor, expected, rel_tol=OMEGA_RTOL):
        raise CalibrateError(f"{label}: the model's RoPE attention scaling {factor:.6g} disagrees with {family}'s "
                             f"{expected:.6g} (rope.scaling: attention_factor, mscale, factor)")


def _expected_rotation(rows: torch.Tensor, omega: torch.Tensor, factor: float, geometry: TriGeometry) -> torch.Tensor:
    """What the spec says the model's RoPE makes of ``rows`` ``[T, D]`` at positions ``0..T-1``:
    the reference rotation, the rotated span times HF's attention factor."""
    positions = torch.arange(rows.shape[0], device=rows.device)
    out = apply_rope(rows, positions, omega.to(rows.device), geometry)
    for part in split_pairs(out, geometry):
        part.mul_(factor)
    return out


def _rotation_error(model_out: torch.Tensor, rows: torch.Tensor, omega: torch.Tensor, factor: float,
                    geometry: TriGeometry) -> float:
    return float((model_out - _expected_rotation(rows, omega, factor, geometry)).abs().max())


def _pairing_hint(model_out: torch.Tensor, rows: torch.Tensor, omega: torch.Tensor, factor: float,
                  geometry: TriGeometry) -> str:
    for pairing in ("half", "interleaved"):
        if pairing == geometry.pairing:
            continue
        other = TriGeometry(**{**geometry.to_json(), "pairing": pairing})
        if _rotation_error(model_out, rows, omega, factor, other) <= PROBE_ATOL * max(1.0, factor):
            return f"; the model pairs {pairing!r} (set rope.pairing: {pairing})"
    return " (rope.pairing, rope.placement or the rotated width)"


@torch.no_grad()
def check_rope(model: torch.nn.Module, geometry: TriGeometry, omega: torch.Tensor, freq_scale_sq: torch.Tensor,
               family: str) -> None:
    """The model's RoPE is the spec's: frequencies, attention factor, pairing and rotated span."""
    rotary = find_rotary(model)
    _check_frequencies(model, rotary, omega, freq_scale_sq, family)
    attention = attention_modules(model)[0][1]
    apply = _apply_function(model, attention)
    device = rotary.inv_freq.device
    generator = torch.Generator().manual_seed(0)
    rows = torch.randn(PROBE_POSITIONS, geometry.head_dim, generator=generator).to(device)
    positions = torch.arange(PROBE_POSITIONS, device=device)[None]
    cos, sin = rotary(rows[None], positions)                     # [1, T, rotated width], float32
    model_out, _ = apply(rows[None, None], rows[None, None], cos, sin)   # HF layout [B, H, T, D]
    model_out = model_out[0, 0].float()
    factor = float(getattr(rotary, "attention_scaling", 1.0))
    if _rotation_error(model_out, rows, omega, factor, geometry) > PROBE_ATOL * max(1.0, factor):
        raise CalibrateError(f"{model_label(model)}: the model's apply_rotary_pos_emb rotates queries differently "
                             f"from {family}'s rope (pairing {geometry.pairing!r}, rotated elements "
                             f"[{geometry.rotary_start}, {geometry.rotary_start + geometry.rotary_dim}))"
                             + _pairing_hint(model_out, rows, omega, factor, geometry))
