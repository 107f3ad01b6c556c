"""Ownership across ranks, uneven splits included."""
from __future__ import annotations

import pytest

from ep.topology import EPTopology, even_split


def test_uneven_expert_split_6_over_4():
    topo = [EPTopology(ep_rank=r, ep_size=4, num_experts=6, num_heads=4, num_kv_heads=2, vocab_size=10)
            for r in range(4)]
    assert [list(t.expert_range()) for t in topo] == [[0, 1], [2, 3], [4], [5]]
    assert [list(t.head_range) for t in topo] == [[0], [1], [2], [3]]
    assert [list(t.kv_head_range) for t in topo] == [[0], [0], [1], [1]]  # replicated kv heads
    assert [list(t.vocab_range()) for t in topo] == [[0, 1, 2], [3, 4, 5], [6, 7], [8, 9]]
    assert topo[0].max_vocab_shard == 3


def test_even_split_covers_everything_once():
    for n in range(1, 20):
        for parts in range(1, 6):
            covered = [i for p in range(parts) for i in even_split(n, parts, p)]
            assert covered == list(range(n))


@pytest.mark.parametrize("kwargs, match", [(dict(num_heads=6), "num_attention_heads=6"),
                                           (dict(num_experts=2), "2 routed experts"),
                                           (dict(num_kv_heads=3), "num_key_value_heads=3"),
                                           (dict(ep_rank=4), "ep_rank=4")])
def test_refused_topologies(kwargs, match):
    base = dict(ep_rank=0, ep_size=4, num_experts=8, num_heads=8, num_kv_heads=2, vocab_size=100)
    with pytest.raises(ValueError, match=match):
        EPTopology(**{**base, **kwargs})
