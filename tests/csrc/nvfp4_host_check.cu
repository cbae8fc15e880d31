// Driver for kvgen/kernels/cuda/nvfp4.cuh: runs the header's __host__ __device__ arithmetic on the CPU
// (and, optionally, on a GPU) so tests/test_nvfp4_block.py can compare it bit for bit with the
// oracle kvgen/reference/nvfp4.py.
//
// Host build (no GPU, no driver: cudart is linked statically and never called):
//   nvcc -x cu -std=c++17 -I<repo> tests/csrc/nvfp4_host_check.cu -o nvfp4_host_check
// Device build (adds --device; runs the same code in a kernel, one thread per record):
//   nvcc -x cu -std=c++17 -I<repo> -DKVGEN_CHECK_DEVICE -arch=sm_90a ... -o nvfp4_device_check
//
//   nvfp4_host_check --info            "key=value" lines (path macro, constants)
//   nvfp4_host_check [--device] < in > out
//   nvfp4_host_check --sweep-e2m1 [S]  the 2^32 float patterns (NaNs skipped), in groups of 8 taking
//                                      every S-th group (default 1: all; about 3 minutes here),
//                                      through both software roundings, one code and eight at a
//                                      time; prints "mismatches=N" (and the first few), exit 1 if any
//   nvfp4_host_check --sweep-fp8 [G..] the packed-fp16 encode of FP8 blocks (Rounding::PackedF16,
//                                      Q = 1) against the general route, every (block maximum, element)
//                                      byte pair at every position, for each G (default 1); prints
//                                      "mismatches=N" to stderr, exit 1 if any, and writes the blocks
//                                      (u8 x[16], f32 G, u8 scale, u8 packed[8]) to stdout
//   nvfp4_host_check --sweep-bf16 [G..] the bf16 encode with codes on fp16 pairs (Rounding::PackedBF16,
//                                      Q = 1): every (E4M3 scale byte, bf16 element) pair through its
//                                      packer against the contract's code (and the device's refined
//                                      reciprocal against 1/S), then blocks whose maximum
//                                      runs through every finite bf16 magnitude (position and other
//                                      elements varied, NaN/Inf blocks too) against the general route,
//                                      for each G (default 1); prints "mismatches=N" to stderr, exit 1
//                                      if any, and writes the blocks (u16 x[16], f32 G, u8 scale,
//                                      u8 packed[8]) to stdout.  With --device among the arguments (a
//                                      device build) the GPU computes the route's side of both levels.
//   nvfp4_host_check --sweep-decode    every (code byte, E4M3 scale byte) pair through the packed
//                                      decode route (DecodeRoute::Lut, Q = 1) at every byte position
//                                      of a block, against the float route; prints "mismatches=N",
//                                      exit 1 if any, and writes to stdout 256 x 256 records (scale
//                                      major) of u16 bf16[2], u16 fp16[2], u8 fp8[2]: the two elements
//                                      of the code byte, for the Python test to hold against the oracle
//
// Input: records of 72 bytes: float x[16], float G, float Q (little-endian).
// Output: one record of kOutBytes per input record, fields in this order, no padding, LE:
//   element level, for the 16 inputs x_i taken one by one:
//     u8  e4m3_sw[16]   e4m3_from_f32_sw(x_i)
//     u8  e4m3_hw[16]   e4m3_from_f32_hw(x_i)  (fix-ups + the cvt, or NVIDIA's host model of it)
//     u8  e2m1_sw[16]   e2m1_from_f32_sw(x_i)
//     u8  e2m1_hw[16]   low nibble of e2m1x2_hw(x_i, 0)
//     u8  e2m1_raw[16]  low nibble of e2m1x2_cvt_raw(x_i, 0): the bare instruction (model)
//     u16 bf16_x[16], u16 fp16_x[16], u8 fp8_x[16]      round_to_*(x_i)
//   then three times, for Path::Software, Path::Hardware, and Path::Software with the FMA-pipe
//   rounding (Rounding::Fma):
//     u8  scale, u8 packed[8]                            encode_block_path
//     f32 y[16]                                          decode_block
//     u16 bf16_y[16], u16 fp16_y[16], u8 fp8_y[16]
//     u8  scale2, u8 packed2[8], u8 res_scale, u8 res_packed[8]   encode_block_2fp4_path
//     f32 y2[16]                                         decode_block_2fp4
//     u16 bf16_y2[16], u16 fp16_y2[16], u8 fp8_y2[16]
// On the host, and on GPUs without the FP4 cvt, Path::Hardware runs the fix-up logic around
// NVIDIA's software model of the instruction; on a Blackwell build it runs the instruction.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "kvgen/kernels/cuda/nvfp4.cuh"

