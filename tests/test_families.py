"""The model-family options of rope_and_cache: NoPE calls (rotary_dim=0, positions and tables optional),
a traced per-layer rotation switch (use_rope), rotary channels at the tail (rotary_position="tail"),
the Gemma (1 + w) and weightless QK-norms, the norm after the rotation (Llama 4), Llama 4's attention
temperature, and gated q rows in the fused QKV input (Qwen3-Next).

1. The XLA path equals the reference bit for bit on fresh random data (caches pre-filled with
   random values, invalid slots and out-of-range positions mixed in), every option alone and combined.
2. The reference against independent float64 formulas of each family (transformers' arithmetic),
   within the stated bounds; a wrong variant (plain RMS weight for Gemma, no floor in the
   temperature, the head instead of the tail) is outside them.
3. The CPU handler implements every option, bit for bit against the reference (impl="kernel"; the
   switch, the temperature and q_gate: tests/test_cpu_families.py); the other native kernels refuse
   every family option (contract.FEATURES not in their SUPPORTS): impl="kernel" raises naming it,
   impl=None warns once and runs the XLA path.
4. A lax.scan over RoPE and NoPE layers is one compiled program (the switch is traced).
5. Contradictory options raise ValueError naming the arguments.
"""

from __future__ import annotations

import math
import re
import warnings
import zlib

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jax_rope_cache as jrc
from jax_rope_cache import backends, contract, reference
from jax_rope_cache.backends import cpu as cpu_backend
from jax_rope_cache.backends import native
from conftest import assert_bits_equal, assert_fma_close, platforms

BF16, F16, F32 = np.dtype(ml_dtypes.bfloat16), np.dtype(np.float16), np.dtype(np.float32)
EPS = {BF16: 2.0**-8, F16: 2.0**-11, F32: 2.0**-24}  # unit roundoff: one rounding moves x by <= EPS * |x|


