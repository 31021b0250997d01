"""Which MegatronFSDP models an optimizer step has updated, so their next forward installs the weights.

The optimizer's in-place updates of the DTensor shards leave no trace a model could read on every rank
alike (a rank owning no rows of a bucket sees nothing change, and DTensor updates do not bump the flat
buffer's version counter). torch runs global post-step hooks after every ``torch.optim.Optimizer.step``
on every rank, so one such hook marks each model whose params the optimizer holds: a rank-consistent
"stepped" flag, cleared by ``install_optimized_model_weights()``.
"""

from __future__ import annotations

import functools
from typing import Any, Protocol

from torch.optim.optimizer import Optimizer, register_optimizer_step_post_hook
from torch.utils.hooks import RemovableHandle

OWNER = "_megatron_fsdp_model"
"""The attribute of an optimizer param that names its MegatronFSDP (the reference's name)."""


class Steppable(Protocol):
    def mark_stepped(self) -> None: ...


@functools.cache
def watch_optimizer_steps() -> RemovableHandle:
    """Register the global post-step hook (once per process)."""
    return register_optimizer_step_post_hook(_mark_stepped_models)


def _mark_stepped_models(optimizer: Optimizer, args: Any, kwargs: Any) -> None:
    marked: set[int] = set()
    for group in optimizer.param_groups:
        for param in group["params"]:
            model: Steppable | None = getattr(param, OWNER, None)
            if model is None or id(model) in marked:
                continue
            marked.add(id(model))
            model.mark_stepped()
