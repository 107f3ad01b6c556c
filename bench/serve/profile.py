"""Where a served token's time goes: the server's step loop against `LLM.generate`, per token.

    python -m bench.serve.profile --model models/tiny-glm-moe --dtype bfloat16 --max-tokens 200 \
        --repeats 5 --concurrency 1 [--stream] [--json-out R.json] [--plot-out R.png]
    python -m launch.serve_profile --ep 2 ...     # an EP group (mp launcher; rank 0 is this process)

One process: an `LLM` is built and warmed up on the main thread; `LLM.generate` runs the request
`--repeats` times (the offline arm), then the same thread serves (`serving.server.serve`) while a
client process sends the same requests (`--concurrency` at a time, each `--repeats` times) and
then ends the server with SIGTERM. For each arm, per output token: the wall time, the time the
engine thread spent inside `Deployment.step` and outside it (the server's loop: inbox, updates,
metrics), the CPU time of the engine thread, of the HTTP (event loop) thread and of the other
threads (OpenMP workers), their context switches (voluntary: a thread that waited and was woken;
involuntary: a thread preempted), and how many cross-thread hand-offs the engine thread made
(deliveries run on the event loop, each one a wakeup of its thread).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from bench.serve.lone_request import PROMPT, free_port

CLIENT = r"""
import json, sys, time, urllib.request, threading
base, body, conc, repeats, stream = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5] == "1"
for _ in range(600):
    try:
        urllib.request.urlopen(base + "/health", timeout=2); break
    except OSError:
        time.sleep(0.2)
