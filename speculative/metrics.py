"""Acceptance metrics (docs/design.md §5.8): per width bucket and per draft position."""
from __future__ import annotations

from dataclasses import dataclass, field

MAX_POSITIONS = 8


def width_bucket(width: int) -> int:
    """Buckets 1, 2, 4, 8, ...: the smallest power of two at least `width`."""
    b = 1
    while b < width:
        b *= 2
    return b


@dataclass(slots=True)
class BucketStats:
    verifies: int = 0
    first_accepted: int = 0
    accepted: int = 0

    def as_dict(self) -> dict:
        v = max(self.verifies, 1)
        return {"verifies": self.verifies, "p1": self.first_accepted / v, "mean_na": self.accepted / v,
                "tokens_per_step": 1 + self.accepted / v}


@dataclass(slots=True)
class AcceptanceMetrics:
    buckets: dict[int, BucketStats] = field(default_factory=dict)
    drafted_at: list[int] = field(default_factory=lambda: [0] * MAX_POSITIONS)
    matched_at: list[int] = field(default_factory=lambda: [0] * MAX_POSITIONS)
    # vLLM's meaning of "accepted at position i": the verifies whose first i+1 drafts were all
    # accepted (so the positions sum to accepted_tokens); matched_at counts a draft equal to the
    # target's token whatever came before it
    accepted_at: list[int] = field(default_factory=lambda: [0] * MAX_POSITIONS)
    verifies: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    hedges_taken: int = 0        # tree verifies whose accepted path ended in a hedge

    def record(self, width: int, drafts: list[int], targets: list[int], num_accepted: int) -> None:
        """One verify of one sequence: its drafts, the target's token at each row, and na."""
        b = self.buckets.setdefault(width_bucket(width), BucketStats())
        b.verifies += 1
        b.first_accepted += int(num_accepted >= 1)
        b.accepted += num_accepted
        self.verifies += 1
        self.drafted_tokens += len(drafts)
        self.accepted_tokens += num_accepted
        for i, (d, t) in enumerate(zip(drafts[:MAX_POSITIONS], targets)):
            self.drafted_at[i] += 1
            self.matched_at[i] += int(d == t)
            self.accepted_at[i] += int(num_accepted > i)

    def positional(self, i: int) -> float | None:
        """p_{i+1}: among verifies that drafted position i+1, the share where it equals the target's token."""
        return self.matched_at[i] / self.drafted_at[i] if self.drafted_at[i] else None

    def summary(self) -> dict:
        return {"verifies": self.verifies, "drafted_tokens": self.drafted_tokens,
                "accepted_tokens": self.accepted_tokens, "hedges_taken": self.hedges_taken,
                "accept_len": 1 + self.accepted_tokens / self.verifies if self.verifies else None,
                "p1": self.positional(0), "p2_uncond": self.positional(1), "p3_uncond": self.positional(2),
                "buckets": {w: b.as_dict() for w, b in sorted(self.buckets.items())}}
