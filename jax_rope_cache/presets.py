"""Hugging Face-style configs of real models, and their per-shard attention shapes (numpy only).

`PRESETS` maps a model name to the fields of its public config.json that RoPE and the KV cache need
(heads, KV heads, head_dim, RoPE settings, max_position_embeddings). Feed one to
`rope_tables_from_hf_config`, or use `preset_tables` / `preset_shape`.

Tensor parallelism (`shard_shape`): query heads are split evenly (num_attention_heads % tp == 0).
KV heads are split evenly while there are at least tp of them (num_key_value_heads % tp == 0); with
fewer KV heads than shards each KV head is replicated on tp / num_key_value_heads shards
(tp % num_key_value_heads == 0), so every shard holds max(1, num_key_value_heads // tp) KV heads —
the rule vLLM and SGLang use.
"""

from __future__ import annotations

import copy
import dataclasses

import numpy as np

from jax_rope_cache import tables as _rt
from jax_rope_cache.shapes import ModelShape

__all__ = ["PRESETS", "TP_DEGREES", "preset_config", "shard_shape", "preset_shape", "preset_tables"]

TP_DEGREES = (1, 2, 4, 8)

_LLAMA_31_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192}

# Values from the models' public config.json files (only the fields that matter here).
PRESETS: dict[str, dict] = {
    "gpt-oss-120b": {
        "model_type": "gpt_oss", "hidden_size": 2880, "num_hidden_layers": 36, "num_attention_heads": 64,
        "num_key_value_heads": 8, "head_dim": 64, "max_position_embeddings": 131072, "rope_theta": 150000,
        "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                         "original_max_position_embeddings": 4096, "truncate": False},
    },
    "qwen3-32b": {
        "model_type": "qwen3", "hidden_size": 5120, "num_hidden_layers": 64, "num_attention_heads": 64,
        "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 40960, "rope_theta": 1000000,
        "rope_scaling": None,
    },
    "qwen3-235b-a22b": {
        "model_type": "qwen3_moe", "hidden_size": 4096, "num_hidden_layers": 94, "num_attention_heads": 64,
        "num_key_value_heads": 4, "head_dim": 128, "max_position_embeddings": 40960, "rope_theta": 1000000,
        "rope_scaling": None,
    },
    "llama-3.1-8b": {
        "model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 8, "max_position_embeddings": 131072, "rope_theta": 500000.0,
        "rope_scaling": dict(_LLAMA_31_ROPE),
    },
    "llama-3.1-70b": {
        "model_type": "llama", "hidden_size": 8192, "num_hidden_layers": 80, "num_attention_heads": 64,
        "num_key_value_heads": 8, "max_position_embeddings": 131072, "rope_theta": 500000.0,
        "rope_scaling": dict(_LLAMA_31_ROPE),
    },
    "llama-3.1-405b": {
        "model_type": "llama", "hidden_size": 16384, "num_hidden_layers": 126, "num_attention_heads": 128,
        "num_key_value_heads": 8, "max_position_embeddings": 131072, "rope_theta": 500000.0,
        "rope_scaling": dict(_LLAMA_31_ROPE),
    },
}


def preset_config(name: str) -> dict:
    """A copy of the preset's config dict (case-insensitive name)."""
    key = str(name).lower()
    if key not in PRESETS:
        raise ValueError(f"name: expected one of {sorted(PRESETS)}, got {name!r}")
    return copy.deepcopy(PRESETS[key])


def _positive_int(config, key: str) -> int:
    v = config.get(key)
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
        raise ValueError(f"config[{key!r}]: expected a positive integer, got {v!r}")
    return int(v)


def shard_shape(config, tp: int = 1, *, name: str | None = None, is_neox: bool | None = None) -> ModelShape:
    """The per-shard `ModelShape` of a config dict at tensor-parallel degree tp (see the module
    docstring for how KV heads are split or replicated)."""
    if isinstance(tp, bool) or not isinstance(tp, (int, np.integer)) or tp < 1:
        raise ValueError(f"tp: expected an integer >= 1, got {tp!r}")
    tp = int(tp)
    settings = _rt.hf_rope_settings(config)
    heads = _positive_int(config, "num_attention_heads")
    kv = _positive_int(config, "num_key_value_heads") if config.get("num_key_value_heads") is not None else heads
    if heads % kv:
        raise ValueError(f"config['num_key_value_heads']: must divide num_attention_heads ({heads}), got {kv}")
    if heads % tp:
        raise ValueError(f"tp: must divide num_attention_heads ({heads}), got {tp}")
    if kv >= tp and kv % tp:
        raise ValueError(f"tp: must divide num_key_value_heads ({kv}) when tp <= {kv}, got {tp}")
    if kv < tp and tp % kv:
        raise ValueError(f"tp: must be a multiple of num_key_value_heads ({kv}) to replicate KV heads, got {tp}")
    if is_neox is None:
        is_neox = config.get("model_type") not in _rt.GPTJ_STYLE_MODEL_TYPES
    if name is None:
        name = str(config.get("_name_or_path") or config.get("model_type") or "model")
    return ModelShape(name if tp == 1 else f"{name}-tp{tp}", heads // tp, max(1, kv // tp),
                      settings["head_dim"], settings["rotary_dim"], bool(is_neox))


def preset_shape(name: str, tp: int = 1) -> ModelShape:
    """Per-shard shape of a preset at tp (e.g. preset_shape("llama-3.1-70b", 8): 8 q heads, 1 KV head)."""
    return shard_shape(preset_config(name), tp, name=str(name).lower())


def preset_tables(name: str, max_pos=None, *, tp: int = 1, dtype=np.float32, form="half"):
    """(cos, sin, RopeInfo) of a preset; info.shape is the per-shard shape at tp."""
    cfg = preset_config(name)
    cos, sin, info = _rt.rope_tables_from_hf_config(cfg, max_pos=max_pos, tp=1, dtype=dtype, form=form)
    return cos, sin, dataclasses.replace(info, shape=shard_shape(cfg, tp, name=str(name).lower()))
