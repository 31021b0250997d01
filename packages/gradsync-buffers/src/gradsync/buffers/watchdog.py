"""A hang watchdog: a collective that waits past a threshold raises, naming the ranks it waits for and the
bucket groups and params those ranks are missing, instead of hanging silently.

Off by default. :func:`start_hang_watchdog` (a collective: every rank calls it, after wrapping) creates a
side gloo group with a short timeout and a thread on each rank that, every ``threshold / 4`` seconds,
all-gathers every rank's progress over it: per process group, how many collectives the rank has launched
through :mod:`gradsync.buffers.collectives` (a group is known by its ranks and its ``group_name``, unique
and the same on all of them, so two groups over the same ranks, such as FSDP's shard group and its gather
lane, are counted apart); the collective its main thread is waiting in, if any; what its wrappers still
wait for (bucket groups whose grads have not all arrived, by param name, or whose reduction has not been
started). While the watchdog runs, ``wait()`` polls its works instead of blocking in them; once one has waited
``threshold`` seconds, the rank compares its own sequence number in that process group with the others'
and raises :class:`CollectiveHangError` naming the ranks that have not launched the collective (from the
last round they answered) and what they are missing. The error is published in the next round, and every
rank raises it at its next collective wait, so no rank that can still raise is left hanging.

The side group is itself guarded: each round has a timeout, a round that fails (a rank stopped, killed
or exited) ends the heartbeats, and the last complete round is what the diagnosis uses; the error then
also says how long the side group has been silent. Heartbeats stop together: a thread leaves only after
a round in which every rank asked to stop.

Where ``wait()`` only orders the device stream (NCCL: polling ``is_completed()`` from the main thread would
make the host wait for the GPU), waits stay stream-ordered: the work is handed to the heartbeat thread,
which polls the outstanding works each round and declares the hang; the main thread raises it at its next
collective wait. ``paused()`` (or :func:`pause_hang_watchdog`) covers a legitimately long wait, such as a
checkpoint write on some ranks: no rank declares a hang while it, or a rank its collective waits for, is
paused, and the clocks of waits in progress restart when the pause ends.
"""

from __future__ import annotations

import atexit
import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist

from gradsync.groups import get_backend_capabilities, guard_group_teardown
from gradsync.groups.objects import all_gather_objects

_MAX_NAMES = 8  # params named per bucket group in a message

GroupKey = tuple[tuple[int, ...], str]
"""A process group as each of its ranks names it: its global ranks and its ``group_name``."""


def _waited_in_thread(work: Any) -> Any:
    """Wait for ``work`` in a thread of its own; the returned function says whether it is over (and
    raises what the wait raised). Polling ``is_completed()`` instead is not enough: some works never
    report completion (gloo's ``reduce_scatter_tensor``, whose work has no future), so every step would
    be declared hung. The thread is the work's only waiter."""
    failure: list[BaseException] = []

    def wait() -> None:
        try:
            work.wait()
        except BaseException as error:  # handed to the polling thread
            failure.append(error)

    thread = threading.Thread(target=wait, name="gradsync-watchdog-wait", daemon=True)
    thread.start()

    def done() -> bool:
        if thread.is_alive():
            return False
        if failure:
            raise failure[0]
        return True

    return done


class CollectiveHangError(RuntimeError):
    """A collective waited past the watchdog's threshold."""


class HasPendingGrads(Protocol):
    def pending_grads(self) -> dict[str, str]:
        """Per bucket-group label, what it still waits for this step (absent when nothing)."""
        ...


@dataclass
class _Waiting:
    group: GroupKey
    sequence: int
    label: str
    kind: str
    since: float
    work: Any = None  # a work the heartbeat thread tracks (stream-ordered waits)


@dataclass
class Progress:
    """One rank's state as published in a heartbeat round."""

    rank: int
    launched: dict[GroupKey, int]
    waiting: tuple[GroupKey, int, str, str, float] | None
    pending: dict[str, str]
    hang: str | None
    stopping: bool
    paused: bool = False
    time: float = field(default_factory=time.monotonic)


