"""`python -m jax_rope_cache info`: the library version and, for each platform present, whether the
kernel is usable there (not the list of platforms compiled in). And the child processes of the
tests (conftest.child_env) import the test process's package."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax_rope_cache
from conftest import child_env


def _info(*args):
    return subprocess.run([sys.executable, "-P", "-m", "jax_rope_cache", "info", *args], env=child_env(),
                          capture_output=True, text=True, check=True, timeout=120).stdout


def test_info_json_reports_version_and_kernels_of_present_platforms():
    data = json.loads(_info("--json"))
    assert data["jax_rope_cache"] == jax_rope_cache.__version__
    platforms = {d.split(":")[0] for d in data["devices"]}
    assert set(data["kernels"]) >= platforms - {"gpu"}, data
    assert data["kernels"]["cpu"] == "usable"
    assert "cuda" not in data["kernels"] or "cuda" in platforms or "gpu" in platforms


def test_info_help():
    assert _info("--help").startswith("usage: python -m jax_rope_cache info")  # argparse help, exit 0


def test_info_says_which_rocm_setups_are_supported_when_there_is_no_amd_gpu():
    import jax

    data = json.loads(_info("--json"))
    try:
        has_rocm = bool(jax.devices("rocm"))
    except RuntimeError:
        has_rocm = False
    if has_rocm:
        assert "gfx" in data["rocm"], data["rocm"]
    else:
        assert data["rocm"].startswith("no AMD GPU found"), data["rocm"]
        for fact in ("ROCm 7.x", "gfx942", "gfx950", "jax[rocm7-local]", "code-object v6", "ROCm >= 6.3"):
            assert fact in data["rocm"], (fact, data["rocm"])


def test_child_processes_import_this_process_package():
    """The tests' children (started with -P, elsewhere) import the same package as the test process,
    however it was found: installed, a checkout on PYTHONPATH, the current folder."""
    r = subprocess.run([sys.executable, "-P", "-c", "import jax_rope_cache; print(jax_rope_cache.__file__)"],
                       env=child_env(), capture_output=True, text=True, check=True, timeout=60, cwd="/")
    assert os.path.realpath(r.stdout.strip()) == os.path.realpath(jax_rope_cache.__file__)
