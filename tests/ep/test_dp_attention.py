"""Data-parallel attention (`--dp-attention`, ep.dp): each rank attends over its own sequences and
the routed experts exchange rows; EP groups of real processes on gloo give one rank's tokens."""
from __future__ import annotations

import pytest

from ep.dp import DPBook, row_budget
from ep.parallel import EPMoE, dp_layers as target_dp_layers
from ep.protocol import ProtocolError, decode, encode, forward_command, parse_forward
from launch.mp import MPGroup
from engine.scheduler import Scheduler, SchedulerConfig
from engine.sequence import Sequence
from runtime.executor.attention import SeqChunk
from runtime.executor.kv_cache import PagedKVCache
from runtime.sample.sampler import SamplingParams
from serving.llm import LLM

PROMPTS = [[5, 17, 200, 3], [9, 9, 9, 100, 250, 31, 7, 64, 12], [300], [7, 7, 8]]
GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.8, seed=5)
# Sixteen prompts of 1 to 16 tokens (the batch at EP 4: four sequences a rank).
PROMPTS16 = [[(7 * i + 13 * j) % 300 + 1 for j in range(1 + (5 * i) % 16)] for i in range(16)]


def runs(llm: LLM, prompts=PROMPTS) -> list[tuple]:
    """Tokens, then drafts and acceptance, of a greedy and a seeded batch."""
    out = []
    for p in (GREEDY, SEEDED):
        got = llm.generate(prompts, p)
        out.append(([o.token_ids for o in got], [(o.drafted_tokens, o.accepted_tokens) for o in got]))
    return out


def alone_on_rank_1(llm: LLM) -> list[tuple]:
    """Two sequences, the second (rank 1's at EP 2) drafting alone once the first has ended:
    there rank 0 sends the seed's three-word propose and drafts nothing itself."""
    got = llm.generate(PROMPTS[:2], [SamplingParams(max_tokens=2, ignore_eos=True), GREEDY])
    return [(o.token_ids, o.drafted_tokens, o.accepted_tokens) for o in got]


def dp_layers(llm: LLM) -> list[EPMoE]:
    """The target's exchanging MoE layers on rank 0."""
    return target_dp_layers(llm.engine.runner.model)


# --- the wire and the book -------------------------------------------------------------------------
def test_a_dp_forward_carries_each_chunks_rank_and_the_budget():
    cmd = decode(*encode(forward_command([], [(3, 0, 2), (4, 5, 1)], [7, 8, 9], owners=[1, 0], budget=4)))
    p = parse_forward(cmd, vocab_size=16, dp_size=2)
    assert (p.owners, p.budget, p.chunks) == ([1, 0], 4, [(3, 0, 2), (4, 5, 1)])
    with pytest.raises(ProtocolError, match="owner rank 2 outside 0..1"):
        parse_forward(decode(*encode(forward_command([], [(3, 0, 2)], [7, 8], owners=[2], budget=0))),
                      vocab_size=16, dp_size=2)
    with pytest.raises(ProtocolError, match="above the padded budget of 1"):
        parse_forward(decode(*encode(forward_command([], [(3, 0, 2)], [7, 8], owners=[0], budget=1))),
                      vocab_size=16, dp_size=2)
    with pytest.raises(ProtocolError, match="needs 2"):   # a plain FORWARD to a DP-attention rank
        parse_forward(decode(*encode(forward_command([], [(3, 0, 2)], [7, 8]))), vocab_size=16, dp_size=2)


def split_cache(pool: int = 0) -> PagedKVCache:
    """Two pools of 4 blocks of 4 tokens, this process holding pool `pool`."""
    cache = PagedKVCache(num_layers=1, num_kv_heads=1, head_dim=2, num_blocks=4, block_size=4, device="cpu")
    cache.split_pools(2, pool)
    return cache


