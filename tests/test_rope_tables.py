"""RoPE tables (jax_rope_cache.models.tables, jax_rope_cache.models.presets).

1. Known answers: one hand-computable tiny case per scaling law and per table form (no transformers).
2. Bad settings and configs raise ValueError naming the key.
3. Presets: per-shard shapes at TP 1/2/4/8.
4. End to end: tables from real configs drive rope_and_cache (every impl here) like the reference,
   and the reference with these tables rotates like float64 RoPE maths.
5. Hugging Face transformers, for every law and every preset: against its outputs recorded in
   tests/data/hf_rope.npz (inv_freq and attention factor; `python tools/record_hf_rope.py`
   regenerates it) always, and live when torch and transformers import (the live part is skipped
   only when they are not installed; JRC_REQUIRE_TRANSFORMERS=1 makes that a failure), the live
   values also equal to the recorded ones:
   - inv_freq within INV_ULPS float32 ulps of transformers' (it computes them in float32),
   - the attention factor equal to 1e-12,
   - cos/sin built the way transformers builds them (emb = cat(freqs, freqs), cos(emb) *
     attention_scaling) from transformers' own inv_freq, at every row: |ours - theirs| <= 1e-6 +
     p * |inv_ours - inv_theirs| * scaling per element. The second term is exactly the angle error
     of transformers' float32 frequencies at position p (|cos a - cos b| <= |a - b|); where it is
     below 1e-6 the plain 1e-6 bound applies. Our tables are computed in float64, so at large
     positions they differ from a float32 implementation by that rounding and no less.
"""

from __future__ import annotations

import importlib
import math
import os

import jax
import ml_dtypes
import numpy as np
import pytest

import jax_rope_cache as jrc
from jax_rope_cache import reference
from jax_rope_cache.models import config, presets, tables
from conftest import Case, child_env, assert_bits_equal, assert_fma_close, impl_params, make_problem

TABLE_TOL = 1e-6
INV_ULPS = 4


# --- 1. known answers ----------------------------------------------------------------------------------

def _cos_sin(inv, att=1.0, rows=6):
    ang = np.arange(rows, dtype=np.float64)[:, None] * np.asarray(inv, np.float64)[None, :]
    return np.cos(ang) * att, np.sin(ang) * att


def _check_known(scaling, want_inv, want_att=1.0, *, max_pos=6, rotary_dim=None, base=100.0):
    r = rotary_dim or 2 * len(want_inv)
    inv, att = tables.rope_frequencies(r, base=base, scaling=scaling, max_pos=max_pos)
    np.testing.assert_allclose(inv, want_inv, rtol=1e-14, atol=0)
    assert att == pytest.approx(want_att, rel=1e-14)
    cos, sin = jrc.rope_tables(max_pos, r, base=base, scaling=scaling, dtype=np.float64)
    wc, ws = _cos_sin(want_inv, want_att, max_pos)
    np.testing.assert_allclose(cos, wc, rtol=0, atol=1e-14)
    np.testing.assert_allclose(sin, ws, rtol=0, atol=1e-14)


def test_default_known_answer():
    # R=4, base 100: inv_freq = 100^(-0/4), 100^(-2/4) = 1, 0.1
    _check_known(None, [1.0, 0.1])
    _check_known({"rope_type": "default"}, [1.0, 0.1])
    cos, sin = jrc.rope_tables(3, 4, base=100.0)
    assert cos.dtype == np.float32 and cos.shape == (3, 2)
    np.testing.assert_array_equal(cos[2], np.cos([2.0, 0.2]).astype(np.float32))
    np.testing.assert_array_equal(sin[2], np.sin([2.0, 0.2]).astype(np.float32))


def test_linear_known_answer():
    _check_known({"rope_type": "linear", "factor": 2.0}, [0.5, 0.05])
    _check_known({"type": "linear", "factor": 4}, [0.25, 0.025])  # legacy key "type"


