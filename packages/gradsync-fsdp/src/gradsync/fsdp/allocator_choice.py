"""Which allocators a model's buckets use, from the constructor's flags.

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
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch
import torch.distributed as dist

from gradsync.buffers import DistributedDataParallelConfig

from .allocators import (
    BucketAllocator,
    BufferRequest,
    DoubleBufferAllocator,
    MaxPoolDoubleBufferAllocator,
    MemoryContext,
    PersistentBucketAllocator,
    StorageResizeBucketAllocator,
    TemporaryBucketAllocator,
    UnitBuckets,
)
from .bucket import BucketAllocators
from .layout import BucketLayout
from .mixed_precision import MixedPrecisionPolicy
from .units import BucketSpec
from .userbuffers import NcclUserBufferPool


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
