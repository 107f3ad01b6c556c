"""The verify half of a speculative step (DESIGN §5.2, §5.5, §5.6): dispatch order, the verify
rows of chains and trees, acceptance, and what is kept afterwards.

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

import logging
from typing import TYPE_CHECKING

import torch

from runtime.attention import SeqChunk
from runtime.sampler import sample_rows, target_probs
from runtime.scheduler import Scheduled
from speculative.knobs import mtp_accept_debug
from speculative.proposer import Drafts
from speculative.tree_shape import TreeShape, accepted_path, tree_mask, verify_rows
from speculative.verify import committed_tokens, rejection_tokens, target_tokens
from speculative.verify_key import canonical_order_applies, verify_batch_order
from speculative.verify_plan import SeqLayout, VerifyPlan, VerifyPlanCache

if TYPE_CHECKING:
    from runtime.engine import Engine

log = logging.getLogger("metrale.engine")


class Verifier:
    def __init__(self, engine: Engine, tree: TreeShape | None) -> None:
        self.engine = engine
        self.tree = tree
        self.plans = VerifyPlanCache(tree)

    # --- before the forward -------------------------------------------------------------------
    def dispatch(self, batch: list[Scheduled], drafts: list[Drafts]
                 ) -> tuple[list[Scheduled], list[Drafts], VerifyPlan | None]:
        """Put the verifying sequences first, in dispatch order, each cut to its dispatch depth
        (canonical order lays the sorted depths onto the slots; a sequence never gets more than
        it drafted), and fetch the plan for that key."""
        spec = [i for i, d in enumerate(drafts) if d.tokens]
        if not spec:
            return batch, drafts, None
        by_slot = {batch[i].seq.seq_id: i for i in spec}
        order, depths = verify_batch_order(list(by_slot), [len(drafts[i].tokens) for i in spec],
                                           canonical_order_applies(len(spec)))
        depths = [min(d, len(drafts[by_slot[s]].tokens)) for s, d in zip(order, depths)]
        plan = self.plans.get(order, depths)
        rest = [i for i in range(len(batch)) if not drafts[i].tokens]
        return ([batch[by_slot[s]] for s in order] + [batch[i] for i in rest],
                [drafts[by_slot[s]].cut(d) for s, d in zip(order, depths)] + [drafts[i] for i in rest], plan)

    def rows(self, item: Scheduled, d: Drafts, lay: SeqLayout) -> tuple[list[int], SeqChunk]:
        """The forward tokens and chunk of one verifying sequence."""
        seq = item.seq
        start = seq.num_computed
        root = seq.token_ids[start]
        if lay.block is None:
            return [root, *d.tokens], SeqChunk(seq.seq_id, start, 1 + len(d.tokens))
        rows = verify_rows(root, d.tokens, d.hedges)
        if len(rows) != lay.num_rows:
            raise RuntimeError(f"sequence {seq.seq_id}: the drafter gave {len(rows)} tree rows, the shape "
                               f"{self.tree.text} at depth {lay.depth} has {lay.num_rows}")
        return [t for t, _, _ in rows], SeqChunk(seq.seq_id, start, len(rows), tree_mask(start, lay.block),
                                                 start + lay.row_depth)

    # --- after the forward --------------------------------------------------------------------
    def verify(self, spec: list[tuple[Scheduled, Drafts, int]], plan: VerifyPlan, hidden: torch.Tensor,
               width: int, now: float) -> None:
        """Accept, commit, keep the accepted keys/values and feed the drafter, per sequence."""
        engine = self.engine
        logits = engine.runner.logits(hidden, plan.logits_rows)
        for (item, d, row), lay in zip(spec, plan.seqs):
            rows_logits = logits[row:row + lay.num_rows]
            if lay.block is None:
                self._verify_chain(item, d, row, rows_logits, hidden, width, now)
            else:
                self._verify_tree(item, d, row, rows_logits, hidden, width, now)
        if mtp_accept_debug() and engine.metrics.verifies % 200 < len(spec):
            log.info("mtp accept: %s", engine.metrics.summary())

    def _verify_chain(self, item: Scheduled, d: Drafts, row: int, rows_logits: torch.Tensor, hidden: torch.Tensor,
                      width: int, now: float) -> None:
        engine = self.engine
        seq, k = item.seq, len(d.tokens)
        start = seq.num_computed
        if engine.config.spec_verify == "rejection" and not seq.params.is_greedy:
            # The drafters here are deterministic (top-1 or lookup): q is one-hot at each draft.
            dists = [target_probs(r, seq.params) for r in rows_logits]
            na, commit = rejection_tokens(d.tokens, None, dists, seq.seed, start + 1)
            targets = commit + [-1] * (k + 1 - len(commit))
        else:
            targets = target_tokens(rows_logits, seq.params, seq.seed, start + 1)
            na, commit = committed_tokens(d.tokens, targets)
        # Rows 0..na had committed inputs (the pending token and the accepted drafts).
        self._keep(item, d, width, targets, na, k, hidden, [range(row, row + na + 1)], commit, now)

    def _verify_tree(self, item: Scheduled, d: Drafts, row: int, rows_logits: torch.Tensor, hidden: torch.Tensor,
                     width: int, now: float) -> None:
        seq = item.seq
        start = seq.num_computed
        rows = verify_rows(seq.token_ids[start], d.tokens, d.hedges)
        n = len(rows)
        # The token after a row at depth δ sits at start + δ + 1: the position plain decoding draws it at.
        targets = sample_rows(rows_logits, [seq.params] * n, [seq.seed] * n, [start + dep + 1 for _, dep, _ in rows])
        path, bonus = accepted_path(d.tokens, d.hedges, targets)
        na = len(path)
        observed = [range(row, row + na + 1)]
        if path and path[-1] > len(d.tokens):   # a hedge: its keys/values go to its depth's place
            self.engine.metrics.hedges_taken += 1
            self.engine.runner.cache.move(seq.seq_id, start + path[-1], start + na)
            observed = [range(row, row + na), range(row + path[-1], row + path[-1] + 1)]
        self._keep(item, d, width, targets, na, n - 1, hidden, observed, [rows[r][0] for r in path] + [bonus], now)

    def _keep(self, item: Scheduled, d: Drafts, width: int, targets: list[int], na: int, drafted: int,
              hidden: torch.Tensor, observed: list[range], commit: list[int], now: float) -> None:
        """Record the verify, rewind to the committed rows, feed their hiddens to the drafter, commit."""
        engine, seq = self.engine, item.seq
        start = seq.num_computed
        engine.metrics.record(width, d.tokens, targets, na)
        if engine.auto is not None:
            engine.auto.observe_verify(len(d.tokens), na)
        seq.num_verifies += 1
        seq.drafted_tokens += drafted
        seq.accepted_tokens += na
        seq.num_computed = start + na + 1
        engine.runner.cache.rewind(seq.seq_id, seq.num_computed)
        at = start
        for rows in observed:
            engine.observe_target(seq, hidden, rows, at)
            at += len(rows)
        engine.proposer.after_verify(engine.states[seq.seq_id], na)
        engine.commit(seq, commit, now)
