// The C ABI of a score library (kvgen_score.h) over the CuTe DSL AOT export of one family's
// kernel. Hand-written and identical for every family: the family's facts come from
// score_family.h and the exported kernel from kvgen_score_impl.h/.o, both written by
// kvgen.build.cute_aot next to this file at build time.
//
// The exported wrapper takes one struct per tensor argument ({data, dynamic_shapes,
// dynamic_strides}, only the modes that were symbolic at compile time); this file fills them from
// plain pointers and sizes, checks what the kernel cannot, and loads the embedded cubin (once per
// process, prepared once per device).
//
// Device-side index errors: page ids come from the page table in device memory, so the kernel
// checks each against num_pages (and each position against the table's row); a token that cannot
// be read is skipped (scored 0) and recorded in a small record of mapped pinned host memory
// (g_errors: {kind, value}). The next call reads it with a plain load (no synchronization), clears
// it and fails with KVGEN_SCORE_EDEVICE naming the value, before enqueuing anything;
// kvgen_score_check_device_errors asks explicitly.
#include <cstdint>
#include <cstdio>
#include <mutex>
#include <string>
#include <vector>

#include <cuda_runtime.h>

#include "kvgen_score.h"

namespace {

thread_local std::string g_last_error;

// The exported header's loader reports CUDA errors through CUTE_DSL_CUDA_ERROR_CHECK (it prints
// by default); collect them instead. Only the header's inline loader uses it, and this file calls
// the underlying init / load-to-device functions itself (below), so it is defined for the include.
cudaError_t g_header_error = cudaSuccess;
void note_cuda_error(cudaError_t err) {
  if (err != cudaSuccess && g_header_error == cudaSuccess) g_header_error = err;
}

}  // namespace

#define CUTE_DSL_CUDA_ERROR_CHECK(err) note_cuda_error(err)
#include "kvgen_score_impl.h"
#include "score_family.h"

