"""`metrale bench --workload serve`: drive running OpenAI-compatible servers (ours, vLLM's, any
other) with a closed loop at each concurrency, and measure them the way vLLM's `bench serve` does.

Every request is a streamed /v1/completions call with a prompt of `input_len` random token ids
(drawn once from a seed, so every server gets the same prompts), `max_tokens` = `output_len`,
greedy, `ignore_eos`, and the usage in the last event. A cell is one server at one concurrency:
that many clients, each sending its next request as soon as its last one ended, until `requests`
requests are done. Per cell: output tokens per second over the cell's wall time, requests per
second, time to first token (the first event carrying a choice) and time per output token after
the first ((latency - TTFT) / (tokens - 1)), as mean, p50, p90 and p99. Servers take turns cell by
cell (never two under load at once); with `repeats` each cell runs that many times and the record
keeps the median run by tok/s, with the others' tok/s beside it. Start-up is not measured: each
server first serves `warmup` requests.
"""
from __future__ import annotations

import http.client
import json
import math
import random
import statistics
import threading
import time
import urllib.parse
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

MIN_REQUESTS = 16
REQUEST_TIMEOUT_S = 600.0


@dataclass(frozen=True, kw_only=True, slots=True)
class ServeWorkloadConfig:
    servers: tuple[tuple[str, str], ...]     # (name, base URL), e.g. ("metrale", "http://127.0.0.1:8000")
    vocab_size: int                          # random prompt ids are drawn below this
    concurrency: tuple[int, ...] = (1, 16)
    requests: int | None = None              # per cell; None: 4 x concurrency, at least MIN_REQUESTS
    input_len: int = 128
    output_len: int = 64
    repeats: int = 1
    warmup: int = 2
    seed: int = 0
    api_key: str | None = None
    avoid_ids: tuple[int, ...] = ()          # never drawn (e.g. EOS and other special tokens)

    def __post_init__(self) -> None:
        if not self.servers:
            raise ValueError("the serve workload needs at least one server (--url NAME=URL)")
        names = [n for n, _ in self.servers]
        if len(set(names)) != len(names):
            raise ValueError(f"server names {names} repeat: give each --url a distinct NAME=")
        for name, url in self.servers:
            parts = urllib.parse.urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ValueError(f"--url {name}={url!r} is not an http(s) URL")
        if not self.concurrency or any(c < 1 for c in self.concurrency):
            raise ValueError(f"--concurrency {list(self.concurrency)}: each level must be at least 1")
        for field in ("input_len", "output_len", "repeats"):
            if getattr(self, field) < 1:
                raise ValueError(f"{field}={getattr(self, field)} must be at least 1")
        if self.output_len < 2:
            raise ValueError(f"output_len={self.output_len} must be at least 2 (TPOT needs two tokens)")
        if self.requests is not None and self.requests < 1:
            raise ValueError(f"--requests {self.requests} must be at least 1")
        if self.warmup < 0:
            raise ValueError(f"warmup={self.warmup} must be at least 0")
        if self.vocab_size - len(set(self.avoid_ids)) < 2:
            raise ValueError(f"vocab_size={self.vocab_size} leaves no ids to draw prompts from")

    def num_requests(self, concurrency: int) -> int:
        return self.requests or max(MIN_REQUESTS, 4 * concurrency)


def parse_servers(items: list[str]) -> tuple[tuple[str, str], ...]:
    """`--url` values, `NAME=URL` or a bare URL (named after its host and port)."""
    out = []
    for item in items:
        name, sep, url = item.partition("=")
        if not sep or "://" in name:
            name, url = urllib.parse.urlsplit(item).netloc or item, item
        out.append((name.strip(), url.strip().rstrip("/")))
    return tuple(out)


def make_prompts(config: ServeWorkloadConfig, n: int) -> list[list[int]]:
    rng = random.Random(config.seed)
    avoid = set(config.avoid_ids)
    pool = [i for i in range(config.vocab_size) if i not in avoid]
    return [[rng.choice(pool) for _ in range(config.input_len)] for _ in range(n)]


