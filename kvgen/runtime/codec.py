"""``ColdPageCodec``: the cold-page codec of one family, driven from torch tensors.

Hot pools are any tensors whose dim 0 indexes pages (``[num_pages, ...one page...]``, possibly a
strided view such as ``kv_pool[:, 0]`` for K inside a combined K/V pool). Cold storage is a uint8
tensor on the GPU or in pinned host memory (the kernel then writes and reads it over the bus
directly). Page pairs are ``int32 [n, 2]`` tensors of ``(dst, src)``. Every index is checked against
the pools' page counts and the cold buffer's slots (the bounds-checked entry points of the C ABI),
so no pair can make a kernel touch memory it was not given.

``offload`` / ``onboard`` move pages to and from pinned host cold storage by a strategy ("staged"
through a device staging ring and the copy engine, or "zero-copy"; ``kvgen.runtime.offload``);
``describe_offload()`` says which one is in use and why.

A family whose spec declares ``cold_page.scales.<buffer>: per_layer`` is configured with its
per-layer scales (``scales=``, a ``kvgen.runtime.scales.LayerScales`` from ``load_layer_scales``);
``set_layer_scales`` changes them later.

The torch custom ops ``kvgen::cold_encode`` / ``cold_decode`` / ``cold_offload`` / ``cold_onboard``
(``register_codec``, ``cold_encode``, ..., ``register_ops``) wrap a configured codec; they live here, beside it.
"""

from __future__ import annotations

import ctypes
import functools
import itertools
import math
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from kvgen.runtime.library import FamilyLibrary, LibraryError, PoolExtent
from kvgen.runtime.offload import (
    DEFAULT_STAGING_BYTES,
    STRATEGIES,
    OffloadState,
    check_host_cold,
    check_slots,
    check_staging_tensor,
    check_strategy,
    cold_slots,
    default_strategy,
)
from kvgen.runtime.scales import LayerScales, per_layer_buffers

if TYPE_CHECKING:  # only attributes are read: kvgen.lower.layout.FamilyLayout (build side) works too
    from kvgen.runtime.lookup import RegistryLayout

INDEX_LOCATIONS = {"host": 0, "device": 1}
# Hot dtypes of a quantized buffer by element size (the layout records sizes, not dtype names).
HOT_DTYPES = {2: (torch.bfloat16, torch.float16), 1: (torch.float8_e4m3fn,)}


@dataclass(frozen=True)
class PoolSpec:
    """What one pool of a layer holds per page: ``elem_bytes`` None for a side buffer (any dtype)."""

    name: str
    page_bytes: int
    elem_bytes: int | None


def _field(item: Any, name: str) -> Any:
    return item[name] if isinstance(item, Mapping) else getattr(item, name)


def pool_specs(layout: "RegistryLayout") -> list[PoolSpec]:
    """The pools of one layer, in descriptor order (quantized buffers, then side buffers). Reads a
    ``RegistryLayout`` (JSON mappings) or a build-side ``FamilyLayout`` (its ``record``)."""
    record = getattr(layout, "record", layout)
    specs = [PoolSpec(_field(b, "name"), _field(b, "rows") * _field(b, "row_dim") * _field(b, "elem_bytes"),
                      _field(b, "elem_bytes")) for b in record.buffers]
    return specs + [PoolSpec(_field(s, "name"), _field(s, "bytes"), None) for s in record.sides]


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def check_pool(pool: Any, spec: PoolSpec, what: str) -> None:
    """One hot pool: ``[pages, ...one dense page...]`` of the buffer's page size and dtype, pages
    not overlapping (any page stride at least one page, e.g. ``kv_pool[:, 0]``)."""
    if not isinstance(pool, torch.Tensor) or pool.dim() < 1:
        raise ValueError(f"{what}: expected a tensor [pages, ...] (dim 0 indexes pages), got {type(pool).__name__}"
                         f"{'' if not isinstance(pool, torch.Tensor) else ' of dim 0'}")
    page_bytes = math.prod(pool.shape[1:]) * pool.element_size()
    if page_bytes != spec.page_bytes:
        raise ValueError(f"{what}: pages of {spec.page_bytes} bytes expected, got {list(pool.shape[1:])} "
                         f"{_dtype_name(pool.dtype)} = {page_bytes} bytes")
    if spec.elem_bytes is not None and pool.dtype not in HOT_DTYPES.get(spec.elem_bytes, ()):
        allowed = " or ".join(_dtype_name(d) for d in HOT_DTYPES.get(spec.elem_bytes, ()))
        raise ValueError(f"{what}: dtype {_dtype_name(pool.dtype)}, the family's hot dtype is {allowed}")
    if pool.shape[0] and not pool[0].is_contiguous():
        raise ValueError(f"{what}: each page must be dense (only the page stride may differ)")
    if pool.shape[0] > 1 and pool.stride(0) * pool.element_size() < page_bytes:
        raise ValueError(f"{what}: page stride {pool.stride(0) * pool.element_size()} bytes is below the page size "
                         f"{page_bytes} (pages would overlap)")


