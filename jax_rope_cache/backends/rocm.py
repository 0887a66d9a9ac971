"""impl="kernel" on AMD GPUs: OpSpec -> FlyDSL kernel config -> code objects -> the launcher's custom call.

Which archs a lowering embeds (`lowering_archs`):
  * lowering for this process's ROCm devices: the devices' gfx archs, read from the PJRT device
    attribute `compute_capability` (on ROCm it is the gfx name, e.g. "gfx942", possibly with
    feature suffixes ":sramecc+:xnack-"). An arch without a kernel (MI250X gfx90a, RDNA
    gfx1100/gfx1201, ...) makes the backend unusable for that lowering: impl=None warns and
    lowers the XLA path, impl="kernel" raises an error naming the arch.
  * `jax.export`, or lowering for "rocm" where this process has no ROCm device (a build machine):
    every target arch (JAX_ROPE_CACHE_ROCM_ARCHS, default gfx942 and gfx950), so the program runs
    on MI300 and MI350 alike.
The code objects travel in the executable as the `code` attribute of the custom call; the GPU
launcher (backends/launcher.py, registered for platform "ROCM", HIP driver) loads the one whose
arch matches the device's gcnArchName.

Code objects come from compilers/flydsl.py: memory, a bundle, the disk cache, else FlyDSL in a
child process (never in this process). Without FlyDSL and without a precompiled entry:
impl="kernel" raises an error saying what to install or how to precompile; impl=None warns and
lowers to the XLA implementation. `python -m jax_rope_cache compile ...` (cli/aot.py) precompiles.

Environment: JAX_ROPE_CACHE_ROCM_ARCHS, comma-separated targets for exports and device-less
lowerings (default "gfx942,gfx950"); JAX_ROPE_CACHE_DIR (compilers/cache.py);
JAX_ROPE_CACHE_ROCM_BUNDLE (compilers/flydsl.py); JAX_ROPE_CACHE_COMMAND_BUFFERS (backends/launcher.py: on
ROCm the lowering uses the launcher target that XLA never captures into a HIP graph unless it is 1).
"""

from __future__ import annotations

import dataclasses
import inspect
import os

import jax
import numpy as np

from jax_rope_cache import contract
from jax_rope_cache.backends import launcher, native
from jax_rope_cache.compilers import flydsl

PLATFORM = "rocm"
NAME = "ROCm"
DEFAULT_ARCHS = ("gfx942", "gfx950")
ARCH_NAMES = {"gfx942": "MI300", "gfx950": "MI350/MI355"}
# contract.FEATURES the FlyDSL kernel implements (others: the XLA path, or an error with impl="kernel").
# Per-token scales: for shapes where a row is a power-of-two lane group (refuse_token_scales); the norm
# after the rotation: where the rotation lanes hold the whole row (refuse_families); NVFP4 / MXFP4: where
# each block spreads evenly over an aligned lane group (kernel block_problem).
SUPPORTS: frozenset[str] = frozenset(contract.BASE_FEATURES) | {
    "nope", "rope_switch", "rotary_tail", "gemma_norm", "weightless_norm", "norm_after", "temperature", "q_gate",
    "int8_cache", "int4_cache", "nvfp4_cache", "mxfp4_cache"}


class UnsupportedArch(RuntimeError):
    """The ROCm device's arch has no kernel (impl="kernel" raises it at lowering)."""


def target_archs() -> tuple[str, ...]:
    env = os.environ.get("JAX_ROPE_CACHE_ROCM_ARCHS", "").strip()
    if not env:
        return DEFAULT_ARCHS
    archs = tuple(a.strip() for a in env.split(",") if a.strip())
    for a in archs:
        if a not in flydsl.SUPPORTED_ARCHS:
            raise ValueError(f"JAX_ROPE_CACHE_ROCM_ARCHS: expected archs among {flydsl.SUPPORTED_ARCHS}, got {a!r}")
    return archs


def _rocm_devices() -> list:
    """This process's ROCm devices (none without a ROCm backend). Tests replace this to mock archs."""
    try:
        return list(jax.devices("rocm"))
    except RuntimeError:
        return []


