// kvgen/kernels/cuda/compact_kernels.cuh -- TriAttention physical compaction (TRIATTENTION.md §7), generic
// over a family's page geometry.
//
// A generated compact.cu describes one family (layout, heads, row bytes, tokens per block) and the
// launch shape (threads, tile, slices); the logic lives here, once.  One CTA owns one slice of one
// (layer, KV head, request) and walks that request's moves in ascending order, copying its slice of
// the K and the V row of token src(m) to token dst(m) through the page table, 16 bytes per access.
// A move's 2 x row_bytes (K row, then V row) are cut into `slices` equal runs of 16-byte vectors;
// slice c of every move belongs to CTA c.  Each byte column of a row is its own in-place problem
// (a move copies column j of src(m) to column j of dst(m) and touches no other column), so the
// argument below holds per slice, and CTAs of different slices share no bytes.  Slices raise the
// CTAs of a launch (batch 1: layers x KV heads) at the cost of resolving every move once per slice.
// The same argument splits a slice further: with tail_split T > 1, the units (request, head, layer,
// slice) past the last whole multiple of the SM count are each copied by T CTAs of 1/T of the slice
// (cta_unit).  Batch 1 of qwen3-8b is 576 units on 132 SMs: 48 SMs held 5 and set the time
// (Nsight Compute: avg/max SM active 0.946); split by 4, every SM holds 4 units and a share of 192
// quarter units.
//
// The walk (walk_moves) is written once and run two ways: on the GPU, one call per thread with
// __syncthreads() as the barrier; on the host (tests/csrc/compact_host_check.cu), every "thread"
// of a phase in turn, so the CPU tests check the same addressing and the same order of memory
// operations against the oracle's compact_paged.
//
// Why the tile order is safe.  Per (layer, head, request) the packer guarantees (§6): sources
// strictly increase and dst(m) <= src(m).  Hence for m < m': dst(m) <= src(m) < src(m').
//   (a) A source is never written before it is read: the only moves that can write token src(m')
//       are moves m'' with dst(m'') = src(m'), and dst(m'') <= src(m'') forces src(m'') >= src(m'),
//       i.e. m'' >= m' (m'' = m' is an identity move, skipped).  So every move that overwrites a
//       source comes *after* the move reading it.
//   (b) Inside a tile a later move may overwrite an earlier move's source (src = [5, 6],
//       dst = [4, 5]: move 1 writes token 5, move 0 reads it).  So a tile's stores wait at a
//       barrier until every thread has loaded the whole tile.
//   (c) Across tiles, the loads of tile k+1 may run concurrently with the stores of tile k: by
//       (a) tile k's stores only hit sources of moves <= k's last move, never tile k+1's.
// One barrier per tile therefore suffices:  barrier | load(k+D) || store(k) | resolve(k+D+1), with
// D = load_ahead tiles in flight (1 or 2).  (c) holds for any D: tile k's stores hit no source of
// a later tile, and every thread issued tile k's loads before barrier k (b).
// Different (layer, head, request) never share bytes (different rows or pages), and K and V are
// different pools, so CTAs need no coordination.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>
#include <string.h>

#include "device_errors.cuh"

namespace kvgen {
namespace compact {

// ---------------------------------------------------------------------------------------------
// Page geometry: token -> page -> byte offset
// ---------------------------------------------------------------------------------------------

enum Layout : int { kHND = 0, kNHD = 1 };

// One layer pool's page: HND [kv_heads][tokens_per_block][row], NHD [tokens_per_block][kv_heads][row],
// row = head_dim elements of elem_bytes (row_bytes, a multiple of 16: head_dim % 16 == 0 by spec).
struct Geometry {
  int layout;
  int kv_heads;
  int tokens_per_block;
  int row_bytes;

  __host__ __device__ constexpr int row_vectors() const { return row_bytes / 16; }

