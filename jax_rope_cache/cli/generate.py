"""The main job: greedy generation (batched prefill of prompts of different lengths, then decode)
with a small Llama-3.1 / Qwen3 decoder (jax_rope_cache/decoder.py) or DeepSeek-V3 on the MLA latent
cache (jax_rope_cache/decoder_mla.py) on the default device.

1. Check: the tiny random-weight models of the fixtures (tests/data/hf_greedy.npz and
   hf_greedy_mla.npz, recorded from Hugging Face transformers by tools/record_hf_model.py) generate
   their prompts' tokens with impl="kernel" and impl="xla"; prints the token ids and whether tokens
   and logits match. Every fixture model, or with `--model` that model only.
2. Timing: a batch of random prompts, prefill + `--steps` decode steps of `--model`, for each
   of `--impls` in one process; prints decode step time and tokens/s, and with "baseline" in
   --impls (the model with RoPE and the cache write replaced by a one-element in-place write of each
   cache, so attention still depends on a write every layer: wrong output, timing only) the share of
   the step that RoPE + cache write take.

`--attention` picks how decode steps read the cache (gather, pallas_gpu, pallas_tpu; default: the
fastest on the device, decoder.Decoder's choice); the check then decodes with it too.

    python -m jax_rope_cache generate                                # every tiny model checked, tiny Llama timed
    python -m jax_rope_cache generate --model llama-3.1-8b --dtype bfloat16 --batch 64 --check none
    python -m jax_rope_cache generate --model tiny-deepseek-v3 --layout split
"""

from __future__ import annotations

import argparse
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from jax_rope_cache import attention as attn
from jax_rope_cache import decoder, decoder_families, decoder_mla
from jax_rope_cache.cli._fmt import compare_runs, progress

MODELS = {**decoder.TINY_CONFIGS, **decoder_mla.TINY_MLA_CONFIGS, **decoder_families.TINY_FAMILY_CONFIGS,
          "llama-3.1-8b": decoder.LLAMA_31_8B_CONFIG}
DEFAULT_MODEL = "tiny-llama-3.1"


def summary() -> str:
    """The command's one line in `python -m jax_rope_cache --help`, from MODELS."""
    tiny = [n.removeprefix("tiny-") for n in MODELS if n.startswith("tiny-")]
    full = [n for n in MODELS if not n.startswith("tiny-")]
    return (f"the README's main job: tiny {', '.join(tiny)} generate on the paged caches, checked against "
            f"transformers; --model (also {', '.join(full)}) timed, kernel vs XLA")
SEEDS = {**decoder.TINY_SEEDS, **decoder_mla.TINY_MLA_SEEDS, **decoder_families.TINY_FAMILY_SEEDS}
FIXTURE_NAME = os.path.join("tests", "data", "hf_greedy.npz")
MLA_FIXTURE_NAME = os.path.join("tests", "data", "hf_greedy_mla.npz")
FAMILIES_FIXTURE_NAME = os.path.join("tests", "data", "hf_greedy_families.npz")
LAYOUTS = ("flash", "xpacked", "xpacked_shuffled", "hnd", "head_major", "kv_merged", "combined", "split")


def model_classes(config) -> tuple:
    """(config dataclass, decoder class) of a config dict: MLA models (DeepSeek-V3) or the others."""
    if config.get("model_type") in decoder_mla.MlaDecoderConfig.supported:
        return decoder_mla.MlaDecoderConfig, decoder_mla.MlaDecoder
    if config.get("model_type") in ("gemma3_text", "llama4_text"):
        return decoder_families.FamilyDecoderConfig, decoder_families.FamilyDecoder
    return decoder.DecoderConfig, decoder.Decoder


def find_reference(path: str | None, name: str = FIXTURE_NAME) -> str | None:
    """A fixture: `path`, else $JRC_HF_REFERENCE (the Llama/Qwen3 one), else `name` under the current
    directory or under the source tree this package was imported from."""
    if path:
        return path
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = os.environ.get("JRC_HF_REFERENCE") if name == FIXTURE_NAME else None
    for cand in (env, name, os.path.join(here, name)):
        if cand and os.path.exists(cand):
            return cand
    return None


