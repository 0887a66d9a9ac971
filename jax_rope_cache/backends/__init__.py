"""The implementations below the primitive, and THE list of platforms with a native kernel.

Each kernel backend module has PLATFORM (jax's name), NAME (for messages), `missing()` (what this
process lacks to build its kernel, or None) and `lower(ctx, args, spec)` (the custom call; may
raise native.KernelUnavailable). `xla` is the pure jax.numpy implementation every platform can
fall back to. Adding a platform is a module with that interface and a line here.
"""

from jax_rope_cache.backends import cpu, cuda, rocm, tpu, xla  # noqa: F401

KERNEL_BACKENDS = {b.PLATFORM: b for b in (cpu, cuda, rocm, tpu)}


def kernel_platforms() -> list[str]:
    """Platforms (jax names: "cpu", "cuda", "rocm", "tpu") whose native kernel is usable in this process."""
    return [p for p, b in KERNEL_BACKENDS.items() if b.missing() is None]
