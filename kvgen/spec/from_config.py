"""``kvgen spec from-config``: a family spec drafted from a Hugging Face ``config.json``.

The attention geometry and the RoPE are read the way transformers reads them (heads, head_dim or
``hidden_size / heads``, ``rope_theta``, ``rope_scaling`` under either spelling of its type,
partial rotary, sliding-window layers, DeepSeek-style MLA), plus the few model-specific rules
HF keeps in modeling code (ChatGLM's half-head interleaved RoPE and ``rope_ratio``, Gemma-2's
alternating windows, Phi-3's LongRoPE factor). What a config cannot say (the engine's page size,
the layout, TriAttention's budget) takes a stated default. Every default and everything that could
not be inferred becomes a note, which the CLI prints on stderr. The draft is parsed by the spec's
own validator before anything is written.
"""

from __future__ import annotations

import json
import math
import re
import textwrap
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from kvgen.reference.triattention_family import refusal_reason
from kvgen.spec.schema import SCALING_FIELDS, SCALING_REQUIRED, FamilySpec, parse_spec

DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float8_e4m3fn": "fp8_e4m3"}
# HF modeling code that rotates adjacent pairs (2f, 2f+1) instead of rotate_half's (f, f+F).
INTERLEAVED_MODEL_TYPES = ("chatglm", "glm", "glm4", "gptj", "codegen", "deepseek_v2", "deepseek_v3", "kimi_k2")
LAYER_TYPES = ("full_attention", "sliding_attention", "linear_attention")  # linear: recurrent state, no KV
TOKENS_PER_BLOCK = 32
MLA_TOKENS_PER_BLOCK = 64   # FlashMLA's page size
TRI_BUDGET, TRI_BETA = 2048, 128


class ConfigError(ValueError):
    """A config.json this command cannot turn into a spec; the message names the file and key."""


@dataclass
class Draft:
    """A spec as data (in the shipped specs' key order), its comments and the notes for stderr."""

    data: dict[str, Any]
    header: list[str]
    comments: dict[str, str] = field(default_factory=dict)   # top-level key -> end-of-line comment
    notes: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.data["name"]

    def text(self) -> str:
        """Commented YAML, shaped like ``specs/*.yaml``."""
        body = yaml.dump(self.data, Dumper=_SpecDumper, sort_keys=False, default_flow_style=False, width=100)
        lines = []
        for line in body.splitlines():
            key = line.split(":", 1)[0]
            comment = self.comments.get(key) if not line.startswith(" ") else None
            lines.append(f"{line}  # {comment}" if comment else line)
        header = textwrap.wrap(" ".join(self.header), width=98)
        return "".join(f"# {h}\n" for h in header) + "\n".join(lines) + "\n"


class _FlowList(list):
    """A list of numbers written on one line (``[1.0, 1.05, ...]``), as in the shipped specs."""


class _SpecDumper(yaml.SafeDumper):
    pass


_SpecDumper.add_representer(
    _FlowList, lambda dumper, data: dumper.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=True))


# ---------------------------------------------------------------- reading the config


class _Config:
    """The config's values, with errors that name the file and key and notes on what was assumed."""

    def __init__(self, values: Mapping[str, Any], source: str, notes: list[str]):
        self.values, self.source, self.notes = values, source, notes
        self.model_type = str(values.get("model_type") or "")

    def get(self, *keys: str) -> Any:
        """The first of ``keys`` present with a non-null value, else ``None``."""
        for key in keys:
            if self.values.get(key) is not None:
                return self.values[key]
        return None

    def integer(self, *keys: str, required: bool = True) -> int | None:
        value = self.get(*keys)
        if value is None:
            if required:
                raise self.error(" / ".join(keys), "missing")
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value) or value < 1:
            raise self.error(keys[0], f"expected a positive integer, got {value!r}")
        return int(value)

    def number(self, *keys: str) -> float | None:
        value = self.get(*keys)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise self.error(keys[0], f"expected a positive number, got {value!r}")
        return float(value)

    def error(self, key: str, message: str) -> ConfigError:
        return ConfigError(f"{self.source}: {key}: {message}")

    def note(self, text: str) -> None:
        self.notes.append(text)


