"""The main job: greedy generation (batched prefill of prompts of different lengths, then decode)
with a small Llama-3.1 / Qwen3 decoder on the default device (jax_rope_cache/cli/decoder.py).

1. Check: the tiny random-weight models of the fixture (tests/data/hf_greedy.npz, recorded from
   Hugging Face transformers by scripts/record_hf_model.py) generate their prompts' tokens with
   impl="kernel" and impl="xla"; prints the token ids and whether tokens and logits match.
2. Timing: a batch of random prompts, prefill + `--steps` decode steps of `--model`, for each
   of `--impls` in one process; prints decode step time and tokens/s, and with "off" in --impls
   (the model with RoPE and the cache write removed: wrong output, timing only) the share of the
   step that RoPE + cache write take.

    python -m jax_rope_cache generate                                # tiny Llama: check + timing
    python -m jax_rope_cache generate --model llama-3.1-8b --dtype bfloat16 --batch 64 --check none
"""

from __future__ import annotations

import argparse
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from jax_rope_cache.cli import decoder

MODELS = {**decoder.TINY_CONFIGS, "llama-3.1-8b": decoder.LLAMA_31_8B_CONFIG}
FIXTURE_NAME = os.path.join("tests", "data", "hf_greedy.npz")


def find_reference(path: str | None) -> str | None:
    """The fixture: `path`, else $JRC_HF_REFERENCE, else tests/data/hf_greedy.npz under the current
    directory or under the source tree this package was imported from."""
    if path:
        return path
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    for cand in (os.environ.get("JRC_HF_REFERENCE"), FIXTURE_NAME, os.path.join(here, FIXTURE_NAME)):
        if cand and os.path.exists(cand):
            return cand
    return None


