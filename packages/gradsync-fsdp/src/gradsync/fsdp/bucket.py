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
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Collection
from dataclasses import dataclass
from enum import Enum

import torch
import torch.distributed as dist

from gradsync.buffers.collectives import Launched, all_gather_shards, chain
from gradsync.buffers.comm_hook import HookBucket, RegisteredHook
from gradsync.buffers.grad_checks import LocalGradNorms
from gradsync.buffers.low_precision_reduce import GradCommWire, reduce_bucket
from gradsync.buffers.shard_alignment import shard_alignment_of
from gradsync.buffers.stats import CommStats
from gradsync.buffers.wire_format import WireFormat

from .allocators import BucketAllocator, BufferRequest, StorageResizeBucketAllocator
from .hsdp import OuterReplication
from .layout import BucketLayout, ItemPlacement, compute_bucket_layout
from .mixed_precision import MixedPrecisionPolicy
from .strategy import Sharding
from .torch_internals import version_counter
from .units import BucketSpec


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
        self._exact_gather = False  # exports and broadcasts gather the full-precision shards
        self._packed_cuts: tuple[list[int], list[int] | None] | None = None  # packed rows' byte cuts
        self.gather_group = group if gather_group is None else gather_group
        self.label = f"fsdp.bucket{bucket_id}"  # in telemetry
        self.outer = outer
        self.layout: BucketLayout = bucket_layout(spec, sharding, group, outer)
        pieces = outer.pieces if outer is not None else 1
        # This rank's shard of the layout: inner rank i, outer piece o -> i*M + o (the inner dim cuts first).
        self.rank = group.rank() * pieces + (outer.piece if outer is not None else 0)
        self.shard_lo, self.shard_hi = 0, self.layout.size  # the inner shard: gathers and grads
        cuts, first = self.layout.cuts, group.rank() * pieces
        if sharding.shard_main:
            self.shard_lo, self.shard_hi = cuts[first], cuts[first + pieces]
        # ragged shards: the boundaries the collectives take, of the inner shards and of this one's pieces
        self.inner_cuts = cuts[::pieces] if self.layout.ragged else None
        self.outer_cuts = (
            tuple(cut - self.shard_lo for cut in cuts[first : first + pieces + 1])
            if self.layout.ragged and pieces > 1
            else None
        )
        self._outer_stale = False  # outer optim: other pieces of the inner weight shard are outdated
        self.dtype, self.device = spec.dtype, device
        self.allocators = allocators or BucketAllocators.dynamic()

        if sharding.shard_params:
            weight = self.allocators.weights.allocate(bucket_id, self.weight_request)
        else:
            weight = torch.empty(self.layout.size, dtype=self.dtype, device=device)
        with torch.no_grad():
            weight.zero_()  # the padding stays zero
            for param, item in zip(spec.params, self.layout.items, strict=True):
                if param not in unset:
                    self._item_view(weight, 0, item.offset, item.end, item.shape).copy_(param.detach())
        self.weight = weight
        self._point_params_at_weight()
        self.weight_shard = (
            self.weight[self.shard_lo : self.shard_hi].clone() if sharding.shard_params else None
        )

        main_dtype = policy.main_dtype(self.dtype)
        self.main_weight: torch.Tensor | None = None
        # ZeRO-1/2 with packed gathers: this rank's piece of the compute weights takes its unpacked values,
        # so the exact weights (the optimizer's, and a frozen bucket's) are kept apart
        packed_in_place = gather_wire is not None and sharding.shard_main and not sharding.shard_params
        if main_dtype != self.dtype or pieces > 1 or packed_in_place:
            lo, hi = self.main_range
            self.main_weight = self.weight[lo:hi].to(main_dtype, copy=True)

        self.grad_dtype = policy.grad_dtype(self.dtype)
        self.comm_dtype = policy.comm_dtype(self.dtype)
        self.grad: torch.Tensor | None = None
        self._unreduced: torch.Tensor | None = None  # ZeRO-2/3: this backward's whole-bucket grads
        self._unreduced_items: list[torch.Tensor | None] = []  # each param's view of it, built when used
        self._unreduced_items_of: torch.Tensor | None = None  # the buffer those views are of
        self._reduced_earlier: torch.Tensor | None = None  # see set_aside_reduced
        self.non_finite_params: list[str] = []  # report_nan_in_param_grad: this rank's, in this cycle
        self._grad_items: list[torch.Tensor] = []  # no_shard / ZeRO-1: each param's view of self.grad
        self._grads_reduced_into = True  # see zero_grad
        self._zeroed_version = -1
        if spec.requires_grad:
            lo, hi = self.grad_range
            self.grad = grad_storage
            if self.grad is None:
                self.grad = torch.zeros(hi - lo, dtype=self.grad_dtype, device=device)
            if not sharding.shard_grads:
                self._grad_items = [
                    self._item_view(self.grad, 0, item.offset, item.end, item.shape)
                    for item in self.layout.items
                ]
                for param, view in zip(spec.params, self._grad_items, strict=True):
                    param.main_grad = view  # type: ignore[attr-defined]
        self.comm_hook: RegisteredHook | None = None  # MegatronFSDP.register_comm_hook's
        self.hook_index = 0  # this bucket's index as the hook sees it
        self.status = BucketStatus.READY_TO_USE
        if packed_in_place:  # the first forward computes with the packed weights too, as every later one
            self.mark_replicas_stale()
        self.stats = CommStats()  # this step's collectives (bytes, spans), as gradsync-ddp's bucket groups
        self._gather: Launched | None = None
        self.gather_together: Callable[[], bool] | None = None  # a coalesced group's (ZeRO-1/2)
        if sharding.shard_params:
            self.release()

    # --- coordinates -------------------------------------------------------------------------------
    @property
    def weight_request(self) -> BufferRequest:
        return BufferRequest(self.layout.size, self.dtype, self.device)

    @property
    def grad_request(self) -> BufferRequest:
        return BufferRequest(self.layout.size, self.comm_dtype, self.device)

    @property
    def main_range(self) -> tuple[int, int]:
        """Buffer coordinates the main weights (and the optimizer) cover on this rank."""
        return self.layout.shard_range(self.rank) if self.sharding.shard_main else (0, self.layout.size)

    @property
    def grad_range(self) -> tuple[int, int]:
        """Buffer coordinates the persistent grad buffer covers on this rank."""
        return (self.shard_lo, self.shard_hi) if self.sharding.shard_grads else (0, self.layout.size)

    def optimizer_source(self) -> tuple[torch.Tensor, int]:
        """The tensor the optimizer's params view, and the buffer coordinate of its first element."""
        if self.main_weight is not None:
            return self.main_weight, self.main_range[0]
        if self.weight_shard is not None:
            return self.weight_shard, self.shard_lo
        return self.weight, 0

    def local_span(self, index: int) -> tuple[int, int]:
        """Buffer coordinates of item ``index``'s rows this rank's optimizer owns."""
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

    def local_view(self, tensor: torch.Tensor, base: int, index: int) -> torch.Tensor:
        """Item ``index``'s locally owned rows of ``tensor`` (whose first element is coordinate ``base``)."""
        start, end = self.local_span(index)
        shape = self.layout.items[index].shape
        return self._item_view(tensor, base, start, end, shape)

    @staticmethod
    def _item_view(tensor: torch.Tensor, base: int, start: int, end: int, shape: torch.Size) -> torch.Tensor:
        flat = tensor[start - base : end - base]
        if len(shape) <= 1:
            return flat.view(-1) if len(shape) == 1 else flat.view(shape)
        return flat.view(-1, *shape[1:])

    # --- compute weights ---------------------------------------------------------------------------
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
        if self._outer_stale:  # outer optim, first gather after a step: the outer pieces first
            assert self.outer is not None
            assert self.weight_shard is not None
            self._outer_stale = False
            self.record("all_gather", self.weight_shard, self.outer.group)
            outer = all_gather_shards(
                self.weight_shard, self.outer.group, cuts=self.outer_cuts, label=f"{self.label}.outer"
            )
            self._gather = chain(outer, self._gather_inner, self.outer.group, self.device)
        else:
            self._gather = self._gather_inner()
        self.status = BucketStatus.COMMUNICATING

    def adopt_gather(self, launched: Launched) -> None:
        """A group's gather fills this stale bucket too: waiting either waits the one collective."""
        self._gather = launched
        self.status = BucketStatus.COMMUNICATING

    def _gather_inner(self) -> Launched:
        if self.gather_wire is not None and not self._exact_gather:
            own = self.weight_shard  # ZeRO-1/2: the piece install_main_weights wrote, exact
            return self._gather_packed(self.gather_wire, own if own is not None else self._own_piece())
        if self.weight_shard is not None:
            self.weight[self.shard_lo : self.shard_hi].copy_(self.weight_shard)
        self.record("all_gather", self.weight, self.gather_group)
        return all_gather_shards(self.weight, self.gather_group, cuts=self.inner_cuts, label=self.label)

    def _gather_packed(self, wire: WireFormat, shard: torch.Tensor) -> Launched:
        """Every rank packs its own shard in ``wire`` and gathers the packed bytes; every rank, this one
        included, computes with the unpacked values, so all compute with the same weights."""
        cuts = self.layout.cuts
        if self._packed_cuts is None:  # the layout is fixed: once per bucket
            lengths = [hi - lo for lo, hi in itertools.pairwise(cuts)]
            byte_cuts = [0, *itertools.accumulate(wire.row_bytes(n) for n in lengths)]
            self._packed_cuts = (byte_cuts, None if len(set(lengths)) == 1 else byte_cuts)
        byte_cuts, uneven = self._packed_cuts
        packed = torch.empty(byte_cuts[-1], dtype=torch.uint8, device=self.device)
        rank = self.gather_group.rank()
        packed[byte_cuts[rank] : byte_cuts[rank + 1]] = wire.pack_row(shard)
        self.record("all_gather", packed, self.gather_group)
        launched = all_gather_shards(packed, self.gather_group, cuts=uneven, label=self.label)

        def unpack() -> None:
            for r, (lo, hi) in enumerate(itertools.pairwise(cuts)):
                if hi > lo:
                    self.weight[lo:hi].copy_(
                        wire.unpack_row(packed[byte_cuts[r] : byte_cuts[r + 1]], hi - lo)
                    )

        launched.after.append(unpack)
        return launched

    def _own_piece(self) -> torch.Tensor:
        return self.weight[self.shard_lo : self.shard_hi]

    def wait_exact_gather(self) -> None:
        """The whole compute buffer in full precision (exports, broadcasts): a packed gather is redone.
        ZeRO-1/2 first put the exact weights back in this rank's piece, and gather packed again at the
        next use, so the exports change nothing the forward sees."""
        kept_whole = self.weight_shard is None and self.sharding.shard_main
        if self.gather_wire is not None:
            if kept_whole:
                self.wait_gather()  # a packed gather in flight lands first
                assert self.main_weight is not None
                self._own_piece().copy_(self.main_weight)
                self.status = BucketStatus.EMPTY
            else:
                self.release()
        self._exact_gather = True
        try:
            self.wait_gather()
        finally:
            self._exact_gather = False
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
        for param, item in zip(self.spec.params, self.layout.items, strict=True):
            param.data = self._item_view(self.weight, 0, item.offset, item.end, item.shape)

    def mark_replicas_stale(self) -> None:
        """ZeRO-1/2: other ranks' shards of the compute buffer changed; gather before the next use."""
        if self.sharding.shard_main and self.weight_shard is None and self.layout.world > 1:
            self.status = BucketStatus.EMPTY

    def install_main_weights(self) -> None:
        """Copy the optimizer's updated weights into this rank's part of the compute weights."""
        with torch.no_grad():
            if self.main_weight is not None:
                lo, hi = self.main_range
                if self.weight_shard is not None:
                    target = self.weight_shard[lo - self.shard_lo : hi - self.shard_lo]
                else:
                    target = self.weight[lo:hi]
                target.copy_(self.main_weight)
        # outer optim: the other pieces may have changed on their ranks (every rank must agree, so frozen
        # buckets are gathered too: a load writes each rank's piece only)
        self._outer_stale = self.outer is not None and self.outer.pieces > 1
        self.mark_replicas_stale()

    def write_param(self, index: int, value: torch.Tensor) -> None:
        """Set item ``index`` to ``value`` (the whole param) in the compute and main weights this rank
        keeps, so no whole bucket is needed (meta-device init)."""
        item = self.layout.items[index]
        flat = value.reshape(-1)
        with torch.no_grad():
            if self.weight_shard is None:
                self.weight[item.offset : item.end].copy_(flat)
            else:
                _copy_overlap(self.weight_shard, self.shard_lo, flat, item)
            if self.main_weight is not None:
                _copy_overlap(self.main_weight, self.main_range[0], flat, item)

    def reset_from_weights(self) -> None:
        """Re-derive this rank's weight shard and main weights from the whole compute buffer."""
        with torch.no_grad():
            if self.weight_shard is not None:
                self.weight_shard.copy_(self.weight[self.shard_lo : self.shard_hi])
            if self.main_weight is not None:
                lo, hi = self.main_range
                self.main_weight.copy_(self.weight[lo:hi])
        self._outer_stale = False

    # --- grads -------------------------------------------------------------------------------------
    def accumulate(self, index: int, grad: torch.Tensor) -> None:
        """Add one param's grad from this backward into the bucket."""
        target = self._unreduced_item(index) if self.sharding.shard_grads else self._grad_items[index]
        target.add_(grad)

    def _unreduced_item(self, index: int) -> torch.Tensor:
        """Item ``index``'s view of this backward's whole-bucket grads. The views are kept while the
        allocator lends the same tensor (the default storage-resize one does, every backward), so the
        hook of a later backward adds into a kept view, as no_shard's and ZeRO-1's do."""
        buffer = self._unreduced_grads()
        if buffer is not self._unreduced_items_of:
            self._unreduced_items_of, self._unreduced_items = buffer, [None] * len(self.layout.items)
        view = self._unreduced_items[index]
        if view is None:
            item = self.layout.items[index]
            view = self._item_view(buffer, 0, item.offset, item.end, item.shape)
            self._unreduced_items[index] = view
        return view

    def launch_reduce(self, reduction: GradReduction, norms: LocalGradNorms | None = None) -> Launched:
        """Scale and reduce this bucket's grads: reduce-scatter into the shard (ZeRO-1/2/3; ZeRO-2/3 add
        it to the accumulated shard), or all-reduce the whole buffer (no_shard). ``norms``: record the
        local grads' norm first, on the device (the NaN check reads it at ``finish_grad_sync``)."""
        assert self.grad is not None
        if self.sharding.shard_grads:
            wire = self._unreduced_grads()  # zeros when no param of the bucket got a grad
        else:
            wire = self.grad if self.comm_dtype == self.grad_dtype else self.grad.to(self.comm_dtype)
        if norms is not None:
            norms.record(self.bucket_id, wire)
        if self.comm_hook is not None:
            launched = self._launch_hook(wire, reduction)
            self.record("all_reduce", wire, self.group)
        else:
            if reduction.factor != 1.0:
                wire.mul_(reduction.factor)
            scatter = self.sharding.shard_main
            launched, sent = reduce_bucket(
                wire, self.group, self.grad_comm, self.bucket_id, scatter=scatter,
                average=reduction.average, cuts=self.inner_cuts, label=self.label,
            )  # fmt: skip
            self.record("reduce_scatter" if scatter else "all_reduce", wire, self.group, sent)
        launched.after.append(lambda: self.finish_reduce(wire))
        return launched

    def _launch_hook(self, wire: torch.Tensor, reduction: GradReduction) -> Launched:
        """Hand the whole-bucket ``wire`` to the comm hook, which averages it over the group (as torch's
        hooks do): scaled first so that mean is the reduction asked for. Sharded strategies then keep
        their shard of the all-reduced bucket."""
        assert self.comm_hook is not None
        scale = reduction.factor * (1 if reduction.average else self.group.size())
        if scale != 1.0:
            wire.mul_(scale)
        bucket = HookBucket(wire, self.spec.params, self._grad_views(wire), self.hook_index)
        work = self.comm_hook.launch(bucket)
        return Launched([work]).record("all_reduce", f"{self.label}.hook", wire, self.group)

    def _grad_views(self, wire: torch.Tensor) -> list[torch.Tensor]:
        """Each param's view of the whole-bucket ``wire``: the views the grad hooks add into where ``wire``
        is their buffer (kept across steps), else built for this cast copy."""
        if self.sharding.shard_grads:
            return [self._unreduced_item(index) for index in range(len(self.layout.items))]
        if wire is self.grad:
            return self._grad_items
        return [self._item_view(wire, 0, item.offset, item.end, item.shape) for item in self.layout.items]

    def finish_reduce_shard(self, shard: torch.Tensor) -> None:
        """Land this rank's reduced shard (a reduce-scatter's result) in the grad buffer."""
        assert self.grad is not None
        if self.sharding.shard_grads:
            self.grad.add_(shard)
            self._drop_unreduced()
        else:
            self.grad[self.shard_lo : self.shard_hi].copy_(shard)
        if self.outer is None:
            self._add_back_reduced()

    def unreduced_grads(self) -> torch.Tensor:
        """This backward's whole-bucket grads: the temporary buffer (ZeRO-2/3) or the grad buffer."""
        assert self.grad is not None
        return self._unreduced_grads() if self.sharding.shard_grads else self.grad

    def _unreduced_grads(self) -> torch.Tensor:
        """ZeRO-2/3: this backward's whole-bucket grads, zeroed when first asked for."""
        if self._unreduced is None:
            self._unreduced = self.allocators.grads.allocate(self.bucket_id, self.grad_request).zero_()
        return self._unreduced

    def can_take_grads(self) -> bool:
        """Whether the first grad of this backward would get a buffer now (double buffers can be full)."""
        return self._unreduced is not None or self.allocators.grads.can_allocate(self.bucket_id)

    def _drop_unreduced(self) -> None:
        if self._unreduced is not None:
            self._unreduced = None
            self.allocators.grads.free(self.bucket_id)

    def finish_reduce(self, wire: torch.Tensor) -> None:
        """Land the reduced ``wire`` (this bucket's grads on the wire) in the grad buffer."""
        assert self.grad is not None
        if self.sharding.shard_grads:
            self.finish_reduce_shard(wire[self.shard_lo : self.shard_hi])
            return
        if wire is not self.grad:
            self.grad.copy_(wire)
        if self.outer is None:  # otherwise the outer stage ends the reduction
            self._add_back_reduced()

    def set_aside_reduced(self) -> None:
        """A grad arrives after this cycle's final reduction (accumulation without ``no_sync()``): keep the
        reduced grads the optimizer reads apart and zero the buffer, so the next reduction sees only new
        grads; it adds them back when it ends. The sum of reduced grads is what ZeRO-2/3 accumulate."""
        assert self.grad is not None
        assert self._reduced_earlier is None, "set aside twice without a reduction in between"
        lo, hi = self.main_range
        base = self.grad_range[0]
        self._reduced_earlier = self.grad[lo - base : hi - base].clone()
        self.grad.zero_()

    def _add_back_reduced(self) -> None:
        if self._reduced_earlier is not None:
            assert self.grad is not None
            lo, hi = self.main_range
            base = self.grad_range[0]
            self.grad[lo - base : hi - base].add_(self._reduced_earlier)
            self._reduced_earlier = None

    def launch_outer_reduce(self, reduction: GradReduction) -> Launched:
        """The cycle's outer stage: all-reduce the grads this rank's optimizer steps over the outer group
        (outer ``no_shard``), or reduce-scatter the inner grad shard into this rank's piece (``optim``).
        The inner stage already applied the scaling factor."""
        assert self.outer is not None
        assert self.grad is not None
        base = self.grad_range[0]
        if self.outer.shard:
            region = self.grad
        else:
            lo, hi = self.main_range
            region = self.grad[lo - base : hi - base]
        wire = region if self.comm_dtype == region.dtype else region.to(self.comm_dtype)
        launched, sent = reduce_bucket(
            wire, self.outer.group, self.grad_comm, (self.bucket_id, "outer"), scatter=self.outer.shard,
            average=reduction.average, cuts=self.outer_cuts, label=f"{self.label}.outer",
        )  # fmt: skip
        if wire is not region:

            def copy_back() -> None:
                region.copy_(wire)

            launched.after.append(copy_back)
        launched.after.append(self._add_back_reduced)
        self.record("reduce_scatter" if self.outer.shard else "all_reduce", wire, self.outer.group, sent)
        return launched

    def record(
        self, op: str, payload: torch.Tensor, group: dist.ProcessGroup, sent: int | None = None
    ) -> None:
        """Account one collective of this bucket in its step's :class:`CommStats` (``sent``: the bytes on
        the wire, when they are not ``payload``'s own)."""
        nbytes = payload.numel() * payload.element_size() if sent is None else sent
        self.stats.begin(op, nbytes, group.size(), payload.device)

    def grad_view(self, index: int) -> torch.Tensor | None:
        """Item ``index``'s reduced grad rows owned by this rank, empty when it owns none (every rank
        holds a grad, so torch's ops over all grads, ``clip_grad_norm_``, issue the same collectives on
        every rank); None for frozen buckets."""
        if self.grad is None:
            return None
        return self.local_view(self.grad, self.grad_range[0], index)

    def zero_grad(self) -> None:
        """Zero the grads unless nothing wrote them since they were last zeroed: loops that call
        ``optimizer.zero_grad()`` (which zeros the buffers under fully_shard_optimizer) and then
        ``model.zero_grad_buffer()`` as Megatron's do would otherwise write every grad byte twice. Any
        in-place torch op on the buffer or a view of it (a grad hook's add, a user's write through
        ``main_grad`` or a DTensor grad) moves its version counter; a collective does not, so a reduction
        into the buffer is noted by :meth:`note_reduction`."""
        grad = self.grad
        if grad is not None and (self._grads_reduced_into or version_counter(grad) != self._zeroed_version):
            grad.zero_()
        self._drop_unreduced()
        self._reduced_earlier = None

    def note_zeroed(self) -> None:
        """Called once every bucket is zeroed: coalesced buckets' grads share one storage and so one
        version counter, which a sibling's zeroing moves."""
        if self.grad is not None:
            self._zeroed_version, self._grads_reduced_into = version_counter(self.grad), False

    def note_reduction(self) -> None:
        """A collective is about to write this bucket's grads (see :meth:`zero_grad`)."""
        self._grads_reduced_into = True


def _copy_overlap(target: torch.Tensor, base: int, flat: torch.Tensor, item: ItemPlacement) -> None:
    """Copy the part of ``flat`` (item ``item``'s values) that ``target`` (starting at buffer coordinate
    ``base``) covers."""
    start, end = max(item.offset, base), min(item.end, base + target.numel())
    if start < end:
        target[start - base : end - base].copy_(flat[start - item.offset : end - item.offset])
