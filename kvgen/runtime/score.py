"""ctypes bindings of a TriAttention score library (``kvgen/csrc/kvgen_score.h``), torch in, no CUTLASS.

``ScoreLibrary(path)`` loads ``lib<kvgen_family>_score.so`` from the path the registry hands out
(``RuntimeRegistry.resolve(family, arch).artifact("score")``, which checked its sha256 against the
manifest), checks the ABI version and the family; ``check_geometry`` compares the kernel's
compile-time geometry with a family's ``TriGeometry``; ``score`` launches it on torch tensors after
checking their shapes, dtypes, devices and contiguity.

``ScoreDispatch`` is what a registry family serves: its score library and the size-dispatched
variants the tuner found faster for larger calls (``kvgen.artifacts.dispatch``), behind the same
interface; each call goes to the library of its work (requests x width).
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Sequence

import torch

from kvgen.artifacts.dispatch import dispatch_rows, score_work, serving
from kvgen.reference.triattention import TriGeometry
from kvgen.runtime.library import LibraryError, load_once, load_typed

ABI_VERSION = 2
PAIRINGS = ("half", "interleaved")
LAYOUTS = ("HND", "NHD")
DTYPES = ("bf16", "fp16", "fp8_e4m3")   # fp8 K is scored as stored (no scale: see kvgen_score.h)
TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8_e4m3": torch.float8_e4m3fn}
MAX_GRID_Z = 65535


class ScoreGeometry(ctypes.Structure):
    _fields_ = [(name, ctypes.c_int32) for name in (
        "abi_version", "head_dim", "query_heads", "kv_heads", "rotary_start", "rotary_dim", "pairing",
        "tokens_per_block", "layout", "dtype", "threads", "heads_per_pass", "passes", "vector_elems", "lanes",
        "tokens_per_cta")]

    def as_dict(self) -> dict[str, int | str]:
        out: dict[str, int | str] = {name: getattr(self, name) for name, _ in self._fields_}
        out["pairing"] = PAIRINGS[self.pairing]
        out["layout"] = LAYOUTS[self.layout]
        out["dtype"] = DTYPES[self.dtype]
        return out


_c = ctypes
_SIGNATURES = {
    "kvgen_score_abi_version": (_c.c_int, []),
    "kvgen_score_family_name": (_c.c_char_p, []),
    "kvgen_score_arch": (_c.c_char_p, []),
    "kvgen_score_last_error": (_c.c_char_p, []),
    "kvgen_score_query_geometry": (_c.c_int, [_c.POINTER(ScoreGeometry)]),
    "kvgen_score_check_device_errors": (_c.c_int, []),
    "kvgen_score": (_c.c_int, [_c.c_void_p, _c.c_int64, _c.c_int64, _c.c_void_p, _c.c_int32, _c.c_void_p, _c.c_void_p,
                               _c.c_void_p, _c.c_void_p, _c.c_void_p, _c.c_void_p, _c.c_void_p, _c.c_void_p,
                               _c.c_void_p, _c.c_int32, _c.c_int32, _c.c_int32, _c.c_void_p]),
}


class ScoreLibrary:
    """A loaded score library: typed entry points; ABI and family checked at load."""

    def __init__(self, path: str | Path, family: str | None = None):
        self.path = Path(path)
        self._lib = load_typed(self.path, _SIGNATURES, "not a kvgen score library")
        abi = self._lib.kvgen_score_abi_version()
        if abi != ABI_VERSION:
            raise LibraryError(f"{self.path}: score ABI version {abi}, this runtime speaks {ABI_VERSION}; "
                               "rebuild with kvgen build")
        self.family = self._lib.kvgen_score_family_name().decode()
        self.arch = self._lib.kvgen_score_arch().decode()
        if family is not None and family != self.family:
            raise LibraryError(f"{self.path}: built for family {self.family!r}, not {family!r}")
        raw = ScoreGeometry()
        if self._lib.kvgen_score_query_geometry(ctypes.byref(raw)) != 0:
            raise LibraryError(f"{self.path}: {self.last_error()}")
        self.geometry = raw.as_dict()

    def last_error(self) -> str:
        return self._lib.kvgen_score_last_error().decode(errors="replace")

    @property
    def freqs(self) -> int:
        return int(self.geometry["rotary_dim"]) // 2

    def check_geometry(self, geometry: TriGeometry, dtype: str) -> None:
        """The kernel must have been compiled for exactly this family geometry and K dtype."""
        expected = {"head_dim": geometry.head_dim, "query_heads": geometry.query_heads,
                    "kv_heads": geometry.kv_heads, "rotary_start": geometry.rotary_start,
                    "rotary_dim": geometry.rotary_dim, "pairing": geometry.pairing,
                    "tokens_per_block": geometry.tokens_per_block, "layout": geometry.layout, "dtype": dtype}
        wrong = [f"{k}: library {self.geometry[k]!r}, family {v!r}" for k, v in expected.items()
                 if self.geometry[k] != v]
        if wrong:
            raise LibraryError(f"{self.path}: compiled for another geometry ({'; '.join(wrong)}); rebuild it")

    def check_page_stride(self, page_stride: int) -> None:
        """``page_stride``: elements between the pages of a K pool, > 0, a multiple of the kernel's
        vector width (its loads are that wide and aligned)."""
        vector = int(self.geometry["vector_elems"])
        if not isinstance(page_stride, int) or isinstance(page_stride, bool) or page_stride <= 0 or page_stride % vector:
            raise ValueError(f"page_stride: {page_stride!r}, expected a positive multiple of {vector} elements")

    def score(self, k_layer_ptrs: torch.Tensor, page_stride: int, page_table: torch.Tensor, P: torch.Tensor,
              S: torch.Tensor, c: torch.Tensor, d: torch.Tensor, qr: torch.Tensor, qi: torch.Tensor,
              mlr: torch.Tensor, freq_scale_sq: torch.Tensor, scores: torch.Tensor,
              stream: torch.cuda.Stream | None = None, *, num_pages: int) -> None:
        """Enqueue the scores ``[layers, B, Hq, W]`` (see ``kvgen_score.h`` for every argument;
        ``num_pages``: pages in every K pool, page ids outside are skipped and raise on the next call).

        Checked here, without reading device memory: every tensor's dtype, shape, contiguity and
        device, ``page_stride``, the grid limit and the stream's device. ``P``, ``S``, the page ids
        and the K addresses are device values: the caller (``TriAttentionManager.score`` checks its
        host copies of ``P`` and ``S`` against the page table's width) and the kernel answer for them."""
        if scores.dim() != 4:
            raise ValueError(f"scores: expected [layers, batch, query_heads, width], got {list(scores.shape)}")
        if page_table.dim() != 2:
            raise ValueError(f"page_table: expected int32 [batch, pages], got {list(page_table.shape)}")
        self.check_page_stride(page_stride)
        layers, batch, heads, width = scores.shape
        F = self.freqs
        expected = {
            "k_layer_ptrs": (k_layer_ptrs, torch.int64, (layers,)),
            "page_table": (page_table, torch.int32, (batch, page_table.shape[-1])),
            "P": (P, torch.int32, (batch,)),
            "S": (S, torch.int32, (batch,)),
            "c": (c, torch.float32, (batch, F)),
            "d": (d, torch.float32, (batch, F)),
            "qr": (qr, torch.float32, (layers, heads, F)),
            "qi": (qi, torch.float32, (layers, heads, F)),
            "mlr": (mlr, torch.float32, (layers, heads, F)),
            "freq_scale_sq": (freq_scale_sq, torch.float32, (F,)),
            "scores": (scores, torch.float32, (layers, batch, self.geometry["query_heads"], width)),
        }
        device = scores.device
        for name, (tensor, dtype, shape) in expected.items():
            _check(name, tensor, dtype, shape, device)
        if layers * batch > MAX_GRID_Z:
            raise ValueError(f"layers * batch = {layers * batch} > {MAX_GRID_Z}; score fewer layers per call")
        if width and page_table.shape[1] == 0:
            raise ValueError("page_table: no pages per row, but width > 0 tokens are scored")
        if page_table.shape[1] >= 1 << 31:
            raise ValueError(f"page_table: {page_table.shape[1]} pages per row do not fit int32")
        stream = stream or torch.cuda.current_stream(device)
        if stream.device != device:
            raise ValueError(f"stream: on {stream.device}, scores on {device}")
        status = self._lib.kvgen_score(
            k_layer_ptrs.data_ptr(), page_stride, num_pages, page_table.data_ptr(), page_table.shape[1], P.data_ptr(),
            S.data_ptr(), c.data_ptr(), d.data_ptr(), qr.data_ptr(), qi.data_ptr(), mlr.data_ptr(),
            freq_scale_sq.data_ptr(), scores.data_ptr(), layers, batch, width, stream.cuda_stream)
        if status != 0:
            raise LibraryError(f"{self.path}: {self.last_error()}")

    def check_device_errors(self) -> None:
        """Raise if a finished kernel skipped a page id outside the pool (clears the record)."""
        if self._lib.kvgen_score_check_device_errors() != 0:
            raise LibraryError(f"{self.path}: {self.last_error()}")


class ScoreDispatch:
    """A family's score libraries by call size: ``main`` below the first threshold, then each
    ``(from_work, library)`` of ``variants`` (ascending) from its threshold on. Every library is
    checked like the main one (family, geometry, page stride); the attributes are the main one's."""

    def __init__(self, main: ScoreLibrary, variants: Sequence[tuple[int, ScoreLibrary]] = ()):
        self.main = main
        # what a caller of one library reads: the main library's identity and geometry
        self.path, self.family, self.arch, self.geometry = main.path, main.family, main.arch, main.geometry
        self.thresholds = [start for start, _ in variants]
        self.variants = [library for _, library in variants]
        for library in self.variants:
            if library.family != main.family or library.arch != main.arch:
                raise LibraryError(f"{library.path}: a variant of {library.family} for {library.arch}, "
                                   f"not of {main.family} for {main.arch}")

    @classmethod
    def from_resolved(cls, resolved) -> ScoreDispatch:   # noqa: ANN001 - kvgen.runtime.lookup.Resolved
        """The score libraries of a registry family (``Resolved.dispatch``), each file loaded once."""
        family = resolved.entry.family
        return cls(*load_once(*resolved.dispatch("score"), lambda path: ScoreLibrary(path, family=family)))

    def variant_index(self, batch: int, width: int) -> int | None:
        """Which variant serves ``batch`` requests of ``width`` tokens (None: the main library)."""
        return serving(self.thresholds, score_work(batch, width))

    def library_for(self, batch: int, width: int) -> ScoreLibrary:
        """The library serving ``batch`` requests of ``width`` tokens."""
        index = self.variant_index(batch, width)
        return self.main if index is None else self.variants[index]

    def _all(self) -> list[ScoreLibrary]:
        return list({id(lib): lib for lib in (self.main, *self.variants)}.values())

    def check_geometry(self, geometry: TriGeometry, dtype: str) -> None:
        for library in self._all():
            library.check_geometry(geometry, dtype)

    def check_page_stride(self, page_stride: int) -> None:
        for library in self._all():
            library.check_page_stride(page_stride)

    def score(self, k_layer_ptrs: torch.Tensor, page_stride: int, page_table: torch.Tensor, P: torch.Tensor,
              S: torch.Tensor, c: torch.Tensor, d: torch.Tensor, qr: torch.Tensor, qi: torch.Tensor,
              mlr: torch.Tensor, freq_scale_sq: torch.Tensor, scores: torch.Tensor,
              stream: torch.cuda.Stream | None = None, *, num_pages: int) -> None:
        """``ScoreLibrary.score`` on the library of this call's size (``scores`` is
        ``[layers, batch, heads, width]``)."""
        if scores.dim() != 4:
            raise ValueError(f"scores: expected [layers, batch, query_heads, width], got {list(scores.shape)}")
        library = self.library_for(scores.shape[1], scores.shape[3])
        library.score(k_layer_ptrs, page_stride, page_table, P, S, c, d, qr, qi, mlr, freq_scale_sq, scores, stream,
                      num_pages=num_pages)

    def check_device_errors(self) -> None:
        for library in self._all():
            library.check_device_errors()

    def describe(self) -> list[dict[str, object]]:
        """Which library serves which calls, for ``TriAttentionManager.describe``."""
        return dispatch_rows(self.main.path, [(start, lib.path) for start, lib in zip(self.thresholds, self.variants)])


def _check(name: str, tensor: torch.Tensor, dtype: torch.dtype, shape: Sequence[int], device: torch.device) -> None:
    if tensor.dtype != dtype or tuple(tensor.shape) != tuple(shape) or not tensor.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous {str(dtype).replace('torch.', '')} {list(shape)} tensor, "
                         f"got {str(tensor.dtype).replace('torch.', '')} {list(tensor.shape)}"
                         f"{'' if tensor.is_contiguous() else ' (not contiguous)'}")
    if tensor.device != device:
        raise ValueError(f"{name} is on {tensor.device}, scores on {device}")
