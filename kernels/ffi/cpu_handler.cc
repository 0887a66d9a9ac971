// The op on the host: an XLA FFI handler for platform "cpu" that computes directly into the
// aliased cache buffers. Large calls split their tokens over a few threads.
//
// Bounds safety: positions are clamped to the table, a slot writes only if 0 <= slot < NB*BS,
// and every other index is derived from buffer dimensions checked at the top of the handler.
//
// Numerics: kernels/common/rope_cache_math.h (the QK-RMSNorm: NormRow below), bit-exact to
// jax_rope_cache/reference.py. The
// handler runs on XLA's threads, which compute with flush-to-zero and denormals-are-zero set;
// every thread doing the op's arithmetic switches both off for its work and restores the
// caller's mode afterwards (ScopedIeeeDenormals), so subnormals are kept as the reference keeps them.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#endif
#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
#endif

#include "kernels/common/rope_cache_math.h"
#include "kernels/ffi/dtypes.h"
#include "kernels/ffi/handlers.h"
#include "kernels/ffi/ieee_denormals.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jax_rope_cache {
namespace {

int64_t LoadIndex(const void* base, int64_t i, bool is64) {
  return is64 ? static_cast<const int64_t*>(base)[i] : static_cast<const int32_t*>(base)[i];
}

// Converts n table values starting at `start` to float32 (exactly: tables are never rounded).
void LoadRow(const void* base, int64_t start, int64_t n, int dt, float* out) {
  switch (dt) {
    case RC_BF16: {
      const uint16_t* p = static_cast<const uint16_t*>(base) + start;
      for (int64_t i = 0; i < n; ++i) out[i] = rc_bf16_to_f32(p[i]);
      break;
    }
    case RC_F16: {
      const uint16_t* p = static_cast<const uint16_t*>(base) + start;
      for (int64_t i = 0; i < n; ++i) out[i] = rc_f16_to_f32(p[i]);
      break;
    }
    default: std::memcpy(out, static_cast<const float*>(base) + start, n * sizeof(float));
  }
}

// Element access by dtype code, resolved at compile time so the inner loops inline and vectorise.
template <int DT> struct Elem;
template <> struct Elem<RC_F32> {
  using T = float;
  static float Load(T v) { return v; }
  static T Store(float v) { return rc_canonical_f32(v); }
};
template <> struct Elem<RC_BF16> {
  using T = uint16_t;
  static float Load(T v) { return rc_bf16_to_f32(v); }
  static T Store(float v) { return rc_f32_to_bf16(v); }
};
template <> struct Elem<RC_F16> {
  using T = uint16_t;
  static float Load(T v) { return rc_f16_to_f32(v); }
  static T Store(float v) { return rc_f32_to_f16(v); }
};

struct Problem {
  const void *q, *k, *v, *slots, *pos, *cos, *sin;
  void *q_out, *k_out, *kc, *vc;
  int64_t T, QH, KH, D, R, NB, BS, max_pos, width, X;
  int64_t DC;  // elements of a cache row: D, or D / 2 bytes of an int4 cache
  // Where the inputs' rows are (elements): head h of token t is q[t * q_row + h * D],
  // k[t * kv_row + k_off + h * D], v[t * kv_row + v_off + h * D]. Separate q, k, v: q_row = QH * D,
  // kv_row = KH * D, offsets 0; the fused QKV tensor [T, QH + 2 KH, D] in all three: q_row = kv_row =
  // (QH + 2 KH) * D, k_off = QH * D, v_off = (QH + KH) * D.
  int64_t q_row, kv_row, k_off, v_off;
  int64_t q_head;  // q head h at h * q_head: D, or 2 D in gated rows (q_gate: each q head, then its gate)
  int dt, table_dt, cache_dt, layout, arith;  // arith: rc_arith(native, dt, table_dt)
  bool neox, slots64, pos64, full_table;
  const float *inv_k_scale, *inv_v_scale;  // per kv head (one scale: KH copies)
  float *k_sc, *v_sc;  // per-token scales: the scale caches of the layer ([NB, KH, BS]; head_major
                       // [KH, NB, BS]); nullptr: static scales
  const float *q_norm_w, *k_norm_w;        // the norm weights widened to f32 [D]; nullptr: no norm
  float norm_eps;
  // Model families: the norm rule (RcNormType), whether q / k are normalised (the weightless norm has
  // no weight), the norm after the rotation, and the first rotary channel (D - R at the tail).
  int norm_type;
  bool q_normed, k_normed, norm_after;
  int64_t rot_off;
  const int8_t* col_stream;  // M-RoPE: the position stream of each table column [width]; nullptr: off
  // The attention temperature of a call that does not rotate: q_out times temp[(p + 1) / floor_scale]
  // (p the clamped position; temp_n entries); nullptr: off (no temperature, or a rotating call).
  const float* temp;
  int64_t temp_n, floor_scale;
};

// Sum of a[0..n) in reference.tree_sum's order (n even: the halves, then one add; n odd: the
// first n - 1, then the last). A power-of-two n is the same tree done in place, neighbours first.
// Overwrites a.
float TreeSum(float* a, int64_t n) {
  if ((n & (n - 1)) == 0) {
    for (int64_t w = 1; w < n; w *= 2)
      for (int64_t i = 0; i + w < n; i += 2 * w) a[i] = a[i] + a[i + w];
    return a[0];
  }
  if (n % 2) return TreeSum(a, n - 1) + a[n - 1];
  return TreeSum(a, n / 2) + TreeSum(a + n / 2, n / 2);
}

// The QK-norm of one head row (reference.rms_norm), inv = 1 / sqrt(S / D + eps) with a correctly
// rounded sqrt and division (no approximate rsqrt): "rms" out = r(w * r(x * inv)), "gemma"
// r((x * inv) * (1 + w)), "weightless" r(x * inv) (w unused). `sq`: D floats of scratch.
template <int DT>
void NormRow(const typename Elem<DT>::T* __restrict x, typename Elem<DT>::T* __restrict out, const float* w,
             int64_t d, float eps, float* __restrict sq, int norm_type = RC_NORM_RMS) {
  using E = Elem<DT>;
  for (int64_t i = 0; i < d; ++i) {
    const float xf = E::Load(x[i]);
    sq[i] = xf * xf;
  }
  const float ms = TreeSum(sq, d) / static_cast<float>(d);
  const float inv = 1.0f / std::sqrt(ms + eps);
  if (norm_type == RC_NORM_GEMMA) {
    for (int64_t i = 0; i < d; ++i) out[i] = E::Store(rc_norm_gemma(E::Load(x[i]), inv, w[i]));
    return;
  }
  if (norm_type == RC_NORM_WEIGHTLESS) {
    for (int64_t i = 0; i < d; ++i) out[i] = E::Store(rc_norm_weightless(E::Load(x[i]), inv));
    return;
  }
  for (int64_t i = 0; i < d; ++i) {
    const float y = E::Load(E::Store(E::Load(x[i]) * inv));  // rounding point 1: the input dtype
    out[i] = E::Store(w[i] * y);                               // rounding point 2
  }
}

// Where one token's head h lands in each cache: K element d at
// k_base + (d / k_group) * k_group_stride + d % k_group, V element d at v_base + d * v_stride.
struct CacheRow {
  int64_t k_base, k_group, k_group_stride, v_base, v_stride;
};

CacheRow Locate(const Problem& p, int64_t blk, int64_t off, int64_t h) {
  const int64_t bs = p.BS, kh = p.KH, d = p.DC, x = p.X;  // d: the stored row's elements
  switch (p.layout) {
    case RC_FLASH: {
      const int64_t base = ((blk * bs + off) * kh + h) * d;
      return {base, d, 0, base, 1};
    }
    case RC_HND: {
      const int64_t base = ((blk * kh + h) * bs + off) * d;
      return {base, d, 0, base, 1};
    }
    case RC_HEAD_MAJOR: {
      const int64_t base = ((h * p.NB + blk) * bs + off) * d;
      return {base, d, 0, base, 1};
    }
    case RC_KV_MERGED: {  // one array (p.vc == p.kc): K row at head 2h, V row right after it
      const int64_t base = ((blk * bs + off) * 2 * kh + 2 * h) * d;
      return {base, d, 0, base + d, 1};
    }
    case RC_XPACKED:
      return {((blk * kh + h) * (d / x) * bs + off) * x, x, bs * x, (blk * kh + h) * d * bs + off, bs};
    default:
      return {((blk * kh + h) * (d / x) * bs + off) * x, x, bs * x,
              ((blk * kh + h) * (bs / x) + off / x) * d * x + off % x, x};
  }
}

// Element offset of kv head h's scale at (blk, off) in one layer's scale cache.
int64_t ScaleIndex(const Problem& p, int64_t blk, int64_t off, int64_t h) {
  if (p.layout == RC_HEAD_MAJOR) return (h * p.NB + blk) * p.BS + off;  // [KH, NB, BS]
  return (blk * p.KH + h) * p.BS + off;                                 // [NB, KH, BS]
}

// Rotates one head row x into out. With `wide` (the fp8 cache in "fused" arithmetic), also
// writes the row's f32 values before the final rounding there (channels >= R: x widened).
template <int DT, int ARITH, bool kNeox, bool kWide>
void RotateRow(const Problem& p, const typename Elem<DT>::T* __restrict x, typename Elem<DT>::T* __restrict out,
               const float* __restrict ca, const float* __restrict cb, const float* __restrict sa,
               const float* __restrict sb, float* __restrict wide) {
  using E = Elem<DT>;
  const int64_t half = p.R / 2, r0 = p.rot_off, r1 = p.rot_off + p.R;  // rotary channels [r0, r1)
  const int64_t step = kNeox ? 1 : 2, b_off = kNeox ? half : 1;
  std::memcpy(out, x, r0 * sizeof(*x));  // the tail form's leading pass-through channels
  if constexpr (kWide)
    for (int64_t d = 0; d < r0; ++d) wide[d] = E::Load(x[d]);
  for (int64_t i = 0; i < half; ++i) {
    const int64_t ia = r0 + i * step, ib = ia + b_off;
    float ya, yb;
    rc_rotate_pair(E::Load(x[ia]), E::Load(x[ib]), ca[i], sa[i], cb[i], sb[i], ARITH, &ya, &yb);
    out[ia] = E::Store(ya);
    out[ib] = E::Store(yb);
    if constexpr (kWide) wide[ia] = ya, wide[ib] = yb;
  }
  std::memcpy(out + r1, x + r1, (p.D - r1) * sizeof(*x));
  if constexpr (kWide)
    for (int64_t d = r1; d < p.D; ++d) wide[d] = E::Load(x[d]);
}

// Writes one head's K (already rotated, in the input dtype) and V into the caches. An fp8, int8 or
// int4 cache quantizes `k_wide` instead of k where given (the f32 values of "fused" arithmetic).
template <int DT, int CDT>
void WriteRow(const Problem& p, const CacheRow& at, const typename Elem<DT>::T* k, const typename Elem<DT>::T* v,
              const float* k_wide, float inv_k, float inv_v) {
  using E = Elem<DT>;
  if constexpr (CDT == DT) {
    auto* kc = static_cast<typename E::T*>(p.kc);
    auto* vc = static_cast<typename E::T*>(p.vc);
    for (int64_t d0 = 0; d0 < p.D; d0 += at.k_group)
      std::memcpy(kc + at.k_base + (d0 / at.k_group) * at.k_group_stride, k + d0, at.k_group * sizeof(*k));
    for (int64_t d = 0; d < p.D; ++d) vc[at.v_base + d * at.v_stride] = v[d];
  } else if constexpr (CDT == RC_INT8 || CDT == RC_INT4) {
    // int8: one value per byte; int4: byte j holds channels 2j (low nibble) and 2j + 1
    constexpr bool int4 = CDT == RC_INT4;
    const float qmax = rc_low_bit_max(int4);
    auto* kc = static_cast<uint8_t*>(p.kc);
    auto* vc = static_cast<uint8_t*>(p.vc);
    auto kq = [&](int64_t d) { return rc_quantize_int(k_wide ? k_wide[d] : E::Load(k[d]), inv_k, qmax); };
    auto vq = [&](int64_t d) { return rc_quantize_int(E::Load(v[d]), inv_v, qmax); };
    for (int64_t j = 0; j < p.DC; ++j) {
      const uint8_t kb = int4 ? rc_pack_int4(kq(2 * j), kq(2 * j + 1)) : static_cast<uint8_t>(kq(j));
      const uint8_t vb = int4 ? rc_pack_int4(vq(2 * j), vq(2 * j + 1)) : static_cast<uint8_t>(vq(j));
      kc[at.k_base + (j / at.k_group) * at.k_group_stride + j % at.k_group] = kb;
      vc[at.v_base + j * at.v_stride] = vb;
    }
  } else {
    constexpr RcDtype fp8 = static_cast<RcDtype>(CDT);
    auto* kc = static_cast<uint8_t*>(p.kc);
    auto* vc = static_cast<uint8_t*>(p.vc);
    for (int64_t d0 = 0; d0 < p.D; d0 += at.k_group) {
      uint8_t* dst = kc + at.k_base + (d0 / at.k_group) * at.k_group_stride;
      if (k_wide) {
        for (int64_t j = 0; j < at.k_group; ++j) dst[j] = rc_quantize_fp8(k_wide[d0 + j], inv_k, fp8);
      } else {
        for (int64_t j = 0; j < at.k_group; ++j) dst[j] = rc_quantize_fp8(E::Load(k[d0 + j]), inv_k, fp8);
      }
    }
    for (int64_t d = 0; d < p.D; ++d) vc[at.v_base + d * at.v_stride] = rc_quantize_fp8(E::Load(v[d]), inv_v, fp8);
  }
}

// x86-64: an x86-64-v3 clone (AVX2 + FMA) next to the baseline one, chosen at load time (ifunc);
// everything the loop calls is inlined into each clone (flatten). Measured: ~1.5x on the rotation
// loops. FMA is only ever used where the source asks for it (rc_fma; -ffp-contract=off); the
// baseline clone calls libm's correctly rounded fmaf there instead.
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define JRC_CPU_CLONES __attribute__((target_clones("arch=x86-64-v3", "default"), flatten, noinline))
#else
#define JRC_CPU_CLONES
#endif

template <int DT, int CDT, int ARITH, bool kNeox>
JRC_CPU_CLONES void RunTokensT(const Problem& p, int64_t t0, int64_t t1) {
  using T = typename Elem<DT>::T;
  // fp8 cache in "fused" arithmetic: quantize the f32 values, kept per k head (D floats each).
  constexpr bool kWide = ARITH == RC_ARITH_FUSED && CDT != DT;
  const int64_t half = p.R / 2;
  // Per token: the cos and sin rows as float32, then the per-pair views ca/cb/sa/sb into them.
  std::unique_ptr<float[]> table(new float[2 * p.width + 4 * half]);
  // M-RoPE: the three streams' rows of cos and sin, from which each column takes its own.
  std::unique_ptr<float[]> streams(p.col_stream ? new float[6 * p.width] : nullptr);
  std::unique_ptr<float[]> k_wide(kWide ? new float[p.KH * p.D] : nullptr);
  // The normalised row of one head (the rotation's input) and the norm's scratch.
  const bool norm = p.q_normed || p.k_normed;
  std::unique_ptr<T[]> normed(norm ? new T[p.D] : nullptr);
  std::unique_ptr<float[]> sq(norm ? new float[p.D] : nullptr);
  float *cos_row = table.get(), *sin_row = cos_row + p.width;
  float *ca = cos_row, *cb = cos_row, *sa = sin_row, *sb = sin_row;  // "half" table: both channels share
  if (p.full_table && kNeox) cb = cos_row + half, sb = sin_row + half;
  float* split = sin_row + p.width;  // GPT-J full table: de-interleave even/odd channels
  if (p.full_table && !kNeox) ca = split, cb = split + half, sa = split + 2 * half, sb = split + 3 * half;
  const T* q = static_cast<const T*>(p.q);
  const T* k = static_cast<const T*>(p.k);
  const T* v = static_cast<const T*>(p.v);
  T* q_out = static_cast<T*>(p.q_out);
  T* k_out = static_cast<T*>(p.k_out);
  for (int64_t t = t0; t < t1; ++t) {
    if (p.R == 0) {  // no rotation: the tables and positions are placeholders, never read
    } else if (p.col_stream) {  // positions [3, T]: stream s of token t at s * T + t, each clamped on its own
      float* rows = streams.get();
      for (int64_t st = 0; st < 3; ++st) {
        const int64_t row = std::clamp<int64_t>(LoadIndex(p.pos, st * p.T + t, p.pos64), 0, p.max_pos - 1) * p.width;
        LoadRow(p.cos, row, p.width, p.table_dt, rows + (2 * st) * p.width);
        LoadRow(p.sin, row, p.width, p.table_dt, rows + (2 * st + 1) * p.width);
      }
      for (int64_t c = 0; c < p.width; ++c) {
        const int64_t st = p.col_stream[c];
        cos_row[c] = rows[(2 * st) * p.width + c], sin_row[c] = rows[(2 * st + 1) * p.width + c];
      }
    } else {
      const int64_t row = std::clamp<int64_t>(LoadIndex(p.pos, t, p.pos64), 0, p.max_pos - 1) * p.width;
      LoadRow(p.cos, row, p.width, p.table_dt, cos_row);
      LoadRow(p.sin, row, p.width, p.table_dt, sin_row);
    }
    if (p.full_table && !kNeox) {
      for (int64_t i = 0; i < half; ++i) {
        ca[i] = cos_row[2 * i], cb[i] = cos_row[2 * i + 1], sa[i] = sin_row[2 * i], sb[i] = sin_row[2 * i + 1];
      }
    }
    float temp = 1.0f;  // the temperature factor of this token (calls that do not rotate)
    if (p.temp) {
      const int64_t pos = std::clamp<int64_t>(LoadIndex(p.pos, t, p.pos64), 0, p.max_pos - 1);
      temp = p.temp[std::min((pos + 1) / p.floor_scale, p.temp_n - 1)];
    }
    for (int64_t h = 0; h < p.QH; ++h) {
      const int64_t o = (t * p.QH + h) * p.D;
      const T* x = q + t * p.q_row + h * p.q_head;
      if (p.q_normed && !p.norm_after)
        NormRow<DT>(x, normed.get(), p.q_norm_w, p.D, p.norm_eps, sq.get(), p.norm_type), x = normed.get();
      RotateRow<DT, ARITH, kNeox, false>(p, x, q_out + o, ca, cb, sa, sb, nullptr);
      if (p.q_normed && p.norm_after) {  // normalise the rotated row (scratch: NormRow's rows are __restrict)
        NormRow<DT>(q_out + o, normed.get(), p.q_norm_w, p.D, p.norm_eps, sq.get(), p.norm_type);
        std::memcpy(q_out + o, normed.get(), p.D * sizeof(T));
      }
      if (p.temp)  // r(r32(q * f)), q after any norm
        for (int64_t d = 0; d < p.D; ++d) q_out[o + d] = Elem<DT>::Store(rc_mul(Elem<DT>::Load(q_out[o + d]), temp));
    }
    for (int64_t h = 0; h < p.KH; ++h) {
      const int64_t o = (t * p.KH + h) * p.D;
      const T* x = k + t * p.kv_row + p.k_off + h * p.D;
      if (p.k_normed && !p.norm_after)
        NormRow<DT>(x, normed.get(), p.k_norm_w, p.D, p.norm_eps, sq.get(), p.norm_type), x = normed.get();
      RotateRow<DT, ARITH, kNeox, kWide>(p, x, k_out + o, ca, cb, sa, sb, kWide ? k_wide.get() + h * p.D : nullptr);
      if (p.k_normed && p.norm_after) {
        NormRow<DT>(k_out + o, normed.get(), p.k_norm_w, p.D, p.norm_eps, sq.get(), p.norm_type);
        std::memcpy(k_out + o, normed.get(), p.D * sizeof(T));
      }
    }
    const int64_t slot = LoadIndex(p.slots, t, p.slots64);
    if (slot < 0 || slot >= p.NB * p.BS) continue;
    for (int64_t h = 0; h < p.KH; ++h) {
      const int64_t o = (t * p.KH + h) * p.D;
      const T* vrow = v + t * p.kv_row + p.v_off + h * p.D;
      // norm "after": the cache stores the normalised k_out, not the rotation's f32 values
      const float* kw = kWide && !p.norm_after ? k_wide.get() + h * p.D : nullptr;
      float inv_k = p.inv_k_scale[h], inv_v = p.inv_v_scale[h];
      if constexpr (CDT != DT) {
        if (p.k_sc) {  // per-token scales from the values the cache quantizes (kw, else k_out's)
          float km = 0.0f, vm = 0.0f;
          for (int64_t d = 0; d < p.D; ++d) km = rc_amax_step(km, kw ? kw[d] : Elem<DT>::Load(k_out[o + d]));
          for (int64_t d = 0; d < p.D; ++d) vm = rc_amax_step(vm, Elem<DT>::Load(vrow[d]));
          float ks, vs;
          if constexpr (CDT == RC_INT8 || CDT == RC_INT4) {
            ks = rc_low_bit_scale(km, CDT == RC_INT4), vs = rc_low_bit_scale(vm, CDT == RC_INT4);
          } else {
            ks = rc_token_scale(km, static_cast<RcDtype>(CDT)), vs = rc_token_scale(vm, static_cast<RcDtype>(CDT));
          }
          const int64_t at = ScaleIndex(p, slot / p.BS, slot % p.BS, h);
          p.k_sc[at] = ks, p.v_sc[at] = vs;
          inv_k = rc_inv_scale(ks), inv_v = rc_inv_scale(vs);
        }
      }
      WriteRow<DT, CDT>(p, Locate(p, slot / p.BS, slot % p.BS, h), k_out + o, vrow, kw, inv_k, inv_v);
    }
  }
}

template <int DT, int CDT, int ARITH>
void RunTokensStyle(const Problem& p, int64_t t0, int64_t t1) {
  if (p.neox) RunTokensT<DT, CDT, ARITH, true>(p, t0, t1);
  else RunTokensT<DT, CDT, ARITH, false>(p, t0, t1);
}

template <int DT, int CDT>
void RunTokensNative(const Problem& p, int64_t t0, int64_t t1) {
  if (p.arith == RC_ARITH_FUSED) return RunTokensStyle<DT, CDT, RC_ARITH_FUSED>(p, t0, t1);
  if constexpr (DT != RC_F32) {
    if (p.arith == DT) return RunTokensStyle<DT, CDT, DT>(p, t0, t1);  // "rounded"
  }
  RunTokensStyle<DT, CDT, RC_ARITH_FP32>(p, t0, t1);
}

template <int DT>
void RunTokensCache(const Problem& p, int64_t t0, int64_t t1) {
  switch (p.cache_dt) {
    case RC_FP8_E4M3FN: return RunTokensNative<DT, RC_FP8_E4M3FN>(p, t0, t1);
    case RC_FP8_E4M3FNUZ: return RunTokensNative<DT, RC_FP8_E4M3FNUZ>(p, t0, t1);
    case RC_FP8_E5M2: return RunTokensNative<DT, RC_FP8_E5M2>(p, t0, t1);
    case RC_INT8: return RunTokensNative<DT, RC_INT8>(p, t0, t1);
    case RC_INT4: return RunTokensNative<DT, RC_INT4>(p, t0, t1);
    default: return RunTokensNative<DT, DT>(p, t0, t1);
  }
}

// The work of one thread (the handler's own or a worker), with IEEE subnormals.
void RunTokens(const Problem& p, int64_t t0, int64_t t1) {
  ScopedIeeeDenormals ieee;
  switch (p.dt) {
    case RC_BF16: return RunTokensCache<RC_BF16>(p, t0, t1);
    case RC_F16: return RunTokensCache<RC_F16>(p, t0, t1);
    default: return RunTokensCache<RC_F32>(p, t0, t1);
  }
}

// Splits [0, T) over a few threads for large calls. XLA's FFI thread pool is not used: under the
// jaxlib CPU client its Schedule ran tasks inline (measured: CPU time == wall time), so the
// handler starts its own workers, and only when each gets enough tokens to repay the start.
void ParallelOverTokens(const Problem& p) {
  constexpr int64_t kTokensPerThread = 128;
  const int64_t hw = std::max(1u, std::thread::hardware_concurrency());
  const int64_t n = std::min(hw, std::max<int64_t>(1, p.T / kTokensPerThread));
  if (n == 1) return RunTokens(p, 0, p.T);
  std::vector<std::thread> workers;
  const int64_t per = (p.T + n - 1) / n;
  for (int64_t i = 1; i < n; ++i)
    workers.emplace_back([&p, i, per] { RunTokens(p, i * per, std::min(p.T, (i + 1) * per)); });
  RunTokens(p, 0, std::min(p.T, per));
  for (auto& w : workers) w.join();
}

// q_out/k_out are fresh allocations on every call, so a large call pays a page fault (and the
// zeroing of a page) per 4 KiB it writes: measured, twice the handler's own compute at T=4096.
// Asking for transparent huge pages over them first (advice only; contents are untouched) turns
// that into one fault per 2 MiB where the system allows THP on request.
void AdviseHugePages(void* data, size_t bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr uintptr_t kHuge = uintptr_t{2} << 20;
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(data) + kHuge - 1) & ~(kHuge - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(data) + bytes) & ~(kHuge - 1);
  if (end > begin) madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
#else
  (void)data, (void)bytes;
#endif
}

