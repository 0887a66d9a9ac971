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
            "cos": spec.table_dtype, "sin": spec.table_dtype, "k_scale": contract.scale_cache_dtype(spec),
            "v_scale": contract.scale_cache_dtype(spec), "layer": np.int32, "q_norm_weight": np.float32 if spec.q_norm_dtype is None else spec.q_norm_dtype,
            "k_norm_weight": np.float32 if spec.k_norm_dtype is None else spec.k_norm_dtype}
    extra = len(contract.extra_operands(spec))
    if len(avals) != len(contract.OPERANDS) + extra:
        raise TypeError(f"rope_and_cache (internal): expected {len(contract.OPERANDS) + extra} operands, "
                        f"got {len(avals)}")
    for name, aval in zip(contract.OPERANDS, avals):
        if np.dtype(aval.dtype) != np.dtype(want[name]):
            raise TypeError(f"rope_and_cache (internal): operand {name} is {np.dtype(aval.dtype).name}, but the "
                            f"call was specialised for {np.dtype(want[name]).name}")
    inputs = contract.input_shapes(spec)
    if any(tuple(a.shape) != inputs[n] for n, a in zip(("q", "k", "v"), avals[:3])) or \
            tuple(avals[5].shape) != (spec.num_tokens,) or \
            tuple(avals[6].shape) != ((spec.num_tokens,) if spec.mrope_section is None else (3, spec.num_tokens)):
        raise ValueError(f"rope_and_cache (internal): operand shapes {[list(a.shape) for a in avals[:7]]} do not "
                         "match the call's specialisation")
    # scales [] / [1] or [KH]; weights [D] when the norm is on, the [1] placeholder otherwise
    per = dict(zip(contract.OPERANDS, avals))
    for name, heads in (("k_scale", spec.k_scale_heads), ("v_scale", spec.v_scale_heads)):
        if spec.token_scales:  # the scale caches
            ok = tuple(per[name].shape) == contract.scale_cache_shape(spec)
        else:
            ok = tuple(per[name].shape) == (spec.kv_heads,) if heads else tuple(per[name].shape) in ((), (1,))
        if not ok:
            raise ValueError(f"rope_and_cache (internal): operand {name} has shape {list(per[name].shape)}")
    for name, on in (("q_norm_weight", spec.q_norm_dtype), ("k_norm_weight", spec.k_norm_dtype)):
        if tuple(per[name].shape) != ((spec.head_dim,) if on is not None else (1,)):
            raise ValueError(f"rope_and_cache (internal): operand {name} has shape {list(per[name].shape)}")


def _abstract_eval(q, k, v, key_cache, value_cache, *rest, spec, impl):
    del impl
    _check_operands((q, k, v, key_cache, value_cache) + tuple(rest), spec)
    t, d = spec.num_tokens, spec.head_dim
    out = [q.update(shape=(t, spec.q_heads, d)), k.update(shape=(t, spec.kv_heads, d)), key_cache.update(),
           value_cache.update()]
    if spec.token_scales:  # the scale caches, in the k_scale / v_scale operand slots
        out += [rest[4].update(), rest[5].update()]
    return out


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


def _kernel_unusable(ctx, *args, spec, impl, platform: str, problem: str, op: str = "rope_and_cache",
                     lower_xla=None):
    """A platform's kernel cannot be built here (`problem` says why): impl="kernel" raises,
    impl=None warns (once per platform and reason) and lowers the XLA path."""
    if impl == "kernel":
        raise RuntimeError(f"{op}: impl='kernel' on {platform} needs {problem}")
    warn_once(f"{op}: falling back to the XLA implementation on {platform}: it needs {problem}")
    return (lower_xla or _lower_xla)(ctx, *args, spec=spec)


