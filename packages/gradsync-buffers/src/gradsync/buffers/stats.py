"""What a bucket group sent in the current step: cheap records upper layers can expose as telemetry.

On CUDA a collective completes on a device stream long after the host call returns, and ``wait()`` only
orders the streams, so host timestamps would measure nothing: there, each record times itself with CUDA
events recorded on the current stream at launch and after the wait. On the CPU the host clock is right.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch


@dataclass
class CollectiveRecord:
    """One collective: its op, payload bytes (this rank's input), group size, and launch-to-completion span.

    ``start``/``end`` are host ``perf_counter`` readings; on CUDA, ``start_event``/``end_event`` time the
    collective on the device and :attr:`seconds` reads them.
    """

    op: str
    bytes: int
    group_size: int
    start: float
    end: float | None = None
    start_event: torch.cuda.Event | None = None
    end_event: torch.cuda.Event | None = None

    @property
    def seconds(self) -> float | None:
        if self.end is None:
            return None
        if self.start_event is not None and self.end_event is not None:
            self.end_event.synchronize()
            return float(self.start_event.elapsed_time(self.end_event)) / 1000.0
        return self.end - self.start


def recorded_cuda_event() -> torch.cuda.Event:
    """A timing event recorded now on the current CUDA stream."""
    event = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    event.record()
    return event


@dataclass
class CommStats:
    """Per-step list of collective records; ``reset`` at every zero_grad_buffer."""

    records: list[CollectiveRecord] = field(default_factory=list)

    def begin(
        self, op: str, nbytes: int, group_size: int, device: torch.device | None = None
    ) -> CollectiveRecord:
        on_cuda = device is not None and device.type == "cuda"
        start_event = recorded_cuda_event() if on_cuda else None
        record = CollectiveRecord(op, nbytes, group_size, time.perf_counter(), start_event=start_event)
        self.records.append(record)
        return record

    @staticmethod
    def end(records: list[CollectiveRecord]) -> None:
        now = time.perf_counter()
        for record in records:
            if record.end is None:
                record.end = now
                if record.start_event is not None:
                    record.end_event = recorded_cuda_event()

    @property
    def total_bytes(self) -> int:
        return sum(r.bytes for r in self.records)

    def reset(self) -> None:
        self.records.clear()
