"""Prepared verify plans: exact layouts, hits and misses, eviction by slot, and the dispatch order
the engine gives a batched verify (legacy and canonical, by the settings' width threshold)."""
from __future__ import annotations

import torch

from runtime.executor.kv_cache import PagedKVCache
from runtime.sample.sampler import SamplingParams
from engine.scheduler import Scheduled
from engine.sequence import Sequence
from engine.verifier import Verifier
from speculative.settings import SpecSettings
from speculative.proposer import Drafts
from speculative.tree_shape import TreeShape
from engine.verify_plan import VerifyPlanCache, build_verify_plan


def test_chain_and_tree_layouts():
    chain = build_verify_plan([4, 9], [3, 1], None)
    assert chain.key == (4, 3, 9, 1, 0xFFFFFFFF)
    assert chain.row_starts == (0, 4) and chain.logits_rows == list(range(6))
    assert [(s.depth, s.num_rows, s.parents) for s in chain.seqs] == [(3, 4, None), (1, 2, None)]
    tree = build_verify_plan([4, 9], [3, 1], TreeShape.parse("1,2,2"))
    assert tree.key == (4, 3, 9, 1, 0xFFFFFFFE)
    assert tree.row_starts == (0, 6) and tree.logits_rows == list(range(8))
    a, b = tree.seqs
    assert a.parents == (-1, 0, 1, 2, 1, 2)
    assert b.parents == (-1, 0)


def test_hits_misses_and_drop_by_slot():
    cache = VerifyPlanCache(TreeShape.parse("1,2"))
    p = cache.get([1, 2], [2, 2])
    assert cache.get([1, 2], [2, 2]) is p
    cache.get([2, 1], [2, 2])          # another dispatch order is another key
    cache.get([3], [2])
    cache.get([2, 5], [1, 1])
    assert (cache.hits, cache.misses, len(cache)) == (1, 4, 4)
    assert cache.drop_slot(2) == 3 and list(cache.plans) == [(3, 2, 0xFFFFFFFE)]
    assert cache.drop_slot(2) == 0 and cache.drop_slot(0xFFFFFFFE) == 0   # never the sentinel
    small = VerifyPlanCache(None, max_plans=2)
    for s in range(3):
        small.get([s], [1])
    assert list(small.plans) == [(1, 1, 0xFFFFFFFF), (2, 1, 0xFFFFFFFF)]   # the oldest went first


def fake_step(slots_and_depths: list[tuple[int, int]]) -> tuple[list[Scheduled], list[Drafts]]:
    batch, drafts = [], []
    for slot, k in slots_and_depths:
        seq = Sequence(seq_id=slot, prompt_len=3, token_ids=[1, 2, 3], params=SamplingParams(), seed=0)
        batch.append(Scheduled(seq, 1 if k else 3, k))
        drafts.append(Drafts(list(range(10, 10 + k)), [1.0] * k))
    return batch, drafts


def dispatch(slots_and_depths, min_width: int | None = 8):
    batch, drafts = fake_step(slots_and_depths)
    batch, drafts, plan = Verifier(SpecSettings(canonical_min_width=min_width)).order(batch, drafts)
    return [b.seq.seq_id for b in batch], [len(d.tokens) for d in drafts], plan.key


def test_engine_dispatch_takes_the_legacy_order_below_the_width_threshold():
    # slot 8 is prefilling: it goes after the verified sequences
    assert dispatch([(2, 3), (8, 0), (5, 1), (7, 2)]) == ([2, 7, 5, 8], [3, 2, 1, 0], (2, 3, 7, 2, 5, 1, 0xFFFFFFFF))
    assert dispatch([(2, 3), (5, 1), (7, 2)], min_width=None)[0] == [2, 7, 5]   # never canonical


def test_engine_dispatch_takes_the_canonical_order_at_the_threshold():
    # By slot; sorted depths laid on, each cut to what its sequence drafted (slot 5 drafted 1).
    assert dispatch([(2, 3), (8, 0), (5, 1), (7, 2)], min_width=3) == ([2, 5, 7, 8], [3, 1, 1, 0],
                                                                       (2, 3, 5, 1, 7, 1, 0xFFFFFFFF))
    assert dispatch([(2, 3), (5, 3), (7, 1)], min_width=3) == ([2, 5, 7], [3, 3, 1], (2, 3, 5, 3, 7, 1, 0xFFFFFFFF))


def test_kv_move_copies_every_layer_and_replays():
    a = PagedKVCache(num_layers=2, num_kv_heads=1, head_dim=2, num_blocks=4, block_size=4, dtype=torch.float64, device="cpu")
    b = PagedKVCache(num_layers=2, num_kv_heads=1, head_dim=2, num_blocks=4, block_size=4, dtype=torch.float64, device="cpu")
    a.journal = []
    a.reserve(0, 9)
    a.k.copy_(torch.arange(a.k.numel(), dtype=torch.float64).view_as(a.k))
    a.v.copy_(-a.k)
    src, dst = a.cells(0, 0, 9)[8], a.cells(0, 0, 9)[5]     # position 8 sits in another block
    want_k = a.k[:, src].clone()
    a.move(0, 8, 5)
    a.rewind(0, 6)
    assert torch.equal(a.k[:, dst], want_k) and torch.equal(a.v[:, dst], -want_k)
    assert a.journal == [("reserve", 0, 9), ("move", 0, 5 << 3 | 3), ("rewind", 0, 6)]
    b.k.copy_(torch.arange(b.k.numel(), dtype=torch.float64).view_as(b.k))
    for op in a.journal:
        b.replay(*op)
    assert torch.equal(b.k[:, dst], want_k) and b.length(0) == 6
