/* tests/csrc/abi_v1_check.c -- ABI version 2 keeps version 1 unchanged (compiled by tests/test_c_abi.py).
 *
 * Every version-1 declaration of kvgen_codec.h, copied verbatim from version 1, beside the current
 * header: a C compiler refuses a redeclaration with another signature, and the static asserts pin
 * the version-1 structs' layout. */
#include <stddef.h>

#include "kvgen_codec.h"

int kvgen_abi_version(void);
const char* kvgen_family_name(void);
const char* kvgen_last_error(void);
kvgen_codec* kvgen_codec_configure(const kvgen_pool_desc* descs, int64_t num_descs,
                                   kvgen_index_location index_location);
void kvgen_codec_destroy(kvgen_codec* codec);
int kvgen_codec_num_lifecycles(const kvgen_codec* codec);
int64_t kvgen_codec_query_cold_page_bytes(const kvgen_codec* codec, int lifecycle);
int kvgen_codec_get_batching_layer_group_id(const kvgen_codec* codec, int lifecycle);
kvgen_index_location kvgen_codec_query_page_index_location(const kvgen_codec* codec, int lifecycle);
int kvgen_codec_encode(kvgen_codec* codec, int lifecycle, void* cold_base, const kvgen_page_pair* pairs,
                       int64_t num_pairs, void* stream);
int kvgen_codec_decode(kvgen_codec* codec, int lifecycle, const void* cold_base, const kvgen_page_pair* pairs,
                       int64_t num_pairs, void* stream);

_Static_assert(sizeof(kvgen_pool_desc) == 16 && offsetof(kvgen_pool_desc, page_stride_bytes) == 8, "pool desc");
_Static_assert(sizeof(kvgen_page_pair) == 8 && offsetof(kvgen_page_pair, src) == 4, "page pair");
_Static_assert(KVGEN_INDEX_HOST == 0 && KVGEN_INDEX_DEVICE == 1, "index location");
_Static_assert(KVGEN_ABI_VERSION == 2, "this check is for ABI version 2");
