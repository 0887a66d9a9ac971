"""The MLA op in a real model: the tiny DeepSeek-V3 of jax_rope_cache/decoder_mla.py (MLA attention
in the absorbed form over the latent cache mla_rope_and_cache writes, YaRN with mscale, DeepSeek-V3's
MoE) generates the same greedy tokens as Hugging Face transformers, with logits within
decoder.HF_LOGIT_BOUND, for prompts of 1, 6, 16 and 21 tokens and 32 decode steps, with
impl="kernel" and impl="xla", combined and split caches.

The reference is the fixture tests/data/hf_greedy_mla.npz (tools/record_hf_model.py); the live
test re-runs transformers when torch and transformers import (only that test skips otherwise).
The sensitivity tests show the comparison sees every MLA-specific rule: tables one position off,
without YaRN, without its attention factor, NeoX pairs instead of GPT-J pairs, or a softmax scale
without mscale_all_dim all move the logits far beyond the bound.
"""

from __future__ import annotations

import dataclasses
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_rope_cache as jrc
from conftest import impl_params
from jax_rope_cache import decoder, decoder_mla
from jax_rope_cache.cli import generate
from jax_rope_cache.models import tables
from test_model import _load_recorder, compare_to_transformers
from test_structure import check_in_place, check_temp_independent_of_pool

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURE = os.path.join(HERE, "data", "hf_greedy_mla.npz")
REF = decoder.load_hf_reference(FIXTURE)
META = REF.pop("meta")
NAME = "tiny-deepseek-v3"
ENTRY = REF[NAME]
BOUND = decoder.HF_LOGIT_BOUND
LAYOUTS = ("combined", "split")
_DECODERS: dict = {}  # compiled decoders shared by the tests of this module


def _decoder(platform, impl, layout="combined"):
    return generate.reference_decoder(ENTRY, impl, layout, device=jax.devices(platform)[0], decoder_cache=_DECODERS)


def _params():
    return decoder.random_params(decoder_mla.MlaDecoderConfig.from_hf(ENTRY["config"]), ENTRY["seed"])


def _compare(toks, logits, want_t=ENTRY["tokens"], want_l=ENTRY["logits"]):
    compare_to_transformers(toks, logits, want_t, want_l)


# ---- the fixture itself -------------------------------------------------------------------------
def test_fixture_is_this_model_and_a_meaningful_reference():
    assert ENTRY["config"] == decoder_mla.TINY_MLA_CONFIGS[NAME], "config changed: regenerate the fixture"
    assert ENTRY["seed"] == decoder_mla.TINY_MLA_SEEDS[NAME]
    assert decoder.params_digest(_params()) == ENTRY["digest"], "weights from the seed changed"
    cfg = decoder_mla.MlaDecoderConfig.from_hf(ENTRY["config"])
    assert 0 < cfg.dense_layers < cfg.num_layers and cfg.top_groups < cfg.groups  # dense and MoE layers, groups
    lengths = [len(p) for p in ENTRY["prompts"]]
    assert len(set(lengths)) >= 3 and 1 in lengths and max(lengths) > 16
    tokens, logits = ENTRY["tokens"], ENTRY["logits"]
    assert tokens.shape == (len(lengths), META["new_tokens"]) and tokens.shape[1] >= 33  # 1 + >= 32 decode steps
    assert logits.shape == tokens.shape + (cfg.vocab_size,) and logits.dtype == np.float32
    np.testing.assert_array_equal(tokens, logits.argmax(-1))
    top2 = np.sort(logits, axis=-1)[..., -2:]
    assert (top2[..., 1] - top2[..., 0]).min() >= 10 * BOUND  # equal greedy tokens are no accident
    assert len(np.unique(tokens)) >= 40 and min(len(set(t)) for t in tokens.tolist()) >= 10
    assert os.path.getsize(FIXTURE) < 400 * 1024


