"""``ColdPageCodec``: the cold-page codec of one family, driven from torch tensors.

Hot pools are any tensors whose dim 0 indexes pages (``[num_pages, ...one page...]``, possibly a
strided view such as ``kv_pool[:, 0]`` for K inside a combined K/V pool). Cold storage is a uint8
tensor on the GPU or in pinned host memory (the kernel then writes and reads it over the bus
directly). Page pairs are ``int32 [n, 2]`` tensors of ``(dst, src)``.

``offload`` / ``onboard`` move pages to and from pinned host cold storage by a strategy ("staged"
through a device staging ring and the copy engine, or "zero-copy"; ``kvgen.runtime.offload``);
``describe_offload()`` says which one is in use and why.

The torch custom ops ``kvgen::cold_encode`` / ``cold_decode`` / ``cold_offload`` / ``cold_onboard``
(``register_codec``, ``cold_encode``, ..., ``register_ops``) wrap a configured codec; they live here, beside it.
"""

from __future__ import annotations

import ctypes
import functools
import itertools
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from kvgen.runtime.library import FamilyLibrary, LibraryError, PoolDesc
from kvgen.runtime.offload import (
    DEFAULT_STAGING_BYTES,
    STRATEGIES,
    OffloadState,
    check_host_cold,
    check_slots,
    check_staging_tensor,
    check_strategy,
    default_strategy,
)

if TYPE_CHECKING:  # only attributes are read: kvgen.lower.layout.FamilyLayout (build side) works too
    from kvgen.runtime.lookup import RegistryLayout

INDEX_LOCATIONS = {"host": 0, "device": 1}


def pool_descriptors(pools: Sequence[Sequence[torch.Tensor]]) -> list[tuple[int, int]]:
    """(base address, page stride in bytes) per (layer, buffer), layers then buffers in order."""
    descs = []
    for layer, buffers in enumerate(pools):
        for index, pool in enumerate(buffers):
            if pool.dim() < 1:
                raise ValueError(f"pool of layer {layer}, buffer {index} needs a page dimension")
            descs.append((pool.data_ptr(), pool.stride(0) * pool.element_size()))
    return descs


def _stream_handle(stream: torch.cuda.Stream | None) -> int:
    stream = stream or torch.cuda.current_stream()
    return stream.cuda_stream


class ColdPageCodec:
    """One configured codec instance (C ABI ``kvgen_codec``), owning its device tables."""

    def __init__(self, library: FamilyLibrary, layout: "RegistryLayout", pools: Sequence[Sequence[torch.Tensor]],
                 index_location: str = "host"):
        self._handle = None   # close() and __del__ work on a codec whose configuration failed
        if library.family != layout.family:
            raise LibraryError(f"{library.path}: built for {library.family!r}, layout is {layout.family!r}")
        self.library = library
        self.layout = layout
        self.index_location = index_location
        self._pools = [list(p) for p in pools]  # keep the hot pools alive while configured
        descs = pool_descriptors(self._pools)
        array = (PoolDesc * len(descs))(*[PoolDesc(base, stride) for base, stride in descs])
        handle = library.kvgen_codec_configure(array, len(descs), INDEX_LOCATIONS[index_location])
        if not handle:
            raise LibraryError(f"{library.path}: configure failed: {library.last_error()}")
        self._handle = handle

    def close(self) -> None:
        if self._handle:
            self.library.kvgen_codec_destroy(self._handle)
            self._handle = None

    def __del__(self) -> None:
        self.close()

    def cold_page_bytes(self, lifecycle: int = 0) -> int:
        return self.library.kvgen_codec_query_cold_page_bytes(self._handle, lifecycle)

    def _pairs(self, pairs: torch.Tensor) -> torch.Tensor:
        if pairs.dtype != torch.int32 or pairs.dim() != 2 or pairs.shape[1] != 2:
            raise ValueError("page pairs must be an int32 tensor of shape [n, 2] (dst, src)")
        want_cuda = self.index_location == "device"
        if pairs.is_cuda != want_cuda:
            raise ValueError(f"this codec takes {self.index_location} index arrays")
        return pairs.contiguous()

    def _check_cold(self, cold: torch.Tensor, lifecycle: int) -> None:
        if cold.dtype != torch.uint8 or not cold.is_contiguous():
            raise ValueError("cold storage must be a contiguous uint8 tensor")
        if not (cold.is_cuda or cold.is_pinned()):
            raise ValueError("cold storage must be GPU memory or pinned host memory")
        if cold.numel() % self.cold_page_bytes(lifecycle):
            raise ValueError(f"cold storage size is not a multiple of {self.cold_page_bytes(lifecycle)} bytes")

    def _run(self, fn, lifecycle: int, cold: torch.Tensor, pairs: torch.Tensor, stream) -> None:
        self._check_cold(cold, lifecycle)
        pairs = self._pairs(pairs)
        ok = fn(self._handle, lifecycle, ctypes.c_void_p(cold.data_ptr()), ctypes.c_void_p(pairs.data_ptr()),
                pairs.shape[0], ctypes.c_void_p(_stream_handle(stream)))
        if not ok:
            raise LibraryError(f"{self.library.path}: {self.library.last_error()}")

    def encode(self, cold: torch.Tensor, pairs: torch.Tensor, lifecycle: int = 0, stream=None) -> None:
        """Enqueue: hot page ``src`` of every layer of the lifecycle → cold slot ``dst``."""
        self._run(self.library.kvgen_codec_encode, lifecycle, cold, pairs, stream)

    def decode(self, cold: torch.Tensor, pairs: torch.Tensor, lifecycle: int = 0, stream=None) -> None:
        """Enqueue: cold slot ``src`` → hot page ``dst`` of every layer of the lifecycle."""
        self._run(self.library.kvgen_codec_decode, lifecycle, cold, pairs, stream)

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
                "staging_bytes": self.library.kvgen_codec_staging_bytes(self._handle) if staged else 0,
                "strategies": list(STRATEGIES) if staged else ["zero-copy"]}

    def set_staging(self, staging: torch.Tensor | int | None = None) -> None:
        """The staged path's device ring: a caller's uint8 GPU tensor, or a size for the codec to
        allocate (None: 64 MiB). Allocates (the stream and events too): call it before capturing."""
        check_strategy("staged", getattr(self.library, "abi", 1))
        if isinstance(staging, torch.Tensor):
            check_staging_tensor(staging)
            ok = self.library.kvgen_codec_set_staging(self._handle, ctypes.c_void_p(staging.data_ptr()),
                                                      staging.numel())
        else:
            size = DEFAULT_STAGING_BYTES if staging is None else int(staging)
            ok = self.library.kvgen_codec_set_staging(self._handle, None, size)
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
        num_slots = check_host_cold(cold, self.cold_page_bytes(lifecycle))
        pairs = self._pairs(pairs)
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
        if not self.library.kvgen_codec_staging_bytes(self._handle):
            if torch.cuda.is_current_stream_capturing():
                raise ValueError("no staging buffer yet: call set_staging() before capturing a CUDA graph")
            self.set_staging()
        fn = self.library.kvgen_codec_offload if offload else self.library.kvgen_codec_onboard
        ok = fn(self._handle, lifecycle, ctypes.c_void_p(cold.data_ptr()), num_slots,
                ctypes.c_void_p(pairs.data_ptr()), pairs.shape[0], ctypes.c_void_p(_stream_handle(stream)))
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
