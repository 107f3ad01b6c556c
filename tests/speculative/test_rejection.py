"""Rejection-sampling verification preserves the target distribution."""
from __future__ import annotations

import torch

from runtime.sampler import SamplingParams, target_probs
from speculative.verify import rejection_tokens

P = torch.tensor([0.05, 0.4, 0.3, 0.2, 0.05], dtype=torch.float64)
Q = torch.tensor([0.5, 0.1, 0.1, 0.2, 0.1], dtype=torch.float64)


def first_token_histogram(n: int, q: torch.Tensor | None, draft_of) -> torch.Tensor:
    counts = torch.zeros(5, dtype=torch.float64)
    for seed in range(n):
        d = draft_of(seed)
        _, toks = rejection_tokens([d], None if q is None else [q], [P, P], seed, 100)
        counts[toks[0]] += 1
    return counts / n


def tv(a: torch.Tensor, b: torch.Tensor) -> float:
    return 0.5 * float((a - b).abs().sum())


def test_sampled_drafts_give_the_target_distribution_and_converge():
    gen = torch.Generator().manual_seed(0)
    drafts = torch.multinomial(Q, 8000, replacement=True, generator=gen).tolist()
    dist_small = tv(first_token_histogram(500, Q, lambda s: drafts[s]), P)
    dist_large = tv(first_token_histogram(8000, Q, lambda s: drafts[s]), P)
    assert dist_large < 0.03
    assert dist_large < dist_small  # the distance shrinks with samples


def test_deterministic_drafter_gives_the_target_distribution():
    # A greedy drafter always proposes token 0, which the target rarely wants.
    hist = first_token_histogram(6000, None, lambda s: 0)
    assert tv(hist, P) < 0.03


def test_top_k_and_top_p_are_respected():
    logits = torch.log(torch.tensor([0.05, 0.4, 0.3, 0.2, 0.05], dtype=torch.float64))
    p = target_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    seen = set()
    for seed in range(400):
        _, toks = rejection_tokens([0], None, [p, p], seed, 7)   # draft 0 is outside the top 2
        seen.update(toks)
    assert seen <= {1, 2} and seen == {1, 2}


def test_all_accepted_draws_the_bonus():
    one_hot = torch.tensor([0.0, 1.0, 0.0, 0.0, 0.0], dtype=torch.float64)
    na, toks = rejection_tokens([1, 1], None, [one_hot, one_hot, P], 3, 0)
    assert na == 2 and toks[:2] == [1, 1] and len(toks) == 3


def test_engine_rejection_mode_runs_and_greedy_stays_exact(ckpt_mtp):
    from serving.llm import LLM
    prompts = [[5, 17, 200, 3, 5, 17], [9, 9, 9, 100]]
    greedy = SamplingParams(max_tokens=16, ignore_eos=True)
    plain = [o.token_ids for o in LLM(ckpt_mtp, dtype="float64").generate(prompts, greedy)]
    llm = LLM(ckpt_mtp, dtype="float64", spec="mtp", num_drafts=3, spec_verify="rejection")
    assert [o.token_ids for o in llm.generate(prompts, greedy)] == plain   # greedy verify is exact
    sampled = llm.generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True, temperature=1.0, seed=2))
    assert all(len(o.token_ids) == 16 for o in sampled)
    assert llm.engine.metrics.verifies > 0
    again = llm.generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True, temperature=1.0, seed=2))
    assert [o.token_ids for o in again] == [o.token_ids for o in sampled]  # keyed: reproducible
