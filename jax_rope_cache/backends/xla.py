"""impl="xla": the op in pure jax.numpy. The fallback on every platform and the baseline to beat.

One gather of the cos/sin rows, the rotation as slices, and one windowed scatter per cache with
mode="drop" (invalid slots are mapped past the last block, never wrapped like negative indices)
and unique_indices=True (callers pass unique slots, as the contract says).

Numerics: the reference's formulas (jax_rope_cache/reference.py), with two documented limits:
* XLA may contract a product and a sum into an FMA (it does on GPU), and "fused" native
  arithmetic is written as a multiply and an add that XLA may or may not fuse; both move a result
  by at most one float32 ulp of the larger product (the bound of tests/test_op.py);
* XLA's CPU runtime computes with flush-to-zero and denormals-are-zero: float32 subnormals
  (|x| < 2^-126: bf16 subnormals, subnormal table values or products, a scale below 2^-126) are
  read and written as zero there, which moves an output by at most a few 2^-126 in absolute
  terms (tests/test_numerics.py: 2^-123). XLA on GPU keeps subnormals.
NaN outputs are the canonical ones, as in every implementation.

The QK-RMSNorm follows the reference step by step (the same pairwise tree for the sum of squares,
a correctly rounded sqrt and division). Optimization barriers keep XLA's rewrites out: the squares,
which XLA could contract into the tree's adds as FMAs; the divisor D, which XLA would replace by a
multiplication with a rounded 1/D (D not a power of two: 3,577 of 20,480 f32 values off at
D=80, measured on CPU); the sqrt, whose reciprocal XLA would turn into its (not correctly
rounded) rsqrt (49 of 132 rows 1 ulp off, measured on CPU). On CPU the norm's subnormals are
flushed as above.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np

from jax_rope_cache import contract, reference

_F32 = jnp.float32


def _pairs(x, spec: contract.OpSpec, offset: int = 0):
    r, o = spec.rotary_dim, offset
    if spec.is_neox:
        return x[..., o : o + r // 2], x[..., o + r // 2 : o + r]
    return x[..., o : o + r : 2], x[..., o + 1 : o + r : 2]


def _unpair(xa, xb, tail, spec: contract.OpSpec, head=None):
    """The rotated pairs back in channel order, between the pass-through channels `head` (before the
    rotary ones, rotary_position="tail") and `tail` (after them)."""
    if spec.is_neox:
        rot = jnp.concatenate([xa, xb], axis=-1)
    else:
        rot = jnp.stack([xa, xb], axis=-1).reshape(xa.shape[:-1] + (2 * xa.shape[-1],))
    parts = [p for p in (head, rot, tail) if p is not None and p.shape[-1]]
    return jnp.concatenate(parts, axis=-1) if len(parts) > 1 else parts[0]


def round_to(y, dtype):
    """Rounds f32 values to `dtype`'s precision (nearest even), staying f32, with explicit ops XLA
    keeps: a convert pair (f32 -> bf16 -> f32) may be dropped by XLA's excess-precision rewrites
    (seen on GPU: up to 166 ulp off in "native" precision). reduce_precision with f16's own 5
    exponent bits flushes subnormals to zero (measured), so f16 uses 8 exponent bits for the
    normal range, an exact scale-round-scale for subnormals, and inf from 65520 up."""
    if np.dtype(dtype) == np.dtype(jnp.bfloat16):
        return jax.lax.reduce_precision(y, 8, 7)
    if np.dtype(dtype) == np.dtype(jnp.float16):
        tiny = jnp.abs(y) < 2.0**-14
        normal = jax.lax.reduce_precision(y, 8, 10)
        sub = jnp.round(y * 2.0**24) * 2.0**-24  # multiples of 2^-24, ties to even; scaling is exact
        big = jnp.abs(y) >= 65520.0
        return jnp.where(tiny, sub, jnp.where(big, jnp.copysign(jnp.inf, y), normal)).astype(_F32)
    return y


_UINT = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}  # the unsigned integer of each itemsize


def to_dtype(y, dtype):
    """f32 values converted to `dtype` (nearest even), every NaN the canonical one
    (reference.CANONICAL_NAN)."""
    dtype = np.dtype(dtype)
    uint = _UINT[dtype.itemsize]
    # chosen among bit patterns, not floats: XLA's CPU compiler of jax 0.11 widens a bf16 select to
    # f32 and back, which turns the canonical NaN's payload into another NaN
    bits = jax.lax.bitcast_convert_type(y.astype(dtype), uint)
    bits = jnp.where(jnp.isnan(y), jnp.asarray(reference.CANONICAL_NAN[dtype], uint), bits)
    return jax.lax.bitcast_convert_type(bits, dtype)


def table_rows(cos, sin, positions, spec: contract.OpSpec):
    """(cos_a, cos_b, sin_a, sin_b) as f32 [T, 1, R/2], gathered once per token (exactly:
    tables are never rounded); with M-RoPE, each column from its stream's row (reference.table_rows)."""
    pos = jnp.clip(positions, 0, spec.max_pos - 1)
    cs = jnp.take(jnp.stack([cos, sin]), pos, axis=1, mode="clip").astype(_F32)  # [2, T, W]; M-RoPE [2, 3, T, W]
    if spec.mrope_section is not None:  # column c from the row of its stream (a static choice per column)
        streams = contract.mrope_column_streams(spec)
        cs = jnp.where(streams == 0, cs[:, 0], jnp.where(streams == 1, cs[:, 1], cs[:, 2]))
    c, s = cs[0][:, None, :], cs[1][:, None, :]
    if spec.table_full:
        (ca, cb), (sa, sb) = _pairs(c, spec), _pairs(s, spec)
        return ca, cb, sa, sb
    return c, c, s, s