def test_dynamic_known_answer():
    # base' = 100 * (2 * 16 / 8 - 1) ** (4 / 2) = 900 at max_pos 16: inv_freq 1, 1/30
    s = {"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 8}
    _check_known(s, [1.0, 1.0 / 30.0], max_pos=16)
    # at (or below) the original length the law is plain RoPE
    _check_known(s, [1.0, 0.1], max_pos=8)
    _check_known(s, [1.0, 0.1], max_pos=3)


def test_llama3_known_answer():
    # R=6, base 1000: inv_freq 1, 0.1, 0.01; wavelengths 2pi, 20pi, 200pi. L0=200, low 1, high 4:
    # 2pi < 200/4 kept; 200pi > 200/1 divided by factor 8; 20pi smoothed with
    # s = (200 / (20pi) - 1) / (4 - 1), inv = 0.1 * ((1 - s) / 8 + s).
    s = (200 / (20 * math.pi) - 1) / 3
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 200}
    _check_known(scaling, [1.0, 0.1 * ((1 - s) / 8 + s), 0.01 / 8], base=1000.0)


def test_yarn_known_answer():
    # R=8, base 1e4: inv_freq 1, 0.1, 0.01, 0.001, and the correction dimension of r rotations in
    # L0 positions is log10(L0 / (2 pi r)). L0=4096: beta_fast 32 -> 1.309, beta_slow 1 -> 2.814.
    lo, hi = math.log10(4096 / (2 * math.pi * 32)), math.log10(4096 / (2 * math.pi))
    base = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096}
    m = 0.1 * math.log(4.0) + 1.0  # 1.1386
    # truncate (default): lo, hi = 1, 3 -> ramp over i = 0..3 is 0, 0, 0.5, 1
    _check_known(base, [1.0, 0.1, 0.01 * (0.5 / 4 + 0.5), 0.001 / 4], m, base=1e4)
    _check_known({**base, "beta_fast": 32, "beta_slow": 1, "truncate": True},
                 [1.0, 0.1, 0.01 * (0.5 / 4 + 0.5), 0.001 / 4], m, base=1e4)
    # GPT-OSS style, no truncation: ramp (i - lo) / (hi - lo) clipped to [0, 1]
    ramp = np.clip((np.arange(4) - lo) / (hi - lo), 0, 1)
    want = np.array([1.0, 0.1, 0.01, 0.001]) * (ramp / 4 + (1 - ramp))
    _check_known({**base, "truncate": False}, want, m, base=1e4)
    # attention factor: explicit; mscale / mscale_all_dim ratio; mscale alone is ignored
    _check_known({**base, "truncate": False, "attention_factor": 0.5}, want, 0.5, base=1e4)
    _check_known({**base, "truncate": False, "mscale": 1.0, "mscale_all_dim": 0.5}, want,
                 (0.1 * math.log(4) + 1) / (0.05 * math.log(4) + 1), base=1e4)
    _check_known({**base, "truncate": False, "mscale": 0.707, "mscale_all_dim": 0.707}, want, 1.0, base=1e4)
    _check_known({**base, "truncate": False, "mscale": 2.0}, want, m, base=1e4)
    # factor <= 1: no attention scaling
    _check_known({**base, "factor": 1.0}, [1.0, 0.1, 0.01, 0.001], 1.0, base=1e4)


def test_longrope_known_answer():
    s = {"rope_type": "longrope", "short_factor": [1.0, 2.0], "long_factor": [2.0, 4.0],
         "original_max_position_embeddings": 8}
    _check_known(s, [1.0, 0.05], 1.0, max_pos=8)  # short factors, factor 8/8 = 1
    _check_known(s, [0.5, 0.025], math.sqrt(1 + math.log(2) / math.log(8)), max_pos=16)  # long, factor 2
    _check_known({**s, "factor": 4.0}, [0.5, 0.025], math.sqrt(1 + math.log(4) / math.log(8)), max_pos=16)
    _check_known({**s, "attention_factor": 1.25}, [0.5, 0.025], 1.25, max_pos=16)


def test_full_forms_and_dtypes():
    cos_h, sin_h = jrc.rope_tables(5, 6, base=1000.0, dtype=np.float64)
    cos_n, sin_n = jrc.rope_tables(5, 6, base=1000.0, dtype=np.float64, form="full")
    cos_j, sin_j = jrc.rope_tables(5, 6, base=1000.0, dtype=np.float64, form="full", is_neox=False)
    np.testing.assert_array_equal(cos_n, cos_h[:, [0, 1, 2, 0, 1, 2]])  # NeoX: [f, f]
    np.testing.assert_array_equal(sin_n, sin_h[:, [0, 1, 2, 0, 1, 2]])
    np.testing.assert_array_equal(cos_j, cos_h[:, [0, 0, 1, 1, 2, 2]])  # GPT-J: [f0, f0, f1, f1, ...]
    np.testing.assert_array_equal(sin_j, sin_h[:, [0, 0, 1, 1, 2, 2]])
    for dt in (np.float32, np.float16, ml_dtypes.bfloat16):
        c, s = jrc.rope_tables(5, 6, base=1000.0, dtype=dt)
        assert c.dtype == np.dtype(dt) and s.dtype == np.dtype(dt)
        np.testing.assert_array_equal(c, cos_h.astype(dt))  # one rounding from float64


