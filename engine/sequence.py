"""A request's sequence: its tokens, how many of them are in the KV cache, and how it ended."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from engine.detokenizer import IncrementalDetokenizer
from runtime.sample.grammar import GrammarMatcher
from runtime.sample.sampler import History, SamplingParams, TokenLogprobs


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Sequence:
    seq_id: int
    prompt_len: int
    token_ids: list[int]            # prompt followed by every committed output token
    params: SamplingParams
    seed: int                       # the request seed, or one drawn at arrival when none was given
    stop_ids: tuple[int, ...] = ()  # token ids that end it (EOS), masked until params.min_tokens
    num_computed: int = 0           # leading tokens whose keys/values are in the cache
    num_cached_tokens: int = 0      # prompt tokens found in the prefix cache, not computed
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    text: str = ""                  # the output text so far (its detokenizer's, cut at a stop string)
    detokenizer: IncrementalDetokenizer | None = None
    grammar: GrammarMatcher | None = None   # params.structured's state: the committed output consumed
    num_preemptions: int = 0
    num_verifies: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    arrival_time: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    finish_time: float | None = None
    # One entry per output token, from the verify or decode row that produced it (params.logprobs).
    logprobs: list[TokenLogprobs] | None = None
    # One entry per prompt token, None for the first (params.prompt_logprobs); filled by the prefill.
    prompt_logprobs: list[TokenLogprobs | None] | None = None

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len:]

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def num_pending(self) -> int:
        """Tokens known but not yet in the cache (the whole prompt at first, then 1 per decode)."""
        return len(self.token_ids) - self.num_computed

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def history(self, path: list[int] | tuple[int, ...] = ()) -> History:
        """The tokens before a row's token: everything committed, then `path` (drafts on the row's
        path), and the grammar's mask after them."""
        allowed = self.grammar.allowed_after(path) if self.grammar is not None else None
        return History(self.token_ids, self.prompt_len, path, self.stop_ids, allowed)

    @property
    def cumulative_logprob(self) -> float | None:
        """The sum of the output tokens' logprobs (None when they are not kept)."""
        return None if self.logprobs is None else sum(lp.logprob for lp in self.logprobs)


@dataclass(frozen=True, kw_only=True, slots=True)
class RequestOutput:
    index: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    num_verifies: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    cached_tokens: int = 0
    ttft_s: float | None = None
    latency_s: float | None = None
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    cumulative_logprob: float | None = None

    @classmethod
    def of(cls, index: int, seq: Sequence) -> RequestOutput:
        ttft = None if seq.first_token_time is None else seq.first_token_time - seq.arrival_time
        latency = None if seq.finish_time is None else seq.finish_time - seq.arrival_time
        return cls(index=index, prompt_token_ids=seq.token_ids[:seq.prompt_len], token_ids=list(seq.output_ids),
                   text=seq.text, finish_reason=seq.finish_reason, num_verifies=seq.num_verifies,
                   drafted_tokens=seq.drafted_tokens, accepted_tokens=seq.accepted_tokens,
                   cached_tokens=seq.num_cached_tokens, ttft_s=ttft, latency_s=latency,
                   logprobs=None if seq.logprobs is None else list(seq.logprobs),
                   prompt_logprobs=None if seq.prompt_logprobs is None else list(seq.prompt_logprobs),
                   cumulative_logprob=seq.cumulative_logprob)
