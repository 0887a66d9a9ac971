"""scripts/tpu_check.sh / benchmarks/tpu_check.py: on a machine without a TPU the script installs
nothing, reports the environment and says plainly that no TPU was found; the report's decode loop
and timing run here (--dry-run on the CPU kernel, and the decode loop with the TPU kernel in
interpret mode)."""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import pytest

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(_ROOT, "benchmarks"))
import tpu_check  # noqa: E402

no_tpu = pytest.mark.skipif(bool(tpu_check.tpu_devices()), reason="this host has a TPU")


@no_tpu
def test_the_script_without_a_tpu_says_so_and_writes_the_report(tmp_path):
    report = tmp_path / "report.md"
    env = dict(os.environ, JRC_VENV=sys.prefix)  # this venv has the package: nothing is installed
    r = subprocess.run(["bash", os.path.join(_ROOT, "scripts", "tpu_check.sh"), "--report", str(report)], env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "installing" not in r.stdout.lower(), r.stdout
    assert "No TPU found on this machine" in r.stdout
    text = report.read_text()
    assert text.startswith("# jax_rope_cache TPU check\n\nNo TPU found on this machine")
    assert "| TPU | NONE |" in text and f"- jax: {jax.__version__}" in text
    assert "- TPU kernel layouts: flash, hnd, head_major, kv_merged\n" in text


def test_the_dry_run_fills_every_section(tmp_path):
    report = tmp_path / "dry.md"
    r = subprocess.run([sys.executable, "-P", os.path.join(_ROOT, "benchmarks", "tpu_check.py"), "--dry-run",
                        "--report", str(report)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    text = report.read_text()
    assert "| decode loop, bit-exact | PASS: 3 steps x 2 layers" in text
    rows = [x for x in text.splitlines() if x.startswith("| small |")]
    assert all(x.endswith("x |") for x in rows), rows  # kernel and XLA path both timed
    # every dry case in "flash" and in the ragged-paged-attention layout
    assert sorted(x.split("|")[4].strip() for x in rows) == ["flash", "flash", "kv_merged", "kv_merged"], rows


def test_the_decode_loop_with_the_tpu_kernel_interpreted():
    """The report's decode loop (stacked layers, a traced layer in lax.fori_loop, donated caches)
    runs the TPU kernel through Pallas' TPU interpreter, bit-exact every step."""
    from tpu_interpret import tpu_kernel_on_cpu

    with tpu_kernel_on_cpu():
        ok, what = tpu_check.decode_loop(jax.devices("cpu")[0], steps=2, layers=2, shape=(4, 2, 64))
    assert ok, what


def test_the_feature_checks_with_the_tpu_kernel_interpreted():
    """The report's one-call checks of fp8 (static, per-head, per-token scales), NVFP4 and MXFP4 caches,
    float16, M-RoPE and the fused QKV input with q_gate run the TPU kernel interpreted, each bit-exact;
    and the timing of the fp8 per-token and fused QKV variants runs (tiny shapes)."""
    from tpu_interpret import tpu_kernel_on_cpu

    with tpu_kernel_on_cpu():
        cpu = jax.devices("cpu")[0]
        got = tpu_check.feature_checks(cpu)
        for variant in ("fp8 per-token", "qkv"):
            assert isinstance(tpu_check.time_op(cpu, "kernel", 3, 4, 2, 64, "scattered", "flash", 1, variant), float)
    assert len(got) == 8 and all(ok for _, ok, _ in got), got