  // Row index of (head, slot) inside a page, in units of row_bytes.
  __host__ __device__ constexpr int row_in_page(int head, int slot) const {
    return layout == kHND ? head * tokens_per_block + slot : slot * kv_heads + head;
  }
};

// K and V pool of one layer: page p of K starts at k + p * k_page_stride (bytes); same for V.
// Same memory layout as kvgen_compact_pool in kvgen_compact.h.
struct LayerPools {
  uint8_t* k;
  int64_t k_page_stride;
  uint8_t* v;
  int64_t v_page_stride;
};

// A move with its tokens resolved to (page, row in page), every index clamped into its range (see
// resolve_move); dst_page < 0: nothing to load or store (the packer's -1 fill, an identity move,
// which would copy a row onto itself, a move out of range, or a slot past the request's last move).
struct ResolvedMove {
  int32_t src_page;
  int32_t src_row;
  int32_t dst_page;
  int32_t dst_row;
};

// What one CTA may touch: tokens [0, tokens) of its page table row (the row's width times
// tokens_per_block) and pages [0, pages) of its pools.  A move outside is skipped, noted in the
// thread's SkippedMoves and recorded in `errors` (device_errors.cuh) once, after the walk.
// Limits are index_limit32() of the int64 ones (moves and page ids are int32): see move_limits.
struct MoveLimits {
  uint32_t tokens;
  uint32_t pages;
  DeviceErrors* errors;
};

__host__ __device__ inline MoveLimits move_limits(int64_t tokens, int64_t pages, DeviceErrors* errors) {
  return MoveLimits{index_limit32(tokens), index_limit32(pages), errors};
}

// The out-of-range indices one thread met during its walk (the last of each kind).  Noting them in
// registers keeps the failure path's call (record_device_error: a fence and mapped-memory stores)
// out of the move loop, so a good move pays only its compares: with the call inside resolve_move
// the kernel had 176 more SASS instructions and batch-1 compaction ran ~12 % slower than with
// the checks compiled out (results/2026-12-01-h200-s2 checks-on/checks-off).
struct SkippedMoves {
  bool position = false;  // a src or dst token outside the page table row
  bool page = false;      // a page id of the page table outside the pools
  int32_t position_index = 0;
  int32_t page_index = 0;

