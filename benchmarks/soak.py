"""Soak: many decode steps of rope_and_cache in place, the cache verified against the reference.

    python benchmarks/soak.py                      # 100,000 steps on the default backend (CPU here)
    python benchmarks/soak.py --steps 1000000 --platform cuda

Each chunk of `--chunk` steps (default 1,000) is one call of a jitted `lax.fori_loop` that runs the
op once per step on a donated cache (B sequences, one token each per step; each sequence owns a
ring of slots, so a chunk writes every slot at most once). After every chunk the numpy reference
is applied to the same chunk of tokens (incrementally: the reference cache carries over from chunk
to chunk) and the whole device cache is compared with it: bit for bit for the native kernel, within
the FMA tolerance of tests/test_op.py for the XLA path. The last step's q_out is compared too.

Recorded per chunk: process RSS (VmRSS from /proc/self/status) and, on GPU platforms, the
launcher's counters of kernel launches and of loaded modules (jax_rope_cache._native.gpu_launch_count
and gpu_module_count; modules must stay flat: one per code object and device). Prints a table;
--json writes the records.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

import jax_rope_cache as jrc
from jax_rope_cache import backends, reference
from jax_rope_cache.backends import native


def rss_mib() -> float:
    """Resident set size of this process in MiB (VmRSS of /proc/self/status)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    return float("nan")


def gpu_counter(name: str) -> int | None:
    """The launcher's counter `name` ("gpu_launch_count" or "gpu_module_count"), None without it."""
    module = native.native_module()
    fn = getattr(module, name, None) if module is not None else None
    return int(fn()) if fn is not None else None


def jax_platform(device) -> str:
    """jax's platform name of `device`: "cpu", "cuda" or "rocm" (device.platform says "gpu" for both GPUs)."""
    for name in ("cuda", "rocm"):
        try:
            if device in jax.devices(name):
                return name
        except RuntimeError:
            pass
    return device.platform


