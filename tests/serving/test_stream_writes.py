"""The streamed response's cost per token (issue 44): one write per wakeup of the event loop,
carrying every event the steps since the last write produced, encoded from a template, never a
`json.dumps` of each chunk. Driven through the ASGI app in process, without sockets."""
from __future__ import annotations

import asyncio
import json

import pytest

from serving import responses
from serving.responses import EventEncoder
from serving.server import ServerConfig, build_app
from serving.server_metrics import ServerMetrics
from tests.serving.engine_thread import start_counted_engine

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def served(ckpt_plain):
    """An engine loop on its own thread (which built the engine), and the ASGI app over it."""
    box, thread = start_counted_engine(ckpt_plain)
    app = build_app(box["aengine"], ServerConfig(served_model_name="tiny"), ServerMetrics())
    yield app, box
    box["aengine"].shutdown()
    thread.join(timeout=60)


def post(app, body: dict, hold: asyncio.Event | None = None) -> list[dict]:
    """POST /v1/completions through the app; returns the ASGI messages it sent. `hold`: the first
    body write waits for it (a client, or a loop, that fell behind)."""
    async def main() -> list[dict]:
        raw = json.JSONEncoder().encode(body).encode()   # not json.dumps, which the test counts
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
                 "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions", "root_path": "",
                 "query_string": b"", "headers": [(b"content-type", b"application/json"),
                                                  (b"content-length", str(len(raw)).encode())],
                 "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2)}
        sent: list[dict] = []
        got_body = [False]
        done = asyncio.Event()

        async def receive() -> dict:
            if not got_body[0]:
                got_body[0] = True
                return {"type": "http.request", "body": raw, "more_body": False}
            await done.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            if message["type"] == "http.response.body" and hold is not None and not hold.is_set():
                await asyncio.sleep(0)
                while not hold.is_set():
                    await asyncio.sleep(0.01)
            sent.append(message)
            if message["type"] == "http.response.body" and not message.get("more_body"):
                done.set()
        await asyncio.wait_for(app(scope, receive, send), timeout=120)
        return sent
    return asyncio.run(main())


def events(sent: list[dict]) -> list[dict | str]:
    data = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body").decode()
    assert data.endswith("\n\n")
    out = []
    for block in data.split("\n\n")[:-1]:
        assert block.startswith("data: "), block
        out.append(block[6:] if block == "data: [DONE]" else json.loads(block[6:]))
    return out


def test_stream_writes_once_a_wakeup_without_json_dumps_per_token(served, monkeypatch):
    app, box = served
    calls = []
    dumps = json.dumps

    def counted(*a, **k):
        calls.append(a[0])
        return dumps(*a, **k)
    monkeypatch.setattr(responses.json, "dumps", counted)
    body = {"model": "tiny", "prompt": [5, 17, 42, 99, 7], "max_tokens": MAX_TOKENS, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    steps0 = box["steps"]
    sent = post(app, body)
    steps = box["steps"] - steps0
    evs = events(sent)
    assert evs[-1] == "[DONE]" and evs[-2]["usage"]["completion_tokens"] == MAX_TOKENS
    chunks = evs[:-2]
    assert chunks[0]["choices"][0]["text"] is not None                 # the first token's chunk, always
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all(c["object"] == "text_completion" and c["model"] == "tiny" and c["id"] == evs[0]["id"] for c in chunks)
    # json.dumps: the template's head and the usage event, not one per token (was 1 + MAX_TOKENS + 1)
    assert len(calls) <= 2, len(calls)
    writes = [m for m in sent if m["type"] == "http.response.body"]
    assert 1 < len(writes) <= steps + 1, (len(writes), steps)          # at most one write a step

    # A writer that fell behind sends everything queued meanwhile in one write.
    hold = asyncio.Event()
    held = [0]

    def release(_engine=None):
        held[0] += 1
        if held[0] >= MAX_TOKENS + 2:
            hold.set()
    step = box["aengine"].deployment.step
    box["aengine"].deployment.step = lambda engine: (release(), step(engine))[1]
    try:
        sent = post(app, {**body, "stream_options": None}, hold)
    finally:
        box["aengine"].deployment.step = step
    writes = [m for m in sent if m["type"] == "http.response.body"]
    assert len(writes) <= 3, [m["body"][:80] for m in writes]
    assert sum(c["choices"][0]["finish_reason"] == "length" for c in events(sent)[:-1]) == 1


@pytest.mark.parametrize("choice", [
    {"index": 0, "text": 'a "quoted" \\ line\n\u00e9\u2028', "logprobs": None, "finish_reason": None},
    {"index": 7, "text": "", "logprobs": None, "finish_reason": "length"},
    {"index": 0, "delta": {"content": "x\ty"}, "logprobs": None, "finish_reason": None},
    {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "tool_calls"},
    {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None},
    {"index": 0, "text": "x", "logprobs": {"tokens": ["x"], "token_logprobs": [-0.5]}, "finish_reason": None},
])
def test_event_template_writes_what_json_dumps_writes(choice):
    head = {"id": 'cmpl-"1"', "object": "text_completion", "created": 17, "model": "m\u00f6del"}
    enc = EventEncoder(head["id"], head["object"], head["created"], head["model"])
    assert enc.event([choice]) == "data: " + json.dumps({**head, "choices": [choice]}) + "\n\n"
    usage = {"prompt_tokens": 3, "completion_tokens": 1}
    assert enc.event([], usage=usage) == "data: " + json.dumps({**head, "choices": [], "usage": usage}) + "\n\n"
