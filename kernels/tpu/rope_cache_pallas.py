"""rope_and_cache as one Pallas TPU (Mosaic) kernel.

Framework code only (jax and Pallas): jax_rope_cache/backends/tpu.py loads this file, builds the
`Config` from the op's contract and calls `rope_and_cache`. The numbers it must reproduce are
jax_rope_cache/reference.py's ("fp32" precision, and "native" in its "rounded" arithmetic).

One grid step owns TB consecutive tokens (`Config.block_tokens`):

  scalar prefetch (SMEM)   slots [T], positions [T] (int32), layer [1]
  q, k       VMEM blocks [TB, QH, D], [TB, KH, D];  q_out, k_out the same
  v          HBM (pl.ANY): copied into the value cache by DMA, never through VMEM (a merged
             cache: a VMEM block [TB, KH, D], interleaved with k_out into [TB, 2KH, D])
  cos, sin   HBM: the rows of the block's positions DMA'd into VMEM [TB, W]
  caches     HBM, aliased to outputs 2 and 3; rows written by DMA from k_out's VMEM block and v

1. Table rows: one DMA per run of consecutive clamped positions (a prefill reads its rows in one
   DMA per table; a decode step one per token).
2. V: one DMA per run of consecutive valid slots inside one cache block (prefill: a whole block per
   DMA; decode: one per token), started with 1. in one scalar loop, so it overlaps the compute.
3. The rows' cosines and signed sines spread over the D lanes of each token, once per block
   ([TB, D] f32 in VMEM); then per token the rotation (and the QK-RMSNorm) in f32 on [H, D] tiles,
   written to q_out / k_out. Every value is 2-D: heads on sublanes, channels on lanes.
4. K: the same runs, from k_out's VMEM block. Every DMA is waited for, before the step ends, with
   the descriptor that started it (walking the same runs again), never with a guessed byte count.

Invalid slots (< 0 or >= NB*BS) and a layer outside [0, L) start no DMA at all; positions are
clamped before they address a table row. Nothing reads or writes outside a buffer.

Cache layouts come as axis names per cache (jax_rope_cache.contract.LAYOUT_TABLE: "NB", "BS", "KH",
"D"): a cache whose token rows hold [KH, D] contiguously after BS ("flash") takes one DMA per run;
one whose heads come before BS ("hnd", [NB, KH, BS, D]) one DMA per run and head. A merged cache
("kv_merged", [NB, BS, 2KH, D]: K head h at row 2h, V head h at 2h+1) takes V as a VMEM block; each
token's K and V rows are interleaved into a VMEM buffer [TB, 2KH, D] after the rotation, and one DMA
per run writes both. The value cache operand is then a placeholder the pallas_call never sees.

Quantized caches (fp8 with static, per-head or per-token scales; int8 and int4 with per-token
scales) take v as a VMEM block too: k_out's and v's rows are quantized in VMEM (integer conversions
from the f32 bits) and both caches are written from VMEM after the compute; per-token scales go
to the scale caches (aliased) from a [KH, lanes] buffer, one DMA per run and head. NVFP4 and
MXFP4 rows take each block's amax by lane-roll butterflies, the block scale and multiplier per lane
(integer arithmetic on the f32 bits), E2M1 codes packed as int4's, and the block scales compacted
to [KH, D/G] bytes in a [TB, KH, D/G] buffer, DMA'd like the key cache's rows. M-RoPE reads
the table rows of each of its three position streams and picks each column's stream. The fused
QKV input is one VMEM block of fused rows. float16 is moved as bits, widened and rounded in
integer arithmetic. The model-family options (NoPE, the use_rope switch as a 4th scalar
prefetch, tail rotary, Gemma / weightless norms, the norm after the rotation, the temperature
factors DMA'd per token) follow reference.py's order.

Arithmetic without fused multiply-adds or reassociation: the rotation is x*C + P*S' with the
partner P from lane rolls and S' the sine with the sign of its pair member folded in (x - y is
x + (-y) in IEEE). Roundings to bf16 are integer round-to-nearest-even on the f32 bits, so no
compiler may drop them as excess precision, and outputs are written as bits (bitcast), so no
conversion rounds them or rewrites a NaN. The QK-norm's division and square root are corrected to the correctly
rounded result with exact residuals (Dekker products), whatever the hardware's approximation.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

F32 = jnp.float32
U32 = jnp.uint32
I32 = jnp.int32
# The NaN every output holds (reference.CANONICAL_NAN), as f32 bits: bf16 0x7FFF widened, f32 itself.
CANONICAL_NAN_BITS = {np.dtype(jnp.bfloat16): 0x7FFF0000, np.dtype(np.float32): 0x7FFFFFFF,
                      np.dtype(np.float16): 0x7FFFFFFF}  # f16: any NaN, its encoder writes 0x7FFF
# A merged cache's rows of K head h and V head h: 2h + 0 and 2h + 1 (JAX's ragged paged attention).
KV_MERGED_ROWS = (0, 1)
BLOCK_GROUP = {"nvfp4": 16, "mxfp4": 32}  # contract.BLOCK_GROUP
VMEM_BLOCK_BUDGET = 4 << 20  # bytes of double-buffered q/k blocks and table rows per grid step


@dataclasses.dataclass(frozen=True)
class Config:
    """The static facts of one call site (the op's OpSpec, translated by backends/tpu.py)."""

    tokens: int
    q_heads: int
    kv_heads: int
    head_dim: int
    rotary_dim: int
    block_size: int
    num_blocks: int
    num_layers: int            # 0: one layer of caches; L: caches stacked [L, ...], `layer` picks one
    max_pos: int
    neox: bool
    full_table: bool           # cos/sin [max_pos, R] (one value per channel), else [max_pos, R/2]
    rounded: bool              # "native" precision, "rounded" arithmetic: each product rounded to bf16
    q_norm: bool
    k_norm: bool
    norm_eps: float            # float32 value
    key_axes: tuple[str, ...]    # one layer's axes in memory order, e.g. ("NB", "BS", "KH", "D")
    value_axes: tuple[str, ...]
    block_tokens: int          # TB: tokens per grid step
    cache_dtype: str = ""      # an fp8 cache dtype's name, "int8", "int4", "nvfp4" or "mxfp4" (quantized), "" none
    token_scales: bool = False  # per-token scales written to the scale caches (else static scales)
    scale_axes: tuple[str, ...] = ("NB", "KH", "BS")  # one layer's scale cache axes (token_scales)
    mrope: tuple[int, int, int] | None = None  # M-RoPE sections (t, h, w): positions [3, T], rows per stream
    mrope_interleaved: bool = False
    norm_type: str = "rms"     # "rms", "gemma" or "weightless" (q_norm / k_norm: which rows it normalises)
    norm_after: bool = False   # the norm on the rotated rows (calls that rotate), else before the rotation
    rotary_tail: bool = False  # rotary channels [D - R, D), else [0, R)
    rope_switch: bool = False  # a use_rope scalar (4th scalar prefetch) switches the rotation per call
    temperature: int = 0       # floor_scale of the attention temperature (q on calls that do not rotate), 0: none
    qkv: bool = False          # q, k and v rows of one fused tensor [T, nq + 2KH, D] (nq: QH, or 2QH gated)
    q_gate: bool = False       # fused rows hold q head h at 2h, its gate (not read) at 2h + 1

    @property
    def rotary_offset(self) -> int:
        return self.head_dim - self.rotary_dim if self.rotary_tail else 0

    @property
    def scalar_prefetch(self) -> int:
        """slots, positions, layer (and use_rope)."""
        return 4 if self.rope_switch else 3

    @property
    def streams(self) -> int:
        """Position streams: 3 with M-RoPE (temporal, height, width), else 1."""
        return 3 if self.mrope else 1

    @property
    def table_width(self) -> int:
        return self.rotary_dim if self.full_table else self.rotary_dim // 2

    @property
    def merged(self) -> bool:
        return row_dma(self.key_axes) == "merged"

    @property
    def grid(self) -> int:
        return -(-self.tokens // self.block_tokens)

    @property
    def quant(self) -> bool:
        """The caches hold fp8: V goes through VMEM (quantized), both caches from fp8 VMEM buffers."""
        return bool(self.cache_dtype)

    @property
    def v_in_vmem(self) -> bool:
        return self.merged or self.quant

    @property
    def block_group(self) -> int:
        """Values per block scale (NVFP4 16, MXFP4 32); 0 for the other caches."""
        return BLOCK_GROUP.get(self.cache_dtype, 0)

    @property
    def global_scales(self) -> bool:
        """NVFP4: the k and v global decode scales, an SMEM operand f32 [2]."""
        return self.cache_dtype == "nvfp4"

    @property
    def scale_lanes(self) -> int:
        """Lanes of a scale buffer [KH, lanes]: TB rounded up to whole 128-lane tiles."""
        return -(-self.block_tokens // 128) * 128


def block_tokens(tokens: int, q_heads: int, kv_heads: int, head_dim: int, itemsize: int, table_width: int,
                 table_itemsize: int, merged: bool = False, quant: bool = False, streams: int = 1,
                 block_scales: bool = False) -> int:
    """TB: all tokens when they fit the budget (the block is the whole array), else a multiple of 8."""
    per_token = (2 * 2 * (q_heads + kv_heads) * head_dim * itemsize
                 + 2 * (streams * table_width * table_itemsize + head_dim * 4))
    if merged or quant:  # the double-buffered V block
        per_token += 2 * kv_heads * head_dim * itemsize
    if merged:  # the interleaved [2KH, D] rows
        per_token += 2 * kv_heads * head_dim * itemsize
    if quant:  # fp8 rows of K and V, one f32 scale per head each
        per_token += 2 * kv_heads * (head_dim + 4)
    if block_scales:  # two uint8 [KH, D/G] block-scale rows a token, each padded to whole (32, 128) tiles
        per_token += 2 * -(-kv_heads // 32) * 32 * 128
    most = max(8, (VMEM_BLOCK_BUDGET // per_token) // 8 * 8)
    return max(1, tokens) if tokens <= most else most


def row_dma(axes: tuple[str, ...]) -> str:
    """How a cache takes a run of token rows: "whole" (token rows [KH, D] contiguous after BS, one
    DMA per run), "per_head" (heads before BS, one DMA per run and head), "merged" (rows [2KH, D] of
    K and V interleaved, one DMA per run for both). ValueError otherwise."""
    rest = tuple(a for a in axes if a != "NB")
    if rest == ("BS", "KH", "D"):
        return "whole"
    if rest == ("BS", "2KH", "D"):
        return "merged"
    if sorted(rest) == ["BS", "D", "KH"] and rest[-1] == "D":
        return "per_head"
    raise ValueError(f"cache axes {axes}: the TPU kernel writes rows of [BS, KH, D] caches with D last only")


# ---- scalar arithmetic helpers (also used by the tests on plain arrays) --------------------------
def bits(x):
    return lax.bitcast_convert_type(x, U32)


def from_bits(u):
    return lax.bitcast_convert_type(u, F32)


def round_bf16(y):
    """f32 -> the f32 value of its bf16 rounding (nearest even), NaN kept NaN. Integer arithmetic:
    a convert pair could be dropped as excess precision, and no conversion's rounding is trusted."""
    u = bits(y)
    r = (u + U32(0x7FFF) + ((u >> 16) & U32(1))) & U32(0xFFFF0000)
    return jnp.where(jnp.isnan(y), y, from_bits(r))


F16 = np.dtype(np.float16)
# f16 as a narrow float: 10 mantissa bits, bias 15, overflow to inf (0x7C00), canonical NaN 0x7FFF
F16_FORMAT = (10, 15, 0x7C00, 0x7FFF, False)


def _shift_rne(m, s):
    """m >> s rounded to nearest, ties to even (u32 m < 2^24, 1 <= s <= 25)."""
    return (m + ((U32(1) << (s - U32(1))) - U32(1)) + ((m >> s) & U32(1))) >> s


def narrow_codes(y, fmt, width: int):
    """The bits (u32) of f32 y in a float of `width` bits, fmt = (mantissa bits M, bias B, largest code,
    NaN code, no negative zero): round to nearest even, codes above the largest (inf included)
    saturate to it (f16: the largest code is inf's), every NaN the NaN code, subnormals kept.
    Integer arithmetic on the f32 bits only: no conversion of the hardware's is trusted to round,
    saturate or write NaNs as the reference does."""
    m_bits, bias, max_code, nan_code, fnuz = fmt[:5]
    u = bits(y)
    sign, a = (u >> (32 - width)) & U32(1 << (width - 1)), u & U32(0x7FFFFFFF)
    shift = 23 - m_bits
    rebased = a - U32((127 - bias) << 23)  # wraps below the normal range: unused there
    normal = (rebased + U32((1 << (shift - 1)) - 1) + ((rebased >> shift) & U32(1))) >> shift
    e = a >> 23  # a subnormal result: k * 2^(1 - B - M), k = mant * 2^(e - 150 - (1 - B - M)) rounded
    mant = jnp.where(e == 0, U32(0), (a & U32(0x007FFFFF)) | U32(0x00800000))  # f32 subnormals round to 0
    s = jnp.clip(U32(151 - bias - m_bits) - jnp.minimum(e, U32(151 - bias - m_bits - 1)), 1, 25)
    code = jnp.where(a < U32((128 - bias) << 23), _shift_rne(mant, s), normal)
    code = jnp.minimum(code, U32(max_code))
    out = jnp.where(code == 0, U32(0), sign | code) if fnuz else sign | code
    return jnp.where(a > U32(0x7F800000), U32(nan_code), out)


def f16_widen(h):
    """f32 values of f16 bits (u16), exactly: normal and special values by moving bit fields (NaN
    payloads kept), subnormals as k * 2^-24 (an exact int conversion and product; normal in f32)."""
    h = h.astype(U32)
    sign, e, m = (h & U32(0x8000)) << 16, (h >> 10) & U32(0x1F), h & U32(0x3FF)
    normal = from_bits(sign | ((e + U32(112)) << 23) | (m << 13))
    special = from_bits(sign | U32(0x7F800000) | (m << 13))
    sub = from_bits(sign | bits(m.astype(I32).astype(F32) * F32(2.0**-24)))
    return jnp.where(e == 0, sub, jnp.where(e == 31, special, normal))


def round_f16(y):
    """f32 -> the f32 value of its f16 rounding (nearest even, overflow to inf), NaN kept NaN."""
    return jnp.where(jnp.isnan(y), y, f16_widen(narrow_codes(y, F16_FORMAT, 16)))


def rounder(dtype):
    """The rounding r() of the reference to `dtype`, staying f32."""
    dtype = np.dtype(dtype)
    return round_bf16 if dtype == np.dtype(jnp.bfloat16) else round_f16 if dtype == F16 else (lambda y: y)


UINT = {2: jnp.uint16, 4: U32}  # the unsigned integer of each element width


def value_bits(x, dtype):
    """The bits in `dtype` of f32 values exactly representable in it (unsigned ints of its width).
    Bits, never a conversion: a conversion may rewrite a NaN's payload (XLA:CPU's f32 -> bf16 writes
    0x7FC0 for every NaN)."""
    if np.dtype(dtype) == F16:  # the encoder: exact for these values, NaN the canonical one
        return narrow_codes(x, F16_FORMAT, 16).astype(jnp.uint16)
    u = bits(x)
    return u if np.dtype(dtype).itemsize == 4 else (u >> 16).astype(jnp.uint16)


def output_bits(y, dtype):
    """The bits in `dtype` of f32 results: rounded to nearest even, every NaN the canonical one."""
    if np.dtype(dtype) == F16:
        return narrow_codes(y, F16_FORMAT, 16).astype(jnp.uint16)
    canon = from_bits(jnp.full(y.shape, CANONICAL_NAN_BITS[np.dtype(dtype)], U32))
    return value_bits(jnp.where(jnp.isnan(y), canon, rounder(dtype)(y)), dtype)


def to_f32(x):
    """f32 values of a loaded vector (bf16: a shift; f16: f16_widen, never a conversion)."""
    if np.dtype(x.dtype) == F16:
        return f16_widen(lax.bitcast_convert_type(x, jnp.uint16))
    return x.astype(F32)


def keep(x):
    """A barrier against contracting the product x into a later add. XLA:CPU, which runs the
    kernel in interpret mode, forms FMAs (measured: 568 of 4608 f32 outputs moved); Mosaic has no
    barrier op and emits arith ops without fast-math flags, so the TPU lowering passes `plain`."""
    return lax.optimization_barrier(x)


def plain(x):
    return x


def _split(a, sep):
    """Veltkamp: a = hi + lo with 12-bit halves, so products of halves are exact in f32."""
    c = sep(a * F32(4097.0))
    hi = c - (c - a)
    return hi, a - hi


def product_error(a, b, p, sep=keep):
    """e with a*b = p + e exactly, p = f32(a*b) (Dekker; no FMA, |a|, |b| well inside the range)."""
    ah, al = _split(a, sep)
    bh, bl = _split(b, sep)
    return ((ah * bh - p) + ah * bl + al * bh) + al * bl


def _mantissa(x):
    """(x scaled into [1, 2), its biased exponent) for positive normal f32 x."""
    u = bits(x)
    return from_bits((u & U32(0x007FFFFF)) | U32(0x3F800000)), (u >> 23).astype(I32)


def _scaled(m, e):
    """m * 2^e for m in [0.5, 4) and an int exponent offset e: 0 where it would be subnormal (the
    TPU flushes them), inf where it overflows."""
    u = bits(m)
    field = (u >> 23).astype(I32) + e
    out = from_bits(((u & U32(0x807FFFFF)) | (jnp.clip(field, 1, 254).astype(U32) << 23)))
    return jnp.where(field < 1, F32(0.0), jnp.where(field > 254, F32(jnp.inf), out))


def _div_step(a, b, q, sep):
    """One step toward the correctly rounded a/b (a, b in [1, 2), q > 0 within a few ulps): the
    exact residual a - q*b against half the gap to each neighbour, scaled by b."""
    p = sep(q * b)
    r = (a - p) - product_error(q, b, p, sep)
    up, down = from_bits(bits(q) + U32(1)), from_bits(bits(q) - U32(1))
    return jnp.where(r > (up - q) * b * F32(0.5), up, jnp.where(-r > (q - down) * b * F32(0.5), down, q))


def div_rn(a, b, approx=None, sep=keep):
    """Correctly rounded f32 a / b for positive normal a, b (other operands: the hardware's a / b).
    `approx` stands in for the hardware quotient of the scaled operands (tests)."""
    ok = jnp.isfinite(a) & jnp.isfinite(b) & (a >= F32(2.0**-126)) & (b >= F32(2.0**-126))
    a1 = jnp.where(ok, a, F32(1.0))
    b1 = jnp.where(ok, b, F32(1.0))
    am, ea = _mantissa(a1)
    bm, eb = _mantissa(b1)
    q = am / bm if approx is None else approx(am, bm)
    q = _div_step(am, bm, _div_step(am, bm, q, sep), sep)
    return jnp.where(ok, _scaled(q, ea - eb), a / b)


def _sqrt_step(m, y, sep):
    """One step toward the correctly rounded sqrt(m) (m in [1, 4), y in [1, 2]): round up when
    m - y^2 > y*ulp(y), down when y^2 - m >= y*ulp below y (no ties exist for a square root)."""
    p = sep(y * y)
    r = (m - p) - product_error(y, y, p, sep)
    up, down = from_bits(bits(y) + U32(1)), from_bits(bits(y) - U32(1))
    return jnp.where(r > y * (up - y), up, jnp.where(-r >= y * (y - down), down, y))


def sqrt_rn(m, approx=None, sep=keep):
    """Correctly rounded f32 sqrt(m) for positive normal m (other operands: the hardware's sqrt)."""
    ok = jnp.isfinite(m) & (m >= F32(2.0**-126))
    m1 = jnp.where(ok, m, F32(1.0))
    u = bits(m1)
    e = (u >> 23).astype(I32) - 127
    half = e >> 1  # floor(e / 2): m = mm * 4^half, mm in [1, 4)
    mm = from_bits((u & U32(0x007FFFFF)) | ((e - 2 * half + 127).astype(U32) << 23))
    y = jnp.sqrt(mm) if approx is None else approx(mm)
    y = _sqrt_step(mm, _sqrt_step(mm, y, sep), sep)
    return jnp.where(ok, _scaled(y, half), jnp.sqrt(m))


def lane_tree_sum(a):
    """reference.tree_sum over the last axis, in lane rolls: lane 0 of tree(n) holds the sum of
    a[0..n) in the reference's association (n even: the two halves; n odd: the first n - 1, then
    the last). Other lanes hold partial sums that are never read. Returns [..., 1]."""
    d = a.shape[-1]
    ax = a.ndim - 1

    def tree(n):
        if n == 1:
            return a
        if n % 2:
            return tree(n - 1) + pltpu.roll(a, d - (n - 1), ax)  # lane p: tree(n-1)@p + a[p + n - 1]
        h = tree(n // 2)
        return h + pltpu.roll(h, d - n // 2, ax)  # lane p: tree(n/2)@p + tree(n/2)@(p + n/2)

    return tree(d)[..., 0:1]


def rms_norm(x, w, head_dim: int, eps: float, dtype, sep=keep, norm_type: str = "rms"):
    """reference.rms_norm of f32 rows x [..., D] (values of `dtype`) with w [1, D] f32 ("rms":
    r(w * r(x * inv)); "gemma": r((x * inv) * (1 + w)), one rounding; "weightless": r(x * inv), w
    unused); f32 values of `dtype`, NaNs canonical."""
    r = rounder(dtype)
    s = lane_tree_sum(sep(x * x))
    ms = div_rn(s, jnp.full(s.shape, float(head_dim), F32), sep=sep)
    inv = div_rn(jnp.ones_like(ms), sqrt_rn(ms + F32(eps), sep=sep), sep=sep)
    if norm_type == "weightless":
        n = r(x * inv)
    elif norm_type == "gemma":
        n = r(sep(x * inv) * (F32(1.0) + w))
    else:
        n = r(w * r(x * inv))
    canon = from_bits(jnp.full(n.shape, CANONICAL_NAN_BITS[np.dtype(dtype)], U32))
    return jnp.where(jnp.isnan(n), canon, n)


# ---- fp8 caches ------------------------------------------------------------------------------------
# (mantissa bits M, exponent bias B, largest finite code, canonical NaN code, no negative zero, max value)
FP8 = {"float8_e4m3fn": (3, 7, 0x7E, 0x7F, False, 448.0), "float8_e4m3fnuz": (3, 8, 0x7F, 0x80, True, 240.0),
       "float8_e5m2": (2, 15, 0x7B, 0x7F, False, 57344.0)}
F32_MAX = float(np.finfo(np.float32).max)
TOKEN_AMAX_FLOOR = float(np.float32(1e-8))  # contract.TOKEN_AMAX_FLOOR


def f8_codes(y, name: str):
    """The fp8 bits (uint8) of f32 y in the cache dtype `name` (narrow_codes: the reference's
    saturating conversion)."""
    return narrow_codes(y, FP8[name], 8).astype(jnp.uint8)


def inverse_scale(s, sep=keep):
    """reference.inverse_scale of f32 scales: the correctly rounded 1/|s| (div_rn) with s's sign,
    an overflow to inf the largest finite f32 (0 and scales below 2^-128; a subnormal scale reads
    as 0 where the hardware flushes it)."""
    a = from_bits(bits(s) & U32(0x7FFFFFFF))
    q = div_rn(jnp.ones_like(a), a, sep=sep)
    q = jnp.where(q == F32(jnp.inf), F32(F32_MAX), q)
    return from_bits(bits(q) | (bits(s) & U32(0x80000000)))


def row_amax(y):
    """max |y| over the last axis of f32 rows, NaN and +-inf left out (0 when none is left): [..., 1].
    A max is exact, so its reduction order does not matter."""
    a = from_bits(bits(y) & U32(0x7FFFFFFF))
    return jnp.max(jnp.where(a <= F32(F32_MAX), a, F32(0.0)), axis=-1, keepdims=True)


QUANT_MAX = {**{name: fmt[5] for name, fmt in FP8.items()}, "int8": 127.0, "int4": 7.0}  # contract.QUANT_MAX


def int8_codes(y, q: float = 127.0):
    """reference.quantize_rows' integer rule on f32 y (already scaled): NaN stores 0, then round half
    to even and saturate to +-q (clamping first is the same: the bounds are integers). The rounding
    is integer arithmetic on the f32 bits (the mantissa shifted by the exponent difference)."""
    u = bits(jnp.clip(jnp.where(jnp.isnan(y), F32(0.0), y), F32(-q), F32(q)))
    a = u & U32(0x7FFFFFFF)
    e = a >> 23
    mant = jnp.where(e == 0, U32(0), (a & U32(0x007FFFFF)) | U32(0x00800000))
    code = _shift_rne(mant, jnp.clip(U32(150) - jnp.minimum(e, U32(149)), 1, 25)).astype(I32)
    return jnp.where((u >> 31) == 1, -code, code).astype(jnp.int8)


def pack_int4(c):
    """int8 values in [-7, 7], [..., D] -> uint8 bytes [..., D/2], channel 2j in the low nibble of byte
    j (reference.pack_int4). The pairs are combined at the even lanes, then compacted to lanes
    [0, D/2) by lane rolls: stage k moves down by 2^k every byte whose index has bit k set (lowest
    bit first: the bytes keep their order, so no two ever share a lane), each byte tagged with its
    index so a stage knows which lanes hold one."""
    d = c.shape[-1]
    ax = c.ndim - 1
    nib = c.astype(I32) & I32(0xF)
    lane = _lanes(c.shape)
    v = nib | (pltpu.roll(nib, d - 1, ax) << 4)  # even lane 2j: byte j
    tag = jnp.where((lane & 1) == 0, lane >> 1, -1)
    for k in range(max(1, (d // 2 - 1).bit_length())):
        moving = (tag >= 0) & (((tag >> k) & 1) == 1)
        v_in, tag_in = pltpu.roll(v, d - (1 << k), ax), pltpu.roll(jnp.where(moving, tag, -1), d - (1 << k), ax)
        v = jnp.where(tag_in >= 0, v_in, v)
        tag = jnp.where(tag_in >= 0, tag_in, jnp.where(moving, -1, tag))
    return v[..., : d // 2].astype(jnp.uint8)


def token_scale(amax, name: str, sep=keep):
    """reference.token_scale: r32(max(amax, 1e-8) / Q) (Q: the format's largest value), correctly rounded."""
    top = jnp.maximum(amax, F32(TOKEN_AMAX_FLOOR))
    return div_rn(top, jnp.full(top.shape, QUANT_MAX[name], F32), sep=sep)


# ---- NVFP4 / MXFP4 caches (reference.quantize_blocks) ------------------------------------------------
FP4_MAX = 6.0  # contract.FP4_MAX
E4M3_MAX = 448.0
# reference.E2M1_STEPS: code >= k + 1 where |p| passes threshold k (strictly above it where the tie goes down)
E2M1_STEPS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))


def block_amax_lanes(y, group: int):
    """reference.block_amax of f32 rows [..., D], on every lane of its block (a butterfly of lane
    rolls inside each group of `group` lanes): [..., D]. NaN and +-inf left out; a max is exact."""
    d, ax = y.shape[-1], y.ndim - 1
    a = from_bits(bits(y) & U32(0x7FFFFFFF))
    a = jnp.where(a <= F32(F32_MAX), a, F32(0.0))
    lane = _lanes(a.shape)
    s = 1
    while s < group:  # lane l meets lane l ^ s: l + s (roll by d - s) or l - s (roll by s)
        a = jnp.maximum(a, jnp.where((lane & s) == 0, pltpu.roll(a, d - s, ax), pltpu.roll(a, s, ax)))
        s *= 2
    return a


def e4m3_value(code):
    """The f32 value of E4M3 codes (u32, finite, >= 0): exact, by moving bit fields (subnormals m * 2^-9)."""
    e, m = (code >> 3) & U32(0xF), code & U32(7)
    normal = from_bits(((e + U32(120)) << 23) | (m << 20))
    return jnp.where(e == 0, m.astype(I32).astype(F32) * F32(2.0**-9), normal)


def e2m1_codes(p):
    """reference.e2m1_codes of f32 p: codes 0..15 (int32, sign in bit 3), half to even by exact
    comparisons of |p| with the midpoints, saturating at +-6, NaN -> +0, the sign of a zero kept."""
    u = jnp.where(jnp.isnan(p), U32(0), bits(p))
    a = from_bits(u & U32(0x7FFFFFFF))
    code = jnp.zeros(p.shape, I32)
    for t, up in E2M1_STEPS:
        code = code + jnp.where((a >= F32(t)) if up else (a > F32(t)), I32(1), I32(0))
    return code | ((u >> 31).astype(I32) << 3)


def compact_lanes(v, stride: int):
    """int32 [..., D] -> [..., D / stride]: lane j holds v's lane j * stride. As pack_int4's
    compaction: stage k moves every value whose index has bit k set down by (stride - 1) * 2^k
    (lowest bit first, so values keep their order and never share a lane)."""
    d, ax = v.shape[-1], v.ndim - 1
    n = d // stride
    lane = _lanes(v.shape)
    tag = jnp.where(lax.rem(lane, I32(stride)) == 0, lax.div(lane, I32(stride)), -1)
    for k in range((n - 1).bit_length()):
        step = (stride - 1) << k
        moving = (tag >= 0) & (((tag >> k) & 1) == 1)
        v_in, tag_in = pltpu.roll(v, d - step, ax), pltpu.roll(jnp.where(moving, tag, -1), d - step, ax)
        v = jnp.where(tag_in >= 0, v_in, v)
        tag = jnp.where(tag_in >= 0, tag_in, jnp.where(moving, -1, tag))
    return v[..., :n]


def block_quantize(y, fmt: str, g=None, sep=keep):
    """reference.quantize_blocks of f32 rows y [KH, D]: (block-scale bytes uint8 [KH, D/G], E2M1
    bytes uint8 [KH, D/2]); g: NVFP4's global decode scale (f32, y's shape). Every step on all D
    lanes (each lane with its block's amax and scale), then the scales of lanes 0, G, 2G, ... compacted."""
    group = BLOCK_GROUP[fmt]
    amax = block_amax_lanes(y, group)
    if fmt == "nvfp4":  # e4m3(clamp(r32(r32(amax / 6) * r32(1 / g)), 0, 448))
        s = sep(div_rn(amax, jnp.full(amax.shape, FP4_MAX, F32), sep=sep) * inverse_scale(g, sep))
        code = f8_codes(jnp.clip(s, F32(0.0), F32(E4M3_MAX)), "float8_e4m3fn").astype(U32)
        den = sep(e4m3_value(code) * g)
        mult = jnp.where(den == F32(0.0), F32(0.0), inverse_scale(den, sep))  # min(r32(1 / den), FLT_MAX)
    else:  # X = clamp(exponent field - 127 - 2, -127, 127): byte X + 127, multiplier 2^-X (exact)
        x = jnp.clip((bits(amax) >> 23).astype(I32) - 129, -127, 127)
        code = (x + 127).astype(U32)
        mult = from_bits((127 - x).astype(U32) << 23)
    scales = compact_lanes(code.astype(I32), group).astype(jnp.uint8)
    return scales, pack_int4(e2m1_codes(sep(y * mult)))


def widen(out_bits, dtype):
    """The f32 values of output bits in `dtype` (bf16: a shift)."""
    if np.dtype(dtype) == F16:
        return f16_widen(out_bits)
    if np.dtype(dtype).itemsize == 4:
        return from_bits(out_bits)
    return from_bits(out_bits.astype(U32) << U32(16))


# ---- the rotation ---------------------------------------------------------------------------------
def _lanes(shape):
    return lax.broadcasted_iota(I32, shape, len(shape) - 1)


def _spread_pairs(c, d: int):
    """[TB, W] half-table values -> [TB, d] with value i at lanes 2i and 2i+1 (GPT-J pairs), by lane
    rolls: stage k moves the values whose index has bit k set up by 2^k (highest bit first, so no
    two live values ever share a lane), then each even lane is copied to the odd one above it."""
    g, w = c.shape
    v = jnp.concatenate([c, jnp.zeros((g, d - w), F32)], axis=-1) if d > w else c
    lane = _lanes(v.shape)
    for k in reversed(range(max(1, (w - 1).bit_length()))):
        v = jnp.where(((lane >> k) & 3) == 2, pltpu.roll(v, 1 << k, 1), v)
    return jnp.where((lane & 1) == 1, pltpu.roll(v, 1, 1), v)


def mrope_rows(rows, cfg: Config):
    """[TB, W] table values: the rows themselves, or with M-RoPE ([3, TB, W], one row per stream)
    column c from the row of its frequency's stream (contract.mrope_stream, by lane arithmetic)."""
    if not cfg.mrope:
        return rows
    t, h, w = cfg.mrope
    half = cfg.rotary_dim // 2
    c = _lanes(rows.shape[1:])
    i = (jnp.where(c >= half, c - half, c) if cfg.neox else c >> 1) if cfg.full_table else c  # the frequency
    if cfg.mrope_interleaved:
        m3 = lax.rem(i, I32(3))
        stream = jnp.where((m3 == 1) & (i < 3 * h), 1, jnp.where((m3 == 2) & (i < 3 * w), 2, 0))
    else:
        stream = jnp.where(i < t, 0, jnp.where(i < t + h, 1, 2))
    return jnp.where(stream == 0, rows[0], jnp.where(stream == 1, rows[1], rows[2]))


def table_lanes(cos, sin, cfg: Config):
    """(C, S') [TB, D] f32 from the rows [TB, W]: C the cosine of each channel's pair, S' its sine
    negated on the first member of the pair (a' = a*C + b*S'). Lanes >= R are never used."""
    d, r, off = cfg.head_dim, cfg.rotary_dim, cfg.rotary_offset
    g = cos.shape[0]

    def widen(t):
        if cfg.full_table:
            parts = [t]
        elif cfg.neox:
            parts = [t, t]
        else:  # spread over [0, R), then moved to the tail
            v = _spread_pairs(t, d)
            return pltpu.roll(v, off, 1) if off else v
        if off:
            parts.insert(0, jnp.zeros((g, off), F32))
        elif d > r:
            parts.append(jnp.zeros((g, d - r), F32))
        return jnp.concatenate(parts, axis=-1) if len(parts) > 1 else t

    c, s = widen(cos), widen(sin)
    rel = _lanes(c.shape) - off  # the channel within the rotary part
    first = rel < r // 2 if cfg.neox else (rel & 1) == 0
    return c, jnp.where(first, -s, s)


def partner(x, cfg: Config):
    """The other member of each channel's rotary pair, by lane rolls over D."""
    d, r = cfg.head_dim, cfg.rotary_dim
    ax = x.ndim - 1
    rel = _lanes(x.shape) - cfg.rotary_offset  # the channel within the rotary part
    if cfg.neox:
        return jnp.where(rel < r // 2, pltpu.roll(x, d - r // 2, ax), pltpu.roll(x, r // 2, ax))
    return jnp.where((rel & 1) == 0, pltpu.roll(x, d - 1, ax), pltpu.roll(x, 1, ax))


def rotate(x, c, s, cfg: Config, dtype, sep=keep):
    """Rotated channels of f32 x [H, D] (values of `dtype`) with C, S' [1, D]: f32 before the
    final rounding."""
    p = partner(x, cfg)
    if cfg.rounded:
        r = rounder(dtype)
        return r(x * c) + r(p * s)
    return sep(x * c) + sep(p * s)


def finish(y, tail, cfg: Config, dtype):
    """The bits of the output rows in `dtype`: rotated channels < R from f32 y, channels >= R
    moved from `tail` (the input's bits, or the normalised input's)."""
    out = output_bits(y, dtype)
    if cfg.rotary_dim == cfg.head_dim:
        return out
    if cfg.rotary_tail:  # channels [0, D - R) pass through
        off = cfg.rotary_offset
        return jnp.concatenate([tail[..., :off], out[..., off:]], axis=-1)
    return jnp.concatenate([out[..., : cfg.rotary_dim], tail[..., cfg.rotary_dim :]], axis=-1)


# ---- DMA runs ------------------------------------------------------------------------------------
def for_each_run(count, walks):
    """For each (key, emit) of `walks`, calls emit(t, n, k) for every maximal run of tokens t, t+1,
    ..., t+n-1 (< count) whose keys are k, k+1, ...; key(t) -> (k, valid, joins): a run never holds
    an invalid token, and a token whose `joins` is False starts a new run (e.g. the first offset of
    a cache block). One scalar loop walks them all."""

    def body(t, carry):
        out = []
        for (key, emit), (start, start_key, start_ok, prev) in zip(walks, carry):
            k, ok, joins = key(t)
            ok = jnp.asarray(ok).astype(I32)  # scalar flags stay 32-bit
            cont = (t > 0) & (ok == 1) & (start_ok == 1) & joins & (k == prev + 1)

            @pl.when((t > 0) & jnp.logical_not(cont) & (start_ok == 1))
            def _():
                emit(start, t - start, start_key)

            out.append((jnp.where(cont, start, t), jnp.where(cont, start_key, k), jnp.where(cont, start_ok, ok), k))
        return tuple(out)

    zero = (I32(0), I32(0), I32(0), I32(0))
    final = lax.fori_loop(0, count, body, tuple(zero for _ in walks))
    for (_, emit), (start, start_key, start_ok, _) in zip(walks, final):
        @pl.when((count > 0) & (start_ok == 1))
        def _():
            emit(start, count - start, start_key)


def cache_index(axes, layer, blk, off, n, head=None):
    """Ref index of n token rows at (blk, off, ...) of one cache (head: one head's rows)."""
    pick = {"NB": blk, "BS": pl.ds(off, n), "KH": slice(None) if head is None else I32(head), "2KH": slice(None),
            "D": slice(None)}
    return ((layer,) if layer is not None else ()) + tuple(pick[a] for a in axes)


def cache_copies(src, cache, axes, layer, t, n, slot, block_size, kv_heads, head0=None):
    """The DMA descriptors (without semaphores bound yet) writing tokens t..t+n-1 of `src` [T, KH, D]
    (head0: src's rows [head0, head0 + KH) of [T, H, D], the fused QKV tensor's v rows) to slots
    slot..slot+n-1 (one cache block)."""
    blk, off = lax.div(slot, I32(block_size)), lax.rem(slot, I32(block_size))
    if row_dma(axes) in ("whole", "merged"):
        rows = src.at[pl.ds(t, n)] if head0 is None else src.at[pl.ds(t, n), pl.ds(head0, kv_heads)]
        return [(rows, cache.at[cache_index(axes, layer, blk, off, n)])]
    return [(src.at[pl.ds(t, n), I32(h + (head0 or 0))], cache.at[cache_index(axes, layer, blk, off, n, h)])
            for h in range(kv_heads)]


def scale_copies(src, cache, axes, layer, t, n, slot, block_size, kv_heads):
    """The DMA descriptors writing the per-token scales of tokens t..t+n-1 (`src` [KH, lanes], one
    token per lane) to slots slot..slot+n-1 of a scale cache (BS last: one DMA per head)."""
    blk, off = lax.div(slot, I32(block_size)), lax.rem(slot, I32(block_size))
    out = []
    for h in range(kv_heads):
        pick = {"NB": blk, "BS": pl.ds(off, n), "KH": I32(h)}
        idx = ((layer,) if layer is not None else ()) + tuple(pick[a] for a in axes)
        out.append((src.at[I32(h), pl.ds(t, n)], cache.at[idx]))
    return out


# ---- the kernel ----------------------------------------------------------------------------------
def switch(use_rope, rotated, off):
    """The row of this call: `rotated` where the use_rope scalar is nonzero, else `off` (bits)."""
    return jnp.where(jnp.full(rotated.shape, use_rope, I32) != 0, rotated, off)



def _kernel(slot_ref, pos_ref, layer_ref, *refs, cfg: Config, sep):
    it = iter(refs)
    use_ref = next(it) if cfg.rope_switch else None  # the 4th scalar prefetch
    kh, nq = cfg.kv_heads, cfg.q_heads * (2 if cfg.q_gate else 1)
    if cfg.qkv:  # one VMEM block of fused rows [TB, nq + 2KH, D] (and the tensor in HBM for V's DMA)
        x_ref = next(it)
        v_ref = x_ref if cfg.v_in_vmem else next(it)
        q_ref, k_ref = x_ref, x_ref
        heads = {"q": pl.ds(0, cfg.q_heads, stride=2) if cfg.q_gate else pl.ds(0, cfg.q_heads), "k": pl.ds(nq, kh),
                "v": pl.ds(nq + kh, kh)}
        v_head0 = nq + kh
    else:
        q_ref, k_ref, v_ref = (next(it) for _ in range(3))
        heads = dict.fromkeys("qkv", slice(None))
        v_head0 = None
    rotary = cfg.rotary_dim > 0  # NoPE: no tables at all
    cos_hbm, sin_hbm = (next(it), next(it)) if rotary else (None, None)
    weighted = cfg.norm_type != "weightless"
    qw_ref = next(it) if cfg.q_norm and weighted else None
    kw_ref = next(it) if cfg.k_norm and weighted else None
    ks_ref, vs_ref = (next(it), next(it)) if cfg.quant and not cfg.token_scales else (None, None)
    temp_hbm = next(it) if cfg.temperature else None  # temperature factors [N, 1] f32
    gs_ref = next(it) if cfg.global_scales else None  # NVFP4's global decode scales [2] f32 (SMEM)
    ncache = (1 if cfg.merged else 2) + (2 if cfg.token_scales else 0)
    for _ in range(ncache):
        next(it)  # the caches as inputs: aliased to the outputs below
    qo_ref, ko_ref, kc_ref = (next(it) for _ in range(3))
    vc_ref = None if cfg.merged else next(it)
    ksc_ref, vsc_ref = (next(it), next(it)) if cfg.token_scales else (None, None)
    cos_buf, sin_buf, c_buf, s_buf, table_sem = (next(it) for _ in range(5)) if rotary else (None,) * 5
    k_sem, v_sem = next(it), next(it)
    f_buf, f_sem = (next(it), next(it)) if cfg.temperature else (None, None)  # each token's factor [TB, 1]
    kv_buf = next(it) if cfg.merged else None  # merged: K and V rows go out of kv_buf
    kq_buf, vq_buf = (next(it), next(it)) if cfg.quant and not cfg.merged else (None, None)  # fp8 rows
    ksc_buf, vsc_buf, sc_sem = (next(it) for _ in range(3)) if cfg.token_scales else (None, None, None)

    tb, t_all = cfg.block_tokens, cfg.tokens
    base = pl.program_id(0) * tb
    count = jnp.minimum(I32(tb), I32(t_all) - base)  # tokens of this block (the last may be short)
    nslots = cfg.num_blocks * cfg.block_size
    if cfg.num_layers:
        layer = layer_ref[0]
        layer_ok = (layer >= 0) & (layer < cfg.num_layers)
        layer = jnp.where(layer_ok, layer, 0)
    else:
        layer, layer_ok = None, True

    def position(stream):
        def key(t):  # positions [streams * T]: stream s of token t at s * T + t
            p = jnp.clip(pos_ref[stream * t_all + base + t], 0, cfg.max_pos - 1)
            return p, True, True
        return key

    def slot(t):
        s = slot_ref[base + t]
        ok = (s >= 0) & (s < nslots) & layer_ok
        return s, ok, lax.rem(jnp.maximum(s, 0), I32(cfg.block_size)) != 0

    def table_copies(stream):
        def copies(t, n, p):
            at = (lambda b: b.at[pl.ds(t, n)]) if cfg.streams == 1 else (lambda b: b.at[stream, pl.ds(t, n)])
            return [(tab.at[pl.ds(p, n)], at(buf)) for tab, buf in ((cos_hbm, cos_buf), (sin_hbm, sin_buf))]
        return copies

    def factor(t):  # n = (p + 1) // floor_scale: the row of the temperature factors
        p = position(0)(t)[0]
        return lax.div(p + 1, I32(cfg.temperature)), True, True

    def factor_copies(t, n, k):
        return [(temp_hbm.at[pl.ds(k, n)], f_buf.at[pl.ds(t, n)])]

    def table_walks(act):
        out = [walk(table_copies(st), position(st), table_sem, act) for st in range(cfg.streams)] if rotary else []
        return out + ([walk(factor_copies, factor, f_sem, act)] if cfg.temperature else [])

    def walk(copies_of, key, sem, act):
        """(key, emit) starting or waiting for the copies of each run: a wait mirrors its start."""
        def emit(t, n, k):
            for src, dst in copies_of(t, n, k):
                d = pltpu.make_async_copy(src, dst, sem)
                d.start() if act == "start" else d.wait()
        return key, emit

    def k_copies(t, n, s):
        src = kv_buf if cfg.merged else kq_buf if cfg.quant else ko_ref
        return cache_copies(src, kc_ref, cfg.key_axes, layer, t, n, s, cfg.block_size, cfg.kv_heads)

    def v_copies(t, n, s):
        if cfg.quant:  # the quantized rows, from VMEM
            return cache_copies(vq_buf, vc_ref, cfg.value_axes, layer, t, n, s, cfg.block_size, cfg.kv_heads)
        return cache_copies(v_ref, vc_ref, cfg.value_axes, layer, base + t, n, s, cfg.block_size, cfg.kv_heads,
                            v_head0)

    def scale_walks(act):
        if not cfg.token_scales:
            return []
        if cfg.block_group:  # block-scale rows [KH, D/G] per token: the key cache's axes, D/G last
            return [walk(lambda t, n, s, src=src, dst=dst: cache_copies(src, dst, cfg.key_axes, layer, t, n, s,
                                                                        cfg.block_size, cfg.kv_heads), slot, sc_sem, act)
                    for src, dst in ((ksc_buf, ksc_ref), (vsc_buf, vsc_ref))]
        return [walk(lambda t, n, s, src=src, dst=dst: scale_copies(src, dst, cfg.scale_axes, layer, t, n, s,
                                                                      cfg.block_size, cfg.kv_heads), slot, sc_sem, act)
                for src, dst in ((ksc_buf, ksc_ref), (vsc_buf, vsc_ref))]

    v_direct = not cfg.v_in_vmem  # v HBM -> the value cache, before the compute
    v_early = lambda act: [walk(v_copies, slot, v_sem, act)] if v_direct else []  # noqa: E731
    v_late = lambda act: [walk(v_copies, slot, v_sem, act)] if cfg.quant and not cfg.merged else []  # noqa: E731
    for_each_run(count, table_walks("start") + v_early("start"))
    for_each_run(count, table_walks("wait"))

    if rotary:
        c_buf[...], s_buf[...] = table_lanes(*(mrope_rows(to_f32(b[...]), cfg) for b in (cos_buf, sin_buf)), cfg)
    weights = [None if w is None else to_f32(w[...]) for w in (qw_ref, kw_ref)]
    norms = (cfg.q_norm, cfg.k_norm)
    static_inv = [None if r is None else inverse_scale(r[...], sep) for r in (ks_ref, vs_ref)]  # [KH, 1]
    fp8 = jnp.dtype(cfg.cache_dtype) if cfg.cache_dtype in FP8 else None

    def quantize(y, inv_static, sc_buf, t, gi):
        """fp8 rows of f32 rows y [KH, D] (the static rule, or the row's own scale, put in lane t of sc_buf)."""
        if cfg.block_group:  # the row's block scales to sc_buf[t] ([TB, KH, D/G] bytes)
            g = None if gs_ref is None else jnp.full(y.shape, gs_ref[gi], F32)
            scales, packed = block_quantize(y, cfg.cache_dtype, g, sep)
            sc_buf[t] = scales
            return packed
        if sc_buf is None:
            inv = inv_static
        else:
            scale = token_scale(row_amax(y), cfg.cache_dtype, sep)  # [KH, 1]
            inv = inverse_scale(scale, sep)
            c0 = pl.multiple_of(lax.div(t, I32(128)) * 128, 128)  # t >= 0: no floor correction
            cur = sc_buf[:, pl.ds(c0, 128)]
            sc_buf[:, pl.ds(c0, 128)] = jnp.where(_lanes(cur.shape) == t - c0, scale, cur)
        if cfg.cache_dtype == "int8":
            return int8_codes(y * inv)
        if cfg.cache_dtype == "int4":
            return pack_int4(int8_codes(y * inv, 7.0))
        return lax.bitcast_convert_type(f8_codes(y * inv, cfg.cache_dtype), fp8)

    def compute(t, _):
        c, s = (c_buf[pl.ds(t, 1), :], s_buf[pl.ds(t, 1), :]) if rotary else (None, None)
        rows = []
        for x_ref, which, o_ref, w, normed in ((q_ref, "q", qo_ref, weights[0], norms[0]),
                                               (k_ref, "k", ko_ref, weights[1], norms[1])):
            x_in = x_ref[t, heads[which], :]
            dtype = x_in.dtype
            x = to_f32(x_in)
            tail = lax.bitcast_convert_type(x_in, UINT[np.dtype(dtype).itemsize])
            norm = lambda y: rms_norm(y, w, cfg.head_dim, cfg.norm_eps, dtype, sep, cfg.norm_type)  # noqa: E731
            if normed and not cfg.norm_after:
                x = norm(x)
                tail = value_bits(x, dtype)
            off = tail  # the row of a call that does not rotate
            if which == "q" and cfg.temperature:  # q times its token's factor, one rounding
                off = output_bits(x * f_buf[pl.ds(t, 1), :], dtype)
            if rotary:
                out = finish(rotate(x, c, s, cfg, dtype, sep), tail, cfg, dtype)
                if normed and cfg.norm_after:  # the norm of the rotated, rounded row
                    out = value_bits(norm(widen(out, dtype)), dtype)
                if cfg.rope_switch:
                    out = switch(use_ref[0], out, off)
            else:
                out = off
            o_ref[t] = lax.bitcast_convert_type(out, dtype)
            rows.append((out, dtype))
        if cfg.quant:  # the cache stores the rounded k_out and v, quantized
            k_row = quantize(widen(*rows[1]), static_inv[0], ksc_buf, t, 0)
            v_row = quantize(to_f32(v_ref[t, heads["v"], :]), static_inv[1], vsc_buf, t, 1)
        elif cfg.merged:
            k_row, v_row = ko_ref[t], v_ref[t, heads["v"], :]
        if cfg.merged:  # one sublane per head: K head h to row 2h, V head h to 2h+1 (bits as they are)
            kr, vr = KV_MERGED_ROWS
            for h in range(cfg.kv_heads):
                kv_buf[t, pl.ds(2 * h + kr, 1), :] = k_row[h : h + 1]
                kv_buf[t, pl.ds(2 * h + vr, 1), :] = v_row[h : h + 1]
        elif cfg.quant:
            kq_buf[t] = k_row
            vq_buf[t] = v_row
        return 0

    lax.fori_loop(0, tb, compute, 0)

    late = lambda act: [walk(k_copies, slot, k_sem, act)] + v_late(act) + scale_walks(act)  # noqa: E731
    for_each_run(count, late("start"))
    for_each_run(count, v_early("wait") + late("wait"))


def rope_and_cache(q, k, v, key_cache, value_cache, slots, positions, cos, sin, layer, q_norm_weight=None,
                   k_norm_weight=None, k_scale=None, v_scale=None, use_rope=None, temperature_factors=None,
                   global_scales=None, *, cfg: Config, interpret=False):
    """(q_out, k_out, key_cache, value_cache[, k_scale_cache, v_scale_cache]); slots int32 [T] and
    positions int32 [T] (M-RoPE: [3 * T], stream-major) (slots outside [0, NB*BS) write nothing,
    positions are clamped here), layer int32 [1].
    fp8 caches: k_scale / v_scale f32 [KH, 1] (static scales), or with cfg.token_scales the scale
    caches (written, aliased); NVFP4 / MXFP4: the block-scale caches as uint8 (written, aliased) and for
    NVFP4 global_scales f32 [2] (k, v). The caches are aliased: donate them for an in-place update.
    `interpret`: pallas_call's (e.g. pltpu.InterpretParams())."""
    tb, t, d, kh = cfg.block_tokens, cfg.tokens, cfg.head_dim, cfg.kv_heads
    w = cfg.table_width
    row = lambda h: pl.BlockSpec((tb, h, d), lambda i, *_: (i, 0, 0))  # noqa: E731
    hbm = pl.BlockSpec(memory_space=pl.ANY)
    weight = pl.BlockSpec((1, d), lambda i, *_: (0, 0))
    if cfg.qkv:  # q is the fused tensor (k and v the same one)
        in_specs, operands = [row(q.shape[1])] + ([] if cfg.v_in_vmem else [hbm]), [q] + ([] if cfg.v_in_vmem else [q])
    else:
        in_specs, operands = [row(cfg.q_heads), row(kh), row(kh) if cfg.v_in_vmem else hbm], [q, k, v]
    if cfg.rotary_dim:  # NoPE: the tables stay out
        in_specs += [hbm, hbm]
        operands += [cos, sin]
    for on, wt in ((cfg.q_norm, q_norm_weight), (cfg.k_norm, k_norm_weight)):
        if on and cfg.norm_type != "weightless":
            in_specs.append(weight)
            operands.append(wt.reshape(1, d))
    if cfg.quant and not cfg.token_scales:
        in_specs += [pl.BlockSpec((kh, 1), lambda i, *_: (0, 0))] * 2
        operands += [k_scale, v_scale]
    if cfg.temperature:
        in_specs.append(hbm)
        operands.append(temperature_factors.reshape(-1, 1))
    if cfg.global_scales:
        in_specs.append(pl.BlockSpec(memory_space=pltpu.SMEM))
        operands.append(global_scales.astype(F32).reshape(2))
    cache_at = cfg.scalar_prefetch + len(operands)  # operand index of key_cache, counting the scalar prefetch
    caches = [key_cache] if cfg.merged else [key_cache, value_cache]  # merged: the placeholder stays out
    if cfg.token_scales:
        caches += [k_scale, v_scale]
    in_specs += [hbm] * len(caches)
    operands += caches
    rows = (tb, w) if cfg.streams == 1 else (cfg.streams, tb, w)
    scratch = [pltpu.VMEM(rows, cos.dtype), pltpu.VMEM(rows, sin.dtype), pltpu.VMEM((tb, d), F32),
               pltpu.VMEM((tb, d), F32), pltpu.SemaphoreType.DMA(())] if cfg.rotary_dim else []
    scratch += [pltpu.SemaphoreType.DMA(()), pltpu.SemaphoreType.DMA(())]
    if cfg.temperature:
        scratch += [pltpu.VMEM((tb, 1), F32), pltpu.SemaphoreType.DMA(())]
    if cfg.merged:
        scratch.append(pltpu.VMEM((tb, 2 * kh, key_cache.shape[-1]), key_cache.dtype))
    elif cfg.quant:  # (int4: D/2 bytes a row)
        scratch += [pltpu.VMEM((tb, kh, key_cache.shape[-1]), key_cache.dtype),
                    pltpu.VMEM((tb, kh, value_cache.shape[-1]), value_cache.dtype)]
    if cfg.block_group:  # one row of block-scale bytes per token and head
        scratch += [pltpu.VMEM((tb, kh, d // cfg.block_group), jnp.uint8)] * 2 + [pltpu.SemaphoreType.DMA(())]
    elif cfg.token_scales:
        scratch += [pltpu.VMEM((kh, cfg.scale_lanes), F32), pltpu.VMEM((kh, cfg.scale_lanes), F32),
                    pltpu.SemaphoreType.DMA(())]
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=cfg.scalar_prefetch, grid=(cfg.grid,), in_specs=in_specs,
        out_specs=[row(cfg.q_heads), row(kh)] + [hbm] * len(caches), scratch_shapes=scratch)
    out_shape = [jax.ShapeDtypeStruct((t, cfg.q_heads, d), q.dtype), jax.ShapeDtypeStruct((t, kh, d), q.dtype)]
    out_shape += [jax.ShapeDtypeStruct(c.shape, c.dtype) for c in caches]
    call = pl.pallas_call(
        functools.partial(_kernel, cfg=cfg, sep=keep if interpret else plain), grid_spec=grid_spec, out_shape=out_shape,
        input_output_aliases={cache_at + i: 2 + i for i in range(len(caches))},
        # each step waits for its own DMAs, so steps are independent (megacore may split them)
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
        interpret=interpret, name="rope_and_cache")
    with jax.enable_x64(False):  # the kernel's index arithmetic is int32, also inside an x64 program
        prefetch = (slots, positions, layer) + ((use_rope,) if cfg.rope_switch else ())
        out = list(call(*prefetch, *operands))
    if cfg.merged:
        out.insert(3, value_cache)
    return tuple(out)
