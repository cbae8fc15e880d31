/* kvgen_codec.h -- C ABI of a kvgen family library's cold-page codec (ABI version 2).
 *
 * Every library built by `kvgen build` (lib<kvgen_family>.so, one per family and arch) exports
 * these symbols with the meaning of TensorRT-LLM's IKvCacheColdPageCodec (COLD_PAGE_FORMAT.md §6).
 * A C++ KV-cache manager includes this header and dlopen()s the library (RTLD_LOCAL: every
 * family library exports the same names).  Plain C types only: no torch, no C++ ABI.
 *
 * Pool descriptors: one per (layer, buffer), layers in the family's order 0..L-1, and inside a
 * layer the quantized buffers (K then V; or the MLA latent / CSA entry) then the side buffers, as
 * `kvgen show FAMILY` lists them.  Hot page p of that buffer starts at base + p * page_stride_bytes
 * and holds the page exactly as the engine writes it (HND or NHD rows).  Bases and strides must
 * be 16-byte aligned for quantized buffers (side buffers: aligned to their copy word).
 *
 * encode/decode only enqueue work on `stream` and return 1 when submission succeeded, 0 otherwise
 * (kvgen_last_error() then says why).  Host index arrays are read during the call only; device
 * index arrays must stay valid until the stream work completes.
 *
 * Version 2 adds the staged offload/onboard block; every version-1 entry point keeps its signature
 * and meaning.  The per-layer scales block at the end extends version 2 (no entry point changes):
 * every library built by this kvgen exports it, and a family that declares per-layer scales (which
 * no older kvgen could build) needs it.
 */
#ifndef KVGEN_CODEC_H_
#define KVGEN_CODEC_H_

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define KVGEN_ABI_VERSION 2

typedef struct kvgen_pool_desc {
  void* base;
  int64_t page_stride_bytes;
} kvgen_pool_desc;

typedef struct kvgen_page_pair { /* 8 bytes, 8-aligned */
  int32_t dst;                   /* encode: cold slot; decode: hot page */
  int32_t src;                   /* encode: hot page;  decode: cold slot */
} kvgen_page_pair;

typedef enum kvgen_index_location {
  KVGEN_INDEX_HOST = 0,
  KVGEN_INDEX_DEVICE = 1
} kvgen_index_location;

typedef struct kvgen_codec kvgen_codec;

int kvgen_abi_version(void);
const char* kvgen_family_name(void);
/* Message of the last failed call on this thread ("" if none). */
const char* kvgen_last_error(void);

/* configure: descriptors for every layer × buffer of the family (see above).  Returns NULL on a
 * count or alignment error, or when the GPU cannot hold one layer record in shared memory. */
kvgen_codec* kvgen_codec_configure(const kvgen_pool_desc* descs, int64_t num_descs,
                                   kvgen_index_location index_location);
void kvgen_codec_destroy(kvgen_codec* codec);

int kvgen_codec_num_lifecycles(const kvgen_codec* codec);
/* Bytes of one cold page of a lifecycle; 0 for an unknown lifecycle. */
int64_t kvgen_codec_query_cold_page_bytes(const kvgen_codec* codec, int lifecycle);
/* Smallest equivalent lifecycle (identity: every lifecycle has its own pools). */
int kvgen_codec_get_batching_layer_group_id(const kvgen_codec* codec, int lifecycle);
kvgen_index_location kvgen_codec_query_page_index_location(const kvgen_codec* codec, int lifecycle);

/* cold_base: device memory or a mapped pinned host pointer (UVA); slot i at cold_base + i *
 * cold_page_bytes.  stream: a cudaStream_t (NULL = legacy default stream). */
int kvgen_codec_encode(kvgen_codec* codec, int lifecycle, void* cold_base, const kvgen_page_pair* pairs,
                       int64_t num_pairs, void* stream);
int kvgen_codec_decode(kvgen_codec* codec, int lifecycle, const void* cold_base, const kvgen_page_pair* pairs,
                       int64_t num_pairs, void* stream);

/* ---- Bounds-checked entry points ---------------------------------------------------------------
 * The same codec, told how many pages each pool holds and how many slots the cold buffer holds, so
 * no index can make it touch memory it was not given:
 *   - host index arrays: every pair is checked before anything is enqueued; the first pair out of
 *     range fails the call (0, nothing enqueued, kvgen_last_error() names the pair and the limit);
 *   - device index arrays: the kernels check every pair and skip those out of range (nothing is read
 *     or written for them) and record them; the next encode/decode of that codec then fails (0,
 *     nothing enqueued, kvgen_last_error() says what was skipped), as does
 *     kvgen_codec_check_device_errors, and the record is cleared.  Checking costs no
 *     synchronization: the record is mapped pinned host memory, so a check sees the kernels that
 *     have finished (synchronize the stream first to see them all).  Kernels replayed from a CUDA
 *     graph record too; the next host call or check reports them.
 * kvgen_codec_configure / _encode / _decode check indices >= 0 only (and hot pages against the page
 * counts when the codec was configured by kvgen_codec_configure_checked).
 */
