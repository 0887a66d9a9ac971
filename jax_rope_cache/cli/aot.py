"""`python -m jax_rope_cache compile`: precompile the ROCm kernels (rope_and_cache's and
mla_rope_and_cache's) into the disk cache and/or ONE bundle file, so a deployment host lowers
without a compiler (`precompile` is the same as a function).

The entries are keyed by what determines their bytes (kernel source, compile driver, kernel
configuration, arch; compilers/flydsl.py), so a host with the same jax_rope_cache finds them with
neither FlyDSL nor torch installed: copy the bundle and set JAX_ROPE_CACHE_ROCM_BUNDLE=FILE (or
drop it into the cache folder's rocm/), or copy the cache folder's rocm/. FlyDSL runs in a child
process; this process never imports it (or torch)."""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import sys
import time

import ml_dtypes
import numpy as np

from jax_rope_cache import contract
from jax_rope_cache.backends import rocm
from jax_rope_cache.cli import _args
from jax_rope_cache.cli._fmt import plural
from jax_rope_cache.compilers import cache, flydsl
from jax_rope_cache.mla import contract as mla_contract
from jax_rope_cache.mla import rocm_kernel
from jax_rope_cache.models.presets import (MLA_PRESETS, MODELS, MROPE_PRESETS, PRESET_GROUPS, mla_shape, model_shape,
                                          preset_mrope, preset_qk_norm_eps)

QK_NORM_CHOICES = ("auto", "off", "both")
# The kernel's regimes (backends/rocm.kernel_config): "bandwidth" for calls of more than
# LATENCY_TOKENS tokens, "latency" for decode-sized calls (one token per workgroup).
REGIMES = ("bandwidth", "latency")
_REGIME_TOKENS = {"bandwidth": None, "latency": 1}

_DTYPES = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16, "float32": np.float32,
           "float8_e4m3fn": ml_dtypes.float8_e4m3fn, "float8_e4m3fnuz": ml_dtypes.float8_e4m3fnuz,
           "float8_e5m2": ml_dtypes.float8_e5m2}


def _code(name: str) -> int:
    if name not in _DTYPES:
        raise ValueError(f"dtype: expected one of {sorted(_DTYPES)}, got {name!r}")
    return contract.DTYPE_CODES[np.dtype(_DTYPES[name])]


# Layouts whose kernels read NB at run time (the default set: one code object serves every cache size).
RUNTIME_NB_LAYOUTS = tuple(name for name, lay in contract.LAYOUT_TABLE.items() if lay.blocks_lead)


def configs_for(*, q_heads, kv_heads, head_dim, rotary_dim=None, block_sizes=(16,), layouts=RUNTIME_NB_LAYOUTS,
                dtypes=("bfloat16",), cache_dtypes=None, table_dtypes=("float32",), neox=(True,),
                tables=("half",), precisions=("fp32",), index_dtypes=("int32",), norm_eps=None,
                norm_weight_dtypes=("same",), scale_heads=False, regimes=REGIMES, mrope=None, num_blocks=None):
    """Kernel configurations of every combination of the given options (one model shape); combinations
    a layout cannot hold (D or BS not a multiple of X) are left out. `num_blocks`: the caches' blocks,
    which head_major's kernels are specialised on (its caches lead with KH); needed for that layout only. `norm_eps` (a float): the fused
    QK-RMSNorm on q and k with weights in each of `norm_weight_dtypes` ("same" = q's dtype, or a
    dtype name); None: no norm. `scale_heads`: fp8 caches with one k/v scale per kv head (KH > 1).
    `regimes`: the configurations of large calls ("bandwidth") and/or of decode-sized calls
    ("latency"); a shape whose latency configuration is the bandwidth one gets it once.
    `mrope`: None, or (mrope_section, mrope_interleaved) of a multimodal-RoPE model (positions [3, T])."""
    for g in regimes:
        if g not in REGIMES:
            raise ValueError(f"regimes: expected a subset of {REGIMES}, got {g!r}")
    for layout in layouts:
        if not contract.cache_layout(layout).blocks_lead and num_blocks is None:
            raise ValueError(f"num_blocks: layout {layout!r} compiles the caches' block count into its kernels; "
                             "expected the blocks of the deployment's caches (--num-blocks), got None")
    r = rotary_dim or head_dim
    eps = 0.0 if norm_eps is None else float(np.float32(norm_eps))
    out = []
    for bs, layout, dt, tdt, nx, table, prec, idx, wdt in itertools.product(
            block_sizes, layouts, dtypes, table_dtypes, neox, tables, precisions, index_dtypes,
            norm_weight_dtypes if norm_eps is not None else (None,)):
        norm = -1 if wdt is None else _code(dt if wdt == "same" else wdt)
        for cdt in (cache_dtypes or (dt,)):
            try:
                contract.check_layout_divisibility(layout, head_dim, bs, _DTYPES[cdt], head_arg="head_dim",
                                                   block_arg="block_size")
            except ValueError:
                continue
            heads = bool(scale_heads) and kv_heads > 1 and np.dtype(_DTYPES[cdt]) in contract.FP8_DTYPES
            codes = contract.KernelCodes(
                qh=q_heads, kh=kv_heads, d=head_dim, r=r, bs=bs, layout=contract.cache_layout(layout).code,
                neox=nx, full_table=table == "full", native=prec == "native", dt=_code(dt),
                tab_dt=_code(tdt), cache_dt=_code(cdt), slot64=idx == "int64", pos64=idx == "int64",
                q_norm=norm, k_norm=norm, norm_eps=eps, k_scale_heads=heads, v_scale_heads=heads,
                nb=0 if contract.cache_layout(layout).blocks_lead else int(num_blocks),
                **_mrope_codes(mrope))
            for g in regimes:
                cfg = rocm.kernel_config(codes, num_tokens=_REGIME_TOKENS[g])
                if cfg not in out:
                    out.append(cfg)
    return out


