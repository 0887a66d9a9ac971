"""Tiny Gemma 3 and Llama 4 (text) decoders on `rope_and_cache_qkv`: the model-family options of the
op as a model runs them, in ONE compiled program per step (a lax.scan over layers of different kinds,
the per-layer switches traced).

Gemma 3 (transformers' Gemma3ForCausalLM):
    embedding * sqrt(H) -> L x [norm -> q/k/v -> op (Gemma (1 + w) q/k norms before the rotation; the
    sliding layers' local tables, the global layers' scaled ones, selected per layer) -> attention
    (sliding window on local layers, scale query_pre_attn_scalar ** -0.5) -> o -> norm, residual ->
    norm -> GELU-tanh MLP -> norm, residual] -> norm -> tied LM head; every norm (1 + w).
Llama 4 text (Llama4ForCausalLM):
    L x [RMSNorm -> q/k/v -> op (RoPE layers: GPT-J rotation, then the weightless q/k norm; NoPE
    layers: no rotation, q times the attention temperature; use_rope traced per layer) -> attention
    (chunked on RoPE layers, full on NoPE layers) -> o, residual -> RMSNorm -> MoE (sigmoid top-k
    router scaling the experts' input, a shared expert) on the MoE layers, a SwiGLU MLP of width
    intermediate_size_mlp on the dense ones] -> RMSNorm -> LM head. Scout: every layer MoE; Maverick
    (interleave_moe_layer_step 2): every second, as transformers picks them (moe_layers, by default
    layers step-1, 2 step-1, ...). An interleaved model's scan runs over groups of `step` layers
    (step-1 dense, then the MoE one, unrolled in the body): one loop with no per-layer branch (a
    lax.cond would make a GPU read its predicate on the host every layer) and each kind's weights
    stacked apart (no MoE weights padded onto the dense layers).

Every native kernel implements the family options, so impl="kernel" runs the op's kernel on every
layer. The steps, block allocation and host side are decoder.Decoder's; attention reads the
caches with attention.gather_blocks.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np

import jax_rope_cache as jrc
from jax_rope_cache import attention as attn
from jax_rope_cache import decoder
from jax_rope_cache.models import config as hfconfig

__all__ = ["FamilyDecoderConfig", "FamilyDecoder", "TINY_FAMILY_CONFIGS", "TINY_FAMILY_SEEDS", "hf_state_dict"]

TINY_FAMILY_CONFIGS: dict[str, dict] = {
    "tiny-gemma-3": {
        # sliding window 8 within prompts of 21 + 33 tokens; every third layer global; query_pre_attn_scalar
        # != head_dim, as Gemma 3 27B's
        "model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"], "vocab_size": 256, "hidden_size": 128,
        "intermediate_size": 256, "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 32, "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0, "rope_scaling": {"rope_type": "linear", "factor": 8.0},
        "sliding_window": 8, "sliding_window_pattern": 3, "query_pre_attn_scalar": 24,
        "hidden_activation": "gelu_pytorch_tanh", "attention_bias": False, "tie_word_embeddings": True,
        "final_logit_softcapping": None, "attn_logit_softcapping": None,
    },
    "tiny-llama-4": {
        # every second layer NoPE (with the temperature: floor_scale 4 changes the factor within a prompt),
        # chunks of 8 positions on the RoPE layers, Scout's weightless q/k norm, all layers MoE
        "model_type": "llama4_text", "architectures": ["Llama4ForCausalLM"], "vocab_size": 256, "hidden_size": 128,
        "intermediate_size": 64, "intermediate_size_mlp": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 256, "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "rope_scaling": None, "no_rope_layer_interval": 2, "attention_chunk_size": 8,
        "attn_temperature_tuning": True, "floor_scale": 4, "attn_scale": 0.5, "use_qk_norm": True,
        "num_local_experts": 4, "num_experts_per_tok": 1, "interleave_moe_layer_step": 1, "hidden_act": "silu",
        "attention_bias": False, "tie_word_embeddings": False,
    },
    "tiny-llama-4-maverick": {
        # Maverick's text model: every second layer MoE (1, 3, 5; the others dense, intermediate_size_mlp
        # wide), no q/k norm, no rope scaling; NoPE every third layer (2, 5: both MLP kinds meet both
        # attention kinds) with the temperature, chunks of 8 positions on the RoPE layers
        "model_type": "llama4_text", "architectures": ["Llama4ForCausalLM"], "vocab_size": 256, "hidden_size": 128,
        "intermediate_size": 64, "intermediate_size_mlp": 160, "num_hidden_layers": 6, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 256, "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "rope_scaling": None, "no_rope_layer_interval": 3, "attention_chunk_size": 8,
        "attn_temperature_tuning": True, "floor_scale": 4, "attn_scale": 0.5, "use_qk_norm": False,
        "num_local_experts": 4, "num_experts_per_tok": 1, "interleave_moe_layer_step": 2, "hidden_act": "silu",
        "attention_bias": False, "tie_word_embeddings": False,
    },
}
TINY_FAMILY_SEEDS = {"tiny-gemma-3": 12, "tiny-llama-4": 4, "tiny-llama-4-maverick": 5}

_GAIN = {"wq": 2.0, "wk": 2.0, "wv": 1.0, "wo": 1.0, "w_gate": 1.0, "w_up": 1.0, "w_down": 1.0, "lm_head": 2.0,
         "router": 1.0, "experts_gate_up": 1.0, "experts_down": 1.0, "dense_gate": 1.0, "dense_up": 1.0,
         "dense_down": 1.0}
_MOE = ("w_gate", "w_up", "w_down", "router", "experts_gate_up", "experts_down")  # one per MoE layer
_DENSE = ("dense_gate", "dense_up", "dense_down")  # one per dense layer (interleaved models)


def moe_layers(config: Mapping) -> tuple[int, ...]:
    """The layers transformers gives the MoE block (Llama4TextConfig): config['moe_layers'] when given,
    else every interleave_moe_layer_step-th layer counted from step - 1."""
    n = decoder.config_int(config, "num_hidden_layers")
    given = config.get("moe_layers")
    if given is not None:
        if not isinstance(given, (list, tuple)) or any(
                isinstance(i, bool) or not isinstance(i, (int, np.integer)) or not 0 <= i < n for i in given):
            raise ValueError(f"config['moe_layers']: expected layer indices in [0, {n}), got {given!r}")
        return tuple(sorted({int(i) for i in given}))
    step = config.get("interleave_moe_layer_step", 1)
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 1:
        raise ValueError(f"config['interleave_moe_layer_step']: expected a positive integer, got {step!r}")
    return tuple(range(step - 1, n, step))


def _moe_period(config: Mapping) -> int:
    """k when the MoE layers are the last of every group of k layers (k | L), as the scan runs them."""
    n = decoder.config_int(config, "num_hidden_layers")
    moe = moe_layers(config)
    k = n // len(moe) if moe else 0
    if not moe or n % len(moe) or moe != tuple(range(k - 1, n, k)):
        key = "moe_layers" if config.get("moe_layers") is not None else "interleave_moe_layer_step"
        raise ValueError(f"config[{key!r}]: this decoder runs MoE layers k-1, 2k-1, ..., L-1 for a k dividing "
                         f"num_hidden_layers ({n}); got {config.get(key)!r} (MoE layers {list(moe)})")
    return k


_SUPPORTED = ("gemma3_text", "llama4_text")


@dataclasses.dataclass(frozen=True)
class FamilyDecoderConfig(decoder.DecoderConfig):
    """decoder.DecoderConfig plus what Gemma 3 / Llama 4 add (per-layer plan, norms, MoE)."""

    layers_plan: tuple = ()
    query_pre_attn_scalar: float = 0.0
    num_experts: int = 0
    top_k: int = 0
    moe_step: int = 1  # Llama 4: every moe_step-th layer MoE, the others dense (Maverick 2)
    intermediate_size_mlp: int = 0  # the dense layers' width
    family: tuple = ()  # family_options as sorted items (hashable)

    @property
    def gains(self) -> dict:
        return _GAIN

    @property
    def gemma(self) -> bool:
        return self.model_type == "gemma3_text"

    @classmethod
    def from_hf(cls, config: Mapping) -> FamilyDecoderConfig:
        mt = decoder.check_hf_family(config, _SUPPORTED, ("attention_bias", "final_logit_softcapping",
                                                          "attn_logit_softcapping"))
        if mt == "gemma3_text":
            if config.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
                raise ValueError(f"config['hidden_activation']: expected 'gelu_pytorch_tanh', got "
                                 f"{config['hidden_activation']!r}")
        base = decoder.DecoderConfig.from_hf(dict(config, model_type="llama"))
        need = functools.partial(decoder.config_int, config)
        extra = {}
        if mt == "llama4_text":
            extra = dict(num_experts=need("num_local_experts"), top_k=need("num_experts_per_tok"),
                         moe_step=_moe_period(config))
            if extra["moe_step"] > 1:
                extra["intermediate_size_mlp"] = need("intermediate_size_mlp")
        return cls(**{**dataclasses.asdict(base), "model_type": mt, "qk_norm": mt == "gemma3_text"},
                   layers_plan=hfconfig.layer_plan(config),
                   query_pre_attn_scalar=float(config.get("query_pre_attn_scalar", base.head_dim)),
                   family=tuple(sorted(hfconfig.family_options(config).items())), **extra)

    def param_shapes(self) -> dict:
        out = super().param_shapes()
        lay = dict(out["layers"])
        L, H, I = self.num_layers, self.hidden_size, self.intermediate_size
        if self.gemma:
            lay |= {"post_attn_norm": (L, H), "post_mlp_norm": (L, H)}
        else:
            E, M = self.num_experts, L // self.moe_step
            for n in ("w_gate", "w_up", "w_down"):  # the shared expert: intermediate_size wide
                lay[n] = (M, I, H) if n == "w_down" else (M, H, I)
            lay |= {"router": (M, H, E), "experts_gate_up": (M, E, H, 2 * I), "experts_down": (M, E, I, H)}
            if self.moe_step > 1:  # the dense layers' SwiGLU, intermediate_size_mlp wide
                D, J = L - M, self.intermediate_size_mlp
                lay |= {"dense_gate": (D, H, J), "dense_up": (D, H, J), "dense_down": (D, J, H)}
        out["layers"] = lay
        return out


def hf_state_dict(cfg: FamilyDecoderConfig, params: dict) -> dict[str, np.ndarray]:
    """The same weights under transformers' Gemma3ForCausalLM / Llama4ForCausalLM names."""
    t = lambda a: np.ascontiguousarray(np.asarray(a).T)  # noqa: E731
    lay = params["layers"]
    sd = {"model.embed_tokens.weight": np.asarray(params["embed"]), "model.norm.weight": np.asarray(params["final_norm"])}
    sd["lm_head.weight"] = np.asarray(params["embed"]) if cfg.tie_word_embeddings else t(params["lm_head"])
    proj = {"wq": "self_attn.q_proj", "wk": "self_attn.k_proj", "wv": "self_attn.v_proj", "wo": "self_attn.o_proj"}
    if cfg.gemma:
        proj |= {"w_gate": "mlp.gate_proj", "w_up": "mlp.up_proj", "w_down": "mlp.down_proj"}
        norms = {"attn_norm": "input_layernorm", "post_attn_norm": "post_attention_layernorm",
                 "mlp_norm": "pre_feedforward_layernorm", "post_mlp_norm": "post_feedforward_layernorm",
                 "q_norm": "self_attn.q_norm", "k_norm": "self_attn.k_norm"}
    else:
        norms = {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm"}
    moe = {"w_gate": "feed_forward.shared_expert.gate_proj", "w_up": "feed_forward.shared_expert.up_proj",
           "w_down": "feed_forward.shared_expert.down_proj", "router": "feed_forward.router"}
    dense = {"dense_gate": "feed_forward.gate_proj", "dense_up": "feed_forward.up_proj",
             "dense_down": "feed_forward.down_proj"}
    step = cfg.moe_step
    for i in range(cfg.num_layers):
        for ours, theirs in proj.items():
            sd[f"model.layers.{i}.{theirs}.weight"] = t(lay[ours][i])
        for ours, theirs in norms.items():
            sd[f"model.layers.{i}.{theirs}.weight"] = np.asarray(lay[ours][i])
        if cfg.gemma:
            continue
        if (i + 1) % step:  # a dense layer (interleaved models): its index among the dense ones
            for ours, theirs in dense.items():
                sd[f"model.layers.{i}.{theirs}.weight"] = t(lay[ours][i - i // step])
            continue
        m = i // step
        for ours, theirs in moe.items():
            sd[f"model.layers.{i}.{theirs}.weight"] = t(lay[ours][m])
        # stored as the module holds them: [E, H, 2I] and [E, I, H]
        sd[f"model.layers.{i}.feed_forward.experts.gate_up_proj"] = np.asarray(lay["experts_gate_up"][m])
        sd[f"model.layers.{i}.feed_forward.experts.down_proj"] = np.asarray(lay["experts_down"][m])
    return sd


def gemma_norm(x, weight, eps):
    """Gemma's RMSNorm: in float32, normalised, times (1 + w), rounded once to x's dtype."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (y * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)


class FamilyDecoder(decoder.Decoder):
    """Gemma 3 / Llama 4 text on the paged caches (module docstring). The per-layer differences
    (rotation, tables, attention window) are arrays indexed by the scan's layer index, so every layer
    runs in one lax.scan: use_rope and the table choice reach the op traced."""

    config_class = FamilyDecoderConfig
    kv_quants = (None,)
    attentions = ("gather",)  # sliding-window and chunked layers: the Pallas kernels take neither

    def __init__(self, config: Mapping, params: dict, **kw):
        if kw.get("impl") == "baseline":
            raise ValueError("impl: expected 'kernel' or 'xla' for the family decoders (no baseline), got 'baseline'")
        super().__init__(config, params, **kw)
        plan = self.cfg.layers_plan
        self.family = dict(self.cfg.family)
        self.rope_layers = np.array([lp.rope for lp in plan], np.int32)
        self.local_layers = np.array([lp.table == "local" for lp in plan], np.int32)
        self.window = np.array([lp.window or 0 for lp in plan], np.int32)
        self.chunked = np.array([lp.attention == "chunked" for lp in plan], np.int32)
        if self.cfg.gemma and kw.get("tables") is None:  # [global, local] stacked: one table pair chosen per layer
            _, _, info = jrc.rope_tables_from_hf_config(config, max_pos=self.max_len, dtype=np.float32)
            g, l = self.tables, info.local
            self.tables = jax.device_put((jnp.stack([g[0], jnp.asarray(l[0])]), jnp.stack([g[1], jnp.asarray(l[1])])),
                                         self.device)


    def _attention(self, w, i, h, caches, step, tables):
        cfg = self.cfg
        B, P = h.shape[:2]
        kc, vc = caches
        cos, sin = tables
        if cos.ndim == 3:  # Gemma 3: [global, local]
            local = jnp.asarray(self.local_layers)[i]
            cos, sin = cos[local], sin[local]
        qkv = self._mm(h, w["wqkv"]).reshape(B * P, -1)
        opts = dict(num_q_heads=cfg.q_heads, num_kv_heads=cfg.kv_heads, layout=self.layout, is_neox=self.is_neox,
                    rotary_dim=self.rotary_dim, impl=self.impl, layer=i)
        if cfg.gemma:
            opts |= dict(q_norm_weight=w["q_norm"], k_norm_weight=w["k_norm"], norm_eps=cfg.rms_norm_eps,
                         norm_type="gemma")
        else:
            opts |= dict(use_rope=jnp.asarray(self.rope_layers)[i] != 0, norm_eps=cfg.rms_norm_eps,
                         **{k: v for k, v in self.family.items() if k != "q_gate"})
        q, _, kc, vc = jrc.rope_and_cache_qkv(qkv, kc, vc, step["slots"], step["flat_pos"], cos, sin, **opts)
        keys, values = attn.gather_blocks((kc, vc), i, step["block_table"], self.layout)
        o = self._attend_window(q.reshape(B, P, cfg.q_heads, cfg.head_dim), keys, values, step["q_pos"], i)
        return self._mm(o, w["wo"]), (kc, vc)

    def _attend_window(self, q, k, v, q_pos, i):
        """decoder.Decoder._attend with the layer's window: sliding (key > query - W) on Gemma's local
        layers, chunked (same block of W positions) on Llama 4's RoPE layers, causal everywhere."""
        cfg = self.cfg
        B, P, QH, D = q.shape
        S, KH = k.shape[1], k.shape[2]
        scale = cfg.query_pre_attn_scalar ** -0.5 if cfg.gemma else 1.0 / math.sqrt(D)
        s = jnp.einsum("bpkgd,bskd->bkgps", q.reshape(B, P, KH, QH // KH, D), k, precision=self._precision,
                       preferred_element_type=jnp.float32) * scale
        kv, qp = jnp.arange(S)[None, None, :], q_pos[:, :, None]
        win, chunked = jnp.asarray(self.window)[i], jnp.asarray(self.chunked)[i] != 0
        sliding = (win > 0) & ~chunked
        mask = (kv <= qp) & jnp.where(sliding, kv > qp - win, True) & jnp.where(
            chunked, kv // jnp.maximum(win, 1) == qp // jnp.maximum(win, 1), True)
        s = jnp.where(mask[:, None, None], s, -jnp.inf)
        p = jax.nn.softmax(s, axis=-1).astype(v.dtype)
        o = jnp.einsum("bkgps,bskd->bpkgd", p, v, precision=self._precision, preferred_element_type=jnp.float32)
        return o.reshape(B, P, QH * D).astype(q.dtype)

    def _mlp(self, w, h):
        if self.cfg.gemma:
            return self._mm(jax.nn.gelu(self._mm(h, w["w_gate"]), approximate=True) * self._mm(h, w["w_up"]),
                            w["w_down"])
        shared = super()._mlp(w, h)
        logits = self._mm(h, w["router"])  # [B, P, E]
        kth = jax.lax.top_k(logits, self.cfg.top_k)[0][..., -1:]
        scores = jnp.where(logits >= kth, jax.nn.sigmoid(logits), 0.0).astype(h.dtype)  # sigmoid(-inf) = 0
        routed = h[None] * jnp.moveaxis(scores, -1, 0)[..., None]  # [E, B, P, H]: the input is scaled
        gu = jnp.einsum("ebph,ehf->ebpf", routed, w["experts_gate_up"], precision=self._precision)
        gate, up = jnp.split(gu, 2, axis=-1)
        out = jnp.einsum("ebpf,efh->ebph", up * jax.nn.silu(gate), w["experts_down"], precision=self._precision)
        return shared + out.sum(0)

    def _dense_mlp(self, w, h):
        return self._mm(jax.nn.silu(self._mm(h, w["dense_gate"])) * self._mm(h, w["dense_up"]), w["dense_down"])

    def _forward(self, params, tables, caches, tokens, positions, block_table):
        if not self.cfg.gemma and self.cfg.moe_step == 1:
            return super()._forward(params, tables, caches, tokens, positions, block_table)
        if not self.cfg.gemma:
            return self._forward_interleaved(params, tables, caches, tokens, positions, block_table)
        cfg = self.cfg
        step = dict(slots=decoder.slot_mapping(block_table, positions, self.block_size).reshape(-1),
                    flat_pos=jnp.maximum(positions, 0).reshape(-1), q_pos=jnp.maximum(positions, 0),
                    block_table=block_table)
        x = params["embed"][tokens] * jnp.asarray(math.sqrt(cfg.hidden_size), jnp.float32).astype(params["embed"].dtype)
        norm = functools.partial(gemma_norm, eps=cfg.rms_norm_eps)

        def layer(carry, xs):
            x, caches = carry
            w, i = xs
            o, caches = self._attention(w, i, norm(x, w["attn_norm"]), caches, step, tables)
            x = x + norm(o, w["post_attn_norm"])
            x = x + norm(self._mlp(w, norm(x, w["mlp_norm"])), w["post_mlp_norm"])
            return (x, caches), None

        weights = params["layers"]
        if self.unroll is True or self.unroll >= cfg.num_layers:
            for j in range(cfg.num_layers):
                (x, caches), _ = layer((x, caches), (jax.tree.map(lambda a: a[j], weights), j))
        else:
            (x, caches), _ = jax.lax.scan(layer, (x, caches), (weights, jnp.arange(cfg.num_layers)), unroll=self.unroll)
        return norm(x, params["final_norm"]), caches

    def _forward_interleaved(self, params, tables, caches, tokens, positions, block_table):
        """Llama 4 with dense layers between the MoE ones (Maverick): one scan over L / k groups of k
        layers (module docstring); a group's body runs its k - 1 dense layers, then the MoE one."""
        cfg = self.cfg
        k, G = cfg.moe_step, cfg.num_layers // cfg.moe_step
        step = dict(slots=decoder.slot_mapping(block_table, positions, self.block_size).reshape(-1),
                    flat_pos=jnp.maximum(positions, 0).reshape(-1), q_pos=jnp.maximum(positions, 0),
                    block_table=block_table)
        norm = functools.partial(decoder.rms_norm, eps=cfg.rms_norm_eps)
        lay = params["layers"]
        # [G, k, ...] per layer, [G, k - 1, ...] per dense layer, [G, ...] per MoE layer
        weights = {n: a.reshape((G, k - 1) + a.shape[1:]) if n in _DENSE else
                   a if n in _MOE else a.reshape((G, k) + a.shape[1:]) for n, a in lay.items()}

        def group(carry, xs):
            x, caches = carry
            w, g = xs
            for j in range(k):
                mine = {n: a[j] for n, a in w.items() if n not in _MOE and n not in _DENSE}
                o, caches = self._attention(mine, g * k + j, norm(x, mine["attn_norm"]), caches, step, tables)
                x = x + o
                h = norm(x, mine["mlp_norm"])
                if j < k - 1:
                    x = x + self._dense_mlp({n: w[n][j] for n in _DENSE}, h)
                else:
                    x = x + self._mlp({n: w[n] for n in _MOE}, h)
            return (x, caches), None

        x = params["embed"][tokens]
        if self.unroll is True or self.unroll >= G:
            for g in range(G):
                (x, caches), _ = group((x, caches), (jax.tree.map(lambda a: a[g], weights), g))
        else:
            (x, caches), _ = jax.lax.scan(group, (x, caches), (weights, jnp.arange(G)), unroll=self.unroll)
        return norm(x, params["final_norm"]), caches
