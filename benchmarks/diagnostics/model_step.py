#!/usr/bin/env python3
"""The model client's decode step per implementation, measured two ways: wall time with the
implementations interleaved repeat by repeat (so drift hits all alike), and GPU busy time from a
profiler trace (deterministic enough to resolve a few microseconds per step), with the GPU's idle
time inside the step (gaps between kernels) overall and next to our kernel.

    python benchmarks/diagnostics/model_step.py [--model llama-3.1-8b] [--impls kernel,xla,baseline]
                                                [--batch 64] [--steps 32] [--repeats 7] [--out DIR]

"baseline" is the model with RoPE and the cache write replaced by a one-element in-place write of
each cache per layer (decoder.touch_caches): attention still depends on a write every layer. The
op's share of a step = the implementation's step minus the baseline's, in wall and in GPU busy time.
Prints one row per implementation; with --out also a JSON of every row with the GPU events per step
by name.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from decode_chain import trace_steps  # noqa: E402


def build(model, impl, params, cfg, config, batch, prompt_len, steps, dtype, seed=0, xla_options=None):
    from jax_rope_cache import decoder

    rng = np.random.default_rng(seed)
    lengths = rng.integers(max(1, prompt_len // 2), prompt_len + 1, batch)
    prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in lengths]
    max_len = -(-(prompt_len + steps + 1) // 16) * 16
    m = decoder.Decoder(config, params, layout="flash", block_size=16, impl=impl, max_seqs=batch, max_len=max_len,
                        dtype=dtype, unroll=cfg.num_layers, cache_fill="zeros",
                        decode_compiler_options=xla_options or None)
    seqs = [m.allocator.allocate(len(p) + steps + 1) for p in prompts]
    bt = m.allocator.block_table(seqs, m.blocks_per_seq)
    first, _, lens = m.prefill(prompts, bt)
    return m, first, lens, bt


def xla_value(text: str):
    """An --xla-option value as XLA's options take it: bool (true/false), int, float, else the text."""
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def name_groups(by_name: dict, steps: int) -> dict:
    """{group: (kernels, GPU us)} per decode step; a group is an event name without XLA's numeric
    suffix (loop_reduce_fusion_31 -> loop_reduce_fusion; fusion_1375 -> fusion)."""
    out = {}
    for name, (n, us) in by_name.items():
        g = re.sub(r"_\d+$", "", name)
        c, t = out.get(g, (0.0, 0.0))
        out[g] = (c + n / steps, t + us / steps)
    return out


