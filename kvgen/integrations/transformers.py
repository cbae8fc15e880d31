"""kvgen caches for Hugging Face transformers' ``model.generate(past_key_values=...)``.

Two ``transformers.Cache`` classes for Llama/Qwen3-style models (full attention in every layer,
RoPE on the leading elements with ``rotate_half`` pairing), both built from a registry family:

- ``KvgenOffloadedCache``: K/V live in a paged GPU pool in the family's layout (HND or NHD pages
  of ``tokens_per_block`` tokens). ``offload()`` moves the cache's pages through the family's
  cold-page codec to pinned host memory (the staged path where the library has it); the next
  forward brings them back, decoded, before any layer reads them.
- ``KvgenTriAttentionCache``: the same pool; every ``beta`` generated tokens past the budget, one
  TriAttention round (``kvgen.runtime.eviction.TriAttentionManager``: the generated scorer,
  selection, packer and compactor from the registry) compacts it in place.

Both read the family from the registry manifest (no spec, no pydantic) and refuse, before
allocating anything, a model whose config the family does not describe (``ModelMismatch``).

How the pages meet transformers' ``[B, H, T, D]`` tensors: batch row ``b`` owns pages
``b * pages_per_row ...`` (``page_table``); token ``t`` of a row sits in page
``page_table[b, t // tokens_per_block]`` at slot ``t % tokens_per_block``. ``update`` writes the
step's tokens there and returns the row's tokens gathered back to ``[B, H, T, D]``, contiguous.
The cache counts two lengths: ``seen`` (tokens the model has processed: positions, what
``get_seq_length`` returns) and ``length`` (tokens physically cached, smaller after eviction;
``get_mask_sizes`` returns it, with the evicted count as the offset, as a sliding-window layer does).
Rows share one length: batches must not be padded (TriAttention keeps every row's prompt).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

try:
    from transformers.cache_utils import Cache, CacheLayerMixin
except ImportError as exc:  # the optional extra
    raise ImportError("kvgen.integrations.transformers needs transformers: pip install 'kvgen[hf]'") from exc

from kvgen.reference.layout import BufferSchema, LayerRecord, Region, SideSchema
from kvgen.reference.triattention import EvictionConfig, GeometryError, TriGeometry, is_due
from kvgen.runtime.eviction import GenerationStep, TriAttentionManager, registry_config
from kvgen.runtime.lookup import RegistryLayout, RuntimeRegistry
from kvgen.runtime.score import TORCH_DTYPES


class ModelMismatch(ValueError):
    """A model the family's spec does not describe; the message lists every difference."""


# ----------------------------------------------------------------------------------------------
# What the model is, and whether the family describes it
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ModelGeometry:
    """The attention geometry of a transformers config (its text/decoder part)."""

    model_type: str
    layers: int
    query_heads: int
    kv_heads: int
    head_dim: int
    rotary_dim: int
    rope_theta: float | None
    rope_parameters: Mapping[str, Any]
    layer_types: tuple[str, ...]


