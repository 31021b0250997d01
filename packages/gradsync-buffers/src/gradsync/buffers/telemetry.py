"""Communication telemetry: what every collective sent, when it ran, and how long its caller waited.

Off by default and free when off: the collectives check one module-level reference. When on
(:func:`enable_telemetry`), every collective launched through :mod:`gradsync.buffers.collectives` (so
every DDP bucket group and every MegatronFSDP bucket, whose callers label them) becomes a
:class:`CommSpan`: its kind, label, payload bytes, launch time, completion time and exposed time (how long
``wait()`` blocked). Training code marks compute phases with :meth:`CommTelemetry.phase`; wrappers start a
new step at every ``zero_grad_buffer``.

Clocks: on the CPU, host ``perf_counter_ns`` (completion from the work's future callback, which gloo runs
when the collective finishes). On CUDA a collective runs on NCCL's stream and ``wait()`` only orders the
compute stream after it, so host times would measure nothing: there, CUDA events on the current stream
time the launch, the point the stream reached when waiting, and the point after the wait; the span is
launch to after-wait and the exposed time the stall between the last two, read when the trace or summary
is built.

:meth:`CommTelemetry.chrome_trace` gathers every rank's spans (a collective), aligns the ranks' clocks with
one barrier-based offset estimate, and returns Chrome / Perfetto trace JSON: one process per rank with a
compute track, a communication track (launch to completion) and an exposed-wait track.

At scale a run has millions of spans: each step's spans are settled and folded into per-step totals at
:meth:`CommTelemetry.next_step` (on CUDA their events are read there: one host sync per step while
telemetry is on, and no events held past a step), then kept raw in a ring of ``max_spans`` (the oldest
dropped, and counted). :meth:`CommTelemetry.summary` reads the totals, so it counts every collective; the
trace shows what the ring holds and says how many spans it dropped.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from gradsync.groups.objects import all_gather_objects

from .stats import recorded_cuda_event

TRACKS = {"compute": 0, "comm": 1, "exposed": 2}


def now_ns() -> int:
    return time.perf_counter_ns()


@dataclass
class CommSpan:
    """One collective on this rank. Times are host nanoseconds; on CUDA they are derived from events
    when :meth:`settle` runs (launch stays the host time, the rest are offsets measured on the device)."""

    kind: str
    label: str
    bytes: int
    group_size: int
    step: int
    launch_ns: int
    complete_ns: int | None = None
    wait_start_ns: int | None = None
    wait_end_ns: int | None = None
    exposed_ns: int = 0
    events: dict[str, torch.cuda.Event] = field(default_factory=dict)

    def mark_complete(self) -> None:
        if self.complete_ns is None:
            self.complete_ns = now_ns()

    def settle(self) -> None:
        """CUDA: turn the recorded events into times (synchronises with them)."""
        if "launch" not in self.events or "after_wait" not in self.events:
            return
        launch, reached, after = self.events["launch"], self.events["wait"], self.events["after_wait"]
        after.synchronize()
        to_ns = 1e6  # elapsed_time is in milliseconds
        self.wait_start_ns = self.launch_ns + int(launch.elapsed_time(reached) * to_ns)
        self.wait_end_ns = self.launch_ns + int(launch.elapsed_time(after) * to_ns)
        self.complete_ns = self.wait_end_ns
        self.exposed_ns = self.wait_end_ns - self.wait_start_ns
        self.events = {}

    @property
    def seconds(self) -> float | None:
        """Launch to completion."""
        return None if self.complete_ns is None else (self.complete_ns - self.launch_ns) / 1e9


@dataclass
class PhaseSpan:
    name: str
    step: int
    start_ns: int
    end_ns: int


Totals = dict[int, dict[str, dict[str, dict[str, float]]]]
"""Per step, per label, per collective kind: bytes, count, seconds and exposed seconds."""


class CommTelemetry:
    """The collectives and compute phases this rank ran while telemetry was on: totals per step for all of
    them, raw spans for the last ``max_spans``."""

    def __init__(self, max_spans: int = 10_000) -> None:
        if max_spans < 1:
            raise ValueError(f"CommTelemetry: max_spans={max_spans} must be at least 1")
        self.max_spans = max_spans
        self._current: list[CommSpan] = []  # this step's spans, folded into the totals at next_step()
        self._ring: deque[CommSpan] = deque(maxlen=max_spans)
        self.dropped_spans = 0
        self._totals: Totals = {}
        self.phases: deque[PhaseSpan] = deque(maxlen=max_spans)
        self.step = 0
        self._recorded = False

    @property
    def spans(self) -> list[CommSpan]:
        """The raw spans kept: earlier steps' (at most ``max_spans``), then those not folded yet."""
        return [*self._ring, *self._current]

    # --- recording (called by gradsync.buffers.collectives) ------------------------------------------
    def launched(
        self, kind: str, label: str, tensor: torch.Tensor, group: dist.ProcessGroup, works: list[Any]
    ) -> CommSpan:
        """A collective over ``group`` that sends ``tensor`` (this rank's payload) was just launched."""
        span = CommSpan(
            kind, label, tensor.numel() * tensor.element_size(), group.size(), self.step, now_ns()
        )
        if tensor.device.type == "cuda":
            span.events["launch"] = recorded_cuda_event()
        else:
            _on_completion([w for w in works if w is not None], span)
        self._current.append(span)
        self._recorded = True
        return span

    @staticmethod
    def waiting(span: CommSpan) -> None:
        if span.wait_start_ns is None:
            span.wait_start_ns = now_ns()
            if "launch" in span.events:
                span.events["wait"] = recorded_cuda_event()

    @staticmethod
    def waited(span: CommSpan, started_ns: int) -> None:
        now = now_ns()
        span.exposed_ns += now - started_ns
        span.wait_end_ns = now
        if "launch" in span.events:
            span.events["after_wait"] = recorded_cuda_event()
        else:
            span.mark_complete()  # a work without a usable future completes when waited, at the latest

    # --- marks from training code and wrappers --------------------------------------------------------
    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Record a compute phase (forward, backward, optimizer, ...) on this rank's compute track."""
        start = now_ns()
        try:
            yield
        finally:
            self.phases.append(PhaseSpan(name, self.step, start, now_ns()))
            self._recorded = True

    def next_step(self) -> None:
        """Fold this step's spans into the totals and the ring; later spans belong to the next step."""
        if not self._recorded:
            return
        # A collective still in flight (a param gather overlapped with the next forward) is folded once
        # waited, or a step later at the latest.
        done = [s for s in self._current if s.wait_end_ns is not None or s.step < self.step]
        self._current = [s for s in self._current if s.wait_end_ns is None and s.step == self.step]
        _add_up(self._totals, done)
        for span in done:
            self.dropped_spans += len(self._ring) == self.max_spans
            self._ring.append(span)
        self.step += 1

    # --- reading -------------------------------------------------------------------------------------
    def summary(self) -> Totals:
        """Per step, per label, per collective kind: bytes, count, seconds (launch to completion, summed)
        and exposed seconds (time callers waited, summed); every collective, dropped spans included."""
        result = {
            step: {
                label: {kind: dict(entry) for kind, entry in kinds.items()} for label, kinds in labels.items()
            }
            for step, labels in self._totals.items()
        }
        _add_up(result, self._current)
        return result

    def chrome_trace(self, group: dist.ProcessGroup | None = None) -> dict[str, Any]:
        """The trace of every rank of ``group`` (default: the world); a collective, call it on every rank.
        Every rank gets the whole trace."""
        spans = self.spans
        for span in spans:
            span.settle()
        dist.barrier(group)
        sync_ns = now_ns()  # every rank leaves the barrier at about the same moment
        mine = (
            dist.get_rank(),
            sync_ns,
            [_span_record(s) for s in spans],
            list(self.phases),
            self.dropped_spans,
        )
        everyone = all_gather_objects(mine, group)
        origin = min(ns for _, ns, *_ in everyone)
        events: list[dict[str, Any]] = []
        dropped = {}
        for rank, rank_sync_ns, records, phases, rank_dropped in everyone:
            dropped[rank] = rank_dropped
            shift = rank_sync_ns - origin  # this rank's clock minus the reference clock
            events += _metadata(rank)
            events += [_phase_event(p, rank, shift) for p in phases]
            for record in records:
                events += _span_events(record, rank, shift)
        return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"dropped_spans": dropped}}

    def write_chrome_trace(self, path: str | Path, group: dist.ProcessGroup | None = None) -> dict[str, Any]:
        """:meth:`chrome_trace`, written as JSON by group rank 0 (open it in ui.perfetto.dev or
        chrome://tracing)."""
        trace = self.chrome_trace(group)
        if dist.get_rank(group) == 0:
            Path(path).write_text(json.dumps(trace))
        return trace


