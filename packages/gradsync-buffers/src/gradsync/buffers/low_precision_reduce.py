"""Grad reductions that send a low-precision wire and sum in fp32 (``grad_comm_dtype``).

A ring reduction in bf16 rounds the running sum at every hop, so its error grows with the number of ranks.
Here each rank instead sends every other rank that rank's piece of the bucket in the wire format, by one
all-to-all (the traffic of a ring reduce-scatter, in the smaller dtype), and each rank sums the pieces it
receives in fp32: one rounding per contribution, whatever the group size. A reduce-scatter stops there
(the owner keeps its fp32 sum, cast to the grad dtype). An all-reduce then all-gathers the summed pieces,
packed again, so every replica holds the same values: one more rounding, of the sum.

With error feedback, what the packing lost from this rank's contribution (the residual) is kept and added
to the next reduction's grads, so the rounding errors do not pile up over steps: the contributions sent
over T steps sum to the grads of those steps minus the last residual. An all-reduce rounds a second time,
when the owner of a summed piece packs it for the all-gather; the owner adds what that packing lost to its
own residual for the piece (times the group size where the sum is averaged), so the next step's sum
carries it. The grads applied over T steps then equal the true ones minus the last residuals' mean, on
every path, however many steps run.
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .collectives import Launched, all_gather_shards, all_reduce, chain, reduce_scatter, uneven_shards
from .config import DistributedDataParallelConfig
from .wire_format import WireFormat


class LowPrecisionReduction:
    """One bucket's reduction over ``group``: packs at construction, sums when the all-to-all is waited.

    ``cuts``: the shards' boundaries (``group.size() + 1`` of them) when they are not equal (a
    reduce-scatter only); without them the bucket is cut into equal pieces, the last padded with zeros."""

    def __init__(
        self,
        bucket: torch.Tensor,
        group: dist.ProcessGroup,
        wire: WireFormat,
        *,
        average: bool,
        residual: torch.Tensor | None,
        cuts: Sequence[int] | None = None,
    ) -> None:
        self.bucket, self.group, self.wire, self.average = bucket, group, wire, average
        self.world, self.rank = group.size(), group.rank()
        numel = bucket.numel()
        contribution = bucket.float() if residual is None else bucket.float() + residual.float()
        if cuts is None:
            self.chunk = -(-numel // self.world)
            self.bounds = [
                (min(r * self.chunk, numel), min((r + 1) * self.chunk, numel)) for r in range(self.world)
            ]
            rows = F.pad(contribution, (0, self.world * self.chunk - numel)).view(self.world, self.chunk)
            self.sent = wire.encode(F.pad(rows, (0, wire.padded_length(self.chunk) - self.chunk))).view(-1)
            self.splits: list[int] | None = None
            received = self.chunk
        else:
            self.chunk = 0
            uneven_shards(bucket, cuts, self.world)  # refuses cuts that do not split the bucket
            self.bounds = list(itertools.pairwise(cuts))
            self.sent = torch.cat([wire.pack_row(contribution[lo:hi]) for lo, hi in self.bounds])
            self.splits = [wire.row_bytes(hi - lo) for lo, hi in self.bounds]
            lo, hi = self.bounds[self.rank]
            received = hi - lo
        self.received_length = received
        self.residual = residual
        if residual is not None:
            residual.copy_(contribution - self._unpack_sent())
        self.received = torch.empty(
            self.world * wire.row_bytes(received), dtype=torch.uint8, device=self.sent.device
        )
        self.total = torch.empty(0)

    def _unpack_rows(self, packed: torch.Tensor, length: int) -> torch.Tensor:
        """Equal packed rows of ``length`` values each back to ``(rows, length)`` fp32."""
        rows = self.wire.decode(packed.view(self.world, -1), self.wire.padded_length(length))
        return rows[:, :length]

    def _unpack_sent(self) -> torch.Tensor:
        """What this rank's packed contribution unpacks to, as a flat fp32 bucket."""
        if self.splits is None:
            return self._unpack_rows(self.sent, self.chunk).reshape(-1)[: self.bucket.numel()]
        pieces = torch.split(self.sent, self.splits)
        return torch.cat(
            [self.wire.unpack_row(p, hi - lo) for p, (lo, hi) in zip(pieces, self.bounds, strict=True)]
        )

    @property
    def wire_bytes(self) -> int:
        """Bytes this rank puts into the all-to-all (the whole bucket, packed)."""
        return self.sent.numel()

    def _sum_received(self) -> None:
        total = self._unpack_rows(self.received, self.received_length).sum(dim=0)
        self.total = total / self.world if self.average else total
        self.received = torch.empty(0)  # the scratch is not needed past the sum

    def launch(self, label: str) -> Launched:
        """The all-to-all, then the fp32 sum of the pieces this rank owns."""
        work = dist.all_to_all_single(
            self.received, self.sent, input_split_sizes=self.splits, group=self.group, async_op=True
        )
        launched = Launched([work]).record("reduce_scatter", label, self.sent, self.group)
        launched.after.append(self._sum_received)
        return launched

    def reduce_scatter(self, label: str) -> Launched:
        """This rank's shard of the bucket ends as the sum (or mean); other shards keep local values."""
        launched = self.launch(label)

        def keep_own_sum() -> None:
            lo, hi = self.bounds[self.rank]
            self.bucket[lo:hi].copy_(self.total[: hi - lo])

        launched.after.append(keep_own_sum)
        return launched

    def all_reduce(self, label: str) -> Launched:
        """Every rank's bucket ends as the sum (or mean), identical on every rank."""
        if self.splits is not None:
            raise ValueError("an all-reduce cuts the bucket into equal pieces: pass no cuts")
        first = self.launch(label)
        return chain(first, lambda: self._gather_sums(label), self.group, self.bucket.device)

    def _gather_sums(self, label: str) -> Launched:
        mine = self.wire.pack_row(self.total[: self.chunk])
        if self.residual is not None:
            lo, hi = self.bounds[self.rank]
            lost = self.total[: hi - lo] - self.wire.unpack_row(mine, self.chunk)[: hi - lo]
            self.residual[lo:hi].add_(lost * self.world if self.average else lost)
        gathered = torch.empty(self.world * mine.numel(), dtype=torch.uint8, device=mine.device)
        gathered.view(self.world, -1)[self.rank] = mine
        launched = all_gather_shards(gathered, self.group, label=f"{label}.sums")

        def unpack() -> None:
            self.bucket.copy_(self._unpack_rows(gathered, self.chunk).reshape(-1)[: self.bucket.numel()])

        launched.after.append(unpack)
        return launched


