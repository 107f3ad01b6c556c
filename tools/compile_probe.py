"""A probe for the compiled step (issue 14's next idea): eager against `torch.compile`, one run.

    python tools/compile_probe.py --model models/tiny-glm-moe --concurrency 1,16 \
        --json-out bench/records/compile_probe.json

The target forward is compiled by inductor with dynamic shapes. The two pieces a compiled graph
cannot hold today stay opaque `torch.library` custom ops: paged attention, which writes the KV
cache (functionalizing that write copies the whole cache; here the op finds the step's cache and
plan in a forward context, as vLLM's unified attention does), and the grouped routed experts
(`torch._grouped_mm` has no float32 meta kernel). Everything else (embedding, norms, rotary,
projections, the router, shared experts, residuals) is fused. The probe checks that both modes
give the same greedy tokens, then alternates them per concurrency and keeps the best of the
repeats. Both arms here call attention and the experts through the custom ops, so the eager arm
pays their dispatch too and the ratio overstates what compiling buys the runtime; for that, run
`metrale bench --arms none,none-eager` (the runtime's compiled step against its plain eager one;
bench/records/compiled_vs_eager.json).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from torch import Tensor

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from runtime import attention, layers  # noqa: E402
from runtime.sampler import SamplingParams  # noqa: E402
from serving.llm import LLM  # noqa: E402

_step: list[attention.PagedAttention | None] = [None]   # the forward context of the step running now


@torch.library.custom_op("metrale_probe::attend", mutates_args=())
def attend(q: Tensor, k: Tensor, v: Tensor, layer_idx: int, scale: float) -> Tensor:
    return attention.PagedAttention.attend(_step[0], layer_idx, q, k, v, scale).contiguous()


@attend.register_fake
def _(q: Tensor, k: Tensor, v: Tensor, layer_idx: int, scale: float) -> Tensor:
    return q.new_empty(q.shape)


@torch.library.custom_op("metrale_probe::experts", mutates_args=())
def experts(x: Tensor, weights: Tensor, ids: Tensor, gate_up: Tensor, down: Tensor, offset: int) -> Tensor:
    m = layers.RoutedExperts.__new__(layers.RoutedExperts)
    torch.nn.Module.__init__(m)
    m.expert_offset, m.gate_up_proj, m.down_proj = offset, gate_up, down
    return m._grouped(x, weights, ids)


@experts.register_fake
def _(x: Tensor, weights: Tensor, ids: Tensor, gate_up: Tensor, down: Tensor, offset: int) -> Tensor:
    return x.new_empty(x.shape)


class OpaqueAttention:
    def attend(self, layer_idx: int, q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
        return attend(q, k, v, layer_idx, scale)


def build(model_dir: str, dtype: str, compiled: bool) -> LLM:
    llm = LLM(model_dir, dtype=dtype, spec="none", kv_cache_tokens=16384)
    runner = llm.engine.runner
    for layer in runner.model.layers:
        routed = getattr(layer.mlp, "experts", None)
        if routed is not None:
            routed.forward = (lambda r: lambda x, w, i: experts(x, w, i, r.gate_up_proj, r.down_proj,
                                                               r.expert_offset))(routed)
    forward = torch.compile(runner.model.forward, dynamic=True) if compiled else runner.model.forward

    def run(tokens: list[int], chunks):
        plan = attention.build_plan(runner.cache, chunks)
        _step[0] = attention.PagedAttention(runner.cache, plan)
        with torch.inference_mode():
            return forward(torch.tensor(tokens, dtype=torch.long), plan.positions, OpaqueAttention()), plan

    runner.forward = run
    return llm


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(ROOT / "models" / "tiny-glm-moe"))
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--concurrency", default="1,16")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json-out", type=Path, default=None)
    args = ap.parse_args(argv)
    levels = [int(c) for c in args.concurrency.split(",")]
    if min(levels) < 1 or args.repeats < 1 or args.max_tokens < 1:
        ap.error("--concurrency levels, --repeats and --max-tokens must be at least 1")
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    arms = {"eager": build(args.model, args.dtype, False), "compiled": build(args.model, args.dtype, True)}
    t0 = time.perf_counter()
    warm = arms["compiled"].generate([[1, 2, 3]] * max(levels), params)   # compiles (dynamic shapes)
    compile_s = time.perf_counter() - t0
    same = [o.token_ids for o in arms["eager"].generate([[1, 2, 3]] * max(levels), params)] == \
        [o.token_ids for o in warm]
    rows = []
    for c in levels:
        prompts = [[7, 8, 9, 10, 11 + j] for j in range(c)]
        best = {name: 0.0 for name in arms}
        for _ in range(args.repeats):
            for name, llm in arms.items():
                t = time.perf_counter()
                llm.generate(prompts, params)
                best[name] = max(best[name], args.max_tokens * c / (time.perf_counter() - t))
        rows.append({"concurrency": c, "eager_tok_s": round(best["eager"], 1),
                     "compiled_tok_s": round(best["compiled"], 1),
                     "speedup": round(best["compiled"] / best["eager"], 3)})
        print(f"c={c:<3} eager {best['eager']:8.1f} tok/s  compiled {best['compiled']:8.1f} tok/s  "
              f"{best['compiled'] / best['eager']:.3f}x", flush=True)
    print(f"compile and first run: {compile_s:.1f} s; same greedy tokens: {same}")
    if args.json_out:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(json.dumps({"model": args.model, "dtype": args.dtype, "threads": torch.get_num_threads(),
                                             "max_tokens": args.max_tokens, "repeats": args.repeats,
                                             "compile_s": round(compile_s, 1), "same_greedy_tokens": same,
                                             "rows": rows}, indent=2) + "\n")
        print(f"wrote {args.json_out}")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
