"""The model-family options in the CPU handler (impl="kernel" on CPU), bit for bit against the
reference: the use_rope switch (an int32 operand after contract.OPERANDS, traced in a lax.scan over
stacked layers: one compiled program), Llama 4's attention temperature (the temperature_factors
operand after it: q times the token's factor on calls that do not rotate) and gated q rows
(q_gate); every layout, input dtype, both precisions, fp8 caches with static and per-token scales,
stacked layers, the caches donated; and the handler's own checks of the extra operands."""

from __future__ import annotations

import re
import warnings
import zlib

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from conftest import assert_bits_equal
from test_families import BF16, F16, F32, CASES, _weights, check_equal, problem, run

import jax_rope_cache as jrc
from jax_rope_cache import backends, contract, reference
from jax_rope_cache.backends import cpu, native

pytestmark = pytest.mark.skipif("cpu" not in backends.kernel_platforms(), reason="no CPU kernel here")

E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
NEW = ("rope_switch", "temperature", "q_gate")
SWITCHED = [c for c in CASES if "use_rope" in c[1](np.random.default_rng(0), 64, BF16)
            or "attn_temperature" in c[1](np.random.default_rng(0), 64, BF16)]


def test_the_handler_implements_every_family_option():
    assert set(NEW) <= cpu.SUPPORTS
    family = set(contract.FEATURES) - set(contract.BASE_FEATURES) - set(contract.CACHE_FORMAT_FEATURES)
    assert family <= cpu.SUPPORTS


@pytest.mark.parametrize("precision", ["fp32", "native"])
@pytest.mark.parametrize("dtype", [BF16, F16, F32], ids=["bf16", "f16", "f32"])
@pytest.mark.parametrize("case", SWITCHED, ids=[c[0] for c in SWITCHED])
def test_switch_and_temperature_equal_the_reference(case, dtype, precision):
    """use_rope traced (a jit argument), the temperature, both together (Llama 4's RoPE and NoPE layers)."""
    name, make, width = case
    args, rng = problem(dtype, seed=(zlib.crc32(name.encode()) + 3) % 1000, table_w=width)
    opts = dict(make(rng, args[0].shape[2], dtype), precision=precision)
    want = reference.rope_and_cache(*args, **opts)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback warning: the handler runs them
        check_equal(run(args, opts, impl=None), want, f"{name} {precision}")
    check_equal(run(args, opts, impl="kernel"), want, f"{name} {precision}")


@pytest.mark.parametrize("layout", ["flash", "xpacked", "xpacked_shuffled", "hnd", "head_major", "kv_merged"])
@pytest.mark.parametrize("cache", ["same", "fp8-static", "fp8-token"])
def test_layouts_fp8_and_stacked_caches(layout, cache):
    """Both values of a traced switch with the temperature and a norm "after" (skipped when the
    call does not rotate), in every layout, stacked layers, fp8 caches in "fused" arithmetic."""
    args, rng = problem(BF16, layout=layout, seed=13 + len(layout), R=32)
    kc, vc = (None if a is None else np.stack([a, a[::-1]]) for a in args[3:5])
    opts = dict(layout=layout, precision="native", layer=np.int32(1), rotary_dim=32, is_neox=False,
                norm_type="weightless", norm_position="after", attn_temperature=(4, 0.25))
    if cache != "same":
        kc, vc = kc.astype(E4M3), None if vc is None else vc.astype(E4M3)
    if cache == "fp8-static":
        opts.update(k_scale=np.float32(0.3), v_scale=rng.uniform(0.1, 1, 2).astype(np.float32))
    if cache == "fp8-token":
        shape = (2,) + contract.scale_shape(layout, 6, 8, 2)  # problem's NB, BS, KH
        opts.update(k_scale_cache=rng.uniform(0.1, 2, shape).astype(np.float32),
                    v_scale_cache=rng.uniform(0.1, 2, shape).astype(np.float32))
    args = args[:3] + (kc, vc) + args[5:]
    for on in (0, 1, 7):
        opts["use_rope"] = np.int32(on)
        want = reference.rope_and_cache(*args, **opts)
        got = jax.jit(lambda a, o: jrc.rope_and_cache(*a, **o, **{k: v for k, v in opts.items() if k not in o},
                                                      impl="kernel"))(
            args, {k: opts[k] for k in ("use_rope", "layer", "k_scale_cache", "v_scale_cache") if k in opts})
        names = ("q_out", "k_out", "key_cache", "value_cache", "k_scale_cache", "v_scale_cache")
        assert len(got) == len(want)
        for n, g, w in zip(names, got, want):
            assert_bits_equal(None if g is None else np.asarray(g), w, f"{n} [{layout} {cache} use_rope={on}]")


