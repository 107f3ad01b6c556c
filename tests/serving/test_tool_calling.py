"""Tool calling, reasoning content and content parts through the official openai client against
`metrale serve --spec mtp` on the embedded model (GLM-4.5 family: glm45 parsers, the GLM-4.5-format
default template); in-process, greedy output with MTP equals output without under a tool grammar
and under a reasoning budget."""
from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from runtime.sample.grammar import StructuredOutput
from runtime.sample.sampler import SamplingParams
from engine.tokenizer import Tokenizer
from serving.chat import budget_grammar, plan_chat, required_schema
from serving.chat_template import ChatTemplate, load_chat_template
from serving.llm import LLM
from serving.openai_api import APIError, parse_chat_options, parse_messages
from tests.launch.test_server import MODEL, openai_client, start_server, stop_server

EMBEDDED = Path(__file__).resolve().parents[2] / "models" / "tiny-glm-moe"
WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "days"],
           "properties": {"city": {"type": "string", "maxLength": 12}, "days": {"type": "integer", "minimum": 1,
                                                                                "maximum": 14}}}
SEARCH = {"type": "object", "additionalProperties": False, "required": ["query"],
          "properties": {"query": {"type": "string", "maxLength": 16}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "search", "parameters": SEARCH}}]
SCHEMA_OF = {"get_weather": WEATHER, "search": SEARCH}
MSGS = [{"role": "user", "content": "What is the weather in Paris for 3 days?"}]


@pytest.fixture(scope="module")
def client():
    proc, base = start_server(EMBEDDED, "--spec", "mtp", "--kv-cache-tokens", "4096", "--max-num-seqs", "8")
    yield openai_client(base)
    stop_server(proc)


def streamed(stream) -> tuple[dict, str | None, list[dict]]:
    """A streamed choice 0 put together: content, reasoning_content, tool calls by index; its finish
    reason; and the deltas' tool_calls in order."""
    out, calls, finish, deltas = {"content": "", "reasoning_content": ""}, {}, None, []
    for chunk in stream:
        for c in chunk.choices:
            d = c.delta
            out["content"] += d.content or ""
            out["reasoning_content"] += getattr(d, "reasoning_content", None) or ""
            for tc in d.tool_calls or []:
                deltas.append(tc.model_dump())
                call = calls.setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
                call["id"] = call["id"] or tc.id
                call["name"] = call["name"] or (tc.function.name if tc.function else None)
                call["arguments"] += (tc.function.arguments or "") if tc.function else ""
            finish = c.finish_reason or finish
    out["calls"] = [calls[k] for k in sorted(calls)]
    return out, finish, deltas


def test_named_function_gives_a_valid_call_streamed_and_not(client):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    r = client.chat.completions.create(model=MODEL, messages=MSGS, tools=TOOLS, tool_choice=choice, temperature=0,
                                       max_completion_tokens=80)
    c = r.choices[0]
    assert c.finish_reason == "stop"                            # as OpenAI answers a named function
    (call,) = c.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_") and not c.message.content
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, WEATHER)
    got, finish, deltas = streamed(client.chat.completions.create(
        model=MODEL, messages=MSGS, tools=TOOLS, tool_choice=choice, temperature=0, max_completion_tokens=80,
        stream=True))
    assert finish == "stop" and got["calls"][0]["name"] == "get_weather"
    assert json.loads(got["calls"][0]["arguments"]) == args
    assert deltas[0]["id"] and deltas[0]["function"]["name"] == "get_weather"   # id and name first
    assert sum(bool(d["function"]["arguments"]) for d in deltas) > 1            # then argument fragments


