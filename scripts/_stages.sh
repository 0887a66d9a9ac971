# Sourced by scripts/gpu.sh (and any lent-GPU script): common environment, stage selection and a
# stage runner. `has NAME` tells whether $STAGES selects a stage; `run NAME TIMEOUT CMD...` runs CMD
# from / (so python imports the installed package) with a time limit, logs it to $OUT/NAME.log and
# keeps its exit code, time and last ${TAIL:-6} lines for the summary `summary_print` prints last.
set -u -o pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${OUT:-$ROOT/.out}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
export JAX_ROPE_CACHE_DIR="${JAX_ROPE_CACHE_DIR:-/tmp/jax_rope_cache}"
export NCCL_NVLS_ENABLE=0 NCCL_CUMEM_ENABLE=0
summary=()
has() { [[ " $STAGES " == *" $1 "* ]]; }
run() {
  local name=$1 limit=$2 t0=$SECONDS rc
  shift 2
  (cd / && timeout "$limit" "$@") >"$OUT/$name.log" 2>&1
  rc=$?
  summary+=("== $name: rc=$rc, $((SECONDS - t0)) s")
  summary+=("$(tail -n "${TAIL:-6}" "$OUT/$name.log")")
  return $rc
}
summary_print() { printf '%s\n' "${summary[@]}"; }
