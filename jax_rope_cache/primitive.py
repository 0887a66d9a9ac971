"""The JAX primitive of rope_and_cache: abstract evaluation, batching, and the lowering policy.

The primitive (rather than a bare `jax.ffi.ffi_call`) lets each platform's code object be built
at *lowering* time: tracing never compiles a GPU kernel, and `jax.export` for a platform compiles
only that platform's kernel. Every kernel lowering aliases the caches (contract.CACHE_ALIASES).

Lowering policy, per platform: a native kernel (backends.KERNEL_BACKENDS) lowers unless the call is
partitioned automatically over several devices (the kernel refuses: use shard_map) or the backend
says it cannot build here; then impl=None lowers the pure-XLA implementation (with a warning when
something is missing) and impl="kernel" raises. Platforms without a native kernel get the XLA
implementation for impl=None and an error for impl="kernel".
"""

from __future__ import annotations

import dataclasses
import functools
import os
import threading
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from jax_rope_cache import backends, contract
from jax_rope_cache.backends import native, xla

rope_cache_p = Primitive("rope_and_cache")
rope_cache_p.multiple_results = True
kernel_platforms = backends.kernel_platforms


def _check_operands(avals, spec: contract.OpSpec) -> None:
    """The operands must be what `spec` describes: the GPU kernels are compiled from the spec (index
    widths included) and read the buffers XLA hands them, so a mismatch is a bug caught here."""
    want = {"q": spec.dtype, "k": spec.dtype, "v": spec.dtype, "key_cache": spec.cache_dtype,
            "value_cache": spec.cache_dtype, "slot_mapping": spec.slot_dtype, "positions": spec.pos_dtype,
            "cos": spec.table_dtype, "sin": spec.table_dtype, "k_scale": np.float32, "v_scale": np.float32,
            "layer": np.int32, "q_norm_weight": np.float32 if spec.q_norm_dtype is None else spec.q_norm_dtype,
            "k_norm_weight": np.float32 if spec.k_norm_dtype is None else spec.k_norm_dtype}
    if len(avals) != len(contract.OPERANDS):
        raise TypeError(f"rope_and_cache (internal): expected {len(contract.OPERANDS)} operands, got {len(avals)}")
    for name, aval in zip(contract.OPERANDS, avals):
        if np.dtype(aval.dtype) != np.dtype(want[name]):
            raise TypeError(f"rope_and_cache (internal): operand {name} is {np.dtype(aval.dtype).name}, but the "
                            f"call was specialised for {np.dtype(want[name]).name}")
    if tuple(avals[0].shape) != (spec.num_tokens, spec.q_heads, spec.head_dim) or \
            tuple(avals[5].shape) != (spec.num_tokens,) or tuple(avals[6].shape) != (spec.num_tokens,):
        raise ValueError(f"rope_and_cache (internal): operand shapes {[list(a.shape) for a in avals[:7]]} do not "
                         "match the call's specialisation")
    # scales [] / [1] or [KH]; weights [D] when the norm is on, the [1] placeholder otherwise
    per = dict(zip(contract.OPERANDS, avals))
    for name, heads in (("k_scale", spec.k_scale_heads), ("v_scale", spec.v_scale_heads)):
        ok = tuple(per[name].shape) == (spec.kv_heads,) if heads else tuple(per[name].shape) in ((), (1,))
        if not ok:
            raise ValueError(f"rope_and_cache (internal): operand {name} has shape {list(per[name].shape)}")
    for name, on in (("q_norm_weight", spec.q_norm_dtype), ("k_norm_weight", spec.k_norm_dtype)):
        if tuple(per[name].shape) != ((spec.head_dim,) if on is not None else (1,)):
            raise ValueError(f"rope_and_cache (internal): operand {name} has shape {list(per[name].shape)}")


def _abstract_eval(q, k, v, key_cache, value_cache, *rest, spec, impl):
    del impl
    _check_operands((q, k, v, key_cache, value_cache) + tuple(rest), spec)
    return [q.update(), k.update(), key_cache.update(), value_cache.update()]


def _xla_fallback(*args, spec, impl):
    del impl
    return list(xla.rope_and_cache(*args, spec=spec))


SHARD_MAP_RECIPE = (
    "run it per shard under jax.shard_map with q/k/v heads and the caches' KV-head axis split over the "
    "mesh axis (see 'Tensor parallelism' in the README)")


