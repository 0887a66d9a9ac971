"""CPU benchmark: native CPU kernel vs the XLA path, side by side in one run.

    python benchmarks/bench_cpu.py [--tokens 4096 64 1] [--model llama-3.1-8b] [--json out.json]

Each implementation runs under a jit that donates the caches; a call's time is the median over
`--repeats` runs, the two implementations' calls alternating (inputs rotate between several sets
so the machine's caches do not serve them).
Bandwidth counts the fewest bytes the op must move (presets.ModelShape.bytes_per_token) and is
compared with a large memcpy measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_rope_cache as jrc
from jax_rope_cache.models import presets


def copy_bandwidth(nbytes=1 << 28, repeats=5) -> float:
    """Bytes read + written per second by np.copyto over a buffer larger than the caches."""
    src = np.random.default_rng(0).integers(0, 255, nbytes, np.uint8)
    dst = np.empty_like(src)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t0)
    return 2 * nbytes / np.median(times)


def make_inputs(model: presets.ModelShape, tokens: int, sets: int, seed=0):
    rng = np.random.default_rng(seed)
    bs = 16
    nb = -(-tokens // bs) * 2 + 1
    x = lambda *s: jnp.asarray(rng.standard_normal(s, np.float32), jnp.bfloat16)  # noqa: E731
    ang = rng.uniform(-np.pi, np.pi, (8192, model.rotary_dim // 2))
    cos, sin = jnp.asarray(np.cos(ang), jnp.float32), jnp.asarray(np.sin(ang), jnp.float32)
    inputs = []
    for _ in range(sets):
        q, k, v = x(tokens, model.q_heads, model.head_dim), x(tokens, model.kv_heads, model.head_dim), \
            x(tokens, model.kv_heads, model.head_dim)
        slots = jnp.asarray(rng.permutation(nb * bs)[:tokens].astype(np.int32))
        pos = jnp.asarray(rng.integers(0, 8192, tokens).astype(np.int32))
        inputs.append((q, k, v, slots, pos))
    caches = jrc.make_kv_cache(nb, bs, model.kv_heads, model.head_dim, jnp.bfloat16, fill="random", seed=seed)
    return inputs, caches, cos, sin


def time_impls(impls, inputs, caches, cos, sin, repeats):
    """Median seconds per call of each impl; calls alternate between the impls so that load from
    elsewhere on the machine hits them alike (the ratio is what this benchmark reports)."""
    steps, state = {}, {}
    for impl in impls:
        steps[impl] = jax.jit(lambda q, k, v, kc, vc, s, p, c, sn, impl=impl: jrc.rope_and_cache(
            q, k, v, kc, vc, s, p, c, sn, impl=impl), donate_argnums=(3, 4))
        kc, vc = (jnp.array(c, copy=True) for c in caches)
        for q, k, v, s, p in inputs:  # warm up: compile and touch every input set
            out = steps[impl](q, k, v, kc, vc, s, p, cos, sin)
            kc, vc = out[2], out[3]
        jax.block_until_ready(out)
        state[impl] = (kc, vc)
    times = {impl: [] for impl in impls}
    for i in range(repeats):
        q, k, v, s, p = inputs[i % len(inputs)]
        for impl in impls:
            kc, vc = state[impl]
            t0 = time.perf_counter()
            out = steps[impl](q, k, v, kc, vc, s, p, cos, sin)
            jax.block_until_ready(out)
            times[impl].append(time.perf_counter() - t0)
            state[impl] = (out[2], out[3])
    return {impl: float(np.median(t)) for impl, t in times.items()}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama-3.1-8b", choices=sorted(presets.MODELS))
    p.add_argument("--tokens", type=int, nargs="+", default=[4096, 256, 1])
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    model = presets.MODELS[a.model]
    ceiling = copy_bandwidth()
    per_token = model.bytes_per_token()
    rows = []
    print(f"{jax.devices()[0].device_kind}, {a.model}: {per_token} B/token; memcpy {ceiling / 1e9:.1f} GB/s")
    print(f"{'T':>6} {'impl':<7} {'time':>10} {'GB/s':>7} {'of copy':>8} {'vs xla':>7}")
    for t in a.tokens:
        inputs, caches, cos, sin = make_inputs(model, t, sets=4)
        res = time_impls(("kernel", "xla"), inputs, caches, cos, sin, a.repeats)
        for impl in ("kernel", "xla"):
            bw = per_token * t / res[impl]
            row = dict(model=a.model, tokens=t, impl=impl, seconds=res[impl], gbps=bw / 1e9,
                       fraction_of_copy=bw / ceiling, speedup_vs_xla=res["xla"] / res[impl])
            rows.append(row)
            print(f"{t:>6} {impl:<7} {res[impl] * 1e6:>8.0f}us {bw / 1e9:>7.2f} {bw / ceiling:>8.1%} "
                  f"{row['speedup_vs_xla']:>6.2f}x")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(device=jax.devices()[0].device_kind, copy_gbps=ceiling / 1e9, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