def kernel_lowering(backend, lower_kernel=None, lower_xla=None, op: str = "rope_and_cache"):
    """The lowering rule of an op on `backend`'s platform, with the policy of the module docstring:
    `lower_kernel(ctx, args, spec)` emits the custom call (default: backend.lower; it may raise
    native.KernelUnavailable), `lower_xla(ctx, *args, spec=spec)` the XLA path (default: the main
    op's), `op` names the op in messages. Every op of the package lowers through this."""
    lower_kernel = lower_kernel or backend.lower
    lower_xla = lower_xla or _lower_xla

    def lower(ctx, *args, spec, impl):
        if auto_partitioned(ctx):
            if impl == "kernel":
                raise ValueError(f"{op}: impl='kernel' cannot be partitioned automatically by jit over "
                                 f"several {backend.PLATFORM} devices; {SHARD_MAP_RECIPE}, or use impl='xla'")
            warn_once(f"{op}: a jit over several {backend.PLATFORM} devices runs the XLA implementation "
                      f"(the kernel cannot be partitioned automatically); for the kernel, {SHARD_MAP_RECIPE}")
            return lower_xla(ctx, *args, spec=spec)
        problem = backend.missing()
        if problem is None:
            try:
                return lower_kernel(ctx, args, spec)
            except native.KernelUnavailable as e:
                if impl == "kernel":
                    raise e.__cause__ or e
                problem = str(e)
        return _kernel_unusable(ctx, *args, spec=spec, impl=impl, platform=backend.NAME, problem=problem, op=op,
                                lower_xla=lower_xla)

    return lower


def _kernel_lowering(backend):
    return kernel_lowering(backend)


@functools.lru_cache(maxsize=256)
def _eager_callable(prim, spec, impl):
    """The one-op jitted computation an eager call of `prim` runs, compiled once per (spec, impl)."""
    def one_op(*args):
        return prim.bind(*args, spec=spec, impl=impl)
    one_op.__name__ = prim.name
    return jax.jit(one_op)


def eager_impl(prim):
    """The impl rule of a primitive: outside jit, and under jax.disable_jit() too, it runs as its
    own small jitted computation: the same lowering (kernel or XLA path) as inside a jit, never a
    Python loop. Under disable_jit a plain jax.jit would call bind again, which would call this
    again, forever."""
    def impl_rule(*args, spec, impl):
        with jax.disable_jit(False):
            return _eager_callable(prim, spec, impl)(*args)
    return impl_rule


rope_cache_p.def_abstract_eval(_abstract_eval)
rope_cache_p.def_impl(eager_impl(rope_cache_p))
mlir.register_lowering(rope_cache_p, _lower_fallback)
for _backend in backends.KERNEL_BACKENDS.values():
    mlir.register_lowering(rope_cache_p, kernel_lowering(_backend), platform=_backend.PLATFORM)


NOT_DIFFERENTIABLE = ("rope_and_cache is not differentiable: it writes a KV cache for inference. Apply "
                      "jax.lax.stop_gradient to its inputs, or differentiate a pure-jnp RoPE instead")


def _not_differentiable(primals, tangents, **params):
    raise TypeError(NOT_DIFFERENTIABLE)