ffi::Error CheckSame(const char* what, int64_t got, int64_t want) {
  if (got == want) return ffi::Error::Success();
  return ffi::Error::InvalidArgument(std::string("rope_and_cache cpu: ") + what + ": expected " +
                                     std::to_string(want) + ", got " + std::to_string(got));
}

// rc_inv_scale of the scale operand for each of the `kh` kv heads (a single scale: kh copies; 1
// where unused). Not inlined: it must run inside the caller's ScopedIeeeDenormals, which the
// compiler does not order floating-point code against.
__attribute__((noinline)) void InverseScales(const ffi::AnyBuffer& scale, int64_t kh, float* out) {
  const int64_t n = scale.element_type() == ffi::DataType::F32 ? scale.element_count() : 0;
  const float* s = static_cast<const float*>(scale.untyped_data());
  for (int64_t h = 0; h < kh; ++h) out[h] = n < 1 ? 1.0f : rc_inv_scale(s[n == kh ? h : 0]);
}

// A norm weight widened to float32 (exactly), under the caller's ScopedIeeeDenormals.
__attribute__((noinline)) void WidenWeight(const ffi::AnyBuffer& w, float* out) {
  LoadRow(w.untyped_data(), 0, w.element_count(), DtypeCode(w.element_type()), out);
}

