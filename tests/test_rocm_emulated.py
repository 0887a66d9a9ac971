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
import itertools

import ml_dtypes
import numpy as np
import pytest

import rocm_emulator
from conftest import (Case, assert_bits_equal, make_problem, reference_op, special_problem, flydsl_kernel_module,
                      ulp_diff)
from e5m2_values import ROUNDING_EXPONENTS, boundary_f32, oracle_e5m2
from jax_rope_cache import contract, reference
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

# X taken from the key cache: narrower than a chunk (one store per X group, the bits of 16-bit caches
# split), 1, and wider than 16 bytes
CASES += [
    Case(T=5, QH=4, KH=2, D=64, layout="xpacked", X=4, dtype="bfloat16"),
    Case(T=6, QH=2, KH=1, D=32, layout="xpacked_shuffled", X=1, is_neox=False, dtype="float16", table="full"),
    Case(T=4, QH=4, KH=2, D=64, R=32, layout="xpacked", X=2, dtype="float16", cache_dtype="float8_e4m3fn",
         precision="native", table_dtype="float16"),
    Case(T=7, QH=2, KH=2, D=128, BS=32, layout="xpacked_shuffled", X=32, dtype="bfloat16",
         cache_dtype="float8_e4m3fnuz"),
    Case(T=3, QH=2, KH=1, D=64, layout="xpacked", X=16, is_neox=False, dtype="float32", index_dtype="int64"),
]
# float8_e5m2 caches: every layout, both precisions, "fused" (wide fp8) and "rounded", X narrower than 16
CASES += [
    Case(T=5, QH=4, KH=2, D=64, layout="flash", dtype="bfloat16", table_dtype="float32", cache_dtype="float8_e5m2",
         precision="native"),
    Case(T=6, QH=4, KH=1, D=128, R=64, layout="xpacked", is_neox=False, table="full", dtype="float16",
         table_dtype="float16", cache_dtype="float8_e5m2", precision="native", index_dtype="int64"),
    Case(T=4, QH=6, KH=3, D=32, layout="xpacked_shuffled", dtype="float32", table_dtype="bfloat16",
         cache_dtype="float8_e5m2"),
    Case(T=7, QH=2, KH=2, D=64, layout="hnd", is_neox=False, dtype="bfloat16", table_dtype="bfloat16",
         cache_dtype="float8_e5m2", precision="native"),
    Case(T=5, QH=4, KH=2, D=64, layout="xpacked", X=4, dtype="bfloat16", cache_dtype="float8_e5m2"),
]

custom_call_operands = rocm_emulator.custom_call_operands


def regime_config(spec, regime):
    """The kernel configuration of `spec` in the "latency" regime (what these small calls get) or the
    "bandwidth" one (what the same shapes get at a large T: tokens per workgroup, full-width chunks)."""
    from jax_rope_cache.backends import rocm

    cfg = rocm.kernel_config(spec if regime == "latency" else contract.kernel_codes(spec), K)
    assert cfg.latency == (regime == "latency") and (cfg.tpb == 1 or regime == "bandwidth"), cfg
    return cfg


@pytest.mark.parametrize("regime", ["latency", "bandwidth"])
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_emulated_kernel_matches_reference(case, regime):
    args, opts = make_problem(case, seed=7)
    spec = contract.check_op(*args, **opts)
    cfg = regime_config(spec, regime)
    got = rocm_emulator.run(K, cfg, custom_call_operands(args, opts))
    want = reference_op(*args, **opts)
    for name, g, w in zip(("q_out", "k_out", "key_cache", "value_cache"), got, want):
        assert_bits_equal(g, w, name)


def test_emulated_kernel_small_workgroups_cover_tails():
    """A config forced to several tokens per workgroup with a partial last workgroup."""
    case = Case(T=10, QH=1, KH=1, D=16, layout="flash", dtype="bfloat16")
    args, opts = make_problem(case, seed=3)
    from jax_rope_cache.backends import rocm

    cfg = rocm.kernel_config(contract.kernel_codes(contract.check_op(*args, **opts)), K)  # bandwidth
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
        if c is None:  # kv_merged: K and V in the key cache
            stacks.append(None)
            continue
        c = np.asarray(c)
        bits = rng.integers(0, 2**16, (layers,) + c.shape, dtype=np.uint16) & 0x3FFF  # finite bf16 values
        stacks.append(bits.view(c.dtype))
    args = list(args[:3]) + stacks + list(args[5:])
    spec = contract.check_op(*args, **opts, layer=np.zeros((), np.int32))
    cfg = rocm.kernel_config(spec, K)
    assert cfg.layer_blocks == spec.num_blocks
    for layer in (2, 0, -1, 3, 2**31 - 1):
        got = rocm_emulator.run(K, cfg, custom_call_operands(args, opts, layer))
        want = reference_op(*args, **opts, layer=np.array(layer, np.int32))
        for name, g, w in zip(("q_out", "k_out", "key_cache", "value_cache"), got, want):
            assert_bits_equal(g, w, f"{name} (layer {layer})")


