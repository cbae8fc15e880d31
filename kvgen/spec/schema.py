"""The cache-family spec language: YAML in, a frozen, validated ``FamilySpec`` out.

Two layers of checking, both reported as ``file:line: key: what is wrong (what is accepted)``:
1. shape and types (pydantic, ``extra="forbid"``: an unknown key lists the accepted ones);
2. the rules of COLD_PAGE_FORMAT.md §5 and TRIATTENTION.md §8 (``_semantic_errors``).
Everything a kernel needs is derived later, once, by ``kvgen.lower.plan``; this module only says what a
valid spec is.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated, Literal, Sequence, Union

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    StringConstraints,
    Tag,
    ValidationError,
    model_validator,
)

from kvgen.arch import DEFAULT_TARGETS
from kvgen.reference.layout import row_spans
from kvgen.reference.triattention_family import refusal_reason
from kvgen.spec.yamlsrc import KeyPath, LocatedDoc, YamlShapeError, load_located, read_text

HOT_DTYPES = ("bf16", "fp16", "fp8_e4m3")
ELEM_BYTES = {"bf16": 2, "fp16": 2, "fp8_e4m3": 1}
MAX_DIM = 1 << 14
MAX_COUNT = 1 << 12
MAX_HEADS = 1 << 10
# One layer's hot page, every buffer and side buffer together (tokens_per_block x heads x row x
# dtype). Far above what the codec stages in shared memory (227 KiB on sm_90a and sm_100a), and
# low enough that every size in the generated code is a 32-bit int: a spec that validates builds.
MAX_PAGE_BYTES = 1 << 24
# G and Q are binary32 (COLD_PAGE_FORMAT.md §3): both, and 1/G, stay normal finite numbers.
MIN_SCALE, MAX_SCALE = 2.0 ** -64, 2.0 ** 64

# Names reach C symbols and file names: lowercase words joined by '-' or '_'.
FamilyName = Annotated[str, StringConstraints(pattern=r"^[a-z][a-z0-9]*([-_.][a-z0-9]+)*$", max_length=64)]
BufferName = Annotated[str, StringConstraints(pattern=r"^[a-z][a-z0-9_]*$", max_length=32)]
Dim = Annotated[int, Field(ge=1, le=MAX_DIM, strict=True)]
Count = Annotated[int, Field(ge=1, le=MAX_COUNT, strict=True)]
Heads = Annotated[int, Field(ge=1, le=MAX_HEADS, strict=True)]
Scale = Annotated[float, Field(ge=MIN_SCALE, le=MAX_SCALE, allow_inf_nan=False)]
PositiveFloat = Annotated[float, Field(gt=0, allow_inf_nan=False)]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=False)


class RopeScaling(_Model):
    """HF ``rope_scaling``; only the fields the supported types use. HF's ``rope_type`` key is
    accepted as a spelling of ``type``."""

    type: Literal["llama3", "linear", "yarn", "dynamic", "longrope"]
    factor: PositiveFloat = 1.0
    low_freq_factor: PositiveFloat | None = None
    high_freq_factor: PositiveFloat | None = None
    original_max_position_embeddings: Count | Annotated[int, Field(ge=1, le=1 << 24, strict=True)] | None = None
    beta_fast: PositiveFloat | None = None
    beta_slow: PositiveFloat | None = None
    mscale: PositiveFloat | None = None
    mscale_all_dim: Annotated[float, Field(ge=0, allow_inf_nan=False)] | None = None
    truncate: bool | None = None
    attention_factor: PositiveFloat | None = None
    short_factor: Annotated[list[PositiveFloat], Field(min_length=1, max_length=MAX_DIM // 2)] | None = None
    long_factor: Annotated[list[PositiveFloat], Field(min_length=1, max_length=MAX_DIM // 2)] | None = None

    @model_validator(mode="before")
    @classmethod
    def _rope_type_is_type(cls, data: object) -> object:
        if isinstance(data, dict) and "rope_type" in data:
            if "type" in data:
                raise ValueError("give one of type or rope_type (the same key, two spellings), not both")
            data = {("type" if key == "rope_type" else key): value for key, value in data.items()}
        return data


# The fields each scaling type reads (HF transformers' modeling_rope_utils); `type` aside.
SCALING_FIELDS = {
    "linear": ("factor",),
    "dynamic": ("factor", "original_max_position_embeddings"),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
             "truncate", "attention_factor"),
    "longrope": ("factor", "original_max_position_embeddings", "short_factor", "long_factor", "attention_factor"),
}
SCALING_REQUIRED = {
    "llama3": ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("original_max_position_embeddings",),
    "longrope": ("short_factor", "long_factor", "original_max_position_embeddings"),
}


class RopeSpec(_Model):
    placement: Literal["leading", "trailing", "full", "none"]
    rotary_dim: Dim | None = None
    partial_rotary_factor: Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)] | None = None
    pairing: Literal["half", "interleaved"] = "half"
    theta: PositiveFloat = 10000.0
    scaling: RopeScaling | None = None


class GlobalScale(_Model):
    """Encode multiplier ``G`` and decode multiplier ``Q`` (default ``1/G``), compiled into the kernels."""

    G: Scale = 1.0
    Q: Scale | None = None


# ``cold_page.scales.<buffer>: per_layer``: G and Q of every layer come from a scales file at configure
# time (kvgen.runtime.scales), not from the spec; the kernels read them at run time.
PER_LAYER = "per_layer"


def _scales_kind(value: object) -> str:
    return "[per_layer]" if isinstance(value, str) else "[G, Q]"


# A mapping is a GlobalScale, a string must be per_layer; each error names only its own kind (the
# bracketed tags are dropped from error keys like pydantic's other internal location parts).
BufferScales = Annotated[Union[Annotated[GlobalScale, Tag("[G, Q]")], Annotated[Literal["per_layer"], Tag("[per_layer]")]],
                         Discriminator(_scales_kind)]


class QuantizedRange(_Model):
    start: Annotated[int, Field(ge=0, le=MAX_DIM, strict=True)]
    length: Dim


class ColdPageSpec(_Model):
    rope: Literal["quantized", "lossless", "2fp4"] = "quantized"
    residual_width: Dim | None = None
    quantized_range: QuantizedRange | None = None
    scales: dict[BufferName, BufferScales] = Field(default_factory=dict)


class SideBuffer(_Model):
    name: BufferName
    bytes_per_token: Annotated[int, Field(ge=1, le=1 << 20, strict=True)]


class SlidingWindow(_Model):
    window: Annotated[int, Field(ge=1, le=1 << 24, strict=True)]
    layers: Union[Literal["even", "odd", "all"], list[Annotated[int, Field(ge=0, le=MAX_COUNT, strict=True)]]]


class MLASpec(_Model):
    kv_lora_rank: Dim
    qk_rope_head_dim: Dim


class CSASpec(_Model):
    """DeepSeek-V4 compressed-entry buffer: one entry per ``tokens_per_entry`` tokens."""

    tokens_per_entry: Literal[4] = 4


class TriAttentionSpec(_Model):
    enabled: bool = False
    budget: Annotated[int, Field(ge=1, le=1 << 22, strict=True)] = 2048
    beta: Annotated[int, Field(ge=1, le=1 << 16, strict=True)] = 128
    eviction_mode: Literal["union", "per_head", "per_layer_perhead"] = "union"


class FamilySpec(_Model):
    """One cache family, as written in ``specs/<name>.yaml`` (validated)."""

    name: FamilyName
    model: Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9._/-]+$", max_length=128)] | None = None
    description: Annotated[str, StringConstraints(max_length=2000)] | None = None
    attention: Literal["mha", "gqa", "mqa", "mla", "csa"]
    layers: Count
    query_heads: Heads
    kv_heads: Heads = 1
    head_dim: Dim | None = None
    tokens_per_block: Annotated[int, Field(ge=1, le=1024, strict=True)]
    layout: Literal["HND", "NHD"] = "HND"
    dtype: Literal["bf16", "fp16", "fp8_e4m3"]
    rope: RopeSpec
    cold_page: ColdPageSpec = Field(default_factory=ColdPageSpec)
    side_buffers: list[SideBuffer] = Field(default_factory=list, max_length=8)
    sliding_window: SlidingWindow | None = None
    mla: MLASpec | None = None
    csa: CSASpec | None = None
    triattention: TriAttentionSpec = Field(default_factory=TriAttentionSpec)
    targets: list[Literal["sm_90a", "sm_100a", "sm_100f", "sm_103a", "sm_107a"]] = Field(
        default_factory=lambda: list(DEFAULT_TARGETS), min_length=1
    )

    @model_validator(mode="after")
    def _no_duplicate_targets(self) -> "FamilySpec":
        if len(set(self.targets)) != len(self.targets):
            raise ValueError("targets lists an architecture twice")
        return self

    # ---- derived facts (cheap; kvgen.lower.plan turns them into layouts) ----
    @property
    def row_dim(self) -> int:
        """Width of the quantized buffer's row: K/V head_dim, MLA latent, or the CSA entry."""
        if self.attention == "mla" and self.mla is not None:
            return self.mla.kv_lora_rank + self.mla.qk_rope_head_dim
        return self.head_dim or 0

    @property
    def rotary_dim(self) -> int:
        rope = self.rope
        if rope.placement == "none":
            return 0
        if rope.placement == "full":
            return self.row_dim
        if self.attention == "mla" and self.mla is not None:
            return self.mla.qk_rope_head_dim
        if rope.rotary_dim is not None:
            return rope.rotary_dim
        if rope.partial_rotary_factor is not None:
            return int(round(self.row_dim * rope.partial_rotary_factor))
        return 0

    @property
    def rope_start(self) -> int:
        """Element offset of the rotated span inside the row: ``row_dim - rotary_dim`` for
        ``trailing`` RoPE, 0 otherwise (leading, full, none)."""
        return self.row_dim - self.rotary_dim if self.rope.placement == "trailing" else 0

    @property
    def elem_bytes(self) -> int:
        return ELEM_BYTES[self.dtype]

    @property
    def swa_layers(self) -> frozenset[int]:
        sw = self.sliding_window
        if sw is None:
            return frozenset()
        if sw.layers == "all":
            return frozenset(range(self.layers))
        if sw.layers in ("even", "odd"):
            parity = 0 if sw.layers == "even" else 1
            return frozenset(i for i in range(self.layers) if i % 2 == parity)
        return frozenset(sw.layers)

    def layer_window(self, layer: int) -> int | None:
        """Sliding window of a layer, ``None`` for full attention."""
        if self.sliding_window is not None and layer in self.swa_layers:
            return self.sliding_window.window
        return None

    def scale_for(self, buffer: str) -> tuple[float, float] | None:
        """(G, Q) of a quantized buffer, Q defaulting to 1/G; None for a buffer whose scales are
        per layer (given at configure time)."""
        scale = self.cold_page.scales.get(buffer, GlobalScale())
        if scale == PER_LAYER:
            return None
        return scale.G, scale.Q if scale.Q is not None else 1.0 / scale.G