def check_pools(pools: Sequence[Sequence[Any]], layout: "RegistryLayout") -> torch.device:
    """Every (layer, buffer) pool of the family, all on one CUDA device (returned)."""
    specs = pool_specs(layout)
    layers = 1 + max(layer for lc in layout.lifecycles for layer in lc.layers)
    if len(pools) != layers:
        raise ValueError(f"pools: {layout.family} has {layers} layers, got {len(pools)} lists of pools")
    names = ", ".join(spec.name for spec in specs)
    for layer, buffers in enumerate(pools):
        if len(buffers) != len(specs):
            raise ValueError(f"pools[{layer}]: expected {len(specs)} pools ({names}), got {len(buffers)}")
        for index, (pool, spec) in enumerate(zip(buffers, specs)):
            check_pool(pool, spec, f"pool of layer {layer}, buffer {index} ({spec.name})")
    device = pools[0][0].device
    for layer, buffers in enumerate(pools):
        for index, pool in enumerate(buffers):
            if pool.device != device or not pool.is_cuda:
                raise ValueError(f"pool of layer {layer}, buffer {index}: on {pool.device}; every pool must be on "
                                 f"one CUDA device ({device} for the first)")
    return device


def pool_descriptors(pools: Sequence[Sequence[torch.Tensor]]) -> list[tuple[int, int, int]]:
    """(base address, page stride in bytes, pages) per (layer, buffer), layers then buffers in order."""
    return [(pool.data_ptr(), pool.stride(0) * pool.element_size(), pool.shape[0])
            for buffers in pools for pool in buffers]


def check_pairs(pairs: Any, index_location: str, device: torch.device) -> torch.Tensor:
    """``int32 [n, 2]`` (dst, src): host pairs in CPU memory (copied if strided), device pairs on
    the pools' device and contiguous (they are read after the call returns, so no copy is made).
    Their values are checked by the library: host pairs before anything is enqueued, device pairs
    by the kernels."""
    if not isinstance(pairs, torch.Tensor) or pairs.dtype != torch.int32 or pairs.dim() != 2 or pairs.shape[1] != 2:
        raise ValueError("pairs: page pairs must be an int32 tensor of shape [n, 2] (dst, src)")
    if index_location == "host":
        if pairs.is_cuda:
            raise ValueError("pairs: this codec takes host index arrays (configured with index_location='host')")
        return pairs.contiguous()
    if pairs.device != device:
        raise ValueError(f"pairs: this codec takes device index arrays on {device}, got {pairs.device}")
    if not pairs.is_contiguous():
        raise ValueError("pairs: device index arrays must be contiguous (a copy would be freed before the kernel reads it)")
    return pairs


