"""Verify dispatch order, graph keys, slot matching and the canonical-order knobs (docs/design.md §5.6)."""
from __future__ import annotations

import itertools

import pytest

from engine.verify_key import (FLAG_TREE, verify_batch_order, verify_graph_key, verify_graph_key_has_slot)
from tests.speculative.test_knobs import read_in_process, read_in_subprocess


def test_legacy_order_by_depth_then_slot():
    assert verify_batch_order([7, 2, 5, 9], [1, 3, 3, 2], canonical=False) == ([2, 5, 9, 7], [3, 3, 2, 1])
    assert verify_batch_order([4, 1], [2, 2], canonical=False) == ([1, 4], [2, 2])
    assert verify_batch_order([], [], canonical=False) == ([], [])


def test_canonical_order_lays_sorted_depths_onto_slots():
    assert verify_batch_order([7, 2, 5, 9], [1, 3, 3, 2], canonical=True) == ([2, 5, 7, 9], [3, 3, 2, 1])
    assert verify_batch_order([3], [4], canonical=True) == ([3], [4])


def test_all_arrangements_of_a_depth_multiset_share_one_canonical_key():
    slots, depths = [11, 4, 8, 2], [3, 1, 3, 0]
    canonical, legacy = set(), set()
    for perm in itertools.permutations(depths):
        canonical.add(verify_graph_key(*verify_batch_order(slots, list(perm), canonical=True)))
        legacy.add(verify_graph_key(*verify_batch_order(slots, list(perm), canonical=False)))
    assert canonical == {(2, 3, 4, 3, 8, 1, 11, 0, 0xFFFFFFFF)}
    assert len(legacy) == 12   # 4! / 2! distinct arrangements, each its own legacy key


def test_graph_key_words_and_sentinel():
    assert verify_graph_key([2, 5], [3, 1]) == (2, 3, 5, 1, 0xFFFFFFFF)
    assert verify_graph_key([2, 5], [3, 1], flags=FLAG_TREE) == (2, 3, 5, 1, 0xFFFFFFFE)
    assert verify_graph_key([], [], flags=3) == (0xFFFFFFFC,)
    with pytest.raises(ValueError, match="2 slots but 1 depths"):
        verify_graph_key([2, 5], [3])
    with pytest.raises(ValueError, match="flags 256"):
        verify_graph_key([2], [3], flags=256)
    with pytest.raises(ValueError, match="slot -1"):
        verify_graph_key([-1], [3])
    with pytest.raises(ValueError, match="repeat"):
        verify_batch_order([2, 2], [1, 1], canonical=True)


def test_slot_matching_sees_slot_words_only():
    key = verify_graph_key([2, 5], [3, 7], flags=1)
    assert verify_graph_key_has_slot(key, 2) and verify_graph_key_has_slot(key, 5)
    assert not verify_graph_key_has_slot(key, 3)            # a depth word
    assert not verify_graph_key_has_slot(key, 7)            # a depth word
    assert not verify_graph_key_has_slot(key, 0xFFFFFFFE)   # the sentinel
    assert not verify_graph_key_has_slot(verify_graph_key([], []), 0xFFFFFFFF)


@pytest.mark.parametrize("env, want", [({}, "8"), ({"METRALE_CANONICAL_KEY_MIN_WIDTH": "4"}, "4"),
                                       ({"METRALE_CANONICAL_KEY_MIN_WIDTH": "  2 "}, "2"),
                                       ({"METRALE_CANONICAL_KEY_MIN_WIDTH": "0"}, "0"),
                                       ({"METRALE_CANONICAL_KEY_MIN_WIDTH": "-3"}, "8"),
                                       ({"METRALE_CANONICAL_KEY_MIN_WIDTH": "2.5"}, "8"),
                                       ({"METRALE_CANONICAL_KEY_MIN_WIDTH": "wide"}, "8"),
                                       ({"METRALE_CANONICAL_KEY_MIN_WIDTH": ""}, "8")])
def test_canonical_min_width(env, want, monkeypatch):
    from engine.verify_key import canonical_key_min_width
    assert read_in_process(canonical_key_min_width, env, monkeypatch) == want


@pytest.mark.parametrize("env, want", [({}, "False False True True"),
                                       ({"METRALE_NO_CANONICAL_VERIFY_KEY": "0"}, "False False False False"),
                                       ({"METRALE_CANONICAL_KEY_MIN_WIDTH": "3"}, "False True True True"),
                                       ({"METRALE_CANONICAL_KEY_MIN_WIDTH": "9"}, "False False False True")])
def test_canonical_order_applies_by_width_and_kill_switch(env, want):
    expr = ("__import__('speculative.settings').settings.resolve_spec_settings().canonical_order(w) "
            "for w in (1, 3, 8, 9)")
    assert read_in_subprocess(f"' '.join(str(x) for x in [{expr}])", env) == want


def test_knobs_read_once_per_process():
    code = ("k.canonical_key_min_width(), k.no_canonical_verify_key(), "
            "__import__('os').environ.update(METRALE_CANONICAL_KEY_MIN_WIDTH='3', METRALE_NO_CANONICAL_VERIFY_KEY=''), "
            "k.canonical_key_min_width(), k.no_canonical_verify_key()")
    assert read_in_subprocess(code, {"METRALE_CANONICAL_KEY_MIN_WIDTH": "5"}) == "5 False None 5 False"