def _add_up(totals: Totals, spans: list[CommSpan]) -> None:
    """Add ``spans`` (settled first) into ``totals``."""
    for span in spans:
        span.settle()
        entry = (
            totals.setdefault(span.step, {})
            .setdefault(span.label, {})
            .setdefault(span.kind, {"bytes": 0, "count": 0, "seconds": 0.0, "exposed_seconds": 0.0})
        )
        entry["bytes"] += span.bytes
        entry["count"] += 1
        entry["seconds"] += span.seconds or 0.0
        entry["exposed_seconds"] += span.exposed_ns / 1e9


def _on_completion(works: list[Any], span: CommSpan) -> None:
    """Timestamp the span when the last of ``works`` completes (gloo runs future callbacks, on its own
    threads, when a work finishes; an all-gather made of broadcasts has several works)."""
    futures = []
    for work in works:
        try:
            futures.append(work.get_future())
        except (AttributeError, RuntimeError):  # no future: completion is taken when waited
            return
    remaining = [len(futures)]
    lock = threading.Lock()

    def one_done(_: Any) -> None:
        with lock:
            remaining[0] -= 1
            if remaining[0] == 0:
                span.mark_complete()

    for future in futures:
        future.then(one_done)


def _span_record(span: CommSpan) -> dict[str, Any]:
    return {
        "kind": span.kind,
        "label": span.label,
        "bytes": span.bytes,
        "group_size": span.group_size,
        "step": span.step,
        "launch": span.launch_ns,
        "complete": span.complete_ns,
        "wait_start": span.wait_start_ns,
        "wait_end": span.wait_end_ns,
        "exposed": span.exposed_ns,
    }


