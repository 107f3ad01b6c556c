"""OpenAI request bodies -> prompts and SamplingParams, with errors that name the field.

Each endpoint has a whitelist of the fields it implements; any other field, and any known field
this server does not implement (suffix), is a 400 naming it. Nothing is accepted and then
ignored, except `user`, which only labels a request.

Chat messages: roles system, developer (rendered as system), user, assistant (content may be null
when it has tool_calls; reasoning_content is passed to the template) and tool (tool_call_id).
`content` is a string or a list of OpenAI content parts: text parts are joined with newlines (as
vLLM does); any other part type is a 400 naming it. Tool calls: `tools` (functions with a JSON
schema), `tool_choice` (auto, none, required, or a named function), `parallel_tool_calls`; the
chat template's extras in `chat_template_kwargs`; reasoning: `include_reasoning`, and a budget
in `max_reasoning_tokens` (or its alias `thinking_budget`). See serving.chat for what they do.

Structured outputs, on both endpoints, in one of two shapes (not both in one request):
- OpenAI's `response_format`: {"type": "text"}, {"type": "json_object"}, or {"type": "json_schema",
  "json_schema": {"name": ..., "schema": {...}, "strict": true, "description": ...}};
- vLLM's `structured_outputs` with exactly one of {"json": schema object or JSON text},
  {"regex": "..."}, {"choice": ["a", "b"]}, {"json_object": true}.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from typing import Any

from runtime.sample.grammar import StructuredOutput
from runtime.sample.sampler import MAX_LOGPROBS, SamplingParamError, SamplingParams

MAX_N = 128
MAX_SEQS_PER_REQUEST = 256      # prompts x best_of

_SAMPLING = {"model", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options", "stop", "seed",
             "presence_penalty", "frequency_penalty", "logit_bias", "user", "response_format",
             "top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos",
             "structured_outputs"}    # the last six: vLLM's
COMPLETION_FIELDS = _SAMPLING | {"prompt", "logprobs", "echo", "best_of", "suffix"}
CHAT_FIELDS = _SAMPLING | {"messages", "logprobs", "top_logprobs", "max_completion_tokens", "tools", "tool_choice",
                           "parallel_tool_calls", "chat_template_kwargs", "add_generation_prompt",
                           "include_reasoning", "max_reasoning_tokens", "thinking_budget"}
# Known fields this server refuses whenever they carry a value.
REFUSED = {"suffix": "suffix (insertion) is not supported"}
MESSAGE_ROLES = ("system", "user", "assistant", "tool", "developer")
MESSAGE_FIELDS = {"role", "content", "name", "tool_calls", "tool_call_id", "reasoning_content", "refusal"}
TOOL_CHOICES = ("auto", "none", "required")


class APIError(Exception):
    """An OpenAI-style error: HTTP status, message, the offending field."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 type_: str = "invalid_request_error", code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type_, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    model: str
    prompts: list[str | list[int]]      # completions: one or more; chat: none (see messages)
    structured_field: str               # the field that asked for a structured output (for errors)
    messages: list[dict] | None
    chat: ChatOptions | None            # chat: tools, tool_choice, template kwargs, reasoning options
    params: SamplingParams              # every choice's, before its seed is derived (choice_seed)
    n: int                              # choices returned per prompt
    best_of: int                        # sequences generated per prompt (>= n; the best n by cumulative logprob)
    echo: bool
    logprobs: int | None                # top alternatives shown per token; None: no logprobs in the response
    stream: bool
    include_usage: bool
    max_key: str                        # the field that set max_tokens (chat: max_completion_tokens or max_tokens)
    max_tokens_given: bool


def bad(field: str, message: str) -> APIError:
    return APIError(400, f"'{field}': {message}", param=field)


def _get(body: dict, field: str, types: tuple[type, ...], default: Any, *, name: str) -> Any:
    value = body.get(field)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in types:
        raise bad(field, f"expected {name}, got a boolean")
    if not isinstance(value, types):
        raise bad(field, f"expected {name}, got {type(value).__name__}")
    return value


