"""impl="kernel" of the MLA op per platform: the CPU handler, the CUDA kernel (NVRTC), the FlyDSL
kernel (ROCm). Availability (`missing()`) is each platform backend's own (backends/cpu.py, cuda.py,
rocm.py): the same extension, NVRTC and FlyDSL serve both ops. The GPU kernels launch through the
main op's launcher and lowering helper (backends/launcher.lower_launch), so the MLA op takes
whatever route the main op's GPU lowering takes.
"""

from __future__ import annotations

import dataclasses

import jax

from jax_rope_cache.backends import cpu, cuda, launcher, native, rocm
from jax_rope_cache.compilers import nvrtc
from jax_rope_cache.mla import contract as mla_contract
from jax_rope_cache.mla.contract import MlaSpec

MLA_BACKENDS = {"cpu": cpu, "cuda": cuda, "rocm": rocm}


# ---- CPU -------------------------------------------------------------------------------------------
CPU_TARGET = cpu.MLA_TARGET


def lower_cpu(ctx, args, spec: MlaSpec):
    native.register_target(CPU_TARGET, native.native_module().mla_cpu_handler, "cpu")
    rule = jax.ffi.ffi_lowering(CPU_TARGET, operand_output_aliases=mla_contract.cache_aliases(spec.layout))
    return rule(ctx, *args, is_neox=bool(spec.is_neox), native=spec.precision == "native")


# ---- CUDA ------------------------------------------------------------------------------------------
CUDA_KERNEL = "mla_cache_kernel"
MAX_PARTS = 64
# Latency regime (fewer than ~2 tokens per SM): one token per block, its units spread over up to
# MAX_PARTS blocks of LATENCY_NT threads, one unit per thread while the grid fits the GPU's resident
# threads (RESIDENT_BLOCKS blocks per SM): a thread with a copy unit and a rotation unit would run
# their memory latencies back to back (DeepSeek-V3 TP8 at T = 64: 5 parts, 2.81 us). Bandwidth
# regime: ~UNITS_PER_BLOCK units per block, threads sized so that every thread's copy units are one
# round of at most UNROLL (every load, then every store: MLA_UNROLL = the round's units), between
# MIN_NT and MAX_NT threads. A round left over for a few threads (DeepSeek-V3 TP8 with 256 threads:
# 1088 copy units, 4 + 1 per thread) adds a whole memory latency to the block's life with few bytes
# in flight; 288 threads take them in one round of 4 (an UNROLL of 5 instead costs 51-56 registers
# against 39-43: four resident blocks per SM instead of five or six).
LATENCY_NT = 128
RESIDENT_BLOCKS = 2048 // LATENCY_NT
MIN_NT, MAX_NT = 128, 512
UNITS_PER_BLOCK = 2048
UNROLL = 4
MAX_UNROLL = 8  # where MAX_NT threads are too few for rounds of UNROLL


@dataclasses.dataclass(frozen=True)
class MlaCudaConfig:
    defines: tuple[tuple[str, int], ...]
    tokens_per_block: int
    threads: int
    parts: int

    def options(self) -> list[str]:
        return [f"-D{k}={v}" for k, v in self.defines]


def _width(max_elems: int, *divides: int, even: bool = False) -> int:
    w = max_elems
    while w > 1 and any(d % w for d in divides):
        w //= 2
    return max(w, 2) if even else w


