"""The OpenAI-compatible server, driven by the official openai client against a real process."""
from __future__ import annotations

import concurrent.futures as cf
import json
import re
import socket
import subprocess
import time
import urllib.error
import urllib.request

import pytest

from tests.conftest import metrale_cmd, run_env

API_KEY = "sk-test-123"
MODEL = "tiny"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(method: str, url: str, body: bytes | None = None, headers: dict | None = None, timeout: float = 30):
    req = urllib.request.Request(url, data=body, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def start_server(ckpt, *args: str) -> tuple[subprocess.Popen, str]:
    """`metrale serve` on `ckpt` (float64, served as MODEL with API_KEY); returns it and its base URL
    once /health answers."""
    port = free_port()
    proc = subprocess.Popen(metrale_cmd("serve", "--model", str(ckpt), "--port", str(port),
                                        "--served-model-name", MODEL, "--api-key", API_KEY, "--dtype", "float64",
                                        *args),
                            env=run_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 90
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {proc.stdout.read()}")
        try:
            if http("GET", base + "/health", timeout=2)[0] == 200:
                break
        except OSError:
            time.sleep(0.3)
    else:
        proc.kill()
        raise RuntimeError("server did not come up in 90 s")
    return proc, base


def stop_server(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()


@pytest.fixture(scope="module")
def server(ckpt_plain):
    proc, base = start_server(ckpt_plain, "--kv-cache-tokens", "4096", "--max-num-seqs", "16")
    yield base
    stop_server(proc)


def openai_client(base: str):
    """The official client against a test server (no retries: a failure shows at once)."""
    from openai import OpenAI
    return OpenAI(base_url=base + "/v1", api_key=API_KEY, timeout=60, max_retries=0)


@pytest.fixture
def client(server):
    return openai_client(server)


def test_completion_streamed_equals_plain_and_usage(client):
    plain = client.completions.create(model=MODEL, prompt="def main():", max_tokens=12, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert plain.choices[0].finish_reason == "length"
    assert plain.usage.completion_tokens == 12 and plain.usage.prompt_tokens > 0
    assert plain.usage.total_tokens == plain.usage.prompt_tokens + 12
    assert plain.usage.completion_tokens_details is None     # OpenAI's Predicted Outputs: not ours
    assert plain.usage.model_extra["metrale_spec_decode"] == {"num_drafts": 0, "num_draft_tokens": 0,
                                                              "num_accepted_tokens": 0}
    chunks = list(client.completions.create(model=MODEL, prompt="def main():", max_tokens=12, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks) == plain.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_chat_streamed_equals_plain(client):
    msgs = [{"role": "user", "content": "print hello"}]
    plain = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=10, temperature=0,
                                           extra_body={"ignore_eos": True})
    assert plain.choices[0].message.role == "assistant"
    chunks = list(client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=10, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 10


def test_api_key_required(server):
    from openai import AuthenticationError, OpenAI
    bad = OpenAI(base_url=server + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(AuthenticationError):
        bad.models.list()
    assert http("GET", server + "/v1/models")[0] == 401
    assert http("GET", server + "/health")[0] == 200  # health and metrics stay open


def test_models_and_health(client, server):
    assert [m.id for m in client.models.list().data] == [MODEL]
    status, body = http("GET", server + "/health")
    info = json.loads(body)
    assert status == 200 and info["status"] == "ok"
    assert info["ranks"][0]["rank"] == 0 and info["ranks"][0]["pid"] > 0


AUTH = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
BAD = [
    (b"{not json", 400, None),
    (json.dumps({"model": MODEL, "prompt": "x", "max_tokens": "ten"}).encode(), 400, "max_tokens"),
    (json.dumps({"prompt": "x"}).encode(), 400, "model"),
    (json.dumps({"model": MODEL}).encode(), 400, "prompt"),
    (json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 0}).encode(), 400, "max_tokens"),
    (json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 100000}).encode(), 400, "max_tokens"),
    (json.dumps({"model": MODEL, "prompt": "x", "temperature": -1}).encode(), 400, "temperature"),
    (json.dumps({"model": MODEL, "prompt": "x", "top_p": 0}).encode(), 400, "top_p"),
    (json.dumps({"model": MODEL, "prompt": "x", "top_p": 1.5}).encode(), 400, "top_p"),
    (json.dumps({"model": MODEL, "prompt": ""}).encode(), 400, "prompt"),
    (json.dumps({"model": MODEL, "prompt": "word " * 400}).encode(), 400, "prompt"),
    (json.dumps({"model": MODEL, "prompt": [1, 999999]}).encode(), 400, "prompt"),
    (json.dumps({"model": MODEL, "prompt": "x", "n": 0}).encode(), 400, "n"),
    (json.dumps({"model": MODEL, "prompt": "x", "stop": 5}).encode(), 400, "stop"),
    (json.dumps({"model": "other", "prompt": "x"}).encode(), 404, "model"),
    (json.dumps({"model": MODEL, "prompt": "x" * (2 << 20)}).encode(), 413, None),
]


@pytest.mark.parametrize("body, status, param", BAD, ids=[f"{i}-{b[2]}" for i, b in enumerate(BAD)])
def test_bad_input_is_a_named_4xx_and_server_stays_up(server, body, status, param):
    got, raw = http("POST", server + "/v1/completions", body, AUTH)
    assert got == status, raw[:300]
    err = json.loads(raw)["error"]
    assert err["message"] and err["type"]
    if param:
        assert err["param"] == param
    assert http("GET", server + "/health")[0] == 200


def test_bad_chat_messages(server):
    body = json.dumps({"model": MODEL, "messages": [{"role": "user"}]}).encode()
    got, raw = http("POST", server + "/v1/chat/completions", body, AUTH)
    assert got == 400 and json.loads(raw)["error"]["param"] == "messages[0].content"


def test_concurrent_requests_equal_one_at_a_time(client):
    prompts = [f"def f{i}(x):\n    return x" + " +" * (i % 5) for i in range(16)]

    def one(p):
        r = client.completions.create(model=MODEL, prompt=p, max_tokens=8, temperature=0,
                                      extra_body={"ignore_eos": True})
        return r.choices[0].text

    with cf.ThreadPoolExecutor(16) as pool:
        together = list(pool.map(one, prompts))
    assert together == [one(p) for p in prompts]


def metric(server, name: str) -> float:
    text = http("GET", server + "/metrics")[1].decode()
    total = 0.0
    for line in text.splitlines():
        m = re.match(rf"^{re.escape(name)}(\{{[^}}]*\}})? ([0-9.e+-]+)$", line)
        if m:
            total += float(m.group(2))
    return total


def test_metrics_move(client, server):
    before = metric(server, "metrale_requests_total")
    tokens_before = metric(server, "metrale_generation_tokens_total")
    client.completions.create(model=MODEL, prompt="import sys", max_tokens=5, temperature=0,
                              extra_body={"ignore_eos": True})
    assert metric(server, "metrale_requests_total") == before + 1
    assert metric(server, "metrale_generation_tokens_total") == tokens_before + 5
    assert metric(server, "metrale_request_latency_seconds_count") >= 1
    assert "metrale_kv_cache_usage_ratio" in http("GET", server + "/metrics")[1].decode()


def test_disconnect_cancels_and_frees_the_slot(server):
    body = json.dumps({"model": MODEL, "prompt": "while True:", "max_tokens": 200, "stream": True,
                       "ignore_eos": True, "temperature": 0}).encode()
    req = urllib.request.Request(server + "/v1/completions", data=body, method="POST", headers=AUTH)
    resp = urllib.request.urlopen(req, timeout=30)
    resp.readline()  # the first event arrived: the request is running
    resp.close()
    deadline = time.time() + 20
    while time.time() < deadline:
        text = http("GET", server + "/metrics")[1].decode()
        if 'outcome="cancelled"' in text and metric(server, "metrale_num_requests_running") == 0:
            break
        time.sleep(0.2)
    assert metric(server, "metrale_num_requests_running") == 0
    assert 'outcome="cancelled"' in http("GET", server + "/metrics")[1].decode()


def test_prefix_cache_reports_cached_tokens_and_counts_hits(client, server):
    """A later chat turn resends the conversation: its usage names the prompt tokens the prefix
    cache held (whole blocks, never the last token), and /metrics counts them."""
    hits, queried = (metric(server, f"metrale_prefix_cache_{x}_tokens_total") for x in ("hit", "queried"))
    msgs = [{"role": "system", "content": "You answer in Python only, with short functions and no prose. " * 2},
            {"role": "user", "content": "print hello"}]
    args = dict(model=MODEL, max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    first = client.chat.completions.create(messages=msgs, **args)
    msgs += [{"role": "assistant", "content": first.choices[0].message.content},
             {"role": "user", "content": "now add a loop"}]
    chunks = list(client.chat.completions.create(messages=msgs, stream=True, stream_options={"include_usage": True},
                                                 **args))
    second = chunks[-1].usage
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.prompt_tokens_details.cached_tokens
    assert cached >= 16 * ((first.usage.prompt_tokens - 1) // 16) and cached % 16 == 0
    assert cached <= second.prompt_tokens - 1
    assert metric(server, "metrale_prefix_cache_hit_tokens_total") == hits + cached
    assert metric(server, "metrale_prefix_cache_queried_tokens_total") == \
        queried + first.usage.prompt_tokens + second.prompt_tokens
