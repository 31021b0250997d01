"""Parity: DDP on 2 and 4 gloo ranks with different data per rank trains exactly like one process on
the concatenated global batch (fp32: max relative param difference <= 1e-6), for every combination of
the sync options, with SGD-momentum and Adam."""

from __future__ import annotations

import functools
import itertools

import pytest
import torch
import torch.distributed as dist
from ddp_testkit import Trainer, max_relative_difference, reference_training

from gradsync.buffers import DistributedDataParallelConfig
from gradsync.groups.testing import run_distributed

STEPS = 20
BUCKET_SIZE = 600  # several buckets for a ~5k-param model


def train_and_check_replicas(config_kwargs: dict[str, bool], optimizer: str, micro: int) -> torch.Tensor:
    rank, world = dist.get_rank(), dist.get_world_size()
    config = DistributedDataParallelConfig(bucket_size=BUCKET_SIZE, **config_kwargs)
    trainer = Trainer.build(config, optimizer)
    if config.overlap_grad_reduce:
        assert len(trainer.ddp.bucket_groups) > 1
    for step in range(STEPS):
        trainer.step(step, rank, world, micro)
        params = trainer.full_params()
        replicas = [torch.empty_like(params) for _ in range(world)]
        dist.all_gather(replicas, params)
        assert all(torch.equal(r, params) for r in replicas), f"replicas differ after step {step}"
    return trainer.full_params()


@functools.cache
def reference(optimizer: str, world: int, micro: int) -> torch.Tensor:
    return reference_training(optimizer, world, micro, STEPS)


SYNC_OPTIONS = [
    {"overlap_grad_reduce": overlap, "use_distributed_optimizer": distopt, "overlap_param_gather": gather}
    for overlap, distopt, gather in itertools.product([False, True], repeat=3)
    if distopt or not gather
]
# grad_reduce_in_fp32 changes nothing on an fp32 model: test_mixed_precision covers it on a bf16 one.
GRID = [
    (world, optimizer, {**sync, "average_in_collective": avg}, micro)
    for world, optimizer, sync, avg, micro in itertools.product(
        [2, 4], ["sgd", "adam"], SYNC_OPTIONS, [False, True], [1, 4]
    )
]


def grid_id(case: tuple[int, str, dict[str, bool], int]) -> str:
    world, optimizer, kwargs, micro = case
    flags = "-".join(k for k, v in kwargs.items() if v) or "plain"
    return f"w{world}-{optimizer}-{flags}-micro{micro}"


@pytest.mark.parametrize("case", GRID, ids=[grid_id(c) for c in GRID])
def test_matches_single_process_training(case: tuple[int, str, dict[str, bool], int]) -> None:
    world, optimizer, kwargs, micro = case
    results = run_distributed(train_and_check_replicas, world, args=(kwargs, optimizer, micro))
    difference = max_relative_difference(results[0], reference(optimizer, world, micro))
    assert difference <= 1e-6, difference


def test_aligned_param_gather_matches_single_process_training() -> None:
    """align_param_gather: every group's gather is dispatched at the end of the step; pre-hooks only wait."""
    kwargs = {
        "overlap_grad_reduce": True,
        "use_distributed_optimizer": True,
        "overlap_param_gather": True,
        "align_param_gather": True,
    }
    results = run_distributed(train_and_check_replicas, 2, args=(kwargs, "adam", 1))
    assert max_relative_difference(results[0], reference("adam", 2, 1)) <= 1e-6
