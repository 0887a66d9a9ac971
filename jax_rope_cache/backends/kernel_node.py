"""The CUDA kernel as a plain kernel node in XLA's graph: XLA's PTX custom call.

XLA:GPU compiles a custom call whose target is `__gpu$xla.gpu.ptx` into its own kernel thunk
(CustomKernelThunk): the PTX in the call's backend config is loaded by XLA, the kernel is launched
with the call's buffers as its arguments (every operand, then every result, one device pointer
each; an aliased result is passed again with the operand's address), and inside a command buffer it
is recorded as an ordinary kernel node whose arguments XLA updates in place when buffers move. An
FFI custom call with the command-buffer trait is instead re-traced (its handler re-run under stream
capture) whenever its buffer addresses miss XLA's trace cache, which costs several microseconds a
call in a decode loop.

Backend config (an MLIR dictionary, the custom call's attributes): name (the entry's symbol),
kernel_type "ptx", kernel_data (the PTX text), grid_x/y/z, block_x/y/z, shared_mem_bytes. The target
is internal to XLA (undocumented; cubin is rejected, PTX only), so its use is feature-detected:

  JAX_ROPE_CACHE_KERNEL_NODE=auto (default)  the route where the running CUDA PJRT plugin compiles
                                   the target (its library holds the target's name) and the local
                                   driver accepts the PTX's ISA version; otherwise the FFI launcher
                                   (backends/launcher.py). Without a CUDA plugin (lowering for
                                   "cuda" on a CPU machine, e.g. jax.export) the FFI launcher.
  JAX_ROPE_CACHE_KERNEL_NODE=1       the route whenever a CUDA lowering can use it (also without a
                                   plugin: export for a jaxlib that has it)
  JAX_ROPE_CACHE_KERNEL_NODE=0       always the FFI launcher

The variable is read at lowering time. A call of zero tokens always takes the launcher (an empty
grid is not a valid launch).
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import mmap
import os
import re

import jax
import numpy as np

from jax_rope_cache import contract
from jax_rope_cache.backends import launcher

TARGET = "__gpu$xla.gpu.ptx"
ENV = "JAX_ROPE_CACHE_KERNEL_NODE"
_PLUGIN_PACKAGES = ("jax_plugins.xla_cuda13", "jax_plugins.xla_cuda12")


def setting() -> str:
    """"auto", "on" or "off" from JAX_ROPE_CACHE_KERNEL_NODE (anything else: a ValueError naming it)."""
    raw = os.environ.get(ENV, "auto").strip().lower()
    if raw in ("", "auto"):
        return "auto"
    if raw in ("1", "on", "true", "yes"):
        return "on"
    if raw in ("0", "off", "false", "no"):
        return "off"
    raise ValueError(f"{ENV}: expected auto, 1 or 0, got {os.environ.get(ENV)!r}")


@functools.cache
def plugin_library() -> str | None:
    """The shared library of the installed CUDA PJRT plugin, or None."""
    for name in _PLUGIN_PACKAGES:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            continue
        for d in (spec.submodule_search_locations or []) if spec else []:
            for f in sorted(os.listdir(d)) if os.path.isdir(d) else []:
                if f.endswith(".so") and "plugin" in f:
                    return os.path.join(d, f)
    return None


@functools.cache
def library_has_target(path: str) -> bool:
    """True when the library's bytes hold the target's name (the emitter that compiles it)."""
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            return m.find(TARGET.encode()) >= 0
    except (OSError, ValueError):
        return False


def plugin_supports() -> bool:
    """The running CUDA plugin compiles `__gpu$xla.gpu.ptx` (see the module docstring)."""
    path = plugin_library()
    return path is not None and library_has_target(path)


@functools.cache
def driver_version() -> int | None:
    """The CUDA driver's version (e.g. 13000), or None where no driver loads."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        v = ctypes.c_int()
        return v.value if lib.cuDriverGetVersion(ctypes.byref(v)) == 0 and v.value > 0 else None
    except (OSError, AttributeError):
        return None


def ptx_isa(ptx: bytes | str) -> tuple[int, int] | None:
    """The `.version` of a PTX text, or None."""
    text = ptx.decode(errors="replace") if isinstance(ptx, bytes) else ptx
    m = re.search(r"^\s*\.version\s+(\d+)\.(\d+)", text[:4096], re.M)
    return (int(m.group(1)), int(m.group(2))) if m else None


