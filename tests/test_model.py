"""A real model on the op: the decoder of jax_rope_cache/decoder.py generates, on
the paged caches the op writes, the same greedy tokens as Hugging Face transformers, with logits
within decoder.HF_LOGIT_BOUND, for prompts of 1, 6, 16 and 21 tokens and 32 decode steps, with
impl="kernel" and impl="xla", flash, x-packed, head_major and kv_merged caches, each decode
attention (the jnp gather, JAX's Pallas GPU kernel; the Pallas TPU kernel, which reads K and V as
bfloat16, to that precision and exactly against the gather on bfloat16 K and V), a tiny Llama-3.1
(llama3 RoPE scaling) and a tiny Qwen3 (q/k RMSNorm before RoPE, tied embeddings).

The reference is the fixture tests/data/hf_greedy.npz (tools/record_hf_model.py); the live
test re-runs transformers when torch and transformers import (only that test skips otherwise).
The sensitivity tests show the comparison has teeth: tables one position off, or without the
llama3 law, move the logits far beyond the bound.
"""

from __future__ import annotations

import importlib.util
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_rope_cache as jrc
from conftest import impl_params, platforms
from jax_rope_cache import attention as attn
from jax_rope_cache import contract, decoder
from jax_rope_cache.cli import generate
from jax_rope_cache.models import tables
from test_structure import check_in_place, check_temp_independent_of_pool

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURE = os.path.join(HERE, "data", "hf_greedy.npz")
REF = decoder.load_hf_reference(FIXTURE)
META = REF.pop("meta")
LLAMA, QWEN = "tiny-llama-3.1", "tiny-qwen3"
BOUND = decoder.HF_LOGIT_BOUND
_DECODERS: dict = {}  # compiled decoders shared by the tests of this module


def _decoder(name, platform, impl, layout="flash", attention="gather"):
    return generate.reference_decoder(REF[name], impl, layout, device=jax.devices(platform)[0],
                                      decoder_cache=_DECODERS, attention=attention)


def _generate(name, platform, impl, layout="flash", attention="gather"):
    m = _decoder(name, platform, impl, layout, attention)
    return m.generate(REF[name]["prompts"], REF[name]["tokens"].shape[1])


# ---- the fixture itself -------------------------------------------------------------------------
@pytest.mark.parametrize("name", [LLAMA, QWEN])
def test_fixture_is_this_model_and_a_meaningful_reference(name):
    entry = REF[name]
    assert entry["config"] == decoder.TINY_CONFIGS[name], "config changed: regenerate the fixture"
    assert entry["seed"] == decoder.TINY_SEEDS[name]
    params = decoder.random_params(decoder.DecoderConfig.from_hf(entry["config"]), entry["seed"])
    assert decoder.params_digest(params) == entry["digest"], "weights from the seed changed"
    lengths = [len(p) for p in entry["prompts"]]
    assert len(set(lengths)) >= 3 and 1 in lengths and max(lengths) > 16  # several lengths, across blocks
    tokens, logits = entry["tokens"], entry["logits"]
    assert tokens.shape == (len(lengths), META["new_tokens"]) and tokens.shape[1] >= 33  # 1 + >= 32 decode steps
    assert logits.shape == tokens.shape + (entry["config"]["vocab_size"],) and logits.dtype == np.float32
    np.testing.assert_array_equal(tokens, logits.argmax(-1))
    top2 = np.sort(logits, axis=-1)[..., -2:]
    assert (top2[..., 1] - top2[..., 0]).min() >= 10 * BOUND  # equal greedy tokens are no accident
    assert len(np.unique(tokens)) >= 40  # not a model that repeats one token
    assert os.path.getsize(FIXTURE) < 400 * 1024


def test_llama3_law_matters_at_these_positions():
    """The tiny Llama's llama3 scaling changes the tables within the positions generated here
    (else the check could not tell the law from plain RoPE)."""
    cfg = REF[LLAMA]["config"]
    cos, _, info = jrc.rope_tables_from_hf_config(cfg, max_pos=64)
    plain, _ = tables.rope_tables(64, info.rotary_dim, base=cfg["rope_theta"])
    assert info.rope_type == "llama3"
    assert np.abs(cos - plain).max() > 0.5