// ---- operand and attribute validation --------------------------------------------------------
// The handler trusts nothing it is called with (a direct jax.ffi.ffi_call can pass anything):
// ValidateCall checks every operand's and result's dtype and dimensions against q's, the key
// cache's and the attributes before a byte is read, and names the offending buffer. Everything
// the loops index with follows from what it checked.
const char* TypeName(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F32: return "float32";
    case ffi::DataType::BF16: return "bfloat16";
    case ffi::DataType::F16: return "float16";
    case ffi::DataType::F64: return "float64";
    case ffi::DataType::F8E4M3FN: return "float8_e4m3fn";
    case ffi::DataType::F8E4M3FNUZ: return "float8_e4m3fnuz";
    case ffi::DataType::F8E5M2: return "float8_e5m2";
    case ffi::DataType::S8: return "int8";
    case ffi::DataType::S16: return "int16";
    case ffi::DataType::S32: return "int32";
    case ffi::DataType::S64: return "int64";
    case ffi::DataType::U8: return "uint8";
    case ffi::DataType::U32: return "uint32";
    case ffi::DataType::PRED: return "bool";
    default: return "an unsupported type";
  }
}

std::string DimsString(ffi::Span<const int64_t> d) {
  std::string s = "[";
  for (size_t i = 0; i < d.size(); ++i) s += (i ? ", " : "") + std::to_string(d[i]);
  return s + "]";
}

