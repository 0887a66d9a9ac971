"""`python -m jax_rope_cache check`: the hardware check for an AMD GPU host (scripts/rocm_check.sh
installs what it needs and runs this), written to ONE report file to paste into a bug report.

On a ROCm host (jax has a "rocm" backend):
  1. the environment: ROCm version, jax / jaxlib / plugin / FlyDSL versions, devices with their
     gcnArchName (`compute_capability`), what the kernel needs and lacks;
  2. the GPU tests of the test suite for ROCm, against the numpy reference (needs a checkout);
     then the kernel's f32 -> f16 rounding on all 2**32 f32 inputs against numpy
     (tests/test_rocm_f16_conversion.py; its F16CHECK line goes into the report);
  3. the launcher's two targets: a decode loop (fori_loop over stacked layers) with
     JAX_ROPE_CACHE_COMMAND_BUFFERS=0 (no HIP graphs, the ROCm default) and =1 (XLA may capture
     the call into a HIP graph), each compared bit for bit with the reference;
  4. `generate` with the kernel and the XLA path (tokens checked against transformers' fixture);
  5. a short `bench`.
Elsewhere it reports the environment, says plainly that no AMD GPU was found and which ROCm setups
are supported, and exits 0; where an AMD GPU driver is present (/dev/kfd) but jax has no ROCm
backend, it reports the plugin's load error and the fix, and exits 1.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform as host_platform
import re
import shutil
import subprocess
import sys
import time

STEP_TIMEOUT_S = {"gpu tests": 3600, "f16 conversion": 1800, "launcher targets": 900, "generate": 900, "bench": 900}
F16_TESTS = "tests/test_rocm_f16_conversion.py"

KFD = "/dev/kfd"


def _source_root() -> str | None:
    """The checkout this runs from (tests/ beside the package), or $JRC_ROOT; None for a wheel install."""
    for root in (os.environ.get("JRC_ROOT"), os.getcwd(),
                 os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))):
        if root and os.path.isfile(os.path.join(root, "tests", "conftest.py")):
            return root
    return None


def _run_tool(cmd: list[str], timeout: float = 20) -> str | None:
    """A host tool's output (rocminfo, amd-smi...), or None when it is absent or fails."""
    if shutil.which(cmd[0]) is None:
        return None
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"({cmd[0]} failed: {e})"
    return (r.stdout + r.stderr).strip()


def hip_runtime_version() -> str | None:
    """hipRuntimeGetVersion of the HIP runtime jax loaded (or the first found), as major.minor.patch."""
    import ctypes

    for name in ("libamdhip64.so", "libamdhip64.so.7", "libamdhip64.so.6"):
        try:
            lib = ctypes.CDLL(name, mode=getattr(os, "RTLD_NOLOAD", 4) | os.RTLD_LAZY)
        except OSError:
            try:
                lib = ctypes.CDLL(name)
            except OSError:
                continue
        v = ctypes.c_int(0)
        if lib.hipRuntimeGetVersion(ctypes.byref(v)) == 0 and v.value > 0:
            return f"{v.value // 10000000}.{v.value // 100000 % 100}.{v.value % 100000} ({name})"
    return None


