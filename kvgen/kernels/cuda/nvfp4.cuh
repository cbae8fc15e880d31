// kvgen/kernels/cuda/nvfp4.cuh -- NVFP4 block arithmetic for kvgen's generated CUDA kernels.
//
// The contract is COLD_PAGE_FORMAT.md section 3, and the executable reference is
// kvgen/reference/nvfp4.py: every function here must give the oracle's bits, on the host and on
// every GPU (tests/test_nvfp4_block.py compiles tests/csrc/nvfp4_host_check.cu with this header
// and compares bit for bit).
//
// Two implementations, chosen at compile time, must write identical bytes:
//
//   * software path (KVGEN_NVFP4_HW_PATH == 0): integer / compare arithmetic only; exact on any
//     target, used on the host, on sm_90a and on plain sm_100 (no arch suffix).
//   * hardware path (KVGEN_NVFP4_HW_PATH == 1): device code for an architecture- or
//     family-specific Blackwell-generation target (sm_100a/f, sm_103a/f, sm_107a/f, sm_110a/f,
//     sm_120a/f, sm_121a/f): one `cvt.rn.satfinite.e2m1x2.f32` per two codes and one
//     `cvt.rn.satfinite.e4m3x2.f32` for the scale.  The operands are sanitised first so that
//     the cvt only ever sees finite values it rounds exactly like the contract (no NaN, no Inf,
//     nothing that would round to -0); see e2m1_cvt_operand() and e4m3_cvt_operand().
//     Decoding and the final rounding to bf16/fp16/fp8 make no decision that differs between
//     targets, so both paths share that code (cuda_bf16/fp16/fp8.h conversions).  The same
//     hardware-path code runs on the host with the instruction replaced by NVIDIA's own host
//     model of it (cuda_fp4.h / cuda_fp8.h), which is how the tests check it without a GPU.
//
// Rules honoured everywhere:
//   * every float operation rounds to binary32 on its own, with subnormals kept, whatever the
//     compiler flags: device code writes the PTX `mul.rn.f32` / `add.rn.f32` / `sub.rn.f32` /
//     `div.rn.f32` itself.  (The __fmul_rn-style intrinsics are never contracted into an FMA,
//     but nvcc 13 *does* give them `.ftz` under -ftz=true or --use_fast_math; inline PTX is
//     immune to -fmad, -ftz, -prec-div and --use_fast_math.)  Host code stores each result
//     through a volatile so no host compiler can fuse it or keep extra precision.  (Do not build
//     host code that calls this with -ffast-math: gcc then sets FTZ/DAZ for the whole process.)
//   * the remaining logic is integer work on bit patterns, or compares against thresholds
//     >= 0.25 (a flushed subnormal compares the same), so it cannot be changed by FTZ either.
//   * the reciprocal is the correctly rounded division div.rn.f32 of 1 by x, never rcp.approx.
//
// Usage: include in a .cu file compiled by nvcc (device or host code).  Everything lives in
// namespace kvgen::nvfp4.  Define KVGEN_NVFP4_FORCE_SOFTWARE before including to force the
// software path (for A/B testing on a Blackwell GPU).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp4.h>
#include <cuda_fp8.h>
#include <stdint.h>
#if !defined(__CUDA_ARCH__)
#include <string.h>
#endif

// ---------------------------------------------------------------------------------------------
// Path selection
// ---------------------------------------------------------------------------------------------
// nvcc 13 defines, in the device pass only:
//   __CUDA_ARCH__                 e.g. 1000 for every sm_100 flavour;
//   __CUDA_ARCH_SPECIFIC__        only for "a" targets (sm_100a -> 1000, also sm_90a -> 900);
//   __CUDA_ARCH_FAMILY_SPECIFIC__ for "a" and "f" targets (sm_100a and sm_100f -> 1000,
//                                 sm_103a/f -> 1030, sm_110 -> 1100, sm_120 -> 1200, ...; also
//                                 sm_90a -> 900).
//   __CUDA_ARCH_FEAT_SM100_ALL    only for sm_100a (one macro per "a" target), so it is useless
//                                 for the "f" targets and we do not use it.
// `cvt ... .e2m1x2` exists only on family/arch-specific targets of compute capability >= 10.0
// (ptxas refuses it for plain sm_100 and for sm_90a), which is exactly "family-specific macro
// >= 1000".  The upper bound 1300 is the one NVIDIA's own cuda_fp8.h uses for the same
// instruction: an unknown future family falls back to the exact software path.
#if defined(KVGEN_NVFP4_FORCE_SOFTWARE)
#define KVGEN_NVFP4_HW_PATH 0
#elif defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FAMILY_SPECIFIC__) && \
    (__CUDA_ARCH_FAMILY_SPECIFIC__ >= 1000) && (__CUDA_ARCH_FAMILY_SPECIFIC__ < 1300)
#define KVGEN_NVFP4_HW_PATH 1
#else
#define KVGEN_NVFP4_HW_PATH 0
#endif

// Local to this header (undefined at its end) so it cannot clash with other kvgen headers.
#define KVGEN_NVFP4_HD __host__ __device__ __forceinline__

