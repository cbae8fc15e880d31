// kvgen/kernels/cuda/last_error.cuh -- the one per-thread error message of a family library.
//
// Every C entry point that fails stores why here and returns 0/false/NULL; kvgen_last_error()
// and kvgen_compact_last_error() both read it (one library, one message per thread).
//
// It also turns the kernels' record of skipped device indices (device_errors.cuh) into that
// message: take_device_errors() reads the record with plain host loads (no synchronization, no
// copy: it is mapped pinned memory), clears it and fails naming what was skipped.
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "device_errors.cuh"

namespace kvgen {

inline std::string& last_error() {
  thread_local std::string message;
  return message;
}

// Record why a call failed; false converts to the 0 the int-returning entry points report.
inline bool fail(const std::string& message) {
  last_error() = message;
  return false;
}

// What each DeviceErrorKind skipped, for the message.
inline const char* device_error_text(int kind) {
  static const char* const text[kNumDeviceErrorKinds] = {
      "encode: src is not a hot page of the lifecycle's pools",
      "encode: dst is not a slot of the cold buffer",
      "decode: src is not a slot of the cold buffer",
      "decode: dst is not a hot page of the lifecycle's pools",
      "compaction: src or dst token is outside the page table row",
      "compaction: the page table maps a moved token to a page outside the pools",
  };
  return text[kind];
}

// A zeroed record in mapped pinned host memory (visible to every device), or nullptr with the
// CUDA error as the message.  Init time only: allocating is not allowed while capturing a graph.
inline DeviceErrors* alloc_device_errors() {
  void* p = nullptr;
  const cudaError_t status = cudaHostAlloc(&p, sizeof(DeviceErrors), cudaHostAllocMapped | cudaHostAllocPortable);
  if (status != cudaSuccess) {
    fail(std::string("cannot allocate the device error record: ") + cudaGetErrorString(status));
    return nullptr;
  }
  *static_cast<DeviceErrors*>(p) = DeviceErrors{};
  return static_cast<DeviceErrors*>(p);
}

// Reads and clears the record; false (and the message) if a kernel skipped indices since the
// last take.  Sees the kernels that have finished (synchronize the stream first to see them all).
inline bool take_device_errors(DeviceErrors* errors) {
  if (errors == nullptr) return true;
  volatile DeviceErrors* e = errors;
  std::string message;
  for (int kind = 0; kind < kNumDeviceErrorKinds; ++kind) {
    if (!e->hit[kind]) continue;
    const long long index = e->index[kind];
    e->hit[kind] = 0;
    message += std::string(message.empty() ? "" : "; ") + device_error_text(kind) + " (e.g. " +
               std::to_string(index) + ")";
  }
  if (message.empty()) return true;
  return fail("a kernel skipped out-of-range device indices (nothing was read or written for them): " + message);
}

}  // namespace kvgen
