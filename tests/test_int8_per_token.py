"""int8 caches with per-token scales (cache dtype int8 + k_scale_cache / v_scale_cache): the
reference against a float64 statement of the rule, the XLA path bit-exact to the reference in every
layout (stacked layers, the norm, native arithmetic), read_kv's dequantization, the native kernels'
refusal, and the bad-input errors."""

from __future__ import annotations

import dataclasses
import warnings

import jax
import numpy as np
import pytest
from conftest import Case, assert_fma_close, num_blocks, ulp_diff, xla_bound
from test_fp8_per_token import SPECIAL_TOKENS, _valid, per_token_problem

import jax_rope_cache as jrc
from jax_rope_cache import contract, reference

F32 = np.float32
I8 = np.dtype(np.int8)


def int8_problem(case: Case, seed: int, **kw):
    """per_token_problem's call (rows of magnitudes 1e-3 .. 1e3, a zero row, inf and NaN) with int8
    caches pre-filled with random values in [-127, 127]."""
    case = dataclasses.replace(case, cache_dtype="float8_e4m3fn")
    args, opts = per_token_problem(case, seed, **kw)
    rng = np.random.default_rng(seed + 2)
    fill = lambda a: None if a is None else rng.integers(-127, 128, a.shape).astype(I8)  # noqa: E731
    return args[:3] + (fill(args[3]), fill(args[4])) + args[5:], opts


def _expected(rows):
    """An independent float64 statement of the rule: scale = r32(max(amax, 1e-8) / 127) over the
    finite |values|; stored = clip(round_half_even(r32(y * r32(1 / scale))), -127, 127), NaN -> 0."""
    y = rows.astype(np.float64)
    a = np.abs(y)
    a[~np.isfinite(a)] = 0
    scale = (np.maximum(a.max(axis=-1), float(F32(1e-8))) / 127.0).astype(F32)
    inv = (1.0 / scale.astype(np.float64)).astype(F32).astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        p = (y * inv[..., None]).astype(F32).astype(np.float64)  # the f32 product: exact in f64, one rounding
    p[np.isnan(p)] = 0
    return scale, np.clip(np.round(p), -127, 127).astype(I8)


@pytest.mark.parametrize("layout", ["flash", "hnd", "head_major", "xpacked", "kv_merged"])
def test_reference_follows_the_rule(layout):
    case = Case(T=9, QH=4, KH=2, D=64, BS=16, layout=layout)
    args, opts = int8_problem(case, seed=3)
    q_out, k_out, kc, vc, ksc, vsc = reference.rope_and_cache(*args, **opts)
    valid = _valid(args[5], num_blocks(case) * case.BS)
    k_rows, v_rows = k_out.astype(F32)[valid], args[2].astype(F32)[valid]
    kk, vv = reference.read_kv(kc, vc, args[5][valid], layout=layout)
    ks, vs = (reference.read_tokens(c, "scale", layout, args[5][valid] // case.BS, args[5][valid] % case.BS,
                                    case.KH, 1).reshape(-1, case.KH) for c in (ksc, vsc))
    for rows, stored, scale in ((k_rows, kk, ks), (v_rows, vv, vs)):
        want_scale, want = _expected(rows)
        np.testing.assert_array_equal(scale, want_scale)
        np.testing.assert_array_equal(stored, want)
        # the bound: a finite value is within half a step (and the f32 rounding of 1/scale) of its dequantized one
        fin = np.isfinite(rows)
        err = np.abs(stored.astype(np.float64) * scale[..., None] - rows)[fin]
        assert np.all(err <= (0.5 + 1e-6) * np.broadcast_to(scale[..., None], rows.shape)[fin] + 1e-30)
    z, s, n = SPECIAL_TOKENS
    assert np.any(kk == 127) or np.any(kk == -127)  # the row maximum maps to +-127


def test_reference_special_values():
    case = Case(T=9, QH=4, KH=2, D=64, BS=16)
    args, opts = int8_problem(case, seed=5)
    *_, kc, vc, ksc, vsc = reference.rope_and_cache(*args, **opts)
    z, s, n = SPECIAL_TOKENS
    slots = args[5]
    vv = reference.read_kv(kc, vc, slots, layout="flash")[1]
    sc = reference.read_kv(kc, vc, slots, layout="flash", k_scale_cache=ksc, v_scale_cache=vsc)[1]
    assert np.all(vv[z, 0] == 0) and np.all(sc[z, 0] == 0)  # a zero row: scale 1e-8/127, all zero
    assert vv[s, 0, 3] == 127 and vv[s, -1, 5] == -127  # +-inf saturate
    assert vv[n, 0, 7] == 0  # NaN stores 0
    assert np.all(np.isfinite(sc))


CASES = [Case(T=9, QH=4, KH=2, D=64, BS=16, layout=lay) for lay in ("flash", "hnd", "head_major", "xpacked",
                                                                    "xpacked_shuffled", "kv_merged")] + [
    Case(T=9, QH=4, KH=2, D=64, BS=16, R=32, is_neox=False, precision="native", table_dtype="bfloat16"),
    Case(T=9, QH=4, KH=2, D=64, BS=16, dtype="float16", precision="native"),
]


