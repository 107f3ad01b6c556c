"""Qwen3.5 / Qwen3.6-MoE (Gated DeltaNet linear attention beside gated full attention) against
transformers' own implementation, on small random checkpoints it wrote in both layouts (text only,
and multimodal with a vision tower): 3 linear-attention layers and 1 full-attention layer."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from runtime.ops.batch_invariant import set_batch_invariant
from runtime.executor.attention import PagedAttention, SeqChunk, build_plan
from runtime.model.config import load_config
from runtime.executor import runner as runner_module
from runtime.executor.kv_cache import NO_LAYER_STATES, PagedKVCache
from runtime.executor.runner import ModelRunner
from runtime.executor.settings import StepSettings
from runtime.model.linear_attention import RecurrentStates, chunked_delta_rule, recurrent_delta_rule
from runtime.sample.sampler import SamplingParams
from runtime.model.weights import load_model
from runtime.platform import device as rdevice
from serving.llm import LLM
from speculative import Drafts
from tests.speculative.test_proposers import ScriptedProposer
from tests.runtime.model.test_oracle import TOLERANCE, reference, reference_logits_stepwise

pytest.importorskip("transformers.models.qwen3_5_moe", reason="transformers without Qwen3.5-MoE (before 5.2x)")

LAYOUTS = ["qwen35_text", "qwen35_vl"]
IDS = torch.randint(0, 320, (20,), generator=torch.Generator().manual_seed(3)).tolist()


def _in_input_dtype(module):
    """transformers' function `name` of the Qwen3.5 module, run with float32 meaning the input's
    dtype (its float32 islands: the delta rules), so a float64 reference stays float64."""
    import types
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as q

    class Torch64:
        float32 = torch.float64
        float = torch.float64

        def __getattr__(self, name):
            return getattr(torch, name)

    scope = {**q.__dict__, "torch": Torch64()}

    def inner(fn, name, depth=0):
        """The function called `name` inside the closures of a kernel-hub wrapper `fn`."""
        if isinstance(fn, types.FunctionType) and fn.__name__ == name and fn.__code__.co_filename == q.__file__:
            return fn
        if isinstance(fn, torch.nn.Module):
            fn = type(fn).forward
        for cell in getattr(fn, "__closure__", None) or () if depth < 4 else ():
            found = inner(cell.cell_contents, name, depth + 1)
            if found is not None:
                return found
        return None

    def copy(fn):
        fn = inner(fn, module)
        return types.FunctionType(fn.__code__, scope, fn.__name__, fn.__defaults__, fn.__closure__)
    return copy(getattr(q, module))


@pytest.fixture
def qwen35_float64(monkeypatch):
    """The reference's float32 islands (norms, gated norm, router, delta rules) in float64."""
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as q

    def norm(self, x):
        h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return h * (1.0 + self.weight)

    def gated_norm(self, x, gate):
        h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * h * torch.nn.functional.silu(gate)

    def router(self, x):
        x = x.reshape(-1, self.hidden_dim)
        logits = torch.nn.functional.linear(x, self.weight.to(x.dtype))
        weights, idx = torch.softmax(logits, dim=-1).topk(self.top_k, dim=-1)
        return logits, weights / weights.sum(dim=-1, keepdim=True), idx

    monkeypatch.setattr(q.Qwen3_5MoeRMSNorm, "forward", norm)
    monkeypatch.setattr(q.Qwen3_5MoeRMSNormGated, "forward", gated_norm)
    monkeypatch.setattr(q.Qwen3_5MoeTopKRouter, "forward", router)
    for name in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"):
        monkeypatch.setattr(q, name, _in_input_dtype(name))


def ours_stepwise(model, steps: list[list[tuple[int, list[int]]]]) -> list[torch.Tensor]:
    """Run `steps` (each a list of (seq_id, tokens) chunks continuing those sequences) -> each
    step's logits [rows, V]; a fresh cache and state pool."""
    cfg = model.config
    cache = PagedKVCache(num_layers=cfg.num_attention_layers, num_blocks=64, block_size=4, dtype=model.dtype,
                         device=model.device, **model.cache_layout())
    cache.states = RecurrentStates(cfg, dtype=model.dtype, device=model.device)
    out = []
    with torch.no_grad():
        for step in steps:
            chunks = []
            for seq_id, toks in step:
                start = cache.length(seq_id)
                cache.reserve(seq_id, start + len(toks))
                chunks.append(SeqChunk(seq_id, start, len(toks)))
            plan = build_plan(cache, chunks, batch_invariant=model.dtype == torch.float64)
            paged = PagedAttention(cache, plan)
            paged.states = cache.states.step(chunks)
            tokens = torch.tensor([t for _, toks in step for t in toks])
            out.append(model.compute_logits(model(tokens, plan.positions, paged)))
    return out


