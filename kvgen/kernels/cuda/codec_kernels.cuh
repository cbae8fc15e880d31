// kvgen/kernels/cuda/codec_kernels.cuh -- the cold-page codec kernels, generic over a family's geometry.
//
// Generated files (generated/<family>/codec.cu) describe one family as compile-time structs
// (buffer spans, region offsets, G/Q) and instantiate these kernels; the logic lives here, once.
// Contract: COLD_PAGE_FORMAT.md.  One CTA handles one (layer, page pair), a decode CTA DecodePages pairs:
//
//   encode: hot page --(16-element blocks, one per thread per step)--> layer record in shared
//           memory --(16-byte vector stores)--> cold slot (device memory or mapped pinned host;
//           with pinned host slots the store *is* the transfer, in full 16-byte writes).
//   decode: cold slot --(16-byte vector loads)--> shared memory --> hot page.
//
// Staging the record in shared memory turns the record's many small, unaligned regions (scales,
// residuals, lossless bytes) into one linear, aligned stream to or from the cold slot.
//
// The record parts (Quantized, Side, Layer) are __host__ __device__: a kernel splits a record's
// work items over its threads (Lanes), and tests/csrc/codec_record_check.cu runs the same code on
// the CPU, one lane, against the oracle.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#include "device_errors.cuh"
#include "nvfp4.cuh"

// Local to this header (undefined at its end).
#define KVGEN_CODEC_HD __host__ __device__ __forceinline__

namespace kvgen {
namespace codec {

// Pool descriptor of one (layer, buffer): hot page p lives at base + p * page_stride.
struct PoolDesc {
  uint8_t* base;
  int64_t page_stride;
};

// One page-index pair (C ABI layout: int32 dst at offset 0, int32 src at offset 4).
struct PagePair {
  int32_t dst;
  int32_t src;
};

// Host index arrays travel by value in the launch (valid only during the host call), up to
// kPairsPerLaunch pairs; device index arrays are read through a pointer.
constexpr int kPairsPerLaunch = 256;
struct PairBatch {
  PagePair pairs[kPairsPerLaunch];
};

// What a launch may touch: hot pages [0, hot_pages) of every pool of the lifecycle and cold
// slots [0, cold_slots); a pair outside is skipped and recorded in `errors` (device_errors.cuh).
struct PairLimits {
  int64_t hot_pages;
  int64_t cold_slots;
  DeviceErrors* errors;
};

// Whether the CTA's pair is in range; a pair out of range is recorded once (by the CTA of its
// first layer) and the whole CTA skips it (the pair is uniform over the CTA).
template <bool kEncode>
__host__ __device__ __forceinline__ bool pair_in_range(const PagePair& pair, const PairLimits& limits,
                                                       bool record) {
  const int64_t hot = kEncode ? pair.src : pair.dst;
  const int64_t slot = kEncode ? pair.dst : pair.src;
  const bool hot_ok = in_range(hot, limits.hot_pages);
  const bool slot_ok = in_range(slot, limits.cold_slots);
  if (hot_ok && slot_ok) return true;
  if (record) {
    if (!hot_ok) record_device_error(limits.errors, kEncode ? kEncodeHotPage : kDecodeHotPage, hot);
    if (!slot_ok) record_device_error(limits.errors, kEncode ? kEncodeColdSlot : kDecodeColdSlot, slot);
  }
  return false;
}

// Which of a record's work items a caller does: first, first + step, ...  A kernel passes
// (threadIdx.x, blockDim.x) (cta_lanes); a host test walks them all (0, 1).  Unsigned, as
// threadIdx and blockDim are: the loops `for (int i = first; i < n; i += step)` then compile to
// the same code as they did over threadIdx.x / blockDim.x.
struct Lanes {
  unsigned first;
  unsigned step;
};

__device__ __forceinline__ Lanes cta_lanes() { return Lanes{threadIdx.x, blockDim.x}; }

// ---------------------------------------------------------------------------------------------
// Global multipliers G and Q of a quantized buffer (COLD_PAGE_FORMAT.md §3)
// ---------------------------------------------------------------------------------------------
// Scales::Spec: compile-time constants B::kG, B::kQdec of the generated struct (the spec's
// cold_page.scales.<buffer>: {G, Q}, or the default 1).  Scales::PerLayer (cold_page.scales.<buffer>:
// per_layer): entry B::kIndex of the layer's row of the codec's scale table, which
// kvgen_codec_set_layer_scales fills at configure time; one load per record part.
enum class Scales { Spec = 0, PerLayer = 1 };

struct LayerScale {
  float G;
  float Q;
};

template <class B, Scales S>
struct BufferScales;

template <class B>
struct BufferScales<B, Scales::Spec> {
  static constexpr bool kLayerScales = false;
  static constexpr bool kUnitQ = B::kQdec == 1.0f;
  static KVGEN_CODEC_HD LayerScale of(const LayerScale*) { return LayerScale{B::kG, B::kQdec}; }
};

template <class B>
struct BufferScales<B, Scales::PerLayer> {
  static constexpr bool kLayerScales = true;
  static constexpr bool kUnitQ = false;  // Q is known at run time only
  static KVGEN_CODEC_HD LayerScale of(const LayerScale* row) { return row[B::kIndex]; }
};

// ---------------------------------------------------------------------------------------------
// Hot dtypes: two elements at a time, with the packed hardware conversions where they are exact
// ---------------------------------------------------------------------------------------------
// widen2: the two elements in the low bits of `bits` (element 0 lowest) as binary32, exactly.
// narrow2: two binary32 values rounded to the hot dtype (the contract's single rounding), packed
// the same way.  The packed cvt instructions round to nearest even, overflow to +-Inf and write
// the canonical NaN, exactly like the per-element functions of nvfp4.cuh (which the tests pin).

struct HotBF16 {
  static constexpr int kBytes = 2;
  static constexpr bool kBF16 = true;
  static KVGEN_CODEC_HD float2 widen2(uint32_t bits) {
    return make_float2(nvfp4::bits_f32(bits << 16), nvfp4::bits_f32(bits & 0xFFFF0000u));
  }
  static KVGEN_CODEC_HD uint32_t narrow2(float a, float b) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
    return *reinterpret_cast<const uint32_t*>(&h);
  }
  static KVGEN_CODEC_HD void decode_lut(const nvfp4::Block& b, uint32_t (&w)[8]) {
    nvfp4::decode_block_bf16_lut(b, w);
  }
  static KVGEN_CODEC_HD void decode_word_lut(uint32_t packed, uint8_t scale, uint32_t (&w)[4]) {
    nvfp4::decode_word_bf16_lut(packed, scale, w);
  }
};

struct HotFP16 {
  static constexpr int kBytes = 2;
  static constexpr bool kBF16 = false;
  static KVGEN_CODEC_HD float2 widen2(uint32_t bits) {
    return __half22float2(*reinterpret_cast<const __half2*>(&bits));
  }
  static KVGEN_CODEC_HD uint32_t narrow2(float a, float b) {
    const __half2 h = __floats2half2_rn(a, b);
    return *reinterpret_cast<const uint32_t*>(&h);
  }
  static KVGEN_CODEC_HD void decode_lut(const nvfp4::Block& b, uint32_t (&w)[8]) {
    nvfp4::decode_block_f16_lut(b, w);
  }
  static KVGEN_CODEC_HD void decode_word_lut(uint32_t packed, uint8_t scale, uint32_t (&w)[4]) {
    nvfp4::decode_word_f16_lut(packed, scale, w);
  }
};

struct HotFP8E4M3 {
  static constexpr int kBytes = 1;
  static constexpr bool kBF16 = false;
  // E4M3 -> f16 is exact (every E4M3 value, subnormals included, is an f16), and one cvt does two.
  static KVGEN_CODEC_HD float2 widen2(uint32_t bits) {
    const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(bits & 0xFFFFu), __NV_E4M3);
    return __half22float2(*reinterpret_cast<const __half2*>(&h));
  }
  // cvt.rn.satfinite.e4m3x2.f32: nearest even, saturating at +-448, NaN -> 0x7F, two at a time.
  // Decoded values are finite (a valid record never holds a NaN scale), so nvfp4.cuh's Inf clamp
  // is not needed here.
  static KVGEN_CODEC_HD uint32_t narrow2(float a, float b) {
    return __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, __NV_E4M3);
  }
  static KVGEN_CODEC_HD void decode_lut(const nvfp4::Block& b, uint32_t (&w)[4]) {
    nvfp4::decode_block_fp8_lut(b, w);
  }
};