class GradCommWire:
    """A wrapper's low-precision wire: the format its config names and, with error feedback, the residual
    of each reduction it runs (keyed by the caller: a bucket, a stage), in the grad buffer's dtype and
    created at that reduction's first launch."""

    def __init__(self, wire: WireFormat, error_feedback: bool) -> None:
        self.wire = wire
        self.residuals: dict[Hashable, torch.Tensor] | None = {} if error_feedback else None

    @classmethod
    def from_config(cls, config: DistributedDataParallelConfig) -> GradCommWire | None:
        if config.grad_comm_dtype is None:
            return None
        return cls(
            WireFormat(config.grad_comm_dtype, config.grad_comm_block_size), config.grad_comm_error_feedback
        )

    def residual(self, key: Hashable, grads: torch.Tensor) -> torch.Tensor | None:
        """With error feedback, the residual of reduction ``key`` (zeros at its first launch); else None."""
        if self.residuals is None:
            return None
        residual = self.residuals.get(key)
        if residual is None:
            residual = self.residuals[key] = torch.zeros_like(grads)
        return residual

    def launch(
        self,
        key: Hashable,
        grads: torch.Tensor,
        group: dist.ProcessGroup,
        *,
        scatter: bool,
        average: bool,
        label: str,
        cuts: Sequence[int] | None = None,
    ) -> tuple[int, Launched]:
        """Reduce ``grads`` over ``group`` (``key`` names the reduction for its residual): the bytes this rank
        sends, and the handle."""
        reduction = LowPrecisionReduction(
            grads, group, self.wire, average=average, residual=self.residual(key, grads), cuts=cuts
        )
        launched = reduction.reduce_scatter(label) if scatter else reduction.all_reduce(label)
        return reduction.wire_bytes, launched


def reduce_bucket(
    grads: torch.Tensor,
    group: dist.ProcessGroup,
    wire: GradCommWire | None,
    key: Hashable,
    *,
    scatter: bool,
    average: bool,
    label: str,
    cuts: Sequence[int] | None = None,
) -> tuple[Launched, int]:
    """Reduce-scatter (``scatter``) or all-reduce ``grads`` over ``group``: through the low-precision
    ``wire`` when there is one (``key`` names the reduction for its residual), else the backend's own
    collective. Both wrappers reduce through this; returns the handle and the bytes this rank sent."""
    if wire is not None:
        sent, launched = wire.launch(
            key, grads, group, scatter=scatter, average=average, label=label, cuts=cuts
        )
        return launched, sent
    if scatter:
        launched = reduce_scatter(grads, group, average=average, cuts=cuts, label=label)
    else:
        launched = all_reduce(grads, group, average=average, label=label)
    return launched, grads.numel() * grads.element_size()
