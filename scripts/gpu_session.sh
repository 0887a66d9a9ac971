#!/usr/bin/env bash
# One lent-GPU call covering the integration work: install, the CUDA-relevant tests, the 32-layer
# demo (stacked caches under scan) with and without command buffers, the stacked-layer benchmark,
# and, when the machine has several GPUs, the tensor-parallel decode. Logs under $OUT; summary last.
set -u -o pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${OUT:-$ROOT/.out}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false JAX_ROPE_CACHE_DIR=/tmp/jax_rope_cache
export NCCL_NVLS_ENABLE=0 NCCL_CUMEM_ENABLE=0
source "$ROOT/scripts/_stages.sh"

STAGES=install bash "$ROOT/scripts/h200.sh" >"$OUT/install_stage.log" 2>&1 || { tail -30 "$OUT/install_stage.log"; exit 1; }
nvidia-smi --query-gpu=name --format=csv,noheader | head -4
NGPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | wc -l)

TAIL=3 run pytest_gpu 180 python3 -P -m pytest -q -p no:cacheprovider -x "$ROOT/tests" \
    -k "cuda or gpu" --ignore "$ROOT/tests/test_cuda_compile.py"
TAIL=8 run demo 120 python3 -P -m jax_rope_cache demo --tp 1 --check-layers 2
TAIL=8 JAX_ROPE_CACHE_COMMAND_BUFFERS=0 run demo_no_command_buffers 90 \
    env JAX_ROPE_CACHE_COMMAND_BUFFERS=0 python3 -P -m jax_rope_cache demo --tp 1 --check-layers 1
TAIL=4 run stacked_layers 45 python3 -P "$ROOT/benchmarks/bench_stacked_layers.py" --tp 1
if [ "$NGPU" -ge 2 ]; then
  TAIL=4 run tp_decode 90 python3 -P "$ROOT/benchmarks/tp_decode.py" --layers 32 --steps 64 --batch 64
fi
printf '%s\n' "${summary[@]}"
