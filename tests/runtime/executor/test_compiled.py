"""The compiled target step (torch.compile, paged attention and experts opaque) gives the tokens
the eager step gives, compiles its graphs before serving, and never runs where it must not (float64,
--enforce-eager)."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from torch._dynamo.utils import counters

from runtime.sample.sampler import SamplingParams
from serving.llm import LLM
from tests.conftest import engine_on

MODEL = Path(__file__).resolve().parents[3] / "models" / "tiny-glm-moe"


def test_compiled_float32_equals_eager_on_the_embedded_model():
    """Compiled and eager greedy tokens agree; the step compiles when the LLM is built (the
    target's one-row and several-row graphs, and with MTP the drafter's), so serving compiles
    nothing more, one-row steps (a verify with no drafts) included."""
    prompts = [[5, 17, 200, 3], [9, 9, 9, 100, 250], [300, 4], [1, 2, 3, 4, 5, 6, 7, 8]]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    eager = LLM(MODEL, dtype="float32", kv_cache_tokens=2048, enforce_eager=True)
    assert not eager.engine.runner.compiled
    want = [o.token_ids for o in eager.generate(prompts, params)]
    mtp = LLM(MODEL, dtype="float32", kv_cache_tokens=2048, spec="mtp", num_drafts=3, enforce_eager=False)
    assert mtp.engine.runner.compiled and mtp.engine.proposer.compiles
    graphs = counters["stats"]["unique_graphs"]
    mtp.deployment.warm_up()   # as the server does before it listens (else the first step does)
    # Seven steps, nine graphs: the target's steps each with the graph of their logits rows, and
    # one sequence's three drafts as one chained graph after a feed of several rows or one.
    assert counters["stats"]["unique_graphs"] == graphs + 9
    assert ("7 steps (target 2 rows, target 1 row, drafter 2 rows, drafter 1 row, drafter 2 rows of 2 sequences, "
            "drafter chain 3 drafts after 2 rows, drafter chain 3 drafts after 1 row), 9 graphs"
            in mtp.deployment.compile_report)
    assert mtp.engine.proposer._chain_shapes == {(3, 1)}
    cache = mtp.engine.runner.cache
    assert cache.num_free_blocks == cache.num_blocks         # the warm-up's rows are given back
    graphs = counters["stats"]["unique_graphs"]
    # The compiled target without speculation (an engine without a drafter on the same runner).
    speculating, mtp.engine = mtp.engine, engine_on(mtp)
    got = [o.token_ids for o in mtp.generate(prompts, params)]
    mtp.engine = speculating
    same = sum(a == b for w, g in zip(want, got) for a, b in zip(w, g))
    assert same == sum(len(w) for w in want)       # every token (the probe record says the same)
    # One prompt at a time (other row counts, the same compiled graph) and MTP on top of it.
    assert [o.token_ids for o in mtp.generate(prompts[:1], params)] == want[:1]
    # Several sequences at once, and one-row steps: a verify that drafts nothing (the last
    # token of a request has no room for drafts).
    runner, rows = mtp.engine.runner, []
    forward = runner.forward
    runner.forward = lambda tokens, chunks: rows.append(len(tokens)) or forward(tokens, chunks)
    mtp.generate(prompts, SamplingParams(max_tokens=5, ignore_eos=True))
    mtp.generate(prompts[:1], SamplingParams(max_tokens=2, ignore_eos=True))
    assert 1 in rows and max(rows) > 4
    assert counters["stats"]["unique_graphs"] == graphs
    # Warm, the steps skip Dynamo (runtime.executor.compiled.CompiledStep), the target's and the drafter's.
    proposer = mtp.engine.proposer
    assert runner.mode.fn.direct_calls > 0 and proposer.mode.fn.direct_calls > 0
    assert proposer._compiled_chain.direct_calls > 0
    # One sequence's drafts chained in one graph are the drafts of the separate steps, bit for bit
    # in float32 (probabilities too), and so are the tokens.
    runs: dict[bool, tuple] = {}
    draft = proposer.draft
    for chained in (True, False):
        proposer._chain_shapes = {(3, 1)} if chained else set()
        calls: list = []
        chains = proposer._compiled_chain.direct_calls
        def record(*a, _calls=calls, **k):
            out = draft(*a, **k)
            _calls.append([(d.tokens, d.probs) for d in out])
            return out
        proposer.draft = record
        tokens = [mtp.generate([p], params)[0].token_ids for p in prompts[:2]]   # one sequence at a time
        proposer.draft = draft
        runs[chained] = (tokens, calls, proposer._compiled_chain.direct_calls - chains)
    assert runs[True][:2] == runs[False][:2] and len(runs[True][1]) > 5
    assert runs[True][0] == want[:2]
    assert runs[True][2] > 5 and runs[False][2] == 0      # chained, and not
    proposer._chain_shapes = {(3, 1)}
    # The compiled drafter drafts what the eager one drafts, up to rounding: on held-out code its
    # acceptance stays within a few percent of an eager float32 engine's.
    held = [mtp.encode(json.loads(line)["prompt"]) for line in (MODEL / "heldout_prompts.jsonl").read_text().splitlines()[:3]]
    accept = {}
    for name, llm in (("compiled", mtp), ("eager", LLM(MODEL, dtype="float32", kv_cache_tokens=2048, spec="mtp",
                                                        num_drafts=3, enforce_eager=True))):
        llm.engine.metrics = type(llm.engine.metrics)()
        llm.generate(held, SamplingParams(max_tokens=48, ignore_eos=True))
        accept[name] = llm.engine.metrics.summary()["accept_len"]
    assert accept["compiled"] >= 0.95 * accept["eager"] and accept["eager"] > 1.5, accept
    assert counters["stats"]["unique_graphs"] == graphs


def test_float64_and_enforce_eager_stay_eager(monkeypatch):
    calls = []
    real = torch.compile
    monkeypatch.setattr(torch, "compile", lambda *a, **k: calls.append(1) or real(*a, **k))
    assert not LLM(MODEL, dtype="float64", kv_cache_tokens=512, enforce_eager=False).engine.runner.compiled
    assert not LLM(MODEL, dtype="float32", kv_cache_tokens=512, enforce_eager=True).engine.runner.compiled
    assert calls == []


def test_a_compiled_draft_tree_chains_its_spine_and_hedges():
    """With a tree shape the compiled drafter chains one sequence's spine in one graph and takes
    each depth's hedges from the graph's top tokens: float32 drafts, probabilities and hedges bit
    for bit as the separate steps give them, and the same tokens."""
    prompts = [[5, 17, 200, 3], [300, 4]]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    llm = LLM(MODEL, dtype="float32", kv_cache_tokens=2048, spec="mtp", num_drafts=3, tree_shape="1,2,2",
              enforce_eager=False)
    llm.deployment.warm_up()
    assert "drafter chain tree of 3 depths after 2 rows" in llm.deployment.compile_report
    proposer = llm.engine.proposer
    assert proposer._chain_shapes == {(3, 2)}
    draft = proposer.draft
    runs = {}
    for chained in (True, False):
        proposer._chain_shapes = {(3, 2)} if chained else set()
        calls: list = []

        def record(*a, _calls=calls, **k):
            out = draft(*a, **k)
            _calls.append([(d.tokens, d.probs, d.hedges) for d in out])
            return out
        proposer.draft = record
        chains = proposer._compiled_chain.direct_calls
        tokens = [llm.generate([p], params)[0].token_ids for p in prompts]
        proposer.draft = draft
        runs[chained] = (tokens, calls, proposer._compiled_chain.direct_calls - chains)
    assert runs[True][:2] == runs[False][:2]
    assert runs[True][2] > 3 and runs[False][2] == 0
    # One hedge at each of depths 2 and 3 of the 1,2,2 tree, at every propose of three drafts.
    full = [h for call in runs[True][1] for tokens, _, h in call if len(tokens) == 3]
    assert len(full) > 3 and all(sorted(d for d, _ in h) == [2, 3] for h in full)