def _stream(stream: torch.cuda.Stream | None, device: torch.device) -> torch.cuda.Stream:
    """The stream to enqueue on (default: ``device``'s current one); it must belong to ``device``
    and so must the current device (kernels launch on the current device)."""
    stream = stream or torch.cuda.current_stream(device)
    if stream.device != device:
        raise ValueError(f"stream: on {stream.device}, the codec's pools on {device}")
    if torch.cuda.current_device() != device.index:
        raise ValueError(f"the current CUDA device is cuda:{torch.cuda.current_device()}, the codec's pools are on "
                         f"{device}: call it under torch.cuda.device({device.index})")
    return stream


class ColdPageCodec:
    """One configured codec instance (C ABI ``kvgen_codec``), owning its device tables.

    Everything is checked before a launch without synchronizing: pools (layers, buffers, page
    size, dtype, device), cold storage (dtype, device, alignment, slot count), page pairs (dtype,
    shape, location) and, in the library, host pairs against the pools' pages and the cold slots.
    Device pairs are checked by the kernels: out-of-range ones are skipped and the next call (or
    ``check_device_errors``) raises ``LibraryError`` saying what was skipped."""

    def __init__(self, library: FamilyLibrary, layout: "RegistryLayout", pools: Sequence[Sequence[torch.Tensor]],
                 index_location: str = "host", scales: LayerScales | None = None):
        self._handle = None   # close() and __del__ work on a codec whose configuration failed
        if library.family != layout.family:
            raise LibraryError(f"{library.path}: built for {library.family!r}, layout is {layout.family!r}")
        if index_location not in INDEX_LOCATIONS:
            raise ValueError(f"index_location: {index_location!r}, expected one of {sorted(INDEX_LOCATIONS)}")
        self.library = library
        self.layout = layout
        self.index_location = index_location
        self.device = check_pools(pools, layout)
        per_layer = per_layer_buffers(layout)
        if per_layer and scales is None:
            raise ValueError(f"scales: {layout.family} takes per-layer scales for {', '.join(per_layer)}; pass "
                             "scales=kvgen.runtime.scales.load_layer_scales(file, layout)")
        if not per_layer and scales is not None:
            raise ValueError(f"scales: {layout.family} compiles its scales in (cold_page.scales); it takes none")
        self._pools = [list(p) for p in pools]  # keep the hot pools alive while configured
        descs = pool_descriptors(self._pools)
        array = (PoolExtent * len(descs))(*[PoolExtent(*desc) for desc in descs])
        with torch.cuda.device(self.device):  # the descriptor tables live on the pools' device
            handle = library.kvgen_codec_configure_checked(array, len(descs), INDEX_LOCATIONS[index_location])
        if not handle:
            raise LibraryError(f"{library.path}: configure failed: {library.last_error()}")
        self._handle = handle
        if scales is not None:
            self.set_layer_scales(scales)

    def set_layer_scales(self, scales: LayerScales) -> None:
        """Upload (G, Q) of every per-layer buffer in every layer (C ``kvgen_codec_set_layer_scales``).
        Synchronous: call it when no encode or decode of this codec is in flight."""
        if not isinstance(scales, LayerScales):
            raise ValueError(f"scales: expected LayerScales (kvgen.runtime.scales.load_layer_scales), "
                             f"got {type(scales).__name__}")
        expected = per_layer_buffers(self.layout)
        if scales.family != self.layout.family or scales.buffers != expected:
            raise ValueError(f"scales: {scales.source or 'given'} are for {scales.family} {list(scales.buffers)}, "
                             f"this codec is {self.layout.family} with per-layer buffers {list(expected)}")
        if not getattr(self.library, "layer_scales", False):
            raise LibraryError(f"{self.library.path}: no kvgen_codec_set_layer_scales (built by an older kvgen); "
                               "rebuild it with kvgen build")
        G, Q = scales.flat()
        with torch.cuda.device(self.device):  # the scale tables live beside the descriptor tables
            ok = self.library.kvgen_codec_set_layer_scales(self._live(), (ctypes.c_float * len(G))(*G),
                                                           (ctypes.c_float * len(Q))(*Q), len(G))
        if not ok:
            raise LibraryError(f"{self.library.path}: set_layer_scales: {self.library.last_error()}")

    def close(self) -> None:
        if self._handle:
            self.library.kvgen_codec_destroy(self._handle)
            self._handle = None

    def __del__(self) -> None:
        self.close()

    def _live(self) -> int:
        """The C handle; a closed codec is an error here, never a call into the library."""
        if not self._handle:
            raise LibraryError(f"{self.library.path}: this {self.layout.family} codec is closed")
        return self._handle

    def cold_page_bytes(self, lifecycle: int = 0) -> int:
        count = len(self.layout.lifecycles)
        if not isinstance(lifecycle, int) or not 0 <= lifecycle < count:
            raise ValueError(f"lifecycle: {lifecycle!r}, {self.layout.family} has lifecycles 0..{count - 1}")
        return self.library.kvgen_codec_query_cold_page_bytes(self._live(), lifecycle)

    def _run(self, fn, lifecycle: int, cold: torch.Tensor, pairs: torch.Tensor, stream) -> None:
        handle = self._live()
        slots = cold_slots(cold, self.cold_page_bytes(lifecycle), self.device)
        pairs = check_pairs(pairs, self.index_location, self.device)
        stream = _stream(stream, self.device)
        ok = fn(handle, lifecycle, ctypes.c_void_p(cold.data_ptr()), slots, ctypes.c_void_p(pairs.data_ptr()),
                pairs.shape[0], ctypes.c_void_p(stream.cuda_stream))
        if not ok:
            raise LibraryError(f"{self.library.path}: {self.library.last_error()}")

    def encode(self, cold: torch.Tensor, pairs: torch.Tensor, lifecycle: int = 0, stream=None) -> None:
        """Enqueue: hot page ``src`` of every layer of the lifecycle → cold slot ``dst``."""
        self._run(self.library.kvgen_codec_encode_checked, lifecycle, cold, pairs, stream)

    def decode(self, cold: torch.Tensor, pairs: torch.Tensor, lifecycle: int = 0, stream=None) -> None:
        """Enqueue: cold slot ``src`` → hot page ``dst`` of every layer of the lifecycle."""
        self._run(self.library.kvgen_codec_decode_checked, lifecycle, cold, pairs, stream)

    def check_device_errors(self) -> None:
        """``LibraryError`` if a kernel of this codec skipped out-of-range device pairs since the last
        check or call (then cleared). No synchronization: it sees the kernels that have finished, so
        synchronize the stream first to see all of them."""
        if not self.library.kvgen_codec_check_device_errors(self._live()):
            raise LibraryError(f"{self.library.path}: {self.library.last_error()}")

    # ------------------------------------------------------------ offload / onboard (kvgen.runtime.offload)

    @functools.cached_property
    def _offload(self) -> OffloadState:
        return OffloadState(*default_strategy(getattr(self.library, "abi", 1)))

    @property
    def offload_strategy(self) -> str:
        """The strategy ``offload`` / ``onboard`` use when not told: "staged" or "zero-copy"."""
        return self._offload.strategy

    def set_offload_strategy(self, strategy: str) -> None:
        self._offload.strategy = check_strategy(strategy, getattr(self.library, "abi", 1))
        self._offload.reason = "set by the caller"

    def describe_offload(self) -> dict[str, Any]:
        """Which strategy offload/onboard use and why, and the staging bytes in use (0: none yet)."""
        staged = getattr(self.library, "abi", 1) >= 2
        return {"strategy": self._offload.strategy, "reason": self._offload.reason,
                "staging_bytes": self.library.kvgen_codec_staging_bytes(self._live()) if staged else 0,
                "strategies": list(STRATEGIES) if staged else ["zero-copy"]}

    def set_staging(self, staging: torch.Tensor | int | None = None) -> None:
        """The staged path's device ring: a caller's uint8 GPU tensor, or a size for the codec to
        allocate (None: 64 MiB). Allocates (the stream and events too): call it before capturing."""
        check_strategy("staged", getattr(self.library, "abi", 1))
        if isinstance(staging, torch.Tensor):
            check_staging_tensor(staging)
            ok = self.library.kvgen_codec_set_staging(self._live(), ctypes.c_void_p(staging.data_ptr()),
                                                      staging.numel())
        else:
            size = DEFAULT_STAGING_BYTES if staging is None else int(staging)
            ok = self.library.kvgen_codec_set_staging(self._live(), None, size)
        if not ok:
            raise LibraryError(f"{self.library.path}: set_staging: {self.library.last_error()}")
        self._offload.staging = staging if isinstance(staging, torch.Tensor) else None

    def offload(self, cold: torch.Tensor, pairs: torch.Tensor, lifecycle: int = 0, stream=None,
                strategy: str | None = None) -> None:
        """Enqueue: hot page ``src`` → slot ``dst`` of pinned host ``cold``, by ``strategy``
        (default ``offload_strategy``)."""
        self._transfer(True, cold, pairs, lifecycle, stream, strategy)

    def onboard(self, cold: torch.Tensor, pairs: torch.Tensor, lifecycle: int = 0, stream=None,
                strategy: str | None = None) -> None:
        """Enqueue: slot ``src`` of pinned host ``cold`` → hot page ``dst``; a slot this codec never
        offloaded into ``cold`` is refused (host pairs)."""
        self._transfer(False, cold, pairs, lifecycle, stream, strategy)

    def _transfer(self, offload: bool, cold: torch.Tensor, pairs: torch.Tensor, lifecycle: int, stream,
                  strategy: str | None) -> None:
        strategy = check_strategy(strategy or self._offload.strategy, getattr(self.library, "abi", 1))
        num_slots = check_host_cold(cold, self.cold_page_bytes(lifecycle), self.device)
        pairs = check_pairs(pairs, self.index_location, self.device)
        slots = pairs[:, 0 if offload else 1]
        if not pairs.is_cuda:
            check_slots(slots, num_slots)
            if not offload:
                self._offload.slots.require(cold, lifecycle, slots)
        if strategy == "zero-copy":
            (self.encode if offload else self.decode)(cold, pairs, lifecycle, stream)
        else:
            self._staged(offload, cold, num_slots, pairs, lifecycle, stream)
        if offload and not pairs.is_cuda:
            self._offload.slots.mark(cold, lifecycle, slots, num_slots)

    def _staged(self, offload: bool, cold: torch.Tensor, num_slots: int, pairs: torch.Tensor, lifecycle: int,
                stream) -> None:
        if pairs.is_cuda:
            raise ValueError("the staged strategy needs host index arrays (the copies' addresses come from them)")
        if not self.library.kvgen_codec_staging_bytes(self._live()):
            if torch.cuda.is_current_stream_capturing():
                raise ValueError("no staging buffer yet: call set_staging() before capturing a CUDA graph")
            self.set_staging()
        fn = self.library.kvgen_codec_offload if offload else self.library.kvgen_codec_onboard
        ok = fn(self._live(), lifecycle, ctypes.c_void_p(cold.data_ptr()), num_slots,
                ctypes.c_void_p(pairs.data_ptr()), pairs.shape[0], ctypes.c_void_p(_stream(stream, self.device).cuda_stream))
        if not ok:
            raise LibraryError(f"{self.library.path}: {'offload' if offload else 'onboard'}: "
                               f"{self.library.last_error()}")


