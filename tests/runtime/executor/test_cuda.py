"""The runtime on a GPU (marked `cuda`: skipped without one; `make gpu-check` runs them): every
tensor on the device, parity with transformers on the device, speculation with CUDA graphs on and
off, one graph for the arrangements of one depth multiset, NCCL through the EP code path at world
size 1, and the KV cache sized from free GPU memory.

Written and checked on a CPU-only machine: the code paths are the ones the CPU suite runs, but
these tests themselves have not run on a GPU yet (tolerances for float32/bfloat16 are estimates).
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from runtime.executor.attention import PagedAttention, SeqChunk, build_plan
from runtime.executor.kv_cache import PagedKVCache
from runtime.executor.runner import ModelRunner
from runtime.sample.sampler import SamplingParams
from runtime.executor.static_step import StaticShape
from runtime.model.weights import load_model
from tests.conftest import cache_kwargs, output_cache
from serving.llm import LLM
from tests.runtime.executor.test_device_placement import DevicelessFactories

pytestmark = pytest.mark.cuda

MODEL = Path(__file__).resolve().parents[3] / "models" / "tiny-glm-moe"
PROMPTS = [[5, 17, 200, 3, 5, 17, 200], [9, 9, 9, 100, 250, 31, 7, 64, 12, 13, 14], [300, 4], [41, 42, 41, 42]]
GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.8, seed=7)
CUDA = torch.device("cuda", 0)


def tokens(llm: LLM, params: SamplingParams = GREEDY) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(PROMPTS, params)]


def share_equal(a: list[list[int]], b: list[list[int]]) -> float:
    """Share of positions where two runs agree, counting nothing after a request's first difference."""
    same = 0
    for x, y in zip(a, b):
        for s, t in zip(x, y):
            if s != t:
                break
            same += 1
    return same / sum(len(x) for x in a)


def test_every_tensor_lives_on_the_gpu():
    # No factory without a device, on the padded path (eager: torch.compile is kept out of the mode).
    mode = DevicelessFactories()
    with mode:
        llm = LLM(MODEL, dtype="bfloat16", kv_cache_tokens=4096, device="cuda", spec="mtp", tree_shape="1,2,2",
                  enforce_eager=True, static_steps=True)
        llm.generate(PROMPTS, [GREEDY, SEEDED, GREEDY, SEEDED])
    assert mode.calls == []
    # The default on CUDA: graphs captured for target and drafter, every tensor on the GPU.
    llm = LLM(MODEL, dtype="bfloat16", kv_cache_tokens=4096, device="cuda", spec="mtp", num_drafts=3)
    # One sequence's decode and verify buckets, and the drafter's, are captured at start.
    assert {StaticShape(1, 1, 256), StaticShape(1, 4, 256)} <= set(llm.engine.runner.graphs.entries)
    assert StaticShape(1, 1, 256) in llm.engine.proposer.graphs.entries
    outs = llm.generate(PROMPTS, [GREEDY, SEEDED, GREEDY, SEEDED])
    assert all(len(o.token_ids) == 24 for o in outs)
    runner = llm.engine.runner
    assert {p.device for p in llm.model.parameters()} == {CUDA}
    assert {b.device for b in llm.model.buffers()} == {CUDA}
    assert runner.cache.k.device == CUDA and runner.cache.v.device == CUDA
    assert runner.graphs is not None and runner.graphs.entries
    for shape, entry in runner.graphs.entries.items():
        assert entry.graph is not None, shape
        for t in (entry.buffers.tokens, entry.buffers.positions, entry.buffers.gather, entry.buffers.mask):
            assert t.device == CUDA
    assert runner.graphs.replays > 0 and runner.graphs.pool_bytes >= 0
    drafter = llm.engine.proposer.graphs
    assert drafter is not None and drafter.replays > 0
    assert all(e.graph is not None and e.buffers.hidden_in.device == CUDA for e in drafter.entries.values())


