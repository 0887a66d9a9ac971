// The op on the host: an XLA FFI handler for platform "cpu" that computes directly into the
// aliased cache buffers. Tokens are split over XLA's intra-op thread pool.
//
// Bounds safety: positions are clamped to the table, a slot writes only if 0 <= slot < NB*BS,
// and every other index is derived from buffer dimensions checked at the top of the handler.
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <thread>

#include "kernels/common/rope_cache_math.h"
#include "kernels/ffi/handlers.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jax_rope_cache {
namespace {

int DtypeCode(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F32: return RC_F32;
    case ffi::DataType::BF16: return RC_BF16;
    case ffi::DataType::F16: return RC_F16;
    case ffi::DataType::F8E4M3FN: return RC_FP8_E4M3FN;
    case ffi::DataType::F8E4M3FNUZ: return RC_FP8_E4M3FNUZ;
    default: return -1;
  }
}

float LoadF32(const void* base, int64_t i, int dt) {
  switch (dt) {
    case RC_BF16: return rc_bf16_to_f32(static_cast<const uint16_t*>(base)[i]);
    case RC_F16: return rc_f16_to_f32(static_cast<const uint16_t*>(base)[i]);
    default: return static_cast<const float*>(base)[i];
  }
}

void StoreAs(void* base, int64_t i, int dt, float v) {
  switch (dt) {
    case RC_BF16: static_cast<uint16_t*>(base)[i] = rc_f32_to_bf16(v); break;
    case RC_F16: static_cast<uint16_t*>(base)[i] = rc_f32_to_f16(v); break;
    default: static_cast<float*>(base)[i] = v; break;
  }
}

int64_t LoadIndex(const void* base, int64_t i, bool is64) {
  return is64 ? static_cast<const int64_t*>(base)[i] : static_cast<const int32_t*>(base)[i];
}

struct Problem {
  const void *q, *k, *v, *slots, *pos, *cos, *sin;
  void *q_out, *k_out, *kc, *vc;
  int64_t T, QH, KH, D, R, NB, BS, max_pos, width, X;
  int dt, table_dt, cache_dt, layout;
  bool neox, native, slots64, pos64, full_table;
  float inv_k_scale, inv_v_scale;

  // Element offsets of (block, offset, head, channel) in each cache.
  int64_t KeyIndex(int64_t blk, int64_t off, int64_t h, int64_t d) const {
    if (layout == RC_FLASH) return ((blk * BS + off) * KH + h) * D + d;
    return (((blk * KH + h) * (D / X) + d / X) * BS + off) * X + d % X;
  }
  int64_t ValueIndex(int64_t blk, int64_t off, int64_t h, int64_t d) const {
    if (layout == RC_FLASH) return ((blk * BS + off) * KH + h) * D + d;
    if (layout == RC_XPACKED) return ((blk * KH + h) * D + d) * BS + off;
    return (((blk * KH + h) * (BS / X) + off / X) * D + d) * X + off % X;
  }
};

// Stores one value into a cache element (same dtype as the input, or scaled fp8).
void StoreCache(const Problem& p, void* cache, int64_t i, float value, float inv_scale) {
  if (p.cache_dt == RC_FP8_E4M3FN || p.cache_dt == RC_FP8_E4M3FNUZ) {
    static_cast<uint8_t*>(cache)[i] = rc_quantize_fp8(value, inv_scale, p.cache_dt == RC_FP8_E4M3FNUZ);
  } else {
    StoreAs(cache, i, p.cache_dt, value);
  }
}

// Rotates row `row` (H heads of D channels) of x into out. Returns nothing; out gets x's dtype.
void RotateRow(const Problem& p, const void* x, void* out, int64_t row, const float* ca, const float* cb,
               const float* sa, const float* sb) {
  const int64_t half = p.R / 2;
  const int64_t base = row * p.D;
  const int native_dt = p.native ? p.dt : -1;
  for (int64_t i = 0; i < half; ++i) {
    const int64_t ia = p.neox ? i : 2 * i;
    const int64_t ib = p.neox ? i + half : 2 * i + 1;
    float ya, yb;
    rc_rotate_pair(LoadF32(x, base + ia, p.dt), LoadF32(x, base + ib, p.dt), ca[i], sa[i], cb[i], sb[i],
                   native_dt, &ya, &yb);
    StoreAs(out, base + ia, p.dt, ya);
    StoreAs(out, base + ib, p.dt, yb);
  }
  const int64_t elem = p.dt == RC_F32 ? 4 : 2;
  std::memcpy(static_cast<char*>(out) + (base + p.R) * elem, static_cast<const char*>(x) + (base + p.R) * elem,
              (p.D - p.R) * elem);
}