// 16 hot elements are 1 or 2 uint4 vectors, i.e. 4 or 8 32-bit words.
template <class Hot>
struct HotBlock {
  static constexpr int kWords = 4 * Hot::kBytes;
  static constexpr int kPairsPerWord = 2 / Hot::kBytes;  // bf16/fp16: one pair; fp8: two
  uint32_t w[kWords];

  KVGEN_CODEC_HD void load(const uint8_t* __restrict__ p) {
#pragma unroll
    for (int i = 0; i < kWords / 4; ++i) {
#if defined(__CUDA_ARCH__)
      const uint4 v = __ldg(reinterpret_cast<const uint4*>(p) + i);
#else
      const uint4 v = reinterpret_cast<const uint4*>(p)[i];
#endif
      w[4 * i] = v.x;
      w[4 * i + 1] = v.y;
      w[4 * i + 2] = v.z;
      w[4 * i + 3] = v.w;
    }
  }
  KVGEN_CODEC_HD void store(uint8_t* p) const {
#pragma unroll
    for (int i = 0; i < kWords / 4; ++i) {
      reinterpret_cast<uint4*>(p)[i] = make_uint4(w[4 * i], w[4 * i + 1], w[4 * i + 2], w[4 * i + 3]);
    }
  }
  KVGEN_CODEC_HD void widen(float (&x)[16]) const {
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const uint32_t word = w[i / kPairsPerWord];
      const float2 v = Hot::widen2(word >> (16 * (i % kPairsPerWord)));
      x[2 * i] = v.x;
      x[2 * i + 1] = v.y;
    }
  }
  // One NVFP4 block (Q == 1) straight to hot words, nvfp4::DecodeRoute::Lut.
  KVGEN_CODEC_HD void decode_lut(const nvfp4::Block& b) { Hot::decode_lut(b, w); }
  KVGEN_CODEC_HD void narrow(const float (&y)[16]) {
#pragma unroll
    for (int i = 0; i < kWords; ++i) w[i] = 0;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      w[i / kPairsPerWord] |= Hot::narrow2(y[2 * i], y[2 * i + 1]) << (16 * (i % kPairsPerWord));
    }
  }
};

// ---------------------------------------------------------------------------------------------
// Byte moves whose alignment is known at compile time
// ---------------------------------------------------------------------------------------------

// Largest power of two <= 16 dividing x (16 for x == 0).
__host__ __device__ constexpr int align_of(long long x) {
  return x % 16 == 0 ? 16 : x % 8 == 0 ? 8 : x % 4 == 0 ? 4 : x % 2 == 0 ? 2 : 1;
}
__host__ __device__ constexpr int min_align(int a, int b) { return a < b ? a : b; }

template <int kAlign> struct Word;
template <> struct Word<1> { using T = uint8_t; };
template <> struct Word<2> { using T = uint16_t; };
template <> struct Word<4> { using T = uint32_t; };
template <> struct Word<8> { using T = uint2; };
template <> struct Word<16> { using T = uint4; };

// Copy kBytes bytes, the lanes striding over kAlign-byte words.
template <int kBytes, int kAlign>
KVGEN_CODEC_HD void cta_copy(uint8_t* __restrict__ dst, const uint8_t* __restrict__ src, Lanes lanes) {
  using T = typename Word<kAlign>::T;
  static_assert(kBytes % kAlign == 0, "copy size must be a multiple of its alignment");
  for (int i = lanes.first; i < kBytes / kAlign; i += lanes.step) {
    reinterpret_cast<T*>(dst)[i] = reinterpret_cast<const T*>(src)[i];
  }
}

// 8 packed bytes of one block, to shared memory at an offset aligned to kAlign.
template <int kAlign>
KVGEN_CODEC_HD void put8(uint8_t* p, const nvfp4::Block& b) {
  if constexpr (kAlign >= 8) {
    *reinterpret_cast<uint2*>(p) = make_uint2(b.packed[0], b.packed[1]);
  } else if constexpr (kAlign >= 4) {
    reinterpret_cast<uint32_t*>(p)[0] = b.packed[0];
    reinterpret_cast<uint32_t*>(p)[1] = b.packed[1];
  } else {
#pragma unroll
    for (int i = 0; i < 8; ++i) p[i] = (uint8_t)(b.packed[i / 4] >> (8 * (i % 4)));
  }
}