def test_hf_config_reading():
    cfg = {"hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2, "rope_theta": 100.0,
           "partial_rotary_factor": 0.0625, "max_position_embeddings": 6}
    cos, sin, info = jrc.rope_tables_from_hf_config(cfg)  # head_dim 64, rotary_dim 4
    assert (info.rotary_dim, info.head_dim, info.is_neox, info.max_pos, info.rope_type) == (4, 64, True, 6, "default")
    np.testing.assert_allclose(cos, _cos_sin([1.0, 0.1])[0], atol=6e-8)
    assert info.shape == presets.ModelShape("model", 4, 2, 64, 4)
    # rope_parameters (newer transformers) wins over rope_scaling and carries rope_theta itself
    cfg2 = {**cfg, "rope_theta": 7.0, "rope_scaling": {"rope_type": "linear", "factor": 3.0},
            "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 100.0}}
    cos2, _, info2 = jrc.rope_tables_from_hf_config(cfg2, max_pos=4, tp=2)
    np.testing.assert_allclose(cos2, _cos_sin([0.5, 0.05], rows=4)[0], atol=6e-8)
    assert info2.shape.q_heads == 2 and info2.shape.kv_heads == 1
    # dynamic: table built for max_position_embeddings * factor by default
    cfg3 = {**cfg, "max_position_embeddings": 8, "rope_scaling": {"type": "dynamic", "factor": 2.0}}
    _, _, info3 = jrc.rope_tables_from_hf_config(cfg3)
    assert info3.max_pos == 16 and info3.scaling["original_max_position_embeddings"] == 8
    # yarn without factor: max_position_embeddings / original (transformers' rule)
    cfg4 = {**cfg, "max_position_embeddings": 32,
            "rope_scaling": {"rope_type": "yarn", "original_max_position_embeddings": 8}}
    _, _, info4 = jrc.rope_tables_from_hf_config(cfg4, max_pos=4)
    assert info4.scaling["factor"] == 4.0 and info4.attention_scaling == pytest.approx(0.1 * math.log(4) + 1)
    # GPT-J-style model types rotate interleaved pairs
    _, _, info5 = jrc.rope_tables_from_hf_config({**cfg, "model_type": "gptj"})
    assert not info5.is_neox and not info5.shape.is_neox


# --- 2. errors -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs,match", [
    (dict(scaling={"rope_type": "ntk-by-parts"}), r"scaling\['rope_type'\]"),
    (dict(scaling={"rope_type": "linear"}), r"scaling\['factor'\]"),
    (dict(scaling={"rope_type": "linear", "factor": "2"}), r"scaling\['factor'\]"),
    (dict(scaling={"rope_type": "linear", "factor": -1.0}), r"scaling\['factor'\]"),
    (dict(scaling={"rope_type": "linear", "factor": 2.0, "beta_fast": 3}), r"scaling\['beta_fast'\]"),
    (dict(scaling={"rope_type": "yarn", "factor": 2.0}), r"scaling\['original_max_position_embeddings'\]"),
    (dict(scaling={"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 4, "truncate": "no"}),
     r"scaling\['truncate'\]"),
    (dict(scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                   "original_max_position_embeddings": 8}), r"scaling\['high_freq_factor'\]"),
    (dict(scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0,
                   "original_max_position_embeddings": 8}), r"scaling\['high_freq_factor'\]"),
    (dict(scaling={"rope_type": "dynamic", "factor": 2.0}), r"scaling\['original_max_position_embeddings'\]"),
    (dict(scaling={"rope_type": "longrope", "long_factor": [1.0, 1.0], "original_max_position_embeddings": 4}),
     r"scaling\['short_factor'\]"),
    (dict(scaling={"rope_type": "longrope", "short_factor": [1.0], "long_factor": [1.0, 1.0],
                   "original_max_position_embeddings": 4}), r"scaling\['short_factor'\]"),
    (dict(scaling=[("rope_type", "linear")]), r"scaling:"),
    (dict(scaling={"rope_type": "linear", "factor": 2.0, "rope_theta": 10.0}), r"scaling\['rope_theta'\]"),
    (dict(rotary_dim=5), r"rotary_dim"),
    (dict(base=1.0), r"base"),
    (dict(max_pos=0), r"max_pos"),
    (dict(form="quarter"), r"form"),
    (dict(dtype=np.int32), r"dtype"),
])
def test_bad_settings_name_the_key(kwargs, match):
    args = dict(max_pos=8, rotary_dim=4, base=100.0)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        jrc.rope_tables(args.pop("max_pos"), args.pop("rotary_dim"), **args)


