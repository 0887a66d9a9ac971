#!/usr/bin/env python3
"""Multimodal RoPE (Qwen3-VL) fused with the QK-norm and the cache write vs its jnp and 1-D alternatives.

    python benchmarks/bench_gpu.py mrope OUT_DIR [--dry-run] [--tokens 1,8192] [--models qwen3-vl-8b:1,...]

Shapes: Qwen3-VL-8B TP1 (32/8/128) and Qwen3-VL-235B-A22B TP4 (16/1/128) (models/presets.py), bf16
q/k/v/caches/weights, f32 half tables, NeoX, BS = 16, interleaved sections (24, 20, 20), positions
[3, T] of text runs and image grids (about half the tokens image patches). Variants per case:
  fused  rope_and_cache(..., positions [3, T], mrope_section, mrope_interleaved=True, q/k norm
         weights, impl="kernel"): one kernel
  jnp    the same call with impl="xla": M-RoPE row selection, RMSNorm, rotation and the cache
         scatter in jax.numpy (XLA fuses what it can)
  front  jnp M-RoPE in front of the 1-D op: each token's cos/sin row assembled in jnp (three
         gathers and a per-frequency select, [T, R/2]), then the 1-D fused op (norm included) on
         that per-token table with positions arange(T)
  plain  the 1-D op (positions [T], the norm fused), impl="kernel": the M-RoPE op's yardstick
Timing (benchmarks/gpu/timing.py): N calls unrolled in one jit, each on its own input set, caches
donated and carried; "device" = GPU busy time per call from a jax.profiler trace, else "wall" =
median wall time / N. Every case first checks one call of each variant on its first 64 tokens
against the numpy reference (fused and front must match bit for bit, else the exit code is 1).
Prints a table last (jnp/fused: target >= 1.5 at T = 8192; fused/plain: target <= 1.10 at every
T); writes OUT_DIR/bench_mrope.json and .log. --budget-s (150) bounds the run: about 100 s on an
H200 by estimate. --dry-run: tiny shapes on the CPU backend (wall time, the same checks).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from qk_norm import slot_pattern  # noqa: E402
from timing import (add_timing_args, copy_ceiling, fmt, log, measure, over_budget, ratio,  # noqa: E402
                    start_run, write_log)

BS = 16
EPS = 1e-6
VARIANTS = ("fused", "jnp", "front", "plain")


def vl_positions(t: int, max_pos: int, rng) -> np.ndarray:
    """[3, T] positions of a prompt of text runs and image grids (about half the tokens patches)."""
    pos = np.zeros((3, t), np.int64)
    base, i = int(rng.integers(0, max(1, max_pos // 4))), 0
    while i < t:
        n = int(min(t - i, rng.integers(8, 64)))
        if rng.random() < 0.5:
            pos[:, i:i + n] = base + np.arange(n)
            base += n
        else:
            gw = 8
            j = np.arange(n)
            pos[0, i:i + n], pos[1, i:i + n], pos[2, i:i + n] = base, base + j // gw, base + j % gw
            base += 1 + max(j // gw) if n else 0
        i += n
    return np.minimum(pos, max_pos - 1).astype(np.int32)


class Inputs:
    def __init__(self, shape, t, layout, section, seed, n_sets, max_pos):
        import jax
        import jax.numpy as jnp

        import jax_rope_cache as jrc

        qh, kh, d = shape
        bf = jnp.bfloat16
        rng = np.random.default_rng(seed)
        self.num_slots = max(2 * t * n_sets, 4096) // BS * BS
        ks = jax.random.split(jax.random.key(seed), 8)
        self.q = [jax.random.normal(k, (t, qh, d), jnp.float32).astype(bf) for k in jax.random.split(ks[0], n_sets)]
        self.k = [jax.random.normal(k, (t, kh, d), jnp.float32).astype(bf) for k in jax.random.split(ks[1], n_sets)]
        self.v = [jax.random.normal(k, (t, kh, d), jnp.float32).astype(bf) for k in jax.random.split(ks[2], n_sets)]
        allslots = slot_pattern("prefill" if t >= 2048 else "random", t * n_sets, self.num_slots, rng)
        self.slots = [jnp.asarray(allslots[i * t:(i + 1) * t]) for i in range(n_sets)]
        self.pos3 = [jnp.asarray(vl_positions(t, max_pos, rng)) for _ in range(n_sets)]
        self.ar = jnp.arange(t, dtype=jnp.int32)
        ang = jax.random.uniform(ks[3], (max_pos, d // 2), jnp.float32, -3.0, 3.0)
        self.cos, self.sin = jnp.cos(ang), jnp.sin(ang)
        self.wq = (1.0 + 0.1 * jax.random.normal(ks[4], (d,), jnp.float32)).astype(bf)
        self.wk = (1.0 + 0.1 * jax.random.normal(ks[5], (d,), jnp.float32)).astype(bf)
        self.shape, self.layout, self.t, self.section = shape, layout, t, section
        self.caches = [jrc.make_kv_cache(self.num_slots // BS, BS, kh, d, bf, layout=layout, fill="random", seed=seed)]


def mrope_rows(cos, sin, pos3, section, interleaved=True):
    """jnp M-RoPE front: per-token cos/sin rows [T, R/2], each frequency from its stream's row."""
    import jax.numpy as jnp

    from jax_rope_cache import contract

    streams = jnp.asarray(contract.mrope_stream(np.arange(cos.shape[1]), section, interleaved))
    rows = []
    for tab in (cos, sin):
        g = tab[pos3]  # [3, T, W]
        rows.append(jnp.where(streams == 0, g[0], jnp.where(streams == 1, g[1], g[2])))
    return rows


