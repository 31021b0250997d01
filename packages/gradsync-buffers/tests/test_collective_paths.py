"""Both paths of each collective give identical results, so the faster one can be chosen freely."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from gradsync.buffers import collectives, shard_buffer
from gradsync.groups.testing import run_distributed


def paths_agree(average: bool) -> None:
    world, rank = dist.get_world_size(), dist.get_rank()
    group = dist.group.WORLD
    assert group is not None
    data = (torch.arange(64 * world, dtype=torch.float32) * (rank + 1)) / 8
    results = []
    for via in (False, True):
        bucket = data.clone()
        collectives.reduce_scatter(bucket, group, average=average, via_all_reduce=via).wait()
        results.append(bucket)
    assert torch.equal(results[0], results[1])
    total = sum(data / (rank + 1) * (r + 1) for r in range(world))
    own = shard_buffer(total / world if average else total, world)[rank]
    assert torch.equal(shard_buffer(results[0], world)[rank], own)
    for r in range(world):  # other shards keep their local values
        if r != rank:
            assert torch.equal(shard_buffer(results[0], world)[r], shard_buffer(data, world)[r])
    gathered = []
    full = torch.arange(32 * world, dtype=torch.float32)
    for via in (False, True):
        bucket = torch.full_like(full, -1.0)
        shard_buffer(bucket, world)[rank].copy_(shard_buffer(full, world)[rank])
        collectives.all_gather_shards(bucket, group, via_broadcasts=via).wait()
        gathered.append(bucket)
    assert torch.equal(gathered[0], full)
    assert torch.equal(gathered[1], full)


@pytest.mark.parametrize("average", [False, True])
@pytest.mark.parametrize("world", [2, 4])
def test_native_and_alternative_paths_agree(average: bool, world: int) -> None:
    run_distributed(paths_agree, world, args=(average,))
