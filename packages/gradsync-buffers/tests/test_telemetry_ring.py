"""Telemetry at scale: totals per step count every collective, raw spans are kept in a bounded ring (the
oldest dropped and counted), and the totals equal what the raw spans add up to when nothing was dropped.
Real all-reduces on 2 gloo ranks."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from gradsync.buffers import CommTelemetry, disable_telemetry, enable_telemetry
from gradsync.buffers.collectives import all_reduce
from gradsync.groups.testing import run_distributed

STEPS, PER_STEP = 4, 3


def record_steps(max_spans: int) -> dict[str, Any]:
    recorder = enable_telemetry(CommTelemetry(max_spans=max_spans))
    try:
        for step in range(STEPS):
            for index in range(PER_STEP):
                tensor = torch.ones(16 * (index + 1)) * (dist.get_rank() + 1)
                all_reduce(tensor, dist.group.WORLD, label=f"bucket{index}").wait()  # type: ignore[arg-type]
            if step < STEPS - 1:
                recorder.next_step()
    finally:
        disable_telemetry()
    by_hand: dict[int, dict[str, dict[str, dict[str, float]]]] = {}
    for span in recorder.spans:
        entry = by_hand.setdefault(span.step, {}).setdefault(span.label, {}).setdefault(span.kind, {})
        entry["bytes"] = entry.get("bytes", 0) + span.bytes
        entry["count"] = entry.get("count", 0) + 1
        entry["seconds"] = entry.get("seconds", 0.0) + (span.seconds or 0.0)
        entry["exposed_seconds"] = entry.get("exposed_seconds", 0.0) + span.exposed_ns / 1e9
    trace = recorder.chrome_trace()
    return {
        "summary": recorder.summary(),
        "by_hand": by_hand,
        "kept": len(recorder.spans),
        "dropped": recorder.dropped_spans,
        "trace_dropped": trace["otherData"]["dropped_spans"],
    }


def test_the_ring_keeps_the_newest_spans_and_the_totals_count_all() -> None:
    for rank, run in enumerate(run_distributed(record_steps, 2, args=(5,))):
        # the last step's 3 spans are not folded yet; the ring holds the newest 5 of the first 9
        assert run["kept"] == 5 + PER_STEP
        assert run["dropped"] == (STEPS - 1) * PER_STEP - 5
        assert run["trace_dropped"] == {0: run["dropped"], 1: run["dropped"]}, rank
        summary = run["summary"]
        assert sorted(summary) == list(range(STEPS))
        for step in range(STEPS):
            assert {label: kinds["all_reduce"]["count"] for label, kinds in summary[step].items()} == {
                f"bucket{i}": 1 for i in range(PER_STEP)
            }
            assert summary[step]["bucket2"]["all_reduce"]["bytes"] == 48 * 4


def test_the_totals_equal_the_raw_spans_added_up() -> None:
    for run in run_distributed(record_steps, 2, args=(1000,)):
        assert run["dropped"] == 0
        assert run["summary"] == run["by_hand"]
