// Scalar arithmetic of the op, shared by the CPU handler (g++) and the CUDA kernel (NVRTC).
//
// Every rounding here is defined bit for bit so that all implementations and the numpy
// reference (jax_rope_cache/reference.py, whose docstring is the contract) agree exactly:
//   * conversions f32 -> bf16 / f16 / fp8 round to nearest, ties to even; subnormals are kept;
//   * every NaN a conversion writes is the canonical quiet NaN (positive, all mantissa bits set):
//     bf16/f16 0x7fff, f32 0x7fffffff (rc_canonical_f32), e4m3fn 0x7f, e4m3fnuz 0x80, e5m2 0x7f;
//   * fp8 stores saturate to the largest finite value (never NaN from overflow);
//   * products and sums are separate f32 operations (no FMA contraction: the CPU build uses
//     -ffp-contract=off, the CUDA kernel calls the _rn intrinsics through rc_mul/rc_add/rc_sub);
//     the one fused operation is rc_fma, used by the "fused" native arithmetic only.
// No standard headers: NVRTC compiles this file as is.
#pragma once

#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
#define RC_FN __host__ __device__ __forceinline__
#else
#define RC_FN static inline
#endif

typedef unsigned char rc_u8;
typedef unsigned short rc_u16;
typedef unsigned int rc_u32;
typedef int rc_i32;
typedef long long rc_i64;

// Element codes shared with the Python side (jax_rope_cache/_spec.py: DTYPE_CODES).
enum RcDtype {
  RC_F32 = 0,
  RC_BF16 = 1,
  RC_F16 = 2,
  RC_FP8_E4M3FN = 3,
  RC_FP8_E4M3FNUZ = 4,
  RC_FP8_E5M2 = 5,
};

// Cache layouts (jax_rope_cache/contract.py: LAYOUT_TABLE, the codes). RC_HEAD_MAJOR's caches lead
// with KH (its blocks per layer are not the caches' leading dim); RC_KV_MERGED holds K and V in the
// key cache (K head h at 2h, V head h at 2h + 1), its value_cache operand a placeholder never touched.
enum RcLayout { RC_FLASH = 0, RC_XPACKED = 1, RC_XPACKED_SHUFFLED = 2, RC_HND = 3, RC_HEAD_MAJOR = 4, RC_KV_MERGED = 5 };

RC_FN rc_u32 rc_f32_bits(float f) {
#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
  return __float_as_uint(f);
#else
  rc_u32 u;
  __builtin_memcpy(&u, &f, 4);
  return u;
#endif
}

RC_FN float rc_bits_f32(rc_u32 u) {
#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
  return __uint_as_float(u);
#else
  float f;
  __builtin_memcpy(&f, &u, 4);
  return f;
#endif
}

#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
RC_FN float rc_mul(float a, float b) { return __fmul_rn(a, b); }
RC_FN float rc_add(float a, float b) { return __fadd_rn(a, b); }
RC_FN float rc_sub(float a, float b) { return __fsub_rn(a, b); }
RC_FN float rc_fma(float a, float b, float c) { return __fmaf_rn(a, b, c); }
RC_FN float rc_recip(float a) { return __frcp_rn(a); }
RC_FN float rc_div(float a, float b) { return __fdiv_rn(a, b); }
RC_FN float rc_sqrt(float a) { return __fsqrt_rn(a); }
#else
RC_FN float rc_mul(float a, float b) { return a * b; }
RC_FN float rc_add(float a, float b) { return a + b; }
RC_FN float rc_sub(float a, float b) { return a - b; }
// One rounding: the FMA instruction where the target has it, else libm's correctly rounded fmaf.
RC_FN float rc_fma(float a, float b, float c) { return __builtin_fmaf(a, b, c); }
RC_FN float rc_recip(float a) { return 1.0f / a; }
RC_FN float rc_div(float a, float b) { return a / b; }
RC_FN float rc_sqrt(float a) { return __builtin_sqrtf(a); }  // IEEE: correctly rounded
#endif

RC_FN bool rc_is_nan(float f) { return (rc_f32_bits(f) & 0x7fffffffu) > 0x7f800000u; }

