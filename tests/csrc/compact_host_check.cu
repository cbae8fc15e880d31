// Driver for kvgen/kernels/cuda/compact_kernels.cuh: runs the kernel's walk (walk_moves, cta_task,
// request_range, resolve_move, row_offset) on the CPU over host memory, so
// tests/test_compact_cpu.py can compare the compacted pools byte for byte with the oracle's
// compact_paged.  Every "thread" of a phase runs in turn; the concurrent phase (loads of tile k+D,
// stores of tile k, D = load_ahead) runs in the order asked for, and the addresses it touches are
// checked to be disjoint, which is what makes the kernel's single barrier per tile sufficient.
//
// Build (no GPU, no driver: cudart is linked statically and never called):
//   nvcc -x cu -std=c++17 -I<repo> tests/csrc/compact_host_check.cu -o compact_host_check
//
// stdin (little-endian):
//   int64 header[18]: layout (0 HND, 1 NHD), row_bytes, kv_heads, tokens_per_block, num_layers,
//                     num_pages, max_requests, max_pages, moves_per_head (N), threads (64, 128,
//                     256 or 512), tile_tokens, stores_first (0/1), kv_interleaved (0/1: K and V of a
//                     layer share one buffer, page stride = 2 pages, as a combined KV pool), slices
//                     (1, 2, 4 or 8: CTAs per (layer, head, request)), load_ahead (1 or 2), index_ahead
//                     (0 or 1), tail_split (1, 2 or 4), sms (the SM count cta_unit rounds to); the
//                     launch's CTAs (cta_unit, unit_index) are walked one after another
//   int32 page_table[max_requests * max_pages]
//   int32 src[num_layers * kv_heads * N], int32 dst[same], int32 offsets[max_requests + 1]
//   per layer: K pool bytes [num_pages * page_bytes], then V pool bytes
// stdout: int64 overlaps (address conflicts found in concurrent phases), int64 skipped[2] (whether the
// walk skipped a move for a token outside the page table row, for a page id outside the pools:
// the kernel's bounds checks, limits max_pages * tokens_per_block tokens and num_pages pages),
// int64 loads (16-byte pool loads issued: a move that stores nothing must issue none), then the
// pools as read.
#include <cstdio>
#include <cstring>
#include <set>
#include <vector>

#include "kvgen/kernels/cuda/compact_kernels.cuh"

namespace kc = kvgen::compact;

namespace {

constexpr int kHostPer = kc::kMaxVectorsInFlight;  // the kernel's bound on vectors per thread

// Exec of walk_moves on the host: phases run thread after thread.
template <int kThreads, int kRing>
struct HostExec {
  bool stores_first = false;
  int tile = 1;
  std::vector<kc::TileRegs<kHostPer, kRing>> regs_ = std::vector<kc::TileRegs<kHostPer, kRing>>(kThreads);
  std::vector<kc::ResolvedMove> tiles_;
  std::set<const uint8_t*>* record = nullptr;  // addresses touched in the current phase
  long long overlaps = 0;
  long long loads = 0;

  template <class F>
  void each_thread(F f) {
    for (int t = 0; t < kThreads; ++t) f(t);
  }
  template <class L, class S>
  void overlap(L load, S store) {
    std::set<const uint8_t*> loaded, stored;
    if (stores_first) {
      record = &stored;
      each_thread(store);
      record = &loaded;
      each_thread(load);
    } else {
      record = &loaded;
      each_thread(load);
      record = &stored;
      each_thread(store);
    }
    record = nullptr;
    for (const uint8_t* p : loaded) overlaps += (long long)stored.count(p);
  }
  void barrier() {}
  kc::TileRegs<kHostPer, kRing>& regs(int t) { return regs_[t]; }
  kc::ResolvedMove* moves(int buffer) { return tiles_.data() + buffer * tile; }
  uint4 load16_if(const uint8_t* p) {
    uint4 v{};
    if (p == nullptr) return v;
    ++loads;
    if (record) record->insert(p);
    memcpy(&v, p, 16);
    return v;
  }
  void store16(uint8_t* p, uint4 v) {
    if (record) record->insert(p);
    memcpy(p, &v, 16);
  }
};

template <class T>
bool read_into(std::vector<T>& v, size_t n) {
  v.resize(n);
  return n == 0 || fread(v.data(), sizeof(T), n, stdin) == n;
}

struct Case {
  kc::Geometry g;
  int64_t num_layers, num_pages, max_requests, max_pages, moves_per_head, threads, tile_tokens, slices, load_ahead,
      tail_split, sms;
  bool index_ahead;
  bool stores_first, kv_interleaved;
  std::vector<int32_t> table, src, dst, offsets;
};

struct Counts {
  long long overlaps = -1;
  long long loads = 0;
};

template <int kThreads, int kLoadAhead, bool kIndexAhead>
Counts compact_all(const Case& c, std::vector<kc::LayerPools>& pools, kvgen::DeviceErrors& errors) {
  HostExec<kThreads, kc::ring_tiles(kLoadAhead)> ex;
  ex.stores_first = c.stores_first;
  const kc::MoveLimits limits = kc::move_limits(c.max_pages * c.g.tokens_per_block, c.num_pages, &errors);
  // Any CTA order is valid (CTAs share no bytes); walk them as the kernel's grid enumerates them,
  // one launch of every layer.
  const int64_t units = kc::launch_units(c.max_requests, c.g.kv_heads, (int)c.num_layers, (int)c.slices);
  const int64_t whole = kc::whole_units(units, (int)c.sms, (int)c.tail_split);
  for (int x = 0; x < (int)kc::launch_ctas(units, (int)c.sms, (int)c.tail_split); ++x) {
    const kc::CtaUnit cta = kc::cta_unit(x, (int)whole, (int)c.tail_split);
    const kc::UnitIndex u = kc::unit_index(cta.unit, (int)c.max_requests, c.g.kv_heads, (int)c.slices);
    const kc::RequestRange range = kc::request_range(c.offsets.data(), u.request, c.moves_per_head);
    if (range.count == 0) continue;
    const int slices = (int)c.slices * cta.parts;
    const int per_move = kc::move_vectors(c.g.row_vectors(), slices);
    ex.tile = kc::tile_moves(kThreads, (int)c.tile_tokens, per_move, kLoadAhead);
    ex.tiles_.resize(kc::move_buffers(kLoadAhead) * ex.tile);
    if (kc::vectors_per_thread(kThreads, ex.tile, per_move) > kHostPer) {
      fprintf(stderr, "rows too long for %d threads\n", kThreads);
      return Counts{};
    }
    kc::CtaTask task = kc::cta_task(c.g, pools[u.layer], c.table.data(), c.max_pages, c.src.data(), c.dst.data(),
                                    c.moves_per_head, range, u.request, u.head, u.layer, limits, slices,
                                    u.slice * cta.parts + cta.part);
    task.pools = kc::run_pools(c.g, task.pools, task.slices, task.slice);  // as the split kernel: same addresses
    kc::walk_moves<kThreads, kHostPer, kLoadAhead, kIndexAhead>(ex, c.g, task, ex.tile);
  }
  return Counts{ex.overlaps, ex.loads};
}

// compact_all of the case's pipeline shape.
template <int kThreads>
Counts compact_pipeline(const Case& c, std::vector<kc::LayerPools>& pools, kvgen::DeviceErrors& errors) {
  if (c.load_ahead == 1) {
    return c.index_ahead ? compact_all<kThreads, 1, true>(c, pools, errors) : compact_all<kThreads, 1, false>(c, pools, errors);
  }
  return c.index_ahead ? compact_all<kThreads, 2, true>(c, pools, errors) : compact_all<kThreads, 2, false>(c, pools, errors);
}

}  // namespace

