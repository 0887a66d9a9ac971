"""The public API: rope_and_cache, its donating jit entry point, and cache helpers."""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jax_rope_cache import versions

versions.check_jax()

from jax_rope_cache import contract, primitive, reference  # noqa: E402
from jax_rope_cache.backends import cpu, kernel_node, launcher, xla  # noqa: E402

IMPLS = (None, "kernel", "xla")
ArrayLike = jax.typing.ArrayLike
Cache = jax.Array | jax.Ref


def _scale_operand(scale, per_head: bool):
    """The f32 scale operand: [] (1 when absent), or [KH] for a per-head scale."""
    if scale is None:
        return jnp.ones((), jnp.float32)
    s = jnp.asarray(scale, jnp.float32)
    return s.reshape((-1,)) if per_head else s.reshape(())


_NO_WEIGHT = np.zeros(1, np.float32)


def _weight_operand(weight):
    """A norm weight operand: the weight [D], or a float32[1] placeholder the kernels never read."""
    return jnp.asarray(_NO_WEIGHT) if weight is None else jnp.asarray(weight)  # a constant, not a broadcast


# ---- validation shared by every entry point (rope_and_cache, rope_and_cache_donated) ----------
def _is_host(a) -> bool:
    """A numpy array or scalar: its values are visible here, before JAX converts it."""
    return isinstance(a, (np.ndarray, np.generic))


def _is_concrete(a) -> bool:
    """A jax.Array with a buffer (not a tracer)."""
    return isinstance(a, jax.Array) and not isinstance(a, jax.core.Tracer)


def _check_refs(key_cache, value_cache, k_scale_cache=None, v_scale_cache=None) -> bool:
    """True when the caches are jax.Refs (both or neither, never the same one; scale caches given
    alongside: the same kind as the caches). A merged layout's absent value cache (None) goes with either."""
    refs = [isinstance(c, jax.Ref) for c in (key_cache, value_cache if value_cache is not None else key_cache)]
    if any(refs) and not all(refs):
        raise TypeError(f"value_cache: expected {'a jax.Ref' if refs[0] else 'an array'} like key_cache, "
                        f"got {type(value_cache).__name__}")
    for name, c in (("k_scale_cache", k_scale_cache), ("v_scale_cache", v_scale_cache)):
        if c is not None and isinstance(c, jax.Ref) != refs[0]:
            raise TypeError(f"{name}: expected {'a jax.Ref' if refs[0] else 'an array'} like key_cache, "
                            f"got {type(c).__name__}")
    contract.check_distinct_caches(key_cache, value_cache)
    return refs[0]


def _first_buffer(a):
    try:
        return a.addressable_shards[0].data.unsafe_buffer_pointer()
    except Exception:  # noqa: BLE001 - no single buffer to compare (deleted, sharded oddly, ...)
        return None


def _devices(ds) -> str:
    return ", ".join(sorted(f"{d.platform}:{d.id}" for d in ds))


def _check_concrete(named, distinct: bool = True) -> None:
    """Checks of concrete jax.Arrays that XLA would report without naming the argument: deleted
    (donated) arrays, one buffer passed as both caches, committed arrays on different devices."""
    concrete = [(n, a) for n, a in named if _is_concrete(a)]
    for name, a in concrete:
        if a.is_deleted():
            raise ValueError(f"{name}: expected a live array, got one that was deleted (donated to an earlier "
                             "call, e.g. of rope_and_cache_donated, which consumes the caches); use the arrays "
                             "that call returned")
    arrays = dict(concrete)
    kc, vc = arrays.get("key_cache"), arrays.get("value_cache")
    if distinct and kc is not None and vc is not None and kc.nbytes and _first_buffer(kc) is not None \
            and _first_buffer(kc) == _first_buffer(vc):
        raise ValueError("value_cache: expected a different buffer from key_cache, got an array sharing "
                         "key_cache's buffer (the V writes would overwrite the K writes)")
    first = None
    for name, a in concrete:
        if not a.committed:
            continue
        ds = a.sharding.device_set
        if first is None:
            first = (name, ds)
        elif ds != first[1]:
            raise ValueError(f"{name}: expected an array on the same device(s) as {first[0]} "
                             f"({_devices(first[1])}), got one on {_devices(ds)}; move it with jax.device_put")


def _narrow_indices(slot_mapping, positions, spec: contract.OpSpec):
    """Host int64 indices JAX would narrow to int32 (jax_enable_x64 off) are given their meaning
    first (contract.narrow_slots / narrow_positions); returns them and the matching spec."""
    changes = {}
    if _is_host(slot_mapping) and jax.dtypes.canonicalize_dtype(slot_mapping.dtype) != slot_mapping.dtype:
        slot_mapping = contract.narrow_slots(slot_mapping, spec.num_slots)
        changes["slot_dtype"] = slot_mapping.dtype
    if _is_host(positions) and jax.dtypes.canonicalize_dtype(positions.dtype) != positions.dtype:
        positions = contract.narrow_positions(positions, spec.max_pos)
        changes["pos_dtype"] = positions.dtype
    return slot_mapping, positions, dataclasses.replace(spec, **changes) if changes else spec


def _host_layer(layer, spec: contract.OpSpec):
    """A numpy scalar-array layer (concrete, any integer width) as an int32 array with -1 where it
    is outside [0, L); Python ints (already range-checked) and jax values are left as they are."""
    if layer is None or isinstance(layer, numbers.Integral) or not _is_host(layer):
        return layer
    value = int(np.asarray(layer).reshape(()))
    return np.asarray(value if 0 <= value < spec.num_layers else -1, np.int32)


