"""The drafter's fed rows (float64): a row that drafts nothing writes its keys and values and
stops there, which changes no output; and a sequence that does not draft feeds the drafter in
batches, yet its blocks, generated ones included, reach the prefix cache."""
from __future__ import annotations

import pytest
import torch

import engine.engine as engine_module
from runtime.executor.attention import PagedAttention, SeqChunk, build_plan, drafter_attention, last_row_plan, writes_plan
from runtime.ops.batch_invariant import set_batch_invariant
from runtime.sample.sampler import SamplingParams
from serving.llm import LLM


@pytest.mark.parametrize("case", ["grouped", "deepseek_plain"])
def test_last_rows_alone_equal_the_full_drafter_step(ckpt_mtp, family_ckpt, case):
    """`MTPLayer.forward` with `rows` gives those rows of the full step and writes the same keys and
    values (grouped-query and latent attention), for every chunk's last row or a subset."""
    path = ckpt_mtp if case == "grouped" else family_ckpt(case)
    llm = LLM(path, dtype="float64", kv_cache_tokens=256, spec="mtp")
    model, cache = llm.engine.runner.model, llm.engine.runner.cache
    layer = model.config.num_hidden_layers
    gen = torch.Generator().manual_seed(0)
    # Two sequences with a committed context (5 and 9 cells) and a chunk of rows after it each.
    chunks = [SeqChunk(1, 5, 4), SeqChunk(2, 9, 3), SeqChunk(3, 0, 1)]
    for c in chunks:
        cache.reserve(c.seq_id, c.end)
    rows = sum(c.num_tokens for c in chunks)
    tokens = torch.randint(0, model.config.vocab_size, (rows,), generator=gen)
    prev = torch.randn(rows, model.config.hidden_size, generator=gen, dtype=torch.float64)
    context = torch.randn(cache.k[layer].shape, generator=gen, dtype=torch.float64)
    drafter = drafter_attention(cache)   # the drafter's plans: the padded batch, even beside a float64 target
    plan = build_plan(cache, chunks, backend=drafter)
    cells = torch.cat([cache.cells(c.seq_id, 0, c.end) for c in chunks])

    def written() -> torch.Tensor:
        planes = [cache.k[layer]] + ([cache.v[layer]] if cache.latent_dim is None else [])
        return torch.stack([p[cells] for p in planes])

    def run(query: list[int] | str | None):
        cache.k[layer].copy_(context)
        if cache.latent_dim is None:
            cache.v[layer].copy_(context)
        if query == "write":   # rows that draft nothing: keys and values alone (`MTPLayer.write`)
            assert model.mtp.write(tokens, prev, PagedAttention(cache, writes_plan(cache, chunks))) is None
            return None, written()
        if query is None:
            return model.mtp.forward(tokens, prev, plan.positions, PagedAttention(cache, plan)), written()
        picked = [chunks[j] for j in query]
        at = torch.tensor([sum(c.num_tokens for c in chunks[:j + 1]) - 1 for j in query])
        out = model.mtp.forward(tokens, prev, plan.positions, PagedAttention(cache, plan, last_row_plan(cache, picked, drafter)), at)
        return out, written()

    full, keys = run(None)
    assert not torch.equal(keys, torch.stack([context[cells]] * keys.shape[0]))   # the step wrote them
    for query in ([0, 1, 2], [1], [0, 2]):
        at = [sum(c.num_tokens for c in chunks[:j + 1]) - 1 for j in query]
        out, got_keys = run(query)
        assert out.shape == (len(query), model.config.hidden_size)
        torch.testing.assert_close(out, full[at], rtol=0, atol=1e-12)
        torch.testing.assert_close(got_keys, keys, rtol=0, atol=0)
    torch.testing.assert_close(run("write")[1], keys, rtol=0, atol=0)   # the same keys and values, bit for bit


def test_a_write_only_feed_of_one_batch_invariant_row_writes_what_the_step_writes(monkeypatch):
    """A batch-invariant float32 drafter (the runner keeps its drafter on the default kernels;
    switched on here) on the Python kernels (the native few-row kernel, which needs no copies,
    switched off here as where the library is not loaded) runs a one-row step as two copies of
    the row (`one_row_twice`); `MTPLayer.write` runs the one row, and `bi.linear` gives it the same keys and
    values bit for bit."""
    from pathlib import Path
    from runtime.ops import cpu_ops
    model_dir = Path(__file__).resolve().parents[2] / "models" / "tiny-glm-moe"
    llm = LLM(model_dir, dtype="float32", kv_cache_tokens=256, spec="mtp", batch_invariant=True, enforce_eager=True)
    model, cache = llm.engine.runner.model, llm.engine.runner.cache
    layer = model.config.num_hidden_layers
    assert not model.one_row_twice or not cpu_ops.load()   # native: one row as itself
    monkeypatch.setattr(cpu_ops, "invariant_linear", lambda dtype, weight: False)
    set_batch_invariant(model, True)   # chosen again without the native kernel
    set_batch_invariant(model.mtp, True)
    assert model.one_row_twice and model.mtp.one_row_twice   # this CPU's one-row GEMMs round otherwise
    chunk = SeqChunk(1, 6, 1)
    cache.reserve(1, chunk.end)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, model.config.vocab_size, (1,), generator=gen)
    prev = torch.randn(1, model.config.hidden_size, generator=gen)
    cell = cache.cells(1, 6, 7)
    plan = build_plan(cache, [chunk])
    with torch.inference_mode():
        model.mtp.forward(tokens, prev, plan.positions, PagedAttention(cache, plan))
        want = cache.k[layer][cell].clone(), cache.v[layer][cell].clone()
        cache.k[layer].zero_()
        cache.v[layer].zero_()
        model.mtp.write(tokens, prev, PagedAttention(cache, writes_plan(cache, [chunk])))
    assert torch.equal(cache.k[layer][cell], want[0]) and torch.equal(cache.v[layer][cell], want[1])
    assert want[0].abs().sum() > 0


