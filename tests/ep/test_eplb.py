"""EPLB (`--eplb-redundant-experts`, `--eplb-interval-steps`): the placement algorithm, its
command on the wire, and EP 2 groups on gloo whose redundant experts and live re-placements
leave every token as one rank computes it."""
from __future__ import annotations

import numpy as np
import pytest

from ep.eplb import (balanced_packing, check_placeable, eplb_slots, imbalance, keep_in_place, rebalance,
                     replicate, slot_share)
from ep.placement import initial_slots, moe_layers
from ep.protocol import EP_CMD_EPLB, ProtocolError, decode, encode, eplb_command, parse_eplb
from launch.mp import MPGroup
from runtime.sample.sampler import SamplingParams
from serving.llm import LLM
from serving.server_metrics import ServerMetrics

PROMPTS = [[5, 17, 200, 3], [9, 9, 9, 100, 250, 31, 7, 64, 12], [300]]


# --- the placement -------------------------------------------------------------------------------
@pytest.mark.parametrize("experts, redundant, ranks", [(8, 2, 2), (8, 0, 4), (16, 8, 4), (6, 2, 4), (64, 16, 8)])
def test_every_expert_is_placed_and_every_rank_holds_its_slots(experts, redundant, ranks):
    loads = np.random.default_rng(experts + redundant).pareto(1.3, experts) + 0.01
    slots = eplb_slots(loads, num_redundant=redundant, num_ranks=ranks, ranks_per_node=ranks, num_groups=1)
    assert slots.shape == (ranks, (experts + redundant) // ranks)
    assert sorted(set(slots.reshape(-1).tolist())) == list(range(experts))
    assert np.allclose(slot_share(slots, experts).sum(axis=0), 1.0)     # each expert's rows served once
    # A rank holds two copies of an expert (they would balance nothing) only when it has more copies than ranks.
    reps = np.bincount(slots.reshape(-1), minlength=experts)
    assert all(reps[e] > ranks for row in slots for e in set(row.tolist()) if (row == e).sum() > 1)


def test_replica_counts_follow_the_loads():
    loads = np.array([40.0, 1.0, 1.0, 1.0, 20.0, 1.0, 1.0, 1.0])
    reps = replicate(loads, 12)
    assert reps.tolist() == [4, 1, 1, 1, 2, 1, 1, 1]   # 40/4 = 10 = 20/2: the loads per copy even out
    slots = eplb_slots(loads, num_redundant=4, num_ranks=4, ranks_per_node=4, num_groups=1)
    counts = np.bincount(slots.reshape(-1), minlength=8)
    assert counts.tolist() == reps.tolist()


def test_ranks_are_balanced_better_than_the_contiguous_split():
    rng = np.random.default_rng(3)
    for _ in range(5):
        loads = rng.pareto(1.2, 16) + 0.01
        contiguous = np.repeat(np.arange(16), 1).reshape(4, 4)
        before = imbalance(slot_share(contiguous, 16), loads)
        placed = eplb_slots(loads, num_redundant=4, num_ranks=4, ranks_per_node=4, num_groups=1)
        after = imbalance(slot_share(placed, 16), loads)
        assert after <= before
        # The greedy bound: no rank exceeds the mean by more than the heaviest single copy.
        per_rank = slot_share(placed, 16) @ loads
        reps = np.bincount(placed.reshape(-1), minlength=16)
        assert per_rank.max() <= per_rank.mean() + (loads / reps).max() + 1e-9


def test_hierarchical_placement_keeps_groups_on_their_node():
    loads = np.random.default_rng(5).pareto(1.2, 32) + 0.01
    slots = eplb_slots(loads, num_redundant=8, num_ranks=8, ranks_per_node=4, num_groups=4)
    for node in range(2):
        groups = {e // 8 for e in slots[node * 4:(node + 1) * 4].reshape(-1)}
        assert len(groups) == 2                                          # two whole groups a node
    assert balanced_packing(np.array([5.0, 4.0, 3.0, 2.0]), 2).tolist() == [0, 1, 1, 0]


def test_kept_in_place_moves_only_what_changes():
    old = np.array([[0, 1, 2], [3, 4, 5]])
    new = np.array([[2, 7, 0], [5, 4, 6]])
    kept = keep_in_place(new, old)
    assert kept.tolist() == [[0, 7, 2], [6, 4, 5]]
    loads = np.ones(6)
    assert (rebalance(np.zeros(6), old) == old).all()                   # nothing routed: nothing moves
    assert sorted(rebalance(loads, old).reshape(-1).tolist()) == list(range(6))


def test_initial_slots_keep_the_loaded_split_and_add_the_copies():
    slots = initial_slots(6, 2, 4)          # 6 experts over 4 ranks load as 2, 2, 1, 1
    assert slots.tolist() == [[0, 1], [2, 3], [4, 0], [5, 1]]
    assert initial_slots(8, 0, 2).tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]


@pytest.mark.parametrize("experts, redundant, ranks, needle", [
    (8, -1, 2, "must be at least 0"), (8, 1, 2, "do not split evenly over --ep 2"),
    (4, 10, 2, "more copies than ranks")])
def test_unplaceable_values_are_refused_in_one_line(experts, redundant, ranks, needle):
    with pytest.raises(ValueError, match=needle) as err:
        check_placeable(experts, redundant, ranks)
    assert "\n" not in str(err.value)


# --- the command -----------------------------------------------------------------------------------
def test_eplb_command_round_trips_and_bad_tables_are_refused():
    tables = [[0, 1, 2, 3, 1, 2], [3, 2, 1, 0, 0, 0]]
    header, bulk = encode(eplb_command(tables))
    cmd = decode(header, bulk)
    assert cmd.code == EP_CMD_EPLB
    assert parse_eplb(cmd, num_layers=2, num_slots=6, num_experts=4) == tables
    with pytest.raises(ProtocolError, match="this model has 3 of 6"):
        parse_eplb(cmd, num_layers=3, num_slots=6, num_experts=4)
    with pytest.raises(ProtocolError, match="places expert 9"):
        parse_eplb(decode(*encode(eplb_command([[0, 1, 2, 9, 1, 2]]))), num_layers=1, num_slots=6, num_experts=4)
    with pytest.raises(ProtocolError, match="places 3 of the 4 experts"):
        parse_eplb(decode(*encode(eplb_command([[0, 1, 2, 2, 1, 2]]))), num_layers=1, num_slots=6, num_experts=4)


# --- EP 2 groups ---------------------------------------------------------------------------------
def _expert_tokens(text: str, layer: int) -> int:
    return sum(int(float(line.rsplit(" ", 1)[1])) for line in text.splitlines()
               if line.startswith("metrale_expert_routed_tokens_total{") and f'layer="{layer}"' in line)


@pytest.mark.parametrize("mode", ["alltoall", "allreduce"])
def test_eplb_ep2_with_live_replacements_equals_one_rank_in_float64(ckpt_mtp, mode):
    """EP 2 with 2 redundant experts, re-placed every 3 forwards while MTP chains draft (greedy,
    then seeded): the tokens, drafts and acceptance of one rank; the placements changed, copies
    exist, weights moved; the load counters reach /metrics."""
    greedy = SamplingParams(max_tokens=12, ignore_eos=True)
    seeded = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.8, seed=5)
    one = LLM(ckpt_mtp, dtype="float64", spec="mtp", num_drafts=3, kv_cache_tokens=2048)
    want = [one.generate(PROMPTS, p) for p in (greedy, seeded)]
    llm = LLM(ckpt_mtp, dtype="float64", spec="mtp", num_drafts=3, kv_cache_tokens=2048, ep=2, moe_a2a=mode,
              launcher=MPGroup, ep_timeout_s=60, eplb_redundant_experts=2, eplb_interval_steps=3,
              warm_standby=False)
    try:
        layers = moe_layers(llm.engine.runner.model)
        start = [m.eplb_slots.copy() for m in layers]
        assert all(len(np.unique(s)) == 8 and s.size == 10 for s in start)   # 8 experts, 2 copies, 5 slots a rank
        got = [llm.generate(PROMPTS, p) for p in (greedy, seeded)]
        for g, w in zip(got, want):
            assert [o.token_ids for o in g] == [o.token_ids for o in w]
            assert [(o.drafted_tokens, o.accepted_tokens) for o in g] == \
                [(o.drafted_tokens, o.accepted_tokens) for o in w]
        assert sum(o.drafted_tokens for o in got[0]) > 0
        stats = llm.expert_stats()
        assert stats["placements"] >= 3 and stats["bytes_received"] > 0
        assert any((m.eplb_slots != s).any() for m, s in zip(layers, start))
        # Every target layer routed every row once per choice (top-3): the same count per layer.
        totals = [sum(row) for row in stats["loads"]]
        assert len(totals) == 3 and totals[0] == totals[1] > 0 and totals[0] % 3 == 0
        metrics = ServerMetrics()
        metrics.observe_experts(llm.deployment, idle=True)
        text = metrics.render().decode()
        assert _expert_tokens(text, 0) == totals[0] and _expert_tokens(text, 2) == totals[2]
        assert f"metrale_eplb_placements_total {float(stats['placements'])}" in text
    finally:
        llm.shutdown()


