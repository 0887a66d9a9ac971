"""A minimal DeepSeek-V3 in jax.numpy on top of `mla_rope_and_cache`: the MLA op's real client, the
check that its latent rows, rotation and tables are right as seen through attention.

    token embedding -> L x [RMSNorm -> MLA attention -> RMSNorm -> dense SwiGLU MLP (the first
    first_k_dense_replace layers) or DeepSeek-V3's MoE (sigmoid router, group-limited top-k, shared
    expert)] -> RMSNorm -> LM head -> greedy argmax

MLA attention in the absorbed form, the one serving engines run and the op's q_out is laid out for:

    q = q_b(RMSNorm(q_a(h)))  -> q_nope [T, QH, Dn], q_pe [T, QH, Dr]
    kv_a(h)                   -> kv_c = RMSNorm(latent) [T, Dc], k_pe [T, Dr]   (one latent per token)
    q_lat = q_nope @ W_UK[h]  [T, QH, Dc]   (W_UK: kv_b's key half, absorbed into the query)
    mla_rope_and_cache(q_lat, q_pe, kv_c, k_pe) -> q_out = cat(q_lat, rope(q_pe)) [T, QH, Dc + Dr],
                                                  row cat(kv_c, rope(k_pe)) written at the token's slot
    scores = q_out . row * softmax_scale over the sequence's cached rows (block-table gather)
    o = (softmax @ rows[:, :Dc]) @ W_UV[h]  (kv_b's value half) -> o_proj

so attention reads nothing but the latent cache the op wrote: one dot product per (query head,
cached row) over Dc + Dr channels, no per-head keys or values are ever built. The non-absorbed form
(transformers': kv_b expands every cached latent into QH keys and values) gives the same numbers in
another summation order. The cache is one array [L, NB, BS, Dc + Dr] ("combined") or a pair
([L, NB, BS, Dc], [L, NB, BS, Dr]) ("split"); the gather below is written from those definitions.

Softmax scale: (Dn + Dr) ** -0.5 times YaRN's mscale(factor, mscale_all_dim) squared
(`mla_softmax_scale`); the tables carry the rest of YaRN's attention factor (mscale / mscale_all_dim).
The latent norms (q_a_layernorm, kv_a_layernorm) use epsilon 1e-6 whatever rms_norm_eps says, as
transformers builds them.

The MoE runs every expert on every token and weights the outputs with the router's sparse gate
matrix: the same sums as a dispatch, and cheap at this size. Layers run under one `lax.scan` per run
of equal layers (dense, then MoE), on weights stacked per run; the stacked caches span all layers.
The steps, block allocation and host side are decoder.Decoder's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np

import jax_rope_cache as jrc
from jax_rope_cache import decoder
from jax_rope_cache.mla import contract as mla_contract
from jax_rope_cache.models.config import mla_softmax_scale

__all__ = ["MlaDecoderConfig", "MlaDecoder", "TINY_MLA_CONFIGS", "TINY_MLA_SEEDS", "hf_state_dict",
           "gather_latent", "LATENT_NORM_EPS"]

# Tiny random-weight DeepSeek-V3 in Hugging Face config.json form (what DeepseekV3Config takes).
TINY_MLA_CONFIGS: dict[str, dict] = {
    "tiny-deepseek-v3": {
        "model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"], "vocab_size": 256,
        "hidden_size": 128, "intermediate_size": 256, "moe_intermediate_size": 64, "num_hidden_layers": 3,
        "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 64, "kv_lora_rank": 64,
        "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32,
        # DeepSeek-V3's routing at a small scale: 8 experts in 2 groups, the best group's top 2 experts
        "n_routed_experts": 8, "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1, "n_shared_experts": 1,
        "routed_scaling_factor": 2.5, "norm_topk_prob": True, "first_k_dense_replace": 1,
        "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        # DeepSeek-V3's YaRN law at original length 32 (not 4096): within the positions of a test the
        # law then changes most frequencies. mscale != mscale_all_dim, so the tables carry an attention
        # factor (1.036) and the softmax scale another (mscale_all_dim's, squared).
        "rope_scaling": {"type": "yarn", "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0,
                         "mscale_all_dim": 0.8, "original_max_position_embeddings": 32},
        "hidden_act": "silu", "attention_bias": False, "rope_interleave": True, "tie_word_embeddings": False,
        "num_nextn_predict_layers": 0,
    },
}
TINY_MLA_SEEDS = {"tiny-deepseek-v3": 9}

LATENT_NORM_EPS = 1e-6  # transformers' DeepseekV3RMSNorm default, which q_a/kv_a_layernorm keep

_GAIN = {"wq_a": 1.0, "wq_b": 2.0, "wkv_a": 1.0, "wkv_b": 2.0, "wo": 1.0, "w_gate": 1.0, "w_up": 1.0,
         "w_down": 1.0, "lm_head": 2.0, "router": 1.0, "expert_gate": 1.0, "expert_up": 1.0, "expert_down": 1.0,
         "shared_gate": 1.0, "shared_up": 1.0, "shared_down": 1.0}


_need = decoder.config_int


@dataclasses.dataclass(frozen=True)
class MlaDecoderConfig:
    supported = ("deepseek_v3",)  # model types (not a field)

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    q_heads: int
    q_lora_rank: int
    latent_dim: int      # kv_lora_rank (Dc)
    nope_dim: int        # qk_nope_head_dim (Dn)
    rope_dim: int        # qk_rope_head_dim (Dr)
    v_head_dim: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    softmax_scale: float
    dense_layers: int    # first_k_dense_replace, at most num_layers
    experts: int = 0
    experts_per_token: int = 0
    groups: int = 1
    top_groups: int = 1
    moe_intermediate_size: int = 0
    shared_experts: int = 0
    routed_scaling: float = 1.0
    norm_topk: bool = True

    @classmethod
    def from_hf(cls, config: Mapping) -> MlaDecoderConfig:
        """Reads a DeepSeek-V3 config dict; raises ValueError naming a key this decoder does not implement."""
        mt = decoder.check_hf_family(config, cls.supported, ("attention_bias",))
        if config.get("q_lora_rank") is None:
            raise ValueError("config['q_lora_rank']: None (a plain q_proj) is not implemented by this decoder")
        heads = _need(config, "num_attention_heads")
        if config.get("num_key_value_heads") not in (None, heads):
            raise ValueError(f"config['num_key_value_heads']: MLA has one latent for all {heads} heads, expected "
                             f"{heads} or null, got {config['num_key_value_heads']!r}")
        layers = _need(config, "num_hidden_layers")
        dense = config.get("first_k_dense_replace", 3)
        if isinstance(dense, bool) or not isinstance(dense, int) or dense < 0:
            raise ValueError(f"config['first_k_dense_replace']: expected an integer >= 0, got {dense!r}")
        moe = {}
        if dense < layers:
            experts, groups = _need(config, "n_routed_experts"), _need(config, "n_group")
            per_tok, top_groups = _need(config, "num_experts_per_tok"), _need(config, "topk_group")
            if experts % groups or experts // groups < 2:
                raise ValueError(f"config['n_group']: must split n_routed_experts ({experts}) into groups of >= 2, "
                                 f"got {groups}")
            if top_groups > groups or per_tok > top_groups * (experts // groups):
                raise ValueError(f"config['num_experts_per_tok']: at most topk_group ({top_groups}) x experts per "
                                 f"group ({experts // groups}) with topk_group <= n_group ({groups}), got {per_tok}")
            moe = dict(experts=experts, experts_per_token=per_tok, groups=groups, top_groups=top_groups,
                       moe_intermediate_size=_need(config, "moe_intermediate_size"),
                       shared_experts=int(config.get("n_shared_experts") or 0),
                       routed_scaling=float(config.get("routed_scaling_factor", 1.0)),
                       norm_topk=bool(config.get("norm_topk_prob", True)))
        return cls(model_type=mt, vocab_size=_need(config, "vocab_size"), hidden_size=_need(config, "hidden_size"),
                   intermediate_size=_need(config, "intermediate_size"), num_layers=layers, q_heads=heads,
                   q_lora_rank=_need(config, "q_lora_rank"), latent_dim=_need(config, "kv_lora_rank"),
                   nope_dim=_need(config, "qk_nope_head_dim"), rope_dim=_need(config, "qk_rope_head_dim"),
                   v_head_dim=_need(config, "v_head_dim"), rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
                   tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
                   softmax_scale=mla_softmax_scale(config), dense_layers=min(dense, layers), **moe)

    @property
    def gains(self) -> dict:
        return _GAIN

    def param_shapes(self) -> dict:
        """{name: shape} of `random_params`' arrays: "layers" stacks the dense layers [n_dense, ...],
        "moe_layers" the MoE layers after them; projections stored [in, out] (x @ w)."""
        H, QH, qr, dc = self.hidden_size, self.q_heads, self.q_lora_rank, self.latent_dim
        attn = {"attn_norm": (H,), "wq_a": (H, qr), "q_a_norm": (qr,), "wq_b": (qr, QH * (self.nope_dim + self.rope_dim)),
                "wkv_a": (H, dc + self.rope_dim), "kv_a_norm": (dc,), "wkv_b": (dc, QH * (self.nope_dim + self.v_head_dim)),
                "wo": (QH * self.v_head_dim, H), "mlp_norm": (H,)}
        I, E, Im, Is = self.intermediate_size, self.experts, self.moe_intermediate_size, \
            self.moe_intermediate_size * self.shared_experts
        dense = {"w_gate": (H, I), "w_up": (H, I), "w_down": (I, H)}
        moe = {"router": (H, E), "router_bias": (E,), "expert_gate": (E, H, Im), "expert_up": (E, H, Im),
               "expert_down": (E, Im, H)}
        if Is:
            moe |= {"shared_gate": (H, Is), "shared_up": (H, Is), "shared_down": (Is, H)}
        out = {"embed": (self.vocab_size, H), "final_norm": (H,)}
        for name, n, mlp in (("layers", self.dense_layers, dense), ("moe_layers", self.num_layers - self.dense_layers, moe)):
            if n:
                out[name] = {k: (n,) + v for k, v in (attn | mlp).items()}
        if not self.tie_word_embeddings:
            out["lm_head"] = (H, self.vocab_size)
        return out


def hf_state_dict(cfg: MlaDecoderConfig, params: dict) -> dict[str, np.ndarray]:
    """The same weights under transformers' DeepseekV3ForCausalLM names ([out, in] projections;
    experts as its packed gate_up_proj [E, 2 I, H] and down_proj [E, H, I])."""
    t = lambda a: np.ascontiguousarray(np.swapaxes(np.asarray(a), -1, -2))  # noqa: E731
    sd = {"model.embed_tokens.weight": np.asarray(params["embed"]), "model.norm.weight": np.asarray(params["final_norm"])}
    sd["lm_head.weight"] = np.asarray(params["embed"]) if cfg.tie_word_embeddings else t(params["lm_head"])
    names = {"attn_norm": "input_layernorm.weight", "mlp_norm": "post_attention_layernorm.weight",
             "q_a_norm": "self_attn.q_a_layernorm.weight", "kv_a_norm": "self_attn.kv_a_layernorm.weight",
             "router_bias": "mlp.gate.e_score_correction_bias"}
    linear = {"wq_a": "self_attn.q_a_proj", "wq_b": "self_attn.q_b_proj", "wkv_a": "self_attn.kv_a_proj_with_mqa",
              "wkv_b": "self_attn.kv_b_proj", "wo": "self_attn.o_proj", "w_gate": "mlp.gate_proj",
              "w_up": "mlp.up_proj", "w_down": "mlp.down_proj", "router": "mlp.gate",
              "shared_gate": "mlp.shared_experts.gate_proj", "shared_up": "mlp.shared_experts.up_proj",
              "shared_down": "mlp.shared_experts.down_proj"}
    layer = 0
    for group in ("layers", "moe_layers"):
        if group not in params:
            continue
        lay = params[group]
        for j in range(len(lay["attn_norm"])):
            pre = f"model.layers.{layer}."
            for ours, theirs in names.items():
                if ours in lay:
                    sd[pre + theirs] = np.asarray(lay[ours][j])
            for ours, theirs in linear.items():
                if ours in lay:
                    sd[f"{pre}{theirs}.weight"] = t(lay[ours][j])
            if "expert_gate" in lay:
                sd[pre + "mlp.experts.gate_up_proj"] = np.concatenate([t(lay["expert_gate"][j]), t(lay["expert_up"][j])], 1)
                sd[pre + "mlp.experts.down_proj"] = t(lay["expert_down"][j])
            layer += 1
    return sd


def absorb(params: dict, cfg: MlaDecoderConfig) -> dict:
    """params with each stack's kv_b ([Dc, QH * (Dn + Dv)]) split into the absorbed halves:
    w_uk [n, QH, Dn, Dc] (q_nope @ w_uk[h] is the query against the latent) and w_uv [n, QH, Dc, Dv]."""
    out = dict(params)
    for group in ("layers", "moe_layers"):
        if group in params:
            lay = dict(params[group])
            kvb = lay.pop("wkv_b")
            kvb = kvb.reshape(kvb.shape[0], cfg.latent_dim, cfg.q_heads, cfg.nope_dim + cfg.v_head_dim)
            lay["w_uk"] = kvb[..., :cfg.nope_dim].transpose(0, 2, 3, 1)
            lay["w_uv"] = kvb[..., cfg.nope_dim:].transpose(0, 2, 1, 3)
            out[group] = lay
    return out


def gather_latent(caches, layer, block_table, layout: str):
    """The cached rows cat(kv_c, rope(k_pe)) of every sequence's blocks in position order,
    [B, MB * BS, Dc + Dr], from stacked caches at `layer` (block ids -1 read block 0, which the
    attention mask hides). Written from the layouts' definitions:
      combined  one cache [L, NB, BS, Dc + Dr]
      split     ckv [L, NB, BS, Dc] and kpe [L, NB, BS, Dr]
    """
    bt = jnp.maximum(jnp.asarray(block_table), 0)
    B, MB = bt.shape
    if layout == "combined":
        rows = caches[0][layer, bt]
    elif layout == "split":
        rows = jnp.concatenate([caches[0][layer, bt], caches[1][layer, bt]], axis=-1)
    else:
        raise ValueError(f"layout: expected one of {mla_contract.MLA_LAYOUTS}, got {layout!r}")
    return rows.reshape(B, MB * rows.shape[2], rows.shape[3])


class MlaDecoder(decoder.Decoder):
    """decoder.Decoder with DeepSeek-V3's MLA attention on the latent cache and its MoE. `layout`:
    "combined" or "split"; `self.caches` is (kv_cache,) or (ckv_cache, kpe_cache), stacked [L, ...].
    impl="baseline" (timing only): no RoPE, and one element of each cache is written (touch_caches)."""

    config_class = MlaDecoderConfig
    layouts = mla_contract.MLA_LAYOUTS
    kv_quants = (None,)  # per-token fp8 scales: the main op's feature, not the MLA op's
    attentions = ("gather",)  # JAX's paged-attention kernels read per-head K and V, not latent rows

    def __init__(self, config: Mapping, params: dict, *, layout="combined", **kw):
        if kw.get("per_layer"):
            raise ValueError("per_layer: the MLA decoder keeps stacked latent caches, got True")
        super().__init__(config, params, layout=layout, **kw)

    def _prepare_params(self, params):
        return absorb(params, self.cfg)

    def _new_caches(self, num_blocks, fill, seed):
        cfg = self.cfg
        shapes = mla_contract.mla_cache_shapes(self.layout, num_blocks, self.block_size, cfg.latent_dim, cfg.rope_dim)
        return self._filled([(cfg.num_layers,) + s for s in shapes], fill, seed)

    def _segments(self, params):
        return [(params[g], first, mlp) for g, first, mlp in (("layers", 0, self._mlp),
                                                              ("moe_layers", self.cfg.dense_layers, self._moe))
                if g in params]

    def _attention(self, w, i, h, caches, step, tables):
        cfg = self.cfg
        B, P = h.shape[:2]
        T, QH, dn, dc = B * P, cfg.q_heads, cfg.nope_dim, cfg.latent_dim
        q_a = decoder.rms_norm(self._mm(h, w["wq_a"]), w["q_a_norm"], LATENT_NORM_EPS)
        q = self._mm(q_a, w["wq_b"]).reshape(T, QH, dn + cfg.rope_dim)
        ckv = self._mm(h, w["wkv_a"]).reshape(T, dc + cfg.rope_dim)
        kv_c, k_pe = decoder.rms_norm(ckv[:, :dc], w["kv_a_norm"], LATENT_NORM_EPS), ckv[:, dc:]
        q_lat = jnp.einsum("thn,hnc->thc", q[..., :dn], w["w_uk"], precision=self._precision)  # W_UK absorbed
        if self.impl == "baseline":
            q_out = jnp.concatenate([q_lat, q[..., dn:]], axis=-1)
            caches = decoder.touch_caches(caches, (kv_c, k_pe), step["slots"], i, self.block_size)
        else:
            cache = caches[0] if self.layout == "combined" else caches
            q_out, _, cache = jrc.mla_rope_and_cache(q_lat, q[..., dn:], kv_c, k_pe, cache, step["slots"],
                                                     step["flat_pos"], *tables, layout=self.layout,
                                                     is_neox=self.is_neox, impl=self.impl, layer=i)
            caches = (cache,) if self.layout == "combined" else tuple(cache)
        rows = gather_latent(caches, i, step["block_table"], self.layout)  # [B, S, Dc + Dr]
        s = jnp.einsum("bphc,bsc->bhps", q_out.reshape(B, P, QH, -1), rows, precision=self._precision,
                       preferred_element_type=jnp.float32) * cfg.softmax_scale
        mask = jnp.arange(rows.shape[1])[None, None, :] <= step["q_pos"][:, :, None]  # causal, written
        p = jax.nn.softmax(jnp.where(mask[:, None], s, -jnp.inf), axis=-1).astype(rows.dtype)
        o_lat = jnp.einsum("bhps,bsc->bphc", p, rows[..., :dc], precision=self._precision)
        o = jnp.einsum("bphc,hcv->bphv", o_lat, w["w_uv"], precision=self._precision)  # W_UV
        return self._mm(o.reshape(B, P, QH * cfg.v_head_dim), w["wo"]), caches

    def _moe(self, w, h):
        """DeepSeek-V3's MoE: sigmoid scores, experts chosen by score + bias within the topk_group
        groups of best top-2 sums, weighted by their scores (normalised, times routed_scaling_factor);
        plus the shared expert."""
        cfg = self.cfg
        x = h.reshape(-1, h.shape[-1])
        T, E, G = x.shape[0], cfg.experts, cfg.groups
        logits = jnp.matmul(x.astype(jnp.float32), w["router"].astype(jnp.float32),
                            precision=jax.lax.Precision.HIGHEST)
        scores = jax.nn.sigmoid(logits)
        choice = scores + w["router_bias"].astype(jnp.float32)
        group_score = jax.lax.top_k(choice.reshape(T, G, E // G), 2)[0].sum(-1)  # [T, G]
        top_groups = jax.lax.top_k(group_score, cfg.top_groups)[1]
        allowed = jnp.zeros((T, G), bool).at[jnp.arange(T)[:, None], top_groups].set(True)
        choice = jnp.where(jnp.repeat(allowed, E // G, axis=1), choice, -jnp.inf)
        chosen = jax.lax.top_k(choice, cfg.experts_per_token)[1]  # [T, K]
        weight = jnp.take_along_axis(scores, chosen, axis=1)
        if cfg.norm_topk:
            weight = weight / (weight.sum(-1, keepdims=True) + 1e-20)
        gate = jnp.zeros((T, E), jnp.float32).at[jnp.arange(T)[:, None], chosen].set(weight * cfg.routed_scaling)
        up = jax.nn.silu(jnp.einsum("th,ehi->tei", x, w["expert_gate"], precision=self._precision)) * \
            jnp.einsum("th,ehi->tei", x, w["expert_up"], precision=self._precision)
        y = jnp.einsum("tei,eih->teh", up, w["expert_down"], precision=self._precision)
        out = jnp.einsum("te,teh->th", gate.astype(y.dtype), y, precision=self._precision)
        if "shared_gate" in w:
            out = out + self._mm(jax.nn.silu(self._mm(x, w["shared_gate"])) * self._mm(x, w["shared_up"]),
                                 w["shared_down"])
        return out.reshape(h.shape)
