"""rope_and_cache on an NVIDIA GPU: the CUDA kernel vs the XLA path, side by side in one run.

    python benchmarks/bench_gpu.py OUT_DIR [--quick]

Prints a table and writes OUT_DIR/bench_gpu.csv and OUT_DIR/bench_gpu.json.

Method (stated in the output too):
  * device time per call: N = 16 calls unrolled in ONE jit (each on its own input set, the
    caches carried from call to call and donated); wall time of the whole executable around
    jax.block_until_ready, minus the executable's fixed dispatch overhead, divided by N; warm-up
    first, median of R repetitions; no profiler. The fixed overhead is measured once per impl as
    2*t(N) - t(2N) (Llama shapes, T=8, flash; clamped to [0, t(N)/2]) and reported. XLA may
    capture the unrolled calls into a command buffer (CUDA graph), so at small T this is the
    per-call cost inside the executable (kernel + per-node gap or per-thunk host cost), not the
    bare kernel time. Input sets: for T >= 2048 each set is bigger than the 60 MB L2 (Llama);
    for T <= 128 the 16 sets fit in L2, as in real decode where q/k/v were just written.
  * bytes per call (the floor), as benchmarks/baselines: (QH+2KH)*D*s_in + R*s_table + 2*s_index
    + (QH+KH)*D*s_out + 2*KH*D*s_cache per token; GB/s = bytes / time.
  * ceiling: a device-to-device copy measured in the same run (a 2 GiB buffer rewritten by a
    fori_loop of `x + 1` steps, bytes read + written).
  * inputs are random (never zeros); caches are filled with random values.
Also: (a) a jitted 32-layer unrolled decode step (T=1, 32 caches donated), wall time per op; (b) a
1000-step lax.fori_loop of T=1 updates vs the same loop writing K and V with
lax.dynamic_update_slice.

Optional AITER column: when torch and AITER's Triton kernel
`aiter.ops.triton.fusions.fused_kv_cache.fused_qk_rope_reshape_and_cache` import (an installed
AITER, or `--peers DIR` holding ../shared/peers' bench_peers.py and an assembled AITER source in
DIR/aiter_src, see ../shared/peers/README.md), every case also times AITER on inputs of the same
shapes: device time per call from a CUDA graph of 16 calls / 16 (same buffers each call), bf16
tables (as bench_peers runs it), and the ratio AITER time / kernel time (> 1: the kernel is
faster). Without AITER only the XLA path and the copy ceiling are printed next to the kernel.
`--aiter off` skips it. `--dry-run`: the CPU backend with small sizes (AITER through the Triton
interpreter on float32 inputs when --peers is given), to check the script without a GPU.
"""

from __future__ import annotations

import argparse
import csv
import functools
import json
import os
import statistics
import sys
import time

if "--dry-run" in sys.argv[1:]:  # before jax is imported
    os.environ["JAX_PLATFORMS"] = "cpu"

import jax
import jax.numpy as jnp
import numpy as np

import jax_rope_cache as jrc

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # run with -P too
from cuda_graph_timing import graph_us  # noqa: E402  (benchmarks/)
from jax_rope_cache.models import presets

# (QH, KH, D) of the library's named models (models/presets.py), keyed by their per-shard names.
_MODELS = (presets.model_shape("llama-3.1-8b"), presets.model_shape("gpt-oss-120b", 8))
CONFIGS = {m.name: (m.q_heads, m.kv_heads, m.head_dim) for m in _MODELS}
LLAMA = _MODELS[0].name
TOKENS = (1, 8, 128, 2048, 8192, 32768)
LAYOUTS = ("flash", "xpacked")
PATTERNS = ("random", "prefill")
BS = 16
MAX_POS = 131072
L2_BYTES = 60e6
N_SETS = 16  # ops (each with its own input set) unrolled in one timed executable


