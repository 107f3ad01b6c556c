"""Rejection-sampling verification preserves the target distribution."""
from __future__ import annotations

import math

import torch

from runtime.sample.sampler import SamplingParams, target_probs
from engine.verify import rejection_tokens

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


def test_a_draft_the_target_wants_at_least_as_much_is_always_accepted():
    # p(1) = 0.4 >= q(1) = 0.1, p(2) = 0.3 >= q(2) = 0.1 and p(3) = q(3) = 0.2: min(1, p/q) = 1.
    for seed in range(200):
        na, toks = rejection_tokens([1, 2, 3], [Q, Q, Q], [P, P, P, P], seed, 40)
        assert na == 3 and toks[:3] == [1, 2, 3] and len(toks) == 4


def test_a_draft_the_target_never_picks_is_always_rejected():
    p = torch.tensor([0.0, 0.5, 0.5, 0.0, 0.0], dtype=torch.float64)
    seen = set()
    for seed in range(200):
        na, toks = rejection_tokens([0, 1], None, [p, p, p], seed, 40)
        assert na == 0 and len(toks) == 1  # the step ends at the first rejection
        seen.add(toks[0])
    assert seen == {1, 2}  # resampled from p itself: q's mass sits where p has none


def test_a_rejected_draft_is_resampled_from_the_residual():
    # Deterministic drafter at token 1: accepted with p(1) = 0.5; the residual max(0, p - q) is
    # all on token 2, so a rejection commits exactly 2.
    p = torch.tensor([0.0, 0.5, 0.5, 0.0, 0.0], dtype=torch.float64)
    outcomes = [rejection_tokens([1], None, [p, p], seed, 9) for seed in range(2000)]
    assert all(toks[0] == 1 if na == 1 else toks == [2] for na, toks in outcomes)
    assert abs(sum(na for na, _ in outcomes) / 2000 - 0.5) < 0.05
    # Sampled drafter: draft 0 is accepted with p(0) / q(0) = 0.1 / 0.5 = 0.2; the residual
    # max(0, p - q) = [0, 0.3, 0.2, 0, 0] normalises to 0.6 / 0.4 on tokens 1 and 2.
    p = torch.tensor([0.1, 0.4, 0.3, 0.2, 0.0], dtype=torch.float64)
    outcomes = [rejection_tokens([0], [Q], [p, p], seed, 9) for seed in range(4000)]
    rejected = [toks[0] for na, toks in outcomes if na == 0]
    assert abs(1 - len(rejected) / 4000 - 0.2) < 0.03
    assert set(rejected) == {1, 2}
    assert abs(rejected.count(1) / len(rejected) - 0.6) < 0.04


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


def chi_square(tokens: list[int], expected: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic of observed `tokens` against expected counts [V]; bins expecting
    fewer than 5 are pooled into one. Returns (statistic, degrees of freedom)."""
    observed = torch.bincount(torch.tensor(tokens), minlength=expected.numel()).to(torch.float64)
    big = expected >= 5
    e = torch.cat([expected[big], expected[~big].sum().view(1)])
    o = torch.cat([observed[big], observed[~big].sum().view(1)])
    return float(((o - e) ** 2 / e).sum()), e.numel() - 1


def test_engine_rejection_mode_samples_the_target_distribution(ckpt_mtp):
    """One MTP draft per request, verified by rejection sampling: the verified token follows the
    target's distribution exactly, as plain sampling's does (a chi-square bound over 1000 seeds),
    whether the draft was accepted or not."""
    from runtime.executor.attention import CausalAttention
    from runtime.model.weights import load_model
    from serving.llm import LLM
    prompt, n = [5, 17, 200, 3, 5, 17], 1000
    params = [SamplingParams(max_tokens=3, ignore_eos=True, temperature=0.3, seed=s) for s in range(n)]
    plain = LLM(ckpt_mtp, dtype="float64").generate([prompt] * n, params)
    rej = LLM(ckpt_mtp, dtype="float64", spec="mtp", num_drafts=1, spec_verify="rejection",
              mtp_max_seqs=128).generate([prompt] * n, params)
    # The first token comes from the prefill, before any draft: the same keyed draw as plain.
    assert [o.token_ids[0] for o in rej] == [o.token_ids[0] for o in plain]
    # Every request verified its one draft; some drafts were accepted, others rejected.
    assert [o.num_verifies for o in rej] == [1] * n
    assert 0.05 * n < sum(o.accepted_tokens for o in rej) < 0.95 * n
    # Acceptance uses its own draws: not a replay of the keyed plain tokens (that is --spec-verify exact).
    assert sum(o.token_ids[1] != r.token_ids[1] for o, r in zip(plain, rej)) > 0.05 * n
    # The exact target distribution of the second token after each first token, summed over seeds.
    firsts = sorted({o.token_ids[0] for o in plain})
    model = load_model(ckpt_mtp, torch.float64, device="cpu")
    ids = torch.tensor([prompt + [t] for t in firsts])                         # [B, L]
    b, length = ids.shape
    with torch.no_grad():
        hidden = model(ids.reshape(-1), torch.arange(length).repeat(b), CausalAttention(b, length))
        last = model.compute_logits(hidden).view(b, length, -1)[:, -1]         # [B, V]
    dist = {t: target_probs(last[i], params[0]) for i, t in enumerate(firsts)}
    expected = sum(dist[o.token_ids[0]] for o in plain)                        # [V]
    for outs in (plain, rej):
        stat, df = chi_square([o.token_ids[1] for o in outs], expected)
        assert df >= 10 and stat < df + 5 * math.sqrt(2 * df), (stat, df)