def test_a_split_cache_gives_each_sequence_one_pool_and_the_book_reads_it():
    cache = split_cache()
    cache.journal = []
    cache.reserve(1, 9)                                          # pool 0: blocks 0-2
    cache.reserve(2, 4)                                          # pool 1 has more free blocks: block 4
    cache.reserve(5, 1)                                          # pool 1 again (3 free against 1)
    assert [cache.pool_of(s) for s in (1, 2, 5)] == [0, 1, 1] and cache.block_table(5) == [5]
    assert (cache.total_blocks, cache.num_free_blocks, cache.capacity_tokens) == (8, 3, 16)
    assert not cache.can_reserve(1, 17) and cache.can_reserve(2, 12)   # 2 more blocks: in its own pool only
    book = DPBook(2, row_budget(4, 2, 4))                       # 2 sequences a rank, 4 rows each: 8
    assert book.budget == 8 and row_budget(64, 4, 1) == 16 and row_budget(3, 2, 3) == 8
    assert book.assign([SeqChunk(1, 0, 9)], cache) == [0]
    assert book.assign([SeqChunk(2, 0, 4), SeqChunk(1, 9, 1)], cache) == [1, 0]
    assert book.step_budget([SeqChunk(1, 9, 4), SeqChunk(2, 4, 4)], [0, 1]) == 8
    assert book.step_budget([SeqChunk(1, 9, 9)], [0]) == 0      # a prefill: exact counts
    # Rank 0 addresses its own pool's cells only; rank 1, replaying the journal, the other pool's.
    assert cache.cells(1, 0, 9).tolist() == list(range(9))
    with pytest.raises(ValueError, match="in pool 1; this rank holds pool 0"):
        cache.cells(2, 0, 4)
    other = split_cache(pool=1)
    for op, seq, word in cache.journal:
        other.replay(op, seq, word)
    assert other.book.tables == cache.book.tables and other.cells(5, 0, 1).tolist() == [4]
    cache.free(1)
    book.free(1)
    assert cache.pool_of(7) == 0 and book.assign([SeqChunk(7, 0, 3)], cache) == [0] and book.assigned == [2, 1]


def test_pools_admit_each_ranks_share_and_preempt_within_a_pool():
    """Two pools of 16 tokens admit four 8-token sequences where one pool admits two; a sequence
    that cannot grow preempts the youngest of its own pool, not the youngest of all."""
    params = SamplingParams(max_tokens=4)
    for pools, admitted in ((1, 2), (2, 4)):
        cache = PagedKVCache(num_layers=1, num_kv_heads=1, head_dim=2, num_blocks=4, block_size=4, device="cpu")
        if pools > 1:
            cache.split_pools(pools, 0)
        sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64), cache)
        seqs = [Sequence(seq_id=i, prompt_len=7, token_ids=list(range(1, 8)), params=params, seed=0) for i in range(4)]
        for seq in seqs:
            sched.add(seq)
        for item in sched.schedule():
            item.seq.num_computed += item.num_tokens
            item.seq.token_ids.append(9)
        assert len(sched.running) == admitted
    assert [cache.pool_of(s.seq_id) for s in seqs] == [0, 1, 0, 1]
    for item in sched.schedule():                 # a decode step in the blocks each holds
        item.seq.num_computed += item.num_tokens
    for seq in seqs[::2]:
        seq.token_ids.append(9)
    sched.schedule()                              # 0 and 2 need a third block: pool 0 is full
    assert [s.seq_id for s in sched.running] == [0, 1, 3] and sched.num_preemptions == 1


# --- two-batch overlap: the split, the schedule, the waits, the refusals ---------------------------
def test_micro_batches_split_by_sequence_and_agree_on_the_exchange_form():
    from ep.overlap import micro_budget, split_point
    assert [split_point(r) for r in ([], [4], [4, 4], [1, 1, 1], [9, 1, 1], [1, 1, 9])] == [0, 1, 1, 2, 1, 2]
    assert micro_budget(8, [(4, 4), (4, 0), (0, 0)]) == 4      # every micro-batch fits half the budget
    assert micro_budget(8, [(4, 4), (5, 3)]) == 0              # one does not: exact counts, on every rank
    assert micro_budget(1, [(1, 0)]) == 0 and micro_budget(0, [(0, 0)]) == 0


def test_a_step_without_two_sequences_on_any_rank_runs_as_one_batch():
    from ep.overlap import TwoBatchOverlap
    step, calls = TwoBatchOverlap(), []
    step.one.run = lambda *args: calls.append(args[-2:]) or "one"
    assert step.run(None, [5], ["chunk"], 8, [[1], []], 0) == "one"
    assert calls == [([[1], []], 0)] and step.one_batch_steps == 1 and step.padded_steps == 0


def test_interleave_alternates_the_micro_batches_stages():
    from ep.overlap import interleave
    log = []

    def mb(name, stages):
        for i in range(stages):
            log.append(f"{name}{i}")
            yield
        log.append(f"{name}-end")
        return name

    assert interleave([mb("a", 2), mb("b", 2)]) == ["a", "b"]
    assert log == ["a0", "b0", "a1", "b1", "a-end", "b-end"]