std::string DimsString(const std::vector<int64_t>& d) {
  return DimsString(ffi::Span<const int64_t>(d.data(), d.size()));
}

ffi::Error Invalid(const std::string& what) {
  return ffi::Error::InvalidArgument("rope_and_cache cpu: " + what);
}

bool IsInputType(ffi::DataType t) {
  return t == ffi::DataType::F32 || t == ffi::DataType::BF16 || t == ffi::DataType::F16;
}

bool IsFp8(ffi::DataType t) {
  return t == ffi::DataType::F8E4M3FN || t == ffi::DataType::F8E4M3FNUZ || t == ffi::DataType::F8E5M2;
}

// The low-bit caches: int8, and int4 as uint8 bytes of two values (always with per-token scales).
bool IsLowBit(ffi::DataType t) { return t == ffi::DataType::S8 || t == ffi::DataType::U8; }

// The cache code of the handler's loops: DtypeCode, or RC_INT8 / RC_INT4.
int CacheCode(ffi::DataType t) {
  return t == ffi::DataType::S8 ? RC_INT8 : (t == ffi::DataType::U8 ? RC_INT4 : DtypeCode(t));
}

// `name` must have dtype `want` (`as` says why, e.g. "as q").
ffi::Error ExpectType(const char* name, const ffi::AnyBuffer& b, ffi::DataType want, const char* as) {
  if (b.element_type() == want) return ffi::Error::Success();
  return Invalid(std::string(name) + ": expected dtype " + TypeName(want) + " (" + as + "), got " +
                 TypeName(b.element_type()));
}

// `name` must have exactly the dimensions `want` (`dims` names them, e.g. "[T, KH, D]").
ffi::Error ExpectDims(const char* name, const ffi::AnyBuffer& b, const std::vector<int64_t>& want,
                      const std::string& dims) {
  auto got = b.dimensions();
  bool same = got.size() == want.size();
  for (size_t i = 0; same && i < want.size(); ++i) same = got[i] == want[i];
  if (same) return ffi::Error::Success();
  return Invalid(std::string(name) + ": expected dims " + dims + " = " + DimsString(want) + ", got " +
                 DimsString(got));
}

ffi::Error ExpectScalar(const char* name, const ffi::AnyBuffer& b, ffi::DataType want) {
  auto d = b.dimensions();
  if (b.element_type() != want || d.size() > 1 || b.element_count() != 1)
    return Invalid(std::string(name) + ": expected a " + TypeName(want) + " scalar (dims [] or [1]), got " +
                   TypeName(b.element_type()) + DimsString(d));
  return ffi::Error::Success();
}

// A scale: float32 dims [] or [1] (one scale), or [KH] (one per kv head).
ffi::Error ExpectScale(const char* name, const ffi::AnyBuffer& b, int64_t kh) {
  auto d = b.dimensions();
  const bool one = d.size() == 0 || (d.size() == 1 && d[0] == 1);
  if (b.element_type() != ffi::DataType::F32 || !(one || (d.size() == 1 && d[0] == kh)))
    return Invalid(std::string(name) + ": expected float32 dims [], [1] or [KH] = [" + std::to_string(kh) +
                   "], got " + TypeName(b.element_type()) + DimsString(d));
  return ffi::Error::Success();
}

// A norm weight: dims [D] of q's dtype or float32 when its norm is on, else the float32[1] placeholder.
ffi::Error ExpectNormWeight(const char* name, const ffi::AnyBuffer& b, bool on, ffi::DataType dt, int64_t d) {
  auto dims = b.dimensions();
  if (!on) {
    if (b.element_type() != ffi::DataType::F32 || dims.size() != 1 || dims[0] != 1)
      return Invalid(std::string(name) + ": expected the float32[1] placeholder (its norm is off), got " +
                     TypeName(b.element_type()) + DimsString(dims));
    return ffi::Error::Success();
  }
  if (b.element_type() != dt && b.element_type() != ffi::DataType::F32)
    return Invalid(std::string(name) + ": expected dtype " + TypeName(dt) + " (as q) or float32, got " +
                   TypeName(b.element_type()));
  return ExpectDims(name, b, {d}, "[D]");
}

// One layer's dims of each cache per layout (contract.LAYOUT_TABLE spelled out), with their names.
struct LayerDims {
  std::vector<int64_t> key, value, scale;
  const char *key_names, *value_names, *scale_names;
};

LayerDims ExpectedDims(int64_t layout, int64_t NB, int64_t BS, int64_t KH, int64_t D, int64_t X) {
  switch (layout) {
    case RC_FLASH:
      return {{NB, BS, KH, D}, {NB, BS, KH, D}, {NB, KH, BS}, "NB, BS, KH, D]", "NB, BS, KH, D]", "NB, KH, BS]"};
    case RC_HND:
      return {{NB, KH, BS, D}, {NB, KH, BS, D}, {NB, KH, BS}, "NB, KH, BS, D]", "NB, KH, BS, D]", "NB, KH, BS]"};
    case RC_HEAD_MAJOR:
      return {{KH, NB, BS, D}, {KH, NB, BS, D}, {KH, NB, BS}, "KH, NB, BS, D]", "KH, NB, BS, D]", "KH, NB, BS]"};
    case RC_KV_MERGED:  // the value_cache operand: a one-element placeholder per layer
      return {{NB, BS, 2 * KH, D}, {1}, {NB, KH, BS}, "NB, BS, 2*KH, D]", "1] (kv_merged's placeholder)",
              "NB, KH, BS]"};
    case RC_XPACKED:
      return {{NB, KH, D / X, BS, X}, {NB, KH, D, BS}, {NB, KH, BS}, "NB, KH, D//X, BS, X]", "NB, KH, D, BS]",
              "NB, KH, BS]"};
    default:
      return {{NB, KH, D / X, BS, X}, {NB, KH, BS / X, D, X}, {NB, KH, BS}, "NB, KH, D//X, BS, X]",
              "NB, KH, BS//X, D, X]", "NB, KH, BS]"};
  }
}

// (NB, BS) of a key cache of one layer (dims of the layout's rank).
std::pair<int64_t, int64_t> BlockGeometry(int64_t layout, ffi::Span<const int64_t> kcd) {
  switch (layout) {
    case RC_FLASH: case RC_KV_MERGED: return {kcd[0], kcd[1]};
    case RC_HND: return {kcd[0], kcd[2]};
    case RC_HEAD_MAJOR: return {kcd[1], kcd[2]};
    default: return {kcd[0], kcd[3]};
  }
}

#define JRC_CHECK(expr)                   \
  do {                                    \
    if (auto e = (expr); e.failure()) return e; \
  } while (0)

