"""Where every param lives: FSDP units, the order and place of each param in its bucket's flat buffer, each
rank's rows, and the outer (HSDP) stage's pieces.

Where every param of a bucket lives in its flat buffer, and which rows each rank's shard holds.

A bucket's flat buffer is cut into ``world`` shards, equal ones unless a ``tensor`` or ``block`` param lives
in it: then each shard is as long as what it holds (a ragged bucket, veScale-FSDP's layout), because equal
shards would pad every rank up to the largest whole matrix. The optimizer sees each param's local part as a
dim-0 DTensor shard, so every shard boundary must fall on a row boundary of every param it cuts, and on a
place its shard-alignment policy allows (:mod:`gradsync.buffers.shard_alignment`: ``row`` by default,
``block`` keeps tiles whole, ``tensor`` keeps the param in one shard). The packing itself is
gradsync-buffers' :func:`~gradsync.buffers.shard_alignment.pack_shards`, which gradsync-ddp's distributed
optimizer shares.

FSDP units and buckets: which params are gathered, released and reduced together.

A unit is an instance of one of ``fsdp_unit_modules`` that is not inside another unit (the outermost
wins); all its params form one bucket group. Params outside every unit are grouped by dtype and
requires_grad and split into buckets of ``bucket_size`` elements.

Which way round each bucket's params lie in its flat buffer, so every rank steps about as many params.

A sharded bucket is cut into equal shards by elements, so where a unit's large matrices sit at one end
and its small vectors (norms, biases) at the other, one rank holds most of the unit's params: on a
transformer block laid out in module order, the first half of the elements holds parts of nine of its
twelve params and the second half parts of four (one is cut). An element-wise optimizer costs about as
much per param as per thousand elements (torch's single-tensor Adam: about ten kernel launches per
param), so with every block cut the same way one rank steps three times as many params as the other and
sets the pace of every step (measured on the launch-bound benchmark at 2 ranks: 313 params on rank 0,
100 on rank 1, 137 ms of CPU per step against 98 ms). Laying each bucket's params forwards or
backwards, whichever leaves the busiest rank least busy so far, balances the counts over the buckets
(the next block is cut the other way round) without moving any shard boundary. Only the order inside a
bucket changes: every param keeps its own values, views, hooks and checkpoint name.

Hybrid sharding: the DP-outer stage that runs after the shard group's collectives.

The model is sharded over the shard (inner) group of N ranks and replicated over the outer group of M
ranks. With outer ``no_shard`` (HSDP) the outer group only all-reduces the grads this rank's optimizer
steps, once per optimisation cycle. With outer ``optim`` (HFSDP) the main weights, their grads and the
optimizer state are sharded over all N·M ranks as well: the buffers are laid out over N·M shards in the
order (inner, outer), i.e. shard ``i·M + o`` for inner rank i and outer rank o, so inner shard i is the
M consecutive outer pieces ``i·M … i·M+M-1``. Each rank keeps its inner shard of the compute weights and
grads; the outer stage reduce-scatters the accumulated inner grad shard into its piece at the end of a
cycle, and all-gathers the pieces into the inner shard before the first gather after an optimizer step.

Where one rank's pieces of a bucket lie in the bucket's flat layout.

The layout cuts the flat buffers into shards (with outer ``optim``, each inner shard into the outer pieces);
which of them this rank gathers, reduces and steps follows the strategy and the rank, fixed for the
bucket's life, so it is worked out once here and read by the gathers, the reductions and the optimizer.
"""

from __future__ import annotations

import importlib
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import Placement, Replicate, Shard

from gradsync.buffers import DistributedDataParallelConfig, is_expert_parallel
from gradsync.buffers.shard_alignment import (
    ROW,
    ShardAlignment,
    ShardBalance,
    drop_tail_padding,
    equal_cuts,
    owned_elements,
    pack_shards,
    row_size,
    shard_alignment_of,
)
from gradsync.groups import FSDPDistributedIndex

from .settings import Sharding, parse_strategy


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


UnitEntry = type[nn.Module] | str


