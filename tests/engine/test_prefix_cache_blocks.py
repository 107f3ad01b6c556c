"""The prefix cache's bookkeeping: the hash chain, reference counts, the LRU, admission by eviction,
and the journal that keeps other ranks' allocators identical."""
from __future__ import annotations

import pytest

from runtime.executor.kv_cache import PagedKVCache
from engine.prefix_cache import PrefixCache, root_key
from runtime.sample.sampler import SamplingParams
from engine.scheduler import Scheduler, SchedulerConfig
from engine.sequence import Sequence

BS = 4
ROOT = root_key("model-a", "torch.float64")


def make(num_blocks: int = 8) -> tuple[PagedKVCache, PrefixCache]:
    cache = PagedKVCache(num_layers=1, num_kv_heads=1, head_dim=2, num_blocks=num_blocks, block_size=BS, device="cpu")
    return cache, PrefixCache(cache, ROOT)


def compute(cache: PagedKVCache, prefix: PrefixCache, seq_id: int, tokens: list[int]) -> list[int]:
    """Admit `tokens` as sequence `seq_id` the way the scheduler does, 'compute' it all and index it;
    returns the blocks it attached."""
    hit = prefix.match(seq_id, tokens)
    prefix.attach(seq_id, hit)
    cache.reserve(seq_id, len(tokens))
    prefix.commit(seq_id, tokens, len(tokens))
    return hit


def test_match_takes_full_blocks_and_leaves_the_last_token_to_compute():
    cache, prefix = make()
    a = list(range(1, 14))                        # 13 tokens: blocks 0..2 are full, and token 12 follows
    compute(cache, prefix, 0, a)
    table = cache.block_table(0)
    assert prefix.match(1, a) == table[:3]        # (13 - 1) // 4 = 3 blocks
    assert prefix.match(2, a[:12]) == table[:2]   # a 12-token prompt must compute its last token: 2 blocks
    assert prefix.match(3, a[:9] + [99, 98]) == table[:2]
    assert prefix.match(4, a[:8] + [99, 98]) == table[:1]   # block 1's next token (8) differs
    assert prefix.match(5, a[:4]) == []


def test_the_same_tokens_elsewhere_or_after_another_prefix_do_not_match():
    cache, prefix = make()
    compute(cache, prefix, 0, [1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert prefix.match(1, [5, 6, 7, 8, 9, 1]) == []                  # block 1's tokens at position 0
    assert prefix.match(2, [0, 2, 3, 4, 5, 6, 7, 8, 9, 1]) == []      # another first block
    assert prefix.match(3, [1, 2, 3, 4, 5, 6, 7, 8, 9, 1]) == cache.block_table(0)[:2]
    other = PrefixCache(cache, root_key("model-a", "torch.float32"))
    assert other.match(4, [1, 2, 3, 4, 5, 6, 7, 8, 9]) == []          # the dtype is in the root


def test_a_shared_block_is_freed_only_after_every_holder_ends():
    cache, prefix = make()
    tokens = list(range(1, 10))
    compute(cache, prefix, 0, tokens)
    shared = cache.block_table(0)[:2]
    for s in (1, 2):
        assert compute(cache, prefix, s, tokens + [s]) == shared
    assert [cache.refs(b) for b in shared] == [3, 3]
    free_before = cache.num_free_blocks
    for n, s in enumerate((0, 2), start=1):
        prefix.free(s)
        assert [cache.refs(b) for b in shared] == [3 - n] * 2
    assert cache.num_free_blocks == free_before + 2          # only the two sequences' own last blocks
    prefix.free(1)
    assert cache.num_free_blocks == 8 and [cache.refs(b) for b in shared] == [0, 0]
    assert prefix.match(3, tokens) == shared                 # freed, and still cached


def test_eviction_takes_the_least_recently_freed_block_and_never_one_in_use():
    cache, prefix = make(num_blocks=5)
    old, new, busy = [1, 2, 3, 4, 5], [6, 7, 8, 9, 10], [11, 12, 13]
    for s, tokens in enumerate((old, new, busy)):
        compute(cache, prefix, s, tokens)
    cached = [cache.block_table(s)[0] for s in (0, 1)]      # each one indexed block, then a partial one
    prefix.free(0)
    prefix.free(1)
    # The free queue, head first: 1's partial block, 0's partial block, 0's cached block, 1's.
    cache.reserve(3, 3 * BS)
    assert cached[0] in cache.block_table(3) and cached[1] not in cache.block_table(3)
    assert prefix.match(4, old) == [] and prefix.match(5, new) == [cached[1]]
    assert cache.block_table(2)[0] not in cache.block_table(3)   # sequence 2's block is in use
    with pytest.raises(Exception, match="needs 2 more blocks, 1 free"):
        cache.reserve(3, 4 * BS + 1)


def test_a_full_cache_still_admits_by_evicting_and_counts_hits():
    cache, prefix = make(num_blocks=4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), cache, prefix)
    params = SamplingParams(max_tokens=1)

    def admit(seq_id: int, tokens: list[int]) -> Sequence:
        seq = Sequence(seq_id=seq_id, prompt_len=len(tokens), token_ids=list(tokens), params=params, seed=0)
        sched.add(seq)
        [item] = sched.schedule()
        seq.num_computed += item.num_tokens
        sched.commit(seq, seq.num_computed)
        return seq

    first = admit(0, list(range(1, 14)))                    # 4 blocks with the output token: the whole pool
    assert cache.num_free_blocks == 0
    sched.finish(first)
    again = admit(1, list(range(1, 14)))
    assert again.num_cached_tokens == 12 and sched.num_prefix_hit_tokens == 12
    sched.finish(again)
    other = admit(2, list(range(50, 63)))                   # nothing in common: evicts every cached block
    assert other.num_cached_tokens == 0 and other.num_computed == 13
    assert sched.num_prefix_queried_tokens == 39 and sched.num_prefix_hit_tokens == 12


def test_the_journal_replays_to_identical_tables_and_free_order():
    cache, prefix = make(num_blocks=6)
    cache.journal = []
    tokens = list(range(1, 10))
    compute(cache, prefix, 0, tokens)
    compute(cache, prefix, 1, tokens + [7, 7])
    cache.rewind(1, 10)
    prefix.free(0)
    compute(cache, prefix, 2, tokens)
    assert ("attach", 1, cache.block_table(1)[0]) in cache.journal
    mirror = PagedKVCache(num_layers=1, num_kv_heads=1, head_dim=2, num_blocks=6, block_size=BS, device="cpu")
    for op in cache.journal:
        mirror.replay(*op)
    for s in (1, 2):
        assert mirror.block_table(s) == cache.block_table(s)
        assert mirror.num_attached_tokens(s) == cache.num_attached_tokens(s) == 8
    assert list(mirror.book.free) == list(cache.book.free)
    assert mirror.book.refs == cache.book.refs


def test_rewind_never_reaches_into_shared_blocks():
    cache, prefix = make()
    tokens = list(range(1, 10))
    compute(cache, prefix, 0, tokens)
    compute(cache, prefix, 1, tokens)
    with pytest.raises(ValueError, match="in shared blocks"):
        cache.rewind(1, 5)
