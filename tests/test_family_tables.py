"""RoPE tables, layer plans and op options of the model-family presets (models/presets.FAMILY_PRESETS):
Llama 4 Scout / Maverick, Gemma 3 4B / 27B (local and global tables), Qwen3-Next-80B-A3B and GLM-4.5
(partial rotary), SmolLM3-3B (NoPE layers).

Against transformers' own modules, recorded in tests/data/hf_family_rope.npz by
tools/record_hf_family.py (and live when transformers imports): the inverse frequencies and attention
factors of each layer type, which layers rotate (the attention modules' use_rope) and each layer's
attention kind (the config's layer_types after transformers' defaults).
"""

from __future__ import annotations

import importlib.util
import math
import os

import numpy as np
import pytest

import jax_rope_cache as jrc
from jax_rope_cache.models import config as hfconfig
from jax_rope_cache.models import presets, tables

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
FIXTURE = os.path.join(ROOT, "tests", "data", "hf_family_rope.npz")
NAMES = sorted(presets.FAMILY_PRESETS)
INV_ULPS = 4  # transformers computes inv_freq in float32: a few roundings


def _recorded():
    with np.load(FIXTURE) as d:
        return {k: d[k] for k in d.files}


def _live():
    if importlib.util.find_spec("transformers") is None or importlib.util.find_spec("torch") is None:
        pytest.skip("transformers / torch not installed: the recorded fixture is checked instead")
    spec = importlib.util.spec_from_file_location("record_hf_family", os.path.join(ROOT, "tools", "record_hf_family.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = {}
    for name in NAMES:
        out.update(mod.record(name))
    return out


def _layer_types(name):
    cfg = presets.preset_config(name)
    return ("full_attention", "sliding_attention") if cfg["model_type"] == "gemma3_text" else ("full_attention",)


@pytest.mark.parametrize("source", ["recorded", "live"])
@pytest.mark.parametrize("name", NAMES)
def test_frequencies_and_layers_match_transformers(name, source):
    data = _recorded() if source == "recorded" else _live()
    if source == "live":
        rec = _recorded()
        for k, v in data.items():
            if k.startswith(name + ":"):
                np.testing.assert_array_equal(v, rec[k], err_msg=f"{k}: transformers changed; re-record")
    cfg = presets.preset_config(name)
    for lt in _layer_types(name):
        inv_hf, att_hf = data[f"{name}:{lt}:inv_freq"], float(data[f"{name}:{lt}:attention"])
        cos, sin, info = jrc.rope_tables_from_hf_config(cfg, max_pos=4096, layer_type=lt)
        inv, att = tables.rope_frequencies(info.rotary_dim, base=info.base, scaling=info.scaling, max_pos=4096)
        assert inv.shape == inv_hf.shape and info.rotary_dim == 2 * inv.size
        r = info.rotary_dim
        e = np.arange(0, r, 2) / r
        e32 = (np.arange(0, r, 2, dtype=np.float32) / np.float32(r)).astype(np.float64)
        ulp = np.spacing(inv_hf.astype(np.float32)).astype(np.float64)
        allowed = INV_ULPS * ulp + inv_hf * np.abs(e - e32) * (math.log(info.base) + 4.0)
        assert (np.abs(inv - inv_hf) <= allowed).all(), (name, lt, float((np.abs(inv - inv_hf) / ulp).max()))
        assert att == att_hf == info.attention_scaling
        # the table rows are cos / sin of p * inv_freq (half form), up to float32 rounding and p * dinv
        p = np.array([0, 1, 7, 1000, 4095], np.float64)[:, None]
        bound = 2e-7 + p * np.abs(inv - inv_hf)[None, :] * att
        assert (np.abs(cos[p[:, 0].astype(int)] - np.cos(p * inv_hf) * att_hf) <= bound).all(), (name, lt)
        assert (np.abs(sin[p[:, 0].astype(int)] - np.sin(p * inv_hf) * att_hf) <= bound).all(), (name, lt)
    plan = presets.preset_layers(name)
    rope_hf = data[f"{name}:rope_layers"].tolist()
    types_hf = [str(t) for t in data[f"{name}:layer_types"]]
    kind = {"full_attention": "full", "sliding_attention": "sliding", "chunked_attention": "chunked",
            "linear_attention": "linear"}
    assert [int(lp.rope) for lp in plan if lp.attention != "linear"] == [
        r for r, t in zip(rope_hf, types_hf) if t != "linear_attention"]
    assert [lp.attention for lp in plan] == [kind[t] for t in types_hf]
    assert all((lp.table == "local") == (lp.attention == "sliding") for lp in plan)


def test_gemma3_local_and_global_tables():
    """Gemma 3: the sliding layers rotate with base 10000 and no scaling, the global layers with base 1e6
    and the linear factor 8; rope_tables_from_hf_config returns the global tables with the local ones
    in info.local, the older config form (rope_local_base_freq) and the newer per-type rope_parameters
    give the same tables."""
    cfg = presets.preset_config("gemma-3-4b")
    cos, sin, info = jrc.rope_tables_from_hf_config(cfg, max_pos=256)
    lcos, lsin, linfo = info.local
    assert (info.layer_type, info.base, info.scaling) == ("full_attention", 1e6, {"rope_type": "linear", "factor": 8.0})
    assert (linfo.layer_type, linfo.base, linfo.scaling) == ("sliding_attention", 1e4, None)
    want_g = jrc.rope_tables(256, 256, base=1e6, scaling={"rope_type": "linear", "factor": 8.0})
    want_l = jrc.rope_tables(256, 256, base=1e4)
    assert all(np.array_equal(a, b) for a, b in zip((cos, sin, lcos, lsin), want_g + want_l))
    assert not np.array_equal(cos, lcos)
    assert info.family == {"norm_type": "gemma"}
    assert [lp.table for lp in info.layers[:6]] == ["local"] * 5 + ["global"]
    new = {k: v for k, v in cfg.items() if k not in ("rope_theta", "rope_local_base_freq", "rope_scaling")}
    new["rope_parameters"] = {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                              "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}
    c2, s2, i2 = jrc.rope_tables_from_hf_config(new, max_pos=256)
    assert np.array_equal(c2, cos) and np.array_equal(i2.local[0], lcos)
    with pytest.raises(ValueError, match="layer_type: expected None or one of"):
        jrc.rope_tables_from_hf_config(cfg, max_pos=8, layer_type="chunked_attention")
    del new["rope_parameters"]["sliding_attention"]
    with pytest.raises(ValueError, match=r"config\['rope_parameters'\]: expected RoPE parameters for layer type"):
        jrc.rope_tables_from_hf_config(new, max_pos=8)


def test_partial_rotary_and_the_family_options():
    """Qwen3-Next (head 256, factor 0.25 -> 64 rotary channels) and GLM-4.5 (128, 0.5 -> 64) read their
    partial factors; Llama 4 rotates GPT-J pairs; each family's op options."""
    want = {"qwen3-next-80b-a3b": (256, 64, True), "glm-4.5": (128, 64, True), "llama-4-scout": (128, 128, False),
            "smollm3-3b": (128, 128, True), "gemma-3-27b": (128, 128, True)}
    for name, (d, r, neox) in want.items():
        _, _, info = presets.preset_tables(name, max_pos=16, tp=2)
        assert (info.head_dim, info.rotary_dim, info.is_neox) == (d, r, neox), name
    assert presets.preset_family_options("qwen3-next-80b-a3b") == dict(norm_type="gemma", q_gate=True)
    assert presets.preset_family_options("llama-4-scout") == dict(
        norm_type="weightless", norm_position="after", attn_temperature=(8192, 0.1))
    assert presets.preset_family_options("llama-4-maverick") == dict(attn_temperature=(8192, 0.1))  # no qk_norm
    assert presets.preset_family_options("glm-4.5") == presets.preset_family_options("smollm3-3b") == {}
    plan = presets.preset_layers("llama-4-scout")
    assert [lp.rope for lp in plan[:8]] == [True, True, True, False] * 2
    assert {lp.window for lp in plan if lp.rope} == {8192} and {lp.attention for lp in plan if not lp.rope} == {"full"}
    assert sum(lp.attention == "full" for lp in presets.preset_layers("qwen3-next-80b-a3b")) == 12


def test_llama3_law_with_equal_band_factors():
    """Llama 4 Scout's llama3 law has low_freq_factor == high_freq_factor (1, 1): no smoothed band,
    every wavelength above 8192 divided by 16 (transformers warns and computes the same)."""
    inv, _ = tables.rope_frequencies(128, base=500000.0, scaling={
        "rope_type": "llama3", "factor": 16.0, "low_freq_factor": 1.0, "high_freq_factor": 1.0,
        "original_max_position_embeddings": 8192})
    plain = 500000.0 ** -(np.arange(0, 128, 2) / 128)
    long = 2 * np.pi / plain > 8192
    np.testing.assert_allclose(inv, np.where(long, plain / 16, plain), rtol=1e-15)
    with pytest.raises(ValueError, match=r"scaling\['high_freq_factor'\]: must not be below"):
        tables.rope_frequencies(8, base=1e4, scaling={"rope_type": "llama3", "factor": 2.0, "low_freq_factor": 2.0,
                                                      "high_freq_factor": 1.0, "original_max_position_embeddings": 8})


def test_layer_plan_checks_the_per_layer_lists():
    cfg = dict(presets.preset_config("smollm3-3b"), no_rope_layers=[1, 0])
    with pytest.raises(ValueError, match=r"config\['no_rope_layers'\]: expected 36 entries of 0 or 1"):
        hfconfig.layer_plan(cfg)
    cfg = dict(presets.preset_config("gemma-3-4b"), layer_types=["full_attention"])
    with pytest.raises(ValueError, match=r"config\['layer_types'\]: expected 34 layer types"):
        hfconfig.layer_plan(cfg)


def test_an_empty_no_rope_layers_list_is_llama_4s_default():
    """Llama 4's released configs carry "no_rope_layers": []: every fourth layer NoPE, as without the key."""
    cfg = presets.preset_config("llama-4-scout")
    plain = [p.rope for p in hfconfig.layer_plan(cfg)]
    assert plain == [(i + 1) % 4 != 0 for i in range(48)]
    assert [p.rope for p in hfconfig.layer_plan(dict(cfg, no_rope_layers=[]))] == plain
    with pytest.raises(ValueError, match=r"config\['no_rope_layers'\]: expected 36 entries"):
        hfconfig.layer_plan(dict(presets.preset_config("smollm3-3b"), no_rope_layers=[]))
