"""A bucket's weight gathers: the collectives that fill its whole compute buffer from every rank's shard.

One job in three forms: the plain all-gather of the shards over the gather lane; HFSDP's first gather
after an optimizer step, whose outer ``optim`` pieces are gathered over the outer group first; and the
packed gathers of ``param_gather_dtype``, where every rank packs its own shard in the wire format and
gathers the packed bytes. The bucket decides when to gather; this says how.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist

from gradsync.buffers.collectives import Launched, all_gather_shards, chain
from gradsync.buffers.stats import CommStats
from gradsync.buffers.wire_format import WireFormat

from .bucket_ranges import BucketRanges
from .collective_stats import record_collective
from .hsdp import OuterReplication


class WeightGather:
    """Launches one bucket's weight gathers over ``group`` (its gather lane) and ``outer``'s group."""

    def __init__(
        self,
        ranges: BucketRanges,
        group: dist.ProcessGroup,
        outer: OuterReplication | None,
        wire: WireFormat | None,
        device: torch.device,
        label: str,
        stats: CommStats,
    ) -> None:
        """``wire``: the packed format of the sharded strategies' gathers, if any. ``stats``: the
        bucket's, where each gather is accounted."""
        self.ranges, self.group, self.outer, self.wire = ranges, group, outer, wire
        self.device, self.label, self.stats = device, label, stats
        self._packed_cuts: tuple[list[int], list[int] | None] | None = None  # packed rows' byte cuts
        self.outer_stale = False  # outer optim: other pieces of the inner weight shard are outdated
        self._exact = False  # exports and broadcasts gather the full-precision shards

    @contextmanager
    def exact(self) -> Iterator[None]:
        """Gathers launched inside gather the full-precision shards, even with a packed wire."""
        self._exact = True
        try:
            yield
        finally:
            self._exact = False

    def launch(self, weight: torch.Tensor, shard: torch.Tensor | None) -> Launched:
        """Fill ``weight`` from every rank's shard; ``shard``: this rank's kept copy of its shard (ZeRO-3),
        else its piece of ``weight`` is current. After a step with :attr:`outer_stale` the outer pieces
        are gathered first."""
        exact = self._exact
        if not self.outer_stale:
            return self._inner(weight, shard, exact)
        self.outer_stale = False
        assert self.outer is not None
        assert shard is not None
        record_collective(self.stats, "all_gather", shard, self.outer.group)
        outer = all_gather_shards(
            shard, self.outer.group, cuts=self.ranges.outer_cuts, label=f"{self.label}.outer"
        )
        return chain(outer, lambda: self._inner(weight, shard, exact), self.outer.group, self.device)

    def _inner(self, weight: torch.Tensor, shard: torch.Tensor | None, exact: bool) -> Launched:
        own = weight[self.ranges.shard_lo : self.ranges.shard_hi]
        if self.wire is not None and not exact:
            # ZeRO-1/2: the piece install_main_weights wrote, exact
            return self._packed(self.wire, weight, shard if shard is not None else own)
        if shard is not None:
            own.copy_(shard)
        record_collective(self.stats, "all_gather", weight, self.group)
        return all_gather_shards(weight, self.group, cuts=self.ranges.inner_cuts, label=self.label)

    def _packed(self, wire: WireFormat, weight: torch.Tensor, shard: torch.Tensor) -> Launched:
        """Every rank packs its own shard in ``wire`` and gathers the packed bytes; every rank, this one
        included, computes with the unpacked values, so all compute with the same weights."""
        cuts = self.ranges.layout.cuts
        if self._packed_cuts is None:  # the layout is fixed: once per bucket
            lengths = [hi - lo for lo, hi in itertools.pairwise(cuts)]
            byte_cuts = [0, *itertools.accumulate(wire.row_bytes(n) for n in lengths)]
            self._packed_cuts = (byte_cuts, None if len(set(lengths)) == 1 else byte_cuts)
        byte_cuts, uneven = self._packed_cuts
        packed = torch.empty(byte_cuts[-1], dtype=torch.uint8, device=self.device)
        rank = self.group.rank()
        packed[byte_cuts[rank] : byte_cuts[rank + 1]] = wire.pack_row(shard)
        record_collective(self.stats, "all_gather", packed, self.group)
        launched = all_gather_shards(packed, self.group, cuts=uneven, label=self.label)

        def unpack() -> None:
            for r, (lo, hi) in enumerate(itertools.pairwise(cuts)):
                if hi > lo:
                    weight[lo:hi].copy_(wire.unpack_row(packed[byte_cuts[r] : byte_cuts[r + 1]], hi - lo))

        launched.after.append(unpack)
        return launched
