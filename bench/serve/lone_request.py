"""A lone request through `metrale serve` against the same request through `LLM.generate`.

    python -m bench.serve.lone_request --model models/tiny-glm-moe --dtypes bfloat16,float32 \
        --max-tokens 200 --repeats 7 --json-out R.json --plot-out R.png

Per dtype: one `metrale serve` process and one offline process (an `LLM` built, warmed up and
driven on its main thread, as `metrale generate` does), both started and warmed before anything
is timed. Then they take turns, one request at a time (never both busy, the order swapped every
repeat): the offline process runs `LLM.generate` on the prompt; the server gets the same prompt
as token ids, non-streaming, greedy, EOS ignored. tok/s is output tokens over the wall time of
the call (the HTTP round trip included for the server). The record keeps every run, the medians
and the best runs; `ratio` is the server's median over the offline median, `best_ratio` the same
of the best runs (interference from other processes only ever slows a run, so on a shared machine
the best run is the quiet machine's figure). `--baseline-tree DIR` adds a third arm in the same
rotation: a server started from another source tree (e.g. `git archive OLD | tar -x -C DIR`).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.request
from datetime import datetime, timezone
from pathlib import Path

PROMPT = [17, 230, 41, 998, 5, 77, 1024, 300, 12, 64, 2048, 9, 150, 511, 33, 400]   # ids of the embedded model's vocabulary

OFFLINE_CHILD = """
import json, sys, time
from serving import LLM
from runtime.sample.sampler import SamplingParams
model, dtype, max_tokens, prompt = sys.argv[1], sys.argv[2], int(sys.argv[3]), json.loads(sys.argv[4])
llm = LLM(model, dtype=dtype)
llm.deployment.warm_up()
params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
llm.generate(prompt, params)
print("ready", flush=True)
for line in sys.stdin:
    t0 = time.perf_counter()
    out = llm.generate(prompt, params)[0]
    wall = time.perf_counter() - t0
    print(json.dumps({"tokens": len(out.token_ids), "wall_s": wall}), flush=True)