int main() {
  int64_t h[18];
  if (fread(h, sizeof(int64_t), 18, stdin) != 18) return 2;
  Case c;
  c.g = kc::Geometry{(int)h[0], (int)h[2], (int)h[3], (int)h[1]};
  c.num_layers = h[4];
  c.num_pages = h[5];
  c.max_requests = h[6];
  c.max_pages = h[7];
  c.moves_per_head = h[8];
  c.threads = h[9];
  c.tile_tokens = h[10];
  c.stores_first = h[11] != 0;
  c.kv_interleaved = h[12] != 0;
  c.slices = h[13];
  c.load_ahead = h[14];
  c.index_ahead = h[15] != 0;
  c.tail_split = h[16];
  c.sms = h[17];
  if (c.slices < 1 || c.tail_split < 1 || 2 * c.g.row_vectors() % (c.slices * c.tail_split) != 0 || c.load_ahead < 1 ||
      c.load_ahead > 2 || c.sms < 1) {
    return 2;
  }
  const size_t moves = (size_t)(c.num_layers * c.g.kv_heads * c.moves_per_head);
  if (!read_into(c.table, c.max_requests * c.max_pages) || !read_into(c.src, moves) || !read_into(c.dst, moves) ||
      !read_into(c.offsets, c.max_requests + 1)) {
    return 3;
  }
  const int64_t page_bytes = (int64_t)c.g.kv_heads * c.g.tokens_per_block * c.g.row_bytes;
  const int64_t layer_bytes = 2 * c.num_pages * page_bytes;  // K and V
  std::vector<uint8_t> memory(c.num_layers * layer_bytes);
  std::vector<kc::LayerPools> pools;
  for (int64_t layer = 0; layer < c.num_layers; ++layer) {
    uint8_t* base = memory.data() + layer * layer_bytes;
    if (c.kv_interleaved) {
      pools.push_back(kc::LayerPools{base, 2 * page_bytes, base + page_bytes, 2 * page_bytes});
    } else {
      pools.push_back(kc::LayerPools{base, page_bytes, base + c.num_pages * page_bytes, page_bytes});
    }
  }
  // Pools arrive (and leave) as K then V per layer, page after page.
  auto each_page = [&](bool reading) {
    for (int64_t layer = 0; layer < c.num_layers; ++layer) {
      for (int kv = 0; kv < 2; ++kv) {
        for (int64_t page = 0; page < c.num_pages; ++page) {
          const kc::LayerPools& p = pools[layer];
          uint8_t* at = kv == 0 ? p.k + page * p.k_page_stride : p.v + page * p.v_page_stride;
          const size_t n = reading ? fread(at, 1, page_bytes, stdin) : fwrite(at, 1, page_bytes, stdout);
          if ((int64_t)n != page_bytes) return false;
        }
      }
    }
    return true;
  };
  if (!each_page(true)) return 4;
  Counts counts;
  kvgen::DeviceErrors errors{};
  if (c.threads == 64) counts = compact_pipeline<64>(c, pools, errors);
  if (c.threads == 128) counts = compact_pipeline<128>(c, pools, errors);
  if (c.threads == 256) counts = compact_pipeline<256>(c, pools, errors);
  if (c.threads == 512) counts = compact_pipeline<512>(c, pools, errors);
  if (counts.overlaps < 0) return 5;
  const int64_t out[4] = {counts.overlaps, errors.hit[kvgen::kCompactPosition], errors.hit[kvgen::kCompactPage],
                          counts.loads};
  fwrite(out, sizeof(int64_t), 4, stdout);
  return each_page(false) ? 0 : 6;
}