template <int kAlign>
KVGEN_CODEC_HD nvfp4::Block get8(const uint8_t* p, uint8_t scale) {
  nvfp4::Block b;
  if constexpr (kAlign >= 8) {
    const uint2 w = *reinterpret_cast<const uint2*>(p);
    b.packed[0] = w.x;
    b.packed[1] = w.y;
  } else if constexpr (kAlign >= 4) {
    b.packed[0] = reinterpret_cast<const uint32_t*>(p)[0];
    b.packed[1] = reinterpret_cast<const uint32_t*>(p)[1];
  } else {
    b.packed[0] = b.packed[1] = 0;
#pragma unroll
    for (int i = 0; i < 8; ++i) b.packed[i / 4] |= (uint32_t)p[i] << (8 * (i % 4));
  }
  b.scale = scale;
  return b;
}

// ---------------------------------------------------------------------------------------------
// Record parts.  B (generated) provides:
//   kIndex, kRows, kRowDim, kPrefix, kQ, kSuffix, kR, kResStart,
//   kData, kScales, kResidual, kResidualScales, kLossless (record offsets), and kG, kQdec with
//   Scales::Spec.
// R is the software path's E2M1 rounding route and D the decode route of plain blocks (tunables:
// every choice gives the contract's bytes), kBatch the plain blocks a thread loads before encoding
// them and kSplit the threads sharing one plain block in decode (tunables, same bytes; kSplit 2
// applies to the Lut route of 16-bit hot dtypes, where half a block is one 16-byte store).
// DecodeRoute::Lut is exact only for Q == 1: with a compiled Q != 1, or per-layer scales (Q known
// at run time), the float route is compiled whatever D says (it is exact for every Q), and with it
// whole blocks whatever kSplit says.
// ---------------------------------------------------------------------------------------------

template <class B, class Hot, nvfp4::Rounding R, nvfp4::DecodeRoute D = nvfp4::DecodeRoute::Float,
          int kBatch = 1, int kSplit = 1, Scales S = Scales::Spec>
struct Quantized {
  using Scale = BufferScales<B, S>;
  static constexpr int kIndex = B::kIndex;
  static constexpr bool kLayerScales = Scale::kLayerScales;
  static constexpr int kPageBytes = B::kRows * B::kRowDim * Hot::kBytes;
  static constexpr int kBlocksPerRow = B::kQ / 16;
  static constexpr int kBlocks = B::kRows * kBlocksPerRow;
  static constexpr int kRowBytes = B::kRowDim * Hot::kBytes;
  static constexpr int kResFirst = B::kResStart / 16;
  static constexpr int kResBlocksPerRow = B::kR / 16;
  static constexpr int kLosslessRowBytes = (B::kPrefix + B::kSuffix) * Hot::kBytes;
  static constexpr int kPrefixBytes = B::kPrefix * Hot::kBytes;
  static constexpr int kSuffixStart = (B::kRowDim - B::kSuffix) * Hot::kBytes;
  static constexpr int kLosslessAlign = align_of(B::kLossless);
  static_assert(B::kQ % 16 == 0 && B::kR % 16 == 0 && B::kPrefix % 16 == 0, "spans are multiples of 16");
  static_assert(kBatch >= 1, "at least one block per batch");
  static_assert(kSplit == 1 || kSplit == 2, "a plain block is decoded by one or two threads");

  // Work is split in two index spaces, plain blocks and 2FP4 blocks, each walked by the whole CTA:
  // a warp then runs one path only (a 2FP4 block costs three plain ones), instead of diverging
  // whenever a row's RoPE blocks fall into it.
  static constexpr int kPlainPerRow = kBlocksPerRow - kResBlocksPerRow;
  static constexpr bool kLutDecode = D == nvfp4::DecodeRoute::Lut && Scale::kUnitQ;

  // Row and block-in-row of the i-th plain block (the 2FP4 run is contiguous inside the row).
  static KVGEN_CODEC_HD int2 plain_block(int i) {
    const int row = i / kPlainPerRow;
    const int k = i % kPlainPerRow;
    return make_int2(row, k < kResFirst ? k : k + kResBlocksPerRow);
  }

  static KVGEN_CODEC_HD const uint8_t* hot_block(const uint8_t* page, int row, int blk) {
    return page + row * kRowBytes + (B::kPrefix + blk * 16) * Hot::kBytes;
  }

  // Rounding::PackedF16 quantizes FP8 hot words on packed fp16 lanes (software path, compiled
  // Q == 1). A per-layer buffer (Q known at run time only) or another Q takes the general route,
  // which for PackedF16 is the FusedFma one (nvfp4::encode_block_path).
  // Rounding::PackedBF16 does the same for FP8 and, with the codes on fp16 pairs, for BF16 hot words.
  static constexpr bool kPackedRoute = nvfp4::kPath == nvfp4::Path::Software && Scale::kUnitQ;
  static constexpr bool kPackedF16 = (R == nvfp4::Rounding::PackedF16 || R == nvfp4::Rounding::PackedBF16) &&
                                     Hot::kBytes == 1 && kPackedRoute;
  static constexpr bool kPackedBF16 = R == nvfp4::Rounding::PackedBF16 && Hot::kBF16 && kPackedRoute;

  static KVGEN_CODEC_HD nvfp4::Block quantize_plain(const HotBlock<Hot>& hot, LayerScale gq) {
    if constexpr (kPackedF16) {
      return nvfp4::encode_block_e4m3x16(hot.w, gq.G);
    } else if constexpr (kPackedBF16) {
      return nvfp4::encode_block_bf16x16(hot.w, gq.G);
    } else {
      float x[16];
      hot.widen(x);
      return nvfp4::encode_block<R>(x, gq.G, gq.Q);
    }
  }

  // One plain block: hot words (already loaded) -> packed codes and scale in the record.
  static KVGEN_CODEC_HD void encode_plain(uint8_t* rec, int i, const HotBlock<Hot>& hot, LayerScale gq) {
    const int2 at = plain_block(i);
    const int t = at.x * kBlocksPerRow + at.y;
    const nvfp4::Block main = quantize_plain(hot, gq);
    put8<8>(rec + B::kData + t * 8, main);  // region offsets of packed data are multiples of 8
    rec[B::kScales + t] = main.scale;
  }

