"""`--mtp-k-ladder auto`: an online controller that picks the draft depth per width band.

It measures two things apart, because their product is what a step earns and each alone is far
less noisy than tokens per step:
- the drafter's acceptance at each draft position i, pooled over every verify: a_i, the share
  of chains that reached draft i and had it accepted;
- per width band (1, 2, 4, ... sequences), the cost in seconds of a pure decode step at each
  depth it has run, depth 0 being plain decoding.
The expected committed tokens per sequence at depth d are 1 + sum_{i<=d} prod_{j<=i} a_j, and the
depth served is the one with the most expected tokens per second of step. Depths with fewer than
`min_samples` cost samples are probed (one step each) every `probe_every / 4` steps of the band,
then every `probe_every` steps the known ones are re-probed in turn so their costs stay current; the band switches only when
another depth beats its current one by more than `hysteresis`. Starts from the static ladder.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from speculative.metrics import width_bucket as width_band

__all__ = ["AutoDepthController", "width_band"]


@dataclass(slots=True)
class _Band:
    current: int
    cost: dict[int, float] = field(default_factory=dict)     # depth -> EMA of seconds per step
    samples: dict[int, int] = field(default_factory=dict)
    steps: int = 0
    probes: int = 0


class AutoDepthController:
    def __init__(self, max_depth: int, *, start_depth: Callable[[int], int] | None = None, probe_every: int = 16,
                 hysteresis: float = 0.05, min_samples: int = 3, smoothing: float = 0.1) -> None:
        """`start_depth(n_active)`: a new band's first depth (the static ladder's; max_depth when None)."""
        if max_depth < 0:
            raise ValueError(f"max_depth={max_depth} must be non-negative")
        self.max_depth = max_depth
        self.start_depth = start_depth or (lambda n_active: max_depth)
        self.probe_every, self.hysteresis = probe_every, hysteresis
        self.min_samples, self.smoothing = min_samples, smoothing
        self.bands: dict[int, _Band] = {}
        self.reached = [0] * max_depth     # chains that drafted position i (0-based) with 0..i-1 accepted
        self.accepted = [0] * max_depth    # ... and had draft i accepted

    def _band(self, n_active: int) -> _Band:
        key = width_band(n_active)
        if key not in self.bands:
            self.bands[key] = _Band(current=self.start_depth(n_active))
        return self.bands[key]

    # --- measurements ---------------------------------------------------------------------
    def observe_verify(self, num_drafts: int, num_accepted: int) -> None:
        """One sequence's verify: `num_accepted` of its `num_drafts` drafts were accepted."""
        for i in range(min(num_accepted + 1, num_drafts, self.max_depth)):
            self.reached[i] += 1
            self.accepted[i] += i < num_accepted

    def record(self, n_active: int, depth: int, seconds: float) -> None:
        """One pure decode step at width `n_active` and `depth` took `seconds`."""
        if seconds <= 0:
            return
        band = self._band(n_active)
        old = band.cost.get(depth)
        band.cost[depth] = seconds if old is None else (1 - self.smoothing) * old + self.smoothing * seconds
        band.samples[depth] = band.samples.get(depth, 0) + 1
        rates = {d: self.expected_tokens(d) / c for d, c in band.cost.items() if band.samples[d] >= self.min_samples}
        if band.current in rates:
            best = max(rates, key=rates.get)
            if rates[best] > rates[band.current] * (1 + self.hysteresis):
                band.current = best

    # --- decisions ------------------------------------------------------------------------
    def acceptance(self) -> list[float]:
        """a_i per draft position, with one accepted and one rejected chain as a prior."""
        return [(a + 1) / (r + 2) for a, r in zip(self.accepted, self.reached)]

    def expected_tokens(self, depth: int) -> float:
        """Expected committed tokens per sequence for a step at `depth`: the bonus plus the
        chance of reaching and keeping each draft."""
        total, chain = 1.0, 1.0
        for a in self.acceptance()[:depth]:
            chain *= a
            total += chain
        return total

    def depth_for(self, n_active: int) -> int:
        """The depth to run this step at width `n_active` (a probe now and then)."""
        band = self._band(n_active)
        band.steps += 1
        unknown = [d for d in range(self.max_depth + 1) if band.samples.get(d, 0) < self.min_samples]
        # While some depth is unmeasured, probe four times as often: a band can be short-lived.
        if band.steps % (max(1, self.probe_every // 4) if unknown else self.probe_every):
            return band.current
        band.probes += 1
        if unknown:
            return min(unknown, key=lambda d: (band.samples.get(d, 0), abs(d - band.current)))
        others = [d for d in range(self.max_depth + 1) if d != band.current]
        return others[band.probes % len(others)] if others else band.current

    def summary(self) -> dict:
        return {"acceptance": [round(a, 3) for a in self.acceptance()],
                "bands": {w: {"depth": b.current, "cost_ms": {d: round(1000 * c, 2) for d, c in sorted(b.cost.items())}}
                          for w, b in sorted(self.bands.items())}}