@pytest.mark.parametrize("parallel", [False, True])
def test_required_gives_valid_calls_streamed_and_not(client, parallel):
    # With parallel calls the grammar's array has no bound, so the tiny model closes it by chance: this
    # seed closes it after two calls (with the device sampler's (seed, position) stream).
    kw = dict(model=MODEL, messages=MSGS, tools=TOOLS, tool_choice="required", temperature=0.8,
              seed=11 if parallel else 3, max_completion_tokens=200, parallel_tool_calls=parallel)
    r = client.chat.completions.create(**kw)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.tool_calls
    assert parallel or len(c.message.tool_calls) == 1
    for call in c.message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), SCHEMA_OF[call.function.name])
    got, finish, _ = streamed(client.chat.completions.create(**kw, stream=True))
    assert finish == "tool_calls"
    assert [(x["name"], json.loads(x["arguments"])) for x in got["calls"]] == \
           [(x.function.name, json.loads(x.function.arguments)) for x in c.message.tool_calls]


def test_auto_parses_the_family_format_streamed_and_not(client):
    """A regex makes the model write text and then a call in GLM's format; tool_choice auto reads it."""
    regex = (r"Checking [a-z]{2,5}\.<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>[A-Z][a-z]{2,6}"
             r"</arg_value>\n<arg_key>days</arg_key>\n<arg_value>[1-9]</arg_value>\n</tool_call>")
    kw = dict(model=MODEL, messages=MSGS, tools=TOOLS, temperature=0, max_completion_tokens=80,
              extra_body={"structured_outputs": {"regex": regex}})
    c = client.chat.completions.create(**kw).choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content.startswith("Checking ")
    (call,) = c.message.tool_calls
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, WEATHER)
    got, finish, deltas = streamed(client.chat.completions.create(**kw, stream=True))
    assert finish == "tool_calls" and got["content"] == c.message.content
    assert [(x["name"], json.loads(x["arguments"])) for x in got["calls"]] == [("get_weather", args)]
    assert deltas[0]["function"]["name"] == "get_weather" and deltas[0]["id"].startswith("call_")
    none = client.chat.completions.create(**{**kw, "tool_choice": "none"}).choices[0]
    assert none.finish_reason == "stop" and "<tool_call>get_weather" in none.message.content


def test_auto_and_none_answer_as_content_without_a_grammar(client):
    for choice in ("auto", "none"):
        r = client.chat.completions.create(model=MODEL, messages=MSGS, tools=TOOLS, tool_choice=choice,
                                           temperature=0, max_completion_tokens=16)
        c = r.choices[0]
        assert c.finish_reason == "length" and c.message.content and not c.message.tool_calls


def test_a_tool_result_round_trips_through_the_template(client):
    msgs = [*MSGS, {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris", "days": 3})}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 24 C"}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, tools=TOOLS, temperature=0, max_completion_tokens=4)
    prompt = load_chat_template(EMBEDDED).render(parse_messages(msgs), tools=TOOLS)   # as the server reads them
    assert "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>" in prompt
    assert "<|observation|>\n<tool_response>\nsunny, 24 C\n</tool_response><|assistant|>" in prompt
    assert r.usage.prompt_tokens == len(Tokenizer(EMBEDDED).encode(prompt, add_special_tokens=False))


def test_reasoning_streams_separately_and_its_budget_closes_the_block(client):
    kw = dict(model=MODEL, messages=MSGS, temperature=0, max_completion_tokens=40,
              extra_body={"max_reasoning_tokens": 6})
    r = client.chat.completions.create(**kw)
    msg = r.choices[0].message
    reasoning = msg.model_extra["reasoning_content"]
    assert reasoning and "<think>" not in (msg.content or "") and "</think>" not in (msg.content or "")
    assert len(Tokenizer(EMBEDDED).encode(reasoning)) <= 6
    got, _, _ = streamed(client.chat.completions.create(**kw, stream=True))
    assert got["reasoning_content"] == reasoning and got["content"] == (msg.content or "")
    hidden = client.chat.completions.create(**{**kw, "extra_body": {"max_reasoning_tokens": 6,
                                                                   "include_reasoning": False}})
    assert hidden.choices[0].message.model_extra.get("reasoning_content") is None
    assert hidden.choices[0].message.content == msg.content


