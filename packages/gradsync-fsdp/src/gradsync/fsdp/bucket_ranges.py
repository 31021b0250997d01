"""Where one rank's pieces of a bucket lie in the bucket's flat layout.

The layout cuts the flat buffers into shards (with outer ``optim``, each inner shard into the outer pieces);
which of them this rank gathers, reduces and steps follows the strategy and the rank, fixed for the
bucket's life, so it is worked out once here and read by the gathers, the reductions and the optimizer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from .hsdp import OuterReplication
from .layout import BucketLayout
from .strategy import Sharding


@dataclass(frozen=True)
class BucketRanges:
    """This rank's coordinates in one bucket's flat layout (buffer coordinates, ``[lo, hi)``)."""

    layout: BucketLayout
    sharding: Sharding
    rank: int  # this rank's shard of the layout: inner rank i, outer piece o -> i*M + o
    shard_lo: int  # the inner shard: what gathers and grad reductions cut
    shard_hi: int
    inner_cuts: tuple[int, ...] | None  # ragged shards: the boundaries the collectives take
    outer_cuts: tuple[int, ...] | None  # ragged shards: this inner shard's outer pieces

    @classmethod
    def of(
        cls,
        layout: BucketLayout,
        sharding: Sharding,
        group: dist.ProcessGroup,
        outer: OuterReplication | None,
    ) -> BucketRanges:
        """The ranges of ``group``'s rank (and ``outer``'s piece): the inner dim cuts first."""
        pieces = outer.pieces if outer is not None else 1
        first = group.rank() * pieces
        rank = first + (outer.piece if outer is not None else 0)
        cuts = layout.cuts
        shard_lo, shard_hi = (cuts[first], cuts[first + pieces]) if sharding.shard_main else (0, layout.size)
        inner_cuts = cuts[::pieces] if layout.ragged else None
        outer_cuts = (
            tuple(cut - shard_lo for cut in cuts[first : first + pieces + 1])
            if layout.ragged and pieces > 1
            else None
        )
        return cls(layout, sharding, rank, shard_lo, shard_hi, inner_cuts, outer_cuts)

    @property
    def main(self) -> tuple[int, int]:
        """What the main weights (and the optimizer) cover on this rank."""
        return self.layout.shard_range(self.rank) if self.sharding.shard_main else (0, self.layout.size)

    @property
    def grad(self) -> tuple[int, int]:
        """What the persistent grad buffer covers on this rank."""
        return (self.shard_lo, self.shard_hi) if self.sharding.shard_grads else (0, self.layout.size)

    def local_span(self, index: int) -> tuple[int, int]:
        """Item ``index``'s rows this rank's optimizer owns."""
        if not self.sharding.shard_main:
            item = self.layout.items[index]
            return item.offset, item.end
        return self.layout.local_span(index, self.rank)

    def owned_rows(self, index: int) -> tuple[int, int]:
        """Rows ``[first, last)`` of item ``index`` whose optimizer state this rank owns."""
        if not self.sharding.shard_main:
            shape = self.layout.items[index].shape
            return 0, shape[0] if len(shape) else 1
        return self.layout.local_rows(index, self.rank)
