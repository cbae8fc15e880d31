/* kvgen_compact.h -- C ABI of a kvgen family library's TriAttention compaction (ABI version 4).
 *
 * Every library built by `kvgen build` for a family with `triattention.enabled` exports these
 * symbols beside the codec's (kvgen_codec.h).  Semantics: TRIATTENTION.md §7.  For every layer,
 * KV head and request, the K and the V row of token src[m] is copied onto token dst[m], in place,
 * through the page table; no length changes and no page is freed.
 *
 * Pools: one kvgen_compact_pool per layer, layers 0..L-1 in the family's order.  Page p of a
 * layer's K pool starts at k_base + p * k_page_stride_bytes and holds the page densely in the
 * family's layout: HND [kv_heads][tokens_per_block][head_dim] or NHD
 * [tokens_per_block][kv_heads][head_dim], elements of elem_bytes.  V likewise.  Bases and strides
 * must be 16-byte aligned.  The pool array is host memory, read during the call only.
 *
 * Moves (as the Triton packer writes them, kvgen.reference.triattention.Moves):
 *   src, dst    int32 [num_layers][kv_heads][moves_per_head], row-major, device memory;
 *   offsets     int32 [max_requests + 1], device memory: request r owns slots
 *               offsets[r] .. offsets[r+1]-1 of every (layer, head) row (clamped to the row);
 *   slots holding -1 (fill) and slots with src == dst move nothing.
 * moves_per_head is the allocated row length (the packer's capacity), which may exceed
 * offsets[max_requests]: no value is read back to the host, so a call can be captured in a CUDA graph.
 * page_table: int32 [max_requests][>= pages of the longest request], row stride
 * page_table_stride elements, device memory; rows of requests that move nothing are not read.
 * The caller guarantees what the packer guarantees (§6): per (layer, head, request) sources strictly
 * increase and dst <= src; and that the page table maps every moved token to a page of the pools.
 *
 * kvgen_compact only enqueues work on `stream` (a cudaStream_t, NULL = legacy default stream):
 * no allocation, no synchronization.  It returns 1 when submission succeeded, 0 otherwise
 * (kvgen_compact_last_error() then says why).
 */
#ifndef KVGEN_COMPACT_H_
#define KVGEN_COMPACT_H_

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define KVGEN_COMPACT_ABI_VERSION 4

typedef enum kvgen_page_layout { KVGEN_LAYOUT_HND = 0, KVGEN_LAYOUT_NHD = 1 } kvgen_page_layout;

typedef struct kvgen_compact_pool { /* 32 bytes */
  void* k_base;
  int64_t k_page_stride_bytes;
  void* v_base;
  int64_t v_page_stride_bytes;
} kvgen_compact_pool;

/* What the library was generated for, so a loader can check its tensors without the family spec. */
typedef struct kvgen_compact_info {
  int32_t abi_version;      /* KVGEN_COMPACT_ABI_VERSION */
  int32_t num_layers;
  int32_t kv_heads;
  int32_t head_dim;
  int32_t tokens_per_block;
  int32_t elem_bytes;       /* 2 (bf16, fp16) or 1 (fp8_e4m3) */
  int32_t layout;           /* kvgen_page_layout */
  int32_t threads;          /* launch parameters the library was built with */
  int32_t tile_tokens;
  int32_t slices;           /* CTAs per (request, KV head, layer), each copying 1/slices of every row (ABI 2) */
  int32_t load_ahead;       /* tiles loading while one is stored (ABI 3) */
  int32_t index_ahead;      /* 1: move indices fetched a tile before they are resolved (ABI 3) */
  int32_t tail_split;       /* CTAs each (request, KV head, layer, slice) past the last whole multiple of
                               the SM count is split into (ABI 4) */
} kvgen_compact_info;

int kvgen_compact_abi_version(void);
/* Fills *info; returns 1 (0 if info is NULL). */
int kvgen_compact_query_info(kvgen_compact_info* info);
/* Message of the last failed call into this library on this thread ("" if none; shared with kvgen_last_error). */
const char* kvgen_compact_last_error(void);

int kvgen_compact(const kvgen_compact_pool* pools, int num_layers, const int32_t* page_table,
                  int64_t page_table_stride, int max_requests, const int32_t* src, const int32_t* dst,
                  const int32_t* offsets, int64_t moves_per_head, void* stream);

/* ---- Bounds-checked entry points ---------------------------------------------------------------
 * kvgen_compact_checked is kvgen_compact told the page table's row width (pages per row) and how
 * many pages each layer's pools hold, so no move and no page table entry can make it touch memory
 * it was not given.  The moves and the page table are device memory, so the kernel checks them:
 * a move whose src or dst token is not below page_table_width * tokens_per_block (other than the
 * -1 fill), or whose page table entry is not a page of the pools, is skipped (nothing is read or
 * written for it) and recorded.  The next call then fails (0, nothing enqueued,
 * kvgen_compact_last_error() says what was skipped), as does kvgen_compact_check_device_errors,
 * and the record is cleared.  No synchronization: the record is mapped pinned host memory, so a
 * check sees the kernels that have finished (synchronize the stream first to see them all).
 * The record is allocated by the first call or check: make one before capturing a CUDA graph.
 * kvgen_compact checks only that tokens and page ids are >= 0.
 */
typedef struct kvgen_compact_pool_extent { /* 40 bytes */
  void* k_base;
  int64_t k_page_stride_bytes;
  void* v_base;
  int64_t v_page_stride_bytes;
  int64_t num_pages; /* pages 0 .. num_pages-1 exist in both the K and the V pool */
} kvgen_compact_pool_extent;

int kvgen_compact_checked(const kvgen_compact_pool_extent* pools, int num_layers, const int32_t* page_table,
                          int64_t page_table_stride, int64_t page_table_width, int max_requests, const int32_t* src,
                          const int32_t* dst, const int32_t* offsets, int64_t moves_per_head, void* stream);
/* 1 if no compaction kernel of this library skipped a move since the last check or call; else 0,
 * kvgen_compact_last_error() says what was skipped, and the record is cleared. */
int kvgen_compact_check_device_errors(void);

#ifdef __cplusplus
}
#endif

#endif /* KVGEN_COMPACT_H_ */
