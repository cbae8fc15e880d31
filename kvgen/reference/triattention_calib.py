"""Reference RoPE frequencies and TriAttention calibration (TRIATTENTION.md §1).

Split out of ``triattention.py`` to keep both modules short; ``triattention.py`` re-exports every
public name here. This module only needs a few attributes of ``TriGeometry`` (``num_layers``,
``query_heads``, ``rotary_dim``), so it does not import it at run time.

Conventions (shared with the scorer):
- Frequency ``f`` of a head is the complex number ``x_a + i·x_b`` of its pair ``(a, b)`` of
  rotated elements (the pair rule: ``triattention.split_pairs``).
- RoPE turns that number into ``(x_a + i·x_b)·e^{i·p·omega_f}`` at position ``p``.
- Calibration is indexed by **cache layer** (the same index as the K/V pools, SWA layers
  included); rows of SWA layers are never read.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from kvgen.reference.triattention_family import TriGeometry

ROPE_SCALING_TYPES = ("default", "linear", "llama3", "yarn", "longrope")


# ----------------------------------------------------------------------------------------------
# RoPE angular frequencies, as HuggingFace transformers computes them (float32, like the model).
# ----------------------------------------------------------------------------------------------

def _opt(scaling: Mapping[str, Any], key: str, default: Any = None) -> Any:
    """A scaling field; ``None`` counts as absent (pydantic ``model_dump`` writes ``None``)."""
    value = scaling.get(key)
    if value is None:
        return default
    return value


def _need(scaling: Mapping[str, Any], key: str, kind: str) -> Any:
    value = _opt(scaling, key)
    if value is None:
        raise ValueError(f"RoPE scaling {kind!r} needs {key!r}; got keys {sorted(scaling)}")
    return value


def _scaling_type(scaling: Mapping[str, Any] | None) -> str:
    """HF spells it ``rope_type`` (new) or ``type`` (old, and the kvgen spec)."""
    if scaling is None:
        return "default"
    kind = _opt(scaling, "rope_type", _opt(scaling, "type", "default"))
    if kind not in ROPE_SCALING_TYPES:
        raise ValueError(f"RoPE scaling type {kind!r} is not supported by TriAttention; "
                         f"accepted: {', '.join(ROPE_SCALING_TYPES)} (dynamic NTK changes omega "
                         f"with the sequence length, which fixed calibration cannot follow)")
    return kind


def _default_inv_freq(rotary_dim: int, theta: float) -> torch.Tensor:
    # Same expression and dtype as HF `_compute_default_rope_parameters`, so omega is bit-equal
    # to the frequency the model rotated its keys with.
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).to(torch.float32) / rotary_dim
    return 1.0 / (theta ** exponents)


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: Mapping[str, Any]) -> torch.Tensor:
    # HF `_compute_llama3_parameters`: long wavelengths divided by `factor`, short ones kept,
    # a linear blend (in 1/wavelength) between the two thresholds.
    factor = float(_need(scaling, "factor", "llama3"))
    low = float(_need(scaling, "low_freq_factor", "llama3"))
    high = float(_need(scaling, "high_freq_factor", "llama3"))
    old_len = float(_need(scaling, "original_max_position_embeddings", "llama3"))
    low_freq_wavelen = old_len / low
    high_freq_wavelen = old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_correction_range(scaling: Mapping[str, Any], rotary_dim: int, theta: float) -> tuple[float, float]:
    # HF `find_correction_range`: the dimensions whose wavelength spans beta_fast..beta_slow
    # rotations over the pretrained context.
    old_len = float(_opt(scaling, "original_max_position_embeddings",
                         _opt(scaling, "max_position_embeddings")))
    beta_fast = float(_opt(scaling, "beta_fast", 32))
    beta_slow = float(_opt(scaling, "beta_slow", 1))

    def correction_dim(rotations: float) -> float:
        return (rotary_dim * math.log(old_len / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low = correction_dim(beta_fast)
    high = correction_dim(beta_slow)
    if _opt(scaling, "truncate", True):
        low = math.floor(low)
        high = math.ceil(high)
    return max(low, 0), min(high, rotary_dim - 1)


def _yarn_inv_freq(rotary_dim: int, theta: float, scaling: Mapping[str, Any]) -> torch.Tensor:
    # HF `_compute_yarn_parameters`: blend of extrapolated (original) and interpolated
    # (divided by factor) frequencies along a linear ramp over the frequency index.
    factor = float(_need(scaling, "factor", "yarn"))
    if _opt(scaling, "original_max_position_embeddings", _opt(scaling, "max_position_embeddings")) is None:
        raise ValueError("RoPE scaling 'yarn' needs 'original_max_position_embeddings'")
    pos_freqs = theta ** (torch.arange(0, rotary_dim, 2).to(torch.float32) / rotary_dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)
    low, high = _yarn_correction_range(scaling, rotary_dim, theta)
    if low == high:
        high += 0.001  # HF: prevent a division by zero
    ramp = torch.clamp((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation_weight = 1 - ramp
    return interpolation * (1 - extrapolation_weight) + extrapolation * extrapolation_weight


def _longrope_inv_freq(rotary_dim: int, theta: float, scaling: Mapping[str, Any],
                       seq_len: int | None) -> torch.Tensor:
    # HF `_compute_longrope_parameters`: the default frequencies divided by one rescale factor per
    # pair, `short_factor` within the pretrained context and `long_factor` past it.
    old_len = int(_need(scaling, "original_max_position_embeddings", "longrope"))
    key = "short_factor" if seq_len is not None and seq_len <= old_len else "long_factor"
    ext_factors = torch.tensor([float(v) for v in _need(scaling, key, "longrope")], dtype=torch.float32)
    if ext_factors.shape != (rotary_dim // 2,):
        raise ValueError(f"RoPE scaling 'longrope': {key} has {ext_factors.numel()} entries; "
                         f"rotary_dim {rotary_dim} needs {rotary_dim // 2}")
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).to(torch.float32) / rotary_dim
    return 1.0 / (ext_factors * theta ** exponents)


def longrope_attention_factor(scaling: Mapping[str, Any]) -> float:
    """HF's LongRoPE attention factor (multiplies cos and sin of both q and k):
    ``sqrt(1 + log(factor) / log(original_max_position_embeddings))``, 1 for ``factor <= 1``,
    unless ``attention_factor`` is given. ``factor`` is HF's, which for Phi-3/Phi-4 is
    ``max_position_embeddings / original_max_position_embeddings``."""
    explicit = _opt(scaling, "attention_factor")
    if explicit is not None:
        return float(explicit)
    factor = float(_opt(scaling, "factor", 1.0))
    if factor <= 1.0:
        return 1.0
    old_len = float(_need(scaling, "original_max_position_embeddings", "longrope"))
    return math.sqrt(1 + math.log(factor) / math.log(old_len))


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def yarn_attention_factor(scaling: Mapping[str, Any]) -> float:
    """HF's YaRN attention factor (multiplies cos and sin of both q and k)."""
    explicit = _opt(scaling, "attention_factor")
    if explicit is not None:
        return float(explicit)
    factor = float(_need(scaling, "factor", "yarn"))
    mscale = _opt(scaling, "mscale")
    mscale_all_dim = _opt(scaling, "mscale_all_dim")
    if mscale and mscale_all_dim:
        return _yarn_mscale(factor, float(mscale)) / _yarn_mscale(factor, float(mscale_all_dim))
    return _yarn_mscale(factor)


