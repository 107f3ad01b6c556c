"""Shared fixtures: tiny random Glm4MoeForCausalLM checkpoints written by transformers itself."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

# Without a GPU the Triton kernels (runtime/ops/kernels) run under Triton's interpreter on CPU tensors;
# it is chosen when triton is imported (torch.compile imports it), so before any test runs.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 320  # a byte-level BPE needs 256 base tokens

BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, moe_intermediate_size=32, num_experts_per_tok=2,
            n_routed_experts=8, n_shared_experts=1, first_k_dense_replace=1, max_position_embeddings=256,
            eos_token_id=0)
@pytest.fixture(autouse=True)
def engines_run_eager_unless_asked(request, monkeypatch):
    """An `LLM` built in the test process runs its step eagerly unless the test passes
    `enforce_eager=False`: every distinct model configuration costs a compile (5-15 s), and only
    the tests of the compiled step need one. (Before this, Dynamo's recompile limit made the 9th
    configuration of a process run eager silently; `ModelRunner` now raises that limit.) Engines
    in subprocesses (the CLI, tools, EP workers of a compiled rank 0) keep the real default, and
    so do tests marked `cuda` (their LLMs capture CUDA graphs by default; `forces_eager`)."""
    if not forces_eager(request.node):
        return
    from serving.llm import LLM
    monkeypatch.setitem(LLM.__init__.__kwdefaults__, "enforce_eager", True)


@pytest.fixture(autouse=True)
def cli_publications_end_with_the_test(monkeypatch):
    """The CLI publishes its speculation settings process-wide (`launch.cli.resolve_speculation`:
    the ladder, the width cap, the confidence stop), as one process serves one model; a test that
    runs the CLI in the test process must not leave them to the next test of its worker."""
    from speculative import draft_stop, ladder
    for module, name in ((ladder, "_published_ladder"), (ladder, "_published_max_seqs"), (draft_stop, "_published")):
        monkeypatch.setattr(module, name, getattr(module, name))


def forces_eager(node) -> bool:
    """Whether `engines_run_eager_unless_asked` makes this test's LLMs eager: not for a `cuda` test."""
    return node.get_closest_marker("cuda") is None


def engine_on(llm, spec=None, proposer=None, prefix_cache: bool = True):
    """A fresh engine (scheduler, prefix index, speculation: `spec` with its `proposer`, or none)
    over `llm`'s runner, so one loaded and compiled model serves several arms of a test; run it
    with `llm.engine = engine_on(...)` before `llm.generate`."""
    from engine.engine import Engine, EngineConfig
    config = EngineConfig(max_num_seqs=llm.engine.config.max_num_seqs, prefix_cache=prefix_cache)
    return Engine(llm.deployment.runner, llm.tokenizer, config, spec, proposer)


def cache_kwargs(model, cache) -> dict:
    """The keyword a transformers model's forward takes its KV cache by: `cache` from 5.25,
    `past_key_values` before (the GPU image has 5.17), read off the forward's signature."""
    import inspect
    params = inspect.signature(model.forward).parameters
    return {"cache": cache} if "cache" in params else {"past_key_values": cache}


def output_cache(out):
    """The cache a transformers forward returns (`out.cache` from 5.25, `out.past_key_values` before)."""
    return out.cache if hasattr(out, "cache") else out.past_key_values


# One plain config, one with grouped routing, q/k norm, attention bias and routed scaling.
CONFIGS = {
    "plain": dict(n_group=1, topk_group=1, use_qk_norm=False, attention_bias=False),
    "grouped": dict(n_group=4, topk_group=2, use_qk_norm=True, attention_bias=True, routed_scaling_factor=2.5,
                    n_routed_experts=8, num_experts_per_tok=3),
}


def write_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    text = (ROOT / "runtime" / "model" / "causal_lm.py").read_text() + (ROOT / "runtime" / "model" / "layers.py").read_text()
    tok.train_from_iterator([text] * 4, trainer=trainer)
    tok.save(str(path / "tokenizer.json"))


def make_checkpoint(path: Path, name: str = "plain", seed: int = 0, **overrides) -> Path:
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM
    torch.manual_seed(seed)
    cfg = Glm4MoeConfig(**{**BASE, **CONFIGS[name], **overrides})
    model = Glm4MoeForCausalLM(cfg)
    with torch.no_grad():
        for n, b in model.named_buffers():
            if n.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.05)  # a non-zero correction bias changes which experts win
        for n, p in model.named_parameters():  # larger weights: logits that are not all near zero
            if p.dim() == 2:
                p.normal_(0.0, 0.08)
    model.save_pretrained(path)
    write_tokenizer(path)
    return path


