"""mla_rope_and_cache on a GPU: our kernel vs the jnp version (impl="xla") vs AITER's Triton MLA kernel
(`fused_qk_rope_cat_and_cache_mla`, when its sources are given), DeepSeek-V3 shapes at TP8 (16 query
heads, q_nope absorbed to Dc = 512, Dr = 64), combined latent cache in bf16 and fp8.

    python benchmarks/bench_gpu.py mla                               # the H200: T in {1, 64, 8192, 32768}
    python benchmarks/bench_gpu.py mla --aiter-src .peers/aiter_src   # with AITER (torch + triton needed)
    python benchmarks/bench_gpu.py mla --dry-run                      # any machine: tiny shapes, checks only

Timing: ours and jnp as N calls unrolled in one jit, the cache carried and donated (wall time / N, the
device time for all but the smallest calls); AITER as a CUDA graph of N calls (device time / N), as
/work/shared/peers/bench_peers.py times it. The copy ceiling is a device-to-device copy of a large
buffer (bytes read + written per second); "of ceiling" = the call's minimum bytes (MlaShape.bytes_per_token:
every input read once, every output written once) / time / ceiling. Every implementation is checked
against the numpy reference on the first tokens (ours bit for bit; AITER and jnp within 1 ulp for bf16,
one fp8 step). AITER's code is never part of this repository: it is loaded from the folder given.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.machinery
import os
import sys
import time
import types

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

import jax_rope_cache as jrc
from jax_rope_cache.mla import reference as mla_reference
from jax_rope_cache.models import presets

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # run as a suite or on its own
from cuda_graph_timing import graph_us  # noqa: E402  (benchmarks/gpu/)

BF16, FN = np.dtype(ml_dtypes.bfloat16), np.dtype(ml_dtypes.float8_e4m3fn)
CHECK_TOKENS = 64


def make_inputs(shape, T, num_slots, block_size, cache_dtype, seed=0):
    rng = np.random.default_rng(seed)
    qh, dn, dr, dc = shape.q_heads, shape.absorbed_nope_dim, shape.rope_dim, shape.latent_dim
    nb = -(-num_slots // block_size)
    q_nope = rng.standard_normal((T, qh, dn), np.float32).astype(BF16)
    q_pe = rng.standard_normal((T, qh, dr), np.float32).astype(BF16)
    kv_c = rng.standard_normal((T, dc), np.float32).astype(BF16)
    k_pe = rng.standard_normal((T, dr), np.float32).astype(BF16)
    cache = rng.standard_normal((nb, block_size, dc + dr), np.float32).astype(cache_dtype)
    slots = rng.permutation(nb * block_size)[:T].astype(np.int32)
    pos = rng.integers(0, 4096, T).astype(np.int32)
    return q_nope, q_pe, kv_c, k_pe, cache, slots, pos


def chain(impl, n, opts):
    """n calls unrolled in one jit, the cache carried (donated)."""
    def run(q_nope, q_pe, kv_c, k_pe, cache, slots, pos, cos, sin):
        outs = []
        for _ in range(n):
            q_out, k_pe_out, cache = jrc.mla_rope_and_cache(q_nope, q_pe, kv_c, k_pe, cache, slots, pos, cos, sin,
                                                            impl=impl, **opts)
            outs.append(q_out[:1, :1, :1])
        return cache, jnp.stack(outs)
    return jax.jit(run, donate_argnums=(4,))


def time_chain(fn, args, n, reps):
    args = list(args)
    cache, _ = fn(*args)
    jax.block_until_ready(cache)
    ts = []
    for _ in range(reps):
        args[4] = cache
        t0 = time.perf_counter()
        cache, out = fn(*args)
        jax.block_until_ready((cache, out))
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts)) / n * 1e6, cache


def copy_ceiling_gbs(gib=2.0, reps=10):
    """Read + write bytes per second of a device copy of `gib` GiB."""
    n = int(gib * (1 << 30)) // 4
    x = jnp.ones((n,), jnp.float32)
    f = jax.jit(lambda a: a + 0.0)  # a copy kernel: reads and writes every byte once
    jax.block_until_ready(f(x))
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(f(x))
        ts.append(time.perf_counter() - t0)
    return 2 * 4 * n / float(np.median(ts)) / 1e9


def check(got, want, exact: bool, what: str) -> str:
    bad = 0
    for g, w in zip(got, want):
        g, w = np.asarray(g), np.asarray(w)
        if exact:
            bad += int((g.view(np.uint8) != w.view(np.uint8)).sum())
        else:
            d = np.abs(g.astype(np.float32) - w.astype(np.float32))
            tol = 2 * np.abs(w.astype(np.float32)) * (2.0**-7 if g.dtype == BF16 else 2.0**-3) + 1e-6
            bad += int((d > tol).sum())
    return "ok" if bad == 0 else f"{what}: {bad} elements differ"


# ---- AITER (third-party, loaded from --aiter-src; never committed) ------------------------------------------
def load_aiter(root):
    pkgs = ["aiter", "aiter.jit", "aiter.jit.utils", "aiter.ops", "aiter.ops.triton", "aiter.ops.triton.fusions",
            "aiter.ops.triton.rope", "aiter.ops.triton.utils", "aiter.ops.triton.utils._triton",
            "aiter.ops.triton._triton_kernels", "aiter.ops.triton._triton_kernels.fusions",
            "aiter.ops.triton._triton_kernels.quant", "aiter.ops.triton._triton_kernels.rope"]
    for name in pkgs:  # empty packages pointing into the source folder: no aiter __init__ runs
        mod = types.ModuleType(name)
        path = os.path.join(root, *name.split("."))
        mod.__path__ = [path]
        mod.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
        mod.__spec__.submodule_search_locations = [path]
        sys.modules[name] = mod
    sys.path.insert(0, root)
    return importlib.import_module("aiter.ops.triton.fusions.fused_kv_cache")


def aiter_case(W, host, cos, sin, cache_dtype, kv_scale, n):
    """(device us per call, q_out and cache rows of the first tokens) of AITER's MLA kernel."""
    import torch

    def t(a, dt=None):
        a = np.ascontiguousarray(a)
        if a.dtype == BF16:
            return torch.from_numpy(a.view(np.int16)).cuda().view(torch.bfloat16)
        if a.dtype == FN:
            return torch.from_numpy(a.view(np.uint8)).cuda().view(torch.float8_e4m3fn)
        return torch.from_numpy(a).cuda()

    q_nope, q_pe, kv_c, k_pe, cache, slots, pos = host
    kvc = t(cache).view(-1, 1, cache.shape[-1])  # [NB * BS, 1, Dc + Dr]: one slot per row
    args = (t(q_nope), t(q_pe), t(kv_c)[:, None], t(k_pe)[:, None], kvc, t(slots.astype(np.int64)),
            t(pos.astype(np.int64)), t(cos), t(sin), torch.tensor([kv_scale], dtype=torch.float32, device="cuda"))
    out = W.fused_qk_rope_cat_and_cache_mla(*args, is_neox=False, apply_scale=cache_dtype == FN)
    torch.cuda.synchronize()
    us = graph_us(lambda: W.fused_qk_rope_cat_and_cache_mla(*args, is_neox=False, apply_scale=cache_dtype == FN),
                  n)
    q = out[0][:CHECK_TOKENS].float().cpu().numpy().astype(BF16)
    rows = kvc.view(torch.uint8 if cache_dtype == FN else torch.int16)[torch.from_numpy(slots[:CHECK_TOKENS]).long().cuda()]
    rows = rows.cpu().numpy().view(cache_dtype).reshape(min(CHECK_TOKENS, len(slots)), -1)
    return us, q, rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", default="1,64,8192,32768")
    ap.add_argument("--caches", default="bf16,fp8")
    ap.add_argument("--model", default="deepseek-v3", choices=sorted(presets.MLA_PRESETS))
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--cache-slots", type=int, default=262144, help="latent cache slots (beyond L2)")
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--aiter-src", default=None, help="folder holding aiter/ops/triton/... (see peers/README.md)")
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on any device: checks, no meaningful times")
    args = ap.parse_args(argv)

    shape = presets.mla_shape(args.model, args.tp)
    tokens = [int(t) for t in args.tokens.split(",")]
    if args.dry_run:
        tokens, args.cache_slots, args.calls, args.reps = [1, 64], 1024, 2, 2
    cos, sin, _ = jrc.rope_tables_from_hf_config(presets.preset_config(args.model), max_pos=4096)
    W = load_aiter(os.path.abspath(args.aiter_src)) if args.aiter_src else None
    ceiling = copy_ceiling_gbs(0.0625 if args.dry_run else 2.0)
    dev = jax.devices()[0]
    print(f"# {args.model} TP{args.tp}: {shape.q_heads} q heads, q_nope {shape.absorbed_nope_dim}, Dr {shape.rope_dim}, "
          f"Dc {shape.latent_dim}; device {dev.device_kind}; copy ceiling {ceiling:.0f} GB/s; {args.calls} calls per timing")
    print(f"{'cache':>5} {'T':>6} | {'ours us':>9} {'of ceil':>7} | {'jnp us':>9} {'x/J':>6} | {'AITER us':>9} {'x/A':>6} | check")
    for cname in args.caches.split(","):
        cdt = FN if cname == "fp8" else BF16
        opts = dict(kv_scale=np.float32(0.25)) if cdt == FN else {}
        for T in tokens:
            host = make_inputs(shape, T, max(args.cache_slots, 2 * T), args.block_size, cdt)
            dargs = [jax.device_put(a) for a in host] + [jax.device_put(cos), jax.device_put(sin)]
            nbytes = T * shape.bytes_per_token(cache_size=cdt.itemsize)
            m = min(T, CHECK_TOKENS)
            want = mla_reference.mla_rope_and_cache(*(a[:m] for a in host[:4]), host[4], *(a[:m] for a in host[5:]),
                                                    cos, sin, **opts)
            res, notes = {}, []
            for impl in ("kernel", "xla"):
                fn = chain(impl, args.calls, opts)
                a = list(dargs)
                a[4] = jax.device_put(host[4])
                us, _ = time_chain(fn, a, args.calls, args.reps)
                res[impl] = us
                q_out, _, cache = jrc.mla_rope_and_cache(*(x[:m] for x in dargs[:4]), jax.device_put(host[4]),
                                                         *(x[:m] for x in dargs[5:7]), cos, sin, impl=impl, **opts)
                rows = np.asarray(cache).reshape(-1, cache.shape[-1])[host[5][:m]]
                wrows = want[2].reshape(-1, cache.shape[-1])[host[5][:m]]
                notes.append(f"{impl} " + check((q_out, rows), (want[0], wrows), impl == "kernel", impl))
            if W is not None:
                try:
                    us, q, rows = aiter_case(W, host, cos, sin, cdt, 0.25, args.calls)
                    res["aiter"] = us
                    wrows = want[2].reshape(-1, want[2].shape[-1])[host[5][:m]]
                    notes.append("aiter " + check((q[:m], rows), (want[0], wrows), False, "aiter"))
                except Exception as e:  # noqa: BLE001 - AITER's own failure is a result, not ours
                    notes.append(f"aiter failed: {type(e).__name__}: {e}")
            frac = nbytes / (res["kernel"] * 1e-6) / 1e9 / ceiling
            a_us = res.get("aiter")
            print(f"{cname:>5} {T:>6} | {res['kernel']:9.2f} {frac:7.1%} | {res['xla']:9.2f} {res['xla'] / res['kernel']:6.2f} | "
                  + (f"{a_us:9.2f} {a_us / res['kernel']:6.2f}" if a_us else f"{'-':>9} {'-':>6}") + " | " + "; ".join(notes))


if __name__ == "__main__":
    main()
