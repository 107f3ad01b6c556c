"""Penalties, bias, min_p, min_tokens and logprobs give the same tokens and logprobs with speculation on
and off (float64, in-process): plain rows, chain verify rows and tree verify rows go through one
per-row processing with the tokens accepted before each row.

Two checkpoints: the random test checkpoint with an MTP layer (few drafts accepted under penalties)
and the embedded trained model, whose drafter is accepted most of the time, so many verify rows
draw after drafts accepted earlier in the same verify."""
from __future__ import annotations

from pathlib import Path

import pytest

from runtime.sample.sampler import SamplingParams
from serving.llm import LLM

EMBEDDED = Path(__file__).resolve().parents[2] / "models" / "tiny-glm-moe"
PROMPTS = {"random": [[5, 17, 200, 3, 5, 17, 200], [9, 9, 9, 100, 250, 31, 7, 64, 12, 13, 14], [300],
                      [41, 42, 41, 42, 41]],
           "embedded": ["def fib(n):\n", "import os\nimport sys\n", "class Stack:\n    def __init__(self):\n",
                        "for i in range(10):\n"]}
PENALTIES = dict(presence_penalty=0.2, frequency_penalty=0.1, repetition_penalty=1.1, logit_bias={5: 1.5, 17: -2.0})
PARAMS = {
    "greedy": SamplingParams(max_tokens=24, ignore_eos=True, logprobs=3, prompt_logprobs=2, **PENALTIES),
    "seeded": SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.8, top_k=60, min_p=0.02, seed=7,
                             logprobs=3, **PENALTIES),
    # EOS (id 0) pushed to the top but held back by min_tokens: the requests end right after.
    "min_tokens": SamplingParams(max_tokens=24, min_tokens=6, logprobs=0, logit_bias={0: 30}, frequency_penalty=0.5),
}
SPECS = {"chain": dict(spec="mtp", num_drafts=3), "tree": dict(spec="mtp", num_drafts=3, tree_shape="1,2,2")}


@pytest.fixture(scope="module")
def models(ckpt_mtp):
    """which -> (checkpoint, its plain float64 LLM), loaded on first use."""
    cache: dict[str, tuple[Path, LLM]] = {}

    def get(which: str) -> tuple[Path, LLM]:
        if which not in cache:
            path = ckpt_mtp if which == "random" else EMBEDDED
            cache[which] = path, LLM(path, dtype="float64", kv_cache_tokens=4096)
        return cache[which]
    return get


def same(got, want) -> None:
    """Tokens, finish and logprobs equal; logprob values to float64 rounding (the rows ran in a
    different batch shape), the top alternatives' ids exactly."""
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.finish_reason for o in got] == [o.finish_reason for o in want]
    for g, w in zip(got, want):
        for entries in ("logprobs", "prompt_logprobs"):
            ge, we = getattr(g, entries) or [], getattr(w, entries) or []
            assert len(ge) == len(we)
            for a, b in zip(ge, we):
                if a is None or b is None:
                    assert a is b
                    continue
                assert a.token == b.token and abs(a.logprob - b.logprob) < 1e-9
                assert [t for t, _ in a.top] == [t for t, _ in b.top]
                assert all(abs(x - y) < 1e-9 for (_, x), (_, y) in zip(a.top, b.top))


CASES = [(w, n, s) for w in PROMPTS for n in PARAMS for s in SPECS if (w, n) != ("embedded", "min_tokens")]


@pytest.mark.parametrize("which, name, spec", CASES, ids=["-".join(c) for c in CASES])
def test_same_tokens_and_logprobs_with_and_without_speculation(models, which, name, spec):
    path, plain = models(which)
    params, prompts = PARAMS[name], PROMPTS[which]
    want = plain.generate(prompts, params)
    assert all(len(o.logprobs) == len(o.token_ids) for o in want)
    llm = LLM(path, dtype="float64", kv_cache_tokens=4096, **SPECS[spec])
    same(llm.generate(prompts, params), want)                                 # width 4
    same([llm.generate([p], params)[0] for p in prompts], want)               # width 1
    m = llm.engine.metrics
    # Verification really decided: drafts accepted (the rows after them drew with them in their history).
    assert 0 < m.accepted_tokens < m.drafted_tokens
    if which == "embedded" and name != "min_tokens":
        assert m.accepted_tokens > 0.1 * m.drafted_tokens