def test_config_reads_both_layouts(family_ckpt):
    text, vl = load_config(family_ckpt("qwen35_text")), load_config(family_ckpt("qwen35_vl"))
    assert text.architecture == "Qwen3_5MoeForCausalLM"
    assert vl.architecture == "Qwen3_5MoeForConditionalGeneration"
    for cfg in (text, vl):
        assert cfg.layer_types == ("linear_attention",) * 3 + ("full_attention",)
        assert cfg.num_attention_layers == 1 and cfg.linear_layers == (0, 1, 2)
        assert cfg.rotary_dim == 4 and cfg.shared_expert_gate and cfg.norm_unit_offset


def test_vision_tower_skipped_with_one_line(family_ckpt, caplog):
    with caplog.at_level("INFO", logger="metrale.weights"):
        model = load_model(family_ckpt("qwen35_vl"), "float32", device="cpu")
    lines = [r.getMessage() for r in caplog.records if "vision tower" in r.getMessage()]
    assert len(lines) == 1 and "model.visual." in lines[0]
    assert not any("visual" in n for n, _ in model.named_parameters())


def test_delta_rule_chunked_equals_recurrent():
    g = torch.Generator().manual_seed(0)
    n, nv, dk, dv = 70, 2, 8, 6   # more than one block of CHUNK rows
    q, k = (torch.nn.functional.normalize(torch.randn(n, nv, dk, generator=g, dtype=torch.float64), dim=-1)
            for _ in range(2))
    v = torch.randn(n, nv, dv, generator=g, dtype=torch.float64)
    decay = -torch.rand(n, nv, generator=g, dtype=torch.float64)
    beta = torch.rand(n, nv, generator=g, dtype=torch.float64)
    s0 = torch.randn(nv, dk, dv, generator=g, dtype=torch.float64)
    a, sa = chunked_delta_rule(q, k, v, decay, beta, s0)
    b, sb = recurrent_delta_rule(q, k, v, decay, beta, s0)
    assert (a - b).abs().max() < 1e-12 and (sa - sb).abs().max() < 1e-12


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_logits_match_transformers_prefill_and_decode(request, family_ckpt, layout, dtype):
    if dtype == torch.float64:
        request.getfixturevalue("qwen35_float64")
    path = family_ckpt(layout)
    ref, ours = reference(path, dtype), load_model(path, dtype, device="cpu")
    for prefill in (20, 7):
        expected = reference_logits_stepwise(ref, IDS, prefill)
        assert expected.abs().max() > 0.1
        steps = [[(0, IDS[:prefill])]] + [[(0, [t])] for t in IDS[prefill:]]
        got = torch.cat(ours_stepwise(ours, steps))
        assert got.dtype == dtype
        assert (got - expected).abs().max().item() < TOLERANCE[dtype], f"prefill={prefill}"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_greedy_continuations_identical_in_float64(family_ckpt, layout, qwen35_float64):
    path = family_ckpt(layout)
    ref = reference(path, torch.float64)
    prompts = [[5, 17, 200, 3], [9, 9, 9, 100, 250, 31, 7, 64]]
    outs = LLM(path, dtype="float64", kv_cache_tokens=512).generate(prompts, SamplingParams(max_tokens=10,
                                                                                           ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        ids = list(prompt)
        with torch.no_grad():   # transformers' full forward over everything so far, token by token
            for _ in range(10):
                ids.append(int(ref(torch.tensor([ids])).logits[0, -1].argmax()))
        assert out.token_ids == ids[len(prompt):]


def test_batch_equals_each_sequence_alone(family_ckpt):
    """Sequences prefilled and decoded together give the logits each gives alone, exactly (float64)."""
    model = load_model(family_ckpt("qwen35_text"), torch.float64, device="cpu")
    set_batch_invariant(model, True)   # as the runner sets it for float64
    a, b = IDS[:9], IDS[9:15]
    together = ours_stepwise(model, [[(0, a), (1, b)], [(0, [7]), (1, [11])], [(0, [3]), (1, [4])]])
    alone_a = ours_stepwise(model, [[(0, a)], [(0, [7])], [(0, [3])]])
    alone_b = ours_stepwise(model, [[(1, b)], [(1, [11])], [(1, [4])]])
    assert torch.equal(together[0], torch.cat((alone_a[0], alone_b[0])))
    for step in (1, 2):
        assert torch.equal(together[step], torch.cat((alone_a[step], alone_b[step])))


def test_preemption_equals_roomy(family_ckpt):
    """A cache too small for every sequence at once preempts (frees the state with the blocks and
    recomputes it from the tokens) and gives the same greedy tokens as a roomy one."""
    path = family_ckpt("qwen35_text")
    prompts = [[5, 17, 200, 3, 8, 8, 1], [9, 9, 9, 100, 250, 31, 7, 64], [300, 2, 5], [1, 2, 3, 4, 5, 6]]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    roomy = LLM(path, dtype="float64", kv_cache_tokens=512).generate(prompts, params)
    tight_llm = LLM(path, dtype="float64", kv_cache_tokens=48)
    tight = tight_llm.generate(prompts, params)
    assert [o.token_ids for o in tight] == [o.token_ids for o in roomy]
    assert tight_llm.engine.scheduler.num_preemptions > 0


def test_prefix_cache_refused_in_one_line(family_ckpt, caplog):
    with caplog.at_level("INFO", logger="metrale.engine"):
        llm = LLM(family_ckpt("qwen35_text"), dtype="float32", kv_cache_tokens=256)
    lines = [r.getMessage() for r in caplog.records if "prefix caching is off" in r.getMessage()]
    assert len(lines) == 1 and "bytes per sequence" in lines[0]
    assert llm.engine.scheduler.prefix is None
    prompt = [5, 17, 200, 3, 8, 8, 1, 2, 9, 9, 9, 100, 250, 31, 7, 64, 1, 2]   # past a block: nothing attached
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    first, again = llm.generate([prompt], params), llm.generate([prompt], params)
    assert first[0].token_ids == again[0].token_ids and again[0].cached_tokens == 0


def test_state_freed_with_the_sequence(family_ckpt):
    llm = LLM(family_ckpt("qwen35_text"), dtype="float32", kv_cache_tokens=256)
    llm.generate([[5, 17, 200, 3], [9, 9]], SamplingParams(max_tokens=4, ignore_eos=True))
    states = llm.engine.runner.states
    assert states is not None and states.bytes_per_sequence > 0
    assert not states.conv and not states.rec and not states.lengths


def test_layers_are_what_transformers_builds(family_ckpt):
    path = family_ckpt("qwen35_vl")
    raw = json.loads((path / "config.json").read_text())
    assert raw["architectures"] == ["Qwen3_5MoeForConditionalGeneration"]
    ref, ours = reference(path, torch.float32), load_model(path, "float32", device="cpu")
    for theirs, mine in zip(ref.model.layers, ours.layers, strict=True):
        assert hasattr(theirs, "linear_attn") == hasattr(mine, "linear_attn")
        assert hasattr(theirs, "self_attn") == hasattr(mine, "self_attn")
    assert ours.mtp is not None and hasattr(ours.mtp.block, "self_attn")   # mtp.layers.0: full attention


SPEC_PROMPTS = [[5, 17, 200, 3, 5, 17, 200, 3, 5], [41, 42, 41, 42, 41, 42], [9, 9, 9, 100, 250, 31, 7, 64],
                [300]]
SPEC_PARAMS = {"greedy": SamplingParams(max_tokens=16, ignore_eos=True),
               "seeded": SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.5, seed=7)}


class PartlyRightProposer(ScriptedProposer):
    """The true continuation with one draft changed (at a place that moves along the output), so
    verifies accept 0..K-1 drafts and the state goes back to rows inside the verified chunk."""

    def propose(self, req):
        drafts = super().propose(req)
        toks = list(drafts.tokens)
        if toks:
            at = len(req.token_ids) % len(toks)
            toks[at] = (toks[at] + 1) % 320
        return Drafts(toks, list(drafts.probs))


@pytest.mark.parametrize("name", list(SPEC_PARAMS))
@pytest.mark.parametrize("spec, layout", [("ngram", "qwen35_text"), ("mtp", "qwen35_vl")])
def test_speculation_lossless(family_ckpt, spec, layout, name):
    """n-gram and MTP (`mtp.*`) chains over the recurrent state: the same tokens as without
    speculation (float64, greedy and seeded, width 4 and width 1)."""
    path, params = family_ckpt(layout), SPEC_PARAMS[name]
    want = [o.token_ids for o in LLM(path, dtype="float64", kv_cache_tokens=1024).generate(SPEC_PROMPTS, params)]
    llm = LLM(path, dtype="float64", kv_cache_tokens=1024, spec=spec, num_drafts=3)
    assert [o.token_ids for o in llm.generate(SPEC_PROMPTS, params)] == want               # width 4
    assert [llm.generate([p], params)[0].token_ids for p in SPEC_PROMPTS] == want          # width 1
    m = llm.engine.metrics
    assert m.verifies > 0 and m.drafted_tokens > 0 and m.accepted_tokens < m.drafted_tokens


class HedgingProposer(ScriptedProposer):
    """A tree of the true continuation whose spine is wrong at one depth (moving along the
    output) with the true token as that depth's first hedge, garbage in the other hedges: verifies
    take hedges, accept spine prefixes, and reject."""

    def propose(self, req):
        truth = super().propose(req)
        spine = list(truth.tokens)
        if not spine or not req.tree:
            return truth
        wrong = len(req.token_ids) % (len(spine) + 1)    # 0-based depth; len(spine): none wrong
        hedges = []
        for d in range(1, len(spine) + 1):
            for i in range(req.tree[d - 1] - 1):
                right = d - 1 == wrong and i == 0
                hedges.append((d, truth.tokens[d - 1] if right else (truth.tokens[d - 1] + 2 + i) % 320))
        if wrong < len(spine) and req.tree[wrong] > 1:
            spine[wrong] = (spine[wrong] + 1) % 320
        return Drafts(spine, list(truth.probs), hedges)


@pytest.mark.parametrize("name", list(SPEC_PARAMS))
def test_tree_speculation_lossless(family_ckpt, name):
    """Draft trees over the recurrent state (float64, greedy and seeded, width 4 and width 1): the
    `mtp.*` drafter's trees, and scripted trees that take hedges, give plain decoding's tokens."""
    path, params = family_ckpt("qwen35_vl"), dataclasses.replace(SPEC_PARAMS[name], max_tokens=10)
    want = [o.token_ids for o in LLM(path, dtype="float64", kv_cache_tokens=1024).generate(SPEC_PROMPTS, params)]
    tree = dict(dtype="float64", kv_cache_tokens=1024, spec="mtp", num_drafts=3, tree_shape="1,2,2",
                draft_policy="fixed")
    llm = LLM(path, **tree)
    assert [o.token_ids for o in llm.generate(SPEC_PROMPTS, params)] == want               # width 4
    assert [llm.generate([p], params)[0].token_ids for p in SPEC_PROMPTS[:2]] == want[:2]  # width 1
    assert llm.engine.metrics.verifies > 0
    scripted = LLM(path, **tree)
    scripted.engine.proposer = HedgingProposer({tuple(p): w for p, w in zip(SPEC_PROMPTS, want)}, {})
    assert [o.token_ids for o in scripted.generate(SPEC_PROMPTS, params)] == want          # width 4
    assert [scripted.generate([p], params)[0].token_ids for p in SPEC_PROMPTS[:2]] == want[:2]  # width 1
    m = scripted.engine.metrics
    assert m.hedges_taken > 0 and 0 < m.accepted_tokens < m.drafted_tokens


@pytest.mark.parametrize("width", [1, 4])
def test_verify_keeps_the_state_at_the_accepted_row(family_ckpt, width):
    """Drafts right up to a wrong one: each verify accepts some rows and rejects the rest, the
    state is the snapshot after the last accepted row, and the tokens are plain decoding's."""
    path = family_ckpt("qwen35_text")
    params = SamplingParams(max_tokens=11, ignore_eos=True)
    prompts = SPEC_PROMPTS[:width]
    plain = LLM(path, dtype="float64", kv_cache_tokens=1024).generate(prompts, params)
    script = PartlyRightProposer({tuple(p): o.token_ids for p, o in zip(prompts, plain)}, {})
    llm = LLM(path, dtype="float64", kv_cache_tokens=1024, spec="ngram", num_drafts=4, draft_policy="fixed")
    llm.engine.proposer = script
    assert [o.token_ids for o in llm.generate(prompts, params)] == [o.token_ids for o in plain]
    m = llm.engine.metrics
    assert 0 < m.accepted_tokens < m.drafted_tokens


def test_fp8_checkpoint_gives_the_dequantized_models_logits(family_ckpt, tmp_path):
    """The multimodal layout stored as the FP8 releases are (vision tower included, skipped)."""
    from tests.runtime.model.test_fp8 import _fp8_pair
    fp8, deq = _fp8_pair(family_ckpt("qwen35_vl"), tmp_path)
    a, b = load_model(fp8, "float32", device="cpu"), load_model(deq, "float32", device="cpu")
    assert a.weight_format.startswith("fp8 blocks")
    for (na, ta), (nb, tb) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert na == nb and torch.equal(ta, tb), na
    steps = [[(0, IDS[:8])]] + [[(0, [t])] for t in IDS[8:12]]
    got, want = torch.cat(ours_stepwise(a, steps)), torch.cat(ours_stepwise(b, steps))
    assert want.abs().max() > 0.1 and (got - want).abs().max().item() < 1e-5


TREE_PARENTS = (-1, 0, 1, 2, 1, 2)   # shape 1,2,2 at depth 3: root, spine s1 s2 s3, hedges h2 (under s1), h3 (under s2)
# Accepted paths (rows after the root) and the move a taken hedge makes (row -> its depth's row).
TREE_PATHS = {(): None, (1,): None, (1, 2): None, (1, 2, 3): None, (1, 4): (4, 2), (1, 2, 5): (5, 3)}


def _run_step(model, cache, seq_id: int, toks: list[int], parents=None) -> torch.Tensor:
    start = cache.length(seq_id)
    cache.reserve(seq_id, start + len(toks))
    chunk = SeqChunk(seq_id, start, len(toks), parents)
    plan = build_plan(cache, [chunk], batch_invariant=True)
    paged = PagedAttention(cache, plan)
    paged.states = cache.states.step([chunk])
    with torch.no_grad():
        return model.compute_logits(model(torch.tensor(toks), plan.positions, paged))


def _fresh_cache(model) -> PagedKVCache:
    cfg = model.config
    cache = PagedKVCache(num_layers=cfg.num_attention_layers, num_blocks=64, block_size=4, dtype=model.dtype,
                         device=model.device, **model.cache_layout())
    cache.states = RecurrentStates(cfg, dtype=model.dtype, device=model.device)
    return cache


@pytest.mark.parametrize("path", list(TREE_PATHS), ids=lambda p: "root" + "".join(f"-{r}" for r in p))
def test_tree_rows_follow_their_ancestors_and_the_path_keeps_its_state(family_ckpt, path):
    """A verify of a draft tree: each row's logits are those of decoding its ancestors' tokens one
    by one (its state follows its own ancestors, not the rows before it), and after the accepted
    path's move and rewind the states equal those of decoding the path's tokens one by one."""
    model = load_model(family_ckpt("qwen35_text"), "float64", device="cpu")
    set_batch_invariant(model, True)
    prompt, tree = IDS[:9], [IDS[9], 11, 12, 13, 14, 15]
    cache = _fresh_cache(model)
    _run_step(model, cache, 0, prompt)
    rows = _run_step(model, cache, 0, tree, TREE_PARENTS)
    for r in range(len(tree)):   # row r against its ancestors decoded one by one
        line, at = [], r
        while at >= 0:
            line.insert(0, tree[at])
            at = TREE_PARENTS[at]
        ref = _fresh_cache(model)
        _run_step(model, ref, 0, prompt)
        for tok in line:
            want = _run_step(model, ref, 0, [tok])
        assert (rows[r] - want[0]).abs().max().item() < 1e-9, r
    start, move = len(prompt), TREE_PATHS[path]
    if move is not None:
        cache.move(0, start + move[0], start + move[1])
    cache.rewind(0, start + 1 + len(path))
    ref = _fresh_cache(model)
    _run_step(model, ref, 0, prompt)
    for tok in [tree[0]] + [tree[r] for r in path]:
        _run_step(model, ref, 0, [tok])
    assert cache.states.length(0) == ref.states.length(0) == start + 1 + len(path)
    for a, b in ((cache.states.conv[0], ref.states.conv[0]), (cache.states.rec[0], ref.states.rec[0])):
        assert b.abs().max() > 0 and (a - b).abs().max().item() < 1e-12
    nxt = 77   # and the next step goes on from there as plain decoding does
    assert (_run_step(model, cache, 0, [nxt]) - _run_step(model, ref, 0, [nxt])).abs().max().item() < 1e-9


def test_mtp_is_fed_the_normed_hiddens_as_vllm_runs_qwen35_mtp(family_ckpt):
    """The `mtp.*` drafter's logits equal a reference written from vLLM's Qwen3-Next / Qwen3.5 MTP
    (`Qwen3NextMultiTokenPredictor.forward`): fc(concat(pre_fc_norm_embedding(embed(token)),
    pre_fc_norm_hidden(h))), the decoder layer, `mtp.norm`, the head; h is the target's hidden after
    its final norm, then the previous step's after `mtp.norm`. The norms' weights are made
    non-zero here (the random checkpoint's (1 + w) norms are unit, where pre-norm and normed
    hiddens give the same drafts), and the pre-norm reading is checked to differ."""
    llm = LLM(family_ckpt("qwen35_vl"), dtype="float64", kv_cache_tokens=1024, spec="mtp", num_drafts=2,
              draft_policy="fixed")
    model, g = llm.model, torch.Generator().manual_seed(11)
    with torch.no_grad():
        for norm in (model.norm, model.mtp.shared_head.norm):
            norm.weight.copy_(torch.randn(norm.weight.shape, generator=g, dtype=norm.weight.dtype) * 0.5)
    seen = []
    drafter_logits = model.mtp.logits
    model.mtp.logits = lambda h: seen.append(drafter_logits(h)) or seen[-1]
    prompt = IDS[:9]
    first = llm.generate([prompt], SamplingParams(max_tokens=6, ignore_eos=True))[0].token_ids[0]
    assert len(seen) >= 2

    cfg, mtp = model.config, model.mtp
    cache = PagedKVCache(num_layers=cfg.num_cache_layers, num_blocks=16, block_size=4, dtype=model.dtype,
                         device=model.device, **model.cache_layout())
    cache.states = RecurrentStates(cfg, dtype=model.dtype, device=model.device)

    def step(toks, start, run):
        cache.reserve(0, start + len(toks))
        chunk = SeqChunk(0, start, len(toks))
        plan = build_plan(cache, [chunk], batch_invariant=True)
        paged = PagedAttention(cache, plan)
        paged.states = cache.states.step([chunk])
        with torch.no_grad():
            return run(paged, plan.positions)

    target = step(prompt, 0, lambda paged, pos: model(torch.tensor(prompt), pos, paged))          # [n, H] pre-norm
    n, tokens = len(prompt), torch.tensor(prompt[1:] + [first])

    def drafts(hidden_norm, out_norm):
        def layer(toks, hidden, paged, pos):
            x = mtp.eh_proj(torch.cat((mtp.enorm(model.embed_tokens(toks)), mtp.hnorm(hidden)), dim=-1))
            return mtp.block(x, model.rotary(pos, x.dtype), paged, None)
        cache.rewind(0, n)
        out = step(list(tokens), 0, lambda paged, pos: layer(tokens, hidden_norm(target), paged, pos))
        with torch.no_grad():
            first_logits = model.lm_head(mtp.shared_head.norm(out[-1:]))
            d1 = first_logits.argmax(-1)
        out2 = step([int(d1)], n, lambda paged, pos: layer(d1, out_norm(out[-1:]), paged, pos))
        with torch.no_grad():
            return first_logits, model.lm_head(mtp.shared_head.norm(out2))

    with torch.no_grad():
        want = drafts(model.norm, mtp.shared_head.norm)                         # vLLM's reading
        prenorm = drafts(lambda h: h, lambda h: h)                              # the pre-norm reading
    for got, ref, other in zip(seen[:2], want, prenorm):
        assert (got - ref).abs().max().item() < 1e-9
        assert (other - ref).abs().max().item() > 1e-3


def _state_bytes(states: RecurrentStates, seq_id: int) -> int:
    """Bytes the states of `seq_id` hold now: its conv and recurrent state and its last step's snapshots."""
    held = [states.conv[seq_id], states.rec[seq_id]]
    for window, _, every in states.snapshots.get(seq_id, (0, {}, {}))[1].values():
        held += [window, *every]
    return sum(t.numel() * t.element_size() for t in held)


@pytest.mark.parametrize("tree", [False, True])
def test_memory_sizing_leaves_the_running_sequences_states_room(family_ckpt, monkeypatch, tree):
    """A cache sized from free GPU memory leaves room for the layer states: `bytes_reserved` bounds
    what a sequence's states and a verify step's snapshots hold (a chain of 4 rows, a tree of 5),
    the runner hands it to the sizing for the deployment's sequence limit and rows a step, and
    the sizing takes it off the budget (and says so when nothing is left)."""
    model = load_model(family_ckpt("qwen35_text"), "float32", device="cpu")
    cache = _fresh_cache(model)
    _run_step(model, cache, 0, [5, 6, 7, 8, 9, 10])
    rows, parents = (5, (-1, 0, 0, 1, 2)) if tree else (4, None)
    _run_step(model, cache, 0, [11, 12, 13, 14, 15][:rows], parents)
    held = _state_bytes(cache.states, 0)
    reserved = cache.states.bytes_reserved(1, rows)
    assert held <= reserved <= 1.25 * held, (held, reserved)
    assert cache.states.bytes_reserved(8, rows) == 8 * reserved
    assert NO_LAYER_STATES.bytes_reserved(8, rows) == 0
    # The runner's sizing gets the reserve of the settings' sequences and rows.
    seen = []
    monkeypatch.setattr(runner_module, "kv_tokens_for_memory", lambda *a: seen.append(a) or 256)
    runner = ModelRunner(model, StepSettings(gpu_memory_utilization=0.5, max_num_seqs=8, max_rows_per_seq=rows))
    assert seen[0][3] == runner.states.bytes_reserved(8, rows) == 8 * reserved
    # An EP rank's sizing (ep.channel.load_shard): rank 0's sequences and rows reach every rank in
    # the collective (a max), and each rank reserves its own heads' states.
    from ep import channel

    class OneRank:
        device = torch.device("cpu")

        def all_reduce(self, t, op):
            assert op == "max"
            return torch.maximum(t, torch.tensor([8, rows])) if t.numel() == 2 else t

    monkeypatch.setattr(channel, "kv_tokens_for_memory", lambda *a: seen.append(a) or 256)
    shard = channel.load_shard(None, "float32", OneRank(), "auto", 1024, False, model=model,
                               gpu_memory_utilization=0.5)
    assert seen[-1][3] == 8 * reserved and shard.settings.max_num_seqs == 8 and shard.cache.num_blocks == 16
    gib = 1 << 30
    with_states = rdevice.kv_tokens_from(free=60 * gib, total=80 * gib, cached_free=0, utilization=0.9,
                                         bytes_per_token=1 << 20, reserved=3 * gib)
    without = rdevice.kv_tokens_from(free=60 * gib, total=80 * gib, cached_free=0, utilization=0.9,
                                     bytes_per_token=1 << 20)
    assert without - with_states == 3 * 1024
    with pytest.raises(ValueError, match="GiB for the running sequences' layer states"):
        rdevice.kv_tokens_from(free=60 * gib, total=80 * gib, cached_free=0, utilization=0.9, bytes_per_token=1,
                               reserved=60 * gib)


def test_a_deployment_sizes_states_for_its_deepest_verify(family_ckpt):
    path = family_ckpt("qwen35_vl")
    for spec, want in ((dict(), 1), (dict(spec="ngram", num_drafts=3), 4),
                       (dict(spec="mtp", num_drafts=2, tree_shape="2,2"), 5)):
        llm = LLM(path, dtype="float32", kv_cache_tokens=256, max_num_seqs=12, **spec)
        try:
            assert llm.deployment.rows_per_seq == want
            settings = llm.deployment.config.step_settings(llm.deployment.rows_per_seq)
            assert (settings.max_num_seqs, settings.max_rows_per_seq) == (12, want)
        finally:
            llm.shutdown()
