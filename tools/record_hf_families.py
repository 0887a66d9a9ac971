"""Records transformers' greedy generation of the tiny Gemma 3 and Llama 4 (text) models of
jax_rope_cache/decoder_families.py into tests/data/hf_greedy_families.npz: the reference of
tests/test_model_families.py and of `generate --model tiny-gemma-3 / tiny-llama-4 / tiny-llama-4-maverick`.

    python tools/record_hf_families.py                       # needs jax (this package) + torch + transformers
    python tools/record_hf_families.py --stage export --weights W.npz   # the jax side alone (Python >= 3.12)
    python tools/record_hf_families.py --stage record --weights W.npz   # the torch side alone (numpy only)
    ... --models tiny-llama-4-maverick    # (both stages) only these; the fixture's other models kept as stored

The two stages let a machine whose torch and jax need different Pythons record it: `export` draws the
weights (decoder.random_params with the model's seed) and writes them under transformers' names with
the configs and prompts; `record` loads them into Gemma3ForCausalLM / Llama4ForCausalLM (float32, eager
attention) and, for each prompt, NEW_TOKENS greedy tokens, each from a full forward pass over the whole
sequence so far (no KV cache on that side). Stored per model as tools/record_hf_model.py stores its
models (decoder.load_hf_reference reads both), plus, for Llama 4, the layers transformers built with
the MoE block (`<name>/moe_layers`). A tiny top-2 logit gap or router gap is refused (pick another
seed): equal tokens must not be luck. With --models the other models' arrays are copied unchanged,
and only into a fixture whose recorded versions (meta) are the running ones.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
FIXTURE = os.path.join(ROOT, "tests", "data", "hf_greedy_families.npz")

from record_hf_model import NEW_TOKENS, PROMPT_LENGTHS, ROUTER_MARGIN, make_prompts, top2_margin  # noqa: E402


def export(path: str, models=None) -> None:
    """The jax side: configs, seeds, weight digests, prompts and the weights under transformers' names."""
    from jax_rope_cache import decoder, decoder_families as fam

    out = {"bound": np.float64(decoder.HF_LOGIT_BOUND)}
    for name, config in fam.TINY_FAMILY_CONFIGS.items():
        if models is not None and name not in models:
            continue
        cfg = fam.FamilyDecoderConfig.from_hf(config)
        params = decoder.random_params(cfg, fam.TINY_FAMILY_SEEDS[name])
        out[f"{name}/config"] = np.array(json.dumps(config, sort_keys=True))
        out[f"{name}/seed"] = np.int64(fam.TINY_FAMILY_SEEDS[name])
        out[f"{name}/digest"] = np.array(decoder.params_digest(params))
        out[f"{name}/vocab"] = np.int64(cfg.vocab_size)
        for k, v in fam.hf_state_dict(cfg, params).items():
            out[f"{name}/sd/{k}"] = np.asarray(v, np.float32)
    np.savez(path, **out)


def hf_model(config: dict, state: dict):
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig, Llama4ForCausalLM, Llama4TextConfig

    kwargs = {k: v for k, v in config.items() if k not in ("model_type", "architectures")}
    cls = {"gemma3_text": (Gemma3TextConfig, Gemma3ForCausalLM),
           "llama4_text": (Llama4TextConfig, Llama4ForCausalLM)}[config["model_type"]]
    hf_cfg = cls[0](**kwargs)
    hf_cfg._attn_implementation = "eager"
    model = cls[1](hf_cfg).to(torch.float32).eval()
    missing, unexpected = model.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in state.items()},
                                                strict=False)
    tied = config.get("tie_word_embeddings", False)
    missing = [m for m in missing if not (tied and m == "lm_head.weight")]
    if missing or unexpected:
        raise RuntimeError(f"state dict mismatch: missing {missing}, unexpected {unexpected}")
    return model


