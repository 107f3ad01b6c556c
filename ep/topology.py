"""Who owns what across EP ranks: expert ranges, attention heads, vocabulary slices.

Checked once at start; every rank computes the same answer from (ep_size, model config).
Uneven splits are allowed: the first `n % ep_size` ranks take one more.
"""
from __future__ import annotations

from dataclasses import dataclass

from runtime.model.config import ModelConfig


def even_split(n: int, parts: int, index: int) -> range:
    """The `index`-th of `parts` contiguous ranges covering 0..n, sizes differing by at most one."""
    base, extra = divmod(n, parts)
    start = index * base + min(index, extra)
    return range(start, start + base + (1 if index < extra else 0))


@dataclass(frozen=True, kw_only=True, slots=True)
class EPTopology:
    ep_rank: int
    ep_size: int
    num_experts: int
    num_heads: int
    num_kv_heads: int
    vocab_size: int
    # Data-parallel attention (`--dp-attention`, docs/design.md §4.3): attention, dense layers, norms,
    # embeddings and the LM head stay whole on every rank, which runs them over its own sequences'
    # rows; only the routed experts are split.
    dp_attention: bool = False

    def __post_init__(self) -> None:
        if not 0 <= self.ep_rank < self.ep_size:
            raise ValueError(f"ep_rank={self.ep_rank} outside 0..{self.ep_size - 1}")
        if self.num_experts < self.ep_size:
            raise ValueError(f"{self.num_experts} routed experts cannot be split over {self.ep_size} ranks")
        if self.dp_attention:
            return   # no head is split
        if self.num_heads % self.ep_size:
            raise ValueError(f"num_attention_heads={self.num_heads} is not divisible by ep_size={self.ep_size}")
        if self.num_kv_heads % self.ep_size and self.ep_size % self.num_kv_heads:
            raise ValueError(f"num_key_value_heads={self.num_kv_heads} and ep_size={self.ep_size}: "
                             "one must divide the other")

    @classmethod
    def of(cls, cfg: ModelConfig, ep_rank: int, ep_size: int, dp_attention: bool = False) -> "EPTopology":
        return cls(ep_rank=ep_rank, ep_size=ep_size, num_experts=cfg.n_routed_experts,
                   num_heads=cfg.num_attention_heads, num_kv_heads=cfg.num_key_value_heads,
                   vocab_size=cfg.vocab_size, dp_attention=dp_attention)

    @property
    def dp_size(self) -> int:
        """Ranks that hold sequences of their own: every rank with `dp_attention`, else one group of all."""
        return self.ep_size if self.dp_attention else 1

    @property
    def dp_rank(self) -> int:
        """This rank's place among the `dp_size` data-parallel ranks (whose sequences it attends over)."""
        return self.ep_rank if self.dp_attention else 0

    def expert_range(self, rank: int | None = None) -> range:
        return even_split(self.num_experts, self.ep_size, self.ep_rank if rank is None else rank)

    @property
    def head_range(self) -> range:
        per = self.num_heads // self.ep_size
        return range(self.ep_rank * per, (self.ep_rank + 1) * per)

    @property
    def kv_head_range(self) -> range:
        """KV heads this rank holds: its share, or the one head its query heads read (replicated)."""
        if self.num_kv_heads >= self.ep_size:
            per = self.num_kv_heads // self.ep_size
            return range(self.ep_rank * per, (self.ep_rank + 1) * per)
        h = self.ep_rank * self.num_kv_heads // self.ep_size
        return range(h, h + 1)

    def vocab_range(self, rank: int | None = None) -> range:
        return even_split(self.vocab_size, self.ep_size, self.ep_rank if rank is None else rank)

    @property
    def max_vocab_shard(self) -> int:
        return len(self.vocab_range(0))