def _mrope_codes(mrope) -> dict:
    if mrope is None:
        return {}
    (t, h, w), interleaved = mrope
    return dict(mrope=2 if interleaved else 1, mrope_t=t, mrope_h=h, mrope_w=w)


def mla_configs_for(*, q_heads, nope_dim, latent_dim, rope_dim, block_sizes=(16,), layouts=mla_contract.MLA_LAYOUTS,
                    dtypes=("bfloat16",), cache_dtypes=None, q_out_dtypes=None, table_dtypes=("float32",),
                    neox=(False,), tables=("half",), precisions=("fp32",), index_dtypes=("int32",),
                    regimes=REGIMES):
    """MLA kernel configurations (kernels/rocm/mla_cache_flydsl.py) of every combination of the given
    options (one MLA shape: q heads, Dn, Dc, Dr). Cache and q_out dtypes: None or "same" (the input's)
    or float8 names (the call then passes kv_scale / q_scale). Unstacked caches, as `configs_for`."""
    for g in regimes:
        if g not in REGIMES:
            raise ValueError(f"regimes: expected a subset of {REGIMES}, got {g!r}")
    for layout in layouts:
        mla_contract.check_layout(layout)
    out = []
    for bs, layout, dt, tdt, nx, table, prec, idx in itertools.product(
            block_sizes, layouts, dtypes, table_dtypes, neox, tables, precisions, index_dtypes):
        for cdt, qdt in itertools.product(cache_dtypes or ("same",), q_out_dtypes or ("same",)):
            cdt, qdt = (dt if x == "same" else x for x in (cdt, qdt))
            for what, x in (("cache_dtypes", cdt), ("q_out_dtypes", qdt)):
                if x != dt and np.dtype(_DTYPES[x]) not in contract.FP8_DTYPES:
                    raise ValueError(f"{what}: expected 'same' ({dt}) or a float8 dtype, got {x!r}")
            codes = mla_contract.MlaKernelCodes(
                qh=q_heads, dn=nope_dim, dc=latent_dim, dr=rope_dim, bs=bs, split=layout == "split", neox=nx,
                full_table=table == "full", native=prec == "native", dt=_code(dt), tab_dt=_code(tdt),
                cache_dt=_code(cdt), q_dt=_code(qdt), slot64=idx == "int64", pos64=idx == "int64")
            for g in regimes:
                cfg = rocm_kernel.kernel_config(codes, num_tokens=_REGIME_TOKENS[g])
                if cfg not in out:
                    out.append(cfg)
    return out


def mla_preset_configs(name: str, tp: int = 1, nope=("absorbed",), **options) -> list:
    """`mla_configs_for` of an MLA preset at tp: q_nope absorbed (Dn = kv_lora_rank, what decode runs)
    and/or "plain" (Dn = qk_nope_head_dim)."""
    m = mla_shape(name, tp)
    out = []
    for form in nope:
        if form not in ("absorbed", "plain"):
            raise ValueError(f"nope: expected 'absorbed' and/or 'plain', got {form!r}")
        dn = m.absorbed_nope_dim if form == "absorbed" else m.nope_dim
        for cfg in mla_configs_for(**({"neox": (m.is_neox,)} | options), q_heads=m.q_heads, nope_dim=dn,
                                   latent_dim=m.latent_dim, rope_dim=m.rope_dim):
            if cfg not in out:
                out.append(cfg)
    return out


