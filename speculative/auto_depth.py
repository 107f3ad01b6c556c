"""`--mtp-k-ladder auto`: an online controller that picks the draft depth per width band.

It measures two things apart, because their product is what a step earns and each alone is far
less noisy than tokens per step:
- the drafter's acceptance at each draft position i, pooled over every verify: a_i, the share
  of chains that reached draft i and had it accepted;
- per width band (1, 2, 4, ... sequences), the cost of a pure decode step at each depth it has
  run, depth 0 being plain decoding, on a relative scale: a step at another depth than the band's
  current one (a probe) is divided by the current depth's last few steps, which ran just before it.
  A probe is a short run of steps at its depth, and only a run's later steps are measured (the
  current depth's too, after a probe): the first steps after a change of depth run slower on caches
  the other depth filled, and would make every depth but the current one look dear.
  The host's speed drifts within minutes on a shared CPU, and a ratio of neighbouring steps
  cancels that drift where costs measured minutes apart would not. Each depth keeps the median of
  its last few ratios, so one outlier (a first step that compiles a shape) does not stick.
The expected committed tokens per sequence at depth d are 1 + sum_{i<=d} prod_{j<=i} a_j, and the
depth served is the one with the most expected tokens per unit of step cost. Depths with fewer than
`min_samples` ratios are probed (a run of `probe_run` steps each) every `probe_every / 4` steps of
the band (at least `probe_run + settle + 2`), then the known ones are re-probed in turn so their
ratios stay current, every `probe_every` steps at first and half as often after each round of probes that changes nothing (down to one in
`probe_every * 2**max_doublings`: a probe at a worse depth costs that step its difference); the
band switches only when another depth beats its current one by more than `hysteresis`, and then
probes at the shortest interval again. Only the current depth's neighbours are probed, and on each side
the next depth past one within the hysteresis of the current (`_eligible`): a hill climb, since a
depth's rate has one peak. A band starts from the static ladder, or from the depth of the nearest
narrower band that has measured every depth it probes when that is lower.
"""
from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from speculative.metrics import width_bucket as width_band

__all__ = ["AutoDepthController", "width_band"]


RECENT_STEPS = 5   # the current depth's steps a probe is divided by (their median)
RATIOS_KEPT = 5    # a depth's latest ratios, whose median is its relative cost


def _median(values) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else 0.5 * (ordered[mid - 1] + ordered[mid])


@dataclass(slots=True)
class _Band:
    current: int
    recent: deque = field(default_factory=lambda: deque(maxlen=RECENT_STEPS))   # log s of the current depth's steps
    levels: dict[int, deque] = field(default_factory=dict)   # depth -> its latest log costs on the band's scale
    steps: int = 0
    probes: int = 0
    quiet: int = 0   # probes since the band last switched depth
    probe_depth: int = 0
    probe_left: int = 0    # steps left of the probe run under way
    run_depth: int = -1    # the depth of the latest measured steps in a row, and how many
    run_len: int = 0
    ratios: int = 0        # probe ratios recorded so far (a change of what `eligible` sees)
    eligible_key: tuple = ()
    eligible: list = field(default_factory=list)

    def level(self, depth: int) -> float | None:
        """The depth's log cost on the band's scale (the median of its latest), None when unmeasured."""
        kept = self.levels.get(depth)
        return _median(kept) if kept else None

    @property
    def cost(self) -> dict[int, float]:
        """Seconds a step at each measured depth costs at the host's current speed (the current
        depth's recent steps times each depth's ratio to it)."""
        anchor = self.level(self.current)
        if anchor is None or not self.recent:
            return {}
        now = _median(self.recent)
        return {d: math.exp(now + self.level(d) - anchor) for d in self.levels if self.levels[d]}


