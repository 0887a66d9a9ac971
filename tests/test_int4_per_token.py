"""int4 caches with per-token scales (uint8 caches of head_dim / 2 bytes + k_scale_cache /
v_scale_cache): the reference against a float64 statement of the rule and the nibble order, the
XLA path bit-exact to the reference in every layout, read_kv, the refusal of the native kernels,
and the bad-input errors."""

from __future__ import annotations

import dataclasses
import warnings

import numpy as np
import pytest
from conftest import Case, assert_fma_close, num_blocks, ulp_diff, xla_bound
from test_fp8_per_token import SPECIAL_TOKENS, _valid, per_token_problem

import jax_rope_cache as jrc
from jax_rope_cache import contract, reference

F32 = np.float32
U8 = np.dtype(np.uint8)


def int4_problem(case: Case, seed: int, **kw):
    """per_token_problem's call (magnitudes 1e-3 .. 1e3, a zero row, inf and NaN) with uint8 caches
    of D/2 bytes pre-filled with random bytes."""
    args, opts = per_token_problem(dataclasses.replace(case, cache_dtype="float8_e4m3fn"), seed, **kw)
    rng = np.random.default_rng(seed + 2)
    lead = () if kw.get("layers") is None else (kw["layers"],)
    shapes = contract.cache_shapes(case.layout, num_blocks(case), case.BS, case.KH, case.D, U8)
    kc, vc = (None if s is None else rng.integers(0, 256, lead + s).astype(U8) for s in shapes)
    return args[:3] + (kc, vc) + args[5:], opts


def _expected(rows):
    """float64 statement: scale = r32(max(amax, 1e-8) / 7) over the finite |values|; value =
    clip(round_half_even(r32(y * r32(1 / scale))), -7, 7), NaN -> 0; byte j = v[2j] + 16 v[2j+1] mod 256."""
    y = rows.astype(np.float64)
    a = np.abs(y)
    a[~np.isfinite(a)] = 0
    scale = (np.maximum(a.max(axis=-1), float(F32(1e-8))) / 7.0).astype(F32)
    inv = (1.0 / scale.astype(np.float64)).astype(F32).astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        p = (y * inv[..., None]).astype(F32).astype(np.float64)
    p[np.isnan(p)] = 0
    v = np.clip(np.round(p), -7, 7).astype(np.int64)
    return scale, v, ((v[..., 0::2] % 16) + 16 * (v[..., 1::2] % 16)).astype(U8)


@pytest.mark.parametrize("layout", ["flash", "hnd", "head_major", "xpacked", "kv_merged"])
def test_reference_follows_the_rule(layout):
    case = Case(T=9, QH=4, KH=2, D=64, BS=16, layout=layout)
    args, opts = int4_problem(case, seed=3)
    q_out, k_out, kc, vc, ksc, vsc = reference.rope_and_cache(*args, **opts)
    s = args[5][_valid(args[5], num_blocks(case) * case.BS)]
    k_rows, v_rows = k_out.astype(F32)[_valid(args[5], num_blocks(case) * case.BS)], \
        args[2].astype(F32)[_valid(args[5], num_blocks(case) * case.BS)]
    kk, vv = reference.read_kv(kc, vc, s, layout=layout)  # the bytes, [n, KH, D/2]
    dk, dv = reference.read_kv(kc, vc, s, layout=layout, k_scale_cache=ksc, v_scale_cache=vsc)
    for rows, stored, deq in ((k_rows, kk, dk), (v_rows, vv, dv)):
        scale, vals, packed = _expected(rows)
        assert stored.dtype == U8 and stored.shape[-1] == case.D // 2
        np.testing.assert_array_equal(stored, packed)
        np.testing.assert_array_equal(deq, (vals * scale[..., None].astype(np.float64)).astype(F32))
        fin = np.isfinite(rows)
        err = np.abs(deq.astype(np.float64) - rows)[fin]
        assert np.all(err <= (0.5 + 1e-6) * np.broadcast_to(scale[..., None], rows.shape)[fin] + 1e-30)
    z, sp, n = SPECIAL_TOKENS
    vv_all = reference.unpack_int4(reference.read_kv(kc, vc, args[5], layout=layout)[1])
    assert np.all(vv_all[z, 0] == 0)
    assert vv_all[sp, 0, 3] == 7 and vv_all[sp, -1, 5] == -7 and vv_all[n, 0, 7] == 0


def test_nibble_order():
    v = np.array([[1, -2, 7, -7, 0, 3]], np.int8)
    b = reference.pack_int4(v)
    assert b.tolist() == [[0xE1, 0x97, 0x30]]  # channel 2j low nibble, 2j+1 high, two's complement
    np.testing.assert_array_equal(reference.unpack_int4(b), v)


CASES = [Case(T=9, QH=4, KH=2, D=64, BS=16, layout=lay) for lay in ("flash", "hnd", "head_major", "xpacked",
                                                                    "xpacked_shuffled", "kv_merged")] + [
    Case(T=9, QH=4, KH=2, D=64, BS=16, R=32, is_neox=False, precision="native", table_dtype="bfloat16"),
    Case(T=9, QH=4, KH=2, D=64, BS=16, dtype="float16", precision="native"),
]


