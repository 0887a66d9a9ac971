"""Per-token fp8 quantization (k_scale_cache / v_scale_cache): the reference's rule checked from its
definition, every implementation bit-exact to the reference, the scale caches updated in place,
and read_kv's dequantization."""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from conftest import (Case, assert_bits_equal, assert_fma_close, impl_params, make_problem, num_blocks, ulp_diff,
                      xla_bound)

from test_structure import check_in_place

import jax_rope_cache as jrc
from jax_rope_cache import contract, reference

FP8 = [np.dtype(d) for d in (ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e4m3fnuz, ml_dtypes.float8_e5m2)]
F32 = np.float32
SPECIAL_TOKENS = (1, 2, 4)  # tokens with valid slots in make_problem (every third slot is invalid)


def per_token_problem(case: Case, seed: int, *, layers: int | None = None, norm: bool = False):
    """make_problem's call with scale caches instead of static scales: rows of very different
    magnitudes (1e-3 .. 1e3), an all-zero row, rows holding inf and NaN; caches and scale caches
    pre-filled with random values (so untouched entries show)."""
    args, opts = make_problem(case, seed)
    rng = np.random.default_rng(seed + 1)
    q, k, v, kc, vc, slots, pos, cos, sin = args
    opts = {n: x for n, x in opts.items() if n not in ("k_scale", "v_scale")}
    mag = lambda: (10.0 ** rng.uniform(-3, 3, (case.T, case.KH, 1))).astype(F32)  # noqa: E731
    k = (k.astype(F32) * mag()).astype(k.dtype)
    v = (v.astype(F32) * mag()).astype(v.dtype)
    z, s, n = SPECIAL_TOKENS
    v[z, 0] = 0
    k[z, -1] = 0
    v[s, 0, 3], v[s, -1, 5] = np.inf, -np.inf
    v[n, 0, 7] = np.nan
    k[n, 0, 1] = np.nan
    k[s, -1, case.D - 1] = np.inf  # a pass-through or rotated channel: inf either way
    shape = contract.scale_shape(case.layout, num_blocks(case), case.BS, case.KH)
    sc = lambda: rng.uniform(0.1, 2.0, shape).astype(F32)  # noqa: E731
    ksc, vsc = sc(), sc()
    if layers is not None:
        stack = lambda a: None if a is None else np.stack(  # noqa: E731
            [a] + [rng.standard_normal(a.shape).astype(F32).astype(a.dtype) for _ in range(layers - 1)])
        kc, vc, ksc, vsc = stack(kc), stack(vc), stack(ksc), stack(vsc)
        opts["layer"] = layers - 1
    if norm:
        opts["q_norm_weight"] = rng.uniform(0.5, 1.5, case.D).astype(q.dtype)
        opts["k_norm_weight"] = rng.uniform(0.5, 1.5, case.D).astype(F32)
    opts.update(k_scale_cache=ksc, v_scale_cache=vsc)
    return (q, k, v, kc, vc, slots, pos, cos, sin), opts


def _valid(slots, num_slots):
    s = np.asarray(slots).astype(np.int64)
    return (s >= 0) & (s < num_slots)


# ---- the reference against its definition ---------------------------------------------------------
def _stored_rows(args, opts):
    """The float32 rows an fp8 cache quantizes (fp32 precision: k_out widened; v widened)."""
    q_out, k_out, *_ = reference.rope_and_cache(*args, **opts)
    return k_out.astype(F32), args[2].astype(F32)


def _expected_scale(rows, cache_dtype):
    """amax over finite |values| in float64, floored, divided in float64 and rounded once: an
    independent statement of scale = r32(max(amax, 1e-8f) / FP8_MAX)."""
    a = np.abs(rows.astype(np.float64))
    a[~np.isfinite(a)] = 0
    amax = np.maximum(a.max(axis=-1), float(F32(1e-8)))
    return (amax / contract.FP8_MAX[cache_dtype]).astype(F32)


