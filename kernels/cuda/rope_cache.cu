// rope_and_cache as ONE CUDA kernel, compiled at lowering time by NVRTC (jax_rope_cache/_nvrtc.py).
//
// Static configuration (one compiled variant per call-site shape, all required, set with -D by
// jax_rope_cache/cuda.py):
//   RC_QH, RC_KH, RC_D, RC_R     query heads, kv heads, head_dim, rotary_dim
//   RC_BS                        cache block size
//   RC_LAYOUT                    RcLayout (0 flash, 1 xpacked, 2 xpacked_shuffled)
//   RC_NEOX, RC_FULL_TABLE       1/0
//   RC_NATIVE                    1: "native" precision (rc_arith picks "rounded" or "fused" arithmetic
//                                from RC_DT and RC_TAB_DT), 0: "fp32"
//   RC_DT, RC_TAB_DT, RC_CACHE_DT  RcDtype codes of q/k/v (and outputs), cos/sin, the caches
//   RC_SLOT64, RC_POS64          1: int64 slot_mapping / positions, 0: int32
//   RC_LAYER_BLOCKS              0: one cache [NB, ...]; NB > 0: stacked caches [L, NB, ...], the
//                                layer to write read from the `layer` operand (a device scalar)
//   RC_WCH                       elements per chunk: 16 bytes of q/k/v where the shape allows
//                                (power of two; divides D and R, and R/2 for NeoX; even for GPT-J)
//   RC_TPB                       tokens per thread block
//   RC_NT                        threads per block (launch bound)
//   RC_UNROLL                    units per thread per round (memory-level parallelism)
//
// Kernel ABI (what kernels/ffi/gpu_launcher.cc passes; the launcher is generic and knows nothing of
// this op): one kernel parameter, a struct by value holding
//   void*  ptr[16]   device pointers of the 12 operands, then of the 4 results, in custom-call order:
//                    q, k, v, key_cache, value_cache, slot_mapping, positions, cos, sin, k_scale,
//                    v_scale, layer (int32) | q_out, k_out, key_cache_out, value_cache_out
//   int64  dim0[12]  the leading dimension of each operand (rank-0 operands: 1)
// Grid: (ceil(T / RC_TPB), 1, 1) blocks of RC_NT threads, T = dim0[0]; no dynamic shared memory.
// Runtime values: T = dim0[0], NB = dim0[3] (stacked: L = dim0[3]), max_pos = dim0[7]; every index
// (slots, positions, layer) comes from device
// buffers, so a captured CUDA graph replays correctly whatever the slots and positions hold.
//
// Work decomposition. A block owns RC_TPB consecutive tokens. Units of work (each one chunk of
// RC_WCH channels, loaded and stored with one vector access):
//   * V units     (token, kv head, chunk): copy v into the value cache;
//   * pass units  (token, q/k head, chunk >= R): copy channels >= R to q_out/k_out (and K cache);
//   * rot units   (token, q/k head, pair-chunk): rotate; NeoX loads chunk j and chunk j + R/2,
//                 GPT-J one chunk holding whole pairs; k heads also go to the key cache.
// The cos/sin rows of the block's tokens are read once per token into shared memory (as f32,
// exactly: tables are never rounded) and shared by all heads. V and pass
// units need no table, so they run while the table loads are in flight; each thread also
// prefetches its first round of rotation units before the barrier. Each thread works in rounds of
// RC_UNROLL units and issues all loads of a round before its first store, to keep enough bytes in
// flight for the memory system.
// For the x-packed layouts the V units are ordered token-fastest, so a warp writing a run of
// consecutive slots (prefill) stores consecutive offsets of one value row together.
//
// Bounds: positions are clamped to [0, max_pos-1]; a slot writes only if 0 <= slot < NB*BS (and,
// stacked, 0 <= layer < L);
// all offsets are 64-bit. q_out/k_out are written for every token.
// Arithmetic: kernels/common/rope_cache_math.h (rc_mul/rc_add/rc_sub/rc_fma are the _rn intrinsics,
// and NVRTC runs with --fmad=false, so the only FMA is rc_fma of "fused" native arithmetic),
// bit-exact to jax_rope_cache.reference in both precisions; subnormals kept (no --ftz); every NaN
// the kernel computes is the canonical one (rope_cache_math.h), copies keep their bits.
#ifdef RC_EMULATE
#include "host_emulation.h"  // CPU build for tests: one thread per block (RC_NT=1)
#endif
#include "rope_cache_math.h"