def test_a_wait_on_a_collective_in_flight_keeps_the_timeout_and_raises_comm_error():
    import datetime as dt

    import torch

    from ep.comm import CommError, Communicator, Pending
    comm = Communicator(rank=1, world_size=2, init_method=None, timeout_s=7.0, device="cpu")
    seen = []

    class Work:
        def wait(self, timeout):
            seen.append(timeout)
            raise RuntimeError("[gloo] Timed out waiting 7000ms for recv operation to complete")

    out = torch.zeros(2)
    done = Pending(comm, "all_to_all", None, out)
    assert done.wait() is out
    with pytest.raises(CommError, match=r"rank 1: all_to_all \(wait\) failed \(RuntimeError: \[gloo\] Timed out"):
        Pending(comm, "all_to_all", Work(), out).wait()
    assert seen == [dt.timedelta(seconds=7.0)] and comm.comm_seconds > 0


def test_two_batch_overlap_is_refused_where_it_cannot_overlap(capsys):
    import re
    from pathlib import Path
    from types import SimpleNamespace

    from ep.channel import driver_handshake
    from ep.dp import OneBatch
    from ep.overlap import NOT_EAGER, NOT_ROW_TWICE, NOT_STATIC, TwoBatchOverlap, choose_dp_step
    from launch.cli import main
    from serving.deployment import DeploymentConfig
    embedded = Path(__file__).resolve().parents[2] / "models" / "tiny-glm-moe"
    cfg = dict(model_dir=embedded, ep=2, two_batch_overlap=True)
    with pytest.raises(ValueError, match="^--two-batch-overlap splits each rank's rows of --dp-attention"):
        DeploymentConfig(**cfg)
    with pytest.raises(ValueError, match=f"^{re.escape(NOT_EAGER)}$"):
        DeploymentConfig(**cfg, dp_attention=True)                       # float32 compiles its step
    with pytest.raises(ValueError, match=f"^{re.escape(NOT_STATIC)}$"):
        DeploymentConfig(**cfg, dp_attention=True, enforce_eager=True, static_steps=True)
    DeploymentConfig(**cfg, dp_attention=True, enforce_eager=True)
    DeploymentConfig(**cfg, dp_attention=True, dtype="float64")        # float64 runs eager
    with pytest.raises(ValueError, match="splits the rows of --dp-attention"):
        driver_handshake(SimpleNamespace(world_size=2), embedded, "float32", two_batch=True)
    model = SimpleNamespace(one_row_twice=False)
    runner = dict(compiled=False, graphs=None, model=model)
    assert isinstance(choose_dp_step(SimpleNamespace(**runner), False), OneBatch)
    assert isinstance(choose_dp_step(SimpleNamespace(**runner), True), TwoBatchOverlap)
    for change, why in ((dict(compiled=True), NOT_EAGER), (dict(graphs=object()), NOT_STATIC),
                        (dict(model=SimpleNamespace(one_row_twice=True)), NOT_ROW_TWICE)):
        with pytest.raises(ValueError, match=f"^{re.escape(why)}$"):
            choose_dp_step(SimpleNamespace(**runner | change), True)
    code = main(["generate", "--model", str(embedded), "--prompt", "x", "--ep", "2", "--dp-attention",
                 "--two-batch-overlap"])
    assert code == 2 and capsys.readouterr().err.strip() == f"metrale generate: error: {NOT_EAGER}"


