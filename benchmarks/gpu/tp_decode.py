"""Tensor-parallel decode over every device of the default backend, heads split with shard_map.

    python benchmarks/bench_gpu.py tp [--preset llama-3.1-8b] [--layers 32] [--steps 64] [--batch 64]

q/k/v heads and the caches' KV-head axis are split over a 1-D mesh "tp" of all devices; each
device runs the op on its own heads (one kernel per layer per device, no communication). The
stacked [L, ...] caches are carried through `lax.scan` over layers inside a `fori_loop` over steps
and donated. Afterwards the caches (gathered to the host) are compared with the numpy reference,
and the time per step is reported for the kernel and the XLA path.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_rope_cache as jrc
from jax_rope_cache import reference
from jax_rope_cache.models import presets


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="llama-3.1-8b", choices=sorted(presets.MODELS))
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--batch", type=int, default=64)
    a = p.parse_args(argv)
    devices = jax.devices()
    tp = len(devices)
    full = presets.model_shape(a.preset, 1)
    mesh = jax.make_mesh((tp,), ("tp",), devices=devices)
    rng = np.random.default_rng(0)
    qh, kh, d, L, B, S = full.q_heads, full.kv_heads, full.head_dim, a.layers, a.batch, a.steps
    bps = -(-S // 16)
    nb = B * bps + 1
    blocks = rng.permutation(nb)[: B * bps].reshape(B, bps)
    t = np.arange(S)
    slots = (blocks[:, t // 16] * 16 + t % 16).T.astype(np.int32)  # [steps, batch]
    pos = (rng.integers(0, 1024, B)[None, :] + t[:, None]).astype(np.int32)
    ang = np.arange(2048)[:, None] * (1.0 / 500000.0 ** (np.arange(0, d, 2) / d))[None, :]
    cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    bf = jnp.bfloat16
    q = rng.standard_normal((S, B, qh, d), np.float32).astype(bf)
    k = rng.standard_normal((S, B, kh, d), np.float32).astype(bf)
    v = rng.standard_normal((S, B, kh, d), np.float32).astype(bf)
    kc0, vc0 = (np.asarray(c) for c in jrc.make_kv_cache(nb, 16, kh, d, bf, num_layers=L, fill="random"))
    heads = P(None, None, "tp")  # [steps, batch, heads, D]
    cache = P(None, None, None, "tp")  # [L, NB, BS, KH, D]
    print(f"{tp} x {devices[0].device_kind}; {a.preset}: {qh // tp}/{max(1, kh // tp)} heads per device, {L} layers, "
          f"batch {B}, {S} steps, caches {kc0.nbytes * 2 / 2**30:.2f} GiB")

    def per_shard(q, k, v, kc, vc, slots, pos, cos, sin, impl):
        def step(n, carry):
            def layer_fn(carry, i):
                kc, vc, acc = carry
                s = (2.0 ** ((i % 4) - 2)).astype(bf)
                qo, _, kc, vc = jrc.rope_and_cache(q[n] * s, k[n] * s, v[n], kc, vc, slots[n], pos[n], cos, sin,
                                                   impl=impl, layer=i)
                return (kc, vc, acc + jnp.sum(qo, dtype=jnp.float32)), None
            return jax.lax.scan(layer_fn, carry, jnp.arange(L))[0]
        acc = jax.lax.pcast(jnp.float32(0), ("tp",), to="varying")  # per-device partial sums
        return jax.lax.fori_loop(0, S, step, (kc, vc, acc))[:2]

    want_k, want_v = kc0.copy(), vc0.copy()
    for i in range(L):
        s = np.float32(2.0 ** ((i % 4) - 2))
        sc = lambda x: (x.astype(np.float32) * s).astype(bf)  # noqa: E731
        _, _, want_k[i], want_v[i] = reference.rope_and_cache(
            sc(q).reshape(S * B, qh, d), sc(k).reshape(S * B, kh, d), v.reshape(S * B, kh, d), kc0[i], vc0[i],
            slots.reshape(-1), pos.reshape(-1), cos, sin)

    specs = (heads, heads, heads, cache, cache, P(), P(), P(), P())
    args = (q, k, v, kc0, vc0, slots, pos, cos, sin)
    for impl in ("kernel", "xla"):
        fn = jax.jit(jax.shard_map(lambda *x, impl=impl: per_shard(*x, impl), mesh=mesh, in_specs=specs,
                                   out_specs=(cache, cache)), donate_argnums=(3, 4))
        placed = [jax.device_put(x, NamedSharding(mesh, s)) for x, s in zip(args, specs)]
        kc, vc = fn(*placed)
        exact = np.array_equal(np.asarray(kc).view(np.uint16), want_k.view(np.uint16)) and \
            np.array_equal(np.asarray(vc).view(np.uint16), want_v.view(np.uint16))
        close = np.allclose(np.asarray(kc, np.float32), want_k.astype(np.float32), rtol=2**-7, atol=2**-7)
        times = []
        for _ in range(3):
            placed = [jax.device_put(x, NamedSharding(mesh, s)) for x, s in zip(args, specs)]
            jax.block_until_ready(placed)
            t0 = time.perf_counter()
            kc, vc = fn(*placed)
            jax.block_until_ready(kc)
            times.append(time.perf_counter() - t0)
        per_step = float(np.median(times)) / S
        print(f"{impl:<7} caches vs reference: {'bit-exact' if exact else 'close' if close else 'MISMATCH'}; "
              f"{per_step * 1e6:.0f} us/step, {per_step / L * 1e6:.2f} us/op per device")


if __name__ == "__main__":
    main()