def test_content_parts_are_joined_text(client):
    parts = [{"type": "text", "text": "def fib(n):"}, {"type": "text", "text": "    return n"}]
    a = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": parts}], temperature=0,
                                       max_completion_tokens=8)
    b = client.chat.completions.create(model=MODEL, temperature=0, max_completion_tokens=8,
                                       messages=[{"role": "user", "content": "def fib(n):\n    return n"}])
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.usage.prompt_tokens == b.usage.prompt_tokens
    from openai import BadRequestError
    with pytest.raises(BadRequestError, match=r"messages\[0\].content\[1\].type.*'image_url'"):
        client.chat.completions.create(model=MODEL, max_completion_tokens=4, messages=[{"role": "user", "content": [
            parts[0], {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}])


def test_a_template_that_fails_is_a_400_naming_the_problem():
    options = parse_chat_options({"tools": TOOLS})
    raising = ChatTemplate("{{ raise_exception('system messages only') }}", "test")
    sandboxed = ChatTemplate("{{ messages.__class__.__mro__ }}", "test")
    broken = ChatTemplate("{{ messages[5].content.upper() }}", "test")
    for template, needle in ((raising, "system messages only"), (sandboxed, "sandbox"), (broken, "failed to render")):
        with pytest.raises(APIError) as err:
            plan_chat(MSGS, options, template, tool_parser="glm45", reasoning_parser="glm45", structured=None,
                      structured_field="response_format")
        assert err.value.status == 400 and needle in err.value.message and err.value.param == "messages"
    with pytest.raises(ValueError, match="does not compile"):
        ChatTemplate("{% for %}", "test")


@pytest.fixture(scope="module")
def models():
    return (LLM(EMBEDDED, dtype="float64", kv_cache_tokens=4096, enforce_eager=True),
            LLM(EMBEDDED, dtype="float64", kv_cache_tokens=4096, spec="mtp", num_drafts=3, enforce_eager=True))


GRAMMARS = {"required": StructuredOutput.json_schema(required_schema(SCHEMA_OF, False)),
            "budget+named": budget_grammar(5, False, StructuredOutput.json_schema(WEATHER))}


@pytest.mark.parametrize("kind", GRAMMARS)     # a named function's grammar is a JSON schema: test_structured_outputs
def test_greedy_output_with_mtp_equals_without_under_a_tool_grammar(models, kind):
    plain, mtp = models
    prompt = load_chat_template(EMBEDDED).render(MSGS, tools=TOOLS)
    ids = Tokenizer(EMBEDDED).encode(prompt, add_special_tokens=False)
    params = SamplingParams(max_tokens=60, structured=GRAMMARS[kind], temperature=0)
    want = plain.generate([ids], params)[0]
    verifies = mtp.engine.metrics.verifies
    got = mtp.generate([ids], params)[0]
    assert got.token_ids == want.token_ids and got.finish_reason == "stop"
    assert mtp.engine.metrics.verifies > verifies
    text = got.text.split("</think>")[-1].strip()
    if kind == "required":
        for call in json.loads(text):
            jsonschema.validate(call["parameters"], SCHEMA_OF[call["name"]])
    else:
        jsonschema.validate(json.loads(text), WEATHER)


FAMILY_PARSERS = {"qwen_norm": ("hermes", "qwen3"), "deepseek_yarn": ("deepseek_v31", "deepseek_r1"),
                  "glm_lite": ("glm45", "glm45")}


@pytest.mark.parametrize("case", FAMILY_PARSERS)
def test_other_families_get_their_parsers_and_valid_calls(family_ckpt, case):
    """Random checkpoints of the other families: the family's default parsers, and tool_choice
    required gives a call valid for its schema (eager, plain: MTP under a grammar is covered above)."""
    from launch.cli import chat_parsers
    path = family_ckpt(case)
    assert chat_parsers(str(path), None, None) == FAMILY_PARSERS[case]
    ids = Tokenizer(path).encode(load_chat_template(path).render(MSGS), add_special_tokens=False)
    params = SamplingParams(max_tokens=120, structured=GRAMMARS["required"], temperature=0)
    out = LLM(path, dtype="float32", kv_cache_tokens=512, enforce_eager=True).generate([ids], params)[0]
    assert out.finish_reason == "stop"
    (call,) = json.loads(out.text)
    jsonschema.validate(call["parameters"], SCHEMA_OF[call["name"]])
