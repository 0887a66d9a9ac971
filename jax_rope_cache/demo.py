"""The main job: a jitted decode loop on the default device, checked against the reference and
timed for the native kernel vs the XLA path.

Each step rotates one new token per sequence for every layer and writes it into that layer's
paged cache (caches donated, carried through a fori_loop). Afterwards the final caches are compared
with the numpy reference applied to all tokens of all steps at once (slots never repeat, so that
is the same computation), and both implementations are timed per step.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_rope_cache as jrc
from jax_rope_cache import reference, shapes


def build(model: shapes.ModelShape, batch: int, steps: int, layers: int, block_size: int, seed: int):
    rng = np.random.default_rng(seed)
    qh, kh, d = model.q_heads, model.kv_heads, model.head_dim
    blocks_per_seq = -(-steps // block_size)
    nb = batch * blocks_per_seq + 1
    # Each sequence owns random blocks; step s of sequence b writes its s-th slot.
    perm = rng.permutation(nb)[: batch * blocks_per_seq].reshape(batch, blocks_per_seq)
    s = np.arange(steps)
    slots = (perm[:, s // block_size] * block_size + s % block_size).T.astype(np.int32)  # [steps, batch]
    start = rng.integers(0, 512, batch)
    positions = (start[None, :] + s[:, None]).astype(np.int32)
    inv = 1.0 / (10000.0 ** (np.arange(0, d, 2) / d))
    ang = np.arange(1024)[:, None] * inv[None, :]
    cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    dt = jnp.bfloat16
    x = lambda *shape: rng.standard_normal(shape, np.float32).astype(dt)  # noqa: E731
    qkv = [(x(steps, batch, qh, d), x(steps, batch, kh, d), x(steps, batch, kh, d)) for _ in range(layers)]
    caches = [jrc.make_kv_cache(nb, block_size, kh, d, dt, fill="random", seed=seed + i) for i in range(layers)]
    return qkv, caches, slots, positions, cos, sin


def make_loop(steps: int, impl: str):
    def loop(qkv, caches, slots, positions, cos, sin):
        def body(i, carry):
            caches, acc = carry
            new = []
            for (q, k, v), (kc, vc) in zip(qkv, caches):
                q_out, _, kc, vc = jrc.rope_and_cache(q[i], k[i], v[i], kc, vc, slots[i], positions[i], cos, sin,
                                                      impl=impl)
                acc = acc + q_out[0, 0, 0].astype(jnp.float32)
                new.append((kc, vc))
            return new, acc
        return jax.lax.fori_loop(0, steps, body, (caches, jnp.float32(0)))
    return jax.jit(loop, donate_argnums=(1,))


def run(model_name="llama-3.1-8b", batch=64, steps=128, layers=4, block_size=16, repeats=3, seed=0):
    model = shapes.MODELS[model_name]
    qkv, caches, slots, positions, cos, sin = build(model, batch, steps, layers, block_size, seed)
    initial = [(np.asarray(kc), np.asarray(vc)) for kc, vc in caches]
    device = jax.devices()[0]
    print(f"device: {device.platform} ({device.device_kind}); {model_name} heads {model.q_heads}/{model.kv_heads} "
          f"D={model.head_dim}; {layers} layers, batch {batch}, {steps} decode steps, block size {block_size}")
    results = {}
    for impl in ("kernel", "xla"):
        loop = make_loop(steps, impl)
        fresh = lambda: [tuple(jnp.asarray(c) for c in pair) for pair in initial]  # noqa: E731
        out_caches, _ = loop(qkv, fresh(), slots, positions, cos, sin)  # compile + first run
        jax.block_until_ready(out_caches)
        times = []
        for _ in range(repeats):
            caches_in = fresh()
            jax.block_until_ready(caches_in)
            t0 = time.perf_counter()
            out_caches, _ = loop(qkv, caches_in, slots, positions, cos, sin)
            jax.block_until_ready(out_caches)
            times.append(time.perf_counter() - t0)
        results[impl] = (np.median(times), out_caches)

    # The reference: every step's tokens at once, per layer.
    ok = True
    exact_by_impl = {impl: [] for impl in results}
    flat = lambda a: np.asarray(a).reshape((steps * batch,) + a.shape[2:])  # noqa: E731
    for layer, ((q, k, v), (kc0, vc0)) in enumerate(zip(qkv, initial)):
        _, _, kc_ref, vc_ref = reference.rope_and_cache(flat(q), flat(k), flat(v), kc0, vc0, slots.ravel(),
                                                        positions.ravel(), cos, sin)
        for impl, (_, out) in results.items():
            kc, vc = (np.asarray(c) for c in out[layer])
            exact = np.array_equal(kc.view(np.uint16), kc_ref.view(np.uint16)) and np.array_equal(
                vc.view(np.uint16), vc_ref.view(np.uint16))
            close = np.allclose(kc.astype(np.float32), kc_ref.astype(np.float32), atol=2**-7, rtol=2**-7)
            ok = ok and close and (exact or impl != "kernel")
            exact_by_impl[impl].append(exact)
    per_step = {impl: results[impl][0] / steps for impl in ("kernel", "xla")}
    tokens = batch * steps * layers
    print(f"final caches vs numpy reference: kernel {'bit-exact' if all(exact_by_impl['kernel']) else 'MISMATCH'}, "
          f"xla {'bit-exact' if all(exact_by_impl['xla']) else 'within tolerance' if ok else 'MISMATCH'}")
    print(f"{'impl':<8}{'per step':>12}{'per op':>12}{'tokens/s':>14}")
    for impl in ("kernel", "xla"):
        t = results[impl][0]
        print(f"{impl:<8}{per_step[impl] * 1e6:>10.1f}us{per_step[impl] / layers * 1e6:>10.2f}us{tokens / t:>14,.0f}")
    print(f"kernel vs xla: {per_step['xla'] / per_step['kernel']:.2f}x faster per step")
    return ok


def main(argv=None):
    p = argparse.ArgumentParser(prog="jax_rope_cache demo", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama-3.1-8b", choices=sorted(shapes.MODELS))
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--block-size", type=int, default=16)
    a = p.parse_args(argv)
    ok = run(a.model, a.batch, a.steps, a.layers, a.block_size)
    raise SystemExit(0 if ok else 1)
