"""When MegatronFSDP communicates, and the cycle state those schedules read.

Where a MegatronFSDP model is in its training cycle (``zero_grad_buffer()`` to the optimizer step).

The forward and backward hooks write these facts and the step's checks read them; one object holds them so
both sides see the same state, and a step abandoned part-way can be told from a finished one.

Which MegatronFSDP models an optimizer step has updated, so their next forward installs the weights.

The optimizer's in-place updates of the DTensor shards leave no trace a model could read on every rank
alike (a rank owning no rows of a bucket sees nothing change, and DTensor updates do not bump the flat
buffer's version counter). A post-step hook of each optimizer holding a model's params
(:mod:`gradsync.fsdp.optimizer_facing`) marks the model after every step, on every rank: a
rank-consistent "stepped" flag, cleared by ``install_optimized_model_weights()``.

``suggested_communication_unit_size``: how many elements MegatronFSDP communicates at once.

Half of it bounds the all-gather prefetch (how many following units are gathered ahead), all of it the
elements of grad reductions allowed in flight before the oldest is waited for. Unset, it is twice the
average unit for ZeRO-3 (so one unit is prefetched), else ``bucket_size``, else 1e9; and unset, ZeRO-1/2
prefetch every unit (:func:`prefetch_size`). The reference docs
say a smaller value means less prefetching; the reference code floors the value at 1e9 (a min/max
mix-up by its own comment, "Cap to 1B"), which would make any smaller setting meaningless, so gradsync
caps it at 1e9 instead.

When MegatronFSDP communicates: which gathers run ahead of use, and when each bucket's grads are reduced.

:class:`GatherSchedule` gathers a unit's buckets and prefetches the next units in forward or backward
order within a budget of elements. :class:`ReduceSchedule` counts each bucket's grads as they arrive (a
unit's at once, or one param's outside every unit; :mod:`gradsync.buffers.grad_arrivals`, as
gradsync-ddp's bucket groups do, expecting one per param),
launches its reduction when the last one lands (or defers it to the end of the cycle: ``no_shard`` and
``optim`` reduce once per cycle), reduces buckets grouped by :mod:`gradsync.fsdp.coalesce` in one
collective, bounds the reductions in flight, chains HSDP's outer stage to the inner one
(:func:`~gradsync.buffers.collectives.chain`), and reopens a bucket reduced earlier in the cycle when
more grads arrive (accumulation without ``no_sync()``). A bucket whose grads arrive again after its
reduction launched in the same backward (a module run through several backwards before the root's, as a
chunked loss runs its output head) is reduced again at the backward's end, so every backward's grads
count. The wrapper decides *what* happens in its hooks; these two decide *when* it communicates.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from gradsync.buffers import DistributedDataParallelConfig, watchdog
from gradsync.buffers.collectives import Launched, chain
from gradsync.buffers.grad_arrivals import GradArrivals
from gradsync.buffers.grad_checks import LocalGradNorms
from gradsync.buffers.step_cycle import StepCycle

from .allocators import BucketAllocator
from .bucket import BucketStatus, FlatParamBucket, GradReduction
from .coalesce import ReductionGroup
from .hooks import labelled
from .layout import OuterReplication
from .settings import Sharding
from .sharded_param import ShardedParam

CAP = 1_000_000_000


def communication_unit_size(
    config: DistributedDataParallelConfig, shards_params: bool, unit_sizes: Sequence[int]
) -> int:
    """Elements per communication unit, from the config and the units' sizes (in elements)."""
    value = config.suggested_communication_unit_size
    if value is not None and value < 0:
        raise ValueError(
            f"suggested_communication_unit_size={value} must be >= 0 (0 turns all-gather prefetch off)"
        )
    if value is None:
        if shards_params and unit_sizes:
            value = 2 * sum(unit_sizes) // len(unit_sizes)
        else:
            value = config.bucket_size if config.bucket_size is not None else CAP
    return min(CAP, value)


