"""Where a speculative step's time goes at concurrency 1: drafting, the verify forward, the rest.

    python tools/step_split.py --model models/tiny-glm-moe --num-drafts 1,2,3 --max-tokens 128 [--dtype bfloat16]

For no speculation and each K: ms per step, split into the drafter (propose), the target forward
(plus its logits) and everything else on the host (scheduling, sampling, commits), tokens per
step, and the drafter's ms per step against a one-row target step (`draft_per_target`); with
`--chain-ab` each K > 1 also runs its drafts as separate steps (not chained in one graph); prints
one table and writes JSON when asked.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def timed(obj, name: str, bucket: dict) -> None:
    fn = getattr(obj, name)

    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            bucket[name] = bucket.get(name, 0.0) + time.perf_counter() - t0
    setattr(obj, name, wrapper)


def measure(model: str, k: int, prompts: list[str], max_tokens: int, enforce_eager: bool = False,
            dtype: str = "float32", chained: bool = True) -> dict:
    """`chained` False: the compiled drafter runs each draft as a step of its own, not one sequence's
    drafts as one chained graph (speculative.mtp.MTPProposer._chain), to measure what chaining saves."""
    from serving.llm import LLM
    from runtime.sample.sampler import SamplingParams
    llm = LLM(model, dtype=dtype, spec="mtp" if k else "none", num_drafts=max(k, 1), draft_policy="fixed",
              kv_cache_tokens=8192, enforce_eager=enforce_eager)
    engine = llm.engine
    llm.generate(prompts[:1], SamplingParams(max_tokens=8, ignore_eos=True))  # warm-up
    if not chained and engine.proposer is not None:
        engine.proposer._chain_shapes = set()
    bucket: dict[str, float] = {}
    if engine.proposer is not None:
        timed(engine.proposer, "propose_batch", bucket)
    timed(engine.runner, "forward", bucket)
    timed(engine.runner, "logits", bucket)
    steps0, tokens = engine.num_steps, 0
    t0 = time.perf_counter()
    for p in prompts:  # one at a time: concurrency 1
        tokens += len(llm.generate([p], SamplingParams(max_tokens=max_tokens, ignore_eos=True))[0].token_ids)
    wall = time.perf_counter() - t0
    steps = engine.num_steps - steps0
    draft, target = bucket.get("propose_batch", 0.0), bucket["forward"] + bucket["logits"]
    return {"drafts": k, "chained": "yes" if chained and k > 1 and getattr(engine.proposer, "_chain_shapes", None)
            else "no", "steps": steps, "tokens": tokens, "tok_s": round(tokens / wall, 1),
            "tokens_per_step": round(tokens / steps, 3), "step_ms": round(1000 * wall / steps, 2),
            "draft_ms": round(1000 * draft / steps, 2), "target_ms": round(1000 * target / steps, 2),
            "host_ms": round(1000 * (wall - draft - target) / steps, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="models/tiny-glm-moe")
    ap.add_argument("--num-drafts", default="1,2,3")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--json-out", type=Path, default=None)
    ap.add_argument("--chain-ab", action="store_true", help="also run each K > 1 with the drafts as separate steps")
    ap.add_argument("--enforce-eager", action="store_true", help="run the eager step (no compile: a quick check; the speeds are not the served ones)")
    args = ap.parse_args()
    path = Path(args.model) / "heldout_prompts.jsonl"
    prompts = [json.loads(line)["prompt"] for line in path.read_text().splitlines() if line.strip()][:args.prompts]
    arms = [(0, True)]
    for k in map(int, args.num_drafts.split(",")):
        arms += [(k, True)] + ([(k, False)] if args.chain_ab and k > 1 else [])
    rows = [measure(args.model, k, prompts, args.max_tokens, args.enforce_eager, args.dtype, chained)
            for k, chained in arms]
    one_row = rows[0]["target_ms"]
    for r in rows:   # the drafter's cost against a one-row target step (forward and logits)
        r["draft_per_target"] = round(r["draft_ms"] / one_row, 2)
    cols = list(rows[0])
    print("  ".join(f"{c:>15}" for c in cols))
    for r in rows:
        print("  ".join(f"{r[c]!s:>15}" for c in cols))
    if args.json_out:
        args.json_out.write_text(json.dumps({"model": args.model, "dtype": args.dtype, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
