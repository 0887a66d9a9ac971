"""Device time per call of a torch-launched kernel: a CUDA graph of n_calls calls, replayed and timed
with CUDA events (median). Shared by the op and MLA suites (the AITER column) and diagnostics/kernel_speed.py."""
from __future__ import annotations

import statistics


def graph_us(call, n_calls: int = 20, min_total_ms: float = 40.0) -> float:
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (Triton compiles) outside the capture
        for _ in range(3):
            call()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(n_calls):
            call()
    g.replay()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    g.replay()
    e1.record()
    e1.synchronize()
    reps = int(min(100, max(5, min_total_ms / max(e0.elapsed_time(e1), 1e-3))))
    ts = []
    for _ in range(reps):
        e0.record()
        g.replay()
        e1.record()
        e1.synchronize()
        ts.append(e0.elapsed_time(e1))
    del g
    return statistics.median(ts) * 1e3 / n_calls
