"""What the optimizer and checkpoints see of a MegatronFSDP model, and what it attaches to each optimizer.

MegatronFSDP's state dict: params as the optimizer's DTensor shards, loaded from shards or whole tensors,
and the whole model gathered for export.

The sharded state dict runs no collective, in either direction. Each rank knows from the layout which rows
of every param it owns, so a whole tensor (from an unwrapped model, or gathered) is loaded by copying those
rows, and a DTensor saved by the same layout by copying its local shard.

What a MegatronFSDP model attaches to each optimizer that holds its params, at that optimizer's first
step (:mod:`gradsync.buffers.optimizer_watch` finds the model for it), through the optimizer's own hooks:

- before each step, the guard that refuses a step on wrong grads (:meth:`refuse_unsynced_step`);
- after each step, the "stepped" mark (:mod:`gradsync.fsdp.schedule`);
- torch's element-wise optimizers step on the local tensors from the next step on
  (:mod:`gradsync.fsdp.local_step`);
- where torch drops a ragged DTensor's split from op outputs (2.11), the state the step created gets its
  param's split back.

Each hook holds the model weakly: an optimizer may outlive the model it stepped.

What the optimizer and checkpoints see of a MegatronFSDP model: the sharded params, their grads and state
dict, and what an optimizer step tells the model.

:class:`OptimizerFacing` is MegatronFSDP's base: it holds that half of the reference's API, over the parts
MegatronFSDP builds (:mod:`gradsync.fsdp.assembly`), so the wrapper's own class keeps the module-facing
half (forward, backward, gathers, the grad sync). A move or cast of the model after wrapping is refused
here too: it would leave the optimizer stepping copies of its params.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any, NoReturn, Protocol

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from gradsync.buffers.optimizer_watch import guard_steps, weak_step_hook
from gradsync.buffers.step_cycle import StepCycle
from gradsync.groups import FSDPDistributedIndex

from .bucket import FlatParamBucket
from .local_step import adopt_for_local_steps, split_state_as_params
from .ragged import describe_shard, split_of
from .settings import Sharding
from .sharded_param import ParamRegistry, ShardedParam, ShardedParams
from .step_control import StepControl, WeightSync
from .torch_internals import SUBCLASS_DISPATCH, detach_for_saving
from .training_hooks import TrainingHooks


def param_keys(module: nn.Module, prefix: str = "module.") -> dict[str, nn.Parameter]:
    """Every name of every param of ``module`` (tied aliases included), as ``prefix + name``."""
    keys = {}
    for module_name, owner in module.named_modules():
        for leaf, param in owner.named_parameters(recurse=False):
            keys[f"{prefix}{module_name}{'.' if module_name else ''}{leaf}"] = param
    return keys


def param_loader(
    key: str, bucket: FlatParamBucket, index: int, target: nn.Parameter, value: torch.Tensor
) -> Callable[[], None]:
    """Check ``value`` (the whole param, or a DTensor shard of the same layout) against ``target`` (an
    optimizer param of ``bucket``) and return the copy of it into the rows this rank owns: a state dict is
    checked whole before any param changes. A split that differs is refused first: every rank sees it, so
    every rank refuses alike."""
    local = target.to_local() if isinstance(target, DTensor) else target
    shape = bucket.layout.items[index].shape
    if isinstance(value, DTensor) and all(p.is_replicate() for p in value.placements):
        value = value.to_local()  # whole on every rank (a load pre-hook's merge of whole pieces)
    if isinstance(value, DTensor):
        if isinstance(target, DTensor) and split_of(value) != split_of(target):
            raise ValueError(
                f"load_state_dict: {key!r} is split over the ranks as {split_of(value)}, this model's param "
                f"as {split_of(target)}: the buckets were laid out differently (gradsync-fsdp up to 0.3.0 "
                "kept every bucket in module order); load through torch.distributed.checkpoint, which "
                "reshards, or load whole tensors"
            )
        source = value.to_local()
        if tuple(value.shape) != tuple(shape) or source.shape != local.shape:
            raise ValueError(
                f"load_state_dict: {key!r} is a DTensor of shape {list(value.shape)} with a local shard of "
                f"{list(source.shape)}, but this model's shard is {list(local.shape)} of {list(shape)}: "
                "load shards saved with the same strategy and world size, or whole tensors"
            )
    else:
        if tuple(value.shape) != tuple(shape):
            raise ValueError(
                f"load_state_dict: {key!r} has shape {list(value.shape)}, the param {list(shape)}"
            )
        first, last = bucket.owned_rows(index)
        source = value.reshape(shape)[first:last] if len(shape) else value

    def copy() -> None:
        with torch.no_grad():
            local.copy_(source.reshape(local.shape))

    return copy


def add_sharded_params(
    destination: dict[str, Any], module: nn.Module, params: ShardedParams, prefix: str, keep_vars: bool
) -> None:
    """Put every param of ``module`` (tied aliases included) into ``destination`` as the optimizer's
    DTensor shard, described for ``torch.distributed.checkpoint``."""
    for key, param in param_keys(module, prefix).items():
        record = params.of(param)
        value = record.sharded if keep_vars else detach_for_saving(record.sharded)
        first_row = record.first_row
        destination[key] = value if first_row is None else describe_shard(value, first_row)


def load_sharded_params(module: nn.Module, params: ShardedParams, state_dict: dict[str, Any]) -> None:
    """Copy the rows this rank owns of every param of ``module`` that ``state_dict`` holds (DTensor shards
    of the same layout, or whole tensors: plain, or DTensors replicated everywhere), each checked before
    any is copied. Keys are ``module.``-prefixed."""
    keys = param_keys(module)
    copies = []
    for key, param in keys.items():
        if key in state_dict:
            record = params.of(param)
            copies.append(param_loader(key, record.bucket, record.index, record.sharded, state_dict[key]))
    for copy in copies:  # every param checked first: a refused state dict changes nothing
        copy()


def gather_full_state_dict(
    module: nn.Module,
    registry: ParamRegistry,
    buckets: Sequence[FlatParamBucket],
    *,
    release: bool,
    keep: bool,
) -> dict[str, Any]:
    """Every param whole, gathered one bucket at a time (as double buffers require), as plain CPU tensors
    keyed like ``module``'s own state dict; an empty dict where not ``keep``. ``release``: ZeRO-3 drops
    each bucket's gathered weights after copying them."""
    with registry.compute_shown():
        state = module.state_dict(keep_vars=True)
    names_of: dict[torch.Tensor, list[str]] = {}
    copied: dict[str, Any] = {}
    for name, value in state.items():
        if isinstance(value, torch.Tensor):
            names_of.setdefault(value, []).append(name)
        else:  # extra state (Megatron's layers give None): kept as it is
            copied[name] = value
    for bucket in buckets:
        bucket.wait_exact_gather()
        for param in bucket.spec.params:
            for name in names_of.pop(param, []) if keep else []:
                copied[name] = param.detach().cpu().clone()
        if release:
            bucket.release()
    if not keep:
        return {}
    for tensor, names in names_of.items():  # buffers
        copied.update({name: tensor.detach().cpu().clone() for name in names})
    return {name: copied[name] for name in state}