def _layer_operand(layer, spec: contract.OpSpec):
    """The int32 `layer` operand. A wider (or unsigned) traced layer is compared with [0, L) in its
    own width first, so layer 2**32 never wraps into layer 0: outside, it becomes -1 (no write)."""
    if layer is None:
        return jnp.zeros((), jnp.int32)
    if isinstance(layer, numbers.Integral):
        return jnp.asarray(int(layer), jnp.int32)  # check_op checked 0 <= layer < L
    layer = jnp.reshape(jnp.asarray(layer), ())
    dt = np.dtype(layer.dtype)
    if dt == np.int32 or dt.itemsize < 4:  # every value of int8/int16/uint8/uint16 fits int32
        return layer.astype(jnp.int32)
    inside = layer >= 0 if dt.kind == "i" else jnp.ones((), bool)
    if spec.num_layers <= np.iinfo(dt).max:
        inside = inside & (layer < spec.num_layers)
    return jnp.where(inside, layer.astype(jnp.int32), jnp.int32(-1))


def _prepare(q, k, v, key_cache, value_cache, slot_mapping, positions, cos, sin, *, layout, is_neox,
             rotary_dim, k_scale, v_scale, precision, impl, layer, q_norm_weight, k_norm_weight, norm_eps,
             mrope_section=None, mrope_interleaved=False, inputs=None, k_scale_cache=None, v_scale_cache=None,
             table_form="half", **family):
    """Every check of a call, in the same order for every entry point; returns the spec and the
    index arguments as they may be handed to JAX (host int64 indices given their meaning).
    `inputs`: (name, array) of the arrays q, k and v were read from, when not q, k and v themselves
    (the fused tensor of rope_and_cache_qkv)."""
    _check_refs(key_cache, value_cache, k_scale_cache, v_scale_cache)
    spec = contract.check_op(q, k, v, key_cache, value_cache, slot_mapping, positions, cos, sin,
                             layout=layout, is_neox=is_neox, rotary_dim=rotary_dim, k_scale=k_scale,
                             v_scale=v_scale, precision=precision, layer=layer, q_norm_weight=q_norm_weight,
                             k_norm_weight=k_norm_weight, norm_eps=norm_eps, mrope_section=mrope_section,
                             mrope_interleaved=mrope_interleaved, k_scale_cache=k_scale_cache,
                             v_scale_cache=v_scale_cache, table_form=table_form, **family)
    if impl not in IMPLS:
        raise ValueError(f"impl: expected one of {IMPLS}, got {impl!r}")
    named = list(zip(contract.OPERANDS, (q, k, v, key_cache, value_cache, slot_mapping, positions, cos, sin,
                                         k_scale, v_scale, layer, q_norm_weight, k_norm_weight)))
    named += [("k_scale_cache", k_scale_cache), ("v_scale_cache", v_scale_cache)]
    _check_concrete(named if inputs is None else list(inputs) + named[3:])
    slot_mapping, positions, spec = _narrow_indices(slot_mapping, positions, spec)
    return spec, slot_mapping, positions, _host_layer(layer, spec)


