// mla_rope_and_cache as ONE CUDA kernel, compiled at lowering time by NVRTC
// (jax_rope_cache/mla/kernels.py: mla_kernel_config, compile_mla).
//
// What it computes (jax_rope_cache/mla/reference.py is the definition):
//   q_out[t, h]  = cat(q_nope[t, h], rope(q_pe[t, h]))        [Dn + Dr], q_out's dtype (input or fp8)
//   k_pe_out[t]  = rope(k_pe[t])                              [Dr]
//   latent row of slot s = cat(kv_c[t], rope(k_pe[t]))        combined cache [.., Dc + Dr], or
//                                                             split: ckv [.., Dc] and kpe [.., Dr]
//
// Static configuration (-D, all required):
//   MLA_QH, MLA_DN, MLA_DC, MLA_DR, MLA_BS   heads, q_nope width, latent width, rope width, block size
//   MLA_SPLIT_CACHE                          0: one combined cache, 1: ckv + kpe caches
//   MLA_NEOX, MLA_FULL_TABLE, MLA_NATIVE     rotation style, table form, precision ("native" = 1)
//   MLA_DT, MLA_TAB_DT, MLA_CACHE_DT, MLA_Q_DT  RcDtype codes: inputs, tables, cache(s), q_out
//   MLA_SLOT64, MLA_POS64                    int64 slot_mapping / positions (else int32)
//   MLA_LAYER_BLOCKS                         0: caches [NB, BS, row]; NB > 0: stacked [L, NB, BS, row],
//                                            the layer read from the `layer` operand
//   MLA_W                                    elements per copy chunk (divides Dn and Dc; <= 16 bytes)
//   MLA_RW                                   elements per rotation chunk (divides Dr/2 for NeoX; even,
//                                            dividing Dr for GPT-J)
//   MLA_TPB, MLA_NT, MLA_PARTS, MLA_MINB     tokens per block, threads, blocks per token block
//                                            (grid.y), blocks per SM of the register budget
//   MLA_UNROLL                               copy units a thread loads before it stores (1..8; the
//                                            configuration gives each thread's copy units one round)
//
// Kernel ABI (kernels/ffi/gpu_launcher.cc, generic): one struct by value holding the device pointers
// of the NA operands then the NR results, then int64 dim0 of every operand:
//   combined: NA = 12 (q_nope, q_pe, kv_c, k_pe, kv_cache, slot_mapping, positions, cos, sin,
//             kv_scale, q_scale, layer), NR = 3 (q_out, k_pe_out, kv_cache)
//   split:    NA = 13 (kv_cache -> ckv_cache, kpe_cache), NR = 4
// Grid: (ceil(T / MLA_TPB), MLA_PARTS, 1) blocks of MLA_NT threads, T = dim0[0]; no shared memory.
//
// Work: a block owns MLA_TPB tokens and a list of independent units; part y of a block takes units
// y * NT + tid, + NT * PARTS, ... Units: first the copy units (token, then q_nope chunks of every head,
// then kv_c chunks: one MLA_W-element vector each, consecutive lanes on consecutive chunks), issued
// MLA_UNROLL at a time (all loads, then all stores); then the rotation units (token, head h <= QH, chunk
// j; h == QH is k_pe), each loading its chunk(s), its position and its table values.
// One token per block (MLA_TPB 1): its position and slot are loaded once, before any unit, so no
// unit's table loads or cache stores wait on an index load of their own.
// Bounds: positions clamped to [0, max_pos - 1]; a slot writes only if 0 <= slot < NB*BS (and, stacked,
// 0 <= layer < L); offsets are 64-bit. q_out and k_pe_out are written for every token.
// Arithmetic: kernels/common/rope_cache_math.h (NVRTC with --fmad=false), bit-exact to the reference;
// copies into a cache or q_out of the input dtype keep their bits.
#ifdef RC_EMULATE
#include "host_emulation.h"  // CPU build for tests: every thread of a block run in turn
#endif
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
#define RC_HW_CVT 1
#endif
#include "rope_cache_math.h"

#ifndef MLA_QH
#error "mla_cache.cu needs its -D configuration (see the header comment)"
#endif
#ifndef MLA_UNROLL
#define MLA_UNROLL 4
#endif

