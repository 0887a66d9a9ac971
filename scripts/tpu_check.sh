#!/usr/bin/env bash
# The one-command check for a TPU host. Nothing has run on TPU hardware yet: this is what the first
# person with one runs. It installs what it needs (a venv with jax[tpu], i.e. libtpu, and this
# package built from the checkout), then runs benchmarks/tpu_check.py, which prints and writes ONE
# report file: jax / jaxlib / libtpu versions and the devices, the TPU kernel tests
# (tests/test_tpu_kernel.py, tests/test_tpu_fp4.py, full tier) on the TPU, a decode loop checked bit
# for bit against the numpy reference, one call each of fp8 caches (static, per-head, per-token
# scales), NVFP4 and MXFP4 caches, float16, M-RoPE
# and the fused QKV input (q_gate) checked bit for bit, and the kernel next to the XLA path (flash,
# and the ragged-paged-attention layout "kv_merged"; T = 1, 64, 8192; fp8 per-token and fused QKV).
#
#   scripts/tpu_check.sh [--report FILE]       (default: tpu_check_report.md in the checkout)
#
# On a machine without a TPU (no /dev/accel* or /dev/vfio device) it installs nothing heavy: it
# reuses the venv when it already has the package (else makes the CPU one), reports the environment,
# says plainly that no TPU was found and exits 0. Environment: JRC_VENV (venv folder; default
# .venv-tpu on a TPU host, .venv elsewhere), JRC_JAX_EXTRA (default tpu on a TPU host), and what
# scripts/_venv.sh reads. Exit status: 0 when every check passed (or no TPU), 1 otherwise.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
REPORT="$ROOT/tpu_check_report.md"
while [ $# -gt 0 ]; do
  case "$1" in
    --report) REPORT=$2; shift 2 ;;
    --report=*) REPORT=${1#--report=}; shift ;;
    -h|--help) sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "error: unknown argument $1 (expected --report FILE)" >&2; exit 2 ;;
  esac
done

if compgen -G "/dev/accel*" >/dev/null || compgen -G "/dev/vfio/[0-9]*" >/dev/null; then
  echo "# TPU device found: installing jax[tpu] (libtpu) and this package"
  export JRC_JAX_EXTRA=${JRC_JAX_EXTRA:-tpu}
  export JRC_VENV=${JRC_VENV:-$ROOT/.venv-tpu}
  source "$ROOT/scripts/_venv.sh"
  pip_install -r "$ROOT/scripts/test-requirements.txt"
else
  echo "# no TPU device here (no /dev/accel*, no /dev/vfio): reporting the environment only"
  VENV="${JRC_VENV:-$ROOT/.venv}"
  if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -P -c "import jax_rope_cache.backends.tpu" >/dev/null 2>&1; then
    PY="$VENV/bin/python"
  else
    source "$ROOT/scripts/_venv.sh"
  fi
fi
cd "$ROOT"
exec "$PY" -P benchmarks/tpu_check.py --report "$REPORT"
