"""Multimodal RoPE in the GPU kernels without a GPU (CPU-only CI).

CUDA: the kernel built for the host (kernels/cuda/host_emulation.h, tests/test_cuda_compile.py's
run_emulation: guard bytes around every output, checked untouched) bit for bit against the numpy
reference on positions [3, T] with out-of-range streams, both assignment rules, the QK-norm, both
styles, every layout, fp8 caches; NVRTC compiles Qwen3-VL variants for sm_90 without spills.
FlyDSL (AMD): the lane emulator (tests/rocm_emulator.py) runs the kernel's M-RoPE variant against
the reference, and FlyDSL compiles it for gfx942 / gfx950 where FlyDSL is installed.

The default tier runs a handful of cases; the rest carry the `full` marker (JRC_TEST_TIER=full).
"""

from __future__ import annotations

import os

import ml_dtypes
import numpy as np
import pytest

from jax_rope_cache import contract, reference
from conftest import Case
from test_mrope import FULL, QWEN25_VL, QWEN3_VL, make_mrope_problem

BF16, F16, F32 = np.dtype(ml_dtypes.bfloat16), np.dtype(np.float16), np.dtype(np.float32)


def _cuda():
    """test_cuda_compile's emulation helpers (skips, as that module does, without NVRTC)."""
    import test_cuda_compile

    return test_cuda_compile


# (case, section, interleaved, norm); the first CUDA_DEFAULT run in the default tier
KERNEL_CASES = [
    (Case(T=37, QH=8, KH=2, D=128, table_dtype="float32"), QWEN3_VL, True, "qk"),
    (Case(T=5, QH=4, KH=2, D=128, layout="xpacked", precision="native", dtype="bfloat16", table_dtype="bfloat16",
          table="full"), QWEN25_VL, False, "qk"),
    (Case(T=130, QH=4, KH=1, D=64, R=48, layout="xpacked_shuffled", is_neox=False, dtype="float16",
          cache_dtype="float8_e4m3fn", precision="native", index_dtype="int64"), (8, 8, 8), False, ""),
    (Case(T=9, QH=2, KH=2, D=80, R=64, is_neox=False, table="full", dtype="float32", table_dtype="bfloat16"),
     (12, 10, 10), True, "k"),
    (Case(T=21, QH=4, KH=2, D=128, layout="xpacked", dtype="bfloat16", cache_dtype="float8_e4m3fnuz",
          precision="native"), QWEN3_VL, True, "q"),
    (Case(T=1, QH=16, KH=1, D=128, precision="native", dtype="bfloat16", table_dtype="bfloat16"), QWEN3_VL, True,
     "qk"),
    (Case(T=64, QH=8, KH=1, D=256, R=128, layout="xpacked", is_neox=True, table="full"), (16, 24, 24), False, "qk"),
]
CUDA_DEFAULT = 3
IDS = [f"{c.id}-{'il' if il else 'sec'}-norm{n or 'none'}" for c, _, il, n in KERNEL_CASES]


def _cases(default: int):
    return [pytest.param(*c, id=i, marks=() if n < default else FULL) for n, (c, i) in
            enumerate(zip(KERNEL_CASES, IDS))]


def _problem(case, section, interleaved, norm, seed=0):
    args, opts = make_mrope_problem(case, section, interleaved, seed=seed, norm=norm)
    return args, opts, reference.rope_and_cache(*args, **opts)


@pytest.fixture(scope="module")
def emu_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("emu_mrope"))


@pytest.mark.parametrize("case,section,interleaved,norm", _cases(CUDA_DEFAULT))
def test_cuda_host_emulation_bitwise(case, section, interleaved, norm, emu_dir):
    tcc = _cuda()
    args, opts, want = _problem(case, section, interleaved, norm, seed=case.T)
    got = tcc._emulate(args, opts, emu_dir)
    tcc._assert_bitwise(got, want)


