"""The depth policy: how deep each sequence drafts this step, and how many verify rows that takes.

One policy per engine, built from the resolved `SpecSettings`. Per step it answers, for every
decoding sequence, a `DraftPlan` of depth (drafts along the chain or the tree's spine) and rows
(the draft rows the verify forward holds: the depth for a chain, every node up to that depth for a
tree). The scheduler reserves cache and batch budget for the rows; the drafter drafts the depth.
Nothing speculates above the width cap; a sequence never drafts past what it may still commit
(max_tokens, the context). After drafting, the confidence stop's `chain_depth` cuts a chain where
the drafter stopped it (the same rule the drafter uses).
"""
from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

from speculative.auto_depth import AutoDepthController
from speculative.draft_stop import chain_depth
from speculative.settings import SpecSettings


@dataclass(frozen=True, slots=True)
class DraftPlan:
    depth: int      # drafts along the chain (the spine of a tree)
    num_rows: int   # draft rows in the verify forward (the root row not counted)


NO_DRAFTS = DraftPlan(0, 0)

log = logging.getLogger("metrale.spec")
REPEAT_NOTICE_S = 10.0   # a notice said less than this long ago is not said again (widths that oscillate)


class DepthPolicy:
    def __init__(self, spec: SpecSettings) -> None:
        self.spec = spec
        self.tree = spec.tree_shape
        self.auto = (AutoDepthController(spec.num_drafts, start_depth=spec.ladder_drafts)
                     if spec.depth_policy == "auto" and self.tree is None and spec.is_speculating else None)
        self.step_depth_taken: int | None = None   # the depth `plans` chose for the current step
        self._notice: str | int | None = None       # the depth change last told ("cap", a depth; None: as asked)
        self._said: dict[str | int | None, float] = {}   # change -> when it was last logged

    def step_depth(self, n_active: int) -> int:
        """The depth every sequence of this step drafts at most, for `n_active` running sequences:
        0 above the width cap; the tree's spine; the auto controller's pick (one per step); the
        fixed depth; or the ladder's count for this width."""
        spec = self.spec
        if not spec.is_speculating:
            return 0
        if n_active > spec.width_cap:
            self._tell(n_active, "cap")
            return 0
        if self.tree is not None:
            self._tell(n_active, None)
            return self.tree.spine_len
        if self.auto is not None:
            self._tell(n_active, None)
            return self.auto.depth_for(n_active)
        if spec.depth_policy == "fixed":
            self._tell(n_active, None)
            return spec.num_drafts
        depth = spec.ladder_drafts(n_active)
        self._tell(n_active, depth if depth < spec.num_drafts else None)
        return depth

    def _tell(self, n_active: int, change: str | int | None) -> None:
        """One log line when the depth this step departs from what was asked (`change`: "cap", or
        the ladder's depth), or returns to it, saying where the value that decided came from; the
        same line at most once per REPEAT_NOTICE_S."""
        if change == self._notice:    # the step's hot path: nothing changed
            return
        spec = self.spec
        if change is None:
            notice = f"speculation: {n_active} sequence(s) running, drafting {spec.num_drafts} per sequence again"
        elif change == "cap":
            notice = (f"speculation paused: {n_active} sequences running, above mtp_max_seqs {spec.width_cap} "
                      f"(from {spec.width_cap_origin}); plain decoding until at most {spec.width_cap} run")
        else:
            ladder = ",".join(f"{n}:{d}" for n, d in spec.ladder)
            notice = (f"speculation: {n_active} sequence(s) running, drafting {change} of the "
                      f"{spec.num_drafts} asked per sequence (mtp_k_ladder {ladder}, from {spec.ladder_origin})")
        self._notice = change
        now = time.monotonic()
        if now - self._said.get(change, -REPEAT_NOTICE_S) >= REPEAT_NOTICE_S:
            self._said[change] = now
            log.info("%s", notice)

    def plan(self, depth: int, room: int) -> DraftPlan:
        """One sequence's plan at the step's `depth` when it may commit at most `room` more tokens
        (accepted drafts plus the bonus, so at most room - 1 drafts)."""
        d = max(0, min(depth, room - 1))
        if d == 0:
            return NO_DRAFTS
        return DraftPlan(d, self.tree.nodes_at(d) if self.tree is not None else d)

    def plans(self, n_active: int, rooms: Sequence[int]) -> list[DraftPlan]:
        """The plan of every decoding sequence of one step (`rooms` in the same order)."""
        depth = self.step_depth(n_active)
        self.step_depth_taken = depth
        return [self.plan(depth, room) for room in rooms]

    def verify_depth(self, planned: int, probs: Sequence[float]) -> int:
        """How deep a chain is verified: what was planned, cut where the confidence stop ended it."""
        ln_tau = self.spec.ln_confidence_stop
        if ln_tau is None or not probs:
            return min(planned, len(probs))
        return min(planned, chain_depth([math.log(p) if p > 0 else float("-inf") for p in probs], ln_tau))
