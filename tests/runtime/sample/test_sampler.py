"""Sampler rules with exact values: top-k/top-p/min_p, keyed draws, the per-row processing
(penalties, bias, min_tokens, temperature), logprobs, choice seeds, and the histories of verify rows."""
from __future__ import annotations

import pytest
import torch

from runtime.sample.sampler import (History, RowSpec, SamplingParamError, SamplingParams, choice_seed, draw,
                             position_uniforms, process_logits, prompt_token_logprobs, sample_rows, sample_token,
                             sampling_probs, target_probs, token_logprobs)


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
    assert torch.equal(position_uniforms(1, 5, 4, "cpu"), position_uniforms(1, 5, 4, "cpu"))


def test_the_uniforms_are_splitmix64_computed_on_the_device():
    """key_uniforms is splitmix64's stream (wrapping int64 arithmetic on the device agrees with
    Python's integers), uniform, and one op sequence for every row."""
    from runtime.sample.sampler import _MASK64, key_uniforms, position_key
    keys = [position_key(s, p) for s, p in ((0, 0), (7, 11), (2**62, 3), (123456789, 10**6))]
    got = key_uniforms(torch.tensor(keys), 5)
    for row, key in zip(got.tolist(), keys):
        want = []
        for i in range(1, 6):
            x = (key + i * 0x9E3779B97F4A7C15) & _MASK64
            x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
            x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
            want.append(((x ^ (x >> 31)) >> 11) / 2**53)
        assert row == want
    u = key_uniforms(torch.tensor([position_key(3, 4)]), 20000)[0]
    assert 0 <= u.min() and u.max() < 1 and abs(u.mean().item() - 0.5) < 0.01


