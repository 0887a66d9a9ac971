"""Timing shared by the JAX suites (qk_norm, mrope, mla, qkv): the run log, the options every suite
takes, the copy ceiling, and the device time of one jitted executable of N unrolled calls.

Device time = the GPU busy time of a few executions in a jax.profiler trace (sum of the events on
the GPU's stream lines) / (executions * calls); wall = median wall time of one execution / calls.
On the CPU (a dry run) only wall time exists. torch-launched kernels (AITER) are timed in
cuda_graph_timing.py, after every JAX measurement of a suite or in another process: torch's profiler
takes CUPTI, and a jax.profiler trace started after it in the same process records no GPU events.
measure() says which time it returns ("timing": device or wall) and why device time is missing.
"""
from __future__ import annotations

import glob
import os
import shutil
import statistics
import tempfile
import time

LOG = []


def log(*a):
    s = " ".join(str(x) for x in a)
    LOG.append(s)
    print(s, flush=True)


def write_log(path):
    with open(path, "w") as fh:
        fh.write("\n".join(LOG) + "\n")


def add_timing_args(ap, budget_s: float) -> None:
    """The timing options every suite of this harness shares."""
    ap.add_argument("--calls", type=int, default=None, help="calls per jit (default 16; dry run 2)")
    ap.add_argument("--reps", type=int, default=None, help="timed executions (median; default 5)")
    ap.add_argument("--trace-execs", type=int, default=3, help="executions in the profiler trace")
    ap.add_argument("--no-profile", dest="profile", action="store_false", help="wall time only")
    ap.add_argument("--budget-s", type=float, default=budget_s,
                    help=f"start no new case after this many seconds (default {budget_s:g})")


def start_run(a, *, dry_tokens: str, tokens: str) -> list[int]:
    """Before jax starts: a dry run is pinned to the CPU; without a GPU the run becomes a dry run.
    Fills the timing defaults in `a` and returns the token counts."""
    if a.dry_run:
        os.environ["JAX_PLATFORMS"] = "cpu"
    import jax

    if jax.default_backend() != "gpu" and not a.dry_run:
        log(f"no GPU backend ({jax.default_backend()}): running as --dry-run")
        a.dry_run = True
    a.calls = a.calls or (2 if a.dry_run else 16)
    a.reps = a.reps or (2 if a.dry_run else 5)
    a.t_start = time.time()
    return [int(x) for x in (a.tokens or (dry_tokens if a.dry_run else tokens)).split(",")]


def over_budget(a, what: str) -> bool:
    if time.time() - a.t_start > a.budget_s:
        log(f"budget ({a.budget_s:g} s): skipped {what}")
        return True
    return False


def copy_ceiling(n_bytes, reps=5):
    """Bytes read + written per second by a device copy of n_bytes (x + 1 on float32, in place)."""
    import jax
    import jax.numpy as jnp

    n = n_bytes // 4
    x = jax.random.normal(jax.random.key(0), (n,), jnp.float32)
    steps = 10
    f = jax.jit(lambda x: jax.lax.fori_loop(0, steps, lambda i, y: y + 1.0, x))
    jax.block_until_ready(f(x))
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(f(x))
        ts.append(time.perf_counter() - t0)
    return 2 * n * 4 * steps / statistics.median(ts)


