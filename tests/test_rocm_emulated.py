"""The ROCm kernel's logic on the CPU, bit for bit against the reference (no GPU, no flydsl).

The emitter in kernels/rocm/rope_cache_flydsl.py builds the kernel from a small set of MLIR
calls; tests/rocm_emulator.py implements those calls on numpy arrays (one value per lane, whole
workgroups, byte-array device memory, buffer-descriptor bounds, scf.if masks). Running the same
emitter through it checks the kernel's work decomposition, index math (slots, layouts, clamped
positions, tails of the last workgroup), conversions and arithmetic against
jax_rope_cache.reference on hostile inputs. What it cannot check: FlyDSL/LLVM's lowering of those
calls and the hardware (that is the job of tests/test_rocm_compile.py and of the suite on a ROCm
host).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import rocm_emulator
from conftest import Case, assert_bits_equal, make_problem, reference_op, special_problem, flydsl_kernel_module
from jax_rope_cache import contract
from jax_rope_cache.compilers import flydsl


K = flydsl_kernel_module()  # the installed source, else the repository's (the emulator needs no build)

CASES = [
    Case(),
    Case(T=5, QH=8, KH=1, D=64, layout="xpacked", dtype="bfloat16", cache_dtype="float8_e4m3fnuz"),
    Case(T=9, QH=4, KH=2, D=64, R=32, layout="xpacked_shuffled", is_neox=False, table="full", dtype="float16",
         table_dtype="float16", cache_dtype="float8_e4m3fn", precision="native", index_dtype="int64"),
    Case(T=6, QH=2, KH=2, D=32, layout="flash", is_neox=False, dtype="float32", table_dtype="bfloat16",
         index_dtype="int64"),
    Case(T=7, QH=4, KH=1, D=128, R=64, layout="xpacked", table="full", dtype="bfloat16", table_dtype="float32",
         precision="native"),
    Case(T=4, QH=6, KH=3, D=80, layout="flash", dtype="float16", cache_dtype="float8_e4m3fnuz", BS=8),
    Case(T=3, QH=2, KH=1, D=64, R=2, layout="xpacked_shuffled", dtype="bfloat16", table="full", BS=16),
    Case(T=11, QH=8, KH=8, D=64, layout="flash", dtype="bfloat16", table_dtype="bfloat16", precision="native"),
]
# a covering sweep: every layout x style x (dtype, cache, table, precision) combo, rotating the rest
_COMBOS = [("bfloat16", None, "float32", "fp32"), ("float16", "float8_e4m3fn", "float16", "native"),
           ("float32", None, "bfloat16", "fp32"), ("bfloat16", "float8_e4m3fnuz", "bfloat16", "native"),
           ("float16", None, "float32", "native"), ("bfloat16", "float8_e4m3fn", "float32", "native"),
           ("float32", "float8_e4m3fnuz", "float32", "native")]
_i = 0
for _layout in contract.LAYOUTS:
    for _neox in (True, False):
        for _dt, _cdt, _tdt, _prec in _COMBOS:
            _i += 1
            _D = (32, 64, 128)[_i % 3]
            CASES.append(Case(T=3 + _i % 6, QH=(2, 4, 6)[_i % 3], KH=(1, 2, 3)[_i % 3], D=_D,
                              R=_D // 2 if _i % 4 == 0 else None, layout=_layout, is_neox=_neox,
                              table="full" if _i % 2 else "half", dtype=_dt, cache_dtype=_cdt, table_dtype=_tdt,
                              precision=_prec, index_dtype="int64" if _i % 3 == 1 else "int32"))


def custom_call_operands(args, opts, layer=0):
    fp8 = np.dtype(args[3].dtype) in contract.FP8_DTYPES
    ks = np.asarray(opts.get("k_scale", 1.0) if fp8 else 1.0, np.float32).reshape(())
    vs = np.asarray(opts.get("v_scale", 1.0) if fp8 else 1.0, np.float32).reshape(())
    no_norm = np.zeros(1, np.float32)  # q_norm_weight / k_norm_weight placeholders
    return [np.asarray(a) for a in args] + [ks, vs, np.asarray(layer, np.int32).reshape(()), no_norm, no_norm]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_emulated_kernel_matches_reference(case):
    args, opts = make_problem(case, seed=7)
    from jax_rope_cache.backends import rocm

    spec = contract.check_op(*args, **opts)
    cfg = rocm.kernel_config(spec, K)
    got = rocm_emulator.run(K, cfg, custom_call_operands(args, opts))
    want = reference_op(*args, **opts)
    for name, g, w in zip(("q_out", "k_out", "key_cache", "value_cache"), got, want):
        assert_bits_equal(g, w, name)


def test_emulated_kernel_small_workgroups_cover_tails():
    """A config forced to several tokens per workgroup with a partial last workgroup."""
    case = Case(T=10, QH=1, KH=1, D=16, layout="flash", dtype="bfloat16")
    args, opts = make_problem(case, seed=3)
    from jax_rope_cache.backends import rocm

    cfg = rocm.kernel_config(contract.check_op(*args, **opts), K)
    assert cfg.tpb > 1 and case.T % cfg.tpb, cfg
    got = rocm_emulator.run(K, cfg, custom_call_operands(args, opts))
    for name, g, w in zip(("q_out", "k_out", "key_cache", "value_cache"), got, reference_op(*args, **opts)):
        assert_bits_equal(g, w, name)


@pytest.mark.parametrize("layout", contract.LAYOUTS)
def test_emulated_kernel_writes_one_layer_of_stacked_caches(layout):
    """Stacked caches [L, NB, ...]: the layer is read from its operand on the device; a layer in
    range writes exactly that layer (bit-exact), one outside [0, L) writes nothing."""
    from jax_rope_cache.backends import rocm

    layers = 3
    case = Case(T=9, QH=4, KH=2, D=64, layout=layout, dtype="bfloat16")
    args, opts = make_problem(case, seed=5)
    rng = np.random.default_rng(5)
    stacks = []
    for c in (args[3], args[4]):
        c = np.asarray(c)
        bits = rng.integers(0, 2**16, (layers,) + c.shape, dtype=np.uint16) & 0x3FFF  # finite bf16 values
        stacks.append(bits.view(c.dtype))
    args = list(args[:3]) + stacks + list(args[5:])
    spec = contract.check_op(*args, **opts, layer=np.zeros((), np.int32))
    cfg = rocm.kernel_config(spec, K)
    assert cfg.layer_blocks == np.asarray(args[3]).shape[1]
    for layer in (2, 0, -1, 3, 2**31 - 1):
        got = rocm_emulator.run(K, cfg, custom_call_operands(args, opts, layer))
        want = reference_op(*args, **opts, layer=np.array(layer, np.int32))
        for name, g, w in zip(("q_out", "k_out", "key_cache", "value_cache"), got, want):
            assert_bits_equal(g, w, f"{name} (layer {layer})")


_SPECIAL = [("bfloat16", "bfloat16", None, "native"), ("bfloat16", "float32", "float8_e4m3fn", "native"),
            ("float16", "float32", "float8_e4m3fnuz", "native"), ("float32", "float32", None, "native"),
            ("float16", "float16", "float8_e4m3fn", "fp32")]


def _dt(name):
    import ml_dtypes

    return None if name is None else np.dtype(getattr(ml_dtypes, name, None) or name)


@pytest.mark.parametrize("dt,tdt,cdt,prec", _SPECIAL, ids=lambda v: str(v))
def test_emulated_kernel_special_values_bitwise(dt, tdt, cdt, prec):
    """NaN (payloads, signs, signalling), +-inf, +-0, subnormals and +-max as x, partner, cos and
    sin in every combination: bit for bit with the reference, NaN bits included (the canonical
    NaN of every conversion, llvm.intr.fma in "fused" arithmetic)."""
    from jax_rope_cache.backends import rocm

    args, opts = special_problem(_dt(dt), _dt(tdt), _dt(cdt), prec)
    cfg = rocm.kernel_config(contract.check_op(*args, **opts), K)
    with np.errstate(all="ignore"):
        got = rocm_emulator.run(K, cfg, custom_call_operands(args, opts))
        want = reference_op(*args, **opts)
    for name, g, w in zip(("q_out", "k_out", "key_cache", "value_cache"), got, want):
        assert np.array_equal(g.view(np.uint8), w.view(np.uint8)), f"{name}: {int((g.view(np.uint8) != w.view(np.uint8)).sum())} bytes differ"


@pytest.mark.parametrize("dt,tdt,cdt,prec", [("bfloat16", "float32", "float8_e4m3fn", "native"),
                                             ("bfloat16", "bfloat16", None, "native"),
                                             ("float32", "float32", None, "fp32")], ids=lambda v: str(v))
@pytest.mark.parametrize("scale", [1e-40, 0.0])
def test_emulated_kernel_subnormals_and_tiny_scales(dt, tdt, cdt, prec, scale):
    """Values, products and results over the subnormal range; fp8 scales whose reciprocal
    overflows (clamped to FLT_MAX, 0 stays 0): bit-exact to the reference."""
    from jax_rope_cache.backends import rocm

    case = Case(T=9, QH=4, KH=2, D=64, dtype=dt, table_dtype=tdt, cache_dtype=cdt, precision=prec)
    args, opts = make_problem(case, seed=11)
    rng = np.random.default_rng(11)
    args = list(args)
    for i in (0, 1, 2, 7, 8):
        a = args[i]
        args[i] = (a.astype(np.float32) * np.exp2(rng.integers(-140, 2, a.shape))).astype(a.dtype)
    if "k_scale" in opts:
        opts.update(k_scale=np.float32(scale), v_scale=np.float32(scale))
    cfg = rocm.kernel_config(contract.check_op(*args, **opts), K)
    with np.errstate(all="ignore"):
        got = rocm_emulator.run(K, cfg, custom_call_operands(args, opts))
        want = reference_op(*args, **opts)
    assert (np.abs(want[0].astype(np.float32)) < 2.0**-126).sum() > 20
    for name, g, w in zip(("q_out", "k_out", "key_cache", "value_cache"), got, want):
        assert_bits_equal(g, w, name)
        assert np.array_equal(g.view(np.uint8), w.view(np.uint8)), name
