// C ABI of a kvgen TriAttention move packer, lib kvgen_<family>_pack.so (one family, one arch).
//
// The library holds the Triton kernels of kvgen/kernels/triton/pack.py compiled ahead of time for
// the arch (the images embedded); it opens the CUDA driver (libcuda.so.1, CUDA 12.0 or newer)
// itself and links no CUDA library: no Triton, no Python, no cudart. kvgen_pack turns the kept positions of a round (kvgen_select_keep)
// into the move rows kvgen_compact consumes, exactly kvgen.reference.triattention.pack_moves
// (TRIATTENTION.md §6):
//
//   offsets [max_requests + 1] int32: request r owns slots offsets[r] .. offsets[r+1]-1 of every
//           (layer, KV head) row; a due request owns budget + tail[r] slots, others none.
//   src, dst [num_layers, kv_heads, capacity] int32: slot m of request r moves token src to
//           position dst = P[r] + m; -1 (MOVE_FILL) in every slot that moves nothing.
//
// Every pointer is device memory unless said otherwise; every tensor is contiguous. The kernels
// read kept only for the `batch` requests and write src/dst only inside their `capacity` slots:
// moves past capacity are dropped, whatever the device holds. Calls are asynchronous on `stream`
// (a cudaStream_t, 0 for the legacy default) with the stream's device current. Return 0 on
// success; otherwise a nonzero code and kvgen_pack_last_error() says why (thread-local text).
#ifndef KVGEN_PACK_H_
#define KVGEN_PACK_H_

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define KVGEN_PACK_ABI_VERSION 1

// Error codes (besides CUresult values of a failed launch, returned as is).
#define KVGEN_PACK_EINVAL (-1)   // an argument is out of range; the message names it
#define KVGEN_PACK_ELOAD (-2)    // the embedded kernels could not be loaded on this device

// Eviction modes, as in kvgen_select.h: the decision rows kept has per request.
#define KVGEN_PACK_UNION 0               // 1
#define KVGEN_PACK_PER_HEAD 1            // kv_heads
#define KVGEN_PACK_PER_LAYER_PERHEAD 2   // num_layers * kv_heads

typedef struct {
  int32_t abi_version;   // KVGEN_PACK_ABI_VERSION
  int32_t num_layers;
  int32_t kv_heads;
  int32_t block;         // moves per program step (tunable)
} kvgen_pack_geometry;

int kvgen_pack_abi_version(void);
const char* kvgen_pack_family_name(void);
const char* kvgen_pack_arch(void);
const char* kvgen_pack_last_error(void);
int kvgen_pack_query_geometry(kvgen_pack_geometry* out);   // host pointer
// Host array [num_layers]: each layer's sliding window, 0 for a scored (full-attention) layer.
// kvgen_pack_moves reads a device copy of it.
const int32_t* kvgen_pack_layer_windows(void);

// offsets [max_requests + 1] from tail [batch] int64 and due [batch] int8 (nonzero: due).
int kvgen_pack_offsets(const int64_t* tail, const int8_t* due, int32_t* offsets, int32_t batch, int32_t max_requests,
                       int32_t budget, void* stream);

// src, dst from kept [batch, rows(mode), budget] int64, P and S [batch] int64 and the offsets of
// kvgen_pack_offsets (same batch, max_requests, budget). layer_windows: int32 [num_layers], a
// device copy of kvgen_pack_layer_windows().
int kvgen_pack_moves(int32_t mode, const int64_t* kept, const int64_t* P, const int64_t* S,
                     const int32_t* layer_windows, const int32_t* offsets, int32_t* src, int32_t* dst, int32_t batch,
                     int32_t max_requests, int32_t budget, int32_t capacity, void* stream);

#ifdef __cplusplus
}
#endif

#endif  // KVGEN_PACK_H_
