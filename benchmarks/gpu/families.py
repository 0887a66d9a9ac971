#!/usr/bin/env python3
"""The model-family switches of rope_and_cache vs the plain op of the same bytes and vs the XLA path.

    python benchmarks/bench_gpu.py families OUT_DIR [--dry-run] [--tokens 1,8192] [--switches ...]

Switches (each on a shape of its family, models/presets.py, bf16 q/k/v/caches, f32 half tables, flash):
  nope         rotary_dim=0 (a Llama 4 NoPE layer; Llama-4-Scout TP8)
  rope_off     a traced use_rope=0 with the weightless norm and the attention temperature (Llama 4's
               NoPE layer in a scan over layers; Llama-4-Scout TP8)
  rope_after   a traced use_rope=1 with the weightless norm after the rotation (its RoPE layers)
  tail         rotary_position="tail" with R = D / 4 (nope-first heads; Qwen3-Next-80B TP4's shape)
  gemma        norm_type="gemma" with q/k weights (Gemma-3-27B TP4)
  q_gate       rope_and_cache_qkv with gated q rows (Qwen3-Next-80B TP4)
Variants per case: switch (impl="kernel" with the switch), plain (impl="kernel", the same shape
without it: rotary_dim=D, no norm, no gate: the same bytes but for the weights), jnp (impl="xla" with
the switch). Targets (docs/performance.md): switch / plain <= 1.05 at T = 1 and 8192, jnp / switch
>= 1.5 at T = 8192. Timing as the other suites (benchmarks/gpu/timing.py: N calls per jit, device
time from a profiler trace). Writes OUT_DIR/bench_families.json; --dry-run: tiny sizes on the CPU.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # run as a suite or on its own
from qk_norm import TokenSets  # noqa: E402
from timing import add_timing_args, fmt, log, measure, over_budget, start_run, write_log  # noqa: E402

BS = 16
MAX_POS = 8192
SWITCHES = {"nope": "llama-4-scout:8", "rope_off": "llama-4-scout:8", "rope_after": "llama-4-scout:8",
            "tail": "qwen3-next-80b-a3b:4", "gemma": "gemma-3-27b:4", "q_gate": "qwen3-next-80b-a3b:4"}
VARIANTS = ("switch", "plain", "jnp")


def options(switch, d, wq, wk):
    """The rope_and_cache options of a switch (traced values are operands of the chain)."""
    return {"nope": dict(rotary_dim=0),
            "rope_off": dict(norm_type="weightless", attn_temperature=(MAX_POS, 0.1)),
            "rope_after": dict(norm_type="weightless", norm_position="after"),
            "tail": dict(rotary_dim=d // 4, rotary_position="tail"),
            "gemma": dict(norm_type="gemma", q_norm_weight=wq, k_norm_weight=wk),
            "q_gate": {}}[switch]


def make_chain(switch, variant, inp, n_calls):
    import jax
    import jax.numpy as jnp

    import jax_rope_cache as jrc

    qh, kh, d = inp.shape
    impl = "xla" if variant == "jnp" else "kernel"
    on = variant != "plain"

    def one(q, k, v, kc, vc, s, p, cos, sin, wq, wk, rope):
        opts = options(switch, d, wq, wk) if on else {}
        if switch == "tail" and on:
            cos, sin = cos[:, : d // 8], sin[:, : d // 8]
        if on and switch in ("rope_off", "rope_after"):
            opts["use_rope"] = rope
        if switch == "q_gate":
            gate = q if on else None
            qkv = jnp.concatenate(([jnp.stack([q, gate], axis=2).reshape(q.shape[0], 2 * qh, d)] if on else [q])
                                  + [k, v], axis=1)
            return jrc.rope_and_cache_qkv(qkv, kc, vc, s, p, cos, sin, num_q_heads=qh, num_kv_heads=kh,
                                          q_gate=on, impl=impl)
        return jrc.rope_and_cache(q, k, v, kc, vc, s, p, cos, sin, impl=impl, **opts)

    def chain(q, k, v, slots, pos, cos, sin, wq, wk, rope, kc, vc):
        outs = []
        for j in range(n_calls):
            i = j % len(q)
            qo, ko, kc, vc = one(q[i], k[i], v[i], kc, vc, slots[i], pos[i], cos, sin, wq, wk, rope)
            outs += [qo, ko]
        return outs, kc, vc

    return jax.jit(chain, donate_argnums=(10, 11))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out_dir")
    ap.add_argument("--dry-run", action="store_true", help="tiny sizes on the CPU backend")
    ap.add_argument("--tokens", default=None, help="T values (default 1,8192; dry run 1,32)")
    ap.add_argument("--switches", default=",".join(SWITCHES))
    ap.add_argument("--variants", default=",".join(VARIANTS))
    add_timing_args(ap, budget_s=300.0)
    a = ap.parse_args(argv)
    tokens = start_run(a, dry_tokens="1,32", tokens="1,8192")
    import jax
    import jax.numpy as jnp

    import jax_rope_cache as jrc
    from jax_rope_cache.models import presets

    os.makedirs(a.out_dir, exist_ok=True)
    workdir = tempfile.mkdtemp(prefix="families_")
    rows = []
    for switch in a.switches.split(","):
        name, tp = SWITCHES[switch].split(":")
        s = presets.preset_shape(name, int(tp))
        shape = (s.q_heads, s.kv_heads, 32 if a.dry_run else s.head_dim)
        for t in tokens:
            if over_budget(a, f"{switch} T={t}"):
                continue
            inp = TokenSets(shape, t, "flash", "prefill" if t >= 2048 else "random", len(rows) + 1, a.calls, MAX_POS)
            d = shape[2]
            wq = (0.1 * jax.random.normal(inp.keys[4], (d,), jnp.float32)).astype(jnp.bfloat16)
            wk = (0.1 * jax.random.normal(inp.keys[5], (d,), jnp.float32)).astype(jnp.bfloat16)
            rope = jnp.asarray(0 if switch == "rope_off" else 1, jnp.int32)
            caches = [jrc.make_kv_cache(inp.nb, BS, shape[1], d, jnp.bfloat16, fill="random", seed=1)]
            res = {}
            for variant in a.variants.split(","):
                rec = dict(switch=switch, model=f"{name} TP{tp}", shape="/".join(map(str, shape)), T=t,
                           variant=variant, bytes=s.bytes_per_token() * t)
                try:
                    f = make_chain(switch, variant, inp, a.calls)

                    def run():
                        outs, kc, vc = f(inp.q, inp.k, inp.v, inp.slots, inp.pos, inp.cos, inp.sin, wq, wk, rope,
                                         *caches[-1])
                        caches[-1] = (kc, vc)
                        return outs

                    rec.update(measure(run, a, workdir))
                except Exception as e:  # noqa: BLE001 - keep the other variants
                    rec["error"] = f"{type(e).__name__}: {e}"[:300]
                res[variant] = rec
                rows.append(rec)
                log(json.dumps(rec))
            sw, pl, jn = (res.get(v, {}).get("time_us") for v in VARIANTS)
            log(f"{switch:11s} T={t:6d} switch {fmt(sw)} plain {fmt(pl)} jnp {fmt(jn)} us  switch/plain "
                f"{fmt(sw / pl if sw and pl else None, 6)} (<= 1.05)  jnp/switch {fmt(jn / sw if sw and jn else None, 6)}"
                " (>= 1.5 at T = 8192)")
            del inp
    with open(os.path.join(a.out_dir, "bench_families.json"), "w") as fh:
        json.dump(dict(rows=rows, dry_run=a.dry_run, calls=a.calls), fh, indent=1)
    shutil.rmtree(workdir, ignore_errors=True)
    write_log(os.path.join(a.out_dir, "bench_families.log"))
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