@pytest.mark.parametrize("cdt", FP8, ids=lambda d: d.name)
def test_reference_scales_and_values_follow_the_rule(cdt):
    case = Case(T=9, KH=2, D=64, cache_dtype=cdt.name)
    args, opts = per_token_problem(case, seed=3)
    out = reference.rope_and_cache(*args, **opts)
    k_rows, v_rows = _stored_rows(args, opts)
    slots, bs = args[5], case.BS
    valid = _valid(slots, args[3].shape[0] * bs)
    blk, off = slots[valid] // bs, slots[valid] % bs
    m = contract.FP8_MAX[cdt]
    sub = float(ml_dtypes.finfo(cdt).smallest_subnormal)
    mbits = ml_dtypes.finfo(cdt).nmant
    for which, rows, cache, scache, before in (("key", k_rows, out[2], out[4], opts["k_scale_cache"]),
                                               ("value", v_rows, out[3], out[5], opts["v_scale_cache"])):
        want = _expected_scale(rows[valid], cdt)
        got = scache[blk, :, off]
        np.testing.assert_array_equal(got, want, err_msg=f"{which} scales")
        untouched = np.ones(scache.shape, bool)
        untouched[blk, :, off] = False
        np.testing.assert_array_equal(scache[untouched], before[untouched], err_msg=f"{which}: untouched scales")
        stored = reference.read_tokens(cache, which, "flash", blk, off, case.KH, case.D)
        y, s = rows[valid], got[..., None].astype(np.float64)
        deq = stored.astype(np.float64) * s
        fin = np.isfinite(y)
        # |error| <= half an fp8 ulp of |y/scale| (relative 2^-(nmant+1)) or half the smallest subnormal
        err = np.abs(deq - y.astype(np.float64))[fin]
        bound = (np.abs(y.astype(np.float64)) * 2.0 ** -(mbits + 1) + 0.5 * sub * s + 1e-30 * 0)[fin] * (1 + 2**-20)
        assert (err <= bound).all(), f"{which}: dequantized error above half an fp8 ulp"
        # the row's largest finite value lands on +-FP8_MAX (rows above the floor)
        amax_row = np.where(fin, np.abs(y), 0).max(axis=-1)
        big = amax_row > 1e-8
        top = np.where(fin, np.abs(stored.astype(np.float64)), 0).max(axis=-1)
        np.testing.assert_array_equal(top[big], m)
        # inf saturates to +-max, NaN stays the canonical NaN
        assert (stored[np.isposinf(y)].astype(F32) == m).all() and (stored[np.isneginf(y)].astype(F32) == -m).all()
        nan_bits = stored.view(np.uint8)[np.isnan(y)]
        assert nan_bits.size and (nan_bits == reference.CANONICAL_NAN[cdt]).all()
    # the all-zero row: the floor scale and zeros, never NaN
    z = SPECIAL_TOKENS[0]
    zb, zo = slots[z] // bs, slots[z] % bs
    assert out[5][zb, 0, zo] == F32(F32(1e-8) / F32(m))
    assert (reference.read_tokens(out[3], "value", "flash", np.array([zb]), np.array([zo]), case.KH, case.D)[0, 0]
            .astype(F32) == 0).all()


