"""The grammar mask at verification: a draft the grammar forbids is rejected even where the
target's raw logits pick it, each verify row is masked by the grammar state after its path, and
only committed tokens advance the matcher (docs/design.md §5.2)."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from engine.verifier import Verifier, VerifyItem
from runtime.sample.grammar import GrammarCompiler, StructuredOutput
from runtime.sample.sampler import SamplingParams
from engine.sequence import Sequence
from engine.tokenizer import Tokenizer
from speculative.proposer import Drafts
from speculative.settings import SpecSettings
from speculative.tree_shape import TreeShape
from engine.verify_plan import layout

EMBEDDED = Path(__file__).resolve().parents[2] / "models" / "tiny-glm-moe"
V = 4096
SEVEN, EIGHT, NINE, X = 23, 24, 25, 88        # "7", "8", "9", "x" in the embedded model's tokenizer
DIGITS = StructuredOutput.regex("[0-9]{1,6}")


@pytest.fixture(scope="module")
def grammars() -> GrammarCompiler:
    tok = Tokenizer(EMBEDDED)
    return GrammarCompiler(tok.to_json(), V, [0], device="cpu")


def row(*best: int) -> list[float]:
    """Logits with `best` ranked first, second, ... and everything else far below."""
    out = [0.0] * V
    for i, t in enumerate(best):
        out[t] = 40.0 - 10.0 * i
    return out


def verify(grammars, spec: SpecSettings, drafts: Drafts, rows: list[list[float]], params: SamplingParams,
           structured: StructuredOutput | None = DIGITS):
    """One sequence (prompt [1], pending output token "7") through the engine's Verifier."""
    params = replace(params, structured=structured)
    seq = Sequence(seq_id=0, prompt_len=1, token_ids=[1, SEVEN], params=params, seed=3, num_computed=1)
    if structured is not None:
        seq.grammar = grammars.matcher(structured)
        assert not seq.grammar.commit(SEVEN)
    item = VerifyItem(seq, drafts, 0, layout(len(drafts.tokens), spec.tree_shape))
    return seq, Verifier(spec).verify([item], torch.tensor(rows, dtype=torch.float64))[0]


CHAIN = SpecSettings(method="mtp", num_drafts=2)


def test_a_forbidden_draft_is_rejected_where_the_raw_logits_pick_it(grammars):
    # Row 0's raw arg-max is the draft "x"; the grammar (digits only) forbids it, so "8" is committed.
    rows = [row(X, EIGHT), row(NINE), row(NINE)]
    _, free = verify(grammars, CHAIN, Drafts([X, NINE], [1.0, 1.0]), rows, SamplingParams(), structured=None)
    assert free.commit == [X, NINE, NINE]                   # without the grammar both drafts are accepted
    _, u = verify(grammars, CHAIN, Drafts([X, NINE], [1.0, 1.0]), rows, SamplingParams())
    assert u.commit == [EIGHT] and u.verify.num_accepted == 0


def test_each_row_is_masked_after_the_drafts_on_its_path(grammars):
    # "7" pending, drafts "8","9": at most 6 digits, so after 7,8,9 three more may come; row 2's raw
    # pick "x" is masked to its second choice.
    rows = [row(EIGHT), row(NINE), row(X, SEVEN)]
    seq, u = verify(grammars, CHAIN, Drafts([EIGHT, NINE], [1.0, 1.0]), rows, SamplingParams(logprobs=0))
    assert u.commit == [EIGHT, NINE, SEVEN] and u.verify.num_accepted == 2
    assert u.logprobs[2].logprob > -1e-3                    # "x" got no mass: the mask came first
    # The verify left the matcher where the committed output put it ("7"): nothing was consumed for good.
    fresh = grammars.matcher(DIGITS)
    fresh.commit(SEVEN)
    assert torch.equal(seq.grammar.allowed_after(), fresh.allowed_after())


def test_a_complete_grammar_allows_only_eos_and_the_verify_stops_there(grammars):
    choice = StructuredOutput.choice(["78"])
    _, u = verify(grammars, CHAIN, Drafts([EIGHT, NINE], [1.0, 1.0]), [row(EIGHT), row(NINE), row(NINE)],
                  SamplingParams(), structured=choice)
    assert u.commit == [EIGHT, 0] and u.verify.num_accepted == 1    # row 1 may only give EOS


def test_rejection_mode_never_keeps_a_forbidden_draft(grammars):
    spec = SpecSettings(method="mtp", num_drafts=1, verify="rejection")
    params = SamplingParams(temperature=1.0)
    for seed in range(8):
        rows = [row(X, EIGHT), row(NINE)]
        seq = Sequence(seq_id=0, prompt_len=1, token_ids=[1, SEVEN], seed=seed, num_computed=1,
                       params=SamplingParams(temperature=1.0, structured=DIGITS))
        seq.grammar = grammars.matcher(DIGITS)
        seq.grammar.commit(SEVEN)
        u = Verifier(spec).verify([VerifyItem(seq, Drafts([X], [1.0]), 0, layout(1, None))],
                                  torch.tensor(rows, dtype=torch.float64))[0]
        assert u.verify.num_accepted == 0 and u.commit[0] != X
    _, free = verify(grammars, spec, Drafts([X], [1.0]), [row(X, EIGHT), row(NINE)], params, structured=None)
    assert free.verify.num_accepted == 1                    # unmasked, "x" carries nearly all the mass


def test_a_forbidden_hedge_is_not_taken_in_a_tree(grammars):
    tree = SpecSettings(method="mtp", num_drafts=1, tree_shape=TreeShape.parse("2"))
    # Rows: root, spine "9", hedge "x". The root's raw pick is "x": masked, it picks "8", which matches neither.
    rows = [row(X, EIGHT), row(NINE), row(NINE)]
    _, free = verify(grammars, tree, Drafts([NINE], [1.0], hedges=[(1, X)]), rows, SamplingParams(), structured=None)
    assert free.verify.hedge_taken and free.commit == [X, NINE]
    _, u = verify(grammars, tree, Drafts([NINE], [1.0], hedges=[(1, X)]), rows, SamplingParams())
    assert not u.verify.hedge_taken and u.commit == [EIGHT]
