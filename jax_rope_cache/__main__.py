"""Command line: `python -m jax_rope_cache demo` (the README's main job) and `info`."""

from __future__ import annotations

import sys


def info() -> None:
    import jax

    from jax_rope_cache import _ffi

    print(f"jax {jax.__version__}; devices: {', '.join(f'{d.platform}:{d.device_kind}' for d in jax.devices())}")
    print(f"native kernels usable here: {', '.join(_ffi.kernel_platforms()) or 'none'}")


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: python -m jax_rope_cache {demo,info} [options]")
        return
    command, rest = argv[0], argv[1:]
    if command == "demo":
        from jax_rope_cache import demo

        demo.main(rest)
    elif command == "info":
        info()
    else:
        raise SystemExit(f"unknown command {command!r}; expected demo or info")


if __name__ == "__main__":
    main()
