"""Where a wave's prefill step goes, by op: torch.profiler's self CPU time over the compiled step.

    python tools/prefill_ops.py --dtype float32 --width 16 --input-len 128 --rounds 3 [--json-out R.json]

`--width` random prompts of `--input-len` tokens prefilled in one step (the token budget set to
take them all, as vLLM's server takes a wave of 16 x 128 in one 2,048-token step), one output
token each, `--rounds` times after a warm-up; prints the wall time a wave and the ops with the
most self CPU time (the native linears, routed experts and attention, MKL's GEMMs, the compiled
graph's own kernels) as ms a wave.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def plot(record: dict, path: Path) -> None:
    """The ops' self time a wave, the most first."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    ops = record["ops"][::-1]
    fig, ax = plt.subplots(figsize=(8, 0.3 * len(ops) + 1.2))
    ax.barh(range(len(ops)), [o["self_ms_per_wave"] for o in ops])
    ax.set_yticks(range(len(ops)), [o["op"][:48] for o in ops], fontsize=7)
    wall = sorted(record["wall_ms"])[len(record["wall_ms"]) // 2]
    ax.set(xlabel="self CPU ms a wave", title=f"{record['dtype']}: {record['width']} x {record['input_len']} tokens "
                                             f"in one step, {wall:.0f} ms a wave under the profiler")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(ROOT / "models" / "tiny-glm-moe"))
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--width", type=int, default=16)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--json-out", type=Path, default=None)
    ap.add_argument("--plot-out", type=Path, default=None)
    args = ap.parse_args()
    if min(args.width, args.input_len, args.rounds, args.top) < 1:
        ap.error("--width, --input-len, --rounds and --top must be at least 1")
    import torch

    from runtime.sample.sampler import SamplingParams
    from serving import LLM
    budget = args.width * args.input_len
    llm = LLM(args.model, dtype=args.dtype, max_num_seqs=max(args.width, 16), max_num_batched_tokens=budget,
              prefix_cache=False)
    llm.deployment.warm_up()
    rng = random.Random(0)
    params = SamplingParams(max_tokens=1, ignore_eos=True)

    def wave() -> list[list[int]]:
        return [[rng.randrange(100, 4000) for _ in range(args.input_len)] for _ in range(args.width)]
    llm.generate(wave(), params)                                      # warm-up of this shape
    walls = []
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(args.rounds):
            prompts = wave()
            t0 = time.perf_counter()
            llm.generate(prompts, params)
            walls.append(time.perf_counter() - t0)
    rows = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:args.top]
    table = [{"op": e.key, "calls_per_wave": e.count / args.rounds,
              "self_ms_per_wave": round(e.self_cpu_time_total / 1000 / args.rounds, 3)} for e in rows]
    print(f"{args.dtype}: {args.width} x {args.input_len} tokens in one step, {args.rounds} rounds under the "
          f"profiler: {1000 * sorted(walls)[len(walls) // 2]:.1f} ms a wave (median wall)")
    for t in table:
        print(f"  {t['self_ms_per_wave']:9.2f} ms  {t['calls_per_wave']:7.1f} calls  {t['op']}")
    from bench.report import machine
    record = {"tool": "prefill_ops", **{k: v for k, v in vars(args).items() if k not in ("json_out", "plot_out")},
              "wall_ms": [round(1000 * w, 2) for w in walls], "machine": machine(), "ops": table}
    if args.json_out:
        args.json_out.write_text(json.dumps(record, indent=1) + "\n")
    if args.plot_out:
        plot(record, args.plot_out)


if __name__ == "__main__":
    main()
