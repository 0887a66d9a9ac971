#!/usr/bin/env bash
# Memory-safety check of the CPU handler: builds the extension with AddressSanitizer + UBSan
# (CMake option JRC_SANITIZE=ON) into a separate folder, then runs the fuzz set, test_op's and
# test_qk_norm's native-kernel cases, tests/test_concurrency.py and tests/test_hardening.py's direct ffi_call cases
# (raw_ffi: every operand, result and attribute of the CPU handler and the GPU launcher's buffer
# check broken in turn), its hostile-index kernel cases, and tests/test_cpu_families.py and
# test_cpu_low_bit.py (the model-family options and the low-bit caches) against that build with
# libasan preloaded. Fails on any sanitizer report.
#
# Python: $JRC_PY, else the venv of run_tests.sh ($JRC_VENV or .venv; made by scripts/_venv.sh
# when missing). Build and install folders: $JRC_ASAN_DIR (default /tmp/jrc_asan), never the
# regular build folder. Extra arguments go to pytest.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if [ -n "${JRC_PY:-}" ]; then
  PY=$JRC_PY
elif [ -x "${JRC_VENV:-$ROOT/.venv}/bin/python" ]; then
  PY="${JRC_VENV:-$ROOT/.venv}/bin/python"
else
  source "$ROOT/scripts/_venv.sh"
fi
WORK="${JRC_ASAN_DIR:-/tmp/jrc_asan}"
SITE="$WORK/site"
LOG="$WORK/pytest.log"
CXX_BIN="${CXX:-g++}"
LIBASAN=$("$CXX_BIN" -print-file-name=libasan.so)
# libstdc++ is preloaded too: Python itself does not link it, and ASan's __cxa_throw interceptor
# must find it when ASan initialises (else: "CHECK failed ... real___cxa_throw" at the first C++
# exception thrown inside jaxlib).
LIBSTDCXX=$("$CXX_BIN" -print-file-name=libstdc++.so)
for lib in "$LIBASAN" "$LIBSTDCXX"; do
  if [ ! -e "$lib" ]; then
    echo "asan_check: $lib not found for $CXX_BIN (install the compiler's sanitizer runtime)" >&2
    exit 1
  fi
done
PRELOAD="$LIBASAN $LIBSTDCXX"

mkdir -p "$WORK"
if [ "${JRC_ASAN_REUSE:-0}" = 1 ] && ls "$SITE"/jax_rope_cache/_native*.so >/dev/null 2>&1; then
  echo "# asan_check: reusing the sanitized build in $SITE (JRC_ASAN_REUSE=1)"
else
  echo "# asan_check: building jax_rope_cache with -fsanitize=address,undefined into $SITE"
  rm -rf "$SITE"
  t0=$(date +%s)
  # A build folder of its own: the regular build (build/{wheel_tag}) is never touched.
  "$PY" -m pip install -q --disable-pip-version-check --no-build-isolation --no-deps --target "$SITE" \
    -C cmake.define.JRC_SANITIZE=ON -C build-dir="$WORK/build" "$ROOT"
  echo "# asan_check: built in $(( $(date +%s) - t0 )) s"
fi
NATIVE=$(ls "$SITE"/jax_rope_cache/_native*.so)
# grep without -q reads all of ldd's output: with -q it may exit first, ldd then dies of SIGPIPE
# and pipefail turns the match into a failure (seen once in a CI simulation)
if ! ldd "$NATIVE" | grep libasan >/dev/null; then
  echo "asan_check: $NATIVE is not linked with libasan (was JRC_SANITIZE honoured?)" >&2
  exit 1
fi

export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
export ASAN_OPTIONS="detect_leaks=0:halt_on_error=1:abort_on_error=0:exitcode=99:print_summary=1${ASAN_OPTIONS:+:$ASAN_OPTIONS}"
export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1:exitcode=98${UBSAN_OPTIONS:+:$UBSAN_OPTIONS}"
export JRC_FUZZ_CASES="${JRC_FUZZ_CASES:-400}"
cd "$ROOT"
# The sanitized extension must be the one imported.
LD_PRELOAD="$PRELOAD" "$PY" -P -c "
import sys, jax_rope_cache._native as n
assert n.__file__.startswith('$SITE'), n.__file__
print('# asan_check: importing', n.__file__)"

echo "# asan_check: fuzz set ($JRC_FUZZ_CASES cases per impl), test_op kernel cases, the concurrency tests and the hardening tests under ASan/UBSan"
t0=$(date +%s)
set +e
LD_PRELOAD="$PRELOAD" "$PY" -P -m pytest -q -p no:cacheprovider \
  "$ROOT/tests/test_fuzz.py" "$ROOT/tests/test_op.py" "$ROOT/tests/test_concurrency.py" "$ROOT/tests/test_qk_norm.py" \
  -k "kernel or case_mix or test_concurrency" "$@" 2>&1 | tee "$LOG"
rc=${PIPESTATUS[0]}
echo "# asan_check: direct ffi_call cases and hostile indices (tests/test_hardening.py)"
LD_PRELOAD="$PRELOAD" "$PY" -P -m pytest -q -p no:cacheprovider "$ROOT/tests/test_hardening.py" \
  -k "raw_ffi or (kernel and (indices or layer))" "$@" 2>&1 | tee -a "$LOG"
rc2=${PIPESTATUS[0]}
[ "$rc" -eq 0 ] && rc=$rc2
echo "# asan_check: the model-family options and the low-bit caches in the handler (tests/test_cpu_families.py, test_cpu_low_bit.py)"
LD_PRELOAD="$PRELOAD" "$PY" -P -m pytest -q -p no:cacheprovider "$ROOT/tests/test_cpu_families.py" \
  "$ROOT/tests/test_cpu_low_bit.py" "$@" 2>&1 | tee -a "$LOG"
rc3=${PIPESTATUS[0]}
[ "$rc" -eq 0 ] && rc=$rc3
set -e
echo "# asan_check: pytest exit $rc after $(( $(date +%s) - t0 )) s"
if grep -Eq "ERROR: AddressSanitizer|AddressSanitizer: CHECK failed|runtime error:|SUMMARY: (Address|UndefinedBehavior)Sanitizer" "$LOG"; then
  echo "asan_check: FAILED: sanitizer report(s) in $LOG:" >&2
  grep -E -A20 "ERROR: AddressSanitizer|runtime error:" "$LOG" | head -60 >&2
  exit 1
fi
if [ "$rc" -ne 0 ]; then
  echo "asan_check: FAILED: pytest exit $rc (see $LOG)" >&2
  exit "$rc"
fi
echo "# asan_check: clean (no AddressSanitizer or UBSan report)"
