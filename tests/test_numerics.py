"""The arithmetic itself: the shared C++/CUDA conversions against ml_dtypes (exhaustive where the
format is small), and known answers of the reference."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from jax_rope_cache import contract, reference
from jax_rope_cache.backends import native
from conftest import Case, make_problem

native = native.native_module()
needs_native = pytest.mark.skipif(native is None, reason="the compiled extension did not import")
SMALL = {"bfloat16": (ml_dtypes.bfloat16, np.uint16), "float16": (np.float16, np.uint16),
         "float8_e4m3fn": (ml_dtypes.float8_e4m3fn, np.uint8), "float8_e4m3fnuz": (ml_dtypes.float8_e4m3fnuz, np.uint8)}


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
@pytest.mark.parametrize("name", ["float8_e4m3fn", "float8_e4m3fnuz"])
def test_fp8_saturates_and_keeps_nan(name):
    dt, _ = SMALL[name]
    f = np.array([1e6, -1e6, np.inf, -np.inf, 449.0, np.nan, -0.0, 1e-30], np.float32)
    bits = np.zeros(f.size, np.uint32)
    native.round_f32(f, bits, contract.DTYPE_CODES[np.dtype(dt)])
    vals = bits.astype(np.uint8).view(dt).astype(np.float32)
    m = contract.FP8_MAX[np.dtype(dt)]
    assert list(vals[:4]) == [m, -m, m, -m] and vals[4] == min(448.0, m)
    assert np.isnan(vals[5]) and vals[6] == 0 and vals[7] == 0


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
    args, opts = make_problem(Case(T=7, D=64, layout=layout, cache_dtype="float8_e4m3fnuz"), seed=8)
    _, k_out, kc, vc = reference.rope_and_cache(*args, **opts)
    k_read, v_read = reference.read_kv(kc, vc, args[5], layout=layout)
    valid = (args[5] >= 0) & (args[5] < kc.size // (2 * 64))
    want_k = reference.quantize(k_out, kc.dtype, opts["k_scale"])
    assert np.array_equal(k_read[valid].view(np.uint8), want_k[valid].view(np.uint8))
    assert np.array_equal(v_read[valid].view(np.uint8),
                          reference.quantize(args[2], kc.dtype, opts["v_scale"])[valid].view(np.uint8))
    assert (k_read[~valid].astype(np.float32) == 0).all()
