"""Continuous batching: which sequences run this step and how many of their tokens.

Every step, running sequences come first (a decode row each, or the rest of a prefill); then
waiting sequences are admitted while there is room in the batch, in the token budget and in the
KV cache. Prompts are prefilled in chunks within the token budget. When the cache cannot hold a
running sequence's next tokens, the most recently admitted sequence (of its pool, where the cache
is split into a pool a rank) is preempted: its blocks are
freed and it goes back to the front of the queue, to be recomputed from its prompt and its
committed output (nothing it produced is lost).

With a prefix cache, a sequence is admitted with the longest cached prefix of its tokens attached
(`engine.prefix_cache`): those positions count as computed and only the rest is prefilled. A
preempted sequence's blocks stay cached, so its recompute mostly attaches them again.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from runtime.executor.kv_cache import PagedKVCache
from engine.prefix_cache import PrefixCache
from engine.sequence import Sequence, SequenceStatus


@dataclass(frozen=True, kw_only=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs={self.max_num_seqs} must be at least 1")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(f"max_num_batched_tokens={self.max_num_batched_tokens} must be at least "
                             f"max_num_seqs={self.max_num_seqs}")


@dataclass(slots=True)
class Scheduled:
    """One sequence's share of a step: `num_tokens` known tokens, then `num_draft_rows` draft rows."""
    seq: Sequence
    num_tokens: int
    num_draft_rows: int = 0


class Scheduler:
    def __init__(self, config: SchedulerConfig, cache: PagedKVCache, prefix: PrefixCache | None = None,
                 on_preempt: Callable[[Sequence], None] | None = None,
                 on_admit: Callable[[Sequence], None] | None = None) -> None:
        """`prefix`: the prefix cache over `cache` (None: every prompt is computed whole);
        `on_admit(seq)` runs once a sequence is admitted, its cached prefix counted computed."""
        self.config = config
        self.cache = cache
        self.prefix = prefix
        self.on_preempt = on_preempt
        self.on_admit = on_admit
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.num_prefix_queried_tokens = 0   # tokens of admitted sequences looked up in the prefix cache
        self.num_prefix_hit_tokens = 0       # of which found there

    def add(self, seq: Sequence) -> None:
        if len(seq.token_ids) + 1 > self.cache.capacity_tokens:
            raise ValueError(f"prompt of {len(seq.token_ids)} tokens cannot fit a KV cache of "
                             f"{self.cache.capacity_tokens} tokens")
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, draft_rows: Mapping[int, int] | None = None) -> list[Scheduled]:
        """Pick this step's sequences and token counts and reserve their cache.

        `draft_rows[seq_id]` is the draft rows a decoding sequence (one pending token) wants this
        step; its cache is reserved for them too (the drafter writes its rows there as well). A
        sequence whose rows do not fit the token budget gets none this step.
        """
        budget = self.config.max_num_batched_tokens
        batch: list[Scheduled] = []
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_pending, budget)
            k = draft_rows.get(seq.seq_id, 0) if draft_rows and seq.num_pending == 1 else 0
            if n + k > budget:
                k = 0
            if not self._reserve(seq, n + k):
                victim = self._victim(seq)
                self.running.remove(victim)
                self._preempt(victim)
                if victim is seq:
                    break
                continue
            batch.append(Scheduled(seq, n, k))
            budget -= n + k
            i += 1
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            hit = self.prefix.match(seq.seq_id, seq.token_ids) if self.prefix is not None else []
            # Admit only when the whole remaining prompt and a first output token fit.
            if not self.cache.can_reserve(seq.seq_id, len(seq.token_ids) + 1, hit):
                break
            if self.prefix is not None:
                self.prefix.attach(seq.seq_id, hit)
                seq.num_computed = len(hit) * self.cache.block_size
                self.num_prefix_queried_tokens += len(seq.token_ids)
                self.num_prefix_hit_tokens += seq.num_computed
                if seq.num_output == 0:
                    seq.num_cached_tokens = seq.num_computed
            n = min(seq.num_pending, budget)
            self._reserve(seq, n)
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.append(Scheduled(seq, n))
            budget -= n
            if self.on_admit is not None:
                self.on_admit(seq)
        return batch

    def commit(self, seq: Sequence, num_final: int) -> None:
        """The first `num_final` positions of a running `seq` hold their final keys/values (and
        drafter rows): index its full blocks there for later requests."""
        if self.prefix is not None:
            self.prefix.commit(seq.seq_id, seq.token_ids, num_final)

    def _free(self, seq: Sequence) -> None:
        if self.prefix is not None:
            self.prefix.free(seq.seq_id)
        else:
            self.cache.free(seq.seq_id)

    def _reserve(self, seq: Sequence, n: int) -> bool:
        end = seq.num_computed + n
        if not self.cache.can_reserve(seq.seq_id, end):
            return False
        self.cache.reserve(seq.seq_id, end)
        return True

    def _victim(self, seq: Sequence) -> Sequence:
        """Whom to preempt when `seq` cannot grow: the youngest admission whose blocks share its
        pool (a cache split into a pool a rank, data-parallel attention: another pool's blocks
        would not help), `seq` itself at the latest."""
        pool = self.cache.pool_of(seq.seq_id)
        return next(s for s in reversed(self.running) if self.cache.pool_of(s.seq_id) == pool)

    def _preempt(self, seq: Sequence) -> None:
        self._free(seq)
        seq.num_computed = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        if self.on_preempt is not None:
            self.on_preempt(seq)

    def finish(self, seq: Sequence) -> None:
        """Drop a finished or cancelled sequence from the queues and free its cache."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._free(seq)
        seq.status = SequenceStatus.FINISHED