def make_chain(variant, inp, n_calls):
    import jax

    import jax_rope_cache as jrc

    n_sets, layout, section = len(inp.q), inp.layout, inp.section
    norm = dict(q_norm_weight=inp.wq, k_norm_weight=inp.wk, norm_eps=EPS)

    def one(q, k, v, kc, vc, s, p3, ar, cos, sin):
        if variant in ("fused", "jnp"):
            return jrc.rope_and_cache(q, k, v, kc, vc, s, p3, cos, sin, layout=layout, mrope_section=section,
                                      mrope_interleaved=True, impl="kernel" if variant == "fused" else "xla", **norm)
        if variant == "front":
            c, sn = mrope_rows(cos, sin, p3, section)
            return jrc.rope_and_cache(q, k, v, kc, vc, s, ar, c, sn, layout=layout, impl="kernel", **norm)
        return jrc.rope_and_cache(q, k, v, kc, vc, s, p3[0], cos, sin, layout=layout, impl="kernel", **norm)

    def chain(q, k, v, slots, pos3, ar, cos, sin, kc, vc):
        outs = []
        for j in range(n_calls):
            i = j % n_sets
            qo, ko, kc, vc = one(q[i], k[i], v[i], kc, vc, slots[i], pos3[i], ar, cos, sin)
            outs += [qo, ko]
        return outs, kc, vc

    return jax.jit(chain, donate_argnums=(8, 9))


def run_variant(variant, inp, a, workdir):
    f = make_chain(variant, inp, a.calls)
    args = (inp.q, inp.k, inp.v, inp.slots, inp.pos3, inp.ar, inp.cos, inp.sin)

    def run():
        outs, kc, vc = f(*args, *inp.caches[-1])
        inp.caches[-1] = (kc, vc)
        return outs

    return measure(run, a, workdir)


