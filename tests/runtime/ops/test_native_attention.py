"""The native paged attention (runtime/ops/csrc/cpu_ops.cpp) against the Python method, in every mask
mode and for a latent cache: the same cache writes bit for bit; a prefill's rows bit for bit (both
gather and call SDPA); decode and verify rows, which it computes from the cache in place, within
rounding, and each row independent of the rows beside it."""
from __future__ import annotations

import pytest
import torch

from runtime.ops import cpu_ops
from runtime.executor.attention import PagedAttention, SeqChunk, build_plan
from runtime.executor.kv_cache import PagedKVCache
from runtime.executor.static_step import StaticBuffers, static_shape

STEPS = {
    "one row": [SeqChunk(0, 37, 1)],                                         # mode none
    "prefill": [SeqChunk(0, 0, 20)],                                          # causal
    "chunk": [SeqChunk(0, 30, 8)],                                            # explicit, one sequence
    "batch": [SeqChunk(0, 37, 1), SeqChunk(1, 10, 4), SeqChunk(2, 0, 7)],     # explicit
    "tree": [SeqChunk(0, 20, 4, parents=(-1, 0, 0, 1)), SeqChunk(1, 5, 1)],
}


def _cache(latent: bool, dtype: torch.dtype) -> PagedKVCache:
    heads, dim = (1, 48) if latent else (2, 32)
    cache = PagedKVCache(num_layers=2, num_kv_heads=heads, head_dim=dim, num_blocks=24, block_size=8, dtype=dtype,
                         latent_dim=40 if latent else None, device="cpu")
    for seq in range(3):
        cache.reserve(seq, 48)
    torch.manual_seed(0)
    cache.k.normal_()
    if not latent:
        cache.v.normal_()
    return cache


def _run(native: bool, monkeypatch, cache: PagedKVCache, chunks, padded: bool, latent: bool, dtype):
    monkeypatch.setattr(cpu_ops, "_state", {} if native else {"loaded": False})
    t = sum(c.num_tokens for c in chunks)
    torch.manual_seed(1)
    nh, dk = (4, 48) if latent else (4, 32)
    # Drawn for the largest step, then cut: a step's first rows are the same in every step.
    q, k = torch.randn(24, nh, dk, dtype=dtype)[:t], torch.randn(24, cache.k.shape[2], dk, dtype=dtype)[:t]
    v = k[..., :40] if latent else torch.randn(24, 2, 32, dtype=dtype)[:t]
    if padded:
        shape = static_shape(chunks, 48)
        buffers = StaticBuffers(shape, cache)
        rows = buffers.fill(list(range(t)), chunks, cache)
        qp, kp, vp = (x.new_zeros(shape.num_tokens, *x.shape[1:]).index_copy_(0, rows, x) for x in (q, k, v))
        return PagedAttention(cache, buffers.plan).attend(1, qp, kp, vp, 0.125)[rows]
    return PagedAttention(cache, build_plan(cache, chunks)).attend(1, q, k, v, 0.125)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("latent", [False, True], ids=["gqa", "latent"])