namespace kvgen {
namespace nvfp4 {

enum class Path { Software = 0, Hardware = 1 };
// The path this compilation pass uses (the host pass is always Software).
constexpr Path kPath = KVGEN_NVFP4_HW_PATH ? Path::Hardware : Path::Software;

// fl32(1/6) = 0x3E2AAAAB.
constexpr float kSixth = 0x1.555556p-3f;
constexpr float kE4M3Max = 448.0f;
constexpr uint8_t kE4M3NaN = 0x7F;
// Canonical NaNs of the final rounding (what NVIDIA's cvt writes; the oracle uses the same).
constexpr uint16_t kBF16NaN = 0x7FFF;
constexpr uint16_t kFP16NaN = 0x7FFF;

// ---------------------------------------------------------------------------------------------
// Bits and single-rounding binary32 operations
// ---------------------------------------------------------------------------------------------

KVGEN_NVFP4_HD uint32_t f32_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  return u;
#endif
}

KVGEN_NVFP4_HD float bits_f32(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
#endif
}

// Bit tests instead of isnan/isfinite: they survive fast-math flags on either compiler.
KVGEN_NVFP4_HD bool is_nan(float f) { return (f32_bits(f) & 0x7FFFFFFFu) > 0x7F800000u; }
KVGEN_NVFP4_HD bool is_finite(float f) { return (f32_bits(f) & 0x7FFFFFFFu) < 0x7F800000u; }
KVGEN_NVFP4_HD float abs_f32(float f) { return bits_f32(f32_bits(f) & 0x7FFFFFFFu); }

// One IEEE binary32 operation, rounded to nearest even, subnormals kept.  Device: the PTX
// instruction itself without .ftz (see the header comment for why not __fmul_rn & co.); the asm
// is not volatile, so the compiler may still CSE or schedule it, but never fuse or flush it.
// Host: the __f*_rn intrinsics are device-only; a volatile store forces the result to be
// rounded to binary32 on its own (no FMA contraction, no excess precision).
KVGEN_NVFP4_HD float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  float r;
  asm("mul.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
#else
  volatile float r = a * b;
  return r;
#endif
}

KVGEN_NVFP4_HD float add_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  float r;
  asm("add.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
#else
  volatile float r = a + b;
  return r;
#endif
}

KVGEN_NVFP4_HD float sub_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  float r;
  asm("sub.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
#else
  volatile float r = a - b;
  return r;
#endif
}

// Fused a * b + c, rounded once (fma.rn.f32; the host's fmaf is the same correctly rounded fma).
// Used only where a * b is exact, so it equals add_rn(mul_rn(a, b), c) in one instruction.
KVGEN_NVFP4_HD float fma_rn(float a, float b, float c) {
#if defined(__CUDA_ARCH__)
  float r;
  asm("fma.rn.f32 %0, %1, %2, %3;" : "=f"(r) : "f"(a), "f"(b), "f"(c));
  return r;
#else
  volatile float r = fmaf(a, b, c);
  return r;
#endif
}

// Correctly rounded IEEE division (what __fdiv_rn is without -ftz=true).
KVGEN_NVFP4_HD float div_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  float r;
  asm("div.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
#else
  volatile float r = a / b;
  return r;
#endif
}

// ---------------------------------------------------------------------------------------------
// E4M3 (OCP E4M3FN: bias 7, max 448, 0x7F/0xFF NaN)
// ---------------------------------------------------------------------------------------------

// Exact value of an E4M3 byte.  Any byte is accepted (decoders must not fault on bytes the
// encoder never writes); 0x7F/0xFF give NaN.
KVGEN_NVFP4_HD float e4m3_to_f32(uint32_t b) {
  const uint32_t sign = (b & 0x80u) << 24;
  const uint32_t exp = (b >> 3) & 0xFu;
  const uint32_t man = b & 7u;
  uint32_t mag;
  if ((b & 0x7Fu) == 0x7Fu) {
    mag = 0x7FFFFFFFu;
  } else if (exp == 0) {
    mag = f32_bits(mul_rn((float)man, 0x1p-9f));  // subnormal: man * 2^-9, exact
  } else {
    mag = ((exp + (127u - 7u)) << 23) | (man << 20);  // rebias the exponent, widen the mantissa
  }
  return bits_f32(sign | mag);
}

// Software rounding of any float to E4M3: nearest, ties to even, saturating at +-448 (also
// +-Inf), NaN -> 0x7F, sign kept (a negative value that rounds to zero gives 0x80).
KVGEN_NVFP4_HD uint32_t e4m3_from_f32_sw(float f) {
  const uint32_t u = f32_bits(f);
  const uint32_t sign = (u >> 24) & 0x80u;
  const uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return kE4M3NaN;
  // >= 448: saturate.  (Values in (448, 464] would round to 448 anyway; above, saturation.)
  if (a >= 0x43E00000u) return sign | 0x7Eu;
  if (a < 0x3C800000u) {
    // Below 2^-6, the E4M3 subnormal range: the code is |f| * 2^9 rounded to an integer 0..8
    // (8 is the smallest normal, 0x08).  |f| * 512 is exact; adding 2^23 rounds it to an integer
    // with the FPU's round-to-nearest-even, and the integer is then the low mantissa bits.
    const float t = add_rn(mul_rn(bits_f32(a), 512.0f), 8388608.0f);
    return sign | (f32_bits(t) - 0x4B000000u);
  }
  // Normal range: keep 3 of the 23 mantissa bits, rounding to nearest even by adding
  // 0x7FFFF + (lowest kept bit); a carry correctly bumps the exponent (at most up to 448).
  const uint32_t r = a + 0x7FFFFu + ((a >> 20) & 1u);
  return sign | ((r >> 20) - ((127u - 7u) << 3));
}

// Operand for the hardware cvt (and NVIDIA's host model of it): the cvt rounds finite values
// exactly like the contract; clamping to +-448 first means we never depend on how it treats Inf.
KVGEN_NVFP4_HD float e4m3_cvt_operand(float f) {
  const uint32_t u = f32_bits(f);
  if ((u & 0x7FFFFFFFu) > 0x43E00000u) return bits_f32((u & 0x80000000u) | 0x43E00000u);
  return f;
}

// Raw `cvt.rn.satfinite.e4m3x2.f32` of one value: the PTX instruction in device code (sm_89+),
// NVIDIA's software model of the same instruction elsewhere (cuda_fp8.h does exactly that).
KVGEN_NVFP4_HD uint32_t e4m3_cvt_raw(float f) {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 890)
  uint16_t r;
  // operand a (upper byte) = 0, operand b (lower byte) = f
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(0.0f), "f"(f));
  return r & 0xFFu;
#else
  return __nv_cvt_float_to_fp8(f, __NV_SATFINITE, __NV_E4M3);
#endif
}

// Hardware-style rounding to E4M3 (same bytes as e4m3_from_f32_sw for every input).
KVGEN_NVFP4_HD uint32_t e4m3_from_f32_hw(float f) {
  if (is_nan(f)) return kE4M3NaN;  // the cvt would give a NaN too, but we pin the byte
  return e4m3_cvt_raw(e4m3_cvt_operand(f));
}

template <Path P>
KVGEN_NVFP4_HD uint32_t e4m3_from_f32_path(float f) {
  return P == Path::Hardware ? e4m3_from_f32_hw(f) : e4m3_from_f32_sw(f);
}

// Round to E4M3 with this pass's path (for the block scale: f >= 0 there).
KVGEN_NVFP4_HD uint32_t e4m3_from_f32(float f) { return e4m3_from_f32_path<kPath>(f); }

// ---------------------------------------------------------------------------------------------
// E2M1 (FP4 codes 0..15; magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6; bit 3 = sign)
// ---------------------------------------------------------------------------------------------

// Exact value of a nibble code (only the low 4 bits are used); code 8 is -0.0.  From code 2 up
// the binary32 patterns step by 0x00400000 (1, 1.5, 2, 3, 4, 6); codes 0 and 1 are 0 and 0.5.
KVGEN_NVFP4_HD float e2m1_to_f32(uint32_t code) {
  const uint32_t c = code & 7u;
  const uint32_t mag = c >= 2u ? 0x3F000000u + c * 0x00400000u : (c == 1u ? 0x3F000000u : 0u);
  return bits_f32(mag | ((code & 8u) << 28));
}

// Software E2M1 rounding, in about a dozen instructions (the encoder's hot loop on sm_90):
//   |p| <  1: the codes 0, 1, 2 are 2|p| rounded to an integer; adding 2^23 lets the FPU round to
//             nearest even (0.25 -> 0, 0.75 -> 2 = 1.0).  fmaxf turns NaN into 0 (code 0x0).
//   |p| >= 1: E2M1 keeps one mantissa bit; rounding the bit pattern to nearest even (add
//             0x1FFFFF plus the kept bit) and reading exponent|bit gives the code directly
//             (1.0 -> 2, 1.5 -> 3, 2 -> 4, 3 -> 5, 4 -> 6, 6 -> 7): code = (bits >> 22) - 252,
//             saturated at 7 (5 -> 4.0 by ties-to-even, everything above 5, Inf included, -> 6.0).
// A NaN fails `a >= 1` and takes the first branch.  The sign only when the magnitude is non-zero:
// the contract has no negative zero.  Every tie lands on the even code, as the contract demands.
KVGEN_NVFP4_HD uint32_t e2m1_magnitude_sw(float p) {
  const float a = abs_f32(p);
  const uint32_t small = f32_bits(add_rn(fmaxf(add_rn(a, a), 0.0f), 8388608.0f)) - 0x4B000000u;
  const uint32_t u = f32_bits(a);
  const uint32_t code = ((u + 0x1FFFFFu + ((u >> 22) & 1u)) >> 22) - 252u;
  const uint32_t big = code < 7u ? code : 7u;
  return a >= 1.0f ? big : small;
}

KVGEN_NVFP4_HD uint32_t e2m1_from_f32_sw(float p) {
  const uint32_t mag = e2m1_magnitude_sw(p);
  const uint32_t neg = (f32_bits(p) >> 31) & (uint32_t)(mag != 0u);
  return mag | (neg << 3);
}

// Operand for the hardware cvt.  `cvt.rn.satfinite.e2m1x2.f32` rounds finite values exactly as
// the contract wants, but (per NVIDIA's model of it in cuda_fp4.hpp) writes 0x7 for NaN and keeps
// the sign of a result that rounds to zero (0x8).  So:
//   |p| <= 0.25 or NaN -> +0   (code 0x0: the contract's NaN rule and "no negative zero");
//   |p| >  6   or Inf  -> +-6  (code 0x7/0xF: saturate ourselves instead of via .satfinite);
//   anything else unchanged (the cvt rounds it to nearest even, like e2m1_from_f32_sw).
// This is the only fix-up the hardware path needs, and it is shared with the host emulation.
KVGEN_NVFP4_HD float e2m1_cvt_operand(float p) {
  const uint32_t u = f32_bits(p);
  const float a = bits_f32(u & 0x7FFFFFFFu);
  if (!(a > 0.25f)) return 0.0f;
  if (a > 6.0f) return bits_f32((u & 0x80000000u) | 0x40C00000u);
  return p;
}

