"""A MegatronFSDP model's buckets, built in one pass: the specs, their layouts, the allocators, the grad
storage and the groups of buckets that reduce together.

Each step needs the one before: the layouts (balanced across ranks) size the allocators and the reduction
groups, and the groups decide each ``no_shard`` bucket's persistent grad buffer (a slice of its group's
flat buffer, so the group reduces with one collective).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from gradsync.buffers import DistributedDataParallelConfig, effective_bucket_size
from gradsync.buffers.low_precision_reduce import GradCommWire
from gradsync.buffers.wire_format import WireFormat

from .allocator_choice import choose_allocators
from .allocators import DoubleBufferAllocator
from .bucket import BucketAllocators, FlatParamBucket, bucket_layout
from .coalesce import ReductionGroup, grad_storage, plan_reduction_groups
from .hsdp import OuterReplication
from .meta_init import MetaReplacement, ParamInitFn, materialize
from .mixed_precision import MixedPrecisionPolicy
from .param_order import balance_param_order
from .strategy import Sharding
from .units import group_into_buckets
from .userbuffers import NcclUserBufferPool


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
