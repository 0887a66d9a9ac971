"""make_kv_cache allocates every layout and dtype (optionally stacked per layer); read_kv gathers
tokens back exactly as the numpy reference does."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jax_rope_cache as jrc
from jax_rope_cache import contract, reference
from conftest import Case, assert_bits_equal, make_problem, platforms

DTYPES = [jnp.bfloat16, jnp.float16, jnp.float32, ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e4m3fnuz, ml_dtypes.float8_e5m2]


@pytest.mark.parametrize("layout", contract.LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("num_layers", [None, 3])
def test_make_kv_cache_shapes(layout, dtype, num_layers):
    kc, vc = jrc.make_kv_cache(5, 32, 2, 128, dtype, layout=layout, num_layers=num_layers, fill="random")
    want_k, want_v = contract.cache_shapes(layout, 5, 32, 2, 128, dtype)
    lead = () if num_layers is None else (num_layers,)
    assert kc.shape == lead + want_k and kc.dtype == np.dtype(dtype)
    vals = np.asarray(kc).astype(np.float32)
    assert np.count_nonzero(vals) > 0.9 * vals.size and vals.std() > 0.5  # random, not zeros
    if contract.LAYOUT_TABLE[layout].merged:  # K and V in the one array
        assert vc is None and want_v is None
        return
    assert vc.shape == lead + want_v and vc.dtype == np.dtype(dtype)
    assert not np.array_equal(np.asarray(kc).view(np.uint8), np.asarray(vc).view(np.uint8))


@pytest.mark.parametrize("layout", contract.LAYOUTS)
@pytest.mark.parametrize("num_layers", [None, 2])
def test_make_kv_scale_cache_shapes(layout, num_layers):
    """The scale caches have the layout's scale axes: [NB, KH, BS], head_major [KH, NB, BS]."""
    ks, vs = jrc.make_kv_scale_cache(5, 32, 3, num_layers=num_layers, layout=layout)
    want = {"head_major": (3, 5, 32)}.get(layout, (5, 3, 32))
    assert ks.shape == vs.shape == (() if num_layers is None else (num_layers,)) + want
    assert ks.dtype == np.float32 and (np.asarray(ks) == 1).all()


def test_make_kv_cache_zeros():
    kc, vc = jrc.make_kv_cache(2, 16, 1, 64, layout="xpacked_shuffled")
    assert not np.asarray(kc).astype(np.float32).any() and not np.asarray(vc).astype(np.float32).any()


def _read_kv_checked(platform, case, seed):
    """(K read back, key cache, slots): read_kv on `platform` after the reference wrote `case`, equal
    to the reference's read_kv bit for bit."""
    args, opts = make_problem(case, seed=seed)
    _, _, kc, vc = reference.rope_and_cache(*args, **opts)
    slots = args[5]
    dev = jax.devices(platform)[0]
    got_k, got_v = jrc.read_kv(jax.device_put(kc, dev), None if vc is None else jax.device_put(vc, dev),
                               jax.device_put(slots, dev), layout=case.layout)
    want_k, want_v = reference.read_kv(kc, vc, slots, layout=case.layout)
    assert_bits_equal(np.asarray(got_k), want_k, "K")
    assert_bits_equal(np.asarray(got_v), want_v, "V")
    return np.asarray(got_k), kc, slots


@pytest.mark.parametrize("platform", platforms())
@pytest.mark.parametrize("layout", contract.LAYOUTS)
@pytest.mark.parametrize("cache_dtype", [None, "float8_e4m3fn", "float8_e5m2"])
def test_read_kv_matches_reference(platform, layout, cache_dtype):
    got_k, _, slots = _read_kv_checked(platform, Case(T=20, D=128, layout=layout, cache_dtype=cache_dtype), 21)
    assert got_k.astype(np.float32)[slots >= 0].any()


@pytest.mark.parametrize("layout,x,dtype", [("xpacked", 4, jnp.bfloat16), ("xpacked_shuffled", 16, jnp.bfloat16),
                                           ("xpacked", 1, ml_dtypes.float8_e4m3fn),
                                           ("xpacked_shuffled", 2, jnp.float32)])
def test_make_kv_cache_x(layout, x, dtype):
    """x= sets X of the x-packed layouts (the key cache's last dim); None keeps 16 // itemsize."""
    kc, vc = jrc.make_kv_cache(3, 16, 2, 64, dtype, layout=layout, x=x, num_layers=2, fill="random")
    want_k, want_v = contract.cache_shapes(layout, 3, 16, 2, 64, dtype, x)
    assert kc.shape == (2,) + want_k and vc.shape == (2,) + want_v and kc.shape[-1] == x
    default = jrc.make_kv_cache(3, 16, 2, 64, dtype, layout=layout)[0]
    assert default.shape[-1] == 16 // np.dtype(dtype).itemsize


@pytest.mark.parametrize("platform", platforms())
@pytest.mark.parametrize("layout,x", [("xpacked", 4), ("xpacked_shuffled", 2), ("xpacked", 16)])
def test_read_kv_takes_x_from_the_cache(platform, layout, x):
    got_k, kc, slots = _read_kv_checked(platform, Case(T=20, D=64, layout=layout, X=x), 22)
    # the element of (token t, head h, channel d) sits at kc[blk, h, d // X, off, d % X]
    t = int(np.flatnonzero((slots >= 0) & (slots < kc.shape[0] * 16))[0])
    blk, off = divmod(int(slots[t]), 16)
    d = np.arange(64)
    assert_bits_equal(kc[blk, 1, d // x, off, d % x], got_k[t, 1], "K placement")
