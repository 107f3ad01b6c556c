"""Chaos run against a loaded `metrale serve --ep 2`: faults while clients stream, nothing lost.

    python tools/chaos.py --model models/tiny-glm-moe --launcher mp --clients 64 --requests 8 --out /tmp/chaos

Starts the server itself (float64, so every request's tokens are independent of what shares its
steps) on a free 127.0.0.1 port and drives the same requests twice with N concurrent streaming
clients of the official openai client (greedy and seeded, mixed prompt and output lengths, every
--cancel-every-th one cancelled midway): an undisturbed pass (the reference), then a pass during
which faults are injected on a schedule (--faults, seconds after that pass starts):

    kill     SIGKILL of worker rank 1
    stop     SIGSTOP of rank 1 for --ep-timeout + 2 s, then SIGCONT (the stale rank must not rejoin)
    double   a second fault before the first is healed: mp: SIGKILL of rank 1 and of its warm
             standby, then of the cold rank 1 the restart spawns, while it starts; Ray: SIGKILL of
             rank 1, then of the new rank 1 as soon as /health shows it
    burst    --burst clients that start streaming and disconnect after two chunks

It checks every request completed in both passes token for token (text and token count) against
the reference, counts errors by kind and requests lost (a stream that ended without a finish
reason), checks that the KV cache's free blocks return to the total once the server is idle
(/metrics), records per fault the restarts, the server's recovery seconds and the longest stall
between streamed tokens, and writes chaos.json and chaos.png (streamed tokens/s over time, faults marked) into
--out. Exit code 0 when nothing was lost or wrong and the cache came back whole.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FAULT_KINDS = ("kill", "stop", "double", "burst")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse_faults(text: str) -> list[tuple[float, str]]:
    """'kill@2,stop@8' -> [(2.0, 'kill'), (8.0, 'stop')], sorted by time; ValueError naming a bad part."""
    out = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        kind, _, at = part.partition("@")
        try:
            t = float(at)
        except ValueError:
            raise ValueError(f"--faults part {part!r}: expected KIND@SECONDS") from None
        if kind not in FAULT_KINDS or t < 0:
            raise ValueError(f"--faults part {part!r}: kind must be one of {', '.join(FAULT_KINDS)}, seconds >= 0")
        out.append((t, kind))
    return sorted(out)


@dataclass(slots=True)
class Request:
    index: int
    prompt: str
    max_tokens: int
    seed: int | None          # None: greedy
    cancel_after: int | None  # chunks read before the client walks away; None: read to the end


@dataclass(slots=True)
class Result:
    index: int
    text: str = ""
    tokens: int = 0
    finish: str | None = None
    error: str | None = None
    cancelled: bool = False
    chunk_times: list[float] = field(default_factory=list)


def make_requests(prompts: list[str], n: int, cancel_every: int, max_tokens: int) -> list[Request]:
    reqs = []
    for i in range(n):
        words = prompts[i % len(prompts)]
        prompt = words[: 40 + (i * 37) % 260]                   # mixed prompt lengths
        reqs.append(Request(i, prompt, max(4, max_tokens // 4 + (i * 13) % max_tokens),
                            None if i % 2 == 0 else 1000 + i,
                            2 + i % 5 if cancel_every and i % cancel_every == cancel_every - 1 else None))
    return reqs


async def run_one(client, req: Request, res: Result, t0: float) -> None:
    extra = {"ignore_eos": True}
    sampling = {"temperature": 0.0} if req.seed is None else {"temperature": 0.8, "seed": req.seed}
    try:
        stream = await client.completions.create(model="chaos", prompt=req.prompt, max_tokens=req.max_tokens,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body=extra, **sampling)
        chunks = 0
        async for chunk in stream:
            if chunk.choices:
                choice = chunk.choices[0]
                if choice.text:
                    res.text += choice.text
                    res.chunk_times.append(time.perf_counter() - t0)
                    chunks += 1
                if choice.finish_reason:
                    res.finish = choice.finish_reason
            if chunk.usage is not None:
                res.tokens = chunk.usage.completion_tokens
            if req.cancel_after is not None and chunks >= req.cancel_after:
                res.cancelled = True
                await stream.close()
                return
    except Exception as exc:  # counted by kind, never hidden
        status = getattr(exc, "status_code", None)
        res.error = f"{type(exc).__name__}" + (f" {status}" if status else "")


async def run_pass(base: str, reqs: list[Request], clients: int, t0: float) -> list[Result]:
    from openai import AsyncOpenAI
    client = AsyncOpenAI(base_url=base + "/v1", api_key="none", timeout=300, max_retries=0)
    results = {r.index: Result(r.index) for r in reqs}
    queue: asyncio.Queue[Request] = asyncio.Queue()
    for r in reqs:
        queue.put_nowait(r)

    async def worker() -> None:
        while not queue.empty():
            req = queue.get_nowait()
            await run_one(client, req, results[req.index], t0)
    await asyncio.gather(*(worker() for _ in range(clients)))
    await client.close()
    return [results[r.index] for r in reqs]


# --- the server ----------------------------------------------------------------------------------
def get_json(url: str, timeout: float = 5.0) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


def get_metrics(base: str) -> dict[str, float]:
    with urllib.request.urlopen(base + "/metrics", timeout=5) as r:
        text = r.read().decode()
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^(metrale_[a-z_]+) (\S+)$", text, re.M)}


def worker_pids(base: str) -> list[int]:
    return [r["pid"] for r in get_json(base + "/health")["ranks"][1:]]


def spawned_children(pid: int) -> list[int]:
    """The multiprocessing-spawned children of `pid` (the mp launcher's workers and standbys)."""
    kids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid and \
                    "spawn_main" in Path(f"/proc/{entry}/cmdline").read_text(errors="replace"):
                kids.append(int(entry))
    return kids


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def signal_pid(pid: int, sig: int) -> bool:
    try:
        os.kill(pid, sig)
        return True
    except ProcessLookupError:
        return False


def start_server(args, port: int, log) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "launch", "serve", "--model", args.model, "--port", str(port),
           "--served-model-name", "chaos", "--dtype", "float64", "--ep", "2", "--launcher", args.launcher,
           "--ep-timeout", str(args.ep_timeout), "--max-restarts", str(args.max_restarts),
           "--max-num-seqs", str(max(args.clients, args.burst)), "--kv-cache-tokens", str(args.kv_cache_tokens)]
    if args.launcher == "ray":
        cmd += ["--ray-temp-dir", tempfile.mkdtemp(prefix="chaosray", dir="/tmp")]
    help_text = subprocess.run([sys.executable, "-m", "launch", "serve", "--help"], cwd=ROOT, capture_output=True,
                               text=True).stdout
    if args.request_timeout and "--request-timeout" in help_text:
        cmd += ["--request-timeout", str(args.request_timeout)]
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    return subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def wait_ready(proc: subprocess.Popen, base: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"chaos: the server exited with code {proc.returncode} before it was ready")
        try:
            if get_json(base + "/health", timeout=2)["status"] == "ok":
                return
        except OSError:
            pass
        time.sleep(0.3)
    raise SystemExit(f"chaos: the server was not ready within {timeout_s:.0f} s")


