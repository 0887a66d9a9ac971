"""int8 and int4 caches in the CPU handler (impl="kernel" on CPU): per (token, KV head) scales in
the scale caches, bit for bit against the reference in every layout, input dtype and arithmetic,
with stacked layers, the QK-norm and family options; slot -1 and slots past the end skipped, a
layer outside the stack writes nothing; the caches donated and aliased (no copy); the scalar
quantization of kernels/common/rope_cache_math.h on every float32 class of value; bad input."""

from __future__ import annotations

import dataclasses
import re

import jax
import ml_dtypes
import numpy as np
import pytest
from conftest import Case, assert_bits_equal, num_blocks
from test_fp8_per_token import SPECIAL_TOKENS, per_token_problem

import jax_rope_cache as jrc
from jax_rope_cache import backends, contract, reference
from jax_rope_cache.backends import cpu, native

pytestmark = pytest.mark.skipif("cpu" not in backends.kernel_platforms(), reason="no CPU kernel here")

F32 = np.float32
I8, U8 = np.dtype(np.int8), np.dtype(np.uint8)
NAMES = ("q_out", "k_out", "key_cache", "value_cache", "k_scale_cache", "v_scale_cache")
CDTS = {"int8": I8, "int4": U8}


def low_bit_problem(case: Case, cdt, seed: int, **kw):
    """per_token_problem's call (magnitudes 1e-3 .. 1e3, a zero row, inf and NaN, random scale caches)
    with int8 / int4 caches pre-filled with random bytes (untouched entries show)."""
    args, opts = per_token_problem(dataclasses.replace(case, cache_dtype="float8_e4m3fn"), seed, **kw)
    rng = np.random.default_rng(seed + 7)
    lead = () if kw.get("layers") is None else (kw["layers"],)
    shapes = contract.cache_shapes(case.layout, num_blocks(case), case.BS, case.KH, case.D, cdt)
    kc, vc = (None if s is None else rng.integers(0, 256, lead + s).astype(np.uint8).view(cdt) for s in shapes)
    return args[:3] + (kc, vc) + args[5:], opts


def kernel_call(args, opts, donate=True):
    """The op jitted with impl="kernel" on the CPU, the caches and scale caches donated."""
    static = {n: v for n, v in opts.items() if n in ("layout", "is_neox", "rotary_dim", "precision", "table_form",
                                                     "rotary_position", "norm_type", "norm_position", "attn_temperature")}
    arrays = {n: v for n, v in opts.items() if n not in static}

    def step(q, k, v, kc, vc, rest, scales, arrays):
        return jrc.rope_and_cache(q, k, v, kc, vc, *rest, **scales, **arrays, **static, impl="kernel")

    scales = {"k_scale_cache": arrays.pop("k_scale_cache"), "v_scale_cache": arrays.pop("v_scale_cache")}
    fn = jax.jit(step, donate_argnums=(3, 4, 6) if donate else ())
    dev = jax.devices("cpu")[0]
    # device-owned copies: a device_put of a numpy array may share the host memory, which a donation copies
    put = lambda a: jax.tree.map(lambda x: jax.device_put(x, dev).copy(), a)  # noqa: E731
    return fn, (put(args[0]), put(args[1]), put(args[2]), put(args[3]), None if args[4] is None else put(args[4]),
                put(args[5:]), put(scales), put(arrays))


def check(args, opts, what):
    want = reference.rope_and_cache(*args, **opts)
    if np.dtype(args[5].dtype).itemsize == 8 and not jax.config.jax_enable_x64:
        # int64 host slots beyond int32: the entry point narrows them (a jit would truncate 2**40 to 0)
        with jax.default_device(jax.devices("cpu")[0]):
            got = jrc.rope_and_cache(*args, **opts, impl="kernel")
    else:
        fn, call = kernel_call(args, opts)
        got = fn(*call)
    assert len(got) == 6
    for name, g, w in zip(NAMES, got, want):
        assert_bits_equal(None if g is None else np.asarray(g), w, f"{name} [{what}]")
    return want