def environment() -> dict:
    """Facts about this host and its jax (call gpu_env.capture_plugin_errors() before jax loads)."""
    import jax
    import jaxlib

    import jax_rope_cache
    from jax_rope_cache import gpu_env, versions
    from jax_rope_cache.backends import KERNEL_BACKENDS
    from jax_rope_cache.compilers import flydsl

    all_devices = jax.devices()  # loads jax's backends (and plugins): their errors are recorded from here on
    root = gpu_env.rocm_root()
    facts = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "host": f"{host_platform.node()} ({host_platform.platform()})",
        "python": sys.version.split()[0],
        "jax_rope_cache": jax_rope_cache.__version__,
        "jax": jax.__version__, "jaxlib": jaxlib.__version__,
        "supported jax": f"{versions.SUPPORTED_JAX} (jax{versions.JAX_REQUIREMENT}; tested {versions.OLDEST_JAX} and "
                         f"{versions.NEWEST_JAX})",
        "jax plugins": ", ".join(f"{p} {gpu_env.installed(p)}" for ps in gpu_env.PLUGIN_PACKAGES.values() for p in ps
                                 if gpu_env.installed(p)) or "none",
        "flydsl": f"{gpu_env.installed('flydsl') or 'not installed'} (supported: {flydsl.FLYDSL_VERSION}; "
                  f"{'can compile' if flydsl.available() else 'cannot compile: ' + flydsl.unavailable_reason()})",
        "ROCm install": f"{root} (version {gpu_env.rocm_version(root) or 'unknown'})" if root else "none found",
        "AMD GPU driver": f"{KFD} present" if os.path.exists(KFD) else f"no {KFD}",
        "TheRock rocm_sysdeps": gpu_env.sysdeps_dir(root) or "none",
        "LD_LIBRARY_PATH": os.environ.get("LD_LIBRARY_PATH", ""),
        "JAX_ROPE_CACHE_* settings": ", ".join(f"{k}={v}" for k, v in sorted(os.environ.items())
                                               if k.startswith("JAX_ROPE_CACHE_")) or "none",
        "jax plugin errors": " | ".join(gpu_env.plugin_errors()) or "none",
        "default backend": jax.default_backend(),
    }
    devices = []
    for d in all_devices:
        devices.append(f"{d.platform}:{d.id} {d.device_kind} compute_capability="
                       f"{getattr(d, 'compute_capability', None)}")
    facts["devices"] = devices
    rocm_why = gpu_env.backend_error("rocm")
    facts["rocm backend"] = "present" if rocm_why is None else f"absent ({rocm_why})"
    if rocm_why is None:
        facts["HIP runtime"] = hip_runtime_version() or "version not found"
        archs = rocminfo_archs()
        facts["rocminfo gfx"] = ", ".join(archs) if archs else "rocminfo not found"
    kernels = {}
    for name, backend in KERNEL_BACKENDS.items():
        if name == "cpu" or gpu_env.backend_error(name) is None:
            problem = backend.missing()
            kernels[name] = "usable" if problem is None else f"not usable: needs {problem}"
    facts["kernels"] = kernels
    return facts


def rocminfo_archs() -> list[str]:
    out = _run_tool(["rocminfo"])
    return sorted(set(re.findall(r"\bgfx[0-9a-f]+(?::[a-z+-:]+)?", out or "")))


# ---- the launcher-target check (run in a child per JAX_ROPE_CACHE_COMMAND_BUFFERS value) -----------
def op_check(platform: str) -> dict:
    """A decode loop of the kernel over stacked layers (lax.fori_loop: XLA may capture the call into
    a CUDA/HIP graph when its target allows it), compared bit for bit with the numpy reference."""
    import jax
    import jax.numpy as jnp
    import ml_dtypes
    import numpy as np

    import jax_rope_cache as jrc
    from jax_rope_cache import reference

    L, T, QH, KH, D, NB, BS, STEPS = 4, 8, 8, 2, 128, 16, 16, 12
    bf16 = np.dtype(ml_dtypes.bfloat16)
    rng = np.random.default_rng(2024)
    normal = lambda *s: rng.standard_normal(s).astype(np.float32).astype(bf16)  # noqa: E731
    kc, vc = normal(L, NB, BS, KH, D), normal(L, NB, BS, KH, D)
    qs, ks, vs = normal(STEPS, T, QH, D), normal(STEPS, T, KH, D), normal(STEPS, T, KH, D)
    slots = np.stack([rng.permutation(NB * BS)[:T] for _ in range(STEPS)]).astype(np.int32)
    pos = rng.integers(0, 64, (STEPS, T)).astype(np.int32)
    cos, sin = jrc.rope_tables(64, D, base=10000.0)

    def loop(kc, vc, qs, ks, vs, slots, pos):
        def body(i, carry):
            kc, vc, q_all = carry
            qo, _, kc, vc = jrc.rope_and_cache(qs[i], ks[i], vs[i], kc, vc, slots[i], pos[i], cos, sin,
                                               layer=i % L, impl="kernel")
            return kc, vc, q_all.at[i].set(qo)
        return jax.lax.fori_loop(0, STEPS, body, (kc, vc, jnp.zeros(qs.shape, qs.dtype)))

    dev = jax.devices(platform)[0]
    args = jax.device_put((kc, vc, qs, ks, vs, slots, pos), dev)
    fn = jax.jit(loop, donate_argnums=(0, 1))
    compiled = fn.lower(*args).compile()
    targets = sorted(set(re.findall(r'custom_call_target="(jax_rope_cache[^"]*)"', compiled.as_text())))
    got = [np.asarray(x) for x in compiled(*args)]
    want_k, want_v, want_q = kc.copy(), vc.copy(), np.zeros(qs.shape, bf16)
    for i in range(STEPS):
        q_out, _, want_k, want_v = reference.rope_and_cache(qs[i], ks[i], vs[i], want_k, want_v, slots[i], pos[i],
                                                            cos, sin, layer=i % L)
        want_q[i] = q_out
    same = {name: bool(np.array_equal(g.view(np.uint16), w.view(np.uint16)))
            for name, g, w in zip(("key_cache", "value_cache", "q_out"), got, (want_k, want_v, want_q))}
    return dict(platform=platform, targets=targets, bit_exact=same, ok=all(same.values()) and bool(targets))