def _timeit(fn, args_fn, reps, warm=2):
    """Median wall seconds of fn(*args_fn()) with block_until_ready; args_fn returns fresh args
    (donated buffers are consumed)."""
    for _ in range(warm):
        jax.block_until_ready(fn(*args_fn()))
    ts = []
    for _ in range(reps):
        a = args_fn()
        jax.block_until_ready(a)
        t0 = time.perf_counter()
        out = fn(*a)
        jax.block_until_ready(out)
        ts.append(time.perf_counter() - t0)
        del out
    return statistics.median(ts)


def copy_bandwidth(reps=5, n=512 * 1024 * 1024):  # 2 GiB of f32
    x = jax.random.normal(jax.random.key(0), (n,), jnp.float32)
    steps = 10
    f = jax.jit(lambda x: jax.lax.fori_loop(0, steps, lambda i, y: y + 1.0, x))
    t = _timeit(f, lambda: (x,), reps)
    return 2 * n * 4 * steps / t


def slot_pattern(pattern, t, num_slots, rng):
    if pattern == "random":
        return rng.permutation(num_slots)[:t].astype(np.int32)
    # prefill: sequences of up to 1024 tokens, each filling random whole blocks in order
    nblk = num_slots // BS
    blocks = rng.permutation(nblk)
    tok = np.arange(t)
    return (blocks[tok // BS] * BS + tok % BS).astype(np.int32)


def chain_time(cfg, t, layout, pattern, impl, reps, rng, n_sets=N_SETS, n_calls=N_SETS):
    """Median wall seconds of ONE executable running n_calls ops (cycling over n_sets input sets)."""
    qh, kh, d = cfg
    n = n_sets
    num_slots = max(4 * t, 4096) // BS * BS
    nb = num_slots // BS
    bf16 = jnp.bfloat16
    key = jax.random.key(rng.integers(1 << 30))
    ks = jax.random.split(key, 6)
    q = [jax.random.normal(k, (t, qh, d), jnp.float32).astype(bf16) for k in jax.random.split(ks[0], n)]
    k_ = [jax.random.normal(k, (t, kh, d), jnp.float32).astype(bf16) for k in jax.random.split(ks[1], n)]
    v = [jax.random.normal(k, (t, kh, d), jnp.float32).astype(bf16) for k in jax.random.split(ks[2], n)]
    # distinct slots across the whole chain, so no call overwrites another's
    allslots = slot_pattern(pattern, t * n, max(num_slots, t * n) // BS * BS, rng) if pattern == "prefill" else None
    slots = []
    for i in range(n):
        if allslots is not None:
            s_ = allslots[i * t:(i + 1) * t]
        else:
            s_ = slot_pattern(pattern, t, num_slots, rng)
        slots.append(jnp.asarray(s_ % num_slots))
    pos = [jnp.asarray(rng.integers(0, MAX_POS, t).astype(np.int32)) for _ in range(n)]
    ang = jax.random.uniform(ks[3], (MAX_POS, d // 2), jnp.float32, -3.0, 3.0)
    cos, sin = jnp.cos(ang), jnp.sin(ang)

    def chain(q, k, v, slots, pos, cos, sin, kc, vc):
        outs = []
        for j in range(n_calls):
            i = j % n
            qo, ko, kc, vc = jrc.rope_and_cache(q[i], k[i], v[i], kc, vc, slots[i], pos[i], cos, sin, layout=layout,
                                                impl=impl)
            outs.append(qo)
            outs.append(ko)
        return outs, kc, vc

    f = jax.jit(chain, donate_argnums=(7, 8))
    caches = [jrc.make_kv_cache(nb, BS, kh, d, bf16, layout=layout, fill="random", seed=1)]

    def args():
        kc, vc = caches.pop()
        return (q, k_, v, slots, pos, cos, sin, kc, vc)

    def run(*a):
        out = f(*a)
        caches.append(out[1:])
        return out[0]

    return _timeit(run, args, reps)


def dispatch_overhead(impl, reps, rng):
    """Fixed cost of launching one N_SETS-call executable: 2*t(N) - t(2N) at a small T."""
    cfg = CONFIGS[LLAMA]
    t1 = chain_time(cfg, 8, "flash", "random", impl, reps, rng)
    t2 = chain_time(cfg, 8, "flash", "random", impl, reps, rng, n_calls=2 * N_SETS)
    return min(max(0.0, 2 * t1 - t2), 0.5 * t1), (t2 - t1) / N_SETS  # clamped against noise


def op_time(cfg, t, layout, pattern, impl, reps, rng, overhead):
    tm = chain_time(cfg, t, layout, pattern, impl, reps, rng)
    if tm - overhead < 0.5 * tm:  # noise: keep the plain per-call wall time
        return tm / N_SETS, N_SETS
    return (tm - overhead) / N_SETS, N_SETS


def decode_step(cfg, impl, reps, layers=32):
    qh, kh, d = cfg
    bf16 = jnp.bfloat16
    nb = 4096
    kcs = [jrc.make_kv_cache(nb, BS, kh, d, bf16, fill="random", seed=i) for i in range(layers)]
    key = jax.random.key(7)
    q = jax.random.normal(key, (layers, 1, qh, d), jnp.float32).astype(bf16)
    k = jax.random.normal(jax.random.key(8), (layers, 1, kh, d), jnp.float32).astype(bf16)
    ang = jax.random.uniform(key, (MAX_POS, d // 2), jnp.float32, -3.0, 3.0)
    cos, sin = jnp.cos(ang), jnp.sin(ang)
    qs = [q[i] for i in range(layers)]
    ks = [k[i] for i in range(layers)]

    def step(qs, ks, caches, slot, pos):
        out, new = [], []
        for i in range(layers):
            qo, ko, kc, vc = jrc.rope_and_cache(qs[i], ks[i], ks[i], caches[i][0], caches[i][1], slot, pos, cos,
                                                sin, impl=impl)
            out.append(qo)
            new.append((kc, vc))
        return out, new

    f = jax.jit(step, donate_argnums=(2,))
    state = {"caches": kcs, "i": 0}

    def args():
        i = state["i"] = state["i"] + 1
        return (qs, ks, state["caches"], jnp.array([i % (nb * BS)], jnp.int32), jnp.array([i], jnp.int32))

    def run(*a):
        out, new = f(*a)
        state["caches"] = new
        return out

    return _timeit(run, args, reps, warm=3) / layers


def fori_loop_steps(cfg, impl, steps=1000, reps=5):
    qh, kh, d = cfg
    bf16 = jnp.bfloat16
    nb = 4096
    q = jax.random.normal(jax.random.key(1), (1, qh, d), jnp.float32).astype(bf16)
    k = jax.random.normal(jax.random.key(2), (1, kh, d), jnp.float32).astype(bf16)
    ang = jax.random.uniform(jax.random.key(3), (MAX_POS, d // 2), jnp.float32, -3.0, 3.0)
    cos, sin = jnp.cos(ang), jnp.sin(ang)

    if impl == "dus":
        def body(i, carry):
            kc, vc = carry
            blk, off = i // BS, i % BS
            kc = jax.lax.dynamic_update_slice(kc, k[None], (blk, off, 0, 0))
            vc = jax.lax.dynamic_update_slice(vc, k[None], (blk, off, 0, 0))
            return kc, vc
    else:
        def body(i, carry):
            kc, vc = carry
            s = jnp.reshape(i, (1,)).astype(jnp.int32)
            _, _, kc, vc = jrc.rope_and_cache(q, k, k, kc, vc, s, s, cos, sin, impl=impl)
            return kc, vc

    f = jax.jit(lambda kc, vc: jax.lax.fori_loop(0, steps, body, (kc, vc)), donate_argnums=(0, 1))
    caches = [jrc.make_kv_cache(nb, BS, kh, d, bf16, fill="random")]

    def args():
        return caches.pop()

    def run(*a):
        out = f(*a)
        caches.append(out)
        return out

    return _timeit(run, args, reps) / steps


# ---- AITER (optional; imported at run time, never part of this repository) -------------------
AITER_MODULE = "aiter.ops.triton.fusions.fused_kv_cache"
AITER_GRAPH_CALLS = 16


def load_aiter(peers=None, dry_run=False):
    """(AITER's fused_kv_cache module, None) or (None, why it is unavailable)."""
    if dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # Triton on the CPU
    try:
        import torch  # noqa: F401
    except Exception as e:  # noqa: BLE001
        return None, f"torch does not import ({type(e).__name__}: {e})"
    try:
        if peers:
            # bench_peers.load_aiter registers AITER's package folders without running aiter/__init__.py
            for p in (os.path.join(peers, "aiter_src"), peers):
                sys.path.insert(0, os.path.abspath(p))
            import bench_peers
            return bench_peers.load_aiter(stub_arch="cpu-interpreter" if dry_run else None), None
        import importlib
        return importlib.import_module(AITER_MODULE), None
    except Exception as e:  # noqa: BLE001
        return None, f"{type(e).__name__}: {e}"[:300]


def aiter_time(W, cfg, t, layout, pattern, rng, dry_run=False):
    """AITER's fused rope + cache write on inputs of this case's shapes: us per call."""
    import torch

    qh, kh, d = cfg
    dev = "cpu" if dry_run else "cuda"
    in_dt = torch.float32 if dry_run else torch.bfloat16  # the Triton interpreter's bf16 math is wrong
    num_slots = max(4 * t, 4096) // BS * BS
    nb = num_slots // BS
    x = 8  # 16 bytes of bf16
    g = torch.Generator(device=dev).manual_seed(int(rng.integers(1 << 30)))  # generated on the device

    def rnd(*shape):
        return torch.randn(*shape, generator=g, device=dev).to(in_dt)

    q, k, v = rnd(t, qh, d), rnd(t, kh, d), rnd(t, kh, d)
    flash = layout == "flash"
    kshape, vshape = ((nb, BS, kh, d), (nb, BS, kh, d)) if flash else ((nb, kh, d // x, BS, x), (nb, kh, d, BS))
    kc = torch.randn(*kshape, generator=g, device=dev).to(torch.bfloat16)
    vc = torch.randn(*vshape, generator=g, device=dev).to(torch.bfloat16)
    slots = torch.from_numpy(slot_pattern(pattern, t, num_slots, rng) % num_slots).to(dev)
    pos = torch.from_numpy(rng.integers(0, MAX_POS, t).astype(np.int32)).to(dev)
    ang = torch.rand(MAX_POS, d // 2, generator=g, device=dev) * 6.0 - 3.0
    cos, sin = torch.cos(ang).to(device=dev, dtype=in_dt), torch.sin(ang).to(device=dev, dtype=in_dt)
    q_out, k_out = torch.empty_like(q), torch.empty_like(k)

    def call():
        return W.fused_qk_rope_reshape_and_cache(q, k, v, kc, vc, slots, pos, cos, sin, None, None, True, flash,
                                                 apply_scale=False, q_out=q_out, k_out=k_out, output_zeros=False)

    r = call()
    if len(r) != 4 or r[2] is not kc or r[3] is not vc:
        raise RuntimeError("AITER returned an unexpected result (expected q_out, k_out and the two caches)")
    if dry_run:
        t0 = time.perf_counter()
        call()
        us = (time.perf_counter() - t0) * 1e6
    else:
        us = graph_us(call, n_calls=AITER_GRAPH_CALLS, min_total_ms=30.0)
    del q, k, v, kc, vc, q_out, k_out, r
    if not dry_run:
        torch.cuda.empty_cache()
    return us


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out_dir")
    ap.add_argument("--quick", action="store_true", help="fewer sizes and repetitions")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--tokens", type=str, default=None, help="comma-separated T values (default: all)")
    ap.add_argument("--prefill-tokens", type=str, default="8192,32768",
                    help="T values also measured with prefill-contiguous slots")
    ap.add_argument("--skip-loops", action="store_true", help="skip the decode-step and fori_loop timings")
    ap.add_argument("--aiter", choices=("auto", "off"), default="auto",
                    help="auto: add AITER's time and ratio when torch and AITER import (default)")
    ap.add_argument("--peers", default=None,
                    help="folder with bench_peers.py and aiter_src/ (an assembled AITER source) to import AITER from")
    ap.add_argument("--dry-run", action="store_true", help="CPU backend, small sizes: checks the script")
    a = ap.parse_args(argv)
    os.makedirs(a.out_dir, exist_ok=True)
    dev = jax.devices()[0]
    reps = 5 if a.quick else a.reps
    tokens = (1, 128, 8192) if a.quick else TOKENS
    if a.tokens:
        tokens = tuple(int(x) for x in a.tokens.split(","))
    prefill_tokens = tuple(int(x) for x in a.prefill_tokens.split(","))
    if a.dry_run:
        reps, a.skip_loops = 1, True
        tokens = tuple(t for t in tokens if t <= 8) or (1, 8)
        prefill_tokens = (8,)
    rng = np.random.default_rng(0)
    print(f"device: {dev.device_kind} ({dev.platform}), jax {jax.__version__}", flush=True)
    W, why = (None, "--aiter off") if a.aiter == "off" else load_aiter(a.peers, a.dry_run)
    print(f"AITER: {'loaded from ' + W.__file__ if W is not None else 'not used (' + why + ')'}", flush=True)
    bw = copy_bandwidth(n=(16 << 20) if a.dry_run else 512 << 20)
    print(f"device-to-device copy: {bw / 1e9:.0f} GB/s (read + write)", flush=True)
    overhead = {}
    for impl in ("kernel", "xla"):
        overhead[impl], per_call8 = dispatch_overhead(impl, reps, rng)
        print(f"executable dispatch overhead ({impl}, {N_SETS} calls): {overhead[impl] * 1e6:.1f} us; "
              f"llama T=8 per call by difference: {per_call8 * 1e6:.2f} us", flush=True)
    rows = []
    for name, cfg in CONFIGS.items():
        qh, kh, d = cfg
        for layout in LAYOUTS:
            for pattern in PATTERNS:
                for t in tokens:
                    if pattern == "prefill" and t not in prefill_tokens:
                        continue
                    res = {}
                    for impl in ("kernel", "xla"):
                        tm, n = op_time(cfg, t, layout, pattern, impl, reps, rng, overhead[impl])
                        res[impl] = tm
                    aiter_us, aiter_err = None, None
                    if W is not None:
                        try:
                            aiter_us = aiter_time(W, cfg, t, layout, pattern, rng, a.dry_run)
                        except Exception as e:  # noqa: BLE001 - the JAX columns stand without it
                            aiter_err = f"{type(e).__name__}: {e}"[:200]
                            print(f"AITER {name} {layout} T={t} {pattern}: {aiter_err}", flush=True)
                    by = presets.ModelShape(name, qh, kh, d, d).bytes_per_token() * t
                    for impl in ("kernel", "xla"):
                        gbs = by / res[impl] / 1e9
                        row = dict(config=name, layout=layout, T=t, slots=pattern, impl=impl,
                                   time_us=res[impl] * 1e6, GBps=gbs, frac_copy=gbs * 1e9 / bw,
                                   speedup_vs_xla=res["xla"] / res[impl], calls_per_jit=n)
                        if W is not None:
                            row.update(aiter_us=aiter_us, vs_aiter=aiter_us / row["time_us"] if aiter_us else None,
                                       aiter_error=aiter_err)
                        rows.append(row)
                        print(f"{name:18s} {layout:8s} T={t:6d} {pattern:8s} {impl:6s} {row['time_us']:9.2f} us "
                              f"{gbs:7.0f} GB/s {row['frac_copy']:6.1%}  x{row['speedup_vs_xla']:.2f}"
                              + (f"  AITER {aiter_us:9.2f} us, AITER/{impl} {row['vs_aiter']:.2f}" if aiter_us else ""),
                              flush=True)
    extra = {}
    for name, cfg in ([] if a.skip_loops else CONFIGS.items()):
        for impl in ("kernel", "xla"):
            extra[f"decode32_{name}_{impl}_us_per_op"] = decode_step(cfg, impl, reps) * 1e6
            print(f"decode step, 32 layers unrolled, {name} {impl}: "
                  f"{extra[f'decode32_{name}_{impl}_us_per_op']:.2f} us/op", flush=True)
    cfg = CONFIGS[LLAMA]
    for impl in (() if a.skip_loops else ("kernel", "xla", "dus")):
        extra[f"fori1000_{impl}_us_per_step"] = fori_loop_steps(cfg, impl) * 1e6
        print(f"fori_loop 1000 x T=1, llama shapes, {impl}: {extra[f'fori1000_{impl}_us_per_step']:.2f} us/step",
              flush=True)
    method = ("device time per call = (wall time of one executable of %d unrolled calls, each on its own input set, "
              "caches donated and carried, minus that executable's dispatch overhead measured as 2*t(N)-t(2N)) / N, "
              "median of %d runs after warm-up; bytes by the floor formula; ceiling = device-to-device copy "
              "(fori_loop of x+1 on 2 GiB f32) measured in this run" % (N_SETS, reps))
    if W is not None:
        method += ("; AITER = %s.fused_qk_rope_reshape_and_cache (%s), bf16 tables, CUDA graph of %d calls on the "
                   "same buffers / %d; AITER/kernel > 1: the kernel is faster"
                   % (AITER_MODULE, W.__file__, AITER_GRAPH_CALLS, AITER_GRAPH_CALLS))
    meta = dict(device=dev.device_kind, jax=jax.__version__, copy_GBps=bw / 1e9, method=method, extra=extra,
                dispatch_overhead_us={k: v * 1e6 for k, v in overhead.items()},
                aiter=(W.__file__ if W is not None else None), aiter_unavailable=why)
    with open(os.path.join(a.out_dir, "bench_gpu.csv"), "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    with open(os.path.join(a.out_dir, "bench_gpu.json"), "w") as fh:
        json.dump(dict(meta=meta, rows=rows), fh, indent=1)
    # the short table, last
    print("\n" + method)
    print(f"copy ceiling {bw / 1e9:.0f} GB/s on {dev.device_kind}")
    with_aiter = W is not None
    print(f"{'config':18s} {'layout':8s} {'T':>6s} {'slots':8s} {'kernel us':>10s} {'xla us':>9s} "
          f"{'kern GB/s':>9s} {'of copy':>7s} {'speedup':>7s}"
          + (f" {'AITER us':>9s} {'AITER/kern':>10s}" if with_aiter else ""))
    by_key = {}
    for r in rows:
        by_key.setdefault((r["config"], r["layout"], r["T"], r["slots"]), {})[r["impl"]] = r
    for (c, l, t, p), d in by_key.items():
        k, x = d["kernel"], d["xla"]
        tail = ""
        if with_aiter:
            au = k.get("aiter_us")
            tail = f" {au:9.2f} {k['vs_aiter']:10.2f}" if au else f" {'-':>9s} {'-':>10s}"
        print(f"{c:18s} {l:8s} {t:6d} {p:8s} {k['time_us']:10.2f} {x['time_us']:9.2f} {k['GBps']:9.0f} "
              f"{k['frac_copy']:7.1%} {k['speedup_vs_xla']:7.2f}" + tail)
    for key, val in extra.items():
        print(f"{key}: {val:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
