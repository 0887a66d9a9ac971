"""Records Hugging Face transformers' greedy generation of the tiny random-weight models into
tests/data/hf_greedy.npz (Llama, Qwen3) and tests/data/hf_greedy_mla.npz (DeepSeek-V3): the
independent references of tests/test_model.py, tests/test_model_mla.py and of the `generate`
command (./scripts/run_demo.sh).

    python tools/record_hf_model.py [--only gqa|mla]   # needs torch + transformers

For each model of jax_rope_cache.decoder.TINY_CONFIGS and decoder_mla.TINY_MLA_CONFIGS: weights
from numpy (`random_params`, the model's seed) loaded into LlamaForCausalLM / Qwen3ForCausalLM /
DeepseekV3ForCausalLM (eager attention, float32), and for
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
FIXTURE_MLA = os.path.join(ROOT, "tests", "data", "hf_greedy_mla.npz")
ROUTER_MARGIN = 1e-4  # least gap at a routing decision (MoE models): ours differ from transformers' by ~1e-6
PROMPT_LENGTHS = (1, 6, 16, 21)  # one token, a short prompt, exactly one 16-token block, across blocks
NEW_TOKENS = 33                  # 1 from the prefill + 32 decode steps
PROMPT_SEED = 7


def make_prompts(vocab: int, lengths=PROMPT_LENGTHS, seed: int = PROMPT_SEED) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(0, vocab, n)] for n in lengths]


def families():
    """{fixture path: (tiny configs, seeds)}."""
    from jax_rope_cache import decoder, decoder_mla

    return {FIXTURE: (decoder.TINY_CONFIGS, decoder.TINY_SEEDS),
            FIXTURE_MLA: (decoder_mla.TINY_MLA_CONFIGS, decoder_mla.TINY_MLA_SEEDS)}


def model_config(config: dict):
    """(our config dataclass, hf_state_dict) of a config dict's model family."""
    from jax_rope_cache import decoder, decoder_mla

    if config.get("model_type") == "deepseek_v3":
        return decoder_mla.MlaDecoderConfig.from_hf(config), decoder_mla.hf_state_dict
    return decoder.DecoderConfig.from_hf(config), decoder.hf_state_dict


def hf_model(config: dict, params: dict):
    """The transformers model of `config` holding `params` (float32, eval mode, eager attention)."""
    import torch
    import transformers

    cfg, hf_state_dict = model_config(config)
    cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
           "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
           "deepseek_v3": (transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM)}[cfg.model_type]
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


def hf_greedy(config: dict, params: dict, prompts, new_tokens: int = NEW_TOKENS, router_inputs=None):
    """(tokens [B, new_tokens] int32, logits [B, new_tokens, V] float32) from transformers.
    `router_inputs`: a list that receives (router, its input [N, H]) of every MoE router call."""
    import torch

    model = hf_model(config, params)
    toks, logits = [], []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: more threads only contend (30 s instead of 0.6 s on 2 busy cores)
    hooks = []
    if router_inputs is not None:
        for m in model.modules():
            if type(m).__name__.endswith("TopkRouter"):
                hooks.append(m.register_forward_hook(
                    lambda mod, args, out: router_inputs.append((mod, args[0].reshape(-1, args[0].shape[-1])))))
    try:
        _greedy_loop(model, prompts, new_tokens, toks, logits)
    finally:
        torch.set_num_threads(threads)
        for h in hooks:
            h.remove()
    return np.asarray(toks, np.int32), np.stack(logits).astype(np.float32)


