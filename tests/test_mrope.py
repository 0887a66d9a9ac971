"""Multimodal RoPE (M-RoPE): positions [3, T] (temporal, height, width) with the rotary frequencies
split between the three streams by `mrope_section`, in contiguous sections (Qwen2-VL / Qwen2.5-VL)
or interleaved (Qwen3-VL, `mrope_interleaved=True`).

Checks: the frequency assignment against an independent construction of both rules; the reference
against a per-pair combination of three 1-D reference calls; every implementation present against
the reference over an option matrix (native kernels bit for bit, the XLA path within its FMA
bound); text tokens (three equal positions) give exactly the 1-D result in every implementation;
out-of-range positions are clamped per stream; one custom call with aliased caches; vmap and
stacked layers; argument errors.
"""

from __future__ import annotations

import os
import re
import zlib

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jax_rope_cache as jrc
from jax_rope_cache import contract, reference
from conftest import (Case, assert_bits_equal, assert_fma_close, impl_params, make_problem, reference_op, ulp_diff,
                      to_host, xla_bound)

# Heavy parametrizations: the full test tier only (conftest.py deselects them from the default tier).
FULL = [pytest.mark.full]

QWEN25_VL = (16, 24, 24)  # head_dim 128, Qwen2-VL / Qwen2.5-VL
QWEN3_VL = (24, 20, 20)   # head_dim 128, Qwen3-VL (interleaved)


# ---- the frequency assignment ---------------------------------------------------------------------
def streams_by_hand(half: int, section, interleaved: bool) -> list[int]:
    """Each frequency's stream built the way the models describe it, independently of contract.py:
    sections: t zeros, h ones, w twos in a row; interleaved: every frequency temporal, then every
    third from 1 below 3h height, every third from 2 below 3w width."""
    t, h, w = section
    if not interleaved:
        return [0] * t + [1] * h + [2] * w
    out = [0] * half
    for i in range(1, 3 * h, 3):
        out[i] = 1
    for i in range(2, 3 * w, 3):
        out[i] = 2
    return out


@pytest.mark.parametrize("half,section,interleaved", [
    (64, QWEN25_VL, False), (64, QWEN3_VL, True), (64, (24, 20, 20), False), (32, (8, 12, 12), False),
    (32, (12, 10, 10), True), (64, (22, 21, 21), True), (8, (8, 0, 0), False), (8, (3, 3, 2), True)])
def test_frequency_streams(half, section, interleaved):
    got = contract.mrope_stream(np.arange(half), section, interleaved).tolist()
    assert got == streams_by_hand(half, section, interleaved)
    assert [got.count(s) for s in range(3)] == list(section)


def test_qwen3_vl_interleaving_pattern():
    """Qwen3-VL (24, 20, 20): T H W repeated for 60 frequencies, then the last 4 temporal."""
    got = contract.mrope_stream(np.arange(64), QWEN3_VL, True).tolist()
    assert got == [0, 1, 2] * 20 + [0] * 4


