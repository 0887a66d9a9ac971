"""Concurrency: many threads tracing, compiling and running different configurations at once, and
the op on every device of a multi-device process (conftest forces 8 host CPU devices), each result
checked against the reference. On GPU hosts the same tests run on the GPU devices.
"""

from __future__ import annotations

import concurrent.futures as cf
import threading

import jax
import numpy as np
import pytest

import jax_rope_cache as jrc
from jax_rope_cache import backends
from jax_rope_cache.backends import native
from conftest import Case, assert_bits_equal, assert_fma_close, make_problem, platforms, reference_op

# Different static configurations: each thread traces and compiles its own executables.
CONFIGS = [
    Case(T=5, QH=4, KH=2, D=64),
    Case(T=9, QH=8, KH=1, D=128, layout="xpacked", precision="native"),
    Case(T=3, QH=2, KH=2, D=32, layout="xpacked_shuffled", BS=16, cache_dtype="float8_e4m3fn"),
    Case(T=17, QH=8, KH=4, D=80, R=48, is_neox=False, table="full", dtype="float16"),
    Case(T=1, QH=16, KH=8, D=256, dtype="float32", table_dtype="bfloat16", cache_dtype="float8_e4m3fnuz"),
    Case(T=33, QH=4, KH=4, D=64, BS=8, NB=3, layout="xpacked", dtype="float16", precision="native"),
    Case(T=7, QH=6, KH=3, D=16, BS=1, NB=20, is_neox=False),
    Case(T=200, QH=8, KH=2, D=64, BS=32, layout="flash", precision="native"),  # 2 worker threads in the handler
]


def _impls(platform):
    return ["xla"] + (["kernel"] if platform in backends.kernel_platforms() else [])


def _check(got, args, opts, impl, what):
    want = reference_op(*args, **opts)
    for name, g, w in zip(("q_out", "k_out", "key_cache", "value_cache"), got, want):
        g = np.asarray(g)
        if impl == "kernel":
            assert_bits_equal(g, w, f"{name} [{what}]")
        else:
            big = max(float(np.abs(args[0].astype(np.float32)).max(initial=0)),
                      float(np.abs(args[1].astype(np.float32)).max(initial=0)))
            assert_fma_close(g, w, 2.0**-22 * big / float(opts.get("k_scale", 1.0)), f"{name} [{what}]")


def _run_on(device, impl, args, opts):
    dargs = jax.device_put(args, device)
    scales = {k: jax.device_put(opts[k], device) for k in ("k_scale", "v_scale") if k in opts}
    static = {k: v for k, v in opts.items() if k not in scales}
    fn = jax.jit(lambda *a, **s: jrc.rope_and_cache(*a, **s, **static, impl=impl))
    out = fn(*dargs, **scales)
    for o in out:
        assert o.devices() == {device}, (o.devices(), device)
    return [np.asarray(o) for o in out]


def _task(device, impl, case, seed):
    args, opts = make_problem(case, seed)
    got = _run_on(device, impl, args, opts)
    _check(got, args, opts, impl, f"{case.id} {impl} on {device} seed {seed}")
    return case.id


@pytest.mark.parametrize("platform", platforms())
def test_many_threads_trace_and_run_different_configurations(platform):
    """16 threads x 48 tasks: every configuration with both impls, several seeds, all at once."""
    jax.clear_caches()  # every thread traces and compiles for real, concurrently
    dev = jax.devices(platform)[0]
    tasks = [(dev, impl, case, seed) for seed in range(3) for case in CONFIGS for impl in _impls(platform)]
    start = threading.Barrier(16)

    def run(t):
        try:
            start.wait(timeout=5)
        except threading.BrokenBarrierError:
            pass
        return _task(*t)

    with cf.ThreadPoolExecutor(16) as pool:
        done = list(pool.map(run, tasks))
    assert len(done) == len(tasks)


@pytest.mark.parametrize("platform", platforms())
def test_every_device_of_the_process(platform):
    """The op on each device (8 host devices on CPU), one after the other and then all at once."""
    devices = jax.devices(platform)
    if platform == "cpu":
        assert len(devices) >= 2, "conftest should force several host devices"
    case = Case(T=11, QH=8, KH=2, D=64, layout="xpacked")
    for impl in _impls(platform):
        for i, dev in enumerate(devices):
            _task(dev, impl, case, seed=i)
    tasks = [(dev, impl, case, 100 + i) for impl in _impls(platform) for i, dev in enumerate(devices)]
    with cf.ThreadPoolExecutor(len(tasks)) as pool:
        list(pool.map(lambda t: _task(*t), tasks))


@pytest.mark.parametrize("platform", platforms())
def test_one_executable_called_from_many_threads_on_many_devices(platform):
    """One jitted function (traced once per device), called concurrently with distinct in-place
    caches per device: each device's cache ends with exactly its own writes."""
    devices = jax.devices(platform)
    case = Case(T=4, QH=4, KH=2, D=32, BS=16, NB=2)
    impl = _impls(platform)[-1]
    fn = jax.jit(lambda *a: jrc.rope_and_cache(*a, impl=impl), donate_argnums=(3, 4))
    problems = [make_problem(case, seed=7 * i) for i in range(len(devices))]
    state = [list(jax.device_put(p[0], d)) for p, d in zip(problems, devices)]
    want = [list(p[0]) for p in problems]
    steps = 5

    def worker(i):
        args = state[i]
        for step in range(steps):
            q_out, k_out, kc, vc = fn(*args)
            args[3], args[4] = kc, vc  # the donated caches are consumed: carry the new ones
        return i

    with cf.ThreadPoolExecutor(len(devices)) as pool:
        list(pool.map(worker, range(len(devices))))
    for i, (args, _) in enumerate(problems):
        ref = want[i]
        for _ in range(steps):
            _, _, ref[3], ref[4] = reference_op(*ref)
        for j, name in ((3, "key_cache"), (4, "value_cache")):
            got = np.asarray(state[i][j])
            assert state[i][j].devices() == {devices[i]}
            if impl == "kernel":
                assert_bits_equal(got, ref[j], f"{name} on {devices[i]}")
            else:
                bound = 2.0**-22 * float(np.abs(args[1].astype(np.float32)).max())
                assert_fma_close(got, ref[j], bound, f"{name} on {devices[i]}")


def test_case_ids_are_distinct():
    ids = [c.id for c in CONFIGS]
    assert len(set(ids)) == len(ids)