# --- EP groups ---------------------------------------------------------------------------------------
def test_dp_attention_ep2_with_two_batch_overlap_equals_one_rank_in_float64_with_mtp_chains(ckpt_mtp):
    """EP 2 with data-parallel attention and two-batch overlap, MTP chains, each rank drafting its
    own sequences in a KV pool of its own: three prompts first (rank 0 runs two, rank 1 one, so its
    second micro-batch has no rows; its one stops after 2 tokens, and then it has none: both join
    every exchange), then four, greedy and seeded, then rank 1's sequence drafting alone (rank 0
    sends the seed's three-word propose): one rank's tokens, drafts and acceptance. Each rank's
    pool holds 64 tokens, its own two sequences' (two blocks each): the four run together without
    a preemption, where one pool of that size holds two. Decode exchanges of micro-batches were
    padded to half the budget, one shape a layer whatever the batch's width (a step with one
    sequence a rank runs as one batch, padded to the budget); prefills exact; the MTP layer's
    experts exchanged too."""
    first = [GREEDY, SamplingParams(max_tokens=2, ignore_eos=True), GREEDY]
    one = LLM(ckpt_mtp, dtype="float64", spec="mtp", num_drafts=3, kv_cache_tokens=2048)
    want = [[o.token_ids for o in one.generate(PROMPTS[:3], first)], runs(one), alone_on_rank_1(one)]
    llm = LLM(ckpt_mtp, dtype="float64", spec="mtp", num_drafts=3, kv_cache_tokens=64, ep=2, dp_attention=True,
              two_batch_overlap=True, max_num_seqs=4, launcher=MPGroup, ep_timeout_s=60, warm_standby=False)
    try:
        step = llm.engine.runner.model.dp_step
        assert step.name == "two-batch overlap"
        alone = [o.token_ids for o in llm.generate(PROMPTS[:3], first)]
        assert llm.engine.runner.dp.assigned == [2, 1] and step.empty_micro_batches >= 3
        assert [alone, runs(llm), alone_on_rank_1(llm)] == want
        assert sum(d for d, _ in want[1][0][1]) > 0
        assert min(llm.engine.runner.dp.assigned) >= 3
        assert step.padded_steps > 0 and step.exact_steps > 0
        cache = llm.engine.runner.cache
        assert (cache.num_blocks, cache.total_blocks, llm.engine.scheduler.num_preemptions) == (4, 8, 0)
        sent = llm.engine.runner.sent   # the seed's three words where one sequence drafts, else the batch
        assert sent["MTP_PROPOSE"] > 0 and sent["MTP_PROPOSE_BATCH"] > 0, sent
        [mtp] = target_dp_layers(llm.engine.runner.model, drafter=True)   # the MTP layer's experts: exchanged
        assert mtp.dp_shapes
        layers = dp_layers(llm)
        budget = llm.engine.runner.dp.budget                     # 2 sequences a rank of 4 rows: 8
        assert budget == 8
        rows = 2 * budget // 2 * layers[0].gate.top_k            # N * B/2 * k: a micro-batch's
        shapes = {s for m in layers for s in m.dp_shapes}
        assert ((rows, 64), (rows, 2), (rows, 64)) in shapes and len(shapes) <= 2   # and a one-batch step's
        assert all(s[0][0] in (rows, 2 * rows) for s in shapes)
    finally:
        llm.shutdown()


def test_dp_attention_ep4_equals_one_rank_with_trees_redundant_experts_and_idle_ranks(ckpt_mtp):
    """EP 4 (correctness only on 2 cores): MTP trees (each rank drafting its own sequences, the
    hedges from the candidates they send back), 4 redundant experts re-placed every 4 forwards;
    two greedy prompts leave two ranks without sequences (they still join every exchange, the
    MTP layer's at every draft step too), then sixteen seeded ones fill every rank with four. Tokens, drafts
    and acceptance are one rank's."""
    kw = dict(dtype="float64", spec="mtp", num_drafts=3, tree_shape="1,2,1", kv_cache_tokens=2048)
    one = LLM(ckpt_mtp, **kw)
    want = [one.generate(PROMPTS[:2], GREEDY), one.generate(PROMPTS16, SEEDED)]
    llm = LLM(ckpt_mtp, **kw, ep=4, dp_attention=True, max_num_seqs=16, launcher=MPGroup, ep_timeout_s=60,
              warm_standby=False, eplb_redundant_experts=4, eplb_interval_steps=4)
    try:
        book = llm.engine.runner.dp
        got = [llm.generate(PROMPTS[:2], GREEDY)]
        assert book.idle_rank_steps > 0 and book.assigned[2:] == [0, 0]
        got.append(llm.generate(PROMPTS16, SEEDED))
        for g, w in zip(got, want):
            assert [(o.token_ids, o.drafted_tokens, o.accepted_tokens) for o in g] == \
                [(o.token_ids, o.drafted_tokens, o.accepted_tokens) for o in w]
        assert min(book.assigned) >= 4 and llm.expert_stats()["placements"] >= 2
        assert sum(o.drafted_tokens for o in want[1]) > 0
        assert all(len(m.dp_shapes) == 1 for m in dp_layers(llm))
    finally:
        llm.shutdown()


