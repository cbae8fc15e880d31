// Driver for the codec's bounds checks (kvgen/kernels/cuda/codec_host.cuh, codec_kernels.cuh,
// last_error.cuh) on the CPU: the host pair check of the bounds-checked entry points, the kernels'
// per-pair check (pair_in_range, __host__ __device__) and the report of a device error record.
// No GPU, no driver: nothing here calls CUDA.  tests/test_bounds_cpu.py compares every line.
//
// Build: nvcc -x cu -std=c++17 -I<repo>/kvgen/kernels/include -I<repo>/kvgen/kernels/cuda \
//          tests/csrc/codec_host_check.cu -o codec_host_check
#include <cstdio>

#include "codec_host.cuh"

namespace kc = kvgen::codec;

namespace {

void host_pairs(const char* name, bool encode, kvgen_page_pair pair, int64_t hot_pages, int64_t cold_slots) {
  const kvgen_page_pair pairs[2] = {{0, 0}, pair};
  kvgen::last_error().clear();
  const bool ok = kc::check_host_pairs("fam", encode, 0, pairs, 2, hot_pages, cold_slots);
  std::printf("%s: %d %s\n", name, ok ? 1 : 0, kvgen::last_error().c_str());
}

void device_pair(const char* name, bool encode, kc::PagePair pair) {
  kvgen::DeviceErrors errors{};
  const kc::PairLimits limits{64, 10, &errors};
  const bool ok = encode ? kc::pair_in_range<true>(pair, limits, true) : kc::pair_in_range<false>(pair, limits, true);
  kvgen::last_error().clear();
  const bool clean = kvgen::take_device_errors(&errors);
  const bool cleared = kvgen::take_device_errors(&errors);  // a report clears the record
  std::printf("%s: %d %d %d %s\n", name, ok ? 1 : 0, clean ? 1 : 0, cleared ? 1 : 0, kvgen::last_error().c_str());
}

void hot_pages(const char* name, const int64_t* pages) {
  // two lifecycles: layers {0, 2} and {1}, two pools per layer
  static const int begin[] = {0, 2, 3};
  static const int layers[] = {0, 2, 1};
  static const int align[] = {16, 16};
  const kc::FamilyTables f{"fam", 3, 2, align, 2, begin, layers, 16};
  std::vector<int64_t> out;
  kvgen::last_error().clear();
  const bool ok = kc::lifecycle_hot_pages(f, pages, out);
  std::printf("%s: %d %lld %lld %s\n", name, ok ? 1 : 0, ok ? (long long)out[0] : -1LL,
              ok ? (long long)out[1] : -1LL, kvgen::last_error().c_str());
}

}  // namespace

int main() {
  host_pairs("encode ok", true, {9, 63}, 64, 10);
  host_pairs("encode src 100000", true, {0, 100000}, 64, 10);
  host_pairs("encode src -5", true, {0, -5}, 64, 10);
  host_pairs("encode dst 100000", true, {100000, 1}, 64, 10);
  host_pairs("encode dst = slots", true, {10, 1}, 64, 10);
  host_pairs("decode dst 64", false, {64, 1}, 64, 10);
  host_pairs("decode src -1", false, {1, -1}, 64, 10);
  host_pairs("unknown counts", true, {2000000000, 2000000000}, kc::kUnknownCount, kc::kUnknownCount);
  host_pairs("unknown counts, -5", true, {0, -5}, kc::kUnknownCount, kc::kUnknownCount);
  device_pair("device encode ok", true, {9, 63});
  device_pair("device encode src 100000", true, {0, 100000});
  device_pair("device encode both", true, {-5, 64});
  device_pair("device decode dst -5", false, {-5, 0});
  device_pair("device decode src 10", false, {0, 10});
  const int64_t pages[] = {8, 8, 5, 9, 7, 6};  // pools of layers 0, 1, 2
  hot_pages("hot pages", pages);
  hot_pages("hot pages unknown", nullptr);
  const int64_t negative[] = {8, 8, 5, -1, 7, 6};
  hot_pages("hot pages negative", negative);
  return 0;
}
