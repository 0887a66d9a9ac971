// nanobind module jax_rope_cache._native: hands the FFI handlers to Python as capsules, plus the
// scalar conversions of kernels/common/rope_cache_math.h so tests can check them exhaustively.
#include <cstdint>

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>

#include <string>

#include "kernels/common/rope_cache_math.h"
#include "kernels/ffi/handlers.h"

namespace nb = nanobind;

namespace {

template <typename Fn>
nb::capsule HandlerCapsule(Fn* fn) {
  return nb::capsule(reinterpret_cast<void*>(fn));
}

// Rounds float32 values to dtype code `dt` (RcDtype) and returns the stored bits as uint32.
void RoundF32(nb::ndarray<const float, nb::ndim<1>, nb::c_contig, nb::device::cpu> src,
              nb::ndarray<uint32_t, nb::ndim<1>, nb::c_contig, nb::device::cpu> bits, int dt) {
  if (src.shape(0) != bits.shape(0)) throw nb::value_error("src and bits must have the same length");
  const float* s = src.data();
  uint32_t* b = bits.data();
  for (size_t i = 0; i < src.shape(0); ++i) {
    switch (dt) {
      case RC_BF16: b[i] = rc_f32_to_bf16(s[i]); break;
      case RC_F16: b[i] = rc_f32_to_f16(s[i]); break;
      case RC_FP8_E4M3FN: b[i] = rc_f32_to_fp8(s[i], false); break;
      case RC_FP8_E4M3FNUZ: b[i] = rc_f32_to_fp8(s[i], true); break;
      case RC_FP8_E5M2: b[i] = rc_f32_to_e5m2(s[i]); break;
      default: throw nb::value_error("dt must be a 16- or 8-bit dtype code");
    }
  }
}

// Widens stored bits of dtype code `dt` to float32.
void WidenToF32(nb::ndarray<const uint32_t, nb::ndim<1>, nb::c_contig, nb::device::cpu> bits,
                nb::ndarray<float, nb::ndim<1>, nb::c_contig, nb::device::cpu> dst, int dt) {
  if (dst.shape(0) != bits.shape(0)) throw nb::value_error("bits and dst must have the same length");
  for (size_t i = 0; i < bits.shape(0); ++i) {
    const uint32_t b = bits.data()[i];
    switch (dt) {
      case RC_BF16: dst.data()[i] = rc_bf16_to_f32(static_cast<rc_u16>(b)); break;
      case RC_F16: dst.data()[i] = rc_f16_to_f32(static_cast<rc_u16>(b)); break;
      case RC_FP8_E4M3FN: dst.data()[i] = rc_fp8_to_f32(static_cast<rc_u8>(b), false); break;
      case RC_FP8_E4M3FNUZ: dst.data()[i] = rc_fp8_to_f32(static_cast<rc_u8>(b), true); break;
      case RC_FP8_E5M2: dst.data()[i] = rc_e5m2_to_f32(static_cast<rc_u8>(b)); break;
      default: throw nb::value_error("dt must be a 16- or 8-bit dtype code");
    }
  }
}

}  // namespace

NB_MODULE(_native, m) {
  m.def("cpu_handler", [] { return HandlerCapsule(jax_rope_cache::kCpuRopeAndCache); });
  m.def("cpu_token_scales_handler", [] { return HandlerCapsule(jax_rope_cache::kCpuRopeAndCacheTokenScales); });
  m.def("mla_cpu_handler", [] { return HandlerCapsule(jax_rope_cache::kCpuMlaRopeAndCache); });
  // GPU launcher: dicts of stage capsules, as jax.ffi.register_ffi_target takes them, for the
  // platform they are registered for ("CUDA" binds libcuda, "ROCM" binds libamdhip64).
  m.def(
      "gpu_handler",
      [](const std::string& platform, bool command_buffers) {
        const bool hip = platform == "ROCM" || platform == "rocm";
        if (!hip && platform != "CUDA" && platform != "cuda")
          throw nb::value_error("gpu_handler: platform must be 'CUDA' or 'ROCM'");
        nb::dict d;
        d["instantiate"] = HandlerCapsule(jax_rope_cache::kGpuRopeCacheInstantiate);
        d["initialize"] = hip ? HandlerCapsule(jax_rope_cache::kGpuRopeCacheInitializeHip)
                              : HandlerCapsule(jax_rope_cache::kGpuRopeCacheInitializeCuda);
        if (hip)
          d["execute"] = command_buffers ? HandlerCapsule(jax_rope_cache::kGpuRopeCacheExecuteHip)
                                         : HandlerCapsule(jax_rope_cache::kGpuRopeCacheExecuteNoGraphHip);
        else
          d["execute"] = command_buffers ? HandlerCapsule(jax_rope_cache::kGpuRopeCacheExecuteCuda)
                                         : HandlerCapsule(jax_rope_cache::kGpuRopeCacheExecuteNoGraphCuda);
        return d;
      },
      nb::arg("platform"), nb::arg("command_buffers") = true);
  m.def("gpu_check_buffers_handler", [] { return HandlerCapsule(jax_rope_cache::kGpuCheckBuffers); });
  m.def("gpu_launch_count", [] { return jax_rope_cache::GpuLaunchCount(); });
  m.def("gpu_module_count", [] { return jax_rope_cache::GpuModuleCount(); });
  m.def("round_f32", &RoundF32, nb::arg("src"), nb::arg("bits"), nb::arg("dt"));
  m.def("widen_to_f32", &WidenToF32, nb::arg("bits"), nb::arg("dst"), nb::arg("dt"));
}
