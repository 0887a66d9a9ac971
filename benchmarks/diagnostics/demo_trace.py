#!/usr/bin/env python3
"""Where the time of the demo's decode loop goes (the 32-layer step, kernel vs XLA path).

    python benchmarks/diagnostics/demo_trace.py [--preset llama-3.1-8b --tp 1 --batch 64 --steps 64]

Builds the programs of `python -m jax_rope_cache demo` (cli/demo.py: one fori_loop of decode steps,
32 layers unrolled over one stacked cache pair), runs each impl's decode loop once to compile, then
times R runs (wall per decode step), counts the launcher's executes per step (0: replayed from a
captured graph) and traces one run with jax.profiler: GPU busy and span per step, the executions
the GPU saw (graph launches, split at idle gaps; decode_chain.timeline), our kernel's duration and
the kernels per step by name, and what the optimized HLO holds (custom calls, dynamic slices,
while loops, command buffers). Prints one block per impl. XLA_FLAGS applies as usual.
"""
from __future__ import annotations

import argparse
import collections
import glob
import os
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from decode_chain import launches, timeline  # noqa: E402


def trace(run, steps):
    import jax

    d = tempfile.mkdtemp(prefix="demo_trace_")
    jax.profiler.start_trace(d)
    run()
    jax.profiler.stop_trace()
    pd = jax.profiler.ProfileData.from_file(glob.glob(os.path.join(d, "**", "*.xplane.pb"), recursive=True)[0])
    dev = sorted((float(e.start_ns), float(e.duration_ns), e.name) for p in pd.planes if p.name.startswith("/device:GPU")
                 for ln in p.lines if "stream" in ln.name.lower() for e in ln.events)
    names = collections.Counter()
    per_name_us = collections.Counter()
    for _, dur, nm in dev:
        names[nm[:50]] += 1
        per_name_us[nm[:50]] += dur / 1e3
    out = timeline(dev, steps)
    out["busy_us_per_step"] = sum(e[1] for e in dev) / 1e3 / steps
    out["span_us_per_step"] = (dev[-1][0] + dev[-1][1] - dev[0][0]) / 1e3 / steps if dev else 0.0
    out["top"] = [(nm, c / steps, per_name_us[nm] / steps) for nm, c in names.most_common(8)]
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="llama-3.1-8b")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--impls", default="kernel,xla")
    ap.add_argument("--hlo-dir", default=None, help="write each impl's optimized decode HLO there")
    a = ap.parse_args(argv)
    import jax

    from jax_rope_cache.cli import demo
    from jax_rope_cache.models import presets

    model = presets.model_shape(a.preset, a.tp)
    eps = presets.preset_qk_norm_eps(a.preset)
    data, caches = demo.build(model, a.batch, 16, a.steps, a.layers, 16, 0, a.preset)
    dev = jax.devices()[0]
    ddata = jax.device_put(data, dev)
    for impl in a.impls.split(","):
        _, decode = demo.make_programs(a.layers, a.steps, impl, True, eps)
        state = list(jax.device_put(caches, dev))

        def run():
            kc, vc, acc = decode(ddata, *state)
            jax.block_until_ready(kc)
            state[:] = [kc, vc]

        t0 = time.perf_counter()
        hlo = decode.lower(ddata, *state).compile().as_text() or ""
        run()
        compile_s = time.perf_counter() - t0
        if a.hlo_dir:
            with open(os.path.join(a.hlo_dir, f"demo_decode_{impl}.txt"), "w") as fh:
                fh.write(hlo)
        walls, l0 = [], launches()
        for _ in range(a.repeats):
            t0 = time.perf_counter()
            run()
            walls.append((time.perf_counter() - t0) / a.steps * 1e6)
        lps = (launches() - l0) / (a.repeats * a.steps)
        tr = trace(run, a.steps)
        print(f"== {impl}: {model.name} batch {a.batch}, {a.layers} layers, {a.steps} steps; compile+first {compile_s:.1f} s;"
              f" wall per step {np.median(walls):.1f} us (runs {[round(w, 1) for w in walls]}); launcher executes per"
              f" step {lps:.2f}", flush=True)
        print(f"   GPU busy {tr['busy_us_per_step']:.1f} us/step, span {tr['span_us_per_step']:.1f} us/step; executions"
              f" {tr.get('executions')} (median span {tr.get('exec_span_us')}, idle inside {tr.get('exec_idle_us')});"
              f" our kernel {tr.get('our_kernel_us')} us x {tr.get('our_kernels_per_step')}/step;"
              f" XLA kernels {tr.get('xla_kernel_us')} us median", flush=True)
        marks = ("custom-call(", "dynamic-slice(", "dynamic_slice_fusion", "address_computation", "while(",
                 "command_buffer", "conditional(")
        print("   optimized HLO: " + ", ".join(f"{m.strip('(')} {hlo.count(m)}" for m in marks), flush=True)
        for nm, c, us in tr["top"]:
            print(f"   {c:7.1f}/step {us:8.1f} us/step  {nm}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
