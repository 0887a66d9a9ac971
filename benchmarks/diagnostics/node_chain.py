#!/usr/bin/env python3
"""Marginal cost of one more call in a jitted chain, per route, with inputs that move.

    python benchmarks/diagnostics/node_chain.py OUT_DIR [--tokens 64] [--pools 1,32] [--vmodule]

One jit of N unrolled calls (a decode step of N layers: Llama-3.1-8B shapes 32/8/128, bf16, flash,
one stacked cache pair [N, ...] written at layer i by call i, as a model does, donated and carried
from step to step, q_out summed as attention would consume it), N = 1 and N = 32, for each route:
  node   rope_and_cache(impl="kernel") with JAX_ROPE_CACHE_KERNEL_NODE=1 (XLA's PTX custom call)
  ffi    rope_and_cache(impl="kernel") with JAX_ROPE_CACHE_KERNEL_NODE=0 (the FFI launcher)
  xla    rope_and_cache(impl="xla")
  baseline  no op: q passed through unrotated, and one element of each cache written in place per call
         (decoder.touch_caches, as model_step's baseline): the same parameters, consumer and cache
         dependencies, so a route's marginal cost minus the baseline's is what the op itself adds
Inputs (q, k, v, slots, positions of every call) come from a pool of P copies, the step using copy
i % P: P = 1 keeps every address fixed, P = 32 moves them every step past XLA's 16-entry trace cache
(what a decode loop does when XLA's buffers move). With --inputs step the parameters are only one
step's fused qkv, slots and positions (a decode loop's per-step inputs), each layer's qkv a fusion of
them (build_step), so few addresses move and every call has a producer. Time per step = mean over
back-to-back steps with one sync at the end (the pipelined steady state), median of R repetitions; marginal per call =
(t(32) - t(1)) / 31. Each route runs in its own process (the route is read at lowering time and
XLA's logging flags at start-up); with --vmodule a second short run of each N = 32 case logs
TF_CPP_VMODULE=command_buffer_thunk=3,traced_command_buffer=6,command_buffer_cmd=6 and counts per
step how often XLA re-traced a traced command (trace cache "create new item" / "replacement") and
hit its trace cache, and the command-buffer thunk's lines. Also checks q_out of one call against
the numpy reference. Prints a table last; writes OUT_DIR/node_chain.json.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import re
import statistics
import subprocess
import sys
import time

import numpy as np

ROUTES = ("node", "ffi", "xla", "baseline")
VMODULE = "command_buffer_thunk=3,traced_command_buffer=6,command_buffer_cmd=6"
QH, KH, D, BS = 32, 8, 128, 16  # Llama-3.1-8B heads, flash blocks of 16 slots


def impl_of(route: str) -> str:
    return "xla" if route == "xla" else "kernel"


def build(route, n, t, pool, nb, seed=0, form="layers"):
    import jax
    import jax.numpy as jnp

    import jax_rope_cache as jrc
    from jax_rope_cache.decoder import touch_caches

    qh, kh, d, bs = QH, KH, D, BS
    impl = impl_of(route)
    rng = np.random.default_rng(seed)
    cos, sin = (jnp.asarray(a) for a in jrc.rope_tables(8192, d, base=500000.0))
    keys = jax.random.split(jax.random.key(seed), 3 * pool)
    inputs = []
    caches = jrc.make_kv_cache(nb, bs, kh, d, jnp.bfloat16, fill="random", seed=seed, num_layers=n)
    if form == "step":
        return build_step(route, n, t, pool, nb, keys, rng, caches, (cos, sin))
    for p in range(pool):
        q = jax.random.normal(keys[3 * p], (n, t, qh, d), jnp.float32).astype(jnp.bfloat16)
        k = jax.random.normal(keys[3 * p + 1], (n, t, kh, d), jnp.float32).astype(jnp.bfloat16)
        v = jax.random.normal(keys[3 * p + 2], (n, t, kh, d), jnp.float32).astype(jnp.bfloat16)
        slots = jnp.asarray(np.stack([rng.choice(nb * bs, t, replace=False) for _ in range(n)]).astype(np.int32))
        pos = jnp.asarray(rng.integers(0, 8192, (n, t)).astype(np.int32))
        if form == "layers":  # one array per call, as a model's projections hand them over
            q, k, v, slots, pos = (list(x) for x in (q, k, v, slots, pos))
        inputs.append((q, k, v, slots, pos))

    def step(q, k, v, slots, pos, caches):
        acc, (kc, vc) = jnp.float32(0), caches
        for i in range(n):
            if route == "baseline":
                qo, (kc, vc) = q[i], touch_caches((kc, vc), (k[i], v[i]), slots[i], i, bs)
            else:
                qo, _, kc, vc = jrc.rope_and_cache(q[i], k[i], v[i], kc, vc, slots[i], pos[i], cos, sin,
                                                   impl=impl, layer=i)
            acc = acc + jnp.sum(qo, dtype=jnp.float32)
        return acc, (kc, vc)

    return jax.jit(step, donate_argnums=(5,)), inputs, caches, (cos, sin)


def build_step(route, n, t, pool, nb, keys, rng, caches, tables):
    """The "step" form: the parameters are one step's fused projection output x [T, QH + 2 KH, D],
    slots and positions (as a decode loop's few per-step inputs); layer i reads x times its own
    constant (a producer fusion per layer, where a model has its projection), all layers the same
    slots and positions, each its own layer of the stacked caches."""
    import jax
    import jax.numpy as jnp

    import jax_rope_cache as jrc
    from jax_rope_cache.decoder import touch_caches

    qh, kh, d, bs = QH, KH, D, BS
    impl = impl_of(route)
    cos, sin = tables
    inputs = [(jax.random.normal(keys[3 * p], (t, qh + 2 * kh, d), jnp.float32).astype(jnp.bfloat16),
               jnp.asarray(rng.choice(nb * bs, t, replace=False).astype(np.int32)),
               jnp.asarray(rng.integers(0, 8192, t).astype(np.int32))) for p in range(pool)]

    def step(x, slots, pos, caches):
        acc, (kc, vc) = jnp.float32(0), caches
        for i in range(n):
            qkv = x * jnp.bfloat16(1 + (i + 1) / 256)
            if route == "baseline":
                k, v = qkv[:, qh:qh + kh], qkv[:, qh + kh:]
                qo, (kc, vc) = qkv[:, :qh], touch_caches((kc, vc), (k, v), slots, i, bs)
            else:
                qo, _, kc, vc = jrc.rope_and_cache_qkv(qkv, kc, vc, slots, pos, cos, sin, num_q_heads=qh,
                                                       num_kv_heads=kh, impl=impl, layer=i)
            acc = acc + jnp.sum(qo, dtype=jnp.float32)
        return acc, (kc, vc)

    return jax.jit(step, donate_argnums=(3,)), inputs, caches, tables


def worker(a):
    import jax

    if a.route in ("node", "ffi"):
        os.environ["JAX_ROPE_CACHE_KERNEL_NODE"] = "1" if a.route == "node" else "0"
    from jax_rope_cache.backends import kernel_node

    res = dict(route=a.route, T=a.tokens, pool=a.pool, rows={}, device=jax.devices()[0].device_kind,
               jax=jax.__version__, plugin=kernel_node.plugin_library(), plugin_has_target=kernel_node.plugin_supports(),
               driver=kernel_node.driver_version(), xla_flags=os.environ.get("XLA_FLAGS", ""))
    for n in (1, a.chain):
        f, inputs, caches, tables = build(a.route, n, a.tokens, a.pool, a.num_blocks, form=a.inputs)
        t0 = time.perf_counter()
        compiled = f.lower(*inputs[0], caches).compile()
        hlo = compiled.as_text() or ""
        row = dict(compile_s=round(time.perf_counter() - t0, 2), inputs=a.inputs,
                   fusions=len(re.findall(r"\sfusion\(", hlo)),
                   targets=dict(collections.Counter(re.findall(r'custom_call_target="([^"]+)"', hlo))),
                   copies=len(re.findall(r"\scopy(-start)?\(", hlo)),
                   command_buffers=len(re.findall(r"command_buffer", hlo)))
        for j in range(3 + a.pool):
            out, caches = compiled(*inputs[j % a.pool], caches)
        jax.block_until_ready((out, caches))
        if a.log_steps:  # the logged run: only a few steps, counted by the parent
            sys.stderr.write("=== STEPS BEGIN\n")
            sys.stderr.flush()
            for j in range(a.log_steps):
                out, caches = compiled(*inputs[j % a.pool], caches)
            jax.block_until_ready((out, caches))
            sys.stderr.flush()
            sys.stderr.write("=== STEPS END\n")
            sys.stderr.flush()
            res["rows"][n] = row
            continue
        per = []
        for _ in range(a.reps):
            t0 = time.perf_counter()
            for j in range(a.steps):
                out, caches = compiled(*inputs[j % a.pool], caches)
            jax.block_until_ready((out, caches))
            per.append((time.perf_counter() - t0) / a.steps * 1e6)
        row.update(step_us=statistics.median(per), reps=[round(x, 2) for x in per])
        if a.trace and n == a.chain:
            row["trace"] = trace_chain(compiled, inputs, caches, a.pool, a.steps)
            caches = row["trace"].pop("caches")
        if n == a.chain and a.route != "baseline":  # one call's q_out against the reference
            row["q_out_matches_reference"] = check_one(a.route, a.tokens, tables)
        res["rows"][n] = row
        del compiled, caches, inputs
    print("RESULT_JSON " + json.dumps(res), flush=True)


def trace_chain(compiled, inputs, caches, pool, steps):
    """GPU busy time, events and executions per step from a profiler trace of `steps` steps."""
    import tempfile

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from decode_chain import trace_steps

    class R:  # the runner decode_chain.trace_steps drives
        def __init__(self):
            self.j, self.caches = 0, caches

        def step(self):
            out, self.caches = compiled(*inputs[self.j % pool], self.caches)
            self.j += 1
            return out

        def block(self, out):
            import jax
            jax.block_until_ready((out, self.caches))

    r = R()
    res = trace_steps(r, steps, tempfile.gettempdir())
    keep = ("gpu_busy_us_per_step", "gpu_span_us_per_step", "gpu_events_per_step", "executions", "exec_span_us",
            "exec_idle_us", "our_kernel_us", "xla_kernel_us", "inner_gap_us", "top_gpu_events", "host_events")
    out = {k: res.get(k) for k in keep}
    out["caches"] = r.caches
    return out


def check_one(route, t, tables):
    import jax
    import jax.numpy as jnp

    import jax_rope_cache as jrc
    from jax_rope_cache import reference

    rng = np.random.default_rng(5)
    nb, bs = 64, BS
    q = rng.standard_normal((t, QH, D)).astype(jnp.bfloat16)
    k = rng.standard_normal((t, KH, D)).astype(jnp.bfloat16)
    v = rng.standard_normal((t, KH, D)).astype(jnp.bfloat16)
    kc = rng.standard_normal((nb, bs, KH, D)).astype(jnp.bfloat16)
    vc = rng.standard_normal((nb, bs, KH, D)).astype(jnp.bfloat16)
    slots = rng.choice(nb * bs, t, replace=False).astype(np.int32)
    pos = rng.integers(0, 8192, t).astype(np.int32)
    cos, sin = (np.asarray(x) for x in tables)
    want = reference.rope_and_cache(q, k, v, kc, vc, slots, pos, cos, sin)
    f = jax.jit(lambda *x: jrc.rope_and_cache(*x, impl=impl_of(route)))
    got = f(q, k, v, kc, vc, slots, pos, cos, sin)
    if route == "xla":  # the XLA path is not bit-exact on GPU for every op; compare q_out closely
        return bool(np.allclose(np.asarray(got[0], np.float32), np.asarray(want[0], np.float32), atol=2e-2))
    return all(np.array_equal(np.asarray(g).view(np.uint16), np.asarray(w).view(np.uint16)) for g, w in zip(got, want))


def count_log(text):
    """Per-phase counts of XLA's command-buffer log lines between the step markers."""
    body = text.split("=== STEPS BEGIN", 1)[-1].split("=== STEPS END", 1)[0]
    kinds = collections.Counter()
    for ln in body.splitlines():
        if "trace cache" in ln:
            m = re.search(r"trace cache (hit|create new item|does replacement|force-retrace)", ln)
            kinds["trace cache " + (m.group(1) if m else "other")] += 1
        elif "command_buffer_thunk" in ln:
            msg = re.sub(r"0x[0-9a-f]+|\d+", "#", ln.split("]", 1)[-1].strip())[:60]
            kinds["thunk: " + msg] += 1
    return kinds


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out_dir", nargs="?", default=".")
    ap.add_argument("--routes", default=",".join(ROUTES))
    ap.add_argument("--tokens", default="64")
    ap.add_argument("--pools", default="1,32")
    ap.add_argument("--inputs", default="layers", choices=("layers", "stacked", "step"),
                    help="layers: one array per call (a model's projection outputs); stacked: call i slices "
                         "[N, ...] arrays (XLA copies each slice into its own buffer before a custom call); "
                         "step: one step's fused qkv, slots and positions, scaled per layer by a fusion")
    ap.add_argument("--trace", action="store_true", help="also trace the N-call step: GPU busy, kernels per step")
    ap.add_argument("--chain", type=int, default=32)
    ap.add_argument("--num-blocks", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--vmodule", action="store_true", help="also count XLA's re-traces per step")
    ap.add_argument("--log-steps", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--route", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--pool", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--timeout", type=int, default=240)
    a = ap.parse_args()
    if a.route:
        a.tokens = int(a.tokens)
        return worker(a)
    os.makedirs(a.out_dir, exist_ok=True)
    results = []
    for t in [int(x) for x in a.tokens.split(",")]:
        for route in a.routes.split(","):
            for pool in [int(x) for x in a.pools.split(",")]:
                base = [sys.executable, os.path.abspath(__file__), "--route", route, "--tokens", str(t), "--pool",
                        str(pool), "--chain", str(a.chain), "--num-blocks", str(a.num_blocks), "--reps", str(a.reps),
                        "--steps", str(a.steps), "--inputs", a.inputs] + (["--trace"] if a.trace else [])
                t0 = time.perf_counter()
                p = subprocess.run(base, capture_output=True, text=True, timeout=a.timeout)
                out = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT_JSON ")]
                res = json.loads(out[-1][12:]) if out else dict(route=route, T=t, pool=pool,
                                                                 error=(p.stderr or "")[-800:])
                if a.vmodule and out:
                    env = dict(os.environ, TF_CPP_VMODULE=VMODULE, TF_CPP_MIN_LOG_LEVEL="0")
                    steps = 4
                    q = subprocess.run(base + ["--log-steps", str(steps)], capture_output=True, text=True,
                                       timeout=a.timeout, env=env)
                    with open(os.path.join(a.out_dir, f"vmodule_{route}_T{t}_P{pool}.log"), "w") as fh:
                        fh.write(q.stderr[-2_000_000:])
                    parts = q.stderr.split("=== STEPS BEGIN")
                    if len(parts) >= 3:  # the N = chain run is the second
                        res["vmodule_per_step"] = {k: v / steps for k, v in count_log("=== STEPS BEGIN" + parts[2]).items()}
                res["wall_s"] = round(time.perf_counter() - t0, 1)
                results.append(res)
                print(json.dumps(res)[:1500], flush=True)
    with open(os.path.join(a.out_dir, "node_chain.json"), "w") as fh:
        json.dump(results, fh, indent=1)
    print(f"\nmarginal per call = (t({a.chain}) - t(1)) / {a.chain - 1}; t = pipelined step time (median of reps); "
          "- base = marginal minus the baseline route's (same T and pool): what the op adds")
    print(f"{'route':8s} {'T':>5s} {'pool':>4s} {'t(1) us':>9s} {'t(N) us':>9s} {'marg us':>8s} {'ok':>3s} "
          f"{'- base':>7s} {'copies':>6s} {'fus':>4s} {'busy us':>8s} {'ev/step':>7s}  targets / re-traces per step")

    def marginal(r):
        rows = r.get("rows") or {}
        t1, tn = (rows.get(k, {}).get("step_us") for k in ("1", str(a.chain)))
        return (tn - t1) / (a.chain - 1) if t1 and tn else None

    base = {(r["T"], r["pool"]): marginal(r) for r in results if r["route"] == "baseline"}
    for r in results:
        rows = r.get("rows") or {}
        rn = rows.get(str(a.chain)) or {}
        marg, b = marginal(r), base.get((r["T"], r["pool"]))
        over = marg - b if marg is not None and b is not None else None
        f = lambda x, w=9, p=1: f"{x:{w}.{p}f}" if isinstance(x, (int, float)) else f"{'-':>{w}}"  # noqa: E731
        vm = r.get("vmodule_per_step") or {}
        t1 = (rows.get("1") or {}).get("step_us")
        print(f"{r['route']:8s} {r['T']:5d} {r['pool']:4d} {f(t1)} {f(rn.get('step_us'))} {f(marg, 8, 2)} "
              f"{str(rn.get('q_out_matches_reference', '-'))[:3]:>3s} {f(over, 7, 2)} {f(rn.get('copies'), 6, 0)} "
              f"{f(rn.get('fusions'), 4, 0)} "
              f"{f((rn.get('trace') or {}).get('gpu_busy_us_per_step'), 8)} "
              f"{f((rn.get('trace') or {}).get('gpu_events_per_step'), 7)}  "
              f"{rn.get('targets')} {dict((k, round(v, 1)) for k, v in vm.items() if 'trace' in k)}"
              + (f" ERROR {r['error'][-300:]}" if r.get("error") else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
