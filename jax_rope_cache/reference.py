"""The oracle: rope_and_cache in numpy (+ ml_dtypes), importable without jax.

Same signature as `jax_rope_cache.rope_and_cache`; returns new arrays and never modifies its
inputs. It defines the arithmetic every implementation must reproduce:

* positions are clamped to [0, max_pos - 1]; a slot s writes the caches only if 0 <= s < NB*BS
  (block s // BS, offset s % BS);
* rotary pair (a, b) is (i, i + R/2) for NeoX and (2i, 2i+1) for GPT-J, i < R/2; channels >= R are
  copied unchanged. A "half" table gives both channels of pair i the value cos[p, i]; a "full"
  table gives channel c the value cos[p, c];
  a' = a*cos_a - b*sin_a,  b' = b*cos_b + a*sin_b;
* precision "fp32": inputs and table values in float32, each product and the difference/sum a
  separate float32 operation (no FMA), one rounding to the input dtype at the end;
* precision "native": the table values are first rounded to the input dtype, and each product and
  the sum is rounded to the input dtype (float32 operation, then round to nearest even);
* the cache stores k_out/v as they are (cache dtype == input dtype), or for float8 caches
  fp8(clamp(float32(x) * (1/scale), -max, max)) with 1/scale computed in float32 and
  round-to-nearest-even; NaN stays NaN.
"""

from __future__ import annotations

import numpy as np

from jax_rope_cache import contract

__all__ = ["rope_and_cache", "read_kv", "rotate", "quantize", "write_tokens", "read_tokens"]

_F32 = np.float32


def _round(x: np.ndarray, dtype: np.dtype) -> np.ndarray:
    return x.astype(dtype).astype(_F32)


