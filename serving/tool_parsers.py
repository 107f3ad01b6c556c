"""Tool calls in a model's output text: the families' formats, parsed whole or as the text streams.

Formats (`--tool-call-parser`, by default the model family's, `DEFAULT_PARSERS`):
- glm45: GLM-4.5 / 4.6 / 4.7 / 5, `<tool_call>name<arg_key>k</arg_key><arg_value>v</arg_value>...</tool_call>`
  (newlines between the parts or not). A value is a string when the tool's schema types the
  argument as a string, else JSON when it parses as JSON, else a string.
- hermes: Qwen3 / Qwen3.5 (and Hermes-style models), `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.
- qwen3_coder: Qwen3-Coder's XML, `<tool_call><function=name><parameter=k>v</parameter>...</function></tool_call>`
  (values typed as glm45's).
- deepseek_v31: DeepSeek-V3.1 and later, `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>name<｜tool▁sep｜>{json}<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>`.

`ToolCallStream` reads the text as it grows and yields events: text outside calls is content (less
a tail that could begin a call marker, held until it cannot), a call is announced (id, name) as
soon as its name is complete and names a tool of the request, and its arguments JSON follows in
fragments, each a stable prefix of the final arguments. A call that turns out malformed (unknown
tool, arguments that are not a JSON object, text the format does not allow, a call cut off by the
end of the output) becomes content: its whole raw text, so no text is lost. Streaming cannot take
back what it sent, so a malformed call that was already announced keeps its partial arguments and
its raw text follows as content; a whole (non-streamed) parse drops such a call.
"""
from __future__ import annotations

import json
import re
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

DEFAULT_PARSERS = {"glm4_moe": "glm45", "glm4_moe_lite": "glm45", "qwen3_moe": "hermes",
                   "deepseek_v3": "deepseek_v31"}


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


@dataclass(frozen=True, slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str          # JSON text of an object

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True, slots=True)
class Partial:
    """What a call's body says so far: its name once complete, a prefix of its arguments JSON that
    will not change (the whole arguments when the body is complete), and an error when the body
    cannot be a well-formed call."""
    name: str | None = None
    args: str = ""
    error: str | None = None


Schemas = dict[str, dict]       # tool name -> its parameters' JSON schema


def held_tail(text: str, markers: tuple[str, ...]) -> int:
    """The length of the longest tail of `text` that is a proper prefix of one of `markers`."""
    best = 0
    for m in markers:
        for k in range(min(len(m) - 1, len(text)), best, -1):
            if text.endswith(m[:k]):
                best = k
                break
    return best


def _is_string_arg(schema: dict | None, key: str) -> bool | None:
    """True/False when the schema types argument `key` as a string or as something else; None when it does not say."""
    prop = ((schema or {}).get("properties") or {}).get(key)
    if not isinstance(prop, dict):
        return None
    kind = prop.get("type")
    if kind is None and "enum" in prop:
        return all(isinstance(v, str) for v in prop["enum"])
    if isinstance(kind, list):
        return kind == ["string"] or (None if "string" in kind else False)
    return None if kind is None else kind == "string"


def _typed_value(schema: dict | None, key: str, raw: str) -> str:
    """An XML-style argument value as JSON text: a string when the schema says so, else its JSON
    when it parses, else a string."""
    if _is_string_arg(schema, key) is not True:
        try:
            return json.dumps(json.loads(raw), ensure_ascii=False)
        except ValueError:
            pass
    return json.dumps(raw, ensure_ascii=False)


def _xml_args(pairs: list[tuple[str, str]], open_pair: tuple[str, str] | None, schema: dict | None,
              done: bool) -> str:
    """The arguments JSON (prefix) of complete key/value pairs and, streaming, an open pair whose
    key is complete and whose value (a string by the schema) is partial."""
    parts = [json.dumps(k, ensure_ascii=False) + ": " + _typed_value(schema, k, v) for k, v in pairs]
    text = "{" + ", ".join(parts)
    if done:
        return text + "}"
    if open_pair is not None and _is_string_arg(schema, open_pair[0]):
        text += (", " if parts else "") + json.dumps(open_pair[0], ensure_ascii=False) + ": " \
                + json.dumps(open_pair[1], ensure_ascii=False)[:-1]
    return text


class Format(ABC):
    """One family's call syntax: the markers around a call and how to read its body."""
    name = ""
    opens: tuple[str, ...] = ()     # a call begins with one of these
    close = ""                      # and ends with this
    drop: tuple[str, ...] = ()      # region markers around calls, dropped from the content

    @abstractmethod
    def scan(self, body: str, done: bool, schemas: Schemas) -> Partial:
        """What `body` (a call's text after its opening marker; `done`: all of it) says so far."""