ffi::Error ValidateCall(const ffi::AnyBuffer& q, const ffi::AnyBuffer& k, const ffi::AnyBuffer& v,
                        const ffi::AnyBuffer& key_cache, const ffi::AnyBuffer& value_cache,
                        const ffi::AnyBuffer& slots, const ffi::AnyBuffer& positions, const ffi::AnyBuffer& cos,
                        const ffi::AnyBuffer& sin, const ffi::AnyBuffer& k_scale, const ffi::AnyBuffer& v_scale,
                        const ffi::AnyBuffer& layer, const ffi::AnyBuffer& q_norm_weight,
                        const ffi::AnyBuffer& k_norm_weight, const ffi::AnyBuffer& q_out, const ffi::AnyBuffer& k_out,
                        const ffi::AnyBuffer& key_cache_out, const ffi::AnyBuffer& value_cache_out,
                        int64_t layout, int64_t rotary_dim, bool rotary_tail, int64_t norm_type, bool norm_after,
                        bool q_norm, bool k_norm, float norm_eps, int64_t mrope,
                        int64_t mrope_t, int64_t mrope_h, int64_t mrope_w, const ffi::AnyBuffer* k_sc_out,
                        const ffi::AnyBuffer* v_sc_out, bool q_gate, bool rope_switch, int64_t floor_scale,
                        const ffi::RemainingArgs& extra) {
  const bool scale_caches = k_sc_out != nullptr;  // the handler with per-token scales (6 results)
  if (layout < RC_FLASH || layout > RC_KV_MERGED)
    return Invalid("attribute layout: expected 0 (flash), 1 (xpacked), 2 (xpacked_shuffled), 3 (hnd), 4 (head_major) "
                   "or 5 (kv_merged), got " + std::to_string(layout));
  // q fixes T, D and the input dtype; QH and KH are q_out's and k_out's head counts. q with more
  // heads than q_out is the fused QKV tensor [T, QH + 2 KH, D], passed as k and v too.
  const auto qd = q.dimensions(), qod = q_out.dimensions(), kod = k_out.dimensions();
  if (!IsInputType(q.element_type()))
    return Invalid(std::string("q: expected dtype float32, bfloat16 or float16, got ") + TypeName(q.element_type()));
  if (qd.size() != 3) return Invalid("q: expected rank 3 [T, QH, D], got dims " + DimsString(qd));
  if (qod.size() != 3) return Invalid("q_out: expected rank 3 [T, QH, D], got dims " + DimsString(qod));
  const bool fused = q_gate || qod[1] != qd[1];
  const int64_t T = qd[0], QH = qod[1], D = qd[2];
  const int64_t NQ = q_gate ? 2 * QH : QH;  // q rows of a fused token: with q_gate each q head, then its gate
  if (q_gate && kod.size() == 3 && qd[1] != NQ + 2 * kod[1])
    return Invalid("q: attribute q_gate expects the gated fused tensor [T, 2 QH + 2 KH, D] with QH = q_out's " +
                   std::to_string(QH) + " and KH = k_out's " + std::to_string(kod[1]) + ", got dims " + DimsString(qd));
  if (fused) {  // the fused tensor: k_out says KH; q, k and v are [T, QH + 2 KH, D] ([T, 2 QH + 2 KH, D] gated)
    if (kod.size() != 3) return Invalid("k_out: expected rank 3 [T, KH, D], got dims " + DimsString(kod));
    const int64_t KH = kod[1];
    if (KH < 1 || QH < KH || QH % KH || qd[1] != NQ + 2 * KH)
      return Invalid("q: expected dims [T, QH, D] with QH = q_out's " + std::to_string(QH) +
                     ", or the fused QKV tensor [T, QH + 2 KH, D] with KH = k_out's " + std::to_string(KH) +
                     " dividing QH, got dims " + DimsString(qd));
  }
  if (D < 2 || D % 2) return Invalid("q: expected an even head_dim D >= 2, got D=" + std::to_string(D));
  if (rotary_dim < 0 || rotary_dim % 2 || rotary_dim > D)
    return Invalid("attribute rotary_dim: expected an even value in [0, D=" + std::to_string(D) + "] (0: no rotation), got " +
                   std::to_string(rotary_dim));
  if (rotary_tail && rotary_dim == 0)
    return Invalid("attribute rotary_tail: expected false with rotary_dim=0 (no rotary channels), got true");
  if (norm_type < RC_NORM_RMS || norm_type > RC_NORM_WEIGHTLESS)
    return Invalid("attribute norm_type: expected 0 (rms), 1 (gemma) or 2 (weightless), got " +
                   std::to_string(norm_type));
  if (norm_type == RC_NORM_WEIGHTLESS && (q_norm || k_norm))
    return Invalid("attributes q_norm/k_norm: expected false with norm_type 2 (weightless: no weight), got true");
  if (norm_after && (rotary_dim == 0 || !(q_norm || k_norm || norm_type == RC_NORM_WEIGHTLESS)))
    return Invalid("attribute norm_after: expected false without rotation (rotary_dim=0) or without a QK-norm, got "
                   "true with rotary_dim=" + std::to_string(rotary_dim));
  const ffi::DataType dt = q.element_type();
  JRC_CHECK(ExpectType("k", k, dt, "as q"));
  const auto kd = k.dimensions();
  if (kd.size() != 3) return Invalid("k: expected rank 3 [T, KH, D], got dims " + DimsString(kd));
  const int64_t KH = fused ? kod[1] : kd[1];
  if (KH < 1 || QH % KH)
    return Invalid("k: expected KH >= 1 dividing QH=" + std::to_string(QH) + ", got dims " + DimsString(kd));
  const std::vector<int64_t> kv_dims = fused ? std::vector<int64_t>{T, NQ + 2 * KH, D} : std::vector<int64_t>{T, KH, D};
  const char* kv_names = !fused ? "[T, KH, D]" : (q_gate ? "[T, 2 QH + 2 KH, D] (the gated fused QKV tensor, as q)"
                                                          : "[T, QH + 2 KH, D] (the fused QKV tensor, as q)");
  JRC_CHECK(ExpectDims("k", k, kv_dims, kv_names));
  JRC_CHECK(ExpectType("v", v, dt, "as q"));
  JRC_CHECK(ExpectDims("v", v, kv_dims, kv_names));

  // The key cache fixes the cache dtype, L (stacked), NB and BS; the value cache must agree.
  const ffi::DataType cdt = key_cache.element_type();
  if (cdt != dt && !IsFp8(cdt) && !(IsLowBit(cdt) && scale_caches))
    return Invalid(std::string("key_cache: expected dtype ") + TypeName(dt) +
                   " (as q), float8_e4m3fn, float8_e4m3fnuz or float8_e5m2" +
                   (scale_caches ? ", int8 or uint8 (int4)" : " (int8 and uint8 (int4) caches: with scale caches)") +
                   ", got " + TypeName(cdt));
  const int64_t DC = cdt == ffi::DataType::U8 ? D / 2 : D;  // a cache row: D values, int4 D / 2 bytes
  JRC_CHECK(ExpectType("value_cache", value_cache, cdt, "as key_cache"));
  const bool packed = layout == RC_XPACKED || layout == RC_XPACKED_SHUFFLED;
  const size_t rank = packed ? 5 : 4;
  auto kcd = key_cache.dimensions();
  if (kcd.size() != rank && kcd.size() != rank + 1)
    return Invalid("key_cache: expected rank " + std::to_string(rank) + " (or " + std::to_string(rank + 1) +
                   " with stacked layers) for layout " + std::to_string(layout) + ", got dims " + DimsString(kcd));
  const bool stacked = kcd.size() == rank + 1;
  std::vector<int64_t> lead;
  if (stacked) lead.push_back(kcd[0]);
  const size_t o = stacked ? 1 : 0;
  // X of the x-packed layouts: the key cache's last dim, a power of two dividing D (and BS, shuffled)
  const int64_t X = packed ? kcd[o + 4] : 16 / static_cast<int64_t>(ffi::ByteWidth(cdt));
  const auto [NB, BS] = BlockGeometry(layout, kcd.last(rank));
  if (BS < 1) return Invalid("key_cache: expected a block size >= 1, got dims " + DimsString(kcd));
  if (packed && (X < 1 || (X & (X - 1))))
    return Invalid("key_cache: expected X (the last dim) to be a power of two, got dims " + DimsString(kcd));
  if (packed && DC % X)
    return Invalid("key_cache: an x-packed layout needs D divisible by X=" + std::to_string(X) + ", got D=" +
                   std::to_string(DC) + (DC != D ? " bytes (int4: D/2)" : ""));
  if (layout == RC_XPACKED_SHUFFLED && BS % X)
    return Invalid("value_cache: layout xpacked_shuffled needs the block size divisible by X=" + std::to_string(X) +
                   ", got BS=" + std::to_string(BS));
  auto with_lead = [&](std::vector<int64_t> d) {
    d.insert(d.begin(), lead.begin(), lead.end());
    return d;
  };
  const std::string l = stacked ? "[L, " : "[";
  const LayerDims want = ExpectedDims(layout, NB, BS, KH, DC, X);
  JRC_CHECK(ExpectDims("key_cache", key_cache, with_lead(want.key), l + want.key_names));
  JRC_CHECK(ExpectDims("value_cache", value_cache, with_lead(want.value), l + want.value_names));

  for (auto [name, b] : {std::pair<const char*, const ffi::AnyBuffer*>{"slot_mapping", &slots},
                         std::pair<const char*, const ffi::AnyBuffer*>{"positions", &positions}}) {
    if (b->element_type() != ffi::DataType::S32 && b->element_type() != ffi::DataType::S64)
      return Invalid(std::string(name) + ": expected dtype int32 or int64, got " + TypeName(b->element_type()));
    if (b == &positions && mrope != RC_MROPE_OFF)
      JRC_CHECK(ExpectDims(name, *b, {3, T}, "[3, T] (M-RoPE streams)"));
    else
      JRC_CHECK(ExpectDims(name, *b, {T}, "[T]"));
  }
  if (mrope < RC_MROPE_OFF || mrope > RC_MROPE_INTERLEAVED)
    return Invalid("attribute mrope: expected 0 (off), 1 (sections) or 2 (interleaved), got " + std::to_string(mrope));
  if (mrope != RC_MROPE_OFF && rotary_dim == 0)
    return Invalid("attribute mrope: expected 0 (off) with rotary_dim=0, got " + std::to_string(mrope));
  if (mrope != RC_MROPE_OFF) {
    // Every stream must drive exactly its section's count of the R/2 frequencies.
    int64_t count[3] = {0, 0, 0};
    const int64_t sec[3] = {mrope_t, mrope_h, mrope_w};
    bool ok = mrope_t >= 0 && mrope_h >= 0 && mrope_w >= 0 && mrope_t + mrope_h + mrope_w == rotary_dim / 2;
    for (int64_t i = 0; ok && i < rotary_dim / 2; ++i) ++count[rc_mrope_stream(i, int(mrope), mrope_t, mrope_h, mrope_w)];
    for (int s = 0; ok && s < 3; ++s) ok = count[s] == sec[s];
    if (!ok)
      return Invalid("attributes mrope_t/h/w: expected 3 counts >= 0 summing to R/2=" + std::to_string(rotary_dim / 2) +
                     ", each stream driving its count, got [" + std::to_string(mrope_t) + ", " + std::to_string(mrope_h) +
                     ", " + std::to_string(mrope_w) + "]");
  }
  if (!IsInputType(cos.element_type()))
    return Invalid(std::string("cos: expected dtype float32, bfloat16 or float16, got ") +
                   TypeName(cos.element_type()));
  JRC_CHECK(ExpectType("sin", sin, cos.element_type(), "as cos"));
  const auto cd = cos.dimensions();
  if (cd.size() != 2 || cd[0] < 1 || (rotary_dim && cd[1] != rotary_dim && cd[1] != rotary_dim / 2))
    return Invalid("cos: expected dims [max_pos >= 1, R/2=" + std::to_string(rotary_dim / 2) + " or R=" +
                   std::to_string(rotary_dim) + "], got " + DimsString(cd));
  JRC_CHECK(ExpectDims("sin", sin, {cd[0], cd[1]}, "as cos"));
  if (scale_caches) {  // per-token scales: the k_scale / v_scale operands are the scale caches
    const std::string dims = l + want.scale_names;
    JRC_CHECK(ExpectType("k_scale_cache", k_scale, ffi::DataType::F32, "float32"));
    JRC_CHECK(ExpectType("v_scale_cache", v_scale, ffi::DataType::F32, "float32"));
    JRC_CHECK(ExpectDims("k_scale_cache", k_scale, with_lead(want.scale), dims));
    JRC_CHECK(ExpectDims("v_scale_cache", v_scale, with_lead(want.scale), dims));
    if (!IsFp8(cdt) && !IsLowBit(cdt))
      return Invalid(std::string("k_scale_cache: per-token scales need a float8, int8 or uint8 (int4) cache, got ") +
                     TypeName(cdt));
    JRC_CHECK(ExpectType("k_scale_cache result", *k_sc_out, ffi::DataType::F32, "as k_scale_cache"));
    JRC_CHECK(ExpectType("v_scale_cache result", *v_sc_out, ffi::DataType::F32, "as v_scale_cache"));
    JRC_CHECK(ExpectDims("k_scale_cache result", *k_sc_out, with_lead(want.scale), "as k_scale_cache"));
    JRC_CHECK(ExpectDims("v_scale_cache result", *v_sc_out, with_lead(want.scale), "as v_scale_cache"));
  } else {
    JRC_CHECK(ExpectScale("k_scale", k_scale, KH));
    JRC_CHECK(ExpectScale("v_scale", v_scale, KH));
  }
  JRC_CHECK(ExpectScalar("layer", layer, ffi::DataType::S32));
  JRC_CHECK(ExpectNormWeight("q_norm_weight", q_norm_weight, q_norm, dt, D));
  JRC_CHECK(ExpectNormWeight("k_norm_weight", k_norm_weight, k_norm, dt, D));
  if ((q_norm || k_norm || norm_type == RC_NORM_WEIGHTLESS) && !(norm_eps > 0.0f && norm_eps <= 3.4028234663852886e38f))
    return Invalid("attribute norm_eps: expected a finite value > 0, got " + std::to_string(norm_eps));

  // The model-family operands after contract.OPERANDS: use_rope (rope_switch), then the temperature table.
  if (rope_switch && rotary_dim == 0)
    return Invalid("attribute rope_switch: expected false with rotary_dim=0 (no call rotates), got true");
  if (floor_scale < 0)
    return Invalid("attribute floor_scale: expected 0 (no temperature) or a positive integer, got " +
                   std::to_string(floor_scale));
  if (floor_scale > 0 && rotary_dim && !rope_switch)
    return Invalid("attribute floor_scale: the temperature scales q on calls that do not rotate; expected 0 with "
                   "rotary_dim=" + std::to_string(rotary_dim) + " and no rope_switch, got " + std::to_string(floor_scale));
  if (floor_scale > 0 && mrope != RC_MROPE_OFF)
    return Invalid("attribute floor_scale: expected 0 with M-RoPE positions, got " + std::to_string(floor_scale));
  const size_t n_extra = size_t{rope_switch} + size_t{floor_scale > 0};
  if (extra.size() != n_extra)
    return Invalid("operands: expected " + std::to_string(14 + n_extra) + " (contract.OPERANDS" +
                   (rope_switch ? ", use_rope" : "") + (floor_scale > 0 ? ", temperature_factors" : "") + "), got " +
                   std::to_string(14 + extra.size()));
  if (rope_switch) {
    auto b = extra.get<ffi::AnyBuffer>(0);
    if (b.has_error()) return b.error();
    JRC_CHECK(ExpectScalar("use_rope", *b, ffi::DataType::S32));
  }
  if (floor_scale > 0) {
    auto b = extra.get<ffi::AnyBuffer>(rope_switch ? 1 : 0);
    if (b.has_error()) return b.error();
    JRC_CHECK(ExpectType("temperature_factors", *b, ffi::DataType::F32, "float32"));
    JRC_CHECK(ExpectDims("temperature_factors", *b, {cd[0] / floor_scale + 1}, "[max_pos // floor_scale + 1]"));
  }

  // Results: the same dtype and dims as what they are computed from (the caches: as the operands
  // they alias; without the alias the handler copies the operand's bytes into the result first).
  const std::pair<const char*, const ffi::AnyBuffer*> like[] = {
      {"q", &q}, {"k", &k}, {"key_cache", &key_cache}, {"value_cache", &value_cache}};
  const char* names[] = {"q_out", "k_out", "key_cache result", "value_cache result"};
  const ffi::AnyBuffer* outs[] = {&q_out, &k_out, &key_cache_out, &value_cache_out};
  for (int i = 0; i < 4; ++i) {
    const auto& [src_name, src] = like[i];
    const std::string as = std::string("as ") + src_name;
    JRC_CHECK(ExpectType(names[i], *outs[i], src->element_type(), as.c_str()));
    auto sd = src->dimensions();
    std::vector<int64_t> want(sd.begin(), sd.end());
    if (i < 2) want = {T, i == 0 ? QH : KH, D};  // q_out [T, QH, D], k_out [T, KH, D] (also from the fused tensor)
    JRC_CHECK(ExpectDims(names[i], *outs[i], want, i < 2 ? (i == 0 ? "[T, QH, D]" : "[T, KH, D]") : as));
  }
  return ffi::Error::Success();
}

