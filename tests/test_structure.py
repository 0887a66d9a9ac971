"""Structure, not only values: the caches are updated in place.

For every (platform, impl): a donated jit aliases both caches (`input_output_alias=` in the
compiled HLO; "kv_merged": its one array), contains no copy of a cache-shaped buffer, and needs
less temp memory than one cache; a 64-step fori_loop decode keeps all of that and matches 64
reference steps; the library's own donating entry point consumes the caches it is given; the
kernel path is one custom call.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np
import pytest

import jax_rope_cache as jrc
from conftest import Case, assert_bits_equal, assert_fma_close, impl_params, make_problem, reference_op, to_host

CASE = Case(T=8, QH=8, KH=2, D=128, NB=64, BS=16, layout="xpacked")
LAYOUTS = ("xpacked", "head_major", "kv_merged")  # the structure of each kind of cache argument
OPTS_STATIC = ("layout", "is_neox", "rotary_dim", "precision")


def _on(platform, tree):
    return jax.device_put(tree, jax.devices(platform)[0])


def _dims(shape) -> str:
    return "[" + ",".join(str(d) for d in shape) + "]"


def widens_bf16_scatter(platform, impl, cache_dtype) -> bool:
    """Whether the XLA path copies a bf16 cache here: the CPU compiler of jaxlib < 0.12 has no bf16
    scatter (it would widen the whole cache to f32 and back, rewriting NaN payloads), so the XLA
    path scatters the cache's uint16 bits there, and that XLA copies each cache into its integer view
    (jaxlib 0.11.1, measured: temp memory 1.06 caches for one call, 2.09 in a fori_loop, where both
    copies are live; the caches still aliased in and out).
    Only the XLA path on CPU; jaxlib >= 0.12 and GPUs scatter bf16 in place."""
    old = tuple(int(x) for x in jaxlib.__version__.split(".")[:2]) < (0, 12)
    return old and platform == "cpu" and impl == "xla" and np.dtype(cache_dtype) == np.dtype(jnp.bfloat16)


def check_in_place(compiled, cache_shapes, cache_bytes, n_params_before_caches=3, widened=False, n_caches=2):
    """The caches (parameters n_params_before_caches.. of `n_caches` arrays: 1 for kv_merged's one
    array) are aliased in and out, never copied, and temp memory holds less than one cache;
    `widened` (widens_bf16_scatter): a copy of each cache into its bit view is expected, and no more
    than that (temp memory below 2.25 caches). cache_bytes=None: no bound on temp memory (programs
    with GEMMs, whose workspace can exceed a cache: check_temp_independent_of_pool instead)."""
    text = compiled.as_text()
    aliases = {int(p) for _, p in re.findall(r"\{(\d*)\}: \((\d+), \{\}, (?:may|must)-alias\)", text)}
    assert "input_output_alias=" in text, "no input_output_alias in the compiled module"
    want = set(range(n_params_before_caches, n_params_before_caches + n_caches))
    assert want <= aliases, f"caches not aliased: {aliases}"
    for line in text.splitlines():
        if re.search(r"\bcopy(-start)?\(", line):
            for shape in cache_shapes:
                assert _dims(shape) not in line, f"cache-shaped copy: {line.strip()}"
    if cache_bytes is None:
        return text
    temp = compiled.memory_analysis().temp_size_in_bytes
    if widened:
        assert temp < 2.25 * cache_bytes, f"temp memory {temp} B holds more than a copy of each cache ({cache_bytes} B)"
        return text
    assert temp < cache_bytes, f"temp memory {temp} B holds a cache-sized buffer ({cache_bytes} B)"
    return text


def check_temp_independent_of_pool(compiled, lower, caches):
    """Temp memory of a program over stacked paged caches [L, NB, ...] does not grow with the pool
    (NB): a copy of a cache, or of one layer of one, grows with it; what a model step legitimately
    holds (activations, the gathered blocks of its sequences, a GEMM library's workspace: 32 MiB
    with cuBLAS on Hopper) does not. An absolute bound cannot tell a cache from such a workspace.
    `compiled`: the program at the caches' pool; lower(structs): the same program lowered for
    caches of these shapes."""
    grown = [jax.ShapeDtypeStruct((c.shape[0], 2 * c.shape[1], *c.shape[2:]), c.dtype, sharding=c.sharding)
             for c in caches]
    base = compiled.memory_analysis().temp_size_in_bytes
    big = lower(tuple(grown)).compile().memory_analysis().temp_size_in_bytes
    piece = min(c.nbytes // c.shape[0] for c in caches)  # one layer of the smallest cache, at NB
    assert big - base < piece // 2, (f"temp memory grows with the pool: {base} B at NB={caches[0].shape[1]}, "
                                     f"{big} B at twice that (one layer of a cache: {piece} B)")


def _split(args, opts):
    static = {k: v for k, v in opts.items() if k in OPTS_STATIC}
    dynamic = {k: v for k, v in opts.items() if k not in OPTS_STATIC}
    return static, dynamic


def _caches(args) -> list:
    """The cache arrays of a call: both, or kv_merged's one (its value cache is None)."""
    return [c for c in args[3:5] if c is not None]


