"""The draft-proposer interface: what the engine asks of any drafter (MTP head, n-gram lookup).

Shapes: m fed rows, H hidden.

Feeding convention: the target's pre-norm hidden at position i is paired with the committed token
at position i + 1. `observe_target` hands the proposer the hiddens of committed positions as the
engine learns them (prefill chunks, the accepted rows of a verify); a propose then drafts the
tokens that follow the last committed token.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from runtime.sample.grammar import GrammarMatcher

# The seed's propose command word (docs/design.md §4): header (slot, EP_CMD_MTP_PROPOSE), then exactly three
# u32 words last_token, position, num_drafts. ep.protocol's table takes it from here.
EP_CMD_MTP_PROPOSE = 0xFFFFFFF5


@dataclass(slots=True)
class ProposerState:
    """Per-sequence drafter state, opaque to the engine."""
    seq_id: int
    # Target hiddens not yet fed to the drafter: rows for positions fed_upto.. (in order), and
    # how many rows they hold (kept with them: the engine reads it for every sequence each step).
    # Change them through the methods below.
    pending_hidden: list[torch.Tensor] = field(default_factory=list)
    fed_upto: int = 0          # drafter rows 0..fed_upto-1 hold true (committed) inputs
    pending_rows: int = 0

    @property
    def pending_end(self) -> int:
        """The position after the last observed row: fed_upto plus the unfed rows."""
        return self.fed_upto + self.pending_rows

    def add_pending(self, rows: torch.Tensor) -> None:
        """Target hidden rows [n, H] for the next n unfed positions."""
        self.pending_hidden.append(rows)
        self.pending_rows += rows.shape[0]

    def keep_pending(self, n: int) -> None:
        """Keep the first n unfed rows only (0 drops them all)."""
        if n < self.pending_rows:
            self.pending_hidden[:] = [torch.cat(self.pending_hidden)[:n]] if n > 0 else []
            self.pending_rows = max(n, 0)

    def clear_pending(self) -> None:
        self.pending_hidden.clear()
        self.pending_rows = 0


@dataclass(frozen=True, slots=True)
class Drafts:
    tokens: list[int]
    probs: list[float]         # the drafter's top-1 probability of each token (1.0 for lookups)
    # (depth, token): the drafter's next-best tokens at each depth, when a tree asked for them
    hedges: list[tuple[int, int]] = field(default_factory=list)

    def cut(self, depth: int) -> Drafts:
        """The drafts up to `depth` (the spine and the hedges at depths 1..depth)."""
        return Drafts(self.tokens[:depth], self.probs[:depth], [h for h in self.hedges if h[0] <= depth])


@dataclass(slots=True)
class ProposeRequest:
    state: ProposerState
    token_ids: Sequence[int]   # every committed token of the sequence
    num_drafts: int            # 0: feed the unfed rows only (their cache rows become final), no drafts
    # Candidates per depth of a draft tree (speculative.tree_shape): the drafter's top-1 is the
    # spine, its next-best count - 1 tokens the hedges. Empty: a chain.
    tree: tuple[int, ...] = ()
    # The sequence's grammar state (its committed output consumed) when its output must match one:
    # drafters pick from what it allows after the drafts before, or cut where it refuses. Read only.
    grammar: GrammarMatcher | None = None


def cut_at_grammar(drafts: Drafts, grammar: GrammarMatcher | None) -> Drafts:
    """The drafts before the first spine token `grammar` refuses (verification would reject it and
    everything after it). A tree keeps that token's depth when it has hedges there: they are the
    sibling candidates after the allowed spine before them. No grammar: the drafts unchanged."""
    if grammar is None or not drafts.tokens:
        return drafts
    n = grammar.num_allowed(drafts.tokens)
    if n == len(drafts.tokens):
        return drafts
    return drafts.cut(n + 1 if any(depth == n + 1 for depth, _ in drafts.hedges) else n)


class DraftProposer(ABC):
    """A source of draft tokens. Implementations must not change any committed state of the target."""

    # Does this drafter keep rows in the KV cache (written when it is fed)? Then a sequence that
    # does not draft must still be fed now and then, or its blocks never become final (`num_final`).
    writes_cache_rows = False

    def alloc_state(self, seq_id: int) -> ProposerState:
        return ProposerState(seq_id=seq_id)

    def observe_target(self, state: ProposerState, hidden: torch.Tensor, rows: range, start: int) -> None:
        """Rows `rows` of a target forward's pre-norm hidden [T, H] belong to committed positions
        start..start+len(rows)-1 of `state`'s sequence."""
        if start != state.pending_end:
            raise ValueError(f"sequence {state.seq_id}: hidden rows from {start}, expected {state.pending_end}")
        state.add_pending(hidden[rows.start:rows.stop])

    @abstractmethod
    def propose(self, req: ProposeRequest) -> Drafts:
        """Draft up to `req.num_drafts` tokens after the last committed token."""

    def propose_batch(self, reqs: list[ProposeRequest]) -> list[Drafts] | None:
        """Draft for many sequences at once; None declines (the engine then goes one by one)."""
        return None

    def after_verify(self, state: ProposerState, num_accepted: int) -> None:
        """Trim the state to what the verify accepted (default: nothing to trim)."""

    def free_state(self, state: ProposerState) -> None:
        state.clear_pending()

    def reset_state(self, state: ProposerState) -> None:
        """Forget everything: the sequence was preempted and will be recomputed from scratch."""
        self.resume_at(state, 0)

    def resume_at(self, state: ProposerState, position: int) -> None:
        """The sequence starts over with positions 0..position-1 already computed (attached from
        the prefix cache, whose blocks hold this drafter's rows too): feeding resumes at `position`."""
        state.clear_pending()
        state.fed_upto = position

    def num_final(self, state: ProposerState, num_computed: int) -> int:
        """Leading positions whose cache rows this drafter will not write again, of the
        `num_computed` the target has: the prefix cache may share blocks only within them. A
        drafter without rows in the cache (the default) leaves them all final."""
        return num_computed