def device_arch(device) -> str | None:
    """The gfx arch of a ROCm device ("gfx942"), from its `compute_capability` attribute (XLA sets
    it to the gfx version on ROCm); None when the attribute is absent or not a gfx name."""
    cc = getattr(device, "compute_capability", None)
    name = str(cc or "").strip().split(":")[0]
    return name if name.startswith("gfx") else None


def lowering_archs(ctx=None) -> tuple[str, ...]:
    """The archs whose code objects a lowering embeds; UnsupportedArch when a device has no kernel."""
    params = getattr(getattr(ctx, "module_context", None), "lowering_parameters", None)
    if getattr(params, "for_export", False):
        return target_archs()
    devices = _rocm_devices()
    if not devices:
        return target_archs()
    archs, unknown = {}, False
    for d in devices:
        a = device_arch(d)
        if a is None:
            unknown = True
        else:
            archs.setdefault(a, d)
    bad = {a: d for a, d in archs.items() if a not in flydsl.SUPPORTED_ARCHS}
    if bad:
        a, d = next(iter(sorted(bad.items())))
        kinds = ", ".join(f"{k} ({v})" for k, v in ARCH_NAMES.items())
        raise UnsupportedArch(
            f"rope_and_cache: the ROCm kernel is built for {kinds} only; this process's ROCm device "
            f"{getattr(d, 'id', '?')} ({getattr(d, 'device_kind', 'unknown kind')}) is {a}. Use impl=None (the XLA "
            "implementation on this GPU) or impl='xla'")
    if unknown or not archs:  # a device that does not say: embed every target, the launcher picks
        return tuple(sorted(set(target_archs()) | set(archs)))
    return tuple(sorted(archs))


def kernel_config(spec_or_codes, module=None, num_tokens: int | None = None):
    """The static kernel configuration (kernels/rocm/rope_cache_flydsl.py) of an OpSpec or KernelCodes.
    Its regime follows the call's token count (an OpSpec's, or `num_tokens`): small calls get the
    latency configuration (make_config(latency=True)); KernelCodes alone (no T) the bandwidth one."""
    codes = spec_or_codes
    family = None
    if isinstance(spec_or_codes, contract.OpSpec):
        num_tokens = codes.num_tokens if num_tokens is None else num_tokens
        family = family_codes(codes)
        codes = op_codes(codes, module)
    K = module or flydsl.kernel_module()
    extra = {}
    if "latency" in inspect.signature(K.make_config).parameters:
        extra["latency"] = K.latency_regime(num_tokens)
    return K.make_config(**config_codes(codes, K, family), **extra)


def op_codes(spec: contract.OpSpec, module=None) -> contract.KernelCodes:
    """contract.kernel_codes, with an int8 / int4 cache as the kernel's INT8 / INT4 code (contract.DTYPE_CODES
    holds the float dtypes only)."""
    if not spec.low_bit:
        return contract.kernel_codes(spec)
    K = module or flydsl.kernel_module()
    codes = contract.kernel_codes(dataclasses.replace(spec, cache_dtype=contract.FP8_DTYPES[0]))  # the same geometry
    return dataclasses.replace(codes, cache_dt=K.INT8 if spec.int8 else K.INT4)  # NVFP4 / MXFP4: INT4 bytes


# The model-family fields of the kernel's make_config (not in contract.KernelCodes) and their off values.
FAMILY_DEFAULTS = dict(tail=False, rope_switch=False, norm_type=0, norm_after=False, temp_floor=0, q_gate=False,
                       block_fmt=0)
BLOCK_FMT_CODES = {None: 0, "nvfp4": 1, "mxfp4": 2}  # the kernel's NVFP4 / MXFP4
NORM_TYPE_CODES = {"rms": 0, "gemma": 1, "weightless": 2}


def family_codes(spec: contract.OpSpec) -> dict:
    """The model-family fields of make_config for a call (every one at its off value without the options)."""
    return dict(tail=bool(spec.rotary_tail), rope_switch=bool(spec.rope_switch),
                norm_type=NORM_TYPE_CODES[spec.norm_type] if spec.qk_norm else 0, norm_after=bool(spec.norm_after),
                temp_floor=int(spec.temperature[0]) if spec.temperature is not None else 0, q_gate=bool(spec.q_gate),
                block_fmt=BLOCK_FMT_CODES[getattr(spec, "cache_format", None)])


