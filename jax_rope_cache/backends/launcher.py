"""The GPU side shared by CUDA and ROCm: the code-object table format, the launcher's FFI targets
(registered for both platforms), and the custom call that launches a kernel of a table.

The launcher (kernels/ffi/gpu_launcher.cc) is generic: it loads the entry of the table that fits
the device (cubin / PTX / AMDGPU ELF for the device's gcnArchName), once per device and table
hash, and launches the named kernel on XLA's stream with the operand pointers and leading
dimensions (see rope_cache.cu's ABI). The driver it binds follows the platform the target was
registered for (CUDA -> libcuda.so.1; ROCM -> the HIP runtime the process already loaded, any
soname, else libamdhip64.so.7 / .so.6). On HIP a launch makes the call's device current and restores
the thread's device after it.

Environment:
  JAX_ROPE_CACHE_COMMAND_BUFFERS     which of the launcher's two targets the lowering uses: 1 the
                                     target with the command-buffer trait (XLA may capture the call
                                     into a CUDA/HIP graph and replay it), 0 the target without it
                                     (XLA never captures the call; the call runs as its own launch
                                     every time). Unset: 1 on CUDA, 0 on ROCm (XLA's HIP-graph
                                     replay is not trusted yet: openxla/xla#46952, a segfault
                                     replaying a HIP graph on gfx950 / ROCm 7.1). Read at lowering.
Where jax refuses the trait for a platform (a PJRT plugin without custom-call trait support), the
lowering uses the target without it and warns once.
"""

from __future__ import annotations

import functools
import hashlib
import os
import struct
import threading
import warnings

import jax
import ml_dtypes
import numpy as np
from jax.extend.mlir.dialects import stablehlo

from jax_rope_cache import contract
from jax_rope_cache.backends import native

GPU_TARGET = "jax_rope_cache_gpu"
GPU_TARGET_NO_GRAPH = "jax_rope_cache_gpu_nograph"
KIND_CUBIN, KIND_PTX, KIND_AMDGPU = 1, 2, 3
MAGIC = b"JRCCODE1"
_ENTRY = struct.Struct("<II16sQQ")  # kind, reserved, arch (NUL-padded), offset, size

MISSING = ("the compiled extension jax_rope_cache._native (with the GPU launcher), which did not import; "
           "reinstall the package")


COMMAND_BUFFERS_DEFAULT = {"CUDA": True, "ROCM": False}  # XLA platform name -> graph target by default
_ON, _OFF = ("1", "true", "on", "yes"), ("0", "false", "off", "no")


def command_buffers_enabled(platform: str = "CUDA") -> bool:
    """Whether a lowering for `platform` ("CUDA" / "ROCM", any case) uses the graph target."""
    value = os.environ.get("JAX_ROPE_CACHE_COMMAND_BUFFERS", "").strip().lower()
    if not value:
        return COMMAND_BUFFERS_DEFAULT[platform.upper()]
    if value in _ON or value in _OFF:
        return value in _ON
    raise ValueError(f"JAX_ROPE_CACHE_COMMAND_BUFFERS: expected 1 (the launcher target XLA may capture into "
                     f"CUDA/HIP graphs) or 0 (the target it never captures), or unset (1 on CUDA, 0 on ROCm), got "
                     f"{value!r}")


def launcher_module():
    """jax_rope_cache._native when it carries the GPU launcher, else None."""
    module = native.native_module()
    return module if module is not None and hasattr(module, "gpu_handler") else None


# ---- the code-object table (parsed by kernels/ffi/gpu_launcher.cc) ---------------------------
def pack_code_table(entries: list[tuple[int, str, bytes]]) -> bytes:
    """Header (magic, count, 0), one 40-byte row per entry, then the 16-byte aligned blobs."""
    header = MAGIC + struct.pack("<II", len(entries), 0)
    offset = len(header) + _ENTRY.size * len(entries)
    rows, blobs = [], []
    for kind, arch, data in entries:
        if kind == KIND_PTX and not data.endswith(b"\0"):
            data += b"\0"
        a = arch.encode()
        if len(a) > 15:
            raise ValueError(f"arch name too long: {arch}")
        rows.append(_ENTRY.pack(kind, 0, a, offset, len(data)))
        blobs.append(data)
        offset += len(data)
        pad = (-offset) % 16
        blobs.append(b"\0" * pad)
        offset += pad
    return header + b"".join(rows) + b"".join(blobs)