@pytest.mark.parametrize("layers", [None, 3])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_xla_bit_exact_to_reference(case, layers):
    args, opts = int4_problem(case, seed=11, layers=layers, norm=layers is None)
    want = reference.rope_and_cache(*args, **opts)
    got = jrc.rope_and_cache(*args, impl="xla", **opts)
    fused = case.precision == "native" and case.table_dtype == "float32"  # FMA bound, as for int8
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
            d = reference.unpack_int4(g).astype(int) - reference.unpack_int4(w).astype(int)
            assert np.abs(d).max() <= 1, name
        else:
            np.testing.assert_array_equal(g.view(np.uint8), w.view(np.uint8), err_msg=name)


@pytest.mark.parametrize("layout", ["flash", "head_major", "xpacked", "kv_merged"])
def test_read_kv_dequantizes_like_the_reference(layout):
    case = Case(T=9, QH=4, KH=2, D=64, BS=16, layout=layout)
    args, opts = int4_problem(case, seed=13)
    *_, kc, vc, ksc, vsc = reference.rope_and_cache(*args, **opts)
    want = reference.read_kv(kc, vc, args[5], layout=layout, k_scale_cache=ksc, v_scale_cache=vsc)
    got = jrc.read_kv(kc, vc, args[5], layout=layout, k_scale_cache=ksc, v_scale_cache=vsc)
    for g, w in zip(got, want):
        assert np.asarray(g).shape == (case.T, case.KH, case.D)
        np.testing.assert_array_equal(np.asarray(g), w)


def test_kernel_refuses_int4_and_default_falls_back(monkeypatch):
    from jax_rope_cache.backends import cpu
    monkeypatch.setattr(cpu, "SUPPORTS", cpu.SUPPORTS - {"int4_cache"})  # the CPU handler runs it: a kernel without
    args, opts = int4_problem(Case(T=9, QH=4, KH=2, D=64, BS=16), seed=7)
    want = reference.rope_and_cache(*args, **opts)
    with pytest.raises(NotImplementedError, match=r"impl='kernel'.*int4 caches"):
        jrc.rope_and_cache(*args, impl="kernel", **opts)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        got = jrc.rope_and_cache(*args, **opts)
    assert sum("int4 caches" in str(x.message) for x in w) == 1
    np.testing.assert_array_equal(np.asarray(got[2]), want[2])


def test_make_kv_cache_int4():
    kc, vc = jrc.make_kv_cache(4, 16, 2, 64, np.uint8, layout="flash", fill="random")
    assert kc.dtype == U8 and kc.shape == (4, 16, 2, 32)
    kc, vc = jrc.make_kv_cache(4, 16, 2, 64, np.uint8, layout="xpacked")
    assert kc.shape == (4, 2, 2, 16, 16) and vc.shape == (4, 2, 32, 16)
    assert contract.cache_shapes("xpacked", 4, 16, 2, 64, np.uint8) == (kc.shape, vc.shape)  # D values, D/2 bytes
    with pytest.raises(ValueError, match="head_dim: layout 'xpacked' with uint8 needs a multiple of X=16"):
        jrc.make_kv_cache(4, 16, 2, 48, np.uint8, layout="xpacked")


def test_errors():
    args, opts = int4_problem(Case(T=9, QH=4, KH=2, D=64, BS=16), seed=9)
    bare = {k: v for k, v in opts.items() if k not in ("k_scale_cache", "v_scale_cache")}
    with pytest.raises(ValueError, match=r"key_cache: an int4 \(uint8\) cache .*k_scale_cache"):
        jrc.rope_and_cache(*args, impl="xla", **bare)
    full = np.zeros(args[3].shape[:-1] + (64,), U8)  # D bytes, not D/2
    with pytest.raises(ValueError, match="key_cache: expected shape"):
        jrc.rope_and_cache(*args[:3], full, full.copy(), *args[5:], impl="xla", **opts)


def test_every_backend_refuses_the_format():
    from jax_rope_cache import backends
    from jax_rope_cache.backends import native
    args, opts = int4_problem(Case(T=9, QH=4, KH=2, D=64, BS=16), seed=4)
    spec = contract.check_op(*args, **opts)
    assert "int4_cache" in contract.features(spec) and "int4_cache" in contract.CACHE_FORMAT_FEATURES
    for name, backend in backends.KERNEL_BACKENDS.items():
        if name == "cpu":  # the CPU handler implements it (tests/test_cpu_low_bit.py)
            assert "int4_cache" in backend.SUPPORTS
            continue
        assert not set(contract.CACHE_FORMAT_FEATURES) & set(backend.SUPPORTS), name
        with pytest.raises(native.KernelUnavailable, match="int4 caches"):
            native.refuse_unsupported(spec, backend.SUPPORTS, backend.NAME)
