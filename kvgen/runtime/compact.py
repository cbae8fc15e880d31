"""``Compactor``: TriAttention's in-place compaction (``kvgen/csrc/kvgen_compact.h``) of one family,
driven from torch tensors.

The pools are registered once (their addresses travel by value in every launch); a call takes the
page table and the packed moves, checks only tensor metadata (no device value is read) and
enqueues the kernel on a stream, so it can be captured in a CUDA graph. Imports nothing of the
build side (no spec, no pydantic): the library describes its own geometry.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from pathlib import Path

import torch

from kvgen.artifacts.dispatch import compact_work, dispatch_rows, serving
from kvgen.runtime.library import LibraryError, load_once, load_typed

COMPACT_ABI_VERSION = 4  # 2: kvgen_compact_info.slices; 3: load_ahead, index_ahead; 4: tail_split
LAYOUTS = ("HND", "NHD")  # kvgen_page_layout
GEOMETRY = ("num_layers", "kv_heads", "head_dim", "tokens_per_block", "elem_bytes", "layout")
# The launch parameters the library was built with (kvgen_compact_info after the geometry).
LAUNCH = ("threads", "tile_tokens", "slices", "load_ahead", "index_ahead", "tail_split")


class CompactPool(ctypes.Structure):
    _fields_ = [("k_base", ctypes.c_void_p), ("k_page_stride_bytes", ctypes.c_int64),
                ("v_base", ctypes.c_void_p), ("v_page_stride_bytes", ctypes.c_int64)]


class CompactPoolExtent(ctypes.Structure):
    """``kvgen_compact_pool_extent``: a layer's pools with the pages both hold (kvgen_compact_checked)."""

    _fields_ = CompactPool._fields_ + [("num_pages", ctypes.c_int64)]


class CompactInfo(ctypes.Structure):
    _fields_ = [(name, ctypes.c_int32) for name in ("abi_version", *GEOMETRY, *LAUNCH)]

    def as_dict(self) -> dict[str, int | str]:
        info: dict[str, int | str] = {name: getattr(self, name) for name, _ in self._fields_}
        info["layout"] = LAYOUTS[self.layout]
        return info


_c = ctypes
_SIGNATURES = {
    "kvgen_compact_abi_version": (_c.c_int, []),
    "kvgen_compact_query_info": (_c.c_int, [_c.POINTER(CompactInfo)]),
    "kvgen_compact_last_error": (_c.c_char_p, []),
    "kvgen_compact": (_c.c_int, [_c.POINTER(CompactPool), _c.c_int, _c.c_void_p, _c.c_int64, _c.c_int, _c.c_void_p,
                                 _c.c_void_p, _c.c_void_p, _c.c_int64, _c.c_void_p]),
    # bounds-checked entry points (second block of kvgen_compact.h)
    "kvgen_compact_checked": (_c.c_int, [_c.POINTER(CompactPoolExtent), _c.c_int, _c.c_void_p, _c.c_int64,
                                         _c.c_int64, _c.c_int, _c.c_void_p, _c.c_void_p, _c.c_void_p, _c.c_int64,
                                         _c.c_void_p]),
    "kvgen_compact_check_device_errors": (_c.c_int, []),
}


