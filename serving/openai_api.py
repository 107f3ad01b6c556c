"""OpenAI request bodies -> prompts and SamplingParams, with errors that name the field.

Only what this server implements is accepted: n=1, one prompt per completion request, no logprobs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from runtime.sampler import SamplingParams

DEFAULT_CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
                         "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


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
    prompt: str | list[int] | None
    messages: list[dict] | None
    params: SamplingParams
    stream: bool
    include_usage: bool


def _bad(field: str, message: str) -> APIError:
    return APIError(400, f"'{field}': {message}", param=field)


def _get(body: dict, field: str, types: tuple[type, ...], default: Any, *, name: str) -> Any:
    value = body.get(field, default)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in types:
        raise _bad(field, f"expected {name}, got a boolean")
    if not isinstance(value, types):
        raise _bad(field, f"expected {name}, got {type(value).__name__}")
    return value


def parse_request(body: Any, *, chat: bool, default_max_tokens: int) -> ParsedRequest:
    if not isinstance(body, dict):
        raise APIError(400, "request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _bad("model", "a model name (string) is required")
    prompt = messages = None
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise _bad("messages", "a non-empty list of {role, content} objects is required")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) \
                    or not isinstance(m.get("content"), str):
                raise _bad(f"messages[{i}]", "expected an object with string 'role' and 'content'")
            if m["role"] not in ("system", "user", "assistant", "tool", "developer"):
                raise _bad(f"messages[{i}].role", f"unknown role {m['role']!r}")
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            if not prompt:
                raise _bad("prompt", "the prompt is empty")
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool)
                                                          for t in prompt):
            pass
        elif isinstance(prompt, list) and not prompt:
            raise _bad("prompt", "the prompt is empty")
        elif prompt is None:
            raise _bad("prompt", "a prompt (string or list of token ids) is required")
        else:
            raise _bad("prompt", "expected a string or a list of token ids (one prompt per request)")
    n = _get(body, "n", (int,), 1, name="an integer")
    if n != 1:
        raise _bad("n", f"n={n} is not supported; only n=1")
    max_key = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _get(body, max_key, (int,), default_max_tokens, name="an integer")
    if max_tokens < 1:
        raise _bad(max_key, f"must be at least 1, got {max_tokens}")
    temperature = float(_get(body, "temperature", (int, float), 1.0, name="a number"))
    if temperature < 0 or temperature > 2:
        raise _bad("temperature", f"must be in [0, 2], got {temperature}")
    top_p = float(_get(body, "top_p", (int, float), 1.0, name="a number"))
    if not 0 < top_p <= 1:
        raise _bad("top_p", f"must be in (0, 1], got {top_p}")
    top_k = _get(body, "top_k", (int,), 0, name="an integer")
    if top_k < 0:
        raise _bad("top_k", f"must be 0 (off) or positive, got {top_k}")
    seed = _get(body, "seed", (int,), None, name="an integer")
    if seed is not None and seed < 0:
        raise _bad("seed", f"must be non-negative, got {seed}")
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None:
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > 4:
            raise _bad("stop", "expected a non-empty string or a list of up to 4 non-empty strings")
    stream = _get(body, "stream", (bool,), False, name="a boolean")
    options = _get(body, "stream_options", (dict,), {}, name="an object")
    ignore_eos = _get(body, "ignore_eos", (bool,), False, name="a boolean")
    _get(body, "user", (str,), None, name="a string")
    for unsupported in ("logprobs", "best_of", "echo", "suffix", "tools", "functions"):
        value = body.get(unsupported)
        if value not in (None, False, 0, 1) or (unsupported in ("tools", "functions") and value):
            raise _bad(unsupported, "is not supported by this server")
    params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, max_tokens=max_tokens, seed=seed,
                            ignore_eos=ignore_eos, stop=stop)
    return ParsedRequest(model=model, prompt=prompt, messages=messages, params=params, stream=stream,
                         include_usage=bool(options.get("include_usage", False)))


def render_chat(messages: list[dict], template: str | None) -> str:
    """Apply the model's chat template (jinja2), or a plain default when it has none."""
    import jinja2
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
    return env.from_string(template or DEFAULT_CHAT_TEMPLATE).render(messages=messages, add_generation_prompt=True)
