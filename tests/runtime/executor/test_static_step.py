"""Static-shape steps (the layer CUDA graphs capture) on the CPU: buckets are what the docstring
says, the padded forward gives the tokens of the unpadded one (none, chains, trees; greedy and
seeded), padding never reaches a real cache cell, and arrangements of one depth multiset share
one bucket."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from runtime.executor.attention import SeqChunk
from runtime.executor.runner import ModelRunner
from runtime.sample.sampler import SamplingParams
from runtime.executor.static_step import StaticShape, StepGraphs, static_shape
from runtime.model.weights import load_model
from serving.llm import LLM

MODEL = Path(__file__).resolve().parents[3] / "models" / "tiny-glm-moe"
PROMPTS = [[5, 17, 200, 3, 5, 17, 200], [9, 9, 9, 100, 250, 31, 7, 64, 12, 13, 14], [300, 4]]
GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.8, seed=11)


def test_buckets():
    chunk = SeqChunk
    assert static_shape([chunk(0, 40, 1)], 2048) == StaticShape(1, 1, 256)
    assert static_shape([chunk(0, 300, 4), chunk(1, 10, 2), chunk(2, 5, 1)], 2048) == StaticShape(4, 4, 512)
    assert static_shape([chunk(i, 0, 8) for i in range(9)], 2048) == StaticShape(16, 8, 256)
    assert static_shape([chunk(0, 0, 9)], 2048) is None                  # a prefill longer than 8 rows
    assert static_shape([chunk(0, 1000, 1)], 600) is None                # past the longest context
    assert static_shape([chunk(0, 500, 1)], 600) == StaticShape(1, 1, 512)
    assert static_shape([chunk(0, 550, 1)], 600) == StaticShape(1, 1, 600)       # capped at the longest context
    assert static_shape([chunk(i, 3, 1) for i in range(129)], 2048) is None


@pytest.mark.parametrize("spec, params", [(dict(spec="none"), SEEDED), (dict(spec="mtp", num_drafts=3), SEEDED),
                                          (dict(spec="mtp", tree_shape="1,2,2"), GREEDY)],
                         ids=["none-seeded", "mtp-chain-seeded", "tree-greedy"])
def test_padded_steps_give_the_unpadded_tokens(spec, params):
    kw = dict(dtype="float64", kv_cache_tokens=2048, batch_invariant=False, enforce_eager=True, device="cpu")
    plain = LLM(MODEL, **kw, **spec)
    want = [o.token_ids for o in plain.generate(PROMPTS, params)]
    llm = LLM(MODEL, static_steps=True, **kw, **spec)
    got = [o.token_ids for o in llm.generate(PROMPTS, params)]
    assert got == want
    graphs = llm.engine.runner.graphs
    assert graphs is not None and graphs.entries and graphs.replays == 0   # no capture on the CPU
    if spec["spec"] == "mtp":
        assert any(s.num_rows > 1 and s.num_seqs > 1 for s in graphs.entries)   # batched verifies went static
        # The drafter's steps went static too, and drafted exactly what the unpadded drafter drafted.
        assert any(s.num_rows == 1 and s.num_seqs > 1 for s in llm.engine.proposer.graphs.entries)
        m, ref = llm.engine.metrics, plain.engine.metrics
        assert (m.verifies, m.drafted_tokens, m.accepted_tokens) == (ref.verifies, ref.drafted_tokens,
                                                                    ref.accepted_tokens)


def test_static_steps_are_off_by_default_on_the_cpu_and_refuse_capture_there():
    llm = LLM(MODEL, dtype="float32", kv_cache_tokens=512, device="cpu")
    assert llm.engine.runner.graphs is None
    model = llm.model
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device, not cpu"):
        StepGraphs(model.forward, llm.engine.runner.cache, 512, capture=True)


def _reserve(cache, lengths: dict[int, int]) -> None:
    for seq, n in lengths.items():
        cache.reserve(seq, n)


def test_arrangements_of_one_depth_multiset_share_a_bucket_and_padding_stays_in_scratch():
    """Two verify steps over the same slots with the depths laid out differently (what canonical
    order makes one key) reuse one bucket; each gives the rows the unpadded forward gives, and
    every cache cell but the scratch one matches the unpadded run."""
    model = load_model(MODEL, "float64", device="cpu")
    eager = ModelRunner(model, kv_cache_tokens=1024, batch_invariant=False)
    static = ModelRunner(model, kv_cache_tokens=1024, batch_invariant=False, static_steps=True)
    g = torch.Generator(device="cpu").manual_seed(0)
    prompt = {s: torch.randint(1, 4000, (n,), generator=g, device="cpu").tolist() for s, n in ((0, 5), (1, 9), (2, 7))}
    for runner in (eager, static):
        _reserve(runner.cache, {s: len(p) for s, p in prompt.items()})
        for s, p in prompt.items():
            runner.forward(p, [SeqChunk(s, 0, len(p))])
    scratch = static.cache.scratch_cell
    before = set(static.graphs.entries)   # the prefills' buckets
    for depths in ((3, 1, 2), (1, 2, 3)):
        chunks, tokens = [], []
        for s, d in zip(prompt, depths):
            start = eager.cache.book.lengths[s]
            chunks.append(SeqChunk(s, start, d + 1))
            tokens += [7 + s] * (d + 1)
        for runner in (eager, static):
            _reserve(runner.cache, {c.seq_id: c.end for c in chunks})
        want, _ = eager.forward(tokens, chunks)
        got, _ = static.forward(tokens, chunks)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        cells = torch.cat([eager.cache.cells(c.seq_id, 0, c.end) for c in chunks])
        torch.testing.assert_close(static.cache.k[:, cells], eager.cache.k[:, cells], rtol=1e-12, atol=1e-12)
        assert not torch.equal(static.cache.k[:, scratch], torch.zeros_like(static.cache.k[:, scratch]))
    assert set(static.graphs.entries) - before == {StaticShape(4, 4, 256)}


def test_static_buckets_run_the_chosen_mode_compiled_for_target_and_drafter():
    """One step executor: with compiled steps on, the static buckets run the compiled forward (the
    target's and the MTP drafter's, the same mode classes), and give the eager buckets' tokens."""
    kw = dict(dtype="float32", kv_cache_tokens=2048, batch_invariant=False, device="cpu", static_steps=True,
              spec="mtp", num_drafts=2)
    eager = LLM(MODEL, enforce_eager=True, **kw)
    want = [o.token_ids for o in eager.generate(PROMPTS[:2], GREEDY)]
    llm = LLM(MODEL, enforce_eager=False, **kw)
    got = [o.token_ids for o in llm.generate(PROMPTS[:2], GREEDY)]
    assert got == want
    runner, proposer = llm.engine.runner, llm.engine.proposer
    assert runner.graphs.name == "padded, compiled" and eager.engine.runner.graphs.name == "padded"
    assert proposer.graphs.mode.compiles and proposer.mode.compiles
    assert "static steps padded, compiled" in str(runner.choice)
    assert runner.graphs.entries and proposer.graphs.entries
