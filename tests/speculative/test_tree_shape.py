"""Draft tree shapes, verify rows, accepted paths and tree masks, with exact values (docs/design.md §5.5)."""
from __future__ import annotations

import pytest
import torch

from runtime.executor.attention import SeqChunk, ancestor_mask, build_plan, row_depths
from runtime.executor.kv_cache import PagedKVCache
from speculative.tree_shape import TreeShape, accepted_path, verify_rows


def test_valid_shapes():
    s = TreeShape.parse("1,2,2")
    assert (s.counts, s.spine_len, s.num_nodes, s.verify_width, s.is_chain, s.shape_id) == ((1, 2, 2), 3, 5, 6,
                                                                                          False, 122)
    s = TreeShape.parse(" 1 , 1,1 ")
    assert (s.counts, s.num_nodes, s.verify_width, s.is_chain, s.shape_id) == ((1, 1, 1), 3, 4, True, 111)
    s = TreeShape.parse("4,3")
    assert (s.spine_len, s.num_nodes, s.verify_width, s.is_chain, s.shape_id) == (2, 7, 8, False, 43)
    assert TreeShape.parse("1,2,2,2").num_nodes == 7
    assert TreeShape.parse("1,2,2") == TreeShape((1, 2, 2))


@pytest.mark.parametrize("text, match", [("", "comma list"), ("1,,2", "comma list"), ("1;2", "comma list"),
                                         ("a", "comma list"), ("-1,2", "comma list"), ("1.5", "comma list"),
                                         ("0,2", "count 0 is outside 1..=4"), ("1,5", "count 5 is outside"),
                                         ("2,2,2,2", "8 nodes, at most 7"), ("1,1,1,1,1,1,1,1", "8 nodes")])
def test_refused_shapes(text, match):
    with pytest.raises(ValueError, match=match):
        TreeShape.parse(text)


def test_cuts_of_a_shape():
    s = TreeShape.parse("1,2,2")
    assert [s.nodes_at(d) for d in range(4)] == [0, 1, 3, 5]
    assert s.parents(3) == [-1, 0, 1, 2, 1, 2]
    assert s.parents(1) == [-1, 0]
    assert TreeShape.parse("2,1,3").parents(3) == [-1, 0, 1, 2, 0, 2, 2]


def test_verify_rows():
    assert verify_rows(7, [10, 11, 12], [(2, 20), (3, 30)]) == [
        (7, 0, -1), (10, 1, 0), (11, 2, 1), (12, 3, 2), (20, 2, 1), (30, 3, 2)]
    assert verify_rows(7, [10], [(1, 21), (1, 22)]) == [(7, 0, -1), (10, 1, 0), (21, 1, 0), (22, 1, 0)]
    assert verify_rows(7, [], []) == [(7, 0, -1)]
    with pytest.raises(ValueError, match="depth 2"):
        verify_rows(7, [10], [(2, 20)])


SPINE, HEDGES = [10, 11, 12], [(2, 20), (3, 30)]   # rows: 0 root, 1..3 spine, 4 hedge d2, 5 hedge d3


@pytest.mark.parametrize("targets, want", [
    ([10, 11, 12, 99, 77, 66], ([1, 2, 3], 99)),    # the whole spine, bonus after row 3
    ([10, 11, 30, 98, 77, 66], ([1, 2, 5], 66)),    # spine to depth 2, the depth-3 hedge, bonus after row 5
    ([10, 20, 11, 12, 55, 66], ([1, 4], 55)),       # the hedge at depth 2 ends the walk, though its spine rows match
    ([10, 21, 11, 12, 55, 66], ([1], 21)),          # nothing at depth 2 matches: bonus after row 1
    ([13, 11, 12, 99, 77, 66], ([], 13)),           # depth 1 has no hedge: bonus after the root
    ([10, 11, 20, 99, 77, 66], ([1, 2], 20)),       # a depth-2 hedge token at depth 3 is not a match
])
def test_accepted_path(targets, want):
    assert accepted_path(SPINE, HEDGES, targets) == want


def test_accepted_path_spine_before_hedges_in_list_order():
    spine, hedges = [10], [(1, 20), (1, 10), (1, 21)]
    assert accepted_path(spine, hedges, [10, 1, 2, 3, 4]) == ([1], 1)      # the spine wins a tie
    assert accepted_path(spine, hedges, [21, 1, 2, 3, 4]) == ([4], 4)
    with pytest.raises(ValueError, match="5 verify rows need 5 target tokens, got 4"):
        accepted_path(spine, hedges, [10, 1, 2, 3])


def test_masks_and_parent_lists():
    parents = TreeShape.parse("1,2,2").parents(3)
    assert row_depths(parents) == [0, 1, 2, 3, 2, 3]
    block = ancestor_mask(parents, device="cpu")
    assert block.int().tolist() == [[1, 0, 0, 0, 0, 0],
                                    [1, 1, 0, 0, 0, 0],
                                    [1, 1, 1, 0, 0, 0],
                                    [1, 1, 1, 1, 0, 0],
                                    [1, 1, 0, 0, 1, 0],
                                    [1, 1, 1, 0, 0, 1]]
    # A tree chunk in a step: rows at start + depth, seeing the committed context and their ancestors.
    cache = PagedKVCache(num_layers=1, num_kv_heads=1, head_dim=2, num_blocks=4, block_size=4, device="cpu")
    cache.reserve(0, 9)
    plan = build_plan(cache, [SeqChunk(0, 3, 6, tuple(parents))])
    assert plan.positions.tolist() == [3, 4, 5, 6, 5, 6]
    seen = plan.mask[0, 0, :6, :9]
    assert bool(seen[:, :3].all()) and torch.equal(seen[:, 3:], block)
    with pytest.raises(ValueError, match="5 parents for 6 rows"):
        SeqChunk(0, 3, 6, tuple(parents[:5]))
    with pytest.raises(ValueError, match="root"):
        row_depths([-1, -1])
