// The C shim of lib kvgen_<family>_pack.so (kvgen/kernels/include/kvgen_pack.h): host code only.
//
// kvgen.build.triton_aot compiles the Triton kernels of pack.py for one arch and writes
// aot_family.h next to this file: the family's constants and, per kernel of `Kernel` below, its
// image (aot_launch.h). They are launched here with the grids of pack.py's JIT launches.
#include "kvgen_pack.h"

#include "aot_launch.h"
#include "aot_family.h"

namespace {

// The order of aot_family.h's kImages (kvgen.build.triton_aot's kernel order for pack).
enum Kernel { kOffsets, kMoves, kNumKernels };
static_assert(sizeof(kImages) / sizeof(kImages[0]) == kNumKernels, "one image per kernel");

const KernelTable<kNumKernels>& kernels() {
  static const KernelTable<kNumKernels> table(kImages, KVGEN_AOT_ARCH, KVGEN_PACK_ELOAD);   // once per process
  return table;
}

int check_requests(const char* call, int32_t batch, int32_t max_requests, int32_t budget) {
  if (batch < 0 || max_requests < batch)
    return invalid(call, "batch " + std::to_string(batch) + " and max_requests " + std::to_string(max_requests) +
                             ": need 0 <= batch <= max_requests");
  if (int64_t(max_requests) + 1 > kMaxGridX) return invalid(call, "max_requests is too large");
  if (budget < 1) return invalid(call, "budget " + std::to_string(budget) + " must be at least 1");
  return 0;
}

}  // namespace

extern "C" {

int kvgen_pack_abi_version(void) { return KVGEN_PACK_ABI_VERSION; }
const char* kvgen_pack_family_name(void) { return KVGEN_AOT_FAMILY; }
const char* kvgen_pack_arch(void) { return KVGEN_AOT_ARCH; }
const char* kvgen_pack_last_error(void) { return last_error.c_str(); }
const int32_t* kvgen_pack_layer_windows(void) { return kLayerWindows; }

int kvgen_pack_query_geometry(kvgen_pack_geometry* out) {
  if (out == nullptr) return invalid("kvgen_pack_query_geometry", "out is NULL");
  *out = {KVGEN_PACK_ABI_VERSION, kNumLayers, kKvHeads, kBlock};
  return 0;
}

int kvgen_pack_offsets(const int64_t* tail, const int8_t* due, int32_t* offsets, int32_t batch, int32_t max_requests,
                       int32_t budget, void* stream) {
  const char* call = "kvgen_pack_offsets";
  if (int rc = check_requests(call, batch, max_requests, budget)) return rc;
  if (!offsets || (batch > 0 && (!tail || !due))) return invalid(call, "a tensor is NULL");
  void* global_scratch = nullptr;
  void* profile_scratch = nullptr;
  void* args[] = {&tail, &due, &offsets, &batch, &max_requests, &budget, &global_scratch, &profile_scratch};
  return kernels().launch(kOffsets, Grid(1), args, stream);
}

int kvgen_pack_moves(int32_t mode, const int64_t* kept, const int64_t* P, const int64_t* S,
                     const int32_t* layer_windows, const int32_t* offsets, int32_t* src, int32_t* dst, int32_t batch,
                     int32_t max_requests, int32_t budget, int32_t capacity, void* stream) {
  const char* call = "kvgen_pack_moves";
  if (mode < KVGEN_PACK_UNION || mode > KVGEN_PACK_PER_LAYER_PERHEAD)
    return invalid(call, "mode " + std::to_string(mode) + " (accepted: 0 union, 1 per_head, 2 per_layer_perhead)");
  if (int rc = check_requests(call, batch, max_requests, budget)) return rc;
  if (capacity < 0) return invalid(call, "capacity " + std::to_string(capacity) + " must not be negative");
  for (int32_t layer = 0; layer < kNumLayers; ++layer)
    if (kLayerWindows[layer] > 0 && budget < kLayerWindows[layer])
      return invalid(call, "budget " + std::to_string(budget) + " < sliding window " +
                               std::to_string(kLayerWindows[layer]) + " of layer " + std::to_string(layer));
  if (capacity == 0) return 0;
  if (!layer_windows || !offsets || !src || !dst || (batch > 0 && (!kept || !P || !S)))
    return invalid(call, "a tensor is NULL");
  // (layer, head) reads decision row layer * layer_stride + head * head_stride of its request.
  int32_t layer_stride = mode == KVGEN_PACK_PER_LAYER_PERHEAD ? kKvHeads : 0;
  int32_t head_stride = mode == KVGEN_PACK_UNION ? 0 : 1;
  int32_t num_rows = 1 + (kNumLayers - 1) * layer_stride + (kKvHeads - 1) * head_stride;
  void* global_scratch = nullptr;
  void* profile_scratch = nullptr;
  void* args[] = {&kept, &P, &S, &layer_windows, &offsets, &src, &dst, &batch, &max_requests, &budget, &num_rows,
                  &layer_stride, &head_stride, &capacity, &global_scratch, &profile_scratch};
  return kernels().launch(kMoves, Grid(static_cast<unsigned>(max_requests) + 1, static_cast<unsigned>(kNumLayers)),
                          args, stream);
}

}  // extern "C"