def test_nothing_falls_back_to_the_cpu_silently():
    with pytest.raises(ValueError, match="expected auto, cpu, cuda or cuda:N"):
        LLM(MODEL, device="gpu")
    with pytest.raises(ValueError, match=r"this host has \d+ CUDA device"):
        LLM(MODEL, device=f"cuda:{torch.cuda.device_count()}")
    from runtime.platform.device import check_local_gpus
    with pytest.raises(ValueError, match="needs .* GPUs on this host"):
        check_local_gpus(CUDA, torch.cuda.device_count() + 1)


# --- parity with transformers on the GPU ---------------------------------------------------------
def _logits_stepwise(model, ids: list[int], prefill: int) -> torch.Tensor:
    cfg = model.config
    cache = PagedKVCache(num_layers=cfg.num_hidden_layers, num_blocks=16, block_size=4, dtype=model.dtype,
                         device=CUDA, **model.cache_layout())
    rows, start = [], 0
    with torch.no_grad():
        for n in [prefill] + [1] * (len(ids) - prefill):
            cache.reserve(0, start + n)
            plan = build_plan(cache, [SeqChunk(0, start, n)])
            hidden = model(torch.tensor(ids[start:start + n], device=CUDA), plan.positions, PagedAttention(cache, plan))
            rows.append(model.compute_logits(hidden).double())
            start += n
    return torch.cat(rows)


def _reference_stepwise(ref, ids: list[int], prefill: int) -> torch.Tensor:
    from transformers import DynamicCache
    cache = DynamicCache(config=ref.config)
    rows = []
    with torch.no_grad():
        out = ref(torch.tensor([ids[:prefill]], device=CUDA), **cache_kwargs(ref, cache), use_cache=True)
        rows.append(out.logits[0].double())
        for t in ids[prefill:]:
            out = ref(torch.tensor([[t]], device=CUDA), **cache_kwargs(ref, output_cache(out)), use_cache=True)
            rows.append(out.logits[0].double())
    return torch.cat(rows)


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 2e-3), (torch.bfloat16, 0.1)])
def test_logits_match_transformers_on_the_gpu(ckpt_grouped, dtype, tolerance):
    """float32 and bfloat16 within tolerance of transformers on the same GPU (relative to the
    largest logit), prefill and decode."""
    from transformers import AutoModelForCausalLM
    ref = AutoModelForCausalLM.from_pretrained(ckpt_grouped, dtype=dtype, experts_implementation="eager").to(CUDA).eval()
    ours = load_model(ckpt_grouped, dtype, device=CUDA)
    ids = torch.randint(0, ref.config.vocab_size, (20,), generator=torch.Generator(device="cpu").manual_seed(3),
                        device="cpu").tolist()
    for prefill in (20, 7):
        want = _reference_stepwise(ref, ids, prefill)
        got = _logits_stepwise(ours, ids, prefill)
        scale = want.abs().max().item()
        assert scale > 0.1
        assert (got - want).abs().max().item() < tolerance * scale, f"{dtype} prefill={prefill}"