def test_cuda_host_emulation_would_catch_a_wrong_assignment(emu_dir):
    """The kernel with the interleaved rule's height and width slots swapped fails the comparison."""
    tcc = _cuda()
    args, opts, want = _problem(*KERNEL_CASES[0], seed=1)
    hdr = open(os.path.join(tcc._kernel_dir(), "common", "rope_cache_math.h")).read()
    old = "((i % 3 == 1 && i < 3 * h) ? 1 : ((i % 3 == 2 && i < 3 * w) ? 2 : 0))"
    assert old in hdr
    src = open(os.path.join(tcc._kernel_dir(), "cuda", "rope_cache.cu")).read()
    mutant = src.replace('#include "rope_cache_math.h"', hdr.replace(old, "((i % 3 == 2 && i < 3 * w) ? 1 : "
                                                                     "((i % 3 == 1 && i < 3 * h) ? 2 : 0))"))
    assert mutant != src
    got = tcc._emulate(args, opts, emu_dir, source=mutant)
    assert not np.array_equal(got[0].view(np.uint8), np.asarray(want[0]).view(np.uint8))


def _spec(T, QH, KH, D, layout, section, interleaved, norm=True, dt=BF16, tdt=F32, prec="fp32"):
    import jax

    s = jax.ShapeDtypeStruct
    kc, vc = contract.cache_shapes(layout, 64, 16, KH, D, dt)
    w = None if not norm else s((D,), dt)
    return contract.check_op(s((T, QH, D), dt), s((T, KH, D), dt), s((T, KH, D), dt), s(kc, dt), s(vc, dt),
                             s((T,), np.int32), s((3, T), np.int32), s((4096, D // 2), tdt), s((4096, D // 2), tdt),
                             layout=layout, precision=prec, q_norm_weight=w, k_norm_weight=w,
                             mrope_section=section, mrope_interleaved=interleaved)


# Qwen3-VL-8B TP1 (32/8/128) and Qwen3-VL-235B-A22B TP8 (8/1/128) at T = 1 and 8192
COMPILE_CASES = [dict(T=1, QH=32, KH=8, D=128, layout="flash"), dict(T=8192, QH=8, KH=1, D=128, layout="flash"),
                 dict(T=8192, QH=32, KH=8, D=128, layout="xpacked"), dict(T=1, QH=8, KH=1, D=128, layout="xpacked_shuffled",
                                                                           dt=BF16, tdt=BF16, prec="native"),
                 dict(T=128, QH=28, KH=4, D=128, layout="flash", norm=False, section=QWEN25_VL, interleaved=False)]


@pytest.mark.parametrize("kw", [pytest.param(kw, id=f"{kw['T']}-{kw['QH']}x{kw['KH']}-{kw['layout']}",
                                             marks=() if i < 2 else FULL) for i, kw in enumerate(COMPILE_CASES)])
def test_nvrtc_compiles_qwen3_vl_without_spills(kw):
    tcc = _cuda()
    kw = dict(kw)
    spec = _spec(section=kw.pop("section", QWEN3_VL), interleaved=kw.pop("interleaved", True), **kw)
    failures = tcc.spill_failures([spec], ["mrope"], "sm_90")
    assert not failures, failures[0]
    from jax_rope_cache.backends import cuda

    defines = dict(cuda.kernel_config(spec).defines)
    assert defines["RC_MROPE"] == (1 if spec.mrope_section == QWEN25_VL else 2)
    assert (defines["RC_MROPE_T"], defines["RC_MROPE_H"], defines["RC_MROPE_W"]) == spec.mrope_section
    from conftest import make_spec

    # without M-RoPE the variant (and its cache key) has no M-RoPE define: the kernel's defaults
    assert not any(k.startswith("RC_MROPE") for k, _ in cuda.kernel_config(make_spec(T=kw["T"])).defines)


def test_rocm_lowering_without_the_flydsl_variant_falls_back():
    """The FlyDSL kernel has no M-RoPE variant yet: the ROCm backend says so before compiling,
    so impl=None lowers the XLA path (with a warning) and impl="kernel" raises naming the feature."""
    from jax_rope_cache.backends import native, rocm

    spec = _spec(T=8, QH=8, KH=1, D=128, layout="flash", section=QWEN3_VL, interleaved=True)
    assert "mrope" not in rocm.SUPPORTS
    with pytest.raises(native.KernelUnavailable, match="multimodal RoPE") as e:
        native.refuse_unsupported(spec, rocm.SUPPORTS, rocm.NAME)
    assert isinstance(e.value.__cause__, NotImplementedError) and "impl='kernel' on ROCm" in str(e.value.__cause__)
    native.refuse_unsupported(spec, rocm.SUPPORTS | {"mrope"}, rocm.NAME)  # no other feature is missing