@pytest.mark.parametrize("layers", [None, 3])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_xla_bit_exact_to_reference(case, layers):
    args, opts = int8_problem(case, seed=11, layers=layers, norm=layers is None)
    want = reference.rope_and_cache(*args, **opts)
    got = jrc.rope_and_cache(*args, impl="xla", **opts)
    assert len(got) == 6
    # "fused" native arithmetic: XLA may contract a product into an FMA (docs/numerics.md#the-xla-path),
    # so k moves by an f32 ulp, its scale by one and a stored value by one step; everything else is exact
    fused = case.precision == "native" and case.table_dtype == "float32"
    for name, g, w in zip(("q_out", "k_out", "key_cache", "value_cache", "k_scale_cache", "v_scale_cache"), got, want):
        if w is None:
            assert g is None
            continue
        g = np.asarray(g)
        assert g.dtype == w.dtype and g.shape == w.shape, name
        if fused and name in ("q_out", "k_out"):
            assert_fma_close(g, w, xla_bound(name, args, opts), name)
        elif fused and name == "k_scale_cache":
            assert ulp_diff(g, w).max() <= 1, name
        elif fused and name == "key_cache":
            assert np.abs(g.astype(int) - w.astype(int)).max() <= 1, name
        else:
            np.testing.assert_array_equal(g.view(np.uint8), w.view(np.uint8), err_msg=name)


@pytest.mark.parametrize("layout", ["flash", "head_major", "xpacked", "kv_merged"])
def test_read_kv_dequantizes_like_the_reference(layout):
    case = Case(T=9, QH=4, KH=2, D=64, BS=16, layout=layout)
    args, opts = int8_problem(case, seed=13)
    *_, kc, vc, ksc, vsc = reference.rope_and_cache(*args, **opts)
    slots = args[5]
    want = reference.read_kv(kc, vc, slots, layout=layout, k_scale_cache=ksc, v_scale_cache=vsc)
    got = jrc.read_kv(kc, vc, slots, layout=layout, k_scale_cache=ksc, v_scale_cache=vsc)
    for g, w in zip(got, want):
        assert np.asarray(g).dtype == np.float32
        np.testing.assert_array_equal(np.asarray(g), w)
    raw = jrc.read_kv(kc, vc, slots, layout=layout)
    assert np.asarray(raw[0]).dtype == I8


def test_kernel_refuses_int8_and_default_falls_back(monkeypatch):
    from jax_rope_cache.backends import cpu
    monkeypatch.setattr(cpu, "SUPPORTS", cpu.SUPPORTS - {"int8_cache"})  # the CPU handler runs it: a kernel without
    args, opts = int8_problem(Case(T=9, QH=4, KH=2, D=64, BS=16), seed=7)
    want = reference.rope_and_cache(*args, **opts)
    with pytest.raises(NotImplementedError, match=r"impl='kernel'.*int8 caches"):
        jrc.rope_and_cache(*args, impl="kernel", **opts)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        got = jrc.rope_and_cache(*args, **opts)
    assert sum("int8 caches" in str(x.message) for x in w) == 1
    np.testing.assert_array_equal(np.asarray(got[2]), want[2])
    for mod in jrc.backends.__dict__.values():
        if hasattr(mod, "SUPPORTS"):
            assert "int8_cache" not in mod.SUPPORTS


def test_make_kv_cache_int8():
    kc, vc = jrc.make_kv_cache(4, 16, 2, 64, np.int8, layout="xpacked", fill="random")
    assert kc.dtype == I8 and kc.shape == (4, 2, 64 // 16, 16, 16) and vc.shape == (4, 2, 64, 16)
    assert np.abs(np.asarray(kc).astype(int)).max() > 1
    ksc, _ = jrc.make_kv_scale_cache(4, 16, 2, layout="head_major")
    assert ksc.shape == (2, 4, 16)


def test_errors():
    args, opts = int8_problem(Case(T=9, QH=4, KH=2, D=64, BS=16), seed=9)
    bare = {k: v for k, v in opts.items() if k not in ("k_scale_cache", "v_scale_cache")}
    with pytest.raises(ValueError, match="key_cache: an int8 cache .*k_scale_cache"):
        jrc.rope_and_cache(*args, impl="xla", **bare)
    with pytest.raises(ValueError, match="k_scale: expected None with per-token scales"):
        jrc.rope_and_cache(*args, impl="xla", k_scale=1.0, **opts)
    with pytest.raises(ValueError, match="k_scale: scales apply to float8 caches only"):  # int8: per-token only
        jrc.read_kv(args[3], args[4], args[5], k_scale=1.0, v_scale=1.0)
    with pytest.raises(TypeError, match="dtype: expected one of .*int8"):
        jrc.make_kv_cache(4, 16, 2, 64, np.int16)


def test_every_backend_refuses_the_format():
    from jax_rope_cache import backends
    from jax_rope_cache.backends import native
    args, opts = int8_problem(Case(T=9, QH=4, KH=2, D=64, BS=16), seed=4)
    spec = contract.check_op(*args, **opts)
    assert "int8_cache" in contract.features(spec) and "int8_cache" in contract.CACHE_FORMAT_FEATURES
    for name, backend in backends.KERNEL_BACKENDS.items():
        if name == "cpu":  # the CPU handler implements it (tests/test_cpu_low_bit.py)
            assert "int8_cache" in backend.SUPPORTS
            continue
        assert not set(contract.CACHE_FORMAT_FEATURES) & set(backend.SUPPORTS), name
        with pytest.raises(native.KernelUnavailable, match="int8 caches"):
            native.refuse_unsupported(spec, backend.SUPPORTS, backend.NAME)
