"""MLA (DeepSeek-V3/R1, Kimi-K2): RoPE of the decoupled rope dims and the latent-cache write, in one kernel.

The subpackage mirrors the main op's stack, imports pointing down inside it:
    api -> primitive -> kernels (CPU / CUDA / ROCm lowerings), xla -> reference -> contract
and below it the package's own contract, reference, backends and primitive machinery. Public
names: `jax_rope_cache.mla_rope_and_cache`, `make_mla_cache`, `read_mla_cache`;
`jax_rope_cache.mla.reference.mla_rope_and_cache` is the numpy oracle (no jax needed).
"""
