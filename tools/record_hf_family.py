"""Regenerates tests/data/hf_family_rope.npz: for every preset of models/presets.FAMILY_PRESETS, what
transformers' own modules say about RoPE and the layers (needs torch + transformers, not jax):

  <preset>:<layer type>:inv_freq, :attention   the model's rotary embedding module (Gemma 3: both
                                               layer types, its {type}_inv_freq buffers)
  <preset>:rope_layers                         per layer, 1 where the attention module rotates
  <preset>:layer_types                         the config's layer_types after transformers' defaults

    python tools/record_hf_family.py [--out tests/data/hf_family_rope.npz]
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

from jax_rope_cache.models import presets  # noqa: E402  (numpy only: no jax needed here)

# model_type -> (module, config class, rotary class, attention class)
CLASSES = {
    "llama4_text": ("llama4", "Llama4TextConfig", "Llama4TextRotaryEmbedding", "Llama4TextAttention"),
    "gemma3_text": ("gemma3", "Gemma3TextConfig", "Gemma3RotaryEmbedding", "Gemma3Attention"),
    "qwen3_next": ("qwen3_next", "Qwen3NextConfig", "Qwen3NextRotaryEmbedding", None),
    "glm4_moe": ("glm4_moe", "Glm4MoeConfig", "Glm4MoeRotaryEmbedding", None),
    "smollm3": ("smollm3", "SmolLM3Config", "SmolLM3RotaryEmbedding", "SmolLM3Attention"),
}


def hf_config(cfg: dict):
    import importlib

    module, config_cls, _, _ = CLASSES[cfg["model_type"]]
    conf = importlib.import_module(f"transformers.models.{module}.configuration_{module}")
    kwargs = {k: v for k, v in cfg.items() if k != "model_type"}
    if "attn_temperature_tuning" in kwargs:  # Llama 4's config.json says 4; transformers' config wants a bool
        kwargs["attn_temperature_tuning"] = bool(kwargs["attn_temperature_tuning"])
    return getattr(conf, config_cls)(**kwargs)


def record(name: str) -> dict:
    import importlib

    cfg = presets.preset_config(name)
    module, _, rotary_cls, attn_cls = CLASSES[cfg["model_type"]]
    modeling = importlib.import_module(f"transformers.models.{module}.modeling_{module}")
    config = hf_config(cfg)
    rot = getattr(modeling, rotary_cls)(config)
    out = {}
    if cfg["model_type"] == "gemma3_text":
        for lt in ("full_attention", "sliding_attention"):
            out[f"{name}:{lt}:inv_freq"] = getattr(rot, f"{lt}_inv_freq").double().numpy()
            out[f"{name}:{lt}:attention"] = np.array(float(getattr(rot, f"{lt}_attention_scaling")))
    else:
        out[f"{name}:full_attention:inv_freq"] = rot.inv_freq.double().numpy()
        out[f"{name}:full_attention:attention"] = np.array(float(rot.attention_scaling))
    types = getattr(config, "layer_types", None)
    out[f"{name}:layer_types"] = np.array(list(types) if types else ["full_attention"] * config.num_hidden_layers)
    if attn_cls is not None and hasattr(config, "no_rope_layers"):
        rope = [int(bool(getattr(modeling, attn_cls)(config, i).use_rope)) for i in range(config.num_hidden_layers)]
    else:
        rope = [1] * config.num_hidden_layers
    out[f"{name}:rope_layers"] = np.array(rope, np.int32)
    return out


def main(argv=None):
    import torch
    import transformers

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.path.join(ROOT, "tests", "data", "hf_family_rope.npz"))
    args = p.parse_args(argv)
    out = {"transformers_version": np.array(transformers.__version__), "torch_version": np.array(torch.__version__)}
    for name in sorted(presets.FAMILY_PRESETS):
        out.update(record(name))
    np.savez_compressed(args.out, **out)
    print(f"wrote {args.out}: {len(out) - 2} arrays, transformers {transformers.__version__}")


if __name__ == "__main__":
    main()