"""


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(base: str, body: dict) -> dict:
    req = urllib.request.Request(base + "/v1/completions", data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())


def start_server(model: str, dtype: str, extra: list[str], tree: Path | None = None) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(tree)) if tree is not None else None
    proc = subprocess.Popen([sys.executable, "-m", "launch", "serve", "--model", str(Path(model).resolve()),
                             "--dtype", dtype, "--port", str(port), "--served-model-name", "lone", *extra],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=tree, env=env)
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 600
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited: {proc.stderr.read()[-2000:]}")
        try:
            urllib.request.urlopen(base + "/health", timeout=2)
            return proc, base
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError("the server did not answer /health within 600 s")


def measure(model: str, dtype: str, max_tokens: int, repeats: int, extra: list[str],
            baseline: Path | None = None) -> dict:
    offline = subprocess.Popen([sys.executable, "-c", OFFLINE_CHILD, model, dtype, str(max_tokens), json.dumps(PROMPT)],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                               env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    servers = {"server": start_server(model, dtype, extra)}
    try:
        if baseline is not None:
            servers["baseline"] = start_server(model, dtype, extra, baseline)
        if offline.stdout.readline().strip() != "ready":
            raise RuntimeError("the offline process failed to start")
        body = {"model": "lone", "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
        for _, base in servers.values():
            post(base, body)   # each server's first request (its warm-up compiled the step already)
        runs: dict[str, list[float]] = {"generate": [], **{name: [] for name in servers}}
        arms = list(runs)
        for r in range(repeats):
            for arm in arms[r % len(arms):] + arms[:r % len(arms)]:
                if arm == "generate":
                    offline.stdin.write("go\n")
                    offline.stdin.flush()
                    got = json.loads(offline.stdout.readline())
                    runs[arm].append(got["tokens"] / got["wall_s"])
                else:
                    t0 = time.perf_counter()
                    out = post(servers[arm][1], body)
                    runs[arm].append(out["usage"]["completion_tokens"] / (time.perf_counter() - t0))
    finally:
        offline.kill()
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(timeout=60)
    row = {"dtype": dtype}
    g, g_best = statistics.median(runs["generate"]), max(runs["generate"])
    for arm, xs in runs.items():
        row[f"{arm}_tok_s"], row[f"{arm}_best_tok_s"] = round(statistics.median(xs), 1), round(max(xs), 1)
        row[f"{arm}_runs"] = [round(x, 1) for x in xs]
        if arm != "generate":
            prefix = "" if arm == "server" else f"{arm}_"
            row[f"{prefix}ratio"] = round(statistics.median(xs) / g, 3)
            row[f"{prefix}best_ratio"] = round(max(xs) / g_best, 3)
    print(f"{dtype}: " + "; ".join(f"{arm} median {row[f'{arm}_tok_s']:.0f} best {row[f'{arm}_best_tok_s']:.0f} tok/s"
                                   for arm in runs)
          + f"; server / generate {row['ratio']:.3f} (best {row['best_ratio']:.3f})"
          + (f", baseline / generate {row['baseline_ratio']:.3f} (best {row['baseline_best_ratio']:.3f})"
             if "baseline" in runs else "")
          + "\n  runs: " + "; ".join(f"{arm} {[round(x) for x in xs]}" for arm, xs in runs.items()), flush=True)
    return row


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    xs = range(len(rows))
    arms = [a for a in ("generate", "server", "baseline") if f"{a}_tok_s" in rows[0]]
    labels = {"generate": "LLM.generate", "server": "metrale serve", "baseline": "metrale serve (baseline tree)"}
    width = 0.8 / len(arms)
    for i, arm in enumerate(arms):
        at = [x - 0.4 + width * (i + 0.5) for x in xs]
        ax.bar(at, [r[f"{arm}_tok_s"] for r in rows], width, label=labels[arm])
        if arm != "generate":
            key = "ratio" if arm == "server" else f"{arm}_ratio"
            for x, r in zip(at, rows):
                ax.text(x, r[f"{arm}_tok_s"], f"{r[key]:.2f}x", ha="center", va="bottom")
    ax.set_xticks(list(xs), [r["dtype"] for r in rows])
    ax.set(ylabel="output tokens/s (median)", title=title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.serve.lone_request", description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--dtypes", default="bfloat16,float32")
    p.add_argument("--max-tokens", type=int, default=200)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--server-args", default="", help="more `metrale serve` arguments, space separated")
    p.add_argument("--baseline-tree", type=Path, default=None, metavar="DIR",
                   help="also serve from this source tree, in the same rotation")
    p.add_argument("--json-out", type=Path, default=None)
    p.add_argument("--plot-out", type=Path, default=None)
    args = p.parse_args(argv)
    if args.repeats < 1 or args.max_tokens < 1:
        p.error("--repeats and --max-tokens must be at least 1")
    from bench.report import check_provenance, machine, provenance
    start = provenance()
    if args.baseline_tree is not None and not (args.baseline_tree / "launch").is_dir():
        p.error(f"--baseline-tree {args.baseline_tree}: no launch/ there (not a metrale source tree)")
    rows = [measure(args.model, d.strip(), args.max_tokens, args.repeats, args.server_args.split(),
                    args.baseline_tree.resolve() if args.baseline_tree else None)
            for d in args.dtypes.split(",")]
    record = {"workload": "lone_request", "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "model": args.model, "max_tokens": args.max_tokens, "repeats": args.repeats, "prompt_tokens": len(PROMPT),
              "machine": machine(), **start, "rows": rows, **check_provenance(start)}
    if args.json_out is not None:
        args.json_out.write_text(json.dumps(record, indent=1) + "\n")
    if args.plot_out is not None:
        plot(rows, args.plot_out, f"a lone request, {args.max_tokens} tokens, EOS ignored (median)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
