"""mla_rope_and_cache on a GPU: our kernel vs the jnp version (impl="xla") vs AITER's Triton MLA kernel
(`fused_qk_rope_cat_and_cache_mla`), DeepSeek-V3 shapes at TP8 (16 query heads, q_nope absorbed to
Dc = 512, Dr = 64), combined latent cache [NB, 64, 576] in bf16 and fp8 (kv_scale 0.25).

    python benchmarks/bench_gpu.py mla OUT_DIR                  # the H200: T in {1, 64, 8192, 32768}
    PYTHONPATH=.peers/aiter_src python benchmarks/bench_gpu.py mla OUT_DIR   # with AITER (torch + triton)
    python benchmarks/bench_gpu.py mla OUT_DIR --dry-run        # any machine: tiny shapes, the same paths

Timing (benchmarks/gpu/timing.py): ours and jnp as N calls unrolled in one jit, each call on its own
input set, the cache carried and donated, every output returned; "device" = the profiler's GPU busy
time per call; a row whose profile had no GPU events says "WALL time" at its end (wall time of a
small call is host time, not the kernel's). AITER (benchmarks/gpu/aiter_mla.py), after every JAX
measurement of the run (torch's profiler takes CUPTI from jax.profiler): its kernel's own time per
call from torch's profiler ("A us") and a CUDA graph of N calls / N ("A graph", which adds the graph
node's gap), on N random input sets of the same shapes and one cache, call j on set j % N as ours
(aiter_mla.Rotation), so at T <= 64 neither side reads inputs that a previous call left in L2
(benchmarks/diagnostics/mla_floor.py times both, and floor kernels, on one input set).
x/A = A us / ours, x/J = jnp / ours (> 1: ours is faster).
Bytes: MlaShape.bytes_per_token (every input read once, every output written once). "of copy" =
the time of a device copy moving the same bytes (N copies in one jit, timed as the op) / ours;
"of ceil" = bytes / ours / the bandwidth of a 2 GiB copy. Targets: x/A >= 1.2 at T = 1 and
T >= 8192, of copy >= 85% at T >= 8192.
Checks, every case: one call of ours, jnp and AITER on the first 64 tokens of the case's inputs and
a small fresh cache against the numpy reference: ours bit for bit (q_out, k_pe_out, the whole
cache; else the exit code is 1), jnp and AITER within one step of the output dtype plus 2^-20
(AITER may contract its f32 products to FMAs); the whole-cache compare also catches stray writes.
AITER's source is found on sys.path (PYTHONPATH) or given by --aiter-src; never committed here.
--budget-s (150) bounds the run: about 90 s on an H200 by estimate.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import tempfile

import ml_dtypes
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # run as a suite or on its own
import aiter_mla  # noqa: E402
from timing import (add_timing_args, copy_ceiling, copy_chain, fmt, log, measure, over_budget, ratio,  # noqa: E402
                    start_run, wall_note, write_log)

BF16, FN = np.dtype(ml_dtypes.bfloat16), np.dtype(ml_dtypes.float8_e4m3fn)
KV_SCALE = 0.25
CHECK_TOKENS = 64
MAX_POS = 65536


class Inputs:
    """n_sets input sets of one case on the device (random, never zeros) and the cache."""

    def __init__(self, shape, t, n_sets, cache_dtype, num_slots, block_size, seed):
        import jax
        import jax.numpy as jnp

        qh, dc, dr = shape.q_heads, shape.latent_dim, shape.rope_dim
        bf = jnp.bfloat16
        rng = np.random.default_rng(seed)
        ks = jax.random.split(jax.random.key(seed), 5)

        def rnd(key, *s):
            return [jax.random.normal(k, (t, *s), jnp.float32).astype(bf) for k in jax.random.split(key, n_sets)]

        self.q_nope, self.q_pe, self.kv_c, self.k_pe = rnd(ks[0], qh, dc), rnd(ks[1], qh, dr), rnd(ks[2], dc), rnd(
            ks[3], dr)
        self.slots = [jnp.asarray(rng.permutation(num_slots)[:t].astype(np.int32)) for _ in range(n_sets)]
        self.pos = [jnp.asarray(rng.integers(0, MAX_POS, t).astype(np.int32)) for _ in range(n_sets)]
        self.cache = [jax.random.normal(ks[4], (num_slots // block_size, block_size, dc + dr), jnp.float32).astype(
            cache_dtype)]
        self.t, self.cache_dtype, self.block_size = t, np.dtype(cache_dtype), block_size


def make_chain(impl, n_calls, n_sets, opts):
    import jax

    import jax_rope_cache as jrc

    def chain(q_nope, q_pe, kv_c, k_pe, slots, pos, cos, sin, cache):
        outs = []
        for j in range(n_calls):
            i = j % n_sets
            q_out, k_pe_out, cache = jrc.mla_rope_and_cache(q_nope[i], q_pe[i], kv_c[i], k_pe[i], cache, slots[i],
                                                            pos[i], cos, sin, impl=impl, **opts)
            outs += [q_out, k_pe_out]
        return outs, cache

    return jax.jit(chain, donate_argnums=(8,))


def steps(got, want):
    """Largest |got - want| in steps of want's dtype (one ulp at |want|), after 2^-20 of slack."""
    g, w = got.astype(np.float64), want.astype(np.float64)
    fi = ml_dtypes.finfo(want.dtype) if want.dtype in (BF16, FN) else np.finfo(want.dtype)
    e = np.floor(np.log2(np.maximum(np.abs(w), float(fi.smallest_normal))))
    ulp = np.exp2(e - fi.nmant)
    return float(np.max(np.maximum(np.abs(g - w) - 2.0**-20, 0.0) / ulp)) if w.size else 0.0


