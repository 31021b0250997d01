"""The hang watchdog's pause and its stream-ordered mode, on 2 gloo ranks. Paused around a long wait (a
checkpoint write on one rank), no hang is declared; the same wait unpaused is declared. In the
stream-ordered mode (NCCL's, forced here on gloo) the main thread never polls: the wait returns when the
collective completes and the heartbeat thread declares the hang, which the next wait raises."""

from __future__ import annotations

import contextlib
import time

import pytest
import torch
import torch.distributed as dist

from gradsync.buffers import (
    CollectiveHangError,
    pause_hang_watchdog,
    start_hang_watchdog,
    stop_hang_watchdog,
)
from gradsync.buffers.collectives import all_reduce
from gradsync.groups.testing import run_distributed

THRESHOLD = 1.0


def late_rank(paused: bool) -> str:
    """Rank 1 spends 3 thresholds (paused or not) before joining an all-reduce rank 0 already waits in.
    Returns what rank 0 saw: the sum, or the hang report."""
    rank = dist.get_rank()
    pair = dist.new_group([0, 1])  # own group: one left hanging must not block the harness
    guard = start_hang_watchdog(THRESHOLD)
    tensor = torch.full((4,), float(rank + 1))
    all_reduce(torch.ones(1), pair).wait()
    if rank == 1:
        with pause_hang_watchdog() if paused else contextlib.nullcontext():
            deadline = time.monotonic() + 3 * THRESHOLD
            while time.monotonic() < deadline and guard.hang is None:
                time.sleep(0.05)  # a checkpoint write, say
        late = all_reduce(tensor, pair, label="late")
        stop_hang_watchdog()  # (a declared hang would be raised by the wait on this rank too)
        late.wait()
        return "rank 1"
    time.sleep(2 * guard.interval_s)  # rank 1's pause is published
    try:
        all_reduce(tensor, pair, label="late").wait()
    except CollectiveHangError as error:
        stop_hang_watchdog()
        return str(error)
    stop_hang_watchdog()
    return f"sum {tensor.tolist()}"


@pytest.mark.parametrize("paused", [True, False])
def test_a_paused_rank_is_not_declared_hung(paused: bool) -> None:
    seen = run_distributed(late_rank, 2, args=(paused,), reuse=False, timeout=60, device="cpu")[0]
    if paused:
        assert seen == "sum [3.0, 3.0, 3.0, 3.0]"
    else:
        assert "Culprit rank(s) [1]" in seen, seen


def tracked_wait() -> tuple[bool, str]:
    """Stream-ordered mode on gloo: rank 1 launches only once a hang is declared; rank 0's wait must
    return normally (it does not poll) and the declared hang must name rank 1."""
    rank = dist.get_rank()
    pair = dist.new_group([0, 1])
    guard = start_hang_watchdog(THRESHOLD, stream_ordered=True)
    tensor = torch.ones(4)
    all_reduce(tensor, pair).wait()
    time.sleep(2 * guard.interval_s)
    if rank == 1:
        deadline = time.monotonic() + 3 * THRESHOLD + 20
        while guard.hang is None and time.monotonic() < deadline:
            time.sleep(0.05)
        held_back = all_reduce(tensor, pair, label="held back")
        stop_hang_watchdog()
        held_back.wait()
        return True, guard.hang or ""
    returned = True
    try:
        all_reduce(tensor, pair, label="held back").wait()
    except CollectiveHangError:
        returned = False
    report = guard.hang or ""
    with pytest.raises(CollectiveHangError):
        guard.raise_if_hung()  # the next wait raises it
    stop_hang_watchdog()
    return returned, report


def test_stream_ordered_waits_are_tracked_by_the_heartbeat() -> None:
    for returned, report in run_distributed(tracked_wait, 2, reuse=False, timeout=60, device="cpu"):
        assert returned
        assert "Culprit rank(s) [1]" in report, report
        assert "held back all_reduce" in report
