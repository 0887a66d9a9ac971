"""Small calls (T <= 128): one jitted call per configuration, to be run under Nsight Compute for
the kernel's own device time (no launch or dispatch cost):

    ncu --clock-control none -k regex:rope_cache --metrics gpu__time_duration.sum \
        python benchmarks/diagnostics/kernel_time_small.py

Llama-3.1-8B (32/8/128) and GPT-OSS-120B at TP8 (8/1/64), flash and x-packed, bf16, random unique
slots in a 4096-block cache, random positions in a 131072-row table. Each configuration runs
twice; the second launch is the warm one (ncu flushes caches before each launch by default).
"""

import jax
import jax.numpy as jnp
import numpy as np

import jax_rope_cache as jrc

rng = np.random.default_rng(0)
NB, BS, MAXPOS = 4096, 16, 131072
for name, qh, kh, d in (("llama-3.1-8b", 32, 8, 128), ("gpt-oss-120b-tp8", 8, 1, 64)):
    ang = rng.uniform(-3, 3, (MAXPOS, d // 2))
    cos, sin = jnp.asarray(np.cos(ang), jnp.float32), jnp.asarray(np.sin(ang), jnp.float32)
    for layout in ("flash", "xpacked"):
        kc, vc = jrc.make_kv_cache(NB, BS, kh, d, jnp.bfloat16, layout=layout, fill="random")
        for t in (1, 8, 64, 128):
            q = jnp.asarray(rng.standard_normal((t, qh, d)), jnp.bfloat16)
            k = jnp.asarray(rng.standard_normal((t, kh, d)), jnp.bfloat16)
            slots = jnp.asarray(rng.permutation(NB * BS)[:t].astype(np.int32))
            pos = jnp.asarray(rng.integers(0, MAXPOS, t).astype(np.int32))
            f = jax.jit(lambda q, k, kc, vc, s, p: jrc.rope_and_cache(q, k, k, kc, vc, s, p, cos, sin,
                                                                      layout=layout, impl="kernel"),
                        donate_argnums=(2, 3))
            for _ in range(2):
                _, _, kc, vc = f(q, k, kc, vc, slots, pos)
                jax.block_until_ready(vc)
            print(f"done {name} {layout} T={t}", flush=True)
