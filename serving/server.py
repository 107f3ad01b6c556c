"""The OpenAI-compatible HTTP server: an ASGI app (Starlette) over the engine thread, run by uvicorn.

Routes: POST /v1/completions, POST /v1/chat/completions (streamed as server-sent events or not),
GET /v1/models, GET /health, GET /metrics. Every refusal is a 4xx with an OpenAI-style error body
that names the field; the server keeps serving after each. A client that disconnects cancels its
request and frees its slot.
"""
from __future__ import annotations

import asyncio
import json
import os
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from serving.async_engine import AsyncEngine, RequestHandle, Update
from engine.engine import RequestError
from serving.openai_api import APIError, ParsedRequest, parse_request, render_chat
from serving.server_metrics import ServerMetrics

MAX_BODY_BYTES = 1 << 20
DRAIN_LIMIT_BYTES = 16 << 20   # an oversized body is read (and dropped) up to this before the 413


@dataclass(frozen=True, kw_only=True, slots=True)
class ServerConfig:
    served_model_name: str
    api_key: str | None = None
    chat_template: str | None = None
    max_body_bytes: int = MAX_BODY_BYTES


def load_chat_template(model_dir: Path) -> str | None:
    path = model_dir / "tokenizer_config.json"
    if path.is_file():
        template = json.loads(path.read_text()).get("chat_template")
        return template if isinstance(template, str) else None
    return None


class TextStream:
    """Text deltas of a sequence's output text, which its engine-side incremental detokenizer
    keeps (one decode of a short window per update, shared with stop strings). Until the end it
    holds back the last characters a stop string still to come could remove; the detokenizer
    itself never shows half a UTF-8 character."""

    def __init__(self, stops: tuple[str, ...] | None) -> None:
        self.holdback = max((len(s) for s in stops), default=1) - 1 if stops else 0
        self.sent = 0

    def delta(self, text: str, finished: bool) -> str:
        if not finished:
            text = text[:max(self.sent, len(text) - self.holdback)]
        out = text[self.sent:]
        self.sent = len(text)
        return out


