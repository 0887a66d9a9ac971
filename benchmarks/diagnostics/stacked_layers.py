"""Per-op time with one stacked [L, ...] cache written at a traced layer index does not grow with L.

    python benchmarks/diagnostics/stacked_layers.py [--layers 8 64] [--preset llama-3.1-8b --tp 8]

A jitted `lax.scan` over L layers (one decode step, batch 64 tokens) writes layer i of the stacked
caches (donated). If any layer's write copied or sliced the stack, the time per op would grow
with L (the stack is L times larger); it stays flat when the update is in place. Time per op =
median step time / L.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_rope_cache as jrc
from jax_rope_cache.models import presets


def per_op_seconds(model, layers, impl, batch=64, blocks=512, repeats=20):
    rng = np.random.default_rng(0)
    x = lambda *s: jnp.asarray(rng.standard_normal(s, np.float32), jnp.bfloat16)  # noqa: E731
    q, k, v = x(batch, model.q_heads, model.head_dim), x(batch, model.kv_heads, model.head_dim), \
        x(batch, model.kv_heads, model.head_dim)
    slots = jnp.asarray(rng.permutation(blocks * 16)[:batch].astype(np.int32))
    pos = jnp.asarray(rng.integers(0, 4096, batch).astype(np.int32))
    ang = rng.uniform(-np.pi, np.pi, (4096, model.rotary_dim // 2))
    cos, sin = jnp.asarray(np.cos(ang), jnp.float32), jnp.asarray(np.sin(ang), jnp.float32)
    kc, vc = jrc.make_kv_cache(blocks, 16, model.kv_heads, model.head_dim, num_layers=layers)

    def step(kc, vc):
        def layer_fn(carry, i):
            kc, vc, acc = carry
            qo, ko, kc, vc = jrc.rope_and_cache(q, k, v, kc, vc, slots, pos, cos, sin, impl=impl, layer=i)
            return (kc, vc, acc + jnp.sum(qo, dtype=jnp.float32) + jnp.sum(ko, dtype=jnp.float32)), None
        return jax.lax.scan(layer_fn, (kc, vc, jnp.float32(0)), jnp.arange(layers))[0]

    fn = jax.jit(step, donate_argnums=(0, 1))
    kc, vc, _ = fn(kc, vc)
    jax.block_until_ready(kc)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        kc, vc, _ = fn(kc, vc)
        jax.block_until_ready(kc)
        times.append(time.perf_counter() - t0)
    return float(np.median(times)) / layers


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, nargs="+", default=[8, 64])
    p.add_argument("--preset", default="llama-3.1-8b", choices=sorted(presets.MODELS))
    p.add_argument("--tp", type=int, default=8)
    a = p.parse_args(argv)
    model = presets.model_shape(a.preset, a.tp)
    print(f"{jax.devices()[0].device_kind}; {model.name}, batch 64, 512 blocks of 16 per layer")
    print(f"{'impl':<8}" + "".join(f"{'L=' + str(n):>12}" for n in a.layers))
    for impl in ("kernel", "xla"):
        row = [per_op_seconds(model, n, impl) for n in a.layers]
        print(f"{impl:<8}" + "".join(f"{t * 1e6:>10.2f}us" for t in row))


if __name__ == "__main__":
    main()
