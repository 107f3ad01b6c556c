"""The most MTP speculation can gain at one sequence where a step's cost is the weight bytes it reads.

    python tools/spec_bound.py --model models/tiny-glm-moe --accept 1:1.753,2:2.3,3:2.695

A one-row target step reads every dense weight and `num_experts_per_tok` routed experts a MoE
layer; a verify of R rows reads the experts its rows touch (expected distinct of R independent
top-k draws, routing taken as uniform); a drafter step reads the MTP layer (eh_proj, one decoder
layer) and the lm_head. With A(K) tokens a step at K drafts, bytes-bound tok/s over no speculation:

    S(K) = A(K) / (verify(K + 1) / target + K * drafter / target)

printed beside the bound with a free verify (verify = target) and with every draft accepted
(A = K + 1). Kernel launch and host costs only lower the measured ratio below these.
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


if __name__ == "__main__":
    main()
