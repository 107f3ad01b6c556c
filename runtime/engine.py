"""The engine loop on rank 0: requests in, one batched step at a time, tokens out.

Each step the scheduler picks sequences and token counts; the runner computes their rows in one
forward; sequences whose rows reach the end of their known tokens get a new token sampled with
the (seed, position) generator; finished sequences free their cache.
"""
from __future__ import annotations

import itertools
import logging
import random
import time
from dataclasses import dataclass

import torch

from runtime.attention import SeqChunk
from runtime.config import ModelConfig
from runtime.model_runner import ModelRunner
from runtime.sampler import SamplingParams, sample_rows
from runtime.scheduler import Scheduled, Scheduler, SchedulerConfig
from runtime.sequence import Sequence, SequenceStatus
from runtime.tokenizer import Tokenizer, find_stop
from runtime.verifier import Verifier
from speculative.auto_depth import AutoDepthController
from speculative.ladder import mtp_ladder_drafts, mtp_ladder_pinned, mtp_max_seqs
from speculative.metrics import AcceptanceMetrics
from speculative.proposer import DraftProposer, Drafts, ProposerState, ProposeRequest
from speculative.tree_shape import TreeShape

log = logging.getLogger("metrale.engine")


class RequestError(ValueError):
    """A request this engine refuses; the message names the bad value."""


@dataclass(frozen=True, kw_only=True, slots=True)
class EngineConfig:
    kv_cache_tokens: int = 32768
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024
    num_drafts: int = 0          # draft tokens per sequence per step when a proposer is given
    spec_verify: str = "exact"   # "exact": keyed target draws; "rejection": rejection sampling
    draft_policy: str = "ladder"  # "ladder": by running width (DESIGN §5.3); "fixed": num_drafts; "auto": online
    mtp_max_seqs: int | None = None  # width cap; None: the published cap (speculative.ladder.mtp_max_seqs)
    tree_shape: TreeShape | None = None  # draft trees (spine plus hedges) instead of chains; beats draft_policy

    def __post_init__(self) -> None:
        if self.tree_shape is not None and self.spec_verify != "exact":
            raise ValueError(f"tree speculation verifies with keyed target draws only, not spec_verify="
                             f"{self.spec_verify!r}")
        if self.draft_policy not in ("ladder", "fixed", "auto"):
            raise ValueError(f"draft_policy={self.draft_policy!r}: expected ladder, fixed or auto")
        if self.spec_verify not in ("exact", "rejection"):
            raise ValueError(f"spec_verify={self.spec_verify!r}: expected exact or rejection")
        if not 0 <= self.num_drafts <= 16:
            raise ValueError(f"num_drafts={self.num_drafts} must be in 0..16")
        if self.kv_cache_tokens < self.block_size:
            raise ValueError(f"kv_cache_tokens={self.kv_cache_tokens} must be at least one block "
                             f"({self.block_size} tokens)")


