"""The fused QK-RMSNorm before RoPE (q_norm_weight / k_norm_weight, norm_eps) and per-head
fp8 scales (k_scale / v_scale of shape [KH]), every implementation present vs the numpy reference.

Coverage: layouts, NeoX / GPT-J, partial rotary, half / full tables, bf16 / f16 / f32 inputs,
weights in q's dtype and in float32, q-only / k-only / both, both precisions, fp8 caches with
scalar and per-head scales. The native kernels are bit-exact to the reference; the XLA path is
within the FMA bound of tests/test_op.py taken over the normalised inputs (the rotation is where
XLA may contract; the norm itself cannot be contracted: backends/xla.py). A kernel whose backend
does not implement an option yet (its SUPPORTS set) must refuse it with impl="kernel", never
compute something else. The tree order of the sum of squares is pinned by rows on which a plain
sequential sum and the (i, i + n/2) fold give other bits.
"""

from __future__ import annotations

import warnings
import zlib

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jax_rope_cache as jrc
from jax_rope_cache import backends, contract, reference
from jax_rope_cache.backends import xla
from conftest import (Case, assert_bits_equal, assert_fma_close, assert_within_ulp, canonical_nan_violations,
                      impl_params, make_problem, to_host, xla_bound)

BF16, F16, F32 = np.dtype(ml_dtypes.bfloat16), np.dtype(np.float16), np.dtype(np.float32)
NAMES = ("q_out", "k_out", "key_cache", "value_cache")


def _dt(name):
    return np.dtype(getattr(ml_dtypes, name, None) or name)


def add_norm(args, opts, *, q=True, k=True, weight_dtype="same", eps=1e-6, per_head=(False, False), seed=0):
    """opts with norm weights (random, both signs, some near 0) and, for fp8 caches, per-head scales."""
    rng = np.random.default_rng(seed + 1000)
    dt, d, kh = args[0].dtype, args[0].shape[2], args[1].shape[1]
    wdt = dt if weight_dtype == "same" else np.dtype(weight_dtype)
    opts = dict(opts, norm_eps=eps)
    if q:
        opts["q_norm_weight"] = (rng.standard_normal(d) * 1.5).astype(wdt)
    if k:
        opts["k_norm_weight"] = (rng.standard_normal(d) * 1.5).astype(wdt)
    for name, on in zip(("k_scale", "v_scale"), per_head):
        if on and name in opts:
            opts[name] = rng.uniform(0.02, 0.5, kh).astype(np.float32)
    return opts


def run(platform, impl, args, opts):
    """The op jitted on `platform`, every array (weights and scales included) a traced argument."""
    arrays = {n: opts[n] for n in ("k_scale", "v_scale", "q_norm_weight", "k_norm_weight") if n in opts}
    static = {n: v for n, v in opts.items() if n not in arrays}
    dev = jax.devices(platform)[0]
    with jax.enable_x64(any(np.asarray(a).dtype == np.int64 for a in args[5:7])):
        fn = jax.jit(lambda a, kw: jrc.rope_and_cache(*a, **kw, **static, impl=impl))
        return to_host(fn(jax.device_put(args, dev), jax.device_put(arrays, dev)))


def kernel_supports(platform, opts) -> bool:
    used = {f for f, n in (("q_norm", "q_norm_weight"), ("k_norm", "k_norm_weight")) if n in opts}
    used |= {f"{n}_heads" for n in ("k_scale", "v_scale") if np.ndim(opts.get(n, 0)) == 1 and np.size(opts[n]) > 1}
    return used <= backends.KERNEL_BACKENDS[platform].SUPPORTS


# The XLA path's norm on a GPU: XLA's own float32 division and square root there are not the correctly
# rounded ones (measured on the H200: up to 4 f32 ulps of the normalised value, 1-2 ulps after a
# rounding to f16 and the weight product, none seen for bf16), so a normalised input may be that far
# off before the rotation.
GPU_NORM_ULPS = {np.dtype(np.float32): 8 * 2.0**-24, np.dtype(np.float16): 2 * 2.0**-11,
                 np.dtype(ml_dtypes.bfloat16): 2 * 2.0**-8}