  __host__ __device__ void note_position(int32_t index) {
    position = true;
    position_index = index;
  }
  __host__ __device__ void note_page(int32_t index) {
    page = true;
    page_index = index;
  }
  // Record what was noted (after the walk; nothing on the good path but two predicates).
  __host__ __device__ void report(DeviceErrors* errors) const {
    if (position) record_device_error(errors, kCompactPosition, position_index);
    if (page) record_device_error(errors, kCompactPage, page_index);
  }
};

constexpr int32_t kMoveFill = -1;  // the packer's fill slot (src and dst), which moves nothing

// Every index is clamped into its range before it is used (a token outside the page table row
// to token 0, a page outside the pools to page 0), so the page table reads are unconditional and
// stay inside what the kernel was given, and a move needs no branch: its row load and store are
// both predicated on dst_page >= 0 (Walk::address, ThreadExec::load16_if).  With a branch per move
// instead, the compiler could not batch a tile's loads ahead of its stores, and batch-1
// compaction (latency-bound) ran at 0.66 of copy against 0.74 with the checks compiled out
// (results/2026-12-02-h200/codec_device_check.json).  With unpredicated loads from the clamped
// address instead, every move that stores nothing still read a row: at batch 256 the benchmark's
// 11 layers of fill moves all loaded the same few rows (0.66 of copy, results/2026-12-02-h200/bench).
// An empty page table row (limits.tokens 0) reads no page id; empty pools (limits.pages 0) make
// every move store nothing, so they are never read.
__host__ __device__ inline ResolvedMove resolve_move(const Geometry& g, const int32_t* table_row, int head,
                                                     int32_t src, int32_t dst, const MoveLimits& limits,
                                                     SkippedMoves& skipped) {
  const bool src_ok = in_range32(src, limits.tokens);
  const bool dst_ok = in_range32(dst, limits.tokens);
  const bool copies = src != kMoveFill && src != dst;  // fill and identity moves copy nothing
  if (src != kMoveFill && !(src_ok && dst_ok)) skipped.note_position(src_ok ? dst : src);
  const int tpb = g.tokens_per_block;
  const int32_t s = src_ok ? src : 0;
  const int32_t d = dst_ok ? dst : 0;
  // A move that copies nothing reads no page id either: a run of fill moves (the benchmark's layers
  // that do not fit, a sliding-window layer's leading slots) costs one dependent load, not two.
  const bool reads_pages = copies && limits.tokens > 0;
  const int32_t src_page = reads_pages ? table_row[s / tpb] : -1;
  const int32_t dst_page = reads_pages ? table_row[d / tpb] : -1;
  const bool src_page_ok = in_range32(src_page, limits.pages);
  const bool dst_page_ok = in_range32(dst_page, limits.pages);
  const bool tokens_ok = copies && src_ok && dst_ok;
  if (tokens_ok && !(src_page_ok && dst_page_ok)) skipped.note_page(src_page_ok ? dst_page : src_page);
  const bool stores = tokens_ok && src_page_ok && dst_page_ok;
  return ResolvedMove{src_page_ok ? src_page : 0, g.row_in_page(head, s % tpb), stores ? dst_page : -1,
                      g.row_in_page(head, d % tpb)};
}

// Byte offset of (page, row) from a pool's base.  64-bit: pools exceed 2 GiB.
__host__ __device__ inline int64_t row_offset(const Geometry& g, int64_t page_stride, int32_t page, int32_t row) {
  return (int64_t)page * page_stride + (int64_t)row * g.row_bytes;
}

// ---------------------------------------------------------------------------------------------
// Moves of one (layer, head, request)
// ---------------------------------------------------------------------------------------------

// Request r owns slots [offsets[r], offsets[r+1]) of every (layer, head) row of N slots.  Clamped
// to the row so a bad offsets array cannot make the kernel read outside src/dst.
struct RequestRange {
  int64_t begin;
  int count;
};

__host__ __device__ inline RequestRange request_range(const int32_t* offsets, int request, int64_t moves_per_head) {
  int64_t begin = offsets[request];
  int64_t end = offsets[request + 1];
  begin = begin < 0 ? 0 : (begin > moves_per_head ? moves_per_head : begin);
  end = end > moves_per_head ? moves_per_head : end;
  return RequestRange{begin, end > begin ? (int)(end - begin) : 0};
}

// Everything one CTA needs: its request's slice of the (layer, head) move rows, its pools, and
// which run of each move's vectors it copies.
struct CtaTask {
  const int32_t* src;        // src[(layer * kv_heads + head) * N + begin]
  const int32_t* dst;
  int count;                 // moves of the request
  const int32_t* table_row;  // page table row of the request
  int head;
  LayerPools pools;
  MoveLimits limits;
  int slices;                // runs a move's 2 x row_vectors vectors are cut into
  int slice;                 // the run this CTA copies, 0 .. slices-1
};

// 16-byte vectors of one move a CTA copies: its run of the K and V rows.
__host__ __device__ constexpr int move_vectors(int row_vectors, int slices) { return 2 * row_vectors / slices; }

// The pools a CTA's run reads: where the run lies inside one row (K or V), both entries name that
// pool, so choosing a vector's pool picks between equal values and the choice folds away (the same
// addresses).  With the slice a register rather than a function of blockIdx (cta_unit), the kernel
// otherwise kept both pools' bases and strides for every vector: 64 registers against 48 (qwen3-8b,
// 256 threads, 2 slices), 4 CTAs a SM instead of 5.
__host__ __device__ inline LayerPools run_pools(const Geometry& g, const LayerPools& pools, int slices, int slice) {
  const int per_move = move_vectors(g.row_vectors(), slices);
  if (per_move > g.row_vectors()) return pools;  // the run spans the K row and the V row
  const bool in_v = slice * per_move >= g.row_vectors();
  return in_v ? LayerPools{pools.v, pools.v_page_stride, pools.v, pools.v_page_stride}
              : LayerPools{pools.k, pools.k_page_stride, pools.k, pools.k_page_stride};
}

// The task of the CTA (request, head, layer, slice) whose request owns `range`; src/dst rows are
// [layer][head][moves_per_head].
__host__ __device__ inline CtaTask cta_task(const Geometry& g, const LayerPools& pools, const int32_t* page_table,
                                            int64_t page_table_stride, const int32_t* src, const int32_t* dst,
                                            int64_t moves_per_head, RequestRange range, int request, int head,
                                            int layer, const MoveLimits& limits, int slices, int slice) {
  const int64_t row = ((int64_t)layer * g.kv_heads + head) * moves_per_head + range.begin;
  return CtaTask{src + row, dst + row, range.count, page_table + (int64_t)request * page_table_stride, head, pools,
                 limits, slices, slice};
}

// ---------------------------------------------------------------------------------------------
// CTAs of a launch: units of work, the tail's split finer
// ---------------------------------------------------------------------------------------------

// A launch's work is `units` equal units, unit u = ((layer * kv_heads + head) * requests + request)
// * slices + slice (the order of the 3-D grid a launch without a split takes).  Units [0, whole)
// take one CTA each; with split > 1 whole is the largest multiple of the SM count, and each later
// unit takes `split` CTAs, part p copying run p of the unit's slice (a slice of slices * split).
// The block scheduler hands CTAs out in order, so the whole units sit evenly on the SMs and the
// small ones fill in behind (the design; not yet measured on a GPU).
__host__ __device__ constexpr int64_t launch_units(int64_t requests, int kv_heads, int layers, int slices) {
  return requests * kv_heads * layers * slices;
}

__host__ __device__ constexpr int64_t whole_units(int64_t units, int sms, int split) {
  return split > 1 && sms > 0 ? units / sms * sms : units;
}

__host__ __device__ constexpr int64_t launch_ctas(int64_t units, int sms, int split) {
  return whole_units(units, sms, split) + (units - whole_units(units, sms, split)) * split;
}

// A launch's CTAs number at most 2^31 - 1 (the host refuses more), so a CTA's unit is found in
// 32-bit arithmetic.
struct CtaUnit {
  int unit;
  int part;   // 0 .. parts-1
  int parts;  // 1 for a whole unit, split for a unit of the tail
};

__host__ __device__ inline CtaUnit cta_unit(int cta, int whole, int split) {
  if (cta < whole) return CtaUnit{cta, 0, 1};
  return CtaUnit{whole + (cta - whole) / split, (cta - whole) % split, split};
}

// Which (request, head, layer of the launch, slice) a unit is, for `requests` request slots.
struct UnitIndex {
  int request;
  int head;
  int layer;
  int slice;
};

__host__ __device__ inline UnitIndex unit_index(int unit, int requests, int kv_heads, int slices) {
  const int request_slice = unit % (requests * slices);
  const int layer_head = unit / (requests * slices);
  return UnitIndex{request_slice / slices, layer_head % kv_heads, layer_head / kv_heads, request_slice % slices};
}

// ---------------------------------------------------------------------------------------------
// Tiles: which 16-byte vectors a thread copies
// ---------------------------------------------------------------------------------------------

// A thread holds at most this many 16-byte vectors (128 registers) over all the tiles it has in
// registers at once: the one being stored and the load_ahead ones being loaded.
constexpr int kMaxVectorsInFlight = 32;

// Tiles a thread holds at once: the one being stored and load_ahead ones being loaded.
__host__ __device__ constexpr int ring_tiles(int load_ahead) { return load_ahead + 1; }

// Vectors per thread and tile that fit the register file: kMaxVectorsInFlight shared by the ring
// up to 256 threads; above, 64K registers / 512 threads = 128 per thread, half of that.
__host__ __device__ constexpr int max_vectors_per_thread(int threads, int load_ahead) {
  return (threads > 256 ? kMaxVectorsInFlight / 2 : kMaxVectorsInFlight) / ring_tiles(load_ahead);
}

// Moves per tile: the tunable tile_tokens, reduced when long rows would need more than
// max_vectors_per_thread vectors per thread (then the kernel would spill), and to one move per
// thread (each thread resolves at most one move of a tile).  At least one move.  per_move: the
// vectors of a move the CTA copies (move_vectors).
__host__ __device__ constexpr int tile_moves(int threads, int tile_tokens, int per_move, int load_ahead) {
  const int spill_cap = max_vectors_per_thread(threads, load_ahead) * threads / per_move;
  const int cap = spill_cap < threads ? spill_cap : threads;
  return cap < 1 ? 1 : (tile_tokens < cap ? tile_tokens : cap);
}

// Vectors one thread copies per tile (its slice of the K and V rows of every move, spread over the
// threads).
__host__ __device__ constexpr int vectors_per_thread(int threads, int tile, int per_move) {
  return (tile * per_move + threads - 1) / threads;
}

// Vector i of a tile: move i / P (P = move_vectors), and vector w = slice * P + i % P of the move's
// K row then V row: pool w / V (0 = K, 1 = V), vector w % V of that row.  Consecutive threads take
// consecutive vectors, so a warp reads whole runs of rows (coalesced).
struct TileVector {
  int move;
  int pool;
  int vec;
};

__host__ __device__ inline TileVector tile_vector(int i, int row_vectors, int slices, int slice) {
  const int per_move = move_vectors(row_vectors, slices);
  const int w = slice * per_move + i % per_move;
  return TileVector{i / per_move, w / row_vectors, w % row_vectors};
}

// The registers of one thread: a ring of kRing tiles (tile k in slot k % kRing: the one being
// stored and the ones being loaded), the move indices it fetched ahead (index_ahead), and the moves
// it skipped.  The walk names slots by constants on the GPU, so the ring never leaves registers.
template <int kPer, int kRing>
struct TileRegs {
  uint4 ring[kRing][kPer];
  int32_t src = 0;  // src and dst of this thread's move of the next tile to resolve
  int32_t dst = 0;
  SkippedMoves skipped;
};

// ---------------------------------------------------------------------------------------------
// The walk, shared by the kernel and the host check
// ---------------------------------------------------------------------------------------------

// Exec supplies how a phase runs and how bytes move:
//   each_thread(f)          f(t) for this thread (GPU) or for every t in turn (host)
//   overlap(load, store)    the concurrent phase: load(t) and store(t), in an order of Exec's choice
//   barrier()               __syncthreads() (GPU) or nothing (host: phases are already sequential)
//   regs(t)                 TileRegs of thread t (its ring of tiles, fetched indices, SkippedMoves)
//   moves(buffer)           ResolvedMove[tile] in shared memory, buffer 0 .. move_buffers(D) - 1
//   load16_if(p)            the 16 bytes at p, or (p null) any value without touching memory
//   store16(p, v)
// Exec's functions are __device__ on the GPU and __host__ on the host, hence the
// nv_exec_check_disable on every function that calls them.

// Tiles whose resolved moves are live at once: k (being stored) to k + D + 1 (being resolved).
__host__ __device__ constexpr int move_buffers(int load_ahead) { return load_ahead + 2; }

// kLoadAhead (D): tiles whose loads are in flight while one is stored.  kIndexAhead: a thread
// fetches the src/dst of its move of tile k+1 right after resolving tile k, so the resolve of the
// next iteration waits only for the page id, not for the index load before it.
template <int kThreads, int kPer, int kLoadAhead, bool kIndexAhead, class Exec>
struct Walk {
  static constexpr int kRing = ring_tiles(kLoadAhead);
  static constexpr int kBuffers = move_buffers(kLoadAhead);
  Exec& ex;
  const Geometry& g;
  const CtaTask& task;
  int tile;
  int tiles;