# ---- problems -------------------------------------------------------------------------------------
def mrope_positions(T: int, max_pos: int, rng, out_of_range: bool = True) -> np.ndarray:
    """[3, T] positions as a vision-language prompt has them: text runs (three equal positions), an
    image (temporal fixed, height and width on a grid), and, with `out_of_range`, single streams
    below 0 or >= max_pos (each stream is clamped on its own)."""
    pos = np.zeros((3, T), np.int64)
    base = int(rng.integers(0, max_pos // 2))
    t = 0
    while t < T:
        n = int(min(T - t, rng.integers(1, 6)))
        if rng.random() < 0.5:  # text
            pos[:, t:t + n] = base + np.arange(n)
            base += n
        else:  # image patches of a grid of width 3
            i = np.arange(n)
            pos[0, t:t + n] = base
            pos[1, t:t + n] = base + i // 3
            pos[2, t:t + n] = base + i % 3
            base += 1 + (n - 1) // 3
        t += n
    pos = np.minimum(pos, max_pos - 1)
    if out_of_range:
        for j in range(1, T, 4):
            s = j % 3
            pos[s, j] = -int(rng.integers(1, 1000)) if j % 8 == 1 else max_pos + int(rng.integers(0, 1000))
    return pos


def make_mrope_problem(case: Case, section, interleaved: bool, seed: int, norm: str = "", text: bool = False):
    """make_problem's random inputs with positions [3, T] (all three equal with `text`) and, with
    `norm` ("q", "k" or "qk"), random QK-norm weights."""
    args, opts = make_problem(case, seed)
    rng = np.random.default_rng(seed + 1)
    idt = np.dtype(case.index_dtype)
    pos = mrope_positions(case.T, case.max_pos, rng)
    if text:
        pos = np.broadcast_to(pos[1], (3, case.T)).copy()
    args = args[:6] + (pos.astype(idt),) + args[7:]
    opts = dict(opts, mrope_section=section, mrope_interleaved=interleaved)
    dt = args[0].dtype
    for which in norm:
        opts[f"{which}_norm_weight"] = rng.normal(1.0, 0.4, case.D).astype(dt)
    return args, opts


def _run(platform, impl, args, opts):
    with jax.enable_x64(any(np.asarray(a).dtype == np.int64 for a in args[5:7])):
        dev = jax.devices(platform)[0]
        dargs = jax.device_put(args, dev)
        traced = {k: jax.device_put(opts[k], dev) for k in ("k_scale", "v_scale", "q_norm_weight", "k_norm_weight")
                  if k in opts}
        static = {k: v for k, v in opts.items() if k not in traced}
        fn = jax.jit(lambda *a, **s: jrc.rope_and_cache(*a, **s, **static, impl=impl))
        return to_host(fn(*dargs, **traced))


NAMES = ("q_out", "k_out", "key_cache", "value_cache")


def check(platform, impl, args, opts, want, what):
    from test_qk_norm import xla_bounds  # the rotation's FMA bound over the normalised inputs (GPU: + its norm)

    got = _run(platform, impl, args, opts)
    bounds = xla_bounds(args, opts, platform)
    for name, g, w, bound in zip(NAMES, got, want, bounds):
        if impl == "kernel":
            assert_bits_equal(g, w, f"{name} [{what}]")
        else:
            assert_fma_close(g, w, bound, f"{name} [{what}]")
    for name, g, before, w in zip(NAMES[2:], got[2:], args[3:5], want[2:]):
        untouched = ulp_diff(w, before) == 0
        assert (ulp_diff(g, before)[untouched] == 0).all(), f"{name}: an unwritten entry changed [{what}]"
    return got


# ---- the reference: three 1-D calls combined per pair ----------------------------------------------
@pytest.mark.parametrize("interleaved,section", [(False, (8, 12, 12)), (True, (12, 10, 10))])
@pytest.mark.parametrize("is_neox,table", [(True, "half"), (False, "half"), (True, "full"), (False, "full")])
def test_reference_is_one_stream_per_pair(interleaved, section, is_neox, table):
    """Rotary pair i of the M-RoPE output equals pair i of the 1-D output for the positions of
    its stream; channels >= R and the V cache equal the 1-D ones."""
    case = Case(T=11, QH=4, KH=2, D=80, R=64, is_neox=is_neox, table=table, precision="native",
                dtype="bfloat16", table_dtype="bfloat16")
    args, opts = make_mrope_problem(case, section, interleaved, seed=3, norm="qk")
    got = reference_op(*args, **opts)
    plain = {k: v for k, v in opts.items() if not k.startswith("mrope")}
    per_stream = [reference_op(*args[:6], args[6][s], *args[7:], **plain) for s in range(3)]
    streams = streams_by_hand(32, section, interleaved)
    a, b = reference.pair_channels(64, is_neox)
    for out in (0, 1):
        want = per_stream[0][out].copy()
        for i, s in enumerate(streams):
            want[..., [a[i], b[i]]] = per_stream[s][out][..., [a[i], b[i]]]
        assert_bits_equal(got[out], want, NAMES[out])
    assert len(set(streams)) == 3 and not np.array_equal(per_stream[1][0], per_stream[2][0])
    assert_bits_equal(got[3], per_stream[0][3], "value_cache")


# ---- every implementation vs the reference -----------------------------------------------------------
# A covering set: every layout, cache dtype (fp8 with scales), rotation style, table form, precision,
# partial rotary, QK-norm, index width and both assignment rules appear.
MATRIX = [
    # (case, section, interleaved, norm)
    (Case(T=9, QH=8, KH=2, D=128, layout="flash"), QWEN25_VL, False, "qk"),
    (Case(T=9, QH=8, KH=2, D=128, layout="xpacked", precision="native", dtype="bfloat16", table_dtype="bfloat16"),
     QWEN3_VL, True, "qk"),
    (Case(T=7, QH=4, KH=1, D=128, layout="xpacked_shuffled", cache_dtype="float8_e4m3fn", precision="native"),
     QWEN3_VL, True, "k"),
    (Case(T=7, QH=4, KH=2, D=64, R=48, layout="flash", is_neox=False, table="full", dtype="float16",
          table_dtype="float16", index_dtype="int64"), (8, 8, 8), False, ""),
    (Case(T=6, QH=4, KH=2, D=64, layout="xpacked", is_neox=False, cache_dtype="float8_e4m3fnuz", dtype="float32"),
     (12, 10, 10), True, "q"),
    (Case(T=5, QH=2, KH=2, D=80, R=64, layout="flash", table="full", precision="native"), (12, 10, 10), True, "qk"),
    (Case(T=1, QH=16, KH=1, D=128, layout="flash", precision="native", dtype="bfloat16", table_dtype="bfloat16"),
     QWEN3_VL, True, "qk"),
    (Case(T=9, QH=8, KH=2, D=128, layout="head_major", cache_dtype="float8_e5m2"), QWEN25_VL, False, "k"),
    (Case(T=6, QH=4, KH=2, D=64, layout="kv_merged", precision="native", dtype="bfloat16", table_dtype="bfloat16"),
     (12, 10, 10), True, "q"),
]
MATRIX_IDS = [f"{c.id}-{'il' if il else 'sec'}{'-'.join(map(str, s))}-norm{n or 'none'}" for c, s, il, n in MATRIX]


@pytest.mark.parametrize("platform,impl", impl_params())
@pytest.mark.parametrize("case,section,interleaved,norm", MATRIX, ids=MATRIX_IDS)
def test_matches_reference(platform, impl, case, section, interleaved, norm):
    args, opts = make_mrope_problem(case, section, interleaved, seed=zlib.crc32(case.id.encode()), norm=norm)
    check(platform, impl, args, opts, reference_op(*args, **opts), case.id)


# Calls large enough that CUDA blocks hold several tokens on any GPU of up to 256 SMs: the kernel
# merges each token's cos/sin rows in shared memory (RC_MROW); the second takes the packed bf16 path.
LARGE = [(Case(T=1024, QH=8, KH=2, D=128, max_pos=3000), QWEN3_VL, True, "qk"),
         (Case(T=1024, QH=8, KH=2, D=128, max_pos=3000, layout="xpacked", precision="native",
               table_dtype="bfloat16"), QWEN25_VL, False, "")]


@pytest.mark.parametrize("platform,impl", [p for p in impl_params() if p.values[1] == "kernel"])
@pytest.mark.parametrize("case,section,interleaved,norm", LARGE, ids=["il-qk", "sec-native"])
def test_large_calls_match_reference(platform, impl, case, section, interleaved, norm):
    args, opts = make_mrope_problem(case, section, interleaved, seed=21, norm=norm)
    if platform == "cuda":  # the configuration this GPU gets merges the rows
        from jax_rope_cache.backends import cuda

        cfg = cuda.kernel_config(contract.check_op(*args, **opts), num_sms=cuda._local_cuda_arch()[1])
        assert dict(cfg.defines).get("RC_MROW") == 1, cfg
    check(platform, impl, args, opts, reference_op(*args, **opts), case.id)


@pytest.mark.parametrize("platform,impl", impl_params())
@pytest.mark.parametrize("interleaved,section", [(False, QWEN25_VL), (True, QWEN3_VL)])
@pytest.mark.parametrize("is_neox,table", [(True, "half"), (False, "full")])
def test_text_tokens_equal_1d_bit_for_bit(platform, impl, interleaved, section, is_neox, table):
    """Three equal positions per token: the same bits as the 1-D op on the same implementation."""
    case = Case(T=8, QH=8, KH=2, D=128, is_neox=is_neox, table=table, layout="xpacked", precision="native")
    args, opts = make_mrope_problem(case, section, interleaved, seed=11, norm="qk", text=True)
    plain = {k: v for k, v in opts.items() if not k.startswith("mrope")}
    one_d = args[:6] + (args[6][0],) + args[7:]
    got = _run(platform, impl, args, opts)
    want = _run(platform, impl, one_d, plain)
    for name, g, w in zip(NAMES, got, want):
        assert_bits_equal(g, w, name)
    for name, w, r in zip(NAMES, want, reference_op(*one_d, **plain)):
        if impl == "kernel":
            assert_bits_equal(w, r, f"1-D {name} vs reference")


@pytest.mark.parametrize("platform,impl", impl_params())
def test_each_stream_clamped_on_its_own(platform, impl):
    """A stream below 0 reads row 0 and one past the table reads the last row, only for the
    frequencies of that stream: compared with the same call on positions clamped by hand."""
    case = Case(T=6, QH=4, KH=2, D=64, max_pos=16)
    args, opts = make_mrope_problem(case, (12, 10, 10), True, seed=5)
    pos = np.array([[3, -5, 7, 2**31 - 1, 0, 15], [3, 4, 99, 1, -(2**31), 15], [3, 9, 8, 16, 2, -1]], np.int32)
    args = args[:6] + (pos,) + args[7:]
    clamped = args[:6] + (np.clip(pos, 0, 15),) + args[7:]
    got = _run(platform, impl, args, opts)
    want = reference_op(*clamped, **opts)
    for name, g, w in zip(NAMES, got, want):
        if impl == "kernel":
            assert_bits_equal(g, w, name)
        else:
            assert_fma_close(g, w, xla_bound(name, clamped, opts), name)


@pytest.mark.parametrize("platform,impl", impl_params())
def test_stacked_layers_and_vmap(platform, impl):
    """Stacked caches with a traced layer, and vmap over a batch of problems (positions [B, 3, T])."""
    case = Case(T=5, QH=4, KH=2, D=64, layout="xpacked")
    args, opts = make_mrope_problem(case, (8, 12, 12), False, seed=9, norm="q")
    rng = np.random.default_rng(0)
    kc = np.stack([args[3], rng.standard_normal(args[3].shape).astype(args[3].dtype)])
    vc = np.stack([args[4], rng.standard_normal(args[4].shape).astype(args[4].dtype)])
    static = {k: v for k, v in opts.items() if k != "q_norm_weight"}
    fn = jax.jit(lambda *a, layer, w: jrc.rope_and_cache(*a, layer=layer, q_norm_weight=w, impl=impl, **static))
    dev = jax.devices(platform)[0]
    got = fn(*jax.device_put(args[:3] + (kc, vc) + args[5:], dev), layer=jnp.int32(1), w=opts["q_norm_weight"])
    want = reference_op(*args[:3], kc, vc, *args[5:], layer=1, **opts)
    for name, g, w in zip(NAMES, got, want):
        (assert_bits_equal if impl == "kernel" else lambda g, w, n: assert_fma_close(
            g, w, xla_bound(n, args, opts), n))(np.asarray(g), w, name)

    # vmap: two problems, positions [2, 3, T]
    args2, _ = make_mrope_problem(case, (8, 12, 12), False, seed=10, norm="q")
    batch = [np.stack([a, b]) for a, b in zip(args, args2)]
    vfn = jax.jit(jax.vmap(lambda *a: jrc.rope_and_cache(*a, q_norm_weight=opts["q_norm_weight"], impl=impl,
                                                        **static)))
    got = [np.asarray(o) for o in vfn(*jax.device_put(batch, dev))]
    for i, a in enumerate((args, args2)):
        want = reference_op(*a, **opts)
        for name, g, w in zip(NAMES, got, want):
            if impl == "kernel":
                assert_bits_equal(g[i], w, f"vmap[{i}] {name}")
            else:
                assert_fma_close(g[i], w, xla_bound(name, a, opts), f"vmap[{i}] {name}")


def test_one_custom_call_with_aliased_caches():
    from jax_rope_cache.backends import cpu

    case = Case(T=8, QH=8, KH=2, D=128, layout="xpacked_shuffled")
    args, opts = make_mrope_problem(case, QWEN3_VL, True, seed=2, norm="qk")
    static = {k: v for k, v in opts.items() if not k.endswith("norm_weight")}
    fn = jax.jit(lambda *a, qw, kw: jrc.rope_and_cache(*a, q_norm_weight=qw, k_norm_weight=kw, impl="kernel",
                                                       **static), donate_argnums=(3, 4))
    cpu_device = jax.devices("cpu")[0]  # the CPU program, also on a GPU host
    with jax.default_device(cpu_device):
        hlo = fn.lower(*jax.device_put(args, cpu_device), qw=opts["q_norm_weight"],
                       kw=opts["k_norm_weight"]).compile().as_text()
    assert len(re.findall(r"custom_call_target=\"" + cpu.TARGET, hlo)) == 1, hlo
    assert "input_output_alias" in hlo


def test_rope_and_cache_donated_takes_a_list_section():
    case = Case(T=4, QH=4, KH=2, D=64)
    args, opts = make_mrope_problem(case, [8, 12, 12], False, seed=4)
    want = reference_op(*args, **opts)
    got = jrc.rope_and_cache_donated(*[jnp.asarray(a) for a in args], **opts)
    for name, g, w in zip(NAMES, got, want):
        assert_fma_close(np.asarray(g), w, xla_bound(name, args, opts), name)


# ---- argument errors --------------------------------------------------------------------------------
def _spec_args(T=4, D=64, R=None, pos_shape=None):
    s = jax.ShapeDtypeStruct
    bf = jnp.bfloat16
    r = R or D
    return (s((T, 4, D), bf), s((T, 2, D), bf), s((T, 2, D), bf), s((4, 16, 2, D), bf), s((4, 16, 2, D), bf),
            s((T,), jnp.int32), s(pos_shape or (3, T), jnp.int32), s((32, r // 2), jnp.float32),
            s((32, r // 2), jnp.float32))


@pytest.mark.parametrize("kwargs,pos_shape,exc,match", [
    (dict(mrope_section=(8, 8, 8)), None, ValueError, r"mrope_section: expected 3 counts >= 0 summing to rotary_dim/2 = 32.*\[8, 8, 8\] \(sum 24\)"),
    (dict(mrope_section=(8, 12, 12), rotary_dim=48), None, ValueError, r"summing to rotary_dim/2 = 24"),
    (dict(mrope_section=(-4, 18, 18)), None, ValueError, r"mrope_section: expected 3 counts >= 0"),
    (dict(mrope_section=(16, 16)), None, TypeError, r"mrope_section: expected a sequence of 3 ints.*\(16, 16\)"),
    (dict(mrope_section=(8.0, 12, 12)), None, TypeError, r"mrope_section: expected a sequence of 3 ints"),
    (dict(mrope_section=32), None, TypeError, r"mrope_section: expected a sequence of 3 ints"),
    (dict(mrope_section=(2, 15, 15), mrope_interleaved=True), None, ValueError,
     r"mrope_section: interleaved sections must fit rotary_dim/2 = 32.*\[2, 15, 15\]"),
    (dict(mrope_interleaved=True), (4,), ValueError, r"mrope_interleaved: True needs mrope_section"),
    (dict(mrope_section=(8, 12, 12), mrope_interleaved=1), None, TypeError, r"mrope_interleaved: expected a Python bool"),
    (dict(mrope_section=(8, 12, 12)), (4,), ValueError, r"positions: expected rank 2 \[3, T\].*got shape \[4\]"),
    (dict(mrope_section=(8, 12, 12)), (2, 4), ValueError, r"positions: expected shape \[3, T\].* = \[3, 4\], got \[2, 4\]"),
    (dict(mrope_section=(8, 12, 12)), (3, 5), ValueError, r"positions: expected shape .*\[3, 4\], got \[3, 5\]"),
    (dict(), (3, 4), ValueError, r"positions: expected rank 1 \[T\] \(positions \[3, T\] need mrope_section\)"),
])
def test_errors_name_the_argument(kwargs, pos_shape, exc, match):
    args = _spec_args(R=kwargs.get("rotary_dim"), pos_shape=pos_shape)
    with pytest.raises(exc, match=match):
        contract.check_op(*args, **kwargs)
    with pytest.raises(exc, match=match):  # the public entry point raises the same at trace time
        jax.eval_shape(lambda *a: jrc.rope_and_cache(*a, **kwargs), *args)


def test_kernel_codes_carry_the_sections():
    spec = contract.check_op(*_spec_args(D=128), mrope_section=QWEN3_VL, mrope_interleaved=True)
    codes = contract.kernel_codes(spec)
    assert (codes.mrope, codes.mrope_t, codes.mrope_h, codes.mrope_w) == (2, 24, 20, 20)
    assert "mrope" in contract.features(spec)
    plain = contract.kernel_codes(contract.check_op(*_spec_args(D=128, pos_shape=(4,))))
    assert (plain.mrope, plain.mrope_t, plain.mrope_h, plain.mrope_w) == (0, 0, 0, 0)


# ---- tables, presets and the benchmark's dry run ---------------------------------------------------
def test_tables_from_vision_language_configs():
    from jax_rope_cache.models import config, presets, tables

    cos, sin, info = config.rope_tables_from_hf_config(presets.preset_config("qwen2.5-vl-7b"), max_pos=64)
    assert (info.rope_type, info.mrope_section, info.mrope_interleaved) == ("default", QWEN25_VL, False)
    want = tables.rope_tables(64, 128, base=1e6)
    np.testing.assert_array_equal(cos, want[0])
    assert info.op_options() == dict(rotary_dim=128, is_neox=True, table_form="half", mrope_section=QWEN25_VL,
                                     mrope_interleaved=False)
    # Qwen3-VL's config.json nests the language model under text_config
    flat = presets.preset_config("qwen3-vl-8b")
    nested = {"model_type": "qwen3_vl", "text_config": flat, "vision_config": {"depth": 27}}
    for cfg in (flat, nested):
        _, _, info = config.rope_tables_from_hf_config(cfg, max_pos=64, tp=4)
        assert (info.mrope_section, info.mrope_interleaved, info.base) == (QWEN3_VL, True, 5e6)
        assert (info.shape.q_heads, info.shape.kv_heads, info.shape.head_dim) == (8, 2, 128)
    assert config.rope_tables_from_hf_config(presets.preset_config("qwen3-32b"), max_pos=8)[2].op_options() == dict(
        rotary_dim=128, is_neox=True, table_form="half")


@pytest.mark.parametrize("name,shapes", [
    ("qwen3-vl-8b", [(32, 8), (16, 4), (8, 2), (4, 1)]),
    ("qwen3-vl-235b-a22b", [(64, 4), (32, 2), (16, 1), (8, 1)]),
    ("qwen2.5-vl-7b", [(28, 4), (14, 2), (7, 1)])])
def test_vision_language_presets_per_shard(name, shapes):
    from jax_rope_cache.models import presets

    for tp, want in zip((1, 2, 4, 8), shapes):
        s = presets.preset_shape(name, tp)
        assert (s.q_heads, s.kv_heads, s.head_dim, s.rotary_dim) == want + (128, 128), (name, tp)
    _, _, info = presets.preset_tables(name, max_pos=16, tp=2)
    assert info.mrope_section is not None and info.shape.q_heads == shapes[1][0]
    assert presets.preset_qk_norm_eps(name) == (None if name.startswith("qwen2.5") else 1e-6)


@pytest.mark.parametrize("rope,match", [
    ({"rope_type": "default", "mrope_section": [16, 24, 16]}, r"config\['rope_scaling'\]\['mrope_section'\]: expected a sum of rotary_dim/2 = 64"),
    ({"type": "mrope", "mrope_section": [16, 24]}, r"config\['rope_scaling'\]\['mrope_section'\]: expected 3 integers"),
    ({"rope_type": "default", "mrope_interleaved": True}, r"config\['rope_scaling'\]\['mrope_section'\]: missing"),
    ({"rope_type": "default", "mrope_section": [24, 20, 20], "mrope_interleaved": "yes"},
     r"config\['rope_scaling'\]\['mrope_interleaved'\]: expected true or false")])
def test_config_errors_name_the_key(rope, match):
    from jax_rope_cache.models import config, presets

    cfg = dict(presets.preset_config("qwen3-vl-8b"), rope_scaling=rope)
    with pytest.raises(ValueError, match=match):
        config.rope_tables_from_hf_config(cfg, max_pos=8)


@pytest.mark.full
@pytest.mark.full  # about 25 s on 2 cores
def test_benchmark_dry_run(tmp_path):
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks", "bench_gpu.py")
    spec = importlib.util.spec_from_file_location("bench_gpu", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    rc = mod.main(["mrope", str(tmp_path), "--dry-run", "--tokens", "5", "--layouts", "xpacked", "--models", "qwen3-vl-8b:1",
                   "--calls", "1", "--reps", "1"])
    assert rc == 0
    log = (tmp_path / "bench_mrope.log").read_text()
    assert "exact, exact, exact" in log and "jnp/fu" in log  # fused, jnp, front each bit for bit on the CPU
