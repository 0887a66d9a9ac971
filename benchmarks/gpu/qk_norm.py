#!/usr/bin/env python3
"""Qwen3 QK-RMSNorm fused into rope_and_cache vs the norm as a separate jnp pass.

    python benchmarks/bench_gpu.py qk_norm OUT_DIR [--dry-run] [--tokens 1,128,8192,32768] ...

Shapes: Qwen3-32B TP8 and Qwen3-235B-A22B TP4 (models/presets.py), bf16 q/k/v/caches/weights,
f32 half tables, NeoX, BS = 16, flash and x-packed caches. Variants per case:
  fused       rope_and_cache(..., q_norm_weight, k_norm_weight, impl="kernel")
  sep_kernel  jnp RMSNorm (Hugging Face Qwen3's: w * (x_f32 * rsqrt(mean(x_f32^2) + eps)).astype(bf16))
              on q and k, then rope_and_cache(impl="kernel")
  sep_xla     the same jnp RMSNorm, then rope_and_cache(impl="xla") (XLA may fuse the two)
  fused_xla   rope_and_cache(..., q_norm_weight, k_norm_weight, impl="xla")
  plain       today's op without the norm, impl="kernel" (the "no slower than +10%" reference)
Timing: N calls unrolled in ONE jit (each on its own input set: with shared sets XLA would compute
the separate variants' RMSNorm once per set and large calls would hit L2; caches donated and carried; q_out/k_out returned). "device" = GPU busy
time per call from a jax.profiler trace of a few executions (sum of the GPU events / calls);
"wall" = median wall time of one execution / N (includes per-execution dispatch). Bytes = the op's
fewest bytes (ModelShape.bytes_per_token, the same for every variant: the norm adds no traffic
when fused); fraction of a device copy measured in the same run. Prints a table last; writes
OUT_DIR/bench_qk_norm.json and .csv. --dry-run: tiny sizes on the CPU backend (wall only).
"""
from __future__ import annotations

import argparse
import csv
import inspect
import json
import os
import shutil
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # run as a suite or on its own
from timing import (add_timing_args, copy_ceiling, fmt, log, measure, over_budget, start_run,  # noqa: E402
                    write_log)

BS = 16
MAX_POS = 40960  # Qwen3 max_position_embeddings
EPS = 1e-6
VARIANTS = ("fused", "sep_kernel", "sep_xla", "fused_xla", "plain")


def rms_norm_hf(x, w, eps=EPS):
    """Hugging Face Qwen3RMSNorm: normalise in float32, round to the input dtype, then the weight
    product in the weight's dtype (bf16 here)."""
    import jax
    import jax.numpy as jnp

    xf = x.astype(jnp.float32)
    var = jnp.mean(xf * xf, axis=-1, keepdims=True)
    return w * (xf * jax.lax.rsqrt(var + eps)).astype(x.dtype)


def has_norm_api():
    import jax_rope_cache as jrc

    return "q_norm_weight" in inspect.signature(jrc.rope_and_cache).parameters


