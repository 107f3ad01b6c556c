"""Load and shutdown of a real `metrale serve` process: a full waiting queue is a 503 with
Retry-After, --request-timeout ends a request and frees its cache, SIGTERM drains (503s and
/health "draining", open requests finish or end with finish reason `shutdown`) and exits 0 with
no process left behind, at EP 1 and with an EP 2 group (mp, and Ray with its own local cluster)."""
from __future__ import annotations

import concurrent.futures as cf
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import ROOT, metrale_cmd, run_env
from tests.launch.test_server import free_port, metric

MODEL_DIR = ROOT / "models" / "tiny-glm-moe"
MODEL = "tiny"
JSON = {"Content-Type": "application/json"}


def post(base: str, body: dict, path: str = "/v1/completions", timeout: float = 60):
    """(status, headers (case-insensitive), parsed body) of one POST."""
    req = urllib.request.Request(base + path, data=json.dumps(body).encode(), method="POST", headers=JSON)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.headers, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, e.headers, json.loads(e.read())


def get(base: str, path: str):
    try:
        with urllib.request.urlopen(base + path, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def completion(max_tokens: int, stream: bool = False, prompt: str = "def main():") -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": stream}


class Stream:
    """A streamed completion read event by event."""

    def __init__(self, base: str, max_tokens: int) -> None:
        req = urllib.request.Request(base + "/v1/completions", data=json.dumps(completion(max_tokens, True)).encode(),
                                     method="POST", headers=JSON)
        self.resp = urllib.request.urlopen(req, timeout=60)

    def next_event(self) -> dict | str | None:
        while True:
            line = self.resp.readline()
            if not line:
                return None
            line = line.decode().strip()
            if line.startswith("data: "):
                data = line[len("data: "):]
                return data if data == "[DONE]" else json.loads(data)

    def rest(self) -> list:
        events = []
        while (e := self.next_event()) is not None:
            events.append(e)
        return events


def start(*args: str, env: dict[str, str] | None = None) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen(metrale_cmd("serve", "--model", str(MODEL_DIR), "--port", str(port),
                                        "--served-model-name", MODEL, "--enforce-eager", *args),
                            env=env or run_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 240   # a local Ray cluster on a loaded 2-core machine takes minutes to come up
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {proc.stderr.read()}")
        try:
            if get(base, "/health")[0] == 200:
                return proc, base
        except OSError:
            time.sleep(0.3)
    proc.kill()
    raise RuntimeError("server did not come up in 240 s")


def descendants(pid: int) -> set[int]:
    """Every process below `pid` (from /proc)."""
    out: set[int] = set()
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            children = (task / "children").read_text().split()
        except OSError:
            continue
        for c in map(int, children):
            out |= {c} | descendants(c)
    return out


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.fixture(scope="module")
def limited():
    """One running sequence at a time, at most 2 waiting, 3 s per request, no prefix cache (so a
    freed request leaves the KV cache empty)."""
    proc, base = start("--max-num-seqs", "1", "--max-waiting", "2", "--request-timeout", "3", "--no-prefix-cache")
    yield base
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()


def test_full_queue_is_a_503_with_retry_after(limited):
    running = Stream(limited, 1500)
    assert running.next_event()["choices"][0]["finish_reason"] is None     # it holds the one slot
    with cf.ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(post, limited, completion(3)) for _ in range(8)]
        refused = []
        deadline = time.time() + 10
        while len(refused) < 6 and time.time() < deadline:
            refused = [f.result() for f in futures if f.done()]
            time.sleep(0.05)
        assert len(refused) == 6        # 2 wait (--max-waiting 2), the rest are refused at once
        for status, headers, body in refused:
            assert status == 503 and headers["Retry-After"] == "1", body
            assert body["error"]["code"] == "queue_full" and "--max-waiting 2" in body["error"]["message"]
        running.resp.close()            # the slot frees: the two waiting requests run
        results = [f.result(timeout=30) for f in futures]
    served = [body for status, _, body in results if status == 200]
    assert len(served) == 2 and all(b["choices"][0]["finish_reason"] == "length" for b in served)
    assert get(limited, "/health")[0] == 200
    assert metric(limited, "metrale_requests_rejected_total") >= 6


def test_request_timeout_ends_and_frees(limited):
    timeouts = metric(limited, 'metrale_requests_total{outcome="timeout"}')
    with cf.ThreadPoolExecutor(1) as pool:
        plain = pool.submit(post, limited, completion(1500))
        stream = Stream(limited, 1500)
        events = stream.rest()
        status, _, body = plain.result(timeout=30)
    # One ran 3 s, the other waited 3 s for the single slot: both end the same way.
    assert status == 504 and body["error"]["code"] == "request_timeout", body
    assert "--request-timeout 3 s" in body["error"]["message"]
    assert events[-1] == "[DONE]"
    assert events[-2]["error"]["code"] == "request_timeout"
    assert events[-3]["choices"][0]["finish_reason"] == "timeout"
    assert metric(limited, 'metrale_requests_total{outcome="timeout"}') == timeouts + 2
    deadline = time.time() + 5
    while metric(limited, "metrale_kv_cache_usage_ratio") > 0 and time.time() < deadline:
        time.sleep(0.1)
    assert metric(limited, "metrale_kv_cache_usage_ratio") == 0
    assert metric(limited, "metrale_num_requests_running") == 0
    ok = post(limited, completion(4))
    assert ok[0] == 200 and ok[2]["usage"]["completion_tokens"] == 4


@pytest.mark.timeout(420)   # the start may take up to 240 s on a loaded machine (`start`)
@pytest.mark.parametrize("launcher", [None, "mp", "ray"], ids=["ep1", "ep2-mp", "ep2-ray"])
def test_sigterm_drains_then_exits_0_without_orphans(launcher):
    """With Ray: a local Ray of its own (usage statistics off, temp dir under /tmp); its actor,
    raylet, GCS and helpers are all below the server process and must all be gone."""
    ep = [] if launcher is None else ["--ep", "2", "--launcher", launcher]
    env = run_env()
    ray_tmp = None
    if launcher == "ray":
        ray_tmp = tempfile.mkdtemp(prefix="mray", dir="/tmp")
        ep += ["--ray-temp-dir", ray_tmp]
        env["RAY_USAGE_STATS_ENABLED"] = "0"
        env.pop("RAY_ADDRESS", None)
    # The drain outlasts the short request's steps on a slow machine (an EP 2 step is ~20-40 ms
    # here, much more on a loaded host) and ends the long one (1900 tokens: 10 s and more at EP 1).
    proc, base = start("--drain-timeout", "4" if launcher is None else "10", *ep, env=env)
    kids = descendants(proc.pid)
    assert len(kids) >= (1 if ep else 0)
    try:
        long = Stream(base, 1900)   # the drain ends it
        assert long.next_event()["choices"][0]["finish_reason"] is None
        short = Stream(base, 8)     # some steps: it ends inside the drain, also on a slow machine
        assert short.next_event()["choices"][0]["finish_reason"] is None
        proc.send_signal(signal.SIGTERM)
        status, health = get(base, "/health")
        assert status == 503 and health["status"] == "draining"
        status, headers, body = post(base, completion(4))
        assert status == 503 and headers["Retry-After"] == "1" and body["error"]["code"] == "draining"
        finished = short.rest()                                   # it finishes inside the drain
        assert finished[-1] == "[DONE]" and finished[-2]["choices"][0]["finish_reason"] == "length"
        ended = long.rest()                                       # it does not: ended at the deadline
        assert ended[-1] == "[DONE]" and ended[-2]["error"]["code"] == "shutdown"
        assert ended[-3]["choices"][0]["finish_reason"] == "shutdown"
        assert proc.wait(timeout=60) == 0
        assert "stopped (1 request(s) ended by the drain)" in proc.stderr.read()
        deadline = time.time() + 15
        while any(alive(k) for k in kids) and time.time() < deadline:
            time.sleep(0.2)
        assert [k for k in kids if alive(k)] == []
    finally:
        if proc.poll() is None:
            proc.kill()
        for k in kids:
            if alive(k):
                os.kill(k, signal.SIGKILL)
        if ray_tmp is not None:
            shutil.rmtree(ray_tmp, ignore_errors=True)
