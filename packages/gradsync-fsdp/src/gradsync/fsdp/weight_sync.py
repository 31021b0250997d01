"""The compute weights of a MegatronFSDP model kept current: an optimizer step's update installed into
them, the gathers that bring it to every replica (ZeRO-1/2) or the first weights a forward needs (ZeRO-3),
gathers asked for by param, and a broadcast that gives every replica the first one's weights.

An install must come before any gather or read of the weights. :class:`StepMarks` records that a step
updated them, on every rank alike, so every rank installs at the same point and gathers the same weights.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch.distributed as dist
from torch import nn

from gradsync.buffers import DistributedDataParallelConfig

from .bucket import BucketStatus, PrefetchOrder
from .bucket_set import BucketSet
from .labels import labelled
from .registration import ParamRegistry
from .schedule import GatherSchedule
from .sharded_param import ShardedParams
from .step_tracking import StepMarks
from .strategy import Sharding


class WeightSync:
    """Installs and gathers of one model's compute weights."""

    def __init__(
        self,
        buckets: BucketSet,
        sharding: Sharding,
        config: DistributedDataParallelConfig,
        gathers: GatherSchedule,
        registry: ParamRegistry,
        steps: StepMarks,
    ) -> None:
        self.buckets, self.sharding, self.config = buckets, sharding, config
        self.gathers, self.registry, self.steps = gathers, registry, steps

    def install_if_stepped(self) -> None:
        """Weights are read or gathered: bring an optimizer step in first (the mark is the same on every
        rank, so every rank installs)."""
        if self.steps.weights_uninstalled:
            self.install()

    def install(self) -> None:
        for bucket in self.buckets.buckets:
            bucket.install_main_weights()
        self.steps.weights_uninstalled = False
        if not self.config.overlap_param_gather:
            self.start(force_sync=True)

    @labelled("start_param_sync")
    def start(self, force_sync: bool = False) -> None:
        self.install_if_stepped()
        if self.sharding.name == "no_shard":
            return
        overlapped = self.config.overlap_param_gather and not force_sync
        if overlapped and not self.config.fsdp_all_gather_in_start_param_sync:
            return  # the forward gathers each bucket when it first needs it
        stale = [b for b in self.buckets.buckets if b.status is BucketStatus.EMPTY]
        if self.sharding.shard_params:  # the first weights only: the forward gathers each unit as it comes
            first_unit = self.buckets.of_unit[0] if self.buckets.of_unit else []
            stale = self.buckets.outside_units + first_unit
        for bucket in stale:
            bucket.launch_gather()
        if not overlapped:
            for bucket in stale:
                bucket.wait_gather()

    def finish(self) -> None:
        for bucket in self.buckets.buckets:
            if bucket.status is BucketStatus.COMMUNICATING:
                bucket.wait_gather()
            if self.sharding.shard_params:
                bucket.release()
        self.registry.show_optimizer()

    def gather_params(
        self,
        params: ShardedParams,
        which: Sequence[nn.Parameter],
        prefetch: bool,
        prefetch_order: PrefetchOrder,
        wait_bucket_ready: bool,
    ) -> None:
        self.install_if_stepped()
        buckets = self.buckets.buckets
        ids = sorted({params.of(p).bucket.bucket_id for p in which})
        for bucket_id in ids:
            buckets[bucket_id].launch_gather()
        unit_ids = [u for b in ids if (u := buckets[b].spec.unit_id) is not None] if prefetch else []
        if unit_ids:
            if prefetch_order is PrefetchOrder.FORWARD_PASS_ORDER:
                self.gathers.prefetch(max(unit_ids) + 1, 1)
            else:
                self.gathers.prefetch(min(unit_ids) - 1, -1)
        if wait_bucket_ready:
            for bucket_id in ids:
                buckets[bucket_id].wait_gather()

    def broadcast(self, group: dist.ProcessGroup) -> None:
        """Every rank of ``group`` takes its first rank's weights: each bucket gathered whole, broadcast,
        re-sharded."""
        self.install_if_stepped()
        src = dist.get_global_rank(group, 0)
        for bucket in self.buckets.buckets:
            bucket.wait_exact_gather()
            dist.broadcast(bucket.weight, src=src, group=group)
            bucket.reset_from_weights()
            if self.sharding.shard_params:
                bucket.release()