def unpack_code_table(table: bytes) -> list[tuple[int, str, bytes]]:
    """The (kind, arch, data) entries of a table made by pack_code_table (PTX data keeps its NUL)."""
    if table[:8] != MAGIC:
        raise ValueError("code table: bad magic")
    count = struct.unpack_from("<I", table, 8)[0]
    entries = []
    for i in range(count):
        kind, _, arch, offset, size = _ENTRY.unpack_from(table, 16 + _ENTRY.size * i)
        entries.append((kind, arch.rstrip(b"\0").decode(), table[offset:offset + size]))
    return entries


def code_hash(table: bytes) -> int:
    return int.from_bytes(hashlib.sha256(table).digest()[:8], "little", signed=True)


# ---- registration and the custom call ----------------------------------------------------------
GPU_PLATFORMS = ("CUDA", "ROCM")  # XLA's platform names; the handlers of each bind that vendor's driver


def handler_capsules(module, platform: str, command_buffers: bool):
    """The stage capsules of the launcher for `platform` ("CUDA": libcuda, "ROCM": libamdhip64)."""
    return module.gpu_handler(platform, command_buffers)


_warned: set[str] = set()
_warned_lock = threading.Lock()


def _warn_once(message: str) -> None:
    """A RuntimeWarning once per process and message, pointing at the caller's code."""
    with _warned_lock:
        if message in _warned:
            return
        _warned.add(message)
    internal = (os.path.dirname(jax.__file__), os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    warnings.warn(message, RuntimeWarning, skip_file_prefixes=internal)


def register_gpu_targets(module, platform: str = "CUDA") -> str:
    """Registers both launcher targets for CUDA and ROCM (each platform gets the handlers that bind
    its own driver); returns the target a lowering for `platform` uses (command_buffers_enabled).
    Where jax refuses the command-buffer trait, that is the target without it, with a warning."""
    rejected = {}
    for p in GPU_PLATFORMS:
        native.register_target(GPU_TARGET_NO_GRAPH, functools.partial(handler_capsules, module, p, False), p)
        try:
            native.register_target(GPU_TARGET, functools.partial(handler_capsules, module, p, True), p,
                                   command_buffers=True)
        except native.TraitsRejected as e:
            rejected[p] = str(e)
    platform = platform.upper()
    if not command_buffers_enabled(platform):
        return GPU_TARGET_NO_GRAPH
    if platform in rejected:
        _warn_once(
            f"rope_and_cache: jax refused the command-buffer trait of the launcher target for {platform} "
            f"({rejected[platform]}); the call runs outside CUDA/HIP graphs (the launcher target without the trait). "
            f"jax >= 0.11.1 with a PJRT plugin that supports custom-call traits lifts this; "
            f"JAX_ROPE_CACHE_COMMAND_BUFFERS=0 selects that target without this warning")
        return GPU_TARGET_NO_GRAPH
    return GPU_TARGET


# XLA element type numbers (xla::PrimitiveType, = ffi::DataType) of the dtypes the op's buffers use.
XLA_TYPES = {
    np.dtype(np.float32): 11, np.dtype(ml_dtypes.bfloat16): 16, np.dtype(np.float16): 10,
    np.dtype(ml_dtypes.float8_e4m3fn): 20, np.dtype(ml_dtypes.float8_e4m3fnuz): 25,
    np.dtype(ml_dtypes.float8_e5m2): 19,
    np.dtype(np.int32): 4, np.dtype(np.int64): 5,
    np.dtype(np.int8): 2, np.dtype(np.uint8): 6,  # int8 caches; int4 caches (bytes of two values)
    np.dtype(ml_dtypes.float8_e8m0fnu): 33,  # MXFP4 block-scale caches
}


def buffer_signature(avals_in, avals_out) -> np.ndarray:
    """The launcher's `signature` attribute: {n_args, n_rets, then per buffer: xla type, rank,
    dims...}. The initialize stage checks every buffer XLA hands the call against it."""
    words = [len(avals_in), len(avals_out)]
    for a in list(avals_in) + list(avals_out):
        words += [XLA_TYPES[np.dtype(a.dtype)], len(a.shape), *a.shape]
    return np.asarray(words, np.int64)


def buffer_names(spec: contract.OpSpec | None = None) -> str:
    """The launcher's `buffer_names` of rope_and_cache (operands, then results; with per-token scales
    the k_scale / v_scale operands are the scale caches, which are two more results; the call's
    contract.extra_operands follow the 14 operands)."""
    token = spec is not None and spec.token_scales
    ops = tuple({"k_scale": "k_scale_cache", "v_scale": "v_scale_cache"}.get(n, n) if token else n
                for n in contract.OPERANDS) + (contract.extra_operands(spec) if spec is not None else ())
    rets = contract.RESULTS + (contract.TOKEN_SCALE_RESULTS if token else ())
    return ",".join(ops + tuple(f"{r} result" if r in ops else r for r in rets))


BUFFER_NAMES = buffer_names()


_FENCED = tuple(contract.OPERANDS.index(n) for n in contract.FENCED_OPERANDS)


def fenced(spec: contract.OpSpec) -> tuple[int, ...]:
    """The operands fence_small_operands passes through its barrier: the FENCED_OPERANDS, less the
    k_scale / v_scale slots when they carry the scale caches (donated, updated in place: not small),
    and the use_rope switch (a scan over layers indexes it per step, like the slots)."""
    base = _FENCED if not spec.token_scales else tuple(
        i for i in _FENCED if contract.OPERANDS[i] not in ("k_scale", "v_scale"))
    extra = contract.extra_operands(spec)
    return base + tuple(len(contract.OPERANDS) + i for i, n in enumerate(extra) if n == "use_rope")


def fence_small_operands(args, fenced=_FENCED):
    """args with the FENCED_OPERANDS (or the operands at indices `fenced`) passed through one
    optimization barrier. XLA otherwise folds a
    dynamic slice feeding the call (slots[n] in a decode loop) into a dynamic-slice fusion around
    it, whose operand address changes every iteration: the command buffer is then re-recorded
    (our handler re-traced) for every call of every step. H200, the demo's decode loop (32 layers,
    Llama-3.1-8B, batch 64): 32 launcher executes and 219 us per step with the fusion, 0 and 177 us
    without (benchmarks/diagnostics/demo_trace.py). The barrier costs no copy of its own; the slice
    becomes an ordinary small fusion."""
    barrier = stablehlo.OptimizationBarrierOp([args[i] for i in fenced])
    out = list(args)
    for j, i in enumerate(fenced):
        out[i] = barrier.results[j]
    return out


def lower_launch(ctx, args, *, table: bytes, kernel: str, grid_div: int, block: int, grid_y: int = 1,
                 aliases: dict[int, int] | None = None, fenced: tuple[int, ...] | None = None,
                 buffer_names: str | None = None, platform: str = "CUDA"):
    """The launcher's custom call running `kernel` of the code-object `table` (caches in place) on a
    grid of (ceil(T / grid_div), grid_y) blocks of `block` threads. Another op than rope_and_cache
    passes its cache `aliases` (operand -> result), the indices of its `fenced` small operands and
    its `buffer_names` (operands, then results, comma-separated). `platform` ("CUDA" / "ROCM"): the
    platform lowered for (which of the launcher's two targets it uses by default)."""
    aliases = contract.CACHE_ALIASES if aliases is None else aliases
    target = register_gpu_targets(launcher_module(), platform)
    rule = jax.ffi.ffi_lowering(target, operand_output_aliases=aliases)
    return rule(ctx, *fence_small_operands(args, _FENCED if fenced is None else fenced), code=table,
                code_hash=np.int64(code_hash(table)), kernel=kernel,
                grid_div=np.int64(grid_div), grid_y=np.int64(grid_y), block=np.int64(block), smem=np.int64(0),
                signature=buffer_signature(ctx.avals_in, ctx.avals_out),
                buffer_names=BUFFER_NAMES if buffer_names is None else buffer_names)