// Raw `cvt.rn.satfinite.e2m1x2.f32` of two values: one byte, `even` in the low nibble.  PTX in
// hardware-path device code; NVIDIA's software model of the instruction elsewhere.
KVGEN_NVFP4_HD uint32_t e2m1x2_cvt_raw(float even, float odd) {
#if defined(__CUDA_ARCH__) && KVGEN_NVFP4_HW_PATH
  uint16_t r;
  // The cvt puts operand a in the upper nibble and operand b in the lower one.
  asm("{\n\t.reg .b8 kvgen_t;\n\t"
      "cvt.rn.satfinite.e2m1x2.f32 kvgen_t, %1, %2;\n\t"
      "mov.b16 %0, {kvgen_t, 0};\n\t}"
      : "=h"(r)
      : "f"(odd), "f"(even));
  return r & 0xFFu;
#else
  return __nv_cvt_float2_to_fp4x2(make_float2(even, odd), __NV_E2M1, cudaRoundNearest);
#endif
}

KVGEN_NVFP4_HD uint32_t e2m1x2_sw(float even, float odd) {
  return e2m1_from_f32_sw(even) | (e2m1_from_f32_sw(odd) << 4);
}

KVGEN_NVFP4_HD uint32_t e2m1x2_hw(float even, float odd) {
  return e2m1x2_cvt_raw(e2m1_cvt_operand(even), e2m1_cvt_operand(odd));
}

template <Path P>
KVGEN_NVFP4_HD uint32_t e2m1x2_path(float even, float odd) {
  return P == Path::Hardware ? e2m1x2_hw(even, odd) : e2m1x2_sw(even, odd);
}

// Two codes packed in one byte (even element in the low nibble), with this pass's path.
KVGEN_NVFP4_HD uint32_t e2m1x2(float even, float odd) { return e2m1x2_path<kPath>(even, odd); }
// One code.
KVGEN_NVFP4_HD uint32_t e2m1_code(float p) { return e2m1x2(p, 0.0f) & 0xFu; }

// Eight codes packed in one word (element k in nibble k), software path: magnitudes by
// arithmetic, then the signs of the whole word at once -- a code keeps its sign bit only when its
// magnitude is non-zero, tested per nibble with two shifts -- which saves the per-element sign
// logic of e2m1_from_f32_sw in the encoder's hot loop (same bits).
KVGEN_NVFP4_HD uint32_t e2m1x8_sw(const float (&p)[8]) {
  uint32_t mags = 0;
  uint32_t signs = 0;
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    mags += e2m1_magnitude_sw(p[k]) << (4 * k);
    signs |= (f32_bits(p[k]) >> (28 - 4 * k)) & (8u << (4 * k));
  }
  const uint32_t nonzero = (mags | (mags >> 1) | (mags >> 2)) & 0x11111111u;
  return mags | (signs & (nonzero * 8u));
}

KVGEN_NVFP4_HD uint32_t e2m1x8_hw(const float (&p)[8]) {
  uint32_t word = 0;
#pragma unroll
  for (int k = 0; k < 4; ++k) word |= e2m1x2_hw(p[2 * k], p[2 * k + 1]) << (8 * k);
  return word;
}

template <Path P>
KVGEN_NVFP4_HD uint32_t e2m1x8_path(const float (&p)[8]) {
  return P == Path::Hardware ? e2m1x8_hw(p) : e2m1x8_sw(p);
}

// ---------------------------------------------------------------------------------------------
// Software rounding on the FMA pipe (Rounding::Fma): same codes as e2m1_magnitude_sw for every
// non-NaN product, with the integer ALU pipe (half the FMA pipe's issue rate on sm_90) left to
// the packing.  The E2M1 magnitude code is the concave piecewise-linear function
//     code(a) = min(2a, a + 2, a/2 + 4, 7)      (a = |p|: one line per binade, then saturation)
// rounded to an integer with ties to even: rne is monotone, so rne(min(..)) = min(rne(2a),
// rne(a) + 2, rne(a/2) + 4, 7), and each line's rne is one float add of the magic 2^23 + k
// (k = 0, 2, 4 even, so the tie-to-even of the sum is the tie-to-even of the line): the code ends
// up in the low byte of the float's bit pattern, 0x4B00000c.  2a and a/2 are exact (a/2 only
// loses bits below every threshold), and +Inf gives 7.  A NaN would give 7 too, which is why
// encode_block only takes this route for blocks without non-finite values (see there).
// ---------------------------------------------------------------------------------------------

// FusedFma: the same FMA-pipe route with 2a + magic and a/2 + magic as one fused op each (2a and
// a/2 are exact products, so the bits are the same): 32 fewer FMA-pipe instructions per block, but
// ptxas then keeps more values live (qwen3-8b encode: 47 registers instead of 40), hence a choice.
// PackedF16: FP8 E4M3 hot pages at Q == 1 take encode_block_e4m3x16 (packed fp16 arithmetic on
// two elements per instruction, see there); every other input takes the FusedFma route (a
// per-layer or other Q, 16-bit hot dtypes), so those buffers compile what rounding 2 compiles.
// PackedBF16: the same for BF16 hot pages at Q == 1 (encode_block_bf16x16: binary32 products, codes
// on fp16 pairs), and PackedF16's route for FP8 ones; FusedFma for every other input.
enum class Rounding { Integer = 0, Fma = 1, FusedFma = 2, PackedF16 = 3, PackedBF16 = 4 };

constexpr float kRoundMagic = 8388608.0f;  // 2^23: adding it rounds [0, 2^23) to an integer

// Bits 0x4B000000 | code of any non-NaN p (code = e2m1_magnitude_sw(p)).  kFused: 2a + magic and
// a/2 + magic in one fused op each; 2a and a/2 are exact products (a/2 of a subnormal a below
// 2^-125 is not, but any such sum rounds to the magic number alike), so the bits are the same.
template <bool kFused = false>
KVGEN_NVFP4_HD uint32_t e2m1_magnitude_fma_bits(float p) {
  const float a = fabsf(p);
  // codes 0..4: steps of 0.5; codes 4..6: steps of 1; codes 6..7: steps of 2
  const float by_half = kFused ? fma_rn(a, 2.0f, kRoundMagic) : add_rn(add_rn(a, a), kRoundMagic);
  const float by_one = add_rn(a, kRoundMagic + 2.0f);
  const float by_two = kFused ? fma_rn(a, 0.5f, kRoundMagic + 4.0f) : add_rn(mul_rn(a, 0.5f), kRoundMagic + 4.0f);
  return f32_bits(fminf(fminf(by_half, by_one), fminf(by_two, kRoundMagic + 7.0f)));
}

// __byte_perm (PRMT) in device code, the same byte selection on the host: selector nibble k
// picks byte (nibble & 7) of {b:a} for result byte k.  Only the low 3 bits of each nibble are
// used (the intrinsic is specified on them alone; its sign-replicate bit is never relied on).
KVGEN_NVFP4_HD uint32_t byte_perm(uint32_t a, uint32_t b, uint32_t selector) {
#if defined(__CUDA_ARCH__)
  return __byte_perm(a, b, selector);
#else
  const uint64_t both = ((uint64_t)b << 32) | a;
  uint32_t out = 0;
  for (int k = 0; k < 4; ++k) {
    const uint32_t nib = (selector >> (4 * k)) & 7u;
    out |= (uint32_t)((both >> (8 * nib)) & 0xFFu) << (8 * k);
  }
  return out;
#endif
}

// Byte `kByte` of four words, gathered into one word (w0's in byte 0): three PRMTs.
template <uint32_t kByte>
KVGEN_NVFP4_HD uint32_t gather_bytes(uint32_t w0, uint32_t w1, uint32_t w2, uint32_t w3) {
  constexpr uint32_t kPair = kByte | ((kByte + 4u) << 4);  // [a.kByte, b.kByte, .., ..]
  return byte_perm(byte_perm(w0, w1, kPair), byte_perm(w2, w3, kPair), 0x5410u);
}

