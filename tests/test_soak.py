"""A short soak (benchmarks/soak.py): 2,000 decode steps in jitted fori_loop chunks, the cache
checked against the incrementally applied reference after every chunk, and the process RSS flat."""

from __future__ import annotations

import importlib.util
import io
import os

import pytest

from conftest import platforms

_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "soak.py")
RSS_GROWTH_MIB = 32.0  # after the first chunk (which compiles); measured here: a few MiB


def _soak_module():
    spec = importlib.util.spec_from_file_location("jrc_soak", _PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("platform", platforms())
@pytest.mark.parametrize("impl,layout", [("kernel", "xpacked_shuffled"), ("xla", "flash")])
def test_short_soak(platform, impl, layout):
    from jax_rope_cache import _ffi

    if impl == "kernel" and platform not in _ffi.kernel_platforms():
        pytest.skip(f"no native kernel on {platform}")
    soak = _soak_module()
    out = io.StringIO()
    recs = soak.soak(2000, chunk=250, ring=1024, impl=impl, layout=layout, platform=platform, out=out)
    assert [r["check"] for r in recs] == ["ok"] * 8, out.getvalue()
    assert recs[-1]["steps"] == 2000
    growth = recs[-1]["rss_mib"] - recs[1]["rss_mib"]
    assert growth < RSS_GROWTH_MIB, f"RSS grew by {growth:.1f} MiB over 1,500 steps:\n{out.getvalue()}"