LAYOUTS = ("flash", "hnd", "head_major", "xpacked", "xpacked_shuffled", "kv_merged")


@pytest.mark.parametrize("layers", [None, 3], ids=["one-layer", "stacked"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("cname", CDTS)
def test_every_layout_bit_exact(cname, layout, layers):
    case = Case(T=9, QH=4, KH=2, D=64, BS=16, layout=layout)
    args, opts = low_bit_problem(case, CDTS[cname], seed=len(layout) * 7 + (layers or 0), layers=layers,
                                 norm=layers is None)
    want = check(args, opts, f"{cname} {layout}")
    valid = (args[5] >= 0) & (args[5] < num_blocks(case) * case.BS)
    assert valid.sum() >= 4 and (~valid).any()  # slot -1 and slots past the end in the call
    k_stored = reference.read_kv(want[2], want[3], args[5][valid], layout=layout)[0] if layers is None else None
    if k_stored is not None and cname == "int8":
        assert np.abs(k_stored.astype(int)).max() == 127  # each row's maximum maps to +-Q


ARITH_CASES = [
    Case(T=9, QH=4, KH=2, D=64, BS=16, R=32, is_neox=False, precision="native", table_dtype="bfloat16"),  # rounded
    Case(T=9, QH=4, KH=2, D=64, BS=16, dtype="float16", precision="native"),  # fused: k quantized from f32 values
    Case(T=9, QH=4, KH=2, D=64, BS=16, dtype="float32", precision="native", table="full"),
    Case(T=9, QH=8, KH=2, D=80, BS=8, dtype="float32", R=48),
    Case(T=300, QH=4, KH=2, D=32, BS=16, NB=40, dtype="bfloat16", index_dtype="int64"),  # threads, int64 indices
]


@pytest.mark.parametrize("case", ARITH_CASES, ids=lambda c: c.id)
@pytest.mark.parametrize("cname", CDTS)
def test_dtypes_and_arithmetic_bit_exact(cname, case):
    args, opts = low_bit_problem(case, CDTS[cname], seed=case.D + case.T, norm=True)
    check(args, opts, f"{cname} {case.id}")


@pytest.mark.parametrize("cname", CDTS)
def test_family_options_with_low_bit_caches(cname):
    """The norm after the rotation (the cache quantizes the normalised k_out), a traced switch, the
    temperature, a tail rotation, q_gate: each with an int8 / int4 cache."""
    case = Case(T=9, QH=4, KH=2, D=64, R=32, BS=16, layout="hnd", precision="native")
    args, opts = low_bit_problem(case, CDTS[cname], seed=71)
    for fam in (dict(rotary_dim=32, norm_type="weightless", norm_position="after", is_neox=False),
                dict(rotary_dim=32, rotary_position="tail", use_rope=np.int32(1), attn_temperature=(4, 0.3)),
                dict(rotary_dim=32, rotary_position="tail", use_rope=np.int32(0), attn_temperature=(4, 0.3)),
                dict(rotary_dim=0)):
        check(args, dict(opts, **fam), f"{cname} {fam}")
    # gated fused rows
    rng = np.random.default_rng(72)
    qkv = rng.standard_normal((case.T, (2 * case.QH + 2 * case.KH) * case.D)).astype(ml_dtypes.bfloat16)
    o = dict(opts, num_q_heads=case.QH, num_kv_heads=case.KH, q_gate=True)
    want = reference.rope_and_cache_qkv(qkv, *args[3:], **o)
    got = jrc.rope_and_cache_qkv(qkv, *args[3:], impl="kernel", **o)
    for name, g, w in zip(NAMES, got, want):
        assert_bits_equal(None if g is None else np.asarray(g), w, f"{name} [{cname} q_gate]")


@pytest.mark.parametrize("cname", CDTS)
def test_slot_edges_and_layer_outside_the_stack(cname):
    """Only slots in [0, NB*BS) write (the first and the last included); a layer outside [0, L)
    writes nothing: every cache and scale cache keeps its bytes."""
    case = Case(T=9, QH=4, KH=2, D=64, BS=16, layout="xpacked")
    args, opts = low_bit_problem(case, CDTS[cname], seed=81, layers=2)
    n = num_blocks(case) * case.BS
    slots = np.array([0, n - 1, -1, n, 2**31 - 1, -(2**31), 5, 17, 33], np.int32)
    args = args[:5] + (slots,) + args[6:]
    want = check(args, opts, "slot edges")
    before = dict(zip(NAMES[2:], (args[3], args[4], opts["k_scale_cache"], opts["v_scale_cache"])))
    for i, name in enumerate(NAMES[2:], 2):  # layer 0 untouched, layer 1 written
        assert np.array_equal(want[i][0].view(np.uint8), before[name][0].view(np.uint8)), name
        assert not np.array_equal(want[i][1].view(np.uint8), before[name][1].view(np.uint8)), name
    for layer in (-1, 2):  # traced (the reference refuses a concrete one): q_out and k_out as ever
        fn, call = kernel_call(args, dict(opts, layer=np.int32(layer)))
        out = [np.asarray(o) for o in fn(*call)]
        assert_bits_equal(out[0], want[0], f"q_out [layer {layer}]")
        assert_bits_equal(out[1], want[1], f"k_out [layer {layer}]")
        for i, name in enumerate(NAMES[2:], 2):
            assert np.array_equal(out[i].view(np.uint8), before[name].view(np.uint8)), (layer, name)


def test_donated_caches_are_aliased_not_copied():
    case = Case(T=5, QH=4, KH=2, D=64, BS=16, layout="head_major")
    args, opts = low_bit_problem(case, U8, seed=91, layers=2)
    fn, call = kernel_call(args, opts)
    text = fn.lower(*call).compile().as_text()
    assert "jax_rope_cache_cpu_token_scales" in text and "input_output_alias=" in text
    shapes = [args[3].shape, opts["k_scale_cache"].shape]
    copies = [ln for ln in text.splitlines() if re.search(r"\bcopy\(", ln) and
              any("[" + ",".join(map(str, s)) + "]" in ln for s in shapes)]
    assert not copies, copies
    ptrs = [call[3].unsafe_buffer_pointer(), call[6]["k_scale_cache"].unsafe_buffer_pointer()]
    out = fn(*call)
    assert [out[2].unsafe_buffer_pointer(), out[4].unsafe_buffer_pointer()] == ptrs  # written in place


def test_scalar_quantization_matches_the_reference_on_every_class_of_value():
    """rc_quantize_int / rc_low_bit_scale through the handler: rows of one token holding ties (x.5
    after scaling), values just off ties, subnormals, +-0, +-inf, NaN, +-max; D = 2 * 16 values."""
    rng = np.random.default_rng(5)
    T, KH, D = 64, 1, 32
    v = (rng.standard_normal((T, KH, D)) * 10.0 ** rng.integers(-40, 38, (T, 1, 1))).astype(F32)
    for t in range(0, T, 4):  # rows whose amax is 127 (or 7): the scale is 1, the values are ties
        v[t, 0, 0] = 127.0 if t % 8 == 0 else 7.0
        v[t, 0, 1:9] = np.array([0.5, 1.5, 2.5, -0.5, -2.5, 3.5, -3.5, 126.5 if t % 8 == 0 else 6.5])
        v[t, 0, 9:12] = np.nextafter(np.float32([2.5, -2.5, 0.5]), np.float32(0))
    v[1, 0, :4] = [np.inf, -np.inf, np.nan, 0.0]
    v[2, 0, :] = np.float32(1e-45) * np.arange(D)  # subnormals only
    v[3, 0, :] = -0.0
    v[5, 0, :2] = [np.finfo(F32).max, -np.finfo(F32).max]
    v[6, 0, :] = np.nan
    q = np.zeros((T, 2, D), F32)
    kc = np.zeros((T, 1, KH, D), I8)
    slots, pos = np.arange(T, dtype=np.int32), np.zeros(T, np.int32)
    for cdt in (I8, U8):
        shapes = contract.cache_shapes("flash", T, 1, KH, D, cdt)
        kc, vc = np.zeros(shapes[0], cdt), np.zeros(shapes[1], cdt)
        sc = contract.scale_shape("flash", T, 1, KH)
        opts = dict(rotary_dim=0, k_scale_cache=np.ones(sc, F32), v_scale_cache=np.ones(sc, F32))
        args = (q, v, v, kc, vc, slots, pos, None, None)
        check(args, opts, f"classes {cdt.name}")


@pytest.mark.parametrize("cname", CDTS)
def test_kernel_runs_without_fallback(cname):
    """int8 / int4 are in cpu.SUPPORTS: impl=None runs the handler (no warning), impl="kernel" too."""
    import warnings
    args, opts = low_bit_problem(Case(T=9, QH=4, KH=2, D=64, BS=16), CDTS[cname], seed=4)
    spec = contract.check_op(*args, **opts)
    assert f"{cname}_cache" in contract.features(spec) <= cpu.SUPPORTS
    native.refuse_unsupported(spec, cpu.SUPPORTS, cpu.NAME)
    want = reference.rope_and_cache(*args, **opts)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with jax.default_device(jax.devices("cpu")[0]):
            got = jrc.rope_and_cache(*args, **opts)
    for name, g, w in zip(NAMES, got, want):
        assert_bits_equal(None if g is None else np.asarray(g), w, name)


# ---- bad input: a direct call of the handler, which checks every buffer itself --------------------------
def _direct(args, opts, **change):
    spec = contract.check_op(*args, **opts)
    ops = dict(zip(contract.OPERANDS[:9], args))
    ops.update(k_scale=opts["k_scale_cache"], v_scale=opts["v_scale_cache"], layer=np.zeros((), np.int32),
               q_norm_weight=np.zeros(1, F32), k_norm_weight=np.zeros(1, F32))
    ops.update({k: v for k, v in change.items() if k in ops})
    attrs = cpu.kernel_attrs(spec)
    results = [jax.ShapeDtypeStruct(ops[n].shape, ops[n].dtype)
               for n in ("q", "k", "key_cache", "value_cache", "k_scale", "v_scale")]
    target = change.get("target", cpu.TOKEN_SCALES_TARGET)
    handler = native.native_module().cpu_handler if target == cpu.TARGET else native.native_module().cpu_token_scales_handler
    native.register_target(target, handler, "cpu")
    if target == cpu.TARGET:
        results = results[:4]
    fn = jax.ffi.ffi_call(target, results)
    with jax.default_device(jax.devices("cpu")[0]):
        return jax.block_until_ready(fn(*[ops[n] for n in contract.OPERANDS], **attrs))


def test_bad_input_is_named():
    case = Case(T=5, QH=4, KH=2, D=64, BS=16)
    args, opts = low_bit_problem(case, U8, seed=3)
    _direct(args, opts)  # the well-formed call runs
    kc = args[3]
    with pytest.raises(Exception, match=r"key_cache: expected dims \[NB, BS, KH, D\] = \[6, 16, 2, 32\], got \[6, 16, 2, 64\]"):
        full = np.zeros(kc.shape[:-1] + (64,), U8)
        _direct(args, opts, key_cache=full, value_cache=full.copy())
    with pytest.raises(Exception, match=r"key_cache: expected dtype bfloat16 \(as q\), .*int8 and uint8 \(int4\) caches: "
                                        r"with scale caches"):
        _direct(args, opts, target=cpu.TARGET, k_scale=np.ones((), F32), v_scale=np.ones((), F32))
    with pytest.raises(Exception, match=r"value_cache: expected dtype uint8 \(as key_cache\), got int8"):
        _direct(args, opts, value_cache=args[4].view(I8))
    with pytest.raises(Exception, match=r"k_scale_cache: expected dims"):
        _direct(args, opts, k_scale=opts["k_scale_cache"][:, :1])
