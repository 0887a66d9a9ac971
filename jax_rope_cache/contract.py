"""Argument checking and the static description of one call (numpy only, shared by every impl).

`check_op` takes anything with `.shape` and `.dtype` (numpy arrays, jax arrays, tracers,
ShapeDtypeStruct) and returns an `OpSpec`, or raises ValueError/TypeError naming the argument,
what was expected and what was given.
"""

from __future__ import annotations

import dataclasses
import math
import numbers

import ml_dtypes
import numpy as np

PRECISIONS = ("fp32", "native")
INPUT_DTYPES = (np.dtype(ml_dtypes.bfloat16), np.dtype(np.float16), np.dtype(np.float32))
FP8_DTYPES = (np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(ml_dtypes.float8_e4m3fnuz), np.dtype(ml_dtypes.float8_e5m2))
INDEX_DTYPES = (np.dtype(np.int32), np.dtype(np.int64))
# Element codes understood by the native kernels (kernels/common/rope_cache_math.h: RcDtype).
DTYPE_CODES = {
    np.dtype(np.float32): 0,
    np.dtype(ml_dtypes.bfloat16): 1,
    np.dtype(np.float16): 2,
    np.dtype(ml_dtypes.float8_e4m3fn): 3,
    np.dtype(ml_dtypes.float8_e4m3fnuz): 4,
    np.dtype(ml_dtypes.float8_e5m2): 5,
}
FP8_MAX = {FP8_DTYPES[0]: 448.0, FP8_DTYPES[1]: 240.0, FP8_DTYPES[2]: 57344.0}
# Per-token fp8 scales (k_scale_cache / v_scale_cache): the floor of a row's absolute maximum, so
# an all-zero (or all non-finite) row gets a finite, nonzero scale (AITER's floor).
TOKEN_AMAX_FLOOR = float(np.float32(1e-8))
# int8 caches (vLLM's int8_per_token_head): always with per-token scales (k_scale_cache / v_scale_cache),
# symmetric, stored values in [-127, 127] (-128 unused, so the range is symmetric).
INT8 = np.dtype(np.int8)
# int4 caches (vLLM's int4_per_token_head): uint8 bytes, two signed 4-bit values each (channel 2i in
# the low nibble, 2i + 1 in the high one, two's complement), the head dim D/2 bytes; per-token
# scales always; stored values in [-7, 7].
INT4 = np.dtype(np.uint8)
# the largest stored magnitude of each quantized cache dtype: a per-token scale is amax / this
QUANT_MAX = {**FP8_MAX, INT8: 127.0, INT4: 7.0}
LOW_BIT = (INT8, INT4)  # cache dtypes that exist only with per-token scales
# Block-scaled 4-bit float caches (NVFP4, MXFP4): uint8 bytes as int4's (two E2M1 values a byte, channel
# 2j in the low nibble, the head dim D/2 bytes), with block-scale caches instead of per-token ones. The
# scale caches' dtype names the format: float8_e4m3fn (one scale per 16 values: NVFP4, with a per-tensor
# float32 global decode scale in k_scale / v_scale) or float8_e8m0fnu (one power of two per 32 values:
# OCP MX v1.0 MXFP4). A block-scale cache has the layout's key-cache axes with D replaced by D / group:
# flash [NB, BS, KH, D/16], hnd [NB, KH, BS, D/16], head_major [KH, NB, BS, D/16] (FlashInfer's
# nvfp4 append writes this linear layout, NHD and HND).
E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
E8M0 = np.dtype(ml_dtypes.float8_e8m0fnu)
BLOCK_FORMATS = ("nvfp4", "mxfp4")
BLOCK_GROUP = {"nvfp4": 16, "mxfp4": 32}  # values per block scale, along the head dim
BLOCK_SCALE_DTYPE = {"nvfp4": E4M3, "mxfp4": E8M0}
BLOCK_FORMAT_OF_SCALE = {E4M3: "nvfp4", E8M0: "mxfp4"}
BLOCK_FORMAT_NAMES = {"nvfp4": "NVFP4", "mxfp4": "MXFP4"}
FP4_MAX = 6.0  # E2M1's largest magnitude
# the layouts a block-scale cache is defined for (x-packed layouts and kv_merged: no reader of
# block scales in them exists to follow, so they are refused)
BLOCK_LAYOUTS = ("flash", "hnd", "head_major")


def cache_head_dim(head_dim: int, cache_dtype) -> int:
    """The cache's last (head) dimension: D elements, D/2 bytes for a packed int4 cache."""
    return head_dim // 2 if np.dtype(cache_dtype) == INT4 else head_dim


def dtype_names(dtypes) -> str:
    return ", ".join(d.name for d in dtypes)


def pack_width(cache_dtype) -> int:
    """The default X of the x-packed layouts: how many elements make 16 bytes."""
    return 16 // np.dtype(cache_dtype).itemsize


