"""Where does the kernel path's per-executable overhead come from? (diagnostic, H200)

For one executable of N unrolled rope_and_cache calls (Llama shapes, T=8, flash) under three
launcher registrations -- graph target (instantiate+initialize+execute, command-buffer trait),
no-graph target, and a graph target without the initialize stage -- prints the wall time per
execution for N=16 and N=32 and how many kernels the handler launched per execution (0 means XLA
replayed a captured graph without calling the handler).
"""

import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from jaxlib import xla_client

import jax_rope_cache as jrc
from jax_rope_cache import _ffi, cuda

native = _ffi.native_module()
NOINIT = "jax_rope_cache_gpu_noinit"
caps = native.gpu_handler()
jax.ffi.register_ffi_target(NOINIT, {"instantiate": caps["instantiate"], "execute": caps["execute"]},
                            platform="CUDA", api_version=1,
                            traits=xla_client.CustomCallTargetTraits.COMMAND_BUFFER_COMPATIBLE)
_ffi._registered.add((NOINIT, "CUDA"))
_ffi._registered.add((NOINIT, "ROCM"))

T, QH, KH, D, BS, NB = 8, 32, 8, 128, 16, 4096
rng = np.random.default_rng(0)
bf = jnp.bfloat16
sets = 16
q = [jnp.asarray(rng.standard_normal((T, QH, D)), bf) for _ in range(sets)]
k = [jnp.asarray(rng.standard_normal((T, KH, D)), bf) for _ in range(sets)]
sl = [jnp.asarray(rng.permutation(NB * BS)[:T].astype(np.int32)) for _ in range(sets)]
ps = [jnp.asarray(rng.integers(0, 4096, T).astype(np.int32)) for _ in range(sets)]
ang = rng.uniform(-3, 3, (4096, D // 2))
cos, sin = jnp.asarray(np.cos(ang), jnp.float32), jnp.asarray(np.sin(ang), jnp.float32)


def make(n):
    def chain(q, k, sl, ps, kc, vc):
        outs = []
        for j in range(n):
            i = j % sets
            qo, ko, kc, vc = jrc.rope_and_cache(q[i], k[i], k[i], kc, vc, sl[i], ps[i], cos, sin, impl="kernel")
            outs += [qo, ko]
        return outs, kc, vc
    return jax.jit(chain, donate_argnums=(4, 5))


def measure(label, n, target, env):
    os.environ["JAX_ROPE_CACHE_COMMAND_BUFFERS"] = env
    old = cuda.GPU_TARGET
    cuda.GPU_TARGET = target
    try:
        f = make(n)
        caches = list(jrc.make_kv_cache(NB, BS, KH, D, bf, fill="random"))
        ts, launches = [], []
        for it in range(12):
            c0 = native.gpu_launch_count()
            t0 = time.perf_counter()
            outs, caches[0], caches[1] = f(q, k, sl, ps, caches[0], caches[1])
            jax.block_until_ready(caches)
            ts.append(time.perf_counter() - t0)
            launches.append(native.gpu_launch_count() - c0)
        med = statistics.median(ts[2:])
        print(f"{label:34s} N={n:2d}: {med * 1e6:8.1f} us/execution, {med * 1e6 / n:6.2f} us/call, "
              f"handler launches per execution (after warm-up): {launches[2:5]}", flush=True)
        return med
    finally:
        cuda.GPU_TARGET = old


# load the no-init target's module outside any capture: a one-call executable
measure("warm-up noinit (1 call)", 1, NOINIT, "1")
for label, target, env in (("graph target (with initialize)", cuda.GPU_TARGET, "1"),
                           ("no-graph target", cuda.GPU_TARGET_NO_GRAPH, "0"),
                           ("graph target, no initialize stage", NOINIT, "1")):
    t16 = measure(label, 16, target, env)
    t32 = measure(label, 32, target, env)
    print(f"    -> fixed {max(0, 2 * t16 - t32) * 1e6:.1f} us, per extra call {(t32 - t16) / 16 * 1e6:.2f} us")
