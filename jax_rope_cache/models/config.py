"""What a Hugging Face-style config dict (a model's config.json) says about RoPE and attention
shapes (numpy only): `hf_rope_settings`, `rope_tables_from_hf_config`, and the per-shard
`ModelShape` at a tensor-parallel degree (`shard_shape`).

Tensor parallelism: query heads are split evenly (num_attention_heads % tp == 0). KV heads are
split evenly while there are at least tp of them (num_key_value_heads % tp == 0); with fewer KV
heads than shards each KV head is replicated on tp / num_key_value_heads shards
(tp % num_key_value_heads == 0), so every shard holds max(1, num_key_value_heads // tp) KV heads,
the rule vLLM and SGLang use.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

import numpy as np

from jax_rope_cache.models import tables

__all__ = ["RopeInfo", "ModelShape", "MlaShape", "LayerPlan", "GPTJ_STYLE_MODEL_TYPES", "MLA_MODEL_TYPES",
           "hf_rope_settings", "rope_tables_from_hf_config", "shard_shape", "mla_shard_shape", "mla_softmax_scale",
           "default_is_neox", "layer_plan", "family_options"]

# Keys of a RoPE parameter dict that say how multimodal positions split the frequencies (not a law's).
MROPE_KEYS = {"mrope_section", "mrope_interleaved"}
# Hugging Face model types whose attention rotates interleaved pairs (2i, 2i+1) (GPT-J style).
GPTJ_STYLE_MODEL_TYPES = ("gptj", "codegen", "llama4", "llama4_text")  # Llama 4: complex pairs (2i, 2i+1)
# MLA model types (multi-head latent attention): RoPE covers the decoupled rope dims only
# (qk_rope_head_dim), with interleaved pairs unless the config says rope_interleave = false.
MLA_MODEL_TYPES = ("deepseek_v2", "deepseek_v3", "kimi_k2")


def default_is_neox(config: Mapping) -> bool:
    """The rotation style a config's model uses: GPT-J pairs for GPT-J-style and (interleaved) MLA
    model types, NeoX pairs otherwise."""
    model_type = config.get("model_type")
    if model_type in MLA_MODEL_TYPES:
        return not bool(config.get("rope_interleave", True))
    return model_type not in GPTJ_STYLE_MODEL_TYPES


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """Per-shard attention shape of a model at a tensor-parallel degree."""

    name: str
    q_heads: int
    kv_heads: int
    head_dim: int
    rotary_dim: int
    is_neox: bool = True

    def bytes_per_token(self, in_size=2, table_size=4, cache_size=2, index_size=4, table_full=False) -> int:
        """The fewest bytes one token must move (baselines.md): read q/k/v, table row and two
        indices; write q_out/k_out and one K and one V cache row."""
        qh, kh, d, r = self.q_heads, self.kv_heads, self.head_dim, self.rotary_dim
        width = r if table_full else r // 2
        return ((qh + 2 * kh) * d * in_size + 2 * width * table_size + 2 * index_size
                + (qh + kh) * d * in_size + 2 * kh * d * cache_size)


@dataclasses.dataclass(frozen=True)
class RopeInfo:
    """What a caller needs besides the tables: pass rotary_dim and is_neox to `rope_and_cache`."""

    rope_type: str
    rotary_dim: int
    head_dim: int | None
    is_neox: bool
    base: float
    max_pos: int
    form: str
    attention_scaling: float  # already folded into cos and sin
    scaling: dict | None = None  # the normalised scaling parameters the tables were built with
    shape: object | None = None  # per-shard `ModelShape` at the requested tp (config input only)
    # multimodal RoPE (Qwen2-VL / Qwen2.5-VL sections, Qwen3-VL interleaved): positions are [3, T]
    mrope_section: tuple[int, int, int] | None = None
    mrope_interleaved: bool = False
    # model families: the RoPE layer type these tables are for ("full_attention" / "sliding_attention"
    # where a config has per-type RoPE, Gemma 3), the sliding layers' (cos, sin, RopeInfo) next to the
    # global tables, the per-layer plan (layer_plan) and the op options of the family (family_options)
    layer_type: str | None = None
    local: tuple | None = None
    layers: tuple | None = None
    family: dict | None = None

    def op_options(self) -> dict:
        """The options of `rope_and_cache` these tables need: rotary_dim, is_neox, table_form and,
        for a multimodal model, mrope_section and mrope_interleaved."""
        out = dict(rotary_dim=self.rotary_dim, is_neox=self.is_neox, table_form=self.form)
        if self.mrope_section is not None:
            out.update(mrope_section=self.mrope_section, mrope_interleaved=self.mrope_interleaved)
        return out




def _cfg_int(config: Mapping, key: str, *, required=True):
    v = config.get(key)
    if v is None:
        if required:
            raise ValueError(f"config[{key!r}]: missing")
        return None
    if isinstance(v, bool) or not isinstance(v, (int, np.integer, float)) or not math.isfinite(v) \
            or v != int(v) or v < 1:
        raise ValueError(f"config[{key!r}]: expected a positive integer, got {v!r}")
    return int(v)


def text_config(config: Mapping) -> Mapping:
    """The language model's part of a config: a vision-language config (Qwen2.5-VL, Qwen3-VL) nests
    it under "text_config"; its keys win over the top level's."""
    if isinstance(config, Mapping) and isinstance(config.get("text_config"), Mapping):
        return {**{k: v for k, v in config.items() if k != "text_config"}, **config["text_config"]}
    return config


