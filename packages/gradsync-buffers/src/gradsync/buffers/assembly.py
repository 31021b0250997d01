"""Build every buffer and bucket group of a model from its named params and process groups.

This is the part of a DDP wrapper's construction that does not depend on hooks: group params into
buffers (dense over the intra-instance dp x cp group, expert params over the expert-DP group), derive the
effective bucket size and scaling factors, and partition buckets into groups. All group checks happen
here, before any collective.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.nn import Parameter

from gradsync.groups import ProcessGroupCollection

from . import telemetry, watchdog
from .bucket_group import ParamAndGradBucketGroup, partition_buckets
from .buffer import ParamAndGradBuffer
from .config import DistributedDataParallelConfig, effective_bucket_size
from .layout import BufferKey, FullParamLayout, ParamSpec, group_specs_for_buffers
from .scaling import gradient_scaling_factors


@dataclass
class GradBuffers:
    """A model's buffers and bucket groups, dense and expert-parallel, and the bucket size in use."""

    buffers: list[ParamAndGradBuffer]
    expert_parallel_buffers: list[ParamAndGradBuffer]
    bucket_groups: list[ParamAndGradBucketGroup]
    expert_parallel_bucket_groups: list[ParamAndGradBucketGroup]
    bucket_size: int | None

    @property
    def all_buffers(self) -> list[ParamAndGradBuffer]:
        return self.buffers + self.expert_parallel_buffers

    @property
    def all_bucket_groups(self) -> list[ParamAndGradBucketGroup]:
        return self.bucket_groups + self.expert_parallel_bucket_groups

    def __post_init__(self) -> None:
        for index, group in enumerate(self.bucket_groups):
            group.label = f"bucket_group{index}"
        for index, group in enumerate(self.expert_parallel_bucket_groups):
            group.label = f"expert_bucket_group{index}"
        clock = itertools.count()
        for group in self.all_bucket_groups:
            group.grad_clock = clock

    def launch_order(self) -> list[ParamAndGradBucketGroup]:
        """The order in which every rank launches the bucket groups' reductions (with
        ``overlap_grad_reduce``): the groups' own in the first iteration (its ``finish_grad_sync`` launches
        them), later the order the backward readies them in, the same every iteration."""
        groups = self.all_bucket_groups
        if not groups or groups[0].is_first_batch:
            return groups
        return sorted(groups, key=lambda group: group.readied_at)

    def reset(self) -> None:
        """Zero every grad and start a new iteration in every bucket group.

        After the first iteration in which backward reported grads, every param must have reported one:
        a param that never did would leave its group waiting forever, so it is named here.
        """
        first = [g for g in self.all_bucket_groups if g.is_first_batch]
        if any(g.per_param_grad_ready_counts for g in first):
            missing = sorted(name for g in first for name in g.params_without_grad())
            if missing:
                raise RuntimeError(
                    f"{len(missing)} params got no grad in the first iteration: {', '.join(missing)}. Every "
                    "param must receive a grad in every iteration: freeze params that are never used "
                    "(requires_grad=False) or declare them unused to the wrapper."
                )
        for group in self.all_bucket_groups:
            group.drain_in_flight()
        for buffer in self.all_buffers:
            buffer.reset()
        for group in self.all_bucket_groups:
            group.reset()
        telemetry.next_step()

    def pending_grads(self) -> dict[str, str]:
        """What each bucket group whose reduction has not started still waits for (for the watchdog)."""
        pending = {}
        for group in self.all_bucket_groups:
            if group.grad_reduce_dispatched:
                continue
            if not group.ddp_config.overlap_grad_reduce:
                pending[group.label] = (
                    "reduction not started (without overlap_grad_reduce, finish_grad_sync starts it)"
                )
                continue
            missing = group.params_without_grad()
            pending[group.label] = (
                f"no grad yet for {watchdog.missing_names(missing)}"
                if missing
                else "every grad arrived, reduction not started"
            )
        return pending

    def start_grad_sync(self, force_all_reduce: bool = False) -> None:
        for group in self.all_bucket_groups:
            group.start_grad_sync(force_all_reduce)

    def finish_grad_sync(self, force_all_reduce: bool = False) -> None:
        for group in self.all_bucket_groups:
            group.finish_grad_sync(force_all_reduce)

    def start_param_sync(self, force_sync: bool = False) -> None:
        for group in self.all_bucket_groups:
            group.start_param_sync(force_sync)

    def scale_gradients(self, scaling_factor: float | torch.Tensor) -> None:
        for buffer in self.all_buffers:
            buffer.scale_gradients(scaling_factor)


def _require(pgs: ProcessGroupCollection, *names: str) -> dist.ProcessGroup:
    for name in names:
        group = getattr(pgs, name)
        if group is not None:
            return group  # type: ignore[no-any-return]
    raise ValueError(f"pg_collection needs one of {', '.join(names)} (set it to the matching process group)")


