"""The optimizer's view of a sharded model: one dim-0 DTensor per param over the shard mesh.

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
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Shard

from gradsync.buffers.checkpointing import contiguous_stride
from gradsync.buffers.shard_alignment import SHARD_ALIGNMENT_ATTR

from .bucket import FlatParamBucket
from .dcp import describe_shard
from .ragged import RaggedDTensor, left_to_right, shard_placement, torch_describes
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