def _number(body: dict, field: str, default: float, lo: float, hi: float) -> float:
    value = float(_get(body, field, (int, float), default, name="a number"))
    if not lo <= value <= hi:
        raise bad(field, f"must be in [{lo:g}, {hi:g}], got {value:g}")
    return value


def _is_ids(x: Any) -> bool:
    return isinstance(x, list) and bool(x) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)


def parse_prompts(prompt: Any) -> list[str | list[int]]:
    """A string, a list of token ids, or a non-empty list of either (not mixed)."""
    if prompt is None:
        raise bad("prompt", "a prompt (string, token ids, or a list of either) is required")
    if isinstance(prompt, str) or _is_ids(prompt):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and (all(isinstance(p, str) for p in prompt)
                                                 or all(isinstance(p, list) for p in prompt)):
        prompts = list(prompt)
    elif isinstance(prompt, list) and not prompt:
        raise bad("prompt", "the prompt is empty")
    else:
        raise bad("prompt", "expected a string, a list of token ids, or a list of strings or of token id lists")
    for i, p in enumerate(prompts):
        if not p:
            raise bad("prompt", "the prompt is empty" if len(prompts) == 1 else f"prompt {i} is empty")
        if isinstance(p, list) and not _is_ids(p):
            raise bad("prompt", f"prompt {i} must be a list of integer token ids")
    return prompts


def _content(value: Any, field: str, *, nullable: bool) -> str | None:
    """A message's content: a string, or a list of OpenAI content parts whose text parts are joined
    with newlines; null only where `nullable` (an assistant message with tool calls)."""
    if value is None and nullable:
        return None
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise bad(field, f"expected a string or a list of content parts, got {type(value).__name__}")
    texts = []
    for j, part in enumerate(value):
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise bad(f"{field}[{j}]", "expected a content part object with a string 'type'")
        if part["type"] != "text":
            raise bad(f"{field}[{j}].type", f"content parts of type {part['type']!r} are not supported "
                                            "(only 'text': this model reads text)")
        if not isinstance(part.get("text"), str):
            raise bad(f"{field}[{j}].text", "a text part needs a string 'text'")
        texts.append(part["text"])
    return "\n".join(texts)


def _tool_calls(value: Any, field: str) -> list[dict]:
    """An assistant message's tool_calls, for the template: arguments as an object when they are
    a JSON object's text (templates iterate over them), else the text as given."""
    if not isinstance(value, list):
        raise bad(field, "expected a list of tool calls")
    out = []
    for j, call in enumerate(value):
        f = call.get("function") if isinstance(call, dict) else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str):
            raise bad(f"{field}[{j}]", "expected {id, type: 'function', function: {name, arguments}}")
        args = f.get("arguments", "{}")
        if isinstance(args, str):
            try:
                parsed = json.loads(args)
            except ValueError:
                parsed = None
            args = parsed if isinstance(parsed, dict) else args
        elif not isinstance(args, dict):
            raise bad(f"{field}[{j}].function.arguments", "expected the arguments' JSON text")
        out.append({"id": call.get("id"), "type": "function", "function": {"name": f["name"], "arguments": args}})
    return out