// Eight codes in one word (element k in nibble k), FMA-pipe rounding, for non-NaN products.  The
// codes sit in byte 0 of each magnitude pattern and the signs in bit 7 of byte 3 of each product:
// PRMT gathers the even and the odd elements' bytes, a shift and LOP3s move the signs to bit 3
// (even) and bit 7 (odd) of each byte, and a sign survives only where its magnitude is non-zero
// (no negative zero), as in e2m1x8_sw.
template <bool kFused = false>
KVGEN_NVFP4_HD uint32_t e2m1x8_fma(const float (&p)[8]) {
  uint32_t t[8];
  uint32_t u[8];
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    t[k] = e2m1_magnitude_fma_bits<kFused>(p[k]);
    u[k] = f32_bits(p[k]);
  }
  const uint32_t even = gather_bytes<0>(t[0], t[2], t[4], t[6]);
  const uint32_t odd = gather_bytes<0>(t[1], t[3], t[5], t[7]);
  const uint32_t mags = even | (odd << 4);
  const uint32_t sign_even = gather_bytes<3>(u[0], u[2], u[4], u[6]);
  const uint32_t sign_odd = gather_bytes<3>(u[1], u[3], u[5], u[7]);
  const uint32_t signs = ((sign_even >> 4) & 0x08080808u) | (sign_odd & 0x80808080u);
  const uint32_t nonzero = ((mags << 1) | (mags << 2) | (mags << 3)) & 0x88888888u;
  return mags | (signs & nonzero);
}

// ---------------------------------------------------------------------------------------------
// One block of 16 elements
// ---------------------------------------------------------------------------------------------

// packed[0] holds elements 0..7 and packed[1] elements 8..15; inside a word, element 2k sits in
// the low nibble of byte k and element 2k+1 in its high nibble.  Stored little-endian, the two
// words are exactly the 8 bytes of the cold page (element e in byte e/2, even e low nibble).
struct Block {
  uint32_t packed[2];
  uint8_t scale;  // E4M3 byte
};

struct Block2FP4 {
  Block main;
  Block residual;
};

// amax over the finite elements: non-finite values (NaN fails the compare, Inf exceeds the
// largest float) count as 0, so the running max never sees a NaN and one float max per element is
// exact on every target (no reliance on how a host libm treats signaling NaNs in fmaxf).
KVGEN_NVFP4_HD float finite_amax(const float (&x)[16]) {
  float best = 0.0f;
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    const float a = abs_f32(x[i]);
    best = fmaxf(best, a <= 3.40282347e38f ? a : 0.0f);
  }
  return best;
}

// max |x_i| propagating NaN (max.NaN.f32; an Inf stays Inf): finite exactly when every element is
// finite, and then it is finite_amax(x).  The test of the FMA-pipe rounding's fast path.
KVGEN_NVFP4_HD float raw_amax(const float (&x)[16]) {
  float best = 0.0f;
#pragma unroll
  for (int i = 0; i < 16; ++i) {
#if defined(__CUDA_ARCH__)
    asm("max.NaN.f32 %0, %1, %2;" : "=f"(best) : "f"(best), "f"(fabsf(x[i])));
#else
    best = is_nan(x[i]) || is_nan(best) ? bits_f32(0x7FFFFFFFu) : fmaxf(best, fabsf(x[i]));
#endif
  }
  return best;
}

// The codes of one block, 8 products at a time, with the path's packer or the FMA-pipe one.
template <Path P, bool kFma, bool kFused = false>
KVGEN_NVFP4_HD void pack_codes(Block& blk, const float (&x)[16], float m) {
#pragma unroll
  for (int w = 0; w < 2; ++w) {
    float p[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) p[k] = mul_rn(x[w * 8 + k], m);
    blk.packed[w] = kFma ? e2m1x8_fma<kFused>(p) : e2m1x8_path<P>(p);
  }
}

// Rounding::Fma, FusedFma, PackedF16 and PackedBF16 (software path only; the hardware path has its
// cvt) take the FMA-pipe route when every x_i is finite and m is finite: then no product is NaN (one may still overflow to +-Inf,
// which rounds right).  Any other block -- garbage rows, or a tiny Q making S * Q underflow --
// takes the integer route, which handles everything.  Both routes give the same bytes.
template <Path P, Rounding R = Rounding::Integer>
KVGEN_NVFP4_HD Block encode_block_path(const float (&x)[16], float G, float Q) {
  constexpr bool kFmaRoute = P == Path::Software && R != Rounding::Integer;
  Block blk;
  bool all_finite = false;
  float amax;
  if constexpr (kFmaRoute) {
    amax = raw_amax(x);
    all_finite = is_finite(amax);
    if (!all_finite) amax = finite_amax(x);
  } else {
    amax = finite_amax(x);
  }
  // s = fl(fl(amax * SIXTH) * G); S = E4M3(s).  s >= 0 (possibly +Inf), so the byte has no sign.
  const uint32_t sb = e4m3_from_f32_path<P>(mul_rn(mul_rn(amax, kSixth), G));
  blk.scale = (uint8_t)sb;
  // m = fl(1 / fl(S * Q)).  With S == 0 this is Inf and the codes are garbage: they are masked
  // below instead of branching, so every lane does the same work.
  const float m = div_rn(1.0f, mul_rn(e4m3_to_f32(sb), Q));
  if (kFmaRoute && all_finite && is_finite(m)) {
    pack_codes<P, true, R == Rounding::FusedFma || R == Rounding::PackedF16 || R == Rounding::PackedBF16>(blk, x, m);
  } else {
    pack_codes<P, false>(blk, x, m);
  }
  const uint32_t keep = sb != 0u ? 0xFFFFFFFFu : 0u;
  blk.packed[0] &= keep;
  blk.packed[1] &= keep;
  return blk;
}

// Encode one block with this pass's path.
template <Rounding R = Rounding::Integer>
KVGEN_NVFP4_HD Block encode_block(const float (&x)[16], float G, float Q) {
  return encode_block_path<kPath, R>(x, G, Q);
}

// ---------------------------------------------------------------------------------------------
// FP8 E4M3 hot blocks on packed fp16 lanes (Rounding::PackedF16, software path, Q == 1)
// ---------------------------------------------------------------------------------------------
// Every E4M3 value is an exact fp16, so one cvt widens two elements and every later step works on
// fp16 pairs.  With c = fl16(m), m = fl32(1/S) the contract's multiplier:
//   q = fl16(|x| * c)                       one packed multiply (mul.rn.f16x2)
//   code = min(rne(2q), rne(q) + 2, rne(q/2) + 4, 7)
// as in e2m1_magnitude_fma_bits, each line one packed fused op with the magic 2^10 + k (fp16 has 10
// fraction bits: the code lands in the low byte of 0x6400 | code, exact up to 2047), then packed
// mins.  Why q, rounded to fp16, gives the contract's code of fl32(x * m) for every finite x and
// every scale: x / S can only be an E2M1 decision point t exactly when x = t * S; otherwise it lies
// at least 2^-6.8 (relative) away from every t (x has 4 significant bits, t * S at most 7), far
// beyond q's error (two fp16 roundings, < 2^-10), so q and fl32(x * m) round alike.  At x = t * S
// q is t itself or its fp16 neighbour on the side fl32(x * m) rounds to, which nvfp4_host_check
// --sweep-fp8 proves over every (scale byte, element byte) pair a block can hold.  c comes from the
// approximate reciprocal (rcp.approx.ftz.f32, at most one binary32 ulp off) rounded to fp16, not from
// a division: for every E4M3 S, fl16 is constant on [m (1 - 2^-21), m (1 + 2^-21)] (the sweep checks
// that too), so the device's c is the host's fl16(m).  Overflow of |x| * c gives +Inf and code 7,
// like the contract; a zero scale's garbage is masked as usual.
// Blocks holding a NaN byte (0x7F, 0xFF; E4M3 has no Inf) take encode_block_path's general route.

// Two E4M3 bytes (low 16 bits of v) as an fp16 pair: one cvt.rn.f16x2.e4m3x2 on sm_89+.
KVGEN_NVFP4_HD uint32_t e4m3x2_to_f16x2(uint32_t v) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(v & 0xFFFFu), __NV_E4M3);
  return (uint32_t)h.x | ((uint32_t)h.y << 16);
}

KVGEN_NVFP4_HD double f16_lane(uint32_t v, int k) {
  return (double)__half2float(__ushort_as_half((unsigned short)(v >> (16 * k))));
}