#undef JRC_CHECK

// The op; k_sc_out / v_sc_out: the scale-cache results of a call with per-token scales (the
// k_scale / v_scale operands are then the scale caches), else nullptr.
ffi::Error RopeAndCache(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer key_cache,
                        ffi::AnyBuffer value_cache, ffi::AnyBuffer slots, ffi::AnyBuffer positions, ffi::AnyBuffer cos,
                        ffi::AnyBuffer sin, ffi::AnyBuffer k_scale, ffi::AnyBuffer v_scale, ffi::AnyBuffer layer,
                        ffi::AnyBuffer q_norm_weight, ffi::AnyBuffer k_norm_weight, const ffi::RemainingArgs& extra,
                        ffi::AnyBuffer* q_out,
                        ffi::AnyBuffer* k_out, ffi::AnyBuffer* key_cache_out, ffi::AnyBuffer* value_cache_out,
                        ffi::AnyBuffer* k_sc_out, ffi::AnyBuffer* v_sc_out, int64_t layout, bool is_neox,
                        int64_t rotary_dim, bool native, bool q_norm, bool k_norm, float norm_eps, int64_t mrope,
                        int64_t mrope_t, int64_t mrope_h, int64_t mrope_w, bool rotary_tail, int64_t norm_type,
                        bool norm_after, bool q_gate, bool rope_switch, int64_t floor_scale) {
  if (auto e = ValidateCall(q, k, v, key_cache, value_cache, slots, positions, cos, sin, k_scale, v_scale, layer,
                            q_norm_weight, k_norm_weight, *q_out, *k_out, *key_cache_out, *value_cache_out, layout,
                            rotary_dim, rotary_tail, norm_type, norm_after, q_norm, k_norm, norm_eps, mrope, mrope_t,
                            mrope_h, mrope_w, k_sc_out, v_sc_out, q_gate, rope_switch, floor_scale, extra);
      e.failure())
    return e;
  // The switch of this call (ValidateCall checked the operand): a call that does not rotate is a NoPE call.
  bool rotating = rotary_dim > 0;
  if (rope_switch) rotating = rotating && *static_cast<const int32_t*>((*extra.get<ffi::AnyBuffer>(0)).untyped_data()) != 0;
  Problem p{};
  auto qd = q.dimensions(), kd = k.dimensions(), cd = cos.dimensions();
  auto qod = q_out->dimensions(), kod = k_out->dimensions();
  if (qd.size() != 3 || kd.size() != 3 || qod.size() != 3 || kod.size() != 3 || cd.size() != 2 ||
      key_cache.dimensions().size() < 4)
    return ffi::Error::InvalidArgument("rope_and_cache cpu: unexpected ranks");
  p.T = qd[0], p.QH = qod[1], p.D = qd[2], p.KH = kod[1], p.R = rotary_dim;
  const bool fused = q_gate || qd[1] != p.QH;  // ValidateCall: then q, k and v are the fused [T, NQ + 2 KH, D]
  const int64_t nq = q_gate ? 2 * p.QH : p.QH;  // gated rows: q head h at row 2h, its gate at 2h + 1
  p.q_row = qd[1] * p.D, p.kv_row = kd[1] * p.D, p.q_head = q_gate ? 2 * p.D : p.D;
  p.k_off = fused ? nq * p.D : 0, p.v_off = fused ? (nq + p.KH) * p.D : 0;
  p.max_pos = cd[0], p.width = cd[1], p.layout = static_cast<int>(layout);
  p.dt = DtypeCode(q.element_type()), p.table_dt = DtypeCode(cos.element_type());
  p.cache_dt = CacheCode(key_cache.element_type());
  if (p.dt < 0 || p.dt > RC_F16 || p.table_dt < 0 || p.table_dt > RC_F16 || p.cache_dt < 0)
    return ffi::Error::InvalidArgument("rope_and_cache cpu: unsupported dtype");
  const bool low_bit = p.cache_dt == RC_INT8 || p.cache_dt == RC_INT4;
  if (p.cache_dt != p.dt && p.cache_dt != RC_FP8_E4M3FN && p.cache_dt != RC_FP8_E4M3FNUZ && p.cache_dt != RC_FP8_E5M2 &&
      !(low_bit && k_sc_out))
    return ffi::Error::InvalidArgument("rope_and_cache cpu: cache dtype must equal the input dtype or be fp8");
  p.DC = p.cache_dt == RC_INT4 ? p.D / 2 : p.D;
  if (p.layout < RC_FLASH || p.layout > RC_KV_MERGED)
    return ffi::Error::InvalidArgument("rope_and_cache cpu: unknown layout " + std::to_string(layout));
  // Stacked caches ([L, ...], one rank more than a layer's layout) are written at layer `layer`.
  auto kcd = key_cache.dimensions();
  const bool packed = p.layout == RC_XPACKED || p.layout == RC_XPACKED_SHUFFLED;
  const size_t layer_rank = packed ? 5 : 4;
  if (kcd.size() != layer_rank && kcd.size() != layer_rank + 1)
    return ffi::Error::InvalidArgument("rope_and_cache cpu: key_cache rank does not match the layout");
  const bool stacked = kcd.size() == layer_rank + 1;
  const int64_t num_layers = stacked ? kcd[0] : 1;
  if (stacked) kcd = kcd.last(kcd.size() - 1);
  std::tie(p.NB, p.BS) = BlockGeometry(p.layout, kcd);
  p.X = packed ? kcd[4] : 16 / static_cast<int64_t>(ffi::ByteWidth(key_cache.element_type()));
  // Every index the loops form stays inside these element counts.
  if (auto e = CheckSame("k tokens", kd[0], p.T); e.failure()) return e;
  if (auto e = CheckSame("k head_dim", kd[2], p.D); e.failure()) return e;
  if (auto e = CheckSame("v elements", v.element_count(), k.element_count()); e.failure()) return e;
  // The rows read stay inside q, k and v: the last head of a row ends at its row's end.
  if (auto e = CheckSame("q elements", q.element_count(), p.T * p.q_row); e.failure()) return e;
  if (auto e = CheckSame("k elements", k.element_count(), p.T * p.kv_row); e.failure()) return e;
  if (auto e = CheckSame("q row", p.q_row, fused ? (nq + 2 * p.KH) * p.D : p.QH * p.D); e.failure()) return e;
  if (auto e = CheckSame("k row", p.kv_row, fused ? (nq + 2 * p.KH) * p.D : p.KH * p.D); e.failure()) return e;
  const bool merged = p.layout == RC_KV_MERGED;  // K and V in the key cache; the value cache: [1] per layer
  const int64_t layer_elems = p.NB * p.BS * p.KH * p.DC * (merged ? 2 : 1);
  if (auto e = CheckSame("key_cache elements", key_cache.element_count(), num_layers * layer_elems); e.failure())
    return e;
  if (auto e = CheckSame("value_cache elements", value_cache.element_count(), num_layers * (merged ? 1 : layer_elems));
      e.failure())
    return e;
  if (layer.element_count() != 1 || layer.element_type() != ffi::DataType::S32)
    return ffi::Error::InvalidArgument("rope_and_cache cpu: layer must be an int32 scalar");
  if (auto e = CheckSame("slot_mapping elements", slots.element_count(), p.T); e.failure()) return e;
  if (auto e = CheckSame("positions elements", positions.element_count(), (mrope ? 3 : 1) * p.T); e.failure())
    return e;
  if (p.R < 0 || p.R % 2 || p.R > p.D || (p.R && p.width != p.R && p.width != p.R / 2) || p.max_pos < 1)
    return ffi::Error::InvalidArgument("rope_and_cache cpu: inconsistent rotary_dim / table width");
  if (packed && (p.X < 1 || p.DC % p.X || (p.layout == RC_XPACKED_SHUFFLED && p.BS % p.X)))
    return ffi::Error::InvalidArgument("rope_and_cache cpu: x-packed layout needs D and BS divisible by X");

  if (!rotating) p.R = 0;  // a switched-off call: no rotation, and no norm "after" (below)
  p.full_table = p.R && p.width == p.R;
  p.rot_off = rotary_tail && p.R ? p.D - p.R : 0;
  p.neox = is_neox, p.arith = rc_arith(native, p.dt, p.table_dt);
  p.slots64 = slots.element_type() == ffi::DataType::S64;
  p.pos64 = positions.element_type() == ffi::DataType::S64;
  p.q = q.untyped_data(), p.k = k.untyped_data(), p.v = v.untyped_data();
  p.slots = slots.untyped_data(), p.pos = positions.untyped_data();
  p.cos = cos.untyped_data(), p.sin = sin.untyped_data();
  p.q_out = q_out->untyped_data(), p.k_out = k_out->untyped_data();
  p.kc = key_cache_out->untyped_data(), p.vc = value_cache_out->untyped_data();
  // Per-call tables: inverse scales per kv head, the norm weights in f32 ([D] each, checked above).
  for (auto [name, b] : {std::pair<const char*, const ffi::AnyBuffer*>{"k_scale", &k_scale},
                         std::pair<const char*, const ffi::AnyBuffer*>{"v_scale", &v_scale}})
    if (!k_sc_out && b->element_count() != 1 && b->element_count() != p.KH)
      return ffi::Error::InvalidArgument(std::string("rope_and_cache cpu: ") + name + " must have 1 or KH elements");
  if ((q_norm && q_norm_weight.element_count() != p.D) || (k_norm && k_norm_weight.element_count() != p.D))
    return ffi::Error::InvalidArgument("rope_and_cache cpu: a norm weight must have D elements");
  std::vector<float> inv_scales(2 * p.KH), weights((q_norm + k_norm) * p.D);
  {
    ScopedIeeeDenormals ieee;  // a subnormal scale is a scale, not zero; subnormal weights stay too
    if (!k_sc_out) {  // per-token scales: computed per row instead
      InverseScales(k_scale, p.KH, inv_scales.data());
      InverseScales(v_scale, p.KH, inv_scales.data() + p.KH);
    }
    if (q_norm) WidenWeight(q_norm_weight, weights.data());
    if (k_norm) WidenWeight(k_norm_weight, weights.data() + (q_norm ? p.D : 0));
  }
  p.inv_k_scale = inv_scales.data(), p.inv_v_scale = inv_scales.data() + p.KH;
  p.q_norm_w = q_norm ? weights.data() : nullptr;
  p.k_norm_w = k_norm ? weights.data() + (q_norm ? p.D : 0) : nullptr;
  p.norm_eps = norm_eps;
  p.norm_type = static_cast<int>(norm_type), p.norm_after = norm_after;
  p.q_normed = q_norm || norm_type == RC_NORM_WEIGHTLESS, p.k_normed = k_norm || norm_type == RC_NORM_WEIGHTLESS;
  if (norm_after && !rotating) p.q_normed = p.k_normed = p.norm_after = false;  // the norm "after" needs a rotation
  if (floor_scale > 0 && !rotating) {  // checked: float32 [max_pos // floor_scale + 1]
    const ffi::AnyBuffer table = *extra.get<ffi::AnyBuffer>(rope_switch ? 1 : 0);
    p.temp = static_cast<const float*>(table.untyped_data());
    p.temp_n = table.element_count(), p.floor_scale = floor_scale;
  }
  std::vector<int8_t> col_stream(mrope && p.R ? p.width : 0);  // p.R: 0 on a switched-off call
  for (int64_t c = 0; c < static_cast<int64_t>(col_stream.size()); ++c) {
    // a "full" column serves the pair of its frequency: NeoX c mod R/2, GPT-J c / 2
    const int64_t f = p.width == p.R / 2 ? c : (p.neox ? c % (p.R / 2) : c / 2);
    col_stream[c] = static_cast<int8_t>(rc_mrope_stream(f, int(mrope), mrope_t, mrope_h, mrope_w));
  }
  p.col_stream = mrope && p.R ? col_stream.data() : nullptr;
  const int64_t layer_index = stacked ? *static_cast<const int32_t*>(layer.untyped_data()) : 0;
  // Outputs alias the caches; should XLA ever hand separate buffers, start from the inputs' bits.
  if (p.kc != key_cache.untyped_data()) std::memcpy(p.kc, key_cache.untyped_data(), key_cache.size_bytes());
  if (p.vc != value_cache.untyped_data()) std::memcpy(p.vc, value_cache.untyped_data(), value_cache.size_bytes());
  if (layer_index < 0 || layer_index >= num_layers) p.NB = 0;  // no slot is valid: nothing is written
  const int64_t cache_offset = (p.NB ? layer_index : 0) * layer_elems * ffi::ByteWidth(key_cache.element_type());
  p.kc = static_cast<char*>(p.kc) + cache_offset, p.vc = static_cast<char*>(p.vc) + cache_offset;
  if (merged) p.vc = p.kc;  // V rows go into the one array; the placeholder is never touched
  if (k_sc_out) {
    if (auto e = CheckSame("k_scale_cache elements", k_scale.element_count(), num_layers * p.NB * p.KH * p.BS);
        p.NB && e.failure())
      return e;
    float* ks = static_cast<float*>(k_sc_out->untyped_data());
    float* vs = static_cast<float*>(v_sc_out->untyped_data());
    if (ks != k_scale.untyped_data()) std::memcpy(ks, k_scale.untyped_data(), k_scale.size_bytes());
    if (vs != v_scale.untyped_data()) std::memcpy(vs, v_scale.untyped_data(), v_scale.size_bytes());
    const int64_t scale_offset = (p.NB ? layer_index : 0) * p.NB * p.KH * p.BS;
    p.k_sc = ks + scale_offset, p.v_sc = vs + scale_offset;
  }
  AdviseHugePages(p.q_out, q_out->size_bytes());
  AdviseHugePages(p.k_out, k_out->size_bytes());
  if (p.T > 0) ParallelOverTokens(p);
  return ffi::Error::Success();
}

