"""Prompt-lookup (n-gram) drafting: continue the most recent earlier match of the sequence's tail,
cut before the first token the sequence's grammar (if any) refuses."""
from __future__ import annotations

from speculative.proposer import DraftProposer, Drafts, ProposerState, ProposeRequest, cut_at_grammar


class NgramProposer(DraftProposer):
    def __init__(self, max_ngram: int = 3, min_ngram: int = 1) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"n-gram sizes {min_ngram}..{max_ngram} must satisfy 1 <= min <= max")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def observe_target(self, state: ProposerState, hidden, rows: range, start: int) -> None:
        """Lookup needs only the tokens; hiddens are not kept."""

    def propose(self, req: ProposeRequest) -> Drafts:
        toks = list(req.token_ids)
        k = req.num_drafts
        for n in range(min(self.max_ngram, len(toks) - 1), self.min_ngram - 1, -1):
            tail = toks[-n:]
            for start in range(len(toks) - n - 1, -1, -1):  # most recent earlier occurrence first
                if toks[start:start + n] == tail:
                    cont = toks[start + n:start + n + k]
                    if cont:
                        return cut_at_grammar(Drafts(cont, [1.0] * len(cont)), req.grammar)
        return Drafts([], [])
