"""`python -m jax_rope_cache bench`: kernel vs XLA path on the default device, side by side.

Method: for each token count, `--calls` independent input sets are applied in ONE jitted function
(caches donated, the calls chained through the caches and every q_out/k_out returned, so no
part of any call is dead code); the time of that
function over the number of calls is the time per op, median of `--repeats` runs after a warm-up.
On a GPU that is device time plus the per-op launch cost inside one executable. Bytes are the
fewest the op must move (presets.ModelShape.bytes_per_token); the ceiling is an elementwise pass
(read + write) over a large buffer measured in the same run.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_rope_cache as jrc
from jax_rope_cache import contract
from jax_rope_cache.cli import _args
from jax_rope_cache.cli._fmt import progress
from jax_rope_cache.models import presets

SLOT_PATTERNS = ("random", "prefill", "decode")


def _median_time(fn, *args, repeats: int) -> float:
    out = fn(*args)
    jax.block_until_ready(out)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def copy_ceiling(nbytes: int, repeats: int = 10) -> float:
    """Bytes read + written per second by an elementwise pass over `nbytes` on the default device,
    in place (the buffer donated and carried), so no call pays for fresh pages (a new 128 MiB output
    per call made the CPU figure 0.8 GB/s, a third of what the op itself reached)."""
    fn = jax.jit(lambda a: a ^ jnp.uint32(0x5A5A5A5A), donate_argnums=0)
    x = fn(jnp.arange(nbytes // 4, dtype=jnp.uint32))
    times = []
    for _ in range(repeats + 1):
        jax.block_until_ready(x)
        t0 = time.perf_counter()
        x = fn(x)
        jax.block_until_ready(x)
        times.append(time.perf_counter() - t0)
    return 2 * nbytes / float(np.median(times[1:]))


def make_slots(pattern: str, tokens: int, block_size: int, rng) -> tuple[np.ndarray, int]:
    """(slot_mapping, number of blocks) for a slot pattern: random unique slots; prefill runs of
    1024 tokens filling random blocks in order; decode: one token per sequence in a random block."""
    if pattern == "random":
        nb = -(-2 * tokens // block_size) + 1
        return rng.permutation(nb * block_size)[:tokens].astype(np.int32), nb
    if pattern == "prefill":
        per_seq = min(1024, tokens)
        seqs = -(-tokens // per_seq)
        bps = -(-per_seq // block_size)
        nb = 2 * seqs * bps + 1
        blocks = rng.permutation(nb)[: seqs * bps].reshape(seqs, bps)
        t = np.arange(per_seq)
        slots = (blocks[:, t // block_size] * block_size + t % block_size).reshape(-1)[:tokens]
        return slots.astype(np.int32), nb
    if pattern == "decode":
        nb = 2 * tokens + 1
        blocks = rng.permutation(nb)[:tokens]
        return (blocks * block_size + rng.integers(0, block_size, tokens)).astype(np.int32), nb
    raise ValueError(f"pattern: expected one of {SLOT_PATTERNS}, got {pattern!r}")


def bench_one(model: presets.ModelShape, tokens: int, impl: str, *, layout="flash", pattern="random",
              calls=8, repeats=10, block_size=16, seed=0) -> float:
    rng = np.random.default_rng(seed)
    qh, kh, d, r = model.q_heads, model.kv_heads, model.head_dim, model.rotary_dim
    x = lambda *s: jnp.asarray(rng.standard_normal(s, np.float32), jnp.bfloat16)  # noqa: E731
    sets = []
    nb = 1
    for _ in range(calls):
        slots, nb_i = make_slots(pattern, tokens, block_size, rng)
        nb = max(nb, nb_i)
        sets.append((x(tokens, qh, d), x(tokens, kh, d), x(tokens, kh, d), jnp.asarray(slots),
                     jnp.asarray(rng.integers(0, 4096, tokens).astype(np.int32))))
    ang = rng.uniform(-np.pi, np.pi, (4096, r // 2))
    cos, sin = jnp.asarray(np.cos(ang), jnp.float32), jnp.asarray(np.sin(ang), jnp.float32)
    kc, vc = jrc.make_kv_cache(nb, block_size, kh, d, jnp.bfloat16, layout=layout, fill="random", seed=seed)

    def chain(sets, kc, vc):
        outs = []
        for q, k, v, s, p in sets:
            qo, ko, kc, vc = jrc.rope_and_cache(q, k, v, kc, vc, s, p, cos, sin, layout=layout,
                                                is_neox=model.is_neox, rotary_dim=r, impl=impl)
            outs.append((qo, ko))  # returned whole: XLA may not skip any of the rotation
        return outs, kc, vc

    fn = jax.jit(chain, donate_argnums=(1, 2))
    _, kc, vc = fn(sets, kc, vc)  # compile and warm up
    jax.block_until_ready(kc)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        _, kc, vc = fn(sets, kc, vc)
        jax.block_until_ready((kc, vc))
        times.append(time.perf_counter() - t0)
    return float(np.median(times)) / calls


def run(model_names, tokens_list, *, layouts=("flash",), patterns=("random",), impls=("kernel", "xla"),
        calls=8, repeats=10, tp=1):
    rows = []
    on_gpu = jax.default_backend() != "cpu"
    ceiling = copy_ceiling(1 << 30 if on_gpu else 1 << 27)
    jobs = [(m, lay, pat, t) for m in model_names for lay in layouts for pat in patterns for t in tokens_list]
    for i, (name, layout, pattern, tokens) in enumerate(jobs):
        progress(i, len(jobs), f"{name} {layout} {pattern} T={tokens}")
        model = presets.model_shape(name, tp)
        per_token = model.bytes_per_token()
        times = {impl: bench_one(model, tokens, impl, layout=layout, pattern=pattern, calls=calls, repeats=repeats)
                 for impl in impls}
        for impl, t in times.items():
            bw = per_token * tokens / t
            rows.append(dict(model=name, tp=tp, layout=layout, slots=pattern, tokens=tokens, impl=impl,
                             us_per_op=t * 1e6, gbps=bw / 1e9, fraction_of_copy=bw / ceiling,
                             speedup_vs_xla=times.get("xla", t) / t))
    progress(len(jobs), len(jobs), "done")
    return dict(device=jax.devices()[0].device_kind, platform=jax.default_backend(), copy_gbps=ceiling / 1e9,
                method=__doc__.split("Method: ")[1].split("\n\n")[0].replace("\n", " "), rows=rows)


def print_table(result) -> None:
    print(f"{result['device']} ({result['platform']}); ceiling (elementwise read+write) {result['copy_gbps']:.1f} GB/s")
    print(f"{'model':<20}{'layout':<18}{'slots':<9}{'T':>7} {'impl':<7}{'us/op':>10}{'GB/s':>9}{'of copy':>9}"
          f"{'vs xla':>8}")
    for r in result["rows"]:
        print(f"{r['model']:<20}{r['layout']:<18}{r['slots']:<9}{r['tokens']:>7} {r['impl']:<7}{r['us_per_op']:>10.1f}"
              f"{r['gbps']:>9.1f}{r['fraction_of_copy']:>9.1%}{r['speedup_vs_xla']:>7.2f}x")


def plot(result, path: str) -> bool:
    """Bandwidth vs tokens per implementation with the copy ceiling; False without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5))
    keys = sorted({(r["model"], r["layout"], r["slots"], r["impl"]) for r in result["rows"]})
    for key in keys:
        pts = sorted((r["tokens"], r["gbps"]) for r in result["rows"]
                     if (r["model"], r["layout"], r["slots"], r["impl"]) == key)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=" ".join(key))
    ax.axhline(result["copy_gbps"], color="k", linestyle="--", label="copy ceiling")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens per call")
    ax.set_ylabel("achieved GB/s (fewest bytes / time)")
    ax.set_title(f"rope_and_cache on {result['device']}")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m jax_rope_cache bench", description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--preset", nargs="+", default=["llama-3.1-8b"], type=_args.preset_name,
                   help="model presets (see `info`)")
    p.add_argument("--tp", type=_args.positive_int, default=1, help="tensor-parallel degree: heads per shard")
    p.add_argument("--tokens", type=_args.positive_int, nargs="+", default=None,
                   help="tokens per call (default: 1 8 64 128 512 2048 8192 32768 on a GPU, 1 8 64 256 1024 4096 "
                        "on CPU)")
    p.add_argument("--layout", nargs="+", default=["flash"], choices=list(contract.LAYOUTS), help="cache layouts")
    p.add_argument("--slots", nargs="+", default=["random"], choices=SLOT_PATTERNS,
                   help="slot patterns: random unique, prefill runs, decode (one token per sequence)")
    p.add_argument("--calls", type=_args.positive_int, default=8, help="calls unrolled in one timed executable")
    p.add_argument("--repeats", type=_args.positive_int, default=10, help="timed repetitions (the median is kept)")
    p.add_argument("--out", default=None, type=_args.output_prefix, help="write <out>.json, <out>.csv and <out>.png")
    p.add_argument("--json", action="store_true", help="print the result as JSON instead of a table")
    a = _args.parse_args(p, argv)
    tokens = a.tokens or ([1, 8, 64, 128, 512, 2048, 8192, 32768] if jax.default_backend() != "cpu"
                          else [1, 8, 64, 256, 1024, 4096])
    result = run(a.preset, tokens, layouts=a.layout, patterns=a.slots, calls=a.calls, repeats=a.repeats, tp=a.tp)
    if a.json:
        print(json.dumps(result, indent=1))
    else:
        print_table(result)
    if a.out:
        with open(a.out + ".json", "w") as f:
            json.dump(result, f, indent=1)
        with open(a.out + ".csv", "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(result["rows"][0]))
            w.writeheader()
            w.writerows(result["rows"])
        if plot(result, a.out + ".png"):
            print(f"wrote {a.out}.json, {a.out}.csv, {a.out}.png")
        else:
            print(f"wrote {a.out}.json, {a.out}.csv (no plot: matplotlib is not installed)")
