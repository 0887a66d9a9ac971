"""impl="kernel" on TPUs: one Pallas TPU (Mosaic) kernel, kernels/tpu/rope_cache_pallas.py.

The lowering runs Pallas' Mosaic lowering (on any machine: `jax.export` for "tpu" needs no TPU) and
emits one `tpu_custom_call` whose key and value caches are aliased to results 2 and 3 (per-token
scales: the scale caches to 4 and 5; NVFP4 / MXFP4: the block-scale caches, as uint8 bytes, to 4 and
5). The kernel's static configuration (`config`) comes from the op's OpSpec; slots, positions, the
layer and use_rope stay device values (scalar prefetch), NVFP4's global scales an SMEM operand, so
one executable serves every step and every layer.

What the kernel does not implement is refused through the package's mechanism (impl=None: the
XLA path with one warning; impl="kernel": an error naming it), see `unsupported`. A configuration
Mosaic's lowering rejects is refused the same way, so impl=None takes the kernel only when it lowers.

`kernel_fn(spec, interpret=params)` is the same kernel run by Pallas' TPU interpreter
(`pltpu.InterpretParams`): the tests lower it for the CPU that way (tests/tpu_interpret.py); the
package itself never selects interpret mode.
"""

from __future__ import annotations

import functools
import importlib.util
import sys

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.interpreters import mlir

from jax_rope_cache import contract
from jax_rope_cache.backends import native
from jax_rope_cache.compilers import cache

PLATFORM = "tpu"
NAME = "TPU"
KERNEL_SOURCE = "tpu/rope_cache_pallas.py"
# contract.FEATURES the kernel implements.
SUPPORTS: frozenset[str] = frozenset({"q_norm", "k_norm", "k_scale_heads", "v_scale_heads", "token_scales", "mrope",
                                          "q_gate", "nope", "rope_switch", "rotary_tail", "gemma_norm",
                                          "weightless_norm", "norm_after", "temperature",
                                          "int8_cache", "int4_cache", "nvfp4_cache", "mxfp4_cache"})
# float16 is moved as bits and widened / rounded in integer arithmetic (Mosaic has no float16 arithmetic).
DTYPES = (np.dtype(jnp.bfloat16), np.dtype(np.float32), np.dtype(np.float16))
ROUNDED = (np.dtype(jnp.bfloat16), np.dtype(np.float16))  # "native" precision's "rounded" arithmetic
INT32_MAX = 2**31 - 1
# Slots and positions live in SMEM as scalar prefetch (8 bytes a token, 16 with M-RoPE's three position
# streams; 1 MiB of SMEM on v4 and later): at most 512 KiB of them.
MAX_TOKENS = 65536


def max_tokens(spec: contract.OpSpec) -> int:
    return MAX_TOKENS * 2 // (1 + (3 if spec.mrope_section is not None else 1))


def _pallas_problem() -> str | None:
    try:
        from jax.experimental.pallas import tpu  # noqa: F401
    except ImportError as e:  # pragma: no cover - every supported jax ships it
        return f"jax's Pallas TPU module (jax.experimental.pallas.tpu), which did not import ({e})"
    return None


def missing() -> str | None:
    """What the kernel needs that this process lacks, or None when it can lower."""
    problem = _pallas_problem()
    if problem is not None:
        return problem
    try:
        cache.find_source(KERNEL_SOURCE)
    except FileNotFoundError as e:
        return str(e)
    return None


@functools.cache
def kernel_module():
    """kernels/tpu/rope_cache_pallas.py (shipped in the package, or beside it in a checkout)."""
    name = "jax_rope_cache._tpu_kernel"
    spec = importlib.util.spec_from_file_location(name, cache.find_source(KERNEL_SOURCE))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def layouts() -> tuple[str, ...]:
    """The cache layouts of contract.LAYOUT_TABLE the kernel writes (token rows [KH, D] or K and V
    interleaved [2KH, D], D last)."""
    K = kernel_module()
    ok = []
    for name, lay in contract.LAYOUT_TABLE.items():
        try:
            K.row_dma(lay.key_axes), K.row_dma(lay.value_axes)
        except ValueError:
            continue
        ok.append(name)
    return tuple(ok)


