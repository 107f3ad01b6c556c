"""Flood `metrale serve` and see whether it holds: bounded queue, bounded memory, running streams
that keep streaming.

Starts the server itself (`--max-waiting B`, a small `--max-num-seqs` so the queue fills), opens a
few long streaming requests first (the "running" ones), waits a baseline, then fires 10 x B
non-streaming requests at once. Reports how many were refused (503 with Retry-After) and how many
completed, the peak RSS of the server's process tree (psutil when installed, else /proc) against
its idle RSS (healthy, before any request) and whether it stayed within `--rss-margin` of it, and
the largest gap between tokens of the running streams during the flood against before it (a
stall: longer than `--stall-s`), then sends SIGTERM and records the drain's exit status. Writes flood.json (and flood.png when matplotlib is
installed) under --out.

    python tools/flood.py --out flood-out --max-waiting 16                 # EP 1
    python tools/flood.py --out flood-out --max-waiting 16 --ep 2          # an mp EP 2 group
"""
from __future__ import annotations

import argparse
import itertools
import json
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODEL_NAME = "flood"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tree_rss_bytes(pid: int) -> int:
    """Resident bytes of `pid` and every process below it (psutil if installed, else /proc)."""
    try:
        import psutil
    except ImportError:
        psutil = None
    if psutil is not None:
        try:
            root = psutil.Process(pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.Error:
            return 0
        total = 0
        for p in procs:
            try:
                total += p.memory_info().rss
            except psutil.Error:
                pass
        return total
    return sum(_proc_rss(p) for p in [pid, *_proc_descendants(pid)])


def _proc_descendants(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            children = [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
        for c in children:
            out += [c, *_proc_descendants(c)]
    return out


def _proc_rss(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def post(base: str, body: dict, timeout: float) -> tuple[int, str | None, dict]:
    """(status, Retry-After header, parsed body) of one POST /v1/completions."""
    req = urllib.request.Request(base + "/v1/completions", data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.headers.get("Retry-After"), json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, e.headers.get("Retry-After"), json.loads(e.read() or b"{}")


class RunningStream(threading.Thread):
    """One long streaming request; records when each of its token events arrived."""

    def __init__(self, base: str, max_tokens: int, prompt: str) -> None:
        super().__init__(daemon=True)
        self.base, self.max_tokens, self.prompt = base, max_tokens, prompt
        self.times: list[float] = []
        self.finish_reason: str | None = None
        self.error: str | None = None

    def run(self) -> None:
        body = {"model": MODEL_NAME, "prompt": self.prompt, "max_tokens": self.max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True}
        req = urllib.request.Request(self.base + "/v1/completions", data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=600) as r:
                for line in r:
                    line = line.decode().strip()
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[len("data: "):])
                    if "error" in event:
                        self.error = event["error"]["message"]
                        continue
                    self.times.append(time.perf_counter())
                    self.finish_reason = event["choices"][0]["finish_reason"] or self.finish_reason
        except Exception as exc:  # recorded in the report, never hidden
            self.error = repr(exc)


def max_gap(times: list[float], start: float, end: float) -> float | None:
    """The longest wait between consecutive token events that ends inside [start, end]."""
    gaps = [b - a for a, b in itertools.pairwise(times) if start < b <= end]
    return max(gaps) if gaps else None


def start_server(args: argparse.Namespace, port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "launch", "serve", "--model", str(args.model), "--port", str(port),
           "--served-model-name", MODEL_NAME, "--max-waiting", str(args.max_waiting),
           "--max-num-seqs", str(args.max_num_seqs), "--dtype", args.dtype, "--drain-timeout", str(args.drain_timeout)]
    if args.ep > 1:
        cmd += ["--ep", str(args.ep), "--launcher", "mp"]
    if args.eager:
        cmd.append("--enforce-eager")
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def wait_healthy(proc: subprocess.Popen, base: str, timeout_s: float = 180) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"flood: the server exited ({proc.returncode}): {proc.stderr.read()[-2000:]}")
        try:
            with urllib.request.urlopen(base + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.3)
    proc.kill()
    raise SystemExit(f"flood: the server did not answer /health within {timeout_s:.0f} s")


def flood(args: argparse.Namespace) -> dict:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    proc = start_server(args, port)
    samples: list[tuple[float, int]] = []
    stop_sampling = threading.Event()
    try:
        wait_healthy(proc, base)
        time.sleep(0.2)
        rss_idle = tree_rss_bytes(proc.pid)     # healthy, nothing asked yet

        def sample() -> None:
            while not stop_sampling.is_set():
                samples.append((time.perf_counter(), tree_rss_bytes(proc.pid)))
                time.sleep(0.05)
        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()

        streams = [RunningStream(base, args.running_tokens, f"def worker_{i}(queue):") for i in range(args.running)]
        for s in streams:
            s.start()
        deadline = time.time() + 120
        while any(len(s.times) < 2 for s in streams) and time.time() < deadline:
            time.sleep(0.05)
        if any(len(s.times) < 2 for s in streams):
            raise SystemExit("flood: the running streams did not start within 120 s")
        t_baseline = time.perf_counter()
        time.sleep(args.baseline_s)

        num_requests = args.factor * args.max_waiting
        results: list[tuple[int, str | None, dict] | None] = [None] * num_requests
        barrier = threading.Barrier(num_requests + 1)

        def one(i: int) -> None:
            barrier.wait()
            try:
                results[i] = post(base, {"model": MODEL_NAME, "prompt": f"x_{i} = ", "max_tokens": args.flood_tokens,
                                         "temperature": 0, "ignore_eos": True}, timeout=600)
            except Exception as exc:  # a refused connection or a reset: counted as "other"
                results[i] = (0, None, {"error": {"message": repr(exc)}})
        threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(num_requests)]
        for t in threads:
            t.start()
        barrier.wait()
        t_flood = time.perf_counter()
        for t in threads:
            t.join()
        t_flood_end = time.perf_counter()
        for s in streams:
            s.join(timeout=600)
        stop_sampling.set()
        sampler.join()

        t_term = time.perf_counter()
        proc.send_signal(signal.SIGTERM)
        exit_code = proc.wait(timeout=args.drain_timeout + 60)
        drain_s = time.perf_counter() - t_term
    finally:
        stop_sampling.set()
        if proc.poll() is None:
            proc.kill()
            proc.wait()

    statuses = [r[0] for r in results]
    refused = [r for r in results if r[0] == 503]
    before = [max_gap(s.times, t_baseline, t_flood) for s in streams]
    during = [max_gap(s.times, t_flood, t_flood_end) for s in streams]
    worst_before = max((g for g in before if g is not None), default=None)
    worst_during = max((g for g in during if g is not None), default=None)
    rss_before = max((b for t, b in samples if t < t_flood), default=0)
    rss_peak = max((b for _, b in samples), default=0)
    report = {
        "config": {"model": str(args.model), "ep": args.ep, "dtype": args.dtype, "max_waiting": args.max_waiting,
                   "max_num_seqs": args.max_num_seqs, "num_requests": num_requests, "flood_tokens": args.flood_tokens,
                   "running": args.running, "running_tokens": args.running_tokens, "stall_s": args.stall_s},
        "requests": {"refused_503": len(refused), "completed_200": statuses.count(200),
                     "other": len(statuses) - len(refused) - statuses.count(200),
                     "refused_with_retry_after": sum(r[1] is not None for r in refused),
                     "other_statuses": sorted({s for s in statuses if s not in (200, 503)})},
        "flood_seconds": round(t_flood_end - t_flood, 3),
        "rss_mib": {"idle": round(rss_idle / 2**20, 1), "before_flood": round(rss_before / 2**20, 1),
                    "peak": round(rss_peak / 2**20, 1), "peak_over_idle": round(rss_peak / rss_idle, 4) if rss_idle else None,
                    "margin": args.rss_margin, "within_margin": bool(rss_idle) and rss_peak <= rss_idle * (1 + args.rss_margin),
                    "source": "psutil" if _has_psutil() else "/proc"},
        "running_streams": {
            "max_gap_before_s": None if worst_before is None else round(worst_before, 4),
            "max_gap_during_s": None if worst_during is None else round(worst_during, 4),
            "stalled": worst_during is None or worst_during > args.stall_s,
            "finish_reasons": [s.finish_reason for s in streams],
            "errors": [s.error for s in streams if s.error]},
        "shutdown": {"exit_code": exit_code, "drain_seconds": round(drain_s, 3)},
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "flood.json").write_text(json.dumps(report, indent=2) + "\n")
    plot(out / "flood.png", samples, streams, t_baseline, t_flood, t_flood_end)
    return report


def _has_psutil() -> bool:
    try:
        import psutil  # noqa: F401
    except ImportError:
        return False
    return True


def plot(path: Path, samples: list[tuple[float, int]], streams: list[RunningStream], t_baseline: float,
         t_flood: float, t_flood_end: float) -> bool:
    """RSS over time above the running streams' token gaps, the flood shaded; False without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    t0 = samples[0][0] if samples else t_baseline
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    top.plot([t - t0 for t, _ in samples], [b / 2**20 for _, b in samples])
    top.set_ylabel("server tree RSS (MiB)")
    for i, s in enumerate(streams):
        bottom.plot([b - t0 for b in s.times[1:]], [1000 * (b - a) for a, b in zip(s.times, s.times[1:])],
                    ".", markersize=3, label=f"running stream {i}")
    bottom.set_ylabel("gap between tokens (ms)")
    bottom.set_xlabel("seconds")
    bottom.set_yscale("log")
    bottom.legend(loc="upper right", fontsize=8)
    for ax in (top, bottom):
        ax.axvspan(t_flood - t0, t_flood_end - t0, color="tab:red", alpha=0.15)
    top.set_title("flood (shaded): RSS and running streams")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="folder for flood.json (and flood.png)")
    ap.add_argument("--model", type=Path, default=ROOT / "models" / "tiny-glm-moe")
    ap.add_argument("--ep", type=int, default=1, help="expert-parallel ranks (an mp group above 1)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float64"])
    ap.add_argument("--max-waiting", type=int, default=16, metavar="B", help="the server's --max-waiting")
    ap.add_argument("--factor", type=int, default=10, help="the flood is FACTOR x B requests fired at once")
    ap.add_argument("--max-num-seqs", type=int, default=None,
                    help="the server's batch size (default: the running streams plus 2, so the queue fills)")
    ap.add_argument("--flood-tokens", type=int, default=16, help="max_tokens of each flood request")
    ap.add_argument("--running", type=int, default=2, help="long streaming requests started before the flood")
    ap.add_argument("--running-tokens", type=int, default=400, help="max_tokens of each running stream")
    ap.add_argument("--baseline-s", type=float, default=1.5, help="seconds of streaming measured before the flood")
    ap.add_argument("--stall-s", type=float, default=2.0,
                    help="a running stream stalled if it waited longer than this for a token during the flood")
    ap.add_argument("--rss-margin", type=float, default=0.25,
                    help="the flood holds memory if the peak RSS stays within this share above the idle RSS")
    ap.add_argument("--drain-timeout", type=float, default=10.0, help="the server's --drain-timeout")
    ap.add_argument("--eager", action=argparse.BooleanOptionalAction, default=True,
                    help="--enforce-eager on the server (default on: no compile time in a short run)")
    args = ap.parse_args(argv)
    for name in ("ep", "max_waiting", "factor", "flood_tokens", "running", "running_tokens"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} {getattr(args, name)} must be at least 1")
    if args.max_num_seqs is None:
        args.max_num_seqs = args.running + 2
    if args.max_num_seqs < 1:
        ap.error(f"--max-num-seqs {args.max_num_seqs} must be at least 1")
    if not args.model.is_dir():
        ap.error(f"--model {str(args.model)!r} is not a folder")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report = flood(args)
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
