"""The multi-host recipe (examples/multihost_tp.py) runs: two processes on this machine joined by
jax.distributed, two CPU devices each, caches sharded over the four devices by KV head, two donated
steps, every process's shards equal to the numpy reference."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from conftest import child_env

EXAMPLE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples", "multihost_tp.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("impl", ["kernel", "xla"])
def test_two_processes_four_devices_match_the_reference(impl):
    addr = f"localhost:{_free_port()}"
    env = child_env(drop=("XLA_FLAGS", "JAX_PLATFORMS"))
    procs = [subprocess.Popen([sys.executable, "-P", EXAMPLE, "--coordinator", addr, "--num-processes", "2",
                               "--process-id", str(i), "--impl", impl], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, env=env) for i in range(2)]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=240)[0])
    finally:
        for p in procs:
            p.kill()
    for i, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"process {i} failed:\n{out[-3000:]}"
        # flash caches [NB, BS, KH, D] over 4 devices: each process holds 2 shards of each of 4 outputs
        assert f"process {i}/2: 2 of 4 devices, 8 shards equal to the reference ({impl})" in out, out[-3000:]