class HangWatchdog:
    """This rank's counters, its heartbeat thread and the diagnosis (see the module docstring)."""

    def __init__(
        self,
        threshold_s: float,
        sources: list[HasPendingGrads],
        side_group: dist.ProcessGroup,
        stream_ordered: bool | None = None,
    ) -> None:
        """``stream_ordered``: track every wait in the heartbeat thread (True) or poll it (False); None
        decides per collective from its group's backend and device."""
        self.threshold_s = threshold_s
        self.interval_s = max(threshold_s / 4, 0.05)
        self.sources = sources
        self.side_group = side_group
        self.rank = dist.get_rank()
        self.launched: dict[GroupKey, int] = {}
        self.waiting: _Waiting | None = None
        self.hang: str | None = None
        self.peers: dict[int, Progress] = {}
        self.last_round = time.monotonic()
        self.side_error: str | None = None
        self._stopping = False
        self.stream_ordered = stream_ordered
        self.tracked: list[_Waiting] = []  # stream-ordered waits not yet complete
        self._paused = 0
        self._keys: dict[dist.ProcessGroup, GroupKey] = {}
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._heartbeats, name="gradsync-hang-watchdog", daemon=True)
        self._thread.start()

    # --- called by the collectives -------------------------------------------------------------------
    def launched_on(self, group: dist.ProcessGroup, device: torch.device) -> tuple[GroupKey, int, bool]:
        """Count one collective launched over ``group``; returns (the group's key, its sequence number,
        whether its wait is stream-ordered and so tracked by the heartbeat thread)."""
        key = self._keys.get(group)
        if key is None:
            key = self._keys[group] = (tuple(dist.get_process_group_ranks(group)), group.group_name)
        tracked = self.stream_ordered
        if tracked is None:
            tracked = get_backend_capabilities(group, device).stream_ordered_wait
        with self._lock:
            self.launched[key] = self.launched.get(key, 0) + 1
            return key, self.launched[key], tracked

    def wait(self, work: Any, group: GroupKey, sequence: int, tracked: bool, label: str, kind: str) -> None:
        """Wait for ``work``: stream-ordered and handed to the heartbeat thread (``tracked``), or by
        polling, raising once it has taken longer than the threshold (pauses excepted)."""
        self.raise_if_hung()
        if not hasattr(work, "is_completed"):
            work.wait()
            return
        if tracked:
            with self._lock:
                self.tracked.append(_Waiting(group, sequence, label, kind, time.monotonic(), work))
            work.wait()
            return
        if work.is_completed():
            work.wait()
            return
        done = _waited_in_thread(work)
        started = time.monotonic()
        self.waiting = _Waiting(group, sequence, label, kind, started)
        pause = 1e-4
        try:
            while not done():
                self.raise_if_hung()
                if self._paused_for(group):
                    started = time.monotonic()  # the clock restarts once the pause ends
                elif time.monotonic() - started > self.threshold_s:
                    self.hang = self._diagnose(group, sequence, label, kind, time.monotonic() - started)
                    raise CollectiveHangError(self.hang)
                time.sleep(pause)
                pause = min(pause * 2, 1e-3)  # at most a millisecond late
        finally:
            self.waiting = None

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """No hang is declared by or about this rank while inside (a checkpoint write, say); waits in
        progress anywhere restart their clocks afterwards. Nests."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    def _paused_for(self, group: GroupKey) -> bool:
        """This rank, or one of ``group``'s ranks as of its last heartbeat, is paused."""
        peers = self.peers
        return self._paused > 0 or any(peers[r].paused for r in group[0] if r in peers)

    def _check_tracked(self) -> None:
        """Heartbeat thread: drop completed tracked works, declare the hang of one past the threshold."""
        now = time.monotonic()
        with self._lock:
            self.tracked = [w for w in self.tracked if not w.work.is_completed()]
            outstanding = list(self.tracked)
        for waiting in outstanding:
            if self._paused_for(waiting.group):
                waiting.since = now
            elif now - waiting.since > self.threshold_s and self.hang is None:
                self.hang = self._diagnose(
                    waiting.group, waiting.sequence, waiting.label, waiting.kind, now - waiting.since
                )

    def raise_if_hung(self) -> None:
        """Raise the hang some rank (this one included) has declared."""
        if self.hang is not None:
            raise CollectiveHangError(self.hang)

    # --- the side channel ----------------------------------------------------------------------------
    def _progress(self) -> Progress:
        with self._lock:
            oldest = self.tracked[0] if self.tracked else None
        waiting = self.waiting or oldest
        pending: dict[str, str] = {}
        for source in self.sources:
            pending.update(source.pending_grads())
        with self._lock:
            launched = dict(self.launched)
        state = None
        if waiting is not None:
            state = (waiting.group, waiting.sequence, waiting.label, waiting.kind, waiting.since)
        return Progress(self.rank, launched, state, pending, self.hang, self._stopping, self._paused > 0)

    def _heartbeats(self) -> None:
        while True:
            time.sleep(self.interval_s)
            try:
                everyone = all_gather_objects(self._progress(), self.side_group)
            # a rank stopped, died or left (RuntimeError), or the group was destroyed under us (ValueError):
            # the side group is done
            except (RuntimeError, ValueError) as error:
                self.side_error = str(error).splitlines()[0][:200]
                return
            self.peers = {p.rank: p for p in everyone}
            self.last_round = time.monotonic()
            self._check_tracked()
            declared = next((p.hang for p in everyone if p.hang), None)
            if declared and self.hang is None:
                self.hang = declared
            if all(p.stopping for p in everyone):
                return

    def stop(self) -> None:
        """Stop the heartbeats on every rank together (a collective); waits at most a few rounds."""
        self._stopping = True
        self._thread.join(timeout=self.interval_s * 4 + 10)

    # --- the diagnosis -------------------------------------------------------------------------------
    def _diagnose(self, group: GroupKey, sequence: int, label: str, kind: str, waited: float) -> str:
        peers = dict(self.peers)
        ranks = group[0]
        others = [r for r in ranks if r != self.rank]
        behind = [r for r in others if r in peers and peers[r].launched.get(group, 0) < sequence]
        unknown = [r for r in others if r not in peers]
        lines = [
            f"gradsync hang watchdog: rank {self.rank} has waited {waited:.1f} s (threshold "
            f"{self.threshold_s:g} s) in collective #{sequence} ({label or 'unlabelled'} {kind}) over "
            f"{_name(group)}."
        ]
        if behind:
            reached = ", ".join(f"rank {r} #{peers[r].launched.get(group, 0)}" for r in behind)
            lines.append(f"Culprit rank(s) {behind}: they have not launched it (last launched: {reached}).")
        for r in behind:
            lines += _describe(r, peers[r])
        if unknown:
            lines.append(f"Rank(s) {unknown} never answered the watchdog's side group.")
        if not behind and not unknown:
            lines.append(
                "Every rank reports having launched it: the transport itself is stuck, or a rank stopped "
                "after its last heartbeat."
            )
        silent = time.monotonic() - self.last_round
        if self.side_error is not None or silent > 2 * self.interval_s + 1:
            cause = f": {self.side_error}" if self.side_error else ""
            lines.append(
                f"The side group has been silent for {silent:.1f} s (a rank is stopped, dead or stuck "
                f"holding its interpreter){cause}; the ranks above are as of the last round they answered."
            )
        lines.append("(How to read this report: docs/troubleshooting.md#a-step-hangs.)")
        return " ".join(lines)


