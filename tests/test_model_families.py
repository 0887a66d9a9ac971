"""The tiny Gemma 3, Llama 4 Scout-like and Maverick-like (text) decoders (jax_rope_cache/decoder_families.py) generate
transformers' greedy tokens: prompts of 1, 6, 16 and 21 tokens, 1 + 32 tokens each, logits within
decoder.HF_LOGIT_BOUND, with impl="kernel" (the op's impl=None: the XLA path for the family options
the kernels refuse) and impl="xla". Fixture tests/data/hf_greedy_families.npz, recorded by
tools/record_hf_families.py (transformers' Gemma3ForCausalLM / Llama4ForCausalLM, float32, eager).

The models exercise every family option in one lax.scan per step: Gemma's (1 + w) q/k norms, its
local tables on the sliding layers (window 8) and scaled global tables on every third layer;
Llama 4's NoPE layers (every second) with the attention temperature, its GPT-J rotation and
weightless norm after it on the RoPE layers (chunks of 8), use_rope traced per layer; Maverick's
dense layers between its MoE ones (the layers transformers picked, recorded in the fixture), no q/k
norm, NoPE every third layer, in one scan over groups of two layers. Each of these made wrong on
purpose changes the tokens.
"""

from __future__ import annotations

import os
import warnings

import numpy as np
import pytest

import jax_rope_cache as jrc
from jax_rope_cache import decoder, decoder_families as fam

FIXTURE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "hf_greedy_families.npz")


@pytest.fixture(scope="module")
def reference():
    ref = decoder.load_hf_reference(FIXTURE)
    ref.pop("meta")
    return ref


def _decoder(entry, impl, layout="flash", **kw):
    cfg = fam.FamilyDecoderConfig.from_hf(entry["config"])
    params = decoder.random_params(cfg, entry["seed"])
    assert decoder.params_digest(params) == entry["digest"], "the initialiser changed: re-record the fixture"
    return fam.FamilyDecoder(entry["config"], params, impl=impl, layout=layout, block_size=8,
                             max_seqs=4 * len(entry["prompts"]), max_len=56, **kw)


def _generate(m, entry):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # impl=None's one fallback warning per option set
        return m.generate(entry["prompts"], entry["tokens"].shape[1])


def test_fixture_holds_every_model(reference):
    assert set(reference) == set(fam.TINY_FAMILY_CONFIGS)
    for name, entry in reference.items():
        assert entry["config"] == fam.TINY_FAMILY_CONFIGS[name] and entry["seed"] == fam.TINY_FAMILY_SEEDS[name]
        assert entry["tokens"].shape == (4, 33)


@pytest.mark.parametrize("impl,layout", [("kernel", "flash"), ("xla", "flash"), ("xla", "xpacked_shuffled")])
@pytest.mark.parametrize("name", sorted(fam.TINY_FAMILY_CONFIGS))
def test_greedy_tokens_equal_transformers(reference, name, impl, layout):
    entry = reference[name]
    toks, logits = _generate(_decoder(entry, impl, layout), entry)
    assert np.array_equal(toks, entry["tokens"]), (name, impl, layout, (toks == entry["tokens"]).mean())
    err = float(np.abs(logits - entry["logits"]).max())
    assert err <= decoder.HF_LOGIT_BOUND, (name, impl, layout, err)


def test_the_layers_differ_as_the_models_do():
    g = fam.FamilyDecoderConfig.from_hf(fam.TINY_FAMILY_CONFIGS["tiny-gemma-3"])
    assert [lp.table for lp in g.layers_plan] == ["local", "local", "global"] * 2
    assert {lp.window for lp in g.layers_plan if lp.table == "local"} == {8}
    m = fam.FamilyDecoderConfig.from_hf(fam.TINY_FAMILY_CONFIGS["tiny-llama-4"])
    assert [lp.rope for lp in m.layers_plan] == [True, False, True, False]
    assert dict(m.family) == dict(norm_type="weightless", norm_position="after", attn_temperature=(4, 0.5))
    assert (m.moe_step, fam.moe_layers(fam.TINY_FAMILY_CONFIGS["tiny-llama-4"])) == (1, (0, 1, 2, 3))
    v = fam.FamilyDecoderConfig.from_hf(fam.TINY_FAMILY_CONFIGS["tiny-llama-4-maverick"])
    assert [lp.rope for lp in v.layers_plan] == [True, True, False] * 2
    assert dict(v.family) == dict(attn_temperature=(4, 0.5))  # use_qk_norm False: no q/k norm
    assert v.moe_step == 2 and v.intermediate_size_mlp == 160


def test_the_moe_layers_are_those_transformers_built():
    """fam.moe_layers against the layers transformers' Llama4ForCausalLM gave the MoE block when the
    fixture was recorded (`<name>/moe_layers`), and transformers' rule on other configs."""
    with np.load(FIXTURE) as f:
        built = {k.split("/")[0]: f[k].tolist() for k in f.files if k.endswith("/moe_layers")}
    assert "tiny-llama-4-maverick" in built
    for name, layers in built.items():
        assert list(fam.moe_layers(fam.TINY_FAMILY_CONFIGS[name])) == layers, name
    assert built["tiny-llama-4-maverick"] == [1, 3, 5]
    base = dict(fam.TINY_FAMILY_CONFIGS["tiny-llama-4-maverick"], num_hidden_layers=12)
    assert fam.moe_layers(dict(base, interleave_moe_layer_step=1)) == tuple(range(12))
    assert fam.moe_layers(dict(base, interleave_moe_layer_step=4)) == (3, 7, 11)
    assert fam.moe_layers(dict(base, moe_layers=[5, 2, 8, 11])) == (2, 5, 8, 11)  # moe_layers wins over the step
    assert fam.FamilyDecoderConfig.from_hf(dict(base, moe_layers=[2, 5, 8, 11])).moe_step == 3
    assert fam.FamilyDecoderConfig.from_hf(dict(base, interleave_moe_layer_step=4)).moe_step == 4


