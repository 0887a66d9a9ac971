"""impl="kernel": one JAX primitive lowered per platform to an XLA FFI custom call.

The primitive (rather than a bare `jax.ffi.ffi_call`) lets each platform's code object be built
at *lowering* time: tracing never compiles a GPU kernel, and `jax.export` for a platform compiles
only that platform's kernel. Every lowering aliases the caches (operands 3, 4 -> results 2, 3).

Platforms without a native kernel lower the same primitive to the pure-XLA implementation when
impl=None, and raise when impl="kernel" was asked for explicitly.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from jax_rope_cache import _spec, xla

CPU_TARGET = "jax_rope_cache_cpu"
CACHE_ALIASES = {3: 2, 4: 3}  # operand index -> result index
LAYOUT_CODES = {name: i for i, name in enumerate(_spec.LAYOUTS)}

rope_cache_p = Primitive("rope_and_cache")
rope_cache_p.multiple_results = True

_registered: set[tuple[str, str]] = set()
# platform -> callable telling whether its native kernel can be built here (backend modules add theirs).
_KERNEL_PLATFORMS = {"cpu": lambda: native_module() is not None}
_lock = threading.Lock()


@functools.cache
def native_module():
    """The compiled extension, or None when the package was installed without it."""
    try:
        from jax_rope_cache import _native
    except ImportError:
        return None
    return _native


def register_kernel_platform(platform: str, available) -> None:
    _KERNEL_PLATFORMS[platform] = available


def kernel_platforms() -> list[str]:
    """Platforms (jax names: "cpu", "cuda", "rocm") whose native kernel is usable in this process."""
    return [p for p, available in _KERNEL_PLATFORMS.items() if available()]


def register_target(name: str, capsule_fn, platform: str) -> None:
    """Registers an FFI target once per process (registration is queued for absent platforms)."""
    with _lock:
        if (name, platform) in _registered:
            return
        jax.ffi.register_ffi_target(name, capsule_fn(), platform=platform, api_version=1)
        _registered.add((name, platform))


def _abstract_eval(q, k, v, key_cache, value_cache, *rest, spec, impl):
    del v, rest, spec, impl
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


def kernel_unusable(ctx, *args, spec, impl, platform: str, problem: str):
    """A platform's kernel cannot be built here (`problem` says why): impl="kernel" raises,
    impl=None warns and lowers the XLA path. `args` must still include the layer operand."""
    if impl == "kernel":
        raise RuntimeError(f"rope_and_cache: impl='kernel' on {platform} needs {problem}")
    warnings.warn(f"rope_and_cache: falling back to the XLA implementation on {platform}: it needs {problem}",
                  RuntimeWarning, stacklevel=3)
    return _lower_xla(ctx, *args, spec=spec)


def kernel_attrs(spec: _spec.OpSpec) -> dict:
    """The attributes every native handler reads (shapes and dtypes come from the buffers)."""
    return dict(layout=np.int64(LAYOUT_CODES[spec.layout]), is_neox=bool(spec.is_neox),
                rotary_dim=np.int64(spec.rotary_dim), native=spec.precision == "native")


def kernel_or_fallback(ctx, *args, spec, impl, platform: str):
    """None when the native kernel may lower here; otherwise the fallback lowering (impl=None)
    or a clear error (impl="kernel")."""
    if not auto_partitioned(ctx):
        return None
    if impl == "kernel":
        raise ValueError(f"rope_and_cache: impl='kernel' cannot be partitioned automatically by jit over "
                         f"several {platform} devices; {SHARD_MAP_RECIPE}, or use impl='xla'")
    return _lower_xla(ctx, *args, spec=spec)


def _lower_cpu(ctx, *args, spec, impl):
    if (fallback := kernel_or_fallback(ctx, *args, spec=spec, impl=impl, platform="cpu")) is not None:
        return fallback
    module = native_module()
    if module is None:
        if impl == "kernel":
            raise RuntimeError("rope_and_cache: impl='kernel' needs the compiled extension "
                               "jax_rope_cache._native, which did not import; reinstall the package")
        return _lower_fallback(ctx, *args, spec=spec, impl=impl)
    register_target(CPU_TARGET, module.cpu_handler, "cpu")
    rule = jax.ffi.ffi_lowering(CPU_TARGET, operand_output_aliases=CACHE_ALIASES)
    return rule(ctx, *args, **kernel_attrs(spec))


rope_cache_p.def_abstract_eval(_abstract_eval)
# Outside jit the primitive runs as its own small jitted computation.
rope_cache_p.def_impl(lambda *args, **params: jax.jit(functools.partial(rope_cache_p.bind, **params))(*args))
mlir.register_lowering(rope_cache_p, _lower_fallback)
mlir.register_lowering(rope_cache_p, _lower_cpu, platform="cpu")


def _not_differentiable(primals, tangents, **params):
    raise TypeError("rope_and_cache is not differentiable: it writes a KV cache for inference. Apply "
                    "jax.lax.stop_gradient to its inputs, or differentiate a pure-jnp RoPE instead")


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
                                           jnp.asarray(layer, jnp.int32), spec=inner, impl=impl)
        return q_all.at[b].set(qo), k_all.at[b].set(ko), kc, vc

    q0 = jnp.zeros((size,) + args[0].shape[mapped[0]:], args[0].dtype)
    k0 = jnp.zeros((size,) + args[1].shape[mapped[1]:], args[1].dtype)
    q_all, k_all, kc, vc = jax.lax.fori_loop(0, size, body, (q0, k0, *caches))
    kc = kc.reshape((size,) + args[3].shape[int(mapped[3]):])
    vc = vc.reshape((size,) + args[4].shape[int(mapped[4]):])
    return [q_all, k_all, kc, vc], [0, 0, 0, 0]


ad.primitive_jvps[rope_cache_p] = _not_differentiable
batching.primitive_batchers[rope_cache_p] = _batch


def bind(q, k, v, key_cache, value_cache, slot_mapping, positions, cos, sin, k_scale, v_scale, layer, *,
         spec: _spec.OpSpec, impl):
    return rope_cache_p.bind(q, k, v, key_cache, value_cache, slot_mapping, positions, cos, sin,
                             k_scale, v_scale, layer, spec=spec, impl=impl)
from jax_rope_cache import cuda as _cuda  # noqa: E402,F401
from jax_rope_cache import rocm as _rocm  # noqa: E402,F401
