"""Verification: which drafts a target forward accepts, and what the step commits (docs/design.md §5.2).

The target's token at each verify row is the token the request would emit there without
speculation: the arg-max of the processed logits for greedy requests, else a draw keyed by
(request seed, absolute position of that token). Each row is processed with the tokens plain
decoding would have committed before it if the row's token is used: the committed output and the
drafts on the row's path. So the accepted prefix and the bonus token reproduce exactly what plain
decoding gives, penalties included, at any batch width.
"""
from __future__ import annotations

import torch

from runtime.sample.sampler import RowSpec, Sampled, draw_rows, key_uniforms, position_key, sample_rows
from engine.sequence import Sequence


def chain_rows(seq: Sequence, drafts: list[int]) -> list[RowSpec]:
    """The rows of a chain verify of `seq` (pending token, then `drafts`): row r draws position
    num_computed + r + 1 after drafts 0..r-1."""
    start = seq.num_computed
    return [RowSpec(seq.params, seq.seed, start + r + 1, seq.history(drafts[:r])) for r in range(len(drafts) + 1)]


def tree_rows(seq: Sequence, rows: list[tuple[int, int, int]]) -> list[RowSpec]:
    """The rows of a tree verify (`verify_rows`' (token, depth, parent row) list): the row at depth
    δ draws position num_computed + δ + 1 after the tokens of its ancestors and itself (below the
    root, which is committed already)."""
    start = seq.num_computed
    paths: list[list[int]] = []
    for r, (token, depth, parent) in enumerate(rows):
        paths.append([] if r == 0 else [*paths[parent], token])
    return [RowSpec(seq.params, seq.seed, start + depth + 1, seq.history(path))
            for (_, depth, _), path in zip(rows, paths)]


def target_tokens(logits: torch.Tensor, rows: list[RowSpec]) -> list[Sampled]:
    """logits [n, V] of one sequence's verify rows -> the target's token (and logprobs) after each row."""
    if logits.shape[0] != len(rows):
        raise ValueError(f"{logits.shape[0]} logits rows for {len(rows)} verify rows")
    return sample_rows(logits, rows)


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


REJECTION_STREAM = 0x5EC0DE  # mixed into the seed: acceptance draws never reuse the sampling draws


def rejection_tokens(drafts: list[int], draft_dists: list[torch.Tensor] | None, target_dists: list[torch.Tensor],
                     seed: int, first_position: int) -> tuple[int, list[int]]:
    """Standard speculative rejection sampling (Leviathan et al.; Chen et al.).

    Draft i (at absolute position first_position + i) is accepted with probability
    min(1, p_i(d_i) / q_i(d_i)); at the first rejection the token is resampled from
    norm(max(0, p_i - q_i)); when every draft is accepted the bonus is drawn from p_K.
    `target_dists` are the K+1 target distributions p_0..p_K [V]; `draft_dists` the drafter's
    q_i [V], or None for a deterministic drafter (q_i one-hot at d_i). Draws are keyed by
    (seed, position), so a request's outcome does not depend on its batch.
    Returns (na, committed tokens).
    """
    if len(target_dists) != len(drafts) + 1:
        raise ValueError(f"{len(drafts)} drafts need {len(drafts) + 1} target distributions")
    # Every draft's test and every position's resample at once on the device, then one host read:
    # the same keys and draws as testing draft by draft (no sync per draft).
    k = len(drafts)
    p = torch.stack(target_dists)                                                    # [K+1, V]
    dev = p.device
    d = torch.tensor(drafts, dtype=torch.long, device=dev)
    rows = torch.arange(k, device=dev)
    if draft_dists is None:
        q = torch.zeros_like(p[:k]).index_put_((rows, d), torch.ones((), dtype=p.dtype, device=dev))
    else:
        q = torch.stack(draft_dists).to(p.dtype)                                     # [K, V]
    pd, qd = p[rows, d], q[rows, d]
    keys = [position_key(seed ^ REJECTION_STREAM, first_position + i) for i in range(k)]
    u = key_uniforms(torch.tensor(keys, dtype=torch.long, device=dev), 1)[:, 0]
    accept = (qd > 0) & (u < torch.clamp(pd / torch.where(qd > 0, qd, 1.0), max=1.0))
    residual = torch.clamp(p[:k] - q, min=0.0)
    total = residual.sum(dim=-1, keepdim=True)
    resample = torch.where(total > 0, residual / torch.where(total > 0, total, 1.0), p[:k])
    draws = draw_rows(torch.cat([resample, p[k:]]),
                      torch.tensor([position_key(seed, first_position + i) for i in range(k + 1)],
                                   dtype=torch.long, device=dev))
    host = torch.cat([accept.long(), draws]).tolist()
    na = next((i for i in range(k) if not host[i]), k)
    return na, drafts[:na] + [host[k + na]]
