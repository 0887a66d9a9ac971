"""jit(vmap(rope_and_cache)) over numpy arrays the traced function closes over, for every impl,
with array caches and with jax.Ref caches.

vmap over a numpy array leaves that array as the batched value, and the enclosing jit's trace only
accepts canonical jax values: any step of the op that hands a batched value straight to that trace
(as jax's batching of a jax.custom_jvp does) fails with "non-canonical constant of type ndarray".
Each batch element is compared with the numpy reference; the caches start random (never zeros),
so entries the op must leave alone are checked too.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

import jax_rope_cache as jrc
from jax_rope_cache import backends
from conftest import (Case, assert_bits_equal, assert_fma_close, impl_params, make_problem, reference_op,
                      xla_bound)

CASE = Case(T=5, QH=4, KH=2, D=64, BS=8, NB=3, dtype="float32")
BATCH = 3
NAMES = ("q_out", "k_out", "key_cache", "value_cache")


def _params():
    """(platform, impl) of conftest.impl_params, plus impl=None on each platform."""
    out = list(impl_params())
    for p in dict.fromkeys(p.values[0] for p in impl_params()):
        out.append(pytest.param(p, None, id=f"{p}-default"))
    return out


def _problems():
    """BATCH independent random problems of one shape (the tables are shared: one per call)."""
    probs = [make_problem(CASE, seed=100 + b) for b in range(BATCH)]
    opts = probs[0][1]
    cos, sin = probs[0][0][7:9]
    elems = [a[:7] + (cos, sin) for a, _ in probs]
    stacked = [np.stack([e[i] for e in elems]) for i in range(7)]
    return elems, stacked, cos, sin, opts


def _check(got, elems, opts, exact, what):
    for b, args in enumerate(elems):
        want = reference_op(*args, **opts)
        for name, g, w in zip(NAMES, got, want):
            if exact:  # the native kernels are bit-exact to the reference
                assert_bits_equal(g[b], w, f"{name} [{what}, element {b}]")
            else:
                assert_fma_close(g[b], w, xla_bound(name, args, opts), f"{name} [{what}, element {b}]")


@pytest.mark.parametrize("caches", ["jit-arguments", "closed-over", "refs"])
@pytest.mark.parametrize("platform,impl", _params())
def test_jit_of_vmap_over_closed_over_numpy_inputs(platform, impl, caches):
    elems, (q, k, v, kc, vc, slots, pos), cos, sin, opts = _problems()
    assert np.abs(kc).min() > 0 and np.abs(vc).min() > 0  # random caches: untouched entries are checked

    def batched(key_cache, value_cache):
        per = lambda q, k, v, a, b, s, p: jrc.rope_and_cache(q, k, v, a, b, s, p, cos, sin, impl=impl, **opts)  # noqa
        return jax.vmap(per)(q, k, v, key_cache, value_cache, slots, pos)

    with jax.default_device(jax.devices(platform)[0]):
        if caches == "jit-arguments":
            got = jax.jit(batched)(kc, vc)
        elif caches == "closed-over":
            got = jax.jit(lambda: batched(kc, vc))()
        else:
            def with_refs(key_cache, value_cache):
                kr, vr = jax.new_ref(key_cache), jax.new_ref(value_cache)
                q_out, k_out, kr_out, vr_out = batched(kr, vr)
                assert kr_out is kr and vr_out is vr  # the refs themselves come back, written
                return q_out, k_out, kr[...], vr[...]

            got = jax.jit(with_refs)(kc, vc)
    exact = impl == "kernel" or (impl is None and platform in backends.kernel_platforms())
    _check([np.asarray(g) for g in got], elems, opts, exact, f"{platform}, impl={impl}, caches {caches}")


@pytest.mark.parametrize("caches", ["jit-arguments", "closed-over"])
@pytest.mark.parametrize("platform,impl", _params())
def test_mla_jit_of_vmap_over_closed_over_numpy_inputs(platform, impl, caches):
    """The MLA op's XLA path had the same no-differentiation wrapper: the same check against its
    numpy reference."""
    from mla_cases import MlaCase, make_mla_problem
    from test_mla import assert_mla_close

    from jax_rope_cache.mla import reference as mla_reference

    probs = [make_mla_problem(MlaCase(T=5), seed=40 + b) for b in range(BATCH)]
    opts = probs[0][1]
    cos, sin = probs[0][0][7], probs[0][0][8]
    stacked = [np.stack([p[0][i] for p in probs]) for i in range(7)]
    assert np.abs(stacked[4].astype(np.float32)).min() > 0  # random caches

    def batched(cache):
        per = lambda a, b, c, d, kv, s, p: jrc.mla_rope_and_cache(a, b, c, d, kv, s, p, cos, sin, **opts,  # noqa
                                                                     impl=impl)
        return jax.vmap(per)(*stacked[:4], cache, *stacked[5:7])

    with jax.default_device(jax.devices(platform)[0]):
        got = jax.jit(batched)(stacked[4]) if caches == "jit-arguments" else jax.jit(lambda: batched(stacked[4]))()
    exact = impl == "kernel" or (impl is None and platform in backends.kernel_platforms())
    for b in range(BATCH):
        args = list(probs[b][0])
        args[7], args[8] = cos, sin
        want = mla_reference.mla_rope_and_cache(*args, **opts)
        assert_mla_close(jax.tree.map(lambda x: np.asarray(x)[b], got), want, args, opts,
                         "kernel" if exact else "xla", f"[{platform}, impl={impl}, {caches}, element {b}] ")