_CFG = {"num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 16, "rope_theta": 1e4,
        "max_position_embeddings": 64}


@pytest.mark.parametrize("change,match", [
    ({"rope_scaling": {"rope_type": "su"}}, r"config\['rope_scaling'\]\['rope_type'\]"),
    ({"rope_parameters": {"rope_type": "wavy"}}, r"config\['rope_parameters'\]\['rope_type'\]"),
    ({"rope_scaling": "yarn"}, r"config\['rope_scaling'\]"),
    ({"rope_parameters": {"sliding_attention": {"rope_type": "default"}}},  # per layer type, no full_attention
     r"config\['rope_parameters'\]: expected RoPE parameters for layer type 'full_attention' among "
     r"\['sliding_attention'\]"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}, "max_position_embeddings": None},
     r"config\['max_position_embeddings'\]"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0}},
     r"config\['rope_scaling'\]\['low_freq_factor'\]: rope_type 'llama3' needs"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": -4.0}}, r"config\['rope_parameters'\]\['factor'\]"),
    ({"max_position_embeddings": float("inf")}, r"config\['max_position_embeddings'\]"),
    ({"rope_theta": "big"}, r"config\['rope_theta'\]"),
    ({"head_dim": None}, r"config\['head_dim'\]"),
    ({"head_dim": 0}, r"config\['head_dim'\]"),
    ({"partial_rotary_factor": 0.1}, r"config\['partial_rotary_factor'\]"),  # 16 * 0.1 -> 1
    ({"partial_rotary_factor": 1.5}, r"config\['partial_rotary_factor'\]"),
    ({"max_position_embeddings": None}, r"config\['max_position_embeddings'\]"),
    ({"num_key_value_heads": 3}, r"config\['num_key_value_heads'\]"),
])
def test_bad_configs_name_the_key(change, match):
    with pytest.raises(ValueError, match=match):
        jrc.rope_tables_from_hf_config({**_CFG, **change})


@pytest.mark.parametrize("cfg,tp", [(_CFG, 3), (_CFG, 16), ({**_CFG, "num_attention_heads": 12, "num_key_value_heads": 6}, 4),
                                    (_CFG, 0), (_CFG, 2.0)])
def test_bad_tp(cfg, tp):
    with pytest.raises(ValueError, match=r"^tp"):
        jrc.rope_tables_from_hf_config(cfg, tp=tp)


def test_bad_preset_name():
    with pytest.raises(ValueError, match=r"name"):
        presets.preset_config("llama-9")


def test_importable_without_jax():
    import subprocess
    import sys
    code = ("import sys, jax_rope_cache as j; from jax_rope_cache.models import presets; "
            "c, s, i = presets.preset_tables('gpt-oss-120b', 8); j.rope_tables(4, 4, base=1e4); "
            "assert 'jax' not in sys.modules, 'jax imported'")
    subprocess.run([sys.executable, "-P", "-c", code], check=True, env=child_env())


# --- 3. presets ----------------------------------------------------------------------------------------

