"""One bucket: its flat buffers, the weights a rank keeps, its grads and their reduction.

Views of a bucket's items in its flat buffers.

Params, their grads and the optimizer's rows are views of a bucket's flat buffers, never copies, so a
collective on a buffer is seen by every param at once; these turn buffer coordinates into such views.

Zeroing a bucket's grads only when something may have written them since they were last zeroed.

Loops that call ``optimizer.zero_grad()`` (which zeros the buffers under fully_shard_optimizer) and then
``model.zero_grad_buffer()`` as Megatron's do would otherwise write every grad byte twice. Any in-place
torch op on the buffer or a view of it (a grad hook's add, a user's write through ``main_grad`` or a
DTensor grad) moves its version counter; a collective does not, so a reduction into the buffer is noted.

ZeRO-2/3's whole-bucket grads of one backward: borrowed from the grads allocator when the first grad
arrives, handed back once their reduce-scatter has landed in the shard, so a bucket holds whole-bucket
grads only while its reduction is pending. The params' views of them are kept with them
(:meth:`UnreducedGrads.views`).

The weights one rank keeps of a bucket besides its whole compute buffer.

Its shard of the compute weights (ZeRO-3, whose whole buffer exists only between a gather and a release)
and the main weights its optimizer steps, where those are not the compute weights themselves (another
dtype, outer ``optim``'s piece, or ZeRO-1/2's exact values beside packed gathers' unpacked ones). These
copies are what a step, a load or a meta-device init writes; a gather spreads them to every rank.

One bucket's storage and collectives: compute weights, main weights and grads as flat buffers.

Params are views into the bucket's flat compute-weight buffer (zero-copy: a gather or a grad
reduction works on the buffer itself, never on per-param copies). What is kept whole and what only as
this rank's shard follows the strategy (:class:`~gradsync.fsdp.settings.Sharding`). Under ZeRO-3 the
whole compute buffer exists only between :meth:`FlatParamBucket.launch_gather` and
:meth:`FlatParamBucket.release`, and ZeRO-2/3's whole-bucket grads only until their reduce-scatter is
done; both come from the bucket's allocators (:mod:`gradsync.fsdp.allocators`), and the params are
re-pointed whenever the weight buffer is a different tensor than last time. The optimizer's params are
views of the main-weight buffer (or, when the main dtype is the compute dtype, of the compute weights
themselves), so its in-place updates land in the buffer.

The bucket holds that state and decides when each step happens; one collaborator per job does it:
:class:`~gradsync.fsdp.layout.BucketRanges` (where this rank's pieces lie),
:class:`~gradsync.fsdp.bucket.KeptWeights` (its weight shard and main weights),
:class:`~gradsync.fsdp.collectives.WeightGather` (the gathers),
:class:`~gradsync.fsdp.bucket.UnreducedGrads` (ZeRO-2/3's borrowed grads),
:class:`~gradsync.fsdp.bucket.GradReducer` (the reductions) and
:class:`~gradsync.fsdp.bucket.GradZeroing` (skipped zeroings).

A bucket's grad reductions: scale, reduce over the group (or hand to a comm hook), land the result.

The inner stage reduce-scatters into the shard (ZeRO-1/2/3; ZeRO-2/3 add it to the accumulated shard) or
all-reduces the whole buffer (no_shard); HSDP's outer stage then reduces what this rank's optimizer steps
over the outer group. Grads reduced earlier in the cycle and set aside (accumulation without
``no_sync()``) are added back when the last stage ends.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from enum import Enum

import torch
import torch.distributed as dist

from gradsync.buffers.collectives import Launched
from gradsync.buffers.comm_hook import HookBucket, RegisteredHook
from gradsync.buffers.grad_checks import LocalGradNorms
from gradsync.buffers.low_precision_reduce import GradCommWire, reduce_bucket
from gradsync.buffers.shard_alignment import shard_alignment_of
from gradsync.buffers.stats import CommStats
from gradsync.buffers.wire_format import WireFormat

from .allocators import BucketAllocator, BufferRequest, StorageResizeBucketAllocator
from .collectives import WeightGather, record_collective
from .layout import (
    BucketLayout,
    BucketRanges,
    BucketSpec,
    ItemPlacement,
    OuterReplication,
    compute_bucket_layout,
)
from .settings import MixedPrecisionPolicy, Sharding
from .torch_internals import version_counter


def item_view(tensor: torch.Tensor, base: int, start: int, end: int, shape: torch.Size) -> torch.Tensor:
    """Buffer coordinates ``[start, end)`` of ``tensor`` (whose first element is coordinate ``base``) as
    whole rows of a param shaped ``shape``: all of it, or only the rows a rank owns."""
    flat = tensor[start - base : end - base]
    if len(shape) <= 1:
        return flat.view(-1) if len(shape) == 1 else flat.view(shape)
    return flat.view(-1, *shape[1:])


def item_views(buffer: torch.Tensor, items: Sequence[ItemPlacement]) -> list[torch.Tensor]:
    """Each item's view of the whole-bucket ``buffer``, shaped as its param."""
    return [item_view(buffer, 0, item.offset, item.end, item.shape) for item in items]


