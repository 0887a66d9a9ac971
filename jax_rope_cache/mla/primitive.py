"""The JAX primitive of mla_rope_and_cache, on the main op's machinery (jax_rope_cache/primitive.py):
the same lowering policy (kernel where the platform has one and can build it, else the XLA path
with a warning for impl=None or an error for impl="kernel"; automatic multi-device partitioning
refused), the same eager rule (a small jitted computation), the same vmap rule (sequential, batched
caches written in place through the stacked-layer index) and the same refusal to differentiate.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from jax_rope_cache import primitive
from jax_rope_cache.mla import contract as mla_contract
from jax_rope_cache.mla import kernels, xla
from jax_rope_cache.mla.contract import MlaSpec

OP = "mla_rope_and_cache"
mla_p = Primitive(OP)
mla_p.multiple_results = True

NOT_DIFFERENTIABLE = (f"{OP} is not differentiable: it writes a latent KV cache for inference. Apply "
                      "jax.lax.stop_gradient to its inputs, or differentiate a pure-jnp RoPE instead")


def expected_operands(spec: MlaSpec) -> list[tuple[str, tuple[int, ...], np.dtype]]:
    """(name, shape, dtype) of every operand a call specialised for `spec` takes."""
    t, qh, dr = spec.num_tokens, spec.q_heads, spec.rope_dim
    lead = () if spec.num_layers is None else (spec.num_layers,)
    f32 = np.dtype(np.float32)
    out = [("q_nope", (t, qh, spec.nope_dim), spec.dtype), ("q_pe", (t, qh, dr), spec.dtype),
           ("kv_c", (t, spec.latent_dim), spec.dtype), ("k_pe", (t, dr), spec.dtype)]
    out += [(n, lead + s, spec.cache_dtype) for n, s in zip(mla_contract.CACHE_NAMES[spec.layout], spec.cache_shapes())]
    out += [("slot_mapping", (t,), spec.slot_dtype), ("positions", (t,), spec.pos_dtype),
            ("cos", None, spec.table_dtype), ("sin", None, spec.table_dtype), ("kv_scale", (), f32),
            ("q_scale", (), f32), ("layer", (), np.dtype(np.int32))]
    return out


def _abstract_eval(*avals, spec: MlaSpec, impl):
    del impl
    want = expected_operands(spec)
    if len(avals) != len(want):
        raise TypeError(f"{OP} (internal): expected {len(want)} operands, got {len(avals)}")
    for (name, shape, dtype), a in zip(want, avals):
        if np.dtype(a.dtype) != dtype or (shape is not None and tuple(a.shape) != tuple(shape)):
            raise TypeError(f"{OP} (internal): operand {name} is {np.dtype(a.dtype).name}{list(a.shape)}, but the "
                            f"call was specialised for {dtype.name}{list(shape) if shape is not None else ''}")
    q_out = jax.core.ShapedArray((spec.num_tokens, spec.q_heads, spec.q_dim), spec.q_out_dtype)
    k_pe_out = jax.core.ShapedArray((spec.num_tokens, spec.rope_dim), spec.dtype)
    return [q_out, k_pe_out] + [a.update() for a in avals[4:4 + len(mla_contract.CACHE_NAMES[spec.layout])]]


def _lower_xla(ctx, *args, spec):
    return mlir.lower_fun(functools.partial(xla.mla_rope_and_cache, spec=spec), multiple_results=True)(ctx, *args)


def _lower_fallback(ctx, *args, spec, impl):
    if impl == "kernel":
        platform = ",".join(ctx.module_context.platforms)
        raise NotImplementedError(f"{OP}: impl='kernel' has no kernel for platform {platform!r}; use impl=None "
                                  "(falls back to the XLA implementation) or impl='xla'")
    return _lower_xla(ctx, *args, spec=spec)


def _not_differentiable(primals, tangents, **params):
    raise TypeError(NOT_DIFFERENTIABLE)


def _batch(args, dims, *, spec, impl):
    n_caches = len(mla_contract.CACHE_NAMES[spec.layout])
    return primitive.batch_sequentially(mla_p, args, dims, spec=spec, impl=impl, caches=tuple(range(4, 4 + n_caches)),
                                        layer=len(args) - 1, n_front=2)


mla_p.def_abstract_eval(_abstract_eval)
mla_p.def_impl(primitive.eager_impl(mla_p))
mlir.register_lowering(mla_p, _lower_fallback)
for _platform, _backend in kernels.MLA_BACKENDS.items():
    mlir.register_lowering(mla_p, primitive.kernel_lowering(_backend, kernels.lowering(_platform), _lower_xla, OP),
                           platform=_platform)
ad.primitive_jvps[mla_p] = _not_differentiable
batching.primitive_batchers[mla_p] = _batch


def bind(*operands, spec: MlaSpec, impl):
    if len(operands) != len(mla_contract.operands(spec.layout)):
        raise TypeError(f"{OP} (internal): expected operands {mla_contract.operands(spec.layout)}")
    return mla_p.bind(*operands, spec=spec, impl=impl)


__all__ = ["mla_p", "bind", "NOT_DIFFERENTIABLE"]