# ---------------------------------------------------------------- errors


class SpecIssue(BaseModel):
    model_config = ConfigDict(frozen=True)
    line: int
    key: str
    message: str


class SpecError(ValueError):
    """A spec that is not valid; ``str()`` lists every issue as ``file:line: key: message``."""

    def __init__(self, path: str, issues: list[SpecIssue]):
        self.path = path
        self.issues = issues
        super().__init__("\n".join(f"{path}:{i.line}: {i.key}: {i.message}" for i in issues))


def _key_text(path: KeyPath) -> str:
    text = ""
    for part in path:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text or "(top level)"


def _accepted_keys(model: type[BaseModel]) -> str:
    return ", ".join(model.model_fields)


def _model_at(path: KeyPath) -> type[BaseModel] | None:
    """The pydantic model that owns the mapping at ``path`` (for 'accepted keys' hints)."""
    model: type[BaseModel] | None = FamilySpec
    for part in path:
        if model is None or isinstance(part, int):
            continue
        field = model.model_fields.get(part)
        if field is None:
            return None
        model = _first_model(field.annotation)
    return model


def _first_model(annotation) -> type[BaseModel] | None:  # noqa: ANN001 - typing objects
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()) or ():
        found = _first_model(arg)
        if found is not None:
            return found
    return None


