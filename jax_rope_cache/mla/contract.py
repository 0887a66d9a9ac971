"""Argument checking and the static description of one MLA call (numpy only).

MLA (multi-head latent attention: DeepSeek-V2/V3/R1, Kimi-K2) caches, per token, ONE latent row:
the compressed kv_c [Dc] (512) and the decoupled rope key k_pe [Dr] (64), rotated. The query
handed to attention is cat(q_nope, rope(q_pe)) per head. `check_mla` takes anything with `.shape`
and `.dtype` and returns an `MlaSpec`, or raises ValueError/TypeError naming the argument, what was
expected and what was given.

Cache layouts (one layer; stacked layers add a leading [L]):
  "combined": kv_cache [NB, BS, Dc + Dr]: row = cat(kv_c, rope(k_pe))   (vLLM, AITER, SGLang)
  "split":    (ckv_cache [NB, BS, Dc], kpe_cache [NB, BS, Dr])           (FlashInfer)
"""

from __future__ import annotations

import dataclasses
import numbers

import numpy as np

from jax_rope_cache import contract

MLA_LAYOUTS = ("combined", "split")
CACHE_NAMES = {"combined": ("kv_cache",), "split": ("ckv_cache", "kpe_cache")}


def operands(layout: str) -> tuple[str, ...]:
    """Operand order of the MLA primitive and every native handler, for `layout`. kv_scale and
    q_scale are f32 [] (1 where unused); layer is an int32 scalar (0 when the caches are not stacked)."""
    return ("q_nope", "q_pe", "kv_c", "k_pe") + CACHE_NAMES[layout] + (
        "slot_mapping", "positions", "cos", "sin", "kv_scale", "q_scale", "layer")


def results(layout: str) -> tuple[str, ...]:
    return ("q_out", "k_pe_out") + CACHE_NAMES[layout]


def cache_aliases(layout: str) -> dict[int, int]:
    """operand index -> result index of each cache (updated in place)."""
    return {4 + i: 2 + i for i in range(len(CACHE_NAMES[layout]))}


def fenced_operands(layout: str) -> tuple[int, ...]:
    """Indices of the small per-step operands a GPU lowering passes through an optimization barrier
    (backends/launcher.fence_small_operands says why)."""
    names = operands(layout)
    return tuple(names.index(n) for n in ("slot_mapping", "positions", "kv_scale", "q_scale", "layer"))


@dataclasses.dataclass(frozen=True)
class MlaSpec:
    """Everything static about one MLA call. The attribute names shared with contract.OpSpec
    (rotary_dim, is_neox, table_full, precision, dtype, table_dtype, num_layers, num_slots, ...)
    mean the same, so the main op's rotation, quantization and index helpers serve both."""

    num_tokens: int
    q_heads: int
    nope_dim: int    # Dn: q_nope's width (128, or 512 when W_UK is absorbed into q)
    latent_dim: int  # Dc: kv_c's width (kv_lora_rank, 512)
    rope_dim: int    # Dr: q_pe's and k_pe's width, all rotated (qk_rope_head_dim, 64)
    num_blocks: int
    block_size: int
    max_pos: int
    layout: str
    is_neox: bool
    table_full: bool
    precision: str
    dtype: np.dtype        # q_nope, q_pe, kv_c, k_pe, k_pe_out
    table_dtype: np.dtype
    cache_dtype: np.dtype  # the latent cache(s): dtype, or float8 with kv_scale
    q_out_dtype: np.dtype  # dtype, or float8 with q_scale
    slot_dtype: np.dtype
    pos_dtype: np.dtype
    num_layers: int | None = None
    # One position stream (no multimodal RoPE): read by the main op's table helpers.
    mrope_section = None
    mrope_interleaved = False

    @property
    def rotary_dim(self) -> int:
        return self.rope_dim

    @property
    def row_dim(self) -> int:
        return self.latent_dim + self.rope_dim

    @property
    def q_dim(self) -> int:
        return self.nope_dim + self.rope_dim

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def fp8(self) -> bool:
        return self.cache_dtype in contract.FP8_DTYPES

    @property
    def q_fp8(self) -> bool:
        return self.q_out_dtype in contract.FP8_DTYPES

    def cache_shapes(self) -> tuple[tuple[int, ...], ...]:
        return mla_cache_shapes(self.layout, self.num_blocks, self.block_size, self.latent_dim, self.rope_dim)


def check_layout(layout) -> str:
    if layout not in MLA_LAYOUTS:
        raise ValueError(f"layout: expected one of {MLA_LAYOUTS}, got {layout!r}")
    return layout


def mla_cache_shapes(layout: str, num_blocks: int, block_size: int, latent_dim: int,
                     rope_dim: int) -> tuple[tuple[int, ...], ...]:
    """The cache shapes of one layer: ((NB, BS, Dc + Dr),) or ((NB, BS, Dc), (NB, BS, Dr))."""
    check_layout(layout)
    if layout == "combined":
        return ((num_blocks, block_size, latent_dim + rope_dim),)
    return ((num_blocks, block_size, latent_dim), (num_blocks, block_size, rope_dim))


