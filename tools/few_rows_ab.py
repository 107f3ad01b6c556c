"""The few-row kernel's row limit as a setting: a decode step's ms at given widths, per limit.

    python tools/few_rows_ab.py --model models/tiny-glm-moe --dtype float32 --limits 8,16,32 --widths 16,24,32

`runtime.ops.cpu_ops.few_rows_max` sends a GEMM of at most that many rows to the native few-row
kernel and more to MKL / oneDNN; the compiled step reads it as a constant, so each limit is a
process of its own (a child of this one, its table set before a step compiles), built and
warmed up once. Per round, every child decodes each width in turn (that many held-out prompts
added at once, greedy, `--max-tokens` each, EOS ignored); the children take turns (the order
swapped every round), never two at once. Per limit and width: the median over rounds of the
decode steps' ms (the steps after every prompt has its first token) and of the ms inside the
native kernels (linears, attention, routed experts: `cpu_ops.kernel_clock`), the prefill's ms
(the steps until every prompt has its first token: one step while the prompts fit the 1,024-token
budget), and each limit's paired ratios to the first one.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def child(model: str, dtype: str, limit: int) -> None:
    """Serve rounds on stdin (a JSON list of widths) with the few-row limit `limit` for `dtype`."""
    import torch

    from runtime.ops import cpu_ops
    from runtime.sample.sampler import SamplingParams
    from serving.llm import LLM
    if not cpu_ops.load():
        raise SystemExit(f"the native CPU ops did not load: {cpu_ops._state.get('error')}")
    cpu_ops.FEW_ROWS[getattr(torch, dtype)] = limit     # read as a constant by the compiled step
    llm = LLM(model, dtype=dtype, max_num_seqs=64, kv_cache_tokens=65536, prefix_cache=False)
    assert cpu_ops.few_rows_max(getattr(torch, dtype)) == limit, cpu_ops.FEW_ROWS
    llm.deployment.warm_up()
    engine = llm.engine
    texts = [json.loads(line)["prompt"] for line in (Path(model) / "heldout_prompts.jsonl").read_text().splitlines()
             if line.strip()]
    ids = [llm.encode(t) for t in texts]
    print("ready", flush=True)
    for line in sys.stdin:
        widths, max_tokens = json.loads(line)
        out = {}
        for w in widths:
            params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
            seqs = [engine.add_request(ids[i % len(ids)], params) for i in range(w)]
            steps0, t0 = engine.num_steps, time.perf_counter()
            while any(s.num_output == 0 for s in seqs):
                llm.step()
            prefill, prefill_steps = time.perf_counter() - t0, engine.num_steps - steps0
            steps0 = engine.num_steps
            cpu_ops.kernel_clock(True)
            t0 = time.perf_counter()
            while engine.has_unfinished():
                llm.step()
            wall = time.perf_counter() - t0
            kernels = cpu_ops.kernel_clock(False)
            steps = engine.num_steps - steps0
            out[str(w)] = {"step_ms": 1000 * wall / steps, "kernels_ms": 1000 * kernels / steps, "steps": steps,
                           "prefill_ms": 1000 * prefill, "prefill_steps": prefill_steps,
                           "prefill_tokens": sum(len(ids[i % len(ids)]) for i in range(w))}
        print(json.dumps(out), flush=True)


def plot(record: dict, path: Path) -> None:
    """Decode step ms by width, a line per limit (dots: rounds)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    for limit in record["limits"]:
        rows = [r for r in record["rows"] if r["limit"] == limit]
        line, = ax.plot([r["width"] for r in rows], [r["step_ms"] for r in rows], "o-",
                        label=f"limit {limit if limit < 1 << 20 else 'all rows'}")
        for r in rows:
            ax.plot([r["width"]] * len(r["step_ms_runs"]), r["step_ms_runs"], ".", color=line.get_color(), ms=3)
    ax.set(xlabel="decode width (rows a step)", ylabel="ms a decode step (median)",
           title=f"{record['dtype']}: few-row kernel limit, {record['rounds']} rounds (load {record['load'][0]:.1f})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="models/tiny-glm-moe")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--limits", default="8,16,32", help="comma list of few-row limits (the first: the ratios' base)")
    ap.add_argument("--widths", default="16,24,32", help="comma list of decode widths")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json-out", type=Path, default=None)
    ap.add_argument("--plot-out", type=Path, default=None)
    ap.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        return child(args.model, args.dtype, args.child)
    limits = [int(x) for x in args.limits.split(",")]
    widths = [int(x) for x in args.widths.split(",")]
    if min(limits) < 0 or min(widths) < 1 or args.rounds < 1 or args.max_tokens < 2:
        ap.error("limits at least 0, widths and --rounds at least 1, --max-tokens at least 2")
    procs = {}
    for limit in limits:    # one at a time: each compiles alone
        procs[limit] = subprocess.Popen([sys.executable, __file__, "--model", args.model, "--dtype", args.dtype,
                                         "--child", str(limit)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        text=True, cwd=ROOT)
        if procs[limit].stdout.readline().strip() != "ready":
            raise SystemExit(f"the child with limit {limit} failed to start")
    def one_round(limit: int) -> dict:
        procs[limit].stdin.write(json.dumps([widths, args.max_tokens]) + "\n")
        procs[limit].stdin.flush()
        return json.loads(procs[limit].stdout.readline())
    for limit in limits:
        one_round(limit)                                        # warm-up: first touches of every width
    runs = {limit: [] for limit in limits}
    for r in range(args.rounds):
        for limit in (limits if r % 2 == 0 else limits[::-1]):
            runs[limit].append(one_round(limit))
    for p in procs.values():
        p.stdin.close()
        p.wait(timeout=120)
    rows = []
    print(f"{args.dtype}, decode steps, {args.max_tokens} tokens, {args.rounds} rounds (medians, ms a step)")
    print(f"{'limit':>10} {'width':>6} {'step_ms':>9} {'kernels_ms':>11} {'vs first':>9} {'prefill_ms':>11} {'vs first':>9}")
    for limit in limits:
        for w in map(str, widths):
            step = statistics.median(x[w]["step_ms"] for x in runs[limit])
            kern = statistics.median(x[w]["kernels_ms"] for x in runs[limit])
            ratio = statistics.median(a[w]["step_ms"] / b[w]["step_ms"] for a, b in zip(runs[limit], runs[limits[0]]))
            pre = statistics.median(x[w]["prefill_ms"] for x in runs[limit])
            pre_ratio = statistics.median(a[w]["prefill_ms"] / b[w]["prefill_ms"]
                                          for a, b in zip(runs[limit], runs[limits[0]]))
            rows.append({"limit": limit, "width": int(w), "step_ms": round(step, 3), "kernels_ms": round(kern, 3),
                         "step_vs_first": round(ratio, 3),
                         "step_ms_runs": [round(x[w]["step_ms"], 3) for x in runs[limit]],
                         "prefill_ms": round(pre, 3), "prefill_vs_first": round(pre_ratio, 3),
                         "prefill_steps": runs[limit][0][w]["prefill_steps"],
                         "prefill_tokens": runs[limit][0][w]["prefill_tokens"]})
            print(f"{limit:>10} {w:>6} {step:>9.3f} {kern:>11.3f} {ratio:>9.3f} {pre:>11.3f} {pre_ratio:>9.3f}")
    import os

    from bench.report import machine
    record = {"tool": "few_rows_ab", "model": args.model, "dtype": args.dtype, "limits": limits, "widths": widths,
              "max_tokens": args.max_tokens, "rounds": args.rounds, "load": os.getloadavg(), "machine": machine(),
              "rows": rows}
    if args.json_out:
        args.json_out.write_text(json.dumps(record, indent=1) + "\n")
    if args.plot_out:
        plot(record, args.plot_out)


if __name__ == "__main__":
    main()