def test_scan_over_layers_is_one_program_with_a_traced_switch():
    """Llama 4: every fourth layer NoPE (temperature, no norm), the others rotate and normalise after;
    a lax.scan over the stacked caches with the switch per layer: one custom call in one program,
    every layer bit-exact to the reference, the caches donated and not copied."""
    L = 4
    args, rng = problem(BF16, seed=17, R=32)
    q, k, v, kc, vc, slots, pos, cos, sin = args
    kcs, vcs = (np.stack([rng.standard_normal(a.shape).astype(BF16) for _ in range(L)]) for a in (kc, vc))
    rope_layers = np.array([1, 1, 1, 0], np.int32)
    opts = dict(rotary_dim=32, is_neox=False, norm_type="weightless", norm_position="after",
                attn_temperature=(8, 0.1), precision="native")

    def model(q, k, v, kcs, vcs, flags):
        def body(carry, x):
            kcs, vcs = carry
            layer, flag = x
            q_out, k_out, kcs, vcs = jrc.rope_and_cache(q, k, v, kcs, vcs, slots, pos, cos, sin, layer=layer,
                                                        use_rope=flag, impl="kernel", **opts)
            return (kcs, vcs), (q_out, k_out)
        (kcs, vcs), outs = jax.lax.scan(body, (kcs, vcs), (jnp.arange(L, dtype=jnp.int32), flags))
        return outs, kcs, vcs

    step = jax.jit(model, donate_argnums=(3, 4))
    text = step.lower(q, k, v, kcs, vcs, rope_layers).compile().as_text()
    assert len(re.findall(r"custom_call_target=\"jax_rope_cache_cpu\"", text)) == 1, "one custom call in the loop"
    assert not [ln for ln in text.splitlines() if re.search(r"\bcopy\(", ln) and
                "[" + ",".join(map(str, kcs.shape)) + "]" in ln]
    (q_outs, k_outs), got_k, got_v = step(q, k, v, jnp.asarray(kcs), jnp.asarray(vcs), rope_layers)
    want_k, want_v = kcs.copy(), vcs.copy()
    for i in range(L):
        want = reference.rope_and_cache(q, k, v, want_k, want_v, slots, pos, cos, sin, layer=i,
                                        use_rope=rope_layers[i], **opts)
        want_k, want_v = want[2], want[3]
        assert_bits_equal(np.asarray(q_outs[i]), want[0], f"q_out layer {i}")
        assert_bits_equal(np.asarray(k_outs[i]), want[1], f"k_out layer {i}")
    assert_bits_equal(np.asarray(got_k), want_k, "key caches")
    assert_bits_equal(np.asarray(got_v), want_v, "value caches")
    # the NoPE layer differs from a RoPE one: the switch is read per call
    assert not np.array_equal(np.asarray(q_outs[3]), np.asarray(q_outs[0]))


@pytest.mark.parametrize("dtype", [BF16, F16, F32], ids=["bf16", "f16", "f32"])
@pytest.mark.parametrize("layout", ["flash", "xpacked", "kv_merged"])
def test_gated_qkv_rows(layout, dtype):
    """q head h at row 2h, its gate at 2h + 1: the handler reads the q heads in place (the gates are
    never read: NaN gates change nothing), with the Gemma norm, a tail rotation, stacked caches."""
    rng = np.random.default_rng(23)
    T, QH, KH, D = 11, 4, 2, 64
    qkv = rng.standard_normal((T, 2 * QH + 2 * KH, D)).astype(dtype)
    qkv[:, 1:2 * QH:2] = np.nan  # the gates
    args, _ = problem(dtype, T=T, QH=QH, KH=KH, D=D, R=32, seed=23, layout=layout)
    kc, vc = (None if a is None else np.stack([a, a]) for a in args[3:5])
    w = _weights(rng, D, dtype)
    opts = dict(num_q_heads=QH, num_kv_heads=KH, q_gate=True, rotary_dim=32, rotary_position="tail",
                norm_type="gemma", q_norm_weight=w[0], k_norm_weight=w[1], layout=layout, layer=1)
    want = reference.rope_and_cache_qkv(qkv.reshape(T, -1), kc, vc, *args[5:], **opts)
    assert not np.isnan(want[0].astype(np.float32)).any()
    static = {n: opts[n] for n in ("num_q_heads", "num_kv_heads", "q_gate", "rotary_dim", "rotary_position",
                                   "norm_type", "layout")}
    step = jax.jit(lambda x, kc, vc, qw, kw: jrc.rope_and_cache_qkv(
        x, kc, vc, *args[5:], q_norm_weight=qw, k_norm_weight=kw, layer=1, impl="kernel", **static),
        donate_argnums=(1, 2))
    text = step.lower(qkv, kc, vc, *w).compile().as_text()
    qkv_shape = "[" + ",".join(map(str, qkv.shape)) + "]"
    assert not [ln for ln in text.splitlines() if re.search(r"\b(copy|slice)\(", ln) and qkv_shape in ln]
    got = step(qkv, kc, vc, *w)
    for n, g, w_ in zip(("q_out", "k_out", "key_cache", "value_cache"), got, want):
        assert_bits_equal(None if g is None else np.asarray(g), w_, f"{n} [gated {layout}]")