def _mrope(params: Mapping, key: str, rotary_dim: int):
    """(mrope_section tuple or None, interleaved) of a RoPE parameter dict."""
    section, interleaved = params.get("mrope_section"), params.get("mrope_interleaved", False)
    if not isinstance(interleaved, bool):
        raise ValueError(f"config[{key!r}]['mrope_interleaved']: expected true or false, got {interleaved!r}")
    if section is None:
        if interleaved:
            raise ValueError(f"config[{key!r}]['mrope_section']: missing, and mrope_interleaved is true")
        return None, False
    if not isinstance(section, (list, tuple)) or len(section) != 3 or any(
            isinstance(x, bool) or not isinstance(x, (int, np.integer)) or x < 0 for x in section):
        raise ValueError(f"config[{key!r}]['mrope_section']: expected 3 integers >= 0 (temporal, height, width), "
                         f"got {section!r}")
    if sum(section) != rotary_dim // 2:
        raise ValueError(f"config[{key!r}]['mrope_section']: expected a sum of rotary_dim/2 = {rotary_dim // 2}, "
                         f"got {list(section)} (sum {sum(section)})")
    return tuple(int(x) for x in section), interleaved


def hf_rope_settings(config: Mapping, layer_type: str | None = None) -> dict:
    """Reads the RoPE settings of a Hugging Face-style config dict, as transformers does.

    Returns a dict: rope_type, base, head_dim, rotary_dim, partial_rotary_factor, max_position_embeddings
    (or None), source (the config key the parameters came from) and scaling (the law's parameters, with Hugging Face's defaults filled in: a llama3/yarn/
    longrope original_max_position_embeddings from a top-level key of that name, else from
    max_position_embeddings; a missing yarn/longrope factor from max_position_embeddings /
    original_max_position_embeddings; the dynamic law's original length is max_position_embeddings).

    layer_type: for configs whose RoPE differs per layer type (Gemma 3: rope_parameters
    {"full_attention": {...}, "sliding_attention": {...}}, or the older rope_theta + rope_scaling for
    the global layers and rope_local_base_freq for the sliding ones): "full_attention" (the default)
    or "sliding_attention".
    """
    if not isinstance(config, Mapping):
        raise ValueError(f"config: expected a dict (a model's config.json), got {type(config).__name__}")
    config = text_config(config)
    params = config.get("rope_parameters")
    key = "rope_parameters"
    if params is None:
        params, key = config.get("rope_scaling"), "rope_scaling"
    if params is None:
        params = {}
    if not isinstance(params, Mapping):
        raise ValueError(f"config[{key!r}]: expected a dict or null, got {params!r}")
    layer_type = _check_layer_type(config, layer_type)
    if any(isinstance(v, Mapping) for v in params.values()):  # per layer type (Gemma 3's new form)
        if layer_type not in params or not isinstance(params[layer_type], Mapping):
            raise ValueError(f"config[{key!r}]: expected RoPE parameters for layer type {layer_type!r} among "
                             f"{sorted(params)}")
        params = params[layer_type]
    elif layer_type == "sliding_attention" and _gemma3(config):  # the older form: one base for the local layers
        params = {"rope_theta": config.get("rope_local_base_freq", GEMMA3_LOCAL_THETA)}
    params = dict(params)
    law = params.get("rope_type", params.get("type")) or "default"
    if law == "mrope":  # Qwen2-VL's legacy name of default RoPE with mrope_section (transformers maps it so)
        law = "default"
    if law not in tables.ROPE_TYPES:
        raise ValueError(f"config[{key!r}]['rope_type']: expected one of {tables.ROPE_TYPES}, got {law!r}")

    base = params.get("rope_theta", config.get("rope_theta"))
    if base is None:
        base = GEMMA3_GLOBAL_THETA if _gemma3(config) else tables.DEFAULT_THETA
    if isinstance(base, bool) or not isinstance(base, (int, float)) or not math.isfinite(base) or base <= 1:
        raise ValueError(f"config['rope_theta']: expected a finite number > 1, got {base!r}")

    # MLA configs (DeepSeek-V2/V3, Kimi-K2): RoPE runs on the qk_rope_head_dim decoupled dims (transformers
    # sets the config's head_dim to it)
    head_dim = _cfg_int(config, "qk_rope_head_dim", required=False)
    if head_dim is None:
        head_dim = _cfg_int(config, "head_dim", required=False)
    if head_dim is None:
        hidden = config.get("hidden_size")
        heads = config.get("num_attention_heads")
        if hidden is None or heads is None:
            raise ValueError("config['head_dim']: missing, and hidden_size / num_attention_heads to derive it "
                             "are missing too")
        head_dim = _cfg_int(config, "hidden_size") // _cfg_int(config, "num_attention_heads")
    prf = params.get("partial_rotary_factor", config.get("partial_rotary_factor"))
    if prf is None:
        prf = 1.0
    if isinstance(prf, bool) or not isinstance(prf, (int, float)) or not 0 < prf <= 1:
        raise ValueError(f"config['partial_rotary_factor']: expected a number in (0, 1], got {prf!r}")
    rotary_dim = int(head_dim * prf)
    if rotary_dim < 2 or rotary_dim % 2:
        raise ValueError(f"config['partial_rotary_factor']: head_dim {head_dim} * {prf} gives rotary dimension "
                         f"{rotary_dim}, which must be even and >= 2")
    mpe = _cfg_int(config, "max_position_embeddings", required=False)

    mrope_section, mrope_interleaved = _mrope(params, key, rotary_dim)
    scaling = {k: v for k, v in params.items() if k not in tables.COMMON_KEYS | MROPE_KEYS}
    if law in ("llama3", "yarn", "longrope"):
        top = config.get("original_max_position_embeddings")
        if top is not None:
            scaling["original_max_position_embeddings"] = top  # transformers gives it priority
        elif scaling.get("original_max_position_embeddings") is None:
            if mpe is None:
                raise ValueError(f"config['max_position_embeddings']: missing, and rope_type {law!r} needs it "
                                 f"(or {key}['original_max_position_embeddings'])")
            scaling["original_max_position_embeddings"] = mpe
    if law in ("yarn", "longrope") and scaling.get("factor") is None:
        if mpe is None:
            raise ValueError(f"config[{key!r}]['factor']: missing, and max_position_embeddings to derive it "
                             f"is missing too")
        scaling["factor"] = mpe / float(scaling["original_max_position_embeddings"])
    if law == "dynamic":
        if mpe is None:
            raise ValueError("config['max_position_embeddings']: missing, and rope_type 'dynamic' needs it "
                             "(the length the model was trained for)")
        scaling["original_max_position_embeddings"] = mpe
    scaling = None if law == "default" else {"rope_type": law, **scaling}
    return dict(rope_type=law, base=float(base), head_dim=head_dim, rotary_dim=rotary_dim,
                partial_rotary_factor=float(prf), max_position_embeddings=mpe, scaling=scaling, source=key,
                mrope_section=mrope_section, mrope_interleaved=mrope_interleaved, layer_type=layer_type)


