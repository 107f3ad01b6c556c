"""Chat templates: the checkpoint's Jinja template (chat_template.jinja, or tokenizer_config.json's
`chat_template`) rendered in a sandbox with the request's messages, tools and
`chat_template_kwargs`; a GLM-4.5-format default when the checkpoint has none.

The sandbox (jinja2's ImmutableSandboxedEnvironment) refuses attribute access to Python internals
and mutation of the request's objects; a template can raise with `raise_exception(msg)`, as
Hugging Face templates do. Anything that fails while rendering is a `TemplateError` with a
one-line message (the server's 400), never an internal error.

Default template (docs/design.md §7): the embedded model (GLM-4.5 architecture) ships no chat
template, so a checkpoint without one renders in GLM-4.5's own chat format: `[gMASK]<sop>`, role
tags `<|system|>`, `<|user|>`, `<|assistant|>`, `<|observation|>` (tool results, each in
`<tool_response>`), tools listed as JSON lines in a `# Tools` system block, assistant tool calls
written `<tool_call>name\\n<arg_key>k</arg_key>\\n<arg_value>v</arg_value>\\n</tool_call>`, reasoning
as `<think>...</think>`, and `enable_thinking: false` closing an empty think block after the
generation prompt. A GLM checkpoint's own template renders the same prompts; the tool-call parser
for the family (serving.tool_parsers "glm45") reads what a model prompted so writes.
"""
from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

GLM45_TEMPLATE = r"""
{%- set nl = '\n' -%}
{{- '[gMASK]<sop>' -}}
{%- if tools -%}
{{- '<|system|>' + nl + '# Tools' + nl + nl + 'You may call one or more functions to assist with the user query.' + nl + nl -}}
{{- 'You are provided with function signatures within <tools></tools> XML tags:' + nl + '<tools>' + nl -}}
{%- for tool in tools -%}{{- tool | tojson(ensure_ascii=False) -}}{{- nl -}}{%- endfor -%}
{{- '</tools>' + nl + nl + 'For each function call, write the function name and its arguments in this XML format:' + nl -}}
{{- '<tool_call>{function-name}' + nl + '<arg_key>{arg-key-1}</arg_key>' + nl + '<arg_value>{arg-value-1}</arg_value>' + nl -}}
{{- '...' + nl + '</tool_call>' -}}
{%- endif -%}
{%- set ns = namespace(last_user=-1) -%}
{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}{%- endfor -%}
{%- for m in messages -%}
{%- if m.role == 'system' -%}
{{- '<|system|>' + nl + m.content -}}
{%- elif m.role == 'user' -%}
{{- '<|user|>' + nl + m.content -}}
{%- if enable_thinking is defined and not enable_thinking and loop.index0 == ns.last_user -%}{{- ' /nothink' -}}{%- endif -%}
{%- elif m.role == 'assistant' -%}
{{- '<|assistant|>' + nl -}}
{%- if m.reasoning_content and loop.index0 > ns.last_user -%}
{{- '<think>' + m.reasoning_content.strip() + '</think>' -}}
{%- else -%}
{{- '<think></think>' -}}
{%- endif -%}
{%- if m.content -%}{{- nl + m.content.strip() -}}{%- endif -%}
{%- for tc in m.tool_calls or [] -%}
{%- set f = tc.function if tc.function is defined else tc -%}
{{- nl + '<tool_call>' + f.name + nl -}}
{%- if f.arguments is mapping -%}
{%- for k, v in f.arguments.items() -%}
{{- '<arg_key>' + k + '</arg_key>' + nl + '<arg_value>' -}}
{{- v if v is string else (v | tojson(ensure_ascii=False)) -}}
{{- '</arg_value>' + nl -}}
{%- endfor -%}
{%- else -%}
{{- f.arguments + nl -}}
{%- endif -%}
{{- '</tool_call>' -}}
{%- endfor -%}
{%- elif m.role == 'tool' -%}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}{{- '<|observation|>' -}}{%- endif -%}
{{- nl + '<tool_response>' + nl + m.content + nl + '</tool_response>' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{- '<|assistant|>' -}}
{%- if enable_thinking is defined and not enable_thinking -%}{{- nl + '<think></think>' -}}{%- endif -%}
{%- endif -%}"""


class TemplateError(ValueError):
    """A chat template that does not compile or does not render: a one-line message."""


def _raise(message: str) -> None:
    raise TemplateError(str(message))


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
            sort_keys: bool = False) -> str:
    """Hugging Face's `tojson` (keyword ensure_ascii, indent, separators, sort_keys; no HTML escaping)."""
    from markupsafe import Markup
    return Markup(json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                             sort_keys=sort_keys))


class ChatTemplate:
    """A compiled chat template and where it came from (`source`: a file, or "default (GLM-4.5 format)")."""

    def __init__(self, text: str, source: str, *, bos_token: str = "", eos_token: str = "") -> None:
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self._template = env.from_string(text)
        except jinja2.TemplateError as exc:
            raise TemplateError(f"chat template from {source} does not compile: {_one_line(exc)}") from None
        self.text, self.source = text, source
        self.bos_token, self.eos_token = bos_token, eos_token

    def render(self, messages: list[dict], *, tools: list[dict] | None = None, add_generation_prompt: bool = True,
               kwargs: dict[str, Any] | None = None) -> str:
        """The prompt text; raises `TemplateError` naming what failed."""
        import jinja2
        context = {"bos_token": self.bos_token, "eos_token": self.eos_token, **(kwargs or {}),
                   "messages": messages, "tools": tools or None, "add_generation_prompt": add_generation_prompt}
        try:
            return self._template.render(**context)
        except TemplateError as exc:
            raise TemplateError(f"the chat template refused the request: {exc}") from None
        except jinja2.exceptions.SecurityError as exc:
            raise TemplateError(f"the chat template did something the sandbox forbids: {_one_line(exc)}") from None
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError, AttributeError,
                ZeroDivisionError, RecursionError) as exc:
            raise TemplateError(f"the chat template failed to render: {type(exc).__name__}: {_one_line(exc)}") from None


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _token_text(value: Any) -> str:
    """tokenizer_config.json's bos/eos entry: a string or an AddedToken-shaped {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else ""


def load_chat_template(model_dir: Path, override: str | Path | None = None) -> ChatTemplate:
    """The model folder's chat template: `override` (a file) when given, else chat_template.jinja,
    else tokenizer_config.json's `chat_template` (a string, or a list of {name, template}: the one
    named "default", else the first), else the GLM-4.5-format default. Raises ValueError (one line)
    on a file that cannot be read or a template that does not compile."""
    config_path = model_dir / "tokenizer_config.json"
    config: dict = {}
    if config_path.is_file():
        try:
            raw = json.loads(config_path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"{config_path}: not valid JSON ({exc})") from None
        config = raw if isinstance(raw, dict) else {}
    special = {"bos_token": _token_text(config.get("bos_token")), "eos_token": _token_text(config.get("eos_token"))}
    jinja_path = Path(override) if override is not None else model_dir / "chat_template.jinja"
    if override is not None and not jinja_path.is_file():
        raise ValueError(f"--chat-template {jinja_path}: no such file")
    if jinja_path.is_file():
        return ChatTemplate(jinja_path.read_text(), str(jinja_path), **special)
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default", next(iter(named.values()), None))
    if isinstance(template, str) and template:
        return ChatTemplate(template, f"{config_path} chat_template", **special)
    return ChatTemplate(GLM45_TEMPLATE, "default (GLM-4.5 format)", **special)
