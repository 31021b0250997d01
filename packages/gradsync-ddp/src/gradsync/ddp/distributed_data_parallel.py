"""DistributedDataParallel, and the grad hooks that count each param's grads into its bucket.

DDP's side of the param-readiness protocol (:func:`gradsync.buffers.ensure_params_ready`).

With ``overlap_param_gather`` each bucket group's params carry one :class:`BucketParamReadyCallback`.
Called before weights are read outside the forward pre-hooks, it finishes the group's gather in flight,
or, while the wrapper's pre-hooks own the schedule, starts and finishes one. It holds the wrapper and
the group weakly, so a param outliving its wrapper keeps neither alive.

The hooks and callbacks a DistributedDataParallel leaves on its params and module.

Each holds the wrapper weakly: params keep their hooks in C++, where the garbage collector cannot see a
cycle back to the wrapper, so a strong reference would keep the wrapper, its buffers and its process
groups (each with polling gloo threads) alive for as long as the params live.

`DistributedDataParallel`: contiguous grad buffers, bucketed reductions overlapped with backward.

The wrapper owns the hooks; the buffers, bucket groups and collectives come from gradsync-buffers.
A post-accumulate-grad hook moves each ``.grad`` into ``main_grad`` and reports the param ready, so a
bucket group's reduction starts the moment its last grad arrives. With the distributed optimizer and
``overlap_param_gather``, forward pre-hooks wait for each group's param all-gather just before the first
module that needs it, and start the next group's.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, NoReturn, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.hooks import RemovableHandle

from gradsync.buffers import (
    PARAM_READY_CALLBACK_ATTR,
    DistributedDataParallelConfig,
    FullParamLayout,
    as_ddp_config,
    build_grad_buffers,
    refuse_fields_ddp_cannot_honour,
)
from gradsync.buffers.bucket_group import ParamAndGradBucketGroup
from gradsync.buffers.comm_hook import CommHook
from gradsync.buffers.optimizer_watch import guard_steps, watch_optimizers
from gradsync.buffers.shard_alignment import ShardAlignmentSpec, ShardBalance
from gradsync.buffers.step_ballot import StepBallot
from gradsync.buffers.step_cycle import StepCycle
from gradsync.buffers.wrapper_claims import claim
from gradsync.groups import ModelParallelConfigProtocol, ProcessGroupCollection

from .base import _BaseDataParallel
from .comm_hook_registration import install_comm_hook
from .grad_buffer_offload import offload_grad_buffers, restore_grad_buffers
from .process_groups import resolve_process_groups
from .wrapped_params import (
    agree_across_ranks,
    apply_shard_alignment,
    broadcast_module_params,
    refuse_unknown_unused,
)


class BucketParamReadyCallback:
    """Makes one bucket group's params current when called (Megatron-Core's _BucketParamReadyCallback)."""

    def __init__(self, ddp: DistributedDataParallel, bucket_group: ParamAndGradBucketGroup) -> None:
        self._ddp = weakref.ref(ddp)
        self._group = weakref.ref(bucket_group)

    def __call__(self) -> None:
        group = self._group()
        if group is None:
            return
        if group.param_gather_dispatched and group.param_gather_handle is None:
            return  # gathered already: the common case, kept cheap
        ddp = self._ddp()
        if ddp is None:
            return
        owns_schedule = bool(ddp.remove_forward_pre_hook_handles)
        if group.param_gather_handle is not None:
            if owns_schedule:
                ddp._finish_param_sync_for_bucket_group(group)
            else:
                group.finish_param_sync(skip_next_bucket_dispatch=True)
        elif owns_schedule:
            ddp._finish_param_sync_for_bucket_group(group)  # starts the gather and waits for it


def register_grad_hooks(
    ddp: DistributedDataParallel,
    named: Sequence[tuple[str, nn.Parameter]],
    unused_parameters: Collection[str],
) -> list[RemovableHandle]:
    """A post-accumulate-grad hook on every param: the main-grad hook on those with a grad buffer, one
    that refuses the grad on those declared unused."""
    post_hook = _main_grad_hook(weakref.ref(ddp))
    hooks = [(p, post_hook) for p in ddp.params_with_grad]
    hooks += [(p, _refuse_grad(n)) for n, p in named if n in unused_parameters]
    return [
        p.register_post_accumulate_grad_hook(hook)  # type: ignore[no-untyped-call]
        for p, hook in hooks
    ]


def _main_grad_hook(wrapper: weakref.ref[DistributedDataParallel]) -> Callable[[torch.Tensor], None]:
    """The hook moves a param's grad into main_grad and reports it ready."""

    def hook(param: torch.Tensor) -> None:
        ddp = wrapper()
        if ddp is None:
            return  # the wrapper is gone: the grad stays in param.grad, as without one
        grad = param.grad
        main_grad: torch.Tensor = param.main_grad  # type: ignore[attr-defined]
        # A grad that aliases main_grad (left from finish_grad_sync) was accumulated in place already.
        aliased = grad is not None and grad.data_ptr() == main_grad.data_ptr()
        fused_already = param.grad_added_to_main_grad and not getattr(param, "zero_out_wgrad", False)  # type: ignore[attr-defined]
        if grad is not None and not aliased and not fused_already:
            main_grad.add_(grad)
        param.grad = None
        ddp._step.grad_arrived()
        if ddp.ddp_config.overlap_grad_reduce:
            owned = cast(nn.Parameter, param)  # the hook is handed the param itself
            ddp.param_to_bucket_group[owned].register_grad_ready(owned, ddp.force_all_reduce)

    return hook


