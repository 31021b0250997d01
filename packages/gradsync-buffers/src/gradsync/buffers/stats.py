"""What a bucket group sent in the current step: cheap records upper layers can expose as telemetry."""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class CollectiveRecord:
    """One collective: its op, payload bytes (this rank's input), group size, and wall-clock span."""

    op: str
    bytes: int
    group_size: int
    start: float
    end: float | None = None

    @property
    def seconds(self) -> float | None:
        return None if self.end is None else self.end - self.start


@dataclass
class CommStats:
    """Per-step list of collective records; ``reset`` at every zero_grad_buffer."""

    records: list[CollectiveRecord] = field(default_factory=list)

    def begin(self, op: str, nbytes: int, group_size: int) -> CollectiveRecord:
        record = CollectiveRecord(op, nbytes, group_size, time.perf_counter())
        self.records.append(record)
        return record

    @staticmethod
    def end(records: list[CollectiveRecord]) -> None:
        now = time.perf_counter()
        for record in records:
            if record.end is None:
                record.end = now

    @property
    def total_bytes(self) -> int:
        return sum(r.bytes for r in self.records)

    def reset(self) -> None:
        self.records.clear()