def reference_generation(entry: dict, impl: str, layout: str = "flash", block_size: int = 8, decoder_cache=None):
    """Generates the fixture entry's prompts with the decoder: (tokens [B, N], logits [B, N, V]).
    The block size (8) puts the longest sequence (21 + 33 tokens) in 7 blocks."""
    config = entry["config"]
    new = entry["tokens"].shape[1]
    key = (str(config), impl, layout, block_size)
    m = None if decoder_cache is None else decoder_cache.get(key)
    if m is None:
        params = decoder.random_params(decoder.DecoderConfig.from_hf(config), entry["seed"])
        if decoder.params_digest(params) != entry["digest"]:
            raise RuntimeError("the weights from the fixture's seed differ from the recorded ones (the initialiser "
                               "changed?): regenerate with scripts/record_hf_model.py")
        max_len = -(-(max(map(len, entry["prompts"])) + new) // block_size) * block_size
        m = decoder.Decoder(config, params, layout=layout, block_size=block_size, impl=impl,
                            max_seqs=len(entry["prompts"]), max_len=max_len)
        if decoder_cache is not None:
            decoder_cache[key] = m
    return m.generate(entry["prompts"], new)


def check(ref_path: str, impls, layouts, show_tokens=True) -> bool:
    ref = decoder.load_hf_reference(ref_path)
    meta = ref.pop("meta")
    print(f"check against transformers {meta['transformers']} (torch {meta['torch']}), recorded in {ref_path}; "
          f"bound: tokens equal, max |logit - reference| <= {decoder.HF_LOGIT_BOUND:g}")
    ok = True
    for name, entry in ref.items():
        lens = ", ".join(str(len(p)) for p in entry["prompts"])
        shown = False
        for impl in impls:
            for layout in layouts:
                toks, logits = reference_generation(entry, impl, layout)
                same = np.array_equal(toks, entry["tokens"])
                err = float(np.abs(logits - entry["logits"]).max())
                good = same and err <= decoder.HF_LOGIT_BOUND
                ok &= good
                print(f"  {name:<15} impl={impl:<7}{layout:<17} prompts of {lens} tokens, {toks.shape[1]} tokens each: "
                      f"tokens {'match' if same else 'DIFFER'}, max |dlogit| {err:.1e} -> {'OK' if good else 'MISMATCH'}")
                if show_tokens and not shown:
                    for p, t in zip(entry["prompts"], toks):
                        print(f"      prompt[{len(p):>2}] -> {' '.join(map(str, t))}")
                    shown = True
    return ok


def timing(model: str, impls, layout: str, batch: int, prompt_len: int, steps: int, dtype, repeats: int,
           unroll: int, block_size: int, seed: int = 0):
    config = MODELS[model]
    cfg = decoder.DecoderConfig.from_hf(config)
    t0 = time.perf_counter()
    if cfg.num_layers * cfg.hidden_size ** 2 > 1e8:
        params = decoder.random_params_on_device(cfg, seed, dtype)
    else:
        params = decoder.random_params(cfg, decoder.TINY_SEEDS.get(model, seed), np.dtype(dtype))
    jax.block_until_ready(params)
    rng = np.random.default_rng(seed)
    lengths = rng.integers(max(1, prompt_len // 2), prompt_len + 1, batch)
    lengths[0] = prompt_len
    prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in lengths]
    max_len = -(-(prompt_len + steps + 1) // block_size) * block_size
    print(f"\ntiming {model} ({cfg.num_layers} layers, hidden {cfg.hidden_size}, heads {cfg.q_heads}/{cfg.kv_heads}"
          f" x {cfg.head_dim}, vocab {cfg.vocab_size}), {np.dtype(dtype).name}, {layout} cache, batch {batch}, prompts"
          f" {lengths.min()}-{lengths.max()} tokens, {steps} decode steps, layer scan unroll={unroll or 'all'}"
          f" (weights ready in {time.perf_counter() - t0:.1f} s)")
    rows = {}
    for impl in impls:
        m = decoder.Decoder(config, params, layout=layout, block_size=block_size, impl=impl, max_seqs=batch,
                            max_len=max_len, dtype=dtype, unroll=unroll or cfg.num_layers)
        seqs = [m.allocator.allocate(len(p) + steps + 1) for p in prompts]
        bt = m.allocator.block_table(seqs, m.blocks_per_seq)
        t_pre, t_dec = [], []
        for r in range(repeats + 1):  # the first round compiles
            t1 = time.perf_counter()
            first, _, lens = m.prefill(prompts, bt)
            jax.block_until_ready(first)
            t2 = time.perf_counter()
            toks, _ = m.decode(first, lens, bt, steps, with_logits=False)
            jax.block_until_ready((toks, m.key_cache))
            t3 = time.perf_counter()
            if r:
                t_pre.append(t2 - t1)
                t_dec.append(t3 - t2)
        rows[impl] = (float(np.median(t_pre)), float(np.median(t_dec)) / steps)
        del m
    print(f"{'impl':<8}{'prefill':>11}{'decode step':>14}{'decode tok/s':>15}")
    for impl, (tp, td) in rows.items():
        print(f"{impl:<8}{tp * 1e3:>9.2f}ms{td * 1e6:>12.0f}us{batch / td:>15,.0f}")
    if "kernel" in rows and "xla" in rows:
        k, x = rows["kernel"], rows["xla"]
        print(f"kernel vs xla: decode step {x[1] / k[1]:.2f}x faster, prefill {x[0] / k[0]:.2f}x faster")
    if "off" in rows:
        off = rows["off"][1]
        for impl in ("kernel", "xla"):
            if impl in rows:
                share = 1 - off / rows[impl][1]
                print(f"RoPE + cache write ({impl}): {share * 100:.1f}% of the decode step "
                      f"({(rows[impl][1] - off) * 1e6:.0f} us of {rows[impl][1] * 1e6:.0f} us; "
                      f"{(rows[impl][1] - off) / cfg.num_layers * 1e6:.1f} us per layer)")
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m jax_rope_cache generate", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny-llama-3.1", choices=sorted(MODELS), help="model to time")
    p.add_argument("--check", default="auto", choices=("auto", "none"),
                   help="compare the fixture's tiny models with transformers' tokens (auto: if the fixture is found)")
    p.add_argument("--reference", default=None, help=f"the fixture (default {FIXTURE_NAME} here or in the source tree)")
    p.add_argument("--check-layouts", default="flash,xpacked")
    p.add_argument("--impls", default="kernel,xla", help="comma list of kernel, xla, off (off: no RoPE/cache write)")
    p.add_argument("--layout", default="flash", choices=("flash", "xpacked", "xpacked_shuffled"))
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=64, help="longest prompt; the others are 1/2 to all of it")
    p.add_argument("--steps", type=int, default=128, help="decode steps timed")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--unroll", type=int, default=0, help="layer scan unroll factor (0: all layers, straight-line)")
    a = p.parse_args(argv)
    impls = [s for s in a.impls.split(",") if s]
    for s in impls:
        if s not in decoder.IMPLS:
            p.error(f"--impls: expected a comma list of {', '.join(decoder.IMPLS)}, got {s!r}")
    for name, v in (("--batch", a.batch), ("--prompt-len", a.prompt_len), ("--steps", a.steps),
                    ("--block-size", a.block_size), ("--repeats", a.repeats)):
        if v < 1:
            p.error(f"{name}: expected >= 1, got {v}")
    dev = jax.devices()[0]
    print(f"device {dev.platform} ({dev.device_kind}), jax {jax.__version__}")
    ok = True
    if a.check == "auto":
        ref = find_reference(a.reference)
        if ref is None:
            print(f"no recorded reference ({FIXTURE_NAME} not found here; pass --reference): check skipped")
        else:
            ok = check(ref, [i for i in impls if i != "off"] or ["kernel", "xla"],
                       [s for s in a.check_layouts.split(",") if s])
    timing(a.model, impls, a.layout, a.batch, a.prompt_len, a.steps, jnp.dtype(a.dtype), a.repeats, a.unroll,
           a.block_size)
    raise SystemExit(0 if ok else 1)