def rope_omega(rotary_dim: int, theta: float, scaling: Mapping[str, Any] | None,
               seq_len: int | None = None) -> torch.Tensor:
    """Angular frequency per pair, float32 ``[rotary_dim // 2]``, as HF computes ``inv_freq``.

    ``scaling`` is an HF ``rope_scaling`` dict (``type``/``rope_type`` in default, linear,
    llama3, yarn, longrope) or ``None``. For yarn, ``factor`` is used as given (HF's DeepSeek rule
    that recomputes it from ``max_position_embeddings`` is the caller's business).

    ``seq_len`` matters for longrope only: HF switches from ``short_factor`` to ``long_factor``
    once the sequence is longer than ``original_max_position_embeddings``. ``None`` (what
    TriAttention uses) means past it: the scorer predicts queries at ``L + o`` with offsets up to
    65536, beyond the pretrained context of any LongRoPE model, where the model uses the long
    factors; below that context, scores use them too (an approximation, see docs/specs.md).
    """
    if rotary_dim <= 0 or rotary_dim % 2:
        raise ValueError(f"rotary_dim must be a positive even number, got {rotary_dim}")
    kind = _scaling_type(scaling)
    if kind == "yarn":
        return _yarn_inv_freq(rotary_dim, theta, scaling)
    if kind == "longrope":
        return _longrope_inv_freq(rotary_dim, theta, scaling, seq_len)
    inv_freq = _default_inv_freq(rotary_dim, theta)
    if kind == "linear":
        return inv_freq / float(_need(scaling, "factor", "linear"))
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    return inv_freq