// f32 results as stored: NaN becomes the canonical 0x7fffffff (x86 would keep payloads and write
// 0xffc00000 for 0 * inf; NVIDIA's f32 arithmetic already gives 0x7fffffff).
RC_FN float rc_canonical_f32(float f) { return rc_is_nan(f) ? rc_bits_f32(0x7fffffffu) : f; }

// ---- bfloat16 -------------------------------------------------------------------------------
RC_FN float rc_bf16_to_f32(rc_u16 h) { return rc_bits_f32((rc_u32)h << 16); }

// Branch-free (a select) so that host compilers vectorise loops around it. NaN -> 0x7fff, the
// pattern of cvt.rn.bf16.f32 on NVIDIA and of Triton's conversion.
RC_FN rc_u16 rc_f32_to_bf16(float f) {
#ifdef RC_HW_CVT  // CUDA sm_80+ (rope_cache.cu): the same bits for every non-NaN f; NaN -> 0x7FFF
  rc_u16 h;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return h;
#else
  const rc_u32 u = rc_f32_bits(f);
  const rc_u32 rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  return (rc_u16)((u & 0x7fffffffu) > 0x7f800000u ? 0x7fffu : rounded);
#endif
}

// ---- float16 --------------------------------------------------------------------------------
RC_FN float rc_f16_to_f32(rc_u16 h) {
  rc_u32 sign = (rc_u32)(h & 0x8000u) << 16;
  rc_u32 exp = (h >> 10) & 0x1fu;
  rc_u32 man = h & 0x3ffu;
  if (exp == 0x1fu) return rc_bits_f32(sign | 0x7f800000u | (man << 13));
  if (exp == 0) {  // zero or subnormal: man * 2^-24, exact in f32
    float v = (float)man * rc_bits_f32(0x33800000u);
    return rc_bits_f32(sign | rc_f32_bits(v));
  }
  return rc_bits_f32(sign | ((exp + 112u) << 23) | (man << 13));
}

// Rounds m >> shift to nearest, ties to even (shift in [1, 31]).
RC_FN rc_u32 rc_shift_rne(rc_u32 m, rc_u32 shift) {
  rc_u32 kept = m >> shift;
  rc_u32 rem = m & ((1u << shift) - 1u);
  rc_u32 half = 1u << (shift - 1u);
  if (rem > half || (rem == half && (kept & 1u))) kept += 1u;
  return kept;
}

RC_FN rc_u16 rc_f32_to_f16(float f) {
#ifdef RC_HW_CVT  // CUDA sm_80+ (rope_cache.cu): the same bits for every non-NaN f; NaN -> 0x7FFF
  rc_u16 h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return h;
#else
  rc_u32 x = rc_f32_bits(f);
  rc_u16 sign = (rc_u16)((x >> 16) & 0x8000u);
  x &= 0x7fffffffu;
  if (x > 0x7f800000u) return (rc_u16)0x7fffu;  // NaN: the canonical pattern
  if (x >= 0x477ff000u) return (rc_u16)(sign | 0x7c00u);  // >= 65520 rounds to inf
  if (x >= 0x38800000u) {  // normal half: rebias exponent 127 -> 15, keep 10 mantissa bits
    return (rc_u16)(sign | rc_shift_rne(x - 0x38000000u, 13));
  }
  if (x <= 0x33000000u) return sign;  // <= 2^-25: rounds to zero (tie goes to even 0)
  rc_u32 e = x >> 23;                 // subnormal half: k * 2^-24
  rc_u32 m = (x & 0x7fffffu) | 0x800000u;
  return (rc_u16)(sign | rc_shift_rne(m, 126u - e));
#endif
}