def compare(got, want, exact):
    if exact:
        return "exact" if all(np.array_equal(g.view(np.uint8), w.view(np.uint8)) for g, w in zip(got, want)) else \
            "NOT exact"
    worst = max(steps(g, w) for g, w in zip(got, want))
    return "<=1 step" if worst <= 1.0 else f"{worst:.1f} steps"


def check_inputs(inp, cos, sin, opts):
    """(host inputs, reference outputs) of the check: the first CHECK_TOKENS tokens of set 0 and a
    small fresh cache (random), kept for AITER's check after every JAX measurement."""
    import jax

    from jax_rope_cache.mla import reference

    m = min(inp.t, CHECK_TOKENS)
    rng = np.random.default_rng(inp.t)
    dim = inp.cache[0].shape[-1]
    nb = 2 * CHECK_TOKENS // inp.block_size + 1
    cache = rng.standard_normal((nb, inp.block_size, dim)).astype(inp.cache_dtype)
    slots = rng.permutation(nb * inp.block_size)[:m].astype(np.int32)
    host = [np.asarray(jax.device_get(x[0][:m])) for x in (inp.q_nope, inp.q_pe, inp.kv_c, inp.k_pe)]
    host += [cache, slots, np.asarray(jax.device_get(inp.pos[0][:m]))]
    return host, reference.mla_rope_and_cache(*host, cos, sin, **opts)


def check_ours(host, want, cos, sin, opts):
    """Ours (kernel, xla) against the reference: {impl: "exact" | "<=1 step" | "N steps"}."""
    import jax_rope_cache as jrc

    out = {}
    for impl in ("kernel", "xla"):
        got = jrc.mla_rope_and_cache(*host, cos, sin, impl=impl, **opts)
        out[impl] = compare([np.asarray(g) for g in got], want, exact=impl == "kernel")
    return out