def _pydantic_issues(exc: ValidationError, doc: LocatedDoc) -> list[SpecIssue]:
    issues = []
    for err in exc.errors(include_url=False):
        loc = tuple(p for p in err["loc"] if not (isinstance(p, str) and ("[" in p or p.startswith("function-"))))
        message = err["msg"]
        if err["type"] == "extra_forbidden":
            owner = _model_at(loc[:-1])
            message = "unknown key" + (f"; accepted keys: {_accepted_keys(owner)}" if owner else "")
        elif err["type"] == "string_pattern_mismatch":
            message = f"{message} (lowercase letters and digits, words joined by '-', '_' or '.')"
        issues.append(SpecIssue(line=doc.line_of(loc), key=_key_text(loc), message=message))
    return _dedupe(issues)


def _dedupe(issues: list[SpecIssue]) -> list[SpecIssue]:
    seen: dict[tuple[int, str, str], SpecIssue] = {}
    for issue in issues:
        seen.setdefault((issue.line, issue.key, issue.message), issue)
    return list(seen.values())


# ---------------------------------------------------------------- semantic rules


def _semantic_errors(spec: FamilySpec) -> list[tuple[KeyPath, str]]:
    """Rules that need several fields at once; each error names the key to change."""
    errors: list[tuple[KeyPath, str]] = []
    errors += _attention_errors(spec)
    if errors:
        return errors  # later rules assume a coherent geometry
    errors += _rope_errors(spec)
    if errors:
        return errors
    errors += _cold_page_errors(spec)
    errors += _size_errors(spec)
    errors += _layer_errors(spec)
    errors += _triattention_errors(spec)
    return errors