def _describe(rank: int, progress: Progress) -> list[str]:
    """What ``rank`` was doing in its last heartbeat: the collective it waits in, its pending grads."""
    lines = []
    if progress.waiting is not None:
        group, sequence, label, kind, since = progress.waiting
        lines.append(
            f"Rank {rank} is itself waiting in collective #{sequence} ({label} {kind}) over "
            f"{_name(group)}, for {time.monotonic() - since:.1f} s."
        )
    lines += [f"Rank {rank}, {name}: {what}." for name, what in sorted(progress.pending.items())]
    return lines


def _name(group: GroupKey) -> str:
    """``group`` for a message: its ranks, and its process-group name."""
    ranks, desc = group
    return f"ranks {list(ranks)}" + (f" (group {desc!r})" if desc and desc != "undefined" else "")


def missing_names(names: list[str]) -> str:
    """``names`` for a message, at most a few."""
    shown = ", ".join(names[:_MAX_NAMES])
    return shown + (f" and {len(names) - _MAX_NAMES} more" if len(names) > _MAX_NAMES else "")


class _Switch:
    watchdog: HangWatchdog | None = None


_switch = _Switch()


def active_watchdog() -> HangWatchdog | None:
    return _switch.watchdog


@contextlib.contextmanager
def pause_hang_watchdog() -> Iterator[None]:
    """:meth:`HangWatchdog.paused` on the running watchdog; nothing when none runs."""
    guard = _switch.watchdog
    if guard is None:
        yield
        return
    with guard.paused():
        yield


def start_hang_watchdog(
    threshold_s: float, models: list[Any] | None = None, *, stream_ordered: bool | None = None
) -> HangWatchdog:
    """Start the watchdog on every rank (a collective: call it on all ranks after wrapping). ``models``:
    DistributedDataParallel or MegatronFSDP wrappers (anything with ``pending_grads()`` or
    ``grad_buffers.pending_grads()``) whose missing grads the messages should name. ``stream_ordered``:
    see :class:`HangWatchdog` (None: per collective, from its backend)."""
    if threshold_s <= 0:
        raise ValueError(f"start_hang_watchdog: threshold_s={threshold_s} must be positive")
    if _switch.watchdog is not None:
        raise RuntimeError("start_hang_watchdog: a watchdog is already running; stop_hang_watchdog() first")
    sources = [getattr(m, "grad_buffers", m) for m in models or []]
    for source in sources:
        if not callable(getattr(source, "pending_grads", None)):
            raise TypeError(f"start_hang_watchdog: {type(source).__name__} has no pending_grads()")
    timeout = timedelta(seconds=max(threshold_s, 2.0))
    side = dist.new_group(backend="gloo", timeout=timeout)
    guard_group_teardown(side)
    _switch.watchdog = HangWatchdog(threshold_s, sources, side, stream_ordered)
    # a heartbeat thread inside a gloo collective when the interpreter finalizes aborts the process
    # (gradsync.groups.teardown): a watchdog left running is stopped, its thread joined, before that
    atexit.register(stop_hang_watchdog)
    return _switch.watchdog


def stop_hang_watchdog() -> None:
    """Stop the heartbeats on every rank (a collective) and go back to plain blocking waits."""
    watchdog, _switch.watchdog = _switch.watchdog, None
    atexit.unregister(stop_hang_watchdog)
    if watchdog is not None:
        watchdog.stop()
