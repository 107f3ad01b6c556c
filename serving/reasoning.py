"""Reasoning content: a thinking model's `<think>...</think>` block split from its answer.

Parsers (`--reasoning-parser`, by default the model family's, `DEFAULT_PARSERS`): glm45 (GLM-4.5
to 5), qwen3 (Qwen3 / 3.5) and deepseek_r1 (DeepSeek-R1, V3.1+) all write the block between
`<think>` and `</think>`; they differ in where it opens, which the rendered prompt tells: a prompt
whose last think tag is an open `<think>` (DeepSeek-R1's and V3.1's thinking prompts, Qwen3
thinking-2507's) starts the output inside the block, otherwise the block is reasoning only when
the output opens it. `none` leaves the text whole. Text before `</think>` that never closes stays
reasoning (a budget or max_tokens cut it); the tags themselves are dropped.

`ReasoningStream` splits a growing text into reasoning and content deltas, holding back a tail
that may begin a tag until it cannot.
"""
from __future__ import annotations

from dataclasses import dataclass

from serving.tool_parsers import held_tail

DEFAULT_PARSERS = {"glm4_moe": "glm45", "glm4_moe_lite": "glm45", "qwen3_moe": "qwen3",
                   "deepseek_v3": "deepseek_r1"}
PARSER_NAMES = ("glm45", "qwen3", "deepseek_r1", "none")
THINK, END_THINK = "<think>", "</think>"


def check_parser(name: str) -> str:
    if name not in PARSER_NAMES:
        raise ValueError(f"reasoning parser {name!r} is not one of {', '.join(PARSER_NAMES)}")
    return name


def prompt_opens_think(prompt: str) -> bool:
    """Whether the prompt ends inside a think block (its last think tag is an open `<think>`)."""
    return prompt.rfind(THINK) > prompt.rfind(END_THINK)


def prompt_closes_think(prompt: str) -> bool:
    """Whether the prompt ends right after a closed think block (thinking switched off)."""
    return prompt.rstrip().endswith(END_THINK)


@dataclass(slots=True)
class Split:
    reasoning: str = ""
    content: str = ""


class ReasoningStream:
    """One choice's text -> reasoning and content. States: "start" (the output may open a block),
    "think" (inside it), "after" (right after it), "answer" (then, or no block)."""

    def __init__(self, inside: bool) -> None:
        self.state = "think" if inside else "start"
        self.buf = ""

    def feed(self, text: str) -> Split:
        self.buf += text
        return self._run(final=False)

    def finish(self) -> Split:
        return self._run(final=True)

    def _run(self, final: bool) -> Split:
        out = Split()
        while True:
            if self.state == "start":
                stripped = self.buf.lstrip()
                if stripped.startswith(THINK):
                    self.buf, self.state = stripped[len(THINK):], "think"
                    continue
                if not final and THINK.startswith(stripped):
                    return out                      # may still open the block
                self.state = "answer"
            if self.state == "after":                       # the newlines after </think> are dropped
                self.buf = self.buf.lstrip("\n")
                if not self.buf and not final:
                    return out
                self.state = "answer"
            if self.state == "answer":
                out.content += self.buf
                self.buf = ""
                return out
            j = self.buf.find(END_THINK)
            if j >= 0:
                out.reasoning += self.buf[:j]
                self.buf, self.state = self.buf[j + len(END_THINK):], "after"
                continue
            keep = 0 if final else held_tail(self.buf, (END_THINK,))
            out.reasoning += self.buf[:len(self.buf) - keep]
            self.buf = self.buf[len(self.buf) - keep:]
            return out


def split_reasoning(text: str, inside: bool) -> Split:
    s = ReasoningStream(inside)
    a, b = s.feed(text), s.finish()
    return Split(a.reasoning + b.reasoning, a.content + b.content)