def slot_pattern(pattern, t, num_slots, rng):
    if pattern == "random":
        return rng.permutation(num_slots)[:t].astype(np.int32)
    blocks = rng.permutation(num_slots // BS)  # prefill: consecutive slots filling random blocks
    tok = np.arange(t)
    return (blocks[tok // BS] * BS + tok % BS).astype(np.int32)


class TokenSets:
    """n_sets input sets of T tokens (bf16 q, k, v, slots distinct over the whole chain, positions)
    and f32 half tables of max_pos rows; keys[4:] are left for a suite's own draws."""

    def __init__(self, shape, t, layout, pattern, seed, n_sets, max_pos):
        import jax
        import jax.numpy as jnp

        qh, kh, d = shape
        bf = jnp.bfloat16
        rng = np.random.default_rng(seed)
        self.num_slots = max(2 * t * n_sets, 4096) // BS * BS
        self.nb = self.num_slots // BS
        self.keys = ks = jax.random.split(jax.random.key(seed), 8)
        draw = lambda key, h: [jax.random.normal(k, (t, h, d), jnp.float32).astype(bf)  # noqa: E731
                               for k in jax.random.split(key, n_sets)]
        self.q, self.k, self.v = draw(ks[0], qh), draw(ks[1], kh), draw(ks[2], kh)
        allslots = slot_pattern(pattern, t * n_sets, self.num_slots, rng)
        self.slots = [jnp.asarray(allslots[i * t:(i + 1) * t]) for i in range(n_sets)]
        self.pos = [jnp.asarray(rng.integers(0, max_pos, t).astype(np.int32)) for _ in range(n_sets)]
        ang = jax.random.uniform(ks[3], (max_pos, d // 2), jnp.float32, -3.0, 3.0)
        self.cos, self.sin = jnp.cos(ang), jnp.sin(ang)
        self.shape, self.layout, self.t = shape, layout, t


class Inputs(TokenSets):
    """Input sets, caches, tables and norm weights of one (shape, T, layout), shared by every variant."""

    def __init__(self, shape, t, layout, pattern, seed, n_sets):
        import jax
        import jax.numpy as jnp

        import jax_rope_cache as jrc

        super().__init__(shape, t, layout, pattern, seed, n_sets, MAX_POS)
        _, kh, d = shape
        bf = jnp.bfloat16
        # Qwen3's norm weights sit near 1; random so no product is trivially exact
        self.wq = (1.0 + 0.1 * jax.random.normal(self.keys[4], (d,), jnp.float32)).astype(bf)
        self.wk = (1.0 + 0.1 * jax.random.normal(self.keys[5], (d,), jnp.float32)).astype(bf)
        self.caches = [jrc.make_kv_cache(self.nb, BS, kh, d, bf, layout=layout, fill="random", seed=seed)]


def make_chain(variant, inp, n_calls):
    import jax

    import jax_rope_cache as jrc

    n_sets = len(inp.q)
    layout = inp.layout

    def one(q, k, v, kc, vc, s, p, cos, sin, wq, wk):
        if variant in ("fused", "fused_xla"):
            return jrc.rope_and_cache(q, k, v, kc, vc, s, p, cos, sin, layout=layout,
                                      impl="kernel" if variant == "fused" else "xla",
                                      q_norm_weight=wq, k_norm_weight=wk, norm_eps=EPS)
        if variant in ("sep_kernel", "sep_xla"):
            q, k = rms_norm_hf(q, wq), rms_norm_hf(k, wk)
        return jrc.rope_and_cache(q, k, v, kc, vc, s, p, cos, sin, layout=layout,
                                  impl="xla" if variant == "sep_xla" else "kernel")

    def chain(q, k, v, slots, pos, cos, sin, wq, wk, kc, vc):
        outs = []
        for j in range(n_calls):
            i = j % n_sets
            qo, ko, kc, vc = one(q[i], k[i], v[i], kc, vc, slots[i], pos[i], cos, sin, wq, wk)
            outs += [qo, ko]
        return outs, kc, vc

    return jax.jit(chain, donate_argnums=(9, 10))


def run_variant(variant, inp, a, workdir):
    f = make_chain(variant, inp, a.calls)
    args = (inp.q, inp.k, inp.v, inp.slots, inp.pos, inp.cos, inp.sin, inp.wq, inp.wk)

    def run():  # a variant that fails to compile leaves the caches undonated for the next one
        outs, kc, vc = f(*args, *inp.caches[-1])
        inp.caches[-1] = (kc, vc)
        return outs

    return measure(run, a, workdir)


def check_variants(inp, variants):
    """q_out/k_out of one call per variant vs the fused one (or sep_kernel): max |diff| in f32.
    The separate versions round q and k to bf16 after the norm, as the fused op's contract does."""
    import jax
    import jax.numpy as jnp

    import jax_rope_cache as jrc

    q, k, v, s, p = inp.q[0], inp.k[0], inp.v[0], inp.slots[0], inp.pos[0]
    out, errors = {}, {}
    for variant in variants:
        kc, vc = inp.caches[-1]
        kc, vc = jnp.copy(kc), jnp.copy(vc)
        try:
            if variant in ("fused", "fused_xla"):
                r = jrc.rope_and_cache(q, k, v, kc, vc, s, p, inp.cos, inp.sin, layout=inp.layout,
                                       q_norm_weight=inp.wq, k_norm_weight=inp.wk, norm_eps=EPS,
                                       impl="kernel" if variant == "fused" else "xla")
            elif variant in ("sep_kernel", "sep_xla"):
                r = jrc.rope_and_cache(rms_norm_hf(q, inp.wq), rms_norm_hf(k, inp.wk), v, kc, vc, s, p, inp.cos,
                                       inp.sin, layout=inp.layout, impl="kernel" if variant == "sep_kernel" else "xla")
            else:
                continue
            out[variant] = [np.asarray(jax.device_get(x), np.float32) for x in r[:2]]
        except Exception as e:  # noqa: BLE001 - e.g. a kernel without the norm yet
            errors[variant] = f"{type(e).__name__}: {e}"[:120]
    ref = out.get("fused") or out.get("sep_kernel")
    diff = {v: float(max(np.max(np.abs(a - b)) for a, b in zip(o, ref))) for v, o in out.items()} if ref else {}
    return dict(diff, **{f"{v} error": e for v, e in errors.items()})


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out_dir")
    ap.add_argument("--dry-run", action="store_true", help="tiny sizes on the CPU backend")
    ap.add_argument("--tokens", default=None, help="T values (default 1,128,8192,32768; dry run 1,32)")
    ap.add_argument("--layouts", default="flash,xpacked")
    ap.add_argument("--models", default="qwen3-32b:8,qwen3-235b-a22b:4", help="preset:tp,...")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--slots", default="auto", help="random, prefill, or auto (prefill for T >= 2048)")
    add_timing_args(ap, budget_s=165.0)
    ap.add_argument("--check", action="store_true",
                    help="compare one call's q_out/k_out across the variants per case (on by default in --dry-run)")
    a = ap.parse_args(argv)
    tokens = start_run(a, dry_tokens="1,32", tokens="1,128,8192,32768")
    import jax

    from jax_rope_cache.models import presets

    small = a.dry_run
    models = []
    for m in a.models.split(","):
        name, tp = m.split(":")
        s = presets.model_shape(name, int(tp))
        models.append((f"{name} TP{tp}", s))
    if small:
        models = [(n, presets.ModelShape(s.name, s.q_heads, s.kv_heads, 32, 32)) for n, s in models]
    variants = a.variants.split(",")
    norm_api = has_norm_api()
    if not norm_api:
        log("rope_and_cache has no q_norm_weight here: the fused variants are skipped")
        variants = [v for v in variants if not v.startswith("fused")]
    os.makedirs(a.out_dir, exist_ok=True)
    workdir = tempfile.mkdtemp(prefix="qk_norm_")
    dev = jax.devices()[0]
    ceiling = copy_ceiling((64 << 20) if small else (2 << 30))
    meta = dict(device=getattr(dev, "device_kind", str(dev)), platform=dev.platform, jax=jax.__version__,
                copy_GBps=ceiling / 1e9, calls=a.calls, reps=a.reps, norm_api=norm_api, eps=EPS,
                dry_run=a.dry_run)
    log("bench_qk_norm:", json.dumps(meta))
    rows = []
    for mname, s in models:
        shape = (s.q_heads, s.kv_heads, s.head_dim)
        bpt = s.bytes_per_token()
        for t in tokens:
            pattern = a.slots if a.slots != "auto" else ("prefill" if t >= 2048 else "random")
            # One input set per call: with fewer, XLA computes the separate variants' jnp RMSNorm
            # once per set (CSE across calls on the same q/k), which undercounts the separate pass.
            n_sets = a.calls
            for layout in a.layouts.split(","):
                if over_budget(a, f"{mname} T={t} {layout}"):
                    continue
                try:
                    inp = Inputs(shape, t, layout, pattern, seed=len(rows) + 1, n_sets=n_sets)
                except Exception as e:  # noqa: BLE001
                    log(f"{mname} T={t} {layout}: inputs failed: {type(e).__name__}: {e}")
                    continue
                res = {}
                if a.check or a.dry_run:
                    try:
                        diff = check_variants(inp, variants)
                        log(f"check {mname} T={t} {layout}: max |q_out, k_out - reference variant| = {diff}")
                    except Exception as e:  # noqa: BLE001
                        diff = {"error": f"{type(e).__name__}: {e}"[:200]}
                        log(f"check {mname} T={t} {layout}: {diff['error']}")
                for variant in variants:
                    rec = dict(model=mname, shape="/".join(map(str, shape)), T=t, layout=layout, slots=pattern,
                               variant=variant, bytes=bpt * t, sets=n_sets)
                    try:
                        rec.update(run_variant(variant, inp, a, workdir))
                    except Exception as e:  # noqa: BLE001 - keep the other variants
                        rec["error"] = f"{type(e).__name__}: {e}"[:300]
                    us = rec.get("time_us")
                    if us:
                        rec["GBps"] = rec["bytes"] / (us * 1e-6) / 1e9
                        rec["frac_copy"] = rec["GBps"] * 1e9 / ceiling
                    res[variant] = rec
                    rows.append(rec)
                    log(json.dumps(rec))
                base = res.get("fused", {}).get("time_us")
                for variant, rec in res.items():
                    if base and rec.get("time_us"):
                        rec["vs_fused"] = rec["time_us"] / base  # > 1: fused is faster
                del inp
    with open(os.path.join(a.out_dir, "bench_qk_norm.json"), "w") as fh:
        json.dump(dict(meta=meta, rows=rows), fh, indent=1)
    if rows:
        keys = sorted({k for r in rows for k in r}, key=lambda k: list(rows[0]).index(k) if k in rows[0] else 99)
        with open(os.path.join(a.out_dir, "bench_qk_norm.csv"), "w", newline="") as fh:
            w = csv.DictWriter(fh, fieldnames=keys)
            w.writeheader()
            w.writerows(rows)
    shutil.rmtree(workdir, ignore_errors=True)
    f = fmt

    timing = "device (profiler GPU busy per call)" if any(r.get("device_us") for r in rows) else "wall per call"
    log(f"\ntime = {timing}, us; {a.calls} calls per jit; sep/fused = separate-norm time / fused time "
        f"(target >= 1.5 at T >= 8192); fused/plain <= 1.10 targeted; frac = op bytes / time / copy ceiling "
        f"({ceiling / 1e9:.0f} GB/s)")
    log(f"{'model':24s} {'T':>6s} {'layout':8s} {'slots':8s} {'fused':>9s} {'sep_kern':>9s} {'sep_xla':>9s} "
        f"{'fused_xla':>9s} {'plain':>9s} {'sepK/fu':>7s} {'sepX/fu':>7s} {'fu/plain':>8s} {'frac fu':>7s}")
    by = {}
    for r in rows:
        by.setdefault((r["model"], r["T"], r["layout"], r["slots"]), {})[r["variant"]] = r
    for (m, t, lay, sl), d in by.items():
        tm = {v: d.get(v, {}).get("time_us") for v in VARIANTS}
        fu, pl = tm["fused"], tm["plain"]
        log(f"{m:24s} {t:6d} {lay:8s} {sl:8s} " + " ".join(f(tm[v]) for v in VARIANTS) + " "
            f"{f(tm['sep_kernel'] / fu if fu and tm['sep_kernel'] else None, 7)} "
            f"{f(tm['sep_xla'] / fu if fu and tm['sep_xla'] else None, 7)} "
            f"{f(fu / pl if fu and pl else None, 8)} "
            f"{f(d.get('fused', {}).get('frac_copy'), 7, 3)}"
            + "".join(f"  [{v}: {d[v]['error'][:60]}]" for v in d if d[v].get("error")))
    write_log(os.path.join(a.out_dir, "bench_qk_norm.log"))
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