_SPECIAL = [("bfloat16", "bfloat16", None, "native"), ("bfloat16", "float32", "float8_e4m3fn", "native"),
            ("float16", "float32", "float8_e4m3fnuz", "native"), ("float32", "float32", None, "native"),
            ("float16", "float16", "float8_e4m3fn", "fp32"), ("bfloat16", "float32", "float8_e5m2", "native")]


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
                                             ("float32", "float32", None, "fp32"),
                                             ("float32", "float32", "float8_e5m2", "native")], ids=lambda v: str(v))
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


# ---- QK-RMSNorm before the rotation, per-head fp8 scales ------------------------------
# Bitwise equality of bf16/f16 outputs barely depends on the last bits of the f32 sum (a 1-ulp change
# of inv flips a 16-bit rounding rarely), so float32 inputs carry the checks of the reduction order:
# their outputs hold inv's bits. Cases cover each way a lane gets its row's sum (NormLayout.plan):
# an xor butterfly reaching each cross-lane primitive (DPP 1/2/4/8, ds_swizzle 16, ds_bpermute 32),
# one lane holding the row, a reload of the row (chunks not aligned with the tree: D = 80, 96, R = 3D/4),
# the pass-through channels merged into the rotation phase or in their own phase.
NORM_CASES = [  # (case, q norm, k norm, weight dtype: "same" as q or "float32", per-head k/v scales, rot_cap)
    (Case(T=5, QH=8, KH=1, D=128, dtype="float32", table_dtype="float32"), True, True, "same", None, None),
    (Case(T=6, QH=8, KH=1, D=128), True, True, "same", None, None),  # Qwen3-32B TP8
    (Case(T=4, QH=16, KH=2, D=128, layout="xpacked", dtype="bfloat16", table_dtype="bfloat16", precision="native",
          cache_dtype="float8_e4m3fn"), True, True, "float32", (True, True), None),
    (Case(T=5, QH=4, KH=2, D=256, dtype="float32", table_dtype="float32", layout="xpacked_shuffled",
          cache_dtype="float8_e4m3fnuz"), True, False, "same", (True, False), None),  # 32 lanes: ds_swizzle
    (Case(T=3, QH=2, KH=2, D=256, dtype="float32", table_dtype="float32", precision="native"), False, True,
     "same", None, 2),  # 64 lanes: ds_bpermute
    (Case(T=7, QH=6, KH=3, D=64, R=32, is_neox=False, dtype="float32", table_dtype="bfloat16",
          cache_dtype="float8_e4m3fn"), True, True, "same", (False, True), None),  # merged pass-through
    (Case(T=5, QH=4, KH=2, D=128, R=64, layout="xpacked", dtype="float16", table_dtype="float16",
          precision="native", table="full"), True, True, "float32", None, None),
    (Case(T=4, QH=4, KH=1, D=64, R=2, dtype="float32", table_dtype="float32", table="full",
          layout="xpacked_shuffled"), True, True, "same", None, None),  # one lane per head
    (Case(T=5, QH=4, KH=2, D=80, dtype="float32", table_dtype="float32", cache_dtype="float8_e4m3fn"),
     True, True, "same", (True, True), None),  # reload: 5 lanes per head
    (Case(T=6, QH=6, KH=2, D=96, R=48, is_neox=False, dtype="float32", table_dtype="float32",
          layout="xpacked"), True, False, "same", None, None),  # reload, merged pass-through
    (Case(T=5, QH=4, KH=4, D=128, R=96, dtype="float32", table_dtype="float32", index_dtype="int64"),
     False, True, "same", None, None),  # reload, separate pass-through phase
    (Case(T=9, QH=2, KH=1, D=64, dtype="bfloat16", table_dtype="bfloat16", precision="native", table="full",
          cache_dtype="float8_e4m3fnuz", layout="xpacked"), False, True, "float32", (True, True), None),
    (Case(T=4, QH=8, KH=4, D=128, is_neox=False, dtype="float16", table_dtype="float32", precision="native",
          cache_dtype="float8_e4m3fn", layout="xpacked_shuffled"), True, True, "same", (True, True), 4),
    (Case(T=5, QH=4, KH=2, D=128, dtype="float32", table_dtype="float32", cache_dtype="float8_e4m3fn",
          precision="native"), False, False, "same", (True, True), None),  # per-head scales alone
    (Case(T=5, QH=4, KH=2, D=64, dtype="bfloat16", table_dtype="float32", cache_dtype="float8_e5m2", layout="hnd",
          precision="native"), False, False, "same", (True, True), None),  # e5m2, per-head scales alone
    (Case(T=4, QH=8, KH=2, D=128, dtype="float16", table_dtype="float16", cache_dtype="float8_e5m2",
          layout="xpacked"), True, True, "float32", (False, True), None),  # e5m2 with the norm
]


