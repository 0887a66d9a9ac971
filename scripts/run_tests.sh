#!/usr/bin/env bash
# The test suite on this machine's jax backends (CPU here; CUDA or ROCm where jax has them).
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"
install_test_deps() {
  echo "# installing test-only dependencies (scripts/test-requirements.txt)"
  pip_install -r "$ROOT/scripts/test-requirements.txt"
}
when_changed test-deps "$(sha256sum "$ROOT/scripts/test-requirements.txt" | cut -c1-16)" install_test_deps
cd "$ROOT"
# -P: import the installed package, not the source folder (which has no compiled extension).
exec "$PY" -P -m pytest -q "$ROOT/tests" "$@"
