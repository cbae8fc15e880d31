// C ABI of a kvgen TriAttention selection library, lib kvgen_<family>_select.so (one family, one arch).
//
// The library holds the family's normalize, aggregate and select kernels (TRIATTENTION.md §4-§5),
// the Triton kernels of kvgen/kernels/triton/select.py compiled ahead of time for the arch (the
// images embedded); it opens the CUDA driver (libcuda.so.1, CUDA 12.0 or newer) itself and links
// no CUDA library: no Triton, no Python, no cudart. The three calls after the scorer, in order:
//
//   kvgen_select_statistics: scores [scored, B, Hq, W] -> mean, std [scored, B, Hq] (zscore's)
//   kvgen_select_aggregate:  scores, mean, std -> decision values [B, R, W] (R: per mode)
//   kvgen_select_keep:       values -> kept positions [B, R, budget] ascending, -1 past the valid
//                            count; nan_rows [B, R]: NaN count of each row (the oracle refuses any)
//
// Their results equal kvgen.reference.triattention's zscore, aggregate and select_keep bit for bit.
// Every pointer is device memory unless said otherwise; every tensor is contiguous. A width
// width[b] past W counts as W: no kernel reads or writes outside the tensors described here,
// whatever the device holds. Calls are asynchronous on `stream` (a cudaStream_t, 0 for the
// legacy default) and must be made with the stream's device current (as torch does). Return 0 on
// success; otherwise a nonzero code and kvgen_select_last_error() says why (thread-local text).
#ifndef KVGEN_SELECT_H_
#define KVGEN_SELECT_H_

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// 3: kvgen_select_geometry gained stats_resident, select_route and select_warps.
// 4: kvgen_select_statistics_aggregate (and its work size); the geometry gained aggregate_route,
//    chunk_requests, queue_lag and queue_programs.
// 5: the geometry gained head_step.
#define KVGEN_SELECT_ABI_VERSION 5

// Error codes (besides CUresult values of a failed launch, returned as is).
#define KVGEN_SELECT_EINVAL (-1)   // an argument is out of range; the message names it
#define KVGEN_SELECT_ELOAD (-2)    // the embedded kernels could not be loaded on this device

// Eviction modes: R = 1 (union), Hkv (per_head), num_layers * Hkv (per_layer_perhead).
#define KVGEN_SELECT_UNION 0
#define KVGEN_SELECT_PER_HEAD 1
#define KVGEN_SELECT_PER_LAYER_PERHEAD 2

// Compile-time geometry and launch tunables of this library (kvgen_select_query_geometry).
typedef struct {
  int32_t abi_version;   // KVGEN_SELECT_ABI_VERSION
  int32_t num_layers;    // cache layers
  int32_t kv_heads;      // Hkv
  int32_t group;         // query heads per KV head: Hq = kv_heads * group
  int32_t num_scored;    // scored (full-attention) layers: kvgen_select_scored_layers
  int32_t rows;          // score rows per statistics program (tunable)
  int32_t block_w;       // columns per aggregation program (tunable)
  int32_t block;         // columns per selection step (tunable)
  int32_t radix_bits;    // key bits found per selection pass (tunable)
  int32_t stats_unroll;  // steps of 512 columns a statistics program loads at once (tunable)
  int32_t stats_warps;   // warps per statistics program (tunable)
  int32_t aggregate_warps;  // warps per aggregation program (tunable)
  int32_t stats_resident;   // columns a statistics program holds to read a row once, 0: twice (tunable)
  int32_t select_route;     // 0: a selection pass compares keys with candidates, 1: histograms (tunable)
  int32_t select_warps;     // warps per selection program (tunable)
  int32_t aggregate_route;  // 0: statistics then aggregate; 1: kvgen_select_statistics_aggregate (tunable)
  int32_t chunk_requests;   // requests of one scored layer per chunk of that queue (tunable)
  int32_t queue_lag;        // chunks of statistics queued ahead of their aggregation (tunable)
  int32_t queue_programs;   // that queue's programs per multiprocessor (tunable)
  int32_t head_step;        // query heads an aggregation step holds, 0: all of them (tunable)
} kvgen_select_geometry;

int kvgen_select_abi_version(void);
const char* kvgen_select_family_name(void);
const char* kvgen_select_arch(void);
const char* kvgen_select_last_error(void);
int kvgen_select_query_geometry(kvgen_select_geometry* out);   // host pointer
// Host array [num_scored]: the cache layer of each scored layer, in the scorer's output order.
// kvgen_select_aggregate reads a device copy of it (per_layer_perhead writes rows by layer).
const int32_t* kvgen_select_scored_layers(void);

// mean, std [scored, B, Hq] float32 of scores [scored, B, Hq, W] float32 over each request's
// width[b] (int64 [B]) leading columns: population std, floored at 1e-6 (NaN stays NaN).
int kvgen_select_statistics(const float* scores, const int64_t* width, float* mean, float* std, int32_t batch,
                            int32_t W, void* stream);

// out [B, R, W] float32: the decision values of `mode` from the z-scores (scores - mean) / std.
// scored_layers: int32 [num_scored], a device copy of kvgen_select_scored_layers(). In
// per_layer_perhead mode the rows of layers that are not scored are not written: zero them first
// when the family has sliding layers.
int kvgen_select_aggregate(int32_t mode, const float* scores, const float* mean, const float* std,
                           const int64_t* width, const int32_t* scored_layers, float* out, int32_t batch,
                           int32_t W, void* stream);

// Both of the above in one launch, the same results bit for bit (mean, std and out as above):
// a queue of chunks (one scored layer of chunk_requests requests) whose aggregation reads the
// rows again while the statistics left them in L2. The route the library was tuned for is the
// geometry's aggregate_route. work: int32 [kvgen_select_queue_work_ints(mode, batch, W)] device
// counters, zeroed before every call. Launches multiprocessors x queue_programs programs of the
// current device.
int64_t kvgen_select_queue_work_ints(int32_t mode, int32_t batch, int32_t W);   // -1: bad mode or size
int kvgen_select_statistics_aggregate(int32_t mode, const float* scores, const int64_t* width,
                                      const int32_t* scored_layers, float* mean, float* std, float* out,
                                      int32_t* work, int32_t batch, int32_t W, void* stream);

// kept [B, R, budget] int64: the stable top-`budget` of each row of values [B, R, W] float32
// among its width[b] valid columns, as absolute positions P[b] + column, ascending, -1 past the
// valid count. nan_rows [B, R] int32: written with each row's count of NaN valid values.
int kvgen_select_keep(const float* values, const int64_t* width, const int64_t* P, int64_t* kept,
                      int32_t* nan_rows, int32_t batch, int32_t rows, int32_t W, int32_t budget, void* stream);

#ifdef __cplusplus
}
#endif

#endif  // KVGEN_SELECT_H_
