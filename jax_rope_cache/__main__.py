"""`python -m jax_rope_cache ...`: the command line (jax_rope_cache/cli)."""

from jax_rope_cache.cli import main

if __name__ == "__main__":
    main()