void RunTokens(const Problem& p, int64_t t0, int64_t t1) {
  const int64_t half = p.R / 2;
  std::unique_ptr<float[]> table(new float[4 * half]);
  float *ca = table.get(), *cb = ca + half, *sa = cb + half, *sb = sa + half;
  const int round_dt = p.native ? p.dt : RC_F32;
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t row = std::clamp<int64_t>(LoadIndex(p.pos, t, p.pos64), 0, p.max_pos - 1) * p.width;
    for (int64_t i = 0; i < half; ++i) {
      const int64_t ia = p.full_table ? (p.neox ? i : 2 * i) : i;
      const int64_t ib = p.full_table ? (p.neox ? i + half : 2 * i + 1) : i;
      ca[i] = rc_round_to(LoadF32(p.cos, row + ia, p.table_dt), round_dt);
      cb[i] = rc_round_to(LoadF32(p.cos, row + ib, p.table_dt), round_dt);
      sa[i] = rc_round_to(LoadF32(p.sin, row + ia, p.table_dt), round_dt);
      sb[i] = rc_round_to(LoadF32(p.sin, row + ib, p.table_dt), round_dt);
    }
    for (int64_t h = 0; h < p.QH; ++h) RotateRow(p, p.q, p.q_out, t * p.QH + h, ca, cb, sa, sb);
    for (int64_t h = 0; h < p.KH; ++h) RotateRow(p, p.k, p.k_out, t * p.KH + h, ca, cb, sa, sb);

    const int64_t slot = LoadIndex(p.slots, t, p.slots64);
    if (slot < 0 || slot >= p.NB * p.BS) continue;
    const int64_t blk = slot / p.BS, off = slot % p.BS;
    for (int64_t h = 0; h < p.KH; ++h) {
      const int64_t src = (t * p.KH + h) * p.D;
      for (int64_t d = 0; d < p.D; ++d) {
        StoreCache(p, p.kc, p.KeyIndex(blk, off, h, d), LoadF32(p.k_out, src + d, p.dt), p.inv_k_scale);
        StoreCache(p, p.vc, p.ValueIndex(blk, off, h, d), LoadF32(p.v, src + d, p.dt), p.inv_v_scale);
      }
    }
  }
}

// Splits [0, T) into chunks; the calling thread and pool tasks claim chunks until none is left.
// State lives on the heap so pool tasks that start late (after the work is done) stay valid.
void ParallelOverTokens(const Problem& p, ffi::ThreadPool& pool) {
  constexpr int64_t kChunk = 16;
  const int64_t n_chunks = (p.T + kChunk - 1) / kChunk;
  struct Shared {
    Problem p;
    int64_t n_chunks;
    std::atomic<int64_t> next{0}, done{0};
  };
  auto shared = std::make_shared<Shared>();
  shared->p = p;
  shared->n_chunks = n_chunks;
  auto work = [](Shared& s) {
    for (int64_t c; (c = s.next.fetch_add(1)) < s.n_chunks;) {
      RunTokens(s.p, c * kChunk, std::min(s.p.T, (c + 1) * kChunk));
      s.done.fetch_add(1, std::memory_order_release);
    }
  };
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), n_chunks - 1);
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([shared, work] { work(*shared); });
  work(*shared);
  while (shared->done.load(std::memory_order_acquire) < n_chunks) std::this_thread::yield();
}

ffi::Error CheckSame(const char* what, int64_t got, int64_t want) {
  if (got == want) return ffi::Error::Success();
  return ffi::Error::InvalidArgument(std::string("rope_and_cache cpu: ") + what + ": expected " +
                                     std::to_string(want) + ", got " + std::to_string(got));
}

float InverseScale(ffi::AnyBuffer scale) {
  if (scale.element_count() < 1 || scale.element_type() != ffi::DataType::F32) return 1.0f;
  return 1.0f / *static_cast<const float*>(scale.untyped_data());
}

