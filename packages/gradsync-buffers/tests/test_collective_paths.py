"""Every path of each collective gives the closed-form result, plainly and under the race probe, so the
faster one can be chosen freely. The data are multiples of 1/8 whose partial sums over 4 ranks, in any
order, bf16 holds exactly, so bf16 results are exact too."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from buffers_testkit import device, with_and_without_probe

from gradsync.buffers import collectives, shard_buffer
from gradsync.groups.testing import run_distributed

REDUCE_SCATTER_PATHS: tuple[collectives.ReduceScatterPath, ...] = ("native", "all_reduce", "all_to_all")


def rank_data(world: int, rank: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return ((torch.arange(64 * world, device=device()) % 16) * (rank + 1) / 8).to(dtype)


def paths_agree(average: bool, dtype: torch.dtype) -> None:
    world, rank = dist.get_world_size(), dist.get_rank()
    group = dist.group.WORLD
    assert group is not None
    data = rank_data(world, rank, dtype)
    full = torch.arange(32 * world, dtype=dtype, device=device())

    def run() -> list[torch.Tensor]:
        results = []
        for path in REDUCE_SCATTER_PATHS:
            bucket = data.clone()
            collectives.reduce_scatter(bucket, group, average=average, path=path).wait()
            results.append(bucket)
        for via in (False, True):
            bucket = torch.full_like(full, -1.0)
            shard_buffer(bucket, world)[rank].copy_(shard_buffer(full, world)[rank])
            collectives.all_gather_shards(bucket, group, via_broadcasts=via).wait()
            results.append(bucket)
        return results

    *reduced, gathered, via_broadcasts = with_and_without_probe(run, seed=rank)
    total = torch.stack([rank_data(world, r) for r in range(world)]).sum(dim=0)
    expected = data.clone()  # other shards keep their local values
    mine = shard_buffer(total / world if average else total, world)[rank]
    shard_buffer(expected, world)[rank].copy_(mine)
    for path, bucket in zip(REDUCE_SCATTER_PATHS, reduced, strict=True):
        assert torch.equal(bucket, expected), path
    assert torch.equal(gathered, full)
    assert torch.equal(via_broadcasts, full)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("average", [False, True])
@pytest.mark.parametrize("world", [2, 4])
def test_native_and_alternative_paths_agree(average: bool, world: int, dtype: torch.dtype) -> None:
    run_distributed(paths_agree, world, args=(average, dtype))


def test_gloo_reduce_scatters_cpu_tensors_through_an_all_to_all() -> None:
    """Measured on gloo (bench-buffers): the all-to-all and a local sum take under half the native op's
    time; gloo serving CUDA tensors keeps the native op (not measured there)."""
    assert run_distributed(chosen_path, 2)[0] == "all_to_all"


def chosen_path() -> str:
    group = dist.group.WORLD
    assert group is not None
    return collectives.reduce_scatter_path(group, torch.device("cpu"))


UNEVEN_CUTS = {2: (0, 50, 64), 4: (0, 30, 30, 101, 128)}  # rank 1 of 4 owns nothing


def uneven_paths_agree(average: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Ragged shards (gradsync-fsdp's ragged buckets): this rank's shard of each reduction path, and the
    whole bucket after each gather path."""
    world, rank = dist.get_world_size(), dist.get_rank()
    group = dist.group.WORLD
    assert group is not None
    cuts = UNEVEN_CUTS[world]
    lo, hi = cuts[rank], cuts[rank + 1]
    reduced = []
    for path in REDUCE_SCATTER_PATHS:
        bucket = rank_data(world, rank)[: cuts[-1]].clone()
        collectives.reduce_scatter(bucket, group, average=average, path=path, cuts=cuts).wait()
        reduced.append(bucket[lo:hi].cpu())
    gathered = []
    full = torch.arange(cuts[-1], dtype=torch.float32, device=device())
    for via in (False, True):
        bucket = torch.full_like(full, -1.0)
        bucket[lo:hi].copy_(full[lo:hi])
        collectives.all_gather_shards(bucket, group, via_broadcasts=via, cuts=cuts).wait()
        gathered.append(bucket.cpu())
    return reduced, gathered


@pytest.mark.parametrize("average", [False, True])
@pytest.mark.parametrize("world", [2, 4])
def test_uneven_shards_reduce_and_gather_at_their_cuts(average: bool, world: int) -> None:
    cuts = UNEVEN_CUTS[world]
    total = torch.stack([rank_data(world, r).cpu()[: cuts[-1]] for r in range(world)]).sum(dim=0)
    want = total / world if average else total
    for rank, (reduced, gathered) in enumerate(run_distributed(uneven_paths_agree, world, args=(average,))):
        for shard in reduced:
            assert torch.equal(shard, want[cuts[rank] : cuts[rank + 1]]), rank
        for bucket in gathered:
            assert torch.equal(bucket, torch.arange(cuts[-1], dtype=torch.float32)), rank


def test_cuts_that_do_not_cover_the_buffer_are_refused() -> None:
    with pytest.raises(ValueError, match=r"shard cuts \(0, 5, 3, 10\) must be 4 boundaries rising from 0"):
        collectives.uneven_shards(torch.zeros(10), (0, 5, 3, 10), 3)
    with pytest.raises(ValueError, match="to the buffer's 10 elements"):
        collectives.uneven_shards(torch.zeros(10), (0, 5, 9), 2)
    with pytest.raises(ValueError, match="must be 3 boundaries"):  # cuts for another group size
        collectives.uneven_shards(torch.zeros(10), (0, 5, 6, 10), 2)
