#!/usr/bin/env python3
"""Per-token fp8 caches vs per-tensor fp8 vs bf16 caches: what dynamic quantization costs the op.

    python benchmarks/bench_gpu.py fp8 OUT_DIR [--dry-run] [--tokens 1,64,8192] ...

Shapes: Llama-3.1-8B (TP1) and Qwen3-235B-A22B TP4 (models/presets.py), bf16 q/k/v, f32 half
tables, NeoX, BS = 16, flash caches (--layouts for others). Variants per case:
  bf16        bf16 caches, impl="kernel"
  fp8_tensor  float8_e4m3fn caches, one static k_scale / v_scale, impl="kernel"
  fp8_token   float8_e4m3fn caches, per-token scales into the scale caches, impl="kernel"
  token_xla   the same per-token call, impl="xla"
A platform whose kernel lacks per-token scales reports fp8_token as an error (impl="kernel" refuses).
Timing as the qk_norm suite: N calls unrolled in one jit on their own input sets, caches (and
scale caches) donated and carried; "device" = profiler GPU busy time per call, else wall / N.
Prints a table with the ratios fp8_token / fp8_tensor and fp8_token / bf16 last; writes
OUT_DIR/bench_fp8.json. --dry-run: tiny sizes on the CPU backend (wall only).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile

from qk_norm import TokenSets
from timing import LOG, add_timing_args, log, measure, over_budget, start_run

BS = 16
MAX_POS = 4096
VARIANTS = ("bf16", "fp8_tensor", "fp8_token", "token_xla")
LOG_NAME = "bench_fp8"


class Inputs(TokenSets):
    """Input sets, tables and the three kinds of caches of one (shape, T, layout)."""

    def __init__(self, shape, t, layout, pattern, seed, n_sets):
        import jax.numpy as jnp

        import jax_rope_cache as jrc

        super().__init__(shape, t, layout, pattern, seed, n_sets, MAX_POS)
        _, kh, d = shape
        nb = self.nb
        self.caches = {"bf16": jrc.make_kv_cache(nb, BS, kh, d, jnp.bfloat16, layout=layout),
                       "fp8": jrc.make_kv_cache(nb, BS, kh, d, jnp.float8_e4m3fn, layout=layout)}
        self.scale_caches = jrc.make_kv_scale_cache(nb, BS, kh)


def make_chain(variant, layout, n_calls, n_sets):
    import jax
    import jax.numpy as jnp

    import jax_rope_cache as jrc

    impl = "xla" if variant == "token_xla" else "kernel"

    def chain(q, k, v, slots, pos, cos, sin, caches):
        outs = []
        for j in range(n_calls):
            i = j % n_sets
            args = (q[i], k[i], v[i], caches[0], caches[1], slots[i], pos[i], cos, sin)
            if variant in ("fp8_token", "token_xla"):
                r = jrc.rope_and_cache(*args, layout=layout, impl=impl, k_scale_cache=caches[2],
                                       v_scale_cache=caches[3])
            elif variant == "fp8_tensor":
                r = jrc.rope_and_cache(*args, layout=layout, impl=impl, k_scale=jnp.float32(0.05),
                                       v_scale=jnp.float32(0.05))
            else:
                r = jrc.rope_and_cache(*args, layout=layout, impl=impl)
            outs += list(r[:2])
            caches = tuple(r[2:])
        return outs, caches

    return jax.jit(chain, donate_argnums=(7,))


def run_variant(variant, inp, a, workdir):
    f = make_chain(variant, inp.layout, a.calls, len(inp.q))
    key = "bf16" if variant == "bf16" else "fp8"
    token = variant in ("fp8_token", "token_xla")
    args = (inp.q, inp.k, inp.v, inp.slots, inp.pos, inp.cos, inp.sin)

    def run():  # carries the donated caches on; a failed compile leaves them for the next variant
        caches = inp.caches[key] + (inp.scale_caches if token else ())
        outs, caches = f(*args, caches)
        inp.caches[key] = caches[:2]
        if token:
            inp.scale_caches = caches[2:]
        return outs

    return measure(run, a, workdir)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out_dir")
    ap.add_argument("--dry-run", action="store_true", help="tiny sizes on the CPU backend")
    ap.add_argument("--tokens", default=None, help="T values (default 1,64,8192; dry run 1,8)")
    ap.add_argument("--layouts", default="flash")
    ap.add_argument("--models", default="llama-3.1-8b:1,qwen3-235b-a22b:4", help="preset:tp,...")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    add_timing_args(ap, budget_s=150.0)
    a = ap.parse_args(argv)
    tokens = start_run(a, dry_tokens="1,8", tokens="1,64,8192")
    import jax

    from jax_rope_cache.models import presets

    models = []
    for m in a.models.split(","):
        name, tp = m.split(":")
        s = presets.model_shape(name, int(tp))
        if a.dry_run:
            s = presets.ModelShape(s.name, s.q_heads, s.kv_heads, 32, 32)
        models.append((f"{name} TP{tp}", (s.q_heads, s.kv_heads, s.head_dim)))
    variants = a.variants.split(",")
    os.makedirs(a.out_dir, exist_ok=True)
    workdir = tempfile.mkdtemp(prefix="fp8_")
    dev = jax.devices()[0]
    meta = dict(device=getattr(dev, "device_kind", str(dev)), platform=dev.platform, jax=jax.__version__,
                calls=a.calls, reps=a.reps, dry_run=a.dry_run)
    log(f"{LOG_NAME}:", json.dumps(meta))
    rows = []
    for mname, shape in models:
        for t in tokens:
            pattern = "prefill" if t >= 2048 else "random"
            for layout in a.layouts.split(","):
                if over_budget(a, f"{mname} T={t} {layout}"):
                    continue
                inp = Inputs(shape, t, layout, pattern, seed=len(rows) + 1, n_sets=a.calls)
                for variant in variants:
                    rec = dict(model=mname, shape="/".join(map(str, shape)), T=t, layout=layout, variant=variant)
                    try:
                        rec.update(run_variant(variant, inp, a, workdir))
                    except Exception as e:  # noqa: BLE001 - keep the other variants
                        rec["error"] = f"{type(e).__name__}: {e}"[:300]
                    rec["time_us"] = rec.get("device_us") or rec.get("wall_us")
                    rows.append(rec)
                    log(json.dumps(rec))
                del inp
    with open(os.path.join(a.out_dir, f"{LOG_NAME}.json"), "w") as fh:
        json.dump(dict(meta=meta, rows=rows), fh, indent=1)
    shutil.rmtree(workdir, ignore_errors=True)

    def f(x, w=10, p=2):
        return f"{x:{w}.{p}f}" if isinstance(x, (int, float)) else f"{'-':>{w}}"

    timing = "device (profiler GPU busy per call)" if any(r.get("device_us") for r in rows) else "wall per call"
    log(f"\ntime = {timing}, us; {a.calls} calls per jit; tok/ten = fp8_token / fp8_tensor, tok/bf16 = "
        "fp8_token / bf16 (> 1: per-token scales cost that factor)")
    log(f"{'model':24s} {'T':>6s} {'layout':8s} " + " ".join(f"{v:>10s}" for v in VARIANTS)
        + f" {'tok/ten':>8s} {'tok/bf16':>8s}")
    by = {}
    for r in rows:
        by.setdefault((r["model"], r["T"], r["layout"]), {})[r["variant"]] = r
    for (m, t, lay), d in by.items():
        tm = {v: d.get(v, {}).get("time_us") for v in VARIANTS}
        tok, ten, bf = tm["fp8_token"], tm["fp8_tensor"], tm["bf16"]
        log(f"{m:24s} {t:6d} {lay:8s} " + " ".join(f(tm[v]) for v in VARIANTS)
            + f" {f(tok / ten if tok and ten else None, 8)} {f(tok / bf if tok and bf else None, 8)}"
            + "".join(f"  [{v}: {d[v]['error'][:80]}]" for v in d if d[v].get("error")))
    with open(os.path.join(a.out_dir, f"{LOG_NAME}.log"), "w") as fh:
        fh.write("\n".join(LOG) + "\n")
    return 0 if all("error" not in r for r in rows) else 1

if __name__ == "__main__":
    sys.exit(main())
