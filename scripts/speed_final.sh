#!/usr/bin/env bash
# Issue 14, one call on the lent H200 (about 8 minutes): install, the CUDA tests, compute-sanitizer
# memcheck, the kernel-level harness (benchmarks/gpu_speed.py: AITER side by side, old-kernel
# bit-identity, floors) and, in the time left, ../shared/peers/bench_peers.py (jnp column, JAX-level
# chain and profiler device times). Every stage has its own time limit; logs in $OUT/final.log.
#   OLD=.old/rope_cache_old.cu PEERS=/abs/path/.peers DEADLINE_S=470 scripts/speed_final.sh
set -u -o pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${OUT:-$ROOT/.out}"
mkdir -p "$OUT/gs" "$OUT/bp"
LOG="$OUT/final.log"
DEADLINE_S="${DEADLINE_S:-470}"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false JAX_ROPE_CACHE_DIR=/tmp/jrc_cache
site=/tmp/site
left() { echo $((DEADLINE_S - SECONDS)); }
say() { echo "$*" | tee -a "$LOG"; }
{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv; } >>"$LOG" 2>&1

t0=$SECONDS
timeout 110 python3 -m pip install -q --no-build-isolation --no-deps --target "$site" "$ROOT" >>"$LOG" 2>&1
say "install: rc=$? ($((SECONDS - t0)) s)"
export PYTHONPATH="$site"

t0=$SECONDS
(cd / && timeout 80 python3 -P -m pytest -q -p no:cacheprovider "$ROOT/tests/test_gpu.py") >"$OUT/pytest_gpu.log" 2>&1
say "pytest test_gpu.py: rc=$? ($((SECONDS - t0)) s): $(grep -E '(passed|failed|error)' "$OUT/pytest_gpu.log" | tail -1)"

t0=$SECONDS
(cd "$ROOT" && timeout 90 python3 benchmarks/gpu_speed.py "$OUT/gs" --old "${OLD}" --peers "${PEERS}" --budget-s 55) \
    >"$OUT/gs/gpu_speed.log" 2>&1
say "harness: rc=$? ($((SECONDS - t0)) s)"
grep -v '^{' "$OUT/gs/gpu_speed.log" | grep -v "^xp floors" | tail -45

t0=$SECONDS
(STAGES=sanitize OUT=/tmp/san SAN_TIMEOUT=90 PY=python3 bash "$ROOT/scripts/h200.sh") >/tmp/san_stage.log 2>&1
say "sanitize: $(grep -E 'compute-sanitizer memcheck' /tmp/san_stage.log | tail -1) ($((SECONDS - t0)) s)"
tail -6 /tmp/san/sanitizer.log >>"$LOG" 2>/dev/null

t0=$SECONDS
(cd / && timeout 120 python3 -P -m pytest -q -p no:cacheprovider "$ROOT/tests/test_op.py" "$ROOT/tests/test_fuzz.py" \
    "$ROOT/tests/test_integration.py" "$ROOT/tests/test_numerics.py" "$ROOT/tests/test_structure.py" \
    "$ROOT/tests/test_concurrency.py" -k "cuda and kernel") >"$OUT/pytest_cuda.log" 2>&1
say "pytest cuda-kernel cases: rc=$? ($((SECONDS - t0)) s): $(grep -E '(passed|failed|error)' "$OUT/pytest_cuda.log" | tail -1)"
grep -E "^FAILED|Error" "$OUT/pytest_cuda.log" | head -10 | tee -a "$LOG"

b=$(( $(left) - 30 ))
if (( b > 60 )); then
  t0=$SECONDS
  (cd "${PEERS}/.." && OUT="$OUT/bp" PYTHONPATH="${PEERS}/aiter_src:$site" timeout $((b + 25)) python3 "${PEERS}/bench_peers.py" \
      --slot-pattern "${BP_SLOTS:-random}" --tokens "${BP_TOKENS:-8192}" --no-pad --budget-s "$b" --grace-s 10 \
      --jax-profile-budget-s 25) >"$OUT/bp/bench_peers.log" 2>&1
  say "bench_peers: rc=$? ($((SECONDS - t0)) s, budget $b s)"
  sed -n '/====/,$p' "$OUT/bp/bench_peers.log" | tail -60
else
  say "bench_peers: skipped ($(left) s left)"
fi
say "total $SECONDS s"