@pytest.mark.parametrize("platform,impl", impl_params())
@pytest.mark.parametrize("layout", LAYOUTS)
def test_donated_jit_updates_caches_in_place(platform, impl, layout):
    """kv_merged: its ONE array is donated, aliased to its result and written in place; the op's
    value_cache placeholder is no cache-sized buffer (temp memory below one cache)."""
    args, opts = make_problem(dataclasses.replace(CASE, layout=layout), seed=11)
    static, _ = _split(args, opts)
    step = jax.jit(lambda *a: jrc.rope_and_cache(*a, **static, impl=impl), donate_argnums=(3, 4))
    dargs = _on(platform, args)
    compiled = step.lower(*dargs).compile()
    caches = _caches(args)
    text = check_in_place(compiled, [c.shape for c in caches], args[3].nbytes, n_caches=len(caches),
                          widened=widens_bf16_scatter(platform, impl, args[3].dtype))
    if impl == "kernel":
        calls = re.findall(r"custom_call_target=\"(jax_rope_cache[a-z_]*|__gpu\$xla\.gpu\.ptx)\"", text)
        assert len(calls) == 1, f"expected one kernel custom call, found {calls}"
    want = reference_op(*args, **opts)
    got = to_host(compiled(*dargs))
    for g, w in zip(got[2:], want[2:]):
        assert_fma_close(g, w, 2.0**-22 * 8, "cache")
    assert all(c.is_deleted() for c in _caches(dargs)), "donated caches were not consumed"


@pytest.mark.parametrize("platform,impl", impl_params())
@pytest.mark.parametrize("layout", ["flash", "kv_merged"])
def test_fori_loop_decode_keeps_caches_in_place(platform, impl, layout):
    steps = 64
    case = Case(T=4, QH=8, KH=2, D=64, NB=80, BS=16, layout=layout)
    args, opts = make_problem(case, seed=12)
    q, k, v, kc, vc, _, _, cos, sin = args
    base_slots = np.arange(case.T, dtype=np.int32) * 300  # token t owns slots [300 t, 300 t + 64)
    static, _ = _split(args, opts)

    def decode(q, k, v, kc, vc, cos, sin):
        def body(i, carry):
            kc, vc, acc = carry
            slots = jnp.asarray(base_slots) + i
            pos = jnp.full((case.T,), i, jnp.int32)
            qo, ko, kc, vc = jrc.rope_and_cache(q * (i + 1).astype(q.dtype), k, v, kc, vc, slots, pos, cos, sin,
                                                **static, impl=impl)
            return kc, vc, acc + qo[0, 0, 0].astype(jnp.float32)
        return jax.lax.fori_loop(0, steps, body, (kc, vc, jnp.float32(0)))

    loop = jax.jit(decode, donate_argnums=(3, 4))
    dargs = _on(platform, (q, k, v, kc, vc, cos, sin))
    compiled = loop.lower(*dargs).compile()
    text = compiled.as_text()
    caches = _caches(args)
    check_in_place(compiled, [c.shape for c in caches], kc.nbytes, n_caches=len(caches),
                   widened=widens_bf16_scatter(platform, impl, kc.dtype))
    assert not re.search(r"dynamic-update-slice\(|\bdynamic-slice\(", text) or impl == "xla"
    got_kc, got_vc, _ = compiled(*dargs)

    want_kc, want_vc = kc, vc
    for i in range(steps):
        qi = (q.astype(np.float32) * (i + 1)).astype(q.dtype)
        _, _, want_kc, want_vc = reference_op(qi, k, v, want_kc, want_vc, base_slots + i,
                                              np.full(case.T, i, np.int32), cos, sin, **opts)
    got_vc = None if got_vc is None else np.asarray(got_vc)
    if impl == "kernel":
        assert_bits_equal(np.asarray(got_kc), want_kc, "key_cache after 64 steps")
    else:
        assert_fma_close(np.asarray(got_kc), want_kc, 2.0**-22 * 8, "key_cache after 64 steps")
    assert_bits_equal(got_vc, want_vc, "value_cache after 64 steps")


