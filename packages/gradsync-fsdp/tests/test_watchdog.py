"""The hang watchdog joins MegatronFSDP through the same collectives: under ZeRO-3, one rank that skips its
backward leaves the other waiting in a gather or reduction, and the report names it and the FSDP bucket."""

from __future__ import annotations

import time

import torch.distributed as dist
from fsdp_testkit import Block, TinyTransformer, local_microbatches

from gradsync.buffers import (
    CollectiveHangError,
    DistributedDataParallelConfig,
    start_hang_watchdog,
    stop_hang_watchdog,
)
from gradsync.fsdp import MegatronFSDP
from gradsync.groups import FSDPDistributedIndex
from gradsync.groups.testing import run_distributed

THRESHOLD = 2.0


def skipped_backward() -> str:
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.new_group()  # the hanging collective must not block the harness's own barrier
    config = DistributedDataParallelConfig(
        use_megatron_fsdp=True, data_parallel_sharding_strategy="optim_grads_params"
    )
    model = MegatronFSDP(
        TinyTransformer(), FSDPDistributedIndex.from_group(group), config, fsdp_unit_modules=[Block]
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
