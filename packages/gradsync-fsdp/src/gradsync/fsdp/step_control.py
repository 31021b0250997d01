"""The cycle's end and the weights kept current: grads finished for the optimizer, a step's update installed
and gathered.

The compute weights of a MegatronFSDP model kept current: an optimizer step's update installed into
them, the gathers that bring it to every replica (ZeRO-1/2) or the first weights a forward needs (ZeRO-3),
gathers asked for by param, and a broadcast that gives every replica the first one's weights.

An install must come before any gather or read of the weights. The step cycle
(:class:`gradsync.buffers.step_cycle.StepCycle`) records that a step updated them, on every rank alike, so
every rank installs at the same point and gathers the same weights.

The end of a MegatronFSDP model's cycle: grads finished for the optimizer, a step refused when it would
apply wrong grads, a step abandoned on one rank completed for the others, and the buffers zeroed.

A rank that abandons a step (a backward that raised, a batch skipped after its forward: the rules are the
step cycle's, shared with gradsync-ddp) must still issue every collective the other ranks' forward,
backward and ``finish_grad_sync()`` wait in, which this module knows; then every rank raises by name
(:mod:`gradsync.buffers.step_ballot`): nothing hangs, and no rank steps on partial grads.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Sequence
from typing import NoReturn

import torch
import torch.distributed as dist
from torch import nn

from gradsync.buffers import DistributedDataParallelConfig, telemetry
from gradsync.buffers.grad_checks import LocalGradNorms, non_finite_ranks
from gradsync.buffers.step_cycle import StepCycle

from .bucket import BucketStatus, PrefetchOrder
from .bucket_set import BucketSet
from .hooks import labelled
from .schedule import GatherSchedule, ReduceSchedule
from .settings import Sharding
from .sharded_param import ParamRegistry, ShardedParams
from .training_hooks import TrainingHooks


class WeightSync:
    """Installs and gathers of one model's compute weights."""

    def __init__(
        self,
        buckets: BucketSet,
        sharding: Sharding,
        config: DistributedDataParallelConfig,
        gathers: GatherSchedule,
        registry: ParamRegistry,
        steps: StepCycle,
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


class StepControl:
    """Finishing, checking, abandoning and zeroing one model's cycle. ``sync_grads`` launches the
    deferred reductions and waits for every reduction in flight (the wrapper's, so it is labelled)."""

    def __init__(
        self,
        buckets: BucketSet,
        hooks: TrainingHooks,
        params: ShardedParams,
        all_dp_group: dist.ProcessGroup,
        grad_norms: LocalGradNorms | None,
        sync_grads: Callable[[], None],
    ) -> None:
        self.buckets, self.hooks, self.params = buckets, hooks, params
        self.cycle: StepCycle = hooks.cycle
        self.ballot = self.cycle.ballot
        self.reductions: ReduceSchedule = hooks.reductions
        self.registry: ParamRegistry = hooks.registry
        self.all_dp_group, self.grad_norms = all_dp_group, grad_norms
        self.sync_grads = sync_grads
        self.across_replicas: Callable[[], None] | None = None
        """A stage after this model's own reductions landed (torchft's replica groups: each rank's reduced
        shard averaged across the groups; :mod:`gradsync.fsdp.fault_tolerance`)."""

    def finish(self) -> None:
        """Every grad of the cycle reduced exactly once, checked, then attached to the optimizer's params;
        once per backward."""
        cycle = self.cycle
        if cycle.grads_finished:
            return
        with cycle.syncing(self._grad_buffers, self.abandon):
            self.sync_grads()
            if self.across_replicas is not None:
                self.across_replicas()
            self.refuse_non_finite_grads()
        self.params.attach_grads()
        cycle.microbatch_count = 0
        cycle.grads_finished = True
        if not cycle.forwards_awaiting_backward:  # a later backward may still recompute (auto-sync)
            self.registry.show_optimizer()

    def refuse_non_finite_grads(self) -> None:
        """Raise on every rank, naming the ranks (and, with ``report_nan_in_param_grad``, this rank's
        params), if any rank's local grads held NaN or Inf before a reduction of this cycle."""
        if self.grad_norms is None:
            return
        group = self.all_dp_group
        bad = non_finite_ranks(self.grad_norms.gather(group, "fsdp.grad_norms"), group)
        buckets = self.buckets.buckets
        params = {b.bucket_id: b.non_finite_params for b in buckets}
        for bucket in buckets:
            bucket.non_finite_params = []
        if bad:
            bucket_id, ranks = min(bad.items())
            names = ", ".join(buckets[bucket_id].spec.names)
            here = f"; on this rank in the grads of {params[bucket_id]}" if params[bucket_id] else ""
            raise RuntimeError(
                f"MegatronFSDP (check_for_nan_in_grad=True): NaN or Inf in the grads of bucket {bucket_id} "
                f"({names}) on rank(s) {ranks}, before the reduction{here}"
            )

    def zero(self) -> None:
        """Zero the grad buffers and drop the optimizer params' grads; a backward that raised part-way
        abandons the step here."""
        self.cycle.before_zeroing(self.abandon)
        self.reductions.new_cycle()
        self.registry.show_optimizer()
        buckets = self.buckets.buckets
        for bucket in buckets:
            bucket.zero_grad()
            bucket.non_finite_params = []
        for bucket in buckets:
            bucket.note_zeroed()
        if self.grad_norms is not None:
            self.grad_norms.reset()
        self.params.drop_grads()
        self.cycle.zeroed()
        for bucket in buckets:
            bucket.stats.reset()
        telemetry.next_step()

    def _grad_buffers(self) -> Iterator[torch.Tensor]:
        return (bucket.grad for bucket in self.buckets.buckets if bucket.grad is not None)

    def abandon(self, reason: str) -> NoReturn:
        """Complete this step's collectives for the other ranks, then raise on every rank."""
        cycle = self.cycle
        no_forward = not (cycle.in_backward or cycle.backward_ran or cycle.forwards_awaiting_backward)
        cycle.abandon(functools.partial(self._complete_step_collectives, no_forward), reason)

    def _complete_step_collectives(self, no_forward: bool) -> None:
        """What the other ranks' forward, backward and ``finish_grad_sync()`` still communicate: a forward's
        gathers when this rank ran none (every unit in forward order, as the others' forward issues them),
        the rest of an abandoned backward (ZeRO-3 gathers each unit it did not reach, in backward order;
        every bucket's reduction in launch order), the reductions deferred to the cycle's end, the NaN
        check's gather."""
        hooks, cycle = self.hooks, self.cycle
        units = range(len(hooks.units))
        if no_forward:
            hooks.install_stepped()
            hooks.gather_for_forward()
            for unit_id in units if hooks.sharding.shard_main else ():
                hooks.gathers.gather_unit(unit_id, prefetch=unit_id + 1)
                hooks.release_after_forward(unit_id, backward_follows=True)
        if cycle.in_backward or not cycle.backward_ran:
            if not cycle.in_backward:
                hooks.gather_root_buckets()
            if hooks.sharding.shard_params:
                for unit_id in reversed(units):
                    if not hooks.unit_in_post_backward(unit_id):
                        hooks.unit_pre_backward(unit_id)
                        hooks.unit_post_backward(unit_id)
            hooks.end_backward()
        self.sync_grads()
        self.refuse_non_finite_grads()
