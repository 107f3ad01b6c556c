"""A lone request through `metrale serve` against the same request through `LLM.generate`.

    python -m bench.lone_request --model models/tiny-glm-moe --dtypes bfloat16,float32 \
        --max-tokens 200 --repeats 7 --json-out R.json --plot-out R.png

Per dtype: one `metrale serve` process and one offline process (an `LLM` built, warmed up and
driven on its main thread, as `metrale generate` does), both started and warmed before anything
is timed. Then they take turns, one request at a time (never both busy, the order swapped every
repeat): the offline process runs `LLM.generate` on the prompt; the server gets the same prompt
as token ids, non-streaming, greedy, EOS ignored. tok/s is output tokens over the wall time of
the call (the HTTP round trip included for the server). The record keeps every run and the
medians; `ratio` is the server's median over the offline median.
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
from runtime.sampler import SamplingParams
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


def start_server(model: str, dtype: str, extra: list[str]) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "launch", "serve", "--model", model, "--dtype", dtype,
                             "--port", str(port), "--served-model-name", "lone", *extra],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
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


def measure(model: str, dtype: str, max_tokens: int, repeats: int, extra: list[str]) -> dict:
    offline = subprocess.Popen([sys.executable, "-c", OFFLINE_CHILD, model, dtype, str(max_tokens), json.dumps(PROMPT)],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                               env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    server, base = start_server(model, dtype, extra)
    try:
        if offline.stdout.readline().strip() != "ready":
            raise RuntimeError("the offline process failed to start")
        body = {"model": "lone", "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
        post(base, body)   # the server's first request (its warm-up compiled the step already)
        gen, srv = [], []
        for r in range(repeats):
            for arm in (("generate", "server") if r % 2 == 0 else ("server", "generate")):
                if arm == "generate":
                    offline.stdin.write("go\n")
                    offline.stdin.flush()
                    got = json.loads(offline.stdout.readline())
                    gen.append(got["tokens"] / got["wall_s"])
                else:
                    t0 = time.perf_counter()
                    out = post(base, body)
                    srv.append(out["usage"]["completion_tokens"] / (time.perf_counter() - t0))
    finally:
        offline.kill()
        server.terminate()
        server.wait(timeout=60)
    g, s = statistics.median(gen), statistics.median(srv)
    print(f"{dtype}: LLM.generate {g:.0f} tok/s, server {s:.0f} tok/s, server / generate {s / g:.3f} "
          f"(runs: generate {[round(x) for x in gen]}, server {[round(x) for x in srv]})", flush=True)
    return {"dtype": dtype, "generate_tok_s": round(g, 1), "server_tok_s": round(s, 1), "ratio": round(s / g, 3),
            "generate_runs": [round(x, 1) for x in gen], "server_runs": [round(x, 1) for x in srv]}


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r["generate_tok_s"] for r in rows], 0.4, label="LLM.generate")
    ax.bar([x + 0.2 for x in xs], [r["server_tok_s"] for r in rows], 0.4, label="metrale serve")
    for x, r in zip(xs, rows):
        ax.text(x + 0.2, r["server_tok_s"], f"{r['ratio']:.2f}x", ha="center", va="bottom")
    ax.set_xticks(list(xs), [r["dtype"] for r in rows])
    ax.set(ylabel="output tokens/s (median)", title=title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.lone_request", description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--dtypes", default="bfloat16,float32")
    p.add_argument("--max-tokens", type=int, default=200)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--server-args", default="", help="more `metrale serve` arguments, space separated")
    p.add_argument("--json-out", type=Path, default=None)
    p.add_argument("--plot-out", type=Path, default=None)
    args = p.parse_args(argv)
    if args.repeats < 1 or args.max_tokens < 1:
        p.error("--repeats and --max-tokens must be at least 1")
    from bench.report import check_provenance, machine, provenance
    start = provenance()
    rows = [measure(args.model, d.strip(), args.max_tokens, args.repeats, args.server_args.split())
            for d in args.dtypes.split(",")]
    record = {"workload": "lone_request", "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "model": args.model, "max_tokens": args.max_tokens, "repeats": args.repeats, "prompt_tokens": len(PROMPT),
              "machine": machine(), **start, "rows": rows, **check_provenance(start)}
    if args.json_out is not None:
        args.json_out.write_text(json.dumps(record, indent=1) + "\n")
    if args.plot_out is not None:
        plot(rows, args.plot_out, f"a lone request, {args.max_tokens} tokens, EOS ignored")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
