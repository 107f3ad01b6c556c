"""The engine loop on rank 0: requests in, one batched step at a time, tokens out.

Each step the scheduler picks sequences and token counts; the runner computes their rows in one
forward; sequences whose rows reach the end of their known tokens get a new token sampled with
the (seed, position) generator; finished sequences free their cache.
"""
from __future__ import annotations

import itertools
import random
import time
from dataclasses import dataclass

import torch

from runtime.attention import SeqChunk
from runtime.config import ModelConfig
from runtime.model_runner import ModelRunner
from runtime.sampler import SamplingParams, sample_rows
from runtime.scheduler import Scheduler, SchedulerConfig
from runtime.sequence import Sequence
from runtime.tokenizer import Tokenizer, find_stop


class RequestError(ValueError):
    """A request this engine refuses; the message names the bad value."""


@dataclass(frozen=True, kw_only=True, slots=True)
class EngineConfig:
    kv_cache_tokens: int = 32768
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024

    def __post_init__(self) -> None:
        if self.kv_cache_tokens < self.block_size:
            raise ValueError(f"kv_cache_tokens={self.kv_cache_tokens} must be at least one block "
                             f"({self.block_size} tokens)")


class Engine:
    def __init__(self, runner: ModelRunner, tokenizer: Tokenizer | None, config: EngineConfig) -> None:
        self.runner = runner
        self.model_config: ModelConfig = runner.config
        self.tokenizer = tokenizer
        self.config = config
        self.scheduler = Scheduler(SchedulerConfig(max_num_seqs=config.max_num_seqs,
                                                   max_num_batched_tokens=config.max_num_batched_tokens),
                                   runner.cache)
        self.max_model_len = min(self.model_config.max_position_embeddings, runner.cache.capacity_tokens)
        self._ids = itertools.count()
        self._rng = random.Random()
        self.num_steps = 0

    # --- requests -------------------------------------------------------------------------
    def add_request(self, prompt_ids: list[int], params: SamplingParams) -> Sequence:
        """Validate and queue one request; raises `RequestError` naming what is wrong."""
        vocab = self.model_config.vocab_size
        if not prompt_ids:
            raise RequestError("prompt is empty: at least one token is needed")
        bad = next((t for t in prompt_ids if not isinstance(t, int) or not 0 <= t < vocab), None)
        if bad is not None:
            raise RequestError(f"token id {bad!r} is outside the vocabulary (0..{vocab - 1})")
        if len(prompt_ids) >= self.max_model_len:
            raise RequestError(f"prompt of {len(prompt_ids)} tokens does not fit the context of "
                               f"{self.max_model_len} tokens (one output token needs room too)")
        seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        seq = Sequence(seq_id=next(self._ids), prompt_len=len(prompt_ids), token_ids=list(prompt_ids),
                       params=params, seed=seed)
        self.scheduler.add(seq)
        return seq

    def abort(self, seq: Sequence, reason: str = "abort") -> None:
        if not seq.is_finished:
            seq.finish_reason = reason
            seq.finish_time = time.perf_counter()
            self.scheduler.finish(seq)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # --- one step -------------------------------------------------------------------------
    def step(self) -> list[Sequence]:
        """Run one batched forward; returns the sequences that got a token (or finished)."""
        batch = self.scheduler.schedule()
        if not batch:
            if self.scheduler.waiting:
                raise RuntimeError("the KV cache cannot hold the next waiting request even when empty")
            return []
        tokens: list[int] = []
        chunks: list[SeqChunk] = []
        for seq, n in batch:
            tokens.extend(seq.token_ids[seq.num_computed:seq.num_computed + n])
            chunks.append(SeqChunk(seq.seq_id, seq.num_computed, n))
        hidden, plan = self.runner.forward(tokens, chunks)
        for seq, n in batch:
            seq.num_computed += n
        ready = [i for i, (seq, _) in enumerate(batch) if seq.num_pending == 0]
        self.num_steps += 1
        if not ready:
            return []
        logits = self.runner.logits(hidden[plan.last_rows[ready]])
        seqs = [batch[i][0] for i in ready]
        new = sample_rows(logits, [s.params for s in seqs], [s.seed for s in seqs],
                          [len(s.token_ids) for s in seqs])
        now = time.perf_counter()
        for seq, tok in zip(seqs, new):
            self.commit(seq, [tok], now)
        return seqs

    def commit(self, seq: Sequence, new_tokens: list[int], now: float) -> None:
        """Append tokens to a sequence, stopping at EOS, a stop string, max_tokens or the context."""
        if seq.first_token_time is None:
            seq.first_token_time = now
        eos = () if seq.params.ignore_eos else self.model_config.eos_token_ids
        reason = None
        for tok in new_tokens:
            seq.token_ids.append(tok)
            if tok in eos:
                reason = "stop"
            elif seq.num_output >= seq.params.max_tokens or len(seq.token_ids) >= self.max_model_len:
                reason = "length"
            if reason:
                break
        if self.tokenizer is not None and (reason or seq.params.stop):
            seq.text = self.tokenizer.decode(seq.output_ids)
            cut = find_stop(seq.text, seq.params.stop)
            if cut is not None:
                seq.text = seq.text[:cut]
                reason = "stop"
        if reason:
            seq.finish_reason = reason
            seq.finish_time = now
            self.scheduler.finish(seq)

    def run_to_completion(self) -> None:
        with torch.inference_mode():
            while self.has_unfinished():
                self.step()