#ifndef RC_QH
#error "rope_cache.cu needs its -D configuration (see the header comment)"
#endif

namespace rc {

constexpr int QH = RC_QH, KH = RC_KH, D = RC_D, R = RC_R, BS = RC_BS;
constexpr int LAYER_BLOCKS = RC_LAYER_BLOCKS;
constexpr int RH = QH + KH;  // heads rotated per token
constexpr int W = RC_WCH;
constexpr int TPB = RC_TPB, NT = RC_NT;
constexpr bool NEOX = RC_NEOX != 0, FULL = RC_FULL_TABLE != 0, NATIVE = RC_NATIVE != 0;
constexpr int DT = RC_DT, TAB_DT = RC_TAB_DT, CDT = RC_CACHE_DT, LAYOUT = RC_LAYOUT;
constexpr int ARITH = rc_arith(NATIVE, DT, TAB_DT);  // RC_ARITH_FP32, "rounded" (DT) or RC_ARITH_FUSED
constexpr bool FP8 = CDT == RC_FP8_E4M3FN || CDT == RC_FP8_E4M3FNUZ;
// An fp8 key cache in "fused" arithmetic quantizes the rotated f32 values, not the rounded k_out.
constexpr bool WIDE_K = FP8 && ARITH == RC_ARITH_FUSED;
constexpr bool FNUZ = CDT == RC_FP8_E4M3FNUZ;
constexpr int S_IN = DT == RC_F32 ? 4 : 2;
constexpr int S_CACHE = FP8 ? 1 : S_IN;
constexpr int X = 16 / S_CACHE;          // x-packed group width
constexpr int HALF = R / 2;
constexpr int TW = FULL ? R : HALF;      // table row width
constexpr int CH = D / W;                // chunks per head row
constexpr int P = NEOX ? HALF / W : R / W;  // rotation units per head
constexpr int CPASS = (D - R) / W;       // pass-through chunks per head
constexpr int PASS0 = R / W;             // first pass-through chunk

static_assert(W >= 1 && (W & (W - 1)) == 0 && W * S_IN <= 16, "RC_WCH: power of two, at most 16 bytes");
static_assert(D % W == 0 && R % W == 0 && R % 2 == 0 && R <= D, "RC_WCH must divide D and R");
static_assert(!NEOX || HALF % W == 0, "NeoX: RC_WCH must divide R/2");
static_assert(NEOX || W % 2 == 0, "GPT-J: RC_WCH must be even");
static_assert(X % W == 0, "a chunk must stay inside one x-packed group");
static_assert(LAYOUT == RC_FLASH || (D % X == 0), "x-packed layouts need D % X == 0");
static_assert(LAYOUT != RC_XPACKED_SHUFFLED || BS % X == 0, "xpacked_shuffled needs BS % X == 0");
static_assert(DT == RC_F32 || DT == RC_BF16 || DT == RC_F16, "RC_DT");
static_assert(FP8 || CDT == DT, "cache dtype: q's dtype or fp8");
#ifndef RC_EMULATE
static_assert(NT % 32 == 0 && NT >= 32 && NT <= 1024, "RC_NT");
#endif

typedef long long i64;

// ---- raw element types and vectors -----------------------------------------------------------
template <int BYTES> struct VecOf;
template <> struct VecOf<16> { typedef uint4 T; };
template <> struct VecOf<8> { typedef uint2 T; };
template <> struct VecOf<4> { typedef unsigned int T; };
template <> struct VecOf<2> { typedef unsigned short T; };
template <> struct VecOf<1> { typedef unsigned char T; };

template <int S> struct RawOf;
template <> struct RawOf<4> { typedef unsigned int T; };
template <> struct RawOf<2> { typedef unsigned short T; };
template <> struct RawOf<1> { typedef unsigned char T; };

typedef RawOf<S_IN>::T raw_in;
typedef RawOf<S_CACHE>::T raw_cache;

// W input elements moved as one access.
union Chunk {
  VecOf<W * S_IN>::T v;
  raw_in e[W];
};
// W cache elements moved as one access (same bytes as Chunk unless the cache is fp8).
union CacheChunk {
  VecOf<W * S_CACHE>::T v;
  raw_cache e[W];
};

template <int dt>
__device__ __forceinline__ float to_f32(unsigned int raw) {
  if (dt == RC_BF16) return rc_bf16_to_f32((rc_u16)raw);
  if (dt == RC_F16) return rc_f16_to_f32((rc_u16)raw);
  return __uint_as_float(raw);
}

__device__ __forceinline__ raw_in from_f32(float f) {
  if (DT == RC_BF16) return (raw_in)rc_f32_to_bf16(f);
  if (DT == RC_F16) return (raw_in)rc_f32_to_f16(f);
  return (raw_in)__float_as_uint(rc_canonical_f32(f));
}

__device__ __forceinline__ Chunk load_chunk(const void* base, i64 elem) {
  Chunk c;
  c.v = *reinterpret_cast<const VecOf<W * S_IN>::T*>(static_cast<const char*>(base) + elem * S_IN);
  return c;
}

__device__ __forceinline__ void store_chunk(void* base, i64 elem, const Chunk& c) {
  *reinterpret_cast<VecOf<W * S_IN>::T*>(static_cast<char*>(base) + elem * S_IN) = c.v;
}

__device__ __forceinline__ raw_cache to_cache(raw_in x, float inv_scale) {
  if (FP8) return (raw_cache)rc_quantize_fp8(to_f32<DT>(x), inv_scale, FNUZ);
  return (raw_cache)x;
}

__device__ __forceinline__ void store_cache_chunk(void* base, i64 elem, const Chunk& c, float inv_scale) {
  CacheChunk o;
#pragma unroll
  for (int e = 0; e < W; ++e) o.e[e] = to_cache(c.e[e], inv_scale);
  *reinterpret_cast<VecOf<W * S_CACHE>::T*>(static_cast<char*>(base) + elem * S_CACHE) = o.v;
}

// W f32 values quantized into an fp8 cache as one access (WIDE_K only).
__device__ __forceinline__ void store_cache_chunk_f32(void* base, i64 elem, const float* x, float inv_scale) {
  CacheChunk o;
#pragma unroll
  for (int e = 0; e < W; ++e) o.e[e] = (raw_cache)rc_quantize_fp8(x[e], inv_scale, FNUZ);
  *reinterpret_cast<VecOf<W * S_CACHE>::T*>(static_cast<char*>(base) + elem * S_CACHE) = o.v;
}

__device__ __forceinline__ void store_cache_elem(void* base, i64 elem, raw_in x, float inv_scale) {
  static_cast<raw_cache*>(base)[elem] = to_cache(x, inv_scale);
}

__device__ __forceinline__ i64 load_index(const void* base, i64 i, bool is64) {
  return is64 ? static_cast<const i64*>(base)[i] : (i64) static_cast<const int*>(base)[i];
}

// Element offset of channel d (start of an aligned chunk) of kv head h at (blk, off).
__device__ __forceinline__ i64 key_index(i64 blk, i64 off, int h, int d) {
  if (LAYOUT == RC_FLASH) return ((blk * BS + off) * KH + h) * D + d;
  return (((blk * KH + h) * (D / X) + d / X) * BS + off) * X + d % X;
}

__device__ __forceinline__ i64 value_index(i64 blk, i64 off, int h, int d) {
  if (LAYOUT == RC_FLASH) return ((blk * BS + off) * KH + h) * D + d;
  if (LAYOUT == RC_XPACKED) return ((blk * KH + h) * D + d) * BS + off;
  return (((blk * KH + h) * (BS / X) + off / X) * D + d) * X + off % X;
}

struct Params {
  const void* q;
  const void* k;
  const void* v;
  const void* key_cache_in;
  const void* value_cache_in;
  const void* slots;
  const void* pos;
  const void* cos;
  const void* sin;
  const float* k_scale;
  const float* v_scale;
  const int* layer;
  void* q_out;
  void* k_out;
  void* kc;
  void* vc;
  i64 dim0[12];
};

// Row of one token's head h (h < QH: q, else k head h - QH) in the rotation inputs.
__device__ __forceinline__ i64 row_of(i64 t, int h) {
  return h < QH ? (t * QH + h) * (i64)D : (t * KH + (h - QH)) * (i64)D;
}

// The slots this call writes: slot s in [0, n) lands at cache slot base + s (base: the layer's first).
struct SlotRange {
  i64 n, base;
};

// Cache slot of token t if it writes the cache, else -1.
__device__ __forceinline__ i64 valid_slot(const Params& p, i64 t, SlotRange r) {
  const i64 s = load_index(p.slots, t, RC_SLOT64 != 0);
  return (s >= 0 && s < r.n) ? r.base + s : -1;
}

// Loaded inputs of one rotation unit.
struct RotIn {
  Chunk a, b;  // NeoX: chunk j and chunk j + R/2; GPT-J: a only
};

__device__ __forceinline__ void rot_decode(int u, int* tt, int* h, int* j) {
  *j = u % P;
  const int r = u / P;
  *h = r % RH;
  *tt = r / RH;
}

__device__ __forceinline__ RotIn rot_load(const Params& p, i64 t0, int u) {
  int tt, h, j;
  rot_decode(u, &tt, &h, &j);
  const i64 row = row_of(t0 + tt, h);
  const void* src = h < QH ? p.q : p.k;
  RotIn in;
  in.a = load_chunk(src, row + j * W);
  if (NEOX) in.b = load_chunk(src, row + HALF + j * W);
  return in;
}

__device__ __forceinline__ void rot_compute_store(const Params& p, i64 t0, int u, RotIn in, const float* tab,
                                                  SlotRange slot_range, float inv_k) {
  int tt, h, j;
  rot_decode(u, &tt, &h, &j);
  const i64 t = t0 + tt;
  const float* cs = tab + tt * 2 * TW;  // [cos row | sin row] of this token
  const float* sn = cs + TW;
  float wa[W], wb[NEOX ? W : 1];  // WIDE_K: the f32 values of chunk a (and b), before rounding
  (void)wa, (void)wb;
  if (NEOX) {
#pragma unroll
    for (int e = 0; e < W; ++e) {
      const int i = j * W + e;  // pair index, channels (i, i + R/2)
      const float ca = cs[i], sa = sn[i];
      const float cb = FULL ? cs[i + HALF] : ca, sb = FULL ? sn[i + HALF] : sa;
      float ya, yb;
      rc_rotate_pair(to_f32<DT>(in.a.e[e]), to_f32<DT>(in.b.e[e]), ca, sa, cb, sb, ARITH, &ya, &yb);
      in.a.e[e] = from_f32(ya);
      in.b.e[e] = from_f32(yb);
      if (WIDE_K) wa[e] = ya, wb[NEOX ? e : 0] = yb;
    }
  } else {
#pragma unroll
    for (int e = 0; e < W; e += 2) {
      const int m = (j * W + e) / 2;  // pair index, channels (2m, 2m + 1)
      const float ca = FULL ? cs[2 * m] : cs[m], sa = FULL ? sn[2 * m] : sn[m];
      const float cb = FULL ? cs[2 * m + 1] : ca, sb = FULL ? sn[2 * m + 1] : sa;
      float ya, yb;
      rc_rotate_pair(to_f32<DT>(in.a.e[e]), to_f32<DT>(in.a.e[e + 1]), ca, sa, cb, sb, ARITH, &ya, &yb);
      in.a.e[e] = from_f32(ya);
      in.a.e[e + 1] = from_f32(yb);
      if (WIDE_K) wa[e] = ya, wa[e + 1] = yb;
    }
  }
  const i64 row = row_of(t, h);
  void* dst = h < QH ? p.q_out : p.k_out;
  store_chunk(dst, row + j * W, in.a);
  if (NEOX) store_chunk(dst, row + HALF + j * W, in.b);
  if (h >= QH) {
    const i64 s = valid_slot(p, t, slot_range);
    if (s >= 0) {
      const i64 blk = s / BS, off = s % BS;
      const int kh = h - QH;
      if (WIDE_K) {
        store_cache_chunk_f32(p.kc, key_index(blk, off, kh, j * W), wa, inv_k);
        if (NEOX) store_cache_chunk_f32(p.kc, key_index(blk, off, kh, HALF + j * W), wb, inv_k);
      } else if (NEOX) {
        store_cache_chunk(p.kc, key_index(blk, off, kh, j * W), in.a, inv_k);
        store_cache_chunk(p.kc, key_index(blk, off, kh, HALF + j * W), in.b, inv_k);
      } else {
        store_cache_chunk(p.kc, key_index(blk, off, kh, j * W), in.a, inv_k);
      }
    }
  }
}

// Table element e of the block's staging area: token tt = e / (2*TW), cos (first TW) or sin.
__device__ __forceinline__ float table_load(const Params& p, i64 t0, i64 T, i64 max_pos, int e) {
  const int tt = e / (2 * TW);
  const int r = e % (2 * TW);
  const i64 t = t0 + tt;
  if (t >= T) return 0.0f;
  i64 row = load_index(p.pos, t, RC_POS64 != 0);
  row = row < 0 ? 0 : (row >= max_pos ? max_pos - 1 : row);
  const void* tab = r < TW ? p.cos : p.sin;
  const i64 idx = row * TW + (r < TW ? r : r - TW);
  float f;
  if (TAB_DT == RC_F32) f = static_cast<const float*>(tab)[idx];
  else f = to_f32<TAB_DT>(static_cast<const unsigned short*>(tab)[idx]);
  return f;  // exact; never rounded to the input dtype (rope_cache_math.h: the rotation)
}

constexpr int TAB_ELEMS = TPB * 2 * TW;
// Units each thread keeps in flight per round (loads of all of them issued before any store).
constexpr int UB = RC_UNROLL;
constexpr int TAB_PER_THREAD = (TAB_ELEMS + NT - 1) / NT;

}  // namespace rc