class CompactLibrary:
    """The compaction entry points of a family library, ABI checked and geometry read at load."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._lib = load_typed(self.path, _SIGNATURES, "the family was built without TriAttention "
                               "(triattention.enabled) or by an older kvgen (rebuild it with kvgen build)")
        for name in _SIGNATURES:
            setattr(self, name, getattr(self._lib, name))
        abi = self.kvgen_compact_abi_version()
        if abi != COMPACT_ABI_VERSION:
            raise LibraryError(f"{self.path}: compaction ABI version {abi}, this kvgen runtime speaks "
                               f"{COMPACT_ABI_VERSION}; rebuild with kvgen build")
        info = CompactInfo()
        self.kvgen_compact_query_info(ctypes.byref(info))
        self.info = info.as_dict()

    def last_error(self) -> str:
        return self.kvgen_compact_last_error().decode(errors="replace")


def _page_shape(info: dict) -> tuple[int, int, int]:
    if info["layout"] == "HND":
        return info["kv_heads"], info["tokens_per_block"], info["head_dim"]
    return info["tokens_per_block"], info["kv_heads"], info["head_dim"]


def check_pool(pool: torch.Tensor, info: dict, what: str) -> None:
    """A pool is ``[num_pages, *page]`` with dense pages of the library's layout and dtype size;
    any page stride (a K or V view of a combined pool is fine) as long as it is 16-byte aligned."""
    page = _page_shape(info)
    if pool.dim() != 4 or tuple(pool.shape[1:]) != page or pool.element_size() != info["elem_bytes"]:
        raise ValueError(f"{what}: expected [pages, {', '.join(map(str, page))}] ({info['layout']}) of "
                         f"{info['elem_bytes']}-byte elements, got {list(pool.shape)} {pool.dtype}")
    if pool.shape[0] and not pool[0].is_contiguous():
        raise ValueError(f"{what}: pages must be dense (only the page stride may differ)")
    if pool.data_ptr() % 16 or (pool.stride(0) * pool.element_size()) % 16:
        raise ValueError(f"{what}: base and page stride must be 16-byte aligned")
    if not pool.is_cuda:
        raise ValueError(f"{what}: pools must be CUDA tensors")


def _stream_handle(stream: torch.cuda.Stream | None, device: torch.device) -> int:
    """The stream (default: ``device``'s current one), which must belong to ``device``, as must the
    current device (kernels launch on it)."""
    stream = stream or torch.cuda.current_stream(device)
    if stream.device != device:
        raise ValueError(f"stream: on {stream.device}, the pools on {device}")
    if torch.cuda.current_device() != device.index:
        raise ValueError(f"the current CUDA device is cuda:{torch.cuda.current_device()}, the pools are on {device}: "
                         f"call it under torch.cuda.device({device.index})")
    return stream.cuda_stream


class Compactor:
    """Compaction over fixed K and V pools (one pair per layer of the family).

    ``variants``: ``(from_work, library)`` of the size-dispatched compaction libraries a registry
    lists (ascending, ``kvgen.artifacts.dispatch``): a call of ``max_requests`` request slots goes
    to the last one whose threshold it reaches, else to ``library``. Each is checked to compile the
    same geometry; only the launch shape differs.

    Checked without synchronizing: pools (layers, page shape, element size, alignment, one CUDA
    device) at construction; the moves' and page table's dtypes, shapes and devices per call. Their
    values are device memory, so the kernel checks them against the page table's width and the
    pools' page counts: a move out of range is skipped and the next call (or
    ``check_device_errors``) raises ``LibraryError`` saying what was skipped."""

    def __init__(self, library: CompactLibrary | str | Path, k_pools: Sequence[torch.Tensor],
                 v_pools: Sequence[torch.Tensor], variants: Sequence[tuple[int, CompactLibrary | str | Path]] = ()):
        self.library, loaded = load_once(library, variants, CompactLibrary)
        self.thresholds = [int(start) for start, _ in loaded]
        self.variants = [lib for _, lib in loaded]
        info = self.library.info
        for variant in self.variants:
            if any(variant.info[k] != info[k] for k in GEOMETRY):
                raise LibraryError(f"{variant.path}: a compaction variant of another geometry than {self.library.path} "
                                   f"({', '.join(f'{k} {variant.info[k]} vs {info[k]}' for k in GEOMETRY)})")
        if len(k_pools) != info["num_layers"] or len(v_pools) != info["num_layers"]:
            raise ValueError(f"{self.library.path}: {info['num_layers']} layers, got {len(k_pools)} K and "
                             f"{len(v_pools)} V pools")
        for layer, (k, v) in enumerate(zip(k_pools, v_pools)):
            check_pool(k, info, f"K pool of layer {layer}")
            check_pool(v, info, f"V pool of layer {layer}")
        self.device = k_pools[0].device
        for layer, (k, v) in enumerate(zip(k_pools, v_pools)):
            if k.device != self.device or v.device != self.device:
                raise ValueError(f"pools of layer {layer}: on {k.device} (K) and {v.device} (V), layer 0's K on "
                                 f"{self.device}; every pool must be on one device")
        self._pools = (list(k_pools), list(v_pools))  # keep the memory alive while registered
        self._descs = (CompactPoolExtent * len(k_pools))(*[
            CompactPoolExtent(k.data_ptr(), k.stride(0) * k.element_size(), v.data_ptr(),
                              v.stride(0) * v.element_size(), min(k.shape[0], v.shape[0]))
            for k, v in zip(k_pools, v_pools)])
        with torch.cuda.device(self.device):  # allocates each library's error record (never while capturing)
            self.check_device_errors()

    def _check_moves(self, page_table: torch.Tensor, src: torch.Tensor, dst: torch.Tensor,
                     offsets: torch.Tensor) -> None:
        info = self.library.info
        rows = (info["num_layers"], info["kv_heads"])
        for name, t in (("src", src), ("dst", dst)):
            if t.dtype != torch.int32 or t.dim() != 3 or tuple(t.shape[:2]) != rows or not t.is_contiguous():
                raise ValueError(f"{name}: expected a contiguous int32 [{rows[0]}, {rows[1]}, N] tensor, got "
                                 f"{list(t.shape)} {t.dtype}")
        if src.shape != dst.shape:
            raise ValueError(f"src {list(src.shape)} and dst {list(dst.shape)} differ")
        if offsets.dtype != torch.int32 or offsets.dim() != 1 or offsets.numel() < 1 or not offsets.is_contiguous():
            raise ValueError("offsets: expected a contiguous int32 [max_requests + 1] tensor")
        max_requests = offsets.numel() - 1
        if page_table.dtype != torch.int32 or page_table.dim() != 2 or page_table.stride(1) != 1:
            raise ValueError("page_table: expected an int32 [requests, pages] tensor with unit column stride")
        if page_table.shape[0] < max_requests:
            raise ValueError(f"page_table has {page_table.shape[0]} rows for {max_requests} requests; pad it to "
                             "max_requests rows (rows of requests that move nothing are never read)")
        for name, t in (("page_table", page_table), ("src", src), ("dst", dst), ("offsets", offsets)):
            if t.device != self.device:
                raise ValueError(f"{name} is on {t.device}, the pools on {self.device}")

    def __call__(self, page_table: torch.Tensor, src: torch.Tensor, dst: torch.Tensor, offsets: torch.Tensor,
                 stream: torch.cuda.Stream | None = None) -> None:
        """Enqueue the compaction of every (layer, KV head, request) on ``stream`` (default: current),
        by the library serving ``offsets.numel() - 1`` request slots."""
        self._check_moves(page_table, src, dst, offsets)
        library = self.library_for(offsets.numel() - 1)
        ok = library.kvgen_compact_checked(
            self._descs, len(self._descs), page_table.data_ptr(), page_table.stride(0), page_table.shape[1],
            offsets.numel() - 1, src.data_ptr(), dst.data_ptr(), offsets.data_ptr(), src.shape[2],
            _stream_handle(stream, self.device))
        if not ok:
            raise LibraryError(f"{library.path}: {library.last_error()}")

    def library_for(self, max_requests: int) -> CompactLibrary:
        """The library serving a call of ``max_requests`` request slots."""
        index = serving(self.thresholds, compact_work(max_requests))
        return self.library if index is None else self.variants[index]

    def describe(self) -> list[dict[str, object]]:
        """Which library serves which calls (``from_work``: request slots)."""
        return dispatch_rows(self.library.path, [(start, lib.path) for start, lib in zip(self.thresholds, self.variants)])

    def check_device_errors(self) -> None:
        """``LibraryError`` if a compaction kernel of these libraries skipped a move since the last
        check or call (then cleared). No synchronization: it sees the kernels that have finished, so
        synchronize the stream first to see all of them."""
        for library in {id(lib): lib for lib in (self.library, *self.variants)}.values():
            if not library.kvgen_compact_check_device_errors():
                raise LibraryError(f"{library.path}: {library.last_error()}")
