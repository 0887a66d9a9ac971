// Reference kernels for benchmarks/diagnostics/kernel_speed.py: the memory traffic of rope_and_cache without its
// arithmetic, to measure what bounds the op (floors), and an exhaustive check of the hardware
// f32 -> bf16/f16 conversions used by kernels/cuda/rope_cache.cu against the integer code of
// kernels/common/rope_cache_math.h. bf16 everywhere, int32 slots, BS / X / heads as -D.
//   FL_KH, FL_D, FL_BS, FL_QH    heads, head dim, block size (X = 8: bf16)
#include "rope_cache_math.h"

typedef long long i64;
typedef unsigned short u16;

#ifndef FL_KH
#define FL_KH 1
#define FL_D 64
#define FL_BS 16
#define FL_QH 8
#endif
constexpr int KH = FL_KH, D = FL_D, BS = FL_BS, QH = FL_QH, X = 8;

// V cache x-packed [NB, KH, D, BS], write only: one thread per (token, head, d), d fastest
// (a warp writes 2 bytes into each of 32 neighbouring sectors of one block).
extern "C" __global__ void floor_v_xp_d(const int* slots, u16* vc, i64 T, i64 nslots) {
  const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= T * KH * D) return;
  const int d = (int)(i % D);
  const i64 th = i / D;
  const int h = (int)(th % KH);
  const i64 t = th / KH;
  const i64 s = slots[t];
  if (s < 0 || s >= nslots) return;
  vc[((s / BS * KH + h) * D + d) * BS + s % BS] = (u16)(d + 1);
}

// The same writes with tokens fastest (a warp writes 32 tokens' elements: 32 different blocks).
extern "C" __global__ void floor_v_xp_t(const int* slots, u16* vc, i64 T, i64 nslots) {
  const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= T * KH * D) return;
  const i64 t = i % T;
  const i64 hd = i / T;
  const int d = (int)(hd % D), h = (int)(hd / D);
  const i64 s = slots[t];
  if (s < 0 || s >= nslots) return;
  vc[((s / BS * KH + h) * D + d) * BS + s % BS] = (u16)(d + 1);
}

// K cache x-packed [NB, KH, D/X, BS, X], write only: one 16-byte piece per (token, head, d/X).
extern "C" __global__ void floor_k_xp(const int* slots, uint4* kc, i64 T, i64 nslots) {
  const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= T * KH * (D / X)) return;
  const int c = (int)(i % (D / X));
  const i64 th = i / (D / X);
  const int h = (int)(th % KH);
  const i64 t = th / KH;
  const i64 s = slots[t];
  if (s < 0 || s >= nslots) return;
  kc[(s / BS * KH + h) * (D / X) * BS + c * BS + s % BS] = make_uint4(c, 1, 2, 3);
}

// The op's whole memory traffic with no arithmetic and no table: q -> q_out, k -> k_out and the K
// cache, v -> the V cache; flash (FL_XP = 0) or x-packed. One thread per 16-byte chunk of q/k/v of
// one token (V x-packed: per element, d fastest).
#ifndef FL_XP
#define FL_XP 0
#endif
__device__ __forceinline__ uint4 xor4(uint4 a, uint4 b) { return make_uint4(a.x ^ b.x, a.y ^ b.y, a.z ^ b.z, a.w ^ b.w); }

