"""Grad sync on 1/2/4/8 gloo ranks with analytic values: all grads 1 give exactly 1, or 1/DP on the
shards a rank does not own after a pre-divided reduce-scatter."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist
from buffers_testkit import buffers_for, model_parallel, toy_model

from gradsync.buffers import DistributedDataParallelConfig, shard_buffer
from gradsync.groups.testing import run_distributed


def sync_all_ones(distopt: bool, average: bool, fp32: bool, instances: int, overlap: bool) -> int:
    world = dist.get_world_size()
    with model_parallel(num_distributed_optimizer_instances=instances) as groups:
        model = toy_model(dtype=torch.bfloat16)
        config = DistributedDataParallelConfig(
            use_distributed_optimizer=distopt,
            average_in_collective=average,
            grad_reduce_in_fp32=fp32,
            num_distributed_optimizer_instances=instances,
            overlap_grad_reduce=overlap,
            bucket_size=700,
        )
        buffers = buffers_for(model, config, groups)
        assert len(buffers.bucket_groups) > 1 if overlap else len(buffers.bucket_groups) == 1
        for buffer in buffers.buffers:
            assert buffer.grad_dtype == (torch.float32 if fp32 else torch.bfloat16)
            buffer.grad_data.fill_(1.0)
        buffers.finish_grad_sync()
        checked = 0
        for group in buffers.bucket_groups:
            size, rank = group.collective_group_size, group.collective_group_rank
            assert size == world // instances
            for bucket in group.buckets:
                for r, shard in enumerate(shard_buffer(bucket.grad_data, size)):
                    # A shard this rank does not own keeps its local value, pre-divided unless averaging.
                    owned = not distopt or r == rank
                    expected = 1.0 if owned or average else 1.0 / world
                    assert torch.equal(shard, torch.full_like(shard, expected)), (r, rank, shard[:4])
                    checked += shard.numel()
        return checked


GRID = [
    (world, distopt, average, fp32, instances)
    for world, distopt, average, fp32, instances in itertools.product(
        [1, 2, 4, 8], [False, True], [False, True], [False, True], [1, 2]
    )
    if instances == 1 or (distopt and world >= 2)
]


@pytest.mark.parametrize(("world", "distopt", "average", "fp32", "instances"), GRID)
def test_all_ones_reduce_to_analytic_values(
    world: int, distopt: bool, average: bool, fp32: bool, instances: int
) -> None:
    checked = run_distributed(sync_all_ones, world, args=(distopt, average, fp32, instances, False))
    assert all(c > 0 for c in checked)


@pytest.mark.parametrize(("distopt", "average"), [(False, False), (True, False), (True, True)])
def test_overlapped_buckets_give_the_same_values(distopt: bool, average: bool) -> None:
    run_distributed(sync_all_ones, 4, args=(distopt, average, False, 1, True))


def expert_grads_end_at_one(distopt: bool, average: bool) -> None:
    # world 4, ep 2: dense dp_cp = 4, expert dp = 2. An expert sees ep x etp = 2 times the tokens.
    with model_parallel(expert_model_parallel_size=2) as groups:
        model = toy_model(num_layers=3)
        for param in model[1].parameters():
            param.allreduce = False  # type: ignore[attr-defined]
        config = DistributedDataParallelConfig(
            use_distributed_optimizer=distopt, average_in_collective=average
        )
        buffers = buffers_for(model, config, groups)
        assert len(buffers.buffers) == len(buffers.expert_parallel_buffers) == 1
        (expert,) = buffers.expert_parallel_buffers
        assert expert.data_parallel_group is groups.expt_dp
        assert set(expert.params) == set(model[1].parameters())
        buffers.buffers[0].grad_data.fill_(1.0)
        expert.grad_data.fill_(2.0)
        buffers.finish_grad_sync()
        edp, rank = groups.expt_dp.size(), groups.expt_dp.rank()  # type: ignore[union-attr]
        for r, shard in enumerate(shard_buffer(expert.grad_data, edp)):
            expected = 1.0 if (not distopt or r == rank or average) else 1.0 / edp
            assert torch.equal(shard, torch.full_like(shard, expected))


@pytest.mark.parametrize(("distopt", "average"), [(False, False), (False, True), (True, False), (True, True)])
def test_expert_grads_use_the_expert_dp_group_and_factor(distopt: bool, average: bool) -> None:
    run_distributed(expert_grads_end_at_one, 4, args=(distopt, average))


def per_token_loss_sums() -> None:
    rank = dist.get_rank()
    with model_parallel() as groups:
        model = toy_model(num_layers=2)
        buffers = buffers_for(model, DistributedDataParallelConfig(), groups, calculate_per_token_loss=True)
        buffers.buffers[0].grad_data.fill_(2.0**rank)
        buffers.finish_grad_sync()
        total = sum(2.0**r for r in range(dist.get_world_size()))
        assert torch.equal(buffers.buffers[0].grad_data, torch.full_like(buffers.buffers[0].grad_data, total))
        with pytest.raises(
            ValueError, match="average_in_collective=True cannot be combined with calculate_per_token_loss"
        ):
            buffers_for(
                model,
                DistributedDataParallelConfig(average_in_collective=True),
                groups,
                calculate_per_token_loss=True,
            )


def test_per_token_loss_sums_without_scaling() -> None:
    run_distributed(per_token_loss_sums, 4)
