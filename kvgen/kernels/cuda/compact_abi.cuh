// kvgen/kernels/cuda/compact_abi.cuh -- the extern "C" functions of kvgen_compact.h for one family.
//
// Included exactly once, at the end of a generated compact.cu, after it has defined
//   kvgen::compact_family::Family   (static geometry(), info(), kThreads, kTileTokens)
#pragma once

#include <vector>

#include "compact_host.cuh"

extern "C" {

int kvgen_compact_abi_version(void) { return KVGEN_COMPACT_ABI_VERSION; }

int kvgen_compact_query_info(kvgen_compact_info* info) {
  if (info == nullptr) return 0;
  *info = kvgen::compact_family::Family::info();
  return 1;
}

const char* kvgen_compact_last_error(void) { return kvgen::last_error().c_str(); }

int kvgen_compact(const kvgen_compact_pool* pools, int num_layers, const int32_t* page_table,
                  int64_t page_table_stride, int max_requests, const int32_t* src, const int32_t* dst,
                  const int32_t* offsets, int64_t moves_per_head, void* stream) {
  using kvgen::compact::kUnknownCount;
  std::vector<kvgen_compact_pool_extent> extents;
  const bool counted = pools != nullptr && num_layers == kvgen::compact_family::Family::info().num_layers;
  for (int layer = 0; counted && layer < num_layers; ++layer) {  // else the count or null error below
    const kvgen_compact_pool& p = pools[layer];
    extents.push_back({p.k_base, p.k_page_stride_bytes, p.v_base, p.v_page_stride_bytes, kUnknownCount});
  }
  return kvgen_compact_checked(counted ? extents.data() : nullptr, num_layers, page_table, page_table_stride,
                               kUnknownCount, max_requests, src, dst, offsets, moves_per_head, stream);
}

// ---- Bounds-checked entry points (kvgen_compact.h, second block)

int kvgen_compact_checked(const kvgen_compact_pool_extent* pools, int num_layers, const int32_t* page_table,
                          int64_t page_table_stride, int64_t page_table_width, int max_requests, const int32_t* src,
                          const int32_t* dst, const int32_t* offsets, int64_t moves_per_head, void* stream) {
  return kvgen::compact::launch<kvgen::compact_family::Family>(pools, num_layers, page_table, page_table_stride,
                                                               page_table_width, max_requests, src, dst, offsets,
                                                               moves_per_head, static_cast<cudaStream_t>(stream));
}

int kvgen_compact_check_device_errors(void) { return kvgen::compact::check_device_errors(); }

}  // extern "C"
