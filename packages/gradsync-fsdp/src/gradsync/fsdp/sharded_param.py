"""One record per param, the optimizer's DTensor over its shard, and which of the two the module shows.

The optimizer's view of a sharded model: one dim-0 DTensor per param over the shard mesh.

Each DTensor's local tensor is a view of its bucket's main weights (or compute weights), so the
optimizer's in-place updates land in the flat buffers. Shards are uneven, and a rank may own no rows of
a param: the DTensor carries the param's global shape explicitly. Its shard placement is torch's
``Shard(0)``; where the rows per rank do not follow ``torch.chunk`` (and always under HFSDP, whose mesh
dims cut inner first) it is a :class:`~gradsync.fsdp.ragged.RaggedDTensor` whose ``full_tensor()``,
``redistribute()`` and DCP metadata use the layout's row counts. ``no_shard`` params are ``Replicate``.

On a torch whose DTensor specs carry no shard order (2.6), HFSDP's inner-first shards are plain DTensors
labelled ``(Shard(0), Shard(0))``: DCP still reads each shard at its true offset (the chunk attached to its
local tensor) and :mod:`gradsync.fsdp.uneven_dtensor` gathers it whole, but torch's own ``full_tensor()``
does not.

One record per param of a MegatronFSDP model: everything the wrapper knows about it, in one place.

A param lives as two tensors. The compute param is the module's own, a view of its bucket's weights, with
``main_grad`` on it, where Megatron's code reads it. The optimizer's param is a DTensor over the bucket's
main weights. Lookups from either tensor go through one map to the record, so no other place keeps a
per-param map that could drift from it, and nothing gradsync reads is stamped on the params (Megatron's
``_megatron_fsdp_model`` is written for Megatron's code alone).

The record also holds every view of the param's grads, each built once: the one a backward's grad is
added into, and the optimizer param's grad DTensor over the reduced rows. A grad hook then does one add
into a view it already has, and a step attaches grads that already exist.

Which params the wrapped module's attributes hold: the compute params, or the optimizer's DTensors.

A parent module, ``torch.compile``'s wrapper or any code walking ``module.parameters()`` reads the
modules' registered params directly, never ``MegatronFSDP.parameters()``. As in the reference, the
modules hold the optimizer's DTensor params outside forward and backward (so such code finds the params
that get grads and get stepped) and the compute params from the root forward until the backward ends.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Shard

from gradsync.buffers.checkpointing import contiguous_stride
from gradsync.buffers.shard_alignment import SHARD_ALIGNMENT_ATTR
from gradsync.buffers.torch_internals import local_tensor

from .bucket import FlatParamBucket, item_view
from .ragged import RaggedDTensor, describe_shard, left_to_right, shard_placement, torch_describes
from .torch_internals import HAS_SHARD_ORDER

# Attributes Megatron and gradsync-finalize read off params, carried over to the optimizer's params.
CARRIED_ATTRIBUTES = (
    "sequence_parallel",
    "shared",
    "tensor_model_parallel",
    "partition_dim",
    "partition_stride",
    "is_embedding_or_output_parameter",
    "is_embedding_parameter",
    "shared_embedding",
    "average_gradients_across_tp_domain",
    SHARD_ALIGNMENT_ATTR,  # matrix optimizers refuse, on every rank alike, a policy that may cut a matrix
)


def as_dtensor(
    local: torch.Tensor, mesh: DeviceMesh, shape: torch.Size, placements: Sequence[Placement]
) -> DTensor:
    return DTensor.from_local(
        local, mesh, placements, run_check=False, shape=shape, stride=contiguous_stride(shape)
    )


def true_split(
    bucket: FlatParamBucket, index: int, mesh: DeviceMesh, placements: Sequence[Placement]
) -> tuple[list[Placement], tuple[int, ...]]:
    """``placements`` with each shard dim describing how the layout split item ``index``'s rows, and the
    order the mesh dims cut them in. HFSDP's (outer, inner) mesh cuts inner first (its shard ``i*M + o``
    is outer piece ``o`` of inner shard ``i``), and the outer sizes are those of this rank's inner shard."""
    shape = bucket.layout.items[index].shape
    order = tuple(range(mesh.ndim))
    sharded = [mesh_dim for mesh_dim, p in enumerate(placements) if isinstance(p, Shard)]
    if not bucket.sharding.shard_main or not len(shape) or not sharded:
        return list(placements), order
    rows = [bucket.layout.local_rows(index, rank) for rank in range(bucket.layout.world)]
    sizes = [last - first for first, last in rows]
    if len(sharded) == 1:
        split = {sharded[0]: shard_placement(sizes)}
    else:  # HFSDP: (outer, inner), each Shard(0)
        pieces = mesh.size(0)
        by_inner = [sizes[inner * pieces : (inner + 1) * pieces] for inner in range(mesh.size(1))]
        mine = by_inner[mesh.get_local_rank(1)]
        split = {0: shard_placement(mine), 1: shard_placement([sum(inner) for inner in by_inner])}
        order = (1, 0)
    return [split.get(mesh_dim, p) for mesh_dim, p in enumerate(placements)], order