def read_config(path: str | Path) -> dict[str, Any]:
    """The JSON object in ``path``; ``ConfigError`` names the file if it is not one."""
    try:
        values = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read: {exc}") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}:{exc.lineno}: not JSON: {exc.msg}") from None
    if not isinstance(values, dict):
        raise ConfigError(f"{path}: expected a JSON object (a config.json), got {type(values).__name__}")
    return values


def _language_model(values: dict[str, Any], source: str, notes: list[str]) -> _Config:
    """Multimodal configs nest the language model under ``text_config``."""
    nested = values.get("text_config")
    if "num_attention_heads" not in values and isinstance(nested, dict):
        notes.append("read the language model from text_config")
        return _Config(nested, f"{source}: text_config", notes)
    return _Config(values, source, notes)


# ---------------------------------------------------------------- geometry


@dataclass(frozen=True)
class _Geometry:
    attention: str
    layers: int
    query_heads: int
    kv_heads: int
    head_dim: int | None   # K/V row width; None for MLA, whose row is the latent
    mla: dict[str, int] | None = None


def _layer_kinds(cfg: _Config) -> list[str] | None:
    """The type of each layer that keeps a KV cache (hybrid stacks: linear-attention layers keep
    recurrent state instead), or ``None`` when the config does not list them."""
    layers = cfg.integer("num_hidden_layers", "num_layers", "n_layer")
    kinds = cfg.get("layer_types")
    interval = cfg.integer("full_attention_interval", required=False)
    if kinds is None and interval is not None:  # Qwen3-Next/Qwen3.5: every interval-th layer is full
        kinds = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)]
    if kinds is None:
        return None
    if not isinstance(kinds, list) or len(kinds) != layers:
        raise cfg.error("layer_types", f"expected a list of {layers} layer types (one per layer)")
    for i, kind in enumerate(kinds):
        if kind not in LAYER_TYPES:
            raise cfg.error(f"layer_types[{i}]", f"{kind!r}; accepted: {', '.join(LAYER_TYPES)}")
    cached = [kind for kind in kinds if kind != "linear_attention"]
    if len(cached) < layers:
        cfg.note(f"layers: {len(cached)} of {layers} keep a KV cache (the others are linear attention)")
    return cached


def _geometry(cfg: _Config, kinds: list[str] | None) -> _Geometry:
    layers = len(kinds) if kinds is not None else cfg.integer("num_hidden_layers", "num_layers", "n_layer")
    heads = cfg.integer("num_attention_heads", "n_head")
    if cfg.get("kv_lora_rank") is not None:
        return _mla_geometry(cfg, layers, heads)
    kv_heads = _kv_heads(cfg, heads)
    head_dim = cfg.integer("head_dim", "kv_channels", required=False)
    if head_dim is None:
        hidden = cfg.integer("hidden_size", "n_embd")
        if hidden % heads:
            raise cfg.error("head_dim", f"missing, and hidden_size {hidden} is not a multiple of {heads} heads")
        head_dim = hidden // heads
        cfg.note(f"head_dim: not in the config; hidden_size / num_attention_heads = {head_dim}")
    if kv_heads == heads:
        attention = "mha"
    else:
        attention = "mqa" if kv_heads == 1 else "gqa"
    return _Geometry(attention, layers, heads, kv_heads, head_dim)


