"""float32 inputs that exercise every rounding boundary of float8_e5m2, and an independent oracle.

`boundary_f32()` is a stratified sample of float32 bit patterns: for every sign and every
exponent (all 256 of them, so zero, subnormals, the whole normal range, inf and NaN), the top six
mantissa bits in every combination with seven fills below them (zero, one, all ones, the next
bit alone, ...). That holds, for every exponent, each exact tie of the e5m2 rounding (21 dropped
bits in the normal range, 22..24 in e5m2's subnormal range), one float32 ulp either side of it,
and the values that carry into the next exponent. Explicit points follow: the largest finite
value 57344, the tie 61440 between it and 2^16, the subnormal limits (2^-16 the smallest, 2^-17
its half, 3 * 2^-16 the largest, 2^-14 the smallest normal), float32 extremes, +-0, +-inf and
NaNs with payloads and both signs.

`oracle_e5m2(f)` gives the bits the op stores for float32 values f (scale 1): the nearest finite
e5m2 value, found by searching the 124 finite non-negative values in float64, ties to the even
code, |f| beyond 57344 saturating to +-57344, NaN 0x7F, the sign kept (also on zero). It shares
no code with ml_dtypes or the kernels.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

E5M2 = np.dtype(ml_dtypes.float8_e5m2)
MAX = 57344.0

_LOW_FILLS = np.array([0x0, 0x1, 0x1FFFF, 0x10000, 0xFFFF, 0x10001, 0x0ACE5], np.uint32)  # bits 0..16


def _values() -> np.ndarray:
    """The float64 value of every finite non-negative e5m2 code 0x00..0x7B (exact)."""
    codes = np.arange(0x7C, dtype=np.uint8)
    e, m = codes >> 2, codes & 3
    return np.where(e == 0, m * 2.0**-16, (1 + m / 4.0) * 2.0 ** (e.astype(np.int64) - 15))


_VALS = _values()


# The float32 exponents where e5m2 rounds (98..146: below 2^-28 everything is +-0, from 2^20 on
# everything saturates) and the extremes (zero and f32 subnormals, inf and NaN): what the slower
# emulations take.
ROUNDING_EXPONENTS = (0, 1, *range(98, 147), 254, 255)


def boundary_f32(rng: np.random.Generator | None = None, n_random: int = 0, exponents=range(256)) -> np.ndarray:
    """The stratified sample (module docstring) over `exponents`, the explicit points, and n_random
    random bit patterns from rng."""
    top = np.arange(64, dtype=np.uint32) << np.uint32(17)
    mant = (top[:, None] | _LOW_FILLS[None, :]).ravel()
    exps = np.asarray(exponents, np.uint32) << np.uint32(23)
    pos = (exps[:, None] | mant[None, :]).ravel()
    bits = np.concatenate([pos, pos | np.uint32(0x80000000)])
    points = np.array([MAX, np.nextafter(MAX, 0), np.nextafter(MAX, np.inf), 61440.0, np.nextafter(61440.0, 0),
                       np.nextafter(61440.0, np.inf), 65536.0, 2.0**-16, 2.0**-17, 3 * 2.0**-18, 5 * 2.0**-18,
                       3 * 2.0**-16, 7 * 2.0**-18, 2.0**-14, 2.0**-14 - 2.0**-18, 2.0**-14 - 2.0**-19, 1e-45,
                       np.finfo(np.float32).tiny, np.finfo(np.float32).max, 0.0, np.inf, 1.0, 1.125, 1.375,
                       448.0, 240.0, 57343.0, 49152.0, 53248.0], np.float64).astype(np.float32)
    points = np.concatenate([points, -points]).view(np.uint32)
    nans = np.array([0x7FC00000, 0x7F800001, 0x7FFFFFFF, 0xFFC00000, 0xFF800001, 0x7FA5A5A5], np.uint32)
    parts = [bits, points, nans]
    if n_random:
        parts.append(rng.integers(0, 2**32, n_random, dtype=np.uint64).astype(np.uint32))
    return np.concatenate(parts).view(np.float32)


def oracle_e5m2(f: np.ndarray) -> np.ndarray:
    f = np.asarray(f, np.float32)
    nan = np.isnan(f)
    with np.errstate(invalid="ignore"):
        a = np.abs(np.where(nan, np.float32(0), f).astype(np.float64))
    a = np.minimum(a, MAX)
    hi = np.clip(np.searchsorted(_VALS, a, side="left"), 0, len(_VALS) - 1)  # first value >= a
    lo = np.maximum(hi - 1, 0)
    d_lo, d_hi = a - _VALS[lo], _VALS[hi] - a
    code = np.where(d_lo < d_hi, lo, np.where(d_hi < d_lo, hi, np.where(lo % 2 == 0, lo, hi)))
    code = np.where(_VALS[hi] == a, hi, code).astype(np.uint8)
    code |= np.where(np.signbit(f), np.uint8(0x80), np.uint8(0))
    return np.where(nan, np.uint8(0x7F), code).astype(np.uint8)
