"""Low-bit caches, one test per property parametrized by format: int8 and int4 per (token, kv head)
(float32 scale caches), NVFP4 (E2M1 bytes, float8_e4m3fn block scales per 16 values, a global
decode scale) and MXFP4 (E2M1 bytes, float8_e8m0fnu block scales per 32 values). The reference
against an independent float64 / ml_dtypes statement of each rule, the XLA path bit-exact to the
reference (layouts, stacked layers, the norm, native arithmetic, slot edges), read_kv's
dequantization and its error bound, the native kernels' refusal, and the bad-input errors."""

from __future__ import annotations

import dataclasses
import warnings

import jax
import ml_dtypes
import numpy as np
import pytest
from conftest import Case, assert_fma_close, num_blocks, ulp_diff, xla_bound
from test_fp8_per_token import SPECIAL_TOKENS, _valid, per_token_problem

import jax_rope_cache as jrc
from jax_rope_cache import contract, reference
from jax_rope_cache.backends import xla

F32 = np.float32
I8, U8 = np.dtype(np.int8), np.dtype(np.uint8)
FORMATS = ("int8", "int4", "nvfp4", "mxfp4")
BLOCK = ("nvfp4", "mxfp4")
CACHE_DTYPE = {"int8": I8, "int4": U8, "nvfp4": U8, "mxfp4": U8}
FEATURE_TEXT = {"int8": "int8 caches", "int4": "int4 caches", "nvfp4": "NVFP4 caches", "mxfp4": "MXFP4 caches"}
LAYOUTS = {f: ("flash", "hnd", "head_major", "xpacked", "xpacked_shuffled", "kv_merged") for f in ("int8", "int4")}
LAYOUTS.update(dict.fromkeys(BLOCK, contract.BLOCK_LAYOUTS))  # no block-scale layout defined for the others


def problem(fmt: str, case: Case, seed: int, **kw):
    """per_token_problem's call (rows of magnitudes 1e-3 .. 1e3, a zero row, inf and NaN) with caches
    of format `fmt` pre-filled with random bytes / values, and its scale caches (NVFP4: random
    global scales in [0.5, 2], so the largest rows saturate their block scale at 448)."""
    args, opts = per_token_problem(dataclasses.replace(case, cache_dtype="float8_e4m3fn"), seed, **kw)
    rng = np.random.default_rng(seed + 2)
    lead = () if kw.get("layers") is None else (kw["layers"],)
    cdt = CACHE_DTYPE[fmt]
    lo, hi = (-127, 128) if fmt == "int8" else (0, 256)
    shapes = contract.cache_shapes(case.layout, num_blocks(case), case.BS, case.KH, case.D, cdt)
    kc, vc = (None if s is None else rng.integers(lo, hi, lead + s).astype(cdt) for s in shapes)
    if fmt in BLOCK:
        shape = lead + contract.block_scale_shape(case.layout, num_blocks(case), case.BS, case.KH, case.D, fmt)
        top = 0x7F if fmt == "nvfp4" else 0xFF  # any bits but NaN: untouched entries must compare equal
        opts["k_scale_cache"], opts["v_scale_cache"] = (
            rng.integers(0, top, shape).astype(U8).view(contract.BLOCK_SCALE_DTYPE[fmt]) for _ in range(2))
        if fmt == "nvfp4":
            opts["k_scale"], opts["v_scale"] = (F32(rng.uniform(0.5, 2.0)) for _ in range(2))
    return args[:3] + (kc, vc) + args[5:], opts


def globals_of(opts) -> dict:
    return {n: opts[n] for n in ("k_scale", "v_scale") if n in opts}


# ---- independent statements of the rules ---------------------------------------------------------
def e2m1_bits(y64):
    """float64 values (already float32-rounded products) -> E2M1 codes by ml_dtypes' float4_e2m1fn
    conversion (round half to even) after the saturation at +-6; NaN -> +0."""
    y = np.where(np.isnan(y64), 0.0, np.clip(y64, -6.0, 6.0)).astype(F32)
    return y.astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & np.uint8(0xF)