def _nid(p):
    case, qn, kn, wd, heads, cap = p
    return (f"{case.id}-{'q' if qn else ''}{'k' if kn else ''}norm-{wd}"
            f"{'-ks' if heads and heads[0] else ''}{'-vs' if heads and heads[1] else ''}{f'-cap{cap}' if cap else ''}")


def norm_problem(case, seed, q_norm, k_norm, wdtype="same", heads=None, eps=1e-6):
    """make_problem plus fresh random norm weights and (fp8) per-head scales."""
    args, opts = make_problem(case, seed)
    rng = np.random.default_rng(seed + 1000)
    dt = np.dtype(args[0].dtype)
    wd = dt if wdtype == "same" else np.dtype(np.float32)
    for name, on in (("q_norm_weight", q_norm), ("k_norm_weight", k_norm)):
        if on:
            opts[name] = rng.uniform(0.25, 2.0, case.D).astype(np.float32).astype(wd)
    if q_norm or k_norm:
        opts["norm_eps"] = float(eps)
    for name, on in zip(("k_scale", "v_scale"), heads or (False, False)):
        if on and name in opts:
            opts[name] = rng.uniform(0.05, 0.5, case.KH).astype(np.float32)
    return args, opts


def norm_config(args, opts, cap=None, regime="latency"):
    from jax_rope_cache.backends import rocm

    cfg = regime_config(contract.check_op(*args, **opts), regime)
    if cap:
        cfg = K.make_config(**rocm.config_codes(cfg, K), rot_cap=cap, latency=cfg.latency)
    return cfg


def run_and_compare(cfg, args, opts, what=""):
    with np.errstate(all="ignore"):
        got = rocm_emulator.run(K, cfg, custom_call_operands(args, opts))
        want = reference_op(*args, **opts)
    for name, g, w in zip(("q_out", "k_out", "key_cache", "value_cache"), got, want):
        assert np.array_equal(g.view(np.uint8), w.view(np.uint8)), (
            f"{name}{what}: {int((ulp_diff(g, w) != 0).sum())} elements differ (max {ulp_diff(g, w).max()} ulp)")
    return got


@pytest.mark.parametrize("regime", ["latency", "bandwidth"])
@pytest.mark.parametrize("p", NORM_CASES, ids=[_nid(p) for p in NORM_CASES])
def test_emulated_norm_and_per_head_scales_match_reference(p, regime):
    case, qn, kn, wd, heads, cap = p
    args, opts = norm_problem(case, 21, qn, kn, wd, heads)
    cfg = norm_config(args, opts, cap, regime)
    assert (cfg.q_norm >= 0, cfg.k_norm >= 0) == (qn, kn)
    run_and_compare(cfg, args, opts)


def test_norm_cases_cover_every_path():
    """The cases above reach every way of forming the sum and every cross-lane primitive."""
    seen = set()
    for (case, qn, kn, wd, heads, cap), regime in itertools.product(NORM_CASES, ("latency", "bandwidth")):
        args, opts = norm_problem(case, 0, qn, kn, wd, heads)
        cfg = norm_config(args, opts, cap, regime)
        seen.add(f"{regime}, weights {'early' if cfg.latency and K.norm_layout(cfg).plan else 'late'}")
        if not cfg.norm:
            continue
        nl = K.norm_layout(cfg)
        plan = "reload" if nl.plan is None else nl.plan[0]
        seen.add(plan)
        if plan != "local" and nl.plan is not None:
            seen |= {f"xor{m}" for m in (1, 2, 4, 8, 16, 32) if m < nl.lanes}
        seen.add("merged" if nl.merged else ("pass phase" if cfg.r < cfg.d else "full rotary"))
        seen.add({(True, True): "both", (True, False): "q only", (False, True): "k only"}[(qn, kn)])
        seen.add(f"weight {wd}")
    want = {"latency, weights early", "latency, weights late", "bandwidth, weights late", "reload", "local", "add", "fam", "merged", "pass phase", "full rotary", "both", "q only", "k only",
            "weight same", "weight float32"} | {f"xor{m}" for m in (1, 2, 4, 8, 16, 32)}
    assert want <= seen, want - seen