def build_app(aengine: AsyncEngine, config: ServerConfig, metrics: ServerMetrics,
              ranks: Callable[[], list[dict]] | None = None) -> Starlette:
    engine = aengine.engine
    tokenizer = engine.tokenizer
    hostname = socket.gethostname()
    started = int(time.time())

    def error(exc: APIError) -> JSONResponse:
        metrics.rejected.labels(status=str(exc.status)).inc()
        return JSONResponse(exc.body(), status_code=exc.status)

    def check_auth(request: Request) -> None:
        if config.api_key is None:
            return
        if request.headers.get("authorization", "") != f"Bearer {config.api_key}":
            raise APIError(401, "invalid or missing API key (Authorization: Bearer KEY)",
                           type_="authentication_error", code="invalid_api_key")

    async def read_json(request: Request):
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > config.max_body_bytes:
            # Read what the client is sending anyway (up to a bound) before refusing: closing the
            # socket with unread bytes makes the client see a reset instead of the 413.
            drained = 0
            async for chunk in request.stream():
                drained += len(chunk)
                if drained > DRAIN_LIMIT_BYTES:
                    break
            raise APIError(413, f"request body of {declared} bytes exceeds {config.max_body_bytes}")
        body = b""
        async for chunk in request.stream():
            body += chunk
            if len(body) > config.max_body_bytes:
                raise APIError(413, f"request body exceeds {config.max_body_bytes} bytes")
        try:
            return json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise APIError(400, f"malformed JSON body: {exc}") from None

    def prompt_ids(req: ParsedRequest) -> list[int]:
        if req.messages is not None:
            return tokenizer.encode(render_chat(req.messages, config.chat_template))
        if isinstance(req.prompt, str):
            if tokenizer is None:
                raise APIError(400, "this model has no tokenizer: send the prompt as token ids", param="prompt")
            return tokenizer.encode(req.prompt)
        return list(req.prompt)

    async def generate(request: Request, chat: bool) -> Response:
        try:
            check_auth(request)
            body = await read_json(request)
            req = parse_request(body, chat=chat, default_max_tokens=16 if not chat else 256)
            if req.model != config.served_model_name:
                raise APIError(404, f"model {req.model!r} does not exist (serving {config.served_model_name!r})",
                               param="model", code="model_not_found")
            ids = prompt_ids(req)
            room = engine.max_model_len - len(ids)
            if len(ids) < engine.max_model_len and req.params.max_tokens > room:
                if chat and "max_tokens" not in body and "max_completion_tokens" not in body:
                    from dataclasses import replace
                    req = replace(req, params=replace(req.params, max_tokens=room))
                else:
                    raise APIError(400, f"'max_tokens': {req.params.max_tokens} exceeds the {room} tokens left in "
                                        f"the context of {engine.max_model_len} after a {len(ids)}-token prompt",
                                   param="max_tokens")
            try:
                handle = await aengine.submit(ids, req.params)
            except RequestError as exc:
                raise APIError(400, str(exc), param="messages" if chat else "prompt") from None
        except APIError as exc:
            return error(exc)
        except ClientDisconnect:
            return Response(status_code=499)
        metrics.prompt_tokens.inc(len(ids))
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        if req.stream:
            return StreamingResponse(stream(request, handle, req, rid, chat, len(ids)),
                                     media_type="text/event-stream")
        return await complete(request, handle, req, rid, chat, len(ids))

    async def next_update(request: Request, handle: RequestHandle) -> Update | None:
        """The next update, or None when the client went away (the request is then aborted)."""
        while True:
            try:
                item = await asyncio.wait_for(handle.updates.get(), timeout=0.25)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    aengine.abort(handle)
                    metrics.requests.labels(outcome="cancelled").inc()
                    return None
                continue
            if isinstance(item, BaseException):
                raise item
            return item

    def usage(seq, prompt_len: int) -> dict:
        return {"prompt_tokens": prompt_len, "completion_tokens": seq.num_output,
                "total_tokens": prompt_len + seq.num_output,
                "completion_tokens_details": {"accepted_prediction_tokens": seq.accepted_tokens,
                                              "rejected_prediction_tokens": seq.drafted_tokens - seq.accepted_tokens}}

    def finished(seq) -> None:
        metrics.requests.labels(outcome=seq.finish_reason or "unknown").inc()
        metrics.generation_tokens.inc(seq.num_output)
        if seq.finish_time is not None:
            metrics.latency.observe(seq.finish_time - seq.arrival_time)
        if seq.first_token_time is not None:
            metrics.ttft.observe(seq.first_token_time - seq.arrival_time)

    async def complete(request, handle, req, rid, chat, prompt_len) -> Response:
        try:
            while True:
                upd = await next_update(request, handle)
                if upd is None:
                    return Response(status_code=499)
                if upd.finished:
                    break
        except Exception as exc:
            return JSONResponse(APIError(500, f"generation failed: {exc}", type_="server_error").body(), 500)
        seq = handle.seq
        finished(seq)
        created = int(time.time())
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": seq.text},
                      "finish_reason": seq.finish_reason, "logprobs": None}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": seq.text, "finish_reason": seq.finish_reason, "logprobs": None}
            obj = "text_completion"
        return JSONResponse({"id": rid, "object": obj, "created": created, "model": config.served_model_name,
                             "choices": [choice], "usage": usage(seq, prompt_len)})

    async def stream(request, handle, req, rid, chat, prompt_len):
        created = int(time.time())
        obj = "chat.completion.chunk" if chat else "text_completion"
        text = TextStream(req.params.stop)

        def event(delta: str | None, finish: str | None, role: bool = False) -> str:
            if chat:
                d = {"role": "assistant", "content": ""} if role else ({"content": delta} if delta else {})
                choice = {"index": 0, "delta": d, "finish_reason": finish, "logprobs": None}
            else:
                choice = {"index": 0, "text": delta or "", "finish_reason": finish, "logprobs": None}
            return "data: " + json.dumps({"id": rid, "object": obj, "created": created,
                                          "model": config.served_model_name, "choices": [choice]}) + "\n\n"

        if chat:
            yield event(None, None, role=True)
        try:
            while True:
                upd = await next_update(request, handle)
                if upd is None:
                    return
                seq = handle.seq
                delta = text.delta(seq.text, upd.finished)
                if delta or upd.finished:
                    yield event(delta, seq.finish_reason if upd.finished else None)
                if upd.finished:
                    break
        except asyncio.CancelledError:
            aengine.abort(handle)
            metrics.requests.labels(outcome="cancelled").inc()
            raise
        except Exception as exc:
            yield "data: " + json.dumps(APIError(500, f"generation failed: {exc}", type_="server_error").body()) + "\n\n"
            return
        finished(handle.seq)
        if req.include_usage:
            yield "data: " + json.dumps({"id": rid, "object": obj, "created": created,
                                         "model": config.served_model_name, "choices": [],
                                         "usage": usage(handle.seq, prompt_len)}) + "\n\n"
        yield "data: [DONE]\n\n"

    async def completions(request: Request) -> Response:
        return await generate(request, chat=False)

    async def chat_completions(request: Request) -> Response:
        return await generate(request, chat=True)

    async def models(request: Request) -> Response:
        try:
            check_auth(request)
        except APIError as exc:
            return error(exc)
        return JSONResponse({"object": "list", "data": [{"id": config.served_model_name, "object": "model",
                                                         "created": started, "owned_by": "metrale",
                                                         "max_model_len": engine.max_model_len}]})

    async def health(request: Request) -> Response:
        ok = aengine.error is None
        return JSONResponse({"status": "ok" if ok else "error", "model": config.served_model_name,
                             "ranks": ranks() if ranks is not None else
                                       [{"rank": 0, "pid": os.getpid(), "host": hostname, "node": hostname}]},
                            status_code=200 if ok else 503)

    async def prometheus(request: Request) -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    async def not_found(request: Request, exc) -> Response:
        return error(APIError(404, f"no route {request.method} {request.url.path}", code="not_found"))

    async def bad_method(request: Request, exc) -> Response:
        return error(APIError(405, f"method {request.method} not allowed on {request.url.path}"))

    routes = [Route("/v1/completions", completions, methods=["POST"]),
              Route("/v1/chat/completions", chat_completions, methods=["POST"]),
              Route("/v1/models", models, methods=["GET"]),
              Route("/health", health, methods=["GET"]),
              Route("/metrics", prometheus, methods=["GET"])]
    return Starlette(routes=routes, exception_handlers={404: not_found, 405: bad_method})


def serve(llm, *, host: str, port: int, config: ServerConfig) -> None:
    """Run the server until interrupted; the engine thread stops with it."""
    import uvicorn
    metrics = ServerMetrics()
    deployment = llm.deployment

    def observe(engine) -> None:
        metrics.observe_engine(engine)
        if deployment.is_supervised:
            metrics.observe_deployment(deployment)

    aengine = AsyncEngine(llm.engine, deployment, on_step=observe)
    app = build_app(aengine, config, metrics, ranks=lambda: llm.rank_info)
    try:
        uvicorn.run(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=5)
    finally:
        aengine.shutdown()
