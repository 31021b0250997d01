"""A MegatronFSDP model's forward and backward hooks: when weights are gathered and released, when the
modules show the compute params, and when grads enter their buckets (a unit's in its post-backward, one
call per bucket, as torch FSDP2 takes a param group's; a param's outside every unit from its own hook).

The hooks decide *what* happens at each point of a training step; :mod:`gradsync.fsdp.schedule` decides
*when* it communicates. They run outside ``torch.compile``'s trace (:func:`outside_compile`), as torch
FSDP2's do, so a compiled model never freezes one mesh's groups into its frame. Module hooks sit in the
modules' hook dicts, which the garbage collector sees, so the cycle wrapper -> module -> hook -> wrapper is
collected once nothing else holds either. A param's hooks are invisible to it: those hold these hooks
weakly (:func:`weak_method`) and are removed, with the params' ``main_grad`` views, when they go.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from gradsync.buffers.step_cycle import StepCycle
from gradsync.groups.torch_internals import queue_backward_end_callback

from .bucket import FlatParamBucket
from .bucket_set import BucketSet
from .hooks import (
    TrainingState,
    attach_post_backward,
    get_state,
    labelled,
    on_first_output_grad,
    outside_compile,
    set_state,
    weak_method,
)
from .schedule import GatherSchedule, ReduceSchedule
from .settings import Sharding
from .sharded_param import ParamRegistry, ShardedParam, ShardedParams


class TrainingHooks:
    """The hooks of one wrapped ``module`` over its ``units``. Every root forward runs ``check_forward``
    first (the wrapper's checks), then ``install_stepped`` (an optimizer step's weights, before any
    gather); every backward ends with ``backward_ended`` (the wrapper's auto-sync)."""

    def __init__(
        self,
        module: nn.Module,
        units: list[nn.Module],
        buckets: BucketSet,
        sharding: Sharding,
        schedules: tuple[GatherSchedule, ReduceSchedule],
        registry: ParamRegistry,
        cycle: StepCycle,
        *,
        check_forward: Callable[[], None],
        install_stepped: Callable[[], None],
        backward_ended: Callable[[], None],
        report_nan_in_param_grad: bool,
    ) -> None:
        self.module, self.units, self.buckets, self.sharding = module, units, buckets, sharding
        self.gathers, self.reductions = schedules
        self.registry, self.cycle = registry, cycle
        self.check_forward, self.install_stepped = check_forward, install_stepped
        self.backward_ended = backward_ended
        self.report_nan_in_param_grad = report_nan_in_param_grad
        self.units_kept_after_forward: set[int] = set()  # ZeRO-3 units not released after their forward
        self._all_modules = list(module.modules())
        self._modules_of_unit = [list(unit.modules()) for unit in units]
        set_state(self._all_modules, TrainingState.IDLE)

    def register(self, params: ShardedParams) -> None:
        self.module.register_forward_pre_hook(outside_compile(self.root_pre_forward), prepend=True)
        self.module.register_forward_hook(outside_compile(self.root_post_forward))
        for unit_id, unit in enumerate(self.units):
            unit.register_forward_pre_hook(
                outside_compile(functools.partial(self.unit_pre_forward, unit_id)),
                prepend=True,
                with_kwargs=True,
            )
            unit.register_forward_hook(outside_compile(functools.partial(self.unit_post_forward, unit_id)))
        self.records = params.records
        # a grad of a param outside every unit goes to its bucket from its own hook; a unit's grads go in
        # its post-backward, each bucket's in one call (and any left over at the backward's end)
        outside = {bucket.bucket_id for bucket in self.buckets.outside_units}
        trainable: dict[int, list[ShardedParam]] = {}  # by bucket id, in one pass over the records
        for record in params.records:
            if record.compute.requires_grad:
                trainable.setdefault(record.bucket.bucket_id, []).append(record)
        self._unit_grads: list[list[tuple[FlatParamBucket, list[ShardedParam]]]] = [
            [(bucket, trainable.get(bucket.bucket_id, [])) for bucket in buckets]
            for buckets in self.buckets.of_unit
        ]
        grad_hooks = [
            record.compute.register_post_accumulate_grad_hook(  # type: ignore[no-untyped-call]
                # its position, not the record: that reaches the wrapper, which a kept param's hook
                # must not hold
                weak_method(self, "on_grad", position)
            )
            for position, record in enumerate(params.records)
            if record.compute.requires_grad and record.bucket.bucket_id in outside
        ]
        weakref.finalize(self, _detach_from_params, grad_hooks, [record.compute for record in params])

    # --- forward -----------------------------------------------------------------------------------
    @labelled("root_pre_forward")
    def root_pre_forward(self, module: nn.Module, args: Any) -> None:
        self.check_forward()  # every rank fails alike: each raises before any collective
        if module.training and torch.is_grad_enabled():  # noted first: a forward that raises counts too
            self.cycle.forward_ran()
        self.install_stepped()
        self.registry.show_compute()
        self.gather_for_forward()

    def gather_for_forward(self) -> None:
        """The forward's first gathers: the buckets outside every unit, and the first units' prefetch."""
        if self.sharding.name == "no_shard":
            return
        for bucket in self.buckets.outside_units:
            bucket.launch_gather()
        self.gathers.prefetch(0 if self.units else None)
        for bucket in self.buckets.outside_units:
            bucket.wait_gather()

    def root_post_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        if torch.is_grad_enabled():
            self.cycle.forwards_awaiting_backward += 1
            on_first_output_grad(output, self.root_pre_backward)
            return
        if self.sharding.shard_params:  # no backward follows: drop what the forward gathered
            for bucket in self.buckets.buckets:
                bucket.release()
        if not self.cycle.forwards_awaiting_backward:
            self.registry.show_optimizer()

    @labelled("pre_forward")
    def unit_pre_forward(
        self, unit_id: int, unit: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        recomputing = get_state(unit) is TrainingState.PRE_BACKWARD
        if not recomputing:
            set_state(self._modules_of_unit[unit_id], TrainingState.FORWARD)
        if self.sharding.shard_main:  # no_shard's compute weights are never stale
            self.gathers.gather_unit(unit_id, prefetch=None if recomputing else unit_id + 1)
        return attach_post_backward(args, kwargs, functools.partial(self.unit_post_backward, unit_id))

    @labelled("post_forward")
    def unit_post_forward(self, unit_id: int, unit: nn.Module, args: Any, output: Any) -> None:
        """ZeRO-3 releases the unit, except during recomputation (its backward follows at once) and, when
        a backward will follow, for the last unit (backward starts with it) and ``units_kept_after_forward``
        (FSDP2's ``reshard_after_forward=False``: no gather in the backward)."""
        if get_state(unit) is not TrainingState.PRE_BACKWARD:  # not recomputing
            self.release_after_forward(unit_id, backward_follows=torch.is_grad_enabled())
        if self.sharding.shard_params:  # weights kept whole since the forward need nothing before backward
            on_first_output_grad(output, functools.partial(self.unit_pre_backward, unit_id))

    def release_after_forward(self, unit_id: int, backward_follows: bool) -> None:
        kept = unit_id == len(self.units) - 1 or unit_id in self.units_kept_after_forward
        if self.sharding.shard_params and not (kept and backward_follows):
            for bucket in self.buckets.of_unit[unit_id]:
                bucket.release()

    # --- backward ----------------------------------------------------------------------------------
    @labelled("root_pre_backward")
    def root_pre_backward(self) -> None:
        cycle = self.cycle
        if cycle.in_backward:
            return
        cycle.backward_began()
        set_state(self._all_modules, TrainingState.PRE_BACKWARD)
        self.gather_root_buckets()
        queue_backward_end_callback(self.root_post_backward)

    def gather_root_buckets(self) -> None:
        """ZeRO-3: the buckets outside every unit, at the backward's start (an earlier microbatch's
        backward may have released them)."""
        if self.sharding.shard_params:
            for bucket in self.buckets.outside_units:
                bucket.launch_gather()
            for bucket in self.buckets.outside_units:
                bucket.wait_gather()

    @labelled("pre_backward")
    def unit_pre_backward(self, unit_id: int) -> None:
        """ZeRO-3: gather the unit (its backward is next) and prefetch the ones before it."""
        set_state(self._modules_of_unit[unit_id], TrainingState.PRE_BACKWARD)
        self.gathers.gather_for_backward(unit_id)

    @labelled("post_backward")
    def unit_post_backward(self, unit_id: int) -> None:
        """The unit's backward is done (grads reached its inputs): its grads go to their buckets, and
        ZeRO-3 releases its weights."""
        set_state(self._modules_of_unit[unit_id], TrainingState.POST_BACKWARD)
        self.take_unit_grads(unit_id)
        if self.sharding.shard_params:
            for bucket in self.buckets.of_unit[unit_id]:
                bucket.release()

    def take_unit_grads(self, unit_id: int) -> None:
        """Move the grads the unit's params hold into their buckets, one call per bucket, as torch FSDP2's
        post-backward takes a param group's. Autograd has summed every grad of this backward into
        ``.grad`` (a unit run through several backwards, or a param whose grad lands after the unit's
        post-backward, leaves its grad there for the next take: at the latest the backward's end)."""
        for bucket, records in self._unit_grads[unit_id]:
            arrived = [record for record in records if record.compute.grad is not None]
            if not arrived:
                continue
            grads = [record.compute.grad for record in arrived]
            for record in arrived:
                record.compute.grad = None
            if self.report_nan_in_param_grad:
                self._note_non_finite(arrived, grads)  # type: ignore[arg-type]
            self.reductions.add_grads(bucket, arrived, grads)  # type: ignore[arg-type]

    def on_grad(self, position: int, param: torch.Tensor) -> None:
        """``param``'s grad of this backward is complete: move it into its bucket (``param`` is the
        compute param of record ``position``, outside every unit)."""
        grad = param.grad
        if grad is None:
            return
        record = self.records[position]
        if self.report_nan_in_param_grad:
            self._note_non_finite([record], [grad])
        self.reductions.add_grad(record, grad)
        param.grad = None

    def _note_non_finite(self, records: list[ShardedParam], grads: list[torch.Tensor]) -> None:
        """``report_nan_in_param_grad``: name the params whose grad holds a NaN or an infinity."""
        for record, grad in zip(records, grads, strict=True):
            if not bool(torch.isfinite(grad).all()):
                record.bucket.non_finite_params.append(record.name)

    @labelled("root_post_backward")
    def root_post_backward(self) -> None:
        self.end_backward()
        self.backward_ended()

    def end_backward(self) -> None:
        """End of the backward: buckets some param of which got no grad on this rank complete
        (:meth:`ReduceSchedule.end_backward`: no_shard's and ZeRO-1's reductions are left in flight for
        ``finish_grad_sync()``), and ZeRO-3 drops every gathered weight."""
        for unit_id in range(len(self.units)):
            self.take_unit_grads(unit_id)
        self.reductions.end_backward()
        if self.sharding.shard_params:
            for bucket in self.buckets.buckets:
                bucket.release()
        set_state(self._all_modules, TrainingState.IDLE)
        cycle = self.cycle
        cycle.backward_ended()
        if not cycle.forwards_awaiting_backward:  # no recomputation can need the compute params now
            self.registry.show_optimizer()

    def unit_in_post_backward(self, unit_id: int) -> bool:
        return get_state(self.units[unit_id]) is TrainingState.POST_BACKWARD


def _detach_from_params(handles: list[RemovableHandle], params: list[nn.Parameter]) -> None:
    """The wrapper is gone: its params lose their grad hooks and their views into its grad buffers."""
    for handle in handles:
        handle.remove()
    for param in params:
        if hasattr(param, "main_grad"):
            del param.main_grad
