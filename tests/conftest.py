"""Shared fixtures: tiny random Glm4MoeForCausalLM checkpoints written by transformers itself."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 320  # a byte-level BPE needs 256 base tokens

BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, moe_intermediate_size=32, num_experts_per_tok=2,
            n_routed_experts=8, n_shared_experts=1, first_k_dense_replace=1, max_position_embeddings=256,
            eos_token_id=0)
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
    text = (ROOT / "runtime" / "model.py").read_text() + (ROOT / "runtime" / "layers.py").read_text()
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
    from safetensors.torch import load_file, save_file
    cfg = json.loads((path / "config.json").read_text())
    layers, h = cfg["num_hidden_layers"], cfg["hidden_size"]
    tensors = load_file(str(path / "model.safetensors"))
    g = torch.Generator().manual_seed(seed)
    src = f"model.layers.{layers - 1}."
    for k in [k for k in tensors if k.startswith(src)]:
        noise = 0.0 if copy_from_last else 0.05 * torch.randn(tensors[k].shape, generator=g)
        tensors[f"model.layers.{layers}." + k[len(src):]] = tensors[k].clone() + noise
    eh = torch.zeros(h, 2 * h)
    eh[:, h:] = torch.eye(h)  # pass the target hidden through, ignore the token
    eh += 0.02 * torch.randn(h, 2 * h, generator=g)
    tensors[f"model.layers.{layers}.eh_proj.weight"] = eh
    for name in ("enorm", "hnorm", "shared_head.norm"):
        tensors[f"model.layers.{layers}.{name}.weight"] = torch.ones(h)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


@pytest.fixture(scope="session")
def ckpt_mtp(tmp_path_factory) -> Path:
    return add_random_mtp(make_checkpoint(tmp_path_factory.mktemp("mtp"), "grouped", seed=2))


@pytest.fixture(scope="session")
def ckpt_plain(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("plain"), "plain")


@pytest.fixture(scope="session")
def ckpt_grouped(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("grouped"), "grouped", seed=1)


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
