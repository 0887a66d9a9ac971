"""The model client's decode attention (jax_rope_cache/attention.py): the block gather reads every
layout by its definition, the decoder's write into the layouts being added to the op stores what
the op computes, and JAX's Pallas paged-attention kernels, called as the decoder calls them, equal
a numpy attention on fresh random caches (on the CPU interpreted: Triton's through Pallas' HLO
interpreter, Mosaic TPU's in TPU interpret mode; natively on a GPU)."""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jax_rope_cache as jrc
from conftest import platforms
from jax_rope_cache import attention as attn
from jax_rope_cache import decoder

BF16 = ml_dtypes.bfloat16


def layer_shapes(layout, NB, BS, KH, D, dtype=np.float32):
    return [s for s in jrc.cache_shapes(layout, NB, BS, KH, D, dtype) if s is not None]


def read_slot(caches, layout, blk, off):
    """K, V [KH, D] of one slot of one layer's numpy caches, from the layouts' definitions."""
    if layout == "kv_merged":
        row = caches[0][blk, off]          # [2 KH, D]
        return row[0::2], row[1::2]
    kc, vc = caches
    if layout == "head_major":
        return kc[:, blk, off], vc[:, blk, off]
    if layout == "flash":
        return kc[blk, off], vc[blk, off]
    if layout == "hnd":
        return kc[blk, :, off], vc[blk, :, off]
    k = kc[blk, :, :, off, :].reshape(kc.shape[1], -1)  # x-packed K [NB, KH, D//X, BS, X]
    if layout == "xpacked":
        return k, vc[blk, :, :, off]
    x = kc.shape[-1]
    return k, vc[blk, :, off // x, :, off % x]            # shuffled V [NB, KH, BS//X, D, X]


@pytest.mark.parametrize("stacked", [True, False], ids=["stacked", "one-layer"])
@pytest.mark.parametrize("layout", attn.GATHER_LAYOUTS)
def test_block_gather_reads_each_layout_by_its_definition(layout, stacked):
    """gather_blocks returns every slot of every sequence's blocks in position order, at a traced
    layer of stacked caches or from one layer's caches; for the op's layouts also what read_kv reads."""
    L, NB, BS, KH, D = 3, 7, 8, 2, 32
    rng = np.random.default_rng(4)
    shapes = layer_shapes(layout, NB, BS, KH, D)
    caches = [rng.standard_normal(((L,) if stacked else ()) + s).astype(np.float32) for s in shapes]
    bt = np.array([[5, 2, -1], [0, 6, 3]], np.int32)  # -1: padding, read as block 0 (masked by attention)
    fn = jax.jit(attn.gather_blocks, static_argnames="layout")
    k, v = fn(tuple(caches), jnp.int32(1) if stacked else None, bt, layout=layout)
    assert k.shape == v.shape == (2, 3 * BS, KH, D)
    one = [c[1] for c in caches] if stacked else caches
    for b in range(2):
        for pos in range(3 * BS):
            want = read_slot(one, layout, max(bt[b, pos // BS], 0), pos % BS)
            np.testing.assert_array_equal(np.asarray(k[b, pos]), want[0])
            np.testing.assert_array_equal(np.asarray(v[b, pos]), want[1])
    slots = (np.maximum(bt, 0)[:, :, None] * BS + np.arange(BS)).reshape(-1)
    # the library's reader agrees
    rk, rv = jrc.read_kv(*(list(one) + [None])[:2], slots, layout=layout)
    np.testing.assert_array_equal(np.asarray(k).reshape(rk.shape), np.asarray(rk))
    np.testing.assert_array_equal(np.asarray(v).reshape(rv.shape), np.asarray(rv))


@pytest.mark.parametrize("stacked", [True, False], ids=["stacked", "one-layer"])
@pytest.mark.parametrize("layout", ["head_major", "kv_merged"])
def test_decoder_write_stores_what_the_op_computes(layout, stacked):
    """decoder.rope_and_write into head_major / kv_merged: q and k are the op's (here: with the
    QK-norm), every valid slot holds the op's k and the token's v, and no other slot changes
    (slots -1 and past the pool write nothing)."""
    T, QH, KH, D, NB, BS, L = 6, 4, 2, 32, 5, 8, 3
    rng = np.random.default_rng(7)
    qkv = rng.standard_normal((T, (QH + 2 * KH) * D)).astype(np.float32)
    cos, sin = jrc.rope_tables(64, D, base=10000.0)
    slots = np.array([3, 17, -1, 39, NB * BS, 8], np.int32)
    pos = rng.integers(0, 64, T).astype(np.int32)
    opts = dict(q_norm_weight=rng.random(D).astype(np.float32), k_norm_weight=rng.random(D).astype(np.float32),
                norm_eps=1e-6)
    shapes = layer_shapes(layout, NB, BS, KH, D)
    init = [rng.standard_normal(((L,) if stacked else ()) + s).astype(np.float32) for s in shapes]
    layer = jnp.int32(2) if stacked else None
    q, k, got = jax.jit(lambda c, lay: decoder.rope_and_write(qkv, c, slots, pos, cos, sin, layout=layout, layer=lay,
                                                              num_q_heads=QH, num_kv_heads=KH, **opts)
                        )(tuple(init), layer)
    fk, fv = (np.zeros(s, np.float32) for s in jrc.cache_shapes("flash", NB, BS, KH, D, np.float32))
    want_q, want_k, *_ = jrc.rope_and_cache_qkv(qkv, fk, fv, slots, pos, cos, sin, num_q_heads=QH, num_kv_heads=KH,
                                               **opts)
    np.testing.assert_array_equal(np.asarray(q), np.asarray(want_q))
    np.testing.assert_array_equal(np.asarray(k), np.asarray(want_k))
    v = qkv.reshape(T, QH + 2 * KH, D)[:, QH + KH:]
    got = [np.asarray(c) for c in got]
    for c, c0 in zip(got, init):
        if stacked:  # the other layers are untouched
            np.testing.assert_array_equal(np.delete(c, 2, 0), np.delete(c0, 2, 0))
    now = [c[2] for c in got] if stacked else got
    before = [c[2] for c in init] if stacked else init
    written = {int(s): t for t, s in enumerate(slots) if 0 <= s < NB * BS}
    for s in range(NB * BS):
        gk, gv = read_slot(now, layout, s // BS, s % BS)
        if s in written:
            np.testing.assert_array_equal(gk, np.asarray(want_k)[written[s]])
            np.testing.assert_array_equal(gv, v[written[s]])
        else:
            bk, bv = read_slot(before, layout, s // BS, s % BS)
            np.testing.assert_array_equal(gk, bk)
            np.testing.assert_array_equal(gv, bv)


# ---- the Pallas kernels against numpy ----------------------------------------------------------
def _kernel_params():
    """(platform, attention): each kernel where it runs, natively or interpreted on the CPU."""
    out = []
    for p in platforms():
        dev = jax.devices(p)[0]
        for a in ("pallas_gpu", "pallas_tpu"):
            try:
                attn.check_platform(a, dev)
            except ValueError:
                continue
            if p == "rocm" and a == "pallas_gpu":
                continue  # the Triton kernel is untried on ROCm: not a platform the decoder offers by default
            out.append(pytest.param(p, a, id=f"{p}-{a}"))
    return out


def numpy_attention(q, k, v, lengths):
    """q [B, QH, D]; k, v [B, S, KH, D]; float64 softmax(q k / sqrt(D)) v over keys < length."""
    B, QH, D = q.shape
    KH = k.shape[2]
    out = np.zeros((B, QH, D))
    for b in range(B):
        for h in range(QH):
            kk, vv = k[b, :lengths[b], h // (QH // KH)].astype(np.float64), v[b, :lengths[b], h // (QH // KH)]
            s = kk @ q[b, h].astype(np.float64) / np.sqrt(D)
            p = np.exp(s - s.max())
            out[b, h] = (p / p.sum()) @ vv.astype(np.float64)
    return out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("group", [1, 4, 20])
@pytest.mark.parametrize("platform,attention", _kernel_params())
def test_paged_decode_equals_numpy_attention(platform, attention, group, dtype):
    """paged_decode on one layer's head_major caches (pre-filled with random values, pages scattered,
    block tables padded with -1) equals numpy's attention over each sequence's first `length` keys,
    for GQA groups below, at and above the GPU kernel's 16-row blocks. pallas_tpu reads K and V as
    bfloat16 (tpu.paged_attention converts them), so its float32 reference rounds them first."""
    KH, D, NB, BS, B = 2, 64, 40, 8, 5
    QH = KH * group
    dt = np.dtype(dtype)
    rng = np.random.default_rng(group)
    kp, vp = (rng.standard_normal((KH, NB, BS, D)).astype(dt) for _ in "kv")
    pages_per_seq = 7
    bt = np.full((B, pages_per_seq), -1, np.int32)
    lengths = np.array([1, BS, 2 * BS + 3, pages_per_seq * BS, 20], np.int32)
    perm = rng.permutation(NB)
    for b, n in enumerate(lengths):
        used = -(-n // BS)
        bt[b, :used], perm = perm[:used], perm[used:]
    q = rng.standard_normal((B, QH, D)).astype(dt)
    dev = jax.devices(platform)[0]
    width = attn.page_width(attention, pages_per_seq, BS, group)
    fn = jax.jit(lambda q, kp, vp, bt, n: attn.paged_decode(attention, q, kp, vp, attn.page_table(bt, width), n,
                                                            block_size=BS, interpret=attn.interpret_on(dev)))
    got = np.asarray(fn(*jax.device_put((q, kp, vp, bt, lengths), dev))).astype(np.float64)
    ks, vs = (np.moveaxis(c[:, np.maximum(bt, 0)], 0, 3).reshape(B, -1, KH, D) for c in (kp, vp))
    if attention == "pallas_tpu":
        ks, vs = ks.astype(BF16), vs.astype(BF16)
    qs = (q.astype(np.float32) * np.float32(1 / np.sqrt(D))).astype(dt).astype(np.float64) * np.sqrt(D)
    want = numpy_attention(qs, ks.astype(np.float32), vs.astype(np.float32), lengths)
    tol = 2e-5 if dt == np.float32 else 2e-2  # float32: summation order; bfloat16: the output's rounding
    err = np.abs(got - want).max()
    assert err <= tol, f"max |paged_decode - numpy| = {err:.2e}"
    # length 1 sees its first key only: the value row itself
    np.testing.assert_allclose(got[0], np.repeat(vs[0, 0].astype(np.float64), group, axis=0), atol=tol)


def test_kernel_parameters_fit_the_kernels():
    """The static parameters each kernel asserts on: GPU blocks a multiple of 16 heads covering the
    group, powers of two per compute block, k_splits * pages_per_compute_block dividing the width;
    TPU pages_per_compute_block dividing the width; widths never below the block table's."""
    for pages in (1, 3, 7, 64, 515):
        for bs in (8, 16, 32):
            for group in (1, 4, 8, 16, 20):
                p = attn.gpu_params(pages, bs, group)
                assert p["block_h"] % 16 == 0 and group <= p["block_h"] < group + 16
                ppcb = p["pages_per_compute_block"]
                assert ppcb & (ppcb - 1) == 0 and ppcb * bs >= 16
                assert p["width"] >= pages and p["width"] % (p["k_splits"] * ppcb) == 0 and p["k_splits"] <= 16
            t = attn.tpu_params(pages, bs)
            assert t["width"] >= pages and t["width"] % t["pages_per_compute_block"] == 0
    table = np.asarray(attn.page_table(np.array([[4, -1, 2]], np.int32), 8))
    assert table.tolist() == [[4, 0, 2, 0, 0, 0, 0, 0]]  # every entry a real page


def test_the_gpu_kernels_deprecation_is_silenced_and_nothing_else():
    """jax deprecates the Pallas Triton ops; the suite fails on deprecation warnings, so gpu_kernel
    silences exactly that warning (in a fresh interpreter, where the module is imported first)."""
    code = ("import warnings; warnings.simplefilter('error');"
            "from jax_rope_cache import attention; f = attention.gpu_kernel();"
            "import jax.experimental.pallas.ops.gpu.paged_attention as m; assert f is m.paged_attention;"
            "warnings.warn('other', DeprecationWarning)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert r.returncode != 0 and "DeprecationWarning: other" in r.stderr, r.stderr[-2000:]
    assert "paged_attention is deprecated" not in r.stderr, r.stderr[-2000:]


def test_attention_choice_by_platform_and_errors():
    cpu = jax.devices("cpu")[0]
    assert attn.default_attention(cpu) == "gather"

    class Client:
        def __init__(self, version):
            self.platform_version = version

    class Device:
        def __init__(self, platform, version=""):
            self.platform, self.client = platform, Client(version)

    assert attn.default_attention(Device("gpu", "cuda 13000")) == "pallas_gpu"
    assert attn.default_attention(Device("gpu", "rocm 70100")) == "gather"
    assert attn.default_attention(Device("tpu")) == "pallas_tpu"
    with pytest.raises(ValueError, match="pallas_tpu.*TPUs or the CPU"):
        attn.check_platform("pallas_tpu", Device("gpu", "cuda 13000"))
    with pytest.raises(ValueError, match="attention: expected one of"):
        attn.check_platform("flash", cpu)


@pytest.mark.parametrize("attention", ["gather", "pallas_gpu"])
def test_demo_reads_q_out_with_an_attention(attention, capsys):
    """`demo --attention`: each decode layer's q_out read by the attention over one cache per layer
    in its layout; the final caches still equal the reference's (the op wrote what it must)."""
    from jax_rope_cache.cli import demo

    assert demo.run("llama-3.1-8b", tp=8, batch=3, prefill=5, steps=2, layers=2, repeats=1, attention=attention)
    out = capsys.readouterr().out
    assert f"q_out read by {attention} attention over {attn.layout_of(attention) or 'flash'} caches" in out, out
    assert "kernel bit-exact, xla bit-exact" in out, out


def test_generate_command_takes_an_attention(capsys):
    """`generate --attention pallas_gpu` times the decoder on head_major caches (the kernel interpreted
    here); a layout the attention does not read is refused by name."""
    from jax_rope_cache.cli import generate

    with pytest.raises(SystemExit) as e:
        generate.main(["--check", "none", "--impls", "kernel", "--attention", "pallas_gpu", "--batch", "2",
                       "--prompt-len", "3", "--steps", "2", "--repeats", "1", "--block-size", "8"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "head_major cache, attention pallas_gpu" in out, out
    with pytest.raises(SystemExit) as e:
        generate.main(["--check", "none", "--attention", "pallas_gpu", "--layout", "flash"])
    assert e.value.code == 2
    assert "--layout: attention 'pallas_gpu' reads 'head_major' caches, got 'flash'" in capsys.readouterr().err


def test_decoder_attention_and_layout_choice():
    """Decoder.choose_attention: None takes the device's kernel where its layout fits (or none is
    asked) and the caches are unquantized, else the gather; contradictions are refused by name."""
    class Client:
        platform_version = "cuda 13000"

    class Gpu:
        platform, client = "gpu", Client()

    choose = decoder.Decoder.choose_attention
    assert choose(None, None, None, Gpu()) == ("pallas_gpu", "head_major")
    assert choose(None, "flash", None, Gpu()) == ("gather", "flash")
    assert choose(None, None, "per_token", Gpu()) == ("gather", "flash")
    assert choose(None, None, None, jax.devices("cpu")[0]) == ("gather", "flash")
    assert choose("pallas_tpu", None, None, jax.devices("cpu")[0]) == ("pallas_tpu", "head_major")
    for args, match in ((("pallas_gpu", "flash", None), "layout: attention 'pallas_gpu' reads 'head_major'"),
                        (("pallas_gpu", None, "per_token"), "kv_quant: attention 'pallas_gpu' reads unquantized"),
                        (("paged", None, None), "attention: expected one of"),
                        (("pallas_tpu", None, None), "runs on TPUs or the CPU")):
        with pytest.raises(ValueError, match=match):
            choose(*args, Gpu() if args[0] == "pallas_tpu" else jax.devices("cpu")[0])
    from jax_rope_cache import decoder_mla

    assert decoder_mla.MlaDecoder.choose_attention(None, "combined", None, Gpu()) == ("gather", "combined")
    with pytest.raises(ValueError, match="attention: expected one of \\('gather',\\)"):
        decoder_mla.MlaDecoder.choose_attention("pallas_gpu", None, None, Gpu())
    cfg = decoder.TINY_CONFIGS["tiny-llama-3.1"]
    params = decoder.random_params(decoder.DecoderConfig.from_hf(cfg), 1)
    with pytest.raises(ValueError, match="per_layer: attention 'pallas_gpu' reads one cache per layer"):
        decoder.Decoder(cfg, params, attention="pallas_gpu", per_layer=False, max_len=16, device=jax.devices("cpu")[0])
    m = decoder.Decoder(cfg, params, layout="kv_merged", per_layer=True, max_len=16, max_seqs=2,
                        device=jax.devices("cpu")[0])
    assert m.attention == "gather" and len(m.caches) == 2 and m.value_cache is None
    assert m.key_cache.shape == (2, m.allocator.num_blocks, 16, 4, 32)  # stacked view of the per-layer caches