def rope_tables_from_hf_config(config: Mapping, *, max_pos: int | None = None, tp: int = 1, dtype=np.float32,
                               form: str = "half", is_neox: bool | None = None, layer_type: str | None = None):
    """(cos, sin, info) for a Hugging Face-style config dict (a model's config.json).

    Reads rope_theta, rope_scaling or the newer rope_parameters (rope_type / type and the law's keys),
    partial_rotary_factor, head_dim (else hidden_size // num_attention_heads) and
    max_position_embeddings, as transformers does (see `hf_rope_settings`).

    Args:
      config: the config dict.
      max_pos: table rows; default max_position_embeddings, except for the dynamic law, whose default is
        max_position_embeddings * factor (the length the law extends to; at max_position_embeddings the
        dynamic law equals plain RoPE).
      tp: tensor-parallel degree for `info.shape` (per-shard heads, see `shard_shape`); the
        tables themselves are the same on every shard. Ignored for the shape when the config has no
        num_attention_heads.
      dtype, form: as in `rope_tables`.
      is_neox: rotation style; default True (rotate_half: Llama, Qwen, GPT-OSS, ...) except for the
        GPT-J-style model types in GPTJ_STYLE_MODEL_TYPES and the MLA model types (MLA_MODEL_TYPES:
        DeepSeek-V2/V3, Kimi-K2), which rotate interleaved pairs unless rope_interleave is false.
        For MLA configs the rotary dimension is qk_rope_head_dim.

    A vision-language config (Qwen2.5-VL: rope_scaling {"type": "mrope", "mrope_section": [...]};
    Qwen3-VL: text_config.rope_scaling with "mrope_section" and "mrope_interleaved") gives the same
    tables (one row per position) and the sections in info.mrope_section / info.mrope_interleaved.

    Local and global tables (Gemma 3): the layers of type "sliding_attention" use their own base
    (rope_local_base_freq, 10000) and no scaling, the "full_attention" layers rope_theta with the
    config's scaling (linear, factor 8 for Gemma 3 4B / 27B). With layer_type None the tables are the
    global ones and info.local holds (cos, sin, RopeInfo) of the sliding layers; info.layers says
    which layer uses which (layer_plan), info.family the op options of the family (family_options).

    Returns:
      (cos, sin, RopeInfo): pass info.op_options() (rotary_dim, is_neox, table_form and, for a
      multimodal model, mrope_section and mrope_interleaved) to `rope_and_cache`.
    """
    config = text_config(config) if isinstance(config, Mapping) else config
    s = hf_rope_settings(config, layer_type)
    if is_neox is None:
        is_neox = default_is_neox(config)
    if max_pos is None:
        mpe = s["max_position_embeddings"]
        if mpe is None:
            raise ValueError("config['max_position_embeddings']: missing; pass max_pos")
        max_pos = int(mpe * s["scaling"]["factor"]) if s["rope_type"] == "dynamic" else mpe
    shape = None
    if config.get("num_attention_heads") is not None:
        shape = shard_shape(config, tp, is_neox=bool(is_neox))
    elif isinstance(tp, bool) or not isinstance(tp, (int, np.integer)) or tp < 1:
        raise ValueError(f"tp: expected an integer >= 1, got {tp!r}")
    try:
        cos, sin, attention = tables.build(max_pos, s["rotary_dim"], s["base"], s["scaling"], dtype, form, bool(is_neox))
    except ValueError as e:  # name the config's key: config['rope_scaling']['factor'], not scaling['factor']
        msg = str(e)
        if msg.startswith("scaling["):
            raise ValueError(f"config[{s['source']!r}]{msg[len('scaling'):]}") from None
        raise
    plan = layer_plan(config) if config.get("num_hidden_layers") is not None else None
    local = None
    if layer_type is None and _per_type_rope(config):
        lc, ls, linfo = rope_tables_from_hf_config(config, max_pos=max_pos, tp=tp, dtype=dtype, form=form,
                                                   is_neox=is_neox, layer_type="sliding_attention")
        local = (lc, ls, linfo)
    info = RopeInfo(rope_type=s["rope_type"], rotary_dim=s["rotary_dim"], head_dim=s["head_dim"],
                    is_neox=bool(is_neox), base=s["base"], max_pos=int(max_pos), form=form,
                    attention_scaling=attention, scaling=s["scaling"], shape=shape,
                    mrope_section=s["mrope_section"], mrope_interleaved=s["mrope_interleaved"],
                    layer_type=s["layer_type"], local=local, layers=plan, family=family_options(config))
    return cos, sin, info


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
    config = text_config(config)
    settings = hf_rope_settings(config)
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
        is_neox = default_is_neox(config)
    if name is None:
        name = str(config.get("_name_or_path") or config.get("model_type") or "model")
    return ModelShape(name if tp == 1 else f"{name}-tp{tp}", heads // tp, max(1, kv // tp),
                      settings["head_dim"], settings["rotary_dim"], bool(is_neox))


