// The C shim of lib kvgen_<family>_select.so (kvgen/kernels/include/kvgen_select.h): host code only.
//
// kvgen.build.triton_aot compiles the Triton kernels of select.py for one arch and writes
// aot_family.h next to this file: the family's constants and, per kernel of `Kernel` below, its
// image (aot_launch.h). They are launched here with the grids of select.py's JIT launches.
#include "kvgen_select.h"

#include "aot_launch.h"
#include "aot_family.h"

namespace {

// The order of aot_family.h's kImages (kvgen.build.triton_aot's kernel order for select).
enum Kernel {
  kStatistics, kAggregateUnion, kAggregatePerHead, kAggregatePerLayerPerHead,
  kQueueUnion, kQueuePerHead, kQueuePerLayerPerHead, kSelect, kNumKernels
};
static_assert(sizeof(kImages) / sizeof(kImages[0]) == kNumKernels, "one image per kernel");

const KernelTable<kNumKernels>& kernels() {
  static const KernelTable<kNumKernels> table(kImages, KVGEN_AOT_ARCH, KVGEN_SELECT_ELOAD);   // once per process
  return table;
}

int check_sizes(const char* call, int32_t batch, int32_t W) {
  if (batch < 0 || W < 0)
    return invalid(call, "batch " + std::to_string(batch) + " and W " + std::to_string(W) + " must not be negative");
  return 0;
}

int check_mode(const char* call, int32_t mode) {
  if (mode < KVGEN_SELECT_UNION || mode > KVGEN_SELECT_PER_LAYER_PERHEAD)
    return invalid(call, "mode " + std::to_string(mode) + " (accepted: 0 union, 1 per_head, 2 per_layer_perhead)");
  return 0;
}

int32_t out_rows(int32_t mode) {
  return mode == KVGEN_SELECT_UNION ? 1 : mode == KVGEN_SELECT_PER_HEAD ? kKvHeads : kNumLayers * kKvHeads;
}

// The queue kernel's counters (selection.py's SelectionHost.queue_work_ints): its ticket, one per
// chunk, one per request, group and column tile.
int64_t queue_work_ints(int32_t mode, int32_t batch, int32_t W) {
  int64_t groups = mode == KVGEN_SELECT_UNION ? 1 : kKvHeads;
  return 1 + int64_t(kNumScored) * cdiv(batch, kChunkRequests) + int64_t(batch) * groups * cdiv(W, kBlockW);
}

}  // namespace