def auto_partitioned(ctx) -> bool:
    """True when lowering for XLA's automatic SPMD partitioner over several devices: a custom call
    there would be replicated (whole caches gathered to every device), so the kernel refuses."""
    axis_ctx = ctx.module_context.axis_context
    num_devices = getattr(axis_ctx, "num_devices", None)
    if num_devices is not None:  # ShardingContext: plain jit over a device set
        return num_devices > 1
    mesh, manual = getattr(axis_ctx, "mesh", None), getattr(axis_ctx, "manual_axes", frozenset())
    if mesh is None:
        return False
    return any(size > 1 for name, size in mesh.shape.items() if name not in manual)


def _lower_xla(ctx, *args, spec):
    return mlir.lower_fun(functools.partial(_xla_fallback, spec=spec, impl=None), multiple_results=True)(ctx, *args)


def _lower_fallback(ctx, *args, spec, impl):
    platform = ",".join(ctx.module_context.platforms)
    if impl == "kernel":
        raise NotImplementedError(
            f"rope_and_cache: impl='kernel' has no kernel for platform {platform!r}; "
            "use impl=None (falls back to the XLA implementation) or impl='xla'")
    return _lower_xla(ctx, *args, spec=spec)


_warned: set[str] = set()
_warn_lock = threading.Lock()
# Warnings point at the caller's code, not into jax's lowering machinery or this package.
_INTERNAL = (os.path.dirname(jax.__file__), os.path.dirname(os.path.abspath(__file__)))


def warn_once(message: str) -> None:
    with _warn_lock:
        if message in _warned:
            return
        _warned.add(message)
    warnings.warn(message, RuntimeWarning, skip_file_prefixes=_INTERNAL)


def _kernel_unusable(ctx, *args, spec, impl, platform: str, problem: str):
    """A platform's kernel cannot be built here (`problem` says why): impl="kernel" raises,
    impl=None warns (once per platform and reason) and lowers the XLA path."""
    if impl == "kernel":
        raise RuntimeError(f"rope_and_cache: impl='kernel' on {platform} needs {problem}")
    warn_once(f"rope_and_cache: falling back to the XLA implementation on {platform}: it needs {problem}")
    return _lower_xla(ctx, *args, spec=spec)


def _kernel_lowering(backend):
    def lower(ctx, *args, spec, impl):
        if auto_partitioned(ctx):
            if impl == "kernel":
                raise ValueError(f"rope_and_cache: impl='kernel' cannot be partitioned automatically by jit over "
                                 f"several {backend.PLATFORM} devices; {SHARD_MAP_RECIPE}, or use impl='xla'")
            warn_once(f"rope_and_cache: a jit over several {backend.PLATFORM} devices runs the XLA implementation "
                      f"(the kernel cannot be partitioned automatically); for the kernel, {SHARD_MAP_RECIPE}")
            return _lower_xla(ctx, *args, spec=spec)
        problem = backend.missing()
        if problem is None:
            try:
                return backend.lower(ctx, args, spec)
            except native.KernelUnavailable as e:
                if impl == "kernel":
                    raise e.__cause__ or e
                problem = str(e)
        return _kernel_unusable(ctx, *args, spec=spec, impl=impl, platform=backend.NAME, problem=problem)

    return lower


@functools.lru_cache(maxsize=256)
def _eager_callable(spec: contract.OpSpec, impl):
    """The one-op jitted computation an eager call runs, compiled once per (spec, impl)."""
    def rope_and_cache(*args):
        return rope_cache_p.bind(*args, spec=spec, impl=impl)
    return jax.jit(rope_and_cache)


def _eager_impl(*args, spec, impl):
    """Outside jit, and under jax.disable_jit() too, the primitive runs as its own small jitted
    computation: the same lowering (kernel or XLA path) as inside a jit, never a Python loop. Under
    disable_jit a plain jax.jit would call bind again, which would call this again, forever."""
    with jax.disable_jit(False):
        return _eager_callable(spec, impl)(*args)


rope_cache_p.def_abstract_eval(_abstract_eval)
rope_cache_p.def_impl(_eager_impl)
mlir.register_lowering(rope_cache_p, _lower_fallback)
for _backend in backends.KERNEL_BACKENDS.values():
    mlir.register_lowering(rope_cache_p, _kernel_lowering(_backend), platform=_backend.PLATFORM)


