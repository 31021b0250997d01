"""Grad reductions that send a low-precision wire and sum in fp32 (``grad_comm_dtype``).

A ring reduction in bf16 rounds the running sum at every hop, so its error grows with the number of ranks.
Here each rank instead sends every other rank that rank's piece of the bucket in the wire format, by one
all-to-all (the traffic of a ring reduce-scatter, in the smaller dtype), and each rank sums the pieces it
receives in fp32: one rounding per contribution, whatever the group size. A reduce-scatter stops there
(the owner keeps its fp32 sum, cast to the grad dtype). An all-reduce then all-gathers the summed pieces,
packed again, so every replica holds the same values: one more rounding, of the sum.

With error feedback, what the packing lost from this rank's contribution (the residual) is kept and added
to the next reduction's grads, so the rounding errors do not pile up over steps: the contributions sent
over T steps sum to the grads of those steps minus the last residual.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .collectives import Launched, all_gather_shards, chain
from .config import DistributedDataParallelConfig
from .wire_format import WireFormat


class LowPrecisionReduction:
    """One bucket's reduction over ``group``: packs at construction, sums when the all-to-all is waited."""

    def __init__(
        self,
        bucket: torch.Tensor,
        group: dist.ProcessGroup,
        wire: WireFormat,
        *,
        average: bool,
        residual: torch.Tensor | None,
    ) -> None:
        self.bucket, self.group, self.wire, self.average = bucket, group, wire, average
        self.world, self.rank = group.size(), group.rank()
        self.chunk = -(-bucket.numel() // self.world)
        self.length = wire.padded_length(self.chunk)
        contribution = bucket.float() if residual is None else bucket.float() + residual.float()
        rows = F.pad(contribution, (0, self.world * self.chunk - bucket.numel())).view(self.world, self.chunk)
        self.sent = wire.encode(F.pad(rows, (0, self.length - self.chunk)))
        if residual is not None:
            residual.copy_(contribution - self._unpack(self.sent))
        self.received = torch.empty_like(self.sent)
        self.total = torch.empty(0)

    @property
    def wire_bytes(self) -> int:
        """Bytes this rank puts into the all-to-all (the whole bucket, packed)."""
        return self.sent.numel()

    def _unpack(self, packed: torch.Tensor) -> torch.Tensor:
        """Rows of packed pieces back to a flat fp32 bucket of the original size."""
        rows = self.wire.decode(packed, self.length)[:, : self.chunk]
        return rows.reshape(-1)[: self.bucket.numel()]

    def _own(self) -> slice:
        return slice(self.rank * self.chunk, min((self.rank + 1) * self.chunk, self.bucket.numel()))

    def _sum_received(self) -> None:
        total = self.wire.decode(self.received, self.length).sum(dim=0)
        self.total = total / self.world if self.average else total
        self.received = torch.empty(0)  # the scratch is not needed past the sum

    def launch(self, label: str) -> Launched:
        """The all-to-all, then the fp32 sum of the pieces this rank owns."""
        work = dist.all_to_all_single(self.received, self.sent, group=self.group, async_op=True)
        launched = Launched([work]).record("reduce_scatter", label, self.sent, self.group)
        launched.after.append(self._sum_received)
        return launched

    def reduce_scatter(self, label: str) -> Launched:
        """This rank's shard of the bucket ends as the sum (or mean); other shards keep local values."""
        launched = self.launch(label)

        def keep_own_sum() -> None:
            own = self._own()
            self.bucket[own].copy_(self.total[: own.stop - own.start])

        launched.after.append(keep_own_sum)
        return launched

    def all_reduce(self, label: str) -> Launched:
        """Every rank's bucket ends as the sum (or mean), identical on every rank."""
        first = self.launch(label)
        return chain(first, lambda: self._gather_sums(label), self.group, self.bucket.device)

    def _gather_sums(self, label: str) -> Launched:
        mine = self.wire.encode(self.total.view(1, -1))
        gathered = torch.empty(self.world, mine.shape[1], dtype=torch.uint8, device=mine.device)
        gathered[self.rank] = mine[0]
        launched = all_gather_shards(gathered.view(-1), self.group, label=f"{label}.sums")

        def unpack() -> None:
            self.bucket.copy_(self._unpack(gathered))

        launched.after.append(unpack)
        return launched


class GradCommWire:
    """A bucket group's low-precision wire: the format its config names and, with error feedback, each
    bucket's residual (in the grad buffer's dtype, created at the bucket's first reduction)."""

    def __init__(self, wire: WireFormat, error_feedback: bool, buckets: int) -> None:
        self.wire = wire
        self.residuals: list[torch.Tensor | None] | None = [None] * buckets if error_feedback else None

    @classmethod
    def from_config(cls, config: DistributedDataParallelConfig, buckets: int) -> GradCommWire | None:
        if config.grad_comm_dtype is None:
            return None
        wire = WireFormat(config.grad_comm_dtype, config.grad_comm_block_size)
        return cls(wire, config.grad_comm_error_feedback, buckets)

    def _residual(self, position: int, grads: torch.Tensor) -> torch.Tensor | None:
        if self.residuals is None:
            return None
        residual = self.residuals[position]
        if residual is None:
            residual = self.residuals[position] = torch.zeros_like(grads)
        return residual

    def launch(
        self,
        position: int,
        grads: torch.Tensor,
        group: dist.ProcessGroup,
        *,
        scatter: bool,
        average: bool,
        label: str,
    ) -> tuple[int, Launched]:
        """Reduce bucket ``position``'s grads over ``group``: the bytes this rank sends, and the handle."""
        reduction = LowPrecisionReduction(
            grads, group, self.wire, average=average, residual=self._residual(position, grads)
        )
        launched = reduction.reduce_scatter(label) if scatter else reduction.all_reduce(label)
        return reduction.wire_bytes, launched