def test_sample_rows_reads_the_host_once_for_the_batch():
    """Sampled rows are drawn together on the device: the batch's tokens come back in one host
    read (no per-row generator, no per-row arg-max read), and equal `sample_row`'s one by one."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from runtime.sample.sampler import sample_row

    class Reads(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.__name__.startswith("_local_scalar_dense"):
                Reads.n += 1
            return func(*args, **(kwargs or {}))

    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    rows = [RowSpec(SamplingParams(temperature=0.9, top_k=20, seed=5), 5, 10 + i) if i % 3 else
            RowSpec(SamplingParams(), 0, i) for i in range(5)]
    rows.append(RowSpec(SamplingParams(temperature=0.7, top_p=0.8, min_p=0.05, seed=1), 1, 3))
    with Reads():
        got = sample_rows(logits, rows)
    assert Reads.n <= 1
    assert [g.token for g in got] == [sample_row(logits[i], r).token for i, r in enumerate(rows)]


def test_draw_follows_the_distribution():
    probs = torch.tensor([0.7, 0.2, 0.1, 0.0], dtype=torch.float64)
    counts = torch.bincount(torch.tensor([draw(probs, 9, pos) for pos in range(3000)]), minlength=4)
    freq = counts.double() / 3000
    assert counts[3] == 0
    assert abs(freq[0] - 0.7) < 0.04 and abs(freq[1] - 0.2) < 0.04 and abs(freq[2] - 0.1) < 0.03


def test_greedy_is_argmax():
    logits = torch.tensor([0.1, 3.0, 2.9])
    assert sample_token(logits, SamplingParams(), seed=0, position=0) == 1


# --- per-row processing (vLLM's definitions), exact values ---------------------------------------------

LOGITS = torch.tensor([1.0, 2.0, -1.0, 0.5, 0.0], dtype=torch.float64)
# Prompt [3], committed output [1, 1], and draft 2 on the row's path: output tokens 1, 1, 2.
HIST = History([3, 1, 1], 1, path=[2], stop_ids=(0,))


def test_presence_and_frequency_penalties_count_output_tokens_only():
    out = process_logits(LOGITS, SamplingParams(frequency_penalty=0.5, presence_penalty=0.25), HIST)
    # token 1 twice: 2 - 2 * 0.5 - 0.25; token 2 once (the draft): -1 - 0.5 - 0.25; token 3 only in the prompt.
    assert out.tolist() == [1.0, 0.75, -1.75, 0.5, 0.0]


def test_repetition_penalty_divides_positive_and_multiplies_negative_over_prompt_and_output():
    out = process_logits(LOGITS, SamplingParams(repetition_penalty=2.0), HIST)
    assert out.tolist() == [1.0, 1.0, -2.0, 0.25, 0.0]


def test_logit_bias_min_tokens_and_temperature():
    out = process_logits(LOGITS, SamplingParams(logit_bias={4: 100, 1: -3}), HIST)
    assert out.tolist() == [1.0, -1.0, -1.0, 0.5, 100.0]
    # Three output tokens so far (two committed, one on the path): EOS (0) masked below min_tokens=4 only.
    assert process_logits(LOGITS, SamplingParams(min_tokens=4, max_tokens=8), HIST)[0] == float("-inf")
    assert process_logits(LOGITS, SamplingParams(min_tokens=3, max_tokens=8), HIST)[0] == 1.0
    assert process_logits(LOGITS, SamplingParams(temperature=0.5), HIST).tolist() == [2.0, 4.0, -2.0, 1.0, 0.0]
    # Greedy follows the processed logits.
    rows = [RowSpec(SamplingParams(), 0, 4, HIST), RowSpec(SamplingParams(logit_bias={4: 100}), 0, 4, HIST)]
    assert [s.token for s in sample_rows(torch.stack([LOGITS, LOGITS]), rows)] == [1, 4]
    assert LOGITS.tolist() == [1.0, 2.0, -1.0, 0.5, 0.0]          # float64 logits are never changed in place


def test_min_p_keeps_tokens_above_a_share_of_the_top_probability():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=torch.float64))
    p = sampling_probs(logits, SamplingParams(temperature=1.0, min_p=0.2))        # threshold 0.1
    assert torch.allclose(p, torch.tensor([0.5, 0.3, 0.15, 0.0], dtype=torch.float64) / 0.95)


def test_logprobs_are_log_softmax_of_the_processed_logits_before_top_k():
    params = SamplingParams(temperature=0.5, top_k=1, logprobs=2, presence_penalty=0.5, seed=3)
    [got] = sample_rows(LOGITS.unsqueeze(0), [RowSpec(params, 3, 4, HIST)])
    want = torch.log_softmax(torch.tensor([2.0, 3.0, -3.0, 1.0, 0.0], dtype=torch.float64), dim=-1)
    assert got.token == 1                              # top-k 1 keeps only token 1; its logprob is not 0
    assert got.logprobs.token == 1 and abs(got.logprobs.logprob - want[1]) < 1e-15 < -want[1]
    assert [t for t, _ in got.logprobs.top] == [1, 0] and abs(got.logprobs.top[1][1] - want[0]) < 1e-15
    lp = token_logprobs(torch.log(torch.tensor([0.25, 0.75], dtype=torch.float64)), 0, 0)
    assert abs(lp.logprob - torch.log(torch.tensor(0.25)).item()) < 1e-7 and lp.top == ()
    # Prompt logprobs: temperature only (1 for greedy), penalties and bias do not score the prompt.
    [p] = prompt_token_logprobs(LOGITS.unsqueeze(0), [2], SamplingParams(logit_bias={2: 50}, temperature=0.0), 1)
    assert p.logprob == torch.log_softmax(LOGITS, dim=-1)[2] and p.top[0][0] == 1


def test_choice_seeds_are_distinct_and_choice_zero_keeps_the_seed():
    assert choice_seed(42, 0) == 42
    seeds = [choice_seed(42, i) for i in range(64)]
    assert len(set(seeds)) == 64 and seeds == [choice_seed(42, i) for i in range(64)]
    assert choice_seed(43, 1) != choice_seed(42, 1)


def test_bad_values_name_their_field():
    for kwargs, field in [(dict(presence_penalty=2.5), "presence_penalty"), (dict(repetition_penalty=0.0),
                          "repetition_penalty"), (dict(min_p=1.5), "min_p"), (dict(min_tokens=20), "min_tokens"),
                          (dict(logprobs=21), "logprobs"), (dict(logit_bias={3: 101}), "logit_bias")]:
        try:
            SamplingParams(**kwargs)
        except SamplingParamError as exc:
            assert exc.field == field
        else:
            raise AssertionError(f"{kwargs} was accepted")


# --- the histories of verify rows -------------------------------------------------------------------

def test_verify_rows_draw_after_the_drafts_on_their_path():
    from engine.sequence import Sequence
    from engine.verify import chain_rows, tree_rows
    seq = Sequence(seq_id=0, prompt_len=2, token_ids=[7, 8, 9], params=SamplingParams(), seed=1, num_computed=2)
    rows = chain_rows(seq, [4, 5])
    assert [r.position for r in rows] == [3, 4, 5]
    assert [list(r.history.path) for r in rows] == [[], [4], [4, 5]]
    assert [r.history.output_ids() for r in rows] == [[9], [9, 4], [9, 4, 5]]
    # verify_rows' layout: root, spine 4 -> 5, hedge 6 at depth 1 and hedge 3 at depth 2 (child of 4).
    tree = tree_rows(seq, [(9, 0, -1), (4, 1, 0), (5, 2, 1), (6, 1, 0), (3, 2, 1)])
    assert [r.position for r in tree] == [3, 4, 5, 4, 5]
    assert [list(r.history.path) for r in tree] == [[], [4], [4, 5], [6], [4, 3]]


@pytest.mark.cuda
def test_the_device_draws_equal_the_cpu_draws():
    """The (seed, position) uniforms are the same numbers on a GPU as on the CPU, so a batch's
    sampled tokens are too (given the same probabilities)."""
    from runtime.sample.sampler import key_uniforms, position_key
    keys = torch.tensor([position_key(s, p) for s in range(4) for p in (0, 7, 10**6)])
    assert torch.equal(key_uniforms(keys.cuda(), 1000).cpu(), key_uniforms(keys, 1000))
    logits = torch.randn(8, 300, generator=torch.Generator().manual_seed(2))
    rows = [RowSpec(SamplingParams(temperature=0.8, top_p=0.9, top_k=50, min_p=0.01, seed=i), i, 30 + i)
            for i in range(8)]
    cpu = [s.token for s in sample_rows(logits.double(), rows)]
    gpu = [s.token for s in sample_rows(logits.double().cuda(), rows)]
    assert cpu == gpu
