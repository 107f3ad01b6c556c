"""Write a random Glm4MoeForCausalLM checkpoint with transformers (for speed comparisons).

    python tools/random_checkpoint.py OUT_DIR --tokenizer models/tiny-glm-moe/tokenizer.json
"""
from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--tokenizer", type=Path, required=True, help="a tokenizer.json whose vocabulary the model uses")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM
    vocab = len(json.loads(args.tokenizer.read_text())["model"]["vocab"])
    torch.manual_seed(args.seed)
    cfg = Glm4MoeConfig(vocab_size=vocab, hidden_size=args.hidden, intermediate_size=3 * args.hidden,
                        num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=args.hidden // 4, moe_intermediate_size=args.hidden, num_experts_per_tok=2,
                        n_routed_experts=args.experts, n_shared_experts=1, first_k_dense_replace=1,
                        max_position_embeddings=2048, eos_token_id=0)
    Glm4MoeForCausalLM(cfg).save_pretrained(args.out)
    shutil.copy(args.tokenizer, args.out / "tokenizer.json")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
