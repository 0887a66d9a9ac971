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


MODELS = {
    "llama-3.1-8b": ModelShape("llama-3.1-8b", 32, 8, 128, 128),
    "llama-3.1-70b-tp8": ModelShape("llama-3.1-70b-tp8", 8, 1, 128, 128),
    "gpt-oss-120b-tp8": ModelShape("gpt-oss-120b-tp8", 8, 1, 64, 64),
    "gpt-oss-120b": ModelShape("gpt-oss-120b", 64, 8, 64, 64),
    "qwen3-32b-tp8": ModelShape("qwen3-32b-tp8", 8, 1, 128, 128),
    "tiny": ModelShape("tiny", 8, 2, 64, 64),
}
