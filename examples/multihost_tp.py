"""Tensor parallelism across processes: the recipe for serving past one machine.

Every process runs this same program (one process per host; here several on one host). JAX's own
multi-process runtime (`jax.distributed.initialize`) joins them into one set of global devices; a
mesh over all of them splits the heads, so each device holds its KV heads' slice of both caches
and `rope_and_cache` runs on each shard inside `shard_map`, in place, with no communication.

    # two processes on this machine, two CPU devices each (4 shards):
    python examples/multihost_tp.py --coordinator localhost:9876 --num-processes 2 --process-id 0 &
    python examples/multihost_tp.py --coordinator localhost:9876 --num-processes 2 --process-id 1

On GPU hosts drop --cpu-devices: each process sees its own GPUs. Each process checks its own shards
of the result against the numpy reference and prints one line.
"""

from __future__ import annotations

import argparse
import os
import sys


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--coordinator", required=True, help="host:port of process 0")
    p.add_argument("--num-processes", type=int, required=True)
    p.add_argument("--process-id", type=int, required=True)
    p.add_argument("--cpu-devices", type=int, default=2, help="CPU devices per process (0: use the GPUs)")
    p.add_argument("--impl", default="kernel", choices=("kernel", "xla"))
    a = p.parse_args(argv)
    if a.cpu_devices:  # before jax starts its CPU backend
        os.environ["JAX_PLATFORMS"] = "cpu"
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                                   + f" --xla_force_host_platform_device_count={a.cpu_devices}")

    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jax_rope_cache as jrc
    from jax_rope_cache import reference

    jax.distributed.initialize(a.coordinator, a.num_processes, a.process_id)
    tp = jax.device_count()  # every process's devices
    mesh = jax.make_mesh((tp,), ("tp",))

    # The same problem in every process (same seed); each process places only its own shards.
    T, QH, KH, D, NB, BS = 24, 4 * tp, tp, 64, 16, 16
    rng = np.random.default_rng(0)
    q = rng.standard_normal((T, QH, D)).astype(np.float32)
    k = rng.standard_normal((T, KH, D)).astype(np.float32)
    v = rng.standard_normal((T, KH, D)).astype(np.float32)
    key_cache = rng.standard_normal((NB, BS, KH, D)).astype(np.float32)  # flash: [NB, BS, KH, D]
    value_cache = rng.standard_normal((NB, BS, KH, D)).astype(np.float32)
    slots = rng.permutation(NB * BS)[:T].astype(np.int32)
    positions = rng.integers(0, 512, T).astype(np.int32)
    cos, sin = (np.asarray(t) for t in jrc.rope_tables(512, D, base=10000.0))

    heads, cache = P(None, "tp"), P(None, None, "tp")
    specs = (heads, heads, heads, cache, cache, P(), P(), P(), P())
    host = (q, k, v, key_cache, value_cache, slots, positions, cos, sin)

    def place(x, spec):
        sharding = NamedSharding(mesh, spec)
        return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])

    step = jax.jit(jax.shard_map(lambda *x: jrc.rope_and_cache(*x, impl=a.impl), mesh=mesh, in_specs=specs,
                                 out_specs=(heads, heads, cache, cache)),
                   donate_argnums=(3, 4))
    args = [place(x, s) for x, s in zip(host, specs)]
    q_out, k_out, kc, vc = step(*args)
    # A second step writes more tokens into the same (donated) caches.
    q2 = rng.standard_normal((T, QH, D)).astype(np.float32)
    k2 = rng.standard_normal((T, KH, D)).astype(np.float32)
    v2 = rng.standard_normal((T, KH, D)).astype(np.float32)
    slots2 = rng.permutation(np.setdiff1d(np.arange(NB * BS), slots))[:T].astype(np.int32)
    host2 = (q2, k2, v2, None, None, slots2, positions + 1, cos, sin)
    args2 = [place(x, s) for x, s in zip(host2, specs) if x is not None]
    q_out, k_out, kc, vc = step(*args2[:3], kc, vc, *args2[3:])

    _, _, want_kc, want_vc = reference.rope_and_cache(*host)
    want = reference.rope_and_cache(q2, k2, v2, want_kc, want_vc, slots2, positions + 1, cos, sin)
    # The kernel is bit-exact; the XLA path may fuse a multiply-add (a few float32 ulps).
    same = np.array_equal if a.impl == "kernel" else lambda x, y: np.allclose(x, y, rtol=1e-5, atol=1e-6)
    shards = 0
    for got, ref in zip((q_out, k_out, kc, vc), want):
        for s in got.addressable_shards:
            if not same(np.asarray(s.data), np.asarray(ref)[s.index]):
                print(f"process {a.process_id}: shard {s.index} of device {s.device} differs from the reference")
                return 1
            shards += 1
    print(f"process {a.process_id}/{a.num_processes}: {len(jax.local_devices())} of {tp} devices, "
          f"{shards} shards equal to the reference ({a.impl})")
    jax.distributed.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