def rotate_values(x, rows, spec: contract.OpSpec):
    """(x rotated in its dtype, the f32 values before the final rounding: what an fp8 cache
    quantizes in "fused" native arithmetic)."""
    ca, cb, sa, sb = rows
    o = getattr(spec, "rotary_offset", 0)  # MLA specs have none
    xa, xb = (t.astype(_F32) for t in _pairs(x, spec, o))
    mode = reference.arithmetic(spec)
    if mode == "rounded":
        r = lambda y: round_to(y, spec.dtype)  # noqa: E731
        ya = r(r(xa * ca) - r(xb * sa))
        yb = r(r(xb * cb) + r(xa * sb))
    elif mode == "fused":  # fma(a, c, -(b*s)): XLA may fuse either product (documented bound)
        ya = xa * ca + (-(xb * sa))
        yb = xb * cb + xa * sb
    else:
        ya = xa * ca - xb * sa
        yb = xb * cb + xa * sb
    head, tail = x[..., :o], x[..., o + spec.rotary_dim :]
    out = _unpair(to_dtype(ya, x.dtype), to_dtype(yb, x.dtype), tail, spec, head)
    return out, _unpair(ya, yb, tail.astype(_F32), spec, head.astype(_F32))


def rotate(x, rows, spec: contract.OpSpec):
    return rotate_values(x, rows, spec)[0]


def tree_sum(a):
    """reference.tree_sum: the pairwise halving tree over the last axis. n = 2^k * m (m odd): the
    2^k contiguous blocks of m reduce first (m odd: the first m - 1, then the last), then the
    blocks pairwise, neighbours first: the same association as the reference's recursion."""
    n = a.shape[-1]
    if n == 1:
        return a[..., 0]
    if n % 2:
        return tree_sum(a[..., : n - 1]) + a[..., n - 1]
    k = (n & -n)  # the largest power of two dividing n
    m = n // k
    b = tree_sum(a.reshape(a.shape[:-1] + (k, m))) if m > 1 else a
    while b.shape[-1] > 1:
        b = b[..., 0::2] + b[..., 1::2]
    return b[..., 0]


def rms_norm(x, weight, spec: contract.OpSpec):
    """reference.rms_norm: x [..., D] normalised (spec.norm_type) with weight [D], in x's dtype."""
    xf = x.astype(_F32)
    sq = jax.lax.optimization_barrier(xf * xf)  # no FMA into the tree's adds
    # a divisor XLA cannot see as a broadcast scalar: it would multiply by a rounded 1/D instead
    s = tree_sum(sq)
    ms = s / jax.lax.optimization_barrier(jnp.full(s.shape, spec.head_dim, _F32))
    # the barrier keeps XLA from rewriting 1 / sqrt(x) into its rsqrt, which is not correctly rounded
    inv = _F32(1.0) / jax.lax.optimization_barrier(jnp.sqrt(ms + _F32(spec.norm_eps)))
    if spec.norm_type == "weightless":
        return to_dtype(xf * inv[..., None], x.dtype)
    if spec.norm_type == "gemma":  # one rounding, after the (1 + w) product
        return to_dtype((xf * inv[..., None]) * (_F32(1.0) + weight.astype(_F32)), x.dtype)
    y = round_to(xf * inv[..., None], x.dtype)
    return to_dtype(weight.astype(_F32) * y, x.dtype)


