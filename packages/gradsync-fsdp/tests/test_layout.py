"""The flat layout: every shard boundary falls on a row boundary of every param, shards are equal, and
each param's rows are covered exactly once across ranks (checked against a direct element-by-element
assignment, on random shapes)."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gradsync.fsdp import compute_bucket_layout

shapes = st.lists(
    st.lists(st.integers(1, 7), min_size=1, max_size=3).map(torch.Size),
    min_size=1,
    max_size=6,
)


@settings(max_examples=200, deadline=None)
@given(shapes=shapes, world=st.integers(1, 8))
def test_shards_cut_params_only_between_rows(shapes: list[torch.Size], world: int) -> None:
    layout = compute_bucket_layout(shapes, world)
    assert layout.size % world == 0
    owner = torch.full((layout.size,), -1)
    for rank in range(world):
        lo, hi = layout.shard_range(rank)
        owner[lo:hi] = rank
    for index, item in enumerate(layout.items):
        row = math.prod(item.shape[1:]) if len(item.shape) > 1 else 1
        assert world == 1 or item.offset % row == 0
        rows_seen = []
        for rank in range(world):
            first, last = layout.local_rows(index, rank)
            start, end = layout.local_span(index, rank)
            # the span holds exactly the elements of this item that lie in rank's shard
            mine = (owner[item.offset : item.end] == rank).nonzero().flatten()
            assert end - start == len(mine)
            if len(mine):
                assert (start, end) == (item.offset + int(mine[0]), item.offset + int(mine[-1]) + 1)
            rows_seen += range(first, last)
        assert rows_seen == list(range(item.shape[0]))


def test_items_do_not_overlap_and_padding_is_minimal_for_aligned_shapes() -> None:
    layout = compute_bucket_layout([torch.Size([4, 3]), torch.Size([5]), torch.Size([2, 3])], world=2)
    assert [(i.offset, i.end) for i in layout.items] == [(0, 12), (12, 17), (18, 24)]
    assert (layout.size, layout.cuts) == (24, (0, 12, 24))
    assert (layout.local_rows(1, 0), layout.local_rows(1, 1)) == ((0, 0), (0, 5))  # rank 0 owns none
