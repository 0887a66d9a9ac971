"""The TPU hardware check behind scripts/tpu_check.sh: writes ONE report file.

    python benchmarks/tpu_check.py --report tpu_check_report.md [--dry-run]

On a TPU host: the environment (jax, jaxlib, libtpu, devices), the TPU kernel tests
(tests/test_tpu_kernel.py, full tier) on the TPU, a decode loop (stacked layers, caches donated,
checked bit for bit against the numpy reference every step), and the kernel next to the XLA path
(Llama-3.1-8B 32/8/128 and Llama-3.1-70B TP8 8/1/128, bf16; T = 1 and 64 on scattered slots,
8192 on a prefill's consecutive slots and on scattered ones; the "flash" layout and the
ragged-paged-attention layout "kv_merged").
Without a TPU: the environment and the words "No TPU found", exit 0.
--dry-run: the decode loop and the timing with small shapes on this machine's default device and
its kernel (CI checks the report's code path this way), no tests.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import os
import platform as host_platform
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_rope_cache as jrc
from jax_rope_cache import reference
from jax_rope_cache.backends import tpu

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELS = (("llama-3.1-8b", 32, 8, 128), ("llama-3.1-70b TP8", 8, 1, 128))
CASES = ((1, "scattered"), (64, "scattered"), (8192, "prefill"), (8192, "scattered"))
DRY_MODELS = (("small", 4, 2, 64),)
DRY_CASES = ((1, "scattered"), (24, "prefill"))


def tpu_devices() -> list:
    try:
        return list(jax.devices("tpu"))
    except RuntimeError:
        return []


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def environment() -> dict:
    devs = jax.devices()
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "host": f"{host_platform.node()} ({host_platform.platform()})",
        "python": sys.version.split()[0],
        "jax": jax.__version__, "jaxlib": _version("jaxlib"), "libtpu": _version("libtpu"),
        "jax_rope_cache": jrc.__version__,
        "default backend": jax.default_backend(),
        "devices": ", ".join(f"{d.platform}:{d.id} {d.device_kind}" for d in devs[:8]) + (" ..." if len(devs) > 8 else ""),
        "TPU kernel": "usable" if tpu.missing() is None else f"not usable: needs {tpu.missing()}",
        "TPU kernel layouts": ", ".join(tpu.layouts()),
    }


def run_tests() -> tuple[bool, str]:
    """tests/test_tpu_kernel.py (full tier) in a child process on this host's TPU."""
    env = dict(os.environ, JRC_TEST_TIER="full")
    r = subprocess.run([sys.executable, "-m", "pytest", "tests/test_tpu_kernel.py", "-q", "-p", "no:xdist", "-ra"],
                       capture_output=True, text=True, timeout=3600, env=env, cwd=ROOT)
    lines = r.stdout.strip().splitlines()
    summary = [x for x in lines if x.startswith(("FAILED", "ERROR", "SKIPPED"))][:40] + lines[-1:]
    return r.returncode == 0, "\n".join(summary)


def _problem(t, qh, kh, d, pattern, *, nb, bs=16, layers=None, seed=0, layout="flash"):
    rng = np.random.default_rng(seed)
    bf = jnp.bfloat16
    q, k, v = (rng.standard_normal((t, h, d), np.float32).astype(bf) for h in (qh, kh, kh))
    if pattern == "prefill":
        slots = (np.arange(t) + bs * 3 + 5) % (nb * bs)
    else:
        slots = rng.permutation(nb * bs)[:t]
    pos = rng.integers(0, 8192, t) if pattern == "scattered" else np.arange(t) + 17
    cos, sin = jrc.rope_tables(8192 + t + 17, d, base=500000.0)
    kc, vc = jrc.make_kv_cache(nb, bs, kh, d, bf, layout=layout, num_layers=layers, fill="random", seed=seed)
    return q, k, v, kc, vc, slots.astype(np.int32), pos.astype(np.int32), cos, sin


