"""Hypothesis over random shapes, dtypes and bucket sizes: the layout invariants always hold."""

from __future__ import annotations

from itertools import pairwise

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gradsync.buffers import ParamSpec, bucket_end_divisor, compute_full_param_layout

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@st.composite
def cases(draw: st.DrawFn) -> tuple[list[ParamSpec], int | None, bool, int, bool]:
    n = draw(st.integers(1, 12))
    specs = [
        ParamSpec(
            shape=tuple(draw(st.lists(st.integers(1, 40), min_size=1, max_size=3))),
            dtype=draw(st.sampled_from(DTYPES)),
            is_expert_parallel=draw(st.booleans()),
            shared_embedding=draw(st.integers(0, 9)) == 0,
        )
        for _ in range(n)
    ]
    bucket_size = draw(st.one_of(st.none(), st.integers(1, 5000)))
    return (
        specs,
        bucket_size,
        draw(st.booleans()),
        draw(st.sampled_from([1, 2, 3, 4, 8])),
        draw(st.booleans()),
    )


@settings(max_examples=300, deadline=None)
@given(cases())
def test_layout_invariants(case: tuple[list[ParamSpec], int | None, bool, int, bool]) -> None:
    specs, bucket_size, padded, dp, high_busbw = case
    full = compute_full_param_layout(
        specs, bucket_size, padded=padded, data_parallel_world_size=dp, pad_for_high_nccl_busbw=high_busbw
    )
    assert sorted(i for members in full.members.values() for i in members) == list(range(len(specs)))
    for key, layout in full.layouts.items():
        members = full.members[key]
        assert all(specs[i].dtype == key.param_dtype for i in members)
        ranges = sorted(layout.param_index_map.values())
        # Every param has exactly its numel, and no two params overlap.
        for i, (start, end, _) in layout.param_index_map.items():
            assert end - start == specs[members[i]].numel
        for (_, end_a, _), (start_b, _, _) in pairwise(ranges):
            assert end_a <= start_b
        # Buckets tile the buffer; every param lies inside the one bucket it names.
        assert layout.bucket_indices[0][0] == 0
        for (_, end_a), (start_b, _) in pairwise(layout.bucket_indices):
            assert end_a == start_b
        for start, end, bucket in layout.param_index_map.values():
            bucket_start, bucket_end = layout.bucket_indices[bucket]
            assert bucket_start <= start
            assert end <= bucket_end
        # Bucket ids increase in reverse registration order.
        ids = [layout.param_index_map[i][2] for i in reversed(range(len(members)))]
        assert ids == sorted(ids)
        for b, (start, end) in enumerate(layout.bucket_indices):
            assert layout.per_bucket_numel_unpadded[b] <= end - start
            if padded:
                assert start % bucket_end_divisor(dp, high_busbw) == 0
                assert end % bucket_end_divisor(dp, high_busbw) == 0
                # The shards of a bucket partition it exactly.
                shards = [layout.shard_range(b, r, dp) for r in range(dp)]
                assert shards[0][0] == start
                assert shards[-1][1] == end
                assert all(a[1] == c[0] for a, c in pairwise(shards))
                owned = sum(
                    p.local[1] - p.local[0] for r in range(dp) for p in layout.shard_param_ranges(b, r, dp)
                )
                assert owned == sum(specs[members[i]].numel for i in layout.bucket_params(b))
        if padded:
            for start, _, _ in layout.param_index_map.values():
                assert start % 64 == 0
            for i, (_, _, bucket) in layout.param_index_map.items():
                if specs[members[i]].shared_embedding:
                    assert layout.bucket_params(bucket) == [i]
        else:
            assert layout.numel == sum(specs[i].numel for i in members)
        if bucket_size is None and not padded:
            assert len(layout.bucket_indices) == 1