def test_yarn_law_and_mscale_matter_at_these_positions():
    """The YaRN law changes the tables within the positions generated here, and both halves of
    DeepSeek's mscale are live: the tables' factor (mscale / mscale_all_dim) and the softmax's."""
    cfg = ENTRY["config"]
    cos, _, info = jrc.rope_tables_from_hf_config(cfg, max_pos=64)
    assert info.rope_type == "yarn" and not info.is_neox and info.rotary_dim == cfg["qk_rope_head_dim"]
    plain, _ = tables.rope_tables(64, info.rotary_dim, base=cfg["rope_theta"])
    assert np.abs(cos / info.attention_scaling - plain).max() > 0.5
    assert abs(info.attention_scaling - 1) > 0.02
    mcfg = decoder_mla.MlaDecoderConfig.from_hf(cfg)
    assert mcfg.softmax_scale / (mcfg.nope_dim + mcfg.rope_dim) ** -0.5 > 1.2


# ---- the decoder against transformers -----------------------------------------------------------
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("platform,impl", impl_params())
def test_greedy_generation_matches_transformers(platform, impl, layout):
    _compare(*_decoder(platform, impl, layout).generate(ENTRY["prompts"], ENTRY["tokens"].shape[1]))


def test_live_transformers_agrees_with_fixture_and_decoder():
    for module in ("torch", "transformers"):  # absent or broken: only this test skips
        pytest.importorskip(module, exc_type=ImportError)
    rec = _load_recorder()
    routed = []
    toks, logits = rec.hf_greedy(ENTRY["config"], _params(), ENTRY["prompts"], ENTRY["tokens"].shape[1],
                                 router_inputs=routed)
    assert routed and rec.router_margin(routed) >= rec.ROUTER_MARGIN  # no routing decision is a near tie
    np.testing.assert_array_equal(toks, ENTRY["tokens"], err_msg="live transformers vs fixture")
    assert np.abs(logits - ENTRY["logits"]).max() <= BOUND  # another version may sum in another order
    for layout in LAYOUTS:
        _compare(*_decoder(jax.devices()[0].platform, "kernel", layout).generate(
            ENTRY["prompts"], ENTRY["tokens"].shape[1]), toks, logits)


WRONG = ["positions one off", "plain RoPE instead of YaRN", "no YaRN attention factor in the tables",
         "NeoX pairs instead of GPT-J pairs", "softmax scale without mscale_all_dim"]


@pytest.mark.parametrize("what", WRONG)
def test_comparison_catches_wrong_rope_and_scale(what):
    """One MLA rule broken at a time (a fresh decoder: is_neox and the scale are traced in): the
    logits move far beyond the bound and the tokens change."""
    cfg = ENTRY["config"]
    max_len = 56
    cos, sin, info = jrc.rope_tables_from_hf_config(cfg, max_pos=max_len)
    neox = False
    if what == "positions one off":
        cos, sin = np.roll(cos, 1, axis=0), np.roll(sin, 1, axis=0)
    elif what == "plain RoPE instead of YaRN":
        cos, sin = tables.rope_tables(max_len, info.rotary_dim, base=cfg["rope_theta"])
    elif what == "no YaRN attention factor in the tables":
        cos, sin = cos / info.attention_scaling, sin / info.attention_scaling
    elif what.startswith("NeoX"):
        neox = True
    m = decoder_mla.MlaDecoder(cfg, _params(), block_size=8, max_seqs=4, max_len=max_len, impl="xla",
                               tables=(cos, sin, info.rotary_dim, neox))
    if what.startswith("softmax"):
        m.cfg = dataclasses.replace(m.cfg, softmax_scale=(m.cfg.nope_dim + m.cfg.rope_dim) ** -0.5)
    toks, logits = m.generate(ENTRY["prompts"], ENTRY["tokens"].shape[1])
    assert np.abs(logits - ENTRY["logits"]).max() > 100 * BOUND
    assert (toks != ENTRY["tokens"]).any()


