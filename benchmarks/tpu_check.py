"""The TPU hardware check behind scripts/tpu_check.sh: writes ONE report file.

    python benchmarks/tpu_check.py --report tpu_check_report.md [--dry-run]

On a TPU host: the environment (jax, jaxlib, libtpu, devices), the TPU kernel tests
(tests/test_tpu_kernel.py and tests/test_tpu_fp4.py, full tier) on the TPU, a decode loop (stacked
layers, caches donated, checked bit for bit against the numpy reference every step), one call of each
newer kernel option bit for bit against the reference (fp8 caches with static, per-head and per-token
scales, NVFP4 and MXFP4 caches with their block-scale caches, float16,
M-RoPE, the fused QKV input with q_gate rows: `feature_checks`), and the kernel next to the XLA path
(Llama-3.1-8B 32/8/128 and Llama-3.1-70B TP8 8/1/128, bf16; T = 1 and 64 on scattered slots,
8192 on a prefill's consecutive slots and on scattered ones; the "flash" layout and the
ragged-paged-attention layout "kv_merged"; for the 8B model also an fp8 cache with per-token
scales and the fused QKV input).
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
from jax_rope_cache import contract, reference
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
    """tests/test_tpu_kernel.py and tests/test_tpu_fp4.py (full tier) in a child process on this host's TPU."""
    env = dict(os.environ, JRC_TEST_TIER="full")
    r = subprocess.run([sys.executable, "-m", "pytest", "tests/test_tpu_kernel.py", "tests/test_tpu_fp4.py", "-q", "-p",
                        "no:xdist", "-ra"],
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


def _bits(a):
    a = np.asarray(a)
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


def feature_checks(device) -> list[tuple[str, bool, str]]:
    """One call of each newer option with impl="kernel" on `device`, every result compared bit for
    bit with the reference: (name, passed, detail)."""
    import ml_dtypes

    rng = np.random.default_rng(5)
    t, qh, kh, d, nb, bs, max_pos = 12, 4, 2, 128, 8, 16, 64
    bf, f16 = np.dtype(ml_dtypes.bfloat16), np.dtype(np.float16)
    e4, e5 = np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(ml_dtypes.float8_e5m2)

    def problem(dt=bf, cdt=None, layout="flash", tdt=np.float32, gate=False):
        q = rng.standard_normal((t, 2 * qh if gate else qh, d)).astype(np.float32).astype(dt)
        k, v = (rng.standard_normal((t, kh, d)).astype(np.float32).astype(dt) for _ in range(2))
        ks, vs = contract.cache_shapes(layout, nb, bs, kh, d, cdt or dt)
        kc = rng.standard_normal(ks).astype(np.float32).astype(cdt or dt)
        vc = None if vs is None else rng.standard_normal(vs).astype(np.float32).astype(cdt or dt)
        slots = rng.permutation(nb * bs)[:t].astype(np.int32)
        slots[::5] = -1
        pos = rng.integers(0, max_pos, t).astype(np.int32)
        ang = rng.uniform(-np.pi, np.pi, (max_pos, d // 2))
        return [q, k, v, kc, vc, slots, pos, np.cos(ang).astype(tdt), np.sin(ang).astype(tdt)]

    scale_cache = lambda layout: rng.uniform(0.1, 2, contract.scale_shape(layout, nb, bs, kh)).astype(np.float32)  # noqa: E731
    cases = []
    a = problem(cdt=e4)
    cases.append(("fp8 e4m3fn, static scales", a, dict(k_scale=np.float32(0.05), v_scale=np.float32(0.3))))
    a = problem(cdt=e5, layout="kv_merged")
    cases.append(("fp8 e5m2, per-head scales, kv_merged", a,
                  dict(layout="kv_merged", k_scale=np.float32([0.01, 0.2]), v_scale=np.float32([0.5, 0.003]))))
    a = problem(cdt=e4, layout="head_major")
    cases.append(("fp8 e4m3fn, per-token scales, head_major", a,
                  dict(layout="head_major", k_scale_cache=scale_cache("head_major"),
                       v_scale_cache=scale_cache("head_major"))))
    for fmt, layout in (("nvfp4", "head_major"), ("mxfp4", "flash")):
        a = problem(layout=layout)
        shapes = contract.cache_shapes(layout, nb, bs, kh, d, np.uint8)
        a[3], a[4] = (rng.integers(0, 256, sh).astype(np.uint8) for sh in shapes)
        sc = lambda: rng.integers(0, 0x7F, contract.block_scale_shape(layout, nb, bs, kh, d, fmt)).astype(  # noqa: E731
            np.uint8).view(contract.BLOCK_SCALE_DTYPE[fmt])
        kw = dict(layout=layout, k_scale_cache=sc(), v_scale_cache=sc())
        if fmt == "nvfp4":
            kw.update(k_scale=np.float32(0.004), v_scale=np.float32(0.02))
        cases.append((f"{contract.BLOCK_FORMAT_NAMES[fmt]} cache, {layout}", a, kw))
    a = problem(dt=f16, layout="hnd", tdt=np.float16)
    cases.append(("float16, native precision, hnd", a, dict(layout="hnd", precision="native")))
    a = problem()
    a[6] = np.stack([a[6], rng.integers(0, max_pos, t), rng.integers(0, max_pos, t)]).astype(np.int32)
    cases.append(("M-RoPE (24, 20, 20) interleaved", a, dict(mrope_section=(24, 20, 20), mrope_interleaved=True)))
    a = problem(gate=True)
    cases.append(("fused QKV with q_gate rows", a, dict(qkv=True)))
    out = []
    for name, args, opts in cases:
        try:
            if opts.pop("qkv", False):
                fused = np.concatenate(args[:3], axis=1)
                kw = dict(num_q_heads=qh, num_kv_heads=kh, q_gate=True)
                got = jax.jit(lambda *x: jrc.rope_and_cache_qkv(*x, **kw, impl="kernel"))(
                    *jax.device_put([fused] + args[3:], device))
                want = reference.rope_and_cache_qkv(fused, *args[3:], **kw)
            else:
                got = jax.jit(lambda *x: jrc.rope_and_cache(*x, **opts, impl="kernel"))(*jax.device_put(args, device))
                want = reference.rope_and_cache(*args, **opts)
            same = [g is None and w is None or np.array_equal(_bits(g), _bits(w)) for g, w in zip(got, want)]
            out.append((name, all(same), "bit-exact" if all(same) else
                        f"results equal (q_out, k_out, caches...): {same}"))
        except Exception as e:  # noqa: BLE001 - a refusal or failure goes into the report
            out.append((name, False, f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"))
    return out


def time_op(device, impl, t, qh, kh, d, pattern, layout, steps, variant="") -> float:
    """Seconds per call: `steps` calls in one jit (lax.fori_loop, caches carried and donated).
    variant: "" (bf16 caches), "fp8 per-token" (e4m3fn caches, scale caches carried too) or "qkv"
    (rope_and_cache_qkv with the fused [T, QH + 2KH, D] input)."""
    nb = max(64, -(-2 * t // 16))
    q, k, v, kc, vc, slots, pos, cos, sin = _problem(t, qh, kh, d, pattern, nb=nb, layout=layout)
    extra = ()
    if variant == "fp8 per-token":
        kc, vc = (c.astype(jnp.float8_e4m3fn) for c in (kc, vc))
        extra = tuple(jnp.ones(contract.scale_shape(layout, nb, 16, kh), jnp.float32) for _ in range(2))
    if variant == "qkv":
        q = jnp.concatenate([q, k, v], axis=1)

    def call(kc, vc, ex):
        if variant == "qkv":
            return jrc.rope_and_cache_qkv(q, kc, vc, slots, pos, cos, sin, num_q_heads=qh, num_kv_heads=kh,
                                          layout=layout, impl=impl)[2:]
        scales = dict(k_scale_cache=ex[0], v_scale_cache=ex[1]) if ex else {}
        return jrc.rope_and_cache(q, k, v, kc, vc, slots, pos, cos, sin, layout=layout, impl=impl, **scales)[2:]

    def loop(kc, vc, *ex):
        return jax.lax.fori_loop(0, steps, lambda _, c: tuple(call(c[0], c[1], c[2:])), (kc, vc) + ex)

    run = jax.jit(loop, donate_argnums=tuple(range(2 + len(extra))))
    carry = jax.device_put((kc, vc) + extra, device)
    q, k, v, slots, pos, cos, sin = jax.device_put((q, k, v, slots, pos, cos, sin), device)
    carry = jax.block_until_ready(run(*carry))  # compile and warm up
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        carry = jax.block_until_ready(run(*carry))
        times.append(time.perf_counter() - t0)
    return float(np.median(times)) / steps


VARIANT_CASES = ((1, "scattered"), (64, "scattered"), (8192, "prefill"))


def timing(device, models=MODELS, cases=CASES, variants=False) -> list[dict]:
    """Rows of the timing table; `variants`: also the first model with an fp8 cache (per-token
    scales) and with the fused QKV input, on VARIANT_CASES."""
    layouts = ["flash", "kv_merged"]  # kv_merged: the layout of JAX's ragged paged attention
    runs = [(m, t, p, lay, "") for m in models for t, p in cases for lay in layouts]
    if variants:
        runs += [(models[0], t, p, "flash", var) for var in ("fp8 per-token", "qkv") for t, p in VARIANT_CASES]
    rows = []
    for (name, qh, kh, d), t, pattern, layout, variant in runs:
        row = dict(model=name + (f" ({variant})" if variant else ""), T=t, slots=pattern, layout=layout)
        for impl in ("kernel", "xla"):
            try:
                row[impl] = time_op(device, impl, t, qh, kh, d, pattern, layout, 100 if t <= 64 else 10, variant)
            except Exception as e:  # noqa: BLE001 - a refusal or failure goes into the report
                row[impl] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
        rows.append(row)
    return rows


def _us(x) -> str:
    return f"{x * 1e6:.2f}" if isinstance(x, float) else str(x)


def report_text(env: dict, found: bool, tests=None, loop=None, rows=None, note: str = "", features=None) -> str:
    out = ["# jax_rope_cache TPU check", ""]
    if not found:
        out += ["No TPU found on this machine: nothing was run on a TPU.", ""]
    if note:
        out += [note, ""]
    out += ["## Environment", ""] + [f"- {k}: {v}" for k, v in env.items()] + [""]
    out += ["## Results", "", "| check | result |", "|---|---|"]
    out.append(f"| TPU | {'found' if found else 'NONE'} |")
    if tests is not None:
        out.append(f"| tests/test_tpu_kernel.py, tests/test_tpu_fp4.py (full tier) | {'PASS' if tests[0] else 'FAIL'} |")
    if loop is not None:
        out.append(f"| decode loop, bit-exact | {'PASS' if loop[0] else 'FAIL'}: {loop[1]} |")
    for name, ok, what in features or ():
        out.append(f"| {name} | {'PASS' if ok else 'FAIL'}: {what} |")
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
        features = feature_checks(devs[0])
        rows = timing(devs[0], variants=True)
        text = report_text(env, True, tests=tests, loop=loop, rows=rows, features=features)
        ok = tests[0] and loop[0] and all(f[1] for f in features)
    with open(a.report, "w") as f:
        f.write(text)
    print(text)
    print(f"# report written to {a.report}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
