"""Grammar-aware drafting: the MTP drafter picks each draft from its logits masked by the grammar
after the drafts before it, so under a JSON schema more drafts are accepted per verify than with
its raw arg-max, for the same tokens; the n-gram drafter (and the sharded MTP spine) is cut before
the first token the grammar refuses; the committed grammar state never moves while drafting."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from bench.request_kinds import SCHEMA
from runtime.sample.grammar import GrammarCompiler, StructuredOutput
from runtime.sample.sampler import SamplingParams
from engine.tokenizer import Tokenizer
from serving.llm import LLM
from speculative.mtp import MTPProposer, grammar_masked
from speculative.ngram import NgramProposer
from speculative.proposer import Drafts, ProposerState, ProposeRequest, cut_at_grammar

EMBEDDED = Path(__file__).resolve().parents[2] / "models" / "tiny-glm-moe"
V = 4096
SEVEN, EIGHT, NINE, X = 23, 24, 25, 88        # "7", "8", "9", "x" in the embedded model's tokenizer
DIGITS = StructuredOutput.regex("[0-9]{1,6}")
PROMPTS = ["def fib(n):\n", "x = {", "class Stack:\n", "import os\n"]


@pytest.fixture(scope="module")
def grammars() -> GrammarCompiler:
    return GrammarCompiler(Tokenizer(EMBEDDED).to_json(), V, [0], device="cpu")


@pytest.fixture
def after_seven(grammars):
    """A digits-only matcher that has committed "7"."""
    m = grammars.matcher(DIGITS)
    m.commit(SEVEN)
    return m


def test_cut_at_grammar_stops_before_the_first_refused_spine_token(after_seven):
    before = after_seven.allowed_after()
    assert cut_at_grammar(Drafts([EIGHT, X, NINE], [0.9, 0.8, 0.7]), after_seven) == Drafts([EIGHT], [0.9])
    assert cut_at_grammar(Drafts([X, NINE], [0.9, 0.8]), after_seven) == Drafts([], [])
    whole = Drafts([EIGHT, NINE], [0.9, 0.8])
    assert cut_at_grammar(whole, after_seven) is whole and cut_at_grammar(whole, None) is whole
    # A tree keeps the refused spine token's depth when it has hedges there: "9" may still be taken.
    tree = Drafts([EIGHT, X, NINE], [0.9, 0.8, 0.7], hedges=[(1, SEVEN), (2, NINE), (3, EIGHT)])
    assert cut_at_grammar(tree, after_seven) == Drafts([EIGHT, X], [0.9, 0.8], hedges=[(1, SEVEN), (2, NINE)])
    assert torch.equal(after_seven.allowed_after(), before)     # only tried, never consumed


def test_ngram_lookup_is_cut_where_the_grammar_refuses(after_seven):
    # The tail "7" occurred at the start, followed by "8", "x", "9": only "8" fits the digits.
    state = ProposerState(seq_id=0)
    toks = [SEVEN, EIGHT, X, NINE, SEVEN]
    free = NgramProposer(max_ngram=1).propose(ProposeRequest(state, toks, 3))
    assert free.tokens == [EIGHT, X, NINE]
    got = NgramProposer(max_ngram=1).propose(ProposeRequest(state, toks, 3, grammar=after_seven))
    assert got.tokens == [EIGHT]


def test_grammar_masked_rows(after_seven):
    logits = torch.zeros(3, V)
    logits[:, X] = 5.0
    out = grammar_masked(logits, [after_seven, None, after_seven], [[], [], [X]])
    assert int(out[0].argmax()) != X and out[0, X] == float("-inf") and out[0, EIGHT] == 0.0
    assert torch.equal(out[1], logits[1])           # no grammar
    assert torch.equal(out[2], logits[2])           # a refused path: the row cannot be reached, left as it is
    assert grammar_masked(logits, [None, None, None], [[], [], []]) is logits


def run(llm: LLM, params: SamplingParams, is_masked: bool, monkeypatch) -> tuple[list[list[int]], int, int, int]:
    """Generate PROMPTS; returns (tokens, verifies, accepted drafts, drafts the grammar refuses)."""
    proposer = llm.engine.proposer
    refused = 0

    def propose_batch(reqs: list[ProposeRequest]) -> list[Drafts]:
        nonlocal refused
        got = MTPProposer.propose_batch(proposer, reqs if is_masked else [replace(r, grammar=None) for r in reqs])
        for r, d in zip(reqs, got):
            refused += len(d.tokens) - r.grammar.num_allowed(d.tokens)
        return got

    monkeypatch.setattr(proposer, "propose_batch", propose_batch)
    m = llm.engine.metrics
    verifies, accepted = m.verifies, m.accepted_tokens
    out = [o.token_ids for o in llm.generate(PROMPTS, params)]
    monkeypatch.undo()
    return out, m.verifies - verifies, m.accepted_tokens - accepted, refused


@pytest.mark.parametrize("tree_shape", [None, "1,2,2"], ids=["chain", "tree"])
def test_the_masked_drafter_is_accepted_more_under_a_json_schema(monkeypatch, tree_shape):
    llm = LLM(EMBEDDED, dtype="float64", kv_cache_tokens=4096, spec="mtp", num_drafts=3, draft_policy="fixed",
              tree_shape=tree_shape)
    params = SamplingParams(max_tokens=48, ignore_eos=True, structured=StructuredOutput.json_schema(SCHEMA))
    raw, raw_verifies, raw_accepted, raw_refused = run(llm, params, False, monkeypatch)
    out, verifies, accepted, refused = run(llm, params, True, monkeypatch)
    assert out == raw                                       # verification decides the tokens either way
    assert raw_refused > 0 and refused == 0                 # the raw arg-max breaks the schema; masked, never
    assert accepted / verifies > raw_accepted / raw_verifies