  // Plain blocks kBatch at a time per lane: every hot load of the batch is issued before the
  // first block is quantized, so a thread keeps kBatch * 16 elements in flight instead of one
  // block's (the loop is otherwise latency-bound between a block's load and its arithmetic).
  // scales: the layer's row of the scale table (null with Scales::Spec).
  static KVGEN_CODEC_HD void encode(uint8_t* rec, const uint8_t* __restrict__ page, const LayerScale* scales,
                                    Lanes lanes) {
    const LayerScale gq = Scale::of(scales);
    constexpr int kPlain = B::kRows * kPlainPerRow;
    for (int i0 = lanes.first; i0 < kPlain; i0 += lanes.step * kBatch) {
      HotBlock<Hot> hot[kBatch];
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
        const int i = i0 + j * lanes.step;
        if (j == 0 || i < kPlain) {  // block 0 of a batch is in range by the loop condition
          const int2 at = plain_block(i);
          hot[j].load(hot_block(page, at.x, at.y));
        }
      }
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
        const int i = i0 + j * lanes.step;
        if (j == 0 || i < kPlain) encode_plain(rec, i, hot[j], gq);
      }
    }
    if constexpr (kResBlocksPerRow > 0) {
      for (int r = lanes.first; r < B::kRows * kResBlocksPerRow; r += lanes.step) {
        const int row = r / kResBlocksPerRow;
        const int blk = kResFirst + r % kResBlocksPerRow;
        const int t = row * kBlocksPerRow + blk;
        float x[16];
        HotBlock<Hot> hot;
        hot.load(hot_block(page, row, blk));
        hot.widen(x);
        const nvfp4::Block2FP4 both = nvfp4::encode_block_2fp4<R>(x, gq.G, gq.Q);
        put8<8>(rec + B::kData + t * 8, both.main);
        rec[B::kScales + t] = both.main.scale;
        put8<align_of(B::kResidual)>(rec + B::kResidual + r * 8, both.residual);
        rec[B::kResidualScales + r] = both.residual.scale;
      }
    }
    if constexpr (kLosslessRowBytes > 0) save_lossless(rec, page, lanes);
  }

  // kSplit 2: a lane decodes half a plain block (one packed word, 8 elements = 16 hot bytes),
  // so consecutive threads store consecutive 16-byte pieces and one warp store covers 512
  // contiguous bytes; with whole blocks each of a thread's two stores half-fills 32 sectors.
  // Only the Lut route has half blocks, so a per-layer buffer (float route) decodes whole blocks.
  static constexpr bool kHalfBlocks = kSplit == 2 && kLutDecode && Hot::kBytes == 2;

  static KVGEN_CODEC_HD void decode_half_blocks(const uint8_t* rec, uint8_t* __restrict__ page, Lanes lanes) {
    for (int h = lanes.first; h < 2 * B::kRows * kPlainPerRow; h += lanes.step) {
      const int2 at = plain_block(h >> 1);
      const int t = at.x * kBlocksPerRow + at.y;
      const int half = h & 1;
      uint32_t w[4];
      Hot::decode_word_lut(*reinterpret_cast<const uint32_t*>(rec + B::kData + t * 8 + 4 * half),
                           rec[B::kScales + t], w);
      *reinterpret_cast<uint4*>(const_cast<uint8_t*>(hot_block(page, at.x, at.y)) + 16 * half) =
          make_uint4(w[0], w[1], w[2], w[3]);
    }
  }

  static KVGEN_CODEC_HD void decode_plain(const uint8_t* rec, uint8_t* __restrict__ page, LayerScale gq,
                                          Lanes lanes) {
    if constexpr (kHalfBlocks) {
      decode_half_blocks(rec, page, lanes);
      return;
    }
    for (int i = lanes.first; i < B::kRows * kPlainPerRow; i += lanes.step) {
      const int2 at = plain_block(i);
      const int t = at.x * kBlocksPerRow + at.y;
      const nvfp4::Block blk = get8<8>(rec + B::kData + t * 8, rec[B::kScales + t]);
      HotBlock<Hot> hot;
      if constexpr (kLutDecode) {
        hot.decode_lut(blk);
      } else {
        float y[16];
        nvfp4::decode_block(blk, gq.Q, y);
        hot.narrow(y);
      }
      hot.store(const_cast<uint8_t*>(hot_block(page, at.x, at.y)));
    }
  }

  // scales: the layer's row of the scale table (null with Scales::Spec).
  static KVGEN_CODEC_HD void decode(const uint8_t* rec, uint8_t* __restrict__ page, const LayerScale* scales,
                                    Lanes lanes) {
    const LayerScale gq = Scale::of(scales);
    decode_plain(rec, page, gq, lanes);
    if constexpr (kResBlocksPerRow > 0) {
      for (int r = lanes.first; r < B::kRows * kResBlocksPerRow; r += lanes.step) {
        const int row = r / kResBlocksPerRow;
        const int blk = kResFirst + r % kResBlocksPerRow;
        const int t = row * kBlocksPerRow + blk;
        nvfp4::Block2FP4 both;
        both.main = get8<8>(rec + B::kData + t * 8, rec[B::kScales + t]);
        both.residual = get8<align_of(B::kResidual)>(rec + B::kResidual + r * 8, rec[B::kResidualScales + r]);
        float y[16];
        nvfp4::decode_block_2fp4(both, gq.Q, y);
        HotBlock<Hot> hot;
        hot.narrow(y);
        hot.store(const_cast<uint8_t*>(hot_block(page, row, blk)));
      }
    }
    if constexpr (kLosslessRowBytes > 0) restore_lossless(rec, page, lanes);
  }

  // Lossless bytes of every row: prefix then suffix, in kLosslessAlign-byte words.  Rows and
  // spans are multiples of 16 elements, so only the record offset limits the word size.
  using LosslessWord = typename Word<kLosslessAlign>::T;
  static constexpr int kLosslessWordsPerRow = kLosslessRowBytes / kLosslessAlign;

  // Byte offsets (in the record's lossless region, in the hot page) of lossless word i.
  static KVGEN_CODEC_HD int2 lossless_word(int i) {
    const int row = i / kLosslessWordsPerRow;
    const int byte = (i % kLosslessWordsPerRow) * kLosslessAlign;
    const int hot_byte = byte < kPrefixBytes ? byte : kSuffixStart + (byte - kPrefixBytes);
    return make_int2(row * kLosslessRowBytes + byte, row * kRowBytes + hot_byte);
  }

  static KVGEN_CODEC_HD void save_lossless(uint8_t* rec, const uint8_t* __restrict__ page, Lanes lanes) {
    for (int i = lanes.first; i < B::kRows * kLosslessWordsPerRow; i += lanes.step) {
      const int2 at = lossless_word(i);
      *reinterpret_cast<LosslessWord*>(rec + B::kLossless + at.x) =
          *reinterpret_cast<const LosslessWord*>(page + at.y);
    }
  }

  static KVGEN_CODEC_HD void restore_lossless(const uint8_t* rec, uint8_t* __restrict__ page, Lanes lanes) {
    for (int i = lanes.first; i < B::kRows * kLosslessWordsPerRow; i += lanes.step) {
      const int2 at = lossless_word(i);
      *reinterpret_cast<LosslessWord*>(page + at.y) =
          *reinterpret_cast<const LosslessWord*>(rec + B::kLossless + at.x);
    }
  }
};

