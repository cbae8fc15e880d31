// Driver for the compaction kernel's tile size (kvgen/kernels/cuda/compact_kernels.cuh, tile_moves)
// on the CPU: tests/test_costmodel.py compares every line with the cost model's restatement,
// kvgen.tuning.costmodel.workload.compact_tile.  No GPU, no driver: nothing here calls CUDA.
//
// Build: nvcc -x cu -std=c++17 -I<repo> tests/csrc/compact_tile_check.cu -o compact_tile_check
//
// stdout: one line per case, "threads tile_tokens load_ahead per_move tile_moves", over threads
// 64..512 (the tunable's choices), tile_tokens 8..128, load_ahead 1 and 2, and per_move (16-byte
// vectors of a move one CTA copies) from a sliced short row to a long row of an odd width, and one
// too long for even a one-move tile (the floor of one move).
#include <cstdio>

#include "kvgen/kernels/cuda/compact_kernels.cuh"

namespace kc = kvgen::compact;

// The kernel takes tile_moves as a compile-time constant: it must stay usable as one.
static_assert(kc::tile_moves(256, 32, 16, 1) > 0, "tile_moves is constexpr");

int main() {
  const int threads[] = {64, 128, 256, 512};
  const int tile_tokens[] = {8, 16, 32, 64, 128};
  const int load_ahead[] = {1, 2};
  const int per_move[] = {1, 2, 4, 8, 16, 32, 36, 64, 1024};
  for (int t : threads)
    for (int tokens : tile_tokens)
      for (int ahead : load_ahead)
        for (int p : per_move)
          std::printf("%d %d %d %d %d\n", t, tokens, ahead, p, kc::tile_moves(t, tokens, p, ahead));
  return 0;
}
