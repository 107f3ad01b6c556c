"""n, best_of, logprobs, echo, batched prompts, penalties and bias, min_tokens, and refused fields,
through the official openai client against `metrale serve` (float64, the tiny test checkpoint).
Logprobs are checked against log_softmax of the model's logits computed here, in-process, by a
fresh runner over the whole prompt and output in one forward."""
from __future__ import annotations

import pytest
import torch

from runtime.executor.attention import SeqChunk
from runtime.executor.runner import ModelRunner
from runtime.sample.sampler import SamplingParams
from runtime.model.weights import load_model
from serving.llm import LLM
from serving.responses import TokenText
from tests.launch.test_server import MODEL, openai_client, start_server, stop_server

PROMPT = "def main():\n    x ="
IDS = [5, 17, 200, 3, 5, 17, 200, 9]
EOS = 0


@pytest.fixture(scope="module")
def server(ckpt_plain):
    proc, base = start_server(ckpt_plain, "--kv-cache-tokens", "8192", "--max-num-seqs", "32")
    yield base
    stop_server(proc)


@pytest.fixture
def client(server):
    return openai_client(server)


@pytest.fixture(scope="module")
def local(ckpt_plain):
    """The same checkpoint in-process: the engine (for token ids) and a separate runner (for logits)."""
    llm = LLM(ckpt_plain, dtype="float64", kv_cache_tokens=2048)
    runner = ModelRunner(load_model(ckpt_plain, torch.float64, device="cpu"), kv_cache_tokens=2048)
    return llm, runner


def model_logprobs(runner: ModelRunner, ids: list[int], temperature: float) -> torch.Tensor:
    """log_softmax(logits / T) [L, V] of every position of `ids`, from one forward (row i predicts i + 1)."""
    runner.cache.free(0)
    runner.cache.reserve(0, len(ids))
    hidden, _ = runner.forward(ids, [SeqChunk(0, 0, len(ids))])
    logits = runner.logits(hidden, list(range(len(ids))))
    return torch.log_softmax(logits / (temperature or 1.0), dim=-1)


def tokens_of(choice) -> list[str]:
    return choice.logprobs.tokens


def test_n_choices_are_distinct_reproducible_and_choice_zero_is_the_seed(client):
    def run(**kw):
        r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0.8, seed=11,
                                      extra_body={"ignore_eos": True}, **kw)
        return [(c.index, c.text) for c in r.choices]

    three = run(n=3)
    assert [i for i, _ in three] == [0, 1, 2]
    assert len({t for _, t in three}) == 3
    assert run(n=3) == three
    assert run(n=1) == three[:1]
    unseeded = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0.8, n=3,
                                         extra_body={"ignore_eos": True})
    assert len({c.text for c in unseeded.choices}) == 3
    assert unseeded.usage.completion_tokens == 36


def test_completion_logprobs_are_the_models(client, local):
    llm, runner = local
    r = client.completions.create(model=MODEL, prompt=IDS, max_tokens=10, temperature=0.8, seed=3, logprobs=5,
                                  extra_body={"ignore_eos": True})
    out = llm.generate([IDS], SamplingParams(max_tokens=10, temperature=0.8, seed=3, ignore_eos=True))[0].token_ids
    lp = r.choices[0].logprobs
    text_of = TokenText(llm.tokenizer)
    assert lp.tokens == [text_of(t) for t in out]
    want = model_logprobs(runner, IDS + out, 0.8)[len(IDS) - 1:-1]                # rows predicting the output
    for i, t in enumerate(out):
        assert abs(lp.token_logprobs[i] - want[i, t].item()) < 1e-9
        # The top 5 and the chosen token; of ids that decode alike (part of a UTF-8 character) the likeliest.
        expect: dict[str, float] = {}
        top = torch.topk(want[i], 5)
        for j, v in zip(top.indices.tolist(), top.values.tolist()):
            expect.setdefault(text_of(j), v)
        expect.setdefault(lp.tokens[i], want[i, t].item())
        got = lp.top_logprobs[i]
        assert got.keys() == expect.keys() and all(abs(got[k] - expect[k]) < 1e-9 for k in got)
    # Offsets in characters of the text: where the characters completed before each token end (a
    # character still missing bytes, U+FFFD at the prefix's end, is not counted yet).
    for i, at in enumerate(lp.text_offset):
        before = llm.tokenizer.decode(out[:i])
        assert len(before.rstrip("\ufffd")) <= at <= len(before)


