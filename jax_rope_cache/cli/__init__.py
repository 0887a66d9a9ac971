"""Command line: `python -m jax_rope_cache {info,generate,demo,bench,compile,check}` (also `jax-rope-cache`)."""

from __future__ import annotations

import json
import sys

COMMANDS = {
    "info": "version, devices, whether the kernel is usable on each platform present, cache dir, presets",
    "generate": "the README's main job: tiny models generating on the paged caches, checked against "
                "transformers, kernel vs XLA timed (generate.summary() names them)",
    "demo": "prefill + decode loop of the op alone over a preset's shapes, checked and timed",
    "bench": "kernel vs XLA path table (+ CSV/JSON/PNG) on the default device",
    "compile": "precompile code objects of presets into the disk cache (deployment hosts compile nothing)",
    "check": "the AMD GPU hardware check (scripts/rocm_check.sh): environment, ROCm GPU tests, both launcher "
             "targets, generate, bench; one report file (without an AMD GPU: says so)",
}


def _backend_platforms() -> list[str]:
    """jax platform names ("cpu", "cuda", "rocm") of the backends this process has."""
    import jax

    out = []
    for name in ("cpu", "cuda", "rocm"):
        try:
            jax.devices(name)
        except RuntimeError:
            continue
        out.append(name)
    return out


def rocm_summary() -> str:
    """The ROCm devices jax has, or that none was found (with jax's plugin error) and what is supported."""
    from jax_rope_cache import gpu_env

    why = gpu_env.backend_error("rocm")
    if why is None:
        import jax

        archs = sorted({str(getattr(d, "compute_capability", "?")) for d in jax.devices("rocm")})
        return f"{len(jax.devices('rocm'))} device(s), {', '.join(archs)}; ROCm {gpu_env.rocm_version() or '?'}"
    errors = [m for m in gpu_env.plugin_errors() if "rocm" in m.lower()]
    plugin = gpu_env.installed("jax-rocm7-plugin")
    found = (f"jax-rocm7-plugin {plugin} did not load ({' | '.join(errors) or why})" if plugin
             else "jax-rocm7-plugin is not installed")
    return f"no AMD GPU found ({found}); supported: {gpu_env.SUPPORTED_ROCM}"


def info(argv) -> None:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m jax_rope_cache info", description=COMMANDS["info"])
    parser.add_argument("--json", action="store_true", help="print the facts as JSON")
    args = parser.parse_args(argv)
    from jax_rope_cache import gpu_env

    gpu_env.capture_plugin_errors()  # before jax loads its backends
    import jax

    import jax_rope_cache
    from jax_rope_cache.backends import KERNEL_BACKENDS
    from jax_rope_cache.compilers.cache import cache_dir
    from jax_rope_cache.models import presets

    devices = jax.devices()
    arch = [getattr(d, "compute_capability", None) or getattr(d, "device_kind", "") for d in devices[:1]]
    kernels = {}
    for p in _backend_platforms():  # the devices present, not every platform the package knows
        backend = KERNEL_BACKENDS.get(p)
        problem = "no native kernel for this platform" if backend is None else backend.missing()
        kernels[p] = "usable" if problem is None else f"not usable: needs {problem}"
    data = dict(
        jax_rope_cache=jax_rope_cache.__version__, jax=jax.__version__, default_backend=jax.default_backend(),
        devices=[f"{d.platform}:{d.device_kind}" for d in devices], arch=arch[0] if arch else None,
        kernels=kernels, rocm=rocm_summary(), code_object_cache=cache_dir() or "off (JAX_ROPE_CACHE_DIR='')",
        presets={op: list(names) for op, names in presets.PRESET_GROUPS.items()},
        tp_degrees=list(presets.TP_DEGREES))
    if args.json:
        print(json.dumps(data, indent=1))
        return
    for key, value in data.items():
        if key == "presets":
            value = "; ".join(f"{op}: {', '.join(names)}" for op, names in value.items())
        elif isinstance(value, dict):
            value = "; ".join(f"{k} {v}" for k, v in value.items())
        print(f"{key:>18}: {', '.join(map(str, value)) if isinstance(value, list) else value}")


def compile_presets(argv) -> None:
    from jax_rope_cache.cli import aot

    aot.main(argv)


USAGE = "usage: python -m jax_rope_cache {" + ",".join(COMMANDS) + "} [options]"


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        from jax_rope_cache.cli import generate

        print(USAGE + "\n")
        for name, text in COMMANDS.items():
            print(f"  {name:<9}{generate.summary() if name == 'generate' else text}")
        return
    command, rest = argv[0], argv[1:]
    if command == "info":
        info(rest)
    elif command == "generate":
        from jax_rope_cache.cli import generate

        generate.main(rest)
    elif command == "demo":
        from jax_rope_cache.cli import demo

        demo.main(rest)
    elif command == "bench":
        from jax_rope_cache.cli import bench

        bench.main(rest)
    elif command == "compile":
        compile_presets(rest)
    elif command == "check":
        from jax_rope_cache.cli import check

        raise SystemExit(check.main(rest))
    else:  # as argparse reports a bad choice: usage and one error line on stderr, exit status 2
        print(f"{USAGE}\npython -m jax_rope_cache: error: unknown command {command!r}; expected one of "
              f"{', '.join(COMMANDS)}", file=sys.stderr)
        raise SystemExit(2)


if __name__ == "__main__":
    main()
