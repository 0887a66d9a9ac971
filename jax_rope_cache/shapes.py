"""Named problem shapes shared by tests, benchmarks and the demo (numpy only)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """Per-shard attention shape of a model at a tensor-parallel degree."""

    name: str
    q_heads: int
    kv_heads: int
    head_dim: int
    rotary_dim: int
    is_neox: bool = True

    def bytes_per_token(self, in_size=2, table_size=4, cache_size=2, index_size=4, table_full=False) -> int:
        """The fewest bytes one token must move (baselines.md): read q/k/v, table row and two
        indices; write q_out/k_out and one K and one V cache row."""
        qh, kh, d, r = self.q_heads, self.kv_heads, self.head_dim, self.rotary_dim
        width = r if table_full else r // 2
        return ((qh + 2 * kh) * d * in_size + 2 * width * table_size + 2 * index_size
                + (qh + kh) * d * in_size + 2 * kh * d * cache_size)


# Full (TP 1) attention shapes; for the real models these agree with the configs in presets.py
# (tests/test_rope_tables.py checks it), whose shard_shape is the one rule for splitting heads.
MODELS = {
    "llama-3.1-8b": ModelShape("llama-3.1-8b", 32, 8, 128, 128),
    "llama-3.1-70b": ModelShape("llama-3.1-70b", 64, 8, 128, 128),
    "llama-3.1-405b": ModelShape("llama-3.1-405b", 128, 8, 128, 128),
    "gpt-oss-120b": ModelShape("gpt-oss-120b", 64, 8, 64, 64),
    "qwen3-32b": ModelShape("qwen3-32b", 64, 8, 128, 128),
    "qwen3-235b-a22b": ModelShape("qwen3-235b-a22b", 64, 4, 128, 128),
    "tiny": ModelShape("tiny", 8, 2, 64, 64),
}
TP_DEGREES = (1, 2, 4, 8)


def model_shape(name: str, tp: int = 1) -> ModelShape:
    """The per-shard shape of model `name` at tensor-parallel degree `tp`: query heads split evenly,
    KV heads split while there are enough and replicated (one per shard) beyond that
    (presets.shard_shape for the real models)."""
    if name not in MODELS:
        raise ValueError(f"preset: expected one of {sorted(MODELS)}, got {name!r}")
    from jax_rope_cache import presets  # presets imports this module

    if name in presets.PRESETS:
        return presets.preset_shape(name, tp)
    m = MODELS[name]
    if tp < 1 or m.q_heads % tp or (m.kv_heads >= tp and m.kv_heads % tp):
        raise ValueError(f"tp: expected a divisor of {m.q_heads} query heads and {m.kv_heads} KV heads, got {tp}")
    return dataclasses.replace(m, name=m.name if tp == 1 else f"{m.name}-tp{tp}", q_heads=m.q_heads // tp,
                               kv_heads=max(1, m.kv_heads // tp))
