"""Tree speculation never changes a request's tokens (greedy and seeded, widths 1 and 4, EP 1 and
2), taken hedges really happen, and the verify-plan cache drops a slot's plans when it is freed."""
from __future__ import annotations

import pytest

from launch.mp import MPGroup
from serving.llm import LLM
from runtime.sample.sampler import SamplingParams
from engine.verify_key import verify_graph_key_has_slot

PROMPTS = [[5, 17, 200, 3, 5, 17, 200], [9, 9, 9, 100, 250, 31, 7, 64, 12, 13, 14], [300], [41, 42, 41, 42, 41]]
GREEDY = SamplingParams(max_tokens=20, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=20, ignore_eos=True, temperature=0.8, seed=7)


@pytest.fixture(scope="module")
def plain(ckpt_mtp):
    return LLM(ckpt_mtp, dtype="float64", kv_cache_tokens=4096)


def count_moves(llm: LLM) -> list[tuple[int, int, int]]:
    """Record every hedge row moved into place on rank 0's cache."""
    cache = llm.engine.runner.cache
    moves, move = [], cache.move

    def spy(seq_id: int, src: int, dst: int) -> None:
        moves.append((seq_id, src, dst))
        move(seq_id, src, dst)
    cache.move = spy
    return moves


def check_lossless(llm: LLM, want: list[list[int]], params: SamplingParams, shape: str) -> list:
    moves = count_moves(llm)
    together = llm.generate(PROMPTS, params)                           # width 4
    assert [o.token_ids for o in together] == want
    assert [llm.generate([p], params)[0].token_ids for p in PROMPTS] == want   # width 1
    nodes = sum(int(c) for c in shape.split(","))
    m = llm.engine.metrics
    assert m.verifies > 0
    for o in together:
        assert o.accepted_tokens <= o.drafted_tokens <= nodes * o.num_verifies
    return moves


@pytest.mark.parametrize("shape", ["1,2,2", "4,3"])
@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_tree_equals_no_speculation(plain, ckpt_mtp, shape, params):
    want = [o.token_ids for o in plain.generate(PROMPTS, params)]
    llm = LLM(ckpt_mtp, dtype="float64", kv_cache_tokens=4096, spec="mtp", tree_shape=shape)
    moves = check_lossless(llm, want, params, shape)
    if params is GREEDY:
        assert moves, "no hedge was ever taken: the test would not see a wrong move"
        assert llm.engine.metrics.hedges_taken == len(moves)
        assert all(1 <= src - dst <= 6 for _, src, dst in moves)


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_tree_at_ep2_equals_no_speculation(plain, ckpt_mtp, params):
    """Tree masks travel to the worker as parent rows, hedge moves as SLOT_MOVE ops: its half of
    the attention heads reads the same keys/values as rank 0's."""
    want = [o.token_ids for o in plain.generate(PROMPTS, params)]
    llm = LLM(ckpt_mtp, dtype="float64", kv_cache_tokens=4096, spec="mtp", tree_shape="4,3", ep=2, launcher=MPGroup)
    try:
        moves = check_lossless(llm, want, params, "4,3")
    finally:
        llm.shutdown()
    if params is GREEDY:
        assert moves


def test_chain_shaped_tree_matches_the_chain(ckpt_mtp):
    chain = LLM(ckpt_mtp, dtype="float64", kv_cache_tokens=4096, spec="mtp", num_drafts=3, draft_policy="fixed")
    tree = LLM(ckpt_mtp, dtype="float64", kv_cache_tokens=4096, spec="mtp", tree_shape="1,1,1")
    a, b = chain.generate(PROMPTS, GREEDY), tree.generate(PROMPTS, GREEDY)
    assert [(o.token_ids, o.drafted_tokens, o.accepted_tokens) for o in a] == \
        [(o.token_ids, o.drafted_tokens, o.accepted_tokens) for o in b]


def test_verify_plans_are_cached_and_dropped_when_a_sequence_is_freed(ckpt_mtp):
    llm = LLM(ckpt_mtp, dtype="float64", kv_cache_tokens=4096, spec="mtp", tree_shape="1,2,2")
    engine, plans = llm.engine, llm.engine.verifier.plans
    short = engine.add_request(PROMPTS[0], SamplingParams(max_tokens=8, ignore_eos=True))
    long = engine.add_request(PROMPTS[1], SamplingParams(max_tokens=40, ignore_eos=True))
    seen_short, verify_steps = False, 0

    def step() -> None:
        nonlocal verify_steps
        before = engine.metrics.verifies
        engine.step()
        verify_steps += engine.metrics.verifies > before

    while not short.is_finished:
        step()
        seen_short |= any(verify_graph_key_has_slot(k, short.seq_id) for k in plans.plans)
    assert seen_short
    assert not any(verify_graph_key_has_slot(k, short.seq_id) for k in plans.plans)
    while not long.is_finished:
        step()
        assert all(verify_graph_key_has_slot(k, long.seq_id) for k in plans.plans)
    assert len(plans) == 0
    assert plans.hits + plans.misses == verify_steps    # one lookup per step that verifies
    assert plans.hits > plans.misses > 0


@pytest.mark.parametrize("kwargs, match", [(dict(spec="ngram", tree_shape="1,2"), "needs spec='mtp'"),
                                           (dict(spec="mtp", tree_shape="1,9"), "count 9"),
                                           (dict(spec="mtp", tree_shape="1,2", spec_verify="rejection"),
                                            "keyed target draws only")])
def test_refused_tree_settings(ckpt_mtp, kwargs, match):
    with pytest.raises(ValueError, match=match):
        LLM(ckpt_mtp, dtype="float64", kv_cache_tokens=512, **kwargs)