def parse_messages(messages: Any) -> list[dict]:
    """The request's messages as the chat template reads them (content as text, developer as system)."""
    if not isinstance(messages, list) or not messages:
        raise bad("messages", "a non-empty list of {role, content} objects is required")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad(f"messages[{i}]", "expected an object with a string 'role'")
        role = m["role"]
        if role not in MESSAGE_ROLES:
            raise bad(f"messages[{i}].role", f"unknown role {role!r} (one of {', '.join(MESSAGE_ROLES)})")
        extra = sorted(set(m) - MESSAGE_FIELDS)
        if extra:
            raise bad(f"messages[{i}].{extra[0]}", f"is not a field of a message ({', '.join(sorted(MESSAGE_FIELDS))})")
        has_calls = role == "assistant" and m.get("tool_calls") not in (None, [])
        if "content" not in m and not has_calls:
            raise bad(f"messages[{i}].content", "is required")
        msg = {"role": "system" if role == "developer" else role,
               "content": _content(m.get("content"), f"messages[{i}].content", nullable=role == "assistant")}
        if m.get("name") is not None:
            msg["name"] = _get(m, "name", (str,), None, name="a string")
        if role == "assistant":
            if has_calls:
                msg["tool_calls"] = _tool_calls(m["tool_calls"], f"messages[{i}].tool_calls")
            if m.get("reasoning_content") is not None:
                msg["reasoning_content"] = _content(m["reasoning_content"], f"messages[{i}].reasoning_content",
                                                    nullable=False)
        elif m.get("tool_calls") is not None or m.get("reasoning_content") is not None:
            key = "tool_calls" if m.get("tool_calls") is not None else "reasoning_content"
            raise bad(f"messages[{i}].{key}", "is only allowed on an assistant message")
        if role == "tool":
            if not isinstance(m.get("tool_call_id"), str):
                raise bad(f"messages[{i}].tool_call_id", "a tool message needs the string id of the call it answers")
            msg["tool_call_id"] = m["tool_call_id"]
        elif m.get("tool_call_id") is not None:
            raise bad(f"messages[{i}].tool_call_id", "is only allowed on a tool message")
        out.append(msg)
    return out


@dataclass(frozen=True, slots=True)
class ChatOptions:
    """A chat request's tools and template/reasoning options."""
    tools: list[dict] | None            # the request's tools as given (for the template)
    schemas: dict[str, dict]            # function name -> its parameters' JSON schema
    tool_choice: str                    # auto, none, required, or "function" (named)
    function: str | None                # the named function
    parallel: bool                      # parallel_tool_calls
    template_kwargs: dict
    add_generation_prompt: bool
    include_reasoning: bool
    reasoning_budget: int | None        # max_reasoning_tokens / thinking_budget
    budget_field: str


def parse_chat_options(body: dict) -> ChatOptions:
    tools = _get(body, "tools", (list,), None, name="a list of tools")
    schemas: dict[str, dict] = {}
    for i, tool in enumerate(tools or ()):
        f = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(f, dict):
            raise bad(f"tools[{i}]", "expected {type: 'function', function: {name, description, parameters}}")
        name = f.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.:-]{1,64}", name):
            raise bad(f"tools[{i}].function.name", "expected 1-64 letters, digits, '_', '.', ':' or '-'")
        if name in schemas:
            raise bad(f"tools[{i}].function.name", f"{name!r} is given twice")
        params = f.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise bad(f"tools[{i}].function.parameters", "expected a JSON schema object")
        schemas[name] = params
    choice = body.get("tool_choice")
    function = None
    if choice is None:
        choice = "auto" if tools else "none"
    elif isinstance(choice, dict):
        f = choice.get("function")
        if choice.get("type") != "function" or not isinstance(f, dict) or not isinstance(f.get("name"), str):
            raise bad("tool_choice", "expected auto, none, required or {type: 'function', function: {name}}")
        function, choice = f["name"], "function"
        if function not in schemas:
            raise bad("tool_choice.function.name", f"{function!r} is not one of the request's tools")
    elif choice not in TOOL_CHOICES:
        raise bad("tool_choice", f"expected auto, none, required or a named function, got {choice!r}")
    if choice in ("required", "function", "auto") and not tools and body.get("tool_choice") is not None:
        raise bad("tool_choice", f"{choice!r} needs tools")
    kwargs = _get(body, "chat_template_kwargs", (dict,), {}, name="an object")
    budget_field = "thinking_budget" if body.get("thinking_budget") is not None else "max_reasoning_tokens"
    if body.get("thinking_budget") is not None and body.get("max_reasoning_tokens") is not None:
        raise bad("thinking_budget", "give max_reasoning_tokens or thinking_budget, not both")
    budget = _get(body, budget_field, (int,), None, name="an integer")
    if budget is not None and budget < 1:
        raise bad(budget_field, f"must be at least 1, got {budget}")
    return ChatOptions(tools=tools or None, schemas=schemas, tool_choice=choice, function=function,
                       parallel=_get(body, "parallel_tool_calls", (bool,), True, name="a boolean"),
                       template_kwargs=kwargs,
                       add_generation_prompt=_get(body, "add_generation_prompt", (bool,), True, name="a boolean"),
                       include_reasoning=_get(body, "include_reasoning", (bool,), True, name="a boolean"),
                       reasoning_budget=budget, budget_field=budget_field)