ffi::Error CpuRopeAndCache(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                           ffi::AnyBuffer key_cache, ffi::AnyBuffer value_cache, ffi::AnyBuffer slots,
                           ffi::AnyBuffer positions, ffi::AnyBuffer cos, ffi::AnyBuffer sin,
                           ffi::AnyBuffer k_scale, ffi::AnyBuffer v_scale, ffi::Result<ffi::AnyBuffer> q_out,
                           ffi::Result<ffi::AnyBuffer> k_out, ffi::Result<ffi::AnyBuffer> key_cache_out,
                           ffi::Result<ffi::AnyBuffer> value_cache_out, int64_t layout, bool is_neox,
                           int64_t rotary_dim, bool native) {
  Problem p{};
  auto qd = q.dimensions(), kd = k.dimensions(), cd = cos.dimensions();
  if (qd.size() != 3 || kd.size() != 3 || cd.size() != 2 || key_cache.dimensions().size() < 4)
    return ffi::Error::InvalidArgument("rope_and_cache cpu: unexpected ranks");
  p.T = qd[0], p.QH = qd[1], p.D = qd[2], p.KH = kd[1], p.R = rotary_dim;
  p.max_pos = cd[0], p.width = cd[1], p.layout = static_cast<int>(layout);
  p.dt = DtypeCode(q.element_type()), p.table_dt = DtypeCode(cos.element_type());
  p.cache_dt = DtypeCode(key_cache.element_type());
  if (p.dt < 0 || p.dt > RC_F16 || p.table_dt < 0 || p.table_dt > RC_F16 || p.cache_dt < 0)
    return ffi::Error::InvalidArgument("rope_and_cache cpu: unsupported dtype");
  if (p.layout < RC_FLASH || p.layout > RC_XPACKED_SHUFFLED)
    return ffi::Error::InvalidArgument("rope_and_cache cpu: unknown layout " + std::to_string(layout));
  auto kcd = key_cache.dimensions();
  p.NB = kcd[0];
  p.BS = p.layout == RC_FLASH ? kcd[1] : kcd[3];
  p.X = 16 / static_cast<int64_t>(ffi::ByteWidth(key_cache.element_type()));
  // Every index the loops form stays inside these element counts.
  if (auto e = CheckSame("k tokens", kd[0], p.T); e.failure()) return e;
  if (auto e = CheckSame("k head_dim", kd[2], p.D); e.failure()) return e;
  if (auto e = CheckSame("v elements", v.element_count(), k.element_count()); e.failure()) return e;
  if (auto e = CheckSame("key_cache elements", key_cache.element_count(), p.NB * p.BS * p.KH * p.D); e.failure())
    return e;
  if (auto e = CheckSame("value_cache elements", value_cache.element_count(), p.NB * p.BS * p.KH * p.D);
      e.failure())
    return e;
  if (auto e = CheckSame("slot_mapping elements", slots.element_count(), p.T); e.failure()) return e;
  if (auto e = CheckSame("positions elements", positions.element_count(), p.T); e.failure()) return e;
  if (p.R < 2 || p.R % 2 || p.R > p.D || (p.width != p.R && p.width != p.R / 2) || p.max_pos < 1)
    return ffi::Error::InvalidArgument("rope_and_cache cpu: inconsistent rotary_dim / table width");
  if (p.layout != RC_FLASH && (p.D % p.X || (p.layout == RC_XPACKED_SHUFFLED && p.BS % p.X)))
    return ffi::Error::InvalidArgument("rope_and_cache cpu: x-packed layout needs D and BS divisible by X");

  p.full_table = p.width == p.R;
  p.neox = is_neox, p.native = native && p.dt != RC_F32;
  p.slots64 = slots.element_type() == ffi::DataType::S64;
  p.pos64 = positions.element_type() == ffi::DataType::S64;
  p.q = q.untyped_data(), p.k = k.untyped_data(), p.v = v.untyped_data();
  p.slots = slots.untyped_data(), p.pos = positions.untyped_data();
  p.cos = cos.untyped_data(), p.sin = sin.untyped_data();
  p.q_out = q_out->untyped_data(), p.k_out = k_out->untyped_data();
  p.kc = key_cache_out->untyped_data(), p.vc = value_cache_out->untyped_data();
  p.inv_k_scale = InverseScale(k_scale), p.inv_v_scale = InverseScale(v_scale);
  // Outputs alias the caches; should XLA ever hand separate buffers, start from the inputs' bits.
  if (p.kc != key_cache.untyped_data()) std::memcpy(p.kc, key_cache.untyped_data(), key_cache.size_bytes());
  if (p.vc != value_cache.untyped_data()) std::memcpy(p.vc, value_cache.untyped_data(), value_cache.size_bytes());
  if (p.T > 0) ParallelOverTokens(p, pool);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(kCpuRopeAndCache, CpuRopeAndCache,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()  // q
                                  .Arg<ffi::AnyBuffer>()  // k
                                  .Arg<ffi::AnyBuffer>()  // v
                                  .Arg<ffi::AnyBuffer>()  // key_cache
                                  .Arg<ffi::AnyBuffer>()  // value_cache
                                  .Arg<ffi::AnyBuffer>()  // slot_mapping
                                  .Arg<ffi::AnyBuffer>()  // positions
                                  .Arg<ffi::AnyBuffer>()  // cos
                                  .Arg<ffi::AnyBuffer>()  // sin
                                  .Arg<ffi::AnyBuffer>()  // k_scale (f32[], 1 when unused)
                                  .Arg<ffi::AnyBuffer>()  // v_scale
                                  .Ret<ffi::AnyBuffer>()  // q_out
                                  .Ret<ffi::AnyBuffer>()  // k_out
                                  .Ret<ffi::AnyBuffer>()  // key_cache (aliased)
                                  .Ret<ffi::AnyBuffer>()  // value_cache (aliased)
                                  .Attr<int64_t>("layout")
                                  .Attr<bool>("is_neox")
                                  .Attr<int64_t>("rotary_dim")
                                  .Attr<bool>("native"));

}  // namespace jax_rope_cache
