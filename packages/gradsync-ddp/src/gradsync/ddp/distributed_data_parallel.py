"""`DistributedDataParallel`: contiguous grad buffers, bucketed reductions overlapped with backward.

The wrapper owns the hooks; the buffers, bucket groups and collectives come from gradsync-buffers.
A post-accumulate-grad hook moves each ``.grad`` into ``main_grad`` and reports the param ready, so a
bucket group's reduction starts the moment its last grad arrives. With the distributed optimizer and
``overlap_param_gather``, forward pre-hooks wait for each group's param all-gather just before the first
module that needs it, and start the next group's.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from typing import Any, NoReturn, cast

import torch
import torch.distributed as dist
from torch import nn

from gradsync.buffers import (
    PARAM_READY_CALLBACK_ATTR,
    DistributedDataParallelConfig,
    FullParamLayout,
    as_ddp_config,
    broadcast_from_first_rank,
    build_grad_buffers,
    check_experts_match_across_ranks,
    check_params_match_across_ranks,
    is_expert_parallel,
    refuse_fields_ddp_cannot_honour,
    settings_of,
)
from gradsync.buffers.bucket_group import ParamAndGradBucketGroup
from gradsync.buffers.comm_hook import CommHook, RegisteredHook, check_hook
from gradsync.buffers.shard_alignment import (
    ShardAlignmentSpec,
    ShardBalance,
    set_shard_alignments,
    shard_alignment_of,
)
from gradsync.buffers.step_ballot import StepBallot, unfinished_step
from gradsync.buffers.wrapper_claims import (
    claim,
    first_owned_elsewhere,
    guard_optimizer_steps,
    refuse_owned_elsewhere,
    refuse_unfrozen,
    skipped_backward,
)
from gradsync.groups import ModelParallelConfigProtocol, ProcessGroupCollection
from gradsync.groups.model_config import describe_model_parallel
from gradsync.groups.torch_internals import queue_backward_end_callback

from .base import _BaseDataParallel
from .param_ready import BucketParamReadyCallback


def resolve_process_groups(
    pg_collection: ProcessGroupCollection | None, config: ModelParallelConfigProtocol
) -> ProcessGroupCollection:
    """The groups DDP uses: pure DP over the default world when none are given; otherwise the given
    collection (never modified), with dp_cp defaulting to dp when there is no context parallelism.

    Without groups every rank is a DP replica, so a config that says model-parallel is refused: averaging
    TP shards or pipeline stages as if they were replicas would give silently wrong grads.
    """
    if pg_collection is None:
        sizes = describe_model_parallel(config)
        if sizes:
            raise ValueError(
                f"DistributedDataParallel: the config says {sizes} but no pg_collection was given, so every "
                "rank would be treated as a data-parallel replica. Pass "
                "pg_collection=gradsync.groups.initialize_model_parallel(...) (or a ProcessGroupCollection "
                "with dp, dp_cp, tp, pp, ...), or set those sizes to 1."
            )
        world = dist.group.WORLD
        return ProcessGroupCollection(
            dp=world,
            dp_cp=world,
            intra_dp_cp=world,
            expt_dp=world,
            intra_expt_dp=world,
            intra_dist_opt=world,
        )
    given = dict(vars(pg_collection))
    if given.get("dp") is None:
        raise ValueError("dp process group is required but not provided in pg_collection")
    if given.get("dp_cp") is None:
        if getattr(config, "context_parallel_size", 1) != 1:
            raise ValueError(
                "dp_cp process group is required when context_parallel_size > 1 but not provided in "
                "pg_collection"
            )
        given["dp_cp"] = given["dp"]
    return ProcessGroupCollection(**given)


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
        unknown = set(unused_parameters) - {name for name, _ in named}
        if unknown:
            raise ValueError(f"unused_parameters names params the module does not have: {sorted(unknown)}")
        dp_cp = self.pg_collection.dp_cp
        assert dp_cp is not None
        owned_elsewhere = first_owned_elsewhere(named, self)
        settings = settings_of(
            ddp_config,
            disable_bucketing=disable_bucketing,
            unused_parameters=sorted(unused_parameters),
            shard_alignment=shard_alignment,
            full_param_layout=full_param_layout is not None,
            calculate_per_token_loss=getattr(config, "calculate_per_token_loss", False),
            init_sync=init_sync,
            params_owned_by_another_wrapper=owned_elsewhere,
        )
        check_params_match_across_ranks(named, dp_cp, settings=settings)
        refuse_owned_elsewhere(owned_elsewhere, type(self).__name__)
        # dense params first: an expert-group mismatch raises on that group's ranks only, and the others
        # must not be left waiting in a broadcast over the whole data-parallel group
        if init_sync:
            _broadcast_params(module, experts=False, group=dp_cp)
        if self.pg_collection.expt_dp is not None:
            check_experts_match_across_ranks(named, self.pg_collection.expt_dp, who=type(self).__name__)
            if init_sync:
                _broadcast_params(module, experts=True, group=self.pg_collection.expt_dp)
        if full_param_layout is not None and shard_alignment is not None:
            raise ValueError(
                "DistributedDataParallel: full_param_layout was computed before shard_alignment could "
                "shape it; pass one or the other (DistributedOptimizer.compute_full_param_layout reads the "
                "policies recorded on the params)"
            )
        set_shard_alignments(named, shard_alignment)
        chunked = [name for name, param in named if shard_alignment_of(param).alone]
        if chunked:
            raise ValueError(
                f"shard_alignment 'chunk' (params {chunked[:3]}...) is gradsync-fsdp's torch-native DTensor "
                "layout; the distributed optimizer's main params are plain tensors: use 'row', 'tensor' or "
                "'block'"
            )

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
            calculate_per_token_loss=getattr(config, "calculate_per_token_loss", False),
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
        self.params_with_grad_copies = [
            p
            for p in self.params_with_grad
            if p.main_grad.dtype != p.dtype  # type: ignore[attr-defined]
        ]
        self.force_all_reduce = False
        self.model_params_version = 0
        """Bumped whenever weights are loaded into the module, so optimizers holding main-param copies can
        tell theirs are stale (see DistributedOptimizer.reload_model_params)."""
        self._watch_weight_loads()
        post_hook = self._make_backward_post_hook()
        hooks = [(p, post_hook) for p in self.params_with_grad]
        hooks += [(p, _refuse_grad(n)) for n, p in named if n in unused_parameters]
        self.grad_hook_handles = [
            p.register_post_accumulate_grad_hook(hook)  # type: ignore[no-untyped-call]
            for p, hook in hooks
        ]
        self.use_forward_hook = ddp_config.overlap_param_gather
        self.remove_forward_pre_hook_handles: dict[nn.Module, Any] = {}
        self.overlap_param_gather_with_optimizer_step = False
        self._set_param_ready_callbacks()
        if self.use_forward_hook:
            self.enable_forward_pre_hook()
        self._frozen_at_wrap = [(n, p) for n, p in named if not p.requires_grad]
        self._grads_pending = False  # a backward ran since the last finish_grad_sync / zero_grad_buffer
        self._backward_this_cycle = True  # a backward ran since zero_grad_buffer (none called yet: unknown)
        self._in_backward = False  # a backward delivered grads and has not ended (it raised, if it never)
        self._forward_unsynced = False  # a training forward ran since the last sync or zero_grad_buffer
        expert_dp = [self.pg_collection.expt_dp] if self.expert_parallel_bucket_groups else []
        self._ballot = StepBallot(
            [dp_cp, *expert_dp],  # type: ignore[list-item]
            type(self).__name__,
            ddp_config.check_abandoned_steps,
        )
        claim((p for _, p in named), self)
        guard_optimizer_steps()
        self._ballot.prepare()  # every check passed on every rank: no step has to build the vote groups

    # --- hooks -----------------------------------------------------------------------------------

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

    def _make_backward_post_hook(self) -> Callable[[torch.Tensor], None]:
        """The hook moves a param's grad into main_grad and reports it ready.

        It holds the wrapper weakly: params keep their hooks in C++, where the garbage collector cannot see
        a cycle back to the wrapper, so a strong reference would keep the wrapper, its buffers and its
        process groups (each with polling gloo threads) alive for as long as the params live.
        """
        wrapper = weakref.ref(self)

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
            ddp._grads_pending = ddp._backward_this_cycle = True
            if not ddp._in_backward:  # the engine runs the callback when this backward ends, not if it raises
                ddp._in_backward = True
                queue_backward_end_callback(ddp._backward_ended)
            if ddp.ddp_config.overlap_grad_reduce:
                owned = cast(nn.Parameter, param)  # the hook is handed the param itself
                ddp.param_to_bucket_group[owned].register_grad_ready(owned, ddp.force_all_reduce)

        return hook

    def _backward_ended(self) -> None:
        self._in_backward = False

    def _watch_weight_loads(self) -> None:
        """Count ``load_state_dict`` calls on the module or any submodule (held weakly, like the hooks)."""
        wrapper = weakref.ref(self)

        def loaded(_module: nn.Module, _keys: Any) -> None:
            ddp = wrapper()
            if ddp is not None:
                ddp.model_params_version += 1

        for module in self.module.modules():
            module.register_load_state_dict_post_hook(loaded)  # type: ignore[no-untyped-call]

    def _set_param_ready_callbacks(self) -> None:
        """With overlap_param_gather, let ``ensure_params_ready`` finish a param's gather on demand (one
        callback per bucket group); otherwise drop callbacks a previous wrapper left on the params."""
        for group in self.grad_buffers.all_bucket_groups:
            callback = BucketParamReadyCallback(self, group) if self.ddp_config.overlap_param_gather else None
            for param in group.params:
                if callback is not None:
                    setattr(param, PARAM_READY_CALLBACK_ATTR, callback)
                elif hasattr(param, PARAM_READY_CALLBACK_ATTR):
                    delattr(param, PARAM_READY_CALLBACK_ATTR)

    def _finish_param_sync_for_bucket_group(self, group: ParamAndGradBucketGroup) -> None:
        """Wait for ``group``'s gather; start the next group's unless the schedule says it is aligned."""
        skip = self.ddp_config.align_param_gather or self.overlap_param_gather_with_optimizer_step
        group.finish_param_sync(skip_next_bucket_dispatch=skip)

    def _make_forward_pre_hook(self) -> Callable[[nn.Module, Any], None]:
        def hook(module: nn.Module, _: Any) -> None:
            for param in module.parameters(recurse=False):
                group = self.param_to_bucket_group.get(param)
                if group is not None:
                    self._finish_param_sync_for_bucket_group(group)

        return hook

    def enable_forward_pre_hook(self) -> None:
        """Wait for (and chain) param all-gathers just before each module's forward."""
        if not self.use_forward_hook:
            raise RuntimeError("forward pre-hooks are only used with overlap_param_gather=True")
        if self.remove_forward_pre_hook_handles:
            raise RuntimeError("forward pre-hooks are already enabled")
        for module in self.module.modules():
            self.remove_forward_pre_hook_handles[module] = module.register_forward_pre_hook(
                self._make_forward_pre_hook()
            )

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
        groups = self.grad_buffers.all_bucket_groups
        if self.ddp_config.use_distributed_optimizer:
            raise NotImplementedError(
                "DistributedDataParallel.register_comm_hook: a hook returns whole reduced buckets, but "
                "use_distributed_optimizer=True reduce-scatters them; use grad_comm_dtype to compress there"
            )
        if self.ddp_config.grad_comm_dtype is not None:
            raise ValueError(
                "DistributedDataParallel.register_comm_hook: grad_comm_dtype already sets how buckets are "
                "reduced; unset it, or keep it and register no hook"
            )
        if self.expert_parallel_bucket_groups:
            raise NotImplementedError(
                "DistributedDataParallel.register_comm_hook: expert params reduce over the expert "
                "data-parallel group, which a hook's state does not name; not supported with experts"
            )
        dp_cp = self.pg_collection.dp_cp
        assert dp_cp is not None  # resolve_process_groups set it
        check_hook("DistributedDataParallel", state, hook, dp_cp)
        if any(group.comm_hook is not None for group in groups):
            raise RuntimeError("DistributedDataParallel.register_comm_hook can only be called once")
        registered, offset = RegisteredHook(state, hook, sum(len(group.buckets) for group in groups)), 0
        for group in groups:
            group.comm_hook, group.hook_bucket_offset = registered, offset
            offset += len(group.buckets)

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """The module's forward; a training one (grad enabled) is noted, so that a rank whose step ends
        before its backward (the loss raised) abandons it at the next ``zero_grad_buffer()``."""
        if self.training and torch.is_grad_enabled():
            self._forward_unsynced = True
        return self.module(*inputs, **kwargs)

    def start_grad_sync(self, *unused: Any) -> None:
        """Launch every bucket group's reduction now (async with overlap_grad_reduce)."""
        self.grad_buffers.start_grad_sync()

    def finish_grad_sync(self, force_all_reduce: bool = False) -> None:
        """Complete every reduction. Without the distributed optimizer, ``param.grad`` then holds the synced
        grad, so any torch.optim optimizer can step: a view of ``main_grad`` when dtypes match, else a copy
        in the param dtype that :meth:`scale_gradients` (and finalize_model_grads' reductions) keep equal
        to ``main_grad``."""
        self._forward_unsynced = False
        self._ballot.refuse_abandoned("finish_grad_sync()", self._in_backward, self._abandon)
        skipped = skipped_backward(self._backward_this_cycle, self._grad_buffers)
        if skipped is not None:
            self._abandon(skipped)
        counted = self._ballot.post()
        self.grad_buffers.finish_grad_sync(force_all_reduce)
        counted()
        self._grads_pending = False
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
        reason = unfinished_step(self._in_backward, self._forward_unsynced, self._backward_this_cycle)
        if reason is not None:
            self._abandon(reason)
        self._forward_unsynced = False
        for param in self.params_with_grad:
            param.grad_added_to_main_grad = False  # type: ignore[attr-defined]
            param.grad = None
        self.grad_buffers.reset()
        self._grads_pending = self._backward_this_cycle = self._ballot.abandoned = False

    def _grad_buffers(self) -> Iterator[torch.Tensor]:
        return (buffer.grad_data for buffer in self.grad_buffers.all_buffers)

    def refuse_unsynced_step(self) -> None:
        """Raise before an optimizer step that would apply wrong grads (run by a global step pre-hook,
        and by the DistributedOptimizer before it reads the grads)."""
        self._ballot.refuse_abandoned(
            "an optimizer step",
            self._in_backward,
            self._abandon,
            forward_without_backward=self._forward_unsynced and not self._backward_this_cycle,
        )
        if self._grads_pending:  # every rank usually runs the same code: each raises, no collective waits
            raise RuntimeError(
                f"{type(self).__name__}: optimizer step after a backward whose grads were not synchronised; "
                "call model.finish_grad_sync() (finalize_model_grads does) between the last backward and "
                "the step: stepping now would apply this rank's unreduced grads, or none"
            )
        refuse_unfrozen(self._frozen_at_wrap, type(self).__name__)

    def _abandon(self, reason: str) -> NoReturn:
        """Complete this step's reductions for the other ranks, then raise on every rank."""
        self._in_backward = self._grads_pending = self._forward_unsynced = False
        self._ballot.abandon(self._complete_step_collectives, reason)

    def _complete_step_collectives(self) -> None:
        """What the other ranks' forward, backward and finish_grad_sync still communicate. With forward
        pre-hooks, the forward's param gathers, bucket group by bucket group in the order the gathers
        chain (the forward's: each group's gather dispatches the next): a rank that ran no forward issues
        them here, and for one that did, finishing a finished gather does nothing. Then every bucket
        group's reduction: those the abandoned backward did not launch are launched now, in the order the
        others launch them (:meth:`GradBuffers.launch_order`)."""
        if self.remove_forward_pre_hook_handles:
            for group in reversed(self.grad_buffers.all_bucket_groups):
                self._finish_param_sync_for_bucket_group(group)
        if self.ddp_config.overlap_grad_reduce:
            for group in self.grad_buffers.launch_order():
                if not group.grad_reduce_dispatched:
                    group.start_grad_sync()
        self.grad_buffers.finish_grad_sync()

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
        device = self.grad_buffers.all_buffers[0].device if self.grad_buffers.all_buffers else None
        if synchronize:
            _synchronize(device)
        for buffer in self.grad_buffers.all_buffers:
            buffer.offload_to_cpu(move_params=False, move_grads=True)
        if empty_cache and device is not None and device.type == "cuda":
            torch.cuda.empty_cache()

    def restore_grad_buffers(self, synchronize: bool = True) -> None:
        """Re-allocate the grad buffers freed by :meth:`offload_grad_buffers`, zeroed."""
        for buffer in self.grad_buffers.all_buffers:
            buffer.reload_from_cpu(move_params=False, move_grads=True)
        if synchronize and self.grad_buffers.all_buffers:
            _synchronize(self.grad_buffers.all_buffers[0].device)

    def broadcast_params(self) -> None:
        """Copy the first data-parallel rank's params (frozen ones too) to every replica; expert params
        from the first rank of their expert-data-parallel group."""
        _broadcast_params(self.module, experts=False, group=self.pg_collection.dp_cp)
        _broadcast_params(self.module, experts=True, group=self.pg_collection.expt_dp)


def _broadcast_params(module: nn.Module, *, experts: bool, group: dist.ProcessGroup | None) -> None:
    """The dense (or expert) params of ``module`` from the first rank of ``group``."""
    chosen = [p.data for p in module.parameters() if is_expert_parallel(p) == experts]
    if not chosen:
        return
    if group is None:
        raise ValueError("broadcast_params: expert params need pg_collection.expt_dp")
    broadcast_from_first_rank(chosen, group)


def _synchronize(device: torch.device | None) -> None:
    if device is not None and device.type != "cpu":
        torch.accelerator.synchronize(device)


def _refuse_grad(name: str) -> Callable[[torch.Tensor], None]:
    def hook(_: torch.Tensor) -> None:
        raise RuntimeError(
            f"param {name} was declared in unused_parameters but received a gradient; its grad would not "
            "be synchronised. Remove it from unused_parameters."
        )

    return hook
