"""MegatronFSDP, and torch DDP's comm-hook protocol on its buckets.

torch DDP's comm-hook protocol on MegatronFSDP's buckets (gradsync's addition, as on gradsync-ddp's
wrapper), so torch's own hooks run unchanged, PowerSGD among them.

A hook averages a whole bucket over the data-parallel group; the sharded strategies keep their shard of
it, so the wire carries what the hook sends (an all-reduce's traffic with torch's hooks) instead of a
reduce-scatter.

MegatronFSDP: sharded data parallelism over flat, zero-copy param/grad buffers.

Deliberate differences from Megatron-FSDP v1 (all in docs/megatron-migration.md): the caller's config is never
mutated; gradients are never silently left unreduced (``is_last_microbatch`` defaults to True and
``finish_grad_sync`` reduces whatever a cycle left pending) nor double counted (accumulating without
``no_sync()`` reduces again and sums); ``parameters()`` always yields the optimizer's DTensor params;
ZeRO-1/2 replicas are refreshed after every ``install_optimized_model_weights`` (and the first forward
after a torch optimizer stepped the model's params installs the weights itself if nobody did:
:mod:`gradsync.fsdp.schedule`); ``sync()``/``no_sync()`` restore the previous value; ZeRO-3 releases
non-unit buckets after every backward.

The class is the module-facing API; each job behind it has a module of its own, built in this order:
:mod:`~gradsync.fsdp.preparation` settles and checks the inputs on every rank at once;
:mod:`~gradsync.fsdp.bucket_set` builds the buckets; :mod:`~gradsync.fsdp.assembly` builds the rest:
one :class:`~gradsync.fsdp.sharded_param.ShardedParam` per param, the schedules, the hooks
(:mod:`~gradsync.fsdp.training_hooks`), the weights' installs and gathers
(:mod:`~gradsync.fsdp.step_control`) and the cycle's end (:mod:`~gradsync.fsdp.step_control`). The
optimizer-facing half of the API is the base class, :mod:`~gradsync.fsdp.optimizer_facing`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gradsync.buffers import DistributedDataParallelConfig
from gradsync.buffers.comm_hook import CommHook, RegisteredHook, check_hook
from gradsync.buffers.shard_alignment import ShardAlignmentSpec, ShardBalance
from gradsync.groups import FSDPDistributedIndex

from .allocators import AllocatorStats
from .assembly import WrapperCalls, assemble
from .bucket import FlatParamBucket, PrefetchOrder
from .bucket_set import build_bucket_set
from .collectives import gather_group
from .hooks import labelled
from .layout import OuterReplication, UnitEntry, find_units
from .meta_init import ParamInitFn
from .optimizer_facing import OptimizerFacing
from .preparation import WrapArguments, prepare_wrap, refuse_fine_grained_gathers
from .settings import MixedPrecisionPolicy


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


class MegatronFSDP(OptimizerFacing):
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
        init_meta_values: bool = True,
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
        grad reductions (:mod:`gradsync.fsdp.collectives`); False keeps them on the shard group.

        Before any other collective (the gather lane's group included), one collective checks that every
        data-parallel rank wraps the same params with the same config, strategy, units, mixed precision
        and arguments; a difference raises on every rank, naming it. ``init_sync`` (gradsync's addition,
        as torch's DDP): every replica starts from the first data-parallel rank's weights, broadcast
        before sharding (expert params excepted); False keeps the reference's behaviour (call
        :meth:`broadcast_params` yourself). A meta-device model is materialised by each rank from the seed
        it is given, into the rows it keeps: ZeRO-3 keeps each row on one rank, so its ranks hold one model
        whatever their seeds, but no_shard, ZeRO-1/2's compute weights and HSDP's outer replicas keep
        copies, which would start (no_shard and HSDP: stay) apart; there :meth:`broadcast_params` then
        gives every rank the first data-parallel rank's model, as the broadcast above does.
        ``init_meta_values`` False (gradsync's addition, what the FSDP2-style ``fully_shard`` passes): a
        meta-device model's params get their storage in the shards but no values and nothing is
        broadcast; the caller writes every value through the DTensor params (torch FSDP2's ``to_empty()``
        then ``init_weights()``), and the first forward installs them."""
        super().__init__()
        refuse_fine_grained_gathers(
            enable_fine_grained_param_gather_hook, enable_fine_grained_param_gather_backward_hook
        )
        del fine_grained_recurse_module_types  # only read by the fine-grained hooks
        keywords = {
            "nccl_ub": nccl_ub,
            "fsdp_double_buffer": fsdp_double_buffer,
            "fsdp_db_use_persist_buf_on_alloc_fail": fsdp_db_use_persist_buf_on_alloc_fail,
            "keep_fp8_transpose_cache": keep_fp8_transpose_cache,
            "disable_symmetric_registration": disable_symmetric_registration,
        }
        arguments = WrapArguments(
            disable_bucketing, calculate_per_token_loss, init_model_with_meta_device,
            sync_model_each_microbatch, report_nan_in_param_grad, shard_alignment, gather_lane, init_sync,
        )  # fmt: skip
        prepared = prepare_wrap(
            self, module, dist_index, ddp_config, mixed_precision_policy, fsdp_unit_modules, device, keywords,
            arguments,
        )  # fmt: skip
        self.ddp_config = ddp_config = prepared.config
        self.sharding, self.data_parallel_sharding_strategy = prepared.sharding, prepared.sharding.name
        self.dist_index, self.mp_policy, self.device = dist_index, prepared.policy, prepared.device
        self.outer, self.module, self.fsdp_unit_modules = prepared.outer, module, prepared.unit_classes
        self.calculate_per_token_loss = calculate_per_token_loss
        self.report_nan_in_param_grad = report_nan_in_param_grad
        meta, named = prepared.meta, prepared.named
        self.gather_group = gather_group(dist_index, gather_lane and self.sharding.shard_main)
        self.units = find_units(module, self.fsdp_unit_modules)
        groups = (dist_index.get_fsdp_group(), self.gather_group)
        unset = meta.placeholders if meta is not None else set()
        buckets = build_bucket_set(
            module, self.units, ddp_config, self.sharding, self.mp_policy, groups, self.outer, self.device,
            unset, disable_bucketing=disable_bucketing,
        )  # fmt: skip
        self.buckets, self.allocators, self.nccl_ub_pool = (
            buckets.buckets,
            buckets.allocators,
            buckets.nccl_ub_pool,
        )
        if meta is not None and init_meta_values:
            buckets.materialize(module, meta, param_init_fn)
        calls = WrapperCalls(
            self._refuse_converted, self._backward_ended, self._cycle_ends, self.synchronize_gradient_reduce
        )
        parts = assemble(
            self, module, self.units, named, buckets, meta, (self.sharding, self.outer, dist_index),
            ddp_config, self.device, calls, calculate_per_token_loss=calculate_per_token_loss,
            report_nan_in_param_grad=report_nan_in_param_grad,
        )  # fmt: skip
        self.params, self.steps, self._weights = parts.params, parts.steps, parts.weights
        self._hooks, self._step = parts.hooks, parts.step
        self.suggested_communication_unit_size = parts.communication_unit_size
        self._probe = next(iter(self.params), None)  # _refuse_converted
        self.set_model_auto_sync(sync_model_each_microbatch)
        self.is_last_microbatch = True
        if meta is not None and not init_meta_values:
            self.steps.weights_uninstalled = True  # the caller's init writes the main weights
        elif meta is not None and init_sync and (not self.sharding.shard_params or self.outer is not None):
            self.broadcast_params()  # replicas materialised apart (see init_sync above)
        self._step.ballot.prepare()  # every check passed on every rank: no step has to build the vote groups

    @property
    def suggested_AG_prefetch_size(self) -> int:
        """Elements a prefetch may gather ahead (whole units, in order); 0 turns prefetch off."""
        return self._hooks.gathers.prefetch_size

    @suggested_AG_prefetch_size.setter
    def suggested_AG_prefetch_size(self, elements: int) -> None:
        self._hooks.gathers.prefetch_size = elements

    @property
    def suggested_RS_queue_capacity(self) -> int:
        """Elements of grad reductions in flight before the oldest is waited for (ZeRO-2/3, whose
        whole-bucket grads are temporary; no_shard and optim reduce persistent buffers, unbounded)."""
        return self._hooks.reductions.queue_capacity

    @suggested_RS_queue_capacity.setter
    def suggested_RS_queue_capacity(self, elements: int) -> None:
        self._hooks.reductions.queue_capacity = elements

    @property
    def units_kept_after_forward(self) -> set[int]:
        """ZeRO-3 units not released after their forward (FSDP2's ``reshard_after_forward=False``)."""
        return self._hooks.units_kept_after_forward

    @units_kept_after_forward.setter
    def units_kept_after_forward(self, unit_ids: set[int]) -> None:
        self._hooks.units_kept_after_forward = unit_ids

    @property
    def units_not_gathered_in_backward(self) -> set[int]:
        """ZeRO-3 units whose backward needs no weights (an embedding's): not gathered for it (FSDP2's
        ``set_unshard_in_backward(False)``)."""
        return self._hooks.gathers.not_gathered_in_backward

    @property
    def chosen_prefetch(self) -> dict[tuple[int, int], list[int]]:
        """{(unit, +1 forward / -1 backward): the units gathered right after that unit's own gather},
        in place of the budgeted prefetch there (FSDP2's ``set_modules_to_*_prefetch``)."""
        return self._hooks.gathers.chosen_prefetch

    @property
    def raw_param(self) -> dict[str, nn.Parameter]:
        """Megatron-FSDP's name -> param map of the wrapped module's own (compute) params, tied ones once,
        named as in the wrapped module: a view over the records, built when read."""
        return {record.name: record.compute for record in self.params}

    @property
    def param_to_name(self) -> dict[nn.Parameter, str]:
        """Megatron-FSDP's param -> name map, the inverse of :attr:`raw_param`."""
        return {record.compute: record.name for record in self.params}

    @property
    def grads_pending(self) -> bool:
        """Whether a backward ran since the cycle's grads were last handed to the optimizer's params."""
        return self._step.cycle.grads_pending

    @property
    def cycle_finished(self) -> bool:
        """Whether ``finish_grad_sync()`` handed this cycle's grads to the optimizer's params and no
        backward ran since."""
        return self._step.cycle.grads_finished

    @property
    def microbatch_count(self) -> int:
        """Backwards since the last ``finish_grad_sync()``."""
        return self._hooks.cycle.microbatch_count

    # --- what it holds -------------------------------------------------------------------------------
    def pending_grads(self) -> dict[str, str]:
        """Buckets still waiting for grads in this backward, by param name (for the hang watchdog)."""
        return self._hooks.reductions.missing_grads(self._hooks.cycle.in_backward)

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

    # --- forward and backward -------------------------------------------------------------------------
    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        return self.module(*inputs, **kwargs)  # the root hooks install, show the compute params, gather

    def _replace_param_with_raw_if_needed(self) -> None:
        """The wrapped modules hold the compute params (from the root forward to the end of backward)."""
        self._hooks.registry.show_compute()

    def _replace_param_with_distributed_if_needed(self) -> None:
        """The wrapped modules hold the optimizer's DTensor params, as a parent module or
        ``torch.compile``'s wrapper then sees them (:mod:`gradsync.fsdp.sharded_param`)."""
        self._hooks.registry.show_optimizer()

    def _cycle_ends(self) -> bool:
        """Whether this backward is the cycle's last: the once-per-cycle reductions run in it."""
        return self.is_last_microbatch or self.model_auto_sync

    def _backward_ended(self) -> None:
        if self.model_auto_sync:
            self.finish_grad_sync()

    # --- gathers ------------------------------------------------------------------------------------
    def all_gather_and_wait_parameters_ready(
        self,
        params: Sequence[nn.Parameter],
        prefetch: bool = True,
        prefetch_order: PrefetchOrder = PrefetchOrder.FORWARD_PASS_ORDER,
        wait_bucket_ready: bool = True,
    ) -> None:
        """Gather the compute weights of ``params`` (and, with ``prefetch``, the next unit in
        ``prefetch_order``), waiting for them when ``wait_bucket_ready``."""
        self._weights.gather_params(self.params, params, prefetch, prefetch_order, wait_bucket_ready)

    def start_param_sync(self, *unused: Any, force_sync: bool = False, force_dispatch: bool = False) -> None:
        """Start the gathers that bring the optimizer's update to every replica (ZeRO-1/2), or prefetch
        the first weights (ZeRO-3); wait for them when ``force_sync`` or ``overlap_param_gather`` is off.
        With overlap and ``fsdp_all_gather_in_start_param_sync=False`` it starts none: the forward
        gathers each bucket as it comes."""
        self._weights.start(force_sync)

    def synchronize_param_gather(self) -> None:
        """Finish every gather in flight; ZeRO-3 then drops all gathered weights. The modules hold the
        optimizer's params after it."""
        self._weights.finish()

    # --- the step ------------------------------------------------------------------------------------
    @labelled("start_grad_sync")
    def start_grad_sync(self, *unused: Any) -> None:
        """Reduce grads that wait for the end of the cycle (no_shard / optim, HSDP's outer stage)."""
        self._hooks.reductions.launch_deferred()

    def synchronize_gradient_reduce(self) -> None:
        """Launch pending reductions and wait for every reduction in flight."""
        self.start_grad_sync()
        self._hooks.reductions.wait_all()

    @labelled("finish_grad_sync")
    def finish_grad_sync(self, force_all_reduce: bool = False) -> None:
        """Every grad of the cycle reduced exactly once, then attached to the optimizer's params. Calling
        it again before the next backward changes nothing (finalize_model_grads may already have run
        reductions on the attached grads)."""
        self._step.finish()

    @labelled("zero_grad_buffer")
    def zero_grad_buffer(self) -> None:
        """Zero the grad buffers and drop the optimizer params' grads; call once per optimizer step. A
        backward that raised part-way abandons the step here (see :mod:`gradsync.buffers.step_ballot`)."""
        self._step.zero()

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
        """Reduce each bucket's grads with ``hook(state, bucket)``, torch DDP's protocol
        (:mod:`gradsync.fsdp.megatron_fsdp`). Register it once, before the first backward."""
        group = self.dist_index.get_fsdp_group()
        register_bucket_hook(self.buckets, self.ddp_config, self.outer, group, state, hook)

    def set_model_auto_sync(self, sync_model: bool = True) -> None:
        """With auto-sync every backward reduces and ends with ``finish_grad_sync()``."""
        self.model_auto_sync = sync_model
