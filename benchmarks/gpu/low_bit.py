#!/usr/bin/env python3
"""Low-bit KV caches (int8, int4 per token-head; NVFP4, MXFP4 blocks) vs bf16 and per-token fp8 caches.

    python benchmarks/bench_gpu.py low_bit OUT_DIR [--dry-run] [--tokens 1,64,8192,32768] ...

Shapes: Llama-3.1-8B (TP1) and Qwen3-235B-A22B TP4 (models/presets.py), bf16 q/k/v, f32 half
tables, NeoX, BS = 16, flash caches (--layouts for others). Variants (FORMATS) per case, each
impl="kernel" unless named _xla:
  bf16       bf16 caches
  fp8_token  float8_e4m3fn caches with per-token scales (the target's reference)
  int8       int8 caches, per-token scales;  int8_xla: the same call on the XLA path
  int4       int4 caches (uint8 bytes, D/2 per row), per-token scales;  int4_xla: on the XLA path
  nvfp4      NVFP4 caches (uint8 E2M1 pairs), E4M3 block scales per 16 values, global scales 1.0;  nvfp4_xla
  mxfp4      MXFP4 caches (uint8 E2M1 pairs), E8M0 block scales per 32 values;  mxfp4_xla
A platform whose kernel lacks a format reports that variant as an error (impl="kernel" refuses).
Target: at T = 8192 each format no slower than 1.15x fp8_token. Bytes = the fewest bytes a token
moves with that format (q/k/v in, q_out/k_out out, the table row, indices, the K and V rows at the
format's width and their scales), reported as a fraction of the copy ceiling measured in the run.
Timing as the qk_norm suite. Prints a table last; writes OUT_DIR/bench_low_bit.json.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile

from qk_norm import TokenSets
from timing import (add_timing_args, copy_ceiling, fmt, log, over_budget, ratio, save_rows, start_run, timed_row,
                    write_log)

BS = 16
MAX_POS = 4096
# variant -> (cache dtype name, value bits, scale caches (None, "token" or a block format), impl)
FORMATS = {
    "bf16": ("bfloat16", 16, None, "kernel"),
    "fp8_token": ("float8_e4m3fn", 8, "token", "kernel"),
    "int8": ("int8", 8, "token", "kernel"),
    "int8_xla": ("int8", 8, "token", "xla"),
    "int4": ("uint8", 4, "token", "kernel"),
    "int4_xla": ("uint8", 4, "token", "xla"),
    "nvfp4": ("uint8", 4, "nvfp4", "kernel"),
    "nvfp4_xla": ("uint8", 4, "nvfp4", "xla"),
    "mxfp4": ("uint8", 4, "mxfp4", "kernel"),
    "mxfp4_xla": ("uint8", 4, "mxfp4", "xla"),
}


def format_bytes(shape, variant) -> float:
    """The fewest bytes one token moves with a variant's cache format."""
    from jax_rope_cache import contract
    from jax_rope_cache.models import presets

    qh, kh, d = shape
    _, bits, scales, _ = FORMATS[variant]
    base = presets.ModelShape("s", qh, kh, d, d).bytes_per_token(cache_size=0)
    per_row = 0 if scales is None else 4 if scales == "token" else d // contract.BLOCK_GROUP[scales]  # scale bytes
    return base + 2 * kh * (d * bits / 8 + per_row)


class Inputs(TokenSets):
    """Input sets, tables and the caches of every format of one (shape, T, layout)."""

    def __init__(self, shape, t, layout, pattern, seed, n_sets, variants):
        import jax.numpy as jnp

        import jax_rope_cache as jrc

        super().__init__(shape, t, layout, pattern, seed, n_sets, MAX_POS)
        _, kh, d = shape
        self.caches = {}
        for v in variants:
            dtype, _, scales, _ = FORMATS[v]
            if dtype not in self.caches:
                self.caches[dtype] = jrc.make_kv_cache(self.nb, BS, kh, d, jnp.dtype(dtype), layout=layout)
            if scales and scales not in self.caches:
                block = {} if scales == "token" else dict(kv_format=scales, head_dim=d)
                self.caches[scales] = jrc.make_kv_scale_cache(self.nb, BS, kh, layout=layout, **block)