def parse_logit_bias(value: Any, vocab_size: int) -> dict[int, float] | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise bad("logit_bias", f"expected an object of token id -> bias, got {type(value).__name__}")
    out = {}
    for key, bias in value.items():
        if not isinstance(key, str) or not key.isdigit() or int(key) >= vocab_size:
            raise bad("logit_bias", f"key {key!r} is not a token id in 0..{vocab_size - 1}")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100 <= bias <= 100:
            raise bad("logit_bias", f"bias {bias!r} of token {key} must be a number in [-100, 100]")
        out[int(key)] = float(bias)
    return out


def _check_fields(body: dict, chat: bool) -> None:
    known = CHAT_FIELDS if chat else COMPLETION_FIELDS
    for field, value in body.items():
        if field not in known:
            raise bad(field, f"unknown field for {'/v1/chat/completions' if chat else '/v1/completions'}")
        if field in REFUSED and value not in (None, [], ""):
            raise bad(field, REFUSED[field])


def parse_structured(body: dict) -> tuple[StructuredOutput | None, str]:
    """The request's structured output and the field that gave it (for errors)."""
    fmt, so = body.get("response_format"), body.get("structured_outputs")
    if fmt is not None and so is not None:
        raise bad("structured_outputs", "give response_format or structured_outputs, not both")
    if so is not None:
        return _structured_outputs(so), "structured_outputs"
    if fmt is None:
        return None, "response_format"
    if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
        raise bad("response_format", "expected an object with a string 'type'")
    kind = fmt["type"]
    extra = sorted(set(fmt) - {"type", "json_schema"} if kind == "json_schema" else set(fmt) - {"type"})
    if extra:
        raise bad(f"response_format.{extra[0]}", f"is not a field of a {kind!r} response_format")
    if kind == "text":
        return None, "response_format"
    if kind == "json_object":
        return StructuredOutput("json_object"), "response_format"
    if kind != "json_schema":
        raise bad("response_format", f"type {kind!r} is not one of text, json_object, json_schema")
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict):
        raise bad("response_format.json_schema", "expected an object with 'name' and 'schema'")
    extra = sorted(set(spec) - {"name", "schema", "strict", "description"})
    if extra:
        raise bad(f"response_format.json_schema.{extra[0]}", "is not supported (name, schema, strict, description)")
    if not isinstance(spec.get("name"), str) or not spec["name"]:
        raise bad("response_format.json_schema.name", "a non-empty string is required")
    if not isinstance(spec.get("schema"), dict):
        raise bad("response_format.json_schema.schema", "a JSON schema object is required")
    if not isinstance(spec.get("strict", False), (bool, type(None))):
        raise bad("response_format.json_schema.strict", "expected a boolean")
    # strict or not, the grammar holds the output to the schema.
    return StructuredOutput.json_schema(spec["schema"]), "response_format"


def _structured_outputs(so: Any) -> StructuredOutput:
    if not isinstance(so, dict):
        raise bad("structured_outputs", "expected an object with one of json, regex, choice, json_object")
    given = {k: v for k, v in so.items() if v is not None}
    unknown = sorted(set(given) - {"json", "regex", "choice", "json_object"})
    if unknown:
        raise bad(f"structured_outputs.{unknown[0]}", "is not supported (only json, regex, choice, json_object)")
    if len(given) != 1:
        raise bad("structured_outputs", f"give exactly one of json, regex, choice, json_object, got {sorted(given)}")
    key, value = next(iter(given.items()))
    field = f"structured_outputs.{key}"
    if key == "json":
        if not isinstance(value, (dict, str)):
            raise bad(field, "expected a JSON schema object or its JSON text")
        return StructuredOutput.json_schema(value)
    if key == "regex":
        if not isinstance(value, str) or not value:
            raise bad(field, "expected a non-empty string")
        return StructuredOutput.regex(value)
    if key == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise bad(field, "expected a non-empty list of non-empty strings")
        return StructuredOutput.choice(value)
    if value is not True:
        raise bad(field, "expected true")
    return StructuredOutput("json_object")