namespace {

// The embedded cubin is loaded once per process (cudaLibraryLoadData) and prepared lazily per
// device on the first call made on it; the header's own loader would prepare every visible GPU,
// creating a context on each (hundreds of MB apiece on an 8-GPU host serving one rank per GPU).
kvgen_score_impl_Kernel_Module_t g_module;
std::mutex g_load_mutex;
bool g_initialized = false;
cudaError_t g_init_error = cudaSuccess;
std::vector<bool> g_device_ready;
volatile int32_t* g_errors = nullptr;   // mapped pinned host memory, ERROR_WORDS of score_kernel.py
int32_t* g_errors_device = nullptr;      // its device address (unified addressing: the same pointer)

int fail(int code, const std::string& message) {
  g_last_error = message;
  return code;
}

std::string cuda_text(cudaError_t err) {
  return std::string(cudaGetErrorName(err)) + ": " + cudaGetErrorString(err);
}

int load_module_on_current_device() {
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  std::lock_guard<std::mutex> lock(g_load_mutex);
  if (err != cudaSuccess) {
    return fail(KVGEN_SCORE_ELOAD, "kvgen_score (" KVGEN_SCORE_FAMILY ", " KVGEN_SCORE_ARCH
                                   "): no current CUDA device: " + cuda_text(err));
  }
  if (!g_initialized) {
    g_initialized = true;
    cudaLibrary_t* library = &g_module.module;
    struct {
      cudaLibrary_t** library;
      cudaError_t* ret;
    } init_args = {&library, &g_init_error};
    _mlir_kvgen_score_impl_cuda_init(reinterpret_cast<void**>(&init_args));
  }
  if (g_init_error != cudaSuccess) {
    return fail(KVGEN_SCORE_ELOAD, "kvgen_score (" KVGEN_SCORE_FAMILY ", " KVGEN_SCORE_ARCH
                                   "): cannot load the embedded kernel: " + cuda_text(g_init_error));
  }
  if (device >= static_cast<int>(g_device_ready.size())) {
    g_device_ready.resize(device + 1, false);
  }
  if (!g_device_ready[device]) {
    cudaLibrary_t* library = &g_module.module;
    int32_t device_id = device;
    cudaError_t ret = cudaSuccess;
    struct {
      cudaLibrary_t** library;
      int32_t* device_id;
      cudaError_t* ret;
    } load_args = {&library, &device_id, &ret};
    _mlir_kvgen_score_impl_cuda_load_to_device(reinterpret_cast<void**>(&load_args));
    if (ret != cudaSuccess) {
      return fail(KVGEN_SCORE_ELOAD, "kvgen_score (" KVGEN_SCORE_FAMILY ", " KVGEN_SCORE_ARCH
                                     "): cannot prepare the kernel on device " + std::to_string(device) + ": " +
                                     cuda_text(ret));
    }
    g_device_ready[device] = true;
  }
  return 0;
}

// The error record, allocated once per process by the first call or check (do one before
// capturing a CUDA graph: cudaHostAlloc is not allowed during capture).
int ensure_error_record() {
  std::lock_guard<std::mutex> lock(g_load_mutex);
  if (g_errors != nullptr) return 0;
  void* host = nullptr;
  cudaError_t err = cudaHostAlloc(&host, 2 * sizeof(int32_t), cudaHostAllocMapped);
  if (err == cudaSuccess) {
    err = cudaHostGetDevicePointer(reinterpret_cast<void**>(&g_errors_device), host, 0);
  }
  if (err != cudaSuccess) {
    if (host != nullptr) cudaFreeHost(host);
    return fail(KVGEN_SCORE_ELOAD, "kvgen_score (" KVGEN_SCORE_FAMILY ", " KVGEN_SCORE_ARCH
                                   "): cannot allocate the device error record: " + cuda_text(err));
  }
  g_errors = static_cast<volatile int32_t*>(host);
  g_errors[0] = 0;
  g_errors[1] = 0;
  return 0;
}

// Nonzero (and the message set, the record cleared) when a finished kernel skipped a token.
// Kinds: SKIPPED_PAGE / SKIPPED_POSITION of score_kernel.py.
int take_device_errors() {
  if (g_errors == nullptr || g_errors[0] == 0) return 0;
  const int32_t kind = g_errors[0];
  const int32_t value = g_errors[1];
  g_errors[0] = 0;
  const std::string what = kind == 1 ? "read page id " + std::to_string(value) +
                                           " from the page table, outside the pool's num_pages"
                                     : "met position " + std::to_string(value) +
                                           " (P + j), outside its page table row";
  return fail(KVGEN_SCORE_EDEVICE, "kvgen_score (" KVGEN_SCORE_FAMILY ", " KVGEN_SCORE_ARCH "): an earlier call " +
                                       what + "; those tokens were skipped (scored 0)");
}

}  // namespace

