"""collectives.chain: the one rule for a collective that needs another's result. Where wait() only orders
the device stream the second stage is issued at once; where it blocks the host (gloo) the second stage
waits for the handle's wait(). Both give the same result; checked on real gloo groups, the stream-ordered
branch by declaring gloo's wait stream-ordered (its wait then blocks, which is still correct)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
from buffers_testkit import device

from gradsync.buffers import collectives
from gradsync.groups import get_backend_capabilities
from gradsync.groups.testing import run_distributed


def two_stage_sum(stream_ordered: bool) -> tuple[bool, bool, list[float]]:
    """Stage 1 sums rank-distinct values; stage 2 sums (stage 1's result + rank) again. Returns whether
    stage 2 was issued before the handle was waited, whether it ran at all, and its result."""
    group, rank = dist.group.WORLD, dist.get_rank()
    assert group is not None
    caps = get_backend_capabilities(group, device())
    original = collectives.get_backend_capabilities
    collectives.get_backend_capabilities = (  # type: ignore[assignment]
        lambda *_: dataclasses.replace(caps, stream_ordered_wait=stream_ordered)
    )
    first = torch.arange(4, dtype=torch.float32, device=device()) * (rank + 1)
    second = torch.zeros_like(first)
    issued: list[bool] = []

    def next_stage() -> collectives.Launched:
        issued.append(True)
        second.copy_(first + rank)
        return collectives.all_reduce(second, group)

    try:
        launched = collectives.chain(collectives.all_reduce(first, group), next_stage, group, device())
        issued_before_wait = bool(issued)
        launched.wait()
    finally:
        collectives.get_backend_capabilities = original  # type: ignore[assignment]
    return issued_before_wait, bool(issued), second.tolist()


@pytest.mark.parametrize("stream_ordered", [False, True])
def test_chain_issues_the_second_stage_as_the_backend_allows(stream_ordered: bool) -> None:
    world = 2
    stage1 = [float(i * sum(r + 1 for r in range(world))) for i in range(4)]
    want = [world * v + sum(range(world)) for v in stage1]
    for issued_before_wait, issued, got in run_distributed(two_stage_sum, world, args=(stream_ordered,)):
        assert issued_before_wait == stream_ordered
        assert issued
        assert got == want