def rope_and_cache(q: ArrayLike, k: ArrayLike, v: ArrayLike, key_cache: Cache, value_cache: Cache,
                   slot_mapping: ArrayLike, positions: ArrayLike, cos: ArrayLike, sin: ArrayLike, *,
                   layout: str = "flash", is_neox: bool = True, rotary_dim: int | None = None,
                   k_scale: ArrayLike | None = None, v_scale: ArrayLike | None = None,
                   precision: str = "fp32", impl: str | None = None,
                   layer: int | ArrayLike | None = None, q_norm_weight: ArrayLike | None = None,
                   k_norm_weight: ArrayLike | None = None,
                   norm_eps: float = 1e-6, mrope_section: Sequence[int] | None = None,
                   mrope_interleaved: bool = False, k_scale_cache: Cache | None = None,
                   v_scale_cache: Cache | None = None, table_form: str = "half", rotary_position: str = "head",
                   use_rope: bool | ArrayLike | None = None, norm_type: str = "rms", norm_position: str = "before",
                   attn_temperature: tuple[int, float] | None = None) -> tuple:
    """Rotates q and k with RoPE and writes k and v into a paged KV cache, in one kernel.

    Args:
      q: [T, QH, D] bfloat16, float16 or float32 queries.
      k, v: [T, KH, D] new keys and values, q's dtype; QH % KH == 0.
      key_cache, value_cache: the caches in `layout` (see below), q's dtype or float8_e4m3fn /
        float8_e4m3fnuz / float8_e5m2 (vLLM's fp8_e5m2); two different arrays. Updated in place when the caller's jit donates them
        (or use `rope_and_cache_donated`), or when they are `jax.Ref`s (then nothing needs donating:
        the refs are written and also returned). With `layer`, stacked as [L, ...]. layout="kv_merged"
        keeps K and V in ONE array, passed as key_cache, with value_cache=None (and None returned in
        its place), as `make_kv_cache` returns them.
      slot_mapping: [T] int32/int64. Slot s is block s // BS, offset s % BS; slots outside
        [0, NB*BS) (e.g. -1 for padding) write nothing, whatever their width (numpy int64 slots
        with jax_enable_x64 off are mapped before JAX narrows them; see docs/errors.md). Pass
        unique valid slots: of duplicates one token wins (unspecified which), and with per-token
        scales the stored row and its scale may come from different tokens.
      positions: [T] int32/int64 rows of cos/sin, clamped to [0, max_pos - 1]; with
        mrope_section, [3, T]: the temporal, height and width position of each token.
      cos, sin: RoPE tables in `table_form`, bf16/f16/f32 (`rope_tables` builds them).
      layout: "flash"            K, V: [NB, BS, KH, D]
              "xpacked"          K: [NB, KH, D//X, BS, X], V: [NB, KH, D, BS]
              "xpacked_shuffled" K: [NB, KH, D//X, BS, X], V: [NB, KH, BS//X, D, X]
              "hnd"              K, V: [NB, KH, BS, D] (FlashInfer's HND)
              "head_major"       K, V: [KH, NB, BS, D] (JAX's Pallas paged_attention, GPU and TPU:
                                 k_pages / v_pages)
              "kv_merged"        one array [NB, BS, 2*KH, D], K head h at 2h and V head h at 2h + 1
                                 (JAX's Pallas TPU ragged_paged_attention: kv_pages); value_cache=None
        with X the key cache's last dim: a power of two dividing D (and BS for the shuffled
        value cache), by default 16 // cache itemsize.
      is_neox: True rotates pairs (i, i + R/2); False (GPT-J) pairs (2i, 2i + 1).
      rotary_dim: R, even, <= D (default D); channels >= R pass through.
      k_scale, v_scale: float8 caches only (None otherwise): a float scalar (shape () or (1,)) or
        one scale per kv head (shape [KH]), any float dtype, used as float32; each may be traced.
        Stored = fp8(sat(x * (1/scale))), kv head h with scale[h].
      k_scale_cache, v_scale_cache: per-token fp8 quantization (float8 caches, k_scale = v_scale =
        None): float32 scale caches [NB, KH, BS] ("head_major": [KH, NB, BS], as Pallas' k_scales_pages;
        stacked [L, ...] with `layer`; see make_kv_scale_cache). Each (token, kv head) row of k (after the norm and the rotation) and
        of v gets scale = max(amax(|row|), 1e-8) / FP8_MAX (448 e4m3fn, 240 e4m3fnuz, 57344
        e5m2; NaN and inf left out of the amax), is stored as fp8(sat(row * (1/scale))), and the
        scale goes to [block, h, offset] of the token's slot. Updated in place like the caches
        (donate them too; jax.Refs when the caches are). jax_rope_cache.reference states every step.
        int8 / uint8 (int4) caches take the same float32 scale caches (scale amax / 127, amax / 7).
        NVFP4 / MXFP4: uint8 caches of E2M1 pairs with block-scale caches, whose dtype selects the
        format: float8_e4m3fn (NVFP4, one scale per 16 values; k_scale / v_scale are then the
        required float32 global decode scales) or float8_e8m0fnu (MXFP4, one per 32 values, no
        k_scale / v_scale), in the layout's cache axes with D / 16 (D / 32) scales a row (flash,
        hnd, head_major; make_kv_scale_cache(kv_format=...)). docs/numerics.md states the rules.
      precision: "fp32" (rotate in float32, round once) or "native" (AITER's arithmetic on ROCm:
        tables in the input dtype round every product and the sum; other tables promote to
        float32 with the first product fused). jax_rope_cache.reference states every rule.
      impl: None (native kernel where the platform has one, else XLA), "kernel", or "xla".
      layer: None, or the layer (int or traced integer scalar) of stacked [L, ...] caches to
        write: one stacked cache carried through `lax.scan`/`fori_loop` over layers is updated in
        place, never sliced. A traced layer outside [0, L) writes nothing (compared in its own
        integer width: a 64-bit layer 2**32 is outside, never layer 0).
      q_norm_weight, k_norm_weight: None, or an RMSNorm weight [D] (q's dtype or float32; may be
        traced), each independently: every head of q (k) is normalised over the full head_dim
        before the rotation (Qwen3's q_norm / k_norm): n = r(w * r(x * rsqrt(mean(x^2) + eps)))
        with the sum of squares in a fixed pairwise tree and both roundings r() to q's dtype
        (jax_rope_cache.reference states every step). k_out and the key cache hold the normalised,
        rotated k; v is untouched.
      norm_eps: the norm's epsilon, a static float > 0 (used as float32); checked even when no
        weight is given.
      mrope_section: None, or the multimodal RoPE sections (temporal, height, width): how many of
        the R/2 rotary frequencies each position stream drives (summing to R/2; static), e.g.
        (16, 24, 24) for Qwen2.5-VL, (24, 20, 20) for Qwen3-VL; positions are then [3, T].
      mrope_interleaved: False: contiguous sections (Qwen2-VL / Qwen2.5-VL): frequency i < t is
        temporal, then h height, then w width. True (Qwen3-VL): i % 3 == 1 and i < 3h height,
        i % 3 == 2 and i < 3w width, the others temporal. A token with three equal positions
        (text) gets exactly the result of positions [T].
      table_form: the form of cos and sin, said, never guessed from their width: "half" (default)
        [max_pos, R/2], column i the angle of rotary pair i; "full" [max_pos, R], one column per
        rotary channel (Hugging Face's cat(freqs, freqs) for NeoX, repeated pairs for GPT-J). A
        width that does not match the form raises a ValueError naming cos (a width-R table given
        as "half" may be a table built for another head size).
      rotary_dim=0: no rotation (a NoPE layer: Llama 4, SmolLM3); positions, cos and sin may then
        be None (tables given are not read: any width).
      rotary_position: "head" (default) rotates channels [0, R); "tail" rotates [D - R, D) and passes
        [0, D - R) through (nope-first heads: DeepSeek-V4, AITER's is_nope_first).
      use_rope: None, or a per-call rotation switch (a bool, or a bool / integer scalar that may be
        traced: one compiled program for a lax.scan over RoPE and NoPE layers, e.g.
        use_rope=rope_layers[i]). False: this call is a NoPE call (no rotation, no "after" norm,
        the temperature if given).
      norm_type: the QK-norm's weight rule: "rms" (default, Qwen3/GLM: r(w * r(x * inv))), "gemma"
        (Gemma 3, Qwen3-Next: r(x * inv * (1 + w)), one rounding), "weightless" (Llama 4's qk_norm,
        an RMS norm without weight, on q and k; no weights then).
      norm_position: "before" (default) normalises before the rotation; "after" normalises the
        rotated q and k (Llama 4), on calls that rotate only.
      attn_temperature: None, or (floor_scale, attn_scale) (Llama 4): on calls that do not rotate, q
        is scaled by 1 + attn_scale * log1p(floor((p + 1) / floor_scale)), p the token's position
        (clamped to the tables' rows); needs positions and the tables (docs/numerics.md).

    Returns:
      (q_out [T, QH, D], k_out [T, KH, D], key_cache, value_cache), then (k_scale_cache,
      v_scale_cache) when the scale caches are given; value_cache is None for "kv_merged".

    Not differentiable (every impl): jax.grad through it raises a TypeError.
    """
    family = dict(rotary_position=rotary_position, use_rope=use_rope, norm_type=norm_type,
                  norm_position=norm_position, attn_temperature=attn_temperature)
    if _check_refs(key_cache, value_cache, k_scale_cache, v_scale_cache):
        refs = (key_cache, value_cache) + tuple(c for c in (k_scale_cache, v_scale_cache) if c is not None)
        out = rope_and_cache(
            q, k, v, key_cache[...], _ref_value(value_cache), slot_mapping, positions, cos, sin, layout=layout,
            is_neox=is_neox, rotary_dim=rotary_dim, k_scale=k_scale, v_scale=v_scale, precision=precision,
            impl=impl, layer=layer, q_norm_weight=q_norm_weight, k_norm_weight=k_norm_weight, norm_eps=norm_eps,
            mrope_section=mrope_section, mrope_interleaved=mrope_interleaved, table_form=table_form,
            **_read_refs(k_scale_cache=k_scale_cache, v_scale_cache=v_scale_cache), **family)
        return _write_refs(out, refs)
    spec, slot_mapping, positions, layer = _prepare(
        q, k, v, key_cache, value_cache, slot_mapping, positions, cos, sin, layout=layout, is_neox=is_neox,
        rotary_dim=rotary_dim, k_scale=k_scale, v_scale=v_scale, precision=precision, impl=impl, layer=layer,
        q_norm_weight=q_norm_weight, k_norm_weight=k_norm_weight, norm_eps=norm_eps, mrope_section=mrope_section,
        mrope_interleaved=mrope_interleaved, k_scale_cache=k_scale_cache, v_scale_cache=v_scale_cache,
        table_form=table_form, **family)
    return _run(q, k, v, key_cache, value_cache, slot_mapping, positions, cos, sin, k_scale=k_scale,
                v_scale=v_scale, layer=layer, q_norm_weight=q_norm_weight, k_norm_weight=k_norm_weight, spec=spec,
                impl=impl, k_scale_cache=k_scale_cache, v_scale_cache=v_scale_cache, use_rope=use_rope)


