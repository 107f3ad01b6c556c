"""Sampler rules with exact values."""
from __future__ import annotations

import torch

from runtime.sampler import SamplingParams, draw, position_generator, sample_token, target_probs


def test_top_k_and_top_p_keep_exactly_the_expected_tokens():
    logits = torch.log(torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05], dtype=torch.float64))
    p = target_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    assert torch.allclose(p, torch.tensor([5 / 7, 2 / 7, 0, 0, 0], dtype=torch.float64))
    p = target_probs(logits, SamplingParams(temperature=1.0, top_p=0.7))  # 0.5 + 0.2 reaches 0.7
    assert torch.allclose(p, torch.tensor([5 / 7, 2 / 7, 0, 0, 0], dtype=torch.float64))
    p = target_probs(logits, SamplingParams(temperature=1.0, top_p=0.71))
    assert (p > 0).tolist() == [True, True, True, False, False]
    p = target_probs(logits, SamplingParams(temperature=0.0))
    assert p.tolist() == [1.0, 0.0, 0.0, 0.0, 0.0]


def test_keyed_draws_are_reproducible_and_position_dependent():
    probs = torch.full((1000,), 1e-3, dtype=torch.float64)
    a = [draw(probs, 42, pos) for pos in range(20)]
    assert a == [draw(probs, 42, pos) for pos in range(20)]
    assert len(set(a)) > 10
    assert a != [draw(probs, 43, pos) for pos in range(20)]
    g1, g2 = position_generator(1, 5), position_generator(1, 5)
    assert torch.equal(torch.rand(4, generator=g1), torch.rand(4, generator=g2))


def test_draw_follows_the_distribution():
    probs = torch.tensor([0.7, 0.2, 0.1, 0.0], dtype=torch.float64)
    counts = torch.bincount(torch.tensor([draw(probs, 9, pos) for pos in range(3000)]), minlength=4)
    freq = counts.double() / 3000
    assert counts[3] == 0
    assert abs(freq[0] - 0.7) < 0.04 and abs(freq[1] - 0.2) < 0.04 and abs(freq[2] - 0.1) < 0.03


def test_greedy_is_argmax():
    logits = torch.tensor([0.1, 3.0, 2.9])
    assert sample_token(logits, SamplingParams(), seed=0, position=0) == 1
