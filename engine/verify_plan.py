"""Prepared verify plans, cached under the verify graph key (docs/design.md §5.6).

Shapes: n verify rows of one sequence (root plus drafts), R verify rows of the step.

A plan is everything about a batched verify that its key fixes: each sequence's row count, and
for a tree its parent rows (the attention derives positions and the ancestor mask from them), plus the rows the
verify reads logits from. These are CPU index and mask tensors (on a GPU a captured graph would
hang off the same key). What changes every step (cache slots, context lengths) is not in it.
A slot's plans are dropped when its sequence is freed.
"""
from __future__ import annotations

from dataclasses import dataclass

from speculative.tree_shape import TreeShape
from engine.verify_key import FLAG_TREE, verify_graph_key, verify_graph_key_has_slot

DEFAULT_MAX_PLANS = 1024


@dataclass(frozen=True, slots=True)
class SeqLayout:
    """One sequence's verify rows: `depth` drafts deep (the spine of a tree)."""
    depth: int
    num_rows: int
    parents: tuple[int, ...] | None = None      # tree only: parent row of each row, the root's -1


@dataclass(frozen=True, slots=True)
class VerifyPlan:
    key: tuple[int, ...]
    slots: tuple[int, ...]                      # dispatch order
    seqs: tuple[SeqLayout, ...]
    row_starts: tuple[int, ...]                 # first forward row of each sequence (verified rows go first)
    logits_rows: list[int]                      # [R] every verify row


def layout(depth: int, shape: TreeShape | None) -> SeqLayout:
    if shape is None:
        return SeqLayout(depth=depth, num_rows=depth + 1)
    parents = shape.parents(depth)
    return SeqLayout(depth=depth, num_rows=len(parents), parents=tuple(parents))


def build_verify_plan(slots: list[int], depths: list[int], shape: TreeShape | None) -> VerifyPlan:
    seqs = tuple(layout(d, shape) for d in depths)
    starts, at = [], 0
    for s in seqs:
        starts.append(at)
        at += s.num_rows
    return VerifyPlan(key=verify_graph_key(slots, depths, FLAG_TREE if shape is not None else 0), slots=tuple(slots),
                      seqs=seqs, row_starts=tuple(starts), logits_rows=list(range(at)))


class VerifyPlanCache:
    """Plans by graph key, with hit and miss counts; at most `max_plans` (oldest dropped first)."""

    def __init__(self, shape: TreeShape | None = None, max_plans: int = DEFAULT_MAX_PLANS) -> None:
        self.shape = shape
        self.max_plans = max_plans
        self.plans: dict[tuple[int, ...], VerifyPlan] = {}
        self.hits = 0
        self.misses = 0

    def get(self, slots: list[int], depths: list[int]) -> VerifyPlan:
        """The plan for a verify of `slots` (dispatch order) at `depths`, built on a miss."""
        key = verify_graph_key(slots, depths, FLAG_TREE if self.shape is not None else 0)
        plan = self.plans.get(key)
        if plan is not None:
            self.hits += 1
            return plan
        self.misses += 1
        plan = build_verify_plan(slots, depths, self.shape)
        if len(self.plans) >= self.max_plans:
            del self.plans[next(iter(self.plans))]
        self.plans[key] = plan
        return plan

    def drop_slot(self, slot: int) -> int:
        """Forget every plan whose key holds `slot` (its sequence was freed); returns how many."""
        gone = [k for k in self.plans if verify_graph_key_has_slot(k, slot)]
        for k in gone:
            del self.plans[k]
        return len(gone)

    def clear(self) -> None:
        """Forget every plan (the slots now name other sequences)."""
        self.plans.clear()

    def __len__(self) -> int:
        return len(self.plans)
