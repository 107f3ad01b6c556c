"""The verify phase of a speculative step (docs/design.md §5.2, §5.5, §5.6): dispatch order, the verify
rows of chains and trees, and acceptance. It returns a result per sequence; the engine's one
postprocess applies it.

Shapes: n verify rows of one sequence, R verify rows of the step, V vocab.

Sequences that verify go first in the step's forward, in the order `verify_batch_order` gives, and
their layout comes from a plan cached under the verify graph key. A chain's rows are the pending
token and its drafts, causal. A tree's rows are `verify_rows` of its spine and hedges, each at
position start + depth, seeing the committed context and its ancestors; the target token after a
row is keyed by the position that row's successor would occupy, so seeded sampling stays
lossless. Only the accepted path's keys/values are kept: its spine rows are in place already, a
taken hedge is moved to its depth's place, and the rest is rewound.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from runtime.executor.attention import SeqChunk
from runtime.sample.sampler import TokenLogprobs, process_logits, sampling_probs, token_logprobs
from engine.scheduler import Scheduled
from engine.sequence import Sequence
from speculative.proposer import Drafts
from speculative.settings import SpecSettings
from speculative.tree_shape import accepted_path, verify_rows
from engine.verify import chain_rows, committed_tokens, rejection_tokens, target_tokens, tree_rows
from engine.verify_key import verify_batch_order
from engine.verify_plan import SeqLayout, VerifyPlan, VerifyPlanCache


@dataclass(frozen=True, slots=True)
class VerifyStats:
    """What one verify of one sequence drafted and accepted (for the metrics and the controller)."""
    drafts: list[int]           # the spine (the chain)
    targets: list[int]          # the target's token after each verify row (-1 where rejection sampling stopped)
    num_accepted: int           # na
    num_draft_rows: int         # draft rows verified (the spine plus a tree's hedges)
    hedge_taken: bool = False


@dataclass(frozen=True, slots=True)
class SeqUpdate:
    """What one sequence's rows of a step change; `Engine.postprocess` applies it.

    `observed`: forward rows whose inputs are now committed, with the position of the first
    (the drafter is fed them in this order). `num_computed`: the sequence's cached length after
    the step (a verify rewinds the cache to it). `move`: a taken hedge's keys/values go from cache
    position src to dst. `commit`: tokens to append; `logprobs`: theirs, one each from the row that
    produced it, when the request keeps them.
    """
    seq: Sequence
    num_computed: int
    observed: list[tuple[range, int]] = field(default_factory=list)
    commit: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] | None = None
    move: tuple[int, int] | None = None
    verify: VerifyStats | None = None


@dataclass(frozen=True, slots=True)
class VerifyItem:
    """One verifying sequence in the step's forward."""
    seq: Sequence
    drafts: Drafts
    row: int                    # its first row in the forward
    layout: SeqLayout