// ---- f32 -> 8-bit floats -----------------------------------------------------------------------
// f32 -> a float of M mantissa bits and exponent bias B (e4m3fn, e4m3fnuz, e5m2): round to nearest,
// ties to even, saturating to max_code (inf included); NaN -> nan_code; fnuz: no negative zero.
// Written without branches (selects only): a one-token decode block runs it on its latency chain,
// and the branchy form was 4x the instructions. Normal results round the rebiased f32 bits in
// integer arithmetic. A subnormal one (|x| < 2^(1-B)) is k * 2^(1-B-M): adding 2^(23+1-B-M) to |x|
// rounds |x| to that step (IEEE: to nearest, ties to even) and leaves k in the sum's low mantissa
// bits; k = 2^M, where it rounds up, is the smallest normal's code.
RC_FN rc_u8 rc_f32_to_f8(float f, rc_u32 M, rc_u32 B, rc_u32 max_code, rc_u32 nan_code, bool fnuz) {
  const rc_u32 x = rc_f32_bits(f), sign = (x >> 24) & 0x80u, a = x & 0x7fffffffu;
  const bool is_sub = a < ((128u - B) << 23);
  const rc_u32 magic = (127u + 23u + 1u - B - M) << 23;
  const rc_u32 sub = rc_f32_bits(rc_add(rc_bits_f32(is_sub ? a : 0u), rc_bits_f32(magic))) - magic;
  const rc_u32 shift = 23u - M, rebased = a - ((127u - B) << 23);  // wraps below the normal range: unused there
  rc_u32 code = is_sub ? sub : (rebased + ((1u << (shift - 1u)) - 1u) + ((rebased >> shift) & 1u)) >> shift;
  code = code > max_code ? max_code : code;
  const rc_u32 out = (fnuz && code == 0u) ? 0u : (sign | code);
  return (rc_u8)(a > 0x7f800000u ? nan_code : out);
}

#if defined(RC_HW_CVT) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
#define RC_HW_CVT_FP8 1
// sm_89+: one cvt.rn.satfinite instruction per value for e4m3fn and e5m2 (no e4m3fnuz form). It
// rounds to nearest even and saturates (inf included) as rc_f32_to_f8 does; NaN is selected after
// it, so the canonical pattern does not rest on the instruction's. Equal to rc_f32_to_f8 on all
// 2^32 inputs (checked on the GPU by tests/test_cuda_fp8_conversion.py).
RC_FN rc_u8 rc_f32_to_f8_hw(float f, bool e5m2) {
  rc_u16 h;  // {cvt(first operand), cvt(second)}: the value is the low byte
  if (e5m2) asm("cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2;" : "=h"(h) : "f"(0.0f), "f"(f));
  else asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(h) : "f"(0.0f), "f"(f));
  return (rc_u8)((rc_f32_bits(f) & 0x7fffffffu) > 0x7f800000u ? 0x7fu : (h & 0xffu));
}
#endif

// ---- float8 e4m3 (fn: bias 7, max 448, NaN 0x7f/0xff; fnuz: bias 8, max 240, NaN 0x80) --------
RC_FN float rc_fp8_to_f32(rc_u8 b, bool fnuz) {
  if (fnuz && b == 0x80u) return rc_bits_f32(0x7fc00000u);
  if (!fnuz && (b & 0x7fu) == 0x7fu) return rc_bits_f32(((rc_u32)(b & 0x80u) << 24) | 0x7fc00000u);
  rc_u32 sign = (rc_u32)(b & 0x80u) << 24;
  rc_u32 exp = (b >> 3) & 0xfu;
  rc_u32 man = b & 7u;
  rc_u32 bias = fnuz ? 8u : 7u;
  if (exp == 0) {  // subnormal: man * 2^(1 - bias - 3)
    float v = (float)man * rc_bits_f32((127u + 1u - bias - 3u) << 23);
    return rc_bits_f32(sign | rc_f32_bits(v));
  }
  return rc_bits_f32(sign | ((exp + 127u - bias) << 23) | (man << 20));
}

// f32 -> e4m3 with saturation: |x| beyond the largest finite value (inf included) stores +-max;
// NaN stores the canonical pattern (0x7f; fnuz 0x80).
RC_FN rc_u8 rc_f32_to_fp8(float f, bool fnuz) {
#ifdef RC_HW_CVT_FP8
  if (!fnuz) return rc_f32_to_f8_hw(f, false);
#endif
  return fnuz ? rc_f32_to_f8(f, 3u, 8u, 0x7fu, 0x80u, true) : rc_f32_to_f8(f, 3u, 7u, 0x7eu, 0x7fu, false);
}

RC_FN float rc_fp8_max(bool fnuz) { return fnuz ? 240.0f : 448.0f; }

