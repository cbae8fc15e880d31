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

Pages come from a ``PagePool`` (one per cache by default, or shared: ``PagePool.for_family``), so
pages an offload or a round frees serve other caches. How the pages meet transformers'
``[B, H, T, D]`` tensors: row ``b``'s ``j``-th page is ``page_table[b, j]``; token ``t`` of a row
sits in page ``page_table[b, t // tokens_per_block]`` at slot ``t % tokens_per_block``. ``update`` writes the
step's tokens there and returns the row's tokens gathered back to ``[B, H, T, D]``, contiguous.
The cache counts two lengths: ``seen`` (tokens the model has processed: positions, what
``get_seq_length`` returns) and ``length`` (tokens physically cached, smaller after eviction;
``get_mask_sizes`` returns it, with the evicted count as the offset, as a sliding-window layer does).
Rows share one length: batches must not be padded (TriAttention keeps every row's prompt).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
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

def token_rows(page_table: torch.Tensor, start: int, count: int, kv_heads: int, tokens_per_block: int,
               layout: str) -> torch.Tensor:
    """Flat row indices (int64 ``[B, H, count]``) of tokens ``start .. start+count-1`` of every row
    and head in a pool ``[pages, *page]`` viewed as ``[pages * kv_heads * tokens_per_block, D]``
    (``pool_rows``): one ``index_copy_`` / ``index_select`` per pool and layer moves them. Three
    broadcast advanced indices instead dispatched 2149 aten operators per decode step of a 36-layer
    model against 1293 (CPU profile; the same GPU kernels), and the small models' decoding is bound
    by dispatch."""
    device = page_table.device
    positions = torch.arange(start, start + count, device=device)
    pages = page_table[:, positions // tokens_per_block].long()[:, None, :]        # [B, 1, T]
    slots = (positions % tokens_per_block)[None, None, :]                          # [1, 1, T]
    heads = torch.arange(kv_heads, device=device)[None, :, None]                   # [1, H, 1]
    if layout == "HND":   # page [H, tokens_per_block, D]
        return (pages * kv_heads + heads) * tokens_per_block + slots
    return (pages * tokens_per_block + slots) * kv_heads + heads                    # page [tokens_per_block, H, D]


def pool_rows(pool: torch.Tensor) -> torch.Tensor:
    """A contiguous pool ``[pages, *page]`` as ``[rows, D]`` (a view), the rows ``token_rows`` counts."""
    return pool.view(-1, pool.shape[-1])


def gather_rows(pool: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The pool rows ``rows`` (``[B, H, T]``) as a contiguous ``[B, H, T, D]`` tensor."""
    return pool_rows(pool).index_select(0, rows.reshape(-1)).view(*rows.shape, pool.shape[-1])


class PagePool:
    """K and V pages of every layer of a family (``[num_pages, *page_shape]`` in its layout and hot
    dtype), shared by any number of caches: each takes pages as its rows grow, gives back the pages
    a TriAttention round emptied, and gives all of them back when it offloads. It also holds what
    offloading needs once per pool: the codec (configured over these pages at the first offload)
    and the pinned host cold slots (``host_pages``, default one per hot page)."""

    def __init__(self, geometry: TriGeometry, num_pages: int, dtype: torch.dtype, device: torch.device | str,
                 host_pages: int | None = None):
        if not isinstance(num_pages, int) or num_pages <= 0:
            raise ValueError(f"num_pages: expected a positive int, got {num_pages!r}")
        self.geometry, self.num_pages, self.dtype = geometry, num_pages, dtype
        self.device = torch.zeros(0, device=device).device   # "cuda" -> "cuda:0", as the model's tensors say
        self.k = [torch.zeros((num_pages, *geometry.page_shape), dtype=dtype, device=self.device)
                  for _ in range(geometry.num_layers)]
        self.v = [torch.zeros_like(pool) for pool in self.k]
        self.free = list(range(num_pages))
        self.host_pages = host_pages or num_pages
        self.free_slots = list(range(self.host_pages))
        self.codec: Any = None
        self.cold: torch.Tensor | None = None

    @classmethod
    def for_family(cls, family: str, num_pages: int, *, registry: Any = None, arch: str | None = None,
                   device: torch.device | str = "cuda", host_pages: int | None = None) -> PagePool:
        """A pool for caches of ``family`` (the registry's geometry and hot dtype)."""
        registry = registry if registry is not None else RuntimeRegistry.default()
        config = family_config(registry.resolve(family, arch))
        return cls(config.geometry, num_pages, TORCH_DTYPES[config.dtype], device, host_pages)

    @staticmethod
    def _take(free: list[int], count: int, what: str, total: int, fix: str) -> list[int]:
        if count > len(free):
            raise ValueError(f"page pool: {count} {what} asked for, {len(free)} of {total} free ({fix})")
        taken = free[:count]
        del free[:count]
        return taken

    def take(self, count: int) -> torch.Tensor:
        """``count`` free hot pages, int32 on the pool's device."""
        pages = self._take(self.free, count, "hot pages", self.num_pages,
                           "offload or close another cache, or make num_pages larger")
        return torch.tensor(pages, dtype=torch.int32, device=self.device)

    def give(self, pages: torch.Tensor) -> None:
        self.free = sorted(self.free + pages.tolist())

    def take_slots(self, count: int) -> torch.Tensor:
        """``count`` free cold slots, int32 on the host."""
        slots = self._take(self.free_slots, count, "cold slots", self.host_pages,
                           "onboard or close another cache, or make host_pages larger")
        return torch.tensor(slots, dtype=torch.int32)

    def give_slots(self, slots: torch.Tensor) -> None:
        self.free_slots = sorted(self.free_slots + slots.tolist())

    def cold_storage(self, page_bytes: int) -> torch.Tensor:
        """The host cold slots, allocated once: pinned wherever a GPU is (the codec refuses pageable
        memory), plain on a CPU-only host (stand-in codecs)."""
        if self.cold is None:
            self.cold = torch.empty((self.host_pages, page_bytes), dtype=torch.uint8,
                                    pin_memory=torch.cuda.is_available())
        return self.cold

    def nbytes(self) -> int:
        return sum(pool.numel() * pool.element_size() for pool in self.k + self.v)


class PagedKV:
    """One cache's rows in a ``PagePool``: ``page_table`` (int32 ``[batch, pages_per_row]`` on the
    device) maps row ``b``'s ``j``-th page to a pool page; the first ``row_pages`` entries of every
    row are assigned, taken from the pool as the rows grow."""

    def __init__(self, pool: PagePool, batch: int, capacity: int):
        self.pool, self.batch, self.geometry = pool, batch, pool.geometry
        self.pages_per_row = -(-capacity // self.geometry.tokens_per_block)
        self.page_table = torch.zeros((batch, self.pages_per_row), dtype=torch.int32, device=pool.device)
        self.row_pages = 0

    @property
    def k(self) -> list[torch.Tensor]:
        return self.pool.k

    @property
    def v(self) -> list[torch.Tensor]:
        return self.pool.v

    @property
    def tokens(self) -> int:
        """Tokens a row can hold."""
        return self.pages_per_row * self.geometry.tokens_per_block

    def _pages_for(self, tokens: int) -> int:
        return -(-tokens // self.geometry.tokens_per_block)

    def attach(self, row_pages: int) -> torch.Tensor:
        """Assign pool pages to entries ``row_pages_before .. row_pages - 1`` of every row; returns
        them row-major (int32 on the device)."""
        pages = self.pool.take(self.batch * (row_pages - self.row_pages)).view(self.batch, -1)
        self.page_table[:, self.row_pages:row_pages] = pages
        self.row_pages = row_pages
        return pages.reshape(-1)

    def detach(self, row_pages: int = 0) -> None:
        """Give entries ``row_pages ..`` of every row back to the pool."""
        if row_pages < self.row_pages:
            self.pool.give(self.page_table[:, row_pages:self.row_pages].reshape(-1))
            self.row_pages = row_pages

    def release_after(self, tokens: int) -> None:
        """Give back the pages past ``tokens`` (a round shortened the rows)."""
        self.detach(self._pages_for(tokens))

    def _rows(self, start: int, count: int) -> torch.Tensor:
        g = self.geometry
        return token_rows(self.page_table, start, count, g.kv_heads, g.tokens_per_block, g.layout)

    def step_rows(self, start: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(write, read) rows of a forward adding ``count`` tokens at ``start`` (pages taken from
        the pool as needed): the same for every layer, so computed once per step."""
        if start + count > self.tokens:
            raise ValueError(f"kvgen cache full: {start + count} tokens per row, max_cache_len gives {self.tokens} "
                             "(pass a larger max_cache_len)")
        if self._pages_for(start + count) > self.row_pages:
            self.attach(self._pages_for(start + count))
        return self._rows(start, count), self._rows(0, start + count)

    def write(self, layer: int, key: torch.Tensor, value: torch.Tensor, start: int,
              rows: torch.Tensor | None = None) -> None:
        """Tokens ``start ..`` of every row from ``[B, H, t, D]`` K and V."""
        rows = (rows if rows is not None else self.step_rows(start, key.shape[2])[0]).reshape(-1)
        d = key.shape[-1]
        pool_rows(self.k[layer]).index_copy_(0, rows, key.reshape(-1, d))
        pool_rows(self.v[layer]).index_copy_(0, rows, value.reshape(-1, d))

    def read(self, layer: int, length: int, rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens ``0 .. length-1`` of every row as contiguous ``[B, H, length, D]`` K and V."""
        rows = rows if rows is not None else self._rows(0, length)
        return gather_rows(self.k[layer], rows), gather_rows(self.v[layer], rows)

    def used_pages(self) -> torch.Tensor:
        """int32 ids of the pool pages the rows hold (row-major)."""
        return self.page_table[:, : self.row_pages].reshape(-1)


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
                 max_cache_len: int = 4096, pool: PagePool | None = None):
        if not isinstance(max_cache_len, int) or max_cache_len <= 0:
            raise ValueError(f"max_cache_len: expected a positive int, got {max_cache_len!r}")
        self.registry = registry if registry is not None else RuntimeRegistry.default()
        self.resolved = self.registry.resolve(family, arch)
        self.family = family_config(self.resolved)
        self.model = check_model(model_config, self.family)
        self.geometry = self.family.geometry
        self.capacity = max_cache_len
        if pool is not None and (pool.geometry != self.geometry or pool.dtype != TORCH_DTYPES[self.family.dtype]):
            raise ValueError(f"pool: pages of another geometry or dtype ({pool.dtype}) than family {family}")
        self.pool = pool
        self.store: PagedKV | None = None
        self.length = 0   # tokens physically cached per row
        self.seen = 0     # tokens processed per row (positions)
        self._step_rows: tuple = ()   # this forward's (write, read) pool rows, made at layer 0
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
        batch = key_states.shape[0]
        if self.pool is None:   # a pool of its own: every row's max_cache_len
            self.pool = PagePool(g, batch * -(-self.capacity // g.tokens_per_block), dtype, key_states.device)
        elif self.pool.device != key_states.device:
            raise ValueError(f"pool on {self.pool.device}, the model's K/V on {key_states.device}")
        self.store = PagedKV(self.pool, batch, self.capacity)
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
            self._step_rows = self.store.step_rows(self.length, count)
        write, read = self._step_rows
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

    def close(self) -> None:
        """Give the rows' pages back to the pool (the cache is done)."""
        if self.store is not None:
            self.store.detach()
            self.length = 0

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

    ``offload()`` encodes every page the rows hold into free cold slots of the pool (pinned host)
    by the codec's strategy ("staged" where the library has C ABI 2) and gives the hot pages back
    to the pool, where another cache sharing it (``pool=``, ``PagePool.for_family``) can use them;
    the next forward (``generate`` continuing with this cache) takes free pages again and decodes
    the cold pages into them before layer 0 reads anything. ``onboard()`` does that ahead of time.

    ``codec_factory(layout, pools)`` replaces the registry's ``ColdPageCodec`` (tests pass the
    oracle's codec on the CPU); ``pools[layer] = [K, V]``. One codec serves a pool."""

    def __init__(self, model_config: Any, family: str, *, registry: Any = None, arch: str | None = None,
                 max_cache_len: int = 4096, pool: PagePool | None = None, strategy: str | None = None,
                 codec_factory: Callable[[RegistryLayout, list], Any] | None = None):
        super().__init__(model_config, family, registry=registry, arch=arch, max_cache_len=max_cache_len, pool=pool)
        self.codec_factory = codec_factory or self._registry_codec
        layout = self.resolved.layout()
        names = [b["name"] for b in layout.buffers]
        if names != ["k", "v"] or layout.sides or len(layout.lifecycles) != 1:
            raise ModelMismatch(f"{family}: cold pages of buffers {names}, {len(layout.sides)} side buffers and "
                                f"{len(layout.lifecycles)} lifecycles; this cache moves K and V pages of one lifecycle")
        self.layout = layout
        self.strategy = strategy
        self.offloaded: tuple[torch.Tensor, int] | None = None   # (cold slots, pages per row) while on the host

    def _registry_codec(self, layout: RegistryLayout, pools: list) -> Any:
        from kvgen.runtime.codec import ColdPageCodec  # needs a GPU: imported when a codec is made

        return ColdPageCodec(self.registry.load(self.family.family, self.resolved.arch), layout, pools)

    @property
    def codec(self) -> Any:
        """The pool's codec, configured over its pages on first use."""
        pool = self.pool
        if pool.codec is None:
            pool.codec = self.codec_factory(self.layout, [[k, v] for k, v in zip(pool.k, pool.v)])
            if self.strategy is not None:
                pool.codec.set_offload_strategy(self.strategy)
        return pool.codec

    @property
    def cold(self) -> torch.Tensor:
        return self.pool.cold_storage(self.layout.cold_page_bytes())

    @staticmethod
    def _pairs(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
        """Host int32 ``[n, 2]`` (dst, src) pairs of the codec."""
        return torch.stack([dst.cpu(), src.cpu()], dim=1).to(torch.int32).contiguous()

    def offload(self) -> int:
        """Encode every page the rows hold into cold slots and give the hot pages back to the pool;
        returns the cold bytes written. Enqueued on the current stream (synchronize it to time the
        transfer); later users of the pages queue behind it."""
        if self.store is None or self.offloaded is not None or not self.store.row_pages:
            return 0
        pages = self.store.used_pages()
        slots = self.pool.take_slots(pages.numel())
        self.codec.offload(self.cold, self._pairs(slots, pages))
        self.offloaded = (slots, self.store.row_pages)
        self.store.detach()
        return pages.numel() * self.layout.cold_page_bytes()

    def onboard(self) -> None:
        """Take free hot pages and decode the cold pages into them (enqueued before anything reads
        them); the cold slots go back to the pool."""
        if self.offloaded is None:
            return
        slots, row_pages = self.offloaded
        pages = self.store.attach(row_pages)
        self.codec.onboard(self.cold, self._pairs(pages, slots))
        self.pool.give_slots(slots)
        self.offloaded = None

    def _begin_step(self, count: int) -> None:
        self.onboard()

    def close(self) -> None:
        if self.offloaded is not None:
            self.pool.give_slots(self.offloaded[0])
            self.offloaded = None
        super().close()

    def describe(self) -> dict[str, Any]:
        return {"family": self.family.family, "arch": self.resolved.arch,
                "pool_bytes": self.pool.nbytes() if self.pool else 0, "cold_page_bytes": self.layout.cold_page_bytes(),
                "offload": self.pool.codec.describe_offload() if self.pool and self.pool.codec else None}


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
                 beta: int | None = None, eviction_mode: str | None = None, pool: PagePool | None = None,
                 manager_factory: ManagerFactory | None = None, on_round: Callable[[Any], None] | None = None):
        super().__init__(model_config, family, registry=registry, arch=arch, max_cache_len=max_cache_len, pool=pool)
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
        self.store.release_after(self.length)   # the emptied pages go back to the pool
        self.rounds.append(RoundRecord(self.seen, before, self.length, report.kept))

    def evicted_bytes(self) -> int:
        """K/V bytes the rounds freed against a cache that keeps every token (``DynamicCache``)."""
        g = self.geometry
        per_token = 2 * g.num_layers * g.kv_heads * g.head_dim * TORCH_DTYPES[self.family.dtype].itemsize
        return (self.seen - self.length) * per_token * (self.store.batch if self.store else 0)