def _plant_specials(x, rng):
    """Rows (token, head) of x made hostile: zeros, a NaN, an inf, subnormals, the dtype's max (its
    square overflows), a mix of huge and tiny values."""
    x = x.copy()
    fi = ml_dtypes.finfo(x.dtype)
    T, H, D = x.shape
    rows = [(t, h) for t in range(T) for h in range(H)]
    rng.shuffle(rows)
    specials = [np.zeros(D), None, None, np.full(D, float(fi.smallest_subnormal)),
                np.full(D, float(fi.max)), None, np.full(D, -float(fi.smallest_normal))]
    for i, (t, h) in enumerate(rows[: len(specials)]):
        s = specials[i]
        if i == 1:
            x[t, h, rng.integers(D)] = np.nan
        elif i == 2:
            x[t, h, rng.integers(D)] = -np.inf
        elif i == 5:
            x[t, h, ::2] = float(fi.max) / 4
        else:
            x[t, h] = s.astype(x.dtype)
    return x


@pytest.mark.parametrize("dt,eps", [("float32", 1e-6), ("bfloat16", 1e-5), ("float16", 1e-45), ("float32", 3.0)])
def test_emulated_norm_special_rows_bitwise(dt, eps):
    """Zero rows (inv = 1/sqrt(eps)), NaN and inf entries, subnormal rows, overflowing squares, a
    subnormal eps and a large one: every bit as the reference, NaNs canonical."""
    case = Case(T=6, QH=8, KH=2, D=64, dtype=dt, table_dtype="float32", cache_dtype="float8_e4m3fn",
                precision="native")
    args, opts = norm_problem(case, 5, True, True, "same", (True, True), eps=eps)
    rng = np.random.default_rng(5)
    args = list(args)
    args[0], args[1] = _plant_specials(args[0], rng), _plant_specials(args[1], rng)
    run_and_compare(norm_config(args, opts), args, opts)


def _sequential(vals, add):
    out = vals[0]
    for v in vals[1:]:
        out = add(out, v)
    return out


@pytest.mark.parametrize("mutant", ["sequential chunk sums", "DPP row_mirror for xor 4", "1-ulp sqrt"])
def test_emulated_norm_catches_a_wrong_reduction(monkeypatch, mutant):
    """The checks are sharp: the same case passes as written and fails with a plausible mistake (the
    chunks summed in order, a DPP pattern that is not the xor partner, a sqrt off by one ulp, as the
    bare v_sqrt_f32 can be)."""
    case = Case(T=8, QH=8, KH=2, D=128, dtype="float32", table_dtype="float32")
    args, opts = norm_problem(case, 33, True, True)
    # in-order sums equal the tree on 2-element chunks (latency: f32 chunks of 2): the bandwidth config's 4
    cfg = norm_config(args, opts, regime="bandwidth" if mutant == "sequential chunk sums" else "latency")
    assert K.norm_layout(cfg).lanes >= 8
    run_and_compare(cfg, args, opts)
    if mutant == "sequential chunk sums":
        monkeypatch.setattr(K, "tree_sum", _sequential)
    elif mutant == "DPP row_mirror for xor 4":
        real = K._Emitter.lane_xor
        monkeypatch.setattr(K._Emitter, "lane_xor", lambda self, v, m, tid: real(self, v, 8 if m == 4 else m, tid))
    else:
        real_sqrt = K._Emitter.sqrt
        monkeypatch.setattr(K._Emitter, "sqrt", lambda self, f: self.bitcast(
            self.f32, self.add(self.bitcast(self.i32, real_sqrt(self, f)), self.i32c(1))))
    with pytest.raises(AssertionError, match="differ"):
        run_and_compare(cfg, args, opts)


