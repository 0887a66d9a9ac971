"""impl="kernel" on NVIDIA GPUs: OpSpec -> CUDA kernel variant -> NVRTC -> the launcher's custom call.

At lowering time the CUDA kernel (kernels/cuda/rope_cache.cu, shipped inside the package) is
compiled by NVRTC for the local GPU's architecture (cubin) plus PTX of the same architecture as a
fallback (a GPU of a newer architecture JIT-compiles it); without a visible CUDA device: sm_90 +
compute_90. Compiled code objects are cached in memory and on disk (compilers/nvrtc.py). The code
objects travel inside the executable: as the PTX of XLA's kernel-node custom call where the running
jaxlib compiles it (backends/kernel_node.py: the kernel's `rope_cache_node` entry, the call's static
dims compiled in), else as the `code` attribute of the FFI launcher's custom call (backends/launcher.py).

Environment: JAX_ROPE_CACHE_NVRTC, a libnvrtc.so to use instead of searching; JAX_ROPE_CACHE_DIR
(compilers/cache.py); JAX_ROPE_CACHE_KERNEL_NODE (backends/kernel_node.py); JAX_ROPE_CACHE_COMMAND_BUFFERS
(backends/launcher.py).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np

from jax_rope_cache import contract
from jax_rope_cache.backends import kernel_node, launcher, native
from jax_rope_cache.compilers import cache, nvrtc

PLATFORM = "cuda"
NAME = "CUDA"
KERNEL_NAME = "rope_cache_kernel"
NODE_KERNEL_NAME = "rope_cache_node"  # the kernel-node entry (RC_NODE builds)
DEFAULT_ARCH = 90
DEFAULT_SMS = 132
# contract.FEATURES the CUDA kernel implements (others: the XLA path, or an error with impl="kernel").
SUPPORTS: frozenset[str] = frozenset({"q_norm", "k_norm", "k_scale_heads", "v_scale_heads", "mrope", "token_scales",
                                      "nope", "rope_switch", "rotary_tail", "gemma_norm", "weightless_norm",
                                      "norm_after", "temperature", "q_gate", "int8_cache", "int4_cache",
                                      "nvfp4_cache", "mxfp4_cache"})


@functools.cache
def kernel_sources(name: str = "rope_cache.cu") -> tuple[str, dict[str, str]]:
    """(the text of kernels/cuda/<name>, {include name: header text}); the MLA op's kernel is
    mla_cache.cu."""
    with open(cache.find_source(f"cuda/{name}")) as f:
        src = f.read()
    with open(cache.find_source("common/rope_cache_math.h")) as f:
        hdr = f.read()
    return src, {"rope_cache_math.h": hdr}


# ---- the static configuration of one variant ----------------------------------------------------
@dataclasses.dataclass(frozen=True)
class KernelConfig:
    defines: tuple[tuple[str, int], ...]
    tokens_per_block: int
    threads: int
    fallback_minb: int = 0  # RC_MINB to build with instead if ptxas spills under this one (0: none)

    @property
    def parts(self) -> int:
        """grid.y: the blocks a block's units are split over (RC_SPLIT)."""
        return dict(self.defines).get("RC_SPLIT", 1)

    def options(self) -> list[str]:
        return define_flags(self.defines)


def define_flags(defines) -> list[str]:
    """-D options of a configuration (bit patterns in hex)."""
    return [f"-D{k}={v:#010x}" if k.endswith("_BITS") else f"-D{k}={v}" for k, v in defines]


# -D name of each KernelCodes field (the configuration rope_cache.cu's header lists).
_DEFINES = (("QH", "qh"), ("KH", "kh"), ("D", "d"), ("R", "r"), ("BS", "bs"), ("LAYOUT", "layout"),
            ("NEOX", "neox"), ("FULL_TABLE", "full_table"), ("NATIVE", "native"), ("DT", "dt"),
            ("TAB_DT", "tab_dt"), ("CACHE_DT", "cache_dt"), ("SLOT64", "slot64"), ("POS64", "pos64"),
            ("LAYER_BLOCKS", "layer_blocks"), ("Q_NORM", "q_norm"), ("K_NORM", "k_norm"),
            ("KS_HEADS", "k_scale_heads"), ("VS_HEADS", "v_scale_heads"), ("MROPE", "mrope"),
            ("MROPE_T", "mrope_t"), ("MROPE_H", "mrope_h"), ("MROPE_W", "mrope_w"))


