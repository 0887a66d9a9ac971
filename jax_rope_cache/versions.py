"""The jax releases this package supports, and the check that the installed one is among them.

Policy: the oldest supported jax is OLDEST_JAX (jax 0.11.0's GPU plugins refuse the launcher's
command-buffer trait); the newest is the newest release tested, NEWEST_JAX; pyproject.toml's
`jax>=OLDEST,<next minor after NEWEST` says the same. CI runs the default test tier on both
(scripts/run_tests.sh with JRC_JAX_VERSION=OLDEST_JAX, and with the newest jax pip resolves).
"""

from __future__ import annotations

OLDEST_JAX = "0.11.1"
NEWEST_JAX = "0.12.0.1"
# jax[rocm7-local] of the newest jax whose ROCm plugin is published (jax 0.12.0.1 has none: its
# extra asks for jax-rocm7-plugin 0.12.0.1, which does not exist).
ROCM_JAX = "0.12.0"
# What the README, `check` and pyproject.toml say: the oldest release to the newest tested minor series.
_MAJOR_MINOR = ".".join(NEWEST_JAX.split(".")[:2])
SUPPORTED_JAX = f"{OLDEST_JAX} to {_MAJOR_MINOR}.x"
JAX_REQUIREMENT = f">={OLDEST_JAX},<{NEWEST_JAX.split('.')[0]}.{int(NEWEST_JAX.split('.')[1]) + 1}"


def _key(version: str) -> tuple[int, ...]:
    parts = []
    for p in version.split("+")[0].split("."):
        digits = "".join(c for c in p if c.isdigit()) if p[:1].isdigit() else ""
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


def jax_problem(jax_version: str, jaxlib_version: str | None = None) -> str | None:
    """Why an installed jax / jaxlib is not supported (None when it is)."""
    for name, v in (("jax", jax_version), ("jaxlib", jaxlib_version)):
        if v is not None and _key(v) < _key(OLDEST_JAX):
            return (f"jax_rope_cache needs {name} >= {OLDEST_JAX} (tested: {OLDEST_JAX} to {NEWEST_JAX}), found "
                    f"{name} {v}: pip install -U 'jax>={OLDEST_JAX}' 'jaxlib>={OLDEST_JAX}'")
    return None


def check_jax() -> None:
    """Raises ImportError when the installed jax or jaxlib is older than OLDEST_JAX."""
    import jax
    import jaxlib

    problem = jax_problem(jax.__version__, getattr(jaxlib, "__version__", None))
    if problem:
        raise ImportError(problem)