KVGEN_NVFP4_HD uint32_t f16_bits_rn(double v) { return __half_as_ushort(__double2half(v)); }

// Packed fp16 a * b, rounded once.  Host: the product of two fp16 values is exact in binary64.
KVGEN_NVFP4_HD uint32_t mul_rn_f16x2(uint32_t a, uint32_t b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  uint32_t r;
  asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;
#else
  return f16_bits_rn(f16_lane(a, 0) * f16_lane(b, 0)) | (f16_bits_rn(f16_lane(a, 1) * f16_lane(b, 1)) << 16);
#endif
}

// Packed fp16 a * b + c, rounded once.  Host: exact in binary64 for the operands used here
// (b a power of two, so a * b + c spans at most 2^16 .. 2^-25).
KVGEN_NVFP4_HD uint32_t fma_rn_f16x2(uint32_t a, uint32_t b, uint32_t c) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  uint32_t r;
  asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
  return r;
#else
  uint32_t r = 0;
  for (int k = 0; k < 2; ++k) r |= f16_bits_rn(f16_lane(a, k) * f16_lane(b, k) + f16_lane(c, k)) << (16 * k);
  return r;
#endif
}

// Packed fp16 min of non-NaN operands (min.f16x2).
KVGEN_NVFP4_HD uint32_t min_f16x2(uint32_t a, uint32_t b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  uint32_t r;
  asm("min.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;
#else
  uint32_t r = 0;
  for (int k = 0; k < 2; ++k) r |= ((f16_lane(a, k) <= f16_lane(b, k) ? a : b) >> (16 * k) & 0xFFFFu) << (16 * k);
  return r;
#endif
}

// Packed fp16 max propagating NaN (max.NaN.f16x2): a lane is NaN when either operand's is.
KVGEN_NVFP4_HD uint32_t max_nan_f16x2(uint32_t a, uint32_t b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  uint32_t r;
  asm("max.NaN.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;
#else
  uint32_t r = 0;
  for (int k = 0; k < 2; ++k) {
    const double x = f16_lane(a, k), y = f16_lane(b, k);
    const uint32_t lane = x != x || y != y ? 0x7FFFu : (x >= y ? a : b) >> (16 * k) & 0xFFFFu;
    r |= lane << (16 * k);
  }
  return r;
#endif
}

// The E2M1 magnitude codes of a pair of non-negative, non-NaN fp16 values q, as 0x6400 | code per
// lane: min(rne(2q), rne(q) + 2, rne(q/2) + 4, 7), each line one packed fused op with the magic
// 2^10 + k (see the section comment), then packed mins.
KVGEN_NVFP4_HD uint32_t e2m1x2_codes_f16(uint32_t q) {
  constexpr uint32_t kTwo = 0x40004000u, kOne = 0x3C003C00u, kHalf = 0x38003800u;
  constexpr uint32_t kMagic0 = 0x64006400u, kMagic2 = 0x64026402u, kMagic4 = 0x64046404u, kSeven = 0x64076407u;
  const uint32_t by_half = fma_rn_f16x2(q, kTwo, kMagic0);
  const uint32_t by_one = fma_rn_f16x2(q, kOne, kMagic2);
  const uint32_t by_two = fma_rn_f16x2(q, kHalf, kMagic4);
  return min_f16x2(min_f16x2(by_half, by_one), min_f16x2(by_two, kSeven));
}

// Eight codes in one word (element k in nibble k) from four fp16 pairs holding 0x6400 | code per
// lane (pair j: elements 2j, 2j+1) and the raw E4M3 bytes of the same elements (lo: 0..3, hi: 4..7),
// whose bit 7 is the sign: a sign survives only where its magnitude is non-zero (no negative zero).
// Adding 7 to a nibble of 0..7 carries into its bit 3 exactly when it is non-zero.
KVGEN_NVFP4_HD uint32_t e2m1x8_from_f16_codes(const uint32_t (&r)[4], uint32_t lo, uint32_t hi) {
  const uint32_t a = byte_perm(r[0], r[1], 0x6240u);  // codes 0, 2, 1, 3
  const uint32_t b = byte_perm(r[2], r[3], 0x6240u);  // codes 4, 6, 5, 7
  const uint32_t mags = byte_perm(a, b, 0x5410u) + byte_perm(a, b, 0x7632u) * 16u;  // no overlap: one IMAD
  const uint32_t even = byte_perm(lo, hi, 0x6420u);   // bytes of elements 0, 2, 4, 6
  const uint32_t odd = byte_perm(lo, hi, 0x7531u);    // bytes of elements 1, 3, 5, 7
  const uint32_t signs = ((even >> 4) & 0x08080808u) | (odd & 0x80808080u);
  return mags | (signs & (mags + 0x77777777u));
}

// c = fl16(1/S) for an E4M3 S: the approximate reciprocal on the device (see above), fl16(m) on
// the host.
KVGEN_NVFP4_HD uint32_t recip_f16(float S) {
#if defined(__CUDA_ARCH__)
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(S));  // S is 0 or >= 2^-9: ftz changes nothing
  return __half_as_ushort(__float2half_rn(r));
#else
  return __half_as_ushort(__float2half_rn(div_rn(1.0f, S)));
#endif
}

// One block of 16 E4M3 elements (element 4i + b in byte b of w[i]) at Q == 1: the bytes of
// encode_block(widened x, G, 1) on every input (see the section comment).
KVGEN_NVFP4_HD Block encode_block_e4m3x16(const uint32_t (&w)[4], float G) {
  uint32_t h[8];  // |x| as fp16 pairs: h[j] = elements 2j, 2j+1
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const uint32_t a = w[i] & 0x7F7F7F7Fu;
    h[2 * i] = e4m3x2_to_f16x2(a);
    h[2 * i + 1] = e4m3x2_to_f16x2(a >> 16);
  }
  uint32_t mx = h[0];
#pragma unroll
  for (int j = 1; j < 8; ++j) mx = max_nan_f16x2(mx, h[j]);
  mx = max_nan_f16x2(mx, byte_perm(mx, mx, 0x1032u));
  if ((mx & 0x7FFFu) > 0x7C00u) {  // a NaN element: the general route (rare)
    float x[16];
#pragma unroll
    for (int e = 0; e < 16; ++e) x[e] = e4m3_to_f32((w[e >> 2] >> (8 * (e & 3))) & 0xFFu);
    return encode_block_path<Path::Software, Rounding::Fma>(x, G, 1.0f);
  }
  const float amax = __half2float(__ushort_as_half((unsigned short)(mx & 0xFFFFu)));
  Block blk;
  const uint32_t sb = e4m3_from_f32_hw(mul_rn(mul_rn(amax, kSixth), G));  // the cvt on sm_89+
  blk.scale = (uint8_t)sb;
  // S through the fp16 cvt (exact, and sb is never a NaN byte here) instead of e4m3_to_f32's branches.
  const float S = __half2float(__ushort_as_half((unsigned short)(e4m3x2_to_f16x2(sb) & 0xFFFFu)));
  const uint32_t c = recip_f16(S) * 0x10001u;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    uint32_t r[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) r[j] = e2m1x2_codes_f16(mul_rn_f16x2(h[4 * half + j], c));
    blk.packed[half] = e2m1x8_from_f16_codes(r, w[2 * half], w[2 * half + 1]);
  }
  const uint32_t keep = sb != 0u ? 0xFFFFFFFFu : 0u;
  blk.packed[0] &= keep;
  blk.packed[1] &= keep;
  return blk;
}

