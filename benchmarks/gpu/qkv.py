"""Fused QKV input (rope_and_cache_qkv) vs q, k, v sliced out of the projection for rope_and_cache:
the kernels and the time the fused form removes per decode step.

    python benchmarks/bench_gpu.py qkv OUT_DIR [--dry-run] [--tokens 1,64,256] [--models llama-3.1-8b:1,...]

Per model and T (decode tokens = batch): one jit of a decode step's L layers as the decoder runs
them (jax_rope_cache/decoder.py): lax.scan over stacked per-layer projection weights, the stacked
caches written with layer=i, qkv = x @ w_qkv[i] ([T, (QH + 2 KH) * D], bf16), then
  fused   rope_and_cache_qkv(qkv, ..., num_q_heads, num_kv_heads, layer=i, impl="kernel")
  sliced  rope_and_cache(q, k, v = the three head ranges of qkv, ..., layer=i, impl="kernel")
Counted in the compiled HLO of the step: the instructions that launch work (outside fused
computations; parameters, tuples, bitcasts and the like excluded), by opcode, and what produces the
op's q, k and v operands (the projection itself, or a slice / copy / fusion of it). Timed
(benchmarks/gpu/timing.py): the profiler's GPU busy time and GPU events per layer; "removed" =
sliced - fused per layer and per step of the model's layer count. Checked once per case: each form's
q, k and caches bit for bit against the numpy reference run on that form's OWN projection output
(the step run once more returning it), so a projection that XLA compiles differently for the two
forms (three dots for the sliced one, another cuBLAS algorithm) is no mismatch; a form that differs
from its reference makes the exit code 1. "same bits" (the two forms' results equal) is printed
for information, with whether their projections were equal. --budget-s (90) bounds the run: about 45 s on
an H200 by estimate. --dry-run: tiny shapes on the CPU backend (the CPU handler's HLO; wall time).
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shutil
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import add_timing_args, fmt, log, measure, over_budget, start_run, write_log  # noqa: E402

BS = 16
FORMS = ("fused", "sliced")
FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while", "conditional", "call",
        "after-all", "add-dependency", "opt-barrier", "partition-id", "replica-id"}


def op_targets():
    from jax_rope_cache.backends import cpu, kernel_node, launcher

    return (cpu.TARGET, kernel_node.TARGET, launcher.GPU_TARGET)


def hlo_kernels(hlo: str):
    """(Counter of opcodes that launch work, [(opcode, line) producing the op's q, k, v operands])
    in compiled HLO text. Fused and reducer computations are skipped; while bodies are counted."""
    comps, name = {}, None
    for line in hlo.splitlines():
        m = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
        if m:
            name = m.group(1)
            comps[name] = []
        elif name is not None and line.strip() and line.strip() != "}":
            comps[name].append(line.strip())
    inner = set(re.findall(r"(?:calls|to_apply)=%([\w.\-]+)", hlo))
    counts, producers = collections.Counter(), []
    for cname, lines in comps.items():
        if cname in inner:
            continue
        defs = {}
        for line in lines:
            m = re.match(r"^(?:ROOT )?%([\w.\-]+) = .*? ([\w\-]+)\((.*)$", line)
            if not m:
                continue
            defs[m.group(1)] = (m.group(2), line)
            if m.group(2) not in FREE:
                counts[m.group(2)] += 1
        for op, line in defs.values():
            if op == "custom-call" and any(f'custom_call_target="{t}"' in line for t in op_targets()):
                args = re.search(r"custom-call\((.*?)\), custom_call_target", line).group(1)
                for n in [x.strip().split("%")[-1] for x in args.split(",")][:3]:
                    while defs.get(n, ("", ""))[0] in ("bitcast", "get-tuple-element") or \
                            _convert_only(comps, defs.get(n, ("", ""))):  # to the real producer
                        n = re.search(r"(?:bitcast|get-tuple-element|fusion)\(%([\w.\-]+)", defs[n][1]).group(1)
                    op, pline = defs.get(n, ("parameter", n))
                    called = re.search(r"calls=%([\w.\-]+)", pline) if op == "fusion" else None
                    if called and any(" dot(" in x for x in comps.get(called.group(1), ())):
                        pline += "  (its fused computation holds the dot)"  # a CPU backend wraps dots in fusions
                    producers.append((op, pline))
    return counts, producers


def _convert_only(comps, node) -> bool:
    """A fusion that only converts / bitcasts its one operand (a CPU backend's bf16 epilogue of an f32 dot)."""
    op, line = node
    called = re.search(r"calls=%([\w.\-]+)", line) if op == "fusion" else None
    body = comps.get(called.group(1), ()) if called else ()
    ops = {m.group(1) for x in body if (m := re.search(r"= \S+ ([\w\-]+)\(", x))}
    return bool(ops) and ops <= {"parameter", "convert", "bitcast", "copy"}


def producer_kind(op, line):
    if op == "parameter":
        return "parameter"
    if "dot" in line or "gemm" in line or "cublas" in line:
        return "projection"
    return "slice" if "slice" in line else op


def make_step(form, qh, kh, d, layout="flash", with_proj=False):
    """The jitted decode step of `form`; with_proj: each layer's projection output returned too."""
    import jax
    import jax.numpy as jnp

    import jax_rope_cache as jrc

    def step(x, w, kc, vc, slots, pos, cos, sin):
        t = x.shape[0]

        def layer(carry, xs):
            kc, vc = carry
            wi, i = xs
            qkv = x @ wi  # [T, (QH + 2 KH) * D]: one projection
            if form == "fused":
                q, k, kc, vc = jrc.rope_and_cache_qkv(qkv, kc, vc, slots, pos, cos, sin, num_q_heads=qh,
                                                      num_kv_heads=kh, layout=layout, layer=i, impl="kernel")
            else:
                h = qkv.reshape(t, qh + 2 * kh, d)
                q, k, kc, vc = jrc.rope_and_cache(h[:, :qh], h[:, qh:qh + kh], h[:, qh + kh:], kc, vc, slots, pos, cos,
                                                  sin, layout=layout, layer=i, impl="kernel")
            return (kc, vc), ((q, k, qkv) if with_proj else (q, k))

        (kc, vc), outs = jax.lax.scan(layer, (kc, vc), (w, jnp.arange(w.shape[0])))
        return outs, kc, vc

    return jax.jit(step, donate_argnums=(2, 3))


class Case:
    def __init__(self, qh, kh, d, hidden, t, layers, seed):
        import jax
        import jax.numpy as jnp

        import jax_rope_cache as jrc

        bf = jnp.bfloat16
        rng = np.random.default_rng(seed)
        ks = jax.random.split(jax.random.key(seed), 3)
        self.x = jax.random.normal(ks[0], (t, hidden), jnp.float32).astype(bf)
        self.w = (jax.random.normal(ks[1], (layers, hidden, (qh + 2 * kh) * d), jnp.float32) * hidden**-0.5).astype(bf)
        num_slots = max(4096, 2 * t) // BS * BS
        self.init = jrc.make_kv_cache(num_slots // BS, BS, kh, d, bf, num_layers=layers, fill="random", seed=seed)
        self.caches = [jnp.copy(c) for c in self.init]
        self.slots = jnp.asarray(rng.permutation(num_slots)[:t].astype(np.int32))
        self.pos = jnp.asarray(rng.integers(0, 4096, t).astype(np.int32))
        self.cos, self.sin = jrc.rope_tables(4096, d, base=500000.0)

    def args(self):
        return (self.x, self.w, *self.caches, self.slots, self.pos, self.cos, self.sin)

    def run(self, f):
        outs, *self.caches = f(*self.args())
        return outs


def check_form(f, case, qh, kh):
    """One run of `f` (make_step with with_proj) from the initial caches against the reference fed
    its own projection outputs, layer after layer: (verdict, that projection output [L, T, *])."""
    import jax

    from jax_rope_cache import reference

    (q, k, qkv), kc, vc = jax.device_get(f(case.x, case.w, *[jax.numpy.copy(c) for c in case.init],
                                          *case.args()[4:]))
    verdict = compare_layers((q, k, kc, vc), np.asarray(qkv), [np.asarray(c) for c in case.init], case, qh, kh,
                             reference)
    return verdict, np.asarray(qkv)


def compare_layers(got, qkv, init, case, qh, kh, reference):
    """"exact", or the first output that differs from the reference of the projection outputs qkv."""
    q, k, kc, vc = (np.asarray(x) for x in got)
    rk, rv = init
    args = [np.asarray(x) for x in (case.slots, case.pos, case.cos, case.sin)]
    for i in range(qkv.shape[0]):
        rq, rkk, rk, rv = reference.rope_and_cache_qkv(qkv[i], rk, rv, *args, num_q_heads=qh, num_kv_heads=kh,
                                                        layer=i)
        for name, g, w in (("q", q[i], rq), ("k", k[i], rkk)):
            if not _same(g, w):
                return f"NOT exact ({name}, layer {i})"
    for name, g, w in (("key cache", kc, rk), ("value cache", vc, rv)):
        if not _same(g, w):
            return f"NOT exact ({name})"
    return "exact"


def _same(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and np.array_equal(a.view(np.uint8), b.view(np.uint8))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out_dir")
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU backend")
    ap.add_argument("--tokens", default=None, help="T values (default 1,64,256; dry run 1,8)")
    ap.add_argument("--models", default="llama-3.1-8b:1,llama-3.1-70b:8", help="preset:tp,...")
    ap.add_argument("--layers", type=int, default=None, help="layers per jitted step (default 8; dry run 2)")
    add_timing_args(ap, budget_s=90.0)
    a = ap.parse_args(argv)
    tokens = start_run(a, dry_tokens="1,8", tokens="1,64,256")
    import jax

    from jax_rope_cache.models import presets

    layers = a.layers or (2 if a.dry_run else 8)
    os.makedirs(a.out_dir, exist_ok=True)
    workdir = tempfile.mkdtemp(prefix="qkv_")
    dev = jax.devices()[0]
    meta = dict(device=getattr(dev, "device_kind", str(dev)), platform=dev.platform, jax=jax.__version__,
                layers=layers, reps=a.reps, dry_run=a.dry_run)
    log("bench_qkv:", json.dumps(meta))
    rows, ok = [], True
    for m in a.models.split(","):
        name, tp = m.split(":")
        s = presets.preset_shape(name, int(tp))
        qh, kh, d = s.q_heads, s.kv_heads, s.head_dim
        hidden = int(presets.preset_config(name)["hidden_size"])
        model_layers = int(presets.preset_config(name)["num_hidden_layers"])
        if a.dry_run:
            qh, kh, d, hidden = min(qh, 4), 1, 32, 64
        for t in tokens:
            if over_budget(a, f"{name} TP{tp} T={t}"):
                continue
            case = Case(qh, kh, d, hidden, t, layers, seed=len(rows) + 1)
            row = dict(model=f"{name} TP{tp}", shape=f"{qh}/{kh}/{d}", hidden=hidden, T=t, model_layers=model_layers)
            results, projections = {}, {}
            for form in FORMS:
                f = make_step(form, qh, kh, d)
                try:
                    counts, producers = hlo_kernels(f.lower(*case.args()).compile().as_text())
                    rec = dict(hlo_kernels=sum(counts.values()), hlo_opcodes=dict(counts),
                               qkv_producers=[producer_kind(*p) for p in producers])
                    fresh = [jax.numpy.copy(c) for c in case.init]  # the same start for both forms
                    results[form] = jax.device_get(f(case.x, case.w, *fresh, *case.args()[4:]))
                    rec["check"], projections[form] = check_form(make_step(form, qh, kh, d, with_proj=True), case,
                                                                 qh, kh)
                    ok &= rec["check"] == "exact"
                    rec.update(measure(lambda: case.run(f), a, workdir, calls=layers))
                except Exception as e:  # noqa: BLE001 - keep the other form
                    rec = {"error": f"{type(e).__name__}: {e}"[:300]}
                row[form] = rec
            if len(results) == 2:  # information: equal unless XLA compiled the two projections apart
                flat = [jax.tree.leaves(results[f]) for f in FORMS]
                row["same_bits"] = all(_same(x, y) for x, y in zip(*flat))
                row["same_projection"] = _same(*projections.values()) if len(projections) == 2 else None
            rows.append(row)
            log(json.dumps(row))
            del case
    with open(os.path.join(a.out_dir, "bench_qkv.json"), "w") as fh:
        json.dump(dict(meta=meta, rows=rows), fh, indent=1)
    shutil.rmtree(workdir, ignore_errors=True)

    timing = "device (profiler GPU busy)" if any(r.get("fused", {}).get("device_us") for r in rows) else "wall"
    log(f"\nfused QKV vs sliced q/k/v, {layers} layers per jitted step (lax.scan, stacked caches); time = {timing} "
        f"per layer, us; hlo = HLO instructions that launch work (the entry and the scan body, the body "
        f"counted once: sliced - fused = kernels added per layer); events = GPU events per layer; removed = sliced "
        f"- fused per layer, rem/step = that x the model's layers")
    log(f"{'model':18s} {'T':>5s} {'hlo fu':>7s} {'hlo sl':>7s} {'ev fu':>6s} {'ev sl':>6s} {'fused':>8s} "
        f"{'sliced':>8s} {'removed':>8s} {'rem/step':>9s}  q/k/v producers (fused | sliced), checks (fused | "
        f"sliced, vs the reference of each form's own projection), same bits (same projection)")
    for r in rows:
        fu, sl = r.get("fused", {}), r.get("sliced", {})
        gain = sl["time_us"] - fu["time_us"] if fu.get("time_us") and sl.get("time_us") else None
        log(f"{r['model']:18s} {r['T']:5d} {fmt(fu.get('hlo_kernels'), 7, 0)} "
            f"{fmt(sl.get('hlo_kernels'), 7, 0)} {fmt(fu.get('gpu_events_per_call'), 6, 1)} "
            f"{fmt(sl.get('gpu_events_per_call'), 6, 1)} {fmt(fu.get('time_us'), 8)} {fmt(sl.get('time_us'), 8)} "
            f"{fmt(gain, 8)} {fmt(gain * r['model_layers'] if gain is not None else None, 9, 1)}  "
            f"{','.join(fu.get('qkv_producers', ['-']))} | {','.join(sl.get('qkv_producers', ['-']))}, "
            f"{fu.get('check', '-')} | {sl.get('check', '-')}, {r.get('same_bits', '-')} "
            f"({r.get('same_projection', '-')})"
            + "".join(f"  [{k}: {r[k]['error'][:80]}]" for k in FORMS if r.get(k, {}).get("error")))
    write_log(os.path.join(a.out_dir, "bench_qkv.log"))
    return 0 if ok and all("error" not in r.get(k, {}) for r in rows for k in FORMS) else 1


if __name__ == "__main__":
    sys.exit(main())
