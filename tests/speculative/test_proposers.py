"""Proposers through the engine: an oracle accepts everything, garbage accepts nothing, and
EOS / stop strings / max_tokens inside accepted drafts end the output exactly where plain decoding does."""
from __future__ import annotations

import pytest
import torch

from serving.llm import LLM
from runtime.sample.sampler import SamplingParams
from speculative import DraftProposer, Drafts, ProposeRequest, hidden_fingerprint
from speculative.ngram import NgramProposer
from speculative.proposer import ProposerState

PROMPTS = [[5, 17, 200, 3], [9, 9, 9, 100, 250, 31, 7, 64], [300]]


class ScriptedProposer(DraftProposer):
    """Drafts from a fixed continuation per prompt (the oracle), or constant garbage."""

    def __init__(self, continuations: dict[tuple[int, ...], list[int]] | None, prompt_lens: dict) -> None:
        self.continuations = continuations
        self.prompt_lens = prompt_lens

    def propose(self, req: ProposeRequest) -> Drafts:
        toks = list(req.token_ids)
        if self.continuations is None:
            return Drafts([1] * req.num_drafts, [1.0] * req.num_drafts)
        for prompt, cont in self.continuations.items():
            if tuple(toks[:len(prompt)]) == prompt:
                done = len(toks) - len(prompt)
                d = cont[done:done + req.num_drafts]
                return Drafts(d, [1.0] * len(d))
        return Drafts([], [])


def with_proposer(path, proposer, k):
    llm = LLM(path, dtype="float64", kv_cache_tokens=4096, spec="ngram", num_drafts=k, draft_policy="fixed")
    llm.engine.proposer = proposer
    return llm


@pytest.mark.parametrize("k", [1, 2, 4])
def test_oracle_accepts_everything_and_garbage_nothing(ckpt_plain, k):
    params = SamplingParams(max_tokens=31, ignore_eos=True)  # 1 + 30: whole verifies of K+1 for K in 1, 2, 4
    plain = LLM(ckpt_plain, dtype="float64").generate(PROMPTS, params)
    oracle = with_proposer(ckpt_plain, ScriptedProposer({tuple(p): o.token_ids for p, o in zip(PROMPTS, plain)}, {}), k)
    outs = oracle.generate(PROMPTS, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    m = oracle.engine.metrics
    assert m.accepted_tokens == m.drafted_tokens > 0
    # Every verify drafts K tokens and accepts all of them: acceptance 1.0, accept_len K + 1.
    assert m.summary()["p1"] == 1.0
    assert m.drafted_tokens == k * m.verifies
    assert m.summary()["accept_len"] == k + 1
    garbage = with_proposer(ckpt_plain, ScriptedProposer(None, {}), k)
    outs = garbage.generate(PROMPTS, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    g = garbage.engine.metrics
    assert g.accepted_tokens == 0 and g.summary()["accept_len"] == 1.0


def test_eos_stop_and_max_tokens_inside_accepted_drafts(ckpt_plain):
    free = LLM(ckpt_plain, dtype="float64").generate(PROMPTS[:1], SamplingParams(max_tokens=20, ignore_eos=True))[0]
    oracle = {tuple(PROMPTS[0]): free.token_ids}
    # max_tokens in the middle of a run of accepted drafts: never exceeded.
    for n in (1, 5, 7):
        llm = with_proposer(ckpt_plain, ScriptedProposer(oracle, {}), 4)
        out = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=n, ignore_eos=True))[0]
        assert out.token_ids == free.token_ids[:n] and out.finish_reason == "length"
    # An EOS among accepted drafts ends the output there.
    eos = free.token_ids[6]
    first = free.token_ids.index(eos)
    llm = with_proposer(ckpt_plain, ScriptedProposer(oracle, {}), 4)
    cfg = llm.engine.model_config
    llm.engine.model_config = type(cfg)(**{**{f: getattr(cfg, f) for f in cfg.__dataclass_fields__},
                                           "eos_token_ids": (eos,)})
    out = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=20))[0]
    assert out.token_ids == free.token_ids[:first + 1] and out.finish_reason == "stop"
    # A stop string completed inside accepted drafts.
    text = free.text
    stop = text[len(text) // 2:len(text) // 2 + 2]
    llm = with_proposer(ckpt_plain, ScriptedProposer(oracle, {}), 4)
    out = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=20, ignore_eos=True, stop=[stop]))[0]
    assert out.finish_reason == "stop" and out.text == text[:text.find(stop)]


def test_ngram_lookup_exact_values():
    ng = NgramProposer(max_ngram=2)
    st = ProposerState(seq_id=0)
    assert ng.propose(ProposeRequest(st, [1, 2, 3, 9, 1, 2], 3)).tokens == [3, 9, 1]
    assert ng.propose(ProposeRequest(st, [1, 2, 3, 4], 2)).tokens == []
    assert ng.propose(ProposeRequest(st, [7, 5, 7], 2)).tokens == [5, 7]   # falls back to a 1-gram


def test_hidden_fingerprint_is_fnv1a_over_bf16_bytes():
    row = torch.tensor([1.0, -2.0], dtype=torch.float32)
    # bf16: 1.0 = 0x3F80, -2.0 = 0xC000 -> little-endian bytes 80 3F 00 C0
    h = 0xCBF29CE484222325
    for byte in bytes([0x80, 0x3F, 0x00, 0xC0]):
        h = ((h ^ byte) * 0x100000001B3) & ((1 << 64) - 1)
    assert hidden_fingerprint(row) == h
    assert hidden_fingerprint(row.double()) == h
    assert hidden_fingerprint("not a tensor") == 0
