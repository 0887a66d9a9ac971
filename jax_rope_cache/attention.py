"""Decode attention over the paged KV cache, for the model client (decoder.py).

    "gather"      jax.numpy: each sequence's blocks gathered in position order, then one softmax
                  attention (any layout the op writes; also the prefill path of every choice)
    "pallas_gpu"  jax.experimental.pallas.ops.gpu.paged_attention (Pallas on Triton; NVIDIA GPUs,
                  the CPU in interpret mode), over "head_major" caches
    "pallas_tpu"  jax.experimental.pallas.ops.tpu.paged_attention (Pallas on Mosaic TPU; TPUs, the
                  CPU in TPU interpret mode), over "head_major" caches

"head_major": key and value caches each [KH, NB, BS, D] per layer, the k_pages / v_pages both
kernels read. The Pallas kernels take one layer's cache as an operand, so a decoder that uses them
keeps one cache per layer: a layer sliced out of a stacked [L, ...] cache would be a copy.

The kernels compute q . k without a softmax scale, so q is scaled before the call. Neither kernel
reads the per-token fp8 scale caches of kv_quant="per_token".

Layouts are read from their definitions (the README's table), not from the library's index
helpers, so a layout bug in the op shows as a wrong token.
"""

from __future__ import annotations

import math
import warnings

import jax
import jax.numpy as jnp

from jax_rope_cache import contract

__all__ = ["ATTENTIONS", "PALLAS_LAYOUT", "GATHER_LAYOUTS", "layout_of", "default_attention",
           "check_platform", "interpret_on", "gather_blocks", "attend", "gpu_params", "tpu_params", "page_table", "page_width",
           "paged_decode", "gpu_kernel"]

ATTENTIONS = ("gather", "pallas_gpu", "pallas_tpu")
PALLAS_LAYOUT = "head_major"  # gpu/tpu paged_attention's k_pages / v_pages [KH, NB, BS, D]
GATHER_LAYOUTS = contract.LAYOUTS  # the gather reads every layout the op writes

# gpu.paged_attention: tokens per compute block (pages_per_compute_block * BS; Triton's dot needs
# a power of two >= 16) and the most sequence splits (k_splits; partial softmaxes combined after).
GPU_BLOCK_TOKENS = 128
GPU_MAX_SPLITS = 16
# tpu.paged_attention: tokens per compute block (its pages_per_compute_block * BS).
TPU_BLOCK_TOKENS = 128


def layout_of(attention: str) -> str | None:
    """The cache layout `attention` reads: head_major for the Pallas kernels, None (any) for gather."""
    return None if attention == "gather" else PALLAS_LAYOUT


def _is_nvidia(device) -> bool:
    version = str(getattr(getattr(device, "client", None), "platform_version", "")).lower()
    return device.platform in ("gpu", "cuda") and "rocm" not in version


def default_attention(device) -> str:
    """The fastest attention on `device`: the Pallas kernel where it compiles natively (NVIDIA GPU,
    TPU), else gather (on the CPU the kernels only run interpreted; on ROCm the Triton kernel is untried)."""
    if _is_nvidia(device):
        return "pallas_gpu"
    if device.platform == "tpu":
        return "pallas_tpu"
    return "gather"


def check_platform(attention: str, device) -> None:
    """ValueError naming where `attention` runs when `device` is not such a place."""
    if attention not in ATTENTIONS:
        raise ValueError(f"attention: expected one of {ATTENTIONS} or None, got {attention!r}")
    ok = {"gather": True, "pallas_gpu": device.platform in ("gpu", "cuda", "rocm", "cpu"),
          "pallas_tpu": device.platform in ("tpu", "cpu")}[attention]
    if not ok:
        where = {"pallas_gpu": "NVIDIA GPUs (Triton) or the CPU (interpreted)",
                 "pallas_tpu": "TPUs or the CPU (TPU interpret mode)"}[attention]
        raise ValueError(f"attention: {attention!r} runs on {where}, not on {device.platform}")


def interpret_on(device) -> bool:
    """The Pallas kernels run interpreted on the CPU."""
    return device.platform == "cpu"