# ---- float8_e5m2: stacked caches with per-head scales, the conversion on every boundary ----------
def test_emulated_e5m2_stacked_layers_per_head_scales():
    """A float8_e5m2 cache stacked [L, ...] with one scale per kv head: each layer in range is
    written exactly, one outside [0, L) writes nothing."""
    from jax_rope_cache.backends import rocm

    layers = 3
    case = Case(T=7, QH=4, KH=2, D=64, layout="xpacked_shuffled", dtype="bfloat16", table_dtype="float32",
                cache_dtype="float8_e5m2", precision="native")
    args, opts = make_problem(case, seed=6)
    rng = np.random.default_rng(6)
    args = list(args[:3]) + [np.stack([rng.standard_normal(np.shape(c)).astype(np.float32).astype(c.dtype)
                                       for _ in range(layers)]) for c in args[3:5]] + list(args[5:])
    opts.update(k_scale=np.asarray([0.3, 0.02], np.float32), v_scale=np.asarray([2.5, 0.007], np.float32))
    cfg = rocm.kernel_config(contract.check_op(*args, **opts, layer=np.zeros((), np.int32)), K)
    for layer in (2, 0, -1):
        got = rocm_emulator.run(K, cfg, custom_call_operands(args, opts, layer))
        want = reference_op(*args, **opts, layer=np.array(layer, np.int32))
        for name, g, w in zip(("q_out", "k_out", "key_cache", "value_cache"), got, want):
            assert_bits_equal(g, w, f"{name} (layer {layer})")


