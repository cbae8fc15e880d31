// tests/csrc/staging_plan_check.cpp -- kvgen/kernels/cuda/staging_plan.cuh on the host (g++).
//
// Prints one line per case; tests/test_staging_plan.py compares them with what the staged
// offload/onboard must do (ring sizes, refused arguments, copies per run of cold slots, remapped pairs).
#include <stdio.h>

#include <map>
#include <string>
#include <vector>

#include "staging_plan.cuh"

using kvgen::staging::Ring;

static void ring(int64_t staging, int64_t page) {
  Ring r;
  const std::string why = kvgen::staging::plan_ring(staging, page, &r);
  if (why.empty()) {
    printf("ring %lld %lld: slots %lld pages %lld bytes %lld\n", (long long)staging, (long long)page,
           (long long)r.slots, (long long)r.pages_per_slot, (long long)r.slot_bytes);
  } else {
    printf("ring %lld %lld: refused: %s\n", (long long)staging, (long long)page, why.c_str());
  }
}

static void runs(const std::vector<kvgen_page_pair>& pairs, int64_t begin, int64_t end, bool offload) {
  printf("runs %s [%lld,%lld):", offload ? "offload" : "onboard", (long long)begin, (long long)end);
  kvgen::staging::for_each_run(pairs.data(), begin, end, offload, [](int64_t first, int64_t slot, int64_t count) {
    printf(" (%lld %lld %lld)", (long long)first, (long long)slot, (long long)count);
  });
  printf("\n");
}

static void check(const std::vector<kvgen_page_pair>& pairs, int64_t slots, bool offload) {
  const std::string why = kvgen::staging::check_pairs(pairs.data(), (int64_t)pairs.size(), slots, offload);
  printf("check %s %lld: %s\n", offload ? "offload" : "onboard", (long long)slots, why.empty() ? "ok" : why.c_str());
}

// Records run_transfer's operations as text and checks the capture rules while it goes: every wait
// names an event recorded before in this call, the copier starts with a wait on a caller event
// (fork), and the caller waits on the copier's last record after the copier's last operation (join).
// The ring order (a slot reused only after its previous chunk is done) is in the expected text.
struct Recorder {
  std::string text;
  std::map<std::pair<int, int>, int> recorded_by;   // (kind, slot) -> side of its last record
  int copier_ops = 0;
  bool copier_forked = false;
  bool legal = true;
  std::pair<int, int> last_copier_record{-1, -1};
  bool joined = false;

  static char side(kvgen::staging::Side s) { return s == kvgen::staging::kCaller ? 'C' : 'K'; }
  static const char* name(kvgen::staging::EventKind k) {
    return k == kvgen::staging::kFork ? "fork" : k == kvgen::staging::kComputed ? "computed" : "moved";
  }
  void op(kvgen::staging::Side s, const std::string& what) {
    text += std::string(" ") + side(s) + ":" + what;
    if (s == kvgen::staging::kCopier) {
      ++copier_ops;
      joined = false;   // copier work after the caller's last wait on it would be left unjoined
    }
  }
  bool record(kvgen::staging::EventKind k, int slot, kvgen::staging::Side s) {
    op(s, std::string("rec ") + name(k) + std::to_string(slot));
    recorded_by[{k, slot}] = s;
    if (s == kvgen::staging::kCopier) last_copier_record = {k, slot};
    return true;
  }
  bool wait(kvgen::staging::Side s, kvgen::staging::EventKind k, int slot) {
    const bool first_copier_op = s == kvgen::staging::kCopier && copier_ops == 0;
    op(s, std::string("wait ") + name(k) + std::to_string(slot));
    auto it = recorded_by.find({k, slot});
    if (it == recorded_by.end()) legal = false;                       // never recorded in this call
    if (first_copier_op) copier_forked = it != recorded_by.end() && it->second == kvgen::staging::kCaller;
    if (s == kvgen::staging::kCaller && last_copier_record == std::make_pair((int)k, slot)) joined = true;
    return true;
  }
  bool compute(int64_t b, int64_t e, int slot) {
    op(kvgen::staging::kCaller, "code[" + std::to_string(b) + "," + std::to_string(e) + ")@" + std::to_string(slot));
    return true;
  }
  bool copy(int64_t b, int64_t e, int slot) {
    op(kvgen::staging::kCopier, "copy[" + std::to_string(b) + "," + std::to_string(e) + ")@" + std::to_string(slot));
    return true;
  }
};

static void transfer(int64_t slots, int64_t pages, int64_t n, bool offload) {
  Ring r;
  r.slots = slots;
  r.pages_per_slot = pages;
  Recorder rec;
  kvgen::staging::run_transfer(r, n, offload, rec);
  printf("%s n=%lld ring %lldx%lld:%s | legal %d fork %d join %d\n", offload ? "offload" : "onboard", (long long)n,
         (long long)slots, (long long)pages, rec.text.c_str(), rec.legal, n ? rec.copier_forked : 1,
         n ? rec.joined : 1);
}

int main() {
  ring(64 << 20, 1327104);   // qwen3-8b cold page: 50 pages, 2 slots of 25
  ring(1327104, 1327104);    // one page: one slot, no overlap
  ring(1327103, 1327104);    // smaller than a page
  ring(3 * 4096 + 100, 4096);  // odd page count: 2 slots of 1
  ring(4096, 4100);          // page not a multiple of 16
  // offload pairs (dst = cold slot, src = hot page): slots 3,4,5 then 9,10,11
  std::vector<kvgen_page_pair> off = {{3, 7}, {4, 0}, {5, 2}, {9, 1}, {10, 5}, {11, 6}};
  runs(off, 0, 6, true);
  runs(off, 2, 5, true);
  std::vector<kvgen_page_pair> on = {{7, 3}, {0, 4}, {2, 8}, {1, 2}};
  runs(on, 0, 4, false);
  check(off, 12, true);
  check(off, 11, true);
  check({{0, -1}}, 4, true);
  check({{0, -2}}, 4, false);
  check({{-3, 1}}, 4, false);
  check(on, 9, false);
  std::vector<kvgen_page_pair> local(3);
  kvgen::staging::to_staging_pairs(off.data(), 2, 5, true, local.data());
  printf("local offload: (%d %d) (%d %d) (%d %d)\n", local[0].dst, local[0].src, local[1].dst, local[1].src,
         local[2].dst, local[2].src);
  kvgen::staging::to_staging_pairs(on.data(), 1, 4, false, local.data());
  printf("local onboard: (%d %d) (%d %d) (%d %d)\n", local[0].dst, local[0].src, local[1].dst, local[1].src,
         local[2].dst, local[2].src);
  transfer(2, 2, 5, true);    // chunks [0,2)@0 [2,4)@1 [4,5)@0: the third waits for the first's copy
  transfer(2, 2, 5, false);
  transfer(1, 1, 2, true);    // a one-page ring: strictly alternating
  transfer(2, 4, 0, false);   // nothing: no fork left open
  return 0;
}
