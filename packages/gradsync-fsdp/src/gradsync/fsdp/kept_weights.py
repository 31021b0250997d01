"""The weights one rank keeps of a bucket besides its whole compute buffer.

Its shard of the compute weights (ZeRO-3, whose whole buffer exists only between a gather and a release)
and the main weights its optimizer steps, where those are not the compute weights themselves (another
dtype, outer ``optim``'s piece, or ZeRO-1/2's exact values beside packed gathers' unpacked ones). These
copies are what a step, a load or a meta-device init writes; a gather spreads them to every rank.
"""

from __future__ import annotations

import torch

from .bucket_ranges import BucketRanges
from .layout import ItemPlacement


class KeptWeights:
    """This rank's weight shard and main weights of one bucket (either may be None)."""

    def __init__(
        self, weight: torch.Tensor, ranges: BucketRanges, keep_shard: bool, main_dtype: torch.dtype | None
    ) -> None:
        """Copies of the whole compute buffer ``weight``; ``main_dtype`` None: the optimizer steps the
        compute weights."""
        self.ranges = ranges
        self.shard = weight[ranges.shard_lo : ranges.shard_hi].clone() if keep_shard else None
        lo, hi = ranges.main
        self.main = None if main_dtype is None else weight[lo:hi].to(main_dtype, copy=True)

    def optimizer_source(self, weight: torch.Tensor) -> tuple[torch.Tensor, int]:
        """The tensor the optimizer's params view (of these, else the compute buffer ``weight``), and the
        buffer coordinate of its first element."""
        if self.main is not None:
            return self.main, self.ranges.main[0]
        if self.shard is not None:
            return self.shard, self.ranges.shard_lo
        return weight, 0

    def install(self, weight: torch.Tensor) -> None:
        """Copy the optimizer's updated main weights into this rank's part of the compute weights: the
        kept shard, else the compute buffer ``weight``."""
        if self.main is None:
            return
        lo, hi = self.ranges.main
        base = self.ranges.shard_lo
        with torch.no_grad():
            target = weight[lo:hi] if self.shard is None else self.shard[lo - base : hi - base]
            target.copy_(self.main)

    def write(self, weight: torch.Tensor, item: ItemPlacement, value: torch.Tensor) -> None:
        """Set ``item`` to ``value`` (the whole param) in the compute weights this rank keeps (the compute
        buffer ``weight`` when no shard is kept) and in the main weights."""
        flat = value.reshape(-1)
        with torch.no_grad():
            if self.shard is None:
                weight[item.offset : item.end].copy_(flat)
            else:
                _copy_overlap(self.shard, self.ranges.shard_lo, flat, item)
            if self.main is not None:
                _copy_overlap(self.main, self.ranges.main[0], flat, item)

    def reset(self, weight: torch.Tensor) -> None:
        """Re-derive both from the whole compute buffer ``weight``."""
        with torch.no_grad():
            if self.shard is not None:
                self.shard.copy_(weight[self.ranges.shard_lo : self.ranges.shard_hi])
            if self.main is not None:
                lo, hi = self.ranges.main
                self.main.copy_(weight[lo:hi])


def _copy_overlap(target: torch.Tensor, base: int, flat: torch.Tensor, item: ItemPlacement) -> None:
    """Copy the part of ``flat`` (item ``item``'s values) that ``target`` (starting at buffer coordinate
    ``base``) covers."""
    start, end = max(item.offset, base), min(item.end, base + target.numel())
    if start < end:
        target[start - base : end - base].copy_(flat[start - item.offset : end - item.offset])
