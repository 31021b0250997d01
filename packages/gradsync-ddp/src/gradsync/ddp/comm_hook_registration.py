"""DistributedDataParallel's side of torch-DDP-style comm hooks: which configs a hook can serve, and
handing one hook to every bucket group, each bucket numbered as torch's DDP numbers them.

A hook returns whole buckets averaged over the data-parallel group it names, so configs that reduce
otherwise (a reduce-scatter, a low-precision wire, experts over their own group) are refused up front
rather than reduced wrongly.
"""

from __future__ import annotations

from gradsync.buffers import DistributedDataParallelConfig, GradBuffers
from gradsync.buffers.comm_hook import CommHook, RegisteredHook, check_hook
from gradsync.groups import ProcessGroupCollection


def install_comm_hook(
    grad_buffers: GradBuffers,
    ddp_config: DistributedDataParallelConfig,
    pg_collection: ProcessGroupCollection,
    state: object,
    hook: CommHook,
) -> None:
    """Make ``hook(state, bucket)`` reduce every bucket of every group, once and for all."""
    groups = grad_buffers.all_bucket_groups
    if ddp_config.use_distributed_optimizer:
        raise NotImplementedError(
            "DistributedDataParallel.register_comm_hook: a hook returns whole reduced buckets, but "
            "use_distributed_optimizer=True reduce-scatters them; use grad_comm_dtype to compress there"
        )
    if ddp_config.grad_comm_dtype is not None:
        raise ValueError(
            "DistributedDataParallel.register_comm_hook: grad_comm_dtype already sets how buckets are "
            "reduced; unset it, or keep it and register no hook"
        )
    if grad_buffers.expert_parallel_bucket_groups:
        raise NotImplementedError(
            "DistributedDataParallel.register_comm_hook: expert params reduce over the expert "
            "data-parallel group, which a hook's state does not name; not supported with experts"
        )
    dp_cp = pg_collection.dp_cp
    assert dp_cp is not None  # resolve_process_groups set it
    check_hook("DistributedDataParallel", state, hook, dp_cp)
    if any(group.comm_hook is not None for group in groups):
        raise RuntimeError("DistributedDataParallel.register_comm_hook can only be called once")
    registered, offset = RegisteredHook(state, hook, sum(len(group.buckets) for group in groups)), 0
    for group in groups:
        group.comm_hook, group.hook_bucket_offset = registered, offset
        offset += len(group.buckets)
