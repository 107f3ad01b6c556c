"""Batch invariance, KV rewind, stop conditions and preemption through the engine."""
from __future__ import annotations

import pytest
import torch

from runtime.executor.attention import PagedAttention, SeqChunk, build_plan
from engine.engine import RequestError
from runtime.executor.kv_cache import PagedKVCache
from serving.llm import LLM
from runtime.sample.sampler import SamplingParams
from runtime.model.weights import load_model

PROMPTS = [[5, 17, 200, 3], [9, 9, 9, 100, 250, 31, 7, 64, 12, 13, 14], [300], [41, 42]]


@pytest.fixture(scope="module")
def llm64(ckpt_grouped):
    return LLM(ckpt_grouped, dtype="float64", kv_cache_tokens=2048)


@pytest.mark.parametrize("params", [SamplingParams(max_tokens=20, ignore_eos=True),
                                    SamplingParams(max_tokens=20, ignore_eos=True, temperature=1.0, seed=7),
                                    SamplingParams(max_tokens=20, ignore_eos=True, temperature=0.8, top_p=0.9,
                                                   top_k=50, seed=11)])
def test_batched_equals_one_by_one_float64(llm64, params):
    together = llm64.generate(PROMPTS, params)
    alone = [llm64.generate([p], params)[0] for p in PROMPTS]
    assert [o.token_ids for o in together] == [o.token_ids for o in alone]
    assert all(len(o.token_ids) == 20 for o in together)


def test_seeded_sampling_depends_on_seed(llm64):
    def run(seed: int | None, temperature: float = 1.0) -> list[int]:
        params = SamplingParams(max_tokens=16, temperature=temperature, seed=seed, ignore_eos=True)
        return llm64.generate([PROMPTS[0]], params)[0].token_ids

    a, b, greedy = run(1), run(2), run(None, temperature=0.0)
    # At temperature 1 over 320 tokens, 16 draws from seeds 1 and 2 of this fixed float64
    # checkpoint differ from each other and from the arg-max path; the same seed repeats exactly.
    assert len(a) == len(b) == len(greedy) == 16
    assert a != b and a != greedy and b != greedy
    assert run(1) == a and run(2) == b
    # A seedless request draws its own seed: two of them differ, and neither replays seed 1.
    c, d = run(None), run(None)
    assert c != d and a not in (c, d)


def test_kv_rewind_equals_never_going_ahead(ckpt_grouped):
    model = load_model(ckpt_grouped, torch.float64, device="cpu")
    cfg = model.config
    cache = PagedKVCache(num_layers=cfg.num_hidden_layers, num_kv_heads=cfg.num_key_value_heads,
                         head_dim=cfg.head_dim, num_blocks=32, block_size=4, dtype=torch.float64, device="cpu")

    def run(seq_id: int, tokens: list[int], start: int) -> torch.Tensor:
        cache.reserve(seq_id, start + len(tokens))
        plan = build_plan(cache, [SeqChunk(seq_id, start, len(tokens))])
        with torch.no_grad():
            return model.compute_logits(model(torch.tensor(tokens), plan.positions, PagedAttention(cache, plan)))

    prompt, ahead, then = [3, 1, 4, 1, 5, 9, 2], [6, 5, 3, 5, 8, 9], [7, 9, 3]
    run(0, prompt, 0)
    run(0, ahead, len(prompt))                  # decode ahead by 6 (crosses a block boundary)
    blocks_before = cache.num_free_blocks
    cache.rewind(0, len(prompt) + 1)           # keep one of them
    assert cache.length(0) == len(prompt) + 1
    assert cache.num_free_blocks > blocks_before  # whole blocks past the new end came back
    got = run(0, then, len(prompt) + 1)
    run(1, prompt, 0)
    run(1, ahead[:1], len(prompt))
    want = run(1, then, len(prompt) + 1)
    # Equal up to float64 rounding of differently shaped matmuls; stale rows would differ at 1e-2.
    assert torch.allclose(got, want, rtol=0, atol=1e-12)


def test_kv_cache_accounting():
    cache = PagedKVCache(num_layers=1, num_kv_heads=1, head_dim=2, num_blocks=4, block_size=4, device="cpu")
    assert cache.num_free_tokens() == 16
    assert cache.can_reserve(0, 16) and not cache.can_reserve(0, 17)
    cache.reserve(0, 5)
    assert cache.num_free_tokens() == 8 and cache.length(0) == 5
    assert cache.cells(0, 0, 5).tolist()[:4] == [0, 1, 2, 3]
    cache.rewind(0, 4)
    assert cache.num_free_tokens() == 12
    with pytest.raises(ValueError, match="cannot rewind"):
        cache.rewind(0, 5)
    cache.free(0)
    assert cache.num_free_tokens() == 16


def test_stop_string_and_eos(ckpt_plain):
    llm = LLM(ckpt_plain, dtype="float32", kv_cache_tokens=1024)
    free = llm.generate(["def f(x):"], SamplingParams(max_tokens=30, ignore_eos=True))[0]
    assert free.finish_reason == "length" and len(free.token_ids) == 30
    assert len(free.text) > 2
    stop = free.text[1:3]
    cut = llm.generate(["def f(x):"], SamplingParams(max_tokens=30, ignore_eos=True, stop=[stop]))[0]
    assert cut.finish_reason == "stop"
    assert cut.text == free.text[:free.text.find(stop)]
    eos_tok = free.token_ids[4]  # make the 5th generated token the EOS: generation ends right there
    llm.engine.model_config = type(llm.engine.model_config)(
        **{**{f: getattr(llm.engine.model_config, f) for f in llm.engine.model_config.__dataclass_fields__},
           "eos_token_ids": (eos_tok,)})
    ended = llm.generate(["def f(x):"], SamplingParams(max_tokens=30))[0]
    first = free.token_ids.index(eos_tok)
    assert ended.finish_reason == "stop" and ended.token_ids == free.token_ids[:first + 1]


def test_preemption_loses_nothing(ckpt_plain):
    """A cache too small for every sequence at once: sequences are preempted and recomputed,
    and each still produces exactly the tokens it produces alone."""
    small = LLM(ckpt_plain, dtype="float64", kv_cache_tokens=96, max_num_seqs=8, max_num_batched_tokens=64)
    params = SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.9, seed=3)
    prompts = [[i + 1, i + 2, i + 3, i + 4, i + 5, 7, 8, 9] for i in range(5)]
    outs = small.generate(prompts, params)
    assert small.engine.scheduler.num_preemptions > 0
    roomy = LLM(ckpt_plain, dtype="float64", kv_cache_tokens=4096)
    assert [o.token_ids for o in outs] == [roomy.generate([p], params)[0].token_ids for p in prompts]


@pytest.mark.parametrize("prompt, match", [([], "empty"), ([1, 5000], "5000"), ([-1], "-1"),
                                           (list(range(1, 300)) * 1, "context")])
def test_bad_requests_are_refused_by_name(llm64, prompt, match):
    with pytest.raises(RequestError, match=match):
        llm64.generate([prompt], SamplingParams(max_tokens=4))
    assert not llm64.engine.has_unfinished()  # nothing half-queued after a refusal


@pytest.mark.parametrize("kwargs, match", [(dict(max_tokens=0), "max_tokens"), (dict(temperature=-0.5), "temperature"),
                                           (dict(top_p=0.0), "top_p"), (dict(top_k=-1), "top_k")])
def test_bad_sampling_params(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)