# ---------------------------------------------------------------- torch custom ops
#
# kvgen::cold_encode / kvgen::cold_decode make the codec one opaque node for torch.compile (no
# tracing into ctypes) whose mutations are declared: encode writes `cold`, decode writes the hot
# pools. A configured codec is not a tensor, so ops name it by an integer id from `register_codec`.
# The work is only enqueued on the current stream, so the ops can be captured in a CUDA graph
# (use device index arrays: host ones are read while capturing).

_codecs: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
_next_id = itertools.count(1)
ENCODE_SCHEMA = "(int codec_id, Tensor(a!) cold, Tensor pairs, int lifecycle, Tensor[] hot) -> ()"
DECODE_SCHEMA = "(int codec_id, Tensor cold, Tensor pairs, int lifecycle, Tensor(a!)[] hot) -> ()"
# kvgen::cold_offload / kvgen::cold_onboard: the same schemas, pinned host cold, the codec's offload_strategy.


def register_codec(codec: Any) -> int:
    """An id naming ``codec`` in the ops; held weakly (the caller keeps the codec alive)."""
    codec_id = next(_next_id)
    _codecs[codec_id] = codec
    return codec_id


def _codec(codec_id: int) -> Any:
    try:
        return _codecs[codec_id]
    except KeyError:
        raise LibraryError(f"no live codec with id {codec_id} (register it with register_codec)") from None