def preset_norms(name: str, qk_norm: str = "auto") -> tuple:
    """The QK-RMSNorm epsilons (None: without the norm) `compile` builds a preset with."""
    if qk_norm not in QK_NORM_CHOICES:
        raise ValueError(f"qk_norm: expected one of {QK_NORM_CHOICES}, got {qk_norm!r}")
    eps = preset_qk_norm_eps(name)
    if eps is None or qk_norm == "off":
        return (None,)
    return (eps,) if qk_norm == "auto" else (None, eps)


def preset_configs(name: str, tp: int = 1, qk_norm: str = "auto", **options) -> list:
    """`configs_for` of a preset of MODELS at tp: its heads, rotary dim and RoPE style, its QK-norm
    variants (`preset_norms`) and, for a multimodal-RoPE preset, its M-RoPE sections."""
    m = model_shape(name, tp)
    out = []
    for e in preset_norms(name, qk_norm):
        out += configs_for(q_heads=m.q_heads, kv_heads=m.kv_heads, head_dim=m.head_dim, rotary_dim=m.rotary_dim,
                           mrope=preset_mrope(name), **({"neox": (m.is_neox,)} | options | {"norm_eps": e}))
    return out


def precompile(archs=rocm.DEFAULT_ARCHS, configs=None, *, presets=(), tp: int = 1, verbose=False, bundle=None,
               qk_norm="auto", mla_presets=(), mla_options=None, **options):
    """Compiles kernel configurations into the disk cache; returns [(config, CodeObject)].

    `configs`: RocmKernelConfig objects (rope_and_cache) and/or MLA ones (`mla_configs_for`);
    `presets`: names of models.presets.MODELS (a model at tensor
    parallelism `tp` divides its heads by tp), each expanded with `options` (see `configs_for`);
    a multimodal-RoPE preset gets its M-RoPE kernels (the sections of its config);
    `mla_presets`: names of models.presets.MLA_PRESETS at `tp`, expanded with `mla_options`
    (`mla_preset_configs`);
    `qk_norm`: "auto" gives a preset with a QK-RMSNorm (Qwen3) its fused norm (its config's eps),
    "off" never, "both" the variants with and without it.
    `bundle`: also write every code object into this ONE file (compilers/flydsl.write_bundle).
    Configurations already cached or bundled are not compiled again (and need no FlyDSL).
    """
    for a in archs:
        if a not in flydsl.SUPPORTED_ARCHS:
            raise ValueError(f"arch: expected one of {flydsl.SUPPORTED_ARCHS}, got {a!r}")
    cfgs = list(configs or [])
    for name in presets:
        cfgs += preset_configs(name, tp, qk_norm, **options)
    for name in mla_presets:
        cfgs += mla_preset_configs(name, tp, **(mla_options or {}))
    mla_type = rocm_kernel.kernel_module().MlaRocmConfig
    out = []
    for cfg in cfgs:
        t = time.perf_counter()
        build = rocm_kernel.build_code_table if isinstance(cfg, mla_type) else rocm.build_code_table
        _, _, objs = build(cfg, archs)  # the occupancy candidate that fits on every arch
        for co in objs:
            flydsl.ensure_on_disk(co, co.config or cfg)
            if verbose:
                i = co.info
                built = co.config or cfg
                narrowed = [f"{f.name}={getattr(built, f.name)}" for f in dataclasses.fields(built)
                             if getattr(built, f.name) != getattr(cfg, f.name)]  # the chunk widths narrowed
                how = "" if built == cfg and not co.hints else (
                    f" (occupancy: {' '.join(narrowed)}{' ' + str(co.hints) if co.hints else ''})")
                print(f"{co.arch} {cfg.key()}: {len(co.code)} B, {i['vgpr_count']} VGPR, {i['sgpr_count']} SGPR{how}, "
                      f"{co.origin if co.from_disk else f'compiled in {time.perf_counter() - t:.2f} s'}")
            out.append((cfg, co))
    if bundle:
        flydsl.write_bundle(bundle, [co for _, co in out])
    return out


