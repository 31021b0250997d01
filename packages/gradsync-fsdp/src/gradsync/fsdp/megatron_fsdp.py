"""MegatronFSDP: sharded data parallelism over flat, zero-copy param/grad buffers.

Deliberate differences from Megatron-FSDP v1 (all in docs/megatron-migration.md): the caller's config is never
mutated; gradients are never silently left unreduced (``is_last_microbatch`` defaults to True and
``finish_grad_sync`` reduces whatever a cycle left pending) nor double counted (accumulating without
``no_sync()`` reduces again and sums); ``parameters()`` always yields the optimizer's DTensor params;
ZeRO-1/2 replicas are refreshed after every ``install_optimized_model_weights`` (and the first forward
after a torch optimizer stepped the model's params installs the weights itself if nobody did:
:mod:`gradsync.fsdp.step_tracking`); ``sync()``/``no_sync()`` restore the previous value; ZeRO-3 releases
non-unit buckets after every backward.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import weakref
from collections.abc import Iterator, Sequence
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.hooks import RemovableHandle

from gradsync.buffers import (
    DistributedDataParallelConfig,
    as_ddp_config,
    broadcast_from_first_rank,
    check_params_match_across_ranks,
    effective_bucket_size,
    gradient_scaling_factors,
    is_expert_parallel,
    settings_of,
    telemetry,
)
from gradsync.buffers.comm_hook import CommHook, RegisteredHook, check_hook
from gradsync.buffers.grad_checks import LocalGradNorms, non_finite_ranks
from gradsync.buffers.low_precision_reduce import GradCommWire
from gradsync.buffers.shard_alignment import ShardAlignmentSpec, ShardBalance, set_shard_alignments
from gradsync.buffers.step_ballot import StepBallot, unfinished_step
from gradsync.buffers.torch_internals import local_tensor
from gradsync.buffers.wire_format import WireFormat
from gradsync.buffers.wrapper_claims import (
    claim,
    first_owned_elsewhere,
    guard_optimizer_steps,
    refuse_owned_elsewhere,
    refuse_unfrozen,
    skipped_backward,
)
from gradsync.groups import FSDPDistributedIndex
from gradsync.groups.torch_internals import queue_backward_end_callback

from .allocator_choice import choose_allocators
from .allocators import AllocatorStats, DoubleBufferAllocator
from .bucket import BucketStatus, FlatParamBucket, GradReduction, PrefetchOrder, bucket_layout
from .checkpoint import param_keys, param_loader
from .coalesce import ReductionGroup, grad_storage, plan_reduction_groups
from .communication_unit import communication_unit_size, prefetch_size
from .dcp import FIRST_ROW, describe_shard
from .device_choice import choose_device
from .hooks import (
    TrainingState,
    attach_post_backward,
    get_state,
    on_first_output_grad,
    outside_compile,
    set_state,
    weak_method,
)
from .hsdp import optimizer_placements, outer_replication
from .labels import labelled
from .lanes import gather_group
from .local_step import adopt_hand_built_optimizers, watch_state_splits
from .meta_init import ParamInitFn, materialize, replace_meta_params
from .mixed_precision import MixedPrecisionPolicy, policy_from_config
from .optimizer_params import OptimizerGrads, build_optimizer_params
from .param_order import balance_param_order
from .registration import ParamRegistry
from .schedule import GatherSchedule, ReduceSchedule
from .step_tracking import OWNER, StepMarks, watch_optimizer_steps
from .strategy import parse_strategy
from .support import (
    refuse_contradicting_keywords,
    refuse_packed_gathers_where_nothing_is_gathered,
    refuse_two_grad_wires,
    refuse_unsupported,
)
from .torch_internals import detach_for_saving
from .units import UnitEntry, find_units, group_into_buckets, resolve_unit_classes


def default_fsdp_config() -> DistributedDataParallelConfig:
    """ZeRO-3 with overlapped gathers and reductions, as Megatron-FSDP defaults to."""
    return DistributedDataParallelConfig(
        use_megatron_fsdp=True,
        data_parallel_sharding_strategy="optim_grads_params",
        overlap_grad_reduce=True,
        overlap_param_gather=True,
    )


class MegatronFSDP(nn.Module):
    """Fully sharded data parallelism for ``module`` over ``dist_index``'s shard group.

    ``parameters()`` / ``named_parameters()`` yield the optimizer's params: dim-0 DTensor shards (uneven,
    possibly empty) of the main weights, ``Replicate`` for ``no_shard``. Build the optimizer on them; call
    ``finish_grad_sync()`` before ``optimizer.step()`` and ``install_optimized_model_weights()`` after it.
    The uneven shards are :class:`~gradsync.fsdp.ragged.RaggedDTensor` s, so torch's own ``full_tensor()`` /
    ``redistribute()`` and DCP take their true split (HFSDP's from torch 2.7 on), as do Megatron-FSDP's
    helpers in :mod:`gradsync.fsdp.uneven_dtensor` and ``full_state_dict()``.
    """

    def __init__(
        self,
        module: nn.Module,
        dist_index: FSDPDistributedIndex,
        ddp_config: DistributedDataParallelConfig | None = None,
        mixed_precision_policy: MixedPrecisionPolicy | None = None,
        fsdp_unit_modules: Sequence[UnitEntry] | None = None,
        disable_bucketing: bool = False,
        device: torch.device | None = None,
        calculate_per_token_loss: bool = False,
        init_model_with_meta_device: bool = False,
        sync_model_each_microbatch: bool = False,
        keep_fp8_transpose_cache: bool = False,
        nccl_ub: bool = False,
        fsdp_double_buffer: bool = False,
        fsdp_db_use_persist_buf_on_alloc_fail: bool = False,
        disable_symmetric_registration: bool = False,
        enable_fine_grained_param_gather_hook: bool = False,
        enable_fine_grained_param_gather_backward_hook: bool = False,
        fine_grained_recurse_module_types: tuple[type[nn.Module], ...] | None = None,
        report_nan_in_param_grad: bool = False,
        *,
        param_init_fn: ParamInitFn | None = None,
        shard_alignment: ShardAlignmentSpec = None,
        gather_lane: bool = True,
        init_sync: bool = True,
    ) -> None:
        """Arguments in Megatron-FSDP's order, with its defaults. ``mixed_precision_policy`` None: the
        one ``ddp_config`` describes. ``init_model_with_meta_device``: ``module`` was built on the meta
        device; it is materialised module by module into the shards (:mod:`gradsync.fsdp.meta_init`), by
        ``param_init_fn(module)`` (gradsync's addition) or each module's ``reset_parameters()``.
        ``report_nan_in_param_grad`` checks every param's grad as it arrives (a host sync per param: for
        debugging) and names the params in the NaN check, which records each bucket's local grad norm on
        the device before its reduction and reads every rank's once per cycle, at ``finish_grad_sync``.
        The fine-grained gather hooks are not built (``NotImplementedError`` when asked for).
        ``shard_alignment`` (gradsync's addition): where shards may cut each param, one policy or per
        param name (:mod:`gradsync.buffers.shard_alignment`): ``row`` (default), ``tensor`` (whole on one
        rank, as Muon needs) or ``block:k`` / ``block:RxC``. ``gather_lane`` (gradsync's addition): param
        all-gathers run on a group of their own over the shard group's ranks, so they never queue behind
        grad reductions (:mod:`gradsync.fsdp.lanes`); False keeps them on the shard group.

        Before any other collective (the gather lane's group included), one collective checks that every
        data-parallel rank wraps the same params with the same config, strategy, units, mixed precision
        and arguments; a difference raises on every rank, naming it. ``init_sync`` (gradsync's addition,
        as torch's DDP): every replica starts from the first data-parallel rank's weights, broadcast
        before sharding (expert params excepted); False keeps the reference's behaviour (call
        :meth:`broadcast_params` yourself). A meta-device model is materialised by each rank from the seed
        it is given, into the rows it keeps: ZeRO-3 keeps each row on one rank, so its ranks hold one model
        whatever their seeds, but no_shard, ZeRO-1/2's compute weights and HSDP's outer replicas keep
        copies, which would start (no_shard and HSDP: stay) apart; there :meth:`broadcast_params` then
        gives every rank the first data-parallel rank's model, as the broadcast above does."""
        super().__init__()
        if enable_fine_grained_param_gather_hook or enable_fine_grained_param_gather_backward_hook:
            raise NotImplementedError(
                "MegatronFSDP: enable_fine_grained_param_gather_hook / _backward_hook (per-submodule "
                "gathers) are not implemented by gradsync-fsdp; leave them False (units gather whole)"
            )
        del fine_grained_recurse_module_types  # only read by the fine-grained hooks
        if ddp_config is None:
            ddp_config = dataclasses.replace(
                default_fsdp_config(),
                nccl_ub=nccl_ub,
                fsdp_double_buffer=fsdp_double_buffer or nccl_ub,
                fsdp_db_use_persist_buf_on_alloc_fail=fsdp_db_use_persist_buf_on_alloc_fail,
                keep_fp8_transpose_cache=keep_fp8_transpose_cache,
                disable_symmetric_registration=disable_symmetric_registration,
            )
        else:
            ddp_config = as_ddp_config(ddp_config)  # Megatron-Core's own config objects too
            keywords = {
                "nccl_ub": nccl_ub,
                "fsdp_double_buffer": fsdp_double_buffer,
                "fsdp_db_use_persist_buf_on_alloc_fail": fsdp_db_use_persist_buf_on_alloc_fail,
                "keep_fp8_transpose_cache": keep_fp8_transpose_cache,
                "disable_symmetric_registration": disable_symmetric_registration,
            }
            refuse_contradicting_keywords(ddp_config, keywords)
        self.ddp_config = ddp_config
        self.sharding = parse_strategy(ddp_config.data_parallel_sharding_strategy)
        self.data_parallel_sharding_strategy = self.sharding.name
        self.dist_index = dist_index
        self.mp_policy = policy_from_config(ddp_config, mixed_precision_policy)
        self.device = _resolve_device(device, module, dist_index, init_model_with_meta_device)
        refuse_unsupported(ddp_config, dist_index, self.device)
        refuse_two_grad_wires(ddp_config, self.mp_policy)
        refuse_packed_gathers_where_nothing_is_gathered(ddp_config)
        self.outer = outer_replication(ddp_config, dist_index, self.sharding)
        meta = replace_meta_params(module, self.device) if init_model_with_meta_device else None
        unset = meta.placeholders if meta is not None else set()
        # Looked for before the move: module.to() swaps a live wrapper's DTensor params for unmarked
        # copies. A module held elsewhere is not moved; it is refused below, once every rank agrees.
        owned_elsewhere = first_owned_elsewhere(list(module.named_parameters()), self)
        if device is not None and owned_elsewhere is None:
            module.to(device)
        self.module = module
        self.calculate_per_token_loss = calculate_per_token_loss
        self.report_nan_in_param_grad = report_nan_in_param_grad

        group = dist_index.get_fsdp_group()
        named = list(module.named_parameters())
        set_shard_alignments(named, shard_alignment)
        self.fsdp_unit_modules = resolve_unit_classes(fsdp_unit_modules)
        settings = settings_of(
            ddp_config,
            mixed_precision_policy=self.mp_policy,
            fsdp_unit_modules=self.fsdp_unit_modules,
            disable_bucketing=disable_bucketing,
            device_type=self.device.type,
            calculate_per_token_loss=calculate_per_token_loss,
            init_model_with_meta_device=init_model_with_meta_device,
            sync_model_each_microbatch=sync_model_each_microbatch,
            report_nan_in_param_grad=report_nan_in_param_grad,
            shard_alignment=shard_alignment,
            gather_lane=gather_lane,
            init_sync=init_sync,
            params_owned_by_another_wrapper=owned_elsewhere,
        )
        check_params_match_across_ranks(
            named, dist_index.get_dp_group(), who="MegatronFSDP", settings=settings
        )
        refuse_owned_elsewhere(owned_elsewhere, "MegatronFSDP")
        if init_sync and meta is None:
            dense = [p.data for p in module.parameters() if not is_expert_parallel(p)]
            broadcast_from_first_rank(dense, dist_index.get_dp_group())
        self.gather_group = gather_group(dist_index, gather_lane and self.sharding.shard_main)
        self.units = find_units(module, self.fsdp_unit_modules)
        bucket_size = None if disable_bucketing else ddp_config.bucket_size
        specs = group_into_buckets(module, self.units, bucket_size)
        layouts = balance_param_order(
            specs, lambda spec: bucket_layout(spec, self.sharding, group, self.outer)
        )
        comm_groups = [group] if self.gather_group is group else [group, self.gather_group]
        self.allocators, self.nccl_ub_pool = choose_allocators(
            ddp_config, specs, layouts, self.mp_policy, comm_groups, self.device
        )
        reduction_groups = plan_reduction_groups(
            specs,
            layouts,
            self.sharding,
            self.mp_policy,
            hsdp=self.outer is not None,
            pooled_grads=isinstance(self.allocators.grads, DoubleBufferAllocator),
            bucket_size=effective_bucket_size(
                ddp_config,
                group.size(),
                total_params=sum(layout.size for layout in layouts),
                single_bucket=disable_bucketing,
            ),
        )
        group_grads, grad_slices = grad_storage(
            reduction_groups, layouts, specs, self.sharding, self.mp_policy, self.device
        )
        grad_comm = GradCommWire.from_config(ddp_config)
        gather_wire = (
            WireFormat(ddp_config.param_gather_dtype, ddp_config.param_gather_block_size)
            if ddp_config.param_gather_dtype is not None
            else None
        )
        self.buckets = [
            FlatParamBucket(
                i,
                spec,
                self.sharding,
                self.mp_policy,
                group,
                self.device,
                self.allocators,
                self.outer,
                unset,
                gather_group=self.gather_group,
                grad_storage=grad_slices.get(i),
                grad_comm=grad_comm,
                gather_wire=gather_wire,
            )
            for i, spec in enumerate(specs)
        ]
        for allocator in (self.allocators.weights, self.allocators.grads):
            allocator.forget_assignments()  # construction filled every bucket once; the forward assigns
        self._unit_buckets: list[list[FlatParamBucket]] = [[] for _ in self.units]
        self._non_unit_buckets: list[FlatParamBucket] = []
        for bucket in self.buckets:
            unit_id = bucket.spec.unit_id
            (self._unit_buckets[unit_id] if unit_id is not None else self._non_unit_buckets).append(bucket)

        self.param_to_name = {p: n for n, p in named}
        self._position: dict[torch.Tensor, tuple[FlatParamBucket, int]] = {
            p: (b, i) for b in self.buckets for i, p in enumerate(b.spec.params)
        }
        self.raw_param = dict(named)
        if meta is not None:
            materialize(module, meta, self._write_param, param_init_fn)
        shard_dim = dist_index.dp_shard_dim or ""
        dims = (dist_index.dp_outer_dim, shard_dim) if dist_index.dp_outer_dim else (shard_dim,)
        self._mesh = dist_index.get_submesh(dims)
        self._placements = optimizer_placements(self.sharding, self.outer)
        self._optimizer_params = [
            build_optimizer_params(b, self._mesh, self._placements) for b in self.buckets
        ]
        self._optimizer_grads = [
            OptimizerGrads(b, params) for b, params in zip(self.buckets, self._optimizer_params, strict=True)
        ]
        self.sharded_param_of = {
            raw: dist_p
            for b, params in zip(self.buckets, self._optimizer_params, strict=True)
            for raw, dist_p in zip(b.spec.params, params, strict=True)
        }
        for dist_p in self.sharded_param_of.values():
            setattr(dist_p, OWNER, self)
        claim([*(p for _, p in named), *self.sharded_param_of.values()], self)
        frozen = [(n, p) for n, p in named if not p.requires_grad]  # the module shows either param
        self._frozen_at_wrap = frozen + [
            (n, self.sharded_param_of[p]) for n, p in frozen if p in self.sharded_param_of
        ]
        self._grads_pending = False  # a backward ran since the last finish_grad_sync / zero_grad_buffer
        self._backward_this_cycle = True  # a backward ran since zero_grad_buffer (none called yet: unknown)
        guard_optimizer_steps()
        self.steps = StepMarks()
        watch_optimizer_steps()
        watch_state_splits()
        adopt_hand_built_optimizers()
        self._registry = ParamRegistry(module, self.sharded_param_of)
        self._probe = next(((n, self.sharded_param_of[p]) for n, p in named), None)  # _refuse_converted
        self._forwards_awaiting_backward = 0
        self._forward_unsynced = False  # a training forward ran since the last sync or zero_grad_buffer
        for meta_param, placeholder in (meta.params if meta is not None else {}).items():
            self.sharded_param_of[meta_param] = self.sharded_param_of[placeholder]  # fully_shard's optimizer
        dense_factor, _ = gradient_scaling_factors(  # the rule gradsync-ddp follows too
            ddp_config,
            calculate_per_token_loss=calculate_per_token_loss,
            data_parallel_cp_size=dist_index.get_dp_group().size(),
            expert_data_parallel_size=1,
        )
        self._reduction = GradReduction(dense_factor, ddp_config.average_in_collective)

        self.model_auto_sync = False
        self.set_model_auto_sync(sync_model_each_microbatch)
        self.is_last_microbatch = True
        self.microbatch_count = 0
        unit_sizes = [sum(b.layout.size for b in buckets) for buckets in self._unit_buckets]
        self.suggested_communication_unit_size = communication_unit_size(
            ddp_config, self.sharding.shard_params, unit_sizes
        )
        self._gathers = GatherSchedule(
            self._unit_buckets,
            self.allocators.weights,
            prefetch_size(ddp_config, self.sharding.shard_params, self.suggested_communication_unit_size),
            weights_stay_whole=not self.sharding.shard_params,
        )
        self._grad_norms = None  # the NaN check's local norms, read once per cycle at finish_grad_sync
        if ddp_config.check_for_nan_in_grad or report_nan_in_param_grad:
            self._grad_norms = LocalGradNorms(len(self.buckets), self.device)
        groups = [
            ReductionGroup([self.buckets[i] for i in members], grads)
            for members, grads in zip(reduction_groups, group_grads, strict=True)
        ]
        for coalesced in groups:
            coalesced.gathers_together()
        self._reductions = ReduceSchedule(
            self.buckets,
            groups,
            self.sharding,
            self.outer,
            self._reduction,
            overlap=ddp_config.overlap_grad_reduce,
            grad_norms=self._grad_norms,
            cycle_ends=self._cycle_ends,
            queue_capacity=self.suggested_communication_unit_size,
            steps=self.steps,
        )
        self._in_backward = False  # the root's pre-backward ran and its post-backward not (yet, or ever)
        self._ballot = StepBallot([self._all_dp_group()], "MegatronFSDP", ddp_config.check_abandoned_steps)
        self._grads_finished = False
        self.units_kept_after_forward: set[int] = set()  # ZeRO-3 units not released after their forward
        self._all_modules = list(module.modules())
        self._modules_of_unit = [list(unit.modules()) for unit in self.units]
        set_state(self._all_modules, TrainingState.IDLE)
        self._register_hooks()
        self._replace_param_with_distributed_if_needed()
        if meta is not None and init_sync and (not self.sharding.shard_params or self.outer is not None):
            self.broadcast_params()  # replicas materialised apart (see init_sync above)
        self._ballot.prepare()  # every check passed on every rank: no step has to build the vote groups

    @property
    def suggested_AG_prefetch_size(self) -> int:
        """Elements a prefetch may gather ahead (whole units, in order); 0 turns prefetch off."""
        return self._gathers.prefetch_size

    @suggested_AG_prefetch_size.setter
    def suggested_AG_prefetch_size(self, elements: int) -> None:
        self._gathers.prefetch_size = elements

    @property
    def suggested_RS_queue_capacity(self) -> int:
        """Elements of grad reductions in flight before the oldest is waited for (ZeRO-2/3, whose
        whole-bucket grads are temporary; no_shard and optim reduce persistent buffers, unbounded)."""
        return self._reductions.queue_capacity

    @suggested_RS_queue_capacity.setter
    def suggested_RS_queue_capacity(self, elements: int) -> None:
        self._reductions.queue_capacity = elements

    # --- the optimizer's params ---------------------------------------------------------------------
    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]:
        """The optimizer's DTensor params, named as in the wrapped module with a ``module.`` prefix."""
        for name, raw in self.raw_param.items():
            yield f"{prefix}{'.' if prefix else ''}module.{name}", self.sharded_param_of[raw]

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]
        """Buffers as usual, params as the optimizer's DTensor shards (``module.``-prefixed; tied aliases
        map to the same DTensor), described for ``torch.distributed.checkpoint``. Local: no collective
        runs, so any rank may call it alone."""
        destination: dict[str, Any] = super().state_dict(*args, **kwargs)
        keep_vars = kwargs.get("keep_vars", False)
        for key, param in param_keys(self.module, kwargs.get("prefix", "") + "module.").items():
            bucket, index = self._locate(param)
            dist_p = self.sharded_param_of[bucket.spec.params[index]]
            value = dist_p if keep_vars else detach_for_saving(dist_p)
            first_row = getattr(dist_p, FIRST_ROW, None)
            destination[key] = value if first_row is None else describe_shard(value, first_row)
        return destination

    def load_state_dict(  # type: ignore[override]
        self, state_dict: dict[str, Any], strict: bool = True, assign: bool = False
    ) -> Any:
        """Load params from DTensor shards of the same layout or from whole tensors (each rank copies the
        rows it owns), buffers as usual; then install the weights. No collective runs."""
        params = param_keys(self.module)
        copies = []
        for key, param in params.items():
            if key in state_dict:
                bucket, index = self._locate(param)
                target = self.sharded_param_of[bucket.spec.params[index]]
                copies.append(param_loader(key, bucket, index, target, state_dict[key]))
        for copy in copies:  # every param checked first: a refused state dict changes nothing
            copy()
        rest = {k: v for k, v in state_dict.items() if k not in params}
        result = super().load_state_dict(rest, strict=False, assign=assign)
        result.missing_keys[:] = [k for k in result.missing_keys if k not in params or k not in state_dict]
        if strict and (result.missing_keys or result.unexpected_keys):
            raise RuntimeError(
                f"MegatronFSDP.load_state_dict: missing keys {result.missing_keys}, unexpected keys "
                f"{result.unexpected_keys}"
            )
        self.install_optimized_model_weights()
        return result

    def full_state_dict(self, rank0_only: bool = True) -> dict[str, Any]:
        """Every param whole, as plain CPU tensors keyed like the wrapped module's own state dict (tied
        aliases included), for inference or export. A collective: every rank of the shard group calls it;
        with ``rank0_only`` only the group's rank 0 gets the tensors, the others an empty dict."""
        self._install_if_stepped()
        keep = not rank0_only or self.dist_index.get_dp_group().rank() == 0
        with self._registry.compute_shown():
            state = self.module.state_dict(keep_vars=True)
        names_of: dict[torch.Tensor, list[str]] = {}
        copied: dict[str, Any] = {}
        for name, value in state.items():
            if isinstance(value, torch.Tensor):
                names_of.setdefault(value, []).append(name)
            else:  # extra state (Megatron's layers give None): kept as it is
                copied[name] = value
        for bucket in self.buckets:  # one bucket whole at a time, as double buffers require
            bucket.wait_exact_gather()
            for param in bucket.spec.params:
                for name in names_of.pop(param, []) if keep else []:
                    copied[name] = param.detach().cpu().clone()
            if self.sharding.shard_params:
                bucket.release()
        if not keep:
            return {}
        for tensor, names in names_of.items():  # buffers
            copied.update({name: tensor.detach().cpu().clone() for name in names})
        return {name: copied[name] for name in state}

    def pending_grads(self) -> dict[str, str]:
        """Buckets still waiting for grads in this backward, by param name (for the hang watchdog)."""
        return self._reductions.missing_grads(self._in_backward)

    def communicated_bytes(self) -> int:
        """Bytes this rank handed to gathers and grad reductions since the last ``zero_grad_buffer``."""
        return sum(bucket.stats.total_bytes for bucket in self.buckets)

    def memory_stats(self) -> dict[str, AllocatorStats]:
        """Allocations and live / peak bytes of every temporary-buffer allocator, keyed
        ``weights:<kind>`` / ``grads:<kind>`` (a double buffer lists its fallback too)."""
        return {
            f"{what}:{kind}": stats
            for what, allocator in (("weights", self.allocators.weights), ("grads", self.allocators.grads))
            for kind, stats in allocator.all_stats().items()
        }

    def shard_balance(self) -> ShardBalance:
        """What the shard-alignment policies cost over every bucket: padding elements, and the param
        elements each shard of the layout holds (``imbalance``: the largest over the mean)."""
        balances = [bucket.layout.balance() for bucket in self.buckets]
        return sum(balances[1:], balances[0])

    def get_distributed_index(self) -> FSDPDistributedIndex:
        return self.dist_index

    # --- forward -----------------------------------------------------------------------------------
    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        return self.module(*inputs, **kwargs)  # the root hooks install, show the compute params, gather

    def _apply(self, *args: Any, **kwargs: Any) -> NoReturn:
        """Refused (``to()``, ``cuda()``, ``float()``, ``to_empty()``, ... all come here): torch would put
        a copy in place of each param, which the wrapper never reads or steps."""
        raise NotImplementedError(
            "MegatronFSDP: moving or casting the model (to(), cuda(), cpu(), float(), half(), to_empty(), "
            "...) after wrapping is not supported: its params are views of the wrapper's flat buffers, and "
            "torch would put copies the wrapper never reads or steps in their place (a move to the device "
            "they are on still strips the wrapper's marks from them). Move or cast the module before "
            "wrapping, or pass device= (for dtypes, mixed_precision_policy)"
        )

    def _refuse_converted(self) -> None:
        """Raise when a move or cast of the wrapped module itself (``module.to()``, ...) swapped the
        optimizer's params it holds between steps for copies: those lose the marks that step tracking and
        the step guard read, and a move to another device leaves the optimizer stepping copies. One param
        is looked at per forward, so a conversion of a submodule that does not hold it goes unseen, and so
        does one during a step (the module then holds the compute params, which keep their marks)."""
        if self._probe is not None and getattr(self._probe[1], OWNER, None) is not self:
            raise RuntimeError(
                f"MegatronFSDP: param {self._probe[0]} of the wrapped module is a copy the wrapper does not "
                "hold: the module was moved or cast after wrapping (module.to(), cuda(), float(), "
                "to_empty(), ...), which swaps each param for one the wrapper never reads or steps. Move "
                "or cast the module before wrapping (device=, mixed_precision_policy), and wrap it again"
            )

    def _replace_param_with_raw_if_needed(self) -> None:
        """The wrapped modules hold the compute params (from the root forward to the end of backward)."""
        self._registry.show_compute()

    def _replace_param_with_distributed_if_needed(self) -> None:
        """The wrapped modules hold the optimizer's DTensor params, as a parent module or
        ``torch.compile``'s wrapper then sees them (:mod:`gradsync.fsdp.registration`)."""
        self._registry.show_optimizer()

    def _register_hooks(self) -> None:
        """Module hooks live in the modules' hook dicts, which the garbage collector sees, so the cycle
        wrapper -> module -> hook -> wrapper is collected once nothing else holds either. A param's hooks
        are invisible to it: those hold the wrapper weakly (:func:`~gradsync.fsdp.hooks.weak_method`) and
        are removed, with the params' ``main_grad`` views, when the wrapper goes."""
        self.module.register_forward_pre_hook(outside_compile(self._root_pre_forward), prepend=True)
        self.module.register_forward_hook(outside_compile(self._root_post_forward))
        for unit_id, unit in enumerate(self.units):
            unit.register_forward_pre_hook(
                outside_compile(functools.partial(self._unit_pre_forward, unit_id)),
                prepend=True,
                with_kwargs=True,
            )
            unit.register_forward_hook(outside_compile(functools.partial(self._unit_post_forward, unit_id)))
        grad_hooks = [
            param.register_post_accumulate_grad_hook(  # type: ignore[no-untyped-call]
                weak_method(self, "_on_grad", name, *self._position[param])
            )
            for param, name in self.param_to_name.items()
            if param.requires_grad
        ]
        weakref.finalize(self, _detach_from_params, grad_hooks, list(self.param_to_name))

    @labelled("root_pre_forward")
    def _root_pre_forward(self, module: nn.Module, args: Any) -> None:
        self._refuse_converted()  # every rank converted alike: each raises before any collective
        if self.training and torch.is_grad_enabled():  # noted first: a forward that raises counts too
            self._forward_unsynced = True
        self._install_if_stepped()
        self._replace_param_with_raw_if_needed()
        self._gather_for_forward()

    def _gather_for_forward(self) -> None:
        """The forward's first gathers: the buckets outside every unit, and the first units' prefetch."""
        if self.sharding.name == "no_shard":
            return
        for bucket in self._non_unit_buckets:
            bucket.launch_gather()
        self._gathers.prefetch(0 if self.units else None)
        for bucket in self._non_unit_buckets:
            bucket.wait_gather()

    def _root_post_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        if torch.is_grad_enabled():
            self._forwards_awaiting_backward += 1
            on_first_output_grad(output, self._root_pre_backward)
            return
        if self.sharding.shard_params:  # no backward follows: drop what the forward gathered
            for bucket in self.buckets:
                bucket.release()
        if not self._forwards_awaiting_backward:
            self._replace_param_with_distributed_if_needed()

    @labelled("pre_forward")
    def _unit_pre_forward(
        self, unit_id: int, unit: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        recomputing = get_state(unit) is TrainingState.PRE_BACKWARD
        if not recomputing:
            set_state(self._modules_of_unit[unit_id], TrainingState.FORWARD)
        if self.sharding.shard_main:  # no_shard's compute weights are never stale
            self._gathers.gather_unit(unit_id, prefetch=None if recomputing else unit_id + 1)
        if self.sharding.shard_params:
            return attach_post_backward(args, kwargs, functools.partial(self._unit_post_backward, unit_id))
        return None

    @labelled("post_forward")
    def _unit_post_forward(self, unit_id: int, unit: nn.Module, args: Any, output: Any) -> None:
        """ZeRO-3 releases the unit, except during recomputation (its backward follows at once) and, when
        a backward will follow, for the last unit (backward starts with it) and ``units_kept_after_forward``
        (FSDP2's ``reshard_after_forward=False``: no gather in the backward)."""
        if get_state(unit) is not TrainingState.PRE_BACKWARD:  # not recomputing
            self._release_after_forward(unit_id, backward_follows=torch.is_grad_enabled())
        if self.sharding.shard_params:  # weights kept whole since the forward need nothing before backward
            on_first_output_grad(output, functools.partial(self._unit_pre_backward, unit_id))

    def _release_after_forward(self, unit_id: int, backward_follows: bool) -> None:
        kept = unit_id == len(self.units) - 1 or unit_id in self.units_kept_after_forward
        if self.sharding.shard_params and not (kept and backward_follows):
            for bucket in self._unit_buckets[unit_id]:
                bucket.release()

    # --- backward ----------------------------------------------------------------------------------
    @labelled("root_pre_backward")
    def _root_pre_backward(self) -> None:
        if self._in_backward:
            return
        self._in_backward = True
        self._grads_finished = False
        self._grads_pending = self._backward_this_cycle = True
        set_state(self._all_modules, TrainingState.PRE_BACKWARD)
        self._gather_root_buckets()
        queue_backward_end_callback(self._root_post_backward)

    def _gather_root_buckets(self) -> None:
        """ZeRO-3: the buckets outside every unit, at the backward's start (an earlier microbatch's
        backward may have released them)."""
        if self.sharding.shard_params:
            for bucket in self._non_unit_buckets:
                bucket.launch_gather()
            for bucket in self._non_unit_buckets:
                bucket.wait_gather()

    @labelled("pre_backward")
    def _unit_pre_backward(self, unit_id: int) -> None:
        """ZeRO-3: gather the unit (its backward is next) and prefetch the ones before it."""
        set_state(self._modules_of_unit[unit_id], TrainingState.PRE_BACKWARD)
        self._gathers.gather_unit(unit_id, prefetch=unit_id - 1)

    @labelled("post_backward")
    def _unit_post_backward(self, unit_id: int) -> None:
        set_state(self._modules_of_unit[unit_id], TrainingState.POST_BACKWARD)
        for bucket in self._unit_buckets[unit_id]:
            bucket.release()

    def _on_grad(self, name: str, bucket: FlatParamBucket, index: int, param: torch.Tensor) -> None:
        """``param``'s grad of this backward is complete: move it into its bucket (item ``index``)."""
        grad = param.grad
        if grad is None:
            return
        if self.report_nan_in_param_grad and not bool(torch.isfinite(grad).all()):
            bucket.non_finite_params.append(name)
        self._reductions.add_grad(bucket, index, grad)
        param.grad = None

    def _locate(self, param: torch.Tensor) -> tuple[FlatParamBucket, int]:
        """The bucket and index of a compute param, or of its optimizer DTensor."""
        return self._position[self._registry.compute_param(param)]

    def _write_param(self, param: nn.Parameter, value: torch.Tensor) -> None:
        bucket, index = self._position[param]
        bucket.write_param(index, value)

    def _cycle_ends(self) -> bool:
        """Whether this backward is the cycle's last: the once-per-cycle reductions run in it."""
        return self.is_last_microbatch or self.model_auto_sync

    @labelled("root_post_backward")
    def _root_post_backward(self) -> None:
        self._end_backward()
        if self.model_auto_sync:
            self.finish_grad_sync()

    def _end_backward(self) -> None:
        """End of the backward: buckets some param of which got no grad on this rank complete, every
        reduction is waited (:meth:`ReduceSchedule.end_backward`), and ZeRO-3 drops every gathered
        weight."""
        self._reductions.end_backward()
        if self.sharding.shard_params:
            for bucket in self.buckets:
                bucket.release()
        set_state(self._all_modules, TrainingState.IDLE)
        self._in_backward = False
        self.microbatch_count += 1
        self._forwards_awaiting_backward = max(0, self._forwards_awaiting_backward - 1)
        if not self._forwards_awaiting_backward:  # no recomputation can need the compute params now
            self._replace_param_with_distributed_if_needed()

    # --- gathers -----------------------------------------------------------------------------------
    def all_gather_and_wait_parameters_ready(
        self,
        params: Sequence[nn.Parameter],
        prefetch: bool = True,
        prefetch_order: PrefetchOrder = PrefetchOrder.FORWARD_PASS_ORDER,
        wait_bucket_ready: bool = True,
    ) -> None:
        """Gather the compute weights of ``params`` (and, with ``prefetch``, the next unit in
        ``prefetch_order``), waiting for them when ``wait_bucket_ready``."""
        self._install_if_stepped()
        buckets = sorted({self._locate(p)[0].bucket_id for p in params})
        for bucket_id in buckets:
            self.buckets[bucket_id].launch_gather()
        if prefetch and buckets:
            unit_ids = [u for b in buckets if (u := self.buckets[b].spec.unit_id) is not None]
            if unit_ids:
                if prefetch_order is PrefetchOrder.FORWARD_PASS_ORDER:
                    self._gathers.prefetch(max(unit_ids) + 1, 1)
                else:
                    self._gathers.prefetch(min(unit_ids) - 1, -1)
        if wait_bucket_ready:
            for bucket_id in buckets:
                self.buckets[bucket_id].wait_gather()

    @labelled("start_param_sync")
    def start_param_sync(self, *unused: Any, force_sync: bool = False, force_dispatch: bool = False) -> None:
        """Start the gathers that bring the optimizer's update to every replica (ZeRO-1/2), or prefetch
        the first weights (ZeRO-3); wait for them when ``force_sync`` or ``overlap_param_gather`` is off.
        With overlap and ``fsdp_all_gather_in_start_param_sync=False`` it starts none: the forward
        gathers each bucket as it comes."""
        self._install_if_stepped()
        if self.sharding.name == "no_shard":
            return
        overlapped = self.ddp_config.overlap_param_gather and not force_sync
        if overlapped and not self.ddp_config.fsdp_all_gather_in_start_param_sync:
            return  # the forward gathers each bucket when it first needs it
        stale = [b for b in self.buckets if b.status is BucketStatus.EMPTY]
        if self.sharding.shard_params:  # the first weights only: the forward gathers each unit as it comes
            stale = self._non_unit_buckets + (self._unit_buckets[0] if self.units else [])
        for bucket in stale:
            bucket.launch_gather()
        if not overlapped:
            for bucket in stale:
                bucket.wait_gather()

    def synchronize_param_gather(self) -> None:
        """Finish every gather in flight; ZeRO-3 then drops all gathered weights. The modules hold the
        optimizer's params after it."""
        for bucket in self.buckets:
            if bucket.status is BucketStatus.COMMUNICATING:
                bucket.wait_gather()
            if self.sharding.shard_params:
                bucket.release()
        self._replace_param_with_distributed_if_needed()

    # --- the step ----------------------------------------------------------------------------------
    @labelled("start_grad_sync")
    def start_grad_sync(self, *unused: Any) -> None:
        """Reduce grads that wait for the end of the cycle (no_shard / optim, HSDP's outer stage)."""
        self._reductions.launch_deferred()

    def synchronize_gradient_reduce(self) -> None:
        """Launch pending reductions and wait for every reduction in flight."""
        self.start_grad_sync()
        self._reductions.wait_all()

    def attach_grad_to_optimizer_state(self) -> None:
        """Give the optimizer's params their reduced grads."""
        for bucket, grads, params in zip(
            self.buckets, self._optimizer_grads, self._optimizer_params, strict=True
        ):
            if bucket.spec.requires_grad:
                grads.attach(params)

    @labelled("finish_grad_sync")
    def finish_grad_sync(self, force_all_reduce: bool = False) -> None:
        """Every grad of the cycle reduced exactly once, then attached to the optimizer's params. Calling
        it again before the next backward changes nothing (finalize_model_grads may already have run
        reductions on the attached grads)."""
        if self._grads_finished:
            return
        self._forward_unsynced = False
        self._ballot.refuse_abandoned("finish_grad_sync()", self._in_backward, self._abandon)
        skipped = skipped_backward(self._backward_this_cycle, self._grad_buffers)
        if skipped is not None:
            self._abandon(skipped)
        counted = self._ballot.post()
        self.synchronize_gradient_reduce()
        self._refuse_non_finite_grads()
        counted()
        self.attach_grad_to_optimizer_state()
        self.microbatch_count = 0
        self._grads_finished = True
        self._grads_pending = False
        if not self._forwards_awaiting_backward:  # a later backward may still recompute (auto-sync)
            self._replace_param_with_distributed_if_needed()

    def _refuse_non_finite_grads(self) -> None:
        """Raise on every rank, naming the ranks (and, with ``report_nan_in_param_grad``, this rank's
        params), if any rank's local grads held NaN or Inf before a reduction of this cycle."""
        if self._grad_norms is None:
            return
        group = self._all_dp_group()
        bad = non_finite_ranks(self._grad_norms.gather(group, "fsdp.grad_norms"), group)
        params = {b.bucket_id: b.non_finite_params for b in self.buckets}
        for bucket in self.buckets:
            bucket.non_finite_params = []
        if bad:
            bucket_id, ranks = min(bad.items())
            names = ", ".join(self.buckets[bucket_id].spec.names)
            here = f"; on this rank in the grads of {params[bucket_id]}" if params[bucket_id] else ""
            raise RuntimeError(
                f"MegatronFSDP (check_for_nan_in_grad=True): NaN or Inf in the grads of bucket {bucket_id} "
                f"({names}) on rank(s) {ranks}, before the reduction{here}"
            )

    def _all_dp_group(self) -> dist.ProcessGroup:
        """Every data-parallel rank: the shard group, or HSDP's shard and outer groups together."""
        return self.outer.hybrid_group if self.outer is not None else self.dist_index.get_fsdp_group()

    def scale_gradients(self, scaling_factor: float | torch.Tensor) -> None:
        """Multiply every grad by ``scaling_factor``: the buffers, and attached grads that are copies."""
        buffers = set()
        for bucket in self.buckets:
            if bucket.grad is not None:
                bucket.grad.mul_(scaling_factor)
                buffers.add(bucket.grad.untyped_storage().data_ptr())
        for params in self._optimizer_params:
            for param in params:
                local = local_tensor(param.grad)
                if local is not None and local.untyped_storage().data_ptr() not in buffers:
                    local.mul_(scaling_factor)

    @labelled("zero_grad_buffer")
    def zero_grad_buffer(self) -> None:
        """Zero the grad buffers and drop the optimizer params' grads; call once per optimizer step. A
        backward that raised part-way abandons the step here (see :mod:`gradsync.buffers.step_ballot`)."""
        reason = unfinished_step(self._in_backward, self._forward_unsynced, self._backward_this_cycle)
        if reason is not None:
            self._abandon(reason)
        self._forward_unsynced = False
        self._reductions.new_cycle()
        self._forwards_awaiting_backward = 0  # the cycle is over (a training forward alone abandoned it)
        self._replace_param_with_distributed_if_needed()
        for bucket in self.buckets:
            bucket.zero_grad()
            bucket.non_finite_params = []
        for bucket in self.buckets:
            bucket.note_zeroed()
        if self._grad_norms is not None:
            self._grad_norms.reset()
        for params in self._optimizer_params:
            for param in params:
                param.grad = None
        self._grads_finished = False
        self._grads_pending = self._backward_this_cycle = self._ballot.abandoned = False
        self._ballot.others_abandoned = False
        for bucket in self.buckets:
            bucket.stats.reset()
        telemetry.next_step()

    def _grad_buffers(self) -> Iterator[torch.Tensor]:
        return (bucket.grad for bucket in self.buckets if bucket.grad is not None)

    @property
    def step_left_broken(self) -> bool:
        """Whether this rank's step went wrong in a way only the next ``zero_grad_buffer()`` settles: a
        backward that raised part-way, a training forward with no backward (both abandon the step
        there), or a step abandoned here or on another rank (the buffers hold its partial grads). Loops
        that call no ``zero_grad_buffer()`` (the FSDP2-style API) ask this at the next forward."""
        abandoned = self._ballot.abandoned or self._ballot.others_abandoned
        unfinished = unfinished_step(self._in_backward, self._forward_unsynced, self._backward_this_cycle)
        return abandoned or unfinished is not None

    def refuse_unsynced_step(self) -> None:
        """Raise before an optimizer step that would apply wrong grads (run by a global step pre-hook)."""
        self._ballot.refuse_abandoned(
            "an optimizer step",
            self._in_backward,
            self._abandon,
            forward_without_backward=self._forward_unsynced and not self._backward_this_cycle,
        )
        if self._grads_pending:  # every rank usually runs the same code: each raises, no collective waits
            raise RuntimeError(
                "MegatronFSDP: optimizer step after a backward whose grads were not synchronised; call "
                "model.finish_grad_sync() (finalize_model_grads does) between the last backward and the "
                "step: the optimizer's params hold no reduced grads of this backward"
            )
        refuse_unfrozen(self._frozen_at_wrap, "MegatronFSDP")

    def _abandon(self, reason: str) -> NoReturn:
        """Complete this step's collectives for the other ranks, then raise on every rank."""
        no_forward = not (self._in_backward or self._backward_this_cycle or self._forwards_awaiting_backward)
        self._grads_pending = self._forward_unsynced = False
        try:
            self._ballot.abandon(functools.partial(self._complete_step_collectives, no_forward), reason)
        finally:
            self._in_backward = False  # one vote per abandoned step, whatever the completion raised

    def _complete_step_collectives(self, no_forward: bool) -> None:
        """What the other ranks' forward, backward and ``finish_grad_sync()`` still communicate: a forward's
        gathers when this rank ran none (every unit in forward order, as the others' forward issues them),
        the rest of an abandoned backward (ZeRO-3 gathers each unit it did not reach, in backward order;
        every bucket's reduction in launch order), the reductions deferred to the cycle's end, the NaN
        check's gather."""
        if no_forward:
            self._install_if_stepped()
            self._gather_for_forward()
            for unit_id in range(len(self.units)) if self.sharding.shard_main else ():
                self._gathers.gather_unit(unit_id, prefetch=unit_id + 1)
                self._release_after_forward(unit_id, backward_follows=True)
        if self._in_backward or not self._backward_this_cycle:
            if not self._in_backward:
                self._gather_root_buckets()
            if self.sharding.shard_params:
                for unit_id in reversed(range(len(self.units))):
                    if get_state(self.units[unit_id]) is not TrainingState.POST_BACKWARD:
                        self._unit_pre_backward(unit_id)
                        self._unit_post_backward(unit_id)
            self._end_backward()
        self.synchronize_gradient_reduce()
        self._refuse_non_finite_grads()

    def _install_if_stepped(self) -> None:
        """Weights are read or gathered: bring an optimizer step in first (the flag is the same on every
        rank, so every rank installs)."""
        if self.steps.weights_uninstalled:
            self.install_optimized_model_weights()

    def install_optimized_model_weights(self) -> None:
        """Copy the optimizer's updated weights into the compute weights; ZeRO-1/2 replicas are gathered
        at the next forward, or now when ``overlap_param_gather`` is off."""
        for bucket in self.buckets:
            bucket.install_main_weights()
        self.steps.weights_uninstalled = False
        if not self.ddp_config.overlap_param_gather:
            self.start_param_sync(force_sync=True)

    def broadcast_params(self) -> None:
        """Make every rank's weights DP rank 0's: gather each bucket whole, broadcast it, re-shard. Under
        ZeRO-3 each rank kept only its shard of its own initial weights, so what is broadcast is the
        gathered model: build identical models (same seed) or load a state dict to start from one."""
        self._install_if_stepped()
        group = self.dist_index.get_dp_group()  # every replica, outer ones included
        src = dist.get_global_rank(group, 0)
        for bucket in self.buckets:
            bucket.wait_exact_gather()
            dist.broadcast(bucket.weight, src=src, group=group)
            bucket.reset_from_weights()
            if self.sharding.shard_params:
                bucket.release()

    # --- gradient accumulation -----------------------------------------------------------------------
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Defer the once-per-cycle reductions (no_shard / optim) to the last microbatch, run outside this
        context. ZeRO-2/3 still reduce-scatter every backward and accumulate in the shard."""
        previous, self.is_last_microbatch = self.is_last_microbatch, False
        try:
            yield
        finally:
            self.is_last_microbatch = previous

    @contextlib.contextmanager
    def sync(self) -> Iterator[None]:
        """Reduce and finish the grad sync at the end of every backward inside this context."""
        previous = self.model_auto_sync
        self.set_model_auto_sync(True)
        try:
            yield
        finally:
            self.set_model_auto_sync(previous)

    def register_comm_hook(self, state: object, hook: CommHook) -> None:
        """Reduce each bucket's grads with ``hook(state, bucket)``, torch DDP's protocol (gradsync's
        addition, as on gradsync-ddp's wrapper), so torch's own hooks run unchanged, PowerSGD among them.
        The hook averages the whole bucket over the data-parallel group; the sharded strategies keep
        their shard of it, so the wire carries what the hook sends (an all-reduce's traffic with torch's
        hooks) instead of a reduce-scatter. Register it once, before the first backward."""
        if self.ddp_config.grad_comm_dtype is not None:
            raise ValueError(
                "MegatronFSDP.register_comm_hook: grad_comm_dtype already sets how buckets are reduced; "
                "unset it, or keep it and register no hook"
            )
        if self.outer is not None:
            raise NotImplementedError(
                "MegatronFSDP.register_comm_hook: HSDP reduces in two stages over two groups, and a hook "
                "reduces over one; not supported with an outer data-parallel group"
            )
        check_hook("MegatronFSDP", state, hook, self.dist_index.get_fsdp_group())
        reducing = [bucket for bucket in self.buckets if bucket.grad is not None]
        if any(bucket.comm_hook is not None for bucket in reducing):
            raise RuntimeError("MegatronFSDP.register_comm_hook can only be called once")
        registered = RegisteredHook(state, hook, len(reducing))
        for index, bucket in enumerate(reversed(reducing)):  # numbered from the model's end, as DDP's
            bucket.comm_hook, bucket.hook_index = registered, index

    def mark_stepped(self) -> None:
        """An optimizer updated the params: the next forward (or weight read) installs the weights unless
        ``install_optimized_model_weights()`` runs first, and no grad may arrive before
        ``zero_grad_buffer()``. torch optimizers call it by themselves; call it after an update made any
        other way."""
        self.steps.mark()

    def set_model_auto_sync(self, sync_model: bool = True) -> None:
        """With auto-sync every backward reduces and ends with ``finish_grad_sync()``."""
        self.model_auto_sync = sync_model


def _detach_from_params(handles: list[RemovableHandle], params: list[nn.Parameter]) -> None:
    """The wrapper is gone: its params lose their grad hooks and their views into its grad buffers."""
    for handle in handles:
        handle.remove()
    for param in params:
        if hasattr(param, "main_grad"):
            del param.main_grad


def _resolve_device(
    device: torch.device | None, module: nn.Module, dist_index: FSDPDistributedIndex, meta_init: bool
) -> torch.device:
    """Where the buffers live: ``device``, else the params' device; a meta model goes to the mesh's
    device type (the current accelerator, or the CPU)."""
    on_meta = [name for name, p in module.named_parameters() if p.is_meta]
    if on_meta and not meta_init:
        raise ValueError(
            f"MegatronFSDP: {len(on_meta)} params are on the meta device (first {on_meta[0]!r}); pass "
            "init_model_with_meta_device=True to materialise them shard by shard, or build the model on "
            "a real device"
        )
    mesh_type = dist_index.device_mesh.device_type if on_meta else None
    return choose_device(device, module.parameters(), mesh_type) or torch.device("cpu")