namespace kn = kvgen::nvfp4;

namespace {

constexpr int kInFloats = 18;
constexpr size_t kHotBytes = 16 * 2 + 16 * 2 + 16;
constexpr size_t kPathBytes = 9 + 64 + kHotBytes + 18 + 64 + kHotBytes;
constexpr size_t kOutBytes = 5 * 16 + kHotBytes + 3 * kPathBytes;

// Byte writer usable on host and device (no std::vector in device code).
struct Writer {
  unsigned char* p;
  __host__ __device__ void u8(uint32_t v) { *p++ = (unsigned char)v; }
  __host__ __device__ void u16(uint32_t v) {
    u8(v & 0xFFu);
    u8(v >> 8);
  }
  __host__ __device__ void f32(float f) {
    const uint32_t u = kn::f32_bits(f);
    for (int k = 0; k < 4; ++k) u8(u >> (8 * k));
  }
};

__host__ __device__ void put_block(Writer& w, const kn::Block& b) {
  w.u8(b.scale);
  for (int i = 0; i < 2; ++i)
    for (int k = 0; k < 4; ++k) w.u8(b.packed[i] >> (8 * k));
}

__host__ __device__ void put_hot(Writer& w, const float (&y)[16]) {
  for (int i = 0; i < 16; ++i) w.u16(kn::round_to_bf16_bits(y[i]));
  for (int i = 0; i < 16; ++i) w.u16(kn::round_to_fp16_bits(y[i]));
  for (int i = 0; i < 16; ++i) w.u8(kn::round_to_fp8_e4m3_bits(y[i]));
}

template <kn::Path P, kn::Rounding R>
__host__ __device__ void put_path(Writer& w, const float (&x)[16], float G, float Q) {
  const kn::Block b = kn::encode_block_path<P, R>(x, G, Q);
  float y[16];
  kn::decode_block(b, Q, y);
  put_block(w, b);
  for (int i = 0; i < 16; ++i) w.f32(y[i]);
  put_hot(w, y);

  const kn::Block2FP4 b2 = kn::encode_block_2fp4_path<P, R>(x, G, Q);
  float y2[16];
  kn::decode_block_2fp4(b2, Q, y2);
  put_block(w, b2.main);
  put_block(w, b2.residual);
  for (int i = 0; i < 16; ++i) w.f32(y2[i]);
  put_hot(w, y2);
}

__host__ __device__ void fill(const float* rec, unsigned char* out) {
  float x[16];
  for (int i = 0; i < 16; ++i) x[i] = rec[i];
  const float G = rec[16], Q = rec[17];
  Writer w{out};
  for (int i = 0; i < 16; ++i) w.u8(kn::e4m3_from_f32_sw(x[i]));
  for (int i = 0; i < 16; ++i) w.u8(kn::e4m3_from_f32_hw(x[i]));
  for (int i = 0; i < 16; ++i) w.u8(kn::e2m1_from_f32_sw(x[i]));
  for (int i = 0; i < 16; ++i) w.u8(kn::e2m1x2_hw(x[i], 0.0f) & 0xFu);
  for (int i = 0; i < 16; ++i) w.u8(kn::e2m1x2_cvt_raw(x[i], 0.0f) & 0xFu);
  put_hot(w, x);
  put_path<kn::Path::Software, kn::Rounding::Integer>(w, x, G, Q);
  put_path<kn::Path::Hardware, kn::Rounding::Integer>(w, x, G, Q);
  put_path<kn::Path::Software, kn::Rounding::Fma>(w, x, G, Q);
}

#if defined(KVGEN_CHECK_DEVICE)
__global__ void check_kernel(const float* in, unsigned char* out, size_t n, int* path) {
  const size_t r = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (r == 0) *path = KVGEN_NVFP4_HW_PATH;
  if (r < n) fill(in + kInFloats * r, out + kOutBytes * r);
}

#define CK(call)                                                                  \
  do {                                                                            \
    cudaError_t e_ = (call);                                                      \
    if (e_ != cudaSuccess) {                                                      \
      fprintf(stderr, "%s failed: %s\n", #call, cudaGetErrorString(e_));          \
      return false;                                                               \
    }                                                                             \
  } while (0)

bool run_device(const std::vector<float>& in, std::vector<unsigned char>& out, size_t n) {
  float* d_in = nullptr;
  unsigned char* d_out = nullptr;
  int* d_path = nullptr;
  CK(cudaMalloc(&d_in, in.size() * sizeof(float) + 4));
  CK(cudaMalloc(&d_out, out.size() + 1));
  CK(cudaMalloc(&d_path, sizeof(int)));
  CK(cudaMemcpy(d_in, in.data(), in.size() * sizeof(float), cudaMemcpyHostToDevice));
  const unsigned threads = 64;
  check_kernel<<<(unsigned)((n + threads - 1) / threads) + 1, threads>>>(d_in, d_out, n, d_path);
  CK(cudaGetLastError());
  CK(cudaDeviceSynchronize());
  int path = -1;
  CK(cudaMemcpy(out.data(), d_out, out.size(), cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(&path, d_path, sizeof(int), cudaMemcpyDeviceToHost));
  fprintf(stderr, "device KVGEN_NVFP4_HW_PATH=%d\n", path);
  cudaFree(d_in);
  cudaFree(d_out);
  cudaFree(d_path);
  return true;
}
#endif

// The FMA-pipe rounding against the integer one over every non-NaN float pattern: one code at a
// time (magnitude and, through e2m1x8, sign), and eight at a time with pattern i at position i % 8
// and again reversed, so every nibble position of the packer sees 2^29 patterns each way.
int sweep_e2m1(uint64_t stride) {
  uint64_t mismatches = 0;
  auto report = [&](const char* what, uint32_t bits, uint32_t got, uint32_t want) {
    if (mismatches++ < 8) printf("%s 0x%08X: fma 0x%08X integer 0x%08X\n", what, bits, got, want);
  };
  for (uint64_t base = 0; base < (1ull << 32); base += 8 * stride) {
    float p[8], q[8];
    for (int k = 0; k < 8; ++k) {
      const uint32_t bits = (uint32_t)(base + k);
      const float v = kn::is_nan(kn::bits_f32(bits)) ? 0.0f : kn::bits_f32(bits);
      p[k] = v;
      q[7 - k] = v;
      const uint32_t want = kn::e2m1_magnitude_sw(v);
      const uint32_t got = kn::e2m1_magnitude_fma_bits(v) - 0x4B000000u;
      if (got != want) report("magnitude", bits, got, want);
      const uint32_t fused = kn::e2m1_magnitude_fma_bits<true>(v) - 0x4B000000u;
      if (fused != want) report("fused magnitude", bits, fused, want);
    }
    const uint32_t want = kn::e2m1x8_sw(p), want_r = kn::e2m1x8_sw(q);
    const uint32_t got = kn::e2m1x8_fma(p), got_r = kn::e2m1x8_fma(q);
    if (got != want) report("x8", (uint32_t)base, got, want);
    if (got_r != want_r) report("x8 reversed", (uint32_t)base, got_r, want_r);
    const uint32_t fused = kn::e2m1x8_fma<true>(p), fused_r = kn::e2m1x8_fma<true>(q);
    if (fused != want) report("fused x8", (uint32_t)base, fused, want);
    if (fused_r != want_r) report("fused x8 reversed", (uint32_t)base, fused_r, want_r);
  }
  printf("mismatches=%llu\n", (unsigned long long)mismatches);
  return mismatches ? 1 : 0;
}

// The packed decode route against the float route (decode_block, Q = 1, then round_to_*) for every
// scale byte and every code byte, each byte at every position: block bytes are b, b+1, .., b+7
// (mod 256), so over all b each value sits at each of the 8 byte positions.
int sweep_decode() {
  uint64_t mismatches = 0;
  std::vector<unsigned char> table;
  for (uint32_t sb = 0; sb < 256; ++sb) {
    for (uint32_t b = 0; b < 256; ++b) {
      kn::Block blk;
      blk.scale = (uint8_t)sb;
      for (int w = 0; w < 2; ++w) {
        blk.packed[w] = 0;
        for (int k = 0; k < 4; ++k) blk.packed[w] |= ((b + 4 * w + k) & 0xFFu) << (8 * k);
      }
      float y[16];
      kn::decode_block(blk, 1.0f, y);
      uint32_t bf[8], hf[8], f8[4];
      kn::decode_block_bf16_lut(blk, bf);
      kn::decode_block_f16_lut(blk, hf);
      kn::decode_block_fp8_lut(blk, f8);
      for (int i = 0; i < 16; ++i) {
        const uint32_t got_bf = (bf[i / 2] >> (16 * (i % 2))) & 0xFFFFu;
        const uint32_t got_hf = (hf[i / 2] >> (16 * (i % 2))) & 0xFFFFu;
        const uint32_t got_f8 = (f8[i / 4] >> (8 * (i % 4))) & 0xFFu;
        const bool ok = got_bf == kn::round_to_bf16_bits(y[i]) && got_hf == kn::round_to_fp16_bits(y[i]) &&
                        got_f8 == kn::round_to_fp8_e4m3_bits(y[i]);
        if (!ok && mismatches++ < 8)
          fprintf(stderr, "scale 0x%02X byte 0x%02X element %d: lut %04X %04X %02X float %04X %04X %02X\n", sb, b, i,
                  got_bf, got_hf, got_f8, kn::round_to_bf16_bits(y[i]), kn::round_to_fp16_bits(y[i]),
                  kn::round_to_fp8_e4m3_bits(y[i]));
      }
      // Elements 0 and 1 come from code byte b (block byte 0).
      for (int i = 0; i < 2; ++i) {
        const uint32_t v = (bf[0] >> (16 * i)) & 0xFFFFu;
        table.push_back(v & 0xFFu), table.push_back(v >> 8);
      }
      for (int i = 0; i < 2; ++i) {
        const uint32_t v = (hf[0] >> (16 * i)) & 0xFFFFu;
        table.push_back(v & 0xFFu), table.push_back(v >> 8);
      }
      table.push_back(f8[0] & 0xFFu), table.push_back((f8[0] >> 8) & 0xFFu);
    }
  }
  fwrite(table.data(), 1, table.size(), stdout);
  fprintf(stderr, "mismatches=%llu\n", (unsigned long long)mismatches);
  return mismatches ? 1 : 0;
}

// The packed-fp16 encode of FP8 E4M3 blocks (Rounding::PackedF16) against the general route over
// every (block maximum, element) pair: for each G given and each magnitude byte a, blocks whose
// element at position p (every p) is +-a and whose other 15 elements run through every byte of
// magnitude <= a, plus blocks with a NaN byte (the fallback). Prints "mismatches=N" to stderr, exit
// 1 if any, and writes each block to stdout as u8 x[16], f32 G, u8 scale, u8 packed[8] for the
// Python test to hold against the oracle.
int sweep_fp8(const std::vector<float>& gs) {
  uint64_t mismatches = 0, blocks = 0;
  std::vector<unsigned char> out;
  auto check = [&](const uint8_t (&bytes)[16], float G) {
    uint32_t w[4] = {0, 0, 0, 0};
    float x[16];
    for (int e = 0; e < 16; ++e) {
      w[e / 4] |= (uint32_t)bytes[e] << (8 * (e % 4));
      x[e] = kn::e4m3_to_f32(bytes[e]);
    }
    const kn::Block got = kn::encode_block_e4m3x16(w, G);
    const kn::Block want = kn::encode_block_path<kn::Path::Software, kn::Rounding::Integer>(x, G, 1.0f);
    ++blocks;
    if ((got.scale != want.scale || got.packed[0] != want.packed[0] || got.packed[1] != want.packed[1]) &&
        mismatches++ < 8) {
      fprintf(stderr, "G %g bytes", G);
      for (int e = 0; e < 16; ++e) fprintf(stderr, " %02X", bytes[e]);
      fprintf(stderr, ": packed %02X %08X %08X, general %02X %08X %08X\n", got.scale, got.packed[1], got.packed[0],
              want.scale, want.packed[1], want.packed[0]);
    }
    out.insert(out.end(), bytes, bytes + 16);
    const uint32_t g = kn::f32_bits(G);
    for (int k = 0; k < 4; ++k) out.push_back((unsigned char)(g >> (8 * k)));
    out.push_back(got.scale);
    for (int i = 0; i < 8; ++i) out.push_back((unsigned char)(got.packed[i / 4] >> (8 * (i % 4))));
  };
  // The device's c (rcp.approx, within 2^-23 of 1/S, rounded to fp16) is the host's fl16(m): fl16 is
  // constant within 2^-21 of m for every non-zero, non-NaN scale byte.
  for (uint32_t sb = 1; sb < 0x7F; ++sb) {
    const double m = kn::div_rn(1.0f, kn::e4m3_to_f32(sb));
    const uint32_t c = kn::recip_f16(kn::e4m3_to_f32(sb));
    const uint32_t lo = __half_as_ushort(__double2half(m * (1.0 - 0x1p-21)));
    const uint32_t hi = __half_as_ushort(__double2half(m * (1.0 + 0x1p-21)));
    if ((lo != c || hi != c) && mismatches++ < 8) fprintf(stderr, "scale 0x%02X: fp16 of 1/S not stable\n", sb);
  }
  for (const float G : gs) {
    for (uint32_t a = 0; a < 0x7F; ++a) {
      std::vector<uint8_t> rest;  // every byte of magnitude <= a, both signs
      for (uint32_t b = 0; b < 256; ++b)
        if ((b & 0x7Fu) <= a) rest.push_back((uint8_t)b);
      for (size_t start = 0; start < rest.size(); start += 15) {
        for (int p = 0; p < 16; ++p) {
          for (const uint32_t sign : {0u, 0x80u}) {
            uint8_t bytes[16];
            bytes[p] = (uint8_t)(a | sign);
            for (int i = 0; i < 15; ++i) bytes[(p + 1 + i) % 16] = rest[(start + i) % rest.size()];
            check(bytes, G);
          }
        }
      }
    }
    // NaN bytes at every position, beside large and tiny values: the general route.
    for (int p = 0; p < 16; ++p) {
      for (const uint8_t nan : {(uint8_t)0x7F, (uint8_t)0xFF}) {
        uint8_t bytes[16];
        for (int e = 0; e < 16; ++e) bytes[e] = (uint8_t)(e * 37 + p * 11);
        for (int e = 0; e < 16; ++e) bytes[e] = (bytes[e] & 0x7Fu) == 0x7Fu ? 0x7Eu : bytes[e];
        bytes[p] = nan;
        check(bytes, G);
      }
    }
  }
  fwrite(out.data(), 1, out.size(), stdout);
  fprintf(stderr, "blocks=%llu mismatches=%llu\n", (unsigned long long)blocks, (unsigned long long)mismatches);
  return mismatches ? 1 : 0;
}

// Rounding::PackedBF16 over every (scale, element) pair, then over blocks (see the usage above).
// Group g of the element level: scale byte 1 + g / 8192, the eight bf16 patterns from 8 (g % 8192);
// NaN/Inf patterns become a zero of their sign (a block holding one takes the fallback).
constexpr uint32_t kBF16Groups = 0x7Eu * 8192u;

__host__ __device__ uint32_t bf16_group_pattern(uint32_t g, int k) {
  const uint32_t b = (g % 8192u) * 8u + (uint32_t)k;
  return (b & 0x7F80u) == 0x7F80u ? b & 0x8000u : b;
}

// The route's eight codes of group g, with this side's multiplier (the device's from rcp.approx).
__host__ __device__ uint32_t bf16_group_codes(uint32_t g) {
  const float S = kn::e4m3_to_f32(1u + g / 8192u);
  uint32_t w[4];
  for (int j = 0; j < 4; ++j) w[j] = bf16_group_pattern(g, 2 * j) | (bf16_group_pattern(g, 2 * j + 1) << 16);
  return kn::e2m1x8_bf16(w, kn::tie_scaled_multiplier(S, kn::recip_e4m3(S)));
}

struct BF16Block {
  uint32_t w[8];
  float G;
};

#if defined(KVGEN_CHECK_DEVICE)
__global__ void bf16_groups_kernel(uint32_t* got) {
  const uint32_t g = blockIdx.x * blockDim.x + threadIdx.x;
  if (g < kBF16Groups) got[g] = bf16_group_codes(g);
}

__global__ void bf16_blocks_kernel(const BF16Block* in, kn::Block* out, size_t n) {
  const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = kn::encode_block_bf16x16(in[i].w, in[i].G);
}

// Both sweeps' results computed by the GPU.
bool bf16_on_device(std::vector<uint32_t>& groups, const std::vector<BF16Block>& in, std::vector<kn::Block>& out) {
  uint32_t* d_groups = nullptr;
  BF16Block* d_in = nullptr;
  kn::Block* d_out = nullptr;
  CK(cudaMalloc(&d_groups, groups.size() * sizeof(uint32_t)));
  CK(cudaMalloc(&d_in, in.size() * sizeof(BF16Block)));
  CK(cudaMalloc(&d_out, in.size() * sizeof(kn::Block)));
  CK(cudaMemcpy(d_in, in.data(), in.size() * sizeof(BF16Block), cudaMemcpyHostToDevice));
  bf16_groups_kernel<<<(kBF16Groups + 255) / 256, 256>>>(d_groups);
  bf16_blocks_kernel<<<(unsigned)((in.size() + 255) / 256), 256>>>(d_in, d_out, in.size());
  CK(cudaGetLastError());
  CK(cudaMemcpy(groups.data(), d_groups, groups.size() * sizeof(uint32_t), cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(out.data(), d_out, in.size() * sizeof(kn::Block), cudaMemcpyDeviceToHost));
  CK(cudaFree(d_groups));
  CK(cudaFree(d_in));
  CK(cudaFree(d_out));
  return true;
}
#endif

int sweep_bf16(const std::vector<float>& gs, bool device) {
  uint64_t mismatches = 0, blocks = 0;
  // The device's m: the corrected approximate reciprocal, from any start within two ulps.
  for (uint32_t sb = 1; sb < 0x7F; ++sb) {
    const float S = kn::e4m3_to_f32(sb);
    const float m = kn::div_rn(1.0f, S);
    for (int32_t d = -2; d <= 2; ++d) {
      const float y = kn::bits_f32((uint32_t)((int32_t)kn::f32_bits(m) + d));
      if (kn::recip_refined(y, S) != m && mismatches++ < 8)
        fprintf(stderr, "scale 0x%02X: refined reciprocal from %+d ulps is not 1/S\n", sb, d);
    }
  }
  // Block level inputs: the block maximum runs through every finite magnitude (position, signs and
  // the other elements varied), then NaN and Inf patterns at every position (the fallback).
  std::vector<BF16Block> in;
  uint64_t state = 0x9E3779B97F4A7C15ull;
  auto next = [&]() {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    return (uint32_t)(state >> 33);
  };
  auto add = [&](const uint16_t (&e)[16], float G) {
    BF16Block b;
    for (int j = 0; j < 8; ++j) b.w[j] = e[2 * j] | ((uint32_t)e[2 * j + 1] << 16);
    b.G = G;
    in.push_back(b);
  };
  for (const float G : gs) {
    for (uint32_t a = 0; a < 0x7F80u; ++a) {
      uint16_t e[16];
      for (int i = 0; i < 16; ++i) {
        const uint32_t r = next();
        e[i] = (uint16_t)((r & 0x8000u) | ((r & 0x7FFFu) % (a + 1)));  // magnitude <= a
      }
      e[a % 16] = (uint16_t)(a | ((a & 1u) << 15));
      add(e, G);
    }
    for (int p = 0; p < 16; ++p) {
      for (const uint16_t bad : {(uint16_t)0x7FC0, (uint16_t)0xFF81, (uint16_t)0x7F80, (uint16_t)0xFF80}) {
        uint16_t e[16];
        for (int i = 0; i < 16; ++i) e[i] = (uint16_t)((next() & 0xFFFFu) % 0x7F80u);
        e[p] = bad;
        add(e, G);
      }
    }
  }
  std::vector<uint32_t> groups(kBF16Groups);
  std::vector<kn::Block> got(in.size());
  if (device) {
#if defined(KVGEN_CHECK_DEVICE)
    if (!bf16_on_device(groups, in, got)) return 4;
#else
    fprintf(stderr, "built without -DKVGEN_CHECK_DEVICE\n");
    return 5;
#endif
  } else {
    for (uint32_t g = 0; g < kBF16Groups; ++g) groups[g] = bf16_group_codes(g);
    for (size_t i = 0; i < in.size(); ++i) got[i] = kn::encode_block_bf16x16(in[i].w, in[i].G);
  }
  // Element level: against the contract's code of fl32(x * fl32(1/S)).
  for (uint32_t g = 0; g < kBF16Groups; ++g) {
    const float m = kn::div_rn(1.0f, kn::e4m3_to_f32(1u + g / 8192u));
    uint32_t want = 0;
    for (int k = 0; k < 8; ++k)
      want |= kn::e2m1_from_f32_sw(kn::mul_rn(kn::bits_f32(bf16_group_pattern(g, k) << 16), m)) << (4 * k);
    if (groups[g] != want && mismatches++ < 8)
      fprintf(stderr, "scale 0x%02X bf16 0x%04X..: packed %08X, contract %08X\n", 1u + g / 8192u,
              (g % 8192u) * 8u, groups[g], want);
  }
  // Block level: against the general route; every block to stdout for the oracle.
  std::vector<unsigned char> out;
  for (size_t i = 0; i < in.size(); ++i) {
    float x[16];
    for (int e = 0; e < 16; ++e) x[e] = kn::bits_f32((in[i].w[e / 2] >> (16 * (e % 2))) << 16);
    const kn::Block want = kn::encode_block_path<kn::Path::Software, kn::Rounding::Integer>(x, in[i].G, 1.0f);
    ++blocks;
    if ((got[i].scale != want.scale || got[i].packed[0] != want.packed[0] || got[i].packed[1] != want.packed[1]) &&
        mismatches++ < 8) {
      fprintf(stderr, "G %g bf16 pairs", in[i].G);
      for (int j = 0; j < 8; ++j) fprintf(stderr, " %08X", in[i].w[j]);
      fprintf(stderr, ": packed %02X %08X %08X, general %02X %08X %08X\n", got[i].scale, got[i].packed[1],
              got[i].packed[0], want.scale, want.packed[1], want.packed[0]);
    }
    for (int j = 0; j < 8; ++j)
      for (int k = 0; k < 4; ++k) out.push_back((unsigned char)(in[i].w[j] >> (8 * k)));
    const uint32_t g = kn::f32_bits(in[i].G);
    for (int k = 0; k < 4; ++k) out.push_back((unsigned char)(g >> (8 * k)));
    out.push_back(got[i].scale);
    for (int k = 0; k < 8; ++k) out.push_back((unsigned char)(got[i].packed[k / 4] >> (8 * (k % 4))));
  }
  fwrite(out.data(), 1, out.size(), stdout);
  fprintf(stderr, "pairs=%llu blocks=%llu mismatches=%llu\n", (unsigned long long)kBF16Groups * 8ull,
          (unsigned long long)blocks, (unsigned long long)mismatches);
  return mismatches ? 1 : 0;
}

}  // namespace

int main(int argc, char** argv) {
  bool device = false;
  for (int a = 1; a < argc; ++a) {
    if (strcmp(argv[a], "--info") == 0) {
      printf("KVGEN_NVFP4_HW_PATH=%d\n", KVGEN_NVFP4_HW_PATH);
      printf("SIXTH_BITS=0x%08X\n", kn::f32_bits(kn::kSixth));
      printf("OUT_BYTES=%zu\n", kOutBytes);
      // Host arithmetic must keep subnormals (a -ffast-math build would break this).
      printf("SUBNORMAL_OK=%d\n", kn::mul_rn(kn::bits_f32(1u), 1.0f) != 0.0f ? 1 : 0);
#if defined(KVGEN_CHECK_DEVICE)
      printf("DEVICE_BUILD=1\n");
#else
      printf("DEVICE_BUILD=0\n");
#endif
      return 0;
    }
    if (strcmp(argv[a], "--sweep-e2m1") == 0) return sweep_e2m1(a + 1 < argc ? strtoull(argv[a + 1], nullptr, 10) : 1);
    if (strcmp(argv[a], "--sweep-decode") == 0) return sweep_decode();
    if (strcmp(argv[a], "--sweep-bf16") == 0) {
      std::vector<float> gs;
      bool on_device = false;
      for (int g = a + 1; g < argc; ++g) {
        if (strcmp(argv[g], "--device") == 0) on_device = true;
        else gs.push_back(strtof(argv[g], nullptr));
      }
      return sweep_bf16(gs.empty() ? std::vector<float>{1.0f} : gs, on_device);
    }
    if (strcmp(argv[a], "--sweep-fp8") == 0) {
      std::vector<float> gs;
      for (int g = a + 1; g < argc; ++g) gs.push_back(strtof(argv[g], nullptr));
      return sweep_fp8(gs.empty() ? std::vector<float>{1.0f} : gs);
    }
    if (strcmp(argv[a], "--device") == 0) device = true;
  }
  std::vector<float> in;
  float buf[kInFloats * 256];
  size_t got;
  while ((got = fread(buf, sizeof(float), kInFloats * 256, stdin)) > 0)
    in.insert(in.end(), buf, buf + got);
  if (in.size() % kInFloats != 0) {
    fprintf(stderr, "input is not a whole number of 72-byte records\n");
    return 2;
  }
  const size_t n = in.size() / kInFloats;
  std::vector<unsigned char> out(n * kOutBytes);
  if (device) {
#if defined(KVGEN_CHECK_DEVICE)
    if (!run_device(in, out, n)) return 4;
#else
    fprintf(stderr, "built without -DKVGEN_CHECK_DEVICE\n");
    return 5;
#endif
  } else {
    for (size_t r = 0; r < n; ++r) fill(&in[kInFloats * r], &out[kOutBytes * r]);
  }
  if (!out.empty() && fwrite(out.data(), 1, out.size(), stdout) != out.size()) return 3;
  return 0;
}