def test_dp_attention_ep4_with_ngram_equals_one_rank(ckpt_grouped):
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], *PROMPTS16[1:]]
    kw = dict(dtype="float64", spec="ngram", num_drafts=3, kv_cache_tokens=2048)
    want = LLM(ckpt_grouped, **kw).generate(prompts, GREEDY)
    llm = LLM(ckpt_grouped, **kw, ep=4, dp_attention=True, launcher=MPGroup, ep_timeout_s=60, warm_standby=False)
    try:
        got = llm.generate(prompts, GREEDY)
        assert [(o.token_ids, o.drafted_tokens) for o in got] == [(o.token_ids, o.drafted_tokens) for o in want]
        assert sum(o.drafted_tokens for o in got) > 0
    finally:
        llm.shutdown()


def test_a_dp_attention_group_restarted_mid_stream_loses_nothing(ckpt_mtp):
    """A worker SIGKILLed mid-stream (MTP chains): the group restarts, every sequence gets a rank
    again and recomputes what it committed; the tokens are one rank's."""
    import os
    import signal
    import threading
    import time
    long = [SamplingParams(max_tokens=28, ignore_eos=True),
            SamplingParams(max_tokens=28, ignore_eos=True, temperature=0.8, seed=5)]
    prompts = PROMPTS[:2]
    kw = dict(dtype="float64", spec="mtp", num_drafts=2, kv_cache_tokens=2048)
    want = [o.token_ids for o in LLM(ckpt_mtp, **kw).generate(prompts, long)]
    llm = LLM(ckpt_mtp, **kw, ep=2, dp_attention=True, launcher=MPGroup, ep_timeout_s=30, max_restarts=1,
              warm_standby=False)
    try:
        first = llm.deployment.group.pids[0]
        seqs = [llm.engine.add_request(p, sp) for p, sp in zip(prompts, long)]
        runner = threading.Thread(target=lambda: [llm.step() for _ in iter(llm.engine.has_unfinished, False)])
        runner.start()
        while seqs[0].num_output < 8 and runner.is_alive():
            time.sleep(0.01)
        os.kill(first, signal.SIGKILL)
        runner.join(timeout=120)
        assert not runner.is_alive()
        assert llm.deployment.restarts == 1
        assert [s.output_ids for s in seqs] == want
        assert min(llm.engine.runner.dp.assigned) >= 1
    finally:
        llm.shutdown()


def test_a_worker_loaded_for_the_other_layout_refuses_the_handshake(ckpt_plain):
    from ep.channel import HandshakeError, driver_handshake
    from ep.parallel import DP_MODE
    from serving.deployment import GroupConfig
    group = MPGroup(GroupConfig(model_dir=str(ckpt_plain), dtype="float32", ep=2, timeout_s=30, moe_a2a=DP_MODE,
                                warm_standby=False))
    try:
        with pytest.raises(HandshakeError, match=r"rank 1 has another attention layout \(--dp-attention\)"):
            driver_handshake(group.comm, ckpt_plain, "float32")   # rank 0: tensor-parallel attention
        group.procs[0].join(timeout=30)
        assert group.procs[0].exitcode == 2
    finally:
        group.stop()
        group.close()


def test_dp_attention_ep4_in_attention_groups_of_two_with_two_batch_overlap_equals_one_rank(ckpt_mtp):
    """`--attention-tp 2` at EP 4: two attention groups of two ranks, each splitting its heads
    (output projection all-reduced inside the group) and routing half its rows, each group's rows
    as two overlapped micro-batches (the group's collectives run while the exchange's are in
    flight); MTP chains, greedy then seeded, give one rank's tokens, drafts and acceptance."""
    kw = dict(dtype="float64", spec="mtp", num_drafts=2, kv_cache_tokens=2048)
    want = runs(LLM(ckpt_mtp, **kw))
    llm = LLM(ckpt_mtp, **kw, ep=4, dp_attention=True, attention_tp=2, two_batch_overlap=True, max_num_seqs=4,
              launcher=MPGroup, ep_timeout_s=60, warm_standby=False)
    try:
        assert runs(llm) == want
        assert llm.engine.runner.dp.dp_size == 2 and min(llm.engine.runner.dp.assigned) >= 2
        assert llm.model.layers[0].self_attn.num_heads == llm.model.config.num_attention_heads // 2
        assert all(len(m.dp_shapes) <= 2 for m in dp_layers(llm))   # micro-batches', and one-batch steps'
        assert llm.engine.runner.model.dp_step.padded_steps > 0
    finally:
        llm.shutdown()