def _norms(q, k, q_norm_weight, k_norm_weight, spec: contract.OpSpec):
    """reference._norms: the weightless norm on q and k, the weighted ones where a weight is given."""
    weightless = spec.norm_type == "weightless"
    if weightless or spec.q_norm_dtype is not None:
        q = rms_norm(q, q_norm_weight, spec)
    if weightless or spec.k_norm_dtype is not None:
        k = rms_norm(k, k_norm_weight, spec)
    return q, k


def _select(on, a, b):
    """jnp.where(on, a, b) on the bit patterns: a 16-bit float select may be widened by XLA's CPU
    compiler, which would rewrite NaN payloads (see to_dtype)."""
    uint = _UINT[np.dtype(a.dtype).itemsize]
    bits = jnp.where(on, jax.lax.bitcast_convert_type(a, uint), jax.lax.bitcast_convert_type(b, uint))
    return jax.lax.bitcast_convert_type(bits, a.dtype)


def temperature(q, positions, table, spec: contract.OpSpec):
    """reference.temperature_rows: q [T, QH, D] times its token's factor, gathered from `table`, the
    temperature_factors operand (n = (p + 1) // floor_scale in integers)."""
    fs = spec.temperature[0]
    p = jnp.clip(positions, 0, spec.max_pos - 1)
    f = jnp.take(table, (p + 1) // fs, mode="clip")
    return to_dtype(q.astype(_F32) * f[:, None, None], q.dtype)


def _inverse_scale(scale, per_head: bool):
    """reference.inverse_scale: [] or, per head, [KH, 1] (broadcasting over [T, KH, D])."""
    big = np.finfo(np.float32).max
    s = jnp.asarray(scale, _F32)
    s = s.reshape((-1, 1)) if per_head else s.reshape(())
    return jnp.clip(_F32(1.0) / s, -big, big)


def quantize(x, cache_dtype, scale, per_head: bool = False):
    cache_dtype = np.dtype(cache_dtype)
    if cache_dtype not in contract.FP8_DTYPES:
        return x.astype(cache_dtype)
    inv = _inverse_scale(scale, per_head)
    m = contract.FP8_MAX[cache_dtype]
    return to_dtype(jnp.clip(x.astype(_F32) * inv, -m, m), cache_dtype)


def token_scale(y, cache_dtype):
    """reference.token_scale: one scale [..., KH] per row of f32 y [..., KH, D]."""
    a = jnp.abs(y.astype(_F32))
    a = jnp.where(a <= np.finfo(np.float32).max, a, _F32(0))  # NaN and inf left out
    amax = jnp.maximum(jnp.max(a, axis=-1), _F32(contract.TOKEN_AMAX_FLOOR))
    # a divisor XLA cannot see as a constant (it would multiply by a rounded 1/FP8_MAX instead): one
    # barrier with the non-constant amax, which XLA cannot fold away as it can a barrier of a constant
    amax, m = jax.lax.optimization_barrier((amax, jnp.full(amax.shape, contract.QUANT_MAX[np.dtype(cache_dtype)], _F32)))
    return amax / m


def quantize_rows(y, cache_dtype, scale):
    """reference.quantize_rows: rows [..., KH, D] with one scale per row (scale [..., KH])."""
    m = contract.QUANT_MAX[np.dtype(cache_dtype)]
    inv = (_F32(1.0) / scale)[..., None]  # scale >= 1e-8 / 57344: never overflows
    y = y.astype(_F32) * inv
    if np.dtype(cache_dtype) in contract.LOW_BIT:  # jnp.round: half to even; NaN stores 0
        i = jnp.clip(jnp.round(jnp.where(jnp.isnan(y), _F32(0), y)), -m, m).astype(jnp.int8)
        return pack_int4(i) if np.dtype(cache_dtype) == contract.INT4 else i
    return to_dtype(jnp.clip(y, -m, m), cache_dtype)


def pack_int4(i):
    """reference.pack_int4: int8 [..., D] -> uint8 [..., D/2], channel 2j in the low nibble."""
    u = i.astype(jnp.uint8) & jnp.uint8(0xF)
    return u[..., 0::2] | (u[..., 1::2] << jnp.uint8(4))


def unpack_int4(b):
    """reference.unpack_int4: uint8 [..., D/2] -> int8 [..., D]."""
    nib = jnp.stack([b & jnp.uint8(0xF), b >> jnp.uint8(4)], axis=-1).astype(jnp.int8)
    return jnp.where(nib >= 8, nib - 16, nib).astype(jnp.int8).reshape(b.shape[:-1] + (2 * b.shape[-1],))


# ---- NVFP4 / MXFP4 (reference.quantize_blocks) ----
_E2M1_VALUES = reference.E2M1_VALUES


def e2m1_codes(y):
    """reference.e2m1_codes: f32 -> E2M1 codes (uint8), half to even, saturating, NaN -> +0."""
    y = jnp.where(jnp.isnan(y), _F32(0), y)
    a = jnp.abs(y)
    code = jnp.zeros(y.shape, jnp.uint8)
    for t, up in reference.E2M1_STEPS:
        code = code + ((a >= _F32(t)) if up else (a > _F32(t))).astype(jnp.uint8)
    return code | (jnp.signbit(y).astype(jnp.uint8) << jnp.uint8(3))


def e2m1_decode(code):
    mag = jnp.asarray(_E2M1_VALUES)[(code & jnp.uint8(7)).astype(jnp.int32)]
    return jnp.where((code & jnp.uint8(8)) != 0, -mag, mag)


def pack_nibbles(code):
    code = code & jnp.uint8(0xF)
    return code[..., 0::2] | (code[..., 1::2] << jnp.uint8(4))


def unpack_nibbles(b):
    return jnp.stack([b & jnp.uint8(0xF), b >> jnp.uint8(4)], axis=-1).reshape(b.shape[:-1] + (2 * b.shape[-1],))


def block_amax(y, group: int):
    a = jnp.abs(y.astype(_F32))
    a = jnp.where(a <= np.finfo(np.float32).max, a, _F32(0))  # NaN and inf left out
    return jnp.max(a.reshape(a.shape[:-1] + (a.shape[-1] // group, group)), axis=-1)


def quantize_blocks(y, fmt: str, global_scale=None):
    """reference.quantize_blocks: rows [..., D] -> (block scales [..., D/group], bytes [..., D/2])."""
    group = contract.BLOCK_GROUP[fmt]
    y = y.astype(_F32)
    amax = block_amax(y, group)
    if fmt == "nvfp4":
        g = jnp.asarray(global_scale, _F32).reshape(())
        # a divisor XLA cannot see as a constant (it would multiply by a rounded 1/6): the barrier
        amax, six = jax.lax.optimization_barrier((amax, jnp.full(amax.shape, contract.FP4_MAX, _F32)))
        s = (amax / six) * _inverse_scale(g, False)
        scales = to_dtype(jnp.clip(s, _F32(0), _F32(contract.FP8_MAX[contract.E4M3])), contract.E4M3)
        den = scales.astype(_F32) * g
        mult = jnp.where(den == 0, _F32(0), jnp.minimum(_F32(1.0) / den, np.finfo(np.float32).max))
    else:
        bits = jax.lax.bitcast_convert_type(amax, jnp.uint32)
        x = jnp.clip((bits >> jnp.uint32(23)).astype(jnp.int32) - 129, -127, 127)
        scales = jax.lax.bitcast_convert_type((x + 127).astype(jnp.uint8), contract.E8M0)
        mult = jax.lax.bitcast_convert_type((127 - x).astype(jnp.uint32) << jnp.uint32(23), _F32)  # 2^-X
    blocks = y.reshape(y.shape[:-1] + (y.shape[-1] // group, group))
    p = (blocks * mult[..., None]).reshape(y.shape)
    return scales, pack_nibbles(e2m1_codes(p))


def e8m0_value(scale):
    """reference.e8m0_value: 2^(code - 127) as f32 (code 0: 2^-127; 0xFF: NaN)."""
    code = jax.lax.bitcast_convert_type(scale, jnp.uint8).astype(jnp.uint32)
    bits = jnp.where(code == 0, jnp.uint32(0x00400000), code << jnp.uint32(23))
    return jax.lax.bitcast_convert_type(jnp.where(code == 255, jnp.uint32(0x7FFFFFFF), bits), _F32)


def dequantize_blocks(b, scales, fmt: str, global_scale=None):
    """reference.dequantize_blocks: bytes [..., D/2], block scales [..., D/group] -> f32 [..., D]."""
    group = contract.BLOCK_GROUP[fmt]
    v = e2m1_decode(unpack_nibbles(b))
    v = v.reshape(v.shape[:-1] + (v.shape[-1] // group, group))
    if fmt == "nvfp4":
        out = (v * scales.astype(_F32)[..., None]) * jnp.asarray(global_scale, _F32).reshape(())
    else:
        out = v * e8m0_value(scales)[..., None]
    return out.reshape(out.shape[:-2] + (-1,))


def _layer_lead(blk, spec: contract.OpSpec, layer) -> tuple:
    """The stacked caches' leading index: the layer (clipped; an invalid one has no valid slot)."""
    return () if spec.num_layers is None else (jnp.full_like(blk, jnp.clip(layer, 0, spec.num_layers - 1)),)


def scatter_block_scales(k_scale_cache, v_scale_cache, ks, vs, blk, off, spec: contract.OpSpec, layer=None):
    """Writes the block scales [T, KH, D/group] at the token's row in the layout's key axes (as bytes)."""
    lay, lead = contract.LAYOUT_TABLE[spec.layout], _layer_lead(blk, spec, layer)
    out = []
    for c, v in ((k_scale_cache, ks), (v_scale_cache, vs)):
        shape, perm = lay.token_split("key", spec.kv_heads, v.shape[-1], 1, lead=len(lead))
        index = lead + lay.token_index("key", blk, off, 1)
        out.append(_scatter_bits(c, index, v.reshape((spec.num_tokens,) + shape).transpose(perm)))
    return tuple(out)


def scatter_scales(k_scale_cache, v_scale_cache, ks, vs, blk, off, spec: contract.OpSpec, layer=None):
    """Writes the per-token scales [T, KH] at (block, :, offset) in the layout's scale axes."""
    lay, lead = contract.LAYOUT_TABLE[spec.layout], _layer_lead(blk, spec, layer)
    shape, perm = lay.token_split("scale", spec.kv_heads, 1, 1, lead=len(lead))
    index = lead + lay.token_index("scale", blk, off, 1)
    return tuple(c.at[index].set(v.reshape((spec.num_tokens,) + shape).transpose(perm), mode="drop",
                                 unique_indices=True)
                 for c, v in ((k_scale_cache, ks), (v_scale_cache, vs)))


_I32_MAX = 2**31 - 1


def slot_validity(s, num_slots: int, num_blocks: int, hint: str = ", or use the kernel (impl='kernel')"):
    """(slots, valid) with `s < num_slots` computed in a width that holds num_slots: int32 slots on a
    cache of >= 2**31 slots are widened to int64 (jax_enable_x64 on), or, without 64-bit integers,
    compared by sign alone (every int32 value is below num_slots); a cache whose block index itself
    exceeds int32 cannot be addressed without x64 and raises, naming the cache."""
    if num_slots <= _I32_MAX or np.dtype(s.dtype).itemsize == 8:
        return s, (s >= 0) & (s < num_slots)
    if jax.config.jax_enable_x64:
        s = s.astype(jnp.int64)
        return s, (s >= 0) & (s < num_slots)
    if num_blocks > _I32_MAX:
        raise ValueError(f"key_cache: {num_blocks} blocks cannot be indexed by the XLA path with int32 indices; "
                         f"enable jax_enable_x64{hint}")
    return s, s >= 0


def slot_coords(slot_mapping, spec: contract.OpSpec, layer=None):
    """(block, offset) per token; invalid slots (and all slots of a layer outside [0, L)) get
    block NB, which mode="drop" skips."""
    s, valid = slot_validity(slot_mapping, spec.num_slots, spec.num_blocks)
    if spec.num_layers is not None:
        valid = valid & (layer >= 0) & (layer < spec.num_layers)
    blk = jnp.where(valid, s // spec.block_size, spec.num_blocks)
    off = jnp.where(valid, s % spec.block_size, 0)
    return blk, off


def scatter_kv(key_cache, value_cache, kq, vq, blk, off, spec: contract.OpSpec, layer=None):
    """Writes kq, vq [T, KH, D] (already in the cache dtype) into both caches; with stacked
    caches, into layer `layer` by one scatter on the whole stack (no slice of it is copied). A
    merged layout gets ONE scatter of each token's interleaved (K, V) heads into the key_cache
    array; its value_cache operand (the placeholder) is returned as it is."""
    lay, x = contract.LAYOUT_TABLE[spec.layout], spec.x
    lead = _layer_lead(blk, spec, layer)
    if lay.merged:  # [T, KH, 2, D] -> [T, 2 KH, D]: K head h at 2h, V head h at 2h + 1
        writes = (("kv", jnp.stack([kq, vq], axis=2).reshape(spec.num_tokens, 2 * spec.kv_heads, vq.shape[-1])),)
    else:
        writes = (("key", kq), ("value", vq))
    out = []
    for (which, vals), cache in zip(writes, (key_cache, value_cache)):
        shape, perm = lay.token_split(which, vals.shape[1], vals.shape[-1], x, lead=len(lead))
        vals = vals.reshape((spec.num_tokens,) + shape).transpose(perm)
        index = lead + lay.token_index(which, blk, off, x)
        if spec.fp8:  # scatter the bytes: XLA would otherwise convert the WHOLE fp8 cache to f16 and back
            out.append(_scatter_bits(cache, index, vals))
        elif _CPU_WIDENS_BF16_SCATTER and np.dtype(cache.dtype) == np.dtype(jnp.bfloat16):
            out.append(jax.lax.platform_dependent(
                cpu=lambda c=cache, i=index, x=vals: _scatter_bits(c, i, x),
                default=lambda c=cache, i=index, x=vals: c.at[i].set(x, mode="drop", unique_indices=True)))
        else:
            out.append(cache.at[index].set(vals, mode="drop", unique_indices=True))
    return tuple(out) if len(out) == 2 else (out[0], value_cache)


# The CPU compiler of jaxlib < 0.12 has no bf16 scatter: it widens the whole cache to f32, scatters
# and narrows it back, which also rewrites the NaN payloads of entries the call never wrote. There,
# a bf16 cache on CPU is scattered as uint16 bits: bit-exact, at the cost of one cache-sized copy
# (that XLA does not fold the bit casts; jaxlib 0.12 scatters bf16 in place, and the bit casts
# would cost it the copy, so it keeps the plain scatter).
_CPU_WIDENS_BF16_SCATTER = tuple(int(p) for p in jaxlib.__version__.split(".")[:2]) < (0, 12)


def _scatter_bits(cache, index, vals):
    """cache.at[index].set(vals) on the caches' bit patterns (same-width unsigned integers): a scatter
    only moves values, so this is the same write with no float conversion XLA could insert."""
    uint = _UINT[np.dtype(cache.dtype).itemsize]
    bits = jax.lax.bitcast_convert_type(cache, uint).at[index].set(
        jax.lax.bitcast_convert_type(vals, uint), mode="drop", unique_indices=True)
    return jax.lax.bitcast_convert_type(bits, cache.dtype)


def rope_and_cache(q, k, v, key_cache, value_cache, slot_mapping, positions, cos, sin,
                   k_scale, v_scale, layer, q_norm_weight, k_norm_weight, *extra, spec: contract.OpSpec):
    extra = dict(zip(contract.extra_operands(spec), extra))
    if spec.qkv:  # q, k and v are each the fused [T, QH + 2 KH, D] tensor: slices XLA fuses into their consumers
        qh, kh = spec.q_heads, spec.kv_heads
        nq = 2 * qh if spec.q_gate else qh  # gated rows: q head h at 2h, its gate at 2h + 1
        q, k, v = q[:, :nq:nq // qh], k[:, nq:nq + kh], v[:, nq + kh:]
    if not spec.norm_after:
        q, k = _norms(q, k, q_norm_weight, k_norm_weight, spec)
    if spec.rotary_dim:
        rows = table_rows(cos, sin, positions, spec)
        q_out = rotate(q, rows, spec)
        k_out, k_wide = rotate_values(k, rows, spec)
        if spec.norm_after:
            q_out, k_out = _norms(q_out, k_out, q_norm_weight, k_norm_weight, spec)
            k_wide = k_out.astype(_F32)
    else:
        q_out, k_out, k_wide = q, k, k.astype(_F32)
    if spec.rope_switch:  # a traced switch: both results computed, one selected per call
        on = extra["use_rope"] != 0
        off_q = temperature(q, positions, extra["temperature_factors"], spec) if spec.temperature is not None else q
        q_out, k_out, k_wide = (_select(on, a, b) for a, b in ((q_out, off_q), (k_out, k), (k_wide, k.astype(_F32))))
    elif spec.temperature is not None:  # rotary_dim=0: every call is a NoPE call
        q_out = temperature(q_out, positions, extra["temperature_factors"], spec)
    blk, off = slot_coords(slot_mapping, spec, layer)
    fused = (spec.fp8 or spec.low_bit) and reference.arithmetic(spec) == "fused"  # fp8 quantizes the f32 values there
    k_stored = k_wide if fused else k_out
    if spec.cache_format is not None:  # k_scale / v_scale are the block-scale caches
        kg, vg = extra.get("k_global_scale"), extra.get("v_global_scale")
        ks, kq = quantize_blocks(k_stored, spec.cache_format, kg)
        vs, vq = quantize_blocks(v, spec.cache_format, vg)
        k_scale, v_scale = scatter_block_scales(k_scale, v_scale, ks, vs, blk, off, spec, layer)
    elif spec.token_scales:  # k_scale / v_scale are the scale caches
        ks, vs = token_scale(k_stored, spec.cache_dtype), token_scale(v, spec.cache_dtype)
        kq, vq = quantize_rows(k_stored, spec.cache_dtype, ks), quantize_rows(v, spec.cache_dtype, vs)
        k_scale, v_scale = scatter_scales(k_scale, v_scale, ks, vs, blk, off, spec, layer)
    else:
        kq = quantize(k_stored, spec.cache_dtype, k_scale, spec.k_scale_heads)
        vq = quantize(v, spec.cache_dtype, v_scale, spec.v_scale_heads)
    key_cache, value_cache = scatter_kv(key_cache, value_cache, kq, vq, blk, off, spec, layer)
    if spec.token_scales:
        return q_out, k_out, key_cache, value_cache, k_scale, v_scale
    return q_out, k_out, key_cache, value_cache


def read_kv(key_cache, value_cache, slot_mapping, scales=None, *, layout="flash", fmt=None):
    """Cached K and V of each slot as [T, KH, D] in the cache dtype; zeros for invalid slots.
    `scales` (k, v): per-token scale caches (the layout's scale axes, e.g. [NB, KH, BS]) or static
    scales [1] / [KH]: dequantized
    float32 values float32(stored) * scale instead. fmt "nvfp4" / "mxfp4": `scales` are the
    block-scale caches (k, v), then for NVFP4 the global scales (k, v): dequantize_blocks."""
    lay = contract.cache_layout(layout)
    value_cache = key_cache if value_cache is None else value_cache  # merged: one array
    x = lay.cache_x("key", key_cache.shape, key_cache.dtype)
    nb, bs = lay.block_geometry(key_cache.shape, x)
    kh, d = lay.kv_heads(key_cache.shape), lay.head_dim(key_cache.shape, x)
    s, valid = slot_validity(jnp.asarray(slot_mapping), nb * bs, nb, hint="")
    safe = jnp.where(valid, s, 0)
    blk, off = safe // bs, safe % bs
    keep = valid[:, None, None]
    out = []
    for i, (cache, which) in enumerate(((key_cache, "key"), (value_cache, "value"))):
        shape, perm = lay.token_split(which, kh, d, x)
        got = cache[lay.token_index(which, blk, off, x)].transpose(np.argsort(perm)).reshape(s.shape[0], kh, d)
        if fmt is not None:
            g = 2 * d // contract.BLOCK_GROUP[fmt]
            _, bperm = lay.token_split("key", kh, g, 1)
            bs_ = scales[i][lay.token_index("key", blk, off, 1)].transpose(np.argsort(bperm)).reshape(s.shape[0], kh, g)
            got = dequantize_blocks(got, bs_, fmt, scales[2 + i] if fmt == "nvfp4" else None)
        elif scales is not None:
            sc = scales[i]
            if sc.ndim == 3:  # a scale cache: [T, KH]
                _, sperm = lay.token_split("scale", kh, 1, 1)
                sc = sc[lay.token_index("scale", blk, off, 1)].transpose(np.argsort(sperm))
            else:
                sc = jnp.broadcast_to(sc, (kh,))
            if np.dtype(got.dtype) == contract.INT4:
                got = unpack_int4(got)
            got = got.astype(_F32) * sc[..., None]
        out.append(jnp.where(keep, got, jnp.zeros((), got.dtype)))
    return tuple(out)
