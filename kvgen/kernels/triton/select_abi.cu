// The C shim of lib kvgen_<family>_select.so (kvgen/kernels/include/kvgen_select.h): host code only.
//
// kvgen.build.triton_aot compiles the Triton kernels of select.py for one arch, bundles each into
// a fatbinary and writes select_family.h next to this file: the family's constants and, per kernel
// of `Kernel` below, its image, its symbol, its dynamic shared memory and its threads. Here they
// are loaded once per process with context-independent loading (cudaLibraryLoadData: every
// device gets them on first use) and launched with the grids of select.py's JIT launches.
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "kvgen_select.h"

namespace {

struct KernelImage {
  const char* name;             // statistics, aggregate_<mode>, select
  const unsigned char* image;   // fatbinary
  const char* symbol;           // the Triton kernel's name in the image
  unsigned shared_bytes;        // dynamic shared memory Triton asks for (at most 48 KiB: checked at build)
  unsigned threads;             // num_warps * 32
};

// The order of select_family.h's kImages.
enum Kernel { kStatistics, kAggregateUnion, kAggregatePerHead, kAggregatePerLayerPerHead, kSelect, kNumKernels };

}  // namespace

#include "select_family.h"

namespace {

static_assert(sizeof(kImages) / sizeof(kImages[0]) == kNumKernels, "one image per kernel");

thread_local std::string last_error;

int fail(int code, const std::string& message) {
  last_error = message;
  return code;
}

struct Loaded {
  cudaKernel_t kernel[kNumKernels] = {};
  int status = 0;
  std::string error;
};

// Loaded once per process (a static local: initialization is thread-safe); a failure sticks.
const Loaded& loaded() {
  static const Loaded state = [] {
    Loaded s;
    for (int k = 0; k < kNumKernels; ++k) {
      cudaLibrary_t library;
      cudaError_t e = cudaLibraryLoadData(&library, kImages[k].image, nullptr, nullptr, 0, nullptr, nullptr, 0);
      if (e == cudaSuccess) e = cudaLibraryGetKernel(&s.kernel[k], library, kImages[k].symbol);
      if (e != cudaSuccess) {
        s.status = KVGEN_SELECT_ELOAD;
        s.error = std::string("loading kernel ") + kImages[k].name + " (" + KVGEN_SELECT_ARCH + "): " +
                  cudaGetErrorString(e);
        break;
      }
    }
    return s;
  }();
  return state;
}

// Triton kernels take two trailing scratch pointers; these kernels need neither (checked at build).
int launch(Kernel k, dim3 grid, void** args, void* stream) {
  const Loaded& s = loaded();
  if (s.status != 0) return fail(s.status, s.error);
  cudaError_t e = cudaLaunchKernel(reinterpret_cast<const void*>(s.kernel[k]), grid, dim3(kImages[k].threads), args,
                                   kImages[k].shared_bytes, static_cast<cudaStream_t>(stream));
  if (e != cudaSuccess) return fail(static_cast<int>(e), std::string(kImages[k].name) + ": " + cudaGetErrorString(e));
  return 0;
}

constexpr int64_t kMaxGridX = 2147483647;
constexpr int64_t kMaxGridYZ = 65535;

int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

int check_sizes(const char* call, int32_t batch, int32_t W) {
  if (batch < 0 || W < 0)
    return fail(KVGEN_SELECT_EINVAL, std::string(call) + ": batch " + std::to_string(batch) + " and W " +
                                         std::to_string(W) + " must not be negative");
  return 0;
}

int null_pointer(const char* call, const char* name) {
  return fail(KVGEN_SELECT_EINVAL, std::string(call) + ": " + name + " is NULL");
}

}  // namespace