PARAMS = SamplingParams(max_tokens=40, ignore_eos=True)


def capped_run(ckpt, monkeypatch):
    """Two 20-token prompts, 40 tokens each, with a width cap of one (so nobody drafts), every
    propose call recorded as (num_steps, requests, their draft counts). Returns (the LLM, the
    prompts, their outputs, the calls)."""
    prompts = [[(i * 37 + s) % 300 + 1 for i in range(20)] for s in (0, 1)]
    capped = LLM(ckpt, dtype="float64", kv_cache_tokens=2048, spec="mtp", num_drafts=3, mtp_max_seqs=1)
    engine, calls = capped.engine, []
    propose = engine.proposer.propose_batch

    def counted(reqs):
        calls.append((engine.num_steps, len(reqs), sorted({r.num_drafts for r in reqs})))
        return propose(reqs)
    monkeypatch.setattr(engine.proposer, "propose_batch", counted)
    return capped, prompts, capped.generate(prompts, PARAMS), calls


def test_capped_sequences_feed_in_batches_and_cache_their_output(ckpt_mtp, monkeypatch):
    """Above the width cap nobody drafts: a prompt's whole blocks are fed at once, the generated
    rows wait (below FEED_BATCH_ROWS) and are fed when their sequence ends, in one call for the
    sequences that end together; then a request that continues one of them (a conversation's
    next turn) finds the generated blocks too, with the drafter rows a computed run writes."""
    capped, prompts, outs, calls = capped_run(ckpt_mtp, monkeypatch)
    engine = capped.engine
    assert engine.metrics.verifies == 0                      # two sequences, cap one: no drafts
    # The prompts' first blocks, together, after the prefill; the rest when both end.
    assert [(n, d) for _, n, d in calls] == [(2, [0]), (2, [0])]
    assert [step for step, _, _ in calls] == [1, engine.num_steps] and engine.num_steps == 40
    # 20 + 40 tokens: the cache holds the last computed position 58, so blocks 0..2 are final.
    follow = prompts[0] + outs[0].token_ids + [7, 8]
    off = LLM(ckpt_mtp, dtype="float64", kv_cache_tokens=2048, prefix_cache=False, spec="mtp", num_drafts=3)
    again, fresh = capped.generate([follow], PARAMS)[0], off.generate([follow], PARAMS)[0]
    assert again.cached_tokens == 48
    assert (again.token_ids, again.drafted_tokens, again.accepted_tokens) == \
        (fresh.token_ids, fresh.drafted_tokens, fresh.accepted_tokens)


def test_generated_rows_are_fed_once_a_batch_is_due(ckpt_mtp, monkeypatch):
    """Once the sequences with a complete unfed block hold FEED_BATCH_ROWS unfed rows between
    them, the engine feeds them all in one call, before the sequences end."""
    monkeypatch.setattr(engine_module, "FEED_BATCH_ROWS", 32)
    capped, _, _, calls = capped_run(ckpt_mtp, monkeypatch)
    engine = capped.engine
    steps = [step for step, _, _ in calls]
    # The prefill computes positions 0..19; decode step k computes position 19 + k, and the
    # propose after it sees num_steps k + 1. The prompt's call feeds rows 0..19. Block 1 is
    # complete from position 31 on, with 12 rows pending each (24 < 32); at position 35, 16 each:
    # fed together (step 17). Likewise block 2 at position 51 (step 33). Rows 52..58 complete no
    # block: no call at the end.
    assert engine.num_steps == 40
    assert steps == [1, 17, 33]


def test_a_writes_only_plan_refuses_to_attend_and_odd_chunks():
    from runtime.executor.attention import WRITES_ONLY
    from runtime.executor.kv_cache import PagedKVCache
    cache = PagedKVCache(num_layers=1, num_blocks=4, block_size=4, num_kv_heads=1, head_dim=2, dtype=torch.float32,
                         device="cpu")
    cache.reserve(0, 3)
    plan = writes_plan(cache, [SeqChunk(0, 1, 2)])
    assert plan.backend is WRITES_ONLY and plan.positions.tolist() == [1, 2] and plan.mask_mode == "writes"
    ctx = PagedAttention(cache, plan)
    ctx.write(0, torch.ones(2, 1, 2), torch.ones(2, 1, 2))
    assert cache.k[0].view(-1, 2).sum() == 4
    with pytest.raises(RuntimeError, match="writes-only plan"):
        ctx.attend(0, torch.ones(2, 1, 2), torch.ones(2, 1, 2), torch.ones(2, 1, 2), 1.0)
    with pytest.raises(ValueError, match="causal, non-empty"):
        writes_plan(cache, [SeqChunk(0, 0, 2, (-1, 0))])