def parse_request(body: Any, *, chat: bool, default_max_tokens: int, vocab_size: int) -> ParsedRequest:
    """One request body -> what to generate; raises `APIError` (400 naming the field) on anything
    unknown, unsupported or malformed."""
    if not isinstance(body, dict):
        raise APIError(400, "request body must be a JSON object")
    _check_fields(body, chat)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad("model", "a model name (string) is required")
    messages = parse_messages(body.get("messages")) if chat else None
    options = parse_chat_options(body) if chat else None
    prompts = [] if chat else parse_prompts(body.get("prompt"))
    n, best_of = _parse_counts(body, max(1, len(prompts)))
    stream, include_usage = _parse_stream(body)
    if stream and best_of > n:
        raise bad("best_of", f"best_of={best_of} above n={n} cannot be streamed")
    logprobs, echo = _parse_logprobs(body, chat)
    max_key = "max_tokens"
    if chat and body.get("max_completion_tokens") is not None:
        if body.get("max_tokens") is not None:
            raise bad("max_tokens", "give max_completion_tokens or max_tokens, not both")
        max_key = "max_completion_tokens"
    # best_of ranks by cumulative logprob, so its sequences keep logprobs even when the response shows none.
    keep = logprobs if logprobs is not None else (0 if best_of > n else None)
    structured, structured_field = parse_structured(body)
    params = _parse_sampling(body, chat, max_key, default_max_tokens, vocab_size, logprobs=keep,
                             prompt_logprobs=logprobs if echo else None)
    if structured is not None:
        params = replace(params, structured=structured)
    return ParsedRequest(model=model, prompts=prompts, structured_field=structured_field, messages=messages,
                         chat=options, params=params, n=n, best_of=best_of,
                         echo=echo, logprobs=logprobs, stream=stream, include_usage=include_usage,
                         max_key=max_key, max_tokens_given=body.get(max_key) is not None)


def _parse_counts(body: dict, num_prompts: int) -> tuple[int, int]:
    n = _get(body, "n", (int,), 1, name="an integer")
    if not 1 <= n <= MAX_N:
        raise bad("n", f"must be in 1..{MAX_N}, got {n}")
    best_of = _get(body, "best_of", (int,), n, name="an integer")
    if not n <= best_of <= MAX_N:
        raise bad("best_of", f"must be in n..{MAX_N} (n={n}), got {best_of}")
    if num_prompts * best_of > MAX_SEQS_PER_REQUEST:
        raise bad("best_of" if best_of > n else "n", f"{num_prompts} prompts x {best_of} sequences exceeds "
                                                      f"{MAX_SEQS_PER_REQUEST} per request")
    return n, best_of


def _parse_stream(body: dict) -> tuple[bool, bool]:
    stream = _get(body, "stream", (bool,), False, name="a boolean")
    options = _get(body, "stream_options", (dict,), None, name="an object")
    if options is None:
        return stream, False
    if not stream:
        raise bad("stream_options", "is only allowed with stream: true")
    extra = sorted(set(options) - {"include_usage"})
    if extra:
        raise bad(f"stream_options.{extra[0]}", "is not supported (only include_usage)")
    if not isinstance(options.get("include_usage", False), bool):
        raise bad("stream_options.include_usage", "expected a boolean")
    return stream, bool(options.get("include_usage", False))