  // Thread t < tile: src and dst of its move of tile k (the fill past the request's last move).
#pragma nv_exec_check_disable
  __host__ __device__ void fetch(int t, int k) const {
    const int m = k * tile + t;
    const bool real = m < task.count;
    ex.regs(t).src = real ? task.src[m] : kMoveFill;
    ex.regs(t).dst = real ? task.dst[m] : kMoveFill;
  }

  // Threads 0 .. tile-1 resolve one move each of tile k through the page table.
#pragma nv_exec_check_disable
  __host__ __device__ void resolve(int t, int k) const {
    if (t >= tile) return;
    if (!kIndexAhead) fetch(t, k);
    auto& r = ex.regs(t);
    ex.moves(k % kBuffers)[t] = resolve_move(g, task.table_row, task.head, r.src, r.dst, task.limits, r.skipped);
    if (kIndexAhead && k + 1 < tiles) fetch(t, k + 1);
  }

#pragma nv_exec_check_disable
  __host__ __device__ void report(int t) const { ex.regs(t).skipped.report(task.limits.errors); }

  // Source or destination address of vector i of tile k, or nullptr past the tile or when the
  // vector's move copies nothing (fill, identity, out of range, or past the last move).  Computed
  // without a branch (a vector past the tile reads move 0's slot, then is dropped by the final
  // select), so the compiler predicates the load and the store on the result instead of branching
  // around them, and a tile's loads issue back to back.
#pragma nv_exec_check_disable
  __host__ __device__ uint8_t* address(int i, int k, bool source) const {
    const bool in_tile = i < tile * move_vectors(g.row_vectors(), task.slices);
    const TileVector tv = tile_vector(in_tile ? i : 0, g.row_vectors(), task.slices, task.slice);
    const ResolvedMove rm = ex.moves(k % kBuffers)[tv.move];
    uint8_t* base = tv.pool == 0 ? task.pools.k : task.pools.v;
    const int64_t stride = tv.pool == 0 ? task.pools.k_page_stride : task.pools.v_page_stride;
    const int64_t offset = source ? row_offset(g, stride, rm.src_page, rm.src_row)
                                  : row_offset(g, stride, rm.dst_page, rm.dst_row);
    return in_tile && rm.dst_page >= 0 ? base + offset + 16 * tv.vec : nullptr;
  }