@dataclasses.dataclass(frozen=True)
class MlaShape:
    """Per-shard shape of an MLA model (DeepSeek-V2/V3, Kimi-K2) at a tensor-parallel degree: query
    heads split over the shards, the one latent row per token on every shard (replicated)."""

    name: str
    q_heads: int
    nope_dim: int     # qk_nope_head_dim
    rope_dim: int     # qk_rope_head_dim: the rotated dims of q and of the latent row
    latent_dim: int   # kv_lora_rank
    v_head_dim: int
    is_neox: bool = False

    @property
    def absorbed_nope_dim(self) -> int:
        """q_nope's width once W_UK is absorbed into the query (decode): kv_lora_rank."""
        return self.latent_dim

    def bytes_per_token(self, in_size=2, table_size=4, cache_size=2, q_out_size=None, index_size=4,
                        nope_dim=None, table_full=False) -> int:
        """The fewest bytes one token of mla_rope_and_cache moves: read q_nope, q_pe, kv_c, k_pe, the
        table row and two indices; write q_out, k_pe_out and one latent row."""
        dn = self.absorbed_nope_dim if nope_dim is None else nope_dim
        q_out_size = in_size if q_out_size is None else q_out_size
        qh, dr, dc = self.q_heads, self.rope_dim, self.latent_dim
        width = dr if table_full else dr // 2
        return ((qh * (dn + dr) + dc + dr) * in_size + 2 * width * table_size + 2 * index_size
                + qh * (dn + dr) * q_out_size + dr * in_size + (dc + dr) * cache_size)