def unsupported(spec: contract.OpSpec) -> list[str]:
    """What of this call the TPU kernel does not implement (besides contract.FEATURES), in words."""
    out = []
    if np.dtype(spec.dtype) not in DTYPES:
        out.append(f"{np.dtype(spec.dtype).name} inputs (bfloat16, float16 and float32 are implemented)")
    if np.dtype(spec.table_dtype) not in DTYPES:
        out.append(f"{np.dtype(spec.table_dtype).name} cos/sin tables")
    if spec.layout not in layouts():
        out.append(f"layout {spec.layout!r} (implemented: {', '.join(layouts())})")
    if spec.precision == "native" and not (np.dtype(spec.dtype) == np.dtype(spec.table_dtype)
                                           and np.dtype(spec.dtype) in ROUNDED):
        out.append("precision='native' other than with bfloat16 or float16 inputs and tables of that dtype (its "
                   "\"fused\" arithmetic: a correctly rounded FMA)")
    if spec.num_slots > INT32_MAX:
        out.append(f"caches of {spec.num_slots} >= 2**31 slots (int32 scalar indices)")
    if spec.num_tokens > max_tokens(spec):
        out.append(f"calls of {spec.num_tokens} > {max_tokens(spec)} tokens (slots and positions are scalar "
                   "prefetch in SMEM; split the call)")
    return out


def refuse(spec: contract.OpSpec) -> None:
    """native.KernelUnavailable (from a NotImplementedError naming what) when the kernel does not
    implement this call."""
    native.refuse_unsupported(spec, SUPPORTS, NAME)
    what = unsupported(spec)
    if what:
        text = "; ".join(what)
        raise native.KernelUnavailable(f"a kernel with {text}, which the {NAME} kernel does not implement yet") from (
            NotImplementedError(f"rope_and_cache: impl='kernel' on {NAME}: the kernel does not implement {text} yet; "
                                "use impl=None (the XLA implementation then runs) or impl='xla'"))


def config(spec: contract.OpSpec):
    """The kernel's static Config of a call."""
    K = kernel_module()
    lay = contract.LAYOUT_TABLE[spec.layout]
    w = spec.rotary_dim if spec.table_full else spec.rotary_dim // 2
    return K.Config(
        tokens=spec.num_tokens, q_heads=spec.q_heads, kv_heads=spec.kv_heads, head_dim=spec.head_dim,
        rotary_dim=spec.rotary_dim, block_size=spec.block_size, num_blocks=spec.num_blocks,
        num_layers=spec.num_layers or 0, max_pos=spec.max_pos, neox=spec.is_neox, full_table=spec.table_full,
        rounded=spec.precision == "native", q_norm=spec.q_norm_dtype is not None or spec.norm_type == "weightless",
        k_norm=spec.k_norm_dtype is not None or spec.norm_type == "weightless", norm_type=spec.norm_type,
        norm_after=spec.norm_after, rotary_tail=spec.rotary_tail, rope_switch=spec.rope_switch,
        temperature=spec.temperature[0] if spec.temperature is not None else 0,
        norm_eps=float(spec.norm_eps), key_axes=lay.key_axes, value_axes=lay.value_axes,
        block_tokens=K.block_tokens(spec.num_tokens, spec.qkv_heads if spec.qkv else spec.q_heads, spec.kv_heads,
                                    spec.head_dim, np.dtype(spec.dtype).itemsize, w, np.dtype(spec.table_dtype).itemsize,
                                    merged=K.row_dma(lay.key_axes) == "merged", quant=spec.fp8 or spec.low_bit,
                                    streams=3 if spec.mrope_section is not None else 1,
                                    block_scales=spec.cache_format is not None),
        mrope=spec.mrope_section, mrope_interleaved=spec.mrope_interleaved, qkv=spec.qkv, q_gate=spec.q_gate,
        cache_dtype=spec.cache_format or ("int4" if spec.int4 else np.dtype(spec.cache_dtype).name
                                          if spec.fp8 or spec.int8 else ""),
        token_scales=spec.token_scales, scale_axes=lay.scale_axes)


