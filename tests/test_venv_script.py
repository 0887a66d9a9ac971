"""scripts/_venv.sh's choice of what to install (JRC_PRINT_PLAN=1 prints it and stops before
creating anything): the supported jax range by default, a pinned jax with its own venv folder for
JRC_JAX_VERSION, jax's ROCm plugin at a jax release that has one for JRC_JAX_EXTRA=rocm*, and pip
upgraded before any of it (an old pip cannot resolve jax[rocm7-local])."""

from __future__ import annotations

import os
import subprocess

import pytest

from jax_rope_cache import versions

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def plan(**env) -> dict:
    e = {k: v for k, v in os.environ.items() if not k.startswith("JRC_")}
    e.update(JRC_PRINT_PLAN="1", **env)
    r = subprocess.run(["bash", "-c", f"source {_ROOT}/scripts/_venv.sh"], env=e, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    out = {}
    for line in r.stdout.splitlines():
        key, _, value = line.partition("=")
        out[key] = value
    return out


def test_default_installs_the_supported_range_into_dot_venv():
    p = plan()
    assert p["venv"] == os.path.join(_ROOT, ".venv")
    assert p["jax"] == f"jax>=0.11.1,<0.13" and p["jaxlib"] == "jaxlib>=0.11.1,<0.13"
    assert p["pip"] == "pip>=24"


def test_a_pinned_jax_gets_its_own_venv():
    p = plan(JRC_JAX_VERSION=versions.OLDEST_JAX)
    assert p["venv"] == os.path.join(_ROOT, f".venv-jax-{versions.OLDEST_JAX}")
    assert p["jax"] == f"jax=={versions.OLDEST_JAX}" and p["jaxlib"] == f"jaxlib=={versions.OLDEST_JAX}"
    assert plan(JRC_JAX_VERSION="0.11.1", JRC_VENV="/tmp/elsewhere")["venv"] == "/tmp/elsewhere"


@pytest.mark.parametrize("extra", ["rocm7-local", "rocm"])
def test_rocm_pins_a_jax_whose_rocm_plugin_exists(extra):
    p = plan(JRC_JAX_EXTRA=extra)
    assert p["jax"] == f"jax[{extra}]=={versions.ROCM_JAX}" and p["jaxlib"] == f"jaxlib=={versions.ROCM_JAX}"
    assert p["pip"] == "pip>=24"
    assert plan(JRC_JAX_EXTRA=extra, JRC_JAX_VERSION="0.11.1")["jax"] == f"jax[{extra}]==0.11.1"


def test_an_unsupported_pinned_jax_is_refused():
    e = {k: v for k, v in os.environ.items() if not k.startswith("JRC_")}
    r = subprocess.run(["bash", "-c", f"source {_ROOT}/scripts/_venv.sh"], capture_output=True, text=True,
                       env=dict(e, JRC_PRINT_PLAN="1", JRC_JAX_VERSION="0.11.0"), timeout=60)
    assert r.returncode != 0
    assert "JRC_JAX_VERSION: expected a jax release from 0.11.1 on" in r.stderr and "got 0.11.0" in r.stderr


def test_the_default_tier_time_is_one_figure_everywhere():
    """README, BUILD_NOTES and `run_tests.sh --help` quote the same measured time of the default tier."""
    import re

    said = {}
    for rel in ("README.md", "BUILD_NOTES.md", "scripts/run_tests.sh"):
        with open(os.path.join(_ROOT, rel), encoding="utf-8") as f:
            text = " ".join(f.read().split())  # the README wraps lines
        said[rel] = re.findall(r"about \d+ minutes on \d+ CPU cores from a fresh clone, install included", text)
    assert all(len(v) == 1 for v in said.values()) and len({v[0] for v in said.values()}) == 1, said
