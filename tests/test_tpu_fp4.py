"""NVFP4 and MXFP4 caches in the Pallas TPU kernel (interpret mode on the CPU, the TPU where one is
present): every result bit-exact to reference.rope_and_cache, the block-scale caches included, on
fresh random data (rows of magnitudes 1e-3 .. 1e3, zero, NaN and inf rows, blocks whose NVFP4 scale
rounds to 0, slots -1 and out of range, stacked layers, QK-norm, partial rotary, traced global
scales); the kernel's block arithmetic against the reference's on bit patterns and exact ties; the
"tpu" lowering one tpu_custom_call with the caches and block-scale caches aliased."""

from __future__ import annotations

import dataclasses
import re
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import Case, assert_bits_equal, reference_op
from test_low_bit_caches import problem
from jax.experimental.pallas import tpu as pltpu
from test_tpu_kernel import K, ON_TPU, WHERE, _f32_patterns, _x64, check_results, kernel_here, tpu_text

import jax_rope_cache as jrc
from jax_rope_cache import contract, reference
from jax_rope_cache.backends import tpu

F32 = np.float32
BLOCK = ("nvfp4", "mxfp4")
TRACED = ("k_scale", "v_scale", "layer")  # passed as jit arguments: the global scales and the layer traced


def with_edges(fmt, args, opts, seed):
    """The sampled rows plus blocks they may miss: tiny values (NVFP4: a block scale that rounds to 0
    or to an E4M3 subnormal; MXFP4: a small shared exponent) and one huge value among zeros (the
    block's other values store +-0), in k and v."""
    q, k, v, kc, vc, slots, pos, cos, sin = args
    rng = np.random.default_rng(seed)
    g = contract.BLOCK_GROUP[fmt]
    k, v = k.copy(), v.copy()
    t = min(1, len(v) - 1)
    v[t, 0, :g] = (rng.uniform(-1, 1, g) * 1e-9).astype(F32).astype(v.dtype)
    k[t, -1, -g:] = (rng.uniform(-1, 1, g) * 3e-6).astype(F32).astype(k.dtype)
    v[t, -1, -g:] = 0
    v[t, -1, -1] = np.array(3e4, F32).astype(v.dtype)
    return (q, k, v, kc, vc, slots, pos, cos, sin), opts


def run_traced(args, opts, params=None):
    """impl="kernel" on WHERE with the global scales and the layer as jit arguments (traced)."""
    traced = {n: opts[n] for n in TRACED if n in opts}
    static = {n: x for n, x in opts.items() if n not in traced}
    names = tuple(traced)
    with jax.enable_x64(_x64(args)), kernel_here(params):
        fn = jax.jit(lambda a, t: jrc.rope_and_cache(*a, **static, **dict(zip(names, t)), impl="kernel"))
        dev = jax.devices(WHERE)[0]
        out = fn(*jax.device_put((tuple(args), tuple(jnp.asarray(traced[n]) for n in names)), dev))
        return [None if o is None else np.asarray(o) for o in out]


def check(fmt, case, layers=None, norm=False, seed=None, slots=None, params=None):
    seed = zlib.crc32(f"{fmt}-{case.id}-{layers}-{norm}".encode()) if seed is None else seed
    args, opts = problem(fmt, case, seed, layers=layers, norm=norm)
    args, opts = with_edges(fmt, args, opts, seed + 5)
    if slots is not None:  # chosen slots and consecutive positions (a chunked prefill)
        args = args[:5] + (np.asarray(slots, np.int32), np.arange(case.T, dtype=np.int32) + 7) + args[7:]
    text = tpu_text(args, opts)
    assert text.count("stablehlo.custom_call @tpu_custom_call") == 1, case.id
    want = reference_op(*args, **opts)
    got = run_traced(args, opts, params)
    check_results(got, want, args, opts, f"{fmt} {case.id}")
    return got, want, args, opts


