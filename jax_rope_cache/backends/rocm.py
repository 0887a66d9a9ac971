"""impl="kernel" on AMD GPUs: OpSpec -> FlyDSL kernel config -> code objects -> the launcher's custom call.

At lowering time, on any machine (no GPU needed), the FlyDSL kernel
(kernels/rocm/rope_cacheflydsl.py) is compiled for gfx942 (MI300) AND gfx950 (MI350/MI355);
both code objects travel in the executable as the `code` attribute of the custom call, and the
generic GPU launcher (backends/launcher.py, platform "ROCM") loads the one that fits the device.
Code objects are cached in memory and on disk (compilers/flydsl.py), and
`python -m jax_rope_cache compile ...` (cli/aot.py) fills the disk cache ahead of time.

Without FlyDSL: impl="kernel" raises an error saying what to install; impl=None warns and lowers
to the XLA implementation.

Environment: JAX_ROPE_CACHE_ROCM_ARCHS, comma-separated targets to embed (default "gfx942,gfx950");
JAX_ROPE_CACHE_DIR (compilers/cache.py); JAX_ROPE_CACHE_COMMAND_BUFFERS (backends/launcher.py).
"""

from __future__ import annotations

import dataclasses
import os

from jax_rope_cache import contract
from jax_rope_cache.backends import launcher, native
from jax_rope_cache.compilers import flydsl

PLATFORM = "rocm"
NAME = "ROCm"
DEFAULT_ARCHS = ("gfx942", "gfx950")


def target_archs() -> tuple[str, ...]:
    env = os.environ.get("JAX_ROPE_CACHE_ROCM_ARCHS", "").strip()
    if not env:
        return DEFAULT_ARCHS
    archs = tuple(a.strip() for a in env.split(",") if a.strip())
    for a in archs:
        if a not in flydsl.SUPPORTED_ARCHS:
            raise ValueError(f"JAX_ROPE_CACHE_ROCM_ARCHS: expected archs among {flydsl.SUPPORTED_ARCHS}, got {a!r}")
    return archs


def kernel_config(spec_or_codes, module=None):
    """The static kernel configuration (kernels/rocm/rope_cache_flydsl.py) of an OpSpec or KernelCodes."""
    codes = spec_or_codes
    if isinstance(codes, contract.OpSpec):
        codes = contract.kernel_codes(codes)
    return (module or flydsl.kernel_module()).make_config(**dataclasses.asdict(codes))


def build_code_table(cfg, archs=None) -> tuple[bytes, str, list]:
    """(code-object table, kernel symbol, [CodeObject]) for `cfg` and each arch."""
    objs = [flydsl.compile_config(cfg, a) for a in (archs or target_archs())]
    symbols = {o.symbol for o in objs}
    if len(symbols) != 1:
        raise RuntimeError(f"rope_and_cache: the ROCm code objects disagree on the kernel symbol: {symbols}")
    table = launcher.pack_code_table([(launcher.KIND_AMDGPU, o.arch, o.code) for o in objs])
    return table, symbols.pop(), objs


# ---- the backend interface (backends/__init__.py) ------------------------------------------
def missing() -> str | None:
    """What the kernel needs that this process lacks, or None when it can lower."""
    if launcher.launcher_module() is None:
        return launcher.MISSING
    if not flydsl.available():
        return (f"FlyDSL to compile the kernel ({flydsl.unavailable_reason()}); install it with: "
                f"{flydsl.INSTALL_HINT}")
    return None


def lower(ctx, args, spec: contract.OpSpec):
    try:
        cfg = kernel_config(spec)
        table, symbol, _ = build_code_table(cfg)
    except Exception as e:  # noqa: BLE001 - a broken toolchain must not break impl=None users
        raise native.KernelUnavailable(
            f"its kernel, but compiling the kernel failed ({type(e).__name__}: {e})") from e
    return launcher.lower_launch(ctx, args, table=table, kernel=symbol, grid_div=cfg.tpb, block=cfg.nt)
