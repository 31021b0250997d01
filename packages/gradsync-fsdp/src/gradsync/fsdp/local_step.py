"""The optimizer step on the shards' local tensors.

An element-wise optimizer (Adam, SGD) on DTensor params sends each of its ~10 ops per param through
DTensor's dispatcher, which on CPU costs as much as the math of a small model's step (measured: 34 ms
against 15 ms for the toy GPT's AdamW). The shards' local tensors are views of the flat buffers, so the
same step on them updates the same memory. :func:`local_tensors_for_step` lends the optimizer the local
tensors (params, grads and state) for the duration of a step and gives the DTensors back after it, state
created during the step included.

``fully_shard_optimizer`` lends them around every step. An optimizer built by hand on the DTensor params
(the fsdp2 API's users build torch's own, as with torch's ``fully_shard``) is adopted at its first step:
a global pre-step hook wraps its later steps the same way, for torch's element-wise optimizers only (a
matrix optimizer on the locals would see shards for whole matrices).
"""

from __future__ import annotations

import contextlib
import functools
import types
from collections.abc import Iterator
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from gradsync.buffers.wrapper_claims import OWNER_ATTR, owners_of

from .ragged import RaggedDTensor
from .step_tracking import OWNER
from .torch_internals import SUBCLASS_DISPATCH


def _local(value: Any) -> Any:
    return value._local_tensor if isinstance(value, DTensor) else value


def _local_param(param: torch.Tensor) -> torch.Tensor:
    """``param``'s local tensor (the same object every step), with its grad and its owner's mark."""
    if not isinstance(param, DTensor):
        return param
    local: torch.Tensor = param._local_tensor
    local.grad = _local(param.grad)
    for mark in (OWNER, OWNER_ATTR):  # the step hooks find the model through them
        owner = getattr(param, mark, None)
        if owner is not None:
            setattr(local, mark, owner)
    return local


def _as_distributed(value: Any, param: DTensor, local: torch.Tensor) -> Any:
    """State the step created: per-element tensors become DTensors split like ``param`` (ragged too)."""
    if not (isinstance(value, torch.Tensor) and value.shape == local.shape and value.dim() > 0):
        return value
    if isinstance(param, RaggedDTensor):
        return param.like(value)
    return DTensor.from_local(
        value, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
    )


@contextlib.contextmanager
def local_tensors_for_step(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """Within the block, ``optimizer`` holds the local tensors of its DTensor params, their grads and
    their state; after it (even on an error), the DTensors again, with any state the step added."""
    groups: list[tuple[dict[str, Any], list[torch.Tensor]]] = []
    lent: dict[int, tuple[DTensor, torch.Tensor, dict[str, Any]]] = {}  # by id: (param, local, state)
    try:
        for group in optimizer.param_groups:
            originals = group["params"]
            if not any(isinstance(p, DTensor) for p in originals):
                continue
            group["params"] = [_local_param(p) for p in originals]
            groups.append((group, originals))
            for param, local in zip(originals, group["params"], strict=True):
                if isinstance(param, DTensor) and id(param) not in lent:
                    state = optimizer.state.pop(param, {})
                    lent[id(param)] = (param, local, state)
                    if state:
                        optimizer.state[local] = {key: _local(value) for key, value in state.items()}
        yield
    finally:
        for group, originals in groups:
            group["params"] = originals
        for param, local, state in lent.values():
            local.grad = None
            for key, value in optimizer.state.pop(local, {}).items():
                if _local(state.get(key)) is not value:  # created or replaced by the step
                    state[key] = _as_distributed(value, param, local)
            if state:
                optimizer.state[param] = state


def split_state_as_params(optimizer: torch.optim.Optimizer) -> None:
    """Give state that torch's ops built as plain DTensors (a torch that runs a DTensor subclass's ops in
    C++, 2.11, drops a :class:`RaggedDTensor`'s split from their outputs) its param's split, so it gathers
    and checkpoints as the param does. Run after every step by :func:`watch_state_splits`' hook, the
    materialising step of ``fully_shard_optimizer`` included."""
    for param, state in optimizer.state.items():
        if not isinstance(param, RaggedDTensor):
            continue
        for key, value in state.items():
            if (
                type(value) is DTensor
                and value.shape == param.shape
                and value._local_tensor.shape == param._local_tensor.shape
            ):
                state[key] = param.like(value._local_tensor)


@functools.cache
def watch_state_splits() -> None:
    """Where torch drops a :class:`RaggedDTensor`'s split from op outputs (2.11), give the state every
    optimizer step creates its param's split (a global post-step hook, once per process: torch optimizers
    stepped on gradsync's params directly, as with the fsdp2 API). Elsewhere nothing is registered."""
    if not SUBCLASS_DISPATCH:
        register_optimizer_step_post_hook(lambda optimizer, args, kwargs: split_state_as_params(optimizer))


LENDING_ATTR = "_gradsync_steps_on_locals"
"""On an optimizer once decided: True when its steps run within :func:`local_tensors_for_step`."""

ELEMENTWISE = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.Adagrad,
    torch.optim.Adadelta,
    torch.optim.RMSprop,
    torch.optim.ASGD,
)
"""torch's optimizers whose update of each element reads only that element's param, grad and state."""


def step_on_local_tensors(optimizer: torch.optim.Optimizer) -> None:
    """Wrap ``optimizer.step`` (whatever it is now: an LR scheduler may have wrapped it already) so each
    step runs on the local tensors. A bound method, as LR schedulers built later expect."""
    previous = optimizer.step

    def step(self: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        with local_tensors_for_step(self):
            return previous(*args, **kwargs)

    # the mark of a scheduler's wrapper stays visible, or the scheduler warns that step was replaced
    step.__dict__.update(getattr(previous, "__dict__", {}))
    optimizer.step = types.MethodType(step, optimizer)  # type: ignore[method-assign]
    setattr(optimizer, LENDING_ATTR, True)


def _adopt(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Decided once per optimizer, at its first step: the hook runs before every step of every optimizer
    in the process, and looking for owners walks all the params."""
    if hasattr(optimizer, LENDING_ATTR):
        return
    adopt = type(optimizer) in ELEMENTWISE and bool(owners_of(optimizer, OWNER))
    if adopt:  # it steps MegatronFSDP's params: from its next step on
        step_on_local_tensors(optimizer)
    else:
        setattr(optimizer, LENDING_ATTR, False)


@functools.cache
def adopt_hand_built_optimizers() -> None:
    """Register :func:`_adopt` as a global pre-step hook (once per process)."""
    register_optimizer_step_pre_hook(_adopt)