# ---- the decoder against transformers -----------------------------------------------------------
CASES = [(LLAMA, "flash", "kernel xla", "gather"), (LLAMA, "xpacked", "kernel", "gather"),
         (QWEN, "flash", "kernel", "gather"), (QWEN, "xpacked_shuffled", "xla", "gather"),
         (LLAMA, "kv_merged", "xla", "gather"), (QWEN, "head_major", "kernel", "gather"),
         (LLAMA, "head_major", "kernel", "pallas_gpu"), (QWEN, "head_major", "xla", "pallas_gpu")]


def _matrix():
    """CASES on CPU (kept small for CI: every model, impl, layout and attention at least once; the
    GPU kernel interpreted); every case with both implementations on a GPU (pallas_gpu natively)."""
    out = []
    for p in impl_params():
        platform, impl = p.values
        for name, layout, impls, attention in CASES:
            if (impl in impls.split() or platform != "cpu") and not (attention == "pallas_gpu" and platform == "rocm"):
                out.append(pytest.param(platform, impl, name, layout, attention,
                                        id=f"{p.id}-{name}-{layout}-{attention}"))
    return out


def compare_to_transformers(toks, logits, want_t, want_l):
    """Greedy tokens equal to transformers' and logits within BOUND (test_model_mla uses it too)."""
    bad = np.argwhere(toks != want_t)
    assert not len(bad), f"first differing token at (prompt, step) {tuple(bad[0])}: {toks[tuple(bad[0])]} vs " \
                         f"transformers' {want_t[tuple(bad[0])]}"
    err = np.abs(logits - want_l).max()
    assert err <= BOUND, f"max |logit - transformers| = {err:.2e} > {BOUND}"


@pytest.mark.parametrize("platform,impl,name,layout,attention", _matrix())
def test_greedy_generation_matches_transformers(platform, impl, name, layout, attention):
    m = _decoder(name, platform, impl, layout, attention)
    assert (m.attention, m.layout, m.per_layer) == (attention, layout, attention != "gather")
    compare_to_transformers(*m.generate(REF[name]["prompts"], REF[name]["tokens"].shape[1]),
                            REF[name]["tokens"], REF[name]["logits"])


