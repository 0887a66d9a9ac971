"""impl="kernel": one JAX primitive lowered per platform to an XLA FFI custom call.

The primitive (rather than a bare `jax.ffi.ffi_call`) lets each platform's code object be built
at *lowering* time: tracing never compiles a GPU kernel, and `jax.export` for a platform compiles
only that platform's kernel. Every lowering aliases the caches (operands 3, 4 -> results 2, 3).

Platforms without a native kernel lower the same primitive to the pure-XLA implementation when
impl=None, and raise when impl="kernel" was asked for explicitly.
"""

from __future__ import annotations

import functools
import threading

import jax
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import mlir

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


def _lower_fallback(ctx, *args, spec, impl):
    platform = ",".join(ctx.module_context.platforms)
    if impl == "kernel":
        raise NotImplementedError(
            f"rope_and_cache: impl='kernel' has no kernel for platform {platform!r}; "
            "use impl=None (falls back to the XLA implementation) or impl='xla'")
    return mlir.lower_fun(functools.partial(_xla_fallback, spec=spec, impl=impl), multiple_results=True)(ctx, *args)


def kernel_attrs(spec: _spec.OpSpec) -> dict:
    """The attributes every native handler reads (shapes and dtypes come from the buffers)."""
    return dict(layout=np.int64(LAYOUT_CODES[spec.layout]), is_neox=bool(spec.is_neox),
                rotary_dim=np.int64(spec.rotary_dim), native=spec.precision == "native")


def _lower_cpu(ctx, *args, spec, impl):
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


def bind(q, k, v, key_cache, value_cache, slot_mapping, positions, cos, sin, k_scale, v_scale, *,
         spec: _spec.OpSpec, impl):
    return rope_cache_p.bind(q, k, v, key_cache, value_cache, slot_mapping, positions, cos, sin,
                             k_scale, v_scale, spec=spec, impl=impl)
from jax_rope_cache import cuda as _cuda  # noqa: E402,F401
from jax_rope_cache import rocm as _rocm  # noqa: E402,F401