def problem(dtype=BF16, *, T=9, QH=4, KH=2, D=64, R=32, NB=6, BS=8, layout="flash", seed=0, max_pos=96, table_w=None):
    """Fresh random inputs: caches pre-filled with random values, slots with -1 and past-the-end mixed
    in, positions partly out of range (negative, >= max_pos)."""
    rng = np.random.default_rng(seed)
    q, k, v = (rng.standard_normal((T, h, D)).astype(dtype) for h in (QH, KH, KH))
    kshape, vshape = contract.cache_shapes(layout, NB, BS, KH, D, dtype)
    kc = rng.standard_normal(kshape).astype(dtype)
    vc = None if vshape is None else rng.standard_normal(vshape).astype(dtype)  # kv_merged: one array
    slots = rng.permutation(NB * BS)[:T].astype(np.int32)
    slots[::4] = -1
    slots[1] = NB * BS
    pos = rng.integers(0, max_pos, T).astype(np.int32)
    pos[2], pos[3] = -5, max_pos + 40
    ang = rng.uniform(-np.pi, np.pi, (max_pos, (table_w if table_w is not None else max(R, 2) // 2)))
    cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    return (q, k, v, kc, vc, slots, pos, cos, sin), rng


def run(args, opts, impl="xla", platform="cpu", traced=("q_norm_weight", "k_norm_weight", "use_rope")):
    """The op jitted on `platform`, the weights and the switch traced arguments."""
    arrays = {n: opts[n] for n in traced if opts.get(n) is not None}
    static = {n: v for n, v in opts.items() if n not in arrays}
    fn = jax.jit(lambda a, kw: jrc.rope_and_cache(*a, **kw, **static, impl=impl))
    dev = jax.devices(platform)[0]
    return [np.asarray(o) for o in fn(jax.device_put(args, dev), jax.device_put(arrays, dev))]


def check_equal(got, want, what):
    for name, g, w in zip(("q_out", "k_out", "key_cache", "value_cache"), got, want):
        assert_bits_equal(g, w, f"{name} [{what}]")


def check_xla(got, want, what, rotates: bool, ulps: int = 1):
    """The XLA path: bit for bit where nothing rotates (copies, norms, the temperature: XLA cannot
    contract them, backends/xla.py); where q and k rotate, within tests/test_op.py's FMA bound (XLA
    may contract a product into the difference), here 2 float32 ulps of the row's largest output.
    A norm after the rotation rescales a value the FMA moved one ulp: `ulps` = 2 there (measured:
    2 ulps in 5 of 300 seeds of the f16 case, never more)."""
    if not rotates:
        return check_equal(got, want, what)
    rowmax = lambda a: np.abs(a.astype(np.float32)).max(axis=-1, keepdims=True)  # noqa: E731
    bounds = (2.0**-21 * rowmax(want[0]), 2.0**-21 * rowmax(want[1]),
              2.0**-21 * float(np.abs(want[1].astype(np.float32)).max()), 0.0)
    for name, g, w, b in zip(("q_out", "k_out", "key_cache", "value_cache"), got, want, bounds):
        if name == "value_cache":
            assert_bits_equal(g, w, f"{name} [{what}]")
        else:
            assert_fma_close(g, w, b, f"{name} [{what}]", ulps)


def _weights(rng, D, dtype):
    return (rng.standard_normal(D) * 0.7).astype(dtype), (rng.standard_normal(D) * 0.7).astype(dtype)


def family_cases():
    """(id, options builder(rng, D, dtype), table width override): every option alone, then the
    combinations models use."""
    def w(kind, **extra):
        def make(rng, D, dt):
            qw, kw = _weights(rng, D, dt)
            return dict(q_norm_weight=qw, k_norm_weight=kw, norm_type=kind, **extra)
        return make
    return [
        ("nope", lambda rng, D, dt: dict(rotary_dim=0), None),
        ("nope-rms-norm", lambda rng, D, dt: dict(rotary_dim=0, q_norm_weight=_weights(rng, D, dt)[0]), None),
        ("tail-neox", lambda rng, D, dt: dict(rotary_dim=32, rotary_position="tail"), None),
        ("tail-gptj", lambda rng, D, dt: dict(rotary_dim=32, rotary_position="tail", is_neox=False), None),
        ("tail-full-table", lambda rng, D, dt: dict(rotary_dim=32, rotary_position="tail", table_form="full"), 32),
        ("gemma", w("gemma", rotary_dim=32), None),
        ("gemma-k-only", lambda rng, D, dt: dict(rotary_dim=32, norm_type="gemma", k_norm_weight=_weights(rng, D, dt)[1]),
         None),
        ("gemma-f32-weight", lambda rng, D, dt: dict(
            rotary_dim=32, norm_type="gemma", q_norm_weight=_weights(rng, D, np.float32)[0]), None),
        ("weightless-before", lambda rng, D, dt: dict(rotary_dim=32, norm_type="weightless"), None),
        ("weightless-after-gptj", lambda rng, D, dt: dict(rotary_dim=32, norm_type="weightless",
                                                          norm_position="after", is_neox=False), None),
        ("rms-after", w("rms", rotary_dim=32, norm_position="after"), None),
        ("gemma-tail-after", w("gemma", rotary_dim=32, norm_position="after", rotary_position="tail"), None),
        ("nope-temperature", lambda rng, D, dt: dict(rotary_dim=0, attn_temperature=(8, 0.1)), 7),
        ("switch-on", lambda rng, D, dt: dict(rotary_dim=32, use_rope=np.bool_(True)), None),
        ("switch-off", lambda rng, D, dt: dict(rotary_dim=32, use_rope=np.bool_(False)), None),
        ("llama4-rope-layer", lambda rng, D, dt: dict(rotary_dim=32, is_neox=False, norm_type="weightless",
                                                      norm_position="after", attn_temperature=(8, 0.1),
                                                      use_rope=np.int32(1)), None),
        ("llama4-nope-layer", lambda rng, D, dt: dict(rotary_dim=32, is_neox=False, norm_type="weightless",
                                                      norm_position="after", attn_temperature=(8, 0.1),
                                                      use_rope=np.int32(0)), None),
    ]


CASES = family_cases()


@pytest.mark.parametrize("dtype", [BF16, F16, F32], ids=["bf16", "f16", "f32"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_xla_path_equals_the_reference(case, dtype):
    name, make, width = case
    args, rng = problem(dtype, seed=zlib.crc32(name.encode()) % 1000, table_w=width)  # the same every run
    opts = make(rng, args[0].shape[2], dtype)
    want = reference.rope_and_cache(*args, **opts)
    rotates = opts.get("rotary_dim") != 0 and bool(opts.get("use_rope", True))
    check_xla(run(args, opts), want, name, rotates, ulps=2 if opts.get("norm_position") == "after" else 1)
    if opts.get("rotary_dim") == 0 and opts.get("attn_temperature") is None:  # no positions or tables needed
        check_equal(run(args[:6] + (None, None, None), opts), want, name + " without positions and tables")


@pytest.mark.parametrize("layout", ["xpacked_shuffled", "hnd"])
def test_other_layouts_and_fp8_caches(layout):
    args, rng = problem(BF16, layout=layout, seed=7)
    kc, vc = (a.astype(ml_dtypes.float8_e4m3fn) for a in args[3:5])
    args = args[:3] + (kc, vc) + args[5:]
    opts = dict(rotary_dim=32, rotary_position="tail", norm_type="weightless", norm_position="after",
                use_rope=np.bool_(False), attn_temperature=(4, 0.5), layout=layout, k_scale=0.3, v_scale=0.2)
    for on in (False, True):
        opts["use_rope"] = np.bool_(on)
        want = reference.rope_and_cache(*args, **opts)
        got = run(args, opts)
        check_xla(got[:2] + [want[2], want[3]], want, f"{layout} use_rope={on}", on)
        if not on:  # fp8 bytes: equal where nothing rotates
            check_equal(got, want, f"{layout} use_rope={on}")
        else:  # a k value one FMA ulp apart may quantize one fp8 step apart
            d = np.abs(got[2].astype(np.float32) - want[2].astype(np.float32))
            assert (d <= np.abs(want[2].astype(np.float32)) * 2.0**-3 + 2.0**-9).all()
            assert_bits_equal(got[3], want[3], "value cache")


def test_switch_keeps_nan_payloads_and_special_values():
    """The switch selects bit patterns: a NaN with a payload passes through a NoPE call unchanged."""
    args, rng = problem(BF16, seed=3)
    q = args[0].copy()
    q.view(np.uint16)[0, 0, :4] = (0x7FC1, 0xFFC3, 0x7F81, 0x0001)
    args = (q,) + args[1:]
    for on in (0, 1):
        opts = dict(rotary_dim=32, use_rope=np.int32(on))
        got, want = run(args, opts), reference.rope_and_cache(*args, **opts)
        check_xla(got, want, f"special values use_rope={on}", bool(on))
        assert_bits_equal(got[0][0, 0, :4], want[0][0, 0, :4], "special values")  # channel < 32: rotated or not


def test_gated_qkv_rows_read_in_place():
    """Qwen3-Next's q_proj output: per q head [q_h (D), gate_h (D)]; the op reads q at heads 2h and
    leaves the gates for the model to read from the same tensor."""
    rng = np.random.default_rng(11)
    T, QH, KH, D = 6, 4, 2, 64
    qkv = rng.standard_normal((T, (2 * QH + 2 * KH) * D)).astype(BF16)
    args, _ = problem(BF16, T=T, QH=QH, KH=KH, D=D, R=16, seed=11)
    kc, vc, slots, pos, cos, sin = args[3:]
    w = _weights(rng, D, BF16)
    opts = dict(num_q_heads=QH, num_kv_heads=KH, q_gate=True, rotary_dim=16, norm_type="gemma",
                q_norm_weight=w[0], k_norm_weight=w[1])
    want = reference.rope_and_cache_qkv(qkv, kc, vc, slots, pos, cos, sin, **opts)
    # the layout itself, written out: q head h is row chunk 2h, k head j is 2 QH + j, v head j 2 QH + KH + j
    heads = qkv.reshape(T, 2 * QH + 2 * KH, D)
    split = dict(opts)
    for n in ("num_q_heads", "num_kv_heads", "q_gate"):
        split.pop(n)
    direct = reference.rope_and_cache(heads[:, 0:2 * QH:2], heads[:, 2 * QH:2 * QH + KH], heads[:, 2 * QH + KH:],
                                      kc, vc, slots, pos, cos, sin, **split)
    check_equal(want, direct, "gated rows vs explicit heads")
    step = jax.jit(lambda x, kc, vc: jrc.rope_and_cache_qkv(x, kc, vc, slots, pos, cos, sin, impl="xla", **opts))
    check_xla(step(qkv, kc, vc), want, "xla gated qkv", True)


# ---- against independent float64 formulas (transformers' arithmetic) --------------------------------------
def _f64(x):
    return np.asarray(x).astype(np.float64)


def _rope64(x, pos, cos, sin, R, offset, neox):
    """The rotation in float64 of channels [offset, offset + R) with the half tables' rows."""
    x = _f64(x).copy()
    p = np.clip(pos, 0, cos.shape[0] - 1)
    c, s = _f64(cos)[p][:, None, :], _f64(sin)[p][:, None, :]
    i = np.arange(R // 2)
    a, b = (offset + i, offset + i + R // 2) if neox else (offset + 2 * i, offset + 2 * i + 1)
    xa, xb = x[..., a].copy(), x[..., b].copy()
    x[..., a], x[..., b] = xa * c - xb * s, xb * c + xa * s
    return x


def _norm64(x, w, eps, kind):
    x = _f64(x)
    n = x / np.sqrt((x * x).mean(-1, keepdims=True) + eps)
    if kind == "gemma":
        return n * (1.0 + _f64(w))
    return n if kind == "weightless" else n * _f64(w)


def _close(got, want64, dtype, ulps, what, scale=None):
    """|got - want| <= ulps * eps(dtype) * (|want| or the row's max |value|)."""
    got = _f64(got)
    ref = np.abs(want64) if scale is None else scale
    err = np.abs(got - want64)
    ok = err <= ulps * EPS[np.dtype(dtype)] * np.maximum(ref, 1e-30)
    assert ok.all(), f"{what}: {int((~ok).sum())} of {ok.size} beyond {ulps} ulp, max err {err.max()}"


@pytest.mark.parametrize("dtype", [BF16, F32], ids=["bf16", "f32"])
def test_reference_against_float64_formulas(dtype):
    args, rng = problem(dtype, seed=21, D=64, R=32)
    q, k, v, kc, vc, slots, pos, cos, sin = args
    D, R = 64, 32
    qw, kw = _weights(rng, D, dtype)
    eps = 1e-6
    row = lambda a: np.abs(a).max(-1, keepdims=True)  # noqa: E731

    # tail rotation: channels [0, D - R) are copied bit for bit, [D - R, D) rotate
    out = reference.rope_and_cache(*args, rotary_dim=R, rotary_position="tail")
    assert_bits_equal(out[0][..., :D - R], q[..., :D - R], "tail: pass-through head channels")
    _close(out[0], _rope64(q, pos, cos, sin, R, D - R, True), dtype, 2.02, "tail rotation", row(_f64(q)))
    head = _rope64(q, pos, cos, sin, R, 0, True)
    assert np.abs(_f64(out[0]) - head).max() > 0.1, "the tail rotation must differ from the head rotation"

    # Gemma (1 + w): one rounding of x * inv * (1 + w)
    out = reference.rope_and_cache(*args, rotary_dim=R, q_norm_weight=qw, k_norm_weight=kw, norm_type="gemma",
                                   norm_eps=eps)
    want = _rope64(_norm64(q, qw, eps, "gemma"), pos, cos, sin, R, 0, True)
    scale = row(np.abs(_norm64(q, qw, eps, "gemma")))
    _close(out[0], want, dtype, 5.0, "gemma norm then rotation", scale)
    plain = _rope64(_norm64(q, qw, eps, "rms"), pos, cos, sin, R, 0, True)
    assert np.abs(_f64(out[0]) - plain).max() > 0.1, "(1 + w) must differ from w"

    # weightless norm after a GPT-J rotation (Llama 4): rotate, round, normalise
    out = reference.rope_and_cache(*args, rotary_dim=R, is_neox=False, norm_type="weightless",
                                   norm_position="after", norm_eps=eps)
    rot = reference.to_dtype(_rope64(q, pos, cos, sin, R, 0, False).astype(np.float32), dtype)
    # one rounding to the dtype, plus the float32 sum of squares, sqrt and division (a few float32 ulps)
    # (float32: the rotation's own roundings, 2 ulps of the row, carry through; rot here is exact)
    want = _norm64(rot, None, eps, "weightless")
    _close(out[0], want, dtype, 1.02 + 8 * 2.0**-24 / EPS[np.dtype(dtype)], "weightless norm after the rotation",
           np.abs(want) if dtype != F32 else row(np.abs(want)))
    # k in the cache is the normalised, rotated k_out (flash: [NB, BS, KH, D])
    valid = (slots >= 0) & (slots < kc.shape[0] * kc.shape[1])
    got_k = out[2].reshape(-1, k.shape[1], D)[slots[valid]]
    assert_bits_equal(got_k, out[1][valid], "key cache holds the normalised k_out")

    # temperature on a NoPE call: 1 + attn_scale * log1p(floor((p + 1) / floor_scale)), p clamped
    fs, scale_t = 8, 0.1
    out = reference.rope_and_cache(*args, rotary_dim=0, attn_temperature=(fs, scale_t))
    p = np.clip(pos, 0, cos.shape[0] - 1)
    f = 1.0 + scale_t * np.log1p(np.floor((p + 1.0) / fs))
    _close(out[0], _f64(q) * f[:, None, None], dtype, 1.01 + 3 * (2.0**-24) / EPS[np.dtype(dtype)],
           "temperature", np.abs(_f64(q) * f[:, None, None]))
    no_floor = 1.0 + scale_t * np.log1p((p + 1.0) / fs)
    assert np.abs(_f64(out[0]) - _f64(q) * no_floor[:, None, None]).max() > 1e-3, "the floor must show"
    assert_bits_equal(out[1], k, "temperature leaves k alone")


def test_temperature_factors_match_transformers_float32_steps():
    """transformers: log1p(floor((p + 1) / floor_scale)) * attn_scale + 1.0 in float32 ops; the table
    is those steps with log1p correctly rounded (float64, then float32)."""
    f = reference.temperature_factors(10_000_000, 8192, 0.1)
    n = np.arange(f.size, dtype=np.float64)
    assert f.dtype == np.float32 and f.size == 10_000_000 // 8192 + 1 and f[0] == 1.0
    exact = 1.0 + 0.1 * np.log1p(n)
    assert np.abs(f - exact).max() <= 2 * np.spacing(np.float32(exact.max()))
    steps = (np.log1p(n).astype(np.float32) * np.float32(0.1)) + np.float32(1.0)
    assert np.array_equal(f, steps)


# ---- the CPU handler: the family options it implements, bit for bit ----------------------------------------
FAMILY = tuple(f for f in contract.FEATURES if f not in contract.BASE_FEATURES + contract.CACHE_FORMAT_FEATURES)
needs_cpu_kernel = pytest.mark.skipif("cpu" not in backends.kernel_platforms(), reason="no CPU kernel here")


def test_every_family_option_is_a_feature_and_the_kernels_implement_theirs():
    assert set(FAMILY) == {"nope", "rope_switch", "rotary_tail", "gemma_norm", "weightless_norm", "norm_after",
                           "temperature", "q_gate"}
    for name, backend in backends.KERNEL_BACKENDS.items():
        assert set(FAMILY) <= set(backend.SUPPORTS), name  # every kernel implements every family option
    for f in FAMILY:
        assert f in contract.FEATURE_NAMES


KERNEL_CASES = CASES


@needs_cpu_kernel
@pytest.mark.parametrize("precision", ["fp32", "native"])
@pytest.mark.parametrize("dtype", [BF16, F16, F32], ids=["bf16", "f16", "f32"])
@pytest.mark.parametrize("case", KERNEL_CASES, ids=[c[0] for c in KERNEL_CASES])
def test_cpu_kernel_equals_the_reference(case, dtype, precision):
    name, make, width = case
    args, rng = problem(dtype, seed=(zlib.crc32(name.encode()) + 1) % 1000, table_w=width)
    opts = dict(make(rng, args[0].shape[2], dtype), precision=precision)
    assert contract.features(contract.check_op(*args, **opts)) & set(FAMILY)
    want = reference.rope_and_cache(*args, **opts)
    check_equal(run(args, opts, impl="kernel"), want, f"{name} {precision}")
    if opts.get("rotary_dim") == 0 and opts.get("attn_temperature") is None:  # placeholders the handler never reads
        check_equal(run(args[:6] + (None, None, None), opts, impl="kernel"), want, name + " without positions and tables")


@needs_cpu_kernel
@pytest.mark.parametrize("layout,cdt", [("xpacked_shuffled", ml_dtypes.float8_e4m3fn), ("hnd", ml_dtypes.float8_e5m2),
                                        ("kv_merged", None), ("head_major", ml_dtypes.float8_e4m3fnuz)])
@pytest.mark.parametrize("opts", [
    dict(rotary_dim=32, rotary_position="tail", norm_type="weightless", norm_position="after"),
    dict(rotary_dim=16, rotary_position="tail", norm_type="gemma", is_neox=False),
    dict(rotary_dim=0, norm_type="weightless"),
], ids=["tail-weightless-after", "tail-gemma-gptj", "nope-weightless"])
def test_cpu_kernel_layouts_fp8_and_stacked_caches(layout, cdt, opts):
    """fp8 caches in "fused" native arithmetic (bf16 inputs, float32 tables: the cache quantizes the
    rotation's float32 values, but the normalised k_out after a norm "after"), stacked layers."""
    args, rng = problem(BF16, layout=layout, seed=31, R=opts["rotary_dim"])
    kc, vc = (None if a is None else np.stack([a, a[::-1]]) for a in args[3:5])
    if cdt is not None:
        kc, vc = kc.astype(cdt), None if vc is None else vc.astype(cdt)
    args = args[:3] + (kc, vc) + args[5:]
    opts = dict(opts, layout=layout, precision="native", layer=1)
    if opts.get("norm_type") == "gemma":
        opts["q_norm_weight"], opts["k_norm_weight"] = _weights(rng, 64, BF16)
    if cdt is not None:
        opts.update(k_scale=np.float32(0.3), v_scale=rng.uniform(0.1, 1, 2).astype(np.float32))
    want = reference.rope_and_cache(*args, **opts)
    got = jrc.rope_and_cache(*args, impl="kernel", **opts)
    for n, g, w in zip(("q_out", "k_out", "key_cache", "value_cache"), got, want):
        if w is not None:
            assert_bits_equal(np.asarray(g), w, f"{n} [{layout}]")


@needs_cpu_kernel
def test_cpu_kernel_fused_qkv_with_family_options():
    rng = np.random.default_rng(41)
    T, QH, KH, D = 7, 4, 2, 64
    qkv = rng.standard_normal((T, (QH + 2 * KH) * D)).astype(F16)
    args, _ = problem(F16, T=T, QH=QH, KH=KH, D=D, R=24, seed=41)
    w = _weights(rng, D, np.float32)
    opts = dict(num_q_heads=QH, num_kv_heads=KH, rotary_dim=24, rotary_position="tail", norm_type="gemma",
                norm_position="after", q_norm_weight=w[0], k_norm_weight=w[1])
    want = reference.rope_and_cache_qkv(qkv, *args[3:], **opts)
    got = jrc.rope_and_cache_qkv(qkv, *args[3:], impl="kernel", **opts)
    check_equal([np.asarray(g) for g in got], want, "fused qkv")


def _spec_using(feature):
    args, rng = problem(BF16, seed=5)
    D = args[0].shape[2]
    opts = {"nope": dict(rotary_dim=0), "rope_switch": dict(rotary_dim=32, use_rope=np.bool_(True)),
            "rotary_tail": dict(rotary_dim=32, rotary_position="tail"),
            "gemma_norm": dict(rotary_dim=32, norm_type="gemma", q_norm_weight=np.ones(D, BF16)),
            "weightless_norm": dict(rotary_dim=32, norm_type="weightless"),
            "norm_after": dict(rotary_dim=32, norm_type="weightless", norm_position="after"),
            "temperature": dict(rotary_dim=0, attn_temperature=(8, 0.1))}[feature]
    return args, opts


@pytest.mark.parametrize("feature", [f for f in FAMILY if f != "q_gate"])
def test_a_kernel_without_the_option_refuses_and_none_falls_back(feature, monkeypatch):
    """Every kernel implements the option; one that did not (the CPU handler with it taken out of its
    SUPPORTS) refuses with impl="kernel", and impl=None runs the XLA path with one warning."""
    args, opts = _spec_using(feature)
    spec = contract.check_op(*args, **opts)
    assert feature in contract.features(spec)
    for backend in backends.KERNEL_BACKENDS.values():
        native.refuse_unsupported(spec, backend.SUPPORTS, backend.NAME)  # implemented: no refusal
    monkeypatch.setattr(cpu_backend, "SUPPORTS", cpu_backend.SUPPORTS - {feature})
    with pytest.raises(native.KernelUnavailable, match="does not implement"):
        native.refuse_unsupported(spec, cpu_backend.SUPPORTS, cpu_backend.NAME)
    if "cpu" not in backends.kernel_platforms():
        return
    with pytest.raises(NotImplementedError, match=r"impl='kernel' on CPU.*" + re.escape(contract.FEATURE_NAMES[feature])):
        run(args, opts, impl="kernel")
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        got = run(args, opts, impl=None)
    assert sum("falling back to the XLA implementation" in str(x.message) for x in w) == 1
    check_equal(got, run(args, opts, impl="xla"), f"impl=None fallback [{feature}]")


@needs_cpu_kernel
def test_gated_qkv_runs_in_the_cpu_kernel():
    rng = np.random.default_rng(2)
    T, QH, KH, D = 3, 2, 1, 32
    qkv = rng.standard_normal((T, (2 * QH + 2 * KH) * D)).astype(np.float32)
    kc, vc = (rng.standard_normal((4, 4, KH, D)).astype(np.float32) for _ in "kv")
    cos, sin = jrc.rope_tables(16, D, base=1e4)
    slots, pos = np.arange(T, dtype=np.int32), np.arange(T, dtype=np.int32)
    with jax.default_device(jax.devices("cpu")[0]):  # the CPU handler reads the q heads of the gated rows
        got = jrc.rope_and_cache_qkv(qkv, kc, vc, slots, pos, cos, sin, num_q_heads=QH, num_kv_heads=KH, q_gate=True,
                                     impl="kernel")
        plain = jrc.rope_and_cache_qkv(qkv[:, :(2 * QH + 2 * KH - QH) * D], kc, vc, slots, pos, cos, sin,
                                       num_q_heads=QH, num_kv_heads=KH, impl="kernel")  # no gate
    want = reference.rope_and_cache_qkv(qkv, kc, vc, slots, pos, cos, sin, num_q_heads=QH, num_kv_heads=KH,
                                        q_gate=True)
    check_equal([np.asarray(g) for g in got], want, "gated rows in the CPU kernel")
    assert plain[0].shape == (T, QH, D)


# ---- one compiled program for a scan over RoPE and NoPE layers ------------------------------------------
@pytest.mark.parametrize("platform", platforms()[:1])
def test_scan_over_rope_and_nope_layers_is_one_program(platform):
    """Llama 4's pattern (every fourth layer NoPE with temperature, the others rotate and normalise
    after): a traced use_rope = rope_layers[i] in lax.scan; every layer equals the reference."""
    L = 4
    args, rng = problem(BF16, seed=13)
    q, k, v, kc, vc, slots, pos, cos, sin = args
    kcs, vcs = (np.stack([c] * L) + np.arange(L, dtype=np.float32).reshape(-1, 1, 1, 1, 1).astype(BF16)
                for c in (kc, vc))
    rope_layers = np.array([1, 1, 1, 0], np.int32)
    opts = dict(rotary_dim=32, is_neox=False, norm_type="weightless", norm_position="after",
                attn_temperature=(8, 0.1))

    @jax.jit
    def layers(kcs, vcs, mask):
        def body(caches, i):
            qo, ko, kc, vc = jrc.rope_and_cache(q, k, v, *caches, slots, pos, cos, sin, layer=i,
                                                use_rope=mask[i], impl="xla", **opts)
            return (kc, vc), (qo, ko)
        return jax.lax.scan(body, (kcs, vcs), jnp.arange(L))

    (got_k, got_v), (qos, kos) = layers(kcs, vcs, rope_layers)
    text = layers.lower(kcs, vcs, rope_layers).as_text()
    assert text.count("stablehlo.while") == 1
    ref_k, ref_v = kcs, vcs
    for i in range(L):
        want = reference.rope_and_cache(q, k, v, ref_k, ref_v, slots, pos, cos, sin, layer=i,
                                        use_rope=bool(rope_layers[i]), **opts)
        assert_bits_equal(qos[i], want[0], f"q_out layer {i}")
        assert_bits_equal(kos[i], want[1], f"k_out layer {i}")
        ref_k, ref_v = want[2], want[3]
    assert_bits_equal(got_k, ref_k, "key caches")
    assert_bits_equal(got_v, ref_v, "value caches")
    # the NoPE layer differs from the RoPE layers: temperature on q, no rotation, no norm
    assert not np.array_equal(np.asarray(qos[3]), np.asarray(qos[2]))


# ---- contradictory options ------------------------------------------------------------------------------
BAD = [
    ("tail-with-nope", dict(rotary_dim=0, rotary_position="tail"), ValueError, ["rotary_position", "rotary_dim=0"]),
    ("unknown-position", dict(rotary_position="middle"), ValueError, ["rotary_position", "'middle'"]),
    ("gemma-without-weight", dict(norm_type="gemma"), ValueError, ["norm_type", "'gemma'", "q_norm_weight"]),
    ("weightless-with-weight", dict(norm_type="weightless", k_norm_weight=np.ones(64, BF16)), ValueError,
     ["k_norm_weight", "weightless", "None"]),
    ("unknown-norm", dict(norm_type="layer"), ValueError, ["norm_type", "'layer'"]),
    ("after-without-norm", dict(norm_position="after"), ValueError, ["norm_position", "'after'"]),
    ("after-on-nope", dict(rotary_dim=0, norm_type="weightless", norm_position="after"), ValueError,
     ["norm_position", "rotary_dim=0"]),
    ("temperature-on-rope", dict(attn_temperature=(8, 0.1)), ValueError, ["attn_temperature", "rotary_dim=32"]),
    ("temperature-without-positions", dict(rotary_dim=0, attn_temperature=(8, 0.1), positions=None), ValueError,
     ["positions", "attn_temperature", "None"]),
    ("temperature-without-tables", dict(rotary_dim=0, attn_temperature=(8, 0.1), cos=None, sin=None), ValueError,
     ["cos", "attn_temperature"]),
    ("temperature-bad-floor", dict(rotary_dim=0, attn_temperature=(0.5, 0.1)), ValueError,
     ["attn_temperature", "floor_scale"]),
    ("temperature-not-pair", dict(rotary_dim=0, attn_temperature=8), TypeError, ["attn_temperature"]),
    ("switch-on-nope", dict(rotary_dim=0, use_rope=True), ValueError, ["use_rope", "rotary_dim=0"]),
    ("switch-not-scalar", dict(use_rope=np.ones(2, np.int32)), TypeError, ["use_rope", "int32[2]"]),
    ("positions-none-with-rotation", dict(positions=None), TypeError, ["positions"]),
    ("one-table-none", dict(rotary_dim=0, sin=None), ValueError, ["sin", "cos"]),
    ("nope-odd", dict(rotary_dim=-2), ValueError, ["rotary_dim", "[0, D=64]"]),
]


@pytest.mark.parametrize("bad", BAD, ids=[b[0] for b in BAD])
@pytest.mark.parametrize("fn", ["op", "reference"])
def test_contradictory_options_name_the_arguments(bad, fn):
    _, opts, exc, words = bad
    args, _ = problem(BF16, seed=1)
    names = ("q", "k", "v", "key_cache", "value_cache", "slot_mapping", "positions", "cos", "sin")
    call = dict(zip(names, args), rotary_dim=32)
    call.update(opts)
    positional = [call.pop(n) for n in names]
    op = jrc.rope_and_cache if fn == "op" else reference.rope_and_cache
    with pytest.raises(exc) as e:
        op(*positional, impl="xla", **call) if fn == "op" else op(*positional, **call)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_gated_qkv_shape_errors_name_the_gate():
    qkv = np.zeros((3, (2 + 2) * 32), np.float32)  # QH=2, KH=1 without the gate
    kc, vc = (np.zeros((4, 4, 1, 32), np.float32) for _ in "kv")
    cos, sin = jrc.rope_tables(16, 32, base=1e4)
    with pytest.raises(ValueError, match=r"2 QH \+ 2 KH.*q_gate"):
        jrc.rope_and_cache_qkv(qkv, kc, vc, np.zeros(3, np.int32), np.zeros(3, np.int32), cos, sin,
                               num_q_heads=2, num_kv_heads=1, q_gate=True)
    with pytest.raises(TypeError, match="q_gate: expected a Python bool"):
        jrc.rope_and_cache_qkv(qkv, kc, vc, np.zeros(3, np.int32), np.zeros(3, np.int32), cos, sin,
                               num_q_heads=2, num_kv_heads=1, q_gate="yes")


def test_donated_entry_point_takes_the_family_options():
    args, rng = problem(BF16, seed=17)
    opts = dict(rotary_dim=32, use_rope=np.bool_(False), attn_temperature=[8, 0.1], norm_type="weightless",
                norm_position="after")
    want = reference.rope_and_cache(*args, **opts)
    got = jrc.rope_and_cache_donated(*(jnp.asarray(a) for a in args), **opts)
    check_equal([np.asarray(g) for g in got], want, "donated")
    assert math.isclose(reference.temperature_factors(96, 8, 0.1)[1], 1 + 0.1 * math.log(2), rel_tol=1e-6)