def check_variants(inp, m=64):
    """One call of each M-RoPE variant on the first m tokens of input set 0 and a small fresh cache,
    against the numpy reference: "exact" when q_out, k_out and both caches match bit for bit, else
    the largest |difference| (the kernels must be exact; the jnp version may round differently)."""
    import jax
    import jax.numpy as jnp

    import jax_rope_cache as jrc
    from jax_rope_cache import reference

    m = min(m, inp.t)
    qh, kh, d = inp.shape
    q, k, v, p3 = inp.q[0][:m], inp.k[0][:m], inp.v[0][:m], inp.pos3[0][:, :m]
    s = jnp.asarray(np.random.default_rng(m).permutation(64 * BS)[:m].astype(np.int32))
    kc, vc = jrc.make_kv_cache(64, BS, kh, d, jnp.bfloat16, layout=inp.layout, fill="random", seed=m)
    norm = dict(q_norm_weight=inp.wq, k_norm_weight=inp.wk, norm_eps=EPS)
    host = [np.asarray(jax.device_get(x)) for x in (q, k, v, kc, vc, s, p3, inp.cos, inp.sin, inp.wq, inp.wk)]
    want = reference.rope_and_cache(*host[:9], layout=inp.layout, mrope_section=inp.section, mrope_interleaved=True,
                                    q_norm_weight=host[9], k_norm_weight=host[10], norm_eps=EPS)
    out = {}
    for variant in ("fused", "jnp", "front"):
        if variant == "front":
            c, sn = mrope_rows(inp.cos, inp.sin, p3, inp.section)
            r = jrc.rope_and_cache(q, k, v, kc, vc, s, inp.ar[:m], c, sn, layout=inp.layout, impl="kernel", **norm)
        else:
            r = jrc.rope_and_cache(q, k, v, kc, vc, s, p3, inp.cos, inp.sin, layout=inp.layout,
                                   mrope_section=inp.section, mrope_interleaved=True,
                                   impl="kernel" if variant == "fused" else "xla", **norm)
        got = [np.asarray(jax.device_get(x)) for x in r]
        if all(np.array_equal(g.view(np.uint8), w.view(np.uint8)) for g, w in zip(got, want)):
            out[variant] = "exact"
        else:
            out[variant] = max(float(np.max(np.abs(g.astype(np.float32) - w.astype(np.float32))))
                               for g, w in zip(got, want))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out_dir")
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU backend")
    ap.add_argument("--tokens", default=None, help="T values (default 1,8192; dry run 1,64)")
    ap.add_argument("--layouts", default="flash,xpacked")
    ap.add_argument("--models", default="qwen3-vl-8b:1,qwen3-vl-235b-a22b:4", help="preset:tp,...")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--mrow-xp-block", default=None,
                    help="THREADSxTOKENS or none: the CUDA kernel's x-packed merged-row blocks of one kv head "
                         "(backends.cuda.MROW_XP_BLOCK) for this run, to compare block shapes")
    add_timing_args(ap, budget_s=150.0)
    a = ap.parse_args(argv)
    tokens = start_run(a, dry_tokens="1,64", tokens="1,8192")
    import jax

    if a.mrow_xp_block:
        from jax_rope_cache.backends import cuda

        cuda.MROW_XP_BLOCK = None if a.mrow_xp_block == "none" else tuple(map(int, a.mrow_xp_block.split("x")))
        log("MROW_XP_BLOCK", cuda.MROW_XP_BLOCK)

    from jax_rope_cache.models import config, presets

    small = a.dry_run
    variants = a.variants.split(",")
    os.makedirs(a.out_dir, exist_ok=True)
    workdir = tempfile.mkdtemp(prefix="mrope_")
    dev = jax.devices()[0]
    ceiling = copy_ceiling((64 << 20) if small else (2 << 30))
    meta = dict(device=getattr(dev, "device_kind", str(dev)), platform=dev.platform, jax=jax.__version__,
                copy_GBps=ceiling / 1e9, calls=a.calls, reps=a.reps, dry_run=a.dry_run)
    log("bench_mrope:", json.dumps(meta))
    rows, checks = [], {}
    for m in a.models.split(","):
        name, tp = m.split(":")
        cfg = presets.preset_config(name)
        s = presets.preset_shape(name, int(tp))
        info = config.rope_tables_from_hf_config(cfg, max_pos=8)[2]
        section, d = info.mrope_section, s.head_dim
        max_pos = 4096 if small else int(cfg["max_position_embeddings"])
        shape = (s.q_heads, s.kv_heads, d)
        if small:  # tiny heads, the same interleaving on head_dim 32
            shape, section = (min(s.q_heads, 4), 1, 32), (6, 5, 5)
        for t in tokens:
            for layout in a.layouts.split(","):
                if over_budget(a, f"{name} TP{tp} T={t} {layout}"):
                    continue
                inp = Inputs(shape, t, layout, section, seed=len(rows) + 1, n_sets=a.calls, max_pos=max_pos)
                try:
                    chk = check_variants(inp)
                except Exception as e:  # noqa: BLE001 - the timings still stand
                    chk = {"error": f"{type(e).__name__}: {e}"[:200]}
                checks[(f"{name} TP{tp}", t, layout)] = chk
                log(f"check {name} TP{tp} T={t} {layout} vs the reference (exact or max |diff|): {chk}")
                for variant in variants:
                    rec = dict(model=f"{name} TP{tp}", shape="/".join(map(str, shape)), T=t, layout=layout,
                               variant=variant, bytes=s.bytes_per_token() * t)
                    try:
                        rec.update(run_variant(variant, inp, a, workdir))
                    except Exception as e:  # noqa: BLE001 - keep the other variants
                        rec["error"] = f"{type(e).__name__}: {e}"[:300]
                    rows.append(rec)
                    log(json.dumps(rec))
                del inp
    with open(os.path.join(a.out_dir, "bench_mrope.json"), "w") as fh:
        json.dump(dict(meta=meta, rows=rows, checks={" ".join(map(str, k)): v for k, v in checks.items()}), fh,
                  indent=1)
    shutil.rmtree(workdir, ignore_errors=True)
    f = fmt

    timing = "device (profiler GPU busy per call)" if any(r.get("device_us") for r in rows) else "wall per call"
    log(f"\ntime = {timing}, us; {a.calls} calls per jit; targets: jnp/fused >= 1.5 at T = 8192, "
        f"fused/plain <= 1.10 at every T")
    log(f"{'model':26s} {'T':>6s} {'layout':8s} " + " ".join(f"{v:>9s}" for v in VARIANTS)
        + f" {'jnp/fu':>7s} {'fu/plain':>8s} {'fu/front':>8s}  check (fused, jnp, front)")
    by = {}
    for r in rows:
        by.setdefault((r["model"], r["T"], r["layout"]), {})[r["variant"]] = r
    for (m, t, lay), dd in by.items():
        tm = {v: dd.get(v, {}).get("time_us") for v in VARIANTS}
        fu = tm["fused"]
        chk = checks.get((m, t, lay), {})
        log(f"{m:26s} {t:6d} {lay:8s} " + " ".join(f(tm[v]) for v in VARIANTS)
            + f" {f(ratio(tm['jnp'], fu), 7)} {f(ratio(fu, tm['plain']), 8)} {f(ratio(fu, tm['front']), 8)}  "
            + ", ".join(str(chk.get(v, chk.get("error", "-")))[:12] for v in ("fused", "jnp", "front"))
            + "".join(f"  [{v}: {dd[v]['error'][:60]}]" for v in dd if dd[v].get("error")))
    write_log(os.path.join(a.out_dir, "bench_mrope.log"))
    kernels_exact = all(c.get("fused") == "exact" and c.get("front") == "exact" for c in checks.values())
    return 0 if kernels_exact and all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