def _index32(slots, positions, spec: contract.OpSpec):
    """int32 slots and positions with the contract's meaning: a wider slot outside [0, NB*BS) is
    -1 (never wrapped into a valid one), a wider position clamped first. int32 ones go as they are
    (the kernel checks and clamps them)."""
    if slots.dtype != jnp.int32:
        slots = jnp.where((slots >= 0) & (slots < spec.num_slots), slots, -1).astype(jnp.int32)
    if positions.dtype != jnp.int32:
        positions = jnp.clip(positions, 0, spec.max_pos - 1).astype(jnp.int32)
    return slots, positions


def kernel_fn(spec: contract.OpSpec, interpret=None):
    """The op on the primitive's 14 operands (contract.OPERANDS) as jax code around the kernel."""
    K = kernel_module()
    cfg = config(spec)

    def op(q, k, v, key_cache, value_cache, slots, positions, cos, sin, k_scale, v_scale, layer, q_norm_weight,
           k_norm_weight, *extra):
        extra = dict(zip(contract.extra_operands(spec), extra))
        if spec.num_tokens == 0:
            outs = (q[:, :spec.q_heads], q[:, :spec.kv_heads]) if spec.qkv else (q, k)
            return outs + (key_cache, value_cache) + ((k_scale, v_scale) if spec.token_scales else ())
        slots, positions = _index32(slots, positions, spec)
        positions = jnp.reshape(positions, (-1,))  # M-RoPE [3, T]: stream-major
        if spec.fp8 and not spec.token_scales:  # static scales as [KH, 1] f32 (a scalar broadcast)
            k_scale, v_scale = (jnp.broadcast_to(jnp.reshape(s, (-1, 1)).astype(jnp.float32), (spec.kv_heads, 1))
                                for s in (k_scale, v_scale))
        elif not spec.token_scales:  # no scales at all
            k_scale = v_scale = None
        scale_dtype = None
        if spec.cache_format is not None:  # block-scale caches as their bytes (uint8: plain Mosaic memrefs)
            scale_dtype = k_scale.dtype
            k_scale, v_scale = (lax.bitcast_convert_type(s, jnp.uint8) for s in (k_scale, v_scale))
        glob = None
        if spec.cache_format == "nvfp4":
            glob = jnp.stack([jnp.reshape(extra[n], ()).astype(jnp.float32)
                              for n in ("k_global_scale", "v_global_scale")])
        out = K.rope_and_cache(
            q, k, v, key_cache, value_cache, slots, positions, cos, sin, jnp.reshape(layer, (1,)).astype(jnp.int32),
            q_norm_weight if cfg.q_norm else None, k_norm_weight if cfg.k_norm else None, k_scale, v_scale,
            jnp.reshape(extra["use_rope"], (1,)).astype(jnp.int32) if spec.rope_switch else None,
            extra.get("temperature_factors"), glob, cfg=cfg, interpret=interpret or False)
        if scale_dtype is None:
            return out
        return out[:4] + tuple(lax.bitcast_convert_type(s, scale_dtype) for s in out[4:])

    return op


def lower(ctx, args, spec: contract.OpSpec):
    refuse(spec)
    fn = kernel_fn(spec)
    try:
        return mlir.lower_fun(fn, multiple_results=True)(ctx, *args)
    except Exception as e:  # noqa: BLE001 - Pallas/Mosaic raise several types; impl="kernel" re-raises it as is
        raise native.KernelUnavailable(f"a configuration Mosaic's lowering accepts ({type(e).__name__}: {e})") from e
