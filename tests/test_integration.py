"""The op inside inference loops: stacked per-layer caches (layer=i, traced, in scan), jax.Ref
caches, vmap, grad, and tensor parallelism over heads (shard_map on 8 host devices)."""

from __future__ import annotations

import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_rope_cache as jrc
from jax_rope_cache import contract
from conftest import Case, assert_bits_equal, assert_fma_close, impl_params, make_problem, reference_op
from test_structure import check_in_place, widens_bf16_scatter

STATIC = ("layout", "is_neox", "rotary_dim", "precision", "table_form")


def _stack(case: Case, layers: int, seed: int):
    """A problem whose caches are stacked [L, ...] with random contents in every layer."""
    args, opts = make_problem(case, seed)
    rng = np.random.default_rng(seed + 1)
    kc, vc = (None if c is None else np.stack([rng.permutation(c.ravel()).reshape(c.shape) for _ in range(layers)])
              for c in args[3:5])
    return args[:3] + (kc, vc) + args[5:], opts


def _check(got, want, impl, what):
    for name, g, w in zip(("q_out", "k_out", "key_cache", "value_cache"), got, want):
        if w is None:  # kv_merged: no value cache
            assert g is None, f"{what} {name}"
        elif impl == "kernel":
            assert_bits_equal(np.asarray(g), w, f"{what} {name}")
        else:
            assert_fma_close(np.asarray(g), w, 2.0**-22 * 8, f"{what} {name}")


@pytest.mark.parametrize("platform,impl", impl_params())
@pytest.mark.parametrize("layout,cdt", [("flash", "float8_e4m3fnuz"), ("xpacked_shuffled", "float8_e4m3fnuz"),
                                        ("hnd", "float8_e5m2"), ("head_major", "float8_e4m3fn"), ("kv_merged", None)])
def test_stacked_layer_writes_only_that_layer(platform, impl, layout, cdt):
    case = Case(T=9, D=64, layout=layout, cache_dtype=cdt)
    args, opts = _stack(case, layers=4, seed=31)
    static = {k: v for k, v in opts.items() if k in STATIC}
    dyn = {k: v for k, v in opts.items() if k not in STATIC}
    fn = jax.jit(lambda *a, layer, **d: jrc.rope_and_cache(*a, **static, **d, impl=impl, layer=layer),
                 donate_argnums=(3, 4))
    dev = jax.devices(platform)[0]
    for layer in (2, 0, 3, -1, 4):  # -1 and 4: a traced layer outside [0, L) writes nothing
        got = fn(*jax.device_put(args, dev), layer=jnp.int32(layer), **dyn)
        want = reference_op(*args, **opts, layer=min(max(layer, 0), 3)) if 0 <= layer < 4 else \
            reference_op(*args, **opts, layer=0)[:2] + args[3:5]
        _check(got, want, impl, f"layer {layer}")


@pytest.mark.parametrize("platform,impl", impl_params())
@pytest.mark.parametrize("layout", ["xpacked", "head_major", "kv_merged"])
def test_scan_over_layers_updates_one_stacked_cache_in_place(platform, impl, layout):
    layers = 6
    case = Case(T=5, QH=8, KH=2, D=64, NB=12, BS=16, layout=layout)
    args, opts = _stack(case, layers, seed=32)
    q, k, v, kc, vc, slots, pos, cos, sin = args
    static = {k: v for k, v in opts.items() if k in STATIC}

    def model_step(q, k, v, kc, vc, slots, pos, cos, sin):
        def layer_fn(carry, i):
            kc, vc = carry
            scale = (i + 1).astype(q.dtype)
            qo, _, kc, vc = jrc.rope_and_cache(q * scale, k * scale, v, kc, vc, slots, pos, cos, sin, **static,
                                               impl=impl, layer=i)
            return (kc, vc), qo[0, 0, :4]
        (kc, vc), outs = jax.lax.scan(layer_fn, (kc, vc), jnp.arange(layers))
        return kc, vc, outs

    step = jax.jit(model_step, donate_argnums=(3, 4))
    dargs = jax.device_put(args, jax.devices(platform)[0])
    compiled = step.lower(*dargs).compile()
    shapes = [c.shape for c in (kc, vc) if c is not None]
    text = check_in_place(compiled, shapes, kc.nbytes, n_caches=len(shapes),
                          widened=widens_bf16_scatter(platform, impl, kc.dtype))
    for op in ("dynamic-slice(", "dynamic-update-slice("):
        for line in text.splitlines():
            if op in line:
                assert "[" + ",".join(map(str, kc.shape)) + "]" not in line, f"stacked cache sliced: {line.strip()}"
    got_kc, got_vc, _ = compiled(*dargs)
    want_kc, want_vc = kc, vc
    for i in range(layers):
        s = np.float32(i + 1)
        qi, ki = ((x.astype(np.float32) * s).astype(x.dtype) for x in (q, k))
        _, _, want_kc, want_vc = reference_op(qi, ki, v, want_kc, want_vc, slots, pos, cos, sin, **opts, layer=i)
    _check([got_kc, got_vc], [want_kc, want_vc], "kernel" if impl == "kernel" else "xla", "scan")