def _refuse_grad(name: str) -> Callable[[torch.Tensor], None]:
    def hook(_: torch.Tensor) -> None:
        raise RuntimeError(
            f"param {name} was declared in unused_parameters but received a gradient; its grad would not "
            "be synchronised. Remove it from unused_parameters."
        )

    return hook


def count_weight_loads(ddp: DistributedDataParallel) -> None:
    """Bump ``ddp.model_params_version`` at every ``load_state_dict`` on the module or any submodule."""
    wrapper = weakref.ref(ddp)

    def loaded(_module: nn.Module, _keys: Any) -> None:
        owner = wrapper()
        if owner is not None:
            owner.model_params_version += 1

    for module in ddp.module.modules():
        module.register_load_state_dict_post_hook(loaded)  # type: ignore[no-untyped-call]


def set_param_ready_callbacks(ddp: DistributedDataParallel) -> None:
    """With overlap_param_gather, let ``ensure_params_ready`` finish a param's gather on demand (one
    callback per bucket group); otherwise drop callbacks a previous wrapper left on the params."""
    for group in ddp.grad_buffers.all_bucket_groups:
        callback = BucketParamReadyCallback(ddp, group) if ddp.ddp_config.overlap_param_gather else None
        for param in group.params:
            if callback is not None:
                setattr(param, PARAM_READY_CALLBACK_ATTR, callback)
            elif hasattr(param, PARAM_READY_CALLBACK_ATTR):
                delattr(param, PARAM_READY_CALLBACK_ATTR)