class Glm45(Format):
    name = "glm45"
    opens = ("<tool_call>",)
    close = "</tool_call>"
    PAIR = re.compile(r"\s*<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)
    OPEN_VALUE = re.compile(r"\s*<arg_key>(.*?)</arg_key>\s*<arg_value>(.*)\Z", re.S)
    MARKERS = ("</arg_value>",)

    def scan(self, body: str, done: bool, schemas: Schemas) -> Partial:
        m = re.match(r"\s*([^\s<]+)(?=[\s<])" if not done else r"\s*([^\s<]+)", body)
        if m is None:
            return Partial(error="no function name" if done else None)
        name, rest = m.group(1), body[m.end():]
        return self.read_pairs(name, rest, done, schemas.get(name))

    def read_pairs(self, name: str, rest: str, done: bool, schema: dict | None, tail: str = r"\s*") -> Partial:
        pairs, pos = [], 0
        while (p := self.PAIR.match(rest, pos)) is not None:
            pairs.append((p.group(1).strip(), p.group(2)))
            pos = p.end()
        left = rest[pos:]
        if done:
            if not re.fullmatch(tail, left):
                return Partial(name, error=f"unexpected text in the call: {left.strip()[:40]!r}")
            return Partial(name, _xml_args(pairs, None, schema, True))
        open_pair = None
        if (o := self.OPEN_VALUE.match(left)) is not None:
            value = o.group(2)
            open_pair = (o.group(1).strip(), value[:len(value) - held_tail(value, self.MARKERS)])
        return Partial(name, _xml_args(pairs, open_pair, schema, False))


class Qwen3Coder(Glm45):
    name = "qwen3_coder"
    PAIR = re.compile(r"\s*<parameter=([^>]*)>\n?(.*?)\n?</parameter>", re.S)
    OPEN_VALUE = re.compile(r"\s*<parameter=([^>]*)>\n?(.*)\Z", re.S)
    MARKERS = ("\n</parameter>", "</parameter>")

    def scan(self, body: str, done: bool, schemas: Schemas) -> Partial:
        m = re.match(r"\s*<function=([^>]+)>", body)
        if m is None:
            return Partial(error="no <function=name>" if done else None)
        name = m.group(1).strip()
        return self.read_pairs(name, body[m.end():], done, schemas.get(name), tail=r"\s*</function>\s*")


class Hermes(Format):
    name = "hermes"
    opens = ("<tool_call>",)
    close = "</tool_call>"
    HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:\s*', re.S)

    def scan(self, body: str, done: bool, schemas: Schemas) -> Partial:
        head = self.HEAD.match(body)
        if not done:
            if head is None:
                name = re.match(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")', body)
                return Partial(json.loads(name.group(1)) if name else None)
            raw = body[head.end():]
            # the arguments' text so far, less what may be the closing brace of the call object
            return Partial(json.loads(head.group(1)), raw.rstrip().rstrip("}").rstrip() if raw.startswith("{") else "")
        try:
            obj = json.loads(body)
        except ValueError as exc:
            return Partial(error=f"the call is not JSON: {exc}")
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return Partial(error="the call is not an object with a string 'name'")
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                return Partial(obj["name"], error="the arguments are not JSON")
        if not isinstance(args, dict):
            return Partial(obj["name"], error="the arguments are not a JSON object")
        if head is not None and body[head.end():].startswith("{"):
            raw, end = json.JSONDecoder().raw_decode(body, head.end())
            return Partial(obj["name"], body[head.end():end])
        return Partial(obj["name"], json.dumps(args, ensure_ascii=False))


class DeepSeekV31(Format):
    name = "deepseek_v31"
    opens = ("<｜tool▁call▁begin｜>",)
    close = "<｜tool▁call▁end｜>"
    drop = ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>")
    SEP = "<｜tool▁sep｜>"

    def scan(self, body: str, done: bool, schemas: Schemas) -> Partial:
        if self.SEP not in body:
            return Partial(error="no <｜tool▁sep｜> after the name" if done else None)
        name, raw = body.split(self.SEP, 1)
        name = name.strip()
        if not done:
            return Partial(name, raw.strip())
        try:
            args = json.loads(raw)
        except ValueError as exc:
            return Partial(name, error=f"the arguments are not JSON: {exc}")
        if not isinstance(args, dict):
            return Partial(name, error="the arguments are not a JSON object")
        return Partial(name, raw.strip())


FORMATS: dict[str, Callable[[], Format]] = {f.name: f for f in (Glm45, Hermes, Qwen3Coder, DeepSeekV31)}
PARSER_NAMES = tuple(FORMATS)


def tool_format(name: str) -> Format:
    if name not in FORMATS:
        raise ValueError(f"tool-call parser {name!r} is not one of {', '.join(FORMATS)}")
    return FORMATS[name]()


@dataclass(slots=True)
class Event:
    """kind: "content" (text), "call" (index, id, name), "args" (index, text: a fragment),
    "failed" (index, text: the call's raw text; index -1 when it was never announced)."""
    kind: str
    text: str = ""
    index: int = -1
    id: str = ""
    name: str = ""


@dataclass(slots=True)
class _Call:
    opener: str
    body: str = ""
    index: int = -1             # announced: its tool_calls index
    sent: str = ""              # arguments sent so far
    rejected: bool = False      # named an unknown tool: its text becomes content


class ToolCallStream:
    """The tool calls of one choice's text, read as it grows (`feed` deltas, then `finish`)."""

    def __init__(self, fmt: Format, schemas: Schemas) -> None:
        self.fmt, self.schemas = fmt, schemas
        self.buf = ""
        self.call: _Call | None = None
        self.num_calls = 0
        self._markers = fmt.opens + fmt.drop

    def feed(self, text: str) -> list[Event]:
        self.buf += text
        return self._run(final=False)

    def finish(self) -> list[Event]:
        return self._run(final=True)

    def _run(self, final: bool) -> list[Event]:
        out: list[Event] = []
        while True:
            if self.call is None:
                hits = [(i, m) for m in self._markers if (i := self.buf.find(m)) >= 0]
                if not hits:
                    keep = 0 if final else held_tail(self.buf, self._markers)
                    if len(self.buf) > keep:
                        out.append(Event("content", self.buf[:len(self.buf) - keep]))
                        self.buf = self.buf[len(self.buf) - keep:]
                    return out
                i, marker = min(hits)
                if i:
                    out.append(Event("content", self.buf[:i]))
                self.buf = self.buf[i + len(marker):]
                if marker in self.fmt.opens:
                    self.call = _Call(marker)
                continue
            call, close = self.call, self.fmt.close
            j = self.buf.find(close)
            if j < 0 and not final:
                safe = self.buf[:len(self.buf) - held_tail(self.buf, (close,))]
                self._advance(call, self.fmt.scan(safe, False, self.schemas), out)
                return out
            body = self.buf if j < 0 else self.buf[:j]
            self.buf = "" if j < 0 else self.buf[j + len(close):]
            self.call = None
            self._complete(call, body, closed=j >= 0, out=out)

    def _advance(self, call: _Call, part: Partial, out: list[Event]) -> None:
        if call.rejected or part.name is None:
            return
        if call.index < 0:
            if part.error is not None or part.name not in self.schemas:
                call.rejected = True
                return
            call.index = self.num_calls
            self.num_calls += 1
            out.append(Event("call", index=call.index, id=new_call_id(), name=part.name))
        if part.args.startswith(call.sent) and len(part.args) > len(call.sent):
            out.append(Event("args", part.args[len(call.sent):], index=call.index))
            call.sent = part.args

    def _complete(self, call: _Call, body: str, closed: bool, out: list[Event]) -> None:
        raw = call.opener + body + (self.fmt.close if closed else "")
        part = self.fmt.scan(body, True, self.schemas) if closed else Partial(error="the call is not closed")
        ok = part.error is None and part.name in self.schemas and not call.rejected
        if ok:
            try:
                ok = isinstance(json.loads(part.args), dict) and part.args.startswith(call.sent)
            except ValueError:
                ok = False
        if ok:
            self._advance(call, part, out)
        else:
            out.append(Event("failed", raw, index=call.index))


@dataclass(slots=True)
class Parsed:
    content: str
    calls: list[ToolCall] = field(default_factory=list)


def collect(events: list[Event]) -> Parsed:
    """A whole output's events -> its content and well-formed calls (a failed call's text in the content)."""
    content: list[str] = []
    calls: dict[int, list[Any]] = {}
    for e in events:
        if e.kind == "content":
            content.append(e.text)
        elif e.kind == "call":
            calls[e.index] = [e.id, e.name, ""]
        elif e.kind == "args":
            calls[e.index][2] += e.text
        else:
            calls.pop(e.index, None)
            content.append(e.text)
    return Parsed("".join(content), [ToolCall(i, n, a) for i, n, a in (calls[k] for k in sorted(calls))])


def parse_tool_calls(fmt: Format, text: str, schemas: Schemas) -> Parsed:
    """The content and tool calls of a whole output."""
    stream = ToolCallStream(fmt, schemas)
    return collect(stream.feed(text) + stream.finish())