@pytest.mark.parametrize("which", list(PROMPTS))
def test_min_tokens_holds_eos_back(models, which):
    _, plain = models(which)
    out = plain.generate(PROMPTS[which], PARAMS["min_tokens"])
    unheld = plain.generate(PROMPTS[which], SamplingParams(max_tokens=24, logit_bias={0: 30}, frequency_penalty=0.5))
    assert [o.token_ids for o in unheld] == [[0]] * 4          # without it, EOS comes first
    for o in out:
        assert 0 not in o.token_ids[:6]
        assert o.finish_reason == "stop" and o.token_ids[6] == 0 and len(o.token_ids) == 7


def test_rejection_mode_applies_the_bias_on_every_verify_row(ckpt_mtp):
    llm = LLM(ckpt_mtp, dtype="float64", kv_cache_tokens=4096, spec="mtp", num_drafts=3, spec_verify="rejection")
    params = SamplingParams(max_tokens=16, ignore_eos=True, temperature=1.0, seed=5, logit_bias={77: 100}, logprobs=1)
    outs = llm.generate(PROMPTS["random"], params)
    assert all(o.token_ids == [77] * 16 for o in outs)
    assert all(lp.logprob > -1e-6 and lp.top[0][0] == 77 for o in outs for lp in o.logprobs)
    assert llm.engine.metrics.verifies > 0


def verify_one(spec, drafts, logits: list[list[float]], params: SamplingParams):
    """One sequence (prompt [1], pending output token 0) verified by the engine's Verifier."""
    import torch

    from engine.verifier import Verifier, VerifyItem
    from engine.sequence import Sequence
    from engine.verify_plan import layout
    seq = Sequence(seq_id=0, prompt_len=1, token_ids=[1, 0], params=params, seed=1, num_computed=1)
    verifier = Verifier(spec)
    item = VerifyItem(seq, drafts, 0, layout(len(drafts.tokens), spec.tree_shape))
    return verifier.verify([item], torch.tensor(logits, dtype=torch.float64))[0]


def test_a_verify_row_is_penalised_by_the_drafts_accepted_before_it():
    """Row 1 would pick 2 again, but 2 is the draft accepted at row 0: the presence penalty makes
    it pick 3, as plain decoding would after committing 2."""
    from speculative.proposer import Drafts
    from speculative.settings import SpecSettings
    from speculative.tree_shape import TreeShape
    params = SamplingParams(presence_penalty=0.5, logprobs=1)
    rows = [[0, 0, 5, 0, 0], [0, 0, 1.0, 0.9, 0], [4, 0, 0, 0, 0]]
    u = verify_one(SpecSettings(method="mtp", num_drafts=2), Drafts([2, 2], [1.0, 1.0]), rows, params)
    assert u.commit == [2, 3] and u.verify.num_accepted == 1
    assert [lp.token for lp in u.logprobs] == [2, 3]
    # Output so far: 0 (committed) and 2 (accepted draft), each penalised once.
    assert abs(u.logprobs[1].logprob - torch_log_softmax([-0.5, 0, 0.5, 0.9, 0])[3]) < 1e-12
    # A tree: the hedge 3 under row 1 is taken; the bonus after it sees both 2 and 3 in its history
    # (without 2 it would pick 2, without 3 it would pick 3).
    tree = SpecSettings(method="mtp", num_drafts=2, tree_shape=TreeShape.parse("1,2"))
    rows = [[0, 0, 5, 0, 0], [0, 0, 1.0, 0.9, 0], [4, 0, 0, 0, 0], [0, 0, 0.9, 1.0, 0.8]]
    u = verify_one(tree, Drafts([2, 2], [1.0, 1.0], hedges=[(2, 3)]), rows, params)
    assert u.commit == [2, 3, 4] and u.verify.hedge_taken
    assert [lp.token for lp in u.logprobs] == [2, 3, 4]


def torch_log_softmax(row: list[float]) -> list[float]:
    import torch
    return torch.log_softmax(torch.tensor(row, dtype=torch.float64), dim=-1).tolist()
