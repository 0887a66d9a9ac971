# Sourced by run_demo.sh and run_tests.sh: finds a Python >= 3.12, makes .venv (or $JRC_VENV) with
# it, installs the dependencies and builds + installs this project into it. Sets $PY.
# Each step runs only when needed: dependencies when their list changed, the build when a source
# file changed (a hash of the tracked sources is kept in the venv). The build folder lives in the
# venv, never in the source tree; the source folder gets a link to the extension built in .venv, so
# Python started in the checkout imports a working package. JRC_REBUILD=1 forces the build.
#
# Which jax (the supported range and the pins are jax_rope_cache/versions.py's; tests/test_venv_script.py
# checks that the numbers here agree):
#   default               jax and jaxlib >=0.11.1,<0.13 (pip takes the newest), in .venv
#   JRC_JAX_VERSION=X     jax and jaxlib ==X (CI: the oldest supported, 0.11.1), in .venv-jax-X
#   JRC_JAX_EXTRA=rocm*   jax[rocm7-local]==0.12.0 (the newest jax with a ROCm plugin release: 0.12.0.1's
#                         extra asks for a plugin that does not exist); JRC_JAX_EXTRA=cuda13: jax[cuda13]
#   JRC_VENV=DIR          the venv folder, whatever the above
#   JRC_PRINT_PLAN=1      print the venv folder and the jax / jaxlib / pip requirements, install nothing
# pip itself is upgraded first: pip 23 cannot resolve jax[rocm7-local] when the newest jax has no
# plugin release of its own version.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
JAX_OLDEST=0.11.1 JAX_BELOW=0.13 JAX_ROCM=0.12.0 PIP_REQ="pip>=24"
if [ -n "${JRC_JAX_VERSION:-}" ]; then
  if [ "$(printf '%s\n' "$JAX_OLDEST" "$JRC_JAX_VERSION" | sort -V | head -n 1)" != "$JAX_OLDEST" ]; then
    echo "error: JRC_JAX_VERSION: expected a jax release from $JAX_OLDEST on (jax_rope_cache/versions.py), got $JRC_JAX_VERSION" >&2
    exit 1
  fi
  JAX_SPEC="==$JRC_JAX_VERSION"
else
  case "${JRC_JAX_EXTRA:-}" in
    rocm*) JAX_SPEC="==$JAX_ROCM" ;;
    *) JAX_SPEC=">=$JAX_OLDEST,<$JAX_BELOW" ;;
  esac
fi
VENV="${JRC_VENV:-$ROOT/.venv${JRC_JAX_VERSION:+-jax-$JRC_JAX_VERSION}}"
JAX_REQ="jax${JRC_JAX_EXTRA:+[$JRC_JAX_EXTRA]}$JAX_SPEC"
JAXLIB_REQ="jaxlib$JAX_SPEC"
if [ "${JRC_PRINT_PLAN:-0}" = 1 ]; then
  printf 'venv=%s\njax=%s\njaxlib=%s\npip=%s\n' "$VENV" "$JAX_REQ" "$JAXLIB_REQ" "$PIP_REQ"
  exit 0
fi

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
# pip without the noise of satisfied requirements and of an index's absent mirrors; keeps pip's status.
pip_install() {
  "$PY" -m pip install --disable-pip-version-check --progress-bar off "$@" 2>&1 \
    | grep -v -E "^(Requirement already satisfied|WARNING: Location)"
  return "${PIPESTATUS[0]}"
}

# Run "$@" only when `key` differs from the one stored under $VENV/.jrc-$name (then store it).
when_changed() {
  local name=$1 key=$2 stamp="$VENV/.jrc-$1"
  shift 2
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$key" ]; then return 0; fi
  "$@"
  echo "$key" >"$stamp"
}

upgrade_pip() {
  echo "# upgrading pip in $VENV ($PIP_REQ)"
  pip_install --upgrade "$PIP_REQ"
}
when_changed pip "$PIP_REQ" upgrade_pip

# JRC_JAX_EXTRA=cuda13 installs jax[cuda13] (NVIDIA GPUs); JRC_JAX_EXTRA=rocm7-local installs jax with its
# ROCm 7 plugin (AMD GPUs; the host's ROCm 7 install provides the libraries, as jax documents); the
# default is the CPU build.
DEPS=("$JAX_REQ" "$JAXLIB_REQ" numpy "ml_dtypes>=0.5" "pytest>=8" "scikit-build-core>=0.11" "nanobind>=2.4")
case "${JRC_JAX_EXTRA:-}" in rocm*) ;; *) DEPS+=(nvidia-cuda-nvrtc) ;; esac  # NVRTC: the CUDA kernel's compiler
install_deps() {
  echo "# installing dependencies into $VENV: ${DEPS[*]}"
  pip_install "${DEPS[@]}"
}
when_changed deps "${DEPS[*]}" install_deps

sources_hash() {
  (cd "$ROOT" && git ls-files -z -- jax_rope_cache kernels CMakeLists.txt pyproject.toml 2>/dev/null \
     | xargs -0 sha256sum 2>/dev/null; git -C "$ROOT" ls-files --others --exclude-standard -- jax_rope_cache kernels) \
    | sha256sum | cut -c1-16
}
build() {
  echo "# building jax_rope_cache (C++ extension: about a minute on 2 cores) into $VENV"
  pip_install --no-build-isolation --no-deps --force-reinstall \
    --config-settings=build-dir="$VENV/build/{wheel_tag}" "$ROOT"
  "$PY" -P -c "import jax_rope_cache._native" || { echo "error: the build did not produce jax_rope_cache._native" >&2; exit 1; }
}
if [ "${JRC_REBUILD:-0}" = 1 ]; then rm -f "$VENV/.jrc-build"; fi
when_changed build "$(sources_hash)" build

# The checkout works where a user stands: Python started in $ROOT imports the source folder, so the
# source folder gets a link to the extension just built (git-ignored, never packaged: *.so).
link_extension() {
  local built
  built=$(ls "$VENV"/lib/python3*/site-packages/jax_rope_cache/_native*.so 2>/dev/null | head -n 1)
  [ -n "$built" ] || { echo "error: no built extension under $VENV" >&2; exit 1; }
  rm -f "$ROOT"/jax_rope_cache/_native*.so
  ln -s "$built" "$ROOT/jax_rope_cache/$(basename "$built")"
}
# Only the checkout's own venv: a pinned jax's venv (.venv-jax-X) or another JRC_VENV leaves the link alone.
if [ "$VENV" = "$ROOT/.venv" ]; then link_extension; fi