def model_geometry(config: Any) -> ModelGeometry:
    """Read a ``PretrainedConfig``: heads, head_dim (explicit, else hidden / heads), RoPE
    (``rope_parameters`` of transformers 5, ``partial_rotary_factor`` included), layer types."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    heads = int(text.num_attention_heads)
    head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // heads)
    rope = dict(getattr(text, "rope_parameters", None) or {})
    factor = float(rope.get("partial_rotary_factor", getattr(text, "partial_rotary_factor", 1.0)) or 1.0)
    theta = rope.get("rope_theta", getattr(text, "rope_theta", None))
    layers = int(text.num_hidden_layers)
    return ModelGeometry(
        model_type=str(getattr(text, "model_type", type(text).__name__)), layers=layers, query_heads=heads,
        kv_heads=int(getattr(text, "num_key_value_heads", None) or heads), head_dim=head_dim,
        rotary_dim=int(head_dim * factor), rope_theta=None if theta is None else float(theta), rope_parameters=rope,
        layer_types=tuple(getattr(text, "layer_types", None) or ["full_attention"] * layers))


def _scaling_problems(model: ModelGeometry, scaling: Mapping[str, Any] | None) -> list[str]:
    rope_type = model.rope_parameters.get("rope_type", model.rope_parameters.get("type", "default"))
    if scaling is None:
        return [] if rope_type == "default" else [f"rope_type {rope_type!r}, the family has no RoPE scaling"]
    family_type = scaling.get("rope_type", scaling.get("type"))
    if rope_type != family_type:
        return [f"rope_type {rope_type!r}, the family's scaling is {family_type!r}"]
    return [f"rope {key} {model.rope_parameters.get(key)!r}, family {value!r}" for key, value in scaling.items()
            if key not in ("rope_type", "type") and model.rope_parameters.get(key) != value]


def check_model(config: Any, family: EvictionConfig) -> ModelGeometry:
    """The model's geometry, or ``ModelMismatch`` naming the family and every difference."""
    model = model_geometry(config)
    g = family.geometry
    wanted = {"num_hidden_layers": (model.layers, g.num_layers), "num_attention_heads": (model.query_heads,
              g.query_heads), "num_key_value_heads": (model.kv_heads, g.kv_heads), "head_dim": (model.head_dim,
              g.head_dim), "rotary dim (head_dim * partial_rotary_factor)": (model.rotary_dim, g.rotary_dim)}
    problems = [f"{name} {mine}, family {theirs}" for name, (mine, theirs) in wanted.items() if mine != theirs]
    others = sorted({t for t in model.layer_types if t != "full_attention"})
    if others or any(w is not None for w in g.swa_window):
        problems.append(f"layer types {others or ['full_attention']} with family windows "
                        f"{sorted({w for w in g.swa_window if w is not None}) or 'none'}: these caches serve "
                        "full attention in every layer")
    if g.rotary_start != 0 or g.pairing != "half":
        problems.append(f"the family rotates [{g.rotary_start}, {g.rotary_start + g.rotary_dim}) with "
                        f"{g.pairing} pairing; transformers' rotate_half rotates the leading elements, half pairing")
    if model.rope_theta is None or not math.isclose(model.rope_theta, family.rope_theta, rel_tol=1e-9):
        problems.append(f"rope_theta {model.rope_theta}, family {family.rope_theta}")
    problems += _scaling_problems(model, family.rope_scaling)
    if problems:
        raise ModelMismatch(f"{model.model_type} config does not match kvgen family {family.family}: "
                            f"{'; '.join(problems)}. Use the family whose spec describes this model "
                            "(kvgen spec from-config config.json drafts one)")
    return model


def family_config(resolved: Any) -> EvictionConfig:
    """The family's geometry from its manifest entry; a family without one (MLA, CSA, an older
    build) is refused, naming why."""
    try:
        return registry_config(resolved)
    except GeometryError as exc:
        raise ModelMismatch(f"{exc}; kvgen's transformers caches need a family with per-head K/V pages") from None


# ----------------------------------------------------------------------------------------------
# [B, H, T, D] <-> pages of the family's layout
# ----------------------------------------------------------------------------------------------