def make_run(variant, inp, n_calls):
    import jax

    import jax_rope_cache as jrc

    dtype, _, scales, impl = FORMATS[variant]
    n_sets = len(inp.q)

    def chain(q, k, v, slots, pos, cos, sin, caches):
        outs = []
        for j in range(n_calls):
            i = j % n_sets
            extra = dict(k_scale_cache=caches[2], v_scale_cache=caches[3]) if scales else {}
            if scales == "nvfp4":  # the per-tensor global decode scales
                extra.update(k_scale=1.0, v_scale=1.0)
            r = jrc.rope_and_cache(q[i], k[i], v[i], caches[0], caches[1], slots[i], pos[i], cos, sin,
                                   layout=inp.layout, impl=impl, **extra)
            outs += list(r[:2])
            caches = tuple(r[2:])
        return outs, caches

    f = jax.jit(chain, donate_argnums=(7,))
    args = (inp.q, inp.k, inp.v, inp.slots, inp.pos, inp.cos, inp.sin)

    def run():  # carries the donated caches on; a failed compile leaves them for the next variant
        caches = inp.caches[dtype] + (inp.caches[scales] if scales else ())
        outs, caches = f(*args, caches)
        inp.caches[dtype] = caches[:2]
        if scales:
            inp.caches[scales] = caches[2:]
        return outs

    return run


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out_dir")
    ap.add_argument("--dry-run", action="store_true", help="tiny sizes on the CPU backend")
    ap.add_argument("--tokens", default=None, help="T values (default 1,64,8192,32768; dry run 1,8)")
    ap.add_argument("--layouts", default="flash")
    ap.add_argument("--models", default="llama-3.1-8b:1,qwen3-235b-a22b:4", help="preset:tp,...")
    ap.add_argument("--variants", default=",".join(FORMATS))
    add_timing_args(ap, budget_s=300.0)
    a = ap.parse_args(argv)
    tokens = start_run(a, dry_tokens="1,8", tokens="1,64,8192,32768")
    import jax

    from jax_rope_cache.models import presets

    variants = a.variants.split(",")
    unknown = [v for v in variants if v not in FORMATS]
    if unknown:
        raise SystemExit(f"--variants: expected names from {', '.join(FORMATS)}, got {unknown}")
    models = []
    for m in a.models.split(","):
        name, tp = m.split(":")
        s = presets.model_shape(name, int(tp))
        models.append((f"{name} TP{tp}", (s.q_heads, s.kv_heads, 32 if a.dry_run else s.head_dim)))
    os.makedirs(a.out_dir, exist_ok=True)
    workdir = tempfile.mkdtemp(prefix="low_bit_")
    dev = jax.devices()[0]
    ceiling = copy_ceiling((64 << 20) if a.dry_run else (2 << 30))
    meta = dict(device=getattr(dev, "device_kind", str(dev)), platform=dev.platform, jax=jax.__version__,
                copy_GBps=ceiling / 1e9, calls=a.calls, reps=a.reps, dry_run=a.dry_run)
    log("bench_low_bit:", json.dumps(meta))
    rows = []
    for mname, shape in models:
        for t in tokens:
            pattern = "prefill" if t >= 2048 else "random"
            for layout in a.layouts.split(","):
                if over_budget(a, f"{mname} T={t} {layout}"):
                    continue
                inp = Inputs(shape, t, layout, pattern, seed=len(rows) + 1, n_sets=a.calls, variants=variants)
                for variant in variants:
                    rec = dict(model=mname, shape="/".join(map(str, shape)), T=t, layout=layout, variant=variant,
                               bytes=format_bytes(shape, variant) * t)
                    timed_row(rec, lambda: make_run(variant, inp, a.calls), a, workdir, rows)  # noqa: B023
                    if rec.get("time_us"):
                        rec["frac_copy"] = rec["bytes"] / (rec["time_us"] * 1e-6) / ceiling
                del inp
    timing = save_rows(a, "bench_low_bit", meta, rows)
    shutil.rmtree(workdir, ignore_errors=True)

    log(f"\ntime = {timing}, us; {a.calls} calls per jit; /fp8 = time / fp8_token time (target <= 1.15 at "
        f"T = 8192); frac = the format's bytes / time / copy ceiling ({ceiling / 1e9:.0f} GB/s)")
    log(f"{'model':24s} {'T':>6s} {'layout':8s} {'variant':10s} {'time':>9s} {'/fp8':>6s} {'/bf16':>6s} {'frac':>6s}")
    by = {}
    for r in rows:
        by.setdefault((r["model"], r["T"], r["layout"]), {})[r["variant"]] = r
    for (m, t, lay), d in by.items():
        fp8, bf = d.get("fp8_token", {}).get("time_us"), d.get("bf16", {}).get("time_us")
        for v, r in d.items():
            us = r.get("time_us")
            log(f"{m:24s} {t:6d} {lay:8s} {v:10s} {fmt(us)} {fmt(ratio(us, fp8), 6)} {fmt(ratio(us, bf), 6)} "
                f"{fmt(r.get('frac_copy'), 6, 3)}" + (f"  [{r['error'][:80]}]" if r.get("error") else ""))
    write_log(os.path.join(a.out_dir, "bench_low_bit.log"))
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