def _router_on_device(self, hidden_states):
    import torch.nn.functional as F
    x = hidden_states.view(-1, self.hidden_dim)
    logits = F.linear(x, self.weight.to(x.dtype))
    scores = logits.sigmoid()
    choice = scores + self.e_score_correction_bias.to(x.dtype)
    grouped = choice.view(-1, self.num_group, self.num_experts // self.num_group)
    group_idx = grouped.topk(2, dim=-1)[0].sum(dim=-1).topk(self.topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros(x.shape[0], self.num_group, dtype=x.dtype, device=x.device).scatter_(1, group_idx, 1)
    keep = group_mask.unsqueeze(-1).expand_as(grouped).reshape(-1, self.num_experts)
    idx = choice.masked_fill(keep == 0, float("-inf")).topk(self.top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, idx)
    if self.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return logits, weights * self.routed_scaling_factor, idx


def test_float64_greedy_equals_transformers_on_the_gpu(ckpt_grouped, monkeypatch):
    """float64 exact: transformers' float32 islands (norm, router) lifted to float64, as in
    tests/runtime/model/test_oracle.py."""
    from transformers import AutoModelForCausalLM
    from transformers.models.glm4_moe import modeling_glm4_moe as glm
    from tests.runtime.model.test_oracle import _norm_in_input_dtype
    monkeypatch.setattr(glm.Glm4MoeRMSNorm, "forward", _norm_in_input_dtype)
    monkeypatch.setattr(glm.Glm4MoeTopkRouter, "forward", _router_on_device)
    ref = AutoModelForCausalLM.from_pretrained(ckpt_grouped, dtype=torch.float64,
                                               experts_implementation="eager").to(CUDA).eval()
    llm = LLM(ckpt_grouped, dtype="float64", kv_cache_tokens=1024, device="cuda")
    for prompt, out in zip(PROMPTS, llm.generate(PROMPTS, GREEDY)):
        with torch.no_grad():
            want = ref.generate(torch.tensor([prompt], device=CUDA), max_new_tokens=24, do_sample=False,
                                eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        assert out.token_ids == want


# --- speculation and CUDA graphs -----------------------------------------------------------------
def test_float64_static_steps_on_the_gpu_are_lossless():
    """The padded step path on the GPU (float64: no capture, exact): speculation gives the tokens
    of plain decoding, chain and tree, greedy and seeded."""
    kw = dict(dtype="float64", kv_cache_tokens=2048, device="cuda", batch_invariant=False)
    for params in (GREEDY, SEEDED):
        want = tokens(LLM(MODEL, static_steps=False, **kw), params)
        for spec in (dict(spec="mtp", num_drafts=3), dict(spec="mtp", tree_shape="1,2,2")):
            llm = LLM(MODEL, static_steps=True, **kw, **spec)
            assert tokens(llm, params) == want
            assert llm.engine.runner.graphs.entries


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_speculation_with_graphs_on_and_off(dtype):
    """Greedy MTP with CUDA graphs against plain eager decoding, and graphs on against off: equal
    up to floating-point ties (a padded bucket may pick another GEMM kernel than the unpadded step)."""
    kw = dict(dtype=dtype, kv_cache_tokens=4096, device="cuda")
    plain = tokens(LLM(MODEL, enforce_eager=True, **kw))
    eager = tokens(LLM(MODEL, enforce_eager=True, spec="mtp", num_drafts=3, **kw))
    graphed_llm = LLM(MODEL, spec="mtp", num_drafts=3, **kw)
    graphed = tokens(graphed_llm)
    graphs = graphed_llm.engine.runner.graphs
    # float32 captures with the fused Triton experts; without them (no triton) its padded steps
    # run eagerly (runtime.platform.device.capture_refusal)
    from runtime.model.experts import uses_fused_experts
    assert graphs.capture == (dtype == "bfloat16" or uses_fused_experts(graphed_llm.model))
    assert (graphs.replays > 0) == graphs.capture
    assert share_equal(graphed, eager) >= 0.9
    assert share_equal(graphed, plain) >= 0.9
    assert all(g[:4] == p[:4] for g, p in zip(graphed, plain))


def test_one_graph_for_the_arrangements_of_one_depth_multiset():
    """Two verify steps over the same slots with the depths laid out differently replay one
    captured graph, and each gives the rows of the eager step."""
    model = load_model(MODEL, "bfloat16", device=CUDA)
    eager = ModelRunner(model, kv_cache_tokens=1024, batch_invariant=False)
    graphed = ModelRunner(model, kv_cache_tokens=1024, batch_invariant=False, static_steps=True, cuda_graphs=True)
    prompt = {0: [5, 17, 200, 3, 9], 1: [9, 9, 9, 100, 250, 31, 7, 64, 12], 2: [300, 4, 41, 42, 41, 42, 7]}
    for runner in (eager, graphed):
        for s, p in prompt.items():
            runner.cache.reserve(s, len(p))
            runner.forward(p, [SeqChunk(s, 0, len(p))])
    before = set(graphed.graphs.entries)
    replays = graphed.graphs.replays
    for depths in ((3, 1, 2), (1, 2, 3), (2, 3, 1)):
        chunks, toks = [], []
        for s, d in zip(prompt, depths):
            chunks.append(SeqChunk(s, eager.cache.book.lengths[s], d + 1))
            toks += [7 + s] * (d + 1)
        for runner in (eager, graphed):
            for c in chunks:
                runner.cache.reserve(c.seq_id, c.end)
        want, _ = eager.forward(toks, chunks)
        got, _ = graphed.forward(toks, chunks)
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    assert set(graphed.graphs.entries) - before == {StaticShape(4, 4, 256)}
    assert graphed.graphs.replays - replays == 3


# --- expert parallelism and memory ---------------------------------------------------------------
def test_nccl_at_world_size_one_through_the_ep_code_path():
    from ep.comm import Communicator, free_port
    comm = Communicator(rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{free_port()}", timeout_s=60,
                        device=CUDA, join_group=True)
    assert comm.backend == "nccl"
    try:
        llm = LLM(MODEL, dtype="float64", kv_cache_tokens=2048, comm=comm, spec="mtp", num_drafts=2)
        got = tokens(llm, SEEDED)
        assert llm.engine.runner.sent["FORWARD"] > 0
    finally:
        comm.close()
    want = tokens(LLM(MODEL, dtype="float64", kv_cache_tokens=2048, device="cuda"), SEEDED)
    assert got == want


def test_float32_capture_is_refused_in_one_line_without_the_fused_experts():
    from runtime.model.experts import choose_fused_experts
    model = load_model(MODEL, "float32", device=CUDA)
    choose_fused_experts(model, False)
    with pytest.raises(ValueError, match="CUDA graphs are refused in float32"):
        ModelRunner(model, kv_cache_tokens=1024, batch_invariant=False, static_steps=True, cuda_graphs=True)


def test_capture_on_a_second_gpu_replays_its_own_output():
    """On cuda:1 with cuda:0 current, the captured step gives the eager step's rows."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    torch.cuda.set_device(0)
    dev = torch.device("cuda", 1)
    model = load_model(MODEL, "bfloat16", device=dev)
    torch.cuda.set_device(0)
    eager = ModelRunner(model, kv_cache_tokens=1024, batch_invariant=False)
    torch.cuda.set_device(0)
    graphed = ModelRunner(model, kv_cache_tokens=1024, batch_invariant=False, static_steps=True, cuda_graphs=True)
    for runner in (eager, graphed):
        runner.cache.reserve(0, 5)
        runner.forward([5, 17, 200, 3, 9], [SeqChunk(0, 0, 5)])
        runner.cache.reserve(0, 6)
    a, _ = eager.forward([7], [SeqChunk(0, 5, 1)])
    b, _ = graphed.forward([7], [SeqChunk(0, 5, 1)])
    assert graphed.graphs.replays == 1
    torch.testing.assert_close(b, a, rtol=2e-2, atol=2e-2)


def test_float32_captures_with_the_fused_experts():
    """The fused Triton experts are sync-free: a float32 step captures, and its replay gives the
    eager step's rows."""
    pytest.importorskip("triton")
    from runtime.model.experts import uses_fused_experts
    model = load_model(MODEL, "float32", device=CUDA)
    assert uses_fused_experts(model)
    eager = ModelRunner(model, kv_cache_tokens=1024, batch_invariant=False)
    graphed = ModelRunner(model, kv_cache_tokens=1024, batch_invariant=False, static_steps=True, cuda_graphs=True)
    for runner in (eager, graphed):
        runner.cache.reserve(0, 5)
        runner.forward([5, 17, 200, 3, 9], [SeqChunk(0, 0, 5)])
        runner.cache.reserve(0, 6)
    a, _ = eager.forward([7], [SeqChunk(0, 5, 1)])
    b, _ = graphed.forward([7], [SeqChunk(0, 5, 1)])
    assert graphed.graphs.replays == 1
    torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)


def test_kv_cache_sized_from_free_gpu_memory():
    llm = LLM(MODEL, dtype="bfloat16", device="cuda", gpu_memory_utilization=0.2)
    cache = llm.engine.runner.cache
    free, total = torch.cuda.mem_get_info(CUDA)
    cache_bytes = cache.k.numel() * cache.k.element_size() * 2
    assert cache_bytes <= 0.2 * total
    assert cache.capacity_tokens > 100_000
    assert len(llm.generate(PROMPTS[:1], GREEDY)[0].token_ids) == 24
