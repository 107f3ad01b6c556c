"""The engine on rank 0: requests in, one batched step at a time, tokens out.

A step is a few named phases and one postprocess:
1. plan: the depth policy gives each decoding sequence its draft depth and verify rows;
2. schedule: the scheduler picks sequences and token counts and reserves their cache;
3. propose: the drafter drafts each planned sequence's depth;
4. run: verifying sequences first (dispatch order), then plain rows, in one forward;
5. verify and sample: a `SeqUpdate` per sequence (verify rows, or a plain row's sampled token);
6. postprocess: move a taken hedge, rewind, feed the drafter, commit, finish.
"""
from __future__ import annotations

import itertools
import logging
import random
import time
from dataclasses import dataclass

import torch

from engine.verifier import SeqUpdate, Verifier, VerifyItem
from runtime.executor.attention import SeqChunk
from runtime.model.config import ModelConfig
from engine.detokenizer import IncrementalDetokenizer
from runtime.sample.grammar import GrammarCompiler
from runtime.executor.runner import ModelRunner
from engine.prefix_cache import PrefixCache, root_key
from runtime.sample.sampler import RowSpec, SamplingParams, TokenLogprobs, prompt_token_logprobs
from engine.scheduler import Scheduled, Scheduler, SchedulerConfig
from engine.sequence import Sequence, SequenceStatus
from engine.tokenizer import Tokenizer
from speculative.depth import NO_DRAFTS, DepthPolicy, DraftPlan
from speculative.metrics import AcceptanceMetrics
from speculative.proposer import DraftProposer, Drafts, ProposerState, ProposeRequest
from speculative.settings import SpecSettings

log = logging.getLogger("metrale.engine")
NO_DRAFT = Drafts([], [])
# Unfed rows of sequences that do not draft (with a complete block among them) that make a
# feed-only call worth its fixed cost (`Engine.feed_only`, keys and values alone: `MTPLayer.write`); the
# cost of a call by its rows is in docs/design.md §3, "Fed rows stop at their keys and values".
FEED_BATCH_ROWS = 256


class RequestError(ValueError):
    """A request this engine refuses; the message names the bad value, `param` the field."""

    def __init__(self, message: str, param: str = "prompt") -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, kw_only=True, slots=True)
class EngineConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024
    prefix_cache: bool = True   # attach cached full blocks of an earlier prompt instead of computing them

    def __post_init__(self) -> None:
        SchedulerConfig(max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens)