def _load_recorder():
    spec = importlib.util.spec_from_file_location("record_hf_model", os.path.join(HERE, "..", "tools",
                                                                                  "record_hf_model.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_live_transformers_agrees_with_fixture_and_decoder():
    for module in ("torch", "transformers"):  # absent or broken: only this test skips
        pytest.importorskip(module, exc_type=ImportError)
    rec = _load_recorder()
    platform = jax.devices()[0].platform
    for name in (LLAMA, QWEN):
        entry = REF[name]
        params = decoder.random_params(decoder.DecoderConfig.from_hf(entry["config"]), entry["seed"])
        toks, logits = rec.hf_greedy(entry["config"], params, entry["prompts"], entry["tokens"].shape[1])
        np.testing.assert_array_equal(toks, entry["tokens"], err_msg=f"{name}: live transformers vs fixture")
        # another torch/transformers version may sum in another order: the same bound, not bits
        assert np.abs(logits - entry["logits"]).max() <= BOUND, name
        ours_t, ours_l = _generate(name, platform, "kernel")
        np.testing.assert_array_equal(ours_t, toks, err_msg=f"{name}: decoder vs live transformers")
        assert np.abs(ours_l - logits).max() <= BOUND, name


@pytest.mark.parametrize("what", ["positions one off", "plain RoPE instead of llama3"])
def test_comparison_catches_wrong_tables(what):
    """Same compiled decoder, wrong tables (they are arguments): the logits move far beyond the
    bound, so a position or scaling-law bug cannot pass the comparison."""
    m = _decoder(LLAMA, jax.devices()[0].platform, "xla")
    good = m.tables
    cos, sin = (np.asarray(t) for t in good)
    if what == "positions one off":
        bad = (np.roll(cos, 1, axis=0), np.roll(sin, 1, axis=0))
    else:
        bad = tables.rope_tables(cos.shape[0], m.rotary_dim, base=REF[LLAMA]["config"]["rope_theta"])
    try:
        m.tables = tuple(jnp.asarray(t) for t in bad)
        toks, logits = m.generate(REF[LLAMA]["prompts"], REF[LLAMA]["tokens"].shape[1])
    finally:
        m.tables = good
    assert np.abs(logits - REF[LLAMA]["logits"]).max() > 100 * BOUND
    assert (toks != REF[LLAMA]["tokens"]).any()


# ---- the Pallas TPU kernel (interpreted on the CPU) ---------------------------------------------
# tpu.paged_attention converts K and V to bfloat16 before its dots, so on these float32 models it
# is checked twice: against the gather attention on K and V rounded to bfloat16, from the same
# caches, within BOUND (measured, CPU, TPU interpret mode: 4.9e-5 tiny Llama, 2.7e-6 tiny Qwen3:
# float32 rounding and summation order, as between the op's implementations); and against
# transformers to bfloat16 precision (measured: logits within 0.21 for the tiny Llama, logit std
# 2.0, and 0.014 for the tiny Qwen3, std 0.35; every token equal but in one prompt of the Llama,
# which forks at its 4th token on a top-2 gap of 4e-3).
TPU_EXACT_BOUND = BOUND
TPU_LOGIT_BOUND = {LLAMA: 0.3, QWEN: 0.03}
TPU_STEPS = 8  # decode steps of the exact check (TPU interpret mode: ~1 s a step on 2 CPU cores)


@pytest.mark.parametrize("name", [LLAMA, QWEN])
def test_pallas_tpu_decode_equals_gather_on_bfloat16_kv(name, monkeypatch):
    """From the same prefilled caches, decode steps with attention="pallas_tpu" (per-layer head_major
    caches) give the tokens and, within TPU_EXACT_BOUND, the logits of attention="gather" (stacked
    head_major caches) reading K and V rounded to bfloat16."""
    entry = REF[name]
    cpu = jax.devices("cpu")[0]
    tpu = generate.reference_decoder(entry, "kernel", None, device=cpu, decoder_cache=_DECODERS,
                                     attention="pallas_tpu")
    gat = generate.reference_decoder(entry, "kernel", "head_major", device=cpu, attention="gather")
    assert tpu.per_layer and tpu.layout == "head_major" and not gat.per_layer
    seqs = [tpu.allocator.allocate(len(p) + TPU_STEPS + 1) for p in entry["prompts"]]
    try:
        bt = tpu.allocator.block_table(seqs, tpu.blocks_per_seq)
        first, _, lens = tpu.prefill(entry["prompts"], bt)
        gat.key_cache, gat.value_cache = tpu.key_cache, tpu.value_cache  # the same caches, stacked
        want_t, want_l = tpu.decode(first, lens, bt, TPU_STEPS)
    finally:
        for s in seqs:
            tpu.allocator.free(s)
    gather = attn.gather_blocks

    def rounded(*a, **kw):
        return tuple(x.astype(jnp.bfloat16).astype(x.dtype) for x in gather(*a, **kw))
    monkeypatch.setattr(attn, "gather_blocks", rounded)
    got_t, got_l = gat.decode(first, lens, bt, TPU_STEPS)
    np.testing.assert_array_equal(np.asarray(got_t), np.asarray(want_t))
    err = float(np.abs(np.asarray(got_l) - np.asarray(want_l)).max())
    assert err <= TPU_EXACT_BOUND, f"max |dlogit| vs the bfloat16 gather {err:.2e}"


@pytest.mark.parametrize("name", [LLAMA, QWEN])
def test_pallas_tpu_generation_follows_transformers_to_bfloat16_precision(name):
    """attention="pallas_tpu" against transformers, compared where both saw the same tokens (each
    prompt up to and including its first differing token): logits within TPU_LOGIT_BOUND, and at
    least 3 of the 4 prompts generate every token."""
    toks, logits = _generate(name, "cpu", "kernel", None, "pallas_tpu")
    want_t, want_l = REF[name]["tokens"], REF[name]["logits"]
    errs, whole = [], 0
    for b in range(toks.shape[0]):
        fork = np.nonzero(toks[b] != want_t[b])[0]
        n = fork[0] + 1 if len(fork) else toks.shape[1]
        whole += not len(fork)
        errs.append(float(np.abs(logits[b, :n] - want_l[b, :n]).max()))
    assert max(errs) <= TPU_LOGIT_BOUND[name], f"max |dlogit| {max(errs):.3e}"
    assert whole >= 3, f"only {whole} prompts generate transformers' tokens"


# ---- paged-cache bookkeeping ----------------------------------------------------------------------
# Per-token fp8 (e4m3fn) caches against the same decoder with float32 caches, compared where both
# runs saw the same tokens (each sequence up to and including its first differing token: after a
# fork the contexts differ). Measured on CPU (XLA path and CPU handler): max |dlogit| 1.10 for
# tiny-llama-3.1 (logit std 2.04) and 0.112 for tiny-qwen3 (std 0.35); the first generated token
# equal for 3 of 4 and 4 of 4 prompts. These tiny random-weight models amplify the ~3% fp8 error of
# K and V (the dequantized caches are within half an e4m3 ulp of the float32 ones, checked in
# tests/test_fp8_per_token.py), and greedy decoding forks within ~7 steps on near-tied logits.
KV_QUANT_LOGIT_BOUND = {LLAMA: 1.6, QWEN: 0.17}
KV_QUANT_FIRST_TOKENS = {LLAMA: 3, QWEN: 4}


@pytest.mark.parametrize("name", [LLAMA, QWEN])
@pytest.mark.parametrize("impl", ["kernel", "xla"])
def test_per_token_fp8_caches_stay_close_to_the_unquantized_model(name, impl):
    toks, logits = _generate(name, "cpu", impl)
    layout = "xpacked" if impl == "kernel" else "flash"
    m = generate.reference_decoder(REF[name], impl, layout, device=jax.devices("cpu")[0], decoder_cache=_DECODERS,
                                   kv_quant="per_token")
    assert m.key_cache.dtype == jnp.float8_e4m3fn and m.scale_caches[0].shape[-1] == m.block_size
    qt, ql = m.generate(REF[name]["prompts"], REF[name]["tokens"].shape[1])
    errs = []
    for b in range(toks.shape[0]):
        fork = np.nonzero(qt[b] != toks[b])[0]
        n = fork[0] + 1 if len(fork) else toks.shape[1]
        errs.append(float(np.abs(ql[b, :n] - logits[b, :n]).max()))
    assert 0 < max(errs) <= KV_QUANT_LOGIT_BOUND[name], f"max |dlogit| {max(errs):.3e}"
    assert (qt[:, 0] == toks[:, 0]).sum() >= KV_QUANT_FIRST_TOKENS[name], (qt[:, 0], toks[:, 0])


def test_block_allocator():
    a = decoder.BlockAllocator(10, 4, seed=3)
    s1, s2 = a.allocate(9), a.allocate(4)  # 3 blocks, 1 block
    assert len(s1) == 3 and len(s2) == 1 and not set(s1) & set(s2) and a.num_free == 6
    assert s1 != sorted(s1) or s1[0] != 0  # shuffled: not simply 0, 1, 2
    with pytest.raises(RuntimeError, match="out of cache blocks"):
        a.allocate(25)
    assert a.num_free == 6  # a failed allocation takes nothing
    a.free(s1)
    with pytest.raises(ValueError, match="not allocated"):
        a.free(s1)
    again = a.allocate(36)  # all 9 free blocks
    assert len(again) == 10 - len(s2) and set(again) | set(s2) == set(range(10))
    bt = a.block_table([s2, again[:2]], width=4)
    assert bt.dtype == np.int32 and bt.tolist() == [[s2[0], -1, -1, -1], again[:2] + [-1, -1]]

    pos = np.array([[0, 3, 4, 7, -1, 16], [5, 8, 4, 0, 2, 9]], np.int32)
    got = np.asarray(decoder.slot_mapping(bt, pos, 4))
    want = [[s2[0] * 4, s2[0] * 4 + 3, -1, -1, -1, -1],  # block 1 of sequence 0 is padding (-1): no slot
            [again[1] * 4 + 1, -1, again[1] * 4, again[0] * 4, again[0] * 4 + 2, -1]]
    assert got.tolist() == want


SENTINEL = 12345.0  # no K or V value of the model comes near it


@pytest.mark.parametrize("platform,impl", [p for p in impl_params() if p.values != ("cpu", "xla")])  # CI: one
def test_generation_writes_only_its_own_slots(platform, impl):
    """Prefill (padded: padding slots -1) + decode write exactly the slots of positions
    [0, len + new - 1) of every sequence, in every layer, and no other slot of the cache."""
    m = _decoder(LLAMA, platform, impl)
    prompts, new = REF[LLAMA]["prompts"], 9
    m.key_cache, m.value_cache = (jnp.full_like(c, SENTINEL) for c in (m.key_cache, m.value_cache))
    seqs = [m.allocator.allocate(len(p) + new) for p in prompts]
    try:
        bt = m.allocator.block_table(seqs, m.blocks_per_seq)
        first, _, lens = m.prefill(prompts, bt)
        toks, _ = m.decode(first, lens, bt, new - 1)
        after = np.asarray(m.key_cache), np.asarray(m.value_cache)
    finally:
        for s in seqs:
            m.allocator.free(s)
    # the generation itself is still transformers' (a finite sentinel in unwritten slots is masked)
    np.testing.assert_array_equal(np.concatenate([np.asarray(first)[:, None], np.asarray(toks).T], 1),
                                  REF[LLAMA]["tokens"][:, :new])
    bs = m.block_size
    written = np.zeros(m.allocator.num_blocks * bs, bool)
    for p, blocks in zip(prompts, seqs):
        n = len(p) + new - 1  # the last generated token is never fed back
        written[[blocks[t // bs] * bs + t % bs for t in range(n)]] = True
    assert written.sum() < written.size / 2  # most of the pool belongs to nobody
    for cache in after:  # flash: [L, NB, BS, KH, D]
        slot_values = cache.reshape(cache.shape[0], written.size, -1)
        assert (slot_values[:, written] != SENTINEL).all(), "a slot of a sequence was not written (whole)"
        assert (slot_values[:, ~written] == SENTINEL).all(), "a slot no sequence owns was written"


def test_compiled_steps_donate_caches_and_call_the_op_once_per_layer():
    """Prefill and decode alias both stacked caches to their outputs, copy no cache-shaped buffer,
    need no temporary that grows with the pool (a cache copy would), and (CPU kernel) hold one
    custom call: the layer scan's body."""
    entry = REF[LLAMA]
    params = decoder.random_params(decoder.DecoderConfig.from_hf(entry["config"]), entry["seed"])
    m = decoder.Decoder(entry["config"], params, block_size=8, max_seqs=64, max_len=56, impl="kernel",
                        attention="gather")
    n_params = len(jax.tree.leaves(m.params)) + 2  # params, then the two tables, then the caches
    bt = np.zeros((4, m.blocks_per_seq), np.int32)
    shapes = [m.key_cache.shape, m.value_cache.shape]
    for fn, rest, kw in ((m.prefill_fn, (np.zeros((4, 21), np.int32), np.full(4, 21, np.int32), bt), {}),
                         (m.decode_fn, (np.zeros(4, np.int32), np.full(4, 21, np.int32), bt), dict(steps=3))):
        lower = lambda caches, fn=fn, rest=rest, kw=kw: fn.lower(m.params, m.tables, caches, *rest, **kw)  # noqa: E731
        compiled = lower(m.caches).compile()
        text = check_in_place(compiled, shapes, None, n_params_before_caches=n_params)
        check_temp_independent_of_pool(compiled, lower, m.caches)
        if m.device.platform == "cpu":
            calls = re.findall(r'custom_call_target="(jax_rope_cache[a-z_]*)"', text)
            assert len(calls) == 1, calls


def _in_place_params():
    """(platform, attention) pairs whose decode program is the one that runs there: each attention
    native to the platform, and pallas_tpu on the CPU (TPU interpret mode reads the operands through
    callbacks). pallas_gpu on the CPU is left out: Pallas' HLO interpreter carries the kernel's
    operands through its grid loop, so XLA copies them, which the GPU program does not."""
    out = []
    for p in platforms():
        dev = jax.devices(p)[0]
        for a in attn.ATTENTIONS:
            if a == "gather" or attn.default_attention(dev) == a or (p == "cpu" and a == "pallas_tpu"):
                out.append(pytest.param(p, a, id=f"{p}-{a}"))
    return out


@pytest.mark.parametrize("platform,attention", _in_place_params())
def test_decode_program_reads_the_caches_the_op_writes_in_place(platform, attention):
    """The decode program with each attention aliases every cache (stacked, or one per layer for a
    Pallas kernel) to its output and holds no copy, transpose or convert of a cache-shaped array:
    the op writes exactly the layout the attention reads. Temp memory stays below one K cache."""
    entry = REF[LLAMA]
    params = decoder.random_params(decoder.DecoderConfig.from_hf(entry["config"]), entry["seed"])
    dev = jax.devices(platform)[0]
    m = decoder.Decoder(entry["config"], params, block_size=8, max_seqs=64, max_len=56, impl="kernel",
                        attention=attention, layout="head_major", device=dev)
    assert m.per_layer == (attention != "gather")
    assert len(m.caches) == (2 * m.cfg.num_layers if m.per_layer else 2)
    bt = np.zeros((4, m.blocks_per_seq), np.int32)
    compiled = m.decode_fn.lower(m.params, m.tables, m.caches, np.zeros(4, np.int32), np.full(4, 21, np.int32),
                                 bt, steps=3).compile()
    text = compiled.as_text()
    dims = {"[" + ",".join(map(str, c.shape)) + "]" for c in m.caches}
    # the entry's parameters by number (jax may pass hoisted constants first, so numbers are read, not counted)
    entry = text[text.index("\nENTRY"):]
    params = {int(n): shape for shape, n in re.findall(r"= \w+(\[[\d,]*\])\S* parameter\((\d+)\)",
                                                        entry[:entry.index("\n}")])}
    aliases = {int(p) for _, p in re.findall(r"\{(\d*)\}: \((\d+), \{\}, (?:may|must)-alias\)", text)}
    cache_params = {n for n, shape in params.items() if shape in dims}
    assert len(cache_params) == len(m.caches) and cache_params <= aliases, (sorted(cache_params), sorted(aliases))
    for line in text.splitlines():
        if re.search(r"\b(copy|copy-start|transpose|convert)\(", line):
            assert not any(d in line.split("=")[1].split("(")[0] for d in dims), f"cache-shaped: {line.strip()}"
    k_bytes = sum(c.nbytes for c in m.caches[::2]) if m.per_layer else m.caches[0].nbytes
    temp = compiled.memory_analysis().temp_size_in_bytes
    assert temp < k_bytes, f"temp memory {temp} B holds a cache-sized buffer ({k_bytes} B)"


def test_fully_unrolled_layers_pass_constant_layer_indices():
    """unroll >= the layer count runs the layers as a Python loop: the same tokens as the scan, and
    (CPU kernel) one custom call per layer whose `layer` operand is a constant, not a device value."""
    entry = REF[LLAMA]
    params = decoder.random_params(decoder.DecoderConfig.from_hf(entry["config"]), entry["seed"])
    n_layers = entry["config"]["num_hidden_layers"]
    prompts, steps = entry["prompts"][:3], 6
    runs = {}
    for unroll in (1, n_layers):
        m = decoder.Decoder(entry["config"], params, max_seqs=4, max_len=64, impl="kernel", unroll=unroll,
                            device=jax.devices("cpu")[0])
        runs[unroll] = m.generate(prompts, steps)
    np.testing.assert_array_equal(runs[1][0], runs[n_layers][0])
    np.testing.assert_allclose(runs[1][1], runs[n_layers][1], rtol=0, atol=1e-5)
    bt = np.zeros((4, m.blocks_per_seq), np.int32)
    text = m.decode_fn.lower(m.params, m.tables, m.caches, np.zeros(4, np.int32), np.full(4, 9, np.int32), bt,
                             steps=2).compile().as_text()
    calls = [ln for ln in text.splitlines() if 'custom_call_target="jax_rope_cache' in ln]
    assert len(calls) == n_layers, len(calls)
    constants = {m_.group(1) for m_ in re.finditer(r"%(\S+) = s32\[\] constant\(", text)}
    for ln in calls:
        operands = re.search(r"custom-call\((.*?)\), custom_call_target", ln).group(1).split(", ")
        layer_arg = operands[contract.OPERANDS.index("layer")].split("=")[-1].lstrip("%")
        assert layer_arg in constants, (layer_arg, ln[:300])


def test_decode_compiler_options_reach_the_decode_program_only():
    """decode_compiler_options are XLA options of the decode program: the same tokens with a valid
    one (split-K off, a no-op on the CPU), XLA's error naming an unknown one at the first decode,
    and prefill unaffected by it."""
    entry = REF[LLAMA]
    params = decoder.random_params(decoder.DecoderConfig.from_hf(entry["config"]), entry["seed"])
    prompts, steps = entry["prompts"][:2], 4
    runs = []
    for opts in (None, {"xla_gpu_experimental_force_split_k": 1}):
        m = decoder.Decoder(entry["config"], params, max_seqs=4, max_len=64, impl="kernel",
                            device=jax.devices("cpu")[0], decode_compiler_options=opts)
        runs.append(m.generate(prompts, steps)[0])
    np.testing.assert_array_equal(runs[0], runs[1])
    m = decoder.Decoder(entry["config"], params, max_seqs=4, max_len=64, impl="kernel",
                        device=jax.devices("cpu")[0], decode_compiler_options={"xla_no_such_option": 1})
    seqs = [m.allocator.allocate(len(p) + steps + 1) for p in prompts]
    bt = m.allocator.block_table(seqs, m.blocks_per_seq)
    first, _, lens = m.prefill(prompts, bt)  # prefill compiles without the decode options
    with pytest.raises(Exception, match="xla_no_such_option"):
        m.decode(first, lens, bt, steps)


def test_decode_options_default_to_cublas_gemms_on_nvidia_only(monkeypatch):
    """None: cuBLAS GEMMs in the decode program on an NVIDIA GPU, XLA's defaults on ROCm and the CPU;
    the caller's options (also {}) replace the default, and the default reaches the decode program:
    with a device default that is not empty (a stand-in for NVIDIA's), {} compiles with none of it."""
    class Client:
        def __init__(self, version):
            self.platform_version = version

    class Device:
        def __init__(self, platform, version):
            self.platform, self.client = platform, Client(version)

    assert decoder.default_decode_options(Device("gpu", "cuda 13000")) == {"xla_gpu_enable_triton_gemm": False}
    assert decoder.default_decode_options(Device("gpu", "rocm 70100")) == {}
    assert decoder.default_decode_options(jax.devices("cpu")[0]) == {}
    entry = REF[LLAMA]
    params = decoder.random_params(decoder.DecoderConfig.from_hf(entry["config"]), entry["seed"])
    for given, want in ((None, {}), ({}, {}), ({"xla_gpu_enable_triton_gemm": True}, {"xla_gpu_enable_triton_gemm": True})):
        m = decoder.Decoder(entry["config"], params, max_seqs=2, max_len=32, device=jax.devices("cpu")[0],
                            decode_compiler_options=given)
        assert m.decode_compiler_options == want
    # the device's default is what the decode program compiles with (an unknown one fails there),
    # unless the caller gives options: {} is XLA's defaults, not the device's (as on an NVIDIA GPU)
    monkeypatch.setattr(decoder, "default_decode_options", lambda device: {"xla_no_such_default": 1})
    prompts, steps = entry["prompts"][:1], 2
    runs = {}
    for given in (None, {}):
        m = decoder.Decoder(entry["config"], params, max_seqs=2, max_len=32, device=jax.devices("cpu")[0],
                            decode_compiler_options=given)
        bt = m.allocator.block_table([m.allocator.allocate(len(prompts[0]) + steps + 1)], m.blocks_per_seq)
        first, _, lens = m.prefill(prompts, bt)
        if given is None:
            assert m.decode_compiler_options == {"xla_no_such_default": 1}
            with pytest.raises(Exception, match="xla_no_such_default"):
                m.decode(first, lens, bt, steps)
        else:
            assert m.decode_compiler_options == {}
            runs["{}"] = m.decode(first, lens, bt, steps)[0]
    monkeypatch.undo()
    m = decoder.Decoder(entry["config"], params, max_seqs=2, max_len=32, device=jax.devices("cpu")[0])
    bt = m.allocator.block_table([m.allocator.allocate(len(prompts[0]) + steps + 1)], m.blocks_per_seq)
    first, _, lens = m.prefill(prompts, bt)
    np.testing.assert_array_equal(runs["{}"], m.decode(first, lens, bt, steps)[0])  # the same model, XLA's defaults


def test_config_errors():
    base = decoder.TINY_CONFIGS[LLAMA]
    for key, value, match in (("model_type", "gpt2", "model_type"), ("attention_bias", True, "attention_bias"),
                              ("hidden_act", "gelu", "hidden_act"), ("num_key_value_heads", 3, "num_key_value_heads"),
                              ("vocab_size", 0, "vocab_size")):
        with pytest.raises(ValueError, match=match):
            decoder.DecoderConfig.from_hf({**base, key: value})
    cfg = decoder.DecoderConfig.from_hf(decoder.TINY_CONFIGS[QWEN])
    assert cfg.qk_norm and cfg.tie_word_embeddings and cfg.head_dim * cfg.q_heads != cfg.hidden_size
    with pytest.raises(ValueError, match="impl"):
        decoder.Decoder(base, {}, impl="fast")


def test_generate_command_times_a_bfloat16_model(capsys):
    """The timing half of `python -m jax_rope_cache generate` (what the H200 benchmark runs), on a
    bfloat16 model with the op replaced by its timing baseline ("baseline": one compile, the cheapest
    smoke test)."""
    with pytest.raises(SystemExit) as e:
        generate.main(["--check", "none", "--impls", "baseline", "--batch", "3", "--prompt-len", "5", "--steps", "2",
                       "--repeats", "1", "--dtype", "bfloat16", "--block-size", "8"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "bfloat16" in out and re.search(r"^baseline\s+[\d.]+ms\s+\d+us\s+[\d,]+$", out, re.M), out


# int8 caches (kv_quant="int8_per_token") against the same float32 decoder, compared as above.
# Measured on CPU (XLA path): max |dlogit| 0.373 for tiny-llama-3.1 (fp8 per-token: 1.10) and 0.0334
# for tiny-qwen3 (fp8: 0.112); first token equal 4 of 4 on both; greedy tokens before the first fork
# 105 of 132 and 132 of 132 (fp8: 24 and 25 of 132). int8's step is amax/127, finer than e4m3's
# 3-bit mantissa near amax, so the test asks only that it beats the fp8 cache on the same prompts.
# int4 caches (kv_quant="int4_per_token", step amax/7): max |dlogit| 4.18 (Llama) and 0.487 (Qwen3),
# first token equal 2 of 4 and 3 of 4, tokens before the first fork 2 and 15 of 132: the test asks
# that it moves the run further than int8 does.
def _logit_change(name, kv_quant, toks, logits):
    m = generate.reference_decoder(REF[name], "xla", "flash", device=jax.devices("cpu")[0], decoder_cache=_DECODERS,
                                   kv_quant=kv_quant)
    qt, ql = m.generate(REF[name]["prompts"], REF[name]["tokens"].shape[1])
    errs = []
    for b in range(toks.shape[0]):
        fork = np.nonzero(qt[b] != toks[b])[0]
        n = fork[0] + 1 if len(fork) else toks.shape[1]
        errs.append(float(np.abs(ql[b, :n] - logits[b, :n]).max()))
    return m, max(errs)


@pytest.mark.parametrize("name", [LLAMA, QWEN])
def test_int8_caches_stay_closer_than_fp8(name):
    toks, logits = _generate(name, "cpu", "xla")
    m, int8_err = _logit_change(name, "int8_per_token", toks, logits)
    assert m.key_cache.dtype == np.int8 and m.scale_caches[0].shape[-1] == m.block_size
    _, fp8_err = _logit_change(name, "per_token", toks, logits)
    assert 0 < int8_err < fp8_err, (int8_err, fp8_err)


@pytest.mark.parametrize("name", [LLAMA, QWEN])
def test_int4_caches_move_further_than_int8(name):
    toks, logits = _generate(name, "cpu", "xla")
    m, int4_err = _logit_change(name, "int4_per_token", toks, logits)
    assert m.key_cache.dtype == np.uint8 and m.key_cache.shape[-1] == m.cfg.head_dim // 2
    _, int8_err = _logit_change(name, "int8_per_token", toks, logits)
    assert 0 < int8_err < int4_err, (int8_err, int4_err)
