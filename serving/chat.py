"""A chat request's prompt, the grammar its tool_choice and reasoning budget need, and the
per-choice parsing of its output into reasoning_content, content and tool_calls (docs/design.md §7).

- The prompt: the chat template (serving.chat_template) rendered with the messages, the tools,
  add_generation_prompt and chat_template_kwargs; a template that fails is a 400.
- tool_choice "auto": the model writes calls in its family's format (serving.tool_parsers);
  "none": no call is parsed; "required" and a named function: a grammar holds the output to
  JSON that validates against the tools' schemas, as vLLM does it: a named function's output is its
  arguments object; "required" gives `[{"name": ..., "parameters": {...}}, ...]` (one item
  without parallel_tool_calls). The grammar goes through the structured-output path
  (runtime.sample.grammar), so the MTP drafter's rows are masked alike and output stays lossless.
- Reasoning (serving.reasoning): the think block becomes reasoning_content; include_reasoning
  false drops it. A budget (max_reasoning_tokens / thinking_budget) is a grammar too: the think
  block may hold at most that many tokens, then `</think>` is the only way on. Under a budget the
  output opens the block (unless the prompt did) and the rest is free text or the structured
  output. A model whose `</think>` is several tokens and begins one to four tokens before the
  budget runs out has it cut there and writes it anew (the tags of the families' real tokenizers
  are single tokens).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from runtime.sample.grammar import JSON_OPTIONS, StructuredOutput
from serving.chat_template import ChatTemplate, TemplateError
from serving.openai_api import APIError, ChatOptions, bad
from serving.reasoning import (
    END_THINK,
    THINK,
    ReasoningStream,
    prompt_closes_think,
    prompt_opens_think,
)
from serving.tool_parsers import Event, Format, ToolCallStream, collect, new_call_id, tool_format

THINK_TEXT = r"/(?s:.*)/ & ~/(?s:.*)<\/think>(?s:.*)/"


def required_schema(schemas: dict[str, dict], parallel: bool) -> dict:
    """tool_choice "required": a non-empty array of {name, parameters} calls, each valid for its tool."""
    items = [{"type": "object", "additionalProperties": False, "required": ["name", "parameters"],
              "properties": {"name": {"enum": [name]}, "parameters": schema}} for name, schema in schemas.items()]
    out = {"type": "array", "minItems": 1, "items": items[0] if len(items) == 1 else {"anyOf": items}}
    return {**out, "maxItems": 1} if not parallel else out


def _lark_json(schema: dict) -> str:
    return "%json " + json.dumps({**schema, "x-guidance": JSON_OPTIONS})


def budget_grammar(budget: int, opened: bool, rest: StructuredOutput | None) -> StructuredOutput:
    """A think block of at most `budget` tokens (opened by the output unless the prompt did), then
    `rest` (free text when None; JSON kinds only)."""
    if rest is None:
        body = "REST\nREST: /(?s:.*)/"
    elif rest.kind in ("json_schema", "json_object"):
        schema = json.loads(rest.spec) if rest.kind == "json_schema" else {"type": "object"}
        body = "/\\n?/ " + _lark_json(schema)
    else:
        raise ValueError(f"a reasoning budget cannot be combined with a {rest.kind} structured output")
    head = "" if opened else json.dumps(THINK) + " "
    return StructuredOutput("lark", f"start: {head}think {json.dumps(END_THINK)} {body}\n"
                                    f"think[max_tokens={budget}]: THINK_TEXT\nTHINK_TEXT: {THINK_TEXT}\n")


@dataclass(frozen=True, slots=True)
class ChatPlan:
    prompt: str
    structured: StructuredOutput | None     # the output's grammar (tool_choice, budget, response_format)
    options: ChatOptions
    tool_format: Format | None              # tool_choice auto: the family's call format
    reasoning: bool                         # split <think> blocks
    opened: bool                            # the prompt opened the think block

    def stream(self) -> ChatOutputStream:
        """A fresh parser for one choice."""
        o = self.options
        if o.tool_choice == "function":
            tools = NamedCallStream(o.function)
        elif o.tool_choice == "required":
            tools = RequiredCallStream(o.schemas)
        elif o.tool_choice == "auto" and self.tool_format is not None:
            tools = ToolCallStream(self.tool_format, o.schemas)
        else:
            tools = None
        return ChatOutputStream(ReasoningStream(self.opened) if self.reasoning else None, tools,
                                o.include_reasoning)


def plan_chat(messages: list[dict], options: ChatOptions, template: ChatTemplate, *, tool_parser: str | None,
              reasoning_parser: str | None, structured: StructuredOutput | None, structured_field: str) -> ChatPlan:
    """Render the prompt and pick the grammar; raises APIError (400) naming what is wrong."""
    try:
        prompt = template.render(messages, tools=options.tools, add_generation_prompt=options.add_generation_prompt,
                                 kwargs=options.template_kwargs)
    except TemplateError as exc:
        raise APIError(400, f"'messages': {exc}", param="messages") from None
    forced = options.tool_choice in ("required", "function")
    if forced and structured is not None:
        raise bad("tool_choice", f"tool_choice {options.tool_choice!r} and {structured_field} both constrain "
                                 "the output: give one")
    if forced:
        schema = (options.schemas[options.function] if options.tool_choice == "function"
                  else required_schema(options.schemas, options.parallel))
        structured = StructuredOutput.json_schema(schema)
    reasoning = reasoning_parser not in (None, "none")
    # a grammar without a budget holds the output from its first token: no think block in it
    opened = reasoning and prompt_opens_think(prompt) and (structured is None or options.reasoning_budget is not None)
    if options.reasoning_budget is not None:
        if not reasoning:
            raise bad(options.budget_field, "this server runs no reasoning parser (--reasoning-parser none)")
        if not prompt_closes_think(prompt):         # thinking switched off: nothing to budget
            try:
                structured = budget_grammar(options.reasoning_budget, opened, structured)
            except ValueError as exc:
                raise bad(options.budget_field, str(exc)) from None
    fmt = tool_format(tool_parser) if tool_parser not in (None, "none") else None
    return ChatPlan(prompt, structured, options, fmt, reasoning, opened)


def _json_end(text: str, pos: int) -> int | None:
    """The end of the JSON object or array starting at text[pos], None while it is open."""
    depth, in_str, esc = 0, False, False
    for i in range(pos, len(text)):
        c = text[i]
        if in_str:
            if esc:
                esc = False
            elif c == "\\":
                esc = True
            elif c == '"':
                in_str = False
        elif c == '"':
            in_str = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


class NamedCallStream:
    """tool_choice naming a function: the whole output is its arguments object."""

    def __init__(self, name: str) -> None:
        self.name, self.buf, self.sent, self.announced = name, "", 0, False

    def feed(self, text: str) -> list[Event]:
        self.buf += text
        body = self.buf.lstrip()
        out = []
        if body and not self.announced:
            self.announced = True
            out.append(Event("call", index=0, id=new_call_id(), name=self.name))
        if len(body) > self.sent:
            out.append(Event("args", body[self.sent:], index=0))
            self.sent = len(body)
        return out

    def finish(self) -> list[Event]:
        out = self.feed("")
        try:
            ok = isinstance(json.loads(self.buf), dict)
        except ValueError:
            ok = False
        if not ok:      # cut by max_tokens: the text comes back as content
            out.append(Event("failed", self.buf, index=0 if self.announced else -1))
        return out


class RequiredCallStream:
    """tool_choice "required": `[{"name": ..., "parameters": {...}}, ...]`, each call announced when
    its name is complete and its arguments streamed as they arrive."""
    HEAD = re.compile(r'\s*,?\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"parameters"\s*:\s*')

    def __init__(self, schemas: dict[str, dict]) -> None:
        self.schemas, self.buf = schemas, ""
        self.sent: list[int] = []       # per call: argument characters sent

    def feed(self, text: str) -> list[Event]:
        self.buf += text
        out, pos = [], self.buf.find("[")
        if pos < 0:
            return out
        pos += 1
        for k in range(len(self.buf)):
            head = self.HEAD.match(self.buf, pos)
            if head is None:
                return out
            if k == len(self.sent):
                self.sent.append(0)
                out.append(Event("call", index=k, id=new_call_id(), name=json.loads(head.group(1))))
            end = _json_end(self.buf, head.end())
            args = self.buf[head.end():end if end is not None else len(self.buf)]
            if end is None:
                args = args.rstrip()
            if len(args) > self.sent[k]:
                out.append(Event("args", args[self.sent[k]:], index=k))
                self.sent[k] = len(args)
            if end is None:
                return out
            close = re.compile(r"\s*\}").match(self.buf, end)
            if close is None:
                return out
            pos = close.end()
        return out

    def finish(self) -> list[Event]:
        out = self.feed("")
        try:
            calls = json.loads(self.buf)
            ok = isinstance(calls, list) and len(calls) == len(self.sent) and all(
                isinstance(c, dict) and isinstance(c.get("parameters"), dict) for c in calls)
        except ValueError:
            ok = False
        if not ok:
            out += [Event("failed", "", index=k) for k in range(len(self.sent))]
            out.append(Event("failed", self.buf))
        return out


@dataclass(slots=True)
class ChatOutputStream:
    """One choice's text -> OpenAI chat deltas: reasoning_content, content, tool_calls."""
    reasoning: ReasoningStream | None
    tools: ToolCallStream | NamedCallStream | RequiredCallStream | None
    include_reasoning: bool
    events: list[Event] = field(default_factory=list)
    reasoning_text: list[str] = field(default_factory=list)

    def feed(self, text: str, final: bool = False) -> dict:
        if self.reasoning is not None:
            a = self.reasoning.feed(text)
            thought, content = a.reasoning, a.content
            if final:
                b = self.reasoning.finish()
                thought, content = thought + b.reasoning, content + b.content
        else:
            thought, content = "", text
        if self.tools is None:
            events = [Event("content", content)] if content else []
        else:
            events = self.tools.feed(content) + (self.tools.finish() if final else [])
        self.events += events
        self.reasoning_text.append(thought)
        delta: dict = {}
        if thought and self.include_reasoning:
            delta["reasoning_content"] = thought
        text_out = "".join(e.text for e in events if e.kind == "content" or e.kind == "failed")
        if text_out:
            delta["content"] = text_out
        calls = []
        for e in events:
            if e.kind == "call":
                calls.append({"index": e.index, "id": e.id, "type": "function",
                              "function": {"name": e.name, "arguments": ""}})
            elif e.kind == "args":
                calls.append({"index": e.index, "function": {"arguments": e.text}})
        if calls:
            delta["tool_calls"] = calls
        return delta

    @property
    def called(self) -> bool:
        """Whether a well-formed call came out so far."""
        return bool(collect(self.events).calls)

    def message(self) -> dict:
        """The whole message, after the whole text went through `feed(text, final=True)`."""
        parsed = collect(self.events)
        msg: dict = {"role": "assistant", "content": parsed.content if parsed.content or not parsed.calls else None}
        if self.reasoning is not None and self.include_reasoning:
            msg["reasoning_content"] = "".join(self.reasoning_text) or None
        if parsed.calls:
            msg["tool_calls"] = [c.to_openai() for c in parsed.calls]
        return msg


def finish_reason(reason: str | None, out: ChatOutputStream, named: bool) -> str | None:
    """OpenAI's: tool_calls when the model called (stop for a named function, as OpenAI gives it)."""
    return "tool_calls" if reason == "stop" and not named and out.called else reason
