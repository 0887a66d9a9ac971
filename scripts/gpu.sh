#!/usr/bin/env bash
# Everything the lent NVIDIA GPU runs, in stages (one device call may run at most 10 minutes: pick
# stages per call; every call starts with `install`). Logs under $OUT; a summary is printed last.
#
#   STAGES="install suite test_gpu memcheck bench" scripts/gpu.sh          (the default)
#   install   pip install the project (no build isolation, no deps: the machine has them)
#   suite     the platform-agnostic tests with their cuda cases (pytest; PYTEST_ARGS adds options)
#   test_gpu  tests/test_gpu.py: one custom call, one launch per call, graph replay, module counts
#   memcheck  the fuzz set through the CUDA kernel under compute-sanitizer memcheck (FUZZ_CASES=150)
#   bench     benchmarks/bench_gpu.py op (BENCH_ARGS, e.g. --quick); with PEERS=.peers (AITER's source,
#             see ../shared/peers/README.md) or an installed AITER it adds AITER's time and ratio
#   decode_chain  benchmarks/diagnostics/decode_chain.py: a 32-call decode chain, kernel vs the same
#             launcher with a one-store kernel vs XLA path vs jnp, our command buffers on/off (DC_ARGS),
#             then T=64 again with XLA's command buffers off (decode_chain_xla_nograph/)
#   decode_flags  decode_chain.py (stacked and loop forms, T=64, command buffers on) once per set of
#             XLA command-buffer flags this jaxlib knows (tools/xla_flag_sets.py; DF_SETS picks sets),
#             and the demo under the sets named in DF_DEMO_SETS (default "default all")
#   qk_norm   benchmarks/bench_gpu.py qk_norm: fused Qwen3 QK-RMSNorm vs jnp RMSNorm + op (QN_ARGS)
#   demo      the 32-layer decode demo, with and without command buffers
#   stacked   benchmarks/diagnostics/stacked_layers.py
#   tp        benchmarks/bench_gpu.py tp over every GPU (2 or more)
#   soak      benchmarks/soak.py --platform cuda (SOAK_STEPS=1000000, SOAK_LIMIT=140 seconds)
#   kernel_speed  benchmarks/diagnostics/kernel_speed.py: the kernel launched directly, next to AITER
#             (PEERS=.peers with AITER's source, see ../shared/peers/README.md), floors (KS_ARGS)
#   peers     ../shared/peers/bench_peers.py copied into $PEERS (BP_ARGS, e.g. --tokens 8192 --slot-pattern prefill)
#   model     the model client: tiny Llama-3.1 / Qwen3 vs transformers' recorded tokens,
#             tiny Llama bf16 decode at batch 64: kernel vs XLA path vs "baseline" (no RoPE, a one-element cache write:
#             the op's share of a step)
#   families  benchmarks/bench_gpu.py families: each model-family option vs the plain op and the XLA path (FAM_ARGS)
#   low_bit   benchmarks/bench_gpu.py low_bit: int8 / int4 caches vs bf16 and per-token fp8 (LB_ARGS)
#   model_steps  benchmarks/diagnostics/model_step.py: a Llama-8B decode step per attention route at
#             contexts 512 and 2048, then 8192 (batch 64)
#   model_8b  the same timing for 32 layers of Llama-3.1-8B's shapes (bf16, random weights), batch 64
STAGES="${STAGES:-install suite test_gpu memcheck bench}"
source "$(dirname "${BASH_SOURCE[0]}")/_stages.sh"
PY="${PY:-python3}"
T="$ROOT/tests"
# stages run from /, so a relative PEERS is taken from the repository root
PEERS_DIR=""
[ -n "${PEERS:-}" ] && PEERS_DIR="$(cd "$ROOT" && cd "$PEERS" && pwd)"

{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv || true
  "$PY" -c "import sys, jax; print(sys.version.split()[0], 'jax', jax.__version__, jax.devices())"; } 2>&1 | tee "$OUT/env.log"

if has install; then
  TAIL=3 run install 300 bash -c "cd '$ROOT' && '$PY' -m pip install --no-build-isolation --no-deps . && cd / && \
    '$PY' -P -c 'from jax_rope_cache.backends import cuda; print(\"CUDA kernel lowers here:\", cuda.missing() or \"yes\")'" \
    || { summary_print; tail -40 "$OUT/install.log"; exit 1; }
fi
has suite && TAIL=3 run suite "${PYTEST_TIMEOUT:-420}" "$PY" -P -m pytest -q -p no:cacheprovider ${PYTEST_ARGS:-} "$T" \
    -k "(cuda or gpu) and not fuzz" --ignore "$T/test_cuda_compile.py" --ignore "$T/test_gpu.py"
has test_gpu && TAIL=3 run test_gpu 120 "$PY" -P -m pytest -q -p no:cacheprovider "$T/test_gpu.py"
# platform allocator: every buffer is its own cudaMalloc, so memcheck sees accesses past a buffer
has memcheck && TAIL=4 run memcheck_fuzz "${SAN_TIMEOUT:-230}" env XLA_PYTHON_CLIENT_ALLOCATOR=platform \
    compute-sanitizer --tool memcheck --error-exitcode 9 \
    "$PY" "$T/test_fuzz.py" --platform cuda --impl kernel --cases "${FUZZ_CASES:-150}"
