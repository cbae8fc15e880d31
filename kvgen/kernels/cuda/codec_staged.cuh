// kvgen/kernels/cuda/codec_staged.cuh -- staged offload/onboard of ABI v2 (kvgen_codec.h).
//
// Offload: the SMs encode a chunk of pages into a device staging ring slot, the copy engine moves
// the slot's cold pages to pinned host memory on an internal copy stream; onboard runs the other
// way.  Two ring slots let chunk i's copy overlap chunk i+1's encode or decode.  Every call only
// enqueues kernels, async copies and event record/wait (fork-join onto the copy stream), so it can
// be captured in a CUDA graph; allocation (staging, stream, events) happens in set_staging.
//
// The encode and decode kernels run at the device's greatest stream priority.  The copy engine waits
// for each ring slot's kernel, and beside a model holding every SM a kernel of the stream's priority
// waits until the model's kernels drain (up to a millisecond), longer than a slot's copy: the link
// idles.  At the greatest priority the block scheduler gives the codec each SM as it frees.  (A CUDA
// graph keeps the priority on the kernel nodes; it applies where the graph is instantiated with
// cudaGraphInstantiateFlagUseNodePriority, else the launch stream's priority does.)
#pragma once

#include <cuda_runtime.h>

#include <string>
#include <vector>

#include "codec_host.cuh"
#include "last_error.cuh"
#include "staging_plan.cuh"

namespace kvgen {
namespace codec {

template <class CodecT>
class Staged {
 public:
  ~Staged() { release(); }

  bool ready() const { return bytes_ > 0; }
  int64_t bytes() const { return bytes_; }

  // Use `buffer` (device memory of this GPU, `bytes` long) or, when it is NULL, allocate `bytes`
  // (0: kDefaultBytes).  Refused before anything changes when the buffer cannot hold the largest
  // cold page of `codec`, is not 16-byte aligned or lives elsewhere than the current device.
  bool set(const CodecT& codec, void* buffer, int64_t bytes) {
    if (bytes < 0) return fail("staging bytes must be >= 0, got " + std::to_string(bytes));
    if (buffer == nullptr && bytes == 0) bytes = staging::kDefaultBytes;
    if (buffer != nullptr && !check_buffer(buffer)) return false;
    for (int lc = 0; lc < codec.num_lifecycles(); ++lc) {
      staging::Ring ring;
      const std::string why = staging::plan_ring(bytes, codec.cold_page_bytes(lc), &ring);
      if (!why.empty()) return fail("staging (lifecycle " + std::to_string(lc) + "): " + why);
    }
    if (codec.location() != KVGEN_INDEX_HOST) return fail("staged offload/onboard needs host index arrays");
    release();
    void* owned = nullptr;
    if (buffer == nullptr) {
      if (!cuda_ok(cudaMalloc(&owned, bytes), "cudaMalloc staging")) return false;
      buffer = owned;
    }
    owned_ = owned;
    base_ = static_cast<uint8_t*>(buffer);
    bytes_ = bytes;
    return create_stream_and_events();
  }

  bool offload(CodecT& codec, int lifecycle, void* host_cold, int64_t num_cold_slots, const kvgen_page_pair* pairs,
               int64_t n, cudaStream_t stream) {
    return transfer<true>(codec, lifecycle, static_cast<uint8_t*>(host_cold), num_cold_slots, pairs, n, stream);
  }
  bool onboard(CodecT& codec, int lifecycle, const void* host_cold, int64_t num_cold_slots,
               const kvgen_page_pair* pairs, int64_t n, cudaStream_t stream) {
    return transfer<false>(codec, lifecycle, static_cast<uint8_t*>(const_cast<void*>(host_cold)), num_cold_slots,
                           pairs, n, stream);
  }

 private:
  bool check_buffer(void* buffer) {
    if ((uintptr_t)buffer % staging::kAlign) return fail("staging buffer must be 16-byte aligned");
    cudaPointerAttributes attr;
    if (!cuda_ok(cudaPointerGetAttributes(&attr, buffer), "staging buffer attributes")) return false;
    int device = -1;
    if (!cuda_ok(cudaGetDevice(&device), "cudaGetDevice")) return false;
    if (attr.type != cudaMemoryTypeDevice) return fail("staging buffer must be device memory (cudaMalloc)");
    if (attr.device != device) {
      return fail("staging buffer is on device " + std::to_string(attr.device) + ", the codec runs on device " +
                  std::to_string(device));
    }
    return true;
  }

  bool create_stream_and_events() {
    int least = 0;
    if (!cuda_ok(cudaDeviceGetStreamPriorityRange(&least, &priority_), "stream priority range")) return false;
    if (!cuda_ok(cudaStreamCreateWithFlags(&copy_, cudaStreamNonBlocking), "copy stream")) return false;
    for (cudaEvent_t* e : {&fork_, &computed_[0], &computed_[1], &moved_[0], &moved_[1]}) {
      if (!cuda_ok(cudaEventCreateWithFlags(e, cudaEventDisableTiming), "staging event")) return false;
    }
    return true;
  }

  void release() {
    for (cudaEvent_t e : {fork_, computed_[0], computed_[1], moved_[0], moved_[1]}) {
      if (e) cudaEventDestroy(e);
    }
    fork_ = computed_[0] = computed_[1] = moved_[0] = moved_[1] = nullptr;
    if (copy_) cudaStreamDestroy(copy_);
    copy_ = nullptr;
    if (owned_) cudaFree(owned_);
    owned_ = nullptr;
    base_ = nullptr;
    bytes_ = 0;
  }