  // Tile k into ring slot `slot` (k % kRing; a constant on the GPU).
#pragma nv_exec_check_disable
  __host__ __device__ void load(int t, int k, int slot) const {
#pragma unroll
    for (int j = 0; j < kPer; ++j) ex.regs(t).ring[slot][j] = ex.load16_if(address(t + j * kThreads, k, true));
  }

#pragma nv_exec_check_disable
  __host__ __device__ void store(int t, int k, int slot) const {
#pragma unroll
    for (int j = 0; j < kPer; ++j) {
      uint8_t* p = address(t + j * kThreads, k, false);
      if (p) ex.store16(p, ex.regs(t).ring[slot][j]);
    }
  }

  // Tile k, held in ring slot `slot`:  barrier | load(k+D) || store(k) | resolve(k+D+1).
  // The barrier: tile k loaded by every thread (b), tile k+D resolved.  Resolving tile k+D+1 (the
  // move, then its page: two dependent loads) after issuing tile k+D's loads overlaps their
  // latencies instead of adding them.  It writes buffer (k+D+1) % (D+2), tile k-1's, which every
  // thread finished with before this barrier; tiles k .. k+D (read in this phase) use the others.
#pragma nv_exec_check_disable
  __host__ __device__ void step(int k, int slot) const {
    ex.barrier();
    ex.overlap([&](int t) { if (k + kLoadAhead < tiles) load(t, k + kLoadAhead, (slot + kLoadAhead) % kRing); },
               [&](int t) { store(t, k, slot); });  // (c): disjoint from tile k's stores
    if (k + kLoadAhead + 1 < tiles) ex.each_thread([&](int t) { resolve(t, k + kLoadAhead + 1); });
  }
};

// One CTA's moves, tile after tile (Walk::step), after a prologue that resolves tiles 0 .. D and
// loads tiles 0 .. D-1; then each thread reports the moves it skipped.  The steps run kRing at a
// time so that every ring slot is a constant after unrolling (registers, not local memory).
#pragma nv_exec_check_disable
template <int kThreads, int kPer, int kLoadAhead, bool kIndexAhead, class Exec>
__host__ __device__ inline void walk_moves(Exec& ex, const Geometry& g, const CtaTask& task, int tile) {
  using W = Walk<kThreads, kPer, kLoadAhead, kIndexAhead, Exec>;
  const int tiles = (task.count + tile - 1) / tile;
  if (tiles == 0) return;
  const W w{ex, g, task, tile, tiles};
  ex.each_thread([&](int t) {
    if (kIndexAhead && t < tile) w.fetch(t, 0);
    for (int k = 0; k <= kLoadAhead && k < tiles; ++k) w.resolve(t, k);
  });
  ex.barrier();
  ex.each_thread([&](int t) {
#pragma unroll
    for (int k = 0; k < kLoadAhead; ++k) {
      if (k < tiles) w.load(t, k, k);
    }
  });
  for (int k0 = 0; k0 < tiles; k0 += W::kRing) {
#pragma unroll
    for (int slot = 0; slot < W::kRing; ++slot) {
      if (k0 + slot < tiles) w.step(k0 + slot, slot);
    }
  }
  ex.each_thread([&](int t) { w.report(t); });
}

// ---------------------------------------------------------------------------------------------
// The kernel
// ---------------------------------------------------------------------------------------------

// Pool descriptors travel by value in the launch (read during the host call only, so a captured
// CUDA graph keeps them); a launch covers up to kLayersPerLaunch layers (2 KiB of parameters).
constexpr int kLayersPerLaunch = 64;
struct LaunchPools {
  LayerPools layers[kLayersPerLaunch];
  int64_t num_pages[kLayersPerLaunch];  // pages each of the layer's K and V pools holds
  int first_layer;
};

// Exec of one GPU thread (see walk_moves).
template <int kPer, int kRing, int kStride>
struct ThreadExec {
  ResolvedMove (*tiles)[kStride];  // [move_buffers][kStride] in shared memory (a tile's moves from the row's start)
  TileRegs<kPer, kRing> r;