def prefetch_size(config: DistributedDataParallelConfig, shards_params: bool, unit_size: int) -> int:
    """Elements gathers may prefetch: half the communication unit, or, with the unit size unset and the
    weights kept whole (ZeRO-1/2), everything: prefetching then costs no memory, and a gather waited
    unit by unit would be exposed in full."""
    if config.suggested_communication_unit_size is None and not shards_params:
        return CAP
    return unit_size // 2


class GatherSchedule:
    """Gathers of the units' buckets, with prefetch of whole units within ``prefetch_size`` elements."""

    def __init__(
        self,
        unit_buckets: Sequence[Sequence[FlatParamBucket]],
        weights: BucketAllocator,
        prefetch_size: int,
        *,
        weights_stay_whole: bool = False,
    ) -> None:
        """``weights_stay_whole``: ZeRO-1/2, whose compute weights all go stale together (an optimizer
        step) and are never released. With a budget for every unit, a prefetch that meets a unit already
        gathered or in flight then follows an earlier prefetch that launched all the rest: it stops
        there instead of walking the remaining units again (quadratic in the units per forward)."""
        self.unit_buckets = unit_buckets
        self.weights_stay_whole = weights_stay_whole
        self.unit_sizes = [sum(b.layout.size for b in buckets) for buckets in unit_buckets]
        self.total_size = sum(self.unit_sizes)
        self.weights = weights
        self.prefetch_size = prefetch_size  # 0 turns prefetch off
        # FSDP2's explicit prefetch lists, per unit and direction (+1 forward, -1 backward): they replace
        # the budgeted prefetch after that unit's gather
        self.chosen_prefetch: dict[tuple[int, int], list[int]] = {}
        self.not_gathered_in_backward: set[int] = set()  # FSDP2's set_unshard_in_backward(False)

    def gather_unit(self, unit_id: int, prefetch: int | None) -> None:
        """Gather unit ``unit_id`` (and prefetch from unit ``prefetch`` on, away from it, or the units
        chosen for it), and wait."""
        for bucket in self.unit_buckets[unit_id]:
            bucket.launch_gather()
        if prefetch is not None:
            direction = 1 if prefetch > unit_id else -1
            chosen = self.chosen_prefetch.get((unit_id, direction))
            if chosen is None:
                self.prefetch(prefetch, direction)
            for other in chosen or ():
                buckets = self.unit_buckets[other]
                if all(self.weights.can_allocate(b.bucket_id) for b in buckets):
                    for bucket in buckets:
                        bucket.launch_gather()
        for bucket in self.unit_buckets[unit_id]:
            bucket.wait_gather()

    def gather_for_backward(self, unit_id: int) -> None:
        """Gather unit ``unit_id`` for its backward (unless its backward needs no weights), prefetching
        the units before it."""
        if unit_id in self.not_gathered_in_backward:
            return
        self.gather_unit(unit_id, prefetch=unit_id - 1)

    def prefetch(self, unit_id: int | None, direction: int = 1) -> None:
        """Start gathering whole units from ``unit_id`` on, in ``direction`` (+1: forward order, -1:
        backward), while they fit ``prefetch_size`` elements together."""
        budget = self.prefetch_size
        unbounded_run = self.weights_stay_whole and budget >= self.total_size
        while unit_id is not None and 0 <= unit_id < len(self.unit_buckets):
            if direction < 0 and unit_id in self.not_gathered_in_backward:
                unit_id += direction
                continue
            buckets, size = self.unit_buckets[unit_id], self.unit_sizes[unit_id]
            if unbounded_run and all(b.status is not BucketStatus.EMPTY for b in buckets):
                return
            if size > budget or not all(self.weights.can_allocate(b.bucket_id) for b in buckets):
                return  # out of budget, or double buffers both held by units still in use
            for bucket in buckets:
                bucket.launch_gather()
            budget -= size
            unit_id += direction