  // Every argument error is found here, before the first enqueue.
  bool check(const CodecT& codec, int lifecycle, const uint8_t* host_cold, int64_t num_cold_slots,
             const kvgen_page_pair* pairs, int64_t n, bool offload, staging::Ring* ring) {
    if (!ready()) return fail("no staging buffer: call kvgen_codec_set_staging first");
    if (lifecycle < 0 || lifecycle >= codec.num_lifecycles()) {
      return fail("no lifecycle " + std::to_string(lifecycle));
    }
    if (n < 0 || (n > 0 && (pairs == nullptr || host_cold == nullptr))) return fail("null cold base or pairs");
    if ((uintptr_t)host_cold % staging::kAlign) return fail("cold base must be 16-byte aligned");
    const std::string why = staging::plan_ring(bytes_, codec.cold_page_bytes(lifecycle), ring);
    if (!why.empty()) return fail(why);
    const std::string bad = staging::check_pairs(pairs, n, num_cold_slots, offload);
    return bad.empty() || fail(bad);
  }

  // CUDA operations of staging::run_transfer for one call.
  struct CudaOps {
    Staged& st;
    CodecT& codec;
    int lifecycle;
    bool offload;
    const kvgen_page_pair* pairs;
    uint8_t* host_cold;
    int64_t page_bytes;
    int64_t slot_bytes;
    cudaStream_t caller;

    cudaStream_t stream_of(staging::Side side) const { return side == staging::kCaller ? caller : st.copy_; }
    cudaEvent_t event(staging::EventKind kind, int slot) const {
      return kind == staging::kFork ? st.fork_ : kind == staging::kComputed ? st.computed_[slot] : st.moved_[slot];
    }
    uint8_t* ring_slot(int slot) const { return st.base_ + slot * slot_bytes; }

    bool record(staging::EventKind kind, int slot, staging::Side side) {
      return cuda_ok(cudaEventRecord(event(kind, slot), stream_of(side)), "staging event record");
    }
    bool wait(staging::Side side, staging::EventKind kind, int slot) {
      return cuda_ok(cudaStreamWaitEvent(stream_of(side), event(kind, slot), 0), "staging event wait");
    }
    bool compute(int64_t begin, int64_t end, int slot) {
      staging::to_staging_pairs(pairs, begin, end, offload, st.local_.data());
      uint8_t* staged = ring_slot(slot);
      const kvgen_page_pair* local = st.local_.data();
      const int64_t n = end - begin;
      return offload ? codec.encode(lifecycle, staged, kUnknownCount, local, n, caller, st.priority_)
                     : codec.decode(lifecycle, staged, kUnknownCount, local, n, caller, st.priority_);
    }
    bool copy(int64_t begin, int64_t end, int slot) {
      return st.copy_runs(pairs, begin, end, offload, ring_slot(slot), host_cold, page_bytes);
    }
  };

  template <bool kOffload>
  bool transfer(CodecT& codec, int lifecycle, uint8_t* host_cold, int64_t num_cold_slots,
                const kvgen_page_pair* pairs, int64_t n, cudaStream_t stream) {
    staging::Ring ring;
    if (!check(codec, lifecycle, host_cold, num_cold_slots, pairs, n, kOffload, &ring)) return false;
    local_.resize(ring.pages_per_slot);
    CudaOps ops{*this, codec, lifecycle, kOffload, pairs, host_cold, codec.cold_page_bytes(lifecycle),
                ring.slot_bytes, stream};
    return staging::run_transfer(ring, n, kOffload, ops);
  }

  // One cudaMemcpyAsync per run of consecutive cold slots (scattered slots: one per page).
  bool copy_runs(const kvgen_page_pair* pairs, int64_t begin, int64_t end, bool offload, uint8_t* staged,
                 uint8_t* host_cold, int64_t page_bytes) {
    bool ok = true;
    staging::for_each_run(pairs, begin, end, offload, [&](int64_t first, int64_t slot, int64_t count) {
      uint8_t* device = staged + (first - begin) * page_bytes;
      uint8_t* host = host_cold + slot * page_bytes;
      const size_t bytes = (size_t)(count * page_bytes);
      if (ok) {
        ok = cuda_ok(offload ? cudaMemcpyAsync(host, device, bytes, cudaMemcpyDefault, copy_)
                             : cudaMemcpyAsync(device, host, bytes, cudaMemcpyDefault, copy_),
                     "staging copy");
      }
    });
    return ok;
  }

  uint8_t* base_ = nullptr;
  void* owned_ = nullptr;   // set when the codec allocated the staging buffer
  int64_t bytes_ = 0;
  cudaStream_t copy_ = nullptr;
  int priority_ = kStreamPriority;   // the encode / decode kernels' (the device's greatest)
  cudaEvent_t fork_ = nullptr;
  cudaEvent_t computed_[staging::kRingSlots] = {nullptr, nullptr};
  cudaEvent_t moved_[staging::kRingSlots] = {nullptr, nullptr};
  std::vector<kvgen_page_pair> local_;   // one chunk's pairs in staging coordinates (host scratch)
};

}  // namespace codec
}  // namespace kvgen