@pytest.mark.parametrize("platform,impl", impl_params())
@pytest.mark.parametrize("layout", ["flash", "kv_merged"])
def test_ref_caches_update_in_place_without_donation(platform, impl, layout):
    case = Case(T=6, D=64, layout=layout)
    args, opts = make_problem(case, seed=33)
    static = {k: v for k, v in opts.items() if k in STATIC}
    dev = jax.devices(platform)[0]
    kref = jax.new_ref(jax.device_put(args[3], dev))
    vref = None if args[4] is None else jax.new_ref(jax.device_put(args[4], dev))  # kv_merged: one ref

    @jax.jit
    def step(q, k, v, kref, vref, slots, pos, cos, sin):
        q_out, k_out, _, _ = jrc.rope_and_cache(q, k, v, kref, vref, slots, pos, cos, sin, **static, impl=impl)
        return q_out, k_out

    rest = jax.device_put(args[5:], dev)
    q_out, k_out = step(*jax.device_put(args[:3], dev), kref, vref, *rest)
    want = reference_op(*args, **opts)
    _check([q_out, k_out, kref[...], None if vref is None else vref[...]], want, impl, "refs")
    text = step.lower(*jax.device_put(args[:3], dev), kref, vref, *rest).compile().as_text()
    assert "input_output_alias=" in text
    assert not [ln for ln in text.splitlines() if re.search(r"\bcopy\(", ln) and
                "[" + ",".join(map(str, args[3].shape)) + "]" in ln]


@pytest.mark.parametrize("platform,impl", impl_params())
@pytest.mark.parametrize("layout", ["xpacked", "head_major", "kv_merged"])
def test_vmap_over_independent_caches(platform, impl, layout):
    batch = 3
    case = Case(T=5, D=64, layout=layout)
    problems = [make_problem(case, seed=40 + b) for b in range(batch)]
    opts = problems[0][1]
    static = {k: v for k, v in opts.items() if k in STATIC}
    stacked = [None if problems[0][0][i] is None else np.stack([p[0][i] for p in problems]) for i in range(9)]
    cos, sin = problems[0][0][7:9]
    fn = jax.vmap(lambda *a: jrc.rope_and_cache(*a, cos, sin, **static, impl=impl))
    got = jax.jit(fn)(*jax.device_put(stacked[:7], jax.devices(platform)[0]))
    for b in range(batch):
        want = reference_op(*problems[b][0][:7], cos, sin, **opts)
        _check([None if g is None else g[b] for g in got], want, impl, f"vmap element {b}")