def _encode_impl(codec_id, cold, pairs, lifecycle, hot) -> None:  # noqa: ANN001 - schema above
    _codec(codec_id).encode(cold, pairs, lifecycle)


def _decode_impl(codec_id, cold, pairs, lifecycle, hot) -> None:  # noqa: ANN001 - schema above
    _codec(codec_id).decode(cold, pairs, lifecycle)


def _offload_impl(codec_id, cold, pairs, lifecycle, hot) -> None:  # noqa: ANN001 - schema above
    _codec(codec_id).offload(cold, pairs, lifecycle)


def _onboard_impl(codec_id, cold, pairs, lifecycle, hot) -> None:  # noqa: ANN001 - schema above
    _codec(codec_id).onboard(cold, pairs, lifecycle)


def _no_output(*args: Any) -> None:
    """Fake (meta) kernel: the ops only mutate their inputs."""
    return None


@functools.cache
def register_ops() -> None:
    """Define ``kvgen::cold_encode``, ``cold_decode``, ``cold_offload`` and ``cold_onboard`` once
    (on first use, not at import)."""
    ops = (("cold_encode", _encode_impl, "cold", ENCODE_SCHEMA), ("cold_decode", _decode_impl, "hot", DECODE_SCHEMA),
           ("cold_offload", _offload_impl, "cold", ENCODE_SCHEMA),
           ("cold_onboard", _onboard_impl, "hot", DECODE_SCHEMA))
    for name, impl, mutated, schema in ops:
        op = torch.library.custom_op(f"kvgen::{name}", impl, mutates_args=(mutated,), schema=schema)
        op.register_fake(_no_output)


