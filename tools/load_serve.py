"""Load run against `metrale serve`: N concurrent streaming clients x M requests each, per arm.

Starts the server itself on a free 127.0.0.1 port (one server per arm: speculation off, then on),
drives it with the official openai client, and reports requests completed and failed, output
tokens/s, TTFT and TPOT p50/p99, and the server's peak RSS.

    python tools/load_serve.py --model models/tiny-glm-moe --clients 64 --requests 8 --json-out bench-out/load.json
"""
from __future__ import annotations

import argparse
import asyncio
import json
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return round(1000 * s[min(len(s) - 1, int(q / 100 * len(s)))], 1)


def peak_rss_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        return None
    return None


async def client_loop(client, prompts, idx, n, max_tokens, results):
    for j in range(n):
        prompt = prompts[(idx * n + j) % len(prompts)]
        t0 = time.perf_counter()
        first = None
        tokens = 0
        try:
            stream = await client.completions.create(model="bench", prompt=prompt, max_tokens=max_tokens,
                                                     temperature=0, stream=True,
                                                     stream_options={"include_usage": True},
                                                     extra_body={"ignore_eos": True})
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].text and first is None:
                    first = time.perf_counter()
                if chunk.usage is not None:
                    tokens = chunk.usage.completion_tokens
            end = time.perf_counter()
            results.append({"ok": tokens == max_tokens, "tokens": tokens, "ttft": (first or end) - t0,
                            "tpot": (end - (first or end)) / max(1, tokens - 1)})
        except Exception as exc:  # counted, never hidden
            results.append({"ok": False, "error": repr(exc), "tokens": 0})


async def drive(base: str, prompts: list[str], clients: int, per_client: int, max_tokens: int) -> tuple[list, float]:
    from openai import AsyncOpenAI
    client = AsyncOpenAI(base_url=base + "/v1", api_key="none", timeout=600, max_retries=0)
    results: list[dict] = []
    t0 = time.perf_counter()
    await asyncio.gather(*(client_loop(client, prompts, i, per_client, max_tokens, results) for i in range(clients)))
    return results, time.perf_counter() - t0


def run_arm(args, spec: str, prompts: list[str]) -> dict:
    port = free_port()
    cmd = [sys.executable, "-m", "launch", "serve", "--model", args.model, "--port", str(port),
           "--served-model-name", "bench", "--max-num-seqs", str(args.clients), "--spec", spec] \
        + (["--num-drafts", str(args.num_drafts)] if spec != "none" else []) \
        + (["--enforce-eager"] if args.enforce_eager else [])
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(300):
            if proc.poll() is not None:
                raise RuntimeError(f"server exited: {proc.stderr.read()}")
            try:
                urllib.request.urlopen(base + "/health", timeout=2)
                break
            except OSError:
                time.sleep(0.3)
        print(f"[{spec}] {args.clients} clients x {args.requests} requests x {args.max_tokens} tokens ...", flush=True)
        results, wall = asyncio.run(drive(base, prompts, args.clients, args.requests, args.max_tokens))
        rss = peak_rss_mib(proc.pid)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    ok = [r for r in results if r["ok"]]
    return {"arm": spec, "clients": args.clients, "requests": len(results), "completed": len(ok),
            "failed": len(results) - len(ok), "tok_s": round(sum(r["tokens"] for r in results) / wall, 1),
            "wall_s": round(wall, 1), "ttft_p50_ms": pct([r["ttft"] for r in ok], 50),
            "ttft_p99_ms": pct([r["ttft"] for r in ok], 99), "tpot_p50_ms": pct([r["tpot"] for r in ok], 50),
            "tpot_p99_ms": pct([r["tpot"] for r in ok], 99), "server_peak_rss_mib": rss,
            "errors": sorted({r["error"] for r in results if "error" in r})[:5]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="models/tiny-glm-moe")
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--num-drafts", type=int, default=3)
    ap.add_argument("--arms", default="none,mtp")
    ap.add_argument("--json-out", type=Path, default=None)
    ap.add_argument("--enforce-eager", action="store_true", help="run the eager step (no compile: a quick check; the speeds are not the served ones)")
    args = ap.parse_args()
    path = Path(args.model) / "heldout_prompts.jsonl"
    prompts = [json.loads(line)["prompt"] for line in path.read_text().splitlines() if line.strip()]
    rows = [run_arm(args, spec, prompts) for spec in args.arms.split(",")]
    for r in rows:
        print(json.dumps(r))
    if args.json_out:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(json.dumps(rows, indent=2) + "\n")
    return 0 if all(r["failed"] == 0 for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
