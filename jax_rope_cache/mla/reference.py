"""The MLA oracle in numpy (+ ml_dtypes), importable without jax.

Same signature as `jax_rope_cache.mla_rope_and_cache`; returns new arrays, never modifies its
inputs. Every rule of the main op's reference (jax_rope_cache/reference.py: positions clamped,
slots outside [0, NB*BS) and layers outside [0, L) write nothing, the rotation in "fp32" and
"native" precision, saturating fp8 quantization, canonical NaNs, subnormals kept) applies, with
rotary_dim = Dr (every rope channel rotates):

* q_pe' = rope(q_pe), k_pe' = rope(k_pe), each (token, head) row a rotary row of width Dr;
* q_out [T, QH, Dn + Dr] = cat(q_nope, q_pe') in q_pe's dtype, q_nope's bits copied; with a float8
  q_out_dtype: cat(fp8(q_nope), fp8(q_pe')) quantized with q_scale (stored = fp8(clamp(x * inv)),
  inv = r32(1 / q_scale), as the caches);
* k_pe_out [T, Dr] = k_pe' in q_pe's dtype;
* the latent row of a token with a valid slot: cat(kv_c, k_pe') in the cache dtype (bits copied),
  or quantized with kv_scale for a float8 cache; "combined" stores it as one row [Dc + Dr],
  "split" stores kv_c in ckv_cache and k_pe' in kpe_cache.
* "fused" native arithmetic: what a float8 output quantizes is the float32 rotation before its
  final rounding (as the main op's k), for q_out's rope part and the cached rope key alike.
"""

from __future__ import annotations

import numpy as np

from jax_rope_cache import reference
from jax_rope_cache.mla import contract as mla_contract

__all__ = ["mla_rope_and_cache", "read_mla_cache"]


def _valid(slot_mapping, num_slots: int) -> np.ndarray:
    s = np.asarray(slot_mapping).astype(np.int64)
    return (s >= 0) & (s < num_slots)


def mla_rope_and_cache(q_nope, q_pe, kv_c, k_pe, kv_cache, slot_mapping, positions, cos, sin, *,
                       layout="combined", is_neox=False, kv_scale=None, q_out_dtype=None, q_scale=None,
                       precision="fp32", impl=None, layer=None, table_form="half"):
    """numpy oracle; returns (q_out, k_pe_out, kv_cache) as new arrays, kv_cache in the structure
    it was given (one array for "combined", a pair for "split")."""
    del impl
    caches = mla_contract.cache_tuple(kv_cache, layout)
    q_nope, q_pe, kv_c, k_pe, slot_mapping, positions, cos, sin = (
        np.asarray(a) for a in (q_nope, q_pe, kv_c, k_pe, slot_mapping, positions, cos, sin))
    caches = tuple(np.asarray(c) for c in caches)
    spec = mla_contract.check_mla(q_nope, q_pe, kv_c, k_pe, caches if layout == "split" else caches[0],
                                  slot_mapping, positions, cos, sin, layout=layout, is_neox=is_neox,
                                  kv_scale=kv_scale, q_out_dtype=q_out_dtype, q_scale=q_scale,
                                  precision=precision, layer=layer, table_form=table_form)
    pos = np.clip(positions.astype(np.int64), 0, spec.max_pos - 1)
    cos_rows, sin_rows = cos[pos], sin[pos]
    qpe_out, qpe_wide = reference.rotate_values(q_pe, cos_rows, sin_rows, spec)
    kpe_out, kpe_wide = reference.rotate_values(k_pe[:, None, :], cos_rows, sin_rows, spec)
    fused = reference.arithmetic(spec) == "fused"
    if spec.q_fp8:
        q_out = np.concatenate([reference.quantize(q_nope, spec.q_out_dtype, q_scale),
                                reference.quantize(qpe_wide if fused else qpe_out, spec.q_out_dtype, q_scale)], axis=-1)
    else:
        q_out = np.concatenate([q_nope, qpe_out], axis=-1)
    k_stored = kpe_wide if spec.fp8 and fused else kpe_out
    latent = reference.quantize(kv_c, spec.cache_dtype, kv_scale)
    rope = reference.quantize(k_stored[:, 0, :], spec.cache_dtype, kv_scale)

    out = [c.copy() for c in caches]
    layer_ok = True
    views = out
    if spec.num_layers is not None:
        li = int(np.asarray(layer))
        layer_ok = 0 <= li < spec.num_layers
        views = [c[li] for c in out] if layer_ok else out
    if layer_ok:
        valid = _valid(slot_mapping, spec.num_slots)
        s = slot_mapping.astype(np.int64)[valid]
        blk, off = s // spec.block_size, s % spec.block_size
        if layout == "combined":
            views[0][blk, off, : spec.latent_dim] = latent[valid]
            views[0][blk, off, spec.latent_dim:] = rope[valid]
        else:
            views[0][blk, off] = latent[valid]
            views[1][blk, off] = rope[valid]
    return q_out, kpe_out[:, 0, :], (out[0] if layout == "combined" else tuple(out))


def read_mla_cache(kv_cache, slot_mapping, *, layout="combined", latent_dim=None):
    """(kv_c [T, Dc], k_pe [T, Dr]) as cached for each slot, in the cache dtype; zeros for slots
    outside [0, NB*BS). "combined" needs latent_dim (Dc) to split the row."""
    caches = tuple(np.asarray(c) for c in mla_contract.cache_tuple(kv_cache, layout))
    nb, bs = caches[0].shape[:2]
    s = np.asarray(slot_mapping).astype(np.int64)
    valid = _valid(s, nb * bs)
    safe = np.where(valid, s, 0)
    blk, off = safe // bs, safe % bs
    if layout == "combined":
        if latent_dim is None:
            raise ValueError("latent_dim: layout 'combined' needs Dc to split the cached row, got None")
        row = caches[0][blk, off]
        lat, rope = row[:, :latent_dim], row[:, latent_dim:]
    else:
        lat, rope = caches[0][blk, off], caches[1][blk, off]
    zero = np.zeros((), caches[0].dtype)
    return np.where(valid[:, None], lat, zero), np.where(valid[:, None], rope, zero)
