// kvgen/kernels/cuda/compact_host.cuh -- host side of kvgen_compact.h, generic over a family.
//
// Checks the arguments it can check without touching device memory, then launches
// compact_kernel once per group of kLayersPerLaunch layers (a family with tail_split > 1 reads the
// current device's SM count first: no synchronization, allowed while capturing a graph).  Nothing
// here synchronizes, and after the first call (or kvgen_compact_check_device_errors) nothing
// allocates, so a call can be captured in a CUDA graph.  The moves and the page table are device memory: the kernel checks
// every token and page id against the limits given here and skips (and records) the bad ones.
#pragma once

#include <cuda_runtime.h>

#include <mutex>
#include <string>

#include "compact_kernels.cuh"
#include "kvgen_compact.h"
#include "last_error.cuh"

namespace kvgen {
namespace compact {

using kvgen::fail;

// Limits a caller of the unchecked entry point did not give: only negative values are refused.
constexpr int64_t kUnknownCount = (int64_t)1 << 32;

// The generated file's description of the family (F::info()), checked against the call.
inline int check_pools(const kvgen_compact_info& f, const kvgen_compact_pool_extent* pools, int num_layers) {
  if (num_layers != f.num_layers) {
    return fail("expected " + std::to_string(f.num_layers) + " layer pools, got " + std::to_string(num_layers));
  }
  if (pools == nullptr) return fail("null pool array");
  for (int layer = 0; layer < num_layers; ++layer) {
    const kvgen_compact_pool_extent& p = pools[layer];
    if (p.k_base == nullptr || p.v_base == nullptr) return fail("layer " + std::to_string(layer) + ": null pool base");
    if ((uintptr_t)p.k_base % 16 || (uintptr_t)p.v_base % 16 || p.k_page_stride_bytes % 16 ||
        p.v_page_stride_bytes % 16) {
      return fail("layer " + std::to_string(layer) + ": pool bases and page strides must be 16-byte aligned");
    }
    if (p.num_pages < 0) return fail("layer " + std::to_string(layer) + ": negative page count");
  }
  return 1;
}

// The library's record of skipped device indices (one per library: compaction has no handle),
// allocated by the first call or check; 0 if it cannot be.
inline DeviceErrors* library_device_errors() {
  static std::once_flag once;
  static DeviceErrors* errors = nullptr;
  static std::string why;
  std::call_once(once, [] {
    errors = alloc_device_errors();
    if (errors == nullptr) why = last_error();
  });
  if (errors == nullptr) fail(why);
  return errors;
}

// 1 if no compaction kernel skipped an index since the last check (and the record exists).
inline int check_device_errors() {
  DeviceErrors* errors = library_device_errors();
  return errors != nullptr && take_device_errors(errors);
}

// SMs of the current device (what tail_split rounds the units to), 0 if it cannot be read.
inline int multiprocessors() {
  int device = 0, sms = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) {
    cudaGetLastError();  // not sticky: clear it, the call fails by its return value
    return 0;
  }
  return sms;
}

// page_table_width: pages per page table row (moved tokens must be below width * tokens_per_block).
template <class F>
int launch(const kvgen_compact_pool_extent* pools, int num_layers, const int32_t* page_table,
           int64_t page_table_stride, int64_t page_table_width, int max_requests, const int32_t* src,
           const int32_t* dst, const int32_t* offsets, int64_t moves_per_head, cudaStream_t stream) {
  const kvgen_compact_info f = F::info();
  if (!check_pools(f, pools, num_layers)) return 0;
  if (max_requests < 0 || moves_per_head < 0 || page_table_stride < 0 || page_table_width < 0) {
    return fail("max_requests, moves_per_head, page_table_stride and page_table_width must be >= 0");
  }
  if (max_requests == 0 || moves_per_head == 0) return 1;  // nothing can move
  if (!page_table || !src || !dst || !offsets) return fail("null page table, src, dst or offsets");
  if (max_requests > 1 && page_table_width != kUnknownCount && page_table_stride < page_table_width) {
    return fail("page_table_stride " + std::to_string(page_table_stride) + " is below the row width " +
                std::to_string(page_table_width));
  }
  const int sms = F::kTailSplit > 1 ? multiprocessors() : 0;
  if (F::kTailSplit > 1 && sms == 0) return fail("cannot read the current device's SM count");
  const int most_layers = num_layers < kLayersPerLaunch ? num_layers : kLayersPerLaunch;
  const int64_t most_units = launch_units(max_requests, f.kv_heads, most_layers, F::kSlices);
  if (f.kv_heads > 65535) return fail("kv_heads above the grid's y limit");
  if (launch_ctas(most_units, sms, F::kTailSplit) > 2147483647) {
    return fail("max_requests " + std::to_string(max_requests) + ": " + std::to_string(most_units) +
                " (request, KV head, layer, slice) units a launch, above the grid's x limit");
  }
  DeviceErrors* errors = library_device_errors();
  if (errors == nullptr || !take_device_errors(errors)) return 0;  // an earlier launch's device indices
  const int64_t table_tokens =
      page_table_width == kUnknownCount ? kUnknownCount : page_table_width * f.tokens_per_block;
  for (int first = 0; first < num_layers; first += kLayersPerLaunch) {
    const int count = num_layers - first < kLayersPerLaunch ? num_layers - first : kLayersPerLaunch;
    LaunchPools batch{};
    batch.first_layer = first;
    for (int i = 0; i < count; ++i) {
      const kvgen_compact_pool_extent& p = pools[first + i];
      batch.layers[i] = LayerPools{static_cast<uint8_t*>(p.k_base), p.k_page_stride_bytes,
                                   static_cast<uint8_t*>(p.v_base), p.v_page_stride_bytes};
      batch.num_pages[i] = p.num_pages;
    }
    const int64_t units = launch_units(max_requests, f.kv_heads, count, F::kSlices);
    // kTailSplit 1: the grid the kernel reads a unit's indices from; else one CTA per cta_unit
    const dim3 grid = F::kTailSplit == 1
                          ? dim3((unsigned)(max_requests * F::kSlices), (unsigned)f.kv_heads, (unsigned)count)
                          : dim3((unsigned)launch_ctas(units, sms, F::kTailSplit));
    compact_kernel<F><<<grid, F::kThreads, 0, stream>>>(batch, page_table, page_table_stride, src, dst, offsets,
                                                        moves_per_head, table_tokens, max_requests,
                                                        (int)whole_units(units, sms, F::kTailSplit), errors);
  }
  const cudaError_t status = cudaGetLastError();
  if (status != cudaSuccess) return fail(std::string("compact launch: ") + cudaGetErrorString(status));
  return 1;
}

}  // namespace compact
}  // namespace kvgen
