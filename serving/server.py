"""The OpenAI-compatible HTTP server: an ASGI app (Starlette) over the engine thread, run by uvicorn.

Routes: POST /v1/completions, POST /v1/chat/completions (streamed as server-sent events or not),
GET /v1/models, GET /health, GET /metrics. Every refusal is a 4xx with an OpenAI-style error body
that names the field; the server keeps serving after each. A client that disconnects cancels its
request and frees its slots.

Load and shutdown (serving.async_engine.QueueLimits, serving.lifecycle): a request that would
take the waiting queue past `max_waiting` sequences, and every request during a drain, is a 503
with `Retry-After`. A request ended by `request_timeout_s` is a 504 (streaming: its choices end
with finish reason `timeout`, then an error event); one ended by the drain's deadline a 503
(streaming: finish reason `shutdown`, then an error event).

A request becomes best_of (= n unless asked) sequences per prompt, all submitted together; choice
i of a seeded request samples with `choice_seed(seed, i)`. Choices are indexed prompt-major
(prompt p, choice j: index p * n + j); a stream sends each choice's chunks as its tokens commit,
the choices of one engine step in index order.
"""
from __future__ import annotations

import asyncio
import json
import os
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from engine.engine import RequestError
from runtime.sample.sampler import SamplingParams, choice_seed
from serving.async_engine import (
    SHUTDOWN,
    TIMEOUT,
    AsyncEngine,
    QueueFull,
    QueueLimits,
    RequestHandle,
    Update,
)
from serving.chat import ChatPlan, plan_chat
from serving.chat_template import GLM45_TEMPLATE, ChatTemplate
from serving.lifecycle import DEFAULT_DRAIN_TIMEOUT_S, Drain, run_server
from serving.openai_api import (
    APIError,
    ParsedRequest,
    parse_request,
    with_max_tokens,
)
from serving.responses import (
    ChoiceStream,
    EventEncoder,
    TokenText,
    best_sequences,
    chat_choice,
    completion_choice,
    usage,
)
from serving.server_metrics import ServerMetrics

MAX_BODY_BYTES = 1 << 20
DRAIN_LIMIT_BYTES = 16 << 20   # an oversized body is read (and dropped) up to this before the 413
RETRY_AFTER_S = 1              # what a 503 tells the client to wait before trying again
SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]
DISCONNECT_POLL_S = 0.25       # how often a request waiting on the engine checks for its client


if hasattr(asyncio, "timeout"):     # Python 3.11+: a timer handle on the running task
    async def wait_at_most(awaitable, seconds: float):
        async with asyncio.timeout(seconds):
            return await awaitable
else:                               # 3.10: wait_for (a task per wait)
    async def wait_at_most(awaitable, seconds: float):
        return await asyncio.wait_for(awaitable, seconds)


@dataclass(frozen=True, kw_only=True, slots=True)
class ServerConfig:
    served_model_name: str
    api_key: str | None = None
    chat_template: ChatTemplate | None = None   # None: the GLM-4.5-format default (serving.chat_template)
    tool_call_parser: str | None = None         # serving.tool_parsers format; None: calls are not parsed
    reasoning_parser: str | None = None         # serving.reasoning parser; None: no reasoning split
    max_body_bytes: int = MAX_BODY_BYTES
    limits: QueueLimits = field(default_factory=QueueLimits)
    drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S

    def __post_init__(self) -> None:
        if not self.drain_timeout_s >= 0:
            raise ValueError(f"drain_timeout_s={self.drain_timeout_s!r} must be at least 0 seconds")