# (q heads, kv heads, head_dim, rotary_dim) per shard at TP 1, 2, 4, 8
PRESET_SHAPES = {
    "gpt-oss-120b": [(64, 8, 64, 64), (32, 4, 64, 64), (16, 2, 64, 64), (8, 1, 64, 64)],
    "qwen3-32b": [(64, 8, 128, 128), (32, 4, 128, 128), (16, 2, 128, 128), (8, 1, 128, 128)],
    "qwen3-235b-a22b": [(64, 4, 128, 128), (32, 2, 128, 128), (16, 1, 128, 128), (8, 1, 128, 128)],
    "llama-3.1-8b": [(32, 8, 128, 128), (16, 4, 128, 128), (8, 2, 128, 128), (4, 1, 128, 128)],
    "llama-3.1-70b": [(64, 8, 128, 128), (32, 4, 128, 128), (16, 2, 128, 128), (8, 1, 128, 128)],
    "llama-3.1-405b": [(128, 8, 128, 128), (64, 4, 128, 128), (32, 2, 128, 128), (16, 1, 128, 128)],
}


@pytest.mark.parametrize("name", sorted(presets.PRESETS))
def test_preset_shapes(name):
    assert set(PRESET_SHAPES) == set(presets.PRESETS)
    for tp, want in zip(presets.TP_DEGREES, PRESET_SHAPES[name]):
        s = presets.preset_shape(name, tp)
        assert (s.q_heads, s.kv_heads, s.head_dim, s.rotary_dim, s.is_neox) == want + (True,), (name, tp)
        assert s.name == (name if tp == 1 else f"{name}-tp{tp}")
        assert presets.model_shape(name, tp) == s  # the one model list agrees


# --- 4. end to end -------------------------------------------------------------------------------------

def _run(platform, impl, args, opts):
    dev = jax.devices(platform)[0]
    fn = jax.jit(lambda *a: jrc.rope_and_cache(*a, **opts, impl=impl))
    return [np.asarray(o) for o in fn(*jax.device_put(args, dev))]


_PHI3_LIKE = {"model_type": "phi3", "hidden_size": 3072, "num_attention_heads": 32, "num_key_value_heads": 32,
              "max_position_embeddings": 131072, "original_max_position_embeddings": 4096, "rope_theta": 10000.0,
              "rope_scaling": {"type": "longrope", "short_factor": list(np.linspace(1.0, 1.2, 48)),
                               "long_factor": list(np.linspace(1.0, 40.0, 48))}}
_GPTJ_LIKE = {"model_type": "gptj", "hidden_size": 1024, "num_attention_heads": 16, "rope_theta": 10000.0,
              "partial_rotary_factor": 0.5, "max_position_embeddings": 2048,
              "rope_scaling": {"rope_type": "linear", "factor": 2.0}}

E2E = [("gpt-oss-120b", "half", "bfloat16"), ("gpt-oss-120b", "full", "float32"), ("llama-3.1-8b", "half", "float32"),
       ("qwen3-32b", "full", "bfloat16"), ("phi3-like", "full", "float32"), ("gptj-like", "half", "float32"),
       ("gptj-like", "full", "bfloat16")]


def _e2e_config(name):
    return {"phi3-like": _PHI3_LIKE, "gptj-like": _GPTJ_LIKE}.get(name) or presets.preset_config(name)


def _e2e_problem(name, form, table_dtype, max_pos=96, seed=0):
    cfg = _e2e_config(name)
    cos, sin, info = jrc.rope_tables_from_hf_config(cfg, max_pos=max_pos, dtype=getattr(ml_dtypes, table_dtype, None)
                                                    or table_dtype, form=form)
    case = Case(T=7, QH=4, KH=2, D=info.head_dim, R=info.rotary_dim, is_neox=info.is_neox, table=form,
                dtype="float32", table_dtype=table_dtype, max_pos=max_pos)
    args, opts = make_problem(case, seed)
    return args[:7] + (cos, sin), opts, info


@pytest.mark.parametrize("platform,impl", impl_params())
@pytest.mark.parametrize("name,form,table_dtype", E2E, ids=["-".join(e) for e in E2E])
def test_tables_drive_the_op(platform, impl, name, form, table_dtype):
    args, opts, _ = _e2e_problem(name, form, table_dtype)
    want = reference.rope_and_cache(*args, **opts)
    got = _run(platform, impl, args, opts)
    big = 2.0 ** -22 * max(np.abs(args[0]).max(), np.abs(args[1]).max())  # FMA: 1 f32 ulp of a product
    for what, g, w in zip(("q_out", "k_out", "key_cache", "value_cache"), got, want):
        if impl == "kernel":
            assert_bits_equal(g, w, what)
        else:
            assert_fma_close(g, w, big, what)