def copy_chain(n_bytes: int, calls: int):
    """(run, the number of copies per execution): `calls` copies of an n_bytes/2 buffer in one jit,
    each reading and writing n_bytes/2 bytes (n_bytes moved), kept apart by optimization barriers so
    XLA cannot fuse them into one pass. Timed like an op: the same bytes at the copy's speed."""
    import jax
    import jax.numpy as jnp

    x = jax.random.normal(jax.random.key(1), (max(1, n_bytes // 8),), jnp.float32)

    def chain(y):
        for _ in range(calls):
            y = jax.lax.optimization_barrier(y + 1.0)
        return y

    f = jax.jit(chain)
    return lambda: f(x)


def device_us_per_call(run, n_exec, n_calls, workdir):
    """(GPU busy time per call, GPU events per call) from a profiler trace; (None, 0) without GPU events."""
    import jax

    d = tempfile.mkdtemp(dir=workdir)
    jax.profiler.start_trace(d)
    for _ in range(n_exec):
        out = run()
    jax.block_until_ready(out)
    jax.profiler.stop_trace()
    files = glob.glob(os.path.join(d, "**", "*.xplane.pb"), recursive=True)
    busy, events = 0.0, 0
    if files:
        pd = jax.profiler.ProfileData.from_file(files[0])
        for plane in pd.planes:
            if not plane.name.startswith("/device:GPU"):
                continue
            for ln in plane.lines:
                if "stream" not in ln.name.lower():
                    continue
                for ev in ln.events:
                    busy += float(ev.duration_ns)
                    events += 1
    shutil.rmtree(d, ignore_errors=True)
    if not events:
        return None, 0
    return busy / 1e3 / (n_exec * n_calls), events / (n_exec * n_calls)


def measure(run, a, workdir, calls=None) -> dict:
    """Time `run` (one execution of `calls` unrolled calls; it returns the outputs and carries its
    own caches): compile, one warm execution, a.reps timed ones, then the profiler's device time.
    Returns wall_us, compile_s and, on a GPU, device_us and gpu_events_per_call (per call)."""
    import jax

    calls = calls or a.calls
    t0 = time.perf_counter()
    jax.block_until_ready(run())
    compile_s = time.perf_counter() - t0
    jax.block_until_ready(run())
    ts = []
    for _ in range(a.reps):
        t0 = time.perf_counter()
        jax.block_until_ready(run())
        ts.append(time.perf_counter() - t0)
    rec = dict(wall_us=statistics.median(ts) / calls * 1e6, compile_s=round(compile_s, 2))
    if a.profile and not a.dry_run:
        try:
            rec["device_us"], rec["gpu_events_per_call"] = device_us_per_call(run, a.trace_execs, calls, workdir)
            if rec["device_us"] is None:  # e.g. CUPTI held by another profiler (torch's) in this process
                rec["trace_error"] = "the profile has no GPU events"
        except Exception as e:  # noqa: BLE001 - wall time still stands
            rec["trace_error"] = f"{type(e).__name__}: {e}"[:200]
    rec["time_us"] = rec.get("device_us") or rec["wall_us"]
    rec["timing"] = "device" if rec.get("device_us") else "wall"
    return rec


def wall_note(rec: dict, expect_device: bool) -> str:
    """"" where `rec` (measure's record) has the time asked for; else why its time is wall time: a
    table must not pass a wall time (host-bound for small calls) off as device time."""
    if not expect_device or rec.get("timing") != "wall":
        return ""
    return f"WALL time ({rec.get('trace_error', 'no device time')})"


def timed_row(rec: dict, run_factory, a, workdir, rows: list) -> dict:
    """rec updated with measure()'s record of run_factory() (or the error that kept it from running:
    the other variants go on), appended to rows and logged."""
    import json

    try:
        rec.update(measure(run_factory(), a, workdir))
    except Exception as e:  # noqa: BLE001 - keep the other variants
        rec["error"] = f"{type(e).__name__}: {e}"[:300]
    rows.append(rec)
    log(json.dumps(rec))
    return rec


def save_rows(a, name: str, meta: dict, rows: list) -> str:
    """Writes OUT_DIR/NAME.json ({meta, rows}); returns the table header's timing words."""
    import json

    with open(os.path.join(a.out_dir, f"{name}.json"), "w") as fh:
        json.dump(dict(meta=meta, rows=rows), fh, indent=1)
    return "device (profiler GPU busy per call)" if any(r.get("device_us") for r in rows) else "wall per call"


def fmt(x, w=9, p=2):
    return f"{x:{w}.{p}f}" if isinstance(x, (int, float)) else f"{'-':>{w}}"


def ratio(x, y):
    return x / y if x and y else None
