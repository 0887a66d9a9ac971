#!/usr/bin/env python3
"""The model client's decode step per route, measured two ways: wall time with the routes
interleaved repeat by repeat (so drift hits all alike), and GPU busy time from a profiler trace
(deterministic enough to resolve a few microseconds per step), with the GPU's idle time inside the
step (gaps between kernels) overall and next to our kernel.

A route is IMPL:ATTENTION: IMPL the op's implementation ("kernel", "xla") or "baseline" (the model
with RoPE and the cache write replaced by a one-element in-place write of each cache per layer,
decoder.touch_caches: attention still depends on a write every layer); ATTENTION the decode
attention (attention.ATTENTIONS: "gather", "pallas_gpu", "pallas_tpu").

    # the attention benchmark: every sequence at a context length, no prefill (the caches hold zeros)
    python benchmarks/diagnostics/model_step.py --contexts 512,2048,8192 [--batch 64] [--steps 32]
        [--routes kernel:pallas_gpu,kernel:gather,xla:pallas_gpu,baseline:pallas_gpu] [--repeats 7] [--out DIR]
    # prompts of up to --prompt-len tokens prefilled, stacked flash caches (the gather routes only)
    python benchmarks/diagnostics/model_step.py [--model llama-3.1-8b] [--impls kernel,xla,baseline] [--batch 64]

With --contexts, all routes share ONE pool of head_major caches, one per layer (the Pallas kernels'
layout; the gather route reads it too), handed from route to route: at batch 64 and 8192 tokens a
Llama-3.1-8B pool is 69 GB, so four pools would not fit an H200. Per context and route it prints
the step (wall, GPU busy, idle), tokens/s, the op's share (route minus the baseline route with the
same attention), and the bytes attention must read per step (every sequence's K and V, all layers)
against the copy ceiling (COPY_TBS, the H200's measured device copy): the time those bytes take at
that rate, and for a Pallas route its kernel's GPU time and bandwidth. With --out, a JSON of every
row with the GPU events per step by name. On the CPU (tiny sizes) it runs as a smoke test: the
Pallas kernels interpreted, no GPU events.
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

COPY_TBS = 4.30  # H200 device copy, TB/s (measured: benchmarks/results/h200.md)
GPU_ROUTES = "kernel:pallas_gpu,kernel:gather,xla:pallas_gpu,baseline:pallas_gpu"


def build(model, impl, params, cfg, config, batch, prompt_len, steps, dtype, seed=0, xla_options=None):
    """Prefill mode: prompts of prompt_len / 2 .. prompt_len tokens, stacked flash caches, gather."""
    from jax_rope_cache import decoder

    rng = np.random.default_rng(seed)
    lengths = rng.integers(max(1, prompt_len // 2), prompt_len + 1, batch)
    prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in lengths]
    max_len = -(-(prompt_len + steps + 1) // 16) * 16
    m = decoder.Decoder(config, params, layout="flash", block_size=16, impl=impl, max_seqs=batch, max_len=max_len,
                        dtype=dtype, unroll=cfg.num_layers, cache_fill="zeros", attention="gather",
                        decode_compiler_options=xla_options or None)
    seqs = [m.allocator.allocate(len(p) + steps + 1) for p in prompts]
    bt = m.allocator.block_table(seqs, m.blocks_per_seq)
    first, _, lens = m.prefill(prompts, bt)
    return m, first, lens, bt


class Pool:
    """The caches every route of one context shares (each call donates them and returns new ones)."""
    caches = None


def build_context(impl, attention, params, cfg, config, batch, context, steps, dtype, pool, seed=0,
                  xla_options=None):
    """Context mode: every sequence holds `context` tokens (no prefill: the pool's zeros stand in for
    them) and decodes from there; head_major caches, one per layer, taken from `pool`."""
    from jax_rope_cache import decoder

    class Shared(decoder.Decoder):
        def _new_caches(self, num_blocks, fill, seed_):
            if pool.caches is None:
                pool.caches = super()._new_caches(num_blocks, fill, seed_)
            return pool.caches

    rng = np.random.default_rng(seed)
    max_len = -(-(context + steps + 1) // 16) * 16
    m = Shared(config, params, layout="head_major", attention=attention, per_layer=True, block_size=16, impl=impl,
               max_seqs=batch, max_len=max_len, dtype=dtype, unroll=cfg.num_layers, cache_fill="zeros",
               decode_compiler_options=xla_options or None)
    seqs = [m.allocator.allocate(context + steps + 1) for _ in range(batch)]
    bt = m.allocator.block_table(seqs, m.blocks_per_seq)
    tokens = rng.integers(0, cfg.vocab_size, batch).astype(np.int32)
    return m, tokens, np.full(batch, context, np.int32), bt


def attention_bytes(cfg, batch, context, steps, itemsize) -> float:
    """Bytes attention reads per decode step: K and V of every sequence's keys (context + 1 .. context
    + steps of them over the steps), every layer."""
    keys = batch * (context + (steps + 1) / 2)
    return keys * cfg.kv_heads * cfg.head_dim * 2 * itemsize * cfg.num_layers


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


def kernel_us(by_name: dict, steps: int, pattern: str = "paged_attention") -> float | None:
    """GPU us per decode step of the events whose name contains `pattern` (None: no such event)."""
    hits = [us for name, (_, us) in (by_name or {}).items() if pattern in name.lower()]
    return sum(hits) / steps if hits else None


class Runner:  # what decode_chain.trace_steps drives: one call = `steps` decode steps
    def __init__(self, m, first, lens, bt, steps, pool=None):
        self.m, self.first, self.lens, self.bt, self.steps, self.pool = m, first, lens, bt, steps, pool

    def step(self):
        if self.pool is not None:
            self.m.caches = self.pool.caches
        toks, _ = self.m.decode(self.first, self.lens, self.bt, self.steps, with_logits=False)
        if self.pool is not None:
            self.pool.caches = self.m.caches
        return toks

    def block(self, out):
        import jax
        jax.block_until_ready((out, self.m.caches))


def parse_routes(text: str, attentions) -> list[tuple[str, str]]:
    """IMPL[:ATTENTION] entries (ATTENTION default gather) -> [(impl, attention)]; ValueError naming a bad one."""
    from jax_rope_cache import decoder

    out = []
    for item in (s for s in text.split(",") if s):
        impl, _, att = item.partition(":")
        att = att or "gather"
        if impl not in decoder.IMPLS or att not in attentions:
            raise ValueError(f"--routes: expected IMPL:ATTENTION with IMPL one of {decoder.IMPLS} and ATTENTION one "
                             f"of {attentions}, got {item!r}")
        out.append((impl, att))
    return out


def measure(runners: dict, repeats: int, steps: int) -> dict:
    """Interleaved wall times and one profiler trace per route -> {route: row}."""
    walls = {k: [] for k in runners}
    for _ in range(repeats):  # interleaved: every repeat runs each route once
        for k, r in runners.items():
            t0 = time.perf_counter()
            r.block(r.step())
            walls[k].append((time.perf_counter() - t0) / steps * 1e6)
    rows = {}
    for k, r in runners.items():
        tr = trace_steps(r, 1, tempfile.gettempdir())
        rows[k] = dict(wall_us=float(np.median(walls[k])), wall_runs=[round(w, 1) for w in walls[k]],
                       busy_us=tr.get("gpu_busy_us_per_step", 0) / steps,
                       events=tr.get("gpu_events_per_step", 0) / steps,
                       our_kernel_us=tr.get("our_kernel_us"), top=tr.get("top_gpu_events"),
                       by_name=tr.get("gpu_us_by_name"), span_us=tr.get("gpu_span_us_per_step", 0) / steps,
                       gap_us=tr.get("gap_sum_us_per_step", 0) / steps, our_gap_us=tr.get("our_gap_us"))
    return rows


def print_context_table(rows: dict, cfg, batch, context, steps, itemsize):
    """One line per route: step, tokens/s, op share, attention bytes and ceiling, Pallas kernel bandwidth."""
    nbytes = attention_bytes(cfg, batch, context, steps, itemsize)
    ceil_us = nbytes / (COPY_TBS * 1e12) * 1e6
    print(f"\ncontext {context}: attention reads {nbytes / 1e9:.2f} GB per step (K and V, {cfg.num_layers} layers); "
          f"at the {COPY_TBS} TB/s copy ceiling {ceil_us:.0f} us")
    print(f"{'route':<22}{'wall us':>10}{'(min-max)':>16}{'GPU busy us':>13}{'idle us':>9}{'tok/s':>10}"
          f"{'op wall/busy us':>18}{'op share':>10}{'attn kernel us':>16}{'of ceiling':>12}")
    for (impl, att), r in rows.items():
        base = rows.get(("baseline", att))
        op = share = "-"
        if base and impl != "baseline":
            op = f"{r['wall_us'] - base['wall_us']:.0f}/{r['busy_us'] - base['busy_us']:.0f}"
            share = f"{(r['wall_us'] - base['wall_us']) / r['wall_us'] * 100:.1f}%"
        ak = kernel_us(r.get("by_name"), steps)
        r.update(attention_bytes=nbytes, ceiling_us=ceil_us, attention_kernel_us=ak)
        akt = f"{ak:.0f}" if ak else "-"
        eff = f"{ceil_us / ak * 100:.0f}%" if ak else "-"
        runs = r["wall_runs"]
        print(f"{impl + ':' + att:<22}{r['wall_us']:>10.1f}{f'{min(runs):.0f}-{max(runs):.0f}':>16}"
              f"{r['busy_us']:>13.1f}{r['gap_us']:>9.1f}{batch / r['wall_us'] * 1e6:>10,.0f}{op:>18}{share:>10}"
              f"{akt:>16}{eff:>12}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--contexts", default=None,
                    help="comma list of context lengths per sequence (the attention benchmark: no prefill, one "
                         "shared pool of head_major caches)")
    ap.add_argument("--routes", default=None,
                    help=f"comma list of IMPL:ATTENTION (default with --contexts: {GPU_ROUTES}, with pallas_tpu on a "
                         "TPU; on the CPU the GPU kernel runs interpreted)")
    ap.add_argument("--impls", default="kernel,xla,baseline", help="without --contexts: the routes IMPL:gather")
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
    import jax.numpy as jnp

    import jax_rope_cache as jrc
    from jax_rope_cache import attention as attn
    from jax_rope_cache import decoder
    from jax_rope_cache.cli.generate import MODELS

    config = dict(MODELS[a.model])
    if a.layers:
        config["num_hidden_layers"] = a.layers
    cfg = decoder.DecoderConfig.from_hf(config)
    n_params = sum(int(np.prod(s)) for s in jax.tree.leaves(cfg.param_shapes(), is_leaf=lambda x: isinstance(x, tuple)))
    params = (decoder.random_params_on_device(cfg, 0, a.dtype) if n_params > 5e7
              else decoder.random_params(cfg, decoder.TINY_SEEDS.get(a.model, 0), np.dtype(a.dtype)))
    xla_options = {k: xla_value(v) for k, v in (kv.split("=", 1) for kv in a.xla_option)}
    dev = jax.devices()[0]
    contexts = [int(c) for c in a.contexts.split(",")] if a.contexts else [None]
    if a.contexts:
        pallas = attn.default_attention(dev)
        pallas = "pallas_gpu" if pallas == "gather" else pallas  # no native kernel here: the GPU one interpreted
        routes = parse_routes(a.routes or GPU_ROUTES.replace("pallas_gpu", pallas), attn.ATTENTIONS)
    else:
        routes = parse_routes(a.routes or a.impls, ("gather",))
    print(f"device {dev.platform} ({dev.device_kind}), jax {jax.__version__}; {a.model}: {cfg.num_layers} layers, "
          f"batch {a.batch}, {a.dtype}, {a.steps} decode steps per run, {a.repeats} interleaved repeats")
    itemsize = jnp.dtype(a.dtype).itemsize
    results = {}
    for context in contexts:
        runners, compile_s = {}, {}
        pool = Pool()
        for impl, att in routes:
            t0 = time.perf_counter()
            if context is None:
                m, first, lens, bt = build(a.model, impl, params, cfg, config, a.batch, a.prompt_len, a.steps,
                                           a.dtype, xla_options=xla_options)
                r = Runner(m, first, lens, bt, a.steps)
            else:
                m, first, lens, bt = build_context(impl, att, params, cfg, config, a.batch, context, a.steps, a.dtype,
                                                   pool, xla_options=xla_options)
                r = Runner(m, first, lens, bt, a.steps, pool)
            r.block(r.step())
            compile_s[(impl, att)] = time.perf_counter() - t0
            runners[(impl, att)] = r
            if a.hlo and a.out:
                os.makedirs(a.out, exist_ok=True)
                text = m.decode_fn.lower(m.params, m.tables, m.caches, r.first, r.lens, r.bt, steps=a.steps,
                                         with_logits=False).compile().as_text()
                with open(os.path.join(a.out, f"hlo_{a.model}_{context}_{impl}_{att}.txt"), "w") as fh:
                    fh.write(text or "")
        rows = measure(runners, a.repeats, a.steps)
        for k, row in rows.items():
            row["compile_s"] = round(compile_s[k], 1)
        opts = runners[routes[0]].m.decode_compiler_options
        if context is None:
            print_prefill_table(rows, cfg, a, opts)
        else:
            print_context_table(rows, cfg, a.batch, context, a.steps, itemsize)
        print_kernel_groups(rows, a.steps)
        results[str(context)] = {(f"{i}:{t}" if a.contexts else i): row for (i, t), row in rows.items()}
        del runners, pool
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, f"model_step_{a.model}.json"), "w") as fh:
            json.dump(results if a.contexts else results["None"], fh, indent=1)
    return 0


def print_prefill_table(rows, cfg, a, opts):
    print(f"\n{a.model}: decode XLA options {opts}; per decode step:")
    print(f"{'impl':<9}{'wall us':>10}{'(min-max)':>20}{'GPU busy us':>13}{'idle us':>9}{'kernels':>9}"
          f"{'op wall/layer':>15}{'op busy/layer':>15}")
    base = rows.get(("baseline", "gather"))
    for (impl, _), r in rows.items():
        ow = ob = "-"
        if base and impl != "baseline":
            ow = f"{(r['wall_us'] - base['wall_us']) / cfg.num_layers:.2f}"
            ob = f"{(r['busy_us'] - base['busy_us']) / cfg.num_layers:.2f}"
        runs = r["wall_runs"]
        print(f"{impl:<9}{r['wall_us']:>10.1f}{f'{min(runs):.0f}-{max(runs):.0f}':>20}{r['busy_us']:>13.1f}"
              f"{r['gap_us']:>9.1f}{r['events']:>9.1f}{ow:>15}{ob:>15}")
    for (impl, _), r in rows.items():
        if r.get("our_gap_us"):
            print(f"{impl}: GPU idle around our kernel per step (us): "
                  + ", ".join(f"{k} {v['per_step'] / a.steps:.1f} (median {v['median']:.2f})"
                              for k, v in r["our_gap_us"].items()))


def print_kernel_groups(rows, steps):
    """The kernels whose count per decode step differs from the baseline route's with the same attention."""
    groups = {k: name_groups(r.get("by_name") or {}, steps) for k, r in rows.items()}
    pairs = [(k, ("baseline", k[1])) for k in rows if k[0] != "baseline" and ("baseline", k[1]) in rows]
    if not pairs or not any(groups.values()):
        return
    print("kernels per decode step whose count differs from the baseline's (name group: count, GPU us):")
    for k, b in pairs:
        for who in (k, b):
            diff = {g: v for g, v in groups[who].items() if groups[k].get(g, (0, 0))[0] != groups[b].get(g, (0, 0))[0]}
            label = ":".join(who) + ":"
            print(f"  {label:<24}" + ", ".join(f"{g} {n:g} x {us / max(n, 1):.2f} = {us:.1f}"
                                              for g, (n, us) in sorted(diff.items())))


if __name__ == "__main__":
    sys.exit(main())
