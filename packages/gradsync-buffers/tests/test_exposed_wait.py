"""Telemetry's exposed time is the time a caller really waited: with one rank launching a collective late,
the rank that launched on time waits at least until then, and its record says so; the late rank, whose
peer is already there, waits next to nothing. Times are taken on the CPU (host clocks), where a
collective's wait blocks the caller; CLOCK_MONOTONIC, which ``perf_counter_ns`` reads, is one clock for
every process on the machine, so the ranks' stamps compare."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from gradsync.buffers import disable_telemetry, enable_telemetry
from gradsync.buffers.collectives import all_reduce
from gradsync.groups.testing import run_distributed

DELAY_S = 0.4


def late_launch(delay_s: float) -> dict[str, int]:
    """Rank 1 enters the all-reduce ``delay_s`` after the barrier, rank 0 at once. Returns this rank's
    exposed time, its wait's start and end (ns), and (rank 1) the moment just before it launched, from which no
    rank's all-reduce can have completed earlier."""
    rank = dist.get_rank()
    tensor = torch.full((8,), float(rank + 1))
    world = dist.group.WORLD
    assert world is not None
    recorder = enable_telemetry()
    try:
        dist.barrier()
        if rank == 1:
            time.sleep(delay_s)
        entered = time.perf_counter_ns()
        all_reduce(tensor, world, label="late").wait()
    finally:
        disable_telemetry()
    assert torch.equal(tensor, torch.full((8,), 3.0))  # the all-reduce really ran
    (span,) = recorder.spans
    assert span.wait_start_ns is not None
    assert span.wait_end_ns is not None
    summary = recorder.summary()[0]["late"]["all_reduce"]
    assert summary["exposed_seconds"] == span.exposed_ns / 1e9
    return {
        "exposed": span.exposed_ns,
        "wait_start": span.wait_start_ns,
        "wait_end": span.wait_end_ns,
        "entered": entered,
    }


def test_a_wait_for_a_late_rank_is_exposed_time() -> None:
    on_time, late = run_distributed(late_launch, 2, args=(DELAY_S,), device="cpu")
    # Rank 0's wait cannot end before rank 1 entered the collective: what lies between its wait's start
    # and that moment is exposed for sure, and the delay makes it most of DELAY_S.
    sure = late["entered"] - on_time["wait_start"]
    assert sure > DELAY_S / 2 * 1e9, (on_time, late)
    assert on_time["wait_end"] >= late["entered"]
    # exposed counts from just after the wait's start stamp: a millisecond covers the stamps between
    assert sure - 1_000_000 <= on_time["exposed"] <= on_time["wait_end"] - on_time["wait_start"]
    assert late["exposed"] < DELAY_S / 4 * 1e9  # the late rank found its peer waiting
