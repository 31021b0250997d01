"""Coalesced grad reductions: consecutive buckets reduce in one collective.

A bucket is a unit's params, so a model of many small units would pay one collective per unit per step;
on a launch-bound model (many small params, fast kernels) those launches cost more than the reduced bytes
(measured on the CPU: 25 units' all-reduces took a third of no_shard's overhead over gradsync-ddp, which
reduces the same grads in one bucket). Buckets join a group, in bucket order, while:

- the group stays within the bucket size gradsync-ddp would use (``bucket_size``, else ``num_buckets``,
  else its default; one group without ``overlap_grad_reduce``, which reduces everything at the end
  anyway), so a group's reduction overlaps the rest of the backward as a DDP bucket's does;
- they share the weight, grad and wire dtypes;
- the strategy keeps compute weights whole (not ZeRO-3: a group would hold more unreduced grads of
  units whose weights are already released), no HSDP outer stage follows (it chains per bucket), and
  ZeRO-2's temporary grads come from a dynamic allocator (a double buffer lends two units' buffers at a
  time, so a group of three could never complete).

``no_shard`` grads of a group are slices of one flat buffer, all-reduced in place. Sharded strategies
reduce-scatter a wire laid out rank-major (every bucket's shard of rank 0, then of rank 1, ..., each
rank's part padded to the longest), so the one collective hands each rank its shard of every bucket, on
any backend, ragged shards included.

ZeRO-1/2 gather a group's weights after an optimizer step the same way: each rank's part of one
all-gather holds its shard of every bucket, unpacked into the buckets when it is waited (one collective
where each bucket would take its own; on gloo, one broadcast per rank where each bucket would take as
many).

A group launches when its last bucket in launch order completes (:class:`~gradsync.fsdp.schedule.
ReduceSchedule`); it is reopened, set aside and reduced again as a whole.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Sequence

import torch

from gradsync.buffers.collectives import Launched, all_gather_shards
from gradsync.buffers.grad_checks import LocalGradNorms
from gradsync.buffers.low_precision_reduce import reduce_bucket

from .bucket import BucketStatus, FlatParamBucket, GradReduction
from .layout import BucketLayout, BucketSpec
from .settings import MixedPrecisionPolicy, Sharding


def plan_reduction_groups(
    specs: Sequence[BucketSpec],
    layouts: Sequence[BucketLayout],
    sharding: Sharding,
    policy: MixedPrecisionPolicy,
    *,
    hsdp: bool,
    pooled_grads: bool,
    bucket_size: int | None,
) -> list[list[int]]:
    """Bucket ids in groups that reduce together, in bucket order; a bucket that cannot join any is a
    group of one. ``pooled_grads``: ZeRO-2/3's temporary grads come from a double buffer. ``bucket_size``
    None: no limit (one group, where nothing else parts the buckets)."""
    joinable = not sharding.shard_params and not hsdp and not (sharding.shard_grads and pooled_grads)
    groups: list[list[int]] = []
    size, key = 0, None
    for bucket_id, (spec, layout) in enumerate(zip(specs, layouts, strict=True)):
        this = (spec.dtype, policy.grad_dtype(spec.dtype), policy.comm_dtype(spec.dtype))
        fits = groups and (bucket_size is None or size + layout.size <= bucket_size)
        if joinable and spec.requires_grad and this == key and fits:
            groups[-1].append(bucket_id)
            size += layout.size
        else:
            groups.append([bucket_id])
            size, key = layout.size, (this if joinable and spec.requires_grad else None)
    return groups


def grad_storage(
    groups: Sequence[Sequence[int]],
    layouts: Sequence[BucketLayout],
    specs: Sequence[BucketSpec],
    sharding: Sharding,
    policy: MixedPrecisionPolicy,
    device: torch.device,
) -> tuple[list[torch.Tensor | None], dict[int, torch.Tensor]]:
    """Per ``no_shard`` group, its flat grad buffer (None for a bucket alone and for sharded strategies),
    and each such bucket's persistent grad buffer: consecutive slices of it."""
    flats: list[torch.Tensor | None] = []
    slices: dict[int, torch.Tensor] = {}
    for members in groups:
        if len(members) < 2 or sharding.shard_main:
            flats.append(None)
            continue
        sizes = [layouts[i].size for i in members]
        dtype = policy.grad_dtype(specs[members[0]].dtype)
        flat = torch.zeros(sum(sizes), dtype=dtype, device=device)
        flats.append(flat)
        slices.update(zip(members, torch.split(flat, sizes), strict=True))
    return flats, slices


