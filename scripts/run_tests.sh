#!/usr/bin/env bash
# The test suite on this machine's jax backends (CPU here; CUDA or ROCm where jax has them).
usage() {
  cat <<'USAGE'
usage: ./scripts/run_tests.sh [--full] [pytest arguments]

Makes .venv (or $JRC_VENV) on first use, installs jax and the test dependencies, builds the
extension, then runs pytest. With no test path, all of tests/ runs.

  (default)   the default tier: every op, layout, dtype and error test on this machine's
              platforms (about 15 minutes on 2 CPU cores from a fresh clone, install included)
  --full      also the compile and emulation matrices (NVRTC for sm_80/sm_90, FlyDSL for
              gfx942/gfx950, the ROCm lane emulator, the larger random sweeps): what CI runs
  --help      this text; installs nothing

Anything else goes to pytest: a file (tests/test_errors.py), -k EXPR, -x, -q ...
Environment:
  JRC_JAX_EXTRA=cuda13 | rocm7-local   jax's GPU plugin; the run then fails (naming jax's plugin
                                       error and the fix) unless jax has that GPU backend; the
                                       tests then run in one process
  JRC_JAX_VERSION=0.11.1               pin jax and jaxlib to one release, in its own venv
                                       (.venv-jax-0.11.1): CI tests the oldest supported jax so
  JRC_TEST_WORKERS=N                   test processes of a CPU run (default: one per core)
  JRC_VENV=DIR                         another venv
USAGE
}
tier=default
args=()
for a in "$@"; do
  case "$a" in
    -h|--help) usage; exit 0 ;;
    --full) tier=full ;;
    *) args+=("$a") ;;
  esac
done
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"
install_test_deps() {
  echo "# installing test-only dependencies (scripts/test-requirements.txt)"
  pip_install -r "$ROOT/scripts/test-requirements.txt"
}
when_changed test-deps "$(sha256sum "$ROOT/scripts/test-requirements.txt" | cut -c1-16)" install_test_deps
cd "$ROOT"
export JRC_TEST_TIER=$tier
# CPU-only runs spread the tests over the machine's cores (pytest-xdist); GPU runs stay in one
# process (one GPU, and tests that count kernel launches). -n or -p given by the caller wins.
workers=()
if [ -z "${JRC_JAX_EXTRA:-}" ] && [[ " ${args[*]-} " != *" -n"* && " ${args[*]-} " != *" -p "* ]]; then
  workers=(-n "${JRC_TEST_WORKERS:-auto}")
fi
# -P: tests import the installed package (the source folder holds the same code and a link to its extension).
exec "$PY" -P -m pytest -q "${workers[@]}" "${args[@]}"