_CODE_FIELDS = tuple(f.name for f in dataclasses.fields(contract.KernelCodes))
_CODE_DEFAULTS = {f.name: f.default for f in dataclasses.fields(contract.KernelCodes)
                  if f.default is not dataclasses.MISSING}
_CODE_DEFAULTS.update(FAMILY_DEFAULTS)


def config_codes(codes, module, family: dict | None = None) -> dict:
    """The KernelCodes fields and the model-family fields (FAMILY_DEFAULTS; of a RocmKernelConfig, or
    `family`) that the kernel module's make_config takes. A field it does not take yet (an option its
    SUPPORTS lacks) must be at its off value: anything else would be dropped silently, so it raises."""
    accepted = inspect.signature(module.make_config).parameters
    out = {}
    for f in _CODE_FIELDS + tuple(FAMILY_DEFAULTS):
        value = (family or {}).get(f, getattr(codes, f, _CODE_DEFAULTS.get(f)))
        if f in accepted:
            out[f] = value
        elif value != _CODE_DEFAULTS.get(f):
            raise NotImplementedError(f"rope_and_cache: the FlyDSL kernel has no option {f} (asked for {value!r})")
    return out


MAX_VGPRS = 64  # 8 waves per SIMD on CDNA3/CDNA4 (512 VGPRs per lane / 64): the occupancy cap
WAVES_PER_EU = {"waves_per_eu": 8}


def fits(info: dict) -> bool:
    """A code object that runs at full occupancy: <= 64 VGPRs, no spills, no scratch (metadata a
    stand-in code object lacks counts as fitting)."""
    return (info.get("vgpr_count", 0) <= MAX_VGPRS and info.get("vgpr_spill_count", 0) == 0
            and info.get("sgpr_spill_count", 0) == 0 and info.get("private_segment_size", 0) == 0)