class Soak:
    """The decode loop and its reference twin."""

    def __init__(self, *, batch=8, q_heads=8, kv_heads=2, head_dim=64, block_size=16, ring=1024,
                 layout="flash", dtype="bfloat16", max_pos=4096, chunk=1000, impl=None, platform=None, seed=0):
        if chunk > ring:
            raise ValueError(f"chunk ({chunk}) must not exceed the per-sequence ring ({ring} slots): "
                             "a chunk writes each slot at most once")
        self.b, self.qh, self.kh, self.d, self.bs = batch, q_heads, kv_heads, head_dim, block_size
        self.ring, self.layout, self.chunk, self.max_pos = ring, layout, chunk, max_pos
        self.dtype = np.dtype(getattr(ml_dtypes, dtype, None) or dtype)
        self.device = jax.devices(platform)[0] if platform else jax.devices()[0]
        self.platform = jax_platform(self.device)
        if impl is None:
            impl = "kernel" if self.platform in backends.kernel_platforms() else "xla"
        self.impl = impl
        self.rng = np.random.default_rng(seed)
        nb = batch * (-(-ring // block_size))
        kc, vc = jrc.make_kv_cache(nb, block_size, kv_heads, head_dim, self.dtype, layout=layout, fill="random",
                                   seed=seed)
        self.ref_kc, self.ref_vc = np.asarray(kc), np.asarray(vc)
        self.kc, self.vc = jax.device_put((kc, vc), self.device)
        ang = self.rng.uniform(-np.pi, np.pi, (max_pos, head_dim // 2))
        self.cos, self.sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
        self.dcos, self.dsin = jax.device_put((self.cos, self.sin), self.device)
        self.step = 0
        self.seconds = {}  # where the wall time goes: inputs, device (incl. dispatch), reference, check
        self._run = jax.jit(functools.partial(_run_chunk, layout=layout, impl=impl), donate_argnums=(0, 1))

    def _inputs(self, n):
        """Host inputs of steps [self.step, self.step + n): q/k/v [n, B, H, D], slots/positions [n, B]."""
        normal = lambda *s: self.rng.standard_normal(s, np.float32).astype(self.dtype)  # noqa: E731
        q, k, v = normal(n, self.b, self.qh, self.d), normal(n, self.b, self.kh, self.d), normal(n, self.b, self.kh, self.d)
        steps = self.step + np.arange(n)[:, None]
        seq = np.arange(self.b)[None, :]
        blocks_per_seq = -(-self.ring // self.bs)
        slots = (seq * blocks_per_seq * self.bs + steps % self.ring).astype(np.int32)
        pos = ((steps + 37 * seq) % self.max_pos).astype(np.int32)
        return q, k, v, slots, pos

    def run_chunk(self, n=None):
        """Runs n (default: chunk) steps on the device and on the reference; returns the check result."""
        n = n or self.chunk
        t = time.perf_counter()
        q, k, v, slots, pos = self._inputs(n)
        dev = jax.device_put((q, k, v, slots, pos), self.device)
        t = self._tick("inputs", t)
        self.kc, self.vc, q_last = self._run(self.kc, self.vc, *dev, self.dcos, self.dsin)
        jax.block_until_ready(self.vc)
        t = self._tick("device", t)
        flat = lambda a: a.reshape((n * self.b,) + a.shape[2:])  # noqa: E731
        rq, _, self.ref_kc, self.ref_vc = reference.rope_and_cache(
            flat(q), flat(k), flat(v), self.ref_kc, self.ref_vc, flat(slots), flat(pos), self.cos, self.sin,
            layout=self.layout)
        self.step += n
        t = self._tick("reference", t)
        result = self.check(np.asarray(q_last), rq[-self.b:], k)
        self._tick("check", t)
        return result

    def _tick(self, what, t0):
        """Adds the time since t0 to self.seconds[what]; returns now."""
        now = time.perf_counter()
        self.seconds[what] = self.seconds.get(what, 0.0) + now - t0
        return now

    def check(self, q_last, ref_q_last, k) -> str:
        got = [np.asarray(self.kc), np.asarray(self.vc), q_last]
        want = [self.ref_kc, self.ref_vc, ref_q_last]
        for name, g, w in zip(("key_cache", "value_cache", "q_out"), got, want):
            if self.impl == "kernel":
                same = g.view(np.uint8) == w.view(np.uint8)
                if not same.all():
                    return f"{name}: {int((~same).sum())} bytes differ"
            else:
                a, b = g.astype(np.float64), w.astype(np.float64)
                ulp = np.abs(a - b) / np.maximum(np.spacing(np.abs(b).astype(self.dtype)).astype(np.float64), 1e-45)
                bound = 2.0**-22 * 8.0  # 2 f32 ulps of inputs |x| < 8 (standard normal, 6+ sigma)
                bad = (ulp > 1) & (np.abs(a - b) > bound)
                if bad.any():
                    return f"{name}: {int(bad.sum())} elements beyond tolerance"
        return "ok"


def _run_chunk(kc, vc, q, k, v, slots, pos, cos, sin, *, layout, impl):
    def body(i, carry):
        kc, vc, _ = carry
        q_out, _, kc, vc = jrc.rope_and_cache(q[i], k[i], v[i], kc, vc, slots[i], pos[i], cos, sin,
                                              layout=layout, impl=impl)
        return kc, vc, q_out

    q0 = jnp.zeros(q.shape[1:], q.dtype)
    return jax.lax.fori_loop(0, q.shape[0], body, (kc, vc, q0))


def soak(steps=100_000, *, report_every=10, time_limit=None, out=sys.stdout, **kw):
    """Runs `steps` steps, or fewer if `time_limit` seconds pass first (checked after each chunk);
    returns the list of per-chunk records (dicts)."""
    s = Soak(**kw)
    records = []
    rss0 = rss_mib()
    t0 = time.perf_counter()
    print(f"# soak: {steps} steps, chunk {s.chunk}, {s.platform} impl={s.impl}, batch {s.b}, heads {s.qh}/{s.kh}, "
          f"D {s.d}, {s.layout} {s.dtype.name}, cache {2 * s.ref_kc.nbytes / 2**20:.1f} MiB; RSS at start "
          f"{rss0:.1f} MiB", file=out)
    header = (f"{'steps':>10} {'time s':>8} {'steps/s':>9} {'RSS MiB':>9} {'dRSS MiB':>9} {'launches':>9} "
              f"{'modules':>8}  check")
    print(header, file=out)
    done = 0
    while done < steps:
        n = min(s.chunk, steps - done)
        result = s.run_chunk(n)
        done += n
        gpu = s.platform != "cpu"
        launches = gpu_counter("gpu_launch_count") if gpu else None
        modules = gpu_counter("gpu_module_count") if gpu else None
        rec = dict(steps=done, seconds=time.perf_counter() - t0, rss_mib=rss_mib(), launches=launches,
                   modules=modules, check=result)
        records.append(rec)
        if result != "ok" or len(records) % report_every == 0 or done == steps or len(records) == 1:
            print(f"{done:>10} {rec['seconds']:>8.1f} {done / rec['seconds']:>9.0f} {rec['rss_mib']:>9.1f} "
                  f"{rec['rss_mib'] - records[0]['rss_mib']:>+9.1f} {'-' if launches is None else launches:>9} "
                  f"{'-' if modules is None else modules:>8}  {result}", file=out, flush=True)
        if result != "ok":
            break
        if time_limit is not None and rec["seconds"] > time_limit and done < steps:
            print(f"# time limit: stopped after {done} of {steps} steps", file=out, flush=True)
            break
    split = ", ".join(f"{k} {v:.1f} s" for k, v in s.seconds.items())
    print(f"# time split: {split}; device time per step {s.seconds.get('device', 0) / max(done, 1) * 1e6:.2f} us "
          f"(one fori_loop call per chunk, dispatch included)", file=out, flush=True)
    return records


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=100_000)
    p.add_argument("--chunk", type=int, default=1000, help="steps per jitted fori_loop call = check interval")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--layout", default="flash")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--impl", default=None, choices=[None, "kernel", "xla"])
    p.add_argument("--platform", default=None, help="cpu, cuda or rocm (default: jax's default backend)")
    p.add_argument("--report-every", type=int, default=10, help="print every N chunks")
    p.add_argument("--json", default=None, help="write the per-chunk records here")
    p.add_argument("--time-limit", type=float, default=None,
                   help="stop after the chunk that passes this many seconds (reported as not reaching --steps)")
    a = p.parse_args(argv)
    ring = max(1024, a.chunk)
    recs = soak(a.steps, chunk=a.chunk, batch=a.batch, layout=a.layout, dtype=a.dtype, impl=a.impl,
                platform=a.platform, ring=ring, report_every=a.report_every, time_limit=a.time_limit)
    checks_ok = all(r["check"] == "ok" for r in recs)
    modules = {r["modules"] for r in recs}
    if len(modules) > 1:  # a module loaded after the first chunk: the launcher leaks modules
        print(f"# loaded modules changed during the soak: {sorted(modules)}")
        checks_ok = False
    ok = checks_ok and recs[-1]["steps"] == a.steps
    first, last = recs[0], recs[-1]
    verdict = "PASS" if ok else ("TIME LIMIT (all checks ok)" if checks_ok else "FAIL")
    print(f"# {verdict}: {last['steps']} steps in {last['seconds']:.1f} s "
          f"({last['steps'] / last['seconds']:.0f} steps/s); RSS {first['rss_mib']:.1f} MiB after the first chunk, "
          f"{last['rss_mib']:.1f} MiB at the end ({last['rss_mib'] - first['rss_mib']:+.1f} MiB); "
          f"{len(recs)} cache checks")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(args=vars(a), records=recs), f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