// ---- float8 e5m2 (OCP / vLLM's fp8_e5m2: bias 15, 2 mantissa bits, max 57344 = 0x7b, inf 0x7c,
// NaN 0x7d-0x7f; the upper byte of an f16) ------------------------------------------------------
RC_FN float rc_e5m2_to_f32(rc_u8 b) { return rc_f16_to_f32((rc_u16)((rc_u16)b << 8)); }

// f32 -> e5m2 with saturation, as rc_f32_to_fp8: |x| beyond the largest finite value (inf
// included) stores +-57344 (0x7b / 0xfb), never inf; NaN stores the canonical 0x7f; -0 and
// negative values that round to zero keep the sign (0x80). Rounding to nearest even throughout.
RC_FN rc_u8 rc_f32_to_e5m2(float f) {
#ifdef RC_HW_CVT_FP8
  return rc_f32_to_f8_hw(f, true);
#else
  return rc_f32_to_f8(f, 2u, 15u, 0x7bu, 0x7fu, false);
#endif
}

// f32 -> the fp8 dtype `cdt` (RC_FP8_E4M3FN, RC_FP8_E4M3FNUZ or RC_FP8_E5M2), saturating.
RC_FN rc_u8 rc_f32_to_fp8_as(float f, RcDtype cdt) {
  return cdt == RC_FP8_E5M2 ? rc_f32_to_e5m2(f) : rc_f32_to_fp8(f, cdt == RC_FP8_E4M3FNUZ);
}

// ---- the rotation ---------------------------------------------------------------------------
// One rotary pair (a, b) with the table values of each channel:
//   a' = a*cos_a - b*sin_a,   b' = b*cos_b + a*sin_b
// computed by one of three arithmetics (`arith`, from rc_arith; jax_rope_cache/reference.py):
//   RC_ARITH_FP32 (-1): f32 products and sums, no FMA; the caller rounds once to the output dtype.
//   RC_BF16 / RC_F16 ("rounded", native with tables in the input dtype): every product rounded to
//     that dtype, the sum taken in f32 and rounded again: r(r(a*c) - r(b*s)). The results are
//     values of that dtype (rounding them again is exact).
//   RC_ARITH_FUSED ("fused", native with any other table dtype, or f32 inputs): f32 with the first
//     product fused, fma(a, cos_a, -(b*sin_a)) and fma(b, cos_b, a*sin_b); the caller rounds once
//     (and an fp8 cache quantizes these f32 values, not the rounded ones).
// Tables are never rounded to the input dtype (in "rounded" arithmetic they already are in it).
#define RC_ARITH_FP32 (-1)
#define RC_ARITH_FUSED 16

RC_FN constexpr int rc_arith(bool native, int dt, int tab_dt) {
  return !native ? RC_ARITH_FP32 : ((dt == tab_dt && (dt == RC_BF16 || dt == RC_F16)) ? dt : RC_ARITH_FUSED);
}

RC_FN float rc_round_to(float v, int dt) {
  if (dt == RC_BF16) return rc_bf16_to_f32(rc_f32_to_bf16(v));
  if (dt == RC_F16) return rc_f16_to_f32(rc_f32_to_f16(v));
  return v;
}

RC_FN void rc_rotate_pair(float a, float b, float cos_a, float sin_a, float cos_b, float sin_b,
                          int arith, float* out_a, float* out_b) {
  if (arith == RC_ARITH_FP32) {
    *out_a = rc_sub(rc_mul(a, cos_a), rc_mul(b, sin_a));
    *out_b = rc_add(rc_mul(b, cos_b), rc_mul(a, sin_b));
  } else if (arith == RC_ARITH_FUSED) {
    *out_a = rc_fma(a, cos_a, -rc_mul(b, sin_a));
    *out_b = rc_fma(b, cos_b, rc_mul(a, sin_b));
  } else {
    const int dt = arith;
    *out_a = rc_round_to(rc_sub(rc_round_to(rc_mul(a, cos_a), dt), rc_round_to(rc_mul(b, sin_a), dt)), dt);
    *out_b = rc_round_to(rc_add(rc_round_to(rc_mul(b, cos_b), dt), rc_round_to(rc_mul(a, sin_b), dt)), dt);
  }
}

