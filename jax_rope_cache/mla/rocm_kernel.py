"""impl="kernel" of the MLA op on AMD GPUs (gfx942, gfx950): the FlyDSL kernel
kernels/rocm/mla_cache_flydsl.py, compiled and cached by compilers/flydsl.py like the main kernel
(memory, bundles, disk, else FlyDSL in the child process), launched by the shared GPU launcher.

The archs embedded, the fallback without FlyDSL or on another GPU, and the occupancy rule (<= 64
VGPRs, no spills, no scratch) are the main op's (backends/rocm.py). Regimes (make_config): calls
of at most 256 tokens get one token per workgroup spread over grid.y parts, one unit per lane;
larger ones 256-lane workgroups of ~2048 units.
"""

from __future__ import annotations

from jax_rope_cache.backends import launcher, native, rocm
from jax_rope_cache.compilers import flydsl
from jax_rope_cache.mla import contract as mla_contract

KERNEL = "mla_cache"  # compilers/flydsl.KERNEL_SOURCES


def kernel_module():
    """The MLA kernel builder (importable without flydsl)."""
    return flydsl.kernel_module(kernel=KERNEL)


def config_fields(codes) -> dict:
    """make_config's arguments of an MlaKernelCodes (or of a built configuration)."""
    return dict(qh=codes.qh, dn=codes.dn, dc=codes.dc, dr=codes.dr, bs=codes.bs, split=bool(codes.split),
                neox=bool(codes.neox), full_table=bool(codes.full_table), native=bool(codes.native), dt=codes.dt,
                tab_dt=codes.tab_dt, cache_dt=codes.cache_dt, q_dt=codes.q_dt, slot64=bool(codes.slot64),
                pos64=bool(codes.pos64), layer_blocks=codes.layer_blocks)


def kernel_config(spec_or_codes, module=None, num_tokens: int | None = None):
    """The configuration of an MlaSpec or MlaKernelCodes; its regime follows the call's token count
    (an MlaSpec's, or `num_tokens`: latency for T <= 256); MlaKernelCodes alone (no T) the bandwidth one."""
    K = module or kernel_module()
    codes = spec_or_codes
    if isinstance(codes, mla_contract.MlaSpec):
        num_tokens = codes.num_tokens if num_tokens is None else num_tokens
        codes = mla_contract.kernel_codes(codes)
    return K.make_config(**config_fields(codes), latency=K.latency_regime(num_tokens))


def occupancy_candidates(cfg, module=None) -> list:
    """[(config, hints)] in the order tried: as made; with waves_per_eu=8; copy and rotation chunks
    of half the width, without and with the hint (only widths and hints differ, never the arithmetic)."""
    K = module or kernel_module()
    fields = config_fields(cfg)
    out = [(cfg, None), (cfg, rocm.WAVES_PER_EU)]
    narrow = K.make_config(**fields, latency=cfg.latency, w_cap=max(1, cfg.w // 2), rot_cap=max(1, cfg.rw // 2))
    if narrow != cfg:
        out += [(narrow, None), (narrow, rocm.WAVES_PER_EU)]
    return [(c, h) for c, h in out if c == cfg or K.span_problem(c) is None]  # cfg itself: refused at lowering


def build_code_table(cfg, archs=None) -> tuple[bytes, str, list]:
    """(code-object table, kernel symbol, [CodeObject]) of the first candidate that fits every arch."""
    archs = tuple(archs or rocm.target_archs())
    objs = flydsl.choose(occupancy_candidates(cfg), archs, rocm.fits)
    symbols = {o.symbol for o in objs}
    if len(symbols) != 1:
        raise RuntimeError(f"mla_rope_and_cache: the ROCm code objects disagree on the kernel symbol: {symbols}")
    table = launcher.pack_code_table([(launcher.KIND_AMDGPU, o.arch, o.code) for o in objs])
    return table, symbols.pop(), objs


def lower(ctx, args, spec, launch_options):
    K = kernel_module()
    rocm.refuse_buffer_limits(spec, kernel_config(spec, K), K, op="mla_rope_and_cache")

    def build(archs):
        cfg = kernel_config(spec)
        table, symbol, objs = build_code_table(cfg, archs)
        return table, symbol, objs[0].config or cfg

    table, symbol, cfg = rocm.prepare_launch(ctx, build, "its MLA kernel")
    return launcher.lower_launch(ctx, args, table=table, kernel=symbol, grid_div=cfg.tpb, block=cfg.nt,
                                 grid_y=cfg.parts, platform="ROCM", **launch_options)