namespace mla {

typedef long long i64;
constexpr int QH = MLA_QH, DN = MLA_DN, DC = MLA_DC, DR = MLA_DR, BS = MLA_BS;
constexpr bool SPLIT_CACHE = MLA_SPLIT_CACHE != 0, NEOX = MLA_NEOX != 0, FULL = MLA_FULL_TABLE != 0;
constexpr int DT = MLA_DT, TAB_DT = MLA_TAB_DT, CDT = MLA_CACHE_DT, QDT = MLA_Q_DT;
constexpr int LAYER_BLOCKS = MLA_LAYER_BLOCKS;
constexpr int W = MLA_W, RW = MLA_RW, TPB = MLA_TPB, NT = MLA_NT, PARTS = MLA_PARTS, UNROLL = MLA_UNROLL;
constexpr int ARITH = rc_arith(MLA_NATIVE != 0, DT, TAB_DT);
constexpr bool FUSED = ARITH == RC_ARITH_FUSED;
constexpr bool is_fp8(int c) { return c == RC_FP8_E4M3FN || c == RC_FP8_E4M3FNUZ || c == RC_FP8_E5M2; }
constexpr int size_of(int c) { return c == RC_F32 ? 4 : is_fp8(c) ? 1 : 2; }
constexpr bool C_FP8 = is_fp8(CDT), Q_FP8 = is_fp8(QDT);
constexpr int S_IN = size_of(DT), S_C = size_of(CDT), S_Q = size_of(QDT);
constexpr int HALF = DR / 2, TW = FULL ? DR : HALF, DQ = DN + DR;
constexpr int ROW0 = SPLIT_CACHE ? DC : DC + DR;  // elements per slot of the first cache
constexpr int NC = SPLIT_CACHE ? 2 : 1;             // caches
constexpr int NA = 11 + NC, NR = 2 + NC;            // operands, results
// operand / result indices
constexpr int A_QNOPE = 0, A_QPE = 1, A_KVC = 2, A_KPE = 3, A_C0 = 4, A_SLOT = 4 + NC, A_POS = 5 + NC,
              A_COS = 6 + NC, A_SIN = 7 + NC, A_KVS = 8 + NC, A_QS = 9 + NC, A_LAYER = 10 + NC;
constexpr int R_Q = NA, R_KPE = NA + 1, R_C0 = NA + 2, R_C1 = NA + 3;

static_assert(DN % W == 0 && DC % W == 0 && DR % W == 0, "MLA_W must divide Dn, Dc and Dr");
static_assert(NEOX ? HALF % RW == 0 : (RW % 2 == 0 && DR % RW == 0), "MLA_RW does not fit Dr");

constexpr int CN = DN / W, CCH = DC / W;     // copy chunks per q head, per kv_c row
constexpr int CU = QH * CN + CCH;            // copy units per token
constexpr int P = NEOX ? HALF / RW : DR / RW;  // rotation units per rotated row
constexpr int RU = (QH + 1) * P;             // rotation units per token
constexpr int N_COPY = TPB * CU, N_ROT = TPB * RU, N_UNITS = N_COPY + N_ROT;
constexpr int STRIDE = NT * PARTS;

struct Params {
  void* ptr[NA + NR];
  i64 dim0[NA];
};

#ifdef RC_EMULATE
// Units each emulated block ran, and their index sum (every unit exactly once over its parts and threads).
static i64 emu_units = 0, emu_sum = 0;
static void emu_count(int u) { ++emu_units, emu_sum += u; }
#endif

// Raw vectors of B bytes (one access).
template <int B> struct Vec;
template <> struct Vec<16> { typedef uint4 T; };
template <> struct Vec<8> { typedef uint2 T; };
template <> struct Vec<4> { typedef unsigned int T; };
template <> struct Vec<2> { typedef unsigned short T; };
template <> struct Vec<1> { typedef unsigned char T; };

// N elements of S bytes as one vector access. Elements are read and written with shifts of 32-bit
// words (never byte arrays in a union, which ptxas would put on the stack).
template <int N, int S>
struct Chunk {
  static constexpr int B = N * S, NW = B >= 4 ? B / 4 : 1;
  union {
    typename Vec<B>::T v;
    unsigned int w[NW];
  };
  __device__ __forceinline__ unsigned int get(int e) const {
    constexpr unsigned int mask = S == 4 ? 0xffffffffu : (1u << (8 * S)) - 1u;
    if constexpr (B >= 4) return (w[e * S / 4] >> (8 * (e * S % 4))) & mask;
    else return ((unsigned int)v >> (8 * e * S)) & mask;
  }
  __device__ __forceinline__ void set(int e, unsigned int x) {
    constexpr unsigned int mask = S == 4 ? 0xffffffffu : (1u << (8 * S)) - 1u;
    if constexpr (B >= 4) {
      const int i = e * S / 4, sh = 8 * (e * S % 4);
      w[i] = S == 4 ? x : ((w[i] & ~(mask << sh)) | ((x & mask) << sh));
    } else {
      const int sh = 8 * e * S;
      v = (typename Vec<B>::T)((((unsigned int)v) & ~(mask << sh)) | ((x & mask) << sh));
    }
  }
};

template <int N, int S>
__device__ __forceinline__ Chunk<N, S> load(const void* base, i64 elem) {
  Chunk<N, S> c;
  c.v = *reinterpret_cast<const typename Vec<N * S>::T*>(static_cast<const char*>(base) + elem * S);
  return c;
}

template <int N, int S>
__device__ __forceinline__ void store(void* base, i64 elem, const Chunk<N, S>& c) {
  *reinterpret_cast<typename Vec<N * S>::T*>(static_cast<char*>(base) + elem * S) = c.v;
}

template <int C>
__device__ __forceinline__ float to_f32(unsigned int raw) {
  if (C == RC_F32) return rc_bits_f32(raw);
  if (C == RC_BF16) return rc_bf16_to_f32((rc_u16)raw);
  return rc_f16_to_f32((rc_u16)raw);
}

// float32 v as an element of dtype C: rounded (canonical NaN) for f32/bf16/f16, quantized with inv for fp8.
template <int C>
__device__ __forceinline__ unsigned int from_f32(float v, float inv) {
  if constexpr (C == RC_F32) return rc_f32_bits(rc_canonical_f32(v));
  else if constexpr (C == RC_BF16) return rc_f32_to_bf16(v);
  else if constexpr (C == RC_F16) return rc_f32_to_f16(v);
  else return rc_quantize_fp8(v, inv, static_cast<RcDtype>(C));
}

// A chunk of inputs as an output of dtype C: the same bits (C == DT), else quantized.
template <int N, int C>
__device__ __forceinline__ Chunk<N, size_of(C)> convert(const Chunk<N, S_IN>& x, float inv) {
  Chunk<N, size_of(C)> o;
  if constexpr (C == DT) {
    o.v = x.v;
  } else {
#pragma unroll
    for (int e = 0; e < N; ++e) o.set(e, from_f32<C>(to_f32<DT>(x.get(e)), inv));
  }
  return o;
}

__device__ __forceinline__ i64 load_index(const void* base, i64 i, bool is64) {
  return is64 ? static_cast<const i64*>(base)[i] : (i64) static_cast<const int*>(base)[i];
}

__device__ __forceinline__ float tab(const void* base, i64 i) {
  if (TAB_DT == RC_F32) return static_cast<const float*>(base)[i];
  return to_f32<TAB_DT>(static_cast<const rc_u16*>(base)[i]);
}

// The slots this call writes: slot s in [0, n) lands at cache slot base + s.
struct SlotRange {
  i64 n, base;
};

// Position and slot of the block's token, loaded in the prologue where the block has one token.
struct TokenIdx {
  i64 pos, slot;
};

__device__ __forceinline__ i64 token_pos(const Params& p, i64 t, TokenIdx pre) {
  return TPB == 1 ? pre.pos : load_index(p.ptr[A_POS], t, MLA_POS64 != 0);
}

__device__ __forceinline__ i64 token_slot(const Params& p, i64 t, TokenIdx pre) {
  return TPB == 1 ? pre.slot : load_index(p.ptr[A_SLOT], t, MLA_SLOT64 != 0);
}

// Rotated values of one chunk, stored to `dst` (dtype C) at the element offsets of the pairs.
template <int C>
__device__ __forceinline__ void store_rot(void* dst, i64 row, int j, const float* ya, const float* yb, float inv) {
  constexpr int SC = size_of(C);
  // fp8 outputs quantize the rounded value, or in fused arithmetic the f32 value before rounding
  auto val = [&](float y) { return (is_fp8(C) && !FUSED) ? rc_round_to(y, DT) : y; };
  if constexpr (NEOX) {
    Chunk<RW, SC> a, b;
#pragma unroll
    for (int e = 0; e < RW; ++e) a.set(e, from_f32<C>(val(ya[e]), inv)), b.set(e, from_f32<C>(val(yb[e]), inv));
    store<RW, SC>(dst, row + j * RW, a);
    store<RW, SC>(dst, row + HALF + j * RW, b);
  } else {
    Chunk<RW, SC> o;
#pragma unroll
    for (int e = 0; e < RW / 2; ++e) o.set(2 * e, from_f32<C>(val(ya[e]), inv)), o.set(2 * e + 1, from_f32<C>(val(yb[e]), inv));
    store<RW, SC>(dst, row + j * RW, o);
  }
}

constexpr int NP = NEOX ? RW : RW / 2;  // pairs per rotation unit

__device__ __forceinline__ void rot_unit(const Params& p, i64 T, i64 t0, int u, SlotRange sr, TokenIdx pre,
                                         float inv_q, float inv_kv) {
  const int tt = u / RU, r = u % RU, h = r / P, j = r % P;
  const i64 t = t0 + tt;
  if (t >= T) return;
  const bool is_k = h == QH;
  const void* x = is_k ? p.ptr[A_KPE] : p.ptr[A_QPE];
  const i64 xrow = is_k ? t * DR : (t * QH + h) * (i64)DR;
  // the data first, then the position; the table values depend on it
  Chunk<RW, S_IN> xa, xb;
  xa = load<RW, S_IN>(x, xrow + j * RW);
  if (NEOX) xb = load<RW, S_IN>(x, xrow + HALF + j * RW);
  const i64 max_pos = p.dim0[A_COS];
  i64 pos = token_pos(p, t, pre);
  pos = pos < 0 ? 0 : (pos >= max_pos ? max_pos - 1 : pos);
  const i64 trow = pos * TW;
  float ya[NP], yb[NP];
#pragma unroll
  for (int e = 0; e < NP; ++e) {
    const int i = j * NP + e;  // pair index
    const float a = to_f32<DT>(NEOX ? xa.get(e) : xa.get(2 * e));
    const float b = to_f32<DT>(NEOX ? xb.get(e) : xa.get(2 * e + 1));
    const int ca = FULL ? (NEOX ? i : 2 * i) : i, cb = FULL ? (NEOX ? i + HALF : 2 * i + 1) : i;
    rc_rotate_pair(a, b, tab(p.ptr[A_COS], trow + ca), tab(p.ptr[A_SIN], trow + ca), tab(p.ptr[A_COS], trow + cb),
                   tab(p.ptr[A_SIN], trow + cb), ARITH, &ya[e], &yb[e]);
  }
  if (!is_k) {
    store_rot<QDT>(p.ptr[R_Q], (t * QH + h) * (i64)DQ + DN, j, ya, yb, inv_q);
    return;
  }
  store_rot<DT>(p.ptr[R_KPE], t * DR, j, ya, yb, 1.0f);
  const i64 s = token_slot(p, t, pre);
  if (s < 0 || s >= sr.n) return;
  const i64 slot = sr.base + s;
  if (SPLIT_CACHE) store_rot<CDT>(p.ptr[R_C1], slot * DR, j, ya, yb, inv_kv);
  else store_rot<CDT>(p.ptr[R_C0], slot * ROW0 + DC, j, ya, yb, inv_kv);
}

// Copy unit c of the block: (token, chunk) of q_nope (every head) or of kv_c.
struct CopyUnit {
  i64 src, dst;  // element offsets; dst < 0: nothing to store (token past T, or an invalid slot)
  bool latent, load;  // load: the token is < T (the load never waits on the slot; only the store does)
};

__device__ __forceinline__ CopyUnit copy_unit(const Params& p, i64 T, i64 t0, int c, SlotRange sr, TokenIdx pre) {
  const int tt = c / CU, r = c % CU;
  const i64 t = t0 + tt;
  CopyUnit u{0, -1, false, false};
  if (t >= T) return u;
  u.load = true;
  if (r < QH * CN) {
    const int h = r / CN, j = r % CN;
    u.src = (t * QH + h) * (i64)DN + j * W;
    u.dst = (t * QH + h) * (i64)DQ + j * W;
  } else {
    const int j = r - QH * CN;
    u.latent = true;
    u.src = t * DC + j * W;
    const i64 s = token_slot(p, t, pre);
    u.dst = (s >= 0 && s < sr.n) ? (sr.base + s) * ROW0 + j * W : -1;
  }
  return u;
}

}  // namespace mla

