#!/usr/bin/env bash
# The main job: a jitted decode loop on the default device, checked against the numpy reference,
# kernel vs XLA path timed side by side. Options go to `python -m jax_rope_cache demo`.
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"
cd "$ROOT"
exec "$PY" -P -m jax_rope_cache demo "$@"
