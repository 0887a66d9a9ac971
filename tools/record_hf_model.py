"""Records Hugging Face transformers' greedy generation of the tiny random-weight models into
tests/data/hf_greedy.npz: the independent reference of tests/test_model.py and of the
`generate` command (./scripts/run_demo.sh).

    python tools/record_hf_model.py [--out tests/data/hf_greedy.npz]   # needs torch + transformers

For each model of jax_rope_cache.decoder.TINY_CONFIGS: weights from numpy (`random_params`,
seed below) loaded into LlamaForCausalLM / Qwen3ForCausalLM (eager attention, float32), and for
each prompt NEW_TOKENS greedy tokens, every one from a full forward pass over the whole sequence
so far (no KV cache on this side at all). Stored per model, under "<name>/...": the config (JSON),
seed, weight digest (sha256, so a changed initialiser is caught instead of compared), prompts,
generated tokens and the float32 logits of every generated token.

The test imports `hf_greedy` from here to redo the comparison live when torch and transformers
are importable.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURE = os.path.join(ROOT, "tests", "data", "hf_greedy.npz")
PROMPT_LENGTHS = (1, 6, 16, 21)  # one token, a short prompt, exactly one 16-token block, across blocks
NEW_TOKENS = 33                  # 1 from the prefill + 32 decode steps
PROMPT_SEED = 7


def make_prompts(vocab: int, lengths=PROMPT_LENGTHS, seed: int = PROMPT_SEED) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(0, vocab, n)] for n in lengths]


def hf_model(config: dict, params: dict):
    """The transformers model of `config` holding `params` (float32, eval mode, eager attention)."""
    import torch
    import transformers

    from jax_rope_cache.decoder import DecoderConfig, hf_state_dict

    cfg = DecoderConfig.from_hf(config)
    cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
           "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM)}[cfg.model_type]
    # a deep copy: transformers' config classes edit nested dicts in place (rope_theta goes into rope_scaling)
    hf_cfg = cls[0](**copy.deepcopy({k: v for k, v in config.items() if k not in ("model_type", "architectures")}))
    hf_cfg._attn_implementation = "eager"
    model = cls[1](hf_cfg).to(torch.float32).eval()
    state = {k: torch.from_numpy(np.asarray(v, np.float32).copy()) for k, v in hf_state_dict(cfg, params).items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    # a tied lm_head is the embedding itself; nothing else may be left out or left over
    missing = [m for m in missing if not (cfg.tie_word_embeddings and m == "lm_head.weight")]
    if missing or unexpected:
        raise RuntimeError(f"state dict mismatch: missing {missing}, unexpected {unexpected}")
    if cfg.tie_word_embeddings:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    return model


def hf_greedy(config: dict, params: dict, prompts, new_tokens: int = NEW_TOKENS):
    """(tokens [B, new_tokens] int32, logits [B, new_tokens, V] float32) from transformers."""
    import torch

    model = hf_model(config, params)
    toks, logits = [], []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: more threads only contend (30 s instead of 0.6 s on 2 busy cores)
    try:
        _greedy_loop(model, prompts, new_tokens, toks, logits)
    finally:
        torch.set_num_threads(threads)
    return np.asarray(toks, np.int32), np.stack(logits).astype(np.float32)


def _greedy_loop(model, prompts, new_tokens, toks, logits):
    import torch

    with torch.no_grad():
        for prompt in prompts:
            ids = list(prompt)
            t_seq, l_seq = [], []
            for _ in range(new_tokens):
                out = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1].to(torch.float32)
                nxt = int(torch.argmax(out))
                t_seq.append(nxt)
                l_seq.append(out.numpy().copy())
                ids.append(nxt)
            toks.append(t_seq)
            logits.append(np.stack(l_seq))


def top2_margin(logits: np.ndarray) -> float:
    top = np.sort(logits, axis=-1)[..., -2:]
    return float((top[..., 1] - top[..., 0]).min())


def record(out: str = FIXTURE) -> dict:
    import torch
    import transformers

    from jax_rope_cache.decoder import (HF_LOGIT_BOUND, TINY_CONFIGS, TINY_SEEDS, DecoderConfig, params_digest,
                                            random_params)

    data = {"meta": np.array(json.dumps({"torch": torch.__version__, "transformers": transformers.__version__,
                                         "numpy": np.__version__, "new_tokens": NEW_TOKENS}))}
    for name, config in TINY_CONFIGS.items():
        cfg = DecoderConfig.from_hf(config)
        params = random_params(cfg, TINY_SEEDS[name])
        prompts = make_prompts(cfg.vocab_size)
        tokens, logits = hf_greedy(config, params, prompts)
        margin = top2_margin(logits)
        if margin < 10 * HF_LOGIT_BOUND:  # else equal greedy tokens could be luck (or fail by rounding)
            raise SystemExit(f"{name}: a top-2 logit margin of {margin:.2e} < 10 x {HF_LOGIT_BOUND}: "
                             f"pick another seed in TINY_SEEDS")
        padded = np.full((len(prompts), max(PROMPT_LENGTHS)), -1, np.int32)
        for i, p in enumerate(prompts):
            padded[i, : len(p)] = p
        data |= {f"{name}/config": np.array(json.dumps(config, sort_keys=True)),
                 f"{name}/seed": np.int64(TINY_SEEDS[name]), f"{name}/digest": np.array(params_digest(params)),
                 f"{name}/prompts": padded, f"{name}/lengths": np.array(PROMPT_LENGTHS, np.int32),
                 f"{name}/tokens": tokens, f"{name}/logits": logits}
        print(f"{name}: seed {TINY_SEEDS[name]}, prompts {list(PROMPT_LENGTHS)}, {NEW_TOKENS} tokens each, "
              f"min top-2 margin {margin:.3f}, |logit| max {np.abs(logits).max():.2f}")
        for p, t in zip(prompts, tokens):
            print(f"  prompt[{len(p)}] -> {t.tolist()}")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    np.savez_compressed(out, **data)
    print(f"wrote {out} ({os.path.getsize(out) / 1024:.0f} KiB)")
    return data


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=FIXTURE)
    a = p.parse_args(argv)
    record(a.out)


if __name__ == "__main__":
    sys.exit(main())