has bench && TAIL=30 run bench 400 "$PY" -P "$ROOT/benchmarks/bench_gpu.py" op "$OUT" ${PEERS_DIR:+--peers "$PEERS_DIR"} \
    ${BENCH_ARGS:-}
if has decode_chain; then
  TAIL=45 run decode_chain 210 "$PY" -P "$ROOT/benchmarks/diagnostics/decode_chain.py" "$OUT/decode_chain" ${DC_ARGS:-}
  TAIL=14 run decode_chain_xla_nograph 75 env XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_command_buffer=" \
      "$PY" -P "$ROOT/benchmarks/diagnostics/decode_chain.py" "$OUT/decode_chain_xla_nograph" --tokens 64 \
      --forms separate --what kernel,trivial,xla,jnp --no-trace --budget-s 35
fi
if has decode_flags; then
  "$PY" -P "$ROOT/tools/xla_flag_sets.py" ${DF_SETS:-} >"$OUT/decode_flags_sets.txt" 2>"$OUT/decode_flags_rejected.txt"
  while IFS='|' read -r name flags; do
    [ -n "$name" ] || continue
    TAIL=1 run "decode_flags_$name" 150 env XLA_FLAGS="$flags" "$PY" -P "$ROOT/benchmarks/diagnostics/decode_chain.py" \
        "$OUT/decode_flags/$name" --tokens 64 --forms stacked,loop --what kernel,trivial,kernel_noinit,xla,jnp \
        --noinit-forms stacked --our-command-buffers on --reps 9 --steps 10 --budget-s 100 ${DC_ARGS:-}
    [[ " ${DF_DEMO_SETS-default all} " == *" $name "* ]] && TAIL=3 run "demo_flags_$name" 150 env XLA_FLAGS="$flags" "$PY" -P -m jax_rope_cache demo \
        --tp 1 --check-layers 1 --steps 128
    true
  done <"$OUT/decode_flags_sets.txt"
fi
has qk_norm && TAIL=20 run qk_norm 220 "$PY" -P "$ROOT/benchmarks/bench_gpu.py" qk_norm "$OUT/qk_norm" ${QN_ARGS:-}
if has demo; then
  TAIL=8 run demo 120 "$PY" -P -m jax_rope_cache demo --tp 1 --check-layers 2
  TAIL=8 run demo_no_command_buffers 90 env JAX_ROPE_CACHE_COMMAND_BUFFERS=0 "$PY" -P -m jax_rope_cache demo \
      --tp 1 --check-layers 1
fi
has stacked && TAIL=4 run stacked_layers 45 "$PY" -P "$ROOT/benchmarks/diagnostics/stacked_layers.py" --tp 1
if has tp && [ "$(nvidia-smi --query-gpu=name --format=csv,noheader | wc -l)" -ge 2 ]; then
  TAIL=4 run tp_decode 90 "$PY" -P "$ROOT/benchmarks/bench_gpu.py" tp --layers 32 --steps 64 --batch 64
fi
has soak && TAIL=7 run soak "$(( ${SOAK_LIMIT:-140} + 60 ))" "$PY" -P "$ROOT/benchmarks/soak.py" --platform cuda \
    --steps "${SOAK_STEPS:-1000000}" --time-limit "${SOAK_LIMIT:-140}" --report-every 50 --json "$OUT/soak_cuda.json"
has families && TAIL=20 run families 400 "$PY" -P "$ROOT/benchmarks/bench_gpu.py" families "$OUT/families" ${FAM_ARGS:-}
has low_bit && TAIL=30 run low_bit 450 "$PY" -P "$ROOT/benchmarks/bench_gpu.py" low_bit "$OUT/low_bit" ${LB_ARGS:-}
if has model_steps; then
  TAIL=20 run model_steps 300 "$PY" -P "$ROOT/benchmarks/diagnostics/model_step.py" --contexts 512,2048 --batch 64 \
      --steps 32 --repeats 7 --out "$OUT/model_steps_512_2048.json"
  TAIL=12 run model_steps_8192 280 "$PY" -P "$ROOT/benchmarks/diagnostics/model_step.py" --contexts 8192 --batch 64 \
      --steps 32 --repeats 7 --out "$OUT/model_steps_8192.json"
fi
has model && TAIL=20 run model 240 "$PY" -P -m jax_rope_cache generate --reference "$ROOT/tests/data/hf_greedy.npz" \
    --batch 64 --dtype bfloat16 --impls kernel,xla,baseline
has model_8b && TAIL=9 run model_8b 420 "$PY" -P -m jax_rope_cache generate --model llama-3.1-8b --dtype bfloat16 \
    --batch 64 --prompt-len 128 --steps 64 --impls kernel,xla,baseline --check none
has kernel_speed && TAIL=45 run kernel_speed 400 bash -c "cd '$ROOT' && '$PY' benchmarks/diagnostics/kernel_speed.py \
    '$OUT' ${PEERS:+--peers '$PEERS'} ${KS_ARGS:-}"
has peers && TAIL=60 run peers 500 env PYTHONPATH="${PEERS_DIR:-$ROOT/.peers}/aiter_src${PYTHONPATH:+:$PYTHONPATH}" \
    "$PY" "${PEERS_DIR:-$ROOT/.peers}/bench_peers.py" ${BP_ARGS:-}
summary_print