def is_pow2(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def check_pack_x(x, head_dim: int, block_size: int | None, layout: str, *, arg: str, x_what: str = "X") -> int:
    """X of an x-packed cache: a power of two dividing D (and BS where the value cache splits
    offsets in X-wide groups); returns it as an int."""
    lay = cache_layout(layout)
    if isinstance(x, bool) or not isinstance(x, numbers.Integral):
        raise TypeError(f"{arg}: expected an int (X, elements per x-packed group), got {describe(x)}")
    x = int(x)
    if not is_pow2(x):
        raise ValueError(f"{arg}: expected {x_what} to be a power of two (1, 2, 4, 8, ...), got X={x}")
    if head_dim % x:
        raise ValueError(f"{arg}: layout {layout!r} needs X to divide the head_dim D={head_dim}, got X={x}")
    if block_size is not None and lay.needs_bs_multiple_of_x and block_size % x:
        raise ValueError(f"{arg}: layout {layout!r} needs X to divide the block size BS={block_size} "
                         f"(value cache [NB, KH, BS//X, D, X]), got X={x}")
    return x


# ---- THE cache-layout table -----------------------------------------------------------------
# One token's values [KH, D] go to block blk = slot // BS, offset off = slot % BS. A layout names,
# per cache, the axes of one layer in memory order, each axis a function of (blk, off, h, d):
#   NB: blk   BS: off   KH: h   D: d   D//X, D%X: d split in X-wide groups   BS//X, BS%X: off split
#   2KH: 2h for the key, 2h + 1 for the value: K and V interleaved by head in ONE array (a
#        "merged" layout: its key and value axes are the same array's, and there is no value cache)
# with X the x-packed key cache's last dimension: a power of two dividing D (and BS where BS is
# split), by default 16 // cache itemsize (16 bytes). The per-token fp8 scale caches have their own
# axes per layout (a permutation of NB, KH, BS). Everything else (shapes, dim strings, divisibility,
# the block-size and head axes, the generic scatter/gather of the reference and the XLA path) is
# derived from this table; only the kernels (kernels/) spell the index arithmetic out, selected by `code`.
AXES = ("NB", "BS", "KH", "2KH", "D", "D//X", "D%X", "BS//X", "BS%X")
_SLOT_AXES = ("NB", "BS", "BS//X", "BS%X")  # indexed per token; the others are a token's values
_DIM_NAMES = {"D%X": "X", "BS%X": "X", "2KH": "2*KH"}


@dataclasses.dataclass(frozen=True)
class CacheLayout:
    name: str
    code: int                    # RcLayout in kernels/common/rope_cache_math.h
    key_axes: tuple[str, ...]
    value_axes: tuple[str, ...]
    scale_axes: tuple[str, ...] = ("NB", "KH", "BS")  # each per-token fp8 scale cache (k_scale_cache, v_scale_cache)

    def axes(self, which: str) -> tuple[str, ...]:
        """The axes of cache `which`: "key", "value" or "scale" (one per-token scale cache)."""
        return {"key": self.key_axes, "value": self.value_axes, "scale": self.scale_axes}[which]

    def dims(self, which: str) -> str:
        """Human-readable shape, e.g. "[NB, KH, D//X, BS, X]"."""
        return "[" + ", ".join(_DIM_NAMES.get(a, a) for a in self.axes(which)) + "]"

    @property
    def merged(self) -> bool:
        """K and V live in one array (the key cache); the op takes no value cache."""
        return "2KH" in self.key_axes

    @property
    def needs_d_multiple_of_x(self) -> bool:
        return any(a.startswith("D") and "X" in a for a in self.key_axes + self.value_axes)

    @property
    def needs_bs_multiple_of_x(self) -> bool:
        return any(a.startswith("BS") and "X" in a for a in self.key_axes + self.value_axes)

    @property
    def packed(self) -> bool:
        """The layout splits D (and maybe BS) in X-wide groups; X is the key cache's last dim."""
        return "D%X" in self.key_axes

    @property
    def blocks_lead(self) -> bool:
        """NB is the caches' first axis (a layer's blocks are contiguous). Kernels that read NB from
        the caches' leading dimension at run time get it as a constant otherwise."""
        return self.key_axes[0] == "NB"

    def shape(self, which: str, num_blocks: int, block_size: int, kv_heads: int, head_dim: int,
              x: int) -> tuple[int, ...]:
        size = {"NB": num_blocks, "BS": block_size, "KH": kv_heads, "2KH": 2 * kv_heads, "D": head_dim,
                "D//X": head_dim // x, "D%X": x, "BS//X": block_size // x, "BS%X": x}
        return tuple(size[a] for a in self.axes(which))

    def token_index(self, which: str, blk, off, x: int) -> tuple:
        """Index of every token's values in cache `which` of one layer: the slot axes take the
        per-token arrays blk/off, the others a slice ("2KH": every other head, from 0 for "key",
        from 1 for "value"; which="kv" takes both, the whole merged axis)."""
        per_token = {"NB": blk, "BS": off, "BS//X": off // x, "BS%X": off % x,
                     "2KH": slice(None) if which == "kv" else slice(int(which == "value"), None, 2)}
        return tuple(per_token.get(a, slice(None)) for a in self.axes("key" if which == "kv" else which))

    def token_split(self, which: str, heads: int, head_dim: int, x: int, lead: int = 0):
        """(shape, perm): values [T, heads, D] (a scale cache: [T, KH]) reshaped to [T, *shape] and
        transposed by perm are in the order `cache[lead indices + token_index(...)]` holds them, with
        `lead` per-token index arrays in front (the layer of stacked caches). numpy and jax put the
        token axis where the per-token indices are when they are adjacent, else first."""
        ax = self.axes("key" if which == "kv" else which)
        tok = tuple("KH" if a == "2KH" else a for a in ax if a not in _SLOT_AXES)
        canon = tuple(a for a in ("KH", "D//X", "D%X") if a in tok) if "D//X" in tok else \
            tuple(a for a in ("KH", "D") if a in tok)
        size = {"KH": heads, "D": head_dim, "D//X": head_dim // x, "D%X": x}
        slot_pos = [i for i, a in enumerate(ax) if a in _SLOT_AXES]
        adjacent = slot_pos == list(range(slot_pos[0], slot_pos[0] + len(slot_pos)))
        t_at = slot_pos[0] if lead == 0 and adjacent else 0
        order = [1 + canon.index(a) for a in tok]
        return tuple(size[a] for a in canon), tuple(order[:t_at] + [0] + order[t_at:])

    def head_axis(self, which: str) -> int:
        """The kv-head axis of one layer's cache `which` ("key", "value", "scale"): where tensor
        parallelism splits it (a merged array's 2*KH axis splits into whole (K, V) pairs when each
        shard gets a whole number of kv heads)."""
        ax = self.axes(which)
        return ax.index("2KH") if "2KH" in ax else ax.index("KH")

    def kv_heads(self, key_shape: tuple[int, ...]) -> int:
        """KH of a key cache of one layer (a merged array holds 2*KH heads)."""
        if "2KH" in self.key_axes:
            return key_shape[self.key_axes.index("2KH")] // 2
        return key_shape[self.key_axes.index("KH")]

    def head_dim(self, key_shape: tuple[int, ...], x: int) -> int:
        ax = self.key_axes
        return key_shape[ax.index("D")] if "D" in ax else key_shape[ax.index("D//X")] * x

    def cache_x(self, which: str, shape: tuple[int, ...], cache_dtype) -> int:
        """X of one layer's cache `which` of this shape: its last dim where an X axis is last (the
        x-packed key cache, the shuffled value cache), else the default (X unused)."""
        ax = self.axes(which)
        return int(shape[-1]) if ax[-1].endswith("%X") else pack_width(cache_dtype)

    def block_geometry(self, key_shape: tuple[int, ...], x: int) -> tuple[int, int]:
        """(NB, BS) read off a key cache shape of the right rank."""
        ax = self.key_axes
        bs = key_shape[ax.index("BS")] if "BS" in ax else key_shape[ax.index("BS//X")] * x
        return key_shape[ax.index("NB")], bs


LAYOUT_TABLE = {layout.name: layout for layout in (
    CacheLayout("flash", 0, ("NB", "BS", "KH", "D"), ("NB", "BS", "KH", "D")),
    CacheLayout("xpacked", 1, ("NB", "KH", "D//X", "BS", "D%X"), ("NB", "KH", "D", "BS")),
    CacheLayout("xpacked_shuffled", 2, ("NB", "KH", "D//X", "BS", "D%X"), ("NB", "KH", "BS//X", "D", "BS%X")),
    CacheLayout("hnd", 3, ("NB", "KH", "BS", "D"), ("NB", "KH", "BS", "D")),
    # JAX's Pallas paged attention (GPU and TPU): k_pages / v_pages [KH, total_pages, page_size, D],
    # k_scales_pages [KH, total_pages, page_size]
    CacheLayout("head_major", 4, ("KH", "NB", "BS", "D"), ("KH", "NB", "BS", "D"), ("KH", "NB", "BS")),
    # JAX's Pallas ragged paged attention (TPU): kv_pages [total_pages, page_size, 2*KH, D]
    CacheLayout("kv_merged", 5, ("NB", "BS", "2KH", "D"), ("NB", "BS", "2KH", "D")),
)}
LAYOUTS = tuple(LAYOUT_TABLE)


def _table_is_consistent(lay: CacheLayout) -> bool:
    both = lay.key_axes + lay.value_axes
    return (set(both) <= set(AXES) and sorted(lay.scale_axes) == ["BS", "KH", "NB"]
            and all("NB" in a and ("KH" in a) != ("2KH" in a) for a in (lay.key_axes, lay.value_axes))
            and (lay.packed or not lay.needs_bs_multiple_of_x) and (not lay.merged or lay.key_axes == lay.value_axes))


assert all(_table_is_consistent(lay) for lay in LAYOUT_TABLE.values())


def cache_layout(layout: str) -> CacheLayout:
    if layout not in LAYOUT_TABLE:
        raise ValueError(f"layout: expected one of {LAYOUTS}, got {layout!r}")
    return LAYOUT_TABLE[layout]


def cache_shapes(layout: str, num_blocks: int, block_size: int, kv_heads: int, head_dim: int,
                 cache_dtype, x: int | None = None) -> tuple[tuple[int, ...], tuple[int, ...] | None]:
    """(key_cache shape, value_cache shape) of one layer for `layout`; the value cache's is None for
    a merged layout (K and V in the one key_cache array); `x`: X of an x-packed layout (None: the
    default 16 // itemsize). head_dim is D, the values of a row: a uint8 (int4) cache holds D/2 bytes."""
    return storage_shapes(layout, num_blocks, block_size, kv_heads, cache_head_dim(head_dim, cache_dtype),
                          cache_dtype, x)


def storage_shapes(layout: str, num_blocks: int, block_size: int, kv_heads: int, last_dim: int,
                   cache_dtype, x: int | None = None) -> tuple[tuple[int, ...], tuple[int, ...] | None]:
    """cache_shapes with the row's stored elements (`last_dim`: D, or D/2 bytes of int4) given."""
    lay, x = cache_layout(layout), pack_width(cache_dtype) if x is None else x
    kshape = lay.shape("key", num_blocks, block_size, kv_heads, last_dim, x)
    return kshape, None if lay.merged else lay.shape("value", num_blocks, block_size, kv_heads, last_dim, x)


def block_scale_shape(layout: str, num_blocks: int, block_size: int, kv_heads: int, head_dim: int,
                      fmt: str) -> tuple[int, ...]:
    """The shape of one layer's block-scale cache of format `fmt` ("nvfp4", "mxfp4") for `layout`: the
    key cache's axes with D / group scales a row (e.g. flash [NB, BS, KH, D/16])."""
    return cache_layout(layout).shape("key", num_blocks, block_size, kv_heads, head_dim // BLOCK_GROUP[fmt], 1)


def scale_shape(layout: str, num_blocks: int, block_size: int, kv_heads: int) -> tuple[int, ...]:
    """The shape of one layer's per-token scale cache for `layout` (e.g. [NB, KH, BS])."""
    return cache_layout(layout).shape("scale", num_blocks, block_size, kv_heads, 1, 1)


def check_layout_divisibility(layout: str, head_dim: int, block_size: int, cache_dtype, *, head_arg: str,
                              block_arg: str, x: int | None = None) -> None:
    """D (and BS) must be multiples of X where the layout splits them into X-wide groups."""
    lay, name = cache_layout(layout), np.dtype(cache_dtype).name
    x = pack_width(cache_dtype) if x is None else x
    if lay.needs_d_multiple_of_x and head_dim % x:
        raise ValueError(f"{head_arg}: layout {layout!r} with {name} needs a multiple of X={x}, got {head_dim}")
    if lay.needs_bs_multiple_of_x and block_size % x:
        raise ValueError(f"{block_arg}: layout {layout!r} with {name} needs a multiple of X={x}, got {block_size}")


# ---- host index arrays on a device without 64-bit integers -----------------------------------
# With jax_enable_x64 off JAX narrows int64 host arrays to int32, which would wrap slot 2**32 + 1
# into slot 1 and position 2**32 + 3 into row 3. The library's entry points see the host values and
# give each its meaning in the contract first (any slot outside [0, num_slots) -> -1, no write;
# positions clamped to the table), then narrow. Inside a user's jit JAX has narrowed already.
INT32_MAX = 2**31 - 1


def narrow_slots(slot_mapping, num_slots: int, arg: str = "slot_mapping") -> np.ndarray:
    """int32 slots with the same meaning as the (wider) host slots `slot_mapping`."""
    s = np.asarray(slot_mapping)
    out = np.where((s >= 0) & (s < num_slots), s, -1)
    if out.size and out.max() > INT32_MAX:
        raise ValueError(f"{arg}: slot {int(out.max())} is valid for a cache of {num_slots} slots but does "
                         "not fit the int32 indices JAX uses with jax_enable_x64 off; enable it "
                         "(jax.config.update('jax_enable_x64', True)) to address slots >= 2**31")
    return out.astype(np.int32)


def narrow_positions(positions, max_pos: int, arg: str = "positions") -> np.ndarray:
    """int32 positions with the same meaning (clamped to [0, max_pos - 1]) as the host positions."""
    p = np.clip(np.asarray(positions), 0, max_pos - 1)
    if p.size and p.max() > INT32_MAX:
        raise ValueError(f"{arg}: position {int(p.max())} is a valid row of a table of {max_pos} rows but "
                         "does not fit the int32 indices JAX uses with jax_enable_x64 off; enable it")
    return p.astype(np.int32)


# Operand order of the primitive and every native handler; the caches are updated in place.
# An absent norm weight is a float32[1] placeholder (never read); scales are f32 [] (absent: 1), [1] or [KH].
OPERANDS = ("q", "k", "v", "key_cache", "value_cache", "slot_mapping", "positions", "cos", "sin",
            "k_scale", "v_scale", "layer", "q_norm_weight", "k_norm_weight")
RESULTS = ("q_out", "k_out", "key_cache", "value_cache")
CACHE_ALIASES = {OPERANDS.index("key_cache"): 2, OPERANDS.index("value_cache"): 3}  # operand -> result
# Per-token scales (OpSpec.token_scales): the k_scale / v_scale operand slots carry the scale caches,
# which are two more results aliased to them; the operand list is the same.
TOKEN_SCALE_RESULTS = ("k_scale_cache", "v_scale_cache")
TOKEN_SCALE_ALIASES = {**CACHE_ALIASES, OPERANDS.index("k_scale"): 4, OPERANDS.index("v_scale"): 5}
# Operands after OPERANDS, present only when the call uses them (every implementation gets the same
# list): use_rope, an int32 [] switch (OpSpec.rope_switch, nonzero rotates); temperature_factors, the
# float32 [max_pos // floor_scale + 1] table of reference.temperature_factors (OpSpec.temperature),
# indexed by n = (clamp(p, 0, max_pos - 1) + 1) // floor_scale, so always in range.
# k_global_scale / v_global_scale: NVFP4's float32 [] global decode scales (OpSpec.cache_format "nvfp4").
EXTRA_OPERANDS = ("use_rope", "temperature_factors", "k_global_scale", "v_global_scale")


def extra_operands(spec) -> tuple[str, ...]:
    """The EXTRA_OPERANDS of a call, in operand order."""
    nv = getattr(spec, "cache_format", None) == "nvfp4"
    used = {"use_rope": spec.rope_switch, "temperature_factors": spec.temperature is not None,
            "k_global_scale": nv, "v_global_scale": nv}
    return tuple(n for n in EXTRA_OPERANDS if used[n])


def results(spec: "OpSpec") -> tuple[str, ...]:
    """The primitive's results: RESULTS, then the scale caches with per-token scales."""
    return RESULTS + (TOKEN_SCALE_RESULTS if spec.token_scales else ())


def cache_aliases(spec: "OpSpec") -> dict[int, int]:
    """operand -> result aliases of a kernel lowering: the caches, and the scale caches when written."""
    return TOKEN_SCALE_ALIASES if spec.token_scales else CACHE_ALIASES


def scale_cache_shape(spec: "OpSpec") -> tuple[int, ...]:
    """One float32 scale per slot and kv head: the layout's scale axes, e.g. [NB, KH, BS]
    (stacked: [L, NB, KH, BS]); NVFP4 / MXFP4: the block-scale caches (block_scale_shape)."""
    lead = () if spec.num_layers is None else (spec.num_layers,)
    if spec.cache_format is not None:
        return lead + block_scale_shape(spec.layout, spec.num_blocks, spec.block_size, spec.kv_heads,
                                        spec.head_dim, spec.cache_format)
    return lead + scale_shape(spec.layout, spec.num_blocks, spec.block_size, spec.kv_heads)


def scale_cache_dtype(spec: "OpSpec") -> np.dtype:
    """The scale caches' dtype: float32 per-token scales, or the block scales' (E4M3, E8M0)."""
    return np.dtype(np.float32) if spec.cache_format is None else BLOCK_SCALE_DTYPE[spec.cache_format]


def value_operand_shape(spec: "OpSpec") -> tuple[int, ...]:
    """The value_cache operand's shape: the cache's, or for a merged layout (no value cache) a
    one-element placeholder per layer, [1] (stacked: [L, 1]), which no kernel reads or writes (one
    per layer so vmap's stacked-layer indexing treats it as any cache)."""
    lead = () if spec.num_layers is None else (spec.num_layers,)
    lay = LAYOUT_TABLE[spec.layout]
    if lay.merged:
        return lead + (1,)
    return lead + lay.shape("value", spec.num_blocks, spec.block_size, spec.kv_heads, spec.head_dim, spec.x)

# Small operands a decode loop typically indexes per step (slots[n], positions[n], weights[layer]):
# the GPU lowering passes them through an optimization barrier (backends/launcher.lower_launch).
FENCED_OPERANDS = ("slot_mapping", "positions", "k_scale", "v_scale", "layer", "q_norm_weight", "k_norm_weight")


@dataclasses.dataclass(frozen=True)
class OpSpec:
    """Everything static about one call (JAX shapes and dtypes are static)."""

    num_tokens: int
    q_heads: int
    kv_heads: int
    head_dim: int
    rotary_dim: int
    num_blocks: int
    block_size: int
    max_pos: int
    layout: str
    is_neox: bool
    table_full: bool  # cos/sin width R (one value per channel) instead of R/2
    precision: str
    dtype: np.dtype  # q, k, v and outputs
    table_dtype: np.dtype
    cache_dtype: np.dtype
    slot_dtype: np.dtype
    pos_dtype: np.dtype
    num_layers: int | None = None  # caches stacked as [L, ...] and indexed by the `layer` operand
    q_norm_dtype: np.dtype | None = None  # q_norm_weight's dtype (q's or float32); None: no q norm
    k_norm_dtype: np.dtype | None = None
    norm_eps: float = 0.0  # float32(norm_eps) as a Python float; 0.0 when neither norm is on
    k_scale_heads: bool = False  # k_scale has shape [KH] (one scale per kv head), else a scalar
    v_scale_heads: bool = False
    # multimodal RoPE: (temporal, height, width) frequency counts, summing to R/2; positions [3, T]
    mrope_section: tuple[int, int, int] | None = None
    mrope_interleaved: bool = False  # False: contiguous sections; True: frequencies interleaved T,H,W,...
    # X of an x-packed layout when it is not the default 16 // cache itemsize (the key cache's last
    # dimension); 0: the default (and every layout without X)
    pack_x: int = 0
    # the fused QKV input (rope_and_cache_qkv): the q, k and v operands are each the one tensor
    # [T, QH + 2 KH, D] (q heads, then k heads, then v heads of a token in one row); False: q [T, QH, D],
    # k and v [T, KH, D]
    qkv: bool = False
    # per-token fp8 quantization: the k_scale / v_scale operands are the scale caches [NB, KH, BS]
    # (stacked [L, NB, KH, BS]) and the op writes one scale per (token, kv head) into them
    token_scales: bool = False
    # ---- model families (check_families): NoPE layers, tail rotary, norm variants, temperature, gated q
    rotary_tail: bool = False  # rotary channels [D - R, D) (rotary_position="tail"), else [0, R)
    rope_switch: bool = False  # a traced use_rope operand (last operand) switches the rotation per call
    norm_type: str = "rms"  # "rms" (w * n, Qwen3), "gemma" ((1 + w) * n), "weightless" (n, Llama 4; q and k)
    norm_after: bool = False  # the norm runs on the rotated q and k (norm_position="after", Llama 4)
    temperature: tuple[int, float] | None = None  # (floor_scale, attn_scale): Llama 4's q scale on NoPE layers
    q_gate: bool = False  # fused QKV rows hold [q_h, gate_h] per q head (Qwen3-Next's gated attention)
    # "nvfp4" / "mxfp4": a uint8 cache of E2M1 pairs with block-scale caches (token_scales is then True:
    # the scale caches take the k_scale / v_scale operand slots); None: every other cache
    cache_format: str | None = None

    @property
    def norm(self) -> bool:
        return self.q_norm_dtype is not None or self.k_norm_dtype is not None

    @property
    def table_form(self) -> str:
        return "full" if self.table_full else "half"

    @property
    def fp8(self) -> bool:
        return self.cache_dtype in FP8_DTYPES

    @property
    def int8(self) -> bool:
        return self.cache_dtype == INT8

    @property
    def int4(self) -> bool:
        return self.cache_dtype == INT4 and self.cache_format is None

    @property
    def low_bit(self) -> bool:
        return self.cache_dtype in LOW_BIT

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def x(self) -> int:
        return self.pack_x or pack_width(self.cache_dtype)

    @property
    def qkv_heads(self) -> int:
        """Heads in one token's row of the fused QKV tensor: QH + 2 KH (2 QH + 2 KH with the q gate)."""
        return self.q_heads * (2 if self.q_gate else 1) + 2 * self.kv_heads

    @property
    def rotary_offset(self) -> int:
        """The first rotary channel: 0, or D - R with rotary_position="tail"."""
        return self.head_dim - self.rotary_dim if self.rotary_tail else 0

    @property
    def qk_norm(self) -> bool:
        """Some norm runs on q or k (a weight given, or the weightless norm on both)."""
        return self.norm or self.norm_type == "weightless"


def input_shapes(spec: OpSpec) -> dict[str, tuple[int, ...]]:
    """The shapes of the q, k and v operands: each the fused [T, QH + 2 KH, D] tensor with spec.qkv."""
    t, d = spec.num_tokens, spec.head_dim
    if spec.qkv:
        return dict.fromkeys(("q", "k", "v"), (t, spec.qkv_heads, d))
    return {"q": (t, spec.q_heads, d), "k": (t, spec.kv_heads, d), "v": (t, spec.kv_heads, d)}


def input_offsets(spec: OpSpec) -> tuple[int, int, int, int]:
    """(q row, k/v row, k offset, v offset) in elements: where the kernels read head h of token t
    (q: t * q_row + h * D; k: t * kv_row + k_off + h * D; v: t * kv_row + v_off + h * D)."""
    qh, kh, d = spec.q_heads, spec.kv_heads, spec.head_dim
    if spec.qkv:
        row, nq = spec.qkv_heads * d, spec.qkv_heads - 2 * kh  # nq: QH, or 2 QH with the q gate
        return row, row, nq * d, (nq + kh) * d
    return qh * d, kh * d, 0, 0


def _check_heads(arg: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{arg}: expected an int (a head count), got {describe(value)}")
    if int(value) < 1:
        raise ValueError(f"{arg}: expected a head count >= 1, got {int(value)}")
    return int(value)


def check_qkv(qkv, num_q_heads, num_kv_heads, q_gate=False) -> tuple[int, int, int, int]:
    """Validates the fused QKV tensor of rope_and_cache_qkv: [T, (QH + 2 KH) * D] or [T, QH + 2 KH, D],
    each token's q heads first, then its k heads, then its v heads (with q_gate: 2 QH q heads, each
    q head followed by its gate). Returns (T, QH, KH, D)."""
    qh = _check_heads("num_q_heads", num_q_heads)
    kh = _check_heads("num_kv_heads", num_kv_heads)
    if not isinstance(q_gate, (bool, np.bool_)):
        raise TypeError(f"q_gate: expected a Python bool, got {describe(q_gate)}")
    dtype = _dtype("qkv", qkv)
    if dtype not in INPUT_DTYPES:
        raise TypeError(f"qkv: expected dtype one of ({dtype_names(INPUT_DTYPES)}), got {dtype.name}")
    nq, qs = (2 * qh, "2 QH") if q_gate else (qh, "QH")
    shape, n = tuple(int(s) for s in qkv.shape), nq + 2 * kh
    if len(shape) == 3:
        if shape[1] != n:
            raise ValueError(f"qkv: expected shape [T, {qs} + 2 KH, D] with {qs} + 2 KH = {nq} + 2*{kh} = {n} heads "
                             f"(num_q_heads, num_kv_heads{', q_gate' if q_gate else ''}), got {list(shape)}")
        return shape[0], qh, kh, shape[2]
    if len(shape) != 2:
        raise ValueError(f"qkv: expected rank 2 [T, ({qs} + 2 KH) * D] or rank 3 [T, {qs} + 2 KH, D], "
                         f"got shape {list(shape)}")
    if shape[1] % n or shape[1] == 0:
        raise ValueError(f"qkv: expected a last dim ({qs} + 2 KH) * D divisible by {qs} + 2 KH = {nq} + 2*{kh} = {n} "
                         f"(num_q_heads, num_kv_heads{', q_gate' if q_gate else ''}), got shape {list(shape)}")
    return shape[0], qh, kh, shape[1] // n


def _dtype(arg: str, a) -> np.dtype:
    if not hasattr(a, "shape") or not hasattr(a, "dtype"):
        raise TypeError(f"{arg}: expected an array, got {type(a).__name__}")
    return np.dtype(a.dtype)


def _check_rank(arg: str, a, rank: int, dims: str) -> tuple[int, ...]:
    shape = tuple(a.shape)
    if len(shape) != rank:
        raise ValueError(f"{arg}: expected rank {rank} {dims}, got shape {list(shape)}")
    return shape


def _check_shape(arg: str, a, expected: tuple[int, ...], dims: str) -> None:
    _check_rank(arg, a, len(expected), dims)
    if tuple(a.shape) != tuple(expected):
        raise ValueError(f"{arg}: expected shape {dims} = {list(expected)}, got {list(a.shape)}")


def describe(value) -> str:
    """What a value is, for error messages: an array (or a tracer of one) by dtype and shape, a
    number by its repr, anything else by its type name; never a tracer's own repr."""
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        try:
            name = np.dtype(value.dtype).name
        except TypeError:
            name = str(value.dtype)
        return f"{'an' if name[:1] in 'aeiou' else 'a'} {name}{list(value.shape)} array"
    if isinstance(value, (numbers.Number, str)) and not isinstance(value, bool):
        return repr(value)
    return type(value).__name__


def is_float_dtype(dtype) -> bool:
    """A real floating dtype: numpy's (float16/32/64) and ml_dtypes' (bfloat16, the float8s)."""
    dt = np.dtype(dtype)
    if dt.kind == "f":
        return True
    if dt.kind != "V":
        return False
    try:
        ml_dtypes.finfo(dt)
    except (ValueError, TypeError):
        return False
    return True


def check_scale(arg: str, scale, fp8: bool, cache_dtype, kv_heads: int | None = None) -> bool:
    """A scale is a Python int/float or an array of any float dtype (numpy, ml_dtypes or jax) of shape
    () or (1,) (one scale), or [KH] (one per kv head; `kv_heads` given): every implementation uses it
    as float32. Integer, bool and complex arrays are not. Returns True for a per-head scale."""
    if not fp8:
        if scale is not None:
            raise ValueError(f"{arg}: scales apply to float8 caches only; expected None for a "
                             f"{np.dtype(cache_dtype).name} cache, got {describe(scale)}")
        return False
    if scale is None:
        raise ValueError(f"{arg}: a {np.dtype(cache_dtype).name} cache needs a scale; expected a "
                         f"float scalar (used as float32), got None")
    if isinstance(scale, (int, float)) and not isinstance(scale, bool) and not hasattr(scale, "dtype"):
        return False  # a Python number; numpy and jax scalars go by their dtype below
    shapes = "shape () or (1,)" + (f" or [KH] = ({kv_heads},)" if kv_heads is not None else "")
    if isinstance(scale, (bool, np.bool_)) or not hasattr(scale, "dtype") or not hasattr(scale, "shape"):
        raise TypeError(f"{arg}: expected a float scalar or per-head vector ({shapes}; used as float32), "
                        f"got {type(scale).__name__}")
    shape = tuple(scale.shape)
    per_head = kv_heads is not None and kv_heads > 1 and shape == (kv_heads,)
    if not is_float_dtype(scale.dtype) or (shape not in ((), (1,)) and not per_head):
        raise TypeError(f"{arg}: expected a float scalar or per-head vector (any float dtype, {shapes}; "
                        f"used as float32), got {describe(scale)}")
    return per_head


def check_norm_weight(arg: str, weight, head_dim: int, dtype) -> np.dtype | None:
    """An RMSNorm weight: None, or an array of shape [D] in q's dtype or float32; returns its dtype."""
    if weight is None:
        return None
    dtype = np.dtype(dtype)
    allowed = (dtype,) if dtype == np.float32 else (dtype, np.dtype(np.float32))
    if not hasattr(weight, "shape") or not hasattr(weight, "dtype"):
        raise TypeError(f"{arg}: expected None or an array [D={head_dim}] of dtype {dtype_names(allowed)}, "
                        f"got {describe(weight)}")
    if np.dtype(weight.dtype) not in allowed:
        raise TypeError(f"{arg}: expected dtype {' or '.join(d.name for d in allowed)} (q's dtype or float32), "
                        f"got {np.dtype(weight.dtype).name}")
    if tuple(weight.shape) != (head_dim,):
        raise ValueError(f"{arg}: expected shape [D] = [{head_dim}] (the full head_dim, one weight shared by "
                         f"every head), got {list(weight.shape)}")
    return np.dtype(weight.dtype)


def check_norm_eps(norm_eps) -> float:
    """norm_eps: a static float (a Python float, or a numpy / concrete jax scalar of a float dtype),
    finite and > 0 once rounded to float32; returns float32(norm_eps) as a Python float."""
    if isinstance(norm_eps, float):  # np.float64 too
        value = norm_eps
    elif (hasattr(norm_eps, "dtype") and hasattr(norm_eps, "shape") and is_float_dtype(norm_eps.dtype)
          and tuple(norm_eps.shape) == ()):
        try:
            value = float(np.asarray(norm_eps).astype(np.float64))
        except Exception:  # noqa: BLE001 - a tracer has no value: norm_eps must be static
            raise TypeError(f"norm_eps: expected a static float (not a traced value), got {describe(norm_eps)}") from None
    else:
        raise TypeError(f"norm_eps: expected a float (used as float32), got {describe(norm_eps)}")
    with np.errstate(over="ignore"):
        eps32 = np.float32(value)
    if not (np.isfinite(eps32) and eps32 > 0):
        raise ValueError(f"norm_eps: expected a finite value > 0 (as float32), got {value!r}")
    return float(eps32)


def check_value_cache(value_cache, layout: str) -> None:
    """A merged layout (K and V in the key_cache array) takes no value cache; every other needs one."""
    lay = cache_layout(layout)
    if lay.merged and value_cache is not None:
        raise ValueError(f"value_cache: layout {layout!r} keeps K and V in one array (key_cache {lay.dims('key')}: "
                         f"K head h at 2h, V head h at 2h + 1); expected None, got {describe(value_cache)}")
    if not lay.merged and value_cache is None:
        merged = ", ".join(repr(n) for n, m in LAYOUT_TABLE.items() if m.merged)
        raise ValueError(f"value_cache: layout {layout!r} needs a value cache {lay.dims('value')}; expected an array, "
                         f"got None (only a merged layout, {merged}, takes None)")


def check_distinct_caches(key_cache, value_cache) -> None:
    """The same array (or jax.Ref) as both caches would make the V writes overwrite the K writes."""
    if value_cache is not None and key_cache is value_cache:
        raise ValueError("value_cache: expected a different array from key_cache, got the same "
                         f"{type(value_cache).__name__} for both (the V writes would overwrite the K writes); "
                         "allocate one cache per K and V, e.g. with make_kv_cache")


@dataclasses.dataclass(frozen=True)
class _LayerView:
    """Shape and dtype of one layer of a stacked cache."""

    shape: tuple[int, ...]
    dtype: np.dtype


def check_layer(layer, key_cache, value_cache, layout: str):
    """Validates `layer` and returns (per-layer key view, value view, number of layers or None)."""
    if layer is None:
        return key_cache, value_cache, None
    if isinstance(layer, bool) or not (isinstance(layer, numbers.Integral) or (
            hasattr(layer, "dtype") and np.issubdtype(np.dtype(layer.dtype), np.integer) and tuple(layer.shape) == ())):
        raise TypeError(f"layer: expected None, an int or an integer scalar array, got {describe(layer)}")
    lay = cache_layout(layout)
    caches = (("key_cache", key_cache, "key"),) + ((("value_cache", value_cache, "value"),) if not lay.merged else ())
    for name, a, which in caches:
        rank, dims = len(lay.axes(which)), lay.dims(which)
        _dtype(name, a)
        _check_rank(name, a, rank + 1, f"[L, {dims[1:]} (stacked layers, as layer is given) for layout {layout!r}")
    if not lay.merged and value_cache.shape[0] != key_cache.shape[0]:
        raise ValueError(f"value_cache: expected {key_cache.shape[0]} layers (as key_cache), "
                         f"got shape {list(value_cache.shape)}")
    num_layers = key_cache.shape[0]
    if isinstance(layer, numbers.Integral) and not 0 <= layer < num_layers:
        raise ValueError(f"layer: expected 0 <= layer < {num_layers}, got {layer}")
    view = lambda a: None if a is None else _LayerView(tuple(a.shape[1:]), np.dtype(a.dtype))  # noqa: E731
    return view(key_cache), view(value_cache), num_layers


def _check_merged_heads(kshape: tuple[int, ...], lay: CacheLayout) -> None:
    """A merged array's head axis holds a (K, V) pair per kv head: it must be even."""
    if lay.merged and kshape[lay.key_axes.index("2KH")] % 2:
        raise ValueError(f"key_cache: layout {lay.name!r} interleaves K and V by head (K head h at 2h, V head h at "
                         f"2h + 1), so {lay.dims('key')} needs an even head axis 2*KH, got shape {list(kshape)}")


def _key_cache_geometry(key_cache, lay: CacheLayout, cache_dtype) -> tuple[tuple[int, ...], int, int, int]:
    """(key_cache shape, X, NB, BS) of a key cache of layout `lay` (rank checked; an x-packed
    layout's X is the key cache's last dimension, a power of two)."""
    kdims = lay.dims("key")
    kshape = _check_rank("key_cache", key_cache, len(lay.key_axes), f"{kdims} for layout {lay.name!r}")
    x = pack_width(cache_dtype)
    if lay.packed:
        x = kshape[lay.key_axes.index("D%X")]
        if not is_pow2(x):
            raise ValueError(f"key_cache: expected X (the last dim of {kdims} for layout {lay.name!r}) to be a "
                             f"power of two (e.g. {pack_width(cache_dtype)} = 16 bytes of "
                             f"{np.dtype(cache_dtype).name}), got shape {list(kshape)}")
    return (kshape, x) + lay.block_geometry(kshape, x)


# ---- multimodal RoPE (M-RoPE): three position streams ---------------------------------------
# positions [3, T] holds a temporal, a height and a width position per token. Rotary frequency i
# (pair i, i < R/2) takes its cos/sin row from one stream, fixed per call site by
# mrope_section = (t, h, w), t + h + w = R/2:
#   sections (Qwen2-VL, Qwen2.5-VL):  i < t -> temporal, t <= i < t + h -> height, else width
#   interleaved (Qwen3-VL):           i % 3 == 1 and i < 3h -> height, i % 3 == 2 and i < 3w -> width,
#                                     every other i -> temporal
# Each stream's position is clamped to [0, max_pos - 1] on its own. A token whose three positions
# are equal (text) gets exactly the one-stream result.
MROPE_STREAMS = ("temporal", "height", "width")


def mrope_stream(i, section, interleaved: bool):
    """Stream (0 temporal, 1 height, 2 width) of rotary frequency i (an int or an integer array)."""
    t, h, w = section
    i = np.asarray(i)
    if interleaved:
        return np.where((i % 3 == 1) & (i < 3 * h), 1, np.where((i % 3 == 2) & (i < 3 * w), 2, 0))
    return np.where(i < t, 0, np.where(i < t + h, 1, 2))


def mrope_frequency_streams(spec: "OpSpec") -> np.ndarray:
    """Stream of each rotary frequency i < R/2 of an M-RoPE call (int array [R/2])."""
    return mrope_stream(np.arange(spec.rotary_dim // 2), spec.mrope_section, spec.mrope_interleaved).astype(np.int64)


def mrope_column_streams(spec: "OpSpec") -> np.ndarray:
    """Stream of each cos/sin table column (int array [W]): a "half" column i is frequency i; a
    "full" column c belongs to the pair it serves (NeoX: c mod R/2; GPT-J: c // 2)."""
    freq = mrope_frequency_streams(spec)
    half = spec.rotary_dim // 2
    if not spec.table_full:
        return freq
    c = np.arange(spec.rotary_dim)
    return freq[c % half] if spec.is_neox else freq[c // 2]


def check_mrope(mrope_section, mrope_interleaved, rotary_dim: int) -> tuple[int, int, int] | None:
    """Validates the static M-RoPE options; returns the sections as a tuple of ints, or None."""
    if not isinstance(mrope_interleaved, (bool, np.bool_)):
        raise TypeError(f"mrope_interleaved: expected a Python bool, got {describe(mrope_interleaved)}")
    if mrope_section is None:
        if mrope_interleaved:
            raise ValueError("mrope_interleaved: True needs mrope_section (the temporal, height and width "
                             "frequency counts), got mrope_section=None")
        return None
    try:
        items = list(mrope_section)
    except TypeError:
        raise TypeError(f"mrope_section: expected a sequence of 3 ints (temporal, height, width), "
                        f"got {describe(mrope_section)}") from None
    if len(items) != 3 or any(isinstance(x, (bool, np.bool_)) or not isinstance(x, numbers.Integral) for x in items):
        raise TypeError(f"mrope_section: expected a sequence of 3 ints (temporal, height, width), "
                        f"got {mrope_section!r}")
    section = tuple(int(x) for x in items)
    half = rotary_dim // 2
    if min(section) < 0 or sum(section) != half:
        raise ValueError(f"mrope_section: expected 3 counts >= 0 summing to rotary_dim/2 = {half} (one per rotary "
                         f"frequency), got {list(section)} (sum {sum(section)})")
    if mrope_interleaved:
        got = np.bincount(mrope_stream(np.arange(half), section, True), minlength=3)
        if tuple(int(n) for n in got) != section:
            raise ValueError(f"mrope_section: interleaved sections must fit rotary_dim/2 = {half} (height h needs "
                             f"3h - 2 < {half}, width w needs 3w - 1 < {half}); got {list(section)}, which assigns "
                             f"{list(int(n) for n in got)} frequencies")
    return section


# The two forms of a cos/sin table (models.tables.FORMS). The form is said, never guessed from the
# width: a "full" table for rotary_dim R and a "half" table for 2R have the same shape, and reading
# one as the other rotates every channel by the wrong angle without any error.
TABLE_FORMS = ("half", "full")


def check_table_dtypes(cos, sin) -> np.dtype:
    """cos and sin: the same input dtype (bf16 / f16 / f32); returns it."""
    table_dtype = _dtype("cos", cos)
    if table_dtype not in INPUT_DTYPES:
        raise TypeError(f"cos: expected dtype one of ({dtype_names(INPUT_DTYPES)}), got {table_dtype.name}")
    if _dtype("sin", sin) != table_dtype:
        raise TypeError(f"sin: expected dtype {table_dtype.name} (same as cos), got {np.dtype(sin.dtype).name}")
    return table_dtype


def check_tables(cos, sin, rotary_dim: int, table_form, *, r_name: str = "R",
                 r_arg: str = "rotary_dim") -> tuple[np.dtype, int, bool]:
    """cos and sin of `table_form` for `rotary_dim`: "half" [max_pos, R/2] (the default) or "full"
    [max_pos, R]. Returns (table dtype, max_pos, full)."""
    if table_form not in TABLE_FORMS:
        raise ValueError(f"table_form: expected one of {TABLE_FORMS}, got {table_form!r}")
    table_dtype = check_table_dtypes(cos, sin)
    r = rotary_dim
    full = table_form == "full"
    want = r if full else r // 2
    dims = f"[max_pos, {r_name}]" if full else f"[max_pos, {r_name}/2]"
    max_pos, width = _check_rank("cos", cos, 2, dims)
    if width != want:
        if full:
            hint = (f"; a table of width {r_name}/2 is the 'half' form (the default: leave table_form out)"
                    if width == r // 2 else "")
        elif width == r:
            hint = (f"; a table of width {r_name} is either the 'full' form, which must be asked for with "
                    f"table_form='full', or a 'half' table built for {r_arg}={2 * r} (another head size), "
                    "which would rotate every channel wrongly")
        else:
            hint = f" (tables built for another {r_arg} or head size?)"
        raise ValueError(f"cos: expected the {table_form!r} table form {dims} = [max_pos, {want}] for "
                         f"{r_arg}={r}, got shape {list(cos.shape)}{hint}")
    if max_pos < 1:
        raise ValueError(f"cos: expected at least one row (max_pos >= 1), got shape {list(cos.shape)}")
    _check_shape("sin", sin, tuple(cos.shape), "same as cos")
    return table_dtype, max_pos, full


def check_op(q, k, v, key_cache, value_cache, slot_mapping, positions, cos, sin, *,
             layout="flash", is_neox=True, rotary_dim=None, k_scale=None, v_scale=None,
             precision="fp32", layer=None, q_norm_weight=None, k_norm_weight=None, norm_eps=1e-6,
             mrope_section=None, mrope_interleaved=False, k_scale_cache=None, v_scale_cache=None,
             table_form="half", rotary_position="head", use_rope=None, norm_type="rms", norm_position="before",
             attn_temperature=None) -> OpSpec:
    """Validates one call of rope_and_cache and returns its static description.

    With `layer` given, the caches are stacked per layer ([L, ...]) and only layer `layer` is
    written; every shape rule below applies to one layer."""
    check_value_cache(value_cache, layout)
    check_distinct_caches(key_cache, value_cache)
    key_cache, value_cache, num_layers = check_layer(layer, key_cache, value_cache, layout)
    if precision not in PRECISIONS:
        raise ValueError(f"precision: expected one of {PRECISIONS}, got {precision!r}")
    if not isinstance(is_neox, (bool, np.bool_)):
        raise TypeError(f"is_neox: expected a Python bool, got {type(is_neox).__name__}")

    dtype = _dtype("q", q)
    if dtype not in INPUT_DTYPES:
        raise TypeError(f"q: expected dtype one of ({dtype_names(INPUT_DTYPES)}), got {dtype.name}")
    t, qh, d = _check_rank("q", q, 3, "[T, QH, D]")
    for name, a in (("k", k), ("v", v)):
        if _dtype(name, a) != dtype:
            raise TypeError(f"{name}: expected dtype {dtype.name} (same as q), got {np.dtype(a.dtype).name}")
    _, kh, _ = _check_rank("k", k, 3, "[T, KH, D]")
    _check_shape("k", k, (t, kh, d), "[T, KH, D]")
    _check_shape("v", v, (t, kh, d), "[T, KH, D]")
    if kh < 1 or qh % kh != 0:
        raise ValueError(f"q: expected QH to be a multiple of KH={kh} (grouped-query attention), got QH={qh}")
    if d < 2 or d % 2:
        raise ValueError(f"q: expected an even head_dim D >= 2, got D={d}")

    r = d if rotary_dim is None else rotary_dim
    if isinstance(r, bool) or not isinstance(r, numbers.Integral):
        raise TypeError(f"rotary_dim: expected an int or None, got {type(rotary_dim).__name__}")
    r = int(r)
    if r < 0 or r % 2 or r > d:
        raise ValueError(f"rotary_dim: expected an even value in [0, D={d}] (0: no rotation), got {r}")

    family = check_families(r, rotary_position, use_rope, norm_type, norm_position, attn_temperature,
                            q_norm_weight, k_norm_weight, positions, cos, sin, mrope_section)
    section = check_mrope(mrope_section, mrope_interleaved, r)
    for name, a in (("slot_mapping", slot_mapping), ("positions", positions)):
        if a is None and name == "positions" and r == 0:  # a NoPE call needs no positions
            continue
        idt = _dtype(name, a)
        if idt not in INDEX_DTYPES:
            raise TypeError(f"{name}: expected dtype int32 or int64, got {idt.name}")
        if name == "positions" and section is not None:
            _check_shape(name, a, (3, t), "[3, T] (temporal, height, width rows, as mrope_section is given)")
        elif name == "positions" and len(a.shape) == 2:
            _check_shape(name, a, (t,), "[T] (positions [3, T] need mrope_section)")
        else:
            _check_shape(name, a, (t,), "[T]")

    table_dtype, max_pos, table_full = (check_tables(cos, sin, r, table_form) if r else
                                        check_nope_tables(cos, sin, table_form))

    cache_dtype = _dtype("key_cache", key_cache)
    fmt = block_format(k_scale_cache, v_scale_cache)
    if fmt is not None:
        check_block_cache_dtype(fmt, cache_dtype, layout, d)
    if cache_dtype in LOW_BIT and k_scale_cache is None and v_scale_cache is None:
        raise ValueError(f"key_cache: an {'int8' if cache_dtype == INT8 else 'int4, NVFP4 or MXFP4 (uint8)'} cache "
                         "stores quantized values; expected the scale caches k_scale_cache / v_scale_cache (float32 "
                         "per-token scales, float8_e4m3fn NVFP4 or float8_e8m0fnu MXFP4 block scales; see "
                         "make_kv_scale_cache), got None")
    if cache_dtype != dtype and cache_dtype not in FP8_DTYPES + LOW_BIT:
        raise TypeError(f"key_cache: expected dtype {dtype.name} (same as q) or one of "
                        f"({dtype_names(FP8_DTYPES)}, int8 or uint8 (int4) with scale caches), got {cache_dtype.name}")
    if value_cache is not None and _dtype("value_cache", value_cache) != cache_dtype:
        raise TypeError(f"value_cache: expected dtype {cache_dtype.name} (same as key_cache), "
                        f"got {np.dtype(value_cache.dtype).name}")
    lay = cache_layout(layout)
    kdims, vdims = lay.dims("key"), lay.dims("value")
    kshape, x, nb, bs = _key_cache_geometry(key_cache, lay, cache_dtype)
    _check_merged_heads(kshape, lay)
    dc = cache_head_dim(d, cache_dtype)
    if lay.needs_d_multiple_of_x and dc % x:
        raise ValueError(f"key_cache: layout {layout!r} needs D divisible by X={x} (the key cache's last dim), "
                         f"got D={dc}{' bytes (int4: D/2)' if dc != d else ''}")
    if lay.needs_bs_multiple_of_x and bs % x:
        raise ValueError(f"value_cache: layout {layout!r} needs the block size divisible by X={x} (the key "
                         f"cache's last dim), got BS={bs}")
    if bs < 1:
        raise ValueError(f"key_cache: expected block size >= 1, got shape {list(kshape)}")
    kexp, vexp = storage_shapes(layout, nb, bs, kh, dc, cache_dtype, x)
    _check_shape("key_cache", key_cache, kexp, f"{kdims} for layout {layout!r}")
    if vexp is not None:
        _check_shape("value_cache", value_cache, vexp, f"{vdims} for layout {layout!r}")
    if nb * bs >= 2**62:
        raise ValueError(f"key_cache: too many slots ({nb}*{bs})")

    fp8 = cache_dtype in FP8_DTYPES
    if fmt is not None:
        check_block_caches(fmt, k_scale_cache, v_scale_cache, k_scale, v_scale,
                           block_scale_shape(layout, nb, bs, kh, d, fmt), layout, num_layers)
        token = True
    else:
        token = check_scale_caches(k_scale_cache, v_scale_cache, k_scale, v_scale, cache_dtype,
                                   scale_shape(layout, nb, bs, kh), layout, num_layers)
    k_heads = False if token else check_scale("k_scale", k_scale, fp8, cache_dtype, kh)
    v_heads = False if token else check_scale("v_scale", v_scale, fp8, cache_dtype, kh)
    q_norm = check_norm_weight("q_norm_weight", q_norm_weight, d, dtype)
    k_norm = check_norm_weight("k_norm_weight", k_norm_weight, d, dtype)
    eps32 = check_norm_eps(norm_eps)
    normed = q_norm is not None or k_norm is not None or family["norm_type"] == "weightless"

    return OpSpec(
        num_tokens=t, q_heads=qh, kv_heads=kh, head_dim=d, rotary_dim=r, num_blocks=nb,
        block_size=bs, max_pos=max_pos, layout=layout, is_neox=bool(is_neox),
        table_full=table_full, precision=precision, dtype=dtype,
        table_dtype=table_dtype, cache_dtype=cache_dtype,
        slot_dtype=np.dtype(slot_mapping.dtype), pos_dtype=np.dtype(np.int32 if positions is None else positions.dtype),
        num_layers=num_layers,
        q_norm_dtype=q_norm, k_norm_dtype=k_norm, norm_eps=eps32 if normed else 0.0,
        k_scale_heads=k_heads, v_scale_heads=v_heads, mrope_section=section,
        mrope_interleaved=bool(mrope_interleaved) if section is not None else False,
        pack_x=x if lay.packed and x != pack_width(cache_dtype) else 0, token_scales=token, cache_format=fmt,
        **family)


def block_format(k_scale_cache, v_scale_cache) -> str | None:
    """The block-scaled format the scale caches' dtype names (float8_e4m3fn: "nvfp4", float8_e8m0fnu:
    "mxfp4"), from either cache; None for every other dtype (float32: per-token scales) or no caches."""
    for sc in (k_scale_cache, v_scale_cache):
        if sc is not None and hasattr(sc, "dtype") and np.dtype(sc.dtype) in BLOCK_FORMAT_OF_SCALE:
            return BLOCK_FORMAT_OF_SCALE[np.dtype(sc.dtype)]
    return None


def _block_format_intro(fmt: str) -> str:
    return (f"{BLOCK_FORMAT_NAMES[fmt]} ({BLOCK_SCALE_DTYPE[fmt].name} block-scale caches, one scale per "
            f"{BLOCK_GROUP[fmt]} values of a row)")


def check_block_cache_dtype(fmt: str, cache_dtype, layout: str, head_dim: int) -> None:
    """The cache dtype (uint8: two E2M1 values a byte), the layout and the head dim of a block-scaled cache."""
    if np.dtype(cache_dtype) != INT4:
        raise ValueError(f"key_cache: {_block_format_intro(fmt)} stores two E2M1 values a byte; expected a uint8 "
                         f"cache, got {np.dtype(cache_dtype).name}")
    if layout not in BLOCK_LAYOUTS:
        raise ValueError(f"layout: {_block_format_intro(fmt)} is written in the layouts {BLOCK_LAYOUTS} (no "
                         f"reader defines block scales for the others); got {layout!r}")
    group = BLOCK_GROUP[fmt]
    if head_dim % group:
        raise ValueError(f"key_cache: {_block_format_intro(fmt)} needs the head_dim D divisible by {group} (the "
                         f"blocks run along a row), got D={head_dim}")


def check_global_scale(arg: str, scale) -> None:
    """NVFP4's global decode scale: a float scalar (shape () or (1,), any float dtype, used as
    float32; may be traced), finite and > 0 where its value is known."""
    if scale is None:
        raise ValueError(f"{arg}: an NVFP4 cache needs its per-tensor global decode scale (dequantized = "
                         "e2m1 * block_scale * global_scale); expected a float scalar (used as float32), got None")
    if isinstance(scale, (bool, np.bool_)) or not (isinstance(scale, numbers.Real) or (
            hasattr(scale, "dtype") and hasattr(scale, "shape") and is_float_dtype(scale.dtype)
            and tuple(scale.shape) in ((), (1,)))):
        raise TypeError(f"{arg}: expected NVFP4's global decode scale, a float scalar (shape () or (1,), any float "
                        f"dtype, used as float32), got {describe(scale)}")
    try:
        value = np.float32(np.asarray(scale, np.float32).reshape(()))
    except Exception:  # noqa: BLE001 - a traced scale has no value here
        return
    if not (np.isfinite(value) and value > 0):
        raise ValueError(f"{arg}: expected NVFP4's global decode scale finite and > 0 (as float32), got {value!r}")


def check_block_caches(fmt: str, k_scale_cache, v_scale_cache, k_scale, v_scale, shape: tuple[int, ...],
                       layout: str, num_layers: int | None = None) -> None:
    """The block-scale caches of format `fmt` (both, its dtype, one layer's `shape`, stacked [L, ...]
    with num_layers, distinct) and the global scales: NVFP4 needs k_scale and v_scale, MXFP4 none."""
    want = BLOCK_SCALE_DTYPE[fmt]
    for name, other, given in (("k_scale_cache", "v_scale_cache", k_scale_cache),
                               ("v_scale_cache", "k_scale_cache", v_scale_cache)):
        if given is None:
            raise ValueError(f"{name}: {_block_format_intro(fmt)} needs both scale caches; expected an array like "
                             f"{other}, got None")
        got = _dtype(name, given)
        if got != want:
            raise ValueError(f"{name}: expected dtype {want.name} (as {other}: {_block_format_intro(fmt)}), "
                             f"got {got.name}")
    dims = cache_layout(layout).dims("key").replace("D]", f"D/{BLOCK_GROUP[fmt]}]")
    if num_layers is not None:
        shape, dims = (num_layers,) + tuple(shape), f"[L, {dims[1:]} (stacked layers, as layer is given)"
    for name, sc in (("k_scale_cache", k_scale_cache), ("v_scale_cache", v_scale_cache)):
        _check_shape(name, sc, tuple(shape), f"{dims} for layout {layout!r}")
    if k_scale_cache is v_scale_cache:
        raise ValueError("v_scale_cache: expected a different array from k_scale_cache, got the same "
                         f"{type(v_scale_cache).__name__} for both (the V scales would overwrite the K scales)")
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        if fmt == "nvfp4":
            check_global_scale(name, scale)
        elif scale is not None:
            raise ValueError(f"{name}: MXFP4 has no global scale (its block scales are powers of two); expected "
                             f"None, got {describe(scale)}")


def check_scale_caches(k_scale_cache, v_scale_cache, k_scale, v_scale, cache_dtype, shape: tuple[int, ...],
                       layout: str = "flash", num_layers: int | None = None) -> bool:
    """The per-token scale caches: both None (False), or both float32 arrays of one layer's `shape`
    (the layout's scale axes, e.g. [NB, KH, BS]; with num_layers stacked [L, ...]) next to an fp8 cache
    and without static scales (True)."""
    if k_scale_cache is None and v_scale_cache is None:
        return False
    for name, other, given in (("k_scale_cache", "v_scale_cache", k_scale_cache),
                               ("v_scale_cache", "k_scale_cache", v_scale_cache)):
        if given is None:
            raise ValueError(f"{name}: per-token scales need both scale caches; expected an array like {other}, "
                             "got None")
    cdt = np.dtype(cache_dtype)
    if cdt not in FP8_DTYPES + LOW_BIT:
        raise ValueError(f"k_scale_cache: per-token scales apply to float8, int8 and int4 caches only; expected None for a "
                         f"{cdt.name} cache, got {describe(k_scale_cache)}")
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        if scale is not None:
            raise ValueError(f"{name}: expected None with per-token scales (k_scale_cache / v_scale_cache: the op "
                             f"computes one scale per token and kv head), got {describe(scale)}")
    dims = cache_layout(layout).dims("scale")
    if num_layers is not None:
        shape, dims = (num_layers,) + tuple(shape), f"[L, {dims[1:]} (stacked layers, as layer is given)"
    for name, sc in (("k_scale_cache", k_scale_cache), ("v_scale_cache", v_scale_cache)):
        if _dtype(name, sc) != np.float32:
            raise TypeError(f"{name}: expected dtype float32, got {np.dtype(sc.dtype).name}")
        _check_shape(name, sc, shape, dims)
    if k_scale_cache is v_scale_cache:
        raise ValueError("v_scale_cache: expected a different array from k_scale_cache, got the same "
                         f"{type(v_scale_cache).__name__} for both (the V scales would overwrite the K scales)")
    return True


def check_read_kv(key_cache, value_cache, slot_mapping, layout="flash", *, k_scale=None, v_scale=None,
                  k_scale_cache=None, v_scale_cache=None) -> tuple[int, int, str | None]:
    """Validates a read_kv call (one layer of caches in `layout`, [T] integer slots, optional scales);
    returns (NB, BS, dequantization: None (values as stored), "static", "token", "nvfp4" or "mxfp4")."""
    lay = cache_layout(layout)
    check_value_cache(value_cache, layout)
    cdt = _dtype("key_cache", key_cache)
    if cdt not in INPUT_DTYPES + FP8_DTYPES + LOW_BIT:
        raise TypeError(f"key_cache: expected dtype one of ({dtype_names(INPUT_DTYPES + FP8_DTYPES + LOW_BIT)}), "
                        f"got {cdt.name}")
    if value_cache is not None and _dtype("value_cache", value_cache) != cdt:
        raise TypeError(f"value_cache: expected dtype {cdt.name} (same as key_cache), "
                        f"got {np.dtype(value_cache.dtype).name}")
    kdims, vdims = lay.dims("key"), lay.dims("value")
    kshape, x, nb, bs = _key_cache_geometry(key_cache, lay, cdt)
    _check_merged_heads(kshape, lay)
    kh, d = lay.kv_heads(kshape), lay.head_dim(kshape, x)
    fmt = block_format(k_scale_cache, v_scale_cache)
    if fmt is not None:
        check_block_cache_dtype(fmt, cdt, layout, 2 * d)
    if lay.needs_bs_multiple_of_x and bs % x:
        raise ValueError(f"value_cache: layout {layout!r} needs the block size divisible by X={x} (the key "
                         f"cache's last dim), got BS={bs}")
    kexp, vexp = storage_shapes(layout, nb, bs, kh, d, cdt, x)  # d: the stored row (int4: bytes)
    _check_shape("key_cache", key_cache, kexp, f"{kdims} for layout {layout!r}")
    if vexp is not None:
        _check_shape("value_cache", value_cache, vexp, f"{vdims} for layout {layout!r}")
    idt = _dtype("slot_mapping", slot_mapping)
    if idt not in INDEX_DTYPES:
        raise TypeError(f"slot_mapping: expected dtype int32 or int64, got {idt.name}")
    _check_rank("slot_mapping", slot_mapping, 1, "[T]")
    if fmt is not None:
        check_block_caches(fmt, k_scale_cache, v_scale_cache, k_scale, v_scale,
                           block_scale_shape(layout, nb, bs, kh, 2 * d, fmt), layout)
        return nb, bs, fmt
    if check_scale_caches(k_scale_cache, v_scale_cache, k_scale, v_scale, cdt, scale_shape(layout, nb, bs, kh), layout):
        return nb, bs, "token"
    if k_scale is None and v_scale is None:
        return nb, bs, None
    check_scale("k_scale", k_scale, cdt in FP8_DTYPES, cdt, kh)
    check_scale("v_scale", v_scale, cdt in FP8_DTYPES, cdt, kh)
    return nb, bs, "static"


@dataclasses.dataclass(frozen=True)
class KernelCodes:
    """The static configuration the GPU kernels are specialised on (RC_* of kernels/cuda/rope_cache.cu,
    make_config of kernels/rocm/rope_cache_flydsl.py): one translation of an OpSpec for both."""

    qh: int
    kh: int
    d: int
    r: int
    bs: int
    layout: int          # CacheLayout.code
    neox: bool
    full_table: bool
    native: bool         # "native" precision; the kernels pick "rounded" or "fused" arithmetic from dt, tab_dt
    dt: int              # DTYPE_CODES of q/k/v, cos/sin, the caches
    tab_dt: int
    cache_dt: int
    slot64: bool
    pos64: bool
    layer_blocks: int = 0  # blocks per layer of stacked caches [L, NB, ...]; 0: one layer
    q_norm: int = -1       # -1: no q RMSNorm, else DTYPE_CODES of q_norm_weight
    k_norm: int = -1       # same for k_norm_weight
    norm_eps: float = 0.0  # float32 value of eps (exact in f32); 0.0 when no norm
    k_scale_heads: bool = False  # k_scale has shape [KH] (False: one scale)
    v_scale_heads: bool = False
    mrope: int = 0         # 0: positions [T]; 1: M-RoPE sections; 2: M-RoPE interleaved (positions [3, T])
    mrope_t: int = 0       # the sections (temporal, height, width frequency counts), 0 without M-RoPE
    mrope_h: int = 0
    mrope_w: int = 0
    x: int = 0             # X of an x-packed layout when not 16 // cache itemsize (OpSpec.pack_x); 0: default
    qkv: bool = False      # q, k and v read from the fused [T, QH + 2 KH, D] tensor (OpSpec.qkv)
    token_scales: bool = False  # per-token fp8 scales written to the scale caches (OpSpec.token_scales)
    # blocks per layer where the caches do not lead with NB (head_major [KH, NB, ...]): the kernels read
    # NB from the caches' leading dimension otherwise; 0 for every other layout
    nb: int = 0


def kernel_codes(spec: OpSpec) -> KernelCodes:
    return KernelCodes(
        qh=spec.q_heads, kh=spec.kv_heads, d=spec.head_dim, r=spec.rotary_dim, bs=spec.block_size,
        layout=LAYOUT_TABLE[spec.layout].code, neox=bool(spec.is_neox), full_table=bool(spec.table_full),
        native=spec.precision == "native",  # float32 inputs too: "fused" arithmetic (reference.arithmetic)
        dt=DTYPE_CODES[np.dtype(spec.dtype)], tab_dt=DTYPE_CODES[np.dtype(spec.table_dtype)],
        cache_dt=DTYPE_CODES[np.dtype(spec.cache_dtype)], slot64=np.dtype(spec.slot_dtype).itemsize == 8,
        pos64=np.dtype(spec.pos_dtype).itemsize == 8,
        layer_blocks=spec.num_blocks if spec.num_layers is not None else 0,
        q_norm=-1 if spec.q_norm_dtype is None else DTYPE_CODES[np.dtype(spec.q_norm_dtype)],
        k_norm=-1 if spec.k_norm_dtype is None else DTYPE_CODES[np.dtype(spec.k_norm_dtype)],
        norm_eps=float(spec.norm_eps), k_scale_heads=bool(spec.k_scale_heads), v_scale_heads=bool(spec.v_scale_heads),
        x=int(spec.pack_x), qkv=bool(spec.qkv), token_scales=bool(spec.token_scales),
        nb=0 if LAYOUT_TABLE[spec.layout].blocks_lead else spec.num_blocks, **mrope_codes(spec))


def mrope_codes(spec: OpSpec) -> dict:
    """The M-RoPE fields of KernelCodes (all 0 without M-RoPE)."""
    if spec.mrope_section is None:
        return dict(mrope=0, mrope_t=0, mrope_h=0, mrope_w=0)
    t, h, w = spec.mrope_section
    return dict(mrope=2 if spec.mrope_interleaved else 1, mrope_t=t, mrope_h=h, mrope_w=w)


# Options a native kernel may not implement (yet): each backend lists the ones it does in SUPPORTS;
# a call using another falls back to the XLA path (impl=None) or raises (impl="kernel").
FEATURES = ("q_norm", "k_norm", "k_scale_heads", "v_scale_heads", "mrope", "token_scales",
            "nope", "rope_switch", "rotary_tail", "gemma_norm", "weightless_norm", "norm_after", "temperature",
            "q_gate", "int8_cache", "int4_cache", "nvfp4_cache", "mxfp4_cache")
# The options every native kernel implemented before the model-family options.
BASE_FEATURES = FEATURES[:6]
# The low-bit cache formats (each backend's SUPPORTS says which its kernel writes).
CACHE_FORMAT_FEATURES = ("int8_cache", "int4_cache", "nvfp4_cache", "mxfp4_cache")


def features(spec: OpSpec) -> frozenset[str]:
    """The FEATURES a call uses."""
    used = {"q_norm": spec.q_norm_dtype is not None, "k_norm": spec.k_norm_dtype is not None,
            "k_scale_heads": spec.k_scale_heads, "v_scale_heads": spec.v_scale_heads,
            "mrope": spec.mrope_section is not None, "token_scales": spec.token_scales,
            "nope": spec.rotary_dim == 0, "rope_switch": spec.rope_switch, "rotary_tail": spec.rotary_tail,
            "gemma_norm": spec.norm_type == "gemma" and spec.norm, "weightless_norm": spec.norm_type == "weightless",
            "norm_after": spec.norm_after, "temperature": spec.temperature is not None, "q_gate": spec.q_gate,
            "int8_cache": spec.int8, "int4_cache": spec.int4, "nvfp4_cache": spec.cache_format == "nvfp4",
            "mxfp4_cache": spec.cache_format == "mxfp4"}
    return frozenset(f for f, on in used.items() if on)


FEATURE_NAMES = {"q_norm": "the fused q RMSNorm (q_norm_weight)", "k_norm": "the fused k RMSNorm (k_norm_weight)",
                 "k_scale_heads": "per-head k_scale ([KH])", "v_scale_heads": "per-head v_scale ([KH])",
                 "mrope": "multimodal RoPE (mrope_section, positions [3, T])",
                 "token_scales": "per-token fp8 scales (k_scale_cache / v_scale_cache)",
                 "nope": "no rotation (rotary_dim=0)", "rope_switch": "a per-layer rotation switch (use_rope)",
                 "rotary_tail": "rotary channels at the tail (rotary_position='tail')",
                 "gemma_norm": "the Gemma (1 + w) QK-norm (norm_type='gemma')",
                 "weightless_norm": "the weightless QK-norm (norm_type='weightless')",
                 "norm_after": "the QK-norm after the rotation (norm_position='after')",
                 "temperature": "the attention temperature (attn_temperature)",
                 "q_gate": "gated q rows in the fused QKV input (q_gate)",
                 "int8_cache": "int8 caches (per-token int8 quantization)",
                 "int4_cache": "int4 caches (per-token int4 quantization, uint8 bytes)",
                 "nvfp4_cache": "NVFP4 caches (E2M1 bytes, float8_e4m3fn block scales, a global scale)",
                 "mxfp4_cache": "MXFP4 caches (E2M1 bytes, float8_e8m0fnu block scales)"}


# ---- model families: NoPE layers, tail rotary, QK-norm variants, attention temperature -----------------
# Static options of check_op (OpSpec fields rotary_tail ... temperature); q_gate is rope_and_cache_qkv's.
ROTARY_POSITIONS = ("head", "tail")
NORM_TYPES = ("rms", "gemma", "weightless")
NORM_POSITIONS = ("before", "after")


def check_use_rope(use_rope, rotary_dim: int) -> bool:
    """The per-call rotation switch: None (no switch), a Python bool, or a bool / integer scalar array
    (may be traced; nonzero rotates). Returns True when the switch is given."""
    if use_rope is None:
        return False
    ok = isinstance(use_rope, (bool, np.bool_)) or (
        hasattr(use_rope, "dtype") and hasattr(use_rope, "shape") and tuple(use_rope.shape) == ()
        and (np.dtype(use_rope.dtype) == np.bool_ or np.issubdtype(np.dtype(use_rope.dtype), np.integer)))
    if not ok:
        raise TypeError(f"use_rope: expected None, a bool or a bool / integer scalar array (may be traced), "
                        f"got {describe(use_rope)}")
    if rotary_dim == 0:
        raise ValueError(f"use_rope: a rotation switch needs rotary_dim > 0 (with rotary_dim=0 no call rotates); "
                         f"expected None, got {describe(use_rope)}")
    return True


def check_temperature(attn_temperature) -> tuple[int, float] | None:
    """(floor_scale, attn_scale) of Llama 4's attention temperature: a positive integer (an integral
    float is taken) and a finite number; None: no temperature."""
    if attn_temperature is None:
        return None
    try:
        items = list(attn_temperature)
    except TypeError:
        items = None
    if items is None or len(items) != 2:
        raise TypeError(f"attn_temperature: expected None or (floor_scale, attn_scale), got {describe(attn_temperature)}")
    fs, scale = items
    real = lambda x: isinstance(x, numbers.Real) and not isinstance(x, (bool, np.bool_))  # noqa: E731
    if not real(fs) or not math.isfinite(float(fs)) or float(fs) != int(fs) or int(fs) < 1:
        raise ValueError(f"attn_temperature: expected floor_scale (the first item) a positive integer, got {fs!r}")
    if not real(scale) or not math.isfinite(float(scale)):
        raise ValueError(f"attn_temperature: expected attn_scale (the second item) a finite number, got {scale!r}")
    return int(fs), float(scale)


def check_families(rotary_dim: int, rotary_position, use_rope, norm_type, norm_position, attn_temperature,
                   q_norm_weight, k_norm_weight, positions, cos, sin, mrope_section) -> dict:
    """Validates the model-family options of check_op and their combinations; returns the OpSpec fields
    (rotary_tail, rope_switch, norm_type, norm_after, temperature). Contradictions raise ValueError
    naming the arguments."""
    if rotary_position not in ROTARY_POSITIONS:
        raise ValueError(f"rotary_position: expected one of {ROTARY_POSITIONS}, got {rotary_position!r}")
    if rotary_position == "tail" and rotary_dim == 0:
        raise ValueError("rotary_position: 'tail' places the rotary channels at the end of the head, but "
                         "rotary_dim=0 rotates none; expected 'head' (the default) with rotary_dim=0")
    switch = check_use_rope(use_rope, rotary_dim)
    if norm_type not in NORM_TYPES:
        raise ValueError(f"norm_type: expected one of {NORM_TYPES}, got {norm_type!r}")
    if norm_position not in NORM_POSITIONS:
        raise ValueError(f"norm_position: expected one of {NORM_POSITIONS}, got {norm_position!r}")
    weights = q_norm_weight is not None or k_norm_weight is not None
    if norm_type == "gemma" and not weights:
        raise ValueError("norm_type: 'gemma' scales the normalised row by (1 + w); expected q_norm_weight and/or "
                         "k_norm_weight, got neither")
    if norm_type == "weightless":
        for name, w in (("q_norm_weight", q_norm_weight), ("k_norm_weight", k_norm_weight)):
            if w is not None:
                raise ValueError(f"{name}: norm_type 'weightless' normalises q and k without a weight; "
                                 f"expected None, got {describe(w)}")
    normed = weights or norm_type == "weightless"
    if norm_position == "after" and not normed:
        raise ValueError("norm_position: 'after' places a QK-norm after the rotation, but none is given; expected "
                         "q_norm_weight / k_norm_weight or norm_type='weightless'")
    if norm_position == "after" and rotary_dim == 0:
        raise ValueError("norm_position: 'after' normalises the rotated q and k (Llama 4's RoPE layers), but "
                         "rotary_dim=0 rotates nothing; expected 'before' for a norm on a NoPE call")
    temperature = check_temperature(attn_temperature)
    if temperature is not None:
        if rotary_dim and not switch:
            raise ValueError(f"attn_temperature: scales q on calls that do not rotate (Llama 4's NoPE layers), but "
                             f"rotary_dim={rotary_dim} always rotates; expected rotary_dim=0 or a use_rope switch")
        if positions is None:
            raise ValueError("positions: attn_temperature scales q by a factor of each token's position; expected "
                             "[T] positions, got None")
        if cos is None or sin is None:
            raise ValueError("cos: attn_temperature clamps positions to the tables' rows, as every position; "
                             "expected cos and sin, got None")
        if mrope_section is not None:
            raise ValueError("attn_temperature: expected None with mrope_section (which of the three position "
                             "streams would set the factor?), got a temperature")
    return dict(rotary_tail=rotary_position == "tail", rope_switch=switch, norm_type=norm_type,
                norm_after=norm_position == "after", temperature=temperature)


def check_nope_tables(cos, sin, table_form) -> tuple[np.dtype, int, bool]:
    """The tables of a call with rotary_dim=0: both None, or a pair of any width (never read; their
    rows bound the temperature's positions). Returns (table dtype, max_pos, False)."""
    if table_form not in TABLE_FORMS:
        raise ValueError(f"table_form: expected one of {TABLE_FORMS}, got {table_form!r}")
    if cos is None and sin is None:
        return np.dtype(np.float32), 1, False
    for name, other, a in (("cos", "sin", cos), ("sin", "cos", sin)):
        if a is None:
            raise ValueError(f"{name}: expected an array like {other} (or both None with rotary_dim=0), got None")
    table_dtype = check_table_dtypes(cos, sin)
    max_pos, _ = _check_rank("cos", cos, 2, "[max_pos, W] (any width with rotary_dim=0)")
    if max_pos < 1:
        raise ValueError(f"cos: expected at least one row (max_pos >= 1), got shape {list(cos.shape)}")
    _check_shape("sin", sin, tuple(cos.shape), "same as cos")
    return table_dtype, max_pos, False
