"""One bucket's storage and collectives: compute weights, main weights and grads as flat buffers.

Params are views into the bucket's flat compute-weight buffer (zero-copy: a gather or a grad
reduction works on the buffer itself, never on per-param copies). What is kept whole and what only as
this rank's shard follows the strategy (:class:`~gradsync.fsdp.strategy.Sharding`). Under ZeRO-3 the
whole compute buffer exists only between :meth:`FlatParamBucket.launch_gather` and
:meth:`FlatParamBucket.release`, and ZeRO-2/3's whole-bucket grads only until their reduce-scatter is
done; both come from the bucket's allocators (:mod:`gradsync.fsdp.allocators`), and the params are
re-pointed whenever the weight buffer is a different tensor than last time. The optimizer's params are
views of the main-weight buffer (or, when the main dtype is the compute dtype, of the compute weights
themselves), so its in-place updates land in the buffer.

The bucket holds that state and decides when each step happens; one collaborator per job does it:
:class:`~gradsync.fsdp.bucket_ranges.BucketRanges` (where this rank's pieces lie),
:class:`~gradsync.fsdp.kept_weights.KeptWeights` (its weight shard and main weights),
:class:`~gradsync.fsdp.weight_gather.WeightGather` (the gathers),
:class:`~gradsync.fsdp.unreduced_grads.UnreducedGrads` (ZeRO-2/3's borrowed grads),
:class:`~gradsync.fsdp.grad_reduction.GradReducer` (the reductions) and
:class:`~gradsync.fsdp.grad_zeroing.GradZeroing` (skipped zeroings).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from enum import Enum

import torch
import torch.distributed as dist

from gradsync.buffers.collectives import Launched
from gradsync.buffers.comm_hook import RegisteredHook
from gradsync.buffers.grad_checks import LocalGradNorms
from gradsync.buffers.low_precision_reduce import GradCommWire
from gradsync.buffers.shard_alignment import shard_alignment_of
from gradsync.buffers.stats import CommStats
from gradsync.buffers.wire_format import WireFormat

from .allocators import BucketAllocator, BufferRequest, StorageResizeBucketAllocator
from .bucket_ranges import BucketRanges
from .collective_stats import record_collective
from .flat_views import item_view, item_views
from .grad_reduction import GradReducer
from .grad_zeroing import GradZeroing
from .hsdp import OuterReplication
from .kept_weights import KeptWeights
from .layout import BucketLayout, compute_bucket_layout
from .mixed_precision import MixedPrecisionPolicy
from .strategy import Sharding
from .units import BucketSpec
from .unreduced_grads import UnreducedGrads
from .weight_gather import WeightGather


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
    :mod:`gradsync.fsdp.lanes`: the same ranks, so a gather does not queue behind a reduction; default
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

    def launch_reduce(self, reduction: GradReduction, norms: LocalGradNorms | None = None) -> Launched:
        """Scale and reduce this bucket's grads into the grad buffer (:meth:`GradReducer.launch`)."""
        return self.reducer.launch(reduction, norms)

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