// A side buffer: S provides kIndex, kBytes (per page), kOffset (in the record).
template <class S>
struct Side {
  static constexpr int kIndex = S::kIndex;
  static constexpr bool kLayerScales = false;
  static constexpr int kPageBytes = S::kBytes;
  static constexpr int kAlign = min_align(align_of(S::kOffset), align_of(S::kBytes));

  static KVGEN_CODEC_HD void encode(uint8_t* rec, const uint8_t* __restrict__ page, const LayerScale*, Lanes lanes) {
    cta_copy<S::kBytes, kAlign>(rec + S::kOffset, page, lanes);
  }
  static KVGEN_CODEC_HD void decode(const uint8_t* rec, uint8_t* __restrict__ page, const LayerScale*, Lanes lanes) {
    cta_copy<S::kBytes, kAlign>(page, rec + S::kOffset, lanes);
  }
};

// One layer record: its parts in record order, its size and where the zero padding starts.
template <int kRecordBytes_, int kUnpadded_, class... Parts>
struct Layer {
  static constexpr int kRecordBytes = kRecordBytes_;
  static constexpr int kUnpadded = kUnpadded_;
  static constexpr int kNumParts = sizeof...(Parts);
  // Whether some buffer takes per-layer scales: the codec then keeps a scale table per lifecycle,
  // one row of kNumParts LayerScale per layer (entries of other parts unused).
  static constexpr int kLayerScaleParts = (0 + ... + int(Parts::kLayerScales));
  static constexpr bool kLayerScales = kLayerScaleParts > 0;
  static constexpr bool kPartLayerScales[kNumParts] = {Parts::kLayerScales...};
  static constexpr int kPageBytes[kNumParts] = {Parts::kPageBytes...};  // one hot page of each part
  static_assert(kRecordBytes % 16 == 0, "records are padded to 16 bytes");

  // scales: the layer's row of the scale table (null without per-layer scales).
  static KVGEN_CODEC_HD void encode(uint8_t* rec, const PoolDesc* pools, int64_t page, const LayerScale* scales,
                                    Lanes lanes) {
    (Parts::encode(rec, pools[Parts::kIndex].base + page * pools[Parts::kIndex].page_stride, scales, lanes), ...);
    for (int i = kUnpadded + lanes.first; i < kRecordBytes; i += lanes.step) rec[i] = 0;
  }
  static KVGEN_CODEC_HD void decode(const uint8_t* rec, const PoolDesc* pools, int64_t page, const LayerScale* scales,
                                    Lanes lanes) {
    (Parts::decode(rec, pools[Parts::kIndex].base + page * pools[Parts::kIndex].page_stride, scales, lanes), ...);
  }
};

// ---------------------------------------------------------------------------------------------
// Kernels: grid (pairs, layers of the lifecycle), decode's pairs DecodePages to a CTA; blockIdx.y
// picks the layer's descriptors.
// ---------------------------------------------------------------------------------------------

// The whole record between the cold slot and shared memory, in 16-byte words, each thread
// issuing kInFlight loads before its stores: over PCIe (mapped pinned slots) a load takes
// microseconds, so several outstanding loads per thread are what keeps the bus busy (a tunable:
// more in flight hides more latency but holds more registers).
template <int kBytes, int kThreads, int kInFlight>
__device__ __forceinline__ void copy_record(uint8_t* __restrict__ dst, const uint8_t* __restrict__ src) {
  constexpr int kWords = kBytes / 16;
  const uint4* in = reinterpret_cast<const uint4*>(src);
  uint4* out = reinterpret_cast<uint4*>(dst);
  for (int base = threadIdx.x; base < kWords; base += kThreads * kInFlight) {
    uint4 v[kInFlight];
#pragma unroll
    for (int k = 0; k < kInFlight; ++k) {
      if (base + k * kThreads < kWords) v[k] = in[base + k * kThreads];
    }
#pragma unroll
    for (int k = 0; k < kInFlight; ++k) {
      if (base + k * kThreads < kWords) out[base + k * kThreads] = v[k];
    }
  }
}

// How decode brings a record from its cold slot into shared memory (the tunable decode_load; the
// same bytes land).  The register copy costs one memory round trip per kThreads * kInFlight words
// (a qwen3-8b record, 2304 words, takes three at 256 x 4), and a CTA decodes nothing until the last
// one returns; the asynchronous copies put the whole record in flight at once and hold no registers:
//   Registers  copy_record: kInFlight 16-byte loads per thread, then their shared-memory stores;
//   Async      cp.async (LDGSTS): every 16-byte word of a thread issued at once, one wait;
//   Bulk       one cp.async.bulk of the whole record by one thread, the CTA waiting on an mbarrier
//              (the copy engine of the SM does the addressing: no per-word instructions at all),
//              for a cold slot in device memory; a slot in mapped host memory takes Async instead:
//              the bulk copy engine reads host memory at half the bus (H200: zero-copy decode at 0.47
//              of pinned bandwidth against 0.92, results/2026-12-07-h200-s11/call1), so the launcher
//              says where the slot is (cold_on_device).
// kvgen builds only for sm_90 and later, where these copies and EncodeStore's exist; device code
// compiled for an older architecture (the host test programs' device pass) takes the register copy.
enum class RecordLoad : int { Registers = 0, Async = 1, Bulk = 2 };

