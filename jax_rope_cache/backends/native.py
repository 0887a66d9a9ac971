"""The compiled extension jax_rope_cache._native (CPU handler + GPU launcher) and FFI target
registration, shared by the CPU, CUDA and ROCm backends."""

from __future__ import annotations

import functools
import threading

import jax
from jaxlib import xla_client

from jax_rope_cache import contract

_registered: set[tuple[str, str]] = set()
_lock = threading.Lock()

class KernelUnavailable(RuntimeError):
    """Raised by a backend's `lower` when the kernel cannot be built here (the cause is chained):
    impl=None then falls back to the XLA path with a warning, impl="kernel" re-raises the cause."""


def refuse_unsupported(spec: contract.OpSpec, supports: frozenset[str], name: str) -> None:
    """Raises KernelUnavailable when the call uses a contract.FEATURES option that a backend's
    kernel does not implement (its SUPPORTS set): impl=None then lowers the XLA path with a
    warning, impl="kernel" raises the chained NotImplementedError."""
    missing = contract.features(spec) - supports
    if not missing:
        return
    what = ", ".join(contract.FEATURE_NAMES[f] for f in contract.FEATURES if f in missing)
    raise KernelUnavailable(f"a kernel with {what}, which the {name} kernel does not implement yet") from (
        NotImplementedError(f"rope_and_cache: impl='kernel' on {name}: the kernel does not implement {what} yet; "
                            "use impl=None (the XLA implementation then runs) or impl='xla'"))


MISSING = ("the compiled extension jax_rope_cache._native, which did not import; reinstall the package")


@functools.cache
def native_module():
    """The compiled extension, or None when the package was installed without it."""
    try:
        from jax_rope_cache import _native
    except ImportError:
        return None
    return _native


class TraitsRejected(RuntimeError):
    """jax refused a target's command-buffer trait (the PJRT plugin does not support custom-call
    traits: jax-rocm7-plugin 0.11.0 never does, later ones when the plugin does not advertise them)."""


_rejected: dict[tuple[str, str], str] = {}


def register_target(name: str, capsules, platform: str, *, command_buffers: bool = False) -> None:
    """Registers an FFI target once per process (for a platform jax lacks, registration is queued).
    XLA takes a target's command-buffer trait from its registration, so a graph-compatible target
    says so here (its execute handler declares it too). Raises TraitsRejected (every time) when jax
    refuses the trait for this platform; the target is then not registered."""
    with _lock:
        if (name, platform) in _registered:
            return
        if (name, platform) in _rejected:
            raise TraitsRejected(_rejected[(name, platform)])
        kwargs = {}
        trait = getattr(getattr(xla_client, "CustomCallTargetTraits", None), "COMMAND_BUFFER_COMPATIBLE", None)
        if command_buffers and trait is not None:
            kwargs["traits"] = trait
        try:
            jax.ffi.register_ffi_target(name, capsules(), platform=platform, api_version=1, **kwargs)
        except Exception as e:  # noqa: BLE001 - jaxlib raises its own runtime error types
            if not kwargs:
                raise
            _rejected[(name, platform)] = f"{type(e).__name__}: {e}"
            raise TraitsRejected(_rejected[(name, platform)]) from e
        _registered.add((name, platform))
