"""RoPE cos/sin tables for real models (numpy only, importable without jax).

`rope_tables` builds the (cos, sin) pair that `rope_and_cache` takes, for a rotary dimension, a base
(theta) and one of the scaling laws below; `models.config.rope_tables_from_hf_config` reads the same settings from a
Hugging Face-style config dict (a model's config.json). Every law is computed in float64 and cast to
the table dtype once, at the end.

Scaling laws (`scaling` is a Hugging Face-style `rope_scaling` / `rope_parameters` dict; its
`rope_type` (or legacy `type`) picks the law; None or "default" means plain RoPE):

  inv_freq[i] = base ** (-2i / R), i < R/2                        (default)
  linear    factor                                   inv_freq / factor
  dynamic   factor, original_max_position_embeddings NTK-aware base:
              base' = base * (factor * L / L0 - (factor - 1)) ** (R / (R - 2)),
              L = max(max_pos, L0), L0 = original_max_position_embeddings.
            The table is static, so it is built for the longest sequence it serves, L = max_pos
            (Hugging Face recomputes it per batch at the current length; its value at length max_pos
            is this table). Every position uses these frequencies, also those below L0.
  llama3    factor, low_freq_factor, high_freq_factor, original_max_position_embeddings
            (Llama 3.1): wavelengths above L0/low_freq_factor are divided by factor, below
            L0/high_freq_factor kept, in between smoothly interpolated.
  yarn      factor, original_max_position_embeddings; optional beta_fast (32), beta_slow (1),
            mscale, mscale_all_dim, attention_factor, truncate (True): NTK-by-parts blend of
            inv_freq and inv_freq / factor over a linear ramp between the correction dimensions of
            beta_fast and beta_slow rotations (floored/ceiled when truncate is true; GPT-OSS uses
            truncate=False). Attention factor: attention_factor if given, else
            m(factor, mscale) / m(factor, mscale_all_dim) when both are given and non-zero, else
            m(factor) with m(s, k=1) = 0.1 * k * ln(s) + 1 for s > 1 (1 otherwise).
  longrope  short_factor, long_factor (R/2 values each), original_max_position_embeddings; optional
            factor, attention_factor: inv_freq / ext, with ext = long_factor when max_pos > L0 and
            short_factor otherwise (one static table cannot switch per batch as Hugging Face does;
            build two tables if you need both). Attention factor: attention_factor if given, else
            sqrt(1 + ln(factor) / ln(L0)) for factor > 1 (1 otherwise); factor defaults to
            max_pos / L0 here and to max_position_embeddings / L0 in `rope_tables_from_hf_config`.

Attention scaling (YaRN mscale, LongRoPE attention factor) is folded into the tables: cos and sin are
both multiplied by it, exactly as Hugging Face transformers and vLLM do, so the rotated q and k each
carry the factor and attention logits carry its square. Callers must not apply it again.

Table forms (what `rope_and_cache` reads, see `jax_rope_cache.reference`):
  "half": [max_pos, R/2], column i holds the frequency of rotary pair i (NeoX or GPT-J alike).
  "full": [max_pos, R], column c holds the frequency of channel c's pair: NeoX [f0..f_{R/2-1},
          f0..f_{R/2-1}] (Hugging Face's cat(freqs, freqs)), GPT-J [f0, f0, f1, f1, ...].
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np

__all__ = ["ROPE_TYPES", "FORMS", "rope_frequencies", "rope_tables"]

ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")
FORMS = ("half", "full")
DEFAULT_THETA = 10000.0  # Hugging Face's default when a config has no rope_theta

_KNOWN_KEYS = {
    "default": set(),
    "linear": {"factor"},
    "dynamic": {"factor", "original_max_position_embeddings"},
    "llama3": {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"},
    "yarn": {"factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale",
             "mscale_all_dim", "attention_factor", "truncate"},
    "longrope": {"short_factor", "long_factor", "original_max_position_embeddings", "factor",
                 "attention_factor"},
}
# Keys a scaling dict may carry besides the law's own (Hugging Face puts them there too).
COMMON_KEYS = {"rope_type", "type", "rope_theta", "partial_rotary_factor"}


def _number(scaling: Mapping, key: str, law: str, *, positive=True, integer=False, default=None):
    v = scaling.get(key, None)
    if v is None:
        if default is not None:
            return default
        raise ValueError(f"scaling[{key!r}]: rope_type {law!r} needs {key}, got nothing")
    if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)):
        raise ValueError(f"scaling[{key!r}]: expected a number for rope_type {law!r}, got {v!r}")
    v = float(v)
    if not math.isfinite(v) or (positive and v <= 0):
        raise ValueError(f"scaling[{key!r}]: expected a finite {'positive ' if positive else ''}number for "
                         f"rope_type {law!r}, got {v!r}")
    if integer:
        if v != int(v):
            raise ValueError(f"scaling[{key!r}]: expected a whole number for rope_type {law!r}, got {v!r}")
        return int(v)
    return v


def _rope_type(scaling) -> str:
    if scaling is None:
        return "default"
    if not isinstance(scaling, Mapping):
        raise ValueError(f"scaling: expected None or a dict with a 'rope_type', got {type(scaling).__name__}")
    law = scaling.get("rope_type", scaling.get("type", "default"))
    if law is None:
        law = "default"
    if law not in ROPE_TYPES:
        raise ValueError(f"scaling['rope_type']: expected one of {ROPE_TYPES}, got {law!r}")
    return law


def _yarn_mscale(scale: float, k: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * k * math.log(scale) + 1.0


def rope_frequencies(rotary_dim: int, *, base: float, scaling=None, max_pos: int | None = None):
    """Inverse frequencies [R/2] (float64) and the attention scaling factor of one RoPE setting.

    max_pos is the table length; the dynamic law and the longrope law depend on it (see the module
    docstring) and need it, the others ignore it.
    """
    if isinstance(rotary_dim, bool) or not isinstance(rotary_dim, (int, np.integer)) or rotary_dim < 2 \
            or rotary_dim % 2:
        raise ValueError(f"rotary_dim: expected an even integer >= 2, got {rotary_dim!r}")
    rotary_dim = int(rotary_dim)
    if isinstance(base, bool) or not isinstance(base, (int, float, np.integer, np.floating)) \
            or not math.isfinite(float(base)) or float(base) <= 1.0:
        raise ValueError(f"base: expected a finite number > 1 (rope_theta), got {base!r}")
    base = float(base)
    law = _rope_type(scaling)
    scaling = {} if scaling is None else dict(scaling)
    if scaling.get("rope_theta") is not None and scaling["rope_theta"] != base:
        raise ValueError(f"scaling['rope_theta']: differs from base ({base}), got {scaling['rope_theta']!r}")
    unknown = set(scaling) - _KNOWN_KEYS[law] - COMMON_KEYS
    if unknown:
        raise ValueError(f"scaling[{sorted(unknown)[0]!r}]: not a parameter of rope_type {law!r} "
                         f"(expected some of {sorted(_KNOWN_KEYS[law])})")
    half = rotary_dim // 2
    exponent = np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim  # 2i / R
    inv_freq = base ** -exponent
    attention = 1.0

    if law == "linear":
        inv_freq = inv_freq / _number(scaling, "factor", law)
    elif law == "dynamic":
        factor = _number(scaling, "factor", law)
        l0 = _number(scaling, "original_max_position_embeddings", law, integer=True)
        if max_pos is None:
            raise ValueError("max_pos: rope_type 'dynamic' builds its table for max_pos positions, got None")
        if rotary_dim <= 2:
            raise ValueError(f"rotary_dim: rope_type 'dynamic' needs rotary_dim > 2, got {rotary_dim}")
        seq_len = max(int(max_pos), l0)
        new_base = base * (factor * seq_len / l0 - (factor - 1.0)) ** (rotary_dim / (rotary_dim - 2))
        inv_freq = new_base ** -exponent
    elif law == "llama3":
        factor = _number(scaling, "factor", law)
        low = _number(scaling, "low_freq_factor", law)
        high = _number(scaling, "high_freq_factor", law)
        l0 = _number(scaling, "original_max_position_embeddings", law, integer=True)
        if high < low:  # equal factors (Llama 4 Scout: 1 and 1): no band is smoothed
            raise ValueError(f"scaling['high_freq_factor']: must not be below low_freq_factor ({low}), got {high}")
        wavelen = 2.0 * math.pi / inv_freq
        scaled = np.where(wavelen > l0 / low, inv_freq / factor, inv_freq)
        smooth = (l0 / wavelen - low) / (high - low) if high > low else np.zeros_like(wavelen)
        smoothed = (1.0 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < l0 / high) & ~(wavelen > l0 / low) & (high > low)
        inv_freq = np.where(medium, smoothed, scaled)
    elif law == "yarn":
        factor = _number(scaling, "factor", law)
        l0 = _number(scaling, "original_max_position_embeddings", law, integer=True)
        beta_fast = _number(scaling, "beta_fast", law, default=32.0)
        beta_slow = _number(scaling, "beta_slow", law, default=1.0)
        truncate = scaling.get("truncate", True)
        if truncate is None:
            truncate = True
        if not isinstance(truncate, (bool, np.bool_)):
            raise ValueError(f"scaling['truncate']: expected a bool for rope_type 'yarn', got {truncate!r}")
        att = scaling.get("attention_factor")
        mscale = _number(scaling, "mscale", law, positive=False, default=0.0)
        mscale_all = _number(scaling, "mscale_all_dim", law, positive=False, default=0.0)
        if att is not None:
            attention = _number(scaling, "attention_factor", law)
        elif mscale and mscale_all:
            attention = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all)
        else:
            attention = _yarn_mscale(factor)

        def correction_dim(rotations: float) -> float:  # the dimension that turns `rotations` times in l0
            return rotary_dim * math.log(l0 / (rotations * 2.0 * math.pi)) / (2.0 * math.log(base))

        lo, hi = correction_dim(beta_fast), correction_dim(beta_slow)
        if truncate:
            lo, hi = math.floor(lo), math.ceil(hi)
        lo, hi = max(lo, 0), min(hi, rotary_dim - 1)
        if lo == hi:
            hi += 0.001  # as the reference implementations: avoids dividing by zero
        ramp = np.clip((np.arange(half, dtype=np.float64) - lo) / (hi - lo), 0.0, 1.0)
        # ramp 0: extrapolate (keep inv_freq), ramp 1: interpolate (inv_freq / factor)
        inv_freq = inv_freq / factor * ramp + inv_freq * (1.0 - ramp)
    elif law == "longrope":
        l0 = _number(scaling, "original_max_position_embeddings", law, integer=True)
        if max_pos is None:
            raise ValueError("max_pos: rope_type 'longrope' picks short/long factors by max_pos, got None")
        use_long = int(max_pos) > l0
        key = "long_factor" if use_long else "short_factor"
        for k in ("short_factor", "long_factor"):
            ext = scaling.get(k)
            if ext is None:
                raise ValueError(f"scaling[{k!r}]: rope_type 'longrope' needs {k} ({half} numbers), got nothing")
            try:
                arr = np.asarray(ext, dtype=np.float64)
            except (TypeError, ValueError):
                raise ValueError(f"scaling[{k!r}]: expected {half} numbers, got {ext!r}") from None
            if arr.shape != (half,) or not np.all(np.isfinite(arr)) or np.any(arr <= 0):
                raise ValueError(f"scaling[{k!r}]: expected {half} finite positive numbers (rotary_dim/2), "
                                 f"got shape {arr.shape}")
            if k == key:
                inv_freq = inv_freq / arr
        factor = scaling.get("factor")
        factor = int(max_pos) / l0 if factor is None else _number(scaling, "factor", law)
        if scaling.get("attention_factor") is not None:
            attention = _number(scaling, "attention_factor", law)
        elif factor > 1.0:
            attention = math.sqrt(1.0 + math.log(factor) / math.log(l0))
    return inv_freq, float(attention)


def _check_max_pos(max_pos) -> int:
    if isinstance(max_pos, bool) or not isinstance(max_pos, (int, np.integer)) or max_pos < 1:
        raise ValueError(f"max_pos: expected an integer >= 1, got {max_pos!r}")
    return int(max_pos)


def _table_dtype(dtype) -> np.dtype:
    try:
        dt = np.dtype(dtype)
    except TypeError:
        raise ValueError(f"dtype: expected a floating dtype (float32, bfloat16, float16), got {dtype!r}") from None
    if dt.kind not in "fV" or dt.itemsize not in (2, 4, 8):
        raise ValueError(f"dtype: expected a floating dtype (float32, bfloat16, float16), got {dt}")
    return dt


def rope_tables(max_pos, rotary_dim, *, base, scaling=None, dtype=np.float32, form="half", is_neox=True):
    """(cos, sin) tables for `rope_and_cache`, rows 0 .. max_pos-1.

    Args:
      max_pos: number of positions (table rows).
      rotary_dim: R, even; the tables rotate channels [0, R).
      base: rope_theta.
      scaling: None, or a Hugging Face-style scaling dict with `rope_type` in ROPE_TYPES and that
        law's parameters (see the module docstring).
      dtype: table dtype (float32, bfloat16 or float16 for `rope_and_cache`); values are computed in
        float64 and rounded once.
      form: "half" ([max_pos, R/2]) or "full" ([max_pos, R], laid out for `is_neox`).
      is_neox: only for form="full": NeoX repeats the frequencies as [f, f], GPT-J interleaves them.

    Returns:
      (cos, sin), each [max_pos, R/2] or [max_pos, R] in `dtype`, with the law's attention scaling
      (YaRN mscale, LongRoPE attention factor) multiplied into both.
    """
    return build(max_pos, rotary_dim, base, scaling, dtype, form, is_neox)[:2]


def build(max_pos, rotary_dim, base, scaling, dtype, form, is_neox):
    """(cos, sin, attention scaling) of `rope_tables`."""
    max_pos = _check_max_pos(max_pos)
    dt = _table_dtype(dtype)
    if form not in FORMS:
        raise ValueError(f"form: expected one of {FORMS}, got {form!r}")
    inv_freq, attention = rope_frequencies(rotary_dim, base=base, scaling=scaling, max_pos=max_pos)
    angles = np.arange(max_pos, dtype=np.float64)[:, None] * inv_freq[None, :]
    cos = np.cos(angles)
    sin = np.sin(angles, out=angles)
    if attention != 1.0:
        cos *= attention
        sin *= attention
    cos, sin = cos.astype(dt), sin.astype(dt)
    if form == "full":  # each channel gets its pair's column
        half = np.arange(rotary_dim // 2)
        cols = np.concatenate([half, half]) if is_neox else np.repeat(half, 2)
        cos, sin = cos[:, cols], sin[:, cols]
    return cos, sin, attention
