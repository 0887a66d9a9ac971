"""THE model list: Hugging Face-style configs of real models, a tiny test shape, and the
tensor-parallel degrees benchmarks and tests use (numpy only).

`PRESETS` maps a model name to the fields of its public config.json that RoPE and the KV cache need
(heads, KV heads, head_dim, RoPE settings, max_position_embeddings); `MROPE_PRESETS` the same for
vision-language models (multimodal RoPE), `MLA_PRESETS` for MLA models. `MODELS` is every named
shape of `rope_and_cache` (the PRESETS and MROPE_PRESETS per-shard shapes at TP 1, plus "tiny");
`model_shape(name, tp)` splits one over tp shards (models/config.py: `shard_shape`). `PRESET_GROUPS`
is what `info`, `compile --help` and the README list.
"""

from __future__ import annotations

import copy
import dataclasses

import numpy as np

from jax_rope_cache.models.config import (LayerPlan, MlaShape, ModelShape, family_options, hf_rope_settings,
                                         layer_plan, mla_shard_shape, rope_tables_from_hf_config, shard_shape)

__all__ = ["PRESETS", "MROPE_PRESETS", "MLA_PRESETS", "FAMILY_PRESETS", "MODELS", "PRESET_GROUPS", "TP_DEGREES",
           "QK_NORM_MODEL_TYPES", "preset_config", "preset_shape", "preset_tables", "preset_qk_norm_eps", "preset_mrope",
           "model_shape", "mla_shape", "preset_layers", "preset_family_options"]

