"""OpenAI response pieces: choices, logprobs in the completions and chat shapes, usage, and the
per-choice state of a stream.

Logprobs are the engine's (docs/design.md §5.2): for each output token, log_softmax of the
target's logits after penalties, bias and temperature, from the row that produced it; for echoed
prompt tokens, after temperature only, the first being null. A token's text is what the tokenizer
decodes it to alone; a token holding only part of a UTF-8 character shows its bytes escaped
(`\\xe2\\x80`, as OpenAI does) instead of U+FFFD, and chat's `bytes` are the token's own bytes, so
a client can join them into the character. `text_offset` counts characters of the real text: the
pieces of one character all sit at that character's offset.
"""
from __future__ import annotations

import codecs
import json
from collections.abc import Sequence as Seq
from json.encoder import encode_basestring_ascii as json_str

from runtime.sample.sampler import TokenLogprobs
from engine.sequence import Sequence
from engine.tokenizer import Tokenizer
from serving.chat import ChatPlan, finish_reason


class TokenText:
    """Token id -> its text and bytes, cached (without a tokenizer: "token_id:N")."""

    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer
        self.cache: dict[int, tuple[str, bytes]] = {}

    def __call__(self, token: int) -> str:
        return self.entry(token)[0]

    def bytes_of(self, token: int) -> bytes:
        return self.entry(token)[1]

    def entry(self, token: int) -> tuple[str, bytes]:
        got = self.cache.get(token)
        if got is None:
            if self.tokenizer is None:
                text = f"token_id:{token}"
                got = text, text.encode()
            else:
                raw = self.tokenizer.token_bytes(token)
                text = self.tokenizer.decode([token])
                if "\ufffd" in text and "\ufffd" not in raw.decode("utf-8", "ignore"):
                    text = raw.decode("utf-8", "backslashreplace")     # part of a character: its bytes, escaped
                got = text, raw
            self.cache[token] = got
        return got


class TextOffsets:
    """The character offset of each token in the text the tokens decode to, from `start`."""

    def __init__(self, start: int = 0) -> None:
        self.offset = start
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")

    def next(self, raw: bytes) -> int:
        """The offset of a token with bytes `raw`, then step past the characters it completes."""
        at = self.offset
        self.offset += len(self._utf8.decode(raw))
        return at


class TextStream:
    """Text deltas of a sequence's output text, which its engine-side incremental detokenizer
    keeps (one decode of a short window per update, shared with stop strings). Until the end it
    holds back the last characters a stop string still to come could remove; the detokenizer
    itself never shows half a UTF-8 character."""

    def __init__(self, stops: tuple[str, ...] | None) -> None:
        self.holdback = max((len(s) for s in stops), default=1) - 1 if stops else 0
        self.sent = 0

    def delta(self, text: str, finished: bool) -> str:
        if not finished:
            text = text[:max(self.sent, len(text) - self.holdback)]
        out = text[self.sent:]
        self.sent = len(text)
        return out


def completion_logprobs(text_of: TokenText, tokens: Seq[int], entries: Seq[TokenLogprobs | None],
                        offsets: TextOffsets) -> dict:
    """The completions shape: tokens, token_logprobs, top_logprobs (the top alternatives plus the
    chosen token, as OpenAI returns up to logprobs + 1), text_offset (advancing `offsets`)."""
    out: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token, e in zip(tokens, entries):
        text = text_of(token)
        out["tokens"].append(text)
        out["text_offset"].append(offsets.next(text_of.bytes_of(token)))
        out["token_logprobs"].append(None if e is None else e.logprob)
        if e is None:
            out["top_logprobs"].append(None)
        else:
            top: dict[str, float] = {}
            for t, lp in e.top:     # best first: of ids that decode alike, the dict keeps the likeliest
                top.setdefault(text_of(t), lp)
            top.setdefault(text, e.logprob)
            out["top_logprobs"].append(top)
    return out