def _kv_heads(cfg: _Config, heads: int) -> int:
    if cfg.model_type == "chatglm":  # ChatGLM: multi-query groups instead of num_key_value_heads
        return cfg.integer("multi_query_group_num") if cfg.get("multi_query_attention") else heads
    kv_heads = cfg.integer("num_key_value_heads", required=False)
    if kv_heads is None:
        cfg.note(f"num_key_value_heads: not in the config; HF's default is num_attention_heads ({heads}), MHA")
        return heads
    if heads % kv_heads:
        raise cfg.error("num_key_value_heads", f"{kv_heads} does not divide num_attention_heads {heads}")
    return kv_heads


def _mla_geometry(cfg: _Config, layers: int, heads: int) -> _Geometry:
    mla = {"kv_lora_rank": cfg.integer("kv_lora_rank"), "qk_rope_head_dim": cfg.integer("qk_rope_head_dim")}
    nope = cfg.integer("qk_nope_head_dim", required=False)
    v_dim = cfg.integer("v_head_dim", required=False)
    cfg.note(f"MLA: the cache keeps one latent row per token (kv_lora_rank {mla['kv_lora_rank']} + qk_rope_head_dim "
             f"{mla['qk_rope_head_dim']}), so kv_heads is 1; qk_nope_head_dim {nope} and v_head_dim {v_dim} "
             f"are decompressed per head and not stored")
    return _Geometry("mla", layers, heads, 1, None, mla)


def _dtype(cfg: _Config) -> str:
    name = cfg.get("torch_dtype", "dtype")
    if name in DTYPES:
        return DTYPES[name]
    why = "no torch_dtype in the config" if name is None else f"torch_dtype {name} is not a hot-cache dtype"
    cfg.note(f"dtype: {why}; chose bf16 (accepted: bf16, fp16, fp8_e4m3)")
    return "bf16"


# ---------------------------------------------------------------- RoPE


def _rope(cfg: _Config, geo: _Geometry) -> dict[str, Any]:
    """``rope`` of the spec: placement, width, pairing, theta and scaling."""
    theta = _theta(cfg)
    if geo.mla is not None:
        rope: dict[str, Any] = {"placement": "trailing"}
        rotary = geo.mla["qk_rope_head_dim"]
    else:
        rope, rotary = _rotated_span(cfg, geo.head_dim)
    rope["pairing"] = _pairing(cfg)
    rope["theta"] = theta
    scaling = _scaling(cfg, rotary)
    if scaling is not None:
        rope["scaling"] = scaling
    return rope


def _theta(cfg: _Config) -> float:
    if cfg.model_type == "chatglm":  # ChatGLM's RotaryEmbedding: base = 10000 * rope_ratio
        ratio = cfg.number("rope_ratio") or 1.0
        return 10000.0 * ratio
    theta = cfg.number("rope_theta") or _parameters(cfg).get("rope_theta")
    if theta is None:
        cfg.note("rope_theta: not in the config; HF's default 10000.0")
        return 10000.0
    return float(theta)


def _parameters(cfg: _Config) -> dict[str, Any]:
    """transformers v5's ``rope_parameters`` (theta and scaling in one dict, or one per layer type:
    TriAttention scores full-attention layers, so those are the ones read)."""
    params = cfg.get("rope_parameters")
    if not isinstance(params, dict):
        return {}
    if isinstance(params.get("full_attention"), dict):
        cfg.note("rope_parameters per layer type: read full_attention's (the layers TriAttention scores)")
        return params["full_attention"]
    return params