class Runner:  # what decode_chain.trace_steps drives: one call = `steps` decode steps
    def __init__(self, m, first, lens, bt, steps):
        self.m, self.first, self.lens, self.bt, self.steps = m, first, lens, bt, steps

    def step(self):
        toks, _ = self.m.decode(self.first, self.lens, self.bt, self.steps, with_logits=False)
        return toks

    def block(self, out):
        import jax
        jax.block_until_ready((out, self.m.key_cache))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--impls", default="kernel,xla,baseline")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out", default=None)
    ap.add_argument("--xla-option", action="append", default=[], metavar="KEY=VALUE",
                    help="an XLA option of the decode program (Decoder's decode_compiler_options, replacing its "
                    "default), repeatable; e.g. xla_gpu_enable_triton_gemm=true (XLA's Triton GEMMs)")
    ap.add_argument("--hlo", action="store_true", help="with --out: write each decode program's optimized HLO")
    a = ap.parse_args(argv)
    import jax

    from jax_rope_cache import decoder
    from jax_rope_cache.cli.generate import MODELS

    config = dict(MODELS[a.model])
    if a.layers:
        config["num_hidden_layers"] = a.layers
    cfg = decoder.DecoderConfig.from_hf(config)
    n_params = sum(int(np.prod(s)) for s in jax.tree.leaves(cfg.param_shapes(), is_leaf=lambda x: isinstance(x, tuple)))
    params = (decoder.random_params_on_device(cfg, 0, a.dtype) if n_params > 5e7
              else decoder.random_params(cfg, decoder.TINY_SEEDS.get(a.model, 0), np.dtype(a.dtype)))
    impls = a.impls.split(",")
    xla_options = {k: xla_value(v) for k, v in (kv.split("=", 1) for kv in a.xla_option)}
    runners, compile_s = {}, {}
    for impl in impls:
        t0 = time.perf_counter()
        r = Runner(*build(a.model, impl, params, cfg, config, a.batch, a.prompt_len, a.steps, a.dtype,
                             xla_options=xla_options), a.steps)
        r.block(r.step())
        compile_s[impl] = time.perf_counter() - t0
        runners[impl] = r
        if a.hlo and a.out:
            os.makedirs(a.out, exist_ok=True)
            m = r.m
            text = m.decode_fn.lower(m.params, m.tables, m.caches, r.first, r.lens, r.bt, steps=a.steps,
                                     with_logits=False).compile().as_text()
            with open(os.path.join(a.out, f"hlo_{a.model}_{impl}.txt"), "w") as fh:
                fh.write(text or "")
    walls = {impl: [] for impl in impls}
    for _ in range(a.repeats):  # interleaved: every repeat runs each implementation once
        for impl in impls:
            r = runners[impl]
            t0 = time.perf_counter()
            r.block(r.step())
            walls[impl].append((time.perf_counter() - t0) / a.steps * 1e6)
    traces = {impl: trace_steps(runners[impl], 1, tempfile.gettempdir()) for impl in impls}
    rows = {}
    for impl in impls:
        tr = traces[impl]
        rows[impl] = dict(wall_us=float(np.median(walls[impl])), wall_runs=[round(w, 1) for w in walls[impl]],
                          busy_us=tr.get("gpu_busy_us_per_step", 0) / a.steps,
                          events=tr.get("gpu_events_per_step", 0) / a.steps, compile_s=round(compile_s[impl], 1),
                          our_kernel_us=tr.get("our_kernel_us"), top=tr.get("top_gpu_events"),
                          by_name=tr.get("gpu_us_by_name"), span_us=tr.get("gpu_span_us_per_step", 0) / a.steps,
                          gap_us=tr.get("gap_sum_us_per_step", 0) / a.steps, our_gap_us=tr.get("our_gap_us"))
    print(f"\n{a.model}: {cfg.num_layers} layers, batch {a.batch}, {a.dtype}, {a.steps} decode steps per run, "
          f"{a.repeats} interleaved repeats, decode XLA options {runners[impls[0]].m.decode_compiler_options}; "
          "per decode step:")
    print(f"{'impl':<9}{'wall us':>10}{'(min-max)':>20}{'GPU busy us':>13}{'idle us':>9}{'kernels':>9}"
          f"{'op wall/layer':>15}{'op busy/layer':>15}")
    base = rows.get("baseline")
    for impl, r in rows.items():
        ow = ob = "-"
        if base and impl != "baseline":
            ow = f"{(r['wall_us'] - base['wall_us']) / cfg.num_layers:.2f}"
            ob = f"{(r['busy_us'] - base['busy_us']) / cfg.num_layers:.2f}"
        rng_ = f"{min(walls[impl]):.0f}-{max(walls[impl]):.0f}"
        print(f"{impl:<9}{r['wall_us']:>10.1f}{rng_:>20}{r['busy_us']:>13.1f}{r['gap_us']:>9.1f}{r['events']:>9.1f}"
              f"{ow:>15}{ob:>15}")
    for impl, r in rows.items():
        if r.get("our_gap_us"):
            print(f"{impl}: GPU idle around our kernel per step (us): "
                  + ", ".join(f"{k} {v['per_step'] / a.steps:.1f} (median {v['median']:.2f})"
                              for k, v in r["our_gap_us"].items()))
    if base:  # the kernels that differ from the baseline's (by name group, per decode step)
        groups = {impl: name_groups(r.get("by_name") or {}, a.steps) for impl, r in rows.items()}
        print("\nkernels per decode step whose count differs from the baseline's (name group: count, GPU us):")
        for impl in rows:
            if impl == "baseline":
                continue
            for who in (impl, "baseline"):
                diff = {k: v for k, v in groups[who].items()
                        if groups[impl].get(k, (0, 0))[0] != groups["baseline"].get(k, (0, 0))[0]}
                print(f"  {who + ':':<10}" + ", ".join(f"{k} {n:g} x {us / max(n, 1):.2f} = {us:.1f}"
                                                     for k, (n, us) in sorted(diff.items())))
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, f"model_step_{a.model}.json"), "w") as fh:
            json.dump(rows, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
