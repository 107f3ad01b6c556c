"""Sampling in Triton: every row of a batch drawn in one launch, no host read (the caller gets
device tensors), with the reference sampler's rules (runtime/sample/sampler.py) and its keyed
uniforms.

One program per row walks the vocabulary in blocks of `BLOCK` several times, keeping nothing of
size V: the arg-max and the maximum, the softmax sum (min_p keeps the tokens whose probability
reaches min_p times the top one), the top-k threshold (the k-th largest logit) and the top-p
threshold (the lowest logit whose strictly-more-likely tokens hold less than top_p of the mass)
each found by bisecting the logits' order-preserving 32-bit keys (at most 32 passes, stopping once
the bracket holds the answer alone: about log2(V) passes on untied logits), then the draw. The
draw is the reference's exponential race: the arg-max over the kept tokens of e_i / E_i with
E_i = -log(1 - u_i) and u_i the i-th output of splitmix64 seeded with the row's key, computed in
wrapping uint64 arithmetic: bit for bit `runtime.sample.sampler.key_uniforms`. Greedy rows
(temperature 0) take the first arg-max of the logits.

Processing is in float64 as the reference's: logits / temperature (the same division), exp
against the row's maximum. The thresholds compare the processed values of the logits against the
processed value of the threshold logit, so with float32 or bfloat16 logits the kept set is the
reference's except where a sum or an exp rounds across a boundary (top-p mass, min_p ratio) or
tied logits straddle the top-p cut (the reference keeps the ties its sort put first; here all or
none). Float64 rows (processed on the host first) bisect on their float32 roundings: ties there
too.

A row may name a draft token (speculative rejection with a deterministic drafter, q one-hot at
the draft): the draw is then from the residual max(0, p - q), i.e. p without the draft, unless
the draft holds all the mass (then the draft), and the draft's probability under p comes back.

Shapes: N rows, V vocab.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024
# splitmix64's constants as int64 (runtime.sample.sampler's, reinterpreted as uint64 in the kernel)
GOLDEN = tl.constexpr(-0x61C8864680B583EB)
M1 = tl.constexpr(-0x40A7B892E31B1A47)
M2 = tl.constexpr(-0x6B2FB644ECCEEE15)


@triton.jit
def _key(x):
    """float32 [BLOCK] -> int32 keys in the same order (negative floats' magnitude bits flipped)."""
    b = x.to(tl.int32, bitcast=True)
    return tl.where(b < 0, b ^ 0x7FFFFFFF, b)


@triton.jit
def _unkey(k):
    """The inverse of `_key` on an int64 scalar holding an int32 key -> float64."""
    b = k.to(tl.int32)
    b = tl.where(b < 0, b ^ 0x7FFFFFFF, b)
    return b.to(tl.float32, bitcast=True).to(tl.float64)


@triton.jit
def _kept(xr, live, t, m, s1, floor, kth, kth_key, cut, cut_key):
    """The processed logits p, their exp against the maximum, and which tokens min_p, top-k
    (`kth` / `kth_key`) and top-p (`cut` / `cut_key`) keep. A threshold keeps a token whose
    processed value reaches the threshold's, or whose float32 key does (float64 rows)."""
    p = xr.to(tl.float64) / t
    e = tl.exp(p - m)
    k = _key(xr.to(tl.float32)).to(tl.int64)
    keep = live & (e / s1 >= floor) & ((p >= kth) | (k >= kth_key)) & ((p >= cut) | (k >= cut_key))
    return p, e, k, keep


@triton.jit
def _sample_kernel(logits_ptr, stride_n, vocab, temp_ptr, topk_ptr, topp_ptr, minp_ptr, key_ptr, draft_ptr,
                   token_ptr, logprob_ptr, pdraft_ptr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    base = logits_ptr + row.to(tl.int64) * stride_n
    offs = tl.arange(0, BLOCK)
    temp = tl.load(temp_ptr + row).to(tl.float64)
    top_k = tl.load(topk_ptr + row).to(tl.int64)
    top_p = tl.load(topp_ptr + row).to(tl.float64)
    min_p = tl.load(minp_ptr + row).to(tl.float64)
    draft = tl.load(draft_ptr + row).to(tl.int64)
    sampled = temp != 0.0
    t = tl.where(sampled, temp, 1.0)
    # The maximum and its first index.
    best = tl.full([], -float("inf"), tl.float64)
    best_i = tl.zeros([], tl.int64)
    for v0 in range(0, vocab, BLOCK):
        idx = v0 + offs
        x = tl.load(base + idx, mask=idx < vocab, other=-float("inf")).to(tl.float64)
        bmax = tl.max(x, 0)
        bi = tl.argmax(x, 0).to(tl.int64) + v0
        best_i = tl.where(bmax > best, bi, best_i)
        best = tl.maximum(best, bmax)
    m = best / t
    # The softmax sum of the processed row.
    s1 = tl.zeros([], tl.float64)
    for v0 in range(0, vocab, BLOCK):
        idx = v0 + offs
        x = tl.load(base + idx, mask=idx < vocab, other=-float("inf")).to(tl.float64)
        s1 += tl.sum(tl.exp(x / t - m), 0)
    # min_p: the tokens whose probability is below min_p times the top probability (1 / s1) go.
    floor = min_p * (1.0 / s1)
    big_key = tl.full([], 1 << 40, tl.int64)        # above every key: a threshold's value test alone decides
    n_min = tl.zeros([], tl.int64)
    min_key = big_key
    if sampled & (top_k > 0) & (top_k < vocab):     # what top-k needs (greedy rows skip every pass below)
        for v0 in range(0, vocab, BLOCK):
            idx = v0 + offs
            xr = tl.load(base + idx, mask=idx < vocab, other=-float("inf"))
            _, _, k, keep = _kept(xr, idx < vocab, t, m, s1, floor, -float("inf"), big_key, -float("inf"), big_key)
            n_min += tl.sum(keep.to(tl.int64), 0)
            min_key = tl.minimum(min_key, tl.min(tl.where(idx < vocab, k, big_key), 0))
    # top-k: the k-th largest logit (of those min_p keeps; all of them when fewer than k remain),
    # bisecting the keys: count(key >= lo) >= k > count(key >= hi), done when count(key >= lo) == k
    # (the answer is then the least key >= lo) or hi == lo + 1 (lo).
    kth = tl.full([], -float("inf"), tl.float64)
    kth_key = big_key
    if sampled & (top_k > 0) & (top_k < vocab) & (n_min >= top_k):
        lo = tl.full([], -(1 << 31), tl.int64)
        hi = tl.full([], 1 << 31, tl.int64)
        n_lo = tl.zeros([], tl.int64) + vocab
        least_lo = min_key
        while (hi - lo > 1) & (n_lo != top_k):
            mid = lo + (hi - lo) // 2
            cnt = tl.zeros([], tl.int64)
            least = big_key
            for v0 in range(0, vocab, BLOCK):
                idx = v0 + offs
                k = _key(tl.load(base + idx, mask=idx < vocab, other=-float("inf")).to(tl.float32)).to(tl.int64)
                ge = (k >= mid) & (idx < vocab)
                cnt += tl.sum(ge.to(tl.int64), 0)
                least = tl.minimum(least, tl.min(tl.where(ge, k, big_key), 0))
            up = cnt >= top_k
            lo = tl.where(up, mid, lo)
            n_lo = tl.where(up, cnt, n_lo)
            least_lo = tl.where(up, least, least_lo)
            hi = tl.where(up, hi, mid)
        kth_key = tl.where(n_lo == top_k, least_lo, lo)
        kth = _unkey(kth_key) / t
    # The mass min_p and top-k keep, how many tokens and the least key they keep.
    s2 = tl.zeros([], tl.float64)
    n_kept = tl.zeros([], tl.int64)
    least_kept = big_key
    if sampled & (top_p < 1.0):
        for v0 in range(0, vocab, BLOCK):
            idx = v0 + offs
            xr = tl.load(base + idx, mask=idx < vocab, other=-float("inf"))
            _, e, k, keep = _kept(xr, idx < vocab, t, m, s1, floor, kth, kth_key, -float("inf"), big_key)
            s2 += tl.sum(tl.where(keep, e, 0.0), 0)
            n_kept += tl.sum(keep.to(tl.int64), 0)
            least_kept = tl.minimum(least_kept, tl.min(tl.where(keep, k, big_key), 0))
    # top-p: the least key t0 whose strictly larger kept tokens hold less than top_p of the mass (the
    # last token top-p keeps), bisecting: mass(key > lo) >= top_p > mass(key > hi), done when one kept
    # key lies in (lo, hi] (the answer) or hi == lo + 1 (hi).
    cut = tl.full([], -float("inf"), tl.float64)
    cut_key = big_key
    if sampled & (top_p < 1.0):
        lo = tl.full([], -(1 << 31) - 1, tl.int64)
        hi = tl.full([], (1 << 31) - 1, tl.int64)
        n_lo = n_kept                               # kept keys > lo
        n_hi = tl.zeros([], tl.int64)               # kept keys > hi
        least_lo = least_kept                       # the least kept key > lo
        while (hi - lo > 1) & (n_lo - n_hi != 1):
            mid = lo + (hi - lo) // 2
            above = tl.zeros([], tl.float64)
            cnt = tl.zeros([], tl.int64)
            least = big_key
            for v0 in range(0, vocab, BLOCK):
                idx = v0 + offs
                xr = tl.load(base + idx, mask=idx < vocab, other=-float("inf"))
                _, e, k, keep = _kept(xr, idx < vocab, t, m, s1, floor, kth, kth_key, -float("inf"), big_key)
                gt = keep & (k > mid)
                above += tl.sum(tl.where(gt, e, 0.0), 0)
                cnt += tl.sum(gt.to(tl.int64), 0)
                least = tl.minimum(least, tl.min(tl.where(gt, k, big_key), 0))
            big = above / s2 >= top_p
            lo = tl.where(big, mid, lo)
            n_lo = tl.where(big, cnt, n_lo)
            least_lo = tl.where(big, least, least_lo)
            hi = tl.where(big, hi, mid)
            n_hi = tl.where(big, n_hi, cnt)
        cut_key = tl.where(n_lo - n_hi == 1, least_lo, hi)
        cut = _unkey(cut_key) / t
    # The draw: the arg-max of e_i / E_i over the kept tokens, the draft left out.
    key = tl.load(key_ptr + row).to(tl.uint64, bitcast=True)
    golden = tl.full([], GOLDEN, tl.int64).to(tl.uint64, bitcast=True)
    m1 = tl.full([], M1, tl.int64).to(tl.uint64, bitcast=True)
    m2 = tl.full([], M2, tl.int64).to(tl.uint64, bitcast=True)
    win = tl.full([], -1.0, tl.float64)
    win_i = tl.zeros([], tl.int64)
    s3 = tl.zeros([], tl.float64)
    e_draft = tl.zeros([], tl.float64)
    if sampled:
        for v0 in range(0, vocab, BLOCK):
            idx = v0 + offs
            live = idx < vocab
            xr = tl.load(base + idx, mask=live, other=-float("inf"))
            _, e, _, keep = _kept(xr, live, t, m, s1, floor, kth, kth_key, cut, cut_key)
            ek = tl.where(keep, e, 0.0)
            s3 += tl.sum(ek, 0)
            e_draft += tl.sum(tl.where(idx == draft, ek, 0.0), 0)
            z = key + (idx + 1).to(tl.uint64) * golden
            z = (z ^ (z >> 30)) * m1
            z = (z ^ (z >> 27)) * m2
            z = z ^ (z >> 31)
            u = (z >> 11).to(tl.float64) * (1.0 / 9007199254740992.0)
            score = tl.where(idx == draft, -1.0, ek / -tl.log(1.0 - u))
            score = tl.where(live, score, -2.0)
            bmax = tl.max(score, 0)
            bi = tl.argmax(score, 0).to(tl.int64) + v0
            win_i = tl.where(bmax > win, bi, win_i)
            win = tl.maximum(win, bmax)
    token = tl.where(sampled, tl.where((win <= 0.0) & (draft >= 0), draft, win_i), best_i)
    x_tok = tl.load(base + token).to(tl.float64)
    tl.store(token_ptr + row, token)
    tl.store(logprob_ptr + row, x_tok / t - m - tl.log(s1))
    tl.store(pdraft_ptr + row, tl.where(sampled, e_draft / s3, tl.where(draft == best_i, 1.0, 0.0)))


def sample_logits(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                  min_p: torch.Tensor, keys: torch.Tensor, drafts: torch.Tensor | None = None,
                  block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits [N, V] (float32, bfloat16 or float64) with per-row temperature, top_k (0 = off),
    top_p, min_p [N] and keys [N] int64 (`runtime.sample.sampler.position_key`) -> (tokens [N]
    int64, each token's logprob under log_softmax(logits / temperature) [N] float64, each draft's
    probability under the row's sampling distribution [N] float64: 0 where no draft), on the
    logits' device. `drafts` [N] int64, -1 for none: the row draws from p without its draft.
    `block`: the vocabulary block a pass reads (a power of two; tests take small ones)."""
    if logits.dim() != 2 or logits.shape[1] == 0:
        raise ValueError(f"sample_logits takes logits [N, V] with V > 0, got {tuple(logits.shape)}")
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    n, vocab = logits.shape
    dev = logits.device
    if drafts is None:
        drafts = torch.full((n,), -1, dtype=torch.long, device=dev)
    for name, x in (("temperature", temperature), ("top_k", top_k), ("top_p", top_p), ("min_p", min_p),
                    ("keys", keys), ("drafts", drafts)):
        if x.shape != (n,) or x.device != dev:
            raise ValueError(f"sample_logits: {name} must be [{n}] on {dev}, got {tuple(x.shape)} on {x.device}")
    tokens = torch.empty(n, dtype=torch.long, device=dev)
    logprobs = torch.empty(n, dtype=torch.float64, device=dev)
    p_draft = torch.empty(n, dtype=torch.float64, device=dev)
    if n:
        _sample_kernel[(n,)](logits, logits.stride(0), vocab, temperature.to(torch.float64),
                             top_k.to(torch.int64), top_p.to(torch.float64), min_p.to(torch.float64),
                             keys.to(torch.int64), drafts.to(torch.int64), tokens, logprobs, p_draft,
                             BLOCK=min(block, triton.next_power_of_2(vocab)))
    return tokens, logprobs, p_draft