# ---- the latent cache ---------------------------------------------------------------------------
@pytest.mark.parametrize("layout", LAYOUTS)
def test_latent_gather_agrees_with_read_mla_cache(layout):
    """The decoder's own block gather (written from the layouts' definitions) and the library's
    read_mla_cache see the same rows for every slot, on a stacked cache at a traced layer."""
    L, NB, BS, DC, DR = 3, 7, 8, 24, 8
    caches = jrc.make_mla_cache(NB, BS, DC, DR, jnp.float32, layout=layout, num_layers=L, fill="random", seed=4)
    caches = (caches,) if layout == "combined" else tuple(caches)
    bt = np.array([[5, 2, -1], [0, 6, 3]], np.int32)  # -1: padding, read as block 0 (masked by attention)
    rows = jax.jit(decoder_mla.gather_latent, static_argnames="layout")(caches, jnp.int32(1), bt, layout=layout)
    assert rows.shape == (2, 3 * BS, DC + DR)
    slots = (np.maximum(bt, 0)[:, :, None] * BS + np.arange(BS)).reshape(-1)
    layer = caches[0][1] if layout == "combined" else tuple(c[1] for c in caches)
    lat, rope = jrc.read_mla_cache(layer, slots, layout=layout, latent_dim=DC)
    np.testing.assert_array_equal(np.asarray(rows).reshape(-1, DC + DR), np.concatenate([lat, rope], -1))
    other = jax.jit(decoder_mla.gather_latent, static_argnames="layout")(caches, jnp.int32(0), bt, layout=layout)
    assert not np.array_equal(np.asarray(rows), np.asarray(other))  # layer 1, not 0


