"""The f32 -> fp8 conversion instructions of sm_89+ (cvt.rn.satfinite.e4m3x2 / e5m2x2), which the
CUDA kernels use for e4m3fn and e5m2 stores (kernels/common/rope_cache_math.h, rc_f32_to_f8_hw),
against the integer code that the CPU handlers run and that tests/test_numerics.py compares with
ml_dtypes on every float32 where it rounds.

1. (NVRTC, CPU-only CI too) the sm_90 builds of the fp8 kernel variants use the instructions for
   e4m3fn and e5m2, never for e4m3fnuz (no such form), and the sm_80 builds do not use them.
2. (an NVIDIA GPU of compute capability >= 8.9) both conversions equal the integer code on all 2^32
   float32 inputs, NaNs and infinities included; a header reading the wrong byte fails the check.
"""

from __future__ import annotations

import ctypes

import ml_dtypes
import numpy as np
import pytest

from conftest import make_spec

nvrtc = pytest.importorskip("jax_rope_cache.compilers.nvrtc")
if not nvrtc.available():
    pytest.skip(f"NVRTC is not available: {nvrtc.unavailable_reason()} (pip install nvidia-cuda-nvrtc)",
                allow_module_level=True)

from jax_rope_cache.backends import cuda  # noqa: E402

FN, FNUZ, E5 = (np.dtype(t) for t in (ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e4m3fnuz, ml_dtypes.float8_e5m2))
INSTR = {FN: "cvt.rn.satfinite.e4m3x2.f32", E5: "cvt.rn.satfinite.e5m2x2.f32"}


@pytest.mark.parametrize("cdt", [FN, E5, FNUZ], ids=lambda d: d.name)
def test_fp8_variants_use_the_conversion_instruction_where_it_exists(cdt):
    spec = make_spec(T=1, QH=32, KH=8, D=128, cdt=cdt)
    cfg = cuda.kernel_config(spec, cuda.DEFAULT_SMS)
    src, headers = cuda.kernel_sources()
    opts = [o for o in cuda.BASE_OPTIONS if not o.startswith("--ptxas")] + cfg.options()

    def ptx(arch):
        return nvrtc.compile_cuda(src, arch=arch, options=opts, headers=headers).code.decode(errors="replace")

    sm90, sm80 = ptx("compute_90"), ptx("compute_80")
    assert "cvt.rn.satfinite.e" not in sm80
    if cdt in INSTR:
        assert INSTR[cdt] in sm90
    else:
        assert "cvt.rn.satfinite.e" not in sm90


# ---- every input, on the GPU ----------------------------------------------------------------------
CHECK_SRC = r"""
#include "rope_cache_math.h"
// out[0] / out[1]: e4m3fn / e5m2 inputs where the instruction path and the integer code differ;
// out[2] / out[3]: the first such input of each.
extern "C" __global__ void check_fp8_cvt(unsigned long long* out) {
  for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < (1ull << 32);
       i += (unsigned long long)gridDim.x * blockDim.x) {
    const float f = rc_bits_f32((rc_u32)i);
    if (rc_f32_to_fp8(f, false) != rc_f32_to_f8(f, 3u, 7u, 0x7eu, 0x7fu, false) && atomicAdd(&out[0], 1ull) == 0)
      out[2] = i;
    if (rc_f32_to_e5m2(f) != rc_f32_to_f8(f, 2u, 15u, 0x7bu, 0x7fu, false) && atomicAdd(&out[1], 1ull) == 0)
      out[3] = i;
  }
}
"""


def _gpu_cc():
    cc, _ = cuda._local_cuda_arch()
    if cc is None:
        pytest.skip("no CUDA GPU here (the exhaustive check runs on NVIDIA hosts)")
    if cc < 89:
        pytest.skip(f"compute capability {cc / 10:.1f}: the kernels use the integer code (no fp8 instructions)")
    return cc


def _run_check(header: str, cc: int) -> list[int]:
    """The check kernel built with `header` for the local GPU, run over all inputs: out[0..3]."""
    opts = [o for o in cuda.BASE_OPTIONS if not o.startswith("--ptxas")] + ["-DRC_HW_CVT=1"]
    ptx = nvrtc.compile_cuda(CHECK_SRC, arch=f"compute_{cc}", options=opts, headers={"rope_cache_math.h": header})
    assert b"cvt.rn.satfinite.e4m3x2.f32" in ptx.code and b"cvt.rn.satfinite.e5m2x2.f32" in ptx.code
    image = nvrtc.compile_cuda(CHECK_SRC, arch=f"sm_{cc}", options=opts, headers={"rope_cache_math.h": header}).code
    cu = ctypes.CDLL("libcuda.so.1")

    def ok(rc, what):
        assert rc == 0, f"{what}: CUDA error {rc}"

    dev, ctx = ctypes.c_int(), ctypes.c_void_p()
    ok(cu.cuInit(0), "cuInit")
    ok(cu.cuDeviceGet(ctypes.byref(dev), 0), "cuDeviceGet")
    ok(cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
    ok(cu.cuCtxPushCurrent_v2(ctx), "cuCtxPushCurrent")
    mod, fn, buf = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_uint64()
    try:
        ok(cu.cuModuleLoadData(ctypes.byref(mod), ctypes.c_char_p(image)), "cuModuleLoadData")
        ok(cu.cuModuleGetFunction(ctypes.byref(fn), mod, b"check_fp8_cvt"), "cuModuleGetFunction")
        ok(cu.cuMemAlloc_v2(ctypes.byref(buf), ctypes.c_size_t(32)), "cuMemAlloc")
        ok(cu.cuMemsetD8_v2(buf, ctypes.c_ubyte(0), ctypes.c_size_t(32)), "cuMemsetD8")
        arg = ctypes.c_uint64(buf.value)
        params = (ctypes.c_void_p * 1)(ctypes.cast(ctypes.pointer(arg), ctypes.c_void_p))
        ok(cu.cuLaunchKernel(fn, 1024, 1, 1, 256, 1, 1, 0, None, params, None), "cuLaunchKernel")
        ok(cu.cuCtxSynchronize(), "cuCtxSynchronize")
        out = (ctypes.c_uint64 * 4)()
        ok(cu.cuMemcpyDtoH_v2(out, buf, ctypes.c_size_t(32)), "cuMemcpyDtoH")
        return list(out)
    finally:
        if buf.value:
            cu.cuMemFree_v2(buf)
        if mod.value:
            cu.cuModuleUnload(mod)
        cu.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))
        cu.cuDevicePrimaryCtxRelease_v2(dev)


def test_fp8_conversion_instructions_equal_the_integer_code_on_every_input():
    cc = _gpu_cc()
    _, headers = cuda.kernel_sources()
    e4, e5, first4, first5 = _run_check(headers["rope_cache_math.h"], cc)
    assert (e4, e5) == (0, 0), f"mismatches: e4m3fn {e4} (first 0x{first4:08x}), e5m2 {e5} (first 0x{first5:08x})"


def test_fp8_conversion_check_catches_a_wrong_byte():
    """The check fails for a header that reads the other half of the instruction's result."""
    cc = _gpu_cc()
    _, headers = cuda.kernel_sources()
    hdr = headers["rope_cache_math.h"]
    old = "? 0x7fu : (h & 0xffu)"
    assert hdr.count(old) == 1, "the header's conversion changed; update this mutant"
    e4, e5, _, _ = _run_check(hdr.replace(old, "? 0x7fu : (h >> 8)"), cc)
    assert e4 > 0 and e5 > 0
