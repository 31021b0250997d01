"""How one bucket group communicates: the collectives its reductions and param gathers launch.

:class:`~gradsync.buffers.bucket_group.ParamAndGradBucketGroup` decides *when* (readiness, overlap, the
chain between groups); this decides *what* goes over the wire: each bucket through a comm hook, the
fp32-accumulating reduce-scatter or the (low-precision) wire, then across optimizer instances, and every
collective recorded in the group's stats for telemetry.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from . import collectives
from .buffer import ParamAndGradBucket
from .comm_hook import HookBucket, RegisteredHook
from .config import DistributedDataParallelConfig
from .low_precision_reduce import GradCommWire, reduce_bucket
from .stats import CollectiveRecord, CommStats


class BucketGroupCollectives:
    """Launches one bucket group's collectives; what may change between launches (the group's label, its
    comm hook) is passed in by the group at each launch."""

    def __init__(
        self,
        buckets: list[ParamAndGradBucket],
        ddp_config: DistributedDataParallelConfig,
        group: dist.ProcessGroup,
        group_size: int,
        inter_instance_group: dist.ProcessGroup | None,
        wire: GradCommWire | None,
        stats: CommStats,
    ) -> None:
        self.buckets, self.ddp_config = buckets, ddp_config
        self.group, self.group_size, self.group_rank = group, group_size, group.rank()
        self.inter_instance_group = inter_instance_group
        self.wire, self.stats = wire, stats

    def reduce_grads(
        self, reduce_scatter: bool, label: str, hook: RegisteredHook | None, first_hook_index: int
    ) -> collectives.Launched:
        """Every bucket's reduction within this optimizer instance, then (with several instances and the
        distributed optimizer) across them. ``first_hook_index``: the index ``hook`` sees for bucket 0."""
        launched = collectives.Launched()
        records = []
        average = self.ddp_config.average_in_collective
        op = "reduce_scatter" if reduce_scatter else "all_reduce"
        for position, bucket in enumerate(self.buckets):
            if hook is not None:
                records.append(self._record(op, bucket.grad_data))
                launched.extend(self._launch_hook(hook, first_hook_index + position, bucket, label))
                continue
            if reduce_scatter and self.ddp_config.reduce_scatter_with_fp32_accumulation:
                records.append(self._record(op, bucket.grad_data))
                launched.extend(
                    collectives.reduce_scatter_fp32_accumulated(bucket.grad_data, self.group, label=label)
                )
                continue
            reduction, sent = reduce_bucket(
                bucket.grad_data, self.group, self.wire, position,
                scatter=reduce_scatter, average=average, label=label,
            )  # fmt: skip
            records.append(self.stats.begin(op, sent, self.group.size(), bucket.grad_data.device))
            launched.extend(reduction)
        launched.after.append(lambda: CommStats.end(records))
        inter = self.inter_instance_group
        if self.ddp_config.use_distributed_optimizer and inter is not None:
            launched = self._then_across_instances(launched, inter, reduce_scatter, label)
        return launched

    def gather_params(self, label: str) -> collectives.Launched:
        """Every bucket's param shards gathered from their owners."""
        launched = collectives.Launched()
        records = []
        for bucket in self.buckets:
            assert bucket.param_data is not None  # a distributed-optimizer buffer always has one
            records.append(self._record("all_gather", bucket.param_data))
            launched.extend(collectives.all_gather_shards(bucket.param_data, self.group, label=label))
        launched.after.append(lambda: CommStats.end(records))
        return launched

    def _launch_hook(
        self, hook: RegisteredHook, index: int, bucket: ParamAndGradBucket, label: str
    ) -> collectives.Launched:
        params = bucket.params_list
        grads = [param.main_grad for param in params]  # type: ignore[attr-defined]
        work = hook.launch(HookBucket(bucket.grad_data, params, grads, index))
        launched = collectives.Launched([work])
        return launched.record("all_reduce", f"{label}.hook", bucket.grad_data, self.group)

    def _then_across_instances(
        self, within: collectives.Launched, inter: dist.ProcessGroup, reduce_scatter: bool, label: str
    ) -> collectives.Launched:
        """Chain the all-reduce across optimizer instances after the reduction within this instance.

        It reduces this rank's shard after a reduce-scatter, the whole bucket after an all-reduce (as
        ``force_all_reduce`` asks), issued as :func:`~gradsync.buffers.collectives.chain` says.
        """
        average = self.ddp_config.average_in_collective

        def across() -> collectives.Launched:
            launched, records = collectives.Launched(), []
            for bucket in self.buckets:
                target = bucket.grad_data
                if reduce_scatter:
                    target = collectives.shard_of(target, self.group_size, self.group_rank)
                records.append(self._record("all_reduce", target, inter))
                launched.extend(
                    collectives.all_reduce(target, inter, average=average, label=f"{label}.inter")
                )
            launched.after.append(lambda: CommStats.end(records))
            return launched

        return collectives.chain(within, across, inter, self.buckets[0].grad_data.device)

    def _record(
        self, op: str, tensor: torch.Tensor, group: dist.ProcessGroup | None = None
    ) -> CollectiveRecord:
        group = group or self.group
        return self.stats.begin(op, tensor.numel() * tensor.element_size(), group.size(), tensor.device)