class AutoDepthController:
    def __init__(self, max_depth: int, *, start_depth: Callable[[int], int] | None = None, probe_every: int = 16,
                 hysteresis: float = 0.05, min_samples: int = 3, max_doublings: int = 3, probe_run: int = 3,
                 settle: int = 2) -> None:
        """`start_depth(n_active)`: a new band's first depth (the static ladder's; max_depth when None).
        `probe_run`: steps of one probe; `settle`: the first steps of each run of one depth that are
        not measured (a step right after a change of depth runs on caches the other depth filled,
        so single-step probes made no speculation look dearer than it is and kept a losing depth;
        the figures are in docs/design.md §5.3)."""
        if max_depth < 0:
            raise ValueError(f"max_depth={max_depth} must be non-negative")
        if not 0 <= settle < probe_run:
            raise ValueError(f"settle={settle} must leave a measured step of a {probe_run}-step probe")
        self.max_depth = max_depth
        self.start_depth = start_depth or (lambda n_active: max_depth)
        self.probe_every, self.hysteresis, self.min_samples = probe_every, hysteresis, min_samples
        self.max_doublings = max_doublings
        self.probe_run, self.settle = probe_run, settle
        # Probes start at least this far apart, so the current depth settles between them.
        self.min_interval = probe_run + settle + 2
        self.bands: dict[int, _Band] = {}
        self.reached = [0] * max_depth     # chains that drafted position i (0-based) with 0..i-1 accepted
        self.accepted = [0] * max_depth    # ... and had draft i accepted

    def _band(self, n_active: int) -> _Band:
        key = width_band(n_active)
        if key not in self.bands:
            self.bands[key] = _Band(current=self._start(key, n_active))
        return self.bands[key]

    def _start(self, key: int, n_active: int) -> int:
        """A new band's first depth: the static ladder's, or less where the nearest narrower band
        has measured every depth and chose less (a wider step's verify costs more, so speculation
        pays no more there). A band that starts where the others learned need not gather, between
        prefills, the samples to leave a depth that a narrower band already found losing
        (docs/design.md §5.3)."""
        start = self.start_depth(n_active)
        settled = [w for w, b in self.bands.items() if w < key and b.recent and all(
            len(b.levels.get(d, ())) >= self.min_samples for d in self._eligible(b))]
        return min(start, self.bands[max(settled)].current) if settled else start

    # --- measurements ---------------------------------------------------------------------
    def observe_verify(self, num_drafts: int, num_accepted: int) -> None:
        """One sequence's verify: `num_accepted` of its `num_drafts` drafts were accepted."""
        for i in range(min(num_accepted + 1, num_drafts, self.max_depth)):
            self.reached[i] += 1
            self.accepted[i] += i < num_accepted

    def break_run(self, n_active: int) -> None:
        """A step that was not a pure decode (a prefill in it) ran at width `n_active`: the next
        decode steps start a new run, so their first `settle` are not measured either."""
        self._band(n_active).run_depth = -1

    def record(self, n_active: int, depth: int, seconds: float) -> None:
        """One pure decode step at width `n_active` and `depth` took `seconds`."""
        if seconds <= 0:
            return
        band = self._band(n_active)
        if depth == band.run_depth:
            band.run_len += 1
        else:
            band.run_depth, band.run_len = depth, 1
        if band.run_len <= self.settle:   # still on the other depth's caches: not this depth's cost
            return
        x = math.log(seconds)
        if depth == band.current:
            band.recent.append(x)
            if not band.levels.get(depth):
                band.levels[depth] = deque([0.0], maxlen=RATIOS_KEPT)   # the first current depth sets the scale
        elif band.recent:   # a probe, paired with the current depth's steps just before it
            kept = band.levels.setdefault(depth, deque(maxlen=RATIOS_KEPT))
            kept.append(x - _median(band.recent) + band.level(band.current))
            band.ratios += 1
        else:               # nothing to pair with yet (the band just started or switched)
            return
        rates = {d: math.log(self.expected_tokens(d)) - band.level(d) for d, kept in band.levels.items()
                 if d == band.current or len(kept) >= self.min_samples}
        best = max(rates, key=rates.get)
        if rates[best] > rates[band.current] + math.log1p(self.hysteresis):
            band.current = best
            band.recent.clear()   # the new current depth's own steps pair the next probes
            band.quiet = 0        # and probing starts again at its shortest interval

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

    def _rate(self, band: _Band, depth: int) -> float | None:
        """log(expected tokens per unit of cost) of `depth` in `band`, None when unmeasured."""
        level = band.level(depth)
        return None if level is None else math.log(self.expected_tokens(depth)) - level

    def _eligible(self, band: _Band) -> list[int]:
        """The depths the band measures beside its current one: each neighbour, and on each side
        the next one past a measured depth whose rate is within the hysteresis of the current's
        (a plateau is walked along). Past a clearly worse neighbour nothing further is probed: a
        depth's rate rises to one peak and falls (its expected tokens grow by ever smaller steps,
        its cost by about a verify row's), and a probe of a far, costly depth costs its steps the
        difference (docs/design.md §5.3 has the record). Recomputed when the current depth or a
        ratio changes."""
        key = (band.current, band.ratios, len(band.recent) > 0)
        if band.eligible_key == key:
            return band.eligible
        current = self._rate(band, band.current)
        out = []
        for step in (-1, 1):
            d = band.current + step
            while 0 <= d <= self.max_depth:
                out.append(d)
                rate = self._rate(band, d) if len(band.levels.get(d, ())) >= self.min_samples else None
                if current is None or rate is None or rate < current - math.log1p(self.hysteresis):
                    break
                d += step
        band.eligible_key, band.eligible = key, out
        return out

    def depth_for(self, n_active: int) -> int:
        """The depth to run this step at width `n_active` (a probe now and then)."""
        band = self._band(n_active)
        band.steps += 1
        if band.probe_left > 0:       # a probe runs `probe_run` steps in a row
            band.probe_left -= 1
            return band.probe_depth
        eligible = self._eligible(band)
        unknown = [d for d in eligible if len(band.levels.get(d, ())) < self.min_samples]
        # While some depth is unmeasured, probe four times as often: a band can be short-lived. A
        # probe needs steps of the current depth to pair with, so none comes before them.
        if not band.recent or (unknown and band.steps % max(self.min_interval, self.probe_every // 4)):
            return band.current
        if unknown:
            band.probes += 1
            return self._probe(band, min(unknown, key=lambda d: (len(band.levels.get(d, ())), abs(d - band.current))))
        others = eligible
        if not others:
            return band.current
        # Each round of probes that leaves the current depth in place doubles the interval (up to
        # `max_doublings` times), so a settled band spends few of its steps probing (docs/design.md §5.3).
        interval = max(self.min_interval, self.probe_every << min(band.quiet // len(others), self.max_doublings))
        if band.steps % interval:
            return band.current
        band.probes += 1
        band.quiet += 1
        return self._probe(band, others[band.probes % len(others)])

    def _probe(self, band: _Band, depth: int) -> int:
        band.probe_depth, band.probe_left = depth, self.probe_run - 1
        return depth

    def summary(self) -> dict:
        return {"acceptance": [round(a, 3) for a in self.acceptance()],
                "bands": {w: {"depth": b.current, "cost_ms": {d: round(1000 * c, 2) for d, c in sorted(b.cost.items())}}
                          for w, b in sorted(self.bands.items())}}