class Engine:
    def __init__(self, runner: ModelRunner, tokenizer: Tokenizer | None, config: EngineConfig,
                 spec: SpecSettings | None = None, proposer: DraftProposer | None = None) -> None:
        self.runner = runner
        self.model_config: ModelConfig = runner.config
        self.tokenizer = tokenizer
        self.config = config
        self.spec = spec or SpecSettings()
        if self.spec.is_speculating and proposer is None:
            raise ValueError(f"spec={self.spec.method!r} with {self.spec.num_drafts} drafts needs a proposer")
        self.proposer = proposer if self.spec.is_speculating else None
        self.states: dict[int, ProposerState] = {}
        self.metrics = AcceptanceMetrics()
        self.depth = DepthPolicy(self.spec)
        self.verifier = Verifier(self.spec, runner.sampler)
        self.scheduler = self._scheduler(runner, SchedulerConfig(
            max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens))
        self.max_model_len = min(self.model_config.max_position_embeddings, runner.cache.capacity_tokens)
        self._ids = itertools.count()
        self._rng = random.Random()
        self.num_steps = 0
        self.num_generated_tokens = 0   # output tokens committed, every sequence (the server's throughput)
        # Structured outputs need the tokenizer's token table; without a tokenizer they are refused.
        self.grammars = None if tokenizer is None else GrammarCompiler(
            tokenizer.to_json(), self.model_config.vocab_size, self.model_config.eos_token_ids, runner.cache.device)

    # --- requests -------------------------------------------------------------------------
    def add_request(self, prompt_ids: list[int], params: SamplingParams) -> Sequence:
        """Validate and queue one request; raises `RequestError` naming what is wrong."""
        self.validate_request(prompt_ids, params)
        seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        seq = Sequence(seq_id=next(self._ids), prompt_len=len(prompt_ids), token_ids=list(prompt_ids),
                       params=params, seed=seed,
                       stop_ids=() if params.ignore_eos else tuple(self.model_config.eos_token_ids))
        if params.logprobs is not None:
            seq.logprobs = []
        if params.prompt_logprobs is not None:
            seq.prompt_logprobs = [None]
        if self.tokenizer is not None:
            seq.detokenizer = IncrementalDetokenizer(self.tokenizer, params.stop or (), params.min_tokens)
        if params.structured is not None:
            seq.grammar = self.grammars.matcher(params.structured)
        self.scheduler.add(seq)
        if self.proposer is not None:
            self.states[seq.seq_id] = self.proposer.alloc_state(seq.seq_id)
        return seq

    def validate_request(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise `RequestError` when a request cannot be served; reads only fixed configuration."""
        vocab = self.model_config.vocab_size
        if not prompt_ids:
            raise RequestError("prompt is empty: at least one token is needed")
        bad = next((t for t in prompt_ids if not isinstance(t, int) or not 0 <= t < vocab), None)
        if bad is not None:
            raise RequestError(f"token id {bad!r} is outside the vocabulary (0..{vocab - 1})")
        if len(prompt_ids) >= self.max_model_len:
            raise RequestError(f"prompt of {len(prompt_ids)} tokens does not fit the context of "
                               f"{self.max_model_len} tokens (one output token needs room too)")
        bad = next((t for t, _ in params.logit_bias or () if t >= vocab), None)
        if bad is not None:
            raise RequestError(f"logit_bias token id {bad} is outside the vocabulary (0..{vocab - 1})",
                               param="logit_bias")
        if params.structured is not None:
            if self.grammars is None:
                raise RequestError("structured outputs need the model's tokenizer.json", param="structured")
            try:
                self.grammars.check(params.structured)
            except ValueError as exc:
                raise RequestError(str(exc), param="structured") from None

    def abort(self, seq: Sequence, reason: str = "abort") -> None:
        if not seq.is_finished:
            seq.finish_reason = reason
            seq.finish_time = time.perf_counter()
            self._finish(seq)

    def _finish(self, seq: Sequence) -> None:
        self.scheduler.finish(seq)
        self.verifier.plans.drop_slot(seq.seq_id)
        state = self.states.pop(seq.seq_id, None)
        if state is not None:
            self.proposer.free_state(state)

    def _scheduler(self, runner: ModelRunner, config: SchedulerConfig) -> Scheduler:
        prefix = None
        states = runner.cache.states   # the cache's layer-state backend (runtime.executor.kv_cache.LayerStates)
        if self.config.prefix_cache and not states.attachable:
            log.info("prefix caching is off for %s: reusing a cached block would need the %s layer state at "
                     "its end, %d bytes per sequence per block boundary kept (not kept)",
                     self.model_config.architecture, states.name, states.bytes_per_sequence)
        if self.config.prefix_cache and states.attachable:
            prefix = PrefixCache(runner.cache, root_key(repr(self.model_config), str(runner.model.dtype)))
        return Scheduler(config, runner.cache, prefix, on_preempt=self._on_preempt, on_admit=self._on_admit)

    def _on_admit(self, seq: Sequence) -> None:
        if seq.seq_id in self.states:
            self.proposer.resume_at(self.states[seq.seq_id], seq.num_computed)

    def _on_preempt(self, seq: Sequence) -> None:
        self.verifier.plans.drop_slot(seq.seq_id)
        if seq.seq_id in self.states:
            self.proposer.reset_state(self.states[seq.seq_id])

    def reset(self, runner: ModelRunner, proposer: DraftProposer | None) -> list[Sequence]:
        """Continue on a fresh runner (a restarted EP group: empty caches, reloaded weights).

        Every unfinished sequence is queued again, in arrival order, to recompute its prompt plus
        the tokens it has already committed; nothing committed is lost or changed, and sampling
        keyed by (seed, position) gives the same next tokens. Returns those sequences.
        """
        unfinished = sorted([*self.scheduler.running, *self.scheduler.waiting], key=lambda s: s.seq_id)
        self.runner = runner
        self.proposer = proposer if self.spec.is_speculating else None
        self.states = {}
        self.verifier.plans.clear()
        old = self.scheduler
        self.scheduler = self._scheduler(runner, old.config)
        self.scheduler.num_preemptions = old.num_preemptions
        self.scheduler.num_prefix_queried_tokens = old.num_prefix_queried_tokens
        self.scheduler.num_prefix_hit_tokens = old.num_prefix_hit_tokens
        for seq in unfinished:
            seq.num_computed = 0
            seq.status = SequenceStatus.WAITING
            self.scheduler.add(seq)
            if self.proposer is not None:
                self.states[seq.seq_id] = self.proposer.alloc_state(seq.seq_id)
        return unfinished

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # --- one step -------------------------------------------------------------------------
    def step(self) -> list[Sequence]:
        """Run one batched forward; returns the sequences that got tokens (or finished)."""
        t0 = time.perf_counter()
        width = len(self.scheduler.running)
        plans = self.plan()
        batch = self.scheduler.schedule({sid: p.num_rows for sid, p in plans.items()})
        if not batch:
            if self.scheduler.waiting:
                raise RuntimeError("the KV cache cannot hold the next waiting request even when empty")
            return []
        drafts = self.propose(batch, plans)
        batch, drafts, vplan = self.verifier.order(batch, drafts)
        tokens, chunks, items = self._rows(batch, drafts, vplan)
        hidden, _ = self.runner.forward(tokens, chunks)
        self.num_steps += 1
        updates = self.verify_and_sample(batch, chunks, items, vplan, hidden)
        self.postprocess(updates, hidden, len(batch))
        depth = self.depth.step_depth_taken
        if self.depth.auto is not None:
            if depth is not None and all(i.num_tokens == 1 for i in batch):
                # A pure decode step: what it cost at this width and depth, for the controller.
                self.depth.auto.record(width, depth, time.perf_counter() - t0)
            else:   # a prefill ran: the decode steps after it are not settled yet
                self.depth.auto.break_run(width)
        return [u.seq for u in updates if u.commit or u.seq.is_finished]

    def plan(self) -> dict[int, DraftPlan]:
        """Phase 1: the draft plan of every running sequence that decodes this step."""
        self.depth.step_depth_taken = None
        if self.proposer is None:
            return {}
        running = self.scheduler.running
        decoding = [s for s in running if s.num_pending == 1]
        if not decoding:
            return {}
        depth = self.depth.step_depth(len(running))
        self.depth.step_depth_taken = depth
        if depth == 0:   # above the width cap nobody drafts: no plan a sequence
            return {}
        plans = {}
        for s in decoding:
            room = min(s.params.max_tokens - s.num_output, self.max_model_len - len(s.token_ids))
            p = self.depth.plan(depth, room)
            if p.num_rows > 0:
                plans[s.seq_id] = p
        return plans

    def propose(self, batch: list[Scheduled], plans: dict[int, DraftPlan]) -> list[Drafts]:
        """Phase 3: drafts for every scheduled sequence that got its draft rows (others: none),
        cut where the confidence stop ended each chain."""
        out = [NO_DRAFT] * len(batch)
        if self.proposer is None:
            return out
        idx = [i for i, item in enumerate(batch) if item.num_draft_rows > 0]
        tree = self.spec.tree_shape
        depths = [plans.get(batch[i].seq.seq_id, NO_DRAFTS).depth for i in idx]
        reqs = [ProposeRequest(self.states[batch[i].seq.seq_id], batch[i].seq.token_ids, d,
                               tree.counts[:d] if tree is not None else (), batch[i].seq.grammar)
                for i, d in zip(idx, depths)]
        feeds = self.feed_only({batch[i].seq.seq_id for i in idx})
        got = self.proposer.propose_batch(reqs + feeds) if reqs or feeds else []
        if got is None:
            got = [self.proposer.propose(r) for r in reqs]
        for i, d, drafts in zip(idx, depths, got):
            out[i] = drafts.cut(self.depth.verify_depth(d, drafts.probs))
        return out

    def feed_only(self, drafting: set[int]) -> list[ProposeRequest]:
        """Feed-only requests (no drafts) for running sequences that do not draft this step and
        whose unfed rows complete a KV block, so the prefix cache can index it: a drafter with
        cache rows finalises a block only once it is fed (`num_final`), and above the width cap
        nobody drafts. A drafter call has a fixed cost (a feed-only call writes keys and values
        alone, `MTPLayer.write`, but its host work and GEMM calls are paid per call), so generated rows
        wait until the sequences with a complete unfed block hold FEED_BATCH_ROWS unfed rows
        between them, or the drafter runs anyway this step; a block wholly in a prompt, which
        later requests are likeliest to share, is fed at once after its prefill, and a finishing
        sequence's rows before it is freed (`_finish_fed`). Whenever a call is made, every
        sequence with a due block rides along."""
        if not self._feeds_blocks:
            return []
        size = self.runner.cache.block_size
        out, rows, urgent = [], 0, False
        for seq in self.scheduler.running:
            state = self.states.get(seq.seq_id)
            if seq.seq_id in drafting or state is None or not state.pending_rows:
                continue
            end = state.pending_end
            if end // size > state.fed_upto // size:
                out.append(ProposeRequest(state, seq.token_ids, 0, grammar=seq.grammar))
                rows += end - state.fed_upto
                urgent = urgent or min(end, seq.prompt_len) // size > state.fed_upto // size
        return out if drafting or urgent or rows >= FEED_BATCH_ROWS else []

    @property
    def _feeds_blocks(self) -> bool:
        """Whether sequences that do not draft must still feed the drafter (see `feed_only`)."""
        return self.proposer is not None and self.proposer.writes_cache_rows and self.scheduler.prefix is not None

    def _finish_fed(self, seqs: list[Sequence]) -> None:
        """Finish `seqs` (which ended this step), first feeding the drafter, in one call, the
        complete blocks they have not fed, so the prefix cache keeps their generated text (a
        conversation's next turn starts with it)."""
        if self._feeds_blocks:
            size = self.runner.cache.block_size
            feeds = []
            for seq in seqs:
                state = self.states.get(seq.seq_id)
                if state is None or not state.pending_rows:
                    continue
                # Row i pairs with token i + 1: the rows past the last committed token's
                # predecessor (verify rows past a stop, the last token's own row) have none.
                known = len(seq.token_ids) - 1 - state.fed_upto
                state.keep_pending(known)
                if known > 0 and (state.fed_upto + known) // size > state.fed_upto // size:
                    feeds.append(ProposeRequest(state, seq.token_ids, 0, grammar=seq.grammar))
            if feeds:
                self.proposer.propose_batch(feeds)
        for seq in seqs:
            self.cache_blocks(seq)
            self._finish(seq)

    def _rows(self, batch: list[Scheduled], drafts: list[Drafts], vplan
              ) -> tuple[list[int], list[SeqChunk], list[VerifyItem]]:
        """Phase 4's input: the forward tokens and chunks (verifying sequences first, in the
        plan's order), and each verifying sequence's place in the forward."""
        tokens: list[int] = []
        chunks: list[SeqChunk] = []
        items: list[VerifyItem] = []
        for i, (item, d) in enumerate(zip(batch, drafts)):
            seq = item.seq
            if d.tokens:
                layout = vplan.seqs[i]
                rows, chunk = self.verifier.rows(seq, d, layout)
                items.append(VerifyItem(seq, d, vplan.row_starts[i], layout))
            else:
                rows = seq.token_ids[seq.num_computed:seq.num_computed + item.num_tokens]
                chunk = SeqChunk(seq.seq_id, seq.num_computed, item.num_tokens)
            tokens.extend(rows)
            chunks.append(chunk)
        return tokens, chunks, items

    def verify_and_sample(self, batch: list[Scheduled], chunks: list[SeqChunk], items: list[VerifyItem],
                          vplan, hidden: torch.Tensor) -> list[SeqUpdate]:
        """Phase 5: a `SeqUpdate` per scheduled sequence. Verifying sequences accept drafts; plain
        rows that reach the end of their known tokens sample one token with the (seed, position)
        generator after the same per-row processing as verify rows; prefill chunks that do not only
        feed the drafter (and score the prompt when asked). Every row whose logits the step needs
        (verify rows, prompt-scoring rows, last rows) goes through the head in one call."""
        updates: list[SeqUpdate] = []
        plain: list[tuple[Sequence, int, int]] = []        # (sequence, its first row, rows)
        row = sum(c.num_tokens for c in chunks[:len(items)])
        for item, chunk in zip(batch[len(items):], chunks[len(items):]):
            plain.append((item.seq, row, item.num_tokens))
            row += chunk.num_tokens
        scored = self.prompt_rows(plain)
        last = [(s, r + n - 1) for s, r, n in plain if s.num_computed + n == len(s.token_ids)]
        verify_rows = vplan.logits_rows if items else []
        score_rows = [x for _, rows, _ in scored for x in rows]
        rows = [*verify_rows, *score_rows, *(r for _, r in last)]
        logits = self.runner.logits(hidden, rows) if rows else None
        if items:
            updates += self.verifier.verify(items, logits[:len(verify_rows)])
        self.score_prompts(scored, logits[len(verify_rows):len(verify_rows) + len(score_rows)] if scored else None)
        sampled = {}
        if last:
            rows = [RowSpec(s.params, s.seed, len(s.token_ids), s.history()) for s, _ in last]
            drawn = self.runner.sampler.sample_rows(logits[len(verify_rows) + len(score_rows):], rows)
            sampled = {s.seq_id: x for (s, _), x in zip(last, drawn)}
        for seq, r, n in plain:
            x = sampled.get(seq.seq_id)
            updates.append(SeqUpdate(seq=seq, num_computed=seq.num_computed + n,
                                     observed=[(range(r, r + n), seq.num_computed)],
                                     commit=[x.token] if x is not None else [],
                                     logprobs=[x.logprobs] if x is not None and x.logprobs is not None else None))
        return updates

    @staticmethod
    def prompt_rows(plain: list[tuple[Sequence, int, int]]) -> list[tuple[Sequence, list[int], list[int]]]:
        """The forward rows whose logits score prompt positions this step's prefill rows predict
        for the first time (a recompute after preemption or restart scores nothing twice): per
        sequence asking for prompt logprobs, (sequence, its rows, the prompt tokens they predict)."""
        want = []
        for seq, r, n in plain:
            if seq.prompt_logprobs is None:
                continue
            # Row i of the chunk predicts position num_computed + i + 1.
            first, end = len(seq.prompt_logprobs), min(seq.num_computed + n + 1, seq.prompt_len)
            if first < end:
                rows = [r + p - 1 - seq.num_computed for p in range(first, end)]
                want.append((seq, rows, seq.token_ids[first:end]))
        return want

    @staticmethod
    def score_prompts(scored: list[tuple[Sequence, list[int], list[int]]], logits: torch.Tensor | None) -> None:
        """Prompt logprobs of `prompt_rows`' positions from their logits rows, in that order."""
        at = 0
        for seq, rows, tokens in scored:
            seq.prompt_logprobs += prompt_token_logprobs(logits[at:at + len(rows)], tokens, seq.params,
                                                         seq.params.prompt_logprobs)
            at += len(rows)

    def postprocess(self, updates: list[SeqUpdate], hidden: torch.Tensor, width: int) -> None:
        """Phase 6, for plain and verify rows alike: move a taken hedge's keys/values, record the
        verify, set the cached length (rewinding past rejected rows), feed the drafter the rows
        whose inputs are committed, trim its state, commit the tokens."""
        now = time.perf_counter()
        cache = self.runner.cache
        ended: list[Sequence] = []
        for u in updates:
            seq, v = u.seq, u.verify
            if u.move is not None:
                cache.move(seq.seq_id, *u.move)
            if v is not None:
                self.metrics.record(width, v.drafts, v.targets, v.num_accepted)
                self.metrics.hedges_taken += int(v.hedge_taken)
                if self.depth.auto is not None:
                    self.depth.auto.observe_verify(len(v.drafts), v.num_accepted)
                seq.num_verifies += 1
                seq.drafted_tokens += v.num_draft_rows
                seq.accepted_tokens += v.num_accepted
                cache.rewind(seq.seq_id, u.num_computed)
            seq.num_computed = u.num_computed
            state = self.states.get(seq.seq_id)
            if state is not None:
                for rows, at in u.observed:
                    self.proposer.observe_target(state, hidden, rows, at)
                if v is not None:
                    self.proposer.after_verify(state, v.num_accepted)
            if not u.commit:
                self.cache_blocks(seq)
            elif self.commit(seq, u.commit, now, u.logprobs):
                ended.append(seq)
        if ended:
            self._finish_fed(ended)
        if self.spec.accept_debug and self.metrics.verifies and any(u.verify for u in updates) \
                and self.metrics.verifies % 200 < sum(u.verify is not None for u in updates):
            log.info("mtp accept: %s", self.metrics.summary())

    def commit(self, seq: Sequence, new_tokens: list[int], now: float,
               logprobs: list[TokenLogprobs] | None = None) -> bool:
        """Append tokens (and their logprobs, when kept) to a sequence, stopping at EOS, a complete
        grammar, a stop string, max_tokens or the context. Returns whether it ended (its reason
        set; the caller finishes it)."""
        if seq.first_token_time is None:
            seq.first_token_time = now
        reason = None
        added = 0
        for i, tok in enumerate(new_tokens):
            seq.token_ids.append(tok)
            if seq.logprobs is not None:
                seq.logprobs.append(logprobs[i])
            added += 1
            if tok in seq.stop_ids:
                reason = "stop"
            elif seq.grammar is not None and seq.grammar.commit(tok):
                reason = "stop"
            elif seq.num_output >= seq.params.max_tokens or len(seq.token_ids) >= self.max_model_len:
                reason = "length"
            if reason:
                break
        self.num_generated_tokens += added
        detok = seq.detokenizer
        if detok is not None:
            detok.append(seq.token_ids[len(seq.token_ids) - added:])
            if reason:
                detok.finish()
            if detok.stopped:
                reason = "stop"
            seq.text = detok.text
        if not reason:
            self.cache_blocks(seq)
            return False
        seq.finish_reason = reason
        seq.finish_time = now
        return True

    def cache_blocks(self, seq: Sequence) -> None:
        """Offer the prefix cache the positions of `seq` whose keys/values (and drafter rows) are final."""
        state = self.states.get(seq.seq_id)
        final = seq.num_computed if state is None else self.proposer.num_final(state, seq.num_computed)
        self.scheduler.commit(seq, final)
