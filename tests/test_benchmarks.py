"""The GPU benchmark harness (benchmarks/bench_gpu.py) reaches every suite: each suite's module
imports on any machine and answers --help; an unknown suite is refused by name."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

HARNESS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks", "bench_gpu.py")
SUITES = ["op", "qk_norm", "mrope", "mla", "tp", "fp8"]


def _run(*args):
    return subprocess.run([sys.executable, "-P", HARNESS, *args], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("suite", SUITES)
def test_every_suite_answers_help(suite):
    r = _run(suite, "--help")
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.startswith("usage:"), r.stdout[:300]


def test_the_harness_lists_its_suites_and_refuses_an_unknown_one():
    r = _run("--help")
    assert r.returncode == 0 and all(f"bench_gpu.py {s}" in r.stdout for s in SUITES)
    r = _run("bogus")
    assert r.returncode == 2 and "suite: expected one of op, qk_norm, mrope, mla, tp, fp8, got 'bogus'" in r.stderr