def _e5m2_boundary_problem():
    """v (float32) holds every e5m2 boundary value (e5m2_values.boundary_f32), scale 1: the value
    cache holds the conversion of each."""
    f = boundary_f32(exponents=ROUNDING_EXPONENTS)
    kh, d = 8, 256
    f = np.concatenate([f, np.full((-f.size) % (kh * d), 1.5, np.float32)])
    t = f.size // (kh * d)
    rng = np.random.default_rng(14)
    q = rng.standard_normal((t, kh, d)).astype(np.float32)
    e5 = np.dtype(ml_dtypes.float8_e5m2)
    kshape, vshape = contract.cache_shapes("flash", -(-t // 16), 16, kh, d, e5)
    kc, vc = (rng.standard_normal(s).astype(np.float32).astype(e5) for s in (kshape, vshape))
    slots = rng.permutation(kshape[0] * 16)[:t].astype(np.int32)
    args = (q, q.copy(), f.reshape(t, kh, d), kc, vc, slots, np.zeros(t, np.int32), np.ones((1, d // 2), np.float32),
            np.zeros((1, d // 2), np.float32))
    return args, dict(k_scale=np.float32(1.0), v_scale=np.float32(1.0)), f


def _e5m2_values_stored(kernel):
    from jax_rope_cache.backends import rocm

    args, opts, f = _e5m2_boundary_problem()
    cfg = rocm.kernel_config(contract.check_op(*args, **opts), kernel)
    with np.errstate(all="ignore"):
        got = rocm_emulator.run(kernel, cfg, custom_call_operands(args, opts))
    return args, opts, f, got


def test_emulated_e5m2_conversion_every_boundary():
    """The FlyDSL kernel's f32_to_e5m2_bits on every e5m2 boundary value: the value cache equals the
    independent oracle, every output the reference."""
    args, opts, f, got = _e5m2_values_stored(K)
    _, v_read = reference.read_kv(got[2], got[3], args[5])
    assert np.array_equal(v_read.view(np.uint8).ravel(), oracle_e5m2(f))
    for name, g, w in zip(("q_out", "k_out", "key_cache", "value_cache"), got, reference_op(*args, **opts)):
        assert np.array_equal(g.view(np.uint8), w.view(np.uint8)), name


_E5M2_MUTANTS = [
    ("saturates to inf", "c(21)), c(0x7B))", "c(21)), c(0x7C))"),
    ("truncates", "self._rne_shift(self.sub(x, c(112 << 23)), c(21))", "self.lshr(self.sub(x, c(112 << 23)), c(21))"),
    ("subnormal shift", "shift = self.sub(c(134), e)", "shift = self.sub(c(133), e)"),
    ("NaN keeps the sign", "c(0x7F), out)  # canonical NaN", "self.bor(sign, c(0x7E)), out)  # canonical NaN"),
]


@pytest.mark.parametrize("what,old,new", [pytest.param(*m, marks=[pytest.mark.full] if i else [])
                                          for i, m in enumerate(_E5M2_MUTANTS)], ids=[m[0] for m in _E5M2_MUTANTS])
def test_emulated_e5m2_conversion_would_catch_a_wrong_rule(what, old, new, tmp_path, monkeypatch):
    """Each plausible mistake in f32_to_e5m2_bits, built into a copy of the kernel source, changes
    the value cache of the boundary problem above (so that test would fail)."""
    import sys

    with open(K.__file__) as fh:
        text = fh.read()
    assert text.count(old) == 1, f"{what}: the kernel no longer has {old!r}; update the mutant"
    path = tmp_path / "rope_cache_flydsl.py"
    path.write_text(text.replace(old, new))
    monkeypatch.setitem(sys.modules, K.__name__, K)  # loading the copy replaces the module entry; restored after
    mutant = flydsl.kernel_module(str(path))
    args, opts, f, got = _e5m2_values_stored(mutant)
    _, v_read = reference.read_kv(got[2], got[3], args[5])
    assert not np.array_equal(v_read.view(np.uint8).ravel(), oracle_e5m2(f)), f"{what}: not caught"


# ---- slots at the edges of [0, NB*BS) on stacked caches ------------------------------------------
EDGE_CASES = [("flash", "int64", None), ("hnd", "int32", None), ("xpacked_shuffled", "int64", None),
              ("xpacked", "int32", "float8_e4m3fnuz")]


def _edge_results(kernel, layout, index_dtype, fp8, regime, layers=None):
    """[(layer, the kernel's results, the reference's)] of tests/test_hardening.py's slot-edge
    problem (slots n, n+1, -1, the int32/int64 extremes, runs crossing 0 and n), at `layers`
    (default: every layer)."""
    from test_hardening import _slot_edge_problem

    args, opts = _slot_edge_problem(layout, index_dtype, fp8, seed=23)
    spec = contract.check_op(*args, **opts, layer=np.zeros((), np.int32))
    cfg = regime_config(spec, regime)
    out = []
    for layer in range(args[3].shape[0]) if layers is None else layers:
        fresh = [np.array(a, copy=True) for a in args]  # the emulator writes the caches in place
        fresh_opts = {k: np.array(v, copy=True) if isinstance(v, np.ndarray) else v for k, v in opts.items()}
        got = rocm_emulator.run(kernel, cfg, custom_call_operands(fresh, fresh_opts, layer))
        out.append((layer, got, reference.rope_and_cache(*args, **opts, layer=layer)))
    return out


def test_emulated_kernel_slots_at_the_edges_write_their_layer_only():
    """Every result bit-exact at every layer, both regimes: no write past slot n - 1 or before slot
    0 of the layer (it would land in a neighbouring layer), none for the int32/int64 extremes.
    (One test, not a matrix: the default tier samples this file's matrices.)"""
    for layout, index_dtype, fp8 in EDGE_CASES:
        for regime in ("latency", "bandwidth"):
            for layer, got, want in _edge_results(K, layout, index_dtype, fp8, regime):
                for name, g, w in zip(contract.RESULTS + contract.TOKEN_SCALE_RESULTS, got, want):
                    assert_bits_equal(g, w, f"{name} ({layout}, {index_dtype}, {fp8}, {regime}, layer {layer})")


_SLOT_MUTANTS = [
    ("upper bound lets slot n through", 'E.cmp("slt", s, num_slots)', 'E.cmp("sle", s, num_slots)'),
    ("lower bound lets slot -1 through", 'E.cmp("sge", s, c64(0))', 'E.cmp("sge", s, c64(-1))'),
]


def test_emulated_slot_edges_would_catch_an_off_by_one_bound(tmp_path, monkeypatch):
    """Each off-by-one in the kernel's slot check, built into a copy of the kernel source, changes
    a neighbouring layer of the slot-edge problem at the middle layer (so the test above would
    fail by values; at the first or last layer the emulator stops at the write outside the cache)."""
    import sys

    with open(K.__file__) as fh:
        text = fh.read()
    monkeypatch.setitem(sys.modules, K.__name__, K)  # loading a copy replaces the module entry; restored after
    for what, old, new in _SLOT_MUTANTS:
        assert text.count(old) == 1, f"{what}: the kernel no longer has {old!r}; update the mutant"
        path = tmp_path / f"{len(what)}_rope_cache_flydsl.py"
        path.write_text(text.replace(old, new))
        mutant = flydsl.kernel_module(str(path))
        [(_, got, want)] = _edge_results(mutant, "flash", "int32", None, "latency", layers=[1])
        assert [n for n, g, w in zip(("key_cache", "value_cache"), got[2:4], want[2:4]) if ulp_diff(g, w).any()], \
            f"{what}: not caught"