def _attention_errors(spec: FamilySpec) -> list[tuple[KeyPath, str]]:
    errors: list[tuple[KeyPath, str]] = []
    kind = spec.attention
    if kind == "mla":
        if spec.mla is None:
            return [(("attention",), "attention: mla needs an 'mla' block with kv_lora_rank and qk_rope_head_dim")]
        if spec.head_dim is not None and spec.head_dim != spec.row_dim:
            errors.append((("head_dim",), f"MLA latent rows are kv_lora_rank + qk_rope_head_dim = {spec.row_dim}, "
                                          f"not {spec.head_dim}; remove head_dim or set it to {spec.row_dim}"))
    elif spec.mla is not None:
        errors.append((("mla",), "an 'mla' block is only accepted with attention: mla"))
    if kind == "csa":
        if spec.head_dim != 512:
            errors.append((("head_dim",), "DeepSeek-V4 CSA entries are 512 wide; set head_dim: 512"))
        if spec.tokens_per_block % 4:
            errors.append((("tokens_per_block",), "CSA stores one compressed entry per 4 tokens; "
                                                  "tokens_per_block must be a multiple of 4"))
    elif spec.csa is not None:
        errors.append((("csa",), "a 'csa' block is only accepted with attention: csa"))
    if kind not in ("mla",) and spec.head_dim is None:
        errors.append((("head_dim",), "head_dim is required for attention kinds other than mla"))
    if kind in ("mla", "csa", "mqa") and spec.kv_heads != 1:
        errors.append((("kv_heads",), f"attention: {kind} has exactly one KV head (or latent); set kv_heads: 1"))
    if kind == "mha" and spec.kv_heads != spec.query_heads:
        errors.append((("kv_heads",), f"mha needs kv_heads == query_heads ({spec.query_heads}); use gqa otherwise"))
    if kind == "gqa" and (spec.kv_heads >= spec.query_heads or spec.query_heads % spec.kv_heads):
        errors.append((("kv_heads",), f"gqa needs kv_heads < query_heads and query_heads % kv_heads == 0 "
                                      f"(query_heads {spec.query_heads}, kv_heads {spec.kv_heads})"))
    if spec.row_dim % 16:
        key = ("mla", "kv_lora_rank") if kind == "mla" else ("head_dim",)
        errors.append((key, f"row width {spec.row_dim} is not a multiple of 16 (NVFP4 scale groups are 16 wide)"))
    return errors


