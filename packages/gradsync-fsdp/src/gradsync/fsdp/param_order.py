"""Which way round each bucket's params lie in its flat buffer, so every rank steps about as many params.

A sharded bucket is cut into equal shards by elements, so where a unit's large matrices sit at one end
and its small vectors (norms, biases) at the other, one rank holds most of the unit's params: on a
transformer block laid out in module order, the first half of the elements holds parts of nine of its
twelve params and the second half parts of four (one is cut). An element-wise optimizer costs about as
much per param as per thousand elements (torch's single-tensor Adam: about ten kernel launches per
param), so with every block cut the same way one rank steps three times as many params as the other and
sets the pace of every step (measured on the launch-bound benchmark at 2 ranks: 313 params on rank 0,
100 on rank 1, 137 ms of CPU per step against 98 ms). Laying each bucket's params forwards or
backwards, whichever leaves the busiest rank least busy so far, balances the counts over the buckets
(the next block is cut the other way round) without moving any shard boundary. Only the order inside a
bucket changes: every param keeps its own values, views, hooks and checkpoint name.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from .layout import BucketLayout
from .units import BucketSpec


def params_per_shard(layout: BucketLayout) -> list[int]:
    """How many params have elements in each shard of ``layout`` (what an optimizer steps there)."""
    counts = [0] * layout.world
    for index in range(len(layout.items)):
        for shard in range(layout.world):
            first, last = layout.local_rows(index, shard)
            counts[shard] += first < last
    return counts


def balance_param_order(
    specs: Sequence[BucketSpec], layout_of: Callable[[BucketSpec], BucketLayout]
) -> list[BucketLayout]:
    """Reverse, in place, the params (and names) of each bucket whose reversed layout leaves the rank
    stepping most params so far with fewer (ties keep the module order); the buckets' layouts, in order.
    Unsharded buckets keep their order."""
    layouts: list[BucketLayout] = []
    loads: list[int] | None = None
    for spec in specs:
        forward = layout_of(spec)
        if forward.world == 1 or len(spec.params) < 2:
            layouts.append(forward)
            continue
        loads = loads or [0] * forward.world
        backward = layout_of(_reversed(spec))
        as_is, reversed_ = _added(loads, forward), _added(loads, backward)
        reverse = max(reversed_) < max(as_is)
        if reverse:
            spec.params.reverse()
            spec.names.reverse()
        loads = reversed_ if reverse else as_is
        layouts.append(backward if reverse else forward)
    return layouts


def _reversed(spec: BucketSpec) -> BucketSpec:
    return BucketSpec(spec.dtype, spec.requires_grad, spec.unit_id, spec.names[::-1], spec.params[::-1])


def _added(loads: list[int], layout: BucketLayout) -> list[int]:
    return [load + count for load, count in zip(loads, params_per_shard(layout), strict=True)]
