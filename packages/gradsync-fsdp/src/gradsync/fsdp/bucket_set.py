"""A model's buckets, built in one pass, and the allocators they use.

Which allocators a model's buckets use, from the constructor's flags.

Without double buffering: storage-resize for ZeRO-3's gathered weights, temporary for ZeRO-2/3's
unreduced grads. With ``fsdp_double_buffer`` (or ``nccl_ub``, which implies it) each kind ZeRO-2/3
allocates per use gets a :class:`DoubleBufferAllocator` over the FSDP units, with the dynamic allocator as
its fallback for buckets that are not shaped like the most common unit; with
``megatron_fsdp_max_pool_double_buffer`` a :class:`MaxPoolDoubleBufferAllocator` instead, which every unit
fits. ``fsdp_db_use_persist_buf_on_alloc_fail`` makes the fallback a :class:`PersistentBucketAllocator`.
``no_shard`` and ``optim`` allocate no whole-bucket buffer per use, so double buffering leaves them as they
are. With ``nccl_ub`` the double buffers come from an NCCL memory pool registered on every group that
sends them (the shard group, and the gather lane when gathers have one); fallback buffers (persistent
ones too) stay ordinary (unregistered) memory.

A MegatronFSDP model's buckets, built in one pass: the specs, their layouts, the allocators, the grad
storage and the groups of buckets that reduce together.

Each step needs the one before: the layouts (balanced across ranks) size the allocators and the reduction
groups, and the groups decide each ``no_shard`` bucket's persistent grad buffer (a slice of its group's
flat buffer, so the group reduces with one collective).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from gradsync.buffers import DistributedDataParallelConfig, effective_bucket_size
from gradsync.buffers.low_precision_reduce import GradCommWire
from gradsync.buffers.wire_format import WireFormat

from .allocators import (
    BucketAllocator,
    BufferRequest,
    DoubleBufferAllocator,
    MaxPoolDoubleBufferAllocator,
    MemoryContext,
    NcclUserBufferPool,
    PersistentBucketAllocator,
    StorageResizeBucketAllocator,
    TemporaryBucketAllocator,
    UnitBuckets,
)
from .bucket import BucketAllocators, FlatParamBucket, bucket_layout
from .coalesce import ReductionGroup, grad_storage, plan_reduction_groups
from .layout import BucketLayout, BucketSpec, OuterReplication, balance_param_order, group_into_buckets
from .meta_init import MetaReplacement, ParamInitFn, materialize
from .settings import MixedPrecisionPolicy, Sharding


def choose_allocators(
    config: DistributedDataParallelConfig,
    specs: Sequence[BucketSpec],
    layouts: Sequence[BucketLayout],
    policy: MixedPrecisionPolicy,
    groups: Sequence[dist.ProcessGroup],
    device: torch.device,
) -> tuple[BucketAllocators, NcclUserBufferPool | None]:
    """The allocators for ``specs`` (laid out as ``layouts``), and the NCCL pool when ``nccl_ub``,
    registered on ``groups``."""
    buffered = config.data_parallel_sharding_strategy in ("optim_grads", "optim_grads_params")
    if not (config.fsdp_double_buffer or config.nccl_ub) or not buffered:
        return BucketAllocators.dynamic(), None  # no_shard / optim: nothing to double-buffer
    pool = None
    context: MemoryContext = contextlib.nullcontext
    if config.nccl_ub:
        pool = NcclUserBufferPool(groups, device, symmetric=not config.disable_symmetric_registration)
        context = pool.allocating

    def units(dtype_of: dict[int, torch.dtype]) -> list[UnitBuckets]:
        """The units' buckets among those in ``dtype_of``, each needing a buffer of that dtype."""
        by_unit: dict[int, list[int]] = {}
        for bucket_id, spec in enumerate(specs):
            if spec.unit_id is not None and bucket_id in dtype_of:
                by_unit.setdefault(spec.unit_id, []).append(bucket_id)
        return [
            UnitBuckets(
                unit_id,
                tuple(ids),
                tuple(BufferRequest(layouts[i].size, dtype_of[i], device) for i in ids),
            )
            for unit_id, ids in by_unit.items()
        ]

    weight_dtypes = {i: spec.dtype for i, spec in enumerate(specs)}
    grad_dtypes = {i: policy.comm_dtype(spec.dtype) for i, spec in enumerate(specs) if spec.requires_grad}
    pool_kind = (
        MaxPoolDoubleBufferAllocator if config.megatron_fsdp_max_pool_double_buffer else DoubleBufferAllocator
    )
    persistent = config.fsdp_db_use_persist_buf_on_alloc_fail
    weights: BucketAllocator = StorageResizeBucketAllocator()
    if config.data_parallel_sharding_strategy == "optim_grads_params":
        fallback = PersistentBucketAllocator() if persistent else weights
        weights = pool_kind("weight", units(weight_dtypes), fallback, context)
    grad_fallback = PersistentBucketAllocator() if persistent else TemporaryBucketAllocator()
    grads = pool_kind("grad", units(grad_dtypes), grad_fallback, context)
    if pool is not None:
        pool.register()
    return BucketAllocators(weights, grads), pool