def _parse_logprobs(body: dict, chat: bool) -> tuple[int | None, bool]:
    """(top alternatives per token or None for no logprobs, echo)."""
    if chat:
        want = _get(body, "logprobs", (bool,), False, name="a boolean")
        top = _get(body, "top_logprobs", (int,), None, name="an integer")
        if top is not None and not want:
            raise bad("top_logprobs", "needs logprobs: true")
        if top is not None and not 0 <= top <= MAX_LOGPROBS:
            raise bad("top_logprobs", f"must be in 0..{MAX_LOGPROBS}, got {top}")
        return ((top or 0) if want else None), False
    logprobs = _get(body, "logprobs", (int,), None, name="an integer")
    if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
        raise bad("logprobs", f"must be in 0..{MAX_LOGPROBS}, got {logprobs}")
    return logprobs, _get(body, "echo", (bool,), False, name="a boolean")


def _parse_sampling(body: dict, chat: bool, max_key: str, default_max_tokens: int, vocab_size: int, *,
                    logprobs: int | None, prompt_logprobs: int | None) -> SamplingParams:
    max_tokens = _get(body, max_key, (int,), default_max_tokens, name="an integer")
    if max_tokens < 1:
        raise bad(max_key, f"must be at least 1, got {max_tokens}")
    min_tokens = _get(body, "min_tokens", (int,), 0, name="an integer")
    if not 0 <= min_tokens <= max_tokens:
        raise bad("min_tokens", f"must be in 0..{max_key} ({max_tokens}), got {min_tokens}")
    top_p = float(_get(body, "top_p", (int, float), 1.0, name="a number"))
    if not 0 < top_p <= 1:
        raise bad("top_p", f"must be in (0, 1], got {top_p}")
    top_k = _get(body, "top_k", (int,), 0, name="an integer")
    if top_k < 0:
        raise bad("top_k", f"must be 0 (off) or positive, got {top_k}")
    repetition = float(_get(body, "repetition_penalty", (int, float), 1.0, name="a number"))
    if not 0 < repetition <= 10:
        raise bad("repetition_penalty", f"must be in (0, 10] (1 = off), got {repetition:g}")
    seed = _get(body, "seed", (int,), None, name="an integer")
    if seed is not None and not 0 <= seed < 1 << 63:
        raise bad("seed", f"must be in 0..2^63-1, got {seed}")
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and (not isinstance(stop, list) or len(stop) > 4
                             or not all(isinstance(s, str) and s for s in stop)):
        raise bad("stop", "expected a non-empty string or a list of up to 4 non-empty strings")
    _get(body, "user", (str,), None, name="a string")
    try:
        return SamplingParams(
            temperature=_number(body, "temperature", 1.0, 0.0, 2.0), top_p=top_p, top_k=top_k,
            min_p=_number(body, "min_p", 0.0, 0.0, 1.0), max_tokens=max_tokens, min_tokens=min_tokens, seed=seed,
            ignore_eos=_get(body, "ignore_eos", (bool,), False, name="a boolean"), stop=stop,
            presence_penalty=_number(body, "presence_penalty", 0.0, -2.0, 2.0),
            frequency_penalty=_number(body, "frequency_penalty", 0.0, -2.0, 2.0), repetition_penalty=repetition,
            logit_bias=parse_logit_bias(body.get("logit_bias"), vocab_size), logprobs=logprobs,
            prompt_logprobs=prompt_logprobs)
    except SamplingParamError as exc:
        raise bad(api_field(exc.field, chat, max_key), str(exc)) from None


def api_field(field: str, chat: bool, max_key: str = "max_tokens") -> str:
    """The request field a `SamplingParams` field came from."""
    return {"max_tokens": max_key, "logprobs": "top_logprobs" if chat else "logprobs",
            "prompt_logprobs": "logprobs"}.get(field, field)


def with_max_tokens(params: SamplingParams, max_tokens: int, chat: bool) -> SamplingParams:
    """`params` with max_tokens lowered (chat without a limit: the room left in the context)."""
    try:
        return replace(params, max_tokens=max_tokens)
    except SamplingParamError as exc:
        raise bad(api_field(exc.field, chat), f"{exc} (the context leaves room for {max_tokens} tokens)") from None