def _read_refs(**refs) -> dict:
    """The current values of the jax.Refs given (None stays None)."""
    return {name: None if r is None else r[...] for name, r in refs.items()}


def _write_refs(out, refs) -> tuple:
    """Writes the op's cache results into the refs they came from (None: a merged layout's absent
    value cache); returns (q_out, k_out, *refs)."""
    for ref, value in zip(refs, out[2:]):
        if ref is not None:
            ref[...] = value
    return tuple(out[:2]) + tuple(refs)


def _ref_value(ref):
    return None if ref is None else ref[...]


def _run(q, k, v, key_cache, value_cache, slot_mapping, positions, cos, sin, *, k_scale, v_scale, layer,
         q_norm_weight, k_norm_weight, spec: contract.OpSpec, impl, k_scale_cache=None, v_scale_cache=None,
         use_rope=None):
    """The op on checked arguments: the operands (contract.OPERANDS), then the XLA path or the primitive.
    With per-token scales the scale caches take the k_scale / v_scale operand slots;
    contract.extra_operands(spec) follow contract.OPERANDS. Absent positions / tables (rotary_dim=0) are placeholders never read.
    A merged layout (value_cache None) passes a placeholder in the value_cache slot and returns None in
    its place."""
    if value_cache is None:
        out = _run(q, k, v, key_cache, jnp.zeros(contract.value_operand_shape(spec), spec.cache_dtype), slot_mapping,
                   positions, cos, sin, k_scale=k_scale, v_scale=v_scale, layer=layer, q_norm_weight=q_norm_weight,
                   k_norm_weight=k_norm_weight, spec=spec, impl=impl, k_scale_cache=k_scale_cache,
                   v_scale_cache=v_scale_cache, use_rope=use_rope)
        return out[:3] + (None,) + out[4:]
    if positions is None:
        positions = np.zeros((spec.num_tokens,), np.int32)
    if cos is None:
        cos = sin = np.zeros((1, 0), np.float32)
    args = tuple(jnp.asarray(a) for a in (q, k, v, key_cache, value_cache, slot_mapping, positions, cos, sin))
    if spec.token_scales:
        args += (jnp.asarray(k_scale_cache), jnp.asarray(v_scale_cache))
    else:
        args += (_scale_operand(k_scale, spec.k_scale_heads), _scale_operand(v_scale, spec.v_scale_heads))
    args += (_layer_operand(layer, spec), _weight_operand(q_norm_weight), _weight_operand(k_norm_weight))
    if spec.rope_switch:
        args += (jnp.asarray(use_rope).astype(jnp.int32).reshape(()),)
    if spec.temperature is not None:
        args += (jnp.asarray(reference.temperature_factors(spec.max_pos, *spec.temperature)),)
    if spec.cache_format == "nvfp4":  # the global decode scales: float32 [] operands
        args += tuple(jnp.asarray(g, jnp.float32).reshape(()) for g in (k_scale, v_scale))
    if spec.num_tokens == 0:
        caches = args[3:5] + (args[9:11] if spec.token_scales else ())
        if spec.qkv:  # empty q_out [0, QH, D] and k_out [0, KH, D]
            return (args[0][:, :spec.q_heads], args[0][:, :spec.kv_heads]) + caches
        return args[:2] + caches
    if impl == "xla":
        return tuple(xla.rope_and_cache(*primitive.not_differentiable(*args), spec=spec))
    return tuple(primitive.bind(*args, spec=spec, impl=impl))