@dataclass
class BucketSet:
    """Every bucket, the buckets of each unit (by unit id) and those outside every unit, the allocators of
    their temporary buffers, and the groups of buckets that reduce together (the schedule takes these)."""

    buckets: list[FlatParamBucket]
    of_unit: list[list[FlatParamBucket]]
    outside_units: list[FlatParamBucket]
    allocators: BucketAllocators
    nccl_ub_pool: NcclUserBufferPool | None
    reduction_groups: list[ReductionGroup]

    def materialize(self, module: nn.Module, meta: MetaReplacement, init_fn: ParamInitFn | None) -> None:
        """Initialise a meta-device ``module``'s params into the buckets, each rank keeping its rows."""
        where = {p: (b, i) for b in self.buckets for i, p in enumerate(b.spec.params)}

        def write(param: nn.Parameter, value: torch.Tensor) -> None:
            bucket, index = where[param]
            bucket.write_param(index, value)

        materialize(module, meta, write, init_fn)


def build_bucket_set(
    module: nn.Module,
    units: Sequence[nn.Module],
    config: DistributedDataParallelConfig,
    sharding: Sharding,
    policy: MixedPrecisionPolicy,
    groups: tuple[dist.ProcessGroup, dist.ProcessGroup],
    outer: OuterReplication | None,
    device: torch.device,
    unset: set[nn.Parameter],
    *,
    disable_bucketing: bool,
) -> BucketSet:
    """The buckets of ``module``'s params (``unset``: meta placeholders, materialised later), sharded over
    ``groups`` (the shard group, and the group the gathers run on: the same or a lane of its own)."""
    group, gather_group = groups
    specs = group_into_buckets(module, units, None if disable_bucketing else config.bucket_size)
    layouts = balance_param_order(specs, lambda spec: bucket_layout(spec, sharding, group, outer))
    comm_groups = [group] if gather_group is group else [group, gather_group]
    allocators, nccl_ub_pool = choose_allocators(config, specs, layouts, policy, comm_groups, device)
    members = plan_reduction_groups(
        specs,
        layouts,
        sharding,
        policy,
        hsdp=outer is not None,
        pooled_grads=isinstance(allocators.grads, DoubleBufferAllocator),
        bucket_size=effective_bucket_size(
            config,
            group.size(),
            total_params=sum(layout.size for layout in layouts),
            single_bucket=disable_bucketing,
        ),
    )
    group_grads, grad_slices = grad_storage(members, layouts, specs, sharding, policy, device)
    grad_comm = GradCommWire.from_config(config)
    gather_wire = (
        WireFormat(config.param_gather_dtype, config.param_gather_block_size)
        if config.param_gather_dtype is not None
        else None
    )
    buckets = [
        FlatParamBucket(
            i,
            spec,
            sharding,
            policy,
            group,
            device,
            allocators,
            outer,
            unset,
            gather_group=gather_group,
            grad_storage=grad_slices.get(i),
            grad_comm=grad_comm,
            gather_wire=gather_wire,
        )
        for i, spec in enumerate(specs)
    ]
    for allocator in (allocators.weights, allocators.grads):
        allocator.forget_assignments()  # construction filled every bucket once; the forward assigns
    of_unit: list[list[FlatParamBucket]] = [[] for _ in units]
    outside_units: list[FlatParamBucket] = []
    for bucket in buckets:
        unit_id = bucket.spec.unit_id
        (of_unit[unit_id] if unit_id is not None else outside_units).append(bucket)
    reduction_groups = [
        ReductionGroup([buckets[i] for i in ids], grads)
        for ids, grads in zip(members, group_grads, strict=True)
    ]
    return BucketSet(buckets, of_unit, outside_units, allocators, nccl_ub_pool, reduction_groups)