@pytest.mark.parametrize("layout", contract.LAYOUTS)
def test_reference_per_token_equals_static_scale_of_that_token(layout):
    """One token written with per-token scales stores what the static rule stores with that token's
    scales as per-head scales: the per-token mode is the static rule with a computed scale."""
    case = Case(T=5, KH=2, D=64, cache_dtype="float8_e4m3fn", layout=layout)
    args, opts = per_token_problem(case, seed=5)
    out = reference.rope_and_cache(*args, **opts)
    slots, bs = args[5], case.BS
    for t in SPECIAL_TOKENS[:2]:
        one = [a[t:t + 1] for a in args[:3]] + list(args[3:5]) + [args[5][t:t + 1], args[6][t:t + 1]] + list(args[7:])
        b, o = np.array([slots[t] // bs]), np.array([slots[t] % bs])
        static = {n: x for n, x in opts.items() if not n.endswith("_scale_cache")}
        ks, vs = (reference.read_tokens(out[i], "scale", layout, b, o, case.KH, 1)[0] for i in (4, 5))
        want = reference.rope_and_cache(*one, **static, k_scale=ks, v_scale=vs)
        got = reference.rope_and_cache(*one, **opts)
        for i in (2, 3):
            assert_bits_equal(got[i], want[i], f"token {t} cache {i}")


def test_reference_stacked_writes_one_layer_only():
    case = Case(T=7, KH=2, D=64, cache_dtype="float8_e5m2", layout="hnd")
    args, opts = per_token_problem(case, seed=7, layers=3)
    out = reference.rope_and_cache(*args, **opts)
    one = dict(opts, k_scale_cache=opts["k_scale_cache"][2], v_scale_cache=opts["v_scale_cache"][2])
    del one["layer"]
    flat = reference.rope_and_cache(*args[:3], args[3][2], args[4][2], *args[5:], **one)
    for i in range(2, 6):
        whole = (args[3], args[4], opts["k_scale_cache"], opts["v_scale_cache"])[i - 2]
        assert_bits_equal(out[i][:2], whole[:2], f"result {i}: layers 0-1 untouched")
        assert_bits_equal(out[i][2], flat[i], f"result {i}: layer 2")


def test_reference_read_kv_dequantizes():
    case = Case(T=7, KH=2, D=64, cache_dtype="float8_e4m3fn", layout="xpacked")
    args, opts = per_token_problem(case, seed=11)
    out = reference.rope_and_cache(*args, **opts)
    slots = args[5]
    kk, vv = reference.read_kv(out[2], out[3], slots, layout="xpacked", k_scale_cache=out[4], v_scale_cache=out[5])
    raw_k, raw_v = reference.read_kv(out[2], out[3], slots, layout="xpacked")
    valid = _valid(slots, args[3].shape[0] * case.BS)
    blk, off = slots[valid] // case.BS, slots[valid] % case.BS
    assert kk.dtype == np.float32
    np.testing.assert_array_equal(kk[valid], raw_k[valid].astype(F32) * out[4][blk, :, off][..., None])
    np.testing.assert_array_equal(vv[valid], raw_v[valid].astype(F32) * out[5][blk, :, off][..., None])
    assert (kk[~valid] == 0).all() and (vv[~valid] == 0).all()
    # static scales: per tensor and per head
    ks, vs = F32(0.25), np.array([0.5, 2.0], F32)
    sk, sv = reference.read_kv(out[2], out[3], slots, layout="xpacked", k_scale=ks, v_scale=vs)
    np.testing.assert_array_equal(sk[valid], raw_k[valid].astype(F32) * ks)
    np.testing.assert_array_equal(sv[valid], raw_v[valid].astype(F32) * vs[:, None])


# ---- every implementation against the reference ---------------------------------------------------
@dataclasses.dataclass(frozen=True)
class TokenCase:
    case: Case
    layers: int | None = None
    norm: bool = False
    qkv: bool = False
    mrope: tuple | None = None

    @property
    def id(self):
        c = self.case
        return (f"{c.layout}-{c.cache_dtype}-{c.dtype}-D{c.D}-R{c.R or c.D}-{c.precision}"
                + ("-stacked" if self.layers else "") + ("-norm" if self.norm else "") + ("-qkv" if self.qkv else "")
                + ("-mrope" if self.mrope else "") + ("" if c.is_neox else "-gptj"))


MATRIX = [TokenCase(Case(T=9, KH=2, D=64, layout=lay, cache_dtype=cdt.name))
          for lay in contract.LAYOUTS for cdt in FP8] + [
    TokenCase(Case(T=9, KH=2, D=128, cache_dtype="float8_e4m3fn", precision="native"), norm=True),
    TokenCase(Case(T=9, KH=2, D=64, R=32, cache_dtype="float8_e4m3fnuz", is_neox=False, layout="hnd"), layers=3),
    TokenCase(Case(T=9, KH=2, D=64, cache_dtype="float8_e5m2", dtype="float16", table_dtype="float16",
                   precision="native", layout="xpacked_shuffled"), layers=2, norm=True),
    TokenCase(Case(T=9, KH=2, D=64, cache_dtype="float8_e4m3fn", dtype="float32", precision="native"), qkv=True),
    TokenCase(Case(T=9, KH=2, D=64, cache_dtype="float8_e4m3fn", layout="xpacked"), mrope=(8, 12, 12)),
    TokenCase(Case(T=70, KH=4, D=128, cache_dtype="float8_e4m3fn", layout="flash", BS=32)),
]


def _token_call(tc: TokenCase, seed: int):
    args, opts = per_token_problem(tc.case, seed, layers=tc.layers, norm=tc.norm)
    if tc.mrope:
        rng = np.random.default_rng(seed)
        pos = np.stack([args[6], args[6] + rng.integers(0, 3, tc.case.T), args[6] + rng.integers(0, 5, tc.case.T)])
        args = args[:6] + (pos.astype(args[6].dtype),) + args[7:]
        opts["mrope_section"] = tc.mrope
    return args, opts


def _run(impl, args, opts, qkv: bool):
    if qkv:
        q, k, v = args[:3]
        fused = np.concatenate([q, k, v], axis=1)
        return jrc.rope_and_cache_qkv(fused, *args[3:], num_q_heads=q.shape[1], num_kv_heads=k.shape[1],
                                      impl=impl, **opts)
    return jrc.rope_and_cache(*args, impl=impl, **opts)


@pytest.mark.parametrize("platform,impl", impl_params())
@pytest.mark.parametrize("tc", MATRIX, ids=lambda tc: tc.id)
def test_impl_matches_reference(platform, impl, tc):
    args, opts = _token_call(tc, seed=17)
    want = reference.rope_and_cache(*args, **opts)
    with jax.default_device(jax.devices(platform)[0]):
        got = _run(impl, args, opts, tc.qkv)
    assert len(got) == 6
    check_results(impl, args, got, want, f"{platform}-{impl}")


def check_results(impl, args, got, want, what, nan_bits=True):
    """Kernels: every result bit-exact. The XLA path: q_out/k_out within its FMA bound (XLA may
    contract a product into the rotation's sum), so a row's amax and scale may move by an f32 ulp
    and a stored value by one fp8 ulp. q_out/k_out NaNs (whose bits XLA does not canonicalise, nor
    with nan_bits=False a kernel result handed on by XLA) only have to be where the reference's are."""
    names = contract.RESULTS + contract.TOKEN_SCALE_RESULTS
    for name, g, w in zip(names, got, want):
        if w is None:  # a merged layout's absent value cache
            assert g is None, f"{what}: {name} should be None"
            continue
        g = np.asarray(g)
        if name in ("q_out", "k_out") and (impl != "kernel" or not nan_bits):
            # NaNs where the reference has them (XLA does not make its NaNs canonical), the rest to the bound
            nan = np.isnan(np.asarray(w, F32))
            assert (np.isnan(g.astype(F32)) == nan).all(), f"{what}: {name} NaN positions"
            g, w = np.where(nan, 0, g).astype(g.dtype), np.where(nan, 0, w).astype(w.dtype)
            if impl == "kernel":
                assert_bits_equal(g, w, f"{what}: {name}")
                continue
            finite = [np.where(np.isfinite(a.astype(F32)), a.astype(F32), 0) for a in args[:2]]
            assert_fma_close(g, w, xla_bound(name, finite, {}), f"{what}: {name}")
        else:
            check_cache(impl, name, g, w, what)


def check_cache(impl, name, got, want, what):
    """A cache or scale cache: bit-exact from a kernel; from the XLA path a scale within an f32 ulp
    (the row's amax may move by one) and a stored value within one fp8 ulp, NaNs where the reference's are."""
    got = np.asarray(got)
    if impl == "kernel":
        assert_bits_equal(got, want, f"{what}: {name}")
    elif name.endswith("scale_cache"):
        np.testing.assert_allclose(got, want, rtol=2.0**-20, atol=0, err_msg=f"{what}: {name}")
    else:
        assert (np.isnan(got.astype(F32)) == np.isnan(want.astype(F32))).all(), f"{what}: {name} NaNs"
        assert ulp_diff(got, want).max(initial=0) <= 1, f"{what}: {name} beyond one fp8 ulp"


@pytest.mark.parametrize("platform,impl", impl_params())
def test_jit_donation_updates_scale_caches_in_place(platform, impl):
    """A donated jit aliases the caches and the scale caches in and out and copies none of them
    (test_structure's check); the library's donating entry point consumes all four."""
    tc = TokenCase(Case(T=9, KH=2, D=64, NB=64, cache_dtype="float8_e4m3fn", layout="xpacked"))
    args, opts = _token_call(tc, seed=23)
    want = reference.rope_and_cache(*args, **opts)
    dev = jax.devices(platform)[0]
    ksc, vsc = opts.pop("k_scale_cache"), opts.pop("v_scale_cache")
    step = jax.jit(lambda *a: jrc.rope_and_cache(*a[:9], k_scale_cache=a[9], v_scale_cache=a[10], impl=impl, **opts),
                   donate_argnums=(3, 4, 9, 10))
    dargs = jax.device_put(args + (ksc, vsc), dev)
    compiled = step.lower(*dargs).compile()
    # widened: XLA's CPU compile of the fp8 XLA path holds about one cache of temp memory, with static
    # scales too (measured: 269164 B for a 262144 B stacked cache); still no copy of a cache
    text = check_in_place(compiled, [args[3].shape, args[4].shape, ksc.shape], args[3].nbytes,
                          widened=impl == "xla" and platform == "cpu")
    aliased = {int(p) for _, p in re.findall(r"\{(\d*)\}: \((\d+), \{\}, (?:may|must)-alias\)", text)}
    assert {9, 10} <= aliased, f"scale caches not aliased: {aliased}"
    check_results(impl, args, compiled(*dargs), want, "donated jit")
    ksc_d, vsc_d, kc, vc = jax.device_put((ksc, vsc, args[3], args[4]), dev)
    with jax.default_device(dev):
        out = jrc.rope_and_cache_donated(*args[:3], kc, vc, *args[5:], impl=impl, k_scale_cache=ksc_d,
                                         v_scale_cache=vsc_d, **opts)
    assert all(a.is_deleted() for a in (kc, vc, ksc_d, vsc_d))
    check_results(impl, args, out, want, "rope_and_cache_donated")


@pytest.mark.parametrize("platform,impl", impl_params())
@pytest.mark.parametrize("layout", ["flash", "head_major", "kv_merged"])
def test_refs_and_traced_layer_in_a_scan(platform, impl, layout):
    """jax.Ref caches and scale caches, written layer by layer by a scan: each layer as the reference
    (kv_merged: one ref for K and V, None for the value cache)."""
    tc = TokenCase(Case(T=9, KH=2, D=64, cache_dtype="float8_e4m3fnuz", layout=layout), layers=3)
    args, opts = _token_call(tc, seed=29)
    opts.pop("layer")
    dev = jax.devices(platform)[0]
    caches = [None if a is None else np.asarray(a)
              for a in (args[3], args[4], opts.pop("k_scale_cache"), opts.pop("v_scale_cache"))]
    want = list(caches)
    for layer in range(3):
        want = list(reference.rope_and_cache(*args[:3], want[0], want[1], *args[5:], layer=layer,
                                             k_scale_cache=want[2], v_scale_cache=want[3], **opts)[2:])
    refs = [None if c is None else jax.new_ref(jax.device_put(c, dev)) for c in caches]

    @jax.jit
    def run(refs):
        def body(layer, carry):
            jrc.rope_and_cache(*args[:3], refs[0], refs[1], *args[5:], layer=layer, k_scale_cache=refs[2],
                               v_scale_cache=refs[3], impl=impl, **opts)
            return carry
        jax.lax.fori_loop(0, 3, body, 0)

    with jax.default_device(dev):
        run(refs)
    names = contract.RESULTS[2:] + contract.TOKEN_SCALE_RESULTS
    for i in range(4):
        if want[i] is None:
            assert refs[i] is None
            continue
        check_cache(impl, names[i], refs[i][...], want[i], "refs in a scan")


@pytest.mark.parametrize("platform,impl", impl_params())
@pytest.mark.parametrize("layout", ["flash", "head_major", "kv_merged"])
def test_vmap_over_scale_caches(platform, impl, layout):
    tc = TokenCase(Case(T=5, KH=2, D=64, cache_dtype="float8_e4m3fn", layout=layout))
    calls = [_token_call(tc, seed=s) for s in (31, 37)]
    want = [reference.rope_and_cache(*a, **o) for a, o in calls]
    stack = lambda i: None if calls[0][0][i] is None else np.stack([a[i] for a, _ in calls])  # noqa: E731
    sstack = lambda n: np.stack([o[n] for _, o in calls])  # noqa: E731
    opts = {n: x for n, x in calls[0][1].items() if not n.endswith("_scale_cache")}
    fn = jax.vmap(lambda *a: jrc.rope_and_cache(*a[:9], k_scale_cache=a[9], v_scale_cache=a[10], impl=impl, **opts))
    with jax.default_device(jax.devices(platform)[0]):
        got = fn(*[stack(i) for i in range(9)], sstack("k_scale_cache"), sstack("v_scale_cache"))
    for b in range(2):
        # jax 0.11's CPU backend hands a batched result through a copy that makes a bf16 NaN 0x7FC0
        check_results(impl, calls[b][0], [None if g is None else g[b] for g in got], want[b], f"vmap[{b}]",
                      nan_bits=jax.__version_info__ >= (0, 12))


@pytest.mark.parametrize("impl", ["kernel", "xla"])
@pytest.mark.parametrize("layout", ["flash", "xpacked", "hnd", "head_major", "kv_merged"])
def test_shard_map_over_kv_heads_shards_the_scale_caches_too(impl, layout):
    """Tensor parallel over 4 host devices: the caches and the scale caches split on their KV-head
    axis (contract.CacheLayout.head_axis; kv_merged: contiguous (K, V) pairs of its 2*KH axis),
    each device quantizes its own heads' rows; the gathered result is the unsharded reference's."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    tp = 4
    tc = TokenCase(Case(T=7, QH=8, KH=4, D=64, NB=8, cache_dtype="float8_e4m3fn", layout=layout))
    args, opts = _token_call(tc, seed=47)
    want = reference.rope_and_cache(*args, **opts)
    devices = jax.devices("cpu")[:tp]
    mesh = jax.make_mesh((tp,), ("tp",), devices=devices)
    table = contract.LAYOUT_TABLE[layout]
    axis = lambda which: P(*([None] * table.head_axis(which) + ["tp"]))  # noqa: E731
    kspec, sspec, heads = axis("key"), axis("scale"), P(None, "tp")
    vspec = None if table.merged else axis("value")
    ksc, vsc = opts.pop("k_scale_cache"), opts.pop("v_scale_cache")
    in_specs = (heads, heads, heads, kspec, vspec, P(), P(), P(), P(), sspec, sspec)
    out_specs = (heads, heads, kspec, vspec, sspec, sspec)
    fn = jax.shard_map(lambda *a: jrc.rope_and_cache(*a[:9], k_scale_cache=a[9], v_scale_cache=a[10], impl=impl,
                                                     **opts), mesh=mesh, in_specs=in_specs, out_specs=out_specs)
    placed = [None if a is None else jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(args + (ksc, vsc), in_specs)]
    got = jax.jit(fn, donate_argnums=(3, 4, 9, 10))(*placed)
    check_results(impl, args, got, want, f"shard_map {layout}")
    assert got[2].sharding.is_equivalent_to(NamedSharding(mesh, kspec), args[3].ndim)
    assert got[4].sharding.is_equivalent_to(NamedSharding(mesh, sspec), 3)


# ---- read_kv and the allocator --------------------------------------------------------------------
@pytest.mark.parametrize("layout", contract.LAYOUTS)
def test_read_kv_dequantizes_like_the_reference(layout):
    tc = TokenCase(Case(T=9, KH=2, D=64, cache_dtype="float8_e5m2", layout=layout))
    args, opts = _token_call(tc, seed=41)
    out = reference.rope_and_cache(*args, **opts)
    scales = dict(k_scale_cache=out[4], v_scale_cache=out[5])
    want = reference.read_kv(out[2], out[3], args[5], layout=layout, **scales)
    vc = None if out[3] is None else jnp.asarray(out[3])
    got = jrc.read_kv(jnp.asarray(out[2]), vc, args[5], layout=layout, **scales)
    for g, w in zip(got, want):
        assert g.dtype == jnp.float32
        assert_values_equal(g, w, f"read_kv {layout}")
    ks = np.array([0.5, 3.0], F32)
    want = reference.read_kv(out[2], out[3], args[5], layout=layout, k_scale=ks, v_scale=0.125)
    got = jrc.read_kv(jnp.asarray(out[2]), vc, args[5], layout=layout, k_scale=ks, v_scale=0.125)
    for g, w in zip(got, want):
        assert_values_equal(g, w, f"read_kv static {layout}")


def assert_values_equal(got, want, what):
    """Every value bit for bit, a NaN where the reference has one (its payload is the device's:
    a GPU converts and multiplies NaNs to the canonical one, numpy keeps the payload)."""
    got, want = np.asarray(got), np.asarray(want)
    nan = np.isnan(want)
    assert (np.isnan(got) == nan).all(), f"{what}: NaN positions differ"
    assert_bits_equal(np.where(nan, 0, got), np.where(nan, 0, want), what)


def test_make_kv_scale_cache():
    k, v = jrc.make_kv_scale_cache(5, 16, 4)
    assert k.shape == v.shape == (5, 4, 16) and k.dtype == jnp.float32 and (np.asarray(k) == 1).all()
    k, _ = jrc.make_kv_scale_cache(5, 16, 4, num_layers=3)
    assert k.shape == (3, 5, 4, 16)
    with pytest.raises(ValueError, match="kv_heads: expected an integer >= 1, got 0"):
        jrc.make_kv_scale_cache(5, 16, 0)


def test_read_kv_scale_errors():
    kc, vc = (np.zeros((3, 16, 2, 64), ml_dtypes.float8_e4m3fn) for _ in range(2))
    slots = np.arange(4, dtype=np.int32)
    with pytest.raises(ValueError, match=r"^k_scale_cache: expected shape \[NB, KH, BS\] = \[3, 2, 16\], got \[3, 16, 2\]"):
        jrc.read_kv(kc, vc, slots, k_scale_cache=np.ones((3, 16, 2), F32), v_scale_cache=np.ones((3, 2, 16), F32))
    with pytest.raises(ValueError, match="^k_scale: expected None with per-token scales"):
        jrc.read_kv(kc, vc, slots, k_scale=1.0, k_scale_cache=np.ones((3, 2, 16), F32),
                    v_scale_cache=np.ones((3, 2, 16), F32))
    bf = np.zeros((3, 16, 2, 64), ml_dtypes.bfloat16)
    with pytest.raises(ValueError, match="^k_scale: scales apply to float8 caches only"):
        jrc.read_kv(bf, bf.copy(), slots, k_scale=1.0, v_scale=1.0)
    with pytest.raises(ValueError, match="^k_scale_cache: per-token scales apply to float8, int8 and int4 caches only"):
        jrc.read_kv(bf, bf.copy(), slots, k_scale_cache=np.ones((3, 2, 16), F32), v_scale_cache=np.ones((3, 2, 16), F32))
