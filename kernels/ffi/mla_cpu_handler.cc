// mla_rope_and_cache on the host: an XLA FFI handler for platform "cpu" that computes directly into
// the aliased latent cache buffer(s). Operands and results (jax_rope_cache/mla/contract.py):
//   q_nope [T, QH, Dn], q_pe [T, QH, Dr], kv_c [T, Dc], k_pe [T, Dr]      (one input dtype)
//   "combined": kv_cache [(L,) NB, BS, Dc + Dr]   "split": ckv_cache [(L,) NB, BS, Dc], kpe_cache [(L,) NB, BS, Dr]
//   slot_mapping [T], positions [T] (int32/int64), cos, sin [max_pos, Dr/2 | Dr],
//   kv_scale f32 [] / [1], q_scale f32 [] / [1], layer i32 []
// Results: q_out [T, QH, Dn + Dr] (input dtype or fp8), k_pe_out [T, Dr], the cache(s) (aliased).
// The layout is the number of caches (12 operands: combined, 13: split); stacking is the caches' rank.
//
// Bounds safety: every dimension is checked against q_pe's and the cache's before a byte is read;
// positions are clamped to the table; a slot writes only if 0 <= slot < NB*BS (64-bit), and with
// stacked caches only if 0 <= layer < L.
// Numerics: kernels/common/rope_cache_math.h, bit-exact to jax_rope_cache/mla/reference.py; subnormals
// kept (ScopedIeeeDenormals).
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "kernels/common/rope_cache_math.h"
#include "kernels/ffi/dtypes.h"
#include "kernels/ffi/handlers.h"
#include "kernels/ffi/ieee_denormals.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jax_rope_cache {
namespace {

const char* Name(int code) {
  switch (code) {
    case RC_F32: return "float32";
    case RC_BF16: return "bfloat16";
    case RC_F16: return "float16";
    case RC_FP8_E4M3FN: return "float8_e4m3fn";
    case RC_FP8_E4M3FNUZ: return "float8_e4m3fnuz";
    case RC_FP8_E5M2: return "float8_e5m2";
    default: return "an unsupported type";
  }
}

bool IsFp8(int c) { return c == RC_FP8_E4M3FN || c == RC_FP8_E4M3FNUZ || c == RC_FP8_E5M2; }
int Size(int c) { return c == RC_F32 ? 4 : IsFp8(c) ? 1 : 2; }

std::string Dims(ffi::Span<const int64_t> d) {
  std::string s = "[";
  for (size_t i = 0; i < d.size(); ++i) s += (i ? ", " : "") + std::to_string(d[i]);
  return s + "]";
}

std::string Dims(const std::vector<int64_t>& d) { return Dims(ffi::Span<const int64_t>(d.data(), d.size())); }

ffi::Error Invalid(const std::string& m) { return ffi::Error::InvalidArgument("mla_rope_and_cache: " + m); }

ffi::Error ExpectDims(const char* name, const ffi::AnyBuffer& b, const std::vector<int64_t>& want) {
  auto got = b.dimensions();
  if (got.size() == want.size() && std::equal(got.begin(), got.end(), want.begin())) return ffi::Error::Success();
  return Invalid(std::string(name) + ": expected dims " + Dims(want) + ", got " + Dims(got));
}

ffi::Error ExpectScalar(const char* name, const ffi::AnyBuffer& b, ffi::DataType want, const char* what) {
  auto d = b.dimensions();
  if (b.element_type() != want || d.size() > 1 || b.element_count() != 1)
    return Invalid(std::string(name) + ": expected a " + what + " scalar ([] or [1]), got element type " +
                   std::to_string(static_cast<int>(b.element_type())) + " dims " + Dims(d));
  return ffi::Error::Success();
}

float Load(const void* base, int64_t i, int dt) {
  switch (dt) {
    case RC_BF16: return rc_bf16_to_f32(static_cast<const uint16_t*>(base)[i]);
    case RC_F16: return rc_f16_to_f32(static_cast<const uint16_t*>(base)[i]);
    default: return static_cast<const float*>(base)[i];
  }
}

// Stores float32 v (a value of the input dtype, or the wide rotation) into an element of dtype `dt`:
// rounded (canonical NaN) for bf16/f16/f32, quantized with `inv` for fp8.
void Store(void* base, int64_t i, int dt, float v, float inv) {
  switch (dt) {
    case RC_BF16: static_cast<uint16_t*>(base)[i] = rc_f32_to_bf16(v); break;
    case RC_F16: static_cast<uint16_t*>(base)[i] = rc_f32_to_f16(v); break;
    case RC_F32: static_cast<float*>(base)[i] = rc_canonical_f32(v); break;
    default: static_cast<uint8_t*>(base)[i] = rc_quantize_fp8(v, inv, static_cast<RcDtype>(dt));
  }
}

// n elements of dtype `in` at src[si..] to dst[di..] of dtype `out`: the same bits when out == in,
// else quantized with `inv` (out is fp8).
void CopyRow(const void* src, int64_t si, int in, void* dst, int64_t di, int out, int64_t n, float inv) {
  if (out == in) {
    const int s = Size(in);
    std::memcpy(static_cast<char*>(dst) + di * s, static_cast<const char*>(src) + si * s, n * s);
    return;
  }
  for (int64_t e = 0; e < n; ++e) Store(dst, di + e, out, Load(src, si + e, in), inv);
}

int64_t LoadIndex(const void* base, int64_t i, bool is64) {
  return is64 ? static_cast<const int64_t*>(base)[i] : static_cast<const int32_t*>(base)[i];
}

struct Geometry {
  int64_t T, QH, Dn, Dr, Dc, NB, BS, L, max_pos;
  bool split, stacked, full, slot64, pos64;
  int dt, tab_dt, cache_dt, q_dt;
};

ffi::Error Validate(ffi::RemainingArgs& args, ffi::RemainingRets& rets, Geometry* g) {
  const size_t na = args.size(), nr = rets.size();
  if (!((na == 12 && nr == 3) || (na == 13 && nr == 4)))
    return Invalid("expected 12 operands and 3 results (layout 'combined') or 13 and 4 ('split'), got " +
                   std::to_string(na) + " and " + std::to_string(nr));
  std::vector<ffi::AnyBuffer> in, out;
  for (size_t i = 0; i < na; ++i) {
    auto b = args.get<ffi::AnyBuffer>(i);
    if (!b.has_value()) return Invalid("operand " + std::to_string(i) + ": not a buffer");
    in.push_back(*b);
  }
  for (size_t i = 0; i < nr; ++i) {
    auto b = rets.get<ffi::AnyBuffer>(i);
    if (!b.has_value()) return Invalid("result " + std::to_string(i) + ": not a buffer");
    out.push_back(**b);
  }
  g->split = na == 13;
  const int nc = g->split ? 2 : 1;
  const char* cname0 = g->split ? "ckv_cache" : "kv_cache";
  const ffi::AnyBuffer &q_nope = in[0], &q_pe = in[1], &kv_c = in[2], &k_pe = in[3];
  const ffi::AnyBuffer &slots = in[4 + nc], &pos = in[5 + nc], &cos = in[6 + nc], &sin = in[7 + nc];
  g->dt = DtypeCode(q_pe.element_type());
  if (g->dt < 0 || IsFp8(g->dt))
    return Invalid(std::string("q_pe: expected dtype float32, bfloat16 or float16, got ") + Name(g->dt));
  auto qd = q_pe.dimensions();
  if (qd.size() != 3) return Invalid("q_pe: expected rank 3 [T, QH, Dr], got dims " + Dims(qd));
  g->T = qd[0], g->QH = qd[1], g->Dr = qd[2];
  if (g->Dr < 2 || g->Dr % 2) return Invalid("q_pe: expected an even Dr >= 2, got " + std::to_string(g->Dr));
  const char* in_names[] = {"q_nope", "q_pe", "kv_c", "k_pe"};
  for (int i = 0; i < 4; ++i)
    if (DtypeCode(in[i].element_type()) != g->dt)
      return Invalid(std::string(in_names[i]) + ": expected dtype " + Name(g->dt) + " (q_pe's), got " +
                     Name(DtypeCode(in[i].element_type())));
  auto nd = q_nope.dimensions();
  if (nd.size() != 3) return Invalid("q_nope: expected rank 3 [T, QH, Dn], got dims " + Dims(nd));
  g->Dn = nd[2];
  if (auto e = ExpectDims("q_nope", q_nope, {g->T, g->QH, g->Dn}); e.failure()) return e;
  auto cd = kv_c.dimensions();
  if (cd.size() != 2) return Invalid("kv_c: expected rank 2 [T, Dc], got dims " + Dims(cd));
  g->Dc = cd[1];
  if (auto e = ExpectDims("kv_c", kv_c, {g->T, g->Dc}); e.failure()) return e;
  if (auto e = ExpectDims("k_pe", k_pe, {g->T, g->Dr}); e.failure()) return e;
  // the caches
  const ffi::AnyBuffer& c0 = in[4];
  auto k0 = c0.dimensions();
  if (k0.size() != 3 && k0.size() != 4)
    return Invalid(std::string(cname0) + ": expected rank 3 [NB, BS, row] or 4 [L, NB, BS, row], got dims " + Dims(k0));
  g->stacked = k0.size() == 4;
  g->L = g->stacked ? k0[0] : 1;
  g->NB = k0[k0.size() - 3], g->BS = k0[k0.size() - 2];
  g->cache_dt = DtypeCode(c0.element_type());
  if (g->cache_dt != g->dt && !IsFp8(g->cache_dt))
    return Invalid(std::string(cname0) + ": expected dtype " + Name(g->dt) + " or a float8 dtype, got " +
                   Name(g->cache_dt));
  std::vector<int64_t> lead;
  if (g->stacked) lead.push_back(g->L);
  lead.push_back(g->NB), lead.push_back(g->BS);
  std::vector<int64_t> want0 = lead, want1 = lead;
  want0.push_back(g->split ? g->Dc : g->Dc + g->Dr);
  want1.push_back(g->Dr);
  if (auto e = ExpectDims(cname0, c0, want0); e.failure()) return e;
  if (g->split) {
    if (DtypeCode(in[5].element_type()) != g->cache_dt)
      return Invalid(std::string("kpe_cache: expected dtype ") + Name(g->cache_dt) + ", got " +
                     Name(DtypeCode(in[5].element_type())));
    if (auto e = ExpectDims("kpe_cache", in[5], want1); e.failure()) return e;
  }
  if (g->L < 1 || g->NB < 1 || g->BS < 1) return Invalid(std::string(cname0) + ": empty cache dims " + Dims(k0));
  // indices and tables
  for (const auto* b : {&slots, &pos}) {
    const char* n = b == &slots ? "slot_mapping" : "positions";
    if (b->element_type() != ffi::DataType::S32 && b->element_type() != ffi::DataType::S64)
      return Invalid(std::string(n) + ": expected int32 or int64");
    if (auto e = ExpectDims(n, *b, {g->T}); e.failure()) return e;
  }
  g->slot64 = slots.element_type() == ffi::DataType::S64;
  g->pos64 = pos.element_type() == ffi::DataType::S64;
  g->tab_dt = DtypeCode(cos.element_type());
  if (g->tab_dt < 0 || IsFp8(g->tab_dt)) return Invalid("cos: expected dtype float32, bfloat16 or float16");
  if (DtypeCode(sin.element_type()) != g->tab_dt) return Invalid(std::string("sin: expected dtype ") + Name(g->tab_dt));
  auto td = cos.dimensions();
  if (td.size() != 2 || td[0] < 1 || (td[1] != g->Dr && td[1] != g->Dr / 2))
    return Invalid("cos: expected dims [max_pos >= 1, Dr/2 or Dr] with Dr=" + std::to_string(g->Dr) + ", got " + Dims(td));
  if (auto e = ExpectDims("sin", sin, {td[0], td[1]}); e.failure()) return e;
  g->max_pos = td[0];
  g->full = td[1] == g->Dr;
  if (auto e = ExpectScalar("kv_scale", in[8 + nc], ffi::DataType::F32, "float32"); e.failure()) return e;
  if (auto e = ExpectScalar("q_scale", in[9 + nc], ffi::DataType::F32, "float32"); e.failure()) return e;
  if (auto e = ExpectScalar("layer", in[10 + nc], ffi::DataType::S32, "int32"); e.failure()) return e;
  // results
  g->q_dt = DtypeCode(out[0].element_type());
  if (g->q_dt != g->dt && !IsFp8(g->q_dt))
    return Invalid(std::string("q_out: expected dtype ") + Name(g->dt) + " or a float8 dtype, got " + Name(g->q_dt));
  if (auto e = ExpectDims("q_out", out[0], {g->T, g->QH, g->Dn + g->Dr}); e.failure()) return e;
  if (DtypeCode(out[1].element_type()) != g->dt) return Invalid(std::string("k_pe_out: expected dtype ") + Name(g->dt));
  if (auto e = ExpectDims("k_pe_out", out[1], {g->T, g->Dr}); e.failure()) return e;
  for (int i = 0; i < nc; ++i) {
    const char* n = i ? "kpe_cache result" : "cache result";
    if (out[2 + i].element_type() != in[4 + i].element_type())
      return Invalid(std::string(n) + ": expected the cache operand's dtype");
    if (auto e = ExpectDims(n, out[2 + i], i ? want1 : want0); e.failure()) return e;
  }
  return ffi::Error::Success();
}

ffi::Error CpuMlaRopeAndCache(ffi::RemainingArgs args, ffi::RemainingRets rets, bool is_neox, bool native) {
  Geometry g;
  if (auto e = Validate(args, rets, &g); e.failure()) return e;
  ScopedIeeeDenormals ieee;
  const int nc = g.split ? 2 : 1;
  auto arg = [&](int i) { return args.get<ffi::AnyBuffer>(i)->untyped_data(); };
  auto ret = [&](int i) { return (*rets.get<ffi::AnyBuffer>(i))->untyped_data(); };
  const void *q_nope = arg(0), *q_pe = arg(1), *kv_c = arg(2), *k_pe = arg(3);
  const void *slots = arg(4 + nc), *pos = arg(5 + nc), *cos = arg(6 + nc), *sin = arg(7 + nc);
  const float kv_scale = *static_cast<const float*>(arg(8 + nc));
  const float q_scale = *static_cast<const float*>(arg(9 + nc));
  const int32_t layer = *static_cast<const int32_t*>(arg(10 + nc));
  void *q_out = ret(0), *k_pe_out = ret(1);
  void* cache0 = ret(2);
  void* cache1 = g.split ? ret(3) : nullptr;
  // in-place aliasing: the result buffers are the operands; copy if XLA gave distinct buffers
  if (cache0 != arg(4))
    std::memcpy(cache0, arg(4), static_cast<size_t>(g.L * g.NB * g.BS * (g.split ? g.Dc : g.Dc + g.Dr)) * Size(g.cache_dt));
  if (g.split && cache1 != arg(5))
    std::memcpy(cache1, arg(5), static_cast<size_t>(g.L * g.NB * g.BS * g.Dr) * Size(g.cache_dt));

  const int arith = rc_arith(native, g.dt, g.tab_dt);
  const bool fused = arith == RC_ARITH_FUSED;
  const bool q_fp8 = IsFp8(g.q_dt), c_fp8 = IsFp8(g.cache_dt);
  const float inv_q = q_fp8 ? rc_inv_scale(q_scale) : 1.0f;
  const float inv_kv = c_fp8 ? rc_inv_scale(kv_scale) : 1.0f;
  const int64_t half = g.Dr / 2, tw = g.full ? g.Dr : half, dq = g.Dn + g.Dr;
  const int64_t per_layer = g.NB * g.BS;
  const bool layer_ok = !g.stacked || (layer >= 0 && layer < g.L);
  const int64_t base_slot = g.stacked && layer_ok ? static_cast<int64_t>(layer) * per_layer : 0;
  const int64_t row0 = g.split ? g.Dc : g.Dc + g.Dr;  // elements per slot of cache0
  std::vector<float> c(tw), s(tw), ya(half), yb(half);

  // One rotary row x[0..Dr) at element `src` of `x` -> rounded (out dtype g.dt) and wide values.
  auto rotate_row = [&](const void* x, int64_t src) {
    for (int64_t i = 0; i < half; ++i) {
      const int64_t a = is_neox ? i : 2 * i, b = is_neox ? i + half : 2 * i + 1;
      const float ca = g.full ? c[a] : c[i], cb = g.full ? c[b] : c[i];
      const float sa = g.full ? s[a] : s[i], sb = g.full ? s[b] : s[i];
      rc_rotate_pair(Load(x, src + a, g.dt), Load(x, src + b, g.dt), ca, sa, cb, sb, arith, &ya[i], &yb[i]);
    }
  };
  // Stores the rotated row: channel a of pair i gets ya[i], b gets yb[i]. to_dt: an element of g.dt
  // (the rounded value); to fp8 `out_dt`: quantized (the wide value in fused arithmetic).
  auto store_row = [&](void* dst, int64_t di, int out_dt, float inv) {
    for (int64_t i = 0; i < half; ++i) {
      const int64_t a = is_neox ? i : 2 * i, b = is_neox ? i + half : 2 * i + 1;
      float va = ya[i], vb = yb[i];
      if (IsFp8(out_dt) && !fused) va = rc_round_to(va, g.dt), vb = rc_round_to(vb, g.dt);
      Store(dst, di + a, out_dt, va, inv);
      Store(dst, di + b, out_dt, vb, inv);
    }
  };

  for (int64_t t = 0; t < g.T; ++t) {
    int64_t p = LoadIndex(pos, t, g.pos64);
    p = p < 0 ? 0 : (p >= g.max_pos ? g.max_pos - 1 : p);
    for (int64_t i = 0; i < tw; ++i) c[i] = Load(cos, p * tw + i, g.tab_dt), s[i] = Load(sin, p * tw + i, g.tab_dt);
    for (int64_t h = 0; h < g.QH; ++h) {
      const int64_t qrow = (t * g.QH + h) * dq;
      CopyRow(q_nope, (t * g.QH + h) * g.Dn, g.dt, q_out, qrow, g.q_dt, g.Dn, inv_q);
      rotate_row(q_pe, (t * g.QH + h) * g.Dr);
      store_row(q_out, qrow + g.Dn, g.q_dt, inv_q);
    }
    rotate_row(k_pe, t * g.Dr);
    store_row(k_pe_out, t * g.Dr, g.dt, 1.0f);
    const int64_t slot = LoadIndex(slots, t, g.slot64);
    if (!layer_ok || slot < 0 || slot >= per_layer) continue;
    const int64_t at = base_slot + slot;
    CopyRow(kv_c, t * g.Dc, g.dt, cache0, at * row0, g.cache_dt, g.Dc, inv_kv);
    if (g.split) store_row(cache1, at * g.Dr, g.cache_dt, inv_kv);
    else store_row(cache0, at * row0 + g.Dc, g.cache_dt, inv_kv);
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(kCpuMlaRopeAndCache, CpuMlaRopeAndCache,
                              ffi::Ffi::Bind().RemainingArgs().RemainingRets().Attr<bool>("is_neox").Attr<bool>("native"));

}  // namespace jax_rope_cache
