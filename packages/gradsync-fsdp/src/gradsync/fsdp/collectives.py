"""The collectives over explicit groups that a bucket runs: the weight gathers, the gather lane, and their
accounting.

Accounting a bucket's collectives in its step's :class:`~gradsync.buffers.stats.CommStats`: one rule
for the bytes a collective counts, whichever of the bucket's jobs (gathers, reductions) launches it.

The gather lane: param all-gathers run on a process group of their own, over exactly the shard group's
ranks, so a prefetched gather never queues behind a grad reduction issued before it.

Collectives of one group run in issue order: on NCCL a group is one communicator with one internal stream,
on gloo one queue served by two worker threads (a gather issued after two reductions waits for one of
them to finish). A second group has its own stream (NCCL) or its own workers (gloo). Grad reductions
(reduce-scatter, all-reduce) stay on the shard group, HSDP's outer stage on the outer group. Ordering stays
explicit per collective: a gather is waited before its weights are read, a reduction before its grads
are; on NCCL that wait orders the compute stream after the lane's stream, on gloo it blocks the host.

Where the lane comes from: the index's own all-gather group (``FSDPDistributedIndex(fsdp_group_ag=...)``,
as the reference's ``get_fsdp_group(independent_all_gather=True)``) when it has one; else gradsync builds
one per shard group and reuses it for every later wrap. Building one is a collective over the whole
world (``new_group``), so gradsync builds it only over a mesh that covers the world, enumerating the
shard dimension's rank lists in mesh order on every rank; an index over part of the world (``from_group``
on a data-parallel group beside tensor parallelism, say) keeps its gathers on the shard group unless it
carries ``fsdp_group_ag``.

A bucket's weight gathers: the collectives that fill its whole compute buffer from every rank's shard.

One job in three forms: the plain all-gather of the shards over the gather lane; HFSDP's first gather
after an optimizer step, whose outer ``optim`` pieces are gathered over the outer group first; and the
packed gathers of ``param_gather_dtype``, where every rank packs its own shard in the wire format and
gathers the packed bytes. The bucket decides when to gather; this says how.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from gradsync.buffers.collectives import Launched, all_gather_shards, chain
from gradsync.buffers.stats import CommStats
from gradsync.buffers.wire_format import WireFormat
from gradsync.groups import FSDPDistributedIndex, guard_group_teardown, release_at_exit
from gradsync.groups.torch_internals import default_group

from .layout import BucketRanges, OuterReplication


def record_collective(
    stats: CommStats, op: str, payload: torch.Tensor, group: dist.ProcessGroup, sent: int | None = None
) -> None:
    """Begin ``op``'s record (``sent``: the bytes on the wire, when they are not ``payload``'s own)."""
    nbytes = payload.numel() * payload.element_size() if sent is None else sent
    stats.begin(op, nbytes, group.size(), payload.device)


LANE_DESC = "gradsync_fsdp_gather_lane"
"""``group_desc`` of the lanes gradsync builds (it also tells them apart in the hang watchdog)."""

_LANES: weakref.WeakKeyDictionary[
    dist.ProcessGroup, tuple[weakref.ref[dist.ProcessGroup], dist.ProcessGroup]
] = weakref.WeakKeyDictionary()
"""Shard group -> (the world's default group when the lane was built, held weakly, the lane): one lane per
shard group however many models are wrapped. A lane from another world (``destroy_process_group`` and a new
``init_process_group``, as test suites, notebooks and elastic restarts do) is never handed out. The world
is held weakly so that ``destroy_process_group`` frees it (and joins its gloo threads) while the
interpreter is alive: see :mod:`gradsync.groups.teardown`. Dropped at exit."""
release_at_exit(_LANES.clear)


def gather_group(dist_index: FSDPDistributedIndex, enabled: bool) -> dist.ProcessGroup:
    """The group param all-gathers run on: the gather lane when ``enabled`` and there is or can be one,
    else the shard group. Every rank of the world must call it alike (it may build groups)."""
    shard = dist_index.get_fsdp_group()
    if not enabled or shard.size() == 1:
        return shard
    given = dist_index.get_fsdp_group(independent_all_gather=True)
    if given is not shard:
        _require_same_ranks(given, shard, "the index's all-gather group (FSDPDistributedIndex fsdp_group_ag)")
        return given
    world = default_group()
    cached = _LANES.get(shard)
    if cached is not None and cached[0]() is world:
        return cached[1]
    assert dist_index.dp_shard_dim is not None  # the index refuses to exist without one
    lane = _build_lane(dist_index.device_mesh, dist_index.dp_shard_dim, shard)
    _LANES[shard] = (weakref.ref(world), lane)
    return lane


def _build_lane(mesh: DeviceMesh, dim: str, shard: dist.ProcessGroup) -> dist.ProcessGroup:
    """A new group over ``shard``'s ranks, made collectively: every rank creates one group per rank list
    of ``mesh``'s dimension ``dim``, in mesh order, and keeps its own. ``shard`` itself where that cannot
    be done alike on every rank: a mesh over part of the world (the ranks outside it would have to join),
    ``dim`` not one of its named dimensions (flattened), or ranks out of order along it (``new_group``
    sorts them, so the lane's rank numbering would not be the shard group's)."""
    names = mesh.mesh_dim_names or ()
    if dim not in names or mesh.mesh.numel() != dist.get_world_size():
        return shard
    ranks = mesh.mesh.movedim(names.index(dim), -1)
    rank_lists: list[list[int]] = ranks.reshape(-1, ranks.shape[-1]).tolist()
    if any(members != sorted(members) for members in rank_lists):
        return shard
    # the default group's backend, as the mesh's own groups have, unless the shard group has another
    backend = None if dist.get_backend(shard) == dist.get_backend() else dist.get_backend_config(shard)
    lane = shard
    for members in rank_lists:
        group = dist.new_group(members, backend=backend, group_desc=LANE_DESC)
        if dist.get_rank() in members:
            guard_group_teardown(group)
            lane = group
    _require_same_ranks(lane, shard, "the gather lane built from the index's mesh")
    return lane


def _require_same_ranks(lane: dist.ProcessGroup, shard: dist.ProcessGroup, what: str) -> None:
    """Gathers place each rank's shard by its rank in the group: the lane must number ranks as the shard
    group does."""
    lane_ranks, shard_ranks = dist.get_process_group_ranks(lane), dist.get_process_group_ranks(shard)
    if lane_ranks != shard_ranks:
        raise ValueError(
            f"MegatronFSDP: {what} spans ranks {lane_ranks} but the shard group spans {shard_ranks}; it must "
            "span the shard group's ranks in their order (or pass gather_lane=False)"
        )


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
