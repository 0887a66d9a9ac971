"""impl="kernel" of the MLA op on AMD GPUs (gfx942, gfx950): the FlyDSL kernel."""

from __future__ import annotations

from jax_rope_cache.backends import native


def lower(ctx, args, spec, launch_options):
    raise native.KernelUnavailable("an MLA kernel for ROCm, which is not built yet") from NotImplementedError(
        "mla_rope_and_cache: impl='kernel' on ROCm is not available yet; use impl=None or impl='xla'")
