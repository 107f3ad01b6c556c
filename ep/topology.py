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
    attention_tp: int = 1   # with dp_attention: ranks of an attention group, which split its heads (`--attention-tp`)

    def __post_init__(self) -> None:
        if not 0 <= self.ep_rank < self.ep_size:
            raise ValueError(f"ep_rank={self.ep_rank} outside 0..{self.ep_size - 1}")
        if self.num_experts < self.ep_size:
            raise ValueError(f"{self.num_experts} routed experts cannot be split over {self.ep_size} ranks")
        k = self.attention_tp
        if self.dp_attention:   # heads split only inside a group of `attention_tp` ranks
            if k < 1 or self.ep_size % k:
                raise ValueError(f"--attention-tp {k} does not divide --ep {self.ep_size}")
            if self.num_heads % k:
                raise ValueError(f"num_attention_heads={self.num_heads} is not divisible by --attention-tp {k}")
            if self.num_kv_heads % k and k % self.num_kv_heads:
                raise ValueError(f"num_key_value_heads={self.num_kv_heads} and --attention-tp {k}: "
                                 "one must divide the other")
            return
        if self.num_heads % self.ep_size:
            raise ValueError(f"num_attention_heads={self.num_heads} is not divisible by ep_size={self.ep_size}")
        if self.num_kv_heads % self.ep_size and self.ep_size % self.num_kv_heads:
            raise ValueError(f"num_key_value_heads={self.num_kv_heads} and ep_size={self.ep_size}: "
                             "one must divide the other")

    @classmethod
    def of(cls, cfg: ModelConfig, ep_rank: int, ep_size: int, dp_attention: bool = False,
           attention_tp: int = 1) -> "EPTopology":
        return cls(ep_rank=ep_rank, ep_size=ep_size, num_experts=cfg.n_routed_experts,
                   num_heads=cfg.num_attention_heads, num_kv_heads=cfg.num_key_value_heads,
                   vocab_size=cfg.vocab_size, dp_attention=dp_attention, attention_tp=attention_tp)

    @property
    def dp_size(self) -> int:
        """Attention groups that hold sequences of their own (`dp_attention`: ep_size / attention_tp;
        else one group of all)."""
        return self.ep_size // self.attention_tp if self.dp_attention else 1

    @property
    def dp_rank(self) -> int:
        """This rank's attention group among the `dp_size` (whose sequences it attends over)."""
        return self.ep_rank // self.attention_tp if self.dp_attention else 0

    @property
    def head_group(self) -> tuple[int, int]:
        """(ranks, this rank's place) of the split of attention heads: the attention group with
        `dp_attention`, else every rank."""
        if self.dp_attention:
            return self.attention_tp, self.ep_rank % self.attention_tp
        return self.ep_size, self.ep_rank

    def expert_range(self, rank: int | None = None) -> range:
        return even_split(self.num_experts, self.ep_size, self.ep_rank if rank is None else rank)

    @property
    def head_range(self) -> range:
        n, r = self.head_group
        per = self.num_heads // n
        return range(r * per, (r + 1) * per)

    @property
    def kv_head_range(self) -> range:
        """KV heads this rank holds: its share, or the one head its query heads read (replicated)."""
        n, r = self.head_group
        if self.num_kv_heads >= n:
            per = self.num_kv_heads // n
            return range(r * per, (r + 1) * per)
        h = r * self.num_kv_heads // n
        return range(h, h + 1)

    def vocab_range(self, rank: int | None = None) -> range:
        return even_split(self.vocab_size, self.ep_size, self.ep_rank if rank is None else rank)

    @property
    def max_vocab_shard(self) -> int:
        return len(self.vocab_range(0))