def chat_logprobs(text_of: TokenText, tokens: Seq[int], entries: Seq[TokenLogprobs]) -> dict:
    """The chat shape: content = [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]."""
    def item(token: int, logprob: float) -> dict:
        text, raw = text_of.entry(token)
        return {"token": text, "logprob": logprob, "bytes": list(raw)}

    return {"content": [{**item(token, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]}
                        for token, e in zip(tokens, entries)], "refusal": None}


def best_sequences(seqs: list[Sequence], n: int) -> list[Sequence]:
    """The n sequences with the highest cumulative logprob (ties: lower index first); all of them,
    in order, when there are n."""
    if len(seqs) == n:
        return seqs
    return sorted(seqs, key=lambda s: -s.cumulative_logprob)[:n]


def usage(seqs: list[Sequence], prompt_tokens: int, best_of: int = 1) -> dict:
    """Prompt tokens once per prompt (`seqs` holds `best_of` sequences per prompt, in prompt order),
    and of them those the prefix cache held (the first sequence's of each prompt); completion tokens
    over every sequence generated (best_of too). Speculation's counts go under a field of our own,
    `metrale_spec_decode` (named as the `/metrics` series: verifies of drafted sequences, draft
    tokens proposed, drafts accepted): OpenAI's `accepted_prediction_tokens` /
    `rejected_prediction_tokens` belong to its Predicted Outputs (a `prediction` field, which this
    server refuses), so `completion_tokens_details` is left out, as vLLM leaves it."""
    completion = sum(s.num_output for s in seqs)
    cached = sum(s.num_cached_tokens for s in seqs[::best_of])
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
            "metrale_spec_decode": {"num_drafts": sum(s.num_verifies for s in seqs),
                                    "num_draft_tokens": sum(s.drafted_tokens for s in seqs),
                                    "num_accepted_tokens": sum(s.accepted_tokens for s in seqs)}}


def completion_choice(index: int, seq: Sequence, text_of: TokenText, *, echo: str | None,
                      logprobs: bool) -> dict:
    """One finished choice of /v1/completions (`echo`: the prompt text to put in front)."""
    lp = None
    if logprobs:
        lp = completion_logprobs(text_of, seq.output_ids, seq.logprobs, TextOffsets(len(echo or "")))
        if echo is not None:
            prompt = completion_logprobs(text_of, seq.token_ids[:seq.prompt_len], seq.prompt_logprobs, TextOffsets())
            lp = {k: prompt[k] + lp[k] for k in lp}
    return {"index": index, "text": (echo or "") + seq.text, "logprobs": lp, "finish_reason": seq.finish_reason}


def chat_choice(index: int, seq: Sequence, text_of: TokenText, *, logprobs: bool, plan: ChatPlan) -> dict:
    """One finished chat choice: the text parsed into reasoning_content, content and tool_calls."""
    out = plan.stream()
    out.feed(seq.text, final=True)
    return {"index": index, "message": out.message(),
            "logprobs": chat_logprobs(text_of, seq.output_ids, seq.logprobs) if logprobs else None,
            "finish_reason": finish_reason(seq.finish_reason, out, plan.options.tool_choice == "function")}


