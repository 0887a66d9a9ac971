"""The oracle: rope_and_cache in numpy (+ ml_dtypes), importable without jax.

Same signature as `jax_rope_cache.rope_and_cache`; returns new arrays and never modifies its
inputs. It defines the arithmetic every implementation must reproduce bit for bit. Below r()
rounds float32 to the input dtype (nearest even), r32() is a float32 operation:

* positions are clamped to [0, max_pos - 1]; a slot s writes the caches only if 0 <= s < NB*BS
  (block s // BS, offset s % BS);
* QK-RMSNorm (q_norm_weight / k_norm_weight given, each independently; Qwen3's q_norm / k_norm):
  every (token, head) row x[0..D) of q (k) is normalised over the whole head_dim before anything
  else, with eps32 = float32(norm_eps), w the weight [D] (q's dtype or float32), xf = float32(x):
    sq_i = r32(xf_i * xf_i)
    S    = tree(sq[0..D)), the pairwise halving tree (float32 adds):
             tree(a[lo..lo+n)) = a[lo]                                    n == 1
                               = tree(a[lo..lo+n/2)) + tree(a[lo+n/2..lo+n))  n even
                               = tree(a[lo..lo+n-1)) + a[lo+n-1]              n odd
           (for D a power of two the balanced tree: a GPU lane reduces its aligned chunk, then an
           xor butterfly across the head's lanes; `tree_sum`)
    ms   = r32(S / float32(D));  inv = r32(1 / r32(sqrt(r32(ms + eps32))))  (correctly rounded
           sqrt, then a correctly rounded reciprocal; not an approximate rsqrt)
    y_i  = r(r32(xf_i * inv))                  rounding point 1: to the input dtype, as HF's
                                               `(x_f32 * rsqrt(...)).to(input_dtype)`
    n_i  = r(r32(float32(w_i) * float32(y_i))) rounding point 2: the weight product (exact in
                                               float32 for a 16-bit weight: HF's 16-bit multiply)
  n replaces x as the input of everything below (rotation, pass-through channels >= R, k_out,
  the key cache); v is never normalised. Every NaN the norm computes is the canonical one;
* multimodal RoPE (mrope_section = (t, h, w), t + h + w = R/2; positions [3, T]: temporal, height,
  width): rotary frequency i (the pair below, i < R/2) takes its cos/sin values from the row of the
  position of stream contract.mrope_stream(i): sections: i < t temporal, i < t + h height, else
  width; interleaved (mrope_interleaved): i % 3 == 1 and i < 3h height, i % 3 == 2 and i < 3w
  width, else temporal. Every stream's position is clamped on its own; a "full" table column
  serves the pair of its frequency (NeoX c mod R/2, GPT-J c // 2). Only the rows change: equal
  streams (text tokens) give exactly the one-stream result;
* rotary pair (a, b) is (i, i + R/2) for NeoX and (2i, 2i+1) for GPT-J, i < R/2; channels >= R are
  copied unchanged (their bits, NaN payloads included). A "half" table gives both channels of
  pair i the value cos[p, i]; a "full" table gives channel c the value cos[p, c];
  a' = a*cos_a - b*sin_a,  b' = b*cos_b + a*sin_b.
* precision "fp32": inputs and table values widened to float32 (exactly), each product and the
  difference/sum a separate float32 operation (no FMA), one rounding r() at the end.
* precision "native": what AITER's Triton kernel computes on ROCm (../shared/notes/numerics.md),
  chosen by the dtypes (`arithmetic(spec)`):
  - "rounded": the table dtype IS the input dtype (bf16/bf16 or f16/f16). Each product is rounded
    to the input dtype, the sum is taken in float32 and rounded again:
    a' = r(r32(r(a*cos_a) - r(b*sin_a))),  b' = r(r32(r(b*cos_b) + r(a*sin_b))).
    (This double rounding of the sum never differs from rounding the exact sum once: float32 has
    24 >= 2p + 2 bits for p = 8 (bf16) and 11 (f16); tests/test_numerics.py checks it.)
  - "fused": any other pair (float32 tables with bf16/f16 inputs, float32 inputs, or mixed
    bf16/f16, which AITER does not run). Promoted to float32 with the first product fused into a
    correctly rounded float32 FMA, one rounding r() at the end:
    a' = r(fma32(a, cos_a, -r32(b*sin_a))),  b' = r(fma32(b, cos_b, r32(a*sin_b))).
  Tables are never rounded to the input dtype.
* the cache stores v and k as they are when its dtype is the input dtype. fp8 caches store
  fp8(clamp(float32(x) * inv, -max, max)) (round to nearest even, saturating), where
  inv = r32(1 / scale) (a scale of shape [KH]: kv head h uses scale[h]), and an inv that
  overflows to +-inf (|scale| < 2^-128: zero and tiny subnormal scales) is the largest finite float32 of its sign instead: 0 stays 0, other finite
  values saturate, and a finite input never becomes NaN. The clamp comes first, so +-inf stores
  +-max too: an fp8 cache never holds inf, also in float8_e5m2, the one cache format that has it
  (max 57344; e4m3fn 448, e4m3fnuz 240). The k value quantized is the rounded
  k_out, except in "fused" native arithmetic, where it is the float32 value before the final
  rounding (what AITER quantizes with float32 tables).
* per-token scales (k_scale_cache / v_scale_cache given, fp8 caches, no k_scale / v_scale): every
  (token, kv head) row y[0..D) of the float32 values an fp8 cache would quantize (the k value
  above, after the norm and the rotation; v widened) gets its own scale, computed from the row:
    amax  = max over d of |y_d|, NaN and +-inf left out (0 when nothing is left)
    scale = r32(max(amax, 1e-8f) / FP8_MAX)        (1e-8f = contract.TOKEN_AMAX_FLOOR: an all-zero
                                                    row gets a tiny nonzero scale, never 0 or NaN)
    stored_d = fp8(clamp(y_d * r32(1 / scale), -max, max))   (the static rule with this scale)
  and `scale` is written to the scale caches at (block, h, offset) of the token's slot in the
  layout's scale axes ([block, h, offset]; head_major [h, block, offset]; stacked: [layer, ...]),
  with the same slot rule as the caches. The max is exact, so the
  order of the reduction does not matter. A NaN stores the canonical NaN and +-inf saturates to
  +-max, as with static scales; they never make the row's scale inf or NaN. Dequantized:
  float32(stored) * scale (read_kv);
* NVFP4 / MXFP4 (uint8 caches with float8_e4m3fn / float8_e8m0fnu block-scale caches; NVFP4 with
  the global decode scales k_scale / v_scale): the row above in blocks of 16 / 32 values, each
  block's scale from its finite amax (NVFP4 e4m3(sat(r32(r32(amax / 6) * r32(1 / g)))), MXFP4
  2^(floor(log2(amax)) - 2) clamped to E8M0), every value rounded half to even to E2M1 after the
  multiplication by the block's multiplier, saturating at +-6, NaN stored as +0; two values a byte,
  channel 2j in the low nibble; the block scales written at the token's row in the layout's key axes
  (quantize_blocks, dequantize_blocks; docs/numerics.md#nvfp4-and-mxfp4-caches);
* NaN: every NaN the op computes (rotated channels, fp8 conversions) is the canonical quiet NaN,
  positive, all mantissa bits set: bf16/f16 0x7FFF, float32 0x7FFFFFFF, e4m3fn 0x7F, e4m3fnuz
  0x80, e5m2 0x7F (what Triton's bf16 conversion and NVIDIA's cvt write). Copies keep their bits.
* subnormals are kept everywhere (inputs, table values, products, sums, results).
* model families (docs/numerics.md#model-families), in this order: the norm "before" (norm_type
  "rms" as above; "gemma" n_i = r(r32(r32(xf_i * inv) * r32(1 + w_i))), one rounding; "weightless"
  n_i = r(r32(xf_i * inv)) on q and k), the rotation (none with rotary_dim=0 or a false use_rope;
  rotary_position="tail": the rotary channels are [D - R, D)), the norm "after" (norm_position, on
  calls that rotate: the cache stores the normalised k_out), and on calls that do not rotate the
  temperature: q_out = r(r32(q * f)), f = temperature_factors(...)[(p + 1) // floor_scale], p the
  clamped position. Gated fused rows (q_gate) change only where q is read.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from jax_rope_cache import contract

__all__ = ["rope_and_cache", "read_kv", "rotate", "rotate_values", "quantize", "token_scale", "quantize_rows",
           "quantize_blocks", "dequantize_blocks", "e2m1_codes", "e2m1_decode", "write_tokens", "read_tokens",
           "arithmetic", "fma32", "to_dtype", "inverse_scale", "tree_sum", "rms_norm", "table_rows", "CANONICAL_NAN",
           "temperature_factors", "temperature_rows"]

_F32 = np.float32
# Bits of the one NaN every implementation writes, by dtype (see the module docstring).
CANONICAL_NAN = {
    np.dtype(ml_dtypes.bfloat16): 0x7FFF,
    np.dtype(np.float16): 0x7FFF,
    np.dtype(np.float32): 0x7FFFFFFF,
    np.dtype(ml_dtypes.float8_e4m3fn): 0x7F,
    np.dtype(ml_dtypes.float8_e4m3fnuz): 0x80,
    np.dtype(ml_dtypes.float8_e5m2): 0x7F,
}
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32}
_F32_MAX = np.finfo(np.float32).max


def to_dtype(y: np.ndarray, dtype) -> np.ndarray:
    """float32 values rounded to `dtype` (nearest even), every NaN the canonical one."""
    dtype = np.dtype(dtype)
    with np.errstate(over="ignore", invalid="ignore"):
        out = np.asarray(y, _F32).astype(dtype)
    nan = np.isnan(np.asarray(y, _F32))
    if nan.any():
        bits = out.view(_UINT[dtype.itemsize])
        bits[nan] = CANONICAL_NAN[dtype]
    return out


def _round(x: np.ndarray, dtype: np.dtype) -> np.ndarray:
    return to_dtype(x, dtype).astype(_F32)


def arithmetic(spec: contract.OpSpec) -> str:
    """How the rotation is computed: "fp32", or native "rounded" / "fused" (module docstring)."""
    if spec.precision != "native":
        return "fp32"
    dt, tdt = np.dtype(spec.dtype), np.dtype(spec.table_dtype)
    return "rounded" if dt == tdt and dt != np.dtype(np.float32) else "fused"


def fma32(a, b, c) -> np.ndarray:
    """Correctly rounded float32 a*b + c (one rounding), for float32 arrays.

    a*b is exact in float64 (24 + 24 bits); the sum is made exact with TwoSum, rounded to odd in
    float64 (53 >= 24 + 2 bits, so the final rounding to float32 is correct, subnormals included)."""
    a, b, c = (np.asarray(t, _F32).astype(np.float64) for t in (a, b, c))
    with np.errstate(invalid="ignore", over="ignore"):
        p = a * b
        s = p + c
        bb = s - p
        e = (p - (s - bb)) + (c - bb)
        bits = s.view(np.uint64)
        odd = np.isfinite(s) & (e != 0) & ((bits & np.uint64(1)) == 0)
        toward = np.where(np.signbit(e) == np.signbit(s), bits + np.uint64(1), bits - np.uint64(1))
        s = np.where(odd, toward, bits).view(np.float64)
        return s.astype(_F32)


def tree_sum(a: np.ndarray) -> np.ndarray:
    """Sum of float32 a[..., 0..n) over the last axis in the pairwise halving tree of the module
    docstring (n even: the two halves, then one add; n odd: the first n - 1, then the last)."""
    n = a.shape[-1]
    if n == 1:
        return a[..., 0]
    with np.errstate(over="ignore", invalid="ignore"):
        if n % 2 == 0:
            return tree_sum(a[..., : n // 2]) + tree_sum(a[..., n // 2 :])
        return tree_sum(a[..., : n - 1]) + a[..., n - 1]


def rms_norm(x: np.ndarray, weight, norm_eps, norm_type: str = "rms") -> np.ndarray:
    """x [..., D] normalised over its last axis (module docstring), in x's dtype: "rms" r(w * r(x * inv)),
    "gemma" r((x * inv) * (1 + w)) with one rounding, "weightless" r(x * inv) (weight unused)."""
    dtype = x.dtype
    xf = x.astype(_F32)
    eps32 = _F32(norm_eps)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        ms = tree_sum(xf * xf) / _F32(x.shape[-1])
        inv = _F32(1.0) / np.sqrt(ms + eps32)
        if norm_type == "weightless":
            return to_dtype(xf * inv[..., None], dtype)
        if norm_type == "gemma":
            return to_dtype((xf * inv[..., None]) * (_F32(1.0) + np.asarray(weight).astype(_F32)), dtype)
        y = _round(xf * inv[..., None], dtype)
        return to_dtype(np.asarray(weight).astype(_F32) * y, dtype)


def temperature_factors(max_pos: int, floor_scale: int, attn_scale: float) -> np.ndarray:
    """Llama 4's attention temperature, one float32 factor per n = (p + 1) // floor_scale, n in
    [0, max_pos // floor_scale]: r32(r32(L(n) * float32(attn_scale)) + 1), L(n) = log1p(n) computed in
    float64 and rounded to float32 (transformers' float32 steps, its log1p correctly rounded)."""
    n = np.arange(int(max_pos) // int(floor_scale) + 1, dtype=np.float64)
    return (np.log1p(n).astype(_F32) * _F32(attn_scale) + _F32(1.0)).astype(_F32)


def temperature_rows(positions, spec: contract.OpSpec) -> np.ndarray:
    """The temperature factor [T] of each token: position p clamped to the tables' rows, n = (p + 1) //
    floor_scale (integers), factor temperature_factors(...)[n]."""
    fs, scale = spec.temperature
    p = np.clip(np.asarray(positions).astype(np.int64), 0, spec.max_pos - 1)
    return temperature_factors(spec.max_pos, fs, scale)[(p + 1) // fs]


def _norms(q, k, q_norm_weight, k_norm_weight, spec: contract.OpSpec):
    """The QK-norm of spec.norm_type on q and k (the weightless norm on both, the others where a weight is given)."""
    out = []
    for x, w in ((q, q_norm_weight), (k, k_norm_weight)):
        if spec.norm_type == "weightless" or w is not None:
            x = rms_norm(x, w, spec.norm_eps, spec.norm_type)
        out.append(x)
    return out


def pair_channels(rotary_dim: int, is_neox: bool, offset: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Channel indices (a, b) of each rotary pair; `offset`: the first rotary channel (D - R at the tail)."""
    i = np.arange(rotary_dim // 2)
    a, b = (i, i + rotary_dim // 2) if is_neox else (2 * i, 2 * i + 1)
    return a + offset, b + offset


def table_rows(cos: np.ndarray, sin: np.ndarray, positions: np.ndarray, spec: contract.OpSpec):
    """The cos/sin values [T, W] of every token: row clamp(p) of the tables; with M-RoPE, column c
    from the row of its stream's position (module docstring)."""
    pos = np.clip(np.asarray(positions).astype(np.int64), 0, spec.max_pos - 1)
    if spec.mrope_section is None:
        return cos[pos], sin[pos]
    streams = contract.mrope_column_streams(spec)  # [W]
    cols = np.arange(cos.shape[1])
    rows = pos[streams]  # [W, T]: the position each column takes, per token
    return cos[rows, cols[:, None]].T, sin[rows, cols[:, None]].T


def rotate_values(x: np.ndarray, cos_rows: np.ndarray, sin_rows: np.ndarray, spec: contract.OpSpec):
    """Rotates x [T, H, D] with the already gathered table rows [T, W].

    Returns (out in x's dtype, the float32 values before the final rounding: what an fp8 cache
    quantizes in "fused" native arithmetic; channels >= R hold x widened)."""
    ta, tb = pair_channels(spec.rotary_dim, spec.is_neox)  # table columns: relative to the first rotary channel
    off = getattr(spec, "rotary_offset", 0)  # MLA specs have none
    a, b = ta + off, tb + off
    c = cos_rows.astype(_F32)
    s = sin_rows.astype(_F32)
    if spec.table_full:
        ca, cb, sa, sb = c[:, ta], c[:, tb], s[:, ta], s[:, tb]
    else:
        ca = cb = c
        sa = sb = s
    ca, cb, sa, sb = (t[:, None, :] for t in (ca, cb, sa, sb))
    xf = x.astype(_F32)
    xa, xb = xf[..., a], xf[..., b]
    mode = arithmetic(spec)
    with np.errstate(invalid="ignore", over="ignore"):
        if mode == "rounded":
            r = lambda y: _round(y, spec.dtype)  # noqa: E731
            ya = r(r(xa * ca) - r(xb * sa))
            yb = r(r(xb * cb) + r(xa * sb))
        elif mode == "fused":
            ya = fma32(xa, ca, -(xb * sa))
            yb = fma32(xb, cb, xa * sb)
        else:
            ya = xa * ca - xb * sa
            yb = xb * cb + xa * sb
    out = x.copy()
    out[..., a] = to_dtype(ya, spec.dtype)
    out[..., b] = to_dtype(yb, spec.dtype)
    wide = xf.copy()
    wide[..., a], wide[..., b] = ya, yb
    return out, wide


def rotate(x: np.ndarray, cos_rows: np.ndarray, sin_rows: np.ndarray, spec: contract.OpSpec) -> np.ndarray:
    """Rotates x [T, H, D] with the already gathered table rows [T, W]; returns x's dtype."""
    return rotate_values(x, cos_rows, sin_rows, spec)[0]


def inverse_scale(scale):
    """r32(1 / scale), an overflow to +-inf replaced by the largest finite float32 of that sign: a
    float32 scalar for one scale, an array [KH, 1] (broadcasting over [T, KH, D]) for per-head scales."""
    s = np.asarray(scale, dtype=_F32)
    s = s.reshape(()) if s.size == 1 else s.reshape(-1, 1)
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        inv = _F32(1.0) / s
    return np.clip(inv, -_F32_MAX, _F32_MAX).astype(_F32)[()]


def quantize(x: np.ndarray, cache_dtype, scale) -> np.ndarray:
    """Values as the cache stores them (saturating scaled fp8, or the same bits)."""
    cache_dtype = np.dtype(cache_dtype)
    if cache_dtype not in contract.FP8_DTYPES:
        return x.astype(cache_dtype)
    inv = inverse_scale(scale)
    m = contract.FP8_MAX[cache_dtype]
    with np.errstate(invalid="ignore", over="ignore"):
        y = np.clip(x.astype(_F32) * inv, -m, m)
    return to_dtype(y, cache_dtype)


def token_scale(y: np.ndarray, cache_dtype) -> np.ndarray:
    """The per-token scales [..., KH] of float32 rows y [..., KH, D] (module docstring)."""
    a = np.abs(np.asarray(y, _F32))
    with np.errstate(invalid="ignore"):
        a = np.where(a <= _F32_MAX, a, _F32(0))  # NaN and inf left out
    amax = np.maximum(a.max(axis=-1, initial=_F32(0)), _F32(contract.TOKEN_AMAX_FLOOR))
    return (amax / _F32(contract.QUANT_MAX[np.dtype(cache_dtype)])).astype(_F32)


def quantize_rows(y: np.ndarray, cache_dtype, scale: np.ndarray) -> np.ndarray:
    """Rows y [..., KH, D] quantized with one scale per row (scale [..., KH]): the static rule."""
    m = contract.QUANT_MAX[np.dtype(cache_dtype)]
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        inv = np.clip(_F32(1.0) / np.asarray(scale, _F32), -_F32_MAX, _F32_MAX).astype(_F32)
        y = np.asarray(y, _F32) * inv[..., None]
        if np.dtype(cache_dtype) in contract.LOW_BIT:  # round half to even, saturate; NaN (no int8 NaN) stores 0
            i = np.clip(np.rint(np.where(np.isnan(y), _F32(0), y)), -m, m).astype(np.int8)
            return pack_int4(i) if np.dtype(cache_dtype) == contract.INT4 else i
        return to_dtype(np.clip(y, -m, m), cache_dtype)


def pack_int4(i: np.ndarray) -> np.ndarray:
    """int8 values in [-8, 7], [..., D] -> uint8 bytes [..., D/2]: channel 2j in the low nibble."""
    u = i.astype(np.uint8) & np.uint8(0xF)
    return u[..., 0::2] | (u[..., 1::2] << np.uint8(4))


def unpack_int4(b: np.ndarray) -> np.ndarray:
    """uint8 bytes [..., D/2] -> int8 values [..., D] (two's complement nibbles)."""
    nib = np.stack([b & np.uint8(0xF), b >> np.uint8(4)], axis=-1).astype(np.int8)
    return (np.where(nib >= 8, nib - 16, nib).astype(np.int8)).reshape(b.shape[:-1] + (2 * b.shape[-1],))


# ---- NVFP4 / MXFP4: E2M1 values with block scales (docs/numerics.md#nvfp4-and-mxfp4-caches) ----
E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], _F32)  # magnitude of codes 0..7
# code >= k + 1 where |y| passes threshold k: strictly above it where the tie goes to the lower
# (even) code, at or above it where it goes to the upper (even) one: round half to even
E2M1_STEPS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))


def e2m1_codes(y: np.ndarray) -> np.ndarray:
    """float32 values -> E2M1 codes (uint8, sign in bit 3): round half to even, saturating at +-6
    (+-inf too), NaN -> +0; the sign of a value rounded to zero is kept (-0 = 0x8)."""
    y = np.asarray(y, _F32)
    y = np.where(np.isnan(y), _F32(0), y)
    a = np.abs(y)
    code = np.zeros(y.shape, np.uint8)
    for t, up in E2M1_STEPS:
        code += ((a >= _F32(t)) if up else (a > _F32(t))).astype(np.uint8)
    return code | (np.signbit(y).astype(np.uint8) << np.uint8(3))


def e2m1_decode(code: np.ndarray) -> np.ndarray:
    """E2M1 codes (uint8, low 4 bits) -> float32 values."""
    code = np.asarray(code, np.uint8)
    mag = E2M1_VALUES[code & np.uint8(7)]
    return np.where(code & np.uint8(8), -mag, mag).astype(_F32)


def pack_nibbles(code: np.ndarray) -> np.ndarray:
    """4-bit codes [..., D] -> bytes [..., D/2], channel 2j in the low nibble (as pack_int4)."""
    code = np.asarray(code, np.uint8) & np.uint8(0xF)
    return code[..., 0::2] | (code[..., 1::2] << np.uint8(4))


def unpack_nibbles(b: np.ndarray) -> np.ndarray:
    """bytes [..., D/2] -> 4-bit codes [..., D] (uint8)."""
    b = np.asarray(b, np.uint8)
    return np.stack([b & np.uint8(0xF), b >> np.uint8(4)], axis=-1).reshape(b.shape[:-1] + (2 * b.shape[-1],))


def block_amax(y: np.ndarray, group: int) -> np.ndarray:
    """max |y| over each group of `group` values of the last axis, NaN and +-inf left out (0 if none):
    [..., D] -> [..., D/group]."""
    a = np.abs(np.asarray(y, _F32))
    with np.errstate(invalid="ignore"):
        a = np.where(a <= _F32_MAX, a, _F32(0))
    return a.reshape(a.shape[:-1] + (a.shape[-1] // group, group)).max(axis=-1)


def nvfp4_scales(amax: np.ndarray, global_scale) -> np.ndarray:
    """NVFP4 block scales (float8_e4m3fn) of block maxima amax with the global decode scale g:
    e4m3(clamp(r32(r32(amax / 6) * r32(1 / g)), 0, 448)) (1 / g: inverse_scale's rule)."""
    enc = inverse_scale(np.asarray(global_scale, _F32).reshape(()))
    with np.errstate(over="ignore", invalid="ignore"):
        s = (np.asarray(amax, _F32) / _F32(contract.FP4_MAX)) * enc
    return to_dtype(np.clip(s, _F32(0), _F32(contract.FP8_MAX[contract.E4M3])), contract.E4M3)


def nvfp4_multiplier(block_scale: np.ndarray, global_scale) -> np.ndarray:
    """r32(1 / r32(float32(block_scale) * g)), the finite float32 maximum where that overflows, 0 where
    the product is 0: what a block's values are multiplied by before the E2M1 rounding."""
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        den = np.asarray(block_scale).astype(_F32) * _F32(np.asarray(global_scale, _F32).reshape(()))
        inv = np.minimum(_F32(1.0) / den, _F32_MAX)
    return np.where(den == 0, _F32(0), inv).astype(_F32)


def mxfp4_exponents(amax: np.ndarray) -> np.ndarray:
    """MXFP4's shared exponents X = floor(log2(amax)) - 2 (E2M1's emax), int32 clamped to [-127, 127]
    (E8M0's range); floor(log2) is the biased float32 exponent - 127 (a zero or subnormal amax: -127)."""
    e = (np.asarray(amax, _F32).view(np.uint32) >> np.uint32(23)).astype(np.int32) - 127
    return np.clip(e - 2, -127, 127).astype(np.int32)


def e8m0_from_exponent(x: np.ndarray) -> np.ndarray:
    return (np.asarray(x, np.int32) + 127).astype(np.uint8).view(contract.E8M0)


def e8m0_value(scale: np.ndarray) -> np.ndarray:
    """float32 2^(code - 127) of E8M0 scales (code 0: 2^-127, a float32 subnormal; 0xFF: NaN)."""
    code = np.asarray(scale).view(np.uint8).astype(np.uint32)
    bits = np.where(code == 0, np.uint32(0x00400000), code << np.uint32(23))
    return np.where(code == 255, np.uint32(0x7FFFFFFF), bits).astype(np.uint32).view(_F32)


def quantize_blocks(y: np.ndarray, fmt: str, global_scale=None) -> tuple[np.ndarray, np.ndarray]:
    """Rows y [..., D] (float32) in format `fmt`: (block scales [..., D/group] in the scale dtype,
    bytes [..., D/2]). NVFP4 multiplies a block by nvfp4_multiplier, MXFP4 by 2^-X (exact); then
    e2m1_codes."""
    group = contract.BLOCK_GROUP[fmt]
    y = np.asarray(y, _F32)
    amax = block_amax(y, group)
    if fmt == "nvfp4":
        scales = nvfp4_scales(amax, global_scale)
        mult = nvfp4_multiplier(scales, global_scale)
    else:
        x = mxfp4_exponents(amax)
        scales = e8m0_from_exponent(x)
        mult = ((127 - x).astype(np.uint32) << np.uint32(23)).view(_F32)  # 2^-X, a normal float32
    blocks = y.reshape(y.shape[:-1] + (y.shape[-1] // group, group))
    with np.errstate(over="ignore", invalid="ignore"):
        p = (blocks * mult[..., None]).reshape(y.shape)
    return scales, pack_nibbles(e2m1_codes(p))


def dequantize_blocks(b: np.ndarray, scales: np.ndarray, fmt: str, global_scale=None) -> np.ndarray:
    """bytes [..., D/2] and block scales [..., D/group] -> float32 [..., D]: NVFP4
    r32(r32(e2m1 * float32(scale)) * g), MXFP4 r32(e2m1 * 2^X)."""
    group = contract.BLOCK_GROUP[fmt]
    v = e2m1_decode(unpack_nibbles(b))
    v = v.reshape(v.shape[:-1] + (v.shape[-1] // group, group))
    with np.errstate(over="ignore", invalid="ignore"):
        if fmt == "nvfp4":
            out = (v * np.asarray(scales).astype(_F32)[..., None]) * _F32(np.asarray(global_scale, _F32).reshape(()))
        else:
            out = v * e8m0_value(scales)[..., None]
    return out.reshape(out.shape[:-2] + (-1,)).astype(_F32)


def write_tokens(cache: np.ndarray, which: str, layout: str, blk, off, values: np.ndarray) -> None:
    """Stores values [n, KH, D] (cache dtype; a scale cache, which="scale": [n, KH]) of n tokens at
    (blk, off) of one layer, in place. A merged layout's "key" and "value" are the same array."""
    lay = contract.LAYOUT_TABLE[layout]
    x = lay.cache_x(which, cache.shape, cache.dtype)
    shape, perm = lay.token_split(which, values.shape[1], values.shape[-1], x)
    cache[lay.token_index(which, blk, off, x)] = values.reshape((len(values),) + shape).transpose(perm)


def read_tokens(cache: np.ndarray, which: str, layout: str, blk, off, kv_heads: int, head_dim: int) -> np.ndarray:
    """The values [n, KH, D] (which="scale": [n, KH]) stored at (blk, off) of one layer."""
    lay = contract.LAYOUT_TABLE[layout]
    x = lay.cache_x(which, cache.shape, cache.dtype)
    shape, perm = lay.token_split(which, kv_heads, head_dim, x)
    got = cache[lay.token_index(which, blk, off, x)]
    return got.transpose(np.argsort(perm)).reshape((len(blk), kv_heads) + ((head_dim,) if which != "scale" else ()))


def _valid_slots(slot_mapping: np.ndarray, num_slots: int) -> np.ndarray:
    s = np.asarray(slot_mapping).astype(np.int64)
    return (s >= 0) & (s < num_slots)


def rope_and_cache(q, k, v, key_cache, value_cache, slot_mapping, positions, cos, sin, *,
                   layout="flash", is_neox=True, rotary_dim=None, k_scale=None, v_scale=None,
                   precision="fp32", impl=None, layer=None, q_norm_weight=None, k_norm_weight=None,
                   norm_eps=1e-6, mrope_section=None, mrope_interleaved=False, k_scale_cache=None,
                   v_scale_cache=None, table_form="half", rotary_position="head", use_rope=None, norm_type="rms",
                   norm_position="before", attn_temperature=None):
    """numpy oracle; returns (q_out, k_out, new_key_cache, new_value_cache) as new arrays, and with
    per-token scales also (new_k_scale_cache, new_value_scale_cache).

    With `layer`, the caches are stacked [L, ...] and only layer `layer` is written (a layer
    outside [0, L) writes nothing, as an invalid slot). The model-family options (rotary_position,
    use_rope, norm_type, norm_position, attn_temperature): docs/numerics.md#model-families; the
    order is norm "before", rotation (unless rotary_dim=0 or use_rope is false), norm "after" (on a
    call that rotated), temperature (q only, on a call that did not rotate)."""
    del impl
    contract.check_value_cache(value_cache, layout)
    contract.check_distinct_caches(key_cache, value_cache)
    q, k, v, key_cache, value_cache, slot_mapping, positions, cos, sin = (
        None if a is None else np.asarray(a)
        for a in (q, k, v, key_cache, value_cache, slot_mapping, positions, cos, sin))
    k_scale_cache, v_scale_cache = (None if c is None else np.asarray(c) for c in (k_scale_cache, v_scale_cache))
    spec = contract.check_op(q, k, v, key_cache, value_cache, slot_mapping, positions, cos, sin,
                          layout=layout, is_neox=is_neox, rotary_dim=rotary_dim, k_scale=k_scale,
                          v_scale=v_scale, precision=precision, layer=layer, q_norm_weight=q_norm_weight,
                          k_norm_weight=k_norm_weight, norm_eps=norm_eps, mrope_section=mrope_section,
                          mrope_interleaved=mrope_interleaved, k_scale_cache=k_scale_cache,
                          v_scale_cache=v_scale_cache, table_form=table_form, rotary_position=rotary_position,
                          use_rope=use_rope, norm_type=norm_type, norm_position=norm_position,
                          attn_temperature=attn_temperature)
    if not spec.norm_after:
        q, k = _norms(q, k, q_norm_weight, k_norm_weight, spec)
    rotating = spec.rotary_dim > 0 and (use_rope is None or bool(np.asarray(use_rope) != 0))
    if rotating:
        cos_rows, sin_rows = table_rows(cos, sin, positions, spec)
        q_out = rotate(q, cos_rows, sin_rows, spec)
        k_out, k_wide = rotate_values(k, cos_rows, sin_rows, spec)
    else:
        q_out, k_out, k_wide = q.copy(), k.copy(), k.astype(_F32)
    if rotating and spec.norm_after:  # the cache then stores the normalised k_out
        q_out, k_out = _norms(q_out, k_out, q_norm_weight, k_norm_weight, spec)
        k_wide = k_out.astype(_F32)
    if spec.temperature is not None and not rotating:
        with np.errstate(over="ignore", invalid="ignore"):
            q_out = to_dtype(q_out.astype(_F32) * temperature_rows(positions, spec)[:, None, None], spec.dtype)
    # what the cache stores: k_out, but an fp8 cache in "fused" arithmetic quantizes the f32 values
    k_stored = k_wide if (spec.fp8 or spec.low_bit) and arithmetic(spec) == "fused" else k_out

    caches = [key_cache.copy(), None if value_cache is None else value_cache.copy()]  # merged: no value cache
    if spec.token_scales:
        caches += [k_scale_cache.copy(), v_scale_cache.copy()]
    out = (q_out, k_out, *caches)
    if spec.num_layers is not None:
        layer = int(np.asarray(layer))
        if not 0 <= layer < spec.num_layers:
            return out
        caches = [None if c is None else c[layer] for c in caches]  # views: writes land in the stacked copies
    valid = _valid_slots(slot_mapping, spec.num_slots)
    slots = slot_mapping.astype(np.int64)[valid]
    blk, off = slots // spec.block_size, slots % spec.block_size
    if spec.cache_format is not None:  # block scales, written like the caches' rows (the key axes)
        ks, kq = quantize_blocks(k_stored[valid], spec.cache_format, k_scale)
        vs, vq = quantize_blocks(v[valid], spec.cache_format, v_scale)
        write_tokens(caches[2], "key", layout, blk, off, ks)
        write_tokens(caches[3], "key", layout, blk, off, vs)
    elif spec.token_scales:
        ks, vs = token_scale(k_stored[valid], spec.cache_dtype), token_scale(v[valid], spec.cache_dtype)
        kq, vq = quantize_rows(k_stored[valid], spec.cache_dtype, ks), quantize_rows(v[valid], spec.cache_dtype, vs)
        write_tokens(caches[2], "scale", layout, blk, off, ks)
        write_tokens(caches[3], "scale", layout, blk, off, vs)
    else:
        kq = quantize(k_stored[valid], spec.cache_dtype, k_scale)
        vq = quantize(v[valid], spec.cache_dtype, v_scale)
    write_tokens(caches[0], "key", layout, blk, off, kq)
    write_tokens(caches[0] if caches[1] is None else caches[1], "value", layout, blk, off, vq)
    return out


def read_kv(key_cache, value_cache, slot_mapping, *, layout="flash", k_scale=None, v_scale=None,
            k_scale_cache=None, v_scale_cache=None):
    """Gathers the cached K and V of each slot as [T, KH, D] in the cache dtype (zeros for
    slots outside [0, NB*BS)). With scales (static k_scale / v_scale, or the per-token scale
    caches) an fp8 cache is dequantized: float32 values float32(stored) * scale; with block-scale
    caches (NVFP4: and the global scales k_scale / v_scale) the E2M1 bytes (dequantize_blocks)."""
    mode = contract.check_read_kv(key_cache, value_cache, slot_mapping, layout, k_scale=k_scale, v_scale=v_scale,
                                  k_scale_cache=k_scale_cache, v_scale_cache=v_scale_cache)[2]
    key_cache = np.asarray(key_cache)
    value_cache = key_cache if value_cache is None else np.asarray(value_cache)  # merged: one array
    lay = contract.cache_layout(layout)
    x = lay.cache_x("key", key_cache.shape, key_cache.dtype)
    nb, bs = lay.block_geometry(key_cache.shape, x)
    kh, d = lay.kv_heads(key_cache.shape), lay.head_dim(key_cache.shape, x)
    s = np.asarray(slot_mapping).astype(np.int64)
    valid = _valid_slots(s, nb * bs)
    safe = np.where(valid, s, 0)
    blk, off = safe // bs, safe % bs
    kk = read_tokens(key_cache, "key", layout, blk, off, kh, d)
    vv = read_tokens(value_cache, "value", layout, blk, off, kh, d)
    if mode in contract.BLOCK_FORMATS:
        g = contract.BLOCK_GROUP[mode]
        ks = read_tokens(np.asarray(k_scale_cache), "key", layout, blk, off, kh, 2 * d // g)
        vs = read_tokens(np.asarray(v_scale_cache), "key", layout, blk, off, kh, 2 * d // g)
        kk, vv = dequantize_blocks(kk, ks, mode, k_scale), dequantize_blocks(vv, vs, mode, v_scale)
    if mode == "token" and key_cache.dtype == contract.INT4:
        kk, vv = unpack_int4(kk), unpack_int4(vv)
    if mode == "token":
        kk = kk.astype(_F32) * read_tokens(np.asarray(k_scale_cache, _F32), "scale", layout, blk, off, kh, 1)[..., None]
        vv = vv.astype(_F32) * read_tokens(np.asarray(v_scale_cache, _F32), "scale", layout, blk, off, kh, 1)[..., None]
    elif mode == "static":
        kk = kk.astype(_F32) * np.asarray(k_scale, _F32).reshape(-1, 1)
        vv = vv.astype(_F32) * np.asarray(v_scale, _F32).reshape(-1, 1)
    zero = np.zeros((), kk.dtype)
    return np.where(valid[:, None, None], kk, zero), np.where(valid[:, None, None], vv, zero)


def split_qkv(qkv, num_q_heads: int, num_kv_heads: int, q_gate: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(q [T, QH, D], k [T, KH, D], v [T, KH, D]) of a fused QKV tensor [T, (QH + 2 KH) * D] or
    [T, QH + 2 KH, D] (each token's q heads, then its k heads, then its v heads). With q_gate the
    rows are [T, (2 QH + 2 KH) * D]: q head h at head 2h, its gate at 2h + 1 (Qwen3-Next), then k, v."""
    t, qh, kh, d = contract.check_qkv(qkv, num_q_heads, num_kv_heads, q_gate)
    nq = 2 * qh if q_gate else qh
    x = np.asarray(qkv).reshape(t, nq + 2 * kh, d)
    return x[:, :nq:nq // qh], x[:, nq:nq + kh], x[:, nq + kh:]


def rope_and_cache_qkv(qkv, key_cache, value_cache, slot_mapping, positions, cos, sin, *, num_q_heads,
                       num_kv_heads, q_gate=False, **options):
    """rope_and_cache of the fused QKV tensor: the same as rope_and_cache(*split_qkv(qkv, ...), ...)."""
    return rope_and_cache(*split_qkv(qkv, num_q_heads, num_kv_heads, q_gate), key_cache, value_cache, slot_mapping,
                          positions, cos, sin, **options)