typedef struct kvgen_pool_extent {
  void* base;
  int64_t page_stride_bytes;
  int64_t num_pages; /* pages 0 .. num_pages-1 exist at base + p * page_stride_bytes */
} kvgen_pool_extent;

/* As kvgen_codec_configure; a hot page index must be below num_pages of every pool of its lifecycle. */
kvgen_codec* kvgen_codec_configure_checked(const kvgen_pool_extent* pools, int64_t num_pools,
                                           kvgen_index_location index_location);
/* As kvgen_codec_encode / _decode; cold_slots: slots at cold_base (0 .. cold_slots-1). */
int kvgen_codec_encode_checked(kvgen_codec* codec, int lifecycle, void* cold_base, int64_t cold_slots,
                               const kvgen_page_pair* pairs, int64_t num_pairs, void* stream);
int kvgen_codec_decode_checked(kvgen_codec* codec, int lifecycle, const void* cold_base, int64_t cold_slots,
                               const kvgen_page_pair* pairs, int64_t num_pairs, void* stream);
/* 1 if no kernel of this codec skipped a device index since the last check or call; else 0,
 * kvgen_last_error() says what was skipped, and the record is cleared.  No synchronization. */
int kvgen_codec_check_device_errors(kvgen_codec* codec);

/* ---- ABI version 2: staged offload / onboard --------------------------------------------------
 *
 * Offload: the SMs encode chunks of pages into a device staging ring, the copy engine moves each
 * chunk's cold pages to host cold slots (cudaMemcpyAsync on an internal copy stream, one copy per
 * run of consecutive slots); onboard: the copy engine moves host cold slots into the ring, the SMs
 * decode from it.  Two ring slots, so chunk i's copy overlaps chunk i+1's encode/decode.  The SMs
 * work only for the encode/decode; a concurrent model stream keeps them otherwise.
 *
 * set_staging: `staging` = device memory of the current device (16-byte aligned, at least one cold
 * page of every lifecycle), or NULL to let the codec allocate `staging_bytes` (0: 64 MiB).  It also
 * creates the copy stream and events; call it once before offload/onboard (and before capturing).
 * A refused buffer (too small, misaligned, host memory, another device) leaves the previous one.
 * Needs a codec configured with KVGEN_INDEX_HOST: the copies' addresses come from the pairs.
 *
 * offload/onboard: `host_cold` = pinned host memory (cudaHostAlloc / cudaHostRegister; device
 * memory works too) holding `num_cold_slots` cold pages; pairs as for encode/decode.  Every cold
 * slot is checked against [0, num_cold_slots) before anything is enqueued.  Only kernels, async
 * copies and event record/wait are enqueued (no host sync, no allocation): CUDA-graph capturable.
 * The caller's stream waits for everything before its next work.  One staging ring per codec:
 * staged calls on different streams must be ordered by the caller. */
int kvgen_codec_set_staging(kvgen_codec* codec, void* staging, int64_t staging_bytes);
/* Bytes of the staging ring in use (0 before set_staging). */
int64_t kvgen_codec_staging_bytes(const kvgen_codec* codec);
int kvgen_codec_offload(kvgen_codec* codec, int lifecycle, void* host_cold, int64_t num_cold_slots,
                        const kvgen_page_pair* pairs, int64_t num_pairs, void* stream);
int kvgen_codec_onboard(kvgen_codec* codec, int lifecycle, const void* host_cold, int64_t num_cold_slots,
                        const kvgen_page_pair* pairs, int64_t num_pairs, void* stream);

/* ---- Per-layer second-level scales (extends ABI version 2) --------------------------------------
 *
 * A quantized buffer's global multipliers G (encode) and Q (decode) (COLD_PAGE_FORMAT.md §3) are
 * compiled in when the spec gives them (cold_page.scales.<buffer>: {G, Q}, default 1).  A buffer
 * declared `cold_page.scales.<buffer>: per_layer` takes one (G, Q) per layer at run time instead,
 * e.g. a checkpoint's calibrated per-layer K/V scales; encode and decode of such a codec fail
 * until kvgen_codec_set_layer_scales has succeeded.
 *
 * set_layer_scales: n = layers x kvgen_codec_layer_scale_buffers(codec) binary32 values each,
 * layer-major: G[l * k + j] is the j-th per-layer buffer (descriptor order) of layer l.  Q NULL:
 * Q = 1/G (correctly rounded).  Every value finite and > 0, else 0 and nothing changes.  The copy
 * to the device is synchronous: call it after configure, when no encode/decode of this codec is in
 * flight (it may be called again to change the scales).  A family without per-layer buffers refuses
 * it.  Decode of a per-layer buffer always takes the binary32 route (decode_route 1, the packed
 * table, is exact only for Q = 1, which is then not known at compile time). */
int kvgen_codec_set_layer_scales(kvgen_codec* codec, const float* G, const float* Q, int64_t n);
/* Quantized buffers per layer whose scales are per layer (0: all compiled in). */
int kvgen_codec_layer_scale_buffers(const kvgen_codec* codec);

#ifdef __cplusplus
}
#endif

#endif /* KVGEN_CODEC_H_ */
