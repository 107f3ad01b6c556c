"""EP 2 equals EP 1 on every family (float64, greedy and seeded; gloo ranks started by the mp
launcher): routed experts split across the ranks, query heads split, and for multi-head latent
attention the latent projections and cache replicated, Qwen3.5's Gated DeltaNet heads split with
their recurrent states; the MTP families draft at EP 2 too (Qwen3.5 from `mtp.*`)."""
from __future__ import annotations

import pytest

from launch.mp import MPGroup
from runtime.sample.sampler import SamplingParams
from serving.llm import LLM

PROMPTS = [[5, 17, 200, 3], [9, 9, 9, 100, 250, 31, 7, 64, 12], [300]]
PARAMS = [SamplingParams(max_tokens=10, ignore_eos=True),
          SamplingParams(max_tokens=10, ignore_eos=True, temperature=0.8, seed=5)]
CASES = [("qwen_norm", "alltoall", {}), ("deepseek_yarn", "allreduce", dict(spec="mtp", num_drafts=2)),
         ("glm_lite", "alltoall", dict(spec="mtp", num_drafts=2)),
         ("glm5", "alltoall", dict(spec="mtp", num_drafts=2)), ("deepseek_v32", "allreduce", {}),
         ("qwen35_vl", "alltoall", dict(spec="mtp", num_drafts=2))]


@pytest.mark.parametrize("case, mode, spec", CASES, ids=[c for c, _, _ in CASES])
def test_ep2_tokens_equal_one_rank_in_float64(family_ckpt, case, mode, spec):
    path = family_ckpt(case)
    single = LLM(path, dtype="float64", kv_cache_tokens=1024)
    want = [[o.token_ids for o in single.generate(PROMPTS, p)] for p in PARAMS]
    llm = LLM(path, dtype="float64", kv_cache_tokens=1024, ep=2, moe_a2a=mode, ep_timeout_s=60, launcher=MPGroup,
              **spec)
    try:
        assert [[o.token_ids for o in llm.generate(PROMPTS, p)] for p in PARAMS] == want
        assert len(llm.rank_weight_bytes) == 2
        assert max(llm.rank_weight_bytes) < sum(p.numel() * p.element_size() for p in single.model.parameters())
        if spec:
            assert llm.engine.metrics.drafted_tokens > 0
        cfg = single.model.config
        if cfg.linear_layers:   # DeltaNet heads split: rank 0 keeps the state of half the value heads
            assert 2 * llm.engine.runner.cache.states.rec_shape[1] == cfg.linear_num_value_heads
    finally:
        llm.shutdown()


def test_qwen35_draft_trees_at_ep2_equal_plain_decoding(family_ckpt):
    """Draft trees over the split DeltaNet states at EP 2 (float64, greedy): the `mtp.*` drafter's
    trees, then scripted trees that take hedges, whose moves every rank replays on its states."""
    pytest.importorskip("transformers.models.qwen3_5_moe", reason="transformers without Qwen3.5-MoE")
    from tests.runtime.model.test_qwen3_5 import SPEC_PROMPTS, HedgingProposer
    path, params = family_ckpt("qwen35_vl"), SamplingParams(max_tokens=8, ignore_eos=True)
    want = [o.token_ids for o in LLM(path, dtype="float64", kv_cache_tokens=1024).generate(SPEC_PROMPTS, params)]
    llm = LLM(path, dtype="float64", kv_cache_tokens=1024, ep=2, ep_timeout_s=60, launcher=MPGroup, spec="mtp",
              num_drafts=3, tree_shape="1,2,2", draft_policy="fixed")
    try:
        assert [o.token_ids for o in llm.generate(SPEC_PROMPTS, params)] == want
        llm.engine.proposer = HedgingProposer({tuple(p): w for p, w in zip(SPEC_PROMPTS, want)}, {})
        assert [o.token_ids for o in llm.generate(SPEC_PROMPTS, params)] == want
        assert llm.engine.metrics.hedges_taken > 0 and llm.deployment.restarts == 0
    finally:
        llm.shutdown()


@pytest.mark.timeout(300)
def test_qwen35_ep2_restart_recomputes_the_states_from_the_tokens(family_ckpt):
    """A killed worker mid-generation: the group restarts and every sequence's recurrent states
    (and KV) are recomputed from its tokens; the output is an undisturbed run's (float64)."""
    pytest.importorskip("transformers.models.qwen3_5_moe", reason="transformers without Qwen3.5-MoE")
    import os
    import signal
    import threading
    import time
    path = family_ckpt("qwen35_text")
    prompts, params = PROMPTS[:2], SamplingParams(max_tokens=24, ignore_eos=True)
    want = [o.token_ids for o in LLM(path, dtype="float64", kv_cache_tokens=1024).generate(prompts, params)]
    llm = LLM(path, dtype="float64", kv_cache_tokens=1024, ep=2, launcher=MPGroup, ep_timeout_s=30, max_restarts=2)
    try:
        seqs = [llm.engine.add_request(p, params) for p in prompts]
        runner = threading.Thread(target=lambda: [llm.step() for _ in iter(llm.engine.has_unfinished, False)])
        runner.start()
        while seqs[0].num_output < 6 and runner.is_alive():
            time.sleep(0.005)
        os.kill(llm.deployment.group.pids[0], signal.SIGKILL)
        runner.join(timeout=240)
        assert not runner.is_alive()
        assert [s.output_ids for s in seqs] == want and llm.deployment.restarts == 1
    finally:
        llm.shutdown()
