"""jax_rope_cache: fused RoPE + paged KV-cache write for JAX, in one kernel, in place inside jit.

`jax_rope_cache.reference` (the numpy oracle) imports without jax; everything else loads jax on
first use.
"""

import importlib

__version__ = "0.1.0"

_LAZY = {
    "rope_and_cache": "jax_rope_cache.api",
    "rope_and_cache_donated": "jax_rope_cache.api",
    "rope_and_cache_qkv": "jax_rope_cache.api",
    "make_kv_cache": "jax_rope_cache.api",
    "make_kv_scale_cache": "jax_rope_cache.api",
    "read_kv": "jax_rope_cache.api",
    "export": "jax_rope_cache.api",
    "DISABLED_EXPORT_CHECKS": "jax_rope_cache.api",
    "LAYOUTS": "jax_rope_cache.contract",
    "PRECISIONS": "jax_rope_cache.contract",
    "cache_shapes": "jax_rope_cache.contract",
    "rope_tables": "jax_rope_cache.models.tables",
    "rope_tables_from_hf_config": "jax_rope_cache.models.config",
    "mla_rope_and_cache": "jax_rope_cache.mla.api",
    "make_mla_cache": "jax_rope_cache.mla.api",
    "read_mla_cache": "jax_rope_cache.mla.api",
    "MLA_LAYOUTS": "jax_rope_cache.mla.contract",
}

__all__ = sorted(_LAZY)


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'jax_rope_cache' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
