"""Where every param of a bucket lives in its flat buffer, and which rows each rank's shard holds.

A bucket's flat buffer is cut into ``world`` shards, equal ones unless a ``tensor`` or ``block`` param lives
in it: then each shard is as long as what it holds (a ragged bucket, veScale-FSDP's layout), because equal
shards would pad every rank up to the largest whole matrix. The optimizer sees each param's local part as a
dim-0 DTensor shard, so every shard boundary must fall on a row boundary of every param it cuts, and on a
place its shard-alignment policy allows (:mod:`gradsync.buffers.shard_alignment`: ``row`` by default,
``block`` keeps tiles whole, ``tensor`` keeps the param in one shard). The packing itself is
gradsync-buffers' :func:`~gradsync.buffers.shard_alignment.pack_shards`, which gradsync-ddp's distributed
optimizer shares.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from gradsync.buffers.shard_alignment import (
    ROW,
    ShardAlignment,
    ShardBalance,
    drop_tail_padding,
    equal_cuts,
    owned_elements,
    pack_shards,
    row_size,
)


def row_alignment(shape: torch.Size) -> int:
    """Elements per dim-0 row: shard boundaries may cut a param only between rows."""
    return row_size(shape)


@dataclass(frozen=True)
class ItemPlacement:
    """One param inside the flat buffer: ``[offset, offset + numel)``, viewed as ``shape``."""

    offset: int
    shape: torch.Size

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def end(self) -> int:
        return self.offset + self.numel

    @property
    def row_size(self) -> int:
        return row_alignment(self.shape)


@dataclass(frozen=True)
class BucketLayout:
    """The flat layout of one bucket over ``world`` shards: shard r is ``[cuts[r], cuts[r + 1])``."""

    items: tuple[ItemPlacement, ...]
    cuts: tuple[int, ...]

    @property
    def size(self) -> int:
        return self.cuts[-1]

    @property
    def world(self) -> int:
        return len(self.cuts) - 1

    @property
    def ragged(self) -> bool:
        """Whether the shards differ in size (the collectives then take the cuts)."""
        return len({hi - lo for lo, hi in itertools.pairwise(self.cuts)}) > 1

    def balance(self) -> ShardBalance:
        """Padding, and the param elements each shard holds."""
        numels = [item.numel for item in self.items]
        owned = owned_elements([item.offset for item in self.items], numels, self.cuts)
        return ShardBalance(sum(numels), self.size, tuple(owned))

    def shard_range(self, rank: int) -> tuple[int, int]:
        """``[start, end)`` of ``rank``'s shard in buffer coordinates."""
        return self.cuts[rank], self.cuts[rank + 1]

    def local_rows(self, index: int, rank: int) -> tuple[int, int]:
        """The rows ``[first, last)`` of item ``index`` that lie in ``rank``'s shard (may be empty)."""
        item = self.items[index]
        lo, hi = self.shard_range(rank)
        start, end = max(item.offset, lo), min(item.end, hi)
        if start >= end:
            return 0, 0
        return (start - item.offset) // item.row_size, (end - item.offset) // item.row_size

    def local_span(self, index: int, rank: int) -> tuple[int, int]:
        """``[start, end)`` in buffer coordinates of item ``index``'s rows held by ``rank``."""
        item = self.items[index]
        first, last = self.local_rows(index, rank)
        return item.offset + first * item.row_size, item.offset + last * item.row_size


def compute_bucket_layout(
    shapes: Sequence[torch.Size],
    world: int,
    policies: Sequence[ShardAlignment] | None = None,
    first_rank: int = 0,
) -> BucketLayout:
    """Place ``shapes`` in ``world`` equal shards: cut params start at a multiple of their row (or
    block-row) size, the shard size is a multiple of all of those, and ``tensor`` params sit whole in the
    shard with the most room (ties from ``first_rank`` on, see :func:`pack_shards`); with a ``tensor`` or
    ``block`` param, each shard then loses the padding at its tail (ragged shards). A single shard needs
    no alignment and no padding."""
    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    policies = list(policies) if policies is not None else [ROW] * len(shapes)
    if len(policies) != len(shapes):
        raise ValueError(f"{len(shapes)} params but {len(policies)} shard-alignment policies")
    sizes = [torch.Size(shape) for shape in shapes]
    if len(shapes) > 1 and any(policy.alone for policy in policies):
        raise ValueError(
            "a 'chunk' param must have a bucket of its own (torch's chunk rule fills every shard)"
        )
    packed = pack_shards(
        [math.prod(shape) for shape in sizes],
        [
            policy.row_multiple(shape) if world > 1 else 1
            for policy, shape in zip(policies, sizes, strict=True)
        ],
        [policy.whole and world > 1 for policy in policies],
        world,
        first_rank=first_rank,
    )
    offsets: Sequence[int] = packed.offsets
    cuts = equal_cuts(packed.shard_size, world)
    if world > 1 and any(policy.kind in ("tensor", "block") for policy in policies):
        numels = [math.prod(shape) for shape in sizes]
        offsets, cuts = drop_tail_padding(offsets, numels, packed.shard_size, world)
    items = tuple(ItemPlacement(offset, shape) for offset, shape in zip(offsets, sizes, strict=True))
    return BucketLayout(items, cuts)