def batch_sequentially(prim, args, dims, *, spec, impl, caches: tuple[int, ...], layer: int, n_front: int):
    """vmap of an op writing caches: a batch of independent problems, run sequentially (fori_loop).
    The batched caches (operands `caches`, results n_front, n_front + 1, ...) are written in place
    through the stacked-layer index (operand `layer`: batch b, layer l -> stacked index b * L + l).
    An unbatched cache is broadcast first (a copy per batch element): vmap's semantics give every
    element its own result cache; batch the caches to avoid that copy. The first n_front results
    are per-problem outputs, stacked."""
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    mapped = [d is not None for d in dims]
    args = [jnp.moveaxis(a, d, 0) if m else a for a, d, m in zip(args, dims, mapped)]
    layers = spec.num_layers
    per = 1 if layers is None else layers
    stacked = {}
    for i in caches:
        c = args[i] if mapped[i] else jnp.broadcast_to(args[i], (size,) + args[i].shape)
        stacked[i] = c.reshape((size * per,) + c.shape[(1 if layers is None else 2):])
    inner = dataclasses.replace(spec, num_layers=size * per)
    fronts = prim.abstract_eval(*[jax.core.ShapedArray(a.shape[int(m):], a.dtype) for a, m in zip(args, mapped)],
                                spec=spec, impl=impl)[0][:n_front]

    def body(b, carry):
        outs, cache_vals = carry[:n_front], dict(zip(caches, carry[n_front:]))
        pick = lambda i: args[i][b] if mapped[i] else args[i]  # noqa: E731
        lay = b if layers is None else jnp.where((pick(layer) >= 0) & (pick(layer) < layers),
                                                 b * layers + pick(layer), -1)
        operands = [cache_vals[i] if i in caches else jnp.asarray(lay, jnp.int32) if i == layer else pick(i)
                    for i in range(len(args))]
        res = prim.bind(*operands, spec=inner, impl=impl)
        return tuple(o.at[b].set(r) for o, r in zip(outs, res[:n_front])) + tuple(res[n_front:])

    init = tuple(jnp.zeros((size,) + f.shape, f.dtype) for f in fronts) + tuple(stacked[i] for i in caches)
    done = jax.lax.fori_loop(0, size, body, init)
    out_caches = [c.reshape((size,) + args[i].shape[int(mapped[i]):]) for i, c in zip(caches, done[n_front:])]
    return list(done[:n_front]) + out_caches, [0] * (n_front + len(caches))


def _batch(args, dims, *, spec, impl):
    caches = tuple(contract.OPERANDS.index(n) for n in ("key_cache", "value_cache"))
    if spec.token_scales:  # the scale caches are written in place the same way
        caches += tuple(contract.OPERANDS.index(n) for n in ("k_scale", "v_scale"))
    return batch_sequentially(rope_cache_p, args, dims, spec=spec, impl=impl, caches=caches,
                              layer=contract.OPERANDS.index("layer"), n_front=2)


ad.primitive_jvps[rope_cache_p] = _not_differentiable
batching.primitive_batchers[rope_cache_p] = _batch


# impl="xla" is traced as jax.numpy code (XLA fuses and vmaps it as such), behind this identity
# primitive, which carries the op's one differentiation rule (none). An identity primitive rather
# than a jax.custom_jvp: primitives canonicalise their operands when bound, while vmap of a
# custom_jvp hands a batched numpy input (a closed-over array the caller vmaps over) to the
# enclosing jit's trace as is, which jax rejects as a non-canonical constant.
def _refuse_jvp(primals, tangents, *, message):
    raise TypeError(message)


not_differentiable_p = Primitive("rope_and_cache_not_differentiable")
not_differentiable_p.multiple_results = True
not_differentiable_p.def_impl(lambda *args, message: list(args))
not_differentiable_p.def_abstract_eval(lambda *avals, message: list(avals))
mlir.register_lowering(not_differentiable_p, lambda ctx, *args, message: list(args))
ad.primitive_jvps[not_differentiable_p] = _refuse_jvp
batching.primitive_batchers[not_differentiable_p] = lambda args, dims, *, message: (
    not_differentiable_p.bind(*args, message=message), dims)


def not_differentiable(*args, message: str = NOT_DIFFERENTIABLE) -> list:
    """`args` unchanged; jax.grad / jvp / vjp through them raise TypeError(message)."""
    return not_differentiable_p.bind(*args, message=message)


def bind(q, k, v, key_cache, value_cache, slot_mapping, positions, cos, sin, k_scale, v_scale, layer,
         q_norm_weight, k_norm_weight, *extra, spec: contract.OpSpec, impl):
    """`extra`: contract.extra_operands(spec), in that order."""
    return rope_cache_p.bind(q, k, v, key_cache, value_cache, slot_mapping, positions, cos, sin,
                             k_scale, v_scale, layer, q_norm_weight, k_norm_weight, *extra, spec=spec, impl=impl)