def _rotated_span(cfg: _Config, head_dim: int) -> tuple[dict[str, Any], int]:
    """Placement and width: HF rotates the first ``rotary_dim`` elements of a head."""
    if cfg.model_type == "chatglm":  # ChatGLM: RotaryEmbedding(kv_channels // 2), the first half
        return {"placement": "leading", "rotary_dim": head_dim // 2}, head_dim // 2
    factor = cfg.number("partial_rotary_factor", "rotary_pct") or _parameters(cfg).get("partial_rotary_factor")
    width = cfg.integer("rotary_dim", required=False)
    if width is None and factor is not None and factor < 1:
        width = int(head_dim * factor)  # HF: int(head_dim * partial_rotary_factor)
        if width == head_dim * factor:
            return {"placement": "leading", "partial_rotary_factor": factor}, width
    if width is None or width == head_dim:
        return {"placement": "full"}, head_dim
    return {"placement": "leading", "rotary_dim": width}, width


def _pairing(cfg: _Config) -> str:
    given = cfg.get("rope_interleave")
    if given is not None:
        return "interleaved" if given else "half"
    if cfg.model_type in INTERLEAVED_MODEL_TYPES:
        cfg.note(f"pairing: interleaved, as HF's {cfg.model_type} modeling code rotates adjacent pairs")
        return "interleaved"
    return "half"


def _scaling(cfg: _Config, rotary: int) -> dict[str, Any] | None:
    raw = cfg.get("rope_scaling") or _parameters(cfg)
    if not isinstance(raw, dict):
        raise cfg.error("rope_scaling", f"expected an object, got {raw!r}")
    kind = raw.get("rope_type") or raw.get("type") or "default"
    if kind == "su":
        cfg.note("rope_scaling: type su is LongRoPE's old name; written as longrope")
        kind = "longrope"
    if kind == "default":
        return None
    if kind not in SCALING_FIELDS:
        raise cfg.error("rope_scaling", f"type {kind!r} has no spec form; accepted: "
                                        f"default, {', '.join(SCALING_FIELDS)} (or the old key type)")
    scaling = {"type": kind}
    for key in SCALING_FIELDS[kind]:
        if raw.get(key) is not None:
            try:
                scaling[key] = _scaling_value(key, raw[key])
            except (TypeError, ValueError):
                raise cfg.error(f"rope_scaling.{key}", f"not a number (or list of numbers): {raw[key]!r}") from None
    ignored = sorted(set(raw) - {"type", "rope_type", "rope_theta", "partial_rotary_factor", *scaling})
    if ignored:
        cfg.note(f"rope_scaling: ignored {', '.join(ignored)} (not read by HF's {kind} frequencies)")
    _original_context(cfg, kind, scaling)
    scaling = {key: scaling[key] for key in ("type", *SCALING_FIELDS[kind]) if key in scaling}
    missing = [key for key in SCALING_REQUIRED.get(kind, ()) if key not in scaling]
    if missing:
        raise cfg.error("rope_scaling", f"{kind} needs {', '.join(missing)}")
    for key in ("short_factor", "long_factor"):
        if key in scaling and len(scaling[key]) != rotary // 2:
            raise cfg.error(f"rope_scaling.{key}", f"{len(scaling[key])} factors; the rotated width {rotary} "
                                                   f"has {rotary // 2} pairs")
    return scaling


def _scaling_value(key: str, value: Any) -> Any:
    if key in ("short_factor", "long_factor"):
        return _FlowList(float(v) for v in value)
    if key == "original_max_position_embeddings":
        return int(value)
    if key == "truncate":
        return bool(value)
    return float(value)


def _original_context(cfg: _Config, kind: str, scaling: dict[str, Any]) -> None:
    """``original_max_position_embeddings`` and ``factor`` where HF takes them from the top level."""
    longest = cfg.integer("max_position_embeddings", "seq_length", required=False)
    if kind == "longrope":
        top = cfg.integer("original_max_position_embeddings", required=False)
        if top is not None:  # Phi-3/Phi-4: the attention factor uses this ratio, not rope_scaling.factor
            scaling["original_max_position_embeddings"] = top
            if longest is not None:
                scaling["factor"] = longest / top
    if kind in ("yarn", "longrope", "dynamic") and "original_max_position_embeddings" not in scaling:
        if longest is None:
            return
        scaling["original_max_position_embeddings"] = longest
        cfg.note(f"rope_scaling: no original_max_position_embeddings; HF uses max_position_embeddings ({longest})")
    original = scaling.get("original_max_position_embeddings")
    if kind == "yarn" and longest and original and not math.isclose(longest / original, scaling.get("factor", 1)):
        cfg.note(f"rope_scaling: yarn factor {scaling.get('factor')} differs from max_position_embeddings / "
                 f"original_max_position_embeddings = {longest / original:g}, which newer transformers use; "
                 f"kept the config's factor")


# ---------------------------------------------------------------- sliding windows


def _sliding(cfg: _Config, layers: int, kinds: list[str] | None) -> tuple[dict[str, Any] | None, int]:
    """The ``sliding_window`` block and the number of sliding layers."""
    window = cfg.integer("sliding_window", required=False)
    longest = cfg.integer("max_position_embeddings", required=False)
    if window is not None and longest is not None and window >= longest:
        cfg.note(f"sliding_window {window} >= max_position_embeddings {longest}: it never slides; none written")
        return None, 0
    sliding = _sliding_layers(cfg, layers, kinds, window)
    if not sliding:
        return None, 0
    if window is None:
        raise cfg.error("sliding_window", "missing, but layers slide")
    return {"window": window, "layers": _layer_set(sliding, layers)}, len(sliding)


def _sliding_layers(cfg: _Config, layers: int, kinds: list[str] | None, window: int | None) -> list[int]:
    """Cache-layer indices that slide."""
    if kinds is not None:
        return [i for i, kind in enumerate(kinds) if kind == "sliding_attention"]
    if cfg.model_type == "gemma2":
        cfg.note("sliding_window: Gemma-2 alternates, even layers slide (HF Gemma2: not layer_idx % 2)")
        return list(range(0, layers, 2))
    pattern = cfg.integer("sliding_window_pattern", required=False)
    if pattern is not None:  # Gemma-3: every pattern-th layer is global
        return [i for i in range(layers) if (i + 1) % pattern]
    if window is None:
        return []
    if cfg.get("use_sliding_window") is False:
        cfg.note(f"sliding_window {window} ignored: use_sliding_window is false")
        return []
    first = cfg.integer("max_window_layers", required=False) if "use_sliding_window" in cfg.values else None
    cfg.note(f"sliding_window {window}: no layer_types; " + (f"layers {first}.. slide (max_window_layers)"
                                                             if first is not None else "every layer slides"))
    return list(range(first or 0, layers))


def _layer_set(sliding: list[int], layers: int) -> str | list[int]:
    if sliding == list(range(layers)):
        return "all"
    for name, parity in (("even", 0), ("odd", 1)):
        if sliding == list(range(parity, layers, 2)):
            return name
    return _FlowList(sliding)


# ---------------------------------------------------------------- the draft


def _name(cfg: _Config, given: str | None, fallback: str | None) -> str:
    if given is not None:
        return given
    raw = cfg.get("_name_or_path") or fallback
    if raw is None:
        raise ConfigError(f"{cfg.source}: no model name to call the family; pass --name")
    name = re.sub(r"[^a-z0-9.]+", "-", Path(str(raw)).name.lower()).strip("-.")
    cfg.note(f"name: {name} (from {raw}); pass --name to choose another")
    return name


def _triattention(cfg: _Config, geo: _Geometry, dtype: str, rope: dict[str, Any], sliding: dict | None,
                  sliding_count: int) -> dict[str, Any] | None:
    reason = refusal_reason(geo.attention, rope_placement=rope["placement"],
                            scored_layers=geo.layers - sliding_count, dtype=dtype)
    if reason is None and rope.get("scaling", {}).get("type") == "dynamic":
        reason = "dynamic NTK scaling changes the frequencies with the sequence length"
    if reason is not None:
        cfg.note(f"triattention: left disabled ({reason})")
        return None
    budget = max(TRI_BUDGET, sliding["window"] if sliding else 0)
    cfg.note(f"triattention: enabled with the default budget {budget} and beta {TRI_BETA}")
    return {"enabled": True, "budget": budget, "beta": TRI_BETA}


def _summary(geo: _Geometry, rope: dict[str, Any], rotary: int, sliding: dict | None) -> str:
    if geo.mla:
        heads = f"MLA {geo.query_heads} heads, latent {geo.mla['kv_lora_rank']} + {geo.mla['qk_rope_head_dim']}"
    else:
        heads = f"{geo.attention.upper()} {geo.query_heads}/{geo.kv_heads}, head_dim {geo.head_dim}"
    span = {"full": "full-width RoPE", "trailing": f"RoPE on the trailing {rotary}"}.get(
        rope["placement"], f"RoPE on the leading {rotary} of {geo.head_dim}")
    theta = rope["theta"]
    theta_text = str(int(theta)) if theta.is_integer() else f"{theta:g}"
    text = f"{geo.layers} layers, {heads}, {span} ({rope['pairing']} pairs), rope_theta {theta_text}"
    if "scaling" in rope:
        text += f", {rope['scaling']['type']} scaling"
    if sliding:
        layers = sliding["layers"]
        text += f", sliding window {sliding['window']} on " + (f"{layers} layers" if isinstance(layers, str)
                                                               else f"layers {', '.join(map(str, layers))}")
    return text


def _rotary_width(geo: _Geometry, rope: dict[str, Any]) -> int:
    if geo.mla is not None:
        return geo.mla["qk_rope_head_dim"]
    if "rotary_dim" in rope:
        return rope["rotary_dim"]
    return round(geo.head_dim * rope.get("partial_rotary_factor", 1.0))


def draft_spec(values: dict[str, Any], source: str, name: str | None = None,
               fallback_name: str | None = None) -> Draft:
    """The spec a config implies (not yet validated: ``validate`` does that); ``ConfigError`` for a
    config that lacks what a spec needs."""
    notes: list[str] = []
    cfg = _language_model(values, source, notes)
    kinds = _layer_kinds(cfg)
    geo = _geometry(cfg, kinds)
    dtype = _dtype(cfg)
    rope = _rope(cfg, geo)
    sliding, sliding_count = _sliding(cfg, geo.layers, kinds)
    data: dict[str, Any] = {"name": _name(cfg, name, fallback_name)}
    model = cfg.get("_name_or_path")
    if model is not None and re.fullmatch(r"[A-Za-z0-9._-]+/[A-Za-z0-9._-]+", str(model)):
        data["model"] = str(model)
    tokens = MLA_TOKENS_PER_BLOCK if geo.mla else TOKENS_PER_BLOCK
    data.update({"attention": geo.attention, "layers": geo.layers, "query_heads": geo.query_heads})
    if geo.mla is None:
        data.update({"kv_heads": geo.kv_heads, "head_dim": geo.head_dim})
    data.update({"tokens_per_block": tokens, "layout": "HND", "dtype": dtype})
    if geo.mla is not None:
        data["mla"] = geo.mla
    data["rope"] = rope
    if sliding is not None:
        data["sliding_window"] = sliding
    tri = _triattention(cfg, geo, dtype, rope, sliding, sliding_count)
    if tri is not None:
        data["triattention"] = tri
    notes.append(f"tokens_per_block: {tokens} and layout: HND are defaults; set them to the engine's pages")
    comments = {"tokens_per_block": "default: set to the engine's page size", "layout": "default",
                "triattention": "default budget and beta"}
    header = [f"{data.get('model', data['name'])} (drafted by kvgen spec from-config from {Path(source).name}):",
              _summary(geo, rope, _rotary_width(geo, rope), sliding) + "."]
    return Draft(data, header, comments, list(dict.fromkeys(notes)))


def validate(draft: Draft, path: str) -> FamilySpec:
    """Parse the draft's text as ``path`` would be parsed: what is written is what validated."""
    return parse_spec(draft.text(), path)
