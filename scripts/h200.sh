#!/usr/bin/env bash
# The NVIDIA path on a lent H200 (or any CUDA machine with jax[cuda] + nanobind + scikit-build-core):
# install the project, run the whole test suite against the CUDA kernel, run compute-sanitizer
# memcheck over hostile slots/positions, run the benchmark. Full logs under $OUT (default ./.out);
# a short table is printed last.
#
#   STAGES="install test sanitize bench" scripts/h200.sh       (the default: everything)
#   PYTEST_ARGS="-x -q"   BENCH_ARGS="--quick"   PY=python3
#
# One device command may run at most 10 minutes: split the stages over calls if needed
# (every call starts with "install"; the other stages need it).
set -u -o pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${OUT:-$ROOT/.out}"
mkdir -p "$OUT"
PY="${PY:-python3}"
STAGES="${STAGES:-install test sanitize bench}"
PYTEST_ARGS="${PYTEST_ARGS:--x -q}"
BENCH_ARGS="${BENCH_ARGS:-}"
export PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_PREALLOCATE=false
export JAX_ROPE_CACHE_DIR="${JAX_ROPE_CACHE_DIR:-/tmp/jax_rope_cache}"
summary=()
has() { [[ " $STAGES " == *" $1 "* ]]; }

{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv || true
  "$PY" -c "import sys, jax, jaxlib; print(sys.version.split()[0], 'jax', jax.__version__, jax.devices())"
  "$PY" -m pip list 2>/dev/null | grep -i -E "^(jax|nvidia-cuda-nvrtc|nanobind|scikit-build-core|numpy|ml.dtypes) " || true
} >"$OUT/env.log" 2>&1
cat "$OUT/env.log"

if has install; then
  t0=$SECONDS
  (cd "$ROOT" && "$PY" -m pip install --no-build-isolation --no-deps . ) >"$OUT/install.log" 2>&1
  rc=$?
  (cd / && "$PY" -P -c "from jax_rope_cache import _nvrtc, cuda; print('nvrtc', _nvrtc.available() and _nvrtc.version(), _nvrtc.unavailable_reason()); print('kernel path available:', cuda.kernel_available())") >>"$OUT/install.log" 2>&1
  tail -3 "$OUT/install.log"
  summary+=("install: rc=$rc ($((SECONDS - t0)) s)")
  [[ $rc -ne 0 ]] && { tail -40 "$OUT/install.log"; exit $rc; }
fi

if has test; then
  t0=$SECONDS
  # -P: import the installed package, not the source folder
  eval "pytest_args=($PYTEST_ARGS)"  # PYTEST_ARGS may hold quoted words, e.g. -k 'not slow'
  (cd / && timeout "${PYTEST_TIMEOUT:-420}" "$PY" -P -m pytest "${pytest_args[@]}" -p no:cacheprovider "$ROOT/tests") \
      >"$OUT/pytest.log" 2>&1
  rc=$?
  tail -25 "$OUT/pytest.log"
  summary+=("pytest: rc=$rc ($((SECONDS - t0)) s): $(grep -E '(passed|failed|error)' "$OUT/pytest.log" | tail -1)")
fi

if has sanitize; then
  t0=$SECONDS
  cat >/tmp/jrc_sanitize.py <<'EOF'
# Hostile indices through the CUDA kernel, every layout, fp8 and int64 included; compared with the reference.
import numpy as np, jax, jax.numpy as jnp, ml_dtypes
jax.config.update("jax_enable_x64", True)  # int64 indices reach the kernel unchanged
import jax_rope_cache as jrc
from jax_rope_cache import reference
rng = np.random.default_rng(0)
bad = 0
for layout in ("flash", "xpacked", "xpacked_shuffled"):
    for cdt, idt in ((ml_dtypes.bfloat16, np.int64), (ml_dtypes.float8_e4m3fn, np.int32)):
        T, QH, KH, D, NB, BS = 67, 8, 2, 128, 8, 16
        q = rng.standard_normal((T, QH, D)).astype(ml_dtypes.bfloat16)
        k = rng.standard_normal((T, KH, D)).astype(ml_dtypes.bfloat16)
        v = rng.standard_normal((T, KH, D)).astype(ml_dtypes.bfloat16)
        kc, vc = (np.asarray(a) for a in jrc.make_kv_cache(NB, BS, KH, D, cdt, layout=layout, fill="random"))
        big = [2**40, -2**62, 2**62, 2**63 - 1, -2**63] if idt == np.int64 else [2**31 - 1, -2**31]
        hostile = np.array([-1, NB * BS, NB * BS + 1] + big, np.int64)
        slots = rng.permutation(NB * BS)[:T].astype(np.int64)  # unique valid slots ...
        m = rng.random(T) < 0.5
        slots[m] = rng.choice(hostile, m.sum())  # ... and half of them hostile
        pos = rng.choice(np.array([-1, 0, 63, 64, 10**6] + big, np.int64), T)
        slots, pos = slots.astype(idt), pos.astype(idt)
        cos = rng.standard_normal((64, D // 2)).astype(np.float32); sin = cos[::-1].copy()
        kw = dict(layout=layout)
        if cdt is not ml_dtypes.bfloat16:
            kw.update(k_scale=np.float32(0.3), v_scale=np.float32(0.2))
        args = (q, k, v, kc, vc, slots, pos, cos, sin)
        got = jrc.rope_and_cache(*args, impl="kernel", **kw)
        want = reference.rope_and_cache(*args, **kw)
        for name, g, w in zip(("q_out", "k_out", "key_cache", "value_cache"), got, want):
            g, w = np.asarray(g), np.asarray(w)
            if not np.array_equal(g.view(np.uint8), w.view(np.uint8)):
                bad += 1
                print("MISMATCH", layout, np.dtype(cdt).name, np.dtype(idt).name, name)
print("sanitize script done, mismatches:", bad)
EOF
  # platform allocator: every buffer is its own cudaMalloc, so memcheck sees overruns past a buffer
  (cd / && XLA_PYTHON_CLIENT_ALLOCATOR=platform timeout "${SAN_TIMEOUT:-300}" compute-sanitizer --tool memcheck --error-exitcode 9 \
      "$PY" -P /tmp/jrc_sanitize.py) >"$OUT/sanitizer.log" 2>&1
  rc=$?
  tail -8 "$OUT/sanitizer.log"
  summary+=("compute-sanitizer memcheck: rc=$rc ($((SECONDS - t0)) s): $(grep -E 'ERROR SUMMARY|mismatches' "$OUT/sanitizer.log" | tr '\n' ' ')")
fi

if has bench; then
  t0=$SECONDS
  eval "bench_args=($BENCH_ARGS)"
  (cd / && "$PY" -P "$ROOT/benchmarks/bench_gpu.py" "$OUT" "${bench_args[@]}") >"$OUT/bench.log" 2>&1
  rc=$?
  summary+=("bench: rc=$rc ($((SECONDS - t0)) s)")
  echo "---- benchmark (full log: bench.log, bench_gpu.csv, bench_gpu.json) ----"
  sed -n '/^device time per call = /,$p' "$OUT/bench.log"
  [[ $rc -ne 0 ]] && tail -30 "$OUT/bench.log"
fi

echo "---- summary ----"
printf '%s\n' "${summary[@]}"