def build_app(aengine: AsyncEngine, config: ServerConfig, metrics: ServerMetrics,
              ranks: Callable[[], list[dict]] | None = None, drain: Drain | None = None) -> Starlette:
    """`drain`: the server's shutdown state (serving.lifecycle); None: this app never drains."""
    engine = aengine.engine
    tokenizer = engine.tokenizer
    hostname = socket.gethostname()
    started = int(time.time())

    def error(exc: APIError) -> JSONResponse:
        metrics.rejected.labels(status=str(exc.status)).inc()
        headers = {"Retry-After": str(RETRY_AFTER_S)} if exc.status == 503 else None
        return JSONResponse(exc.body(), status_code=exc.status, headers=headers)

    def draining() -> bool:
        return drain is not None and drain.check()

    def ended_error(handle: RequestHandle) -> APIError | None:
        """Why the server ended this request before it finished (timeout, shutdown), or None."""
        reasons = {s.finish_reason for s in handle.seqs}
        num_output = sum(s.num_output for s in handle.seqs)
        if TIMEOUT in reasons:
            return APIError(504, f"the request did not finish within --request-timeout "
                                 f"{config.limits.request_timeout_s:g} s and was aborted after {num_output} "
                                 "generated token(s)", type_="server_error", code="request_timeout")
        if SHUTDOWN in reasons:
            return APIError(503, f"the server shut down before the request finished (--drain-timeout "
                                 f"{config.drain_timeout_s:g} s passed) after {num_output} generated token(s)",
                            type_="server_error", code="shutdown")
        return None

    def check_auth(request: Request) -> None:
        if config.api_key is None:
            return
        if request.headers.get("authorization", "") != f"Bearer {config.api_key}":
            raise APIError(401, "invalid or missing API key (Authorization: Bearer KEY)",
                           type_="authentication_error", code="invalid_api_key")

    async def read_json(request: Request):
        ctype = request.headers.get("content-type")
        if ctype is not None:
            media = ctype.split(";", 1)[0].strip().lower()
            if media != "application/json" and not media.endswith("+json"):
                raise APIError(415, f"Content-Type {ctype!r} is not supported: send the body as application/json")
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

    text_of = TokenText(tokenizer)
    template = config.chat_template or ChatTemplate(GLM45_TEMPLATE, "default (GLM-4.5 format)")

    def encode(prompt: str | list[int], chat: bool = False) -> list[int]:
        if isinstance(prompt, str):
            if tokenizer is None:
                raise APIError(400, "this model has no tokenizer: send the prompt as token ids",
                               param="messages" if chat else "prompt")
            # a chat template writes the special tokens itself (BOS included)
            return tokenizer.encode(prompt, add_special_tokens=not chat)
        return list(prompt)

    def echo_text(prompt: str | list[int]) -> str:
        if isinstance(prompt, str):
            return prompt
        return tokenizer.decode(prompt) if tokenizer is not None else ""

    def fit(req: ParsedRequest, ids: list[int], chat: bool) -> SamplingParams:
        """The params of one prompt: a chat request without a limit gets the room left in the context."""
        room = engine.max_model_len - len(ids)
        if len(ids) < engine.max_model_len and req.params.max_tokens > room:
            if chat and not req.max_tokens_given:
                return with_max_tokens(req.params, room, chat)
            raise APIError(400, f"'{req.max_key}': {req.params.max_tokens} exceeds the {room} tokens left in "
                                f"the context of {engine.max_model_len} after a {len(ids)}-token prompt",
                           param=req.max_key)
        return req.params

    async def generate(request: Request, chat: bool) -> Response:
        try:
            if draining():
                raise APIError(503, "the server is shutting down and takes no new requests",
                               type_="server_error", code="draining")
            check_auth(request)
            body = await read_json(request)
            req = parse_request(body, chat=chat, default_max_tokens=16 if not chat else 256,
                                vocab_size=engine.model_config.vocab_size)
            if req.model != config.served_model_name:
                raise APIError(404, f"model {req.model!r} does not exist (serving {config.served_model_name!r})",
                               param="model", code="model_not_found")
            plan = None
            if chat:
                plan = plan_chat(req.messages, req.chat, template, tool_parser=config.tool_call_parser,
                                 reasoning_parser=config.reasoning_parser, structured=req.params.structured,
                                 structured_field=req.structured_field)
                if plan.structured is not req.params.structured:
                    req = replace(req, params=replace(req.params, structured=plan.structured),
                                  structured_field="tool_choice" if req.chat.tool_choice in ("required", "function")
                                  else req.chat.budget_field if req.chat.reasoning_budget is not None
                                  else req.structured_field)
                prompts = [encode(plan.prompt, chat=True)]
            else:
                prompts = [encode(p) for p in req.prompts]
            seqs = []
            for ids in prompts:
                params = fit(req, ids, chat)
                seqs += [(ids, params if params.seed is None else replace(params, seed=choice_seed(params.seed, i)))
                         for i in range(req.best_of)]
            try:
                handle = await aengine.submit(seqs, progress=req.stream)   # non-streaming: told at the end
            except QueueFull as exc:
                raise APIError(503, f"the server is overloaded: {exc}; retry later",
                               type_="server_error", code="queue_full") from None
            except RequestError as exc:
                param = {"prompt": "messages" if chat else "prompt",
                         "structured": req.structured_field}.get(exc.param, exc.param)
                message = str(exc) if exc.param != "structured" else f"'{param}': {exc}"
                raise APIError(400, message, param=param) from None
        except APIError as exc:
            return error(exc)
        except ClientDisconnect:
            return Response(status_code=499)
        num_prompt_tokens = sum(len(ids) for ids in prompts)
        metrics.prompt_tokens.inc(num_prompt_tokens)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        echoes = [echo_text(p) if req.echo else None for p in req.prompts] or [None]
        if req.stream:
            return stream(handle, req, rid, plan, num_prompt_tokens, echoes)
        return await complete(request, handle, req, rid, plan, num_prompt_tokens, echoes)

    async def next_update(request: Request, handle: RequestHandle) -> list[Update] | None:
        """The next step's updates, or None when the client went away (the request is then aborted).
        Per streamed token this runs on the event loop: it waits under a timer handle
        (`asyncio.timeout`), not a task of its own (`wait_for`), and not at all when an update is
        already there."""
        while True:
            if handle.updates.empty():
                try:
                    item = await wait_at_most(handle.updates.get(), DISCONNECT_POLL_S)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        aengine.abort(handle)
                        metrics.requests.labels(outcome="cancelled").inc()
                        return None
                    continue
            else:
                item = handle.updates.get_nowait()
            if isinstance(item, BaseException):
                raise item
            return item

    def finished(seq) -> None:
        metrics.requests.labels(outcome=seq.finish_reason or "unknown").inc()
        metrics.generation_tokens.inc(seq.num_output)
        if seq.finish_time is not None:
            metrics.latency.observe(seq.finish_time - seq.arrival_time)
        if seq.first_token_time is not None:
            metrics.ttft.observe(seq.first_token_time - seq.arrival_time)

    async def complete(request, handle, req, rid, plan: ChatPlan | None, num_prompt_tokens, echoes) -> Response:
        chat = plan is not None
        remaining = len(handle.seqs)
        try:
            while remaining:
                updates = await next_update(request, handle)
                if updates is None:
                    return Response(status_code=499)
                remaining -= sum(u.finished for u in updates)
        except Exception as exc:
            return JSONResponse(APIError(500, f"generation failed: {exc}", type_="server_error").body(), 500)
        for seq in handle.seqs:
            finished(seq)
        ended = ended_error(handle)
        if ended is not None:
            return error(ended)
        choices = []
        show = req.logprobs is not None
        for p, echo in enumerate(echoes):
            group = best_sequences(handle.seqs[p * req.best_of:(p + 1) * req.best_of], req.n)
            for j, seq in enumerate(group):
                index = p * req.n + j
                choices.append(chat_choice(index, seq, text_of, logprobs=show, plan=plan) if chat else
                               completion_choice(index, seq, text_of, echo=echo, logprobs=show))
        return JSONResponse({"id": rid, "object": "chat.completion" if chat else "text_completion",
                             "created": int(time.time()), "model": config.served_model_name,
                             "choices": choices, "usage": usage(handle.seqs, num_prompt_tokens, req.best_of)})

    def stream(handle, req, rid, plan: ChatPlan | None, num_prompt_tokens, echoes):
        """The streamed response, an ASGI app of its own. Per engine step a client gets one write
        carrying every event of that step (several steps' when the loop fell behind), encoded from
        a template (`EventEncoder`); it waits on its queue alone, while one task per request
        listens for the client going away. Starlette's StreamingResponse cost a task switch, a
        timer and a `json.dumps` of the whole chunk per token, on the step's cores."""
        chat = plan is not None
        enc = EventEncoder(rid, "chat.completion.chunk" if chat else "text_completion", int(time.time()),
                           config.served_model_name)
        # best_of == n when streaming: sequence k is choice k. The engine thread sets handle.seqs[k]
        # before the first update of sequence k, so a choice reads its sequence only from then on.
        choices = [ChoiceStream(k, text_of, stops=req.params.stop, chat=chat, plan=plan, echo=echoes[k // req.n],
                                logprobs=req.logprobs is not None) for k in range(len(handle.seqs))]

        def events(updates: list[Update], out: list[str]) -> int:
            """Append the events of one step's updates; returns how many choices ended."""
            ended = 0
            for u in updates:
                chunk = choices[u.index].next(handle.seqs[u.index], u.num_output, u.finished)
                if chunk is not None:
                    out.append(enc.event([chunk]))
                ended += u.finished
            return ended

        def last_events(out: list[str]) -> None:
            for seq in handle.seqs:
                finished(seq)
            ended = ended_error(handle)
            if ended is not None:   # the choices ended with finish reason timeout/shutdown; say why
                metrics.rejected.labels(status=str(ended.status)).inc()
                out.append("data: " + json.dumps(ended.body()) + "\n\n")
            elif req.include_usage:
                out.append(enc.event([], usage=usage(handle.seqs, num_prompt_tokens, req.best_of)))
            out.append("data: [DONE]\n\n")

        async def app(scope, receive, send) -> None:
            async def listen() -> None:     # the client went away: wake the writer, which aborts
                while (await receive())["type"] != "http.disconnect":
                    pass
                handle.updates.put_nowait(None)

            await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
            listener = asyncio.ensure_future(listen())
            out = [enc.event([c.role()]) for c in choices] if chat else []
            remaining = len(choices)
            try:
                try:
                    while remaining:
                        if out:
                            await send({"type": "http.response.body", "body": "".join(out).encode(), "more_body": True})
                            out.clear()
                        item = await handle.updates.get()
                        while True:     # every update already queued goes in this write
                            if item is None:
                                aengine.abort(handle)
                                metrics.requests.labels(outcome="cancelled").inc()
                                return
                            if isinstance(item, BaseException):
                                raise item
                            remaining -= events(item, out)
                            if not remaining or handle.updates.empty():
                                break
                            item = handle.updates.get_nowait()
                except asyncio.CancelledError:
                    aengine.abort(handle)
                    metrics.requests.labels(outcome="cancelled").inc()
                    raise
                except Exception as exc:
                    out.append("data: " + json.dumps(APIError(500, f"generation failed: {exc}",
                                                              type_="server_error").body()) + "\n\n")
                else:
                    last_events(out)
            finally:
                listener.cancel()
            await send({"type": "http.response.body", "body": "".join(out).encode(), "more_body": False})
        return app

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
        ok = aengine.error is None and not draining()
        status = "ok" if ok else "error" if aengine.error is not None else "draining"
        return JSONResponse({"status": status, "model": config.served_model_name,
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


def serve(llm, *, host: str, port: int, config: ServerConfig) -> Drain:
    """Run the server until a signal's drain ends it (serving.lifecycle). Call it on the thread
    that built (and warmed up) `llm`: the engine loop runs here, the event loop on a thread of its
    own. Returns the finished drain (how many requests it had to end)."""
    metrics = ServerMetrics()
    deployment = llm.deployment

    def observe(engine) -> None:
        metrics.observe_engine(engine)
        metrics.observe_experts(deployment, idle=not engine.scheduler.running and not engine.scheduler.waiting)
        if deployment.is_supervised:
            metrics.observe_deployment(deployment)

    aengine = AsyncEngine(llm.engine, deployment, on_step=observe, limits=config.limits)
    drain = Drain(aengine, config.drain_timeout_s)
    app = build_app(aengine, config, metrics, ranks=lambda: llm.rank_info, drain=drain)
    run_server(app, host=host, port=port, drain=drain)
    return drain