template <class L>
struct DecodeLoad {
  static constexpr RecordLoad kRoute = RecordLoad::Registers;
};

// Consecutive page pairs one decode CTA takes (the tunable decode_pages; the same bytes land).  With
// one, the CTA's warps wait for its record and nothing of a next page is in flight while it decodes
// (Nsight, H100: ~40 % of decode's warp cycles stalled waiting for the record); with more, the CTA
// keeps two record buffers (twice the shared memory) and issues the next page's record before it
// decodes the current one (decode_pages).  The register copy has nothing in flight to overlap, so
// plans build it with 1 (fold_codec_params).
template <class L>
struct DecodePages {
  static constexpr int kPages = 1;
};

template <class L>
constexpr int decode_smem_bytes() {
  return (DecodePages<L>::kPages > 1 ? 2 : 1) * L::kRecordBytes;
}

// How encode sends the finished record from shared memory to its cold slot (the tunable
// encode_store; the same bytes land): through registers (copy_record), or one cp.async.bulk store
// issued by thread 0, which alone waits for shared memory to be read while the other warps retire.
template <class L>
struct EncodeStore {
  static constexpr bool kBulk = false;
};

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define KVGEN_CODEC_ASYNC_COPIES 1
#else
#define KVGEN_CODEC_ASYNC_COPIES 0
#endif

#if KVGEN_CODEC_ASYNC_COPIES
// RecordLoad::Async.  .cg: the record is read once, so it bypasses L1.
template <int kBytes, int kThreads>
__device__ __forceinline__ void issue_record_async(uint8_t* __restrict__ dst, const uint8_t* __restrict__ src) {
  const uint32_t base = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
  for (int i = threadIdx.x; i < kBytes / 16; i += kThreads) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(base + 16 * i), "l"(src + 16 * i) : "memory");
  }
}

template <int kBytes, int kThreads>
__device__ __forceinline__ void load_record_async(uint8_t* __restrict__ dst, const uint8_t* __restrict__ src) {
  issue_record_async<kBytes, kThreads>(dst, src);
  asm volatile("cp.async.wait_all;" ::: "memory");
}

// RecordLoad::Bulk.  The barrier's initialization must be visible to the copy (the async proxy)
// and to every waiting thread before thread 0 arms it; one mbarrier phase counts fewer than 2^20
// bytes, so a larger record (none fits a GPU's shared memory) takes Async (load_record).
constexpr int kMaxBulkRecordBytes = 1 << 20;

template <int kBytes>
__device__ __forceinline__ void load_record_bulk(uint8_t* __restrict__ dst, const uint8_t* __restrict__ src) {
  static_assert(kBytes % 16 == 0 && kBytes < kMaxBulkRecordBytes, "one bulk copy, within one mbarrier phase");
  __shared__ alignas(8) uint64_t arrived;
  const uint32_t bar = static_cast<uint32_t>(__cvta_generic_to_shared(&arrived));
  if (threadIdx.x == 0) {
    asm volatile(
        "mbarrier.init.shared::cta.b64 [%0], 1;\n\t"
        "fence.mbarrier_init.release.cluster;\n\t"
        "fence.proxy.async.shared::cta;" ::"r"(bar)
        : "memory");
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    asm volatile(
        "mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n\t"
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%2], [%3], %1, [%0];"
        ::"r"(bar), "r"(kBytes), "r"(static_cast<uint32_t>(__cvta_generic_to_shared(dst))), "l"(src)
        : "memory");
  }
  asm volatile(
      "{\n\t.reg .pred done;\n\t"
      "wait:\n\tmbarrier.try_wait.parity.shared::cta.b64 done, [%0], 0;\n\t"
      "@!done bra wait;\n\t}" ::"r"(bar)
      : "memory");
}

// EncodeStore::kBulk.  The wait is for the reads of shared memory only, which must end before the
// CTA's memory is reused: the global writes complete before the kernel does.
template <int kBytes>
__device__ __forceinline__ void store_record_bulk(uint8_t* __restrict__ dst, const uint8_t* __restrict__ src) {
  static_assert(kBytes % 16 == 0, "bulk copies move multiples of 16 bytes");
  if (threadIdx.x == 0) {
    asm volatile(
        "cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;\n\t"
        "cp.async.bulk.commit_group;\n\t"
        "cp.async.bulk.wait_group.read 0;" ::"l"(dst), "r"(static_cast<uint32_t>(__cvta_generic_to_shared(src))),
        "r"(kBytes)
        : "memory");
  }
}
#endif

template <class L, int kThreads, int kInFlight>
__device__ __forceinline__ void load_record(uint8_t* __restrict__ rec, const uint8_t* __restrict__ slot,
                                            bool cold_on_device) {
#if KVGEN_CODEC_ASYNC_COPIES
  // A record past one mbarrier phase's transaction count (no GPU's shared memory holds one) takes Async.
  if constexpr (DecodeLoad<L>::kRoute == RecordLoad::Bulk && L::kRecordBytes < kMaxBulkRecordBytes) {
    if (cold_on_device) {  // uniform over the launch
      load_record_bulk<L::kRecordBytes>(rec, slot);
      return;
    }
  }
  if constexpr (DecodeLoad<L>::kRoute != RecordLoad::Registers) {
    load_record_async<L::kRecordBytes, kThreads>(rec, slot);
    return;
  }
#endif
  copy_record<L::kRecordBytes, kThreads, kInFlight>(rec, slot);
}

template <class L, int kThreads, int kInFlight>
__device__ __forceinline__ void store_record(uint8_t* __restrict__ slot, const uint8_t* __restrict__ rec) {
#if KVGEN_CODEC_ASYNC_COPIES
  if constexpr (EncodeStore<L>::kBulk) {
    store_record_bulk<L::kRecordBytes>(slot, rec);
    return;
  }
#endif
  copy_record<L::kRecordBytes, kThreads, kInFlight>(slot, rec);
}

// The barrier between building the record and storing it.  For the bulk store, every thread's
// shared-memory writes (generic proxy) are first made visible to the bulk copy (async proxy).
template <class L>
__device__ __forceinline__ void record_built() {
#if KVGEN_CODEC_ASYNC_COPIES
  if constexpr (EncodeStore<L>::kBulk) asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
#endif
  __syncthreads();
}

