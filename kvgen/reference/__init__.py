"""The oracle: plain PyTorch statements of COLD_PAGE_FORMAT.md and TRIATTENTION.md.

Every kernel kvgen generates is tested against these functions (bytes for the codec, packer and
compaction; a stated tolerance for scores).

The codec functions and the submodules load on first use: the spec validator imports the
torch-free ``kvgen.reference.triattention_family``, and importing this package must not import
torch for it (the CLI starts without torch).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__all__ = [
    "decode_layer", "decode_page", "decode_record", "decode_records", "encode_layer", "encode_page",
    "encode_record", "encode_records", "nvfp4",
]

_CODEC = frozenset(__all__) - {"nvfp4"}

if TYPE_CHECKING:
    from kvgen.reference import nvfp4
    from kvgen.reference.codec import (
        decode_layer,
        decode_page,
        decode_record,
        decode_records,
        encode_layer,
        encode_page,
        encode_record,
        encode_records,
    )


def __getattr__(name: str) -> Any:
    if name in _CODEC:
        return getattr(importlib.import_module("kvgen.reference.codec"), name)
    if name in ("codec", "nvfp4", "triattention", "triattention_calib", "triattention_family"):
        return importlib.import_module(f"kvgen.reference.{name}")
    raise AttributeError(f"module 'kvgen.reference' has no attribute {name!r}")
