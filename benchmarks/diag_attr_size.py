"""Does the size of the `code` attribute set the kernel path's fixed per-execution cost? (diagnostic)

One jitted executable of N unrolled rope_and_cache calls (Llama-3.1-8B shapes, T=8, flash, caches
donated), wall time per execution (median of --reps after 3 warm-ups), for code tables of different
sizes holding the same kernel: cubin only, cubin + PTX (the default), and the default plus an
unused padding entry (a PTX entry for an arch no GPU has, so the launcher never picks it). The XLA
path is measured beside them. If the per-execution time grows with the table size at fixed N, the
attribute is handled per execution (or per call). Each is run twice: the calls reading 16 input
sets (64 input buffers per execution) and all calls reading one set (4 buffers), to separate the
host's per-buffer dispatch cost from the kernels'.

    python benchmarks/diag_attr_size.py [--reps 30] [--pad-kib 256]
"""

import argparse
import itertools
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_rope_cache as jrc
from jax_rope_cache import _ffi, cuda

T, QH, KH, D, BS, NB, SETS = 8, 32, 8, 128, 16, 4096, 16


def inputs(rng):
    bf = jnp.bfloat16
    q = [jnp.asarray(rng.standard_normal((T, QH, D)), bf) for _ in range(SETS)]
    k = [jnp.asarray(rng.standard_normal((T, KH, D)), bf) for _ in range(SETS)]
    sl = [jnp.asarray(rng.permutation(NB * BS)[:T].astype(np.int32)) for _ in range(SETS)]
    ps = [jnp.asarray(rng.integers(0, 4096, T).astype(np.int32)) for _ in range(SETS)]
    ang = rng.uniform(-3, 3, (4096, D // 2))
    return q, k, sl, ps, jnp.asarray(np.cos(ang), jnp.float32), jnp.asarray(np.sin(ang), jnp.float32)


def make(n, impl, cos, sin, sets):
    def chain(q, k, sl, ps, kc, vc):
        outs = []
        for j in range(n):
            i = j % sets
            qo, ko, kc, vc = jrc.rope_and_cache(q[i], k[i], k[i], kc, vc, sl[i], ps[i], cos, sin, impl=impl)
            outs += [qo, ko]
        return outs, kc, vc
    return jax.jit(chain, donate_argnums=(4, 5))


def table_variant(kind, pad_bytes):
    """A build_code_table replacement giving the `kind` table; records the table's size."""
    original = cuda.build_code_table
    sizes = []

    def build(cfg, cc):
        table = original(cfg, cc)
        if kind != "default":
            entries = cuda.unpack_code_table(table)
            if kind == "cubin only":
                entries = [e for e in entries if e[0] == cuda.KIND_CUBIN]
            elif kind == "padded":
                entries.append((cuda.KIND_PTX, "compute_999", b"/" * pad_bytes))
            table = cuda.pack_code_table(entries)
        sizes.append(len(table))
        return table
    return build, sizes


def per_execution(f, args, caches, reps):
    native = _ffi.native_module()
    ts, launches = [], []
    for it in range(reps + 3):
        c0 = native.gpu_launch_count()
        t0 = time.perf_counter()
        outs, caches[0], caches[1] = f(*args, caches[0], caches[1])
        jax.block_until_ready(caches)
        if it >= 3:
            ts.append(time.perf_counter() - t0)
            launches.append(native.gpu_launch_count() - c0)
    return statistics.median(ts), max(launches)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--pad-kib", type=int, default=256)
    p.add_argument("--calls", default="1,16,32")
    a = p.parse_args()
    rng = np.random.default_rng(0)
    q, k, sl, ps, cos, sin = inputs(rng)
    caches = list(jrc.make_kv_cache(NB, BS, KH, D, jnp.bfloat16, fill="random"))
    original = cuda.build_code_table
    print(f"{'inputs':>6} {'variant':>14} {'table KiB':>9} {'N':>3} {'us/exec':>9} {'us/call':>8} "
          f"{'handler launches/exec':>22}")
    for sets, kind, n in itertools.product((SETS, 1), ("cubin only", "default", "padded", "xla path"),
                                           (int(x) for x in a.calls.split(","))):
        sizes = []
        if kind != "xla path":
            cuda.build_code_table, sizes = table_variant(kind, a.pad_kib * 1024)
        try:
            f = make(n, "xla" if kind == "xla path" else "kernel", cos, sin, sets)
            med, launches = per_execution(f, (q[:sets], k[:sets], sl[:sets], ps[:sets]), caches, a.reps)
        finally:
            cuda.build_code_table = original
        kib = f"{sizes[0] / 1024:.1f}" if sizes else "-"
        print(f"{4 * sets:>6} {kind:>14} {kib:>9} {n:>3} {med * 1e6:>9.1f} {med * 1e6 / n:>8.2f} {launches:>22}",
              flush=True)


if __name__ == "__main__":
    main()