def _rope_errors(spec: FamilySpec) -> list[tuple[KeyPath, str]]:
    rope = spec.rope
    errors: list[tuple[KeyPath, str]] = []
    given = [k for k in ("rotary_dim", "partial_rotary_factor") if getattr(rope, k) is not None]
    if rope.placement in ("none", "full") and given:
        errors.append((("rope", given[0]), f"placement {rope.placement} fixes the rotated width; remove {given[0]}"))
    if rope.placement in ("leading", "trailing"):
        if spec.attention == "mla":
            if rope.placement != "trailing" or given:
                errors.append((("rope", "placement"), "MLA RoPE is the trailing qk_rope_head_dim of the latent row; "
                                                      "use placement: trailing without rotary_dim"))
        elif len(given) != 1:
            errors.append((("rope", "placement"), f"placement {rope.placement} needs exactly one of rotary_dim or "
                                                  "partial_rotary_factor"))
        else:
            width = spec.row_dim * (rope.partial_rotary_factor or 0)
            if rope.partial_rotary_factor is not None and not math.isclose(width, round(width)):
                errors.append((("rope", "partial_rotary_factor"), f"row {spec.row_dim} × factor is not a whole width"))
    if errors:
        return errors
    rotary = spec.rotary_dim
    if rope.placement != "none" and (rotary % 2 or rotary <= 0 or rotary > spec.row_dim):
        errors.append((("rope",), f"rotated width {rotary} must be even and in 1..{spec.row_dim}"))
    if rope.scaling is not None:
        errors += _scaling_errors(spec, rope.scaling)
    return errors


def _scaling_errors(spec: FamilySpec, scaling: RopeScaling) -> list[tuple[KeyPath, str]]:
    """Required and unused fields of the scaling type; LongRoPE factors, one per rotated pair."""
    kind = scaling.type
    missing = [k for k in SCALING_REQUIRED.get(kind, ()) if getattr(scaling, k) is None]
    if missing:
        return [(("rope", "scaling"), f"{kind} scaling needs {', '.join(missing)}")]
    unused = sorted(set(scaling.model_fields_set) - {"type", *SCALING_FIELDS[kind]})
    if unused:
        return [(("rope", "scaling", unused[0]), f"{kind} scaling does not use {unused[0]}; "
                                                 f"accepted: {', '.join(SCALING_FIELDS[kind])}")]
    errors: list[tuple[KeyPath, str]] = []
    for key in ("short_factor", "long_factor"):
        factors = getattr(scaling, key)
        if factors is not None and len(factors) != spec.rotary_dim // 2:
            errors.append((("rope", "scaling", key), f"{len(factors)} factors; the rotated width "
                                                     f"{spec.rotary_dim} has {spec.rotary_dim // 2} pairs"))
    if kind == "dynamic" and spec.triattention.enabled:
        errors.append((("rope", "scaling", "type"), "dynamic NTK scaling changes the frequencies with the "
                                                    "sequence length, which TriAttention's fixed calibration "
                                                    "cannot follow; set triattention.enabled: false"))
    return errors


