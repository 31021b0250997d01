"""torch DDP's comm-hook protocol on MegatronFSDP's buckets (gradsync's addition, as on gradsync-ddp's
wrapper), so torch's own hooks run unchanged, PowerSGD among them.

A hook averages a whole bucket over the data-parallel group; the sharded strategies keep their shard of
it, so the wire carries what the hook sends (an all-reduce's traffic with torch's hooks) instead of a
reduce-scatter.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch.distributed as dist

from gradsync.buffers import DistributedDataParallelConfig
from gradsync.buffers.comm_hook import CommHook, RegisteredHook, check_hook

from .bucket import FlatParamBucket
from .hsdp import OuterReplication


def register_bucket_hook(
    buckets: Sequence[FlatParamBucket],
    config: DistributedDataParallelConfig,
    outer: OuterReplication | None,
    group: dist.ProcessGroup,
    state: object,
    hook: CommHook,
) -> None:
    """Reduce each bucket that takes grads with ``hook(state, bucket)``, numbered from the model's end as
    torch DDP numbers them. Refused where the buckets are already reduced another way."""
    if config.grad_comm_dtype is not None:
        raise ValueError(
            "MegatronFSDP.register_comm_hook: grad_comm_dtype already sets how buckets are reduced; "
            "unset it, or keep it and register no hook"
        )
    if outer is not None:
        raise NotImplementedError(
            "MegatronFSDP.register_comm_hook: HSDP reduces in two stages over two groups, and a hook "
            "reduces over one; not supported with an outer data-parallel group"
        )
    check_hook("MegatronFSDP", state, hook, group)
    reducing = [bucket for bucket in buckets if bucket.grad is not None]
    if any(bucket.comm_hook is not None for bucket in reducing):
        raise RuntimeError("MegatronFSDP.register_comm_hook can only be called once")
    registered = RegisteredHook(state, hook, len(reducing))
    for index, bucket in enumerate(reversed(reducing)):
        bucket.comm_hook, bucket.hook_index = registered, index
