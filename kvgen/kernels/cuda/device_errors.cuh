// kvgen/kernels/cuda/device_errors.cuh -- out-of-range device indices, recorded by the kernels.
//
// Index arrays in device memory cannot be checked on the host without a synchronization.  The
// kernels therefore check every index themselves (one compare per page pair or move), skip the
// ones out of range (nothing is read or written for them) and record the first kind of each
// problem here.  The record lives in mapped pinned host memory (last_error.cuh allocates it), so
// the kernel's store reaches the host without any copy or synchronization: the next host call,
// or an explicit check, reads it with a plain load and reports it through kvgen_last_error.
//
// Written once per failure only (plain stores, no atomics: every writer of a kind stores the
// same flag; the index stored is one of the bad ones), so the cost on the good path is the compare.
#pragma once

#include <stdint.h>

namespace kvgen {

enum DeviceErrorKind : int {
  kEncodeHotPage = 0,   // codec encode: src is not a hot page of the lifecycle's pools
  kEncodeColdSlot,      // codec encode: dst is not a cold slot of the cold buffer
  kDecodeColdSlot,      // codec decode: src is not a cold slot
  kDecodeHotPage,       // codec decode: dst is not a hot page
  kCompactPosition,     // compaction: src or dst token outside the page table row
  kCompactPage,         // compaction: page id from the page table outside the pools
  kNumDeviceErrorKinds
};

struct DeviceErrors {
  int32_t hit[kNumDeviceErrorKinds];    // 1: at least one index of this kind was skipped
  int64_t index[kNumDeviceErrorKinds];  // one of the skipped indices (page, slot or token)
};

// Whether 0 <= index < limit, in one unsigned compare (a negative index wraps above any limit).
__host__ __device__ __forceinline__ bool in_range(int64_t index, int64_t limit) {
  return (uint64_t)index < (uint64_t)limit;
}

// The same test for a 32-bit index against a limit clamped to 2^31 (every non-negative int32 is
// below it, every negative one wraps above it): one 32-bit compare instead of a sign extension
// and a 64-bit compare pair, for kernels whose indices are int32 (compaction).
__host__ __device__ __forceinline__ uint32_t index_limit32(int64_t limit) {
  return limit <= 0 ? 0u : limit >= (int64_t(1) << 31) ? 0x80000000u : (uint32_t)limit;
}
__host__ __device__ __forceinline__ bool in_range32(int32_t index, uint32_t limit32) {
  return (uint32_t)index < limit32;
}

// Record a skipped index (the failure path only).  The index is made visible before the flag,
// so a reader that sees the flag reads an index of that kind.  Not inlined: the failure path's
// fence and stores would otherwise hold registers across the callers' hot loops (inlined, the
// compaction kernel went from 64 to 91 registers and lost half its occupancy on the H200).
__host__ __device__ __noinline__ inline void record_device_error(DeviceErrors* errors, int kind, int64_t index) {
  if (errors == nullptr) return;
  volatile DeviceErrors* e = errors;
  e->index[kind] = index;
#ifdef __CUDA_ARCH__
  __threadfence_system();
#endif
  e->hit[kind] = 1;
}

}  // namespace kvgen
