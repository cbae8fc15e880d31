"""The oracle: plain PyTorch statements of COLD_PAGE_FORMAT.md and TRIATTENTION.md.

Every kernel kvgen generates is tested against these functions (bytes for the codec, packer and
compaction; a stated tolerance for scores).
"""

from kvgen.reference import nvfp4
from kvgen.reference.codec import (decode_layer, decode_page, decode_record, decode_records, encode_layer, encode_page,
                    encode_record, encode_records)

__all__ = [
    "decode_layer", "decode_page", "decode_record", "decode_records", "encode_layer", "encode_page",
    "encode_record", "encode_records", "nvfp4",
]
