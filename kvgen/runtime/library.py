"""ctypes bindings of one family library (``kvgen/csrc/kvgen_codec.h``)."""

from __future__ import annotations

import ctypes
from pathlib import Path

ABI_VERSION = 1


class LibraryError(RuntimeError):
    """A library that cannot be used; the message names the file."""


class PoolDesc(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("page_stride_bytes", ctypes.c_int64)]


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
}


class FamilyLibrary:
    """A loaded ``lib<kvgen_family>.so``: typed entry points, ABI and family checked at load."""

    def __init__(self, path: str | Path, family: str | None = None):
        self.path = Path(path)
        try:
            self._lib = ctypes.CDLL(str(self.path), mode=ctypes.RTLD_LOCAL)
        except OSError as exc:
            raise LibraryError(f"{self.path}: cannot load: {exc}") from None
        for name, (restype, argtypes) in _SIGNATURES.items():
            try:
                fn = getattr(self._lib, name)
            except AttributeError:
                raise LibraryError(f"{self.path}: missing entry point {name}; not a kvgen family library") from None
            fn.restype = restype
            fn.argtypes = argtypes
            setattr(self, name, fn)
        abi = self.kvgen_abi_version()
        if abi != ABI_VERSION:
            raise LibraryError(f"{self.path}: C ABI version {abi}, this kvgen runtime speaks {ABI_VERSION}; "
                               "rebuild with kvgen build")
        self.family = self.kvgen_family_name().decode()
        if family is not None and family != self.family:
            raise LibraryError(f"{self.path}: built for family {self.family!r}, not {family!r}")

    def last_error(self) -> str:
        return self.kvgen_last_error().decode(errors="replace")
