#!/usr/bin/env python3
"""Where the time of a 32-call decode chain goes (the per-call cost of a custom call in XLA's graphs).

    python benchmarks/diagnostics/decode_chain.py OUT_DIR [--dry-run] [--tokens 1,64,256] ...

One jit of N unrolled calls (a decode step of N layers; Llama-3.1-8B TP1 shapes 32/8/128, bf16,
flash caches), N = 32 and N = 1, for:
  kernel   rope_and_cache(impl="kernel")
  trivial  the SAME custom call (same primitive, operands, aliasing, signature, launch geometry)
           with the code table swapped for a one-store NVRTC kernel: the launcher + XLA cost alone
  xla      rope_and_cache(impl="xla")
  kernel_noinit  the op's kernel through the launcher's target minus its initialize stage (XLA
           calls initialize for every custom call on every execution): what that stage costs
           (also trivial_noinit, on request)
  jnp      a trivial jnp chain: one row of k and of v written with in-place dynamic_update_slice
           per call (XLA's own kernels in the same chain; q is summed as in the other forms)
Forms: "separate" (one cache pair per layer, q_out summed as attention would consume it),
"stacked" (one [L, ...] cache pair, lax.scan over layers unrolled, as cli/demo.py does) and
"return" (separate caches, every q_out/k_out returned as a fresh output buffer).
Custom-call cases run with JAX_ROPE_CACHE_COMMAND_BUFFERS=1 and =0 (read at lowering time, so
both run in one process). XLA's own command buffers are whatever XLA_FLAGS says (run again with
XLA_FLAGS=--xla_gpu_enable_command_buffer= for XLA without graphs; the flag is logged).

Per case: wall time per step (R reps of S back-to-back steps, median), marginal cost per call
(t(N) - t(1)) / (N - 1), launcher executes per step (0 = replayed from a CUDA graph), the
optimized HLO (command-buffer computations, which custom calls sit inside them, copies), and with
a jax.profiler trace of a few steps: GPU events per step (kernels, memcpy, memset), GPU busy
time and span per step, and the host events (XLA thunks, command-buffer updates) per step.
Prints a table last; writes OUT_DIR/decode_chain.json, decode_chain.log and the HLO texts.
--dry-run (or no GPU): tiny sizes on the CPU backend; the trivial kernel and the GPU lowering are
then checked by lowering for "cuda" without running.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import glob
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np

LOG = []
CUSTOM_CALLS = ("kernel", "trivial", "kernel_noinit", "trivial_noinit")
LOOP_STEPS = 8  # decode steps per execution in the "loop" form


def log(*a):
    s = " ".join(str(x) for x in a)
    LOG.append(s)
    print(s, flush=True)


# ---- the trivial kernel through the same launcher path ---------------------------------------------
# The launcher's ABI: one struct of 8-byte words (operand pointers, result pointers, dim0 of each
# operand). Thread 0 of block 0 stores one element of the first result (q_out), so the call has a
# visible effect; the counts come from the call's avals (the op's operand list may grow).
TRIVIAL_NAME = "jrc_trivial_kernel"
TRIVIAL_SRC = r"""
struct JrcWords { void* ptr[JRC_NIN + JRC_NOUT]; long long dim0[JRC_NIN]; };
extern "C" __global__ void jrc_trivial_kernel(const JrcWords p) {
  if (blockIdx.x == 0 && threadIdx.x == 0) *(unsigned short*)p.ptr[JRC_NIN] = 0;
}
"""


@functools.cache
def trivial_table(cc, n_in, n_out):
    from jax_rope_cache.backends import launcher
    from jax_rope_cache.compilers import nvrtc

    arch = cc if cc is not None else 90
    opts = ["--std=c++17", "--device-as-default-execution-space", f"-DJRC_NIN={n_in}", f"-DJRC_NOUT={n_out}"]
    cub = nvrtc.compile_cuda(TRIVIAL_SRC, arch=f"sm_{arch}", options=opts, headers={}, name="trivial.cu")
    ptx = nvrtc.compile_cuda(TRIVIAL_SRC, arch=f"compute_{arch}", options=opts, headers={}, name="trivial.cu")
    return launcher.pack_code_table([(launcher.KIND_CUBIN, f"sm_{arch}", cub.code),
                                     (launcher.KIND_PTX, f"compute_{arch}", ptx.code)])


NOINIT_TARGET = "jax_rope_cache_diag_noinit"


def noinit_target(cb: bool) -> str:
    """The launcher's stages minus initialize, registered under a diagnostic name: XLA then never
    calls into the launcher per execution (the buffer check and module load of initialize are
    skipped; execute finds the module an earlier case of the same code loaded)."""
    from jax_rope_cache.backends import launcher, native

    name = NOINIT_TARGET + ("" if cb else "_nograph")
    mod = launcher.launcher_module()
    native.register_target(
        name, lambda: {k: v for k, v in mod.gpu_handler("CUDA", cb).items() if k != "initialize"}, "CUDA",
        command_buffers=cb)
    return name


@contextlib.contextmanager
def swapped_lowering(code: str, noinit: bool):
    """backends.cuda.lower replaced for the diagnostic: code "trivial" embeds the one-store kernel
    with the op's launch geometry (kernel_config of the same spec), "kernel" the op's own code
    table; noinit lowers to the target without the initialize stage. The attributes, aliasing and
    signature are launcher.lower_launch's."""
    import jax
    import numpy as np_

    from jax_rope_cache import contract
    from jax_rope_cache.backends import cuda, launcher

    orig = cuda.lower

    def lower(ctx, args, spec):
        cc, sms = cuda._local_cuda_arch()
        cfg = cuda.kernel_config(spec, sms)
        if code == "trivial":
            table, name = trivial_table(cc, len(ctx.avals_in), len(ctx.avals_out)), TRIVIAL_NAME
        else:
            table, name = cuda.build_code_table(cfg, cc), cuda.KERNEL_NAME
        if not noinit:
            return launcher.lower_launch(ctx, args, table=table, kernel=name, grid_div=cfg.tokens_per_block,
                                         block=cfg.threads, grid_y=cfg.parts)
        launcher.register_gpu_targets(launcher.launcher_module())
        rule = jax.ffi.ffi_lowering(noinit_target(launcher.command_buffers_enabled()),
                                    operand_output_aliases=contract.CACHE_ALIASES)
        return rule(ctx, *launcher.fence_small_operands(args), code=table, code_hash=np_.int64(launcher.code_hash(table)),
                    kernel=name,
                    grid_div=np_.int64(cfg.tokens_per_block), grid_y=np_.int64(cfg.parts), block=np_.int64(cfg.threads),
                    smem=np_.int64(0),
                    signature=launcher.buffer_signature(ctx.avals_in, ctx.avals_out),
                    buffer_names=launcher.BUFFER_NAMES)

    cuda.lower = lower
    try:
        yield
    finally:
        cuda.lower = orig


