// kvgen/kernels/cuda/staging_plan.cuh -- host-only planning of the staged offload/onboard (ABI v2).
//
// Plain C++ (no CUDA): how a staging buffer splits into ring slots, which argument errors are
// refused before anything is enqueued, how a chunk of page pairs becomes copies of contiguous
// runs of cold slots, and the order of a transfer's operations on the two streams (run_transfer).
// codec_staged.cuh drives CUDA with it; tests/csrc/staging_plan_check.cpp runs it on the host.
#pragma once

#include <stdint.h>

#include <string>

#include "kvgen_codec.h"

namespace kvgen {
namespace staging {

// Two slots: chunk i's copy overlaps chunk i+1's encode (the copy engine is the slower side, so a
// deeper ring would only hold more memory).
constexpr int64_t kRingSlots = 2;
constexpr int64_t kAlign = 16;                       // cold base rule of kvgen_codec.h
constexpr int64_t kDefaultBytes = int64_t(64) << 20;  // staging the codec allocates when asked for 0

// A staging buffer cut into `slots` ring slots of `pages_per_slot` cold pages each.
struct Ring {
  int64_t slots = 0;
  int64_t pages_per_slot = 0;
  int64_t slot_bytes = 0;
};

// The ring for cold pages of `page_bytes`; an empty message when `staging_bytes` holds at least one.
inline std::string plan_ring(int64_t staging_bytes, int64_t page_bytes, Ring* ring) {
  if (page_bytes <= 0 || page_bytes % kAlign) {
    return "cold page size " + std::to_string(page_bytes) + " is not a positive multiple of 16";
  }
  const int64_t pages = staging_bytes / page_bytes;
  if (pages < 1) {
    return "staging buffer of " + std::to_string(staging_bytes) + " bytes is smaller than one cold page (" +
           std::to_string(page_bytes) + " bytes)";
  }
  ring->slots = pages < kRingSlots ? pages : kRingSlots;
  ring->pages_per_slot = pages / ring->slots;
  ring->slot_bytes = ring->pages_per_slot * page_bytes;
  return "";
}

// Which field of a pair names the cold slot: dst when offloading, src when onboarding.
inline int32_t cold_slot(const kvgen_page_pair& p, bool offload) { return offload ? p.dst : p.src; }

// Every cold slot in [0, num_cold_slots) and every hot page >= 0, checked before any launch
// (the hot side's upper bound is the kernels' check); an empty message when all are.
inline std::string check_pairs(const kvgen_page_pair* pairs, int64_t n, int64_t num_cold_slots, bool offload) {
  for (int64_t i = 0; i < n; ++i) {
    const int32_t slot = cold_slot(pairs[i], offload);
    const int32_t page = offload ? pairs[i].src : pairs[i].dst;
    if (slot < 0 || slot >= num_cold_slots) {
      return "pair " + std::to_string(i) + ": cold slot " + std::to_string(slot) + " outside [0, " +
             std::to_string(num_cold_slots) + ")";
    }
    if (page < 0) return "pair " + std::to_string(i) + ": negative hot page " + std::to_string(page);
  }
  return "";
}

// emit(first, slot, count) once per run of pairs [first, first + count) of the chunk
// [begin, end) whose cold slots are consecutive: staging page first - begin .. holds cold slots
// slot .. slot + count - 1, so each run is one copy.
template <class Emit>
void for_each_run(const kvgen_page_pair* pairs, int64_t begin, int64_t end, bool offload, Emit emit) {
  int64_t first = begin;
  for (int64_t i = begin + 1; i <= end; ++i) {
    const bool breaks = i == end || cold_slot(pairs[i], offload) != cold_slot(pairs[i - 1], offload) + 1;
    if (breaks) {
      emit(first, (int64_t)cold_slot(pairs[first], offload), i - first);
      first = i;
    }
  }
}

// The pairs of chunk [begin, end) as the device-side codec sees them: the cold slot replaced by
// the page's position in its staging slot.
inline void to_staging_pairs(const kvgen_page_pair* pairs, int64_t begin, int64_t end, bool offload,
                             kvgen_page_pair* out) {
  for (int64_t i = begin; i < end; ++i) {
    const int32_t local = (int32_t)(i - begin);
    out[i - begin] = offload ? kvgen_page_pair{local, pairs[i].src} : kvgen_page_pair{pairs[i].dst, local};
  }
}

// The two streams of a staged transfer and its events (one fork event, two per ring slot).
enum Side { kCaller = 0, kCopier = 1 };
enum EventKind { kFork = 0, kComputed = 1, kMoved = 2 };

// The order of one staged transfer of n pairs, over `ops` (codec_staged.cuh: CUDA; the host test:
// a recorder), each returning false on failure:
//   ops.record(kind, slot, side)   event record on a stream
//   ops.wait(side, kind, slot)     stream waits for the event's last record
//   ops.compute(begin, end, slot)  encode/decode pairs [begin, end) into/from ring slot `slot` (caller stream)
//   ops.copy(begin, end, slot)     the chunk's cold pages between the ring slot and host (copier stream)
// Offload per chunk: [caller waits moved(slot) when the slot was used] encode, record computed;
// copier waits computed, copies, records moved.  Onboard: caller records fork, copier waits it;
// per chunk: [copier waits computed(slot) when reused] copies, records moved; caller waits moved,
// decodes, records computed.  Every wait names an event recorded earlier in the same call, the
// copier's first operation waits on the caller (fork) and the caller ends waiting on the copier's
// last record (join): the rules of CUDA graph capture.
template <class Ops>
bool run_transfer(const Ring& ring, int64_t n, bool offload, Ops& ops) {
  if (n == 0) return true;   // nothing enqueued (an unjoined fork would break a capture)
  bool ok = offload || (ops.record(kFork, 0, kCaller) && ops.wait(kCopier, kFork, 0));
  int last = 0;
  for (int64_t begin = 0, chunk = 0; ok && begin < n; begin += ring.pages_per_slot, ++chunk) {
    const int64_t end = begin + ring.pages_per_slot < n ? begin + ring.pages_per_slot : n;
    const int slot = (int)(chunk % ring.slots);
    const bool reused = chunk >= ring.slots;   // the slot's previous chunk must be done with it
    if (offload) {
      ok = (!reused || ops.wait(kCaller, kMoved, slot)) && ops.compute(begin, end, slot) &&
           ops.record(kComputed, slot, kCaller) && ops.wait(kCopier, kComputed, slot) &&
           ops.copy(begin, end, slot) && ops.record(kMoved, slot, kCopier);
    } else {
      ok = (!reused || ops.wait(kCopier, kComputed, slot)) && ops.copy(begin, end, slot) &&
           ops.record(kMoved, slot, kCopier) && ops.wait(kCaller, kMoved, slot) && ops.compute(begin, end, slot) &&
           ops.record(kComputed, slot, kCaller);
    }
    last = slot;
  }
  return ok && (!offload || ops.wait(kCaller, kMoved, last));
}

}  // namespace staging
}  // namespace kvgen