ffi::Error CpuRopeAndCache(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer key_cache,
                           ffi::AnyBuffer value_cache, ffi::AnyBuffer slots, ffi::AnyBuffer positions, ffi::AnyBuffer cos,
                           ffi::AnyBuffer sin, ffi::AnyBuffer k_scale, ffi::AnyBuffer v_scale, ffi::AnyBuffer layer,
                           ffi::AnyBuffer q_norm_weight, ffi::AnyBuffer k_norm_weight, ffi::RemainingArgs extra,
                           ffi::Result<ffi::AnyBuffer> q_out,
                           ffi::Result<ffi::AnyBuffer> k_out, ffi::Result<ffi::AnyBuffer> key_cache_out,
                           ffi::Result<ffi::AnyBuffer> value_cache_out, int64_t layout, bool is_neox,
                           int64_t rotary_dim, bool native, bool q_norm, bool k_norm, float norm_eps,
                           int64_t mrope, int64_t mrope_t, int64_t mrope_h, int64_t mrope_w, bool rotary_tail,
                           int64_t norm_type, bool norm_after, bool q_gate, bool rope_switch, int64_t floor_scale) {
  return RopeAndCache(q, k, v, key_cache, value_cache, slots, positions, cos, sin, k_scale, v_scale, layer,
                      q_norm_weight, k_norm_weight, extra, &*q_out, &*k_out, &*key_cache_out, &*value_cache_out,
                      nullptr, nullptr, layout, is_neox, rotary_dim, native, q_norm, k_norm, norm_eps, mrope, mrope_t,
                      mrope_h, mrope_w, rotary_tail, norm_type, norm_after, q_gate, rope_switch, floor_scale);
}