class ChoiceStream:
    """One choice of a stream: what it has sent of the text and of the tokens' logprobs."""

    def __init__(self, index: int, text_of: TokenText, *, stops: tuple[str, ...] | None, chat: bool,
                 echo: str | None, logprobs: bool, plan: ChatPlan | None = None) -> None:
        """`plan`: a chat request's (its text becomes reasoning_content, content and tool_calls deltas)."""
        self.index, self.text_of = index, text_of
        self.plan = plan
        self.parser = plan.stream() if plan is not None else None
        self.chat, self.echo, self.logprobs = chat, echo, logprobs
        self.text = TextStream(stops)
        self.num_tokens = 0                     # output tokens whose logprobs went out
        self.offsets = TextOffsets()            # text_offset of the next token
        self.started = False

    def role(self) -> dict:
        """A chat choice's first chunk."""
        return {"index": self.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                "finish_reason": None}

    def next(self, seq: Sequence, num_output: int, finished: bool) -> dict | None:
        """The choice's next chunk after an update of its sequence (None when there is nothing to
        say yet, never for a completion's first token, whose chunk is what a client times its
        first token by, as vLLM's server sends one for every token): the text delta and the logprobs of the tokens committed since the last chunk; a
        completion's first chunk carries the echoed prompt (and its logprobs) in front."""
        delta = self.text.delta(seq.text, finished)
        span = slice(seq.prompt_len + self.num_tokens, seq.prompt_len + num_output)
        tokens = seq.token_ids[span]
        entries = seq.logprobs[num_output - len(tokens):num_output] if self.logprobs else []
        self.num_tokens = num_output
        first = not self.started
        echo = first and not self.chat and self.echo is not None
        self.started = True
        lp = None
        if self.logprobs and self.chat:
            lp = chat_logprobs(self.text_of, tokens, entries) if tokens else None
        elif self.logprobs:
            prompt = None
            if echo:
                prompt = completion_logprobs(self.text_of, seq.token_ids[:seq.prompt_len], seq.prompt_logprobs,
                                             TextOffsets())
                self.offsets = TextOffsets(len(self.echo))
            lp = completion_logprobs(self.text_of, tokens, entries, self.offsets)
            if prompt is not None:
                lp = {k: prompt[k] + lp[k] for k in lp}
        finish = seq.finish_reason if finished else None
        if self.chat:
            if self.parser is not None:
                parts = self.parser.feed(delta, final=finished) if delta or finished else {}
                if finished:
                    finish = finish_reason(finish, self.parser, self.plan.options.tool_choice == "function")
            else:
                parts = {"content": delta} if delta else {}
            if not (parts or finished or (self.logprobs and tokens)):
                return None
            return {"index": self.index, "delta": parts, "logprobs": lp, "finish_reason": finish}
        if not (delta or first or finished or (self.logprobs and tokens)):
            return None     # the first token always has a chunk (empty text if it ends inside a character)
        return {"index": self.index, "text": (self.echo if echo else "") + delta, "logprobs": lp,
                "finish_reason": finish}


class EventEncoder:
    """A stream's server-sent events as the bytes `"data: " + json.dumps(chunk) + "\\n\\n"` gives,
    written from a template: every chunk of one stream shares its id, object, created and model,
    which are encoded once, and a plain choice (a completion's text, or a chat delta holding only
    content, without logprobs) is spliced in with json's C string encoder. Anything else goes
    through `json.dumps`. Per streamed token this replaces a dict of the whole chunk and its
    `json.dumps` on the event loop's thread, which shares the step's cores."""

    def __init__(self, rid: str, obj: str, created: int, model: str) -> None:
        self.head = "data: " + json.dumps({"id": rid, "object": obj, "created": created, "model": model})[:-1] \
            + ', "choices": ['

    def event(self, choices: list[dict], **extra) -> str:
        """One event: the chunk with these choices (and extra top-level fields, e.g. usage)."""
        body = ", ".join(map(choice_json, choices))
        if extra:
            body += "], " + json.dumps(extra)[1:] + "\n\n"
        else:
            body += "]}\n\n"
        return self.head + body


def choice_json(c: dict) -> str:
    """`json.dumps(c)` of a streamed choice, without building the encoder's state for the plain ones."""
    if c.get("logprobs", 0) is None and len(c) == 4:
        finish = c.get("finish_reason", 0)
        finish = "null" if finish is None else json_str(finish) if isinstance(finish, str) else None
        text = c.get("text")
        if finish is not None and isinstance(text, str):
            return f'{{"index": {c["index"]:d}, "text": {json_str(text)}, "logprobs": null, "finish_reason": {finish}}}'
        delta = c.get("delta")
        if finish is not None and type(delta) is dict and (not delta or (len(delta) == 1 and
                                                                         isinstance(delta.get("content"), str))):
            inner = f'{{"content": {json_str(delta["content"])}}}' if delta else "{}"
            return f'{{"index": {c["index"]:d}, "delta": {inner}, "logprobs": null, "finish_reason": {finish}}}'
    return json.dumps(c)
