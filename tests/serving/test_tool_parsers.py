"""Tool-call and reasoning parsers on hand-written model outputs: each family's format whole and
split at every character boundary and at random boundaries, several calls, text before and after,
unicode arguments, malformed calls (their text comes back as content, never lost)."""
from __future__ import annotations

import json
import random

import pytest

from serving.chat import ChatOutputStream, NamedCallStream, RequiredCallStream
from serving.reasoning import ReasoningStream, prompt_opens_think, split_reasoning
from serving.tool_parsers import ToolCallStream, collect, parse_tool_calls, tool_format

SCHEMAS = {"get_weather": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                                            "units": {"enum": ["c", "f"]}}},
           "search": {"type": "object", "properties": {"query": {"type": "string"}, "filters": {"type": "object"}}}}
DS_BEGIN, DS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CALL, DS_SEP, DS_CALL_END = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"

# format -> (output text, expected content, expected calls as (name, arguments object))
CASES = {
    "glm45": ("Let me look. <tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>São Paulo 東京</arg_value>\n"
              "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>"
              "<tool_call>search<arg_key>query</arg_key><arg_value>a < b && c</arg_value>"
              "<arg_key>filters</arg_key><arg_value>{\"year\": 2024}</arg_value></tool_call> done",
              "Let me look.  done",
              [("get_weather", {"city": "São Paulo 東京", "days": 3}),
               ("search", {"query": "a < b && c", "filters": {"year": 2024}})]),
    "hermes": ("I will call two tools.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Zürich\", "
               "\"days\": 2}}\n</tool_call>\n<tool_call>\n{\"name\": \"search\", \"arguments\": {\"query\": \"}{ \\\"x\"}}\n"
               "</tool_call>\nAfter.",
               "I will call two tools.\n\n\nAfter.",
               [("get_weather", {"city": "Zürich", "days": 2}), ("search", {"query": "}{ \"x"})]),
    "qwen3_coder": ("Sure.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nKraków\n</parameter>\n"
                    "<parameter=units>\nc\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=search>\n"
                    "<parameter=query>\nline one\nline two\n</parameter>\n</function>\n</tool_call>",
                    "Sure.\n\n",
                    [("get_weather", {"city": "Kraków", "units": "c"}), ("search", {"query": "line one\nline two"})]),
    "deepseek_v31": (f"Checking.{DS_BEGIN}{DS_CALL}get_weather{DS_SEP}{{\"city\": \"Αθήνα\", \"days\": 1}}{DS_CALL_END}"
                     f"{DS_CALL}search{DS_SEP}{{\"query\": \"q\"}}{DS_CALL_END}{DS_END}",
                     "Checking.",
                     [("get_weather", {"city": "Αθήνα", "days": 1}), ("search", {"query": "q"})]),
}


def stream_in_pieces(fmt: str, text: str, cuts: list[int]):
    """Feed `text` cut at `cuts`; returns the events and checks that every argument fragment is sent
    only after its call is announced."""
    s = ToolCallStream(tool_format(fmt), SCHEMAS)
    events, last = [], 0
    for c in [*cuts, len(text)]:
        events += s.feed(text[last:c])
        last = c
    events += s.finish()
    announced = set()
    for e in events:
        if e.kind == "call":
            announced.add(e.index)
        elif e.kind == "args":
            assert e.index in announced
    return events


def check(parsed, content, calls):
    assert parsed.content == content
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == calls
    assert len({c.id for c in parsed.calls}) == len(calls)


@pytest.mark.parametrize("fmt", CASES)
def test_whole_output(fmt):
    text, content, calls = CASES[fmt]
    check(parse_tool_calls(tool_format(fmt), text, SCHEMAS), content, calls)


@pytest.mark.parametrize("fmt", CASES)
def test_streamed_at_every_boundary_and_at_random_ones(fmt):
    text, content, calls = CASES[fmt]
    for k in range(1, len(text)):                          # two pieces, cut anywhere
        check(collect(stream_in_pieces(fmt, text, [k])), content, calls)
    check(collect(stream_in_pieces(fmt, text, list(range(1, len(text))))), content, calls)   # a character at a time
    rng = random.Random(0)
    for _ in range(30):
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(2, 12)))
        check(collect(stream_in_pieces(fmt, text, cuts)), content, calls)


def test_arguments_stream_before_the_call_closes():
    text = "<tool_call>search\n<arg_key>query</arg_key>\n<arg_value>a long query, written token by token"
    events = stream_in_pieces("glm45", text, list(range(1, len(text))))
    args = "".join(e.text for e in events if e.kind == "args")
    assert [e.name for e in events if e.kind == "call"] == ["search"]
    assert args.startswith('{"query": "a long query, written token by')
    # cut off by the end of the output: the raw text comes back as content
    assert collect(events).calls == [] and collect(events).content == text


MALFORMED = {
    "glm45": "<tool_call>unknown_tool\n<arg_key>x</arg_key>\n<arg_value>1</arg_value>\n</tool_call>",
    "hermes": "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"\n</tool_call>",
    "qwen3_coder": "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</function>\n</tool_call>",
    "deepseek_v31": f"{DS_CALL}get_weather{DS_SEP}{{city: Paris}}{DS_CALL_END}",
}


