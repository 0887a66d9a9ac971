#!/usr/bin/env bash
# The test suite on this machine's jax backends (CPU here; CUDA or ROCm where jax has them).
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"
echo "# installing test-only dependencies (scripts/test-requirements.txt)"
"$PY" -m pip install -q --disable-pip-version-check -r "$ROOT/scripts/test-requirements.txt"
cd "$ROOT"
# -P: import the installed package, not the source folder (which has no compiled extension).
exec "$PY" -P -m pytest -q "$ROOT/tests" "$@"