// ---------------------------------------------------------------------------------------------
// BF16 hot blocks with the codes on packed fp16 lanes (Rounding::PackedBF16, software path, Q == 1)
// ---------------------------------------------------------------------------------------------
// The products stay binary32 (bf16 does not fit fp16's range), one multiply per element, but
// everything after them works on fp16 pairs: one cvt.rn.f16x2.f32 packs two products and
// e2m1x2_codes_f16 rounds both, instead of three sums and three mins per element.
//   q = fl16(fl32(|x| * c)),   c = m (1 + 2^13 (S m - 1)),   m = fl32(1/S) the contract's multiplier
// Why this gives the contract's code of p = fl32(x * m): x has 8 significant bits and t * S (t an
// E2M1 decision point, 3 bits; S 4 bits) at most 7, so either x = t * S or x / S lies at least
// 2^-8 (relative) away from t, far beyond q's error (|2^13 (S m - 1)| <= 2^-11, plus two roundings),
// and q and p then round alike.  At x = t * S, x m = t (1 + e) with e = S m - 1, and p is t or its
// binary32 neighbour depending on whether |t e| exceeds half a binary32 ulp of t; x c = t (1 + 2^13 e)
// (to first order) against half an fp16 ulp, 2^13 binary32 ulps: the same test, so q is t exactly
// when p is, and otherwise t's fp16 neighbour on p's side.  (With c = m, q would be t at every such
// x and take the tie-to-even where p does not.)  nvfp4_host_check --sweep-bf16 proves it for every
// (scale byte, bf16 element) pair, products that overflow fp16 (code 7) and subnormals included.
// S m - 1 is exact in one fma (at most 4 significant bits near 2^-24); c needs a second one.  A
// zero scale makes c NaN and its codes garbage, masked as usual.  Blocks holding a NaN or an Inf
// take the FusedFma route (encode_block_path), like every FMA-pipe route.

// m = fl32(1/S) for a non-zero E4M3 scale S: on the device the approximate reciprocal
// (rcp.approx.ftz.f32, at most one binary32 ulp off; S is normal, so ftz changes nothing) and one
// fma-based correction, which nvfp4_host_check --sweep-bf16 proves lands on div_rn(1, S) from every
// start within two ulps of it, for every scale byte; div_rn itself on the host.  No FCHK slow path.
KVGEN_NVFP4_HD float recip_refined(float y, float S) { return fma_rn(y, fma_rn(-S, y, 1.0f), y); }

KVGEN_NVFP4_HD float recip_e4m3(float S) {
#if defined(__CUDA_ARCH__)
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(S));
  return recip_refined(y, S);
#else
  return div_rn(1.0f, S);
#endif
}

// The multiplier of the packed route for a non-zero E4M3 scale S and m = fl32(1/S).
KVGEN_NVFP4_HD float tie_scaled_multiplier(float S, float m) {
  return fma_rn(m, mul_rn(fma_rn(S, m, -1.0f), 8192.0f), m);
}

// Packed bf16 max / min propagating NaN (max.NaN.bf16x2, min.NaN.bf16x2): a lane is NaN when either
// operand's is.  Host: per lane in binary32 (bf16 widens exactly), the NaN as 0x7FFF.
KVGEN_NVFP4_HD uint32_t minmax_nan_bf16x2_host(uint32_t a, uint32_t b, bool max) {
  uint32_t r = 0;
  for (int k = 0; k < 2; ++k) {
    const uint32_t ha = (a >> (16 * k)) & 0xFFFFu, hb = (b >> (16 * k)) & 0xFFFFu;
    const float x = bits_f32(ha << 16), y = bits_f32(hb << 16);
    const uint32_t lane = is_nan(x) || is_nan(y) ? 0x7FFFu : ((x >= y) == max ? ha : hb);
    r |= lane << (16 * k);
  }
  return r;
}

KVGEN_NVFP4_HD uint32_t max_nan_bf16x2(uint32_t a, uint32_t b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  uint32_t r;
  asm("max.NaN.bf16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;
#else
  return minmax_nan_bf16x2_host(a, b, true);
#endif
}

KVGEN_NVFP4_HD uint32_t min_nan_bf16x2(uint32_t a, uint32_t b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  uint32_t r;
  asm("min.NaN.bf16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;
#else
  return minmax_nan_bf16x2_host(a, b, false);
#endif
}

// max |x_i| of 16 bf16 elements as binary32, NaN when some element is NaN (an Inf stays Inf): raw_amax
// of the widened block, from packed maxima and minima of the raw pairs (max(max x, -min x), no
// per-element abs).  The sign is cleared last: a block of zeros may give -0 there, the contract +0.
KVGEN_NVFP4_HD float bf16_block_amax(const uint32_t (&w)[8]) {
  uint32_t hi = w[0], lo = w[0];
#pragma unroll
  for (int j = 1; j < 8; ++j) {
    hi = max_nan_bf16x2(hi, w[j]);
    lo = min_nan_bf16x2(lo, w[j]);
  }
  const uint32_t m = max_nan_bf16x2(hi, lo ^ 0x80008000u);
  return bits_f32((max_nan_bf16x2(m, m >> 16) & 0x7FFFu) << 16);
}

// Two binary32 values rounded to an fp16 pair (lo in the low half): one cvt.rn.f16x2.f32 (no .ftz
// whatever the flags) on sm_80+, __float2half_rn per lane elsewhere; both round to nearest even,
// keep subnormals and overflow to Inf.
KVGEN_NVFP4_HD uint32_t f16x2_rn(float lo, float hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  uint32_t r;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
#else
  return (uint32_t)__half_as_ushort(__float2half_rn(lo)) | ((uint32_t)__half_as_ushort(__float2half_rn(hi)) << 16);
#endif
}

// Eight codes (element k in nibble k) of four bf16 pairs w (pair j: elements 2j, 2j+1) under the
// multiplier c, for finite elements: the sign bits of the pairs (bits 15, 31) gathered so element k's
// is bit 7 of byte k % 4 of lo (k < 4) or hi, which e2m1x8_from_f16_codes expects.
KVGEN_NVFP4_HD uint32_t e2m1x8_bf16(const uint32_t (&w)[4], float c) {
  uint32_t r[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float2 x = make_float2(bits_f32(w[j] << 16), bits_f32(w[j] & 0xFFFF0000u));
    r[j] = e2m1x2_codes_f16(f16x2_rn(mul_rn(fabsf(x.x), c), mul_rn(fabsf(x.y), c)));
  }
  return e2m1x8_from_f16_codes(r, byte_perm(w[0], w[1], 0x7531u), byte_perm(w[2], w[3], 0x7531u));
}

// One block of 16 bf16 elements (element 2j + k in half k of w[j]) at Q == 1: the bytes of
// encode_block(widened x, G, 1) on every input (see the section comment).
KVGEN_NVFP4_HD Block encode_block_bf16x16(const uint32_t (&w)[8], float G) {
  const float amax = bf16_block_amax(w);
  if (!is_finite(amax)) {
    float x[16];
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      x[2 * j] = bits_f32(w[j] << 16);
      x[2 * j + 1] = bits_f32(w[j] & 0xFFFF0000u);
    }
    return encode_block_path<Path::Software, Rounding::FusedFma>(x, G, 1.0f);
  }
  Block blk;
  // s = fl(fl(amax * SIXTH) * G) >= 0, finite or +Inf (x * 1 is exact: skipped for the default G);
  // min(s, 448) is e4m3_cvt_operand(s) for such s, and the cvt (sm_89+) rounds it like the contract.
  const float s6 = mul_rn(amax, kSixth);
  const uint32_t sb = e4m3_cvt_raw(fminf(G == 1.0f ? s6 : mul_rn(s6, G), kE4M3Max));
  blk.scale = (uint8_t)sb;
  // S through the fp16 cvt (exact, and sb is never a NaN byte here) instead of e4m3_to_f32's branches.
  const float S = __half2float(__ushort_as_half((unsigned short)(e4m3x2_to_f16x2(sb) & 0xFFFFu)));
  const float c = tie_scaled_multiplier(S, recip_e4m3(S));
  const uint32_t keep = sb != 0u ? 0xFFFFFFFFu : 0u;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const uint32_t(&words)[4] = *reinterpret_cast<const uint32_t(*)[4]>(w + 4 * half);
    blk.packed[half] = e2m1x8_bf16(words, c) & keep;
  }
  return blk;
}

// y_i = fl(fl(e2m1(code_i) * S) * Q), binary32, before the hot rounding.  Decoding makes no
// rounding decision that hardware could do differently, so both paths share this code.
KVGEN_NVFP4_HD void decode_block(const Block& blk, float Q, float (&y)[16]) {
  const float S = e4m3_to_f32(blk.scale);
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    const uint32_t code = (blk.packed[i >> 3] >> (4 * (i & 7))) & 0xFu;
    const float v = mul_rn(e2m1_to_f32(code), S);
    y[i] = Q == 1.0f ? v : mul_rn(v, Q);  // x * 1 is exact: skip it when Q is the default
  }
}