def _cold_page_errors(spec: FamilySpec) -> list[tuple[KeyPath, str]]:
    """COLD_PAGE_FORMAT.md §5: one quantized run, spans in multiples of 16."""
    cold = spec.cold_page
    rope = spec.rope
    errors: list[tuple[KeyPath, str]] = []
    rotary = spec.rotary_dim
    if cold.rope != "quantized":
        if rope.placement == "none":
            errors.append((("cold_page", "rope"), f"rope: {cold.rope} needs a RoPE span; this family has none "
                                                  "(accepted: quantized)"))
        elif rotary % 16:
            errors.append((("cold_page", "rope"), f"the RoPE span ({rotary}) is not a multiple of 16, so it cannot "
                                                  "be its own span; accepted: quantized"))
        elif cold.rope == "lossless" and rope.placement == "full":
            errors.append((("cold_page", "rope"), "RoPE covers the whole row; lossless would leave nothing to "
                                                  "quantize (accepted: quantized, 2fp4)"))
    if cold.residual_width is not None:
        if cold.rope != "2fp4":
            errors.append((("cold_page", "residual_width"), "residual_width is only accepted with rope: 2fp4"))
        elif cold.residual_width % 16 or cold.residual_width > spec.row_dim:
            errors.append((("cold_page", "residual_width"), f"residual_width must be a multiple of 16 and at most "
                                                            f"the row ({spec.row_dim})"))
    allowed = set(_quantized_buffer_names(spec))
    for name in cold.scales:
        if name not in allowed:
            errors.append((("cold_page", "scales", name), f"no quantized buffer named {name!r}; "
                                                           f"accepted: {', '.join(sorted(allowed))}"))
    if not errors and cold.quantized_range is not None:
        errors += _check_quantized_range(spec)
    names = [s.name for s in spec.side_buffers]
    for i, name in enumerate(names):
        if name in names[:i] or name in allowed:
            errors.append((("side_buffers", i, "name"), f"buffer name {name!r} is used twice"))
    return errors


def hot_page_bound(spec: FamilySpec) -> int:
    """An upper bound of one layer's hot page in bytes (CSA stores fewer rows than this counts)."""
    rows = spec.kv_heads * spec.tokens_per_block
    quantized = len(_quantized_buffer_names(spec)) * rows * spec.row_dim * spec.elem_bytes
    return quantized + sum(s.bytes_per_token for s in spec.side_buffers) * spec.tokens_per_block


def _size_errors(spec: FamilySpec) -> list[tuple[KeyPath, str]]:
    size = hot_page_bound(spec)
    if size <= MAX_PAGE_BYTES:
        return []
    return [(("tokens_per_block",), f"one layer's page holds {size} bytes (kv_heads x tokens_per_block x row x "
                                    f"dtype, plus side buffers); at most {MAX_PAGE_BYTES} are accepted")]


def _check_quantized_range(spec: FamilySpec) -> list[tuple[KeyPath, str]]:
    # The span arithmetic is the format's (kvgen.reference.layout); the spec only cross-checks it.
    prefix, q, _, _, _ = row_spans(spec.row_dim, spec.rotary_dim, spec.rope.placement, spec.cold_page.rope,
                                   spec.cold_page.residual_width)
    given = spec.cold_page.quantized_range
    if given.start % 16 or given.length % 16:
        return [(("cold_page", "quantized_range"), "start and length must be multiples of 16")]
    if (given.start, given.length) != (prefix, q):
        return [(("cold_page", "quantized_range"), f"start {given.start}, length {given.length} disagrees with the "
                                                   f"RoPE policy, which quantizes start {prefix}, "
                                                   f"length {q}")]
    return []