def rope_and_cache_qkv(qkv: ArrayLike, key_cache: Cache, value_cache: Cache, slot_mapping: ArrayLike,
                       positions: ArrayLike, cos: ArrayLike, sin: ArrayLike, *, num_q_heads: int, num_kv_heads: int,
                       layout: str = "flash", is_neox: bool = True, rotary_dim: int | None = None,
                       k_scale: ArrayLike | None = None, v_scale: ArrayLike | None = None,
                       precision: str = "fp32", impl: str | None = None,
                       layer: int | ArrayLike | None = None, q_norm_weight: ArrayLike | None = None,
                       k_norm_weight: ArrayLike | None = None, norm_eps: float = 1e-6,
                       mrope_section: Sequence[int] | None = None,
                       mrope_interleaved: bool = False, k_scale_cache: Cache | None = None,
                       v_scale_cache: Cache | None = None, table_form: str = "half", q_gate: bool = False,
                       rotary_position: str = "head", use_rope: bool | ArrayLike | None = None,
                       norm_type: str = "rms", norm_position: str = "before",
                       attn_temperature: tuple[int, float] | None = None) -> tuple:
    """rope_and_cache of a fused QKV projection, read in place: no slice of `qkv` is copied.

    Args:
      qkv: [T, (QH + 2 KH) * D] or [T, QH + 2 KH, D], bfloat16 / float16 / float32: each token's
        QH query heads, then its KH key heads, then its KH value heads (the output of one matmul
        with the q, k and v projection weights concatenated in that order).
      num_q_heads, num_kv_heads: QH and KH (static ints); D is the rest of qkv's last dims.
      q_gate: True for gated attention (Qwen3-Next, Qwen3.5): the rows are [T, (2 QH + 2 KH) * D],
        each q head followed by its output gate (q_proj's [q_h, gate_h] per head), then k, then v.
        The op reads the q heads and leaves the gates where they are: the model reads them from
        qkv (e.g. qkv.reshape(T, -1, D)[:, 1:2 * QH:2]), no copy made for the op.
      Everything else: as rope_and_cache, whose result this is for q, k, v = the three slices.

    Returns:
      (q_out [T, QH, D], k_out [T, KH, D], key_cache, value_cache), then the scale caches when
      given, as rope_and_cache.

    Every implementation reads q, k and v at their head offsets in the fused rows: the kernels take
    the fused buffer itself (the same buffer in the q, k and v operand slots, specialised on the row
    stride), so XLA passes the matmul's output to the custom call without a copy. Under shard_map
    the fused tensor can be split on its head axis only when it is laid out shard-major (each
    shard's slice holds its own q, k and v heads, as a column-parallel QKV projection gives); see
    the README.
    """
    family = dict(rotary_position=rotary_position, use_rope=use_rope, norm_type=norm_type,
                  norm_position=norm_position, attn_temperature=attn_temperature)
    if _check_refs(key_cache, value_cache, k_scale_cache, v_scale_cache):
        refs = (key_cache, value_cache) + tuple(c for c in (k_scale_cache, v_scale_cache) if c is not None)
        out = rope_and_cache_qkv(
            qkv, key_cache[...], _ref_value(value_cache), slot_mapping, positions, cos, sin, num_q_heads=num_q_heads,
            num_kv_heads=num_kv_heads, layout=layout, is_neox=is_neox, rotary_dim=rotary_dim, k_scale=k_scale,
            v_scale=v_scale, precision=precision, impl=impl, layer=layer, q_norm_weight=q_norm_weight,
            k_norm_weight=k_norm_weight, norm_eps=norm_eps, mrope_section=mrope_section,
            mrope_interleaved=mrope_interleaved, table_form=table_form, q_gate=q_gate,
            **_read_refs(k_scale_cache=k_scale_cache, v_scale_cache=v_scale_cache), **family)
        return _write_refs(out, refs)
    t, qh, kh, d = contract.check_qkv(qkv, num_q_heads, num_kv_heads, q_gate)
    q, k, v = (jax.ShapeDtypeStruct((t, h, d), qkv.dtype) for h in (qh, kh, kh))
    spec, slot_mapping, positions, layer = _prepare(
        q, k, v, key_cache, value_cache, slot_mapping, positions, cos, sin, layout=layout, is_neox=is_neox,
        rotary_dim=rotary_dim, k_scale=k_scale, v_scale=v_scale, precision=precision, impl=impl, layer=layer,
        q_norm_weight=q_norm_weight, k_norm_weight=k_norm_weight, norm_eps=norm_eps, mrope_section=mrope_section,
        mrope_interleaved=mrope_interleaved, inputs=(("qkv", qkv),), k_scale_cache=k_scale_cache,
        v_scale_cache=v_scale_cache, table_form=table_form, **family)
    spec = dataclasses.replace(spec, qkv=True, q_gate=bool(q_gate))
    # a bitcast: rows stay where the matmul wrote them
    fused = jnp.reshape(jnp.asarray(qkv), (t, spec.qkv_heads, d))
    return _run(fused, fused, fused, key_cache, value_cache, slot_mapping, positions, cos, sin, k_scale=k_scale,
                v_scale=v_scale, layer=layer, q_norm_weight=q_norm_weight, k_norm_weight=k_norm_weight,
                spec=spec, impl=impl, k_scale_cache=k_scale_cache, v_scale_cache=v_scale_cache, use_rope=use_rope)


