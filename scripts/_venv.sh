# Sourced by run_demo.sh and run_tests.sh: finds a Python >= 3.12, makes .venv (or $JRC_VENV) with
# it, installs the dependencies and builds + installs this project into it. Sets $PY.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV="${JRC_VENV:-$ROOT/.venv}"

find_python() {
  local c p
  for c in "${JRC_PYTHON:-}" python3.14 python3.13 python3.12 python3 python \
           "$HOME"/.pyenv/versions/3.1[2-9]*/bin/python3 /usr/local/bin/python3.1[2-9] /usr/bin/python3.1[2-9]; do
    [ -n "$c" ] || continue
    p=$(command -v "$c" 2>/dev/null) || continue
    if "$p" -c 'import sys; sys.exit(sys.version_info < (3, 12))' >/dev/null 2>&1; then echo "$p"; return 0; fi
  done
  return 1
}

if [ ! -x "$VENV/bin/python" ]; then
  BASE=$(find_python) || { echo "error: no Python >= 3.12 found (set JRC_PYTHON=/path/to/python3.12)" >&2; exit 1; }
  echo "# creating $VENV with $BASE ($("$BASE" --version))"
  "$BASE" -m venv "$VENV"
fi
PY="$VENV/bin/python"
# JRC_JAX_EXTRA=cuda13 installs jax[cuda13] (NVIDIA GPUs); the default is the CPU build.
JAX_REQ="jax${JRC_JAX_EXTRA:+[$JRC_JAX_EXTRA]}>=0.11"
echo "# installing dependencies and building jax_rope_cache into $VENV"
"$PY" -m pip install -q --disable-pip-version-check "$JAX_REQ" "jaxlib>=0.11" numpy "ml_dtypes>=0.5" "pytest>=8" \
  "scikit-build-core>=0.10" "nanobind>=2.4" nvidia-cuda-nvrtc
"$PY" -m pip install -q --disable-pip-version-check --no-build-isolation --no-deps --force-reinstall "$ROOT"
