"""The sampling kernel (runtime/ops/kernels/sampling.py) against the reference sampler
(`runtime.sample.sampler.sample_rows`) and rejection (`engine.verify.rejection_tokens`) on the same
(seed, position) keys: under the Triton interpreter on the CPU, compiled in the `cuda` test.

Tokens are compared for exact equality. The cases are chosen well away from float-rounding ties:
float32 logits are random normals (no two equal), bfloat16 logits distinct bfloat16 values (the
reference's top-p keeps the tied tokens its sort puts first, the kernel all or none of them). The
tolerance rule, for cases not chosen so: the kernel may differ from the reference only where the
reference's decision is within float64 rounding of a boundary (a top-p mass or min_p ratio equal to
the cut to ~1e-15 relative, two scores p_i / E_i that equal to ~1e-15) or where tokens tie at the
top-p cut; the uniforms themselves are bit-exact (`test_the_draw_takes_the_reference_uniforms`).
"""
from __future__ import annotations

import pytest
import torch

from engine.verify import device_rejection_tokens, rejection_tokens
from runtime.executor.sampling import KERNEL, KernelSampler
from runtime.sample.sampler import (History, RowSpec, SamplingParams, key_uniforms, position_key, process_logits,
                                    sample_rows, target_probs)
from tests.runtime.ops.kernel_cases import kernel_device

pytestmark = pytest.mark.triton

MIXED = [SamplingParams(), SamplingParams(temperature=0.8), SamplingParams(temperature=1.0, top_k=5),
         SamplingParams(temperature=1.3, top_p=0.7), SamplingParams(temperature=0.9, min_p=0.1),
         SamplingParams(temperature=1.1, top_k=40, top_p=0.9), SamplingParams(temperature=0.7, top_p=0.8, min_p=0.05),
         SamplingParams(temperature=1.2, top_k=20, top_p=0.95, min_p=0.02), SamplingParams(temperature=1.0, top_k=1)]


