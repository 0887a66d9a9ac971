"""Device time per call of a torch-launched kernel: graph_us, a CUDA graph of n_calls calls replayed
and timed with CUDA events (median); kernel_us, the kernels' own durations from torch's profiler.
Shared by the op and MLA suites (the AITER column) and diagnostics/kernel_speed.py; the JAX side's
timing is timing.py."""
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


def kernel_us(call, n_calls: int = 20):
    """(device time of the kernels `call` launches, kernels) per call, from torch's profiler (CUPTI
    kernel records of n_calls plain launches): the kernel alone, without the graph node's gap that
    graph_us includes. (None, 0) when the profiler records no kernel."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n_calls):
            call()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    if not kernels:
        return None, 0
    return sum(e.time_range.elapsed_us() for e in kernels) / n_calls, len(kernels) / n_calls
