#!/usr/bin/env bash
# Issue 14 kernel measurements on the lent H200, from a copy of this tree (no install needed: the
# harness only compiles and launches kernels): benchmarks/gpu_speed.py (new kernel vs an old
# kernel source, AITER's Triton kernel and floor kernels; conversions checked exhaustively).
#   OLD=path/to/old/rope_cache.cu PEERS=path/to/.peers GS_ARGS="..." scripts/gpu_speed.sh
set -u -o pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${OUT:-$ROOT/.out}"
mkdir -p "$OUT"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 JAX_ROPE_CACHE_DIR=/tmp/jrc_cache
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv
args=()
[[ -n "${OLD:-}" ]] && args+=(--old "$OLD")
[[ -n "${PEERS:-}" ]] && args+=(--peers "$PEERS")
eval "extra=(${GS_ARGS:-})"
python3 "$ROOT/benchmarks/gpu_speed.py" "$OUT" "${args[@]}" "${extra[@]}" 2>&1 | tee "$OUT/gpu_speed.log" | grep -v '^{'
