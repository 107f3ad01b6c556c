"""What a `--dp-attention` deployment admits at once, counted, not timed: the sequences running
together, the preemptions and the KV tokens rank 0's scheduler may hand out, for a workload that
needs more KV than one rank's pool.

    python tools/dp_capacity.py --json-out bench/records/dp_capacity_SHA.json --plot-out bench/records/dp_capacity_SHA.png
    python tools/dp_capacity.py --tree /path/to/an/older/checkout ...   # that checkout's code instead

Each rank is given the same KV pool (`--kv-cache-tokens`). With a pool a rank (docs/design.md
§4.3) the scheduler counts every rank's pool; before it (every rank held every sequence's cells)
it counted one. The workload: `--requests` requests of a `--prompt`-token prompt and `--max-tokens`
output tokens, MTP 3 drafts, all submitted at once (max_num_seqs = the requests), stepped to the
end; per step the running sequences are counted.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "models" / "tiny-glm-moe"


def count(ep: int, kv_tokens: int, requests: int, prompt: int, max_tokens: int) -> dict:
    from launch.mp import MPGroup
    from runtime.sample.sampler import SamplingParams
    from serving.llm import LLM
    llm = LLM(MODEL, dtype="float32", ep=ep, dp_attention=True, launcher=MPGroup, enforce_eager=True,
              warm_standby=False, max_num_seqs=requests, spec="mtp", num_drafts=3, draft_policy="fixed",
              mtp_max_seqs=requests, kv_cache_tokens=kv_tokens, prefix_cache=False)
    try:
        engine = llm.engine
        cache = engine.runner.cache
        seqs = [engine.add_request([(7 * i + j) % 300 + 1 for j in range(prompt)],
                                   SamplingParams(max_tokens=max_tokens, ignore_eos=True)) for i in range(requests)]
        running, steps = [], 0
        while engine.has_unfinished():
            llm.step()
            steps += 1
            running.append(len(engine.scheduler.running))
        blocks = getattr(cache, "total_blocks", cache.num_blocks)   # every pool's, or the one pool's
        return {"ep": ep, "kv_cache_tokens_per_rank": kv_tokens, "requests": requests, "prompt": prompt,
                "max_tokens": max_tokens, "schedulable_kv_tokens": blocks * cache.block_size,
                "max_running": max(running), "mean_running": round(sum(running) / len(running), 2),
                "preemptions": engine.scheduler.num_preemptions, "steps": steps,
                "output_tokens": sum(s.num_output for s in seqs),
                "kv_pools": getattr(cache, "num_pools", 1)}
    finally:
        llm.shutdown()


def plot(records: dict[str, list[dict]], path: str) -> None:
    """Sequences running together per EP size and tree, and the KV tokens scheduled."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    names = list(records)
    eps = sorted({c["ep"] for cells in records.values() for c in cells})
    width = 0.8 / len(names)
    for k, name in enumerate(names):
        by_ep = {c["ep"]: c for c in records[name]}
        xs = [i + k * width for i in range(len(eps))]
        axes[0].bar(xs, [by_ep[e]["max_running"] for e in eps], width, label=name)
        axes[1].bar(xs, [by_ep[e]["schedulable_kv_tokens"] for e in eps], width, label=name)
    for ax, title in zip(axes, ("most sequences running together", "KV tokens the scheduler hands out")):
        ax.set_xticks([i + width * (len(names) - 1) / 2 for i in range(len(eps))], [f"EP {e}" for e in eps])
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ep", default="2")
    p.add_argument("--kv-cache-tokens", type=int, default=1024, help="each rank's KV pool")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--prompt", type=int, default=100)
    p.add_argument("--max-tokens", type=int, default=28)
    p.add_argument("--tree", default=None, help="import the code of this checkout (an older one, for a before)")
    p.add_argument("--name", default="this tree", help="the record's name for the tree counted")
    p.add_argument("--json-out", required=True, help="written, or extended with this tree's cells")
    p.add_argument("--plot-out", default=None)
    args = p.parse_args(argv)
    sys.path.insert(0, str(Path(args.tree).resolve() if args.tree else ROOT))
    out = Path(args.json_out)
    record = json.loads(out.read_text()) if out.exists() else {"model": "models/tiny-glm-moe", "dtype": "float32",
                                                               "commands": [], "trees": {}}
    cells = [count(int(ep), args.kv_cache_tokens, args.requests, args.prompt, args.max_tokens)
             for ep in args.ep.split(",")]
    for c in cells:
        print(json.dumps(c), flush=True)
    record["commands"].append(" ".join(sys.argv))
    record["trees"][args.name] = cells
    out.write_text(json.dumps(record, indent=1))
    if args.plot_out:
        plot(record["trees"], args.plot_out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