# The newest PTX ISA each CUDA driver release JIT-compiles (CUDA 12.x: the PTX ISA release notes; a
# 13.x driver: ISA 9.minor). Drivers newer than this table accept every ISA NVRTC 13 writes.
_ISA_OF_CUDA_12 = {0: (8, 0), 1: (8, 1), 2: (8, 2), 3: (8, 3), 4: (8, 4), 5: (8, 5), 6: (8, 5), 8: (8, 7), 9: (8, 8)}


def driver_isa(version: int) -> tuple[int, int] | None:
    """The newest PTX ISA a driver of `version` (cuDriverGetVersion) loads; None: no known bound."""
    major, minor = version // 1000, version % 1000 // 10
    if major < 12:
        return (7, 0) if major == 11 else (6, 0)
    if major == 12:
        return _ISA_OF_CUDA_12.get(minor, (8, 5))
    if major == 13:
        return (9, minor)
    return None


def driver_accepts(ptx: bytes | str) -> bool:
    """False only where a local driver is known to be too old for the PTX's ISA version."""
    version, isa = driver_version(), ptx_isa(ptx)
    if version is None or isa is None:
        return True
    bound = driver_isa(version)
    return bound is None or isa <= bound


def wanted() -> tuple[bool, str]:
    """(a CUDA call may be lowered as a kernel node, why): the setting and the plugin, before any PTX
    is built."""
    mode = setting()
    if mode == "off":
        return False, f"{ENV}=0"
    if mode == "on":
        return True, f"{ENV}=1"
    if not plugin_supports():
        return False, ("no CUDA PJRT plugin is installed" if plugin_library() is None
                       else f"the CUDA PJRT plugin ({plugin_library()}) does not compile {TARGET}")
    return True, "the CUDA PJRT plugin compiles it"


def decide(ptx: bytes | str) -> tuple[bool, str]:
    """(lower this call as a kernel node, why) for a call whose node PTX is `ptx`: wanted(), and under
    auto a local driver that loads the PTX's ISA version."""
    use, why = wanted()
    if use and setting() == "auto" and not driver_accepts(ptx):
        return False, (f"the CUDA driver ({driver_version()}) is older than the PTX ISA "
                       f"{'.'.join(map(str, ptx_isa(ptx) or ()))} NVRTC wrote")
    return use, why


def lower(ctx, args, *, ptx: bytes | str, kernel: str, grid: tuple[int, int, int], block: int,
          aliases: dict[int, int] | None = None, fenced: tuple[int, ...] | None = None):
    """The call as XLA's PTX custom call: `kernel` of `ptx` on `grid` blocks of `block` threads, its
    arguments the 14 operands, the extra operands of the call (contract.extra_operands: use_rope,
    temperature_factors, NVFP4's k_global_scale / v_global_scale; rope_cache_node takes them after the 14) then the results (4, or 6 with per-token
    scales), the caches (and scale
    caches) aliased in place (`aliases`, operand -> result; None: contract.CACHE_ALIASES). The small
    operands (`fenced`: their indices; None: the launcher's default) go through the same optimization
    barrier as the launcher's call."""
    text = ptx.decode() if isinstance(ptx, bytes) else ptx
    text = text.rstrip("\0")
    if any(not 1 <= g <= 2**31 - 1 for g in grid) or grid[1] > 65535 or grid[2] > 65535 or not 1 <= block <= 1024:
        raise ValueError(f"rope_and_cache (internal): launch geometry grid={grid} block={block} is out of range")
    rule = jax.ffi.ffi_lowering(TARGET, operand_output_aliases=contract.CACHE_ALIASES if aliases is None else aliases)
    i32 = np.int32
    args = launcher.fence_small_operands(args) if fenced is None else launcher.fence_small_operands(args, fenced)
    return rule(ctx, *args, name=kernel, kernel_type="ptx", kernel_data=text,
                grid_x=i32(grid[0]), grid_y=i32(grid[1]), grid_z=i32(grid[2]), block_x=i32(block), block_y=i32(1),
                block_z=i32(1), shared_mem_bytes=i32(0))