def wait_idle_cache(base: str, timeout_s: float) -> dict:
    """Poll /metrics until nothing runs or waits and the free blocks equal the total (or time runs out)."""
    deadline = time.monotonic() + timeout_s
    while True:
        m = get_metrics(base)
        idle = m.get("metrale_num_requests_running", 1) == 0 and m.get("metrale_num_requests_waiting", 1) == 0
        whole = m.get("metrale_kv_cache_free_blocks") == m.get("metrale_kv_cache_blocks")
        if (idle and whole) or time.monotonic() > deadline:
            return {"idle": idle, "free_blocks": m.get("metrale_kv_cache_free_blocks"),
                    "total_blocks": m.get("metrale_kv_cache_blocks"), "ok": idle and whole}
        time.sleep(0.2)


# --- the faults ----------------------------------------------------------------------------------
async def inject(kind: str, base: str, server_pid: int, args, t0: float, burst_reqs: list[Request]) -> dict:
    at = time.perf_counter() - t0
    rec: dict = {"kind": kind, "at_s": round(at, 3)}
    restarts = get_metrics(base).get("metrale_restarts_total", 0.0)
    if kind == "burst":
        results = await run_pass(base, burst_reqs, len(burst_reqs), t0)
        rec["clients"] = len(results)
        rec["disconnected"] = sum(r.cancelled for r in results)
        rec["errors"] = [r.error for r in results if r.error]
        return rec
    victim = worker_pids(base)[0]
    rec["pid"] = victim
    if kind == "kill":
        signal_pid(victim, signal.SIGKILL)
    elif kind == "stop":
        signal_pid(victim, signal.SIGSTOP)
        await asyncio.sleep(args.ep_timeout + 2)
        rec["continued"] = signal_pid(victim, signal.SIGCONT)
    elif kind == "double" and args.launcher == "mp":
        # Rank 1 and the standbys, so the restart spawns a cold rank 1; that one dies while it starts.
        known = set(spawned_children(server_pid)) | {victim}
        for pid in known:
            signal_pid(pid, signal.SIGKILL)
        rec["standbys_killed"] = sorted(known - {victim})
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            fresh = [p for p in spawned_children(server_pid) if p not in known]
            if fresh:
                signal_pid(fresh[0], signal.SIGKILL)
                rec["second_pid"] = fresh[0]
                rec["second_at_s"] = round(time.perf_counter() - t0, 3)
                break
            await asyncio.sleep(0.005)
    elif kind == "double":   # Ray: the next group's rank 1, the moment /health shows it
        signal_pid(victim, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                pids = await asyncio.to_thread(worker_pids, base)
            except OSError:
                pids = []
            if pids and pids[0] != victim:
                signal_pid(pids[0], signal.SIGKILL)
                rec["second_pid"] = pids[0]
                rec["second_at_s"] = round(time.perf_counter() - t0, 3)
                break
            await asyncio.sleep(0.01)
    # Healed: the restart counter moved past what this fault caused and a worker answers again.
    want = restarts + (2 if kind == "double" else 1)
    deadline = time.monotonic() + args.ep_timeout + 60
    while time.monotonic() < deadline:
        m = await asyncio.to_thread(get_metrics, base)
        if m.get("metrale_restarts_total", 0) >= want:
            rec["restarts"] = int(m["metrale_restarts_total"] - restarts)
            rec["last_recovery_s"] = m.get("metrale_last_recovery_seconds")
            break
        await asyncio.sleep(0.05)
    rec["healed_at_s"] = round(time.perf_counter() - t0, 3)
    pids = await asyncio.to_thread(worker_pids, base)
    rec["stale_rank_gone"] = victim not in pids and not alive(victim)
    return rec


async def chaos_pass(base: str, server_pid: int, reqs: list[Request], args, schedule: list[tuple[float, str]]
                     ) -> tuple[list[Result], list[dict], float]:
    t0 = time.perf_counter()
    burst = [Request(-1 - i, "def main(", 64, None, 2) for i in range(args.burst)]
    clients = asyncio.create_task(run_pass(base, reqs, args.clients, t0))
    faults = []
    for at, kind in schedule:
        delay = at - (time.perf_counter() - t0)
        if delay > 0:
            done, _ = await asyncio.wait([clients], timeout=delay)
            if done:
                faults.append({"kind": kind, "at_s": at, "skipped": "the pass had ended"})
                continue
        faults.append(await inject(kind, base, server_pid, args, t0, burst))
    results = await clients
    return results, faults, time.perf_counter() - t0


# --- the record ----------------------------------------------------------------------------------
def compare(reference: list[Result], got: list[Result]) -> dict:
    def complete(r: Result) -> bool:
        return r.error is None and not r.cancelled and r.finish is not None
    wrong = [g.index for r, g in zip(reference, got) if complete(r) and complete(g)
             and (r.text, r.tokens) != (g.text, g.tokens)]
    kinds: dict[str, int] = {}
    for g in got:
        if g.error:
            kinds[g.error] = kinds.get(g.error, 0) + 1
    return {"requests": len(got), "completed": sum(map(complete, got)), "cancelled": sum(g.cancelled for g in got),
            "errored": sum(g.error is not None for g in got),
            "lost": sum(g.error is None and not g.cancelled and g.finish is None for g in got),
            "compared": sum(complete(r) and complete(g) for r, g in zip(reference, got)),
            "wrong": len(wrong), "wrong_requests": wrong[:20], "error_kinds": kinds,
            "tokens": sum(g.tokens for g in got)}


def rate(times: list[float], start: float, end: float) -> float | None:
    return round(sum(start <= t < end for t in times) / (end - start), 1) if end > start else None


def phases(results: list[Result], faults: list[dict], wall: float) -> dict:
    times = [t for r in results for t in r.chunk_times]
    hit = [f for f in faults if "skipped" not in f]
    if not hit:
        return {"before": rate(times, 0, wall)}
    first, last = hit[0]["at_s"], max(f.get("healed_at_s", f["at_s"]) for f in hit)
    return {"before": rate(times, 0, first), "during": rate(times, first, last), "after": rate(times, last, wall)}


def longest_stall(results: list[Result], start: float, end: float) -> float | None:
    """The longest time between streamed tokens (any client) from `start` to the first token after `end`:
    the outage clients saw around a fault."""
    times = sorted(t for r in results for t in r.chunk_times)
    after = [t for t in times if t > end]
    if not after:
        return None
    points = [start] + [t for t in times if start < t <= end] + [after[0]]
    return round(max(b - a for a, b in zip(points, points[1:])), 3)


def plot(path: Path, results: list[Result], faults: list[dict], wall: float, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    width = 0.5
    bins = [0] * (int(wall / width) + 1)
    for r in results:
        for t in r.chunk_times:
            bins[min(len(bins) - 1, int(t / width))] += 1
    fig, ax = plt.subplots(figsize=(10, 4))
    ax.plot([i * width for i in range(len(bins))], [b / width for b in bins], lw=1.2)
    colors = {"kill": "red", "stop": "orange", "double": "purple", "burst": "green"}
    for f in faults:
        if "skipped" in f:
            continue
        ax.axvline(f["at_s"], color=colors[f["kind"]], ls="--", lw=1)
        ax.text(f["at_s"], ax.get_ylim()[1] * 0.95, f" {f['kind']}", color=colors[f["kind"]], va="top", fontsize=8)
        if "healed_at_s" in f:
            ax.axvspan(f["at_s"], f["healed_at_s"], color=colors[f["kind"]], alpha=0.12)
    ax.set_xlabel("seconds into the faulted pass")
    ax.set_ylabel("streamed tokens/s")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(ROOT / "models" / "tiny-glm-moe"))
    ap.add_argument("--launcher", default="mp", choices=["mp", "ray"])
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--requests", type=int, default=8, help="requests per client")
    ap.add_argument("--max-tokens", type=int, default=48, help="output lengths vary over about 1/4..5/4 of this")
    ap.add_argument("--cancel-every", type=int, default=9, help="every n-th request is cancelled midway (0: none)")
    ap.add_argument("--burst", type=int, default=16, help="clients of a burst fault")
    ap.add_argument("--faults", default="kill@3,stop@10,double@24,burst@34",
                    help="KIND@SECONDS after the faulted pass starts; kinds: " + ", ".join(FAULT_KINDS))
    ap.add_argument("--ep-timeout", type=float, default=5.0)
    ap.add_argument("--max-restarts", type=int, default=20)
    ap.add_argument("--request-timeout", type=float, default=120.0,
                    help="passed to the server when `metrale serve --help` lists --request-timeout")
    ap.add_argument("--kv-cache-tokens", type=int, default=16384)
    ap.add_argument("--ready-timeout", type=float, default=180.0)
    ap.add_argument("--out", type=Path, required=True, help="folder for chaos.json, chaos.png and server.log")
    args = ap.parse_args(argv)
    try:
        schedule = parse_faults(args.faults)
    except ValueError as exc:
        ap.error(str(exc))
    if args.clients < 1 or args.requests < 1 or args.max_tokens < 4:
        ap.error("--clients and --requests must be at least 1, --max-tokens at least 4")
    model = Path(args.model)
    if not (model / "heldout_prompts.jsonl").is_file():
        ap.error(f"--model {args.model!r}: no heldout_prompts.jsonl in it")
    args.out.mkdir(parents=True, exist_ok=True)
    prompts = [json.loads(line)["prompt"] for line in (model / "heldout_prompts.jsonl").read_text().splitlines()
               if line.strip()]
    reqs = make_requests(prompts, args.clients * args.requests, args.cancel_every, args.max_tokens)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log = open(args.out / "server.log", "w")
    proc = start_server(args, port, log)
    try:
        wait_ready(proc, base, args.ready_timeout)
        t_ref = time.perf_counter()
        reference = asyncio.run(run_pass(base, reqs, args.clients, t_ref))
        ref_wall = time.perf_counter() - t_ref
        ref_cache = wait_idle_cache(base, 30)
        results, faults, wall = asyncio.run(chaos_pass(base, proc.pid, reqs, args, schedule))
        cache = wait_idle_cache(base, 60)
        metrics = get_metrics(base)
        healthy = get_json(base + "/health")["status"] == "ok"
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        log.close()
    for f in faults:
        if "skipped" not in f:
            f["longest_stall_s"] = longest_stall(results, f["at_s"], f.get("healed_at_s", f["at_s"]))
    outcome = compare(reference, results)
    record = {
        "model": str(model), "launcher": args.launcher, "ep": 2, "dtype": "float64", "clients": args.clients,
        "requests_per_client": args.requests, "max_tokens": args.max_tokens, "ep_timeout_s": args.ep_timeout,
        "schedule": args.faults,
        "reference": {"wall_s": round(ref_wall, 2), "tok_s": round(sum(r.tokens for r in reference) / ref_wall, 1),
                      "errored": sum(r.error is not None for r in reference), "cache": ref_cache},
        "faulted": {**outcome, "wall_s": round(wall, 2), "tok_s": phases(results, faults, wall)},
        "faults": faults, "cache_after": cache, "server_healthy_after": healthy,
        "restarts_total": metrics.get("metrale_restarts_total"),
    }
    ok = outcome["lost"] == 0 and outcome["wrong"] == 0 and cache["ok"] and ref_cache["ok"] and healthy
    record["ok"] = ok
    (args.out / "chaos.json").write_text(json.dumps(record, indent=1) + "\n")
    plot(args.out / "chaos.png", results, faults, wall,
         f"chaos, {args.launcher}, EP 2, {args.clients} clients x {args.requests}: completed "
         f"{outcome['completed']}, errored {outcome['errored']}, lost {outcome['lost']}, wrong {outcome['wrong']}")
    print(json.dumps({k: record[k] for k in ("ok", "restarts_total")} | {"faulted": outcome, "faults": faults}))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