_STATIC = ("layout", "is_neox", "rotary_dim", "precision", "impl", "norm_eps", "mrope_section", "mrope_interleaved",
           "table_form", "rotary_position", "norm_type", "norm_position", "attn_temperature")

_donating_jit = jax.jit(rope_and_cache, static_argnames=_STATIC,
                        donate_argnames=("key_cache", "value_cache", "k_scale_cache", "v_scale_cache"))


def _rope_and_cache_refs(q, k, v, key_cache, value_cache, *args, **options):
    """With jax.Ref caches: writes the refs in place and returns (q_out, k_out); a jit may not return refs."""
    return tuple(rope_and_cache(q, k, v, key_cache, value_cache, *args, **options)[:2])


_refs_jit = jax.jit(_rope_and_cache_refs, static_argnames=_STATIC)  # jax.Refs: nothing to donate
# XLA's words when a donated buffer is gone by the time the executable runs (another thread's call
# donated it first): reported as the caches' error, naming them.
_DONATED_RUNTIME_ERRORS = ("Invalid buffer passed to Execute", "Buffer has been deleted or donated",
                           "Array has been deleted")


def _donated_call(q, k, v, key_cache, value_cache, slot_mapping, positions, cos, sin, *, layout="flash",
                  is_neox=True, rotary_dim=None, k_scale=None, v_scale=None, precision="fp32", impl=None,
                  layer=None, q_norm_weight=None, k_norm_weight=None, norm_eps=1e-6, mrope_section=None,
                  mrope_interleaved=False, k_scale_cache=None, v_scale_cache=None, table_form="half", **family):
    """(jitted function, args, kwargs) of a rope_and_cache_donated call, validated as rope_and_cache does."""
    refs = _check_refs(key_cache, value_cache, k_scale_cache, v_scale_cache)
    _, slot_mapping, positions, layer = _prepare(
        q, k, v, key_cache, value_cache, slot_mapping, positions, cos, sin, layout=layout, is_neox=is_neox,
        rotary_dim=rotary_dim, k_scale=k_scale, v_scale=v_scale, precision=precision, impl=impl, layer=layer,
        q_norm_weight=q_norm_weight, k_norm_weight=k_norm_weight, norm_eps=norm_eps, mrope_section=mrope_section,
        mrope_interleaved=mrope_interleaved, k_scale_cache=k_scale_cache, v_scale_cache=v_scale_cache,
        table_form=table_form, **family)
    if family.get("attn_temperature") is not None:  # static: hashable
        family["attn_temperature"] = contract.check_temperature(family["attn_temperature"])
    # norm_eps is static: its float32 value as a Python float (hashable, the same meaning)
    kwargs = dict(layout=layout, is_neox=is_neox, rotary_dim=rotary_dim, k_scale=k_scale, v_scale=v_scale,
                  precision=precision, impl=impl, layer=layer, q_norm_weight=q_norm_weight,
                  k_norm_weight=k_norm_weight, norm_eps=contract.check_norm_eps(norm_eps),
                  mrope_section=None if mrope_section is None else tuple(int(x) for x in mrope_section),
                  mrope_interleaved=bool(mrope_interleaved), k_scale_cache=k_scale_cache, v_scale_cache=v_scale_cache,
                  table_form=table_form, **family)
    return (_refs_jit if refs else _donating_jit), (q, k, v, key_cache, value_cache, slot_mapping, positions,
                                                     cos, sin), kwargs


def rope_and_cache_donated(q, k, v, key_cache, value_cache, slot_mapping, positions, cos, sin, **options):
    """`rope_and_cache` under `jax.jit` with both caches donated (same arguments, same errors).

    The caches (and scale caches) passed in are consumed (updated in place, then deleted on the
    caller's side): use the returned ones. `jax.Ref` caches are written in place and not donated. Inside your own jit, call
    `rope_and_cache` and donate the caches at the outermost jit instead. `.lower(...)` lowers the
    same jitted call.
    """
    fn, args, kwargs = _donated_call(q, k, v, key_cache, value_cache, slot_mapping, positions, cos, sin, **options)
    try:
        if fn is _refs_jit:
            scales = tuple(c for c in (kwargs["k_scale_cache"], kwargs["v_scale_cache"]) if c is not None)
            return tuple(fn(*args, **kwargs)) + (key_cache, value_cache) + scales
        return fn(*args, **kwargs)
    except (jax.errors.JaxRuntimeError, ValueError, RuntimeError) as e:  # XLA's INVALID_ARGUMENT is a ValueError
        if any(m in str(e) for m in _DONATED_RUNTIME_ERRORS):
            raise ValueError("key_cache/value_cache: expected live caches, got caches that another call donated "
                             "(deleted) while this one started, e.g. two threads passing the same caches to "
                             "rope_and_cache_donated; each call consumes its caches: pass the ones the previous "
                             "call returned") from e
        raise


def _lower_donated(*args, **options):
    fn, args, kwargs = _donated_call(*args, **options)
    return fn.lower(*args, **kwargs)


rope_and_cache_donated.lower = _lower_donated


# int8 and uint8 (packed int4: head_dim / 2 bytes): per-token quantized (rope_and_cache with the
# scale caches of make_kv_scale_cache)
CACHE_DTYPES = contract.INPUT_DTYPES + contract.FP8_DTYPES + contract.LOW_BIT


