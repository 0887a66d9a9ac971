"""The serving engines' layouts (HND, JAX's Pallas head_major and kv_merged) and X taken from the
x-packed key cache, on every implementation present.

HND (FlashInfer's paged layout): K and V caches [NB, KH, BS, D], element (blk, off, h, d) at
cache[blk, h, off, d]. head_major (JAX's Pallas paged_attention): [KH, NB, BS, D], at cache[h, blk,
off, d]; its per-token scale caches [KH, NB, BS]. kv_merged (JAX's Pallas ragged_paged_attention):
one array [NB, BS, 2*KH, D], K at kv[blk, off, 2h, d] and V at kv[blk, off, 2h + 1, d]. X of the
x-packed layouts is the key cache's last dimension (any power of two dividing D, and BS for the
shuffled value cache). Each implementation is compared bit for bit (the
native kernels) or within the XLA path's bound against the numpy reference on fresh random data with
random pre-filled caches; the reference's placement is checked against the layout's definition.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

import jax_rope_cache as jrc
from jax_rope_cache import contract, reference
from conftest import Case, assert_bits_equal, impl_params, make_problem, num_blocks, reference_op
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
    Case(T=9, QH=8, KH=2, D=64, layout="head_major"),
    Case(T=7, QH=4, KH=4, D=80, R=48, layout="head_major", is_neox=False, table="full", dtype="float16",
         cache_dtype="float8_e5m2", precision="native", table_dtype="float16", index_dtype="int64"),
    Case(T=9, QH=8, KH=2, D=64, layout="kv_merged", dtype="float32"),
    Case(T=70, QH=8, KH=1, D=128, BS=32, layout="kv_merged", cache_dtype="float8_e4m3fn", precision="native",
         is_neox=False),
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


def _placed(case, seed):
    """The reference's call of `case` and each valid token's (t, blk, off)."""
    args, opts = make_problem(case, seed=seed)
    out = reference.rope_and_cache(*args, **opts)
    nslots = num_blocks(case) * case.BS
    return args, out, [(t, *divmod(int(s), case.BS)) for t, s in enumerate(args[5].astype(np.int64))
                       if 0 <= s < nslots]


def test_reference_places_head_major_elements_by_the_definition():
    """K (blk, off, h, d) at kc[h, blk, off, d], V at vc[h, blk, off, d]; nothing else changes."""
    case = Case(T=12, QH=6, KH=3, D=32, BS=8, layout="head_major")
    args, (_, k_out, kc, vc), tokens = _placed(case, 5)
    assert kc.shape == vc.shape == (3, num_blocks(case), 8, 32)
    changed = np.zeros(kc.shape, bool)
    for t, blk, off in tokens:
        assert_bits_equal(kc[:, blk, off, :], k_out[t], "K at [h, blk, off, d]")
        assert_bits_equal(vc[:, blk, off, :], args[2][t], "V at [h, blk, off, d]")
        changed[:, blk, off, :] = True
    assert_bits_equal(kc[~changed], args[3][~changed], "every other K entry keeps its bits")
    assert_bits_equal(vc[~changed], args[4][~changed], "every other V entry keeps its bits")


def test_reference_places_kv_merged_elements_by_the_definition():
    """One array: K (blk, off, h, d) at kv[blk, off, 2h, d], V at kv[blk, off, 2h + 1, d]."""
    case = Case(T=12, QH=6, KH=3, D=32, BS=8, layout="kv_merged")
    args, (_, k_out, kv, none), tokens = _placed(case, 6)
    assert args[4] is None and none is None and kv.shape == (num_blocks(case), 8, 6, 32)
    changed = np.zeros(kv.shape, bool)
    for t, blk, off in tokens:
        for h in range(case.KH):
            assert_bits_equal(kv[blk, off, 2 * h], k_out[t, h], f"K head {h} at [blk, off, 2h, d]")
            assert_bits_equal(kv[blk, off, 2 * h + 1], args[2][t, h], f"V head {h} at [blk, off, 2h + 1, d]")
        changed[blk, off] = True
    assert_bits_equal(kv[~changed], args[3][~changed], "every other entry keeps its bits")


def test_reference_places_head_major_scales_by_the_definition():
    """Per-token scales of a head_major cache at scale_cache[h, blk, off] (Pallas' k_scales_pages)."""
    case = Case(T=10, QH=4, KH=2, D=32, BS=8, layout="head_major", cache_dtype="float8_e4m3fn")
    args, opts = make_problem(case, seed=7)
    opts = {k: v for k, v in opts.items() if k not in ("k_scale", "v_scale")}
    ks, vs = (np.full(contract.scale_shape("head_major", num_blocks(case), 8, 2), 3.0, np.float32) for _ in "kv")
    out = reference.rope_and_cache(*args, **opts, k_scale_cache=ks, v_scale_cache=vs)
    assert out[4].shape == (2, num_blocks(case), 8)
    for t, s in enumerate(args[5].astype(np.int64)):
        if 0 <= s < num_blocks(case) * 8:
            blk, off = divmod(int(s), 8)
            for h in range(2):
                row = out[1][t, h].astype(np.float32)
                amax = np.abs(row).max()
                assert out[4][h, blk, off] == np.float32(amax / np.float32(448.0)), (t, h)
                assert out[5][h, blk, off] == np.float32(np.abs(args[2][t, h].astype(np.float32)).max() / 448.0)
    written = sum(1 for s in args[5] if 0 <= s < num_blocks(case) * 8)
    assert (out[4] != 3.0).sum() == 2 * written, "only the written slots' scales change"


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
@pytest.mark.parametrize("layout,x", [("hnd", None), ("xpacked", 2), ("head_major", None), ("kv_merged", None)])
def test_stacked_layers_traced_layer(platform, impl, layout, x):
    """Stacked caches [L, ...] written at a traced layer, one scan over the layers."""
    num_layers, case = 3, Case(T=6, QH=4, KH=2, D=64, layout=layout, X=x)
    args, opts = make_problem(case, seed=9)
    rng = np.random.default_rng(1)
    kc = rng.standard_normal((num_layers,) + args[3].shape).astype(args[3].dtype)
    vc = None if args[4] is None else rng.standard_normal((num_layers,) + args[4].shape).astype(args[4].dtype)
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
    assert_bits_equal(None if got_v is None else np.asarray(got_v), want_v, "stacked V")


def test_default_x_keeps_the_kernel_configuration():
    """The default X adds nothing to the kernels' configuration (cache keys and code unchanged)."""
    from jax_rope_cache.backends import cuda

    spec = contract.check_op(*make_problem(Case(layout="xpacked"), 0)[0], layout="xpacked")
    assert spec.pack_x == 0 and contract.kernel_codes(spec).x == 0
    assert "RC_X" not in dict(cuda.kernel_config(spec).defines)
    spec4 = contract.check_op(*make_problem(Case(layout="xpacked", X=4), 0)[0], layout="xpacked")
    assert spec4.pack_x == 4 and dict(cuda.kernel_config(spec4).defines)["RC_X"] == 4