def chunk_widths(spec: MlaSpec) -> tuple[int, int]:
    """(MLA_W, MLA_RW): 16 bytes of input where the widths allow."""
    m = 16 // spec.dtype.itemsize
    w = _width(m, spec.nope_dim, spec.latent_dim, spec.rope_dim)
    rw = _width(m, spec.rope_dim // 2) if spec.is_neox else _width(m, spec.rope_dim, even=True)
    return w, rw


def copy_units_per_token(spec: MlaSpec, w: int) -> int:
    return spec.q_heads * (spec.nope_dim // w) + spec.latent_dim // w


def units_per_token(spec: MlaSpec, w: int, rw: int) -> int:
    p = (spec.rope_dim // 2) // rw if spec.is_neox else spec.rope_dim // rw
    return copy_units_per_token(spec, w) + (spec.q_heads + 1) * p


def _pow2_floor(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)


def mla_kernel_config(spec: MlaSpec, num_sms: int = cuda.DEFAULT_SMS, unroll: int | None = None) -> MlaCudaConfig:
    """The static configuration of one call (kernels/cuda/mla_cache.cu's header lists the -D names)."""
    w, rw = chunk_widths(spec)
    upt = units_per_token(spec, w, rw)
    t = max(1, spec.num_tokens)
    if t < 2 * num_sms:  # latency: one token per block, its units over several blocks
        nt, tpb = LATENCY_NT, 1
        parts = max(1, min(MAX_PARTS, -(-upt // nt), max(-(-2 * num_sms // t), RESIDENT_BLOCKS * num_sms // t)))
        per_part = -(-upt // parts)
        nt = min(nt, max(32, -(-per_part // 32) * 32))
    else:
        parts = 1
        tpb = max(1, min(64, _pow2_floor(UNITS_PER_BLOCK // upt)))
        nt = max(MIN_NT, min(MAX_NT, -(-tpb * copy_units_per_token(spec, w) // (UNROLL * 32)) * 32))
    minb = max(1, 1024 // nt)  # registers for 1024 resident threads per SM (64 each at 256 threads)
    if unroll is None:  # each thread's copy units in one round
        unroll = max(1, min(MAX_UNROLL, -(-tpb * copy_units_per_token(spec, w) // (nt * parts))))
    c = mla_contract.kernel_codes(spec)
    defines = (("MLA_QH", c.qh), ("MLA_DN", c.dn), ("MLA_DC", c.dc), ("MLA_DR", c.dr), ("MLA_BS", c.bs),
               ("MLA_SPLIT_CACHE", int(c.split)), ("MLA_NEOX", int(c.neox)), ("MLA_FULL_TABLE", int(c.full_table)),
               ("MLA_NATIVE", int(c.native)), ("MLA_DT", c.dt), ("MLA_TAB_DT", c.tab_dt), ("MLA_CACHE_DT", c.cache_dt),
               ("MLA_Q_DT", c.q_dt), ("MLA_SLOT64", int(c.slot64)), ("MLA_POS64", int(c.pos64)),
               ("MLA_LAYER_BLOCKS", c.layer_blocks), ("MLA_W", w), ("MLA_RW", rw), ("MLA_TPB", tpb), ("MLA_NT", nt),
               ("MLA_PARTS", parts), ("MLA_MINB", minb), ("MLA_UNROLL", unroll))
    return MlaCudaConfig(defines=defines, tokens_per_block=tpb, threads=nt, parts=parts)


def compile_mla(cfg: MlaCudaConfig, arch: str) -> nvrtc.Compiled:
    """NVRTC-compiles one variant for `arch` ("sm_90" or "compute_90"), through the package's caches."""
    src, headers = cuda.kernel_sources("mla_cache.cu")
    opts = list(cuda.BASE_OPTIONS) + cfg.options()
    if arch.startswith("compute_"):
        opts.remove("--ptxas-options=-v")
    return nvrtc.compile_cuda(src, arch=arch, options=opts, headers=headers, name="mla_cache.cu")


def build_cuda_table(cfg: MlaCudaConfig, cc: int | None) -> bytes:
    """cubin for the GPU's arch (sm_90 without a GPU) + PTX fallback, as the main op's table."""
    supported = nvrtc.supported_archs() or [cuda.DEFAULT_ARCH]
    target = cc if cc is not None else cuda.DEFAULT_ARCH
    entries = []
    if target in supported:
        entries.append((launcher.KIND_CUBIN, f"sm_{target}", compile_mla(cfg, f"sm_{target}").code))
        ptx_arch = target
    else:
        ptx_arch = max((a for a in supported if a <= target), default=min(supported))
    entries.append((launcher.KIND_PTX, f"compute_{ptx_arch}", compile_mla(cfg, f"compute_{ptx_arch}").code))
    return launcher.pack_code_table(entries)


def _launch_options(spec: MlaSpec) -> dict:
    names = mla_contract.operands(spec.layout)
    res = tuple(f"{r} result" if r in names else r for r in mla_contract.results(spec.layout))
    return dict(aliases=mla_contract.cache_aliases(spec.layout), fenced=mla_contract.fenced_operands(spec.layout),
                buffer_names=",".join(names + res))


def lower_cuda(ctx, args, spec: MlaSpec):
    cc, sms = cuda._local_cuda_arch()
    cfg = mla_kernel_config(spec, sms)
    return launcher.lower_launch(ctx, args, table=build_cuda_table(cfg, cc), kernel=CUDA_KERNEL,
                                 grid_div=cfg.tokens_per_block, block=cfg.threads, grid_y=cfg.parts,
                                 **_launch_options(spec))


# ---- ROCm ------------------------------------------------------------------------------------------
def lower_rocm(ctx, args, spec: MlaSpec):
    from jax_rope_cache.mla import rocm_kernel

    return rocm_kernel.lower(ctx, args, spec, _launch_options(spec))


def lowering(platform: str):
    """The kernel lowering `(ctx, args, spec)` of the MLA op on `platform`."""
    return {"cpu": lower_cpu, "cuda": lower_cuda, "rocm": lower_rocm}[platform]


__all__ = ["MLA_BACKENDS", "lowering", "mla_kernel_config", "compile_mla", "build_cuda_table"]