def xla_bounds(args, opts, platform="cpu"):
    """tests/test_op.py's FMA bound over the rotation's inputs: the normalised q and k (on a GPU
    plus GPU_NORM_ULPS of the largest normalised value of the row, through cos and sin)."""
    normed = list(args)
    for i, w in ((0, "q_norm_weight"), (1, "k_norm_weight")):
        if w in opts:
            normed[i] = reference.rms_norm(args[i], opts[w], np.float32(opts.get("norm_eps", 1e-6)))
    scalar = dict(opts, k_scale=float(np.min(opts["k_scale"]))) if "k_scale" in opts else opts
    bounds = [xla_bound(n, normed, scalar) for n in NAMES]
    if platform != "cpu":
        slack = [GPU_NORM_ULPS[np.dtype(args[0].dtype)] * np.abs(normed[i].astype(np.float32)).max(
            axis=-1, keepdims=True) if w in opts else 0.0 for i, w in ((0, "q_norm_weight"), (1, "k_norm_weight"))]
        inv = 1.0 / float(scalar.get("k_scale", 1.0))
        bounds[0] = bounds[0] + 2 * slack[0]
        bounds[1] = bounds[1] + 2 * slack[1]
        bounds[2] = bounds[2] + 2 * inv * float(np.max(slack[1], initial=0))
    return bounds


def check(platform, impl, args, opts, what):
    want = reference.rope_and_cache(*args, **opts)
    if impl == "kernel" and not kernel_supports(platform, opts):
        with pytest.raises(NotImplementedError, match="does not implement"):
            run(platform, impl, args, opts)
        return want
    got = run(platform, impl, args, opts)
    bounds = xla_bounds(args, opts, platform) if impl == "xla" else None
    for i, (name, g, w) in enumerate(zip(NAMES, got, want)):
        if impl == "kernel":
            assert_bits_equal(g, w, f"{name} [{what}]")
        else:
            assert_fma_close(g, w, bounds[i], f"{name} [{what}]")
    return want


