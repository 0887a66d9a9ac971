"""mla_rope_and_cache against transformers' DeepSeek-V3 attention RoPE (an independent implementation):
DeepSeek-V3 and Kimi-K2 (a DeepSeek-V3 architecture) at TP8, q_pe [T, QH, 64] and k_pe [T, 64], bf16 and
f32, positions over the whole YaRN table. Recorded into tests/data/hf_mla_rope.npz by
tools/record_hf_mla_rope.py; compared live as well where torch + transformers import.

transformers rotates interleaved pairs by first de-interleaving (x.view(.., d/2, 2).transpose), then
rotate_half: its output is ours permuted by that same de-interleave (both q and k, so attention
scores are unchanged). Its arithmetic is torch's in the input dtype with its cos/sin rows cast to it:
bf16 is our "native" ("rounded") arithmetic with bf16 tables, f32 our "fp32".
"""

from __future__ import annotations

import os

import ml_dtypes
import numpy as np
import pytest

import jax_rope_cache as jrc
from jax_rope_cache.mla import reference as mla_reference
from jax_rope_cache.models import presets, tables
from jax_rope_cache.models.config import hf_rope_settings, mla_shard_shape

HF_FIXTURE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "hf_mla_rope.npz")
MODELS = ("deepseek-v3", "kimi-k2")
DTYPES = ("bfloat16", "float32")
T = 48
TP = 8