class DistributedDataParallel(_BaseDataParallel):
    """DDP wrapper that stores grads in contiguous buffers and reduces them bucket by bucket.

    ``full_param_layout`` (Megatron's training path computes it with
    ``DistributedOptimizer.compute_full_param_layout`` over the module's trainable params in order) must
    match how the wrapper groups those params, or construction fails naming the buffer.
    ``unused_parameters`` (gradsync extension) names params known never to receive a grad: they are left
    out of the buffers, and one that does receive a grad raises instead of being silently dropped.

    Before any other collective, one collective checks that every data-parallel rank wraps the same
    params with the same config and arguments (an error on every rank names the first difference). Then,
    as torch's DDP does, every replica starts from the first data-parallel rank's params (``init_sync``,
    gradsync's addition; False keeps the reference's behaviour: call :meth:`broadcast_params` yourself).
    A rank that abandons a step (its backward raised and the exception was caught, or it syncs with no
    backward) raises, and so does every other data-parallel rank at its :meth:`finish_grad_sync`
    (:mod:`gradsync.buffers.step_ballot`). An optimizer step after a backward whose grads were not
    synchronised (no :meth:`finish_grad_sync`), or after a param frozen at wrap time was unfrozen, raises;
    so does a second wrapper over params a live gradsync wrapper holds.
    """

    def __init__(
        self,
        config: ModelParallelConfigProtocol,
        ddp_config: DistributedDataParallelConfig,
        module: nn.Module,
        disable_bucketing: bool = False,
        pg_collection: ProcessGroupCollection | None = None,
        full_param_layout: FullParamLayout[int] | FullParamLayout[torch.Tensor] | None = None,
        *,
        unused_parameters: Collection[str] = (),
        shard_alignment: ShardAlignmentSpec = None,
        init_sync: bool = True,
    ) -> None:
        """``shard_alignment`` (gradsync's addition, read with ``use_distributed_optimizer``): where the
        optimizer's shards may cut each param, one policy or per param name
        (:mod:`gradsync.buffers.shard_alignment`): ``tensor`` keeps a param whole on one rank (Muon),
        ``block:k`` / ``block:RxC`` cut only between whole blocks; the default cuts anywhere."""
        super().__init__(config, module)
        ddp_config = as_ddp_config(ddp_config)  # Megatron-Core's config object of any recent version, too
        refuse_fields_ddp_cannot_honour(ddp_config, type(self).__name__)
        self.ddp_config = ddp_config
        self.pg_collection = resolve_process_groups(pg_collection, config)
        named = list(module.named_parameters())
        refuse_unknown_unused(named, unused_parameters)
        per_token_loss = getattr(config, "calculate_per_token_loss", False)
        arguments: dict[str, object] = {
            "disable_bucketing": disable_bucketing,
            "unused_parameters": sorted(unused_parameters),
            "shard_alignment": shard_alignment,
            "full_param_layout": full_param_layout is not None,
            "calculate_per_token_loss": per_token_loss,
        }
        agree_across_ranks(self, named, ddp_config, self.pg_collection, arguments, init_sync=init_sync)
        apply_shard_alignment(named, shard_alignment, with_full_param_layout=full_param_layout is not None)

        pp = self.pg_collection.pp
        pp_rank = pp.rank() if isinstance(pp, dist.ProcessGroup) else 0
        trainable = [(n, p) for n, p in named if p.requires_grad and n not in unused_parameters]
        self.params_with_grad = [p for _, p in trainable]
        self.param_to_name = {p: n for n, p in trainable}
        for param in self.params_with_grad:
            param.grad_added_to_main_grad = False  # type: ignore[attr-defined]
        self.grad_buffers = build_grad_buffers(
            trainable,
            ddp_config,
            self.pg_collection,
            calculate_per_token_loss=per_token_loss,
            single_bucket=pp_rank > 0,
            disable_bucketing=disable_bucketing,
            full_param_layout=full_param_layout,
        )
        self.full_param_layout = full_param_layout
        # Megatron-Core's attribute name; it shadows nn.Module.buffers() on purpose, as the reference does.
        self.buffers = self.grad_buffers.buffers  # type: ignore[assignment,method-assign]
        self.expert_parallel_buffers = self.grad_buffers.expert_parallel_buffers
        self.bucket_groups = self.grad_buffers.bucket_groups
        self.expert_parallel_bucket_groups = self.grad_buffers.expert_parallel_bucket_groups
        self.bucket_size = self.grad_buffers.bucket_size
        self.param_to_bucket_group: dict[nn.Parameter, ParamAndGradBucketGroup] = {
            p: group for group in self.grad_buffers.all_bucket_groups for p in group.params
        }
        # Params whose optimizer-facing grad cannot be a view of main_grad (bf16 params with fp32 main
        # grads): their ``.grad`` is a copy in the param dtype, refreshed whenever main_grad changes here.
        self.params_with_grad_copies = [p for p in self.params_with_grad if p.main_grad.dtype != p.dtype]  # type: ignore[attr-defined]
        self.force_all_reduce = False
        self.model_params_version = 0
        """Bumped whenever weights are loaded into the module, so optimizers holding main-param copies can
        tell theirs are stale (see DistributedOptimizer.reload_model_params)."""
        count_weight_loads(self)
        self.grad_hook_handles = register_grad_hooks(self, named, unused_parameters)
        self.use_forward_hook = ddp_config.overlap_param_gather
        self.remove_forward_pre_hook_handles: dict[nn.Module, Any] = {}
        self.overlap_param_gather_with_optimizer_step = False
        set_param_ready_callbacks(self)
        if self.use_forward_hook:
            self.enable_forward_pre_hook()
        expert_dp = [self.pg_collection.expt_dp] if self.expert_parallel_bucket_groups else []
        voters = [self.pg_collection.dp_cp, *expert_dp]
        ballot = StepBallot(voters, type(self).__name__, ddp_config.check_abandoned_steps)  # type: ignore[arg-type]
        self._step = StepCycle(ballot, [(n, p) for n, p in named if not p.requires_grad])
        claim((p for _, p in named), self)
        watch_optimizers()
        ballot.prepare()  # every check passed on every rank: no step has to build the vote groups

    def shard_balance(self) -> ShardBalance:
        """What the distributed optimizer's layout costs over every buffer: padding elements, and the
        param elements each DP shard holds (``imbalance``: the largest over the mean). Buffers sharded
        over a different group size (expert parallel) are not counted."""
        buffers = self.grad_buffers.all_buffers
        if not buffers:
            raise ValueError("shard_balance: the model has no trainable params")
        world = buffers[0].data_parallel_world_size
        balances = [b.layout.balance(world) for b in buffers if b.data_parallel_world_size == world]
        return sum(balances[1:], balances[0])

    def _finish_param_sync_for_bucket_group(self, group: ParamAndGradBucketGroup) -> None:
        """Wait for ``group``'s gather; start the next group's unless the schedule says it is aligned."""
        skip = self.ddp_config.align_param_gather or self.overlap_param_gather_with_optimizer_step
        group.finish_param_sync(skip_next_bucket_dispatch=skip)

    def enable_forward_pre_hook(self) -> None:
        """Wait for (and chain) param all-gathers just before each module's forward."""
        if not self.use_forward_hook:
            raise RuntimeError("forward pre-hooks are only used with overlap_param_gather=True")
        if self.remove_forward_pre_hook_handles:
            raise RuntimeError("forward pre-hooks are already enabled")

        def wait_for_params(module: nn.Module, _: Any) -> None:
            for param in module.parameters(recurse=False):
                group = self.param_to_bucket_group.get(param)
                if group is not None:
                    self._finish_param_sync_for_bucket_group(group)

        for module in self.module.modules():
            self.remove_forward_pre_hook_handles[module] = module.register_forward_pre_hook(wait_for_params)

    def disable_forward_pre_hook(self, param_sync: bool = True) -> None:
        """Remove the pre-hooks; with ``param_sync``, gather every param now (before eval or saving)."""
        if not self.use_forward_hook:
            raise RuntimeError("forward pre-hooks are only used with overlap_param_gather=True")
        for handle in self.remove_forward_pre_hook_handles.values():
            handle.remove()
        self.remove_forward_pre_hook_handles.clear()
        if param_sync:
            with torch.no_grad():
                self.start_param_sync(force_sync=True)

    # --- the sync interface ----------------------------------------------------------------------

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate grads without counting readiness or reducing (every micro-batch but the last)."""
        groups = self.grad_buffers.all_bucket_groups
        for group in groups:
            group.is_last_microbatch = False
        try:
            yield
        finally:
            for group in groups:
                group.is_last_microbatch = True

    def register_comm_hook(self, state: object, hook: CommHook) -> None:
        """Reduce each bucket with ``hook(state, bucket)`` instead: torch DDP's method and protocol
        (gradsync's addition; Megatron-Core's wrapper has none), so torch's own hooks run unchanged,
        PowerSGD among them (``torch.distributed.algorithms.ddp_comm_hooks``). The hook returns a future of
        the bucket's grads averaged over the data-parallel group. Register it once, before the first
        backward."""
        install_comm_hook(self.grad_buffers, self.ddp_config, self.pg_collection, state, hook)

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """The module's forward; a training one (grad enabled) is noted, so that a rank whose step ends
        before its backward (the loss raised) abandons it at the next ``zero_grad_buffer()``."""
        if self.training and torch.is_grad_enabled():
            self._step.forward_ran()
        return self.module(*inputs, **kwargs)

    def start_grad_sync(self, *unused: Any) -> None:
        """Launch every bucket group's reduction now (async with overlap_grad_reduce)."""
        self.grad_buffers.start_grad_sync()

    def finish_grad_sync(self, force_all_reduce: bool = False) -> None:
        """Complete every reduction. Without the distributed optimizer, ``param.grad`` then holds the synced
        grad, so any torch.optim optimizer can step: a view of ``main_grad`` when dtypes match, else a copy
        in the param dtype that :meth:`scale_gradients` (and finalize_model_grads' reductions) keep equal
        to ``main_grad``."""
        with self._step.syncing(self._grads, self._abandon):
            self.grad_buffers.finish_grad_sync(force_all_reduce)
        if self.ddp_config.use_distributed_optimizer and not force_all_reduce:
            return  # only this rank's shard is reduced; the DistributedOptimizer reads main_grad
        for param in self.params_with_grad:
            main_grad: torch.Tensor = param.main_grad  # type: ignore[attr-defined]
            param.grad = main_grad if main_grad.dtype == param.dtype else main_grad.to(param.dtype)

    def scale_gradients(self, scaling_factor: float | torch.Tensor) -> None:
        """Multiply every grad by ``scaling_factor`` (a tensor stays on its device: no host sync)."""
        self.grad_buffers.scale_gradients(scaling_factor)
        for param in self.params_with_grad_copies:
            if param.grad is not None:
                param.grad.copy_(param.main_grad)  # type: ignore[attr-defined]

    def zero_grad_buffer(self) -> None:
        """Zero all grads and start a new iteration; call it at the start of every iteration.

        A reduction or gather still in flight (say, after an exception mid-step) is waited for first, so
        the zeroing can never race with a collective writing into the buffers. A backward that raised
        part-way abandons the step here (see the class docstring).
        """
        self._step.before_zeroing(self._abandon)
        for param in self.params_with_grad:
            param.grad_added_to_main_grad = False  # type: ignore[attr-defined]
            param.grad = None
        self.grad_buffers.reset()
        self._step.zeroed()

    def refuse_unsynced_step(self) -> None:
        """Raise before an optimizer step that would apply wrong grads (run by a step pre-hook of every
        optimizer holding these params, and by the DistributedOptimizer before it reads the grads)."""
        self._step.refuse_unsynced_step(self._abandon)

    def attach_to_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """An optimizer holding these params is about to step for the first time
        (:mod:`gradsync.buffers.optimizer_watch`): each of its steps asks :meth:`refuse_unsynced_step`."""
        guard_steps(optimizer, self)

    def _abandon(self, reason: str) -> NoReturn:
        """Complete this step's collectives for the other ranks, then raise on every rank."""
        self._step.abandon(self._complete_collectives, reason)

    def _complete_collectives(self) -> None:
        """What the other ranks' forward, backward and finish_grad_sync still communicate: the forward's
        param gathers, then every bucket group's reduction. Those the abandoned backward did not launch
        are launched now, in the order the others launch them (:meth:`GradBuffers.launch_order`)."""
        self._finish_forward_gathers()
        if self.ddp_config.overlap_grad_reduce:
            for group in self.grad_buffers.launch_order():
                if not group.grad_reduce_dispatched:
                    group.start_grad_sync()
        self.grad_buffers.finish_grad_sync()

    def _grads(self) -> Iterator[torch.Tensor]:
        return (buffer.grad_data for buffer in self.grad_buffers.all_buffers)

    def _finish_forward_gathers(self) -> None:
        """The param gathers the other ranks' forward still issues when this rank abandons its step: with
        forward pre-hooks, bucket group by bucket group in the order the gathers chain (the forward's: each
        group's gather dispatches the next). A rank that ran no forward issues them here, and for one that
        did, finishing a finished gather does nothing."""
        if self.remove_forward_pre_hook_handles:
            for group in reversed(self.grad_buffers.all_bucket_groups):
                self._finish_param_sync_for_bucket_group(group)

    def start_param_sync(self, *unused: Any, force_sync: bool = False, force_dispatch: bool = False) -> None:
        """Gather params after a distributed-optimizer step (async with overlap_param_gather)."""
        if not force_sync and self.overlap_param_gather_with_optimizer_step and not force_dispatch:
            return
        self.grad_buffers.start_param_sync(force_sync)

    def _start_bucket_group_param_sync(self, bucket_group: ParamAndGradBucketGroup, force_sync: bool) -> None:
        """Gather one bucket group's params, then run its post-gather work when the gather was synchronous
        (Megatron's hook, which its DistributedOptimizer calls for the groups it owns)."""
        bucket_group.start_param_sync(force_sync=force_sync)
        if self.ddp_config.overlap_param_gather:
            return
        bucket_group._post_param_sync()

    def reset_param_sync_dispatch_state(self) -> None:
        """Forget that param gathers were dispatched (the optimizer changed the shards again), so the next
        forward gathers anew. Refused while a gather is in flight: its result would be lost."""
        for group in self.grad_buffers.all_bucket_groups:
            if group.param_gather_handle is not None:
                raise RuntimeError(
                    "Cannot reset parameter all-gather dispatch state while an asynchronous parameter "
                    "all-gather is still in flight; call finish_param_sync (or run the forward) first"
                )
        for group in self.grad_buffers.all_bucket_groups:
            group.param_gather_dispatched = False

    def free_overlap_buffers(self) -> None:
        """Finish every param gather still in flight and drop its handle and the buckets'
        ``layerwise_gather_list`` (Megatron-Core's hook before an async checkpoint save)."""
        for group in self.grad_buffers.all_bucket_groups:
            group.free_overlap_buffers()

    def offload_grad_buffers(self, synchronize: bool = True, empty_cache: bool = True) -> None:
        """Give the grad buffers' device memory back (between training phases, say); every ``main_grad``
        view survives and reads as zeros after :meth:`restore_grad_buffers`."""
        offload_grad_buffers(self.grad_buffers.all_buffers, synchronize=synchronize, empty_cache=empty_cache)

    def restore_grad_buffers(self, synchronize: bool = True) -> None:
        """Re-allocate the grad buffers freed by :meth:`offload_grad_buffers`, zeroed."""
        restore_grad_buffers(self.grad_buffers.all_buffers, synchronize=synchronize)

    def broadcast_params(self) -> None:
        """Copy the first data-parallel rank's params (frozen ones too) to every replica; expert params
        from the first rank of their expert-data-parallel group."""
        broadcast_module_params(self.module, experts=False, group=self.pg_collection.dp_cp)
        broadcast_module_params(self.module, experts=True, group=self.pg_collection.expt_dp)