def _us(ns: int, shift: int) -> float:
    return (ns - shift) / 1e3


def _metadata(rank: int) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = [
        {"ph": "M", "name": "process_name", "pid": rank, "args": {"name": f"rank {rank}"}},
        {"ph": "M", "name": "process_sort_index", "pid": rank, "args": {"sort_index": rank}},
    ]
    for track, tid in TRACKS.items():
        events.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": tid, "args": {"name": track}})
    return events


def _phase_event(phase: PhaseSpan, rank: int, shift: int) -> dict[str, Any]:
    return {
        "ph": "X",
        "name": phase.name,
        "cat": "compute",
        "pid": rank,
        "tid": TRACKS["compute"],
        "ts": _us(phase.start_ns, shift),
        "dur": (phase.end_ns - phase.start_ns) / 1e3,
        "args": {"step": phase.step},
    }


def _span_events(record: dict[str, Any], rank: int, shift: int) -> list[dict[str, Any]]:
    name = f"{record['label']} {record['kind']}".strip()
    args = {k: record[k] for k in ("bytes", "group_size", "step", "label", "kind")}
    end = record["complete"] if record["complete"] is not None else record["wait_end"]
    events = []
    if end is not None:
        events.append(
            {
                "ph": "X",
                "name": name,
                "cat": "comm",
                "pid": rank,
                "tid": TRACKS["comm"],
                "ts": _us(record["launch"], shift),
                "dur": (end - record["launch"]) / 1e3,
                "args": args,
            }
        )
    if record["wait_start"] is not None and record["wait_end"] is not None:
        events.append(
            {
                "ph": "X",
                "name": f"wait {name}",
                "cat": "exposed",
                "pid": rank,
                "tid": TRACKS["exposed"],
                "ts": _us(record["wait_start"], shift),
                "dur": (record["wait_end"] - record["wait_start"]) / 1e3,
                "args": {**args, "exposed_us": record["exposed"] / 1e3},
            }
        )
    return events


class _Switch:
    """The process's active recorder (one per rank), None while telemetry is off."""

    recorder: CommTelemetry | None = None


_switch = _Switch()


def active_telemetry() -> CommTelemetry | None:
    """The recorder collectives report to, or None (telemetry off)."""
    return _switch.recorder


def enable_telemetry(recorder: CommTelemetry | None = None) -> CommTelemetry:
    """Start recording on this rank, into ``recorder`` (default: a fresh one); returns it."""
    _switch.recorder = recorder if recorder is not None else CommTelemetry()
    return _switch.recorder


def disable_telemetry() -> CommTelemetry | None:
    """Stop recording; returns the recorder that was active."""
    recorder, _switch.recorder = _switch.recorder, None
    return recorder


def next_step() -> None:
    """Start a new step in the active recorder (wrappers call it at every ``zero_grad_buffer``)."""
    if _switch.recorder is not None:
        _switch.recorder.next_step()


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """:meth:`CommTelemetry.phase` on the active recorder; nothing when telemetry is off."""
    recorder = _switch.recorder
    if recorder is None:
        yield
        return
    with recorder.phase(name):
        yield