// 2FP4: main block, then the residual d_i = fl(x_i - y_i) (0 for non-finite x_i) encoded as its
// own block with the same G and Q.
template <Path P, Rounding R = Rounding::Integer>
KVGEN_NVFP4_HD Block2FP4 encode_block_2fp4_path(const float (&x)[16], float G, float Q) {
  Block2FP4 out;
  out.main = encode_block_path<P, R>(x, G, Q);
  float y[16];
  decode_block(out.main, Q, y);
  float d[16];
#pragma unroll
  for (int i = 0; i < 16; ++i) d[i] = is_finite(x[i]) ? sub_rn(x[i], y[i]) : 0.0f;
  out.residual = encode_block_path<P, R>(d, G, Q);
  return out;
}

template <Rounding R = Rounding::Integer>
KVGEN_NVFP4_HD Block2FP4 encode_block_2fp4(const float (&x)[16], float G, float Q) {
  return encode_block_2fp4_path<kPath, R>(x, G, Q);
}

// 2FP4 decode: fl(y_i + y'_i), binary32, before the (single) hot rounding.
KVGEN_NVFP4_HD void decode_block_2fp4(const Block2FP4& b, float Q, float (&y)[16]) {
  float r[16];
  decode_block(b.main, Q, y);
  decode_block(b.residual, Q, r);
#pragma unroll
  for (int i = 0; i < 16; ++i) y[i] = add_rn(y[i], r[i]);
}

// ---------------------------------------------------------------------------------------------
// Final rounding to the hot dtype, and exact widening from it
// ---------------------------------------------------------------------------------------------
// __float2bfloat16_rn / __float2half_rn are IEEE round-to-nearest-even with overflow to +-Inf and
// signed zeros, on the device (cvt.rn.bf16/f16.f32, no .ftz) and in their host code, which is
// what the contract asks; only NaN is pinned to one canonical pattern.  For FP8 the cuda_fp8.h
// conversion with __NV_SATFINITE rounds to nearest even and saturates; we clamp to +-448 first so
// the result never depends on how the instruction treats Inf, and pin NaN to 0x7F.

KVGEN_NVFP4_HD uint16_t round_to_bf16_bits(float y) {
  if (is_nan(y)) return kBF16NaN;
  return __bfloat16_as_ushort(__float2bfloat16_rn(y));
}

KVGEN_NVFP4_HD uint16_t round_to_fp16_bits(float y) {
  if (is_nan(y)) return kFP16NaN;
  return __half_as_ushort(__float2half_rn(y));
}

KVGEN_NVFP4_HD uint8_t round_to_fp8_e4m3_bits(float y) {
  if (is_nan(y)) return kE4M3NaN;
  return (uint8_t)__nv_cvt_float_to_fp8(e4m3_cvt_operand(y), __NV_SATFINITE, __NV_E4M3);
}

KVGEN_NVFP4_HD float bf16_bits_to_f32(uint16_t h) { return bits_f32((uint32_t)h << 16); }
KVGEN_NVFP4_HD float fp16_bits_to_f32(uint16_t h) { return __half2float(__ushort_as_half(h)); }
KVGEN_NVFP4_HD float fp8_e4m3_bits_to_f32(uint8_t b) { return e4m3_to_f32(b); }

// ---------------------------------------------------------------------------------------------
// Decoding straight to packed 16-bit pairs (DecodeRoute::Lut), for Q == 1 (every shipped spec)
// ---------------------------------------------------------------------------------------------
// With Q == 1 the decoded value e2m1(code) * S is exact in binary32 and, being a product of a 2-bit
// and a 4-bit significand with |e2m1 * S| in {0} u [2^-10, 2688], also exact in fp16 (11 bits,
// normal from 2^-14, max 65504) and in bf16 (8 bits, huge range).  So a packed fp16/bf16 multiply
// of the exact code value by the exact scale is exact under any rounding and gives the bits of
// round_to_{fp16,bf16}_bits(decode_block(...)), zeros' signs included (IEEE product signs;
// the multiply is an FMA with addend -0, which keeps -0 and +0 alike).  FP8 hot pages round that
// exact fp16 product once, with the same satfinite nearest-even cvt the f32 route uses.  A NaN
// scale byte (0x7F/0xFF) makes every element the canonical NaN, pinned by a select.
//
// The code values come from PRMT table lookups, 8 codes per word, no per-element integer math:
// fp16 values of E2M1 codes have a zero low byte, so one 8-byte table of high bytes (index =
// magnitude code) gives a pair with one PRMT, its selector nibbles 0 and 2 picking entry 0 (code 0:
// byte 0x00); bf16 needs a table of low bytes too, and a bit select of the two lookups.

enum class DecodeRoute { Float = 0, Lut = 1 };

// High bytes of the fp16 values 0, .5, 1, 1.5, 2, 3, 4, 6 (low bytes are all 0).
constexpr uint32_t kF16HiLo = 0x3E3C3800u, kF16HiHi = 0x46444240u;
// bf16 values 0x0000 3F00 3F80 3FC0 4000 4040 4080 40C0: low bytes, then high bytes.
constexpr uint32_t kBF16LoLo = 0xC0800000u, kBF16LoHi = 0xC0804000u;
constexpr uint32_t kBF16HiLo = 0x3F3F3F00u, kBF16HiHi = 0x40404040u;

// PRMT with a run-time selector whose four low nibbles are all < 8 (callers guarantee it): the raw
// `prmt.b32` in device code, where __byte_perm would first mask the selector with 0x7777 (one LOP3
// per lookup); byte_perm's host twin otherwise.  With no nibble's bit 3 set, PRMT's sign-replicate
// mode is never entered, so both select the same bytes.
KVGEN_NVFP4_HD uint32_t prmt_lookup(uint32_t lo, uint32_t hi, uint32_t selector) {
#if defined(__CUDA_ARCH__)
  uint32_t r;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(lo), "r"(hi), "r"(selector));
  return r;
#else
  return byte_perm(lo, hi, selector);
#endif
}

// The byte_perm selector whose result byte k is byte j of a (nibble k of kPattern is 0) or byte j
// of b (nibble k is 1).
template <int kJ, uint32_t kPattern>
constexpr uint32_t kPick = (((kPattern >> 0) & 1u) * 4 + kJ) | ((((kPattern >> 4) & 1u) * 4 + kJ) << 4) |
                           ((((kPattern >> 8) & 1u) * 4 + kJ) << 8) | ((((kPattern >> 12) & 1u) * 4 + kJ) << 12);

// Signs of word j's two elements at bits 15 and 31: the even element's sign is bit 3 of byte j of
// the code word w (bit 7 of byte j of w << 4), the odd one's bit 7 of byte j of w.
template <int kJ>
KVGEN_NVFP4_HD uint32_t pair_signs(uint32_t w, uint32_t w4) {
  return byte_perm(w4, w, kPick<kJ, 0x1000u>) & 0x80008000u;
}

// fp16 bits of the 8 codes of w (element k in nibble k), element 2j | 2j+1 in word j.
KVGEN_NVFP4_HD void e2m1x8_to_f16x2(uint32_t w, uint32_t (&out)[4]) {
  const uint32_t w4 = w << 4;
  const uint32_t even = w4 & 0x70707070u;  // byte j: magnitude of element 2j in its high nibble
  const uint32_t odd = w & 0x70707070u;    // byte j: magnitude of element 2j+1 in its high nibble
  // Selector of word j: [even_j, odd_j] = nibbles [0, m_2j, 0, m_2j+1].
#define KVGEN_NVFP4_F16_WORD(J) \
  out[J] = prmt_lookup(kF16HiLo, kF16HiHi, byte_perm(even, odd, kPick<J, 0x1010u>)) | pair_signs<J>(w, w4)
  KVGEN_NVFP4_F16_WORD(0);
  KVGEN_NVFP4_F16_WORD(1);
  KVGEN_NVFP4_F16_WORD(2);
  KVGEN_NVFP4_F16_WORD(3);
#undef KVGEN_NVFP4_F16_WORD
}

