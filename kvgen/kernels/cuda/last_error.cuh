// kvgen/kernels/cuda/last_error.cuh -- the one per-thread error message of a family library.
//
// Every C entry point that fails stores why here and returns 0/false/NULL; kvgen_last_error()
// and kvgen_compact_last_error() both read it (one library, one message per thread).
#pragma once

#include <string>

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

}  // namespace kvgen
