"""Every family of the registry against transformers' own implementation, on small random
checkpoints it wrote (tests/conftest.py FAMILY_CASES: Qwen3-MoE with norm_topk_prob on and off,
decoder_sparse_step and mlp_only_layers; DeepSeek-V3 with q_lora_rank set and unset, grouped
routing, YaRN, first_k_dense_replace; GLM-4.7-Flash with mlp_layer_types; GLM-5 and DeepSeek-V3.2
with sparse attention, index_topk below the prompt, GLM-5 with a shared-indexer layer), plus the registry's
refusals and the compressed cache of multi-head latent attention."""
from __future__ import annotations

import json

import pytest
import torch

from runtime.model.config import ConfigError, ModelConfig, load_config
from runtime.model.families import FAMILIES
from runtime.sample.sampler import SamplingParams
from runtime.model.weights import load_model
from serving.llm import LLM
from tests.conftest import FAMILY_CASES
from tests.runtime.model.test_oracle import (TOLERANCE, float64_islands, our_logits_stepwise, reference,  # noqa: F401
                                       reference_logits_stepwise)

CASES = list(FAMILY_CASES)
IDS = torch.randint(0, 320, (20,), generator=torch.Generator().manual_seed(3)).tolist()


def test_unknown_architecture_is_refused_naming_it_and_the_supported(family_ckpt):
    raw = json.loads((family_ckpt("qwen_sparse") / "config.json").read_text())
    with pytest.raises(ConfigError) as err:
        ModelConfig.from_hf_dict({**raw, "architectures": ["MixtralForCausalLM"], "model_type": "mixtral"})
    msg = str(err.value)
    assert "\n" not in msg and "MixtralForCausalLM" in msg
    assert all(arch in msg for arch in FAMILIES)
    # model_type alone still finds the family (published configs without `architectures`)
    assert ModelConfig.from_hf_dict({**raw, "architectures": None}).architecture == "Qwen3MoeForCausalLM"


@pytest.mark.parametrize("case", CASES)
def test_layers_are_what_transformers_builds(family_ckpt, case):
    """Attention kind, MoE or dense MLP per layer and shared experts, as the reference has them."""
    path = family_ckpt(case)
    ref, ours = reference(path, torch.float32), load_model(path, "float32", device="cpu")
    cfg = load_config(path)
    assert cfg.architecture == json.loads((path / "config.json").read_text())["architectures"][0]
    for theirs, mine in zip(ref.model.layers, ours.layers, strict=True):
        assert hasattr(theirs.mlp, "experts") == hasattr(mine.mlp, "experts")
        assert hasattr(theirs.mlp, "shared_experts") == (getattr(mine.mlp, "shared_experts", None) is not None)
        assert hasattr(theirs.self_attn, "kv_b_proj") == cfg.is_mla
    assert (ours.mtp is not None) == (FAMILY_CASES[case][0] != "qwen3_moe")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("case", CASES)
def test_logits_match_transformers_prefill_and_decode(request, family_ckpt, case, dtype):
    if dtype == torch.float64:
        request.getfixturevalue("float64_islands")
    path = family_ckpt(case)
    ref, ours = reference(path, dtype), load_model(path, dtype, device="cpu")
    for prefill in (20, 7):
        expected = reference_logits_stepwise(ref, IDS, prefill)
        assert expected.abs().max() > 0.1
        got = our_logits_stepwise(ours, IDS, prefill)
        assert (got - expected).abs().max().item() < TOLERANCE[dtype], f"prefill={prefill}"


@pytest.mark.parametrize("case", CASES)
def test_greedy_continuations_identical_in_float64(family_ckpt, case, float64_islands):
    path = family_ckpt(case)
    ref = reference(path, torch.float64)
    prompts = [[5, 17, 200, 3], [9, 9, 9, 100, 250, 31, 7, 64]]
    outs = LLM(path, dtype="float64", kv_cache_tokens=512).generate(prompts, SamplingParams(max_tokens=16,
                                                                                           ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            want = ref.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, eos_token_id=None,
                                pad_token_id=0)[0, len(prompt):].tolist()
        assert out.token_ids == want


@pytest.mark.parametrize("case", ["deepseek_yarn", "glm_lite"])
def test_mla_cache_holds_the_latent_and_the_rotary_key_per_token(family_ckpt, case):
    path = family_ckpt(case)
    cfg = load_config(path)
    llm = LLM(path, dtype="float64", kv_cache_tokens=256)
    cache = llm.engine.runner.cache
    layers = cfg.num_hidden_layers + 1          # the MTP layer has its own plane
    assert cache.bytes_per_token == (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * layers * 8
    # no value tensor beside it (one more cell: the scratch cell padded static steps write to)
    assert cache.k.numel() * 8 == cache.bytes_per_token * (cache.capacity_tokens + 1)
    assert cache.bytes_per_token == cfg.kv_values_per_token() * layers * 8
    uncompressed = cfg.num_attention_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim)
    assert cfg.kv_values_per_token(compressed=False) == uncompressed > cfg.kv_values_per_token()


def test_mtp_is_refused_in_one_line_on_a_family_without_it(family_ckpt):
    path = family_ckpt("qwen_norm")
    with pytest.raises(ValueError) as err:
        LLM(path, dtype="float32", kv_cache_tokens=256, spec="mtp")
    assert "\n" not in str(err.value) and "Qwen3MoeForCausalLM" in str(err.value) and "ngram" in str(err.value)
