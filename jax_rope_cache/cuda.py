"""impl="kernel" on NVIDIA GPUs: lowering of rope_cache_p for platform "cuda".

At lowering time the CUDA kernel (kernels/cuda/rope_cache.cu, shipped inside the package) is
compiled by NVRTC for the local GPU's architecture (cubin) plus PTX of the same architecture as a
fallback (a GPU of a newer architecture JIT-compiles it); without a visible CUDA device: sm_90 +
compute_90. Compiled code objects are cached in memory and on disk (jax_rope_cache._nvrtc).
The code objects travel inside the executable as the `code` attribute of the custom call; the
generic GPU launcher (kernels/ffi/gpu_launcher.cc) loads and launches them.

Environment:
  JAX_ROPE_CACHE_COMMAND_BUFFERS=0   register/use the launcher's execute stage WITHOUT the
                                     command-buffer trait (XLA then never captures the call into
                                     a CUDA/HIP graph; use it where graph replay misbehaves)
  JAX_ROPE_CACHE_DIR                 on-disk cache of compiled code objects
                                     (default ~/.cache/jax_rope_cache; "" disables it)
  JAX_ROPE_CACHE_NVRTC               path of a libnvrtc.so to use instead of searching
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
import struct

import jax
import numpy as np
from jaxlib import xla_client as jax_xla_client
from jax.interpreters import mlir

from jax_rope_cache import _ffi, _nvrtc, _spec

GPU_TARGET = "jax_rope_cache_gpu"
GPU_TARGET_NO_GRAPH = "jax_rope_cache_gpu_nograph"
KERNEL_NAME = "rope_cache_kernel"
DEFAULT_ARCH = 90
DEFAULT_SMS = 132


_PKG_DIR = os.path.dirname(os.path.abspath(__file__))


def _find_source(rel: str) -> str:
    for base in (os.path.join(_PKG_DIR, "kernels"), os.path.join(os.path.dirname(_PKG_DIR), "kernels")):
        p = os.path.join(base, rel)
        if os.path.exists(p):
            return p
    raise FileNotFoundError(f"rope_and_cache: kernel source {rel} is not installed with jax_rope_cache "
                            f"(looked under {_PKG_DIR}/kernels); reinstall the package")


@functools.cache
def kernel_sources() -> tuple[str, dict[str, str]]:
    """(rope_cache.cu text, {include name: header text})."""
    with open(_find_source("cuda/rope_cache.cu")) as f:
        src = f.read()
    with open(_find_source("common/rope_cache_math.h")) as f:
        hdr = f.read()
    return src, {"rope_cache_math.h": hdr}


def command_buffers_enabled() -> bool:
    return os.environ.get("JAX_ROPE_CACHE_COMMAND_BUFFERS", "1").strip().lower() not in ("0", "false", "off", "no")


# ---- the static configuration of one variant ----------------------------------------------------
@dataclasses.dataclass(frozen=True)
class KernelConfig:
    defines: tuple[tuple[str, int], ...]
    tokens_per_block: int
    threads: int

    def options(self) -> list[str]:
        return [f"-D{k}={v}" for k, v in self.defines]


def chunk_width(spec: _spec.OpSpec) -> int:
    """Elements per vector access: 16 bytes of q/k/v where D, R (and R/2 for NeoX) allow."""
    s_in = np.dtype(spec.dtype).itemsize
    w = 16 // s_in
    d, r = spec.head_dim, spec.rotary_dim
    while w > 1:
        if d % w == 0 and r % w == 0 and (not spec.is_neox or (r // 2) % w == 0):
            break
        w //= 2
    if not spec.is_neox and w < 2:
        w = 2  # D and R are even
    return w


def _pow2_floor(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)


MAX_THREADS = 512  # threads per block (a block's units beyond this loop)
UNITS_PER_BLOCK = 2048  # flash: a block's units (~4-6 per thread), measured best on the H200
UNITS_PER_BLOCK_XP = 8192  # x-packed (up to 32 tokens: two whole runs of 16 slots per block)


def kernel_config(spec: _spec.OpSpec, num_sms: int = DEFAULT_SMS) -> KernelConfig:
    """One thread per unit of work (kernels/cuda/rope_cache.cu: rotation, pass-through and V units).
    A block owns RC_TPB tokens; a large call gives each thread several units in turn (fewer, longer
    blocks: 8-15% faster than one unit per thread on the H200, benchmarks/gpu_speed.py). A small
    call (decode) gets one token per block, so the grid spreads over the SMs and every thread does
    one unit: latency, not bandwidth."""
    w = chunk_width(spec)
    d, r, qh, kh = spec.head_dim, spec.rotary_dim, spec.q_heads, spec.kv_heads
    rh = qh + kh
    x = spec.x
    xp = spec.layout != "flash"
    units_tok = rh * ((r // 2) // w if spec.is_neox else r // w) + rh * ((d - r) // w)

    def units(tpb):  # units of a block of tpb tokens (x-packed V: one per channel per group)
        vg = (x if tpb % x == 0 else tpb) if xp else 1
        return tpb * units_tok + ((tpb // vg) * kh * d if xp else tpb * kh * (d // w))

    per_token = max(1.0, units_tok + (kh * d / x if xp else kh * (d // w)))
    # Threads: a block of one unit per thread (up to MAX_THREADS; x-packed: at least X tokens).
    base = max(1, min(64, _pow2_floor(int(MAX_THREADS // per_token))))
    if xp:
        base = max(base, x)
    nt = min(MAX_THREADS, max(32, -(-units(base) // 32) * 32))
    # Tokens per block: several units per thread for large calls.
    target = UNITS_PER_BLOCK_XP if xp else UNITS_PER_BLOCK
    tpb = max(base, min(32, _pow2_floor(int(target // per_token))))
    # Small T: keep at least one block per SM (down to one token per block, one unit per thread).
    t = spec.num_tokens
    while tpb > 1 and -(-t // tpb) < num_sms:
        tpb //= 2
    nt = min(nt, max(32, -(-units(tpb) // 32) * 32))
    minb = max(1, 768 // nt)  # register budget: at least 85 per thread (no spills in the CI matrix)
    defines = (
        ("RC_QH", qh), ("RC_KH", kh), ("RC_D", d), ("RC_R", r), ("RC_BS", spec.block_size),
        ("RC_LAYOUT", _ffi.LAYOUT_CODES[spec.layout]), ("RC_NEOX", int(spec.is_neox)),
        ("RC_FULL_TABLE", int(spec.table_full)),
        ("RC_NATIVE", int(spec.precision == "native" and np.dtype(spec.dtype) != np.float32)),
        ("RC_DT", _spec.DTYPE_CODES[np.dtype(spec.dtype)]),
        ("RC_TAB_DT", _spec.DTYPE_CODES[np.dtype(spec.table_dtype)]),
        ("RC_CACHE_DT", _spec.DTYPE_CODES[np.dtype(spec.cache_dtype)]),
        ("RC_SLOT64", int(np.dtype(spec.slot_dtype).itemsize == 8)),
        ("RC_POS64", int(np.dtype(spec.pos_dtype).itemsize == 8)),
        ("RC_LAYER_BLOCKS", spec.num_blocks if spec.num_layers is not None else 0),
        ("RC_WCH", w), ("RC_TPB", tpb), ("RC_NT", nt), ("RC_MINB", minb), ("RC_VPAIRS", 1),
    )
    return KernelConfig(defines=defines, tokens_per_block=tpb, threads=nt)


BASE_OPTIONS = ("--std=c++17", "--fmad=false", "--ptxas-options=-v", "--device-as-default-execution-space")


def compile_variant(cfg: KernelConfig, arch: str) -> _nvrtc.Compiled:
    """NVRTC-compiles one variant for `arch` ("sm_90" or "compute_90"), through the caches."""
    src, headers = kernel_sources()
    opts = list(BASE_OPTIONS) + cfg.options()
    if arch.startswith("compute_"):
        opts.remove("--ptxas-options=-v")
    return _nvrtc.compile_cuda(src, arch=arch, options=opts, headers=headers, name="rope_cache.cu")


# ---- the code-object table (format: kernels/ffi/gpu_launcher.cc) --------------------------------
KIND_CUBIN, KIND_PTX, KIND_AMDGPU = 1, 2, 3


def pack_code_table(entries: list[tuple[int, str, bytes]]) -> bytes:
    header = b"JRCCODE1" + struct.pack("<II", len(entries), 0)
    offset = len(header) + 40 * len(entries)
    rows, blobs = [], []
    for kind, arch, data in entries:
        if kind == KIND_PTX and not data.endswith(b"\0"):
            data += b"\0"
        a = arch.encode()
        if len(a) > 15:
            raise ValueError(f"arch name too long: {arch}")
        rows.append(struct.pack("<II16sQQ", kind, 0, a, offset, len(data)))
        blobs.append(data)
        offset += len(data)
        pad = (-offset) % 16
        blobs.append(b"\0" * pad)
        offset += pad
    return header + b"".join(rows) + b"".join(blobs)


def unpack_code_table(table: bytes) -> list[tuple[int, str, bytes]]:
    """The (kind, arch, data) entries of a table made by pack_code_table (PTX data keeps its NUL)."""
    if table[:8] != b"JRCCODE1":
        raise ValueError("code table: bad magic")
    count = struct.unpack_from("<I", table, 8)[0]
    entries = []
    for i in range(count):
        kind, _, arch, offset, size = struct.unpack_from("<II16sQQ", table, 16 + 40 * i)
        entries.append((kind, arch.rstrip(b"\0").decode(), table[offset:offset + size]))
    return entries


def code_hash(table: bytes) -> int:
    return int.from_bytes(hashlib.sha256(table).digest()[:8], "little", signed=True)


def _local_cuda_arch() -> tuple[int | None, int]:
    """(compute capability as 90, 100, ... or None without a CUDA device, SM count)."""
    try:
        dev = jax.devices("cuda")[0]
    except Exception:  # noqa: BLE001 - no CUDA backend
        return None, DEFAULT_SMS
    cc = getattr(dev, "compute_capability", None)
    sms = getattr(dev, "core_count", None) or DEFAULT_SMS
    if not cc:
        return None, sms
    major, minor = str(cc).split(".")[:2]
    return int(major) * 10 + int(minor), int(sms)


def build_code_table(cfg: KernelConfig, cc: int | None) -> bytes:
    """cubin for the GPU's arch (sm_90 without a GPU) + PTX fallback, packed as a table."""
    supported = _nvrtc.supported_archs() or [DEFAULT_ARCH]
    target = cc if cc is not None else DEFAULT_ARCH
    entries = []
    if target in supported:
        c = compile_variant(cfg, f"sm_{target}")
        entries.append((KIND_CUBIN, f"sm_{target}", c.code))
        ptx_arch = target
    else:  # a GPU newer than this NVRTC: PTX of the newest arch it knows, JIT-compiled by the driver
        ptx_arch = max(a for a in supported if a <= target) if any(a <= target for a in supported) else min(supported)
    p = compile_variant(cfg, f"compute_{ptx_arch}")
    entries.append((KIND_PTX, f"compute_{ptx_arch}", p.code))
    return pack_code_table(entries)