SENTINEL = 12345.0  # no latent value of the model comes near it


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("platform,impl", impl_params())
def test_generation_writes_only_its_own_slots(platform, impl, layout):
    """Prefill (padded: padding slots -1) + decode write exactly the latent rows of positions
    [0, len + new - 1) of every sequence, in every layer, whole, and no other slot."""
    m = _decoder(platform, impl, layout)
    prompts, new = ENTRY["prompts"], 9
    m.caches = tuple(jnp.full_like(c, SENTINEL) for c in m.caches)
    seqs = [m.allocator.allocate(len(p) + new) for p in prompts]
    try:
        bt = m.allocator.block_table(seqs, m.blocks_per_seq)
        first, _, lens = m.prefill(prompts, bt)
        toks, _ = m.decode(first, lens, bt, new - 1)
        after = [np.asarray(c) for c in m.caches]
    finally:
        for s in seqs:
            m.allocator.free(s)
    np.testing.assert_array_equal(np.concatenate([np.asarray(first)[:, None], np.asarray(toks).T], 1),
                                  ENTRY["tokens"][:, :new])
    bs = m.block_size
    written = np.zeros(m.allocator.num_blocks * bs, bool)
    for p, blocks in zip(prompts, seqs):
        written[[blocks[t // bs] * bs + t % bs for t in range(len(p) + new - 1)]] = True
    assert written.sum() < written.size / 2
    for cache in after:  # [L, NB, BS, width]
        rows = cache.reshape(cache.shape[0], written.size, -1)
        assert (rows[:, written] != SENTINEL).all(), "a slot of a sequence was not written (whole)"
        assert (rows[:, ~written] == SENTINEL).all(), "a slot no sequence owns was written"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_compiled_steps_donate_caches_and_call_the_op_once_per_layer_run(layout):
    """Prefill and decode alias the stacked latent cache(s) to their outputs, copy no cache-shaped
    buffer, need no temporary that grows with the pool (a cache copy would), and (CPU kernel) hold
    one MLA custom call per layer scan (the dense run, the MoE run)."""
    m = decoder_mla.MlaDecoder(ENTRY["config"], _params(), layout=layout, block_size=8, max_seqs=256, max_len=56,
                               impl="kernel")
    n_params = len(jax.tree.leaves(m.params)) + 2  # params, then the two tables, then the caches
    bt = np.zeros((4, m.blocks_per_seq), np.int32)
    shapes = [c.shape for c in m.caches]
    for fn, rest, kw in ((m.prefill_fn, (np.zeros((4, 21), np.int32), np.full(4, 21, np.int32), bt), {}),
                         (m.decode_fn, (np.zeros(4, np.int32), np.full(4, 21, np.int32), bt), dict(steps=3))):
        lower = lambda caches, fn=fn, rest=rest, kw=kw: fn.lower(m.params, m.tables, caches, *rest, **kw)  # noqa: E731
        compiled = lower(m.caches).compile()
        if layout == "split":
            text = check_in_place(compiled, shapes, None, n_params_before_caches=n_params)
        else:  # one cache: aliased, never copied
            text = compiled.as_text()
            aliases = {int(p) for _, p in re.findall(r"\{(\d*)\}: \((\d+), \{\}, (?:may|must)-alias\)", text)}
            assert n_params in aliases, aliases
            dims = ",".join(map(str, shapes[0]))
            assert not [ln for ln in text.splitlines() if re.search(r"\bcopy(-start)?\(", ln) and dims in ln]
        check_temp_independent_of_pool(compiled, lower, m.caches)
        if m.device.platform == "cpu":
            calls = re.findall(r'custom_call_target="(jax_rope_cache[a-z_]*)"', text)
            assert len(calls) == 2 and all("mla" in c for c in calls), calls


def test_config_errors():
    base = decoder_mla.TINY_MLA_CONFIGS[NAME]
    for key, value, match in (("model_type", "llama", "model_type"), ("attention_bias", True, "attention_bias"),
                              ("q_lora_rank", None, "q_lora_rank"), ("num_key_value_heads", 2, "num_key_value_heads"),
                              ("n_group", 3, "n_group"), ("num_experts_per_tok", 5, "num_experts_per_tok"),
                              ("kv_lora_rank", 0, "kv_lora_rank"), ("first_k_dense_replace", -1, "first_k_dense")):
        with pytest.raises(ValueError, match=match):
            decoder_mla.MlaDecoderConfig.from_hf({**base, key: value})
    dense = decoder_mla.MlaDecoderConfig.from_hf({**base, "first_k_dense_replace": 3})
    assert dense.dense_layers == 3 and "moe_layers" not in dense.param_shapes()
    with pytest.raises(ValueError, match="layout"):
        decoder_mla.MlaDecoder(base, _params(), layout="flash")


def test_generate_command_checks_and_times_the_mla_model(capsys):
    """`generate`: the check runs the MLA fixture in its own layouts only (not the GQA ones), and
    --model tiny-deepseek-v3 times the model (bfloat16, with its timing baseline) on a split latent cache."""
    assert generate.check(FIXTURE, ["xla"], ["flash", "split"], show_tokens=False)
    out = capsys.readouterr().out
    assert re.search(r"tiny-deepseek-v3\s+impl=xla\s+split .* tokens match, .* OK", out) and "flash" not in out, out
    with pytest.raises(SystemExit) as e:
        generate.main(["--model", NAME, "--check", "none", "--impls", "baseline,kernel", "--layout", "split",
                       "--batch", "2", "--prompt-len", "5", "--steps", "2", "--repeats", "1", "--block-size", "8",
                       "--dtype", "bfloat16"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "MLA heads 4, latent 64 + 16" in out and "split cache" in out and "bfloat16" in out
    for impl in ("baseline", "kernel"):
        assert re.search(rf"^{impl}\s+[\d.]+ms\s+\d+us\s+[\d,]+$", out, re.M), out
    with pytest.raises(SystemExit):
        generate.main(["--model", NAME, "--check", "none", "--layout", "flash"])
    assert "tiny-deepseek-v3 caches in one of ('combined', 'split')" in capsys.readouterr().err
