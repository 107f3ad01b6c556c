"""Parity with transformers' Glm4MoeForCausalLM on checkpoints it wrote itself (the helpers serve
every family: tests/runtime/model/test_families.py).

transformers runs RMSNorm and the router in float32 even inside a float64 model. Those float32
islands round differently with memory alignment (two identical float32 `F.linear` calls on
equal weights were seen to differ by one ulp), which decode steps then amplify past 1e-9. So the
float64 oracle lifts both islands to the model dtype on the reference side, as our runtime does
in float64: the comparison is then float64 math against float64 math. The float32 comparison
runs transformers unchanged.
"""
from __future__ import annotations

import importlib

import pytest
import torch

from runtime.ops import cpu_ops
from runtime.executor.attention import PagedAttention, SeqChunk, build_plan, choose_attention_backend
from runtime.ops.batch_invariant import set_batch_invariant
from runtime.executor.kv_cache import PagedKVCache
from serving.llm import LLM
from runtime.sample.sampler import SamplingParams
from runtime.model.weights import load_model
from tests.conftest import cache_kwargs, output_cache

TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-4}
BF16_LOGITS_ULPS = 8   # bfloat16 steps of the largest logit two bfloat16 paths may differ by


def _norm_in_input_dtype(self, hidden_states):
    h = hidden_states.to(torch.float64)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
    return self.weight * h.to(hidden_states.dtype)


