"""Segment arithmetic: slices cover every element exactly once; runs and pieces agree with the layout."""

from __future__ import annotations

import pytest
import torch
from microspeed_zero.partition import Segment, cut_segments


def _params(*shapes):
    return [torch.nn.Parameter(torch.zeros(s)) for s in shapes]


@pytest.mark.parametrize("world", [1, 2, 3, 4, 7])
def test_slices_cover_each_element_once(world):
    params = _params((3, 5), (7,), (2, 2, 2), (1,))
    seg = Segment(0, params, ["a", "b", "c", "d"], [0, 0, 1, 1], world, 0)
    assert seg.padded % world == 0 and seg.padded >= seg.numel == 31
    covered = torch.zeros(seg.numel, dtype=torch.int64)
    for rank in range(world):
        for i in range(len(params)):
            rng = seg.param_range(i, rank)
            if rng is not None:
                covered[seg.offsets[i] + rng[0]:seg.offsets[i] + rng[1]] += 1
    assert torch.equal(covered, torch.ones_like(covered))
    assert sum(seg.real_len(r) for r in range(world)) == seg.numel


def test_runs_split_at_group_changes_and_skip_frozen():
    params = _params((4,), (4,), (4,), (4,))
    seg = Segment(0, params, list("abcd"), [0, 0, None, 1], 2, 0)  # rank 0 owns elements 0..7
    assert seg.runs(0) == [(0, 0, 8)]
    assert seg.runs(1) == [(1, 4, 8)]  # c is frozen (no group): not optimized
    assert seg.pieces(1) == [(2, 0, 0), (3, 0, 4)]


def test_views_use_the_recorded_shapes_even_when_parameters_are_placeholders():
    params = _params((2, 3), (4,))
    seg = Segment(0, params, ["w", "b"], [0, 0], 2, 0)
    params[0].data = torch.empty(0)
    flat = torch.arange(seg.padded, dtype=torch.float32)
    w, b = seg.views(flat)
    assert w.shape == (2, 3) and torch.equal(b, torch.tensor([6.0, 7, 8, 9]))


def test_cut_segments_respects_bucket_size_and_dtype():
    a, b, c = _params((10,), (10,), (10,))
    d = torch.nn.Parameter(torch.zeros(5, dtype=torch.bfloat16))
    segs = cut_segments([("a", a, 0), ("b", b, 0), ("c", c, 0), ("d", d, 0)], world=2, rank=0, max_numel=20)
    assert [s.names for s in segs] == [["a", "b"], ["c"], ["d"]]
    assert [s.index for s in segs] == [0, 1, 2]
