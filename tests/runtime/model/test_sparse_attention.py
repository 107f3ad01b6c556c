"""DeepSeek sparse attention (GLM-5, DeepSeek-V3.2; runtime.model.sparse_attention) on small random
checkpoints from transformers' own classes (tests/conftest.py FAMILY_CASES "glm5": index_topk 8,
layer 1 sharing layer 0's selection, an MTP layer with its own indexer; "deepseek_v32").

The family tests (tests/runtime/model/test_families.py) check logits against transformers' cached
decode; here greedy continuations follow transformers' full forward token by token, a context no
longer than index_topk is dense MLA, a tree row selects among its ancestors alone, and the cache,
prefix caching and preemption carry the indexer keys."""
from __future__ import annotations

import copy
import json

import pytest
import torch

from runtime.executor.attention import PagedAttention, SeqChunk, build_plan, choose_attention_backend
from runtime.model.config import ConfigError, ModelConfig, load_config
from runtime.executor.kv_cache import PagedKVCache
from runtime.sample.sampler import SamplingParams
from runtime.model.weights import load_model
from serving.llm import LLM
from tests.runtime.model.test_oracle import float64_islands, reference  # noqa: F401

pytest.importorskip("transformers.models.glm_moe_dsa", reason="transformers without GLM-5 (GlmMoeDsa)")

SPARSE = ["glm5", "deepseek_v32"]
LONG = [(i * 53) % 300 + 1 for i in range(14)]     # longer than index_topk (8)


def dense_copy(model):
    """The same weights with dense MLA: no selection, no indexer key in the cache."""
    dense = copy.deepcopy(model)
    dense.sparse = None
    for layer in [*dense.layers, *([dense.mtp.block] if dense.mtp is not None else [])]:
        layer.self_attn.sparse = None
    return dense


def run_chunks(model, steps: list[tuple[list[int], SeqChunk]], num_layers: int | None = None) -> list[torch.Tensor]:
    """Each step's tokens and chunk (sequence 0 unless the chunk says) through the model on one
    cache -> each step's logits."""
    cfg = model.config
    cache = PagedKVCache(num_layers=num_layers or cfg.num_hidden_layers, num_blocks=32, block_size=4,
                         dtype=model.dtype, device="cpu", **model.cache_layout())
    choose_attention_backend(cache, sparse=model.sparse is not None)   # as the runner chooses, once
    out = []
    with torch.no_grad():
        for tokens, chunk in steps:
            cache.reserve(chunk.seq_id, chunk.end)
            plan = build_plan(cache, [chunk])
            hidden = model(torch.tensor(tokens), plan.positions, PagedAttention(cache, plan))
            out.append(model.compute_logits(hidden))
    return out


def stepwise(ids: list[int], prefill: int) -> list[tuple[list[int], SeqChunk]]:
    return [(ids[:prefill], SeqChunk(0, 0, prefill))] + [([t], SeqChunk(0, prefill + i, 1))
                                                         for i, t in enumerate(ids[prefill:])]