def build_optimizer_params(
    bucket: FlatParamBucket, mesh: DeviceMesh, placements: Sequence[Placement]
) -> list[nn.Parameter]:
    """One DTensor parameter per param of ``bucket``, viewing the optimizer's part of the buffers."""
    source, base = bucket.optimizer_source()
    params = []
    for index, raw in enumerate(bucket.spec.params):
        local = bucket.local_view(source, base, index)
        true_placements, order = true_split(bucket, index, mesh, placements)
        native = HAS_SHARD_ORDER or left_to_right(true_placements, order)
        if native and not torch_describes(true_placements, order):
            dtensor: DTensor = RaggedDTensor.wrap(local, mesh, raw.shape, true_placements, order)
        else:
            dtensor = as_dtensor(local, mesh, raw.shape, placements)
        param = nn.Parameter(dtensor, requires_grad=raw.requires_grad)
        first_row = bucket.first_row(index)
        if first_row is not None:
            describe_shard(param, first_row)
        for name in CARRIED_ATTRIBUTES:
            if hasattr(raw, name):
                setattr(param, name, getattr(raw, name))
        params.append(param)
    return params


def optimizer_grad(
    bucket: FlatParamBucket, index: int, param: nn.Parameter
) -> tuple[DTensor | None, tuple[torch.Tensor, torch.Tensor] | None]:
    """The grad of ``param``, item ``index``'s optimizer param, built once: the grad buffer is allocated at
    construction and only ever zeroed, so the DTensor (with its spec) is built over it once, not every
    step. It views the param's reduced rows of the buffer when the dtypes match, else a cast buffer of the
    param's dtype, returned with those rows (``(reduced rows, cast buffer)``) to be refreshed before each
    step. It is empty where this rank owns no rows (every rank holds a grad, as FSDP2's shards do, so
    torch's ops over all grads, ``clip_grad_norm_``, issue the same collectives everywhere); None for
    params that take no grad."""
    local = bucket.grad_view(index)
    if local is None or not param.requires_grad:
        return None, None
    cast = None
    if local.dtype != param.dtype:
        cast = (local, torch.empty_like(local, dtype=param.dtype))
        local = cast[1]
    if isinstance(param, RaggedDTensor):
        return param.like(local), cast
    assert isinstance(param, DTensor)  # a Parameter over a DTensor
    return as_dtensor(local, param.device_mesh, param.shape, param.placements), cast


