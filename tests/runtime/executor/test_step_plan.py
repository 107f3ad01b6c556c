"""`build_plan`'s padded batch for several causal chunks (the decode, verify and draft steps of
many sequences, built from host lists) against its definition, field by field: each row's
position and cache cell, each sequence's context, query rows and causal mask; and `chain_plans`
(a drafter's chained one-row steps) against `build_plan` of each step."""
from __future__ import annotations

import random

import pytest
import torch

from runtime.executor.attention import SeqChunk, build_plan, chain_plans
from runtime.executor.kv_cache import PagedKVCache


def _expected(cache: PagedKVCache, chunks: list[SeqChunk]) -> dict[str, torch.Tensor]:
    q_max = max(c.num_tokens for c in chunks)
    k_max = max(c.end for c in chunks)
    b = len(chunks)
    positions, cells, gather = [], [], torch.zeros(b, k_max, dtype=torch.long)
    q_index = torch.zeros(b, q_max, dtype=torch.long)
    valid = torch.zeros(b, q_max, dtype=torch.bool)
    mask = torch.zeros(b, 1, q_max, k_max, dtype=torch.bool)
    last_rows, row = [], 0
    for i, c in enumerate(chunks):
        ctx = cache.cells(c.seq_id, 0, c.end).tolist()
        gather[i, :c.end] = torch.tensor(ctx)
        for q in range(q_max):
            if q < c.num_tokens:
                positions.append(c.start + q)
                cells.append(ctx[c.start + q])
                q_index[i, q], valid[i, q] = row + q, True
                mask[i, 0, q, :c.start + q + 1] = True        # causal: keys up to its own position
            else:
                mask[i, 0, q, 0] = True                       # padding rows see key 0 alone
        row += c.num_tokens
        last_rows.append(row - 1)
    return {"positions": torch.tensor(positions), "cell_mapping": torch.tensor(cells), "gather": gather,
            "q_index": q_index, "valid": valid, "mask": mask, "last_rows": torch.tensor(last_rows)}


@pytest.mark.parametrize("rows", ["one each", "several", "mixed"])
def test_several_causal_chunks_plan_as_defined(rows):
    rng = random.Random(rows)
    cache = PagedKVCache(num_layers=1, num_kv_heads=2, head_dim=8, num_blocks=512, block_size=16,
                         dtype=torch.float32, device="cpu")
    lengths = {}
    for seq in rng.sample(range(100), 30):     # tables of scattered blocks: seq ids and blocks interleave
        lengths[seq] = rng.randint(1, 200)
        cache.reserve(seq, lengths[seq])
    for _ in range(20):
        seqs = rng.sample(sorted(lengths), rng.randint(2, 17))
        chunks = []
        for seq in seqs:
            n = {"one each": 1, "several": 4, "mixed": rng.choice([1, 2, 4, 9])}[rows]
            n = min(n, lengths[seq])
            end = rng.randint(n, lengths[seq])
            chunks.append(SeqChunk(seq, end - n, n))
        plan = build_plan(cache, chunks)
        assert plan.mask_mode == "explicit" and plan.tiles is None
        for field, want in _expected(cache, chunks).items():
            got = getattr(plan, field)
            assert got.dtype == want.dtype and torch.equal(got, want), field


@pytest.mark.parametrize("num_seqs", [1, 5])
def test_chained_steps_plan_as_build_plan_plans_each_step(num_seqs):
    """Step s of a chain (one row a sequence at its position + s) attends as `build_plan` of that
    step plans it: the same cells written, the same context and, past each sequence's own end,
    keys masked off (where build_plan pads with cell 0)."""
    rng = random.Random(num_seqs)
    cache = PagedKVCache(num_layers=1, num_kv_heads=2, head_dim=8, num_blocks=512, block_size=16,
                         dtype=torch.float32, device="cpu")
    seqs = rng.sample(range(100), num_seqs)
    positions = []
    for seq in seqs:
        length = rng.randint(1, 150)
        cache.reserve(seq, length + 4)
        positions.append(length - 1)
    plans = chain_plans(cache, seqs, positions, 5)
    assert len(plans) == 4
    for s, plan in enumerate(plans, start=1):
        want = build_plan(cache, [SeqChunk(seq, p + s, 1) for seq, p in zip(seqs, positions)])
        assert plan.mask_mode == want.mask_mode and torch.equal(plan.cell_mapping, want.cell_mapping)
        assert torch.equal(plan.positions, want.positions)
        if num_seqs == 1:
            assert torch.equal(plan.gather, want.gather) and plan.mask is None
            continue
        assert plan.gather.shape == want.gather.shape and torch.equal(plan.mask, want.mask)
        assert torch.equal(plan.gather[plan.mask[:, 0, 0]], want.gather[want.mask[:, 0, 0]])   # every visible key
        for field in ("q_index", "valid", "last_rows"):
            assert torch.equal(getattr(plan, field), getattr(want, field)), field


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_context_cells_pad_each_sequences_cells_with_zero(block_size):
    rng = random.Random(block_size)
    cache = PagedKVCache(num_layers=1, num_kv_heads=1, head_dim=4, num_blocks=4096 // block_size,
                         block_size=block_size, dtype=torch.float32, device="cpu")
    seqs = rng.sample(range(50), 12)
    for seq in seqs:                            # interleaved reservations: scattered tables
        cache.reserve(seq, rng.randint(1, 150))
    for seq in seqs[::3]:
        cache.reserve(seq, cache.length(seq) + rng.randint(1, 40))
    ends = [rng.randint(1, cache.length(seq)) for seq in seqs]
    got = cache.context_cells(seqs, ends)
    want = torch.nn.utils.rnn.pad_sequence([cache.cells(s, 0, e) for s, e in zip(seqs, ends)], batch_first=True)
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match="not reserved"):
        cache.context_cells(seqs[:2], [ends[0], cache.length(seqs[1]) + 1])
