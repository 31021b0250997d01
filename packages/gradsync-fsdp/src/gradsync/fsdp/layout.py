"""Where every param of a bucket lives in its flat buffer, and which rows each rank's shard holds.

A bucket's flat buffer is cut into ``world`` equal shards. The optimizer sees each param's local part as a
dim-0 DTensor shard, so every shard boundary must fall on a row boundary of every param: each param starts
at a multiple of its alignment (its row size: the product of all dims but the first) and the shard size
is a multiple of the least common multiple of all alignments. Alignment is a per-param rule
(:func:`row_alignment` today) so that block- or whole-tensor alignment can be added without touching the
rest.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

AlignmentRule = Callable[[torch.Size], int]


def row_alignment(shape: torch.Size) -> int:
    """Elements per dim-0 row: shard boundaries may cut a param only between rows."""
    return math.prod(shape[1:]) if len(shape) > 1 else 1


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
    """The flat layout of one bucket over ``world`` shards."""

    items: tuple[ItemPlacement, ...]
    size: int
    world: int

    @property
    def shard_size(self) -> int:
        return self.size // self.world

    def shard_range(self, rank: int) -> tuple[int, int]:
        """``[start, end)`` of ``rank``'s shard in buffer coordinates."""
        return rank * self.shard_size, (rank + 1) * self.shard_size

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
    shapes: Sequence[torch.Size], world: int, alignment: AlignmentRule = row_alignment
) -> BucketLayout:
    """Place ``shapes`` in order, each at a multiple of its alignment, padded to ``world`` equal shards
    whose size is a multiple of every alignment. A single shard needs no alignment and no padding."""
    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    items, offset, factor = [], 0, 1
    for shape in shapes:
        align = alignment(shape) if world > 1 else 1
        offset = _round_up(offset, align)
        items.append(ItemPlacement(offset, torch.Size(shape)))
        offset += math.prod(shape)
        factor = math.lcm(factor, align)
    size = _round_up(max(offset, 1), world * factor)
    return BucketLayout(tuple(items), size, world)


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple
