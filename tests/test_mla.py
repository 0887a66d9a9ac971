"""mla_rope_and_cache (DeepSeek-V3/R1, Kimi-K2 MLA) against its numpy reference on every (platform,
impl) this machine has: fresh random data, caches pre-filled with random values, hostile slots and
positions; the native kernels bit for bit, the XLA path within the main op's bounds. Then the
structure (one custom call, caches aliased, no cache copy), stacked layers under scan, jax.Ref
caches, vmap, the errors, and no differentiation."""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import assert_bits_equal, impl_params, ulp_diff
from mla_cases import BF16, CASES, E5, E5M2_FULL_CASES, F32, FN, MlaCase, flat_outputs, make_mla_problem
import jax_rope_cache as jrc
from jax_rope_cache import contract
from jax_rope_cache.mla import reference as mla_reference

IMPLS = impl_params()


def _platform_args(platform, args):
    dev = jax.devices(platform)[0]
    return jax.tree.map(lambda a: jax.device_put(a, dev), args)


def assert_mla_close(got, want, args, opts, impl, what=""):
    """Kernels: every bit. XLA: copies exact; rotated values within 1 ulp, or within 2 f32 ulps of
    the row's largest input (an FMA XLA may form); fp8 values within one fp8 step of that."""
    names = ["q_out", "k_pe_out"] + (["kv_cache"] if opts["layout"] == "combined" else ["ckv_cache", "kpe_cache"])
    for name, g, w in zip(names, flat_outputs(got), flat_outputs(want)):
        if impl == "kernel":
            assert_bits_equal(g, w, f"{what}{name}")
            continue
        assert g.dtype == w.dtype and g.shape == w.shape, (name, g.dtype, w.dtype, g.shape, w.shape)
        d = ulp_diff(g, w)
        if g.dtype.itemsize == 1:
            assert d.max(initial=0) <= 1, f"{what}{name}: {int((d > 1).sum())} fp8 elements beyond one step"
            continue
        err = np.abs(g.astype(np.float64) - w.astype(np.float64))
        bound = 2.0**-22 * max(float(np.abs(np.asarray(a, np.float32)).max(initial=0)) for a in args[1:4:2])
        ok = (d <= 1) | (err <= bound)
        assert ok.all(), f"{what}{name}: {int((~ok).sum())} elements beyond 1 ulp and the FMA bound"


@pytest.mark.parametrize("platform,impl", IMPLS)
@pytest.mark.parametrize("case", CASES + [pytest.param(c, marks=pytest.mark.full) for c in E5M2_FULL_CASES],
                         ids=[c.id for c in CASES + E5M2_FULL_CASES])
def test_matches_reference(case, platform, impl):
    args, opts = make_mla_problem(case, seed=len(case.id))
    want = mla_reference.mla_rope_and_cache(*args, **opts)
    got = jrc.mla_rope_and_cache(*_platform_args(platform, args), **opts, impl=impl)
    assert_mla_close(got, want, args, opts, impl)