# (fmt, case, layers, QK-norm): every layout, both formats, stacked layers, norm and partial rotary by default
SAMPLE = [
    ("nvfp4", Case(T=6, QH=4, KH=2, D=64, layout="flash"), None, False),
    ("mxfp4", Case(T=5, QH=4, KH=2, D=64, layout="hnd", is_neox=False), None, False),
    ("nvfp4", Case(T=7, QH=4, KH=2, D=64, R=32, layout="head_major", dtype="float32"), 3, True),
    ("mxfp4", Case(T=6, QH=4, KH=1, D=96, R=64, layout="flash", dtype="float16", table="full"), 2, True),
]
FULL = [
    ("nvfp4", Case(T=9, QH=8, KH=2, D=128, layout="hnd", index_dtype="int64"), 2, True),
    ("mxfp4", Case(T=9, QH=8, KH=2, D=128, layout="head_major", R=64, is_neox=False), None, True),
    ("nvfp4", Case(T=33, QH=4, KH=4, D=32, layout="flash", dtype="float16", table="full"), None, False),
    ("mxfp4", Case(T=33, QH=4, KH=2, D=256, layout="hnd", dtype="float32"), 3, False),
    ("nvfp4", Case(T=5, QH=4, KH=2, D=16, layout="head_major", BS=8), None, True),
    ("mxfp4", Case(T=7, QH=4, KH=2, D=32, layout="flash", BS=8), 2, False),
    ("nvfp4", Case(T=11, QH=4, KH=2, D=64, layout="flash", precision="native", table_dtype="bfloat16"), 2, False),
    ("mxfp4", Case(T=11, QH=4, KH=2, D=80 + 48, layout="hnd", precision="native", table_dtype="bfloat16"), None, True),
]


def _id(c):
    return f"{c[0]}-{c[1].id}-L{c[2]}-{'norm' if c[3] else 'plain'}"


@pytest.mark.parametrize("fmt,case,layers,norm", SAMPLE, ids=[_id(c) for c in SAMPLE])
def test_block_formats_bit_exact(fmt, case, layers, norm):
    check(fmt, case, layers, norm)


@pytest.mark.full
@pytest.mark.parametrize("fmt,case,layers,norm", FULL, ids=[_id(c) for c in FULL])
def test_block_formats_bit_exact_full(fmt, case, layers, norm):
    check(fmt, case, layers, norm)


@pytest.mark.parametrize("fmt", BLOCK)
def test_a_layer_outside_the_stack_writes_nothing(fmt):
    """A traced layer outside [0, L): no cache or block-scale cache entry changes."""
    case = Case(T=5, QH=4, KH=2, D=64, layout="hnd")
    args, opts = problem(fmt, case, 61, layers=2)
    opts["layer"] = 2
    got = run_traced(args, opts)
    for name, g, before in zip(("key_cache", "value_cache", "k_scale_cache", "v_scale_cache"), got[2:],
                               (args[3], args[4], opts["k_scale_cache"], opts["v_scale_cache"])):
        assert_bits_equal(g, before, f"{name} untouched")


def _prefill_slots(case):
    s = np.arange(19, 19 + case.T)
    s[30 % case.T] = -1
    return s


@pytest.mark.parametrize("fmt,layout", [("nvfp4", "head_major"),
                                        pytest.param("mxfp4", "flash", marks=pytest.mark.full)])
def test_prefill_over_several_token_blocks(monkeypatch, fmt, layout):
    """Grid steps of 8 tokens (the smallest token block): the runs of the caches and of the
    block-scale caches cross token blocks and cache blocks."""
    monkeypatch.setattr(K, "VMEM_BLOCK_BUDGET", 1)
    case = Case(T=45, QH=4, KH=2, D=64, layout=layout, NB=8, max_pos=128)
    args, opts = problem(fmt, case, 81)
    assert tpu.config(contract.check_op(*args, **opts)).block_tokens == 8
    check(fmt, case, seed=81, slots=_prefill_slots(case))


@pytest.mark.skipif(ON_TPU, reason="the interpreter's DMA orders and race detector")
@pytest.mark.parametrize("fmt,order", [("mxfp4", "on_wait"), pytest.param("nvfp4", "eager", marks=pytest.mark.full)])
def test_no_dma_race_whenever_the_copies_run(fmt, order):
    """The block-scale rows' DMAs run at their start or at their wait, with the race detector on."""
    case = Case(T=20, QH=4, KH=2, D=64, layout="hnd")
    slots = np.concatenate([np.arange(3, 17), [40, -1, 90, 41, 60, 200]])
    check(fmt, case, seed=82, slots=slots,
          params=pltpu.InterpretParams(dma_execution_mode=order, detect_races=True))


@pytest.mark.skipif(ON_TPU, reason="a DMA out of bounds on a TPU faults the device; interpret mode raises")
def test_interpret_mode_catches_a_dma_outside_the_caches(monkeypatch):
    """The check the slot-edge tests rely on, with block-scale caches: a kernel told the caches have
    one block more writes slot NB*BS + 3, and the interpreter raises instead of writing."""
    case = Case(T=6, QH=2, KH=1, D=64, BS=8, NB=4, layout="hnd")
    args, opts = problem("nvfp4", case, 83)
    args = args[:5] + (np.array([0, 4 * 8 + 3, 5, -1, 6, 7], np.int32),) + args[6:]
    real = tpu.config
    monkeypatch.setattr(tpu, "config", lambda spec: dataclasses.replace(real(spec), num_blocks=spec.num_blocks + 1))
    with pytest.raises(Exception, match="Out-of-bounds write"):
        run_traced(args, opts)