@pytest.mark.parametrize("name,form,table_dtype", [e for e in E2E if e[2] == "float32"])
def test_reference_with_tables_is_rope(name, form, table_dtype):
    """The op reading these tables rotates like RoPE written out in float64 (transformers'
    rotate_half for NeoX, interleaved pairs for GPT-J), attention scaling included."""
    args, opts, info = _e2e_problem(name, form, table_dtype)
    q_out = reference.rope_and_cache(*args, **opts)[0]
    q, pos = args[0].astype(np.float64), np.clip(args[6].astype(np.int64), 0, info.max_pos - 1)
    inv, att = tables.rope_frequencies(info.rotary_dim, base=info.base, scaling=info.scaling, max_pos=info.max_pos)
    theta = pos[:, None, None] * inv[None, None, :]
    r = info.rotary_dim
    if info.is_neox:
        a, b = q[..., : r // 2], q[..., r // 2: r]
    else:
        a, b = q[..., 0:r:2], q[..., 1:r:2]
    ra = (a * np.cos(theta) - b * np.sin(theta)) * att
    rb = (b * np.cos(theta) + a * np.sin(theta)) * att
    want = q.copy()
    if info.is_neox:
        want[..., : r // 2], want[..., r // 2: r] = ra, rb
    else:
        want[..., 0:r:2], want[..., 1:r:2] = ra, rb
    err = np.abs(q_out.astype(np.float64) - want).max()
    assert err <= 4e-6 * np.abs(q).max(), err


# --- 5. Hugging Face transformers -----------------------------------------------------------------------

def _hf():
    if os.environ.get("JRC_REQUIRE_TRANSFORMERS") == "1":
        import torch  # noqa: F401
        import transformers  # noqa: F401
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    return AutoConfig, ROPE_INIT_FUNCTIONS


def _hf_config(cfg):
    AutoConfig, _ = _hf()
    d = {k: v for k, v in cfg.items() if k != "model_type"}
    return AutoConfig.for_model(cfg.get("model_type", "llama"), **d)


def _hf_rotary_class(model_type):
    mod = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    names = [n for n in dir(mod) if n.endswith("RotaryEmbedding") and not n.startswith("_")]
    assert len(names) == 1, names
    return getattr(mod, names[0])


def _hf_law(cfg, seq_len):
    """transformers' inv_freq and attention factor through ROPE_INIT_FUNCTIONS (the default law
    through the model's own compute_default_rope_parameters where the registry has no "default")."""
    _, funcs = _hf()
    config = _hf_config(cfg)
    params = config.rope_parameters
    law = params.get("rope_type", params.get("type", "default"))
    if law in funcs:
        inv, att = funcs[law](config, None, seq_len=seq_len)
    else:
        inv, att = _hf_rotary_class(cfg.get("model_type", "llama")).compute_default_rope_parameters(config)
    return inv.double().numpy(), float(att)


def _hf_model_rotary(cfg):
    """transformers' inv_freq and attention factor as the model's rotary embedding module holds them."""
    config = _hf_config(cfg)
    rot = _hf_rotary_class(cfg["model_type"])(config)
    return rot.inv_freq.double().numpy(), float(rot.attention_scaling)


def compare_with_hf(cfg, inv_hf, att_hf, max_pos, chunk=8192):
    """Asserts the three checks of the module docstring; returns measurements for reports."""
    cos, sin, info = jrc.rope_tables_from_hf_config(cfg, max_pos=max_pos, form="full")
    inv, att = tables.rope_frequencies(info.rotary_dim, base=info.base, scaling=info.scaling, max_pos=max_pos)
    assert inv.shape == inv_hf.shape, (inv.shape, inv_hf.shape)
    # transformers computes in float32: a few roundings (INV_ULPS), and the exponent 2i/R rounded to
    # float32 (exact when R is a power of two), which moves base**(-2i/R) by ln(base) * |error|.
    r = info.rotary_dim
    e = np.arange(0, r, 2) / r
    e32 = (np.arange(0, r, 2, dtype=np.float32) / np.float32(r)).astype(np.float64)
    ulp = np.spacing(inv_hf.astype(np.float32)).astype(np.float64)
    allowed = INV_ULPS * ulp + inv_hf * np.abs(e - e32) * (math.log(info.base) + 4.0)
    ulps = np.abs(inv - inv_hf) / ulp
    assert (np.abs(inv - inv_hf) <= allowed).all(), \
        f"inv_freq: {ulps.max():.2f} float32 ulps from transformers' (index {ulps.argmax()})"
    assert att == pytest.approx(att_hf, rel=1e-12, abs=0), (att, att_hf)
    assert info.attention_scaling == att
    dinv = np.abs(np.concatenate([inv - inv_hf] * 2)) * att_hf
    inv2 = np.concatenate([inv_hf, inv_hf])  # transformers: emb = cat(freqs, freqs)
    worst = worst_excess = 0.0
    for p0 in range(0, max_pos, chunk):
        p = np.arange(p0, min(p0 + chunk, max_pos), dtype=np.float64)[:, None]
        emb = p * inv2[None, :]
        bound = TABLE_TOL + p * dinv[None, :]
        for ours, theirs in ((cos[p0:p0 + chunk], np.cos(emb) * att_hf), (sin[p0:p0 + chunk], np.sin(emb) * att_hf)):
            err = np.abs(ours.astype(np.float64) - theirs)
            worst = max(worst, float(err.max()))
            worst_excess = max(worst_excess, float((err - bound).max()))
            bad = np.argwhere(err > bound)
            assert len(bad) == 0, (f"table row {p0 + bad[0][0]} column {bad[0][1]}: |err| "
                                   f"{err[tuple(bad[0])]:.3g} > {bound[tuple(bad[0])]:.3g}")
    strict_rows = int(min(max_pos, math.floor(TABLE_TOL / max(dinv.max(), 1e-300))))
    return dict(inv_ulps=float(ulps.max()), max_err=worst, rows_within_1e6=strict_rows, excess=worst_excess)


def _llama(rope_scaling, **kw):
    cfg = {"model_type": "llama", "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8,
           "max_position_embeddings": 8192, "rope_theta": 500000.0, "rope_scaling": rope_scaling}
    cfg.update(kw)
    return cfg


_YARN_QWEN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
# (id, config, max_pos): every law, with partial rotary, legacy "type", rope_parameters, mscale variants
HF_LAWS = [
    ("default", _llama(None), 8192),
    ("default-partial", {"model_type": "gpt_neox", "hidden_size": 2048, "num_attention_heads": 16,
                         "rotary_pct": 0.25, "partial_rotary_factor": 0.25, "rope_theta": 10000.0,
                         "max_position_embeddings": 2048}, 2048),
    ("linear", _llama({"rope_type": "linear", "factor": 4.0}, rope_theta=10000.0), 16384),
    ("linear-legacy-type", _llama({"type": "linear", "factor": 2.0}, rope_theta=10000.0), 4096),
    ("dynamic-2x", _llama({"rope_type": "dynamic", "factor": 2.0}, rope_theta=10000.0), 16384),
    ("dynamic-3x-at-2.5x", _llama({"rope_type": "dynamic", "factor": 3.0}, rope_theta=10000.0), 20480),
    ("dynamic-below-original", _llama({"rope_type": "dynamic", "factor": 2.0}, rope_theta=10000.0), 4096),
    ("llama3.1", _llama({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192}, max_position_embeddings=131072), 131072),
    ("llama3.2", _llama({"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192}, hidden_size=2048, head_dim=64,
                        max_position_embeddings=131072), 131072),
    ("yarn-qwen", _llama(_YARN_QWEN, rope_theta=1e6, head_dim=128, max_position_embeddings=131072), 131072),
    ("yarn-rope_parameters", _llama(None, rope_parameters={**_YARN_QWEN, "rope_theta": 1e6},
                                    max_position_embeddings=131072), 131072),
    ("yarn-gpt-oss", _llama({"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                             "original_max_position_embeddings": 4096, "truncate": False},
                            rope_theta=150000, head_dim=64, max_position_embeddings=131072), 131072),
    ("yarn-mscale", _llama({"rope_type": "yarn", "factor": 40.0, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
                            "mscale_all_dim": 0.8, "original_max_position_embeddings": 4096},
                           rope_theta=10000.0, head_dim=64, max_position_embeddings=163840), 65536),
    ("yarn-attention-factor", _llama({"rope_type": "yarn", "factor": 8.0, "attention_factor": 1.5,
                                      "beta_fast": 16.0, "beta_slow": 2.0, "original_max_position_embeddings": 2048},
                                     rope_theta=10000.0, max_position_embeddings=16384), 16384),
    ("yarn-partial", _llama(_YARN_QWEN, rope_theta=1e6, head_dim=128, partial_rotary_factor=0.5,
                            max_position_embeddings=131072), 131072),
    ("yarn-factor-from-lengths", _llama({"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 4096},
                                        rope_theta=10000.0, max_position_embeddings=16384), 16384),
    ("longrope-short", _PHI3_LIKE, 4096),
    ("longrope-long", _PHI3_LIKE, 131072),
    ("longrope-factor-attention", _llama({**_PHI3_LIKE["rope_scaling"], "factor": 16.0, "attention_factor": 1.1,
                                          "original_max_position_embeddings": 8192},
                                         hidden_size=3072, rope_theta=10000.0, max_position_embeddings=131072), 16384),
    ("longrope-factor-from-lengths", _llama({**_PHI3_LIKE["rope_scaling"], "original_max_position_embeddings": 8192},
                                            hidden_size=3072, rope_theta=10000.0, max_position_embeddings=65536), 65536),
]


HF_FIXTURE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "hf_rope.npz")


def _hf_live(kind, key):
    """transformers' (inv_freq, attention factor) for a law case or a preset, computed now."""
    if kind == "law":
        cfg, max_pos = {c[0]: (c[1], c[2]) for c in HF_LAWS}[key]
        return _hf_law(cfg, seq_len=max_pos)
    cfg = presets.preset_config(key)
    inv_hf, att_hf = _hf_model_rotary(cfg)  # the model's own rotary embedding module
    inv_law, att_law = _hf_law(cfg, seq_len=None)  # and the registry / default function
    np.testing.assert_array_equal(inv_hf, inv_law)
    assert att_hf == att_law
    return inv_hf, att_hf


def record_hf(path=HF_FIXTURE):
    """Writes transformers' outputs for every law case and preset (tools/record_hf_rope.py)."""
    import torch
    import transformers

    out = {"transformers_version": np.array(transformers.__version__), "torch_version": np.array(torch.__version__)}
    for kind, keys in (("law", [c[0] for c in HF_LAWS]), ("preset", sorted(presets.PRESETS))):
        for key in keys:
            inv, att = _hf_live(kind, key)
            out[f"{kind}:{key}:inv_freq"], out[f"{kind}:{key}:attention"] = inv, np.array(att)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    np.savez_compressed(path, **out)
    return out


def _hf_recorded(kind, key):
    with np.load(HF_FIXTURE) as data:
        return data[f"{kind}:{key}:inv_freq"], float(data[f"{kind}:{key}:attention"])


def _check_hf(kind, key, cfg, max_pos, live):
    inv_hf, att_hf = _hf_live(kind, key) if live else _hf_recorded(kind, key)
    if live:  # the fixture is what transformers computes today
        inv_rec, att_rec = _hf_recorded(kind, key)
        np.testing.assert_array_equal(inv_hf, inv_rec, err_msg=f"{key}: transformers changed; re-record")
        assert att_hf == att_rec
    compare_with_hf(cfg, inv_hf, att_hf, max_pos)


@pytest.mark.parametrize("live", [False, True], ids=["recorded", "live"])
@pytest.mark.parametrize("case_id,cfg,max_pos", HF_LAWS, ids=[c[0] for c in HF_LAWS])
def test_law_matches_transformers(case_id, cfg, max_pos, live):
    _check_hf("law", case_id, cfg, max_pos, live)


@pytest.mark.parametrize("live", [False, True], ids=["recorded", "live"])
@pytest.mark.parametrize("name", sorted(presets.PRESETS))
def test_preset_matches_transformers(name, live):
    cfg = presets.preset_config(name)
    _check_hf("preset", name, cfg, cfg["max_position_embeddings"], live)


def test_fixture_covers_every_law_and_preset():
    with np.load(HF_FIXTURE) as data:
        keys = {k.rsplit(":", 1)[0] for k in data.files if k.endswith(":inv_freq")}
        version = str(data["transformers_version"])
    assert keys == {f"law:{c[0]}" for c in HF_LAWS} | {f"preset:{n}" for n in presets.PRESETS}, keys
    assert version
