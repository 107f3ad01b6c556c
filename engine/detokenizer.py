"""Incremental detokenization: one per sequence, shared by stop strings and streaming.

Each update decodes a short window of tokens, never the whole output, so its cost does not grow
with the output's length. The window starts a few tokens before the first undecoded one
(`prefix_offset`, the previous window's new tokens), because a tokenizer may render a token
differently with context before it (a leading space, a byte-level merge); the new text is what the window decodes to beyond what its
prefix alone decodes to. A window that ends inside a multi-byte character (the replacement
character U+FFFD at the end) waits for the next token. Stop strings are searched only in the
tail the new text can complete; `text` is cut where the first stop string begins. While the output
is shorter than `min_tokens` no stop string counts, and afterwards only one that ends past the text
of those first tokens (as EOS is held back by the sampler): tokens are added in two parts where a
batch of them crosses min_tokens, so speculation's multi-token commits stop where one-by-one would.
"""
from __future__ import annotations

from collections.abc import Sequence

from engine.tokenizer import Tokenizer

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, stops: Sequence[str] = (), min_tokens: int = 0) -> None:
        self.tokenizer = tokenizer
        self.stops = tuple(s for s in stops if s)
        self.max_stop = max((len(s) for s in self.stops), default=0)
        self.min_tokens = min_tokens
        self.stop_floor: int | None = 0 if min_tokens == 0 else None   # a stop must end past this character
        # The output alone, as one decode of the whole output reads it (a character split across
        # the prompt's end and the output's start decodes as U+FFFD there too).
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.text = ""
        self.stopped = False

    def append(self, new_ids: Sequence[int]) -> str:
        """Add committed output tokens; returns the text they completed (cut at a stop string,
        after which nothing more is added)."""
        if self.stopped or not new_ids:
            return ""
        held = self.min_tokens - len(self.ids)
        if 0 < held < len(new_ids):
            return self.append(new_ids[:held]) + self.append(new_ids[held:])
        out = self._append(new_ids)
        if self.stop_floor is None and len(self.ids) >= self.min_tokens:
            self.stop_floor = len(self.text)
        return out

    def _append(self, new_ids: Sequence[int]) -> str:
        self.ids.extend(new_ids)
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset:self.read_offset])
        window = self.tokenizer.decode(self.ids[self.prefix_offset:])
        if len(window) <= len(prefix):
            return ""   # nothing new yet
        delta = window[len(prefix):]
        if window.endswith(REPLACEMENT) and self._first_stop(self.text + delta) is None:
            return ""   # a character still missing its last bytes (a stop string already there ends it)
        return self._add(delta)

    def finish(self) -> str:
        """The sequence ended: add what is still held back (an unfinished character decodes as
        U+FFFD, as a decode of the whole output would give)."""
        if self.stopped or self.read_offset == len(self.ids):
            return ""
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset:self.read_offset])
        window = self.tokenizer.decode(self.ids[self.prefix_offset:])
        return self._add(window[len(prefix):]) if len(window) > len(prefix) else ""

    def _add(self, delta: str) -> str:
        self.prefix_offset = self.read_offset   # a character boundary: the last window ended cleanly there
        self.read_offset = len(self.ids)
        old = len(self.text)
        cut = self._first_stop(self.text + delta)
        self.text += delta
        if cut is not None:
            self.text = self.text[:cut]
            self.stopped = True
        return self.text[old:]

    def _first_stop(self, text: str) -> int | None:
        """Where the earliest stop string begins in `text` (the current text plus new text),
        searching only from where a stop string could straddle the current text's end, and only
        for one that ends past the text of the first min_tokens tokens."""
        if not self.stops or self.stop_floor is None:
            return None
        tail_from = max(0, len(self.text) - self.max_stop + 1)
        hits = [i for i in (text.find(s, max(tail_from, self.stop_floor - len(s) + 1)) for s in self.stops)
                if i >= 0]
        return min(hits) if hits else None