def _f32_bits(x: float) -> int:
    return int(np.array(x, np.float32).view(np.uint32))


def chunk_width(spec: contract.OpSpec, max_bytes: int = 16) -> int:
    """Elements per vector access: max_bytes of q/k/v where D, R (and R/2 for NeoX) allow."""
    s_in = np.dtype(spec.dtype).itemsize
    w = max(1, max_bytes // s_in)
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
UNITS_PER_BLOCK = 2048  # flash: a block's units (~4-6 per thread) where the grid is one wave (below)
# Flash calls of 256-thread blocks whose grid is not one wave of resident blocks (more than half of
# SMs x PACKED_MINB): blocks of half the tokens, so the last partial wave is shorter (or, under half
# a wave, more blocks are resident); one full wave keeps the larger blocks (no tail). Not where the
# halved block leaves threads idle in its last round of units (busy < HALVED_BUSY_MIN). H200,
# kernel_speed.py, fp32, rule on vs off in one run: Llama-70B TP8 T = 32768 49.1 vs 50.6 us, GPT-OSS
# TP8 T = 8192 5.77 vs 6.16; halving a one-wave grid (Llama-70B TP8 T = 8192) was 14% slower, and
# Qwen3-235B TP4 (79% busy) 1-2% slower (docs/design.md, "Regimes").
HALVE_BLOCKS_OFF_WAVE = True
HALVED_BUSY_MIN = 0.85
UNITS_PER_BLOCK_XP = 8192  # x-packed (up to 32 tokens: two whole runs of 16 slots per block)
# Flash blocks of several units per thread: 256 threads, 4 resident per SM at <= 64 registers
# (1024 threads; 352- or 448-thread blocks fit 3 or 2 at 56-64 registers). H200, kernel_speed.py:
# T = 32768: Llama-8B 5% faster, the fused QK-norm variants 4-8%; x-packed keeps its 512 (faster there).
PACKED_NT, PACKED_MINB = 256, 4
# Channels per x-packed V unit (RC_VCH): 1 is the one-channel writer; 2, 4 or 8 load a token's
# channels as one vector and write a slot run as that many 16-byte pieces. H200 (kernel_speed.py,
# kernel_speed.py): prefill runs 3-12% faster at C = 2..8, random slots 17-100% slower, decode mixed; so
# the static choice stays 1 and runs get their vector units per block (RC_VSEL below).
V_CHANNELS = 1
# M-RoPE blocks of several tokens build each token's merged cos/sin row once in shared memory
# (RC_MROW), so a rotation unit reads one row as in the 1-D op instead of the three streams' rows
# (load_tab3: 3x the table loads and a select per value, for every head). One-token blocks (decode)
# keep load_tab3: there the build would only add its barrier to the latency. Rows above
# MROW_MAX_BYTES (cos and sin together) of shared memory per block keep load_tab3 too.
MROW_MIN_TPB = 2
MROW_MAX_BYTES = 16384
# x-packed blocks with merged rows and ONE kv head: (threads, largest tokens per block). The row
# build and its barrier stall every warp of a block, and 512-thread x-packed blocks (72-80
# registers) are one per SM, so nothing hides the stall; 256-thread blocks are three per SM. H200,
# Qwen3-VL-235B TP4, T = 8192, one run: fused / plain 1.02 (256 threads, 32 tokens) vs 1.12 (512,
# 32) and 1.09 (256, 16). Qwen3-VL-8B (8 kv heads) keeps 512: fused / plain 0.79 there, 1.02 with
# (256, 16); (256, 32) not measured on it. None: the rule off.
MROW_XP_BLOCK: tuple[int, int] | None = (256, 32)
# RC_VSEL: 0 (off), or the channels (2, 4, 8) of the V units of a block whose groups are all aligned
# slot runs, chosen per block at run time (other blocks: the one-channel units). Applies where
# whole runs can exist (x-packed, RC_VCH 1, tokens per block and BS multiples of X); the thread
# count stays the one-channel one. 4: within the 64-register budget of two 512-thread blocks per SM
# for 16-bit caches (8 takes 74-78 registers); fp8 caches get 2 (4 takes 79). Only with several KV
# heads: H200, kernel_speed.py, x-packed prefill (with K_PAIRS): Llama-8B T=8192 70.1 -> 63.1 us,
# GPT-OSS TP1 52.0 -> 50.4; with one KV head neutral or slower (GPT-OSS TP8 T=32768 28.4 -> 32.4).
V_SELECT_CHANNELS = 4
# RC_KPAIRS for x-packed layouts with an even RC_TPB (rope_cache.cu rot_idx): the k heads' rotation
# units paired by token, so a warp's key cache stores fill whole 32-byte sectors of a prefill run
# (the old order: half-sectors). H200, x-packed prefill T=8192: Llama-8B 82.1 -> 63.1 us, GPT-OSS TP1
# 57.6 -> 50.4, Llama-70B TP8 11.8 -> 10.9; random slots and flash unchanged (within 1-5%).
K_PAIRS = 1
# RC_SPLIT: a one-token-per-block call whose token has more than LATENCY_SPLIT_MIN units spreads
# them over ceil(units / LATENCY_SPLIT_UNITS) blocks (grid.y), each thread one unit, where one block
# would give its threads several units in turn (one dependent load chain after the other); a token
# that one block covers with one unit a thread is split only into SMs the grid leaves idle (at most
# SMs / 2T parts). Not split: tokens of <= LATENCY_SPLIT_MIN units and calls of half-width chunks
# (_latency_width). H200, profiler device time per call, T = 1 / 16 / 64 / 128, interleaved runs
# (split as today vs one block): Llama-8B x-packed 2.54 / 2.58 / 2.72 / 3.40 -> 1.52 / 1.72 / 2.17 /
# 3.42 us, GPT-OSS TP1 x-packed 1.88 / 1.94 / 2.07 / 2.58 -> 1.32 / 1.59 / 1.88 / 2.56; flash
# Llama-8B 1.48 / 1.55 -> 1.27 / 1.41 at T = 1 / 16, but 1.65 -> 1.71 at T = 64 (2 or 4 parts):
# hence the idle-SM bound; Qwen3-235B TP4 x-packed (half width, 400 units) split 4-10% slower.
LATENCY_SPLIT_UNITS = 128
LATENCY_SPLIT_MIN = 320


def _rot_lanes(spec: contract.OpSpec, w: int) -> int:
    """Rotation units per head (rope_cache.cu's P: the QK-norm's lanes per head)."""
    return (spec.rotary_dim // 2) // w if spec.is_neox else spec.rotary_dim // w


def _x_packed(spec: contract.OpSpec) -> bool:
    return contract.LAYOUT_TABLE[spec.layout].packed


def _default_group(spec: contract.OpSpec) -> bool:
    """X cache elements are 16 bytes (the default X): what the vector V units (RC_VCH, RC_VSEL) need."""
    return spec.x * np.dtype(spec.cache_dtype).itemsize == 16


def v_group(spec: contract.OpSpec) -> int:
    """Tokens per x-packed V unit when the block's tokens allow (rope_cache.cu's VGX): X where X
    elements fit one 16-byte access, else 16 bytes' worth."""
    s_cache = np.dtype(spec.cache_dtype).itemsize
    return spec.x if spec.x * s_cache <= 16 else 16 // s_cache


def v_channels(spec: contract.OpSpec, want: int = 1) -> int:
    """RC_VCH: the most channels <= want per x-packed V unit that the shape allows (a power of two,
    at most 16 bytes of v, dividing D); 1 for flash, hnd, a non-default X and per-token scales."""
    if not _x_packed(spec) or not _default_group(spec) or spec.token_scales:
        return 1
    c = min(8, _pow2_floor(want), 16 // np.dtype(spec.dtype).itemsize)
    while c > 1 and spec.head_dim % c:
        c //= 2
    return c


def v_select(spec: contract.OpSpec, tpb: int, vch: int, want: int) -> int:
    """RC_VSEL: the run units' channels (as far as the shape allows, v_channels) for blocks of tpb
    tokens, or 0 (off: want < 2, flash, RC_VCH > 1, tokens per block or BS not multiples of X)."""
    x = spec.x
    if want < 2 or not _x_packed(spec) or not _default_group(spec) or vch != 1 or tpb % x or spec.block_size % x:
        return 0
    c = v_channels(spec, want)
    return c if c > 1 else 0


def _block_units(spec: contract.OpSpec, w: int, vch: int = 1):
    """(units(tpb): the units of a block of tpb tokens, units per token) for chunks of w elements and
    x-packed V units of vch channels (rope_cache.cu's N_ROT + N_PASS + N_V; per-token scales: V row
    units of w channels in every layout, from the next multiple of D / w where that is a power of
    two <= 32: V0 + N_V)."""
    d, r, kh = spec.head_dim, spec.rotary_dim, spec.kv_heads
    rh = spec.q_heads + kh
    x = v_group(spec)
    xp = _x_packed(spec) and not spec.token_scales
    units_tok = rh * _rot_lanes(spec, w) + rh * ((d - r) // w)

    ch = d // w
    blocks = spec.cache_format is not None  # NVFP4 / MXFP4: block units (token, k or v, kv head, block)
    v_lanes = spec.token_scales and not blocks and ch & (ch - 1) == 0 and ch <= 32  # V units from a multiple of ch

    def units(tpb):  # x-packed V: one unit per vch channels per group of tokens
        if blocks:
            return tpb * units_tok + tpb * 2 * kh * (d // contract.BLOCK_GROUP[spec.cache_format])
        vg = (x if tpb % x == 0 else tpb) if xp else 1
        v0 = -(-tpb * units_tok // ch) * ch if v_lanes else tpb * units_tok
        return v0 + ((tpb // vg) * kh * (d // vch) if xp else tpb * kh * ch)

    return units, max(1.0, units_tok + (kh * d / (x * vch) if xp else kh * (d // w)))


def _latency_width(spec: contract.OpSpec, w: int, vch: int = 1) -> int:
    """Chunk width of a one-token-per-block call: half of w (8-byte accesses, twice the threads, half
    the serial work per thread) where the block stays <= MAX_THREADS and a QK-norm keeps its lane
    butterfly (<= 32 lanes per head, R == D). H200, kernel_speed.py, T = 1 / 64: Qwen3-32B TP8 2.02 -> 1.83
    / 2.15 -> 1.91 us, with the norm 2.26 -> 1.94 / 2.39 -> 2.16; Llama-8B (448 -> 896 threads)
    2.01 -> 2.08: slower, so not there."""
    half = chunk_width(spec, max_bytes=max(1, w * np.dtype(spec.dtype).itemsize // 2))
    if half >= w or _block_units(spec, half, vch)[0](1) > MAX_THREADS or (spec.int4 and half % 2):
        return w
    d = spec.head_dim
    lanes_path = spec.rotary_dim == d and d & (d - 1) == 0 and _rot_lanes(spec, half) <= 32
    # the generic norm and amax paths: each unit reads its row, so more units is more work
    return half if not (spec.qk_norm or spec.token_scales) or lanes_path else w


def kernel_config(spec: contract.OpSpec, num_sms: int = DEFAULT_SMS, vch: int | None = None,
                  vsel: int | None = None, kpairs: int | None = None) -> KernelConfig:
    """One thread per unit of work (kernels/cuda/rope_cache.cu: rotation, pass-through and V units).
    A block owns RC_TPB tokens; a large call gives each thread several units in turn (fewer, longer
    blocks: 8-15% faster than one unit per thread on the H200, benchmarks/diagnostics/kernel_speed.py;
    halved where the grid is not one wave, HALVE_BLOCKS_OFF_WAVE). A small
    call (decode) gets one token per block, so the grid spreads over the SMs and every thread does
    one unit: latency, not bandwidth (half-width chunks where that fits, _latency_width); a token
    of more than LATENCY_SPLIT_MIN units is split over several blocks (parts, RC_SPLIT).
    vch: channels per x-packed V unit wanted (None: V_CHANNELS), as far as the shape allows.
    vsel: channels of the run units of all-run blocks wanted (None: V_SELECT_CHANNELS; 0: off), see
    v_select; the threads are sized by the one-channel units (_block_units with vch).
    kpairs: k-head rotation units paired by token (None: K_PAIRS), for x-packed layouts with an even
    number of tokens per block (RC_KPAIRS; otherwise not defined: the kernel of today)."""
    w = w0 = chunk_width(spec)
    x = v_group(spec)
    xp = _x_packed(spec)
    vch = v_channels(spec, V_CHANNELS if vch is None else vch)
    units, per_token = _block_units(spec, w, vch)
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
    if tpb == 1 and (w2 := _latency_width(spec, w, vch)) != w:
        w, (units, _) = w2, _block_units(spec, w2, vch)
        nt = MAX_THREADS
    parts = 1  # the split, where the latency width did not already double the threads (measured worse)
    split = tpb == 1 and w == w0 and LATENCY_SPLIT_UNITS > 0
    if split and units(1) > max(LATENCY_SPLIT_MIN, LATENCY_SPLIT_UNITS):
        parts = min(64, -(-units(1) // LATENCY_SPLIT_UNITS))
        if units(1) <= MAX_THREADS:  # one unit a thread already: only into idle SMs
            parts = max(1, min(parts, num_sms // (2 * max(1, t))))  # T = 0: an empty grid, any parts
    per_part = -(-units(tpb) // parts)
    nt = min(nt, max(32, -(-per_part // 32) * 32))
    minb = max(1, 768 // nt)  # register budget: at least 85 per thread (no spills in the CI matrix)
    fallback = 0
    if not xp and units(tpb) >= 2 * PACKED_NT and -(-t // tpb) > num_sms:  # more than one wave of blocks
        nt, fallback = PACKED_NT, max(1, 768 // PACKED_NT)
        minb = PACKED_MINB  # fit_registers builds with `fallback` where this budget spills
        resident = num_sms * PACKED_MINB
        if HALVE_BLOCKS_OFF_WAVE and tpb > base and not resident // 2 < -(-t // tpb) <= resident:
            half = units(tpb // 2)
            busy = half / (-(-half // PACKED_NT) * PACKED_NT)  # of the halved block's thread rounds
            if half >= 2 * PACKED_NT and busy >= HALVED_BUSY_MIN:
                tpb //= 2
    mrow = bool(spec.mrope_section) and tpb >= MROW_MIN_TPB and mrow_bytes(spec, tpb) <= MROW_MAX_BYTES
    if xp and mrow and MROW_XP_BLOCK and spec.kv_heads == 1 and tpb > base:
        nt, tpb = MROW_XP_BLOCK[0], max(base, min(tpb, MROW_XP_BLOCK[1]))
        minb = max(1, 768 // nt)
    # QK-norm weights loaded early (latency) only where the grid is one block per SM at most: the
    # early chunks cost ~8 registers, which in larger calls would take resident blocks away.
    early_w = int(-(-t // tpb) <= num_sms)
    if vsel is None:  # the default: several KV heads only; fp8 caches at most 2 channels (registers)
        vsel = 0 if spec.kv_heads < 2 else min(V_SELECT_CHANNELS, 2) if spec.fp8 or spec.low_bit else V_SELECT_CHANNELS
    vsel = v_select(spec, tpb, vch, vsel)
    c = kernel_codes(spec)
    defines = tuple((f"RC_{name}", int(getattr(c, field))) for name, field in _DEFINES) + (
        ("RC_NORM_EPS_BITS", _f32_bits(c.norm_eps)), ("RC_WCH", w), ("RC_TPB", tpb), ("RC_NT", nt), ("RC_MINB", minb),
        ("RC_VPAIRS", 1), ("RC_VCH", vch), ("RC_VSEL", vsel), ("RC_EARLY_W", early_w))
    if not c.mrope:  # positions [T]: the kernel's defaults (the variant and its cache key as without M-RoPE)
        defines = tuple(d for d in defines if not d[0].startswith("RC_MROPE"))
    elif mrow:
        defines += (("RC_MROW", 1),)
    if c.x:  # a non-default X (the default: no RC_X, the variant and its cache key as before)
        defines += (("RC_X", c.x),)
    if c.qkv:  # the fused QKV input (the default: no RC_QKV, the variant and its cache key as before)
        defines += (("RC_QKV", 1),)
    if c.token_scales:  # per-token fp8 scales (the default: no RC_TOKEN_SCALES, the kernel of before)
        defines += (("RC_TOKEN_SCALES", 1),)
    if c.nb:  # head_major: the blocks per layer (its caches lead with KH); other layouts read NB at run time
        defines += (("RC_NB", c.nb),)
    if (K_PAIRS if kpairs is None else kpairs) and xp and tpb % 2 == 0:
        defines += (("RC_KPAIRS", 1),)
    if parts > 1:
        defines += (("RC_SPLIT", parts),)
    defines = family_defines(spec, defines)
    return KernelConfig(defines=defines, tokens_per_block=tpb, threads=nt, fallback_minb=fallback)


def family_defines(spec: contract.OpSpec, defines: tuple) -> tuple:
    """The model-family options (rope_cache.cu's RC_ROT_OFF ... RC_QGATE) added to `defines`, each only
    where the call uses it, so every other variant (and its cache key) stays what it was. The weightless
    norm normalises q and k without weights: RC_Q_NORM = RC_K_NORM = q's dtype, the weights never read."""
    extra = []
    if spec.rotary_tail and spec.rotary_offset:
        extra.append(("RC_ROT_OFF", spec.rotary_offset))
    if spec.rope_switch:
        extra.append(("RC_USE_ROPE", 1))
    if spec.temperature is not None:
        extra.append(("RC_TEMP_FS", int(spec.temperature[0])))
    if spec.norm_type != "rms" and spec.qk_norm:
        extra.append(("RC_NORM_TYPE", contract.NORM_TYPES.index(spec.norm_type)))
    if spec.norm_after:
        extra.append(("RC_NORM_AFTER", 1))
    if spec.q_gate:
        extra.append(("RC_QGATE", 1))
    if spec.norm_type == "weightless":
        dt = contract.DTYPE_CODES[np.dtype(spec.dtype)]
        defines = tuple((k, dt if k in ("RC_Q_NORM", "RC_K_NORM") else v) for k, v in defines)
    return defines + tuple(extra)


# RcLowBitDtype of kernels/common/rope_cache_math.h: the int8 cache's code (contract.DTYPE_CODES has the
# floating-point formats only).
INT8_CODE, INT4_CODE = 6, 7
BLOCK_CODES = {"nvfp4": 8, "mxfp4": 9}  # RcBlockDtype: NVFP4 / MXFP4 caches (uint8 bytes as int4's)


def kernel_codes(spec: contract.OpSpec) -> contract.KernelCodes:
    """contract.kernel_codes, with an int8 / int4 cache's code (the rest as for a one-byte fp8 cache: X is
    16 bytes either way; an int4 row is D / 2 bytes, which the kernel derives from RC_D)."""
    if spec.low_bit:
        fp8 = dataclasses.replace(spec, cache_dtype=contract.FP8_DTYPES[0])
        code = BLOCK_CODES.get(spec.cache_format, INT8_CODE if spec.int8 else INT4_CODE)
        return dataclasses.replace(contract.kernel_codes(fp8), cache_dt=code)
    return contract.kernel_codes(spec)


def mrow_bytes(spec: contract.OpSpec, tpb: int) -> int:
    """Shared memory of RC_MROW's merged rows: cos and sin rows of the block's tpb tokens."""
    tw = spec.rotary_dim if spec.table_full else spec.rotary_dim // 2
    return 2 * tpb * tw * np.dtype(spec.table_dtype).itemsize


def fit_registers(cfg: KernelConfig, arch: str) -> tuple[KernelConfig, nvrtc.Compiled]:
    """(cfg, its sm_XY build), or the configuration with cfg's fallback register budget and its
    build where ptxas spills under the tighter one (the launch geometry is the same)."""
    c = compile_variant(cfg, arch)
    if cfg.fallback_minb and any(nvrtc.spills(c)):
        defines = tuple((k, cfg.fallback_minb if k == "RC_MINB" else v) for k, v in cfg.defines)
        cfg = dataclasses.replace(cfg, defines=defines, fallback_minb=0)
        c = compile_variant(cfg, arch)
    return cfg, c


BASE_OPTIONS = ("--std=c++17", "--fmad=false", "--ptxas-options=-v", "--device-as-default-execution-space")


def compile_variant(cfg: KernelConfig, arch: str) -> nvrtc.Compiled:
    """NVRTC-compiles one variant for `arch` ("sm_90" or "compute_90"), through the caches."""
    src, headers = kernel_sources()
    opts = list(BASE_OPTIONS) + cfg.options()
    if arch.startswith("compute_"):
        opts.remove("--ptxas-options=-v")
    return nvrtc.compile_cuda(src, arch=arch, options=opts, headers=headers, name="rope_cache.cu")


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
    supported = nvrtc.supported_archs() or [DEFAULT_ARCH]
    target = cc if cc is not None else DEFAULT_ARCH
    entries = []
    if target in supported:
        cfg, c = fit_registers(cfg, f"sm_{target}")
        entries.append((launcher.KIND_CUBIN, f"sm_{target}", c.code))
        ptx_arch = target
    else:  # a GPU newer than this NVRTC: PTX of the newest arch it knows, JIT-compiled by the driver
        ptx_arch = max(a for a in supported if a <= target) if any(a <= target for a in supported) else min(supported)
        cfg, _ = fit_registers(cfg, f"sm_{ptx_arch}")  # the register budget ptxas can meet
    p = compile_variant(cfg, f"compute_{ptx_arch}")
    entries.append((launcher.KIND_PTX, f"compute_{ptx_arch}", p.code))
    return launcher.pack_code_table(entries)


# ---- the backend interface (backends/__init__.py) ------------------------------------------
def missing() -> str | None:
    """What the kernel needs that this process lacks, or None when it can lower."""
    if launcher.launcher_module() is None:
        return launcher.MISSING
    if not nvrtc.available():
        return (f"NVRTC (the CUDA runtime compiler), which was not found ({nvrtc.unavailable_reason()}); "
                "install it with `pip install nvidia-cuda-nvrtc` (jax[cuda13] installs it too)")
    return None


# ---- the kernel-node build (backends/kernel_node.py) -----------------------------------------------
def node_dims(avals_in) -> tuple[int, int, int]:
    """(T, the caches' leading dimension, table rows) of a call's operands: the values the launcher's
    entry reads from its parameter block, compiled into the kernel-node entry."""
    names = contract.OPERANDS
    return (int(avals_in[names.index("q")].shape[0]), int(avals_in[names.index("key_cache")].shape[0]),
            int(avals_in[names.index("cos")].shape[0]))


def check_node_shapes(avals_in, spec: contract.OpSpec) -> None:
    """Every operand's shape is the one `spec` compiles for (what the launcher's initialize stage checks
    per execution, checked once here: the node's buffers are XLA's, of exactly these shapes)."""
    kshape, vshape = contract.cache_shapes(spec.layout, spec.num_blocks, spec.block_size, spec.kv_heads,
                                           spec.head_dim, spec.cache_dtype, spec.x)
    lead = () if spec.num_layers is None else (spec.num_layers,)
    width = spec.rotary_dim if spec.table_full else spec.rotary_dim // 2
    t = spec.num_tokens
    want = {**contract.input_shapes(spec), "key_cache": lead + kshape,
            # rows of D / 2 bytes for the caches of two values a byte (int4, NVFP4, MXFP4)
            "value_cache": contract.value_operand_shape(spec) if vshape is None else lead + vshape,
            "slot_mapping": (t,), "positions": (3, t) if spec.mrope_section else (t,),
            "cos": (spec.max_pos, width), "sin": (spec.max_pos, width),
            "layer": ()}
    if spec.token_scales:  # the scale caches the kernel indexes like the caches
        want["k_scale"] = want["v_scale"] = contract.scale_cache_shape(spec)
    for name, aval in zip(contract.OPERANDS, avals_in):
        if name in want and tuple(aval.shape) != want[name]:
            raise ValueError(f"rope_and_cache (internal): operand {name} has shape {list(aval.shape)}, but the "
                             f"kernel was specialised for {list(want[name])}")


def node_config(cfg: KernelConfig, dims: tuple[int, int, int]) -> KernelConfig:
    """cfg with the kernel-node entry: RC_NODE and the call's dims as constants."""
    t, lead, max_pos = dims
    extra = (("RC_NODE", 1), ("RC_NODE_T", t), ("RC_NODE_LEAD", lead), ("RC_NODE_MAX_POS", max_pos))
    return dataclasses.replace(cfg, defines=cfg.defines + extra)


def build_node_ptx(cfg: KernelConfig, cc: int | None) -> tuple[KernelConfig, nvrtc.Compiled]:
    """(the configuration built, its PTX) for the kernel-node entry: the register budget is the one
    ptxas meets without spilling for the GPU's arch (fit_registers: the sm_XY build's report), the PTX
    of that arch (a GPU newer than this NVRTC: the newest arch it knows, as build_code_table)."""
    supported = nvrtc.supported_archs() or [DEFAULT_ARCH]
    target = cc if cc is not None else DEFAULT_ARCH
    if target in supported:
        ptx_arch = target
    else:
        ptx_arch = max(a for a in supported if a <= target) if any(a <= target for a in supported) else min(supported)
    cfg, _ = fit_registers(cfg, f"sm_{ptx_arch}")
    return cfg, compile_variant(cfg, f"compute_{ptx_arch}")


def refuse_int4_shape(spec: contract.OpSpec) -> None:
    """int4 caches: a thread stores whole bytes (two channels) of its chunk, so the chunks must be of an
    even width (NeoX with an odd R / 2 has one-channel chunks) and X the default; KernelUnavailable
    otherwise (impl=None: the XLA path with a warning, impl="kernel": NotImplementedError)."""
    if not (spec.int4 or spec.cache_format):  # NVFP4 / MXFP4: bytes as int4's
        return
    what = "int4 caches" if spec.int4 else f"{spec.cache_format.upper()} caches"
    why = None
    if chunk_width(spec) % 2:
        why = f"NeoX rotary_dim={spec.rotary_dim} (an odd R / 2 leaves one-channel chunks)"
    elif spec.pack_x:
        why = f"an x-packed group of X={spec.pack_x} bytes (only the default 16)"
    if why is not None:
        raise native.KernelUnavailable(f"{what} with {why}, which the {NAME} kernel does not implement") from (
            NotImplementedError(f"rope_and_cache: impl='kernel' on {NAME}: {what} with {why} are not "
                                "implemented; use impl=None (the XLA implementation then runs) or impl='xla'"))


def lower(ctx, args, spec: contract.OpSpec):
    native.refuse_unsupported(spec, SUPPORTS, NAME)
    refuse_int4_shape(spec)
    cc, sms = _local_cuda_arch()
    cfg = kernel_config(spec, sms)
    if spec.num_tokens > 0 and kernel_node.wanted()[0]:
        check_node_shapes(ctx.avals_in, spec)
        ncfg, ptx = build_node_ptx(node_config(cfg, node_dims(ctx.avals_in)), cc)
        use, _ = kernel_node.decide(ptx.code)
        if use:
            grid = (-(-spec.num_tokens // ncfg.tokens_per_block), ncfg.parts, 1)
            return kernel_node.lower(ctx, args, ptx=ptx.code, kernel=NODE_KERNEL_NAME, grid=grid, block=ncfg.threads,
                                     aliases=contract.cache_aliases(spec), fenced=launcher.fenced(spec))
    return launcher.lower_launch(ctx, args, table=build_code_table(cfg, cc), kernel=KERNEL_NAME,
                                 grid_div=cfg.tokens_per_block, block=cfg.threads, grid_y=cfg.parts,
                                 aliases=contract.cache_aliases(spec), fenced=launcher.fenced(spec),
                                 buffer_names=launcher.buffer_names(spec))
