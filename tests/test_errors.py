"""Bad input raises ValueError/TypeError at trace time naming the argument, the expectation and
what was given, for the jax API (every impl) and the numpy reference alike."""

from __future__ import annotations

import functools

import jax
import ml_dtypes
import numpy as np
import pytest

import jax_rope_cache as jrc
from jax_rope_cache import reference

BF16, FP8 = ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn
T, QH, KH, D, NB, BS = 4, 8, 2, 64, 3, 16


def _good():
    z = lambda *s, dt=BF16: np.ones(s, dt)  # noqa: E731  (values are irrelevant: errors come first)
    return dict(q=z(T, QH, D), k=z(T, KH, D), v=z(T, KH, D), key_cache=z(NB, BS, KH, D), value_cache=z(NB, BS, KH, D),
                slot_mapping=np.arange(T, dtype=np.int32), positions=np.arange(T, dtype=np.int32),
                cos=z(32, D // 2, dt=np.float32), sin=z(32, D // 2, dt=np.float32))


def _xpacked(dt=BF16, x=8, d=D):
    return dict(key_cache=np.ones((NB, KH, d // x, BS, x), dt), value_cache=np.ones((NB, KH, d, BS), dt))


def _merged(heads=2 * KH, layers=None, dt=BF16):
    """A kv_merged call: the one array [NB, BS, 2*KH, D] as key_cache, value_cache None."""
    lead = () if layers is None else (layers,)
    return dict(key_cache=np.ones(lead + (NB, BS, heads, D), dt), value_cache=None)


def _fp8(layers=None):
    lead = () if layers is None else (layers,)
    return dict(key_cache=np.ones(lead + (NB, BS, KH, D), FP8), value_cache=np.ones(lead + (NB, BS, KH, D), FP8))


# (id, argument overrides, option overrides, exception, substrings the message must contain)
BAD = [
    ("q-rank", dict(q=np.ones((T, QH * D), BF16)), {}, ValueError, ["q", "rank 3", "[4, 512]"]),
    ("q-dtype-int", dict(q=np.ones((T, QH, D), np.int32)), {}, TypeError, ["q", "bfloat16", "int32"]),
    ("q-dtype-f64", dict(q=np.ones((T, QH, D), np.float64)), {}, TypeError, ["q", "float64"]),
    ("k-dtype-mismatch", dict(k=np.ones((T, KH, D), np.float16)), {}, TypeError, ["k", "same as q", "float16"]),
    ("v-shape", dict(v=np.ones((T, KH + 1, D), BF16)), {}, ValueError, ["v", "[4, 2, 64]", "[4, 3, 64]"]),
    ("k-tokens", dict(k=np.ones((T + 1, KH, D), BF16)), {}, ValueError, ["k", "[4, 2, 64]", "[5, 2, 64]"]),
    ("heads-not-multiple", dict(q=np.ones((T, 7, D), BF16)), {}, ValueError, ["q", "multiple of KH=2", "QH=7"]),
    ("odd-head-dim", dict(q=np.ones((T, QH, 63), BF16), k=np.ones((T, KH, 63), BF16), v=np.ones((T, KH, 63), BF16)),
     {}, ValueError, ["q", "even head_dim", "D=63"]),
    ("rotary-odd", {}, dict(rotary_dim=31), ValueError, ["rotary_dim", "even", "31"]),
    ("rotary-too-large", {}, dict(rotary_dim=128), ValueError, ["rotary_dim", "D=64", "128"]),
    ("rotary-float", {}, dict(rotary_dim=32.0), TypeError, ["rotary_dim", "int", "float"]),
    ("table-width", dict(cos=np.ones((32, 20), np.float32), sin=np.ones((32, 20), np.float32)), {}, ValueError,
     ["cos", "'half' table form [max_pos, R/2] = [max_pos, 32]", "rotary_dim=64", "[32, 20]"]),
    ("table-width-partial", {}, dict(rotary_dim=16), ValueError,
     ["cos", "[max_pos, R/2] = [max_pos, 8]", "rotary_dim=16", "[32, 32]"]),
    # a width-R table is the full form only when said: else it may be a half table of a head twice as wide
    ("table-width-r-unsaid", dict(cos=np.ones((32, D), np.float32), sin=np.ones((32, D), np.float32)), {},
     ValueError, ["cos", "[max_pos, R/2] = [max_pos, 32]", "[32, 64]", "table_form='full'", "rotary_dim=128"]),
    ("table-full-given-half", {}, dict(table_form="full"), ValueError,
     ["cos", "'full' table form [max_pos, R] = [max_pos, 64]", "[32, 32]", "'half' form"]),
    ("table-form-unknown", {}, dict(table_form="Full"), ValueError, ["table_form", "'half', 'full'", "'Full'"]),
    ("sin-shape", dict(sin=np.ones((31, D // 2), np.float32)), {}, ValueError, ["sin", "[32, 32]", "[31, 32]"]),
    ("sin-dtype", dict(sin=np.ones((32, D // 2), np.float16)), {}, TypeError, ["sin", "float32", "float16"]),
    ("table-int", dict(cos=np.ones((32, D // 2), np.int32), sin=np.ones((32, D // 2), np.int32)), {}, TypeError,
     ["cos", "int32"]),
    ("table-rank", dict(cos=np.ones((32,), np.float32), sin=np.ones((32,), np.float32)), {}, ValueError,
     ["cos", "rank 2", "[32]"]),
    ("slots-float", dict(slot_mapping=np.zeros(T, np.float32)), {}, TypeError, ["slot_mapping", "int32 or int64", "float32"]),
    ("slots-length", dict(slot_mapping=np.zeros(T + 2, np.int32)), {}, ValueError, ["slot_mapping", "[4]", "[6]"]),
    ("positions-rank", dict(positions=np.zeros((T, 1), np.int32)), {}, ValueError, ["positions", "rank 1", "[4, 1]"]),
    ("positions-uint", dict(positions=np.zeros(T, np.uint32)), {}, TypeError, ["positions", "uint32"]),
    ("cache-dtype", dict(key_cache=np.ones((NB, BS, KH, D), np.float32), value_cache=np.ones((NB, BS, KH, D), np.float32)),
     {}, TypeError, ["key_cache", "bfloat16", "float8_e4m3fn", "float32"]),
    ("value-cache-dtype", dict(value_cache=np.ones((NB, BS, KH, D), np.float16)), {}, TypeError,
     ["value_cache", "same as key_cache", "float16"]),
    ("cache-heads", dict(key_cache=np.ones((NB, BS, KH + 1, D), BF16)), {}, ValueError,
     ["key_cache", "[NB, BS, KH, D]", "[3, 16, 2, 64]", "[3, 16, 3, 64]"]),
    ("cache-rank-for-layout", {}, dict(layout="xpacked"), ValueError, ["key_cache", "rank 5", "xpacked", "[3, 16, 2, 64]"]),
    ("value-cache-layout", dict(value_cache=np.ones((NB, BS, KH, D), BF16), key_cache=_xpacked()["key_cache"]),
     dict(layout="xpacked"), ValueError, ["value_cache", "[NB, KH, D, BS]", "[3, 2, 64, 16]", "[3, 16, 2, 64]"]),
    ("x-not-pow2", dict(key_cache=np.ones((NB, KH, 5, BS, 12), BF16)), dict(layout="xpacked"), ValueError,
     ["key_cache", "power of two", "last dim", "[3, 2, 5, 16, 12]"]),
    ("x-not-dividing-d", _xpacked(x=128, d=128), dict(layout="xpacked"), ValueError,
     ["key_cache", "D divisible by X=128", "D=64"]),
    ("x-value-cache-mismatch", dict(key_cache=np.ones((NB, KH, D // 4, BS, 4), BF16),
                                    value_cache=np.ones((NB, KH, BS // 8, D, 8), BF16)),
     dict(layout="xpacked_shuffled"), ValueError, ["value_cache", "[NB, KH, BS//X, D, X]", "[3, 2, 4, 64, 4]",
                                                   "[3, 2, 2, 64, 8]"]),
    ("hnd-shape", {}, dict(layout="hnd"), ValueError, ["key_cache", "[NB, KH, BS, D]", "hnd", "[3, 16, 2, 64]"]),
    ("shuffled-block", dict(key_cache=np.ones((NB, KH, D // 8, 12, 8), BF16), value_cache=np.ones((NB, KH, 1, D, 8), BF16)),
     dict(layout="xpacked_shuffled"), ValueError, ["value_cache", "divisible by X=8", "BS=12"]),
    ("shuffled-block-x4", dict(key_cache=np.ones((NB, KH, D // 4, 6, 4), BF16), value_cache=np.ones((NB, KH, 1, D, 4), BF16)),
     dict(layout="xpacked_shuffled"), ValueError, ["value_cache", "divisible by X=4", "BS=6"]),
    ("fp8-no-scale", dict(key_cache=np.ones((NB, BS, KH, D), FP8), value_cache=np.ones((NB, BS, KH, D), FP8)),
     dict(v_scale=1.0), ValueError, ["k_scale", "needs a scale", "None"]),
    ("scale-non-fp8", {}, dict(k_scale=0.5), ValueError, ["k_scale", "float8 caches only", "0.5"]),
    ("scale-shape", dict(key_cache=np.ones((NB, BS, KH, D), FP8), value_cache=np.ones((NB, BS, KH, D), FP8)),
     dict(k_scale=np.ones(3, np.float32), v_scale=1.0), TypeError, ["k_scale", "float scalar", "float32[3]"]),
    ("scale-per-head-rank2", dict(key_cache=np.ones((NB, BS, KH, D), FP8), value_cache=np.ones((NB, BS, KH, D), FP8)),
     dict(k_scale=1.0, v_scale=np.ones((KH, 1), np.float32)), TypeError, ["v_scale", "[KH] = (2,)", "float32[2, 1]"]),
    ("scale-per-head-non-fp8", {}, dict(k_scale=np.ones(KH, np.float32)), ValueError,
     ["k_scale", "float8 caches only", "float32[2]"]),
    # per-token scales: the scale caches
    ("scale-cache-non-fp8", {}, dict(k_scale_cache=np.ones((NB, KH, BS), np.float32),
                                     v_scale_cache=np.ones((NB, KH, BS), np.float32)), ValueError,
     ["k_scale_cache", "float8, int8 and int4 caches only", "bfloat16 cache", "float32[3, 2, 16]"]),
    ("scale-cache-and-static", _fp8(), dict(k_scale=1.0, k_scale_cache=np.ones((NB, KH, BS), np.float32),
                                            v_scale_cache=np.ones((NB, KH, BS), np.float32)), ValueError,
     ["k_scale", "None with per-token scales", "1.0"]),
    ("scale-cache-only-k", _fp8(), dict(k_scale_cache=np.ones((NB, KH, BS), np.float32)), ValueError,
     ["v_scale_cache", "both scale caches", "None"]),
    ("scale-cache-shape", _fp8(), dict(k_scale_cache=np.ones((NB, BS, KH), np.float32),
                                       v_scale_cache=np.ones((NB, KH, BS), np.float32)), ValueError,
     ["k_scale_cache", "[NB, KH, BS] = [3, 2, 16]", "[3, 16, 2]"]),
    ("scale-cache-dtype", _fp8(), dict(k_scale_cache=np.ones((NB, KH, BS), np.float32),
                                       v_scale_cache=np.ones((NB, KH, BS), BF16)), TypeError,
     ["v_scale_cache", "float32", "bfloat16"]),
    ("scale-cache-stacked-shape", _fp8(layers=2), dict(layer=1, k_scale_cache=np.ones((NB, KH, BS), np.float32),
                                                       v_scale_cache=np.ones((NB, KH, BS), np.float32)), ValueError,
     ["k_scale_cache", "rank 4 [L, NB, KH, BS]", "[3, 2, 16]"]),
    # the QK-RMSNorm weights and eps
    ("q-norm-weight-rotary-width", {}, dict(q_norm_weight=np.ones(D // 2, BF16)), ValueError,
     ["q_norm_weight", "[D] = [64]", "[32]"]),
    ("q-norm-weight-per-head", {}, dict(q_norm_weight=np.ones((QH, D), BF16)), ValueError,
     ["q_norm_weight", "[D] = [64]", "[8, 64]"]),
    ("k-norm-weight-f16", {}, dict(k_norm_weight=np.ones(D, np.float16)), TypeError,
     ["k_norm_weight", "bfloat16 or float32", "float16"]),
    ("k-norm-weight-f64", {}, dict(k_norm_weight=np.ones(D, np.float64)), TypeError, ["k_norm_weight", "float64"]),
    ("q-norm-weight-int", {}, dict(q_norm_weight=np.ones(D, np.int32)), TypeError, ["q_norm_weight", "int32"]),
    ("q-norm-weight-list", {}, dict(q_norm_weight=[1.0] * D), TypeError, ["q_norm_weight", "array", "list"]),
    ("norm-eps-zero", {}, dict(norm_eps=0.0), ValueError, ["norm_eps", "> 0", "0.0"]),
    ("norm-eps-negative", {}, dict(norm_eps=-1e-6, q_norm_weight=np.ones(D, BF16)), ValueError,
     ["norm_eps", "> 0", "-1e-06"]),
    ("norm-eps-nan", {}, dict(norm_eps=float("nan")), ValueError, ["norm_eps", "finite", "nan"]),
    ("norm-eps-inf", {}, dict(norm_eps=float("inf")), ValueError, ["norm_eps", "finite", "inf"]),
    ("norm-eps-f32-underflow", {}, dict(norm_eps=1e-50), ValueError, ["norm_eps", "as float32", "1e-50"]),
    ("norm-eps-f32-overflow", {}, dict(norm_eps=1e39), ValueError, ["norm_eps", "as float32", "1e+39"]),
    ("norm-eps-int", {}, dict(norm_eps=1), TypeError, ["norm_eps", "float", "1"]),
    ("norm-eps-str", {}, dict(norm_eps="1e-6"), TypeError, ["norm_eps", "float", "'1e-6'"]),
    ("norm-eps-bool", {}, dict(norm_eps=True), TypeError, ["norm_eps", "float", "bool"]),
    ("norm-eps-vector", {}, dict(norm_eps=np.ones(2, np.float32)), TypeError, ["norm_eps", "float32[2]"]),
    ("norm-eps-int-array", {}, dict(norm_eps=np.int32(1)), TypeError, ["norm_eps", "int32"]),
    # the layouts of JAX's Pallas kernels
    ("head-major-shape", {}, dict(layout="head_major"), ValueError,
     ["key_cache", "[KH, NB, BS, D]", "head_major", "[3, 16, 2, 64]"]),
    ("head-major-value-shape", dict(key_cache=np.ones((KH, NB, BS, D), BF16), value_cache=np.ones((NB, KH, BS, D), BF16)),
     dict(layout="head_major"), ValueError, ["value_cache", "[KH, NB, BS, D]", "[2, 3, 16, 64]", "[3, 2, 16, 64]"]),
    ("head-major-scale-cache-shape", dict(key_cache=np.ones((KH, NB, BS, D), FP8), value_cache=np.ones((KH, NB, BS, D), FP8)),
     dict(layout="head_major", k_scale_cache=np.ones((NB, KH, BS), np.float32),
          v_scale_cache=np.ones((KH, NB, BS), np.float32)), ValueError,
     ["k_scale_cache", "[KH, NB, BS] = [2, 3, 16]", "[3, 2, 16]"]),
    ("kv-merged-value-cache-given", dict(key_cache=np.ones((NB, BS, 2 * KH, D), BF16)), dict(layout="kv_merged"),
     ValueError, ["value_cache", "kv_merged", "one array", "expected None", "bfloat16[3, 16, 2, 64]"]),
    ("kv-merged-odd-heads", _merged(heads=2 * KH - 1), dict(layout="kv_merged"), ValueError,
     ["key_cache", "kv_merged", "even head axis 2*KH", "[3, 16, 3, 64]"]),
    ("kv-merged-heads", _merged(heads=2 * KH + 2), dict(layout="kv_merged"), ValueError,
     ["key_cache", "[NB, BS, 2*KH, D]", "[3, 16, 4, 64]", "[3, 16, 6, 64]"]),
    ("kv-merged-flash-shaped", dict(value_cache=None), dict(layout="kv_merged"), ValueError,
     ["key_cache", "[NB, BS, 2*KH, D]", "[3, 16, 4, 64]", "[3, 16, 2, 64]"]),
    ("kv-merged-stacked-rank", _merged(), dict(layout="kv_merged", layer=0), ValueError,
     ["key_cache", "rank 5", "[L, NB, BS, 2*KH, D]", "[3, 16, 4, 64]"]),
    ("value-cache-none", dict(value_cache=None), {}, ValueError, ["value_cache", "'flash' needs a value cache",
                                                                  "got None"]),
    ("unknown-layout", {}, dict(layout="paged"), ValueError, ["layout", "flash", "'paged'"]),
    ("unknown-precision", {}, dict(precision="bf16"), ValueError, ["precision", "fp32", "'bf16'"]),
    ("is-neox-str", {}, dict(is_neox="yes"), TypeError, ["is_neox", "bool", "str"]),
    ("not-an-array", dict(q=[[1.0]]), {}, TypeError, ["q", "array", "list"]),
]


def _call(fn, overrides, options):
    args = _good()
    args.update(overrides)
    return fn(*args.values(), **options)


def test_the_good_call_is_accepted():
    q_out, *_ = _call(reference.rope_and_cache, {}, {})
    assert q_out.shape == (T, QH, D)
    assert len(BAD) >= 20


# Not every entry sees every input: a Python list is no jit argument, jit turns float64 into float32
# (x64 off), and the numpy reference converts array-likes (a list becomes a float64 array).
EXCLUDED = {("api-jit", "not-an-array"), ("api-jit", "q-dtype-f64"), ("reference", "not-an-array")}
PARAMS = [pytest.param(entry, *b[1:], id=f"{entry}-{b[0]}") for entry in ("api", "api-jit", "reference") for b in BAD
          if (entry, b[0]) not in EXCLUDED]


@pytest.mark.parametrize("entry,overrides,options,exc,parts", PARAMS)
def test_bad_input_raises_a_clear_error(entry, overrides, options, exc, parts):
    if entry == "reference":
        fn = reference.rope_and_cache
    elif entry == "api":
        fn = jrc.rope_and_cache
    else:  # traced: the error comes at trace time, before any lowering
        static = {k: v for k, v in options.items() if k not in ("k_scale", "v_scale")}
        scales = {k: v for k, v in options.items() if k in ("k_scale", "v_scale")}
        fn = lambda *a, **_: jax.jit(lambda *b: jrc.rope_and_cache(*b, **static, **scales))(*a)  # noqa: E731
    with pytest.raises(exc) as err:
        _call(fn, overrides, options)
    msg = str(err.value)
    assert msg.split(":")[0] == parts[0], msg  # names the argument first
    for p in parts[1:]:
        assert p in msg, f"{p!r} not in {msg!r}"


def test_traced_norm_eps_is_refused():
    args = _good()
    with pytest.raises(TypeError, match=r"^norm_eps: expected a static float \(not a traced value\), got a float32\[\] "):
        jax.jit(lambda e: jrc.rope_and_cache(*args.values(), q_norm_weight=np.ones(D, BF16), norm_eps=e))(1e-6)


@pytest.mark.parametrize("bad", ["gpu", "triton", ""])
def test_unknown_impl(bad):
    with pytest.raises(ValueError, match="impl: expected one of"):
        _call(jrc.rope_and_cache, {}, dict(impl=bad))


def test_make_kv_cache_rejects_bad_arguments():
    with pytest.raises(ValueError, match="layout: expected one of"):
        jrc.make_kv_cache(2, 16, 1, 64, layout="paged")
    with pytest.raises(TypeError, match="dtype: expected one of .* got int16"):
        jrc.make_kv_cache(2, 16, 1, 64, np.int16)
    with pytest.raises(ValueError, match="head_dim: layout 'xpacked' with float8_e4m3fn needs a multiple of X=16, got 72"):
        jrc.make_kv_cache(2, 16, 1, 72, FP8, layout="xpacked")
    with pytest.raises(ValueError, match=r"x: expected X to be a power of two \(1, 2, 4, 8, ...\), got X=6"):
        jrc.make_kv_cache(2, 16, 1, 72, layout="xpacked", x=6)
    with pytest.raises(ValueError, match="x: layout 'xpacked' needs X to divide the head_dim D=72, got X=16"):
        jrc.make_kv_cache(2, 16, 1, 72, layout="xpacked", x=16)
    with pytest.raises(ValueError, match=r"x: layout 'xpacked_shuffled' needs X to divide the block size BS=16 "
                                         r"\(value cache \[NB, KH, BS//X, D, X\]\), got X=32"):
        jrc.make_kv_cache(2, 16, 1, 64, layout="xpacked_shuffled", x=32)
    with pytest.raises(ValueError, match="x: layout 'hnd' has no X .* expected None, got 8"):
        jrc.make_kv_cache(2, 16, 1, 64, layout="hnd", x=8)
    with pytest.raises(TypeError, match="x: expected an int .* got 8.0"):
        jrc.make_kv_cache(2, 16, 1, 64, layout="xpacked", x=8.0)


@pytest.mark.parametrize("impl", ["xla", "kernel", "reference"])
def test_tables_built_for_another_head_size_are_refused(impl):
    """Tables for head size 128 ([max_pos, 64], half form) given to a call with D = R = 64 have the
    width of a full table for R = 64: read as one, every rotation would be wrong. Refused unless the
    full form is said, and the said full form then gives the full-table result."""
    rng = np.random.default_rng(7)
    args = _good()
    args.update(q=rng.standard_normal((T, QH, D)).astype(BF16), k=rng.standard_normal((T, KH, D)).astype(BF16))
    cos, sin = jrc.rope_tables(32, 2 * D, base=10000.0)
    assert cos.shape == (32, D)
    args.update(cos=cos, sin=sin)
    fn = reference.rope_and_cache if impl == "reference" else functools.partial(jrc.rope_and_cache, impl=impl)
    with pytest.raises(ValueError, match=r"^cos: expected the 'half' table form .* got shape \[32, 64\].*"
                                         r"table_form='full'.*rotary_dim=128"):
        fn(*args.values())
    full_cos, full_sin = jrc.rope_tables(32, D, base=10000.0, form="full")
    args.update(cos=full_cos, sin=full_sin)
    got = fn(*args.values(), table_form="full")
    half_cos, half_sin = jrc.rope_tables(32, D, base=10000.0)
    args.update(cos=half_cos, sin=half_sin)
    want = reference.rope_and_cache(*args.values())
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g).view(np.uint16), w.view(np.uint16))
