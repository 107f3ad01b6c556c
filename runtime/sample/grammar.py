"""Structured outputs: a grammar (JSON schema, any JSON object, regex, choice list) compiled by
llguidance, and one matcher per sequence that gives the tokens allowed next (docs/design.md §5.2).

A matcher's state is the sequence's committed output. A row's mask is the state after the tokens
on its path (nothing for a plain row, the drafts before it for a verify row): the matcher consumes
the path, computes the mask and rolls the path back, so after a verify only the committed tokens
advance it, as the KV cache keeps only theirs. A path the grammar refuses part-way gives no mask:
its row is unreachable, because the row of the refused token drew from a mask without it.

Engine choice (measured on models/tiny-glm-moe's 4096-token byte-level BPE, one CPU thread):
llguidance and xgrammar both compile a small schema, regex or choice list in 0.1-1.6 ms and
compute a mask in about 2-30 us mean (under 1.5 ms at worst); llguidance is taken because it
needs no other package (xgrammar pulls transformers, triton and a tvm runtime) and reads
tokenizer.json directly.

Shapes: V vocab (the model's), W = ceil(V / 32) mask words.
"""
from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

KINDS = ("json_schema", "json_object", "regex", "choice", "lark")
# Python's json.dumps spacing and no other whitespace: a model cannot pad the output forever.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    """What the output must match: `kind` is one of KINDS; `spec` the JSON schema as JSON text,
    the regex, the choices as a JSON list (empty for json_object), or an llguidance Lark grammar
    (lark: what the server builds for tool calls and reasoning budgets)."""
    kind: str
    spec: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"structured output kind {self.kind!r} is not one of {', '.join(KINDS)}")

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | str) -> StructuredOutput:
        return cls("json_schema", schema if isinstance(schema, str) else json.dumps(schema, sort_keys=True))

    @classmethod
    def regex(cls, pattern: str) -> StructuredOutput:
        return cls("regex", pattern)

    @classmethod
    def choice(cls, choices: Sequence[str]) -> StructuredOutput:
        if not choices or not all(isinstance(c, str) and c for c in choices):
            raise ValueError(f"choice needs a non-empty list of non-empty strings, got {choices!r}")
        return cls("choice", json.dumps(list(choices)))

    @property
    def counts_tokens(self) -> bool:
        """A grammar with a token limit on a rule: llguidance cannot roll its matcher back, so a
        row's path is consumed by a copy of the matcher instead."""
        return self.kind == "lark" and "max_tokens=" in self.spec

    def grammar(self) -> str:
        """The llguidance grammar text."""
        from llguidance import LLMatcher
        if self.kind == "json_schema":
            return LLMatcher.grammar_from_json_schema(self.spec, defaults=JSON_OPTIONS)
        if self.kind == "json_object":
            return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
        if self.kind == "regex":
            return LLMatcher.grammar_from_regex(self.spec)
        if self.kind == "lark":
            return LLMatcher.grammar_from_lark(self.spec)
        return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in json.loads(self.spec)))


@dataclass(slots=True)
class GrammarStats:
    """Time spent on masks (consume the path, compute, unpack, roll back) and on committing."""
    num_masks: int = 0
    mask_s: float = 0.0
    num_commits: int = 0
    commit_s: float = 0.0


class GrammarCompiler:
    """One per engine: the tokenizer's token table for llguidance (built on first use) and the
    time its matchers spend."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_ids: Sequence[int],
                 device: torch.device | str) -> None:
        """Masks are built on `device` (the logits' device)."""
        self.device = torch.device(device)
        self.tokenizer_json = tokenizer_json
        self.vocab_size = vocab_size
        self.eos_ids = list(eos_ids)
        self.stats = GrammarStats()
        self._tokenizer = None

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from llguidance import LLTokenizer
            self._tokenizer = LLTokenizer(self.tokenizer_json, n_vocab=self.vocab_size, eos_token=self.eos_ids)
        return self._tokenizer

    def check(self, structured: StructuredOutput) -> None:
        """Raise ValueError with llguidance's message when the grammar does not compile."""
        from llguidance import LLMatcher
        try:
            grammar = structured.grammar()
        except ValueError as exc:
            raise ValueError(f"invalid {structured.kind}: {exc}") from None
        error = LLMatcher.validate_grammar(grammar, self.tokenizer)
        if error:
            raise ValueError(f"invalid {structured.kind}: {error.strip().splitlines()[0]}")

    def matcher(self, structured: StructuredOutput) -> GrammarMatcher:
        from llguidance import LLMatcher
        m = LLMatcher(self.tokenizer, structured.grammar(), log_level=0)
        if m.is_error():
            raise ValueError(f"invalid {structured.kind}: {m.get_error().strip().splitlines()[0]}")
        return GrammarMatcher(m, self.vocab_size, self.stats, self.device, copy_paths=structured.counts_tokens)


class GrammarMatcher:
    """One sequence's grammar state: its committed output consumed."""

    def __init__(self, matcher, vocab_size: int, stats: GrammarStats, device: torch.device | str,
                 copy_paths: bool = False) -> None:
        """`copy_paths`: consume a path on a copy of the matcher (grammars that cannot roll back)."""
        self._m = matcher
        self.copy_paths = copy_paths
        self.vocab_size = vocab_size
        self.stats = stats
        device = torch.device(device)
        # llguidance writes the bitmask through a host pointer: a CPU buffer (pinned when the
        # mask goes on to a GPU), copied to `device` and unpacked there.
        self._words = torch.empty((vocab_size + 31) // 32, dtype=torch.int32, device="cpu",
                                  pin_memory=device.type == "cuda")                     # [W]
        self._bits = torch.arange(32, dtype=torch.int32, device=device)
        self.device = device

    def allowed_after(self, path: Sequence[int] = ()) -> torch.Tensor | None:
        """bool [V]: the tokens allowed after the committed output and `path`; None when the
        grammar refuses a token of `path` (the row cannot be reached)."""
        t0 = time.perf_counter()
        m = self._m.deep_copy() if path and self.copy_paths else self._m
        n = m.try_consume_tokens(list(path)) if path else 0
        allowed = None
        if n == len(path):
            m.unsafe_compute_mask_ptr(self._words.data_ptr(), self._words.numel() * 4)
            words = self._words.to(self.device, copy=True, non_blocking=True)  # the next mask reuses the buffer
            allowed = ((words.unsqueeze(-1) >> self._bits) & 1).flatten()[:self.vocab_size].bool()
        if n and m is self._m:
            m.rollback(n)
        self.stats.num_masks += 1
        self.stats.mask_s += time.perf_counter() - t0
        return allowed

    def num_allowed(self, tokens: Sequence[int]) -> int:
        """How many leading `tokens` the grammar accepts one after another after the committed
        output; the state is left where it was."""
        m = self._m.deep_copy() if tokens and self.copy_paths else self._m
        n = m.try_consume_tokens(list(tokens)) if tokens else 0
        if n and m is self._m:
            m.rollback(n)
        return n

    def commit(self, token: int) -> bool:
        """Advance by a committed token; True when the grammar is complete (only EOS could follow)."""
        t0 = time.perf_counter()
        if not self._m.consume_token(token):
            raise RuntimeError(f"the grammar refused committed token {token}: {self._m.get_error()}")
        self.stats.num_commits += 1
        self.stats.commit_s += time.perf_counter() - t0
        return self._m.is_stopped()
