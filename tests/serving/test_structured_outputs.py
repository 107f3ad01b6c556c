"""Structured outputs: a JSON schema, a regex and a choice list hold the output, through the
official openai client against `metrale serve --spec mtp` (the embedded model) and in-process on
the random test checkpoint; and with speculation the tokens are those of plain decoding (float64,
greedy and seeded): the grammar masks the target's rows, so drafts it forbids are rejected."""
from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest

from runtime.sample.grammar import StructuredOutput
from runtime.sample.sampler import SamplingParams
from serving.llm import LLM
from tests.launch.test_server import MODEL, openai_client, start_server, stop_server

EMBEDDED = Path(__file__).resolve().parents[2] / "models" / "tiny-glm-moe"
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "n", "ok", "kind"],
          "properties": {"name": {"type": "string", "maxLength": 8}, "n": {"type": "integer", "minimum": 0, "maximum": 99},
                         "ok": {"type": "boolean"}, "kind": {"enum": ["def", "class", "import"]}}}
REGEX = r"[a-z]{2,5}-[0-9]{2}"
CHOICES = ["positive", "negative", "neutral"]
KINDS = {"json": StructuredOutput.json_schema(SCHEMA), "regex": StructuredOutput.regex(REGEX),
         "choice": StructuredOutput.choice(CHOICES)}
PROMPTS = {"random": [[5, 17, 200, 3, 5, 17, 200], [9, 9, 9, 100, 250, 31], [300], [41, 42, 41, 42, 41]],
           "embedded": ["def fib(n):\n", "x = {", "class Stack:\n"]}


def holds(kind: str, text: str) -> None:
    if kind == "json":
        jsonschema.validate(json.loads(text), SCHEMA)
    elif kind == "regex":
        assert re.fullmatch(REGEX, text), text
    else:
        assert text in CHOICES, text


@pytest.fixture(scope="module")
def models(ckpt_mtp):
    """which -> (plain float64 LLM, chain-MTP float64 LLM), loaded on first use."""
    cache: dict[str, tuple[LLM, LLM]] = {}

    def get(which: str) -> tuple[LLM, LLM]:
        if which not in cache:
            path = ckpt_mtp if which == "random" else EMBEDDED
            cache[which] = (LLM(path, dtype="float64", kv_cache_tokens=4096),
                            LLM(path, dtype="float64", kv_cache_tokens=4096, spec="mtp", num_drafts=3))
        return cache[which]
    return get


CASES = [(w, k, t) for w in PROMPTS for k in KINDS for t in ("greedy", "seeded") if w == "random" or k == "json"]


@pytest.mark.parametrize("which, kind, mode", CASES, ids=["-".join(c) for c in CASES])
def test_grammar_holds_and_speculation_gives_the_same_tokens(models, which, kind, mode):
    plain, mtp = models(which)
    sampling = dict(temperature=0.9, seed=11) if mode == "seeded" else {}
    params = SamplingParams(max_tokens=160, structured=KINDS[kind], logprobs=1, **sampling)
    want = plain.generate(PROMPTS[which], params)
    verifies = mtp.engine.metrics.verifies
    got = mtp.generate(PROMPTS[which], params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert mtp.engine.metrics.verifies > verifies                     # the grammar rows really were verified
    for o in got:
        assert o.finish_reason == "stop" and 0 not in o.token_ids     # the complete grammar ends it, no EOS step
        holds(kind, o.text)
        assert all(lp.logprob > float("-inf") for lp in o.logprobs)


def test_a_tree_verify_gives_the_same_tokens_under_a_grammar(models, ckpt_mtp):
    plain, _ = models("random")
    params = SamplingParams(max_tokens=160, structured=KINDS["json"], temperature=0.9, seed=5)
    tree = LLM(ckpt_mtp, dtype="float64", kv_cache_tokens=4096, spec="mtp", num_drafts=3, tree_shape="1,2,2")
    got = tree.generate(PROMPTS["random"], params)
    assert [o.token_ids for o in got] == [o.token_ids for o in plain.generate(PROMPTS["random"], params)]
    for o in got:
        holds("json", o.text)


@pytest.fixture(scope="module")
def client():
    proc, base = start_server(EMBEDDED, "--spec", "mtp", "--kv-cache-tokens", "4096", "--max-num-seqs", "8")
    yield openai_client(base)
    stop_server(proc)


def test_chat_json_schema_parses_and_validates_with_mtp(client):
    msgs = [{"role": "user", "content": "Describe a symbol."}]
    fmt = {"type": "json_schema", "json_schema": {"name": "symbol", "schema": SCHEMA, "strict": True}}
    r = client.chat.completions.create(model=MODEL, messages=msgs, response_format=fmt, n=3, temperature=1.0,
                                       seed=4, max_completion_tokens=120)
    for c in r.choices:
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.message.content), SCHEMA)
    assert r.usage.model_extra["metrale_spec_decode"]["num_draft_tokens"] > 0    # MTP drafted
    stream = client.chat.completions.create(model=MODEL, messages=msgs, response_format=fmt, n=3, temperature=1.0,
                                            seed=4, max_completion_tokens=120, stream=True)
    texts = ["", "", ""]
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    assert texts == [c.message.content for c in r.choices]
    obj = client.chat.completions.create(model=MODEL, messages=msgs, response_format={"type": "json_object"},
                                         max_completion_tokens=120)
    content = obj.choices[0].message.content                          # any object: it may run to the limit
    assert content.startswith("{") and (obj.choices[0].finish_reason == "length" or isinstance(json.loads(content), dict))


def test_regex_and_choice_on_both_endpoints(client):
    for body, kind in (({"regex": REGEX}, "regex"), ({"choice": CHOICES}, "choice")):
        r = client.completions.create(model=MODEL, prompt=["def f(x):", "# a"], n=2, temperature=1.0, seed=1,
                                      max_tokens=40, extra_body={"structured_outputs": body})
        assert len(r.choices) == 4
        for c in r.choices:
            assert c.finish_reason == "stop"
            holds(kind, c.text)
        chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Mood?"}],
                                              max_completion_tokens=40, extra_body={"structured_outputs": body})
        holds(kind, chat.choices[0].message.content)
