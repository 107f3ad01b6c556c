"""Per-layer cost of one decode row with DeepSeek sparse attention (runtime.model.sparse_attention)
against dense MLA attention over the same latent cache, as the context grows.

    python tools/kernels/dsa_cost.py [--contexts 256,512,1024,2048,4096,8192] [--reps 15] [--threads 1]
                             [--out bench/records/dsa_cost.json]

One layer at GLM-5's published attention shapes (64 query heads, kv_lora_rank 512, qk_rope 64,
an indexer of 32 heads x 128, index_topk 2048; hidden 6144, q_lora_rank 2048), float32 on the
CPU, one sequence, random cache contents. Dense: `PagedAttention.attend` over the latent cache
(the path a dense MLA model runs). Sparse: the indexer's query and weights, its scores over
every visible key, the top-k and attention over the selected keys (`DsaSelection.attend`). The
arms alternate within each repetition; medians are reported. The indexer's two projections
(`wq_b`, `weights_proj`: a fixed cost of each row, whatever the context) are timed on their own
too, so the part that grows with the context shows apart.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from runtime.executor.attention import PagedAttention, SeqChunk, build_plan
from runtime.model.config import ModelConfig
from runtime.executor.kv_cache import PagedKVCache
from runtime.model.sparse_attention import DsaSelection, Indexer

GLM5 = dict(architecture="GlmMoeDsaForCausalLM", vocab_size=1024, hidden_size=6144, intermediate_size=64,
            num_hidden_layers=1, num_attention_heads=64, num_key_value_heads=64, head_dim=64,
            moe_intermediate_size=64, num_experts_per_tok=1, n_routed_experts=1, kv_lora_rank=512,
            q_lora_rank=2048, qk_nope_head_dim=192, qk_rope_head_dim=64, v_head_dim=256, partial_rotary_factor=1.0,
            index_topk=2048, index_n_heads=32, index_head_dim=128, indexer_types=("full",),
            index_rope_interleave=True, max_position_embeddings=16384)


def measure(cfg: ModelConfig, context: int, reps: int) -> dict[str, float]:
    torch.manual_seed(0)
    c, dr, di, nh = cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.index_head_dim, cfg.num_attention_heads
    block = 64
    caches = {name: PagedKVCache(num_layers=1, num_kv_heads=1, head_dim=width, num_blocks=context // block + 1,
                                 block_size=block, latent_dim=c, device="cpu")
              for name, width in (("dense", c + dr), ("sparse", c + dr + di))}
    for cache in caches.values():
        cache.reserve(0, context)
        cache.k.normal_()
    plan = build_plan(caches["dense"], [SeqChunk(0, context - 1, 1)])
    sparse_plan = build_plan(caches["sparse"], [SeqChunk(0, context - 1, 1)])
    indexer, selection = Indexer(cfg).eval(), DsaSelection(cfg)
    q = torch.randn(1, nh, c + dr)
    cell = torch.randn(1, 1, c + dr + di)
    x, q_resid = torch.randn(1, cfg.hidden_size), torch.randn(1, cfg.q_lora_rank)
    angle = torch.rand(1, dr)
    rope = (angle.cos(), angle.sin())
    times: dict[str, list[float]] = {"dense_ms": [], "sparse_ms": [], "index_proj_ms": []}
    with torch.inference_mode():
        for rep in range(reps + 2):
            for arm in (("dense", "sparse", "index_proj") if rep % 2 else ("index_proj", "sparse", "dense")):
                t0 = time.perf_counter()
                if arm == "index_proj":   # the indexer's per-row projections, a fixed cost of the row
                    indexer.wq_b(q_resid), indexer.weights_proj(x)
                elif arm == "dense":
                    PagedAttention(caches["dense"], plan).attend(0, q, cell[..., :c + dr], cell[..., :c], 0.07)
                else:
                    selection.attend(PagedAttention(caches["sparse"], sparse_plan), 0, q, cell, indexer, q_resid,
                                     x, rope, 0.07, c)
                if rep >= 2:
                    times[f"{arm}_ms"].append(1e3 * (time.perf_counter() - t0))
    return {"context": context, **{k: statistics.median(v) for k, v in times.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="256,512,1024,2048,4096,8192")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfg = ModelConfig(**GLM5)
    rows = [measure(cfg, int(k), args.reps) for k in args.contexts.split(",")]
    print(f"{'context':>8} {'dense ms':>9} {'sparse ms':>10} {'of it proj':>11} {'sparse/dense':>13} "
          f"{'(less proj)/dense':>18}")
    for r in rows:
        rest = r["sparse_ms"] - r["index_proj_ms"]
        print(f"{r['context']:>8} {r['dense_ms']:>9.2f} {r['sparse_ms']:>10.2f} {r['index_proj_ms']:>11.2f} "
              f"{r['sparse_ms'] / r['dense_ms']:>13.2f} {rest / r['dense_ms']:>18.2f}")
    if args.out is not None:
        args.out.write_text(json.dumps({"what": "one GLM-5-shaped layer, one decode row, float32 CPU",
                                        "threads": args.threads, "reps": args.reps, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