def reference_decoder(entry: dict, impl: str, layout: str | None = "flash", block_size: int = 8, device=None,
                      decoder_cache=None, kv_quant=None, attention="gather") -> decoder.Decoder:
    """The decoder of a fixture entry (weights from its seed, checked against its digest); block
    size 8 puts the longest sequence (21 + 33 tokens) in 7 blocks. `decoder_cache`: a dict that
    keeps compiled decoders between calls. `attention` and `layout` as Decoder's (None: its choice)."""
    config = entry["config"]
    new = entry["tokens"].shape[1]
    key = (str(config), impl, layout, block_size, str(device), kv_quant, attention)
    m = None if decoder_cache is None else decoder_cache.get(key)
    if m is None:
        config_class, decoder_class = model_classes(config)
        params = decoder.random_params(config_class.from_hf(config), entry["seed"])
        if decoder.params_digest(params) != entry["digest"]:
            raise RuntimeError("the weights from the fixture's seed differ from the recorded ones (the initialiser "
                               "changed?): regenerate with tools/record_hf_model.py")
        max_len = -(-(max(map(len, entry["prompts"])) + new) // block_size) * block_size
        # a pool 4x what the prompts need: most blocks belong to nobody (and must stay untouched)
        extra = {} if attention == "gather" else dict(attention=attention)  # the MLA decoder only gathers
        m = decoder_class(config, params, layout=layout, block_size=block_size, impl=impl,
                          max_seqs=4 * len(entry["prompts"]), max_len=max_len, device=device, kv_quant=kv_quant,
                          **extra)
        if decoder_cache is not None:
            decoder_cache[key] = m
    return m


def reference_generation(entry: dict, impl: str, layout: str | None = "flash", **kw):
    """The fixture entry's prompts generated by the decoder: (tokens [B, N], logits [B, N, V])."""
    return reference_decoder(entry, impl, layout, **kw).generate(entry["prompts"], entry["tokens"].shape[1])


def model_attention(config, attention):
    """`attention` where the model's decoder has it (the MLA decoder only gathers), else gather."""
    return attention if attention in model_classes(config)[1].attentions else "gather"


def check(ref_path: str, impls, layouts, show_tokens=True, kv_quant=None, attention="gather", models=None) -> bool:
    """The fixture's models (or those of them in `models`) with each impl and each of `layouts` their
    decoder has (a Pallas attention: its own layout); with `kv_quant` also how far quantized caches
    move the run (models whose decoder has no kv_quant: skipped). pallas_tpu reads K and V as
    bfloat16, so its lines report how far it moves instead of being held to the float32 bound."""
    ref = decoder.load_hf_reference(ref_path)
    meta = ref.pop("meta")
    if models is not None:
        ref = {name: entry for name, entry in ref.items() if name in models}
    print(f"check against transformers {meta['transformers']} (torch {meta['torch']}), recorded in {ref_path}; "
          f"bound: tokens equal, max |logit - reference| <= {decoder.HF_LOGIT_BOUND:g}")
    ok = True
    for name, entry in ref.items():
        lens = ", ".join(str(len(p)) for p in entry["prompts"])
        shown = False
        own = model_classes(entry["config"])[1].layouts
        att = model_attention(entry["config"], attention)
        mine = [attn.layout_of(att)] if attn.layout_of(att) else [s for s in layouts if s in own]
        for impl in impls:
            for layout in mine:
                toks, logits = reference_generation(entry, impl, layout, attention=att)
                same = np.array_equal(toks, entry["tokens"])
                err = float(np.abs(logits - entry["logits"]).max())
                good = same and err <= decoder.HF_LOGIT_BOUND
                verdict = "OK" if good else "MISMATCH"
                if att == "pallas_tpu":
                    verdict = f"tokens equal {int((toks == entry['tokens']).sum())}/{toks.size} (bfloat16 K and V)"
                else:
                    ok &= good
                print(f"  {name:<17} impl={impl:<7}{layout:<11}{att:<11} prompts of {lens} tokens, {toks.shape[1]} "
                      f"tokens each: tokens {'match' if same else 'DIFFER'}, max |dlogit| {err:.1e} -> {verdict}")
                if kv_quant in model_classes(entry["config"])[1].kv_quants[1:]:  # the same run with quantized caches: how far it moves (not held to the bound)
                    qt, ql = reference_generation(entry, impl, layout, kv_quant=kv_quant)
                    print(f"  {'':<15} kv_quant={kv_quant}: tokens equal {int((qt == toks).sum())}/{toks.size}, "
                          f"max |dlogit| vs unquantized {float(np.abs(ql - logits).max()):.1e}")
                if show_tokens and not shown:
                    for p, t in zip(entry["prompts"], toks):
                        print(f"      prompt[{len(p):>2}] -> {' '.join(map(str, t))}")
                    shown = True
    return ok


def timing(model: str, impls, layout: str | None, batch: int, prompt_len: int, steps: int, dtype, repeats: int,
           unroll: int, block_size: int, seed: int = 0, layers: int | None = None, kv_quant=None, attention=None):
    config = dict(MODELS[model])
    if layers:
        config["num_hidden_layers"] = layers
    config_class, decoder_class = model_classes(config)
    if layout is not None and layout not in decoder_class.layouts:
        raise ValueError(f"layout: {model} caches in one of {decoder_class.layouts}, got {layout!r}")
    cfg = config_class.from_hf(config)
    t0 = time.perf_counter()
    n_params = sum(int(np.prod(s)) for s in jax.tree.leaves(cfg.param_shapes(), is_leaf=lambda x: isinstance(x, tuple)))
    if n_params > 5e7:
        params = decoder.random_params_on_device(cfg, seed, dtype)
    else:
        params = decoder.random_params(cfg, SEEDS.get(model, seed), np.dtype(dtype))
    jax.block_until_ready(params)
    rng = np.random.default_rng(seed)
    lengths = rng.integers(max(1, prompt_len // 2), prompt_len + 1, batch)
    lengths[0] = prompt_len
    prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in lengths]
    max_len = -(-(prompt_len + steps + 1) // block_size) * block_size
    heads = f"MLA heads {cfg.q_heads}, latent {cfg.latent_dim} + {cfg.rope_dim}" if hasattr(cfg, "latent_dim") \
        else f"heads {cfg.q_heads}/{cfg.kv_heads} x {cfg.head_dim}"
    att, layout = decoder_class.choose_attention(None if attention is None else model_attention(config, attention),
                                                 layout, kv_quant, jax.devices()[0])
    made = dict(layout=layout, attention=att, block_size=block_size, max_seqs=batch, max_len=max_len, dtype=dtype,
                unroll=unroll or cfg.num_layers, cache_fill="zeros")
    print(f"\ntiming {model} ({n_params / 1e6:,.1f}M parameters, {cfg.num_layers} layers, hidden {cfg.hidden_size}, "
          f"{heads}, vocab {cfg.vocab_size}), {np.dtype(dtype).name}, "
          f"{made['layout']} cache{' (' + kv_quant + ' scales)' if kv_quant else ''}, "
          f"attention {made['attention']}, batch {batch}, "
          f"prompts {lengths.min()}-{lengths.max()} tokens, {steps} decode steps, "
          f"layer scan unroll={unroll or 'all'} (weights ready in {time.perf_counter() - t0:.1f} s)")
    rows, runs = {}, {}
    for impl in impls:
        m = decoder_class(config, params, impl=impl, **made, kv_quant=kv_quant if impl != "baseline" else None)
        seqs = [m.allocator.allocate(len(p) + steps + 1) for p in prompts]
        bt = m.allocator.block_table(seqs, m.blocks_per_seq)
        t_pre, t_dec = [], []
        for r in range(repeats + 1):  # the first round compiles
            progress(impls.index(impl) * (repeats + 1) + r, len(impls) * (repeats + 1),
                     f"{impl}: {'compile + first run' if r == 0 else f'timed run {r}/{repeats}'}")
            t1 = time.perf_counter()
            first, _, lens = m.prefill(prompts, bt)
            jax.block_until_ready(first)
            t2 = time.perf_counter()
            toks, _ = m.decode(first, lens, bt, steps, with_logits=False)
            jax.block_until_ready((toks, m.caches))
            t3 = time.perf_counter()
            if r:
                t_pre.append(t2 - t1)
                t_dec.append(t3 - t2)
        rows[impl] = (float(np.median(t_pre)), float(np.median(t_dec)) / steps)
        runs[impl] = (t_pre, t_dec)
        if impl == impls[-1]:
            progress(len(impls) * (repeats + 1), len(impls) * (repeats + 1), "done")
        del m
    print(f"{'impl':<8}{'prefill':>11}{'decode step':>14}{'decode tok/s':>15}")
    for impl, (tp, td) in rows.items():
        print(f"{impl:<8}{tp * 1e3:>9.2f}ms{td * 1e6:>12.0f}us{batch / td:>15,.0f}")
    if "kernel" in rows and "xla" in rows:
        k, x = runs["kernel"], runs["xla"]
        print(f"kernel vs xla: decode step {compare_runs(x[1], k[1])}; prefill {compare_runs(x[0], k[0])}")
    if "baseline" in rows:
        off = rows["baseline"][1]
        for impl in ("kernel", "xla"):
            if impl in rows:
                share = 1 - off / rows[impl][1]
                print(f"RoPE + cache write ({impl}): {share * 100:.1f}% of the decode step "
                      f"({(rows[impl][1] - off) * 1e6:.0f} us of {rows[impl][1] * 1e6:.0f} us; "
                      f"{(rows[impl][1] - off) / cfg.num_layers * 1e6:.1f} us per layer)"
                      + (" - below zero: smaller than the run-to-run noise" if share < 0 else ""))
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m jax_rope_cache generate", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, choices=sorted(MODELS),
                   help=f"the model to check and time (default: every fixture model checked, {DEFAULT_MODEL} timed)")
    p.add_argument("--check", default="auto", choices=("auto", "none"),
                   help="compare the fixture's tiny models with transformers' tokens (auto: if the fixture is found)")
    p.add_argument("--reference", default=None,
                   help=f"the Llama/Qwen3 fixture (default {FIXTURE_NAME} here or in the source tree); "
                        f"{MLA_FIXTURE_NAME} is found the same way")
    p.add_argument("--check-layouts", default="flash,xpacked,combined,split",
                   help="layouts checked, each with the models whose caches have it")
    p.add_argument("--impls", default="kernel,xla",
                   help="comma list of kernel, xla, baseline (baseline: no RoPE, a one-element cache write)")
    p.add_argument("--layout", default=None, choices=LAYOUTS,
                   help="cache layout timed (default: the attention's, flash for gather, combined for an MLA model)")
    p.add_argument("--attention", default=None, choices=attn.ATTENTIONS,
                   help="how decode steps read the cache (default: the fastest on the device: pallas_gpu on NVIDIA "
                        "GPUs, pallas_tpu on TPUs, gather elsewhere; an MLA model always gathers); the Pallas "
                        "kernels run interpreted on the CPU")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=64, help="longest prompt; the others are 1/2 to all of it")
    p.add_argument("--steps", type=int, default=128, help="decode steps timed")
    p.add_argument("--layers", type=int, default=None, help="override the model's number of layers (timing only)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--unroll", type=int, default=0, help="layer scan unroll factor (0: all layers, straight-line)")
    p.add_argument("--kv-quant", default=None, choices=tuple(q for q in decoder.KV_QUANTS if q),
                   help="per_token: float8_e4m3fn, int8_per_token / int4_per_token: int8 / int4 caches, all with "
                        "per-token scales; nvfp4 / mxfp4: 4-bit float caches with block scales (the check then "
                        "also reports how far the quantized run moves from the unquantized one)")
    a = p.parse_args(argv)
    impls = [s for s in a.impls.split(",") if s]
    for s in impls:
        if s not in decoder.IMPLS:
            p.error(f"--impls: expected a comma list of {', '.join(decoder.IMPLS)}, got {s!r}")
    for name, v in (("--batch", a.batch), ("--prompt-len", a.prompt_len), ("--steps", a.steps),
                    ("--block-size", a.block_size), ("--repeats", a.repeats), ("--layers", a.layers or 1)):
        if v < 1:
            p.error(f"{name}: expected >= 1, got {v}")
    model = a.model or DEFAULT_MODEL
    own = model_classes(MODELS[model])[1]
    layout = a.layout  # None: the attention's layout (flash for gather, combined for an MLA model)
    if layout is not None and layout not in own.layouts:
        p.error(f"--layout: {model} caches in one of {own.layouts}, got {layout!r}")
    want = attn.layout_of(model_attention(MODELS[model], a.attention)) if a.attention else None
    if want and layout not in (None, want):
        p.error(f"--layout: attention {a.attention!r} reads {want!r} caches, got {layout!r}")
    if a.kv_quant not in own.kv_quants:
        p.error(f"--kv-quant: {model} takes one of {own.kv_quants}, got {a.kv_quant!r}")
    dev = jax.devices()[0]
    print(f"device {dev.platform} ({dev.device_kind}), jax {jax.__version__}")
    ok = True
    checked = None if a.model is None else {a.model}
    fixtures = ((a.reference, FIXTURE_NAME, decoder.TINY_CONFIGS), (None, MLA_FIXTURE_NAME, decoder_mla.TINY_MLA_CONFIGS),
                (None, FAMILIES_FIXTURE_NAME, decoder_families.TINY_FAMILY_CONFIGS))
    if a.check == "auto" and checked is not None and not any(a.model in models for *_, models in fixtures):
        recorded = ", ".join(n for *_, models in fixtures for n in models)
        print(f"{a.model} has no recorded transformers output (recorded: {recorded}): its check skipped")
    for path, name, models in fixtures if a.check == "auto" else ():
        if checked is not None and not checked & set(models):
            continue
        ref = find_reference(path, name)
        if ref is None:
            print(f"no recorded reference ({name} not found here{'; pass --reference' * (name == FIXTURE_NAME)}):"
                  f" its check skipped")
        else:
            ok &= check(ref, [i for i in impls if i != "baseline"] or ["kernel", "xla"],
                        [s for s in a.check_layouts.split(",") if s], kv_quant=a.kv_quant, models=checked,
                        attention=a.attention or attn.default_attention(dev))
    timing(model, impls, layout, a.batch, a.prompt_len, a.steps, jnp.dtype(a.dtype), a.repeats, a.unroll,
           a.block_size, layers=a.layers, kv_quant=a.kv_quant, attention=a.attention)
    raise SystemExit(0 if ok else 1)
