"""The TPU kernel (kernels/tpu/rope_cache_pallas.py, lowered by backends/tpu.py) against the reference.

Where the kernel runs: on a TPU host, on the TPU (Mosaic); elsewhere on the CPU through Pallas' TPU
interpreter (tests/tpu_interpret.py), which simulates its DMAs and semaphores and raises on a DMA
outside a buffer. Either way each case is also lowered for "tpu" (Pallas' Mosaic lowering, no TPU
needed) and must give one `tpu_custom_call` with the caches aliased. Interpret mode is slow (1-6 s
a case): the default tier runs a sample, the `full` marker the rest of the matrix.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import re
import warnings
import zlib

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

import jax_rope_cache as jrc
from jax_rope_cache import contract
from jax_rope_cache.backends import tpu
from conftest import (Case, assert_bits_equal, canonical_nan_violations, make_problem, reference_op, special_problem,
                      ulp_diff)
from tpu_interpret import tpu_kernel_on_cpu


def _has_tpu() -> bool:
    try:
        return bool(jax.devices("tpu"))
    except RuntimeError:
        return False


ON_TPU = _has_tpu()
WHERE = "tpu" if ON_TPU else "cpu"
K = tpu.kernel_module()
NAMES = ("q_out", "k_out", "key_cache", "value_cache")


def kernel_here(params=None):
    return contextlib.nullcontext() if ON_TPU else tpu_kernel_on_cpu(params)


def _x64(args) -> bool:
    return any(np.asarray(a).dtype == np.int64 for a in args[5:7])


def run_kernel(args, opts, *, layer=None, params=None):
    """The op with impl="kernel" on WHERE (the TPU, or the TPU kernel interpreted on the CPU with
    `params`, by default tpu_interpret.DEFAULT_PARAMS)."""
    with jax.enable_x64(_x64(args)), kernel_here(params):
        dev = jax.devices(WHERE)[0]
        extra = () if layer is None else (jnp.asarray(layer, jnp.int32),)
        fn = jax.jit(lambda *a: jrc.rope_and_cache(*a[:9], **opts, impl="kernel",
                                                   **({} if layer is None else {"layer": a[9]})))
        return [None if o is None else np.asarray(o) for o in fn(*jax.device_put(tuple(args) + extra, dev))]


FP8_NAMES = tuple(d.name for d in contract.FP8_DTYPES)


def tpu_text(args, opts, impl="kernel", **jit_kwargs) -> str:
    """The StableHLO of the op lowered for "tpu" (Mosaic; on any machine)."""
    with jax.enable_x64(_x64(args)):
        fn = jax.jit(lambda *a: jrc.rope_and_cache(*a, **opts, impl=impl), **jit_kwargs)
        return fn.trace(*args).lower(lowering_platforms=("tpu",)).as_text()


def check(case: Case, seed: int | None = None, args=None, opts=None, params=None):
    if args is None:
        args, opts = make_problem(case, zlib.crc32(case.id.encode()) if seed is None else seed)
    text = tpu_text(args, opts)
    assert text.count("stablehlo.custom_call @tpu_custom_call") == 1, case.id
    want = reference_op(*args, **opts)
    got = run_kernel(args, opts, params=params)
    check_results(got, want, args, opts, case.id)


def check_results(got, want, args, opts, what=""):
    """Every result bit-exact; entries of the caches (and scale caches) the reference leaves alone unchanged."""
    names = NAMES + ("k_scale_cache", "v_scale_cache")
    assert len(got) == len(want), (len(got), len(want))
    for name, g, w in zip(names, got, want):
        assert_bits_equal(g, w, f"{name} [{what}]")
    befores = list(args[3:5]) + [opts.get("k_scale_cache"), opts.get("v_scale_cache")]
    for name, g, before, w in zip(names[2:], got[2:], befores, want[2:]):
        if before is None:  # kv_merged: no value cache
            assert g is None and w is None, name
            continue
        untouched = ulp_diff(w, before) == 0
        assert (ulp_diff(g, before)[untouched] == 0).all(), f"{name}: an unwritten entry changed [{what}]"


# ---- the case matrix ------------------------------------------------------------------------------
# Every value of every axis the kernel implements appears in the default sample; the full tier adds
# the other combinations. make_problem pre-fills the caches with random values and mixes slots -1,
# NB*BS, +-2^31 (and 2^40, -2^62 with int64) and positions < 0 and >= max_pos into every case.
SAMPLE = [
    Case(T=7, QH=8, KH=2, D=128),
    Case(T=9, QH=4, KH=2, D=64, is_neox=False, table="full", layout="hnd", table_dtype="bfloat16",
         precision="native", index_dtype="int64"),
    Case(T=5, QH=8, KH=1, D=128, R=64, dtype="float32", table_dtype="float32", is_neox=False),
    Case(T=6, QH=4, KH=2, D=128, R=96, table="full", layout="hnd", dtype="float32", table_dtype="bfloat16",
         index_dtype="int64"),
    Case(T=11, QH=8, KH=2, D=128, layout="kv_merged", BS=8),
    Case(T=7, QH=4, KH=1, D=64, layout="kv_merged", dtype="float32", table_dtype="float32", is_neox=False),
    Case(T=8, QH=4, KH=2, D=64, layout="head_major", table_dtype="bfloat16", index_dtype="int64"),
    Case(T=6, QH=4, KH=2, D=128, layout="hnd", dtype="float16", table_dtype="float16", precision="native"),
    Case(T=5, QH=8, KH=2, D=64, R=32, layout="kv_merged", dtype="float16", is_neox=False),
]
AXES = {
    "dtype": ["bfloat16", "float32", "float16"], "table_dtype": ["float32", "bfloat16", "float16"], "is_neox": [True, False],
    "table": ["half", "full"], "layout": ["flash", "hnd", "head_major", "kv_merged"], "index_dtype": ["int32", "int64"],
    "precision": ["fp32", "native"], "heads": [(8, 1), (4, 2), (32, 8), (16, 4)], "D": [64, 80, 128, 256],
    "partial": [False, True], "BS": [16, 32, 8], "T": [1, 7, 33],
}


def _full_case(i: int) -> Case:
    """Axis values cycled for the first cases (every value appears), then drawn by a generator
    seeded by i; "native" precision only where it is implemented (bf16 inputs and tables)."""
    rng = np.random.default_rng(i)
    pick = {name: vals[(i + j) % len(vals)] if i < 4 else vals[rng.integers(len(vals))]
            for j, (name, vals) in enumerate(AXES.items())}
    qh, kh = pick.pop("heads")
    d = pick.pop("D")
    r = (d // 2 if d % 4 == 0 else d - 16) if pick.pop("partial") else None
    if pick["precision"] == "native":  # "rounded" arithmetic: bf16 or f16 inputs and tables of that dtype
        pick["table_dtype"] = pick["dtype"] = "bfloat16" if pick["dtype"] == "float32" else pick["dtype"]
    return Case(QH=qh, KH=kh, D=d, R=r, **pick)


FULL = [_full_case(i) for i in range(32)]


@pytest.mark.parametrize("case", SAMPLE, ids=[c.id for c in SAMPLE])
def test_matches_reference(case):
    check(case)


@pytest.mark.full
@pytest.mark.parametrize("case", FULL, ids=[c.id for c in FULL])
def test_matches_reference_full(case):
    check(case)


def test_sample_covers_every_axis_value():
    for axis, values in (("dtype", ("bfloat16", "float32", "float16")), ("table_dtype", ("bfloat16", "float32", "float16")),
                         ("is_neox", (True, False)), ("table", ("half", "full")), ("layout", tpu.layouts()),
                         ("index_dtype", ("int32", "int64")), ("precision", ("fp32", "native"))):
        assert set(values) <= {getattr(c, axis) for c in SAMPLE}, axis
    assert {c.R is None for c in SAMPLE} == {True, False}


# ---- runs of slots: prefill batches its DMAs -------------------------------------------------------
def _runs(keys, valid, joins):
    """The runs for_each_run emits for these keys, as (t, n, key) triples, run in a kernel."""
    count = len(keys)

    def kernel(keys_ref, valid_ref, joins_ref, out_ref, n_ref):
        n_ref[0] = 0

        def emit(t, n, k):
            i = n_ref[0]
            out_ref[i, 0], out_ref[i, 1], out_ref[i, 2] = t, n, k
            n_ref[0] = i + 1

        K.for_each_run(jnp.int32(count), [(lambda t: (keys_ref[t], valid_ref[t] == 1, joins_ref[t] == 1), emit)])

    smem = pl.BlockSpec(memory_space=pltpu.SMEM)
    out, n = pl.pallas_call(kernel, in_specs=[smem] * 3, out_specs=[smem, smem],
                            out_shape=[jax.ShapeDtypeStruct((count, 3), jnp.int32),
                                       jax.ShapeDtypeStruct((1,), jnp.int32)],
                            interpret=pltpu.InterpretParams())(
        *(np.asarray(a, np.int32) for a in (keys, valid, joins)))
    return [tuple(int(x) for x in r) for r in np.asarray(out)[: int(n[0])]]


def test_prefill_slots_go_in_one_dma_per_cache_block_and_decode_in_one_per_token():
    bs = 16
    prefill = np.arange(5, 45)  # slots 5..44: cache blocks 0 (5..15), 1, 2 (32..44)
    valid = np.ones(40, bool)
    valid[20] = False  # slot 25 skipped: its block's run splits around it
    joins = prefill % bs != 0
    assert _runs(prefill, valid, joins) == [(0, 11, 5), (11, 9, 16), (21, 6, 26), (27, 13, 32)]
    decode = np.array([77, 3, 40, 41])  # scattered: one DMA each, 40 and 41 adjacent in one block
    assert _runs(decode, np.ones(4, bool), decode % bs != 0) == [(0, 1, 77), (1, 1, 3), (2, 2, 40)]
    positions = np.array([3, 4, 5, 9, 10, 0])  # table rows: runs of consecutive positions
    assert _runs(positions, np.ones(6, bool), np.ones(6, bool)) == [(0, 3, 3), (3, 2, 9), (5, 1, 0)]


@pytest.mark.parametrize("layout", ["flash", "hnd", "kv_merged"])
def test_prefill_over_several_token_blocks(monkeypatch, layout):
    """A chunked prefill (consecutive slots from the middle of a block, consecutive positions) over
    several grid steps of 8 tokens: the runs cross token blocks and cache blocks."""
    monkeypatch.setattr(K, "VMEM_BLOCK_BUDGET", 1)  # the smallest token block: 8
    case = Case(T=45, QH=4, KH=2, D=64, layout=layout, NB=8, max_pos=128)
    args, opts = make_problem(case, seed=7)
    args = list(args)
    args[5] = np.arange(19, 19 + case.T, dtype=np.int32)
    args[5][30] = -1
    args[6] = np.arange(40, 40 + case.T, dtype=np.int32)
    assert tpu.config(contract.check_op(*args, **opts)).block_tokens == 8
    check(case, args=tuple(args), opts=opts)


@pytest.mark.skipif(ON_TPU, reason="the interpreter's DMA orders and race detector")
@pytest.mark.parametrize("order,layout", [("eager", "hnd"), ("on_wait", "hnd"), ("eager", "kv_merged"),
                                          ("on_wait", "kv_merged")])
def test_no_dma_race_whenever_the_copies_run(order, layout):
    """A DMA may run any time between its start and its wait. The interpreter runs them at the
    start ("eager") or at the wait ("on_wait"), with its race detector on: a copy that reads a
    block before the kernel writes it, or whose buffer is rewritten before it completes, fails."""
    case = Case(T=20, QH=4, KH=2, D=64, layout=layout)
    args, opts = make_problem(case, seed=8)
    args = args[:5] + (np.concatenate([np.arange(3, 17), [40, -1, 90, 41, 60, 200]]).astype(np.int32),) + args[6:]
    check(case, args=args, opts=opts, params=pltpu.InterpretParams(dma_execution_mode=order, detect_races=True))


# ---- options -------------------------------------------------------------------------------------
@pytest.mark.parametrize("weights", ["bfloat16", "float32", "float16"])
def test_qk_norm(weights):
    rng = np.random.default_rng(11)
    case = Case(T=6, QH=8, KH=2, D=128, R=64 if weights == "float32" else None,
                dtype="float16" if weights == "float16" else "bfloat16")
    args, opts = make_problem(case, seed=12)
    wdt = np.dtype(getattr(ml_dtypes, weights, None) or weights)
    opts.update(q_norm_weight=rng.uniform(0.2, 2.0, case.D).astype(wdt),
                k_norm_weight=rng.uniform(0.2, 2.0, case.D).astype(wdt), norm_eps=1e-6)
    check(case, args=args, opts=opts)


def test_qk_norm_f32_odd_head_dim_and_one_norm():
    """D = 80 (the tree's odd leaves: 80 = 16 * 5) and only the k norm, f32 inputs and weight."""
    rng = np.random.default_rng(13)
    case = Case(T=5, QH=4, KH=2, D=80, dtype="float32", layout="hnd")
    args, opts = make_problem(case, seed=14)
    opts.update(k_norm_weight=rng.uniform(0.2, 2.0, case.D).astype(np.float32), norm_eps=1e-5)
    check(case, args=args, opts=opts)


@pytest.mark.parametrize("layer,layout", [(3, "flash"), (2, "hnd"), (-1, "flash"), (4, "hnd"), (1, "head_major"),
                                          (3, "kv_merged"), (4, "kv_merged")])
def test_stacked_layers_with_a_traced_layer(layer, layout):
    """Caches [4, ...]: layer `layer` (a traced scalar) is written in place; a layer outside [0, 4)
    writes nothing."""
    case = Case(T=7, QH=8, KH=2, D=64, layout=layout)
    args, opts = make_problem(case, seed=21)
    rng = np.random.default_rng(22)
    stacked = [None if c is None else  # kv_merged: no value cache
               np.stack([c] + [rng.standard_normal(c.shape).astype(c.dtype) for _ in range(3)], 1).swapaxes(0, 1)
               for c in args[3:5]]  # [4, NB, ...], layer 0 the original caches
    args = args[:3] + tuple(stacked) + args[5:]
    want = reference_op(*args, **opts, layer=np.array(layer, np.int32))  # an array: no static range check
    got = run_kernel(args, opts, layer=layer)
    for name, g, w in zip(NAMES, got, want):
        assert_bits_equal(g, w, name)
    if not 0 <= layer < 4:
        assert_bits_equal(got[2], args[3], "key_cache untouched")
        if args[4] is not None:
            assert_bits_equal(got[3], args[4], "value_cache untouched")


SPECIAL = ((jnp.bfloat16, np.float32, "fp32"), (np.float32, np.float32, "fp32"), (jnp.bfloat16, jnp.bfloat16, "native"),
           (np.float16, np.float32, "fp32"), (np.float16, np.float16, "native"))


@pytest.mark.parametrize("layout", ["flash", "kv_merged"])
def test_vmap_over_batched_caches(layout):
    """vmap runs the kernel per batch element through the stacked-layer index (primitive's batching
    rule): each element's caches are its own."""
    case = Case(T=3, QH=4, KH=2, D=64, layout=layout)
    probs = [make_problem(case, seed=90 + i) for i in range(2)]
    opts = probs[0][1]
    batched = tuple(None if probs[0][0][i] is None else np.stack([p[0][i] for p in probs]) for i in range(9))
    with kernel_here():
        fn = jax.jit(jax.vmap(lambda *a: jrc.rope_and_cache(*a, **opts, impl="kernel")))
        got = [None if o is None else np.asarray(o) for o in fn(*jax.device_put(batched, jax.devices(WHERE)[0]))]
    for b, (args, _) in enumerate(probs):
        for name, g, w in zip(NAMES, got, reference_op(*args, **opts)):
            if w is None:  # kv_merged: no value cache
                assert g is None, name
                continue
            assert_bits_equal(g[b], w, f"{name}[{b}]")


def test_kv_merged_with_qk_norm_and_partial_rotary():
    """The normalised, partly rotated K rows are the ones interleaved with V."""
    rng = np.random.default_rng(15)
    case = Case(T=9, QH=8, KH=2, D=128, R=64, layout="kv_merged", is_neox=False)
    args, opts = make_problem(case, seed=16)
    opts.update(q_norm_weight=rng.uniform(0.2, 2.0, case.D).astype(ml_dtypes.bfloat16),
                k_norm_weight=rng.uniform(0.2, 2.0, case.D).astype(ml_dtypes.bfloat16), norm_eps=1e-6)
    check(case, args=args, opts=opts)


@pytest.mark.parametrize("dt,tdt,prec", SPECIAL, ids=[f"{np.dtype(d).name}-{np.dtype(t).name}-{p}" for d, t, p in SPECIAL])
def test_special_values_bit_exact(dt, tdt, prec):
    """Every combination of NaNs with payloads, +-inf, +-0, +-max as x, partner, cos and sin
    (conftest.special_problem), with the values that make subnormals (the smallest subnormal and
    normal) replaced: the TPU flushes subnormals (docs/numerics.md)."""
    args, opts = special_problem(dt, tdt, precision=prec)
    args = _normal_only(args)
    want = reference_op(*args, **opts)
    got = run_kernel(args, opts)
    for name, g, w in zip(NAMES, got, want):
        assert_bits_equal(g, w, name)


def _normal_only(args):
    """Inputs with every value of magnitude <= the smallest normal (but 0) replaced by 0.5."""
    def fix(a):
        f = np.asarray(a).astype(np.float32)
        tiny = (f != 0) & (np.abs(f) <= np.float32(2.0**-126))
        return np.where(tiny, np.asarray(0.5, a.dtype), a).astype(a.dtype)
    return tuple(a if i in (5, 6) else fix(a) for i, a in enumerate(args))


def _flushed(args):
    """Inputs with subnormals replaced by zeros of their sign (what a flush-to-zero unit reads)."""
    def fix(a):
        f = np.asarray(a).astype(np.float32)
        tiny = (f != 0) & (np.abs(f) < np.float32(2.0**-126))
        return np.where(tiny, np.copysign(np.float32(0), f).astype(a.dtype), a).astype(a.dtype)
    return tuple(a if i in (5, 6) else fix(a) for i, a in enumerate(args))


def test_subnormals_are_flushed():
    """With subnormals among the inputs (no +-max): every element is the reference's bits, or the
    reference's bits with subnormal inputs read as zeros, or both results are within 2^-124 of zero
    (a subnormal product or result flushed); NaNs are the canonical one."""
    args, opts = special_problem(jnp.bfloat16, np.float32, precision="fp32", extremes=False)
    want = reference_op(*args, **opts)
    want_flushed = reference_op(*_flushed(args), **opts)
    got = run_kernel(args, opts)
    for name, g, w, wf in zip(NAMES[:2], got, want, want_flushed):
        tiny = (np.abs(g.astype(np.float32)) <= 2.0**-124) & (np.abs(w.astype(np.float32)) <= 2.0**-124)
        ok = (ulp_diff(g, w) == 0) | (ulp_diff(g, wf) == 0) | tiny
        assert ok.all(), f"{name}: {int((~ok).sum())} elements beyond the flush-to-zero rule"
    assert canonical_nan_violations(got[0][..., :2]) == canonical_nan_violations(got[1][..., :2]) == 0  # rotated


def test_zero_tokens():
    args, opts = make_problem(Case(T=0), seed=1)
    got = run_kernel(args, opts)
    assert got[0].shape == (0, 8, 128)
    assert_bits_equal(got[2], args[3], "key_cache")


# ---- index safety ----------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", tpu.layouts())
def test_every_slot_value_writes_only_its_slot(layout):
    """All NB*BS slots once (a random order), next to -1, NB*BS, +-2^31-ish and int64 extremes:
    interpret mode raises on any DMA outside a buffer, and the caches equal the reference's."""
    case = Case(T=32 + 8, QH=2, KH=2 if layout == "kv_merged" else 1, D=64, BS=8, NB=4, index_dtype="int64",
                layout=layout)
    args, opts = make_problem(case, seed=31)
    rng = np.random.default_rng(32)
    nslots = 4 * 8
    slots = np.concatenate([rng.permutation(nslots), [-1, nslots, nslots + 1, 2**31 - 1, -(2**31), 2**40, -(2**62),
                                                      2**63 - 1]]).astype(np.int64)
    pos = rng.integers(-(2**40), 2**40, case.T).astype(np.int64)
    args = args[:5] + (slots, pos) + args[7:]
    check(case, args=args, opts=opts)


@pytest.mark.skipif(ON_TPU, reason="a DMA out of bounds on a TPU faults the device; interpret mode raises")
def test_interpret_mode_catches_a_dma_outside_the_cache(monkeypatch):
    """The check the index-safety tests rely on: a kernel told the cache has one block more than it
    has writes slot NB*BS into it, and the interpreter raises instead of writing."""
    case = Case(T=3, QH=2, KH=1, D=64, BS=8, NB=4)
    args, opts = make_problem(case, seed=33)
    args = args[:5] + (np.array([0, 4 * 8 + 3, 5], np.int32),) + args[6:]
    real = tpu.config
    monkeypatch.setattr(tpu, "config", lambda spec: real(spec).__class__(
        **{**real(spec).__dict__, "num_blocks": spec.num_blocks + 1}))
    with pytest.raises(Exception, match="Out-of-bounds write"):
        run_kernel(args, opts)


@pytest.mark.skipif(ON_TPU, reason="runs a mutated kernel in interpret mode")
def test_mutation_kv_merged_k_and_v_heads_swapped_fails(monkeypatch):
    """The kv_merged checks see which row holds K and which V: a kernel writing K head h to row
    2h+1 and V head h to 2h fails them."""
    case = Case(T=6, QH=4, KH=2, D=64, layout="kv_merged")
    args, opts = make_problem(case, seed=35)
    check(case, args=args, opts=opts)
    monkeypatch.setattr(K, "KV_MERGED_ROWS", (1, 0))
    with pytest.raises(AssertionError, match="key_cache"):
        check(case, args=args, opts=opts)


# ---- the lowering: one Mosaic custom call, caches aliased, policy ---------------------------------
@pytest.mark.parametrize("layout", ["flash", "head_major", "kv_merged"])
def test_lowered_for_tpu_one_custom_call_with_the_caches_aliased(layout):
    """jrc.export for "tpu" on any machine: one tpu_custom_call whose aliased operands are the
    key and value caches (main's arguments 3 and 4) -> results 2 and 3; no cache-shaped copy.
    kv_merged: the one cache (argument 3) -> result 2; the value operand is the op's placeholder."""
    pytest.importorskip("flatbuffers")
    args, opts = make_problem(Case(T=5, QH=8, KH=2, D=128, layout=layout), seed=41)
    merged = args[4] is None
    step = jax.jit(lambda *a: jrc.rope_and_cache(*a, **opts, impl="kernel"), donate_argnums=(3,) if merged else (3, 4))
    exp = jrc.export(step, platforms=["tpu"])(*args)
    text = exp.mlir_module()
    calls = re.findall(r"stablehlo\.custom_call @tpu_custom_call\(([^)]*)\)", text)
    assert len(calls) == 1
    operands = [o.strip() for o in calls[0].split(",")]
    aliases = dict((int(o), operands[int(i)]) for o, i in
                   re.findall(r"output_tuple_indices = \[(\d+)\], operand_index = (\d+)", text))
    assert aliases[2] == "%arg3", aliases
    if not merged:
        assert aliases[3] == "%arg4", aliases
    assert "stablehlo.copy" not in text
    assert jax.export.deserialize(exp.serialize()).platforms == ("tpu",)


@pytest.mark.parametrize("what,opts,match", [
    ("xpacked", dict(layout="xpacked"), "layout 'xpacked'"),
    ("native f32 tables", dict(precision="native"), "precision='native'"),
])
def test_refused_options_name_what_and_fall_back_once(what, opts, match):
    """impl="kernel" raises naming what the TPU kernel lacks; impl=None lowers the XLA path for
    "tpu" with one warning."""
    args, kw = make_problem(Case(T=4, QH=4, KH=2, D=64, **opts), seed=51)
    with pytest.raises(NotImplementedError, match=f"on TPU: the kernel does not implement {re.escape(match)}"):
        tpu_text(args, kw)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        text = tpu_text(args, kw, impl=None)
        tpu_text(args, kw, impl=None)
    assert "tpu_custom_call" not in text
    ours = [w for w in seen if "rope_and_cache" in str(w.message)]
    assert len(ours) == 1 and "falling back to the XLA implementation on TPU" in str(ours[0].message), ours


def test_a_call_longer_than_the_scalar_prefetch_allows_is_refused():
    s = jax.ShapeDtypeStruct
    t = tpu.MAX_TOKENS + 1
    bf = jnp.bfloat16
    args = (s((t, 8, 128), bf), s((t, 2, 128), bf), s((t, 2, 128), bf), s((64, 16, 2, 128), bf),
            s((64, 16, 2, 128), bf), s((t,), jnp.int32), s((t,), jnp.int32), s((64, 64), jnp.float32),
            s((64, 64), jnp.float32))
    with pytest.raises(NotImplementedError, match=f"calls of {t} > 65536 tokens"):
        jax.jit(lambda *a: jrc.rope_and_cache(*a, impl="kernel")).trace(*args).lower(lowering_platforms=("tpu",))


def test_an_mrope_call_longer_than_the_scalar_prefetch_allows_is_refused():
    """Three position streams: 16 bytes of scalar prefetch a token, half the tokens."""
    s = jax.ShapeDtypeStruct
    t = tpu.MAX_TOKENS // 2 + 1
    bf = jnp.bfloat16
    args = (s((t, 8, 128), bf), s((t, 2, 128), bf), s((t, 2, 128), bf), s((64, 16, 2, 128), bf),
            s((64, 16, 2, 128), bf), s((t,), jnp.int32), s((3, t), jnp.int32), s((64, 64), jnp.float32),
            s((64, 64), jnp.float32))
    with pytest.raises(NotImplementedError, match=f"calls of {t} > {t - 1} tokens"):
        jax.jit(lambda *a: jrc.rope_and_cache(*a, impl="kernel", mrope_section=(24, 20, 20))).trace(*args).lower(
            lowering_platforms=("tpu",))


def test_impl_none_takes_the_kernel_only_when_mosaic_lowers_it(monkeypatch):
    args, opts = make_problem(Case(T=4, QH=4, KH=2, D=64), seed=53)
    assert "tpu_custom_call" in tpu_text(args, opts, impl=None)

    def rejected(*a, **k):
        raise pltpu.LoweringException("Not implemented: a shape Mosaic rejects")

    monkeypatch.setattr(K, "rope_and_cache", rejected)
    with pytest.warns(RuntimeWarning, match="Mosaic's lowering accepts .*a shape Mosaic rejects"):
        text = tpu_text(args, opts, impl=None)
    assert "tpu_custom_call" not in text and "stablehlo.scatter" in text
    with pytest.raises(pltpu.LoweringException, match="a shape Mosaic rejects"):
        tpu_text(args, opts)


@pytest.mark.skipif(ON_TPU, reason="the interpret switch is for hosts without a TPU")
def test_the_interpret_switch_is_scoped():
    """Inside tpu_kernel_on_cpu the CPU lowering is the interpreted TPU kernel (no C++ handler
    call); outside it the C++ handler again."""
    args, opts = make_problem(Case(T=3, QH=4, KH=2, D=64), seed=54)

    def text():
        return jax.jit(lambda *a: jrc.rope_and_cache(*a, **opts, impl="kernel")).trace(*args).lower().as_text()

    with tpu_kernel_on_cpu():
        inside = text()
    assert "jax_rope_cache_cpu" not in inside and "tpu_custom_call" not in inside
    assert "jax_rope_cache_cpu" in text()


# ---- the QK-norm's correctly rounded division and square root -------------------------------------
def _nudged(f, off):
    """`f` (the hardware operation) off by `off` ulps: what an approximate divide or sqrt gives."""
    return lambda *x: K.from_bits(K.bits(f(*x)) + np.uint32(off % 2**32))


@pytest.mark.parametrize("off", [-2, -1, 0, 1, 2])
def test_division_and_square_root_correct_an_approximation_to_the_rounded_result(off):
    """div_rn and sqrt_rn give the correctly rounded f32 result (float64 then rounded: exact for
    24-bit operands) from a start up to 2 ulps off, over the normal range; the TPU's own divide and
    square root are not assumed correctly rounded."""
    rng = np.random.default_rng(60 + off)
    n = 20000
    a, b, m = ((rng.uniform(1, 2, n) * 2.0 ** rng.integers(-e, e, n)).astype(np.float32) for e in (60, 60, 125))
    a[:4], b[:4] = [1.0, 3.0, 2.0, 1.0], [3.0, 1.0, 1.0, 1.0 + 2.0**-23]  # exact, 1/3, powers of two
    m[:6] = [1.0, 4.0, 2.0, 1.0 + 2.0**-23, 4.0 - 2.0**-21, 1.0 - 2.0**-24]  # the binade edges
    cpu = jax.devices("cpu")[0]  # plain jax code: the CPU on any host
    a, b, m = jax.device_put((a, b, m), cpu)
    div = jax.jit(lambda a, b: K.div_rn(a, b, approx=_nudged(jnp.divide, off)))
    sqrt = jax.jit(lambda m: K.sqrt_rn(m, approx=_nudged(jnp.sqrt, off)))
    a, b, m = (np.asarray(x) for x in (a, b, m))
    assert_bits_equal(np.asarray(div(a, b)), (a.astype(np.float64) / b).astype(np.float32), "a / b")
    assert_bits_equal(np.asarray(sqrt(m)), np.sqrt(m.astype(np.float64)).astype(np.float32), "sqrt(m)")
    special = jax.device_put(np.array([0.0, np.inf, np.nan], np.float32), cpu)
    assert np.array_equal(np.asarray(div(special, jnp.ones(3, np.float32, device=cpu))), special, equal_nan=True)
    assert np.array_equal(np.asarray(sqrt(special)), special, equal_nan=True)


def test_the_lane_tree_sum_is_the_reference_tree():
    """lane_tree_sum (lane rolls) adds in reference.tree_sum's order for even, odd and
    power-of-two widths: rows where other orders give other sums."""
    from jax_rope_cache import reference

    rng = np.random.default_rng(70)
    for d in (64, 80, 96, 128, 192, 256):
        x = (rng.standard_normal((64, d)) * 2.0 ** rng.integers(-12, 12, (64, d))).astype(np.float32)
        got = np.asarray(jax.jit(K.lane_tree_sum)(jax.device_put(x, jax.devices("cpu")[0])))[:, 0]
        assert_bits_equal(got, reference.tree_sum(x), f"D={d}")
        assert (got != x.sum(axis=1, dtype=np.float32)).any() or d == 64


# ---- layouts by their axes ---------------------------------------------------------------------------
@pytest.mark.skipif(ON_TPU, reason="calls the kernel module in interpret mode")
def test_a_head_major_cache_is_written_from_its_axes_alone():
    """The kernel derives its DMA windows from a cache's axes (contract.LAYOUT_TABLE's names), so a
    layout with NB not leading, JAX's paged-attention [KH, NB, BS, D], needs no kernel code: its
    caches equal the flash reference's caches transposed."""
    case = Case(T=9, QH=4, KH=2, D=64, layout="flash")
    args, opts = make_problem(case, seed=80)
    spec = contract.check_op(*args, **opts)
    want = reference_op(*args, **opts)
    head_major = ("KH", "NB", "BS", "D")
    assert K.row_dma(head_major) == "per_head"
    cfg = tpu.config(spec).__class__(**{**tpu.config(spec).__dict__, "key_axes": head_major,
                                        "value_axes": head_major})
    kc, vc = (np.ascontiguousarray(c.transpose(2, 0, 1, 3)) for c in args[3:5])  # [KH, NB, BS, D]
    slots = np.where((args[5] >= 0) & (args[5] < spec.num_slots), args[5], -1).astype(np.int32)
    pos = np.clip(args[6], 0, spec.max_pos - 1).astype(np.int32)
    run = jax.jit(lambda *a: K.rope_and_cache(*a, cfg=cfg, interpret=pltpu.InterpretParams()))
    got = [np.asarray(o) for o in run(*args[:3], kc, vc, slots, pos, *args[7:9], np.zeros(1, np.int32))]
    assert_bits_equal(got[0], want[0], "q_out")
    assert_bits_equal(got[2], want[2].transpose(2, 0, 1, 3), "key_cache")
    assert_bits_equal(got[3], want[3].transpose(2, 0, 1, 3), "value_cache")


# ---- fp8 caches ------------------------------------------------------------------------------------
def _f32_patterns():
    """Every f32 upper half (sign, exponent, 7 mantissa bits) with low halves that make exact ties,
    values just above and below them, and random ones: every rounding case of every fp8 format."""
    rng = np.random.default_rng(100)
    hi = np.arange(1 << 16, dtype=np.uint32) << 16
    lows = np.array([0, 1, 0x7FFF, 0x8000, 0xFFFF, 0x4000], np.uint32)
    u = (hi[:, None] | lows[None, :]).ravel()
    return np.concatenate([u, rng.integers(0, 2**32, 1 << 18, dtype=np.uint64).astype(np.uint32)]).view(np.float32)


@pytest.mark.parametrize("name", FP8_NAMES)
def test_fp8_conversion_is_the_reference_rounding(name):
    """f8_codes (integer arithmetic on the f32 bits) equals reference.quantize with scale 1 (clamp to
    +-max, round to nearest even, canonical NaN, subnormals kept) on every f32 exponent and sign,
    with ties and their neighbours in every mantissa position."""
    from jax_rope_cache import reference

    x = _f32_patterns()
    cdt = np.dtype(getattr(ml_dtypes, name))
    got = np.asarray(jax.jit(lambda y: K.f8_codes(y, name))(jax.device_put(x, jax.devices("cpu")[0])))
    want = reference.quantize(x, cdt, np.float32(1.0)).view(np.uint8)
    bad = np.flatnonzero(got != want)
    assert len(bad) == 0, f"{len(bad)} differ, first {x.view(np.uint32)[bad[0]]:#x}: {got[bad[0]]:#x} != {want[bad[0]]:#x}"


def test_inverse_and_token_scales_are_the_reference_ones():
    """1/scale correctly rounded with the reference's overflow rule (0, -0, below 2^-128, inf, NaN,
    negative); the per-token scale r32(max(amax, 1e-8) / max) with NaN and inf left out of amax."""
    from jax_rope_cache import reference

    rng = np.random.default_rng(101)
    s = (rng.uniform(1, 2, 4000) * 2.0 ** rng.integers(-125, 126, 4000) * rng.choice([-1, 1], 4000)).astype(np.float32)
    s[:6] = [0.0, -0.0, np.inf, -np.inf, np.nan, 2.0**-126]
    cpu = jax.devices("cpu")[0]
    got = np.asarray(jax.jit(K.inverse_scale)(jax.device_put(s, cpu)))
    want = np.array([reference.inverse_scale(x) for x in s], np.float32)
    assert_bits_equal(got, want, "inverse_scale")
    rows = (rng.standard_normal((64, 4, 80)) * 10.0 ** rng.uniform(-12, 6, (64, 4, 1))).astype(np.float32)
    rows[0, 0] = 0
    rows[1, 1, 3], rows[1, 2, 5], rows[2, 0, 7] = np.inf, -np.inf, np.nan
    for name in FP8_NAMES:
        got = np.asarray(jax.jit(lambda y: K.token_scale(K.row_amax(y), name))(jax.device_put(rows, cpu)))[..., 0]
        assert_bits_equal(got, reference.token_scale(rows, np.dtype(getattr(ml_dtypes, name))), name)


FP8_SAMPLE = [
    Case(T=7, QH=4, KH=2, D=128, cache_dtype="float8_e4m3fn"),
    Case(T=9, QH=4, KH=2, D=64, cache_dtype="float8_e5m2", layout="kv_merged", is_neox=False, R=32),
    Case(T=6, QH=8, KH=2, D=64, cache_dtype="float8_e4m3fnuz", layout="head_major", dtype="float32",
         index_dtype="int64"),
]
FP8_FULL = [Case(T=t, QH=4, KH=kh, D=d, cache_dtype=c, layout=lay, dtype=dt, table="full" if t == 33 else "half",
                 precision="native" if dt == "bfloat16" and t == 1 else "fp32",
                 table_dtype="bfloat16" if dt == "bfloat16" and t == 1 else "float32")
            for t, kh, d, lay, dt, c in [(1, 2, 128, "hnd", "bfloat16", "float8_e4m3fn"),
                                         (33, 1, 80, "flash", "float32", "float8_e5m2"),
                                         (7, 4, 256, "kv_merged", "float32", "float8_e4m3fnuz"),
                                         (12, 2, 64, "head_major", "bfloat16", "float8_e5m2"),
                                         (5, 2, 128, "flash", "bfloat16", "float8_e4m3fnuz")]]


def _fp8_scales(case, opts, kind, seed):
    """The static scales of a case: scalars (make_problem's), per head [KH] (KH > 1), or scales so
    small that most values saturate."""
    rng = np.random.default_rng(seed)
    if kind == "heads" and case.KH > 1:
        opts.update(k_scale=rng.uniform(0.02, 0.5, case.KH).astype(np.float32),
                    v_scale=rng.uniform(0.02, 0.5, case.KH).astype(ml_dtypes.bfloat16))
    elif kind == "saturating":
        opts.update(k_scale=np.float32(2e-3), v_scale=np.float32(5e-6))
    return opts


FP8_KINDS = [(c, "scalar") for c in FP8_SAMPLE] + [(FP8_SAMPLE[0], "heads"), (FP8_SAMPLE[1], "saturating")]
FP8_KINDS_FULL = [(c, k) for c in FP8_SAMPLE for k in ("heads", "saturating") if (c, k) not in FP8_KINDS]


def _fp8_static(case, kind):
    args, opts = make_problem(case, zlib.crc32(case.id.encode()))
    args = list(args)
    args[2] = args[2].copy()
    args[2][1, 0, :3] = [np.nan, np.inf, -np.inf]  # v: NaN stores the canonical code, +-inf saturates
    check(case, args=tuple(args), opts=_fp8_scales(case, opts, kind, 5))


@pytest.mark.parametrize("case,kind", FP8_KINDS, ids=[f"{c.id}-{k}" for c, k in FP8_KINDS])
def test_fp8_static_scales(case, kind):
    """Every fp8 dtype, scalar scales; per-head and saturating scales once (the rest: full tier)."""
    _fp8_static(case, kind)


@pytest.mark.full
@pytest.mark.parametrize("case,kind", FP8_KINDS_FULL, ids=[f"{c.id}-{k}" for c, k in FP8_KINDS_FULL])
def test_fp8_static_scales_other_kinds(case, kind):
    _fp8_static(case, kind)


@pytest.mark.full
@pytest.mark.parametrize("case", FP8_FULL, ids=[c.id for c in FP8_FULL])
def test_fp8_static_scales_full(case):
    args, opts = make_problem(case, zlib.crc32(case.id.encode()))
    check(case, args=args, opts=_fp8_scales(case, opts, "heads", 6))


TOKEN_SAMPLE = [
    (Case(T=7, QH=4, KH=2, D=128, cache_dtype="float8_e4m3fn"), None),
    (Case(T=9, QH=4, KH=2, D=64, cache_dtype="float8_e5m2", layout="head_major", index_dtype="int64"), 3),
    (Case(T=8, QH=4, KH=2, D=64, cache_dtype="float8_e4m3fnuz", layout="kv_merged", dtype="float32", R=32), None),
    (Case(T=6, QH=8, KH=1, D=80, cache_dtype="float8_e4m3fn", layout="hnd", is_neox=False, dtype="float16"), 2),
]


@pytest.mark.parametrize("case,layers", TOKEN_SAMPLE, ids=[c.id + f"-L{n}" for c, n in TOKEN_SAMPLE])
def test_fp8_per_token_scales(case, layers):
    """Scale caches written per (token, kv head) and aliased: rows of magnitudes 1e-3..1e3, an
    all-zero row, rows with inf and NaN (tests/test_fp8_per_token.per_token_problem); stacked
    layers with the last layer written."""
    from test_fp8_per_token import per_token_problem

    args, opts = per_token_problem(case, zlib.crc32(case.id.encode()), layers=layers, norm=case.KH == 1)
    check(case, args=args, opts=opts)


@pytest.mark.parametrize("layout", ["flash", "kv_merged"])
def test_fp8_per_token_over_several_token_blocks(monkeypatch, layout):
    """Token blocks of 8 over a chunked prefill: each block's scales go to its own lanes."""
    from test_fp8_per_token import per_token_problem

    monkeypatch.setattr(K, "VMEM_BLOCK_BUDGET", 1)
    case = Case(T=21, QH=4, KH=2, D=64, cache_dtype="float8_e5m2", layout=layout, NB=8, max_pos=128)
    args, opts = per_token_problem(case, seed=9)
    args = list(args)
    args[5] = np.arange(13, 13 + case.T, dtype=np.int32)
    args[5][10] = -1
    assert tpu.config(contract.check_op(*args, **opts)).block_tokens == 8
    check(case, args=tuple(args), opts=opts)


@pytest.mark.skipif(ON_TPU, reason="the interpreter's DMA orders and race detector")
@pytest.mark.parametrize("order", ["eager", "on_wait"])
def test_fp8_no_dma_race_whenever_the_copies_run(order):
    from test_fp8_per_token import per_token_problem

    case = Case(T=12, QH=4, KH=2, D=64, cache_dtype="float8_e4m3fn")
    args, opts = per_token_problem(case, seed=10)
    check(case, args=args, opts=opts, params=pltpu.InterpretParams(dma_execution_mode=order, detect_races=True))


@pytest.mark.parametrize("layout", tpu.layouts())
def test_fp8_every_slot_value_writes_only_its_slot(layout):
    """Per-token scales: every slot once next to out-of-range ones; the interpreter raises on a DMA
    outside the caches or the scale caches."""
    from test_fp8_per_token import per_token_problem

    case = Case(T=32 + 6, QH=2, KH=2, D=64, BS=8, NB=4, index_dtype="int64", layout=layout,
                cache_dtype="float8_e4m3fn")
    args, opts = per_token_problem(case, seed=36)
    rng = np.random.default_rng(37)
    slots = np.concatenate([rng.permutation(32), [-1, 32, 2**31 - 1, -(2**31), 2**40, -(2**62)]]).astype(np.int64)
    check(case, args=args[:5] + (slots,) + args[6:], opts=opts)


@pytest.mark.parametrize("what", ["static", "token"])
def test_fp8_lowered_for_tpu_with_the_caches_aliased(what):
    """One tpu_custom_call; per-token scales: the scale caches (main's arguments 5 and 6 here) are
    aliased to results 4 and 5 as well."""
    pytest.importorskip("flatbuffers")
    case = Case(T=5, QH=8, KH=2, D=128, cache_dtype="float8_e4m3fn")
    if what == "token":
        from test_fp8_per_token import per_token_problem

        args, opts = per_token_problem(case, seed=42)
        ksc, vsc = opts.pop("k_scale_cache"), opts.pop("v_scale_cache")
        step = jax.jit(lambda q, k, v, kc, vc, ks, vs, *r: jrc.rope_and_cache(
            q, k, v, kc, vc, *r, k_scale_cache=ks, v_scale_cache=vs, **opts, impl="kernel"),
            donate_argnums=(3, 4, 5, 6))
        args = args[:5] + (ksc, vsc) + args[5:]
    else:
        args, opts = make_problem(case, seed=42)
        step = jax.jit(lambda *a: jrc.rope_and_cache(*a, **opts, impl="kernel"), donate_argnums=(3, 4))
    text = jrc.export(step, platforms=["tpu"])(*args).mlir_module()
    calls = re.findall(r"stablehlo\.custom_call @tpu_custom_call\(([^)]*)\)", text)
    assert len(calls) == 1
    operands = [o.strip() for o in calls[0].split(",")]
    aliases = dict((int(o), operands[int(i)]) for o, i in
                   re.findall(r"output_tuple_indices = \[(\d+)\], operand_index = (\d+)", text))
    want = {2: "%arg3", 3: "%arg4"} if what == "static" else {2: "%arg3", 3: "%arg4", 4: "%arg5", 5: "%arg6"}
    assert aliases == want, aliases
    assert "stablehlo.copy" not in text


@pytest.mark.skipif(ON_TPU, reason="runs a mutated kernel in interpret mode")
def test_mutation_fp8_round_toward_zero_fails(monkeypatch):
    """The fp8 checks see the rounding: a conversion that truncates fails them."""
    case = Case(T=6, QH=4, KH=2, D=64, cache_dtype="float8_e4m3fn")
    args, opts = make_problem(case, seed=38)
    check(case, args=args, opts=opts)
    monkeypatch.setattr(K, "_shift_rne", lambda m, s: m >> s)
    real = K.f8_codes
    monkeypatch.setattr(K, "f8_codes", lambda y, name: real(K.from_bits(K.bits(y) & np.uint32(0xFFF00000)), name))
    with pytest.raises(AssertionError, match="key_cache|value_cache"):
        check(case, args=args, opts=opts)


# ---- float16 ---------------------------------------------------------------------------------------
def test_f16_widening_and_rounding_are_the_reference_ones():
    """f16_widen on all 65536 f16 patterns: exact values, NaN payloads moved (sign, 0x7F800000,
    mantissa << 13); narrow_codes to f16 equals reference.to_dtype (nearest even, overflow to inf,
    subnormals kept, NaN 0x7FFF) on every f32 exponent with ties and their neighbours."""
    from jax_rope_cache import reference

    cpu = jax.devices("cpu")[0]
    h = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    got = np.asarray(jax.jit(K.f16_widen)(jax.device_put(h, cpu))).view(np.uint32)
    f = h.view(np.float16)
    want = f.astype(np.float32).view(np.uint32)
    nan = np.isnan(f)
    want[nan] = ((h[nan].astype(np.uint32) & 0x8000) << 16) | 0x7F800000 | ((h[nan].astype(np.uint32) & 0x3FF) << 13)
    assert_bits_equal(got.view(np.float32), want.view(np.float32), "f16_widen")
    x = _f32_patterns()
    got = np.asarray(jax.jit(lambda y: K.narrow_codes(y, K.F16_FORMAT, 16).astype(jnp.uint16))(jax.device_put(x, cpu)))
    want = reference.to_dtype(x, np.float16).view(np.uint16)
    bad = np.flatnonzero(got != want)
    assert len(bad) == 0, f"{len(bad)} differ, first {x.view(np.uint32)[bad[0]]:#x}: {got[bad[0]]:#x} != {want[bad[0]]:#x}"


# ---- multimodal RoPE ---------------------------------------------------------------------------------
def _mrope_cases():
    from test_mrope import QWEN25_VL, QWEN3_VL

    return [
        (Case(T=37, QH=8, KH=2, D=128), QWEN3_VL, True, "qk"),
        (Case(T=5, QH=4, KH=2, D=128, layout="hnd", precision="native", table_dtype="bfloat16", table="full"),
         QWEN25_VL, False, ""),
        (Case(T=9, QH=2, KH=2, D=80, R=64, is_neox=False, table="full", dtype="float32", table_dtype="bfloat16",
              layout="kv_merged", index_dtype="int64"), (12, 10, 10), True, "k"),
        (Case(T=13, QH=4, KH=1, D=64, R=48, is_neox=False, dtype="float16", cache_dtype="float8_e4m3fn",
              layout="head_major"), (8, 8, 8), False, "q"),
        (Case(T=1, QH=16, KH=1, D=128, precision="native", table_dtype="bfloat16"), QWEN3_VL, True, "qk"),
        (Case(T=20, QH=8, KH=1, D=256, R=128, table="full"), (16, 24, 24), False, ""),
    ]


MROPE_DEFAULT = (0, 2, 3)  # the rest: full tier
MROPE_IDS = [f"{c.id}-{'il' if il else 'sec'}-norm{n or 'none'}" for c, _, il, n in _mrope_cases()]


def _mrope(i):
    from test_mrope import make_mrope_problem

    case, section, interleaved, norm = _mrope_cases()[i]
    args, opts = make_mrope_problem(case, section, interleaved, seed=60 + i, norm=norm)
    check(case, args=args, opts=opts)


@pytest.mark.parametrize("i", MROPE_DEFAULT, ids=[MROPE_IDS[i] for i in MROPE_DEFAULT])
def test_mrope(i):
    """Positions [3, T] (temporal, height, width), each clamped on its own; a column's values from
    its frequency's stream (sections, or interleaved), half and full tables, NeoX and GPT-J."""
    _mrope(i)


@pytest.mark.full
@pytest.mark.parametrize("i", [i for i in range(len(MROPE_IDS)) if i not in MROPE_DEFAULT],
                         ids=[MROPE_IDS[i] for i in range(len(MROPE_IDS)) if i not in MROPE_DEFAULT])
def test_mrope_full(i):
    _mrope(i)


def test_mrope_over_several_token_blocks(monkeypatch):
    """Token blocks of 8: each block reads its rows of the three streams (runs of consecutive
    positions per stream)."""
    from test_mrope import QWEN3_VL, make_mrope_problem

    monkeypatch.setattr(K, "VMEM_BLOCK_BUDGET", 1)
    case = Case(T=19, QH=4, KH=2, D=128, max_pos=128)
    args, opts = make_mrope_problem(case, QWEN3_VL, True, seed=70)
    pos = np.stack([np.arange(19), np.arange(40, 59), np.full(19, 7)]).astype(np.int32)
    pos[1, 5] = -3
    args = args[:6] + (pos,) + args[7:]
    assert tpu.config(contract.check_op(*args, **opts)).block_tokens == 8
    check(case, args=args, opts=opts)


@pytest.mark.skipif(ON_TPU, reason="runs a mutated kernel in interpret mode")
def test_mutation_mrope_height_and_width_swapped_fails(monkeypatch):
    from test_mrope import QWEN3_VL, make_mrope_problem

    case = Case(T=6, QH=4, KH=2, D=128)
    args, opts = make_mrope_problem(case, QWEN3_VL, True, seed=71)
    check(case, args=args, opts=opts)
    real = K.mrope_rows
    monkeypatch.setattr(K, "mrope_rows", lambda rows, cfg: real(jnp.stack([rows[0], rows[2], rows[1]]), cfg))
    with pytest.raises(AssertionError, match="q_out"):
        check(case, args=args, opts=opts)


# ---- the fused QKV input -------------------------------------------------------------------------------
def _qkv_problem(case, seed, gate=False, rank=3):
    """make_problem's q, k, v as one fused tensor [T, nq + 2KH, D] (rank 2: [T, (nq + 2KH) * D]); with
    the gate, q head h at row 2h and a random gate row at 2h + 1."""
    args, opts = make_problem(case, seed)
    q, k, v = args[:3]
    if gate:
        g = np.random.default_rng(seed + 1).standard_normal(q.shape).astype(np.float32).astype(q.dtype)
        q = np.stack([q, g], axis=2).reshape(case.T, 2 * case.QH, case.D)
    qkv = np.concatenate([q, k, v], axis=1)
    if rank == 2:
        qkv = qkv.reshape(case.T, -1)
    return (qkv,) + args[3:], dict(opts, num_q_heads=case.QH, num_kv_heads=case.KH, q_gate=gate)


def _check_qkv(case, args, opts):
    from jax_rope_cache import reference

    with jax.enable_x64(_x64((None,) * 4 + args[:3])):
        fn = jax.jit(lambda *a: jrc.rope_and_cache_qkv(*a, **opts, impl="kernel"))
        text = fn.trace(*args).lower(lowering_platforms=("tpu",)).as_text()
    assert text.count("stablehlo.custom_call @tpu_custom_call") == 1, case.id
    with jax.enable_x64(_x64((None,) * 4 + args[:3])), kernel_here():
        got = [None if o is None else np.asarray(o) for o in fn(*jax.device_put(args, jax.devices(WHERE)[0]))]
    want = reference.rope_and_cache_qkv(*args, **opts)
    q, k, v = reference.split_qkv(args[0], case.QH, case.KH, opts["q_gate"])
    check_results(got, want, (q, k, v) + args[1:], opts, case.id)


QKV_CASES = [
    (Case(T=7, QH=8, KH=2, D=128), False, 3),
    (Case(T=9, QH=4, KH=2, D=64, layout="hnd", is_neox=False, R=32), True, 2),
    (Case(T=6, QH=4, KH=1, D=128, layout="kv_merged", dtype="float32", index_dtype="int64"), True, 3),
    (Case(T=5, QH=2, KH=2, D=64, layout="head_major", cache_dtype="float8_e4m3fn", dtype="float16"), True, 3),
    (Case(T=11, QH=8, KH=2, D=128, cache_dtype="float8_e5m2", layout="hnd"), False, 2),
]
QKV_DEFAULT = (0, 1, 3)
QKV_IDS = [f"{c.id}-{'gate' if g else 'nogate'}-rank{r}" for c, g, r in QKV_CASES]


@pytest.mark.parametrize("i", QKV_DEFAULT, ids=[QKV_IDS[i] for i in QKV_DEFAULT])
def test_fused_qkv(i):
    """rope_and_cache_qkv: q, k and v rows read from one tensor (V's DMA from its rows in HBM, or
    through VMEM with fp8 and kv_merged); q_gate: q head h at row 2h, its gate never read."""
    case, gate, rank = QKV_CASES[i]
    _check_qkv(case, *_qkv_problem(case, 80 + i, gate, rank))


@pytest.mark.full
@pytest.mark.parametrize("i", [i for i in range(len(QKV_CASES)) if i not in QKV_DEFAULT],
                         ids=[QKV_IDS[i] for i in range(len(QKV_CASES)) if i not in QKV_DEFAULT])
def test_fused_qkv_full(i):
    case, gate, rank = QKV_CASES[i]
    _check_qkv(case, *_qkv_problem(case, 80 + i, gate, rank))


def test_fused_qkv_with_qk_norm_and_mrope():
    from test_mrope import QWEN3_VL, mrope_positions

    case = Case(T=8, QH=4, KH=2, D=128)
    args, opts = _qkv_problem(case, 90, gate=True)
    rng = np.random.default_rng(91)
    args = args[:4] + (mrope_positions(case.T, case.max_pos, rng).astype(np.int32),) + args[5:]
    opts.update(mrope_section=QWEN3_VL, mrope_interleaved=True, q_norm_weight=rng.uniform(0.2, 2, 128).astype(
        ml_dtypes.bfloat16), k_norm_weight=rng.uniform(0.2, 2, 128).astype(np.float32))
    _check_qkv(case, args, opts)


@pytest.mark.skipif(ON_TPU, reason="the interpreter's DMA orders and race detector")
def test_fused_qkv_every_slot_value_and_dma_orders():
    """Every slot once with out-of-range ones, the late DMA order and the race detector: V's DMA
    reads only the fused tensor's v rows."""
    case = Case(T=32 + 4, QH=2, KH=1, D=64, BS=8, NB=4, index_dtype="int64")
    args, opts = _qkv_problem(case, 92, gate=True)
    rng = np.random.default_rng(93)
    slots = np.concatenate([rng.permutation(32), [-1, 32, 2**40, -(2**62)]]).astype(np.int64)
    args = args[:3] + (slots,) + args[4:]
    with tpu_kernel_on_cpu(pltpu.InterpretParams(dma_execution_mode="on_wait", detect_races=True)):
        from jax_rope_cache import reference

        with jax.enable_x64(True):
            fn = jax.jit(lambda *a: jrc.rope_and_cache_qkv(*a, **opts, impl="kernel"))
            got = [np.asarray(o) for o in fn(*jax.device_put(args, jax.devices("cpu")[0]))]
    want = reference.rope_and_cache_qkv(*args, **opts)
    for name, g, w in zip(NAMES, got, want):
        assert_bits_equal(g, w, name)


# ---- model-family options --------------------------------------------------------------------------------
def _family(name, dtype, layout="flash", extra=None, seed=0):
    """test_families' case `name` (its problem and options) through the TPU kernel, use_rope and the
    norm weights traced; every result bit-exact."""
    import test_families as tf

    _, make, table_w = {c[0]: c for c in tf.family_cases()}[name]
    args, rng = tf.problem(dtype, seed=seed, layout=layout, table_w=table_w)
    opts = dict(make(rng, args[0].shape[2], dtype), layout=layout, **(extra or {}))
    arrays = {n: opts[n] for n in ("q_norm_weight", "k_norm_weight", "use_rope") if opts.get(n) is not None}
    static = {n: v for n, v in opts.items() if n not in arrays}
    fn = jax.jit(lambda a, kw: jrc.rope_and_cache(*a, **kw, **static, impl="kernel"))
    text = fn.trace(args, arrays).lower(lowering_platforms=("tpu",)).as_text()
    assert text.count("stablehlo.custom_call @tpu_custom_call") == 1, name
    with kernel_here():
        dev = jax.devices(WHERE)[0]
        got = [None if o is None else np.asarray(o) for o in fn(jax.device_put(args, dev), jax.device_put(arrays, dev))]
    want = reference_op(*args, **opts)
    check_results(got, want, args, opts, f"{name}-{np.dtype(dtype).name}-{layout}")


def _family_names():
    import test_families as tf

    return [c[0] for c in tf.family_cases()]


FAMILY_NAMES = _family_names()
FAMILY_DEFAULT = [("gemma-tail-after", BF16 := np.dtype(ml_dtypes.bfloat16)), ("nope-temperature", np.dtype(np.float16)),
                  ("llama4-rope-layer", BF16), ("llama4-nope-layer", np.dtype(np.float32)),
                  ("tail-gptj", np.dtype(np.float16)), ("weightless-before", np.dtype(np.float32)),
                  ("nope-rms-norm", BF16), ("tail-full-table", BF16), ("gemma-k-only", np.dtype(np.float16))]
FAMILY_FULL = [(n, np.dtype(d)) for n in FAMILY_NAMES for d in (ml_dtypes.bfloat16, np.float16, np.float32)
               if (n, np.dtype(d)) not in FAMILY_DEFAULT]


@pytest.mark.parametrize("name,dtype", FAMILY_DEFAULT, ids=[f"{n}-{d.name}" for n, d in FAMILY_DEFAULT])
def test_family_options(name, dtype):
    """NoPE, the use_rope switch (traced, on and off), tail rotary, the Gemma and weightless norms,
    the norm after the rotation and the attention temperature, alone and as models combine them."""
    _family(name, dtype)


@pytest.mark.full
@pytest.mark.parametrize("name,dtype", FAMILY_FULL, ids=[f"{n}-{d.name}" for n, d in FAMILY_FULL])
def test_family_options_full(name, dtype):
    _family(name, dtype)


@pytest.mark.parametrize("name,layout,extra", [
    ("llama4-rope-layer", "kv_merged", None),
    ("gemma-tail-after", "hnd", dict(is_neox=False)),
    ("llama4-nope-layer", "head_major", None),
])
def test_family_options_other_layouts(name, layout, extra):
    _family(name, BF16, layout, extra, seed=3)


def test_family_options_with_fp8_per_token_scales():
    """The cache stores the normalised, rotated k_out (norm after) quantized per token."""
    import test_families as tf

    args, rng = tf.problem(BF16, seed=4, layout="flash")
    kc, vc = (c.astype(ml_dtypes.float8_e4m3fn) for c in args[3:5])
    args = args[:3] + (kc, vc) + args[5:]
    shape = contract.scale_shape("flash", 6, 8, 2)
    opts = dict(rotary_dim=32, is_neox=False, norm_type="weightless", norm_position="after",
                k_scale_cache=rng.uniform(0.1, 2, shape).astype(np.float32),
                v_scale_cache=rng.uniform(0.1, 2, shape).astype(np.float32), rotary_position="tail")
    check(Case(), args=args, opts=opts)


# ---- int8 caches ---------------------------------------------------------------------------------------
def test_int8_rounding_is_the_reference_rule():
    """int8_codes (integer rounding of the f32 bits) equals reference.quantize_rows' rule (NaN 0,
    round half to even, saturate to +-127) on every f32 exponent and sign, ties included, and on
    every multiple of 1/4 in [-130, 130]."""
    x = np.concatenate([_f32_patterns(), np.arange(-520, 521, dtype=np.float32) / 4])
    got = np.asarray(jax.jit(K.int8_codes)(jax.device_put(x, jax.devices("cpu")[0])))
    want = np.clip(np.rint(np.where(np.isnan(x), 0, x)), -127, 127).astype(np.int8)
    bad = np.flatnonzero(got != want)
    assert len(bad) == 0, f"{len(bad)} differ, first {x[bad[0]]!r}: {got[bad[0]]} != {want[bad[0]]}"


INT8_CASES = [(Case(T=9, QH=4, KH=2, D=64, layout="flash"), None),
              (Case(T=7, QH=8, KH=2, D=128, layout="kv_merged", dtype="float32"), 2),
              (Case(T=6, QH=4, KH=1, D=80, layout="head_major", dtype="float16", index_dtype="int64"), None),
              (Case(T=11, QH=4, KH=2, D=64, layout="hnd", is_neox=False, R=32), 3)]


@pytest.mark.parametrize("case,layers", INT8_CASES, ids=[c.id + f"-L{n}" for c, n in INT8_CASES])
def test_int8_per_token(case, layers):
    """int8 caches with per-token scales (Q = 127): rows of magnitudes 1e-3..1e3, a zero row, inf
    and NaN (tests/test_int8_per_token.int8_problem), stacked layers."""
    from test_low_bit_caches import problem
    int8_problem = functools.partial(problem, "int8")

    args, opts = int8_problem(case, zlib.crc32(case.id.encode()), layers=layers)
    check(case, args=args, opts=opts)


@pytest.mark.parametrize("layout", ["flash", "kv_merged"])
def test_int8_every_slot_value_writes_only_its_slot(layout):
    from test_low_bit_caches import problem
    int8_problem = functools.partial(problem, "int8")

    case = Case(T=32 + 4, QH=2, KH=2, D=64, BS=8, NB=4, index_dtype="int64", layout=layout)
    args, opts = int8_problem(case, seed=39)
    rng = np.random.default_rng(40)
    slots = np.concatenate([rng.permutation(32), [-1, 32, 2**40, -(2**62)]]).astype(np.int64)
    check(case, args=args[:5] + (slots,) + args[6:], opts=opts)


# ---- int4 caches ---------------------------------------------------------------------------------------
def test_int4_packing_is_the_reference_one():
    """pack_int4 (pairs combined at even lanes, compacted by lane rolls) equals reference.pack_int4
    for every row width the kernel meets, on random nibbles; and the int4 rounding (Q = 7)."""
    from jax_rope_cache import reference

    rng = np.random.default_rng(110)
    cpu = jax.devices("cpu")[0]
    for d in (64, 80, 96, 128, 256):
        c = rng.integers(-8, 8, (5, d)).astype(np.int8)
        got = np.asarray(jax.jit(K.pack_int4)(jax.device_put(c, cpu)))
        assert_bits_equal(got, reference.pack_int4(c), f"D={d}")
    x = np.concatenate([_f32_patterns(), np.arange(-40, 41, dtype=np.float32) / 4])
    got = np.asarray(jax.jit(lambda y: K.int8_codes(y, 7.0))(jax.device_put(x, cpu)))
    want = np.clip(np.rint(np.where(np.isnan(x), 0, x)), -7, 7).astype(np.int8)
    assert (got == want).all()


INT4_CASES = [(Case(T=9, QH=4, KH=2, D=64, layout="flash"), None),
              (Case(T=7, QH=8, KH=2, D=128, layout="kv_merged", dtype="float32"), 2),
              (Case(T=6, QH=4, KH=1, D=80, layout="head_major", dtype="float16", index_dtype="int64"), None),
              (Case(T=11, QH=4, KH=2, D=64, layout="hnd", is_neox=False, R=32), 3)]
INT4_DEFAULT = (0, 1)


def _int4(i):
    from test_low_bit_caches import problem
    int4_problem = functools.partial(problem, "int4")

    case, layers = INT4_CASES[i]
    args, opts = int4_problem(case, zlib.crc32(case.id.encode()), layers=layers)
    check(case, args=args, opts=opts)


@pytest.mark.parametrize("i", INT4_DEFAULT, ids=[INT4_CASES[i][0].id for i in INT4_DEFAULT])
def test_int4_per_token(i):
    """int4 caches (uint8 bytes, two nibbles, channel 2j low) with per-token scales (Q = 7)."""
    _int4(i)


@pytest.mark.full
@pytest.mark.parametrize("i", [i for i in range(len(INT4_CASES)) if i not in INT4_DEFAULT],
                         ids=[INT4_CASES[i][0].id for i in range(len(INT4_CASES)) if i not in INT4_DEFAULT])
def test_int4_per_token_full(i):
    _int4(i)


# ---- mutations of the newer paths: the checks above see them -------------------------------------------
@pytest.mark.skipif(ON_TPU, reason="runs a mutated kernel in interpret mode")
@pytest.mark.parametrize("what", ["gemma weight", "switch ignored", "tail pairs", "int4 nibble order",
                                  "token scale floor"])
def test_mutations_of_the_newer_paths_fail(monkeypatch, what):
    if what == "gemma weight":  # r((x * inv) * w) instead of (1 + w)
        real = K.rms_norm
        monkeypatch.setattr(K, "rms_norm", lambda x, w, *a: real(x, w, *a[:4], "rms" if a[4] == "gemma" else a[4])
                            if len(a) > 4 else real(x, w, *a))
        run = lambda: _family("gemma", BF16)  # noqa: E731
    elif what == "switch ignored":
        monkeypatch.setattr(K, "switch", lambda use_rope, rotated, off: rotated)
        run = lambda: _family("switch-off", BF16)  # noqa: E731
    elif what == "tail pairs":  # the partners of the head's channels instead of the tail's
        real = K.partner
        monkeypatch.setattr(K, "partner", lambda x, cfg: real(x, dataclasses.replace(cfg, rotary_tail=False)))
        run = lambda: _family("tail-neox", BF16)  # noqa: E731 (GPT-J pairs do not depend on an even offset)
    elif what == "int4 nibble order":
        real = K.pack_int4
        monkeypatch.setattr(K, "pack_int4", lambda c: real(K.pltpu.roll(c, 1, c.ndim - 1)))
        run = lambda: _int4(0)  # noqa: E731
    else:
        monkeypatch.setattr(K, "TOKEN_AMAX_FLOOR", 1e-3)
        run = lambda: _int4(0)  # noqa: E731  (its all-zero row's scale)
    with pytest.raises(AssertionError):
        run()


def _aliases(text):
    calls = re.findall(r"stablehlo\.custom_call @tpu_custom_call\(([^)]*)\)", text)
    assert len(calls) == 1, len(calls)
    operands = [o.strip() for o in calls[0].split(",")]
    return dict((int(o), operands[int(i)]) for o, i in
                re.findall(r"output_tuple_indices = \[(\d+)\], operand_index = (\d+)", text))


@pytest.mark.parametrize("what", ["int8", "int4", "mrope", "qkv_gate", "llama4_switch", "float16"])
def test_newer_options_lowered_for_tpu_with_the_caches_aliased(what):
    """jrc.export for "tpu": one tpu_custom_call, the caches (and scale caches) aliased, no copy."""
    pytest.importorskip("flatbuffers")
    case = Case(T=5, QH=4, KH=2, D=128, dtype="float16" if what == "float16" else "bfloat16")
    if what in ("int8", "int4"):
        from test_low_bit_caches import problem

        args, opts = problem(what, case, seed=43)
        ksc, vsc = opts.pop("k_scale_cache"), opts.pop("v_scale_cache")
        step = jax.jit(lambda q, k, v, kc, vc, ks, vs, *r: jrc.rope_and_cache(
            q, k, v, kc, vc, *r, k_scale_cache=ks, v_scale_cache=vs, **opts, impl="kernel"),
            donate_argnums=(3, 4, 5, 6))
        args = args[:5] + (ksc, vsc) + args[5:]
        want = {2: "%arg3", 3: "%arg4", 4: "%arg5", 5: "%arg6"}
    elif what == "qkv_gate":
        args, opts = _qkv_problem(case, 44, gate=True)
        step = jax.jit(lambda *a: jrc.rope_and_cache_qkv(*a, **opts, impl="kernel"), donate_argnums=(1, 2))
        want = {2: "%arg1", 3: "%arg2"}
    elif what == "llama4_switch":
        import test_families as tf

        args, rng = tf.problem(BF16, seed=45)
        opts = dict(rotary_dim=32, is_neox=False, norm_type="weightless", norm_position="after",
                    attn_temperature=(8, 0.1))
        step = jax.jit(lambda *a: jrc.rope_and_cache(*a[:9], use_rope=a[9], **opts, impl="kernel"),
                       donate_argnums=(3, 4))
        args = tuple(args) + (np.int32(1),)
        want = {2: "%arg3", 3: "%arg4"}
    else:
        args, opts = make_problem(case, seed=46)
        if what == "mrope":
            from test_mrope import QWEN3_VL, make_mrope_problem

            args, opts = make_mrope_problem(case, QWEN3_VL, True, seed=46)
        step = jax.jit(lambda *a: jrc.rope_and_cache(*a, **opts, impl="kernel"), donate_argnums=(3, 4))
        want = {2: "%arg3", 3: "%arg4"}
    text = jrc.export(step, platforms=["tpu"])(*args).mlir_module()
    assert _aliases(text) == want
    assert "stablehlo.copy" not in text


@pytest.mark.parametrize("kind", ["int4", "fp8_static"])
def test_more_every_slot_values(kind):
    """int4 per-token and fp8 static scales: every slot once next to out-of-range ones."""
    case = Case(T=32 + 4, QH=2, KH=2, D=64, BS=8, NB=4, index_dtype="int64", layout="hnd",
                cache_dtype="float8_e5m2" if kind == "fp8_static" else None)
    if kind == "int4":
        from test_low_bit_caches import problem
        int4_problem = functools.partial(problem, "int4")

        args, opts = int4_problem(case, seed=47)
    else:
        args, opts = make_problem(case, seed=47)
    rng = np.random.default_rng(48)
    slots = np.concatenate([rng.permutation(32), [-1, 32, 2**40, -(2**62)]]).astype(np.int64)
    check(case, args=args[:5] + (slots,) + args[6:], opts=opts)