def test_echo_with_logprobs_covers_the_prompt(client, local):
    llm, runner = local
    r = client.completions.create(model=MODEL, prompt=IDS, max_tokens=4, temperature=0, logprobs=2, echo=True,
                                  extra_body={"ignore_eos": True})
    c = r.choices[0]
    out = llm.generate([IDS], SamplingParams(max_tokens=4, ignore_eos=True))[0].token_ids
    prompt_text = llm.tokenizer.decode(IDS)
    assert c.text.startswith(prompt_text) and len(tokens_of(c)) == len(IDS) + 4
    assert c.logprobs.token_logprobs[0] is None and c.logprobs.top_logprobs[0] is None
    want = model_logprobs(runner, IDS + out, 0.0)
    for i, t in enumerate((IDS + out)[1:], start=1):
        assert abs(c.logprobs.token_logprobs[i] - want[i - 1, t].item()) < 1e-9
    assert c.logprobs.text_offset[0] == 0 and c.logprobs.text_offset[len(IDS)] == len(prompt_text)


def test_chat_logprobs_n_stop_and_max_completion_tokens(client):
    msgs = [{"role": "user", "content": "print hello"}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_completion_tokens=6, temperature=0.9, seed=2,
                                       n=2, logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1] and r.choices[0].message.content != r.choices[1].message.content
    assert r.usage.completion_tokens == 12 and all(c.finish_reason == "length" for c in r.choices)
    for c in r.choices:
        content = c.logprobs.content
        assert len(content) == 6
        assert bytes(b for x in content for b in x.bytes).decode("utf-8", "replace") == c.message.content
        for x in content:
            assert len(x.top_logprobs) == 3
            values = [t.logprob for t in x.top_logprobs]
            assert values == sorted(values, reverse=True) and x.logprob <= values[0]
    again = client.chat.completions.create(model=MODEL, messages=msgs, max_completion_tokens=6, temperature=0.9,
                                           seed=2, n=2, extra_body={"ignore_eos": True})
    assert [c.message.content for c in again.choices] == [c.message.content for c in r.choices]
    text = r.choices[0].message.content
    stop = text[2:4]
    cut = client.chat.completions.create(model=MODEL, messages=msgs, max_completion_tokens=6, temperature=0.9,
                                         seed=2, stop=[stop, "\u2603"], extra_body={"ignore_eos": True})
    assert cut.choices[0].message.content == text[:text.index(stop)] and cut.choices[0].finish_reason == "stop"


def test_batched_prompts_equal_separate_requests(client):
    kw = dict(model=MODEL, max_tokens=8, temperature=0.7, seed=5, n=2, extra_body={"ignore_eos": True})
    for prompts in (["import os", "class A:", PROMPT], [IDS, IDS[:3]]):
        together = client.completions.create(prompt=prompts, **kw)
        assert [c.index for c in together.choices] == list(range(2 * len(prompts)))
        alone = [c.text for p in prompts for c in client.completions.create(prompt=p, **kw).choices]
        assert [c.text for c in together.choices] == alone


def test_streamed_choices_interleave_and_equal_the_plain_response(client):
    kw = dict(model=MODEL, prompt=["import os", "x = 1"], max_tokens=10, temperature=0.8, seed=4, n=2, logprobs=1,
              echo=True, extra_body={"ignore_eos": True})
    plain = client.completions.create(**kw)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    # All four advance together, a token per step: each step's chunks in choice order.
    assert [c.choices[0].index for c in chunks if c.choices] == [0, 1, 2, 3] * 10
    for choice in plain.choices:
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == choice.index]
        assert "".join(c.text for c in mine) == choice.text
        assert [t for c in mine for t in c.logprobs.tokens] == choice.logprobs.tokens
        assert [v for c in mine for v in c.logprobs.token_logprobs] == choice.logprobs.token_logprobs
        assert [v for c in mine for v in c.logprobs.text_offset] == choice.logprobs.text_offset
        assert mine[-1].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == 40 == plain.usage.completion_tokens


def test_best_of_returns_the_highest_cumulative_logprob(client):
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=1.0, seed=9, logprobs=0,
              extra_body={"ignore_eos": True})
    every = client.completions.create(n=4, **kw).choices
    best = client.completions.create(n=2, best_of=4, **kw)
    ranked = sorted(every, key=lambda c: -sum(c.logprobs.token_logprobs))
    assert [c.text for c in best.choices] == [c.text for c in ranked[:2]]
    assert [c.index for c in best.choices] == [0, 1] and best.usage.completion_tokens == 32


def greedy_ids(llm: LLM, **kw) -> list[int]:
    return llm.generate([IDS], SamplingParams(max_tokens=24, ignore_eos=True, **kw))[0].token_ids


@pytest.mark.parametrize("field, value", [("presence_penalty", 2.0), ("frequency_penalty", 2.0),
                                          ("repetition_penalty", 3.0)])
def test_penalties_change_the_output_as_defined(client, local, field, value):
    llm, _ = local
    base = greedy_ids(llm)
    assert len(set(base)) < len(base)                        # unpenalised, the greedy output repeats itself
    ids = greedy_ids(llm, **{field: value})
    r = client.completions.create(model=MODEL, prompt=IDS, max_tokens=24, temperature=0,
                                  extra_body={"ignore_eos": True, field: value})
    assert r.choices[0].text == llm.tokenizer.decode(ids) != llm.tokenizer.decode(base)
    if field == "repetition_penalty":                        # prompt tokens are penalised too
        assert not set(ids) & set(IDS)
    else:                                                    # output tokens only: it never repeats one
        assert len(set(ids)) == len(ids)