# ---- registration and lowering ------------------------------------------------------------------
def _register(name: str, capsules, platform: str, graph: bool) -> None:
    # XLA takes a target's command-buffer trait from its registration (the execute handler also
    # declares it), so the graph-compatible target is registered with that trait here.
    with _ffi._lock:
        if (name, platform) in _ffi._registered:
            return
        kwargs = {}
        traits = getattr(getattr(jax_xla_client, "CustomCallTargetTraits", None), "COMMAND_BUFFER_COMPATIBLE", None)
        if graph and traits is not None:
            kwargs["traits"] = traits
        jax.ffi.register_ffi_target(name, capsules(), platform=platform, api_version=1, **kwargs)
        _ffi._registered.add((name, platform))


def _register_gpu_targets(module) -> str:
    """Registers both launcher targets for CUDA and ROCM; returns the one to use."""
    for platform in ("CUDA", "ROCM"):
        _register(GPU_TARGET, module.gpu_handler, platform, graph=True)
        _register(GPU_TARGET_NO_GRAPH, module.gpu_handler_no_graph, platform, graph=False)
    return GPU_TARGET if command_buffers_enabled() else GPU_TARGET_NO_GRAPH


LAUNCHER_MISSING = ("the compiled extension jax_rope_cache._native (with the GPU launcher), which did not import; "
                    "reinstall the package")


