# Sourced by the lent-GPU scripts: run NAME TIMEOUT CMD... runs CMD from / with a time limit,
# logs to $OUT/NAME.log and keeps its exit code, time and last ${TAIL:-6} lines for the summary.
summary=()
run() {
  local name=$1 limit=$2 t0=$SECONDS rc
  shift 2
  (cd / && timeout "$limit" "$@") >"$OUT/$name.log" 2>&1
  rc=$?
  summary+=("== $name: rc=$rc, $((SECONDS - t0)) s")
  summary+=("$(tail -n "${TAIL:-6}" "$OUT/$name.log")")
}