def distinct_logits(n: int, vocab: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """[n, V] logits of `dtype`, no two equal in a row: float32 normals * 3, or for bfloat16 a
    shuffle of distinct bfloat16 values in [-6, 6) (steps of 1/32 are exact there)."""
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.float32:
        return torch.randn(n, vocab, generator=g) * 3
    grid = torch.arange(-192, 192, dtype=torch.float32) / 32
    assert vocab <= grid.numel() and torch.equal(grid.to(dtype).float(), grid)
    return torch.stack([grid[torch.randperm(grid.numel(), generator=g)[:vocab]] for _ in range(n)]).to(dtype)


def kernel_tokens(logits: torch.Tensor, rows: list[RowSpec], block: int, drafts=None):
    from runtime.ops.kernels.sampling import sample_logits
    dev = logits.device
    f = lambda xs, dt: torch.tensor(xs, dtype=dt, device=dev)   # noqa: E731
    ps = [r.params for r in rows]
    return sample_logits(logits, f([p.temperature for p in ps], torch.float64), f([p.top_k for p in ps], torch.long),
                         f([p.top_p for p in ps], torch.float64), f([p.min_p for p in ps], torch.float64),
                         f([position_key(r.seed, r.position) for r in rows], torch.long),
                         None if drafts is None else f(drafts, torch.long), block=block)


def check_rows(logits: torch.Tensor, params: list[SamplingParams], seeds: range, block: int) -> None:
    for seed in seeds:
        rows = [RowSpec(p, seed * 7 + i, 50 + 3 * i) for i, p in enumerate(params)]
        want = sample_rows(logits.cpu(), rows)
        tokens, logprobs, _ = kernel_tokens(logits, rows, block)
        assert tokens.device == logits.device and tokens.dtype == torch.long
        assert tokens.tolist() == [s.token for s in want], f"seed {seed}"
        ref_lp = [float(torch.log_softmax(process_logits(logits[i].cpu(), p), -1)[t]) for i, (p, t) in
                  enumerate(zip(params, tokens.tolist()))]
        torch.testing.assert_close(logprobs.cpu(), torch.tensor(ref_lp, dtype=torch.float64), rtol=0, atol=1e-9)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mixed_rows_match_the_reference_sampler(dtype):
    # greedy, temperature, top-k, top-p, min-p and their combinations in one batch; V = 300 is
    # not a multiple of the 256-token block
    dev = kernel_device()
    check_rows(distinct_logits(len(MIXED), 300, dtype, seed=1).to(dev), MIXED, range(2), block=256)


def test_one_row_and_many_rows():
    dev = kernel_device()
    check_rows(distinct_logits(1, 77, torch.float32, seed=2).to(dev), [MIXED[7]], range(3), block=64)
    many = [MIXED[i % len(MIXED)] for i in range(24)]
    check_rows(distinct_logits(24, 45, torch.float32, seed=3).to(dev), many, range(1), block=64)


def test_the_draw_takes_the_reference_uniforms():
    # Equal logits: the exponential race picks the least uniform of the row, so each token pins
    # the kernel's stream (key, counter) to key_uniforms', bit for bit in which one is least.
    dev = kernel_device()
    vocab = 97
    rows = [RowSpec(SamplingParams(temperature=1.0), seed, pos) for seed, pos in
            [(0, 0), (1, 1), (2**62 + 5, 10**9), (12345, 7), (2**63 - 1, 3)] + [(s, 100 + s) for s in range(20)]]
    tokens, _, _ = kernel_tokens(torch.zeros(len(rows), vocab, device=dev), rows, block=64)
    keys = torch.tensor([position_key(r.seed, r.position) for r in rows], dtype=torch.long)
    assert tokens.tolist() == torch.argmin(key_uniforms(keys, vocab), dim=-1).tolist()


def test_rows_processed_first_go_through_the_backend_as_the_reference():
    # penalties, logit_bias, min_tokens and a grammar mask: processed on the host, drawn in the kernel
    dev = kernel_device()
    logits = distinct_logits(5, 120, torch.float32, seed=4)
    allowed = torch.zeros(120, dtype=torch.bool)
    allowed[::3] = True
    hist = History(token_ids=[5, 9, 9, 17, 40], prompt_len=2, stop_ids=(3,))
    rows = [RowSpec(SamplingParams(temperature=0.9, repetition_penalty=1.3, frequency_penalty=0.5, top_p=0.9), 3, 20, hist),
            RowSpec(SamplingParams(temperature=0.0, presence_penalty=1.0, logprobs=3), 4, 21, hist),
            RowSpec(SamplingParams(temperature=1.1, logit_bias={7: 5.0, 11: -100.0}, top_k=10), 5, 22),
            RowSpec(SamplingParams(temperature=1.0, min_tokens=4, min_p=0.05, logprobs=2), 6, 23, hist),
            RowSpec(SamplingParams(temperature=0.8), 7, 24, History((), 0, allowed=allowed))]
    for shift in range(3):
        rows = [RowSpec(r.params, r.seed + shift, r.position, r.history) for r in rows]
        assert KERNEL.sample_rows(logits.to(dev), rows) == sample_rows(logits, rows)


def test_rejection_matches_rejection_tokens():
    dev = kernel_device()
    params = SamplingParams(temperature=1.0, top_k=12, top_p=0.9)
    k, vocab = 3, 64
    accepted = set()
    for seed in range(8):
        logits = distinct_logits(k + 1, vocab, torch.float32, seed=10 + seed)
        rows = [RowSpec(params, seed, 30 + r + 1) for r in range(k + 1)]
        dists = [target_probs(logits[r], params) for r in range(k + 1)]
        # drafts the target often wants (its arg-max) and some it does not (least likely kept or dropped)
        drafts = [int(torch.argmax(d)) if (seed + r) % 3 else int(torch.argsort(d, descending=True)[seed % 5])
                  for r, d in enumerate(dists[:k])]
        want = rejection_tokens(drafts, None, dists, seed, 31)
        got = device_rejection_tokens(KERNEL, logits.to(dev), rows, drafts, seed, 31)
        assert got == want, f"seed {seed}"
        accepted.add(want[0])
    assert len(accepted) > 1   # both rejections and acceptances were exercised


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_compiled_kernel_matches_the_reference(dtype):
    dev = torch.device("cuda", 0)
    check_rows(distinct_logits(len(MIXED), 384 if dtype == torch.bfloat16 else 5000, dtype, seed=5).to(dev),
               MIXED, range(3), block=1024)
    logits = torch.zeros(3, 32000, device=dev)
    rows = [RowSpec(SamplingParams(temperature=1.0), s, 9) for s in range(3)]
    keys = torch.tensor([position_key(r.seed, r.position) for r in rows], dtype=torch.long)
    assert kernel_tokens(logits, rows, 1024)[0].tolist() == torch.argmin(key_uniforms(keys, 32000), -1).tolist()


@pytest.mark.parametrize("verify", ["exact", "rejection"])
def test_an_engine_draws_the_same_tokens_through_the_kernel(ckpt_mtp, verify, monkeypatch):
    """Seeded sampled requests with MTP speculation: the runner's sampler swapped for the kernel
    (plain rows, chain verify rows, rejection) commits the tokens the reference path commits."""
    kernel_device()
    from serving.llm import LLM
    prompts = [[5, 17, 200, 3, 5, 17], [9, 9, 9, 100]]
    params = SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.9, top_k=30, top_p=0.9, seed=3)
    llm = LLM(ckpt_mtp, dtype="float32", spec="mtp", num_drafts=2, spec_verify=verify)
    want = [o.token_ids for o in llm.generate(prompts, params)]
    calls = []
    draws = KernelSampler.draws
    monkeypatch.setattr(KernelSampler, "draws", lambda self, *a, **kw: calls.append(1) or draws(self, *a, **kw))
    llm.engine.runner.sampler = llm.engine.verifier.sampler = KERNEL
    assert [o.token_ids for o in llm.generate(prompts, params)] == want
    assert llm.engine.metrics.verifies > 0 and calls


def test_the_kernel_path_reads_no_scalar_per_row():
    """The kernel backend's draws stay on the device (no `.item()`, a GPU sync each); rejection
    reads its outcome once, as a list."""
    from torch.utils._python_dispatch import TorchDispatchMode
    dev = kernel_device()

    class Scalars(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Scalars.n += func.__name__.startswith("_local_scalar_dense")
            return func(*args, **(kwargs or {}))

    logits = distinct_logits(4, 50, torch.float32, seed=6).to(dev)
    rows = [RowSpec(MIXED[i + 2], 1, 10 + i) for i in range(4)]
    with Scalars():
        draws = KERNEL.draws(logits, rows, [3, 4, 5, -1])
        na, out = device_rejection_tokens(KERNEL, logits, rows, [3, 4, 5], 1, 10)
    assert Scalars.n == 0 and draws.tokens.shape == (4,) and len(out) == na + 1