def _check_layout_matches(
    layout: FullParamLayout[int] | FullParamLayout[torch.Tensor],
    grouping: dict[BufferKey, list[int]],
    named: Sequence[tuple[str, Parameter]],
    specs: Sequence[ParamSpec],
) -> None:
    """A precomputed layout must cover the same buffers and params, in the same order, as the grouping:
    keyed by param (Megatron-Core's form), the very params the wrapper groups, in layout order (reverse
    registration order); keyed by position, the same positions; each with room for exactly its param's
    elements."""
    if set(layout.layouts) != set(grouping):
        raise ValueError(
            f"Buffer keys from param grouping {sorted(map(str, grouping))} do not match full_param_layout "
            f"keys {sorted(map(str, layout.layouts))}: compute the layout over the module's trainable params "
            "with the same grad_reduce_in_fp32"
        )
    for key, members in grouping.items():
        given = layout.layouts[key]
        params = [named[i][1] for i in members]
        if given.is_positional():
            same_params = layout.members.get(key, members) == members
        else:  # the same params (Megatron's check), each in its place: the layout runs last param first
            same_params = [id(p) for p in given.param_index_map] == [id(p) for p in reversed(params)]
        slots = given.by_position(params).param_index_map if same_params else {}
        sizes = [slots[j][1] - slots[j][0] if j in slots else -1 for j in range(len(members))]
        if not same_params or sizes != [specs[i].numel for i in members]:
            expected = [named[i][0] for i in members]
            raise ValueError(
                f"Params for {key} do not match between grouping and layout: the wrapper groups {expected}; "
                "compute the layout over the wrapped module's own trainable params in named_parameters() "
                "order"
            )
        if layout.layouts[key].param_indices not in ([], list(range(len(members)))):
            raise ValueError(f"param_indices for {key} do not match between grouping and layout")


def build_grad_buffers(
    named_params: Sequence[tuple[str, Parameter]],
    ddp_config: DistributedDataParallelConfig,
    pg_collection: ProcessGroupCollection,
    *,
    calculate_per_token_loss: bool = False,
    single_bucket: bool = False,
    disable_bucketing: bool = False,
    device: torch.device | None = None,
    full_param_layout: FullParamLayout[int] | FullParamLayout[torch.Tensor] | None = None,
) -> GradBuffers:
    """Buffers and bucket groups for the trainable params of ``named_params`` (registration order).

    ``single_bucket`` forces one bucket per buffer (pipeline ranks > 0); ``disable_bucketing`` also puts
    every bucket into one group.
    """
    named = [(name, p) for name, p in named_params if p.requires_grad]
    specs = [ParamSpec.of(p) for _, p in named]
    has_experts = any(s.is_expert_parallel for s in specs)
    dp_cp = _require(pg_collection, "dp_cp", "dp")
    dp = _require(pg_collection, "dp", "dp_cp")
    inter = None
    if ddp_config.num_distributed_optimizer_instances > 1:
        # Several optimizer instances: the intra-instance groups differ from dp_cp / expt_dp, so no fallback.
        inter = _require(pg_collection, "inter_dist_opt")
        dense_group = _require(pg_collection, "intra_dp_cp")
        expert_group = _require(pg_collection, "intra_expt_dp") if has_experts else None
    else:
        dense_group = _require(pg_collection, "intra_dp_cp", "dp_cp", "dp")
        expert_group = _require(pg_collection, "intra_expt_dp", "expt_dp") if has_experts else None
    expert_dp_size = _require(pg_collection, "expt_dp").size() if has_experts else 1
    bucket_size = effective_bucket_size(
        ddp_config,
        dp.size(),
        total_params=sum(s.numel for s in specs),
        single_bucket=single_bucket or disable_bucketing,
    )
    dense_factor, expert_factor = gradient_scaling_factors(
        ddp_config,
        calculate_per_token_loss=calculate_per_token_loss,
        data_parallel_cp_size=dp_cp.size(),
        expert_data_parallel_size=expert_dp_size,
    )
    dense: list[ParamAndGradBuffer] = []
    expert: list[ParamAndGradBuffer] = []
    grouping = group_specs_for_buffers(specs, ddp_config.grad_reduce_in_fp32)
    if full_param_layout is not None:
        _check_layout_matches(full_param_layout, grouping, named, specs)
    for key, members in grouping.items():
        buffer = ParamAndGradBuffer(
            ddp_config,
            key.param_dtype,
            key.grad_dtype,
            [(named[i][1], named[i][0]) for i in members],
            expert_group if key.is_expert_parallel and expert_group is not None else dense_group,
            bucket_size,
            expert_factor if key.is_expert_parallel else dense_factor,
            param_layout=full_param_layout.layouts[key] if full_param_layout is not None else None,
            device=device,
        )
        (expert if key.is_expert_parallel else dense).append(buffer)
    fp32_accumulation = ddp_config.reduce_scatter_with_fp32_accumulation
    return GradBuffers(
        buffers=dense,
        expert_parallel_buffers=expert,
        bucket_groups=partition_buckets(
            dense, disable_bucketing, fp32_accumulation, inter_distributed_optimizer_instance_group=inter
        ),
        expert_parallel_bucket_groups=partition_buckets(
            expert, disable_bucketing, fp32_accumulation, inter_distributed_optimizer_instance_group=inter
        ),
        bucket_size=bucket_size,
    )