TP_DEGREES = (1, 2, 4, 8)
# Model types that normalise q and k per head (RMSNorm over head_dim) before RoPE: the op's
# q_norm_weight / k_norm_weight, with the config's rms_norm_eps.
QK_NORM_MODEL_TYPES = ("qwen3", "qwen3_moe")

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
        "rope_scaling": None, "rms_norm_eps": 1e-6,
    },
    "qwen3-235b-a22b": {
        "model_type": "qwen3_moe", "hidden_size": 4096, "num_hidden_layers": 94, "num_attention_heads": 64,
        "num_key_value_heads": 4, "head_dim": 128, "max_position_embeddings": 40960, "rope_theta": 1000000,
        "rope_scaling": None, "rms_norm_eps": 1e-6,
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


# Vision-language models (multimodal RoPE, positions [3, T]): the language model's config fields
# (their config.json's text_config, or its top level for Qwen2.5-VL). rope_tables_from_hf_config
# returns the sections in info.mrope_section / info.mrope_interleaved (info.op_options()).
MROPE_PRESETS: dict[str, dict] = {
    "qwen2.5-vl-7b": {
        "model_type": "qwen2_5_vl", "hidden_size": 3584, "num_hidden_layers": 28, "num_attention_heads": 28,
        "num_key_value_heads": 4, "max_position_embeddings": 128000, "rope_theta": 1000000.0,
        "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]}, "rms_norm_eps": 1e-6,
    },
    "qwen3-vl-8b": {
        "model_type": "qwen3_vl_text", "hidden_size": 4096, "num_hidden_layers": 36, "num_attention_heads": 32,
        "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 262144, "rope_theta": 5000000,
        "rope_scaling": {"rope_type": "default", "mrope_section": [24, 20, 20], "mrope_interleaved": True},
        "rms_norm_eps": 1e-6,
    },
    "qwen3-vl-235b-a22b": {
        "model_type": "qwen3_vl_moe_text", "hidden_size": 4096, "num_hidden_layers": 94, "num_attention_heads": 64,
        "num_key_value_heads": 4, "head_dim": 128, "max_position_embeddings": 262144, "rope_theta": 5000000,
        "rope_scaling": {"rope_type": "default", "mrope_section": [24, 20, 20], "mrope_interleaved": True},
        "rms_norm_eps": 1e-6,
    },
}
# Vision-language model types with Qwen3's QK-RMSNorm (q_norm_weight / k_norm_weight).
MROPE_QK_NORM_MODEL_TYPES = ("qwen3_vl_text", "qwen3_vl_moe_text")


# MLA models (mla_rope_and_cache): values from the models' public config.json files. DeepSeek-R1 has
# DeepSeek-V3's attention and RoPE. Their shapes come from `mla_shape` (query heads split, the one
# latent row replicated on every shard), not from MODELS.
MLA_PRESETS: dict[str, dict] = {
    "deepseek-v3": {
        "model_type": "deepseek_v3", "hidden_size": 7168, "num_hidden_layers": 61, "num_attention_heads": 128,
        "num_key_value_heads": 128, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64, "v_head_dim": 128, "max_position_embeddings": 163840, "rope_theta": 10000,
        "rope_scaling": {"type": "yarn", "factor": 40, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
                         "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096},
    },
    "kimi-k2": {
        "model_type": "kimi_k2", "hidden_size": 7168, "num_hidden_layers": 61, "num_attention_heads": 64,
        "num_key_value_heads": 64, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64, "v_head_dim": 128, "max_position_embeddings": 131072, "rope_theta": 50000.0,
        "rope_scaling": {"type": "yarn", "factor": 32.0, "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0,
                         "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096},
    },
}


# The model families of docs/models.md (values from their public config.json files; Llama 4 and Gemma 3:
# the text_config). Each needs options of the op the native kernels do not implement yet (NoPE layers,
# the Gemma / weightless norms, Llama 4's temperature, gated q rows: contract.FEATURES), so they are not
# in MODELS (the kernel benchmarks, demo and compile); `preset_layers` gives the per-layer plan and
# `preset_family_options` the op options.
_LLAMA4_TEXT = {"model_type": "llama4_text", "hidden_size": 5120, "num_hidden_layers": 48, "num_attention_heads": 40,
                "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 8192, "intermediate_size_mlp": 16384,
                "vocab_size": 202048, "rope_theta": 500000.0, "attention_chunk_size": 8192,
                "attn_temperature_tuning": 4, "floor_scale": 8192, "attn_scale": 0.1, "rms_norm_eps": 1e-5}
_GEMMA3_TEXT = {"model_type": "gemma3_text", "vocab_size": 262208, "max_position_embeddings": 131072,
                "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
                "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "sliding_window": 1024,
                "sliding_window_pattern": 6, "rms_norm_eps": 1e-6}
FAMILY_PRESETS: dict[str, dict] = {
    "llama-4-scout": {**_LLAMA4_TEXT, "max_position_embeddings": 10485760, "num_local_experts": 16,
                      "interleave_moe_layer_step": 1, "use_qk_norm": True,
                      "rope_scaling": {"rope_type": "llama3", "factor": 16.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 1.0, "original_max_position_embeddings": 8192}},
    "llama-4-maverick": {**_LLAMA4_TEXT, "max_position_embeddings": 1048576, "num_local_experts": 128,
                         "interleave_moe_layer_step": 2, "use_qk_norm": False, "rope_scaling": None},
    "gemma-3-4b": {**_GEMMA3_TEXT, "hidden_size": 2560, "intermediate_size": 10240, "num_hidden_layers": 34,
                   "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "query_pre_attn_scalar": 256},
    "gemma-3-27b": {**_GEMMA3_TEXT, "hidden_size": 5376, "intermediate_size": 21504, "num_hidden_layers": 62,
                    "num_attention_heads": 32, "num_key_value_heads": 16, "head_dim": 128,
                    "query_pre_attn_scalar": 168},
    "qwen3-next-80b-a3b": {
        "model_type": "qwen3_next", "hidden_size": 2048, "num_hidden_layers": 48, "num_attention_heads": 16,
        "num_key_value_heads": 2, "head_dim": 256, "partial_rotary_factor": 0.25, "rope_theta": 10000000,
        "max_position_embeddings": 262144, "full_attention_interval": 4, "rms_norm_eps": 1e-6, "vocab_size": 151936,
    },
    "glm-4.5": {
        "model_type": "glm4_moe", "hidden_size": 5120, "num_hidden_layers": 92, "num_attention_heads": 96,
        "num_key_value_heads": 8, "head_dim": 128, "partial_rotary_factor": 0.5, "rope_theta": 1000000,
        "max_position_embeddings": 131072, "use_qk_norm": True, "rms_norm_eps": 1e-5, "vocab_size": 151552,
        "rope_scaling": None,
    },
    "smollm3-3b": {
        "model_type": "smollm3", "hidden_size": 2048, "num_hidden_layers": 36, "num_attention_heads": 16,
        "num_key_value_heads": 4, "max_position_embeddings": 65536, "rope_theta": 5000000.0,
        "no_rope_layers": [1, 1, 1, 0] * 9, "rms_norm_eps": 1e-6, "vocab_size": 128256, "tie_word_embeddings": True,
        "rope_scaling": None,
    },
}


# Every preset by the op it drives, in listing order: the one list `info`, `compile --help` and the
# README show.
PRESET_GROUPS: dict[str, tuple[str, ...]] = {
    "rope_and_cache": tuple(sorted(PRESETS)),
    "rope_and_cache (M-RoPE)": tuple(sorted(MROPE_PRESETS)),
    "mla_rope_and_cache": tuple(sorted(MLA_PRESETS)),
    "rope_and_cache (model families)": tuple(sorted(FAMILY_PRESETS)),
}


def preset_config(name: str) -> dict:
    """A copy of the preset's config dict (case-insensitive name; PRESETS, MROPE_PRESETS, MLA_PRESETS or
    FAMILY_PRESETS)."""
    key = str(name).lower()
    for table in (PRESETS, MROPE_PRESETS, MLA_PRESETS, FAMILY_PRESETS):
        if key in table:
            return copy.deepcopy(table[key])
    raise ValueError(f"name: expected one of {[n for names in PRESET_GROUPS.values() for n in names]}, got {name!r}")


def preset_mrope(name: str) -> tuple[tuple[int, int, int], bool] | None:
    """(mrope_section, mrope_interleaved) of a multimodal-RoPE preset, None for the others."""
    key = str(name).lower()
    if key not in MROPE_PRESETS:
        return None
    settings = hf_rope_settings(MROPE_PRESETS[key])
    return tuple(settings["mrope_section"]), bool(settings["mrope_interleaved"])


def mla_shape(name: str, tp: int = 1) -> MlaShape:
    """Per-shard MLA shape of an MLA preset at tp (e.g. mla_shape("deepseek-v3", 8): 16 query heads,
    Dn 128 (512 absorbed), Dr 64, Dc 512)."""
    key = str(name).lower()
    if key not in MLA_PRESETS:
        raise ValueError(f"name: expected one of {sorted(MLA_PRESETS)}, got {name!r}")
    return mla_shard_shape(preset_config(key), tp, name=key)


def preset_shape(name: str, tp: int = 1) -> ModelShape:
    """Per-shard shape of a preset at tp (e.g. preset_shape("llama-3.1-70b", 8): 8 q heads, 1 KV head)."""
    return shard_shape(preset_config(name), tp, name=str(name).lower())


def preset_qk_norm_eps(name: str) -> float | None:
    """The QK-RMSNorm epsilon of a preset (its config's rms_norm_eps), or None for a model without
    the norm (or the "tiny" shape)."""
    key = str(name).lower()
    if key not in PRESETS and key not in MROPE_PRESETS:
        return None
    cfg = PRESETS.get(key) or MROPE_PRESETS[key]
    norm_types = QK_NORM_MODEL_TYPES + MROPE_QK_NORM_MODEL_TYPES
    return float(cfg["rms_norm_eps"]) if cfg.get("model_type") in norm_types else None


def preset_tables(name: str, max_pos=None, *, tp: int = 1, dtype=np.float32, form="half"):
    """(cos, sin, RopeInfo) of a preset; info.shape is the per-shard shape at tp."""
    cfg = preset_config(name)
    cos, sin, info = rope_tables_from_hf_config(cfg, max_pos=max_pos, tp=1, dtype=dtype, form=form)
    return cos, sin, dataclasses.replace(info, shape=shard_shape(cfg, tp, name=str(name).lower()))


# Shapes with no config of their own (a small one for tests and CPU demos).
_EXTRA_SHAPES = (ModelShape("tiny", 8, 2, 64, 64),)
MODELS: dict[str, ModelShape] = ({name: preset_shape(name) for name in PRESETS}
                                 | {name: preset_shape(name) for name in MROPE_PRESETS}
                                 | {m.name: m for m in _EXTRA_SHAPES})


def model_shape(name: str, tp: int = 1) -> ModelShape:
    """The per-shard shape of model `name` at tensor-parallel degree `tp`: query heads split evenly,
    KV heads split while there are enough and replicated (one per shard) beyond that."""
    if name not in MODELS:
        raise ValueError(f"preset: expected one of {sorted(MODELS)}, got {name!r}")
    if name in PRESETS or name in MROPE_PRESETS:
        return preset_shape(name, tp)
    m = MODELS[name]
    if isinstance(tp, bool) or not isinstance(tp, (int, np.integer)) or tp < 1 or m.q_heads % tp or (
            m.kv_heads >= tp and m.kv_heads % tp):
        raise ValueError(f"tp: expected a divisor of {m.q_heads} query heads and {m.kv_heads} KV heads, got {tp}")
    return dataclasses.replace(m, name=f"{m.name}-tp{tp}" if tp > 1 else m.name, q_heads=m.q_heads // tp,
                               kv_heads=max(1, m.kv_heads // tp))


def preset_layers(name: str) -> tuple[LayerPlan, ...]:
    """Per layer of a preset: whether it rotates, which tables (global / local) and which attention
    (config.layer_plan): e.g. Llama 4 Scout's every fourth layer NoPE with full attention, the others
    chunked; Gemma 3's every sixth layer global, the others sliding with the local tables."""
    return layer_plan(preset_config(name))


def preset_family_options(name: str) -> dict:
    """The rope_and_cache options of a preset's family besides the tables (config.family_options)."""
    return family_options(preset_config(name))