def main(argv=None) -> None:
    """`python -m jax_rope_cache compile --arch gfx942,gfx950 --preset gpt-oss-120b --tp 8 ...`"""
    p = argparse.ArgumentParser(prog="python -m jax_rope_cache compile",
                                description="Precompile the ROCm kernel into the disk cache "
                                            f"({cache.cache_dir()}) for deployment hosts.")
    inputs = ("bfloat16", "float16", "float32")
    p.add_argument("--arch", default=",".join(rocm.DEFAULT_ARCHS), type=_args.csv_of(_args.one_of(
        flydsl.SUPPORTED_ARCHS, "arch"), "list of archs"), help="comma-separated: gfx942,gfx950")
    p.add_argument("--preset", action="append", default=[], type=_args.preset_name,
                   help=f"model (repeatable): {', '.join(PRESET_GROUPS['rope_and_cache'])}; multimodal RoPE "
                        f"(its M-RoPE kernels): {', '.join(PRESET_GROUPS['rope_and_cache (M-RoPE)'])}; or "
                        f"{', '.join(sorted(set(MODELS) - set(PRESET_GROUPS['rope_and_cache']) - set(MROPE_PRESETS)))}")
    p.add_argument("--tp", type=_args.positive_int, default=1,
                   help="tensor-parallel degree dividing the preset's heads")
    p.add_argument("--heads", type=_args.csv_of(_args.positive_int, "QH,KH,D[,R]"),
                   help="explicit shape instead of a preset: QH,KH,D[,R]")
    csv = lambda choices, what: _args.csv_of(_args.one_of(choices, what), f"list of {what}s")  # noqa: E731
    p.add_argument("--block-size", type=_args.csv_of(_args.positive_int, "list of block sizes"), default=(16,))
    p.add_argument("--layout", type=csv(contract.LAYOUTS, "layout"), default=("flash",),
                   help=",".join(contract.LAYOUTS))
    p.add_argument("--num-blocks", type=_args.positive_int, default=None,
                   help="the caches' blocks per layer: head_major's kernels are specialised on it")
    p.add_argument("--dtype", type=csv(inputs, "dtype"), default=("bfloat16",), help="q/k/v dtypes")
    p.add_argument("--cache-dtype", type=csv(tuple(_DTYPES), "cache dtype"), default=None,
                   help="default: same as --dtype; or float8_e4m3fn,...")
    p.add_argument("--table-dtype", type=csv(inputs, "table dtype"), default=("float32",))
    p.add_argument("--style", type=csv(("neox", "gptj"), "style"), default=None,
                   help="neox,gptj (default: the preset's)")
    p.add_argument("--table", type=csv(("half", "full"), "table"), default=("half",), help="half,full")
    p.add_argument("--precision", type=csv(contract.PRECISIONS, "precision"), default=("fp32",),
                   help=",".join(contract.PRECISIONS))
    p.add_argument("--index-dtype", type=csv(("int32", "int64"), "index dtype"), default=("int32",),
                   help="int32,int64")
    p.add_argument("--qk-norm", choices=QK_NORM_CHOICES, default="auto",
                   help="presets with a QK-RMSNorm (Qwen3): auto = with the fused norm (the config's eps), "
                        "off = without, both")
    p.add_argument("--norm-eps", type=float, default=None,
                   help="with --heads: compile the variants with the fused QK-RMSNorm of this eps (weights in q's dtype "
                        "unless --norm-weight-dtype)")
    p.add_argument("--norm-weight-dtype", type=csv(("same",) + inputs, "norm weight dtype"), default=("same",),
                   help="same (q's dtype), float32, ...")
    p.add_argument("--scale-heads", action="store_true",
                   help="fp8 caches: one k/v scale per kv head ([KH]) instead of a scalar")
    p.add_argument("--regimes", type=csv(REGIMES, "regime"), default=REGIMES,
                   help="bandwidth (calls of more tokens than a decode step), latency (decode-sized calls); "
                        "default both")
    p.add_argument("--mla-preset", action="append", default=[], type=_args.one_of(sorted(MLA_PRESETS), "MLA preset"),
                   help=f"MLA model (mla_rope_and_cache; repeatable): {', '.join(PRESET_GROUPS['mla_rope_and_cache'])}")
    p.add_argument("--mla-heads", type=_args.csv_of(_args.positive_int, "QH,Dn,Dc,Dr"),
                   help="explicit MLA shape instead of an MLA preset: QH,Dn,Dc,Dr")
    p.add_argument("--mla-layout", type=csv(mla_contract.MLA_LAYOUTS, "MLA layout"), default=mla_contract.MLA_LAYOUTS,
                   help="MLA cache layouts (default combined,split)")
    p.add_argument("--mla-nope", type=csv(("absorbed", "plain"), "q_nope form"), default=("absorbed",),
                   help="MLA presets: q_nope absorbed (Dn = kv_lora_rank, decode; default) and/or plain "
                        "(Dn = qk_nope_head_dim)")
    p.add_argument("--q-out-dtype", type=csv(("same",) + tuple(n for n in _DTYPES if n.startswith("float8")),
                                             "q_out dtype"), default=None,
                   help="MLA q_out dtypes: same (the input's; default) and/or float8 names")
    p.add_argument("--bundle", metavar="FILE",
                   help=f"also write all code objects into ONE file (name it *{flydsl.BUNDLE_SUFFIX}); a deployment "
                        "host reads it through JAX_ROPE_CACHE_ROCM_BUNDLE=FILE or from the cache folder's rocm/")
    a = _args.parse_args(p, argv)
    if a.heads is not None and len(a.heads) not in (3, 4):
        p.error(f"argument --heads: expected QH,KH,D[,R], got {len(a.heads)} numbers")
    if a.heads is not None:
        qh, kh, d, r = (tuple(a.heads) + (a.heads[2],))[:4]
        if qh % kh or d % 2 or r % 2 or r > d:
            p.error(f"argument --heads: expected QH a multiple of KH, an even D and an even R <= D, got {a.heads}")
    archs = a.arch
    opts = dict(block_sizes=a.block_size, layouts=a.layout, dtypes=a.dtype, cache_dtypes=a.cache_dtype,
                table_dtypes=a.table_dtype, tables=a.table, precisions=a.precision, index_dtypes=a.index_dtype,
                norm_weight_dtypes=a.norm_weight_dtype, scale_heads=a.scale_heads, regimes=a.regimes,
                num_blocks=a.num_blocks)
    if a.norm_eps is not None and not (np.isfinite(np.float32(a.norm_eps)) and np.float32(a.norm_eps) > 0):
        p.error(f"argument --norm-eps: expected a finite value > 0 (as float32), got {a.norm_eps!r}")
    if a.style:
        opts["neox"] = tuple(s == "neox" for s in a.style)
    if a.mla_heads is not None and (len(a.mla_heads) != 4 or a.mla_heads[3] % 2):
        p.error(f"argument --mla-heads: expected QH,Dn,Dc,Dr with an even Dr, got {a.mla_heads}")
    mla_opts = dict(block_sizes=a.block_size, layouts=a.mla_layout, dtypes=a.dtype, cache_dtypes=a.cache_dtype,
                    q_out_dtypes=a.q_out_dtype, table_dtypes=a.table_dtype, tables=a.table, precisions=a.precision,
                    index_dtypes=a.index_dtype, regimes=a.regimes) | ({"neox": opts["neox"]} if a.style else {})
    configs = []
    if a.mla_heads:
        qh, dn, dc, dr = a.mla_heads
        try:
            configs += mla_configs_for(q_heads=qh, nope_dim=dn, latent_dim=dc, rope_dim=dr, **mla_opts)
        except ValueError as e:
            p.error(str(e))
    if a.heads:
        vals = list(a.heads)
        qh, kh, d = vals[:3]
        try:
            configs += configs_for(q_heads=qh, kv_heads=kh, head_dim=d, rotary_dim=vals[3] if len(vals) > 3 else None,
                                   norm_eps=a.norm_eps, **opts)
        except ValueError as e:
            p.error(str(e))
    if not configs and not a.preset and not a.mla_preset:
        p.error("give --preset NAME or --mla-preset NAME (repeatable), --heads QH,KH,D[,R] or --mla-heads QH,Dn,Dc,Dr")
    t = time.perf_counter()
    try:
        out = precompile(archs, configs, presets=a.preset, tp=a.tp, verbose=True, bundle=a.bundle,
                         qk_norm=a.qk_norm, mla_presets=a.mla_preset, mla_options=mla_opts | {"nope": a.mla_nope},
                         **opts)
    except (flydsl.FlyDSLUnavailable, ValueError) as e:
        raise SystemExit(f"compile: {e}") from None
    where = cache.cache_dir() or "memory only (JAX_ROPE_CACHE_DIR='')"
    print(f"{plural(len(out), 'code object')} ({plural(len(out) // max(1, len(archs)), 'configuration')} x "
          f"{plural(len(archs), 'arch')}) "
          f"in {where}{f' and the bundle {a.bundle}' if a.bundle else ''} ({time.perf_counter() - t:.1f} s)",
          file=sys.stderr)
