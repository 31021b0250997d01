"""Grad sync on 1/2/4/8 gloo ranks: each rank contributes different grads, and every buffer must end bit for
bit at the closed-form sum (pre-divided by DP, or averaged), on the shards a rank owns after a
reduce-scatter, and at its own scaled grads elsewhere, both plainly and under the race probe."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist
from buffers_testkit import (
    buffers_for,
    emulate_backward,
    expected_grads,
    fill_local_grads,
    finish_first_iteration,
    local_grads,
    model_parallel,
    rank_grad_of,
    toy_model,
    with_and_without_probe,
)
from torch import nn

from gradsync.buffers import DistributedDataParallelConfig, GradBuffers
from gradsync.groups.testing import run_distributed


def sync_rank_grads(
    distopt: bool, average: bool, fp32: bool, instances: int, overlap: bool, fp32_accumulation: bool = False
) -> int:
    rank, world = dist.get_rank(), dist.get_world_size()
    built: list[GradBuffers] = []
    with model_parallel(num_distributed_optimizer_instances=instances) as groups:

        def run() -> list[torch.Tensor]:
            model = toy_model(dtype=torch.bfloat16)
            config = DistributedDataParallelConfig(
                use_distributed_optimizer=distopt,
                average_in_collective=average,
                grad_reduce_in_fp32=fp32,
                num_distributed_optimizer_instances=instances,
                overlap_grad_reduce=overlap,
                reduce_scatter_with_fp32_accumulation=fp32_accumulation,
                bucket_size=700,
            )
            buffers = buffers_for(model, config, groups)
            built.append(buffers)
            if overlap:
                finish_first_iteration(buffers, model)
                # The second iteration dispatches each group from its last grad, as backward would.
                emulate_backward(buffers, model, rank_grad_of(buffers, rank))
                assert all(g.grad_reduce_dispatched for g in buffers.bucket_groups)
            else:
                fill_local_grads(buffers, rank)
            buffers.finish_grad_sync()
            return [buffer.grad_data for buffer in buffers.buffers]

        results = with_and_without_probe(run, seed=rank)
        buffers = built[0]
        assert len(buffers.bucket_groups) > 1 if overlap else len(buffers.bucket_groups) == 1
        (group_size,) = {g.collective_group_size for g in buffers.bucket_groups}
        (group_rank,) = {g.collective_group_rank for g in buffers.bucket_groups}
        assert group_size == world // instances
        checked = 0
        for buffer, result in zip(buffers.buffers, results, strict=True):
            assert buffer.grad_dtype == (torch.float32 if fp32 else torch.bfloat16)
            expected = expected_grads(
                buffer,
                rank,
                range(world),
                1.0 if average else 1.0 / world,
                average=average,
                shard=(group_rank, group_size) if distopt else None,
            )
            assert not torch.equal(expected, local_grads(buffer, rank).to(expected.dtype)) or world == 1
            assert torch.equal(result, expected), (result[:8], expected[:8])
            checked += result.numel()
        return checked


GRID = [
    (world, distopt, average, fp32, instances)
    for world, distopt, average, fp32, instances in itertools.product(
        [1, 2, 4, 8], [False, True], [False, True], [False, True], [1, 2]
    )
    if instances == 1 or (distopt and world >= 2)
]


@pytest.mark.parametrize(("world", "distopt", "average", "fp32", "instances"), GRID)
def test_rank_grads_reduce_to_the_closed_form(
    world: int, distopt: bool, average: bool, fp32: bool, instances: int
) -> None:
    checked = run_distributed(sync_rank_grads, world, args=(distopt, average, fp32, instances, False))
    assert all(c > 0 for c in checked)


OVERLAPPED = [
    # (distopt, average, instances, fp32 accumulation)
    (False, False, 1, False),
    (False, True, 1, False),
    (True, False, 1, False),
    (True, True, 1, False),
    (True, False, 2, False),
    (True, False, 1, True),
]


@pytest.mark.parametrize(("distopt", "average", "instances", "fp32_accumulation"), OVERLAPPED)
def test_overlapped_buckets_dispatched_from_readiness(
    distopt: bool, average: bool, instances: int, fp32_accumulation: bool
) -> None:
    run_distributed(sync_rank_grads, 4, args=(distopt, average, False, instances, True, fp32_accumulation))


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("world", [2, 4])
def test_reduce_scatter_with_fp32_accumulation(world: int, overlap: bool) -> None:
    run_distributed(sync_rank_grads, world, args=(True, False, False, 1, overlap, True))


def expert_grads(distopt: bool, average: bool) -> None:
    # world 4, ep 2: dense dp_cp = 4, expert dp = 2. An expert sees ep x etp = 2 times the tokens.
    rank, world = dist.get_rank(), dist.get_world_size()
    built: list[tuple[nn.Sequential, GradBuffers]] = []
    with model_parallel(expert_model_parallel_size=2) as groups:

        def run() -> list[torch.Tensor]:
            model = toy_model(num_layers=3)
            for param in model[1].parameters():
                param.allreduce = False  # type: ignore[attr-defined]
            config = DistributedDataParallelConfig(
                use_distributed_optimizer=distopt, average_in_collective=average
            )
            buffers = buffers_for(model, config, groups)
            built.append((model, buffers))
            fill_local_grads(buffers, rank)
            buffers.finish_grad_sync()
            return [buffer.grad_data for buffer in buffers.all_buffers]

        dense_result, expert_result = with_and_without_probe(run, seed=rank)
        model, buffers = built[0]
        (dense,) = buffers.buffers
        (expert,) = buffers.expert_parallel_buffers
        assert expert.data_parallel_group is groups.expt_dp
        assert set(expert.params) == set(model[1].parameters())
        expert_ranks = dist.get_process_group_ranks(groups.expt_dp)
        edp, expert_rank = len(expert_ranks), expert_ranks.index(rank)
        assert edp == 2
        assert torch.equal(
            dense_result,
            expected_grads(
                dense,
                rank,
                range(world),
                1.0 if average else 1.0 / world,
                average=average,
                shard=(rank, world) if distopt else None,
            ),
        )
        assert torch.equal(
            expert_result,
            expected_grads(
                expert,
                rank,
                expert_ranks,
                edp / world if average else 1.0 / world,
                average=average,
                shard=(expert_rank, edp) if distopt else None,
            ),
        )


@pytest.mark.parametrize(("distopt", "average"), [(False, False), (False, True), (True, False), (True, True)])
def test_expert_grads_use_the_expert_dp_group_and_factor(distopt: bool, average: bool) -> None:
    run_distributed(expert_grads, 4, args=(distopt, average))


def per_token_loss_sums() -> None:
    rank = dist.get_rank()
    with model_parallel() as groups:

        def run() -> list[torch.Tensor]:
            model = toy_model(num_layers=2)
            buffers = buffers_for(
                model, DistributedDataParallelConfig(), groups, calculate_per_token_loss=True
            )
            buffers.buffers[0].grad_data.fill_(2.0**rank)
            buffers.finish_grad_sync()
            return [buffers.buffers[0].grad_data]

        (result,) = with_and_without_probe(run, seed=rank)
        total = sum(2.0**r for r in range(dist.get_world_size()))
        assert torch.equal(result, torch.full_like(result, total))
        with pytest.raises(
            ValueError, match="average_in_collective=True cannot be combined with calculate_per_token_loss"
        ):
            buffers_for(
                toy_model(num_layers=2),
                DistributedDataParallelConfig(average_in_collective=True),
                groups,
                calculate_per_token_loss=True,
            )


def test_per_token_loss_sums_without_scaling() -> None:
    run_distributed(per_token_loss_sums, 4)