SPLITS_ATTR = "_gradsync_restores_state_splits"
"""On an optimizer: its post-step hook that restores the state's splits is registered (once, whatever the
number of models it steps)."""


class SteppedModel(Protocol):
    def refuse_unsynced_step(self) -> None: ...

    def mark_stepped(self) -> None: ...


def attach_optimizer(optimizer: torch.optim.Optimizer, model: SteppedModel) -> None:
    guard_steps(optimizer, model)
    optimizer.register_step_post_hook(weak_step_hook(model, "mark_stepped"))
    adopt_for_local_steps(optimizer)
    if not SUBCLASS_DISPATCH and not hasattr(optimizer, SPLITS_ATTR):
        setattr(optimizer, SPLITS_ATTR, True)
        optimizer.register_step_post_hook(lambda optimizer, args, kwargs: split_state_as_params(optimizer))


class OptimizerFacing(nn.Module):
    """The optimizer-facing API of :class:`~gradsync.fsdp.MegatronFSDP`, over the parts it builds."""

    module: nn.Module
    dist_index: FSDPDistributedIndex
    sharding: Sharding
    buckets: list[FlatParamBucket]
    params: ShardedParams
    steps: StepCycle
    _probe: ShardedParam | None
    _hooks: TrainingHooks
    _weights: WeightSync
    _step: StepControl

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]:
        """The optimizer's DTensor params, named as in the wrapped module with a ``module.`` prefix."""
        for record in self.params:
            yield f"{prefix}{'.' if prefix else ''}module.{record.name}", record.sharded

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]
        """Buffers as usual, params as the optimizer's DTensor shards (``module.``-prefixed; tied aliases
        map to the same DTensor), described for ``torch.distributed.checkpoint``. Local: no collective
        runs, so any rank may call it alone."""
        destination: dict[str, Any] = super().state_dict(*args, **kwargs)
        prefix = kwargs.get("prefix", "") + "module."
        add_sharded_params(destination, self.module, self.params, prefix, kwargs.get("keep_vars", False))
        return destination

    def load_state_dict(  # type: ignore[override]
        self, state_dict: dict[str, Any], strict: bool = True, assign: bool = False
    ) -> Any:
        """Load params from DTensor shards of the same layout or from whole tensors (each rank copies the
        rows it owns), buffers as usual; then install the weights. No collective runs.

        The modules' load pre-hooks run first, as in torch: a hook may build a param's value (torchtitan's
        fused QKV merges the split keys it saved into one whole weight). So each param's value is taken
        from the state dict after its own module's hooks ran, and copied into the shards once every
        module's were (torch would copy it into the DTensor shard directly)."""
        keys = param_keys(self.module)
        taken: dict[str, Any] = {}

        def take_params(module: nn.Module, state: dict[str, Any], prefix: str, *_: Any) -> None:
            for leaf in module._parameters:
                if prefix + leaf in keys and prefix + leaf in state:
                    taken[prefix + leaf] = state.pop(prefix + leaf)

        handles = [
            owner.register_load_state_dict_pre_hook(take_params)  # type: ignore[no-untyped-call]
            for owner in self.module.modules()
        ]
        try:
            result = super().load_state_dict(state_dict, strict=False, assign=assign)
        finally:
            for handle in handles:
                handle.remove()
        load_sharded_params(self.module, self.params, taken)
        result.missing_keys[:] = [k for k in result.missing_keys if k not in taken]
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
        self._weights.install_if_stepped()
        keep = not rank0_only or self.dist_index.get_dp_group().rank() == 0
        registry, release = self._hooks.registry, self.sharding.shard_params
        return gather_full_state_dict(self.module, registry, self.buckets, release=release, keep=keep)

    def _apply(self, *args: Any, **kwargs: Any) -> NoReturn:
        """Refused (``to()``, ``cuda()``, ``float()``, ``to_empty()``, ... all come here): torch would put
        a copy in place of each param, which the wrapper never reads or steps."""
        raise NotImplementedError(
            "MegatronFSDP: moving or casting the model (to(), cuda(), cpu(), float(), half(), to_empty(), "
            "...) after wrapping is not supported: its params are views of the wrapper's flat buffers, and "
            "torch would put copies the wrapper never reads or steps in their place (a move to the device "
            "they are on still puts copies in). Move or cast the module before "
            "wrapping, or pass device= (for dtypes, mixed_precision_policy)"
        )

    def _refuse_converted(self) -> None:
        """Raise when a move or cast of the wrapped module itself (``module.to()``, ...) swapped the
        optimizer's params it holds between steps for copies: their local tensors are no longer views of
        the wrapper's buffers, so the optimizer would step tensors the wrapper never reads. One param
        is looked at per forward, so a conversion of a submodule that does not hold it goes unseen, and so
        does one during a step (the module then holds the compute params)."""
        if self._probe is not None and self._probe.swapped_for_a_copy:
            raise RuntimeError(
                f"MegatronFSDP: param {self._probe.name} of the wrapped module is a copy the wrapper does "
                "not hold: the module was moved or cast after wrapping (module.to(), cuda(), float(), "
                "to_empty(), ...), which swaps each param for one the wrapper never reads or steps. Move "
                "or cast the module before wrapping (device=, mixed_precision_policy), and wrap it again"
            )

    def install_optimized_model_weights(self) -> None:
        """Copy the optimizer's updated weights into the compute weights; ZeRO-1/2 replicas are gathered
        at the next forward, or now when ``overlap_param_gather`` is off."""
        self._weights.install()

    def broadcast_params(self) -> None:
        """Make every rank's weights DP rank 0's (every replica, outer ones included): gather each bucket
        whole, broadcast it, re-shard. Under ZeRO-3 each rank kept only its shard of its own initial
        weights, so what is broadcast is the gathered model: build identical models (same seed) or load a
        state dict to start from one."""
        self._weights.broadcast(self.dist_index.get_dp_group())

    def attach_grad_to_optimizer_state(self) -> None:
        """Give the optimizer's params their reduced grads."""
        self.params.attach_grads()

    def scale_gradients(self, scaling_factor: float | torch.Tensor) -> None:
        """Multiply every grad by ``scaling_factor``: the buffers, and attached grads that are copies."""
        self.params.scale_grads(scaling_factor)

    @property
    def step_left_broken(self) -> bool:
        """Whether this rank's step went wrong in a way only the next ``zero_grad_buffer()`` settles: a
        backward that raised part-way, a training forward with no backward (both abandon the step
        there), or a step abandoned here or on another rank (the buffers hold its partial grads). Loops
        that call no ``zero_grad_buffer()`` (the FSDP2-style API) ask this at the next forward."""
        return self._step.cycle.step_left_broken

    def refuse_unsynced_step(self) -> None:
        """Raise before an optimizer step that would apply wrong grads (run by a step pre-hook of every
        optimizer holding these params)."""
        self._step.cycle.refuse_unsynced_step(self._step.abandon)

    def attach_to_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """An optimizer holding these params is about to step for the first time
        (:mod:`gradsync.buffers.optimizer_watch`): attach what its steps need (:mod:`.optimizer_facing`)."""
        attach_optimizer(optimizer, self)

    def mark_stepped(self) -> None:
        """An optimizer updated the params: the next forward (or weight read) installs the weights unless
        ``install_optimized_model_weights()`` runs first, and no grad may arrive before
        ``zero_grad_buffer()``. torch optimizers call it by themselves; call it after an update made any
        other way."""
        self.steps.stepped()