class GradZeroing:
    """Whether one grad buffer may hold anything but zeros."""

    def __init__(self) -> None:
        self._reduced_into = True
        self._zeroed_version = -1

    def needed(self, grad: torch.Tensor) -> bool:
        """Whether ``grad`` may have been written since :meth:`note_zeroed`."""
        return self._reduced_into or version_counter(grad) != self._zeroed_version

    def note_zeroed(self, grad: torch.Tensor) -> None:
        """``grad`` holds zeros now. Called once every bucket is zeroed: coalesced buckets' grads share one
        storage and so one version counter, which a sibling's zeroing moves."""
        self._zeroed_version, self._reduced_into = version_counter(grad), False

    def note_reduction(self) -> None:
        """A collective is about to write the grads."""
        self._reduced_into = True


class UnreducedGrads:
    """One bucket's borrowed whole-bucket grads."""

    def __init__(
        self,
        allocator: BucketAllocator,
        bucket_id: int,
        layout: BucketLayout,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        """``dtype``: the wire's, as the buffer is reduced in place."""
        self.allocator, self.bucket_id = allocator, bucket_id
        self.request = BufferRequest(layout.size, dtype, device)
        self.items = layout.items
        self._buffer: torch.Tensor | None = None
        self._views: tuple[torch.Tensor, list[torch.Tensor]] | None = None  # a buffer, its items' views

    def buffer(self) -> torch.Tensor:
        """This backward's whole-bucket grads, zeroed when first asked for."""
        if self._buffer is None:
            self._buffer = self.allocator.allocate(self.bucket_id, self.request).zero_()
        return self._buffer

    def views(self) -> list[torch.Tensor]:
        """Each item's view of :meth:`buffer`, shaped as its param: where the backward adds its grads.
        Kept while the allocator lends the same tensor (the default storage-resize one does, every
        backward), so a later backward adds into the same views without building them again."""
        buffer = self.buffer()
        if self._views is None or self._views[0] is not buffer:
            self._views = (buffer, item_views(buffer, self.items))
        return self._views[1]

    def can_take(self) -> bool:
        """Whether the first grad of this backward would get a buffer now (double buffers can be full)."""
        return self._buffer is not None or self.allocator.can_allocate(self.bucket_id)

    def drop(self) -> None:
        """Hand the buffer back (its grads were reduced, or zeroed)."""
        if self._buffer is not None:
            self._buffer = None
            self.allocator.free(self.bucket_id)


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


class BucketStatus(Enum):
    """Compute weights of a bucket: not held whole, being gathered, or ready to use."""

    EMPTY = 1
    COMMUNICATING = 3
    READY_TO_USE = 4


class PrefetchOrder(Enum):
    """Which neighbouring unit a gather prefetches: the next in forward order or the previous one."""

    FORWARD_PASS_ORDER = 0
    BACKWARD_PASS_ORDER = 1


class GradReduction:
    """How grads are scaled and reduced (:func:`gradsync.buffers.gradient_scaling_factors`): pre-multiplied
    by ``factor`` and summed, or averaged by the collective."""

    def __init__(self, factor: float, average_in_collective: bool) -> None:
        self.factor = factor
        self.average = average_in_collective

    def factor_for(self, bucket: FlatParamBucket) -> float:
        """What ``bucket``'s grads are pre-multiplied by: its own divide factor's inverse where one is set
        (FSDP2's ``set_gradient_divide_factor``; the collective then sums), else the root's factor."""
        return self.factor if bucket.divide_factor is None else 1.0 / bucket.divide_factor

    def common_factor(self, buckets: Sequence[FlatParamBucket]) -> float | None:
        """The factor every bucket of a coalesced reduction shares, or None where they differ."""
        factors = {self.factor_for(bucket) for bucket in buckets}
        return factors.pop() if len(factors) == 1 else None


@dataclass
class BucketAllocators:
    """Where a bucket's gathered weights and unreduced grads come from (shared by all buckets)."""

    weights: BucketAllocator
    grads: BucketAllocator

    @classmethod
    def dynamic(cls) -> BucketAllocators:
        """The default: storage-resize for weights (params keep their views) and for ZeRO-2/3's
        whole-bucket grads (the hooks keep theirs)."""
        return cls(StorageResizeBucketAllocator(), StorageResizeBucketAllocator())


def bucket_layout(
    spec: BucketSpec, sharding: Sharding, group: dist.ProcessGroup, outer: OuterReplication | None = None
) -> BucketLayout:
    """The bucket's flat layout: cut into the group's shards when main weights are sharded, and each
    shard into the outer pieces with outer ``optim``."""
    pieces = outer.pieces if outer is not None else 1
    world = group.size() * pieces if sharding.shard_main else 1
    for name, param in zip(spec.names, spec.params, strict=True):
        if shard_alignment_of(param).alone and (pieces > 1 or param.dim() == 0):
            raise ValueError(
                f"shard_alignment 'chunk' for param {name!r}: torch's chunk rule needs a param of at least "
                "one dim and one shard dim (outer_dp_sharding_strategy 'optim' lays shards out in (inner, "
                "outer) order); use 'row', 'tensor' or 'block' for it"
            )
    return compute_bucket_layout(
        [p.shape for p in spec.params],
        world,
        [shard_alignment_of(p) for p in spec.params],
        first_rank=spec.unit_id or 0,  # units of one shape spread their largest params over the ranks
    )


class FlatParamBucket:
    """The flat buffers of one bucket and the collectives that keep them in sync across ``group``: grads
    are reduced over ``group``, weights gathered over ``gather_group`` (the gather lane,
    :mod:`gradsync.fsdp.collectives`: the same ranks, so a gather does not queue behind a reduction; default
    ``group``)."""

    def __init__(
        self,
        bucket_id: int,
        spec: BucketSpec,
        sharding: Sharding,
        policy: MixedPrecisionPolicy,
        group: dist.ProcessGroup,
        device: torch.device,
        allocators: BucketAllocators | None = None,
        outer: OuterReplication | None = None,
        unset: Collection[torch.Tensor] = (),
        gather_group: dist.ProcessGroup | None = None,
        grad_storage: torch.Tensor | None = None,
        grad_comm: GradCommWire | None = None,
        gather_wire: WireFormat | None = None,
    ) -> None:
        """``unset``: params without values yet (meta-device init); :meth:`write_param` sets them.
        ``grad_storage``: zeros to hold the persistent grads, a slice of a coalesced group's buffer
        (:mod:`gradsync.fsdp.coalesce`); by default the bucket allocates its own. ``grad_comm``: the
        low-precision wire with fp32 sums the reductions send (``grad_comm_dtype``), if any.
        ``gather_wire``: the sharded strategies' packed weight gathers (``param_gather_dtype``), if any."""
        self.bucket_id, self.spec, self.sharding, self.group = bucket_id, spec, sharding, group
        self.grad_comm, self.gather_wire = grad_comm, gather_wire
        self.gather_group = group if gather_group is None else gather_group
        self.label = f"fsdp.bucket{bucket_id}"  # in telemetry
        self.outer = outer
        self.layout: BucketLayout = bucket_layout(spec, sharding, group, outer)
        self.ranges = BucketRanges.of(self.layout, sharding, group, outer)
        self.dtype, self.device = spec.dtype, device
        self.allocators = allocators or BucketAllocators.dynamic()

        if sharding.shard_params:
            weight = self.allocators.weights.allocate(bucket_id, self.weight_request)
        else:
            weight = torch.empty(self.layout.size, dtype=self.dtype, device=device)
        with torch.no_grad():
            weight.zero_()  # the padding stays zero
            for param, view in zip(spec.params, item_views(weight, self.layout.items), strict=True):
                if param not in unset:
                    view.copy_(param.detach())
        self.weight = weight
        self._point_params_at_weight()
        main_dtype = policy.main_dtype(self.dtype)
        # ZeRO-1/2 with packed gathers: this rank's piece of the compute weights takes its unpacked values,
        # so the exact weights (the optimizer's, and a frozen bucket's) are kept apart
        packed_in_place = gather_wire is not None and sharding.shard_main and not sharding.shard_params
        pieces = outer.pieces if outer is not None else 1
        keep_main = main_dtype != self.dtype or pieces > 1 or packed_in_place
        self.kept = KeptWeights(weight, self.ranges, sharding.shard_params, main_dtype if keep_main else None)

        self.grad_dtype = policy.grad_dtype(self.dtype)
        self.comm_dtype = policy.comm_dtype(self.dtype)
        self.grad: torch.Tensor | None = None
        self.unreduced = UnreducedGrads(
            self.allocators.grads, bucket_id, self.layout, self.comm_dtype, device
        )
        self.non_finite_params: list[str] = []  # report_nan_in_param_grad: this rank's, in this cycle
        self._zeroing = GradZeroing()
        if spec.requires_grad:
            lo, hi = self.ranges.grad
            self.grad = grad_storage
            if self.grad is None:
                self.grad = torch.zeros(hi - lo, dtype=self.grad_dtype, device=device)
        self.reducer = GradReducer(self)
        # FSDP2's set_gradient_divide_factor: the reduced grads are the ranks' sum divided by this (None:
        # the root's scaling, an average over the data-parallel ranks)
        self.divide_factor: float | None = None
        self.comm_hook: RegisteredHook | None = None  # MegatronFSDP.register_comm_hook's
        self.all_reduce_hook: Callable[[torch.Tensor], None] | None = None  # FSDPModule's, on each shard
        self.hook_index = 0  # this bucket's index as the hook sees it
        self.status = BucketStatus.READY_TO_USE
        if packed_in_place:  # the first forward computes with the packed weights too, as every later one
            self.mark_replicas_stale()
        self.stats = CommStats()  # this step's collectives (bytes, spans), as gradsync-ddp's bucket groups
        self.weight_gather = WeightGather(
            self.ranges, self.gather_group, outer, gather_wire, device, self.label, self.stats
        )
        self._gather: Launched | None = None
        self.gather_together: Callable[[], bool] | None = None  # a coalesced group's (ZeRO-1/2)
        if sharding.shard_params:
            self.release()

    # --- coordinates (:class:`BucketRanges`) -------------------------------------------------------
    @property
    def weight_request(self) -> BufferRequest:
        return BufferRequest(self.layout.size, self.dtype, self.device)

    def optimizer_source(self) -> tuple[torch.Tensor, int]:
        """The tensor the optimizer's params view, and the buffer coordinate of its first element."""
        return self.kept.optimizer_source(self.weight)

    def local_span(self, index: int) -> tuple[int, int]:
        """Buffer coordinates of item ``index``'s rows this rank's optimizer owns."""
        return self.ranges.local_span(index)

    def owned_rows(self, index: int) -> tuple[int, int]:
        """Rows ``[first, last)`` of item ``index`` whose optimizer state this rank owns."""
        return self.ranges.owned_rows(index)

    def first_row(self, index: int) -> int | None:
        """The global row this rank's shard of item ``index`` starts at where the main weights are sharded
        (else None): DCP and the optimizer state's description place the shard by it."""
        return self.owned_rows(index)[0] if self.sharding.shard_main else None

    def local_view(self, tensor: torch.Tensor, base: int, index: int) -> torch.Tensor:
        """Item ``index``'s locally owned rows of ``tensor`` (whose first element is coordinate ``base``)."""
        start, end = self.local_span(index)
        return item_view(tensor, base, start, end, self.layout.items[index].shape)

    # --- compute weights ---------------------------------------------------------------------------
    @property
    def weight_shard(self) -> torch.Tensor | None:
        """ZeRO-3: this rank's shard of the compute weights (:class:`KeptWeights`)."""
        return self.kept.shard

    @property
    def main_weight(self) -> torch.Tensor | None:
        """The weights this rank's optimizer steps, where they are not the compute weights."""
        return self.kept.main

    def launch_gather(self) -> None:
        """Start filling the whole compute buffer from every rank's shard (no-op when it is current);
        a bucket of a coalesced group (:attr:`gather_together`) has its group gather it."""
        if self.status is not BucketStatus.EMPTY:
            return
        if self.gather_together is not None and self.gather_together():
            return  # its group launched this bucket's gather, with the others' or alone
        self.launch_gather_alone()

    def launch_gather_alone(self) -> None:
        """Start this bucket's own gather (it is stale)."""
        if self.weight_shard is not None:
            self._point_params_at(self.allocators.weights.allocate(self.bucket_id, self.weight_request))
        self._gather = self.weight_gather.launch(self.weight, self.weight_shard)
        self.status = BucketStatus.COMMUNICATING

    def adopt_gather(self, launched: Launched) -> None:
        """A group's gather fills this stale bucket too: waiting either waits the one collective."""
        self._gather = launched
        self.status = BucketStatus.COMMUNICATING

    def wait_exact_gather(self) -> None:
        """The whole compute buffer in full precision (exports, broadcasts): a packed gather is redone.
        ZeRO-1/2 first put the exact weights back in this rank's piece, and gather packed again at the
        next use, so the exports change nothing the forward sees."""
        kept_whole = self.weight_shard is None and self.sharding.shard_main
        if self.gather_wire is not None:
            if kept_whole:
                self.wait_gather()  # a packed gather in flight lands first
                assert self.main_weight is not None
                self.weight[self.ranges.shard_lo : self.ranges.shard_hi].copy_(self.main_weight)
                self.status = BucketStatus.EMPTY
            else:
                self.release()
        with self.weight_gather.exact():
            self.wait_gather()
        if self.gather_wire is not None and kept_whole:
            self.status = BucketStatus.EMPTY

    def wait_gather(self) -> None:
        if self.status is BucketStatus.EMPTY:
            self.launch_gather()
        if self._gather is not None:
            self._gather.wait()
            self._gather = None
        self.status = BucketStatus.READY_TO_USE

    def release(self) -> None:
        """ZeRO-3: drop the whole compute buffer (the params' views go with it)."""
        if self.weight_shard is None or self.status is BucketStatus.EMPTY:
            return
        self.wait_gather()
        self.allocators.weights.free(self.bucket_id)
        self.status = BucketStatus.EMPTY

    def _point_params_at(self, weight: torch.Tensor) -> None:
        """Make ``weight`` the compute buffer; re-point the params when it is a different tensor."""
        if weight is not self.weight:
            self.weight = weight
            self._point_params_at_weight()

    def _point_params_at_weight(self) -> None:
        for param, view in zip(self.spec.params, item_views(self.weight, self.layout.items), strict=True):
            param.data = view

    def mark_replicas_stale(self) -> None:
        """ZeRO-1/2: other ranks' shards of the compute buffer changed; gather before the next use."""
        if self.sharding.shard_main and self.weight_shard is None and self.layout.world > 1:
            self.status = BucketStatus.EMPTY

    def install_main_weights(self) -> None:
        """Copy the optimizer's updated weights into this rank's part of the compute weights."""
        self.kept.install(self.weight)
        # outer optim: the other pieces may have changed on their ranks (every rank must agree, so frozen
        # buckets are gathered too: a load writes each rank's piece only)
        self.weight_gather.outer_stale = self.outer is not None and self.outer.pieces > 1
        self.mark_replicas_stale()

    def write_param(self, index: int, value: torch.Tensor) -> None:
        """Set item ``index`` to ``value`` (the whole param) in the compute and main weights this rank
        keeps, so no whole bucket is needed (meta-device init)."""
        self.kept.write(self.weight, self.layout.items[index], value)

    def reset_from_weights(self) -> None:
        """Re-derive this rank's weight shard and main weights from the whole compute buffer."""
        self.kept.reset(self.weight)
        self.weight_gather.outer_stale = False

    # --- grads (reductions: :class:`GradReducer`) ---------------------------------------------------
    def unreduced_grads(self) -> torch.Tensor:
        """This backward's whole-bucket grads: the temporary buffer (ZeRO-2/3) or the grad buffer."""
        assert self.grad is not None
        return self.unreduced.buffer() if self.sharding.shard_grads else self.grad

    def can_take_grads(self) -> bool:
        """Whether the first grad of this backward would get a buffer now (double buffers can be full)."""
        return self.unreduced.can_take()

    def launch_outer_reduce(self, reduction: GradReduction) -> Launched:
        """The cycle's outer stage over the outer group (:meth:`GradReducer.launch_outer`)."""
        return self.reducer.launch_outer(reduction)

    def set_aside_reduced(self) -> None:
        """Keep this cycle's reduced grads apart from a later reduction (:meth:`GradReducer.set_aside`)."""
        self.reducer.set_aside()

    def record(
        self, op: str, payload: torch.Tensor, group: dist.ProcessGroup, sent: int | None = None
    ) -> None:
        """Account one collective of this bucket in its step's :class:`CommStats` (``sent``: the bytes on
        the wire, when they are not ``payload``'s own)."""
        record_collective(self.stats, op, payload, group, sent)

    def stepped_grads(self) -> torch.Tensor:
        """The part of the grad buffer this rank's optimizer steps: its shard (ZeRO-1/2/3; the same rows
        on rank r of every replica of the model), or all of it (no_shard)."""
        assert self.grad is not None
        lo, hi = self.ranges.main
        base = self.ranges.grad[0]
        return self.grad[lo - base : hi - base]

    def grad_view(self, index: int) -> torch.Tensor | None:
        """Item ``index``'s reduced grad rows owned by this rank, empty when it owns none (every rank
        holds a grad, so torch's ops over all grads, ``clip_grad_norm_``, issue the same collectives on
        every rank); None for frozen buckets."""
        if self.grad is None:
            return None
        return self.local_view(self.grad, self.ranges.grad[0], index)

    def zero_grad(self) -> None:
        """Zero the grads unless nothing wrote them since they were last zeroed (:class:`GradZeroing`)."""
        if self.grad is not None and self._zeroing.needed(self.grad):
            self.grad.zero_()
        self.unreduced.drop()
        self.reducer.forget_set_aside()

    def note_zeroed(self) -> None:
        """Called once every bucket is zeroed (:meth:`GradZeroing.note_zeroed`)."""
        if self.grad is not None:
            self._zeroing.note_zeroed(self.grad)

    def note_reduction(self) -> None:
        """A collective is about to write this bucket's grads (see :meth:`zero_grad`)."""
        self._zeroing.note_reduction()


class GradReducer:
    """Reduces one bucket's grads into its grad buffer, with the reduction settings the bucket holds."""

    def __init__(self, bucket: FlatParamBucket) -> None:
        self._bucket = weakref.ref(bucket)
        self._reduced_earlier: torch.Tensor | None = None  # see set_aside

    @property
    def bucket(self) -> FlatParamBucket:
        """The bucket, held weakly: it owns its reducer, and a dropped bucket (with its buffers) is freed
        by reference counting, without waiting for the cycle collector."""
        bucket = self._bucket()
        assert bucket is not None, "the bucket was dropped"
        return bucket

    def launch(self, reduction: GradReduction, norms: LocalGradNorms | None) -> Launched:
        """The inner stage. ``norms``: record the local grads' norm first, on the device (the NaN check
        reads it at ``finish_grad_sync``)."""
        bucket = self.bucket
        assert bucket.grad is not None
        if bucket.sharding.shard_grads:
            wire = bucket.unreduced.buffer()  # zeros when no param of the bucket got a grad
        else:
            grad = bucket.grad
            wire = grad if bucket.comm_dtype == bucket.grad_dtype else grad.to(bucket.comm_dtype)
        if norms is not None:
            norms.record(bucket.bucket_id, wire)
        if bucket.comm_hook is not None:
            launched = self._launch_hook(wire, reduction)
            bucket.record("all_reduce", wire, bucket.group)
        else:
            factor = reduction.factor_for(bucket)
            if factor != 1.0:
                wire.mul_(factor)
            scatter = bucket.sharding.shard_main
            launched, sent = reduce_bucket(
                wire, bucket.group, bucket.grad_comm, bucket.bucket_id, scatter=scatter,
                average=reduction.average, cuts=bucket.ranges.inner_cuts, label=bucket.label,
            )  # fmt: skip
            bucket.record("reduce_scatter" if scatter else "all_reduce", wire, bucket.group, sent)
        launched.after.append(lambda: self.finish(wire))
        return launched

    def _launch_hook(self, wire: torch.Tensor, reduction: GradReduction) -> Launched:
        """Hand the whole-bucket ``wire`` to the comm hook, which averages it over the group (as torch's
        hooks do): scaled first so that mean is the reduction asked for. Sharded strategies then keep
        their shard of the all-reduced bucket."""
        bucket = self.bucket
        assert bucket.comm_hook is not None
        scale = reduction.factor_for(bucket) * (1 if reduction.average else bucket.group.size())
        if scale != 1.0:
            wire.mul_(scale)
        views = item_views(wire, bucket.layout.items)  # each param's grads, as the hook sees them
        hooked = HookBucket(wire, bucket.spec.params, views, bucket.hook_index)
        work = bucket.comm_hook.launch(hooked)
        return Launched([work]).record("all_reduce", f"{bucket.label}.hook", wire, bucket.group)

    def finish(self, wire: torch.Tensor) -> None:
        """Land the reduced ``wire`` (the bucket's grads on the wire) in the grad buffer."""
        bucket = self.bucket
        assert bucket.grad is not None
        if bucket.sharding.shard_grads:
            self.finish_shard(wire[bucket.ranges.shard_lo : bucket.ranges.shard_hi])
            return
        if wire is not bucket.grad:
            bucket.grad.copy_(wire)
        if bucket.outer is None:  # otherwise the outer stage ends the reduction
            self._add_back_reduced()

    def finish_shard(self, shard: torch.Tensor) -> None:
        """Land this rank's reduced shard (a reduce-scatter's result) in the grad buffer, after the
        FSDP2-style all-reduce hook has had it (torch's order: the hook sees this backward's reduced
        shard, before it accumulates)."""
        bucket = self.bucket
        assert bucket.grad is not None
        if bucket.all_reduce_hook is not None:
            bucket.all_reduce_hook(shard)
        if bucket.sharding.shard_grads:
            bucket.grad.add_(shard)
            bucket.unreduced.drop()
        else:
            bucket.grad[bucket.ranges.shard_lo : bucket.ranges.shard_hi].copy_(shard)
        if bucket.outer is None:
            self._add_back_reduced()

    def launch_outer(self, reduction: GradReduction) -> Launched:
        """The cycle's outer stage: all-reduce the grads this rank's optimizer steps over the outer group
        (outer ``no_shard``), or reduce-scatter the inner grad shard into this rank's piece (``optim``).
        The inner stage already applied the scaling factor."""
        bucket, outer = self.bucket, self.bucket.outer
        assert outer is not None
        assert bucket.grad is not None
        region = bucket.grad if outer.shard else self.bucket.stepped_grads()
        wire = region if bucket.comm_dtype == region.dtype else region.to(bucket.comm_dtype)
        launched, sent = reduce_bucket(
            wire, outer.group, bucket.grad_comm, (bucket.bucket_id, "outer"), scatter=outer.shard,
            average=reduction.average, cuts=bucket.ranges.outer_cuts, label=f"{bucket.label}.outer",
        )  # fmt: skip
        if wire is not region:

            def copy_back() -> None:
                region.copy_(wire)

            launched.after.append(copy_back)
        launched.after.append(self._add_back_reduced)
        bucket.record("reduce_scatter" if outer.shard else "all_reduce", wire, outer.group, sent)
        return launched

    def set_aside(self) -> None:
        """A grad arrives after this cycle's final reduction (accumulation without ``no_sync()``): keep the
        reduced grads the optimizer reads apart and zero the buffer, so the next reduction sees only new
        grads; it adds them back when it ends. The sum of reduced grads is what ZeRO-2/3 accumulate."""
        assert self.bucket.grad is not None
        assert self._reduced_earlier is None, "set aside twice without a reduction in between"
        self._reduced_earlier = self.bucket.stepped_grads().clone()
        self.bucket.grad.zero_()

    def forget_set_aside(self) -> None:
        """The grads were zeroed: what was set aside is gone with them."""
        self._reduced_earlier = None

    def _add_back_reduced(self) -> None:
        if self._reduced_earlier is not None:
            self.bucket.stepped_grads().add_(self._reduced_earlier)
            self._reduced_earlier = None
