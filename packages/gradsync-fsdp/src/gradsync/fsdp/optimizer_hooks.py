"""What a MegatronFSDP model attaches to each optimizer that holds its params, at that optimizer's first
step (:mod:`gradsync.buffers.optimizer_watch` finds the model for it), through the optimizer's own hooks:

- before each step, the guard that refuses a step on wrong grads (:meth:`refuse_unsynced_step`);
- after each step, the "stepped" mark (:mod:`gradsync.fsdp.step_tracking`);
- torch's element-wise optimizers step on the local tensors from the next step on
  (:mod:`gradsync.fsdp.local_step`);
- where torch drops a ragged DTensor's split from op outputs (2.11), the state the step created gets its
  param's split back.

Each hook holds the model weakly: an optimizer may outlive the model it stepped.
"""

from __future__ import annotations

from typing import Protocol

import torch

from gradsync.buffers.optimizer_watch import guard_steps, weak_step_hook

from .local_step import adopt_for_local_steps, split_state_as_params
from .torch_internals import SUBCLASS_DISPATCH

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
