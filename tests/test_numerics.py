"""The arithmetic itself: the shared C++/CUDA conversions against ml_dtypes (exhaustive where the
format is small), and known answers of the reference."""

from __future__ import annotations

import os

import ml_dtypes
import numpy as np
import pytest

from jax_rope_cache import contract, reference
from jax_rope_cache.backends import native
from conftest import (Case, canonical_nan_violations, impl_params, make_problem, num_blocks, special_problem,
                      ulp_diff)
from e5m2_values import E5M2, boundary_f32, oracle_e5m2

native = native.native_module()
needs_native = pytest.mark.skipif(native is None, reason="the compiled extension did not import")
SMALL = {"bfloat16": (ml_dtypes.bfloat16, np.uint16), "float16": (np.float16, np.uint16),
         "float8_e4m3fn": (ml_dtypes.float8_e4m3fn, np.uint8), "float8_e4m3fnuz": (ml_dtypes.float8_e4m3fnuz, np.uint8),
         "float8_e5m2": (ml_dtypes.float8_e5m2, np.uint8)}


def _hard_f32(rng, n):
    """Random f32 bit patterns plus every tie and near-tie of the small formats' rounding."""
    bits = rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32)
    grid = np.arange(-2**15, 2**15, dtype=np.int64).astype(np.int32).astype(np.uint32) << np.uint32(16)
    ties = np.concatenate([grid, grid | 0x8000, grid | 0x7FFF, grid | 0x8001, grid | 0x1000, grid | 0x0FFF])
    f = np.concatenate([bits, ties]).view(np.float32)
    scales = np.float32(2.0) ** rng.integers(-30, 20, f.size).astype(np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        scaled = f[: n // 2] * scales[: n // 2]
    return np.concatenate([f, (rng.standard_normal(n) * 1e-3).astype(np.float32), scaled])


@needs_native
@pytest.mark.parametrize("name", list(SMALL))
def test_rounding_matches_ml_dtypes(name):
    dt, ut = SMALL[name]
    f = _hard_f32(np.random.default_rng(0), 1 << 18)
    if name.startswith("float8"):  # the kernels saturate; ml_dtypes would give NaN past max
        m = contract.FP8_MAX[np.dtype(dt)]
        with np.errstate(invalid="ignore"):
            f = np.where(np.isnan(f), f, np.clip(f, -m, m)).astype(np.float32)
    f = f[~np.isnan(f)]
    bits = np.zeros(f.size, np.uint32)
    native.round_f32(f, bits, contract.DTYPE_CODES[np.dtype(dt)])
    with np.errstate(over="ignore"):
        want = f.astype(dt).view(ut).astype(np.uint32)
    bad = np.flatnonzero(bits != want)
    assert bad.size == 0, f"{bad.size} mismatches, e.g. {f[bad[0]]!r}: got {bits[bad[0]]:#x} want {want[bad[0]]:#x}"


@needs_native
@pytest.mark.parametrize("name", list(SMALL))
def test_widening_is_exact_for_every_code(name):
    dt, ut = SMALL[name]
    codes = np.arange(np.iinfo(ut).max + 1, dtype=np.uint32)
    got = np.zeros(codes.size, np.float32)
    native.widen_to_f32(codes, got, contract.DTYPE_CODES[np.dtype(dt)])
    want = codes.astype(ut).view(dt).astype(np.float32)
    same = (got.view(np.uint32) == want.view(np.uint32)) | (np.isnan(got) & np.isnan(want))
    assert same.all(), f"code {codes[~same][0]:#x}: got {got[~same][0]} want {want[~same][0]}"


@needs_native
@pytest.mark.parametrize("name", ["float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2"])
def test_fp8_saturates_and_keeps_nan(name):
    dt, _ = SMALL[name]
    f = np.array([1e6, -1e6, np.inf, -np.inf, 449.0, np.nan, -0.0, 1e-30], np.float32)
    bits = np.zeros(f.size, np.uint32)
    native.round_f32(f, bits, contract.DTYPE_CODES[np.dtype(dt)])
    vals = bits.astype(np.uint8).view(dt).astype(np.float32)
    m = contract.FP8_MAX[np.dtype(dt)]
    assert list(vals[:4]) == [m, -m, m, -m] and vals[4] == min(448.0, m)
    assert np.isnan(vals[5]) and vals[6] == 0 and vals[7] == 0


def test_e5m2_reference_equals_ml_dtypes_and_the_nearest_value():
    """float8_e5m2 in the reference: ml_dtypes' rounding (to nearest, ties to even) wherever ml_dtypes
    gives a finite value, saturation to +-57344 past it (ml_dtypes gives inf from 61440 on, the
    reference never), NaN the canonical 0x7F (ml_dtypes keeps the sign: 0x7E / 0xFE), -0 and
    negative underflow 0x80; all of it equal to the independent nearest-value oracle on every
    boundary of every exponent (e5m2_values.boundary_f32) and 2^20 random bit patterns."""
    f = boundary_f32(np.random.default_rng(3), 1 << 20)
    want = oracle_e5m2(f)
    got = reference.quantize(f, E5M2, np.float32(1.0)).view(np.uint8)
    bad = np.flatnonzero(got != want)
    assert bad.size == 0, f"{bad.size} differ, e.g. {f.view(np.uint32)[bad[0]]:#x}: {got[bad[0]]:#x} != {want[bad[0]]:#x}"
    with np.errstate(over="ignore", invalid="ignore"):
        ml = f.astype(E5M2).view(np.uint8)
    finite = np.isfinite(ml.view(E5M2).astype(np.float32))
    assert np.array_equal(ml[finite], want[finite]) and finite.sum() > 0.5 * f.size
    assert {int(b) for b in ml[np.abs(f) >= 61440]} == {0x7C, 0xFC}  # what saturation replaces
    assert {int(b) for b in got[np.abs(f) >= 61440]} == {0x7B, 0xFB}
    assert {int(b) for b in got[np.isnan(f)]} == {reference.CANONICAL_NAN[E5M2]} == {0x7F}
    assert got[f.view(np.uint32) == 0x80000000].tolist() == [0x80, 0x80]
    # scaled: x * (1/scale) is rounded to float32 first, then converted once
    x = boundary_f32()[::7]
    with np.errstate(over="ignore", invalid="ignore"):
        scaled = x * reference.inverse_scale(np.float32(0.37))
    assert np.array_equal(reference.quantize(x, E5M2, np.float32(0.37)).view(np.uint8), oracle_e5m2(scaled))


@needs_native
def test_e5m2_shared_conversion_every_boundary():
    """rc_f32_to_e5m2 (kernels/common/rope_cache_math.h: the CPU handlers' conversion, and the CUDA
    kernels' below sm_89, whose instruction tests/test_cuda_fp8_conversion.py compares with it)
    equals the oracle on every boundary and 2^20 random float32 bit patterns."""
    f = boundary_f32(np.random.default_rng(4), 1 << 20)
    bits = np.zeros(f.size, np.uint32)
    native.round_f32(f, bits, contract.DTYPE_CODES[E5M2])
    want = oracle_e5m2(f)
    bad = np.flatnonzero(bits != want)
    assert bad.size == 0, f"{bad.size} differ, e.g. {f.view(np.uint32)[bad[0]]:#x}: {bits[bad[0]]:#x} != {want[bad[0]]:#x}"


# Per fp8 format: the float32 exponents (both signs, every mantissa) where the conversion rounds to
# something other than +-0 or +-max; below, everything is +-0, above, everything saturates (those,
# inf and NaN are in the stratified tests above).
_ROUNDING_EXPONENTS = {"float8_e5m2": range(98, 147), "float8_e4m3fn": range(114, 138),
                       "float8_e4m3fnuz": range(113, 138)}


@needs_native
@pytest.mark.full
@pytest.mark.parametrize("name", list(_ROUNDING_EXPONENTS))
def test_fp8_shared_conversion_exhaustive_where_it_rounds(name):
    """rc_f32_to_e5m2 / rc_f32_to_fp8 as built for the host (the CPU handlers' conversion; the CUDA
    kernels' below sm_89 and for e4m3fnuz) against the reference (ml_dtypes, clamped) on EVERY
    float32 whose exponent is in the format's rounding range."""
    dt = np.dtype(SMALL[name][0])
    bad = 0
    for sign in (0, 0x80000000):
        for e in _ROUNDING_EXPONENTS[name]:
            f = (np.arange(1 << 23, dtype=np.uint32) | np.uint32((e << 23) | sign)).view(np.float32)
            bits = np.zeros(f.size, np.uint32)
            native.round_f32(f, bits, contract.DTYPE_CODES[dt])
            bad += int((bits != reference.quantize(f, dt, np.float32(1.0)).view(np.uint8)).sum())
    assert bad == 0


@pytest.mark.parametrize("platform,impl", impl_params())
def test_e5m2_cache_through_the_op_every_boundary(platform, impl):
    """The whole op with a float8_e5m2 cache and scale 1: v (float32) is stored as fp8(v), so the
    value cache holds the conversion of every boundary value as the kernel's store path computes it
    (the CPU handler's, or the XLA path's). The kernel is bit-exact to the oracle; the XLA path too,
    except that on CPU it flushes float32 subnormal inputs (FTZ/DAZ), which e5m2 stores as +-0 anyway."""
    f = boundary_f32()
    d, kh = 64, 4
    f = np.concatenate([f, np.full((-f.size) % (d * kh), 1.5, np.float32)])
    T = f.size // (d * kh)
    rng = np.random.default_rng(5)
    v = f.reshape(T, kh, d)
    q = rng.standard_normal((T, kh, d)).astype(np.float32)
    kshape, vshape = contract.cache_shapes("flash", -(-T // 16), 16, kh, d, E5M2)
    kc, vc = (rng.standard_normal(s).astype(np.float32).astype(E5M2) for s in (kshape, vshape))
    args = (q, q.copy(), v, kc, vc, rng.permutation(kc.shape[0] * 16)[:T].astype(np.int32),
            np.zeros(T, np.int32), np.ones((1, d // 2), np.float32), np.zeros((1, d // 2), np.float32))
    opts = dict(k_scale=np.float32(1.0), v_scale=np.float32(1.0))
    got = _run(args, opts, impl, platform)
    _, v_read = reference.read_kv(got[2], got[3], args[5])
    assert np.array_equal(v_read.view(np.uint8).ravel(), oracle_e5m2(f))
    want = reference.rope_and_cache(*args, **opts)
    for name, g, w in zip(("q_out", "k_out", "key_cache", "value_cache"), got, want):
        assert np.array_equal(g.view(np.uint8), w.view(np.uint8)), name


def test_reference_identity_rotation_copies_bits():
    args, opts = make_problem(Case(T=5, D=64, dtype="float16", table="full"), seed=2)
    cos, sin = np.ones_like(args[7]), np.zeros_like(args[8])
    q_out, k_out, *_ = reference.rope_and_cache(*args[:7], cos, sin, **opts)
    assert np.array_equal(q_out.view(np.uint16), args[0].view(np.uint16))
    assert np.array_equal(k_out.view(np.uint16), args[1].view(np.uint16))


@pytest.mark.parametrize("is_neox", [True, False])
def test_reference_known_answer(is_neox):
    """A quarter turn maps pair (a, b) to (-b, a); channels past rotary_dim stay."""
    d, r = 8, 4
    x = np.arange(1, d + 1, dtype=np.float32).reshape(1, 1, d)
    cos = np.zeros((1, r // 2), np.float32)
    sin = np.ones((1, r // 2), np.float32)
    kc = np.full((1, 4, 1, d), 7.0, np.float32)
    q_out, k_out, kc2, vc2 = reference.rope_and_cache(
        x, x, x + 100, kc, kc.copy(), np.array([2]), np.array([0]), cos, sin, is_neox=is_neox, rotary_dim=r)
    want = [-3, -4, 1, 2, 5, 6, 7, 8] if is_neox else [-2, 1, -4, 3, 5, 6, 7, 8]
    assert q_out.ravel().tolist() == want and k_out.ravel().tolist() == want
    assert kc2[0, 2, 0].tolist() == want and vc2[0, 2, 0].tolist() == (x.ravel() + 100).tolist()
    assert (kc2[0, [0, 1, 3]] == 7).all()


def test_reference_preserves_norm_in_fp32():
    args, opts = make_problem(Case(T=9, D=128, dtype="float32"), seed=4)
    q_out, *_ = reference.rope_and_cache(*args, **opts)
    np.testing.assert_allclose(np.linalg.norm(q_out, axis=-1), np.linalg.norm(args[0], axis=-1), rtol=1e-5)


def test_reference_native_differs_from_fp32_only_by_rounding():
    args, opts = make_problem(Case(T=64, D=128, dtype="bfloat16"), seed=6)
    a = reference.rope_and_cache(*args, **opts)[0].astype(np.float32)
    b = reference.rope_and_cache(*args, **{**opts, "precision": "native"})[0].astype(np.float32)
    assert not np.array_equal(a, b)
    assert np.abs(a - b).max() <= 4 * 2.0**-8 * np.abs(a).max()


@pytest.mark.parametrize("layout", contract.LAYOUTS)
def test_read_kv_inverts_the_write(layout):
    case = Case(T=7, D=64, layout=layout, cache_dtype="float8_e4m3fnuz")
    args, opts = make_problem(case, seed=8)
    _, k_out, kc, vc = reference.rope_and_cache(*args, **opts)
    k_read, v_read = reference.read_kv(kc, vc, args[5], layout=layout)
    valid = (args[5] >= 0) & (args[5] < num_blocks(case) * case.BS)
    want_k = reference.quantize(k_out, kc.dtype, opts["k_scale"])
    assert np.array_equal(k_read[valid].view(np.uint8), want_k[valid].view(np.uint8))
    assert np.array_equal(v_read[valid].view(np.uint8),
                          reference.quantize(args[2], kc.dtype, opts["v_scale"])[valid].view(np.uint8))
    assert (k_read[~valid].astype(np.float32) == 0).all()


# ---- native precision = AITER's arithmetic (reference.py docstring, ../shared/notes/numerics.md) ----
BF16, F16, F32 = np.dtype(ml_dtypes.bfloat16), np.dtype(np.float16), np.dtype(np.float32)
FN, FNUZ, E5 = np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(ml_dtypes.float8_e4m3fnuz), E5M2
_HERE = os.path.dirname(os.path.abspath(__file__))


def _round_odd_f32(s, e):
    """float64 s + e (a TwoSum pair) rounded to float32 by round-to-odd (exact for what follows)."""
    with np.errstate(invalid="ignore", over="ignore"):
        f = s.astype(np.float32)
        back = f.astype(np.float64)
        bits = f.view(np.uint32).copy()
        over = np.isfinite(s) & (np.abs(back) > np.abs(s))
        bits[over] -= 1  # toward zero
        inexact = np.isfinite(s) & ((bits.view(np.float32).astype(np.float64) != s) | (e != 0))
        bits[inexact] |= 1
    return bits.view(np.float32)


def round_sum_once(a, b, dtype):
    """a + b (float64 arrays) rounded ONCE to `dtype` (bf16/f16/f32), exactly: TwoSum, round to
    odd at float32 (24 >= p + 2 bits), then to nearest even."""
    with np.errstate(invalid="ignore", over="ignore"):
        s = a + b
        bb = s - a
        e = np.where(np.isfinite(s), (a - (s - bb)) + (b - bb), 0.0)
    if np.dtype(dtype) == F32:
        bits = s.view(np.uint64)
        odd = np.isfinite(s) & (e != 0) & ((bits & np.uint64(1)) == 0)
        s = np.where(odd, np.where(np.signbit(e) == np.signbit(s), bits + np.uint64(1), bits - np.uint64(1)),
                     bits).view(np.float64)
        return s.astype(np.float32)
    with np.errstate(over="ignore"):
        return _round_odd_f32(s, e).astype(dtype)


def _aiter_recording():
    """(npz, name): the full recording if this checkout sees it (JRC_AITER_NPZ, ../shared/data), else
    its first 32 tokens per case, committed in tests/data."""
    for path in (os.environ.get("JRC_AITER_NPZ"),
                 os.path.join(_HERE, "..", "..", "shared", "data", "aiter_h200_numerics.npz"),
                 os.path.join(_HERE, "..", "shared", "data", "aiter_h200_numerics.npz")):
        if path and os.path.exists(path):
            break
    else:
        path = os.path.join(_HERE, "data", "aiter_h200_numerics_t32.npz")
    npz = np.load(path)
    return npz, {128: "full", 32: "t32"}[npz["l8b_neox__q"].shape[0]]


AITER_CASES = ["oss8_neox", "oss8_gptj", "l8b_neox", "l8b_gptj", "l8b_f32tab_neox", "l8b_f32tab_gptj"]
# bf16 tables: AITER ran on NVIDIA, where Triton contracts into a bf16 FMA, r(x*c + r(xr*s)); the
# ROCm formula (our native) differs from that recording in this many (q, k) elements, measured.
AITER_NVIDIA_BF16_DIFFS = {
    "full": {"oss8_neox": (15503, 1991), "oss8_gptj": (15236, 1901), "l8b_neox": (125493, 31468),
             "l8b_gptj": (123991, 31113)},
    "t32": {"oss8_neox": (3968, 486), "oss8_gptj": (3698, 468), "l8b_neox": (31157, 7837),
            "l8b_gptj": (31074, 7657)},
}


def _aiter_case(npz, case):
    bits = lambda name: npz[f"{case}__{name}"]  # noqa: E731
    bf = lambda a: a.view(ml_dtypes.bfloat16)  # noqa: E731
    q, k, qo, ko = (bf(bits(n)) for n in ("q", "k", "qo", "ko"))
    cos, sin = bits("cos"), bits("sin")
    if cos.dtype == np.int16:
        cos, sin = bf(cos), bf(sin)
    return q, k, qo, ko, cos, sin, case.endswith("neox")


def _aiter_sign_formulas(x, cos, sin, neox):
    """AITER's own formulation x*cos + x_rotated*sin (x_rotated NeoX [-x2, x1], GPT-J
    [-x1, x0, ...]), as (ROCm per-op rounding, NVIDIA bf16 FMA), both bf16."""
    xf = x.astype(np.float32)
    h = xf.shape[-1] // 2
    if neox:
        xr = np.concatenate([-xf[..., h:], xf[..., :h]], -1)
        c, s = np.concatenate([cos, cos], -1), np.concatenate([sin, sin], -1)
    else:
        xr = np.stack([-xf[..., 1::2], xf[..., 0::2]], -1).reshape(xf.shape)
        c, s = np.repeat(cos, 2, -1), np.repeat(sin, 2, -1)
    c, s = c.astype(np.float32)[:, None], s.astype(np.float32)[:, None]
    r = lambda y: y.astype(ml_dtypes.bfloat16).astype(np.float32)  # noqa: E731
    rocm = (r(xf * c) + r(xr * s)).astype(ml_dtypes.bfloat16)
    nvidia = round_sum_once(xf.astype(np.float64) * c, r(xr * s).astype(np.float64), BF16)
    return rocm, nvidia


def _run(args, opts, impl="kernel", platform="cpu"):
    import jax

    import jax_rope_cache as jrc

    dev = jax.devices(platform)[0]
    scales = {k: opts[k] for k in ("k_scale", "v_scale") if k in opts}
    static = {k: v for k, v in opts.items() if k not in scales}
    fn = jax.jit(lambda *a, **s: jrc.rope_and_cache(*a, **s, **static, impl=impl))
    return [np.asarray(o) for o in fn(*jax.device_put(args, dev), **jax.device_put(scales, dev))]


# (platform, impl) pairs present here (conftest.impl_params): the native kernels, and the XLA path
KERNELS = [p for p in impl_params() if p.values[1] == "kernel"]
XLA_PATHS = [p for p in impl_params() if p.values[1] == "xla"]


def _aiter_call(q, k, cos, sin, neox):
    t = q.shape[0]
    rng = np.random.default_rng(1)
    kshape = (-(-t // 16), 16) + k.shape[1:]
    kc = rng.standard_normal(kshape).astype(np.float32).astype(q.dtype)
    args = (q, k, k.copy(), kc, kc.copy(), np.arange(t, dtype=np.int32), np.arange(t, dtype=np.int32), cos, sin)
    return args, dict(is_neox=neox, precision="native")


@pytest.mark.parametrize("case", AITER_CASES)
def test_native_replays_recorded_aiter(case):
    """The recorded AITER runs (H200): with float32 tables our native output IS AITER's, bit for bit
    (reference and every native kernel present); with bf16 tables the recording is AITER-on-NVIDIA
    (bf16 FMA), which we reproduce in the test, while native follows the ROCm formula: the measured
    number of differences is pinned, and native equals AITER's ROCm formulation written
    independently here."""
    npz, which = _aiter_recording()
    q, k, qo, ko, cos, sin, neox = _aiter_case(npz, case)
    args, opts = _aiter_call(q, k, cos, sin, neox)
    want = reference.rope_and_cache(*args, **opts)
    runs = [("reference", want)] + [(p.id, _run(args, opts, "kernel", p.values[0])) for p in KERNELS]
    f32_tables = cos.dtype == np.float32
    for who, got in runs:
        for name, g, rec, x in (("q_out", got[0], qo, q), ("k_out", got[1], ko, k)):
            gb, rb = g.view(np.uint16), rec.view(np.uint16)
            if f32_tables:
                assert np.array_equal(gb, rb), f"{who} {name}: {int((gb != rb).sum())} elements differ from AITER"
            else:
                rocm, nvidia = _aiter_sign_formulas(x, cos, sin, neox)
                assert np.array_equal(nvidia.view(np.uint16), rb), "the recording is not the NVIDIA bf16 FMA"
                assert np.array_equal(gb, rocm.view(np.uint16)), f"{who} {name}: not AITER's ROCm formula"
                diffs = int((gb != rb).sum())
                want_diffs = AITER_NVIDIA_BF16_DIFFS[which][case][0 if name == "q_out" else 1]
                assert diffs == want_diffs, f"{who} {name}: {diffs} differences from AITER-on-NVIDIA, measured {want_diffs}"
        k_read, _ = reference.read_kv(got[2], got[3], args[5])
        assert np.array_equal(k_read.view(np.uint16), got[1].view(np.uint16)), f"{who}: key cache != k_out"


@pytest.mark.parametrize("dtype", [BF16, F16])
def test_rounded_sum_double_rounding_never_differs(dtype):
    """r(r32(A + B)) == r(A + B) for A, B of a 16-bit dtype (24 >= 2p + 2 bits, Figueroa): checked
    on random pairs, pairs with every exponent gap, near-ties and subnormals; the rounding helper
    itself does see double roundings (float32 FMA results rounded again to the dtype)."""
    rng = np.random.default_rng(3)
    n = 1 << 20
    u = np.iinfo(np.uint16)
    a = rng.integers(0, u.max + 1, n, dtype=np.uint32).astype(np.uint16).view(dtype)
    b = rng.integers(0, u.max + 1, n, dtype=np.uint32).astype(np.uint16).view(dtype)
    # b = a scaled by 2^-g +- a few ulps: every exponent gap, sums and differences near ties
    g = rng.integers(0, 40, n)
    with np.errstate(over="ignore", invalid="ignore"):
        near = (a.astype(np.float64) * np.exp2(-g.astype(np.float64)) * rng.choice([-1.0, 1.0], n)).astype(dtype)
    near = (near.view(np.uint16).astype(np.int32) + rng.integers(-2, 3, n)).astype(np.uint16).view(dtype)
    a, b = np.concatenate([a, a]), np.concatenate([b, near])
    af, bf = a.astype(np.float32), b.astype(np.float32)
    keep = np.isfinite(af) & np.isfinite(bf)
    af, bf = af[keep], bf[keep]
    with np.errstate(over="ignore", invalid="ignore"):
        twice = (af + bf).astype(dtype)
    once = round_sum_once(af.astype(np.float64), bf.astype(np.float64), dtype)
    same = (twice.view(np.uint16) == once.view(np.uint16)) | (np.isnan(twice.astype(np.float32)) & np.isnan(once.astype(np.float32)))
    assert same.all(), f"{int((~same).sum())} double roundings differ, e.g. {af[~same][:3]} + {bf[~same][:3]}"
    assert len(af) > 1.7 * n  # all but the pairs with inf/NaN operands
    # the same check on the "fused" path's float32 results finds double roundings (so it can)
    x = rng.standard_normal(n).astype(dtype).astype(np.float32)
    c = rng.standard_normal(n).astype(np.float32)
    p = (rng.standard_normal(n) * 2.0**-9).astype(np.float32)
    fused = reference.fma32(x, c, p).astype(dtype)
    exact = round_sum_once(x.astype(np.float64) * c, p.astype(np.float64), dtype)
    assert (fused.view(np.uint16) != exact.view(np.uint16)).sum() > 0


def test_fma32_is_correctly_rounded():
    """reference.fma32 against exact rational arithmetic on hard cases: near ties, cancellation,
    subnormal results, overflow."""
    from fractions import Fraction

    rng = np.random.default_rng(5)
    n = 3000
    a = (rng.standard_normal(n) * np.exp2(rng.integers(-80, 60, n))).astype(np.float32)
    b = (rng.standard_normal(n) * np.exp2(rng.integers(-80, 60, n))).astype(np.float32)
    p = a.astype(np.float64) * b
    c = np.where(rng.random(n) < 0.5, -p, p * np.exp2(-rng.integers(1, 30, n))).astype(np.float32)  # cancellation
    c[:50] = np.float32(2.0**-149)
    got = reference.fma32(a, b, c)
    for i in range(n):
        ex = Fraction(float(a[i])) * Fraction(float(b[i])) + Fraction(float(c[i]))
        f = np.float32(float(ex))
        cands = [np.nextafter(f, np.float32(-np.inf)), f, np.nextafter(f, np.float32(np.inf))]
        finite = [x for x in cands if np.isfinite(x)]
        best = min(finite, key=lambda x: (abs(Fraction(float(x)) - ex), int(np.array(x).view(np.uint32)) & 1))
        if abs(ex) >= Fraction(float(np.finfo(np.float32).max)) * (1 + Fraction(1, 2**24)):
            best = np.float32(np.inf if ex > 0 else -np.inf)
        assert got[i].view(np.uint32) == np.float32(best).view(np.uint32), (a[i], b[i], c[i], got[i], best)


# dtype combinations of native arithmetic: (input, table) -> reference.arithmetic
NATIVE_COMBOS = [(BF16, BF16, "rounded"), (F16, F16, "rounded"), (BF16, F32, "fused"), (F16, F32, "fused"),
                 (F32, F32, "fused"), (F32, BF16, "fused"), (BF16, F16, "fused")]


@pytest.mark.parametrize("dt,tdt,mode", NATIVE_COMBOS, ids=lambda v: getattr(v, "name", v))
def test_arithmetic_by_dtypes(dt, tdt, mode):
    args, opts = special_problem(dt, tdt)
    spec = contract.check_op(*args, **opts)
    assert reference.arithmetic(spec) == mode
    assert reference.arithmetic(contract.check_op(*args, **{**opts, "precision": "fp32"})) == "fp32"


_SPECIAL_COMBOS = [(dt, tdt, cdt, prec) for dt, tdt, _ in NATIVE_COMBOS for cdt, prec in ((None, "native"),)]
_SPECIAL_COMBOS += [(BF16, F32, FN, "native"), (F16, F16, FNUZ, "native"), (F32, F32, FN, "native"),
                    (BF16, F32, None, "fp32"), (F16, F16, FN, "fp32"), (F32, BF16, None, "fp32"),
                    (BF16, F32, E5, "native"), (F16, F16, E5, "native"), (F32, F32, E5, "fp32")]


@pytest.mark.parametrize("platform,impl", KERNELS)
@pytest.mark.parametrize("dt,tdt,cdt,prec", _SPECIAL_COMBOS, ids=lambda v: getattr(v, "name", str(v)))
def test_special_values_in_every_position_bit_exact(dt, tdt, cdt, prec, platform, impl):
    """NaN (payloads, signs, signalling), +-inf, +-0, subnormals and +-max as x, as its partner
    and as cos and sin, in every combination: the native kernel equals the reference bit for bit,
    NaN bits included; every NaN the op computes is the canonical one; copied channels and
    values keep their bits."""
    args, opts = special_problem(dt, tdt, cdt, prec)
    with np.errstate(invalid="ignore", over="ignore"):
        want = reference.rope_and_cache(*args, **opts)
    got = _run(args, opts, impl, platform)
    for name, g, w in zip(("q_out", "k_out", "key_cache", "value_cache"), got, want):
        assert np.array_equal(g.view(np.uint8), w.view(np.uint8)), \
            f"{name}: {int((g.view(np.uint8) != w.view(np.uint8)).sum())} bytes differ"
    q_out, k_out, kc, vc = want
    assert np.isnan(q_out[..., :2].astype(np.float32)).sum() > q_out.shape[0]  # NaN results happen
    assert canonical_nan_violations(q_out[..., :2]) == 0 and canonical_nan_violations(k_out[..., :2]) == 0
    assert np.array_equal(q_out[..., 2:].view(np.uint8), args[0][..., 2:].view(np.uint8))  # copies keep bits
    if np.dtype(kc.dtype) in contract.FP8_DTYPES:
        assert canonical_nan_violations(kc) == 0 and canonical_nan_violations(vc) == 0
    k_read, v_read = reference.read_kv(kc, vc, args[5])
    if np.dtype(kc.dtype) == np.dtype(dt):
        assert np.array_equal(v_read.view(np.uint8), args[2].view(np.uint8))


@pytest.mark.parametrize("platform,impl", XLA_PATHS)
@pytest.mark.parametrize("dt,tdt,cdt,prec", _SPECIAL_COMBOS, ids=lambda v: getattr(v, "name", str(v)))
def test_special_values_xla_path(dt, tdt, cdt, prec, platform, impl):
    """The XLA path with NaN, inf and zeros in every position (no subnormals or +-max: FTZ and FMA
    contraction move those within the documented bounds only): the same NaN positions, every
    computed NaN canonical, infinities and zeros exactly, copies bit for bit."""
    args, opts = special_problem(dt, tdt, cdt, prec, extremes=False)
    tiny = [np.isfinite(a.astype(np.float32)) & (np.abs(a.astype(np.float32)) < 1e-4) & (a.astype(np.float32) != 0)
            for a in (args[0], args[7], args[8])]
    args = list(args)
    for i, m in zip((0, 7, 8), tiny):  # subnormals -> 0.5
        args[i] = np.where(m, np.asarray(0.5, args[i].dtype), args[i]).astype(args[i].dtype)
    args[1] = args[0][:, ::-1].copy()
    args[2] = args[1].copy()
    args = tuple(args)
    with np.errstate(invalid="ignore", over="ignore"):
        want = reference.rope_and_cache(*args, **opts)
    got = _run(args, opts, impl, platform)
    for name, g, w in zip(("q_out", "k_out", "key_cache", "value_cache"), got, want):
        gf, wf = g.astype(np.float32), w.astype(np.float32)
        assert (np.isnan(gf) == np.isnan(wf)).all(), f"{name}: NaN positions differ"
        exact = ~np.isfinite(wf)
        assert np.array_equal(g.view(np.uint8).reshape(g.shape + (-1,))[exact],
                              w.view(np.uint8).reshape(w.shape + (-1,))[exact]), f"{name}: inf/NaN bits"
        # finite: 1 ulp, or the FMA bound of tests/test_op.py (|x|, |table| <= 1.5 here)
        inv = 1.0 / float(opts.get("k_scale", 1.0)) if name == "key_cache" else 1.0
        with np.errstate(invalid="ignore"):
            close = (ulp_diff(g, w) <= 1) | (np.abs(gf.astype(np.float64) - wf) <= 2.0**-22 * 2.25 * inv)
        assert close[~exact].all(), f"{name}: {int((~close[~exact]).sum())} finite values beyond the bound"
    assert canonical_nan_violations(got[0][..., :2]) == 0
    assert np.array_equal(got[0][..., 2:].view(np.uint8), args[0][..., 2:].view(np.uint8))


def _fma_bound(x, cos_rows, sin_rows, spec):
    """Per element, one float32 ulp of each product of its rotation (|x_a*c| + |x_b*s|) * 2^-23:
    what an FMA (XLA's contraction, or "fused" arithmetic left unfused) can move it by."""
    a, b = reference.pair_channels(spec.rotary_dim, spec.is_neox)
    c, s = np.abs(cos_rows.astype(np.float64)), np.abs(sin_rows.astype(np.float64))
    ca, cb, sa, sb = ((c[:, a], c[:, b], s[:, a], s[:, b]) if spec.table_full else (c, c, s, s))
    ca, cb, sa, sb = (t[:, None, :] for t in (ca, cb, sa, sb))
    xf = np.abs(x.astype(np.float64))
    bound = np.zeros(x.shape)
    bound[..., a] = xf[..., a] * ca + xf[..., b] * sa
    bound[..., b] = xf[..., b] * cb + xf[..., a] * sb
    return bound * 2.0**-23


def _subnormal_problem(dt, tdt, cdt=None, prec="native", seed=0):
    """Random values spread over 2^-140 .. 2^4, so inputs, table values, products and results
    are often subnormal (float32 and the 16-bit dtypes)."""
    rng = np.random.default_rng(seed)
    T, QH, KH, D = 24, 4, 2, 32
    mag = lambda *s: rng.standard_normal(s) * np.exp2(rng.integers(-140, 4, s))  # noqa: E731
    q, k, v = (mag(T, h, D).astype(np.float32).astype(dt) for h in (QH, KH, KH))
    cos, sin = (mag(T, D // 2).astype(np.float32).astype(tdt) for _ in range(2))
    cdt = np.dtype(cdt or dt)
    kshape, vshape = contract.cache_shapes("flash", 4, 16, KH, D, cdt)
    kc = rng.standard_normal(kshape).astype(np.float32).astype(cdt)
    vc = rng.standard_normal(vshape).astype(np.float32).astype(cdt)
    slots = rng.permutation(64)[:T].astype(np.int32)
    opts = dict(precision=prec)
    if cdt in contract.FP8_DTYPES:
        opts.update(k_scale=np.float32(2.0**-120), v_scale=np.float32(2.0**-125))  # subnormal k_out -> fp8 range
    return (q, k, v, kc, vc, slots, np.arange(T, dtype=np.int32), cos, sin), opts


_SUB_COMBOS = [(BF16, BF16, None, "native"), (BF16, F32, None, "native"), (F16, F32, None, "native"),
               (F32, F32, None, "native"), (BF16, F32, None, "fp32"), (F32, BF16, None, "fp32"),
               (BF16, F32, FN, "native"), (BF16, BF16, FNUZ, "fp32"), (F16, F16, None, "native"),
               (F32, F32, E5, "native"), (BF16, BF16, E5, "fp32")]


@pytest.mark.parametrize("platform,impl", impl_params())
@pytest.mark.parametrize("dt,tdt,cdt,prec", _SUB_COMBOS, ids=lambda v: getattr(v, "name", str(v)))
def test_subnormals_kept_by_kernels_bounded_in_xla(dt, tdt, cdt, prec, platform, impl):
    """Inputs whose values, products and results are subnormal. The native kernels keep
    subnormals and are bit-exact to the reference; the CPU handler does so although it runs on
    XLA's threads, which compute with flush-to-zero + denormals-are-zero. The XLA path stays
    within its documented bound (2^-123 absolute, or 1 ulp); on CPU it flushes."""
    args, opts = _subnormal_problem(dt, tdt, cdt, prec)
    assert np.float32(2.0**-140) * np.float32(1.0) != 0  # numpy itself keeps subnormals
    want = reference.rope_and_cache(*args, **opts)
    sub = lambda a: np.isfinite(a) & (a != 0) & (np.abs(a) < 2.0**-126)  # noqa: E731
    if dt != F16:
        assert sub(want[0].astype(np.float32)).sum() > 10, "the case has few subnormal results"
    got = _run(args, opts, impl, platform)
    if impl == "kernel":
        for name, g, w in zip(("q_out", "k_out", "key_cache", "value_cache"), got, want):
            assert np.array_equal(g.view(np.uint8), w.view(np.uint8)), f"{name}: differs from the reference"
        return
    flushed = 0
    spec = contract.check_op(*args, **opts)
    for name, g, w, x in zip(("q_out", "k_out"), got, want, args[:2]):
        err = np.abs(g.astype(np.float64) - w.astype(np.float64))
        bound = 2.0**-123 + _fma_bound(x, args[7], args[8], spec)  # FTZ, plus XLA's FMA on GPU
        ok = (ulp_diff(g, w) <= 1) | (err <= bound)
        assert ok.all(), f"xla {name}: {int((~ok).sum())} elements beyond the FTZ bound"
        flushed += int(((g.astype(np.float32) == 0) & (w.astype(np.float32) != 0)).sum())
    print(f"\nXLA path on {platform}: {flushed} q/k outputs flushed to zero that the reference keeps")


@pytest.mark.parametrize("platform,impl", impl_params())
@pytest.mark.parametrize("cdt", [FN, FNUZ, E5])
@pytest.mark.parametrize("scale", [1e-38, 1e-40, 2.0**-149, 0.0, -0.0, 2.0**-127, 1e-30])
def test_tiny_scale_never_makes_finite_values_nan(cdt, scale, platform, impl):
    """k_scale/v_scale subnormal or zero: 1/scale overflows (or not: 1e-38) and is clamped to
    FLT_MAX, so 0 stays 0, finite values saturate or quantize, only NaN input is NaN. The native
    kernels are bit-exact to the reference; the XLA path (which reads a subnormal scale as 0 on
    CPU) keeps the same guarantees."""
    # channels 0, 1 (rotated, R = 2) are zero; the values ride in the pass-through channels
    vals = np.array([0.0, 0.0, 0.0, -0.0, 1.0, -3.0, 1e-39, -1e-40, 1e-30, np.inf, -np.inf, np.nan, 448.0, 2.0**-133],
                    np.float32)
    T, KH, D = 4, 3, len(vals)
    rng = np.random.default_rng(0)
    x = np.broadcast_to(vals, (T, KH, D)).astype(BF16)
    kshape, vshape = contract.cache_shapes("flash", 1, 16, KH, D, cdt)
    kc, vc = (rng.standard_normal(s).astype(np.float32).astype(cdt) for s in (kshape, vshape))
    cos, sin = np.full((1, 1), 0.6, np.float32), np.full((1, 1), 0.8, np.float32)
    args = (x, x, x, kc, vc, np.arange(T, dtype=np.int32), np.zeros(T, np.int32), cos, sin)
    opts = dict(k_scale=np.float32(scale), v_scale=np.float32(scale), precision="native", rotary_dim=2)
    want = reference.rope_and_cache(*args, **opts)
    got = _run(args, opts, impl, platform)
    if impl == "kernel":
        for name, g, w in zip(("key_cache", "value_cache"), got[2:], want[2:]):
            assert np.array_equal(g.view(np.uint8), w.view(np.uint8)), f"{name} (scale {scale})"
    for cache in reference.read_kv(got[2], got[3], args[5]):
        f = cache.astype(np.float32)
        xf = x.astype(np.float32)
        assert (np.isnan(f) == np.isnan(xf)).all(), f"{impl}: NaN from a finite value (scale {scale})"
        assert (f[xf == 0] == 0).all(), f"{impl}: 0 did not stay 0 (scale {scale})"
        big = np.isfinite(xf) & (np.abs(xf) >= 1e-30)
        assert (np.abs(f[big]) == contract.FP8_MAX[cdt]).all() or scale >= 1e-30, impl


@pytest.mark.parametrize("platform,impl", KERNELS)
@pytest.mark.parametrize("cdt", [FN, E5])
def test_fused_fp8_quantizes_the_unrounded_value(platform, impl, cdt):
    """float32 tables (fused arithmetic) with an fp8 cache: the key cache holds fp8 of the float32
    rotation, not of the bf16 k_out (AITER's choice); the two differ on some elements here."""
    from conftest import Case, make_problem

    args, opts = make_problem(Case(T=64, QH=4, KH=4, D=128, dtype="bfloat16", table_dtype="float32",
                                   cache_dtype=cdt.name, precision="native"), seed=9)
    want = reference.rope_and_cache(*args, **opts)
    k_read, _ = reference.read_kv(want[2], want[3], args[5])
    valid = (args[5] >= 0) & (args[5] < want[2].shape[0] * want[2].shape[1])
    from_rounded = reference.quantize(want[1], cdt, opts["k_scale"])
    assert (k_read[valid].view(np.uint8) != from_rounded[valid].view(np.uint8)).sum() > 0
    got = _run(args, opts, impl, platform)
    for name, g, w in zip(("q_out", "k_out", "key_cache", "value_cache"), got, want):
        assert np.array_equal(g.view(np.uint8), w.view(np.uint8)), name


@pytest.mark.parametrize("dtype", [BF16, F16])
def test_rounded_products_equal_one_rounding(dtype):
    """r(r32(x*c)) == r(x*c) for x, c of a 16-bit dtype: the float32 product is exact except in
    float32's subnormal range, and rounding it there first never changes the result (every pair
    of significands at every exponent from far below the dtype's subnormals to its normal range).
    With the sum property above, "rounded" native arithmetic equals the dtype's own hardware
    arithmetic (bf16x2/f16x2 multiply and add, round to nearest, subnormals kept, no FMA)."""
    p = 8 if dtype == BF16 else 11
    m = np.arange(2 ** (p - 1), 2**p, dtype=np.float64)
    m2 = m if dtype == BF16 else m[::3]
    prod = (m[:, None] * m2[None, :]).ravel()  # exact: <= 2p bits
    lo, hi = (-170, -110) if dtype == BF16 else (-62, -28)
    bad = 0
    for e in range(lo, hi):
        x = prod * 2.0**e
        twice = x.astype(np.float32).astype(dtype)
        once = round_sum_once(x, np.zeros_like(x), dtype)
        bad += int((twice.view(np.uint16) != once.view(np.uint16)).sum())
    assert bad == 0