def test_temperature_edges():
    """Positions clamped before the factor (negative, past the table), the last factor of the table,
    NaN and inf in q (the canonical NaN), f32 subnormals, floor_scale 1."""
    args, rng = problem(F32, seed=29, max_pos=40)
    q = args[0].copy()
    q[0, 0, :3] = [np.nan, np.inf, 1e-40]
    pos = np.array([-7, 0, 38, 39, 40, 1000, 7, 8, 2**30], np.int32)
    args = (q,) + args[1:6] + (pos,) + args[7:]
    for fs, scale in ((1, 0.5), (8, 0.1), (39, -0.3), (40, 1.0)):
        opts = dict(rotary_dim=0, attn_temperature=(fs, scale))
        check_equal(run(args, opts, impl="kernel"), reference.rope_and_cache(*args, **opts), f"temperature {fs}")


# ---- bad input: a direct call of the handler, which checks the extra operands itself --------------------
def _direct(extra, **attrs):
    args, _ = problem(BF16, seed=2, R=32)
    q, k, v, kc, vc, slots, pos, cos, sin = args
    one, none = np.ones((), np.float32), np.zeros(1, np.float32)
    native.register_target(cpu.TARGET, native.native_module().cpu_handler, "cpu")
    outs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (q, k, kc, vc)]
    base = dict(layout=np.int64(0), is_neox=True, rotary_dim=np.int64(32), native=False, q_norm=False, k_norm=False,
                norm_eps=np.float32(1e-6), mrope=np.int64(0), mrope_t=np.int64(0), mrope_h=np.int64(0),
                mrope_w=np.int64(0), rotary_tail=False, norm_type=np.int64(0), norm_after=False, q_gate=False,
                rope_switch=True, floor_scale=np.int64(4))
    base.update(attrs)
    with jax.default_device(jax.devices("cpu")[0]):
        return jax.block_until_ready(jax.ffi.ffi_call(cpu.TARGET, outs)(
            q, k, v, kc, vc, slots, pos, cos, sin, one, one, np.zeros((), np.int32), none, none, *extra, **base))


def test_direct_calls_with_bad_extra_operands_are_named():
    table = reference.temperature_factors(96, 4, 0.1)
    on = np.ones((), np.int32)
    _direct((on, table))  # well formed
    _direct((np.zeros((), np.int32), table))
    for extra, attrs, words in [
        ((on,), {}, r"operands: expected 16 \(contract.OPERANDS, use_rope, temperature_factors\), got 15"),
        ((on, table, table), {}, "operands: expected 16"),
        ((table,), dict(rope_switch=False), r"attribute floor_scale: the temperature scales q on calls that do not "
                                            r"rotate; expected 0 with rotary_dim=32 and no rope_switch, got 4"),
        ((np.ones((), np.float32), table), {}, r"use_rope: expected a int32 scalar \(dims \[\] or \[1\]\), got float32\[\]"),
        ((np.ones(2, np.int32), table), {}, r"use_rope: expected a int32 scalar"),
        ((on, table[:-1]), {}, r"temperature_factors: expected dims \[max_pos // floor_scale \+ 1\] = \[25\], got \[24\]"),
        ((on, table.astype(np.float16)), {}, "temperature_factors: expected dtype float32"),
        ((on, table), dict(floor_scale=np.int64(-1)), "attribute floor_scale: expected 0 .* got -1"),
        ((on,), dict(rotary_dim=np.int64(0), floor_scale=np.int64(0)), "attribute rope_switch: expected false with "
                                                                          "rotary_dim=0"),
        ((on, table), dict(q_gate=True), r"q: attribute q_gate expects the gated fused tensor \[T, 2 QH \+ 2 KH, D\]"),
    ]:
        with pytest.raises(Exception, match=words):
            _direct(extra, **attrs)


def test_no_fallback_warning_and_refusal_elsewhere():
    """impl=None runs the handler for the switch, the temperature and q_gate (no warning); the GPU
    and TPU kernels still refuse them (their SUPPORTS)."""
    args, rng = problem(BF16, seed=5)
    opts = dict(rotary_dim=32, use_rope=np.int32(0), attn_temperature=(8, 0.1))
    spec = contract.check_op(*args, **opts)
    native.refuse_unsupported(spec, cpu.SUPPORTS, cpu.NAME)
    for name, backend in backends.KERNEL_BACKENDS.items():
        if name != "cpu" and not {"rope_switch", "temperature"} <= set(backend.SUPPORTS):
            with pytest.raises(native.KernelUnavailable, match="does not implement"):
                native.refuse_unsupported(spec, backend.SUPPORTS, backend.NAME)
