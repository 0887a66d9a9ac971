"""scripts/rocm_check.sh / `python -m jax_rope_cache check`: on this CPU-only machine it must run
quickly, install nothing, report the environment and say plainly that no AMD GPU was found; the
GPU part's report logic is checked with recorded outputs of its steps; the launcher-target check
itself runs here on the CPU kernel."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import pytest

from conftest import child_env
from jax_rope_cache.cli import check

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
cpu_only = pytest.mark.skipif(os.path.exists("/dev/kfd"), reason="this host has an AMD GPU driver: not CPU-only mode")


@cpu_only
def test_the_script_on_a_cpu_only_machine_says_no_amd_gpu_and_writes_the_report(tmp_path):
    report = tmp_path / "report.md"
    env = child_env(JRC_VENV=sys.prefix)  # this venv has the package: nothing is installed
    r = subprocess.run(["bash", os.path.join(_ROOT, "scripts", "rocm_check.sh"), "--report", str(report)], env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "installing" not in r.stdout.lower(), r.stdout  # no pip, no build
    assert "No AMD GPU found on this machine" in r.stdout
    text = report.read_text()
    assert text.startswith("# jax_rope_cache ROCm check\n\nNo AMD GPU found on this machine")
    assert "| AMD GPU | NONE |" in text
    for fact in (f"- jax: {jax.__version__}", "- rocm backend: absent", "- AMD GPU driver: no /dev/kfd",
                 "ROCm 7.x", "gfx942", "gfx950", "code-object v6"):
        assert fact in text, fact


def test_a_rocm_plugin_that_fails_to_load_is_in_the_report(tmp_path):
    plugin = tmp_path / "plugins" / "jax_plugins" / "xla_rocm7"
    plugin.mkdir(parents=True)
    (plugin / "__init__.py").write_text("def initialize():\n    raise OSError('libhsa-runtime64.so.1: cannot open "
                                        "shared object file: No such file or directory')\n")
    env = child_env(path=[tmp_path / "plugins"], drop=("JAX_PLATFORMS",))
    report = tmp_path / "r.md"
    r = subprocess.run([sys.executable, "-P", "-m", "jax_rope_cache", "check", "--report", str(report)], env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == (1 if os.path.exists("/dev/kfd") else 0), r.stderr[-3000:]
    text = report.read_text()
    line = next(x for x in text.splitlines() if x.startswith("- jax plugin errors:"))
    assert "jax_plugins.xla_rocm7.initialize()" in line and "libhsa-runtime64.so.1: cannot open" in line, line


def test_the_launcher_target_check_runs_bit_exact_on_the_cpu_kernel():
    r = subprocess.run([sys.executable, "-P", "-m", "jax_rope_cache", "check", "--op-check", "cpu"],
                       env=child_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads([x for x in r.stdout.splitlines() if x.startswith("OPCHECK ")][-1][8:])
    assert res == dict(platform="cpu", targets=["jax_rope_cache_cpu"], ok=True,
                       bit_exact=dict(key_cache=True, value_cache=True, q_out=True))


# ---- the GPU part, on recorded step outputs ------------------------------------------------------------
F16_PASS = 'F16CHECK {"arch": "gfx942", "inputs": 4294967296, "mismatches": 0, "first_mismatch": null}'
F16_FAIL = 'F16CHECK {"arch": "gfx950", "inputs": 4294967296, "mismatches": 3, "first_mismatch": 947912704}'


def _recorded(op_ok=True, tests_rc=0, f16=(0, F16_PASS)):
    """subprocess.run as the steps would see it on a ROCm host (outputs recorded in the format each
    command prints). f16: the exhaustive f16 check's exit code and F16CHECK line (None: none printed)."""
    calls = []

    def run(cmd, capture_output, text, timeout, env=None, cwd=None):
        calls.append((cmd, (env or {}).get("JAX_ROPE_CACHE_COMMAND_BUFFERS")))
        if check.F16_TESTS in cmd:
            rc, line = f16
            return subprocess.CompletedProcess(cmd, rc, (line + "\n" if line else "") +
                                               ("8 passed in 95.1s\n" if rc == 0 else "1 failed, 7 passed in 96.0s\n"),
                                               "")
        if "pytest" in cmd:
            return subprocess.CompletedProcess(cmd, tests_rc, "412 passed, 3 skipped in 301.2s\n"
                                               if tests_rc == 0 else "2 failed, 410 passed in 300.0s\n", "")
        if "--op-check" in cmd:
            target = "jax_rope_cache_gpu" if env["JAX_ROPE_CACHE_COMMAND_BUFFERS"] == "1" else "jax_rope_cache_gpu_nograph"
            res = dict(platform="rocm", targets=[target], ok=op_ok,
                       bit_exact=dict(key_cache=op_ok, value_cache=True, q_out=True))
            return subprocess.CompletedProcess(cmd, 0 if op_ok else 1, "OPCHECK " + json.dumps(res) + "\n", "")
        if "generate" in cmd:
            return subprocess.CompletedProcess(cmd, 0, "tiny-llama-3.1 kernel: tokens match transformers\n"
                                               "kernel 812 tok/s, xla 640 tok/s\n", "")
        return subprocess.CompletedProcess(cmd, 0, "T      kernel   xla\n1      9.1 us   14.0 us\n", "")

    return run, calls


