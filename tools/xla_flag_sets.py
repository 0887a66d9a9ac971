#!/usr/bin/env python3
"""Prints `name|XLA_FLAGS` lines: the XLA command-buffer flag sets that the installed jaxlib accepts
(XLA aborts on an unknown flag or enum value, so each set is first parsed in a CPU-only child).

    python tools/xla_flag_sets.py [NAME ...]     (default: every set found; "default" = no flags)

Used by scripts/gpu.sh stage decode_flags (what a custom call costs inside XLA's graphs).
"""
import os
import subprocess
import sys

# name -> flags (one XLA_FLAGS value each)
CANDIDATES = {
    "default": "",
    "skip_temp": "--xla_gpu_command_buffer_update_mode=SKIP_TEMP",
    "skip_profiled": "--xla_gpu_command_buffer_update_mode=SKIP_PROFILED",
    "va_remap": "--xla_gpu_enable_command_buffer_va_remapping=true",
    "inline_traced": "--xla_gpu_command_buffer_inline_traced_commands=true",
    "exclusive": "--xla_gpu_require_exclusive_lock=true",
    "trace_cache": "--xla_cmd_buffer_trace_cache_size=64",
}


def accepted(flags):
    """True when XLA parses `flags` (a CPU backend in a child process: same flag table as the plugin)."""
    env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
    code = "import jax.numpy as jnp; jnp.zeros(1).block_until_ready()"
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, timeout=120)
    return r.returncode == 0


def main(argv):
    found = []
    for name in argv or list(CANDIDATES):
        flags = CANDIDATES[name]
        if accepted(flags):
            print(f"{name}|{flags}", flush=True)
            found.append(name)
        else:
            print(f"# {name}: not accepted by this jaxlib ({flags})", file=sys.stderr)
    combined = [n for n in found if n not in ("default", "skip_temp", "trace_cache")]
    if not argv and len(combined) > 1:  # the update-skipping flags together (one update mode only)
        print("all|" + " ".join(CANDIDATES[n] for n in combined))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