def test_compiled_ep2_after_a_replacement_keeps_one_ranks_logits_in_float32(ckpt_grouped):
    """The compiled step reads the routing tables and weights EPLB moves in place: after a live
    re-placement its logits still match one rank's (within 1e-5, float32)."""
    from runtime.executor.attention import SeqChunk

    def prefill_logits(llm, ids):
        runner = llm.engine.runner
        runner.cache.reserve(10_000, len(ids))
        hidden, _ = runner.forward(ids, [SeqChunk(10_000, 0, len(ids))])
        out = runner.logits(hidden, list(range(len(ids))))
        runner.cache.free(10_000)
        return out

    ids = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]
    want = prefill_logits(LLM(ckpt_grouped, dtype="float32", kv_cache_tokens=1024), ids)
    llm = LLM(ckpt_grouped, dtype="float32", kv_cache_tokens=1024, ep=2, moe_a2a="allreduce", launcher=MPGroup,
              ep_timeout_s=60, eplb_redundant_experts=2, warm_standby=False)
    try:
        assert (prefill_logits(llm, ids) - want).abs().max().item() < 1e-5
        llm.generate(PROMPTS, SamplingParams(max_tokens=6, ignore_eos=True))
        runner = llm.engine.runner
        start = [m.eplb_slots.copy() for m in moe_layers(runner.model)]
        assert runner.rebalance_experts() > 0
        assert any((m.eplb_slots != s).any() for m, s in zip(moe_layers(runner.model), start))
        assert (prefill_logits(llm, ids) - want).abs().max().item() < 1e-5
    finally:
        llm.shutdown()