# ---- the option matrix -------------------------------------------------------------------------
def _cases():
    out = []
    layouts = ("flash", "xpacked", "xpacked_shuffled", "head_major", "kv_merged")
    dtypes = ("bfloat16", "float16", "float32")
    tables = ("float32", "bfloat16", "float16")
    caches = (None, "float8_e4m3fn", "float8_e4m3fnuz")
    norms = ((True, True), (True, False), (False, True))
    for i in range(30):
        dt = dtypes[i % 3]
        d = (128, 64, 256, 80)[i % 4]
        cache = caches[(i // 3) % 3]
        layout = layouts[(i // 2) % len(layouts)]
        x = 16 if cache else {"float32": 4}.get(dt, 8)
        if layout != "flash" and d % x:
            layout = "flash"
        case = Case(T=(7, 1, 33)[i % 3], QH=(8, 16, 4)[i % 3], KH=(1, 2, 4)[(i // 3) % 3], D=d,
                    R=(None, d // 2, None, d - 16)[(i // 4) % 4], layout=layout, is_neox=bool(i % 2 == 0),
                    table=("half", "full")[(i // 5) % 2], dtype=dt, table_dtype=tables[(i // 2) % 3],
                    cache_dtype=cache, precision=("fp32", "native")[(i // 6) % 2],
                    index_dtype=("int32", "int64")[(i // 7) % 2])
        q, k = norms[i % 3]
        norm = dict(q=q, k=k, weight_dtype=("same", "float32")[(i // 3) % 2], eps=(1e-6, 1e-5)[i % 2],
                    per_head=((True, True), (True, False), (False, True), (False, False))[i % 4])
        out.append((case, norm))
    return out


CASES = _cases()


def _id(c):
    case, norm = c
    return (f"{case.id}-{'q' if norm['q'] else ''}{'k' if norm['k'] else ''}norm-w{norm['weight_dtype']}-"
            f"heads{int(norm['per_head'][0])}{int(norm['per_head'][1])}")


@pytest.mark.parametrize("platform,impl", impl_params())
@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_norm_matches_reference(platform, impl, case):
    case, norm = case
    seed = zlib.crc32(_id((case, norm)).encode())
    args, opts = make_problem(case, seed)
    check(platform, impl, args, add_norm(args, opts, seed=seed, **norm), _id((case, norm)))


def test_matrix_covers_every_option():
    seen = {(c.layout, c.is_neox, c.dtype, n["weight_dtype"], n["q"], n["k"], c.precision) for c, n in CASES}
    for axis, values in ((0, ("flash", "xpacked", "xpacked_shuffled")), (1, (True, False)),
                         (2, ("bfloat16", "float16", "float32")), (3, ("same", "float32")), (6, ("fp32", "native"))):
        assert {s[axis] for s in seen} >= set(values), axis
    assert {(n["q"], n["k"]) for _, n in CASES} == {(True, True), (True, False), (False, True)}
    fp8 = [(c, n) for c, n in CASES if c.cache_dtype]
    assert any(n["per_head"][0] for _, n in fp8) and any(n["per_head"][1] for _, n in fp8)
    assert any(not n["per_head"][0] for _, n in fp8)
    assert any(c.R for c, _ in CASES) and any(c.table == "full" for c, _ in CASES)


@pytest.mark.parametrize("platform,impl", impl_params())
@pytest.mark.parametrize("layers", [None, 3])
def test_norm_with_stacked_caches_and_real_shapes(platform, impl, layers):
    """Qwen3-32B TP8 (8/1/128) and Qwen3-235B TP4 (16/1/128) decode and prefill shapes."""
    for qh, kh, t in ((8, 1, 1), (16, 1, 64)):
        case = Case(T=t, QH=qh, KH=kh, D=128, layout="xpacked", table_dtype="float32", cache_dtype="float8_e4m3fn")
        args, opts = make_problem(case, seed=qh + t)
        opts = add_norm(args, opts, seed=t, per_head=(True, True))
        if layers:
            args = list(args)
            for i in (3, 4):
                args[i] = np.stack([args[i]] * layers)
            opts["layer"] = 1
        check(platform, impl, tuple(args), opts, f"{qh}/{kh} T={t} layers={layers}")


# ---- the norm is a norm: an independent formula, the rounding points, the un-normalised result ------
@pytest.mark.parametrize("dt", [BF16, F16, F32], ids=lambda d: d.name)
def test_reference_norm_is_an_rmsnorm(dt):
    """The reference's normalised values against the float64 formula w * x / sqrt(mean(x^2) + eps),
    within the two roundings and the float32 steps (a norm wrong in any term is far off)."""
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((64, 4, 128)) * rng.uniform(0.01, 30, (64, 4, 1))).astype(dt)
    w = rng.uniform(0.2, 2.0, 128).astype(dt)
    got = reference.rms_norm(x, w, np.float32(1e-6)).astype(np.float64)
    x64 = x.astype(np.float64)
    want = w.astype(np.float64) * x64 / np.sqrt((x64**2).mean(-1, keepdims=True) + 1e-6)
    unit = 2.0 ** -{BF16: 8, F16: 11, F32: 24}[dt]  # half an ulp, relative
    # two roundings to the dtype, plus the float32 steps (7 tree levels, /, sqrt, 1/x: ~12 half-ulps)
    steps = 12 * 2.0**-24 / unit + (0 if dt == F32 else 2)
    assert (np.abs(got - want) <= steps * unit * np.abs(want) + 1e-30).all()
    assert (np.abs(got - want) > unit * np.abs(want) / 4).any()  # the roundings are really there


def test_rounding_points_are_hf_s():
    """bf16: y is rounded to bf16 before the weight (HF `.to(input_dtype)`), then the product w * y
    is rounded again: a single rounding of x * inv * w gives other bits on part of the elements."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((256, 128)).astype(BF16)
    w = rng.uniform(0.5, 2.0, 128).astype(BF16)
    got = reference.rms_norm(x, w, np.float32(1e-6))
    xf = x.astype(F32)
    inv = (np.float32(1) / np.sqrt(reference.tree_sum(xf * xf) / np.float32(128) + np.float32(1e-6)))[:, None]
    two = (w * (xf * inv).astype(BF16)).astype(BF16)  # ml_dtypes: bf16 * bf16 -> bf16, rounded once
    assert_bits_equal(got, two, "two roundings")
    one = (xf * inv * w.astype(F32)).astype(BF16)
    assert (one.view(np.uint16) != got.view(np.uint16)).mean() > 0.01


@pytest.mark.parametrize("platform,impl", impl_params())
def test_norm_changes_the_result(platform, impl):
    """Guards against a silently ignored weight: the op with the norm equals the reference with the
    norm and differs from the un-normalised op (q, k, key cache), while V is untouched."""
    case = Case(T=9, QH=8, KH=2, D=128)
    args, opts = make_problem(case, seed=11)
    args = (args[0] * np.asarray(7, args[0].dtype), args[1] * np.asarray(0.1, args[1].dtype)) + args[2:]
    normed = add_norm(args, opts, seed=2)
    if impl == "kernel" and not kernel_supports(platform, normed):
        pytest.skip(f"the {platform} kernel does not implement the norm (SUPPORTS); refusal tested elsewhere")
    got = run(platform, impl, args, normed)
    plain = reference.rope_and_cache(*args, **opts)
    valid = (args[5] >= 0) & (args[5] < 6 * 16)
    written = [reference.read_kv(c, args[4], args[5][valid])[0] for c in (got[2], plain[2])]
    for name, g, p in zip(NAMES[:3], [*got[:2], written[0]], [*plain[:2], written[1]]):
        assert (g.view(np.uint8) != p.view(np.uint8)).mean() > 0.5, f"{name}: the norm had no effect"
    assert_bits_equal(got[3], plain[3], "value_cache")
    # scale invariance: with eps below half an ulp of mean(x^2), q * 8 (exact) gives the same bits
    tiny = dict(normed, norm_eps=1e-30)
    eight = (args[0] * np.asarray(8, args[0].dtype), args[1] * np.asarray(0.125, args[1].dtype)) + args[2:]
    for name, g, w in zip(NAMES, run(platform, impl, eight, tiny), run(platform, impl, args, tiny)):
        assert_bits_equal(g, w, f"{name} of 8 q, k / 8")


# ---- the reduction order --------------------------------------------------------------------------
def _sequential(a):
    s = np.zeros(a.shape[:-1], np.float32)
    for i in range(a.shape[-1]):
        s = s + a[..., i]
    return s


def _fold(a):  # pairs (i, i + n/2): another order a GPU implementer might pick
    while a.shape[-1] > 1:
        a = a[..., : a.shape[-1] // 2] + a[..., a.shape[-1] // 2:]
    return a[..., 0]


def test_tree_order_differs_from_other_orders_and_is_what_every_impl_computes():
    """Sums of squares: [1, 0, 2^-24, 2^-24] is 1 + 2^-23 in the tree ((1 + 0) + (2^-24 + 2^-24)) and 1
    sequentially. The op's rows (float32, D=128, identity rotation): one of squares 1, 0, 126 x
    2^-24 (tree: 1 + 63 * 2^-23, sequentially 1: each 2^-24 is lost), and 64 heavy-tailed random
    rows whose sequential and (i, i + n/2)-folded sums give other outputs. Every impl gives the
    tree's bits."""
    assert reference.tree_sum(np.asarray([1, 0, 2**-24, 2**-24], F32)) == np.float32(1 + 2**-23)
    assert _sequential(np.asarray([[1, 0, 2**-24, 2**-24]], F32))[0] == np.float32(1)
    rng = np.random.default_rng(9)
    x = (rng.standard_normal((64, 1, 128)) * np.exp2(rng.integers(-8, 8, (64, 1, 128)))).astype(F32)
    sq = x * x
    tree = reference.tree_sum(sq)
    assert (tree != _sequential(sq)).sum() > 10 and (tree != _fold(sq)).sum() > 10
    tiny = np.zeros((1, 1, 128), F32)
    tiny[0, 0, 0], tiny[0, 0, 2:] = 1, 2**-12  # squares 1, 0, then 126 x 2^-24: tree 1 + 63 * 2^-23, sequential 1
    x = np.concatenate([tiny, x])
    t, d = x.shape[0], x.shape[2]
    w = np.ones(d, F32)
    kc, vc = (np.zeros(s, F32) for s in contract.cache_shapes("flash", 8, 16, 1, d, F32))
    tables = np.ones((1, d // 2), F32), np.zeros((1, d // 2), F32)  # identity rotation
    args = (x, x, x, kc, vc, np.full(t, -1, np.int32), np.zeros(t, np.int32)) + tables
    opts = dict(q_norm_weight=w, k_norm_weight=w, norm_eps=1e-6)
    want = reference.rope_and_cache(*args, **opts)[0]
    eps = np.float32(1e-6)
    for other in (_sequential, _fold):
        inv = np.float32(1) / np.sqrt(other(x * x) / np.float32(d) + eps)
        assert (want != x * inv[..., None]).any(axis=(1, 2)).sum() > 10, other.__name__
    assert reference.tree_sum(x[0, 0] ** 2) == np.float32(1 + 63 * 2**-23) and _sequential(x[0, 0] ** 2) == 1
    seq_row = x[0] * (np.float32(1) / np.sqrt(_sequential(x[:1] * x[:1])[0] / np.float32(d) + eps))
    assert (want[0] != seq_row)[x[0] != 0].all()
    for platform, impl in [p.values for p in impl_params()]:
        if impl == "kernel" and not kernel_supports(platform, opts):
            continue
        got = run(platform, impl, args, opts)[0]
        if impl == "xla" and platform != "cpu":  # XLA's GPU division and square root: GPU_NORM_ULPS
            assert_fma_close(got, want, xla_bounds(args, opts, platform)[0], f"q_out {platform}-{impl}")
        else:
            assert_bits_equal(got, want, f"q_out {platform}-{impl}")


@pytest.mark.parametrize("n", list(range(1, 41)) + [64, 80, 96, 100, 128, 160, 192, 256, 257, 384, 512])
def test_xla_tree_sum_is_the_reference_tree(n):
    """backends/xla.tree_sum (blocks of the odd part, then neighbours) is the reference recursion."""
    rng = np.random.default_rng(n)
    a = (rng.standard_normal((32, n)) * np.exp2(rng.integers(-12, 12, (32, n)))).astype(F32)
    got = np.asarray(jax.jit(xla.tree_sum)(a))
    assert_bits_equal(got, reference.tree_sum(a), f"n={n}")


@pytest.mark.parametrize("platform", sorted({p.values[0] for p in impl_params()}))
@pytest.mark.parametrize("d", [2, 6, 40, 64, 80, 96, 128, 192, 256])
@pytest.mark.parametrize("dt", [BF16, F16, F32], ids=lambda d: d.name)
def test_xla_norm_is_the_reference_norm(platform, d, dt):
    """backends/xla.rms_norm bit for bit (random normal rows: no subnormals for XLA's CPU FTZ), for
    head dims that are powers of two and not: XLA must not replace / D by * (1/D), 1/sqrt by its
    rsqrt, or contract the squares into the sum (each was measured to move bits)."""
    rng = np.random.default_rng(d)
    x = (rng.standard_normal((64, 4, d)) * np.exp2(rng.integers(-6, 6, (64, 4, 1)))).astype(dt)
    for wdt in {dt, F32}:
        w = (rng.standard_normal(d) * 1.5).astype(wdt)
        spec = contract.check_op(*make_problem(Case(T=1, QH=4, KH=2, D=d, dtype=dt.name), 0)[0],
                                 q_norm_weight=w, norm_eps=1e-5)
        dev = jax.devices(platform)[0]
        got = jax.jit(lambda a, b: xla.rms_norm(a, b, spec))(jax.device_put(x, dev), jax.device_put(w, dev))
        want = reference.rms_norm(x, w, np.float32(1e-5))
        if platform == "cpu":
            assert_bits_equal(np.asarray(got), want, f"D={d} w={wdt.name}")
        else:  # XLA's GPU division and sqrt: measured <= 4 f32 ulps (bound 8); 16 bits: 1 ulp of
            # y = r(x * inv), and n = r(w * y) moves that by |w| ulp(y) < 2 ulp(n): bound 2 (H200: 2 seen
            # on 1 element of 16k for f16 with f32 weights, D = 64 and 80)
            assert_within_ulp(np.asarray(got), want, f"D={d} w={wdt.name}", ulps=8 if dt == F32 else 2)


# ---- special values -----------------------------------------------------------------------------
@pytest.mark.parametrize("platform,impl", [p for p in impl_params() if p.values[1] == "kernel"])
@pytest.mark.parametrize("dt", [BF16, F16, F32], ids=lambda d: d.name)
def test_norm_special_values_bitwise(platform, impl, dt):
    """Rows with NaN (payloads, signs), +-inf, all zeros, subnormals and +-max: bit-exact, every
    NaN the norm computes canonical."""
    fin = np.finfo(dt) if dt != BF16 else ml_dtypes.finfo(BF16)
    rng = np.random.default_rng(1)
    d = 64
    rows = rng.standard_normal((12, d)).astype(dt)
    rows[0, 3] = np.nan
    rows[1, 5] = -np.inf
    rows[2] = 0
    rows[3] = (rng.standard_normal(d) * float(fin.smallest_subnormal) * 4).astype(dt)
    rows[4, :] = float(fin.max)
    rows[5, ::2] = -float(fin.max)
    rows[6, 7] = np.inf
    rows[7] = float(fin.smallest_subnormal)
    q = rows.reshape(3, 4, d)
    k = rows[::2].reshape(3, 2, d)
    kc, vc = (np.zeros(s, dt) for s in contract.cache_shapes("flash", 2, 16, 2, d, dt))
    args = (q, k, k, kc, vc, np.arange(3, dtype=np.int32), np.arange(3, dtype=np.int32),
            rng.uniform(-1, 1, (4, d // 2)).astype(F32), rng.uniform(-1, 1, (4, d // 2)).astype(F32))
    w = rng.standard_normal(d).astype(dt)
    w[0] = float(fin.smallest_subnormal)
    opts = dict(q_norm_weight=w, k_norm_weight=w.astype(F32), norm_eps=1e-6)
    want = check(platform, impl, args, opts, dt.name)
    assert canonical_nan_violations(want[0]) == 0 and np.isnan(want[0].astype(F32)).any()


# ---- per-head scales --------------------------------------------------------------------------------
@pytest.mark.parametrize("platform,impl", impl_params())
@pytest.mark.parametrize("cdt,layout", [("float8_e4m3fn", "xpacked_shuffled"), ("float8_e5m2", "xpacked")])
def test_per_head_scales_use_each_heads_scale(platform, impl, cdt, layout):
    """Kv head h is quantized with scale[h]: the cache equals per-head runs with scalar scales; a
    scale [1] or () gives the same bits as the plain float."""
    case = Case(T=11, QH=8, KH=4, D=64, cache_dtype=cdt, layout=layout)
    args, opts = make_problem(case, seed=4)
    ks, vs = np.asarray([0.05, 0.1, 0.4, 2.0], F32), np.asarray([1.0, 0.02, 0.3, 0.07], F32)
    opts = dict(opts, k_scale=ks, v_scale=vs)
    want = check(platform, impl, args, opts, "per-head")
    k_all, v_all = reference.read_kv(want[2], want[3], args[5], layout=case.layout)
    for h in range(4):
        one = reference.rope_and_cache(*args, **dict(opts, k_scale=ks[h], v_scale=vs[h]))
        k1, v1 = reference.read_kv(one[2], one[3], args[5], layout=case.layout)
        assert_bits_equal(k_all[:, h], k1[:, h], f"key head {h}")
        assert_bits_equal(v_all[:, h], v1[:, h], f"value head {h}")
    assert (k_all[:, 0] != reference.read_kv(reference.rope_and_cache(*args, **dict(opts, k_scale=ks[3]))[2],
                                             want[3], args[5], layout=case.layout)[0][:, 0]).any()
    for shape in ((), (1,)):
        s = dict(opts, k_scale=np.full(shape, 0.25, F32), v_scale=np.full(shape, 0.5, F32))
        assert_bits_equal(reference.rope_and_cache(*args, **s)[2],
                          reference.rope_and_cache(*args, **dict(opts, k_scale=0.25, v_scale=0.5))[2], str(shape))


# ---- entry points: donated jit, jax.Ref caches, vmap, eager, eps forms -----------------------------
def _small_norm_problem(seed=0):
    case = Case(T=5, QH=4, KH=2, D=64, cache_dtype="float8_e4m3fn")
    args, opts = make_problem(case, seed)
    return args, add_norm(args, opts, seed=seed, per_head=(True, False), eps=1e-5)


def test_donated_refs_vmap_and_eager_give_the_reference():
    args, opts = _small_norm_problem(1)
    want = reference.rope_and_cache(*args, **opts)
    # eager, with eps as numpy and jax scalars
    for eps in (1e-5, np.float32(1e-5), np.float64(1e-5), jnp.float32(1e-5)):
        got = jrc.rope_and_cache(*args, **dict(opts, norm_eps=eps))
        for name, g, w in zip(NAMES, got, want):
            assert_bits_equal(np.asarray(g), w, f"{name} eps={type(eps).__name__}")
    dargs = [jnp.asarray(a) for a in args]
    got = jrc.rope_and_cache_donated(*dargs, **dict(opts, norm_eps=jnp.float32(1e-5)))
    for name, g, w in zip(NAMES, got, want):
        assert_bits_equal(np.asarray(g), w, f"donated {name}")
    kref, vref = jax.new_ref(jnp.asarray(args[3])), jax.new_ref(jnp.asarray(args[4]))
    q_out, k_out, kref, vref = jrc.rope_and_cache(*args[:3], kref, vref, *args[5:], **opts)
    assert_bits_equal(np.asarray(kref[...]), want[2], "ref key cache")
    assert_bits_equal(np.asarray(q_out), want[0], "ref q_out")
    # vmap over two problems with their own weights and per-head scales
    other_args, other_opts = _small_norm_problem(2)
    stack = lambda a, b: np.stack([a, b])  # noqa: E731
    arrays = ("k_scale", "v_scale", "q_norm_weight", "k_norm_weight")
    batched = [stack(a, b) for a, b in zip(args, other_args)]
    bopts = {n: stack(np.asarray(opts[n]), np.asarray(other_opts[n])) for n in arrays}
    static = {n: v for n, v in opts.items() if n not in arrays}
    out = jax.vmap(lambda a, kw: jrc.rope_and_cache(*a, **kw, **static))(batched, bopts)
    for b, (a, o) in enumerate(((args, opts), (other_args, other_opts))):
        w = reference.rope_and_cache(*a, **o)
        for name, g, ww in zip(NAMES, out, w):
            assert_bits_equal(np.asarray(g[b]), ww, f"vmap {b} {name}")


def test_without_weights_eps_is_ignored_and_the_op_is_unchanged():
    case = Case(T=7)
    args, opts = make_problem(case, seed=6)
    base = jrc.rope_and_cache(*args, **opts)
    other = jrc.rope_and_cache(*args, **dict(opts, norm_eps=0.5))
    for g, w in zip(other, base):
        assert_bits_equal(np.asarray(g), np.asarray(w), "eps without weights")
    spec = contract.check_op(*args, **dict(opts, norm_eps=0.5))
    assert spec.norm_eps == 0.0 and not spec.norm and contract.features(spec) == frozenset()


# ---- the capability check: a kernel without an option refuses it ------------------------------------
def test_unsupported_option_falls_back_or_raises(monkeypatch):
    """With the CPU handler's SUPPORTS emptied (as the GPU kernels' before their norm lands):
    impl=None warns and runs the XLA path, impl="kernel" raises naming the option."""
    from jax_rope_cache import primitive
    from jax_rope_cache.backends import cpu

    monkeypatch.setattr(cpu, "SUPPORTS", frozenset())
    monkeypatch.setattr(primitive, "_warned", set())
    primitive._eager_callable.cache_clear()
    args, opts = _small_norm_problem(3)
    cpu_device = jax.devices("cpu")[0]  # the CPU handler's SUPPORTS: run on the CPU also on a GPU host
    try:
        with jax.default_device(cpu_device), warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            got = jrc.rope_and_cache(*args, **opts)
        assert any("falling back to the XLA implementation on CPU" in str(x.message) and "q_norm_weight" in
                   str(x.message) for x in w), [str(x.message) for x in w]
        with jax.default_device(cpu_device):
            want = jrc.rope_and_cache(*args, **opts, impl="xla")
            for g, ww in zip(got, want):
                assert_bits_equal(np.asarray(g), np.asarray(ww), "fallback")
            with pytest.raises(NotImplementedError, match=r"impl='kernel' on CPU.*q_norm_weight.*per-head k_scale"):
                jrc.rope_and_cache(*args, **opts, impl="kernel")
            plain = dict(opts, k_scale=0.25)
            plain.pop("q_norm_weight"), plain.pop("k_norm_weight")
            jrc.rope_and_cache(*args, **plain, impl="kernel")  # no option used: the kernel runs
    finally:
        primitive._eager_callable.cache_clear()


@pytest.mark.parametrize("platform", ["cuda", "rocm"])
def test_gpu_backends_refuse_what_their_kernel_lacks(platform):
    """Lowering for a GPU platform on this machine: options outside the backend's SUPPORTS raise
    with impl="kernel" (impl=None lowers the XLA path); supported ones reach the kernel build."""
    backend = backends.KERNEL_BACKENDS[platform]
    if backend.missing() is not None:
        pytest.skip(f"the {platform} kernel cannot be built here: {backend.missing()}")
    args, opts = _small_norm_problem(4)
    arrays = {n: opts[n] for n in ("k_scale", "v_scale", "q_norm_weight", "k_norm_weight")}
    static = {n: v for n, v in opts.items() if n not in arrays}
    shapes = [jax.ShapeDtypeStruct(np.shape(a), np.asarray(a).dtype) for a in args]
    ashapes = {n: jax.ShapeDtypeStruct(np.shape(a), np.asarray(a).dtype) for n, a in arrays.items()}

    def export(impl):
        fn = jax.jit(lambda a, kw: jrc.rope_and_cache(*a, **kw, **static, impl=impl))
        return jrc.export(fn, platforms=[platform])(shapes, ashapes)

    if contract.features(contract.check_op(*args, **opts)) <= backend.SUPPORTS:
        assert "custom_call" in export("kernel").mlir_module()
        return
    with pytest.raises(NotImplementedError, match=f"impl='kernel' on {backend.NAME}"):
        export("kernel")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        text = export(None).mlir_module()
    assert "jax_rope_cache_gpu" not in text and "sqrt" in text


# ---- presets and the demo ------------------------------------------------------------------------
def test_qwen3_presets_carry_the_norm_and_the_demo_runs_it(capsys):
    from jax_rope_cache.cli import demo
    from jax_rope_cache.models import presets

    assert presets.preset_qk_norm_eps("qwen3-32b") == presets.preset_qk_norm_eps("qwen3-235b-a22b") == 1e-6
    assert presets.preset_qk_norm_eps("llama-3.1-8b") is None and presets.preset_qk_norm_eps("tiny") is None
    data, _ = demo.build(presets.model_shape("qwen3-32b", 8), 2, 4, 2, 2, 16, 0, "qwen3-32b")
    assert data["q_norm_w"].shape == data["k_norm_w"].shape == (2, 128)
    assert demo.run("qwen3-32b", tp=8, batch=2, prefill=4, steps=2, layers=2, repeats=1)
    out = capsys.readouterr().out
    assert "QK-RMSNorm fused (eps 1e-06" in out and "kernel bit-exact" in out