extern "C" __global__ void __launch_bounds__(RC_NT, 1) rope_cache_kernel(const rc::Params p) {
  using namespace rc;
  __shared__ float tab[TAB_ELEMS];
  const int tid = threadIdx.x;
  const i64 T = p.dim0[0], max_pos = p.dim0[7];
  const i64 t0 = (i64)blockIdx.x * TPB;
  const int ntok = (int)((T - t0) < TPB ? (T - t0) : TPB);  // tokens of this block (>= 1)
  SlotRange slot_range{p.dim0[3] * BS, 0};
  if (LAYER_BLOCKS > 0) {  // stacked [L, NB, ...]: a layer outside [0, L) writes nothing
    const i64 layer = *p.layer, per_layer = (i64)LAYER_BLOCKS * BS;
    slot_range = (layer >= 0 && layer < p.dim0[3]) ? SlotRange{per_layer, layer * per_layer} : SlotRange{0, 0};
  }
  const float inv_k = FP8 ? rc_inv_scale(*p.k_scale) : 1.0f;
  const float inv_v = FP8 ? rc_inv_scale(*p.v_scale) : 1.0f;

  // 1. Issue the table loads and the first rotation unit's loads; the values land later.
  float tv[TAB_PER_THREAD];
#pragma unroll
  for (int i = 0; i < TAB_PER_THREAD; ++i) {
    const int e = tid + i * NT;
    tv[i] = e < TAB_ELEMS ? table_load(p, t0, T, max_pos, e) : 0.0f;
  }
  const int n_rot = ntok * RH * P;
  RotIn rin[UB];
#pragma unroll
  for (int j = 0; j < UB; ++j) {
    const int u = tid + j * NT;
    if (u < n_rot) rin[j] = rot_load(p, t0, u);
  }

  // 2. Units that need no table: V into the value cache, channels >= R to q_out/k_out/key cache.
  //    UB units per thread per round, all loads issued before the first store.
  const int n_v = (LAYOUT == RC_FLASH ? ntok : TPB) * KH * CH;
  for (int base = tid; base < n_v; base += NT * UB) {
    Chunk xs[UB];
    i64 dst[UB];
#pragma unroll
    for (int j = 0; j < UB; ++j) {
      const int u = base + j * NT;
      dst[j] = -1;
      if (u >= n_v) continue;
      int tt, h, c;
      if (LAYOUT == RC_FLASH) {  // token-major: a warp writes contiguous rows
        c = u % CH;
        h = (u / CH) % KH;
        tt = u / (CH * KH);
      } else {  // token-fastest: consecutive slots of one value row are written together
        tt = u % TPB;
        c = (u / TPB) % CH;
        h = u / (TPB * CH);
        if (tt >= ntok) continue;
      }
      const i64 t = t0 + tt;
      const i64 s = valid_slot(p, t, slot_range);
      xs[j] = load_chunk(p.v, (t * KH + h) * (i64)D + c * W);  // in bounds whatever the slot
      if (s >= 0) dst[j] = value_index(s / BS, s % BS, h, c * W);
    }
#pragma unroll
    for (int j = 0; j < UB; ++j) {
      if (dst[j] < 0) continue;
      if (LAYOUT == RC_FLASH) {
        store_cache_chunk(p.vc, dst[j], xs[j], inv_v);
      } else {  // consecutive channels are BS (xpacked) or X (shuffled) elements apart
        constexpr int STEP = LAYOUT == RC_XPACKED ? BS : X;
#pragma unroll
        for (int e = 0; e < W; ++e) store_cache_elem(p.vc, dst[j] + (i64)e * STEP, xs[j].e[e], inv_v);
      }
    }
  }
  if (CPASS > 0) {
    const int n_pass = ntok * RH * (CPASS > 0 ? CPASS : 1);
    for (int u = tid; u < n_pass; u += NT) {
      const int c = PASS0 + u % (CPASS > 0 ? CPASS : 1);
      const int h = (u / (CPASS > 0 ? CPASS : 1)) % RH;
      const int tt = u / ((CPASS > 0 ? CPASS : 1) * RH);
      const i64 t = t0 + tt;
      const i64 row = row_of(t, h);
      const Chunk x = load_chunk(h < QH ? p.q : p.k, row + c * W);
      store_chunk(h < QH ? p.q_out : p.k_out, row + c * W, x);
      if (h >= QH) {
        const i64 s = valid_slot(p, t, slot_range);
        if (s >= 0) store_cache_chunk(p.kc, key_index(s / BS, s % BS, h - QH, c * W), x, inv_k);
      }
    }
  }

  // 3. Publish the table rows, then rotate.
#pragma unroll
  for (int i = 0; i < TAB_PER_THREAD; ++i) {
    const int e = tid + i * NT;
    if (e < TAB_ELEMS) tab[e] = tv[i];
  }
  __syncthreads();
  for (int base = tid; base < n_rot; base += NT * UB) {
    if (base != tid) {
#pragma unroll
      for (int j = 0; j < UB; ++j) {
        const int u = base + j * NT;
        if (u < n_rot) rin[j] = rot_load(p, t0, u);
      }
    }
#pragma unroll
    for (int j = 0; j < UB; ++j) {
      const int u = base + j * NT;
      if (u < n_rot) rot_compute_store(p, t0, u, rin[j], tab, slot_range, inv_k);
    }
  }
}

#ifdef RC_EMULATE
// Runs the whole grid on the host, block after block.
extern "C" void rc_emulate(const rc::Params* p, long long grid) {
  for (long long b = 0; b < grid; ++b) {
    blockIdx.x = (unsigned)b;
    threadIdx.x = 0;
    rope_cache_kernel(*p);
  }
}
#endif