# ---- the report ---------------------------------------------------------------------------------------
class Report:
    def __init__(self, path: str):
        self.path = path
        self.parts: list[str] = []
        self.summary: list[tuple[str, str, str]] = []

    def section(self, title: str, body: str) -> None:
        self.parts.append(f"## {title}\n\n{body.rstrip()}\n")

    def result(self, step: str, status: str, note: str = "") -> None:
        self.summary.append((step, status, note))
        print(f"[{status}] {step}{': ' + note if note else ''}", flush=True)

    def write(self, headline: str) -> None:
        lines = [f"# jax_rope_cache ROCm check\n\n{headline}\n", "| step | result | note |", "| --- | --- | --- |"]
        lines += [f"| {s} | {r} | {n.replace('|', '/')} |" for s, r, n in self.summary]
        text = "\n".join(lines) + "\n\n" + "\n".join(self.parts)
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        with open(self.path, "w") as f:
            f.write(text)


def _step(report: Report, name: str, cmd: list[str], env: dict | None = None, cwd: str | None = None,
          tail: int = 12000) -> subprocess.CompletedProcess | None:
    t = time.perf_counter()
    print(f"# {name}: {' '.join(cmd)}", flush=True)
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=STEP_TIMEOUT_S[name],
                           env=dict(os.environ, **(env or {})), cwd=cwd)
    except subprocess.TimeoutExpired as e:
        out = ((e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or ""))
        report.section(f"{name} (timed out after {STEP_TIMEOUT_S[name]} s)", f"```\n{out[-tail:]}\n```")
        report.result(name, "FAIL", f"timed out after {STEP_TIMEOUT_S[name]} s")
        return None
    took = time.perf_counter() - t
    out = (r.stdout + ("\n" + r.stderr if r.stderr.strip() else "")).strip()
    report.section(f"{name} (exit {r.returncode}, {took:.0f} s)", f"`{' '.join(cmd)}`\n\n```\n{out[-tail:]}\n```")
    return r


def _gpu_steps(report: Report, root: str | None) -> bool:
    py = [sys.executable, "-P"]
    ok = True
    if root is None:
        report.result("gpu tests", "SKIP", "no checkout (tests/) here: run scripts/rocm_check.sh from a clone")
    else:
        r = _step(report, "gpu tests", py + ["-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider",
                                             "tests/test_gpu.py", "tests/test_op.py", "tests/test_fuzz.py",
                                             "tests/test_concurrency.py", "-k", "rocm"],
                  env={"JRC_JAX_EXTRA": os.environ.get("JRC_JAX_EXTRA") or "rocm7-local"}, cwd=root)
        last = (r.stdout.strip().splitlines() or [""])[-1] if r else "timed out"
        report.result("gpu tests", "PASS" if r and r.returncode == 0 else "FAIL", last)
        ok &= bool(r and r.returncode == 0)
        ok &= _f16_step(report, root, py)
    for value, what in (("0", "no-graph target (ROCm default)"), ("1", "graph target (HIP graphs)")):
        r = _step(report, "launcher targets", py + ["-m", "jax_rope_cache", "check", "--op-check", "rocm"],
                  env={"JAX_ROPE_CACHE_COMMAND_BUFFERS": value})
        res = None
        if r is not None:
            found = [x for x in r.stdout.splitlines() if x.startswith("OPCHECK ")]
            res = json.loads(found[-1][8:]) if found else None
        good = bool(r and r.returncode == 0 and res and res["ok"])
        note = (f"targets {res['targets']}, bit-exact {res['bit_exact']}" if res else
                f"exit {r.returncode if r else 'timeout'} (see its section)")
        report.result(f"launcher: {what}", "PASS" if good else "FAIL", note)
        ok &= good
    r = _step(report, "generate", py + ["-m", "jax_rope_cache", "generate", "--impls", "kernel,xla", "--steps", "16",
                                        "--repeats", "3"], cwd=root)
    report.result("generate (kernel vs XLA)", "PASS" if r and r.returncode == 0 else "FAIL",
                  _grep(r, r"(tokens|match|tok/s|us/step)", 3))
    ok &= bool(r and r.returncode == 0)
    r = _step(report, "bench", py + ["-m", "jax_rope_cache", "bench", "--tokens", "1", "64", "2048", "--calls", "4",
                                     "--repeats", "5"], cwd=root)
    report.result("bench", "PASS" if r and r.returncode == 0 else "FAIL", "table in its section")
    ok &= bool(r and r.returncode == 0)
    return ok


