"""The hang watchdog counts launches per process group, so with more than two ranks it names exactly the
rank that lags, not every other rank. Three ranks: ranks 0 and 1 also talk over a group of their own
(so a count over every group would differ from the count over the world group), then all three
all-reduce once over the world group, then ranks 0 and 1 launch a second one that rank 2 holds back
until the report is out."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from gradsync.buffers import CollectiveHangError, start_hang_watchdog, stop_hang_watchdog
from gradsync.buffers.collectives import all_reduce
from gradsync.groups.testing import run_distributed

THRESHOLD = 1.5


def one_rank_lags() -> str:
    rank = dist.get_rank()
    trio = dist.new_group([0, 1, 2])  # own groups: the one left hanging must not block the harness
    pair = dist.new_group([0, 1])
    guard = start_hang_watchdog(THRESHOLD)
    tensor = torch.ones(4)
    if rank < 2:
        for _ in range(3):
            all_reduce(tensor, pair, label="pair").wait()
    all_reduce(tensor, trio, label="healthy").wait()
    time.sleep(3 * guard.interval_s)  # a few heartbeats, so every rank's progress is known
    if rank == 2:  # the lagging rank: it launches its second all-reduce only once the hang is reported
        deadline = time.monotonic() + THRESHOLD + 20
        while guard.hang is None and time.monotonic() < deadline:
            time.sleep(0.05)
        report = guard.hang or ""
        late = all_reduce(tensor, trio, label="stuck")
        stop_hang_watchdog()
        late.wait()  # the others' works complete too
        return report
    try:
        all_reduce(tensor, trio, label="stuck").wait()
    except CollectiveHangError as error:
        stop_hang_watchdog()
        return str(error)
    raise AssertionError(f"rank {rank} finished an all-reduce rank 2 never launched")


def test_the_watchdog_names_only_the_rank_that_lags() -> None:
    reports = run_distributed(one_rank_lags, 3, reuse=False, timeout=90, device="cpu")
    for report in reports[:2]:
        assert "Culprit rank(s) [2]: they have not launched it (last launched: rank 2 #1)" in report, report
        assert "stuck all_reduce" in report
        assert "collective #2" in report
    assert reports[2] in reports[:2]  # the lagging rank learned one of the reports over the side group
