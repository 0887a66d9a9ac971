"""Command line: `python -m jax_rope_cache {info,demo,bench,compile}` (also `jax-rope-cache`)."""

from __future__ import annotations

import json
import sys

COMMANDS = {
    "info": "platforms, native kernels usable here, device architecture, code-object cache dir",
    "demo": "the README's main job: prefill + decode loop of a preset, checked and timed",
    "bench": "kernel vs XLA path table (+ CSV/JSON/PNG) on the default device",
    "compile": "precompile code objects of presets into the disk cache (deployment hosts compile nothing)",
}


def info(argv) -> None:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m jax_rope_cache info", description=COMMANDS["info"])
    parser.add_argument("--json", action="store_true", help="print the facts as JSON")
    args = parser.parse_args(argv)

    import jax

    from jax_rope_cache.backends import kernel_platforms
    from jax_rope_cache.compilers.cache import cache_dir
    from jax_rope_cache.models import presets

    devices = jax.devices()
    arch = [getattr(d, "compute_capability", None) or getattr(d, "device_kind", "") for d in devices[:1]]
    data = dict(
        jax=jax.__version__, default_backend=jax.default_backend(),
        devices=[f"{d.platform}:{d.device_kind}" for d in devices], arch=arch[0] if arch else None,
        native_kernels=kernel_platforms(),
        code_object_cache=cache_dir() or "off (JAX_ROPE_CACHE_DIR='')",
        presets=sorted(presets.MODELS), tp_degrees=list(presets.TP_DEGREES))
    if args.json:
        print(json.dumps(data, indent=1))
        return
    for key, value in data.items():
        print(f"{key:>18}: {', '.join(map(str, value)) if isinstance(value, list) else value}")


def compile_presets(argv) -> None:
    from jax_rope_cache.cli import aot

    aot.main(argv)


USAGE = "usage: python -m jax_rope_cache {" + ",".join(COMMANDS) + "} [options]"


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE + "\n")
        for name, text in COMMANDS.items():
            print(f"  {name:<9}{text}")
        return
    command, rest = argv[0], argv[1:]
    if command == "info":
        info(rest)
    elif command == "demo":
        from jax_rope_cache.cli import demo

        demo.main(rest)
    elif command == "bench":
        from jax_rope_cache.cli import bench

        bench.main(rest)
    elif command == "compile":
        compile_presets(rest)
    else:  # as argparse reports a bad choice: usage and one error line on stderr, exit status 2
        print(f"{USAGE}\npython -m jax_rope_cache: error: unknown command {command!r}; expected one of "
              f"{', '.join(COMMANDS)}", file=sys.stderr)
        raise SystemExit(2)


if __name__ == "__main__":
    main()
