"""Block-level NVFP4 oracle: the single source of semantics for kvgen's cold-page arithmetic.

This module is the executable form of ``COLD_PAGE_FORMAT.md`` section 3 ("Arithmetic").
Every generated kernel (CUDA, Triton, CuTe DSL, on any GPU) must reproduce its bytes bit for bit,
and ``kvgen/kernels/cuda/nvfp4.cuh`` is tested against it.  It is written for readability, not speed:
plain PyTorch on CPU or CUDA tensors, each step one binary32 operation.

Why the code looks the way it does:

* Every arithmetic step of the contract is one IEEE binary32 operation rounded on its own.  We
  only ever combine two float32 *tensors* with ``*``, ``/``, ``-``, ``+`` (each is a separate
  kernel, so nothing can be fused into an FMA), and we turn ``G``/``Q`` into float32 tensors
  first, so no Python double ever takes part in the arithmetic.
* Rounding to the narrow formats (E4M3, E2M1) is written as "nearest value in a table, ties to
  the even code" and compared against the exact midpoints in float64 (every value involved is
  exact there), so it does not share code, or bugs, with the bit-trick implementation in
  ``nvfp4.cuh`` that the tests compare it with.
* NaN results of the final rounding to a hot dtype are canonical (positive, all mantissa bits
  set as NVIDIA GPUs write them: bf16 ``0x7FFF``, fp16 ``0x7FFF``, fp8 ``0x7F``), because the
  sign of a NaN produced by e.g. ``inf - inf`` differs between x86 and GPUs, and bit-exactness
  must not depend on it.

Contract points that COLD_PAGE_FORMAT.md leaves open, as this module decides them:

* ``e4m3_from_f32`` is used for the scale (inputs >= 0) and for the FP8 hot rounding.  For any
  input it rounds to nearest even and saturates at +-448 (also +-Inf); NaN gives ``0x7F``;
  negative inputs keep their sign, so a negative value that rounds to zero gives ``0x80`` (-0),
  as IEEE-style rounding of FP8 hot values does.
* ``G`` and ``Q`` are binary32 by contract; Python floats are rounded to the nearest binary32
  before use (``G=0.37`` means ``fl32(0.37)``).
* The float32 decode results (``decode_blocks*``) are plain IEEE results; a NaN there (only
  possible with extreme ``Q``, e.g. ``inf + -inf`` in 2FP4) has no specified sign or payload.
  Only the hot-dtype rounding pins NaN bits.
* Bytes the encoder never writes decode without faulting: scale 0x7F/0xFF gives NaN, code 0x8
  gives -0.0.
* Section 4 calls a scale of 2^-7 "a normal E4M3 value"; in E4M3FN it is subnormal (the smallest
  normal is 2^-6).  The no-drift property does hold from 2^-7 up (the block maximum then always
  lands on code 7), and can fail at 2^-8 and 2^-9; tests use the 2^-7 threshold as written.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "SIXTH",
    "SIXTH_BITS",
    "E2M1_MAGNITUDES",
    "HOT_DTYPES",
    "e4m3_from_f32",
    "e4m3_to_f32",
    "e2m1_from_f32",
    "e2m1_to_f32",
    "encode_blocks",
    "decode_blocks",
    "encode_blocks_2fp4",
    "decode_blocks_2fp4",
    "round_to_hot",
    "hot_to_f32",
    "pack_nibbles",
    "unpack_nibbles",
]

BLOCK = 16

# fl32(1/6) = 0x3E2AAAAB.  (1/6 in binary is 0.0010101..., far from a rounding tie, so rounding
# the Python double to float32 gives the same value as rounding the real number once.)
SIXTH_BITS = 0x3E2AAAAB
SIXTH = float(torch.tensor(1.0 / 6.0, dtype=torch.float32))

# E2M1 magnitudes by code 0..7; bit 3 of a nibble is the sign.
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)

E4M3_MAX = 448.0
E4M3_NAN = 0x7F

HOT_DTYPES = {
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp8_e4m3": torch.float8_e4m3fn,
}
# Canonical NaN bit patterns of the final rounding (what NVIDIA's cvt instructions write).
_HOT_NAN_BITS = {"bf16": 0x7FFF, "fp16": 0x7FFF, "fp8_e4m3": E4M3_NAN}
_HOT_INT_VIEW = {"bf16": torch.int16, "fp16": torch.int16, "fp8_e4m3": torch.uint8}


# --------------------------------------------------------------------------------------------
# Small helpers
# --------------------------------------------------------------------------------------------


def _f32(value: float | Tensor, device) -> Tensor:
    """Config values (G, Q) enter the arithmetic only as binary32 tensors.

    A Python float becomes a 0-d tensor (rounded once to binary32); a tensor (one value per
    block, broadcastable to the block shape ``x.shape[:-1]``) is converted to float32 as is."""
    if isinstance(value, Tensor):
        return value.to(device=device, dtype=torch.float32)
    return torch.tensor(value, dtype=torch.float32, device=device)


def _check_no_ftz(device) -> None:
    # The contract forbids flushing subnormals; torch.set_flush_denormal(True) would silently
    # break the oracle on CPU, so refuse to run under it.
    tiny = torch.tensor(1.0e-45, dtype=torch.float32, device=device)  # smallest subnormal
    if (tiny * 1.0).item() == 0.0:
        raise RuntimeError("kvgen.reference.nvfp4 needs subnormals: flush-to-zero is enabled")


def _round_to_table(a: Tensor, table: Tensor) -> Tensor:
    """Index of the nearest entry of ``table`` to ``a``, ties to the even index.

    ``table`` is ascending and its index *is* the code (E4M3 byte, E2M1 magnitude code), so
    "ties to the even index" is exactly "ties to even".  Values above the last entry saturate to
    it.  Both arguments are float64, where the midpoints of neighbouring table values and every
    float32 input are exact, so the comparisons below are exact.  ``a`` must be >= 0 and not NaN.
    """
    last = table.numel() - 1
    hi = torch.searchsorted(table, a).clamp(max=last)  # first entry >= a (or the last one)
    lo = (hi - 1).clamp(min=0)
    mid = (table[lo] + table[hi]) / 2  # exact in float64
    take_hi = (a > mid) | ((a == mid) & (hi % 2 == 0))
    return torch.where(take_hi, hi, lo)


# --------------------------------------------------------------------------------------------
# E4M3 (OCP E4M3FN: bias 7, no infinities, 0x7F / 0xFF are NaN, max 448)
# --------------------------------------------------------------------------------------------


def e4m3_to_f32(b: Tensor) -> Tensor:
    """Value of E4M3FN bytes as float32 (exact); 0x7F and 0xFF are NaN."""
    b = b.to(torch.int32)
    sign = (b >> 7) & 1
    exp = (b >> 3) & 0xF
    man = (b & 7).to(torch.float32)
    # exp == 0: subnormal man * 2^-9; else (1 + man/8) * 2^(exp-7).  The powers of two come
    # from a table built in Python (torch.pow may be inexact); every product here is exact.
    pow2 = torch.tensor([2.0 ** (e - 7) for e in range(16)], dtype=torch.float32, device=b.device)
    sub = man * 2.0**-9
    norm = (1.0 + man / 8.0) * pow2[exp.to(torch.int64)]
    mag = torch.where(exp == 0, sub, norm)
    mag = torch.where((b & 0x7F) == 0x7F, torch.full_like(mag, float("nan")), mag)
    return torch.where(sign == 1, -mag, mag)


def _e4m3_table(device) -> Tensor:
    # Every finite non-negative E4M3 value, indexed by its byte 0x00..0x7E (ascending).
    return e4m3_to_f32(torch.arange(0x7F, dtype=torch.uint8, device=device)).double()


def e4m3_from_f32(s: Tensor) -> Tensor:
    """Round float32 to E4M3FN bytes: nearest, ties to even, saturating at +-448, never NaN
    for non-NaN input.

    ``s <= 2^-10`` gives 0 (2^-10 is the midpoint between 0 and 2^-9 and goes to the even code 0).
    +-Inf saturates to +-448 (0x7E / 0xFE).  NaN gives 0x7F.  The sign is kept, so -0.0 and
    negative values that round to zero give 0x80.
    """
    s = s.to(torch.float32)
    code = _round_to_table(s.abs().double(), _e4m3_table(s.device))
    code = code.to(torch.uint8) | (torch.signbit(s).to(torch.uint8) << 7)
    return torch.where(torch.isnan(s), torch.full_like(code, E4M3_NAN), code)


# --------------------------------------------------------------------------------------------
# E2M1 (FP4: 1 sign, 2 exponent, 1 mantissa bit; magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6)
# --------------------------------------------------------------------------------------------


def e2m1_to_f32(codes: Tensor) -> Tensor:
    """Value of E2M1 nibble codes (low 4 bits of each byte) as float32; code 8 is -0.0."""
    codes = codes.to(torch.int64)
    mags = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float32, device=codes.device)
    mag = mags[codes & 7]
    return torch.where((codes & 8) != 0, -mag, mag)


def e2m1_from_f32(v: Tensor) -> Tensor:
    """Round float32 to E2M1 nibble codes 0..15: nearest magnitude, ties to the even code,
    saturating at +-6.

    As values: 0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4.  NaN -> 0x0,
    +Inf -> 0x7, -Inf -> 0xF.  A negative value that rounds to zero gives 0x0 (no -0).
    """
    v = v.to(torch.float32)
    mags = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float64, device=v.device)
    a = v.abs().double().nan_to_num(nan=0.0)  # NaN -> magnitude 0 -> code 0x0
    mag = _round_to_table(a, mags).to(torch.uint8)
    negative = torch.signbit(v) & ~torch.isnan(v) & (mag != 0)  # no negative zero
    return mag | (negative.to(torch.uint8) << 3)


# --------------------------------------------------------------------------------------------
# Block encode / decode (section 3)
# --------------------------------------------------------------------------------------------


def _check_block_shape(x: Tensor) -> None:
    if x.shape[-1] != BLOCK:
        raise ValueError(f"last dimension must be {BLOCK}, got shape {tuple(x.shape)}")


def encode_blocks(x: Tensor, G: float = 1.0, Q: float = 1.0) -> tuple[Tensor, Tensor]:
    """NVFP4-encode blocks of 16 values.

    ``x``: float tensor ``[..., 16]`` (hot values are widened exactly to float32).
    ``G``, ``Q``: binary32 multipliers; a float, or a tensor with one value per block
    (broadcastable to ``x.shape[:-1]``), e.g. to check many configurations in one call.
    Returns ``(codes uint8[..., 16], scales uint8[...])``; codes are unpacked nibbles 0..15,
    scales are E4M3 bytes.
    """
    _check_block_shape(x)
    x = x.to(torch.float32)
    dev = x.device
    _check_no_ftz(dev)
    g, q, sixth = _f32(G, dev), _f32(Q, dev), _f32(SIXTH, dev)

    # 1. amax over the finite values only (0 if none): NaN/Inf must not blow up the scale.
    finite = torch.isfinite(x)
    amax = torch.where(finite, x.abs(), torch.zeros_like(x)).amax(dim=-1)

    # 2. s = fl(fl(amax * SIXTH) * G): two separately rounded products, in this order.
    s = (amax * sixth) * g
    scales = e4m3_from_f32(s)  # s >= 0 (or +Inf), so this never sets the sign bit
    S = e4m3_to_f32(scales)

    # 3. m = fl(1 / fl(S * Q)): a true, correctly rounded float32 division (tensor / tensor,
    #    never a reciprocal approximation or a multiply by a precomputed double).
    sq = S * q
    m = torch.ones_like(sq) / sq

    # 4. code = E2M1(fl(x * m)).  With S == 0, m is Inf and the products are garbage, so the
    #    whole block is forced to code 0 (non-finite inputs included).
    codes = e2m1_from_f32(x * m.unsqueeze(-1))
    codes = torch.where((S == 0).unsqueeze(-1), torch.zeros_like(codes), codes)
    return codes, scales


def decode_blocks(codes: Tensor, scales: Tensor, Q: float = 1.0) -> Tensor:
    """Decode NVFP4 blocks to float32: ``y = fl(fl(e2m1(code) * S) * Q)`` (no hot rounding).

    ``codes``: uint8 ``[..., 16]`` nibble codes; ``scales``: uint8 ``[...]`` E4M3 bytes.
    """
    _check_block_shape(codes)
    dev = codes.device
    _check_no_ftz(dev)
    S = e4m3_to_f32(scales).unsqueeze(-1)
    return (e2m1_to_f32(codes) * S) * _f32(Q, dev).unsqueeze(-1)


def encode_blocks_2fp4(
    x: Tensor, G: float = 1.0, Q: float = 1.0
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """2FP4: main NVFP4 block plus an NVFP4-encoded residual (own scale, same G and Q).

    Returns ``(codes, scales, res_codes, res_scales)``.
    """
    _check_block_shape(x)
    x = x.to(torch.float32)
    codes, scales = encode_blocks(x, G, Q)
    y = decode_blocks(codes, scales, Q)  # binary32 main decode, before any hot rounding
    # d = fl(x - y); a non-finite x has no meaningful residual, so it contributes 0.
    d = torch.where(torch.isfinite(x), x - y, torch.zeros_like(x))
    res_codes, res_scales = encode_blocks(d, G, Q)
    return codes, scales, res_codes, res_scales


def decode_blocks_2fp4(
    codes: Tensor, scales: Tensor, res_codes: Tensor, res_scales: Tensor, Q: float = 1.0
) -> Tensor:
    """2FP4 decode to float32: ``fl(y + y')`` (round to the hot dtype once, afterwards)."""
    return decode_blocks(codes, scales, Q) + decode_blocks(res_codes, res_scales, Q)


# --------------------------------------------------------------------------------------------
# Final rounding to the hot dtype, and widening back
# --------------------------------------------------------------------------------------------


def round_to_hot(y: Tensor, dtype: str) -> Tensor:
    """Round float32 values once to the hot dtype.

    ``"bf16"`` / ``"fp16"``: IEEE round to nearest even (overflow -> +-Inf, negative underflow
    -> -0).  ``"fp8_e4m3"``: nearest even, saturating at +-448 (torch's own float8 cast does
    not saturate: it gives NaN above 464, so we round with ``e4m3_from_f32`` instead).
    NaN gives the canonical NaN of the dtype (see module docstring).
    Returns a tensor of torch.bfloat16 / torch.float16 / torch.float8_e4m3fn.
    """
    if dtype not in HOT_DTYPES:
        raise ValueError(f"hot dtype must be one of {sorted(HOT_DTYPES)}, got {dtype!r}")
    y = y.to(torch.float32)
    if dtype == "fp8_e4m3":
        bits = e4m3_from_f32(y)
    else:
        # torch's float32 -> bf16/fp16 casts are IEEE round-to-nearest-even (checked against
        # the CUDA headers' conversions in tests/test_nvfp4_block.py).
        bits = y.to(HOT_DTYPES[dtype]).view(torch.int16)
    nan_bits = torch.tensor(_HOT_NAN_BITS[dtype], dtype=torch.int32).to(_HOT_INT_VIEW[dtype])
    bits = torch.where(torch.isnan(y), nan_bits.to(y.device), bits)
    return bits.view(HOT_DTYPES[dtype])


def hot_to_f32(x: Tensor) -> Tensor:
    """Widen bf16 / fp16 / fp8_e4m3 (or float32) exactly to float32."""
    if x.dtype == torch.float8_e4m3fn:
        # Same value as torch's cast, but from the single E4M3 definition above.
        return e4m3_to_f32(x.view(torch.uint8))
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"not a hot dtype: {x.dtype}")
    return x.to(torch.float32)  # every bf16 / fp16 value is exact in float32


# --------------------------------------------------------------------------------------------
# Nibble packing (section 2: element e in byte e/2, even e in the low nibble)
# --------------------------------------------------------------------------------------------


def pack_nibbles(codes: Tensor) -> Tensor:
    """Pack nibble codes ``uint8[..., n]`` (n even) into ``uint8[..., n/2]``: even element in
    the low nibble, odd element in the high nibble."""
    if codes.shape[-1] % 2:
        raise ValueError("the last dimension must be even to pack nibbles")
    codes = codes.to(torch.uint8)
    return (codes[..., 0::2] & 0xF) | ((codes[..., 1::2] & 0xF) << 4)


def unpack_nibbles(packed: Tensor) -> Tensor:
    """Inverse of ``pack_nibbles``: ``uint8[..., m]`` -> ``uint8[..., 2m]``."""
    packed = packed.to(torch.uint8)
    low, high = packed & 0xF, packed >> 4
    return torch.stack((low, high), dim=-1).flatten(-2)