def _dims(layout: str, stacked: bool) -> tuple[str, ...]:
    lead = "L, " if stacked else ""
    if layout == "combined":
        return (f"[{lead}NB, BS, Dc + Dr]",)
    return (f"[{lead}NB, BS, Dc]", f"[{lead}NB, BS, Dr]")


def cache_tuple(kv_cache, layout: str) -> tuple:
    """The caches of a call as a tuple: (kv_cache,) for "combined", (ckv_cache, kpe_cache) for "split"."""
    check_layout(layout)
    if layout == "combined":
        if isinstance(kv_cache, (tuple, list)):
            raise TypeError(f"kv_cache: layout 'combined' expects one array [NB, BS, Dc + Dr], got a "
                            f"{type(kv_cache).__name__} of {len(kv_cache)}; for (ckv_cache, kpe_cache) pass "
                            "layout='split'")
        return (kv_cache,)
    if not isinstance(kv_cache, (tuple, list)) or len(kv_cache) != 2:
        raise TypeError("kv_cache: layout 'split' expects a pair (ckv_cache [NB, BS, Dc], kpe_cache [NB, BS, Dr]), "
                        f"got {contract.describe(kv_cache)}")
    if kv_cache[0] is kv_cache[1]:
        raise ValueError("kv_cache: expected two different arrays (ckv_cache, kpe_cache), got the same one twice")
    return tuple(kv_cache)


# the main op's argument checks: same messages for the same mistakes
_array, _rank, _shape = contract._dtype, contract._check_rank, contract._check_shape


def check_q_out_dtype(q_out_dtype, dtype: np.dtype) -> np.dtype:
    if q_out_dtype is None:
        return dtype
    try:
        qdt = np.dtype(q_out_dtype)
    except TypeError:
        qdt = None
    if qdt is None or (qdt != dtype and qdt not in contract.FP8_DTYPES):
        raise TypeError(f"q_out_dtype: expected None, {dtype.name} (q_pe's dtype) or one of "
                        f"({contract.dtype_names(contract.FP8_DTYPES)}), got {qdt.name if qdt is not None else repr(q_out_dtype)}")
    return qdt