class Client:
    """One keep-alive connection to one server (a client of the closed loop)."""

    def __init__(self, base: str, api_key: str | None) -> None:
        parts = urllib.parse.urlsplit(base)
        conn = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
        self.conn = conn(parts.hostname, parts.port, timeout=REQUEST_TIMEOUT_S)
        self.prefix = parts.path.rstrip("/")
        self.headers = {"Content-Type": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"

    def get_json(self, path: str) -> dict:
        self.conn.request("GET", self.prefix + path, headers=self.headers)
        resp = self.conn.getresponse()
        body = resp.read()
        if resp.status != 200:
            raise RuntimeError(f"GET {path}: HTTP {resp.status}: {body[:300]!r}")
        return json.loads(body)

    def complete(self, model: str, prompt: list[int], max_tokens: int) -> dict:
        """One streamed completion: its TTFT, latency and output tokens (from the usage)."""
        body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                           "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}})
        t0 = time.perf_counter()
        self.conn.request("POST", self.prefix + "/v1/completions", body=body, headers=self.headers)
        resp = self.conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"POST /v1/completions: HTTP {resp.status}: {resp.read()[:300]!r}")
        first, usage, chunks = None, None, 0
        for raw in resp:
            if not raw.startswith(b"data: "):
                continue
            data = raw[6:].strip()
            if data == b"[DONE]":
                resp.read()    # the end of the chunked body, so the connection can carry the next request
                break
            event = json.loads(data)
            if "error" in event:
                raise RuntimeError(f"the stream ended with an error: {event['error']}")
            if event.get("choices"):
                chunks += 1
                if first is None:
                    first = time.perf_counter()
            usage = event.get("usage") or usage
        end = time.perf_counter()
        tokens = usage["completion_tokens"] if usage else chunks
        return {"ttft_s": (first or end) - t0, "latency_s": end - t0, "tokens": tokens}


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q / 100 * len(s)) - 1))]


def stats_ms(values: list[float], prefix: str) -> dict:
    out = {f"{prefix}_mean_ms": round(1000 * statistics.fmean(values), 2) if values else None}
    for q in (50, 90, 99):
        v = percentile(values, q)
        out[f"{prefix}_p{q}_ms"] = None if v is None else round(1000 * v, 2)
    return out


def served_model(base: str, api_key: str | None) -> str:
    data = Client(base, api_key).get_json("/v1/models").get("data") or []
    if not data:
        raise RuntimeError(f"{base}/v1/models lists no model")
    return data[0]["id"]


