#!/usr/bin/env python3
"""Does the kernel-node route run slower code than the FFI launcher? The op's kernel for one call,
launched directly (driver API) five ways, on one input set, timed as a CUDA graph and as kernel
durations (torch profiler):

  launcher_cubin   the launcher's entry, NVRTC's sm_90 cubin (what the FFI launcher loads)
  launcher_jit     the launcher's entry as PTX, compiled by the driver at load
  node_jit         the kernel-node entry's PTX (T, cache rows and table rows compiled in), compiled by
                   the driver at load (what XLA does with `__gpu$xla.gpu.ptx`'s kernel_data)
  node_cubin       the kernel-node entry, NVRTC's sm_90 cubin
  node_folded_jit  node_jit with the three dims folded in as constants (RC_NODE_FOLD_DIMS: the entry
                   without its opaque moves)

launcher vs node = the compiled-in shapes; cubin vs jit = NVRTC's ptxas vs the driver's. Every
variant's outputs (q_out, k_out, both caches) must equal launcher_cubin's bit for bit. Llama-3.1-8B
shapes (32/8/128), bf16, flash, fp32 precision, random unique slots in 2 GiB caches.

    python3 benchmarks/diagnostics/node_codegen.py OUTDIR [--tokens 1,64,8192,32768]
"""
from __future__ import annotations

import argparse
import ctypes
import dataclasses
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(os.path.dirname(HERE), "gpu")]
from cuda_graph_timing import graph_us, kernel_us  # noqa: E402
from kernel_speed import Fn, log, make_spec, params_type, stream  # noqa: E402

QH, KH, D, BS, MAX_POS = 32, 8, 128, 16, 32768


def builds(spec):
    """{variant: (Fn, entry is the node's)} and the configuration (launch geometry)."""
    from jax_rope_cache.backends import cuda

    cfg, cubin = cuda.fit_registers(cuda.kernel_config(spec, 132), "sm_90")  # the lowering's choice
    dims = (spec.num_tokens, spec.num_blocks, spec.max_pos)
    ncfg, node_ptx = cuda.build_node_ptx(cuda.node_config(cfg, dims), 90)
    out = {"launcher_cubin": (Fn(cubin.code, cuda.KERNEL_NAME), False),
           "launcher_jit": (Fn(cuda.compile_variant(cfg, "compute_90").code, cuda.KERNEL_NAME), False),
           "node_jit": (Fn(node_ptx.code, cuda.NODE_KERNEL_NAME), True),
           "node_cubin": (Fn(cuda.compile_variant(ncfg, "sm_90").code, cuda.NODE_KERNEL_NAME), True)}
    folded = dataclasses.replace(ncfg, defines=ncfg.defines + (("RC_NODE_FOLD_DIMS", 1),))
    out["node_folded_jit"] = (Fn(cuda.compile_variant(folded, "compute_90").code, cuda.NODE_KERNEL_NAME), True)
    return out, cfg


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out")
    ap.add_argument("--tokens", default="1,64,8192,32768")
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--cache-gib", type=float, default=2.0)
    a = ap.parse_args()
    import torch

    os.makedirs(a.out, exist_ok=True)
    bf = torch.bfloat16
    nb = int(a.cache_gib * 2**30) // (BS * KH * D * 2)
    g = torch.Generator(device="cuda").manual_seed(0)
    base_k = torch.randint(-2**14, 2**14, (nb, BS, KH, D), dtype=torch.int16, device="cuda", generator=g).view(bf)
    base_v = torch.randint(-2**14, 2**14, (nb, BS, KH, D), dtype=torch.int16, device="cuda", generator=g).view(bf)
    kc, vc = torch.empty_like(base_k), torch.empty_like(base_v)
    cos = torch.rand(MAX_POS, D // 2, generator=g, device="cuda").to(bf)
    sin = torch.rand(MAX_POS, D // 2, generator=g, device="cuda").to(bf)
    one = torch.ones((), dtype=torch.float32, device="cuda")
    layer = torch.zeros((), dtype=torch.int32, device="cuda")
    rows = []
    for t in [int(x) for x in a.tokens.split(",")]:
        q, k, v = (torch.randn(t, h, D, generator=g, device="cuda").to(bf) for h in (QH, KH, KH))
        slots = torch.randperm(nb * BS, generator=g, device="cuda")[:t].to(torch.int32)
        pos = torch.randint(0, MAX_POS, (t,), generator=g, device="cuda", dtype=torch.int32)
        q_out, k_out = torch.empty_like(q), torch.empty_like(k)
        spec = make_spec(t, QH, KH, D, "flash", "fp32", nb, MAX_POS, BS)
        fns, cfg = builds(spec)
        ops = [q, k, v, kc, vc, slots, pos, cos, sin, one, one, layer, one, one]
        res = [q_out, k_out, kc, vc]
        prm = params_type(14)()
        for i, x in enumerate(ops + res):
            prm.ptr[i] = x.data_ptr()
        for i, x in enumerate(ops):
            prm.dim0[i] = x.shape[0] if x.dim() else 1
        ptrs = [ctypes.c_void_p(x.data_ptr()) for x in ops + res]
        grid = (-(-t // cfg.tokens_per_block), cfg.parts)
        rec, want = dict(T=t, tpb=cfg.tokens_per_block, threads=cfg.threads, parts=cfg.parts), None
        for name, (fn, node) in fns.items():
            call = (lambda fn=fn: fn.launch(grid, cfg.threads, ptrs, stream())) if node else \
                (lambda fn=fn: fn.launch(grid, cfg.threads, [prm], stream()))
            kc.copy_(base_k)
            vc.copy_(base_v)
            q_out.fill_(0)
            k_out.fill_(0)
            call()
            torch.cuda.synchronize()
            at = _rows(slots)
            got = [x.view(torch.int16).clone() for x in (q_out, k_out)] + [x.view(torch.int16).view(-1)[at]
                                                                          for x in (kc, vc)]
            if want is None:
                want = got
            rec[name + "_same"] = all(bool(torch.equal(x, y)) for x, y in zip(got, want))
            rec[name + "_us"] = round(graph_us(call, a.calls), 3)
            rec[name + "_dev_us"] = round(kernel_us(call, a.calls)[0], 3)
        rows.append(rec)
        log(json.dumps(rec))
        del q, k, v, q_out, k_out
    with open(os.path.join(a.out, "node_codegen.json"), "w") as fh:
        json.dump(rows, fh, indent=1)
    names = ("launcher_cubin", "launcher_jit", "node_jit", "node_cubin", "node_folded_jit")
    for kind, sfx in (("graph us per call", "_us"), ("device us per call (kernel durations)", "_dev_us")):
        log(f"\nLlama-3.1-8B flash bf16 fp32, {kind}; same = outputs equal launcher_cubin's")
        log(f"{'T':>6s} " + " ".join(f"{n:>15s}" for n in names) + "  same")
        for r in rows:
            log(f"{r['T']:6d} " + " ".join(f"{r[n + sfx]:15.2f}" for n in names)
                + "  " + str(all(r[n + "_same"] for n in names)))


def _rows(slots):
    """int16 element indices of the cache rows at `slots` (flash: [blocks, BS, KH, D], a slot's row is
    KH * D contiguous elements)."""
    import torch

    row = KH * D
    return (slots.long()[:, None] * row + torch.arange(row, device=slots.device)[None, :]).reshape(-1)


if __name__ == "__main__":
    main()
