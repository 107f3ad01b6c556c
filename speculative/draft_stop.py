"""Per-position confidence stop for MTP draft chains (`--draft-confidence-stop TAU`, docs/design.md §5.4).

The drafter keeps extending a chain only while its last draft's top-1 probability is at least
TAU. The one rule, used by the drafter and by the scheduler's depth planner alike, is
`chain_depth`.
"""
from __future__ import annotations

from collections.abc import Sequence

_published: float | None = None


def chain_depth(logprobs: Sequence[float], ln_tau: float) -> int:
    """Index of the first log-prob below `ln_tau`, plus one (the low-confidence draft itself is
    kept), or the chain length when none is below. Exactly `ln_tau` continues; NaN never stops."""
    for i, lp in enumerate(logprobs):
        if lp < ln_tau:
            return i + 1
    return len(logprobs)


def set_draft_confidence_stop(tau: float) -> None:
    """Publish TAU once (strictly inside (0, 1)); a different value later is refused."""
    global _published
    if not (isinstance(tau, (int, float)) and 0.0 < tau < 1.0):
        raise ValueError(f"--draft-confidence-stop {tau!r} must be strictly between 0 and 1")
    if _published is not None and _published != tau:
        raise ValueError(f"the draft confidence stop was already published as {_published}; refusing {tau}")
    _published = float(tau)


def draft_confidence_stop() -> float | None:
    return _published