// bf16 bits of the 8 codes of w, laid out as e2m1x8_to_f16x2's.  One selector per word, nibbles
// [m_2j, m_2j, m_2j+1, m_2j+1], serves both tables; the low table's bytes 0 and 2 and the high
// table's bytes 1 and 3 are then kept.
KVGEN_NVFP4_HD void e2m1x8_to_bf16x2(uint32_t w, uint32_t (&out)[4]) {
  const uint32_t w4 = w << 4;
  const uint32_t even = (w & 0x07070707u) * 0x11u;         // byte j: m_2j in both nibbles
  const uint32_t odd = ((w >> 4) & 0x07070707u) * 0x11u;   // byte j: m_2j+1 in both nibbles
#define KVGEN_NVFP4_BF16_WORD(J)                                                              \
  do {                                                                                        \
    const uint32_t sel = byte_perm(even, odd, kPick<J, 0x1010u>);                             \
    const uint32_t lo = prmt_lookup(kBF16LoLo, kBF16LoHi, sel);                               \
    const uint32_t hi = prmt_lookup(kBF16HiLo, kBF16HiHi, sel);                               \
    out[J] = ((hi & 0xFF00FF00u) | (lo & 0x00FF00FFu)) | pair_signs<J>(w, w4);                \
  } while (0)
  KVGEN_NVFP4_BF16_WORD(0);
  KVGEN_NVFP4_BF16_WORD(1);
  KVGEN_NVFP4_BF16_WORD(2);
  KVGEN_NVFP4_BF16_WORD(3);
#undef KVGEN_NVFP4_BF16_WORD
}

// Both halves of a scale byte as exact fp16 (one cvt.f16x2.e4m3x2 on sm_89+) and as exact bf16.
KVGEN_NVFP4_HD uint32_t e4m3_scale_f16x2(uint32_t sb) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(sb * 0x101u), __NV_E4M3);
  return (uint32_t)h.x | ((uint32_t)h.y << 16);
}

// Through fp16 (every E4M3 value is an fp16 and a bf16): cvt, widen, F2FP instead of
// e4m3_to_f32's branches.  A NaN scale gives some NaN here, overridden by the caller.
KVGEN_NVFP4_HD uint32_t e4m3_scale_bf16x2(uint32_t sb) {
  const float s = __half2float(__ushort_as_half((uint16_t)(e4m3_scale_f16x2(sb) & 0xFFFFu)));
  return (uint32_t)__bfloat16_as_ushort(__float2bfloat16_rn(s)) * 0x10001u;
}

// a * b + (-0) on two fp16 / bf16 lanes (exact here, see above).  Host: each lane in binary32,
// rounded to the lane type, which is the same exact product.
KVGEN_NVFP4_HD uint32_t mul_f16x2(uint32_t a, uint32_t b) {
#if defined(__CUDA_ARCH__)
  uint32_t r;
  asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(0x80008000u));
  return r;
#else
  uint32_t r = 0;
  for (int k = 0; k < 2; ++k) {
    const float x = __half2float(__ushort_as_half((uint16_t)(a >> (16 * k))));
    const float y = __half2float(__ushort_as_half((uint16_t)(b >> (16 * k))));
    r |= (uint32_t)__half_as_ushort(__float2half_rn(mul_rn(x, y))) << (16 * k);
  }
  return r;
#endif
}

KVGEN_NVFP4_HD uint32_t mul_bf16x2(uint32_t a, uint32_t b) {
#if defined(__CUDA_ARCH__)
  uint32_t r;
  asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(0x80008000u));
  return r;
#else
  uint32_t r = 0;
  for (int k = 0; k < 2; ++k) {
    const float x = bits_f32((a >> (16 * k)) << 16);
    const float y = bits_f32((b >> (16 * k)) << 16);
    r |= (uint32_t)__bfloat16_as_ushort(__float2bfloat16_rn(mul_rn(x, y))) << (16 * k);
  }
  return r;
#endif
}

KVGEN_NVFP4_HD bool e4m3_is_nan(uint32_t sb) { return (sb & 0x7Fu) == 0x7Fu; }

// Words 4w .. 4w+3 of an 8-word array, as an array of 4 (one packed word's pairs).
KVGEN_NVFP4_HD uint32_t (&quarter_words(uint32_t (&out)[8], int w))[4] {
  return *reinterpret_cast<uint32_t(*)[4]>(out + 4 * w);
}

// The exact fp16 products of one packed word (8 codes) and an fp16x2 scale, unpinned.
KVGEN_NVFP4_HD void f16_word_products(uint32_t packed, uint32_t scale, uint32_t (&out)[4]) {
  uint32_t v[4];
  e2m1x8_to_f16x2(packed, v);
#pragma unroll
  for (int j = 0; j < 4; ++j) out[j] = mul_f16x2(v[j], scale);
}

// The exact fp16 products of one block (Q == 1), unpinned: word i holds elements 2i, 2i+1.
KVGEN_NVFP4_HD void f16_products(const Block& blk, uint32_t (&out)[8]) {
  const uint32_t scale = e4m3_scale_f16x2(blk.scale);
#pragma unroll
  for (int w = 0; w < 2; ++w) f16_word_products(blk.packed[w], scale, quarter_words(out, w));
}

// One block (Q == 1) to 8 words of fp16 pairs (word i: elements 2i, 2i+1).
KVGEN_NVFP4_HD void decode_block_f16_lut(const Block& blk, uint32_t (&out)[8]) {
  f16_products(blk, out);
  const bool nan = e4m3_is_nan(blk.scale);
#pragma unroll
  for (int i = 0; i < 8; ++i) out[i] = nan ? (uint32_t)kFP16NaN * 0x10001u : out[i];
}

// Half a block (one packed word: 8 codes, elements 2j, 2j+1 in word j of out) to bf16 pairs.
KVGEN_NVFP4_HD void decode_word_bf16_lut(uint32_t packed, uint8_t scale_byte, uint32_t (&out)[4]) {
  const uint32_t scale = e4m3_scale_bf16x2(scale_byte);
  const bool nan = e4m3_is_nan(scale_byte);
  uint32_t v[4];
  e2m1x8_to_bf16x2(packed, v);
#pragma unroll
  for (int j = 0; j < 4; ++j) out[j] = nan ? (uint32_t)kBF16NaN * 0x10001u : mul_bf16x2(v[j], scale);
}

// The same to fp16 pairs.
KVGEN_NVFP4_HD void decode_word_f16_lut(uint32_t packed, uint8_t scale_byte, uint32_t (&out)[4]) {
  f16_word_products(packed, e4m3_scale_f16x2(scale_byte), out);
  const bool nan = e4m3_is_nan(scale_byte);
#pragma unroll
  for (int j = 0; j < 4; ++j) out[j] = nan ? (uint32_t)kFP16NaN * 0x10001u : out[j];
}

KVGEN_NVFP4_HD void decode_block_bf16_lut(const Block& blk, uint32_t (&out)[8]) {
#pragma unroll
  for (int w = 0; w < 2; ++w) decode_word_bf16_lut(blk.packed[w], blk.scale, quarter_words(out, w));
}

// FP8 E4M3 hot bytes (word i: elements 4i..4i+3): the exact fp16 products rounded by the packed
// satfinite cvt (cvt.rn.satfinite.e4m3x2.f16x2 on sm_89+, NVIDIA's host model elsewhere).
KVGEN_NVFP4_HD void decode_block_fp8_lut(const Block& blk, uint32_t (&out)[4]) {
  uint32_t h[8];
  f16_products(blk, h);
  const bool nan = e4m3_is_nan(blk.scale);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    uint32_t pair[2];
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      __half2_raw r;
      r.x = (unsigned short)(h[2 * i + k] & 0xFFFFu);
      r.y = (unsigned short)(h[2 * i + k] >> 16);
      pair[k] = __nv_cvt_halfraw2_to_fp8x2(r, __NV_SATFINITE, __NV_E4M3);
    }
    out[i] = nan ? (uint32_t)kE4M3NaN * 0x01010101u : pair[0] | (pair[1] << 16);
  }
}

}  // namespace nvfp4
}  // namespace kvgen

#undef KVGEN_NVFP4_HD
