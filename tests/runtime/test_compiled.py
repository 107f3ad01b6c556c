"""The compiled target step (torch.compile, paged attention and experts opaque) gives the tokens
the eager step gives, and never runs where it must not (float64, --enforce-eager)."""
from __future__ import annotations

from pathlib import Path

import torch

from runtime.sampler import SamplingParams
from serving.llm import LLM

MODEL = Path(__file__).resolve().parents[2] / "models" / "tiny-glm-moe"


def test_compiled_float32_equals_eager_on_the_embedded_model():
    prompts = [[5, 17, 200, 3], [9, 9, 9, 100, 250], [300, 4], [1, 2, 3, 4, 5, 6, 7, 8]]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    eager = LLM(MODEL, dtype="float32", kv_cache_tokens=2048, enforce_eager=True)
    compiled = LLM(MODEL, dtype="float32", kv_cache_tokens=2048, enforce_eager=False)
    assert compiled.engine.runner.compiled and not eager.engine.runner.compiled
    want = [o.token_ids for o in eager.generate(prompts, params)]
    got = [o.token_ids for o in compiled.generate(prompts, params)]
    same = sum(a == b for w, g in zip(want, got) for a, b in zip(w, g))
    assert same == sum(len(w) for w in want)       # every token (the probe record says the same)
    # One prompt at a time (other row counts, the same compiled graph) and MTP on top of it.
    mtp = LLM(MODEL, dtype="float32", kv_cache_tokens=2048, spec="mtp", num_drafts=3, enforce_eager=False)
    assert mtp.engine.runner.compiled
    assert [o.token_ids for o in mtp.generate(prompts[:1], params)] == want[:1]


def test_float64_and_enforce_eager_stay_eager(monkeypatch):
    calls = []
    real = torch.compile
    monkeypatch.setattr(torch, "compile", lambda *a, **k: calls.append(1) or real(*a, **k))
    assert not LLM(MODEL, dtype="float64", kv_cache_tokens=512, enforce_eager=False).engine.runner.compiled
    assert not LLM(MODEL, dtype="float32", kv_cache_tokens=512, enforce_eager=True).engine.runner.compiled
    assert calls == []