@pytest.mark.parametrize("fmt", BLOCK)
def test_zero_tokens_return_the_caches_as_they_are(fmt):
    args, opts = problem(fmt, Case(T=6, QH=4, KH=2, D=64, layout="hnd"), 84)
    args = tuple(a[:0] for a in args[:3]) + args[3:5] + tuple(a[:0] for a in args[5:7]) + args[7:]
    got = run_traced(args, opts)
    assert got[0].shape == (0, 4, 64) and got[1].shape == (0, 2, 64)
    for name, g, before in zip(("key_cache", "value_cache", "k_scale_cache", "v_scale_cache"), got[2:],
                               (args[3], args[4], opts["k_scale_cache"], opts["v_scale_cache"])):
        assert_bits_equal(g, before, name)


# ---- the block arithmetic on plain arrays ----------------------------------------------------------------
def _tie_blocks(fmt, rng, n):
    """Blocks whose multiplier is a power of two (MXFP4 always; NVFP4 with g = 1 and amax = 6 * 2^e, so
    the scale is 2^e): values at E2M1's midpoints and their neighbours, so every tie is met exactly."""
    g = contract.BLOCK_GROUP[fmt]
    mids = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.5, 1.0, 3.0, 6.0, 7.0, 7.99], F32)
    near = np.concatenate([mids, np.nextafter(mids, F32(0)), np.nextafter(mids, F32(9))])
    e = rng.integers(-9, 9, n)
    vals = rng.choice(near, (n, g)) * rng.choice(np.array([-1, 1], F32), (n, g))
    vals[:, 0] = 6.0 if fmt == "nvfp4" else 4.0  # the amax: scale 2^e exactly
    vals = np.clip(vals, -6.0 if fmt == "nvfp4" else -7.99, 6.0 if fmt == "nvfp4" else 7.99)
    return (vals * np.exp2(e)[:, None]).astype(F32)


