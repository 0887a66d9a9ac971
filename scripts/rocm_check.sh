#!/usr/bin/env bash
# The one-command hardware check for an AMD GPU host: installs what it needs (a venv with jax's
# ROCm 7 plugin, FlyDSL, this package built from the checkout), then runs
# `python -m jax_rope_cache check`, which prints and writes ONE report file to paste into a bug
# report: ROCm / jax / plugin versions, devices and gcnArchName, the ROCm GPU tests against the
# numpy reference, the kernel's f16 rounding on all 2^32 f32 inputs (tests/test_rocm_f16_conversion.py),
# the launcher's no-graph and graph targets, `generate` kernel vs XLA, a short bench.
#
#   scripts/rocm_check.sh [--report FILE]       (default: rocm_check_report.md in the checkout)
#
# On a machine without an AMD GPU (no /dev/kfd) it installs nothing heavy: it reuses the venv when it
# already has the package (else makes the CPU one), reports the environment, says plainly that no
# AMD GPU was found and exits 0. Environment: JRC_VENV (venv folder; default .venv-rocm on an AMD
# host, .venv elsewhere), JRC_JAX_EXTRA (default rocm7-local on an AMD host), and what
# scripts/_venv.sh reads.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
REPORT="$ROOT/rocm_check_report.md"
ARGS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --report) REPORT=$2; shift 2 ;;
    --report=*) REPORT=${1#--report=}; shift ;;
    -h|--help) sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) ARGS+=("$1"); shift ;;
  esac
done

if [ -e /dev/kfd ]; then
  echo "# AMD GPU driver found (/dev/kfd): installing jax's ROCm plugin, FlyDSL and this package"
  export JRC_JAX_EXTRA=${JRC_JAX_EXTRA:-rocm7-local}
  export JRC_VENV=${JRC_VENV:-$ROOT/.venv-rocm}
  source "$ROOT/scripts/_venv.sh"
  pip_install -r "$ROOT/scripts/test-requirements.txt"
else
  echo "# no AMD GPU driver here (no /dev/kfd): reporting the environment only"
  VENV="${JRC_VENV:-$ROOT/.venv}"
  if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -P -c "import jax_rope_cache.cli.check" >/dev/null 2>&1; then
    PY="$VENV/bin/python"
  else
    source "$ROOT/scripts/_venv.sh"
  fi
fi
cd "$ROOT"
export JRC_ROOT="$ROOT"
exec "$PY" -P -m jax_rope_cache check --report "$REPORT" ${ARGS[@]+"${ARGS[@]}"}
