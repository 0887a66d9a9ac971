"""A minimal Llama-3.1 / Qwen3 decoder in jax.numpy on top of `rope_and_cache`: the library's
smallest real client, and the check that positions, slots, tables and layouts are right as seen
through attention.

    token embedding -> L x [RMSNorm -> ONE fused q/k/v projection -> (Qwen3: per-head q/k RMSNorm)
    -> rope_and_cache_qkv (RoPE on q and k, K and V written into ONE stacked paged cache [L, ...] at
    layer l, or into the layer's own cache) -> GQA attention over the sequence's cache blocks
    (`attention`: a block-table gather in jax.numpy, or JAX's Pallas paged-attention kernel for
    GPUs or TPUs; attention.py) -> o-projection -> RMSNorm -> SwiGLU MLP] -> RMSNorm -> LM head
    -> greedy argmax

Layers run under `lax.scan` over the stacked weights and the stacked caches (the op's `layer=`
argument; a Python loop with constant layer indices when `unroll` covers every layer); prefill (a
padded batch of prompts of different lengths, padding slots -1) and decode (a `lax.scan` over
steps) are each one `jax.jit` with both caches donated. A `BlockAllocator`
hands each sequence its cache blocks (from a shuffled free list, so a sequence's blocks are not
contiguous); the block table maps (sequence, position) to a slot.

Where it sits: above `api` (it calls the op) and below `cli/` (the `generate` command and
`./scripts/run_demo.sh` drive it), inside the package so that every install can run it.

Attention reads exactly the caches the op writes: the gather from the layouts' definitions (not
from the library's index helpers), so a layout bug in the op shows as a wrong token; the Pallas
kernels from head_major caches, one per layer (a layer sliced out of a stack would be a copy).

The q, k and v projection weights are concatenated once when the decoder is built (`fuse_qkv`), so a
layer computes qkv with one matmul and hands it to `rope_and_cache_qkv`, which reads q, k and v in
place: no slice of the projection is copied before the op. `random_params` and `hf_state_dict` keep
the three separate weights (the checkpoint's form).

Qwen3's q_norm / k_norm are the op's own fused QK-RMSNorm (q_norm_weight / k_norm_weight with the
config's rms_norm_eps): no separate pass over q and k. impl="baseline" skips them with the rest of the op.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np

import jax_rope_cache as jrc
from jax_rope_cache import attention as attn
from jax_rope_cache import contract
from jax_rope_cache.backends import xla

__all__ = ["DecoderConfig", "BlockAllocator", "Decoder", "TINY_CONFIGS", "LLAMA_31_8B_CONFIG", "random_params",
           "random_params_on_device", "params_digest", "hf_state_dict", "slot_mapping", "rope_and_write",
           "load_hf_reference", "TINY_SEEDS", "HF_LOGIT_BOUND"]

_LLAMA3_TINY_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     # 64, not Llama-3.1's 8192: at the short positions of a test the law then changes
                     # most frequencies (wavelengths > 16 are smoothed or divided by 8), so a wrong law shows.
                     "original_max_position_embeddings": 64}

# Tiny random-weight models in Hugging Face config.json form (what LlamaConfig / Qwen3Config take).
TINY_CONFIGS: dict[str, dict] = {
    "tiny-llama-3.1": {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 256, "hidden_size": 128,
        "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 32, "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "rope_scaling": dict(_LLAMA3_TINY_ROPE), "hidden_act": "silu", "attention_bias": False,
        "mlp_bias": False, "tie_word_embeddings": False,
    },
    "tiny-qwen3": {
        # head_dim 64 != hidden_size / heads (32), as in real Qwen3 (5120 hidden, 64 x 128 heads).
        "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "vocab_size": 256, "hidden_size": 128,
        "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 64, "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "rope_scaling": None, "hidden_act": "silu", "attention_bias": False, "tie_word_embeddings": True,
        "use_sliding_window": False,
    },
}

# Llama-3.1-8B's shapes (public config.json), for the benchmark; weights are random.
LLAMA_31_8B_CONFIG = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 128, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192},
    "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False,
}

# The recorded models' seeds (tools/record_hf_model.py draws their weights with these).
TINY_SEEDS = {"tiny-llama-3.1": 1, "tiny-qwen3": 2}

# Logits of this decoder vs transformers', float32 on both sides, same weights: max |difference|
# allowed. Measured on CPU over every impl x layout: tiny Llama (logits up to |9.1|) 4.8e-5 with the
# kernel, 3.4e-5 with the XLA path (2.8e-5 / 2.6e-5 with transformers' own float32 RoPE tables
# swapped in: the rest is summation order); tiny Qwen3 (logits up to |1.5|) 2.5e-6; tiny DeepSeek-V3
# (decoder_mla; logits up to |8|, absorbed MLA) 4.2e-5 kernel, 4.5e-5 XLA path, either cache layout.
# The fixture's models have a top-1 / top-2 logit gap >= 10x this bound at every step, so equal
# greedy tokens are a property of correct code, not luck.
HF_LOGIT_BOUND = 2e-4

_SUPPORTED = ("llama", "qwen3")


def config_int(config: Mapping, key: str) -> int:
    """config[key] as a positive integer, else a ValueError naming the key."""
    v = config.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"config[{key!r}]: expected a positive integer, got {v!r}")
    return v


def check_hf_family(config: Mapping, supported: tuple, unimplemented: tuple) -> str:
    """config['model_type'] if it is one of `supported`; else, or where a key of `unimplemented` is set
    or the activation is not SiLU, a ValueError naming the key."""
    mt = config.get("model_type")
    if mt not in supported:
        raise ValueError(f"config['model_type']: expected one of {supported}, got {mt!r}")
    for key in unimplemented:
        if config.get(key):
            raise ValueError(f"config[{key!r}]: {config[key]!r} is not implemented by this decoder")
    if config.get("hidden_act", "silu") != "silu":
        raise ValueError(f"config['hidden_act']: expected 'silu', got {config['hidden_act']!r}")
    return mt


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    q_heads: int
    kv_heads: int
    head_dim: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    qk_norm: bool  # Qwen3: RMSNorm over head_dim of every q and k head before RoPE

    @property
    def gains(self) -> dict:
        """{weight name: gain} of `random_params` (std = gain / sqrt(fan_in))."""
        return _GAIN

    @classmethod
    def from_hf(cls, config: Mapping) -> DecoderConfig:
        """Reads a Hugging Face-style config dict; raises ValueError naming a key this decoder
        does not implement (biases, activations other than SiLU, sliding windows)."""
        mt = check_hf_family(config, _SUPPORTED, ("attention_bias", "mlp_bias", "use_sliding_window"))

        need = functools.partial(config_int, config)
        heads = need("num_attention_heads")
        kv = need("num_key_value_heads") if config.get("num_key_value_heads") is not None else heads
        if heads % kv:
            raise ValueError(f"config['num_key_value_heads']: must divide num_attention_heads ({heads}), got {kv}")
        head_dim = need("head_dim") if config.get("head_dim") is not None else need("hidden_size") // heads
        # Qwen3 ties by default in transformers only for some sizes; the config decides.
        return cls(model_type=mt, vocab_size=need("vocab_size"), hidden_size=need("hidden_size"),
                   intermediate_size=need("intermediate_size"), num_layers=need("num_hidden_layers"),
                   q_heads=heads, kv_heads=kv, head_dim=head_dim,
                   rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
                   tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
                   qk_norm=mt == "qwen3")

    def param_shapes(self) -> dict:
        """{name: shape} of `random_params`' arrays; per-layer weights are stacked [L, ...] and
        projections stored [in, out] (x @ w)."""
        L, H, I, V = self.num_layers, self.hidden_size, self.intermediate_size, self.vocab_size
        qd, kd = self.q_heads * self.head_dim, self.kv_heads * self.head_dim
        layers = {"attn_norm": (L, H), "wq": (L, H, qd), "wk": (L, H, kd), "wv": (L, H, kd), "wo": (L, qd, H),
                  "mlp_norm": (L, H), "w_gate": (L, H, I), "w_up": (L, H, I), "w_down": (L, I, H)}
        if self.qk_norm:
            layers |= {"q_norm": (L, self.head_dim), "k_norm": (L, self.head_dim)}
        out = {"embed": (V, H), "final_norm": (H,), "layers": layers}
        if not self.tie_word_embeddings:
            out["lm_head"] = (H, V)
        return out


# ---- weights ------------------------------------------------------------------------------------
# Scales are chosen so that the tiny random model is NOT degenerate: attention logits of order
# a few units (so attention is position-sensitive, not uniform) and well separated top tokens.
_GAIN = {"wq": 2.0, "wk": 2.0, "wv": 1.0, "wo": 1.0, "w_gate": 1.0, "w_up": 1.0, "w_down": 1.0, "lm_head": 2.0}


def _norm_init(name: str) -> tuple[float, float]:
    """(mean, std) of a norm weight: not all ones, so a norm applied to the wrong tensor shows."""
    return (1.5, 0.2) if name in ("q_norm", "k_norm") else (1.0, 0.2)


def _leaves(shapes: dict, prefix=()):
    for name in sorted(shapes):
        if isinstance(shapes[name], dict):
            yield from _leaves(shapes[name], prefix + (name,))
        else:
            yield prefix + (name,), shapes[name]


def _init_value(name: str, shape, normal, gains: Mapping):
    if name.endswith("norm"):
        mean, std = _norm_init(name)
        return mean + std * normal(shape)
    if name.endswith("bias"):  # e.g. a router's score correction: small, so it shifts choices, not decides them
        return 0.05 * normal(shape)
    if name == "embed":
        # small next to the layers' outputs (~1 per channel): with tied embeddings a dominant
        # residual would make every token its own argmax (a model that repeats one token)
        return 0.03 * normal(shape)
    fan_in = shape[-2]
    return (gains[name] / math.sqrt(fan_in)) * normal(shape)


def _set(tree: dict, path, value):
    for p in path[:-1]:
        tree = tree.setdefault(p, {})
    tree[path[-1]] = value


def random_params(cfg: DecoderConfig, seed: int, dtype=np.float32) -> dict:
    """Random weights from numpy's PCG64 generator, drawn in sorted name order: the same seed
    gives the same weights on every machine (`params_digest` checks it)."""
    rng = np.random.default_rng(seed)
    out: dict = {}
    for path, shape in _leaves(cfg.param_shapes()):
        value = _init_value(path[-1], shape, lambda s: rng.standard_normal(s, dtype=np.float64), cfg.gains)
        _set(out, path, value.astype(np.float32).astype(dtype))
    return out


def random_params_on_device(cfg: DecoderConfig, seed: int, dtype=jnp.bfloat16, device=None) -> dict:
    """The same scales drawn by jax.random on the device: for benchmark-sized models, whose
    numpy generation and host-to-device copy would take minutes."""
    out: dict = {}
    leaves = list(_leaves(cfg.param_shapes()))
    keys = jax.random.split(jax.random.key(seed), len(leaves))

    def drawer(name, shape):
        return jax.jit(lambda key: _init_value(name, shape, lambda s: jax.random.normal(key, s, jnp.float32),
                                               cfg.gains).astype(dtype))

    with jax.default_device(device or jax.devices()[0]):
        for key, (path, shape) in zip(keys, leaves):
            _set(out, path, drawer(path[-1], shape)(key))
    return out


def params_digest(params: dict) -> str:
    """sha256 over the names, shapes, dtypes and bytes of every array (sorted by name)."""
    h = hashlib.sha256()

    def walk(tree, prefix):
        for name in sorted(tree):
            if isinstance(tree[name], dict):
                walk(tree[name], prefix + name + "/")
                continue
            a = np.ascontiguousarray(np.asarray(tree[name]))
            h.update(f"{prefix}{name}:{a.shape}:{a.dtype.name};".encode())
            h.update(a.tobytes())

    walk(params, "")
    return h.hexdigest()


def hf_state_dict(cfg: DecoderConfig, params: dict) -> dict[str, np.ndarray]:
    """The same weights under Hugging Face's LlamaForCausalLM / Qwen3ForCausalLM names
    (projections transposed to [out, in]); numpy arrays, for `load_state_dict` after torch.from_numpy."""
    t = lambda a: np.ascontiguousarray(np.asarray(a).T)  # noqa: E731
    lay = params["layers"]
    sd = {"model.embed_tokens.weight": np.asarray(params["embed"]),
          "model.norm.weight": np.asarray(params["final_norm"])}
    sd["lm_head.weight"] = np.asarray(params["embed"]) if cfg.tie_word_embeddings else t(params["lm_head"])
    names = {"wq": "self_attn.q_proj", "wk": "self_attn.k_proj", "wv": "self_attn.v_proj", "wo": "self_attn.o_proj",
             "w_gate": "mlp.gate_proj", "w_up": "mlp.up_proj", "w_down": "mlp.down_proj"}
    norms = {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm", "q_norm": "self_attn.q_norm",
             "k_norm": "self_attn.k_norm"}
    for i in range(cfg.num_layers):
        for ours, theirs in names.items():
            sd[f"model.layers.{i}.{theirs}.weight"] = t(lay[ours][i])
        for ours, theirs in norms.items():
            if ours in lay:
                sd[f"model.layers.{i}.{theirs}.weight"] = np.asarray(lay[ours][i])
    return sd


def fuse_qkv(params: dict) -> dict:
    """params with each layer's wq, wk, wv replaced by wqkv = [wq | wk | wv] ([L, H, (QH + 2 KH) * D]):
    x @ wqkv is the fused QKV tensor rope_and_cache_qkv reads (each token's q heads, k heads, v heads)."""
    layers = dict(params["layers"])
    layers["wqkv"] = jnp.concatenate([layers.pop("wq"), layers.pop("wk"), layers.pop("wv")], axis=-1)
    return {**params, "layers": layers}


# ---- paged cache bookkeeping ----------------------------------------------------------------------
class BlockAllocator:
    """Cache blocks handed out from a free list (shuffled by `seed`, so one sequence's blocks are
    scattered over the cache) and given back when a sequence ends."""

    def __init__(self, num_blocks: int, block_size: int, seed: int | None = 0):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks, block_size: expected >= 1, got {num_blocks}, {block_size}")
        self.num_blocks, self.block_size = num_blocks, block_size
        order = np.arange(num_blocks)
        if seed is not None:
            order = np.random.default_rng(seed).permutation(num_blocks)
        self._free = [int(b) for b in order[::-1]]  # pop() from the end
        self._owned: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate(self, num_tokens: int) -> list[int]:
        """Blocks for a sequence of num_tokens tokens (prompt + every token it will generate)."""
        n = self.blocks_for(num_tokens)
        if n > len(self._free):
            raise RuntimeError(f"out of cache blocks: {num_tokens} tokens need {n} blocks, {len(self._free)} free")
        got = [self._free.pop() for _ in range(n)]
        self._owned.update(got)
        return got

    def free(self, blocks) -> None:
        for b in blocks:
            if b not in self._owned:
                raise ValueError(f"blocks: block {b} is not allocated")
            self._owned.remove(b)
            self._free.append(b)

    @staticmethod
    def block_table(seqs: list[list[int]], width: int | None = None) -> np.ndarray:
        """[B, width] int32 block ids, padded with -1."""
        width = max(map(len, seqs)) if width is None else width
        out = np.full((len(seqs), width), -1, np.int32)
        for i, blocks in enumerate(seqs):
            out[i, : len(blocks)] = blocks
        return out


def slot_mapping(block_table, positions, block_size: int):
    """Slot of each (sequence, position): block_table[b, pos // BS] * BS + pos % BS; -1 where
    the position is negative (padding) or past the sequence's blocks."""
    bt = jnp.asarray(block_table)
    pos = jnp.asarray(positions)
    col = pos // block_size
    inside = (pos >= 0) & (col < bt.shape[1])
    blk = jnp.take_along_axis(bt, jnp.clip(col, 0, bt.shape[1] - 1), axis=1)
    return jnp.where(inside & (blk >= 0), blk * block_size + pos % block_size, -1).astype(jnp.int32)


def dequantize_blocks(keys, values, scale_caches, layer, block_table, dtype):
    """keys, values [B, S, KH, D] (fp8 or int8; int4: uint8 [B, S, KH, D/2], from gather_blocks) times their per-token scales from the
    stacked scale caches [L, NB, KH, BS] ([block, head, offset] of each slot), as `dtype`."""
    bt = jnp.maximum(jnp.asarray(block_table), 0)
    B, MB = bt.shape
    out = []
    for x, sc in zip((keys, values), scale_caches):
        s = sc[layer, bt]                                   # [B, MB, KH, BS]
        s = s.transpose(0, 1, 3, 2).reshape(B, -1, s.shape[2])  # [B, MB * BS, KH]
        if x.dtype == contract.INT4:
            x = xla.unpack_int4(x)
        out.append((x.astype(jnp.float32) * s[..., None]).astype(dtype))
    return tuple(out)


KV_QUANTS = (None, "per_token", "int8_per_token", "int4_per_token", "nvfp4", "mxfp4")
# the cache dtype of each kv_quant (per_token, int8, int4: one float32 scale per token and kv head;
# uint8: int4 bytes, or E2M1 pairs of the block-scaled formats nvfp4 / mxfp4)
KV_QUANT_DTYPES = {"per_token": np.dtype(jnp.float8_e4m3fn), "int8_per_token": contract.INT8,
                   "int4_per_token": contract.INT4, "nvfp4": contract.INT4, "mxfp4": contract.INT4}


def dequantize_block_scaled(keys, values, scale_caches, layer, block_table, layout: str, fmt: str, global_scale,
                            dtype):
    """keys, values: uint8 E2M1 pairs [B, S, KH, D/2] (from gather_blocks) dequantized with their
    block scales, gathered the same way (a block-scale cache has the cache's axes), as `dtype`."""
    ks, vs = attn.gather_blocks(scale_caches, layer, block_table, layout)
    return tuple(xla.dequantize_blocks(x, s, fmt, global_scale if fmt == "nvfp4" else None).astype(dtype)
                 for x, s in ((keys, ks), (values, vs)))


# ---- the model ------------------------------------------------------------------------------------
def touch_caches(caches, values, slots, layer, block_size: int):
    """The "baseline" impl's stand-in for the op: element [layer, block of slots[0], 0, ...] of each
    stacked cache (layer None: [block of slots[0], 0, ...] of one layer's cache) set in place
    (dynamic_update_slice) to the first element of its value, any layout. One tiny kernel per
    cache; the caches depend on the values, and what reads them next on the write."""
    blk = jnp.maximum(slots[0], 0) // block_size
    out = []
    for c, x in zip(caches, values):
        lead = (blk,) if layer is None else (layer, blk)
        start = lead + (0,) * (c.ndim - len(lead))
        out.append(jax.lax.dynamic_update_slice(c, x.reshape(-1)[:1].astype(c.dtype).reshape((1,) * c.ndim), start))
    return tuple(out)


def rope_and_write(qkv, caches, slots, positions, cos, sin, *, layout: str, layer, num_q_heads: int,
                   num_kv_heads: int, **options):
    """rope_and_cache_qkv on the decoder's caches in `layout`: -> (q [T, QH, D], k [T, KH, D], caches,
    *scale caches). `caches`: (key_cache, value_cache), or (kv_cache,) for kv_merged; one layer's
    (layer None) or stacked [L, ...] at `layer`. The decoder's only call of the op."""
    key, value = (tuple(caches) + (None,))[:2]
    q, k, *out = jrc.rope_and_cache_qkv(qkv, key, value, slots, positions, cos, sin, layout=layout, layer=layer,
                                        num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, **options)
    return (q, k, tuple(c for c in out[:2] if c is not None), *out[2:])


def rms_norm(x, weight, eps):
    """Hugging Face's order: in float32, normalised, rounded to x's dtype, then times the weight."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * y.astype(x.dtype)


IMPLS = ("kernel", "xla", "baseline")

# The decode program's XLA options on CUDA unless the caller gives its own: cuBLAS GEMMs instead of
# XLA's Triton GEMMs. On the H200 (jaxlib 0.11.2) a 32-layer Llama-3.1-8B decode step took 6.0 ms
# with them against 13.1 ms at batch 64, for every implementation (docs/performance.md).
CUDA_DECODE_OPTIONS = {"xla_gpu_enable_triton_gemm": False}


def default_decode_options(device) -> dict:
    """The decode program's XLA options on `device` when the caller names none: CUDA_DECODE_OPTIONS
    on an NVIDIA GPU, none elsewhere (not measured on ROCm)."""
    version = str(getattr(getattr(device, "client", None), "platform_version", "")).lower()
    return dict(CUDA_DECODE_OPTIONS) if device.platform in ("gpu", "cuda") and "rocm" not in version else {}


class Decoder:
    """A decoder and its paged caches. `impl`: "kernel" or "xla" (the op's implementations), or
    "baseline" (a wrong model, only for timing how much of a step the op takes): no RoPE and no
    QK-norm, and instead of the cache write one element of each cache in the block of the step's
    first slot is overwritten in place with a value of k / v (touch_caches). Attention then depends
    on the layer's cache write as it does with the op (the caches change every layer of every step),
    so XLA schedules the step as it does with the op; a model with no write at all would let XLA
    treat the caches as loop invariants of the decode loop.

    `attention` (attention.ATTENTIONS): how a decode step (one query per sequence) reads the cache:
    "gather" (jax.numpy, any layout), "pallas_gpu" / "pallas_tpu" (JAX's Pallas paged-attention
    kernels, on head_major caches; on the CPU they run interpreted). None: the fastest on the device
    (attention.default_attention) for `layout` (None: that attention's layout, flash for gather).
    Prefill always gathers, from whatever layout the op wrote.

    The caches live in `self.caches`, a tuple: with gather, stacked [L, ...] arrays ((key_cache,
    value_cache), or (kv_cache,) for kv_merged, in `layout`); with a Pallas attention (or
    per_layer=True), each layer's own caches, layer by layer ((k_0, v_0, k_1, v_1, ...)), and the
    layers always unrolled. Every
    jitted call donates them and stores the returned ones. The tables (cos, sin) and the weights are
    arguments of the jitted steps, not constants baked into them.
    kv_quant="per_token": float8_e4m3fn caches with one scale per (token, kv head) computed by the op;
    kv_quant="int8_per_token" / "int4_per_token": int8 caches / uint8 caches of two int4 values a byte,
    the same scale caches (docs/numerics.md#int8-caches-per-token-and-kv-head);
    kv_quant="nvfp4" / "mxfp4": uint8 caches of two E2M1 values a byte with block-scale caches
    (docs/numerics.md#nvfp4-and-mxfp4-caches; layouts flash, hnd, head_major); NVFP4's global decode
    scale is `kv_global_scale` for K and V (default 1.0: block scales amax / 6, in E4M3's range for
    |values| from ~0.01 to 2688);
    the scale caches ([L, NB, KH, BS] each) follow the two caches in `self.caches` and attention reads
    the caches dequantized (stored * scale); gather only.
    decode_compiler_options: XLA options of the decode program only (jax.jit's compiler_options);
    None: default_decode_options(device) (cuBLAS GEMMs on NVIDIA GPUs); {}: XLA's defaults.

    Subclasses (decoder_mla.MlaDecoder) change the model through `config_class`, `layouts`,
    `_prepare_params`, `_new_caches`, `_segments`, `_attention` and `_mlp`; the steps and the host
    side are shared.
    """

    config_class = DecoderConfig
    layouts = jrc.LAYOUTS
    kv_quants = KV_QUANTS
    attentions = attn.ATTENTIONS

    def __init__(self, config: Mapping, params: dict, *, layout=None, block_size=16, num_blocks=None,
                 max_seqs=8, max_len=None, impl="kernel", dtype=jnp.float32, unroll=1, seed=0, tables=None,
                 device=None, cache_fill="random", kv_quant=None, decode_compiler_options=None, attention=None,
                 per_layer=None, kv_global_scale=1.0):
        if impl not in IMPLS:
            raise ValueError(f"impl: expected one of {IMPLS}, got {impl!r}")
        if kv_quant not in self.kv_quants:
            raise ValueError(f"kv_quant: expected one of {self.kv_quants}, got {kv_quant!r}")
        self.kv_quant = kv_quant
        self.device = device or jax.devices()[0]
        self.attention, layout = self.choose_attention(attention, layout, kv_quant, self.device)
        if layout not in self.layouts:
            raise ValueError(f"layout: expected one of {self.layouts}, got {layout!r}")
        self.block_format = kv_quant if kv_quant in contract.BLOCK_FORMATS else None
        if kv_quant != "nvfp4" and kv_global_scale != 1.0:
            raise ValueError(f"kv_global_scale: NVFP4's global decode scale (kv_quant='nvfp4'); expected 1.0 (unused) "
                             f"with kv_quant={kv_quant!r}, got {kv_global_scale!r}")
        if kv_quant == "nvfp4":
            contract.check_global_scale("kv_global_scale", kv_global_scale)
        self.kv_global_scale = float(np.float32(kv_global_scale)) if kv_quant == "nvfp4" else None
        if kv_quant and self.block_format is None and contract.cache_layout(layout).scale_axes != ("NB", "KH", "BS"):
            raise ValueError(f"kv_quant: {kv_quant!r} caches in a layout with [NB, KH, BS] scale caches, "
                             f"got layout {layout!r}")
        self.hf_config = dict(config)
        self.cfg = self.config_class.from_hf(config)
        if self.block_format is not None:  # the layout and the head dim (whole blocks in a row)
            contract.check_block_cache_dtype(self.block_format, contract.INT4, layout, self.cfg.head_dim)
        self.layout, self.block_size, self.impl, self.unroll = layout, block_size, impl, unroll
        # a Pallas kernel reads a layer's caches as an operand: one cache per layer, layers unrolled
        self.per_layer = self.attention != "gather" if per_layer is None else bool(per_layer)
        if self.attention != "gather" and not self.per_layer:
            raise ValueError(f"per_layer: attention {self.attention!r} reads one cache per layer, got False")
        if self.per_layer and kv_quant:
            raise ValueError(f"per_layer: the scale caches of kv_quant={kv_quant!r} are stacked, got True")
        self.dtype = np.dtype(dtype)
        max_len = max_len or config["max_position_embeddings"]
        if tables is None:
            cos, sin, info = jrc.rope_tables_from_hf_config(config, max_pos=max_len, dtype=np.float32)
            self.rotary_dim, self.is_neox = info.rotary_dim, info.is_neox
        else:  # (cos, sin, rotary_dim, is_neox): e.g. deliberately wrong tables in tests
            cos, sin, self.rotary_dim, self.is_neox = tables
        self.tables = jax.device_put((jnp.asarray(cos), jnp.asarray(sin)), self.device)
        self.max_len = int(self.tables[0].shape[0])
        self.blocks_per_seq = -(-self.max_len // block_size)
        num_blocks = num_blocks or max_seqs * self.blocks_per_seq
        self.allocator = BlockAllocator(num_blocks, block_size, seed=seed)
        self.params = self._prepare_params(
            jax.device_put(jax.tree.map(lambda a: jnp.asarray(a, self.dtype), params), self.device))
        if cache_fill not in ("random", "zeros"):
            raise ValueError(f"cache_fill: expected 'random' or 'zeros', got {cache_fill!r}")
        self.caches = self._new_caches(num_blocks, cache_fill, seed)
        if self.block_format is not None:
            self.caches += jrc.make_kv_scale_cache(num_blocks, block_size, self.cfg.kv_heads,
                                                   num_layers=self.cfg.num_layers, device=self.device, layout=layout,
                                                   kv_format=self.block_format, head_dim=self.cfg.head_dim)
        elif kv_quant:
            self.caches += jrc.make_kv_scale_cache(num_blocks, block_size, self.cfg.kv_heads,
                                                   num_layers=self.cfg.num_layers, device=self.device)
        # Matmuls in full float32 where the model is float32 (GPUs would otherwise use TF32).
        self._precision = jax.lax.Precision.HIGHEST if self.dtype == np.float32 else None
        self.prefill_fn = jax.jit(self._prefill, donate_argnums=(2,))
        # XLA options of the decode program only: with XLA's Triton GEMMs, at decode batch sizes XLA may
        # split the q/k/v projection's K dimension, and the partial sums' reduction then fuses into
        # XLA's own consumers but not into a custom call (docs/performance.md).
        self.decode_compiler_options = dict(default_decode_options(self.device) if decode_compiler_options is None
                                            else decode_compiler_options)
        self.decode_fn = jax.jit(self._decode, static_argnames=("steps", "with_logits"), donate_argnums=(2,),
                                 compiler_options=self.decode_compiler_options or None)

    @classmethod
    def choose_attention(cls, attention, layout, kv_quant, device) -> tuple[str, str]:
        """(attention, layout) the decoder takes for these arguments (either may be None): None
        attention is the device's fastest where it reads `layout` and the caches are unquantized,
        else gather."""
        if attention is None:
            best = attn.default_attention(device)
            fits = kv_quant is None and layout in (None, attn.layout_of(best)) and best in cls.attentions
            attention = best if fits else "gather"
        if attention not in cls.attentions:
            raise ValueError(f"attention: expected one of {cls.attentions} or None, got {attention!r}")
        attn.check_platform(attention, device)
        want = attn.layout_of(attention)
        if layout is None:
            layout = want or cls.layouts[0]
        if want and layout != want:
            raise ValueError(f"layout: attention {attention!r} reads {want!r} caches, got {layout!r}")
        if want and kv_quant:
            raise ValueError(f"kv_quant: attention {attention!r} reads unquantized caches, got {kv_quant!r}")
        return attention, layout

    @property
    def cache_dtype(self):
        """The caches' dtype: KV_QUANT_DTYPES[kv_quant] with kv_quant, else the model's."""
        return KV_QUANT_DTYPES[self.kv_quant] if self.kv_quant else self.dtype

    @property
    def _n_caches(self) -> int:
        """Caches per layer: 1 for kv_merged, else 2 (key, value)."""
        return 1 if self.layout == "kv_merged" else 2

    @property
    def scale_caches(self):
        """(k_scale_cache, v_scale_cache) with kv_quant, else ()."""
        return tuple(self.caches[2:4]) if self.kv_quant else ()

    def stacked_caches(self) -> tuple:
        """The caches as stacked [L, ...] arrays, (key_cache, value_cache) or (kv_cache,): `self.caches`
        itself with gather, a stacked copy of the per-layer caches otherwise."""
        n = self._n_caches
        if not self.per_layer:
            return tuple(self.caches[:n])
        return tuple(jnp.stack(self.caches[j::n]) for j in range(n))

    def _set_stacked(self, j, value):
        n = self._n_caches
        if not self.per_layer:
            self.caches = self.caches[:j] + (value,) + tuple(self.caches[j + 1:])
        else:
            caches = list(self.caches)
            caches[j::n] = [jnp.asarray(c) for c in value]
            self.caches = tuple(caches)

    @property
    def key_cache(self):
        """The (stacked) key cache; kv_merged: the one cache."""
        return self.stacked_caches()[0]

    @key_cache.setter
    def key_cache(self, value):
        self._set_stacked(0, value)

    @property
    def value_cache(self):
        """The (stacked) value cache; None for kv_merged (values live in the one cache)."""
        return self.stacked_caches()[1] if self._n_caches == 2 else None

    @value_cache.setter
    def value_cache(self, value):
        self._set_stacked(1, value)

    def _prepare_params(self, params):
        return fuse_qkv(params)

    def _new_caches(self, num_blocks, fill, seed):
        """Stacked [L, ...] caches in the layout, or each layer's own (per_layer). fill="random" (numpy
        normals, seeded): a read of a slot nobody wrote shows as a wrong token, not as a harmless
        zero; "zeros" for large pools."""
        cfg = self.cfg
        cdt = self.cache_dtype
        shapes = [s for s in jrc.cache_shapes(self.layout, num_blocks, self.block_size, cfg.kv_heads, cfg.head_dim, cdt)
                  if s is not None]  # kv_merged: one array
        if self.per_layer:
            return self._filled([tuple(s) for _ in range(cfg.num_layers) for s in shapes], fill, seed, cdt)
        return self._filled([(cfg.num_layers,) + tuple(s) for s in shapes], fill, seed, cdt)

    def _filled(self, shapes, fill, seed, dtype=None):
        """Arrays of these shapes on the device (`dtype`, default the model's): zeros, or seeded numpy normals."""
        dtype = self.dtype if dtype is None else dtype
        if fill == "zeros":
            return tuple(jnp.zeros(s, dtype, device=self.device) for s in shapes)
        rng = np.random.default_rng(seed)
        return tuple(jax.device_put(rng.standard_normal(s, np.float32).astype(dtype), self.device)
                     for s in shapes)

    # -- building blocks (traced) --
    def _mm(self, x, w):
        return jnp.matmul(x, w, precision=self._precision)

    def _attention(self, w, i, h, caches, step, tables):
        """One layer's attention of the normalised hidden states h [B, P, H]: -> (output [B, P, H], caches).
        `step`: the call's slots [B*P], flat positions [B*P], query positions [B, P] and block table
        (and, for a Pallas attention, the kernels' page table and lengths)."""
        cfg = self.cfg
        B, P = h.shape[:2]
        n = self._n_caches
        if self.per_layer:  # layer i's own caches (i is a Python int: the layers are unrolled)
            mine, layer, sc = tuple(caches[i * n:(i + 1) * n]), None, ()
        else:
            mine, layer, sc = tuple(caches[:n]), i, tuple(caches[n:])  # sc: the scale caches with kv_quant
        cos, sin = tables
        qkv = self._mm(h, w["wqkv"]).reshape(B * P, -1)  # [B*P, (QH + 2 KH) * D]: one projection
        if self.impl == "baseline":
            qh, kh, d = cfg.q_heads, cfg.kv_heads, cfg.head_dim
            q = qkv[:, :qh * d].reshape(B * P, qh, d)
            k, v = (qkv[:, (qh + j * kh) * d:(qh + (j + 1) * kh) * d].reshape(B * P, kh, d) for j in (0, 1))
            mine = touch_caches(mine, (k, v)[:n], step["slots"], layer, self.block_size)
        else:
            norm = dict(q_norm_weight=w["q_norm"], k_norm_weight=w["k_norm"],
                        norm_eps=cfg.rms_norm_eps) if cfg.qk_norm else {}
            scales = dict(k_scale_cache=sc[0], v_scale_cache=sc[1]) if sc else {}
            if self.kv_global_scale is not None:
                scales.update(k_scale=self.kv_global_scale, v_scale=self.kv_global_scale)
            q, k, mine, *sc = rope_and_write(qkv, mine, step["slots"], step["flat_pos"], cos, sin, layout=self.layout,
                                             layer=layer, num_q_heads=cfg.q_heads, num_kv_heads=cfg.kv_heads,
                                             is_neox=self.is_neox, rotary_dim=self.rotary_dim, impl=self.impl,
                                             **norm, **scales)
        q = q.reshape(B, P, cfg.q_heads, cfg.head_dim)
        if "pages" in step:  # one query per sequence: the Pallas kernel on this layer's caches
            o = attn.paged_decode(self.attention, q[:, 0], mine[0], mine[1], step["pages"], step["lengths"],
                                  block_size=self.block_size, interpret=attn.interpret_on(self.device))
            o = o.reshape(B, 1, cfg.q_heads * cfg.head_dim)
        else:
            keys, values = attn.gather_blocks(mine, layer, step["block_table"], self.layout)
            if sc and self.block_format is not None:
                keys, values = dequantize_block_scaled(keys, values, sc, i, step["block_table"], self.layout,
                                                       self.block_format, self.kv_global_scale, self.dtype)
            elif sc:
                keys, values = dequantize_blocks(keys, values, sc, i, step["block_table"], self.dtype)
            o = attn.attend(q, keys, values, step["q_pos"], precision=self._precision)
        if self.per_layer:
            caches = tuple(caches[:i * n]) + tuple(mine) + tuple(caches[(i + 1) * n:])
        else:
            caches = (*mine, *sc)
        return self._mm(o, w["wo"]), caches

    def _mlp(self, w, h):
        """SwiGLU of the normalised hidden states."""
        return self._mm(jax.nn.silu(self._mm(h, w["w_gate"])) * self._mm(h, w["w_up"]), w["w_down"])

    def _segments(self, params):
        """[(stacked weights [n, ...], first layer index, mlp)]: runs of layers one `lax.scan` each."""
        return [(params["layers"], 0, self._mlp)]

    def _forward(self, params, tables, caches, tokens, positions, block_table):
        """tokens, positions [B, P] (position -1: padding, writes nothing) -> hidden [B, P, H]."""
        cfg = self.cfg
        step = dict(slots=slot_mapping(block_table, positions, self.block_size).reshape(-1),
                    flat_pos=jnp.maximum(positions, 0).reshape(-1), q_pos=jnp.maximum(positions, 0),
                    block_table=block_table)
        if self.attention != "gather" and tokens.shape[1] == 1:  # decode: the Pallas kernel reads the cache
            width = attn.page_width(self.attention, block_table.shape[1], self.block_size,
                                    cfg.q_heads // cfg.kv_heads)
            step.update(pages=attn.page_table(block_table, width), lengths=step["q_pos"][:, 0] + 1)
        x = params["embed"][tokens]

        def layer(mlp, carry, xs):
            x, caches = carry
            w, i = xs
            o, caches = self._attention(w, i, rms_norm(x, w["attn_norm"], cfg.rms_norm_eps), caches, step, tables)
            x = x + o
            x = x + mlp(w, rms_norm(x, w["mlp_norm"], cfg.rms_norm_eps))
            return (x, caches), None

        for weights, first, mlp in self._segments(params):
            n = jax.tree.leaves(weights)[0].shape[0]
            if self.unroll is True or self.unroll >= n or self.per_layer:
                # Fully unrolled: a Python loop, so each layer index reaches the op as a constant. A
                # scan's traced index is a device scalar that the kernel reads (one tiny XLA kernel
                # per layer to make it; XLA's own path folds it into its scatter indices). Per-layer
                # caches are picked by that constant.
                for j in range(n):
                    (x, caches), _ = layer(mlp, (x, caches), (jax.tree.map(lambda a: a[j], weights), first + j))
                continue
            (x, caches), _ = jax.lax.scan(functools.partial(layer, mlp), (x, caches),
                                          (weights, first + jnp.arange(n)), unroll=self.unroll)
        return rms_norm(x, params["final_norm"], cfg.rms_norm_eps), caches

    def _logits(self, params, h):
        w = params["embed"].T if self.cfg.tie_word_embeddings else params["lm_head"]
        return jnp.matmul(h, w, precision=self._precision, preferred_element_type=jnp.float32)

    def _prefill(self, params, tables, caches, tokens, lengths, block_table):
        """tokens [B, P] (padded), lengths [B] -> (first generated token [B], its logits [B, V], caches)."""
        B, P = tokens.shape
        pos = jnp.arange(P)[None, :]
        positions = jnp.where(pos < lengths[:, None], pos, -1)
        h, caches = self._forward(params, tables, caches, tokens, positions, block_table)
        last = jnp.take_along_axis(h, (lengths - 1)[:, None, None], axis=1)[:, 0]
        logits = self._logits(params, last)
        return jnp.argmax(logits, axis=-1).astype(jnp.int32), logits, caches

    def _decode(self, params, tables, caches, tokens, positions, block_table, *, steps, with_logits=True):
        """`steps` greedy steps: the token at positions[b] goes in, the next comes out.
        -> (tokens [steps, B], logits [steps, B, V] or None, caches)."""
        def step(carry, _):
            tok, pos, caches = carry
            h, caches = self._forward(params, tables, caches, tok[:, None], pos[:, None], block_table)
            logits = self._logits(params, h[:, 0])
            nxt = jnp.argmax(logits, axis=-1).astype(jnp.int32)
            return (nxt, pos + 1, caches), (nxt, logits if with_logits else None)

        (_, _, caches), (toks, logits) = jax.lax.scan(step, (tokens, positions, caches), None, length=steps)
        return toks, logits, caches

    # -- host side --
    def prefill(self, prompts, block_table):
        lengths = np.array([len(p) for p in prompts], np.int32)
        grid = np.zeros((len(prompts), int(lengths.max())), np.int32)
        for i, p in enumerate(prompts):
            grid[i, : len(p)] = p
        tok, logits, self.caches = self.prefill_fn(self.params, self.tables, self.caches, grid, lengths, block_table)
        return tok, logits, lengths

    def decode(self, tokens, positions, block_table, steps, with_logits=True):
        toks, logits, self.caches = self.decode_fn(self.params, self.tables, self.caches, tokens, positions,
                                                   block_table, steps=steps, with_logits=with_logits)
        return toks, logits

    def generate(self, prompts, new_tokens: int):
        """Greedy generation of new_tokens tokens after each prompt (token id lists of any lengths):
        one prefill, then new_tokens - 1 decode steps. Returns (tokens [B, new_tokens] int32,
        logits [B, new_tokens, V] float32) as numpy arrays; the sequences' blocks are freed after."""
        if new_tokens < 1:
            raise ValueError(f"new_tokens: expected >= 1, got {new_tokens}")
        for p in prompts:
            if not len(p) or len(p) + new_tokens > self.max_len:
                raise ValueError(f"prompts: lengths must be in [1, {self.max_len - new_tokens}], got {len(p)}")
        seqs = [self.allocator.allocate(len(p) + new_tokens) for p in prompts]
        try:
            bt = self.allocator.block_table(seqs, self.blocks_per_seq)
            first, first_logits, lengths = self.prefill(prompts, bt)
            toks, logits = [first[None]], [first_logits[None]]
            if new_tokens > 1:
                t, lg = self.decode(first, lengths, bt, new_tokens - 1)
                toks.append(t)
                logits.append(lg)
            toks = np.asarray(jnp.concatenate(toks)).T
            logits = np.asarray(jnp.concatenate(logits)).transpose(1, 0, 2)
        finally:
            for s in seqs:
                self.allocator.free(s)
        return toks, logits


def load_hf_reference(path: str) -> dict:
    """The fixture of tools/record_hf_model.py: {model name: {config, seed, digest, prompts
    (token lists), tokens [B, N], logits [B, N, V]}, "meta": {versions, new_tokens}}."""
    import json

    with np.load(path) as f:
        raw = {k: f[k] for k in f.files}
    out = {"meta": json.loads(str(raw["meta"]))}
    for key in raw:
        if key.endswith("/config"):
            name = key.split("/")[0]
            lengths = raw[f"{name}/lengths"]
            out[name] = {"config": json.loads(str(raw[key])), "seed": int(raw[f"{name}/seed"]),
                         "digest": str(raw[f"{name}/digest"]),
                         "prompts": [raw[f"{name}/prompts"][i, :n].tolist() for i, n in enumerate(lengths)],
                         "tokens": raw[f"{name}/tokens"], "logits": raw[f"{name}/logits"]}
    return out