def _rows(fmt, seed, d=128):
    """Rows [n, d]: a zero block and one of NaN, inf and -0 only, every f32 bit pattern class
    (_f32_patterns, so NaN, inf, zeros, subnormals and huge values share blocks), tie blocks, blocks
    of tiny values and blocks of random magnitudes."""
    rng = np.random.default_rng(seed)
    g = contract.BLOCK_GROUP[fmt]
    pat = _f32_patterns()
    pat = pat[rng.permutation(len(pat))][: (1 << 17)]
    ties = _tie_blocks(fmt, rng, 4096).reshape(-1)
    tiny = (rng.uniform(-1, 1, 64 * g) * np.exp2(rng.integers(-140, -100, 64 * g))).astype(F32)
    spread = (rng.standard_normal((2048, g)) * 10.0 ** rng.uniform(-14, 7, (2048, 1))).astype(F32).reshape(-1)
    special = np.concatenate([np.zeros(g, F32), np.array([np.nan, np.inf, -np.inf, -0.0] * (g // 4), F32)])
    flat = np.concatenate([special, pat, ties, tiny, spread])
    flat = flat[: len(flat) // d * d]
    return flat.reshape(-1, d)


@pytest.mark.parametrize("fmt", BLOCK)
def test_block_quantize_is_the_reference_rule(fmt):
    """K.block_quantize (butterfly amax, integer E4M3 / E8M0 scales, E2M1 by comparisons, lane
    compaction) equals reference.quantize_blocks on bit patterns, exact ties and tiny blocks, for
    several global scales (NVFP4: block scales that saturate at 448, round to 0 and are subnormal)."""
    compare_block_quantize(fmt)


def compare_block_quantize(fmt):
    rows = _rows(fmt, 130)
    cpu = jax.devices("cpu")[0]
    gs = (1.0, 0.013, 3.1e-5, 1234.5, 2.0**-20) if fmt == "nvfp4" else (None,)
    fn = jax.jit(lambda y, g: K.block_quantize(y, fmt, None if g is None else jnp.full(y.shape, g, jnp.float32)))
    seen = set()
    for g in gs:
        got_s, got_b = (np.asarray(o) for o in fn(jax.device_put(rows, cpu), None if g is None else F32(g)))
        want_s, want_b = reference.quantize_blocks(rows, fmt, None if g is None else F32(g))
        assert_bits_equal(got_s, want_s.view(np.uint8), f"{fmt} block scales g={g}")
        assert_bits_equal(got_b, want_b, f"{fmt} E2M1 bytes g={g}")
        seen |= set(np.unique(want_s.view(np.uint8)).tolist())
    if fmt == "nvfp4":  # every E4M3 scale code: 0, the subnormals, 448 (saturated) and all between
        assert seen == set(range(0x7F)), sorted(set(range(0x7F)) - seen)
    else:
        assert {0, 127, 252} <= seen, sorted(seen)  # 2^-127 (a zero block), 2^0, 2^125 (FLT_MAX's)


@pytest.mark.parametrize("d,group", [(16, 16), (32, 16), (64, 16), (96, 32), (128, 16), (256, 32), (512, 16)])
def test_lane_compaction_takes_every_groups_first_lane(d, group):
    rng = np.random.default_rng(d + group)
    v = rng.integers(0, 256, (3, d)).astype(np.int32)
    got = np.asarray(jax.jit(lambda x: K.compact_lanes(x, group))(v))
    assert_bits_equal(got, v[:, ::group], f"D={d} G={group}")


# ---- the lowering ------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt,layout", [("nvfp4", "flash"), ("mxfp4", "hnd"), ("nvfp4", "head_major")])
def test_lowered_for_tpu_one_custom_call_with_caches_and_block_scale_caches_aliased(fmt, layout):
    """jrc.export for "tpu": one tpu_custom_call; results 2, 3 alias the caches (main's arguments 3, 4),
    results 4, 5 the block-scale caches (arguments 9, 10, as their bytes: a bitcast_convert, no copy);
    the global scales are traced arguments."""
    pytest.importorskip("flatbuffers")
    args, opts = problem(fmt, Case(T=5, QH=8, KH=2, D=128, layout=layout), 41)
    names = ("k_scale_cache", "v_scale_cache") + (("k_scale", "v_scale") if fmt == "nvfp4" else ())
    extra = tuple(opts.pop(n) for n in names)

    def step(*a):
        return jrc.rope_and_cache(*a[:9], **dict(zip(names, a[9:])), **opts, impl="kernel")

    exp = jrc.export(jax.jit(step, donate_argnums=(3, 4, 9, 10)), platforms=["tpu"])(*args, *extra)
    text = exp.mlir_module()
    calls = re.findall(r"stablehlo\.custom_call @tpu_custom_call\(([^)]*)\)", text)
    assert len(calls) == 1
    operands = [o.strip() for o in calls[0].split(",")]
    aliases = {int(o): operands[int(i)] for o, i in
               re.findall(r"output_tuple_indices = \[(\d+)\], operand_index = (\d+)", text)}
    assert aliases[2] == "%arg3" and aliases[3] == "%arg4", aliases
    for r, a in ((4, 9), (5, 10)):
        assert re.search(rf"{re.escape(aliases[r])} = stablehlo\.bitcast_convert %arg{a} ", text), (r, aliases[r])
    assert "stablehlo.copy" not in text
    if fmt == "nvfp4":  # the global scales reach the kernel as operands, not constants
        assert "%arg11" in text.split("custom_call @tpu_custom_call")[0]


# ---- mutations: the checks above see them ----------------------------------------------------------------
@pytest.mark.skipif(ON_TPU, reason="runs a mutated kernel in interpret mode")
@pytest.mark.parametrize("what", ["e2m1 ties up", "den off", "mx exponent", "scale lane", "global scale ignored"])
def test_mutations_fail(monkeypatch, what):
    fmt = "mxfp4" if what in ("mx exponent", "scale lane") else "nvfp4"
    if what == "e2m1 ties up":  # every midpoint rounds up
        monkeypatch.setattr(K, "E2M1_STEPS", tuple((t, True) for t, _ in K.E2M1_STEPS))
    elif what == "den off":  # the denominator s * g with s / 1.5 in place of the block scale s
        real = K.e4m3_value
        monkeypatch.setattr(K, "e4m3_value", lambda c: real(c) / K.from_bits(K.bits(real(c) * 0 + 1.5)))
    elif what == "mx exponent":  # floor(log2(amax)) - 1
        real = K.block_amax_lanes
        monkeypatch.setattr(K, "block_amax_lanes", lambda y, g: real(y, g) * 2)
    elif what == "scale lane":  # each block's scale from the next block
        real = K.compact_lanes
        monkeypatch.setattr(K, "compact_lanes", lambda v, s: real(K.pltpu.roll(v, v.shape[-1] - s, v.ndim - 1), s))
    else:
        real = K.block_quantize
        monkeypatch.setattr(K, "block_quantize",  # both rows quantized with one global scale
                            lambda y, f, g, sep: real(y, f, None if g is None else g * 0 + 0.7, sep))
    with pytest.raises(AssertionError):  # exact ties: the bit patterns (random rows rarely meet one)
        compare_block_quantize(fmt) if what == "e2m1 ties up" else check(fmt, Case(T=6, QH=4, KH=2, D=64), seed=71)
