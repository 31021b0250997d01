"""Which MegatronFSDP models an optimizer step has updated, so their next forward installs the weights.

The optimizer's in-place updates of the DTensor shards leave no trace a model could read on every rank
alike (a rank owning no rows of a bucket sees nothing change, and DTensor updates do not bump the flat
buffer's version counter). torch runs global post-step hooks after every ``torch.optim.Optimizer.step``
on every rank, so one such hook marks each model whose params the optimizer holds: a rank-consistent
"stepped" flag, cleared by ``install_optimized_model_weights()``.
"""

from __future__ import annotations

import functools
import weakref
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
    for ref in _models_of(optimizer):
        model = ref()
        if model is not None:
            model.mark_stepped()


_MODELS: weakref.WeakKeyDictionary[Optimizer, tuple[tuple[int, ...], list[weakref.ref[Steppable]]]] = (
    weakref.WeakKeyDictionary()
)
"""Per optimizer: its params' identities when last looked at, and (weakly) the models they belong to."""


def _models_of(optimizer: Optimizer) -> list[weakref.ref[Steppable]]:
    """The models whose params ``optimizer`` holds, walked again only when its params change (this runs
    after every step: comparing identities costs a tuple, reading attributes a lookup per param)."""
    identities = tuple(id(param) for group in optimizer.param_groups for param in group["params"])
    cached = _MODELS.get(optimizer)
    if cached is not None and cached[0] == identities:
        return cached[1]
    models: dict[int, Steppable] = {}
    for group in optimizer.param_groups:
        for param in group["params"]:
            model = getattr(param, OWNER, None)
            if model is not None:
                models.setdefault(id(model), model)
    refs = [weakref.ref(model) for model in models.values()]
    _MODELS[optimizer] = (identities, refs)
    return refs