def _router_in_input_dtype(self, hidden_states):
    import torch.nn.functional as F
    x = hidden_states.view(-1, self.hidden_dim)
    logits = F.linear(x, self.weight.to(x.dtype))
    scores = logits.sigmoid()
    choice = scores + self.e_score_correction_bias.to(x.dtype)
    grouped = choice.view(-1, self.num_group, self.num_experts // self.num_group)
    group_idx = grouped.topk(2, dim=-1)[0].sum(dim=-1).topk(self.topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros(x.shape[0], self.num_group, dtype=x.dtype).scatter_(1, group_idx, 1)
    keep = group_mask.unsqueeze(-1).expand_as(grouped).reshape(-1, self.num_experts)
    idx = choice.masked_fill(keep == 0, float("-inf")).topk(self.top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, idx)
    if self.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return logits, weights * self.routed_scaling_factor, idx


def _softmax_router_in_input_dtype(self, hidden_states):
    x = hidden_states.reshape(-1, self.hidden_dim)
    logits = torch.nn.functional.linear(x, self.weight.to(x.dtype))
    weights, idx = torch.softmax(logits, dim=-1).topk(self.top_k, dim=-1)
    if self.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return logits, weights, idx


@pytest.fixture
def float64_islands(monkeypatch):
    """Every family's RMSNorm and router in the model dtype on the reference side."""
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as ds
    from transformers.models.glm4_moe import modeling_glm4_moe as glm
    from transformers.models.glm4_moe_lite import modeling_glm4_moe_lite as lite
    from transformers.models.qwen3_moe import modeling_qwen3_moe as qwen
    for norm in (glm.Glm4MoeRMSNorm, ds.DeepseekV3RMSNorm, lite.Glm4MoeLiteRMSNorm, qwen.Qwen3MoeRMSNorm):
        monkeypatch.setattr(norm, "forward", _norm_in_input_dtype)
    for router in (glm.Glm4MoeTopkRouter, ds.DeepseekV3TopkRouter, lite.Glm4MoeLiteTopkRouter):
        monkeypatch.setattr(router, "forward", _router_in_input_dtype)
    monkeypatch.setattr(qwen.Qwen3MoeTopKRouter, "forward", _softmax_router_in_input_dtype)
    for name, prefix in (("glm_moe_dsa", "GlmMoeDsa"), ("deepseek_v32", "DeepseekV32")):   # transformers >= 5.2x
        try:
            module = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
        except ImportError:
            continue
        monkeypatch.setattr(getattr(module, f"{prefix}RMSNorm"), "forward", _norm_in_input_dtype)
        monkeypatch.setattr(getattr(module, f"{prefix}TopkRouter"), "forward", _router_in_input_dtype)


def reference(path, dtype):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, experts_implementation="eager").eval()


def our_logits_stepwise(model, ids: list[int], prefill: int, batch_invariant: bool = False) -> torch.Tensor:
    """Prefill the first `prefill` tokens in one chunk, then one token per step; logits of every row.
    `batch_invariant`: the steps' plans for the batch-invariant kernels (switched on by the caller)."""
    cfg = model.config
    cache = PagedKVCache(num_layers=cfg.num_hidden_layers, num_blocks=16, block_size=4, dtype=model.dtype,
                         device=model.device, **model.cache_layout())
    choose_attention_backend(cache, sparse=model.sparse is not None)   # as the runner chooses, once
    rows = []
    start = 0
    with torch.no_grad():
        for n in [prefill] + [1] * (len(ids) - prefill):
            cache.reserve(0, start + n)
            plan = build_plan(cache, [SeqChunk(0, start, n)], batch_invariant=batch_invariant)
            hidden = model(torch.tensor(ids[start:start + n]), plan.positions, PagedAttention(cache, plan))
            rows.append(model.compute_logits(hidden))
            start += n
    return torch.cat(rows)


def reference_logits_stepwise(ref, ids: list[int], prefill: int) -> torch.Tensor:
    """transformers with its own KV cache: the same prefill chunk, then one token per step."""
    from transformers import DynamicCache
    cache = DynamicCache(config=ref.config)
    rows = []
    with torch.no_grad():
        out = ref(torch.tensor([ids[:prefill]]), **cache_kwargs(ref, cache), use_cache=True)
        rows.append(out.logits[0])
        for t in ids[prefill:]:
            out = ref(torch.tensor([[t]]), **cache_kwargs(ref, output_cache(out)), use_cache=True)
            rows.append(out.logits[0])
    return torch.cat(rows)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("which", ["ckpt_plain", "ckpt_grouped"])
def test_logits_match_transformers_prefill_and_decode(request, which, dtype):
    if dtype == torch.float64:
        request.getfixturevalue("float64_islands")
    path = request.getfixturevalue(which)
    ref = reference(path, dtype)
    ours = load_model(path, dtype, device="cpu")
    ids = torch.randint(0, ref.config.vocab_size, (20,), generator=torch.Generator().manual_seed(3)).tolist()
    for prefill in (20, 7):
        expected = reference_logits_stepwise(ref, ids, prefill)
        assert expected.abs().max() > 0.1  # the comparison means something
        got = our_logits_stepwise(ours, ids, prefill)
        assert got.dtype == dtype
        assert (got - expected).abs().max().item() < TOLERANCE[dtype], f"prefill={prefill}"


@pytest.mark.parametrize("which", ["ckpt_plain", "ckpt_grouped"])
def test_greedy_continuations_identical_in_float64(request, which, float64_islands):
    path = request.getfixturevalue(which)
    ref = reference(path, torch.float64)
    llm = LLM(path, dtype="float64", kv_cache_tokens=1024)
    prompts = [[5, 17, 200, 3], [9, 9, 9, 100, 250, 31, 7, 64], [300]]
    outs = llm.generate(prompts, SamplingParams(max_tokens=24, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            want = ref.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False,
                                eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        assert out.token_ids == want
        assert out.finish_reason == "length"


def batch_invariant_model(path, dtype: torch.dtype):
    """The checkpoint loaded as served, with the batch-invariant kernels switched on; skips
    without the native CPU ops, whose kernels these tests are about."""
    if not cpu_ops.load():
        pytest.skip(f"the native CPU ops are unavailable: {cpu_ops.error()}")
    model = load_model(path, dtype, device="cpu")
    set_batch_invariant(model, True)
    return model


@pytest.mark.parametrize("which", ["ckpt_plain", "ckpt_grouped"])
def test_batch_invariant_float32_logits_match_transformers(request, which):
    """The batch-invariant step (GEMMs and experts on the native few-row kernel at every row
    count, attention in place: `_invariant_plan`) against transformers, not only against itself:
    float32 logits within 1e-4 over a prefill and decode steps."""
    path = request.getfixturevalue(which)
    ref = reference(path, torch.float32)
    ours = batch_invariant_model(path, torch.float32)
    ids = torch.randint(0, ref.config.vocab_size, (20,), generator=torch.Generator().manual_seed(3)).tolist()
    for prefill in (20, 7):
        expected = reference_logits_stepwise(ref, ids, prefill)
        got = our_logits_stepwise(ours, ids, prefill, batch_invariant=True)
        assert got.dtype == torch.float32
        assert (got - expected).abs().max().item() < TOLERANCE[torch.float32], f"prefill={prefill}"


@pytest.mark.parametrize("which", ["ckpt_plain", "ckpt_grouped"])
def test_batch_invariant_bfloat16_logits_match_the_default_path(request, which):
    """bfloat16: the batch-invariant step's logits against the default step's on the same
    weights, within bfloat16 rounding (BF16_LOGITS_ULPS of the largest logit), and no further from
    the float32 transformers logits than the default step is (a kernel that computed something
    else would be off by the logits' own size)."""
    path = request.getfixturevalue(which)
    ref = reference(path, torch.float32)
    ids = torch.randint(0, ref.config.vocab_size, (20,), generator=torch.Generator().manual_seed(3)).tolist()
    default = load_model(path, torch.bfloat16, device="cpu")
    ours = batch_invariant_model(path, torch.bfloat16)
    for prefill in (20, 7):
        want = our_logits_stepwise(default, ids, prefill).float()
        got = our_logits_stepwise(ours, ids, prefill, batch_invariant=True).float()
        truth = reference_logits_stepwise(ref, ids, prefill)
        scale = want.abs().max().item()
        assert scale > 0.1 and not torch.equal(got, want)   # the two paths round differently
        assert (got - want).abs().max().item() <= BF16_LOGITS_ULPS * 2.0 ** -8 * scale, f"prefill={prefill}"
        assert (got - truth).abs().max() <= 1.5 * (want - truth).abs().max(), f"prefill={prefill}"