NOT_DIFFERENTIABLE = ("rope_and_cache is not differentiable: it writes a KV cache for inference. Apply "
                      "jax.lax.stop_gradient to its inputs, or differentiate a pure-jnp RoPE instead")


def _not_differentiable(primals, tangents, **params):
    raise TypeError(NOT_DIFFERENTIABLE)


def _batch(args, dims, *, spec, impl):
    """vmap: a batch of independent problems, run sequentially (fori_loop). The batched caches are
    written in place through the stacked-layer index (batch b, layer l -> stacked index b * L + l).
    An unbatched cache is broadcast first (a copy per batch element): vmap's semantics give every
    element its own result cache; batch the caches to avoid that copy."""
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    mapped = [d is not None for d in dims]
    args = [jnp.moveaxis(a, d, 0) if m else a for a, d, m in zip(args, dims, mapped)]
    layers = spec.num_layers
    per = 1 if layers is None else layers
    caches = []
    for i in (3, 4):
        c = args[i] if mapped[i] else jnp.broadcast_to(args[i], (size,) + args[i].shape)
        caches.append(c.reshape((size * per,) + c.shape[(1 if layers is None else 2):]))
    inner = dataclasses.replace(spec, num_layers=size * per)

    def body(b, carry):
        q_all, k_all, kc, vc = carry
        pick = lambda i: args[i][b] if mapped[i] else args[i]  # noqa: E731
        layer = b if layers is None else jnp.where((pick(11) >= 0) & (pick(11) < layers), b * layers + pick(11), -1)
        qo, ko, kc, vc = rope_cache_p.bind(*[pick(i) for i in range(3)], kc, vc, *[pick(i) for i in range(5, 11)],
                                           jnp.asarray(layer, jnp.int32), pick(12), pick(13), spec=inner, impl=impl)
        return q_all.at[b].set(qo), k_all.at[b].set(ko), kc, vc

    q0 = jnp.zeros((size,) + args[0].shape[mapped[0]:], args[0].dtype)
    k0 = jnp.zeros((size,) + args[1].shape[mapped[1]:], args[1].dtype)
    q_all, k_all, kc, vc = jax.lax.fori_loop(0, size, body, (q0, k0, *caches))
    kc = kc.reshape((size,) + args[3].shape[int(mapped[3]):])
    vc = vc.reshape((size,) + args[4].shape[int(mapped[4]):])
    return [q_all, k_all, kc, vc], [0, 0, 0, 0]


ad.primitive_jvps[rope_cache_p] = _not_differentiable
batching.primitive_batchers[rope_cache_p] = _batch


# impl="xla" is traced as jax.numpy code (XLA fuses and vmaps it as such), behind this identity
# primitive, which carries the op's one differentiation rule (none). An identity primitive rather
# than a jax.custom_jvp: primitives canonicalise their operands when bound, while vmap of a
# custom_jvp hands a batched numpy input (a closed-over array the caller vmaps over) to the
# enclosing jit's trace as is, which jax rejects as a non-canonical constant.
not_differentiable_p = Primitive("rope_and_cache_not_differentiable")
not_differentiable_p.multiple_results = True
not_differentiable_p.def_impl(lambda *args: list(args))
not_differentiable_p.def_abstract_eval(lambda *avals: list(avals))
mlir.register_lowering(not_differentiable_p, lambda ctx, *args: list(args))
ad.primitive_jvps[not_differentiable_p] = _not_differentiable
batching.primitive_batchers[not_differentiable_p] = lambda args, dims: (not_differentiable_p.bind(*args), dims)


def not_differentiable(*args) -> list:
    """`args` unchanged; jax.grad / jvp / vjp through them raise NOT_DIFFERENTIABLE."""
    return not_differentiable_p.bind(*args)


def bind(q, k, v, key_cache, value_cache, slot_mapping, positions, cos, sin, k_scale, v_scale, layer,
         q_norm_weight, k_norm_weight, *, spec: contract.OpSpec, impl):
    return rope_cache_p.bind(q, k, v, key_cache, value_cache, slot_mapping, positions, cos, sin,
                             k_scale, v_scale, layer, q_norm_weight, k_norm_weight, spec=spec, impl=impl)