class ReduceSchedule:
    """The grad reductions of ``buckets``: readiness, deferral to the cycle's end, the queue in flight.

    ``cycle_ends()`` says whether the running backward is the cycle's last (``is_last_microbatch`` or
    auto-sync): the once-per-cycle reductions and HSDP's outer stage run in it. ``groups``: the buckets'
    reduction groups, consecutive in bucket order (a bucket alone is a group of one).
    """

    def __init__(
        self,
        buckets: Sequence[FlatParamBucket],
        groups: Sequence[ReductionGroup],
        sharding: Sharding,
        outer: OuterReplication | None,
        reduction: GradReduction,
        *,
        overlap: bool,
        grad_norms: LocalGradNorms | None,
        cycle_ends: Callable[[], bool],
        queue_capacity: int,
        steps: StepCycle,
    ) -> None:
        self.buckets = buckets
        self.groups = list(groups)
        self.group_of = {b.bucket_id: group for group in self.groups for b in group.buckets}
        self.sharding, self.outer, self.reduction = sharding, outer, reduction
        self.overlap, self.grad_norms, self.cycle_ends = overlap, grad_norms, cycle_ends
        self.queue_capacity = queue_capacity  # elements in flight before the oldest is waited for
        self._ready: dict[int, GradArrivals[int]] = {  # one grad per param (by its index) completes it
            b.bucket_id: GradArrivals(dict.fromkeys(range(len(b.spec.params)), 1)) for b in buckets
        }
        self._completed: set[int] = set()  # in this backward
        self._pending: set[int] = set()  # complete, reduction deferred to the cycle's end
        self._outer_pending: set[int] = set()  # HSDP: inner-reduced this cycle, the outer stage not run
        self._reduced_this_cycle: set[int] = set()  # the cycle's final reduction ran
        self.in_flight: list[tuple[Launched, int]] = []  # (launched reduction, its elements)
        # Launch order, the same on every rank whatever order grads arrive in (a param without a grad on
        # one rank must not let that rank pair other buckets' collectives with the wrong ones elsewhere):
        # reverse bucket order, as a backward completes them.
        self._launch_order = [b.bucket_id for b in reversed(buckets) if b.spec.requires_grad]
        self._next_launch = 0
        self._launchable: set[int] = set()
        self._staged: set[int] = set()  # popped in launch order, their group's other buckets not yet
        self._launched: set[int] = set()  # reduced in this backward (its grads left the bucket)
        self._relaunch: set[int] = set()  # grads arrived after the launch: reduced again at the end
        self.steps = steps

    # --- grads arriving ------------------------------------------------------------------------------
    def add_grad(self, record: ShardedParam, grad: torch.Tensor) -> None:
        """Accumulate ``record``'s grad of this backward (a param outside every unit, from its own hook);
        reduce its bucket once it is complete."""
        bucket = record.bucket
        views = self._open(bucket)
        target = record.main_grad if views is None else views[record.index]
        assert target is not None
        # a grad with history (create_graph=True) would record the buffer into the graph: add its data
        target.add_(grad.detach() if grad.requires_grad else grad)
        if self._ready[bucket.bucket_id].arrive(record.index):
            self._complete(bucket)

    def add_grads(
        self, bucket: FlatParamBucket, records: Sequence[ShardedParam], grads: Sequence[torch.Tensor]
    ) -> None:
        """Accumulate this backward's ``grads`` of ``records`` (items of ``bucket``, a unit's, taken in its
        post-backward) in one foreach add; reduce the bucket once it is complete."""
        views = self._open(bucket)
        if views is None:
            targets = [record.main_grad for record in records]
        else:
            targets = [views[record.index] for record in records]
        grads = [grad.detach() if grad.requires_grad else grad for grad in grads]  # as in add_grad
        torch._foreach_add_(targets, grads)  # type: ignore[arg-type]
        if self._ready[bucket.bucket_id].arrive_all([record.index for record in records]):
            self._complete(bucket)

    def _open(self, bucket: FlatParamBucket) -> list[torch.Tensor] | None:
        """Make ``bucket`` ready to take grads: refused after a step; a reduction launched in this backward
        lands first (the bucket is reduced again at its end), one from earlier in the cycle is set aside.
        ZeRO-2/3: the views of its borrowed whole-bucket grads (no_shard and ZeRO-1 add into each param's
        ``main_grad``: None)."""
        self._refuse_after_step()
        bucket_id = bucket.bucket_id
        if bucket_id in self._launched and bucket_id not in self._relaunch:
            self._relaunch.update(self.group_of[bucket_id].bucket_ids)
            self.wait_all()  # the launched reduction must land before its buffer takes new grads
        if bucket_id in self._reduced_this_cycle:
            self._reopen(self.group_of[bucket_id])
        if not self.sharding.shard_grads:
            return None
        if not bucket.can_take_grads():
            self.wait_until(bucket.can_take_grads)
        return bucket.unreduced.views()

    def end_backward(self) -> None:
        """Every grad bucket not completed by its grads (a param got no grad on this rank) completes now,
        in bucket order so every rank posts the same collectives (a bucket reduced earlier in the cycle
        is reopened too: another rank may have grads for it). Then the groups that got grads after their
        reduction launched in this backward are reduced again, in bucket order: every rank runs the same
        backwards through a module (as torch FSDP2 requires), so every rank relaunches the same groups.
        ZeRO-2/3 then wait for every reduction: the next backward's grads go into the same unreduced
        buffers. no_shard's and ZeRO-1's stay in flight: ``finish_grad_sync()`` posts the step's vote
        before it waits for them, so the vote's round trip hides behind the last reduction instead of
        following it (a grad that arrives before then waits for them first: :meth:`_open`)."""
        self._refuse_after_step()  # before any collective, on every rank (those with grads raised already)
        for bucket in self.buckets:
            if not bucket.spec.requires_grad or bucket.bucket_id in self._completed:
                continue
            if bucket.bucket_id in self._reduced_this_cycle:
                self._reopen(self.group_of[bucket.bucket_id])
            self._complete(bucket)
        relaunch, self._relaunch = self._relaunch, set()
        for group in self.groups:
            if relaunch.intersection(group.bucket_ids):
                for bucket_id in group.bucket_ids:
                    self._ready[bucket_id].restart()  # a partial arrival counts in the relaunch
                self.launch(group)
        self._completed.clear()
        self._launched.clear()
        self._next_launch = 0
        if self.sharding.shard_grads:
            self.wait_all()

    def _refuse_after_step(self) -> None:
        if self.steps.grads_consumed:
            raise RuntimeError(
                "MegatronFSDP: a backward ran after an optimizer step without zero_grad_buffer(): the grad "
                "buffers still hold the stepped grads, and adding to them would count those twice. Call "
                "model.zero_grad_buffer() (optimizer.zero_grad() does it with fully_shard_optimizer / "
                "fully_shard) before the next step's first backward"
            )

    def _reopen(self, group: ReductionGroup) -> None:
        """Accumulation after the cycle's final reduction (every microbatch synced, as torch DDP and FSDP2
        users write it): the group's buckets are reduced again, and the reduced grads are summed. Correct
        for every strategy; ``no_sync()`` saves the extra reductions."""
        self.wait_all()  # its last reduction must have landed before its grads are set aside
        for bucket in group.buckets:
            bucket.set_aside_reduced()
            self._reduced_this_cycle.discard(bucket.bucket_id)

    def _complete(self, bucket: FlatParamBucket) -> None:
        self._ready[bucket.bucket_id].restart()
        self._completed.add(bucket.bucket_id)
        if bucket.bucket_id in self._relaunch:
            return  # reduced again at the end of the backward
        if self.sharding.shard_grads or (self.overlap and self.cycle_ends()):
            self._launchable.add(bucket.bucket_id)
            while self._next_launch < len(self._launch_order):
                bucket_id = self._launch_order[self._next_launch]
                if bucket_id not in self._launchable:
                    return  # an earlier bucket in the launch order is still waiting for grads
                self._launchable.discard(bucket_id)
                self._next_launch += 1
                self._staged.add(bucket_id)
                group = self.group_of[bucket_id]
                if self._staged.issuperset(group.bucket_ids):  # its last bucket in launch order
                    self._staged.difference_update(group.bucket_ids)
                    self._launched.update(group.bucket_ids)
                    self.launch(group)
        else:
            self._pending.add(bucket.bucket_id)

    # --- launching -----------------------------------------------------------------------------------
    @labelled("reduce")
    def launch(self, group: ReductionGroup) -> None:
        """Launch ``group``'s reduction over the shard group, and the outer stage after it when it ends
        the cycle (HSDP, whose buckets reduce alone; ZeRO-2/3 accumulate in the shard until then)."""
        self._pending.difference_update(group.bucket_ids)
        ends_cycle = not self.sharding.shard_grads or self.cycle_ends()
        if ends_cycle and (self.outer is not None or not self.sharding.shard_grads):
            self._reduced_this_cycle.update(group.bucket_ids)
        for member in group.buckets:
            self.wait_until(member.can_take_grads)  # a bucket without grads needs a buffer now
            member.note_reduction()
        elements = group.size
        if self.sharding.shard_grads:  # bound the temporary whole-bucket grads in flight; persistent
            # grad buffers (no_shard, optim) cost nothing more in flight, and a wait would stall the backward
            while self.in_flight and sum(n for _, n in self.in_flight) + elements > self.queue_capacity:
                self.in_flight.pop(0)[0].wait()
        launched = group.launch_reduce(self.reduction, self.grad_norms)
        if self.outer is not None:
            (bucket,) = group.buckets
            if ends_cycle:
                self._outer_pending.discard(bucket.bucket_id)
                launched = chain(
                    launched, lambda: self._launch_outer(bucket), self.outer.group, bucket.device
                )
            else:
                self._outer_pending.add(bucket.bucket_id)
        self.in_flight.append((launched, elements))

    def _launch_outer(self, bucket: FlatParamBucket) -> Launched:
        """``bucket``'s outer stage (it needs the inner reduction's result: see :func:`chain`)."""
        self._reduced_this_cycle.add(bucket.bucket_id)
        bucket.note_reduction()
        return bucket.launch_outer_reduce(self.reduction)

    def launch_deferred(self) -> None:
        """The reductions waiting for the end of the cycle (no_shard / optim), and HSDP's outer stages of
        ZeRO-2/3 buckets whose last backward ran under no_sync()."""
        for group in self.groups:
            if self._pending.intersection(group.bucket_ids):  # all of them: they complete together
                self.launch(group)
        if self._outer_pending:
            self.wait_all()
            for bucket_id in sorted(self._outer_pending):
                bucket = self.buckets[bucket_id]
                self.in_flight.append((self._launch_outer(bucket), bucket.layout.size))
            self._outer_pending.clear()

    # --- waiting -------------------------------------------------------------------------------------
    def wait_until(self, ready: Callable[[], bool]) -> None:
        """Double buffers: finish the oldest reductions (freeing their grad buffers) until ``ready()``."""
        while self.in_flight and not ready():
            self.in_flight.pop(0)[0].wait()

    def wait_all(self) -> None:
        while self.in_flight:  # waiting an inner reduction may queue its outer stage
            self.in_flight.pop(0)[0].wait()

    def new_cycle(self) -> None:
        """After ``zero_grad_buffer``: nothing is reduced, deferred or pending any more, and grads may
        arrive again after an optimizer step."""
        self.wait_all()
        self._reduced_this_cycle.clear()
        self._pending.clear()
        self._outer_pending.clear()
        self._launchable.clear()
        self._staged.clear()
        self._launched.clear()
        self._relaunch.clear()
        self._next_launch = 0

    def missing_grads(self, in_backward: bool) -> dict[str, str]:
        """Buckets still waiting for grads in this backward, by param name (for the hang watchdog)."""
        missing = {}
        for bucket in self.buckets:
            done = bucket.bucket_id in self._completed or bucket.bucket_id in self._reduced_this_cycle
            arrived = self._ready[bucket.bucket_id].counts
            if not bucket.spec.requires_grad or done or not (arrived or in_backward):
                continue
            names = [n for i, n in enumerate(bucket.spec.names) if i not in arrived]
            missing[bucket.label] = f"no grad yet for {watchdog.missing_names(names)}"
        return missing
