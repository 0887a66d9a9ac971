#!/usr/bin/env bash
# The main job: a small Llama-3.1 decoder generating (batched prefill, then decode) on the paged
# KV cache of this library, on the default device: the generated token ids, whether they match
# Hugging Face transformers' (recorded in tests/data/hf_greedy.npz), and tokens/s with the kernel
# and with the XLA path. Options go to `python -m jax_rope_cache generate` (--help lists them);
# `python -m jax_rope_cache demo` is the older loop of the op alone.
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"
cd "$ROOT"
exec "$PY" -P -m jax_rope_cache generate --reference "$ROOT/tests/data/hf_greedy.npz" "$@"
