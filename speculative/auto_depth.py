"""`--mtp-k-ladder auto`: an online controller that picks the draft depth per width band.

For each width band (1, 2, 4, ... sequences) it keeps a moving average of committed tokens per
second for every depth it has tried (depth 0 is plain decoding, so speculation that does not pay
is switched off). It serves the band's current depth, probes a neighbouring or untried depth
every `probe_every` steps of that band, and switches only when another depth beats the current
one by more than `hysteresis`. Starts from the static ladder's choice.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from speculative.ladder import mtp_ladder_drafts
from speculative.metrics import width_bucket as width_band


@dataclass(slots=True)
class _Band:
    current: int
    rate: dict[int, float] = field(default_factory=dict)     # depth -> EMA of tokens/s
    samples: dict[int, int] = field(default_factory=dict)
    steps: int = 0


class AutoDepthController:
    def __init__(self, max_depth: int, *, probe_every: int = 16, hysteresis: float = 0.05,
                 min_samples: int = 3, smoothing: float = 0.25) -> None:
        if max_depth < 0:
            raise ValueError(f"max_depth={max_depth} must be non-negative")
        self.max_depth = max_depth
        self.probe_every, self.hysteresis = probe_every, hysteresis
        self.min_samples, self.smoothing = min_samples, smoothing
        self.bands: dict[int, _Band] = {}

    def _band(self, n_active: int) -> _Band:
        key = width_band(n_active)
        if key not in self.bands:
            self.bands[key] = _Band(current=mtp_ladder_drafts(n_active, self.max_depth))
        return self.bands[key]

    def depth_for(self, n_active: int) -> int:
        """The depth to run this step at width `n_active` (a probe now and then)."""
        band = self._band(n_active)
        band.steps += 1
        if band.steps % self.probe_every:
            return band.current
        candidates = [d for d in range(self.max_depth + 1) if band.samples.get(d, 0) < self.min_samples]
        if not candidates:
            candidates = [d for d in (band.current - 1, band.current + 1) if 0 <= d <= self.max_depth]
        return min(candidates, key=lambda d: (band.samples.get(d, 0), abs(d - band.current)))

    def record(self, n_active: int, depth: int, seconds: float, tokens: int) -> None:
        """One decode step at `depth`: it took `seconds` and committed `tokens` in all."""
        if seconds <= 0:
            return
        band = self._band(n_active)
        rate = tokens / seconds
        old = band.rate.get(depth)
        band.rate[depth] = rate if old is None else (1 - self.smoothing) * old + self.smoothing * rate
        band.samples[depth] = band.samples.get(depth, 0) + 1
        ready = {d: r for d, r in band.rate.items() if band.samples[d] >= self.min_samples}
        if band.current in ready and ready:
            best = max(ready, key=ready.get)
            if ready[best] > ready[band.current] * (1 + self.hysteresis):
                band.current = best

    def summary(self) -> dict[int, dict]:
        return {w: {"depth": b.current, "rates": {d: round(r, 1) for d, r in sorted(b.rate.items())}}
                for w, b in sorted(self.bands.items())}
