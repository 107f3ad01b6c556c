"""Speculation never changes a request's tokens: greedy and seeded, any width, MTP and n-gram."""
from __future__ import annotations

import pytest

from serving.llm import LLM
from runtime.sample.sampler import SamplingParams
from engine.verify import accepted_prefix, committed_tokens

PROMPTS = [[5, 17, 200, 3, 5, 17, 200], [9, 9, 9, 100, 250, 31, 7, 64, 12, 13, 14], [300], [41, 42, 41, 42, 41]]
PARAMS = [SamplingParams(max_tokens=24, ignore_eos=True),
          SamplingParams(max_tokens=24, ignore_eos=True, temperature=1.0, seed=7),
          SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.7, top_k=40, top_p=0.9, seed=3)]


@pytest.fixture(scope="module")
def plain(ckpt_mtp):
    return LLM(ckpt_mtp, dtype="float64", kv_cache_tokens=4096)


@pytest.mark.parametrize("spec, k", [("mtp", 1), ("mtp", 3), ("ngram", 3)])
@pytest.mark.parametrize("params", PARAMS, ids=["greedy", "seeded", "seeded-topk-topp"])
def test_same_tokens_with_and_without_speculation(plain, ckpt_mtp, spec, k, params):
    want = [o.token_ids for o in plain.generate(PROMPTS, params)]
    llm = LLM(ckpt_mtp, dtype="float64", kv_cache_tokens=4096, spec=spec, num_drafts=k)
    together = llm.generate(PROMPTS, params)
    assert [o.token_ids for o in together] == want
    alone = [llm.generate([p], params)[0].token_ids for p in PROMPTS]
    assert alone == want
    m = llm.engine.metrics
    assert m.verifies > 0 and m.drafted_tokens > 0
    assert sum(o.num_verifies for o in together) > 0
    for o in together:
        assert o.accepted_tokens <= o.drafted_tokens <= k * o.num_verifies


@pytest.mark.parametrize("params", PARAMS[:2], ids=["greedy", "seeded"])
def test_lossless_with_the_ladder_and_the_confidence_stop(plain, ckpt_mtp, params):
    want = [o.token_ids for o in plain.generate(PROMPTS, params)]
    llm = LLM(ckpt_mtp, dtype="float64", kv_cache_tokens=4096, spec="mtp", num_drafts=4, draft_policy="ladder",
              draft_confidence_stop=0.3)
    outs = llm.generate(PROMPTS, params)
    assert [o.token_ids for o in outs] == want
    m = llm.engine.metrics
    # The stop ends chains early: fewer drafts than 3 (the ladder's count at width 4) per verify.
    assert 0 < m.drafted_tokens < 3 * m.verifies


def test_mtp_drafts_are_accepted_sometimes_and_rejected_sometimes(ckpt_mtp):
    llm = LLM(ckpt_mtp, dtype="float64", kv_cache_tokens=4096, spec="mtp", num_drafts=3)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=32, ignore_eos=True))
    m = llm.engine.metrics
    assert 0 < m.accepted_tokens < m.drafted_tokens  # verification really decides
    assert sum(o.accepted_tokens for o in outs) == m.accepted_tokens
    assert all(len(o.token_ids) == 32 for o in outs)


def test_speculation_survives_preemption(ckpt_mtp):
    small = LLM(ckpt_mtp, dtype="float64", kv_cache_tokens=128, max_num_seqs=6, max_num_batched_tokens=64,
                spec="mtp", num_drafts=3)
    params = SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.9, seed=4)
    prompts = [[i + 1, i + 2, i + 3, 7, 8, 9, 10, 11] for i in range(6)]
    outs = small.generate(prompts, params)
    assert small.engine.scheduler.num_preemptions > 0
    roomy = LLM(ckpt_mtp, dtype="float64", kv_cache_tokens=4096)
    assert [o.token_ids for o in outs] == [o.token_ids for o in roomy.generate(prompts, params)]


def test_acceptance_rule_exact_values():
    assert accepted_prefix([1, 2, 3], [1, 2, 4, 9]) == 2
    assert accepted_prefix([5, 2, 3], [1, 2, 3, 9]) == 0
    assert committed_tokens([1, 2, 3], [1, 2, 3, 9]) == (3, [1, 2, 3, 9])
    assert committed_tokens([1, 7], [1, 2, 3]) == (1, [1, 2])
    assert committed_tokens([], [4]) == (0, [4])
    with pytest.raises(ValueError, match="need 3 target tokens"):
        committed_tokens([1, 2], [1])
