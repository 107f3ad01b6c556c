"""The verify key (docs/design.md §5.6): the dispatch order of a batched verify and the graph key that
names its prepared plan.

Legacy order: by (-depth, slot). Canonical order: by slot, with the multiset of depths sorted
descending laid onto that order, so every arrangement of the same depths over the same slots
shares one key. Canonical applies at widths of at least `canonical_key_min_width()` unless
METRALE_NO_CANONICAL_VERIFY_KEY is present.

Graph key (the seed's name): the `(slot, depth)` words in dispatch order, then one sentinel word
`0xFFFFFFFF - flags`. Today it keys the cache of prepared verify plans (engine.verify_plan);
no CUDA graph hangs off it yet. A slot's cached plans are found by its slot words alone.
"""
from __future__ import annotations

from speculative import knobs

SENTINEL = 0xFFFFFFFF
MAX_FLAGS = 0xFF
MAX_KEY_SLOT = (1 << 30) - 1
FLAG_TREE = 1          # a tree verify (rows carry a tree mask), not a chain


def canonical_key_min_width() -> int:
    """METRALE_CANONICAL_KEY_MIN_WIDTH (default 8), read once per process."""
    return knobs.canonical_key_min_width()


def verify_batch_order(slots: list[int], ks: list[int], canonical: bool) -> tuple[list[int], list[int]]:
    """(slots in dispatch order, the depth at each dispatch position).

    Legacy: the (slot, k) pairs sorted by (-k, slot). Canonical: the slots ascending, the depths
    the multiset of `ks` sorted descending. Empty input gives two empty lists.
    """
    if len(slots) != len(ks):
        raise ValueError(f"{len(slots)} slots but {len(ks)} depths")
    if len(set(slots)) != len(slots):
        raise ValueError(f"slots {slots} repeat: a sequence is verified once per step")
    if canonical:
        return sorted(slots), sorted(ks, reverse=True)
    pairs = sorted(zip(slots, ks), key=lambda p: (-p[1], p[0]))
    return [s for s, _ in pairs], [k for _, k in pairs]


def verify_graph_key(slots: list[int], depths: list[int], flags: int = 0) -> tuple[int, ...]:
    """`(slot_0, depth_0, slot_1, depth_1, ..., 0xFFFFFFFF - flags)`; every word a u32."""
    if len(slots) != len(depths):
        raise ValueError(f"{len(slots)} slots but {len(depths)} depths")
    if not 0 <= flags <= MAX_FLAGS:
        raise ValueError(f"verify key flags {flags} outside 0..={MAX_FLAGS}")
    for s, d in zip(slots, depths):
        if not 0 <= s <= MAX_KEY_SLOT:
            raise ValueError(f"slot {s} outside 0..={MAX_KEY_SLOT}")
        if not 0 <= d < SENTINEL - MAX_FLAGS:
            raise ValueError(f"depth {d} of slot {s} is not a verify depth")
    return tuple(w for pair in zip(slots, depths) for w in pair) + (SENTINEL - flags,)


def verify_graph_key_has_slot(key: tuple[int, ...], slot: int) -> bool:
    """True when `slot` is one of the key's slot words (never a depth word or the sentinel)."""
    return slot in key[0:len(key) - 1:2]