def test_logit_bias_forces_a_token_and_min_tokens_holds_eos_back(client, local):
    llm, _ = local
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=1.0, seed=1,
                                  logit_bias={"77": 100}, extra_body={"ignore_eos": True})
    assert r.choices[0].text == llm.tokenizer.decode([77] * 6)
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=20, temperature=0.8, seed=1, logit_bias={str(EOS): 100})
    assert client.completions.create(**kw).usage.completion_tokens == 1      # EOS at once
    held = client.completions.create(extra_body={"min_tokens": 5}, **kw)
    assert held.usage.completion_tokens == 6 and held.choices[0].finish_reason == "stop"


# Each a 400 whose `param` names the field (completions unless the third item says chat).
BAD = [
    ({"suffix": "x"}, "suffix", False),
    ({"foo": 1}, "foo", False),
    ({"stop_token_ids": [1]}, "stop_token_ids", False),
    ({"response_format": {"type": "json"}}, "response_format", False),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
     "response_format", False),
    ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs", False),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", False),
    ({"structured_outputs": {"grammar": "root ::= x"}}, "structured_outputs.grammar", False),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", False),
    ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}}, "structured_outputs",
     False),
    ({"logprobs": 21}, "logprobs", False),
    ({"logprobs": True}, "logprobs", False),
    ({"echo": "yes"}, "echo", False),
    ({"n": 3, "best_of": 2}, "best_of", False),
    ({"n": 0}, "n", False),
    ({"stream": True, "best_of": 2}, "best_of", False),
    ({"presence_penalty": 2.5}, "presence_penalty", False),
    ({"frequency_penalty": -3}, "frequency_penalty", False),
    ({"repetition_penalty": 0}, "repetition_penalty", False),
    ({"min_p": 1.5}, "min_p", False),
    ({"min_tokens": 20, "max_tokens": 10}, "min_tokens", False),
    ({"logit_bias": {"abc": 1}}, "logit_bias", False),
    ({"logit_bias": {"999999": 1}}, "logit_bias", False),
    ({"logit_bias": {"5": 101}}, "logit_bias", False),
    ({"seed": -1}, "seed", False),
    ({"stream_options": {"include_usage": True}}, "stream_options", False),
    ({"stream": True, "stream_options": {"continuous_usage_stats": True}}, "stream_options.continuous_usage_stats",
     False),
    ({"prompt": ["a", [1, 2]]}, "prompt", False),
    ({"tools": [{"type": "function", "function": {"name": "f g"}}]}, "tools[0].function.name", True),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": {"type": "function",
      "function": {"name": "g"}}}, "tool_choice.function.name", True),
    ({"chat_template_kwargs": [1]}, "chat_template_kwargs", True),
    ({"max_reasoning_tokens": 0}, "max_reasoning_tokens", True),
    ({"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]},
     "messages[0].content[0].type", True),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id", True),
    ({"tool_choice": "auto"}, "tool_choice", True),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}, "response_format.json_schema.name",
     True),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}, "foo": 1}}},
     "response_format.json_schema.foo", True),
    ({"functions": [{"name": "f"}]}, "functions", True),
    ({"top_logprobs": 3}, "top_logprobs", True),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", True),
    ({"echo": True}, "echo", True),
    ({"best_of": 2}, "best_of", True),
    ({"max_tokens": 5, "max_completion_tokens": 5}, "max_tokens", True),
    ({"messages": [{"role": "user", "content": "x", "audio": {}}]}, "messages[0].audio", True),
]


@pytest.mark.parametrize("fields, param, chat", BAD, ids=[f"{'chat' if c else 'cmpl'}-{p}" for _, p, c in BAD])
def test_unsupported_or_malformed_fields_are_a_400_naming_them(client, fields, param, chat):
    from openai import BadRequestError
    with pytest.raises(BadRequestError) as err:
        if chat:
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                           extra_body=fields)
        else:
            client.completions.create(model=MODEL, prompt="x", max_tokens=4, extra_body=fields)
    assert err.value.param == param and param.split(".")[0].split("[")[0] in err.value.message


def test_min_tokens_holds_a_stop_string_back(client, local):
    llm, _ = local
    piece = llm.tokenizer.decode([77])
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logit_bias={"77": 100}, stop=[piece])
    assert client.completions.create(**kw).choices[0].text == ""            # the first token is the stop string
    held = client.completions.create(extra_body={"min_tokens": 3}, **kw).choices[0]
    assert held.text == piece * 3 and held.finish_reason == "stop"