class Verifier:
    def __init__(self, spec: SpecSettings) -> None:
        self.spec = spec
        self.tree = spec.tree_shape
        self.plans = VerifyPlanCache(self.tree)

    # --- before the forward -------------------------------------------------------------------
    def order(self, batch: list[Scheduled], drafts: list[Drafts]
              ) -> tuple[list[Scheduled], list[Drafts], VerifyPlan | None]:
        """Put the verifying sequences first, in dispatch order, each cut to its dispatch depth
        (canonical order lays the sorted depths onto the slots; a sequence never gets more than
        it drafted), and fetch the plan for that key. Returns the batch and drafts reordered."""
        spec = [i for i, d in enumerate(drafts) if d.tokens]
        if not spec:
            return batch, drafts, None
        by_slot = {batch[i].seq.seq_id: i for i in spec}
        order, depths = verify_batch_order(list(by_slot), [len(drafts[i].tokens) for i in spec],
                                           self.spec.canonical_order(len(spec)))
        depths = [min(d, len(drafts[by_slot[s]].tokens)) for s, d in zip(order, depths)]
        plan = self.plans.get(order, depths)
        rest = [i for i in range(len(batch)) if not drafts[i].tokens]
        return ([batch[by_slot[s]] for s in order] + [batch[i] for i in rest],
                [drafts[by_slot[s]].cut(d) for s, d in zip(order, depths)] + [drafts[i] for i in rest], plan)

    def rows(self, seq: Sequence, d: Drafts, lay: SeqLayout) -> tuple[list[int], SeqChunk]:
        """The forward tokens and chunk of one verifying sequence."""
        start = seq.num_computed
        root = seq.token_ids[start]
        if lay.parents is None:
            return [root, *d.tokens], SeqChunk(seq.seq_id, start, 1 + len(d.tokens))
        rows = verify_rows(root, d.tokens, d.hedges)
        if len(rows) != lay.num_rows:
            raise RuntimeError(f"sequence {seq.seq_id}: the drafter gave {len(rows)} tree rows, the shape "
                               f"{self.tree.text} at depth {lay.depth} has {lay.num_rows}")
        return [t for t, _, _ in rows], SeqChunk(seq.seq_id, start, len(rows), lay.parents)

    # --- after the forward --------------------------------------------------------------------
    def verify(self, items: list[VerifyItem], logits: torch.Tensor) -> list[SeqUpdate]:
        """Accept per sequence; `logits` [R, V] are the plan's logits rows, in item order."""
        out, at = [], 0
        for item in items:
            n = item.layout.num_rows
            rows_logits = logits[at:at + n]
            at += n
            out.append(self._chain(item, rows_logits) if item.layout.parents is None else self._tree(item, rows_logits))
        return out

    def _chain(self, item: VerifyItem, rows_logits: torch.Tensor) -> SeqUpdate:
        seq, d, row = item.seq, item.drafts, item.row
        k, start = len(d.tokens), seq.num_computed
        rows = chain_rows(seq, d.tokens)
        logprobs = None
        if self.spec.verify == "rejection" and not seq.params.is_greedy:
            # The drafters here are deterministic (top-1 or lookup): q is one-hot at each draft.
            processed = [process_logits(lg, seq.params, r.history) for lg, r in zip(rows_logits, rows)]
            dists = [sampling_probs(p, seq.params) for p in processed]
            na, commit = rejection_tokens(d.tokens, None, dists, seq.seed, start + 1)
            targets = commit + [-1] * (k + 1 - len(commit))
            if seq.params.logprobs is not None:
                logprobs = [token_logprobs(p, t, seq.params.logprobs) for p, t in zip(processed, commit)]
        else:
            sampled = target_tokens(rows_logits, rows)
            targets = [s.token for s in sampled]
            na, commit = committed_tokens(d.tokens, targets)
            if seq.params.logprobs is not None:
                logprobs = [s.logprobs for s in sampled[:na + 1]]
        # Rows 0..na had committed inputs (the pending token and the accepted drafts).
        return SeqUpdate(seq=seq, num_computed=start + na + 1, observed=[(range(row, row + na + 1), start)],
                         commit=commit, logprobs=logprobs, verify=VerifyStats(d.tokens, targets, na, k))

    def _tree(self, item: VerifyItem, rows_logits: torch.Tensor) -> SeqUpdate:
        seq, d, row = item.seq, item.drafts, item.row
        start = seq.num_computed
        rows = verify_rows(seq.token_ids[start], d.tokens, d.hedges)
        n = len(rows)
        # The token after a row at depth δ sits at start + δ + 1: the position plain decoding draws it at.
        sampled = target_tokens(rows_logits, tree_rows(seq, rows))
        targets = [s.token for s in sampled]
        path, bonus = accepted_path(d.tokens, d.hedges, targets)
        na = len(path)
        # Each committed token came from the row before it on the path: the root, then the path's rows.
        logprobs = [sampled[r].logprobs for r in [0, *path]] if seq.params.logprobs is not None else None
        observed = [(range(row, row + na + 1), start)]
        move = None
        hedge = bool(path) and path[-1] > len(d.tokens)
        if hedge:   # its keys/values go to its depth's place; its hidden follows the spine's
            move = (start + path[-1], start + na)
            observed = [(range(row, row + na), start), (range(row + path[-1], row + path[-1] + 1), start + na)]
        return SeqUpdate(seq=seq, num_computed=start + na + 1, observed=observed,
                         commit=[rows[r][0] for r in path] + [bonus], logprobs=logprobs, move=move,
                         verify=VerifyStats(d.tokens, targets, na, n - 1, hedge_taken=hedge))
