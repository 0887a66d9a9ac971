// Floor kernels of the MLA op (benchmarks/diagnostics/mla_floor.py): the op's memory traffic with
// no arithmetic, one 16-byte input chunk per thread, to bound what kernels/cuda/mla_cache.cu can
// reach. Shapes from -D: FL_QH, FL_DN, FL_DC, FL_DR (bf16 inputs, elements), FL_CB (cache element
// bytes: 2 bf16, 1 fp8: the cache store is the chunk's first 8 bytes). Tables: float32 half tables
// [max_pos, Dr / 2], GPT-J pairs (a q_pe / k_pe chunk of 8 elements takes 4 cos and 4 sin).
//   floor_mla_copy  every chunk read once and stored where the op stores it (q_out, k_pe_out, the
//                   cache row of the token's slot); the slot load is the only dependent load
//   floor_mla_tab   the same, plus the op's dependent position -> table load for the rotated chunks
typedef unsigned long long u64;
typedef long long i64;

constexpr int QH = FL_QH, DN = FL_DN, DC = FL_DC, DR = FL_DR, CB = FL_CB;
constexpr int CNOPE = QH * DN / 8, CQPE = QH * DR / 8, CKVC = DC / 8, CKPE = DR / 8;
constexpr int UNITS = CNOPE + CQPE + CKVC + CKPE;  // chunks per token
constexpr int ROW = DC + DR;                         // cache row, elements

__device__ __forceinline__ uint4 xor4(uint4 a, uint4 b) {
  return make_uint4(a.x ^ b.x, a.y ^ b.y, a.z ^ b.z, a.w ^ b.w);
}

__device__ __forceinline__ void store_cache(unsigned char* cache, i64 elem, uint4 x) {
  if (CB == 2) *reinterpret_cast<uint4*>(cache + elem * 2) = x;
  else *reinterpret_cast<uint2*>(cache + elem) = make_uint2(x.x, x.y);
}

template <bool TAB>
__device__ __forceinline__ void mla_traffic(const uint4* q_nope, const uint4* q_pe, const uint4* kv_c,
                                            const uint4* k_pe, const int* slots, const int* pos,
                                            const uint4* cos, const uint4* sin, uint4* q_out, uint4* k_pe_out,
                                            unsigned char* cache, i64 T, i64 nslots, i64 max_pos) {
  const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
  const i64 t = i / UNITS;
  if (t >= T) return;
  int u = (int)(i % UNITS);
  if (u < CNOPE) {  // q_out[t, h, :Dn] = q_nope[t, h]
    const int h = u / (DN / 8), j = u % (DN / 8);
    q_out[(t * QH + h) * ((DN + DR) / 8) + j] = q_nope[t * CNOPE + u];
    return;
  }
  u -= CNOPE;
  const bool rot = u < CQPE || u >= CQPE + CKVC;
  uint4 m = make_uint4(0, 0, 0, 0);
  if (TAB && rot) {
    const int j = (u < CQPE ? u : u - CQPE - CKVC) % (DR / 8);
    i64 p = pos[t];
    p = p < 0 ? 0 : (p >= max_pos ? max_pos - 1 : p);
    m = xor4(cos[p * (DR / 8) + j], sin[p * (DR / 8) + j]);
  }
  if (u < CQPE) {  // q_out[t, h, Dn:] = rope(q_pe[t, h])
    const int h = u / (DR / 8), j = u % (DR / 8);
    q_out[(t * QH + h) * ((DN + DR) / 8) + DN / 8 + j] = xor4(q_pe[t * CQPE + u], m);
    return;
  }
  u -= CQPE;
  const i64 s = slots[t];
  const bool ok = s >= 0 && s < nslots;
  if (u < CKVC) {  // cache row s, [:Dc] = kv_c[t]
    const uint4 x = kv_c[t * CKVC + u];
    if (ok) store_cache(cache, s * ROW + u * 8, x);
    return;
  }
  u -= CKVC;  // k_pe_out[t] and cache row s, [Dc:] = rope(k_pe[t])
  const uint4 x = xor4(k_pe[t * CKPE + u], m);
  k_pe_out[t * CKPE + u] = x;
  if (ok) store_cache(cache, s * ROW + DC + u * 8, x);
}

#define FLOOR_ARGS                                                                                            \
  const uint4 *q_nope, const uint4 *q_pe, const uint4 *kv_c, const uint4 *k_pe, const int *slots, const int *pos, \
      const uint4 *cos, const uint4 *sin, uint4 *q_out, uint4 *k_pe_out, unsigned char *cache, i64 T, i64 nslots,  \
      i64 max_pos
extern "C" __global__ void floor_mla_copy(FLOOR_ARGS) {
  mla_traffic<false>(q_nope, q_pe, kv_c, k_pe, slots, pos, cos, sin, q_out, k_pe_out, cache, T, nslots, max_pos);
}
extern "C" __global__ void floor_mla_tab(FLOOR_ARGS) {
  mla_traffic<true>(q_nope, q_pe, kv_c, k_pe, slots, pos, cos, sin, q_out, k_pe_out, cache, T, nslots, max_pos);
}