def occupancy_candidates(cfg, module=None) -> list:
    """[(config, compile hints)] to try in order for `cfg` (build_code_table takes the first whose
    code objects fit): as configured; with waves_per_eu=8 (the compiler keeps to 64 VGPRs, but may
    spill); rotation chunks of half the width (fewer values in flight per lane, 8-byte instead of
    16-byte accesses), without and with the hint; every chunk kind at half width. Only the chunk
    widths and hints differ, never the arithmetic (the lane emulator checks every width). A
    latency-regime `cfg` then has the bandwidth configuration's candidates: what `compile` (which
    knows no T) precompiles, so a host without FlyDSL still finds a code object."""
    K = module or flydsl.kernel_module()
    codes = config_codes(cfg, K)
    latency = bool(getattr(cfg, "latency", False))
    regime = {"latency": True} if latency else {}
    out = [(cfg, None), (cfg, WAVES_PER_EU)]
    narrow = K.make_config(**codes, rot_cap=max(1, cfg.w_rot // 2), **regime)
    if narrow != cfg:
        out += [(narrow, None), (narrow, WAVES_PER_EU)]
    narrower = K.make_config(**codes, rot_cap=max(1, cfg.w_rot // 2), width_cap=max(1, max(cfg.w_pass, cfg.w_v) // 2),
                             **regime)
    if narrower not in (cfg, narrow):
        out.append((narrower, None))
    if latency:
        out += [c for c in occupancy_candidates(K.make_config(**codes), K) if c not in out]
    if getattr(cfg, "token_scales", False):  # narrower chunks may spread a row over too many lanes
        out = [(c, h) for c, h in out if K.token_scales_problem(c) is None]
    if getattr(cfg, "block_fmt", 0):  # or split a block unevenly
        out = [(c, h) for c, h in out if K.block_problem(c) is None]
    # a latency cfg's bandwidth fallbacks hold more token rows per workgroup (cfg itself: refused at lowering)
    return [(c, h) for c, h in out if c == cfg or K.span_problem(c) is None]


def build_code_table(cfg, archs=None) -> tuple[bytes, str, list]:
    """(code-object table, kernel symbol, [CodeObject]) for `cfg` and each arch: the first occupancy
    candidate of `cfg` whose code objects fit on every arch (CodeObject.config is the configuration
    actually built: launch with its tpb and nt)."""
    archs = tuple(archs or target_archs())
    objs = flydsl.choose(occupancy_candidates(cfg), archs, fits)
    symbols = {o.symbol for o in objs}
    if len(symbols) != 1:
        raise RuntimeError(f"rope_and_cache: the ROCm code objects disagree on the kernel symbol: {symbols}")
    table = launcher.pack_code_table([(launcher.KIND_AMDGPU, o.arch, o.code) for o in objs])
    return table, symbols.pop(), objs


# ---- the backend interface (backends/__init__.py) ------------------------------------------
def missing() -> str | None:
    """What the kernel needs that this process lacks, or None when it can lower. Needs neither
    FlyDSL nor torch imported: a process without FlyDSL still lowers configurations that are
    precompiled (a miss then falls back / raises at lowering, saying so)."""
    if launcher.launcher_module() is None:
        return launcher.MISSING
    if not flydsl.available() and not flydsl.bundle_paths() and not _has_disk_entries():
        return (f"FlyDSL to compile the kernel ({flydsl.unavailable_reason()}), or precompiled code objects (none "
                f"found); install it with: {flydsl.INSTALL_HINT}; {flydsl.PRECOMPILE_HINT}")
    return None


def _has_disk_entries() -> bool:
    from jax_rope_cache.compilers import cache

    d = cache.cache_dir()
    try:
        return bool(d) and any(n.endswith(".hsaco.jrc") for n in os.listdir(os.path.join(d, "rocm")))
    except OSError:
        return False


def prepare_launch(ctx, build, what: str):
    """(code table, kernel symbol, configuration) of a ROCm lowering: registers the launcher's
    targets, picks the archs, and calls `build(archs)` -> (table, symbol, config). Every miss is a
    KernelUnavailable naming `what` is needed, so impl=None falls back to the XLA path."""
    try:  # here, so that a jax that refuses the registration falls back (impl=None) like any other miss
        launcher.register_gpu_targets(launcher.launcher_module(), "ROCM")
    except Exception as e:  # noqa: BLE001
        raise native.KernelUnavailable(
            f"its launcher target registered with jax, which failed ({type(e).__name__}: {e})") from e
    try:
        archs = lowering_archs(ctx)
    except UnsupportedArch as e:
        raise native.KernelUnavailable(f"a gfx942 or gfx950 GPU ({e})") from e
    try:
        return build(archs)
    except flydsl.FlyDSLUnavailable as e:
        raise native.KernelUnavailable(str(e).replace("compiling the ROCm kernel needs ", "", 1)) from e
    except Exception as e:  # noqa: BLE001 - a broken toolchain must not break impl=None users
        raise native.KernelUnavailable(
            f"{what}, but compiling the kernel failed ({type(e).__name__}: {e})") from e


def refuse_token_scales(cfg, module=None) -> None:
    """KernelUnavailable where per-token scales do not fit the shape (the kernel's
    token_scales_problem: a row's lanes are not a power-of-two group of one wave)."""
    K = module or flydsl.kernel_module()
    problem = K.token_scales_problem(cfg) if getattr(cfg, "token_scales", False) else None
    what = "per-token fp8 scales" if cfg.cache_dt in K.FP8_CODES else "per-token int8 / int4 quantization"
    if problem is None and getattr(cfg, "block_fmt", 0):
        problem, what = K.block_problem(cfg), f"{'NVFP4' if cfg.block_fmt == K.NVFP4 else 'MXFP4'} caches"
    if problem is None:
        return
    raise native.KernelUnavailable(f"a kernel with {what} for this shape ({problem})") from (
        NotImplementedError(f"rope_and_cache: impl='kernel' on {NAME}: the kernel does not implement {what} "
                            f"(k_scale_cache / v_scale_cache) for this shape: {problem}; use impl=None (the "
                            "XLA implementation then runs) or impl='xla'"))


def refuse_families(cfg, module=None) -> None:
    """KernelUnavailable where the kernel cannot take the call's model-family options for its shape
    (the kernel's family_problem: the norm after the rotation needs the row in one butterfly group)."""
    K = module or flydsl.kernel_module()
    problem = K.family_problem(cfg) if hasattr(K, "family_problem") else None
    if problem is None:
        return
    raise native.KernelUnavailable(f"a kernel with these model-family options for this shape ({problem})") from (
        NotImplementedError(f"rope_and_cache: impl='kernel' on {NAME}: the kernel does not implement {problem}; use "
                            "impl=None (the XLA implementation then runs) or impl='xla'"))


def table_bytes(spec) -> int:
    """Bytes of each cos / sin table of a call (an OpSpec or an MlaSpec): [max_pos, R or R/2]."""
    width = spec.rotary_dim if spec.table_full else spec.rotary_dim // 2
    return spec.max_pos * width * np.dtype(spec.table_dtype).itemsize


def refuse_buffer_limits(spec, cfg, module=None, op: str = "rope_and_cache") -> None:
    """KernelUnavailable (cause: a ValueError naming the buffer) where the FlyDSL kernel's 32-bit
    buffer offsets cannot address the call's buffers: a cos/sin table of 4 GiB or more (the
    kernel's TABLE_BYTES_LIMIT; it would silently read another row), or a workgroup's token rows
    spanning more than one descriptor addresses (span_problem of the configuration `cfg`). Every
    other buffer is addressed in 64-bit (the kernel module's docstring lists the limits)."""
    K = module or flydsl.kernel_module()
    nbytes = table_bytes(spec)
    temp_rows = spec.max_pos // spec.temperature[0] + 1 if getattr(spec, "temperature", None) is not None else 0
    if temp_rows * 4 >= K.TABLE_BYTES_LIMIT:
        problem = (f"attn_temperature: expected a factor table of less than 4 GiB (the kernel addresses it with 32-bit "
                   f"offsets), got {temp_rows} float32 factors (max_pos {spec.max_pos} // floor_scale "
                   f"{spec.temperature[0]} + 1)")
    elif nbytes >= K.TABLE_BYTES_LIMIT:
        width = spec.rotary_dim if spec.table_full else spec.rotary_dim // 2
        problem = (f"cos/sin: expected tables of less than 4 GiB ({K.TABLE_BYTES_LIMIT} bytes: the kernel addresses "
                   f"them with 32-bit offsets), got [{spec.max_pos}, {width}] {np.dtype(spec.table_dtype).name} = "
                   f"{nbytes} bytes each")
    else:
        problem = K.span_problem(cfg)
    if problem is None:
        return
    raise native.KernelUnavailable(f"buffers its 32-bit offsets can address ({problem})") from ValueError(
        f"{op}: impl='kernel' on {NAME}: {problem}; use impl=None (the XLA implementation then runs) or impl='xla'")


def launch_buffers(spec: contract.OpSpec) -> dict:
    """lower_launch's aliases, fenced operands and buffer names: with per-token scales the scale
    caches are 2 more results aliased to the k_scale / v_scale slots, and (donated, updated in place)
    are not fenced; the extra operands (contract.extra_operands) follow the 14, use_rope fenced."""
    extra = contract.extra_operands(spec)
    if not spec.token_scales and not extra:
        return {}
    return dict(aliases=contract.cache_aliases(spec), fenced=launcher.fenced(spec),
                buffer_names=launcher.buffer_names(spec))


def lower(ctx, args, spec: contract.OpSpec):
    native.refuse_unsupported(spec, SUPPORTS, NAME)
    refuse_token_scales(kernel_config(spec))
    refuse_families(kernel_config(spec))
    refuse_buffer_limits(spec, kernel_config(spec))

    def build(archs):
        cfg = kernel_config(spec)
        table, symbol, objs = build_code_table(cfg, archs)
        return table, symbol, objs[0].config or cfg

    table, symbol, cfg = prepare_launch(ctx, build, "its kernel")
    return launcher.lower_launch(ctx, args, table=table, kernel=symbol, grid_div=cfg.tpb, block=cfg.nt,
                                 grid_y=getattr(cfg, "split", 1), platform="ROCM", **launch_buffers(spec))