def router_margin(router_inputs) -> float:
    """The least gap, over every routed token, between what a router chose and what it did not:
    the topk_group-th best group's score vs the next, and the top_k-th allowed expert's vs the next
    (DeepSeek-V3's rule). A tiny gap would let a rounding difference pick another expert."""
    import torch

    gaps = [np.inf]
    with torch.no_grad():
        for mod, x in router_inputs:
            scores = torch.sigmoid(x.float() @ mod.weight.float().T)
            choice = (scores + mod.e_score_correction_bias).numpy().astype(np.float64)
            n, e = choice.shape
            grouped = np.sort(choice.reshape(n, mod.num_group, e // mod.num_group), -1)
            group_score = np.sort(grouped[..., -2:].sum(-1), -1)[:, ::-1]
            if mod.topk_group < mod.num_group:
                gaps.append((group_score[:, mod.topk_group - 1] - group_score[:, mod.topk_group]).min())
            best = np.argsort(-grouped[..., -2:].sum(-1), -1)[:, :mod.topk_group]
            allowed = np.zeros((n, mod.num_group), bool)
            np.put_along_axis(allowed, best, True, 1)
            kept = np.sort(np.where(np.repeat(allowed, e // mod.num_group, 1), choice, -np.inf), -1)[:, ::-1]
            if mod.top_k < kept.shape[1] and np.isfinite(kept[:, mod.top_k]).all():
                gaps.append((kept[:, mod.top_k - 1] - kept[:, mod.top_k]).min())
    return float(min(gaps))


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


def record(out: str, configs: dict, seeds: dict) -> dict:
    import torch
    import transformers

    from jax_rope_cache.decoder import HF_LOGIT_BOUND, params_digest, random_params

    data = {"meta": np.array(json.dumps({"torch": torch.__version__, "transformers": transformers.__version__,
                                         "numpy": np.__version__, "new_tokens": NEW_TOKENS}))}
    for name, config in configs.items():
        cfg, _ = model_config(config)
        params = random_params(cfg, seeds[name])
        prompts = make_prompts(cfg.vocab_size)
        routed = []
        tokens, logits = hf_greedy(config, params, prompts, router_inputs=routed)
        margin = top2_margin(logits)
        if margin < 10 * HF_LOGIT_BOUND:  # else equal greedy tokens could be luck (or fail by rounding)
            raise SystemExit(f"{name}: a top-2 logit margin of {margin:.2e} < 10 x {HF_LOGIT_BOUND}: "
                             f"pick another seed")
        routing = router_margin(routed)
        if routing < ROUTER_MARGIN:
            raise SystemExit(f"{name}: a routing decision with a gap of {routing:.2e} < {ROUTER_MARGIN}: pick another seed")
        padded = np.full((len(prompts), max(PROMPT_LENGTHS)), -1, np.int32)
        for i, p in enumerate(prompts):
            padded[i, : len(p)] = p
        data |= {f"{name}/config": np.array(json.dumps(config, sort_keys=True)),
                 f"{name}/seed": np.int64(seeds[name]), f"{name}/digest": np.array(params_digest(params)),
                 f"{name}/prompts": padded, f"{name}/lengths": np.array(PROMPT_LENGTHS, np.int32),
                 f"{name}/tokens": tokens, f"{name}/logits": logits}
        print(f"{name}: seed {seeds[name]}, prompts {list(PROMPT_LENGTHS)}, {NEW_TOKENS} tokens each, "
              f"min top-2 margin {margin:.3f}, |logit| max {np.abs(logits).max():.2f}"
              + (f", least routing gap {routing:.2e} over {sum(len(x) for _, x in routed)} routed tokens"
                 if routed else ""))
        for p, t in zip(prompts, tokens):
            print(f"  prompt[{len(p)}] -> {t.tolist()}")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    np.savez_compressed(out, **data)
    print(f"wrote {out} ({os.path.getsize(out) / 1024:.0f} KiB)")
    return data


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", choices=("gqa", "mla"), default=None,
                   help=f"record one fixture: gqa ({os.path.relpath(FIXTURE, ROOT)}) or mla "
                        f"({os.path.relpath(FIXTURE_MLA, ROOT)}); default both")
    a = p.parse_args(argv)
    for path, (configs, seeds) in families().items():
        if a.only is None or (path == FIXTURE_MLA) == (a.only == "mla"):
            record(path, configs, seeds)


if __name__ == "__main__":
    sys.exit(main())
