"""Expert-load imbalance for `tools/ep/ep_sim.py`: routing traces, DeepSeek's hierarchical EPLB
placement, and the max/mean rank load a placement gives.

    python tools/ep/ep_balance.py record [--model models/tiny-glm-moe] [--out F.json]
    python tools/ep/ep_balance.py imbalance [--trace F.json] --experts 256 --ep 72 --eplb 32 [--groups 8] [--rows 256]

A trace is per MoE layer and per decode step the number of rows routed to each expert (recorded
from the embedded model through the project's loader and engine, or written by any other
server in the same JSON layout). A trace's experts need not be the target model's: the target's
expert loads are the trace's per-layer Lorenz curve (cumulative share of rows over experts sorted
by load) resampled at the target's expert count, so the skew (the Gini) carries over while the
count changes; the hot experts land on random ids (seeded), as they do in a trained model.

EPLB is the runtime's own (`ep.eplb`: DeepSeek's hierarchical policy, which `--eplb-redundant-experts`
serves with); this module judges it on traces. A placement is made from the trace's
mean loads (in-distribution, as SGLang's 96-GPU run did) and judged on steps drawn from them at the
target's rows a step (multinomial), so batch size sets the per-step noise on top of the skew.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:   # run as a script: the runtime's packages import from the checkout
    sys.path.insert(0, str(ROOT))

from ep.eplb import (balanced_packing, contiguous_placement, eplb_placement, imbalance,  # noqa: E402,F401
                     replicate)

DEFAULT_TRACE = ROOT / "bench" / "records" / "routing_trace_tiny_glm_moe.json"


@dataclass(frozen=True, slots=True, kw_only=True)
class Trace:
    """Rows per expert, `steps[layer][step][expert]`, and the router's top-k."""
    num_experts: int
    top_k: int
    steps: np.ndarray   # [L, S, E] rows routed to each expert per layer and step

    def __post_init__(self) -> None:
        if self.steps.ndim != 3 or self.steps.shape[2] != self.num_experts or self.steps.shape[1] < 1:
            raise ValueError(f"trace steps have shape {self.steps.shape}, "
                             f"expected [layers, steps>=1, {self.num_experts}]")


def load_trace(path: Path) -> Trace:
    """The JSON trace written by `record` (or by hand in the same layout)."""
    try:
        raw = json.loads(Path(path).read_text())
        return Trace(num_experts=int(raw["num_experts"]), top_k=int(raw["top_k"]),
                     steps=np.asarray(raw["steps"], dtype=np.float64))
    except (OSError, KeyError, ValueError, TypeError) as exc:
        raise ValueError(f"routing trace {path}: {exc}") from None


def lorenz_shares(loads: np.ndarray, num_experts: int) -> np.ndarray:
    """Expert shares (summing to 1, sorted descending) for `num_experts` experts whose cumulative
    share curve is that of `loads` (linear between the trace's points)."""
    shares = np.sort(np.asarray(loads, dtype=np.float64))[::-1]
    total = shares.sum()
    if total <= 0:
        return np.full(num_experts, 1.0 / num_experts)
    src = np.concatenate([[0.0], np.cumsum(shares / total)])                # at x = i / E_src
    cum = np.interp(np.arange(num_experts + 1) / num_experts, np.arange(len(shares) + 1) / len(shares), src)
    return np.diff(cum)


def target_loads(trace: Trace, num_experts: int, seed: int = 0) -> np.ndarray:
    """Mean rows share per expert of the target model, per layer: [L, E] (each row sums to 1)."""
    rng = np.random.default_rng(seed)
    out = []
    for layer in trace.steps:
        shares = lorenz_shares(layer.sum(axis=0), num_experts)
        out.append(shares[rng.permutation(num_experts)])
    return np.asarray(out)


def choose_placement(mean: np.ndarray, *, ep: int, eplb_redundant: int | None, gpus_per_node: int,
                     num_groups: int) -> np.ndarray:
    """[G, E] placement for expert loads `mean`: contiguous without EPLB (`eplb_redundant` None),
    else EPLB with that many redundant experts, or contiguous where that is no worse on `mean`."""
    contiguous = contiguous_placement(len(mean), ep)
    if eplb_redundant is None:
        return contiguous
    placed = eplb_placement(mean, num_redundant=eplb_redundant, num_gpus=ep, gpus_per_node=gpus_per_node,
                            num_groups=num_groups)
    return placed if imbalance(placed, mean) <= imbalance(contiguous, mean) else contiguous


