"""impl="kernel" on CPU: the custom call of the C++ handler (kernels/ffi/cpu_handler.cc), which
computes the op directly. Shapes and dtypes come from the buffers; the attributes say the rest."""

from __future__ import annotations

import jax
import numpy as np

from jax_rope_cache import contract
from jax_rope_cache.backends import native

PLATFORM = "cpu"
NAME = "CPU"
TARGET = "jax_rope_cache_cpu"
TOKEN_SCALES_TARGET = "jax_rope_cache_cpu_token_scales"  # the same handler with the scale caches as 2 more results
MLA_TARGET = "jax_rope_cache_mla_cpu"  # the MLA op's handler (kernels/ffi/mla_cpu_handler.cc)
# contract.FEATURES the C++ handler implements (others: the XLA path, or an error with impl="kernel"):
# every model-family option and the int8 / int4 caches.
SUPPORTS: frozenset[str] = frozenset(contract.BASE_FEATURES) | {
    "nope", "rope_switch", "rotary_tail", "gemma_norm", "weightless_norm", "norm_after", "temperature", "q_gate",
    "int8_cache", "int4_cache"}


def missing() -> str | None:
    """What the kernel needs that this process lacks, or None when it can lower."""
    return None if native.native_module() is not None else native.MISSING


def kernel_attrs(spec: contract.OpSpec) -> dict:
    """The attributes the CPU handler reads (contract.extra_operands(spec) follow OPERANDS: rope_switch
    says a use_rope operand is there, floor_scale > 0 the temperature_factors table)."""
    return dict(layout=np.int64(contract.LAYOUT_TABLE[spec.layout].code), is_neox=bool(spec.is_neox),
                rotary_dim=np.int64(spec.rotary_dim), native=spec.precision == "native",
                q_norm=spec.q_norm_dtype is not None, k_norm=spec.k_norm_dtype is not None,
                norm_eps=np.float32(spec.norm_eps),
                **{k: np.int64(v) for k, v in contract.mrope_codes(spec).items()},
                rotary_tail=bool(spec.rotary_tail), norm_type=np.int64(contract.NORM_TYPES.index(spec.norm_type)),
                norm_after=bool(spec.norm_after), q_gate=bool(spec.q_gate), rope_switch=bool(spec.rope_switch),
                floor_scale=np.int64(0 if spec.temperature is None else spec.temperature[0]))


def lower(ctx, args, spec: contract.OpSpec):
    native.refuse_unsupported(spec, SUPPORTS, NAME)
    if spec.token_scales:
        target, handler = TOKEN_SCALES_TARGET, native.native_module().cpu_token_scales_handler
    else:
        target, handler = TARGET, native.native_module().cpu_handler
    native.register_target(target, handler, "cpu")
    rule = jax.ffi.ffi_lowering(target, operand_output_aliases=contract.cache_aliases(spec))
    return rule(ctx, *args, **kernel_attrs(spec))
