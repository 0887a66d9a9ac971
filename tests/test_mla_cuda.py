"""The MLA CUDA kernel (kernels/cuda/mla_cache.cu) without a GPU:

1. NVRTC compiles its variants for sm_80 / sm_90: a cubin with the kernel, no spills, no stack.
2. The same source built for the host (kernels/cuda/host_emulation.h; every thread of a block run
   in turn) is compared bit for bit with the numpy reference, and checks that every unit of every
   block ran exactly once over its parts and threads.
3. Lowering for CUDA on this machine (jax.export) emits ONE launcher custom call with the caches
   aliased and the code-object table inside.
Heavy parametrizations are marked `full`.
"""

from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import os
import re
import shutil
import subprocess

import jax
import numpy as np
import pytest

from conftest import assert_bits_equal
from mla_cases import BF16, CASES, E5, E5M2_FULL_CASES, F16, F32, FN, FNUZ, MlaCase, flat_outputs, make_mla_problem
from jax_rope_cache.mla import contract as mla_contract
from jax_rope_cache.mla import reference as mla_reference

nvrtc = pytest.importorskip("jax_rope_cache.compilers.nvrtc")
if not nvrtc.available():
    pytest.skip(f"NVRTC is not available: {nvrtc.unavailable_reason()} (pip install nvidia-cuda-nvrtc)",
                allow_module_level=True)

from jax_rope_cache.backends import cuda, launcher  # noqa: E402
from jax_rope_cache.mla import kernels  # noqa: E402

DEEPSEEK_TP8 = dict(QH=16, Dn=512, Dc=512, Dr=64, BS=16, NB=4)


def spec_of(case: MlaCase, T=None, layer=None):
    args, opts = make_mla_problem(dataclasses.replace(case, T=min(case.T, 4)) if T else case, seed=0, layer=layer)
    spec = mla_contract.check_mla(*args, **opts)
    return dataclasses.replace(spec, num_tokens=T) if T else spec


def _compile_ok(cfg, arch):
    c = kernels.compile_mla(cfg, arch)
    assert c.code[:4] == b"\x7fELF" and kernels.CUDA_KERNEL.encode() in c.code
    assert "spill" in c.log, c.log
    assert not any(nvrtc.spills(c)), c.log
    return c


@pytest.mark.parametrize("T", [1, 64, 8192, 32768])
def test_nvrtc_deepseek_shapes_compile_without_spills(T):
    for cdt in (None, FN, E5):
        cfg = kernels.mla_kernel_config(spec_of(MlaCase(**DEEPSEEK_TP8, cache_dtype=cdt), T=T))
        _compile_ok(cfg, "sm_90")


COMPILE_MATRIX = [dataclasses.replace(c, T=4) for c in CASES] + [
    MlaCase(**DEEPSEEK_TP8, layout="split", cache_dtype=FNUZ, q_out_dtype=FN, precision="native"),
    MlaCase(QH=128, Dn=128, Dc=512, Dr=64, BS=64, dtype=F16, is_neox=True, full=True),  # TP1, not absorbed
    MlaCase(QH=8, Dn=512, Dc=512, Dr=64, BS=1, dtype=F32, cache_dtype=FN, index_dtype="int64", layers=61),  # Kimi TP8
]


@pytest.mark.full
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("case", COMPILE_MATRIX, ids=[c.id for c in COMPILE_MATRIX])
def test_nvrtc_matrix_compiles_without_spills(case, arch):
    for T in (1, 8192):
        _compile_ok(kernels.mla_kernel_config(spec_of(case, T=T)), arch)


# ---- host emulation ---------------------------------------------------------------------------------
_KDIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "kernels")


def _build(cfg, tmp_dir, source=None):
    cxx = shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no C++ compiler for the host emulation")
    defs = cfg.options()
    tag = hashlib.sha256((" ".join(defs) + (source or "")).encode()).hexdigest()[:16]
    src = os.path.join(_KDIR, "cuda", "mla_cache.cu")
    if source is not None:
        src = os.path.join(tmp_dir, f"mla_cache_{tag}.cu")
        with open(src, "w") as f:
            f.write(source)
    so = os.path.join(tmp_dir, f"mla_emu_{tag}.so")
    if not os.path.exists(so):
        cmd = [cxx, "-std=c++17", "-O1", "-ffp-contract=off", "-fno-fast-math", "-shared", "-fPIC", "-DRC_EMULATE",
               *defs, "-I", os.path.join(_KDIR, "cuda"), "-I", os.path.join(_KDIR, "common"), "-x", "c++", src, "-o", so]
        subprocess.run(cmd, check=True, capture_output=True, text=True)
    return ctypes.CDLL(so)


@pytest.fixture(scope="module")
def emu_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("mla_emu"))


