// tests/csrc/staging_plan_check.cpp -- kvgen/kernels/cuda/staging_plan.h on the host (g++).
//
// Prints one line per case; tests/test_staging_plan.py compares them with what the staged
// offload/onboard must do (ring sizes, refused arguments, copies per run of cold slots, remapped pairs).
#include <stdio.h>

#include <vector>

#include "staging_plan.h"

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
  return 0;
}
