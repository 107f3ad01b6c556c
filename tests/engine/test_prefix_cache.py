"""Prefix caching end to end (float64): a request gives the same tokens, and its drafter the same
drafts, whether its prefix came from the cache or was computed."""
from __future__ import annotations

import pytest
import torch

from runtime.sample.sampler import SamplingParams
from serving.llm import LLM

SHARED = [(i * 37) % 300 + 1 for i in range(40)]
# Rounds one and two: the second round's prompts run one at a time, after the first round, so they
# find the first round's blocks. NEW_NEXT shares block 0 with the first prompt but not the token
# after it, which the drafter's row at position 15 pairs with: it must not attach that block.
FIRST = [SHARED + [5, 6, 7], SHARED[:33] + [9], SHARED[:20] + [2, 4, 6, 8, 10], [300, 1]]
NEW_NEXT = SHARED[:16] + [299, 5, 6]
SECOND = [SHARED + [5, 6, 7], SHARED + [11, 12], SHARED[:33] + [9], NEW_NEXT]
CACHED = [32, 32, 32, 0]              # full blocks, each followed by a token the earlier prompt had
PARAMS = {"greedy": SamplingParams(max_tokens=16, ignore_eos=True),
          "seeded": SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.9, seed=11)}
SPECS = {"none": {}, "mtp": dict(spec="mtp", num_drafts=3), "tree": dict(spec="mtp", num_drafts=3, tree_shape="1,2,2")}


def stats(out) -> tuple:
    return out.token_ids, out.num_verifies, out.drafted_tokens, out.accepted_tokens


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("params", PARAMS)
def test_cached_prefix_gives_the_tokens_and_drafts_of_a_computed_one(ckpt_mtp, spec, params):
    params = PARAMS[params]
    on = LLM(ckpt_mtp, dtype="float64", kv_cache_tokens=2048, **SPECS[spec])
    off = LLM(ckpt_mtp, dtype="float64", kv_cache_tokens=2048, prefix_cache=False, **SPECS[spec])
    assert [o.token_ids for o in on.generate(FIRST, params)] == [o.token_ids for o in off.generate(FIRST, params)]
    again = [on.generate([p], params)[0] for p in SECOND]
    fresh = [off.generate([p], params)[0] for p in SECOND]
    assert [o.cached_tokens for o in again] == CACHED
    assert all(o.cached_tokens == 0 for o in fresh)
    assert [stats(o) for o in again] == [stats(o) for o in fresh]
    if spec != "none":
        assert sum(o.drafted_tokens for o in again) > 0
    sched = on.engine.scheduler
    assert sched.num_prefix_hit_tokens == sum(CACHED)
    assert sched.num_prefix_queried_tokens == sum(map(len, FIRST + SECOND))
    assert off.engine.scheduler.num_prefix_queried_tokens == 0


def drafter_rows(llm: LLM, prompt: list[int]) -> torch.Tensor:
    """The drafter's keys at the prompt's positions once its first propose has fed them [P, nkv, D]."""
    engine = llm.engine
    seq = engine.add_request(prompt, PARAMS["greedy"])
    llm.step()                          # the prefill (from the cached prefix on, when there is one)
    llm.step()                          # the first propose feeds the drafter the prompt's rows
    cache = engine.runner.cache
    rows = cache.k[engine.model_config.num_hidden_layers][cache.cells(seq.seq_id, 0, len(prompt))].clone()
    while engine.has_unfinished():
        llm.step()
    return rows


def test_drafter_rows_of_a_cached_prefix_equal_computed_ones(ckpt_mtp):
    """The MTP drafter's keys/values share the blocks: those a request attaches are the ones it
    would have written itself, down to the row before the first computed position. A first round
    wider than the width cap never drafts, yet its blocks are offered all the same: the engine
    feeds the drafter every completed block of a sequence that does not draft (`feed_only`)."""
    off = LLM(ckpt_mtp, dtype="float64", kv_cache_tokens=2048, prefix_cache=False, **SPECS["mtp"])
    on = LLM(ckpt_mtp, dtype="float64", kv_cache_tokens=2048, **SPECS["mtp"])
    capped = LLM(ckpt_mtp, dtype="float64", kv_cache_tokens=2048, mtp_max_seqs=1, **SPECS["mtp"])
    cases = [(SECOND[1], 32), (NEW_NEXT, 0), (SHARED[:16] + [SHARED[16], 7], 16)]
    for llm, cases in ((on, cases), (capped, cases)):
        llm.generate(FIRST, PARAMS["greedy"])
        for prompt, cached in cases:
            before = llm.engine.scheduler.num_prefix_hit_tokens
            got, want = drafter_rows(llm, prompt), drafter_rows(off, prompt)
            assert llm.engine.scheduler.num_prefix_hit_tokens - before == cached
            torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_prefix_cache_under_preemption_equals_a_roomy_run(ckpt_mtp):
    """A cache too small for the batch: preempted sequences come back through their own cached
    blocks, and every token equals a run with room and no prefix cache."""
    params = SamplingParams(max_tokens=20, ignore_eos=True, temperature=0.9, seed=4)
    prompts = [SHARED[:34] + [i + 1, i + 2] for i in range(6)]
    small = LLM(ckpt_mtp, dtype="float64", kv_cache_tokens=224, max_num_seqs=6, max_num_batched_tokens=64,
                spec="mtp", num_drafts=3)
    outs = small.generate(prompts, params)
    sched = small.engine.scheduler
    assert sched.num_preemptions > 0 and sched.num_prefix_hit_tokens > 0
    roomy = LLM(ckpt_mtp, dtype="float64", kv_cache_tokens=4096, prefix_cache=False)
    assert [o.token_ids for o in outs] == [o.token_ids for o in roomy.generate(prompts, params)]
    assert small.engine.runner.cache.num_free_blocks == small.engine.runner.cache.num_blocks


def test_32_token_blocks_give_the_tokens_of_16_and_an_ep_group_refuses_them(ckpt_mtp):
    """vLLM's CPU build caches prefixes in 32-token blocks only; ours can match it (metrale bench
    --prefix-cache both) and serves the same tokens at either size."""
    params = PARAMS["seeded"]
    big = LLM(ckpt_mtp, dtype="float64", kv_cache_tokens=2048, kv_block_size=32, **SPECS["mtp"])
    small = LLM(ckpt_mtp, dtype="float64", kv_cache_tokens=2048, prefix_cache=False, **SPECS["mtp"])
    assert big.engine.runner.cache.block_size == 32
    assert [o.token_ids for o in big.generate(FIRST, params)] == [o.token_ids for o in small.generate(FIRST, params)]
    again = [big.generate([p], params)[0] for p in SECOND]
    assert [o.cached_tokens for o in again] == [32, 32, 32, 0]   # one 32-token block each (three 16s at 16)
    assert [stats(o) for o in again] == [stats(small.generate([p], params)[0]) for p in SECOND]
    with pytest.raises(ValueError, match="an EP group serves 16-token blocks only"):
        LLM(ckpt_mtp, dtype="float64", ep=2, kv_block_size=32, launcher=lambda cfg: pytest.fail("a group started"))