def emulate(args, opts, emu_dir, cfg=None, source=None):
    """The kernel run on the host on (args, opts); returns (q_out, k_pe_out, kv_cache) as the API does."""
    spec = mla_contract.check_mla(*args, **opts)
    cfg = cfg or kernels.mla_kernel_config(spec)
    lib = _build(cfg, emu_dir, source)
    caches = [np.ascontiguousarray(c).copy() for c in mla_contract.cache_tuple(args[4], spec.layout)]
    layer = opts.get("layer")
    ops = [np.ascontiguousarray(a) for a in args[:4]] + caches + [np.ascontiguousarray(a) for a in args[5:]] + [
        np.asarray(opts.get("kv_scale", 1.0), np.float32).reshape(()), np.asarray(opts.get("q_scale", 1.0), np.float32).reshape(()),
        np.asarray(0 if layer is None else int(np.asarray(layer)), np.int32).reshape(())]
    q_out = np.zeros((spec.num_tokens, spec.q_heads, spec.q_dim), spec.q_out_dtype)
    k_pe_out = np.zeros((spec.num_tokens, spec.rope_dim), spec.dtype)
    rets = [q_out, k_pe_out] + caches
    na, nr = len(ops), len(rets)
    assert lib.mla_num_operands() == na

    class Params(ctypes.Structure):
        _fields_ = [("ptr", ctypes.c_void_p * (na + nr)), ("dim0", ctypes.c_int64 * na)]

    p = Params()
    for i, a in enumerate(ops + rets):
        p.ptr[i] = a.ctypes.data
    for i, a in enumerate(ops):
        p.dim0[i] = a.shape[0] if a.ndim else 1
    lib.mla_emulate.argtypes = [ctypes.POINTER(Params), ctypes.c_longlong]
    grid = -(-spec.num_tokens // cfg.tokens_per_block)
    errors = lib.mla_emulate(ctypes.byref(p), grid)
    assert errors == 0, f"{errors} blocks whose units did not run exactly once"
    return q_out, k_pe_out, caches[0] if spec.layout == "combined" else tuple(caches)


def _check(args, opts, emu_dir, cfg=None, source=None):
    got = emulate(args, opts, emu_dir, cfg, source)
    want = mla_reference.mla_rope_and_cache(*args, **opts)
    for name, g, w in zip(("q_out", "k_pe_out", "cache0", "cache1"), flat_outputs(got), flat_outputs(want)):
        assert_bits_equal(g, w, name)


EMU_DEFAULT = [CASES[2], CASES[5], MlaCase(T=5, **DEEPSEEK_TP8, layout="split", cache_dtype=FNUZ, q_out_dtype=FN,
                                             precision="native"),
               MlaCase(T=5, **DEEPSEEK_TP8, cache_dtype=E5, q_out_dtype=E5, precision="native")]  # e5m2, fused


@pytest.mark.parametrize("case", EMU_DEFAULT, ids=[c.id for c in EMU_DEFAULT])
def test_host_emulation_bitwise(case, emu_dir):
    args, opts = make_mla_problem(case, seed=21)
    _check(args, opts, emu_dir)


@pytest.mark.full
@pytest.mark.parametrize("case", CASES + E5M2_FULL_CASES, ids=[c.id for c in CASES + E5M2_FULL_CASES])
def test_host_emulation_bitwise_every_case(case, emu_dir):
    args, opts = make_mla_problem(case, seed=22)
    _check(args, opts, emu_dir)


@pytest.mark.parametrize("regime", ["latency", "bandwidth"])
def test_host_emulation_both_regimes(regime, emu_dir):
    """Latency: one token per block split over parts (grid.y); bandwidth: several tokens per block,
    several units per thread, copy units unrolled (a partial last block)."""
    case = MlaCase(T=13, QH=16, Dn=64, Dc=64, Dr=16, BS=8, NB=4, cache_dtype=FN)
    args, opts = make_mla_problem(case, seed=23)
    spec = mla_contract.check_mla(*args, **opts)
    cfg = kernels.mla_kernel_config(spec, num_sms=132 if regime == "latency" else 2)
    assert (cfg.parts > 1) == (regime == "latency") and (cfg.tokens_per_block > 1) == (regime == "bandwidth")
    if regime == "bandwidth":
        cfg = dataclasses.replace(cfg, defines=tuple((k, 32 if k == "MLA_NT" else v) for k, v in cfg.defines),
                                  threads=32)
    _check(args, opts, emu_dir, cfg)


@pytest.mark.parametrize("T", [8192, 32768])
def test_deepseek_bandwidth_config_gives_each_thread_one_round_of_copies(T):
    """DeepSeek-V3 TP8 at large T: one token per block, its 1088 copy units (16 x 64 q_nope chunks +
    64 kv_c chunks of 16 bytes) in one round of at most UNROLL per thread, no thread left with a
    second round (256 threads took 4 + 1)."""
    for cdt in (None, FN):
        cfg = kernels.mla_kernel_config(spec_of(MlaCase(**DEEPSEEK_TP8, cache_dtype=cdt), T=T), num_sms=132)
        d = dict(cfg.defines)
        copy_units = d["MLA_TPB"] * (16 * 512 + 512) // d["MLA_W"]
        assert (d["MLA_TPB"], d["MLA_W"], cfg.parts) == (1, 8, 1) and copy_units == 1088
        assert cfg.threads % 32 == 0 and d["MLA_UNROLL"] <= kernels.UNROLL
        assert cfg.threads * d["MLA_UNROLL"] >= copy_units > (cfg.threads - 32) * d["MLA_UNROLL"], cfg


def test_host_emulation_deepseek_bandwidth_config(emu_dir):
    """The configuration of the H200's large calls (one token per block, 288 threads, the position and
    slot loaded in the prologue) on a few tokens, invalid slots included."""
    case = MlaCase(T=6, **DEEPSEEK_TP8, cache_dtype=FN)
    args, opts = make_mla_problem(case, seed=27)
    spec = mla_contract.check_mla(*args, **opts)
    cfg = kernels.mla_kernel_config(spec, num_sms=2)
    assert cfg.tokens_per_block == 1 and cfg.parts == 1 and cfg.threads == 288, cfg
    assert dict(cfg.defines)["MLA_UNROLL"] == 4
    _check(args, opts, emu_dir, cfg)


@pytest.mark.parametrize("layer", [1, -1, 3])
def test_host_emulation_stacked_layer(layer, emu_dir):
    case = MlaCase(T=6, layers=3, layout="split", cache_dtype=FN)
    args, opts = make_mla_problem(case, seed=24, layer=np.array(layer, np.int32))
    _check(args, opts, emu_dir)


@pytest.mark.parametrize("what,old,new", [
    ("rotation units skip one", "(N_COPY - u0 + STRIDE - 1) / STRIDE * STRIDE", "(N_COPY - u0 + STRIDE - 1) / STRIDE * STRIDE + STRIDE"),
    ("sin's sign", "rc_rotate_pair(a, b, tab(p.ptr[A_COS], trow + ca), tab(p.ptr[A_SIN], trow + ca)",
     "rc_rotate_pair(a, b, tab(p.ptr[A_COS], trow + ca), -tab(p.ptr[A_SIN], trow + ca)"),
    ("latent chunk offset", "u.src = t * DC + j * W;", "u.src = t * DC;"),
    ("the prologue's slot", "load_index(p.ptr[A_SLOT], t0, MLA_SLOT64 != 0)}", "load_index(p.ptr[A_SLOT], 0, MLA_SLOT64 != 0)}"),
    ("the prologue's position", "pre = TokenIdx{load_index(p.ptr[A_POS], t0,", "pre = TokenIdx{load_index(p.ptr[A_POS], T - 1,"),
])
def test_host_emulation_would_catch_a_wrong_kernel(what, old, new, emu_dir):
    src = open(os.path.join(_KDIR, "cuda", "mla_cache.cu")).read()
    assert src.count(old) == 1, what
    case = MlaCase(T=9, BS=8, NB=2)  # slots >= NB*BS present; several units per thread
    args, opts = make_mla_problem(case, seed=25)
    spec = mla_contract.check_mla(*args, **opts)
    cfg = kernels.mla_kernel_config(spec)  # 8 threads: every thread does copy units, then rotation units
    cfg = dataclasses.replace(cfg, defines=tuple((k, 8 if k == "MLA_NT" else v) for k, v in cfg.defines), threads=8)
    _check(args, opts, emu_dir, cfg)  # the kernel as it is passes
    with pytest.raises(AssertionError, match="differ|exactly once"):
        _check(args, opts, emu_dir, cfg, source=src.replace(old, new))


# ---- the lowering --------------------------------------------------------------------------------------
def test_export_for_cuda_is_one_launcher_call_with_aliased_caches():
    import jax_rope_cache as jrc
    from jax_rope_cache import api

    case = MlaCase(T=4, **DEEPSEEK_TP8, layout="split", cache_dtype=FN)
    args, opts = make_mla_problem(case, seed=26)

    def step(*a):
        return jrc.mla_rope_and_cache(*a, **opts, impl="kernel")

    exp = jax.export.export(jax.jit(step), platforms=["cuda"], disabled_checks=api.DISABLED_EXPORT_CHECKS)(*args)
    text = exp.mlir_module()
    calls = re.findall(r"stablehlo\.custom_call @(\w+)", text)
    assert calls == [launcher.GPU_TARGET] or calls == [launcher.GPU_TARGET_NO_GRAPH], calls
    assert "output_operand_aliases" in text and text.count("operand_index = 4") >= 1 and "operand_index = 5" in text
    assert kernels.CUDA_KERNEL in text
    assert "slot_mapping,positions,cos,sin,kv_scale,q_scale,layer,q_out,k_pe_out,ckv_cache result" in text
