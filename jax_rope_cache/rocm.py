"""impl="kernel" on AMD GPUs: lowering of rope_cache_p for platform "rocm".

At lowering time, on any machine (no GPU needed), the FlyDSL kernel
(kernels/rocm/rope_cache_flydsl.py) is compiled for gfx942 (MI300) AND gfx950 (MI350/MI355);
both code objects travel in the executable as the `code` attribute of the custom call, and the
generic GPU launcher (kernels/ffi/gpu_launcher.cc, platform "ROCM") loads the one that fits the
device. Code objects are cached in memory and on disk (jax_rope_cache._flydsl), and
`python -m jax_rope_cache compile ...` (`precompile`) fills the disk cache ahead of time so a
deployment host needs no compiler.

Without FlyDSL: impl="kernel" raises an error saying what to install; impl=None warns and lowers
to the XLA implementation.

Environment:
  JAX_ROPE_CACHE_ROCM_ARCHS       comma-separated targets to embed (default "gfx942,gfx950")
  JAX_ROPE_CACHE_COMMAND_BUFFERS  0: use the launcher target without the command-buffer trait
                                  (XLA never captures the call into a HIP graph)
  JAX_ROPE_CACHE_DIR              on-disk cache (default ~/.cache/jax_rope_cache; "" disables)
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

from jax_rope_cache import _flydsl, _spec

DEFAULT_ARCHS = ("gfx942", "gfx950")
KIND_AMDGPU = 3


def target_archs() -> tuple[str, ...]:
    env = os.environ.get("JAX_ROPE_CACHE_ROCM_ARCHS", "").strip()
    if not env:
        return DEFAULT_ARCHS
    archs = tuple(a.strip() for a in env.split(",") if a.strip())
    for a in archs:
        if a not in _flydsl.SUPPORTED_ARCHS:
            raise ValueError(f"JAX_ROPE_CACHE_ROCM_ARCHS: expected archs among {_flydsl.SUPPORTED_ARCHS}, got {a!r}")
    return archs


def kernel_config(spec: _spec.OpSpec, module=None):
    """The static kernel configuration of a call (kernels/rocm/rope_cache_flydsl.py)."""
    K = module or _flydsl.kernel_module()
    codes = _spec.DTYPE_CODES
    dt = codes[np.dtype(spec.dtype)]
    return K.make_config(
        qh=spec.q_heads, kh=spec.kv_heads, d=spec.head_dim, r=spec.rotary_dim, bs=spec.block_size,
        layout=_spec.LAYOUTS.index(spec.layout), neox=spec.is_neox, full_table=spec.table_full,
        native=spec.precision == "native" and dt != codes[np.dtype(np.float32)], dt=dt,
        tab_dt=codes[np.dtype(spec.table_dtype)], cache_dt=codes[np.dtype(spec.cache_dtype)],
        slot64=np.dtype(spec.slot_dtype).itemsize == 8, pos64=np.dtype(spec.pos_dtype).itemsize == 8,
        layer_blocks=spec.num_blocks if spec.num_layers is not None else 0)


def pack_code_table(entries: list[tuple[int, str, bytes]]) -> bytes:
    from jax_rope_cache import cuda

    return cuda.pack_code_table(entries)


def code_hash(table: bytes) -> int:
    from jax_rope_cache import cuda

    return cuda.code_hash(table)


def build_code_table(cfg, archs=None) -> tuple[bytes, str, list]:
    """(code-object table, kernel symbol, [CodeObject]) for `cfg` and each arch."""
    objs = [_flydsl.compile_config(cfg, a) for a in (archs or target_archs())]
    symbols = {o.symbol for o in objs}
    if len(symbols) != 1:
        raise RuntimeError(f"rope_and_cache: the ROCm code objects disagree on the kernel symbol: {symbols}")
    table = pack_code_table([(KIND_AMDGPU, o.arch, o.code) for o in objs])
    return table, symbols.pop(), objs


def kernel_available() -> bool:
    """True when impl="kernel" can lower for ROCm in this process (extension + FlyDSL present)."""
    from jax_rope_cache import cuda

    return cuda.launcher_module() is not None and _flydsl.available()


def _lower_rocm(ctx, *args, spec, impl):
    from jax_rope_cache import _ffi, cuda

    if (fallback := _ffi.kernel_or_fallback(ctx, *args, spec=spec, impl=impl, platform="rocm")) is not None:
        return fallback
    module = cuda.launcher_module()
    if module is None:
        return _ffi.kernel_unusable(ctx, *args, spec=spec, impl=impl, platform="ROCm", problem=cuda.LAUNCHER_MISSING)
    if not _flydsl.available():
        return _ffi.kernel_unusable(ctx, *args, spec=spec, impl=impl, platform="ROCm", problem=(
            f"FlyDSL to compile the kernel ({_flydsl.unavailable_reason()}); install it with: "
            f"{_flydsl.INSTALL_HINT}"))
    try:
        cfg = kernel_config(spec)
        table, symbol, _ = build_code_table(cfg)
    except Exception as e:  # noqa: BLE001 - a broken toolchain must not break impl=None users
        if impl == "kernel":
            raise
        return _ffi.kernel_unusable(ctx, *args, spec=spec, impl=impl, platform="ROCm", problem=(
            f"its kernel, but compiling the kernel failed ({type(e).__name__}: {e})"))
    return cuda.lower_launch(ctx, args, module, table=table, kernel=symbol, grid_div=cfg.tpb, block=cfg.nt)


def _register() -> None:
    from jax.interpreters import mlir

    from jax_rope_cache import _ffi

    mlir.register_lowering(_ffi.rope_cache_p, _lower_rocm, platform="rocm")
    if hasattr(_ffi, "register_kernel_platform"):
        _ffi.register_kernel_platform("rocm", kernel_available)


_register()


# ---- ahead-of-time compilation (python -m jax_rope_cache compile ...) -------------------------
def configs_for(*, q_heads, kv_heads, head_dim, rotary_dim=None, block_sizes=(16,), layouts=_spec.LAYOUTS,
                dtypes=("bfloat16",), cache_dtypes=None, table_dtypes=("float32",), neox=(True,),
                tables=("half",), precisions=("fp32",), index_dtypes=("int32",)):
    """Kernel configurations of every combination of the given options (one model shape)."""
    import itertools

    K = _flydsl.kernel_module()
    codes = {np.dtype(k).name: v for k, v in _spec.DTYPE_CODES.items()}
    r = rotary_dim or head_dim
    out = []
    for bs, layout, dt, tdt, nx, table, prec, idx in itertools.product(
            block_sizes, layouts, dtypes, table_dtypes, neox, tables, precisions, index_dtypes):
        for cdt in (cache_dtypes or (dt,)):
            x = 16 // np.dtype(_np_dtype(cdt)).itemsize
            if layout != "flash" and (head_dim % x or (layout == "xpacked_shuffled" and bs % x)):
                continue
            out.append(K.make_config(
                qh=q_heads, kh=kv_heads, d=head_dim, r=r, bs=bs, layout=_spec.LAYOUTS.index(layout), neox=nx,
                full_table=table == "full", native=prec == "native" and dt != "float32", dt=codes[dt],
                tab_dt=codes[tdt], cache_dt=codes[cdt], slot64=idx == "int64", pos64=idx == "int64"))
    return out


def _np_dtype(name: str):
    import ml_dtypes

    return {"bfloat16": ml_dtypes.bfloat16, "float8_e4m3fn": ml_dtypes.float8_e4m3fn,
            "float8_e4m3fnuz": ml_dtypes.float8_e4m3fnuz}.get(name, name)


def precompile(archs=DEFAULT_ARCHS, configs=None, *, presets=(), tp: int = 1, verbose=False, **options):
    """Compiles kernel configurations into the disk cache; returns [(config, CodeObject)].

    `configs`: RocmKernelConfig objects; `presets`: names of jax_rope_cache.shapes.MODELS (a
    model at tensor parallelism `tp` divides its heads by tp), each expanded with `options`
    (see `configs_for`: block_sizes, layouts, dtypes, cache_dtypes, table_dtypes, neox, tables,
    precisions, index_dtypes).
    """
    from jax_rope_cache import shapes

    _flydsl.require()
    cfgs = list(configs or [])
    for name in presets:
        m = shapes.model_shape(name, tp)
        cfgs += configs_for(q_heads=m.q_heads, kv_heads=m.kv_heads, head_dim=m.head_dim, rotary_dim=m.rotary_dim,
                            **({"neox": (m.is_neox,)} | options))
    out = []
    for cfg in cfgs:
        for arch in archs:
            t = time.perf_counter()
            co = _flydsl.compile_config(cfg, arch)
            if verbose:
                i = co.info
                print(f"{arch} {cfg.key()}: {len(co.code)} B, {i['vgpr_count']} VGPR, {i['sgpr_count']} SGPR, "
                      f"{'cached' if co.from_disk else f'{time.perf_counter() - t:.2f} s'}")
            out.append((cfg, co))
    return out


def compile_main(argv=None) -> None:
    """`python -m jax_rope_cache compile --arch gfx942,gfx950 --preset gpt-oss-120b --tp 8 ...`"""
    p = argparse.ArgumentParser(prog="python -m jax_rope_cache compile",
                                description="Precompile the ROCm kernel into the disk cache "
                                            f"({_flydsl.cache_dir()}) for deployment hosts.")
    p.add_argument("--arch", default=",".join(DEFAULT_ARCHS), help="comma-separated: gfx942,gfx950")
    p.add_argument("--preset", action="append", default=[], help="model shape (repeatable); one of: "
                   "llama-3.1-8b, llama-3.1-70b-tp8, gpt-oss-120b-tp8, gpt-oss-120b, qwen3-32b-tp8, tiny")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree dividing the preset's heads")
    p.add_argument("--heads", help="explicit shape instead of a preset: QH,KH,D[,R]")
    csv = lambda s: tuple(x for x in s.split(",") if x)  # noqa: E731
    p.add_argument("--block-size", type=lambda s: tuple(int(x) for x in s.split(",")), default=(16,))
    p.add_argument("--layout", type=csv, default=("flash",), help="flash,xpacked,xpacked_shuffled")
    p.add_argument("--dtype", type=csv, default=("bfloat16",), help="q/k/v dtypes")
    p.add_argument("--cache-dtype", type=csv, default=None, help="default: same as --dtype; or float8_e4m3fn,...")
    p.add_argument("--table-dtype", type=csv, default=("float32",))
    p.add_argument("--style", type=csv, default=None, help="neox,gptj (default: the preset's)")
    p.add_argument("--table", type=csv, default=("half",), help="half,full")
    p.add_argument("--precision", type=csv, default=("fp32",), help="fp32,native")
    p.add_argument("--index-dtype", type=csv, default=("int32",), help="int32,int64")
    a = p.parse_args(argv)
    archs = csv(a.arch)
    opts = dict(block_sizes=a.block_size, layouts=a.layout, dtypes=a.dtype, cache_dtypes=a.cache_dtype,
                table_dtypes=a.table_dtype, tables=a.table, precisions=a.precision, index_dtypes=a.index_dtype)
    if a.style:
        opts["neox"] = tuple(s == "neox" for s in a.style)
    configs = []
    if a.heads:
        vals = [int(x) for x in a.heads.split(",")]
        qh, kh, d = vals[:3]
        configs = configs_for(q_heads=qh, kv_heads=kh, head_dim=d, rotary_dim=vals[3] if len(vals) > 3 else None,
                              **opts)
    if not configs and not a.preset:
        p.error("give --preset NAME (repeatable) or --heads QH,KH,D[,R]")
    t = time.perf_counter()
    out = precompile(archs, configs, presets=a.preset, tp=a.tp, verbose=True, **opts)
    print(f"{len(out)} code objects ({len(out) // max(1, len(archs))} configurations x {len(archs)} archs) "
          f"in {_flydsl.cache_dir()} ({time.perf_counter() - t:.1f} s)", file=sys.stderr)