def _positions(max_pos: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.concatenate([np.arange(8), rng.integers(0, max_pos, T - 10), [max_pos - 2, max_pos - 1]]).astype(np.int64)


def _inputs(name: str, dtype: str):
    shape = presets.mla_shape(name, TP)
    rng = np.random.default_rng(len(name) + len(dtype))
    q_pe = rng.standard_normal((T, shape.q_heads, shape.rope_dim)).astype(np.float32)
    k_pe = rng.standard_normal((T, shape.rope_dim)).astype(np.float32)
    dt = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float32
    return q_pe.astype(dt), k_pe.astype(dt), _positions(presets.preset_config(name)["max_position_embeddings"], 7)


def deinterleave(x: np.ndarray) -> np.ndarray:
    """transformers' view(.., d/2, 2).transpose(-1, -2).reshape: channels (0, 2, 4, .., 1, 3, 5, ..)."""
    d = x.shape[-1]
    return x.reshape(x.shape[:-1] + (d // 2, 2)).swapaxes(-1, -2).reshape(x.shape)


def hf_outputs(name: str, dtype: str) -> dict:
    """transformers' inv_freq, attention factor, cos/sin rows and rotated q_pe / k_pe (needs torch)."""
    import torch
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (DeepseekV3RotaryEmbedding,
                                                                      apply_rotary_pos_emb_interleave)

    cfg = presets.preset_config(name)
    config = DeepseekV3Config(**{k: v for k, v in cfg.items() if k != "model_type"})
    rope = DeepseekV3RotaryEmbedding(config=config)
    q_pe, k_pe, pos = _inputs(name, dtype)
    tdt = torch.bfloat16 if dtype == "bfloat16" else torch.float32
    q = torch.from_numpy(q_pe.astype(np.float32)).to(tdt).transpose(0, 1)[None]  # [1, QH, T, Dr]
    k = torch.from_numpy(k_pe.astype(np.float32)).to(tdt)[None, None]  # [1, 1, T, Dr]
    pid = torch.from_numpy(pos)[None]
    cos, sin = rope(q, pid)
    q_out, k_out = apply_rotary_pos_emb_interleave(q, k, cos, sin)
    cos32, sin32 = rope(q.float(), pid)
    return dict(inv_freq=rope.inv_freq.float().numpy(), attention=np.float64(rope.attention_scaling),
                cos=cos32[0].numpy(), sin=sin32[0].numpy(), positions=pos,
                q_out=q_out[0].transpose(0, 1).float().numpy(), k_out=k_out[0, 0].float().numpy())


def record_hf() -> dict:
    import transformers

    out = {"transformers_version": np.array(transformers.__version__)}
    for name in MODELS:
        for dtype in DTYPES:
            for key, value in hf_outputs(name, dtype).items():
                out[f"{name}:{dtype}:{key}"] = value
    os.makedirs(os.path.dirname(HF_FIXTURE), exist_ok=True)
    np.savez_compressed(HF_FIXTURE, **out)
    return out


def _sources():
    out = []
    if os.path.exists(HF_FIXTURE):
        out.append(pytest.param("fixture", id="fixture"))
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401

        out.append(pytest.param("live", id="live"))
    except ImportError:
        pass
    return out


def _load(source: str, name: str, dtype: str) -> dict:
    if source == "live":
        return hf_outputs(name, dtype)
    data = np.load(HF_FIXTURE)
    return {k.split(":", 2)[2]: data[k] for k in data.files if k.startswith(f"{name}:{dtype}:")}


def test_fixture_is_present():
    assert os.path.exists(HF_FIXTURE), "tests/data/hf_mla_rope.npz is missing: run tools/record_hf_mla_rope.py"


@pytest.mark.parametrize("source", _sources())
@pytest.mark.parametrize("name", MODELS)
def test_tables_match_transformers(source, name):
    """Our YaRN (mscale / mscale_all_dim) frequencies and attention factor for the MLA configs equal
    transformers' within its float32 rounding; the rotation is GPT-J style over qk_rope_head_dim."""
    hf = _load(source, name, "float32")
    cfg = presets.preset_config(name)
    s = hf_rope_settings(cfg)
    inv, attention = tables.rope_frequencies(s["rotary_dim"], base=s["base"], scaling=s["scaling"],
                                             max_pos=cfg["max_position_embeddings"])
    assert s["rotary_dim"] == 64 and np.isclose(attention, float(hf["attention"]), rtol=0, atol=1e-12)
    ulps = np.abs(inv.astype(np.float32).view(np.int32).astype(np.int64) - hf["inv_freq"].view(np.int32))
    assert ulps.max() <= 5, ulps.max()
    cos, sin, info = jrc.rope_tables_from_hf_config(cfg, tp=TP)
    assert not info.is_neox and cos.shape == (cfg["max_position_embeddings"], 32)
    small = hf["positions"] < 4096  # where float32 position products are exact enough to compare rows
    for ours, theirs in ((cos, hf["cos"]), (sin, hf["sin"])):
        assert np.allclose(ours[hf["positions"][small]], theirs[small, :32], atol=2e-5, rtol=0)
        assert np.array_equal(theirs[:, :32], theirs[:, 32:])  # transformers' halves layout


@pytest.mark.parametrize("source", _sources())
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("impl", ["reference", "kernel", "xla"])
def test_rotation_matches_transformers_bitwise(source, name, dtype, impl):
    """With transformers' own cos/sin rows (cast to the input dtype, as it does), q_out's rope part
    and the cached rope key are transformers' outputs, de-interleaved, bit for bit."""
    hf = _load(source, name, dtype)
    shape = mla_shard_shape(presets.preset_config(name), TP)
    q_pe, k_pe, pos = _inputs(name, dtype)
    dt = q_pe.dtype
    cos, sin = hf["cos"][:, :32].astype(dt), hf["sin"][:, :32].astype(dt)  # table row i = token i
    rows = np.arange(T, dtype=np.int32)
    nb, bs = 4, 16
    q_nope = np.ones((T, shape.q_heads, shape.absorbed_nope_dim), dt)
    kv_c = np.ones((T, shape.latent_dim), dt)
    cache = np.zeros((nb, bs, shape.latent_dim + shape.rope_dim), dt)
    slots = np.arange(T, dtype=np.int32)
    args = (q_nope, q_pe, kv_c, k_pe, cache, slots, rows, cos, sin)
    opts = dict(precision="native" if dtype == "bfloat16" else "fp32")
    if impl == "reference":
        q_out, k_pe_out, cache = mla_reference.mla_rope_and_cache(*args, **opts)
    else:
        q_out, k_pe_out, cache = (np.asarray(x) for x in jrc.mla_rope_and_cache(*args, **opts, impl=impl))
    want_q, want_k = hf["q_out"].astype(dt), hf["k_out"].astype(dt)
    got_q = deinterleave(q_out[..., shape.absorbed_nope_dim:])
    if impl == "xla":  # the XLA path's bound (an FMA XLA may form): 1 ulp
        from conftest import ulp_diff

        assert ulp_diff(got_q, want_q).max() <= 1 and ulp_diff(deinterleave(k_pe_out), want_k).max() <= 1
        return
    uint = np.uint16 if dt.itemsize == 2 else np.uint32
    assert np.array_equal(got_q.view(uint), want_q.view(uint))
    assert np.array_equal(deinterleave(k_pe_out).view(uint), want_k.view(uint))
    assert np.array_equal(deinterleave(cache.reshape(-1, cache.shape[-1])[:T, shape.latent_dim:]).view(uint),
                          want_k.view(uint))