def record(weights: str, out: str, models=None) -> None:
    """The torch side: transformers' greedy tokens and logits of every exported model (of `models`)."""
    import torch
    import transformers

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from record_hf_model import _greedy_loop

    w = np.load(weights)
    bound = float(w["bound"])
    names = sorted({k.split("/")[0] for k in w.files if "/" in k and (not models or k.split("/")[0] in models)})
    data = {"meta": np.array(json.dumps({"torch": torch.__version__, "transformers": transformers.__version__,
                                         "numpy": np.__version__, "new_tokens": NEW_TOKENS}))}
    if models:
        data = kept(out, names, data["meta"])
    torch.set_num_threads(1)
    for name in names:
        config = json.loads(str(w[f"{name}/config"]))
        state = {k[len(f"{name}/sd/"):]: w[k] for k in w.files if k.startswith(f"{name}/sd/")}
        model = hf_model(config, state)
        gaps = [np.inf]
        hooks = [m.register_forward_hook(lambda mod, args, res: gaps.append(float(
            (lambda s: (s[:, -mod.top_k] - s[:, -mod.top_k - 1]).min())(np.sort(res[1].float().numpy(), -1)))))
            for m in model.modules() if type(m).__name__ == "Llama4Router"]
        prompts = make_prompts(int(w[f"{name}/vocab"]))
        toks, logits = [], []
        _greedy_loop(model, prompts, NEW_TOKENS, toks, logits)
        for h in hooks:
            h.remove()
        tokens, logits = np.asarray(toks, np.int32), np.stack(logits).astype(np.float32)
        margin = top2_margin(logits)
        if margin < 10 * bound:
            raise SystemExit(f"{name}: a top-2 logit margin of {margin:.2e} < 10 x {bound}: pick another seed")
        if min(gaps) < ROUTER_MARGIN:
            raise SystemExit(f"{name}: a routing decision with a gap of {min(gaps):.2e}: pick another seed")
        padded = np.full((len(prompts), max(PROMPT_LENGTHS)), -1, np.int32)
        for i, p in enumerate(prompts):
            padded[i, : len(p)] = p
        data |= {f"{name}/config": w[f"{name}/config"], f"{name}/seed": w[f"{name}/seed"],
                 f"{name}/digest": w[f"{name}/digest"], f"{name}/prompts": padded,
                 f"{name}/lengths": np.array(PROMPT_LENGTHS, np.int32), f"{name}/tokens": tokens,
                 f"{name}/logits": logits}
        if config["model_type"] == "llama4_text":
            data[f"{name}/moe_layers"] = np.array([i for i, lay in enumerate(model.model.layers) if lay.is_moe_layer],
                                                  np.int32)
        print(f"{name}: prompts {list(PROMPT_LENGTHS)}, {NEW_TOKENS} tokens each, min top-2 margin {margin:.3f}, "
              f"|logit| max {np.abs(logits).max():.2f}" + (f", least router gap {min(gaps):.2e}" if len(gaps) > 1 else ""))
    os.makedirs(os.path.dirname(out), exist_ok=True)
    np.savez_compressed(out, **data)
    print(f"wrote {out} ({os.path.getsize(out) / 1024:.0f} KiB)")


def kept(out: str, names, meta) -> dict:
    """The stored fixture's arrays of every model not in `names` (and its meta), refused unless that meta
    is the running one: one fixture, one recording setup."""
    with np.load(out) as f:
        old = {k: f[k] for k in f.files}
    if str(old["meta"]) != str(meta):
        raise SystemExit(f"{out} was recorded with {old['meta']}, this is {meta}: record every model (no --models)")
    return {k: v for k, v in old.items() if k.split("/")[0] not in names}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stage", choices=("both", "export", "record"), default="both")
    p.add_argument("--weights", default=None, help="the exported weights (export writes, record reads)")
    p.add_argument("--out", default=FIXTURE)
    p.add_argument("--models", default=None, help="comma list: record only these, keep the others as stored")
    a = p.parse_args(argv)
    models = a.models.split(",") if a.models else None
    weights = a.weights or os.path.join(tempfile.mkdtemp(), "families_weights.npz")
    if a.stage in ("both", "export"):
        export(weights, models)
    if a.stage in ("both", "record"):
        record(weights, a.out, models)


if __name__ == "__main__":
    main()