extern "C" {

int kvgen_select_abi_version(void) { return KVGEN_SELECT_ABI_VERSION; }
const char* kvgen_select_family_name(void) { return KVGEN_AOT_FAMILY; }
const char* kvgen_select_arch(void) { return KVGEN_AOT_ARCH; }
const char* kvgen_select_last_error(void) { return last_error.c_str(); }
const int32_t* kvgen_select_scored_layers(void) { return kScoredLayers; }

int kvgen_select_query_geometry(kvgen_select_geometry* out) {
  if (out == nullptr) return invalid("kvgen_select_query_geometry", "out is NULL");
  *out = {KVGEN_SELECT_ABI_VERSION, kNumLayers, kKvHeads, kGroup, kNumScored, kRows, kBlockW, kBlock, kRadixBits,
          kStatsUnroll, kStatsWarps, kAggregateWarps, kStatsResident, kSelectRoute, kSelectWarps, kAggregateRoute,
          kChunkRequests, kQueueLag, kQueuePrograms, kHeadStep};
  return 0;
}

int kvgen_select_statistics(const float* scores, const int64_t* width, float* mean, float* std, int32_t batch,
                            int32_t W, void* stream) {
  const char* call = "kvgen_select_statistics";
  if (int rc = check_sizes(call, batch, W)) return rc;
  const int64_t num_rows = int64_t(kNumScored) * batch * kKvHeads * kGroup;
  if (num_rows == 0) return 0;
  if (!scores || !width || !mean || !std) return invalid(call, "a tensor is NULL");
  if (num_rows > INT32_MAX || cdiv(num_rows, kRows) > kMaxGridX)
    return invalid(call, "batch " + std::to_string(batch) + " is too large");
  int32_t rows32 = static_cast<int32_t>(num_rows);
  void* global_scratch = nullptr;
  void* profile_scratch = nullptr;
  void* args[] = {&scores, &width, &mean, &std, &rows32, &batch, &W, &global_scratch, &profile_scratch};
  return kernels().launch(kStatistics, Grid(static_cast<unsigned>(cdiv(num_rows, kRows))), args, stream);
}

int kvgen_select_aggregate(int32_t mode, const float* scores, const float* mean, const float* std,
                           const int64_t* width, const int32_t* scored_layers, float* out, int32_t batch,
                           int32_t W, void* stream) {
  const char* call = "kvgen_select_aggregate";
  if (int rc = check_mode(call, mode)) return rc;
  if (int rc = check_sizes(call, batch, W)) return rc;
  if (batch == 0 || W == 0) return 0;
  if (!scores || !mean || !std || !width || !scored_layers || !out) return invalid(call, "a tensor is NULL");
  if (batch > kMaxGridYZ) return invalid(call, "batch " + std::to_string(batch) + " above " + std::to_string(kMaxGridYZ));
  int32_t rows = out_rows(mode);
  int32_t num_scored = kNumScored;
  void* global_scratch = nullptr;
  void* profile_scratch = nullptr;
  void* args[] = {&scores, &mean, &std, &width, &scored_layers, &out, &batch, &W, &num_scored, &rows,
                  &global_scratch, &profile_scratch};
  Grid grid(static_cast<unsigned>(cdiv(W, kBlockW)), static_cast<unsigned>(batch),
            mode == KVGEN_SELECT_UNION ? 1u : static_cast<unsigned>(kKvHeads));
  return kernels().launch(kAggregateUnion + mode, grid, args, stream);
}

int64_t kvgen_select_queue_work_ints(int32_t mode, int32_t batch, int32_t W) {
  const char* call = "kvgen_select_queue_work_ints";
  if (check_mode(call, mode) || check_sizes(call, batch, W)) return -1;
  return queue_work_ints(mode, batch, W);
}

int kvgen_select_statistics_aggregate(int32_t mode, const float* scores, const int64_t* width,
                                      const int32_t* scored_layers, float* mean, float* std, float* out,
                                      int32_t* work, int32_t batch, int32_t W, void* stream) {
  const char* call = "kvgen_select_statistics_aggregate";
  if (int rc = check_mode(call, mode)) return rc;
  if (int rc = check_sizes(call, batch, W)) return rc;
  if (batch == 0 || W == 0 || kNumScored == 0) return 0;
  if (!scores || !width || !scored_layers || !mean || !std || !out || !work) return invalid(call, "a tensor is NULL");
  // tickets and the per-tile counters are int32, and so are the kernel's row indices
  if (int64_t(kNumScored) * batch * kKvHeads * kGroup > INT32_MAX || queue_work_ints(mode, batch, W) > INT32_MAX)
    return invalid(call, "batch " + std::to_string(batch) + " and W " + std::to_string(W) + " are too large");
  int sms = 0;
  if (int rc = kernels().sm_count(&sms)) return rc;
  int32_t rows = out_rows(mode);
  int32_t num_scored = kNumScored;
  void* global_scratch = nullptr;
  void* profile_scratch = nullptr;
  void* args[] = {&scores, &width, &mean, &std, &scored_layers, &out, &work, &batch, &W, &num_scored, &rows,
                  &global_scratch, &profile_scratch};
  return kernels().launch(kQueueUnion + mode, Grid(static_cast<unsigned>(sms) * kQueuePrograms), args, stream);
}

int kvgen_select_keep(const float* values, const int64_t* width, const int64_t* P, int64_t* kept,
                      int32_t* nan_rows, int32_t batch, int32_t rows, int32_t W, int32_t budget, void* stream) {
  const char* call = "kvgen_select_keep";
  if (int rc = check_sizes(call, batch, W)) return rc;
  if (rows < 1 || budget < 1)
    return invalid(call, "rows " + std::to_string(rows) + " and budget " + std::to_string(budget) +
                             " must be at least 1");
  if (batch == 0) return 0;
  if (!values || !width || !P || !kept || !nan_rows) return invalid(call, "a tensor is NULL");
  if (int64_t(batch) * rows > kMaxGridX) return invalid(call, "batch * rows is too large");
  void* global_scratch = nullptr;
  void* profile_scratch = nullptr;
  void* args[] = {&values, &width, &P, &kept, &nan_rows, &rows, &W, &budget, &global_scratch, &profile_scratch};
  return kernels().launch(kSelect, Grid(static_cast<unsigned>(int64_t(batch) * rows)), args, stream);
}

}  // extern "C"