// Per-token scales: two more results, the scale caches (aliased to the k_scale / v_scale operands).
ffi::Error CpuRopeAndCacheTokenScales(
    ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer key_cache, ffi::AnyBuffer value_cache,
    ffi::AnyBuffer slots, ffi::AnyBuffer positions, ffi::AnyBuffer cos, ffi::AnyBuffer sin, ffi::AnyBuffer k_scale,
    ffi::AnyBuffer v_scale, ffi::AnyBuffer layer, ffi::AnyBuffer q_norm_weight, ffi::AnyBuffer k_norm_weight,
    ffi::RemainingArgs extra, ffi::Result<ffi::AnyBuffer> q_out, ffi::Result<ffi::AnyBuffer> k_out, ffi::Result<ffi::AnyBuffer> key_cache_out,
    ffi::Result<ffi::AnyBuffer> value_cache_out, ffi::Result<ffi::AnyBuffer> k_sc_out,
    ffi::Result<ffi::AnyBuffer> v_sc_out, int64_t layout, bool is_neox, int64_t rotary_dim, bool native, bool q_norm,
    bool k_norm, float norm_eps, int64_t mrope, int64_t mrope_t, int64_t mrope_h, int64_t mrope_w, bool rotary_tail,
    int64_t norm_type, bool norm_after, bool q_gate, bool rope_switch, int64_t floor_scale) {
  return RopeAndCache(q, k, v, key_cache, value_cache, slots, positions, cos, sin, k_scale, v_scale, layer,
                      q_norm_weight, k_norm_weight, extra, &*q_out, &*k_out, &*key_cache_out, &*value_cache_out,
                      &*k_sc_out, &*v_sc_out, layout, is_neox, rotary_dim, native, q_norm, k_norm, norm_eps, mrope,
                      mrope_t, mrope_h, mrope_w, rotary_tail, norm_type, norm_after, q_gate, rope_switch, floor_scale);
}

// The operands and attributes of both handlers; `rets` adds the results.
auto BindArgs() {
  return ffi::Ffi::Bind()
      .Arg<ffi::AnyBuffer>()   // q
      .Arg<ffi::AnyBuffer>()   // k
      .Arg<ffi::AnyBuffer>()   // v
      .Arg<ffi::AnyBuffer>()   // key_cache
      .Arg<ffi::AnyBuffer>()   // value_cache
      .Arg<ffi::AnyBuffer>()   // slot_mapping
      .Arg<ffi::AnyBuffer>()   // positions
      .Arg<ffi::AnyBuffer>()   // cos
      .Arg<ffi::AnyBuffer>()   // sin
      .Arg<ffi::AnyBuffer>()   // k_scale (f32[] / [1] / [KH], 1 when unused; the scale cache with per-token scales)
      .Arg<ffi::AnyBuffer>()   // v_scale
      .Arg<ffi::AnyBuffer>()   // layer (i32[], used with stacked caches)
      .Arg<ffi::AnyBuffer>()   // q_norm_weight ([D]; f32[1] when q_norm is off)
      .Arg<ffi::AnyBuffer>()   // k_norm_weight
      .RemainingArgs()         // contract.extra_operands: use_rope (rope_switch), temperature_factors (floor_scale > 0)
      .Ret<ffi::AnyBuffer>()   // q_out
      .Ret<ffi::AnyBuffer>()   // k_out
      .Ret<ffi::AnyBuffer>()   // key_cache (aliased)
      .Ret<ffi::AnyBuffer>();  // value_cache (aliased)
}

template <class B>
auto BindAttrs(B&& b) {
  return std::forward<B>(b)
      .template Attr<int64_t>("layout")
      .template Attr<bool>("is_neox")
      .template Attr<int64_t>("rotary_dim")
      .template Attr<bool>("native")
      .template Attr<bool>("q_norm")
      .template Attr<bool>("k_norm")
      .template Attr<float>("norm_eps")
      .template Attr<int64_t>("mrope")     // RcMrope; positions [3, T] unless off
      .template Attr<int64_t>("mrope_t")   // sections: frequencies per stream
      .template Attr<int64_t>("mrope_h")
      .template Attr<int64_t>("mrope_w")
      .template Attr<bool>("rotary_tail")     // rotary channels [D - R, D) instead of [0, R)
      .template Attr<int64_t>("norm_type")    // RcNormType
      .template Attr<bool>("norm_after")      // the QK-norm after the rotation
      .template Attr<bool>("q_gate")          // gated fused rows: q head h at row 2h, its gate at 2h + 1
      .template Attr<bool>("rope_switch")     // a use_rope operand follows OPERANDS (nonzero: rotate)
      .template Attr<int64_t>("floor_scale");  // > 0: the temperature_factors operand follows (Llama 4)
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(kCpuRopeAndCache, CpuRopeAndCache, BindAttrs(BindArgs()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(kCpuRopeAndCacheTokenScales, CpuRopeAndCacheTokenScales,
                              BindAttrs(BindArgs().Ret<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>()));  // the scale caches


}  // namespace jax_rope_cache
