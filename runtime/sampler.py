"""Sampling: greedy, temperature, top-k, top-p, with draws keyed by (request seed, absolute position).

The generator for the token at absolute position p of a request with seed s is seeded from
(s, p) alone, so a request's tokens never depend on what else is in the batch, on batch width,
or on whether speculation verified them (docs/design.md §5.2).

Shapes: N rows, V vocab.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

_MASK64 = (1 << 64) - 1


@dataclass(frozen=True, kw_only=True, slots=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 16
    seed: int | None = None
    ignore_eos: bool = False
    stop: str | list[str] | tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens!r} must be an integer of at least 1")
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature={self.temperature!r} must be non-negative")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p={self.top_p!r} must be in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k={self.top_k!r} must be a non-negative integer (0 = off)")
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            raise ValueError(f"seed={self.seed!r} must be a non-negative integer")
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif self.stop is not None:
            object.__setattr__(self, "stop", tuple(self.stop))
        if self.stop and any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop={self.stop!r} must hold non-empty strings")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0


def splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def position_generator(seed: int, position: int) -> torch.Generator:
    """The generator for the token at absolute `position` of a request seeded `seed`."""
    key = splitmix64(splitmix64(seed) ^ position) & ((1 << 63) - 1)
    return torch.Generator().manual_seed(key)


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """One row's logits [V] -> the distribution the request samples from [V] (float64).

    Temperature, then top-k, then top-p (the smallest set of highest-probability tokens whose mass
    reaches top_p). Greedy requests get a one-hot at the arg-max.
    """
    logits = logits.to(torch.float64)
    if params.is_greedy:
        out = torch.zeros_like(logits)
        out[int(torch.argmax(logits))] = 1.0
        return out
    logits = logits / params.temperature
    if 0 < params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        before = torch.cumsum(sorted_p, dim=-1) - sorted_p  # mass strictly above each token
        drop = before >= params.top_p
        probs = probs.scatter(-1, order, sorted_p.masked_fill(drop, 0.0))
        probs = probs / probs.sum()
    return probs


def draw(probs: torch.Tensor, seed: int, position: int) -> int:
    """Sample one token from `probs` [V] with the (seed, position) generator (exponential race)."""
    u = torch.rand(probs.shape[-1], generator=position_generator(seed, position), dtype=torch.float64)
    race = probs / -torch.log1p(-u)  # argmax of p_i / E_i, E_i ~ Exp(1): a draw from probs
    return int(torch.argmax(race))


def sample_token(logits: torch.Tensor, params: SamplingParams, seed: int, position: int) -> int:
    """The token a request emits at `position` given that position's logits [V]."""
    if params.is_greedy:
        return int(torch.argmax(logits))
    return draw(target_probs(logits, params), seed, position)


def sample_rows(logits: torch.Tensor, params: list[SamplingParams], seeds: list[int],
                positions: list[int]) -> list[int]:
    """logits [N, V] -> one token per row; greedy rows share one arg-max."""
    greedy = torch.argmax(logits, dim=-1).tolist()
    return [g if p.is_greedy else sample_token(logits[i], p, s, pos)
            for i, (g, p, s, pos) in enumerate(zip(greedy, params, seeds, positions))]