def add_random_mtp(path: Path, seed: int = 5, copy_from_last: bool = True) -> Path:
    """Give a transformers checkpoint an MTP layer at index num_hidden_layers (docs/design.md §3).

    With `copy_from_last` the MTP decoder layer starts as a copy of the last target layer and
    eh_proj passes the hidden through, so drafts agree with the target often enough for
    verification to accept some and reject others.
    """
    from tools.random_checkpoint import add_mtp_layer
    return add_mtp_layer(path, seed, noise=0.0 if copy_from_last else 0.05)


@pytest.fixture(scope="session")
def ckpt_mtp(tmp_path_factory) -> Path:
    return add_random_mtp(make_checkpoint(tmp_path_factory.mktemp("mtp"), "grouped", seed=2))


@pytest.fixture(scope="session")
def ckpt_plain(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("plain"), "plain")


@pytest.fixture(scope="session")
def ckpt_grouped(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("grouped"), "grouped", seed=1)


def pytest_configure(config) -> None:
    """Under pytest-xdist (`make test` runs two workers) each worker's torch takes an equal share
    of the cores, so the workers do not oversubscribe them; a test that needs a thread count sets it."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(workers)))


def pytest_collection_modifyitems(config, items) -> None:
    """Tests marked `cuda` are skipped on a host without a CUDA device."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (make gpu-check runs these)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


def metrale_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "launch", *args]


def run_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "2")
    return env


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# Small checkpoints of the other families (tools/random_checkpoint.py), covering each one's options.
FAMILY_CASES = {
    "qwen_norm": ("qwen3_moe", dict(norm_topk_prob=True, mlp_only_layers=[0], attention_bias=True)),
    "qwen_sparse": ("qwen3_moe", dict(norm_topk_prob=False, decoder_sparse_step=2)),
    "deepseek_yarn": ("deepseek_v3", dict(n_group=4, topk_group=2, first_k_dense_replace=1)),  # q_lora_rank set
    "deepseek_plain": ("deepseek_v3", dict(q_lora_rank=None, n_group=1, topk_group=1, first_k_dense_replace=2,
                                           rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    "glm_lite": ("glm4_moe_lite", dict(mlp_layer_types=["dense", "sparse", "sparse"], q_lora_rank=None)),
    # Sparse attention: top 8 keys, layer 1 sharing layer 0's selection (the MTP layer copies layer 2's indexer).
    "glm5": ("glm_moe_dsa", dict(indexer_types=["full", "shared", "full"])),
    "deepseek_v32": ("deepseek_v32", dict()),
}
# Qwen3.5 / Qwen3.6-MoE in its two layouts, 3 Gated DeltaNet layers and 1 full-attention layer
# (tests/runtime/model/test_qwen3_5.py; apart from FAMILY_CASES, whose tests assume a KV cache in every layer).
QWEN35_CASES = {
    "qwen35_text": ("qwen3_5_moe_text", dict(num_hidden_layers=4)),
    "qwen35_vl": ("qwen3_5_moe", dict(num_hidden_layers=4)),
}


def make_family_checkpoint(path: Path, case: str, seed: int = 3) -> Path:
    import transformers
    from tools.random_checkpoint import FAMILIES, family_config, write_checkpoint
    family, overrides = {**FAMILY_CASES, **QWEN35_CASES}[case]
    if not hasattr(transformers, FAMILIES[family][0]):   # GLM-5 / DeepSeek-V3.2 need transformers >= 5.2x
        pytest.skip(f"transformers {transformers.__version__} has no {FAMILIES[family][0]}")
    cfg = {**family_config(family, 64, 3, 8), "vocab_size": VOCAB, "max_position_embeddings": 256, **overrides}
    write_checkpoint(path, family, cfg, seed=seed, mtp=FAMILIES[family][2], weight_std=0.08)
    write_tokenizer(path)
    return path


@pytest.fixture(scope="session")
def family_ckpt(tmp_path_factory):
    """case name -> its checkpoint folder, written on first use."""
    made: dict[str, Path] = {}

    def get(case: str) -> Path:
        if case not in made:
            made[case] = make_family_checkpoint(tmp_path_factory.mktemp(case), case)
        return made[case]
    return get