class Engine:
    def __init__(self, runner: ModelRunner, tokenizer: Tokenizer | None, config: EngineConfig,
                 proposer: DraftProposer | None = None) -> None:
        self.runner = runner
        self.model_config: ModelConfig = runner.config
        self.tokenizer = tokenizer
        self.config = config
        self.proposer = proposer if config.num_drafts > 0 else None
        self.states: dict[int, ProposerState] = {}
        self.metrics = AcceptanceMetrics()
        self.width_cap = config.mtp_max_seqs if config.mtp_max_seqs is not None else mtp_max_seqs()
        # A pinned ladder (--mtp-k-ladder or METRALE_MTP_K_LADDER) turns the controller off.
        self.tree = config.tree_shape if self.proposer is not None else None
        self.auto = (AutoDepthController(config.num_drafts)
                     if config.draft_policy == "auto" and self.proposer is not None and not mtp_ladder_pinned()
                     and self.tree is None else None)
        self.verifier = Verifier(self, self.tree)
        self._step_depth: int | None = None
        self._step_width = 0
        self.scheduler = Scheduler(SchedulerConfig(max_num_seqs=config.max_num_seqs,
                                                   max_num_batched_tokens=config.max_num_batched_tokens),
                                   runner.cache, on_preempt=self._on_preempt)
        self.max_model_len = min(self.model_config.max_position_embeddings, runner.cache.capacity_tokens)
        self._ids = itertools.count()
        self._rng = random.Random()
        self.num_steps = 0

    # --- requests -------------------------------------------------------------------------
    def add_request(self, prompt_ids: list[int], params: SamplingParams) -> Sequence:
        """Validate and queue one request; raises `RequestError` naming what is wrong."""
        self.validate_request(prompt_ids, params)
        seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        seq = Sequence(seq_id=next(self._ids), prompt_len=len(prompt_ids), token_ids=list(prompt_ids),
                       params=params, seed=seed)
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
        self.proposer = proposer if self.config.num_drafts > 0 else None
        self.states = {}
        preemptions = self.scheduler.num_preemptions
        self.scheduler = Scheduler(self.scheduler.config, runner.cache, on_preempt=self._on_preempt)
        self.scheduler.num_preemptions = preemptions
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
        """Run one batched forward; returns the sequences that got tokens (or finished).

        Sequences still prefilling compute a chunk of their prompt; decoding sequences compute
        their pending token, followed by drafts when a proposer is set, verified in the same
        forward. Prefill rows and accepted rows are handed to the proposer as target hiddens.
        """
        t0 = time.perf_counter()
        self._step_depth = None
        batch = self.scheduler.schedule(self._drafts_for if self.proposer is not None else None)
        if not batch:
            if self.scheduler.waiting:
                raise RuntimeError("the KV cache cannot hold the next waiting request even when empty")
            return []
        batch, drafts, vplan = self.verifier.dispatch(batch, self._propose(batch))
        tokens: list[int] = []
        chunks: list[SeqChunk] = []
        for i, (item, d) in enumerate(zip(batch, drafts)):
            seq = item.seq
            if d.tokens:  # verifying sequences come first, in the plan's order
                rows, chunk = self.verifier.rows(item, d, vplan.seqs[i])
                tokens.extend(rows)
                chunks.append(chunk)
                continue
            tokens.extend(seq.token_ids[seq.num_computed:seq.num_computed + item.num_tokens])
            chunks.append(SeqChunk(seq.seq_id, seq.num_computed, item.num_tokens))
        hidden, _ = self.runner.forward(tokens, chunks)
        self.num_steps += 1
        row = 0
        plain: list[tuple[Sequence, int]] = []       # (sequence, hidden row of its last token)
        spec: list[tuple[Scheduled, Drafts, int]] = []
        for item, d, chunk in zip(batch, drafts, chunks):
            if d.tokens:
                spec.append((item, d, row))
            else:
                seq = item.seq
                self.observe_target(seq, hidden, range(row, row + item.num_tokens), seq.num_computed)
                seq.num_computed += item.num_tokens
                if seq.num_pending == 0:
                    plain.append((seq, row + item.num_tokens - 1))
            row += chunk.num_tokens
        now = time.perf_counter()
        done: list[Sequence] = []
        if plain:
            seqs = [s for s, _ in plain]
            logits = self.runner.logits(hidden, [r for _, r in plain])
            new = sample_rows(logits, [s.params for s in seqs], [s.seed for s in seqs],
                              [len(s.token_ids) for s in seqs])
            for seq, tok in zip(seqs, new):
                self.commit(seq, [tok], now)
            done.extend(seqs)
        if spec:
            self.verifier.verify(spec, vplan, hidden, len(batch), now)
            done.extend(item.seq for item, _, _ in spec)
        if self.auto is not None and self._step_depth is not None and all(i.num_tokens == 1 for i in batch):
            # A pure decode step: what it cost at this width and depth, for the controller.
            self.auto.record(self._step_width, self._step_depth, time.perf_counter() - t0)
        return done

    # --- speculation ----------------------------------------------------------------------
    def _drafts_for(self, seq: Sequence) -> int:
        """Drafts for a decoding sequence this step (the depth planner): the ladder's count for the
        running width (capped by --num-drafts), none at all above the width cap, clamped so that the
        committed tokens (accepted drafts plus the bonus) never pass max_tokens or the context."""
        n_active = len(self.scheduler.running)
        if n_active > self.width_cap:
            return 0
        room = min(seq.params.max_tokens - seq.num_output, self.max_model_len - len(seq.token_ids)) - 1
        if self.tree is not None:  # draft rows of the whole tree, cut to the depths that fit
            return self.tree.nodes_at(max(0, min(self.tree.spine_len, room)))
        if self.auto is not None:
            if self._step_depth is None:  # one depth for the whole step
                self._step_depth = self.auto.depth_for(n_active)
                self._step_width = n_active
            k = self._step_depth
        elif self.config.draft_policy == "fixed":
            k = self.config.num_drafts
        else:
            k = mtp_ladder_drafts(n_active, self.config.num_drafts)
        return max(0, min(k, room))

    def _propose(self, batch: list[Scheduled]) -> list[Drafts]:
        none = Drafts([], [])
        if self.proposer is None:
            return [none] * len(batch)
        idx = [i for i, item in enumerate(batch) if self._depth(item) > 0]
        reqs = [ProposeRequest(self.states[batch[i].seq.seq_id], batch[i].seq.token_ids, self._depth(batch[i]),
                               self.tree.counts[:self._depth(batch[i])] if self.tree is not None else ())
                for i in idx]
        got = self.proposer.propose_batch(reqs) if reqs else []
        if got is None:
            got = [self.proposer.propose(r) for r in reqs]
        out = [none] * len(batch)
        for i, d in zip(idx, got):
            out[i] = d.cut(self._depth(batch[i]))
        return out

    def _depth(self, item: Scheduled) -> int:
        """Draft depth of a scheduled sequence: its draft rows, or the deepest tree cut they hold."""
        return item.num_drafts if self.tree is None else self.tree.depth_for_nodes(item.num_drafts)

    def observe_target(self, seq: Sequence, hidden: torch.Tensor, rows: range, start: int) -> None:
        """Hand rows of a target forward (committed positions from `start`) to the drafter."""
        if self.proposer is not None and seq.seq_id in self.states:
            self.proposer.observe_target(self.states[seq.seq_id], hidden, rows, start)

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
            self._finish(seq)

    def run_to_completion(self) -> None:
        with torch.inference_mode():
            while self.has_unfinished():
                self.step()
