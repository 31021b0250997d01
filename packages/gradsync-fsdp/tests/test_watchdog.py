"""The hang watchdog joins MegatronFSDP through the same collectives: under ZeRO-3, one rank that skips its
backward leaves the other waiting in a gather or reduction, and the report names it and the FSDP bucket."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from fsdp_testkit import Block, TinyTransformer, local_microbatches

from gradsync.buffers import (
    CollectiveHangError,
    DistributedDataParallelConfig,
    collectives,
    start_hang_watchdog,
    stop_hang_watchdog,
)
from gradsync.fsdp import MegatronFSDP
from gradsync.groups import FSDPDistributedIndex
from gradsync.groups.testing import run_distributed, test_device

THRESHOLD = 2.0


def skipped_backward() -> str:
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.new_group()  # the hanging collective must not block the harness's own barrier
    config = DistributedDataParallelConfig(
        use_megatron_fsdp=True, data_parallel_sharding_strategy="optim_grads_params"
    )
    model = MegatronFSDP(
        TinyTransformer(),
        FSDPDistributedIndex.from_group(group, device_type=test_device().type),
        config,
        fsdp_unit_modules=[Block],
    )
    guard = start_hang_watchdog(THRESHOLD, models=[model])
    time.sleep(3 * guard.interval_s)
    (batch,) = local_microbatches(0, rank, world, 1)
    loss = model(batch)
    if rank == 1:
        deadline = time.monotonic() + THRESHOLD + 20
        while guard.hang is None and time.monotonic() < deadline:
            time.sleep(0.05)
        stop_hang_watchdog()
        return guard.hang or ""
    try:
        loss.backward()
        model.finish_grad_sync()
    except CollectiveHangError as error:
        stop_hang_watchdog()
        return str(error)
    raise AssertionError("rank 0 finished a step rank 1 never took part in")


def test_a_skipped_backward_is_named_with_its_fsdp_bucket() -> None:
    report, seen = run_distributed(skipped_backward, 2, reuse=False, timeout=90)
    assert "Culprit rank(s) [1]" in report
    assert "fsdp.bucket" in report
    assert seen == report


def healthy_steps(strategy: str, path: collectives.ReduceScatterPath | None) -> tuple[str, float]:
    """Two ordinary steps with the watchdog on: no rank hangs, so nothing may be reported (gloo's native
    reduce-scatter work never reports itself complete; a wait that polled it was declared hung). ``path``:
    the reduce-scatter path to take (None: the backend's choice; gloo's CPU tensors go through an
    all-to-all)."""
    chosen = collectives.reduce_scatter_path

    def forced(group: dist.ProcessGroup, device: torch.device) -> collectives.ReduceScatterPath:
        return chosen(group, device) if path is None else path

    collectives.reduce_scatter_path = forced
    try:
        return _healthy_steps(strategy)
    finally:
        collectives.reduce_scatter_path = chosen


def _healthy_steps(strategy: str) -> tuple[str, float]:
    rank, world = dist.get_rank(), dist.get_world_size()
    config = DistributedDataParallelConfig(use_megatron_fsdp=True, data_parallel_sharding_strategy=strategy)
    model = MegatronFSDP(
        TinyTransformer(),
        FSDPDistributedIndex.from_group(dist.new_group(), device_type=test_device().type),
        config,
        fsdp_unit_modules=[Block],
    )
    start_hang_watchdog(1.0, models=[model])
    started = time.monotonic()
    try:
        for step in range(2):
            model.zero_grad_buffer()
            (batch,) = local_microbatches(step, rank, world, 1)
            model(batch).backward()
            model.finish_grad_sync()
            model.install_optimized_model_weights()
    except CollectiveHangError as error:
        return str(error), time.monotonic() - started
    finally:
        stop_hang_watchdog()
    return "", time.monotonic() - started


@pytest.mark.parametrize("path", [None, "native"])
def test_healthy_steps_raise_nothing(path: collectives.ReduceScatterPath | None) -> None:
    for strategy in ("optim", "optim_grads", "optim_grads_params"):
        for report, _ in run_distributed(healthy_steps, 2, args=(strategy, path), reuse=False, timeout=90):
            assert report == "", report
