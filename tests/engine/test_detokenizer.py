"""The incremental detokenizer: the same text as one decode of the whole output, stop strings
cut where they begin, and a cost per update that does not grow with the output."""
from __future__ import annotations

import random
from pathlib import Path

import pytest

from engine.detokenizer import IncrementalDetokenizer
from engine.tokenizer import Tokenizer

MODEL = Path(__file__).resolve().parents[2] / "models" / "tiny-glm-moe"


@pytest.fixture(scope="module")
def tok(ckpt_plain) -> Tokenizer:
    return Tokenizer(ckpt_plain)


def feed(detok: IncrementalDetokenizer, ids: list[int], step: int) -> None:
    for i in range(0, len(ids), step):
        detok.append(ids[i:i + step])


@pytest.mark.parametrize("step", [1, 2, 4])
def test_equals_one_decode_of_the_whole_output(tok, step):
    rng = random.Random(step)
    for _ in range(20):
        # Random ids of a byte-level BPE: many of them split UTF-8 characters or are invalid alone.
        out = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 60))]
        detok = IncrementalDetokenizer(tok)
        feed(detok, out, step)
        detok.finish()
        assert detok.text == tok.decode(out)


def test_real_text_streams_without_half_characters():
    tok = Tokenizer(MODEL)
    text = "def f(x):\n    return 'naïve café — 東京' + x  # ✓\n"
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok)
    seen = []
    for t in ids:
        detok.append([t])
        seen.append(detok.text)
        assert "\ufffd" not in detok.text
    detok.finish()
    assert detok.text == tok.decode(ids) == text
    assert all(b.startswith(a) for a, b in zip(seen, seen[1:]))   # text only ever grows


def test_stop_strings_cut_where_they_begin(tok):
    text = "alpha beta gamma delta"
    ids = tok.encode(text)
    for stops, want in (((" gam",), "alpha beta"), (("ta g", "lph"), "a"), (("zzz",), text)):
        for step in (1, 3):
            detok = IncrementalDetokenizer(tok, stops)
            feed(detok, ids, step)
            detok.finish()
            assert detok.text == want and detok.stopped == (want != text)
            if detok.stopped:
                detok.append(ids[:3])              # nothing is added after a stop
                assert detok.text == want


def test_a_stop_string_straddling_two_updates(tok):
    ids = tok.encode("xx STOP yy")
    detok = IncrementalDetokenizer(tok, ("STOP",))
    cut = next(i for i in range(1, len(ids)) if "ST" in tok.decode(ids[:i]) and "STOP" not in tok.decode(ids[:i]))
    detok.append(ids[:cut])
    assert not detok.stopped
    detok.append(ids[cut:])
    assert detok.stopped and detok.text == "xx "


def test_cost_per_update_does_not_grow_with_the_output(tok):
    calls: list[int] = []

    class Counting:
        def decode(self, ids):
            calls.append(len(ids))
            return tok.decode(ids)

    detok = IncrementalDetokenizer(Counting())
    ids = tok.encode("the quick brown fox jumps over the lazy dog. " * 40)
    for t in ids:
        detok.append([t])
    assert len(ids) > 300
    # Each update decodes two windows of a few tokens, never the output so far.
    assert len(calls) == 2 * len(ids) and max(calls) <= 8


@pytest.mark.parametrize("step", [1, 3, 5, 100])
def test_min_tokens_holds_stop_strings_back(step):
    """A stop string inside the first min_tokens tokens does not stop; one after them does, at the
    same place however the tokens arrive (speculation commits several at once)."""
    tok = Tokenizer(MODEL)
    ids = tok.encode("x = 1\ny = 2\nz = 3\nw = 4\n")
    first = len(tok.encode("x = 1\n"))
    held = IncrementalDetokenizer(tok, ["\n"], min_tokens=first + 1)
    feed(held, ids, step)
    assert held.stopped and held.text == "x = 1\ny = 2"
    plain = IncrementalDetokenizer(tok, ["\n"])
    feed(plain, ids, step)
    assert plain.text == "x = 1"
    # min_tokens reaching exactly past "y = 2\n": the next newline is the one after "z = 3".
    late = IncrementalDetokenizer(tok, ["\n"], min_tokens=len(tok.encode("x = 1\ny = 2\n")))
    feed(late, ids, step)
    assert late.text == "x = 1\ny = 2\nz = 3"


def test_token_bytes_of_partial_characters_join_into_the_text():
    from serving.responses import TextOffsets, TokenText, chat_logprobs
    from runtime.sample.sampler import TokenLogprobs
    tok = Tokenizer(MODEL)
    text = "é → 😊 ok"
    ids = tok.encode(text)
    text_of = TokenText(tok)
    content = chat_logprobs(text_of, ids, [TokenLogprobs(t, -1.0, ((t, -1.0),)) for t in ids])["content"]
    assert bytes(b for c in content for b in c["bytes"]).decode() == text
    shown = [c["token"] for c in content]
    assert "\ufffd" not in "".join(shown)                        # never U+FFFD: escaped bytes instead
    assert shown[:2] == ["\\xc3", "\\xa9"] and content[0]["top_logprobs"][0]["bytes"] == [0xC3]
    offsets = TextOffsets(0)
    at = [offsets.next(text_of.bytes_of(t)) for t in ids]
    assert at[:3] == [0, 0, 1]                                   # both pieces of "é" sit at its offset
