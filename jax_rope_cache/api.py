"""The public API: rope_and_cache, its donating jit entry point, and cache helpers."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jax_rope_cache import contract, primitive
from jax_rope_cache.backends import cpu, launcher, xla

IMPLS = (None, "kernel", "xla")
ArrayLike = jax.typing.ArrayLike
Cache = jax.Array | jax.Ref


def _scale_operand(scale):
    if scale is None:
        return jnp.ones((), jnp.float32)
    return jnp.asarray(scale, jnp.float32).reshape(())


def rope_and_cache(q: ArrayLike, k: ArrayLike, v: ArrayLike, key_cache: Cache, value_cache: Cache,
                   slot_mapping: ArrayLike, positions: ArrayLike, cos: ArrayLike, sin: ArrayLike, *,
                   layout: str = "flash", is_neox: bool = True, rotary_dim: int | None = None,
                   k_scale: ArrayLike | None = None, v_scale: ArrayLike | None = None,
                   precision: str = "fp32", impl: str | None = None,
                   layer: int | ArrayLike | None = None) -> tuple[jax.Array, jax.Array, Cache, Cache]:
    """Rotates q and k with RoPE and writes k and v into a paged KV cache, in one kernel.

    Args:
      q: [T, QH, D] bfloat16, float16 or float32 queries.
      k, v: [T, KH, D] new keys and values, q's dtype; QH % KH == 0.
      key_cache, value_cache: the caches in `layout` (see below), q's dtype or float8_e4m3fn /
        float8_e4m3fnuz. Updated in place when the caller's jit donates them (or use
        `rope_and_cache_donated`), or when they are `jax.Ref`s (then nothing needs donating:
        the refs are written and also returned). With `layer`, stacked as [L, ...].
      slot_mapping: [T] int32/int64. Slot s is block s // BS, offset s % BS; slots outside
        [0, NB*BS) (e.g. -1 for padding) write nothing.
      positions: [T] int32/int64 rows of cos/sin, clamped to [0, max_pos - 1].
      cos, sin: [max_pos, R/2] ("half") or [max_pos, R] ("full") tables, bf16/f16/f32.
      layout: "flash"            K, V: [NB, BS, KH, D]
              "xpacked"          K: [NB, KH, D//X, BS, X], V: [NB, KH, D, BS]
              "xpacked_shuffled" K: [NB, KH, D//X, BS, X], V: [NB, KH, BS//X, D, X]
        with X = 16 // cache itemsize.
      is_neox: True rotates pairs (i, i + R/2); False (GPT-J) pairs (2i, 2i + 1).
      rotary_dim: R, even, <= D (default D); channels >= R pass through.
      k_scale, v_scale: float32 scalars for float8 caches (stored = fp8(sat(x * (1/scale)))); None otherwise.
      precision: "fp32" (rotate in float32, round once) or "native" (AITER's arithmetic on ROCm:
        tables in the input dtype round every product and the sum; other tables promote to
        float32 with the first product fused). jax_rope_cache.reference states every rule.
      impl: None (native kernel where the platform has one, else XLA), "kernel", or "xla".
      layer: None, or the layer (int or traced integer scalar) of stacked [L, ...] caches to
        write: one stacked cache carried through `lax.scan`/`fori_loop` over layers is updated in
        place, never sliced. A traced layer outside [0, L) writes nothing.

    Returns:
      (q_out [T, QH, D], k_out [T, KH, D], key_cache, value_cache).
    """
    refs = [isinstance(c, jax.Ref) for c in (key_cache, value_cache)]
    if any(refs):
        if not all(refs):
            raise TypeError(f"value_cache: expected {'a jax.Ref' if refs[0] else 'an array'} like key_cache, "
                            f"got {type(value_cache).__name__}")
        key_ref, value_ref = key_cache, value_cache
        q_out, k_out, kc, vc = rope_and_cache(
            q, k, v, key_ref[...], value_ref[...], slot_mapping, positions, cos, sin, layout=layout,
            is_neox=is_neox, rotary_dim=rotary_dim, k_scale=k_scale, v_scale=v_scale, precision=precision,
            impl=impl, layer=layer)
        key_ref[...], value_ref[...] = kc, vc
        return q_out, k_out, key_ref, value_ref
    spec = contract.check_op(q, k, v, key_cache, value_cache, slot_mapping, positions, cos, sin,
                          layout=layout, is_neox=is_neox, rotary_dim=rotary_dim, k_scale=k_scale,
                          v_scale=v_scale, precision=precision, layer=layer)
    if impl not in IMPLS:
        raise ValueError(f"impl: expected one of {IMPLS}, got {impl!r}")
    args = tuple(jnp.asarray(a) for a in (q, k, v, key_cache, value_cache, slot_mapping, positions, cos, sin))
    args += (_scale_operand(k_scale), _scale_operand(v_scale),
             jnp.asarray(0 if layer is None else layer, jnp.int32).reshape(()))
    if spec.num_tokens == 0:
        return args[:2] + args[3:5]
    if impl == "xla":
        return xla.rope_and_cache(*args, spec=spec)
    return tuple(primitive.bind(*args, spec=spec, impl=impl))


_STATIC = ("layout", "is_neox", "rotary_dim", "precision", "impl")

rope_and_cache_donated = jax.jit(rope_and_cache, static_argnames=_STATIC,
                                 donate_argnames=("key_cache", "value_cache"))
rope_and_cache_donated.__doc__ = """`rope_and_cache` under `jax.jit` with both caches donated.

The caches passed in are consumed (updated in place, then deleted on the caller's side): use the
returned ones. Inside your own jit, call `rope_and_cache` and donate the caches at the outermost
jit instead.
"""


def make_kv_cache(num_blocks: int, block_size: int, kv_heads: int, head_dim: int, dtype=jnp.bfloat16, *,
                  layout: str = "flash", num_layers: int | None = None, fill: str = "zeros", seed: int = 0,
                  device=None) -> tuple[jax.Array, jax.Array]:
    """Allocates (key_cache, value_cache) for `layout`, optionally with a leading [num_layers] axis.

    fill: "zeros", or "random" (standard normal values; useful for tests that must see which
    slots a kernel touched).
    """
    dtype = np.dtype(dtype)
    if dtype not in contract.INPUT_DTYPES + contract.FP8_DTYPES:
        raise TypeError(f"dtype: expected one of "
                        f"({contract.dtype_names(contract.INPUT_DTYPES + contract.FP8_DTYPES)}), got {dtype.name}")
    contract.cache_layout(layout)
    contract.check_layout_divisibility(layout, head_dim, block_size, dtype, head_arg="head_dim",
                                       block_arg="block_size")
    shapes = contract.cache_shapes(layout, num_blocks, block_size, kv_heads, head_dim, dtype)
    if num_layers is not None:
        shapes = tuple((num_layers,) + s for s in shapes)
    if fill == "zeros":
        make = lambda shape, _: jnp.zeros(shape, dtype, device=device)  # noqa: E731
    elif fill == "random":
        keys = jax.random.split(jax.random.key(seed), 2)
        make = lambda shape, i: jax.device_put(  # noqa: E731
            jax.random.normal(keys[i], shape, jnp.float32).astype(dtype), device)
    else:
        raise ValueError(f"fill: expected 'zeros' or 'random', got {fill!r}")
    return make(shapes[0], 0), make(shapes[1], 1)


@functools.partial(jax.jit, static_argnames=("layout",))
def read_kv(key_cache: jax.Array, value_cache: jax.Array, slot_mapping: ArrayLike, *,
            layout: str = "flash") -> tuple[jax.Array, jax.Array]:
    """Gathers cached K and V for each slot as [T, KH, D] in the cache dtype (zeros where the slot
    is outside the cache)."""
    return xla.read_kv(key_cache, value_cache, slot_mapping, layout=layout)


# jax.export refuses custom calls it does not know; these are every target the op lowers to (the
# GPU launcher's two registrations included, whatever JAX_ROPE_CACHE_COMMAND_BUFFERS says).
EXPORT_TARGETS = (cpu.TARGET, launcher.GPU_TARGET, launcher.GPU_TARGET_NO_GRAPH)
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