def make_kv_cache(num_blocks: int, block_size: int, kv_heads: int, head_dim: int, dtype=jnp.bfloat16, *,
                  layout: str = "flash", num_layers: int | None = None, fill: str = "zeros", seed: int = 0,
                  device=None, x: int | None = None) -> tuple[jax.Array, jax.Array | None]:
    """Allocates (key_cache, value_cache) for `layout`, optionally with a leading [num_layers] axis.
    "kv_merged" holds K and V in one array: (kv_pages [NB, BS, 2*KH, D], None), the pair
    rope_and_cache and read_kv take.

    dtype int8 or uint8 (int4, two values a byte: the caches' last dim is head_dim / 2 bytes) makes
    the caches of per-token quantization (docs/numerics.md), with make_kv_scale_cache's scale caches;
    uint8 is also the cache of NVFP4 / MXFP4 (two E2M1 values a byte), with
    make_kv_scale_cache(kv_format=...)'s block-scale caches.
    fill: "zeros", or "random" (standard normal values; useful for tests that must see which
    slots a kernel touched).
    x: X of the x-packed layouts (elements per group of the key cache's last dim, and of the
    shuffled value cache's): a power of two dividing head_dim (and block_size for
    "xpacked_shuffled"); None: 16 // itemsize (16 bytes). Other layouts take None only.
    """
    for name, value in (("num_blocks", num_blocks), ("block_size", block_size), ("kv_heads", kv_heads),
                        ("head_dim", head_dim), ("num_layers", num_layers)):
        if value is None and name == "num_layers":
            continue
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
            raise ValueError(f"{name}: expected an integer >= 1, got {contract.describe(value)}")
    if head_dim % 2:
        raise ValueError(f"head_dim: expected an even integer (RoPE rotates pairs), got {head_dim}")
    try:
        dtype = np.dtype(dtype)
    except TypeError:
        names = contract.dtype_names(CACHE_DTYPES)
        raise TypeError(f"dtype: expected one of ({names}), got {contract.describe(dtype)}") from None
    if dtype not in CACHE_DTYPES:
        raise TypeError(f"dtype: expected one of ({contract.dtype_names(CACHE_DTYPES)}), got {dtype.name}")
    lay = contract.cache_layout(layout)
    if x is not None:
        if not lay.packed:
            raise ValueError(f"x: layout {layout!r} has no X (only the x-packed layouts do); expected None, "
                             f"got {contract.describe(x)}")
        x = contract.check_pack_x(x, head_dim, block_size, layout, arg="x")
    dc = contract.cache_head_dim(head_dim, dtype)  # int4: D/2 bytes
    contract.check_layout_divisibility(layout, dc, block_size, dtype, head_arg="head_dim",
                                       block_arg="block_size", x=x)
    shapes = contract.storage_shapes(layout, num_blocks, block_size, kv_heads, dc, dtype, x)
    if num_layers is not None:
        shapes = tuple(None if s is None else (num_layers,) + s for s in shapes)
    if fill == "zeros":
        make = lambda shape, _: jnp.zeros(shape, dtype, device=device)  # noqa: E731
    elif fill == "random":
        keys = jax.random.split(jax.random.key(seed), 2)
        # drawn flat then reshaped: XLA's CPU compile of a rank-5 draw took ~14 s, the flat one < 0.5 s
        if dtype in contract.LOW_BIT:  # every stored value, not the few a normal draw rounds to
            lo, hi = (-127, 128) if dtype == contract.INT8 else (0, 256)
            make = lambda shape, i: jax.device_put(  # noqa: E731
                jax.random.randint(keys[i], (math.prod(shape),), lo, hi, jnp.int32).reshape(shape).astype(dtype),
                device)
        else:
            make = lambda shape, i: jax.device_put(  # noqa: E731
                jax.random.normal(keys[i], (math.prod(shape),), jnp.float32).reshape(shape).astype(dtype), device)
    else:
        raise ValueError(f"fill: expected 'zeros' or 'random', got {fill!r}")
    return make(shapes[0], 0), None if shapes[1] is None else make(shapes[1], 1)


def make_kv_scale_cache(num_blocks: int, block_size: int, kv_heads: int, *, num_layers: int | None = None,
                        device=None, layout: str = "flash", kv_format: str | None = None,
                        head_dim: int | None = None) -> tuple[jax.Array, jax.Array]:
    """Allocates (k_scale_cache, v_scale_cache) for per-token fp8, int8 or int4 scales of caches in `layout`:
    float32 [NB, KH, BS] ("head_major": [KH, NB, BS], Pallas' k_scales_pages), with num_layers
    [L, ...], filled with 1.0 (an unwritten slot dequantizes to its stored value). One scale per
    slot and kv head; the BS scales of one block and head are contiguous (AITER's layout), as an
    attention kernel reads them next to that block's rows.

    kv_format "nvfp4" / "mxfp4" (with head_dim): the block-scale caches of a uint8 cache of that
    format instead, the layout's key axes with D / group scales a row (flash [NB, BS, KH, D/16],
    hnd [NB, KH, BS, D/16], head_major [KH, NB, BS, D/16]; MXFP4 D/32), float8_e4m3fn (NVFP4) or
    float8_e8m0fnu (MXFP4) filled with 1.0; their dtype is what selects the format
    (docs/numerics.md#nvfp4-and-mxfp4-caches)."""
    for name, value in (("num_blocks", num_blocks), ("block_size", block_size), ("kv_heads", kv_heads),
                        ("num_layers", num_layers)):
        if value is None and name == "num_layers":
            continue
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
            raise ValueError(f"{name}: expected an integer >= 1, got {contract.describe(value)}")
    lead = (num_layers,) if num_layers is not None else ()
    if kv_format is None:
        if head_dim is not None:
            raise ValueError(f"head_dim: per-token scale caches do not depend on it (only kv_format 'nvfp4' / "
                             f"'mxfp4' does); expected None, got {contract.describe(head_dim)}")
        shape = lead + contract.scale_shape(layout, num_blocks, block_size, kv_heads)
        return tuple(jnp.ones(shape, jnp.float32, device=device) for _ in range(2))
    if kv_format not in contract.BLOCK_FORMATS:
        raise ValueError(f"kv_format: expected None (per-token scales) or one of {contract.BLOCK_FORMATS}, "
                         f"got {kv_format!r}")
    group = contract.BLOCK_GROUP[kv_format]
    if isinstance(head_dim, bool) or not isinstance(head_dim, numbers.Integral) or head_dim < 1 or head_dim % group:
        raise ValueError(f"head_dim: kv_format {kv_format!r} needs the head dim D, a positive multiple of {group} "
                         f"(one scale per {group} values of a row), got {contract.describe(head_dim)}")
    contract.check_block_cache_dtype(kv_format, contract.INT4, contract.cache_layout(layout).name, head_dim)
    shape = lead + contract.block_scale_shape(layout, num_blocks, block_size, kv_heads, head_dim, kv_format)
    return tuple(jnp.ones(shape, contract.BLOCK_SCALE_DTYPE[kv_format], device=device) for _ in range(2))