class ReductionGroup:
    """Buckets reduced by one collective (a single bucket reduces on its own)."""

    def __init__(self, buckets: Sequence[FlatParamBucket], grads: torch.Tensor | None = None) -> None:
        """``grads``: the flat grad buffer the buckets' grads are slices of (2+ buckets)."""
        self.buckets, self.grads = list(buckets), grads
        self.bucket_ids = [b.bucket_id for b in self.buckets]
        self.size = sum(b.layout.size for b in self.buckets)
        first, last = self.bucket_ids[0], self.bucket_ids[-1]
        self.label = f"fsdp.bucket{first}" if first == last else f"fsdp.bucket{first}-{last}"
        # the rank-major wire (sharded strategies): per rank, its pieces' sizes, then its part's length
        cuts = [b.layout.cuts for b in self.buckets]
        self.piece_sizes = [[c[r + 1] - c[r] for c in cuts] for r in range(len(cuts[0]) - 1)]
        self.part_lengths = [sum(sizes) for sizes in self.piece_sizes]
        self.part = max(self.part_lengths)  # each rank's part of the wire, padded to the longest

    def _rank_pieces(self, tensors: Sequence[torch.Tensor], rank: int) -> list[torch.Tensor]:
        """Each bucket's shard of ``rank`` in ``tensors`` (one whole-bucket tensor per bucket)."""
        members = zip(self.buckets, tensors, strict=True)
        return [t[b.layout.cuts[rank] : b.layout.cuts[rank + 1]] for b, t in members]

    def gathers_together(self) -> None:
        """ZeRO-1/2 with 2+ buckets: route the members' gathers through :meth:`launch_gather`. The
        buckets hold the group weakly (the schedule owns it), so a dropped wrapper is freed by reference
        counting, as it is without groups."""
        first = self.buckets[0]
        if len(self.buckets) < 2 or not first.sharding.shard_main or first.sharding.shard_params:
            return
        if first.gather_wire is not None:  # each bucket packs its own rows
            return
        launch = weakref.WeakMethod(self.launch_gather)

        def gather() -> bool:
            method = launch()
            if method is None:
                return False
            method()
            return True

        for bucket in self.buckets:
            bucket.gather_together = gather

    def launch_gather(self) -> None:
        """Refresh every member's weights with one all-gather of a rank-major wire, when all are stale
        (they go stale together, at an optimizer step); otherwise each stale one gathers alone."""
        stale = [b for b in self.buckets if b.status is BucketStatus.EMPTY]
        if len(stale) < len(self.buckets):
            for bucket in stale:
                bucket.launch_gather_alone()
            return
        group = self.buckets[0].gather_group
        world, rank, part = group.size(), group.rank(), self.part
        weights = [b.weight for b in self.buckets]
        wire = weights[0].new_empty(world * part)
        own = wire[rank * part : rank * part + self.part_lengths[rank]]
        torch.cat(self._rank_pieces(weights, rank), out=own)
        launched = all_gather_shards(wire, group, label=self.label)

        def unpack() -> None:
            for r in range(world):
                if r != rank:
                    received = wire[r * part : r * part + self.part_lengths[r]]
                    values = torch.split(received, self.piece_sizes[r])
                    for piece, value in zip(self._rank_pieces(weights, r), values, strict=True):
                        piece.copy_(value)

        launched.after.append(unpack)
        for bucket in self.buckets:
            bucket.adopt_gather(launched)
            bucket.record("all_gather", bucket.weight, group)

    def launch_reduce(self, reduction: GradReduction, norms: LocalGradNorms | None) -> Launched:
        """Scale and reduce every bucket's grads (a bucket alone: :meth:`GradReducer.launch`). A comm hook
        is handed each bucket on its own, as the hook's protocol has it."""
        if len(self.buckets) == 1:
            return self.buckets[0].reducer.launch(reduction, norms)
        if self.buckets[0].comm_hook is not None:
            launched = Launched()
            for bucket in self.buckets:
                launched.extend(bucket.reducer.launch(reduction, norms))
            return launched
        if norms is not None:
            for bucket in self.buckets:
                norms.record(bucket.bucket_id, bucket.unreduced_grads())
        first = self.buckets[0]
        if first.sharding.shard_main:
            return self._reduce_scatter(reduction)
        flat = self.grads
        assert flat is not None
        wire = flat if first.comm_dtype == first.grad_dtype else flat.to(first.comm_dtype)
        self._scale(reduction, wire, torch.split(wire, [b.layout.size for b in self.buckets]))
        launched, sent = reduce_bucket(
            wire, first.group, first.grad_comm, self.label, scatter=False, average=reduction.average,
            cuts=None, label=self.label,
        )  # fmt: skip
        pieces = torch.split(wire, [b.layout.size for b in self.buckets])
        for bucket, piece in zip(self.buckets, pieces, strict=True):
            reduced = bucket.grad if wire is flat else piece  # in place: nothing to copy back
            assert reduced is not None
            launched.after.append(functools.partial(bucket.reducer.finish, reduced))
            bucket.record("all_reduce", piece, bucket.group, sent * piece.numel() // wire.numel())
        return launched

    def _scale(
        self, reduction: GradReduction, wire: torch.Tensor | None, pieces: Sequence[torch.Tensor]
    ) -> None:
        """Pre-multiply the grads by their factor: the whole ``wire`` at once where the buckets share one,
        else each bucket's piece by its own (a divide factor set on some units only)."""
        common = reduction.common_factor(self.buckets)
        if common is not None and wire is not None:
            if common != 1.0:
                wire.mul_(common)
            return
        for bucket, piece in zip(self.buckets, pieces, strict=True):
            factor = reduction.factor_for(bucket)
            if factor != 1.0:
                piece.mul_(factor)

    def _reduce_scatter(self, reduction: GradReduction) -> Launched:
        """One reduce-scatter of a rank-major wire: this rank's part holds its shard of every bucket."""
        first = self.buckets[0]
        group = first.group
        world, rank, part = group.size(), group.rank(), self.part
        grads = [b.unreduced_grads() for b in self.buckets]
        common = reduction.common_factor(self.buckets)
        if common is None:  # divide factors differ: each bucket its own, before the wire interleaves them
            self._scale(reduction, None, grads)
        pieces: list[torch.Tensor] = []
        for r in range(world):
            pieces += self._rank_pieces(grads, r)
            if self.part_lengths[r] < part:
                pieces.append(grads[0].new_zeros(part - self.part_lengths[r]))
        wire = torch.cat(pieces)
        if wire.dtype != first.comm_dtype:
            wire = wire.to(first.comm_dtype)
        if common is not None and common != 1.0:
            wire.mul_(common)
        launched, sent = reduce_bucket(
            wire, group, first.grad_comm, self.label, scatter=True, average=reduction.average, cuts=None,
            label=self.label,
        )  # fmt: skip
        mine = wire[rank * part : rank * part + self.part_lengths[rank]]
        shards = torch.split(mine, self.piece_sizes[rank])
        for bucket, grad, shard in zip(self.buckets, grads, shards, strict=True):
            launched.after.append(functools.partial(bucket.reducer.finish_shard, shard))
            bucket.record("reduce_scatter", grad, group, sent * grad.numel() // self.size)
        return launched
