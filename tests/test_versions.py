"""The supported jax range: one policy (jax_rope_cache/versions.py) that pyproject.toml, the scripts
and the import-time check all follow."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import jax
import jaxlib
import pytest

from conftest import child_env
from jax_rope_cache import versions

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _read(rel):
    with open(os.path.join(_ROOT, rel)) as f:
        return f.read()


def test_pyproject_states_the_supported_range():
    text = _read("pyproject.toml")
    oldest, newest = versions.OLDEST_JAX, versions.NEWEST_JAX
    cap = ".".join(newest.split(".")[:1] + [str(int(newest.split(".")[1]) + 1)])  # the next minor release
    assert versions.JAX_REQUIREMENT == f">={oldest},<{cap}"
    python = re.search(r'^requires-python = ">=(3\.\d+)"$', text, re.MULTILINE).group(1)
    for name in ("jax", "jaxlib"):
        reqs = re.findall(rf"\"{name}(?:\[[^\]]*\])?([<>=!~][^\"]*)\"", text)
        assert reqs and all(r.split(";")[0].strip() == f">={oldest},<{cap}" for r in reqs), (name, reqs)
        # a marker, where there is one, is requires-python's (the build requirements carry it)
        assert all(r.split(";")[1].strip() == f"python_version >= '{python}'" for r in reqs if ";" in r), (name, reqs)


def test_python_3_12_is_required_and_documented():
    """jax >= 0.11 is published for Python >= 3.12 only; every place that says how to pip install says so."""
    text = _read("pyproject.toml")
    assert re.search(r'^requires-python = ">=3\.12"$', text, re.MULTILINE)
    assert "Python >= 3.12" in _read("README.md") and "Python >= 3.12" in _read("BUILD_NOTES.md")
    rocm = _read("docs/rocm.md")
    for block in re.findall(r"```bash\n(.*?)```", rocm, re.DOTALL):
        if "pip install" in block and "<checkout>" in block:
            assert "Python >= 3.12" in block, block


def test_the_docs_and_check_say_the_supported_range():
    """One phrase from versions.py: the README, docs/rocm.md and `check`'s report."""
    assert versions.SUPPORTED_JAX == f"{versions.OLDEST_JAX} to {'.'.join(versions.NEWEST_JAX.split('.')[:2])}.x"
    assert f"Supported jax: {versions.SUPPORTED_JAX}** (`jax{versions.JAX_REQUIREMENT}`" in _read("README.md")
    assert f"| jax | {versions.SUPPORTED_JAX};" in _read("docs/rocm.md")
    from jax_rope_cache.cli import check

    assert check.environment()["supported jax"].startswith(versions.SUPPORTED_JAX + " (")


def test_the_running_jax_is_in_the_range():
    assert versions.jax_problem(jax.__version__, jaxlib.__version__) is None
    key = versions._key
    assert key(versions.OLDEST_JAX) <= key(jax.__version__)


@pytest.mark.parametrize("old", ["0.11.0", "0.10.2", "0.4.38"])
def test_an_older_jax_is_refused_with_the_range_and_the_fix(old):
    problem = versions.jax_problem(old, versions.OLDEST_JAX)
    assert problem == (f"jax_rope_cache needs jax >= 0.11.1 (tested: 0.11.1 to {versions.NEWEST_JAX}), found jax {old}: "
                       "pip install -U 'jax>=0.11.1' 'jaxlib>=0.11.1'")
    assert "jaxlib 0.11.0" in versions.jax_problem(versions.OLDEST_JAX, "0.11.0")
    assert versions.jax_problem("0.11.1", "0.11.1") is None and versions.jax_problem("0.12.0.1", "0.12.0.1") is None
    assert versions.jax_problem("0.11.2.dev20260101", None) is None


def test_importing_the_api_under_an_older_jax_raises_that_error():
    code = ("import jax, jaxlib; jax.__version__ = jaxlib.__version__ = '0.11.0'\n"
            "try:\n    import jax_rope_cache.api\nexcept ImportError as e:\n    print('ERR', e)\n")
    r = subprocess.run([sys.executable, "-P", "-c", code], env=child_env(), capture_output=True, text=True,
                       timeout=120)
    assert "ERR jax_rope_cache needs jax >= 0.11.1" in r.stdout, r.stdout + r.stderr[-2000:]