_read_kv_jit = jax.jit(xla.read_kv, static_argnames=("layout", "fmt"))


def read_kv(key_cache: jax.Array, value_cache: jax.Array | None, slot_mapping: ArrayLike, *,
            layout: str = "flash", k_scale: ArrayLike | None = None, v_scale: ArrayLike | None = None,
            k_scale_cache: jax.Array | None = None,
            v_scale_cache: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Gathers cached K and V for each slot as [T, KH, D] in the cache dtype (zeros where the slot
    is outside the cache, whatever its width: numpy int64 slots with jax_enable_x64 off are
    mapped before JAX narrows them).

    "kv_merged": key_cache is the one array, value_cache None.
    Dequantization of fp8 caches (int8 caches: the scale caches only): with k_scale / v_scale (a scalar or [KH], as given to
    rope_and_cache) or the per-token scale caches of one layer (the layout's scale axes, e.g.
    [NB, KH, BS]), the values are float32 float32(stored) * scale. NVFP4 / MXFP4 (uint8 caches with
    block-scale caches; NVFP4 with the global scales k_scale / v_scale): the float32 values
    e2m1 * block_scale (* global_scale) [T, KH, D]."""
    nb, bs, mode = contract.check_read_kv(key_cache, value_cache, slot_mapping, layout, k_scale=k_scale,
                                          v_scale=v_scale, k_scale_cache=k_scale_cache, v_scale_cache=v_scale_cache)
    _check_concrete((("key_cache", key_cache), ("value_cache", value_cache), ("slot_mapping", slot_mapping),
                     ("k_scale_cache", k_scale_cache), ("v_scale_cache", v_scale_cache)), distinct=False)
    if _is_host(slot_mapping) and jax.dtypes.canonicalize_dtype(slot_mapping.dtype) != slot_mapping.dtype:
        slot_mapping = contract.narrow_slots(slot_mapping, nb * bs)
    if mode == "nvfp4":
        scales = (k_scale_cache, v_scale_cache) + tuple(jnp.asarray(g, jnp.float32).reshape(()) for g in (k_scale, v_scale))
        return _read_kv_jit(key_cache, value_cache, slot_mapping, scales, layout=layout, fmt=mode)
    if mode == "mxfp4":
        return _read_kv_jit(key_cache, value_cache, slot_mapping, (k_scale_cache, v_scale_cache), layout=layout,
                            fmt=mode)
    if mode == "token":
        scales = (k_scale_cache, v_scale_cache)
    elif mode == "static":
        scales = tuple(jnp.asarray(s, jnp.float32).reshape((-1,)) for s in (k_scale, v_scale))
    else:
        scales = None
    return _read_kv_jit(key_cache, value_cache, slot_mapping, scales, layout=layout)


# jax.export refuses custom calls it does not know; these are every target the ops lower to (both
# ops' CPU handlers, the GPU launcher's two registrations whatever JAX_ROPE_CACHE_COMMAND_BUFFERS
# says, and XLA's PTX custom call of the CUDA kernel-node route whatever JAX_ROPE_CACHE_KERNEL_NODE says).
EXPORT_TARGETS = (cpu.TARGET, cpu.TOKEN_SCALES_TARGET, cpu.MLA_TARGET, launcher.GPU_TARGET, launcher.GPU_TARGET_NO_GRAPH, kernel_node.TARGET)
DISABLED_EXPORT_CHECKS = tuple(jax.export.DisabledSafetyCheck.custom_call(t) for t in EXPORT_TARGETS)


def export(fn: Callable, *, platforms: Sequence[str] | None = None,
           disabled_checks: Sequence[jax.export.DisabledSafetyCheck] = (), **kwargs) -> Callable[..., jax.export.Exported]:
    """`jax.export.export` of `fn` (jitted here if it is not already) with the op's custom calls
    allowed: `jax_rope_cache.export(step, platforms=["cpu", "cuda", "rocm"])(*args)` returns a
    `jax.export.Exported` holding each platform's kernel (CUDA: cubin + PTX; ROCm: gfx942 + gfx950).
    A platform whose kernel cannot be built here lowers the XLA path (impl=None, with a warning) or
    raises (impl="kernel"). `Exported.serialize()` needs the `flatbuffers` package."""
    if not hasattr(fn, "lower"):
        fn = jax.jit(fn)
    return jax.export.export(fn, platforms=platforms, disabled_checks=tuple(disabled_checks) + DISABLED_EXPORT_CHECKS,
                             **kwargs)
