"""Verification: which drafts a target forward accepts, and what the step commits (DESIGN §5.2).

The target's token at each verify row is the token the request would emit there without
speculation: the arg-max for greedy requests, else a draw keyed by (request seed, absolute
position of that token). So the accepted prefix and the bonus token reproduce exactly what plain
decoding gives, at any batch width.
"""
from __future__ import annotations

import torch

from runtime.sampler import SamplingParams, sample_rows


def target_tokens(logits: torch.Tensor, params: SamplingParams, seed: int, first_position: int) -> list[int]:
    """logits [K+1, V] of one sequence's verify rows -> the target's token after each row.

    Row r predicts the token at absolute position `first_position + r`.
    """
    n = logits.shape[0]
    return sample_rows(logits, [params] * n, [seed] * n, list(range(first_position, first_position + n)))


def accepted_prefix(drafts: list[int], targets: list[int]) -> int:
    """na: length of the longest prefix with drafts[i] == targets[i]."""
    na = 0
    for d, t in zip(drafts, targets):
        if d != t:
            break
        na += 1
    return na


def committed_tokens(drafts: list[int], targets: list[int]) -> tuple[int, list[int]]:
    """(na, tokens to commit): the accepted drafts and the bonus token targets[na]."""
    if len(targets) != len(drafts) + 1:
        raise ValueError(f"{len(drafts)} drafts need {len(drafts) + 1} target tokens, got {len(targets)}")
    na = accepted_prefix(drafts, targets)
    return na, drafts[:na] + [targets[na]]