extern "C" {

int kvgen_select_abi_version(void) { return KVGEN_SELECT_ABI_VERSION; }
const char* kvgen_select_family_name(void) { return KVGEN_SELECT_FAMILY; }
const char* kvgen_select_arch(void) { return KVGEN_SELECT_ARCH; }
const char* kvgen_select_last_error(void) { return last_error.c_str(); }
const int32_t* kvgen_select_scored_layers(void) { return kScoredLayers; }

int kvgen_select_query_geometry(kvgen_select_geometry* out) {
  if (out == nullptr) return null_pointer("kvgen_select_query_geometry", "out");
  *out = {KVGEN_SELECT_ABI_VERSION, kNumLayers, kKvHeads, kGroup, kNumScored, kRows, kBlockW, kBlock, kRadixBits};
  return 0;
}

int kvgen_select_statistics(const float* scores, const int64_t* width, float* mean, float* std, int32_t batch,
                            int32_t W, void* stream) {
  const char* call = "kvgen_select_statistics";
  if (int rc = check_sizes(call, batch, W)) return rc;
  const int64_t num_rows = int64_t(kNumScored) * batch * kKvHeads * kGroup;
  if (num_rows == 0) return 0;
  if (!scores || !width || !mean || !std) return null_pointer(call, "a tensor");
  if (num_rows > INT32_MAX || cdiv(num_rows, kRows) > kMaxGridX)
    return fail(KVGEN_SELECT_EINVAL, std::string(call) + ": batch " + std::to_string(batch) + " is too large");
  int32_t rows32 = static_cast<int32_t>(num_rows);
  void* global_scratch = nullptr;
  void* profile_scratch = nullptr;
  void* args[] = {&scores, &width, &mean, &std, &rows32, &batch, &W, &global_scratch, &profile_scratch};
  return launch(kStatistics, dim3(static_cast<unsigned>(cdiv(num_rows, kRows))), args, stream);
}

int kvgen_select_aggregate(int32_t mode, const float* scores, const float* mean, const float* std,
                           const int64_t* width, const int32_t* scored_layers, float* out, int32_t batch,
                           int32_t W, void* stream) {
  const char* call = "kvgen_select_aggregate";
  if (mode < KVGEN_SELECT_UNION || mode > KVGEN_SELECT_PER_LAYER_PERHEAD)
    return fail(KVGEN_SELECT_EINVAL, std::string(call) + ": mode " + std::to_string(mode) + " (accepted: 0 union, "
                                         "1 per_head, 2 per_layer_perhead)");
  if (int rc = check_sizes(call, batch, W)) return rc;
  if (batch == 0 || W == 0) return 0;
  if (!scores || !mean || !std || !width || !scored_layers || !out) return null_pointer(call, "a tensor");
  if (batch > kMaxGridYZ)
    return fail(KVGEN_SELECT_EINVAL, std::string(call) + ": batch " + std::to_string(batch) + " above " +
                                         std::to_string(kMaxGridYZ));
  const int32_t out_rows = mode == KVGEN_SELECT_UNION ? 1 : mode == KVGEN_SELECT_PER_HEAD ? kKvHeads
                                                                                          : kNumLayers * kKvHeads;
  int32_t num_scored = kNumScored;
  void* global_scratch = nullptr;
  void* profile_scratch = nullptr;
  void* args[] = {&scores, &mean, &std, &width, &scored_layers, &out, &batch, &W, &num_scored, (void*)&out_rows,
                  &global_scratch, &profile_scratch};
  dim3 grid(static_cast<unsigned>(cdiv(W, kBlockW)), static_cast<unsigned>(batch),
            mode == KVGEN_SELECT_UNION ? 1u : static_cast<unsigned>(kKvHeads));
  return launch(static_cast<Kernel>(kAggregateUnion + mode), grid, args, stream);
}

int kvgen_select_keep(const float* values, const int64_t* width, const int64_t* P, int64_t* kept,
                      int32_t* nan_rows, int32_t batch, int32_t rows, int32_t W, int32_t budget, void* stream) {
  const char* call = "kvgen_select_keep";
  if (int rc = check_sizes(call, batch, W)) return rc;
  if (rows < 1 || budget < 1)
    return fail(KVGEN_SELECT_EINVAL, std::string(call) + ": rows " + std::to_string(rows) + " and budget " +
                                         std::to_string(budget) + " must be at least 1");
  if (batch == 0) return 0;
  if (!values || !width || !P || !kept || !nan_rows) return null_pointer(call, "a tensor");
  if (int64_t(batch) * rows > kMaxGridX)
    return fail(KVGEN_SELECT_EINVAL, std::string(call) + ": batch * rows is too large");
  void* global_scratch = nullptr;
  void* profile_scratch = nullptr;
  void* args[] = {&values, &width, &P, &kept, &nan_rows, &rows, &W, &budget, &global_scratch, &profile_scratch};
  return launch(kSelect, dim3(static_cast<unsigned>(int64_t(batch) * rows)), args, stream);
}

}  // extern "C"