  template <class F>
  __device__ __forceinline__ void each_thread(F f) { f((int)threadIdx.x); }
  template <class L, class S>
  __device__ __forceinline__ void overlap(L load, S store) {
    load((int)threadIdx.x);
    store((int)threadIdx.x);
  }
  __device__ __forceinline__ void barrier() { __syncthreads(); }
  __device__ __forceinline__ TileRegs<kPer, kRing>& regs(int) { return r; }
  __device__ __forceinline__ ResolvedMove* moves(int buffer) { return tiles[buffer]; }
  // L2-only load (the pools are written by this kernel, so the non-coherent path is off limits),
  // predicated on p != nullptr inside one PTX instruction: no branch, so a tile's loads still issue
  // back to back, and a move that stores nothing reads no memory.  volatile like __ldcg's asm, so it
  // stays between the barriers it was written between.  A skipped load leaves v undefined; its
  // vector is never stored (Walk::store skips the same move).
  __device__ __forceinline__ uint4 load16_if(const uint8_t* p) {
    uint4 v;
    asm volatile(
        "{\n\t.reg .pred p;\n\tsetp.ne.u64 p, %4, 0;\n\t@p ld.global.cg.v4.u32 {%0, %1, %2, %3}, [%4];\n\t}"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(p));
    return v;
  }
  // Streaming stores: a moved row is not read again by this kernel.
  __device__ __forceinline__ void store16(uint8_t* p, uint4 v) { __stcs(reinterpret_cast<uint4*>(p), v); }
};

// Moves a tile of family F holds for a CTA copying `per_move` vectors of every move.
template <class F>
__host__ __device__ constexpr int family_tile(int per_move) {
  return tile_moves(F::kThreads, F::kTileTokens, per_move, F::kLoadAhead);
}

// What every CTA of a launch is given (the kernel's arguments past the pools).
struct LaunchArgs {
  const int32_t* page_table;
  int64_t page_table_stride;
  const int32_t* src;
  const int32_t* dst;
  int64_t moves_per_head;
  RequestRange range;
  MoveLimits limits;
};

// One CTA's walk over unit u, copying run `part` of kParts of the unit's slice (kPerMove vectors of
// every move), its resolved moves in `tiles` (rows of kStride moves: the longest tile of the
// kernel's walks).  The run's count is a constant here, so a vector's move and column divide by
// constants.
template <class F, int kParts, int kStride>
__device__ __forceinline__ void walk_cta(ResolvedMove (*tiles)[kStride], const LaunchPools& pools,
                                         const LaunchArgs& a, const UnitIndex& u, int part) {
  constexpr Geometry g = F::geometry();
  constexpr int kPerMove = move_vectors(g.row_vectors(), F::kSlices * kParts);
  constexpr int kTile = family_tile<F>(kPerMove);
  constexpr int kPer = vectors_per_thread(F::kThreads, kTile, kPerMove);
  static_assert(kPer <= kMaxVectorsInFlight, "rows too long for the register tiles");
  CtaTask task = cta_task(g, pools.layers[u.layer], a.page_table, a.page_table_stride, a.src, a.dst,
                          a.moves_per_head, a.range, u.request, u.head, pools.first_layer + u.layer, a.limits,
                          F::kSlices * kParts, u.slice * kParts + part);
  if (F::kTailSplit > 1) task.pools = run_pools(g, task.pools, task.slices, task.slice);
  ThreadExec<kPer, ring_tiles(F::kLoadAhead), kStride> ex{tiles, {}};
  walk_moves<F::kThreads, kPer, F::kLoadAhead, F::kIndexAhead>(ex, g, task, kTile);
}

// F (generated) provides: static geometry(), kThreads, kTileTokens, kSlices, kLoadAhead, kIndexAhead,
// kTailSplit.  Grid with kTailSplit 1: x = request * kSlices + slice, y = KV head, z = layer within
// this launch's LaunchPools (a unit's indices straight from blockIdx, which the compiler re-reads
// instead of holding them); else x = the CTAs of cta_unit over this launch's units (its layers x KV
// heads x `requests` request slots x kSlices), the first `whole` of them one CTA each.
template <class F>
__global__ void __launch_bounds__(F::kThreads)
    compact_kernel(LaunchPools pools, const int32_t* __restrict__ page_table, int64_t page_table_stride,
                   const int32_t* __restrict__ src, const int32_t* __restrict__ dst,
                   const int32_t* __restrict__ offsets, int64_t moves_per_head, int64_t table_tokens, int requests,
                   int whole, DeviceErrors* errors) {
  constexpr Geometry g = F::geometry();
  static_assert(g.row_bytes % 16 == 0, "rows are copied in 16-byte vectors");
  static_assert(2 * g.row_vectors() % (F::kSlices * F::kTailSplit) == 0,
                "a move's vectors split into equal slices, and a slice into equal tail runs");
  static_assert(F::kLoadAhead >= 1, "at least the next tile is loaded while one is stored");
  constexpr int kWholeTile = family_tile<F>(move_vectors(g.row_vectors(), F::kSlices));
  constexpr int kTailTile = family_tile<F>(move_vectors(g.row_vectors(), F::kSlices * F::kTailSplit));
  constexpr int kStride = kWholeTile > kTailTile ? kWholeTile : kTailTile;

  const CtaUnit cta = F::kTailSplit == 1 ? CtaUnit{0, 0, 1} : cta_unit((int)blockIdx.x, whole, F::kTailSplit);
  const UnitIndex u = F::kTailSplit == 1 ? UnitIndex{(int)blockIdx.x / F::kSlices, (int)blockIdx.y, (int)blockIdx.z,
                                                     (int)blockIdx.x % F::kSlices}
                                         : unit_index(cta.unit, requests, g.kv_heads, F::kSlices);
  const RequestRange range = request_range(offsets, u.request, moves_per_head);
  if (range.count == 0) return;  // uniform over the CTA: padded or inactive request

  const LaunchArgs args{page_table, page_table_stride, src, dst, moves_per_head, range,
                        move_limits(table_tokens, pools.num_pages[u.layer], errors)};
  __shared__ ResolvedMove tiles[move_buffers(F::kLoadAhead)][kStride];
  if (F::kTailSplit == 1 || cta.parts == 1) {
    walk_cta<F, 1, kStride>(tiles, pools, args, u, 0);
  } else {
    walk_cta<F, F::kTailSplit, kStride>(tiles, pools, args, u, cta.part);
  }
}

}  // namespace compact
}  // namespace kvgen
