"""ctypes bindings of one family library (``kvgen/csrc/kvgen_codec.h``)."""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

ABI_VERSION = 2
STAGED_ABI_VERSION = 2   # first version with kvgen_codec_set_staging / offload / onboard


class LibraryError(RuntimeError):
    """A library that cannot be used; the message names the file."""


Loaded = TypeVar("Loaded")


def load_once(main: Loaded | str | Path, variants: Sequence[tuple[int, Loaded | str | Path]],
              load: Callable[[Path], Loaded]) -> tuple[Loaded, list[tuple[int, Loaded]]]:
    """An op's main library and its size-dispatched variants ``(from_work, library)``, each file
    loaded by ``load`` once (a variant compiling to the main plan names the main file); an already
    loaded library is kept as given."""
    loaded: dict[Path, Loaded] = {}

    def one(item: Loaded | str | Path) -> Loaded:
        if not isinstance(item, (str, Path)):
            return item
        path = Path(item)
        if path not in loaded:
            loaded[path] = load(path)
        return loaded[path]

    return one(main), [(start, one(item)) for start, item in variants]


class PoolDesc(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("page_stride_bytes", ctypes.c_int64)]


class PoolExtent(ctypes.Structure):
    """``kvgen_pool_extent``: a pool descriptor with its page count (bounds-checked entry points)."""

    _fields_ = [("base", ctypes.c_void_p), ("page_stride_bytes", ctypes.c_int64), ("num_pages", ctypes.c_int64)]


_c = ctypes
_SIGNATURES = {
    "kvgen_abi_version": (_c.c_int, []),
    "kvgen_family_name": (_c.c_char_p, []),
    "kvgen_last_error": (_c.c_char_p, []),
    "kvgen_codec_configure": (_c.c_void_p, [_c.POINTER(PoolDesc), _c.c_int64, _c.c_int]),
    "kvgen_codec_destroy": (None, [_c.c_void_p]),
    "kvgen_codec_num_lifecycles": (_c.c_int, [_c.c_void_p]),
    "kvgen_codec_query_cold_page_bytes": (_c.c_int64, [_c.c_void_p, _c.c_int]),
    "kvgen_codec_get_batching_layer_group_id": (_c.c_int, [_c.c_void_p, _c.c_int]),
    "kvgen_codec_query_page_index_location": (_c.c_int, [_c.c_void_p, _c.c_int]),
    "kvgen_codec_encode": (_c.c_int, [_c.c_void_p, _c.c_int, _c.c_void_p, _c.c_void_p, _c.c_int64, _c.c_void_p]),
    "kvgen_codec_decode": (_c.c_int, [_c.c_void_p, _c.c_int, _c.c_void_p, _c.c_void_p, _c.c_int64, _c.c_void_p]),
    # bounds-checked entry points (second block of kvgen_codec.h)
    "kvgen_codec_configure_checked": (_c.c_void_p, [_c.POINTER(PoolExtent), _c.c_int64, _c.c_int]),
    "kvgen_codec_encode_checked": (_c.c_int, [_c.c_void_p, _c.c_int, _c.c_void_p, _c.c_int64, _c.c_void_p, _c.c_int64,
                                              _c.c_void_p]),
    "kvgen_codec_decode_checked": (_c.c_int, [_c.c_void_p, _c.c_int, _c.c_void_p, _c.c_int64, _c.c_void_p, _c.c_int64,
                                              _c.c_void_p]),
    "kvgen_codec_check_device_errors": (_c.c_int, [_c.c_void_p]),
}

_STAGED_SIGNATURES = {
    "kvgen_codec_set_staging": (_c.c_int, [_c.c_void_p, _c.c_void_p, _c.c_int64]),
    "kvgen_codec_staging_bytes": (_c.c_int64, [_c.c_void_p]),
    "kvgen_codec_offload": (_c.c_int, [_c.c_void_p, _c.c_int, _c.c_void_p, _c.c_int64, _c.c_void_p, _c.c_int64,
                                       _c.c_void_p]),
    "kvgen_codec_onboard": (_c.c_int, [_c.c_void_p, _c.c_int, _c.c_void_p, _c.c_int64, _c.c_void_p, _c.c_int64,
                                       _c.c_void_p]),
}

# Per-layer scales (extends ABI 2): exported by every library this kvgen builds; a library of an
# older kvgen lacks them, and so cannot serve a family with per-layer scales.
_LAYER_SCALE_SIGNATURES = {
    "kvgen_codec_set_layer_scales": (_c.c_int, [_c.c_void_p, _c.POINTER(_c.c_float), _c.POINTER(_c.c_float),
                                                _c.c_int64]),
    "kvgen_codec_layer_scale_buffers": (_c.c_int, [_c.c_void_p]),
}