@pytest.mark.parametrize("step, padded", [(s, False) for s in STEPS] + [(s, True) for s in STEPS if s != "prefill"])
def test_native_attention_equals_the_python_method(monkeypatch, step, padded, latent, dtype):
    assert cpu_ops.load(), cpu_ops.error()
    chunks = STEPS[step]
    want_cache, got_cache = _cache(latent, dtype), _cache(latent, dtype)
    want = _run(False, monkeypatch, want_cache, chunks, padded, latent, dtype)
    got = _run(True, monkeypatch, got_cache, chunks, padded, latent, dtype)
    assert got.shape == want.shape and got.is_contiguous() and got.dtype == dtype
    if step == "prefill":
        assert torch.equal(got, want)
    else:
        tol = 1e-6 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    assert torch.equal(got_cache.k, want_cache.k) and torch.equal(got_cache.v, want_cache.v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_in_place_rows_do_not_depend_on_their_step(monkeypatch, dtype):
    """A sequence's decode row gives the same bits alone, beside other sequences and padded to a
    bucket: each row's scores, softmax and sum are its own."""
    assert cpu_ops.load(), cpu_ops.error()
    step = STEPS["batch"]
    alone = _run(True, monkeypatch, _cache(False, dtype), step[:1], False, False, dtype)
    batch = _run(True, monkeypatch, _cache(False, dtype), step, False, False, dtype)
    padded = _run(True, monkeypatch, _cache(False, dtype), step, True, False, dtype)
    assert torch.equal(batch[:1], alone) and torch.equal(padded, batch)


def test_native_attention_refuses_an_unknown_mode():
    assert cpu_ops.load(), cpu_ops.error()
    plane = torch.zeros(8, 1, 4)
    x = torch.zeros(1, 1, 4)
    idx = torch.zeros(1, 1, dtype=torch.long)
    with pytest.raises(RuntimeError, match="unknown mask mode"):
        torch.ops.metrale_cpu.paged_attention(x, x, x, plane, plane, True, idx[0], idx, idx, idx.bool(),
                                              torch.ones(1, 1, 1, 1, dtype=torch.bool), "sideways", 1.0)


@pytest.mark.parametrize("latent", [False, True], ids=["gqa", "latent"])
@pytest.mark.parametrize("step", ["one row", "chunk", "batch", "tree"])
def test_the_planned_op_is_the_attend_method_with_its_plan_set_once(step, latent):
    """What a compiled step calls per layer when the forward context set the plan natively
    (`NativeContextAttention`): the same output and cache writes, bit for bit, as `attend`;
    the drafter's query plan (last rows only) included."""
    from runtime.executor.attention import last_row_plan
    from runtime.executor.step_context import NATIVE_ATTENTION, NativeContextAttention, forward_context
    assert cpu_ops.load(), cpu_ops.error()
    chunks = STEPS[step]
    t = sum(c.num_tokens for c in chunks)
    torch.manual_seed(1)
    nh, dk = (4, 48) if latent else (4, 32)
    q, k = torch.randn(t, nh, dk), torch.randn(t, 1 if latent else 2, dk)
    v = k[..., :40] if latent else torch.randn(t, 2, 32)
    for queries in (False, True):
        if queries and any(c.parents is not None for c in chunks):
            continue
        want_cache, got_cache = _cache(latent, torch.float32), _cache(latent, torch.float32)
        plan = build_plan(want_cache, chunks)
        rows = last_row_plan(want_cache, chunks) if queries else None
        qq = q[plan.last_rows] if queries else q
        want = PagedAttention(want_cache, plan, rows).attend(1, qq, k, v, 0.125)
        with forward_context(PagedAttention(got_cache, plan, rows)) as ctx:
            assert ctx is NATIVE_ATTENTION
            got = ctx.attend(1, qq, k, v, 0.125)
        assert torch.equal(got, want) and torch.equal(got_cache.k, want_cache.k) and torch.equal(got_cache.v, want_cache.v)
    with pytest.raises(RuntimeError, match="no attention plan"):
        NativeContextAttention().attend(1, q, k, v, 0.125)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("d, dv", [(64, 64), (36, 96), (20, 24)])
def test_two_query_heads_a_pass_give_each_head_its_own_bits(dtype, d, dv):
    """In-place attention scores a kv head's query heads two at a time (one pass over the keys)
    and sums their values two at a time: each head's output is the bits of that head attending
    alone (the same keys and values as a kv head of its own). Lengths with and without a tail of
    8 keys, heads of 64 and with a lane tail, masked keys, 1 and 4 rows a sequence."""
    assert cpu_ops.load(), cpu_ops.error()
    g = torch.Generator().manual_seed(d + dv)
    b, n, nh = 3, 1024, 4
    for length in (7, 8, 45):
        for rows in (1, 4):
            keys = torch.randn(n, 1, d, generator=g).to(dtype)
            values = torch.randn(n, 1, dv, generator=g).to(dtype)
            gather = torch.randperm(n, generator=g)[:b * length].view(b, length)
            t = b * rows
            q = torch.randn(t, nh, d, generator=g).to(dtype)
            k, v = torch.randn(t, 1, d, generator=g).to(dtype), torch.randn(t, 1, dv, generator=g).to(dtype)
            cells = gather[:, -1].repeat_interleave(rows)[:t] if rows == 1 else torch.randperm(n, generator=g)[:t]
            q_index, valid = torch.arange(t).view(b, rows), torch.ones(b, rows, dtype=torch.bool)
            mask = torch.rand(b, 1, rows, length, generator=g) < 0.8
            mask[..., 0] = True

            def attend(qs, kp, vp, ks, vs):
                return torch.ops.metrale_cpu.paged_attention(qs, ks, vs, kp, vp, True, cells, gather, q_index, valid,
                                                             mask, "padded", 0.125)

            shared = attend(q, keys.clone(), values.clone(), k, v)   # one kv head for the 4 query heads
            own = attend(q, keys.expand(n, nh, d).clone(), values.expand(n, nh, dv).clone(),
                         k.expand(t, nh, d), v.expand(t, nh, dv))   # a kv head of its own each
            assert torch.equal(shared, own), (length, rows)


@pytest.mark.parametrize("d, dv", [(64, 64), (80, 96), (40, 20), (128, 128)])
def test_bfloat16_scores_on_dot_products_give_the_emulated_bits(d, dv):
    """bfloat16 in-place attention sums its scores as VDPBF16PS does (pairs of elements, 16 lanes,
    32-element chunks, a head size's tail padded with zeros) where the CPU has the instruction, and
    as float multiplies and adds otherwise: the same bits either way, 1 and 3 rows a sequence, key
    tails and masked keys, and within bfloat16's rounding of a float64 attention."""
    assert cpu_ops.load(), cpu_ops.error()
    g = torch.Generator().manual_seed(d)
    b, n, nh, nkv = 3, 1024, 4, 2
    native = torch.ops.metrale_cpu.use_bf16_dot_products(True)
    try:
        for length, rows in ((5, 1), (8, 3), (45, 1), (150, 3)):
            keys = torch.randn(n, nkv, d, generator=g).to(torch.bfloat16)
            values = torch.randn(n, nkv, dv, generator=g).to(torch.bfloat16)
            gather = torch.randperm(n, generator=g)[:b * length].view(b, length)
            t = b * rows
            q = torch.randn(t, nh, d, generator=g).to(torch.bfloat16)
            k = torch.randn(t, nkv, d, generator=g).to(torch.bfloat16)
            v = torch.randn(t, nkv, dv, generator=g).to(torch.bfloat16)
            cells = gather[:, -1] if rows == 1 else torch.randperm(n, generator=g)[:t]
            q_index, valid = torch.arange(t).view(b, rows), torch.ones(b, rows, dtype=torch.bool)
            mask = torch.rand(b, 1, rows, length, generator=g) < 0.8
            mask[..., 0] = True
            outs = []
            for on in (True, False):
                assert torch.ops.metrale_cpu.use_bf16_dot_products(on) == (on and native)
                kp, vp = keys.clone(), values.clone()
                outs.append(torch.ops.metrale_cpu.paged_attention(q, k, v, kp, vp, True, cells, gather, q_index, valid,
                                                                  mask, "padded", d ** -0.5))
            assert torch.equal(outs[0], outs[1]), (length, rows)
            kp[cells] = k
            vp[cells] = v
            kk, vv = kp[gather].double(), vp[gather].double()                 # [b, L, nkv, d]
            qq = q.double().view(b, rows, nkv, nh // nkv, d)
            s = torch.einsum("brhgd,blhd->brhgl", qq, kk) * d ** -0.5
            s = s.masked_fill(~mask.view(b, rows, 1, 1, length), float("-inf"))
            want = torch.einsum("brhgl,blhd->brhgd", s.softmax(-1), vv).reshape(t, nh, dv)
            torch.testing.assert_close(outs[0].double(), want, rtol=2e-2, atol=2e-2)
    finally:
        torch.ops.metrale_cpu.use_bf16_dot_products(True)


def score_sums(q: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """q [H, d] . keys [n, d]^T as the bfloat16 in-place attention sums a score: lane i of 16 takes
    the pair (32 c + 2 i, 32 c + 2 i + 1) of each 32-element chunk c, the odd product first, each
    product exact in float32 and each add rounded (the head's tail padded with zeros); then the
    lanes are added i with i + 8, i + 4, i + 2, i + 1."""
    d = q.shape[1]
    pad = -d % 32
    qs = torch.nn.functional.pad(q.float(), (0, pad)).view(q.shape[0], 1, -1, 16, 2)
    ks = torch.nn.functional.pad(keys.float(), (0, pad)).view(1, keys.shape[0], -1, 16, 2)
    lanes = torch.zeros(q.shape[0], keys.shape[0], 16)
    for c in range(qs.shape[2]):
        lanes = lanes + qs[:, :, c, :, 1] * ks[:, :, c, :, 1]
        lanes = lanes + qs[:, :, c, :, 0] * ks[:, :, c, :, 0]
    for half in (8, 4, 2, 1):
        lanes = lanes[..., :half] + lanes[..., half:2 * half]
    return lanes[..., 0]


@pytest.mark.parametrize("d", [64, 80, 40, 128, 7])
def test_bfloat16_scores_are_the_dot_product_instructions_sums(d):
    """The scores of bfloat16 in-place attention are `score_sums`' bits on AVX512-BF16's instruction
    and on its float emulation (the path of CPUs without it): 1 to 3 heads, key counts with and
    without a tail of 8, head sizes with and without a tail of 32."""
    assert cpu_ops.load(), cpu_ops.error()
    g = torch.Generator().manual_seed(d)
    native = torch.ops.metrale_cpu.use_bf16_dot_products(True)
    try:
        for heads, n in ((1, 5), (2, 8), (3, 21), (2, 150)):
            q = torch.randn(heads, d, generator=g).to(torch.bfloat16)
            keys = torch.randn(n, d, generator=g).to(torch.bfloat16)
            want = score_sums(q, keys)
            for on in (True, False):
                assert torch.ops.metrale_cpu.use_bf16_dot_products(on) == (on and native)
                assert torch.equal(torch.ops.metrale_cpu.attention_scores(q, keys), want), (on, heads, n)
    finally:
        torch.ops.metrale_cpu.use_bf16_dot_products(True)