def _hot_tensors(codec: Any) -> list[Any]:
    """Every hot pool the codec was configured with (they are what decode writes)."""
    return [pool for layer in codec._pools for pool in layer]


def cold_encode(codec_id: int, cold: Any, pairs: Any, lifecycle: int = 0) -> None:
    """``torch.ops.kvgen.cold_encode`` on a registered codec (its hot pools passed as read inputs)."""
    register_ops()
    torch.ops.kvgen.cold_encode(codec_id, cold, pairs, lifecycle, _hot_tensors(_codec(codec_id)))


def cold_decode(codec_id: int, cold: Any, pairs: Any, lifecycle: int = 0) -> None:
    """``torch.ops.kvgen.cold_decode`` on a registered codec (its hot pools declared as written)."""
    register_ops()
    torch.ops.kvgen.cold_decode(codec_id, cold, pairs, lifecycle, _hot_tensors(_codec(codec_id)))


def cold_offload(codec_id: int, cold: Any, pairs: Any, lifecycle: int = 0) -> None:
    """``torch.ops.kvgen.cold_offload``: ``ColdPageCodec.offload`` by the codec's ``offload_strategy``."""
    register_ops()
    torch.ops.kvgen.cold_offload(codec_id, cold, pairs, lifecycle, _hot_tensors(_codec(codec_id)))


def cold_onboard(codec_id: int, cold: Any, pairs: Any, lifecycle: int = 0) -> None:
    """``torch.ops.kvgen.cold_onboard``: ``ColdPageCodec.onboard`` by the codec's ``offload_strategy``."""
    register_ops()
    torch.ops.kvgen.cold_onboard(codec_id, cold, pairs, lifecycle, _hot_tensors(_codec(codec_id)))
