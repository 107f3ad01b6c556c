"""Our engine's step against vLLM's at the same rows, offline: a wave's prefill and a decode step.

    python tools/step_vs_vllm.py --vllm-python /path/to/vllm-venv/bin/python --dtype float32 \
        --width 16 --input-len 128 --decode 48 --rounds 5 [--json-out R.json]

Each engine is a child process (ours: `LLM`; vLLM's: its `LLM` in its own venv, set up as
bench.vllm_arm runs it: in-process engine core, OpenMP bound to our cores, libiomp5 and tcmalloc
preloaded), built and warmed up once, prefix caching off on both, a token budget that takes the
whole wave in one step on both (`--budget`, vLLM's server default on a CPU: 2048). Per round, each
engine (taking turns, the order swapped every round) generates for `--width` random prompts of
`--input-len` tokens (fresh ones every round, the same for both), greedy, EOS ignored: once one
token (the wave's prefill: one step) and once 1 + `--decode` tokens; the decode step is the
difference over `--decode`. Prints the medians, ms a step, and ours over theirs.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

OURS = """
import json, sys, time
from serving import LLM
from runtime.sample.sampler import SamplingParams
model, dtype, width, budget = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
llm = LLM(model, dtype=dtype, max_num_seqs=max(width, 16), max_num_batched_tokens=budget, prefix_cache=False)
llm.deployment.warm_up()
def run(prompts, n):
    t0 = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(max_tokens=n, ignore_eos=True))
    assert all(len(o.token_ids) == n for o in outs)
    return time.perf_counter() - t0
print("ready", flush=True)
for line in sys.stdin:
    prompts, n = json.loads(line)
    print(json.dumps(run(prompts, n)), flush=True)
"""

THEIRS = """
import json, sys, time
from vllm import LLM, SamplingParams
model, dtype, width, budget = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
llm = LLM(model=model, dtype=dtype, max_num_seqs=max(width, 16), max_num_batched_tokens=budget,
          enable_prefix_caching=False, max_model_len=2048, seed=0, disable_log_stats=True)
def run(prompts, n):
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == n for o in outs)
    return time.perf_counter() - t0
run([[5] * 32] * 2, 4)
print("ready", flush=True)
for line in sys.stdin:
    prompts, n = json.loads(line)
    print(json.dumps(run(prompts, n)), flush=True)
"""


def plot(record: dict, path: Path) -> None:
    """A wave's prefill and a decode step, ms, ours beside vLLM's (dots: rounds)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(8, 3.6))
    for ax, key, label in ((axes[0], "prefill_ms", f"a wave's prefill ({record['width']} x {record['input_len']})"),
                           (axes[1], "decode_ms", f"a decode step ({record['width']} rows)")):
        cell = record["steps"][key]
        for i, name in enumerate(("metrale", "vllm")):
            ax.bar(i, cell[name], 0.6, color=f"C{i}")
            ax.plot([i] * len(cell[f"{name}_runs"]), cell[f"{name}_runs"], "k.", ms=4)
        ax.set_xticks([0, 1], ["metrale", "vLLM"])
        ax.set(ylabel="ms (median)", title=f"{label}\nours / theirs {cell['ours_over_theirs']:.2f}x")
        ax.set_ylim(bottom=0)
    fig.suptitle(f"{record['dtype']}, offline, {record['rounds']} rounds (load {record['load'][0]:.1f})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(ROOT / "models" / "tiny-glm-moe"))
    ap.add_argument("--vllm-python", required=True)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--width", type=int, default=16)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--decode", type=int, default=48)
    ap.add_argument("--budget", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json-out", type=Path, default=None)
    ap.add_argument("--plot-out", type=Path, default=None)
    args = ap.parse_args()
    if min(args.width, args.input_len, args.decode, args.rounds) < 1 or args.budget < args.width * args.input_len:
        ap.error("--width, --input-len, --decode and --rounds at least 1; --budget must take the whole wave")
    from bench.vllm_arm import child_env
    model = str(Path(args.model).resolve())
    argv = [model, args.dtype, str(args.width), str(args.budget)]
    procs = {"metrale": subprocess.Popen([sys.executable, "-c", OURS, *argv], cwd=ROOT, text=True,
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE),
             "vllm": subprocess.Popen([args.vllm_python, "-c", THEIRS, *argv], text=True, stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                      env=child_env(args.vllm_python, args.threads))}
    for name, p in procs.items():
        while (line := p.stdout.readline()) and line.strip() != "ready":
            pass
        if not line:
            raise SystemExit(f"{name}'s child failed to start")
    rng = random.Random(0)

    def timed(name: str, prompts: list[list[int]], n: int) -> float:
        procs[name].stdin.write(json.dumps([prompts, n]) + "\n")
        procs[name].stdin.flush()
        return json.loads(procs[name].stdout.readline())
    runs = {name: [] for name in procs}
    for r in range(-1, args.rounds):            # round -1: a warm-up of these shapes, not kept
        waves = [[[rng.randrange(100, 4000) for _ in range(args.input_len)] for _ in range(args.width)]
                 for _ in range(2)]
        for name in (("metrale", "vllm") if r % 2 == 0 else ("vllm", "metrale")):
            prefill = timed(name, waves[0], 1)
            both = timed(name, waves[1], 1 + args.decode)
            if r >= 0:
                runs[name].append({"prefill_ms": 1000 * prefill, "decode_ms": 1000 * (both - prefill) / args.decode})
    for p in procs.values():
        p.stdin.close()
        p.wait(timeout=120)
    out = {}
    print(f"{args.dtype}: {args.width} prompts of {args.input_len} tokens (one prefill step), then {args.decode} "
          f"decode steps of {args.width} rows; {args.rounds} rounds, medians, ms a step")
    for key in ("prefill_ms", "decode_ms"):
        ours, theirs = (statistics.median(x[key] for x in runs[n]) for n in ("metrale", "vllm"))
        paired = statistics.median(a[key] / b[key] for a, b in zip(runs["metrale"], runs["vllm"]))
        out[key] = {"metrale": round(ours, 3), "vllm": round(theirs, 3), "ours_over_theirs": round(paired, 3),
                    "metrale_runs": [round(x[key], 3) for x in runs["metrale"]],
                    "vllm_runs": [round(x[key], 3) for x in runs["vllm"]]}
        print(f"  {key:10s} metrale {ours:8.2f}  vllm {theirs:8.2f}  ours / theirs {paired:.3f} (paired)")
    from bench.report import machine
    record = {"tool": "step_vs_vllm", **{k: v for k, v in vars(args).items()
                                         if k not in ("json_out", "plot_out", "vllm_python")},
              "load": os.getloadavg(), "machine": machine(), "steps": out}
    if args.json_out:
        args.json_out.write_text(json.dumps(record, indent=1) + "\n")
    if args.plot_out:
        plot(record, args.plot_out)


if __name__ == "__main__":
    main()