def check_mla(q_nope, q_pe, kv_c, k_pe, kv_cache, slot_mapping, positions, cos, sin, *, layout="combined",
              is_neox=False, kv_scale=None, q_out_dtype=None, q_scale=None, precision="fp32",
              layer=None, table_form="half") -> MlaSpec:
    """Validates one call of mla_rope_and_cache and returns its static description. `kv_cache` is
    one array ("combined") or a pair (ckv_cache, kpe_cache) ("split"); with `layer`, stacked [L, ...]."""
    check_layout(layout)
    caches = cache_tuple(kv_cache, layout)
    names = CACHE_NAMES[layout]
    if precision not in contract.PRECISIONS:
        raise ValueError(f"precision: expected one of {contract.PRECISIONS}, got {precision!r}")
    if not isinstance(is_neox, (bool, np.bool_)):
        raise TypeError(f"is_neox: expected a Python bool, got {type(is_neox).__name__}")

    dtype = _array("q_pe", q_pe)
    if dtype not in contract.INPUT_DTYPES:
        raise TypeError(f"q_pe: expected dtype one of ({contract.dtype_names(contract.INPUT_DTYPES)}), got {dtype.name}")
    t, qh, dr = _rank("q_pe", q_pe, 3, "[T, QH, Dr]")
    for name, a in (("q_nope", q_nope), ("kv_c", kv_c), ("k_pe", k_pe)):
        if _array(name, a) != dtype:
            raise TypeError(f"{name}: expected dtype {dtype.name} (same as q_pe), got {np.dtype(a.dtype).name}")
    _, _, dn = _rank("q_nope", q_nope, 3, "[T, QH, Dn]")
    _shape("q_nope", q_nope, (t, qh, dn), "[T, QH, Dn]")
    if qh < 1 or dn < 1:
        raise ValueError(f"q_nope: expected QH >= 1 heads of Dn >= 1 channels, got shape {list(q_nope.shape)}")
    if dr < 2 or dr % 2:
        raise ValueError(f"q_pe: expected an even rope width Dr >= 2 (RoPE rotates pairs), got Dr={dr}")
    _, dc = _rank("kv_c", kv_c, 2, "[T, Dc]")
    _shape("kv_c", kv_c, (t, dc), "[T, Dc]")
    if dc < 1:
        raise ValueError(f"kv_c: expected a latent width Dc >= 1, got shape {list(kv_c.shape)}")
    _shape("k_pe", k_pe, (t, dr), "[T, Dr] (one rope key per token, shared by every head)")

    for name, a in (("slot_mapping", slot_mapping), ("positions", positions)):
        idt = _array(name, a)
        if idt not in contract.INDEX_DTYPES:
            raise TypeError(f"{name}: expected dtype int32 or int64, got {idt.name}")
        _shape(name, a, (t,), "[T]")

    table_dtype, max_pos, table_full = contract.check_tables(cos, sin, dr, table_form, r_name="Dr",
                                                             r_arg="Dr")

    # caches: rank, stacking, dtype, shapes
    stacked = layer is not None
    if stacked and (isinstance(layer, bool) or not (isinstance(layer, numbers.Integral) or (
            hasattr(layer, "dtype") and np.issubdtype(np.dtype(layer.dtype), np.integer)
            and tuple(layer.shape) == ()))):
        raise TypeError(f"layer: expected None, an int or an integer scalar array, got {contract.describe(layer)}")
    dims = _dims(layout, stacked)
    for name, c, d in zip(names, caches, dims):
        _array(name, c)
        _rank(name, c, 4 if stacked else 3, d + (" (stacked layers, as layer is given)" if stacked else ""))
    cache_dtype = np.dtype(caches[0].dtype)
    if cache_dtype != dtype and cache_dtype not in contract.FP8_DTYPES:
        raise TypeError(f"{names[0]}: expected dtype {dtype.name} (same as q_pe) or one of "
                        f"({contract.dtype_names(contract.FP8_DTYPES)}), got {cache_dtype.name}")
    for name, c in zip(names[1:], caches[1:]):
        if np.dtype(c.dtype) != cache_dtype:
            raise TypeError(f"{name}: expected dtype {cache_dtype.name} (same as {names[0]}), got {np.dtype(c.dtype).name}")
    lead = tuple(caches[0].shape[:1]) if stacked else ()
    num_layers = lead[0] if stacked else None
    nb, bs = caches[0].shape[len(lead):len(lead) + 2]
    if nb < 1 or bs < 1:
        raise ValueError(f"{names[0]}: expected NB >= 1 blocks of BS >= 1 slots, got shape {list(caches[0].shape)}")
    for name, c, want, d in zip(names, caches, mla_cache_shapes(layout, nb, bs, dc, dr), dims):
        _shape(name, c, lead + want, d)
    if nb * bs >= 2**62:
        raise ValueError(f"{names[0]}: too many slots ({nb}*{bs})")
    if stacked and isinstance(layer, numbers.Integral) and not 0 <= layer < num_layers:
        raise ValueError(f"layer: expected 0 <= layer < {num_layers}, got {layer}")
    if stacked and num_layers < 1:
        raise ValueError(f"{names[0]}: expected L >= 1 stacked layers, got shape {list(caches[0].shape)}")

    contract.check_scale("kv_scale", kv_scale, cache_dtype in contract.FP8_DTYPES, cache_dtype)
    qdt = check_q_out_dtype(q_out_dtype, dtype)
    q_fp8 = qdt in contract.FP8_DTYPES
    if not q_fp8 and q_scale is not None:
        raise ValueError(f"q_scale: applies to a float8 q_out only (q_out_dtype); expected None for a {qdt.name} "
                         f"q_out, got {contract.describe(q_scale)}")
    if q_fp8:
        contract.check_scale("q_scale", q_scale, True, qdt)

    return MlaSpec(num_tokens=t, q_heads=qh, nope_dim=dn, latent_dim=dc, rope_dim=dr, num_blocks=nb, block_size=bs,
                   max_pos=max_pos, layout=layout, is_neox=bool(is_neox), table_full=table_full,
                   precision=precision, dtype=dtype, table_dtype=table_dtype, cache_dtype=cache_dtype,
                   q_out_dtype=qdt, slot_dtype=np.dtype(slot_mapping.dtype), pos_dtype=np.dtype(positions.dtype),
                   num_layers=num_layers)


@dataclasses.dataclass(frozen=True)
class MlaKernelCodes:
    """The static configuration the GPU kernels are specialised on (MLA_* of kernels/cuda/mla_cache.cu,
    make_config of kernels/rocm/mla_cache_flydsl.py)."""

    qh: int
    dn: int
    dc: int
    dr: int
    bs: int
    split: bool          # "split" layout (two caches)
    neox: bool
    full_table: bool
    native: bool
    dt: int              # contract.DTYPE_CODES
    tab_dt: int
    cache_dt: int
    q_dt: int            # q_out's dtype code
    slot64: bool
    pos64: bool
    layer_blocks: int = 0  # blocks per layer of stacked caches; 0: one layer


def kernel_codes(spec: MlaSpec) -> MlaKernelCodes:
    codes = contract.DTYPE_CODES
    return MlaKernelCodes(
        qh=spec.q_heads, dn=spec.nope_dim, dc=spec.latent_dim, dr=spec.rope_dim, bs=spec.block_size,
        split=spec.layout == "split", neox=bool(spec.is_neox), full_table=bool(spec.table_full),
        native=spec.precision == "native", dt=codes[spec.dtype], tab_dt=codes[spec.table_dtype],
        cache_dt=codes[spec.cache_dtype], q_dt=codes[spec.q_out_dtype],
        slot64=spec.slot_dtype.itemsize == 8, pos64=spec.pos_dtype.itemsize == 8,
        layer_blocks=spec.num_blocks if spec.num_layers is not None else 0)