// TAB: the q/k chunks also read the table traffic of the op (bf16 half tables [max_pos, D/2]:
// the position, then 16 bytes of cos and of sin at it, mixed in by xor), so the floor counts the
// dependent position -> table step and the table's bytes too (floor_op_tab).
template <bool TAB>
__device__ __forceinline__ void op_traffic(const uint4* q, const uint4* k, const u16* v, const int* slots,
                                           const int* pos, const uint4* cos, const uint4* sin, uint4* q_out,
                                           uint4* k_out, uint4* kc, u16* vc, i64 T, i64 nslots) {
  constexpr int CQ = QH * D / 8, CK = KH * D / 8, CV = FL_XP ? KH * D : KH * D / 8;
  const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
  const i64 t = i / (CQ + CK + CV);
  if (t >= T) return;
  const int u = (int)(i % (CQ + CK + CV));
  uint4 m = make_uint4(0, 0, 0, 0);
  if (TAB && u < CQ + CK) {
    const int p = pos[t];
    const i64 row = (i64)(p < 0 ? 0 : p) * (D / 16) + (u % (D / 8)) % (D / 16);
    m = xor4(cos[row], sin[row]);
  }
  if (u < CQ) {
    q_out[t * CQ + u] = xor4(q[t * CQ + u], m);
    return;
  }
  const i64 s = slots[t];
  const bool ok = s >= 0 && s < nslots;
  if (u < CQ + CK) {
    const int c = u - CQ;
    const uint4 x = xor4(k[t * CK + c], m);
    k_out[t * CK + c] = x;
    if (!ok) return;
    const int h = c / (D / 8), cc = c % (D / 8);
    if (FL_XP) kc[(s / BS * KH + h) * (D / X) * BS + cc * BS + s % BS] = x;
    else kc[(s * KH + h) * (D / 8) + cc] = x;
    return;
  }
  const int c = u - CQ - CK;
  if (FL_XP) {
    const u16 x = v[t * KH * D + c];
    if (ok) vc[((s / BS * KH + c / D) * D + c % D) * BS + s % BS] = x;
  } else {
    const uint4 x = reinterpret_cast<const uint4*>(v)[t * CK + c];
    if (ok) reinterpret_cast<uint4*>(vc)[s * CK + c] = x;
  }
}

extern "C" __global__ void floor_op(const uint4* q, const uint4* k, const u16* v, const int* slots, uint4* q_out,
                                    uint4* k_out, uint4* kc, u16* vc, i64 T, i64 nslots) {
  op_traffic<false>(q, k, v, slots, nullptr, nullptr, nullptr, q_out, k_out, kc, vc, T, nslots);
}

extern "C" __global__ void floor_op_tab(const uint4* q, const uint4* k, const u16* v, const int* slots,
                                        uint4* q_out, uint4* k_out, uint4* kc, u16* vc, i64 T, i64 nslots,
                                        const int* pos, const uint4* cos, const uint4* sin) {
  op_traffic<true>(q, k, v, slots, pos, cos, sin, q_out, k_out, kc, vc, T, nslots);
}

// Every f32 bit pattern through the conversion instructions and through the integer code:
// out[0] non-NaN bf16 mismatches, out[1] NaN inputs whose bf16 is not 0x7FFF, out[2..3] the same
// for f16, out[4..5] packed bf16x2 / f16x2 (pairs (u, ~u)) vs the scalar instructions,
// out[6..13] the first mismatching inputs.
extern "C" __global__ void check_cvt(unsigned long long* out) {
  const unsigned long long n = 1ull << 32;
  for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (unsigned long long)gridDim.x * blockDim.x) {
    const unsigned u = (unsigned)i;
    const float f = __uint_as_float(u);
    const bool nan = (u & 0x7fffffffu) > 0x7f800000u;
    u16 hb, hh;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(hb) : "f"(f));
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(hh) : "f"(f));
    const u16 sb = rc_f32_to_bf16(f), sh = rc_f32_to_f16(f);
    if (nan ? hb != 0x7fff : hb != sb) {
      if (atomicAdd(&out[nan ? 1 : 0], 1ull) == 0) out[6 + (nan ? 1 : 0)] = u;
    }
    if (nan ? hh != 0x7fff : hh != sh) {
      if (atomicAdd(&out[nan ? 3 : 2], 1ull) == 0) out[8 + (nan ? 1 : 0)] = u;
    }
    const float g = __uint_as_float(~u);
    u16 gb, gh;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(gb) : "f"(g));
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(gh) : "f"(g));
    unsigned pb, ph;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(pb) : "f"(g), "f"(f));
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(ph) : "f"(g), "f"(f));
    if (pb != ((unsigned)hb | ((unsigned)gb << 16))) {
      if (atomicAdd(&out[4], 1ull) == 0) out[10] = u;
    }
    if (ph != ((unsigned)hh | ((unsigned)gh << 16))) {
      if (atomicAdd(&out[5], 1ull) == 0) out[11] = u;
    }
  }
}

