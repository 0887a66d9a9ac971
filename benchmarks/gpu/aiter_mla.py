"""AITER's Triton MLA kernel (`fused_qk_rope_cat_and_cache_mla`) for the MLA suite: load it from an
AITER source folder, call it on numpy inputs (the check) or on random device inputs (the timing).
Needs torch and triton, not jax. AITER's code is never part of this repository.

The call, as AITER's wrapper defines it:
  fused_qk_rope_cat_and_cache_mla(q_nope [T, QH, Dc], q_pe [T, QH, Dr], k_nope [T, KH, Dc],
      k_pe [T, KH, Dr], kv_cache [B_cache, KH, Dc + Dr], slot_mapping [T], pos [T], cos, sin
      [max_pos, Dr/2], k_scale (a 1-element float32 tensor), is_neox, apply_scale=...)
  -> (q_out [T, QH, Dc + Dr], decode_q_pe_out, k_pe_out [T, KH, Dr], q_nope_zeros_out)
with the cache written in place: row `slot` gets cat(k_nope, rope(k_pe)) * (1 / k_scale) when
apply_scale, in the cache's dtype. Our combined cache [NB, BS, Dc + Dr] viewed as [NB * BS, 1, Dc + Dr]
is that layout (KH = 1, one slot per row). AITER picks float8_e4m3fnuz as "the" fp8 type on every
arch outside its gfx950/gfx12 list, NVIDIA's included, and refuses other caches: for an
float8_e4m3fn cache on a CUDA GPU the module's fp8 type is set to float8_e4m3fn before the call.
"""
from __future__ import annotations

import importlib
import importlib.machinery
import os
import sys
import types

import numpy as np

MODULE = "aiter.ops.triton.fusions.fused_kv_cache"
_PACKAGES = ("aiter", "aiter.jit", "aiter.jit.utils", "aiter.ops", "aiter.ops.triton", "aiter.ops.triton.fusions",
             "aiter.ops.triton.rope", "aiter.ops.triton.utils", "aiter.ops.triton.utils._triton",
             "aiter.ops.triton._triton_kernels", "aiter.ops.triton._triton_kernels.fusions",
             "aiter.ops.triton._triton_kernels.quant", "aiter.ops.triton._triton_kernels.rope")


def find_source(where: str | None = "auto") -> str | None:
    """The AITER source folder: `where` itself, or with "auto" the first sys.path entry holding
    aiter/ops/triton/fusions/fused_kv_cache.py (PYTHONPATH=.peers/aiter_src)."""
    rel = os.path.join("aiter", "ops", "triton", "fusions", "fused_kv_cache.py")
    if where in (None, "off"):
        return None
    for root in (sys.path if where == "auto" else [where]):
        if root and os.path.isfile(os.path.join(root, rel)):
            return os.path.abspath(root)
    return None


def load(root: str, interpret: bool = False):
    """AITER's fused_kv_cache module from `root`. Its package folders are registered as empty
    packages, so no aiter/__init__.py runs (the real one builds HIP modules). interpret: Triton's
    CPU interpreter (a dry run), with the arch query stubbed (it asks a GPU driver at import)."""
    if interpret:
        os.environ["TRITON_INTERPRET"] = "1"
    for name in _PACKAGES:
        path = os.path.join(root, *name.split("."))
        mod = types.ModuleType(name)
        mod.__path__ = [path]
        mod.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
        mod.__spec__.submodule_search_locations = [path]
        sys.modules[name] = mod
    if interpret:
        arch = types.ModuleType("aiter.ops.triton.utils._triton.arch_info")
        arch.get_arch = lambda: "cpu-interpreter"
        sys.modules[arch.__name__] = arch
    sys.path.insert(0, root)
    return importlib.import_module(MODULE)


def _bind(W, q_nope, q_pe, kv_c, k_pe, cache, slots, pos, cos, sin, kv_scale):
    """A no-argument AITER call on torch tensors in our shapes ([T, QH, *], [T, Dc], [T, Dr],
    [NB, BS, Dc + Dr]). Everything it needs is made here, so the call itself can be graph-captured."""
    import torch

    fp8 = cache.dtype in (torch.float8_e4m3fn, torch.float8_e4m3fnuz)
    if fp8:
        W.e4m3_dtype = cache.dtype  # see the module docstring
    scale = torch.tensor([kv_scale if fp8 else 1.0], dtype=torch.float32, device=cache.device)
    rows = cache.view(-1, 1, cache.shape[-1])  # [NB * BS, KH = 1, Dc + Dr], in place
    k_nope, k_rope = kv_c[:, None], k_pe[:, None]
    return lambda: W.fused_qk_rope_cat_and_cache_mla(q_nope, q_pe, k_nope, k_rope, rows, slots, pos, cos, sin, scale,
                                                     is_neox=False, apply_scale=fp8)