def token_index(page_table: torch.Tensor, start: int, count: int, kv_heads: int, tokens_per_block: int,
                layout: str) -> tuple[torch.Tensor, ...]:
    """Advanced indices into a pool ``[pages, *page]`` selecting tokens ``start .. start+count-1`` of
    every row as ``[B, H, count]``: ``pool[index]`` is ``[B, H, count, D]``."""
    device = page_table.device
    positions = torch.arange(start, start + count, device=device)
    pages = page_table[:, positions // tokens_per_block].long()[:, None, :]          # [B, 1, T]
    slots = (positions % tokens_per_block)[None, None, :]                          # [1, 1, T]
    heads = torch.arange(kv_heads, device=device)[None, :, None]                   # [1, H, 1]
    return (pages, heads, slots) if layout == "HND" else (pages, slots, heads)


@dataclass
class PagedKV:
    """K and V pools of every layer (``[pages, *page_shape]`` of the family's layout and hot dtype);
    row ``b`` owns pages ``b * pages_per_row ...`` in order (``page_table``, int32 on the device)."""

    geometry: TriGeometry
    batch: int
    capacity: int
    dtype: torch.dtype
    device: torch.device
    k: list[torch.Tensor] = field(init=False)
    v: list[torch.Tensor] = field(init=False)
    page_table: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        g = self.geometry
        self.pages_per_row = -(-self.capacity // g.tokens_per_block)
        pages = self.batch * self.pages_per_row
        self.k = [torch.zeros((pages, *g.page_shape), dtype=self.dtype, device=self.device)
                  for _ in range(g.num_layers)]
        self.v = [torch.zeros_like(pool) for pool in self.k]
        self.page_table = torch.arange(pages, dtype=torch.int32, device=self.device).view(self.batch, -1)

    @property
    def tokens(self) -> int:
        """Tokens a row can hold."""
        return self.pages_per_row * self.geometry.tokens_per_block

    def _index(self, start: int, count: int) -> tuple[torch.Tensor, ...]:
        g = self.geometry
        return token_index(self.page_table, start, count, g.kv_heads, g.tokens_per_block, g.layout)

    def step_index(self, start: int, count: int) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        """(write, read) indices of a forward adding ``count`` tokens at ``start``: the same for every
        layer, so computed once per step."""
        if start + count > self.tokens:
            raise ValueError(f"kvgen cache full: {start + count} tokens per row, max_cache_len gives {self.tokens} "
                             "(pass a larger max_cache_len)")
        return self._index(start, count), self._index(0, start + count)

    def write(self, layer: int, key: torch.Tensor, value: torch.Tensor, start: int,
              index: tuple[torch.Tensor, ...] | None = None) -> None:
        """Tokens ``start ..`` of every row from ``[B, H, t, D]`` K and V."""
        index = index or self.step_index(start, key.shape[2])[0]
        self.k[layer][index] = key
        self.v[layer][index] = value

    def read(self, layer: int, length: int,
             index: tuple[torch.Tensor, ...] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens ``0 .. length-1`` of every row as contiguous ``[B, H, length, D]`` K and V."""
        index = index or self._index(0, length)
        return self.k[layer][index], self.v[layer][index]

    def used_pages(self, length: int) -> torch.Tensor:
        """int32 ids of the pages holding tokens ``0 .. length-1`` of every row (row-major)."""
        return self.page_table[:, : -(-length // self.geometry.tokens_per_block)].reshape(-1)

    def nbytes(self) -> int:
        return sum(pool.numel() * pool.element_size() for pool in self.k + self.v)


def reference_record(layout: RegistryLayout) -> LayerRecord:
    """The oracle's ``LayerRecord`` of a registry layout (manifest JSON), for checking cold pages
    against ``kvgen.reference.codec`` without the spec."""
    buffers = tuple(BufferSchema(**{k: b[k] for k in BufferSchema.__dataclass_fields__}) for b in layout.buffers)
    sides = tuple(SideSchema(s["name"], s["bytes"]) for s in layout.sides)
    regions = tuple(Region(r["buffer"], r["kind"], r["offset"], r["size"]) for r in layout.regions)
    return LayerRecord(buffers, sides, regions, layout.record_bytes)


# ----------------------------------------------------------------------------------------------
# The Cache
# ----------------------------------------------------------------------------------------------

class _PagedLayer(CacheLayerMixin):
    """What transformers asks of one layer, answered by the owning cache (one store for all layers:
    the codec and the eviction round work on every layer at once)."""

    is_sliding = False
    is_croppable = False
    supports_early_init = False   # the pools are sized by the first forward (its K and the prompt)

    def __init__(self, owner: _PagedCache):
        super().__init__()
        self.owner = owner

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        raise TypeError("kvgen caches allocate their pools at the first forward, not ahead of it")

    def update(self, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        raise TypeError("kvgen caches update through Cache.update(key, value, layer_idx)")

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.length + query_length, self.owner.seen - self.owner.length

    def get_seq_length(self) -> int:
        return self.owner.seen

    def get_max_length(self) -> int:
        return -1

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("kvgen caches do not reorder rows (beam search): use greedy or sampling")

    def reset(self) -> None:
        raise NotImplementedError("kvgen caches are not reset: make a new one per conversation")


class _PagedCache(Cache):
    """The paged store behind both caches; ``_begin_step`` / ``_end_step`` are the subclasses' hooks
    (called at layer 0 before a forward writes, and after the last layer wrote)."""

    def __init__(self, model_config: Any, family: str, *, registry: Any = None, arch: str | None = None,
                 max_cache_len: int = 4096):
        if not isinstance(max_cache_len, int) or max_cache_len <= 0:
            raise ValueError(f"max_cache_len: expected a positive int, got {max_cache_len!r}")
        self.registry = registry if registry is not None else RuntimeRegistry.default()
        self.resolved = self.registry.resolve(family, arch)
        self.family = family_config(self.resolved)
        self.model = check_model(model_config, self.family)
        self.geometry = self.family.geometry
        self.capacity = max_cache_len
        self.store: PagedKV | None = None
        self.length = 0   # tokens physically cached per row
        self.seen = 0     # tokens processed per row (positions)
        self._index: tuple = ()   # this forward's (write, read) token indices, made at layer 0
        super().__init__(layers=[_PagedLayer(self) for _ in range(self.geometry.num_layers)])

    def allocate(self, key_states: torch.Tensor) -> None:
        """The pools, sized by the first K: the family's hot dtype and [B, kv_heads, T, head_dim]."""
        g, dtype = self.geometry, TORCH_DTYPES[self.family.dtype]
        if key_states.dtype != dtype:
            raise ModelMismatch(f"K/V dtype {key_states.dtype}, family {self.family.family} keeps "
                                f"{self.family.dtype} pages (load the model with dtype={dtype})")
        if key_states.dim() != 4 or tuple(key_states.shape[1::2]) != (g.kv_heads, g.head_dim):
            raise ModelMismatch(f"K of shape {list(key_states.shape)}, family {self.family.family} expects "
                                f"[batch, {g.kv_heads}, tokens, {g.head_dim}]")
        self.store = PagedKV(g, key_states.shape[0], self.capacity, dtype, key_states.device)
        for layer in self.layers:
            layer.is_initialized = True

    @property
    def is_initialized(self) -> bool:
        return self.store is not None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if self.store is None:
            self.allocate(key_states)
        if key_states.shape[0] != self.store.batch:
            raise ValueError(f"batch of {key_states.shape[0]} rows, this cache holds {self.store.batch}")
        count = key_states.shape[2]
        if layer_idx == 0:
            self._begin_step(count)
            self._index = self.store.step_index(self.length, count)
        write, read = self._index
        self.store.write(layer_idx, key_states, value_states, self.length, write)
        keys, values = self.store.read(layer_idx, self.length + count, read)
        if layer_idx == self.geometry.num_layers - 1:
            first = self.seen == 0
            self.length += count
            self.seen += count
            self._end_step(first)
        return keys, values

    def _begin_step(self, count: int) -> None:
        """Before layer 0 writes ``count`` new tokens of a forward."""

    def _end_step(self, prefill: bool) -> None:
        """After the last layer wrote; ``prefill``: this was the cache's first forward."""

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("kvgen caches are not cropped (assisted decoding rolls back tokens)")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("kvgen caches do not repeat rows (num_return_sequences, beams)")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError("kvgen caches do not select rows")

    def cached_bytes(self) -> int:
        """Bytes of K/V the rows hold now (physical tokens, every layer)."""
        g = self.geometry
        batch = self.store.batch if self.store else 0
        itemsize = TORCH_DTYPES[self.family.dtype].itemsize
        return 2 * g.num_layers * batch * self.length * g.kv_heads * g.head_dim * itemsize


# ----------------------------------------------------------------------------------------------
# Offloading
# ----------------------------------------------------------------------------------------------

class KvgenOffloadedCache(_PagedCache):
    """Paged GPU cache whose pages leave for pinned host memory through the family's cold-page codec.

    ``offload()`` encodes every page holding tokens into ``cold`` (pinned host, one slot per hot
    page) by the codec's strategy ("staged" where the library has C ABI 2), then the pages are
    free; the next forward (``generate`` continuing with this cache) decodes them back into the
    same hot pages before layer 0 reads anything. ``onboard()`` does that ahead of time.

    ``codec_factory(layout, pools)`` replaces the registry's ``ColdPageCodec`` (tests pass the
    oracle's codec on the CPU); ``pools[layer] = [K, V]``."""

    def __init__(self, model_config: Any, family: str, *, registry: Any = None, arch: str | None = None,
                 max_cache_len: int = 4096, strategy: str | None = None,
                 codec_factory: Callable[[RegistryLayout, list], Any] | None = None):
        super().__init__(model_config, family, registry=registry, arch=arch, max_cache_len=max_cache_len)
        self.codec_factory = codec_factory or self._registry_codec
        layout = self.resolved.layout()
        names = [b["name"] for b in layout.buffers]
        if names != ["k", "v"] or layout.sides or len(layout.lifecycles) != 1:
            raise ModelMismatch(f"{family}: cold pages of buffers {names}, {len(layout.sides)} side buffers and "
                                f"{len(layout.lifecycles)} lifecycles; this cache moves K and V pages of one lifecycle")
        self.layout = layout
        self.strategy = strategy
        self.codec = None
        self.cold: torch.Tensor | None = None
        self.offloaded: torch.Tensor | None = None   # int32 page ids now in cold storage (None: all hot)

    def _registry_codec(self, layout: RegistryLayout, pools: list) -> Any:
        from kvgen.runtime.codec import ColdPageCodec  # needs a GPU: imported when a codec is made

        return ColdPageCodec(self.registry.load(self.family.family, self.resolved.arch), layout, pools)

    def allocate(self, key_states: torch.Tensor) -> None:
        super().allocate(key_states)
        self.codec = self.codec_factory(self.layout, [[k, v] for k, v in zip(self.store.k, self.store.v)])
        if self.strategy is not None:
            self.codec.set_offload_strategy(self.strategy)

    def _pairs(self, pages: torch.Tensor) -> torch.Tensor:
        """(cold slot, hot page) = (page, page): each hot page has its own slot."""
        return torch.stack([pages, pages], dim=1).to(device="cpu", dtype=torch.int32).contiguous()

    def offload(self) -> int:
        """Encode every page holding tokens to pinned host memory; returns the cold bytes written.
        Enqueued on the current stream (synchronize it to time the transfer)."""
        if self.store is None or self.offloaded is not None:
            return 0
        if self.cold is None:
            # Pinned wherever a GPU is (the codec refuses pageable memory); plain on a CPU-only host (stand-ins).
            self.cold = torch.empty((self.store.batch * self.store.pages_per_row, self.codec.cold_page_bytes()),
                                    dtype=torch.uint8, pin_memory=torch.cuda.is_available())
        pages = self.store.used_pages(self.length)
        self.codec.offload(self.cold, self._pairs(pages))
        self.offloaded = pages
        return pages.numel() * self.codec.cold_page_bytes()

    def onboard(self) -> None:
        """Decode the offloaded pages back into their hot pages (enqueued before anything reads them)."""
        if self.offloaded is None:
            return
        self.codec.onboard(self.cold, self._pairs(self.offloaded))
        self.offloaded = None

    def _begin_step(self, count: int) -> None:
        self.onboard()

    def describe(self) -> dict[str, Any]:
        return {"family": self.family.family, "arch": self.resolved.arch, "pool_bytes": self.store.nbytes()
                if self.store else 0, "cold_page_bytes": self.layout.cold_page_bytes(),
                "offload": self.codec.describe_offload() if self.codec else None}


# ----------------------------------------------------------------------------------------------
# TriAttention
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Row:
    request_id: int
    prompt_len: int


@dataclass(frozen=True)
class RoundRecord:
    """One eviction round: at ``seen`` tokens, ``before`` -> ``after`` physical tokens per row."""

    seen: int
    before: int
    after: int
    kept: torch.Tensor | None


ManagerFactory = Callable[..., TriAttentionManager]


class KvgenTriAttentionCache(_PagedCache):
    """Paged GPU cache compacted by TriAttention rounds.

    ``calibration``: a statistics file in either form ``kvgen.reference`` loads (the flat
    ``{E_q, E_q_norm, omega, freq_scale_sq}`` or the upstream stats file). The first forward's
    tokens are the prompt (never evicted); once ``budget`` generated tokens are cached, every
    ``beta`` more run one round that keeps ``budget`` of them. ``max_cache_len`` must hold the
    physical peak: prompt + budget + beta tokens.

    ``on_round(cache)`` is called right before each round (the proof snapshots the pools there);
    ``rounds`` records every round. ``manager_factory`` replaces
    ``TriAttentionManager.from_registry`` (same arguments; tests pass CPU stand-ins)."""

    def __init__(self, model_config: Any, family: str, calibration: str | Path, *, registry: Any = None,
                 arch: str | None = None, max_cache_len: int = 4096, budget: int | None = None,
                 beta: int | None = None, eviction_mode: str | None = None,
                 manager_factory: ManagerFactory | None = None, on_round: Callable[[Any], None] | None = None):
        super().__init__(model_config, family, registry=registry, arch=arch, max_cache_len=max_cache_len)
        self.calibration = Path(calibration)
        self.overrides = {k: v for k, v in {"budget": budget, "beta": beta, "eviction_mode": eviction_mode}.items()
                          if v is not None}
        self.manager_factory = manager_factory or TriAttentionManager.from_registry
        self.on_round = on_round
        self.manager: TriAttentionManager | None = None
        self.prompt_len = 0
        self.rounds: list[RoundRecord] = []

    def allocate(self, key_states: torch.Tensor) -> None:
        super().allocate(key_states)
        self.manager = self.manager_factory(self.resolved, self.calibration, self.store.k, self.store.v,
                                            **self.overrides)
        self.prompt_len = key_states.shape[2]
        peak = self.prompt_len + self.manager.budget + self.manager.beta
        if peak > self.store.tokens:
            raise ValueError(f"max_cache_len {self.capacity}: a row peaks at prompt {self.prompt_len} + budget "
                             f"{self.manager.budget} + beta {self.manager.beta} = {peak} tokens")
        for row in range(self.store.batch):
            self.manager.on_request_init(_Row(row, self.prompt_len))

    def _due(self) -> bool:
        """The manager's cadence rule, asked before its hook so ``on_round`` sees the pools as the
        round will (rows share prompt and length, so row 0 decides for all)."""
        state = self.manager.requests[0]
        return is_due(state.prompt_len, self.length, state.evicted, self.length + state.evicted,
                      self.manager.budget, self.manager.beta)

    def _end_step(self, prefill: bool) -> None:
        if prefill or not self._due():
            return
        if self.on_round is not None:
            self.on_round(self)
        before = self.length
        step = GenerationStep(list(range(self.store.batch)), self.store.page_table, [self.length] * self.store.batch)
        report = self.manager.on_generation_step_end(step)
        self.length = report.lengths[0]
        self.rounds.append(RoundRecord(self.seen, before, self.length, report.kept))

    def evicted_bytes(self) -> int:
        """K/V bytes the rounds freed against a cache that keeps every token (``DynamicCache``)."""
        g = self.geometry
        per_token = 2 * g.num_layers * g.kv_heads * g.head_dim * TORCH_DTYPES[self.family.dtype].itemsize
        return (self.seen - self.length) * per_token * (self.store.batch if self.store else 0)