// Minimum resident CTAs per SM the kernels of layer type L ask ptxas for (the second
// __launch_bounds__ argument): it caps registers at about 64K / (threads * kMinBlocks), trading
// registers (and possibly spills) for occupancy.  A tunable: a generated file specializes this for
// its Layer; 0 compiles like __launch_bounds__(threads) alone (1 does not: ptxas then allocates
// registers differently, e.g. 54 instead of 40 for qwen3-8b encode).
// kDecodeMinBlocks: the decode kernel's own minimum (-1: kMinBlocks); decode needs fewer registers
// than encode, so a cap that would make encode spill can still raise decode's occupancy.
template <class L>
struct LaunchBounds {
  static constexpr int kMinBlocks = 0;
  static constexpr int kDecodeMinBlocks = -1;
};

template <class L>
constexpr int decode_min_blocks() {
  return LaunchBounds<L>::kDecodeMinBlocks < 0 ? LaunchBounds<L>::kMinBlocks : LaunchBounds<L>::kDecodeMinBlocks;
}

// The row of the CTA's layer in the lifecycle's scale table, which follows the lifecycle's
// descriptor table (gridDim.y layers x kNumParts descriptors) in the same allocation; null for a
// family without per-layer scales.
template <class L>
__device__ __forceinline__ const LayerScale* layer_scales(const PoolDesc* table) {
  if constexpr (L::kLayerScales) {
    return reinterpret_cast<const LayerScale*>(table + gridDim.y * L::kNumParts) + blockIdx.y * L::kNumParts;
  } else {
    return nullptr;
  }
}

template <bool kDevicePairs>
__device__ __forceinline__ PagePair pair_at(const PairBatch& batch, const PagePair* pairs, int64_t i) {
  if constexpr (kDevicePairs) return pairs[i];
  else return batch.pairs[i];
}

// ---------------------------------------------------------------------------------------------
// DecodePages > 1: a CTA's records through two shared-memory buffers.  A record loader issues page
// j's record into its buffer (src null: a skipped pair, nothing to load) and waits for it; every
// thread calls both for every page in the same order, so the loader's bookkeeping (cp.async groups,
// mbarrier phases) agrees across the CTA whichever pairs are skipped.
// ---------------------------------------------------------------------------------------------

// RecordLoad::Registers, and device passes older than sm_90: the record has landed when issue
// returns, so nothing overlaps.
template <int kBytes, int kThreads, int kInFlight>
struct SyncRecords {
  __device__ __forceinline__ void issue(int, uint8_t* __restrict__ dst, const uint8_t* __restrict__ src) const {
    if (src != nullptr) copy_record<kBytes, kThreads, kInFlight>(dst, src);
  }
  __device__ __forceinline__ void wait(int, bool) const {}
};

#if KVGEN_CODEC_ASYNC_COPIES
// RecordLoad::Async: one commit group per page, committed by every thread even with no copy of its
// own (a skipped pair, a record of fewer words than threads), so on every thread page j's group is
// the older of the two in flight, or the only one on the last page.
template <int kBytes, int kThreads>
struct AsyncRecords {
  __device__ __forceinline__ void issue(int, uint8_t* __restrict__ dst, const uint8_t* __restrict__ src) const {
    if (src != nullptr) issue_record_async<kBytes, kThreads>(dst, src);
    asm volatile("cp.async.commit_group;" ::: "memory");
  }
  __device__ __forceinline__ void wait(int, bool last) const {
    if (last) {
      asm volatile("cp.async.wait_group 0;" ::: "memory");
    } else {
      asm volatile("cp.async.wait_group 1;" ::: "memory");
    }
  }
};

// RecordLoad::Bulk: one mbarrier per buffer.  Thread 0 arms the buffer's barrier with the record's
// bytes and issues the copy, or for a skipped pair only arrives, so every use of a buffer completes
// one phase and page j, the (j >> 1)-th use of buffer j & 1, waits on parity (j >> 1) & 1.
template <int kBytes>
struct BulkRecords {
  uint32_t bars;  // shared address of buffer 0's barrier; buffer 1's follows

  __device__ __forceinline__ uint32_t bar(int page) const { return bars + 8 * (page & 1); }
  __device__ __forceinline__ void issue(int page, uint8_t* __restrict__ dst, const uint8_t* __restrict__ src) const {
    if (threadIdx.x != 0) return;
    if (src != nullptr) {
      asm volatile(
          "mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n\t"
          "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%2], [%3], %1, [%0];"
          ::"r"(bar(page)), "r"(kBytes), "r"(static_cast<uint32_t>(__cvta_generic_to_shared(dst))), "l"(src)
          : "memory");
    } else {
      asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar(page)) : "memory");
    }
  }
  __device__ __forceinline__ void wait(int page, bool) const {
    asm volatile(
        "{\n\t.reg .pred done;\n\t"
        "wait:\n\tmbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n\t"
        "@!done bra wait;\n\t}" ::"r"(bar(page)), "r"((page >> 1) & 1)
        : "memory");
  }
};

// The barriers' initialization must be visible to the copies (the async proxy) and to every
// waiting thread before thread 0 arms one (load_record_bulk's rule).
template <int kBytes>
__device__ __forceinline__ BulkRecords<kBytes> bulk_records() {
  static_assert(kBytes % 16 == 0 && kBytes < kMaxBulkRecordBytes, "one bulk copy, within one mbarrier phase");
  __shared__ alignas(8) uint64_t arrived[2];
  const uint32_t bars = static_cast<uint32_t>(__cvta_generic_to_shared(arrived));
  if (threadIdx.x == 0) {
    asm volatile(
        "mbarrier.init.shared::cta.b64 [%0], 1;\n\t"
        "mbarrier.init.shared::cta.b64 [%1], 1;\n\t"
        "fence.mbarrier_init.release.cluster;\n\t"
        "fence.proxy.async.shared::cta;" ::"r"(bars), "r"(bars + 8)
        : "memory");
  }
  __syncthreads();
  return BulkRecords<kBytes>{bars};
}
#endif