def layout_imbalance(trace: Trace, *, num_experts: int, ep: int, eplb_redundant: int | None, gpus_per_node: int,
                     num_groups: int, rows_per_step: float, top_k: int, num_samples: int = 8,
                     seed: int = 0) -> float:
    """Expected max/mean rank load of the routed experts at EP `ep` for a step that routes
    `rows_per_step` rows (all ranks together) with `top_k` choices each: per MoE layer, the target
    loads from the trace, placed (`choose_placement`) from the mean loads, judged on
    `num_samples` steps drawn from them (multinomial), averaged over steps and layers."""
    rng = np.random.default_rng(seed)
    per_layer = []
    for mean in target_loads(trace, num_experts, seed):
        share = choose_placement(mean, ep=ep, eplb_redundant=eplb_redundant, gpus_per_node=gpus_per_node,
                                 num_groups=num_groups)
        draws = rng.multinomial(max(1, round(rows_per_step * top_k)), mean, size=num_samples)
        per_layer.append(imbalance(share, draws))
    return float(np.mean(per_layer))


def record(model: str, out: Path, num_prompts: int, max_tokens: int) -> dict:
    """Route real prompts through the embedded model (greedy decode of a batch of its held-out
    prompts, float32 on the CPU) and write, per MoE layer and decode step, the rows each expert got."""
    import torch

    from runtime.sample.sampler import SamplingParams
    from serving.llm import LLM

    lines = (Path(model) / "heldout_prompts.jsonl").read_text().splitlines()
    prompts = [json.loads(line)["prompt"] for line in lines if line.strip()][:num_prompts]
    llm = LLM(model, "float32", enforce_eager=True, device="cpu", prefix_cache=False)
    cfg = llm.model.config
    num_experts, top_k = cfg.n_routed_experts, cfg.num_experts_per_tok
    moes = [m for m in llm.model.modules() if hasattr(m, "gate") and hasattr(m, "experts")]
    steps: list[list[list[int]]] = [[] for _ in moes]

    def grab(i: int):
        def hook(_module, _inputs, output) -> None:
            ids = output[2]                                  # [T, top_k] chosen experts
            if ids.shape[0] <= len(prompts):                 # a decode step: one row per running sequence
                steps[i].append(torch.bincount(ids.reshape(-1), minlength=num_experts).tolist())
        return hook

    for i, moe in enumerate(moes):
        moe.gate.register_forward_hook(grab(i))
    llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    steps = [layer for layer in steps if layer]              # the MTP layer's MoE does not run without speculation
    data = {"model": str(Path(model).name), "num_experts": num_experts, "top_k": top_k, "num_prompts": len(prompts),
            "max_tokens": max_tokens, "layers": len(steps), "steps": steps}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data) + "\n")
    return data


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    rec = sub.add_parser("record", help="record a routing trace from the embedded model")
    rec.add_argument("--model", default=str(ROOT / "models" / "tiny-glm-moe"))
    rec.add_argument("--out", type=Path, default=DEFAULT_TRACE)
    rec.add_argument("--prompts", type=int, default=16)
    rec.add_argument("--max-tokens", type=int, default=48)
    imb = sub.add_parser("imbalance", help="max/mean rank load of a layout")
    imb.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    imb.add_argument("--experts", type=int, required=True)
    imb.add_argument("--top-k", type=int, default=8)
    imb.add_argument("--groups", type=int, default=1)
    imb.add_argument("--ep", type=int, required=True)
    imb.add_argument("--eplb", type=int, default=None, metavar="R", help="EPLB with R redundant experts")
    imb.add_argument("--rows", type=float, default=256.0, help="rows per rank per step")
    args = ap.parse_args(argv)
    if args.cmd == "record":
        data = record(args.model, args.out, args.prompts, args.max_tokens)
        print(f"{data['layers']} MoE layers, {len(data['steps'][0])} decode steps, {data['num_experts']} experts "
              f"top-{data['top_k']} -> {args.out}")
        return 0
    try:
        value = layout_imbalance(load_trace(args.trace), num_experts=args.experts, ep=args.ep,
                                 eplb_redundant=args.eplb, gpus_per_node=8, num_groups=args.groups,
                                 rows_per_step=args.rows * args.ep, top_k=args.top_k)
    except ValueError as exc:
        ap.error(str(exc))
    print(f"max/mean rank load {value:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