def run_cell(name: str, base: str, model: str, prompts: list[list[int]], concurrency: int,
             config: ServeWorkloadConfig) -> dict:
    """`len(prompts)` requests through `concurrency` closed-loop clients."""
    results: list[dict] = []
    errors: list[BaseException] = []
    lock = threading.Lock()
    todo = iter(range(len(prompts)))

    def client() -> None:
        c = Client(base, config.api_key)
        while True:
            with lock:
                i = next(todo, None)
            if i is None or errors:
                return
            try:
                r = c.complete(model, prompts[i], config.output_len)
            except BaseException as exc:   # stop the cell: one failure makes the figures wrong
                with lock:
                    errors.append(exc)
                return
            with lock:
                results.append(r)

    threads = [threading.Thread(target=client, daemon=True) for _ in range(concurrency)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise RuntimeError(f"server {name} at concurrency {concurrency}: {errors[0]}")
    tokens = sum(r["tokens"] for r in results)
    short = sum(r["tokens"] != config.output_len for r in results)
    tpot = [(r["latency_s"] - r["ttft_s"]) / (r["tokens"] - 1) for r in results if r["tokens"] > 1]
    return {"server": name, "concurrency": concurrency, "requests": len(results), "output_tokens": tokens,
            "short_requests": short, "wall_s": round(wall, 3), "tok_s": round(tokens / wall, 2),
            "req_s": round(len(results) / wall, 3),
            **stats_ms([r["ttft_s"] for r in results], "ttft"), **stats_ms(tpot, "tpot")}


def median_run(runs: list[dict]) -> dict:
    ordered = sorted(runs, key=lambda r: r["tok_s"])
    cell = dict(ordered[(len(ordered) - 1) // 2])
    if len(runs) > 1:
        cell["tok_s_runs"] = [r["tok_s"] for r in runs]
    return cell


def print_table(cells: list[dict]) -> None:
    head = f"{'server':>14} {'conc':>5} {'reqs':>5} {'tok/s':>9} {'req/s':>7} {'TTFT p50':>9} {'p90':>8} {'p99':>8} " \
           f"{'TPOT p50':>9} {'p90':>7} {'p99':>7}"
    print(head)
    for c in cells:
        print(f"{c['server']:>14} {c['concurrency']:>5} {c['requests']:>5} {c['tok_s']:>9.1f} {c['req_s']:>7.2f} "
              f"{c['ttft_p50_ms']:>9.1f} {c['ttft_p90_ms']:>8.1f} {c['ttft_p99_ms']:>8.1f} "
              f"{c['tpot_p50_ms']:>9.2f} {c['tpot_p90_ms']:>7.2f} {c['tpot_p99_ms']:>7.2f}", flush=True)


def ratios(cells: list[dict]) -> list[dict]:
    """Each server against the first one listed, per concurrency (tok/s, median TTFT and TPOT)."""
    first = cells[0]["server"] if cells else None
    by = {(c["server"], c["concurrency"]): c for c in cells}
    out = []
    for c in cells:
        ref = by.get((first, c["concurrency"]))
        if c["server"] == first or ref is None:
            continue
        out.append({"server": first, "against": c["server"], "concurrency": c["concurrency"],
                    "tok_s_ratio": round(ref["tok_s"] / c["tok_s"], 3),
                    "ttft_p50_ratio": round(ref["ttft_p50_ms"] / c["ttft_p50_ms"], 3),
                    "tpot_p50_ratio": round(ref["tpot_p50_ms"] / c["tpot_p50_ms"], 3)})
    return out


def plot(cells: list[dict], path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    servers = list(dict.fromkeys(c["server"] for c in cells))
    for key, ax, label in (("tok_s", axes[0], "output tokens/s"), ("ttft_p50_ms", axes[1], "median TTFT (ms)"),
                           ("tpot_p50_ms", axes[2], "median TPOT (ms)")):
        for s in servers:
            mine = sorted((c for c in cells if c["server"] == s), key=lambda c: c["concurrency"])
            ax.plot([c["concurrency"] for c in mine], [c[key] for c in mine], marker="o", label=s)
        ax.set(xlabel="concurrency", ylabel=label)
        ax.set_xscale("log", base=2)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_serve_workload(config: ServeWorkloadConfig, json_out: Path | None = None,
                       plot_out: Path | None = None) -> dict:
    """Run every cell (servers taking turns), print the table, write the record and the plot."""
    from bench.report import check_provenance, machine, provenance
    start = provenance()
    models = {name: served_model(base, config.api_key) for name, base in config.servers}
    most = max(config.num_requests(c) for c in config.concurrency)
    prompts = make_prompts(config, most + config.warmup)
    warm, prompts = prompts[:config.warmup], prompts[config.warmup:]
    for name, base in config.servers:
        if warm:
            run_cell(name, base, models[name], warm, 1, config)
    print(f"serve workload: {', '.join(f'{n} ({u}, model {models[n]!r})' for n, u in config.servers)}; "
          f"{config.input_len} prompt / {config.output_len} output tokens, concurrency "
          f"{','.join(map(str, config.concurrency))}", flush=True)
    runs: dict[tuple[str, int], list[dict]] = {}
    for _ in range(config.repeats):
        for c in config.concurrency:
            for name, base in config.servers:
                runs.setdefault((name, c), []).append(
                    run_cell(name, base, models[name], prompts[:config.num_requests(c)], c, config))
    cells = [median_run(runs[(name, c)]) for c in config.concurrency for name, _ in config.servers]
    print_table(cells)
    record = {"workload": "serve", "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "config": {**asdict(config), "servers": [list(s) for s in config.servers]}, "models": models,
              "machine": machine(), **start, "cells": cells, "ratios": ratios(cells)}
    for r in record["ratios"]:
        print(f"{r['server']} / {r['against']} at concurrency {r['concurrency']}: tok/s {r['tok_s_ratio']:.2f}x, "
              f"TTFT p50 {r['ttft_p50_ratio']:.2f}x, TPOT p50 {r['tpot_p50_ratio']:.2f}x", flush=True)
    record.update(check_provenance(start))
    if json_out is not None:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(record, indent=1) + "\n")
    if plot_out is not None:
        plot(cells, plot_out, f"serve workload: {config.input_len} in / {config.output_len} out tokens")
    return record


def cell_from_vllm_result(path: Path, server: str) -> dict:
    """A cell of this module's shape from the JSON `vllm bench serve --save-result` writes, so a
    run of vLLM's own client sits in the same record and plot as this workload's cells."""
    r = json.loads(Path(path).read_text())
    missing = [k for k in ("max_concurrency", "completed", "total_output_tokens", "duration", "output_throughput")
               if k not in r]
    if missing:
        raise ValueError(f"{path}: not a `vllm bench serve` result (no {', '.join(missing)})")
    cell = {"server": server, "concurrency": r["max_concurrency"], "requests": r["completed"],
            "output_tokens": r["total_output_tokens"], "wall_s": round(r["duration"], 3),
            "tok_s": round(r["output_throughput"], 2), "req_s": round(r["request_throughput"], 3),
            "client": "vllm bench serve"}
    for metric in ("ttft", "tpot"):
        cell[f"{metric}_mean_ms"] = round(r[f"mean_{metric}_ms"], 2)
        for q in (50, 90, 99):
            key = f"median_{metric}_ms" if q == 50 else f"p{q}_{metric}_ms"
            cell[f"{metric}_p{q}_ms"] = round(r[key], 2) if key in r else None
    return cell