// The CTA's layer record in a decode pair's cold slot; null for a pair out of range (recorded once,
// by the CTA of the first layer, as with one page per CTA).
template <class L>
__device__ __forceinline__ const uint8_t* decode_slot(const PagePair& pair, const uint8_t* cold,
                                                      int64_t cold_page_bytes, const PairLimits& limits) {
  if (!pair_in_range<false>(pair, limits, threadIdx.x == 0 && blockIdx.y == 0)) return nullptr;
  return cold + pair.src * cold_page_bytes + (int64_t)blockIdx.y * L::kRecordBytes;
}

// The CTA's pairs first .. first + count - 1 of the launch's n: page j + 1's record is issued
// before page j is waited for and decoded, so one record is in flight while the other decodes.
template <class L, bool kDevicePairs, class Records>
__device__ __forceinline__ void decode_pages(const Records& records, uint8_t* smem, const PoolDesc* pools,
                                             const uint8_t* cold, int64_t cold_page_bytes, const PairBatch& batch,
                                             const PagePair* pairs, const PairLimits& limits, int64_t n) {
  constexpr int kPages = DecodePages<L>::kPages;
  const int64_t first = (int64_t)blockIdx.x * kPages;
  const int count = n - first < kPages ? (int)(n - first) : kPages;
  PagePair pair = pair_at<kDevicePairs>(batch, pairs, first);
  const uint8_t* slot = decode_slot<L>(pair, cold, cold_page_bytes, limits);
  records.issue(0, smem, slot);
  for (int j = 0; j < count; ++j) {
    PagePair next{};
    const uint8_t* next_slot = nullptr;
    if (j + 1 < count) {
      next = pair_at<kDevicePairs>(batch, pairs, first + j + 1);
      next_slot = decode_slot<L>(next, cold, cold_page_bytes, limits);
      records.issue(j + 1, smem + ((j + 1) & 1) * L::kRecordBytes, next_slot);
    }
    records.wait(j, j + 1 == count);
    __syncthreads();
    if (slot != nullptr) {
      L::decode(smem + (j & 1) * L::kRecordBytes, pools + blockIdx.y * L::kNumParts, pair.dst,
                layer_scales<L>(pools), cta_lanes());
    }
    __syncthreads();  // page j + 2's record lands in this buffer
    pair = next;
    slot = next_slot;
  }
}

// The record loader of DecodeLoad's route, as load_record picks it.
template <class L, int kThreads, int kInFlight, bool kDevicePairs>
__device__ __forceinline__ void decode_paged(uint8_t* smem, const PoolDesc* pools, const uint8_t* cold,
                                             int64_t cold_page_bytes, const PairBatch& batch,
                                             const PagePair* pairs, const PairLimits& limits,
                                             bool cold_on_device, int64_t n) {
#if KVGEN_CODEC_ASYNC_COPIES
  if constexpr (DecodeLoad<L>::kRoute == RecordLoad::Bulk && L::kRecordBytes < kMaxBulkRecordBytes) {
    if (cold_on_device) {  // uniform over the launch
      decode_pages<L, kDevicePairs>(bulk_records<L::kRecordBytes>(), smem, pools, cold, cold_page_bytes, batch,
                                    pairs, limits, n);
      return;
    }
  }
  if constexpr (DecodeLoad<L>::kRoute != RecordLoad::Registers) {
    decode_pages<L, kDevicePairs>(AsyncRecords<L::kRecordBytes, kThreads>{}, smem, pools, cold, cold_page_bytes,
                                  batch, pairs, limits, n);
    return;
  }
#endif
  decode_pages<L, kDevicePairs>(SyncRecords<L::kRecordBytes, kThreads, kInFlight>{}, smem, pools, cold,
                                cold_page_bytes, batch, pairs, limits, n);
}

template <class L, int kThreads, int kInFlight, bool kDevicePairs>
__global__ void __launch_bounds__(kThreads, LaunchBounds<L>::kMinBlocks)
encode_kernel(const PoolDesc* __restrict__ pools, uint8_t* cold, int64_t cold_page_bytes, PairBatch batch,
              const PagePair* __restrict__ pairs, PairLimits limits) {
  extern __shared__ uint4 smem[];
  uint8_t* rec = reinterpret_cast<uint8_t*>(smem);
  const PagePair pair = pair_at<kDevicePairs>(batch, pairs, blockIdx.x);
  if (!pair_in_range<true>(pair, limits, threadIdx.x == 0 && blockIdx.y == 0)) return;
  L::encode(rec, pools + blockIdx.y * L::kNumParts, pair.src, layer_scales<L>(pools), cta_lanes());
  record_built<L>();
  uint8_t* slot = cold + pair.dst * cold_page_bytes + (int64_t)blockIdx.y * L::kRecordBytes;
  store_record<L, kThreads, kInFlight>(slot, rec);
}

// n: the launch's pairs (read with DecodePages > 1 only: its last CTA may take fewer pages).
template <class L, int kThreads, int kInFlight, bool kDevicePairs>
__global__ void __launch_bounds__(kThreads, decode_min_blocks<L>())
decode_kernel(const PoolDesc* __restrict__ pools, const uint8_t* cold, int64_t cold_page_bytes, PairBatch batch,
              const PagePair* __restrict__ pairs, PairLimits limits, bool cold_on_device, int64_t n) {
  extern __shared__ uint4 smem[];
  uint8_t* rec = reinterpret_cast<uint8_t*>(smem);
  if constexpr (DecodePages<L>::kPages > 1) {
    decode_paged<L, kThreads, kInFlight, kDevicePairs>(rec, pools, cold, cold_page_bytes, batch, pairs, limits,
                                                       cold_on_device, n);
  } else {
    const PagePair pair = pair_at<kDevicePairs>(batch, pairs, blockIdx.x);
    if (!pair_in_range<false>(pair, limits, threadIdx.x == 0 && blockIdx.y == 0)) return;
    const uint8_t* slot = cold + pair.src * cold_page_bytes + (int64_t)blockIdx.y * L::kRecordBytes;
    load_record<L, kThreads, kInFlight>(rec, slot, cold_on_device);
    __syncthreads();
    L::decode(rec, pools + blockIdx.y * L::kNumParts, pair.dst, layer_scales<L>(pools), cta_lanes());
  }
}

}  // namespace codec
}  // namespace kvgen

#undef KVGEN_CODEC_ASYNC_COPIES
#undef KVGEN_CODEC_HD
