#!/usr/bin/env python3
"""The model-family options of the op, each next to the plain op of the same bytes and the XLA path.

    python benchmarks/bench_gpu.py families OUT_DIR [--dry-run] [--tokens 1,8192] [--cases nope,...]

Each case is one option on a real shape of the family that uses it (per-shard shapes of
models/presets.py FAMILY_PRESETS; bf16 q/k/v/caches, f32 half tables, BS = 16, flash caches):
  nope               Llama 4 Scout TP4 NoPE layer: rotary_dim=0
  nope_temperature   the same with the attention temperature (floor_scale 8192, attn_scale 0.1)
  use_rope           a traced use_rope switch (on) with the temperature: the layer-stacked Llama 4 call
  weightless_after   Llama 4's weightless QK-norm after the rotation
  gemma_norm         Gemma 3 27B TP4: the (1 + w) QK-norm
  rotary_tail        GLM-4.5 TP8 shape, 64 of 128 channels rotated at the tail
  q_gate             Qwen3-Next TP2: fused QKV rows with the output gate (Gemma norm, rotary 64)
Variants per case:
  switch   the option, impl="kernel"
  plain    the same call without the option (same bytes moved), impl="kernel": target switch/plain <= 1.05
  xla      the option, impl="xla" (what a jnp rotate + scatter costs): target xla/switch >= 1.5 at T = 8192
A platform whose kernel lacks an option reports the switch variant as an error (impl="kernel" refuses).
Timing as the qk_norm suite (N calls unrolled in one jit, own input sets, caches donated and carried).
Prints a table last; writes OUT_DIR/bench_families.json. --dry-run: tiny sizes on the CPU backend.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile

from qk_norm import TokenSets
from timing import add_timing_args, fmt, log, over_budget, ratio, save_rows, start_run, timed_row, write_log

BS = 16
MAX_POS = 16384  # two temperature steps of floor_scale 8192
VARIANTS = ("switch", "plain", "xla")
TEMPERATURE = (8192, 0.1)
# case -> (preset, tp, rotary channels (None: all), the option's keyword arguments, the norm weights it needs)
CASES = {
    "nope": ("llama-4-scout", 4, None, dict(rotary_dim=0), None),
    "nope_temperature": ("llama-4-scout", 4, None, dict(rotary_dim=0, attn_temperature=TEMPERATURE), None),
    "use_rope": ("llama-4-scout", 4, None, dict(use_rope="traced", attn_temperature=TEMPERATURE), None),
    "weightless_after": ("llama-4-scout", 4, None, dict(norm_type="weightless", norm_position="after"), None),
    "gemma_norm": ("gemma-3-27b", 4, None, dict(norm_type="gemma"), "gemma"),
    "rotary_tail": ("glm-4.5", 8, 64, dict(rotary_position="tail"), None),
    "q_gate": ("qwen3-next-80b-a3b", 2, 64, dict(q_gate=True, norm_type="gemma"), "gemma"),
}


class Inputs(TokenSets):
    """Input sets, tables, caches and norm weights of one (case, T); q_gate cases also get fused rows."""

    def __init__(self, shape, t, rotary, weights, gated, seed, n_sets):
        import jax
        import jax.numpy as jnp

        import jax_rope_cache as jrc

        super().__init__(shape, t, "flash", "prefill" if t >= 2048 else "random", seed, n_sets, MAX_POS)
        qh, kh, d = shape
        bf = jnp.bfloat16
        if rotary is not None:
            self.cos, self.sin = self.cos[:, :rotary // 2], self.sin[:, :rotary // 2]
        center = 0.0 if weights == "gemma" else 1.0  # Gemma's weights sit near 0: it scales by (1 + w)
        self.wq = (center + 0.1 * jax.random.normal(self.keys[4], (d,), jnp.float32)).astype(bf)
        self.wk = (center + 0.1 * jax.random.normal(self.keys[5], (d,), jnp.float32)).astype(bf)
        self.weights, self.rotary = weights, rotary
        self.caches = jrc.make_kv_cache(self.nb, BS, kh, d, bf, layout="flash")
        if gated:  # rows [T, 2 QH + 2 KH, D]: q head h at 2h, its gate at 2h + 1, then k, then v
            self.qkv = [jnp.concatenate([jnp.stack([q, q * 0.5], axis=2).reshape(t, 2 * qh, d), k, v], axis=1)
                        for q, k, v in zip(self.q, self.k, self.v)]
            self.qkv_plain = [jnp.concatenate([q, k, v], axis=1) for q, k, v in zip(self.q, self.k, self.v)]


def call_options(case, variant, rotary, shape):
    """rope_and_cache(_qkv) keyword arguments of a variant (use_rope's traced switch added by the chain)."""
    opts = dict(CASES[case][3])
    if variant == "plain":
        keep = {"norm_type": opts["norm_type"]} if case == "q_gate" else {}  # q_gate's plain call keeps its norm
        opts = keep
    if rotary is not None:
        opts["rotary_dim"] = rotary
    if case == "q_gate":
        opts.update(num_q_heads=shape[0], num_kv_heads=shape[1])
    opts["impl"] = "xla" if variant == "xla" else "kernel"
    return opts


def make_chain(case, variant, inp, n_calls):
    import jax
    import jax.numpy as jnp

    import jax_rope_cache as jrc

    opts = call_options(case, variant, inp.rotary, inp.shape)
    gated = case == "q_gate"
    n_sets = len(inp.q)

    def chain(q, k, v, qkv, slots, pos, cos, sin, wq, wk, switch, caches):
        kc, vc = caches
        outs = []
        for j in range(n_calls):
            i = j % n_sets
            o = dict(opts)
            if o.get("use_rope") == "traced":
                o["use_rope"] = switch
            if inp.weights and (variant != "plain" or gated):
                o.update(q_norm_weight=wq, k_norm_weight=wk)
            if gated:
                r = jrc.rope_and_cache_qkv(qkv[i], kc, vc, slots[i], pos[i], cos, sin, **o)
            else:
                r = jrc.rope_and_cache(q[i], k[i], v[i], kc, vc, slots[i], pos[i], cos, sin, **o)
            outs += list(r[:2])
            kc, vc = r[2], r[3]
        return outs, (kc, vc)

    f = jax.jit(chain, donate_argnums=(11,))
    qkv = (inp.qkv if variant != "plain" else inp.qkv_plain) if gated else ()
    args = (inp.q, inp.k, inp.v, qkv, inp.slots, inp.pos, inp.cos, inp.sin, inp.wq, inp.wk, jnp.int32(1))

    def run():  # carries the donated caches on; a failed compile leaves them for the next variant
        outs, inp.caches = f(*args, inp.caches)
        return outs

    return run


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out_dir")
    ap.add_argument("--dry-run", action="store_true", help="tiny sizes on the CPU backend")
    ap.add_argument("--tokens", default=None, help="T values (default 1,8192; dry run 1,8)")
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--variants", default=",".join(VARIANTS))
    add_timing_args(ap, budget_s=200.0)
    a = ap.parse_args(argv)
    tokens = start_run(a, dry_tokens="1,8", tokens="1,8192")
    import jax

    from jax_rope_cache.models import presets

    os.makedirs(a.out_dir, exist_ok=True)
    workdir = tempfile.mkdtemp(prefix="families_")
    dev = jax.devices()[0]
    meta = dict(device=getattr(dev, "device_kind", str(dev)), platform=dev.platform, jax=jax.__version__,
                calls=a.calls, reps=a.reps, dry_run=a.dry_run)
    log("bench_families:", json.dumps(meta))
    rows = []
    for case in a.cases.split(","):
        if case not in CASES:
            raise SystemExit(f"--cases: expected names from {', '.join(CASES)}, got {case!r}")
        preset, tp, rotary, _, weights = CASES[case]
        s = presets.shard_shape(presets.preset_config(preset), tp, name=preset)
        shape = (s.q_heads, s.kv_heads, 32 if a.dry_run else s.head_dim)
        if a.dry_run and rotary is not None:
            rotary = 16
        for t in tokens:
            if over_budget(a, f"{case} T={t}"):
                continue
            inp = Inputs(shape, t, rotary, weights, case == "q_gate", seed=len(rows) + 1, n_sets=a.calls)
            for variant in a.variants.split(","):
                rec = dict(case=case, model=f"{preset} TP{tp}", shape="/".join(map(str, shape)), T=t, variant=variant)
                timed_row(rec, lambda: make_chain(case, variant, inp, a.calls), a, workdir, rows)  # noqa: B023
            del inp
    timing = save_rows(a, "bench_families", meta, rows)
    shutil.rmtree(workdir, ignore_errors=True)

    log(f"\ntime = {timing}, us; {a.calls} calls per jit; sw/plain = switch / plain (target <= 1.05); "
        "xla/sw = xla / switch (target >= 1.5 at T = 8192)")
    log(f"{'case':18s} {'model':26s} {'T':>6s} " + " ".join(f"{v:>9s}" for v in VARIANTS)
        + f" {'sw/plain':>8s} {'xla/sw':>7s}")
    by = {}
    for r in rows:
        by.setdefault((r["case"], r["model"], r["T"]), {})[r["variant"]] = r
    for (case, m, t), d in by.items():
        tm = {v: d.get(v, {}).get("time_us") for v in VARIANTS}
        log(f"{case:18s} {m:26s} {t:6d} " + " ".join(fmt(tm[v]) for v in VARIANTS)
            + f" {fmt(ratio(tm['switch'], tm['plain']), 8)} {fmt(ratio(tm['xla'], tm['switch']), 7)}"
            + "".join(f"  [{v}: {d[v]['error'][:80]}]" for v in d if d[v].get("error")))
    write_log(os.path.join(a.out_dir, "bench_families.log"))
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