Signatures = dict[str, tuple[object, list]]


def load_typed(path: Path, signatures: Signatures, missing_hint: str) -> ctypes.CDLL:
    """dlopen ``path`` (RTLD_LOCAL: every family library exports the same names) and give each
    entry point its C types; a missing one is a LibraryError naming the file and ``missing_hint``."""
    try:
        lib = ctypes.CDLL(str(path), mode=ctypes.RTLD_LOCAL)
    except OSError as exc:
        raise LibraryError(f"{path}: cannot load: {exc}") from None
    for name, (restype, argtypes) in signatures.items():
        try:
            fn = getattr(lib, name)
        except AttributeError:
            raise LibraryError(f"{path}: missing entry point {name}; {missing_hint}") from None
        fn.restype = restype
        fn.argtypes = argtypes
    return lib


class TritonAotLibrary:
    """What the Triton AOT libraries (``lib<symbol>_pack.so``, ``lib<symbol>_select.so``) share:
    dlopen with typed entry points ``<PREFIX>_<name>``, the ABI and family checks at load, calls
    that raise the library's last error, and the refusal of tensors off the GPU."""

    PREFIX: str          # "kvgen_pack", "kvgen_select"
    KIND: str            # "pack", "selection"
    ABI_VERSION: int
    SIGNATURES: Signatures

    def _open(self, path: str | Path, family: str | None) -> None:
        self.path = Path(path)
        self._lib = load_typed(self.path, self.SIGNATURES, f"not a kvgen {self.KIND} library, or one built by an "
                               "older kvgen (rebuild it with kvgen build)")
        abi = self._entry("abi_version")()
        if abi != self.ABI_VERSION:
            raise LibraryError(f"{self.path}: {self.KIND} ABI version {abi}, this runtime speaks {self.ABI_VERSION}; "
                               "rebuild with kvgen build")
        self.family = self._entry("family_name")().decode()
        self.arch = self._entry("arch")().decode()
        if family is not None and family != self.family:
            raise LibraryError(f"{self.path}: built for family {self.family!r}, not {family!r}")

    def _entry(self, name: str):  # noqa: ANN202 - a ctypes function
        return getattr(self._lib, f"{self.PREFIX}_{name}")

    def _call(self, name: str, *args: object) -> None:
        if self._entry(name)(*args) != 0:
            raise LibraryError(f"{self.path}: {self._entry('last_error')().decode(errors='replace')}")

    def _check_device(self, tensor) -> None:  # noqa: ANN001 - a torch.Tensor (this module imports no torch)
        if tensor.device.type != "cuda":
            raise ValueError(f"{self.path.name}: tensors must be on a CUDA device, got {tensor.device}")


class FamilyLibrary:
    """A loaded ``lib<kvgen_family>.so``: typed entry points, ABI and family checked at load."""

    def __init__(self, path: str | Path, family: str | None = None):
        self.path = Path(path)
        self._lib = load_typed(self.path, _SIGNATURES, "not a kvgen family library, or one built by an older "
                               "kvgen (rebuild it with kvgen build)")
        for name in _SIGNATURES:
            setattr(self, name, getattr(self._lib, name))
        self.abi = abi = self.kvgen_abi_version()
        if abi not in (1, ABI_VERSION):
            raise LibraryError(f"{self.path}: C ABI version {abi}, this kvgen runtime speaks 1 and {ABI_VERSION}; "
                               "rebuild with kvgen build")
        if abi >= STAGED_ABI_VERSION:   # a version-1 library still loads, without the staged paths
            for name, (restype, argtypes) in _STAGED_SIGNATURES.items():
                fn = getattr(self._lib, name)
                fn.restype, fn.argtypes = restype, argtypes
                setattr(self, name, fn)
        self.layer_scales = all(hasattr(self._lib, name) for name in _LAYER_SCALE_SIGNATURES)
        if self.layer_scales:
            for name, (restype, argtypes) in _LAYER_SCALE_SIGNATURES.items():
                fn = getattr(self._lib, name)
                fn.restype, fn.argtypes = restype, argtypes
                setattr(self, name, fn)
        self.family = self.kvgen_family_name().decode()
        if family is not None and family != self.family:
            raise LibraryError(f"{self.path}: built for family {self.family!r}, not {family!r}")

    def last_error(self) -> str:
        return self.kvgen_last_error().decode(errors="replace")