def rope_attention_factor(scaling: Mapping[str, Any] | None) -> float:
    """HF's ``attention_scaling`` of a RoPE: yarn's and longrope's factor, 1 for the others."""
    kind = _scaling_type(scaling)
    if kind == "yarn":
        return yarn_attention_factor(scaling)
    if kind == "longrope":
        return longrope_attention_factor(scaling)
    return 1.0


def rope_freq_scale_sq(rotary_dim: int, scaling: Mapping[str, Any] | None) -> torch.Tensor:
    """Square of the RoPE attention factor per pair, float32 ``[F]`` (ones unless yarn or longrope)."""
    factor = rope_attention_factor(scaling)
    return torch.full((rotary_dim // 2,), factor * factor, dtype=torch.float32)


def rope_defaults(rotary_dim: int, theta: float,
                  scaling: Mapping[str, Any] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(omega, freq_scale_sq)``, float32 ``[F]``, of a RoPE: the defaults ``load_calibration``
    checks a stored omega against (and uses for upstream files)."""
    return rope_omega(rotary_dim, theta, scaling), rope_freq_scale_sq(rotary_dim, scaling)


# ----------------------------------------------------------------------------------------------
# Calibration
# ----------------------------------------------------------------------------------------------

class CalibrationError(ValueError):
    """A calibration file that cannot serve this geometry; the message names file and key."""


@dataclass(frozen=True)
class Calibration:
    """Per (cache layer, query head, frequency) pre-RoPE query statistics (§1).

    ``E_q`` complex64 ``[L, Hq, F]`` mean pre-RoPE query pair; ``E_q_norm`` float32 ``[L, Hq, F]``
    mean magnitude ``E|q_f|``; ``omega`` float32 ``[F]``; ``freq_scale_sq`` float32 ``[F]``.
    """

    E_q: torch.Tensor
    E_q_norm: torch.Tensor
    omega: torch.Tensor
    freq_scale_sq: torch.Tensor

    @property
    def mlr(self) -> torch.Tensor:
        """``E|q| - |E q|`` (≥ 0 up to rounding): weight of the key-norm term."""
        return self.E_q_norm - self.E_q.abs()

    def to(self, device: torch.device | str) -> Calibration:
        return Calibration(self.E_q.to(device), self.E_q_norm.to(device),
                           self.omega.to(device), self.freq_scale_sq.to(device))


def _fail(path: Path | str, key: str, message: str) -> CalibrationError:
    return CalibrationError(f"{path}: key {key!r}: {message}")


def _check_tensor(path: Path | str, key: str, value: Any, shape: tuple[int, ...],
                  dtypes: tuple[torch.dtype, ...], meaning: str = "") -> torch.Tensor:
    """Type, dtype, shape and finiteness of one stored tensor; errors name file and key."""
    if value is None:
        raise _fail(path, key, "missing")
    if not isinstance(value, torch.Tensor):
        raise _fail(path, key, f"expected a tensor, got {type(value).__name__}")
    if value.dtype not in dtypes:
        names = " or ".join(str(d).replace("torch.", "") for d in dtypes)
        raise _fail(path, key, f"expected dtype {names}, got {str(value.dtype).replace('torch.', '')}")
    if tuple(value.shape) != shape:
        raise _fail(path, key, f"expected shape {list(shape)}{meaning}, got {list(value.shape)}")
    if not bool(torch.isfinite(value).all()):
        raise _fail(path, key, "contains non-finite values (nan or inf)")
    return value


def _read_file(path: Path | str) -> Any:
    """``torch.load(weights_only=True)``: a file needing arbitrary unpickling is refused."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError as exc:
        raise CalibrationError(f"{path}: calibration file not found") from exc
    except Exception as exc:  # pickle.UnpicklingError and friends: never retry unsafely
        raise CalibrationError(f"{path}: refused: not loadable with torch.load(weights_only=True) "
                               f"(a calibration file holds only tensors, dicts, lists and numbers; "
                               f"arbitrary unpickling is never allowed): {exc}") from exc


def _check_frequencies(path: Path | str, key: str, value: torch.Tensor,
                       expected: torch.Tensor | None) -> torch.Tensor:
    """A stored omega/freq_scale_sq must agree with the one the family's RoPE implies."""
    if expected is not None and not torch.allclose(value.double(), expected.double(), rtol=1e-5, atol=0):
        raise _fail(path, key, "disagrees with the family's RoPE parameters "
                               "(calibrated for another rope theta/scaling?)")
    return value


def _load_flat(path: Path | str, raw: Mapping[str, Any], geometry: TriGeometry,
               omega_default: torch.Tensor | None, scale_default: torch.Tensor | None) -> Calibration:
    shape = (geometry.num_layers, geometry.query_heads, geometry.rotary_dim // 2)
    meaning = " (cache layers, query heads, rotary_dim/2 of the geometry)"
    for key in ("E_q", "E_q_norm"):
        if key not in raw:
            raise _fail(path, key, "missing; a flat calibration has E_q, E_q_norm, omega, freq_scale_sq")
    e_q = _check_tensor(path, "E_q", raw["E_q"], shape, (torch.complex64,), meaning)
    e_q_norm = _check_tensor(path, "E_q_norm", raw["E_q_norm"], shape, (torch.float32,), meaning)
    omega = _stored_or_default(path, raw, "omega", shape[2], omega_default)
    scale = _stored_or_default(path, raw, "freq_scale_sq", shape[2], scale_default)
    return Calibration(e_q, e_q_norm, omega, scale)


def _stored_or_default(path: Path | str, raw: Mapping[str, Any], key: str, freqs: int,
                       default: torch.Tensor | None) -> torch.Tensor:
    if key not in raw:
        if default is None:
            raise _fail(path, key, "missing and no default from the family's RoPE was given")
        return default.to(torch.float32).cpu()
    value = _check_tensor(path, key, raw[key], (freqs,), (torch.float32,), " (rotary_dim/2)")
    return _check_frequencies(path, key, value, default)


def _sampled_heads(path: Path | str, metadata: Any, geometry: TriGeometry) -> list[tuple[int, int]]:
    if not isinstance(metadata, Mapping) or "sampled_heads" not in metadata:
        raise _fail(path, "metadata.sampled_heads", "missing; expected a list of [layer, head] pairs")
    heads = []
    for item in metadata["sampled_heads"]:
        pair = tuple(int(v) for v in item)
        if len(pair) != 2:
            raise _fail(path, "metadata.sampled_heads", f"expected [layer, head] pairs, got {list(item)}")
        layer, head = pair
        if not 0 <= layer < geometry.num_layers:
            raise _fail(path, "metadata.sampled_heads",
                        f"layer {layer} outside the cache's layers 0..{geometry.num_layers - 1}")
        if not 0 <= head < geometry.query_heads:
            raise _fail(path, "metadata.sampled_heads",
                        f"head {head} outside the query heads 0..{geometry.query_heads - 1}")
        heads.append((layer, head))
    return heads


def upstream_head_key(layer: int, head: int) -> str:
    """Key of one (cache layer, query head) in the upstream form's ``stats``."""
    return f"layer{layer:02d}_head{head:02d}"


def _load_upstream(path: Path | str, raw: Mapping[str, Any], geometry: TriGeometry,
                   omega_default: torch.Tensor | None, scale_default: torch.Tensor | None) -> Calibration:
    """Upstream form: per-head dicts; heads not sampled keep zeros, so they score 0."""
    if omega_default is None or scale_default is None:
        raise _fail(path, "stats", "the upstream form stores no omega; pass the family's RoPE "
                                   "omega and freq_scale_sq as defaults")
    freqs = geometry.rotary_dim // 2
    stats = raw["stats"]
    if not isinstance(stats, Mapping):
        raise _fail(path, "stats", f"expected a dict of per-head stats, got {type(stats).__name__}")
    e_q = torch.zeros(geometry.num_layers, geometry.query_heads, freqs, dtype=torch.complex64)
    e_q_norm = torch.zeros(geometry.num_layers, geometry.query_heads, freqs, dtype=torch.float32)
    floats = (torch.float32, torch.float64, torch.float16, torch.bfloat16)  # upstream calls .float()
    for layer, head in _sampled_heads(path, raw.get("metadata"), geometry):
        name = upstream_head_key(layer, head)
        entry = stats.get(name)
        if not isinstance(entry, Mapping):
            raise _fail(path, f"stats.{name}", "missing or not a dict, but the head is in sampled_heads")
        parts = {}
        for field in ("q_mean_real", "q_mean_imag", "q_abs_mean"):
            key = f"stats.{name}.{field}"
            parts[field] = _check_tensor(path, key, entry.get(field), (freqs,), floats, " (rotary_dim/2)").float()
        e_q[layer, head] = torch.complex(parts["q_mean_real"], parts["q_mean_imag"])
        e_q_norm[layer, head] = parts["q_abs_mean"]
    omega = _check_tensor(path, "omega (default)", omega_default.cpu().float(), (freqs,), (torch.float32,))
    scale = _check_tensor(path, "freq_scale_sq (default)", scale_default.cpu().float(), (freqs,), (torch.float32,))
    return Calibration(e_q, e_q_norm, omega, scale)


def load_calibration(path: Path | str, geometry: TriGeometry, omega_default: torch.Tensor | None,
                     freq_scale_sq_default: torch.Tensor | None) -> Calibration:
    """Load and validate either on-disk form of §1 into a CPU ``Calibration``.

    Flat form: ``{E_q, E_q_norm, omega, freq_scale_sq}`` with ``L`` = the cache's layers; a
    stored omega/freq_scale_sq must match the defaults (rtol 1e-5) when defaults are given, and
    missing ones take the defaults. Upstream form: ``{metadata: {sampled_heads}, stats:
    {"layerLL_headHH": {...}}}``; omega and freq_scale_sq come from the defaults.
    """
    raw = _read_file(path)
    if not isinstance(raw, Mapping):
        raise _fail(path, "<top level>", f"expected a dict, got {type(raw).__name__}")
    if "stats" in raw:
        return _load_upstream(path, raw, geometry, omega_default, freq_scale_sq_default)
    if "E_q" in raw or "E_q_norm" in raw:
        return _load_flat(path, raw, geometry, omega_default, freq_scale_sq_default)
    raise _fail(path, "<top level>", f"expected keys E_q, E_q_norm, omega, freq_scale_sq (flat form) "
                                     f"or metadata, stats (upstream form); got {sorted(map(str, raw))}")


def save_calibration(calib: Calibration, path: Path | str) -> None:
    """Write the flat form (loadable with weights_only=True)."""
    torch.save({"E_q": calib.E_q.cpu(), "E_q_norm": calib.E_q_norm.cpu(),
                "omega": calib.omega.cpu(), "freq_scale_sq": calib.freq_scale_sq.cpu()}, path)


def save_upstream_calibration(calib: Calibration, path: Path | str,
                              metadata: Mapping[str, Any] | None = None) -> None:
    """Write the upstream form with every (layer, head) sampled. ``metadata`` adds descriptive
    entries (str, numbers, lists) beside ``sampled_heads``, the only one the loader reads; omega
    and freq_scale_sq are not stored, the loader takes them from the family's RoPE."""
    layers, heads, _ = calib.E_q.shape
    sampled = [[layer, head] for layer in range(layers) for head in range(heads)]
    stats = {}
    for layer, head in sampled:
        # clone(): a view would drag the whole [L, Hq, F] storage into every entry of the file
        stats[upstream_head_key(layer, head)] = {
            "q_mean_real": calib.E_q[layer, head].real.cpu().clone(),
            "q_mean_imag": calib.E_q[layer, head].imag.cpu().clone(),
            "q_abs_mean": calib.E_q_norm[layer, head].cpu().clone(),
        }
    torch.save({"metadata": {**dict(metadata or {}), "sampled_heads": sampled}, "stats": stats}, path)


def synthetic_queries(geometry: TriGeometry, seed: int, num_queries: int = 256,
                      spread: float = 0.3) -> torch.Tensor:
    """Pre-RoPE query pairs, complex64 ``[L, Hq, F, num_queries]``, for tests.

    As the paper observes, pre-RoPE queries of a head concentrate around a fixed center per
    frequency: each (layer, head, f) gets a center with log-normal magnitude and uniform phase,
    and samples are center + complex Gaussian noise of ``spread`` times the center's magnitude.
    """
    generator = torch.Generator().manual_seed(seed)
    shape = (geometry.num_layers, geometry.query_heads, geometry.rotary_dim // 2)
    magnitude = torch.exp(torch.randn(shape, generator=generator) * 0.5)
    phase = torch.rand(shape, generator=generator) * 2 * math.pi
    center = torch.polar(magnitude, phase)
    noise_re = torch.randn(*shape, num_queries, generator=generator)
    noise_im = torch.randn(*shape, num_queries, generator=generator)
    noise = torch.complex(noise_re, noise_im) * (spread * magnitude / math.sqrt(2))[..., None]
    return center[..., None] + noise


def synthetic_calibration(geometry: TriGeometry, seed: int, num_queries: int = 256, spread: float = 0.3,
                          theta: float = 10000.0, scaling: Mapping[str, Any] | None = None) -> Calibration:
    """Statistics of ``synthetic_queries``: E_q = mean, E_q_norm = mean magnitude."""
    queries = synthetic_queries(geometry, seed, num_queries, spread)
    return Calibration(E_q=queries.mean(dim=-1).to(torch.complex64),
                       E_q_norm=queries.abs().mean(dim=-1).to(torch.float32),
                       omega=rope_omega(geometry.rotary_dim, theta, scaling),
                       freq_scale_sq=rope_freq_scale_sq(geometry.rotary_dim, scaling))