class Rotation:
    """One call that cycles through `calls` (one per input set): call j runs calls[j % n], as call j
    of our chain reads input set j % n. N consecutive calls (a profiled run, a captured CUDA graph)
    then read N different sets: one set reused N times would stay in L2 at small T."""

    def __init__(self, calls):
        self.calls, self.i = list(calls), 0

    def __call__(self):
        out = self.calls[self.i % len(self.calls)]()
        self.i += 1
        return out


def _torch(a, dev):
    """A copy of numpy array `a` on torch device `dev` (on the CPU too: AITER writes the cache in place)."""
    import torch

    a = np.array(a, order="C", copy=True)
    by_name = {"bfloat16": (np.int16, torch.bfloat16), "float8_e4m3fn": (np.uint8, torch.float8_e4m3fn)}
    if a.dtype.name in by_name:
        raw, dt = by_name[a.dtype.name]
        return torch.from_numpy(a.view(raw)).to(dev).view(dt)
    return torch.from_numpy(a).to(dev)


def _numpy(t):
    import ml_dtypes
    import torch

    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    if t.dtype == torch.float8_e4m3fn:
        return t.view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn)
    return t.numpy()


def run_numpy(W, host, cos, sin, kv_scale, dev="cuda", inputs_f32=False):
    """(q_out, k_pe_out [T, Dr], cache) of one AITER call on numpy inputs (the cache copied first).
    inputs_f32: q/k inputs as float32 (Triton's CPU interpreter computes bf16 wrongly)."""
    q_nope, q_pe, kv_c, k_pe, cache, slots, pos = host
    ins = [_torch(a.astype(np.float32) if inputs_f32 else a, dev) for a in (q_nope, q_pe, kv_c, k_pe)]
    c = _torch(cache, dev)
    out = _bind(W, *ins, c, _torch(slots.astype(np.int64), dev), _torch(pos.astype(np.int64), dev),
                _torch(cos, dev), _torch(sin, dev), kv_scale)()
    return _numpy(out[0]), _numpy(out[2][:, 0]), _numpy(c)


def timed(W, shape, T, num_slots, block_size, cache_name, cos, sin, kv_scale, n_calls, seed=0, n_sets=None):
    """AITER on random device inputs of one case: (kernel us per call from the profiler, or None;
    kernels per call; CUDA-graph us per call). `n_sets` input sets (default n_calls), the cache
    shared, rotated through as ours are (Rotation)."""
    import torch

    from cuda_graph_timing import graph_us, kernel_us

    g = torch.Generator(device="cuda").manual_seed(seed)
    bf = torch.bfloat16

    def rnd(*s):
        return torch.randn(*s, generator=g, device="cuda")

    qh, dc, dr = shape.q_heads, shape.latent_dim, shape.rope_dim
    cache = rnd(num_slots // block_size, block_size, dc + dr).to(torch.float8_e4m3fn if cache_name == "fp8" else bf)
    c, s = torch.from_numpy(np.ascontiguousarray(cos)).cuda(), torch.from_numpy(np.ascontiguousarray(sin)).cuda()
    sets = [(rnd(T, qh, dc).to(bf), rnd(T, qh, dr).to(bf), rnd(T, dc).to(bf), rnd(T, dr).to(bf),
             torch.randperm(num_slots, generator=g, device="cuda")[:T],
             torch.randint(0, cos.shape[0], (T,), generator=g, device="cuda")) for _ in range(n_sets or n_calls)]

    call = Rotation(_bind(W, q_nope, q_pe, kv_c, k_pe, cache, slots, pos, c, s, kv_scale)
                    for q_nope, q_pe, kv_c, k_pe, slots, pos in sets)
    try:
        k_us, k_n = kernel_us(call, n_calls)
    except Exception as e:  # noqa: BLE001 - the graph time still stands
        print(f"torch profiler: {type(e).__name__}: {e}"[:200], flush=True)
        k_us, k_n = None, 0
    g_us = graph_us(call, n_calls)
    del call, sets, cache
    torch.cuda.empty_cache()
    return k_us, k_n, g_us
