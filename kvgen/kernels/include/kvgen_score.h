// C ABI of a kvgen TriAttention score library, lib kvgen_<family>_score.so (one family, one arch).
//
// The library holds the family's CuTe DSL scoring kernel, compiled ahead of time and exported
// (cubin embedded), the CuTe DSL runtime and cudart, both linked statically: loading it needs the
// CUDA driver only, no CUTLASS, no Python package. Semantics: TRIATTENTION.md §3.
//
// Every pointer is device memory unless said otherwise. Calls are asynchronous on `stream` and
// must be made with the stream's device current (as torch does). Return 0 on success; otherwise
// a nonzero code and kvgen_score_last_error() says why (thread-local text).
#ifndef KVGEN_SCORE_H_
#define KVGEN_SCORE_H_

#include <stdint.h>

#include <cuda_runtime.h>

#ifdef __cplusplus
extern "C" {
#endif

#define KVGEN_SCORE_ABI_VERSION 2   // 2: num_pages, fp8 K, device error record

// Error codes (besides cudaError_t values, returned as is).
#define KVGEN_SCORE_EINVAL (-1)   // an argument is out of range; the message names it
#define KVGEN_SCORE_ELOAD (-2)    // the embedded kernel could not be loaded on this device
#define KVGEN_SCORE_EDEVICE (-3)  // an earlier kernel skipped a page id outside the pool (message: which)

// Compile-time geometry of the kernel in this library (kvgen_score_query_geometry).
typedef struct {
  int32_t abi_version;       // KVGEN_SCORE_ABI_VERSION
  int32_t head_dim;          // elements per K row
  int32_t query_heads;       // Hq
  int32_t kv_heads;          // Hkv
  int32_t rotary_start;      // first rotated element of the row
  int32_t rotary_dim;        // rotated width R; F = R / 2 frequencies
  int32_t pairing;           // 0: half (f, f + F), 1: interleaved (2f, 2f + 1)
  int32_t tokens_per_block;  // tokens per page
  int32_t layout;            // 0: HND [page][Hkv][token][dim], 1: NHD [page][token][Hkv][dim]
  int32_t dtype;             // 0: bf16, 1: fp16, 2: fp8 E4M3 (read as stored: no scale)
  int32_t threads;           // threads per CTA (tunable)
  int32_t heads_per_pass;    // query heads accumulated per pass over K
  int32_t passes;            // passes over K per KV head (ceil(group / heads_per_pass))
  int32_t vector_elems;      // elements per K load; page_stride must be a multiple of it
  int32_t lanes;             // threads per token
  int32_t tokens_per_cta;    // tokens (columns) per CTA
} kvgen_score_geometry_t;

int kvgen_score_abi_version(void);
const char* kvgen_score_family_name(void);
const char* kvgen_score_arch(void);          // e.g. "sm_90a"
const char* kvgen_score_last_error(void);
int kvgen_score_query_geometry(kvgen_score_geometry_t* out);   // host pointer

// Scores of decode tokens [P[b], S[b]) of `num_layers` layers, every query head, every request.
//
//   k_layer_ptrs   int64 [num_layers]: base address of each layer's K pool (16-byte aligned),
//                  pool = [pages][...] in the family's layout and dtype, pages `page_stride`
//                  elements apart (a multiple of vector_elems; > 0)
//   num_pages      pages in every layer's K pool (> 0): a page id outside [0, num_pages) read
//                  from the page table is never dereferenced; its tokens score 0 and the next
//                  call (or kvgen_score_check_device_errors) fails with KVGEN_SCORE_EDEVICE;
//                  so do positions P[b] + j outside the table's row (< 0, >= max_pages pages)
//   page_table     int32 [batch, max_pages], row-major: page of token t of request b is
//                  page_table[b, t / tokens_per_block], slot t % tokens_per_block
//   P, S           int32 [batch]: prompt length, physical length of scorable tokens
//   c, d           f32 [batch, F]: mean-phase row of each request at L = S + C
//   qr, qi, mlr    f32 [num_layers, Hq, F]: calibration of the scored layers, in the order of
//                  k_layer_ptrs (mlr = E|q| - |E q|)
//   freq_scale_sq  f32 [F]
//   scores         f32 [num_layers, batch, Hq, width], row-major, written entirely: column j is
//                  token P[b] + j, zeros for j >= S[b] - P[b]
//
// Grid limit: num_layers * batch <= 65535 (one launch; call per layer group beyond that).
int kvgen_score(const int64_t* k_layer_ptrs, int64_t page_stride, int64_t num_pages, const int32_t* page_table,
                int32_t max_pages,
                const int32_t* P, const int32_t* S, const float* c, const float* d, const float* qr,
                const float* qi, const float* mlr, const float* freq_scale_sq, float* scores, int32_t num_layers,
                int32_t batch, int32_t width, cudaStream_t stream);

// 0 if no score kernel of this library skipped a page id since the last call or check; else
// KVGEN_SCORE_EDEVICE, kvgen_score_last_error() names one skipped id, and the record is cleared.
// No synchronization: it sees the kernels that have finished (synchronize the stream to see all).
int kvgen_score_check_device_errors(void);

#ifdef __cplusplus
}
#endif

#endif  // KVGEN_SCORE_H_