extern "C" {

int kvgen_score_abi_version(void) { return KVGEN_SCORE_ABI_VERSION; }

const char* kvgen_score_family_name(void) { return KVGEN_SCORE_FAMILY; }

const char* kvgen_score_arch(void) { return KVGEN_SCORE_ARCH; }

const char* kvgen_score_last_error(void) { return g_last_error.c_str(); }

int kvgen_score_query_geometry(kvgen_score_geometry_t* out) {
  if (out == nullptr) {
    return fail(KVGEN_SCORE_EINVAL, "kvgen_score_query_geometry: out is NULL");
  }
  *out = kFamilyGeometry;
  return 0;
}

int kvgen_score_check_device_errors(void) {
  int status = ensure_error_record();
  return status != 0 ? status : take_device_errors();
}

int kvgen_score(const int64_t* k_layer_ptrs, int64_t page_stride, int64_t num_pages, const int32_t* page_table,
                int32_t max_pages,
                const int32_t* P, const int32_t* S, const float* c, const float* d, const float* qr,
                const float* qi, const float* mlr, const float* freq_scale_sq, float* scores, int32_t num_layers,
                int32_t batch, int32_t width, cudaStream_t stream) {
  const kvgen_score_geometry_t& g = kFamilyGeometry;
  if (num_layers < 0 || batch < 0 || width < 0 || max_pages < 0) {
    return fail(KVGEN_SCORE_EINVAL, "kvgen_score: num_layers, batch, width and max_pages must be >= 0");
  }
  if (num_layers == 0 || batch == 0 || width == 0) {
    return 0;  // nothing to score (an empty grid is not a valid launch)
  }
  if (static_cast<int64_t>(num_layers) * batch > 65535) {
    return fail(KVGEN_SCORE_EINVAL, "kvgen_score: num_layers * batch = " +
                                        std::to_string(static_cast<int64_t>(num_layers) * batch) +
                                        " exceeds the grid's 65535; score fewer layers per call");
  }
  if (page_stride <= 0 || page_stride % g.vector_elems != 0) {
    return fail(KVGEN_SCORE_EINVAL, "kvgen_score: page_stride " + std::to_string(page_stride) +
                                        " must be positive and a multiple of " + std::to_string(g.vector_elems) +
                                        " elements (16-byte loads)");
  }
  const void* required[] = {k_layer_ptrs, page_table, P, S, c, d, qr, qi, mlr, freq_scale_sq, scores};
  for (const void* pointer : required) {
    if (pointer == nullptr) {
      return fail(KVGEN_SCORE_EINVAL, "kvgen_score: a required pointer is NULL");
    }
  }
  if (max_pages == 0) {
    return fail(KVGEN_SCORE_EINVAL, "kvgen_score: max_pages must be > 0");
  }
  if (num_pages <= 0) {
    return fail(KVGEN_SCORE_EINVAL, "kvgen_score: num_pages " + std::to_string(num_pages) +
                                        " must be > 0 (pages in every K pool)");
  }
  int loaded = load_module_on_current_device();
  if (loaded != 0) {
    return loaded;
  }
  int status = kvgen_score_check_device_errors();
  if (status != 0) {
    return status;
  }
  // Page ids are int32: a pool of more pages than that has every id in range.
  const int32_t pool_pages = num_pages > INT32_MAX ? INT32_MAX : static_cast<int32_t>(num_pages);

  const int64_t B = batch, W = width, Hq = g.query_heads;
  kvgen_score_impl_Tensor_k_ptrs_t t_k_ptrs = {const_cast<int64_t*>(k_layer_ptrs), {num_layers}};
  kvgen_score_impl_Tensor_page_table_t t_page_table = {const_cast<int32_t*>(page_table), {batch, max_pages},
                                                       {max_pages}};
  kvgen_score_impl_Tensor_P_t t_P = {const_cast<int32_t*>(P), {batch}};
  kvgen_score_impl_Tensor_S_t t_S = {const_cast<int32_t*>(S), {batch}};
  kvgen_score_impl_Tensor_c_t t_c = {const_cast<float*>(c), {batch}};
  kvgen_score_impl_Tensor_d_t t_d = {const_cast<float*>(d), {batch}};
  kvgen_score_impl_Tensor_qr_t t_qr = {const_cast<float*>(qr), {num_layers}};
  kvgen_score_impl_Tensor_qi_t t_qi = {const_cast<float*>(qi), {num_layers}};
  kvgen_score_impl_Tensor_mlr_t t_mlr = {const_cast<float*>(mlr), {num_layers}};
  kvgen_score_impl_Tensor_freq_scale_sq_t t_freq = {const_cast<float*>(freq_scale_sq)};
  kvgen_score_impl_Tensor_scores_t t_scores = {scores, {num_layers, batch, width}, {B * Hq * W, Hq * W, W}};
  kvgen_score_impl_Tensor_errors_t t_errors = {g_errors_device};
  status = cute_dsl_kvgen_score_impl_wrapper(&g_module, &t_k_ptrs, &t_page_table, &t_P, &t_S, &t_c, &t_d, &t_qr,
                                             &t_qi, &t_mlr, &t_freq, &t_scores, &t_errors, page_stride, pool_pages,
                                             stream);
  if (status != 0) {
    return fail(status, std::string("kvgen_score (" KVGEN_SCORE_FAMILY ", " KVGEN_SCORE_ARCH "): launch failed: ") +
                            cudaGetErrorName(static_cast<cudaError_t>(status)));
  }
  return 0;
}

}  // extern "C"
