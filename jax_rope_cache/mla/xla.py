"""impl="xla" of the MLA op in pure jax.numpy: the fallback on every platform and the baseline.

Built from the main op's XLA helpers (backends/xla.py: table gather, rotation, rounding,
quantization, slot validity), so it carries the same numerics and the same documented limits (an
FMA XLA may form, flush-to-zero on CPU). One scatter per cache, mode="drop" for invalid slots;
stacked caches are written by one scatter on the whole stack (never sliced).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_rope_cache import reference
from jax_rope_cache.backends import xla
from jax_rope_cache.mla.contract import MlaSpec


def _scatter(cache, idx, vals, fp8: bool):
    if fp8:  # scatter the bytes: XLA would otherwise convert the whole fp8 cache to f16 and back
        bits = jax.lax.bitcast_convert_type(cache, jnp.uint8).at[idx].set(
            jax.lax.bitcast_convert_type(vals, jnp.uint8), mode="drop", unique_indices=True)
        return jax.lax.bitcast_convert_type(bits, cache.dtype)
    return cache.at[idx].set(vals, mode="drop", unique_indices=True)


def mla_rope_and_cache(q_nope, q_pe, kv_c, k_pe, *rest, spec: MlaSpec):
    """The primitive's operands (mla.contract.operands(spec.layout)) -> its results."""
    n_caches = 1 if spec.layout == "combined" else 2
    caches, (slot_mapping, positions, cos, sin, kv_scale, q_scale, layer) = rest[:n_caches], rest[n_caches:]
    rows = xla.table_rows(cos, sin, positions, spec)
    qpe_out, qpe_wide = xla.rotate_values(q_pe, rows, spec)
    kpe_out, kpe_wide = xla.rotate_values(k_pe[:, None, :], rows, spec)
    fused = reference.arithmetic(spec) == "fused"
    if spec.q_fp8:
        q_out = jnp.concatenate([xla.quantize(q_nope, spec.q_out_dtype, q_scale),
                                 xla.quantize(qpe_wide if fused else qpe_out, spec.q_out_dtype, q_scale)], axis=-1)
    else:
        q_out = jnp.concatenate([q_nope, qpe_out], axis=-1)
    latent = xla.quantize(kv_c, spec.cache_dtype, kv_scale)
    rope = xla.quantize((kpe_wide if spec.fp8 and fused else kpe_out)[:, 0, :], spec.cache_dtype, kv_scale)

    blk, off = xla.slot_coords(slot_mapping, spec, layer)
    lead = () if spec.num_layers is None else (jnp.full_like(blk, jnp.clip(layer, 0, spec.num_layers - 1)),)
    idx = lead + (blk, off)
    if spec.layout == "combined":
        out = (_scatter(caches[0], idx, jnp.concatenate([latent, rope], axis=-1), spec.fp8),)
    else:
        out = (_scatter(caches[0], idx, latent, spec.fp8), _scatter(caches[1], idx, rope, spec.fp8))
    return (q_out, kpe_out[:, 0, :]) + out