def _f16_step(report: Report, root: str, py: list[str]) -> bool:
    """The exhaustive f16 rounding check on this host's GPU: PASS only when its test file passed and
    its F16CHECK line covers all 2**32 inputs with no mismatch."""
    r = _step(report, "f16 conversion", py + ["-m", "pytest", "-q", "-s", "-rfEs", "-p", "no:cacheprovider", F16_TESTS],
              env={"JRC_JAX_EXTRA": os.environ.get("JRC_JAX_EXTRA") or "rocm7-local"}, cwd=root)
    found = [x for x in r.stdout.splitlines() if x.startswith("F16CHECK ")] if r else []
    res = json.loads(found[-1][len("F16CHECK "):]) if found else None
    good = bool(r and r.returncode == 0 and res and res["inputs"] == 1 << 32 and res["mismatches"] == 0)
    if res:
        note = (f"{res['arch']}: {res['mismatches']} of {res['inputs']} f32 inputs differ from numpy's f16"
                + (f" (first 0x{res['first_mismatch']:08x})" if res["first_mismatch"] is not None else ""))
    else:
        note = f"no F16CHECK result (exit {r.returncode if r else 'timeout'}; see its section)"
    report.result("f16 conversion (every f32)", "PASS" if good else "FAIL", note)
    return good


def _grep(r, pattern: str, n: int) -> str:
    if r is None:
        return "timed out"
    lines = [x.strip() for x in r.stdout.splitlines() if re.search(pattern, x)]
    return "; ".join(lines[-n:]) or f"exit {r.returncode}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jax_rope_cache check", description=(
        "the ROCm hardware check: environment, GPU tests against the reference, the launcher's graph and "
        "no-graph targets, generate with kernel vs XLA, a short bench; one report file (scripts/rocm_check.sh "
        "installs what it needs first). Without an AMD GPU it reports the environment and says so."))
    parser.add_argument("--report", default="rocm_check_report.md", help="the report file to write")
    parser.add_argument("--op-check", metavar="PLATFORM", help=argparse.SUPPRESS)  # one launcher-target run
    args = parser.parse_args(argv)

    from jax_rope_cache import gpu_env

    gpu_env.capture_plugin_errors()  # before jax loads its backends
    if args.op_check:
        res = op_check(args.op_check)
        print("OPCHECK " + json.dumps(res))
        return 0 if res["ok"] else 1

    report = Report(args.report)
    facts = environment()
    env_text = "\n".join(f"- {k}: {'; '.join(f'{a} {b}' for a, b in v.items()) if isinstance(v, dict) else v}"
                         if not isinstance(v, list) else f"- {k}:\n" + "\n".join(f"  - {x}" for x in v)
                         for k, v in facts.items())
    report.section("environment", env_text)
    print(env_text, flush=True)
    if facts["rocm backend"] != "present":
        driver = os.path.exists(KFD)
        message = gpu_env.missing_backend_message("rocm", extra=os.environ.get("JRC_JAX_EXTRA") or "rocm7-local")
        if driver:
            headline = (f"FAIL: this host has an AMD GPU driver ({KFD}) but jax has no ROCm backend; nothing ran "
                        "on the GPU.")
            report.section("why jax has no ROCm backend", message or "")
            report.result("jax ROCm backend", "FAIL", "see 'why jax has no ROCm backend'")
        else:
            headline = ("No AMD GPU found on this machine (no /dev/kfd, no ROCm backend in jax): nothing ran on an AMD "
                        "GPU. Supported: " + gpu_env.SUPPORTED_ROCM + ".")
            report.result("AMD GPU", "NONE", "no AMD GPU found; only the environment is reported")
        print(headline, flush=True)
        report.write(headline)
        print(f"report: {os.path.abspath(args.report)}", flush=True)
        return 1 if driver else 0
    ok = _gpu_steps(report, _source_root())
    headline = ("PASS: every check passed on this AMD GPU." if ok else
                "FAIL: at least one check failed on this AMD GPU (see the table and its section).")
    print(headline, flush=True)
    report.write(headline)
    print(f"report: {os.path.abspath(args.report)}", flush=True)
    return 0 if ok else 1