def one():
    req = urllib.request.Request(base + "/v1/completions", data=json.dumps({**body, "stream": stream}).encode(),
                                 method="POST", headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        r.read()
one()                                                   # the server's first request, not counted
print("go", flush=True)
sys.stdin.readline()
walls = []
for _ in range(repeats):
    t0 = time.perf_counter()
    ts = [threading.Thread(target=one) for _ in range(conc)]
    [t.start() for t in ts]; [t.join() for t in ts]
    walls.append(time.perf_counter() - t0)
print(json.dumps(walls), flush=True)
"""


def thread_stats() -> dict[int, tuple[float, int, int]]:
    """tid -> (CPU seconds, voluntary, involuntary context switches), every thread of this process."""
    out = {}
    tick = os.sysconf("SC_CLK_TCK")
    for tid in os.listdir("/proc/self/task"):
        try:
            stat = Path(f"/proc/self/task/{tid}/stat").read_text()
            status = Path(f"/proc/self/task/{tid}/status").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        cpu = (int(fields[11]) + int(fields[12])) / tick
        sw = {k: int(v) for k, v in (line.split(":") for line in status.splitlines() if "ctxt_switches" in line)}
        out[int(tid)] = (cpu, sw["voluntary_ctxt_switches"], sw["nonvoluntary_ctxt_switches"])
    return out


def split(before: dict, after: dict, groups: dict[str, int]) -> dict[str, tuple[float, int, int]]:
    """Per named thread (tid) and 'other' (every other thread): CPU s, voluntary, involuntary switches."""
    named = {tid: name for name, tid in groups.items()}
    acc = {name: [0.0, 0, 0] for name in (*groups, "other")}
    for tid, (cpu, vol, inv) in after.items():
        b = before.get(tid, (0.0, 0, 0))
        row = acc[named.get(tid, "other")]
        row[0] += cpu - b[0]
        row[1] += vol - b[1]
        row[2] += inv - b[2]
    return {k: tuple(v) for k, v in acc.items()}


class StepClock:
    """Wraps `deployment.step` (an instance attribute, this process only): time inside it."""

    def __init__(self, deployment) -> None:
        self.inside = 0.0
        self.steps = 0
        inner = deployment.step

        def timed(engine):
            t0 = time.perf_counter()
            try:
                return inner(engine)
            finally:
                self.inside += time.perf_counter() - t0
                self.steps += 1
        deployment.step = timed


def per_token(name: str, tokens: int, wall: float, clock: StepClock, inside0: float, steps0: int,
              stats: dict, handoffs: int) -> dict:
    us = lambda s: round(s / tokens * 1e6, 1)   # noqa: E731
    row = {"arm": name, "tokens": tokens, "tok_s": round(tokens / wall, 1), "wall_us": us(wall),
           "steps": clock.steps - steps0, "step_us": us(clock.inside - inside0),
           "handoffs_per_token": round(handoffs / tokens, 3)}
    for thread, (cpu, vol, inv) in stats.items():
        row[f"{thread}_cpu_us"] = us(cpu)
        row[f"{thread}_wakeups_per_token"] = round(vol / tokens, 3)
        row[f"{thread}_preempted_per_token"] = round(inv / tokens, 3)
    return row


def plot(rows: list[dict], path: Path, title: str) -> None:
    """Per output token: wall time, time inside the step, CPU per thread (bars), hand-offs (text)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    keys = [("wall_us", "wall"), ("step_us", "inside step"), ("engine_cpu_us", "engine thread CPU"),
            ("other_cpu_us", "OpenMP workers CPU"), ("http_cpu_us", "event loop thread CPU")]
    fig, ax = plt.subplots(figsize=(8, 4))
    for i, row in enumerate(rows):
        xs = [j + (i - 0.5) * 0.4 for j in range(len(keys))]
        ax.bar(xs, [row.get(k, 0) for k, _ in keys], 0.4,
               label=f"{'LLM.generate' if row['arm'] == 'generate' else 'metrale serve'} ({row['tok_s']:.0f} tok/s, "
                     f"{row['handoffs_per_token']:.3f} loop wakeups a token)")
    ax.set_xticks(range(len(keys)), [label for _, label in keys], fontsize=8)
    ax.set(ylabel="microseconds per output token", title=title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None, launcher=None) -> int:
    """`launcher`: what `LLM` starts the EP group's worker ranks with (needed for --ep > 1)."""
    p = argparse.ArgumentParser(prog="python -m bench.serve.profile", description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-tokens", type=int, default=200)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--stream", action="store_true")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel ranks (rank 0, this process, serves)")
    p.add_argument("--json-out", type=Path, default=None)
    p.add_argument("--plot-out", type=Path, default=None)
    args = p.parse_args(argv)
    if min(args.repeats, args.max_tokens, args.concurrency, args.ep) < 1:
        p.error("--repeats, --max-tokens, --concurrency and --ep must be at least 1")
    if args.ep > 1 and launcher is None:
        p.error("--ep > 1 needs a launcher: run python -m launch.serve_profile")

    import torch

    from runtime.sample.sampler import SamplingParams
    from serving import LLM
    from serving import async_engine
    from serving.server import ServerConfig, serve

    llm = LLM(args.model, dtype=args.dtype, ep=args.ep, launcher=launcher)
    llm.deployment.warm_up()
    clock = StepClock(llm.deployment)
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    prompts = [PROMPT] * args.concurrency
    llm.generate(prompts, params)
    me = threading.get_native_id()

    # offline arm
    before, inside0, steps0 = thread_stats(), clock.inside, clock.steps
    t0 = time.perf_counter()
    tokens = 0
    for _ in range(args.repeats):
        tokens += sum(len(o.token_ids) for o in llm.generate(prompts, params))
    wall = time.perf_counter() - t0
    rows = [per_token("generate", tokens, wall, clock, inside0, steps0,
                      split(before, thread_stats(), {"engine": me}), 0)]

    # server arm: count the engine thread's hand-offs to the event loop
    handoffs = [0]
    deliver = async_engine.AsyncEngine._deliver

    def counted(self, loop):
        handoffs[0] += 1
        return deliver(self, loop)
    async_engine.AsyncEngine._deliver = counted
    port = free_port()
    body = {"model": "profile", "prompt": PROMPT, "max_tokens": args.max_tokens, "temperature": 0.0,
            "ignore_eos": True}
    client = subprocess.Popen([sys.executable, "-c", CLIENT, f"http://127.0.0.1:{port}", json.dumps(body),
                               str(args.concurrency), str(args.repeats), "1" if args.stream else "0"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    got: dict = {}

    def drive() -> None:
        if client.stdout.readline().strip() != "go":
            os.kill(os.getpid(), signal.SIGTERM)
            return
        http = next(t.native_id for t in threading.enumerate() if t.name == "metrale-http")
        got["before"], got["inside0"], got["steps0"], got["handoffs0"] = (
            thread_stats(), clock.inside, clock.steps, handoffs[0])
        client.stdin.write("go\n")
        client.stdin.flush()
        got["walls"] = json.loads(client.stdout.readline())
        got["after"], got["http"] = thread_stats(), http
        got["inside1"], got["steps1"], got["handoffs1"] = clock.inside, clock.steps, handoffs[0]
        os.kill(os.getpid(), signal.SIGTERM)
    driver = threading.Thread(target=drive, name="profile-driver", daemon=True)
    driver.start()
    serve(llm, host="127.0.0.1", port=port, config=ServerConfig(served_model_name="profile"))
    client.wait(timeout=60)
    llm.shutdown()
    if "walls" not in got:
        raise SystemExit("the client failed")
    tokens = args.max_tokens * args.concurrency * args.repeats
    stats = split(got["before"], got["after"], {"engine": me, "http": got["http"], "driver": driver.native_id})
    clock.inside, clock.steps = got["inside1"], got["steps1"]
    rows.append(per_token("server", tokens, sum(got["walls"]), clock, got["inside0"], got["steps0"], stats,
                          got["handoffs1"] - got["handoffs0"]))
    del torch
    keys = [k for k in rows[1] if k not in ("arm",)]
    print(f"{args.dtype}, ep {args.ep}, {args.max_tokens} tokens, concurrency {args.concurrency}, "
          f"{'streaming' if args.stream else 'non-streaming'}, {args.repeats} repeats (per output token):")
    for k in keys:
        print(f"  {k:32s} " + "  ".join(f"{r['arm']} {r.get(k, '-')}" for r in rows))
    if args.plot_out is not None:
        plot(rows, args.plot_out, f"{args.dtype}, EP {args.ep}, c{args.concurrency}, "
                                  f"{'streamed' if args.stream else 'non-streaming'}, {args.max_tokens} tokens "
                                  f"(load {os.getloadavg()[0]:.1f})")
    if args.json_out is not None:
        from bench.report import machine
        args.json_out.write_text(json.dumps({"workload": "serve_profile", "args": vars(args) | {"json_out": None},
                                             "load": os.getloadavg(), "machine": machine(), "rows": rows},
                                            indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