def expected(fmt: str, rows: np.ndarray, g=None):
    """(scales, stored bytes or values, dequantized float64) of float32 rows [n, KH, D], in float64."""
    y = rows.astype(np.float64)
    a = np.abs(y)
    a[~np.isfinite(a)] = 0
    if fmt in ("int8", "int4"):
        q = 127.0 if fmt == "int8" else 7.0
        scale = (np.maximum(a.max(axis=-1), float(F32(1e-8))) / q).astype(F32)
        inv = (1.0 / scale.astype(np.float64)).astype(F32).astype(np.float64)
        with np.errstate(invalid="ignore", over="ignore"):
            p = (y * inv[..., None]).astype(F32).astype(np.float64)  # the f32 product: exact in f64, one rounding
        p[np.isnan(p)] = 0
        v = np.clip(np.round(p), -q, q).astype(np.int64)
        deq = v * scale[..., None].astype(np.float64)
        if fmt == "int8":
            return scale, v.astype(I8), deq
        return scale, ((v[..., 0::2] % 16) + 16 * (v[..., 1::2] % 16)).astype(U8), deq
    group = contract.BLOCK_GROUP[fmt]
    blocks = y.reshape(y.shape[:-1] + (-1, group))
    amax = a.reshape(blocks.shape).max(axis=-1)
    if fmt == "nvfp4":
        g64 = float(F32(g))
        enc = float(F32(1.0 / g64))
        s = (amax / 6.0).astype(F32).astype(np.float64) * enc
        scale = np.clip(s.astype(F32), 0, 448).astype(ml_dtypes.float8_e4m3fn)
        den = (scale.astype(np.float64) * g64).astype(F32).astype(np.float64)
        with np.errstate(divide="ignore"):
            mult = np.where(den == 0, 0.0, np.minimum((1.0 / den).astype(F32), np.finfo(F32).max))
        unit = scale.astype(np.float64) * g64
    else:
        with np.errstate(divide="ignore"):
            x = np.clip(np.floor(np.log2(amax)), -127, 127)  # amax 0: -inf -> -127
        x = np.where(amax < 2.0**-126, -127, x - 2).astype(np.int64)  # float32 subnormal amax: exponent field 0
        x = np.clip(x, -127, 127)
        scale = (x + 127).astype(U8).view(ml_dtypes.float8_e8m0fnu)
        mult = 2.0 ** -x.astype(np.float64)
        unit = 2.0 ** x.astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        p = (blocks * mult[..., None]).astype(F32).astype(np.float64)
    codes = e2m1_bits(p).reshape(y.shape)
    mag = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6])[codes & 7] * np.where(codes & 8, -1.0, 1.0)
    deq = (mag.reshape(blocks.shape) * unit[..., None]).reshape(y.shape)
    return scale, (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(U8), deq


def stored_scales(fmt, cache, layout, slots, case):
    blk, off = slots // case.BS, slots % case.BS
    if fmt in BLOCK:
        return reference.read_tokens(cache, "key", layout, blk, off, case.KH, case.D // contract.BLOCK_GROUP[fmt])
    return reference.read_tokens(cache, "scale", layout, blk, off, case.KH, 1).reshape(-1, case.KH)


# ---- the reference against its definition ---------------------------------------------------------
@pytest.mark.parametrize("fmt,layout", [(f, lay) for f in FORMATS for lay in LAYOUTS[f]
                                        if lay in ("flash", "hnd", "head_major", "xpacked", "kv_merged")])
def test_reference_follows_the_rule(fmt, layout):
    case = Case(T=9, QH=4, KH=2, D=64, BS=16, layout=layout)
    args, opts = problem(fmt, case, seed=3)
    q_out, k_out, kc, vc, ksc, vsc = reference.rope_and_cache(*args, **opts)
    valid = _valid(args[5], num_blocks(case) * case.BS)
    s = args[5][valid].astype(np.int64)
    k_rows, v_rows = k_out.astype(F32)[valid], args[2].astype(F32)[valid]
    kk, vv = reference.read_kv(kc, vc, s, layout=layout)  # as stored
    dk, dv = reference.read_kv(kc, vc, s, layout=layout, k_scale_cache=ksc, v_scale_cache=vsc, **globals_of(opts))
    for rows, stored, deq, sc, g in ((k_rows, kk, dk, ksc, opts.get("k_scale")), (v_rows, vv, dv, vsc, opts.get("v_scale"))):
        want_scale, want, want_deq = expected(fmt, rows, g)
        np.testing.assert_array_equal(stored_scales(fmt, sc, layout, s, case).view(np.uint8),
                                      np.asarray(want_scale).view(np.uint8))
        assert stored.dtype == CACHE_DTYPE[fmt]
        np.testing.assert_array_equal(stored, want)
        np.testing.assert_array_equal(deq, want_deq.astype(F32))


@pytest.mark.parametrize("fmt", FORMATS)
def test_round_trip_within_the_format_error(fmt):
    """Well-scaled rows (NVFP4: the global scale amax / (6 * 448), the usual calibration): every finite
    value is within the format's step of its dequantized value: int half a step; E2M1 one unit of the
    block (the half gap between 4 and 6) and, MXFP4, two (amax / 2^X in [4, 8) saturates at 6). NVFP4
    blocks whose E4M3 scale is subnormal (below 2^-6) have fewer scale bits and are left out."""
    case = Case(T=24, QH=2, KH=2, D=64, BS=8)
    args, opts = problem(fmt, case, seed=21)
    rng = np.random.default_rng(5)
    k = (rng.standard_normal((case.T, case.KH, case.D)) * rng.uniform(0.5, 4, (case.T, case.KH, 1))).astype(F32)
    v = (rng.standard_normal((case.T, case.KH, case.D)) * rng.uniform(0.5, 4, (case.T, case.KH, 1))).astype(F32)
    slots = rng.permutation(num_blocks(case) * case.BS)[:case.T].astype(np.int32)
    q = rng.standard_normal((case.T, case.QH, case.D)).astype(F32)
    if fmt == "nvfp4":
        opts["k_scale"], opts["v_scale"] = F32(np.abs(k).max() / 2688), F32(np.abs(v).max() / 2688)
    out = reference.rope_and_cache(q, k, v, args[3], args[4], slots, args[6][:case.T], args[7], args[8], **opts)
    got = jrc.read_kv(*out[2:4], slots, k_scale_cache=out[4], v_scale_cache=out[5], **globals_of(opts))
    checked = 0
    for x, d, sc, g in ((out[1], got[0], out[4], opts.get("k_scale")), (v, got[1], out[5], opts.get("v_scale"))):
        err = np.abs(np.asarray(d, np.float64) - x.astype(np.float64))
        if fmt in ("int8", "int4"):
            scale = stored_scales(fmt, sc, "flash", slots, case).astype(np.float64)
            assert np.all(err <= (0.5 + 1e-6) * scale[..., None])
            checked += err.size
            continue
        group = contract.BLOCK_GROUP[fmt]
        bsc = stored_scales(fmt, sc, "flash", slots, case)
        err = err.reshape(err.shape[:-1] + (-1, group)).max(axis=-1)
        if fmt == "nvfp4":
            unit, ok = bsc.astype(np.float64) * float(g), bsc.astype(np.float64) >= 2.0**-6
            assert np.all(err[ok] <= (1 + 1e-6) * unit[ok])
            checked += int(ok.sum()) * group
        else:
            unit = reference.e8m0_value(bsc).astype(np.float64)
            assert np.all(err <= 2 * unit)
            checked += err.size * group
    assert checked >= case.T * case.KH * case.D  # most blocks are in range


@pytest.mark.parametrize("fmt", FORMATS)
def test_reference_special_values(fmt):
    """A zero row stores zeros, +-inf saturates (int: +-Q, E2M1: +-6), NaN stores 0, every scale finite."""
    case = Case(T=9, QH=4, KH=2, D=64, BS=16)
    args, opts = problem(fmt, case, seed=5)
    *_, kc, vc, ksc, vsc = reference.rope_and_cache(*args, **opts)
    z, s, n = SPECIAL_TOKENS
    raw = reference.read_kv(kc, vc, args[5], layout="flash")[1]
    deq = reference.read_kv(kc, vc, args[5], layout="flash", k_scale_cache=ksc, v_scale_cache=vsc, **globals_of(opts))[1]
    if fmt == "int4":
        raw = reference.unpack_int4(raw)
    if fmt in BLOCK:
        raw = reference.unpack_nibbles(raw)
        top, low, zero = 0x7, 0xF, 0x0
    else:
        top, low, zero = (127, -127, 0) if fmt == "int8" else (7, -7, 0)
    assert np.all(raw[z, 0] == zero) and np.all(deq[z, 0] == 0)
    assert raw[s, 0, 3] == top and raw[s, -1, 5] == low and raw[n, 0, 7] == zero
    assert np.all(np.isfinite(deq))


def test_e2m1_rounding_and_nibble_order():
    """e2m1_codes (reference and XLA) against ml_dtypes' float4_e2m1fn on every tie, the grid's
    values, their neighbours and random values; nibble order of both packed formats."""
    grid = np.array([0, 0.25, 0.5, 0.75, 1, 1.25, 1.5, 1.75, 2, 2.5, 3, 3.5, 4, 5, 6, 7, 100, np.inf], F32)
    near = np.concatenate([grid, np.nextafter(grid, F32(0)), np.nextafter(grid, F32(np.inf))])
    y = np.concatenate([near, -near, np.random.default_rng(1).uniform(-8, 8, 2000).astype(F32), [np.nan]]).astype(F32)
    want = e2m1_bits(y.astype(np.float64))
    np.testing.assert_array_equal(reference.e2m1_codes(y), want)
    np.testing.assert_array_equal(np.asarray(jax.jit(xla.e2m1_codes)(y)), want)
    assert reference.e2m1_codes(np.array([-0.1, 0.25, 0.75, 5.0, -np.inf], F32)).tolist() == [0x8, 0, 2, 6, 0xF]
    np.testing.assert_array_equal(reference.e2m1_decode(np.arange(16, dtype=np.uint8)),
                                  np.arange(16, dtype=np.uint8).view(ml_dtypes.float4_e2m1fn).astype(F32))
    v = np.array([[1, -2, 7, -7, 0, 3]], np.int8)
    assert reference.pack_int4(v).tolist() == [[0xE1, 0x97, 0x30]]  # channel 2j low nibble, two's complement
    np.testing.assert_array_equal(reference.unpack_int4(reference.pack_int4(v)), v)
    c = np.array([[0x2, 0xB, 0x7, 0x0]], np.uint8)  # 1.0, -1.5, 6, 0
    assert reference.pack_nibbles(c).tolist() == [[0xB2, 0x07]]
    np.testing.assert_array_equal(reference.unpack_nibbles(reference.pack_nibbles(c)), c)


def test_mx_exponent_and_nvfp4_scale_edges():
    """MXFP4: X = floor(log2(amax)) - 2 at powers of two and just below, clamped to [-127, 127] (a
    zero block: 2^-127, code 0); NVFP4: a block whose scale rounds to 0 stores zeros, scales
    saturate at 448."""
    amax = np.array([0, 2.0**-140, 1.0, np.nextafter(F32(1), F32(0)), 4.0, 6.0, 2.0**100, np.finfo(F32).max], F32)
    assert reference.mxfp4_exponents(amax).tolist() == [-127, -127, -2, -3, 0, 0, 98, 125]
    np.testing.assert_array_equal(np.asarray(jax.jit(lambda a: xla.quantize_blocks(
        np.zeros((8, 32), F32) + a[:, None], "mxfp4")[0])(amax)).view(np.uint8),
        (reference.mxfp4_exponents(amax) + 127).astype(np.uint8)[:, None])
    row = np.zeros((3, 16), F32)
    row[0, 0], row[1, 0], row[2, 0] = 1e-5, 1e6, 3.0
    s, b = reference.quantize_blocks(row, "nvfp4", F32(1.0))
    assert s.astype(F32).ravel().tolist() == [0.0, 448.0, 0.5]
    assert reference.unpack_nibbles(b)[:, 0].tolist() == [0, 7, 7]  # 0; saturated 6; 3 / 0.5 = 6
    xs, xb = jax.jit(lambda r: xla.quantize_blocks(r, "nvfp4", F32(1.0)))(row)
    np.testing.assert_array_equal(np.asarray(xs).view(np.uint8), s.view(np.uint8))
    np.testing.assert_array_equal(np.asarray(xb), b)


# ---- the XLA path -------------------------------------------------------------------------------
BASE = dict(T=9, QH=4, KH=2, D=64, BS=16)
NATIVE = [Case(**BASE, R=32, is_neox=False, precision="native", table_dtype="bfloat16"),
          Case(**BASE, dtype="float16", precision="native")]
XLA_CASES = [(f, Case(**BASE, layout=lay)) for f in FORMATS for lay in LAYOUTS[f]] + \
    [(f, c) for f in FORMATS for c in NATIVE]


@pytest.mark.parametrize("layers", [None, 3])
@pytest.mark.parametrize("fmt,case", XLA_CASES, ids=lambda x: x if isinstance(x, str) else x.id)
def test_xla_bit_exact_to_reference(fmt, case, layers):
    args, opts = problem(fmt, case, seed=11, layers=layers, norm=layers is None)
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
        elif fused and name in ("k_scale_cache", "key_cache"):
            continue  # the k rows move by an f32 ulp: their quantization is checked on the v rows
        else:
            np.testing.assert_array_equal(g.view(np.uint8), w.view(np.uint8), err_msg=name)


@pytest.mark.parametrize("fmt", FORMATS)
def test_fused_k_moves_by_one_step_at_most(fmt):
    """"fused" native arithmetic: k rows an f32 ulp apart quantize at most one step apart (int: the
    scale by one ulp, a value by one; block formats: a block scale by one code, few bytes differ)."""
    case = NATIVE[1]
    args, opts = problem(fmt, case, seed=11)
    want = reference.rope_and_cache(*args, **opts)
    got = jrc.rope_and_cache(*args, impl="xla", **opts)
    if fmt in BLOCK:
        gs, ws = (np.asarray(a).view(np.uint8).astype(int) for a in (got[4], want[4]))
        assert np.abs(gs - ws).max() <= 1
        assert np.mean(np.asarray(got[2]) != want[2]) < 0.02
        return
    assert ulp_diff(np.asarray(got[4]), want[4]).max() <= 1
    unpack = reference.unpack_int4 if fmt == "int4" else (lambda a: a)
    assert np.abs(unpack(np.asarray(got[2])).astype(int) - unpack(want[2]).astype(int)).max() <= 1


@pytest.mark.parametrize("fmt", FORMATS)
def test_slot_edges(fmt):
    """The first and last slot of the cache, -1 and NB*BS beside them: written / not written alike."""
    case = Case(T=5, QH=2, KH=2, D=64, BS=8)
    args, opts = problem(fmt, case, seed=17)
    nslots = num_blocks(case) * case.BS
    slots = np.array([0, nslots - 1, nslots, -1, 2**40], np.int64)
    args = args[:5] + (slots,) + args[6:]
    want = reference.rope_and_cache(*args, **opts)
    got = jrc.rope_and_cache(*args, impl="xla", **opts)
    for g, w in zip(got[2:], want[2:]):
        np.testing.assert_array_equal(np.asarray(g).view(np.uint8), w.view(np.uint8))
    assert not np.array_equal(want[2].view(np.uint8), args[3].view(np.uint8))  # something was written


def test_nvfp4_global_scales_may_be_traced():
    """The global decode scales are operands: one jit for any value, bit-exact to the reference."""
    case = Case(T=5, QH=2, KH=2, D=32, BS=8)
    args, opts = problem("nvfp4", case, seed=19)
    fixed = {n: x for n, x in opts.items() if n not in ("k_scale", "v_scale")}
    step = jax.jit(lambda kg, vg, *a: jrc.rope_and_cache(*a, impl="xla", k_scale=kg, v_scale=vg, **fixed))
    for kg, vg in ((F32(0.75), F32(1.5)), (F32(3.0), F32(0.25))):
        want = reference.rope_and_cache(*args, **{**opts, "k_scale": kg, "v_scale": vg})
        got = step(kg, vg, *args)
        for g, w in zip(got[2:], want[2:]):
            np.testing.assert_array_equal(np.asarray(g).view(np.uint8), w.view(np.uint8))


@pytest.mark.parametrize("fmt", BLOCK)
def test_block_scaled_under_vmap(fmt):
    """vmap over two calls' inputs and caches (the primitive's batch rule, impl=None: the XLA fallback)
    gives each call's reference result; the global scales are shared."""
    case = Case(T=9, QH=4, KH=2, D=64, BS=16)
    problems = [problem(fmt, case, seed=s) for s in (1, 2)]
    (args, opts), tables = problems[0], problems[0][0][6:9]
    fixed = {n: x for n, x in opts.items() if n not in ("k_scale_cache", "v_scale_cache")}
    stack = lambda get: np.stack([get(p) for p in problems])  # noqa: E731
    batched = [stack(lambda p, i=i: p[0][i]) for i in range(6)] + [
        stack(lambda p: p[1]["k_scale_cache"]), stack(lambda p: p[1]["v_scale_cache"])]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = jax.vmap(lambda q, k, v, kc, vc, s, ks, vs: jrc.rope_and_cache(
            q, k, v, kc, vc, s, *tables, k_scale_cache=ks, v_scale_cache=vs, **fixed))(*batched)
    for b, (a, o) in enumerate(problems):
        want = reference.rope_and_cache(*a[:6], *tables, **{**o, **globals_of(opts)})
        for g, w in zip(got[2:], want[2:]):
            np.testing.assert_array_equal(np.asarray(g[b]).view(np.uint8), w.view(np.uint8))


@pytest.mark.parametrize("fmt,layout", [(f, lay) for f in FORMATS for lay in LAYOUTS[f]
                                        if lay in ("flash", "head_major", "hnd", "xpacked", "kv_merged")])
def test_read_kv_dequantizes_like_the_reference(fmt, layout):
    case = Case(T=9, QH=4, KH=2, D=64, BS=16, layout=layout)
    args, opts = problem(fmt, case, seed=13)
    *_, kc, vc, ksc, vsc = reference.rope_and_cache(*args, **opts)
    scales = dict(k_scale_cache=ksc, v_scale_cache=vsc, **globals_of(opts))
    want = reference.read_kv(kc, vc, args[5], layout=layout, **scales)
    got = jrc.read_kv(kc, vc, args[5], layout=layout, **scales)
    for g, w in zip(got, want):
        g = np.asarray(g)
        assert g.dtype == np.float32 and g.shape == (case.T, case.KH, case.D)
        np.testing.assert_array_equal(g.view(np.uint32), w.view(np.uint32))
    raw = jrc.read_kv(kc, vc, args[5], layout=layout)
    assert np.asarray(raw[0]).dtype == CACHE_DTYPE[fmt]


# ---- the kernels refuse, allocation, errors --------------------------------------------------------
@pytest.mark.parametrize("fmt", FORMATS)
def test_kernel_refuses_and_default_falls_back(fmt, monkeypatch):
    from jax_rope_cache.backends import cpu
    monkeypatch.setattr(cpu, "SUPPORTS", cpu.SUPPORTS - {f"{fmt}_cache"})  # the CPU handler runs some: one without
    args, opts = problem(fmt, Case(**BASE), seed=7)
    want = reference.rope_and_cache(*args, **opts)
    with pytest.raises(NotImplementedError, match=rf"impl='kernel'.*{FEATURE_TEXT[fmt]}"):
        jrc.rope_and_cache(*args, impl="kernel", **opts)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        got = jrc.rope_and_cache(*args, **opts)
    assert sum(FEATURE_TEXT[fmt] in str(x.message) for x in w) == 1
    for g, x in zip(got[2:], want[2:]):
        np.testing.assert_array_equal(np.asarray(g).view(np.uint8), x.view(np.uint8))


# The kernels implementing each format (each kernel's own tests check it bit for bit); the others refuse it.
IMPLEMENTED = {"int8": {"cpu", "cuda", "rocm", "tpu"}, "int4": {"cpu", "cuda", "rocm", "tpu"},
               "nvfp4": {"cpu", "cuda", "rocm", "tpu"}, "mxfp4": {"cpu", "cuda", "rocm", "tpu"}}


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_kernels_implement_or_refuse_the_format(fmt):
    from jax_rope_cache import backends
    from jax_rope_cache.backends import native
    args, opts = problem(fmt, Case(**BASE), seed=4)
    spec = contract.check_op(*args, **opts)
    feature = f"{fmt}_cache"
    assert feature in contract.features(spec) and feature in contract.CACHE_FORMAT_FEATURES
    assert sum(f in contract.features(spec) for f in contract.CACHE_FORMAT_FEATURES) == 1
    assert set(backends.KERNEL_BACKENDS) >= IMPLEMENTED[fmt]
    for name, backend in backends.KERNEL_BACKENDS.items():
        assert (feature in backend.SUPPORTS) == (name in IMPLEMENTED[fmt]), name
        if name not in IMPLEMENTED[fmt]:
            with pytest.raises(native.KernelUnavailable, match=FEATURE_TEXT[fmt]):
                native.refuse_unsupported(spec, backend.SUPPORTS, backend.NAME)


@pytest.mark.parametrize("fmt", FORMATS)
def test_make_kv_cache_and_scale_caches(fmt):
    cdt = CACHE_DTYPE[fmt]
    kc, vc = jrc.make_kv_cache(4, 16, 2, 64, cdt, layout="flash", fill="random", num_layers=2)
    assert kc.dtype == cdt and kc.shape == (2, 4, 16, 2, 64 if fmt == "int8" else 32)
    assert len(np.unique(np.asarray(kc))) > 16
    if fmt in BLOCK:
        g = contract.BLOCK_GROUP[fmt]
        for layout, shape in (("flash", (4, 16, 2, 64 // g)), ("hnd", (4, 2, 16, 64 // g)),
                              ("head_major", (2, 4, 16, 64 // g))):
            ksc, vsc = jrc.make_kv_scale_cache(4, 16, 2, layout=layout, kv_format=fmt, head_dim=64, num_layers=3)
            assert ksc.shape == vsc.shape == (3,) + shape and ksc.dtype == contract.BLOCK_SCALE_DTYPE[fmt]
            assert np.all(np.asarray(ksc).astype(F32) == 1)
            assert contract.block_scale_shape(layout, 4, 16, 2, 64, fmt) == shape
    else:
        ksc, _ = jrc.make_kv_scale_cache(4, 16, 2, layout="head_major")
        assert ksc.shape == (2, 4, 16) and ksc.dtype == np.float32


def _call(args, opts, **changes):
    return jrc.rope_and_cache(*args, impl="xla", **{**opts, **changes})


@pytest.mark.parametrize("fmt", FORMATS)
def test_errors(fmt):
    args, opts = problem(fmt, Case(**BASE), seed=9)
    bare = {k: v for k, v in opts.items() if k not in ("k_scale_cache", "v_scale_cache", "k_scale", "v_scale")}
    what = "int8" if fmt == "int8" else r"int4, NVFP4 or MXFP4 \(uint8\)"
    with pytest.raises(ValueError, match=f"key_cache: an {what} cache .*k_scale_cache"):
        jrc.rope_and_cache(*args, impl="xla", **bare)
    full = np.zeros(args[3].shape[:-1] + (128,), CACHE_DTYPE[fmt])  # not the stored row's width
    with pytest.raises(ValueError, match="key_cache: expected shape"):
        _call(args[:3] + (full, full.copy()) + args[5:], opts)
    if fmt in ("int8", "int4"):
        with pytest.raises(ValueError, match="k_scale: expected None with per-token scales"):
            _call(args, opts, k_scale=1.0)
        with pytest.raises(ValueError, match="k_scale: scales apply to float8 caches only"):
            jrc.read_kv(args[3], args[4], args[5], k_scale=1.0, v_scale=1.0)
        return
    name, other = contract.BLOCK_FORMAT_NAMES[fmt], "mxfp4" if fmt == "nvfp4" else "nvfp4"
    as_int8 = args[3].view(np.int8)
    with pytest.raises(ValueError, match=f"key_cache: {name} .* expected a uint8 cache, got int8"):
        _call(args[:3] + (as_int8, args[4].view(np.int8)) + args[5:], opts)
    wrong = opts["v_scale_cache"].view(np.uint8).view(contract.BLOCK_SCALE_DTYPE[other])
    with pytest.raises(ValueError, match=f"v_scale_cache: expected dtype {contract.BLOCK_SCALE_DTYPE[fmt].name}"):
        _call(args, opts, v_scale_cache=wrong)
    with pytest.raises(ValueError, match="k_scale_cache: expected shape"):
        _call(args, opts, k_scale_cache=opts["k_scale_cache"][..., :1])
    with pytest.raises(ValueError, match="v_scale_cache: .* needs both scale caches"):
        _call(args, opts, v_scale_cache=None)
    if fmt == "nvfp4":
        with pytest.raises(ValueError, match="k_scale: an NVFP4 cache needs its per-tensor global decode scale"):
            _call(args, opts, k_scale=None)
        with pytest.raises(ValueError, match="v_scale: an NVFP4 cache needs"):
            _call(args, opts, v_scale=None)
        with pytest.raises(ValueError, match="k_scale: expected NVFP4's global decode scale finite and > 0"):
            _call(args, opts, k_scale=0.0)
        with pytest.raises(TypeError, match="v_scale: expected NVFP4's global decode scale"):
            _call(args, opts, v_scale=np.ones(2, F32))
        with pytest.raises(ValueError, match="k_scale: an NVFP4 cache needs"):
            jrc.read_kv(args[3], args[4], args[5], k_scale_cache=opts["k_scale_cache"],
                        v_scale_cache=opts["v_scale_cache"])
    else:
        with pytest.raises(ValueError, match="k_scale: MXFP4 has no global scale"):
            _call(args, opts, k_scale=1.0)
    # the head dim must hold whole blocks (the block size BS, along the tokens, is free)
    d = contract.BLOCK_GROUP[fmt] + 8
    q, k, v = (a[..., :d] for a in args[:3])
    kc = np.zeros(contract.cache_shapes("flash", 4, 16, 2, d, U8)[0], U8)
    sc = np.zeros((4, 16, 2, 1), contract.BLOCK_SCALE_DTYPE[fmt])
    with pytest.raises(ValueError, match=f"key_cache: {name} .* needs the head_dim D divisible by "
                                         f"{contract.BLOCK_GROUP[fmt]} .*got D={d}"):
        jrc.rope_and_cache(q, k, v, kc, kc.copy(), args[5], args[6], args[7][:, :d // 2], args[8][:, :d // 2],
                           impl="xla", k_scale_cache=sc, v_scale_cache=sc.copy(), **globals_of(opts))
    with pytest.raises(ValueError, match=f"layout: {name} .* is written in the layouts"):
        jrc.make_kv_scale_cache(4, 16, 2, layout="xpacked", kv_format=fmt, head_dim=64)
    with pytest.raises(ValueError, match=f"layout: {name} "):
        jrc.read_kv(np.zeros((4, 16, 4, 32), U8), None, args[5], layout="kv_merged",
                    k_scale_cache=opts["k_scale_cache"], v_scale_cache=opts["v_scale_cache"], **globals_of(opts))
    with pytest.raises(ValueError, match=f"head_dim: kv_format '{fmt}' needs the head dim D, a positive multiple"):
        jrc.make_kv_scale_cache(4, 16, 2, kv_format=fmt, head_dim=d)
    with pytest.raises(ValueError, match="kv_format: expected None"):
        jrc.make_kv_scale_cache(4, 16, 2, kv_format="fp4", head_dim=64)
    with pytest.raises(ValueError, match="head_dim: per-token scale caches do not depend on it"):
        jrc.make_kv_scale_cache(4, 16, 2, head_dim=64)


# ---- the model client ------------------------------------------------------------------------------
def test_decoder_block_scaled_caches_move_logits_further_than_int8():
    """Decoder(kv_quant="nvfp4" / "mxfp4") on the tiny Llama fixture (XLA path, CPU): uint8 caches of
    D/2 bytes, block-scale caches in the layout's axes, written by the decode; the logits move further
    from the unquantized run than with int8 caches (measured: max |dlogit| 5.21 NVFP4, 5.90 MXFP4,
    0.373 int8, docs/models.md), as a 4-bit format must."""
    import os

    from jax_rope_cache import decoder
    from jax_rope_cache.cli import generate
    ref = decoder.load_hf_reference(os.path.join(os.path.dirname(__file__), "data", "hf_greedy.npz"))
    entry, cpu = ref["tiny-llama-3.1"], jax.devices("cpu")[0]
    steps = 6
    prompts = entry["prompts"][:2]

    def run(kv_quant):
        m = generate.reference_decoder(entry, "xla", "flash", device=cpu, kv_quant=kv_quant)
        return m, m.generate(prompts, steps)

    _, (toks, logits) = run(None)
    errs = {}
    for kvq in ("int8_per_token", "nvfp4", "mxfp4"):
        m, (qt, ql) = run(kvq)
        n = np.nonzero(qt[0] != toks[0])[0]
        n = n[0] + 1 if len(n) else steps
        errs[kvq] = float(np.abs(ql[0, :n] - logits[0, :n]).max())
        if kvq in BLOCK:
            d, g = m.cfg.head_dim, contract.BLOCK_GROUP[kvq]
            assert m.key_cache.dtype == U8 and m.key_cache.shape[-1] == d // 2
            ksc = np.asarray(m.scale_caches[0])
            assert ksc.dtype == contract.BLOCK_SCALE_DTYPE[kvq] and ksc.shape[-1] == d // g
            assert np.any(ksc.astype(F32) != 1)  # written (allocated as 1.0)
    assert 0 < errs["int8_per_token"] < min(errs["nvfp4"], errs["mxfp4"]), errs


def test_decoder_errors():
    from jax_rope_cache import decoder
    cfg = decoder.TINY_CONFIGS["tiny-llama-3.1"]
    params = decoder.random_params(decoder.DecoderConfig.from_hf(cfg), 0)
    cpu = jax.devices("cpu")[0]
    with pytest.raises(ValueError, match="layout: NVFP4 .* is written in the layouts"):
        decoder.Decoder(cfg, params, layout="xpacked", max_seqs=1, max_len=16, device=cpu, kv_quant="nvfp4")
    with pytest.raises(ValueError, match="kv_global_scale: NVFP4's global decode scale"):
        decoder.Decoder(cfg, params, max_seqs=1, max_len=16, device=cpu, kv_quant="mxfp4", kv_global_scale=2.0)
    with pytest.raises(ValueError, match="kv_global_scale: expected NVFP4's global decode scale finite and > 0"):
        decoder.Decoder(cfg, params, max_seqs=1, max_len=16, device=cpu, kv_quant="nvfp4", kv_global_scale=-1.0)
    m = decoder.Decoder(cfg, params, layout="head_major", max_seqs=1, max_len=16, device=cpu, kv_quant="mxfp4")
    assert m.scale_caches[0].shape[1:] == contract.block_scale_shape(
        "head_major", m.allocator.num_blocks, m.block_size, m.cfg.kv_heads, m.cfg.head_dim, "mxfp4")


@pytest.mark.parametrize("fmt,other", [("nvfp4", "hnd"), ("mxfp4", "head_major")])
def test_decoder_block_scaled_layouts_agree(fmt, other):
    """The same quantized model in hnd / head_major caches (the block scales in each layout's axes,
    gathered by the attention like the caches) gives the flash run's logits bit for bit."""
    from jax_rope_cache import decoder
    cfg = decoder.TINY_CONFIGS["tiny-llama-3.1"]
    params = decoder.random_params(decoder.DecoderConfig.from_hf(cfg), 3)
    cpu = jax.devices("cpu")[0]
    runs = {}
    for layout in ("flash", other):
        m = decoder.Decoder(cfg, params, layout=layout, impl="xla", block_size=8, max_seqs=2, max_len=32,
                            device=cpu, kv_quant=fmt, kv_global_scale=0.5 if fmt == "nvfp4" else 1.0)
        runs[layout] = m.generate([[3, 17, 9, 40, 2], [5, 6]], 5)
    np.testing.assert_array_equal(runs[other][0], runs["flash"][0])
    np.testing.assert_array_equal(runs[other][1], runs["flash"][1])