def resolve_unit_classes(entries: Sequence[UnitEntry] | None) -> tuple[type[nn.Module], ...]:
    """Classes from classes or dotted import paths (``"package.module.Class"``)."""
    classes = []
    for entry in entries or ():
        if isinstance(entry, str):
            module_path, _, name = entry.rpartition(".")
            try:
                cls = getattr(importlib.import_module(module_path), name)
            except (ImportError, AttributeError, ValueError) as err:
                raise ValueError(
                    f"fsdp_unit_modules entry {entry!r} does not import ({err}); give a class or a dotted "
                    "path 'package.module.Class'"
                ) from err
        else:
            cls = entry
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            raise ValueError(f"fsdp_unit_modules entry {entry!r} is not an nn.Module subclass")
        classes.append(cls)
    return tuple(classes)


def find_units(root: nn.Module, classes: tuple[type[nn.Module], ...]) -> list[nn.Module]:
    """The outermost instances of ``classes`` in ``root``, in ``root.modules()`` order; every class must
    match at least one module."""
    units: list[nn.Module] = []
    inside: set[int] = set()
    for module in root.modules():
        if id(module) in inside or not isinstance(module, classes):
            continue
        units.append(module)
        inside.update(id(m) for m in module.modules())
    for cls in classes:
        if not any(isinstance(m, cls) for m in root.modules()):
            raise ValueError(
                f"fsdp_unit_modules names {cls.__module__}.{cls.__qualname__}, which matches no module of "
                f"the model ({type(root).__name__}); remove it or name a class the model uses"
            )
    return units


@dataclass
class BucketSpec:
    """The params of one bucket, in layout order, with their first names."""

    dtype: torch.dtype
    requires_grad: bool
    unit_id: int | None
    names: list[str] = field(default_factory=list)
    params: list[nn.Parameter] = field(default_factory=list)

    @property
    def numel(self) -> int:
        return sum(p.numel() for p in self.params)


def group_into_buckets(
    root: nn.Module, units: Sequence[nn.Module], bucket_size: int | None
) -> list[BucketSpec]:
    """Buckets in first-use order of ``root.named_parameters()``: one per (unit, dtype, requires_grad);
    params outside units (or used across a unit boundary) share buckets per (dtype, requires_grad), split
    at ``bucket_size`` elements. A ``chunk``-aligned param has a bucket of its own."""
    unit_of = _unit_of_params(root, units)
    groups: dict[tuple[torch.dtype, bool, int | None], list[BucketSpec]] = {}
    ordered: list[BucketSpec] = []
    for name, param in root.named_parameters():
        if is_expert_parallel(param):
            raise NotImplementedError(
                f"param {name!r} is expert-parallel (allreduce=False); gradsync-fsdp does not shard "
                "expert params yet: wrap the experts with gradsync-ddp or leave them out of the model"
            )
        unit_id = unit_of.get(param)
        if shard_alignment_of(param).alone:  # torch's chunk rule: a bucket of its own
            ordered.append(BucketSpec(param.dtype, param.requires_grad, unit_id, [name], [param]))
            continue
        key = (param.dtype, param.requires_grad, unit_id)
        buckets = groups.setdefault(key, [])
        full = (
            unit_id is None
            and bucket_size is not None
            and buckets
            and buckets[-1].numel + param.numel() > bucket_size
            and buckets[-1].params
        )
        if not buckets or full:
            buckets.append(BucketSpec(param.dtype, param.requires_grad, unit_id))
            ordered.append(buckets[-1])
        buckets[-1].names.append(name)
        buckets[-1].params.append(param)
    return ordered


def _unit_of_params(root: nn.Module, units: Sequence[nn.Module]) -> dict[nn.Parameter, int]:
    """The unit of every param used only inside one unit. A param also reached on a path outside its
    unit (a head tied to a unit's embedding, a weight shared by two units, a unit's submodule reused
    elsewhere) belongs to no unit: it goes to a non-unit bucket, which stays gathered for the whole
    forward and backward, as every user needs."""
    unit_ids = {id(unit): unit_id for unit_id, unit in enumerate(units)}
    holders: dict[nn.Parameter, set[int | None]] = {}

    def walk(module: nn.Module, unit_id: int | None) -> None:  # every path, shared modules included
        unit_id = unit_ids.get(id(module), unit_id) if unit_id is None else unit_id
        for param in module.parameters(recurse=False):
            holders.setdefault(param, set()).add(unit_id)
        for child in module.children():
            walk(child, unit_id)

    walk(root, None)
    return {param: unit_id for param, (unit_id, *more) in holders.items() if unit_id is not None and not more}


def params_per_shard(layout: BucketLayout) -> list[int]:
    """How many params have elements in each shard of ``layout`` (what an optimizer steps there)."""
    counts = [0] * layout.world
    for index in range(len(layout.items)):
        for shard in range(layout.world):
            first, last = layout.local_rows(index, shard)
            counts[shard] += first < last
    return counts