def _changed(entry, m):
    toks, logits = _generate(m, entry)
    return float((toks != entry["tokens"]).mean()), float(np.abs(logits - entry["logits"]).max())


def test_wrong_gemma_tables_or_norm_change_the_tokens(reference, monkeypatch):
    entry = reference["tiny-gemma-3"]
    config = entry["config"]
    cos, sin, info = jrc.rope_tables_from_hf_config(config, max_pos=56)
    only_global = _decoder(entry, "xla", tables=(cos, sin, info.rotary_dim, info.is_neox))  # no local tables
    frac, err = _changed(entry, only_global)
    assert frac > 0.1 and err > 100 * decoder.HF_LOGIT_BOUND, (frac, err)
    monkeypatch.setattr(fam, "gemma_norm", lambda x, w, eps: decoder.rms_norm(x, w, eps))  # w, not 1 + w
    frac, err = _changed(entry, _decoder(entry, "xla"))
    assert frac > 0.1, (frac, err)


def test_wrong_llama4_temperature_or_pairs_change_the_tokens(reference):
    entry = reference["tiny-llama-4"]
    m = _decoder(entry, "xla")
    m.family = {k: v for k, v in m.family.items() if k != "attn_temperature"}
    frac, err = _changed(entry, _rebuilt(m))
    assert err > 100 * decoder.HF_LOGIT_BOUND, err
    cos, sin, info = jrc.rope_tables_from_hf_config(entry["config"], max_pos=56)
    frac, err = _changed(entry, _decoder(entry, "xla", tables=(cos, sin, info.rotary_dim, True)))  # NeoX pairs
    assert frac > 0.1 and err > 100 * decoder.HF_LOGIT_BOUND, (frac, err)


def test_maverick_dense_layers_matter(reference, monkeypatch):
    entry = reference["tiny-llama-4-maverick"]
    monkeypatch.setattr(fam.FamilyDecoder, "_dense_mlp", lambda self, w, h: 0.0 * h)  # dense layers skipped
    frac, err = _changed(entry, _decoder(entry, "xla"))
    assert frac > 0.1 and err > 100 * decoder.HF_LOGIT_BOUND, (frac, err)
    monkeypatch.undo()
    m = _decoder(entry, "xla")  # the dense layers' weights in reverse order: each layer must get its own
    m.params["layers"] = {n: a[::-1] if n.startswith("dense_") else a for n, a in m.params["layers"].items()}
    frac, err = _changed(entry, m)
    assert frac > 0.1 and err > 100 * decoder.HF_LOGIT_BOUND, (frac, err)


def test_maverick_unrolled_groups_equal_the_scan(reference):
    """unroll covering every group (generate's timing default): a Python loop with constant layer
    indices, the same tokens and logits as the scan."""
    entry = reference["tiny-llama-4-maverick"]
    toks, logits = _generate(_decoder(entry, "xla", unroll=True), entry)
    assert np.array_equal(toks, entry["tokens"])
    assert float(np.abs(logits - entry["logits"]).max()) <= decoder.HF_LOGIT_BOUND


def _rebuilt(m):
    """The decoder's jitted steps traced afresh (they read m.family when traced)."""
    import jax

    m.prefill_fn = jax.jit(m._prefill, donate_argnums=(2,))
    m.decode_fn = jax.jit(m._decode, static_argnames=("steps", "with_logits"), donate_argnums=(2,))
    return m


def test_one_program_per_step_with_the_switch_traced(reference):
    """The layers run in one lax.scan: the decode step's program holds one layer loop, whatever the
    mix of RoPE / NoPE (Llama 4) or local / global (Gemma 3) layers."""
    for name in sorted(reference):
        m = _decoder(reference[name], "xla")
        bt = m.allocator.block_table([m.allocator.allocate(8)], m.blocks_per_seq)
        text = m.decode_fn.lower(m.params, m.tables, m.caches, np.zeros(1, np.int32), np.ones(1, np.int32), bt,
                                 steps=2).as_text()
        assert text.count("stablehlo.while") == 2, name  # the decode steps' scan and the layers' scan
        assert "stablehlo.case" not in text and "stablehlo.if" not in text, name  # no per-layer branch


def test_bad_configs_name_the_key():
    for bad in (dict(interleave_moe_layer_step=3), dict(interleave_moe_layer_step=0),
                dict(interleave_moe_layer_step=5)):  # 3 and 5 do not divide the 4 layers
        with pytest.raises(ValueError, match=r"config\['interleave_moe_layer_step'\]"):
            fam.FamilyDecoderConfig.from_hf(dict(fam.TINY_FAMILY_CONFIGS["tiny-llama-4"], **bad))
    for bad in ([0, 3], [1, 2, 3], [4], "1,3"):  # not the last layer of equal groups, or not layer indices
        with pytest.raises(ValueError, match=r"config\['moe_layers'\]"):
            fam.FamilyDecoderConfig.from_hf(dict(fam.TINY_FAMILY_CONFIGS["tiny-llama-4"], moe_layers=bad))
    cfg = dict(fam.TINY_FAMILY_CONFIGS["tiny-gemma-3"], hidden_activation="gelu")
    with pytest.raises(ValueError, match=r"config\['hidden_activation'\]"):
        fam.FamilyDecoderConfig.from_hf(cfg)
    entry = fam.TINY_FAMILY_CONFIGS["tiny-gemma-3"]
    with pytest.raises(ValueError, match="impl: expected 'kernel' or 'xla' for the family decoders"):
        fam.FamilyDecoder(entry, {}, impl="baseline")