@pytest.mark.parametrize("platform,impl", impl_params())
def test_vmap_with_an_unbatched_cache_gives_each_element_its_own_result(platform, impl):
    """vmap semantics: element b's cache holds the old cache plus element b's writes only."""
    case = Case(T=4, D=64)
    args, opts = make_problem(case, seed=44)
    static = {k: v for k, v in opts.items() if k in STATIC}
    nslots = args[3].shape[0] * args[3].shape[1]
    slots = np.random.default_rng(0).permutation(nslots)[:8].astype(np.int32).reshape(2, 4)
    qs = np.stack([args[0], args[0][::-1]])
    fn = jax.vmap(lambda q, s: jrc.rope_and_cache(q, *args[1:5], s, *args[6:], **static, impl=impl))
    got = jax.jit(fn)(*jax.device_put((qs, slots), jax.devices(platform)[0]))
    for b in range(2):
        want = reference_op(qs[b], *args[1:5], slots[b], *args[6:], **opts)
        _check([g[b] for g in got], want, impl, f"element {b}")


def test_grad_raises_a_clear_error():
    args, opts = make_problem(Case(T=2, D=64, dtype="float32"), seed=45)
    f = lambda q: jrc.rope_and_cache(q, *args[1:], **opts)[0].sum()  # noqa: E731
    with pytest.raises(TypeError, match="rope_and_cache is not differentiable"):
        jax.grad(f)(args[0])


def _mesh(n):
    devices = jax.devices("cpu")
    if len(devices) < n:
        pytest.fail(f"needs {n} host devices: run with XLA_FLAGS=--xla_force_host_platform_device_count=8 "
                    "(tests/conftest.py sets it before jax starts)")
    return jax.make_mesh((n,), ("tp",), devices=devices[:n])


@pytest.mark.parametrize("impl", ["kernel", "xla"])
@pytest.mark.parametrize("layout", ["flash", "xpacked", "hnd", "head_major", "kv_merged"])
def test_shard_map_tensor_parallel_over_heads(impl, layout):
    """kv_merged: its one array splits on the 2*KH axis into contiguous (K, V) pairs of each shard's heads."""
    tp = 8
    case = Case(T=7, QH=32, KH=8, D=64, layout=layout, NB=8)
    args, opts = make_problem(case, seed=46)
    static = {k: v for k, v in opts.items() if k in STATIC}
    mesh = _mesh(tp)
    lay = contract.LAYOUT_TABLE[layout]
    cache_spec = P(*([None] * lay.head_axis("key") + ["tp"]))  # the KV-head axis of each cache
    vcache_spec = None if lay.merged else P(*([None] * lay.head_axis("value") + ["tp"]))
    heads = P(None, "tp")
    in_specs = (heads, heads, heads, cache_spec, vcache_spec, P(), P(), P(), P())
    out_specs = (heads, heads, cache_spec, vcache_spec)
    fn = jax.shard_map(lambda *a: jrc.rope_and_cache(*a, **static, impl=impl), mesh=mesh, in_specs=in_specs,
                       out_specs=out_specs)
    placed = [None if a is None else jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(args, in_specs)]
    step = jax.jit(fn, donate_argnums=(3, 4))
    got = step(*placed)
    _check(got, reference_op(*args, **opts), impl, "shard_map")
    assert got[2].sharding.is_equivalent_to(NamedSharding(mesh, cache_spec), got[2].ndim)


def test_plain_jit_over_sharded_inputs_points_to_shard_map():
    case = Case(T=3, QH=16, KH=8, D=64)
    args, opts = make_problem(case, seed=47)
    mesh = _mesh(8)
    placed = list(args)
    placed[0] = jax.device_put(args[0], NamedSharding(mesh, P(None, "tp")))
    placed[3] = jax.device_put(args[3], NamedSharding(mesh, P(None, None, "tp")))
    with pytest.raises(ValueError, match="shard_map"):
        jax.jit(lambda *a: jrc.rope_and_cache(*a, impl="kernel"))(*placed)
    with pytest.warns(RuntimeWarning, match="runs the XLA implementation.*shard_map") as record:
        got = jax.jit(lambda *a: jrc.rope_and_cache(*a))(*placed)  # impl=None: the XLA path partitions
    _check(got, reference_op(*args, **opts), "xla", "auto-partitioned")
    assert record[0].filename == __file__, f"the warning points into {record[0].filename}, not at the caller"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per process: a second call site does not warn again
        jax.jit(lambda *a: jrc.rope_and_cache(*a)[0] + 1)(*placed)