def mla_shard_shape(config, tp: int = 1, *, name: str | None = None) -> MlaShape:
    """The per-shard `MlaShape` of an MLA config dict at tensor-parallel degree tp."""
    if isinstance(tp, bool) or not isinstance(tp, (int, np.integer)) or tp < 1:
        raise ValueError(f"tp: expected an integer >= 1, got {tp!r}")
    heads = _positive_int(config, "num_attention_heads")
    if heads % tp:
        raise ValueError(f"tp: must divide num_attention_heads ({heads}), got {tp}")
    if name is None:
        name = str(config.get("_name_or_path") or config.get("model_type") or "model")
    return MlaShape(name if tp == 1 else f"{name}-tp{tp}", heads // int(tp), _positive_int(config, "qk_nope_head_dim"),
                    _positive_int(config, "qk_rope_head_dim"), _positive_int(config, "kv_lora_rank"),
                    _positive_int(config, "v_head_dim"), default_is_neox(config))


def mla_softmax_scale(config) -> float:
    """The attention softmax scale of an MLA model: (qk_nope_head_dim + qk_rope_head_dim) ** -0.5, times
    YaRN's mscale(factor, mscale_all_dim) squared when the config has a YaRN mscale_all_dim (DeepSeek-V3's
    rule; the tables' own attention factor is mscale / mscale_all_dim, 1 for DeepSeek-V3 and Kimi-K2)."""
    scale = (_positive_int(config, "qk_nope_head_dim") + _positive_int(config, "qk_rope_head_dim")) ** -0.5
    s = hf_rope_settings(config)
    if s["rope_type"] == "yarn" and (s["scaling"] or {}).get("mscale_all_dim"):
        factor = float(s["scaling"]["factor"])
        m = 1.0 if factor <= 1 else 0.1 * float(s["scaling"]["mscale_all_dim"]) * math.log(factor) + 1.0
        scale *= m * m
    return scale


# ---- model families: per-layer RoPE, attention kind and the op's family options ------------------------
GEMMA3_MODEL_TYPES = ("gemma3", "gemma3_text")
GEMMA3_GLOBAL_THETA, GEMMA3_LOCAL_THETA = 1_000_000.0, 10_000.0  # transformers' defaults for Gemma 3
LAYER_TYPES = ("full_attention", "sliding_attention")
NOPE_MODEL_TYPES = ("llama4", "llama4_text", "smollm3")  # configs with no_rope_layers (1: the layer rotates)
GATED_MODEL_TYPES = ("qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")


def _gemma3(config: Mapping) -> bool:
    return config.get("model_type") in GEMMA3_MODEL_TYPES


def _per_type_rope(config: Mapping) -> bool:
    """The config's RoPE differs per layer type (Gemma 3, either form)."""
    params = config.get("rope_parameters")
    return _gemma3(config) or (isinstance(params, Mapping) and any(isinstance(v, Mapping) for v in params.values()))


def _check_layer_type(config: Mapping, layer_type):
    if layer_type is None:
        return "full_attention" if _per_type_rope(config) else None
    if layer_type not in LAYER_TYPES:
        raise ValueError(f"layer_type: expected None or one of {LAYER_TYPES}, got {layer_type!r}")
    return layer_type


