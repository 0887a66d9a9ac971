"""This host's GPU setup as jax sees it: which GPU backends loaded, why a PJRT plugin did not, the
ROCm install, and the ROCm setups this package supports. Used by the test suite (a run asked for a
GPU must not pass on CPU), `python -m jax_rope_cache info` and `python -m jax_rope_cache check`.

jax discovers its GPU plugins when a backend is first asked for; a plugin that fails to load is
logged (not raised) and jax carries on with the CPU. `capture_plugin_errors()` must therefore run
before the first `jax.devices()` of the process to see why.
"""

from __future__ import annotations

import glob
import importlib.metadata
import logging
import os
import threading

# The ROCm setups this package is built for. Only CPU-side checks back them so far (the HIP stub,
# the FlyDSL code objects' metadata); no AMD GPU has run the kernel yet.
SUPPORTED_ROCM = ("ROCm 7.x (jax's ROCm 7 plugin: jax[rocm7-local], jax-rocm7-plugin and jax-rocm7-pjrt of the "
                  "same version as jax) on gfx942 (MI300X, MI300A, MI325X) or gfx950 (MI350X, MI355X); the "
                  "kernel's code objects are AMDHSA code-object v6, which needs ROCm >= 6.3")
PLUGIN_PACKAGES = {"rocm": ("jax-rocm7-plugin", "jax-rocm7-pjrt"), "cuda": ("jax-cuda13-plugin", "jax-cuda13-pjrt")}
EXTRA_PLATFORM = {"rocm": "rocm", "cuda": "cuda"}  # JRC_JAX_EXTRA prefix -> jax platform


class _Capture(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        text = record.getMessage()
        if record.exc_info and record.exc_info[1] is not None:
            e = record.exc_info[1]
            text += f": {type(e).__name__}: {e}"
        self.messages.append(text)


_capture: _Capture | None = None
_capture_lock = threading.Lock()


def capture_plugin_errors() -> None:
    """Starts recording what jax logs while it loads its backends (call before the first
    jax.devices(); later calls do nothing)."""
    global _capture
    with _capture_lock:
        if _capture is None:
            _capture = _Capture()
            logging.getLogger("jax._src.xla_bridge").addHandler(_capture)


def plugin_errors() -> list[str]:
    """What jax logged as warnings or errors while loading its backends (since capture started)."""
    return list(_capture.messages) if _capture is not None else []


def asked_platform(extra: str | None = None) -> str | None:
    """The jax GPU platform a run was asked for through JRC_JAX_EXTRA ("rocm7-local" -> "rocm",
    "cuda13" -> "cuda"), or None."""
    extra = (os.environ.get("JRC_JAX_EXTRA", "") if extra is None else extra).strip().lower()
    return next((p for prefix, p in EXTRA_PLATFORM.items() if extra.startswith(prefix)), None)


def backend_error(platform: str) -> str | None:
    """None when jax has devices of `platform`, else jax's own words for why not."""
    import jax

    try:
        if jax.devices(platform):
            return None
        return f"jax's {platform} backend has no devices"
    except RuntimeError as e:
        return str(e)


def installed(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def rocm_root() -> str | None:
    for root in (os.environ.get("ROCM_PATH"), os.environ.get("HIP_PATH"), "/opt/rocm"):
        if root and os.path.isdir(root):
            return root
    return None


def rocm_version(root: str | None = None) -> str | None:
    """The ROCm install's version from its .info/version file (None when absent)."""
    root = root or rocm_root()
    for path in (os.path.join(root or "", ".info", "version"), os.path.join(root or "", ".info", "version-dev")):
        try:
            with open(path) as f:
                return f.read().strip() or None
        except OSError:
            continue
    return None


def sysdeps_dir(root: str | None = None) -> str | None:
    """TheRock's private system libraries (librocm_sysdeps_*), which jax's ROCm plugin's RUNPATH does
    not reach (ROCm/TheRock#5369, ROCm/rocm-jax#444), when this install has them."""
    root = root or rocm_root()
    d = os.path.join(root or "", "lib", "rocm_sysdeps", "lib")
    return d if root and glob.glob(os.path.join(d, "librocm_sysdeps_*")) else None


def missing_backend_message(platform: str, errors: list[str] | None = None, extra: str | None = None) -> str | None:
    """None when jax has `platform` ("rocm" / "cuda"), else an error naming the cause (the plugin's
    load error, as jax logged it) and the fix."""
    why = backend_error(platform)
    if why is None:
        return None
    errors = plugin_errors() if errors is None else errors
    extra = extra if extra is not None else os.environ.get("JRC_JAX_EXTRA", "")
    asked = f"JRC_JAX_EXTRA={extra} asks for a {platform} run" if extra else f"a {platform} run was asked for"
    lines = [f"{asked}, but jax has no {platform} backend here: {why}"]
    plugin = [m for m in errors if "plugin" in m.lower() or platform in m.lower()]
    if plugin:
        lines.append("jax's plugin load error: " + " | ".join(plugin))
    packages = {p: installed(p) for p in PLUGIN_PACKAGES[platform]}
    lines.append("installed: " + ", ".join(f"{p} {v or '(not installed)'}" for p, v in packages.items()) +
                 f", jax {installed('jax')}, jaxlib {installed('jaxlib')}")
    fixes = []
    if not all(packages.values()):
        fixes.append(f"install jax with its {platform} plugin: JRC_JAX_EXTRA={extra or platform} ./scripts/run_tests.sh "
                     "(installs the plugin matching jax)")
    if platform == "rocm":
        sysdeps = sysdeps_dir()
        on_path = sysdeps and sysdeps in os.environ.get("LD_LIBRARY_PATH", "").split(":")
        if sysdeps and not on_path:
            fixes.append(f"this ROCm keeps librocm_sysdeps_* in {sysdeps}, outside the plugin's RUNPATH: "
                         f"export LD_LIBRARY_PATH={sysdeps}:$LD_LIBRARY_PATH")
        elif any("librocm_sysdeps" in m for m in errors):
            fixes.append("the plugin needs TheRock's librocm_sysdeps_* libraries: add the folder that holds them "
                         "(<rocm>/lib/rocm_sysdeps/lib) to LD_LIBRARY_PATH")
        fixes.append("the user must be able to open /dev/kfd and /dev/dri/renderD* (groups render and video)")
        fixes.append("supported: " + SUPPORTED_ROCM)
    else:
        fixes.append("nvidia-smi must list the GPU; jax[cuda13] needs an NVIDIA driver for CUDA 13")
    lines.append("fix: " + "; ".join(fixes))
    lines.append("or run without JRC_JAX_EXTRA to test on the CPU only")
    return "\n  ".join(lines)