def launcher_module():
    """jax_rope_cache._native when it carries the GPU launcher, else None."""
    module = _ffi.native_module()
    return module if module is not None and hasattr(module, "gpu_handler") else None


def lower_launch(ctx, args, module, *, table: bytes, kernel: str, grid_div: int, block: int):
    """The launcher's custom call running `kernel` of the code-object `table` (caches in place);
    shared by the CUDA and ROCm lowerings."""
    rule = jax.ffi.ffi_lowering(_register_gpu_targets(module), operand_output_aliases=_ffi.CACHE_ALIASES)
    return rule(ctx, *args, code=table, code_hash=np.int64(code_hash(table)), kernel=kernel,
                grid_div=np.int64(grid_div), block=np.int64(block), smem=np.int64(0))


def _lower_cuda(ctx, *args, spec, impl):
    if (fallback := _ffi.kernel_or_fallback(ctx, *args, spec=spec, impl=impl, platform="cuda")) is not None:
        return fallback
    module = launcher_module()
    if module is None:
        return _ffi.kernel_unusable(ctx, *args, spec=spec, impl=impl, platform="CUDA", problem=LAUNCHER_MISSING)
    if not _nvrtc.available():
        return _ffi.kernel_unusable(ctx, *args, spec=spec, impl=impl, platform="CUDA", problem=(
            f"NVRTC (the CUDA runtime compiler), which was not found ({_nvrtc.unavailable_reason()}); "
            "install it with `pip install nvidia-cuda-nvrtc` (jax[cuda13] installs it too)"))
    cc, sms = _local_cuda_arch()
    cfg = kernel_config(spec, sms)
    return lower_launch(ctx, args, module, table=build_code_table(cfg, cc), kernel=KERNEL_NAME,
                        grid_div=cfg.tokens_per_block, block=cfg.threads)


def kernel_available() -> bool:
    """True when impl="kernel" can lower for CUDA in this process (extension + NVRTC present)."""
    return launcher_module() is not None and _nvrtc.available()


mlir.register_lowering(_ffi.rope_cache_p, _lower_cuda, platform="cuda")
if hasattr(_ffi, "register_kernel_platform"):
    _ffi.register_kernel_platform("cuda", kernel_available)