# ---- gather -------------------------------------------------------------------------------------
def gather_blocks(caches, layer, block_table, layout: str):
    """K and V of every sequence's blocks, in position order: [B, MB * BS, KH, D] each, from one
    layer's caches (layer None) or stacked [L, ...] caches at `layer` (one gather per cache; block
    ids -1 read block 0, which the attention mask hides). `caches`: (key_cache, value_cache), or
    (kv_cache,) for kv_merged. Written from the layouts' definitions:
      flash            K, V [NB, BS, KH, D]
      xpacked          K [NB, KH, D//X, BS, X]    V [NB, KH, D, BS]
      xpacked_shuffled K as xpacked               V [NB, KH, BS//X, D, X]
      hnd              K, V [NB, KH, BS, D]
      head_major       K, V [KH, NB, BS, D]
      kv_merged        KV [NB, BS, 2 KH, D]: K head h at 2h, V head h at 2h + 1
    """
    bt = jnp.maximum(jnp.asarray(block_table), 0)
    B, MB = bt.shape
    pick = (lambda c: c) if layer is None else (lambda c: c[layer])
    if layout == "kv_merged":
        kv = pick(caches[0])[bt]                     # [B, MB, BS, 2 KH, D]
        _, _, BS, KH2, D = kv.shape
        kv = kv.reshape(B, MB * BS, KH2 // 2, 2, D)
        return kv[:, :, :, 0], kv[:, :, :, 1]
    kc, vc = pick(caches[0]), pick(caches[1])
    if layout == "head_major":
        KH, _, BS, D = kc.shape
        k = kc[:, bt].transpose(1, 2, 3, 0, 4)       # [KH, B, MB, BS, D] -> [B, MB, BS, KH, D]
        v = vc[:, bt].transpose(1, 2, 3, 0, 4)
        return k.reshape(B, MB * BS, KH, D), v.reshape(B, MB * BS, KH, D)
    k, v = kc[bt], vc[bt]                             # [B, MB, *block]
    if layout == "flash":
        _, _, BS, KH, D = k.shape
    elif layout == "hnd":
        _, _, KH, BS, D = k.shape
        k = k.transpose(0, 1, 3, 2, 4)  # [B, MB, KH, BS, D] -> [B, MB, BS, KH, D]
        v = v.transpose(0, 1, 3, 2, 4)
    elif layout in ("xpacked", "xpacked_shuffled"):
        _, _, KH, DX, BS, X = k.shape
        D = DX * X
        k = k.transpose(0, 1, 4, 2, 3, 5)  # [B, MB, BS, KH, D//X, X]
        if layout == "xpacked":
            v = v.transpose(0, 1, 4, 2, 3)  # [B, MB, KH, D, BS] -> [B, MB, BS, KH, D]
        else:
            v = v.transpose(0, 1, 3, 5, 2, 4)  # [B, MB, KH, BS//X, D, X] -> [B, MB, BS//X, X, KH, D]
    else:
        raise ValueError(f"layout: expected one of {GATHER_LAYOUTS}, got {layout!r}")
    return k.reshape(B, MB * BS, KH, D), v.reshape(B, MB * BS, KH, D)


def attend(q, k, v, q_pos, *, precision=None):
    """q [B, P, QH, D]; k, v [B, S, KH, D] with key index = position; q_pos [B, P] -> [B, P, QH * D].
    Causal: query at position p sees keys 0..p (everything written so far)."""
    B, P, QH, D = q.shape
    S, KH = k.shape[1], k.shape[2]
    qg = q.reshape(B, P, KH, QH // KH, D)
    s = jnp.einsum("bpkgd,bskd->bkgps", qg, k, precision=precision,
                   preferred_element_type=jnp.float32) / math.sqrt(D)
    mask = jnp.arange(S)[None, None, :] <= q_pos[:, :, None]
    s = jnp.where(mask[:, None, None], s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1).astype(v.dtype)
    o = jnp.einsum("bkgps,bskd->bpkgd", p, v, precision=precision, preferred_element_type=jnp.float32)
    return o.reshape(B, P, QH * D).astype(q.dtype)


# ---- the Pallas kernels --------------------------------------------------------------------------
_GPU_DEPRECATION = "jax.experimental.pallas.ops.gpu.paged_attention is deprecated"


def gpu_kernel():
    """jax.experimental.pallas.ops.gpu.paged_attention.paged_attention. JAX 0.11.2 and 0.12 warn
    (DeprecationWarning, at import) that the Pallas Triton ops are deprecated in favour of tokamax,
    whose GPU attention kernels have no paged form; this is the one JAX paged kernel for GPUs, so that
    one warning is silenced here (any other still fails the tests)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_GPU_DEPRECATION, category=DeprecationWarning)
        from jax.experimental.pallas.ops.gpu import paged_attention as mod
    return mod.paged_attention


def _pow2_floor(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)


def gpu_params(pages_per_seq: int, block_size: int, group: int) -> dict:
    """gpu.paged_attention's static parameters for a block table `pages_per_seq` wide, pages of
    `block_size` tokens and `group` query heads per KV head, plus "width": the block table's width
    padded so that k_splits * pages_per_compute_block divides it.

    block_h: a multiple of 16 (Triton's dot) covering the group, so K and V are read once per KV
    head; a group below 16 (Llama-3.1-8B: 4) is zero-padded by the kernel itself (q rows only)."""
    ppcb = _pow2_floor(max(1, GPU_BLOCK_TOKENS // block_size))
    blocks = -(-pages_per_seq // ppcb)
    splits = min(GPU_MAX_SPLITS, blocks)
    per_split = -(-blocks // splits)
    return dict(block_h=16 * -(-group // 16), pages_per_compute_block=ppcb, k_splits=splits,
                width=splits * per_split * ppcb)


def tpu_params(pages_per_seq: int, block_size: int) -> dict:
    """tpu.paged_attention's pages_per_compute_block (it must divide the block table's width) and
    that width ("width")."""
    ppcb = max(1, min(pages_per_seq, TPU_BLOCK_TOKENS // block_size))
    return dict(pages_per_compute_block=ppcb, width=-(-pages_per_seq // ppcb) * ppcb)


def page_table(block_table, width: int):
    """The kernels' page indices: int32 [B, width], ids -1 (no block) read as page 0 and the table
    padded with 0 to `width`. Both kernels read whole compute blocks of pages, also past a
    sequence's length (masked), so every entry must be a valid page."""
    bt = jnp.maximum(jnp.asarray(block_table, jnp.int32), 0)
    return jnp.pad(bt, ((0, 0), (0, width - bt.shape[1])))


def paged_decode(attention: str, q, key_pages, value_pages, pages, lengths, *, block_size: int,
                 interpret: bool):
    """One query per sequence over one layer's head_major caches: q [B, QH, D]; key_pages,
    value_pages [KH, NB, BS, D]; pages int32 [B, width] (page_table); lengths int32 [B] (keys
    0..length-1 are seen) -> [B, QH, D] in q's dtype."""
    B, QH, D = q.shape
    KH = key_pages.shape[0]
    # the kernels take no softmax scale: scale q (in float32, one rounding to q's dtype)
    q = (q.astype(jnp.float32) * (1.0 / math.sqrt(D))).astype(q.dtype)
    lengths = jnp.asarray(lengths, jnp.int32)
    if attention == "pallas_gpu":
        p = gpu_params(pages.shape[1], block_size, QH // KH)
        if p["width"] != pages.shape[1]:
            raise ValueError(f"pages: expected width {p['width']} (page_table), got {pages.shape[1]}")
        return gpu_kernel()(q, key_pages, value_pages, pages, lengths, block_h=p["block_h"],
                            pages_per_compute_block=p["pages_per_compute_block"], k_splits=p["k_splits"],
                            interpret=interpret)
    if attention == "pallas_tpu":
        from jax.experimental.pallas import tpu as pltpu
        from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention

        p = tpu_params(pages.shape[1], block_size)
        if p["width"] != pages.shape[1]:
            raise ValueError(f"pages: expected width {p['width']} (page_table), got {pages.shape[1]}")

        def call():
            return paged_attention(q, key_pages, value_pages, lengths, pages,
                                   pages_per_compute_block=p["pages_per_compute_block"])
        if not interpret:
            return call()
        with pltpu.force_tpu_interpret_mode(pltpu.InterpretParams()):  # Mosaic TPU simulated on the CPU
            return call()
    raise ValueError(f"attention: expected 'pallas_gpu' or 'pallas_tpu', got {attention!r}")


def page_width(attention: str, pages_per_seq: int, block_size: int, group: int) -> int:
    """The width page_table must give for `attention`."""
    if attention == "pallas_gpu":
        return gpu_params(pages_per_seq, block_size, group)["width"]
    return tpu_params(pages_per_seq, block_size)["width"]