extern "C" __global__ void __launch_bounds__(MLA_NT, MLA_MINB) mla_cache_kernel(const mla::Params p) {
  using namespace mla;
  const i64 T = p.dim0[A_QPE];
  const i64 t0 = (i64)blockIdx.x * TPB;
  SlotRange sr{p.dim0[A_C0] * BS, 0};
  if (LAYER_BLOCKS > 0) {  // stacked [L, NB, ...]: a layer outside [0, L) writes nothing
    const i64 layer = *static_cast<const int*>(p.ptr[A_LAYER]), per_layer = (i64)LAYER_BLOCKS * BS;
    sr = (layer >= 0 && layer < p.dim0[A_C0]) ? SlotRange{per_layer, layer * per_layer} : SlotRange{0, 0};
  }
  TokenIdx pre{0, -1};
  if (TPB == 1 && t0 < T)
    pre = TokenIdx{load_index(p.ptr[A_POS], t0, MLA_POS64 != 0), load_index(p.ptr[A_SLOT], t0, MLA_SLOT64 != 0)};
  const float inv_q = Q_FP8 ? rc_inv_scale(*static_cast<const float*>(p.ptr[A_QS])) : 1.0f;
  const float inv_kv = C_FP8 ? rc_inv_scale(*static_cast<const float*>(p.ptr[A_KVS])) : 1.0f;
  const int u0 = (PARTS > 1 ? (int)blockIdx.y * NT : 0) + (int)threadIdx.x;
  int u = u0;
  // copy units, UNROLL at a time: every load first, then every store
#pragma unroll 1
  for (; u < N_COPY; u += UNROLL * STRIDE) {
    CopyUnit cu[UNROLL];
    Chunk<W, S_IN> x[UNROLL];
#pragma unroll
    for (int k = 0; k < UNROLL; ++k) {
      const int c = u + k * STRIDE;
      cu[k] = c < N_COPY ? copy_unit(p, T, t0, c, sr, pre) : CopyUnit{0, -1, false, false};
      if (cu[k].load) x[k] = load<W, S_IN>(cu[k].latent ? p.ptr[A_KVC] : p.ptr[A_QNOPE], cu[k].src);
#ifdef RC_EMULATE
      if (c < N_COPY) emu_count(c);
#endif
    }
#pragma unroll
    for (int k = 0; k < UNROLL; ++k) {
      if (cu[k].dst < 0) continue;
      if (cu[k].latent) store<W, S_C>(p.ptr[R_C0], cu[k].dst, convert<W, CDT>(x[k], inv_kv));
      else store<W, S_Q>(p.ptr[R_Q], cu[k].dst, convert<W, QDT>(x[k], inv_q));
    }
  }
  // rotation units: this thread's first unit index >= N_COPY (u0 + m * STRIDE)
  u = u0 < N_COPY ? u0 + (N_COPY - u0 + STRIDE - 1) / STRIDE * STRIDE : u0;
#pragma unroll 1
  for (; u < N_UNITS; u += STRIDE) {
#ifdef RC_EMULATE
    emu_count(u);
#endif
    rot_unit(p, T, t0, u - N_COPY, sr, pre, inv_q, inv_kv);
  }
}

#ifdef RC_EMULATE
// Runs the whole grid on the host, block after block, every part and thread in turn (the kernel has
// no shared memory and no barrier); returns the blocks whose units did not run exactly once each.
extern "C" int mla_emulate(const mla::Params* p, long long grid) {
  int errors = 0;
  for (long long b = 0; b < grid; ++b) {
    mla::emu_units = mla::emu_sum = 0;
    for (int y = 0; y < mla::PARTS; ++y)
      for (int tid = 0; tid < mla::NT; ++tid) {
        blockIdx.x = (unsigned)b, blockIdx.y = (unsigned)y, threadIdx.x = (unsigned)tid;
        mla_cache_kernel(*p);
      }
    const long long n = mla::N_UNITS;
    if (mla::emu_units != n || mla::emu_sum != n * (n - 1) / 2) ++errors;
  }
  return errors;
}
extern "C" int mla_units() { return mla::N_UNITS; }
extern "C" int mla_num_operands() { return mla::NA; }
#endif
