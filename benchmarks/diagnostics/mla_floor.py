#!/usr/bin/env python3
"""What bounds the MLA kernel: kernels/cuda/mla_cache.cu launched directly (driver API, the
lowering's configuration) next to no-math floor kernels moving the same bytes
(mla_floor_kernels.cu: floor_mla_copy, and floor_mla_tab with the op's dependent position ->
table load) and AITER's Triton `fused_qk_rope_cat_and_cache_mla` (when its source is on sys.path),
all timed the same two ways on one input set: a CUDA graph of --calls launches (graph time per
call, with each graph node's gap) and the kernels' own durations from torch's profiler (device time).
DeepSeek-V3 TP8 shapes (16 q heads, q_nope 512 wide as with W_UK absorbed, Dc 512, Dr 64), bf16
inputs, float32 half tables, random unique slots in a combined latent cache beyond L2.

    python3 benchmarks/diagnostics/mla_floor.py OUTDIR [--tokens 1,64,8192,32768] [--caches bf16,fp8]

Checks (each case, before timing): our q_out's q_nope part and the cache rows' kv_c part equal the
inputs bit for bit (bf16 cache), so the launch is the op's. Prints a table last; writes
OUTDIR/mla_floor.jsonl.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(os.path.dirname(HERE), "gpu")]
import aiter_mla  # noqa: E402  (benchmarks/gpu/)
from cuda_graph_timing import graph_us, kernel_us  # noqa: E402
from kernel_speed import Fn, log, stream  # noqa: E402
from mla import BF16, FN, KV_SCALE, MAX_POS  # noqa: E402  (the MLA suite's inputs)


def floor_kernels(shape, cache_bytes):
    from jax_rope_cache.backends import cuda
    from jax_rope_cache.compilers import nvrtc

    src = open(os.path.join(HERE, "mla_floor_kernels.cu")).read()
    defs = dict(FL_QH=shape.q_heads, FL_DN=shape.latent_dim, FL_DC=shape.latent_dim, FL_DR=shape.rope_dim,
                FL_CB=cache_bytes)
    opts = list(cuda.BASE_OPTIONS) + [f"-D{k}={v}" for k, v in defs.items()]
    c = nvrtc.compile_cuda(src, arch="sm_90", options=opts, name="mla_floor_kernels.cu")
    return {name: Fn(c.code, name) for name in ("floor_mla_copy", "floor_mla_tab")}


def our_kernel(shape, t, num_blocks, block_size, cache_dtype):
    """(Fn, config) of the op's kernel as the lowering builds it for this call."""
    import jax

    from jax_rope_cache.mla import contract, kernels

    s = jax.ShapeDtypeStruct
    qh, dn, dc, dr = shape.q_heads, shape.latent_dim, shape.latent_dim, shape.rope_dim
    fp8 = cache_dtype != BF16
    spec = contract.check_mla(s((t, qh, dn), BF16), s((t, qh, dr), BF16), s((t, dc), BF16), s((t, dr), BF16),
                              s((num_blocks, block_size, dc + dr), cache_dtype), s((t,), np.int32), s((t,), np.int32),
                              s((MAX_POS, dr // 2), np.float32), s((MAX_POS, dr // 2), np.float32),
                              kv_scale=np.float32(KV_SCALE) if fp8 else None)
    cfg = kernels.mla_kernel_config(spec, 132)
    return Fn(kernels.compile_mla(cfg, "sm_90").code, kernels.CUDA_KERNEL), cfg


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out")
    ap.add_argument("--tokens", default="1,64,8192,32768")
    ap.add_argument("--caches", default="bf16,fp8")
    ap.add_argument("--calls", type=int, default=20, help="launches per CUDA graph")
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--cache-slots", type=int, default=262144)
    ap.add_argument("--aiter-src", default="auto")
    a = ap.parse_args()
    import torch

    import jax_rope_cache as jrc
    from jax_rope_cache.models import presets

    os.makedirs(a.out, exist_ok=True)
    shape = presets.mla_shape("deepseek-v3", 8)
    qh, dn, dc, dr = shape.q_heads, shape.latent_dim, shape.latent_dim, shape.rope_dim
    cos_np, sin_np, _ = jrc.rope_tables_from_hf_config(presets.preset_config("deepseek-v3"), max_pos=MAX_POS)
    cos, sin = (torch.from_numpy(np.ascontiguousarray(x, np.float32)).cuda() for x in (cos_np, sin_np))
    W = None
    root = aiter_mla.find_source(a.aiter_src)
    if root:
        try:
            W = aiter_mla.load(root)
        except Exception as e:  # noqa: BLE001 - the other columns stand without it
            log("AITER not loaded:", type(e).__name__, e)
    rows = []
    for cname in a.caches.split(","):
        fp8 = cname == "fp8"
        tdt = torch.float8_e4m3fn if fp8 else torch.bfloat16
        floors = floor_kernels(shape, 1 if fp8 else 2)
        for t in [int(x) for x in a.tokens.split(",")]:
            g = torch.Generator(device="cuda").manual_seed(t)
            nslots = max(a.cache_slots, 2 * t) // a.block_size * a.block_size
            nb = nslots // a.block_size

            def rnd(*s):
                return torch.randn(*s, generator=g, device="cuda").to(torch.bfloat16)

            q_nope, q_pe, kv_c, k_pe = rnd(t, qh, dn), rnd(t, qh, dr), rnd(t, dc), rnd(t, dr)
            cache = torch.randn(nb, a.block_size, dc + dr, generator=g, device="cuda").to(tdt)
            slots = torch.randperm(nslots, generator=g, device="cuda")[:t].to(torch.int32)
            pos = torch.randint(0, MAX_POS, (t,), generator=g, device="cuda", dtype=torch.int32)
            q_out = torch.empty(t, qh, dn + dr, dtype=torch.bfloat16, device="cuda")
            k_pe_out = torch.empty(t, dr, dtype=torch.bfloat16, device="cuda")
            scales = torch.tensor([KV_SCALE, 1.0], dtype=torch.float32, device="cuda")
            layer = torch.zeros(1, dtype=torch.int32, device="cuda")
            cdt = FN if fp8 else BF16
            fn, cfg = our_kernel(shape, t, nb, a.block_size, cdt)
            ops = [q_nope, q_pe, kv_c, k_pe, cache, slots, pos, cos, sin, scales[0:1], scales[1:2], layer]
            res = [q_out, k_pe_out, cache]

            class Params(ctypes.Structure):
                _fields_ = [("ptr", ctypes.c_void_p * (len(ops) + len(res))), ("dim0", ctypes.c_int64 * len(ops))]

            prm = Params((ctypes.c_void_p * 15)(*[x.data_ptr() for x in ops + res]),
                         (ctypes.c_int64 * 12)(*[x.shape[0] for x in ops]))
            grid = (-(-t // cfg.tokens_per_block), cfg.parts)
            ours = lambda: fn.launch(grid, cfg.threads, [prm], stream())  # noqa: E731
            ours()
            torch.cuda.synchronize()
            ok = torch.equal(q_out[:, :, :dn], q_nope)
            if not fp8:
                rows_at = cache.view(-1, dc + dr)[slots.long()]
                ok = ok and torch.equal(rows_at[:, :dc], kv_c)
            if not ok:
                raise SystemExit(f"{cname} T={t}: our kernel's copies differ from the inputs")
            fargs = [ctypes.c_void_p(x.data_ptr()) for x in (q_nope, q_pe, kv_c, k_pe, slots, pos, cos, sin, q_out,
                                                             k_pe_out, cache)]
            fargs += [ctypes.c_int64(t), ctypes.c_int64(nslots), ctypes.c_int64(MAX_POS)]
            units = t * (qh * (dn + dr) // 8 + (dc + dr) // 8)
            nt = 128 if t < 264 else 256
            calls = dict(ours=ours)
            for name, f in floors.items():
                calls[name] = lambda f=f: f.launch(-(-units // nt), nt, fargs, stream())
            if W is not None:
                calls["aiter"] = aiter_mla._bind(W, q_nope, q_pe, kv_c, k_pe, cache, slots.long(), pos.long(), cos, sin,
                                                 KV_SCALE)
            rec = dict(cache=cname, T=t, config=dict(tpb=cfg.tokens_per_block, threads=cfg.threads, parts=cfg.parts))
            for name, call in calls.items():
                try:
                    rec[name + "_us"] = graph_us(call, a.calls)
                    rec[name + "_dev_us"] = kernel_us(call, a.calls)[0]
                except Exception as e:  # noqa: BLE001 - AITER's failure is a result, not ours
                    rec[name + "_error"] = f"{type(e).__name__}: {e}"[:200]
            rows.append(rec)
            log(json.dumps(rec))
            with open(os.path.join(a.out, "mla_floor.jsonl"), "a") as fh:
                fh.write(json.dumps(rec) + "\n")
            del q_nope, q_pe, kv_c, k_pe, cache
            torch.cuda.empty_cache()
    for kind, sfx in (("graph us per call (CUDA graph of %d launches)" % a.calls, "_us"),
                      ("device us per call (kernel durations, torch profiler)", "_dev_us")):
        log(f"\nMLA deepseek-v3 TP8, {kind}, one input set; x/A = AITER / ours, x/tab = floor_mla_tab / ours")
        log(f"{'cache':5s} {'T':>6s} {'ours':>8s} {'f_tab':>8s} {'f_copy':>8s} {'AITER':>8s} {'x/A':>6s} {'x/tab':>6s}")
        for r in rows:
            v = {k: r.get(k + sfx) for k in ("ours", "floor_mla_tab", "floor_mla_copy", "aiter")}
            f = lambda x: f"{x:8.2f}" if x else f"{'-':>8s}"  # noqa: E731
            q = lambda n, d: f"{n / d:6.2f}" if n and d else f"{'-':>6s}"  # noqa: E731
            log(f"{r['cache']:5s} {r['T']:6d} {f(v['ours'])} {f(v['floor_mla_tab'])} {f(v['floor_mla_copy'])} "
                f"{f(v['aiter'])} {q(v['aiter'], v['ours'])} {q(v['floor_mla_tab'], v['ours'])}")

if __name__ == "__main__":
    main()