def check_aiter(W, host, want, cos, sin, dry_run):
    try:
        got = aiter_mla.run_numpy(W, host, cos, sin, KV_SCALE, dev="cpu" if dry_run else "cuda", inputs_f32=dry_run)
        return compare(got, want, exact=False)
    except Exception as e:  # noqa: BLE001 - AITER's own failure is a result, not ours
        return f"failed: {type(e).__name__}: {e}"[:200]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out_dir")
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU backend: checks, no meaningful times")
    ap.add_argument("--tokens", default=None, help="T values (default 1,64,8192,32768; dry run 1,8)")
    ap.add_argument("--caches", default="bf16,fp8")
    ap.add_argument("--model", default="deepseek-v3")
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--cache-slots", type=int, default=262144, help="latent cache slots (beyond L2)")
    ap.add_argument("--aiter-src", default="auto",
                    help="AITER source folder; auto: found on sys.path (PYTHONPATH); off: no AITER")
    add_timing_args(ap, budget_s=150.0)
    a = ap.parse_args(argv)
    tokens = start_run(a, dry_tokens="1,8", tokens="1,64,8192,32768")
    import jax
    import jax.numpy as jnp

    import jax_rope_cache as jrc
    from jax_rope_cache.models import presets

    shape = presets.mla_shape(a.model, a.tp)
    if a.dry_run:  # two heads, the same dims
        shape = presets.MlaShape(shape.name, 2, shape.nope_dim, shape.rope_dim, shape.latent_dim, shape.v_head_dim)
        a.cache_slots = 4096
    cos, sin, _ = jrc.rope_tables_from_hf_config(presets.preset_config(a.model), max_pos=MAX_POS)
    cos, sin = np.asarray(cos), np.asarray(sin)
    W, why = None, "no AITER source found (PYTHONPATH or --aiter-src)"
    root = aiter_mla.find_source(a.aiter_src)
    if root:
        try:
            W = aiter_mla.load(root, interpret=a.dry_run)
        except Exception as e:  # noqa: BLE001 - the other columns stand without it
            why = f"{type(e).__name__}: {e}"[:300]
    os.makedirs(a.out_dir, exist_ok=True)
    workdir = tempfile.mkdtemp(prefix="mla_")
    dev = jax.devices()[0]
    ceiling = copy_ceiling((64 << 20) if a.dry_run else (2 << 30))
    meta = dict(device=getattr(dev, "device_kind", str(dev)), platform=dev.platform, jax=jax.__version__,
                shape=dataclasses.asdict(shape), copy_GBps=ceiling / 1e9, calls=a.calls, reps=a.reps, dry_run=a.dry_run,
                aiter=(W.__file__ if W else None), aiter_unavailable=None if W else why)
    log("bench_mla:", json.dumps(meta))
    rows, aiter_cases = [], []
    # Every JAX measurement first, AITER (torch) after them all: torch's profiler takes CUPTI, and
    # a jax.profiler trace started after it in the same process sees no GPU events (timing.py).
    for cname in a.caches.split(","):
        cdt = FN if cname == "fp8" else BF16
        opts = dict(kv_scale=np.float32(KV_SCALE)) if cdt == FN else {}
        for t in tokens:
            if over_budget(a, f"{cname} T={t}"):
                continue
            num_slots = max(a.cache_slots, 2 * t) // a.block_size * a.block_size
            nbytes = t * shape.bytes_per_token(cache_size=cdt.itemsize, table_size=cos.dtype.itemsize)
            row = dict(cache=cname, T=t, bytes=nbytes)
            inp = Inputs(shape, t, a.calls, jnp.dtype(cdt), num_slots, a.block_size, seed=len(rows) + 1)
            host = want = None
            try:
                host, want = check_inputs(inp, cos, sin, opts)
                row["check"] = check_ours(host, want, cos, sin, opts)
            except Exception as e:  # noqa: BLE001 - the timings still stand
                row["check"] = {"error": f"{type(e).__name__}: {e}"[:200]}
            dcos, dsin = jnp.asarray(cos), jnp.asarray(sin)
            for impl in ("kernel", "xla"):
                f = make_chain(impl, a.calls, a.calls, opts)

                def run():
                    outs, inp.cache[0] = f(inp.q_nope, inp.q_pe, inp.kv_c, inp.k_pe, inp.slots, inp.pos, dcos, dsin,
                                           inp.cache[0])
                    return outs

                try:
                    row[impl] = measure(run, a, workdir)
                except Exception as e:  # noqa: BLE001 - keep the other columns
                    row[impl] = {"error": f"{type(e).__name__}: {e}"[:300]}
            del inp
            try:
                row["copy"] = measure(copy_chain(nbytes, a.calls), a, workdir)
            except Exception as e:  # noqa: BLE001
                row["copy"] = {"error": f"{type(e).__name__}: {e}"[:300]}
            rows.append(row)
            aiter_cases.append((row, num_slots, host, want))
            log(json.dumps(row))
    for k, (row, num_slots, host, want) in enumerate(aiter_cases if W is not None else []):
        if host is not None:
            row["check"]["aiter"] = check_aiter(W, host, want, cos, sin, a.dry_run)
        try:  # a dry run's interpreter ran AITER in the check only
            if not a.dry_run:
                k_us, k_n, g_us = aiter_mla.timed(W, shape, row["T"], num_slots, a.block_size, row["cache"], cos, sin,
                                                  KV_SCALE, a.calls, seed=k + 1, n_sets=a.calls)
                row["aiter"] = dict(kernel_us=k_us, kernels_per_call=k_n, graph_us=g_us)
        except Exception as e:  # noqa: BLE001 - AITER's own failure is a result, not ours
            row["aiter"] = {"error": f"{type(e).__name__}: {e}"[:300]}
        log(f"aiter {row['cache']} T={row['T']}: check {row['check'].get('aiter')}, {json.dumps(row.get('aiter'))}")
    for row in rows:
        log(f"check {row['cache']} T={row['T']} vs the reference: {row['check']}")
    with open(os.path.join(a.out_dir, "bench_mla.json"), "w") as fh:
        json.dump(dict(meta=meta, rows=rows), fh, indent=1)
    shutil.rmtree(workdir, ignore_errors=True)

    expect_device = a.profile and not a.dry_run
    timing = "device (profiler GPU busy per call)" if expect_device else "wall per call"
    log(f"\nMLA {shape.name}: {shape.q_heads} q heads, Dc {shape.latent_dim}, Dr {shape.rope_dim}; time = {timing}, "
        f"us; {a.calls} calls per jit; copy ceiling {ceiling / 1e9:.0f} GB/s; AITER: "
        + (W.__file__ if W else why))
    log("targets: x/A >= 1.2 at T = 1 and T >= 8192; of copy >= 85% at T >= 8192")
    log(f"{'cache':5s} {'T':>6s} {'ours':>9s} {'of copy':>7s} {'of ceil':>7s} {'jnp':>9s} {'x/J':>6s} "
        f"{'A us':>9s} {'x/A':>6s} {'A graph':>9s} {'x/Ag':>6s}  check")
    for r in rows:
        us = r.get("kernel", {}).get("time_us")
        ai = r.get("aiter", {})
        log(f"{r['cache']:5s} {r['T']:6d} {fmt(us)} {fmt(ratio(r.get('copy', {}).get('time_us'), us), 7, 3)} "
            f"{fmt(ratio(r['bytes'] / ceiling * 1e6, us), 7, 3)} {fmt(r.get('xla', {}).get('time_us'))} "
            f"{fmt(ratio(r.get('xla', {}).get('time_us'), us), 6)} {fmt(ai.get('kernel_us'))} "
            f"{fmt(ratio(ai.get('kernel_us'), us), 6)} {fmt(ai.get('graph_us'))} {fmt(ratio(ai.get('graph_us'), us), 6)}"
            f"  {', '.join(f'{k} {v}' for k, v in r.get('check', {}).items())}"
            + "".join(f"  [{k}: {r[k]['error'][:80]}]" for k in ("kernel", "xla", "copy", "aiter")
                      if isinstance(r.get(k), dict) and r[k].get("error"))
            + "".join(f"  [{k}: {note}]" for k in ("kernel", "xla", "copy")
                      if (note := wall_note(r.get(k, {}), expect_device))))
    write_log(os.path.join(a.out_dir, "bench_mla.log"))
    ours_ok = all(r.get("check", {}).get("kernel") == "exact" for r in rows)
    return 0 if ours_ok and all("error" not in r.get(k, {}) for r in rows for k in ("kernel", "xla")) else 1


if __name__ == "__main__":
    sys.exit(main())