def decode_loop(device, steps: int = 16, layers: int = 4, shape=(16, 4, 128)) -> tuple[bool, str]:
    """`steps` decode steps over `layers` stacked layers in one jit (lax.fori_loop over the layers,
    caches donated and carried), impl="kernel" on `device`, each step compared bit for bit with
    the reference (all layers' caches)."""
    qh, kh, d = shape
    t, nb, bs = 8, 64, 16
    q, k, v, kc, vc, _, _, cos, sin = _problem(t, qh, kh, d, "scattered", nb=nb, layers=layers)

    @jax.jit
    def one_step(q, k, v, kc, vc, slots, pos, cos, sin):
        def layer(i, carry):
            kc, vc, _ = carry
            qo, _, kc, vc = jrc.rope_and_cache(q, k, v, kc, vc, slots, pos, cos, sin, layer=i, impl="kernel")
            return kc, vc, qo
        return jax.lax.fori_loop(0, layers, layer, (kc, vc, jnp.zeros_like(q)))

    step = jax.jit(one_step, donate_argnums=(3, 4))
    rng = np.random.default_rng(1)
    ref_k, ref_v = np.asarray(kc), np.asarray(vc)
    kc, vc = jax.device_put((kc, vc), device)
    table = rng.permutation(nb)[: t * 4].reshape(t, 4)
    pos = rng.integers(0, 40, t)
    for _ in range(steps):
        slots = (table[np.arange(t), pos // bs] * bs + pos % bs).astype(np.int32)
        q, k, v = (rng.standard_normal((t, h, d), np.float32).astype(jnp.bfloat16) for h in (qh, kh, kh))
        kc, vc, qo = step(*jax.device_put((q, k, v), device), kc, vc, *jax.device_put((slots, pos.astype(np.int32)), device),
                          cos, sin)
        for i in range(layers):
            want = reference.rope_and_cache(q, k, v, ref_k, ref_v, slots, pos, cos, sin, layer=i)
            ref_k, ref_v = want[2], want[3]
        same = [np.array_equal(np.asarray(g).view(np.uint16), w.view(np.uint16))
                for g, w in ((qo, want[0]), (kc, ref_k), (vc, ref_v))]
        if not all(same):
            return False, f"step {_}: q_out/key_cache/value_cache bit-exact: {same}"
        pos = pos + 1
    return True, f"{steps} steps x {layers} layers, T={t}, heads {qh}/{kh}/{d}: q_out and every layer's caches bit-exact"


def time_op(device, impl, t, qh, kh, d, pattern, layout, steps) -> float:
    """Seconds per call: `steps` calls in one jit (lax.fori_loop, caches carried and donated)."""
    nb = max(64, -(-2 * t // 16))
    q, k, v, kc, vc, slots, pos, cos, sin = _problem(t, qh, kh, d, pattern, nb=nb, layout=layout)

    def loop(q, k, v, kc, vc, slots, pos, cos, sin):
        def body(_, carry):
            kc, vc = carry
            return tuple(jrc.rope_and_cache(q, k, v, kc, vc, slots, pos, cos, sin, layout=layout, impl=impl)[2:])
        return jax.lax.fori_loop(0, steps, body, (kc, vc))

    run = jax.jit(loop, donate_argnums=(3, 4))
    args = jax.device_put((q, k, v, kc, vc, slots, pos, cos, sin), device)
    kc, vc = jax.block_until_ready(run(*args))  # compile and warm up
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        kc, vc = jax.block_until_ready(run(*args[:3], kc, vc, *args[5:]))
        times.append(time.perf_counter() - t0)
    return float(np.median(times)) / steps


def timing(device, models=MODELS, cases=CASES) -> list[dict]:
    layouts = ["flash", "kv_merged"]  # kv_merged: the layout of JAX's ragged paged attention
    rows = []
    for name, qh, kh, d in models:
        for t, pattern in cases:
            for layout in layouts:
                row = dict(model=name, T=t, slots=pattern, layout=layout)
                for impl in ("kernel", "xla"):
                    try:
                        row[impl] = time_op(device, impl, t, qh, kh, d, pattern, layout, 100 if t <= 64 else 10)
                    except Exception as e:  # noqa: BLE001 - a refusal or failure goes into the report
                        row[impl] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
                rows.append(row)
    return rows


def _us(x) -> str:
    return f"{x * 1e6:.2f}" if isinstance(x, float) else str(x)


def report_text(env: dict, found: bool, tests=None, loop=None, rows=None, note: str = "") -> str:
    out = ["# jax_rope_cache TPU check", ""]
    if not found:
        out += ["No TPU found on this machine: nothing was run on a TPU.", ""]
    if note:
        out += [note, ""]
    out += ["## Environment", ""] + [f"- {k}: {v}" for k, v in env.items()] + [""]
    out += ["## Results", "", "| check | result |", "|---|---|"]
    out.append(f"| TPU | {'found' if found else 'NONE'} |")
    if tests is not None:
        out.append(f"| tests/test_tpu_kernel.py (full tier) | {'PASS' if tests[0] else 'FAIL'} |")
    if loop is not None:
        out.append(f"| decode loop, bit-exact | {'PASS' if loop[0] else 'FAIL'}: {loop[1]} |")
    out.append("")
    if tests is not None:
        out += ["## Tests", "", "```text", tests[1], "```", ""]
    if rows:
        out += ["## Kernel vs XLA path (us per call, median of 5 runs of a jitted loop)", "",
                "| model | T | slots | layout | kernel | XLA path | XLA / kernel |", "|---|---|---|---|---|---|---|"]
        for r in rows:
            ratio = f"{r['xla'] / r['kernel']:.2f}x" if all(isinstance(r[i], float) for i in ("kernel", "xla")) else "-"
            out.append(f"| {r['model']} | {r['T']} | {r['slots']} | {r['layout']} | {_us(r['kernel'])} | "
                       f"{_us(r['xla'])} | {ratio} |")
        out.append("")
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--report", default=os.path.join(ROOT, "tpu_check_report.md"))
    p.add_argument("--dry-run", action="store_true", help="small shapes on this machine's default device, no tests")
    a = p.parse_args(argv)
    env = environment()
    devs = tpu_devices()
    if a.dry_run:
        device = jax.devices()[0]
        loop = decode_loop(device, steps=3, layers=2, shape=(4, 2, 64))
        rows = timing(device, DRY_MODELS, DRY_CASES)
        text = report_text(env, bool(devs), loop=loop, rows=rows,
                           note=f"Dry run on {device.platform}: small shapes, no tests.")
        ok = loop[0]
    elif not devs:
        text, ok = report_text(env, False), True
        print("No TPU found on this machine: reporting the environment only")
    else:
        tests = run_tests()
        loop = decode_loop(devs[0])
        rows = timing(devs[0])
        text, ok = report_text(env, True, tests=tests, loop=loop, rows=rows), tests[0] and loop[0]
    with open(a.report, "w") as f:
        f.write(text)
    print(text)
    print(f"# report written to {a.report}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