@pytest.mark.parametrize("layout,index_dtype", [("combined", "int64"), ("split", "int32")])
@pytest.mark.parametrize("platform,impl", IMPLS)
def test_slots_at_the_edges_write_their_layer_only(platform, impl, layout, index_dtype):
    """Stacked caches [L, NB, BS, ...], every layer: slots n (= NB * BS, the next layer's first row),
    n + 1, -1 (the previous layer's last), the int32 (and int64) extremes and values whose low 32
    bits name free rows write nothing; every row the reference leaves alone keeps its bits."""
    L, n_edges = 3, 12 if index_dtype == "int64" else 7
    T = 16 + 2 * n_edges
    case = MlaCase(T=T, layers=L, layout=layout, index_dtype=index_dtype, BS=8, NB=-(-2 * T // 8))
    args, opts = make_mla_problem(case, seed=41)
    n = -(-2 * T // 8) * 8
    rng = np.random.default_rng(41)
    i32, i64 = np.iinfo(np.int32), np.iinfo(np.int64)
    edges = [n, n + 1, -1, i32.max, i32.min, n, -1]
    if index_dtype == "int64":
        edges += [i64.max, i64.min, 2**32 + 5, -(2**32) + 6, 2**32 + n]
    valid = rng.permutation([s for s in range(7, n - 8)])[:n_edges]
    slots = np.array(list(range(n - 8, n + 8)) + [x for p in zip(edges, valid) for x in p], np.int64)
    args = args[:5] + (slots.astype(index_dtype),) + args[6:]
    with jax.enable_x64(index_dtype == "int64"):  # int64 slots reach the implementation as int64
        for layer in range(L):
            o = dict(opts, layer=layer)
            want = mla_reference.mla_rope_and_cache(*args, **o)
            got = jrc.mla_rope_and_cache(*_platform_args(platform, args), **o, impl=impl)
            assert_mla_close(got, want, args, o, impl, f"layer {layer}: ")
            for g, w, before in zip(flat_outputs(got)[2:], flat_outputs(want)[2:], jax.tree.leaves(args[4])):
                untouched = ulp_diff(w, before) == 0
                assert not (ulp_diff(g, before)[untouched] != 0).any(), f"layer {layer}: a row no slot owns changed"


def test_reference_writes_exactly_the_valid_slots():
    """The oracle's own rules on one problem: q_out = cat(q_nope, rope(q_pe)) with q_nope's bits,
    every valid slot holds cat(kv_c, k_pe_out), every other slot keeps its bits."""
    case = MlaCase(T=11, BS=4, NB=8)
    args, opts = make_mla_problem(case, seed=3)
    q_out, k_pe_out, kc = mla_reference.mla_rope_and_cache(*args, **opts)
    q_nope, q_pe, kv_c, k_pe, kc0, slots = args[:6]
    assert np.array_equal(q_out[..., : case.Dn].view(np.uint16), q_nope.view(np.uint16))
    assert not np.array_equal(q_out[..., case.Dn:], q_pe)  # rotated
    valid = (slots >= 0) & (slots < kc0.shape[0] * kc0.shape[1])
    assert 0 < valid.sum() < case.T
    flat, flat0 = kc.reshape(-1, kc.shape[-1]), kc0.reshape(-1, kc0.shape[-1])
    row = np.concatenate([kv_c, k_pe_out], axis=-1)
    assert np.array_equal(flat[slots[valid]].view(np.uint16), row[valid].view(np.uint16))
    untouched = np.setdiff1d(np.arange(len(flat)), slots[valid])
    assert np.array_equal(flat[untouched].view(np.uint16), flat0[untouched].view(np.uint16))


def test_rotation_is_the_main_ops_gptj_rotation():
    """rope(k_pe) equals the main op's reference rotation of a one-head k with GPT-J pairs."""
    from jax_rope_cache import reference

    args, opts = make_mla_problem(MlaCase(T=6, Dr=16), seed=4)
    q_nope, q_pe, kv_c, k_pe, kc, slots, pos, cos, sin = args
    _, k_pe_out, _ = mla_reference.mla_rope_and_cache(*args, **opts)
    k = k_pe[:, None, :]
    kcache = np.zeros((4, 16, 1, 16), k.dtype)
    _, k_out, _, _ = reference.rope_and_cache(k, k, k, kcache, kcache.copy(), np.full(6, -1, np.int32), pos, cos, sin,
                                              is_neox=False)
    assert np.array_equal(k_out[:, 0].view(np.uint16), k_pe_out.view(np.uint16))


def _kernel_platforms():
    return [p for p in ("cpu", "cuda", "rocm") if any(i.values[0] == p and i.values[1] == "kernel" for i in IMPLS)]


@pytest.mark.parametrize("platform", _kernel_platforms())
@pytest.mark.parametrize("layout", ["combined", "split"])
def test_one_custom_call_caches_aliased_no_copy(platform, layout):
    case = MlaCase(layout=layout, T=9, QH=16, Dn=512, Dc=512, Dr=64, BS=16, NB=64)
    args, opts = make_mla_problem(case, seed=5)
    args = _platform_args(platform, args)

    @jax.jit
    def step(q_nope, q_pe, kv_c, k_pe, kv_cache, slots, pos, cos, sin):
        return jrc.mla_rope_and_cache(q_nope, q_pe, kv_c, k_pe, kv_cache, slots, pos, cos, sin, **opts, impl="kernel")

    step = jax.jit(step.__wrapped__ if hasattr(step, "__wrapped__") else step, donate_argnums=(4,))
    hlo = step.lower(*args).compile().as_text()
    assert len(re.findall(r"custom-call\(|custom_call_target=", hlo)) >= 1
    targets = set(re.findall(r'custom_call_target="([^"]+)"', hlo))
    assert len(targets) == 1 and "mla" in next(iter(targets)) or platform != "cpu", targets
    assert len(re.findall(r'custom_call_target="', hlo)) == 1, hlo
    assert "input_output_alias" in hlo
    cache_shape = ",".join(str(d) for d in (64, 16, 576 if layout == "combined" else 512))
    assert not re.search(rf"copy[^\n]*\[{cache_shape}\]", hlo), "a copy of a cache"
    want = mla_reference.mla_rope_and_cache(*jax.tree.map(np.asarray, args), **opts)
    assert_mla_close(step(*args), want, args, opts, "kernel")


@pytest.mark.parametrize("platform,impl", IMPLS)
def test_stacked_layers_in_scan_write_in_place(platform, impl):
    """Stacked caches [L, ...] carried through lax.scan over the layers (a traced layer), each
    step writing its layer; layers outside [0, L) write nothing."""
    L = 4
    case = MlaCase(T=6, layers=L, layout="split" if impl == "kernel" else "combined")
    args, opts = make_mla_problem(case, seed=6)
    opts = {k: v for k, v in opts.items() if k != "layer"}
    order = jnp.asarray([2, -1, 0, L, 3], jnp.int32)

    @jax.jit
    def run(kv_cache):
        def body(c, li):
            return jrc.mla_rope_and_cache(*args[:4], c, *args[5:], **opts, impl=impl, layer=li)[2], None
        return jax.lax.scan(body, kv_cache, order)[0]

    run = jax.jit(run.__wrapped__ if hasattr(run, "__wrapped__") else run, donate_argnums=(0,))
    dev_cache = _platform_args(platform, args[4])
    hlo = run.lower(dev_cache).compile().as_text()
    assert "input_output_alias" in hlo
    got = run(dev_cache)
    want = args[4]
    for li in [2, -1, 0, L, 3]:
        want = mla_reference.mla_rope_and_cache(*args[:4], want, *args[5:], **opts, layer=np.array(li, np.int32))[2]
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        if impl == "kernel":
            assert_bits_equal(np.asarray(g), w, "stacked cache")
        else:
            assert ulp_diff(np.asarray(g), w).max() <= 1


@pytest.mark.parametrize("platform,impl", IMPLS)
def test_refs_are_written_in_place(platform, impl):
    case = MlaCase(layout="split")
    args, opts = make_mla_problem(case, seed=7)
    args = _platform_args(platform, args)
    refs = tuple(jax.new_ref(c) for c in args[4])
    step = jax.jit(lambda *a: jrc.mla_rope_and_cache(*a, **opts, impl=impl)[:2])
    q_out, k_pe_out = step(*args[:4], refs, *args[5:])
    want = mla_reference.mla_rope_and_cache(*jax.tree.map(np.asarray, args), **opts)
    assert_mla_close((q_out, k_pe_out, tuple(r[...] for r in refs)), want, args, opts, impl)


@pytest.mark.parametrize("platform,impl", IMPLS)
def test_vmap_over_batched_caches(platform, impl):
    B = 3
    case = MlaCase(T=5)
    probs = [make_mla_problem(case, seed=10 + b) for b in range(B)]
    opts = probs[0][1]
    batched = [np.stack([p[0][i] for p in probs]) for i in range(9)]
    batched[7], batched[8] = probs[0][0][7], probs[0][0][8]  # one table for all
    fn = lambda q_nope, q_pe, kv_c, k_pe, c, s, p: jrc.mla_rope_and_cache(  # noqa: E731
        q_nope, q_pe, kv_c, k_pe, c, s, p, batched[7], batched[8], **opts, impl=impl)
    got = jax.jit(jax.vmap(fn))(*_platform_args(platform, batched[:7]))
    for b in range(B):
        a = list(probs[b][0])
        a[7], a[8] = batched[7], batched[8]
        want = mla_reference.mla_rope_and_cache(*a, **opts)
        assert_mla_close(jax.tree.map(lambda x: np.asarray(x)[b], got), want, a, opts, impl, f"batch {b}: ")


def test_empty_call_and_eager_kernel():
    case = MlaCase(T=0)
    args, opts = make_mla_problem(dataclasses.replace(case), seed=8)
    q, k, c = jrc.mla_rope_and_cache(*args, **opts)
    assert q.shape == (0, case.QH, case.Dn + case.Dr) and k.shape == (0, case.Dr)
    assert np.array_equal(np.asarray(c).view(np.uint16), args[4].view(np.uint16))


def test_not_differentiable():
    args, opts = make_mla_problem(MlaCase(T=3, dtype=F32), seed=9)
    for impl in ("xla", None):
        with pytest.raises(TypeError, match="not differentiable"):
            jax.grad(lambda q: jrc.mla_rope_and_cache(args[0], q, *args[2:], **opts, impl=impl)[0].sum())(args[1])


def test_make_and_read_mla_cache():
    for layout, cdt in (("combined", FN), ("split", FN), ("combined", E5)):
        args, opts = make_mla_problem(MlaCase(layout=layout, cache_dtype=cdt), seed=12)
        q_out, k_pe_out, c = jrc.mla_rope_and_cache(*args, **opts)
        lat, rope = jrc.read_mla_cache(c, args[5], layout=layout, latent_dim=64)
        wl, wr = mla_reference.read_mla_cache(mla_reference.mla_rope_and_cache(*args, **opts)[2], args[5],
                                              layout=layout, latent_dim=64)
        assert_bits_equal(np.asarray(lat), wl, "latent")
        assert_bits_equal(np.asarray(rope), wr, "rope")
    c = jrc.make_mla_cache(4, 16, 512, 64, jnp.bfloat16, num_layers=2)
    assert c.shape == (2, 4, 16, 576) and c.dtype == jnp.bfloat16
    for dt in (jnp.float8_e4m3fn, jnp.float8_e5m2):
        ckv, kpe = jrc.make_mla_cache(4, 16, 512, 64, dt, layout="split", fill="random")
        assert ckv.shape == (4, 16, 512) and kpe.shape == (4, 16, 64) and ckv.dtype == kpe.dtype == np.dtype(dt)
        assert np.asarray(ckv.astype(jnp.float32)).any()


ERRORS = [  # (change to a valid call, exception, message)
    (lambda a, o: ((a[0].astype(np.float32),) + a[1:], o), TypeError, r"q_nope: expected dtype bfloat16"),
    (lambda a, o: (a[:2] + (a[2][:, :-1],) + a[3:], o), ValueError, r"kv_cache: expected shape \[NB, BS, Dc \+ Dr\]"),
    (lambda a, o: (a[:3] + (a[3][:, None],) + a[4:], o), ValueError, r"k_pe: expected rank 2"),
    (lambda a, o: (a[:4] + ((a[4], a[4].copy()),) + a[5:], o), TypeError, r"kv_cache: layout 'combined' expects one"),
    (lambda a, o: (a, dict(o, layout="split")), TypeError, r"kv_cache: layout 'split' expects a pair"),
    (lambda a, o: (a, dict(o, layout="paged")), ValueError, r"layout: expected one of \('combined', 'split'\)"),
    (lambda a, o: (a, dict(o, kv_scale=0.5)), ValueError, r"kv_scale: scales apply to float8 caches only"),
    (lambda a, o: (a, dict(o, q_out_dtype=np.float16)), TypeError, r"q_out_dtype: expected None, bfloat16"),
    (lambda a, o: (a, dict(o, q_out_dtype=FN)), ValueError, r"q_scale: a float8_e4m3fn cache needs a scale"),
    (lambda a, o: (a, dict(o, q_scale=np.float32(1))), ValueError, r"q_scale: applies to a float8 q_out only"),
    (lambda a, o: (a[:7] + (a[7][:, :3], a[8][:, :3]), o), ValueError, r"cos: expected the .half. table form \[max_pos, Dr/2\] = \[max_pos, 8\] for Dr=16"),
    (lambda a, o: (a[:5] + (a[5].astype(np.float32),) + a[6:], o), TypeError, r"slot_mapping: expected dtype int32"),
    (lambda a, o: (a, dict(o, layer=0)), ValueError, r"kv_cache: expected rank 4 \[L, NB, BS, Dc \+ Dr\]"),
    (lambda a, o: (a, dict(o, precision="fp16")), ValueError, r"precision: expected one of"),
    (lambda a, o: (a, dict(o, impl="triton")), ValueError, r"impl: expected one of"),
]


@pytest.mark.parametrize("change,exc,msg", ERRORS, ids=[m for _, _, m in ERRORS])
def test_errors_name_argument_expected_and_given(change, exc, msg):
    args, opts = make_mla_problem(MlaCase(), seed=13)
    bad_args, bad_opts = change(args, opts)
    with pytest.raises(exc, match=msg):
        jrc.mla_rope_and_cache(*bad_args, **bad_opts)
    if "impl" not in bad_opts:  # the oracle checks the same contract
        with pytest.raises(exc, match=msg):
            mla_reference.mla_rope_and_cache(*bad_args, **bad_opts)


def test_cpu_handler_checks_its_operands():
    """A direct ffi_call of the MLA CPU handler with a wrong buffer gets an error naming it, never a
    memory fault."""
    from jax_rope_cache.backends import native
    from jax_rope_cache.mla import kernels

    native.register_target(kernels.CPU_TARGET, native.native_module().mla_cpu_handler, "cpu")
    args, opts = make_mla_problem(MlaCase(T=4), seed=14)
    ops = list(args[:4]) + [args[4]] + list(args[5:]) + [np.float32(1), np.float32(1), np.int32(0)]
    T, QH, Dn, Dr, Dc = 4, 4, 32, 16, 64
    outs = [jax.ShapeDtypeStruct((T, QH, Dn + Dr), BF16), jax.ShapeDtypeStruct((T, Dr), BF16),
            jax.ShapeDtypeStruct(args[4].shape, BF16)]
    def call(ops, outs):  # the CPU handler: run on the CPU also on a GPU host
        with jax.default_device(jax.devices("cpu")[0]):
            return jax.block_until_ready(jax.ffi.ffi_call(kernels.CPU_TARGET, outs)(*ops, is_neox=False, native=False))
    got = call(ops, outs)
    want = mla_reference.mla_rope_and_cache(*args, **opts)
    assert_bits_equal(np.asarray(got[0]), want[0], "q_out")
    bad = list(ops)
    bad[2] = ops[2][:, :-8]  # kv_c narrower than the cache row says
    with pytest.raises(Exception, match=r"kv_cache: expected dims"):
        jax.block_until_ready(call(bad, outs))
    bad = list(ops)
    bad[4] = ops[4][:, :, :-1]
    with pytest.raises(Exception, match=r"kv_cache: expected dims"):
        jax.block_until_ready(call(bad, outs[:2] + [jax.ShapeDtypeStruct(bad[4].shape, BF16)]))
    with pytest.raises(Exception, match=r"q_out: expected dims"):
        jax.block_until_ready(call(ops, [jax.ShapeDtypeStruct((T, QH, Dn), BF16)] + outs[1:]))
    with pytest.raises(Exception, match=r"expected 12 operands"):
        jax.block_until_ready(call(ops[:-1], outs))


def test_layout_test_covers_mla_package():
    """The MLA subpackage is part of the one-way import stack."""
    import test_package_layout as tpl

    graph = tpl.import_graph()
    assert any(m.startswith("jax_rope_cache.mla.") for m in graph)
    assert not tpl.upward_imports(graph)


def test_contract_spec_shares_the_main_ops_names():
    args, opts = make_mla_problem(MlaCase(dtype=BF16, cache_dtype=FN), seed=15)
    from jax_rope_cache.mla import contract as mc

    spec = mc.check_mla(*args, **opts)
    assert spec.rotary_dim == 16 and spec.fp8 and not spec.q_fp8 and spec.num_slots == spec.num_blocks * 8
    assert mc.operands("combined").index("layer") == 11 and mc.cache_aliases("split") == {4: 2, 5: 3}
    assert contract.FP8_DTYPES[0] == FN
