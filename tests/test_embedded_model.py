"""The embedded default model: transformers parity, and MTP speculation that accepts and loses nothing."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from serving.llm import LLM
from runtime.sample.sampler import SamplingParams

MODEL = Path(__file__).resolve().parents[1] / "models" / "tiny-glm-moe"


@pytest.fixture(scope="module")
def prompts() -> list[str]:
    lines = (MODEL / "heldout_prompts.jsonl").read_text().splitlines()
    return [json.loads(line)["prompt"] for line in lines[:3]]


def test_layout_and_size():
    cfg = json.loads((MODEL / "config.json").read_text())
    assert cfg["model_type"] == "glm4_moe" and cfg["num_nextn_predict_layers"] == 1
    size = sum(f.stat().st_size for f in MODEL.glob("*.safetensors"))
    assert size <= 64 * 2**20
    from safetensors import safe_open
    with safe_open(str(MODEL / "model.safetensors"), "pt") as f:
        names = list(f.keys())
        assert all(f.get_slice(n).get_dtype() == "BF16" for n in names)
    mtp = f"model.layers.{cfg['num_hidden_layers']}."
    assert any(n.startswith(mtp + "eh_proj") for n in names)
    for name in ("tokenizer.json", "generation_config.json", "README.md"):
        assert (MODEL / name).is_file()


def test_transformers_gives_our_greedy_tokens_in_float64(prompts):
    from transformers import Glm4MoeForCausalLM
    ref = Glm4MoeForCausalLM.from_pretrained(MODEL, dtype=torch.float64, experts_implementation="eager").eval()
    llm = LLM(MODEL, dtype="float64", kv_cache_tokens=4096)
    for prompt in prompts[:2]:
        ids = llm.encode(prompt)
        ours = llm.generate([ids], SamplingParams(max_tokens=16, ignore_eos=True))[0].token_ids
        with torch.no_grad():
            theirs = ref.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False, eos_token_id=None,
                                  pad_token_id=0)[0, len(ids):].tolist()
        assert ours == theirs


def test_mtp_speculation_accepts_and_loses_nothing(prompts):
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    plain = LLM(MODEL, dtype="float64", kv_cache_tokens=4096).generate(prompts, params)
    spec = LLM(MODEL, dtype="float64", kv_cache_tokens=4096, spec="mtp", num_drafts=3)
    outs = spec.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    s = spec.engine.metrics.summary()
    assert s["accept_len"] > 1.5 and s["p1"] > 0.5  # a trained drafter, not a random one
    seeded = SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.8, seed=11)
    assert [o.token_ids for o in spec.generate(prompts, seeded)] == \
        [o.token_ids for o in LLM(MODEL, dtype="float64").generate(prompts, seeded)]


def test_which_drafters_compile():
    """The deployment's switch (an LLM compiles nothing before its first step): a compiled float32
    target compiles its drafter; float64 and batch-invariant drafters, and those of an eager
    target, stay eager. That the compiled drafter accepts as the eager one does is checked with
    the compiled target (tests/runtime/executor/test_compiled.py), where its graphs are compiled anyway."""
    assert LLM(MODEL, dtype="float32", kv_cache_tokens=1024, spec="mtp", enforce_eager=False).engine.proposer.compiles
    for llm in (LLM(MODEL, dtype="float64", kv_cache_tokens=1024, spec="mtp", enforce_eager=False),
                LLM(MODEL, dtype="float32", kv_cache_tokens=1024, spec="mtp", batch_invariant=True, enforce_eager=False),
                LLM(MODEL, dtype="float32", kv_cache_tokens=1024, spec="mtp", enforce_eager=True)):
        assert not llm.engine.proposer.compiles