@dataclass(eq=False)
class ShardedParam:
    """A param as the wrapper holds it: its name in the wrapped module, its compute param (item ``index``
    of ``bucket``), the optimizer's sharded param and the local tensor under it (a view of the bucket's
    buffers: a conversion of the module that swaps the param for a copy leaves another one there),
    whether it was frozen when wrapped (it then has no grad buffer or hook, so an optimizer step that
    finds it trainable is refused), and the module slots that hold it (``(module, attribute)``: a tied
    param has several).

    Its grads: ``main_grad``, its view of the bucket's persistent grads where the backward adds into them
    (no_shard, ZeRO-1; None under ZeRO-2/3, which add into borrowed whole-bucket grads: the bucket's
    :meth:`~gradsync.fsdp.bucket.UnreducedGrads.views`; and None when frozen),
    and ``optimizer_grad``, the sharded param's grad, with ``cast``, the rows it is refreshed from when
    it is a cast copy (see :func:`optimizer_grad`)."""

    name: str
    compute: nn.Parameter
    bucket: FlatParamBucket
    index: int
    sharded: nn.Parameter
    frozen_at_wrap: bool
    slots: list[tuple[nn.Module, str]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.local = local_tensor(self.sharded)
        bucket, item = self.bucket, self.bucket.layout.items[self.index]
        self.main_grad: torch.Tensor | None = None
        if bucket.grad is not None and not bucket.sharding.shard_grads:
            self.main_grad = item_view(bucket.grad, 0, item.offset, item.end, item.shape)
            self.compute.main_grad = self.main_grad  # type: ignore[attr-defined]
        self.optimizer_grad, self.cast = optimizer_grad(bucket, self.index, self.sharded)

    @property
    def first_row(self) -> int | None:
        """The global row this rank's shard starts at, where the main weights are sharded (else None)."""
        return self.bucket.first_row(self.index)

    @property
    def swapped_for_a_copy(self) -> bool:
        """Whether torch put another tensor in the sharded param (``module.to()`` and the like)."""
        return local_tensor(self.sharded) is not self.local


class ShardedParams:
    """Every record, in the wrapped module's ``named_parameters()`` order, and the one map from a tensor
    (compute or sharded param) to its record."""

    def __init__(
        self,
        root: nn.Module,
        named: Sequence[tuple[str, nn.Parameter]],
        buckets: Sequence[FlatParamBucket],
        optimizer_params: Sequence[Sequence[nn.Parameter]],
    ) -> None:
        """The records of ``root``'s params ``named`` (in its order), each item of ``buckets`` with its
        optimizer param, and every slot of ``root``'s modules that holds one."""
        where = {
            param: (bucket, index, sharded)
            for bucket, params in zip(buckets, optimizer_params, strict=True)
            for index, (param, sharded) in enumerate(zip(bucket.spec.params, params, strict=True))
        }
        self.records = [
            ShardedParam(name, param, *where[param][:2], where[param][2], not param.requires_grad)
            for name, param in named
        ]
        self._of: dict[torch.Tensor, ShardedParam] = {
            tensor: record for record in self.records for tensor in (record.compute, record.sharded)
        }
        for owner in root.modules():
            for leaf, param in owner._parameters.items():
                if param is not None and param in self._of:
                    self._of[param].slots.append((owner, leaf))
        self.buckets = list(buckets)
        self._with_grads = [r for r in self.records if r.bucket.spec.requires_grad]
        casts = [record.cast for record in self._with_grads if record.cast is not None]
        self._cast_from, self._cast_to = [c[0] for c in casts], [c[1] for c in casts]

    def __iter__(self) -> Iterator[ShardedParam]:
        return iter(self.records)

    def __contains__(self, tensor: object) -> bool:
        return tensor in self._of

    def of(self, tensor: torch.Tensor) -> ShardedParam:
        """The record of a compute param, an optimizer param, or an alias given to :meth:`alias`."""
        return self._of[tensor]

    def first_row(self, tensor: torch.Tensor) -> int | None:
        """The first row of ``tensor``'s shard if it is one of these params' and the main weights are
        sharded, else None."""
        record = self._of.get(tensor)
        return record.first_row if record is not None else None

    def alias(self, tensor: torch.Tensor, known: torch.Tensor) -> None:
        """Let ``tensor`` (a meta param the caller still holds) stand for ``known``'s record."""
        self._of[tensor] = self._of[known]

    def attach_grads(self) -> None:
        """Give the optimizer's params their reduced grads (those of frozen buckets keep theirs), the cast
        copies refreshed from the reduced rows first; a loop with no call per param."""
        if self._cast_to:
            torch._foreach_copy_(self._cast_to, self._cast_from)
        for record in self._with_grads:
            record.sharded.grad = record.optimizer_grad

    def drop_grads(self) -> None:
        for record in self.records:
            record.sharded.grad = None

    def scale_grads(self, factor: float | torch.Tensor) -> None:
        """Multiply every grad by ``factor``: the grad buffers, and attached grads that are copies of them."""
        in_buffers = set()
        for bucket in self.buckets:
            if bucket.grad is not None:
                bucket.grad.mul_(factor)
                in_buffers.add(bucket.grad.untyped_storage().data_ptr())
        for record in self.records:
            grad = local_tensor(record.sharded.grad)
            if grad is not None and grad.untyped_storage().data_ptr() not in in_buffers:
                grad.mul_(factor)

    def frozen_at_wrap(self) -> list[tuple[str, nn.Parameter]]:
        """Both tensors of every param frozen when wrapped: the module shows either one."""
        return [(r.name, t) for r in self.records if r.frozen_at_wrap for t in (r.compute, r.sharded)]


class ParamRegistry:
    """Which of each record's two params its module slots hold, and the swap between the two sets: the
    compute params from a forward to its backward's end, the optimizer's sharded DTensors otherwise (so
    ``model.parameters()``, an optimizer built from them and ``state_dict()`` see the shards). torch FSDP2
    swaps its module slots the same way (sharded / unsharded params); it is a dict store per param, twice
    a step, with no copy."""

    def __init__(self, params: ShardedParams) -> None:
        self._params = params
        self.showing_compute = True

    def show_compute(self) -> None:
        if not self.showing_compute:
            for record in self._params:
                for owner, leaf in record.slots:
                    owner._parameters[leaf] = record.compute
            self.showing_compute = True

    def show_optimizer(self) -> None:
        if self.showing_compute:
            for record in self._params:
                for owner, leaf in record.slots:
                    owner._parameters[leaf] = record.sharded
            self.showing_compute = False

    @contextlib.contextmanager
    def compute_shown(self) -> Iterator[None]:
        """The compute params in the modules for the duration, then whatever was there before."""
        before = self.showing_compute
        self.show_compute()
        try:
            yield
        finally:
            if not before:
                self.show_optimizer()