@pytest.mark.parametrize("case", SPARSE)
def test_greedy_continuation_follows_the_full_forward_of_transformers(family_ckpt, case, float64_islands):
    """Prompts longer than index_topk; every generated token is transformers' full-forward argmax."""
    path = family_ckpt(case)
    ref = reference(path, torch.float64)
    prompts = [LONG, LONG[3:] + [7, 7, 9]]
    outs = LLM(path, dtype="float64", kv_cache_tokens=512).generate(prompts, SamplingParams(max_tokens=10,
                                                                                          ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        seq = list(prompt)
        with torch.no_grad():
            for _ in range(10):
                seq.append(int(ref(torch.tensor([seq])).logits[0, -1].argmax()))
        assert out.token_ids == seq[len(prompt):]


@pytest.mark.parametrize("case", SPARSE)
def test_a_context_within_index_topk_is_dense_mla_and_a_longer_one_is_not(family_ckpt, case):
    model = load_model(family_ckpt(case), torch.float64, device="cpu")
    dense = dense_copy(model)
    short = LONG[:5] + [3, 4, 5]                  # 8 keys at most = index_topk
    for got, want in zip(run_chunks(model, stepwise(short, 5)), run_chunks(dense, stepwise(short, 5))):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    got, want = run_chunks(model, stepwise(LONG, 10)), run_chunks(dense, stepwise(LONG, 10))
    assert (got[0][:8] - want[0][:8]).abs().max() < 1e-12        # rows seeing <= 8 keys
    assert (got[0][8:] - want[0][8:]).abs().max() > 1e-4         # the selection drops keys
    assert (got[-1] - want[-1]).abs().max() > 1e-4


@pytest.mark.parametrize("case", SPARSE)
def test_tree_rows_select_over_their_ancestors_not_their_siblings(family_ckpt, case):
    """A tree verify step after a context past index_topk: each row's logits equal those of its
    path run as a causal chunk (the context, then its ancestors and itself)."""
    model = load_model(family_ckpt(case), torch.float64, device="cpu")
    context, tree, parents = LONG[:11], [40, 41, 42, 43, 44], (-1, 0, 0, 1, 2)
    start = len(context)
    got = run_chunks(model, [(context, SeqChunk(0, 0, start)), (tree, SeqChunk(0, start, 5, parents))])[1]
    for row in range(5):
        path, j = [], row
        while j >= 0:
            path.append(tree[j])
            j = parents[j]
        ids = context + path[::-1]
        want = run_chunks(model, [(ids, SeqChunk(0, 0, len(ids)))])[0][-1]
        torch.testing.assert_close(got[row], want, rtol=0, atol=1e-10)


def test_the_selection_lives_in_the_step_and_the_sparse_backend_is_chosen_once(family_ckpt):
    """The runner of a sparse model chooses the sparse backend at start; each step's plan carries
    its rows' visibility and the selection its full layers make (layer 1 reads layer 0's, the
    MTP layer makes its own), and nothing of a step stays in the model; a plan of a dense
    backend, a shared layer with no full layer before it in the step, and batch-invariant tiles
    are refused in one line."""
    llm = LLM(family_ckpt("glm5"), dtype="float64", kv_cache_tokens=256, spec="mtp", num_drafts=2)
    runner = llm.engine.runner
    assert runner.attention.name.startswith("sparse over ") and runner.cache.attention is runner.attention
    assert "sparse over" in str(runner.choice)
    model = llm.model
    assert not any(isinstance(v, torch.Tensor | tuple) for v in vars(model.sparse).values())
    cache = runner.cache
    cache.reserve(0, len(LONG))
    plan = runner.attention.plan(cache, [SeqChunk(0, 0, len(LONG))])
    assert plan.sparse.seq.tolist() == [0] * len(LONG)
    assert plan.sparse.visible.tolist() == torch.ones(len(LONG), len(LONG), dtype=torch.bool).tril().tolist()
    with torch.no_grad():
        model(torch.tensor(LONG), plan.positions, PagedAttention(cache, plan))
    assert plan.sparse.chosen_by == 2 and plan.sparse.chosen[0].shape == (len(LONG), 8)   # the last full layer
    two = [SeqChunk(0, len(LONG) - 2, 2), SeqChunk(1, 0, 3, (-1, 0, 0))]
    cache.reserve(1, 3)
    tree = runner.attention.plan(cache, two)
    assert tree.sparse.seq.tolist() == [0, 0, 1, 1, 1]
    assert tree.sparse.visible[2:, :3].tolist() == [[True, False, False], [True, True, False], [True, False, True]]
    dense = build_plan(cache, [SeqChunk(0, 0, len(LONG))], backend=runner.attention.base)
    with pytest.raises(ValueError, match="plan of the sparse backend"), torch.no_grad():
        model(torch.tensor(LONG), dense.positions, PagedAttention(cache, dense))
    fresh = runner.attention.plan(cache, [SeqChunk(0, 0, len(LONG))])
    with pytest.raises(RuntimeError, match="none ran this step"), torch.no_grad():
        model.layers[1].self_attn(torch.zeros(len(LONG), model.config.hidden_size, dtype=torch.float64),
                                  model.rotary(fresh.positions, torch.float64), PagedAttention(cache, fresh))
    with pytest.raises(ValueError, match="no batch-invariant tiles"):
        choose_attention_backend(cache, batch_invariant=True, sparse=True)
    llm.shutdown()


def test_the_cache_cell_holds_the_latent_the_rotary_key_and_the_indexer_key(family_ckpt):
    path = family_ckpt("glm5")
    cfg = load_config(path)
    assert cfg.indexer_types == ("full", "shared", "full") and cfg.index_topk == 8
    llm = LLM(path, dtype="float64", kv_cache_tokens=256)
    model = llm.model
    assert [layer.self_attn.indexer is not None for layer in model.layers] == [True, False, True]
    assert model.mtp.block.self_attn.indexer is not None          # the MTP layer has its own
    cell = cfg.kv_lora_rank + cfg.qk_rope_head_dim + cfg.index_head_dim
    assert cfg.kv_values_per_token() == cell
    assert llm.engine.runner.cache.bytes_per_token == cell * (cfg.num_hidden_layers + 1) * 8
    assert llm.engine.runner.cache.latent_dim == cfg.kv_lora_rank


def test_bad_sparse_configs_are_refused_in_one_line(family_ckpt):
    raw = json.loads((family_ckpt("glm5") / "config.json").read_text())
    for bad in ({"indexer_types": ["shared", "full", "full"]}, {"indexer_types": ["full", "full"]},
                {"index_topk": 0}, {"index_n_heads": "4"}, {"q_lora_rank": None}):
        with pytest.raises(ConfigError) as err:
            ModelConfig.from_hf_dict({**raw, **bad})
        assert "\n" not in str(err.value)
    # transformers' pattern spelling of indexer_types
    pattern = {k: v for k, v in raw.items() if k != "indexer_types"}
    assert ModelConfig.from_hf_dict({**pattern, "index_topk_pattern": "FSF"}).indexer_types == ("full", "shared",
                                                                                               "full")


SHARED = [(i * 37) % 300 + 1 for i in range(34)]


def test_prefix_cache_on_equals_off_and_preemption_equals_roomy(family_ckpt):
    """The indexer keys live in the blocks: an attached prefix, and a preempted sequence coming
    back through its cached blocks, give the tokens of a computed one (MTP drafting, seeded)."""
    path = family_ckpt("glm5")
    params = SamplingParams(max_tokens=14, ignore_eos=True, temperature=0.9, seed=4)
    prompts = [SHARED + [i + 1, i + 2] for i in range(4)]
    roomy = LLM(path, dtype="float64", kv_cache_tokens=2048, prefix_cache=False)
    want = [o.token_ids for o in roomy.generate(prompts, params)]
    on = LLM(path, dtype="float64", kv_cache_tokens=2048, spec="mtp", num_drafts=3)
    on.generate(prompts[:1], params)
    again = [on.generate([p], params)[0] for p in prompts]
    assert [o.token_ids for o in again] == want and sum(o.cached_tokens for o in again) > 0
    small = LLM(path, dtype="float64", kv_cache_tokens=96, max_num_seqs=4, max_num_batched_tokens=32,
                spec="mtp", num_drafts=3)
    assert [o.token_ids for o in small.generate(prompts, params)] == want
    assert small.engine.scheduler.num_preemptions > 0