GEOMETRY = set()


@contextlib.contextmanager
def record_geometry():
    """Notes (grid, block) of every CUDA lowering of the op (the launcher's grid = (ceil(T / grid_div),
    grid_y))."""
    from jax_rope_cache.backends import cuda

    inner = cuda.lower

    def lower(ctx, args, spec):
        cfg = cuda.kernel_config(spec, cuda._local_cuda_arch()[1])
        GEOMETRY.add(((-(-spec.num_tokens // cfg.tokens_per_block), cfg.parts), cfg.threads))
        return inner(ctx, args, spec)

    cuda.lower = lower
    try:
        yield
    finally:
        cuda.lower = inner


@contextlib.contextmanager
def command_buffers(on: bool):
    old = os.environ.get("JAX_ROPE_CACHE_COMMAND_BUFFERS")
    os.environ["JAX_ROPE_CACHE_COMMAND_BUFFERS"] = "1" if on else "0"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("JAX_ROPE_CACHE_COMMAND_BUFFERS", None)
        else:
            os.environ["JAX_ROPE_CACHE_COMMAND_BUFFERS"] = old


# ---- the chains -------------------------------------------------------------------------------------
def build_case(what, form, n, t, shape, nb, layers, seed=0):
    """(jitted step, initial args, donate index). The step returns (outputs, caches); caches are
    carried from step to step (donated)."""
    import jax
    import jax.numpy as jnp

    import jax_rope_cache as jrc

    qh, kh, d = shape
    bs = 16
    bf = jnp.bfloat16
    rng = np.random.default_rng(seed)
    key = jax.random.key(seed)
    kq, kk, kv = jax.random.split(key, 3)
    q = jax.random.normal(kq, (n, t, qh, d), jnp.float32).astype(bf)
    k = jax.random.normal(kk, (n, t, kh, d), jnp.float32).astype(bf)
    v = jax.random.normal(kv, (n, t, kh, d), jnp.float32).astype(bf)
    slots = jnp.asarray(rng.choice(nb * bs, t, replace=False).astype(np.int32))
    pos = jnp.asarray(rng.integers(0, 8192, t).astype(np.int32))
    cos, sin = jrc.rope_tables(8192, d, base=500000.0)
    cos, sin = jnp.asarray(cos), jnp.asarray(sin)
    impl = {"kernel": "kernel", "trivial": "kernel", "xla": "xla"}.get(what)

    def op(qi, ki, vi, kc, vc, layer=None):
        if what == "jnp":  # in-place row writes of k and v, nothing else
            blk, off = slots[0] // bs, slots[0] % bs  # token 0 only: one row of k and of v
            kr, vr = ki[:1][None], vi[:1][None]
            if layer is None:
                kc = jax.lax.dynamic_update_slice(kc, kr, (blk, off, 0, 0))
                vc = jax.lax.dynamic_update_slice(vc, vr, (blk, off, 0, 0))
            else:
                kc = jax.lax.dynamic_update_slice(kc, kr[None], (layer, blk, off, 0, 0))
                vc = jax.lax.dynamic_update_slice(vc, vr[None], (layer, blk, off, 0, 0))
            return qi, ki, kc, vc
        return jrc.rope_and_cache(qi, ki, vi, kc, vc, slots, pos, cos, sin, impl=impl, layer=layer)

    if form in ("stacked", "loop"):
        caches = jrc.make_kv_cache(nb, bs, kh, d, bf, num_layers=layers, fill="random", seed=seed)

        def layers_step(q, k, v, kc, vc, acc):
            def layer_fn(carry, xs):
                kc, vc, acc = carry
                qi, ki, vi, i = xs
                qo, _, kc, vc = op(qi, ki, vi, kc, vc, layer=i)
                return (kc, vc, acc + jnp.sum(qo, dtype=jnp.float32)), None
            (kc, vc, acc), _ = jax.lax.scan(layer_fn, (kc, vc, acc), (q, k, v, jnp.arange(n)), unroll=True)
            return kc, vc, acc

        def step(q, k, v, caches):
            if form == "stacked":
                kc, vc, acc = layers_step(q, k, v, caches[0], caches[1], jnp.float32(0))
            else:  # the demo's decode: LOOP_STEPS decode steps in one executable (a device-side loop)
                kc, vc, acc = jax.lax.fori_loop(0, LOOP_STEPS, lambda _, c: layers_step(q, k, v, *c),
                                                (caches[0], caches[1], jnp.float32(0)))
            return acc, (kc, vc)
    else:
        caches = [jrc.make_kv_cache(nb, bs, kh, d, bf, fill="random", seed=seed + i) for i in range(n)]
        qs, ks, vs = [q[i] for i in range(n)], [k[i] for i in range(n)], [v[i] for i in range(n)]
        q, k, v = qs, ks, vs

        def step(q, k, v, caches):
            outs, new, acc = [], [], jnp.float32(0)
            for i in range(n):
                qo, ko, kc, vc = op(q[i], k[i], v[i], caches[i][0], caches[i][1])
                new.append((kc, vc))
                if form == "return":
                    outs += [qo, ko]
                else:
                    acc = acc + jnp.sum(qo, dtype=jnp.float32)
            return (outs if form == "return" else acc), new

    return jax.jit(step, donate_argnums=(3,)), [q, k, v, caches]


# ---- HLO after optimizations ------------------------------------------------------------------------
def hlo_summary(text):
    """Command-buffer computations and what they hold; custom calls and copies outside them."""
    comps, cur, name = {}, None, None
    for ln in text.splitlines():
        m = re.match(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$", ln)
        if m and not ln.startswith(" "):
            name, cur = ("ENTRY" if m.group(1) else m.group(2)), []
            comps[name] = cur
            continue
        if ln.startswith("}"):
            cur = None
            continue
        if cur is not None:
            cur.append(ln)

    def count(lines, pat):
        return sum(1 for x in lines if re.search(pat, x))

    cc_pat = r"custom-call\("
    cb = {k: v for k, v in comps.items() if "command_buffer" in k}
    entry = comps.get("ENTRY", [])
    targets = collections.Counter(re.findall(r'custom_call_target="([^"]+)"', text))
    in_cb_targets = collections.Counter()
    for lines in cb.values():
        for x in lines:
            mm = re.search(r'custom_call_target="([^"]+)"', x)
            if mm:
                in_cb_targets[mm.group(1)] += 1
    return dict(
        computations=len(comps),
        command_buffers=len(cb),
        command_buffer_calls_in_entry=count(entry, r"command_buffer"),
        custom_call_targets=dict(targets),
        custom_calls_in_command_buffers=dict(in_cb_targets),
        entry_custom_calls=count(entry, cc_pat),
        entry_fusions=count(entry, r"\sfusion\("),
        copies=count(text.splitlines(), r"\scopy(-start)?\("),
        fusions_total=count(text.splitlines(), r"\sfusion\("),
        dynamic_update_slices=count(text.splitlines(), r"dynamic-update-slice\("),
    )


# ---- timing -----------------------------------------------------------------------------------------
def launches():
    from jax_rope_cache.backends import launcher

    m = launcher.launcher_module()
    return m.gpu_launch_count() if m is not None else 0


class Runner:
    def __init__(self, compiled, args):
        self.f, self.a = compiled, args

    def step(self):
        out, caches = self.f(*self.a[:3], self.a[3])
        self.a[3] = caches
        return out

    def block(self, out):
        import jax

        jax.block_until_ready((out, self.a[3]))


def time_steps(r, reps, steps):
    for _ in range(3):
        r.block(r.step())
    per = []
    l0 = launches()
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(steps):
            out = r.step()
        r.block(out)
        per.append((time.perf_counter() - t0) / steps)
    return statistics.median(per), (launches() - l0) / (reps * steps), per


def trace_steps(r, steps, workdir):
    """Profiler trace of `steps` steps: per-step GPU events and host events."""
    import jax

    d = tempfile.mkdtemp(dir=workdir)
    r.block(r.step())
    jax.profiler.start_trace(d)
    for _ in range(steps):
        out = r.step()
    r.block(out)
    jax.profiler.stop_trace()
    files = glob.glob(os.path.join(d, "**", "*.xplane.pb"), recursive=True)
    res = dict(trace_files=len(files))
    if not files:
        return res
    pd = jax.profiler.ProfileData.from_file(files[0])
    dev, host = [], collections.defaultdict(lambda: [0, 0.0])
    grid_block = collections.Counter()
    for plane in pd.planes:
        if plane.name.startswith("/device:GPU"):
            for ln in plane.lines:
                if "stream" not in ln.name.lower():
                    continue
                for ev in ln.events:
                    dev.append((float(ev.start_ns), float(ev.duration_ns), ev.name))
                    if "rope" in ev.name or "trivial" in ev.name:
                        try:
                            st = dict(ev.stats)
                            kd = st.get("kernel_details")
                            if kd:
                                grid_block[str(kd)[:120]] += 1
                        except Exception:  # noqa: BLE001 - stats are optional evidence
                            pass
        elif plane.name.startswith("/host:CPU"):
            for ln in plane.lines:
                for ev in ln.events:
                    nm = re.sub(r"[.:]\d+", "", ev.name)[:70]
                    try:  # XLA's per-op host events carry the HLO op's name
                        if any(k == "hlo_op" for k, _ in ev.stats):
                            nm = "op:" + nm
                    except Exception:  # noqa: BLE001
                        pass
                    host[nm][0] += 1
                    host[nm][1] += float(ev.duration_ns)
    dev.sort()
    kinds = collections.Counter()
    names = collections.Counter()
    name_ns = collections.Counter()  # GPU time by event name
    for _, dur, nm in dev:
        lo = nm.lower()
        kinds["memcpy" if "memcpy" in lo else "memset" if "memset" in lo else "kernel"] += 1
        names[nm[:60]] += 1
        name_ns[nm[:60]] += dur
    busy = sum(e[1] for e in dev) / steps / 1e3
    res.update(timeline(dev, steps))
    span = (dev[-1][0] + dev[-1][1] - dev[0][0]) / steps / 1e3 if dev else 0.0
    res.update(idle_gaps(dev, steps))
    keys = ("custom", "command", "commandbuffer", "record", "update", "thunk", "initialize", "execute", "launch",
            "graph", "ffi")
    host_rows = sorted(((nm, c / steps, tot / steps / 1e3) for nm, (c, tot) in host.items()
                        if nm.startswith("op:") or any(k in nm.lower() for k in keys)), key=lambda x: -x[2])[:25]
    res.update(gpu_events_per_step=len(dev) / steps, kinds_per_step={k: v / steps for k, v in kinds.items()},
               gpu_busy_us_per_step=busy, gpu_span_us_per_step=span,
               top_gpu_events={k: v / steps for k, v in names.most_common(8)},
               gpu_us_by_name={k: [round(names[k] / steps, 2), round(v / steps / 1e3, 3)]
                               for k, v in name_ns.most_common()},
               kernel_details=dict(grid_block.most_common(3)),
               host_events=[dict(name=a, per_step=round(b, 2), us_per_step=round(c, 2)) for a, b, c in host_rows])
    shutil.rmtree(d, ignore_errors=True)
    return res


def idle_gaps(dev, steps):
    """GPU idle time between consecutive events (sorted (start_ns, duration_ns, name)), gaps capped at
    CLUSTER_GAP_NS: the median gap, the sum per step, and the gaps before / after each event of our
    kernel."""
    gaps = [dev[i + 1][0] - dev[i][0] - dev[i][1] for i in range(len(dev) - 1)]
    ours = [i for i, e in enumerate(dev) if "rope" in e[2] or "mla_cache" in e[2]]
    around = {"before": [gaps[i - 1] for i in ours if i > 0], "after": [gaps[i] for i in ours if i < len(gaps)]}
    capped = lambda v: float(np.sum(np.minimum(v, CLUSTER_GAP_NS)) / steps / 1e3)  # noqa: E731
    return dict(gap_median_us=float(np.median(gaps) / 1e3) if gaps else None,
                gap_sum_us_per_step=capped(gaps) if gaps else 0.0,
                our_gap_us={k: dict(median=float(np.median(v) / 1e3), per_step=capped(v))
                            for k, v in around.items() if v})


CLUSTER_GAP_NS = 20e3  # a GPU gap longer than this separates two executions (graph launches)


def timeline(dev, steps):
    """Executions seen on the GPU: events split where the GPU idles > CLUSTER_GAP_NS. Per execution
    the span (first start to last end) and busy time; span - busy is idle INSIDE an execution (a
    command buffer's own gaps), the rest of the step is host time between executions. Also the
    profiler's duration of our kernel (device time per call) and of XLA's kernels."""
    if not dev:
        return {}
    clusters, cur = [], [dev[0]]
    for e in dev[1:]:
        if e[0] - (cur[-1][0] + cur[-1][1]) > CLUSTER_GAP_NS:
            clusters.append(cur)
            cur = []
        cur.append(e)
    clusters.append(cur)
    spans = [(c[-1][0] + c[-1][1] - c[0][0]) / 1e3 for c in clusters]
    busys = [sum(e[1] for e in c) / 1e3 for c in clusters]
    ours = [e[1] / 1e3 for e in dev if "rope_cache_" in e[2] or "trivial" in e[2]]
    theirs = [e[1] / 1e3 for e in dev if not ("rope_cache_" in e[2] or "trivial" in e[2])]
    inner = [dev[i + 1][0] - dev[i][0] - dev[i][1] for i in range(len(dev) - 1)
             if dev[i + 1][0] - dev[i][0] - dev[i][1] <= CLUSTER_GAP_NS]
    med = lambda x: float(np.median(x)) if x else None  # noqa: E731
    return dict(executions=len(clusters), exec_span_us=med(spans), exec_busy_us=med(busys),
                exec_idle_us=med([a - b for a, b in zip(spans, busys)]), our_kernel_us=med(ours),
                our_kernels_per_step=len(ours) / steps, xla_kernel_us=med(theirs),
                inner_gap_us=med([g / 1e3 for g in inner]))


# ---- one case ---------------------------------------------------------------------------------------
def run_case(what, form, n, t, cb, a, cfg, workdir, on_gpu):
    import jax

    ctx = contextlib.ExitStack()
    custom = what in CUSTOM_CALLS
    if custom:
        ctx.enter_context(command_buffers(cb))
    if what != "kernel" and custom:
        ctx.enter_context(swapped_lowering("trivial" if what.startswith("trivial") else "kernel",
                                           what.endswith("_noinit")))
    if custom:
        ctx.enter_context(record_geometry())
        GEOMETRY.clear()
    rec = dict(what=what, form=form, n=n, T=t, cmdbuf=(cb if custom else None))
    with ctx:
        f, args = build_case(what, form, n, t, cfg["shape"], cfg["nb"], cfg["layers"])
        t0 = time.perf_counter()
        lowered = f.lower(*args)
        if what != "kernel" and custom and not on_gpu:  # checked by lowering for CUDA only
            text = f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
            rec["cuda_lowering_has_trivial"] = TRIVIAL_NAME in text
            rec["cuda_targets"] = sorted(set(re.findall(r"jax_rope_cache_\w*gpu\w*|jax_rope_cache_diag\w*", text)))
            rec["grid_block"] = sorted(GEOMETRY)
            return rec
        if what == "kernel" and not on_gpu:
            text = f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
            rec["cuda_targets"] = sorted(set(re.findall(r"jax_rope_cache_gpu\w*", text)))
        compiled = lowered.compile()
    if custom:
        rec["grid_block"] = sorted(GEOMETRY)
    rec["compile_s"] = round(time.perf_counter() - t0, 2)
    hlo = compiled.as_text() or ""
    tag = f"{what}_{form}_n{n}_T{t}" + ("" if rec["cmdbuf"] is None else f"_cb{int(cb)}")
    with open(os.path.join(a.out_dir, "hlo", tag + ".txt"), "w") as fh:
        fh.write(hlo)
    rec["hlo"] = hlo_summary(hlo)
    r = Runner(compiled, args)
    med, lps, per = time_steps(r, a.reps, a.steps)
    rec.update(step_us=med * 1e6, step_us_reps=[round(x * 1e6, 2) for x in per], launches_per_step=lps)
    if a.trace and n == a.chain and t in a.trace_t:
        try:
            rec["trace"] = trace_steps(r, a.trace_steps, workdir)
        except Exception as e:  # noqa: BLE001 - the timing stands without the trace
            rec["trace"] = dict(error=f"{type(e).__name__}: {e}"[:300])
    del r, compiled, args
    return rec


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out_dir")
    ap.add_argument("--dry-run", action="store_true", help="tiny sizes on the CPU backend")
    ap.add_argument("--tokens", default=None, help="T values (default 1,64,256; dry run 1,8)")
    ap.add_argument("--chain", type=int, default=None, help="calls per step (default 32; dry run 4)")
    ap.add_argument("--what", default="kernel,trivial,xla,jnp,kernel_noinit",
                    help="also: trivial_noinit (the _noinit ones run in --noinit-forms only); a name may repeat "
                         "(interleaved A/B: every run is a row of the log and of the json's cases)")
    ap.add_argument("--forms", default="separate,stacked,return", help="also: loop (the demo's fori_loop of "
                    f"{LOOP_STEPS} decode steps of stacked layers per execution)")
    ap.add_argument("--our-command-buffers", default="on,off", help="JAX_ROPE_CACHE_COMMAND_BUFFERS settings run")
    ap.add_argument("--noinit-forms", default="separate", help="forms the _noinit cases run in")
    ap.add_argument("--extra-forms-tokens", default="64",
                    help="T values at which the forms other than 'separate' run (default 64; 'all')")
    ap.add_argument("--trace-tokens", default="64", help="T values traced with the profiler (default 64; 'all')")
    ap.add_argument("--reps", type=int, default=None, help="repetitions (median; default 15)")
    ap.add_argument("--steps", type=int, default=None, help="steps per repetition (default 20)")
    ap.add_argument("--no-trace", dest="trace", action="store_false", help="skip the profiler traces")
    ap.add_argument("--trace-steps", type=int, default=5)
    ap.add_argument("--num-blocks", type=int, default=None, help="cache blocks per layer (default 1024)")
    ap.add_argument("--budget-s", type=float, default=140.0, help="stop starting new cases after this")
    a = ap.parse_args(argv)
    if a.dry_run:
        os.environ["JAX_PLATFORMS"] = "cpu"
    import jax

    on_gpu = not a.dry_run and jax.default_backend() == "gpu"
    if not on_gpu and not a.dry_run:
        log(f"no GPU backend ({jax.default_backend()}): running as --dry-run")
        a.dry_run = True
    small = a.dry_run
    a.chain = a.chain or (4 if small else 32)
    a.reps = a.reps or (3 if small else 15)
    a.steps = a.steps or (2 if small else 20)
    tokens = [int(x) for x in (a.tokens or ("8,1" if small else "64,1,256")).split(",")]

    def subset(spec):
        return set(tokens) if spec == "all" else {int(x) for x in spec.split(",")} if spec else set()
    extra_t, a.trace_t = subset(a.extra_forms_tokens), subset(a.trace_tokens)
    if small:
        extra_t, a.trace_t = set(tokens), set(tokens)
    cfg = dict(shape=(8, 2, 64) if small else (32, 8, 128), nb=a.num_blocks or (64 if small else 1024))
    cfg["layers"] = a.chain
    os.makedirs(os.path.join(a.out_dir, "hlo"), exist_ok=True)
    workdir = tempfile.mkdtemp(prefix="decode_chain_")
    dev = jax.devices()[0]
    meta = dict(device=getattr(dev, "device_kind", str(dev)), platform=dev.platform, jax=jax.__version__,
                xla_flags=os.environ.get("XLA_FLAGS", ""), chain=a.chain, tokens=tokens, shape=cfg["shape"],
                num_blocks=cfg["nb"], reps=a.reps, steps=a.steps, dry_run=a.dry_run)
    log("decode_chain:", json.dumps(meta))
    whats = a.what.split(",")
    our_cb = tuple({"on": True, "off": False}[x] for x in a.our_command_buffers.split(","))
    forms = a.forms.split(",")
    t_start = time.time()
    rows = []
    for t in tokens:
        for form in forms:
            for what in whats:
                if (form != "separate" and t not in extra_t) or (what == "jnp" and form == "return"):
                    continue
                if what.endswith("_noinit") and form not in a.noinit_forms.split(","):
                    continue
                for cb in (our_cb if what in CUSTOM_CALLS else (True,)):
                    for n in (1, a.chain):
                        if time.time() - t_start > a.budget_s:
                            log(f"budget: skipped {what} {form} n={n} T={t} cb={cb}")
                            continue
                        try:
                            rec = run_case(what, form, n, t, cb, a, cfg, workdir, on_gpu)
                        except Exception as e:  # noqa: BLE001 - one failing case must not hide the rest
                            rec = dict(what=what, form=form, n=n, T=t, cmdbuf=cb, error=f"{type(e).__name__}: {e}"[:400])
                        rows.append(rec)
                        log(json.dumps(rec, default=str))
    # marginal cost per call
    by = {(r["what"], r["form"], r["T"], r.get("cmdbuf"), r["n"]): r for r in rows}
    table = []
    for (what, form, t, cb, n), r in by.items():
        if n != a.chain:
            continue
        r1 = by.get((what, form, t, cb, 1))
        row = dict(what=what, form=form, T=t, cmdbuf=cb, step_us=r.get("step_us"),
                   step1_us=r1.get("step_us") if r1 else None, launches=r.get("launches_per_step"))
        if row["step_us"] is not None and row["step1_us"] is not None:
            per_exec = LOOP_STEPS if form == "loop" else 1  # calls of one layer per execution
            row["marginal_us"] = (row["step_us"] - row["step1_us"]) / (a.chain - 1) / per_exec
        h = r.get("hlo") or {}
        row["geom"] = " ".join(f"{g}x{b}" for g, b in r.get("grid_block") or ())
        row.update(cbufs=h.get("command_buffers"), entry_cc=h.get("entry_custom_calls"), copies=h.get("copies"))
        tr = r.get("trace") or {}
        cc_host = [h["us_per_step"] for h in tr.get("host_events") or ()
                   if h["name"].startswith("op:") and ("rope" in h["name"] or "custom" in h["name"])]
        row.update(gpu_ev=tr.get("gpu_events_per_step"), busy=tr.get("gpu_busy_us_per_step"),
                   cc_host_us=sum(cc_host) / n if cc_host else None,
                   memops=sum(v for k, v in (tr.get("kinds_per_step") or {}).items() if k != "kernel"),
                   execs=tr.get("executions"), span=tr.get("exec_span_us"), idle=tr.get("exec_idle_us"),
                   our_us=tr.get("our_kernel_us"), xla_us=tr.get("xla_kernel_us"))
        if r.get("error"):
            row["error"] = r["error"]
        elif "cuda_lowering_has_trivial" in r:
            has = "embeds the trivial kernel" if r["cuda_lowering_has_trivial"] else "embeds the op's kernel"
            row["error"] = f"not run here; CUDA lowering {has}, {r['cuda_targets']}"
        table.append(row)
    with open(os.path.join(a.out_dir, "decode_chain.json"), "w") as fh:
        json.dump(dict(meta=meta, cases=rows, table=table), fh, indent=1, default=str)
    shutil.rmtree(workdir, ignore_errors=True)

    def f(x, w=8, p=1):
        return f"{x:{w}.{p}f}" if isinstance(x, (int, float)) and x is not None else f"{'-':>{w}}"

    for r in rows:  # where the host time goes, for the traced cases
        for h in ((r.get("trace") or {}).get("host_events") or [])[:8]:
            log(f"host {r['what']} {r['form']} n={r['n']} T={r['T']} cb={r.get('cmdbuf')}: {h}")
    log("\nper step = median over reps of (S back-to-back steps)/S; marginal = (t(N) - t(1)) / (N - 1); "
        f"N = {a.chain}; launches = launcher executes per step (0: replayed graph); cbufs = command-buffer "
        "computations in the optimized HLO; entry cc = custom calls outside them; GPU ev / busy / mem ops per "
        "step from the profiler trace; cc host = host time per call in XLA's op events of the custom call; "
        "span / idle = one execution's GPU span and its idle time inside (median; the rest of a step is host "
        "time between executions); ours / xla us = profiler duration of our kernel / XLA's kernels (median); "
        "grid x block = the launch of the op's configuration (the trivial kernel uses the same); "
        "XLA_FLAGS=" + repr(meta["xla_flags"]))
    log(f"{'what':14s} {'form':9s} {'T':>4s} {'ourCB':>5s} {'step us':>8s} {'1-call':>8s} {'marg us':>8s} "
        f"{'launch':>6s} {'cbufs':>5s} {'entrycc':>7s} {'copies':>6s} {'GPU ev':>6s} {'busy us':>8s} {'memops':>6s} "
        f"{'cc host':>7s} {'span us':>8s} {'idle us':>8s} {'ours us':>7s} {'xla us':>7s} {'grid x block':>9s}")
    for row in table:
        cb = "-" if row["cmdbuf"] is None else ("on" if row["cmdbuf"] else "off")
        log(f"{row['what']:14s} {row['form']:9s} {row['T']:4d} {cb:>5s} {f(row['step_us'])} {f(row['step1_us'])} "
            f"{f(row.get('marginal_us'), 8, 2)} {f(row['launches'], 6)} {f(row['cbufs'], 5, 0)} "
            f"{f(row['entry_cc'], 7, 0)} {f(row['copies'], 6, 0)} {f(row['gpu_ev'], 6)} {f(row['busy'])} "
            f"{f(row['memops'], 6)} {f(row.get('cc_host_us'), 7, 2)} {f(row.get('span'))} {f(row.get('idle'))} "
            f"{f(row.get('our_us'), 7, 2)} {f(row.get('xla_us'), 7, 2)} {row['geom']:>9s}"
            + (f"  {row['error'][:90]}" if row.get("error") else ""))
    with open(os.path.join(a.out_dir, "decode_chain.log"), "w") as fh:
        fh.write("\n".join(LOG) + "\n")
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