@pytest.mark.parametrize("op_ok,tests_rc", [(True, 0), (False, 0), (True, 1)])
def test_the_gpu_steps_report_each_result(monkeypatch, tmp_path, op_ok, tests_rc):
    run, calls = _recorded(op_ok, tests_rc)
    monkeypatch.setattr(check.subprocess, "run", run)
    report = check.Report(str(tmp_path / "r.md"))
    ok = check._gpu_steps(report, _ROOT)
    assert ok == (op_ok and tests_rc == 0)
    rows = {step: status for step, status, _ in report.summary}
    assert rows == {"gpu tests": "PASS" if tests_rc == 0 else "FAIL", "f16 conversion (every f32)": "PASS",
                    "launcher: no-graph target (ROCm default)": "PASS" if op_ok else "FAIL",
                    "launcher: graph target (HIP graphs)": "PASS" if op_ok else "FAIL",
                    "generate (kernel vs XLA)": "PASS", "bench": "PASS"}
    assert [v for c, v in calls if "--op-check" in c] == ["0", "1"]  # both targets, no-graph first
    pytest_cmd = next(c for c, _ in calls if "pytest" in c)
    assert pytest_cmd[-2:] == ["-k", "rocm"] and "tests/test_gpu.py" in pytest_cmd
    assert check.F16_TESTS not in pytest_cmd
    report.write("headline")
    text = (tmp_path / "r.md").read_text()
    assert "targets ['jax_rope_cache_gpu_nograph']" in text and "targets ['jax_rope_cache_gpu']" in text
    assert "kernel 812 tok/s, xla 640 tok/s" in text


@pytest.mark.parametrize("f16,status,note", [
    ((0, F16_PASS), "PASS", "gfx942: 0 of 4294967296 f32 inputs differ from numpy's f16"),
    ((1, F16_FAIL), "FAIL", "gfx950: 3 of 4294967296 f32 inputs differ from numpy's f16 (first 0x38800000)"),
    ((0, F16_PASS.replace("4294967296", "67108864")), "FAIL", "gfx942: 0 of 67108864 f32 inputs differ"),
    ((1, None), "FAIL", "no F16CHECK result (exit 1; see its section)"),
], ids=["pass", "mismatches", "partial", "no-result"])
def test_the_exhaustive_f16_check_runs_its_test_file_and_reports_its_line(monkeypatch, tmp_path, f16, status, note):
    run, calls = _recorded(f16=f16)
    monkeypatch.setattr(check.subprocess, "run", run)
    report = check.Report(str(tmp_path / "r.md"))
    ok = check._gpu_steps(report, _ROOT)
    assert ok == (status == "PASS")
    (row,) = [(st, n) for step, st, n in report.summary if step == "f16 conversion (every f32)"]
    assert row[0] == status and row[1].startswith(note), row
    cmds = [c for c, _ in calls if check.F16_TESTS in c]
    assert len(cmds) == 1 and cmds[0][-1] == check.F16_TESTS and "-s" in cmds[0]  # its print reaches the report
    assert os.path.isfile(os.path.join(_ROOT, check.F16_TESTS))
    order = [("f16" if check.F16_TESTS in c else "gpu" if "pytest" in c else "other") for c, _ in calls]
    assert order[:2] == ["gpu", "f16"]
    report.write("headline")
    text = (tmp_path / "r.md").read_text()
    assert f"| f16 conversion (every f32) | {status} | {note}" in text
    assert f16[1] is None or f16[1] in text  # the step's output, in its section


@cpu_only
def test_the_script_help_describes_the_f16_check():
    r = subprocess.run(["bash", os.path.join(_ROOT, "scripts", "rocm_check.sh"), "--help"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0
    assert "f16 rounding on all 2^32 f32 inputs (tests/test_rocm_f16_conversion.py)" in r.stdout
    assert r.stdout.rstrip().endswith("scripts/_venv.sh reads."), r.stdout  # the whole header