// 1/scale for an fp8 cache: r32(1 / scale); an overflow to +-inf (|scale| < 2^-128, zero
// included) becomes the largest finite f32 of that sign, so 0 stays 0 and a finite input never
// turns into NaN (inf * 0); NaN stays NaN.
RC_FN float rc_inv_scale(float scale) {
  const rc_u32 u = rc_f32_bits(rc_recip(scale));
  return (u & 0x7fffffffu) == 0x7f800000u ? rc_bits_f32((u & 0x80000000u) | 0x7f7fffffu) : rc_bits_f32(u);
}

// Quantises one value for an fp8 cache of dtype `cdt` (RC_FP8_*): saturate(x * inv_scale),
// inv_scale from rc_inv_scale. `cdt` is an RcDtype so that a bool cannot be passed by mistake.
RC_FN rc_u8 rc_quantize_fp8(float x, float inv_scale, RcDtype cdt) {
  return rc_f32_to_fp8_as(rc_mul(x, inv_scale), cdt);
}

// ---- per-token scales (k_scale_cache / v_scale_cache) -------------------------------------------
// One row's scale = r32(max(amax, 1e-8f) / FP8_MAX), amax = max |y| over the row's finite values
// (NaN and +-inf left out; jax_rope_cache/reference.py). The max is exact, so any reduction order
// (a loop, a lane butterfly) gives the same bits. The row is then quantised with rc_inv_scale(scale).
RC_FN float rc_amax_step(float m, float y) {
  const float a = rc_bits_f32(rc_f32_bits(y) & 0x7fffffffu);
  return (a <= 3.40282347e38f && a > m) ? a : m;  // NaN compares false; inf is above the largest finite
}

RC_FN float rc_fp8_max_of(RcDtype cdt) {
  return cdt == RC_FP8_E5M2 ? 57344.0f : rc_fp8_max(cdt == RC_FP8_E4M3FNUZ);
}

RC_FN float rc_token_scale(float amax, RcDtype cdt) {
  return rc_div(amax > 1e-8f ? amax : 1e-8f, rc_fp8_max_of(cdt));
}

// ---- RMSNorm of one (token, head) row (Qwen3's q_norm / k_norm) --------------------
// S = tree(r32(x_i * x_i)) over the row with the pairwise halving tree of the spec
// (jax_rope_cache/reference.py):
//   tree(a[lo, lo+n)) = a[lo]                                   n == 1
//                     = tree(a[lo, lo+n/2)) + tree(a[lo+n/2, lo+n))   n even
//                     = tree(a[lo, lo+n-1)) + a[lo+n-1]               n odd
// `leaf(i)` gives a[i]; N and LO are compile-time, so the tree unrolls and its leaves are visited
// in increasing i (few partial sums live at once).
template <int LO, int N, class Leaf>
RC_FN float rc_tree_sum(const Leaf& leaf) {
  if constexpr (N == 1) {
    return leaf(LO);
  } else if constexpr (N % 2 == 0) {
    return rc_add(rc_tree_sum<LO, N / 2>(leaf), rc_tree_sum<LO + N / 2, N / 2>(leaf));
  } else {
    return rc_add(rc_tree_sum<LO, N - 1>(leaf), leaf(LO + N - 1));
  }
}

// inv = r32(1 / r32(sqrt(r32(r32(S / d) + eps)))): correctly rounded division, sqrt and
// reciprocal (never a hardware rsqrt approximation). For d a power of two, S * (1/d) is the same
// number: 1/d is exact and both round the exact quotient once (a multiply is ~20 instructions
// shorter than the division sequence on GPUs).
RC_FN float rc_rms_inv(float sum_sq, int d, float eps) {
  const float ms = (d & (d - 1)) == 0 ? rc_mul(sum_sq, 1.0f / (float)d) : rc_div(sum_sq, (float)d);
  return rc_recip(rc_sqrt(rc_add(ms, eps)));
}

// ---- multimodal RoPE (M-RoPE) ---------------------------------------------------------------------
// Modes of the position streams (jax_rope_cache/contract.py: KernelCodes.mrope): off (positions [T]),
// contiguous sections (Qwen2-VL / Qwen2.5-VL) or interleaved (Qwen3-VL); positions [3, T] otherwise.
enum RcMrope { RC_MROPE_OFF = 0, RC_MROPE_SECTIONS = 1, RC_MROPE_INTERLEAVED = 2 };