// Every pair of 16-bit operands (a, c) through mul.rn.bf16x2 / mul.rn.f16x2 (as used by the native
// packed path of rope_cache.cu) vs the f32 product rounded once (cvt.rn, equal to the integer
// rounding above): out[0] bf16 mismatches, out[1] f16 mismatches (both-NaN counts as equal; NaN
// results are counted separately in out[2] bf16 / out[3] f16 when not 0x7FFF), out[4..5] first.
extern "C" __global__ void check_mul(unsigned long long* out) {
  const unsigned long long n = 1ull << 32;
  for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (unsigned long long)gridDim.x * blockDim.x) {
    const unsigned a = (unsigned)(i & 0xffffu), c = (unsigned)(i >> 16);
    const unsigned x = a | (c << 16), y = c | (a << 16);  // (a*c) in both halves
    unsigned pb, ph;
    asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(pb) : "r"(x), "r"(y));
    asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(ph) : "r"(x), "r"(y));
    // bf16 reference
    const float fb = __uint_as_float(a << 16) * __uint_as_float(c << 16);
    u16 rb;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(rb) : "f"(fb));
    const u16 hb0 = (u16)(pb & 0xffffu), hb1 = (u16)(pb >> 16);
    const bool nb = (rb & 0x7fffu) > 0x7f80u;
    for (int k = 0; k < 2; ++k) {
      const u16 hb = k ? hb1 : hb0;
      const bool hnan = (hb & 0x7fffu) > 0x7f80u;
      if (nb ? !hnan : hb != rb) {
        if (atomicAdd(&out[0], 1ull) == 0) out[4] = i;
      }
      if (hnan && hb != 0x7fffu) atomicAdd(&out[2], 1ull);
    }
    // f16 reference
    float fa16, fc16;
    asm("{\n\t.reg .b16 t;\n\tmov.b16 t, %1;\n\tcvt.f32.f16 %0, t;\n\t}" : "=f"(fa16) : "h"((u16)a));
    asm("{\n\t.reg .b16 t;\n\tmov.b16 t, %1;\n\tcvt.f32.f16 %0, t;\n\t}" : "=f"(fc16) : "h"((u16)c));
    const float fh = fa16 * fc16;
    u16 rh;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(rh) : "f"(fh));
    const bool nh = (rh & 0x7fffu) > 0x7c00u;
    for (int k = 0; k < 2; ++k) {
      const u16 hh = k ? (u16)(ph >> 16) : (u16)(ph & 0xffffu);
      const bool hnan = (hh & 0x7fffu) > 0x7c00u;
      if (nh ? !hnan : hh != rh) {
        if (atomicAdd(&out[1], 1ull) == 0) out[5] = i;
      }
      if (hnan && hh != 0x7fffu) atomicAdd(&out[3], 1ull);
    }
  }
}

// Decode floors: an empty kernel (the launch and graph-node cost), and the op's dependent chain
// alone (position -> table row -> one store per thread, q/k loaded beside the position).
extern "C" __global__ void null_kernel(i64 T) {}

extern "C" __global__ void chain2(const int* pos, const uint4* tab, const uint4* q, uint4* out, i64 T) {
  const i64 t = blockIdx.x;
  if (t >= T) return;
  const uint4 x = q[t * blockDim.x + threadIdx.x];
  const int p = pos[t];
  const uint4 c = tab[(i64)(p < 0 ? 0 : p) * 4 + threadIdx.x % 4];
  out[t * blockDim.x + threadIdx.x] = xor4(x, c);
}