def pair_channels(rotary_dim: int, is_neox: bool) -> tuple[np.ndarray, np.ndarray]:
    """Channel indices (a, b) of each rotary pair."""
    i = np.arange(rotary_dim // 2)
    return (i, i + rotary_dim // 2) if is_neox else (2 * i, 2 * i + 1)


def rotate(x: np.ndarray, cos_rows: np.ndarray, sin_rows: np.ndarray, spec: contract.OpSpec) -> np.ndarray:
    """Rotates x [T, H, D] with the already gathered table rows [T, W]; returns x's dtype."""
    a, b = pair_channels(spec.rotary_dim, spec.is_neox)
    c = cos_rows.astype(_F32)
    s = sin_rows.astype(_F32)
    native = spec.precision == "native"
    if native:
        c, s = _round(c, spec.dtype), _round(s, spec.dtype)
    if spec.table_full:
        ca, cb, sa, sb = c[:, a], c[:, b], s[:, a], s[:, b]
    else:
        ca = cb = c
        sa = sb = s
    ca, cb, sa, sb = (t[:, None, :] for t in (ca, cb, sa, sb))
    xf = x.astype(_F32)
    xa, xb = xf[..., a], xf[..., b]
    if native:
        r = lambda y: _round(y, spec.dtype)  # noqa: E731
        ya = r(r(xa * ca) - r(xb * sa))
        yb = r(r(xb * cb) + r(xa * sb))
    else:
        ya = xa * ca - xb * sa
        yb = xb * cb + xa * sb
    out = x.copy()
    out[..., a] = ya.astype(spec.dtype)
    out[..., b] = yb.astype(spec.dtype)
    return out


def quantize(x: np.ndarray, cache_dtype, scale) -> np.ndarray:
    """Values as the cache stores them (saturating scaled fp8, or the same bits)."""
    cache_dtype = np.dtype(cache_dtype)
    if cache_dtype not in contract.FP8_DTYPES:
        return x.astype(cache_dtype)
    inv = _F32(1.0) / _F32(np.asarray(scale, dtype=_F32).reshape(()))
    m = contract.FP8_MAX[cache_dtype]
    with np.errstate(invalid="ignore", over="ignore"):
        y = np.clip(x.astype(_F32) * inv, -m, m)
    return y.astype(cache_dtype)


def write_tokens(cache: np.ndarray, which: str, layout: str, blk, off, values: np.ndarray) -> None:
    """Stores values [n, KH, D] (cache dtype) of n tokens at (blk, off) of one layer, in place."""
    lay, x = contract.LAYOUT_TABLE[layout], contract.pack_width(cache.dtype)
    shape, perm = lay.token_split(which, values.shape[1], values.shape[2], x)
    cache[lay.token_index(which, blk, off, x)] = values.reshape((len(values),) + shape).transpose(perm)


def read_tokens(cache: np.ndarray, which: str, layout: str, blk, off, kv_heads: int, head_dim: int) -> np.ndarray:
    """The values [n, KH, D] stored at (blk, off) of one layer."""
    lay, x = contract.LAYOUT_TABLE[layout], contract.pack_width(cache.dtype)
    shape, perm = lay.token_split(which, kv_heads, head_dim, x)
    got = cache[lay.token_index(which, blk, off, x)]
    return got.transpose(np.argsort(perm)).reshape(len(blk), kv_heads, head_dim)


def _valid_slots(slot_mapping: np.ndarray, num_slots: int) -> np.ndarray:
    s = np.asarray(slot_mapping).astype(np.int64)
    return (s >= 0) & (s < num_slots)


def rope_and_cache(q, k, v, key_cache, value_cache, slot_mapping, positions, cos, sin, *,
                   layout="flash", is_neox=True, rotary_dim=None, k_scale=None, v_scale=None,
                   precision="fp32", impl=None, layer=None):
    """numpy oracle; returns (q_out, k_out, new_key_cache, new_value_cache) as new arrays.

    With `layer`, the caches are stacked [L, ...] and only layer `layer` is written (a layer
    outside [0, L) writes nothing, as an invalid slot)."""
    del impl
    contract.check_distinct_caches(key_cache, value_cache)
    q, k, v, key_cache, value_cache, slot_mapping, positions, cos, sin = (
        np.asarray(a) for a in (q, k, v, key_cache, value_cache, slot_mapping, positions, cos, sin))
    spec = contract.check_op(q, k, v, key_cache, value_cache, slot_mapping, positions, cos, sin,
                          layout=layout, is_neox=is_neox, rotary_dim=rotary_dim, k_scale=k_scale,
                          v_scale=v_scale, precision=precision, layer=layer)
    pos = np.clip(positions.astype(np.int64), 0, spec.max_pos - 1)
    cos_rows, sin_rows = cos[pos], sin[pos]
    q_out = rotate(q, cos_rows, sin_rows, spec)
    k_out = rotate(k, cos_rows, sin_rows, spec)

    kc, vc = key_cache.copy(), value_cache.copy()
    if spec.num_layers is not None:
        layer = int(np.asarray(layer))
        if not 0 <= layer < spec.num_layers:
            return q_out, k_out, kc, vc
        kc_all, vc_all = kc, vc
        kc, vc = kc_all[layer], vc_all[layer]  # views: writes land in the stacked copies
    valid = _valid_slots(slot_mapping, spec.num_slots)
    slots = slot_mapping.astype(np.int64)[valid]
    blk, off = slots // spec.block_size, slots % spec.block_size
    write_tokens(kc, "key", layout, blk, off, quantize(k_out[valid], spec.cache_dtype, k_scale))
    write_tokens(vc, "value", layout, blk, off, quantize(v[valid], spec.cache_dtype, v_scale))
    if spec.num_layers is not None:
        return q_out, k_out, kc_all, vc_all
    return q_out, k_out, kc, vc


def read_kv(key_cache, value_cache, slot_mapping, *, layout="flash"):
    """Gathers the cached K and V of each slot as [T, KH, D] in the cache dtype (zeros for
    slots outside [0, NB*BS))."""
    contract.check_read_kv(key_cache, value_cache, slot_mapping, layout)
    key_cache, value_cache = np.asarray(key_cache), np.asarray(value_cache)
    lay = contract.cache_layout(layout)
    x = contract.pack_width(key_cache.dtype)
    nb, bs = lay.block_geometry(key_cache.shape, x)
    kh, d = key_cache.shape[lay.key_axes.index("KH")], value_cache.shape[lay.value_axes.index("D")]
    s = np.asarray(slot_mapping).astype(np.int64)
    valid = _valid_slots(s, nb * bs)
    safe = np.where(valid, s, 0)
    blk, off = safe // bs, safe % bs
    kk = read_tokens(key_cache, "key", layout, blk, off, kh, d)
    vv = read_tokens(value_cache, "value", layout, blk, off, kh, d)
    zero = np.zeros((), key_cache.dtype)
    return np.where(valid[:, None, None], kk, zero), np.where(valid[:, None, None], vv, zero)
