"""Plain decoding at one width, compiled against eager: where each step goes, and what bounds their ratio.

    python tools/eager_split.py --model models/tiny-glm-moe --width 16 --dtype bfloat16

Both arms (`torch.compile`d steps and `enforce_eager`) decode the same `--width` held-out prompts
together (greedy, `--max-tokens` each) in one process, the arms interleaved over `--rounds`. Per
step: the wall, the target forward (its plan and then the compiled graph or the eager modules), the
logits and the rest on the host (scheduling, sampling, commits), and, by the native kernel clock
(`runtime.ops.cpu_ops.kernel_clock`, in the same rounds), the time inside the compute kernels (linears,
paged attention, routed experts), which both arms call alike.

With K the kernels, O the rest of the forward and logits (compiled: the graph's own fused kernels,
its wrapper, the plan and the calls; eager: the modules' Python and ATen ops and the plan) and H the
host, the eager / compiled ratio is (K_e + O_e + H_e) / (K_c + O_c + H_c). The table after the
split prints that ratio as the compiled arm's O falls to a half and to 0 and both arms' H to a half
and to 0: how much of the step each term must lose for a target ratio.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tools.step_split import timed  # noqa: E402 - the repository root is on the path from here


class Arm:
    def __init__(self, model: str, dtype: str, width: int, eager: bool) -> None:
        from serving.llm import LLM
        self.name = "eager" if eager else "compiled"
        self.llm = LLM(model, dtype=dtype, max_num_seqs=width, kv_cache_tokens=65536, enforce_eager=eager)
        self.bucket: dict[str, float] = {}
        timed(self.llm.engine.runner, "forward", self.bucket)
        timed(self.llm.engine.runner, "logits", self.bucket)

    def run(self, prompts: list[list[int]], max_tokens: int) -> dict:
        """One round: every prompt added at once, stepped to the end. -> seconds (wall, forward,
        logits, inside the native kernels by their clock) and steps."""
        from runtime.ops import cpu_ops
        from runtime.sample.sampler import SamplingParams
        engine = self.llm.engine
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        self.bucket.clear()
        for p in prompts:
            engine.add_request(p, params)
        steps0 = engine.num_steps
        cpu_ops.kernel_clock(True)
        t0 = time.perf_counter()
        while engine.has_unfinished():
            self.llm.step()
        wall = time.perf_counter() - t0
        kernels = cpu_ops.kernel_clock(False)
        return {"wall": wall, "steps": engine.num_steps - steps0, "forward": self.bucket.get("forward", 0.0),
                "logits": self.bucket.get("logits", 0.0), "kernels": kernels}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="models/tiny-glm-moe")
    ap.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    ap.add_argument("--width", type=int, default=16, help="sequences decoding together")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json-out", type=Path, default=None)
    args = ap.parse_args()
    if args.width < 1 or args.rounds < 1 or args.max_tokens < 2:
        ap.error("--width and --rounds must be at least 1, --max-tokens at least 2")
    path = Path(args.model) / "heldout_prompts.jsonl"
    texts = [json.loads(line)["prompt"] for line in path.read_text().splitlines() if line.strip()]
    if len(texts) < args.width:
        ap.error(f"{path} holds {len(texts)} prompts, fewer than --width {args.width}")
    arms = [Arm(args.model, args.dtype, args.width, eager) for eager in (False, True)]
    prompts = [arms[0].llm.encode(t) for t in texts[:args.width]]
    for arm in arms:
        arm.run(prompts, args.max_tokens)                       # warm-up: compiles, first touches
    runs: dict[str, list[dict]] = {a.name: [] for a in arms}
    for i in range(args.rounds):
        for arm in (arms if i % 2 == 0 else arms[::-1]):
            runs[arm.name].append(arm.run(prompts, args.max_tokens))
    rows = {}
    for name, rs in runs.items():
        per = lambda key: 1000 * statistics.median(r[key] / r["steps"] for r in rs)   # noqa: E731 - ms a step
        step, fwd, logits, k = per("wall"), per("forward"), per("logits"), per("kernels")
        rows[name] = {"step_ms": step, "forward_ms": fwd, "logits_ms": logits, "kernels_ms": k,
                      "other_forward_ms": fwd + logits - k, "host_ms": step - fwd - logits,
                      "steps": rs[0]["steps"]}
    ratio = statistics.median(e["wall"] / c["wall"] for e, c in zip(runs["eager"], runs["compiled"]))
    print(f"{args.dtype}, width {args.width}, {args.max_tokens} tokens, {args.rounds} rounds (medians, ms a step)")
    cols = ["step_ms", "forward_ms", "logits_ms", "kernels_ms", "other_forward_ms", "host_ms"]
    print(f"{'arm':>9} " + " ".join(f"{c:>16}" for c in cols))
    for name, row in rows.items():
        print(f"{name:>9} " + " ".join(f"{row[c]:>16.3f}" for c in cols))
    print(f"eager / compiled: {ratio:.3f} (paired wall, median)")
    c, e = rows["compiled"], rows["eager"]
    bounds = []
    print(f"{'compiled other_forward':>23} {'host (both arms)':>17} {'eager / compiled':>17}")
    for other in (c["other_forward_ms"], 0.5 * c["other_forward_ms"], 0.0):
        for host_share in (1.0, 0.5, 0.0):
            value = ((e["kernels_ms"] + e["other_forward_ms"] + host_share * e["host_ms"])
                     / (c["kernels_ms"] + other + host_share * c["host_ms"]))
            bounds.append({"compiled_other_forward_ms": round(other, 3), "host_share": host_share,
                           "ratio": round(value, 3)})
            print(f"{other:>23.3f} {f'x {host_share:.1f}':>17} {value:>17.3f}")
    if args.json_out:
        args.json_out.write_text(json.dumps({"model": args.model, "dtype": args.dtype, "width": args.width,
                                             "max_tokens": args.max_tokens, "rounds": args.rounds,
                                             "arms": {n: {k2: round(v, 4) if isinstance(v, float) else v
                                                          for k2, v in r.items()} for n, r in rows.items()},
                                             "ratio": round(ratio, 3), "bounds": bounds}, indent=1) + "\n")


if __name__ == "__main__":
    main()
