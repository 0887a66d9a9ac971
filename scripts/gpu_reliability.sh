#!/usr/bin/env bash
# Issue 7's GPU half in one lent-GPU call: install; tests/test_gpu.py (module counts, aliasing,
# graph replay); the fuzz set through the CUDA kernel under compute-sanitizer memcheck; the soak
# (up to 1,000,000 decode steps, cache checked every 1,000); optionally the CUDA half of the
# whole suite, the 32-layer demo and the attribute-size diagnostic. Logs under $OUT; summary last.
#
#   STAGES="suite test_gpu memcheck demo soak diag" SAN_TIMEOUT=230 FUZZ_CASES=150 SOAK_STEPS=1000000 SOAK_LIMIT=140 \
#       scripts/gpu_reliability.sh
set -u -o pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${OUT:-$ROOT/.out}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false JAX_ROPE_CACHE_DIR=/tmp/jax_rope_cache
STAGES="${STAGES:-test_gpu memcheck soak}"
has() { [[ " $STAGES " == *" $1 "* ]]; }
source "$ROOT/scripts/_stages.sh"

STAGES=install bash "$ROOT/scripts/h200.sh" >"$OUT/install_stage.log" 2>&1 || { tail -30 "$OUT/install_stage.log"; exit 1; }

has suite && TAIL=3 run pytest_cuda 300 python3 -P -m pytest -q -p no:cacheprovider "$ROOT/tests" \
    -k "(cuda or gpu) and not fuzz" --ignore "$ROOT/tests/test_cuda_compile.py" --ignore "$ROOT/tests/test_gpu.py"
has test_gpu && TAIL=3 run test_gpu 120 python3 -P -m pytest -q -p no:cacheprovider "$ROOT/tests/test_gpu.py"
# platform allocator: every buffer is its own cudaMalloc, so memcheck sees accesses past a buffer
has memcheck && TAIL=4 run memcheck_fuzz "${SAN_TIMEOUT:-230}" env XLA_PYTHON_CLIENT_ALLOCATOR=platform \
    compute-sanitizer --tool memcheck --error-exitcode 9 \
    python3 "$ROOT/tests/test_fuzz.py" --platform cuda --impl kernel --cases "${FUZZ_CASES:-150}"
has diag && TAIL=26 run diag_attr_size 200 python3 -P "$ROOT/benchmarks/diag_attr_size.py" ${DIAG_ARGS:-}
has demo && TAIL=8 run demo 120 python3 -P -m jax_rope_cache demo --tp 1 --check-layers 2
has soak && TAIL=7 run soak "$(( ${SOAK_LIMIT:-140} + 60 ))" python3 -P "$ROOT/benchmarks/soak.py" --platform cuda \
    --steps "${SOAK_STEPS:-1000000}" --time-limit "${SOAK_LIMIT:-140}" --report-every 50 --json "$OUT/soak_cuda.json"
printf '%s\n' "${summary[@]}"