def balance_param_order(
    specs: Sequence[BucketSpec], layout_of: Callable[[BucketSpec], BucketLayout]
) -> list[BucketLayout]:
    """Reverse, in place, the params (and names) of each bucket whose reversed layout leaves the rank
    stepping most params so far with fewer (ties keep the module order); the buckets' layouts, in order.
    Unsharded buckets keep their order."""
    layouts: list[BucketLayout] = []
    loads: list[int] | None = None
    for spec in specs:
        forward = layout_of(spec)
        if forward.world == 1 or len(spec.params) < 2:
            layouts.append(forward)
            continue
        loads = loads or [0] * forward.world
        backward = layout_of(_reversed(spec))
        as_is, reversed_ = _added(loads, forward), _added(loads, backward)
        reverse = max(reversed_) < max(as_is)
        if reverse:
            spec.params.reverse()
            spec.names.reverse()
        loads = reversed_ if reverse else as_is
        layouts.append(backward if reverse else forward)
    return layouts


def _reversed(spec: BucketSpec) -> BucketSpec:
    return BucketSpec(spec.dtype, spec.requires_grad, spec.unit_id, spec.names[::-1], spec.params[::-1])


def _added(loads: list[int], layout: BucketLayout) -> list[int]:
    return [load + count for load, count in zip(loads, params_per_shard(layout), strict=True)]


@dataclass(frozen=True)
class OuterReplication:
    """The DP-outer group and whether the optimizer's state is sharded over it too (outer ``optim``)."""

    group: dist.ProcessGroup
    hybrid_group: dist.ProcessGroup
    shard: bool

    @property
    def pieces(self) -> int:
        """Outer pieces an inner shard is cut into: M with outer ``optim``, else 1."""
        return self.group.size() if self.shard else 1

    @property
    def piece(self) -> int:
        return self.group.rank() if self.shard else 0


def outer_replication(
    config: DistributedDataParallelConfig, dist_index: FSDPDistributedIndex, sharding: Sharding
) -> OuterReplication | None:
    """The outer stage ``config`` and ``dist_index`` ask for, or None without hybrid sharding; raises,
    naming the field, for combinations the reference does not support."""
    outer = parse_strategy(config.outer_dp_sharding_strategy, "outer_dp_sharding_strategy")
    if outer.name not in ("no_shard", "optim"):
        raise ValueError(
            f"MegatronFSDP: outer_dp_sharding_strategy={config.outer_dp_sharding_strategy!r}; the outer "
            "group can only replicate ('no_shard') or shard the optimizer state ('optim')"
        )
    if not dist_index.use_hybrid_fsdp:
        if outer.name != "no_shard":
            raise ValueError(
                f"MegatronFSDP: outer_dp_sharding_strategy={outer.name!r} needs hybrid sharding: build the "
                "index with dp_outer_dim and hybrid_fsdp_group (FSDPDistributedIndex.from_sizes(dp_shard, "
                "dp_outer))"
            )
        return None
    if outer.name == "optim" and sharding.name != "optim_grads_params":
        raise ValueError(
            "MegatronFSDP: outer_dp_sharding_strategy='optim' needs data_parallel_sharding_strategy="
            f"'optim_grads_params' inside the shard group, not {sharding.name!r}"
        )
    if dist_index.hsdp_outer_dp_shard != (outer.name == "optim"):
        raise ValueError(
            f"MegatronFSDP: outer_dp_sharding_strategy={outer.name!r} but the index was built with "
            f"hsdp_outer_dp_shard={dist_index.hsdp_outer_dp_shard}; build it with hsdp_outer_dp_shard="
            f"{outer.name == 'optim'}"
        )
    group = dist_index.get_outer_fsdp_group()
    assert group is not None  # use_hybrid_fsdp guarantees it
    return OuterReplication(group, dist_index.get_dp_group(), shard=outer.name == "optim")


def optimizer_placements(sharding: Sharding, outer: OuterReplication | None) -> list[Placement]:
    """How the optimizer's DTensors lie on their mesh: (shard) or (outer, shard), as the reference."""
    inner: Placement = Shard(0) if sharding.shard_main else Replicate()
    if outer is None:
        return [inner]
    return [Shard(0) if outer.shard else Replicate(), inner]


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