// The stream (0 temporal, 1 height, 2 width) whose position drives rotary frequency i, for
// sections (t, h, w) with t + h + w = R/2 (contract.mrope_stream):
//   sections:    i < t -> 0, i < t + h -> 1, else 2
//   interleaved: i % 3 == 1 and i < 3h -> 1, i % 3 == 2 and i < 3w -> 2, else 0
RC_FN constexpr int rc_mrope_stream(rc_i64 i, int mode, rc_i64 t, rc_i64 h, rc_i64 w) {
  return mode == RC_MROPE_INTERLEAVED
             ? ((i % 3 == 1 && i < 3 * h) ? 1 : ((i % 3 == 2 && i < 3 * w) ? 2 : 0))
             : (i < t ? 0 : (i < t + h ? 1 : 2));
}

// ---- model-family QK-norms (jax_rope_cache/reference.py: rms_norm) ----------------------------------
// Norm types of the CPU handler's norm_type attribute (contract.NORM_TYPES order).
enum RcNormType { RC_NORM_RMS = 0, RC_NORM_GEMMA = 1, RC_NORM_WEIGHTLESS = 2 };

// Gemma: r32(r32(x * inv) * r32(1 + w)); the caller rounds once to the input dtype.
RC_FN float rc_norm_gemma(float x, float inv, float w) { return rc_mul(rc_mul(x, inv), rc_add(1.0f, w)); }

// Weightless (Llama 4's L2 norm on q and k): r32(x * inv); the caller rounds once.
RC_FN float rc_norm_weightless(float x, float inv) { return rc_mul(x, inv); }

// ---- low-bit caches: int8 and int4 per (token, KV head) ---------------------------------------------
// Cache codes next to RcDtype's (an int8 cache is int8; an int4 cache is uint8 bytes of two values).
// Each (token, KV head) row y[0..D) gets scale = r32(max(amax, 1e-8f) / Q) (amax: rc_amax_step over
// the row; Q = 127 for int8, 7 for int4), inv = rc_inv_scale(scale), and every value is stored as
// round_half_even(clamp(r32(y * inv), -Q, Q)), NaN as 0 (jax_rope_cache/reference.py: quantize_rows).
// int4 packs channels 2j (low nibble) and 2j + 1 (high nibble) of a row into byte j, two's complement.
enum RcLowBitDtype { RC_INT8 = 6, RC_INT4 = 7 };

RC_FN float rc_low_bit_max(bool int4) { return int4 ? 7.0f : 127.0f; }

RC_FN float rc_low_bit_scale(float amax, bool int4) {
  return rc_div(amax > 1e-8f ? amax : 1e-8f, rc_low_bit_max(int4));
}

// One value: clamping before rounding gives the same integer as after (the bounds are integers), and
// inside [-127, 127] adding and subtracting 1.5 * 2^23 rounds to an integer, ties to even (IEEE
// round to nearest), in any compiler's f32 arithmetic. +-inf saturates; NaN compares false: 0.
RC_FN rc_i32 rc_quantize_int(float y, float inv_scale, float qmax) {
  const float x = rc_mul(y, inv_scale);
  const float c = x > qmax ? qmax : (x < -qmax ? -qmax : (x == x ? x : 0.0f));
  return (rc_i32)rc_sub(rc_add(c, 12582912.0f), 12582912.0f);
}

// Channels 2j (even) and 2j + 1 (odd) of a row, each in [-8, 7], as int4 byte j.
RC_FN rc_u8 rc_pack_int4(rc_i32 even, rc_i32 odd) {
  return (rc_u8)(((rc_u32)even & 0xfu) | (((rc_u32)odd & 0xfu) << 4));
}

// The signed value of nibble `high` (0: the even channel, 1: the odd one) of an int4 byte.
RC_FN rc_i32 rc_unpack_int4(rc_u8 b, int high) {
  const rc_i32 n = (rc_i32)((b >> (high ? 4 : 0)) & 0xfu);
  return n >= 8 ? n - 16 : n;
}