def test_a_group_restarted_mid_stream_with_eplb_loses_nothing(ckpt_mtp):
    """A worker SIGKILLed while EPLB re-places every 4 forwards: the group restarts from the loaded
    split plus copies (rank 0 reloads its shard), re-places again, and the tokens are one rank's."""
    import os
    import signal
    import threading
    import time
    prompts = [[5, 17, 200, 3], [9, 9, 9, 100, 250]]
    long = [SamplingParams(max_tokens=40, ignore_eos=True),
            SamplingParams(max_tokens=40, ignore_eos=True, temperature=0.8, seed=5)]
    want = [o.token_ids for o in LLM(ckpt_mtp, dtype="float64", kv_cache_tokens=2048).generate(prompts, long)]
    llm = LLM(ckpt_mtp, dtype="float64", kv_cache_tokens=2048, ep=2, launcher=MPGroup, ep_timeout_s=30,
              max_restarts=1, eplb_redundant_experts=2, eplb_interval_steps=4)
    try:
        first = llm.deployment.group.pids[0]
        seqs = [llm.engine.add_request(p, sp) for p, sp in zip(prompts, long)]
        runner = threading.Thread(target=lambda: [llm.step() for _ in iter(llm.engine.has_unfinished, False)])
        runner.start()
        while seqs[0].num_output < 10 and runner.is_alive():
            time.sleep(0.01)
        os.kill(first, signal.SIGKILL)
        runner.join(timeout=120)
        assert not runner.is_alive()
        assert [s.output_ids for s in seqs] == want
        assert llm.deployment.restarts == 1
        assert llm.expert_stats()["placements"] >= 1      # the new group re-places too
    finally:
        llm.shutdown()
