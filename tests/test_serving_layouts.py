"""The HND layout and X taken from the x-packed key cache, on every implementation present.

HND (FlashInfer's paged layout): K and V caches [NB, KH, BS, D], element (blk, off, h, d) at
cache[blk, h, off, d]. X of the x-packed layouts is the key cache's last dimension (any power of two
dividing D, and BS for the shuffled value cache). Each implementation is compared bit for bit (the
native kernels) or within the XLA path's bound against the numpy reference on fresh random data with
random pre-filled caches; the reference's placement is checked against the layout's definition.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

import jax_rope_cache as jrc
from jax_rope_cache import contract, reference
from conftest import Case, assert_bits_equal, impl_params, make_problem, reference_op
from test_op import check_against_reference

CASES = [
    Case(T=9, QH=8, KH=2, D=64, layout="hnd"),
    Case(T=7, QH=4, KH=2, D=80, R=48, layout="hnd", is_neox=False, table="full", dtype="float16",
         cache_dtype="float8_e4m3fnuz", precision="native", table_dtype="float16", index_dtype="int64"),
    Case(T=9, QH=4, KH=2, D=64, layout="xpacked", X=4),
    Case(T=6, QH=4, KH=1, D=64, layout="xpacked_shuffled", X=1, is_neox=False, dtype="float32"),
    Case(T=8, QH=4, KH=2, D=128, BS=32, layout="xpacked_shuffled", X=32, cache_dtype="float8_e4m3fn",
         precision="native"),
    Case(T=5, QH=2, KH=2, D=64, layout="xpacked", X=16, dtype="bfloat16", table_dtype="bfloat16", precision="native"),
]


@pytest.mark.parametrize("platform,impl", impl_params())
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_matches_reference(platform, impl, case):
    check_against_reference(platform, impl, case, seed=len(case.id))


def test_reference_places_hnd_elements_by_the_definition():
    case = Case(T=12, QH=6, KH=3, D=32, BS=8, layout="hnd")
    args, opts = make_problem(case, seed=4)
    _, k_out, kc, vc = reference.rope_and_cache(*args, **opts)
    slots, before_k = args[5].astype(np.int64), args[3]
    changed = np.zeros(kc.shape, bool)
    for t, s in enumerate(slots):
        if 0 <= s < kc.shape[0] * case.BS:
            blk, off = divmod(int(s), case.BS)
            assert_bits_equal(kc[blk, :, off, :], k_out[t], "K at [blk, h, off, d]")
            assert_bits_equal(vc[blk, :, off, :], args[2][t], "V at [blk, h, off, d]")
            changed[blk, :, off, :] = True
    assert_bits_equal(kc[~changed], before_k[~changed], "every other entry keeps its bits")


def test_x_packed_placement_by_the_definition():
    """K (blk, off, h, d) at kc[blk, h, d // X, off, d % X]; shuffled V at vc[blk, h, off // X, d, off % X]."""
    x, bs = 4, 16
    case = Case(T=10, QH=2, KH=2, D=32, BS=bs, layout="xpacked_shuffled", X=x)
    args, opts = make_problem(case, seed=6)
    _, k_out, kc, vc = reference.rope_and_cache(*args, **opts)
    assert kc.shape[-1] == vc.shape[-1] == x
    d = np.arange(case.D)
    for t, s in enumerate(args[5].astype(np.int64)):
        if 0 <= s < kc.shape[0] * bs:
            blk, off = divmod(int(s), bs)
            for h in range(case.KH):
                assert_bits_equal(kc[blk, h, d // x, off, d % x], k_out[t, h], "K")
                assert_bits_equal(vc[blk, h, off // x, d, off % x], args[2][t, h], "V")


@pytest.mark.parametrize("platform,impl", impl_params())
@pytest.mark.parametrize("layout,x", [("hnd", None), ("xpacked", 2)])
def test_stacked_layers_traced_layer(platform, impl, layout, x):
    """Stacked caches [L, ...] written at a traced layer, one scan over the layers."""
    num_layers, case = 3, Case(T=6, QH=4, KH=2, D=64, layout=layout, X=x)
    args, opts = make_problem(case, seed=9)
    rng = np.random.default_rng(1)
    kc = rng.standard_normal((num_layers,) + args[3].shape).astype(args[3].dtype)
    vc = rng.standard_normal((num_layers,) + args[4].shape).astype(args[4].dtype)
    want_k, want_v = kc, vc
    for layer in range(num_layers):
        _, _, want_k, want_v = reference.rope_and_cache(*args[:3], want_k, want_v, *args[5:], layer=layer, **opts)
    dev = jax.devices(platform)[0]

    def step(caches, layer):
        out = jrc.rope_and_cache(*args[:3], *caches, *args[5:], layer=layer, impl=impl, **opts)
        return (out[2], out[3]), None

    (got_k, got_v), _ = jax.jit(lambda c: jax.lax.scan(step, c, np.arange(num_layers, dtype=np.int32)))(
        jax.device_put((kc, vc), dev))
    assert_bits_equal(np.asarray(got_k), want_k, "stacked K")
    assert_bits_equal(np.asarray(got_v), want_v, "stacked V")


def test_default_x_keeps_the_kernel_configuration():
    """The default X adds nothing to the kernels' configuration (cache keys and code unchanged)."""
    from jax_rope_cache.backends import cuda

    spec = contract.check_op(*make_problem(Case(layout="xpacked"), 0)[0], layout="xpacked")
    assert spec.pack_x == 0 and contract.kernel_codes(spec).x == 0
    assert "RC_X" not in dict(cuda.kernel_config(spec).defines)
    spec4 = contract.check_op(*make_problem(Case(layout="xpacked", X=4), 0)[0], layout="xpacked")
    assert spec4.pack_x == 4 and dict(cuda.kernel_config(spec4).defines)["RC_X"] == 4
