"""The hang watchdog on 2 gloo ranks: three ways one rank leaves the other waiting in a grad reduction, each
reported on the waiting rank within the threshold plus a few seconds, naming the culprit rank, the
bucket group and (where the culprit knows) the params it is missing; every run is bounded by a timeout.
(A rank that skips its backward leaves nobody waiting: test_rank_agreement shows every rank raising.)"""

from __future__ import annotations

import os
import re
import signal
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
from ddp_testkit import TinyGPT, Trainer, local_microbatches, make_optimizer

from gradsync.buffers import (
    CollectiveHangError,
    DistributedDataParallelConfig,
    start_hang_watchdog,
    stop_hang_watchdog,
)
from gradsync.ddp import DistributedDataParallel, DistributedOptimizer
from gradsync.groups import ModelParallelConfig, initialize_model_parallel
from gradsync.groups.testing import run_distributed

THRESHOLD = 2.0
SLACK = 4.0  # seconds past the threshold within which the report must come


def wait_for_report(guard: Any) -> str | None:
    deadline = time.monotonic() + THRESHOLD + 20
    while guard.hang is None and time.monotonic() < deadline:
        time.sleep(0.05)
    return guard.hang  # type: ignore[no-any-return]


def scenario(kind: str) -> tuple[str, float | None]:
    """One healthy step, then step 1 where rank 1 misbehaves as ``kind`` says. Rank 0 returns the hang
    report and how long it waited; rank 1 what it saw."""
    rank, world = dist.get_rank(), dist.get_world_size()
    overlap = kind != "no_finish_grad_sync"
    # Groups of their own: the reduction left hanging must not block the harness's barrier afterwards.
    groups = initialize_model_parallel()
    model = TinyGPT()
    config = DistributedDataParallelConfig(overlap_grad_reduce=overlap)
    ddp = DistributedDataParallel(ModelParallelConfig(), config, model, pg_collection=groups)
    trainer = Trainer(model, ddp, make_optimizer("adam", ddp.parameters()))
    trainer.step(0, rank, world, 1)
    guard = start_hang_watchdog(THRESHOLD, models=[trainer.ddp])
    pids: list[Any] = [None] * world
    dist.all_gather_object(pids, os.getpid())
    time.sleep(3 * guard.interval_s)  # a few heartbeats, so every rank's progress is known
    ddp.zero_grad_buffer()
    (batch,) = local_microbatches(1, rank, world, 1)
    if rank == 0:
        ddp(batch).backward()
        started = time.monotonic()
        try:
            ddp.finish_grad_sync()
        except CollectiveHangError as error:
            waited = time.monotonic() - started
            if kind == "sigstop":
                os.kill(pids[1], signal.SIGCONT)
            stop_hang_watchdog()
            return str(error), waited
        raise AssertionError("finish_grad_sync returned although rank 1 never joined")
    seen = ""
    if kind == "unused_param":
        trainer.model.ln_f.forward = lambda x: x  # type: ignore[method-assign]
        ddp(batch).backward()
    elif kind == "sigstop":
        os.kill(os.getpid(), signal.SIGSTOP)  # rank 0 sends SIGCONT once it has reported
        ddp(batch).backward()
        ddp.finish_grad_sync()  # joins the reduction rank 0 left in flight
        stop_hang_watchdog()
        return "resumed", None
    else:  # no_finish_grad_sync
        ddp(batch).backward()
    if kind != "no_finish_grad_sync":
        try:
            ddp.finish_grad_sync()
        except RuntimeError as error:  # this rank's own check: no reduction was launched
            seen = str(error)
    report = wait_for_report(guard)
    stop_hang_watchdog()
    return f"{seen} | {report}", None


EXPECTED = {
    "no_finish_grad_sync": ["Culprit rank(s) [1]", "bucket_group0: reduction not started"],
    "unused_param": ["Culprit rank(s) [1]", "no grad yet for ln_f.bias, ln_f.weight"],
    "sigstop": ["Culprit rank(s) [1]", "side group has been silent"],
}


@pytest.mark.parametrize("kind", list(EXPECTED))
def test_the_waiting_rank_names_the_culprit(kind: str) -> None:
    (report, waited), (culprit_saw, _) = run_distributed(scenario, 2, args=(kind,), reuse=False, timeout=90)
    assert waited is not None
    assert THRESHOLD <= waited <= THRESHOLD + SLACK, waited
    assert "collective #" in report
    for expected in EXPECTED[kind]:
        assert expected in report, report
    if kind != "sigstop":  # the culprit learned the report over the side group
        assert report in culprit_saw
    if kind == "unused_param":  # and raised its own error naming what it misses
        assert "Communication call has not been issued" in culprit_saw


def forward_alone() -> str:
    """After a distributed-optimizer step with overlapped param gathers, rank 0 alone runs an evaluation
    forward: its pre-hooks wait for each bucket group's gather and start the next one's, which rank 1 never
    starts. What rank 0 raised."""
    rank, world = dist.get_rank(), dist.get_world_size()
    groups = initialize_model_parallel()  # the gather left hanging must not block the harness's barrier
    model = TinyGPT()
    config = DistributedDataParallelConfig(
        use_distributed_optimizer=True, overlap_grad_reduce=True, overlap_param_gather=True, bucket_size=4000
    )
    ddp = DistributedDataParallel(ModelParallelConfig(), config, model, pg_collection=groups)
    trainer = Trainer(model, ddp, DistributedOptimizer(make_optimizer("adam", ddp.parameters()), ddp))
    trainer.step(0, rank, world, 1)
    guard = start_hang_watchdog(THRESHOLD, models=[ddp])
    time.sleep(3 * guard.interval_s)
    if rank == 1:
        wait_for_report(guard)
        stop_hang_watchdog()
        return ""
    try:
        ddp.eval()
        with torch.no_grad():
            ddp(local_microbatches(1, rank, world, 1)[0])
    except CollectiveHangError as error:
        return str(error)
    finally:
        stop_hang_watchdog()
    raise AssertionError("an evaluation forward on rank 0 alone returned")


def test_a_forward_on_one_rank_names_the_param_gather_and_the_missing_rank() -> None:
    report, _ = run_distributed(forward_alone, 2, reuse=False, timeout=90)
    assert re.search(r"in collective #\d+ \(\S+ all_gather\)", report), report
    assert "Culprit rank(s) [1]: they have not launched it" in report, report
