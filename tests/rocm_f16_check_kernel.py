"""A FlyDSL kernel that rounds f32 bit patterns to f16 with the ROCm kernel's own code, for
tests/test_rocm_f16_conversion.py (compiled by the package's FlyDSL child: flydsl.compile_module).

The conversion is `_Emitter.store_elems_pieces(vals, F16)` of kernels/rocm/rope_cache_flydsl.py,
the path of every f16 output and cache store there: f32_to_f16_bits (llvm fptrunc, NaN made
0x7FFF), PER values packed into one 16-byte store as the kernel packs an f16 chunk (gfx950 then
converts two at a time with v_cvt_pk_f16_f32, gfx942 one at a time).

Arguments (8 bytes each, kernarg segment 16 bytes): `out`, the device address of NT * PER * grid
uint16; `first`, the first f32 bit pattern of the chunk. Lane l of workgroup b writes the f16 bits
of patterns first + (b * NT + l) * PER + i (i < PER, 32-bit wrap-around) at out[(b * NT + l) * PER + i].
Imports no jax_rope_cache module (the compile child does not): the kernel module is loaded from
`RocmKernelConfig.base`.
"""

import dataclasses
import importlib.util
import sys

KERNEL_BASENAME = "jrc_f16_check"
NUM_ARGS = 2
PER = 8  # patterns per lane: one 16-byte store of f16 bits


@dataclasses.dataclass(frozen=True)
class RocmKernelConfig:
    base: str          # path of rope_cache_flydsl.py, whose emitter converts
    nt: int = 256
    mutant: str = ""   # "bf16": the kernel's bf16 rounding instead (a check that must fail)


def kernel_module(path: str):
    name = "_jrc_f16_check_base_" + str(abs(hash(path)))
    mod = sys.modules.get(name)
    if mod is None:
        spec = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return mod


def emit_kernel_body(cfg: RocmKernelConfig, args: list, dialects=None, base=None) -> None:
    """`args`: out, first (i64 values). `base`: the kernel module (default: loaded from cfg.base)."""
    B = base or kernel_module(cfg.base)
    E = B._Emitter(cfg, dialects)
    out, first = args
    g = E.add(E.mul(E.bid(), E.i32c(cfg.nt)), E.tid())
    x0 = E.add(E.trunc32(first), E.mul(g, E.i32c(PER)))
    vals = [E.bitcast(E.f32, E.add(x0, E.i32c(i)) if i else x0) for i in range(PER)]
    pieces = E.store_elems_pieces(vals, B.BF16 if cfg.mutant == "bf16" else B.F16)
    E.global_store_pieces(pieces, E.add(out, E.mul(E.ext64(g), E.i64c(2 * PER))))


def build_launcher(cfg: RocmKernelConfig):
    import flydsl.compiler as flyc
    import flydsl.expr as fx

    def _raw(v):
        return v.ir_value() if hasattr(v, "ir_value") else v

    @flyc.kernel(known_block_size=(cfg.nt, 1, 1))
    def jrc_f16_check(a0: fx.Int64, a1: fx.Int64):
        emit_kernel_body(cfg, [_raw(a0), _raw(a1)])

    @flyc.jit
    def jrc_launch(a0: fx.Int64, a1: fx.Int64):
        jrc_f16_check(a0, a1).launch(grid=(1, 1, 1), block=(cfg.nt, 1, 1))

    return jrc_launch
