"""Hardening: adversarial inputs to every entry point, each compared with the numpy
reference where values matter, or checked for the documented error (docs/errors.md).

Categories (each test's docstring says which item of the issue it covers):
  indices   int64 host slots/positions with x64 off, wide traced layers, >= 2**31-slot caches
  aliasing  one array / buffer / jax.Ref as both caches, deleted and concurrently donated caches
  raw_ffi   direct jax.ffi.ffi_call of the CPU handler and of the GPU launcher's buffer check with
            wrong dtypes, dims, ranks, attributes and results (run by scripts/asan_check.sh under
            AddressSanitizer + UBSan: the tests' names contain "raw_ffi")
  api       disable_jit, the donated entry point, scale dtypes, differentiation, messages
  diskcache FIFO, device, oversized, deeply nested, mistyped and incomplete entries
  cli       every bad command-line value: argparse's one-line error, exit status 2
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import warnings
import zlib

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jax_rope_cache as jrc
from jax_rope_cache import contract, reference
from jax_rope_cache.backends import cpu as cpu_backend
from jax_rope_cache.backends import launcher, native, xla
from jax_rope_cache.compilers import cache as diskcache
from conftest import Case, assert_bits_equal, assert_fma_close, impl_params, make_problem, ulp_diff, xla_bound

BF16, F16, F32 = np.dtype(ml_dtypes.bfloat16), np.dtype(np.float16), np.dtype(np.float32)
FP8, FP8Z = np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(ml_dtypes.float8_e4m3fnuz)
I64 = np.iinfo(np.int64)
NAMES = ("q_out", "k_out", "key_cache", "value_cache")
S = jax.ShapeDtypeStruct




def _compare(impl, got, want, args, opts, what=""):
    for name, g, w in zip(NAMES, got, want):
        if w is None:  # kv_merged: no value cache
            assert g is None, f"{name} {what}"
            continue
        g = np.asarray(g)
        if impl == "kernel":
            assert_bits_equal(g, w, f"{name} {what}")
        else:
            assert_fma_close(g, w, xla_bound(name, args, opts), f"{name} {what}")
    for name, g, before, w in zip(NAMES[2:], got[2:], args[3:5], want[2:]):
        untouched = ulp_diff(w, before) == 0
        g = None if g is None else np.asarray(g)
        assert (ulp_diff(g, before)[untouched] == 0).all(), f"{name} {what}: an unwritten entry changed"


def _device_args(args, platform):
    dev = jax.devices(platform)[0]
    return tuple(jax.device_put(a, dev) if i in (3, 4) and a is not None else a for i, a in enumerate(args))


# ==== indices: silent corruption from integer widths (items 1, 2, 7) ==========================
HOSTILE_SLOTS = [2**32 + 1, -(2**40), I64.min, I64.max, 2**31, -(2**31) - 1, 2**32, 2**63 - 2**31, 2**33 + 5]
HOSTILE_POS = [2**32 + 3, -(2**40), I64.min, I64.max, 2**31 + 1, 2**32, -(2**32) + 2]


def _hostile_problem(layout, cache_dtype, seed, T=24):
    """Fresh random inputs with int64 slots/positions, a third of them beyond int32 (each hostile
    slot value's low 32 bits name a valid slot: a wrap would write it)."""
    case = Case(T=T, QH=4, KH=2, D=32, BS=16, NB=4, layout=layout, cache_dtype=cache_dtype, index_dtype="int64")
    args, opts = make_problem(case, seed)
    rng = np.random.default_rng(seed)
    slots, pos = args[5].copy(), args[6].copy()
    where = rng.permutation(T)
    for j, i in enumerate(where[: T // 3]):
        slots[i] = HOSTILE_SLOTS[j % len(HOSTILE_SLOTS)]
    for j, i in enumerate(where[T // 3: 2 * T // 3]):
        pos[i] = HOSTILE_POS[j % len(HOSTILE_POS)]
    return args[:5] + (slots, pos) + args[7:], opts


HOSTILE_CASES = [(lay, cdt) for lay in contract.LAYOUTS for cdt in (None, "float8_e4m3fn")]


@pytest.mark.parametrize("entry", ["eager", "donated"])
@pytest.mark.parametrize("layout,cache_dtype", HOSTILE_CASES)
@pytest.mark.parametrize("platform,impl", impl_params())
def test_host_int64_indices_keep_their_meaning_with_x64_off(platform, impl, layout, cache_dtype, entry):
    """Item 1 (indices): int64 numpy slots 2**32+1, -2**40, INT64_MIN ... write nothing and
    positions 2**32+3 ... clamp, with jax_enable_x64 off, through rope_and_cache and the donated
    entry point; compared with the reference (which computes in int64)."""
    assert not jax.config.jax_enable_x64
    args, opts = _hostile_problem(layout, cache_dtype, seed=zlib.crc32(f"{layout}{cache_dtype}{entry}".encode()))
    want = reference.rope_and_cache(*args, **opts)
    fn = jrc.rope_and_cache if entry == "eager" else jrc.rope_and_cache_donated
    got = fn(*_device_args(args, platform), **opts, impl=impl)
    _compare(impl, got, want, args, opts, f"[{layout}, {cache_dtype}, {entry}]")


@pytest.mark.parametrize("layout", contract.LAYOUTS)
def test_read_kv_host_int64_slots_keep_their_meaning_with_x64_off(layout):
    """Item 1 (indices): read_kv with int64 host slots beyond int32 reads zeros, never slot s mod 2**32."""
    args, _ = _hostile_problem(layout, None, seed=7)
    kc, vc, slots = args[3], args[4], args[5]
    want = reference.read_kv(kc, vc, slots, layout=layout)
    got = jrc.read_kv(jnp.asarray(kc), None if vc is None else jnp.asarray(vc), slots, layout=layout)
    for g, w, name in zip(got, want, ("k", "v")):
        assert_bits_equal(np.asarray(g), w, f"read_kv {name} [{layout}]")


def test_narrowing_a_valid_slot_that_does_not_fit_int32_raises():
    """Item 1 (indices): a slot valid for a cache of 2**33 slots cannot be narrowed: ValueError
    naming slot_mapping (contract.narrow_slots); positions likewise."""
    with pytest.raises(ValueError, match=r"^slot_mapping: slot 4294967296 is valid .* jax_enable_x64"):
        contract.narrow_slots(np.array([0, 2**32], np.int64), 2**33)
    assert contract.narrow_slots(np.array([2**33, -1, 5, I64.min], np.int64), 2**33).tolist() == [-1, -1, 5, -1]
    with pytest.raises(ValueError, match=r"^positions: position"):
        contract.narrow_positions(np.array([2**32], np.int64), 2**33)
    assert contract.narrow_positions(np.array([I64.min, I64.max, 3], np.int64), 10).tolist() == [0, 9, 3]


LAYER_VALUES = [2**32, 2**32 + 1, -(2**32) + 1, I64.max, I64.min, 3, -1, 1, 0, 2**31, -(2**31)]


@pytest.mark.parametrize("platform,impl", impl_params())
def test_wide_traced_layer_never_wraps(platform, impl):
    """Item 2 (indices): with x64 on, a traced int64 layer 2**32 writes nothing (it used to write
    layer 0), 2**32 + 1 nothing (layer 1), for every value compared with the reference; uint32 and
    uint64 layers too."""
    case = Case(T=6, QH=4, KH=2, D=32, BS=8, NB=3, index_dtype="int32")
    args, opts = make_problem(case, seed=11)
    rng = np.random.default_rng(11)
    L = 3
    kc = rng.standard_normal((L,) + args[3].shape).astype(args[3].dtype)
    vc = rng.standard_normal((L,) + args[4].shape).astype(args[4].dtype)
    stacked = args[:3] + (kc, vc) + args[5:]
    with jax.enable_x64(True):
        fn = jax.jit(lambda layer, *a: jrc.rope_and_cache(*a, **opts, impl=impl, layer=layer))
        cases = [(np.int64, v) for v in LAYER_VALUES] + [(np.uint32, 2**32 - 1), (np.uint32, 2**31), (np.uint32, 2),
                                                         (np.uint64, 2**64 - 1), (np.uint64, 2**32 + 2), (np.uint64, 1)]
        for dt, value in cases:
            want = reference.rope_and_cache(*stacked, **opts, layer=np.asarray(value, dt))
            got = fn(jnp.asarray(value, dt), *_device_args(stacked, platform))
            _compare(impl, got, want, stacked, opts, f"[layer {dt.__name__}({value})]")


@pytest.mark.parametrize("platform,impl", impl_params())
def test_host_layer_array_beyond_int32_writes_nothing(platform, impl):
    """Item 2 (indices): a numpy 0-d int64 layer 2**32 with x64 off (a concrete, 'traced-style'
    layer) writes nothing instead of being narrowed to layer 0."""
    case = Case(T=5, QH=2, KH=1, D=16, BS=4, NB=3)
    args, opts = make_problem(case, seed=3)
    kc = np.stack([args[3]] * 2)
    vc = np.stack([args[4]] * 2)
    stacked = args[:3] + (kc, vc) + args[5:]
    for value in (2**32, 2**32 + 1, -(2**33), 1):
        want = reference.rope_and_cache(*stacked, **opts, layer=np.asarray(value, np.int64))
        got = jrc.rope_and_cache(*stacked, **opts, impl=impl, layer=np.asarray(value, np.int64))
        _compare(impl, got, want, stacked, opts, f"[host layer {value}]")


I32 = np.iinfo(np.int32)
EDGE_CASES = ([(lay, "int32", None) for lay in contract.LAYOUTS] + [(lay, "int64", None) for lay in contract.LAYOUTS]
              + [("flash", "int64", "float8_e4m3fn"), ("xpacked", "int32", "float8_e4m3fnuz")])


def _slot_edge_problem(layout, index_dtype, fp8, seed, L=3):
    """Stacked caches [L, NB, ...] (random, so untouched entries show) and slots at every edge of
    [0, n) (n = NB * BS): a run n-16 .. n+15 crossing the end (the CUDA kernel's vector runs refuse
    a group past it, its per-token path writes the rest), a run -16 .. -1, n, n+1, -1 and the int32
    extremes; int64 also INT64_MAX, INT64_MIN and values whose low 32 bits name free slots (a
    narrowing would write them). Slot n of layer l is layer l+1's first slot, and slot -1 of layer
    l layer l-1's last: an off-by-one bound writes into another layer, where the values show it.
    fp8: per-token scale caches [L, NB, KH, BS] too."""
    n_edges = 13 if index_dtype == "int64" else 7
    T = 48 + 2 * n_edges
    case = Case(T=T, QH=4, KH=2, D=32, BS=16, NB=-(-2 * T // 16), layout=layout, index_dtype=index_dtype,
                cache_dtype=fp8)
    args, opts = make_problem(case, seed)
    rng = np.random.default_rng(seed)
    nb = args[3].shape[contract.cache_layout(layout).key_axes.index("NB")]  # head_major leads with KH
    n = nb * case.BS
    edges = [n, n + 1, -1, I32.max, I32.min, n, -1]
    if index_dtype == "int64":
        edges += [I64.max, I64.min, 2**32 + 20, -(2**32) + 21, 2**32 + n, 2**40 + 22]
    assert len(edges) == n_edges
    free = [s for s in range(1, n - 16) if s not in (20, 21, 22)]
    valid = rng.permutation(free)[:n_edges]
    slots = np.array(list(range(n - 16, n + 16)) + list(range(-16, 0)) + [x for p in zip(edges, valid) for x in p],
                     np.int64)
    assert len(slots) == T
    stack = lambda a: None if a is None else np.stack(  # noqa: E731  (kv_merged: no value cache)
        [a] + [rng.standard_normal(a.shape).astype(F32).astype(a.dtype) for _ in range(L - 1)])
    args = args[:3] + (stack(args[3]), stack(args[4]), slots.astype(index_dtype)) + args[6:]
    if fp8:
        opts = {k: v for k, v in opts.items() if k not in ("k_scale", "v_scale")}
        shape = (L,) + contract.scale_shape(layout, nb, case.BS, case.KH)
        sc = lambda: rng.uniform(0.1, 2.0, shape).astype(F32)  # noqa: E731
        opts.update(k_scale_cache=sc(), v_scale_cache=sc())
    return args, opts


@pytest.mark.parametrize("layout,index_dtype,fp8", EDGE_CASES)
@pytest.mark.parametrize("platform,impl", impl_params())
def test_slots_at_the_edges_write_their_layer_only(platform, impl, layout, index_dtype, fp8):
    """Indices: slots n, n+1, -1, the int32 and int64 extremes write nothing, valid slots next to
    them their own row, for every layer of a stacked cache (static and traced layer): every entry
    the reference leaves alone keeps its bits, in every layer and every cache, scale caches too."""
    args, opts = _slot_edge_problem(layout, index_dtype, fp8, seed=zlib.crc32(f"{layout}{index_dtype}{fp8}".encode()))
    L = args[3].shape[0]
    names = NAMES + ("k_scale_cache", "v_scale_cache")
    with jax.enable_x64(index_dtype == "int64"):  # int64 slots reach the implementation as int64
        dev = jax.devices(platform)[0]
        on = lambda a: jax.device_put(a, dev)  # noqa: E731
        dyn = {k: on(v) for k, v in opts.items() if k.endswith("scale_cache")}
        static = {k: v for k, v in opts.items() if k not in dyn}
        traced = jax.jit(lambda layer, *a, **kw: jrc.rope_and_cache(*a, **static, **kw, impl=impl, layer=layer))
        for layer in range(L):
            want = reference.rope_and_cache(*args, **opts, layer=layer)
            assert len(want) == (6 if fp8 else 4)
            before = args[3:5] + tuple(opts[n] for n in names[4:len(want)])
            for how in ("static", "traced"):
                a = tuple(on(x) if i in (3, 4) and x is not None else x for i, x in enumerate(args))
                if how == "static":
                    got = jrc.rope_and_cache(*a, **static, **dyn, impl=impl, layer=layer)
                else:
                    got = traced(jnp.int32(layer), *a, **dyn)
                what = f"[{layout}, {index_dtype}, {fp8}, layer {layer} {how}]"
                for name, g, w in zip(names, got, want):
                    if w is None:  # kv_merged's absent value cache
                        assert g is None, f"{name} {what}"
                        continue
                    g = np.asarray(g)
                    if impl == "kernel":
                        assert_bits_equal(g, w, f"{name} {what}")
                    elif name.endswith("scale_cache"):
                        np.testing.assert_allclose(g, w, rtol=2.0**-20, atol=0, err_msg=f"{name} {what}")
                    elif fp8 and name in ("key_cache", "value_cache"):
                        assert ulp_diff(g, w).max(initial=0) <= 1, f"{name} {what}: beyond one fp8 ulp"
                    else:
                        assert_fma_close(g, w, xla_bound(name, args, opts), f"{name} {what}")
                for name, g, b, w in zip(names[2:], got[2:], before, want[2:]):
                    if w is None:
                        continue
                    untouched = ulp_diff(w, b) == 0
                    changed = ulp_diff(np.asarray(g), b)[untouched] != 0
                    assert not changed.any(), f"{name} {what}: {int(changed.sum())} entries no slot owns changed"


def _huge_cache_args(num_blocks, block_size, slot_dtype=np.int32, layout="flash"):
    """Shapes only (nothing allocated) of a call on an fp8 cache of num_blocks * block_size slots."""
    T, QH, KH, D = 4, 2, 1, 16
    ks, vs = contract.cache_shapes(layout, num_blocks, block_size, KH, D, FP8)
    return (S((T, QH, D), BF16), S((T, KH, D), BF16), S((T, KH, D), BF16), S(ks, FP8), None if vs is None else S(vs, FP8),
            S((T,), slot_dtype), S((T,), np.int32), S((64, D // 2), F32), S((64, D // 2), F32))


@pytest.mark.parametrize("layout", contract.LAYOUTS)
@pytest.mark.parametrize("x64", [False, True])
def test_xla_path_traces_on_caches_of_2_31_slots_or_more(layout, x64):
    """Item 7 (indices): the XLA path and read_kv with int32 slots on a cache of 2**31 + 2**27
    slots trace (they raised a bare OverflowError); the kernel lowers too."""
    with jax.enable_x64(x64):
        args = _huge_cache_args(2**27 + 2**23, 16, layout=layout)
        out = jax.eval_shape(lambda *a: jrc.rope_and_cache(*a, impl="xla", k_scale=1.0, v_scale=1.0, layout=layout),
                             *args)
        assert [None if o is None else tuple(o.shape) for o in out] == [
            None if a is None else tuple(a.shape) for a in (args[0], args[1], args[3], args[4])]
        got = jax.eval_shape(lambda kc, vc, s: jrc.read_kv(kc, vc, s, layout=layout), args[3], args[4], args[5])
        assert [tuple(g.shape) for g in got] == [(4, 1, 16)] * 2
        if layout == "flash":
            jax.jit(lambda *a: jrc.rope_and_cache(*a, impl="kernel", k_scale=1.0, v_scale=1.0)).lower(*args)


@pytest.mark.parametrize("x64", [False, True])
def test_slot_validity_on_huge_caches_matches_numpy(x64):
    """Item 7 (indices): the XLA path's validity and (block, offset) of int32 slots on caches of
    2**31 slots and more, computed on real slot values and compared with int64 numpy."""
    slots = np.array([0, 1, 2**31 - 1, -1, -(2**31), 2**30 + 7, 15, -5], np.int32)
    with jax.enable_x64(x64):
        for nb, bs in ((2**27, 16), (2**28 + 3, 16), (2**31 - 1, 2)):
            s, valid = xla.slot_validity(jnp.asarray(slots), nb * bs, nb)
            want = (slots.astype(np.int64) >= 0) & (slots.astype(np.int64) < nb * bs)
            assert np.array_equal(np.asarray(valid), want)
            blk = np.asarray(jnp.where(valid, s // bs, nb))
            assert np.array_equal(blk, np.where(want, slots.astype(np.int64) // bs, nb))


def test_xla_path_without_x64_names_a_cache_it_cannot_index():
    """Item 7 (indices): 2**31 blocks or more cannot be indexed with int32: ValueError naming key_cache."""
    args = _huge_cache_args(2**31, 1)
    with pytest.raises(ValueError, match=r"^key_cache: 2147483648 blocks .* jax_enable_x64"):
        jax.eval_shape(lambda *a: jrc.rope_and_cache(*a, impl="xla", k_scale=1.0, v_scale=1.0), *args)


# ==== aliasing: one buffer as both caches, deleted and concurrently donated caches (3, 12) ====
def _small(seed=0, layers=None):
    case = Case(T=5, QH=4, KH=2, D=16, BS=4, NB=4)
    args, opts = make_problem(case, seed)
    if layers:
        args = args[:3] + tuple(np.stack([a] * layers) for a in args[3:5]) + args[5:]
    return args, opts


SAME_CACHE_WAYS = ["numpy", "jax", "ref", "tracer", "shared-buffer", "donated", "donated-ref", "reference"]


@pytest.mark.parametrize("way", SAME_CACHE_WAYS)
@pytest.mark.parametrize("impl", ["kernel", "xla"])
def test_same_array_as_both_caches_raises(way, impl):
    """Item 3 (aliasing): the same array, jax.Array, jax.Ref, tracer or buffer as key_cache and
    value_cache raises a ValueError naming value_cache (the K writes used to be lost)."""
    args, opts = _small()
    q, k, v, kc, _, s, p, c, sn = args
    run = lambda c1, c2, fn=jrc.rope_and_cache: fn(q, k, v, c1, c2, s, p, c, sn, **opts, impl=impl)  # noqa: E731
    with pytest.raises(ValueError, match=r"^value_cache: expected a different (array|buffer) from key_cache"):
        if way == "numpy":
            run(kc, kc)
        elif way == "jax":
            a = jnp.asarray(kc)
            run(a, a)
        elif way == "ref":
            r = jax.new_ref(jnp.asarray(kc))
            run(r, r)
        elif way == "tracer":
            jax.jit(lambda a: run(a, a))(jnp.asarray(kc))
        elif way == "shared-buffer":
            a = jnp.asarray(kc)
            run(a, jax.make_array_from_single_device_arrays(a.shape, a.sharding, [a]))
        elif way == "donated":
            a = jnp.asarray(kc)
            run(a, a, jrc.rope_and_cache_donated)
        elif way == "donated-ref":
            r = jax.new_ref(jnp.asarray(kc))
            run(r, r, jrc.rope_and_cache_donated)
        else:
            reference.rope_and_cache(q, k, v, kc, kc, s, p, c, sn, **opts)


def test_deleted_cache_is_named():
    """Item 12 (aliasing): a cache donated by an earlier call names the argument (was 'Array has
    been deleted with shape=...')."""
    args, opts = _small()
    kc, vc = jnp.asarray(args[3]), jnp.asarray(args[4])
    jrc.rope_and_cache_donated(*args[:3], kc, vc, *args[5:], **opts)
    for fn in (jrc.rope_and_cache, jrc.rope_and_cache_donated):
        with pytest.raises(ValueError, match=r"^key_cache: expected a live array, got one that was deleted"):
            fn(*args[:3], kc, vc, *args[5:], **opts)
    with pytest.raises(ValueError, match=r"^key_cache: expected a live array"):
        jrc.read_kv(kc, vc, args[5])


def test_caches_donated_twice_concurrently_get_a_clear_error():
    """Item 12 (aliasing): 8 threads donating the same caches at once: one wins, the others get a
    ValueError naming the caches (XLA's was 'Invalid buffer passed to Execute()'); the winner's
    result matches the reference."""
    args, opts = _small(seed=5)
    want = reference.rope_and_cache(*args, **opts)
    for attempt in range(3):
        kc, vc = jnp.asarray(args[3]), jnp.asarray(args[4])
        results, errors, barrier = [], [], threading.Barrier(8)

        def go():
            barrier.wait()
            try:
                results.append(jrc.rope_and_cache_donated(*args[:3], kc, vc, *args[5:], **opts))
            except ValueError as e:
                errors.append(str(e))

        threads = [threading.Thread(target=go) for _ in range(8)]
        [t.start() for t in threads]
        [t.join() for t in threads]
        assert len(results) + len(errors) == 8 and len(results) >= 1
        assert all(e.startswith(("key_cache", "key_cache/value_cache")) for e in errors), errors
        for got in results:
            _compare("kernel", got, want, args, opts, "[winner]")


def test_arrays_on_different_devices_are_named():
    """Item 12 (api): committed arrays on two devices name the argument and the devices, not a dump
    of the op's whole specialisation."""
    devs = jax.devices("cpu")
    if len(devs) < 2:
        pytest.skip("needs 2 host devices (conftest asks for 8)")
    args, opts = _small()
    moved = list(args)
    moved[0] = jax.device_put(args[0], devs[0])
    moved[3] = jax.device_put(args[3], devs[1])
    with pytest.raises(ValueError, match=r"^key_cache: expected an array on the same device\(s\) as q \(cpu:0\), "
                                         r"got one on cpu:1") as err:
        jrc.rope_and_cache(*moved, **opts)
    assert "OpSpec" not in str(err.value)


# ==== raw_ffi: the native handlers trust nothing (item 4) ======================================
def _raw_problem(layout="flash", dt=BF16, cdt=None, layers=None, T=5, QH=4, KH=2, D=16, BS=16, NB=3, full=False,
                 seed=0, idx64=False, norm="", weight_dt=None, per_head=False, R=None, tail=False, norm_type=0,
                 after=False):
    """`norm`: "q", "k" or "qk" (weights in `weight_dt`, default q's dtype); `per_head`: fp8 scales [KH];
    R (default D), tail, norm_type (0 rms, 1 gemma, 2 weightless), after: the model-family attributes."""
    rng = np.random.default_rng(seed)
    cdt = np.dtype(cdt or dt)
    n = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    ks, vs = contract.cache_shapes(layout, NB, BS, KH, D, cdt)
    vs = (1,) if vs is None else vs  # kv_merged: the value_cache operand is a one-element placeholder per layer
    if layers:
        ks, vs = (layers,) + ks, (layers,) + vs
    R = D if R is None else R
    w = R if full else max(R // 2, 3)  # rotary_dim=0: a placeholder table of any width
    ang = rng.uniform(-3, 3, (9, w))
    fp8 = cdt in contract.FP8_DTYPES
    ops = dict(q=n(T, QH, D).astype(dt), k=n(T, KH, D).astype(dt), v=n(T, KH, D).astype(dt),
               key_cache=n(*ks).astype(cdt), value_cache=n(*vs).astype(cdt),
               slot_mapping=rng.permutation(NB * BS)[:T].astype(np.int64 if idx64 else np.int32),
               positions=rng.integers(-3, 12, T).astype(np.int64 if idx64 else np.int32),
               cos=np.cos(ang).astype(np.float32), sin=np.sin(ang).astype(np.float32),
               k_scale=np.float32(0.25 if fp8 else 1.0), v_scale=np.float32(0.5 if fp8 else 1.0),
               layer=np.int32(1 if layers else 0),
               q_norm_weight=np.zeros(1, np.float32), k_norm_weight=np.zeros(1, np.float32))  # norms off
    for which in norm:
        ops[f"{which}_norm_weight"] = n(D).astype(weight_dt or dt)
    if per_head and fp8:
        ops["k_scale"], ops["v_scale"] = rng.uniform(0.1, 1, KH).astype(np.float32), rng.uniform(0.1, 1, KH).astype(np.float32)
    if T:
        ops["slot_mapping"][0] = -1
    attrs = dict(layout=np.int64(contract.LAYOUT_TABLE[layout].code), is_neox=True, rotary_dim=np.int64(R),
                 native=False, q_norm="q" in norm, k_norm="k" in norm, norm_eps=np.float32(1e-6),
                 mrope=np.int64(0), mrope_t=np.int64(0), mrope_h=np.int64(0), mrope_w=np.int64(0),
                 rotary_tail=tail, norm_type=np.int64(norm_type), norm_after=after,
                 q_gate=False, rope_switch=False, floor_scale=np.int64(0))
    return ops, attrs


def _results_like(ops):
    return [S(ops[n].shape, ops[n].dtype) for n in ("q", "k", "key_cache", "value_cache")]


def _raw_call(ops, attrs, results=None, aliases=True):
    native.register_target(cpu_backend.TARGET, native.native_module().cpu_handler, "cpu")
    fn = jax.ffi.ffi_call(cpu_backend.TARGET, results or _results_like(ops),
                          input_output_aliases=dict(contract.CACHE_ALIASES) if aliases else None)
    with jax.default_device(jax.devices("cpu")[0]):  # the CPU handler: run there also on a GPU host
        out = fn(*[ops[name] for name in contract.OPERANDS], **attrs)
        return [np.asarray(o) for o in jax.block_until_ready(out)]


def _reference_of(ops, attrs, layers=None):
    layout = contract.LAYOUTS[int(attrs["layout"])]
    fp8 = np.dtype(ops["key_cache"].dtype) in contract.FP8_DTYPES
    operands = [ops[n] for n in contract.OPERANDS[:9]]
    if contract.LAYOUT_TABLE[layout].merged:  # the reference takes no value cache; the handler keeps its placeholder
        operands[4] = None
    want = reference.rope_and_cache(
        *operands, layout=layout, is_neox=attrs["is_neox"],
        rotary_dim=int(attrs["rotary_dim"]), precision="native" if attrs["native"] else "fp32",
        k_scale=ops["k_scale"] if fp8 else None, v_scale=ops["v_scale"] if fp8 else None,
        layer=ops["layer"] if layers else None, norm_eps=float(attrs["norm_eps"]),
        q_norm_weight=ops["q_norm_weight"] if attrs["q_norm"] else None,
        k_norm_weight=ops["k_norm_weight"] if attrs["k_norm"] else None,
        # the handler ABI reads the form from the width (the lowering passes checked tables only)
        table_form="full" if ops["cos"].shape[1] == int(attrs["rotary_dim"]) != 0 else "half",
        rotary_position="tail" if attrs["rotary_tail"] else "head", norm_type=contract.NORM_TYPES[int(attrs["norm_type"])],
        norm_position="after" if attrs["norm_after"] else "before")
    return want[:3] + (ops["value_cache"] if want[3] is None else want[3],) + want[4:]


VALID_RAW = [dict(layout=lay, cdt=cdt, layers=layers) for lay in contract.LAYOUTS for cdt in (None, FP8Z)
             for layers in (None, 3)] + [dict(dt=F32), dict(dt=F16, layout="xpacked"), dict(full=True), dict(T=0),
                                         dict(idx64=True), dict(idx64=True, layout="xpacked", layers=2),
                                         # norms, f32 weights, per-head fp8 scales
                                         dict(norm="qk"), dict(norm="q", dt=F32), dict(norm="k", dt=F16, weight_dt=F32),
                                         dict(norm="qk", cdt=FP8, per_head=True, layout="xpacked_shuffled"),
                                         dict(cdt=FP8Z, per_head=True, layers=3),
                                         # model families: NoPE, tail rotary, the Gemma / weightless norms, after
                                         dict(R=0), dict(R=0, norm="q", norm_type=1, layout="xpacked"),
                                         dict(R=6, tail=True, full=True), dict(R=8, tail=True, cdt=FP8, layers=2),
                                         dict(norm_type=2, after=True, dt=F16), dict(norm="qk", norm_type=1, after=True,
                                                                                       R=8, tail=True, layout="hnd")]


@pytest.mark.parametrize("aliases", [True, False])
@pytest.mark.parametrize("kw", VALID_RAW, ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items()))
def test_raw_ffi_valid_calls_match_reference(kw, aliases):
    """Item 4 (raw_ffi): the checks reject nothing valid: every layout, fp8, stacked, f32/f16,
    full tables, T=0, with and without result aliases, bit-exact against the reference."""
    ops, attrs = _raw_problem(**kw)
    with jax.enable_x64(kw.get("idx64", False)):
        got = _raw_call(ops, attrs, aliases=aliases)
    want = _reference_of(ops, attrs, kw.get("layers"))
    for name, g, w in zip(NAMES, got, want):
        assert_bits_equal(g, w, name)


def _with(ops, **changes):
    out = dict(ops)
    out.update(changes)
    return out


def _bad_raw_cases():
    """(id, problem kwargs, operand changes(ops) -> dict, attr changes, results(ops) or None, aliases,
    the buffer the error must name)."""
    r = lambda a, dt: a.astype(dt)  # noqa: E731
    c = []

    def add(id_, fix, attrs=None, results=None, aliases=True, name=None, problem=None):
        c.append((id_, problem or {}, fix, attrs or {}, results, aliases, name or id_.split("-")[0]))

    # dtypes of every operand
    add("q-f64", lambda o: _with(o, q=r(o["q"], np.float64)))
    add("q-int32", lambda o: _with(o, q=r(o["q"], np.int32)))
    add("k-f32", lambda o: _with(o, k=r(o["k"], np.float32)))
    add("k-f16", lambda o: _with(o, k=r(o["k"], np.float16)))
    add("v-f32", lambda o: _with(o, v=r(o["v"], np.float32)))
    add("key_cache-f32", lambda o: _with(o, key_cache=r(o["key_cache"], np.float32)))
    add("key_cache-int8", lambda o: _with(o, key_cache=r(o["key_cache"], np.int8)))
    add("value_cache-f16", lambda o: _with(o, value_cache=r(o["value_cache"], np.float16)))
    add("value_cache-fp8", lambda o: _with(o, value_cache=r(o["value_cache"], FP8)))
    add("value_cache-fp8z-vs-fp8", lambda o: _with(o, value_cache=r(o["value_cache"], FP8Z)),
        problem=dict(cdt=FP8))
    for dt in (np.int8, np.int16, np.uint32, np.float32):
        add(f"slot_mapping-{np.dtype(dt).name}", lambda o, dt=dt: _with(o, slot_mapping=r(o["slot_mapping"], dt)))
        add(f"positions-{np.dtype(dt).name}", lambda o, dt=dt: _with(o, positions=r(o["positions"], dt)))
    add("cos-f64", lambda o: _with(o, cos=r(o["cos"], np.float64), sin=r(o["sin"], np.float64)))
    add("cos-int32", lambda o: _with(o, cos=r(o["cos"], np.int32), sin=r(o["sin"], np.int32)))
    add("sin-bf16", lambda o: _with(o, sin=r(o["sin"], BF16)))
    add("sin-f16", lambda o: _with(o, sin=r(o["sin"], np.float16)))
    add("k_scale-bf16", lambda o: _with(o, k_scale=BF16.type(1.0)))
    add("k_scale-int32", lambda o: _with(o, k_scale=np.int32(1)))
    add("v_scale-f16", lambda o: _with(o, v_scale=np.float16(1.0)))
    add("layer-int16", lambda o: _with(o, layer=np.int16(0)))
    add("layer-uint32", lambda o: _with(o, layer=np.uint32(0)))
    add("layer-f32", lambda o: _with(o, layer=np.float32(0)))
    add("layer-int64", lambda o: _with(o, layer=np.int64(0)))
    add("k_scale-f64", lambda o: _with(o, k_scale=np.float64(1)))
    add("slot_mapping-uint64", lambda o: _with(o, slot_mapping=o["slot_mapping"].astype(np.uint64)))
    # dims and ranks of every operand
    add("q-rank2", lambda o: _with(o, q=o["q"].reshape(o["q"].shape[0], -1)))
    add("q-odd-head-dim", lambda o: _with(o, q=o["q"][..., :15], k=o["k"][..., :15], v=o["v"][..., :15]))
    add("k-tokens", lambda o: _with(o, k=o["k"][:-1]))
    add("k-heads-not-dividing", lambda o: _with(o, k=np.concatenate([o["k"], o["k"][:, :1]], 1),
                                                 v=np.concatenate([o["v"], o["v"][:, :1]], 1)))
    add("k-head-dim", lambda o: _with(o, k=o["k"][..., :8]))
    add("k-rank4", lambda o: _with(o, k=o["k"][None]))
    add("v-tokens", lambda o: _with(o, v=o["v"][:-1]))
    add("v-heads", lambda o: _with(o, v=o["v"][:, :1]))
    add("slot_mapping-short", lambda o: _with(o, slot_mapping=o["slot_mapping"][:-1]))
    add("slot_mapping-long", lambda o: _with(o, slot_mapping=np.concatenate([o["slot_mapping"]] * 2)))
    add("slot_mapping-rank2", lambda o: _with(o, slot_mapping=o["slot_mapping"][:, None]))
    add("positions-short", lambda o: _with(o, positions=o["positions"][:2]))
    add("positions-rank0", lambda o: _with(o, positions=o["positions"][0]))
    add("cos-rank1", lambda o: _with(o, cos=o["cos"][0], sin=o["sin"][0]))
    add("cos-width", lambda o: _with(o, cos=o["cos"][:, :3], sin=o["sin"][:, :3]))
    add("cos-no-rows", lambda o: _with(o, cos=o["cos"][:0], sin=o["sin"][:0]))
    add("sin-rows", lambda o: _with(o, sin=o["sin"][:-1]))
    add("sin-width", lambda o: _with(o, sin=np.concatenate([o["sin"], o["sin"]], 1)))
    add("k_scale-shape", lambda o: _with(o, k_scale=np.ones(3, np.float32)))  # neither 1 nor KH=2
    add("v_scale-empty", lambda o: _with(o, v_scale=np.ones(0, np.float32)))
    add("layer-shape", lambda o: _with(o, layer=np.zeros(3, np.int32)))
    # per-head scales, norm weights (placeholders when off), norm_eps
    add("v_scale-rank2", lambda o: _with(o, v_scale=np.ones((2, 1), np.float32)))
    add("k_scale-per-head-f16", lambda o: _with(o, k_scale=np.ones(2, np.float16)))
    add("q_norm_weight-placeholder-shape", lambda o: _with(o, q_norm_weight=np.zeros(16, np.float32)))
    add("k_norm_weight-placeholder-dtype", lambda o: _with(o, k_norm_weight=np.zeros(1, BF16)))
    add("q_norm_weight-on-placeholder", lambda o: _with(o, q_norm_weight=np.zeros(1, np.float32)), problem=dict(norm="q"))
    add("k_norm_weight-on-short", lambda o: _with(o, k_norm_weight=o["k_norm_weight"][:-2]), problem=dict(norm="qk"))
    add("k_norm_weight-on-rank2", lambda o: _with(o, k_norm_weight=o["k_norm_weight"][None]), problem=dict(norm="k"))
    add("q_norm_weight-on-f16", lambda o: _with(o, q_norm_weight=o["q_norm_weight"].astype(np.float16)),
        problem=dict(norm="q"))
    add("q_norm_weight-on-int32", lambda o: _with(o, q_norm_weight=o["q_norm_weight"].astype(np.int32)),
        problem=dict(norm="q"))
    add("q_norm_weight-on-f64", lambda o: _with(o, q_norm_weight=o["q_norm_weight"].astype(np.float64)),
        problem=dict(norm="q"))
    add("q_norm_weight-attr-without-weight", None, attrs=dict(q_norm=True), name="q_norm_weight")
    for eps in (0.0, -1e-6, np.nan, np.inf):
        add(f"attribute norm_eps-{eps}", None, attrs=dict(norm_eps=np.float32(eps)), problem=dict(norm="k"),
            name="attribute norm_eps")
    for lay in contract.LAYOUTS:
        p = dict(layout=lay)
        add(f"key_cache-rank-{lay}", lambda o: _with(o, key_cache=o["key_cache"][0]), problem=p)
        add(f"key_cache-heads-{lay}", lambda o, kh=contract.LAYOUT_TABLE[lay].head_axis("key"): _with(
            o, key_cache=np.concatenate([o["key_cache"]] * 2, kh)), problem=p)
        add(f"value_cache-blocks-{lay}", lambda o: _with(o, value_cache=o["value_cache"][:-1]), problem=p)
        add(f"value_cache-rank-{lay}", lambda o: _with(o, value_cache=o["value_cache"][None]), problem=p)
        add(f"value_cache-layers-{lay}", lambda o: _with(o, value_cache=o["value_cache"][:-1]),
            problem=dict(layout=lay, layers=3))
        add(f"key_cache-stacked-vs-single-{lay}", lambda o: _with(o, key_cache=o["key_cache"][None]), problem=p,
            name="value_cache")
        add(f"key_cache-empty-block-{lay}", lambda o, bs=contract.LAYOUT_TABLE[lay].key_axes.index("BS"): _with(
            o, key_cache=o["key_cache"][(slice(None),) * bs + (slice(0, 0),)]), problem=p)
        # results: shorter, other dtype, other dims (the caches' results can only differ unaliased)
        add(f"q_out-short-{lay}", None, results=lambda o: [S((o["q"].shape[0] - 1,) + o["q"].shape[1:], o["q"].dtype)]
            + _results_like(o)[1:], problem=p)
        add(f"q_out-dtype-{lay}", None, results=lambda o: [S(o["q"].shape, np.float32)] + _results_like(o)[1:],
            problem=p)
        add(f"k_out-heads-{lay}", None, results=lambda o: _results_like(o)[:1] + [
            S(o["q"].shape, o["k"].dtype)] + _results_like(o)[2:], problem=p)
        add(f"key_cache result-short-{lay}", None, results=lambda o: _results_like(o)[:2] + [
            S((o["key_cache"].shape[0] - 1,) + o["key_cache"].shape[1:], o["key_cache"].dtype)] + _results_like(o)[3:],
            aliases=False, name="key_cache result", problem=p)
        add(f"value_cache result-dtype-{lay}", None, results=lambda o: _results_like(o)[:3] + [
            S(o["value_cache"].shape, np.float32)], aliases=False, name="value_cache result", problem=p)
    # x-packed specifics: X (the last key dim) a power of two dividing D, BS % X for the shuffled V layout
    add("key_cache-x-not-pow2-xpacked", lambda o: _with(o, key_cache=np.ones(o["key_cache"].shape[:2] + (
        5, o["key_cache"].shape[3], 3), o["key_cache"].dtype)), problem=dict(layout="xpacked"))
    add("key_cache-x-over-d-xpacked", lambda o: _with(o, key_cache=np.ones(o["key_cache"].shape[:2] + (
        1, o["key_cache"].shape[3], 32), o["key_cache"].dtype)), problem=dict(layout="xpacked"))
    add("value_cache-x-shuffled", lambda o: _with(o, value_cache=o["value_cache"].reshape(
        o["value_cache"].shape[:2] + (o["value_cache"].shape[2] * 2, o["value_cache"].shape[3], 4))),
        problem=dict(layout="xpacked_shuffled"))
    add("value_cache-bs-not-multiple-of-x", None, problem=dict(layout="xpacked_shuffled", BS=4),
        name="value_cache")
    # attributes
    add("attribute layout-past-the-table", None, attrs=dict(layout=np.int64(len(contract.LAYOUTS))),
        name="attribute layout")
    # kv_merged: an odd head axis (a K head without its V), the one array read as another layout
    add("key_cache-odd-heads-kv_merged", lambda o: _with(o, key_cache=o["key_cache"][:, :, :-1]),
        problem=dict(layout="kv_merged"))
    add("layout-kv_merged-on-flash-caches", None, attrs=dict(layout=np.int64(5)), name="key_cache")
    add("layout-flash-on-kv_merged-caches", None, attrs=dict(layout=np.int64(0)), problem=dict(layout="kv_merged"),
        name="key_cache")
    add("layout-head_major-on-hnd-caches", None, attrs=dict(layout=np.int64(4)), problem=dict(layout="hnd", NB=5),
        name="key_cache")
    add("value_cache-placeholder-as-cache-kv_merged", lambda o: _with(o, value_cache=np.ones(o["key_cache"].shape,
                                                                                            o["key_cache"].dtype)),
        problem=dict(layout="kv_merged"), name="value_cache")
    add("layout-hnd-on-flash-caches", None, attrs=dict(layout=np.int64(3)), problem=dict(KH=4),
        name="key_cache")
    add("attribute layout-negative", None, attrs=dict(layout=np.int64(-1)), name="attribute layout")
    add("attribute rotary_dim-odd", None, attrs=dict(rotary_dim=np.int64(7)), name="attribute rotary_dim")
    add("attribute rotary_dim-negative", None, attrs=dict(rotary_dim=np.int64(-2)), name="attribute rotary_dim")
    add("attribute rotary_dim-too-big", None, attrs=dict(rotary_dim=np.int64(64)), name="attribute rotary_dim")
    add("cos-width-vs-rotary_dim", None, attrs=dict(rotary_dim=np.int64(4)), name="cos")
    # model-family attributes
    for nt in (-1, 3):
        add(f"attribute norm_type-{nt}", None, attrs=dict(norm_type=np.int64(nt)), name="attribute norm_type")
    add("attribute norm_after-without-norm", None, attrs=dict(norm_after=True), name="attribute norm_after")
    add("attribute norm_after-on-nope", None, attrs=dict(norm_after=True, norm_type=np.int64(2), rotary_dim=np.int64(0)),
        name="attribute norm_after")
    add("attribute rotary_tail-on-nope", None, attrs=dict(rotary_tail=True, rotary_dim=np.int64(0)),
        name="attribute rotary_tail")
    add("attribute mrope-on-nope", lambda o: _with(o, positions=np.stack([o["positions"]] * 3)),
        attrs=dict(mrope=np.int64(1), rotary_dim=np.int64(0)), name="attribute mrope")
    add("attributes q_norm-with-weightless", None, attrs=dict(norm_type=np.int64(2)), problem=dict(norm="q"),
        name="attributes q_norm/k_norm")
    add("attribute norm_eps-weightless", None, attrs=dict(norm_type=np.int64(2), norm_eps=np.float32(0)),
        name="attribute norm_eps")
    add("layout-flash-on-xpacked-caches", None, attrs=dict(layout=np.int64(0)), problem=dict(layout="xpacked"),
        name="key_cache")
    add("layout-shuffled-on-xpacked-caches", None, attrs=dict(layout=np.int64(2)), problem=dict(layout="xpacked"),
        name="value_cache")
    return c


BAD_RAW = _bad_raw_cases()


@pytest.mark.parametrize("case", BAD_RAW, ids=[c[0] for c in BAD_RAW])
def test_raw_ffi_call_with_bad_buffers_gets_an_error_naming_the_buffer(case):
    """Item 4 (raw_ffi): a direct ffi_call of the CPU handler with a wrong dtype, rank or dims of
    any operand or result, or a bad attribute, returns INVALID_ARGUMENT naming it: no memory fault
    (under ASan/UBSan in scripts/asan_check.sh: no report either)."""
    _, problem, fix, attr_changes, results, aliases, name = case
    if name == "value_cache" and problem.get("BS") == 4:
        problem = dict(problem, cdt=FP8)  # X = 16: BS 4 is not a multiple (a valid bf16 case otherwise)
    ops, attrs = _raw_problem(**problem)
    if fix is not None:
        ops = fix(ops)
    attrs = dict(attrs, **attr_changes)
    try:
        res = results(ops) if results else None
    except Exception:  # noqa: BLE001 - results derived from a broken operand
        res = None
    with jax.enable_x64(True), pytest.raises(jax.errors.JaxRuntimeError) as err:  # f64 / int64 stay as given
        _raw_call(ops, attrs, res, aliases=aliases)
    msg = str(err.value)
    assert "INVALID_ARGUMENT" in msg and f"rope_and_cache cpu: {name}" in msg, msg


def _gpu_check_target():
    name = "jax_rope_cache_gpu_check_buffers_test"
    native.register_target(name, native.native_module().gpu_check_buffers_handler, "cpu")
    return name


def _signature_call(ops, signature, names=None, results=None):
    names = launcher.BUFFER_NAMES if names is None else names
    res = results or _results_like(ops)
    fn = jax.ffi.ffi_call(_gpu_check_target(), res, input_output_aliases=dict(contract.CACHE_ALIASES))
    cpu = jax.devices("cpu")[0]  # the check target is registered for the CPU (a GPU host's default is not)
    with jax.default_device(cpu):
        args = [jax.device_put(ops[n], cpu) for n in contract.OPERANDS]
        return jax.block_until_ready(fn(*args, signature=np.asarray(signature, np.int64), buffer_names=names))


def _signature_of(ops):
    avals = [S(np.shape(ops[n]), np.asarray(ops[n]).dtype) for n in contract.OPERANDS]
    return launcher.buffer_signature(avals, _results_like(ops))


def test_raw_ffi_gpu_launcher_buffer_check_accepts_its_own_signature():
    """Item 4 (raw_ffi): the GPU launcher's initialize-stage check (the same C++ function, on real
    FFI buffers, run on CPU) accepts what the lowering declares, for every layout and dtype."""
    for kw in VALID_RAW:
        ops, _ = _raw_problem(**kw)
        with jax.enable_x64(kw.get("idx64", False)):
            _signature_call(ops, _signature_of(ops))


GPU_BAD = [
    ("slot_mapping", lambda o: _with(o, slot_mapping=o["slot_mapping"][:-1])),
    ("positions", lambda o: _with(o, positions=o["positions"].astype(np.int16))),
    ("q", lambda o: _with(o, q=o["q"].astype(np.float32))),
    ("k", lambda o: _with(o, k=o["k"][:, :1])),
    ("v", lambda o: _with(o, v=o["v"][:-1])),
    ("key_cache", lambda o: _with(o, key_cache=o["key_cache"][:-1])),
    ("value_cache", lambda o: _with(o, value_cache=o["value_cache"].astype(np.float16))),
    ("cos", lambda o: _with(o, cos=o["cos"][:, :2])),
    ("sin", lambda o: _with(o, sin=o["sin"].astype(BF16))),
    ("k_scale", lambda o: _with(o, k_scale=np.ones(1, np.float32))),
    ("v_scale", lambda o: _with(o, v_scale=np.float16(1))),
    ("layer", lambda o: _with(o, layer=np.int16(0))),
]


@pytest.mark.parametrize("name,fix", GPU_BAD, ids=[g[0] for g in GPU_BAD])
def test_raw_ffi_gpu_launcher_buffer_check_names_the_buffer(name, fix):
    """Item 4 (raw_ffi): buffers other than the signature's (a raw ffi_call reusing a lowering's
    attributes with other buffers) get INVALID_ARGUMENT naming the buffer, before any launch."""
    ops, _ = _raw_problem()
    sig = _signature_of(ops)
    with pytest.raises(jax.errors.JaxRuntimeError, match=rf"gpu launcher: {name}: expected element type"):
        _signature_call(fix(ops), sig)


BAD_SIGNATURES = [
    ("short-header", lambda s: s[:1], "shorter than its header"),
    ("no-operands", lambda s: np.concatenate([[0], s[1:]]), "declares 0 operands"),
    ("too-many", lambda s: np.concatenate([[40, 4], s[2:]]), "declares 40 operands"),
    ("truncated", lambda s: s[:-1], "ends inside buffer|bad rank"),
    ("trailing", lambda s: np.concatenate([s, [7]]), "longer than its buffers"),
    ("bad-rank", lambda s: np.concatenate([s[:3], [99], s[4:]]), "bad rank"),
    ("negative-dim", lambda s: np.concatenate([s[:4], [-5], s[5:]]), "negative dimension"),
    ("count-mismatch", lambda s: np.concatenate([[11, 4], s[2:-6]]), "expected 11 operands|longer than|names more"),
]


@pytest.mark.parametrize("case", BAD_SIGNATURES, ids=[b[0] for b in BAD_SIGNATURES])
def test_raw_ffi_gpu_launcher_rejects_malformed_signatures(case):
    """Item 4 (raw_ffi): a malformed `signature` (or `buffer_names`) attribute is an error, never a
    read past it."""
    _, damage, pattern = case
    ops, _ = _raw_problem()
    with pytest.raises(jax.errors.JaxRuntimeError, match=pattern):
        _signature_call(ops, damage(_signature_of(ops)))


@pytest.mark.parametrize("names", ["q,k", ",".join(["x"] * 17), "", "q,,k"])
def test_raw_ffi_gpu_launcher_rejects_bad_buffer_names(names):
    """Item 4 (raw_ffi): buffer_names must name exactly the signature's buffers."""
    ops, _ = _raw_problem()
    with pytest.raises(jax.errors.JaxRuntimeError, match="buffer_names"):
        _signature_call(ops, _signature_of(ops), names=names)


def test_raw_ffi_gpu_launcher_instantiate_checks_the_signature():
    """Item 4 (raw_ffi): the launcher's own stages registered for CPU: instantiate (which runs
    there) rejects a malformed signature; a well-formed one passes instantiate and reaches execute,
    which cannot run without a GPU stream (the expected error)."""
    name = "jax_rope_cache_gpu_stages_on_cpu_test"
    native.register_target(name, lambda: native.native_module().gpu_handler("CUDA", False), "cpu")
    ops, _ = _raw_problem()
    table = launcher.pack_code_table([(launcher.KIND_CUBIN, "sm_90", b"\x7fELF-not-loaded")])

    def call(signature):
        fn = jax.ffi.ffi_call(name, _results_like(ops), input_output_aliases=dict(contract.CACHE_ALIASES))
        cpu = jax.devices("cpu")[0]  # registered for the CPU: run there also on a GPU host
        with jax.default_device(cpu):
            return jax.block_until_ready(fn(*[jax.device_put(ops[n], cpu) for n in contract.OPERANDS], code=table,
                                            code_hash=np.int64(1), kernel="k", grid_div=np.int64(1),
                                            grid_y=np.int64(1), block=np.int64(32), smem=np.int64(0),
                                            signature=np.asarray(signature, np.int64),
                                            buffer_names=launcher.BUFFER_NAMES))

    with pytest.raises(jax.errors.JaxRuntimeError, match="attribute 'signature'"):
        call(_signature_of(ops)[:-1])
    with pytest.raises(jax.errors.JaxRuntimeError, match="platform stream|GPU context"):
        call(_signature_of(ops))


def test_gpu_lowering_declares_the_signature_of_its_buffers():
    """Item 4: the signature lower_launch attaches is the call's buffers, in the launcher's format."""
    ops, _ = _raw_problem(layout="xpacked_shuffled", cdt=FP8)
    sig = _signature_of(ops)
    assert sig[0] == len(contract.OPERANDS) == 14 and sig[1] == 4
    at, seen = 2, []
    for _ in range(18):
        rank = sig[at + 1]
        seen.append((int(sig[at]), tuple(int(x) for x in sig[at + 2: at + 2 + rank])))
        at += 2 + rank
    assert at == len(sig)
    assert seen[3] == (20, ops["key_cache"].shape) and seen[5] == (4, (5,)) and seen[0] == (16, ops["q"].shape)
    assert len(launcher.BUFFER_NAMES.split(",")) == 18


def test_cuda_lowering_carries_the_buffer_signature(monkeypatch):
    """The launcher's CUDA custom call (exported here; the launcher route, also on a GPU host whose
    plugin takes the kernel node) carries `signature` and `buffer_names`, and the signature is the
    call's 18 buffers."""
    from jax_rope_cache.backends import kernel_node
    from jax_rope_cache.compilers import nvrtc

    monkeypatch.setenv(kernel_node.ENV, "0")

    if not nvrtc.available():
        pytest.skip("NVRTC not installed")
    ops, _ = _raw_problem()
    args = [S(np.shape(ops[n]), np.asarray(ops[n]).dtype) for n in contract.OPERANDS[:9]]
    checks = [jax.export.DisabledSafetyCheck.custom_call(t)
              for t in (launcher.GPU_TARGET, launcher.GPU_TARGET_NO_GRAPH)]
    exp = jax.export.export(jax.jit(lambda *a: jrc.rope_and_cache(*a, impl="kernel")), platforms=["cuda"],
                            disabled_checks=checks)(*args)
    text = exp.mlir_module()
    sig = _signature_of(ops)
    assert "signature = dense<[" + ", ".join(str(int(x)) for x in sig) + "]>" in text
    assert f'buffer_names = "{launcher.BUFFER_NAMES}"' in text


# ==== api: disable_jit, donated entry point, scales, differentiation, messages ================
@pytest.mark.parametrize("platform,impl", impl_params())
def test_disable_jit_runs_eagerly_through_the_same_implementation(platform, impl):
    """Item 5 (api): under jax.disable_jit() the op, the donated entry point, stacked layers,
    vmap, jax.Ref caches and read_kv run (RecursionError before) and match the reference."""
    args, opts = _small(seed=21)
    want = reference.rope_and_cache(*args, **opts)
    sargs, _ = _small(seed=21, layers=2)
    swant = reference.rope_and_cache(*sargs, **opts, layer=1)
    with jax.disable_jit():
        _compare(impl, jrc.rope_and_cache(*args, **opts, impl=impl), want, args, opts, "[disable_jit]")
        _compare(impl, jrc.rope_and_cache_donated(*_device_args(args, platform), **opts, impl=impl), want, args, opts,
                 "[disable_jit donated]")
        _compare(impl, jrc.rope_and_cache(*sargs, **opts, impl=impl, layer=1), swant, sargs, opts,
                 "[disable_jit layer]")
        _compare(impl, jrc.rope_and_cache(*sargs, **opts, impl=impl, layer=jnp.int32(1)), swant, sargs, opts,
                 "[disable_jit traced-style layer]")
        kr, vr = jax.new_ref(jnp.asarray(args[3])), jax.new_ref(jnp.asarray(args[4]))
        out = jrc.rope_and_cache(*args[:3], kr, vr, *args[5:], **opts, impl=impl)
        _compare(impl, out[:2] + (kr[...], vr[...]), want, args, opts, "[disable_jit refs]")
        batched = tuple(np.stack([a, a]) for a in args)
        got = jax.vmap(lambda *a: jrc.rope_and_cache(*a, **opts, impl=impl))(*batched)
        for b in range(2):
            _compare(impl, [g[b] for g in got], want, args, opts, f"[disable_jit vmap {b}]")
        k_read, v_read = jrc.read_kv(jnp.asarray(want[2]), jnp.asarray(want[3]), args[5])
    rk, rv = reference.read_kv(want[2], want[3], args[5])
    assert_bits_equal(np.asarray(k_read), rk, "read_kv k")
    assert_bits_equal(np.asarray(v_read), rv, "read_kv v")


def test_eager_calls_compile_once_per_specialisation():
    """Item 5 (api): eager calls reuse one compiled computation per (spec, impl) (the old impl
    built a new jax.jit per call)."""
    from jax_rope_cache import primitive

    args, opts = _small(seed=1)
    primitive._eager_callable.cache_clear()
    for _ in range(3):
        jrc.rope_and_cache(*args, **opts, impl="kernel")
    info = primitive._eager_callable.cache_info()
    assert info.misses == 1 and info.hits == 2, info


@pytest.mark.parametrize("layer", [3, 5, -1, 2**40])
def test_donated_static_layer_raises_like_rope_and_cache(layer):
    """Item 8 (api): a Python-int layer outside [0, L) raises the same ValueError from both entry
    points (the donated one treated it as traced and wrote nothing)."""
    args, opts = _small(layers=3)
    msgs = []
    for fn in (jrc.rope_and_cache, jrc.rope_and_cache_donated):
        a = args[:3] + tuple(jnp.asarray(c) for c in args[3:5]) + args[5:]
        with pytest.raises(ValueError) as err:
            fn(*a, **opts, layer=layer)
        msgs.append(str(err.value))
    assert msgs[0] == msgs[1] and msgs[0].startswith("layer: expected 0 <= layer < 3")


@pytest.mark.parametrize("platform,impl", impl_params())
def test_donated_entry_point_with_refs_and_layers_matches_reference(platform, impl):
    """Item 8 (api): rope_and_cache_donated takes jax.Ref caches (written in place, returned) and a
    static layer, like rope_and_cache, and matches the reference."""
    args, opts = _small(seed=9, layers=3)
    want = reference.rope_and_cache(*args, **opts, layer=2)
    kr, vr = jax.new_ref(jnp.asarray(args[3])), jax.new_ref(jnp.asarray(args[4]))
    q_out, k_out, kc, vc = jrc.rope_and_cache_donated(*args[:3], kr, vr, *args[5:], **opts, impl=impl, layer=2)
    assert kc is kr and vc is vr
    _compare(impl, (q_out, k_out, kr[...], vr[...]), want, args, opts, "[donated refs]")
    got = jrc.rope_and_cache_donated(*_device_args(args, platform), **opts, impl=impl, layer=2)
    _compare(impl, got, want, args, opts, "[donated layer]")
    lowered = jrc.rope_and_cache_donated.lower(*_device_args(args, platform), **opts, impl=impl, layer=2)
    assert "rope_and_cache" in lowered.as_text() or "jax_rope_cache" in lowered.as_text()


def _errors_cases():
    import test_errors

    return test_errors.BAD, test_errors._good


def test_donated_entry_point_raises_exactly_what_rope_and_cache_raises():
    """Item 8 (api): every broken call of tests/test_errors.py raises the same exception type and
    message from rope_and_cache and rope_and_cache_donated."""
    bad, good = _errors_cases()
    n = 0
    for id_, overrides, options, exc, _ in bad:
        kwargs = dict(good(), **overrides)
        got = []
        for fn in (jrc.rope_and_cache, jrc.rope_and_cache_donated):
            with pytest.raises(exc) as err:
                fn(**{k: kwargs[k] for k in contract.OPERANDS[:9]}, **options)
            got.append((type(err.value), str(err.value)))
        assert got[0] == got[1], (id_, got)
        n += 1
    assert n == len(bad) >= 30


SCALES = [("bf16-numpy", lambda x: np.asarray(x, BF16)), ("bf16-jax", lambda x: jnp.asarray(x, jnp.bfloat16)),
          ("f16", lambda x: np.asarray(x, np.float16)), ("f32-1d", lambda x: np.asarray([x], np.float32)),
          ("f64", lambda x: np.float64(x)), ("python-float", float), ("python-int", lambda x: 1),
          ("fp8", lambda x: np.asarray(x, FP8)), ("f32-jax-1d", lambda x: jnp.asarray([x], jnp.float32))]


@pytest.mark.parametrize("platform,impl", impl_params())
@pytest.mark.parametrize("kind,make", SCALES, ids=[s[0] for s in SCALES])
def test_any_float_scalar_is_a_scale(platform, impl, kind, make):
    """Item 9 (api): k_scale/v_scale of any float dtype (bf16 was rejected while f16 and f64 were
    accepted), as numpy, jax or Python scalars, used as float32: compared with the reference."""
    case = Case(T=9, QH=4, KH=2, D=32, BS=16, NB=2, cache_dtype="float8_e4m3fnuz")
    args, _ = make_problem(case, seed=4)
    ks, vs = make(0.375), make(0.15625)
    opts = dict(k_scale=ks, v_scale=vs)
    want = reference.rope_and_cache(*args, k_scale=np.float32(np.asarray(ks, np.float32).reshape(())),
                                    v_scale=np.float32(np.asarray(vs, np.float32).reshape(())))
    got = jrc.rope_and_cache(*args, **opts, impl=impl)
    _compare(impl, got, want, args, dict(k_scale=float(np.asarray(ks, np.float32).reshape(()))), f"[scale {kind}]")
    if kind != "python-int":  # a Python int through a jit argument is an int32 array, not a float scalar
        jax.jit(lambda s, t, *a: jrc.rope_and_cache(*a, k_scale=s, v_scale=t, impl=impl))(ks, vs, *args)


@pytest.mark.parametrize("bad", [np.int32(1), np.asarray(1, np.int8), jnp.asarray(2),
                                 np.asarray([1.0, 2.0], np.float32), np.complex64(1), True, "0.5",
                                 np.ones((1, 1), np.float32)],
                         ids=["int32", "int8", "jax-int", "two-values", "complex", "bool", "str", "rank2"])
def test_non_float_scales_are_rejected_the_same_everywhere(bad):
    """Item 9 (api): integer, bool, complex, string and non-scalar scales raise TypeError from the
    op (every impl, inside jit too) and the reference alike."""
    case = Case(T=3, QH=2, KH=1, D=16, BS=16, NB=2, cache_dtype="float8_e4m3fn")
    args, _ = make_problem(case, seed=0)
    errs = []
    for fn in (lambda: jrc.rope_and_cache(*args, k_scale=bad, v_scale=1.0),
               lambda: jrc.rope_and_cache(*args, k_scale=bad, v_scale=1.0, impl="xla"),
               lambda: reference.rope_and_cache(*args, k_scale=bad, v_scale=1.0)):
        with pytest.raises(TypeError) as err:
            fn()
        errs.append(str(err.value))
    assert all(e.startswith("k_scale: expected a float scalar") for e in errs), errs
    assert "Tracer" not in errs[0]


@pytest.mark.parametrize("impl", ["kernel", "xla", None])
@pytest.mark.parametrize("how", ["grad-q", "grad-cache", "jvp", "vjp", "grad-under-jit", "grad-stacked"])
def test_no_impl_is_differentiable(impl, how):
    """Item 10 (api): one rule: jax.grad / jvp / vjp through the op raise the same TypeError for
    every impl (impl='xla' used to differentiate)."""
    args, opts = _small(seed=2)
    sargs, _ = _small(seed=2, layers=2)
    f = lambda q, kc: jrc.rope_and_cache(q, args[1], args[2], kc, args[4], *args[5:], **opts, impl=impl)  # noqa
    loss = lambda q, kc: sum(jnp.sum(o.astype(jnp.float32)) for o in f(q, kc))  # noqa: E731
    q, kc = jnp.asarray(args[0]), jnp.asarray(args[3])
    with pytest.raises(TypeError, match="^rope_and_cache is not differentiable"):
        if how == "grad-q":
            jax.grad(loss)(q, kc)
        elif how == "grad-cache":
            jax.grad(loss, argnums=1)(q, kc)
        elif how == "jvp":
            jax.jvp(lambda q: f(q, kc)[0], (q,), (jnp.ones_like(q),))
        elif how == "vjp":
            jax.vjp(lambda q: f(q, kc)[0], q)
        elif how == "grad-under-jit":
            jax.jit(jax.grad(loss))(q, kc)
        else:
            jax.grad(lambda q: jnp.sum(jrc.rope_and_cache(q, *sargs[1:], **opts, impl=impl, layer=1)[0]
                                       .astype(jnp.float32)))(q)


def test_xla_path_still_vmaps_and_jits_after_the_differentiation_rule():
    """Item 10 (api): the XLA path's no-differentiation wrapper keeps vmap and jit working
    (compared with the reference per batch element)."""
    args, opts = _small(seed=6)
    args2, _ = _small(seed=7)
    batched = tuple(np.stack([a, b]) for a, b in zip(args, args2))
    got = jax.jit(jax.vmap(lambda *a: jrc.rope_and_cache(*a, **opts, impl="xla")))(*batched)
    for b, a in enumerate((args, args2)):
        _compare("xla", [g[b] for g in got], reference.rope_and_cache(*a, **opts), a, opts, f"[vmap {b}]")


MESSAGE_CASES = [
    ("layer-float-tracer", lambda a, o: jax.jit(lambda l: jrc.rope_and_cache(*a, **o, layer=l))(1.0),  # noqa: E741
     TypeError, "layer: expected None, an int or an integer scalar array, got a float32[] array"),
    ("k_scale-tracer-non-fp8", lambda a, o: jax.jit(lambda s: jrc.rope_and_cache(*a, **o, k_scale=s))(1.0),
     ValueError, "k_scale: scales apply to float8 caches only; expected None for a bfloat16 cache, "
                 "got a float32[] array"),
    ("layer-bool", lambda a, o: jrc.rope_and_cache(*a, **o, layer=True), TypeError,
     "layer: expected None, an int or an integer scalar array, got bool"),
    ("layer-list", lambda a, o: jrc.rope_and_cache(*a, **o, layer=[1]), TypeError,
     "layer: expected None, an int or an integer scalar array, got list"),
]


@pytest.mark.parametrize("case", MESSAGE_CASES, ids=[m[0] for m in MESSAGE_CASES])
def test_messages_name_the_expected_type_not_the_tracer(case):
    """Item 12 (api): messages describe a traced value by dtype and shape (they printed
    'DynamicJaxprTracer[]' / 'JitTracer(~float32[])')."""
    _, call, exc, text = case
    args, opts = _small()
    with pytest.raises(exc) as err:
        call(args, opts)
    assert str(err.value).startswith(text), str(err.value)
    assert "Tracer" not in str(err.value)


MAKE_KV_BAD = [
    (dict(num_blocks=-1), ValueError, "num_blocks: expected an integer >= 1, got -1"),
    (dict(num_blocks=0), ValueError, "num_blocks: expected an integer >= 1, got 0"),
    (dict(block_size=0), ValueError, "block_size: expected an integer >= 1, got 0"),
    (dict(kv_heads=2.5), ValueError, "kv_heads: expected an integer >= 1, got 2.5"),
    (dict(head_dim=63), ValueError, "head_dim: expected an even integer"),
    (dict(head_dim=True), ValueError, "head_dim: expected an integer >= 1, got bool"),
    (dict(num_layers=0), ValueError, "num_layers: expected an integer >= 1, got 0"),
    (dict(dtype="nope"), TypeError, "dtype: expected one of"),
    (dict(dtype=np.int16), TypeError, "dtype: expected one of"),
]


@pytest.mark.parametrize("change,exc,text", MAKE_KV_BAD, ids=[str(m[0]) for m in MAKE_KV_BAD])
def test_make_kv_cache_bad_arguments_are_named(change, exc, text):
    """Item 12 (api): make_kv_cache(num_blocks=-1) and friends name the argument (the first failed
    inside broadcast_in_dim)."""
    kw = dict(num_blocks=4, block_size=16, kv_heads=2, head_dim=64)
    kw.update(change)
    with pytest.raises(exc) as err:
        jrc.make_kv_cache(**kw)
    assert str(err.value).startswith(text), str(err.value)


READ_KV_BAD = [
    ("float-slots", lambda kc, vc, s: (kc, vc, s.astype(np.float32)), TypeError, "slot_mapping: expected dtype int32"),
    ("slots-rank2", lambda kc, vc, s: (kc, vc, s[:, None]), ValueError, "slot_mapping: expected rank 1"),
    ("value-dtype", lambda kc, vc, s: (kc, vc.astype(np.float16), s), TypeError, "value_cache: expected dtype"),
    ("value-shape", lambda kc, vc, s: (kc, vc[:-1], s), ValueError, "value_cache: expected shape"),
    ("key-rank", lambda kc, vc, s: (kc[0], vc, s), ValueError, "key_cache: expected rank 4"),
    ("key-int", lambda kc, vc, s: (kc.astype(np.int32), vc, s), TypeError, "key_cache: expected dtype"),
]


@pytest.mark.parametrize("case", READ_KV_BAD, ids=[r[0] for r in READ_KV_BAD])
def test_read_kv_checks_its_arguments_like_the_reference(case):
    """Item 12 (api): read_kv's bad arguments raise the same error from the jax helper and the
    numpy reference (the jax one failed inside the gather, or read garbage)."""
    _, fix, exc, text = case
    args, _ = _small()
    bad = fix(args[3], args[4], args[5])
    for fn in (jrc.read_kv, reference.read_kv):
        with pytest.raises(exc) as err:
            fn(*bad)
        assert str(err.value).startswith(text), str(err.value)


# ==== diskcache: only bounded regular files are read (item 6) =================================
@contextlib.contextmanager
def _deadline(seconds=20):
    """Fails the test instead of hanging forever (the FIFO case hung the reader)."""
    def boom(*_):
        raise TimeoutError("disk-cache read hung")

    old = signal.signal(signal.SIGALRM, boom)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def _valid_entry(meta=None):
    return diskcache.encode(b"\x7fELF" + os.urandom(64), dict(arch="sm_90") if meta is None else meta)


def _deep_json(depth=200_000):
    return "[" * depth + "]" * depth


def _entry_with_header(header: dict | str, payload=b"payload"):
    import hashlib
    import struct

    if isinstance(header, dict):
        header = dict(header)
        header.setdefault("sha256", hashlib.sha256(payload).hexdigest())
        header.setdefault("size", len(payload))
        h = json.dumps(header).encode()
    else:
        h = header.encode()
    return diskcache.MAGIC + struct.pack("<Q", len(h)) + h + payload


DAMAGE = {
    "fifo": lambda p: os.mkfifo(p),
    "symlink-to-dev-zero": lambda p: os.symlink("/dev/zero", p),
    "symlink-to-dev-null": lambda p: os.symlink("/dev/null", p),
    "directory": lambda p: os.mkdir(p),
    "oversized-sparse": lambda p: open(p, "wb").truncate(diskcache.MAX_ENTRY + 1),
    "deep-json-header": lambda p: open(p, "wb").write(_entry_with_header(_deep_json())),
    "deep-json-object": lambda p: open(p, "wb").write(_entry_with_header('{"a":' * 100_000 + "1" + "}" * 100_000)),
    "missing-arch": lambda p: open(p, "wb").write(_entry_with_header({})),
    "arch-not-a-string": lambda p: open(p, "wb").write(_entry_with_header({"arch": ["sm_90"]})),
    "size-a-string": lambda p: open(p, "wb").write(_entry_with_header({"arch": "sm_90", "size": "7"})),
    "size-a-bool": lambda p: open(p, "wb").write(_entry_with_header({"arch": "sm_90", "size": True}, b"x")),
    "sha-a-number": lambda p: open(p, "wb").write(_entry_with_header({"arch": "sm_90", "sha256": 5})),
    "header-a-list": lambda p: open(p, "wb").write(_entry_with_header("[1, 2]")),
    "dangling-symlink": lambda p: os.symlink(p + ".nowhere", p),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_disk_cache_reads_only_bounded_regular_files(tmp_path, damage):
    """Item 6 (diskcache): a FIFO (hung forever), a link to /dev/zero (read until out of memory), a
    directory, an oversized file, a deeply nested header (RecursionError) or one without / with a
    mistyped key the caller needs (KeyError) is a corrupt entry: CacheWarning, removed (where it is
    removable), None returned, within a deadline; a dangling link is simply absent."""
    folder = tmp_path / "c"
    folder.mkdir()
    path = str(folder / "e.cubin.jrc")
    DAMAGE[damage](path)
    with _deadline(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = diskcache.read(str(folder), "e.cubin.jrc", required={"arch": str})
    assert got is None
    corrupt = [w for w in caught if issubclass(w.category, diskcache.CacheWarning) and "corrupt" in str(w.message)]
    if damage == "dangling-symlink":
        assert not corrupt  # absent: compile and write over it
        return
    assert len(corrupt) == 1, [str(w.message) for w in caught]
    if damage != "directory":
        assert not os.path.lexists(path), "the corrupt entry was not removed"


def test_disk_cache_follows_a_symlink_to_a_regular_entry(tmp_path):
    """Item 6 (diskcache): a symlink to an intact regular entry is read (only its target's kind counts)."""
    folder = tmp_path / "c"
    folder.mkdir()
    (tmp_path / "real").write_bytes(_valid_entry())
    os.symlink(tmp_path / "real", folder / "e.cubin.jrc")
    with warnings.catch_warnings():
        warnings.simplefilter("error", diskcache.CacheWarning)
        meta, payload = diskcache.read(str(folder), "e.cubin.jrc", required={"arch": str})
    assert meta["arch"] == "sm_90" and payload.startswith(b"\x7fELF")


@pytest.mark.parametrize("damage", ["fifo", "symlink-to-dev-zero", "missing-arch", "deep-json-header"])
def test_nvrtc_rebuilds_over_a_damaged_entry(tmp_path, monkeypatch, damage):
    """Item 6 (diskcache): end to end through the NVRTC compiler's cache: the damaged entry is
    warned about, the code object compiled again and the entry rewritten whole."""
    from jax_rope_cache.compilers import nvrtc

    if not nvrtc.available():
        pytest.skip("NVRTC not installed")
    monkeypatch.setenv("JAX_ROPE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(nvrtc, "_mem_cache", {})
    src = 'extern "C" __global__ void jrc_probe(float* x) { x[threadIdx.x] = 3.0f * threadIdx.x; }\n'
    first = nvrtc.compile_cuda(src, arch="compute_90", options=[], name="probe.cu")
    path = str(tmp_path / (first.key + ".cubin.jrc"))
    os.unlink(path)
    DAMAGE[damage](path)
    nvrtc._mem_cache.clear()
    with _deadline(60), pytest.warns(diskcache.CacheWarning, match="corrupt"):
        again = nvrtc.compile_cuda(src, arch="compute_90", options=[], name="probe.cu")
    assert not again.from_disk and again.code == first.code
    assert diskcache.decode(open(path, "rb").read(), {"arch": str})[1] == first.code


# ==== cli: every bad value is argparse's one-line error, exit status 2 (item 11) ==============
CLI_BAD = [
    ("demo", "--steps 0"), ("demo", "--layers 0"), ("demo", "--block-size 0"), ("demo", "--batch 0"),
    ("demo", "--prefill -1"), ("demo", "--tp 3"), ("demo", "--tp 0"), ("demo", "--preset nope"),
    ("demo", "--check-layers 0"), ("demo", "--steps x"), ("demo", "--tp 16 --preset tiny"),
    ("bench", "--calls 0"), ("bench", "--tokens -5"), ("bench", "--tokens 4 0"), ("bench", "--tp 3"),
    ("bench", "--preset nope"), ("bench", "--repeats 0"), ("bench", "--repeats -1"), ("bench", "--layout bad"),
    ("bench", "--slots nope"), ("bench", "--out /nonexistent/dir/x"), ("bench", "--tp 2.5"),
    ("compile", "--preset tiny --tp 0"), ("compile", "--preset nope"), ("compile", "--preset tiny --arch gfx900"),
    ("compile", "--preset tiny --layout bad"), ("compile", "--preset tiny --block-size 0"),
    ("compile", "--heads 8,3,64"), ("compile", "--heads 8,2"), ("compile", "--preset tiny --dtype int8"),
    ("compile", "--preset tiny --index-dtype int16"), ("compile", "--preset llama-3.1-8b --tp 3"),
    ("info", "--bogus"),
]


@pytest.mark.parametrize("command,argv", CLI_BAD, ids=[f"{c} {a}" for c, a in CLI_BAD])
def test_command_line_bad_values_exit_2_with_one_line(command, argv, capsys):
    """Item 11 (cli): `demo --steps 0`, `bench --repeats 0`, `--tp 3`, `--preset nope` ... end in
    argparse's `error:` line and exit status 2 (tracebacks, or a table of nan and exit 0, before)."""
    from jax_rope_cache import cli

    with pytest.raises(SystemExit) as err:
        cli.main([command] + argv.split())
    assert err.value.code == 2
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert lines and "error:" in lines[-1] and "Traceback" not in "\n".join(lines), lines


def test_unknown_command_exits_2(capsys):
    """Item 11 (cli): an unknown command is reported like argparse reports a bad choice."""
    from jax_rope_cache import cli

    with pytest.raises(SystemExit) as err:
        cli.main(["nope"])
    assert err.value.code == 2 and "error: unknown command 'nope'" in capsys.readouterr().err
