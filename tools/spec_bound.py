"""The most MTP speculation can gain at one sequence where a step's cost is the weight bytes it reads.

    python tools/spec_bound.py --model models/tiny-glm-moe --accept 1:1.753,2:2.3,3:2.695

A one-row target step reads every dense weight and `num_experts_per_tok` routed experts a MoE
layer; a verify of R rows reads the experts its rows touch (expected distinct of R independent
top-k draws, routing taken as uniform); a drafter step reads the MTP layer (eh_proj, one decoder
layer) and the lm_head. With A(K) tokens a step at K drafts, bytes-bound tok/s over no speculation:

    S(K) = A(K) / (verify(K + 1) / target + K * drafter / target)

printed beside the bound with a free verify (verify = target) and with every draft accepted
(A = K + 1). Kernel launch and host costs only lower the measured ratio below these.

Trees (`--tree 1,2,2:3.13`, a shape and its measured tokens a step, docs/design.md §5.5): a shape of
D depths verifies 1 + its nodes rows and takes D drafter steps (each depth's hedges are that
step's next-best tokens), the drafter steps of the chain of depth D. So against that chain, whose
verify has fewer rows, the tree's tok/s can gain at most its tokens a step over the chain's
(`vs chain, any cost`), whatever a row costs as long as more rows never cost less; the bytes-bound
ratio is printed beside it.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path


def layer_params(cfg: dict, moe: bool, experts: float) -> float:
    """Weights one token reads in one decoder layer: attention, then a dense MLP or the router,
    the shared experts and `experts` routed experts."""
    h, d = cfg["hidden_size"], cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    attn = h * d * (2 * cfg["num_attention_heads"] + 2 * cfg["num_key_value_heads"])   # q, o, k, v
    if not moe:
        return attn + 3 * h * cfg["intermediate_size"]
    expert = 3 * h * cfg["moe_intermediate_size"]
    return attn + h * cfg["n_routed_experts"] + cfg.get("n_shared_experts", 0) * expert + experts * expert


def distinct_experts(cfg: dict, rows: int) -> float:
    """Expected distinct experts `rows` rows touch, each picking top-k of E uniformly."""
    e, k = cfg["n_routed_experts"], cfg["num_experts_per_tok"]
    return e * (1 - (1 - k / e) ** rows)


def costs(cfg: dict, rows: int) -> float:
    """Weights a forward of `rows` rows reads (experts by `distinct_experts`) plus the lm_head."""
    dense = cfg.get("first_k_dense_replace", 0)
    layers = sum(layer_params(cfg, i >= dense, distinct_experts(cfg, rows)) for i in range(cfg["num_hidden_layers"]))
    return layers + cfg["vocab_size"] * cfg["hidden_size"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="models/tiny-glm-moe")
    ap.add_argument("--accept", required=True, help="measured tokens a step by drafts, e.g. 1:1.75,3:2.70")
    ap.add_argument("--tree", action="append", default=[],
                    help="a tree shape and its measured tokens a step, e.g. 1,2,2:3.13 (repeatable); "
                         "compared with the chain of its depth from --accept")
    args = ap.parse_args()
    cfg = json.loads((Path(args.model) / "config.json").read_text())
    h = cfg["hidden_size"]
    target = costs(cfg, 1)
    drafter = 2 * h * h + layer_params(cfg, True, cfg["num_experts_per_tok"]) + cfg["vocab_size"] * h
    print(f"weights read, millions: one-row target step {target / 1e6:.3f}, drafter step {drafter / 1e6:.3f} "
          f"({drafter / target:.3f} of the target step)")
    print(f"{'K':>3} {'accept':>7} {'verify/target':>14} {'bound':>7} {'free verify':>12} {'all accepted':>13}")
    for part in args.accept.split(","):
        k_text, a_text = part.split(":")
        k, accept = int(k_text), float(a_text)
        verify = costs(cfg, k + 1) / target
        draft = k * drafter / target
        print(f"{k:>3} {accept:>7.3f} {verify:>14.3f} {accept / (verify + draft):>7.3f} {accept / (1 + draft):>12.3f} "
              f"{(k + 1) / (verify + draft):>13.3f}")
    chains = {int(k): float(a) for k, a in (part.split(":") for part in args.accept.split(","))}
    if args.tree:
        print(f"{'tree':>9} {'accept':>7} {'rows':>5} {'chain':>6} {'vs chain, any cost':>19} {'vs chain, bytes':>16} "
              f"{'bound':>7}")
    for part in args.tree:
        shape_text, a_text = part.rsplit(":", 1)
        counts = [int(c) for c in shape_text.split(",")]
        accept, depth = float(a_text), len(counts)
        cost = costs(cfg, 1 + sum(counts)) / target + depth * drafter / target
        if depth not in chains:
            raise SystemExit(f"--tree {part}: give the chain of depth {depth} in --accept to compare with")
        chain_cost = costs(cfg, depth + 1) / target + depth * drafter / target
        gain = accept / chains[depth]
        print(f"{shape_text:>9} {accept:>7.3f} {1 + sum(counts):>5} {'k' + str(depth):>6} {gain:>19.3f} "
              f"{gain * chain_cost / cost:>16.3f} {accept / cost:>7.3f}")


if __name__ == "__main__":
    main()
