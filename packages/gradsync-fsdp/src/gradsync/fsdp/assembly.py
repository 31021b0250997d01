"""How a MegatronFSDP model is put together once its buckets exist: the optimizer's params, one record per
param, the gather and reduction schedules, the hooks, and the objects that keep the weights current and
end each cycle. Each part gets what it needs at construction, so none reaches back into the wrapper.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from gradsync.buffers import DistributedDataParallelConfig, gradient_scaling_factors
from gradsync.buffers.grad_checks import LocalGradNorms
from gradsync.buffers.optimizer_watch import watch_optimizers
from gradsync.buffers.step_ballot import StepBallot
from gradsync.buffers.step_cycle import StepCycle
from gradsync.buffers.wrapper_claims import claim
from gradsync.groups import FSDPDistributedIndex

from .bucket import GradReduction
from .bucket_set import BucketSet
from .layout import OuterReplication, optimizer_placements
from .meta_init import MetaReplacement
from .schedule import GatherSchedule, ReduceSchedule, communication_unit_size, prefetch_size
from .settings import Sharding
from .sharded_param import ParamRegistry, ShardedParams, build_optimizer_params
from .step_control import StepControl, WeightSync
from .training_hooks import TrainingHooks

MEGATRON_OWNER = "_megatron_fsdp_model"
"""The attribute of an optimizer param that names its MegatronFSDP: Megatron's own code reads it (its
optimizer setup tells Megatron-FSDP models apart by it), so it is written for Megatron, as ``main_grad``
is; gradsync finds a param's wrapper through its claims (:mod:`gradsync.buffers.wrapper_claims`)."""


@dataclass(frozen=True)
class WrapperCalls:
    """What the parts call on the wrapper: its check before every forward, what ends a backward
    (auto-sync), whether a backward ends the cycle, and its (labelled) wait for every reduction."""

    check_forward: Callable[[], None]
    backward_ended: Callable[[], None]
    cycle_ends: Callable[[], bool]
    sync_grads: Callable[[], None]


@dataclass(frozen=True)
class Parts:
    params: ShardedParams
    steps: StepCycle
    weights: WeightSync
    hooks: TrainingHooks
    step: StepControl
    communication_unit_size: int


def assemble(
    owner: nn.Module,
    module: nn.Module,
    units: list[nn.Module],
    named: Sequence[tuple[str, nn.Parameter]],
    buckets: BucketSet,
    meta: MetaReplacement | None,
    layout: tuple[Sharding, OuterReplication | None, FSDPDistributedIndex],
    config: DistributedDataParallelConfig,
    device: torch.device,
    calls: WrapperCalls,
    *,
    calculate_per_token_loss: bool,
    report_nan_in_param_grad: bool,
) -> Parts:
    """The parts of ``owner`` (the wrapper of ``module``), whose params are claimed for it, so that
    optimizer steps find it, and whose optimizer params name it for Megatron (:data:`MEGATRON_OWNER`)."""
    sharding, outer, dist_index = layout
    shard_dim = dist_index.dp_shard_dim or ""
    dims = (dist_index.dp_outer_dim, shard_dim) if dist_index.dp_outer_dim else (shard_dim,)
    placements = optimizer_placements(sharding, outer)
    mesh = dist_index.get_submesh(dims)
    optimizer_params = [build_optimizer_params(bucket, mesh, placements) for bucket in buckets.buckets]
    params = ShardedParams(module, named, buckets.buckets, optimizer_params)
    for record in params:
        setattr(record.sharded, MEGATRON_OWNER, owner)
    # the local tensors too: an optimizer that lends them for its steps may first meet the model in one
    claim([*(p for _, p in named), *(t for r in params for t in (r.sharded, r.local))], owner)
    watch_optimizers()
    all_dp = outer.hybrid_group if outer is not None else dist_index.get_fsdp_group()
    steps = StepCycle(
        StepBallot([all_dp], "MegatronFSDP", config.check_abandoned_steps), params.frozen_at_wrap()
    )
    registry = ParamRegistry(params)
    for meta_param, placeholder in (meta.params if meta is not None else {}).items():
        params.alias(meta_param, placeholder)  # fully_shard's optimizer holds the meta params
    unit_sizes = [sum(b.layout.size for b in unit) for unit in buckets.of_unit]
    unit_size = communication_unit_size(config, sharding.shard_params, unit_sizes)
    gathers = GatherSchedule(
        buckets.of_unit,
        buckets.allocators.weights,
        prefetch_size(config, sharding.shard_params, unit_size),
        weights_stay_whole=not sharding.shard_params,
    )
    grad_norms = None  # the NaN check's local norms, read once per cycle at finish_grad_sync
    if config.check_for_nan_in_grad or report_nan_in_param_grad:
        grad_norms = LocalGradNorms(len(buckets.buckets), device)
    for coalesced in buckets.reduction_groups:
        coalesced.gathers_together()
    dense_factor, _ = gradient_scaling_factors(  # the rule gradsync-ddp follows too
        config,
        calculate_per_token_loss=calculate_per_token_loss,
        data_parallel_cp_size=dist_index.get_dp_group().size(),
        expert_data_parallel_size=1,
    )
    reductions = ReduceSchedule(
        buckets.buckets,
        buckets.reduction_groups,
        sharding,
        outer,
        GradReduction(dense_factor, config.average_in_collective),
        overlap=config.overlap_grad_reduce,
        grad_norms=grad_norms,
        cycle_ends=calls.cycle_ends,
        queue_capacity=unit_size,
        steps=steps,
    )
    weights = WeightSync(buckets, sharding, config, gathers, registry, steps)
    hooks = TrainingHooks(
        module, units, buckets, sharding, (gathers, reductions), registry, steps,
        check_forward=calls.check_forward,
        install_stepped=weights.install_if_stepped,
        backward_ended=calls.backward_ended,
        report_nan_in_param_grad=report_nan_in_param_grad,
    )  # fmt: skip
    step = StepControl(buckets, hooks, params, all_dp, grad_norms, calls.sync_grads)
    hooks.register(params)
    registry.show_optimizer()
    return Parts(params, steps, weights, hooks, step, unit_size)