def _layer_errors(spec: FamilySpec) -> list[tuple[KeyPath, str]]:
    sw = spec.sliding_window
    if sw is None or not isinstance(sw.layers, list):
        return []
    bad = [i for i in sw.layers if i >= spec.layers]
    if bad:
        return [(("sliding_window", "layers"), f"layer {bad[0]} does not exist (layers 0..{spec.layers - 1})")]
    if len(set(sw.layers)) != len(sw.layers):
        return [(("sliding_window", "layers"), "a layer is listed twice")]
    return []


def _triattention_errors(spec: FamilySpec) -> list[tuple[KeyPath, str]]:
    tri = spec.triattention
    if not tri.enabled:
        return []
    reason = refusal_reason(spec.attention, rope_placement=spec.rope.placement,
                            scored_layers=spec.layers - len(spec.swa_layers), dtype=spec.dtype)
    if reason is not None:
        return [(("triattention", "enabled"), f"{reason}; set enabled: false")]
    if spec.sliding_window is not None and tri.budget < spec.sliding_window.window:
        return [(("triattention", "budget"), f"budget {tri.budget} is below the sliding window "
                                             f"{spec.sliding_window.window}; SWA layers keep the whole window")]
    return []


def _quantized_buffer_names(spec: FamilySpec) -> tuple[str, ...]:
    return {"mla": ("latent",), "csa": ("entry",)}.get(spec.attention, ("k", "v"))


quantized_buffer_names = _quantized_buffer_names


# ---------------------------------------------------------------- a set of specs


def c_identifier(name: str) -> str:
    """A family name as C symbols and artifact file names spell it: '-' and '.' become '_'."""
    return "".join(c if c.isalnum() else "_" for c in name)


def name_collisions(specs: Sequence[tuple[str | Path, FamilySpec]]) -> list[SpecError]:
    """One error per spec whose name spells the same C identifier as an earlier one's
    (``coll-a`` and ``coll_a`` would build one ``libkvgen_coll_a.so``), naming both files."""
    first: dict[str, tuple[str | Path, FamilySpec]] = {}
    errors = []
    for path, spec in specs:
        ident = c_identifier(spec.name)
        if ident in first:
            other_path, other = first[ident]
            errors.append(SpecError(str(path), [SpecIssue(line=1, key="name", message=(
                f"family {spec.name!r} collides with {other.name!r} in {other_path}: both are kvgen_{ident} in C "
                "symbols and artifact names; rename one"))]))
        else:
            first[ident] = (path, spec)
    return errors


# ---------------------------------------------------------------- entry points


def parse_spec(text: str, path: str = "<spec>") -> FamilySpec:
    """Parse and validate spec text; every problem becomes one ``SpecError``."""
    try:
        doc = load_located(text)
    except YamlShapeError as exc:
        raise SpecError(path, [SpecIssue(line=exc.line, key="(file)", message=exc.message)]) from None
    try:
        spec = FamilySpec.model_validate(doc.data)
    except ValidationError as exc:
        raise SpecError(path, _pydantic_issues(exc, doc)) from None
    problems = _semantic_errors(spec)
    if problems:
        issues = [SpecIssue(line=doc.line_of(key), key=_key_text(key), message=msg) for key, msg in problems]
        raise SpecError(path, issues)
    return spec


def load_spec(path: str | Path) -> FamilySpec:
    """Load ``specs/<family>.yaml``; the file name must match the spec's ``name``."""
    path = Path(path)
    try:
        text = read_text(path)
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecError(str(path), [SpecIssue(line=1, key="(file)", message=f"cannot read: {exc}")]) from None
    except YamlShapeError as exc:
        raise SpecError(str(path), [SpecIssue(line=exc.line, key="(file)", message=exc.message)]) from None
    spec = parse_spec(text, str(path))
    if path.suffix in (".yaml", ".yml") and path.stem != spec.name:
        line = load_located(text).line_of(("name",))
        raise SpecError(str(path), [SpecIssue(line=line, key="name", message=f"name {spec.name!r} must match the "
                                                                             f"file name {path.stem!r}")])
    return spec
