"""Dropping a group while its gloo worker still holds a finished collective's tensor must not hang.

The deadlock needs a worker that frees, after the group's object has started dying, a tensor whose Python
object died first: rank 0 queues an all-reduce, drops its tensor and the group at once, and rank 1 joins
the all-reduce only later, so rank 0's worker finishes it while the group's destructor waits for the
worker. On torch < 2.8 an unguarded group deadlocks here every time (the harness's timeout fails the test).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from gradsync.groups import guard_group_teardown
from gradsync.groups.testing import run_distributed, test_device

LATE_JOIN_S = 0.5


def drop_group_with_collective_in_flight() -> float:
    group = dist.new_group([0, 1])
    guard_group_teardown(group)
    tensor = torch.full((4,), float(dist.get_rank() + 1), device=test_device())
    if dist.get_rank() == 0:
        dist.all_reduce(tensor, group=group, async_op=True)
        del tensor  # only the queued work holds it now
        dist.destroy_process_group(group)
        del group  # waits for the worker, which finishes once rank 1 joins
        dist.barrier()
        return 3.0
    time.sleep(LATE_JOIN_S)
    dist.all_reduce(tensor, group=group)
    result = float(tensor[0].item())
    dist.destroy_process_group(group)
    del group
    dist.barrier()
    return result


def test_dropping_a_group_with_a_collective_in_flight_does_not_hang() -> None:
    assert run_distributed(drop_group_with_collective_in_flight, 2, timeout=60) == [3.0, 3.0]
