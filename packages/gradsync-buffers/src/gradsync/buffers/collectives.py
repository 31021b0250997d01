"""Stateless collectives on explicit groups, each picking the fastest correct path for its backend.

Every function launches asynchronously and returns a :class:`Launched` whose ``wait()`` waits *all* its
works and then runs the post-wait steps. The path per backend comes from the capability table in
gradsync-groups, never from backend names:

- AVG: used where the backend's AVG is trusted; otherwise SUM, then divide only the reduced region after
  the wait (gloo's AVG had a correctness bug, pytorch#162338).
- reduce-scatter: the native op writes the reduced shard into this rank's slice of the bucket and leaves
  the other shards at their local values; where all-reduce is faster (``reduce_scatter_via_all_reduce``)
  a copy of the bucket is all-reduced and only this rank's slice copied back; where an all-to-all is
  (``reduce_scatter_via_all_to_all``; gloo: under half the native op's time) every rank receives each
  rank's copy of its own shard and sums them locally, in rank order, into its slice — the same result,
  for a bucket-sized receive buffer while the collective is in flight.
- param all-gather: native ``all_gather_into_tensor``, or, where faster (gloo: measured at about a third
  of the all-gather's time), one broadcast per shard from its owner straight into the bucket.
- uneven shards (``cuts``, gradsync-fsdp's ragged buckets): no backend's native reduce-scatter or
  all-gather takes them, so each non-empty shard is reduced to (``dist.reduce``), or broadcast from, its
  owner in place; empty shards cost nothing. gloo's reduce uses the other ranks' buffers as scratch, so
  there only this rank's shard is defined afterwards.

``dist_reduce_scatter_func`` and ``dist_all_gather_func`` are looked up at call time, so tests can
substitute them.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.distributed as dist

from gradsync.groups import get_backend_capabilities

from . import telemetry, watchdog

dist_reduce_scatter_func: Callable[..., Any] = getattr(
    dist, "reduce_scatter_single", dist.reduce_scatter_tensor
)
dist_all_gather_func: Callable[..., Any] = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)


@dataclass
class Issued:
    """One collective's works, with its telemetry record and its watchdog coordinates (group key,
    sequence number, whether tracked, label, kind) when those are on."""

    works: list[Any]
    span: telemetry.CommSpan | None
    watch: tuple[watchdog.GroupKey, int, bool, str, str] | None


@dataclass
class Launched:
    """In-flight collectives and what to do once they have all completed."""

    works: list[Any] = field(default_factory=list)
    after: list[Callable[[], None]] = field(default_factory=list)
    following: Callable[[], Launched] | None = None
    """Launches the collectives that need these ones' results; called, and waited, by :meth:`wait`."""
    issued: list[Issued] = field(default_factory=list)
    """With telemetry or the hang watchdog on: each collective's works and what watches them."""

    def extend(self, other: Launched) -> None:
        """Add ``other``'s collectives; follow-ups, if any, are launched (in order) once all have finished."""
        self.works += other.works
        self.after += other.after
        self.issued += other.issued
        if other.following is not None:
            self.following = _in_turn(self.following, other.following)

    def record(
        self, kind: str, label: str, payload: torch.Tensor, group: dist.ProcessGroup, *, data: bool = True
    ) -> Launched:
        """Tell telemetry and the hang watchdog, when on, that these works are one collective sending
        ``payload`` over ``group``; returns self. ``data`` False: bookkeeping (the step's vote), which the
        watchdog watches but telemetry, which accounts for the data a step moves, leaves out."""
        recorder, guard = telemetry.active_telemetry() if data else None, watchdog.active_watchdog()
        if recorder is None and guard is None:
            return self
        span = recorder.launched(kind, label, payload, group, self.works) if recorder is not None else None
        watch = (*guard.launched_on(group, payload.device), label, kind) if guard is not None else None
        self.issued.append(Issued(list(self.works), span, watch))
        return self

    def then(self, launch: Callable[[], Launched]) -> Launched:
        """Run ``launch`` once these collectives have completed, when this handle is waited."""
        if self.following is not None:
            raise RuntimeError("these collectives already have a follow-up")
        self.following = launch
        return self

    def wait(self) -> None:
        # gloo completes works on a thread pool, so every work is waited, not just the last.
        if self.issued:
            self._wait_issued()
        for work in self.works:
            if work is not None:
                work.wait()
        for step in self.after:
            step()
        following, self.works, self.after, self.following = self.following, [], [], None
        if following is not None:
            following().wait()

    def future(self, result: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
        """These collectives as a torch future of ``result``, as a comm hook returns: it completes once
        every work's future has and its callback has run what comes after, follow-ups included (issued
        and waited from the callback)."""
        works = [work for work in self.works if work is not None]
        if not works:
            self.wait()
            done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
            done.set_result(result)
            return done

        def finish(_: torch.futures.Future[Any]) -> torch.Tensor:
            # the works have completed; gloo deadlocks on a work waited inside its own future's callback
            self.works = []
            for issued in self.issued:
                issued.works = []
            self.wait()
            return result

        return torch.futures.collect_all([work.get_future() for work in works]).then(finish)

    def _wait_issued(self) -> None:
        """Wait each recorded collective's works: timed for telemetry, polled by the hang watchdog."""
        guard = watchdog.active_watchdog()
        for issued in self.issued:
            if issued.span is not None:
                telemetry.CommTelemetry.waiting(issued.span)
            started = telemetry.now_ns()
            for work in issued.works:
                if work is None:
                    continue
                if guard is not None and issued.watch is not None:
                    guard.wait(work, *issued.watch)
                else:
                    work.wait()
            if issued.span is not None:
                telemetry.CommTelemetry.waited(issued.span, started)
        waited = {id(work) for issued in self.issued for work in issued.works}
        self.works = [work for work in self.works if id(work) not in waited]
        self.issued = []


def _in_turn(first: Callable[[], Launched] | None, second: Callable[[], Launched]) -> Callable[[], Launched]:
    """Launch ``first``'s collectives (when there is one), then ``second``'s, as one handle."""
    if first is None:
        return second

    def both() -> Launched:
        launched = first()
        launched.extend(second())
        return launched

    return both


def chain(
    first: Launched, launch_next: Callable[[], Launched], group: dist.ProcessGroup, device: torch.device
) -> Launched:
    """``launch_next``'s collectives (over ``group``) need ``first``'s results: the one rule both wrappers
    follow for a two-stage collective (HSDP's outer reduction, HFSDP's outer gather, the all-reduce across
    optimizer instances). Where waiting only orders the device stream (NCCL), ``first`` is waited now and
    the next stage issued at once, so both run ahead of the compute that follows; where waiting blocks the
    host (gloo), the next stage is issued when the returned handle is waited, so no hook ever blocks."""
    if get_backend_capabilities(group, device).stream_ordered_wait:
        first.wait()
        return launch_next()
    return first.then(launch_next)


def _shard_size(buffer: torch.Tensor, num_shards: int) -> int:
    if buffer.numel() % num_shards:
        raise ValueError(f"buffer of {buffer.numel()} elements does not split into {num_shards} equal shards")
    return buffer.numel() // num_shards


def shard_buffer(buffer: torch.Tensor, data_parallel_world_size: int) -> list[torch.Tensor]:
    """``data_parallel_world_size`` equal contiguous views of a flat buffer (one per DP rank)."""
    size = _shard_size(buffer, data_parallel_world_size)
    return [buffer[r * size : (r + 1) * size] for r in range(data_parallel_world_size)]


def uneven_shards(buffer: torch.Tensor, cuts: Sequence[int], num_shards: int) -> list[torch.Tensor]:
    """The views ``buffer[cuts[r]:cuts[r + 1]]``, one per rank; ``cuts`` must be ``num_shards + 1``
    boundaries running from 0 to the buffer's size without going back."""
    if (
        len(cuts) != num_shards + 1
        or cuts[0] != 0
        or cuts[-1] != buffer.numel()
        or any(b < a for a, b in itertools.pairwise(cuts))
    ):
        raise ValueError(
            f"shard cuts {tuple(cuts)} must be {num_shards + 1} boundaries rising from 0 to the buffer's "
            f"{buffer.numel()} elements (one shard per rank of the group)"
        )
    return [buffer[lo:hi] for lo, hi in itertools.pairwise(cuts)]


def shard_of(buffer: torch.Tensor, data_parallel_world_size: int, rank: int) -> torch.Tensor:
    """``rank``'s view of :func:`shard_buffer` without building the others (O(1) at any DP size)."""
    size = _shard_size(buffer, data_parallel_world_size)
    return buffer[rank * size : (rank + 1) * size]


def _reduce_op(
    group: dist.ProcessGroup, device: torch.device, average: bool
) -> tuple[dist.ReduceOp.RedOpType, bool]:
    """The op to pass, and whether the result must still be divided by the group size."""
    if not average:
        return dist.ReduceOp.SUM, False
    if get_backend_capabilities(group, device).avg_trusted:
        return dist.ReduceOp.AVG, False
    return dist.ReduceOp.SUM, True


def _divide_after(tensor: torch.Tensor, divisor: int) -> Callable[[], None]:
    def divide() -> None:
        tensor.div_(divisor)

    return divide


def all_reduce(
    tensor: torch.Tensor, group: dist.ProcessGroup, *, average: bool = False, label: str = ""
) -> Launched:
    """Sum (or average) ``tensor`` in place across ``group``. ``label`` names it in telemetry."""
    op, divide = _reduce_op(group, tensor.device, average)
    launched = Launched([dist.all_reduce(tensor, op=op, group=group, async_op=True)])
    launched.record("all_reduce", label, tensor, group)
    if divide:
        launched.after.append(_divide_after(tensor, group.size()))
    return launched


ReduceScatterPath = Literal["native", "all_reduce", "all_to_all"]
"""How :func:`reduce_scatter` reduces (see the module's notes)."""


def reduce_scatter_path(group: dist.ProcessGroup, device: torch.device) -> ReduceScatterPath:
    """The backend's fastest correct reduce-scatter path for tensors on ``device``."""
    caps = get_backend_capabilities(group, device)
    if caps.reduce_scatter_via_all_reduce or not caps.reduce_scatter_tensor:
        return "all_reduce"
    return "all_to_all" if caps.reduce_scatter_via_all_to_all else "native"


def reduce_scatter(
    bucket: torch.Tensor,
    group: dist.ProcessGroup,
    *,
    average: bool = False,
    path: ReduceScatterPath | None = None,
    cuts: Sequence[int] | None = None,
    label: str = "",
) -> Launched:
    """Reduce ``bucket`` so this rank's shard holds the sum (or mean); other shards keep local values
    (with ``cuts`` on gloo: undefined, see the module's notes).

    ``cuts``: the shards' boundaries (``group.size() + 1`` of them) when they are not equal; such shards
    are reduced to their owners one by one unless ``path`` is ``"all_reduce"``. ``path`` overrides the
    backend's choice (for benchmarks and tests).
    """
    size, rank = group.size(), group.rank()
    pieces = uneven_shards(bucket, cuts, size) if cuts is not None else None
    equal = _shard_size(bucket, size) if cuts is None else 0
    lo, hi = (cuts[rank], cuts[rank + 1]) if cuts is not None else (rank * equal, (rank + 1) * equal)
    shard = bucket[lo:hi]
    op, divide = _reduce_op(group, bucket.device, average)
    if path is None:
        path = reduce_scatter_path(group, bucket.device)
    if path == "all_reduce":
        copy = bucket.clone()
        launched = Launched([dist.all_reduce(copy, op=op, group=group, async_op=True)])

        def keep_own_shard() -> None:
            shard.copy_(copy[lo:hi])

        launched.after.append(keep_own_shard)
    elif pieces is not None:
        ranks = dist.get_process_group_ranks(group)
        launched = Launched(
            [
                dist.reduce(piece, dst=ranks[owner], op=op, group=group, async_op=True)
                for owner, piece in enumerate(pieces)
                if piece.numel()
            ]
        )
    elif path == "all_to_all":
        launched = Launched([_summed_all_to_all(shard, bucket, group, bucket.dtype)])
        divide = average  # the local sum is a SUM whatever op the backend would have taken
    else:
        launched = Launched([dist_reduce_scatter_func(shard, bucket, op=op, group=group, async_op=True)])
    launched.record("reduce_scatter", label, bucket, group)
    if divide:
        launched.after.append(_divide_after(shard, size))
    return launched


def all_gather_shards(
    bucket: torch.Tensor,
    group: dist.ProcessGroup,
    *,
    via_broadcasts: bool | None = None,
    cuts: Sequence[int] | None = None,
    label: str = "",
) -> Launched:
    """Fill every shard of ``bucket`` from its owner rank (this rank's shard is its own input).

    ``cuts``: the shards' boundaries (``group.size() + 1`` of them) when they are not equal; each
    non-empty one is broadcast from its owner. ``via_broadcasts`` overrides the backend's choice of path
    (for benchmarks and tests).
    """
    size, rank = group.size(), group.rank()
    if via_broadcasts is None:
        caps = get_backend_capabilities(group, bucket.device)
        via_broadcasts = caps.all_gather_via_broadcasts or not caps.all_gather_into_tensor
    if via_broadcasts or cuts is not None:  # one broadcast per rank: the views are needed anyway
        shards = uneven_shards(bucket, cuts, size) if cuts is not None else shard_buffer(bucket, size)
        ranks = dist.get_process_group_ranks(group)
        launched = Launched(
            [
                dist.broadcast(shards[r], src=ranks[r], group=group, async_op=True)
                for r in range(size)
                if shards[r].numel()
            ]
        )
    else:
        launched = Launched(
            [dist_all_gather_func(bucket, shard_of(bucket, size, rank), group=group, async_op=True)]
        )
    return launched.record("all_gather", label, bucket, group)


class _SummedAllToAllWork:
    """Waits the all-to-all, then sums the received copies of this rank's shard in ``dtype``, in rank
    order, into ``output``."""

    def __init__(
        self, work: Any, scratch: torch.Tensor, output: torch.Tensor, world: int, dtype: torch.dtype
    ) -> None:
        self.work, self.scratch, self.output, self.world, self.dtype = work, scratch, output, world, dtype

    def is_completed(self) -> bool:
        """Whether the all-to-all has finished (the hang watchdog polls this)."""
        return self.work is None or bool(self.work.is_completed())

    def wait(self) -> None:
        if self.work is not None:
            self.work.wait()
            self.work = None
        copies = self.scratch.view(self.world, -1)
        if self.output.dtype == self.dtype and self.output.dim() == 1 and self.output.is_contiguous():
            torch.sum(copies, dim=0, dtype=self.dtype, out=self.output)
        else:
            self.output.copy_(copies.sum(dim=0, dtype=self.dtype).view_as(self.output))


def _summed_all_to_all(
    output: torch.Tensor,
    bucket: torch.Tensor,
    group: dist.ProcessGroup | None,
    dtype: torch.dtype,
    scratch: torch.Tensor | None = None,
) -> _SummedAllToAllWork:
    """Launch the all-to-all that hands every rank each rank's copy of its own shard of ``bucket``; its
    wait sums them into ``output`` in ``dtype``."""
    world = group.size() if group is not None else dist.get_world_size()
    if scratch is None:
        scratch = torch.empty_like(bucket)
    work = dist.all_to_all_single(scratch, bucket, group=group, async_op=True)
    return _SummedAllToAllWork(work, scratch, output, world, dtype)


def reduce_scatter_with_fp32_accumulation(
    output_tensor: torch.Tensor,
    input_tensor: torch.Tensor,
    op: dist.ReduceOp.RedOpType,
    group: dist.ProcessGroup | None,
    async_op: bool,
    all_to_all_output_tensor: torch.Tensor | None = None,
) -> _SummedAllToAllWork | None:
    """Reduce-scatter that sends the grad dtype over the wire but accumulates in fp32.

    An all-to-all gives every rank all copies of its own shard (the same traffic as a ring
    reduce-scatter); the sum is then taken locally in fp32 and cast back. Only SUM is possible.
    """
    if op != dist.ReduceOp.SUM:
        raise ValueError(
            "reduce_scatter_with_fp32_accumulation only sums (op must be ReduceOp.SUM); "
            "set average_in_collective=False"
        )
    world = group.size() if group is not None else dist.get_world_size()
    if input_tensor.numel() % world:
        raise ValueError(f"input of {input_tensor.numel()} elements does not split into {world} shards")
    if output_tensor.numel() * world != input_tensor.numel():
        raise ValueError(
            f"output has {output_tensor.numel()} elements; expected input/world = "
            f"{input_tensor.numel() // world}"
        )
    scratch = all_to_all_output_tensor
    if scratch is not None and (scratch.shape != input_tensor.shape or scratch.dtype != input_tensor.dtype):
        raise ValueError(
            f"all_to_all_output_tensor shape ({tuple(scratch.shape)}, {scratch.dtype}) does not match "
            f"input_tensor shape ({tuple(input_tensor.shape)}, {input_tensor.dtype})"
        )
    handle = _summed_all_to_all(output_tensor, input_tensor, group, torch.float32, scratch)
    if async_op:
        return handle
    handle.wait()
    return None


def reduce_scatter_fp32_accumulated(
    bucket: torch.Tensor, group: dist.ProcessGroup, *, label: str = ""
) -> Launched:
    """:func:`reduce_scatter` semantics, accumulated in fp32 (SUM only)."""
    shard = shard_of(bucket, group.size(), group.rank())
    work = reduce_scatter_with_fp32_accumulation(shard, bucket, dist.ReduceOp.SUM, group, async_op=True)
    return Launched([work]).record("reduce_scatter", label, bucket, group)
