"""The GPU benchmark harness: one entry point, one suite per feature, each timing its subject side
by side with the baseline it must beat, in one process, on the default GPU.

    python benchmarks/bench_gpu.py op OUT_DIR [--quick] [--peers .peers]   the op: kernel vs XLA path (+ AITER)
    python benchmarks/bench_gpu.py qk_norm OUT_DIR [--dry-run] ...         fused QK-RMSNorm vs the separate norm
    python benchmarks/bench_gpu.py mrope OUT_DIR [--dry-run] ...           multimodal RoPE vs jnp M-RoPE
    python benchmarks/bench_gpu.py mla OUT_DIR [--dry-run] ...             the MLA op vs jnp and AITER
    python benchmarks/bench_gpu.py qkv OUT_DIR [--dry-run] ...             fused QKV input vs sliced q/k/v
    python benchmarks/bench_gpu.py tp [--layers 32 --steps 64 ...]          tensor-parallel decode over every GPU
    python benchmarks/bench_gpu.py fp8 OUT_DIR [--dry-run] ...             per-token vs per-tensor fp8 vs bf16 caches
    python benchmarks/bench_gpu.py families OUT_DIR [--dry-run] ...        each model-family option vs the plain op
    python benchmarks/bench_gpu.py low_bit OUT_DIR [--dry-run] ...         int8 / int4 / fp4 caches vs bf16 and fp8

`python benchmarks/bench_gpu.py SUITE --help` lists a suite's options. The suites live in
benchmarks/gpu/; the CPU harness is benchmarks/bench_cpu.py, one-off probes benchmarks/diagnostics/.
"""

from __future__ import annotations

import importlib
import os
import sys

SUITES = {"op": "op", "qk_norm": "qk_norm", "mrope": "mrope", "mla": "mla", "qkv": "qkv", "tp": "tp_decode",
          "fp8": "fp8", "families": "families", "low_bit": "low_bit"}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    if argv[0] not in SUITES:
        print(f"suite: expected one of {', '.join(SUITES)}, got {argv[0]!r}\n\n{__doc__}", file=sys.stderr)
        return 2
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu"))
    suite = importlib.import_module(SUITES[argv[0]])
    sys.argv = [f"{sys.argv[0]} {argv[0]}"] + argv[1:]
    return suite.main(argv[1:]) or 0


if __name__ == "__main__":
    sys.exit(main())
