"""The public MLA API: mla_rope_and_cache, and the latent-cache helpers make_mla_cache / read_mla_cache."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jax_rope_cache import api, contract, primitive
from jax_rope_cache.mla import contract as mla_contract
from jax_rope_cache.mla import primitive as mla_primitive
from jax_rope_cache.mla import xla as mla_xla

ArrayLike = jax.typing.ArrayLike


def _check_refs(caches) -> bool:
    refs = [isinstance(c, jax.Ref) for c in caches]
    if any(refs) and not all(refs):
        raise TypeError("kv_cache: expected jax.Refs for both (ckv_cache, kpe_cache) or for neither, got a mix")
    return bool(refs[0])


def _distinct_buffers(caches) -> None:
    if len(caches) == 2 and all(api._is_concrete(c) for c in caches) and caches[0].nbytes \
            and api._first_buffer(caches[0]) is not None and api._first_buffer(caches[0]) == api._first_buffer(caches[1]):
        raise ValueError("kv_cache: expected two different buffers (ckv_cache, kpe_cache), got arrays sharing one")


def mla_rope_and_cache(q_nope: ArrayLike, q_pe: ArrayLike, kv_c: ArrayLike, k_pe: ArrayLike, kv_cache,
                       slot_mapping: ArrayLike, positions: ArrayLike, cos: ArrayLike, sin: ArrayLike, *,
                       layout: str = "combined", is_neox: bool = False, kv_scale: ArrayLike | None = None,
                       q_out_dtype=None, q_scale: ArrayLike | None = None, precision: str = "fp32",
                       impl: str | None = None, layer: int | ArrayLike | None = None, table_form: str = "half"):
    """MLA's RoPE and latent-cache write in one kernel (DeepSeek-V2/V3/R1, Kimi-K2).

    Args:
      q_nope: [T, QH, Dn] the query's non-rotated part (Dn = qk_nope_head_dim, or kv_lora_rank when
        W_UK is absorbed into the query), bfloat16 / float16 / float32.
      q_pe: [T, QH, Dr] the query's rope part (Dr = qk_rope_head_dim), q_nope's dtype.
      kv_c: [T, Dc] the compressed latent (Dc = kv_lora_rank), q_nope's dtype.
      k_pe: [T, Dr] the rope key (one per token, shared by every head), q_nope's dtype.
      kv_cache: layout "combined": one array [NB, BS, Dc + Dr] (vLLM / AITER / SGLang);
        layout "split": a pair (ckv_cache [NB, BS, Dc], kpe_cache [NB, BS, Dr]) (FlashInfer).
        q_nope's dtype or float8_e4m3fn / float8_e4m3fnuz / float8_e5m2 (then kv_scale is required). With
        `layer`, stacked as [L, ...]. Updated in place when donated at the outermost jit, or when
        jax.Refs (written in place and returned).
      slot_mapping: [T] int32/int64; slot s is block s // BS, offset s % BS; outside [0, NB*BS)
        (e.g. -1 for padding) writes nothing.
      positions: [T] int32/int64 rows of cos/sin, clamped to [0, max_pos - 1].
      cos, sin: [max_pos, Dr/2] (table_form "half", the default) or [max_pos, Dr] ("full"),
        bf16/f16/f32 (scaling law, YaRN's mscale included, inside: `rope_tables_from_hf_config`).
      layout: "combined" or "split" (above).
      is_neox: False (default; DeepSeek and Kimi rotate interleaved pairs (2i, 2i + 1)); True: (i, i + Dr/2).
      kv_scale: float8 caches only: a float scalar (used as float32); stored = fp8(sat(x * (1/kv_scale))).
      q_out_dtype: None (q_nope's dtype) or a float8 dtype (then q_scale is required): q_out quantized
        as the caches are, for an fp8 attention kernel.
      q_scale: the float8 q_out's scale (a float scalar), else None.
      precision: "fp32" or "native", as rope_and_cache.
      impl: None (the native kernel where the platform has one, else XLA), "kernel" or "xla".
      layer: None, or the layer (int or traced integer scalar) of stacked caches to write; a traced
        layer outside [0, L) writes nothing.
      table_form: "half" or "full", the form of cos and sin (said, never guessed; as rope_and_cache).

    Returns:
      (q_out [T, QH, Dn + Dr] = cat(q_nope, rope(q_pe)), k_pe_out [T, Dr] = rope(k_pe), kv_cache)
      with kv_cache in the structure it was given. jax_rope_cache.mla.reference states every rule.

    Not differentiable (every impl): jax.grad through it raises a TypeError.
    """
    mla_contract.check_layout(layout)
    caches = mla_contract.cache_tuple(kv_cache, layout)
    pack = (lambda cs: cs[0]) if layout == "combined" else tuple  # noqa: E731
    if _check_refs(caches):
        q_out, k_pe_out, new = mla_rope_and_cache(
            q_nope, q_pe, kv_c, k_pe, pack(tuple(r[...] for r in caches)), slot_mapping, positions, cos, sin,
            layout=layout, is_neox=is_neox, kv_scale=kv_scale, q_out_dtype=q_out_dtype, q_scale=q_scale,
            precision=precision, impl=impl, layer=layer, table_form=table_form)
        for r, c in zip(caches, mla_contract.cache_tuple(new, layout)):
            r[...] = c
        return q_out, k_pe_out, kv_cache
    spec = mla_contract.check_mla(q_nope, q_pe, kv_c, k_pe, pack(caches), slot_mapping, positions, cos, sin,
                                  layout=layout, is_neox=is_neox, kv_scale=kv_scale, q_out_dtype=q_out_dtype,
                                  q_scale=q_scale, precision=precision, layer=layer, table_form=table_form)
    if impl not in api.IMPLS:
        raise ValueError(f"impl: expected one of {api.IMPLS}, got {impl!r}")
    names = mla_contract.operands(layout)
    api._check_concrete(zip(names, (q_nope, q_pe, kv_c, k_pe, *caches, slot_mapping, positions, cos, sin, kv_scale,
                                    q_scale, layer)), distinct=False)
    _distinct_buffers(caches)
    slot_mapping, positions, spec = api._narrow_indices(slot_mapping, positions, spec)
    layer = api._host_layer(layer, spec)
    operands = tuple(jnp.asarray(a) for a in (q_nope, q_pe, kv_c, k_pe, *caches, slot_mapping, positions, cos, sin))
    operands += (api._scale_operand(kv_scale, False), api._scale_operand(q_scale, False),
                 api._layer_operand(layer, spec))
    if spec.num_tokens == 0:
        return (jnp.zeros((0, spec.q_heads, spec.q_dim), spec.q_out_dtype), jnp.zeros((0, spec.rope_dim), spec.dtype),
                pack(operands[4:4 + len(caches)]))
    if impl == "xla":
        out = mla_xla.mla_rope_and_cache(*primitive.not_differentiable(*operands, message=mla_primitive.NOT_DIFFERENTIABLE),
                                         spec=spec)
    else:
        out = mla_primitive.bind(*operands, spec=spec, impl=impl)
    return out[0], out[1], pack(tuple(out[2:]))


def make_mla_cache(num_blocks: int, block_size: int, latent_dim: int = 512, rope_dim: int = 64, dtype=jnp.bfloat16,
                   *, layout: str = "combined", num_layers: int | None = None, fill: str = "zeros", seed: int = 0,
                   device=None):
    """A latent cache for `mla_rope_and_cache`: one array [(L,) NB, BS, Dc + Dr] ("combined") or a pair
    ([(L,) NB, BS, Dc], [(L,) NB, BS, Dr]) ("split"); zeros, or random values (fill="random")."""
    for name, value in (("num_blocks", num_blocks), ("block_size", block_size), ("latent_dim", latent_dim),
                        ("rope_dim", rope_dim)) + ((("num_layers", num_layers),) if num_layers is not None else ()):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{name}: expected an integer >= 1, got {contract.describe(value)}")
    if rope_dim % 2:
        raise ValueError(f"rope_dim: expected an even integer (RoPE rotates pairs), got {rope_dim}")
    dtype = np.dtype(dtype)
    if dtype not in contract.INPUT_DTYPES + contract.FP8_DTYPES:
        raise TypeError(f"dtype: expected one of ({contract.dtype_names(contract.INPUT_DTYPES + contract.FP8_DTYPES)}), "
                        f"got {dtype.name}")
    shapes = mla_contract.mla_cache_shapes(layout, num_blocks, block_size, latent_dim, rope_dim)
    if num_layers is not None:
        shapes = tuple((num_layers,) + s for s in shapes)
    if fill == "zeros":
        caches = tuple(jnp.zeros(s, dtype, device=device) for s in shapes)
    elif fill == "random":
        keys = jax.random.split(jax.random.key(seed), len(shapes))
        caches = tuple(jax.device_put(jax.random.normal(k, s, jnp.float32).astype(dtype), device)
                       for k, s in zip(keys, shapes))
    else:
        raise ValueError(f"fill: expected 'zeros' or 'random', got {fill!r}")
    return caches[0] if layout == "combined" else caches


@functools.partial(jax.jit, static_argnames=("layout", "latent_dim"))
def _read(caches, slot_mapping, layout, latent_dim):
    nb, bs = caches[0].shape[:2]
    s = jnp.asarray(slot_mapping)
    valid = (s >= 0) & (s < nb * bs)
    safe = jnp.where(valid, s, 0)
    blk, off = safe // bs, safe % bs
    if layout == "combined":
        row = caches[0][blk, off]
        lat, rope = row[:, :latent_dim], row[:, latent_dim:]
    else:
        lat, rope = caches[0][blk, off], caches[1][blk, off]
    zero = jnp.zeros((), caches[0].dtype)
    return jnp.where(valid[:, None], lat, zero), jnp.where(valid[:, None], rope, zero)


def read_mla_cache(kv_cache, slot_mapping: ArrayLike, *, layout: str = "combined", latent_dim: int | None = None):
    """(kv_c [T, Dc], k_pe [T, Dr]) as cached for each slot of one layer, in the cache dtype; zeros for slots
    outside [0, NB*BS). "combined" needs latent_dim (Dc) to split the row."""
    caches = mla_contract.cache_tuple(kv_cache, layout)
    if layout == "combined" and latent_dim is None:
        raise ValueError("latent_dim: layout 'combined' needs Dc to split the cached row, got None")
    return _read(tuple(caches), slot_mapping, layout, latent_dim)