@pytest.mark.parametrize("platform,impl", impl_params())
@pytest.mark.parametrize("layout", ["xpacked", "kv_merged"])
def test_library_donating_entry_point(platform, impl, layout):
    args, opts = make_problem(dataclasses.replace(CASE, layout=layout), seed=13)
    static, dynamic = _split(args, opts)
    dargs = _on(platform, args)
    lowered = jrc.rope_and_cache_donated.lower(*dargs, **static, **dynamic, impl=impl)
    caches = _caches(args)
    check_in_place(lowered.compile(), [c.shape for c in caches], args[3].nbytes, n_caches=len(caches),
                   widened=widens_bf16_scatter(platform, impl, args[3].dtype))
    out = jrc.rope_and_cache_donated(*dargs, **static, **dynamic, impl=impl)
    assert all(c.is_deleted() for c in _caches(dargs))
    want = reference_op(*args, **opts)
    if layout == "kv_merged":  # V lives in the one array: its V heads (odd heads) exactly
        assert out[3] is None
        assert_fma_close(np.asarray(out[2])[:, :, 1::2], want[2][:, :, 1::2], 0.0, "kv_pages V heads")
    else:
        assert_fma_close(np.asarray(out[3]), want[3], 0.0, "value_cache")


def test_without_donation_the_callers_caches_survive():
    """A jit that does not donate must copy (XLA's rule): the caller's arrays stay valid."""
    args, opts = make_problem(CASE, seed=14)
    static, _ = _split(args, opts)
    kc = jnp.asarray(args[3])
    out = jax.jit(lambda *a: jrc.rope_and_cache(*a, **static))(*args[:3], kc, *args[4:])
    assert not kc.is_deleted()
    assert_bits_equal(np.asarray(kc), args[3], "caller's key_cache")
    assert not np.array_equal(np.asarray(out[2]).view(np.uint8), args[3].view(np.uint8))


@pytest.mark.parametrize("layout", ["flash", "xpacked_shuffled"])
def test_fp8_caches_on_the_xla_path_are_never_converted_whole(layout):
    """The XLA path writes fp8 caches as bytes: no convert of a cache-shaped buffer (XLA's CPU backend
    has no fp8 arithmetic and would convert the whole cache to f16 and back on every call). The caches
    stay aliased; XLA's CPU backend still spends one pass (and a temp buffer) on the same-width
    bitcast, which is why temp memory is not checked here (README, "fp8 on the XLA path")."""
    case = Case(T=16, QH=8, KH=2, D=128, NB=256, BS=16, layout=layout, cache_dtype="float8_e4m3fn")
    args, opts = make_problem(case, seed=15)
    static, _ = _split(args, opts)
    scales = {k: opts[k] for k in ("k_scale", "v_scale")}
    step = jax.jit(lambda *a: jrc.rope_and_cache(*a, **static, **scales, impl="xla"), donate_argnums=(3, 4))
    dargs = _on("cpu", args)
    compiled = step.lower(*dargs).compile()
    text = compiled.as_text()
    aliases = {int(p) for _, p in re.findall(r"\{(\d*)\}: \((\d+), \{\}, (?:may|must)-alias\)", text)}
    assert {3, 4} <= aliases, f"caches not aliased: {aliases}"
    for line in text.splitlines():
        if re.search(r"(?<![-\w])convert\(", line):
            for shape in (args[3].shape, args[4].shape):
                assert _dims(shape) not in line, f"cache-shaped convert: {line.strip()}"
    want = reference_op(*args, **opts)
    got = [np.asarray(o) for o in compiled(*dargs)]
    assert_bits_equal(got[3], want[3], "value_cache")
    assert_fma_close(got[2], want[2], 2.0**-22 * 8 / min(opts["k_scale"], 1.0), "key_cache")