@dataclasses.dataclass(frozen=True)
class LayerPlan:
    """What one decoder layer does around the op: whether it rotates (rope), which tables it reads
    ("global" or "local": Gemma 3's sliding layers), its attention ("full", "sliding" over the last
    `window` positions, "chunked" within blocks of `window` positions (Llama 4's RoPE layers), or
    "linear": a recurrent layer with no KV cache and no RoPE (Qwen3-Next's Gated DeltaNet))."""

    rope: bool
    table: str
    attention: str
    window: int | None = None


def _int_list(config: Mapping, key: str, n: int):
    v = config.get(key)
    if v is None:
        return None
    if not isinstance(v, (list, tuple)) or len(v) != n or any(
            isinstance(x, bool) or not isinstance(x, (int, np.integer)) or x not in (0, 1) for x in v):
        raise ValueError(f"config[{key!r}]: expected {n} entries of 0 or 1 (one per layer), got {v!r}")
    return [int(x) for x in v]


def layer_plan(config: Mapping) -> tuple[LayerPlan, ...]:
    """Per layer of a config: LayerPlan (rotation, tables, attention kind), as transformers builds the
    layers: Gemma 3's layer_types (or every sliding_window_pattern-th layer global, default 6);
    Llama 4 and SmolLM3's no_rope_layers (1: rotates; default: every no_rope_layer_interval-th layer,
    4, is NoPE), Llama 4's RoPE layers chunked by attention_chunk_size; Qwen3-Next / Qwen3.5's
    layer_types (or every full_attention_interval-th layer, 4, full attention, the others linear)."""
    config = text_config(config)
    n = _positive_int(config, "num_hidden_layers")
    mt = config.get("model_type")
    types = config.get("layer_types")
    if types is not None and (not isinstance(types, (list, tuple)) or len(types) != n):
        raise ValueError(f"config['layer_types']: expected {n} layer types (one per layer), got {types!r}")
    if mt in GEMMA3_MODEL_TYPES:
        if types is None:
            every = config.get("sliding_window_pattern", 6)
            types = ["full_attention" if (i + 1) % every == 0 else "sliding_attention" for i in range(n)]
        window = config.get("sliding_window", 4096)
        return tuple(LayerPlan(True, "local", "sliding", window) if t == "sliding_attention"
                     else LayerPlan(True, "global", "full") for t in types)
    if mt in NOPE_MODEL_TYPES:
        # Llama 4's released configs say "no_rope_layers": [], which transformers reads as the default
        empty = mt != "smollm3" and config.get("no_rope_layers") in ([], ())
        rope = None if empty else _int_list(config, "no_rope_layers", n)
        if rope is None:
            every = config.get("no_rope_layer_interval", 4)
            rope = [int((i + 1) % every != 0) for i in range(n)]
        chunk = config.get("attention_chunk_size", 8192) if mt != "smollm3" else None
        return tuple(LayerPlan(bool(r), "global", "chunked" if r and chunk else "full", chunk if r and chunk else None)
                     for r in rope)
    if mt in GATED_MODEL_TYPES:
        if types is None:
            every = config.get("full_attention_interval", 4)
            types = ["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(n)]
        return tuple(LayerPlan(True, "global", "full") if t == "full_attention" else LayerPlan(False, "global", "linear")
                     for t in types)
    return tuple(LayerPlan(True, "global", "full") for _ in range(n))


def family_options(config: Mapping) -> dict:
    """The rope_and_cache options a model family needs besides the tables (transformers' arithmetic,
    docs/models.md): Gemma 3 and Qwen3-Next / Qwen3.5 norm_type="gemma" ((1 + w), before the
    rotation), Qwen3-Next / Qwen3.5 q_gate=True (rope_and_cache_qkv), Llama 4 norm_type="weightless"
    and norm_position="after" when use_qk_norm (Scout; not Maverick) and attn_temperature=(floor_scale,
    attn_scale) when attn_temperature_tuning; the others nothing (GLM-4.5's use_qk_norm is the
    default "rms" norm, given by its weights)."""
    config = text_config(config)
    mt = config.get("model_type")
    if mt in GEMMA3_MODEL_TYPES:
        return dict(norm_type="gemma")
    if mt in GATED_MODEL_TYPES:
        return dict(norm_type="gemma", q_gate=True)
    if mt in ("llama4", "llama4_text"):
        out = {}
        if config.get("use_qk_norm", True):
            out.update(norm_type="weightless", norm_position="after")
        if config.get("attn_temperature_tuning", True):
            out["attn_temperature"] = (int(config.get("floor_scale", 8192)), float(config.get("attn_scale", 0.1)))
        return out
    return {}