@pytest.mark.parametrize("fmt", MALFORMED)
def test_malformed_calls_come_back_as_content(fmt):
    text = "before " + MALFORMED[fmt] + " after"
    parsed = parse_tool_calls(tool_format(fmt), text, SCHEMAS)
    assert parsed.calls == []
    assert parsed.content == text.replace(DS_BEGIN, "")
    for k in range(1, len(text), 3):          # streamed: no text is lost either
        events = stream_in_pieces(fmt, text, [k])
        assert "".join(e.text for e in events if e.kind in ("content", "failed")) == text


def test_text_that_only_looks_like_a_marker_is_content():
    text = "a <tool and <tool_call"
    assert parse_tool_calls(tool_format("hermes"), "a <tool and <b>", SCHEMAS).content == "a <tool and <b>"
    events = stream_in_pieces("hermes", text, [3, 9])
    assert collect(events).content == text and collect(events).calls == []


REASONING = [("<think>Let me think: ü.</think>\n\nThe answer.", False, "Let me think: ü.", "The answer."),
             ("I am thinking</think>Answer", True, "I am thinking", "Answer"),
             ("No block here", False, "", "No block here"),
             ("<think>cut off by max_tokens", False, "cut off by max_tokens", ""),
             ("  <thin", False, "", "  <thin")]


@pytest.mark.parametrize("text, inside, reasoning, content", REASONING)
def test_reasoning_split_whole_and_streamed(text, inside, reasoning, content):
    whole = split_reasoning(text, inside)
    assert (whole.reasoning, whole.content) == (reasoning, content)
    for k in range(1, len(text)):
        s = ReasoningStream(inside)
        a, b, c = s.feed(text[:k]), s.feed(text[k:]), s.finish()
        assert (a.reasoning + b.reasoning + c.reasoning, a.content + b.content + c.content) == (reasoning, content)


def test_prompt_tells_where_the_output_starts():
    assert prompt_opens_think("<|assistant|>\n<think>\n") and not prompt_opens_think("<|assistant|>")
    assert not prompt_opens_think("<think>a</think><|assistant|>\n<think></think>")


def test_reasoning_then_a_call_through_the_output_stream():
    text = "<think>the weather tool fits</think>\n<tool_call>get_weather\n<arg_key>city</arg_key>\n" \
           "<arg_value>Oslo</arg_value>\n</tool_call>"
    out = ChatOutputStream(ReasoningStream(False), ToolCallStream(tool_format("glm45"), SCHEMAS), True)
    deltas = [out.feed(text[k:k + 3]) for k in range(0, len(text), 3)] + [out.feed("", final=True)]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "the weather tool fits"
    assert "".join(d.get("content", "") for d in deltas) == ""
    msg = out.message()
    assert msg["reasoning_content"] == "the weather tool fits" and msg["content"] is None
    assert json.loads(msg["tool_calls"][0]["function"]["arguments"]) == {"city": "Oslo"}
    hidden = ChatOutputStream(ReasoningStream(False), None, False)
    assert hidden.feed(text, final=True).get("reasoning_content") is None
    assert "reasoning_content" not in hidden.message()


def test_forced_call_streams():
    named = NamedCallStream("search")
    events = [e for piece in ('{"query": ', '"x"', "}") for e in named.feed(piece)] + named.finish()
    assert collect(events).calls[0].arguments == '{"query": "x"}'
    text = '[{"name": "get_weather", "parameters": {"city": "Oslo"}}, {"name": "search", "parameters": {"query": "]"}}]'
    for k in range(1, len(text)):
        req = RequiredCallStream(SCHEMAS)
        parsed = collect(req.feed(text[:k]) + req.feed(text[k:]) + req.finish())
        assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == [
            ("get_weather", {"city": "Oslo"}), ("search", {"query": "]"})]
    cut = RequiredCallStream(SCHEMAS)
    parsed = collect(cut.feed(text[:30]) + cut.finish())         # max_tokens cut it: content, no call
    assert parsed.calls == [] and parsed.content == text[:30]


def test_a_forced_call_is_not_read_as_reasoning_when_the_prompt_opened_the_block():
    from serving.chat import plan_chat
    from serving.chat_template import ChatTemplate
    from serving.openai_api import parse_chat_options
    r1_like = ChatTemplate("{{ messages[0].content }}<think>\n", "test")     # DeepSeek-R1's prompt ends inside
    tools = [{"type": "function", "function": {"name": n, "parameters": p}} for n, p in SCHEMAS.items()]
    msgs = [{"role": "user", "content": "hi"}]
    named = plan_chat(msgs, parse_chat_options({"tools": tools, "tool_choice": {"type": "function", "function": {
        "name": "search"}}}), r1_like, tool_parser="deepseek_v31", reasoning_parser="deepseek_r1", structured=None,
        structured_field="response_format")
    out = named.stream()
    out.feed('{"query": "x"}', final=True)
    assert out.message()["tool_calls"][0]["function"]["arguments"] == '{"query": "x"}'
    free = plan_chat(msgs, parse_chat_options({}), r1_like, tool_parser="deepseek_v31", reasoning_parser="deepseek_r1",
                     structured=None, structured_field="response_format")
    out = free.stream()
    out.feed("still thinking</think>answer", final=True)
    assert out.message()["reasoning_content"] == "still thinking" and out.message()["content"] == "answer"
